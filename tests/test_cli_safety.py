"""The command line never loses work: one-line errors, overwrite guards, Ctrl-C that saves, quiet output, fast help.

In-process (``hf_relpos_cli.main``) with tiny settings, except where the console script itself matters.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

import hf_relpos
import hf_relpos_cli
import hf_relpos.commands.compare
import hf_relpos.commands.train
from hf_relpos.commands.common import RUN_FILE, TIME_FILE, library_output_off
from hf_relpos.commands.errors import UserError
from hf_relpos.commands.plotting import plot
from hf_relpos.commands.train import PRESETS
from hf_relpos.data import SPECIAL_TOKENS

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_cli_safety")

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--steps", "2", "--seq-len", "16", "--batch-size", "2", "--vocab-size", "300", "--eval-tokens", "64"]


def run(argv, capsys):
    code = hf_relpos_cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(code, err, command):
    assert code == 2, err
    assert err.startswith(f"hf-relpos {command}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny t5_bias folder and a tiny learned-positions folder (table of 16 positions)."""
    base = tmp_path_factory.mktemp("trained")
    for scheme in ("t5_bias", "learned"):
        assert hf_relpos_cli.main(["train", "--position-encoding", scheme, "--output-dir", str(base / scheme),
                                   *TINY, "--quiet"]) == 0  # fmt: skip
    return base


# ---------------------------------------------------------------------------
# 1. every user error: one line, exit 2, nothing left behind
# ---------------------------------------------------------------------------


def _text(path: Path, chars: int) -> Path:
    path.write_text(("Some plain text about functions and classes. " * (chars // 40 + 1))[:chars])
    return path


BAD_TRAIN = {
    "missing --train-file": (lambda d: ["--train-file", str(d / "nope.txt")], "does not exist"),
    "empty --train-file": (lambda d: ["--train-file", str(_text(d / "empty.txt", 0))], "at least 1000"),
    "binary --train-file": (lambda d: ["--train-file", str(d / "bin.dat")], "not a UTF-8 text file"),
    "--train-file without a path": (lambda d: ["--train-file"], "expected at least one argument"),
    "negative --mem-len": (lambda d: ["--mem-len", "-1"], "argument --mem-len: must be >= 0"),
    "--mem-len without memory": (lambda d: ["--mem-len", "4"], "transformer_xl only"),
    "--vocab-size too small": (lambda d: ["--vocab-size", "100"], "argument --vocab-size: must be >= 259"),
    "--seq-len longer than the data": (
        lambda d: ["--train-file", str(_text(d / "small.txt", 1500)), "--seq-len", "4096"], "longer than the data"),
    "--resume without a checkpoint": (lambda d: ["--resume"], "no checkpoint to resume from"),
    "--output-dir that is a file": (lambda d: ["--output-dir", str(_text(d / "afile", 10))], "is a file"),
}


@pytest.mark.parametrize("case", list(BAD_TRAIN))
def test_train_user_errors(case, tmp_path, capsys):
    (tmp_path / "bin.dat").write_bytes(bytes(range(256)) * 8)
    extra, expected = BAD_TRAIN[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = ["train", "--output-dir", str(tmp_path / "model"), *TINY, *extra(tmp_path)]
    with pytest.raises(SystemExit) if "argument" in expected else _no_raise() as info:
        code = hf_relpos_cli.main(argv)
    code = info.value.code if info else code
    err = one_line_error(code, capsys.readouterr().err, "train")
    assert expected in err
    after = sorted(p.name for p in tmp_path.iterdir())
    assert set(after) - set(before) <= {"empty.txt", "small.txt", "afile"}, "a failed command left a folder behind"


class _no_raise:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_train_file(tmp_path, capsys):
    locked = _text(tmp_path / "locked.txt", 2000)
    locked.chmod(0)
    code, _, err = run(["train", "--output-dir", str(tmp_path / "m"), *TINY, "--train-file", str(locked)], capsys)
    assert "cannot be read" in one_line_error(code, err, "train")


def test_generate_and_eval_user_errors(trained, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    checkpoint = next((trained / "t5_bias-checkpoints").glob("checkpoint-*"))
    cases = [
        (["generate", str(tmp_path / "missing")], "does not exist"),
        (["eval", str(tmp_path / "missing")], "does not exist"),
        (["generate", str(other)], "model_type 'gpt2'"),
        (["eval", str(other)], "model_type 'gpt2'"),
        (["generate", str(checkpoint)], "has no tokenizer"),
        (["generate", str(trained / "t5_bias"), "--prompt", ""], "--prompt is empty"),
        (["generate", str(trained / "t5_bias"), "--prompt", "   "], "--prompt is empty"),
        (["eval", str(trained / "learned"), "--seq-len", "64"], "longer than the learned position table"),
    ]
    for argv, expected in cases:
        code, _, err = run(argv, capsys)
        assert expected in one_line_error(code, err, argv[0]), argv
    with pytest.raises(SystemExit) as info:
        hf_relpos_cli.main(["generate", str(trained / "t5_bias"), "--temperature", "-1"])
    assert "argument --temperature: must be >= 0" in one_line_error(info.value.code, capsys.readouterr().err, "generate")


def test_generate_past_a_learned_table_stops_with_a_notice(trained, capsys):
    """The table holds 16 positions: asking for 40 new tokens keeps what fits, and says so in one line."""
    code, out, err = run(["generate", str(trained / "learned"), "--prompt", "The", "--max-new-tokens", "40",
                          "--temperature", "0", "--quiet"], capsys)  # fmt: skip
    assert code == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(trained / "learned")
    assert len(tokenizer(out.rstrip("\n"), add_special_tokens=False)["input_ids"]) <= 16
    assert out.startswith("The")
    assert err.startswith("hf-relpos generate: stopped after ") and "position table holds 16" in err
    assert err.count("\n") == 1


def test_debug_shows_the_traceback_and_unexpected_errors_are_not_hidden(tmp_path, monkeypatch):
    with pytest.raises(UserError):
        hf_relpos_cli.main(["generate", str(tmp_path / "missing"), "--debug"])
    monkeypatch.setenv("HF_RELPOS_DEBUG", "1")
    with pytest.raises(UserError):
        hf_relpos_cli.main(["generate", str(tmp_path / "missing")])
    monkeypatch.delenv("HF_RELPOS_DEBUG")

    def broken(args):
        raise RuntimeError("a bug, not a user error")

    monkeypatch.setattr(hf_relpos.commands.train, "eval_command", broken)  # main looks it up by name
    with pytest.raises(RuntimeError):  # the console script prints its traceback and exits 1
        hf_relpos_cli.main(["eval", str(tmp_path)])


# ---------------------------------------------------------------------------
# 1b. foreign and damaged folders: no code from the folder runs, every damage is one line
# ---------------------------------------------------------------------------


def _planted(folder: Path, marker: Path) -> Path:
    """``folder`` with Python in it that writes ``marker`` when imported: each of its .py files (the saved model
    code), and a tokenizer module ``planted_tokenizer.py``."""
    line = f"import pathlib; pathlib.Path({str(marker)!r}).write_text(__name__)\n"
    for code in folder.glob("*.py"):
        code.write_text(line + code.read_text())
    (folder / "planted_tokenizer.py").write_text(
        line + "from transformers import PreTrainedTokenizerFast\n\n\nclass PlantedTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return folder


def _edit_json(file: Path, **fields) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **fields}))


FOLDER_COMMANDS = (["generate", "--max-new-tokens", "2", "--quiet"], ["eval", "--eval-tokens", "64"], ["inspect"])


def test_commands_run_no_code_from_the_model_folder(trained, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    plain = _planted(Path(shutil.copytree(trained / "t5_bias", tmp_path / "plain")), marker)
    for command, *options in FOLDER_COMMANDS:  # the folder's copies of the model code are never imported
        extra = ["--output-dir", str(tmp_path / "figures")] if command == "inspect" else []
        code, _, err = run([command, str(plain), *options, *extra], capsys)
        assert code == 0 and not marker.exists(), (command, err, marker.exists() and marker.read_text())

    asks_tokenizer = shutil.copytree(plain, tmp_path / "tokenizer-auto-map")
    _edit_json(asks_tokenizer / "tokenizer_config.json", tokenizer_class="PlantedTokenizer",
               auto_map={"AutoTokenizer": [None, "planted_tokenizer.PlantedTokenizer"]})
    asks_config = shutil.copytree(plain, tmp_path / "config-auto-map")
    config = json.loads((asks_config / "config.json").read_text())
    _edit_json(asks_config / "config.json", auto_map={**config["auto_map"],
                                                      "AutoTokenizer": [None, "planted_tokenizer.PlantedTokenizer"]})
    for folder, file in ((asks_tokenizer, "tokenizer_config.json"), (asks_config, "config.json")):
        for command, *options in FOLDER_COMMANDS:
            code, _, err = run([command, str(folder), *options], capsys)
            err = one_line_error(code, err, command)
            assert f"{folder / file} asks for custom tokenizer code" in err and "planted_tokenizer" in err, err
            assert not marker.exists(), (command, marker.read_text())


def _truncated(name: str, keep: int):
    return lambda d: (d / name).write_bytes((d / name).read_bytes()[:keep])


DAMAGED = {  # damage: (how, what the line must name); commands: all three unless listed
    "truncated weights": (_truncated("model.safetensors", 5000), ["model.safetensors is damaged or truncated"]),
    "weights cut short at the end": (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:-64]), ["model.safetensors is damaged or truncated"]),
    "empty weights": (_truncated("model.safetensors", 0), ["model.safetensors is empty (0 bytes)"]),
    "missing weights": (lambda d: (d / "model.safetensors").unlink(), ["has no model.safetensors"]),
    "weights of another shape": (lambda d: _edit_json(d / "config.json", vocab_size=500),
                                 ["model.safetensors does not match", "embed_tokens.weight [300, 128]"]),
    "config field of a wrong type": (lambda d: _edit_json(d / "config.json", hidden_size="128"),
                                     ["config.json: ", "hidden_size", "'128'"]),
    "unknown position_encoding": (lambda d: _edit_json(d / "config.json", position_encoding="bogus"),
                                  ["config.json: ", "position_encoding", "'bogus'"]),
    "config not an object": (lambda d: (d / "config.json").write_text("[1, 2]"), ["config.json holds a JSON list"]),
    "unknown dtype": (lambda d: _edit_json(d / "config.json", dtype="float7"), ["config.json: ", "float7"]),
    "transformers_weights not a name": (lambda d: _edit_json(d / "config.json", transformers_weights=5),
                                        ["transformers_weights", "got 5"]),
    "weights index without weight_map": (lambda d: ((d / "model.safetensors").unlink(),
                                                    (d / "model.safetensors.index.json").write_text("{}")),
                                         ["model.safetensors.index.json", "weight_map"]),
    "weights index of a list": (lambda d: ((d / "model.safetensors").unlink(),
                                           (d / "model.safetensors.index.json").write_text("[1]")),
                                ["model.safetensors.index.json", "weight_map"]),
    "missing tokenizer.json": (lambda d: (d / "tokenizer.json").unlink(), ["has no tokenizer (tokenizer.json)"]),
    "damaged tokenizer.json": (_truncated("tokenizer.json", 100), ["tokenizer.json cannot be loaded"]),
    "damaged tokenizer_config.json": (_truncated("tokenizer_config.json", 10),
                                      ["tokenizer_config.json cannot be read as JSON"]),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_folder_is_one_line_naming_the_file(case, trained, tmp_path, capsys):
    damage, expected = DAMAGED[case]
    folder = Path(shutil.copytree(trained / "t5_bias", tmp_path / "model"))
    damage(folder)
    for command, *options in FOLDER_COMMANDS:
        code, out, err = run([command, str(folder), *options], capsys)
        err = one_line_error(code, err, command)
        assert all(text in err for text in expected), (command, err)
        assert out == ""
    assert not (folder / "inspect").exists()


def test_a_damaged_training_record_is_one_line(trained, tmp_path, capsys):
    folder = Path(shutil.copytree(trained / "t5_bias", tmp_path / "model"))
    for record in ('{"seq_len": "16"}', "[16]", "{"):
        (folder / RUN_FILE).write_text(record)
        for command, flag in (("eval", "--seq-len"), ("inspect", "--distance")):
            code, _, err = run([command, str(folder), "--output-dir", str(tmp_path / "f")][: 2 if command == "eval"
                                                                                               else 4], capsys)
            err = one_line_error(code, err, command)
            assert f"{flag} is needed" in err and RUN_FILE in err, err
    code, _, err = run(["eval", str(folder), "--seq-len", "16", "--factors", "1", "--eval-tokens", "64"], capsys)
    assert code == 0, err


def _t5(folder: Path, **fields) -> Path:
    from transformers import T5Config, T5ForConditionalGeneration

    import torch

    torch.manual_seed(0)
    defaults = dict(vocab_size=99, d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8,
                    relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                    dropout_rate=0.0)  # fmt: skip
    config = T5Config(**{**defaults, **fields})
    with library_output_off():  # no "Writing model shards" bar in the captured output
        T5ForConditionalGeneration(config).save_pretrained(folder)
    return folder


CONVERT_DAMAGED = {
    "truncated weights": (_truncated("model.safetensors", 3000), ["model.safetensors is damaged or truncated"]),
    "empty weights": (_truncated("model.safetensors", 0), ["model.safetensors is empty (0 bytes)"]),
    "config field of a wrong type": (lambda d: _edit_json(d / "config.json", d_model="16"),
                                     ["config.json cannot be read", "d_model"]),
    "weights of another shape": (lambda d: _edit_json(d / "config.json", d_ff=64),
                                 ["do not match its config.json", "DenseReluDense.wi.weight [32, 16]"]),
    "another model_type": (lambda d: _edit_json(d / "config.json", model_type="bart"), ["holds a 'bart' model"]),
}


def test_convert_t5_of_damaged_or_foreign_folders_is_one_line(trained, tmp_path, capsys):
    source = _t5(tmp_path / "t5")
    for case, (damage, expected) in CONVERT_DAMAGED.items():
        folder = Path(shutil.copytree(source, tmp_path / case.replace(" ", "-")))
        damage(folder)
        code, _, err = run(["convert-t5", str(folder), str(tmp_path / "out")], capsys)
        err = one_line_error(code, err, "convert-t5")
        assert all(text in err for text in expected), (case, err)
    # an hf-relpos folder is not a T5 (today: a StrictDataclassFieldValidationError traceback)
    code, _, err = run(["convert-t5", str(trained / "t5_bias"), str(tmp_path / "out")], capsys)
    assert "holds a 'relpos' model" in one_line_error(code, err, "convert-t5")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field,value,expected", [
    ("vocab_size", 10**9, "shared.weight [99, 16] in the file, [1000000000, 16] for config.json"),
    ("d_ff", 10**9, "DenseReluDense.wi.weight [32, 16] in the file, [1000000000, 16] for config.json"),
    ("num_layers", 10**6, "num_layers=1000000 in config.json, 2 encoder blocks in the weights"),
    ("num_decoder_layers", 10**6, "num_decoder_layers=1000000 in config.json, 2 decoder blocks in the weights"),
])
def test_convert_t5_of_a_config_asking_for_more_than_its_weights_is_refused_before_loading(
        field, value, expected, tmp_path, monkeypatch, capsys):
    """A stranger's T5 config.json sized past its weights is one line before T5 is loaded (Transformers allocated
    the config's sizes first: 128 GB for vocab_size 1e9 at d_model 32, minutes to build num_layers 1e6)."""
    import transformers

    folder = _t5(tmp_path / "t5")
    _edit_json(folder / "config.json", **{field: value})

    def loaded(*args, **kwargs):
        raise AssertionError("T5ForConditionalGeneration.from_pretrained was called")

    monkeypatch.setattr(transformers.T5ForConditionalGeneration, "from_pretrained", loaded)
    code, _, err = run(["convert-t5", str(folder), str(tmp_path / "out")], capsys)
    assert expected in one_line_error(code, err, "convert-t5"), err
    assert not (tmp_path / "out").exists()


def test_convert_t5_of_a_decoder_deeper_than_its_encoder_is_one_line_or_converts(tmp_path, capsys):
    """Upstream T5's own generate fails on such a model (an IndexError in its cache, Transformers 5.21-5.24): the
    conversion cannot be checked, and says so in one line; a Transformers that fixes it converts it."""
    source = _t5(tmp_path / "deep", num_layers=1, num_decoder_layers=2)
    code, out, err = run(["convert-t5", str(source), str(tmp_path / "out")], capsys)
    if code == 0:
        assert "greedy identical" in out and (tmp_path / "out" / "model.safetensors").is_file()
    else:
        assert "num_decoder_layers 2 > num_layers 1" in one_line_error(code, err, "convert-t5")
        assert not (tmp_path / "out").exists()


def _unwritable_outputs(tmp_path: Path) -> list:
    """Output folders this process cannot write: one below a file (for every user), one in a read-only folder."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    outputs = [(a_file / "out", "is a file, not a folder")]
    if os.geteuid() != 0:  # root writes whatever the mode says
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        outputs.append((locked / "out", "cannot be written"))
    return outputs


def test_inspect_and_convert_t5_refuse_an_unwritable_output_before_any_work(trained, tmp_path, monkeypatch, capsys):
    import hf_relpos.commands.inspect

    def no_work(*args, **kwargs):
        raise AssertionError("the model was loaded before the output folder was checked")

    source = _t5(tmp_path / "t5")
    monkeypatch.setattr(hf_relpos.commands.inspect, "load_folder", no_work)
    monkeypatch.setattr(transformers.T5ForConditionalGeneration, "from_pretrained", no_work)
    for out, expected in _unwritable_outputs(tmp_path):
        code, _, err = run(["inspect", str(trained / "t5_bias"), "--output-dir", str(out)], capsys)
        err = one_line_error(code, err, "inspect")
        assert err.startswith(f"hf-relpos inspect: error: --output-dir {str(out)!r}") and expected in err, err
        code, _, err = run(["convert-t5", str(source), str(out)], capsys)
        err = one_line_error(code, err, "convert-t5")
        assert err.startswith(f"hf-relpos convert-t5: error: OUT_FOLDER {str(out)!r}") and expected in err, err


def test_check_writable_leaves_nothing_behind(tmp_path):
    from hf_relpos.commands.common import check_writable

    check_writable(tmp_path, flag="--output-dir")
    check_writable(tmp_path / "new" / "deeper", flag="--output-dir")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train", "--learning-rate", "nan"], "argument --learning-rate: must be a finite number, got nan"),
        (["train", "--learning-rate", "inf"], "argument --learning-rate: must be a finite number, got inf"),
        (["compare", "--learning-rate", "NaN"], "argument --learning-rate: must be a finite number, got NaN"),
        (["train", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["train", "--seed", str(2**32)], f"argument --seed: must be <= {2**32 - 1}"),
        (["generate", "folder", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["generate", "folder", "--temperature", "inf"], "argument --temperature: must be a finite number"),
        (["train", "--seq-len", "1"], "argument --seq-len: must be >= 2, got 1"),
        (["compare", "--seq-len", "1"], "argument --seq-len: must be >= 2, got 1"),
        (["eval", "folder", "--seq-len", "1"], "argument --seq-len: must be >= 2, got 1"),
        (["compare", "--seed", str(2**32 - 2), "--seeds", "3"], f"runs seeds up to {2**32}, past {2**32 - 1}"),
    ],
)
def test_numbers_outside_what_a_run_can_use_are_refused_by_the_parser(argv, expected, tmp_path, capsys):
    if argv[0] in ("train", "compare"):  # tiny settings first (the case's flag, later, wins): were it accepted,
        quick = ["--quick", "--schemes", "alibi", "--seeds", "1"] if argv[0] == "compare" else []  # a short run
        argv = [argv[0], *TINY, *quick, *argv[1:], "--output-dir", str(tmp_path / "never")]
    try:
        code = hf_relpos_cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = one_line_error(code, capsys.readouterr().err, argv[0])
    assert expected in err, err
    assert not (tmp_path / "never").exists()


def test_eval_refuses_a_length_longer_than_the_tokens_evaluated(trained, tmp_path, capsys):
    """--factors 200 at L = 16 is 3,200 tokens: from 2,000 tokens it would print ppl@3200 of one short segment."""
    folder = str(trained / "t5_bias")
    code, out, err = run(["eval", folder, "--factors", "1", "200", "--eval-tokens", "2000"], capsys)
    err = one_line_error(code, err, "eval")
    assert "--factors 200 gives length 3200" in err and "2000 tokens evaluated" in err and "--eval-tokens 2000" in err
    assert out == ""
    small = _text(tmp_path / "small-eval.txt", 4000)  # its last 5%: about 200 characters
    code, _, err = run(["eval", folder, "--eval-file", str(small), "--factors", "1", "40"], capsys)
    assert "--factors 40 gives length 640" in err and "all of the held-out text" in one_line_error(code, err, "eval")
    code, out, err = run(["eval", folder, "--factors", "1", "4", "--eval-tokens", "64"], capsys)  # 4L = 64: allowed
    assert code == 0 and "ppl@64" in out, err


# ---------------------------------------------------------------------------
# 2. nothing lost
# ---------------------------------------------------------------------------


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_train_never_replaces_a_model_without_overwrite(tmp_path, capsys):
    model = tmp_path / "model"
    argv = ["train", "--output-dir", str(model), *TINY, "--quiet"]
    assert run(argv, capsys)[0] == 0
    first, first_checkpoints = _snapshot(model), _snapshot(tmp_path / "model-checkpoints")

    code, _, err = run(argv, capsys)
    assert "--overwrite" in one_line_error(code, err, "train")
    assert _snapshot(model) == first and _snapshot(tmp_path / "model-checkpoints") == first_checkpoints

    # --overwrite replaces the model; the earlier run's checkpoints are renamed aside, byte for byte
    code, out, err = run(argv + ["--seed", "1", "--overwrite"], capsys)
    assert code == 0
    assert _snapshot(model)["model.safetensors"] != first["model.safetensors"]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("model-checkpoints.old-")]
    assert len(aside) == 1 and _snapshot(aside[0]) == first_checkpoints
    assert (tmp_path / "model-checkpoints").is_dir()


def test_train_refuses_a_folder_with_other_files_even_with_overwrite(tmp_path, capsys):
    project = tmp_path / "project"
    project.mkdir()
    (project / "README.md").write_text("# my project\n")
    (project / "pyproject.toml").write_text("[project]\nname = 'mine'\n")
    before = _snapshot(project)
    for extra in ([], ["--overwrite"]):
        code, _, err = run(["train", "--output-dir", str(project), *TINY, *extra], capsys)
        assert "not an hf-relpos model" in one_line_error(code, err, "train")
    assert _snapshot(project) == before
    assert not (tmp_path / "project-checkpoints").exists()


def test_compare_writes_a_fresh_folder_under_runs_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    seen = []

    class Stop(Exception):
        pass

    def record(args):
        seen.append(args.output_dir)
        raise Stop

    monkeypatch.setattr(hf_relpos.commands.compare, "train_model", record)
    with pytest.raises(Stop):
        hf_relpos_cli.main(["compare", "--quick"])
    capsys.readouterr()
    assert Path(seen[0]).parts[0] == "runs" and Path(seen[0]).parts[1].startswith("compare-")

    results = tmp_path / "results" / "compare"
    results.mkdir(parents=True)
    (results / "compare.md").write_text("a committed table\n")
    code, _, err = run(["compare", "--quick", "--output-dir", str(results)], capsys)
    assert "--overwrite" in one_line_error(code, err, "compare")
    assert (results / "compare.md").read_text() == "a committed table\n"


def test_gitignore_lists_no_tracked_file():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    assert ignored.returncode == 0 and ignored.stdout == "", ignored.stdout


# ---------------------------------------------------------------------------
# 3. Ctrl-C saves a checkpoint that --resume continues to the same result
# ---------------------------------------------------------------------------


def test_resume_with_other_options_is_a_user_error(tmp_path, capsys):
    """--resume continues the same run: other data options (here, no --train-file: the embedded corpus and
    another vocabulary) are refused in one line naming them, not a state-dict traceback; the folder stays."""
    text = tmp_path / "mine.txt"
    text.write_text(" ".join(f"word{i % 97} text{i % 13}" for i in range(3000)))
    out = tmp_path / "model"
    assert run(["train", "--output-dir", str(out), *TINY, "--train-file", str(text), "--quiet"], capsys)[0] == 0
    checkpoints = sorted(p.name for p in (tmp_path / "model-checkpoints").iterdir())
    other = tmp_path / "other.txt"  # options a resume does not give are the checkpoint's: give another file
    other.write_text(" ".join(f"other{i % 89} words{i % 11}" for i in range(3000)))
    code, _, err = run(["train", "--output-dir", str(out), *TINY, "--train-file", str(other), "--resume"], capsys)
    err = one_line_error(code, err, "train")
    assert "--train-file" in err and "resume with the original options" in err, err
    assert sorted(p.name for p in (tmp_path / "model-checkpoints").iterdir()) == checkpoints
    assert (out / "model.safetensors").is_file()
    # the same options resume (from the last checkpoint: nothing left to train, the model is rewritten)
    code, _, err = run(["train", "--output-dir", str(out), *TINY, "--train-file", str(text), "--resume", "--quiet"],
                       capsys)
    assert code == 0, err


def test_compare_resume_with_other_text_or_length_is_a_user_error(tmp_path, capsys):
    """compare --resume reuses finished runs only if they were trained on this command's text and length: another
    --corpus or --seq-len is one line naming it (another --factors or --sliding evaluates the saved models anew:
    tests/test_corpus.py)."""
    out = tmp_path / "cmp"
    base = ["compare", "--quick", "--schemes", "alibi", "--seeds", "1", "--steps", "2", "--batch-size", "2",
            "--vocab-size", "300", "--eval-tokens", "64", "--factors", "1", "2", "--output-dir", str(out), "--quiet"]
    assert run(base + ["--seq-len", "16"], capsys)[0] == 0
    table = (out / "compare.md").read_text()
    for extra, flag in ((["--seq-len", "16", "--corpus", "stdlib"], "--corpus stdlib"), (["--seq-len", "32"], "--seq-len"),
                        (["--seq-len", "16", "--steps", "3"], "--steps 2, this command gives 3")):
        code, _, err = run(base + extra + ["--resume"], capsys)
        err = one_line_error(code, err, "compare")
        assert flag in err, err
        assert (out / "compare.md").read_text() == table  # nothing rewritten
    assert run(base + ["--seq-len", "16", "--resume"], capsys)[0] == 0  # the same runs resume
    # a record written before --corpus existed (no corpus_name) was trained on the docs: stdlib is refused as well
    record_file = out / "models" / "alibi" / "seed-0" / "hf_relpos_run.json"
    record = json.loads(record_file.read_text())
    del record["corpus_name"]
    record_file.write_text(json.dumps(record))
    table = (out / "compare.md").read_text()
    code, _, err = run(base + ["--seq-len", "16", "--corpus", "stdlib", "--resume"], capsys)
    assert "--corpus stdlib" in one_line_error(code, err, "compare"), err
    assert (out / "compare.md").read_text() == table
    assert run(base + ["--seq-len", "16", "--resume"], capsys)[0] == 0  # and resumes as the docs


def test_ctrl_c_while_compare_evaluates_a_finished_run_anew(tmp_path, capsys, monkeypatch):
    """compare --sliding --resume evaluates the saved models: Ctrl-C there is one line with the resume command
    (as while training, not a bare "interrupted"), and the record is left as it was."""
    import hf_relpos.commands.train as train_module

    out = tmp_path / "cmp"
    base = ["compare", "--quick", "--schemes", "alibi", "--seeds", "1", "--steps", "2", "--batch-size", "2",
            "--vocab-size", "300", "--eval-tokens", "64", "--factors", "1", "2", "--seq-len", "16",
            "--output-dir", str(out), "--quiet"]
    assert run(base, capsys)[0] == 0
    record = (out / "models" / "alibi" / "seed-0" / "hf_relpos_run.json").read_text()

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "evaluate_lengths", ctrl_c)
    code, _, err = run(base + ["--sliding", "--resume"], capsys)
    assert code == 130 and err.count("\n") == 1 and "Resume with: hf-relpos compare" in err, (code, err)
    assert (out / "models" / "alibi" / "seed-0" / "hf_relpos_run.json").read_text() == record
    assert not (out / "compare-sliding.md").exists()


@pytest.mark.parametrize("scheme", ["t5_bias", "transformer_xl"])
def test_ctrl_c_saves_and_resume_reaches_the_same_loss(scheme, tmp_path, monkeypatch, capsys):
    settings = ["--position-encoding", scheme, "--steps", "6", "--seq-len", "16", "--batch-size", "2",
                "--vocab-size", "300", "--eval-tokens", "64", "--quiet"]  # fmt: skip
    straight = tmp_path / "straight"
    assert run(["train", "--output-dir", str(straight), *settings], capsys)[0] == 0

    original = transformers.Trainer.training_step

    def press_ctrl_c(self, *args, **kwargs):
        if self.state.global_step == 2:
            signal.raise_signal(signal.SIGINT)  # as the terminal does: the handler flags it, training goes on
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "training_step", press_ctrl_c)
    interrupted = tmp_path / "interrupted"
    code, out, err = run(["train", "--output-dir", str(interrupted), *settings], capsys)
    monkeypatch.setattr(transformers.Trainer, "training_step", original)
    assert code == 130
    assert err.count("\n") == 1 and "interrupted at step 3 of 6" in err, err
    checkpoint = tmp_path / "interrupted-checkpoints" / "checkpoint-3"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "optimizer.pt").is_file()
    first_part = json.loads((checkpoint / TIME_FILE).read_text())["train_seconds"]
    if scheme == "transformer_xl":
        assert (checkpoint / "mems-rank0.safetensors").is_file()
    assert not (interrupted / "model.safetensors").exists()

    command = err.split("Resume with: ")[1].strip()
    assert command.startswith("hf-relpos train ") and command.endswith("--resume")
    assert run(shlex.split(command)[1:], capsys)[0] == 0
    resumed, reference = (json.loads((d / RUN_FILE).read_text()) for d in (interrupted, straight))
    assert resumed["final_train_loss"] == pytest.approx(reference["final_train_loss"], abs=1e-4)
    assert resumed["test_ppl"] == pytest.approx(reference["test_ppl"], rel=1e-4)
    assert resumed["train_seconds"] >= first_part > 0  # the card's training time covers both parts


# ---------------------------------------------------------------------------
# 4. quiet and clear output
# ---------------------------------------------------------------------------


def test_train_output_is_one_bar_and_quiet_is_one_line(tmp_path, capfd):
    assert hf_relpos_cli.main(["train", "--output-dir", str(tmp_path / "q"), *TINY, "--quiet"]) == 0
    out, err = capfd.readouterr()
    assert out.count("\n") == 1 and out.startswith(f"Saved to {tmp_path / 'q'}/"), out
    assert err == "", err

    assert hf_relpos_cli.main(["train", "--output-dir", str(tmp_path / "loud"), *TINY]) == 0
    out, err = capfd.readouterr()
    assert "training:" in err  # the progress bar
    assert "{'loss'" not in out + err and "Writing model shards" not in out + err
    assert "validation loss" in out + err


def test_generate_takes_no_settings_from_the_folders_generation_config(trained, tmp_path, capsys):
    """A generation_config.json asking for beams and odd token ids (a stranger's, or edited) neither breaks
    `generate` with a traceback nor changes its text: the command's settings are its own."""
    argv = ["--prompt", "The for statement", "--max-new-tokens", "8", "--temperature", "0", "--quiet"]
    code, plain, err = run(["generate", str(trained / "t5_bias"), *argv], capsys)
    assert code == 0, err
    folder = Path(shutil.copytree(trained / "t5_bias", tmp_path / "model"))
    (folder / "generation_config.json").write_text(json.dumps({"num_beams": 4, "eos_token_id": [1, "x"]}))
    code, out, err = run(["generate", str(folder), *argv], capsys)
    assert code == 0, err
    assert out == plain


def test_generate_quiet_prints_only_the_text(trained, capfd):
    assert hf_relpos_cli.main(["generate", str(trained / "t5_bias"), "--prompt", "The", "--max-new-tokens", "5",
                               "--temperature", "0", "--quiet"]) == 0  # fmt: skip
    out, err = capfd.readouterr()
    assert out.startswith("The") and out.count("\n") == 1 and err == ""


def test_generate_quiet_streams_so_an_interrupted_run_keeps_its_text(trained, tmp_path, capfd):
    """``generate --quiet > file`` stopped by Ctrl-C keeps the text written so far: the text goes to stdout as it
    comes, flushed, in quiet mode too (it was printed once, at the end: an interrupted run kept nothing)."""
    import time

    prompt = "The for statement"
    assert hf_relpos_cli.main(["generate", str(trained / "t5_bias"), "--prompt", prompt, "--max-new-tokens", "40",
                               "--temperature", "0", "--quiet"]) == 0  # fmt: skip
    greedy = capfd.readouterr().out.rstrip("\n")
    assert greedy.startswith(prompt) and len(greedy) > len(prompt) + 10

    text = tmp_path / "generated.txt"
    with text.open("w") as stdout:
        process = subprocess.Popen(
            [sys.executable, "-m", "hf_relpos.cli", "generate", str(trained / "t5_bias"), "--prompt", prompt,
             "--max-new-tokens", "100000", "--temperature", "0", "--quiet"],
            stdout=stdout, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=ROOT, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            # A run started in the background of a shell (nohup make test &) ignores SIGINT, and so would this
            # child, which then never sees Ctrl-C: give it the terminal's default, as an interactive user has.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while len(text.read_text()) <= len(prompt) + 10 and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert process.poll() is None, "generate ended before it was interrupted"
            assert len(text.read_text()) > len(prompt) + 10, "nothing streamed to stdout while generating"
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 130 and err.strip().endswith("hf-relpos generate: interrupted"), err
    kept = text.read_text()
    shared = min(len(kept), len(greedy))
    assert kept[:shared] == greedy[:shared]  # the greedy text, as far as either goes


# ---------------------------------------------------------------------------
# 5. help
# ---------------------------------------------------------------------------


def test_every_option_has_help_and_its_default():
    root = hf_relpos_cli.parser()
    subparsers = next(a for a in root._actions if a.dest == "command").choices
    for name, sub in subparsers.items():
        text = sub.format_help()
        for action in sub._actions:
            if action.dest in ("help",):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"
            if action.option_strings and action.default not in (None, False):
                assert f"(default: {action.default})" in " ".join(text.split()), (name, action.dest)


def test_help_and_version_do_not_import_torch():
    code = (
        "import sys, hf_relpos_cli\n"
        "for argv in (['--help'], ['train', '--help'], ['compare', '--help'], ['--version']):\n"
        "    try:\n"
        "        hf_relpos_cli.main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, argv\n"
        "print(sorted(m for m in ('torch', 'transformers', 'hf_relpos') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert f"hf-relpos {hf_relpos.__version__}" in result.stdout


def test_cli_constants_match_the_package():
    assert hf_relpos_cli.SCHEMES == tuple(hf_relpos.POSITION_ENCODINGS)
    assert hf_relpos_cli.MIN_VOCAB == 256 + len(SPECIAL_TOKENS)
    assert sorted(hf_relpos_cli.PRESET_NAMES) == sorted(PRESETS)


def test_training_flags_are_the_train_options_fields():
    """The parser's training flags are made from ``TrainOptions``' fields (one copy of each name and default):
    ``train`` takes every field marked as a flag, with the field's default (or its ``cli_default``), and no
    training flag that is not a field; ``compare`` the same but its own output folder and scheme list."""
    import dataclasses

    from hf_relpos.commands.options import TrainOptions

    subparsers = next(a for a in hf_relpos_cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    flagged = {f.name: f for f in dataclasses.fields(TrainOptions) if "flag" in f.metadata}
    assert flagged, "no TrainOptions field is a flag"
    for command, own in (("train", set()), ("compare", {"output_dir", "schemes", "quick", "seeds", "factors", "sliding"})):
        actions = {a.dest: a for a in subparsers.choices[command]._actions if a.dest not in ("help", "debug")}
        expected = {name for name, f in flagged.items() if f.metadata["flag"].get("command", command) == command}
        assert set(actions) - own == expected, command
        for name in expected:
            field, action = flagged[name], actions[name]
            cli_default = field.metadata["flag"].get("cli_default")
            default = getattr(hf_relpos_cli, cli_default) if cli_default else field.default
            if command == "compare" and name == "steps":
                default = 500  # compare's own
            assert action.default == default, (command, name, action.default, default)
            assert action.option_strings == ["--" + name.replace("_", "-")]


def test_help_parses_in_well_under_half_a_second():
    """Interpreter start aside: importing the parser and printing the help imports no torch, so it takes ~10 ms."""
    code = (
        "import time\n"
        "start = time.perf_counter()\n"
        "import hf_relpos_cli\n"
        "for argv in (['--help'], ['train', '--help'], ['compare', '--help']):\n"
        "    try:\n"
        "        hf_relpos_cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(time.perf_counter() - start)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.strip().splitlines()[-1]) < 0.5, result.stdout[-200:]


def test_the_commands_are_found_by_the_names_the_parser_dispatches_to():
    import importlib

    subparsers = next(a for a in hf_relpos_cli.parser()._actions if a.dest == "command").choices
    assert sorted(hf_relpos_cli.COMMANDS) == sorted(subparsers)
    for name, target in hf_relpos_cli.COMMANDS.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name


# ---------------------------------------------------------------------------
# 8. a readable plot
# ---------------------------------------------------------------------------


def test_plot_log_scale_marks_what_cannot_run_and_keeps_the_legend_off_the_data(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    rows = [
        {"scheme": "alibi", "ppl_1x": 60.0, "ppl_2x": 58.0, "ppl_4x": 57.0},
        {"scheme": "sinusoidal", "ppl_1x": 150.0, "ppl_2x": 900.0, "ppl_4x": 4000.0},
        {"scheme": "learned", "ppl_1x": 90.0, "ppl_2x": float("inf"), "ppl_4x": float("inf")},
    ]
    plot(rows, 64, (1, 2, 4), tmp_path / "p.png", quick=True)
    (ax,) = figures[0].axes
    assert ax.get_yscale() == "log"
    assert "quick run" in ax.get_title()
    labels = [line.get_label() for line in ax.get_lines()]
    assert "cannot run (past its table)" in labels
    marks = [line for line in ax.get_lines() if line.get_marker() == "x"]
    assert sorted(float(line.get_xdata()[0]) for line in marks) == [128.0, 256.0]
    figures[0].canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1 - 1  # to the right of the axes, off the data


def test_train_and_compare_through_a_symlink_or_dots(trained, tmp_path, monkeypatch, capsys):
    """--output-dir a link to an earlier run: --overwrite replaces the folder it points to and keeps the link
    (it crashed with 'Cannot call rmtree on a symbolic link' and left the link turned into a folder); a path
    ending in '.' or '..' is one line, nothing written."""
    real = tmp_path / "real"
    shutil.copytree(trained / "t5_bias", real)
    weights = (real / "model.safetensors").read_bytes()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    code, _, err = run(["train", "--output-dir", str(link), *TINY, "--seed", "1", "--overwrite", "--quiet"], capsys)
    assert code == 0, err
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert (real / "model.safetensors").read_bytes() != weights  # the new run's weights, where the link points
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith((".replaced", ".saving"))]

    monkeypatch.chdir(real)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for command in ("train", "compare"):
        for out in (".", "real/.."):
            code, _, err = run([command, "--output-dir", out, *TINY], capsys)
            err = one_line_error(code, err, command)
            assert f"--output-dir {out!r} names no folder of its own" in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_file_given_as_the_model_folder_is_named_a_file(tmp_path, capsys):
    """A file where the model folder goes: one line saying it is a file (it said the folder held no config.json)."""
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"not a folder")
    for command, *options in FOLDER_COMMANDS:
        code, out, err = run([command, str(a_file), *options], capsys)
        err = one_line_error(code, err, command)
        assert f"{str(a_file)!r} is a file, not a folder" in err, (command, err)
