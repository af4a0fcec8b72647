"""What denormals cost the fused CPU kernel with a decaying bias, and what flushing them buys
(``hf_relpos/denormals_relpos.py``): causal ALiBi's per-key path (``kernels_relpos.causal_key_bias``) and plain
causal SDPA (no bias, the floor), forward + backward, with denormals flushed on every intra-op thread and without,
interleaved in one process, medians.

    python scripts/bench_denormals.py                  # n = 2048, batch 2, 8 heads of 64: results/bench-cpu-denormals.md
    python scripts/bench_denormals.py --lengths 1024 4096 --output /tmp/denormals.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import machine_line, write_report  # noqa: E402

from hf_relpos import denormals_relpos, kernels_relpos  # noqa: E402
from hf_relpos.functional import alibi_slopes  # noqa: E402


def contenders(batch: int, heads: int, n: int, head_dim: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=g, requires_grad=True) for _ in range(3))
    key_bias = alibi_slopes(heads).double()[:, None] * torch.arange(n, dtype=torch.float64)  # ALiBi per key: m·j

    def alibi():
        kernels_relpos.causal_key_bias(q, k, v, key_bias).sum().backward()

    def floor():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return {"ALiBi, per-key kernel": alibi, "no bias (SDPA, is_causal)": floor}


def timed(step, flush: bool) -> float:
    real = denormals_relpos._runtime
    if not flush:
        denormals_relpos._runtime = lambda: None  # flush_denormals() a no-op
    try:
        start = time.perf_counter()
        step()
        return time.perf_counter() - start
    finally:
        denormals_relpos._runtime = real


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default="results/bench-cpu-denormals.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not denormals_relpos.supported():
        sys.exit("bench_denormals: this machine cannot flush denormals per thread (denormals_relpos.supported())")
    lines = ["# Denormals in the fused CPU kernel", "",
             f"Command: `{' '.join(['python', 'scripts/bench_denormals.py', *(sys.argv[1:] if argv is None else argv)])}`  ",
             f"{machine_line(args.threads)}; batch {args.batch}, {args.heads} heads of {args.head_dim}, causal, "
             f"forward + backward; medians of {args.repeats} interleaved runs after a warm-up.", "",
             "| n | step | denormals kept (ms) | flushed (ms) | kept / flushed | vs no bias, kept | vs no bias, flushed |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for n in args.lengths:
        steps = contenders(args.batch, args.heads, n, args.head_dim)
        times = {(name, flush): [] for name in steps for flush in (False, True)}
        for repeat in range(args.repeats + 1):  # the first round is a warm-up
            for name, step in steps.items():
                for flush in (False, True):
                    elapsed = timed(step, flush)
                    if repeat:
                        times[(name, flush)].append(elapsed)
        median = {key: 1e3 * statistics.median(value) for key, value in times.items()}
        floor = {flush: median[("no bias (SDPA, is_causal)", flush)] for flush in (False, True)}
        for name in steps:
            kept, flushed = median[(name, False)], median[(name, True)]
            lines.append(f"| {n} | {name} | {kept:.1f} | {flushed:.1f} | {kept / flushed:.2f} | "
                         f"{kept / floor[False]:.2f} | {flushed / floor[True]:.2f} |")
        print(lines[-2], lines[-1], sep="\n", flush=True)
    write_report(lines, args.output)


if __name__ == "__main__":
    main()
