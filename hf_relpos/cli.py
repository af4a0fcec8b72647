"""``hf-relpos``: train, generate, eval, validate-t5 and compare from the command line.

Thin: each subcommand parses its arguments, calls the library and prints. The heavy lifting is
Transformers' ``Trainer`` and ``generate`` on hf_relpos models.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

from .configuration_relpos import POSITION_ENCODINGS

PRESETS = {
    "tiny": dict(hidden_size=128, num_attention_heads=4, num_hidden_layers=2, intermediate_size=512),
    "small": dict(hidden_size=256, num_attention_heads=4, num_hidden_layers=4, intermediate_size=1024),
}
RUN_FILE = "hf_relpos_run.json"  # what train did, read back by eval and by the model card
CARDS_DIR = Path(__file__).resolve().parent / "model_cards"  # package data (pyproject.toml)


# ----------------------------------------------------------------------------------------------
# train
# ----------------------------------------------------------------------------------------------


def build_config(scheme: str, preset: str, seq_len: int, vocab_size: int, mem_len: Optional[int]):
    from .configuration_relpos import RelPosConfig

    extra = {}
    if scheme == "learned":
        extra["max_position_embeddings"] = seq_len  # a learned table cannot run past what it was trained on
    elif scheme == "sinusoidal":
        extra["max_position_embeddings"] = max(2048, 16 * seq_len)
    elif scheme == "transformer_xl":
        extra["mem_len"] = seq_len if mem_len is None else mem_len
    return RelPosConfig(position_encoding=scheme, vocab_size=vocab_size, **PRESETS[preset], **extra)


def position_parameter_count(model) -> int:
    """Parameters that belong to the position scheme (shared tables and per-layer relative parameters)."""
    base = model.model
    count = sum(p.numel() for p in base.position.parameters())
    for layer in base.layers:
        relative = layer.self_attn.relative
        if relative is not None:
            count += sum(p.numel() for p in relative.parameters())
    return count


def load_corpus(train_files):
    from .data import embedded_corpus, read_text_files

    if train_files:
        return read_text_files(train_files), "user files: " + ", ".join(str(f) for f in train_files)
    return embedded_corpus(), "Python's bundled documentation (pydoc_data.topics), split 85/5/10 within each topic"


def train(args) -> dict:
    """Train one scheme on the corpus and write a Hub-ready folder. Returns the run summary."""
    import torch
    from transformers import GenerationConfig, Trainer, TrainingArguments, set_seed

    from .data import Chunks, encode, train_tokenizer
    from .memory import MemoryTrainer, OrderedSegments, segment_perplexity
    from .modeling_relpos import RelPosForCausalLM

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    set_seed(args.seed)
    corpus, corpus_name = load_corpus(args.train_file)
    tokenizer = train_tokenizer([corpus["train"]], vocab_size=args.vocab_size)
    streams = {part: encode(tokenizer, text) for part, text in corpus.items()}
    config = build_config(args.position_encoding, args.preset, args.seq_len, len(tokenizer), args.mem_len)
    model = RelPosForCausalLM(config)

    with_memory = config.position_encoding == "transformer_xl" and config.mem_len > 0
    if with_memory:
        train_set = OrderedSegments(streams["train"], args.batch_size, args.seq_len)
        eval_set = OrderedSegments(streams["validation"][: 64 * args.seq_len], args.batch_size, args.seq_len)
        trainer_class = MemoryTrainer
    else:
        train_set = Chunks(streams["train"], args.seq_len)
        eval_set = Chunks(streams["validation"], args.seq_len, limit=64)
        trainer_class = Trainer
    eval_steps = max(1, args.steps // 4)
    distributed_cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    training_args = TrainingArguments(
        output_dir=str(out.parent / f"{out.name}-checkpoints"),  # keeps the model folder Hub-ready
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 20),
        weight_decay=0.01,
        logging_steps=max(1, args.steps // 20),
        eval_strategy="steps",
        eval_steps=eval_steps,
        save_strategy="steps",
        save_steps=eval_steps,
        save_total_limit=1,
        report_to=[],
        seed=args.seed,
        dataloader_pin_memory=False,
        disable_tqdm=args.quiet,
        # Under torchrun, Transformer-XL's ordered batches are split by rows so each rank keeps its rows.
        accelerator_config={"split_batches": True} if with_memory and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        # torchrun on CPU-only machines: DDP over gloo (Transformers would otherwise run each rank alone).
        use_cpu=distributed_cpu,
        ddp_backend="gloo" if distributed_cpu else None,
    )
    trainer = trainer_class(model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set)
    started = time.time()
    trainer.train(resume_from_checkpoint=args.resume)
    seconds = time.time() - started
    if not trainer.is_world_process_zero():  # under torchrun, rank 0 alone writes the folder
        return {}

    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_new_tokens=64
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    test = streams["test"]
    max_tokens = args.eval_tokens
    ppl = segment_perplexity(model, test, args.seq_len, use_memory=False, max_tokens=max_tokens)
    summary = {
        "position_encoding": config.position_encoding,
        "preset": args.preset,
        "seq_len": args.seq_len,
        "mem_len": config.mem_len,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "processes": training_args.world_size,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
        "corpus": corpus_name,
        "train_tokens": int(streams["train"].numel()),
        "test_tokens": int(min(test.numel(), max_tokens or test.numel())),
        "vocab_size": len(tokenizer),
        "parameters": sum(p.numel() for p in model.parameters()),
        "position_parameters": position_parameter_count(model),
        "train_seconds": round(seconds, 1),
        "final_train_loss": next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None),
        "test_ppl": ppl,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    if with_memory:
        summary["test_ppl_with_memory"] = segment_perplexity(model, test, args.seq_len, max_tokens=max_tokens)
    (out / RUN_FILE).write_text(json.dumps(summary, indent=2))
    write_model_card(out, summary)
    if not args.quiet:
        print(f"\nSaved to {out}/ — test perplexity at length {args.seq_len}: {ppl:.2f}")
        if with_memory:
            print(f"  with memory (mem_len={config.mem_len}): {summary['test_ppl_with_memory']:.2f}")
    return summary


def write_model_card(folder: Path, summary: dict) -> None:
    template_path = CARDS_DIR / f"{summary['position_encoding']}.md"
    if not template_path.is_file():
        raise FileNotFoundError(f"model card template {template_path} is missing: run from a checkout of hf_relpos")
    training = "\n".join(
        [
            "| | |",
            "| --- | --- |",
            f"| corpus | {summary['corpus']} |",
            f"| training tokens | {summary['train_tokens']:,} |",
            f"| model size | preset `{summary['preset']}`, {summary['parameters']:,} parameters "
            f"({summary['position_parameters']:,} in the position scheme) |",
            f"| sequence length | {summary['seq_len']} tokens" + (f", memory {summary['mem_len']}" if summary["mem_len"] else "") + " |",
            f"| steps × batch | {summary['steps']} × {summary['batch_size']}, learning rate {summary['learning_rate']}, seed {summary['seed']} |",
            f"| final training loss | {summary['final_train_loss']:.3f} |" if summary["final_train_loss"] else "| final training loss | n/a |",
            f"| test perplexity at length {summary['seq_len']} | {summary['test_ppl']:.2f} "
            f"({summary['test_tokens']:,} held-out tokens) |",
        ]
        + ([f"| test perplexity with memory | {summary['test_ppl_with_memory']:.2f} |"] if "test_ppl_with_memory" in summary else [])
        + [f"| trained on | {summary['date']}, torch {summary['torch']}, {summary['train_seconds']} s |"]
    )
    card = template_path.read_text().replace("{{training}}", training)
    (folder / "README.md").write_text(card)


# ----------------------------------------------------------------------------------------------
# generate and eval
# ----------------------------------------------------------------------------------------------


def load_folder(folder: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ValueError(f"folder {folder!r} holds no config.json: pass a folder written by `hf-relpos train`")
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    return model, tokenizer


def generate(args) -> str:
    import torch
    from transformers import TextStreamer

    model, tokenizer = load_folder(args.folder)
    inputs = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False, return_token_type_ids=False)
    streamer = None if args.quiet else TextStreamer(tokenizer)
    torch.manual_seed(args.seed)
    output = model.generate(
        **inputs,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.temperature > 0,
        temperature=args.temperature if args.temperature > 0 else None,
        top_k=args.top_k if args.temperature > 0 else None,
        use_cache=True,
        streamer=streamer,
    )
    return tokenizer.decode(output[0], skip_special_tokens=True)


def evaluate_lengths(model, stream, lengths, max_tokens=None) -> dict:
    """Perplexity at each evaluation length (independent segments); inf where the scheme cannot run."""
    from .memory import segment_perplexity

    result = {}
    for length in lengths:
        try:
            result[length] = segment_perplexity(model, stream, length, use_memory=False, max_tokens=max_tokens)
        except ValueError as error:
            if "max_position_embeddings" not in str(error):
                raise
            result[length] = math.inf  # a learned position table ends before this length
    return result


def evaluate(args) -> dict:
    from .data import encode, read_text_files, embedded_corpus
    from .memory import segment_perplexity

    model, tokenizer = load_folder(args.folder)
    run_file = Path(args.folder) / RUN_FILE
    run = json.loads(run_file.read_text()) if run_file.is_file() else {}
    seq_len = args.seq_len or run.get("seq_len")
    if not seq_len:
        raise ValueError(f"--seq-len is needed: {run_file} is missing")
    text = read_text_files(args.eval_file)["test"] if args.eval_file else embedded_corpus()["test"]
    stream = encode(tokenizer, text)
    lengths = [seq_len * f for f in args.factors]
    result = {f"ppl@{n}": p for n, p in evaluate_lengths(model, stream, lengths, args.eval_tokens).items()}
    if getattr(model.config, "mem_len", 0) > 0:
        result[f"ppl@{seq_len}+memory{model.config.mem_len}"] = segment_perplexity(
            model, stream, seq_len, use_memory=True, max_tokens=args.eval_tokens
        )
    for name, value in result.items():
        print(f"{name:>24}: {value:.2f}")
    return result


# ----------------------------------------------------------------------------------------------
# validate-t5
# ----------------------------------------------------------------------------------------------


def validate_t5(args) -> int:
    import torch
    import transformers
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    from .functional import t5_position_bias, t5_relative_position_bucket

    torch.manual_seed(0)
    relative = torch.cat([torch.arange(-5000, 5001), torch.tensor([-(10**9), -(2**31 - 1), 10**6, 2**31 - 1])])
    cases = values = mismatches = 0
    max_error = 0.0
    for bidirectional in (True, False):
        for num_buckets in (4, 6, 8, 16, 31, 32, 33, 64, 128):
            exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
            for max_distance in sorted({exact + 1, 20, 64, 128, 500, 4096} - set(range(exact + 1))):
                ours = t5_relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
                theirs = T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
                cases += 1
                values += relative.numel()
                mismatches += int((ours != theirs).sum())
                config = T5Config(
                    num_heads=3, d_model=12, d_kv=4, relative_attention_num_buckets=num_buckets,
                    relative_attention_max_distance=max_distance, is_decoder=not bidirectional,
                )
                attention = T5Attention(config, has_relative_attention_bias=True)
                for query_length, key_length, past in ((7, 7, 0), (1, 300, 299), (5, 2000, 1995), (3, 9, 100)):
                    expected = attention.compute_bias(query_length, key_length, past_seen_tokens=past)
                    got = t5_position_bias(
                        attention.relative_attention_bias.weight, query_length, key_length,
                        bidirectional=bidirectional, max_distance=max_distance, past_length=past,
                    )
                    cases += 1
                    values += expected.numel()
                    error = (got - expected).abs().max().item()
                    max_error = max(max_error, error)
                    mismatches += int((got != expected).sum())
    status = "OK" if mismatches == 0 else "MISMATCH"
    print(f"T5 parity with transformers {transformers.__version__} (torch {torch.__version__}): {status}")
    print(f"  cases: {cases}   values checked: {values:,}   mismatches: {mismatches}   max abs error: {max_error:g}")
    return 0 if mismatches == 0 else 1


# ----------------------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------------------


def compare(args) -> dict:
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from .data import encode
    from .memory import segment_perplexity
    from .modeling_relpos import RelPosForCausalLM

    out, models = Path(args.output_dir), Path(args.models_dir)
    out.mkdir(parents=True, exist_ok=True)
    schemes = args.schemes or list(POSITION_ENCODINGS)
    factors = (1, 2, 4)
    rows = []
    for scheme in tqdm(schemes, desc="schemes"):
        run_args = argparse.Namespace(**{**vars(args), "position_encoding": scheme, "output_dir": str(models / scheme),
                                         "quiet": True, "resume": None, "mem_len": args.mem_len})
        summary = train(run_args)
        model = RelPosForCausalLM.from_pretrained(models / scheme).eval()
        tokenizer = AutoTokenizer.from_pretrained(models / scheme)
        corpus, _ = load_corpus(args.train_file)
        stream = encode(tokenizer, corpus["test"])
        ppl = evaluate_lengths(model, stream, [args.seq_len * f for f in factors], args.eval_tokens)
        row = {"scheme": scheme, "position_params": summary["position_parameters"],
               **{f"ppl_{f}x": ppl[args.seq_len * f] for f in factors}}
        if model.config.mem_len > 0:
            row["ppl_1x_with_memory"] = segment_perplexity(model, stream, args.seq_len, max_tokens=args.eval_tokens)
        rows.append(row)
        tqdm.write(f"{scheme:>15}: " + "  ".join(f"{f}x {row[f'ppl_{f}x']:.2f}" for f in factors))
    meta = {
        "command": "hf-relpos " + " ".join(getattr(args, "argv", ["compare"])),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPU cores, {sys.platform}",
        "seq_len": args.seq_len, "steps": args.steps, "preset": args.preset, "batch_size": args.batch_size,
        "seed": args.seed, "eval_tokens": args.eval_tokens,
    }
    (out / "compare.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    table = render_table(rows, args.seq_len, meta)
    (out / "compare.md").write_text(table)
    plot(rows, args.seq_len, factors, out / "compare.png")
    print(table)
    return {"meta": meta, "rows": rows}


def render_table(rows, seq_len, meta) -> str:
    def cell(value):
        return "∞ (cannot run)" if math.isinf(value) else f"{value:.2f}"

    lines = [
        f"Perplexity on held-out text, trained at L={seq_len}, evaluated on non-overlapping segments of L, 2L, 4L.",
        "",
        "| scheme | position params | train PPL (L) | 2x PPL | 4x PPL |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['scheme']} | {row['position_params']:,} | {cell(row['ppl_1x'])} | {cell(row['ppl_2x'])} | "
            f"{cell(row['ppl_4x'])} |"
        )
    memory = [r for r in rows if "ppl_1x_with_memory" in r]
    if memory:
        lines += ["", "Transformer-XL with its segment memory at L: "
                  + ", ".join(f"{r['ppl_1x_with_memory']:.2f}" for r in memory)]
    lines += ["", f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; machine: {meta['machine']}; "
              f"preset {meta['preset']}, {meta['steps']} steps × batch {meta['batch_size']}, seed {meta['seed']}."]
    return "\n".join(lines) + "\n"


def plot(rows, seq_len, factors, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lengths = [seq_len * f for f in factors]
    for row in rows:
        values = [row[f"ppl_{f}x"] for f in factors]
        finite = [(n, v) for n, v in zip(lengths, values) if math.isfinite(v)]
        if finite:
            ax.plot(*zip(*finite), marker="o", label=row["scheme"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity (held-out text)")
    ax.set_title(f"Length extrapolation, trained at L={seq_len}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# argument parsing
# ----------------------------------------------------------------------------------------------


def _add_training_arguments(p, steps, seq_len):
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size (default: tiny)")
    p.add_argument("--seq-len", type=int, default=seq_len, help=f"training sequence length L (default: {seq_len})")
    p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps (default: {steps})")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary trained on the corpus")
    p.add_argument("--mem-len", type=int, default=None, help="Transformer-XL memory (default: the sequence length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-file", nargs="*", default=None, help="your own text files instead of the embedded corpus")
    p.add_argument("--eval-tokens", type=int, default=None, help="cap on held-out tokens evaluated")


def _positive(name, value):
    if value is not None and value < 1:
        raise SystemExit(f"hf-relpos: error: {name} must be >= 1, got {value}")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="hf-relpos", description=__doc__.splitlines()[0])
    sub = root.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train one scheme and write a Hub-ready folder")
    p.add_argument("--position-encoding", choices=POSITION_ENCODINGS, default="t5_bias")
    p.add_argument("--output-dir", default="runs/model")
    p.add_argument("--resume", nargs="?", const=True, default=None, help="resume from the last (or the given) checkpoint")
    p.add_argument("--quiet", action="store_true")
    _add_training_arguments(p, steps=400, seq_len=128)

    p = sub.add_parser("generate", help="generate text from a trained folder (streams to the terminal)")
    p.add_argument("folder")
    p.add_argument("--prompt", default="The")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")

    p = sub.add_parser("eval", help="perplexity of a folder at L, 2L, 4L (and with memory)")
    p.add_argument("folder")
    p.add_argument("--seq-len", type=int, default=None, help="L (default: the training length)")
    p.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--eval-file", nargs="*", default=None)
    p.add_argument("--eval-tokens", type=int, default=None)

    sub.add_parser("validate-t5", help="check T5 buckets and bias against the installed Transformers")

    p = sub.add_parser("compare", help="the length-extrapolation experiment over every scheme")
    p.add_argument("--output-dir", default="results/compare", help="where the table (md, json) and plot go")
    p.add_argument("--models-dir", default="runs/compare", help="where the trained model folders go")
    p.add_argument("--schemes", nargs="+", choices=POSITION_ENCODINGS, default=None)
    p.add_argument("--quick", action="store_true", help="a few-minute run (fewer steps, shorter L)")
    _add_training_arguments(p, steps=500, seq_len=128)
    return root


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for factor in getattr(args, "factors", None) or []:
        _positive("--factors", factor)
    for name in ("seq_len", "steps", "batch_size", "max_new_tokens", "eval_tokens", "vocab_size"):
        _positive("--" + name.replace("_", "-"), getattr(args, name, None))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.command == "train":
        train(args)
    elif args.command == "generate":
        text = generate(args)
        if args.quiet:
            print(text)
        else:
            print()
    elif args.command == "eval":
        evaluate(args)
    elif args.command == "validate-t5":
        return validate_t5(args)
    elif args.command == "compare":
        if args.quick:
            args.steps, args.seq_len = min(args.steps, 60), min(args.seq_len, 64)
            args.eval_tokens = min(args.eval_tokens or 4096, 4096)
        compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
