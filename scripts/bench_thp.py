"""Effect of PyTorch's transparent-huge-page allocator switch (``THP_MEM_ALLOC_ENABLE=1``) on CPU steps.

Fresh ``[batch, heads, n, n]`` tensors cost mostly page faults on this CPU. With
``THP_MEM_ALLOC_ENABLE=1`` PyTorch's CPU allocator aligns large allocations to 2 MiB and asks the
kernel for huge pages (``madvise``), so one fault maps 2 MiB instead of 4 KiB. The switch is read
when the allocator starts, so each measurement runs in a child process: per contender, children
alternate without and with the switch (A B A B ...), each reporting the median forward+backward
step time after a warm-up; the table gives the ratio with / without (below 1: the switch helps).

    python scripts/bench_thp.py                  # n=2048, the contenders of scripts/bench.py that matter;
                                                 # about 30 minutes on 2 CPU cores (3 pairs of child processes per contender)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import UPSTREAM, build, machine_line, step, write_report  # noqa: E402

CONTENDERS = ["rope", "t5_bias", UPSTREAM, "shaw", "transformer_xl", "alibi"]


def child(name: str, n: int, batch: int, repeats: int) -> None:
    model = build(name)
    ids = torch.randint(0, 1024, (batch, n))
    step(model, ids, backward=True)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(model, ids, backward=True)
        times.append(time.perf_counter() - start)
    print(json.dumps({"median_s": statistics.median(times)}))


def run_child(name: str, n: int, batch: int, repeats: int, threads: int, thp: bool) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "THP_MEM_ALLOC_ENABLE": "1" if thp else "0"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, str(n), str(batch), str(repeats), "--threads", str(threads)],
        capture_output=True, text=True, check=True, env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["median_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per child process")
    parser.add_argument("--rounds", type=int, default=3, help="child pairs (without, with) per contender")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS)
    parser.add_argument("--output", default="results/bench-cpu-thp.md")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        name, n, batch, repeats = args.child
        return child(name, int(n), int(batch), int(repeats))

    from tqdm.auto import tqdm

    results = {}
    for name in tqdm(args.contenders, desc="contenders"):
        without, with_thp = [], []
        for _ in range(args.rounds):
            without.append(run_child(name, args.length, args.batch, args.repeats, args.threads, thp=False))
            with_thp.append(run_child(name, args.length, args.batch, args.repeats, args.threads, thp=True))
        results[name] = statistics.median(with_thp) / statistics.median(without)
    thp_mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    lines = [
        "# CPU benchmark: THP_MEM_ALLOC_ENABLE=1",
        "",
        f"Command: `python scripts/bench_thp.py {' '.join(sys.argv[1:])}`  ",
        f"{machine_line(args.threads)}; kernel THP mode: `{thp_mode.read_text().strip() if thp_mode.exists() else 'unknown'}`; "
        f"forward+backward at n={args.length}, batch {args.batch}, the model size of scripts/bench.py; "
        f"median of {args.rounds} child processes per setting, each the median of {args.repeats} steps.",
        "",
        "| contender | step time with / without THP_MEM_ALLOC_ENABLE=1 |",
        "| --- | ---: |",
    ]
    lines += [f"| {name} | {ratio:.2f} |" for name, ratio in results.items()]
    write_report(lines, args.output)


if __name__ == "__main__":
    main()
