"""Speed and memory of every hf_relpos scheme against upstream T5 and against plain attention (rope).

Forward and forward+backward, bidirectional (as T5's encoder) and causal (the decoder use, with a
cached prefill besides), at several lengths, contenders interleaved A B A B in one process, medians
after warm-up; peak memory per contender in a process of its own; cached decoding tokens/s. Writes
a Markdown table with the command, date, torch version and machine.

    python scripts/bench.py                       # the full run (about 20 minutes on 2 CPU cores)
    python scripts/bench.py --quick               # about 3 minutes: n=512, fewer repeats
    python scripts/bench.py --padded --lengths 2048 --causal-lengths 2048 --no-decode \
        --output results/bench-cpu-padded.md      # a padded batch (about 6 minutes)
    python scripts/bench.py --compiled-only --output results/bench-cpu-compiled.md   # compiled decoding
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SCHEMES = ["rope", "t5_bias", "shaw", "transformer_xl", "log_decay", "alibi", "sinusoidal", "learned"]
UPSTREAM = "upstream_t5"
SIZE = dict(hidden_size=512, num_attention_heads=8, num_hidden_layers=2, intermediate_size=2048)


def build(name: str, causal: bool = False, head: bool = False):
    """A contender: an hf_relpos body, causal or not (with the LM head: ``head``), or upstream T5EncoderModel."""
    torch.manual_seed(0)
    if name == UPSTREAM:
        from transformers import T5Config, T5EncoderModel

        config = T5Config(
            vocab_size=1024, d_model=512, d_kv=64, num_heads=8, num_layers=2, d_ff=2048, dropout_rate=0.0,
            relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="relu",
        )
        return T5EncoderModel(config).train()
    from hf_relpos import RelPosConfig, RelPosForCausalLM, RelPosModel

    config = RelPosConfig(
        position_encoding=name, vocab_size=1024, max_position_embeddings=8192, is_decoder=causal, **SIZE
    )
    return (RelPosForCausalLM(config) if head else RelPosModel(config)).train()


def step(model, ids, mode: str, mask=None) -> None:
    """One forward+backward ("fwd+bwd"), inference forward ("fwd") or forward that fills a cache ("prefill")."""
    if mode == "fwd+bwd":
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=mode == "prefill")


def padding(batch: int, n: int):
    """A padded batch: the last row's final quarter is padding (the others are full)."""
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[-1, n - n // 4:] = 0
    return mask


def time_interleaved(names, n, batch, repeats, mode, causal=False, padded=False) -> dict:
    models = {name: build(name, causal) for name in names}
    ids = torch.randint(0, 1024, (batch, n))
    mask = padding(batch, n) if padded else None
    for model in models.values():  # warm-up
        step(model, ids, mode, mask)
    times = {name: [] for name in names}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            step(model, ids, mode, mask)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _high_water_mib() -> float:
    """This process's peak resident set (VmHWM). Unlike ru_maxrss, it starts afresh at exec, so the
    parent's peak does not leak into the child's reading."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory_child(name: str, n: int, batch: int) -> None:
    """Runs in its own process: prints the peak resident set of one fwd+bwd step (MiB)."""
    model = build(name)
    ids = torch.randint(0, 1024, (batch, n))
    base = _high_water_mib()
    step(model, ids, "fwd+bwd")
    peak = _high_water_mib()
    print(json.dumps({"peak_mib": peak, "delta_mib": peak - base}))


def peak_memory(name: str, n: int, batch: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child-memory", name, str(n), str(batch)],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@torch.no_grad()
def decode_tokens_per_second(names, context: int, new_tokens: int, repeats: int) -> dict:
    """Greedy cached decoding after a prefill of ``context`` tokens, contenders interleaved."""
    models = {name: build(name, causal=True, head=True).eval() for name in names}
    ids = torch.randint(0, 1024, (1, context))
    rates = {name: [] for name in names}
    for repeat in range(repeats + 1):  # the first round is a warm-up
        for name, model in models.items():
            out = model(input_ids=ids, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for _ in range(new_tokens):
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
            if repeat:
                rates[name].append(new_tokens / (time.perf_counter() - start))
    return {name: statistics.median(r) for name, r in rates.items()}


@torch.no_grad()
def compiled_decoding(names, context: int, new_tokens: int, repeats: int) -> dict:
    """Greedy decoding into a StaticCache after an eager prefill of ``context`` tokens: tokens/s of the eager
    step and of the same step compiled (inductor, ``fullgraph=True``), interleaved; the compile time of the
    first compiled run; and whether both give the same tokens."""
    from tqdm.auto import tqdm
    from transformers import StaticCache

    ids = torch.randint(0, 1024, (1, context))
    result = {}
    for name in tqdm(names, desc=f"compiled decoding, context {context}"):
        torch._dynamo.reset()
        model = build(name, causal=True, head=True).eval()
        cache = StaticCache(config=model.config, max_cache_len=context + new_tokens)

        def eager(token):
            return model(input_ids=token, past_key_values=cache, use_cache=True).logits

        compiled = torch.compile(eager, fullgraph=True)

        def run(step):
            cache.reset()
            token = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            tokens, start = [], time.perf_counter()
            for _ in range(new_tokens):
                token = step(token)[:, -1:].argmax(-1)
                tokens.append(token)
            return new_tokens / (time.perf_counter() - start), torch.cat(tokens, dim=1)

        start = time.perf_counter()
        run(compiled)  # compiles
        compile_s = time.perf_counter() - start
        rates, tokens = {"eager": [], "compiled": []}, {}
        for repeat in range(repeats + 1):  # the first round is a warm-up
            for kind, step in (("eager", eager), ("compiled", compiled)):
                rate, tokens[kind] = run(step)
                if repeat:
                    rates[kind].append(rate)
        result[name] = dict(eager=statistics.median(rates["eager"]), compiled=statistics.median(rates["compiled"]),
                            compile_s=compile_s, same_tokens=torch.equal(tokens["eager"], tokens["compiled"]))
    return result


def machine_line(threads: int) -> str:
    """Date, torch version and machine, for the header of a results file."""
    return (f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}; "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {threads} threads")


def write_report(lines: list, output: str) -> None:
    text = "\n".join(lines) + "\n"
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--causal-lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--schemes", nargs="+", default=SCHEMES, choices=SCHEMES)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="n=512, contexts 256/1024, 3 repeats")
    parser.add_argument("--output", default="results/bench-cpu.md")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-process peak memory runs")
    parser.add_argument("--no-decode", action="store_true", help="skip the cached decoding runs")
    parser.add_argument("--compiled-only", action="store_true", help="only the compiled-decoding table")
    parser.add_argument("--compiled-context", type=int, default=1024,
                        help="context of the compiled-decoding runs (0: skip them)")
    parser.add_argument("--padded", action="store_true",
                        help="time a padded batch (the last row's final quarter is padding); implies --no-memory")
    parser.add_argument("--child-memory", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child_memory:
        name, n, batch = args.child_memory
        return peak_memory_child(name, int(n), int(batch))
    if args.quick:
        args.lengths, args.causal_lengths, args.contexts, args.repeats = [512], [512], [256, 1024], 3
    if args.compiled_only:
        args.lengths, args.causal_lengths, args.contexts, args.no_memory = [], [], [], True

    from tqdm.auto import tqdm

    schemes = ["rope"] + [s for s in args.schemes if s != "rope"]
    contenders = schemes + ([UPSTREAM] if "t5_bias" in schemes else [])
    rows = {}
    jobs = [(n, mode) for n in args.lengths for mode in ("fwd", "fwd+bwd")]
    for n, mode in tqdm(jobs, desc="bidirectional"):
        rows[(n, mode)] = time_interleaved(contenders, n, args.batch, args.repeats, mode, padded=args.padded)
    causal_rows = {}
    jobs = [(n, mode) for n in args.causal_lengths for mode in ("fwd", "fwd+bwd", "prefill")]
    for n, mode in tqdm(jobs, desc="causal"):
        causal_rows[(n, mode)] = time_interleaved(schemes, n, args.batch, args.repeats, mode, causal=True,
                                                  padded=args.padded)
    memory = {}
    if not (args.no_memory or args.padded):
        for n in tqdm(args.lengths, desc="peak memory"):
            for name in contenders:
                memory[(name, n)] = peak_memory(name, n, args.batch)
    decode = {}
    for context in tqdm([] if args.no_decode else args.contexts, desc="decoding"):
        for name, rate in decode_tokens_per_second(schemes, context, args.new_tokens, args.repeats).items():
            decode[(name, context)] = rate
    compiled = {}
    if not args.no_decode and args.compiled_context:
        compiled = compiled_decoding(schemes, args.compiled_context, args.new_tokens, args.repeats)

    lines = [
        "# CPU benchmark",
        "",
        f"Command: `python scripts/bench.py {' '.join(sys.argv[1:])}`  ",
        f"{machine_line(args.threads)}; batch {args.batch}, hidden 512, 8 heads, 2 layers, intermediate 2048, fp32; "
        f"medians of {args.repeats} interleaved runs after a warm-up."
        + (" **Padded batch**: the last row's final quarter is padding (attention_mask)." if args.padded else ""),
        "",
        "Times are ratios: **vs rope** = this scheme's time / rope's (plain fused SDPA, the floor); "
        "**vs upstream** = t5_bias's time / `transformers.T5EncoderModel`'s (same size and buckets). "
        "Lower is faster. Absolute times on this shared CPU are not meaningful.",
        "",
    ]
    for n in args.lengths:
        lines += [f"## Bidirectional (as T5's encoder), n = {n}", "", "| scheme | fwd vs rope | fwd+bwd vs rope | fwd vs upstream T5 | fwd+bwd vs upstream T5 | peak MiB (fwd+bwd) | of which the step |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        fwd, bwd = rows[(n, "fwd")], rows[(n, "fwd+bwd")]
        for name in contenders:
            versus_t5 = name == "t5_bias" and UPSTREAM in fwd
            mem = memory.get((name, n))
            cells = [
                name,
                f"{fwd[name] / fwd['rope']:.2f}",
                f"{bwd[name] / bwd['rope']:.2f}",
                f"{fwd[name] / fwd[UPSTREAM]:.2f}" if versus_t5 else "",
                f"{bwd[name] / bwd[UPSTREAM]:.2f}" if versus_t5 else "",
                f"{mem['peak_mib']:.0f}" if mem else "–",
                f"{mem['delta_mib']:.0f}" if mem else "–",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    for n in args.causal_lengths:
        lines += [f"## Causal, n = {n}", "",
                  "The decoder use (`is_decoder=True`): time as a ratio to causal rope's; *prefill* is an inference "
                  "forward that fills a `DynamicCache`.", "",
                  "| scheme | fwd vs rope | fwd+bwd vs rope | prefill with cache vs rope |", "| --- | ---: | ---: | ---: |"]
        got = [causal_rows[(n, mode)] for mode in ("fwd", "fwd+bwd", "prefill")]
        for name in schemes:
            lines.append(f"| {name} | " + " | ".join(f"{t[name] / t['rope']:.2f}" for t in got) + " |")
        lines.append("")
    if decode:
        lines += ["## Cached decoding", "",
                  f"Tokens/s generating {args.new_tokens} tokens (batch 1, greedy, causal model) after a context, as a "
                  "ratio to rope's tokens/s (higher is faster).", "",
                  "| scheme | " + " | ".join(f"context {c}" for c in args.contexts) + " |",
                  "| --- | " + " | ".join("---:" for _ in args.contexts) + " |"]
        for name in schemes:
            lines.append(f"| {name} | " + " | ".join(
                f"{decode[(name, c)] / decode[('rope', c)]:.2f}" for c in args.contexts) + " |")
        lines.append("")
    if compiled:
        lines += ["## Compiled decoding", "",
                  f"Greedy decoding of {args.new_tokens} tokens into a `StaticCache` after an eager prefill of "
                  f"{args.compiled_context} tokens (batch 1): one decode step compiled with `torch.compile(fullgraph=True)` "
                  "(inductor) against the same step in eager mode. *compiled vs eager*: tokens/s ratio (higher is "
                  "faster); *vs rope compiled*: this scheme's compiled tokens/s over rope's; *same tokens*: the "
                  "compiled and eager greedy tokens agree.", "",
                  "| scheme | compiled vs eager | vs rope compiled | compile time s | same tokens |",
                  "| --- | ---: | ---: | ---: | :---: |"]
        for name in schemes:
            got = compiled[name]
            lines.append(f"| {name} | {got['compiled'] / got['eager']:.2f} | "
                         f"{got['compiled'] / compiled['rope']['compiled']:.2f} | {got['compile_s']:.0f} | "
                         f"{'yes' if got['same_tokens'] else '**no**'} |")
    write_report(lines, args.output)


if __name__ == "__main__":
    main()
