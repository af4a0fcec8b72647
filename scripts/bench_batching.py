"""Continuous batching against one-by-one and padded batched ``generate``: 32 requests of mixed prompt and answer
lengths, greedy, per scheme family.

Three ways to answer the same requests with the same model: Transformers' continuous batching (a paged cache,
requests packed in one row, each with its own max_new_tokens, as ``generate_batch`` runs it); one greedy
``generate`` per request; one padded batched ``generate`` (left padding, max_new_tokens = the longest answer, each
answer cut to its own length). Generated tokens/s counts the answers' tokens (the padded batch's extra tokens are
not counted). The ways run interleaved (A B C A B C ...) in one process; medians of the repeats. Each way's tokens
are compared per request with one-by-one ``generate``'s. Writes a Markdown table with the command, machine and
versions.

    python scripts/bench_batching.py                      # the default run: 4 schemes, 3 repeats (a few minutes)
    python scripts/bench_batching.py --schemes t5_bias --repeats 1    # a quick look
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# "llama": upstream LlamaForCausalLM of the same size (RoPE, plain attention), the reference in the same run.
SCHEMES = ["t5_bias", "shaw", "alibi", "rope", "llama"]
SIZE = dict(hidden_size=128, num_attention_heads=4, num_hidden_layers=2, intermediate_size=512, vocab_size=512)


def requests(count: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """``count`` prompts of 8-96 random token ids and answer lengths of 4-64 (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 97, (count,), generator=g).tolist()
    answers = torch.randint(4, 65, (count,), generator=g).tolist()
    prompts = [torch.randint(3, SIZE["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    return prompts, answers


def build(scheme: str):
    from hf_relpos import RelPosConfig, RelPosForCausalLM

    if scheme == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            num_key_value_heads=SIZE["num_attention_heads"], max_position_embeddings=256, pad_token_id=0,
            bos_token_id=1, eos_token_id=None, initializer_range=0.1, **SIZE,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        model.set_attn_implementation("sdpa")
        return model
    config = RelPosConfig(
        position_encoding=scheme, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None,
        initializer_range=0.1, **SIZE,
    )
    torch.manual_seed(0)
    model = RelPosForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model


SESSION = {}  # the last continuous session's time from its first request to its last answer


def continuous(model, prompts, answers, args) -> list[list[int]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = ContinuousBatchingConfig(
        page_size=args.page_size, num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens,
        max_requests_per_batch=args.max_requests_per_batch,
    )
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(answers), eos_token_id=-1)
    with model.continuous_batching_context_manager(
        generation_config=generation, continuous_batching_config=config, warmup=False
    ) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, answers)]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous batching loop stopped")
            elif result.is_finished():
                if result.error is not None:
                    raise RuntimeError(result.error)
                results[result.request_id] = result
        SESSION["answers"] = time.perf_counter() - start  # the manager's stop (below) is timed by the caller
    return [results[i].generated_tokens for i in ids]


def one_by_one(model, prompts, answers, args) -> list[list[int]]:
    out = []
    for prompt, n in zip(prompts, answers):
        ids = torch.tensor([prompt])
        out.append(model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist())
    return out


def padded(model, prompts, answers, args) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max(answers), do_sample=False)[:, width:]
    return [row[:n].tolist() for row, n in zip(out, answers)]


WAYS = {"generate_batch": continuous, "one-by-one generate": one_by_one, "padded batched generate": padded}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", nargs="+", default=SCHEMES)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--max-requests-per-batch", type=int, default=32)
    parser.add_argument("--output", type=Path, default=Path("results/bench-cpu-batching.md"))
    args = parser.parse_args(argv)

    import transformers

    prompts, answers = requests(args.requests, args.seed)
    wanted = sum(answers)
    rows = []
    torch.set_grad_enabled(False)
    for scheme in args.schemes:
        model = build(scheme)
        reference = one_by_one(model, prompts, answers, args)  # warm-up, and the tokens each way must give
        times = {name: [] for name in WAYS}
        answering = []
        same = {}
        for _ in range(args.repeats):
            for name, way in WAYS.items():
                start = time.perf_counter()
                tokens = way(model, prompts, answers, args)
                times[name].append(time.perf_counter() - start)
                if way is continuous:
                    answering.append(SESSION["answers"])
                same[name] = sum(t == r for t, r in zip(tokens, reference))
        median = {name: statistics.median(t) for name, t in times.items()}
        rows.append((scheme, median, same, statistics.median(answering)))
        print(scheme, {name: f"{wanted / m:.0f} tok/s" for name, m in median.items()}, same, flush=True)

    lines = [
        "# Continuous batching against one-by-one and padded batched generate (CPU)",
        "",
        f"Command: `python {' '.join(['scripts/bench_batching.py', *sys.argv[1:]])}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {platform.machine()} "
        f"{platform.processor() or platform.platform()}, {os.cpu_count()} CPUs, torch threads "
        f"{torch.get_num_threads()}, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}  ",
        f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}",
        "",
        f"{args.requests} requests (seed {args.seed}): prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens, answers of {min(answers)}-{max(answers)} tokens ({wanted} in all), greedy. Model: RelPosForCausalLM "
        f"{SIZE}, sdpa, float32 (\"llama\": upstream LlamaForCausalLM of the same size, the reference). Continuous batching: page_size={args.page_size}, num_blocks={args.num_blocks}, "
        f"max_batch_tokens={args.max_batch_tokens}, max_requests_per_batch={args.max_requests_per_batch}, "
        "each request its own max_new_tokens. Padded: one generate, left padding, max_new_tokens = the longest "
        f"answer. Tokens/s = the {wanted} answer tokens / wall time; medians of {args.repeats} interleaved repeats. "
        "\"same\": requests whose tokens equal one-by-one generate's. \"in session\": generate_batch's tokens/s from "
        "the first request added to the last answer, without the manager's start and stop (its stop runs "
        "gc.collect; a persistent manager, as a server keeps, pays them once).",
        "",
        "| scheme | generate_batch tok/s | (in session) | one-by-one tok/s | padded tok/s | "
        "generate_batch / one-by-one | generate_batch / padded | same (batch, padded) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scheme, median, same, session in rows:
        cb, single, pad = (median[n] for n in WAYS)
        lines.append(
            f"| {scheme} | {wanted / cb:.0f} | {wanted / session:.0f} | {wanted / single:.0f} | {wanted / pad:.0f} | "
            f"{single / cb:.2f} | "
            f"{pad / cb:.2f} | {same['generate_batch']}/{args.requests}, {same['padded batched generate']}/"
            f"{args.requests} |"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
