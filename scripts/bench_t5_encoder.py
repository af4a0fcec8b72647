"""Upstream ``T5EncoderModel`` of t5-small's shape against its ``hf_relpos.from_t5`` conversion (``RelPosModel``,
the same weights, ``attention_scale=1.0``) on this machine's CPU: inference forward at each length, batch 2, the two
interleaved A B A B in one process (median per model and the median of the per-pair ratios), and the peak
resident memory of a forward, each model in a process of its own. Writes a Markdown table with the command, date,
versions and machine.

    python scripts/bench_t5_encoder.py                         # 512 and 2,048 tokens: about 3 minutes on 2 cores
    python scripts/bench_t5_encoder.py --lengths 512 --repeats 3 --output /tmp/t5-encoder.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# t5-small (and its encoder): d_model 512, d_kv 64, 8 heads, 6 layers, d_ff 2048, ReLU, 32 buckets up to 128
T5_SMALL = dict(vocab_size=32128, d_model=512, d_kv=64, num_heads=8, num_layers=6, d_ff=2048, dropout_rate=0.0,
                relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="relu")
NAMES = ("upstream T5EncoderModel", "hf_relpos (from_t5)")


def build_pair():
    """The upstream encoder (random weights, seed 0, sdpa as Transformers loads it) and its conversion."""
    from transformers import T5Config, T5EncoderModel

    from hf_relpos import from_t5

    torch.manual_seed(0)
    upstream = T5EncoderModel(T5Config(**T5_SMALL)).eval()
    return upstream, from_t5(upstream).eval()


def inputs(batch: int, length: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, T5_SMALL["vocab_size"], (batch, length), generator=generator)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def forward(model, batch_inputs) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model(**batch_inputs)
    return time.perf_counter() - start


def timing(models, length: int, batch: int, repeats: int) -> dict:
    """Median seconds per model and the median of the per-pair ratios (hf_relpos / upstream), after one warm-up."""
    batch_inputs = inputs(batch, length)
    for model in models:
        forward(model, batch_inputs)
    times = {name: [] for name in NAMES}
    for _ in range(repeats):
        for name, model in zip(NAMES, models):
            times[name].append(forward(model, batch_inputs))
    ratios = [ours / theirs for theirs, ours in zip(times[NAMES[0]], times[NAMES[1]])]
    return {"median": {name: statistics.median(values) for name, values in times.items()},
            "ratio": statistics.median(ratios), "ratio_range": (min(ratios), max(ratios))}


def _status_mib(field: str) -> float:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def peak_memory_child(which: int, length: int, batch: int) -> None:
    """In a child process: build both (the same weights), drop the other, reset the peak (Linux' clear_refs 5) and
    print what the forward adds to the resident memory at its peak."""
    import gc

    model = build_pair()[which]
    batch_inputs = inputs(batch, length)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_mib("VmRSS")
    forward(model, batch_inputs)
    print(_status_mib("VmHWM") - before)


def peak_memory(which: int, length: int, batch: int, threads: int) -> float:
    """MiB the forward adds to the process' peak RSS (each model and length in a fresh process)."""
    command = [sys.executable, __file__, "--child", str(which), str(length), str(batch), "--threads", str(threads)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default="results/bench-cpu-t5-encoder.md")
    parser.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        peak_memory_child(*args.child)
        return
    import transformers

    models = build_pair()
    rows = []
    for length in args.lengths:
        timed = timing(models, length, args.batch, args.repeats)
        memory = [peak_memory(which, length, args.batch, args.threads) for which in (0, 1)]
        low, high = timed["ratio_range"]
        rows.append(f"| {length} | {timed['median'][NAMES[0]] * 1e3:.0f} | {timed['median'][NAMES[1]] * 1e3:.0f} | "
                    f"**{timed['ratio']:.2f}** ({low:.2f}-{high:.2f}) | {memory[0]:.0f} | {memory[1]:.0f} | "
                    f"**{memory[1] / memory[0]:.2f}** |")
        print(rows[-1], flush=True)
    load = os.getloadavg()[0]
    report = [
        "# T5EncoderModel (t5-small's shape) against its conversion, CPU",
        "",
        f"`python {' '.join(['scripts/bench_t5_encoder.py'] + sys.argv[1:])}` on {time.strftime('%Y-%m-%d')}: "
        f"torch {torch.__version__}, transformers {transformers.__version__}, {platform.processor() or platform.machine()}"
        f" with {os.cpu_count()} CPUs, {args.threads} threads, load average {load:.1f} at the end. Random weights "
        f"(seed 0), batch {args.batch}, every token real, inference forward (`torch.no_grad`, eval), sdpa both. "
        f"Times: medians of {args.repeats} interleaved repeats after a warm-up; the ratio is the median of the "
        "per-pair ratios (range in brackets), below 1 when the conversion is faster. Memory: what one forward adds "
        "to the resident memory at its peak (VmHWM reset before it), in a fresh process holding that model alone.",
        "",
        "| tokens | upstream ms | hf_relpos ms | time ratio | upstream MiB | hf_relpos MiB | memory ratio |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
    ]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("\n".join(report))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
