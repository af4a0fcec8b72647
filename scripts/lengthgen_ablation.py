"""Why T5's bias does not extend here (issue 52): the ablation's report from its setups' ``hf-relpos lengthgen``
folders. For repeat_copy and replace: t5_bias under each setup and NoPE where it was run, mean ± std over the
learned seeds at 21-30 and 31-40 beside the paper's numbers; how the wrong test answers fail, by bucket (each
record's ``failures_by_length``); where each run first goes wrong beside the first length that reads a bucket
training never read; reverse for the six schemes; and a plot of the learned T5 bias per bucket and head of each
setup's best state (each record's ``position_parameters``). A ``preface.md`` in the output folder (the runs' state
and the verdict, written by hand) goes under the title.

    python scripts/lengthgen_ablation.py                   # the setups below -> results/lengthgen-ablation/
    python scripts/lengthgen_ablation.py --setup a=results/lengthgen --setup b=runs/ablation-b --output /tmp/abl

Each setup's folder holds the records of one ``hf-relpos lengthgen`` command (the setup's options are in every
record's ``settings``); a setup with no folder yet is listed as not run. The learning rate of each task and scheme
is the study's choice (the first seed's run best in distribution, ``choose_lr``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_relpos import lengthgen as lg  # noqa: E402
from hf_relpos.commands import lengthgen as command  # noqa: E402

TASKS = ("repeat_copy", "replace")
SCHEMES = ("t5_bias", "nope")
# (letter, what it changes, its folder): the setups, each an `hf-relpos lengthgen` command
SETUPS = {
    "a": ("the study's setup (q·k/√d, N(0, 0.02), table N(0, 128^-0.5), lr 1e-3 / 3e-3)", "results/lengthgen"),
    "b": ("the probe's: position lr × 0.03 and the table started × 0.03", "runs/ablation-b"),
    "c": ("T5's own attention and initialisation (--attention-scale 1.0 --initialization t5)", "runs/ablation-c"),
    "d": ("one size up: 4 layers × 128 (--layers 4)", "runs/ablation-d"),
}
# Kazemnejad et al. 2023 (their figure's numbers as the issue quotes them): exact match at 21-30 / 31-40
PAPER = {("replace", "t5_bias"): (94.4, 93.4), ("repeat_copy", "t5_bias"): (98.3, 55.9)}
TABLE = "model.position.relative_attention_bias.weight"
# reverse for the study's six schemes (the last table), in a folder of its own
REVERSE = "results/lengthgen-ablation/reverse"
REVERSE_SCHEMES = ("nope", "t5_bias", "alibi", "rope", "learned", "sinusoidal")


def setup_records(folder: Path, task: str, scheme: str) -> list:
    """The records of ``task`` and ``scheme`` in ``folder`` at the learning rate the study chooses."""
    runs = [json.loads(p.read_text()) for p in sorted((folder / "records" / task / scheme).glob("lr-*/seed-*.json"))]
    if not runs:
        return []
    first = min(r["seed"] for r in runs)
    lr = command.choose_lr([r for r in runs if r["seed"] == first])
    return sorted((r for r in runs if r["learning_rate"] == lr), key=lambda r: r["seed"])


def failure_shares(records: list, bucket: tuple) -> dict:
    """Of the wrong test answers at the lengths of ``bucket`` over ``records``: the count of each kind."""
    counts = dict.fromkeys(command.FAILURE_KINDS, 0)
    for record in records:
        for length, kinds in record.get("failures_by_length", {}).items():
            if bucket[0] <= int(length) <= bucket[1]:
                for kind, n in kinds.items():
                    counts[kind] += n
    return counts


def first_unseen_bucket(task: str, train_length: int, max_length: int, num_buckets: int = 32,
                        max_distance: int = 128) -> int | None:
    """The first test length whose decoding reads a T5 bucket (causal) that no training position read, or None.

    A training sequence of the longest instance has ``max_tokens`` positions, so its queries read distances up to
    ``max_tokens - 1``. Decoding an instance of length ``n`` predicts the end at its last answer token, position
    ``len(ids) - 2``, whose farthest key is at that distance: the farthest any of its queries reads.
    """
    import torch

    from hf_relpos.functional import t5_relative_position_bucket

    def buckets(farthest: int) -> set:
        distances = -torch.arange(farthest + 1)
        return set(t5_relative_position_bucket(distances, False, num_buckets, max_distance).tolist())

    seen = buckets(lg.max_tokens(task, train_length) - 1)
    for n in range(train_length + 1, max_length + 1):
        if buckets(lg.max_tokens(task, n) - 2) - seen:
            return n
    return None


def first_wrong_length(record: dict, train_length: int):
    """The shortest test length past training with a wrong answer, or None."""
    wrong = [int(n) for n, (right, total) in record["right_by_length"].items()
             if int(n) > train_length and right < total]
    return min(wrong) if wrong else None


def _cell(row: dict, key: str) -> str:
    if row is None:
        return "not run"
    if not row["learned"]:
        return f"not learned (in {100 * row['best_accuracy']:.1f})"
    mean, std = row[key], row[f"{key}_std"]
    seeds = len(row["seeds"])
    note = "" if len(row["learned"]) == seeds else f" ({len(row['learned'])} of {seeds})"
    return f"{100 * mean:.1f} ± {100 * std:.1f}{note}"


def report(setups: dict, out: Path, train_length: int = 20, gate: float = 0.95, reverse=None) -> str:
    buckets = [b for b in lg.buckets(train_length) if b[0] > train_length]
    names = [lg.bucket_name(b) for b in buckets]
    preface = out / "preface.md"  # the state of the runs and the verdict, by hand: kept when the report is rewritten
    lines = ["# Why T5's bias does not extend here: the ablation", "",
             *([preface.read_text().strip(), ""] if preface.exists() else []),
             "Exact match (%) of greedy decoding past the training lengths (trained on 1-20), mean ± std over the "
             f"learned seeds (best validation accuracy ≥ {gate:.0%}), each setup's runs at the learning rate the "
             "study chooses. `python scripts/lengthgen_ablation.py`.", "", "| setup | what it changes | folder |",
             "| --- | --- | --- |"]
    lines += [f"| {k} | {what} | `{folder}` |" for k, (what, folder) in setups.items()]
    failures, tables, onsets = [], {}, []
    for task in TASKS:
        lines += ["", f"## {task}", "", f"| setup | scheme | seeds | {' | '.join(names)} | paper {' / '.join(names)} |",
                  "| --- | --- | ---: | " + " | ".join("---:" for _ in names) + " | ---: |"]
        for letter, (_, folder) in setups.items():
            for scheme in SCHEMES:
                records = setup_records(Path(folder), task, scheme)
                if not records:
                    continue
                row = command.aggregate(records, train_length, gate)[0]
                paper = PAPER.get((task, scheme))
                lines.append(f"| {letter} | {scheme} | {len(records)} | "
                             + " | ".join(_cell(row, n) for n in names)
                             + f" | {' / '.join(map(str, paper)) if paper else '-'} |")
                learned = [r for r in records if r["best_accuracy"] >= gate]
                for bucket, name in zip(buckets, names):
                    shares = failure_shares(learned, bucket)
                    if sum(shares.values()) or any("failures_by_length" in r for r in learned):
                        failures.append(f"| {task} | {letter} | {scheme} | {name} | "
                                        + " | ".join(str(shares[k]) for k in command.FAILURE_KINDS) + " |")
                if scheme == "t5_bias" and learned:
                    unseen = first_unseen_bucket(task, train_length, 2 * train_length)
                    onsets.append(f"| {task} | {letter} | {unseen or '-'} | " + ", ".join(
                        f"seed {r['seed']}: {first_wrong_length(r, train_length) or 'none'}" for r in learned) + " |")
                    best = max(learned, key=lambda r: (r["accuracy"][names[0]] or 0.0, -r["seed"]))
                    if TABLE in best.get("position_parameters", {}):
                        tables[(task, letter)] = (best["seed"], best["position_parameters"][TABLE])
    lines += ["", "## Where the answers first go wrong, and where an unseen bucket first appears", "",
              "Per learned t5_bias run: the shortest test length with a wrong answer. Beside it, the first length "
              "whose decoding reads a bucket of T5's causal bias (32 buckets up to 128) that no training position "
              "read: the stop query of an instance of length n reads distances up to len - 2 "
              "(`first_unseen_bucket`).", "",
              "| task | setup | first length with an unseen bucket | first wrong length per seed |",
              "| --- | --- | ---: | --- |", *onsets]
    lines += ["", "## How the wrong answers fail", "",
              "Counted over the learned runs' wrong test answers, from the first wrong token: the end where an item "
              "is due (stops early), an item where the end is due (does not stop), another item (wrong item). "
              "Records made before the classification existed are left out.", "",
              "| task | setup | scheme | lengths | " + " | ".join(command.FAILURE_KINDS) + " |",
              "| --- | --- | --- | --- | ---: | ---: | ---: |", *failures]
    if reverse is not None:
        lines += ["", "## reverse (the study's six schemes, the study's setup)", "",
                  f"`hf-relpos lengthgen --tasks reverse --lrs 1e-3 3e-3` in `{reverse}`; as above, mean ± std over "
                  "the learned seeds at the learning rate the study chooses, or the best validation accuracy of a "
                  "scheme that learned it in no seed. The paper's reverse numbers are not beside them: the "
                  "authors' result files (`results/classic.jsonl`, `results/len_gen_experiments.csv` in "
                  "McGill-NLP/length-generalization) hold no reverse run, and this project has no table of them; "
                  "read off the paper's plot they would be guesses.", "",
                  f"| scheme | seeds | {' | '.join(names)} |", "| --- | ---: | " + " | ".join("---:" for _ in names) + " |"]
        for scheme in REVERSE_SCHEMES:
            records = setup_records(Path(reverse), "reverse", scheme)
            if records:
                row = command.aggregate(records, train_length, gate)[0]
                lines.append(f"| {scheme} | {len(records)} | " + " | ".join(_cell(row, n) for n in names) + " |")
            else:
                lines.append(f"| {scheme} | 0 | " + " | ".join("not run" for _ in names) + " |")
    out.mkdir(parents=True, exist_ok=True)
    if tables:
        plot_tables(tables, out / "t5-bias-tables.png")
        lines += ["", "![The learned T5 bias per bucket and head](t5-bias-tables.png)"]
    text = "\n".join(lines) + "\n"
    (out / "ablation.md").write_text(text)
    return text


def plot_tables(tables: dict, path: Path) -> None:
    """One panel per task and setup: the learned bias of each head against its bucket (causal: bucket b holds the
    distances T5's bucket function maps to it; the last, every distance from its start on)."""
    plt = command._matplotlib()
    keys = sorted(tables)
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 2.8), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        seed, table = tables[key]
        for head in range(len(table[0])):
            ax.plot(range(len(table)), [row[head] for row in table], marker=".", linewidth=1, label=f"head {head}")
        ax.set_title(f"{key[0]}, setup {key[1]} (seed {seed})", fontsize=9)
        ax.set_xlabel("bucket")
        ax.grid(True, alpha=0.3)
    axes[0, 0].set_ylabel("bias")
    axes[0, -1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="append", default=[], metavar="LETTER=FOLDER",
                        help="a setup's folder (default: the issue's a-d in SETUPS)")
    parser.add_argument("--output", default="results/lengthgen-ablation")
    parser.add_argument("--reverse", default=REVERSE, help="the reverse runs' folder (default: %(default)s)")
    args = parser.parse_args(argv)
    setups = dict(SETUPS)
    for given in args.setup:
        letter, _, folder = given.partition("=")
        setups[letter] = (SETUPS.get(letter, (letter, ""))[0], folder)
    print(report(setups, Path(args.output), reverse=args.reverse))


if __name__ == "__main__":
    main()
