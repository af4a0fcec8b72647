"""Nothing is lost to a kill or a full disk: fault injection at every file write of `hf-relpos train`.

A forked child (torch already imported, so each run costs only its training) runs the command with the write
functions patched: it counts every write (an ``open`` for writing, ``torch.save``, safetensors' ``save_file``,
the tokenizer's file, ``os.rename``/``os.replace``, ``os.rmdir``, ``shutil.rmtree``) and, at the N-th, is killed
(``os._exit``, before the write or after a torn one) or gets "no space left on device". After each, the parent
checks what is on disk and continues as a user would (``--resume``, or ``--overwrite`` when no complete checkpoint
was made) to the uninterrupted run's loss and perplexity. The model folder is at every moment the old model or
the new one, and a checkpoint that was complete stays.
"""

from __future__ import annotations

import builtins
import errno
import gc
import io
import json
import multiprocessing
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import hf_relpos_cli
import hf_relpos.commands.train  # noqa: F401  (imported before forking)
from hf_relpos.commands.common import RUN_FILE, checkpoint_problem, last_checkpoint

FORK = multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None
# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = [
    pytest.mark.skipif(FORK is None, reason="fault injection forks (Linux)"),
    pytest.mark.xdist_group("test_faults"),
]
KILLED = 9
SETTINGS = ["--position-encoding", "transformer_xl", "--steps", "2", "--seq-len", "16", "--batch-size", "2",
            "--vocab-size", "300", "--eval-tokens", "64", "--quiet"]  # fmt: skip


def _text(folder: Path) -> Path:
    path = folder / "corpus.txt"
    path.write_text(" ".join(f"word{i % 97} text{i % 13} more{i % 7}." for i in range(1500)))
    return path


def _faulty(plan, events):
    """Patch the write functions: count each in ``events``; at ``plan = (mode, n)`` fail the n-th write."""
    import safetensors.torch
    import transformers.modeling_utils
    import transformers.tokenization_utils_tokenizers as tok

    import hf_relpos.memory

    def hit(kind, path, torn=None):
        events.append(f"{kind} {path}")
        if plan is None or len(events) != plan[1]:
            return None
        mode = plan[0]
        if mode == "kill":
            os._exit(KILLED)
        if mode == "full":
            if kind == "torch.save":  # as torch reports it: a RuntimeError wrapping the short write
                raise RuntimeError("[enforce fail at inline_container.cc:783] . unexpected pos 3200 vs 3108")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return "torn"

    def tear(path):  # the write happened and was cut short by the kill: half the file is on disk
        size = os.path.getsize(path)
        with real_open(path, "r+b") as f:
            f.truncate(size // 2)
        os._exit(KILLED)

    real_open, real_save, real_safe = builtins.open, torch.save, safetensors.torch.save_file
    real_rename, real_replace, real_rmdir, real_rmtree = os.rename, os.replace, os.rmdir, shutil.rmtree
    real_tok = tok.TokenizersBackend._save_pretrained

    class Torn:
        def __init__(self, f, path):
            self._f, self._path = f, path

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

        def close(self):
            self._f.close()
            tear(self._path)

    def open_(file, mode="r", *args, **kwargs):
        # (an opener: tempfile's nameless file, O_TMPFILE, which leaves nothing in the folder)
        if isinstance(file, int) or "opener" in kwargs or not any(c in mode for c in "wax+"):
            return real_open(file, mode, *args, **kwargs)
        torn = hit("open", file)
        f = real_open(file, mode, *args, **kwargs)
        return Torn(f, file) if torn else f

    def wrap(kind, real, path_of):
        def write(*args, **kwargs):
            path = path_of(*args, **kwargs)
            torn = hit(kind, path)
            result = real(*args, **kwargs)
            if torn and os.path.isfile(path):
                tear(path)
            elif torn:
                os._exit(KILLED)
            return result

        return write

    builtins.open = io.open = open_
    torch.save = wrap("torch.save", real_save, lambda obj, f, *a, **k: f)
    safe = wrap("save_file", real_safe, lambda tensors, filename, *a, **k: filename)
    transformers.modeling_utils.safe_save_file = hf_relpos.memory.save_file = safetensors.torch.save_file = safe
    folder = lambda *a, **k: str(k["save_directory"] if "save_directory" in k else a[0])  # noqa: E731
    tok.TokenizersBackend._save_pretrained = wrap(
        "tokenizer", real_tok, lambda self, *a, **k: os.path.join(folder(*a, **k), "tokenizer.json"))
    os.rename = wrap("rename", real_rename, lambda src, dst, *a, **k: dst)
    os.replace = wrap("replace", real_replace, lambda src, dst, *a, **k: dst)
    os.rmdir = wrap("rmdir", real_rmdir, lambda path, *a, **k: path)
    shutil.rmtree = wrap("rmtree", real_rmtree, lambda path, *a, **k: path)


def _child(argv, plan, conn):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    gc.freeze()  # the parent's objects: accelerate's gc.collect() at each run would walk them all (half its time)
    sys.stdout = sys.stderr = err = io.StringIO()
    events = []
    _faulty(plan, events)
    try:
        code = hf_relpos_cli.main(argv)
    except BaseException:  # an unexpected error: its traceback is what the test shows
        import traceback

        code = 1
        err.write(traceback.format_exc())
    conn.send((code, err.getvalue(), events))
    os._exit(0)


def _run(argv, plan=None):
    """Run the command in a forked child; (exit status, stderr, writes) or (KILLED, "", None)."""
    receive, send = FORK.Pipe(duplex=False)
    child = FORK.Process(target=_child, args=(argv, plan, send))
    child.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        result = None
    child.join()
    return result if result is not None else (child.exitcode, "", None)


def _model_state(out: Path):
    """What the model folder is: None (absent) or its run record, after checking the folder is whole."""
    if not out.exists():
        return None
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", RUN_FILE, "README.md"} <= files, files
    json.loads((out / "config.json").read_text())
    return json.loads((out / RUN_FILE).read_text())


def _finish(argv, out: Path):
    """Continue as a user would after the fault: --resume, or --overwrite when there is nothing to resume."""
    code, err, _ = _run(argv + ["--resume"])
    if code == 2 and "no checkpoint to resume from" in err.splitlines()[-1]:
        code, err, _ = _run(argv + ["--overwrite"])
    assert code == 0, err
    return json.loads((out / RUN_FILE).read_text())


def _completed_steps(events, upto):
    """The checkpoint steps renamed into place among the first ``upto`` writes (complete from then on)."""
    return [int(e.rsplit("-", 1)[1]) for e in events[:upto]
            if e.startswith("rename ") and "/checkpoint-" in e and "-checkpoints/checkpoint-" in e
            and ".saving" not in e.split()[-1]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (every write counted), and an older model (another seed) to --overwrite."""
    folder = tmp_path_factory.mktemp("reference")
    argv = ["train", "--train-file", str(_text(folder)), *SETTINGS]
    code, err, events = _run(argv + ["--output-dir", str(folder / "straight")])
    assert code == 0, err
    record = json.loads((folder / "straight" / RUN_FILE).read_text())
    code, err, _ = _run(argv + ["--output-dir", str(folder / "older"), "--seed", "1"])
    assert code == 0, err
    return argv, events, record, folder / "older"


def _check_fault(reference, tmp_path, n, mode):
    argv, events, record, older = reference
    out = tmp_path / f"{mode}-{n}"
    shutil.copytree(older, out)  # a finished model of seed 1, replaced by --overwrite
    old = json.loads((out / RUN_FILE).read_text())
    code, err, _ = _run(argv + ["--output-dir", str(out), "--overwrite"], plan=(mode, n))
    if mode == "full":
        assert code == 2 and err.count("\n") == 1 and "no space left" in err, (n, events[n - 1], err)
    else:
        assert code == KILLED, (n, events[n - 1], code, err)
    # the model folder is the old model or the whole new one, never a mix
    state = _model_state(out) or _model_state(out.with_name(f".{out.name}.replaced"))
    assert state in (old, record) or state["final_train_loss"] == record["final_train_loss"], (n, events[n - 1])
    # every checkpoint renamed into place before the fault is still there and complete (or a newer one is)
    completed = _completed_steps(events, n - 1)
    if completed:
        newest = last_checkpoint(tmp_path / f"{mode}-{n}-checkpoints")
        assert newest is not None and int(newest.name.split("-")[1]) >= max(completed), (n, events[n - 1])
        assert checkpoint_problem(newest) is None
    resumed = _finish(argv + ["--output-dir", str(out)], out)
    assert resumed["final_train_loss"] == pytest.approx(record["final_train_loss"], abs=1e-4), (n, events[n - 1])
    assert resumed["test_ppl"] == pytest.approx(record["test_ppl"], rel=1e-4), (n, events[n - 1])
    assert resumed["test_ppl_with_memory"] == pytest.approx(record["test_ppl_with_memory"], rel=1e-4)


def test_the_reference_run_writes_checkpoints_and_the_model_in_staging_folders(reference):
    """What the fault tests walk through: two checkpoints and the final model, each written aside, renamed."""
    _, events, _, _ = reference
    assert len(events) > 30, events
    assert _completed_steps(events, len(events)) == [1, 2], events
    assert any(e.startswith("rename ") and e.endswith("/straight") for e in events), events
    assert any("mems-rank0.safetensors" in e for e in events)


def _writes(events, data_only=False) -> list:
    """The index (from 1) of every write, except within the model's code files (``*.py``), which one call of
    save_pretrained copies one after another, some twice: there the first and the last copy (the same state
    between them: a staging folder part written), which keeps the test within a minute or two."""
    kept = []
    for n, event in enumerate(events, 1):
        if data_only and event.split()[0] in ("rename", "replace", "rmdir", "rmtree"):
            continue  # a full disk fails writes of data (deleting never needs space; Trainer ignores its errors)
        code = event.endswith(".py")
        if code and n + 1 <= len(events) and events[n].endswith(".py") and n - 1 >= 1 and events[n - 2].endswith(".py"):
            continue
        kept.append(n)
    return kept


def test_a_kill_at_every_write_loses_nothing(reference, tmp_path):
    """Killed at each write (before it, or after it was torn in half): resume reaches the same result."""
    for k, n in enumerate(_writes(reference[1])):
        _check_fault(reference, tmp_path, n, "torn" if k % 2 else "kill")


def test_a_full_disk_at_every_write_is_one_line_and_loses_nothing(reference, tmp_path):
    """No space left at each write: one line naming the folder; the last complete checkpoint resumes."""
    for n in _writes(reference[1], data_only=True):
        _check_fault(reference, tmp_path, n, "full")
