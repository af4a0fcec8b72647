"""CPU inference with ``attn_implementation="flex_attention"`` against ``sdpa`` (hf_relpos' fused CPU kernels), as
time ratios flex / sdpa in one run.

For each scheme FlexAttention serves (one per score form, and the rest on request), a causal forward of a padded
batch with no gradient, at each length. The two backends are timed on the same model, interleaved A B A B, as
medians after warm-up; FlexAttention's first call (its compile) is reported apart. Absolute times are this
machine's; the ratios are what to read. On a GPU, FlexAttention is meant to run against SDPA with a dense bias:
``tests/test_flex_attention.py`` has the gradient check; no GPU timing comes from this script.

    python scripts/bench_flex.py                                 # about 3 minutes on 2 CPU cores
    python scripts/bench_flex.py --lengths 256 --schemes t5_bias fox --output results/bench-flex-cpu.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_relpos import RelPosConfig, RelPosForCausalLM  # noqa: E402

SIZE = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, num_hidden_layers=2, intermediate_size=512)


def timed(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(scheme: str, length: int, batch: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = RelPosForCausalLM(RelPosConfig(position_encoding=scheme, max_position_embeddings=max(length, 64), **SIZE))
    model.eval()
    ids = torch.randint(0, SIZE["vocab_size"], (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1:, : length // 8] = 0  # left padding in every row but the first

    def run(impl):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            return model(ids, attention_mask=mask).logits

    start = time.perf_counter()
    flex_logits = run("flex_attention")
    first = time.perf_counter() - start
    difference = (flex_logits - run("sdpa"))[mask.bool()].abs().max().item()
    times = {"sdpa": [], "flex_attention": []}
    for _ in range(repeats):
        for impl in times:
            times[impl].append(timed(lambda: run(impl), 1))
    sdpa, flex = statistics.median(times["sdpa"]), statistics.median(times["flex_attention"])
    return dict(scheme=scheme, length=length, sdpa=sdpa, flex=flex, ratio=flex / sdpa, first=first,
                difference=difference)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", default=["t5_bias", "alibi", "kerple_log", "fox", "rope"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, help="also write the table (Markdown) here")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    lines = [
        f"`python scripts/bench_flex.py {' '.join(argv if argv is not None else sys.argv[1:])}`".replace(" `", "`"),
        "",
        f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, batch {args.batch}, causal, left padding, no gradient; medians of "
        f"{args.repeats} interleaved runs",
        "",
        "| scheme | n | sdpa (s) | flex (s) | flex / sdpa | flex's first call (s) | max abs diff |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    print("\n".join(lines), flush=True)
    for length in args.lengths:
        for scheme in args.schemes:
            r = bench(scheme, length, args.batch, args.repeats)
            line = (f"| {r['scheme']} | {r['length']} | {r['sdpa']:.4f} | {r['flex']:.4f} | {r['ratio']:.2f} | "
                    f"{r['first']:.1f} | {r['difference']:.1e} |")
            print(line, flush=True)
            lines.append(line)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
