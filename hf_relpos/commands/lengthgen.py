"""``hf-relpos lengthgen``: the length-generalisation protocol of Kazemnejad et al. 2023 (arXiv 2305.19466).

For each task × scheme × seed, a decoder-only model is trained (Transformers' ``Trainer``, loss on the answer tokens
only) on fresh instances of lengths ~ U(1, L) and scored by exact-match accuracy of greedy decoding on the same test
instances at every length 1..2L. Each run's record (``records/<task>/<scheme>/seed-<n>.json``) is written as it
finishes, so ``--resume`` trains only the runs not yet recorded; no model weights are kept. The tasks themselves are
in :mod:`hf_relpos.lengthgen`; the table (``lengthgen.md``), record (``lengthgen.json``) and plot
(``lengthgen.png``) are written at the end.
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
from typing import Optional, Sequence, Union

from .. import lengthgen as lg
from .common import check_results_folder, output_folder, output_lock, writing
from .errors import Interrupted, UserError
from .train import PRESETS, resume_command

# What a lengthgen folder holds: its table, record and plot, and the runs' records.
LENGTHGEN_FILE = re.compile(r"lengthgen\.(md|json|png)|records")
QUICK_TASKS = ("copy", "sort", "parity")
QUICK_STEPS = 200
TEST_PER_LENGTH = 10  # test instances at each length 1..2L: 10 × L per bucket of L/2 lengths
MAX_TRAIN_LENGTH = 200  # instances of 2L items stay a few hundred tokens
# What a run's record must share with the command that reuses it (--resume): everything that shapes the run.
RUN_SETTINGS = ("train_length", "steps", "batch_size", "learning_rate", "preset", "test_per_length", "vocabulary")


@dataclasses.dataclass
class LengthgenOptions:
    """The flags of ``hf-relpos lengthgen`` (same names and defaults)."""

    output_dir: Optional[str] = None  # None: a new runs/lengthgen-<date>-<time>
    tasks: Optional[Sequence[str]] = None  # None: every task (--quick: QUICK_TASKS)
    schemes: Optional[Sequence[str]] = None  # None: every scheme of the registry
    seeds: int = 3
    seed: int = 0
    train_length: int = 20
    steps: int = 1000
    batch_size: int = 32
    learning_rate: float = 3e-3
    preset: str = "micro"
    jobs: Optional[int] = None  # runs trained at once, one thread each (None: the CPU cores this process may use)
    quick: bool = False
    overwrite: bool = False
    resume: Optional[bool] = None
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
    """Train and score every task × scheme × seed; write lengthgen.md, lengthgen.json, lengthgen.png. Returns the folder.

    Writes into a fresh ``runs/lengthgen-<date>-<time>`` unless ``--output-dir`` says where (a folder that already
    holds results needs ``--overwrite``, which trains every run again, or ``--resume``, which trains only the runs
    without a record).
    """
    started = time.perf_counter()
    if options.quick:
        options = dataclasses.replace(options, steps=min(options.steps, QUICK_STEPS), seeds=1,
                                      tasks=options.tasks or QUICK_TASKS)
    tasks = list(dict.fromkeys(options.tasks or lg.TASKS))
    unknown = [t for t in tasks if t not in lg.TASKS]
    if unknown:
        raise UserError(f"--tasks {unknown[0]!r} is not a task: choose from {', '.join(lg.TASKS)}")
    schemes = list(dict.fromkeys(options.schemes or _all_schemes()))
    known = _all_schemes()
    unknown = [s for s in schemes if s not in known]
    if unknown:
        raise UserError(f"--schemes {unknown[0]!r} is not a scheme: choose from {', '.join(known)}")
    if not 1 <= options.train_length <= MAX_TRAIN_LENGTH:
        raise UserError(f"--train-length must be from 1 to {MAX_TRAIN_LENGTH} (input items), got {options.train_length}")
    if options.preset not in PRESETS:
        raise UserError(f"--preset {options.preset!r} is not a preset: choose from {', '.join(PRESETS)}")
    if options.jobs is not None and options.jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {options.jobs}")
    out = output_folder(options.output_dir or f"runs/lengthgen-{time.strftime('%Y%m%d-%H%M%S')}")
    check_results_folder(
        out, LENGTHGEN_FILE, "lengthgen run", "records", options.resume, options.overwrite,
        "pass --resume to train only the runs not yet recorded, "
        "or --overwrite to train every run again and replace its table",
    )
    with output_lock(out, "lengthgen", options.argv):
        return _lengthgen(options, out, tasks, schemes, started)


def _settings(options: LengthgenOptions) -> dict:
    return {"train_length": options.train_length, "steps": options.steps, "batch_size": options.batch_size,
            "learning_rate": options.learning_rate, "preset": options.preset, "test_per_length": TEST_PER_LENGTH,
            "vocabulary": len(lg.VOCAB)}


def record_path(out: Path, task: str, scheme: str, seed: int) -> Path:
    return out / "records" / task / scheme / f"seed-{seed}.json"


def _read_record(path: Path, settings: dict, resume: bool) -> Optional[dict]:
    """A finished run's record, or None (not run yet, or cut short: trained again). A record made with other
    settings is a user error under --resume: it would mix two experiments in one table."""
    if not resume or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        recorded = {name: record["settings"][name] for name in RUN_SETTINGS}
    except (OSError, ValueError, KeyError, TypeError):
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


def _lengthgen(options: LengthgenOptions, out: Path, tasks: list, schemes: list, started: float) -> Path:
    from tqdm.auto import tqdm

    settings = _settings(options)
    seeds = [options.seed + k for k in range(options.seeds)]
    runs = [(task, scheme, seed) for task in tasks for scheme in schemes for seed in seeds]
    records = {run: _read_record(record_path(out, *run), settings, bool(options.resume)) for run in runs}
    todo = [run for run in runs if records[run] is None]
    hint = f" and resume with: {resume_command(options.argv)} (finished runs are kept)"
    jobs = min(options.jobs or _cores(), max(1, len(todo)))
    bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc="tasks x schemes x seeds", unit="run",
               disable=options.quiet)
    try:
        for run, record in _train_runs(todo, settings, jobs):
            records[run] = record
            _write_record(record_path(out, *run), record, hint)
            bar.set_postfix_str(f"{run[0]} {run[1]} seed {run[2]}: out {record['accuracy']['out']:.0%}", refresh=False)
            bar.update()
    except (KeyboardInterrupt, WorkerDied) as stop:
        done = sum(r is not None for r in records.values())
        why = ("a worker process died (killed, e.g. out of memory: fewer --jobs use less)"
               if isinstance(stop, WorkerDied) else "interrupted")
        raise Interrupted(f"{why} with {done} of {len(runs)} runs recorded (they are kept).",
                          resume_command(options.argv)) from None
    finally:
        bar.close()
    rows = aggregate([records[run] for run in runs], options.train_length)
    meta = {
        "command": "hf-relpos " + shlex.join(options.argv),
        "quick": bool(options.quick),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPU cores, {sys.platform}",
        **settings, "model": PRESETS[options.preset], "tasks": tasks, "schemes": schemes, "seeds": seeds, "jobs": jobs,
        "buckets": [lg.bucket_name(b) for b in lg.buckets(options.train_length)],
        "runs_trained": len(todo),
        "train_cpu_seconds": round(sum(records[run]["seconds"] for run in runs), 1),
        "seconds": round(time.perf_counter() - started, 1),
    }
    table = render_table(rows, meta)
    with writing(out, hint):
        out.mkdir(parents=True, exist_ok=True)
        (out / "lengthgen.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "lengthgen.md").write_text(table)
        plot_lengthgen(rows, meta, out / "lengthgen.png")
    if not options.quiet:
        print(table)
    print(f"Wrote {out}/lengthgen.md, lengthgen.json and lengthgen.png")
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
    """The IterableDataset of training instances: fresh ones forever, lengths ~ U(1, L). Each group of 16 batches is
    drawn, sorted by length and cut into batches (shuffled), so that a batch pads little: every instance is still an
    independent draw of the same distribution, only which instances share a batch changes."""

    def __new__(cls, task: str, seed: int, train_length: int, batch_size: int):
        import random

        from torch.utils.data import IterableDataset

        class Answers(IterableDataset):
            def __iter__(self):
                stream = lg.train_instances(task, seed, train_length)
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


def build_model(task: str, scheme: str, preset: str, train_length: int):
    """A RelPosForCausalLM of the preset's size over the tasks' vocabulary; absolute position tables cover the longest
    test instance (2L items), so their positions past training are there, untrained, as in the paper."""
    from ..configuration_relpos import RelPosConfig
    from ..modeling_relpos import RelPosForCausalLM

    extra = {}
    if scheme in ("learned", "sinusoidal"):
        extra["max_position_embeddings"] = lg.max_tokens(task, 2 * train_length)
    config = RelPosConfig(position_encoding=scheme, vocab_size=len(lg.VOCAB), pad_token_id=lg.PAD_ID,
                          eos_token_id=lg.EOS_ID, bos_token_id=None, **PRESETS[preset], **extra)
    return RelPosForCausalLM(config)


def exact_match(model, instances, batch_size: int = 128) -> tuple[list, list]:
    """Whether greedy decoding from each instance's prompt gives its answer and then the end-of-sequence, and the
    fraction of its answer tokens predicted right: one teacher-forced forward per batch. Greedy decoding is exact
    iff the argmax at every answer position (and at the end-of-sequence) is the gold token, since each greedy step
    then sees the gold prefix (tests/test_lengthgen.py checks it against ``generate``)."""
    import torch

    exact, tokens = [], []
    with torch.no_grad():
        for start in range(0, len(instances), batch_size):
            chunk = instances[start : start + batch_size]
            batch = collate(chunk)
            predicted = model(input_ids=batch["input_ids"], use_cache=False).logits.argmax(-1)
            for row, instance in enumerate(chunk):
                begin, end = instance.answer_start, len(instance.ids)
                right = predicted[row, begin - 1 : end - 1] == batch["input_ids"][row, begin:end]
                exact.append(bool(right.all()))
                tokens.append(float(right.float().mean()))
    return exact, tokens


def run_one(task: str, scheme: str, seed: int, settings: dict) -> dict:
    """Train one model on ``task`` with ``scheme`` and ``seed`` and score it: the run's record."""
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments, set_seed
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    started = time.process_time()
    length, steps = settings["train_length"], settings["steps"]
    set_seed(seed)
    model = build_model(task, scheme, settings["preset"], length)
    with tempfile.TemporaryDirectory(prefix="hf-relpos-lengthgen-") as scratch:  # Trainer wants a folder; nothing kept
        args = TrainingArguments(
            output_dir=scratch, max_steps=steps, per_device_train_batch_size=settings["batch_size"],
            learning_rate=settings["learning_rate"], lr_scheduler_type="cosine", warmup_steps=max(1, steps // 20),
            weight_decay=0.01, logging_steps=max(1, steps // 10), save_strategy="no", report_to=[], seed=seed,
            disable_tqdm=True, dataloader_pin_memory=False, use_cpu=True,
        )
        trainer = Trainer(model=model, args=args, data_collator=collate,
                          train_dataset=_Answers(task, seed, length, settings["batch_size"]))
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    model.eval()
    test = lg.test_instances(task, 2 * length, settings["test_per_length"])
    exact, tokens = exact_match(model, test)
    counts, token_sums = {}, {}
    for instance, right, fraction in zip(test, exact, tokens):
        r, t = counts.get(instance.length, (0, 0))
        counts[instance.length] = (r + right, t + 1)
        token_sums[instance.length] = token_sums.get(instance.length, 0.0) + fraction
    return {
        "task": task, "scheme": scheme, "seed": seed, "settings": settings,
        "right_by_length": {str(n): list(c) for n, c in sorted(counts.items())},
        "token_accuracy_by_length": {str(n): token_sums[n] / counts[n][1] for n in sorted(counts)},
        "accuracy": lg.accuracy_by_bucket(counts, length),
        "final_train_loss": losses[-1] if losses else None,
        "seconds": round(time.process_time() - started, 1),  # this run's CPU time (one thread in a worker)
        "torch": torch.__version__,
    }


def _mean_std(values: list) -> tuple:
    """Mean and sample standard deviation (0 for one value)."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def aggregate(records: list, train_length: int) -> list:
    """One row per task × scheme (in the records' order): per bucket (and "in", "out") the mean and standard deviation
    over seeds of each seed's accuracy, the per-seed values, and the per-length accuracy over all seeds (the plot)."""
    keys = [lg.bucket_name(b) for b in lg.buckets(train_length)] + ["in", "out"]
    groups = {}
    for record in records:
        groups.setdefault((record["task"], record["scheme"]), []).append(record)
    rows = []
    for (task, scheme), group in groups.items():
        row = {"task": task, "scheme": scheme, "seeds": [r["seed"] for r in group]}
        for key in keys:
            values = [r["accuracy"][key] for r in group]
            row[key], row[f"{key}_std"] = _mean_std(values)
            row[f"{key}_seeds"] = values
        lengths = sorted({int(n) for r in group for n in r["right_by_length"]})
        row["by_length"] = {str(n): sum(r["right_by_length"][str(n)][0] for r in group)
                            / sum(r["right_by_length"][str(n)][1] for r in group) for n in lengths}
        row["token_accuracy_out"] = _mean_std([
            sum(v for n, v in r["token_accuracy_by_length"].items() if int(n) > train_length)
            / sum(1 for n in r["token_accuracy_by_length"] if int(n) > train_length) for r in group])[0]
        rows.append(row)
    return rows


def summary(rows: list) -> list:
    """Per scheme, the accuracy averaged over tasks, in and out of distribution: the mean over seeds of each seed's
    task average (and its standard deviation), sorted by out-of-distribution accuracy, best first."""
    schemes = list(dict.fromkeys(row["scheme"] for row in rows))
    result = []
    for scheme in schemes:
        mine = [row for row in rows if row["scheme"] == scheme]
        entry = {"scheme": scheme, "tasks": len(mine)}
        for key in ("in", "out"):
            per_seed = [sum(vals) / len(vals) for vals in zip(*(row[f"{key}_seeds"] for row in mine))]
            entry[key], entry[f"{key}_std"] = _mean_std(per_seed)
        entry["token_accuracy_out"] = sum(row["token_accuracy_out"] for row in mine) / len(mine)
        result.append(entry)
    return sorted(result, key=lambda e: -e["out"])


def _cell(row: dict, key: str, seeds: int) -> str:
    return f"{100 * row[key]:.1f}" + (f" ± {100 * row[f'{key}_std']:.1f}" if seeds > 1 else "")


def render_table(rows: list, meta: dict) -> str:
    """lengthgen.md: the summary over tasks, then per task scheme × length bucket, accuracy in % (mean ± std)."""
    length, seeds, buckets = meta["train_length"], meta["seeds"], meta["buckets"]
    ood = f"{length + 1}-{2 * length}" if length > 1 else "2"
    lines = []
    if meta.get("quick"):
        lines += [f"**Quick run** ({meta['steps']} steps, {len(seeds)} seed, tasks {', '.join(meta['tasks'])}): a "
                  "smoke test, not comparable with full runs.", ""]
    lines += [
        "Exact-match accuracy (%) of greedy decoding, "
        + (f"mean ± standard deviation over {len(seeds)} seeds" if len(seeds) > 1 else "1 seed")
        + f"; trained on instance lengths U(1, {length}), tested on {meta['test_per_length']} instances at each "
        f"length 1-{2 * length} (the same for every scheme and seed).",
        "",
        f"### All tasks (mean over {len(meta['tasks'])}), sorted by out-of-distribution accuracy",
        "",
        f"| scheme | in distribution (1-{length}) | out of distribution ({ood}) | OOD answer tokens right |",
        "| --- | ---: | ---: | ---: |",
    ]
    for entry in summary(rows):
        lines.append(f"| {entry['scheme']} | {_cell(entry, 'in', len(seeds))} | {_cell(entry, 'out', len(seeds))} | "
                     f"{100 * entry['token_accuracy_out']:.1f} |")
    for task in meta["tasks"]:
        lines += ["", f"### {task}", "", "| scheme | " + " | ".join(buckets) + " |",
                  "| --- | " + " | ".join("---:" for _ in buckets) + " |"]
        for row in rows:
            if row["task"] == task:
                lines.append(f"| {row['scheme']} | " + " | ".join(_cell(row, b, len(seeds)) for b in buckets) + " |")
    model = meta["model"]
    lines += ["", f"Command: `{meta['command']}`  ",
              f"Date: {meta['date']}; machine: {meta['machine']}; preset {meta['preset']} ({model['num_hidden_layers']} "
              f"layers, hidden {model['hidden_size']}, {model['num_attention_heads']} heads), {meta['steps']} steps × "
              f"batch {meta['batch_size']}, learning rate {meta['learning_rate']}, seeds {', '.join(map(str, seeds))}; "
              f"{meta['seconds'] / 60:.1f} minutes in all ({meta['jobs']} at a time; {meta['runs_trained']} runs "
              f"trained by this command, {meta['train_cpu_seconds'] / 60:.1f} CPU minutes over all runs)."]
    return "\n".join(lines) + "\n"


def plot_lengthgen(rows: list, meta: dict, path: Path) -> None:
    """Accuracy against instance length, one panel per task, one curve per scheme (all seeds' instances pooled),
    the training length marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = meta["tasks"]
    columns = min(3, len(tasks))
    lines = math.ceil(len(tasks) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4.2 * columns + 2.2, 3.2 * lines), squeeze=False, sharey=True)
    colors = plt.get_cmap("tab10").colors
    schemes = list(dict.fromkeys(row["scheme"] for row in rows))
    for ax, task in zip(axes.flat, tasks):
        for index, scheme in enumerate(schemes):
            row = next((r for r in rows if r["task"] == task and r["scheme"] == scheme), None)
            if row is None:
                continue
            lengths = [int(n) for n in row["by_length"]]
            ax.plot(lengths, [100 * v for v in row["by_length"].values()], label=scheme, linewidth=1.2,
                    color=colors[index % len(colors)], linestyle="-" if index < len(colors) else "--")
        ax.axvline(meta["train_length"] + 0.5, color="grey", linestyle=":", linewidth=1)
        ax.set_title(task)
        ax.set_xlabel("instance length (input items)")
        ax.grid(True, alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("exact match (%)")
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    title = f"Length generalisation: trained on lengths 1-{meta['train_length']} (dotted line)"
    fig.suptitle(title + (" — quick run, not comparable" if meta.get("quick") else ""))
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / (4.2 * columns + 2.2), 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def lengthgen_command(args) -> int:
    lengthgen(LengthgenOptions.from_namespace(args))
    return 0
