"""Long inputs and soak: cached generation after an 8,192-token context, and 1,000 generate calls.

1. For every relative scheme, in a process of its own: prefill 8,192 tokens through the cache in
   chunks, then decode 32 tokens one at a time; report the peak resident set (VmHWM), the KV cache's
   size, and the peak growth while decoding (bounded by the cache plus one bias row per layer).
2. 1,000 ``generate`` calls with random prompts and batch sizes in one process: resident set at the
   start and at the end, and whether a second pass with the same seed gives the same tokens.

    python scripts/soak.py            # 5-10 minutes on 2 CPU cores (8.5 measured on a busy machine)
    python scripts/soak.py --calls 200 --context 2048   # shorter
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

RELATIVE = ["t5_bias", "shaw", "transformer_xl", "log_decay", "alibi"]


def rss_mib() -> tuple[float, float]:
    """(current resident set, peak resident set) of this process in MiB, from /proc/self/status."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, amount = line.split()[:2]
            values[key] = int(amount) / 1024
    return values["VmRSS:"], values["VmHWM:"]


def tiny_model(scheme: str):
    from hf_relpos import RelPosConfig, RelPosForCausalLM

    torch.manual_seed(0)
    config = RelPosConfig(
        position_encoding=scheme, vocab_size=512, hidden_size=128, num_attention_heads=4, num_hidden_layers=2,
        intermediate_size=512, max_position_embeddings=16384,
    )
    return RelPosForCausalLM(config).eval()


@torch.no_grad()
def long_context_child(scheme: str, context: int, chunk: int, new_tokens: int) -> None:
    model = tiny_model(scheme)
    ids = torch.randint(2, 512, (1, context))
    _, baseline = rss_mib()
    cache = None
    for start in range(0, context, chunk):
        out = model(input_ids=ids[:, start : start + chunk], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    _, after_prefill = rss_mib()
    token = out.logits[:, -1:].argmax(-1)
    started = time.perf_counter()
    for _ in range(new_tokens):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    seconds = time.perf_counter() - started
    _, peak = rss_mib()
    cache_mib = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers) * 4 / 2**20
    print(json.dumps({
        "scheme": scheme, "cache_tokens": cache.get_seq_length(), "cache_mib": cache_mib,
        "baseline_mib": baseline, "peak_mib": peak, "decode_growth_mib": peak - after_prefill, "tokens_per_s": new_tokens / seconds,
    }))


@torch.no_grad()
def soak(calls: int, seed: int) -> dict:
    models = {scheme: tiny_model(scheme) for scheme in RELATIVE}
    generator = torch.Generator().manual_seed(seed)
    digest = hashlib.sha256()
    samples = []
    for call in range(calls):
        scheme = RELATIVE[int(torch.randint(len(RELATIVE), (1,), generator=generator))]
        batch = int(torch.randint(1, 5, (1,), generator=generator))
        length = int(torch.randint(1, 33, (1,), generator=generator))
        ids = torch.randint(2, 512, (batch, length), generator=generator)
        mask = torch.ones_like(ids)
        pad = torch.randint(0, length, (batch,), generator=generator)
        for row in range(batch):  # left padding
            mask[row, : int(pad[row])] = 0
            ids[row, : int(pad[row])] = 0
        torch.manual_seed(seed + call)
        out = models[scheme].generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=int(torch.randint(1, 9, (1,), generator=generator)),
            do_sample=True, top_k=20, pad_token_id=0, eos_token_id=None,
        )
        digest.update(out.numpy().tobytes())
        if call in (50, calls - 1):  # after warm-up, and at the end
            samples.append(rss_mib()[0])
    return {"rss_start_mib": samples[0], "rss_end_mib": samples[-1], "digest": digest.hexdigest()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="results/soak-cpu.md")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    if args.child:
        scheme, context, chunk, new_tokens = args.child
        return long_context_child(scheme, int(context), int(chunk), int(new_tokens))

    from tqdm.auto import tqdm

    long_rows = []
    for scheme in tqdm(RELATIVE, desc=f"{args.context}-token context"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", scheme, str(args.context), str(args.chunk), str(args.new_tokens)],
            capture_output=True, text=True, check=True,
        )
        long_rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = soak(args.calls, args.seed)
    second = soak(args.calls, args.seed)

    lines = [
        "# Long inputs and soak (CPU)", "",
        f"Command: `python scripts/soak.py {' '.join(sys.argv[1:])}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}; {os.cpu_count()} cores. "
        "Model: hidden 128, 4 heads, 2 layers, fp32.", "",
        f"## Cached generation after a {args.context}-token context", "",
        f"Prefill in chunks of {args.chunk} tokens through the cache, then {args.new_tokens} single-token steps; "
        "each scheme in a process of its own (peak = VmHWM of that process).", "",
        "| scheme | cached tokens | KV cache MiB | RSS before prefill MiB | peak RSS MiB | peak growth while decoding MiB | tokens/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in long_rows:
        lines.append(
            f"| {row['scheme']} | {row['cache_tokens']} | {row['cache_mib']:.1f} | {row['baseline_mib']:.0f} | {row['peak_mib']:.0f} | "
            f"{row['decode_growth_mib']:.1f} | {row['tokens_per_s']:.1f} |"
        )
    lines += [
        "", f"## {args.calls} generate calls in one process", "",
        "Random relative scheme, batch 1-4, prompt 1-32 tokens with random left padding, 1-8 sampled new tokens.", "",
        f"- resident set after 50 calls: {first['rss_start_mib']:.0f} MiB; after {args.calls}: {first['rss_end_mib']:.0f} MiB "
        f"(second pass: {second['rss_start_mib']:.0f} → {second['rss_end_mib']:.0f} MiB)",
        f"- same seed, same tokens on both passes: {'yes' if first['digest'] == second['digest'] else 'NO'} "
        f"(sha256 of all outputs {first['digest'][:16]}…)",
    ]
    text = "\n".join(lines) + "\n"
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    print(text)
    if first["digest"] != second["digest"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
