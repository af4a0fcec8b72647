"""``hf-relpos compare``: the length-extrapolation experiment over every scheme, and its table.

:func:`compare` takes a :class:`CompareOptions`, trains every scheme × seed alike through
:func:`~.train.train_model`, and writes ``compare.md`` (:func:`render_table`), ``compare.json``, ``compare.png``
(:func:`~.plotting.plot`) and the models.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence, Union

from .common import (
    RUN_FILE, check_results_folder, checkpoints_dir, evaluation_name, last_checkpoint, output_folder, output_lock, writing,
)
from .errors import Interrupted, UserError
from .model_card import format_ppl
from .plotting import plot
from .train import TrainOptions, check_corpus_options, resume_command, train_model

# What a comparison folder holds: its tables (compare.*: non-overlapping segments, compare-sliding.*: sliding
# windows), their records and plots, and the models it trained.
COMPARE_FILE = re.compile(r"compare(-sliding)?\.(md|json|png)|models")


@dataclasses.dataclass
class CompareOptions:
    """The flags of ``hf-relpos compare`` (same names and defaults): what is compared, and how each run trains."""

    output_dir: Optional[str] = None  # None: a new runs/compare-<date>-<time>
    schemes: Optional[Sequence[str]] = None  # None: every scheme
    quick: bool = False  # a few-minute run (at most 60 steps, L <= 64), marked as such
    seeds: int = 3  # seeds per scheme: seed, seed + 1, ...
    factors: Sequence[int] = (1, 2, 4, 8)  # evaluation lengths as multiples of L
    sliding: bool = False
    preset: str = "tiny"
    seq_len: int = 128
    steps: int = 500
    batch_size: int = 16
    learning_rate: float = 2e-3
    vocab_size: int = 2048
    mem_len: Optional[int] = None
    seed: int = 0
    train_file: Optional[Sequence[str]] = None
    corpus: Optional[str] = None  # the embedded corpus (None: "docs" unless train_file)
    max_train_bytes: Optional[int] = None
    eval_tokens: Optional[int] = None
    overwrite: bool = False
    resume: Union[bool, str, None] = None
    quiet: bool = False
    argv: Sequence[str] = ()  # the command line (without "hf-relpos"), recorded and used in the resume hint

    @classmethod
    def from_namespace(cls, args) -> "CompareOptions":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def compare(options: CompareOptions) -> Path:
    """Train every scheme alike, evaluate at L, 2L, 4L; write compare.md, compare.json, compare.png and the models.

    Writes into a fresh ``runs/compare-<date>-<time>`` unless ``--output-dir`` says where (a folder that
    already holds results needs ``--overwrite``). ``--resume`` continues an interrupted comparison:
    finished runs (scheme and seed) are read from their training records, which must hold this command's
    evaluation lengths and kind; the interrupted one resumes from its checkpoint. A finished run not yet evaluated
    as this command asks (``--sliding``, other ``--factors``) has its saved model evaluated so, nothing retrained;
    its record keeps both evaluations. The sliding table is ``compare-sliding.*``, beside ``compare.*``. Returns
    the folder written.
    """
    started = time.perf_counter()
    check_corpus_options(options.corpus, options.train_file)
    if options.quick:
        options = dataclasses.replace(options, steps=min(options.steps, 60), seq_len=min(options.seq_len, 64),
                                      eval_tokens=min(options.eval_tokens or 4096, 4096))
    if options.mem_len is not None and "transformer_xl" not in (options.schemes or ["transformer_xl"]):
        raise UserError("--mem-len applies to transformer_xl, which --schemes leaves out")
    out = output_folder(options.output_dir or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    check_results_folder(
        out, COMPARE_FILE, "comparison", "models", options.resume, options.overwrite,
        "pass --overwrite to replace its table and plot "
        "(trained models are kept unless retrained) or --resume to continue an interrupted comparison",
    )
    with output_lock(out, "compare", options.argv):
        return _compare(options, out, started)


def _compare(options: CompareOptions, out: Path, started: float) -> Path:
    from tqdm.auto import tqdm

    schemes = options.schemes or list(_all_schemes())
    factors = tuple(sorted(set(options.factors) | {1}))  # L itself always: the training length's perplexity
    seeds = [options.seed + k for k in range(options.seeds)]
    rows = []
    runs = [(scheme, seed) for scheme in schemes for seed in seeds]
    summaries = {}
    reevaluated = 0
    test_stream = _TestText(options)
    for scheme, seed in tqdm(runs, desc="schemes x seeds", disable=options.quiet):
        folder = out / "models" / scheme / f"seed-{seed}"
        done = (folder / RUN_FILE).is_file() and options.resume
        if done:
            _check_resumed_record(folder, options)
            if _evaluated(json.loads((folder / RUN_FILE).read_text()), options.seq_len, options.sliding, factors) is None:
                try:
                    reevaluate(folder, test_stream, options.seq_len, options.sliding, factors, options.eval_tokens)
                except KeyboardInterrupt:  # its record is replaced whole or not at all: resuming evaluates it again
                    raise Interrupted(f"comparison interrupted while evaluating {scheme} (seed {seed}) anew.",
                                      resume_command(options.argv)) from None
                reevaluated += 1
        else:
            checkpoints = checkpoints_dir(folder)
            resumable = options.resume and last_checkpoint(checkpoints) is not None
            # a run stopped before its first complete checkpoint starts afresh (what it left is renamed aside)
            afresh = options.resume and not resumable and checkpoints.is_dir() and any(checkpoints.iterdir())
            resume = True if resumable else None
            run = TrainOptions(
                output_dir=str(folder), position_encoding=scheme, preset=options.preset, seq_len=options.seq_len,
                steps=options.steps, batch_size=options.batch_size, learning_rate=options.learning_rate,
                vocab_size=options.vocab_size, mem_len=options.mem_len if scheme == "transformer_xl" else None,
                seed=seed, train_file=options.train_file, corpus=options.corpus, max_train_bytes=options.max_train_bytes,
                eval_tokens=options.eval_tokens, overwrite=options.overwrite or bool(afresh),
                resume=resume, quiet=True, eval_factors=factors, sliding=options.sliding, argv=options.argv,
            )
            try:
                train_model(run)
            except Interrupted as stop:
                raise Interrupted(f"comparison interrupted while training {scheme} (seed {seed}): {stop}",
                                  resume_command(options.argv)) from None
        record = json.loads((folder / RUN_FILE).read_text())
        summaries.setdefault(scheme, []).append(_evaluated(record, options.seq_len, options.sliding, factors))
        if len(summaries[scheme]) == len(seeds):
            rows.append(compare_row(scheme, summaries[scheme], options.seq_len, factors))
            if not options.quiet:
                tqdm.write(f"{scheme:>15}: " + "  ".join(f"{f}x {_mean_cell(rows[-1], f'ppl_{f}x')}" for f in factors))
    meta = {
        "command": "hf-relpos " + shlex.join(options.argv),
        "quick": bool(options.quick),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPU cores, {sys.platform}",
        "seq_len": options.seq_len, "steps": options.steps, "preset": options.preset, "batch_size": options.batch_size,
        "learning_rate": options.learning_rate, "seeds": seeds, "factors": list(factors),
        "corpus": options.corpus or ("files" if options.train_file else "docs"), "python": platform.python_version(),
        "eval_tokens": options.eval_tokens, "evaluation": evaluation_name(options.seq_len, options.sliding),
        "seconds": round(time.perf_counter() - started, 1),
    }
    if reevaluated:
        meta["reevaluated_runs"] = reevaluated  # finished runs whose saved models were evaluated anew, not retrained
    table = render_table(rows, options.seq_len, meta)
    name = "compare-sliding" if options.sliding else "compare"
    with writing(out, f" and resume with: {resume_command(options.argv)} (the trained models are kept)"):
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (out / f"{name}.md").write_text(table)
        plot(rows, options.seq_len, factors, out / f"{name}.png", quick=meta["quick"])
    if not options.quiet:
        print(table)
    print(f"Wrote {out}/{name}.md, {name}.json and {name}.png")
    return out


def _all_schemes():
    from ..configuration_relpos import POSITION_ENCODINGS

    return POSITION_ENCODINGS


def _check_resumed_record(folder: Path, options: CompareOptions) -> None:
    """A finished run reused by ``--resume`` must have been trained on this command's text, length, preset, steps,
    batch size and learning rate (the table states them)."""
    record = json.loads((folder / RUN_FILE).read_text())
    wanted = options.corpus or (None if options.train_file else "docs")
    recorded = record.get("corpus_name", "docs")
    if "corpus_name" not in record and str(record.get("corpus", "")).startswith("user files: "):
        recorded = None  # a record of before --corpus: the docs, unless it was trained on --train-file
    if recorded != wanted:
        given = "--train-file" if wanted is None else f"--corpus {wanted}"
        raise UserError(f"--resume: {folder} was trained on {record['corpus']}, this command gives {given}: resume "
                        "with the original text, or use a new --output-dir")
    for name in ("seq_len", "preset", "steps", "batch_size", "learning_rate"):  # else its row would be mislabelled
        if record.get(name, getattr(options, name)) != getattr(options, name):
            flag = "--" + name.replace("_", "-")
            raise UserError(f"--resume: {folder} was trained with {flag} {record[name]}, this command gives "
                            f"{getattr(options, name)}: resume with the original {flag}, or use a new --output-dir")


def _evaluated(record: dict, seq_len: int, sliding: bool, factors) -> Optional[dict]:
    """The record as evaluated the way asked (its ``test_ppl_by_length`` and ``test_ppl`` from that evaluation,
    whether made in training or by a later re-evaluation), or None when some length was not evaluated so."""
    name = evaluation_name(seq_len, sliding)
    by_length = dict(record["test_ppl_by_length"]) if record.get("evaluation", evaluation_name(0, False)) == name else {}
    by_length.update(record.get("evaluations", {}).get(name, {}).get("test_ppl_by_length", {}))
    if not {str(seq_len * f) for f in factors} <= set(by_length):
        return None
    return {**record, "evaluation": name, "test_ppl_by_length": by_length, "test_ppl": by_length[str(seq_len)]}


class _TestText:
    """The comparison's held-out test text, read once and only if a run is re-evaluated; and its default cap."""

    def __init__(self, options: CompareOptions):
        self.options = options
        self.text = None

    def stream(self, tokenizer):
        from ..data import MAX_TEXT_BYTES, corpus, encode, read_text_files

        if self.text is None:
            if self.options.train_file:
                try:
                    self.text = read_text_files(self.options.train_file,
                                                max_bytes=self.options.max_train_bytes or MAX_TEXT_BYTES)["test"]
                except ValueError as error:
                    raise UserError(str(error)) from None
            else:
                self.text = corpus(self.options.corpus or "docs")[0]["test"]
        return encode(tokenizer, self.text)

    def default_tokens(self) -> Optional[int]:
        from ..data import DEFAULT_EVAL_TOKENS

        return None if self.options.train_file else DEFAULT_EVAL_TOKENS.get(self.options.corpus or "docs")


def reevaluate(folder: Path, test: _TestText, seq_len: int, sliding: bool, factors, eval_tokens=None) -> dict:
    """Evaluate a finished run's saved model as asked and add that to its record under ``evaluations`` (the
    record's own evaluation, made in training, stays as it was). Returns the new evaluation."""
    from .common import load_folder
    from .train import evaluate_lengths

    model, tokenizer = load_folder(str(folder))
    stream = test.stream(tokenizer)
    max_tokens = eval_tokens or test.default_tokens()
    name = evaluation_name(seq_len, sliding)
    ppl = evaluate_lengths(model, stream, [seq_len * f for f in factors], max_tokens,
                           stride=seq_len if sliding else None)
    record = json.loads((folder / RUN_FILE).read_text())
    evaluations = record.setdefault("evaluations", {})
    earlier = evaluations.get(name, {}).get("test_ppl_by_length", {})
    evaluations[name] = {
        "test_ppl_by_length": {**earlier, **{str(n): p for n, p in ppl.items()}},
        "test_tokens": int(min(stream.numel(), max_tokens or stream.numel())),
        "date": time.strftime("%Y-%m-%d"),
    }
    staged = folder / f".{RUN_FILE}.writing"  # replaced whole: the record is never half written
    try:
        with writing(folder):
            staged.write_text(json.dumps(record, indent=2))
            os.replace(staged, folder / RUN_FILE)
    finally:
        staged.unlink(missing_ok=True)  # a write that failed leaves no stray file in the model folder
    return evaluations[name]


def _mean_std(values: list) -> tuple:
    """Mean and sample standard deviation (0 for one value); inf when a seed cannot run at that length."""
    if any(math.isinf(v) for v in values):
        return math.inf, math.nan
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def compare_row(scheme: str, summaries: list, seq_len: int, factors) -> dict:
    """One scheme's row: at each length the mean, standard deviation and per-seed perplexities from its
    seeds' training records (all on the same test tokens)."""
    row = {"scheme": scheme, "position_params": summaries[0]["position_parameters"],
           "seeds": [s["seed"] for s in summaries]}
    for f in factors:
        values = [{int(n): p for n, p in s["test_ppl_by_length"].items()}[seq_len * f] for s in summaries]
        row[f"ppl_{f}x"], row[f"ppl_{f}x_std"] = _mean_std(values)
        row[f"ppl_{f}x_seeds"] = values
    if all("test_ppl_with_memory" in s for s in summaries):
        row["ppl_1x_with_memory"], row["ppl_1x_with_memory_std"] = _mean_std([s["test_ppl_with_memory"] for s in summaries])
    return row


def _mean_cell(row: dict, key: str) -> str:
    value, std = row[key], row.get(f"{key}_std")
    if math.isinf(value) or std is None or math.isnan(std):
        return format_ppl(value)
    return f"{value:.2f} ± {std:.2f}"


def render_table(rows, seq_len, meta) -> str:
    """compare.md: one row per scheme, perplexity on the test split at each length (mean ± std over seeds); the
    column at L is that held-out perplexity at the training length (each run's ``test_ppl``), not a training loss."""
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
        "| scheme | position params | " + " | ".join("held-out PPL at L" if f == 1 else f"{f}x PPL" for f in factors) + " |",
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
              + (f"; corpus {meta['corpus']} (Python {meta['python']})" if "corpus" in meta else "")
              + (f"; {meta['reevaluated_runs']} finished runs evaluated anew from their saved models"
                 if meta.get("reevaluated_runs") else "")
              + (f"; {meta['seconds'] / 60:.1f} minutes in all." if "seconds" in meta else ".")]
    return "\n".join(lines) + "\n"


def compare_command(args) -> int:
    compare(CompareOptions.from_namespace(args))
    return 0
