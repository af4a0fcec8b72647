"""Where a padded batch pays to be split by its rows' runs of keys (``bias_kernels_relpos.RUNS_MIN_LENGTH``).

Bidirectional T5 attention (``functional.saturating_bias_attention``, 32 buckets up to 128) forward + backward with
the table's gradient, on a padded batch whose rows keep runs of different lengths: one call per run of keys, each
over its keys alone with no mask (``_by_runs``), against one call with the merged ``[B, H, n, n]`` mask. Ratios of
medians in one process, interleaved, written to results/bench-runs.md.

    python scripts/bench_runs.py [--lengths 128 256 512 1024] [--batches 8 32] [--repeats 5] [--output F]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import machine_line, write_report  # noqa: E402

from hf_relpos import bias_kernels_relpos as BK  # noqa: E402
from hf_relpos import functional as F  # noqa: E402


def padded(batch: int, n: int, every_row: bool) -> torch.Tensor:
    """Bool ``[B, 1, 1, n]``: each row a length of its own (every_row), or the last row's final quarter padded."""
    keep = torch.ones(batch, n, dtype=torch.bool)
    for b in range(batch) if every_row else [batch - 1]:
        keep[b, n - 1 - (b * 7) % (n // 2) if every_row else n - n // 4:] = False
    return keep[:, None, None, :]


def step(q, k, v, table, mask, min_length: int) -> None:
    BK.RUNS_MIN_LENGTH = min_length
    F.saturating_bias_attention(q, k, v, table, attention_mask=mask).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default="results/bench-runs.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = torch.randn(32, 8)
    table = F.t5_bias_by_distance(weight, bidirectional=True, max_distance=128).detach().requires_grad_()
    lines = [
        "# A padded batch by its rows' runs of keys against the merged mask", "",
        f"Command: `{' '.join(['python scripts/bench_runs.py', *sys.argv[1:]])}`  ",
        f"{machine_line(args.threads)}; bidirectional T5 attention (32 buckets up to 128), 8 heads, head dim 64, "
        f"forward + backward with the table's gradient; medians of {args.repeats} interleaved runs after a warm-up.",
        "", "Time of one call per run of keys (`bias_kernels_relpos._by_runs`) / one call with the merged mask: "
        "below 1 the runs pay. *A length per row*: each row padded to its own length; *last row's quarter*: "
        "the other rows full (two runs).", "",
        "| batch | n | padding | by runs / merged mask |", "| ---: | ---: | --- | ---: |",
    ]
    for batch in args.batches:
        for n in args.lengths:
            q, k, v = (torch.randn(batch, 8, n, 64, requires_grad=True) for _ in range(3))
            for every_row in (True, False):
                mask = padded(batch, n, every_row)
                times = {0: [], n + 1: []}
                for _ in range(args.repeats + 1):  # the first round warms up
                    for min_length in times:
                        start = time.perf_counter()
                        step(q, k, v, table, mask, min_length)
                        times[min_length].append(time.perf_counter() - start)
                ratio = statistics.median(times[0][1:]) / statistics.median(times[n + 1][1:])
                kind = "a length per row" if every_row else "last row's quarter"
                lines.append(f"| {batch} | {n} | {kind} | {ratio:.2f} |")
                print(lines[-1], flush=True)
    write_report(lines, args.output)


if __name__ == "__main__":
    main()
