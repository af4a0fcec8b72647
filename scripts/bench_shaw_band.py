"""Shaw attention alone: the band decomposition against the gathered form and plain SDPA, by length.

``functional.shaw_attention`` switches from the gathered ``[B, H, n, n]`` form to the band
decomposition at ``_SHAW_BAND_MIN_LENGTH``; this script measures where that pays. Per length, the
three contenders run interleaved in one process (forward, then forward+backward), medians after a
warm-up, as ratios to plain SDPA (``F.scaled_dot_product_attention`` without any position term).

    python scripts/bench_shaw_band.py            # batch 2, 8 heads, head dim 64, k = 16; 1-2 minutes on 2 CPU cores
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

from hf_relpos import functional  # noqa: E402


def contenders(q, k, v, rel_k, rel_v, clip):
    def plain():
        return F.scaled_dot_product_attention(q, k, v)

    def band():
        saved, functional._SHAW_BAND_MIN_LENGTH = functional._SHAW_BAND_MIN_LENGTH, 1
        try:
            return functional.shaw_attention(q, k, v, rel_k, rel_v, max_relative_position=clip)
        finally:
            functional._SHAW_BAND_MIN_LENGTH = saved

    def gathered():
        saved, functional._SHAW_BAND_MIN_LENGTH = functional._SHAW_BAND_MIN_LENGTH, 10**9
        try:
            return functional.shaw_attention(q, k, v, rel_k, rel_v, max_relative_position=clip)
        finally:
            functional._SHAW_BAND_MIN_LENGTH = saved

    return {"plain SDPA": plain, "band": band, "gathered": gathered}


def timed(fn, backward: bool) -> float:
    start = time.perf_counter()
    if backward:
        fn().sum().backward()
    else:
        with torch.no_grad():
            fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--clip", type=int, default=16, help="max_relative_position k")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default="results/bench-shaw-band.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tqdm.auto import tqdm

    rows = []
    for n in tqdm(args.lengths, desc="lengths"):
        torch.manual_seed(0)
        q, k, v = (torch.randn(args.batch, args.heads, n, args.head_dim, requires_grad=True) for _ in range(3))
        rel_k, rel_v = (torch.randn(2 * args.clip + 1, args.head_dim, requires_grad=True) for _ in range(2))
        fns = contenders(q, k, v, rel_k, rel_v, args.clip)
        ratios = []
        for backward in (False, True):
            for fn in fns.values():  # warm-up
                timed(fn, backward)
            times = {name: [] for name in fns}
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    times[name].append(timed(fn, backward))
            med = {name: statistics.median(t) for name, t in times.items()}
            ratios += [med["band"] / med["plain SDPA"], med["gathered"] / med["plain SDPA"]]
        rows.append((n, *ratios))
    lines = [
        "# Shaw attention: band decomposition vs gathered form",
        "",
        f"Command: `python scripts/bench_shaw_band.py {' '.join(sys.argv[1:])}`  ",
        f"{machine_line(args.threads)}; batch {args.batch}, {args.heads} heads, head dim {args.head_dim}, "
        f"k = {args.clip}, bidirectional, fp32; medians of {args.repeats} interleaved runs after a warm-up. "
        f"`shaw_attention` switches to the band at n >= {functional._SHAW_BAND_MIN_LENGTH}.",
        "",
        "Time as a ratio to plain SDPA (no position term) at the same length; lower is faster.",
        "",
        "| n | band fwd | gathered fwd | band fwd+bwd | gathered fwd+bwd |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {n} | {bf:.2f} | {gf:.2f} | {bb:.2f} | {gb:.2f} |" for n, bf, gf, bb, gb in rows]
    write_report(lines, args.output)


if __name__ == "__main__":
    main()
