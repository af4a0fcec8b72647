"""``hf-relpos lengthgen`` and its tasks (hf_relpos/lengthgen.py): the generators against independent checks, the
length distributions, the buckets, exact match against ``generate``, and the command end to end (tiny runs)."""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter

import pytest
import torch

import hf_relpos_cli
import hf_relpos.commands.lengthgen as command
from hf_relpos import lengthgen as lg

TINY = ["--steps", "3", "--train-length", "3", "--batch-size", "4", "--jobs", "1", "--quiet"]


def items(instance):
    """The prompt's and the answer's tokens as text, without the task token, separator and end-of-sequence."""
    tokens = [lg.VOCAB[i] for i in instance.ids]
    return tokens[1 : instance.answer_start - 1], tokens[instance.answer_start : -1]


@pytest.mark.parametrize("task", lg.TASKS)
def test_each_task_answers_what_an_independent_computation_gives(task):
    rng = random.Random(1)
    for length in [1, 2, 3, 7, 20, 40] * 5:
        instance = lg.make_instance(task, rng, length)
        ids = instance.ids
        assert ids[0] == lg.TOKEN_ID[f"<{task}>"] and ids[instance.answer_start - 1] == lg.SEP_ID
        assert ids[-1] == lg.EOS_ID and lg.EOS_ID not in ids[:-1] and lg.SEP_ID not in ids[: instance.answer_start - 1]
        assert instance.length == length and len(ids) <= lg.max_tokens(task, length)
        prompt, answer = items(instance)
        if task in ("copy", "reverse", "sort"):
            assert len(prompt) == length and all(t in lg.LETTERS for t in prompt)
            expected = {"copy": prompt, "reverse": list(reversed(prompt)), "sort": sorted(prompt)}[task]
            assert answer == expected
            if task == "reverse":
                assert list(reversed(answer)) == prompt  # reverse of the reverse
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


def test_seeds_are_aggregated_as_mean_and_sample_std():
    def record(scheme, seed, rights):
        return {"task": "copy", "scheme": scheme, "seed": seed,
                "right_by_length": {str(n): [r, 2] for n, r in enumerate(rights, 1)},
                "token_accuracy_by_length": {str(n): r / 2 for n, r in enumerate(rights, 1)},
                "accuracy": lg.accuracy_by_bucket({n: (r, 2) for n, r in enumerate(rights, 1)}, 2)}

    records = [record("alibi", 0, [2, 1, 0, 0]), record("alibi", 1, [2, 2, 1, 0]), record("nope", 0, [1, 1, 1, 1]),
               record("nope", 1, [1, 1, 1, 1])]
    rows = command.aggregate(records, 2)
    alibi = rows[0]
    assert (alibi["scheme"], alibi["seeds"]) == ("alibi", [0, 1])
    assert alibi["in_seeds"] == [0.75, 1.0] and alibi["in"] == 0.875
    assert alibi["in_std"] == pytest.approx(statistics.stdev([0.75, 1.0]))
    assert alibi["out_seeds"] == [0.0, 0.25] and alibi["by_length"] == {"1": 1.0, "2": 0.75, "3": 0.25, "4": 0.0}
    assert [e["scheme"] for e in command.summary(rows)] == ["nope", "alibi"]  # sorted by OOD accuracy


def _train_briefly(scheme):
    # lr 3e-3 for 120 steps: the micro models get lengths 1-2 right and 4-6 wrong (rope 11 of 24, t5_bias 6). At
    # lr 1e-2 and 60 steps rope learned nothing on some machines (0 of 24: the mix this test needs was luck).
    torch.manual_seed(0)
    model = command.build_model("copy", scheme, "micro", 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = lg.train_instances("copy", 0, 3)
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
    test = lg.test_instances("copy", 6, 4)
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
            "--output-dir", str(out), *TINY]
    assert hf_relpos_cli.main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["lengthgen.json", "lengthgen.md", "lengthgen.png", "records"]
    assert (out / "lengthgen.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "lengthgen.json").read_text())
    table = (out / "lengthgen.md").read_text()
    assert data["meta"]["buckets"] == ["1-2", "3", "4-5", "6"] and data["meta"]["quick"] is False
    assert "Command: `hf-relpos lengthgen --tasks copy parity" in table and "machine:" in table
    for row in data["rows"]:
        records = [json.loads(command.record_path(out, row["task"], row["scheme"], s).read_text()) for s in (0, 1)]
        for key in ("1-2", "3", "4-5", "6", "in", "out"):
            per_seed = [lg.accuracy_by_bucket({int(n): c for n, c in r["right_by_length"].items()}, 3)[key]
                        for r in records]
            assert row[f"{key}_seeds"] == per_seed
            assert row[key] == pytest.approx(statistics.mean(per_seed))
        cells = _table_rows(table, row["task"])[row["scheme"]]
        assert cells == [f"{100 * row[k]:.1f} ± {100 * row[k + '_std']:.1f}" for k in ("1-2", "3", "4-5", "6")]
        # every test length was scored, past the training length too (learned's table covers 2L)
        assert sorted(int(n) for n in records[0]["right_by_length"]) == list(range(1, 7))
    summary = _table_rows(table, "All tasks (mean over 2), sorted by out-of-distribution accuracy")
    assert set(summary) == {"alibi", "learned"}

    # --resume with a scheme added: only its runs train, the others' records are read back as they were
    before = {p: p.read_bytes() for p in (out / "records").rglob("*.json")}
    trained = []
    real = command.run_one
    monkeypatch.setattr(command, "run_one", lambda *run: trained.append(run[:3]) or real(*run))
    assert hf_relpos_cli.main(argv[:6] + ["nope"] + argv[6:] + ["--resume"]) == 0
    assert trained == [("copy", "nope", 0), ("copy", "nope", 1), ("parity", "nope", 0), ("parity", "nope", 1)]
    assert all(p.read_bytes() == content for p, content in before.items())
    assert {r["scheme"] for r in json.loads((out / "lengthgen.json").read_text())["rows"]} == {"alibi", "learned", "nope"}

    # an unrecorded run (deleted record) is trained again; the same command once more trains nothing
    command.record_path(out, "parity", "alibi", 1).unlink()
    trained.clear()
    assert hf_relpos_cli.main(argv + ["--resume"]) == 0
    assert trained == [("parity", "alibi", 1)]
    capsys.readouterr()

    # without --resume or --overwrite the folder is refused; a resume with other settings too (one line each)
    for extra, expected in (([], "--resume"), (["--resume", "--steps", "4"], "steps 3")):
        assert hf_relpos_cli.main(argv + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("hf-relpos lengthgen: error: ") and err.count("\n") == 1 and expected in err, err


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
    assert command.record_path(out, "copy", "alibi", 0).is_file()
    assert not command.record_path(out, "copy", "nope", 0).exists() and not (out / "lengthgen.md").exists()
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
    settings = json.loads(command.record_path(out, "parity", "alibi", 0).read_text())["settings"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for scheme in ("alibi", "rope"):
            record = json.loads(command.record_path(out, "parity", scheme, 0).read_text())
            here = command.run_one("parity", scheme, 0, settings)
            assert record["right_by_length"] == here["right_by_length"]
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
