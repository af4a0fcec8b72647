"""A transfo-xl-wt103-sized TransfoXL folder (18 layers, d_model 1024, 16 heads, cutoffs [20000, 40000, 200000],
div_val 4; random weights) converted by ``hf-relpos convert-transfo-xl``, then loaded through remote code in a
process that cannot import hf_relpos and decoded with memory. Each step runs in its own process, so that its wall
time and peak resident memory (``ru_maxrss`` of the child) are its own.

    python scripts/transfo_xl_wt103_size.py --output-dir results/transfo-xl-wt103

Writes ``wt103-size.json`` and ``wt103-size.md`` there; the model folders go to a temporary directory (2 x 1.1 GB)
and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MAKE = """
import sys
from hf_relpos.transfo_xl_conversion import WT103_CONFIG, write_random_transfo_xl
write_random_transfo_xl(sys.argv[1], WT103_CONFIG)
"""

DECODE = r"""
import json, sys, time
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "hf_relpos" or name.startswith("hf_relpos."):
            raise ImportError("hf_relpos is blocked in this process")
sys.meta_path.insert(0, Block())
import torch
from transformers import AutoModelForCausalLM
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
loaded = time.perf_counter() - start
generator = torch.Generator().manual_seed(0)
segments = torch.randint(0, model.config.vocab_size, (3, 1, 64), generator=generator)
mems, start = model.init_mems(1), time.perf_counter()
with torch.no_grad():
    for segment in segments:
        out = model(input_ids=segment, mems=mems)
        mems = out.mems
segment_s = (time.perf_counter() - start) / len(segments)
start = time.perf_counter()
tokens = model.generate(segments[0, :, :16], max_new_tokens=16, do_sample=False, pad_token_id=0)
generate_s = time.perf_counter() - start
print(json.dumps({
    "module": type(model).__module__, "hf_relpos_imported": [m for m in sys.modules if m.startswith("hf_relpos")],
    "load_s": loaded, "segment_of_64_s": segment_s, "memory_after_3_segments": list(mems[0].shape),
    "log_probs_normalised": float(out.logits.logsumexp(-1).abs().max()), "generate_16_s": generate_s,
    "generated": tokens.shape[1] - 16,
}))
"""


# Runs its arguments as a child and prints the child's peak resident memory (KiB) last on stderr: each step is
# measured alone (RUSAGE_CHILDREN of this script would be the largest over all its children so far).
MEASURE = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(code)
"""


def run(argv: list, env: dict, timeout: int = 3600) -> tuple[subprocess.CompletedProcess, float, float]:
    """The child's result, its wall seconds and its peak resident memory in GiB."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", MEASURE, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc, wall, int(proc.stderr.strip().splitlines()[-1]) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="results/transfo-xl-wt103")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as work:
        src, converted = Path(work) / "transfo-xl-wt103-random", Path(work) / "converted"
        _, make_s, _ = run([sys.executable, "-c", MAKE, str(src)], env)
        hf_relpos = str(Path(sys.executable).parent / "hf-relpos")
        proc, convert_s, convert_gib = run([hf_relpos, "convert-transfo-xl", str(src), str(converted)], env)
        summary = proc.stdout.strip().splitlines()[-1]
        remote_env = {k: v for k, v in env.items() if not k.startswith("PYTHONPATH")}
        remote_env["HF_MODULES_CACHE"] = str(Path(work) / "modules")
        proc, decode_s, decode_gib = run([sys.executable, "-c", DECODE, str(converted)], remote_env)
        decoded = json.loads(proc.stdout.strip().splitlines()[-1])
        sizes = {name: (src / name).stat().st_size / 2**30 for name in ("model.safetensors",)}
        converted_size = (converted / "model.safetensors").stat().st_size / 2**30
        config = json.loads((converted / "config.json").read_text())
    record = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "source_weights_gib": round(sizes["model.safetensors"], 3), "converted_weights_gib": round(converted_size, 3),
        "write_random_source_s": round(make_s, 1), "convert_s": round(convert_s, 1),
        "convert_peak_rss_gib": round(convert_gib, 2), "convert_output": summary,
        "remote_decode_process_s": round(decode_s, 1), "remote_peak_rss_gib": round(decode_gib, 2),
        "remote": decoded, "converted_config": {k: config[k] for k in (
            "num_hidden_layers", "hidden_size", "num_attention_heads", "cutoffs", "div_val", "mem_len", "same_length",
            "norm_position", "vocab_size")},
    }
    (out / "wt103-size.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# transfo-xl-wt103-sized conversion (random weights)", "",
        f"`python scripts/transfo_xl_wt103_size.py`, on {record['machine']} (no GPU).", "",
        "| step | wall | peak RSS |", "| --- | ---: | ---: |",
        f"| `hf-relpos convert-transfo-xl` (read, convert, float64 parity check over 3 segments, save) | "
        f"{record['convert_s']} s | {record['convert_peak_rss_gib']} GiB |",
        f"| remote code, no hf_relpos: load, 3 segments of 64 with memory, generate 16 | "
        f"{record['remote_decode_process_s']} s | {record['remote_peak_rss_gib']} GiB |", "",
        f"Converter: {summary}", "",
        f"Remote process: module `{decoded['module']}`, hf_relpos modules imported: {decoded['hf_relpos_imported']}; "
        f"load {decoded['load_s']:.1f} s, {decoded['segment_of_64_s']:.2f} s per 64-token segment with memory "
        f"(memory after 3 segments {decoded['memory_after_3_segments']}), generate 16 tokens "
        f"{decoded['generate_16_s']:.1f} s.", "",
        f"Weights: {record['source_weights_gib']} GiB in, {record['converted_weights_gib']} GiB out (float32).",
    ]
    (out / "wt103-size.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
