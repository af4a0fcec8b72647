"""Peak memory of ``hf-relpos serve --continuous-batching``: a random model of ``hf-relpos train``'s ``tiny`` preset
(2 layers, hidden 128, the embedded corpus' BPE), 8 concurrent greedy requests of 32 tokens, the peak resident
memory (VmHWM) of the server and every process under it (Transformers 5.25's model process) summed, and the
largest proportional set size (PSS: a page shared by both processes counted once) sampled while the requests run.

    python scripts/serve_memory.py                          # the default paged cache (sized for the requests)
    python scripts/serve_memory.py --cb-max-memory-percent 0.6   # Transformers' own sizing, for comparison

Prints one line per configuration; Linux only (/proc).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def peak_rss_mib(pid: int) -> float:
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            peak = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
            if os.environ.get("SERVE_MEMORY_DETAIL"):
                print(f"  pid {current}: {peak / 1024:.0f} MiB", Path(f"/proc/{current}/cmdline").read_text()[:80])
            total += peak
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total / 1024


def tree(pid: int) -> list[int]:
    pids, pending = [], [pid]
    while pending:
        current = pending.pop()
        pids.append(current)
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return pids


def pss_mib(pid: int) -> float:
    """The proportional set size of the process tree now: each shared page (torch's libraries, mapped by the server
    and by the model process) counted once over the processes that map it."""
    total = 0
    for current in tree(pid):
        try:
            rollup = Path(f"/proc/{current}/smaps_rollup").read_text()
            total += int(next(line.split()[1] for line in rollup.splitlines() if line.startswith("Pss:")))
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total / 1024


def build(folder: Path) -> None:
    import torch

    from hf_relpos import RelPosConfig, RelPosForCausalLM
    from hf_relpos.commands.train import PRESETS
    from hf_relpos.data import embedded_corpus, train_tokenizer

    tokenizer = train_tokenizer([embedded_corpus()["train"][:200000]], vocab_size=2048)
    config = RelPosConfig(position_encoding="t5_bias", is_decoder=True, vocab_size=len(tokenizer),
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **PRESETS["tiny"])
    torch.manual_seed(0)
    RelPosForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def measure(folder: Path, extra: list[str]) -> tuple[float, float]:
    log = tempfile.NamedTemporaryFile("w+", suffix=".out", delete=False)
    server = subprocess.Popen([sys.executable, "-m", "hf_relpos.cli", "serve", str(folder), "--port", "0",
                               "--continuous-batching", *extra], stdout=log, stderr=subprocess.DEVNULL,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 300
        while "http://" not in Path(log.name).read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start ({server.returncode})")
            time.sleep(0.2)
        base = "http://" + Path(log.name).read_text().split("http://", 1)[1].split()[0]

        def ask(i):
            body = json.dumps({"prompt": f"The for statement {i}", "max_tokens": 32, "temperature": 0}).encode()
            request = urllib.request.Request(base + "/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            return json.load(urllib.request.urlopen(request, timeout=300))["usage"]["completion_tokens"]

        pss = [pss_mib(server.pid)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = [pool.submit(ask, i) for i in range(8)]
            while not all(a.done() for a in answers):
                pss.append(pss_mib(server.pid))
                time.sleep(0.02)
        assert all(a.result() > 0 for a in answers)
        return peak_rss_mib(server.pid), max(pss)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
        os.unlink(log.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cb-max-memory-percent", default=None, help="also measure Transformers' own sizing")
    args = parser.parse_args()
    import transformers

    with tempfile.TemporaryDirectory() as root:
        folder = Path(root) / "tiny"
        build(folder)
        runs = [("default paged cache", [])]
        if args.cb_max_memory_percent:
            runs.append((f"--cb-max-memory-percent {args.cb_max_memory_percent}",
                         ["--cb-max-memory-percent", args.cb_max_memory_percent]))
        for name, extra in runs:
            rss, pss = measure(folder, extra)
            print(f"transformers {transformers.__version__}, {name}, 8 concurrent requests: peak RSS {rss:.0f} MiB "
                  f"(summed over the server and its model process; shared pages counted in each), sampled peak "
                  f"PSS {pss:.0f} MiB (shared pages counted once)", flush=True)


if __name__ == "__main__":
    main()
