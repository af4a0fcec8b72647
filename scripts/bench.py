"""Speed and memory of every hf_relpos scheme against upstream T5 and against plain attention (rope).

Forward and forward+backward, bidirectional (as T5's encoder) and causal (the decoder use, with a
cached prefill besides), at several lengths, contenders interleaved A B A B in one process, medians
after warm-up; peak memory per contender in a process of its own; cached decoding tokens/s. A seq2seq
section besides: a training step and greedy ``generate`` of upstream ``T5ForConditionalGeneration``
against its ``hf_relpos.from_t5`` conversion (the same weights) and ``rope``. Writes a Markdown table
with the command, date, torch version, machine and load average.

    python scripts/bench.py                       # the full run (about 30 minutes on 2 CPU cores)
    python scripts/bench.py --quick               # about 5 minutes: n=512, fewer repeats
    python scripts/bench.py --seq2seq             # the seq2seq section alone (about 10 minutes),
                                                  # results/bench-cpu-seq2seq.md
    python scripts/bench.py --padded --lengths 2048 --causal-lengths 2048 --no-decode \
        --output results/bench-cpu-padded.md      # a padded batch (about 6 minutes)
    python scripts/bench.py --compiled-only --output results/bench-cpu-compiled.md   # compiled decoding
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SCHEMES = ["rope", "t5_bias", "shaw", "transformer_xl", "log_decay", "alibi", "sinusoidal", "learned", "fox"]
CAUSAL_ONLY = ("fire", "nope", "fox")  # hf_relpos.configuration_relpos.CAUSAL_ONLY: timed in the causal sections only
UPSTREAM = "upstream_t5"
SIZE = dict(hidden_size=512, num_attention_heads=8, num_hidden_layers=2, intermediate_size=2048)
DTYPE = torch.float32  # --dtype: every contender's weights (and so its activations) in this dtype


def _dtype_flag() -> str:
    return "bf16" if DTYPE == torch.bfloat16 else "fp32"


def build(name: str, causal: bool = False, head: bool = False):
    """A contender: an hf_relpos body, causal or not (with the LM head: ``head``), or upstream T5EncoderModel."""
    torch.manual_seed(0)
    if name == UPSTREAM:
        from transformers import T5Config, T5EncoderModel

        config = T5Config(
            vocab_size=1024, d_model=512, d_kv=64, num_heads=8, num_layers=2, d_ff=2048, dropout_rate=0.0,
            relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="relu",
        )
        return T5EncoderModel(config).to(DTYPE).train()
    from hf_relpos import RelPosConfig, RelPosForCausalLM, RelPosModel

    config = RelPosConfig(
        position_encoding=name, vocab_size=1024, max_position_embeddings=8192, is_decoder=causal, **SIZE
    )
    return (RelPosForCausalLM(config) if head else RelPosModel(config)).to(DTYPE).train()


def step(model, ids, mode: str, mask=None) -> None:
    """One forward+backward ("fwd+bwd"), inference forward ("fwd") or forward that fills a cache ("prefill")."""
    if mode == "fwd+bwd":
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=mode == "prefill")


def padding(batch: int, n: int):
    """A padded batch: the last row's final quarter is padding (the others are full)."""
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[-1, n - n // 4:] = 0
    return mask


def time_interleaved(names, n, batch, repeats, mode, causal=False, padded=False) -> dict:
    models = {name: build(name, causal) for name in names}
    ids = torch.randint(0, 1024, (batch, n))
    mask = padding(batch, n) if padded else None
    for model in models.values():  # warm-up
        step(model, ids, mode, mask)
    times = {name: [] for name in names}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            step(model, ids, mode, mask)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _high_water_mib() -> float:
    """This process's peak resident set (VmHWM). Unlike ru_maxrss, it starts afresh at exec, so the
    parent's peak does not leak into the child's reading."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory_child(name: str, n: int, batch: int) -> None:
    """Runs in its own process: prints the peak resident set of one fwd+bwd step (MiB)."""
    model = build(name)
    ids = torch.randint(0, 1024, (batch, n))
    base = _high_water_mib()
    step(model, ids, "fwd+bwd")
    peak = _high_water_mib()
    print(json.dumps({"peak_mib": peak, "delta_mib": peak - base}))


def peak_memory(name: str, n: int, batch: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child-memory", name, str(n), str(batch), "--dtype", _dtype_flag()],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@torch.no_grad()
def decode_tokens_per_second(names, context: int, new_tokens: int, repeats: int) -> dict:
    """Greedy cached decoding after a prefill of ``context`` tokens, contenders interleaved."""
    models = {name: build(name, causal=True, head=True).eval() for name in names}
    ids = torch.randint(0, 1024, (1, context))
    rates = {name: [] for name in names}
    for repeat in range(repeats + 1):  # the first round is a warm-up
        for name, model in models.items():
            out = model(input_ids=ids, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for _ in range(new_tokens):
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
            if repeat:
                rates[name].append(new_tokens / (time.perf_counter() - start))
    return {name: statistics.median(r) for name, r in rates.items()}


@torch.no_grad()
def compiled_decoding(names, context: int, new_tokens: int, repeats: int) -> dict:
    """Greedy decoding into a StaticCache after an eager prefill of ``context`` tokens: tokens/s of the eager
    step and of the same step compiled (inductor, ``fullgraph=True``), interleaved; the compile time of the
    first compiled run; and whether both give the same tokens."""
    from tqdm.auto import tqdm
    from transformers import StaticCache

    ids = torch.randint(0, 1024, (1, context))
    result = {}
    for name in tqdm(names, desc=f"compiled decoding, context {context}"):
        torch._dynamo.reset()
        model = build(name, causal=True, head=True).eval()
        cache = StaticCache(config=model.config, max_cache_len=context + new_tokens)

        def eager(token):
            return model(input_ids=token, past_key_values=cache, use_cache=True).logits

        compiled = torch.compile(eager, fullgraph=True)

        def run(step):
            cache.reset()
            token = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            tokens, start = [], time.perf_counter()
            for _ in range(new_tokens):
                token = step(token)[:, -1:].argmax(-1)
                tokens.append(token)
            return new_tokens / (time.perf_counter() - start), torch.cat(tokens, dim=1)

        start = time.perf_counter()
        run(compiled)  # compiles
        compile_s = time.perf_counter() - start
        rates, tokens = {"eager": [], "compiled": []}, {}
        for repeat in range(repeats + 1):  # the first round is a warm-up
            for kind, step in (("eager", eager), ("compiled", compiled)):
                rate, tokens[kind] = run(step)
                if repeat:
                    rates[kind].append(rate)
        result[name] = dict(eager=statistics.median(rates["eager"]), compiled=statistics.median(rates["compiled"]),
                            compile_s=compile_s, same_tokens=torch.equal(tokens["eager"], tokens["compiled"]))
    return result


# ---------------------------------------------------------------------------
# Seq2seq: upstream T5ForConditionalGeneration against its hf_relpos conversion
# ---------------------------------------------------------------------------

S2S_UPSTREAM, S2S_EAGER, S2S_CONVERTED, S2S_ROPE = "upstream_t5", "upstream_t5_eager", "from_t5", "rope"
SEQ2SEQ = [S2S_UPSTREAM, S2S_EAGER, S2S_CONVERTED, S2S_ROPE]
S2S_LABELS = {
    S2S_UPSTREAM: "upstream `T5ForConditionalGeneration` (sdpa, its default)",
    S2S_EAGER: "upstream `T5ForConditionalGeneration` (eager)",
    S2S_CONVERTED: "hf_relpos `from_t5(upstream)` (t5_bias, sdpa)",
    S2S_ROPE: "hf_relpos `rope`, same weights (floor)",
}


def build_seq2seq(name: str, vocab: int, same_weights: bool = True):
    """``_build_seq2seq`` in --dtype."""
    return _build_seq2seq(name, vocab, same_weights).to(DTYPE)


def _build_seq2seq(name: str, vocab: int, same_weights: bool = True):
    """A seq2seq contender, T5-small-like with 2 encoder and 2 decoder layers (T5 v1.0: ReLU, tied and rescaled
    output layer). Every contender holds the same seed-0 upstream weights: ``from_t5`` converts them (the same
    function), ``rope`` loads them with rotary positions in place of the bias tables (plain fused SDPA).
    ``same_weights=False`` (the memory runs) builds the hf_relpos models straight from the converted config,
    so that no upstream copy raises the process's peak before the step."""
    from transformers import T5Config, T5ForConditionalGeneration

    from hf_relpos import RelPosConfig, RelPosForConditionalGeneration, from_t5
    from hf_relpos.t5_conversion import t5_config_to_relpos

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=vocab, d_model=512, d_kv=64, num_heads=8, num_layers=2, num_decoder_layers=2, d_ff=2048,
        dropout_rate=0.0, relative_attention_num_buckets=32, relative_attention_max_distance=128,
        feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=None,  # no early stop
    )
    rope_config = RelPosConfig(**{**t5_config_to_relpos(config, tied=True).to_dict(), "position_encoding": "rope"})
    if not same_weights and name in (S2S_CONVERTED, S2S_ROPE):
        relpos_config = t5_config_to_relpos(config, tied=True) if name == S2S_CONVERTED else rope_config
        model = RelPosForConditionalGeneration(relpos_config)
        model.set_attn_implementation("sdpa")
        return model.train()
    upstream = T5ForConditionalGeneration(config).train()
    upstream.set_attn_implementation("eager" if name == S2S_EAGER else "sdpa")
    if name in (S2S_UPSTREAM, S2S_EAGER):
        return upstream
    converted = from_t5(upstream)
    if name == S2S_CONVERTED:
        return converted
    rope = RelPosForConditionalGeneration(rope_config).train()
    rope.generation_config = converted.generation_config
    missing, unexpected = rope.load_state_dict(converted.state_dict(), strict=False)
    if missing or any("relative_attention_bias" not in key for key in unexpected):
        raise RuntimeError(f"rope did not take the converted weights: missing {missing}, unexpected {unexpected}")
    return rope


def seq2seq_batch(vocab: int, batch: int, source: int, target: int):
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(1, vocab, (batch, source), generator=generator),
            torch.randint(1, vocab, (batch, target), generator=generator))


def seq2seq_step(model, src, labels) -> float:
    """One training step's compute: forward with ``labels`` (cross-entropy over the vocabulary) and backward."""
    loss = model(input_ids=src, labels=labels).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


def paired_ratio(values: dict, name: str, reference: str) -> float:
    """The median over rounds of ``name``'s value / ``reference``'s in the same round. Each round runs every
    contender once, back to back, so a burst of the other jobs on a shared machine that spans a round scales
    both and cancels (a ratio of the two medians mixes rounds of different load)."""
    return statistics.median(a / b for a, b in zip(values[name], values[reference]))


def spread(values: list) -> float:
    """The largest of ``values`` over the smallest: how much the load changed during the rounds."""
    return max(values) / min(values)


def seq2seq_training(vocab: int, batch: int, source: int, target: int, repeats: int) -> dict:
    """fwd+bwd times of each contender per round, interleaved, and its loss (the same function: the same loss)."""
    models = {name: build_seq2seq(name, vocab) for name in SEQ2SEQ}
    src, labels = seq2seq_batch(vocab, batch, source, target)
    losses = {name: seq2seq_step(model, src, labels) for name, model in models.items()}  # warm-up
    times = {name: [] for name in SEQ2SEQ}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            seq2seq_step(model, src, labels)
            times[name].append(time.perf_counter() - start)
    return dict(times=times, loss=losses)


def seq2seq_memory_child(name: str, vocab: int, batch: int, source: int, target: int) -> None:
    """Runs in its own process: prints the peak resident set of one seq2seq training step (MiB)."""
    model = build_seq2seq(name, vocab, same_weights=False)
    src, labels = seq2seq_batch(vocab, batch, source, target)
    base = _high_water_mib()
    seq2seq_step(model, src, labels)
    peak = _high_water_mib()
    print(json.dumps({"peak_mib": peak, "delta_mib": peak - base}))


def seq2seq_memory(name: str, vocab: int, batch: int, source: int, target: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child-seq2seq-memory", name, str(vocab), str(batch), str(source), str(target),
         "--dtype", _dtype_flag()],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


class _TokenClock:
    """A ``generate`` streamer noting when each new token arrives (the first ``put`` is the start token)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


@torch.no_grad()
def seq2seq_decoding(vocab: int, source: int, new_tokens: int, repeats: int) -> dict:
    """Greedy cached ``generate`` of ``new_tokens`` after a ``source``-token input (batch 1), interleaved: tokens/s
    of the whole call (encoding the source included) and of the decode steps after the first new token, and
    the generated tokens."""
    models = {name: build_seq2seq(name, vocab).eval() for name in SEQ2SEQ}
    src, _ = seq2seq_batch(vocab, 1, source, 1)
    whole, steps, tokens = ({name: [] for name in SEQ2SEQ} for _ in range(3))
    for repeat in range(repeats + 1):  # the first round is a warm-up
        for name, model in models.items():
            clock = _TokenClock()
            start = time.perf_counter()
            out = model.generate(input_ids=src, max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                                 use_cache=True, streamer=clock)
            end = time.perf_counter()
            tokens[name] = out[:, 1:]
            if out.shape[1] != new_tokens + 1 or len(clock.times) != new_tokens + 1:
                raise RuntimeError(f"{name} generated {out.shape[1] - 1} tokens, not {new_tokens}")
            if repeat:
                whole[name].append(new_tokens / (end - start))
                steps[name].append((new_tokens - 1) / (clock.times[-1] - clock.times[1]))
    return dict(whole=whole, steps=steps, tokens=tokens)


VOCAB_NOTES = {
    32128: "T5's 32128, where the output layer and its cross-entropy take a large part of the step (512 × 32128 "
           "per target token)",
    1024: "1024 (as the rest of `scripts/bench.py`), which leaves the step to attention and the MLPs",
}


def seq2seq_report(args, training: dict, memory: dict, decoding: dict) -> list:
    """The seq2seq section's Markdown."""
    up = S2S_UPSTREAM
    step_spread = ", ".join(f"{spread(training[v]['times'][up]):.1f}×" for v in args.vocabs)
    call_spread = ", ".join(f"{spread(decoding[v]['whole'][up]):.1f}×" for v in decoding)
    lines = [
        "## Seq2seq: upstream T5 against its hf_relpos conversion", "",
        "A T5-small-like encoder-decoder with 2 encoder and 2 decoder layers (d_model 512, 8 heads, d_kv 64, "
        f"d_ff 2048, ReLU, 32 buckets, max_distance 128, T5 v1.0's tied output layer, dropout 0), {_dtype_flag()}. "
        "Every contender holds the same seed-0 upstream weights: `hf_relpos.from_t5` converts them (the same "
        "function: the same loss and greedy tokens); `rope` is `RelPosForConditionalGeneration` with "
        "`position_encoding=\"rope\"` and the same weights but for the bias tables (plain fused SDPA, the floor). "
        "Upstream T5's default attention in Transformers 5.23 is sdpa (its position bias goes to SDPA as a dense "
        "float mask); its eager attention is shown too. Vocabulary: "
        + "; ".join(VOCAB_NOTES.get(vocab, str(vocab)) for vocab in args.vocabs) + ".", "",
        "Ratios are to upstream T5 (sdpa): time / upstream's (lower is faster), tokens/s / upstream's (higher is "
        "faster), peak memory / upstream's. Time and tokens/s ratios are medians over rounds of the ratio within "
        "a round (every contender once, back to back, after a warm-up round), so that the other jobs' load, "
        "which changes between rounds on a shared machine, cancels.", "",
        f"### Training step: forward + backward, source {args.source_length}, target {args.target_length}, "
        f"batch {args.batch}", "",
        f"Forward with `labels` (cross-entropy), backward, `zero_grad`; {args.repeats} rounds "
        f"(upstream's slowest step took {step_spread} "
        f"its fastest for vocab {', '.join(map(str, args.vocabs))}). *peak MiB*: the process's VmHWM after one "
        "step, each contender in a process of its own; *of which the step*: above the model's resident set "
        "before it.", "",
        "| vocab | contender | time vs upstream T5 | peak MiB | of which the step | peak vs upstream T5 "
        "| step's memory vs upstream T5 | loss − upstream's |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for vocab in args.vocabs:
        got = training[vocab]
        for name in SEQ2SEQ:
            mem, ref = memory.get((name, vocab)), memory.get((up, vocab))
            same = "(other function)" if name == S2S_ROPE else f"{got['loss'][name] - got['loss'][up]:.1e}"
            lines.append("| " + " | ".join([
                str(vocab), S2S_LABELS[name], f"{paired_ratio(got['times'], name, up):.2f}",
                f"{mem['peak_mib']:.0f}" if mem else "–", f"{mem['delta_mib']:.0f}" if mem else "–",
                f"{mem['peak_mib'] / ref['peak_mib']:.2f}" if mem else "–",
                f"{mem['delta_mib'] / ref['delta_mib']:.2f}" if mem else "–", same,
            ]) + " |")
    lines.append("")
    if decoding:
        lines += [
            f"### Greedy decoding: `generate` of {args.new_tokens} new tokens after a {args.source_length}-token "
            "source, batch 1, cached", "",
            f"{3 * args.repeats} rounds (three times the training step's: a call is short; upstream's slowest call "
            f"took {call_spread} its fastest). "
            f"*whole call*: {args.new_tokens} / "
            "the call's time (encoding the source included); *decode steps*: tokens/s from the first new token to "
            "the last (a streamer's clock), the cached decoder alone; *same tokens*: the greedy tokens equal "
            "upstream T5's (sdpa).", "",
            "| vocab | contender | whole call vs upstream T5 | decode steps vs upstream T5 | same tokens |",
            "| ---: | --- | ---: | ---: | :---: |",
        ]
        for vocab in args.vocabs:
            got = decoding[vocab]
            for name in SEQ2SEQ:
                same = torch.equal(got["tokens"][name], got["tokens"][up])
                cell = "(other function)" if name == S2S_ROPE else ("yes" if same else "**no**")
                lines.append(f"| {vocab} | {S2S_LABELS[name]} | {paired_ratio(got['whole'], name, up):.2f} | "
                             f"{paired_ratio(got['steps'], name, up):.2f} | {cell} |")
        lines.append("")
    return lines


def run_seq2seq(args) -> list:
    from tqdm.auto import tqdm

    training = {vocab: seq2seq_training(vocab, args.batch, args.source_length, args.target_length, args.repeats)
                for vocab in tqdm(args.vocabs, desc="seq2seq training step")}
    memory = {}
    if not args.no_memory:
        for vocab in tqdm(args.vocabs, desc="seq2seq peak memory"):
            for name in SEQ2SEQ:
                memory[(name, vocab)] = seq2seq_memory(name, vocab, args.batch, args.source_length, args.target_length)
    decoding = {}
    if not args.no_decode:
        decoding = {vocab: seq2seq_decoding(vocab, args.source_length, args.new_tokens, 3 * args.repeats)
                    for vocab in tqdm(args.vocabs, desc="seq2seq decoding")}
    return seq2seq_report(args, training, memory, decoding)


def cpu_name() -> str:
    """The CPU's model name and the vector extensions that decide its kernels (AVX2, AVX-512, its bf16, AMX), from
    /proc/cpuinfo (Linux); the platform's processor string elsewhere."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    names = [("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"), ("amx_bf16", "AMX-BF16")]
    found = [name for flag, name in names if flag in flags]
    return f"{fields.get('model name', platform.machine())} ({', '.join(found) or 'no AVX2'}){_capped()}"


def _capped() -> str:
    """The instruction sets the kernels were held to, where they were (``ATEN_CPU_CAPABILITY``, oneDNN's and MKL's
    switches): such a run takes an older CPU's code paths on this one, not its timings."""
    caps = [f"{name}={os.environ[name]}" for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                      "MKL_ENABLE_INSTRUCTIONS") if os.environ.get(name)]
    if not caps:
        return ""
    return f", kernels held to {', '.join(caps)} (ATen runs {torch.backends.cpu.get_cpu_capability()})"


def machine_line(threads: int) -> str:
    """Date, torch version and machine, for the header of a results file."""
    return (f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}; "
            f"{cpu_name()}, {os.cpu_count()} cores, {threads} threads; {str(DTYPE).replace('torch.', '')}")


def load_line(load_start: float) -> str:
    """The 1-minute load average at the start and the end of the run: above the thread count, other jobs
    shared the cores."""
    return (f"1-minute load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
            f"(on {os.cpu_count()} cores; above this run's threads, other jobs shared them)")


def write_report(lines: list, output: str) -> None:
    text = "\n".join(lines) + "\n"
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--causal-lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--schemes", nargs="+", default=SCHEMES, choices=SCHEMES)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="the models' weights and activations (bf16: AMX's or AVX-512 BF16's kernels where the CPU "
                             "has them)")
    parser.add_argument("--quick", action="store_true",
                        help="n=512, contexts 256/1024, 3 repeats; seq2seq: source 512, target 128, vocab 1024")
    parser.add_argument("--output", help="default results/bench-cpu.md (--seq2seq: results/bench-cpu-seq2seq.md)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-process peak memory runs")
    parser.add_argument("--no-decode", action="store_true", help="skip the cached decoding runs")
    parser.add_argument("--compiled-only", action="store_true", help="only the compiled-decoding table")
    parser.add_argument("--compiled-context", type=int, default=1024,
                        help="context of the compiled-decoding runs (0: skip them)")
    parser.add_argument("--padded", action="store_true",
                        help="time a padded batch (the last row's final quarter is padding); implies --no-memory")
    parser.add_argument("--seq2seq", action="store_true",
                        help="only the seq2seq section: upstream T5ForConditionalGeneration against from_t5 and rope")
    parser.add_argument("--no-seq2seq", action="store_true", help="skip the seq2seq section")
    parser.add_argument("--source-length", type=int, default=1024, help="seq2seq source tokens")
    parser.add_argument("--target-length", type=int, default=256, help="seq2seq target tokens (training step)")
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32128, 1024], help="seq2seq vocabulary sizes")
    parser.add_argument("--child-memory", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--child-seq2seq-memory", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global DTYPE
    DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.child_memory:
        name, n, batch = args.child_memory
        return peak_memory_child(name, int(n), int(batch))
    if args.child_seq2seq_memory:
        name, *sizes = args.child_seq2seq_memory
        return seq2seq_memory_child(name, *map(int, sizes))
    if args.quick:
        args.lengths, args.causal_lengths, args.contexts, args.repeats = [512], [512], [256, 1024], 3
        args.source_length, args.target_length, args.vocabs = 512, 128, [1024]
    if args.compiled_only or args.padded:
        args.no_seq2seq = True
    if args.compiled_only:
        args.lengths, args.causal_lengths, args.contexts, args.no_memory = [], [], [], True
    load_start = os.getloadavg()[0]
    if args.seq2seq:
        section = run_seq2seq(args)
        return write_report(
            ["# CPU benchmark: seq2seq", "", f"Command: `python scripts/bench.py {' '.join(sys.argv[1:])}`  ",
             f"{machine_line(args.threads)}; {load_line(load_start)}.", ""] + section,
            args.output or "results/bench-cpu-seq2seq.md",
        )

    from tqdm.auto import tqdm

    schemes = ["rope"] + [s for s in args.schemes if s != "rope"]
    contenders = [s for s in schemes if s not in CAUSAL_ONLY] + ([UPSTREAM] if "t5_bias" in schemes else [])
    rows = {}
    jobs = [(n, mode) for n in args.lengths for mode in ("fwd", "fwd+bwd")]
    for n, mode in tqdm(jobs, desc="bidirectional"):
        rows[(n, mode)] = time_interleaved(contenders, n, args.batch, args.repeats, mode, padded=args.padded)
    causal_rows = {}
    jobs = [(n, mode) for n in args.causal_lengths for mode in ("fwd", "fwd+bwd", "prefill")]
    for n, mode in tqdm(jobs, desc="causal"):
        causal_rows[(n, mode)] = time_interleaved(schemes, n, args.batch, args.repeats, mode, causal=True,
                                                  padded=args.padded)
    memory = {}
    if not (args.no_memory or args.padded):
        for n in tqdm(args.lengths, desc="peak memory"):
            for name in contenders:
                memory[(name, n)] = peak_memory(name, n, args.batch)
    decode = {}
    for context in tqdm([] if args.no_decode else args.contexts, desc="decoding"):
        for name, rate in decode_tokens_per_second(schemes, context, args.new_tokens, args.repeats).items():
            decode[(name, context)] = rate
    compiled = {}
    if not args.no_decode and args.compiled_context:
        compiled = compiled_decoding(schemes, args.compiled_context, args.new_tokens, args.repeats)
    seq2seq = [] if args.no_seq2seq else run_seq2seq(args)

    lines = [
        "# CPU benchmark",
        "",
        f"Command: `python scripts/bench.py {' '.join(sys.argv[1:])}`  ",
        f"{machine_line(args.threads)}; batch {args.batch}, hidden 512, 8 heads, 2 layers, intermediate 2048; "
        f"medians of {args.repeats} interleaved runs after a warm-up."
        + (" **Padded batch**: the last row's final quarter is padding (attention_mask)." if args.padded else "")
        + f" {load_line(load_start)}.",
        "",
        "Times are ratios: **vs rope** = this scheme's time / rope's (plain fused SDPA, the floor); "
        "**vs upstream** = t5_bias's time / `transformers.T5EncoderModel`'s (same size and buckets). "
        "Lower is faster. Absolute times on this shared CPU are not meaningful.",
        "",
    ]
    for n in args.lengths:
        lines += [f"## Bidirectional (as T5's encoder), n = {n}", "", "| scheme | fwd vs rope | fwd+bwd vs rope | fwd vs upstream T5 | fwd+bwd vs upstream T5 | peak MiB (fwd+bwd) | of which the step |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        fwd, bwd = rows[(n, "fwd")], rows[(n, "fwd+bwd")]
        for name in contenders:
            versus_t5 = name == "t5_bias" and UPSTREAM in fwd
            mem = memory.get((name, n))
            cells = [
                name,
                f"{fwd[name] / fwd['rope']:.2f}",
                f"{bwd[name] / bwd['rope']:.2f}",
                f"{fwd[name] / fwd[UPSTREAM]:.2f}" if versus_t5 else "",
                f"{bwd[name] / bwd[UPSTREAM]:.2f}" if versus_t5 else "",
                f"{mem['peak_mib']:.0f}" if mem else "–",
                f"{mem['delta_mib']:.0f}" if mem else "–",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    for n in args.causal_lengths:
        lines += [f"## Causal, n = {n}", "",
                  "The decoder use (`is_decoder=True`): time as a ratio to causal rope's; *prefill* is an inference "
                  "forward that fills a `DynamicCache`.", "",
                  "| scheme | fwd vs rope | fwd+bwd vs rope | prefill with cache vs rope |", "| --- | ---: | ---: | ---: |"]
        got = [causal_rows[(n, mode)] for mode in ("fwd", "fwd+bwd", "prefill")]
        for name in schemes:
            lines.append(f"| {name} | " + " | ".join(f"{t[name] / t['rope']:.2f}" for t in got) + " |")
        lines.append("")
    if decode:
        lines += ["## Cached decoding", "",
                  f"Tokens/s generating {args.new_tokens} tokens (batch 1, greedy, causal model) after a context, as a "
                  "ratio to rope's tokens/s (higher is faster).", "",
                  "| scheme | " + " | ".join(f"context {c}" for c in args.contexts) + " |",
                  "| --- | " + " | ".join("---:" for _ in args.contexts) + " |"]
        for name in schemes:
            lines.append(f"| {name} | " + " | ".join(
                f"{decode[(name, c)] / decode[('rope', c)]:.2f}" for c in args.contexts) + " |")
        lines.append("")
    if compiled:
        lines += ["## Compiled decoding", "",
                  f"Greedy decoding of {args.new_tokens} tokens into a `StaticCache` after an eager prefill of "
                  f"{args.compiled_context} tokens (batch 1): one decode step compiled with `torch.compile(fullgraph=True)` "
                  "(inductor) against the same step in eager mode. *compiled vs eager*: tokens/s ratio (higher is "
                  "faster); *vs rope compiled*: this scheme's compiled tokens/s over rope's; *same tokens*: the "
                  "compiled and eager greedy tokens agree.", "",
                  "| scheme | compiled vs eager | vs rope compiled | compile time s | same tokens |",
                  "| --- | ---: | ---: | ---: | :---: |"]
        for name in schemes:
            got = compiled[name]
            lines.append(f"| {name} | {got['compiled'] / got['eager']:.2f} | "
                         f"{got['compiled'] / compiled['rope']['compiled']:.2f} | {got['compile_s']:.0f} | "
                         f"{'yes' if got['same_tokens'] else '**no**'} |")
        lines.append("")
    write_report(lines + seq2seq, args.output or "results/bench-cpu.md")


if __name__ == "__main__":
    main()
