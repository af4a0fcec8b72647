"""The band decomposition alone (``kernels_relpos.shaw_banded`` / ``kernels_relpos.saturating_bias_banded``) against
the form it replaces, by length.

``shaw_attention`` (Shaw's clipped embeddings) and ``saturating_bias_attention`` (T5's bucketed bias)
switch to the band decomposition at ``kernels_relpos.SHAW_BAND_MIN_LENGTH`` /
``kernels_relpos.BIAS_BAND_MIN_LENGTH`` (causal: ``kernels_relpos.CAUSAL_BIAS_BAND_MIN_LENGTH``); this script calls each path directly and measures where the band
pays. Per length, three contenders run interleaved in one process
(forward, then forward+backward), medians after a warm-up, as ratios to plain SDPA
(``F.scaled_dot_product_attention`` without any position term, causal when the scheme is):

- shaw: the band against the gathered ``[B, H, n, 2k+1]`` form;
- t5_bias: the band against the bias spread over ``[1, H, n, n]`` in the fused kernel
  (``distance_bias_attention``, what the model runs below the threshold).

    python scripts/bench_band.py --scheme shaw             # k = 16; each run about a minute on 2 CPU cores
    python scripts/bench_band.py --scheme t5_bias           # 32 buckets, max distance 128 (band |d| < 91)
    python scripts/bench_band.py --scheme t5_bias --causal  # the decoder's bias (band d > -113)
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

from hf_relpos import functional, kernels_relpos  # noqa: E402

# Where functional_relpos.py switches to the band: (bidirectional, causal).
THRESHOLD = {"shaw": (kernels_relpos.SHAW_BAND_MIN_LENGTH,) * 2,
             "t5_bias": (kernels_relpos.BIAS_BAND_MIN_LENGTH, kernels_relpos.CAUSAL_BIAS_BAND_MIN_LENGTH)}


def spread_bias_attention(q, k, v, table, causal):
    """``saturating_bias_attention`` below its threshold: the bias spread over ``[1, H, n, n]`` in the fused kernel,
    its gradient folded per distance (``kernels_relpos.distance_bias_attention``)."""
    n = q.shape[2]
    mask = None
    if causal:
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        mask = torch.zeros(n, n).masked_fill(j > i, float("-inf"))
    return kernels_relpos.distance_bias_attention(q, k, v, table, q.shape[-1] ** -0.5, mask=mask)


def contenders(scheme, q, k, v, table, clip, causal):
    def plain():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    if scheme == "shaw":
        rel_k, rel_v = table
        band = lambda: kernels_relpos.shaw_banded(  # noqa: E731
            q, k, v, rel_k, rel_v, max_relative_position=clip, is_causal=causal
        )
        # need_weights takes the gathered form (which forms the probabilities either way)
        other, run = "gathered", lambda: functional.shaw_attention(  # noqa: E731
            q, k, v, rel_k, rel_v, max_relative_position=clip, is_causal=causal, need_weights=True
        )[0]
    else:
        band = lambda: kernels_relpos.saturating_bias_banded(q, k, v, table(), is_causal=causal)  # noqa: E731
        other, run = "bias [1, H, n, n]", lambda: spread_bias_attention(q, k, v, table(), causal)  # noqa: E731
    return {"plain SDPA": plain, "band": band, other: run}


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
    parser.add_argument("--scheme", choices=sorted(THRESHOLD), default="shaw")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--clip", type=int, default=16, help="shaw: max_relative_position k")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", help="default: results/bench-band-<scheme>[-causal].md")
    args = parser.parse_args()
    output = args.output or f"results/bench-band-{args.scheme}{'-causal' if args.causal else ''}.md"
    torch.set_num_threads(args.threads)
    from tqdm.auto import tqdm

    rows, names = [], None
    for n in tqdm(args.lengths, desc="lengths"):
        torch.manual_seed(0)
        q, k, v = (torch.randn(args.batch, args.heads, n, args.head_dim, requires_grad=True) for _ in range(3))
        if args.scheme == "shaw":
            table = tuple(torch.randn(2 * args.clip + 1, args.head_dim, requires_grad=True) for _ in range(2))
        else:
            weight = torch.randn(32, args.heads, requires_grad=True)
            table = lambda: functional.t5_bias_by_distance(weight, bidirectional=not args.causal)  # noqa: E731
        fns = contenders(args.scheme, q, k, v, table, args.clip, args.causal)
        names = list(fns)[1:]
        ratios = []
        for backward in (False, True):
            for fn in fns.values():  # warm-up
                timed(fn, backward)
            times = {name: [] for name in fns}
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    times[name].append(timed(fn, backward))
            med = {name: statistics.median(t) for name, t in times.items()}
            ratios += [med[name] / med["plain SDPA"] for name in names]
        rows.append((n, *ratios))
    what = f"k = {args.clip}" if args.scheme == "shaw" else "32 buckets, max distance 128"
    lines = [
        f"# {args.scheme}: band decomposition vs {names[1]}",
        "",
        f"Command: `python scripts/bench_band.py {' '.join(sys.argv[1:])}`  ",
        f"{machine_line(args.threads)}; batch {args.batch}, {args.heads} heads, head dim {args.head_dim}, "
        f"{what}, {'causal' if args.causal else 'bidirectional'}, fp32; medians of {args.repeats} interleaved runs "
        f"after a warm-up. The band is taken from n >= {THRESHOLD[args.scheme][int(args.causal)]}.",
        "",
        "Time as a ratio to plain SDPA (no position term) at the same length; lower is faster.",
        "",
        f"| n | band fwd | {names[1]} fwd | band fwd+bwd | {names[1]} fwd+bwd |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {n} | {bf:.2f} | {gf:.2f} | {bb:.2f} | {gb:.2f} |" for n, bf, gf, bb, gb in rows]
    write_report(lines, output)


if __name__ == "__main__":
    main()
