"""Runs that would end badly stop at once with one line: text too large for memory, a loss that diverges.

In-process (``hf_relpos_cli.main``) with tiny settings.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_relpos.commands.train
import hf_relpos_cli
from hf_relpos.data import MAX_TEXT_BYTES, read_text_files

TINY = ["--seq-len", "16", "--batch-size", "2", "--vocab-size", "300", "--eval-tokens", "64", "--quiet"]


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"hf-relpos {command}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def text_file(path: Path, size: int) -> Path:
    line = "The quick brown fox jumps over the lazy dog; then it runs away.\n"
    path.write_text((line * (size // len(line) + 1))[:size])
    return path


# ---------------------------------------------------------------------------
# item 3: text larger than memory is refused before it is read
# ---------------------------------------------------------------------------


def test_the_cli_states_the_library_default():
    assert hf_relpos_cli.MAX_TEXT_BYTES == MAX_TEXT_BYTES


def test_a_file_past_the_limit_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as file:  # 400 MB that take no disk and no memory: a sparse file
        file.truncate(400 * 10**6)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"--train-file '.*big.txt' is 400,000,000 bytes, more than --max-train-bytes "
                                         rf"{MAX_TEXT_BYTES:,} \(.*\): pass a larger --max-train-bytes"):
        read_text_files([big], max_bytes=MAX_TEXT_BYTES)
    assert time.perf_counter() - start < 1.0
    # the files count together
    small = text_file(tmp_path / "small.txt", 3000)
    with pytest.raises(ValueError, match=r"--eval-file 2 files are 6,000 bytes, more than --max-eval-bytes 5,000"):
        read_text_files([small, small], flag="--eval-file", max_bytes=5000, limit_flag="--max-eval-bytes")
    assert read_text_files([small, small], max_bytes=6000)["train"]


def test_train_refuses_text_past_max_train_bytes(tmp_path, capsys):
    text = text_file(tmp_path / "corpus.txt", 5000)
    out = tmp_path / "m"
    argv = ["train", "--output-dir", str(out), "--steps", "1", "--train-file", str(text), *TINY]
    assert hf_relpos_cli.main(argv + ["--max-train-bytes", "4000"]) == 2
    err = one_line_error(capsys, "train")
    assert "'" + str(text) + "' is 5,000 bytes, more than --max-train-bytes 4,000" in err, err
    assert not out.exists() and not Path(f"{out}-checkpoints").exists()
    big = tmp_path / "big.txt"
    with open(big, "wb") as file:
        file.truncate(400 * 10**6)
    assert hf_relpos_cli.main(["train", "--output-dir", str(out), "--train-file", str(big), *TINY]) == 2
    assert f"more than --max-train-bytes {MAX_TEXT_BYTES:,}" in one_line_error(capsys, "train")


def test_eval_refuses_text_past_max_eval_bytes(tmp_path, capsys):
    folder = tmp_path / "m"
    assert hf_relpos_cli.main(["train", "--output-dir", str(folder), "--steps", "1", *TINY]) == 0
    text = text_file(tmp_path / "held_out.txt", 5000)
    capsys.readouterr()
    assert hf_relpos_cli.main(["eval", str(folder), "--eval-file", str(text), "--max-eval-bytes", "4999"]) == 2
    assert "--eval-file '" + str(text) + "' is 5,000 bytes, more than --max-eval-bytes 4,999" in one_line_error(capsys, "eval")
    assert hf_relpos_cli.main(["eval", str(folder), "--eval-file", str(text), "--max-eval-bytes", "5000",
                               "--factors", "1"]) == 0  # fmt: skip


# ---------------------------------------------------------------------------
# item 9: a diverging run stops with one line and keeps its last good checkpoint
# ---------------------------------------------------------------------------


def test_a_huge_learning_rate_stops_with_one_line_and_saves_no_model(tmp_path, capsys):
    """Before: `--learning-rate 1e30` trained to the end, saved a model of NaN weights and exited 0."""
    out = tmp_path / "m"
    assert hf_relpos_cli.main(["train", "--output-dir", str(out), "--steps", "8", "--learning-rate", "1e30", *TINY]) == 2
    err = one_line_error(capsys, "train")
    assert "training diverged at step " in err and "lower --learning-rate (it was 1e+30" in err, err
    assert "--overwrite" in err, err  # --resume refuses another learning rate: the hint names what works
    assert not (out / "model.safetensors").exists()
    for checkpoint in Path(f"{out}-checkpoints").glob("checkpoint-*"):  # any checkpoint kept holds finite weights
        assert all(torch.isfinite(t).all() for t in load_file(checkpoint / "model.safetensors").values())


def test_a_loss_turning_nan_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    """Weights overflow at step 7 of 20 (checkpoints every 5 steps): checkpoint-5 stays, no later checkpoint or model
    is written, and the error names the step, the loss and checkpoint-5."""
    from transformers import TrainerCallback

    class Overflow(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 7:
                with torch.no_grad():
                    model.lm_head.weight.mul_(math.inf)  # logits of +-inf and nan: the next loss is nan
    monkeypatch.setattr(hf_relpos.commands.train, "_Progress", Overflow)  # added when not --quiet
    out = tmp_path / "m"
    argv = ["train", "--output-dir", str(out), "--steps", "20", *[a for a in TINY if a != "--quiet"]]
    assert hf_relpos_cli.main(argv) == 2
    err = one_line_error(capsys, "train")
    checkpoints = Path(f"{out}-checkpoints")
    assert f"training diverged at step 8 of 20: loss nan; the last good checkpoint is {checkpoints / 'checkpoint-5'}; " \
           "train again with --overwrite and a lower --learning-rate" in err, err
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-5"]
    weights = load_file(checkpoints / "checkpoint-5" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert not (out / "model.safetensors").exists()


def test_weights_are_checked_at_a_save_the_log_has_not_seen(tmp_path, capsys, monkeypatch):
    """Saves that fall between logged steps (here: logs every 3 steps, a checkpoint at step 17 of 70) are checked
    on the weights themselves: no checkpoint of NaN weights is written."""
    from transformers import TrainerCallback

    class Poison(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 17:
                with torch.no_grad():
                    model.lm_head.weight.fill_(math.nan)
    monkeypatch.setattr(hf_relpos.commands.train, "_Progress", Poison)
    out = tmp_path / "m"
    argv = ["train", "--output-dir", str(out), "--steps", "70", *[a for a in TINY if a != "--quiet"]]
    assert hf_relpos_cli.main(argv) == 2
    err = one_line_error(capsys, "train")
    assert "training diverged at step 17 of 70: the weights are no longer finite; no checkpoint was saved before" in err, err
    assert not any(Path(f"{out}-checkpoints").glob("checkpoint-*")) and not (out / "model.safetensors").exists()
