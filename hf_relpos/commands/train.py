"""``hf-relpos train`` and ``hf-relpos eval``: train one scheme into a Hub-ready folder; evaluate a folder.

:func:`train_model` takes a :class:`TrainOptions` and returns the run's summary (also written as
``hf_relpos_run.json`` beside the model, with a model card). Training is Transformers' ``Trainer``; Ctrl-C stops
at the end of the current step with a resumable checkpoint (:class:`~.errors.Interrupted`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shlex
import signal
import time
from pathlib import Path
from typing import Optional, Sequence

from .common import (
    RUN_FILE, TIME_FILE, RemoveIfEmptyOnFailure, check_writable, checkpoints_dir, evaluation_name, last_checkpoint,
    load_folder, output_folder, output_lock, position_table, prepare_output, refuse_files, replace_folder, set_aside,
    staging_dir, training_length, writing,
)
from .errors import Interrupted, UserError
from .options import TrainOptions

# The model sizes of ``--preset`` (hf_relpos_cli.PRESET_NAMES restates the names).
PRESETS = {
    # small enough to train one model per task, scheme and seed on a CPU (tiny: lengthgen's default)
    "micro": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=256),
    "tiny": dict(hidden_size=128, num_attention_heads=4, num_hidden_layers=2, intermediate_size=512),
    "small": dict(hidden_size=256, num_attention_heads=4, num_hidden_layers=4, intermediate_size=1024),
}
# The options that shape the model and its data, recorded in each checkpoint: a resume must give the same ones.
RUN_OPTIONS = ("position_encoding", "preset", "seq_len", "vocab_size", "mem_len", "train_file", "corpus", "seed",
               "batch_size", "learning_rate", "position_lr_scale", "position_init_scale")
# Recorded too, and taken from the checkpoint by a resume that does not give them (a resume may train longer;
# the --train-file limit goes with the files it admitted).
RECORDED_OPTIONS = RUN_OPTIONS + ("steps", "eval_tokens", "max_train_bytes")


def train_model(options: TrainOptions) -> dict:
    """Train one scheme on the corpus and write a Hub-ready folder. Returns the run summary."""
    check_corpus_options(options.corpus, options.train_file)
    out = output_folder(options.output_dir)
    recorded_scheme = options.resume and options.given is not None and "position_encoding" not in options.given
    if not recorded_scheme:  # else checked once the checkpoint's scheme is read
        _check_mem_len(options)
    refuse_files(out)
    check_writable(out, checkpoints_dir(out))  # before any work (the lock is a file beside the folder)
    with output_lock(out, "train", options.argv):
        resume_from = prepare_output(out, overwrite=options.overwrite, resume=options.resume)
        if resume_from is not None:
            options = _resumed_options(options, resume_from)
            _check_mem_len(options)
        with RemoveIfEmptyOnFailure(out, checkpoints_dir(out)):
            return _train(options, out, resume_from)


def _check_mem_len(options: TrainOptions) -> None:
    if options.mem_len is not None and options.position_encoding != "transformer_xl":
        raise UserError(
            f"--mem-len applies to --position-encoding transformer_xl only, got --position-encoding "
            f"{options.position_encoding}"
        )


def build_config(scheme: str, preset: str, seq_len: int, vocab_size: int, mem_len: Optional[int]):
    """The model configuration of ``train``: the preset's size, what the scheme needs for ``seq_len``."""
    from ..configuration_relpos import RelPosConfig

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


def check_corpus_options(corpus: Optional[str], files, files_flag: str = "--train-file") -> None:
    """--corpus names an embedded corpus, --train-file / --eval-file give the text: one or the other."""
    from ..data import CORPORA

    if corpus is not None and corpus not in CORPORA:
        raise UserError(f"--corpus {corpus!r} is not an embedded corpus; choose from {', '.join(CORPORA)}")
    if corpus is not None and files:
        raise UserError(f"--corpus {corpus} and {files_flag} both give the text: pass one of them")


def load_corpus(train_files, max_bytes: Optional[int] = None):
    from ..data import MAX_TEXT_BYTES, corpus, read_text_files

    if train_files:
        try:
            text = read_text_files(train_files, max_bytes=max_bytes or MAX_TEXT_BYTES)
        except ValueError as error:
            raise UserError(str(error)) from None
        return text, "user files: " + ", ".join(Path(f).name for f in train_files)
    return corpus("docs")


def load_data(options: "TrainOptions"):
    """The run's tokenizer, token streams (train, validation, test) and corpus description: an embedded corpus'
    are computed once per process (``data.tokenized``), ``--train-file`` text each time (files may change)."""
    from ..data import encode, tokenized, train_tokenizer

    if options.train_file:
        text, description = load_corpus(options.train_file, options.max_train_bytes)
        tokenizer = train_tokenizer([text["train"]], vocab_size=options.vocab_size)
        return tokenizer, {part: encode(tokenizer, t) for part, t in text.items()}, description
    return tokenized(options.corpus or "docs", options.vocab_size)


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

            def record(self) -> dict:
                """The time record each checkpoint holds (written with it: part of a complete checkpoint)."""
                return {"train_seconds": round(self.seconds(), 1), "options": options}

            def on_step_end(self, args, state, control, **kwargs):
                if self.interrupted:
                    control.should_save = True
                    control.should_training_stop = True

        return Bookkeeping()


class _Divergence:
    """Stops a run whose loss or weights are no longer finite before it saves them: no checkpoint and no final model
    of NaN weights; ``_train`` then raises one line naming the step and the last good checkpoint.

    The logged losses (training and validation) are read as Trainer logs them, already on the host (a nan or inf
    step is not filtered out of the log: ``logging_nan_inf_filter=False``, which also drops Trainer's host sync per
    step); the weights are checked at the steps that save, so that no save falls between a nan and its log (one
    host sync per checkpoint: 9-17 ms for the small preset on CPU, beside a save of 15 MB).
    """

    def __new__(cls):
        import torch
        from transformers import TrainerCallback

        class Divergence(TrainerCallback):
            step = loss = None

            def _stop(self, state, control, loss: str) -> None:
                if self.step is None:
                    self.step, self.loss = state.global_step, loss
                control.should_training_stop = True
                control.should_save = control.should_evaluate = control.should_log = False

            def on_step_end(self, args, state, control, model=None, **kwargs):
                if (control.should_save or control.should_training_stop) and model is not None:
                    finite = torch.stack([p.detach().isfinite().all() for p in model.parameters()]).all()
                    if not bool(finite):
                        self._stop(state, control, "the weights are no longer finite")

            def on_log(self, args, state, control, logs=None, **kwargs):
                for name in ("loss", "eval_loss"):
                    value = (logs or {}).get(name)
                    if value is not None and not math.isfinite(value):
                        self._stop(state, control, f"{name} {value}")

        return Divergence()


def _whole_checkpoints(base, record, hint: str, afresh_hint: str):
    """``base`` (``Trainer`` or ``MemoryTrainer``) whose checkpoints appear whole or not at all: each is
    written (Trainer's files, Transformer-XL's memory, the time record) into ``.saving-checkpoint-N/`` and
    renamed into place; older checkpoints are rotated out only then. A full disk is one line naming the folder."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

    class WholeCheckpoints(base):
        _staging = None

        def _get_output_dir(self, trial):
            return self._staging if self._staging is not None else super()._get_output_dir(trial)

        def _save_checkpoint(self, model, trial):
            run_dir = Path(super()._get_output_dir(trial))
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            self._staging = str(run_dir / f".saving-{name}")
            try:
                # before the first complete checkpoint there is nothing to resume: the hint is to start afresh
                with writing(run_dir / name, hint if last_checkpoint(run_dir) is not None else afresh_hint):
                    super()._save_checkpoint(model, trial)
                    staged = Path(self._staging) / name
                    if self.args.should_save:
                        (staged / TIME_FILE).write_text(json.dumps(record()))
                    self.accelerator.wait_for_everyone()  # every rank's files are in
                    if self.args.should_save:
                        target = run_dir / name
                        if target.exists():  # resumed from an older checkpoint given by path
                            set_aside(target, "is replaced by a new save of the same step")
                        staged.rename(target)
                        os.rmdir(self._staging)
                        rotate_checkpoints(str(run_dir), self.args.save_total_limit, use_mtime=False,
                                           best_model_checkpoint=self.state.best_model_checkpoint or str(target))
                    self.accelerator.wait_for_everyone()
            finally:
                self._staging = None

    WholeCheckpoints.__name__ = WholeCheckpoints.__qualname__ = base.__name__
    return WholeCheckpoints


def _run_options(run: TrainOptions) -> dict:
    options = {name: getattr(run, name) for name in RECORDED_OPTIONS}
    options["corpus"] = run.corpus or (None if run.train_file else "docs")
    if options["train_file"]:  # the files themselves, wherever the command runs from
        options["train_file"] = [str(Path(f).resolve()) for f in options["train_file"]]
    return options


def _saved_options(resume_from: Path) -> dict:
    record = resume_from / TIME_FILE
    return (json.loads(record.read_text()).get("options") if record.is_file() else None) or {}


def _resumed_options(options: TrainOptions, resume_from: Path) -> TrainOptions:
    """A resume continues the run as recorded in its checkpoint: the options the command line did not give
    are the checkpoint's (``hf-relpos train --output-dir X --resume`` alone continues it)."""
    if options.given is None:
        return options
    saved = _saved_options(resume_from)
    given = set(options.given)
    if given & {"train_file", "corpus"}:  # the text given (either way) replaces the recorded one, not joins it
        given |= {"train_file", "corpus"}
    taken = {name: saved[name] for name in RECORDED_OPTIONS if name in saved and name not in given}
    return dataclasses.replace(options, **taken)


def _check_resume_options(resume_from: Path, options: dict) -> None:
    """A resume continues the same run: the options that shape the model and data must be the checkpoint's."""
    saved = _saved_options(resume_from)
    if not saved:
        return  # a checkpoint from before options were recorded
    if "train_file" in saved:  # recorded before --corpus: the docs, unless files were given
        saved.setdefault("corpus", None if saved["train_file"] else "docs")
    for name in ("position_lr_scale", "position_init_scale"):  # recorded before these options: trained without
        saved.setdefault(name, 1.0)
    changed = [name for name in RUN_OPTIONS if name in saved and saved[name] != options[name]]
    if changed:
        flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
        was = ", ".join(f"{flag(name)} {saved[name]!r}" for name in changed)
        now = ", ".join(f"{flag(name)} {options[name]!r}" for name in changed)
        raise UserError(
            f"--resume: {resume_from} was trained with {was}, this command gives {now}; resume with the original "
            "options (or train afresh with --overwrite)"
        )


def resume_command(argv) -> str:
    """The command line that continues an interrupted run: this one, with ``--resume``, without ``--overwrite``."""
    argv = [a for a in argv if a not in ("--overwrite",)]
    if not any(a == "--resume" or a.startswith("--resume=") for a in argv):
        argv = argv + ["--resume"]
    return "hf-relpos " + shlex.join(argv)


def end_process_group() -> None:
    """Under torchrun, destroy the process group (Trainer's objects, in reference cycles, keep it alive) so that
    gloo joins its worker threads before the interpreter finalizes: one still running then can abort the rank."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _train(options: TrainOptions, out: Path, resume_from: Optional[Path]) -> dict:
    """Train a model on the options' data (resuming ``resume_from``), evaluate it and write its folder ``out``;
    returns the run's record (empty on a torchrun rank other than 0)."""
    if resume_from is not None:
        _check_resume_options(resume_from, _run_options(options))
    from transformers import set_seed

    set_seed(options.seed)
    tokenizer, streams, corpus_description, model = _data_and_model(options, resume_from)
    with_memory = model.config.position_encoding == "transformer_xl" and model.config.mem_len > 0
    hint = f" and resume with: {resume_command(options.argv)} (the last complete checkpoint is kept)"
    trainer, book, divergence = _trainer(options, out, model, streams, with_memory, hint, resume_from)
    _fit(trainer, book, options, resume_from)
    _check_finished(trainer, book, divergence, options, out)
    if not trainer.is_world_process_zero():  # under torchrun, rank 0 alone writes the folder
        return {}
    summary = _evaluate(options, model, tokenizer, streams, corpus_description, trainer, book, with_memory)
    _save(out, hint, model, tokenizer, summary)
    line = f"Saved to {out}/ — test perplexity at length {options.seq_len}: {summary['test_ppl']:.2f}"
    if with_memory:
        line += f" ({summary['test_ppl_with_memory']:.2f} with memory {model.config.mem_len})"
    print(line)
    return summary


def _data_and_model(options: TrainOptions, resume_from: Optional[Path]):
    """The tokenizer, the token streams of each split, the corpus's description and a new model sized for them."""
    from ..modeling_relpos import RelPosForCausalLM
    from ..position_lr import scale_position_init

    tokenizer, streams, corpus_description = load_data(options)
    shortest = min(("train", "validation", "test"), key=lambda part: streams[part].numel())
    if streams[shortest].numel() <= options.seq_len:
        raise UserError(
            f"--seq-len {options.seq_len} is longer than the data: its {shortest} split holds "
            f"{streams[shortest].numel()} tokens; use a shorter --seq-len or more text"
        )
    config = build_config(options.position_encoding, options.preset, options.seq_len, len(tokenizer), options.mem_len)
    if resume_from is not None and (resume_from / "config.json").is_file():
        saved_vocab = json.loads((resume_from / "config.json").read_text()).get("vocab_size")
        if saved_vocab is not None and saved_vocab != config.vocab_size:  # the same options, other text on disk
            raise UserError(
                f"--resume: {resume_from} holds a model of {saved_vocab} tokens, but this command's data gives a "
                f"vocabulary of {config.vocab_size}: the training text changed since; resume with the original text"
            )
    model = RelPosForCausalLM(config)
    scale_position_init(model, options.position_init_scale)  # a resume loads its checkpoint's weights over these
    return tokenizer, streams, corpus_description, model


def _training_arguments(options: TrainOptions, out: Path, with_memory: bool):
    import torch
    from transformers import TrainingArguments

    eval_steps = max(1, options.steps // 4)
    distributed_cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    return TrainingArguments(
        output_dir=str(checkpoints_dir(out)),  # keeps the model folder Hub-ready
        max_steps=options.steps,
        per_device_train_batch_size=options.batch_size,
        per_device_eval_batch_size=options.batch_size,
        learning_rate=options.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, options.steps // 20),
        weight_decay=0.01,
        logging_steps=max(1, options.steps // 20),
        logging_nan_inf_filter=False,  # a nan or inf loss reaches the log (_Divergence stops there), not averaged away
        eval_strategy="steps",
        eval_steps=eval_steps,
        save_strategy="steps",
        save_steps=eval_steps,
        save_total_limit=1,
        report_to=[],
        seed=options.seed,
        dataloader_pin_memory=False,
        disable_tqdm=True,  # our own bar (_Progress) instead of Trainer's bar and raw log dicts
        # Under torchrun, Transformer-XL's ordered batches are split by rows so each rank keeps its rows.
        accelerator_config={"split_batches": True} if with_memory and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        # torchrun on CPU-only machines: DDP over gloo (Transformers would otherwise run each rank alone).
        use_cpu=distributed_cpu,
        ddp_backend="gloo" if distributed_cpu else None,
    )


def _trainer(options: TrainOptions, out: Path, model, streams: dict, with_memory: bool, hint: str,
             resume_from: Optional[Path]):
    """Trainer (MemoryTrainer for Transformer-XL's memory) with whole checkpoints and this command's callbacks:
    the progress bar, the time record and Ctrl-C (``_Bookkeeping``), and the divergence stop (last)."""
    from transformers import Trainer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from ..data import Chunks
    from ..memory import MemoryTrainer, OrderedSegments
    from ..position_lr import position_lr_trainer

    if with_memory:
        train_set = OrderedSegments(streams["train"], options.batch_size, options.seq_len)
        eval_set = OrderedSegments(streams["validation"][: 64 * options.seq_len], options.batch_size, options.seq_len)
        trainer_class = MemoryTrainer
    else:
        train_set = Chunks(streams["train"], options.seq_len)
        eval_set = Chunks(streams["validation"], options.seq_len, limit=64)
        trainer_class = Trainer
    training_args = _training_arguments(options, out, with_memory)
    book = None
    afresh = [a for i, a in enumerate(options.argv) if not (a == "--resume" or a.startswith("--resume=") or (
        i and options.argv[i - 1] == "--resume" and not a.startswith("-")))]  # --resume and its CHECKPOINT
    afresh_hint = (f" and train afresh with: hf-relpos {shlex.join(afresh + ['--overwrite'] * ('--overwrite' not in afresh))}"
                   " (no checkpoint was complete yet)")
    trainer_class = position_lr_trainer(trainer_class, options.position_lr_scale)
    trainer_class = _whole_checkpoints(trainer_class, lambda: book.record(), hint, afresh_hint)
    trainer = trainer_class(model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if not options.quiet:
        trainer.add_callback(_Progress())
    previous = 0.0
    if resume_from is not None and (resume_from / TIME_FILE).is_file():
        previous = json.loads((resume_from / TIME_FILE).read_text())["train_seconds"]
    book = _Bookkeeping(previous, _run_options(options))
    trainer.add_callback(book)
    divergence = _Divergence()
    trainer.add_callback(divergence)  # last: it overrides what the others asked of this step
    return trainer, book, divergence


def _fit(trainer, book, options: TrainOptions, resume_from: Optional[Path]) -> None:
    """Train (or, for a finished run's checkpoint, load it as it was), a first Ctrl-C asking for a checkpoint."""
    def on_interrupt(signum, frame):
        if book.interrupted:  # a second Ctrl-C: stop now, without a checkpoint
            raise KeyboardInterrupt
        book.interrupted = True

    handler = signal.signal(signal.SIGINT, on_interrupt) if _main_thread() else None
    try:
        if resume_from is not None and _global_step(resume_from) >= options.steps:
            # A finished run (say, killed while writing its model folder): its model and record as they were.
            # Trainer would take one more step (at learning rate 0) and log that step's loss.
            from transformers import TrainerState

            trainer._load_from_checkpoint(str(resume_from))
            trainer.state = TrainerState.load_from_json(str(resume_from / "trainer_state.json"))
        else:
            trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
    finally:
        if handler is not None:
            signal.signal(signal.SIGINT, handler)


def _check_finished(trainer, book, divergence, options: TrainOptions, out: Path) -> None:
    """One line for a run that diverged (naming the last good checkpoint) or was interrupted (how to resume)."""
    if divergence.step is not None:
        last = last_checkpoint(checkpoints_dir(out))
        kept = f"the last good checkpoint is {last}" if last is not None else "no checkpoint was saved before"
        raise UserError(
            f"training diverged at step {divergence.step} of {options.steps}: {divergence.loss}; {kept}; train again "
            f"with --overwrite and a lower --learning-rate (it was {options.learning_rate}; --resume keeps it)"
        )
    if book.interrupted:
        checkpoint = checkpoints_dir(out) / f"checkpoint-{trainer.state.global_step}"
        raise Interrupted(
            f"interrupted at step {trainer.state.global_step} of {options.steps}; checkpoint saved in {checkpoint}.",
            resume_command(options.argv),
        )


def _evaluate(options: TrainOptions, model, tokenizer, streams: dict, corpus_description: str, trainer, book,
              with_memory: bool) -> dict:
    """The test perplexity at each evaluation length, and the run's record (``RUN_FILE``)."""
    import torch
    from transformers import GenerationConfig

    from ..data import DEFAULT_EVAL_TOKENS
    from ..memory import segment_perplexity

    seconds = book.seconds()
    config = model.config
    model.generation_config = GenerationConfig(  # use_cache: ExecuTorch's recipe refuses a folder that leaves it unset
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_new_tokens=64, use_cache=True
    )
    test = streams["test"]
    corpus_name = _run_options(options)["corpus"]
    max_tokens = options.eval_tokens or DEFAULT_EVAL_TOKENS.get(corpus_name)
    stride = options.seq_len if options.sliding else None
    ppl = evaluate_lengths(model, test, [options.seq_len * f for f in options.eval_factors], max_tokens, stride=stride)
    summary = {
        "command": "hf-relpos " + shlex.join(options.argv),
        "position_encoding": config.position_encoding,
        "preset": options.preset,
        "seq_len": options.seq_len,
        "mem_len": config.mem_len,
        "steps": options.steps,
        "batch_size": options.batch_size,
        "processes": trainer.args.world_size,
        "learning_rate": options.learning_rate,
        "seed": options.seed,
        "corpus": corpus_description,
        "corpus_name": corpus_name,  # the embedded corpus (None: --train-file), which eval defaults to
        "python": platform.python_version(),  # the embedded corpora are this Python's files
        "train_tokens": int(streams["train"].numel()),
        "test_tokens": int(min(test.numel(), max_tokens or test.numel())),
        "vocab_size": len(tokenizer),
        "parameters": sum(p.numel() for p in model.parameters()),
        "position_parameters": position_parameter_count(model),
        "train_seconds": round(seconds, 1),
        "final_train_loss": next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None),
        "test_ppl": ppl[options.seq_len],
        "test_ppl_by_length": {str(n): p for n, p in ppl.items()},
        "evaluation": evaluation_name(options.seq_len, options.sliding),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    if with_memory:
        summary["test_ppl_with_memory"] = segment_perplexity(model, test, options.seq_len, max_tokens=max_tokens)
    return summary


def _save(out: Path, hint: str, model, tokenizer, summary: dict) -> None:
    """The whole folder written beside ``out``, then renamed into place: the folder is always the old model or the
    new one (an interrupted swap is finished by the next run: common.recover_interrupted_save)."""
    from .model_card import write_model_card

    staged = staging_dir(out)
    with writing(out, hint):
        if staged.exists():
            set_aside(staged, "was being written when a run stopped")
        # Trainer set config.use_cache to TrainingArguments.use_cache (False) while training; the folder is for
        # inference, where ExecuTorch's recipe (TorchExportableModuleForDecoderOnlyLM) refuses a model without cache.
        model.config.use_cache = True
        model.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        (staged / RUN_FILE).write_text(json.dumps(summary, indent=2))
        write_model_card(staged, summary)
        replace_folder(staged, out)


def _global_step(checkpoint: Path) -> int:
    return json.loads((checkpoint / "trainer_state.json").read_text()).get("global_step", 0)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def evaluate_lengths(model, stream, lengths, max_tokens=None, stride=None) -> dict:
    """Perplexity at each evaluation length: independent segments, or sliding windows moving by ``stride``
    tokens (each scores its last ``stride`` tokens); inf where the scheme cannot run."""
    from ..memory import segment_perplexity, sliding_perplexity

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


def evaluate_folder(folder: str, *, seq_len: Optional[int] = None, factors: Sequence[int] = (1, 2, 4),
                    eval_file: Optional[Sequence[str]] = None, eval_tokens: Optional[int] = None,
                    max_eval_bytes: Optional[int] = None, corpus: Optional[str] = None) -> dict:
    """Perplexity of a trained folder's model on held-out text at ``seq_len`` × each factor (and with memory for
    Transformer-XL): ``{"ppl@<n>": value, ...}``. ``seq_len`` defaults to the training length of its record,
    the text to the test split of the embedded corpus it was trained on (``corpus``, ``eval_file``: other text)."""
    from ..data import DEFAULT_EVAL_TOKENS, MAX_TEXT_BYTES, encode, read_text_files
    from ..data import corpus as embedded
    from ..memory import segment_perplexity

    check_corpus_options(corpus, eval_file, "--eval-file")
    model, tokenizer = load_folder(folder)
    run_file = Path(folder) / RUN_FILE
    seq_len = seq_len or training_length(folder)
    if not seq_len:
        raise UserError(f"--seq-len is needed: {run_file} (the training record) is missing, unreadable or without a "
                        "positive seq_len")
    table = position_table(model.config)
    if table is not None and seq_len > table:
        raise UserError(
            f"--seq-len {seq_len} is longer than the {model.config.position_encoding} position table "
            f"(max_position_embeddings={table})"
        )
    if eval_file:
        try:
            text = read_text_files(eval_file, flag="--eval-file", max_bytes=max_eval_bytes or MAX_TEXT_BYTES,
                                   limit_flag="--max-eval-bytes")["test"]
        except ValueError as error:
            raise UserError(str(error)) from None
    else:
        corpus = corpus or _recorded_corpus(run_file)
        text = embedded(corpus)[0]["test"]
        eval_tokens = eval_tokens or DEFAULT_EVAL_TOKENS.get(corpus)
    stream = encode(tokenizer, text)
    if stream.numel() <= seq_len:
        raise UserError(f"--seq-len {seq_len} is longer than the evaluated text ({stream.numel()} tokens)")
    lengths = [seq_len * f for f in factors]
    # A length longer than the tokens evaluated would be scored on one short segment under its name: refused.
    predicted = min(stream.numel() - 1, eval_tokens or stream.numel())
    if max(lengths) > predicted:
        cap = f"capped by --eval-tokens {eval_tokens}" if predicted == eval_tokens else "all of the held-out text"
        raise UserError(
            f"--factors {max(factors)} gives length {max(lengths)} (--seq-len {seq_len} x {max(factors)}), longer than "
            f"the {predicted} tokens evaluated ({cap}): give smaller --factors or more tokens"
        )
    result = {f"ppl@{n}": p for n, p in evaluate_lengths(model, stream, lengths, eval_tokens).items()}
    if getattr(model.config, "mem_len", 0) > 0:
        result[f"ppl@{seq_len}+memory{model.config.mem_len}"] = segment_perplexity(
            model, stream, seq_len, use_memory=True, max_tokens=eval_tokens
        )
    return result


def _recorded_corpus(run_file: Path) -> str:
    """The embedded corpus a folder was trained on, as its record says ("docs" for --train-file runs, records of
    before --corpus and folders without a record)."""
    from ..data import CORPORA

    try:
        name = json.loads(run_file.read_text()).get("corpus_name")
    except (OSError, ValueError, AttributeError):
        return "docs"
    return name if name in CORPORA else "docs"


def train_command(args) -> int:
    try:
        train_model(TrainOptions.from_namespace(args))
    finally:  # here, not in train_model(): compare under torchrun trains several models in one process group
        end_process_group()
    return 0


def eval_command(args) -> int:
    result = evaluate_folder(args.folder, seq_len=args.seq_len, factors=args.factors, eval_file=args.eval_file,
                             eval_tokens=args.eval_tokens, max_eval_bytes=getattr(args, "max_eval_bytes", None),
                             corpus=getattr(args, "corpus", None))
    for name, value in result.items():
        print(f"{name:>24}: {value:.2f}")
    return 0
