"""scripts/lengthgen_ablation.py: issue 52's report from its setups' lengthgen folders."""

import importlib.util
import json
import shutil
from pathlib import Path

import hf_relpos.commands.lengthgen as command
from test_lengthgen import SETTINGS

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("lengthgen_ablation", ROOT / "scripts" / "lengthgen_ablation.py")
ablation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ablation)


def test_the_studys_setup_reads_as_the_study_reported_it(tmp_path):
    """Setup a is the committed study: its rows (the study's learning-rate choice, its learned seeds) give the
    numbers of the study's own table (results/lengthgen/lengthgen.json, written by hf-relpos lengthgen)."""
    text = ablation.report({"a": ("the study", str(ROOT / "results" / "lengthgen"))}, tmp_path)
    study = {(r["task"], r["scheme"]): r for r in json.loads((ROOT / "results/lengthgen/lengthgen.json").read_text())["rows"]}
    for task in ablation.TASKS:
        for scheme in ablation.SCHEMES:
            row = study[(task, scheme)]
            cells = " | ".join(f"{100 * row[k]:.1f} ± {100 * row[f'{k}_std']:.1f}" for k in ("21-30", "31-40"))
            assert f"| a | {scheme} | 3 | {cells} |" in text, (task, scheme)
    assert "98.3 / 55.9" in text and "94.4 / 93.4" in text


def _record(task, seed, failures, table, best=1.0):
    return {"task": task, "scheme": "t5_bias", "seed": seed, "learning_rate": 1e-3, "settings": SETTINGS,
            "best_accuracy": best, "best_step": 10, "curve": [{"step": 10, "accuracy": best}],
            "accuracy": {"1-10": 1.0, "11-20": 1.0, "21-30": 0.1 * seed, "31-40": 0.0, "in": 1.0, "out": 0.05},
            "right_by_length": {}, "failures_by_length": failures,
            "position_parameters": {ablation.TABLE: table}}


def test_failures_are_counted_per_bucket_over_learned_runs_and_the_tables_plotted(tmp_path):
    folder = tmp_path / "setup"
    for seed in range(3):
        failures = {"22": {"stops early": 1, "does not stop": 2 + seed, "wrong item": 0},
                    "35": {"stops early": 0, "does not stop": 0, "wrong item": 4}}
        record = _record("replace", seed, failures, [[0.1 * seed, -0.2]] * 8, best=0.5 if seed == 2 else 1.0)
        path = command.record_path(folder, "replace", "t5_bias", seed, 1e-3)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
    text = ablation.report({"x": ("a test setup", str(folder))}, tmp_path / "out")
    # seeds 0 and 1 learned (seed 2 under the gate): 2 + 3 runs that do not stop at 21-30, 8 wrong items at 31-40
    assert "| replace | x | t5_bias | 21-30 | 2 | 5 | 0 |" in text
    assert "| replace | x | t5_bias | 31-40 | 0 | 0 | 8 |" in text
    assert "(2 of 3)" in text
    assert (tmp_path / "out" / "t5-bias-tables.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "t5-bias-tables.png" in (tmp_path / "out" / "ablation.md").read_text()


def test_the_first_unseen_bucket_is_where_decoding_first_reads_a_distance_bucket_training_never_read():
    """From the layouts by hand (task token, prompt, separator, answer, end) and upstream's own bucket function:
    repeat_copy trains on 43 positions at most (distances up to 42); decoding length n predicts the end at position
    2n + 1. Replace's prompt has two more items."""
    import torch
    from transformers.models.t5.modeling_t5 import T5Attention

    def bucket(d):
        return int(T5Attention._relative_position_bucket(torch.tensor(-d), bidirectional=False, num_buckets=32,
                                                         max_distance=128))

    for task, trained, stop in (("repeat_copy", 42, lambda n: 2 * n + 1), ("replace", 44, lambda n: 2 * n + 3)):
        seen = {bucket(d) for d in range(trained + 1)}
        want = next(n for n in range(21, 41) if any(bucket(d) not in seen for d in range(stop(n) + 1)))
        assert ablation.first_unseen_bucket(task, 20, 40) == want
    assert ablation.first_unseen_bucket("repeat_copy", 20, 22) is None  # none up to 22


def test_first_wrong_length_is_the_shortest_past_training():
    record = {"right_by_length": {"19": [9, 10], "21": [10, 10], "23": [3, 10], "22": [8, 10], "30": [0, 10]}}
    assert ablation.first_wrong_length(record, 20) == 22
    assert ablation.first_wrong_length({"right_by_length": {"21": [10, 10]}}, 20) is None


def test_reverse_has_a_row_per_scheme_with_the_studys_aggregate(tmp_path):
    folder = tmp_path / "reverse"
    for seed, best in ((0, 1.0), (1, 1.0), (2, 0.5)):
        record = _record("reverse", seed, {}, [[0.0]] * 8, best=best)
        record["task"] = "reverse"
        path = command.record_path(folder, "reverse", "nope", seed, 1e-3)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
    text = ablation.report({}, tmp_path / "out", reverse=str(folder))
    records = [json.loads(p.read_text()) for p in sorted(folder.rglob("seed-*.json"))]
    row = command.aggregate(records, 20, 0.95)[0]
    cells = " | ".join(f"{100 * row[k]:.1f} ± {100 * row[f'{k}_std']:.1f} (2 of 3)" for k in ("21-30", "31-40"))
    assert f"| nope | 3 | {cells} |" in text
    assert "| rope | 0 | not run | not run |" in text


def test_a_preface_by_hand_survives_the_rewrite(tmp_path):
    (tmp_path / "preface.md").write_text("**Partial**: the verdict so far.\n")
    ablation.report({}, tmp_path)
    ablation.report({}, tmp_path)
    text = (tmp_path / "ablation.md").read_text()
    assert text.startswith("# Why T5's bias does not extend here: the ablation\n\n**Partial**: the verdict so far.\n")
    assert text.count("**Partial**") == 1
