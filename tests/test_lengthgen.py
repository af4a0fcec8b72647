"""``hf-relpos lengthgen`` and its tasks (hf_relpos/lengthgen.py): the generators against independent checks, the
held-out sets, the length distributions, the buckets, exact match against ``generate``, the best-state selection,
the gate, the learning-rate choice, and the command end to end (tiny runs, resume with the new options)."""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter

import pytest
import torch

import hf_relpos_cli
import hf_relpos.commands.lengthgen as command
from hf_relpos.commands.errors import UserError
from hf_relpos import lengthgen as lg

TINY = ["--steps", "3", "--train-length", "3", "--batch-size", "4", "--eval-every", "2", "--preset", "micro",
        "--items", "8", "--jobs", "1", "--quiet"]
SETTINGS = dict(train_length=3, steps=3, batch_size=4, preset="micro", items=8, vocabulary=lg.vocab_size(8),
                eval_every=2, stop_at=None, warmup=0.05, validation_per_length=4, test_per_length=3,
                position_lr_scale=1.0, position_init_scale=1.0, layers=None, attention_scale=None,
                initialization="default")


def items(instance):
    """The prompt's and the answer's tokens as text, without the task token, separator and end-of-sequence."""
    tokens = lg.decode(instance.ids).split(" ")
    return tokens[1 : instance.answer_start - 1], tokens[instance.answer_start : -1]


def item_index(token: str) -> int:
    assert token[0] == "w" and token[1:].isdigit(), token
    return int(token[1:])


@pytest.mark.parametrize("task", lg.TASKS)
def test_each_task_answers_what_an_independent_computation_gives(task):
    rng = random.Random(1)
    for length in [1, 2, 3, 7, 20, 40] * 5:
        instance = lg.make_instance(task, rng, length, items=13)
        ids = instance.ids
        assert ids[0] == lg.TOKEN_ID[f"<{task}>"] and ids[instance.answer_start - 1] == lg.SEP_ID
        assert ids[-1] == lg.EOS_ID and lg.EOS_ID not in ids[:-1] and lg.SEP_ID not in ids[: instance.answer_start - 1]
        assert instance.length == length and len(ids) <= lg.max_tokens(task, length)
        assert max(ids) < lg.vocab_size(13)
        prompt, answer = items(instance)
        if task in ("copy", "reverse", "sort"):
            assert len(prompt) == length and all(0 <= item_index(t) < 13 for t in prompt)
            expected = {"copy": prompt, "reverse": list(reversed(prompt)), "sort": sorted(prompt, key=item_index)}
            assert answer == expected[task]
            assert len(ids) == lg.max_tokens(task, length)
        elif task == "repeat_copy":
            assert len(prompt) == length and len(set(prompt)) == 1 and answer == prompt
            assert len(ids) == lg.max_tokens(task, length)
        elif task == "replace":
            x, y, *rest = prompt
            assert x != y and rest == [x] * length and answer == [y] * length  # "x y x x x" -> "y y y"
            assert len(ids) == lg.max_tokens(task, length)
        elif task == "addition":
            plus = prompt.index("+")
            a, b = "".join(prompt[:plus]), "".join(prompt[plus + 1 :])
            assert len(a) == len(b) == length and (length == 1 or (a[0] != "0" and b[0] != "0"))
            assert "".join(answer) == str(int(a) + int(b))  # Python's own integers
            assert len(ids) == lg.max_tokens(task, length) or int(a) + int(b) < 10**length
        elif task == "summation":
            assert len(prompt) == length and answer == [str(sum(map(int, prompt)) % 10)]
        else:
            assert len(prompt) == length and set(prompt) <= {"0", "1"}
            assert answer == ["Y" if prompt.count("1") % 2 == 0 else "N"]
    # the decoded text reads as the instance
    text = lg.decode(lg.make_instance(task, random.Random(0), 3).ids)
    assert text.startswith(f"<{task}> ") and text.endswith(" = " + text.split(" = ")[1])


def test_items_come_from_their_types_uniformly_and_every_other_id_stays():
    """100 item types by default (the paper's), each about as often; the ids of the fixed tokens do not depend on
    --items, so a vocabulary is the fixed tokens and then w0 .. w<items-1>."""
    rng = random.Random(2)
    drawn = Counter(t for _ in range(400) for t in items(lg.make_instance("copy", rng, 25))[0])
    assert set(drawn) == {f"w{k}" for k in range(lg.ITEMS)}  # 10,000 draws: every type (miss chance ~1e-42)
    assert max(drawn.values()) < 1.5 * 100 and min(drawn.values()) > 0.5 * 100  # 100 expected each (±5 sigma)
    # replace's y is uniform over the other types: about 1/99 each, never x
    pairs = [items(lg.make_instance("replace", rng, 1, items=4))[0][:2] for _ in range(1200)]
    assert Counter(tuple(p) for p in pairs).keys() == {(f"w{a}", f"w{b}") for a in range(4) for b in range(4) if a != b}
    assert lg.vocabulary(5)[: lg.ITEM_BASE] == lg.vocabulary(100)[: lg.ITEM_BASE] == lg.FIXED
    assert lg.vocabulary(5)[lg.ITEM_BASE :] == ("w0", "w1", "w2", "w3", "w4") and lg.vocab_size(5) == lg.ITEM_BASE + 5
    assert len(set(lg.vocabulary())) == lg.vocab_size()
    for bad in (1, lg.MAX_ITEMS + 1):
        with pytest.raises(ValueError, match="items must be from 2"):
            lg.make_instance("copy", rng, 3, items=bad)


@pytest.mark.parametrize("task", lg.TASKS)
def test_distinct_instances_counts_what_the_generator_can_make(task):
    """Against enumeration: every instance the generator can make at a small length and item count is found by
    drawing many, and their number is the formula's."""
    rng = random.Random(3)
    for length in (1, 2, 3):
        expected = lg.distinct_instances(task, length, items=3)
        if expected > 400:
            continue
        seen = {lg.make_instance(task, rng, length, items=3).ids for _ in range(40 * expected)}
        assert len(seen) == expected, (task, length)
    # the big ones by hand
    assert lg.distinct_instances("copy", 20) == 100**20 and lg.distinct_instances("replace", 5) == 9900
    assert lg.distinct_instances("sort", 2) == 100**2 and lg.distinct_instances("addition", 2) == 90 * 90


def test_held_out_instances_never_train_unless_their_length_has_too_few():
    """The validation and test instances are skipped by training where the task has at least HOLD_OUT_FACTOR times
    as many distinct instances at that length; parity of 1-3 bits (2-8 instances) keeps them (else no instance of
    that length would train)."""
    validation = lg.validation_instances("repeat_copy", 6, 10, items=50)
    test = lg.test_instances("repeat_copy", 12, 10, items=50)
    assert Counter(i.length for i in validation) == {n: 10 for n in range(1, 7)}
    skip = lg.held_out("repeat_copy", validation + test, items=50)
    # in distribution: 20 held out of 50 per length (50 < 5 x 20: kept in training); past it: 10 of 50 (skipped)
    assert {len(ids) for ids in skip} == {lg.max_tokens("repeat_copy", n) for n in range(7, 13)}
    skip = lg.held_out("repeat_copy", validation + test, items=100)
    assert skip == {i.ids for i in validation + test}  # 100 >= 5 x 20 everywhere
    stream = lg.train_instances("repeat_copy", 0, 6, items=100, skip=skip)
    drawn = [next(stream) for _ in range(3000)]
    assert not {i.ids for i in drawn} & skip
    assert set(Counter(i.length for i in drawn)) == set(range(1, 7))
    # a held-out instance is drawn again at its own length: lengths stay U(1, L) where one length loses 20% of its
    # instances (copy of 1 item: 20 of 100 held out) and the others none
    validation = lg.validation_instances("copy", 20, 10)
    skip = lg.held_out("copy", validation + lg.test_instances("copy", 40, 10), items=100)
    assert {len(ids) for ids in skip} == {lg.max_tokens("copy", n) for n in range(1, 41)}
    stream = lg.train_instances("copy", 0, 20, skip=skip)
    counts = Counter(next(stream).length for _ in range(20000))
    assert 0.9 * 1000 < counts[1] < 1.1 * 1000  # 1,000 expected (±3 sigma); redrawing at any length gave ~845
    parity = lg.held_out("parity", lg.test_instances("parity", 8, 3), items=2)
    assert {len(ids) for ids in parity} == {lg.max_tokens("parity", n) for n in range(4, 9)}  # 2**4 >= 15


def test_streams_are_reproducible_and_lengths_uniform():
    first = [next(s) for s in [lg.train_instances("copy", 5, 20)] for _ in range(3)]
    stream = lg.train_instances("copy", 5, 20)
    assert [next(stream) for _ in range(3)] == first
    assert [next(lg.train_instances("copy", 6, 20)) for _ in range(1)] != first[:1]
    stream = lg.train_instances("parity", 0, 20)
    counts = Counter(next(stream).length for _ in range(6000))
    assert set(counts) == set(range(1, 21))  # U(1, L): every length, none outside
    assert max(counts.values()) < 1.35 * 300 and min(counts.values()) > 0.65 * 300  # 300 expected each (±5 sigma)
    test = lg.test_instances("copy", 40, 3)
    assert Counter(i.length for i in test) == {n: 3 for n in range(1, 41)}  # stratified over 1..2L
    assert lg.test_instances("copy", 40, 3) == test  # the same for every run


def test_buckets_and_accuracy_by_hand():
    assert lg.buckets(20) == [(1, 10), (11, 20), (21, 30), (31, 40)]
    assert lg.buckets(5) == [(1, 3), (4, 5), (6, 8), (9, 10)]
    assert lg.buckets(1) == [(1, 1), (2, 2)]
    counts = {1: (2, 2), 2: (1, 2), 3: (0, 2), 4: (1, 4), 5: (0, 2), 6: (1, 2), 7: (2, 2), 8: (0, 2)}
    result = lg.accuracy_by_bucket(counts, 4)
    # by hand: 1-2: 3/4; 3-4: 1/6; 5-6: 1/4; 7-8: 2/4; in: 4/10; out: 3/8
    assert result == pytest.approx({"1-2": 0.75, "3-4": 1 / 6, "5-6": 0.25, "7-8": 0.5, "in": 0.4, "out": 0.375})


def _record(task, scheme, seed, rights, best, lr=1e-3, step=100):
    """A run's record as run_one writes it, from the right answers at lengths 1-4 (2 instances each, L = 2)."""
    return {"task": task, "scheme": scheme, "seed": seed, "learning_rate": lr, "best_accuracy": best,
            "best_step": step, "curve": [{"step": step, "accuracy": best}],
            "right_by_length": {str(n): [r, 2] for n, r in enumerate(rights, 1)},
            "token_accuracy_by_length": {str(n): r / 2 for n, r in enumerate(rights, 1)},
            "accuracy": lg.accuracy_by_bucket({n: (r, 2) for n, r in enumerate(rights, 1)}, 2)}


def test_the_gate_keeps_unlearned_runs_out_of_every_mean():
    """Means and sample standard deviations over the learned runs only (best validation accuracy >= the gate); the
    others are listed with their accuracy, and a task x scheme with no learned run says "not learned"."""
    records = [_record("copy", "alibi", 0, [2, 1, 0, 0], 0.96), _record("copy", "alibi", 1, [2, 2, 1, 0], 1.0),
               _record("copy", "alibi", 2, [0, 0, 0, 0], 0.40),  # not learned: its zeros must not pull the mean
               _record("copy", "nope", 0, [1, 1, 1, 1], 0.5), _record("copy", "nope", 1, [1, 1, 1, 1], 0.94999)]
    rows = command.aggregate(records, 2, gate=0.95)
    alibi, nope = rows
    assert (alibi["scheme"], alibi["seeds"], alibi["learned"]) == ("alibi", [0, 1, 2], [0, 1])
    assert alibi["not_learned"] == {"2": 0.40}
    assert alibi["in_seeds"] == [0.75, 1.0] and alibi["in"] == 0.875
    assert alibi["in_std"] == pytest.approx(statistics.stdev([0.75, 1.0]))
    assert alibi["out_seeds"] == [0.0, 0.25] and alibi["by_length"] == {"1": 1.0, "2": 0.75, "3": 0.25, "4": 0.0}
    assert alibi["best_accuracy"] == pytest.approx(statistics.mean([0.96, 1.0, 0.40]))
    assert nope["learned"] == [] and nope["in"] is None and nope["by_length"] == {}
    assert nope["not_learned"] == {"0": 0.5, "1": 0.94999}
    # a lower gate lets nope in
    assert command.aggregate(records, 2, gate=0.5)[1]["out"] == 0.5
    meta = {"train_length": 2, "seeds": [0, 1, 2], "buckets": ["1", "2", "3", "4"], "gate": 0.95, "tasks": ["copy"],
            "schemes": ["alibi", "nope"], "eval_every": 100, "test_per_length": 2, "command": "hf-relpos lengthgen",
            "date": "d", "machine": "m", "preset": "micro", "model": command.PRESETS["micro"], "items": 100,
            "steps": 5, "batch_size": 4, "learning_rates": [1e-3], "jobs": 1, "runs_trained": 5,
            "train_cpu_seconds": 6.0, "seconds": 7.0}
    table = command.render_table(rows, meta)
    headline = _table_rows(table, "Headline: lengths 3, the first bucket past training")
    assert headline == {"alibi": [f"{100 * alibi['3']:.1f} ± {100 * alibi['3_std']:.1f} (2 of 3)"],
                        "nope": ["not learned (in 95.0)"]}
    per_task = _table_rows(table, "copy")
    assert per_task["nope"] == ["0 of 2 runs", "0.001", f"{100 * nope['best_accuracy']:.1f} ± "
                                f"{100 * nope['best_accuracy_std']:.1f}", "-", "-", "-", "-"]
    assert per_task["alibi"][:2] == ["2 of 3 runs", "0.001"]
    assert "copy alibi seed 2 (40.0%); copy nope seed 0 (50.0%); copy nope seed 1 (95.0%)" in table


def test_negative_controls_stay_out_of_the_headline():
    records = [_record("copy", "alibi", 0, [2, 2, 1, 0], 1.0), _record("parity", "alibi", 0, [2, 2, 1, 1], 1.0)]
    meta = {"train_length": 2, "seeds": [0], "buckets": ["1", "2", "3", "4"], "gate": 0.95,
            "tasks": ["copy", "parity"], "schemes": ["alibi"], "eval_every": 1, "test_per_length": 2, "command": "c",
            "date": "d", "machine": "m", "preset": "micro", "model": command.PRESETS["micro"], "items": 100,
            "steps": 5, "batch_size": 4, "learning_rates": [1e-3], "jobs": 1, "runs_trained": 2,
            "train_cpu_seconds": 6.0, "seconds": 7.0}
    table = command.render_table(command.aggregate(records, 2, 0.95), meta)
    assert "| scheme | copy |\n" in table and "### parity (negative control)" in table
    assert _table_rows(table, "Headline: lengths 3, the first bucket past training") == {"alibi": ["50.0"]}


def test_the_learning_rate_is_the_one_best_in_distribution():
    runs = [_record("copy", "nope", 0, [0] * 4, 0.90, lr=3e-4), _record("copy", "nope", 0, [0] * 4, 1.0, lr=1e-3,
                                                                          step=750),
            _record("copy", "nope", 0, [0] * 4, 1.0, lr=3e-3, step=500)]
    assert command.choose_lr(runs) == 3e-3  # both reach 100%: the one that got there first
    runs[2]["best_step"] = 750
    assert command.choose_lr(runs) == 1e-3  # a full tie: the first given
    assert command.choose_lr(runs[:1]) == 3e-4


def test_selection_keeps_the_first_best_state_and_stops_at_the_target(monkeypatch):
    """The callback measures at every ``every`` steps and at the last, keeps a copy of the state at the first best
    measurement (later equal ones do not replace it), leaves the model in training mode, and stops training once
    the accuracy reaches ``stop_at``."""
    from types import SimpleNamespace

    accuracies = iter([0.2, 0.7, 0.5, 0.7, 0.9])
    modes = []

    def fake_exact_match(model, instances, batch_size=128):
        modes.append(model.training)
        value = next(accuracies)
        return [True] * round(10 * value) + [False] * (10 - round(10 * value)), []

    monkeypatch.setattr(command, "exact_match", fake_exact_match)
    model = torch.nn.Linear(2, 2)
    selection = command._selection(list(range(10)), every=3, stop_at=0.9)
    control = SimpleNamespace(should_training_stop=False)
    weights = {}
    for step in range(1, 14):
        with torch.no_grad():
            model.weight.fill_(step)
        weights[step] = model.weight.clone()
        state = SimpleNamespace(global_step=step, max_steps=13)
        selection.on_step_end(None, state, control, model=model)
        assert model.training and control.should_training_stop == (step == 13)
    assert [p["step"] for p in selection.curve] == [3, 6, 9, 12, 13] and modes == [False] * 5
    assert [p["accuracy"] for p in selection.curve] == [0.2, 0.7, 0.5, 0.7, 0.9]
    assert selection.best == 0.9 and selection.best_step == 13
    # without the last measurement: the first of the two 0.7s (step 6), a copy (not the live weights)
    accuracies = iter([0.2, 0.7, 0.5, 0.7])
    selection = command._selection(list(range(10)), every=3, stop_at=None)
    for step in range(1, 13):
        with torch.no_grad():
            model.weight.fill_(step)
        selection.on_step_end(None, SimpleNamespace(global_step=step, max_steps=99), control, model=model)
    assert selection.best_step == 6 and torch.equal(selection.state["weight"], weights[6])


def test_a_run_scores_its_best_state_and_records_its_curve(monkeypatch):
    """run_one scores the state its selection kept (not the last one): the record's test counts are what that
    state gives, and its curve, best step and steps trained agree."""
    kept = []
    real = command._selection
    monkeypatch.setattr(command, "_selection", lambda *args: kept.append(real(*args)) or kept[-1])
    settings = dict(SETTINGS, steps=8, eval_every=3)
    record = command.run_one("copy", "alibi", 0, 3e-3, settings)
    selection, = kept
    assert [p["step"] for p in record["curve"]] == [3, 6, 8] and record["steps_trained"] == 8
    assert record["best_step"] == selection.best_step and record["best_accuracy"] == selection.best
    assert record["best_accuracy"] == max(p["accuracy"] for p in record["curve"])
    assert [p["step"] for p in record["losses"]] == [3, 6]
    model = command.build_model("copy", "alibi", "micro", 3, items=8)
    model.load_state_dict(selection.state)
    test = lg.test_instances("copy", 6, 3, items=8)
    exact, _ = command.exact_match(model.eval(), test)
    assert record["right_by_length"] == {str(n): [sum(e for e, i in zip(exact, test) if i.length == n), 3]
                                         for n in range(1, 7)}
    validation = lg.validation_instances("copy", 3, 4, items=8)
    assert sum(command.exact_match(model, validation)[0]) / len(validation) == record["best_accuracy"]
    # a target reached at the first measurement (every answer right): training stops there
    monkeypatch.setattr(command, "exact_match", lambda model, instances: ([True] * len(instances), [1.0] * len(instances)))
    record = command.run_one("copy", "alibi", 0, 3e-3, dict(settings, stop_at=0.9))
    assert record["steps_trained"] == 3 and [p["step"] for p in record["curve"]] == [3]


def _train_briefly(scheme):
    # lr 3e-3 for 120 steps over 8 item types: the micro models get some short lengths right and longer ones wrong
    torch.manual_seed(0)
    model = command.build_model("copy", scheme, "micro", 3, items=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = lg.train_instances("copy", 0, 3, items=8)
    for _ in range(120):
        loss = model(**command.collate([next(stream) for _ in range(32)])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@pytest.mark.parametrize("scheme", ["t5_bias", "rope"])
def test_exact_match_is_greedy_decoding(scheme):
    """One teacher-forced forward scores as generate's greedy decoding does (its cache included), on a model that
    gets some instances right and some wrong."""
    model = _train_briefly(scheme)
    test = lg.test_instances("copy", 6, 4, items=8)
    exact, tokens = command.exact_match(model, test, batch_size=7)  # batches of mixed lengths, right-padded
    greedy = []
    for instance in test:
        prompt = torch.tensor([instance.prompt])
        out = model.generate(prompt, max_new_tokens=len(instance.answer), do_sample=False, eos_token_id=lg.EOS_ID,
                             pad_token_id=lg.PAD_ID)
        greedy.append(out[0, prompt.shape[1] :].tolist() == list(instance.answer))
    assert exact == greedy
    assert 0 < sum(exact) < len(exact), sum(exact)  # both kinds of instance are checked
    assert all(t == 1.0 for t, e in zip(tokens, exact) if e) and any(0 < t < 1 for t in tokens)


def _table_rows(table: str, heading: str) -> dict:
    lines = table.split(f"### {heading}\n", 1)[1].splitlines()
    body = [line for line in lines[3:] if line.startswith("|")]
    body = body[: next((k for k, line in enumerate(lines[3:]) if not line.startswith("|")), len(body))]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in body)}


def test_a_tiny_run_end_to_end_and_resume_trains_only_what_is_missing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "lg"
    argv = ["lengthgen", "--tasks", "copy", "parity", "--schemes", "alibi", "learned", "--seeds", "2",
            "--gate", "0.01", "--output-dir", str(out), *TINY]
    assert hf_relpos_cli.main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["curves.png", "lengthgen.json", "lengthgen.md", "lengthgen.png",
                                                     "records"]
    for image in ("lengthgen.png", "curves.png"):
        assert (out / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "lengthgen.json").read_text())
    table = (out / "lengthgen.md").read_text()
    assert data["meta"]["buckets"] == ["1-2", "3", "4-5", "6"] and data["meta"]["quick"] is False
    assert data["meta"]["items"] == 8 and data["meta"]["learning_rates"] == [1e-3]
    assert "Command: `hf-relpos lengthgen --tasks copy parity" in table and "machine:" in table
    for row in data["rows"]:
        records = [json.loads(command.record_path(out, row["task"], row["scheme"], s, 1e-3).read_text())
                   for s in (0, 1)]
        learned = [r for r in records if r["best_accuracy"] >= 0.01]
        assert row["learned"] == [r["seed"] for r in learned]
        for key in ("1-2", "3", "4-5", "6", "in", "out"):
            per_seed = [lg.accuracy_by_bucket({int(n): c for n, c in r["right_by_length"].items()}, 3)[key]
                        for r in learned]
            assert row[f"{key}_seeds"] == per_seed
            assert row[key] == (pytest.approx(statistics.mean(per_seed)) if per_seed else None)
        # every test length was scored, past the training length too (learned's table covers 2L)
        assert sorted(int(n) for n in records[0]["right_by_length"]) == list(range(1, 7))
        assert [p["step"] for p in records[0]["curve"]] == [2, 3] and records[0]["settings"]["items"] == 8

    # --resume with a scheme added: only its runs train, the others' records are read back as they were
    before = {p: p.read_bytes() for p in (out / "records").rglob("*.json")}
    trained = []
    real = command.run_one
    monkeypatch.setattr(command, "run_one", lambda *run: trained.append(run[:4]) or real(*run))
    assert hf_relpos_cli.main(argv[:6] + ["nope"] + argv[6:] + ["--resume"]) == 0
    assert trained == [("copy", "nope", 0, 1e-3), ("copy", "nope", 1, 1e-3), ("parity", "nope", 0, 1e-3),
                       ("parity", "nope", 1, 1e-3)]
    assert all(p.read_bytes() == content for p, content in before.items())
    assert {r["scheme"] for r in json.loads((out / "lengthgen.json").read_text())["rows"]} == {"alibi", "learned", "nope"}

    # an unrecorded run (deleted record) is trained again; the same command once more trains nothing; another gate
    # only changes the table
    command.record_path(out, "parity", "alibi", 1, 1e-3).unlink()
    trained.clear()
    assert hf_relpos_cli.main(argv + ["--resume"]) == 0
    assert trained == [("parity", "alibi", 1, 1e-3)]
    trained.clear()
    assert hf_relpos_cli.main([a if a != "0.01" else "1" for a in argv] + ["--resume"]) == 0
    assert trained == [] and "not learned" in (out / "lengthgen.md").read_text()
    capsys.readouterr()

    # without --resume or --overwrite the folder is refused; a resume with other settings too (one line each)
    for extra, expected in (([], "--resume"), (["--resume", "--steps", "4"], "steps 3"),
                            (["--resume", "--items", "9"], "items 8, vocabulary"),
                            (["--resume", "--eval-every", "1"], "eval_every 2"),
                            (["--resume", "--stop-at", "0.97"], "stop_at 1.0"),
                            # other tasks with other settings: no record of theirs, the folder's records refuse it
                            (["--resume", "--items", "9", "--tasks", "reverse"], "items 8, vocabulary")):
        assert hf_relpos_cli.main(argv + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("hf-relpos lengthgen: error: ") and err.count("\n") == 1 and expected in err, err


def test_several_learning_rates_try_each_on_the_first_seed_then_train_the_rest_at_the_best(tmp_path, monkeypatch):
    """--lrs: seed --seed trains at every rate; the other seeds only at the rate best in distribution for their task
    and scheme (choose_lr); a resume with one more rate trains it on the first seed, and the other seeds again only
    if the choice changed."""
    out = tmp_path / "lg"
    argv = ["lengthgen", "--tasks", "copy", "--schemes", "alibi", "nope", "--seeds", "3", "--seed", "4",
            "--lrs", "1e-3", "2e-3", "--output-dir", str(out), *TINY]
    best = {("alibi", 1e-3): 0.5, ("alibi", 2e-3): 0.8, ("nope", 1e-3): 0.9, ("nope", 2e-3): 0.3,
            ("alibi", 3e-3): 0.7, ("nope", 3e-3): 0.95}
    trained = []

    def fake_run(task, scheme, seed, lr, settings):
        trained.append((scheme, seed, lr))
        return dict(_record(task, scheme, seed, [1, 1, 1, 1], best[scheme, lr], lr=lr), settings=settings,
                    accuracy=lg.accuracy_by_bucket({n: (1, 2) for n in range(1, 7)}, 3), seconds=1.0)

    monkeypatch.setattr(command, "run_one", fake_run)
    assert hf_relpos_cli.main(argv) == 0
    assert trained[:4] == [("alibi", 4, 1e-3), ("alibi", 4, 2e-3), ("nope", 4, 1e-3), ("nope", 4, 2e-3)]
    assert sorted(trained[4:]) == [("alibi", 5, 2e-3), ("alibi", 6, 2e-3), ("nope", 5, 1e-3), ("nope", 6, 1e-3)]
    rows = {r["scheme"]: r for r in json.loads((out / "lengthgen.json").read_text())["rows"]}
    assert rows["alibi"]["learning_rate"] == 2e-3 and rows["nope"]["learning_rate"] == 1e-3
    assert rows["alibi"]["seeds"] == [4, 5, 6]
    trained.clear()
    assert hf_relpos_cli.main(argv[:13] + ["3e-3"] + argv[13:] + ["--resume"]) == 0
    # 3e-3: alibi's 0.7 does not beat 2e-3's 0.8; nope's 0.95 beats 0.9, so nope's other seeds train at 3e-3
    assert sorted(trained) == [("alibi", 4, 3e-3), ("nope", 4, 3e-3), ("nope", 5, 3e-3), ("nope", 6, 3e-3)]
    rows = {r["scheme"]: r for r in json.loads((out / "lengthgen.json").read_text())["rows"]}
    assert rows["nope"]["learning_rate"] == 3e-3 and rows["alibi"]["learning_rate"] == 2e-3


def test_ctrl_c_keeps_the_finished_runs(tmp_path, capsys, monkeypatch):
    out = tmp_path / "lg"
    argv = ["lengthgen", "--tasks", "copy", "--schemes", "alibi", "nope", "--seeds", "1", "--output-dir", str(out), *TINY]
    real = command.run_one

    def stop_at_the_second(*run):
        if run[1] == "nope":
            raise KeyboardInterrupt
        return real(*run)

    monkeypatch.setattr(command, "run_one", stop_at_the_second)
    assert hf_relpos_cli.main(argv) == 130
    err = capsys.readouterr().err
    assert "1 of 2 runs recorded" in err and "Resume with: hf-relpos lengthgen" in err and "--resume" in err
    assert command.record_path(out, "copy", "alibi", 0, 1e-3).is_file()
    assert not command.record_path(out, "copy", "nope", 0, 1e-3).exists() and not (out / "lengthgen.md").exists()
    monkeypatch.setattr(command, "run_one", real)
    assert hf_relpos_cli.main(argv + ["--resume"]) == 0
    assert json.loads((out / "lengthgen.json").read_text())["meta"]["runs_trained"] == 1


@pytest.mark.parametrize("extra, message", [
    (["--tasks", "copy", "juggling"], "argument --tasks: invalid choice: 'juggling'"),
    (["--train-length", "0"], "argument --train-length: must be >= 1, got 0"),
    (["--train-length", "500"], "--train-length must be from 1 to 200"),
    (["--schemes", "nope", "sorcery"], "argument --schemes: invalid choice: 'sorcery'"),
    (["--seeds", "0"], "argument --seeds: must be >= 1"),
    (["--jobs", "0"], "argument --jobs: must be >= 1"),
    (["--resume"], "no lengthgen run to resume"),
    (["--items", "1"], "argument --items: must be >= 2, got 1"),
    (["--items", "1001"], "argument --items: must be <= 1000, got 1001"),
    (["--gate", "0"], "argument --gate: must be > 0.0, got 0"),
    (["--stop-at", "1.5"], "argument --stop-at: must be <= 1.0, got 1.5"),
    (["--lrs", "1e-3", "-1"], "argument --lrs: must be > 0.0, got -1"),
    (["--eval-every", "0"], "argument --eval-every: must be >= 1, got 0"),
    (["--stop-at", "0.9"], "--stop-at 0.9 is under --gate 0.95"),
])
def test_user_errors_are_one_line(extra, message, tmp_path, capsys):
    out = tmp_path / "never"
    try:
        code = hf_relpos_cli.main(["lengthgen", "--output-dir", str(out), *extra])
    except SystemExit as exit:  # argparse's errors
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("hf-relpos lengthgen: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not out.exists()


def test_a_folder_of_other_files_is_never_written(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    for flag in ([], ["--overwrite"], ["--resume"]):
        assert hf_relpos_cli.main(["lengthgen", "--output-dir", str(out), *TINY, *flag]) == 2
        err = capsys.readouterr().err
        assert "not an hf-relpos lengthgen run (notes.txt)" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine\n"


def test_the_parser_restates_the_tasks_and_takes_the_schemes_from_the_registry():
    from hf_relpos import POSITION_ENCODINGS

    assert hf_relpos_cli.LENGTHGEN_TASKS == lg.TASKS
    assert command._all_schemes() == list(POSITION_ENCODINGS)


def test_runs_in_worker_processes_match_runs_in_this_one(tmp_path):
    """--jobs 2 trains in two spawned processes of one thread each: the same records as in this process."""
    out = tmp_path / "lg"
    argv = ["lengthgen", "--tasks", "parity", "--schemes", "alibi", "rope", "--seeds", "1", "--output-dir", str(out),
            *TINY[:-3], "--jobs", "2", "--quiet"]
    assert hf_relpos_cli.main(argv) == 0
    settings = json.loads(command.record_path(out, "parity", "alibi", 0, 1e-3).read_text())["settings"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for scheme in ("alibi", "rope"):
            record = json.loads(command.record_path(out, "parity", scheme, 0, 1e-3).read_text())
            here = command.run_one("parity", scheme, 0, 1e-3, settings)
            assert record["right_by_length"] == here["right_by_length"] and record["curve"] == here["curve"]
            assert record["final_train_loss"] == pytest.approx(here["final_train_loss"], rel=1e-6)
    finally:
        torch.set_num_threads(threads)


def _killed_on_rope(spec):
    """A worker's run that the system kills (as the out-of-memory killer does) when it trains rope."""
    import os
    import signal

    run, _ = spec
    if run[1] == "rope":
        os.kill(os.getpid(), signal.SIGKILL)
    return run, {"scheme": run[1]}


def test_a_killed_worker_stops_the_command_instead_of_hanging(tmp_path, capsys, monkeypatch):
    """multiprocessing's Pool replaces a killed worker and waits forever for its run: the parent must notice and
    stop (one line, finished runs kept, the resume command), as for Ctrl-C."""
    import threading

    monkeypatch.setattr(command, "_run_spec", _killed_on_rope)  # the spawned workers import it from this module
    todo = [("parity", "alibi", 0), ("parity", "rope", 0)]
    outcome = []

    def consume():
        try:
            outcome.append(list(command._train_runs(todo, {}, 2)))
        except BaseException as error:  # noqa: BLE001 - the outcome is what the test checks
            outcome.append(error)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    thread.join(60)
    assert outcome and isinstance(outcome[0], command.WorkerDied), outcome

    def died(todo, settings, jobs):
        raise command.WorkerDied()
        yield

    monkeypatch.setattr(command, "_train_runs", died)
    argv = ["lengthgen", "--tasks", "copy", "--schemes", "alibi", "--seeds", "1", "--output-dir", str(tmp_path / "lg"),
            *TINY]
    assert hf_relpos_cli.main(argv) == 130
    err = capsys.readouterr().err
    assert "a worker process died" in err and "0 of 1 runs recorded" in err and "--resume" in err
    assert err.count("\n") == 1, err


def test_two_learning_rates_never_share_a_record(tmp_path):
    """The record's folder names the learning rate exactly (repr), and a record found at another run's path (moved
    by hand) is not taken for it."""
    paths = {command.record_path(tmp_path, "copy", "nope", 0, lr) for lr in (1e-3, 0.001, 0.0010000001, 1e-3 + 1e-19)}
    assert len(paths) == 2 and command.record_path(tmp_path, "copy", "nope", 0, 1e-3).parent.name == "lr-0.001"
    record = dict(_record("copy", "nope", 0, [1, 1, 1, 1], 1.0), settings=SETTINGS)
    here = command.record_path(tmp_path, "copy", "nope", 0, 1e-3)
    elsewhere = command.record_path(tmp_path, "copy", "nope", 1, 1e-3)
    for path in (here, elsewhere):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
    assert command._read_record(here, SETTINGS, resume=True) == record
    assert command._read_record(elsewhere, SETTINGS, resume=True) is None


def test_report_writes_the_table_of_the_runs_recorded_so_far_and_trains_nothing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "lg"
    argv = ["lengthgen", "--tasks", "copy", "--schemes", "alibi", "nope", "--seeds", "2", "--lrs", "1e-3", "2e-3",
            "--gate", "0.01", "--output-dir", str(out), *TINY]
    assert hf_relpos_cli.main(argv) == 0
    full = json.loads((out / "lengthgen.json").read_text())
    assert full["meta"]["runs_recorded"] == full["meta"]["runs_expected"] == 6
    assert "**Partial**" not in (out / "lengthgen.md").read_text()
    nope = next(r for r in full["rows"] if r["scheme"] == "nope")
    for path in (out / "records" / "copy" / "nope").rglob("seed-*.json"):
        path.unlink()  # nope not run yet
    alibi = next(r for r in full["rows"] if r["scheme"] == "alibi")
    command.record_path(out, "copy", "alibi", 1, alibi["learning_rate"]).unlink()  # alibi's second seed neither
    monkeypatch.setattr(command, "run_one", lambda *run: pytest.fail(f"--report trained {run}"))
    assert hf_relpos_cli.main(["lengthgen", "--tasks", "copy", "--schemes", "alibi", "nope", "--seeds", "2", "--lrs",
                               "1e-3", "2e-3", "--gate", "0.01", "--output-dir", str(out), *TINY, "--report"]) == 0
    data = json.loads((out / "lengthgen.json").read_text())
    table = (out / "lengthgen.md").read_text()
    assert (data["meta"]["runs_recorded"], data["meta"]["runs_expected"], data["meta"]["runs_trained"]) == (2, 6, 0)
    assert table.startswith("**Partial** (`--report`): 2 of the 6 runs are recorded so far")
    assert [r["scheme"] for r in data["rows"]] == ["alibi"] and data["rows"][0]["seeds"] == [0]
    assert _table_rows(table, "Headline: lengths 4-5, the first bucket past training")["nope"] == ["not run yet"]
    assert hf_relpos_cli.main(["lengthgen", "--tasks", "copy", "reverse", "--schemes", "alibi", "nope", "--seeds",
                               "2", "--lrs", "1e-3", "2e-3", "--gate", "0.01", "--output-dir", str(out), *TINY,
                               "--report"]) == 0
    assert "### reverse\n\nNo run recorded yet.\n" in (out / "lengthgen.md").read_text()
    assert nope["seeds"] == [0, 1]
    capsys.readouterr()
    for extra, expected in ((["--overwrite"], "--report reads the runs recorded so far, --overwrite trains"),
                            (["--tasks", "reverse"], "no run of this command is recorded")):
        assert hf_relpos_cli.main(argv + ["--report", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hf-relpos lengthgen: error: ") and err.count("\n") == 1 and expected in err, err
    empty = tmp_path / "empty"
    assert hf_relpos_cli.main(["lengthgen", "--output-dir", str(empty), *TINY, "--report"]) == 2
    assert "--report: no lengthgen run is recorded in" in capsys.readouterr().err
    assert hf_relpos_cli.main(argv + ["--report", "--items", "9"]) == 2
    err = capsys.readouterr().err
    assert "--report: " in err and "items 8, vocabulary" in err and "give the options it was run with" in err


def test_report_with_one_learning_rate_counts_every_recorded_seed(tmp_path, capsys):
    """With one learning rate a seed is reported whichever seeds are missing (the first seed may finish last under
    --jobs); a mean over fewer seeds than asked for says how many; a record whose settings are not a mapping is
    skipped."""
    out = tmp_path / "lg"
    argv = ["lengthgen", "--tasks", "copy", "--schemes", "nope", "--seeds", "2", "--gate", "0.01",
            "--output-dir", str(out), *TINY]
    assert hf_relpos_cli.main(argv) == 0
    command.record_path(out, "copy", "nope", 0, 1e-3).unlink()
    stray = command.record_path(out, "copy", "nope", 5, 1e-3)
    stray.write_text(json.dumps({"settings": [1, 2]}))
    assert hf_relpos_cli.main(argv + ["--report"]) == 0
    data = json.loads((out / "lengthgen.json").read_text())
    assert [r["seeds"] for r in data["rows"]] == [[1]] and data["meta"]["runs_recorded"] == 1
    learned = dict(data["rows"][0], learned=[1], best_accuracy_seeds=[1.0], out=0.5, out_std=0.0)
    assert command._cell(learned, "out", 2) == "50.0 (1 of 2)" and command._cell(learned, "out", 1) == "50.0"


def test_every_panel_of_the_plot_spans_the_tested_lengths(tmp_path, monkeypatch):
    """A task with no run yet used to get matplotlib's default axis (19.5-21.5 around the training-length line)."""
    shown = {}
    monkeypatch.setattr(command, "_finish", lambda fig, axes, title, path, plt: shown.update(
        {ax.get_title().split("\n")[0]: ax.get_xlim() for ax in axes.flat if ax.get_visible()}))
    row = {"task": "copy", "scheme": "alibi", "learned": [0], "by_length": {"1": 1.0, "7": 0.5}}
    meta = {"tasks": ["copy", "reverse"], "schemes": ["alibi"], "train_length": 10, "gate": 0.95}
    command.plot_lengthgen([row], meta, tmp_path / "plot.png")
    assert shown == {"copy": (0.5, 20.5), "reverse": (0.5, 20.5)}


def test_a_record_from_before_the_setup_options_reads_as_made_with_their_defaults(tmp_path):
    """Records written before --position-lr-scale, --position-init-scale, --layers, --attention-scale and
    --initialization existed were made with their defaults: a resume reuses them, and refuses them for a run that
    gives another value."""
    old = {k: v for k, v in SETTINGS.items() if k not in command.SETTING_DEFAULTS}
    record = dict(_record("copy", "nope", 0, [1, 1, 1, 1], 1.0), settings=old)
    path = command.record_path(tmp_path, "copy", "nope", 0, 1e-3)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record))
    assert command._read_record(path, SETTINGS, resume=True) == record
    command._check_folder(tmp_path, SETTINGS)
    for name, value in (("position_lr_scale", 0.03), ("attention_scale", 1.0), ("initialization", "t5"),
                        ("layers", 4)):
        with pytest.raises(UserError, match=rf"was run with {name} .*, this command gives {name} {value!r}"):
            command._read_record(path, dict(SETTINGS, **{name: value}), resume=True)
        with pytest.raises(UserError, match=rf"{name}"):
            command._check_folder(tmp_path, dict(SETTINGS, **{name: value}))


def test_the_setup_options_shape_the_model():
    plain = command.build_model("copy", "t5_bias", "micro", 3, items=8)
    t5 = command.build_model("copy", "t5_bias", "micro", 3, items=8, layers=4, attention_scale=1.0,
                             initialization="t5")
    assert plain.config.num_hidden_layers == 2 and t5.config.num_hidden_layers == 4
    assert plain.config.attention_scale is None and t5.config.attention_scale == 1.0
    assert plain.config.initialization == "default" and not plain.config.scale_decoder_outputs
    assert t5.config.initialization == "t5" and t5.config.scale_decoder_outputs  # T5 v1.0's tied output
    assert abs(t5.model.embed_tokens.weight.std().item() - 1.0) < 0.2


def test_failures_are_classified_from_the_first_wrong_token():
    """A model whose argmax is scripted: exact, an end-of-sequence too early, an item where the end is due, another
    item; and run_one's record counts them by length and keeps the best state's T5 table."""
    from types import SimpleNamespace

    instances = [lg.Instance(ids=(5, 6, lg.SEP_ID, 7, 8, lg.EOS_ID), answer_start=3, length=2) for _ in range(4)]
    gold = torch.tensor(instances[0].ids)
    scripted = torch.stack([gold.roll(-1)] * 4)  # position i predicts token i+1: every answer right
    scripted[1, 3] = lg.EOS_ID  # after the first answer item: the end, where 8 is due
    scripted[2, 4] = 7  # after the last item: 7 again, where the end is due
    scripted[3, 2] = 9  # the first answer item wrong
    vocab = max(lg.vocab_size(8), 10)

    class Scripted(torch.nn.Module):
        def forward(self, input_ids, use_cache=False):
            return SimpleNamespace(logits=torch.nn.functional.one_hot(scripted[:, : input_ids.shape[1]], vocab).float())

    assert command.failure_kinds(Scripted(), instances) == [None, "stops early", "does not stop", "wrong item"]
    assert command.exact_match(Scripted(), instances)[0] == [True, False, False, False]
    record = command.run_one("copy", "t5_bias", 0, 3e-3, SETTINGS)
    assert set(record["failures_by_length"]) == {str(n) for n in range(1, 7)}
    for n, kinds in record["failures_by_length"].items():
        right, total = record["right_by_length"][n]
        assert sum(kinds.values()) == total - right and set(kinds) == set(command.FAILURE_KINDS)
    table = record["position_parameters"]["model.position.relative_attention_bias.weight"]
    assert len(table) == 32 and len(table[0]) == 4  # the preset's buckets x heads


def test_a_setup_a_scheme_refuses_is_one_line_before_any_training(tmp_path, capsys, monkeypatch):
    """--attention-scale with Shaw (which keeps its paper's 1/sqrt(d)): one line naming the scheme and the field,
    nothing trained (it was a traceback after the other schemes' runs)."""
    monkeypatch.setattr(command, "run_one", lambda *a: pytest.fail("trained"))
    argv = ["lengthgen", "--tasks", "copy", "--schemes", "alibi", "shaw", "--attention-scale", "1.0", "--output-dir",
            str(tmp_path / "lg"), *TINY]
    assert hf_relpos_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--schemes shaw" in err[0] and "attention_scale" in err[0], err


def test_the_table_names_the_setup_and_the_layers_it_ran(tmp_path):
    out = tmp_path / "lg"
    argv = ["lengthgen", "--tasks", "copy", "--schemes", "alibi", "--seeds", "1", "--layers", "1",
            "--position-lr-scale", "0.5", "--output-dir", str(out), *TINY]
    assert hf_relpos_cli.main(argv) == 0
    data = json.loads((out / "lengthgen.json").read_text())
    assert data["meta"]["model"]["num_hidden_layers"] == 1 and data["meta"]["layers"] == 1
    table = (out / "lengthgen.md").read_text()
    assert "(1 layers," in table and "Setup: position_lr_scale 0.5." in table
    record = json.loads(command.record_path(out, "copy", "alibi", 0, 1e-3).read_text())
    assert record["settings"]["layers"] == 1 and record["settings"]["position_lr_scale"] == 0.5
