"""A learning-rate sweep for every scheme, so that the shared default rate of `hf-relpos compare` can be
seen not to favour some schemes: `compare --quick` (60 steps, L = 64, one seed) at three peak rates.

    python scripts/lr_sweep.py                              # about 10 minutes on 2 CPU cores
    python scripts/lr_sweep.py --rates 1e-3 2e-3 4e-3 --output results/lr-sweep.md

Writes a Markdown table: perplexity at L per scheme and rate, the best rate per scheme in bold, and
whether the shared default (2e-3) is within 5% of each scheme's best.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hf_relpos_cli  # noqa: E402

DEFAULT_RATE = 2e-3  # compare's --learning-rate default


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3])
    parser.add_argument("--schemes", nargs="+", default=None, choices=hf_relpos_cli.SCHEMES)
    parser.add_argument("--output", default="results/lr-sweep.md")
    args = parser.parse_args()
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for rate in args.rates:
            out = Path(work) / f"lr-{rate:g}"
            argv = ["compare", "--quick", "--seeds", "1", "--factors", "1", "--learning-rate", str(rate),
                    "--output-dir", str(out), "--quiet"] + (["--schemes", *args.schemes] if args.schemes else [])
            if hf_relpos_cli.main(argv) != 0:
                return 1
            for row in json.loads((out / "compare.json").read_text())["rows"]:
                results.setdefault(row["scheme"], {})[rate] = row["ppl_1x"]
    minutes = (time.perf_counter() - started) / 60
    lines = [
        "# Learning-rate sweep",
        "",
        f"Command: `python scripts/lr_sweep.py {' '.join(sys.argv[1:])}` ({minutes:.1f} minutes, 2 CPU threads)  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Each cell: held-out perplexity at L of "
        "`hf-relpos compare --quick --seeds 1` (60 steps, L = 64, seed 0) at that peak learning rate; the best per "
        f"scheme in bold. *default ok*: the shared default {DEFAULT_RATE:g} is within 5% of the scheme's best.",
        "",
        "| scheme | " + " | ".join(f"lr {r:g}" for r in args.rates) + " | best | default ok |",
        "| --- | " + " | ".join("---:" for _ in args.rates) + " | ---: | :---: |",
    ]
    for scheme, by_rate in results.items():
        best = min(by_rate, key=by_rate.get)
        cells = [f"**{by_rate[r]:.2f}**" if r == best else f"{by_rate[r]:.2f}" for r in args.rates]
        default_ok = DEFAULT_RATE in by_rate and by_rate[DEFAULT_RATE] <= 1.05 * by_rate[best]
        lines.append(f"| {scheme} | " + " | ".join(cells) + f" | {best:g} | {'yes' if default_ok else 'no'} |")
    text = "\n".join(lines) + "\n"
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
