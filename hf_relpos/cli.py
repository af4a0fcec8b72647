"""``hf-relpos`` commands: train, generate, eval, validate-t5, convert-t5, compare and inspect.

Thin: each command checks what it was given (a :class:`UserError` names the flag, what was given and
what is allowed), calls the library and prints. The heavy lifting is Transformers' ``Trainer`` and
``generate`` on hf_relpos models. Parsing and the one error handler live in ``hf_relpos_cli``, which
imports no torch, so that ``--help`` answers at once.

Nothing a user made is replaced without ``--overwrite``, and nothing is deleted: an earlier run's
checkpoints are renamed aside. Ctrl-C during training saves a resumable checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from hf_relpos_cli import PRESETS, Interrupted, UserError, main  # noqa: F401  (main: `python -m hf_relpos.cli`)

RUN_FILE = "hf_relpos_run.json"  # what train did, read back by eval and by the model card
INSPECT_DIR = "inspect"  # where `inspect` writes its figures by default, inside the model folder
# In each checkpoint: training seconds so far (a resumed run counts all of it) and the options that shape the
# model and its data (a resume with other ones would not continue this run).
TIME_FILE = "hf_relpos_time.json"
RUN_OPTIONS = ("position_encoding", "preset", "seq_len", "vocab_size", "mem_len", "train_file", "seed", "batch_size",
               "learning_rate")
CARDS_DIR = Path(__file__).resolve().parent / "model_cards"  # package data (pyproject.toml)
# What `save_pretrained` and the tokenizer write into a model folder, and what train adds.
MODEL_FILE = re.compile(
    r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|chat_template)\.json"
    r"|model(-\d+-of-\d+)?\.safetensors(\.index\.json)?|[a-z_]+\.py|README\.md|chat_template\.jinja"
    + "|" + re.escape(RUN_FILE)
    + "|" + re.escape(INSPECT_DIR)  # inspect's figures: the folder stays one train --overwrite / --resume accepts
)


# ----------------------------------------------------------------------------------------------
# folders: what may be written where
# ----------------------------------------------------------------------------------------------


def _is_model_folder(folder: Path) -> bool:
    config = folder / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type") == "relpos"
    except (OSError, ValueError):
        return False


def _checkpoints_dir(out: Path) -> Path:
    return out.parent / f"{out.name}-checkpoints"


def _last_checkpoint(folder: Path) -> Optional[Path]:
    steps = [(int(p.name.split("-")[1]), p) for p in folder.glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
    return max(steps)[1] if steps else None


def prepare_output(out: Path, *, overwrite: bool, resume) -> Optional[Path]:
    """Refuse what would replace or delete a user's work; returns the checkpoint to resume from (or None).

    A non-empty ``out`` must be an hf-relpos model folder holding nothing else, and is replaced only with
    ``--overwrite`` (or continued with ``--resume``). An earlier run's checkpoints are renamed aside, never
    deleted.
    """
    for folder, flag in ((out, "--output-dir"), (_checkpoints_dir(out), "--output-dir's checkpoint folder")):
        if folder.exists() and not folder.is_dir():
            raise UserError(f"{flag} {str(folder)!r} is a file: give a folder path")
    contents = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if contents:
        foreign = [name for name in contents if not MODEL_FILE.fullmatch(name)]
        if not _is_model_folder(out) or foreign:
            shown = ", ".join((foreign or contents)[:3])
            raise UserError(
                f"--output-dir {str(out)!r} holds files that are not an hf-relpos model ({shown}); "
                "give a new or empty folder (nothing is replaced there, --overwrite or not)"
            )
        if not (overwrite or resume):
            raise UserError(
                f"--output-dir {str(out)!r} already holds a trained model: pass --overwrite to replace it "
                "(its checkpoints are kept) or --resume to continue its training"
            )
    checkpoints = _checkpoints_dir(out)
    if resume:
        checkpoint = Path(resume) if isinstance(resume, str) else _last_checkpoint(checkpoints)
        if checkpoint is None or not (checkpoint / "trainer_state.json").is_file():
            where = str(checkpoint) if isinstance(resume, str) else f"{str(checkpoints)!r}"
            raise UserError(f"--resume: no checkpoint to resume from in {where}; train without --resume first")
        return checkpoint
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        if not overwrite:
            raise UserError(
                f"{str(checkpoints)!r} holds checkpoints of an earlier run: pass --resume to continue it, or "
                "--overwrite to start afresh (they are then renamed aside, not deleted)"
            )
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 alone moves files
            aside = checkpoints.with_name(f"{checkpoints.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            checkpoints.rename(aside)
            print(f"hf-relpos train: the earlier run's checkpoints were moved to {aside}", file=sys.stderr)
    return None


class _RemoveIfEmptyOnFailure:
    """A failed command leaves no empty folder behind: folders it created are removed if still empty."""

    def __init__(self, *folders: Path):
        self.new = [f for f in folders if not f.exists()]

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        if kind is not None:
            for folder in self.new:
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
        return False


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
        try:
            corpus = read_text_files(train_files)
        except ValueError as error:
            raise UserError(str(error)) from None
        return corpus, "user files: " + ", ".join(Path(f).name for f in train_files)
    return embedded_corpus(), "Python's bundled documentation (pydoc_data.topics), split 85/5/10 within each topic"


class _Progress:
    """One progress bar for training, loss in it, each evaluation on a line of its own (not Trainer's log dicts)."""

    def __new__(cls):
        from tqdm.auto import tqdm
        from transformers import TrainerCallback

        class Progress(TrainerCallback):
            bar = None

            def on_train_begin(self, args, state, control, **kwargs):
                if state.is_world_process_zero:
                    self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="training", unit="step")

            def on_step_end(self, args, state, control, **kwargs):
                if self.bar is not None:
                    self.bar.update(state.global_step - self.bar.n)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if self.bar is None or not logs:
                    return
                if "loss" in logs:
                    self.bar.set_postfix(loss=f"{logs['loss']:.3f}")
                if "eval_loss" in logs:
                    loss = logs["eval_loss"]
                    self.bar.write(f"step {state.global_step}: validation loss {loss:.3f} (perplexity {math.exp(min(loss, 50)):.2f})")

            def on_train_end(self, args, state, control, **kwargs):
                if self.bar is not None:
                    self.bar.close()

        return Progress()


class _Bookkeeping:
    """Ctrl-C stops training at the end of the current step with a checkpoint; each checkpoint records the
    training seconds so far, so that a resumed run reports its whole training time."""

    def __new__(cls, previous_seconds: float, options: dict):
        from transformers import TrainerCallback

        class Bookkeeping(TrainerCallback):
            def __init__(self):
                self.interrupted = False
                self.started = time.time()
                self.previous = previous_seconds

            def seconds(self) -> float:
                return self.previous + time.time() - self.started

            def on_step_end(self, args, state, control, **kwargs):
                if self.interrupted:
                    control.should_save = True
                    control.should_training_stop = True

            def on_save(self, args, state, control, **kwargs):
                folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                if state.is_world_process_zero and folder.is_dir():
                    record = {"train_seconds": round(self.seconds(), 1), "options": options}
                    (folder / TIME_FILE).write_text(json.dumps(record))

        return Bookkeeping()


def _run_options(args) -> dict:
    options = {name: getattr(args, name, None) for name in RUN_OPTIONS}
    if options["train_file"]:  # the files themselves, wherever the command runs from
        options["train_file"] = [str(Path(f).resolve()) for f in options["train_file"]]
    return options


def _check_resume_options(resume_from: Path, options: dict) -> None:
    """A resume continues the same run: the options that shape the model and data must be the checkpoint's."""
    record = resume_from / TIME_FILE
    saved = json.loads(record.read_text()).get("options") if record.is_file() else None
    if not saved:
        return  # a checkpoint from before options were recorded
    changed = [name for name in RUN_OPTIONS if name in saved and saved[name] != options[name]]
    if changed:
        flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
        was = ", ".join(f"{flag(name)} {saved[name]!r}" for name in changed)
        now = ", ".join(f"{flag(name)} {options[name]!r}" for name in changed)
        raise UserError(
            f"--resume: {resume_from} was trained with {was}, this command gives {now}; resume with the original "
            "options (or train afresh with --overwrite)"
        )


def _resume_command(argv: list) -> str:
    argv = [a for a in argv if a not in ("--overwrite",)]
    if not any(a == "--resume" or a.startswith("--resume=") for a in argv):
        argv = argv + ["--resume"]
    return "hf-relpos " + shlex.join(argv)


def train(args) -> dict:
    """Train one scheme on the corpus and write a Hub-ready folder. Returns the run summary."""
    out = Path(args.output_dir)
    if args.mem_len is not None and args.position_encoding != "transformer_xl":
        raise UserError(
            f"--mem-len applies to --position-encoding transformer_xl only, got --position-encoding "
            f"{args.position_encoding}"
        )
    resume_from = prepare_output(out, overwrite=args.overwrite, resume=args.resume)
    with _RemoveIfEmptyOnFailure(out, _checkpoints_dir(out)):
        return _train(args, out, resume_from)


def _end_process_group() -> None:
    """Under torchrun, destroy the process group (Trainer's objects, in reference cycles, keep it alive) so that
    gloo joins its worker threads before the interpreter finalizes: one still running then can abort the rank."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _train(args, out: Path, resume_from: Optional[Path]) -> dict:
    import torch
    from transformers import GenerationConfig, Trainer, TrainingArguments, set_seed
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from .data import Chunks, encode, train_tokenizer
    from .memory import MemoryTrainer, OrderedSegments, segment_perplexity
    from .modeling_relpos import RelPosForCausalLM

    if resume_from is not None:
        _check_resume_options(resume_from, _run_options(args))
    set_seed(args.seed)
    corpus, corpus_name = load_corpus(args.train_file)
    tokenizer = train_tokenizer([corpus["train"]], vocab_size=args.vocab_size)
    streams = {part: encode(tokenizer, text) for part, text in corpus.items()}
    shortest = min(("train", "validation", "test"), key=lambda part: streams[part].numel())
    if streams[shortest].numel() <= args.seq_len:
        raise UserError(
            f"--seq-len {args.seq_len} is longer than the data: its {shortest} split holds "
            f"{streams[shortest].numel()} tokens; use a shorter --seq-len or more text"
        )
    config = build_config(args.position_encoding, args.preset, args.seq_len, len(tokenizer), args.mem_len)
    if resume_from is not None and (resume_from / "config.json").is_file():
        saved_vocab = json.loads((resume_from / "config.json").read_text()).get("vocab_size")
        if saved_vocab is not None and saved_vocab != config.vocab_size:  # the same options, other text on disk
            raise UserError(
                f"--resume: {resume_from} holds a model of {saved_vocab} tokens, but this command's data gives a "
                f"vocabulary of {config.vocab_size}: the training text changed since; resume with the original text"
            )
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
        output_dir=str(_checkpoints_dir(out)),  # keeps the model folder Hub-ready
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
        disable_tqdm=True,  # our own bar (_Progress) instead of Trainer's bar and raw log dicts
        # Under torchrun, Transformer-XL's ordered batches are split by rows so each rank keeps its rows.
        accelerator_config={"split_batches": True} if with_memory and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        # torchrun on CPU-only machines: DDP over gloo (Transformers would otherwise run each rank alone).
        use_cpu=distributed_cpu,
        ddp_backend="gloo" if distributed_cpu else None,
    )
    trainer = trainer_class(model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if not args.quiet:
        trainer.add_callback(_Progress())
    previous = 0.0
    if resume_from is not None and (resume_from / TIME_FILE).is_file():
        previous = json.loads((resume_from / TIME_FILE).read_text())["train_seconds"]
    book = _Bookkeeping(previous, _run_options(args))
    trainer.add_callback(book)

    def on_interrupt(signum, frame):
        if book.interrupted:  # a second Ctrl-C: stop now, without a checkpoint
            raise KeyboardInterrupt
        book.interrupted = True

    handler = signal.signal(signal.SIGINT, on_interrupt) if _main_thread() else None
    try:
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
    finally:
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
    seconds = book.seconds()
    if book.interrupted:
        checkpoint = _checkpoints_dir(out) / f"checkpoint-{trainer.state.global_step}"
        raise Interrupted(
            f"interrupted at step {trainer.state.global_step} of {args.steps}; checkpoint saved in {checkpoint}.",
            _resume_command(args.argv),
        )
    if not trainer.is_world_process_zero():  # under torchrun, rank 0 alone writes the folder
        return {}

    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_new_tokens=64
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    test = streams["test"]
    max_tokens = args.eval_tokens
    factors = getattr(args, "eval_factors", (1, 2, 4))
    stride = args.seq_len if getattr(args, "sliding", False) else None
    ppl = evaluate_lengths(model, test, [args.seq_len * f for f in factors], max_tokens, stride=stride)
    summary = {
        "command": "hf-relpos " + shlex.join(args.argv),
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
        "test_ppl": ppl[args.seq_len],
        "test_ppl_by_length": {str(n): p for n, p in ppl.items()},
        "evaluation": _evaluation_name(args),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    if with_memory:
        summary["test_ppl_with_memory"] = segment_perplexity(model, test, args.seq_len, max_tokens=max_tokens)
    (out / RUN_FILE).write_text(json.dumps(summary, indent=2))
    write_model_card(out, summary)
    line = f"Saved to {out}/ — test perplexity at length {args.seq_len}: {summary['test_ppl']:.2f}"
    if with_memory:
        line += f" ({summary['test_ppl_with_memory']:.2f} with memory {config.mem_len})"
    print(line)
    return summary


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


BIBTEX = {
    "t5_bias": """@article{raffel2020t5,
  title={Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer},
  author={Raffel, Colin and Shazeer, Noam and Roberts, Adam and Lee, Katherine and Narang, Sharan and Matena, Michael and Zhou, Yanqi and Li, Wei and Liu, Peter J.},
  journal={Journal of Machine Learning Research}, volume={21}, number={140}, pages={1--67}, year={2020}
}""",
    "shaw": """@inproceedings{shaw2018relative,
  title={Self-Attention with Relative Position Representations},
  author={Shaw, Peter and Uszkoreit, Jakob and Vaswani, Ashish},
  booktitle={Proceedings of NAACL-HLT}, pages={464--468}, year={2018}
}""",
    "transformer_xl": """@inproceedings{dai2019transformerxl,
  title={Transformer-{XL}: Attentive Language Models beyond a Fixed-Length Context},
  author={Dai, Zihang and Yang, Zhilin and Yang, Yiming and Carbonell, Jaime and Le, Quoc V. and Salakhutdinov, Ruslan},
  booktitle={Proceedings of ACL}, pages={2978--2988}, year={2019}
}""",
    "log_decay": """@inproceedings{chi2022kerple,
  title={{KERPLE}: Kernelized Relative Positional Embedding for Length Extrapolation},
  author={Chi, Ta-Chung and Fan, Ting-Han and Ramadge, Peter J. and Rudnicky, Alexander I.},
  booktitle={Advances in Neural Information Processing Systems}, year={2022},
  note={the log-decay bias is the fixed (r1 = lambda, r2 = 1) case of KERPLE's logarithmic variant}
}""",
    "alibi": """@inproceedings{press2022alibi,
  title={Train Short, Test Long: Attention with Linear Biases Enables Input Length Extrapolation},
  author={Press, Ofir and Smith, Noah A. and Lewis, Mike},
  booktitle={International Conference on Learning Representations}, year={2022}
}""",
    "rope": """@article{su2021roformer,
  title={{RoFormer}: Enhanced Transformer with Rotary Position Embedding},
  author={Su, Jianlin and Lu, Yu and Pan, Shengfeng and Murtadha, Ahmed and Wen, Bo and Liu, Yunfeng},
  journal={arXiv preprint arXiv:2104.09864}, year={2021}
}""",
}
BIBTEX["kerple_log"] = """@inproceedings{chi2022kerple,
  title={{KERPLE}: Kernelized Relative Positional Embedding for Length Extrapolation},
  author={Chi, Ta-Chung and Fan, Ting-Han and Ramadge, Peter J. and Rudnicky, Alexander I.},
  booktitle={Advances in Neural Information Processing Systems}, year={2022}
}"""
BIBTEX["fire"] = """@inproceedings{li2024fire,
  title={Functional Interpolation for Relative Positions Improves Long Context Transformers},
  author={Li, Shanda and You, Chong and Guruganesh, Guru and Ainslie, Joshua and Ontanon, Santiago and Zaheer, Manzil
          and Sanghai, Sumit and Yang, Yiming and Kumar, Sanjiv and Bhojanapalli, Srinadh},
  booktitle={International Conference on Learning Representations}, year={2024}
}"""
BIBTEX["nope"] = """@inproceedings{kazemnejad2023nope,
  title={The Impact of Positional Encoding on Length Generalization in Transformers},
  author={Kazemnejad, Amirhossein and Padhi, Inkit and Natesan Ramamurthy, Karthikeyan and Das, Payel and Reddy, Siva},
  booktitle={Advances in Neural Information Processing Systems}, year={2023}
}"""
BIBTEX["sinusoidal"] = BIBTEX["learned"] = """@inproceedings{vaswani2017attention,
  title={Attention Is All You Need},
  author={Vaswani, Ashish and Shazeer, Noam and Parmar, Niki and Uszkoreit, Jakob and Jones, Llion and Gomez, Aidan N. and Kaiser, {\\L}ukasz and Polosukhin, Illia},
  booktitle={Advances in Neural Information Processing Systems}, year={2017}
}"""


def _ppl(value) -> str:
    return "∞ (cannot run: past the position table)" if math.isinf(value) else f"{value:.2f}"


def write_model_card(folder: Path, summary: dict) -> None:
    """README.md from the scheme's template: the exact command, the evaluation at L, 2L, 4L (and with
    memory) as a table and as YAML ``model-index`` metrics, and the paper to cite."""
    scheme = summary["position_encoding"]
    template_path = CARDS_DIR / f"{scheme}.md"
    if not template_path.is_file():
        raise FileNotFoundError(f"model card template {template_path} is missing from the installed package")
    L = summary["seq_len"]
    by_length = {int(n): p for n, p in summary["test_ppl_by_length"].items()}
    training = "\n".join(
        [
            f"Command: `{summary['command']}`",
            "",
            "| | |",
            "| --- | --- |",
            f"| corpus | {summary['corpus']} |",
            f"| training tokens | {summary['train_tokens']:,} |",
            f"| model size | preset `{summary['preset']}`, {summary['parameters']:,} parameters "
            f"({summary['position_parameters']:,} in the position scheme) |",
            f"| sequence length | {L} tokens" + (f", memory {summary['mem_len']}" if summary["mem_len"] else "") + " |",
            f"| steps × batch | {summary['steps']} × {summary['batch_size']}, learning rate {summary['learning_rate']}, seed {summary['seed']} |",
            f"| final training loss | {summary['final_train_loss']:.3f} |" if summary["final_train_loss"] else "| final training loss | n/a |",
            f"| trained on | {summary['date']}, torch {summary['torch']}, {summary['train_seconds']} s of training in all |",
            "",
            f"Test perplexity ({summary['test_tokens']:,} held-out tokens, non-overlapping segments; L = {L}):",
            "",
            "| evaluation length | perplexity |",
            "| --- | ---: |",
        ]
        + [f"| {n} ({n // L}L) | {_ppl(p)} |" for n, p in sorted(by_length.items())]
        + ([f"| {L} with memory {summary['mem_len']} | {summary['test_ppl_with_memory']:.2f} |"]
           if "test_ppl_with_memory" in summary else [])
        + ["", "Cite the scheme's paper:", "", "```bibtex", BIBTEX[scheme], "```"]
    )
    metrics = [(f"Perplexity at {n} tokens ({n // L}x the training length)", p) for n, p in sorted(by_length.items())]
    if "test_ppl_with_memory" in summary:
        metrics.append((f"Perplexity at {L} tokens with memory {summary['mem_len']}", summary["test_ppl_with_memory"]))
    index = [
        "model-index:",
        f"  - name: hf_relpos-{scheme}",
        "    results:",
        "      - task: {type: text-generation, name: Causal language modeling}",
        f"        dataset: {{type: text, name: {json.dumps(summary['corpus'])}}}",
        "        metrics:",
    ] + [
        f"          - {{type: perplexity, name: {json.dumps(name)}, value: {json.dumps(round(value, 4)) if math.isfinite(value) else '.inf'}}}"
        for name, value in metrics
    ]
    card = template_path.read_text().replace("{{training}}", training)
    head, sep, rest = card.partition("\n---\n")  # the front matter's closing line
    card = head + "\n" + "\n".join(index) + sep + rest
    (folder / "README.md").write_text(card)


# ----------------------------------------------------------------------------------------------
# generate and eval
# ----------------------------------------------------------------------------------------------


def load_folder(folder: str):
    """The model and tokenizer of a folder written by ``train``; a UserError says what is wrong with any other."""
    path = Path(folder)
    if not path.exists():
        raise UserError(f"folder {folder!r} does not exist: pass a folder written by `hf-relpos train`")
    if not (path / "config.json").is_file():
        raise UserError(f"folder {folder!r} holds no config.json: pass a folder written by `hf-relpos train`")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError:
        raise UserError(f"{folder}/config.json is not valid JSON") from None
    model_type = config.get("model_type")
    if model_type != "relpos":
        raise UserError(f"folder {folder!r} holds a model of model_type {model_type!r}, not an hf-relpos model ('relpos')")
    if config.get("is_encoder_decoder"):
        raise UserError(
            f"folder {folder!r} holds an encoder-decoder (RelPosForConditionalGeneration): this command reads the "
            "causal language models `hf-relpos train` writes; load it with AutoModelForSeq2SeqLM (README: encoder-decoder)"
        )
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise UserError(
            f"folder {folder!r} has no tokenizer (tokenizer.json): pass the model folder written by `hf-relpos train`, "
            "not one of its checkpoints"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    return model, tokenizer


def _position_table(config) -> Optional[int]:
    """How many positions an absolute scheme's table holds (None: relative schemes have no end)."""
    return config.max_position_embeddings if config.position_encoding in ("learned", "sinusoidal") else None


def generate(args) -> int:
    import torch
    from transformers import TextStreamer

    if not args.prompt.strip():
        raise UserError("--prompt is empty: give some text to continue")
    model, tokenizer = load_folder(args.folder)
    inputs = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False, return_token_type_ids=False)
    prompt_length = inputs["input_ids"].shape[1]
    new_tokens, table = args.max_new_tokens, _position_table(model.config)
    if table is not None and prompt_length + new_tokens > table:
        if prompt_length >= table:
            raise UserError(
                f"--prompt is {prompt_length} tokens, and the {model.config.position_encoding} position table "
                f"holds {table}: give a shorter prompt"
            )
        new_tokens = table - prompt_length
    streamer = None if args.quiet else TextStreamer(tokenizer)
    torch.manual_seed(args.seed)
    output = model.generate(
        **inputs,
        max_new_tokens=new_tokens,
        do_sample=args.temperature > 0,
        temperature=args.temperature if args.temperature > 0 else None,
        top_k=args.top_k if args.temperature > 0 else None,
        use_cache=True,
        streamer=streamer,
    )
    text = tokenizer.decode(output[0], skip_special_tokens=True)
    print(text if args.quiet else "")
    if new_tokens < args.max_new_tokens:
        print(
            f"hf-relpos generate: stopped after {new_tokens} new tokens: the {model.config.position_encoding} "
            f"position table holds {table} positions",
            file=sys.stderr,
        )
    return 0


def evaluate_lengths(model, stream, lengths, max_tokens=None, stride=None) -> dict:
    """Perplexity at each evaluation length: independent segments, or sliding windows moving by ``stride``
    tokens (each scores its last ``stride`` tokens); inf where the scheme cannot run."""
    from .memory import segment_perplexity, sliding_perplexity

    result = {}
    for length in lengths:
        try:
            if stride is None or stride >= length:
                result[length] = segment_perplexity(model, stream, length, use_memory=False, max_tokens=max_tokens)
            else:
                result[length] = sliding_perplexity(model, stream, length, stride, max_tokens=max_tokens)
        except ValueError as error:
            if "max_position_embeddings" not in str(error):
                raise
            result[length] = math.inf  # a learned position table ends before this length
    return result


def evaluate(args) -> int:
    from .data import embedded_corpus, encode, read_text_files
    from .memory import segment_perplexity

    model, tokenizer = load_folder(args.folder)
    run_file = Path(args.folder) / RUN_FILE
    run = json.loads(run_file.read_text()) if run_file.is_file() else {}
    seq_len = args.seq_len or run.get("seq_len")
    if not seq_len:
        raise UserError(f"--seq-len is needed: {run_file} (the training record) is missing")
    table = _position_table(model.config)
    if table is not None and seq_len > table:
        raise UserError(
            f"--seq-len {seq_len} is longer than the {model.config.position_encoding} position table "
            f"(max_position_embeddings={table})"
        )
    if args.eval_file:
        try:
            text = read_text_files(args.eval_file, flag="--eval-file")["test"]
        except ValueError as error:
            raise UserError(str(error)) from None
    else:
        text = embedded_corpus()["test"]
    stream = encode(tokenizer, text)
    if stream.numel() <= seq_len:
        raise UserError(f"--seq-len {seq_len} is longer than the evaluated text ({stream.numel()} tokens)")
    lengths = [seq_len * f for f in args.factors]
    result = {f"ppl@{n}": p for n, p in evaluate_lengths(model, stream, lengths, args.eval_tokens).items()}
    if getattr(model.config, "mem_len", 0) > 0:
        result[f"ppl@{seq_len}+memory{model.config.mem_len}"] = segment_perplexity(
            model, stream, seq_len, use_memory=True, max_tokens=args.eval_tokens
        )
    for name, value in result.items():
        print(f"{name:>24}: {value:.2f}")
    return 0


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
    return 0 if mismatches == 0 and _validate_t5_models() else 1


def _validate_t5_models() -> bool:
    """Whole models: small random upstream T5s of each kind, converted by ``from_t5``, on padded inputs."""
    from .t5_conversion import LOGIT_TOLERANCE, T5_KINDS, from_t5, parity_holds, random_t5, t5_parity

    print(f"Whole converted models (hf_relpos.from_t5) against upstream T5ForConditionalGeneration, fp32, "
          f"tolerance {LOGIT_TOLERANCE:g} (relative to logits above 1):")
    ok = True
    for kind in T5_KINDS:
        for impl in ("eager", "sdpa"):
            upstream = random_t5(kind)
            upstream.set_attn_implementation(impl)
            result = t5_parity(upstream, from_t5(upstream, check=False))  # the check is reported, not raised
            passed = parity_holds(result)
            ok &= passed
            print(f"  {kind:<36} {impl:>5}: max |logit diff| {result['max_abs_logit_diff']:.2e} (logits up to "
                  f"{result['max_abs_logit']:.2f}), greedy {'identical' if result['greedy_identical'] else 'DIFFERENT'}, "
                  f"beam {'identical' if result['beam_identical'] else 'DIFFERENT'}  {'OK' if passed else 'MISMATCH'}")
    return ok


# ----------------------------------------------------------------------------------------------
# convert-t5
# ----------------------------------------------------------------------------------------------


def convert_t5(args) -> int:
    """A local upstream T5 folder (safetensors) as an hf_relpos encoder-decoder folder, with code and card; the
    converted model is checked against the upstream one on random padded inputs before anything is written."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from .t5_conversion import check_t5_parity, from_t5

    src, out = Path(args.src_folder), Path(args.out_folder)
    if not (src / "config.json").is_file():
        raise UserError(f"SRC_FOLDER {str(src)!r} holds no config.json: give a local folder saved by "
                        "T5ForConditionalGeneration.save_pretrained (nothing is downloaded)")
    if src.resolve() == out.resolve():
        raise UserError(f"OUT_FOLDER {str(out)!r} is SRC_FOLDER: give another folder (the source is never replaced)")
    try:
        config = T5Config.from_pretrained(src, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UserError(f"SRC_FOLDER {str(src)!r}: its config.json cannot be read ({_first_line(error)})") from None
    if getattr(config, "model_type", None) != "t5":
        raise UserError(f"SRC_FOLDER {str(src)!r} holds a {config.model_type!r} model; convert-t5 converts 't5' models")
    if not any(src.glob("*.safetensors")):
        raise UserError(f"SRC_FOLDER {str(src)!r} holds no .safetensors weights (pickled weights are not loaded)")
    if out.exists() and not out.is_dir():
        raise UserError(f"OUT_FOLDER {str(out)!r} is a file: give a folder path")
    if out.is_dir() and any(out.iterdir()):
        foreign = sorted(p.name for p in out.iterdir() if not MODEL_FILE.fullmatch(p.name))
        if not _is_model_folder(out) or foreign:
            raise UserError(f"OUT_FOLDER {str(out)!r} holds files that are not an hf-relpos model "
                            f"({', '.join((foreign or ['config.json'])[:3])}): give a new or empty folder")
        if not args.overwrite:
            raise UserError(f"OUT_FOLDER {str(out)!r} already holds an hf-relpos model: pass --overwrite to replace it")
    with _RemoveIfEmptyOnFailure(out):
        upstream = T5ForConditionalGeneration.from_pretrained(src, local_files_only=True, use_safetensors=True)
        upstream = upstream.float().eval()
        converted = from_t5(upstream, check=False)
        try:  # before anything is written: a model that differs from its source is refused, not recorded
            parity = check_t5_parity(upstream, converted)
        except ValueError as error:
            raise UserError(f"{src}: {error}; nothing written") from None
        out.mkdir(parents=True, exist_ok=True)
        converted.save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "spiece.model"):
            if (src / name).is_file():  # the source's tokenizer travels with the model
                (out / name).write_bytes((src / name).read_bytes())
        _write_seq2seq_card(out, src, converted.config, parity, torch.__version__)
    print(f"Converted {src} -> {out}/: logits within {parity['max_abs_logit_diff']:.1e} of the source model "
          f"(random padded inputs, fp32); greedy {'identical' if parity['greedy_identical'] else 'DIFFERENT'}, "
          f"beam search {'identical' if parity['beam_identical'] else 'DIFFERENT'}")
    return 0


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _write_seq2seq_card(out: Path, src: Path, config, parity: dict, torch_version: str) -> None:
    kind = "v1.1 / Flan style (gated GELU, untied output layer)" if config.mlp_activation[1] else "v1.0 style (ReLU)"
    provenance = "\n".join([
        f"Converted by `hf-relpos convert-t5 {src} {out}` ({time.strftime('%Y-%m-%d')}, torch {torch_version}) from an "
        f"upstream `T5ForConditionalGeneration`, {kind}:",
        "",
        "| | |",
        "| --- | --- |",
        f"| layers | {config.num_hidden_layers} encoder, {config.num_decoder_layers} decoder |",
        f"| width | d_model {config.hidden_size}, {config.num_attention_heads} heads × d_kv {config.head_dim}, d_ff "
        f"{config.intermediate_size} (`{config.feed_forward_proj}`) |",
        f"| output layer | {'tied to the token table' if config.tie_word_embeddings else 'untied'}"
        f"{', states scaled by d_model**-0.5' if config.scale_decoder_outputs else ''} |",
        f"| parity with the source (random padded inputs, fp32) | max abs logit difference "
        f"{parity['max_abs_logit_diff']:.1e}; greedy {'identical' if parity['greedy_identical'] else 'different'}, "
        f"beam search {'identical' if parity['beam_identical'] else 'different'} |",
    ])
    card = (CARDS_DIR / "seq2seq.md").read_text()
    for key, value in (("title", f"{src.name} converted"), ("scheme", config.position_encoding),
                       ("provenance", provenance), ("bibtex", BIBTEX["t5_bias"])):
        card = card.replace("{{" + key + "}}", value)
    (out / "README.md").write_text(card)


# ----------------------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------------------


def compare(args) -> int:
    """Train every scheme alike, evaluate at L, 2L, 4L; write compare.md, compare.json, compare.png and the models.

    Writes into a fresh ``runs/compare-<date>-<time>`` unless ``--output-dir`` says where (a folder that
    already holds results needs ``--overwrite``). ``--resume`` continues an interrupted comparison:
    finished runs (scheme and seed) are read from their training records, which must hold this command's
    evaluation lengths and kind; the interrupted one resumes from its checkpoint.
    """
    from tqdm.auto import tqdm

    started = time.perf_counter()
    if args.quick:
        args.steps, args.seq_len = min(args.steps, 60), min(args.seq_len, 64)
        args.eval_tokens = min(args.eval_tokens or 4096, 4096)
    if args.mem_len is not None and "transformer_xl" not in (args.schemes or ["transformer_xl"]):
        raise UserError("--mem-len applies to transformer_xl, which --schemes leaves out")
    out = Path(args.output_dir or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {str(out)!r} is a file: give a folder path")
    if out.is_dir() and any(out.iterdir()) and not (args.overwrite or args.resume):
        raise UserError(
            f"--output-dir {str(out)!r} already holds files: pass --overwrite to replace its table and plot "
            "(trained models are kept unless retrained) or --resume to continue an interrupted comparison"
        )
    schemes = args.schemes or list(hf_schemes())
    factors = tuple(sorted(set(args.factors) | {1}))  # L itself always: the training length's perplexity
    seeds = [args.seed + k for k in range(args.seeds)]
    rows = []
    runs = [(scheme, seed) for scheme in schemes for seed in seeds]
    summaries = {}
    for scheme, seed in tqdm(runs, desc="schemes x seeds", disable=args.quiet):
        folder = out / "models" / scheme / f"seed-{seed}"
        done = (folder / RUN_FILE).is_file() and args.resume
        if done:
            _check_resumed_record(folder, args, factors)
        else:
            resume = True if args.resume and _last_checkpoint(_checkpoints_dir(folder)) is not None else None
            run_args = argparse.Namespace(**{
                **vars(args), "position_encoding": scheme, "output_dir": str(folder), "quiet": True,
                "resume": resume, "overwrite": args.overwrite, "seed": seed, "eval_factors": factors,
                "mem_len": args.mem_len if scheme == "transformer_xl" else None,
            })
            try:
                train(run_args)
            except Interrupted as stop:
                raise Interrupted(f"comparison interrupted while training {scheme} (seed {seed}): {stop}",
                                  _resume_command(args.argv)) from None
        summaries.setdefault(scheme, []).append(json.loads((folder / RUN_FILE).read_text()))
        if len(summaries[scheme]) == len(seeds):
            rows.append(_compare_row(scheme, summaries[scheme], args, factors))
            if not args.quiet:
                tqdm.write(f"{scheme:>15}: " + "  ".join(f"{f}x {_mean_cell(rows[-1], f'ppl_{f}x')}" for f in factors))
    meta = {
        "command": "hf-relpos " + shlex.join(args.argv),
        "quick": bool(args.quick),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPU cores, {sys.platform}",
        "seq_len": args.seq_len, "steps": args.steps, "preset": args.preset, "batch_size": args.batch_size,
        "learning_rate": args.learning_rate, "seeds": seeds, "factors": list(factors), "eval_tokens": args.eval_tokens,
        "evaluation": _evaluation_name(args),
        "seconds": round(time.perf_counter() - started, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    table = render_table(rows, args.seq_len, meta)
    (out / "compare.md").write_text(table)
    plot(rows, args.seq_len, factors, out / "compare.png", quick=meta["quick"])
    if not args.quiet:
        print(table)
    print(f"Wrote {out}/compare.md, compare.json and compare.png")
    return 0


def hf_schemes():
    from .configuration_relpos import POSITION_ENCODINGS

    return POSITION_ENCODINGS


def _evaluation_name(args) -> str:
    """How a run is evaluated (``train`` has no ``--sliding``; ``compare`` passes its own down)."""
    return f"sliding windows, stride {args.seq_len}" if getattr(args, "sliding", False) else "non-overlapping segments"


def _check_resumed_record(folder: Path, args, factors) -> None:
    """A finished run reused by ``--resume`` must have been evaluated as this command asks."""
    record = json.loads((folder / RUN_FILE).read_text())
    lengths = sorted(int(n) for n in record["test_ppl_by_length"])
    evaluation = record.get("evaluation", "non-overlapping segments")
    wanted = [args.seq_len * f for f in factors]
    if not set(wanted) <= set(lengths) or evaluation != _evaluation_name(args):
        raise UserError(
            f"--resume: {folder} was evaluated at lengths {lengths} ({evaluation}), this command asks for {wanted} "
            f"({_evaluation_name(args)}): resume with the original --factors and --sliding, or use a new --output-dir"
        )


def _mean_std(values: list) -> tuple:
    """Mean and sample standard deviation (0 for one value); inf when a seed cannot run at that length."""
    if any(math.isinf(v) for v in values):
        return math.inf, math.nan
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def _compare_row(scheme: str, summaries: list, args, factors) -> dict:
    """One scheme's row: at each length the mean, standard deviation and per-seed perplexities from its
    seeds' training records (all on the same test tokens)."""
    row = {"scheme": scheme, "position_params": summaries[0]["position_parameters"],
           "seeds": [s["seed"] for s in summaries]}
    for f in factors:
        values = [{int(n): p for n, p in s["test_ppl_by_length"].items()}[args.seq_len * f] for s in summaries]
        row[f"ppl_{f}x"], row[f"ppl_{f}x_std"] = _mean_std(values)
        row[f"ppl_{f}x_seeds"] = values
    if all("test_ppl_with_memory" in s for s in summaries):
        row["ppl_1x_with_memory"], row["ppl_1x_with_memory_std"] = _mean_std([s["test_ppl_with_memory"] for s in summaries])
    return row


def _mean_cell(row: dict, key: str) -> str:
    value, std = row[key], row.get(f"{key}_std")
    if math.isinf(value) or std is None or math.isnan(std):
        return _ppl(value)
    return f"{value:.2f} ± {std:.2f}"


def render_table(rows, seq_len, meta) -> str:
    factors = meta.get("factors", [1, 2, 4])
    seeds = meta.get("seeds", [meta.get("seed", 0)])
    lines = []
    if meta.get("quick"):
        lines += [f"**Quick run** ({meta['steps']} steps, L={seq_len}): a smoke test, not comparable with full runs.", ""]
    lines += [
        f"Perplexity on held-out text (mean ± standard deviation over {len(seeds)} seed{'s' * (len(seeds) > 1)}), "
        f"trained at L={seq_len}, evaluated at " + ", ".join(f"{f}L" for f in factors)
        + f" ({meta.get('evaluation', 'non-overlapping segments')}).",
        "",
        "| scheme | position params | " + " | ".join("train PPL (L)" if f == 1 else f"{f}x PPL" for f in factors) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in factors) + " |",
    ]
    for row in rows:
        lines.append(f"| {row['scheme']} | {row['position_params']:,} | "
                     + " | ".join(_mean_cell(row, f"ppl_{f}x") for f in factors) + " |")
    memory = [r for r in rows if "ppl_1x_with_memory" in r]
    if memory:
        lines += ["", "Transformer-XL with its segment memory at L: " + ", ".join(_mean_cell(r, "ppl_1x_with_memory")
                                                                                for r in memory)]
    lines += ["", f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; machine: {meta['machine']}; "
              f"preset {meta['preset']}, {meta['steps']} steps × batch {meta['batch_size']}, learning rate "
              f"{meta.get('learning_rate')}, seeds {', '.join(map(str, seeds))}"
              + (f"; {meta['seconds'] / 60:.1f} minutes in all." if "seconds" in meta else ".")]
    return "\n".join(lines) + "\n"


def plot(rows, seq_len, factors, path, quick: bool = False) -> None:
    """Perplexity against evaluation length, log-scale y so that every curve stays readable; a scheme that
    cannot run at a length (a learned table's end) is marked there with an x on the top edge; legend outside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    lengths = [seq_len * f for f in factors]
    marked = False
    colors = plt.get_cmap("tab10").colors
    for index, row in enumerate(rows):
        # more schemes than colours: the eleventh and later are dashed, so that no two curves look alike
        style = dict(color=colors[index % len(colors)], linestyle="-" if index < len(colors) else "--")
        values = [row[f"ppl_{f}x"] for f in factors]
        finite = [(n, v, row.get(f"ppl_{f}x_std", 0.0)) for n, f, v in zip(lengths, factors, values) if math.isfinite(v)]
        line = None
        if finite:  # error bars: one standard deviation over the seeds
            n, v, std = zip(*finite)
            line = ax.errorbar(n, v, yerr=std, marker="o", capsize=3, label=row["scheme"], **style).lines[0]
        for n, v in zip(lengths, values):
            if not math.isfinite(v):
                color = line.get_color() if line is not None else None
                ax.plot([n], [1.0], marker="x", markersize=9, color=color, clip_on=False,
                        transform=ax.get_xaxis_transform(), label=None if marked else "cannot run (past its table)")
                marked = True
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    from matplotlib.ticker import LogFormatter

    for axis_format in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_format(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))  # plain numbers on a log axis
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity (held-out text, log scale)")
    title = f"Length extrapolation, trained at L={seq_len}"
    ax.set_title(title + (" — quick run, not comparable" if quick else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class library_output_off:
    """While a command runs, Transformers' own progress bars ("Loading weights", "Writing model shards" at
    each checkpoint) and info warnings are off: the command shows one bar of its own, or just its result."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self.verbosity = hf_logging.get_verbosity()
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        return self

    def __exit__(self, *exc):
        from transformers.utils import logging as hf_logging

        hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(self.verbosity)
        return False


# ----------------------------------------------------------------------------------------------
# inspect
# ----------------------------------------------------------------------------------------------


def inspect_model(args) -> int:
    """Figures of what a trained folder learned about position: ``position.png`` (the position term per head
    over distances 0 .. N; not for schemes without a term in attention) and ``attention-layer{L}.png`` (every
    head's attention probabilities for ``--prompt``), into ``--output-dir`` (default ``FOLDER/inspect``).
    Existing figures there are replaced only with ``--overwrite``."""
    import torch

    from .inspection import (
        NO_POSITION_TERM, has_position_term, plot_attention, plot_position, position_curves, run_prompt, token_labels,
    )

    if not args.prompt.strip():
        raise UserError(f"--prompt is empty (got {args.prompt!r}): give some text whose attention to show")
    folder = Path(args.folder)
    model, tokenizer = load_folder(args.folder)
    config = model.config
    scheme = config.position_encoding
    run_file = folder / RUN_FILE
    try:
        run = json.loads(run_file.read_text()) if run_file.is_file() else {}
    except ValueError:
        run = {}  # unreadable: no default distance, no training-length mark
    train_length = run.get("seq_len") if isinstance(run, dict) else None
    with_position = has_position_term(model)
    distance = args.distance
    if distance is None and with_position:
        if not train_length:
            raise UserError(
                f"--distance is needed: {run_file} (the training record, whose seq_len sets the default) is "
                "missing or unreadable; pass --distance N (a positive int)"
            )
        distance = 2 * train_length

    out = Path(args.output_dir) if args.output_dir else folder / INSPECT_DIR
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {str(out)!r} is a file: give a folder path")
    names = (["position.png"] if with_position else []) + [
        f"attention-layer{layer}.png" for layer in range(config.num_hidden_layers)
    ]
    existing = [name for name in names if (out / name).exists()]
    if existing and not args.overwrite:
        shown = ", ".join(existing[:3]) + (f" and {len(existing) - 3} more" if len(existing) > 3 else "")
        raise UserError(
            f"--output-dir {str(out)!r} already holds {shown}: pass --overwrite to replace them, or give another "
            "--output-dir"
        )

    input_ids = tokenizer(args.prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    table = _position_table(config)
    if table is not None and input_ids.numel() > table:
        raise UserError(
            f"--prompt is {input_ids.numel()} tokens, and the {scheme} position table holds {table}: give a "
            "shorter prompt"
        )
    with torch.no_grad():
        prompt_run = run_prompt(model, input_ids)
        curves = position_curves(model, distance, prompt_run.queries) if with_position else None
    labels = token_labels(tokenizer, prompt_run.input_ids)

    with _RemoveIfEmptyOnFailure(out):
        out.mkdir(parents=True, exist_ok=True)
        if curves is not None:
            plot_position(curves, out / "position.png", train_length=train_length)
        for layer, weights in enumerate(prompt_run.attentions):
            plot_attention(weights, out / f"attention-layer{layer}.png", scheme=scheme, layer=layer, labels=labels)
    layers = config.num_hidden_layers
    maps = "attention-layer0.png" if layers == 1 else f"attention-layer{{0..{layers - 1}}}.png"
    if curves is not None:
        per = "per layer, " if curves.per_layer else ""
        print(f"{scheme}: wrote {out}/position.png (the position term per head, {per}distances 0..{distance}) and "
              f"{maps} (prompt: {len(labels)} tokens)")
    else:
        print(f"{scheme}: {NO_POSITION_TERM.get(scheme, 'no position term in attention')}; attention maps only: "
              f"wrote {out}/{maps} (prompt: {len(labels)} tokens)")
    return 0


def train_command(args) -> int:
    try:
        train(args)
    finally:  # here, not in train(): compare under torchrun trains several models in one process group
        _end_process_group()
    return 0


COMMANDS = {
    "train": train_command, "generate": generate, "eval": evaluate, "validate-t5": validate_t5, "convert-t5": convert_t5, "compare": compare,
    "inspect": inspect_model,
}


if __name__ == "__main__":
    sys.exit(main())
