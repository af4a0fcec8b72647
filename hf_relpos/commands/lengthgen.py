"""``hf-relpos lengthgen``: the length-generalisation protocol of Kazemnejad et al. 2023 (arXiv 2305.19466).

For each task × scheme × seed, a decoder-only model is trained (Transformers' ``Trainer``, loss on the answer tokens
only) on fresh instances of lengths ~ U(1, L). Every ``--eval-every`` steps its exact match on a held-out
in-distribution validation set is measured and the best state kept (optionally training stops once it reaches
``--stop-at``); that state is scored by exact match of greedy decoding on the same test instances at every length
1..2L. With several ``--lrs``, seed ``--seed`` tries each and the other seeds train with the one best in
distribution. A run whose best in-distribution accuracy is under ``--gate`` is reported as not learned, never
averaged in. Each run's record (``records/<task>/<scheme>/lr-<lr>/seed-<n>.json``, with its learning curve) is
written as it finishes, so ``--resume`` trains only the runs not yet recorded; no model weights are kept. The tasks
are in :mod:`hf_relpos.lengthgen`; the table (``lengthgen.md``), record (``lengthgen.json``) and plots
(``lengthgen.png``, ``curves.png``) are written at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from .. import lengthgen as lg
from .common import check_results_folder, output_folder, output_lock, writing
from .errors import Interrupted, UserError
from .train import PRESETS, resume_command

# What a lengthgen folder holds: its table, record and plots, and the runs' records.
LENGTHGEN_FILE = re.compile(r"lengthgen\.(md|json|png)|curves\.png|records")
# The paper's five schemes: NoPE, T5's relative bias, ALiBi, rotary and an absolute baseline (learned positions).
PAPER_SCHEMES = ("nope", "t5_bias", "alibi", "rope", "learned")
QUICK_TASKS = ("copy", "replace", "parity")
QUICK_STEPS = 200
TEST_PER_LENGTH = 10  # test instances at each length 1..2L: 10 × L per bucket of L/2 lengths
VALIDATION_PER_LENGTH = 10  # held-out in-distribution instances at each length 1..L
WARMUP = 0.05  # share of the steps with a linear warm-up, then a cosine decay
MAX_TRAIN_LENGTH = 200  # instances of 2L items stay a few hundred tokens
# What a run's record must share with the command that reuses it (--resume): everything that shapes a run but its
# seed and learning rate, which name its record.
RUN_SETTINGS = ("train_length", "steps", "batch_size", "preset", "items", "vocabulary", "eval_every", "stop_at",
                "warmup", "validation_per_length", "test_per_length", "position_lr_scale", "position_init_scale",
                "layers", "attention_scale", "initialization")
# Settings added since the first records: a record without one was made with this value.
SETTING_DEFAULTS = {"position_lr_scale": 1.0, "position_init_scale": 1.0, "layers": None, "attention_scale": None,
                    "initialization": "default"}


@dataclasses.dataclass
class LengthgenOptions:
    """The flags of ``hf-relpos lengthgen`` (same names and defaults)."""

    output_dir: Optional[str] = None  # None: a new runs/lengthgen-<date>-<time>
    tasks: Optional[Sequence[str]] = None  # None: lg.HEADLINE_TASKS (--quick: QUICK_TASKS)
    schemes: Optional[Sequence[str]] = None  # None: PAPER_SCHEMES
    seeds: int = 3
    seed: int = 0
    train_length: int = 20
    steps: int = 5000
    batch_size: int = 64
    lrs: Sequence[float] = (1e-3,)
    eval_every: int = 250
    stop_at: Optional[float] = 1.0  # the first state at 100% is the one scored: training on changes nothing
    gate: float = 0.95
    items: int = lg.ITEMS
    preset: str = "tiny"
    position_lr_scale: float = 1.0  # the position parameters' learning rate as a multiple of each run's
    position_init_scale: float = 1.0  # the position parameters multiplied by this once initialised
    layers: Optional[int] = None  # None: the preset's num_hidden_layers
    attention_scale: Optional[float] = None  # RelPosConfig.attention_scale (None: 1/sqrt(head_dim); T5's: 1.0)
    initialization: str = "default"  # RelPosConfig.initialization ("t5": T5's, with its tied output rescaled)
    jobs: Optional[int] = None  # runs trained at once, one thread each (None: the CPU cores this process may use)
    quick: bool = False
    overwrite: bool = False
    resume: Optional[bool] = None
    report: bool = False  # train nothing: the table and plots of the runs recorded so far
    quiet: bool = False
    argv: Sequence[str] = ()

    @classmethod
    def from_namespace(cls, args) -> "LengthgenOptions":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _all_schemes() -> list:
    from ..configuration_relpos import POSITION_ENCODINGS

    return list(POSITION_ENCODINGS)  # every scheme runs causally (Transformer-XL without memory here)


def lengthgen(options: LengthgenOptions) -> Path:
    """Train and score every task × scheme × seed; write lengthgen.md, lengthgen.json, the plots. Returns the folder.

    Writes into a fresh ``runs/lengthgen-<date>-<time>`` unless ``--output-dir`` says where (a folder that already
    holds results needs ``--overwrite``, which trains every run again, or ``--resume``, which trains only the runs
    without a record).
    """
    started = time.perf_counter()
    if options.quick:
        options = dataclasses.replace(options, steps=min(options.steps, QUICK_STEPS), seeds=1,
                                      tasks=options.tasks or QUICK_TASKS)
    tasks = list(dict.fromkeys(options.tasks or lg.HEADLINE_TASKS))
    unknown = [t for t in tasks if t not in lg.TASKS]
    if unknown:
        raise UserError(f"--tasks {unknown[0]!r} is not a task: choose from {', '.join(lg.TASKS)}")
    schemes = list(dict.fromkeys(options.schemes or PAPER_SCHEMES))
    known = _all_schemes()
    unknown = [s for s in schemes if s not in known]
    if unknown:
        raise UserError(f"--schemes {unknown[0]!r} is not a scheme: choose from {', '.join(known)}")
    if not 1 <= options.train_length <= MAX_TRAIN_LENGTH:
        raise UserError(f"--train-length must be from 1 to {MAX_TRAIN_LENGTH} (input items), got {options.train_length}")
    if not 2 <= options.items <= lg.MAX_ITEMS:
        raise UserError(f"--items must be from 2 to {lg.MAX_ITEMS} (item types), got {options.items}")
    for flag, value in (("--gate", options.gate), ("--stop-at", options.stop_at)):
        if value is not None and not 0 < value <= 1:
            raise UserError(f"{flag} is an exact-match accuracy from 0 (excluded) to 1, got {value}")
    if options.stop_at is not None and options.stop_at < options.gate:
        raise UserError(f"--stop-at {options.stop_at:g} is under --gate {options.gate:g}: a run stopped there could "
                        "never count as learned; give --stop-at >= --gate")
    if not options.lrs or any(not (lr > 0 and math.isfinite(lr)) for lr in options.lrs):
        raise UserError(f"--lrs must be positive learning rates, got {' '.join(map(str, options.lrs)) or 'none'}")
    if options.preset not in PRESETS:
        raise UserError(f"--preset {options.preset!r} is not a preset: choose from {', '.join(PRESETS)}")
    for scheme in schemes:  # a setup a scheme refuses (Shaw's attention scale) is one line before any training
        try:
            model_config(tasks[0], scheme, options.preset, options.train_length, options.items, options.layers,
                         options.attention_scale, options.initialization)
        except ValueError as error:
            raise UserError(f"--schemes {scheme}: {error}") from None
    if options.jobs is not None and options.jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {options.jobs}")
    if options.report and options.overwrite:
        raise UserError("--report reads the runs recorded so far, --overwrite trains every run again: give one")
    out = output_folder(options.output_dir or f"runs/lengthgen-{time.strftime('%Y%m%d-%H%M%S')}")
    if options.report:
        if not (out / "records").is_dir():
            raise UserError(f"--report: no lengthgen run is recorded in {str(out)!r}: give the folder of a run")
        options = dataclasses.replace(options, resume=True)
    check_results_folder(
        out, LENGTHGEN_FILE, "lengthgen run", "records", options.resume, options.overwrite,
        "pass --resume to train only the runs not yet recorded, "
        "or --overwrite to train every run again and replace its table",
    )
    with output_lock(out, "lengthgen", options.argv):
        return _lengthgen(options, out, tasks, schemes, started)


def _settings(options: LengthgenOptions) -> dict:
    return {"train_length": options.train_length, "steps": options.steps, "batch_size": options.batch_size,
            "preset": options.preset, "items": options.items, "vocabulary": lg.vocab_size(options.items),
            "eval_every": options.eval_every, "stop_at": options.stop_at, "warmup": WARMUP,
            "validation_per_length": VALIDATION_PER_LENGTH, "test_per_length": TEST_PER_LENGTH,
            "position_lr_scale": options.position_lr_scale, "position_init_scale": options.position_init_scale,
            "layers": options.layers, "attention_scale": options.attention_scale,
            "initialization": options.initialization}


def _recorded(settings: dict, name: str):
    """A record's setting (``SETTING_DEFAULTS``' value where the record predates it; KeyError where it lacks it)."""
    return settings[name] if name in settings or name not in SETTING_DEFAULTS else SETTING_DEFAULTS[name]


def record_path(out: Path, task: str, scheme: str, seed: int, lr: float) -> Path:
    # repr: the shortest text that reads back as the same float, so two learning rates never share a record
    return out / "records" / task / scheme / f"lr-{float(lr)!r}" / f"seed-{seed}.json"


def _check_folder(out: Path, settings: dict, flag: str = "--resume") -> None:
    """Under --resume, every record already in ``out`` must have been made with ``settings``: a resume with other
    settings (or tasks the folder's records do not cover) would otherwise write one table over two experiments."""
    for path in sorted((out / "records").rglob("seed-*.json")):
        try:
            recorded = json.loads(path.read_text())["settings"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # cut short: trained again if this command needs it
        if not isinstance(recorded, dict):
            continue  # not a record of this command (edited by hand): never read as one
        recorded = {**SETTING_DEFAULTS, **recorded}  # a record from before a setting was added: its default
        changed = [name for name in RUN_SETTINGS if recorded.get(name) != settings[name]]
        if changed:
            was = ", ".join(f"{name} {recorded.get(name)!r}" for name in changed)
            now = ", ".join(f"{name} {settings[name]!r}" for name in changed)
            advice = ("give the options it was run with" if flag == "--report" else
                      "resume with the original options, or use --overwrite or a new --output-dir")
            raise UserError(f"{flag}: {path} was run with {was}, this command gives {now}: {advice}")


def _read_record(path: Path, settings: dict, resume: bool) -> Optional[dict]:
    """A finished run's record, or None (not run yet, or cut short: trained again). A record made with other
    settings is a user error under --resume: it would mix two experiments in one table."""
    if not resume or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        recorded = {name: _recorded(record["settings"], name) for name in RUN_SETTINGS}
        named = (record["task"], record["scheme"], record["seed"], record["learning_rate"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if path != record_path(path.parents[4], *named):  # moved or edited by hand: not this run's record
        return None
    wanted = {name: settings[name] for name in RUN_SETTINGS}
    if recorded != wanted:
        changed = [name for name in RUN_SETTINGS if recorded[name] != wanted[name]]
        was = ", ".join(f"{name} {recorded[name]!r}" for name in changed)
        now = ", ".join(f"{name} {wanted[name]!r}" for name in changed)
        raise UserError(f"--resume: {path} was run with {was}, this command gives {now}: resume with the original "
                        "options, or use --overwrite or a new --output-dir")
    return record


def _write_record(path: Path, record: dict, hint: str) -> None:
    with writing(path.parent, hint):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(record, indent=1))
        os.replace(partial, path)  # a run killed while writing leaves no half record


def choose_lr(records: list) -> float:
    """The learning rate of the record best in distribution: the highest best validation accuracy, then the one
    that reached it in the fewest steps, then the first given."""
    best = max(records, key=lambda r: (r["best_accuracy"], -r["best_step"]))
    return best["learning_rate"]


def _lengthgen(options: LengthgenOptions, out: Path, tasks: list, schemes: list, started: float) -> Path:
    from tqdm.auto import tqdm

    settings = _settings(options)
    if options.resume:
        _check_folder(out, settings, "--report" if options.report else "--resume")
    seeds = [options.seed + k for k in range(options.seeds)]
    lrs = list(dict.fromkeys(float(lr) for lr in options.lrs))
    groups = [(task, scheme) for task in tasks for scheme in schemes]
    # Phase 1: the first seed at every learning rate (and, with one learning rate, every seed). Phase 2: the other
    # seeds at each task and scheme's chosen rate, once phase 1 has chosen it.
    first = [(task, scheme, seeds[0], lr) for task, scheme in groups for lr in lrs]
    if len(lrs) == 1:
        first = [(task, scheme, seed, lrs[0]) for task, scheme in groups for seed in seeds]
    total = len(first) + (len(groups) * (len(seeds) - 1) if len(lrs) > 1 else 0)
    hint = f" and resume with: {resume_command(options.argv)} (finished runs are kept)"
    records, trained = {}, []
    bar = tqdm(total=total, desc="tasks x schemes x seeds", unit="run", disable=options.quiet)
    jobs = 1

    def run_phase(runs: list) -> None:
        nonlocal jobs
        for run in runs:
            records[run] = _read_record(record_path(out, *run), settings, bool(options.resume))
        todo = [run for run in runs if records[run] is None and not options.report]
        bar.update(len(runs) - len(todo))
        phase_jobs = min(options.jobs or _cores(), max(1, len(todo)))
        jobs = max(jobs, phase_jobs)
        for run, record in _train_runs(todo, settings, phase_jobs):
            records[run] = record
            trained.append(run)
            _write_record(record_path(out, *run), record, hint)
            bar.set_postfix_str(f"{run[0]} {run[1]} seed {run[2]} lr {run[3]:g}: in {record['best_accuracy']:.0%} "
                                f"out {record['accuracy']['out']:.0%}", refresh=False)
            bar.update()

    def choice(group):  # None: several rates and no run of the first seed recorded yet (under --report)
        if len(lrs) == 1:
            return lrs[0]
        tried = [records[(*group, seeds[0], lr)] for lr in lrs if records.get((*group, seeds[0], lr))]
        return choose_lr(tried) if tried else None

    try:
        run_phase(first)
        chosen = {group: choice(group) for group in groups}
        if len(lrs) > 1:
            run_phase([(task, scheme, seed, chosen[task, scheme]) for task, scheme in groups for seed in seeds[1:]
                       if chosen[task, scheme] is not None])
    except (KeyboardInterrupt, WorkerDied) as stop:
        done = sum(r is not None for r in records.values())
        why = ("a worker process died (killed, e.g. out of memory: fewer --jobs use less)"
               if isinstance(stop, WorkerDied) else "interrupted")
        raise Interrupted(f"{why} with {done} of {total} runs recorded (they are kept).",
                          resume_command(options.argv)) from None
    finally:
        bar.close()
    scored = [records[run] for run in ((task, scheme, seed, chosen[task, scheme]) for task, scheme in groups
                                       for seed in seeds) if records.get(run)]
    if not scored:
        raise UserError(f"--report: no run of this command is recorded in {str(out)!r} yet")
    recorded = sum(r is not None for r in records.values())
    rows = aggregate(scored, options.train_length, options.gate)
    meta = {
        "command": "hf-relpos " + shlex.join(options.argv),
        "quick": bool(options.quick),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPU cores, {sys.platform}",
        **settings, "gate": options.gate, "learning_rates": lrs, "model": {**PRESETS[options.preset], **({"num_hidden_layers": options.layers} if options.layers else {})},
        "tasks": tasks,
        "schemes": schemes, "seeds": seeds, "jobs": jobs,
        "buckets": [lg.bucket_name(b) for b in lg.buckets(options.train_length)],
        "runs_trained": len(trained), "runs_recorded": recorded, "runs_expected": total,
        "train_cpu_seconds": round(sum(r["seconds"] for r in records.values() if r), 1),
        "seconds": round(time.perf_counter() - started, 1),
    }
    table = render_table(rows, meta)
    with writing(out, hint):
        out.mkdir(parents=True, exist_ok=True)
        (out / "lengthgen.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "lengthgen.md").write_text(table)
        plot_lengthgen(rows, meta, out / "lengthgen.png")
        plot_curves(rows, meta, out / "curves.png")
    if not options.quiet:
        print(table)
    print(f"Wrote {out}/lengthgen.md, lengthgen.json, lengthgen.png and curves.png")
    return out


class WorkerDied(Exception):
    """A worker process ended without its run's result (killed, e.g. by the out-of-memory killer)."""


def _train_runs(todo: list, settings: dict, jobs: int):
    """Yield ``(run, record)`` as each run finishes: in this process for one job, else in ``jobs`` processes of one
    thread each (many small models train faster side by side than one at a time on several threads). Ctrl-C (or
    a failed run) stops the other processes at once: a run whose record is not written is trained again later.
    A worker that dies (killed) raises :class:`WorkerDied`: the pool would start another and wait forever for
    the lost run's result."""
    if jobs == 1:
        for run in todo:
            yield run, run_one(*run, settings)
        return
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    started = context.Value("i", 0)  # workers started: more than ``jobs`` means the pool replaced a dead one
    pool = context.Pool(jobs, initializer=_worker_start, initargs=(started,))
    try:
        results = pool.imap_unordered(_run_spec, [(run, settings) for run in todo])
        for _ in todo:
            while True:
                try:
                    item = results.next(timeout=1.0)
                    break
                except multiprocessing.TimeoutError:
                    if started.value > jobs:
                        raise WorkerDied() from None
            yield item
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def _run_spec(spec: tuple) -> tuple:
    run, settings = spec
    return run, run_one(*run, settings)


def _worker_start(started=None) -> None:
    import signal

    import torch

    from .common import library_output_off

    if started is not None:
        with started.get_lock():
            started.value += 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the workers
    torch.set_num_threads(1)
    library_output_off().__enter__()  # for the worker's life: no Transformers bars or info lines


class _Answers:
    """The IterableDataset of training instances: fresh ones forever, lengths ~ U(1, L), the held-out ones skipped.
    Each group of 16 batches is drawn, sorted by length and cut into batches (shuffled), so that a batch pads little:
    every instance is still an independent draw of the same distribution, only which instances share a batch
    changes."""

    def __new__(cls, task: str, seed: int, settings: dict, skip: frozenset):
        import random

        from torch.utils.data import IterableDataset

        batch_size = settings["batch_size"]

        class Answers(IterableDataset):
            def __iter__(self):
                stream = lg.train_instances(task, seed, settings["train_length"], settings["items"], skip)
                order = random.Random(f"lengthgen-batches-{seed}")
                while True:
                    group = sorted((next(stream) for _ in range(16 * batch_size)), key=lambda i: len(i.ids))
                    batches = [group[k:k + batch_size] for k in range(0, len(group), batch_size)]
                    order.shuffle(batches)
                    for batch in batches:
                        yield from batch

        return Answers()


def collate(instances) -> dict:
    """Right-padded ``input_ids`` and ``labels`` that are -100 except on the answer tokens and the end-of-sequence
    (the loss is on the answer only). A causal model needs no attention mask for right padding: no real token
    attends to a later one."""
    import torch

    width = max(len(i.ids) for i in instances)
    ids = torch.full((len(instances), width), lg.PAD_ID)
    labels = torch.full((len(instances), width), -100)
    for row, instance in enumerate(instances):
        ids[row, : len(instance.ids)] = torch.tensor(instance.ids)
        labels[row, instance.answer_start : len(instance.ids)] = torch.tensor(instance.answer)
    return {"input_ids": ids, "labels": labels}


def build_model(task: str, scheme: str, preset: str, train_length: int, items: int = lg.ITEMS,
                layers: Optional[int] = None, attention_scale: Optional[float] = None,
                initialization: str = "default"):
    """A RelPosForCausalLM of the preset's size (``layers`` of them when given) over the tasks' vocabulary; absolute
    position tables cover the longest test instance (2L items), so their positions past training are there,
    untrained, as in the paper. ``initialization="t5"`` also rescales the tied output layer's input by
    ``hidden_size**-0.5`` as T5 v1.0 (and the paper's T5-based decoder) does: its token table starts at std 1."""
    from ..modeling_relpos import RelPosForCausalLM

    return RelPosForCausalLM(model_config(task, scheme, preset, train_length, items, layers, attention_scale,
                                          initialization))


def model_config(task: str, scheme: str, preset: str, train_length: int, items: int = lg.ITEMS,
                 layers: Optional[int] = None, attention_scale: Optional[float] = None,
                 initialization: str = "default"):
    """``build_model``'s config (ValueError naming the field where the setup does not suit the scheme)."""
    from ..configuration_relpos import RelPosConfig

    extra = {"attention_scale": attention_scale, "initialization": initialization,
             "scale_decoder_outputs": initialization == "t5"}
    if layers is not None:
        extra["num_hidden_layers"] = layers
    if scheme in ("learned", "sinusoidal"):
        extra["max_position_embeddings"] = lg.max_tokens(task, 2 * train_length)
    return RelPosConfig(position_encoding=scheme, vocab_size=lg.vocab_size(items), pad_token_id=lg.PAD_ID,
                        eos_token_id=lg.EOS_ID, bos_token_id=None, **{**PRESETS[preset], **extra})


def _answers(model, instances, batch_size: int = 128):
    """For each instance, ``(predicted, gold)``: the teacher-forced argmax at each answer position (and at the
    end-of-sequence) and the gold tokens there, one forward per batch of ``batch_size``."""
    import torch

    with torch.no_grad():
        for start in range(0, len(instances), batch_size):
            chunk = instances[start : start + batch_size]
            batch = collate(chunk)
            predicted = model(input_ids=batch["input_ids"], use_cache=False).logits.argmax(-1)
            for row, instance in enumerate(chunk):
                begin, end = instance.answer_start, len(instance.ids)
                yield predicted[row, begin - 1 : end - 1], batch["input_ids"][row, begin:end]


def exact_match(model, instances, batch_size: int = 128) -> tuple[list, list]:
    """Whether greedy decoding from each instance's prompt gives its answer and then the end-of-sequence, and the
    fraction of its answer tokens predicted right: one teacher-forced forward per batch. Greedy decoding is exact
    iff the argmax at every answer position (and at the end-of-sequence) is the gold token, since each greedy step
    then sees the gold prefix (tests/test_lengthgen.py checks it against ``generate``)."""
    exact, tokens = [], []
    for predicted, gold in _answers(model, instances, batch_size):
        right = predicted == gold
        exact.append(bool(right.all()))
        tokens.append(float(right.float().mean()))
    return exact, tokens


def _selection(validation: list, every: int, stop_at: Optional[float]):
    """A Trainer callback: every ``every`` steps (and at the last) the model's exact match on ``validation``, into a
    learning curve; the best state (the first of equals) kept in memory; training stopped once ``stop_at`` is
    reached. The model is put back in training mode after each measurement."""
    from transformers import TrainerCallback

    class Selection(TrainerCallback):
        def __init__(self):
            self.curve, self.best, self.best_step, self.state = [], -1.0, 0, None

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % every and state.global_step < state.max_steps:
                return
            model.eval()
            accuracy = sum(exact_match(model, validation)[0]) / len(validation)
            model.train()
            self.curve.append({"step": state.global_step, "accuracy": accuracy})
            if accuracy > self.best:
                self.best, self.best_step = accuracy, state.global_step
                self.state = {name: value.detach().clone() for name, value in model.state_dict().items()}
            if stop_at is not None and accuracy >= stop_at:
                control.should_training_stop = True

    return Selection()


def run_one(task: str, scheme: str, seed: int, lr: float, settings: dict) -> dict:
    """Train one model on ``task`` with ``scheme``, ``seed`` and peak learning rate ``lr``, keep its best state in
    distribution and score that state: the run's record."""
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments, set_seed
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from ..position_lr import position_lr_trainer, position_parameter_names, scale_position_init

    started = time.process_time()
    length, steps, items = settings["train_length"], settings["steps"], settings["items"]
    validation = lg.validation_instances(task, length, settings["validation_per_length"], items)
    test = lg.test_instances(task, 2 * length, settings["test_per_length"], items=items)
    skip = lg.held_out(task, validation + test, items)
    set_seed(seed)
    model = build_model(task, scheme, settings["preset"], length, items, layers=settings.get("layers"),
                        attention_scale=settings.get("attention_scale"),
                        initialization=settings.get("initialization", "default"))
    scale_position_init(model, settings.get("position_init_scale", 1.0))
    selection = _selection(validation, settings["eval_every"], settings["stop_at"])
    with tempfile.TemporaryDirectory(prefix="hf-relpos-lengthgen-") as scratch:  # Trainer wants a folder; nothing kept
        args = TrainingArguments(
            output_dir=scratch, max_steps=steps, per_device_train_batch_size=settings["batch_size"],
            learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=max(1, round(steps * settings["warmup"])),
            weight_decay=0.01, logging_steps=min(steps, settings["eval_every"]), save_strategy="no", report_to=[],
            seed=seed, disable_tqdm=True, dataloader_pin_memory=False, use_cpu=True,
        )
        trainer_class = position_lr_trainer(Trainer, settings.get("position_lr_scale", 1.0))
        trainer = trainer_class(model=model, args=args, data_collator=collate, callbacks=[selection],
                          train_dataset=_Answers(task, seed, settings, skip))
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        trainer.train()
    losses = [{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h]
    model.load_state_dict(selection.state)
    model.eval()
    exact, tokens = exact_match(model, test)
    counts, token_sums, failures = {}, {}, {}
    for instance, right, fraction, kind in zip(test, exact, tokens, failure_kinds(model, test)):
        r, t = counts.get(instance.length, (0, 0))
        counts[instance.length] = (r + right, t + 1)
        token_sums[instance.length] = token_sums.get(instance.length, 0.0) + fraction
        kinds = failures.setdefault(str(instance.length), dict.fromkeys(FAILURE_KINDS, 0))
        if kind is not None:
            kinds[kind] += 1
    parameters = {name: model.get_parameter(name).detach().tolist() for name in position_parameter_names(model)
                  if model.get_parameter(name).numel() <= RECORDED_PARAMETER_SIZE}
    return {
        "task": task, "scheme": scheme, "seed": seed, "learning_rate": lr, "settings": settings,
        "best_accuracy": selection.best, "best_step": selection.best_step,
        "steps_trained": trainer.state.global_step, "curve": selection.curve, "losses": losses,
        "right_by_length": {str(n): list(c) for n, c in sorted(counts.items())},
        "token_accuracy_by_length": {str(n): token_sums[n] / counts[n][1] for n in sorted(counts)},
        "accuracy": lg.accuracy_by_bucket(counts, length),
        "failures_by_length": failures,  # how each wrong test instance fails, by its length (FAILURE_KINDS)
        "position_parameters": parameters,  # of the scored state (those up to RECORDED_PARAMETER_SIZE values)
        "final_train_loss": losses[-1]["loss"] if losses else None,
        "seconds": round(time.process_time() - started, 1),  # this run's CPU time (one thread in a worker)
        "torch": torch.__version__,
    }


FAILURE_KINDS = ("stops early", "does not stop", "wrong item")


def failure_kinds(model, instances, batch_size: int = 128) -> list:
    """How greedy decoding fails each instance (None where it is exact), from its first wrong token, as
    ``exact_match`` reads it (teacher-forced argmax: greedy's first divergence): the end-of-sequence where an item
    is due ("stops early"), an item where the end-of-sequence is due ("does not stop"), another item ("wrong
    item")."""
    kinds = []
    for predicted, gold in _answers(model, instances, batch_size):
        wrong = (predicted != gold).nonzero()
        if not len(wrong):
            kinds.append(None)
            continue
        first = int(wrong[0])
        if int(gold[first]) == lg.EOS_ID:
            kinds.append("does not stop")
        elif int(predicted[first]) == lg.EOS_ID:
            kinds.append("stops early")
        else:
            kinds.append("wrong item")
    return kinds


# A record keeps the best state's position parameters up to this size (T5's table: buckets x heads), for plots.
RECORDED_PARAMETER_SIZE = 4096


def _mean_std(values: list) -> tuple:
    """Mean and sample standard deviation (0 for one value); (None, None) for no value."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def _pooled(group: list) -> dict:
    """Accuracy at each length over all of ``group``'s test instances."""
    lengths = sorted({int(n) for r in group for n in r["right_by_length"]})
    return {str(n): sum(r["right_by_length"][str(n)][0] for r in group)
            / sum(r["right_by_length"][str(n)][1] for r in group) for n in lengths}


def aggregate(records: list, train_length: int, gate: float) -> list:
    """One row per task × scheme (in the records' order). A run is learned when its best in-distribution
    (validation) accuracy reaches ``gate``. Per bucket (and "in", "out"): the mean and standard deviation over the
    learned runs (None when none learned) and their per-seed values; the learned and not-learned seeds (with their
    best validation accuracy); the accuracy at each length pooled over the learned runs (the plot) and the learning
    curves' mean over seeds."""
    keys = [lg.bucket_name(b) for b in lg.buckets(train_length)] + ["in", "out"]
    groups = {}
    for record in records:
        groups.setdefault((record["task"], record["scheme"]), []).append(record)
    rows = []
    for (task, scheme), group in groups.items():
        learned = [r for r in group if r["best_accuracy"] >= gate]
        row = {"task": task, "scheme": scheme, "seeds": [r["seed"] for r in group],
               "learning_rate": group[0]["learning_rate"], "learned": [r["seed"] for r in learned],
               "not_learned": {str(r["seed"]): r["best_accuracy"] for r in group if r["best_accuracy"] < gate},
               "best_accuracy_seeds": [r["best_accuracy"] for r in group],
               "best_step_seeds": [r["best_step"] for r in group]}
        row["best_accuracy"], row["best_accuracy_std"] = _mean_std(row["best_accuracy_seeds"])
        for key in keys:
            values = [r["accuracy"][key] for r in learned]
            row[key], row[f"{key}_std"] = _mean_std(values)
            row[f"{key}_seeds"] = values
        row["by_length"] = _pooled(learned) if learned else {}
        steps = sorted({point["step"] for r in group for point in r["curve"]})
        row["curve"] = {str(step): _mean_std([next((p["accuracy"] for p in r["curve"][::-1] if p["step"] <= step), 0.0)
                                              for r in group])[0] for step in steps}
        rows.append(row)
    return rows


def _first_out_bucket(meta: dict) -> str:
    buckets = lg.buckets(meta["train_length"])
    return lg.bucket_name(next((b for b in buckets if b[0] > meta["train_length"]), buckets[-1]))


def _cell(row: dict, key: str, seeds: int) -> str:
    """A bucket's mean ± std over the learned runs, "(k of n)" when fewer than the ``seeds`` asked for are behind it
    (the others not learned, or in a partial table not run yet), or "not learned" with the best in-distribution
    accuracy."""
    if not row["learned"]:
        return f"not learned (in {100 * max(row['best_accuracy_seeds']):.1f})"
    text = f"{100 * row[key]:.1f}" + (f" ± {100 * row[f'{key}_std']:.1f}" if len(row["learned"]) > 1 else "")
    return text if len(row["learned"]) == seeds else f"{text} ({len(row['learned'])} of {seeds})"


def render_table(rows: list, meta: dict) -> str:
    """lengthgen.md: the headline (first out-of-distribution bucket, scheme × task), then per task scheme × bucket
    over the learned runs, then the runs not learned; negative controls apart."""
    length, seeds, buckets, gate = meta["train_length"], meta["seeds"], meta["buckets"], meta["gate"]
    headline = [t for t in meta["tasks"] if t not in lg.CONTROLS]
    first_out = _first_out_bucket(meta)
    lines = []
    if meta.get("runs_recorded", 0) < meta.get("runs_expected", 0):
        lines += [f"**Partial** (`--report`): {meta['runs_recorded']} of the {meta['runs_expected']} runs are recorded "
                  "so far; a mean counts the seeds recorded, and a learning rate is chosen among those tried.", ""]
    if meta.get("quick"):
        lines += [f"**Quick run** ({meta['steps']} steps, {len(seeds)} seed, tasks {', '.join(meta['tasks'])}): a "
                  "smoke test, not comparable with full runs.", ""]
    lines += [
        "Exact-match accuracy (%) of greedy decoding, "
        + (f"mean ± standard deviation over the learned runs of {len(seeds)} seeds" if len(seeds) > 1 else "1 seed")
        + f"; trained on instance lengths U(1, {length}), each run scored with its state best on a held-out "
        f"validation set of lengths 1-{length} (measured every {meta['eval_every']} steps), tested on "
        f"{meta['test_per_length']} instances at each length 1-{2 * length} (the same for every scheme and seed). "
        f"A run whose best validation accuracy is under {100 * gate:g}% is **not learned**: it is listed with that "
        "accuracy and never averaged in; \"(k of n)\": a mean over k of the n seeds (the others not learned, or in "
        "a partial table not run yet).",
        "",
    ]
    if headline:
        lines += [f"### Headline: lengths {first_out}, the first bucket past training", "",
                  "| scheme | " + " | ".join(headline) + " |", "| --- | " + " | ".join("---:" for _ in headline) + " |"]
        for scheme in meta["schemes"]:
            cells = [next((_cell(r, first_out, len(seeds)) for r in rows if r["task"] == task and r["scheme"] == scheme),
                          "not run yet") for task in headline]
            lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    for task in meta["tasks"]:
        title = f"{task} (negative control)" if task in lg.CONTROLS else task
        if not any(row["task"] == task for row in rows):
            lines += ["", f"### {title}", "", "No run recorded yet."]
            continue
        lines += ["", f"### {title}", "",
                  "| scheme | learned | learning rate | best in-distribution | " + " | ".join(buckets) + " |",
                  "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in buckets) + " |"]
        for row in rows:
            if row["task"] == task:
                best = f"{100 * row['best_accuracy']:.1f}" + (
                    f" ± {100 * row['best_accuracy_std']:.1f}" if len(row["seeds"]) > 1 else "")
                cells = [_cell(row, b, len(seeds)) if row["learned"] else "-" for b in buckets]
                runs = f"{len(row['learned'])} of {len(row['seeds'])} run" + "s" * (len(row["seeds"]) > 1)
                lines.append(f"| {row['scheme']} | {runs} | "
                             f"{row['learning_rate']:g} | {best} | " + " | ".join(cells) + " |")
    missed = [(row, seed, accuracy) for row in rows for seed, accuracy in row["not_learned"].items()]
    if missed:
        lines += ["", f"Not learned (best validation accuracy under {100 * gate:g}%): "
                  + "; ".join(f"{row['task']} {row['scheme']} seed {seed} ({100 * accuracy:.1f}%)"
                              for row, seed, accuracy in missed) + "."]
    model = meta["model"]
    stop = f", stopping at {100 * meta['stop_at']:g}% in distribution" if meta.get("stop_at") else ""
    lines += ["", f"Command: `{meta['command']}`  ",
              f"Date: {meta['date']}; machine: {meta['machine']}; preset {meta['preset']} ({model['num_hidden_layers']} "
              f"layers, hidden {model['hidden_size']}, {model['num_attention_heads']} heads), {meta['items']} item "
              f"types, up to {meta['steps']} steps × batch {meta['batch_size']}{stop}, learning rates "
              f"{', '.join(f'{lr:g}' for lr in meta['learning_rates'])}, seeds {', '.join(map(str, seeds))}; "
              f"{meta['seconds'] / 60:.1f} minutes in all ({meta['jobs']} at a time; {meta['runs_trained']} runs "
              f"trained by this command, {meta['train_cpu_seconds'] / 60:.1f} CPU minutes over all runs)."]
    setup = [f"{name} {meta[name]}" for name, default in SETTING_DEFAULTS.items()
             if name != "layers" and meta.get(name, default) != default]
    if setup:  # what sets this table's runs apart from the default setup
        lines.append(f"Setup: {', '.join(setup)}.")
    return "\n".join(lines) + "\n"


def _panels(tasks: list, plt):
    columns = min(3, len(tasks))
    lines = math.ceil(len(tasks) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4.2 * columns + 2.2, 3.2 * lines), squeeze=False, sharey=True)
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    return fig, axes


def _finish(fig, axes, title: str, path: Path, plt) -> None:
    columns = axes.shape[1]
    handles, labels = {}, {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    labels = list(handles)
    fig.legend([handles[label] for label in labels], labels, loc="center right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / (4.2 * columns + 2.2), 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _matplotlib():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lengthgen(rows: list, meta: dict, path: Path) -> None:
    """Accuracy against instance length, one panel per task, one curve per scheme (its learned runs' instances
    pooled; a scheme with no learned run is named in the panel's title), the training length marked."""
    plt = _matplotlib()
    tasks = meta["tasks"]
    fig, axes = _panels(tasks, plt)
    colors = plt.get_cmap("tab10").colors
    for ax, task in zip(axes.flat, tasks):
        missing, unrun = [], []
        for index, scheme in enumerate(meta["schemes"]):
            row = next((r for r in rows if r["task"] == task and r["scheme"] == scheme), None)
            if row is None or not row["learned"]:
                (unrun if row is None else missing).append(scheme)
                continue
            lengths = [int(n) for n in row["by_length"]]
            ax.plot(lengths, [100 * v for v in row["by_length"].values()], label=scheme, linewidth=1.2,
                    color=colors[index % len(colors)], linestyle="-" if index < len(colors) else "--")
        ax.axvline(meta["train_length"] + 0.5, color="grey", linestyle=":", linewidth=1)
        ax.set_xlim(0.5, 2 * meta["train_length"] + 0.5)  # every panel on the tested lengths, one without runs too
        control = " (control)" if task in lg.CONTROLS else ""
        notes = [f"not learned: {', '.join(missing)}"] * bool(missing) + [f"not run yet: {', '.join(unrun)}"] * bool(unrun)
        ax.set_title("\n".join([f"{task}{control}", *notes]), fontsize=9)
        ax.set_xlabel("instance length (input items)")
        ax.grid(True, alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("exact match (%)")
    title = f"Length generalisation: trained on lengths 1-{meta['train_length']} (dotted line), learned runs"
    _finish(fig, axes, title + (" — quick run, not comparable" if meta.get("quick") else ""), path, plt)


def plot_curves(rows: list, meta: dict, path: Path) -> None:
    """The learning curves: validation exact match against the training step, one panel per task, one curve per
    scheme (mean over seeds; a run stopped early keeps its last value), the gate marked."""
    plt = _matplotlib()
    tasks = meta["tasks"]
    fig, axes = _panels(tasks, plt)
    colors = plt.get_cmap("tab10").colors
    for ax, task in zip(axes.flat, tasks):
        for index, scheme in enumerate(meta["schemes"]):
            row = next((r for r in rows if r["task"] == task and r["scheme"] == scheme), None)
            if row is None:
                continue
            ax.plot([int(s) for s in row["curve"]], [100 * v for v in row["curve"].values()], label=scheme,
                    linewidth=1.2, color=colors[index % len(colors)], linestyle="-" if index < len(colors) else "--")
        ax.axhline(100 * meta["gate"], color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{task} (control)" if task in lg.CONTROLS else task, fontsize=9)
        ax.set_xlabel("training step")
        ax.grid(True, alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("validation exact match (%)")
    title = f"In-distribution learning curves (lengths 1-{meta['train_length']}; dotted: the gate)"
    _finish(fig, axes, title + (" — quick run" if meta.get("quick") else ""), path, plt)


def lengthgen_command(args) -> int:
    lengthgen(LengthgenOptions.from_namespace(args))
    return 0
