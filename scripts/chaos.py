"""Chaos: random SIGKILLs, full disks and second processes across `hf-relpos train`, `--resume` and `compare`.

Each run is started in a fresh folder and continued as a user would until it finishes (``--resume``; ``--overwrite``
or a plain start when there is nothing to resume), every attempt meeting at random one of: a SIGKILL at a random
moment, "no space left on device" at a random file write (the write functions patched in the child process), a
second process started into the same folder, or nothing. A run is lost if an attempt fails other than as one of
these faults (a traceback, an unexpected error line), if a complete checkpoint disappears, if the model folder is
ever half written, or if the finished run's loss or perplexity differs from the uninterrupted run's. Prints the
counts; exit status 1 if any run was lost.

    python scripts/chaos.py --minutes 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--steps", "6", "--seq-len", "16", "--batch-size", "2", "--vocab-size", "300", "--eval-tokens", "64",
        "--quiet"]
SCENARIOS = {
    "train transformer_xl": ["train", "--position-encoding", "transformer_xl", *TINY],
    "train t5_bias": ["train", "--position-encoding", "t5_bias", *TINY],
    "compare": ["compare", "--quick", "--schemes", "alibi", "transformer_xl", "--seeds", "1", "--factors", "1", "2",
                *TINY],
}

# The child: the write functions fail with ENOSPC at the N-th write (N from the environment), then the command.
CHILD = r"""
import builtins, errno, io, os, sys
import torch, safetensors.torch, transformers.modeling_utils
import hf_relpos.memory, hf_relpos_cli
at, count = int(os.environ["CHAOS_FULL_AT"]), [0]
def hit(path):
    count[0] += 1
    if count[0] == at:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
real_open, real_save, real_safe = builtins.open, torch.save, safetensors.torch.save_file
def open_(file, mode="r", *a, **k):
    if not isinstance(file, int) and "opener" not in k and any(c in mode for c in "wax+"):
        hit(file)
    return real_open(file, mode, *a, **k)
def save(obj, f, *a, **k):
    hit(f)
    return real_save(obj, f, *a, **k)
def safe(tensors, filename, *a, **k):
    hit(filename)
    return real_safe(tensors, filename, *a, **k)
builtins.open = io.open = open_
torch.save = save
transformers.modeling_utils.safe_save_file = hf_relpos.memory.save_file = safetensors.torch.save_file = safe
sys.exit(hf_relpos_cli.main(sys.argv[1:]))
"""


def command(argv, full_at=None):
    if full_at is None:
        return [sys.executable, "-m", "hf_relpos.cli", *argv], dict(os.environ)
    return [sys.executable, "-c", CHILD, *argv], {**os.environ, "CHAOS_FULL_AT": str(full_at)}


def start(argv, full_at=None):
    cmd, env = command(argv, full_at)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def results(scenario: str, out: Path) -> dict:
    """What must equal the uninterrupted run: each model's final loss and perplexity."""
    if scenario == "compare":
        files = sorted((out / "models").glob("*/seed-*/hf_relpos_run.json"))
        assert (out / "compare.md").is_file()
    else:
        files = [out / "hf_relpos_run.json"]
    found = {}
    for f in files:
        record = json.loads(f.read_text())
        found[str(f.relative_to(out))] = (record["final_train_loss"], record["test_ppl"])
    return found


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[k][0] - b[k][0]) <= 1e-4 and abs(a[k][1] / b[k][1] - 1) <= 1e-4
                                        for k in a)


def model_folders(scenario: str, out: Path) -> list:
    if scenario == "compare":
        return [p for p in (out / "models").glob("*/seed-*") if p.name.split("-", 1)[1].isdigit()]
    return [out]


def check_state(scenario: str, out: Path, before: dict) -> tuple:
    """(problem or None, newest complete checkpoint step of each model folder)."""
    from hf_relpos.commands.common import checkpoints_dir, last_checkpoint

    steps = {}
    for folder in model_folders(scenario, out):
        if folder.exists():
            names = {p.name for p in folder.iterdir()}
            if not {"config.json", "model.safetensors", "tokenizer.json", "hf_relpos_run.json"} <= names:
                return f"{folder} is half written: {sorted(names)}", steps
        newest = last_checkpoint(checkpoints_dir(folder))
        steps[str(folder)] = int(newest.name.split("-")[1]) if newest else 0
        if steps[str(folder)] < before.get(str(folder), 0):
            return f"{folder}: complete checkpoint of step {before[str(folder)]} lost", steps
    return None, steps


EXPECTED = ("no space left", "is in use by", "no checkpoint to resume from", "no comparison to resume")


def one_run(scenario: str, folder: Path, reference: dict, rng: random.Random, seconds: float, stats: dict):
    out = folder / "out"
    base = SCENARIOS[scenario] + ["--output-dir", str(out)]
    steps, mode = {}, "start"
    for attempt in range(14):
        if mode == "start":
            argv = base
        elif mode == "resume":
            argv = base + ["--resume"]
        else:
            argv = base + ["--overwrite"]
        fault = "none" if attempt == 13 else rng.choice(["kill", "kill", "full", "second", "none"])
        full_at = rng.randint(1, 60) if fault == "full" else None
        proc = start(argv, full_at)
        second = None
        if fault == "second":
            time.sleep(rng.uniform(0.5, 3))
            second = start(argv)
        if fault == "kill":
            try:
                proc.wait(timeout=rng.uniform(0.5, seconds * 1.2))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stats["kills"] += 1
        _, err = proc.communicate()
        lines = [line for line in err.splitlines() if ": error: " in line or "Traceback" in line]
        if second is not None:
            _, err2 = second.communicate()
            errors2 = [line for line in err2.splitlines() if ": error: " in line or "Traceback" in line]
            if second.returncode == 2 and "is in use by" in err2:
                stats["refused second"] += 1
            elif second.returncode != 0 and not (second.returncode == 2 and len(errors2) == 1):
                # (after the first finished, a second plain start is refused as any start into a trained folder)
                return f"second process: rc {second.returncode}: {err2.strip()[-300:]}"
        if proc.returncode == 0:
            problem, steps = check_state(scenario, out, steps)
            if problem:
                return problem
            got = results(scenario, out)
            if not same(got, reference):
                return f"finished with other results: {got} vs {reference}"
            stats["attempts"] += attempt + 1
            return None
        if proc.returncode == -signal.SIGKILL:
            pass
        elif proc.returncode == 2 and len(lines) == 1 and any(e in lines[0] for e in EXPECTED):
            if "no space left" in lines[0]:
                stats["full disks"] += 1
        else:
            return (f"attempt {attempt} ({' '.join(argv[:1] + argv[-1:])}, {fault}): rc {proc.returncode}: "
                    f"{err.strip()[-600:]}")
        problem, steps = check_state(scenario, out, steps)
        if problem:
            return problem
        # continue as a user would
        if lines and ("no checkpoint to resume from" in lines[0] or "no comparison to resume" in lines[0]):
            mode = "overwrite" if scenario != "compare" else "start"
        elif out.exists() or Path(str(out) + "-checkpoints").exists():
            mode = "resume"
        else:
            mode = "start"
        if scenario == "compare" and mode == "resume" and not (out / "models").is_dir():
            mode = "start"
    return "did not finish in 14 attempts"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10, help="stop starting new runs after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (printed)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="hf-relpos-chaos-"))
    os.chdir(work)
    references, durations = {}, {}
    for scenario in SCENARIOS:
        started = time.time()
        proc = start(SCENARIOS[scenario] + ["--output-dir", str(work / "reference" / scenario.replace(" ", "-"))])
        _, err = proc.communicate()
        if proc.returncode != 0:
            print(f"reference {scenario} failed: {err}", file=sys.stderr)
            return 1
        durations[scenario] = time.time() - started
        references[scenario] = results(scenario, work / "reference" / scenario.replace(" ", "-"))
    stats = {"runs": 0, "lost": 0, "attempts": 0, "kills": 0, "full disks": 0, "refused second": 0}
    deadline = time.time() + args.minutes * 60
    n = 0
    while time.time() < deadline:
        scenario = rng.choice(list(SCENARIOS))
        folder = work / f"run-{n}"
        folder.mkdir()
        problem = one_run(scenario, folder, references[scenario], rng, durations[scenario], stats)
        stats["runs"] += 1
        if problem:
            stats["lost"] += 1
            print(f"LOST run-{n} ({scenario}): {problem}", flush=True)
        else:
            shutil.rmtree(folder)
        n += 1
        print(f"{n} runs, {stats['lost']} lost", end="\r", flush=True)
    print()
    print(", ".join(f"{k}: {v}" for k, v in stats.items()))
    if args.keep or stats["lost"]:
        print(f"work folder: {work}")
    else:
        shutil.rmtree(work)
    return 1 if stats["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
