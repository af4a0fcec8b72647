"""Nothing is lost to a second process, a damaged checkpoint or a folder that cannot be written (issue 23,
items 4-7, 11-14; kills and full disks at every write: tests/test_faults.py)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

import hf_relpos_cli
import hf_relpos.commands.train  # noqa: F401
from hf_relpos.commands.common import RUN_FILE, checkpoint_problem, output_lock

TINY = ["--steps", "2", "--seq-len", "16", "--batch-size", "2", "--vocab-size", "300", "--eval-tokens", "64", "--quiet"]


def run(argv, capsys):
    code = hf_relpos_cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(code, err):
    assert code == 2 and err.count("\n") == 1, (code, err)
    return err


def _text(folder: Path) -> Path:
    path = folder / "mine.txt"
    path.write_text(" ".join(f"word{i % 97} text{i % 13}" for i in range(3000)))
    return path


def _hold(lock_target, ready, release):
    with output_lock(Path(lock_target), "train", ["train", "--output-dir", str(lock_target)]):
        ready.set()
        release.wait(60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks")
@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_second_run_into_the_same_folder_is_refused_naming_the_first(command, tmp_path, capsys):
    """Two runs into one --output-dir: the second gets one line naming the running process, writes nothing."""
    fork = multiprocessing.get_context("fork")
    out = tmp_path / "out"
    ready, release = fork.Event(), fork.Event()
    holder = fork.Process(target=_hold, args=(str(out), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        extra = ["--schemes", "alibi", "--seeds", "1"] if command == "compare" else []
        code, _, err = run([command, "--output-dir", str(out), *TINY, *extra], capsys)
        err = one_line(code, err)
        assert "in use by process" in err and str(holder.pid) in err and "hf-relpos train" in err, err
        assert not out.exists()
    finally:
        release.set()
        holder.join()


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_message(tmp_path, capsys):
    out = tmp_path / "model"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".model.lock").touch()
    (tmp_path / ".model.lock.json").write_text(json.dumps(
        {"pid": dead.pid, "host": "here", "command": "hf-relpos train", "started": "then"}))
    code, _, err = run(["train", "--output-dir", str(out), *TINY], capsys)
    assert code == 0, err
    assert f"took over the lock on {out} left by process {dead.pid}" in err, err
    assert not (tmp_path / ".model.lock.json").exists()  # the run's own record goes with it


def test_a_lock_path_that_is_not_a_file_is_one_line(tmp_path, capsys):
    """A folder where the lock file goes (a stranger's, or left by hand) is one line naming it, not filelock's
    IsADirectoryError traceback; nothing is trained or written."""
    out = tmp_path / "model"
    (tmp_path / ".model.lock").mkdir()
    code, _, err = run(["train", "--output-dir", str(out), *TINY], capsys)
    assert str(tmp_path / ".model.lock") in one_line(code, err), err
    assert not out.exists()


@pytest.fixture
def trained(tmp_path, capsys):
    """A finished Transformer-XL run of 4 steps (checkpoint-4 kept) on a small text, and its command."""
    argv = ["train", "--output-dir", str(tmp_path / "model"), "--position-encoding", "transformer_xl", *TINY,
            "--steps", "4", "--train-file", str(_text(tmp_path))]
    assert run(argv, capsys)[0] == 0
    return argv, tmp_path / "model-checkpoints"


def _truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "trainer_state.json": _truncate,
    "optimizer.pt": _truncate,
    "scheduler.pt": _truncate,
    "rng_state.pth": _truncate,
    "mems-rank0.safetensors": lambda path: path.unlink(),  # a kill before the memory was written (item 7)
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_resume_skips_an_incomplete_newer_checkpoint_and_keeps_it(name, trained, capsys):
    """A newer checkpoint cut short (here checkpoint-5, a copy of checkpoint-4 with one file damaged) is renamed
    aside with one line and the run resumes from the newest complete one (before: "no checkpoint to resume
    from", a traceback, or for the memory a silent resume without it)."""
    argv, checkpoints = trained
    shutil.copytree(checkpoints / "checkpoint-4", checkpoints / "checkpoint-5")
    DAMAGE[name](checkpoints / "checkpoint-5" / name)
    resumed = []
    original = transformers.Trainer._load_from_checkpoint

    def spy(self, path, *args, **kwargs):
        resumed.append(Path(path).name)
        return original(self, path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.Trainer, "_load_from_checkpoint", spy)
        code, _, err = run(argv + ["--steps", "6", "--resume"], capsys)
    assert code == 0, err
    assert resumed == ["checkpoint-4"]
    assert "checkpoint-5 is not a complete checkpoint" in err and name in err, err
    aside = [p for p in checkpoints.iterdir() if p.name.startswith("incomplete-checkpoint-5-")]
    assert len(aside) == 1 and (aside[0] / "model.safetensors").is_file()  # renamed, not deleted
    assert checkpoint_problem(checkpoints / "checkpoint-6") is None


@pytest.mark.parametrize("name", list(DAMAGE))
def test_resume_from_a_damaged_only_checkpoint_is_one_line(name, trained, capsys):
    argv, checkpoints = trained
    DAMAGE[name](checkpoints / "checkpoint-4" / name)
    code, _, err = run(argv + ["--resume"], capsys)
    err = one_line(code, err)
    assert "no checkpoint to resume from" in err and name in err and "--overwrite" in err, err
    assert (checkpoints / "checkpoint-4").is_dir()  # kept as it is
    code, _, err = run(argv + ["--resume", str(checkpoints / "checkpoint-4")], capsys)
    err = one_line(code, err)
    assert "is not a complete checkpoint" in err and name in err, err


def test_an_interrupted_swap_of_the_model_folder_is_finished_by_the_next_run(trained, capsys):
    """Killed between moving the old model aside and moving the new one in: the next run puts the old one back."""
    argv, _ = trained
    out = Path(argv[2])
    out.rename(out.with_name(".model.replaced"))
    (out.with_name(".model.saving")).mkdir()
    (out.with_name(".model.saving") / "config.json").write_text("")  # a new folder only begun
    code, _, err = run(argv + ["--resume"], capsys)
    assert code == 0, err
    assert f"restored {out}" in err and "renamed aside" in err, err
    assert json.loads((out / RUN_FILE).read_text())["steps"] == 4
    assert not out.with_name(".model.replaced").exists() and not out.with_name(".model.saving").exists()


@contextlib.contextmanager
def _read_only(folder: Path):
    """A folder no one can write into (chmod, or for root the immutable attribute)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
        pytest.skip("root, and no immutable attribute here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_folder_that_cannot_be_written_is_refused_before_any_training(command, tmp_path, capsys, monkeypatch):
    """Before: train --overwrite trained fully and failed at the final save."""
    parent = tmp_path / "locked"
    parent.mkdir()
    trained = []
    monkeypatch.setattr(transformers.Trainer, "train", lambda *a, **k: trained.append(1))
    extra = ["--schemes", "alibi", "--seeds", "1"] if command == "compare" else []
    with _read_only(parent):
        code, _, err = run([command, "--output-dir", str(parent / "out"), *TINY, *extra, "--overwrite"], capsys)
    err = one_line(code, err)
    assert "cannot be written" in err and str(parent / "out") in err, err
    assert trained == []


def test_compare_refuses_a_folder_of_other_files_and_a_resume_of_nothing(tmp_path, capsys):
    """As train does: --overwrite never writes into a folder holding other files (the repository root, say);
    --resume of a folder holding no comparison is refused instead of starting afresh."""
    base = ["compare", "--quick", "--schemes", "alibi", "--seeds", "1", *TINY]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, _, err = run(base + ["--output-dir", str(mine), "--overwrite"], capsys)
    assert "notes.txt" in one_line(code, err) and "not an hf-relpos comparison" in err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    code, _, err = run(base + ["--output-dir", str(tmp_path / "new"), "--resume"], capsys)
    assert "no comparison to resume" in one_line(code, err)
    assert not (tmp_path / "new").exists()


def test_train_resume_alone_continues_with_the_recorded_options(trained, capsys):
    """`hf-relpos train --output-dir X --resume` continues the run as it was started (its options are in the
    checkpoint); an option given explicitly must still agree."""
    argv, checkpoints = trained
    out = argv[2]
    code, _, err = run(["train", "--output-dir", out, "--resume"], capsys)
    assert code == 0, err
    record = json.loads((Path(out) / RUN_FILE).read_text())
    assert (record["seq_len"], record["steps"], record["position_encoding"]) == (16, 4, "transformer_xl")
    code, _, err = run(["train", "--output-dir", out, "--resume", "--seq-len", "32"], capsys)
    assert "--seq-len 16" in one_line(code, err) and "--seq-len 32" in err
    code, _, err = run(["train", "--output-dir", out, "--resume", "--steps", "6"], capsys)  # training on is allowed
    assert code == 0, err
    assert json.loads((Path(out) / RUN_FILE).read_text())["steps"] == 6


def test_train_resume_alone_takes_the_recorded_max_train_bytes(tmp_path, capsys, monkeypatch):
    """A run given --max-train-bytes (above the default) for its --train-file resumes with `--resume` alone: the
    limit is recorded with the file it admits, not refused at the default."""
    text = _text(tmp_path)
    monkeypatch.setattr(hf_relpos_cli, "MAX_TEXT_BYTES", text.stat().st_size // 2)  # the default, made small
    out = str(tmp_path / "model")
    limit = str(text.stat().st_size)
    assert run(["train", "--output-dir", out, *TINY, "--train-file", str(text), "--max-train-bytes", limit],
               capsys)[0] == 0
    code, _, err = run(["train", "--output-dir", out, "--resume", "--steps", "3"], capsys)
    assert code == 0, err
    assert json.loads((Path(out) / RUN_FILE).read_text())["steps"] == 3


def test_train_resume_giving_mem_len_again_reads_the_recorded_scheme(tmp_path, capsys):
    """`--resume --mem-len N` of a Transformer-XL run that did not repeat --position-encoding: --mem-len is checked
    against the recorded scheme (it was refused as if the scheme were the default t5_bias)."""
    out = str(tmp_path / "model")
    argv = ["train", "--output-dir", out, "--position-encoding", "transformer_xl", "--mem-len", "8", *TINY]
    assert run(argv, capsys)[0] == 0
    code, _, err = run(["train", "--output-dir", out, "--resume", "--mem-len", "8", "--steps", "3"], capsys)
    assert code == 0, err
    assert json.loads((Path(out) / RUN_FILE).read_text())["mem_len"] == 8
    code, _, err = run(["train", "--output-dir", str(tmp_path / "other"), "--mem-len", "8", *TINY], capsys)
    assert "--mem-len applies to --position-encoding transformer_xl only" in one_line(code, err)
    assert not (tmp_path / "other").exists()


def test_a_full_disk_at_the_first_checkpoint_hints_a_fresh_start_that_works(tmp_path, capsys, monkeypatch):
    """No complete checkpoint yet: the full-disk line gives the command that starts afresh (it said "resume with
    ... the last complete checkpoint is kept", and that resume found nothing); the command it gives completes."""
    import shlex

    import torch

    real_save, calls = torch.save, []

    def full(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", full)
    out = str(tmp_path / "model")
    code, _, err = run(["train", "--output-dir", out, *TINY], capsys)
    err = one_line(code, err)
    assert "no space left" in err and "resume with" not in err, err
    hint = err.split("train afresh with: ")[1].split(" (no checkpoint")[0]
    code, _, err = run(shlex.split(hint)[1:], capsys)
    assert code == 0, err
    assert (Path(out) / RUN_FILE).is_file()
