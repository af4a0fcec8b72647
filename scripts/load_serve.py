"""Load test of ``hf-relpos serve``: 1, 4 and 16 concurrent clients, without and with ``--continuous-batching``.

Each client sends greedy ``/v1/completions`` requests (a fixed set of prompts of mixed length, fixed ``max_tokens``)
one after another until the level's requests are done; the table gives requests/s, generated tokens/s (the
``usage.completion_tokens`` the server reports, over the level's wall time) and the p50/p95 latency of a request.
The servers run in child processes (``python -m hf_relpos.cli serve FOLDER --port 0``), one per mode, all started
first; each level runs ``--rounds`` rounds with the modes alternating, so that a busy shared machine slows both
alike, and the table gives the medians. ``--url`` drives a server already running instead (one mode).

    python scripts/load_serve.py                       # a small random t5_bias model built here; a few minutes
    python scripts/load_serve.py runs/demo             # a trained folder
    python scripts/load_serve.py --url http://127.0.0.1:8000 --model-name demo

Writes results/bench-cpu-serve.md (``--output``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 300


def build_folder(folder: Path) -> Path:
    """A random t5_bias model of 4 layers, width 256, with a 2048-token BPE of the embedded corpus."""
    import torch

    from hf_relpos import RelPosConfig, RelPosForCausalLM
    from hf_relpos.data import embedded_corpus, train_tokenizer

    tokenizer = train_tokenizer([embedded_corpus()["train"]], vocab_size=2048)
    config = RelPosConfig(position_encoding="t5_bias", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                          num_attention_heads=4, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    RelPosForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prompts(count: int) -> list:
    """``count`` fixed prompts of 4 to 60 words: the embedded corpus' test split, cut at varying lengths."""
    from hf_relpos.data import embedded_corpus

    words = embedded_corpus()["test"].split()
    out, start = [], 0
    for i in range(count):
        n = 4 + (i * 7) % 57
        out.append(" ".join(words[start:start + n]))
        start += n
    return out


class Server:
    def __init__(self, folder: str, extra: list, log: Path):
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        self.log = log
        with open(log, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "hf_relpos.cli", "serve", folder, "--port", "0", *extra],
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True, env=env,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
        line = self.process.stdout.readline()  # "hf-relpos serve: NAME (...) at http://HOST:PORT/v1 (Ctrl-C stops)"
        if "http://" not in line:
            self.stop()
            raise SystemExit(f"the server did not start: {line.strip()} {log.read_text()[-2000:]}")
        self.url = "http://" + line.split("http://", 1)[1].split()[0].rsplit("/v1", 1)[0]
        self.name = line.split("serve: ", 1)[1].split(" ", 1)[0]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def complete(url: str, name: str, prompt: str, max_tokens: int) -> tuple:
    """(seconds, generated tokens, error or None) of one greedy completion."""
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as error:
        return time.perf_counter() - start, 0, f"HTTP {error.code}: {error.read().decode()[:300]}"
    return time.perf_counter() - start, answer["usage"]["completion_tokens"], None


def level(url: str, name: str, texts: list, clients: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: complete(url, name, p, max_tokens), texts))
    wall = time.perf_counter() - start
    errors = [e for _, _, e in results if e]
    latencies = sorted(s for s, _, e in results if not e)
    tokens = sum(t for _, t, _ in results)
    return {
        "clients": clients, "requests": len(texts), "errors": len(errors), "first_error": errors[0] if errors else None,
        "rps": len(latencies) / wall, "tps": tokens / wall, "tokens": tokens,
        "p50": statistics.median(latencies) if latencies else float("nan"),
        "p95": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))] if latencies else float("nan"),
    }


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"Python {platform.python_version()}"]
    for package in ("hf_relpos", "torch", "transformers", "fastapi", "uvicorn"):
        try:
            parts.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            parts.append(f"{package} (not installed)")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", help="a folder to serve (default: a random t5_bias model built here)")
    parser.add_argument("--url", help="drive this running server instead of starting one")
    parser.add_argument("--model-name", help="the model's name (with --url; default: the server's first model)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")),
                        help="the server's OMP_NUM_THREADS")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per level, the modes alternating")
    parser.add_argument("--modes", nargs="+", choices=["plain", "continuous-batching"],
                        default=["plain", "continuous-batching"])
    parser.add_argument("--output", default=str(ROOT / "results" / "bench-cpu-serve.md"))
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    texts = prompts(args.requests)
    load_start = os.getloadavg()[0]
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        if args.url:
            name = args.model_name or json.loads(urllib.request.urlopen(args.url + "/v1/models").read())["data"][0]["id"]
            runs = [("as started", args.url.rstrip("/"), name, None)]
            what = f"the server at {args.url} (model {name})"
        else:
            folder = args.folder or str(build_folder(Path(tmp) / "load-model"))
            what = (f"folder {args.folder}" if args.folder else
                    "a random t5_bias model (4 layers, width 256, 4 heads, 2048-token BPE) built by the script")
            runs = [(mode, folder, None, ["--continuous-batching"] if mode == "continuous-batching" else [])
                    for mode in args.modes]
        servers = []
        try:
            targets = []
            for mode, target, name, extra in runs:  # every mode's server up at once: rounds alternate between them
                if extra is not None:
                    servers.append(Server(target, extra + ["--max-tokens", str(args.max_tokens)],
                                          Path(tmp) / f"{mode}.log"))
                    target, name = servers[-1].url, servers[-1].name
                complete(target, name, texts[0], 4)  # warm-up
                targets.append((mode, target, name))
            failed = set()
            for clients in args.clients:
                results = {mode: [] for mode, _, _ in targets}
                for _ in range(args.rounds):  # mode A, mode B, A, B, ...: each pair under the same machine load
                    for mode, target, name in targets:
                        if mode in failed:
                            continue
                        result = level(target, name, texts, clients, args.max_tokens)
                        results[mode].append(result)
                        print(mode, json.dumps(result), flush=True)
                        if result["errors"]:
                            failed.add(mode)
                            notes.append(f"{mode}, {clients} clients: {result['errors']} of {result['requests']} "
                                         f"requests failed; the first: {result['first_error']}")
                for mode, _, _ in targets:
                    if results[mode]:
                        rows.append((mode, clients, results[mode]))
        finally:
            for server in servers:
                server.stop()
    command = "python scripts/load_serve.py " + " ".join(sys.argv[1:])
    lines = [
        "# CPU load test: hf-relpos serve", "",
        f"Command: `{command.strip()}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, server OMP_NUM_THREADS={args.threads}; 1-minute load average {load_start:.1f} at "
        f"the start, {os.getloadavg()[0]:.1f} at the end  ",
        f"Versions: {versions()}  ",
        f"Served: {what}; {args.requests} greedy /v1/completions requests per level (prompts of 4 to 60 words of "
        f"the embedded corpus' test split), max_tokens {args.max_tokens}; clients send their next request when the "
        f"last one is answered. Each level runs {args.rounds} rounds, the modes alternating (so each pair shares the "
        "machine's load); the table gives the medians over the rounds.", "",
        "| mode | clients | requests/s | generated tokens/s | p50 latency (s) | p95 latency (s) | failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, clients, results in rows:
        med = {key: statistics.median(r[key] for r in results) for key in ("rps", "tps", "p50", "p95")}
        lines.append(f"| {mode} | {clients} | {med['rps']:.2f} | {med['tps']:.1f} | {med['p50']:.2f} | "
                     f"{med['p95']:.2f} | {sum(r['errors'] for r in results)} |")
    lines += [""] + [f"- {note}" for note in notes]
    text = "\n".join(lines).rstrip() + "\n"
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
