"""Transformers' own exporters for every scheme of a causal model, an exported decode loop against ``generate``, and
``hf-relpos export`` (its pt2 and ONNX folders read back as a user would, its one-line errors).

- ``DynamoExporter`` / ``OnnxExporter`` (``transformers.exporters``, Transformers 5.23+): the exported program, run
  on another batch and length than the traced ones with padding, gives the model's logits; the Dynamo program driven
  as a greedy loop (the whole text each step) gives ``generate``'s tokens for a left-padded batch;
- ``TorchExportableModuleForDecoderOnlyLM`` (static cache, ExecuTorch's recipe): the program driven token by token
  gives ``generate``'s greedy tokens; ``export_with_dynamic_cache``: the program's logits and cache are the model's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_relpos_cli
from hf_relpos import RelPosForCausalLM
from tiny import ENCODINGS, VOCAB, build, greedy, make_model, padding_mask, rand_ids

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_export_tools")

NEW_TOKENS = 6


def generate_inputs(input_ids, attention_mask):
    """The kwargs ``generate`` passes a first forward: positions counted from each row's first token."""
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def dims(model):
    from torch.export import Dim

    batch, length = Dim("batch", min=1), Dim("sequence", min=1, max=model.config.max_position_embeddings)
    return {name: {0: batch, 1: length} for name in ("input_ids", "attention_mask", "position_ids")}


def traced_and_other():
    """The traced inputs and ones of another batch and length (both padded on the left)."""
    return (generate_inputs(rand_ids(2, 7, seed=1), padding_mask(2, 7, "left")),
            generate_inputs(rand_ids(3, 11, seed=2), padding_mask(3, 11, "left")))


def max_difference(logits, expected, attention_mask) -> float:
    keep = attention_mask.bool()  # a padding position's logits mean nothing
    return float((torch.as_tensor(logits) - expected)[keep].abs().max())


def static_cache_greedy(program, prompt, new_tokens: int) -> torch.Tensor:
    """Greedy decoding by a program of ``TorchExportableModuleForDecoderOnlyLM``, one token per call: token ``p`` at
    cache position ``p``. (Transformers' own ``TorchExportableModuleWithStaticCache.generate``, 5.23 and 5.24, feeds
    each generated token at its position + 1, which leaves an empty cache slot: its tokens differ from ``generate``'s
    for upstream models as well.)"""
    step, tokens = program.module(), prompt[0].tolist()
    for position in range(prompt.shape[1] + new_tokens - 1):
        logits = step(input_ids=torch.tensor([[tokens[position]]]), cache_position=torch.tensor([position]))
        if position >= prompt.shape[1] - 1:
            tokens.append(int(logits[0, -1].argmax()))
    return torch.tensor([tokens])


def exported_logits(exported, inputs):
    """The logits of what an exporter returned: an ``ExportedModel`` (Transformers 5.23+) gives the model's output;
    5.21 and 5.22 return the bare program (an ``ExportedProgram`` to call through ``.module()``, or an
    ``ONNXProgram`` whose outputs are a tuple, the logits first)."""
    if isinstance(exported, torch.export.ExportedProgram):
        exported = exported.module()
    out = exported(**inputs)
    return torch.as_tensor(out.logits if hasattr(out, "logits") else out[0])


@pytest.mark.parametrize("scheme", ENCODINGS)
def test_dynamo_exporter_and_its_decode_loop_then_executorchs_recipe(scheme):
    pytest.importorskip("transformers.exporters", reason="Transformers' exporters are missing")
    from transformers.exporters.configs import DynamoConfig
    from transformers.exporters.exporter_dynamo import DynamoExporter
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = build(scheme, impl="sdpa")
    traced, other = traced_and_other()
    exported = DynamoExporter().export(model, traced, DynamoConfig(dynamic_shapes=dims(model)))
    with torch.no_grad():
        expected = model(**other).logits
    assert max_difference(exported_logits(exported, other), expected, other["attention_mask"]) <= 1e-5

    # the program as a decoder: the whole (left-padded) text each step, greedy
    ids, mask = other["input_ids"], other["attention_mask"]
    for _ in range(NEW_TOKENS):
        logits = exported_logits(exported, generate_inputs(ids, mask))
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    assert torch.equal(ids, greedy(model, other["input_ids"], NEW_TOKENS, attention_mask=other["attention_mask"]))

    # then ExecuTorch's recipe (static cache) on the same model: DynamoExporter leaves `model.forward` set on the
    # instance, and a tensor made in forward was then lifted under a path unlifting cannot find (alibi's slopes)
    prompt = rand_ids(1, 7, seed=3)
    expected = greedy(model, prompt, 10)
    model.generation_config.cache_implementation = "static"
    exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=24)
    if scheme == "fox":  # the recipe sizes its cache's keys head_dim: no room for FoX's forget gate, said plainly
        with torch.no_grad(), pytest.raises(Exception) as error:
            exportable.export(input_ids=prompt[:, :1], cache_position=torch.tensor([0]))
        assert "position_encoding='fox', whose keys carry 1 more channel" in str(error.value), error.value
        return
    with torch.no_grad():
        program = exportable.export(input_ids=prompt[:, :1], cache_position=torch.tensor([0]))
        assert torch.equal(static_cache_greedy(program, prompt, 10), expected)


@pytest.mark.parametrize("scheme", ENCODINGS)
def test_onnx_exporter(scheme):
    pytest.importorskip("transformers.exporters", reason="Transformers' exporters are missing")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from transformers.exporters.configs import OnnxConfig
    from transformers.exporters.exporter_onnx import OnnxExporter

    model = build(scheme, impl="sdpa", num_hidden_layers=1)  # one layer: ONNX's translation time grows with the graph
    traced, other = traced_and_other()
    exported = OnnxExporter().export(model, traced, OnnxConfig(dynamic_shapes=dims(model)))
    with torch.no_grad():
        expected = model(**other).logits
    assert max_difference(exported_logits(exported, other), expected, other["attention_mask"]) <= 1e-4


@pytest.mark.parametrize("scheme", ENCODINGS)
def test_export_with_dynamic_cache(scheme):
    from transformers import DynamicCache
    from transformers.integrations.executorch import export_with_dynamic_cache

    model = build(scheme, impl="sdpa")
    input_ids, attention_mask = rand_ids(2, 6, seed=4), padding_mask(2, 6, "left")
    program = export_with_dynamic_cache(model, input_ids, attention_mask)
    # the cache's keyword: `past_key_values`, or `cache` from Transformers 5.24 on
    names = program.call_spec.in_spec.child(1).context
    cache_name = next(name for name in names if name in ("cache", "past_key_values"))
    with torch.no_grad():
        got = program.module()(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                               **{cache_name: DynamicCache(config=model.config)})
        expected = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True)
    assert max_difference(got.logits, expected.logits, attention_mask) <= 1e-5
    cache, expected_cache = got.past_key_values, expected.past_key_values
    assert cache.get_seq_length() == expected_cache.get_seq_length() == 6
    for layer, expected_layer in zip(cache.layers, expected_cache.layers):
        torch.testing.assert_close(layer.keys, expected_layer.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(layer.values, expected_layer.values, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------
# hf-relpos export
# ---------------------------------------------------------------------------

TEXT = "The for statement is used to iterate over the elements of a sequence. " * 20
PROMPT = "The for statement"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``folders(scheme)``: a model folder as ``hf-relpos train`` writes it (random weights, a small tokenizer)."""
    from hf_relpos.commands.common import library_output_off
    from hf_relpos.data import train_tokenizer

    tokenizer = train_tokenizer([TEXT], vocab_size=300)
    made = {}

    def get(scheme: str, **overrides) -> Path:
        key = (scheme, *sorted(overrides.items()))
        if key not in made:
            folder = tmp_path_factory.mktemp("models") / scheme
            model = make_model(RelPosForCausalLM, scheme, vocab_size=len(tokenizer), max_position_embeddings=48,
                               **overrides)
            with library_output_off():  # no "Writing model shards" bar in the first test's output
                model.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
            made[key] = folder
        return made[key]

    return get


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A folder written by ``hf-relpos train``: learned positions (a table of 16)."""
    folder = tmp_path_factory.mktemp("trained") / "learned"
    assert hf_relpos_cli.main(["train", "--position-encoding", "learned", "--output-dir", str(folder), "--steps", "1",
                               "--seq-len", "16", "--batch-size", "2", "--vocab-size", "300", "--eval-tokens", "64",
                               "--quiet"]) == 0
    return folder


def test_a_trained_folder_goes_through_executorchs_recipe(trained, capsys):
    """Trainer turns config.use_cache off for training; the folder turns it on again, in its generation config too
    (the recipe refuses a model without cache), and the program's decoding is generate's."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from hf_relpos.commands.common import load_folder

    capsys.readouterr()
    model, _ = load_folder(str(trained))
    assert model.config.use_cache is True and model.generation_config.use_cache is True
    prompt = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(6))
    expected = greedy(model, prompt, 8)
    model.generation_config.cache_implementation = "static"
    with torch.no_grad():
        program = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=16).export(
            input_ids=prompt[:, :1], cache_position=torch.tensor([0]))
        assert torch.equal(static_cache_greedy(program, prompt, 8), expected)


def run(argv, capsys):
    try:
        code = hf_relpos_cli.main(argv)
    except SystemExit as stop:  # the parser's errors
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(argv, capsys) -> str:
    code, out, err = run(["export", *argv], capsys)
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("hf-relpos export: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def readme_code(out: Path) -> str:
    (code,) = re.findall(r"```python\n(.*?)```", (out / "README.md").read_text(), flags=re.S)
    return code


def run_readme(out: Path) -> str:
    """OUT/README.md's code, run where it says (beside OUT) in a fresh interpreter; what it printed and imported."""
    code = readme_code(out) + "import sys\nprint(sorted(m for m in ('hf_relpos', 'transformers', 'torch') if m in sys.modules))\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=out.parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def expected_text(folder: Path) -> str:
    """The README's greedy decoding by the model itself: ``generate``'s tokens for the prompt (20, or up to the end
    of a position table), decoded."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = RelPosForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([tokenizer.encode(PROMPT, add_special_tokens=False).ids])
    table = model.config.max_position_embeddings if model.config.position_encoding == "learned" else 10**6
    new = min(20, table - ids.shape[1])
    assert new < 20 or table == 10**6, "the prompt leaves the table room for 20 new tokens: the break goes untested"
    return tokenizer.decode(greedy(model, ids, new)[0].tolist())


def test_export_pt2_round_trip(trained, tmp_path, capsys):
    folder = trained  # an absolute table: positions from the mask, the length capped by the table
    out = tmp_path / "learned-pt2"
    capsys.readouterr()
    code, printed, err = run(["export", str(folder), str(out), "--format", "pt2"], capsys)
    assert code == 0, err
    assert "max |difference| to the model" in printed and err == ""
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "export.json", "model.pt2", "tokenizer.json",
                                                     "tokenizer_config.json"]
    record = json.loads((out / "export.json").read_text())
    assert record["format"] == "pt2" and record["max_sequence_length"] == 16
    assert record["check"]["max_abs_difference"] <= 1e-5

    # read back as a user would, on a shape of its own: a left-padded row gives the logits of the row alone
    program = torch.export.load(out / "model.pt2").module()
    model = RelPosForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 15), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        logits = program(ids, mask)
        alone = model(ids[1:, 5:]).logits
        assert torch.allclose(logits[1, 5:], alone[0], atol=1e-5)
        assert torch.allclose(logits[0], model(ids[:1]).logits[0], atol=1e-5)
    # its README runs beside the folder without hf_relpos and decodes generate's tokens
    lines = run_readme(out).splitlines()
    assert lines[0] == expected_text(folder) and lines[-1] == "['torch']"


def test_export_onnx_round_trip_and_overwrite(folders, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    folder = folders("t5_bias")
    out = tmp_path / "t5-onnx"
    out.mkdir()  # an earlier export (what the command reads of it: its record)
    (out / "export.json").write_text(json.dumps({"hf_relpos_export": 1}))
    (out / "model.pt2").write_bytes(b"an earlier program")
    err = one_line_error([str(folder), str(out), "--format", "onnx"], capsys)
    assert f"OUT {str(out)!r} already holds an hf-relpos export: pass --overwrite to replace it" in err
    assert (out / "model.pt2").is_file()  # untouched

    code, _, err = run(["export", str(folder), str(out), "--format", "onnx", "--overwrite"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "export.json", "model.onnx", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".t5-onnx.lock"]  # no staging
    assert json.loads((out / "export.json").read_text())["check"]["max_abs_difference"] <= 1e-4
    # onnxruntime alone (no torch, no Transformers) decodes generate's tokens
    lines = run_readme(out).splitlines()
    assert lines[0] == expected_text(folder) and lines[-1] == "[]"


class _Constant(torch.nn.Module):
    """A wrong program: the logits of a model whose every output is 0."""

    def forward(self, input_ids, attention_mask):
        return torch.zeros(*input_ids.shape, 300) + attention_mask[..., None] * 0


def test_export_pt2_of_transformer_xl_with_memory(folders, tmp_path, capsys):
    """Memory makes a sliding window of mem_len + 1 keys (checked by the command on 13 tokens); the memory the model
    would hand on is no output of the program, and slicing it no longer fixes the traced length below mem_len."""
    folder = folders("transformer_xl", mem_len=8)
    out = tmp_path / "txl-pt2"
    code, _, err = run(["export", str(folder), str(out), "--format", "pt2"], capsys)
    assert code == 0, err
    program = torch.export.load(out / "model.pt2").module()
    model = RelPosForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(program(ids, torch.ones_like(ids)), model(ids).logits, atol=1e-5, rtol=0)


def test_a_wrong_export_fails_loudly_and_writes_nothing(folders, tmp_path, capsys, monkeypatch):
    import hf_relpos.commands.export as export

    def wrong_program(model, fmt, path):
        inputs = export.example_inputs(export.shapes(model.config)[0], 300, seed=0)
        torch.export.save(torch.export.export(_Constant(), inputs, dynamic_shapes=export.dynamic_shapes(model.config)),
                          path)

    monkeypatch.setattr(export, "export_program", wrong_program)
    out = tmp_path / "out"
    err = one_line_error([str(folders("rope")), str(out), "--format", "pt2"], capsys)
    assert "the exported program differs from the model on a [3, 13] input: max |difference| of the logits" in err
    assert "the export is wrong; nothing written" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_export_user_errors_are_one_line(folders, tmp_path, capsys, monkeypatch):
    import hf_relpos.commands.export as export

    folder = folders("rope")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    cases = [
        ([str(tmp_path / "missing"), str(tmp_path / "o"), "--format", "pt2"], "does not exist"),
        ([str(mine), str(tmp_path / "o"), "--format", "pt2"], f"folder {str(mine)!r} holds no config.json"),
        ([str(folder), str(mine), "--format", "pt2", "--overwrite"],
         f"OUT {str(mine)!r} holds files that are not an hf-relpos export (notes.txt); give a new or empty folder"),
        ([str(folder), str(folder), "--format", "pt2", "--overwrite"], "OUT " + repr(str(folder)) + " is FOLDER"),
        ([str(folder), str(afile), "--format", "pt2"], f"OUT {str(afile)!r} is a file"),
        ([str(folder), str(tmp_path / "model.onnx"), "--format", "onnx"], "names a file: OUT is a folder"),
        ([str(folder), str(tmp_path / "o"), "--format", "tflite"],
         "argument --format: invalid choice: 'tflite'"),
        ([str(folder), str(tmp_path / "o")], "the following arguments are required: --format"),
    ]
    for argv, expected in cases:
        assert expected in one_line_error(argv, capsys), argv
    assert (mine / "notes.txt").read_text() == "mine" and afile.read_text() == "mine"

    real = export.importlib.util.find_spec
    monkeypatch.setattr(export.importlib.util, "find_spec", lambda name: None if name == "onnxruntime" else real(name))
    err = one_line_error([str(folder), str(tmp_path / "o"), "--format", "onnx"], capsys)
    assert "--format onnx needs the packages onnx, onnxscript and onnxruntime (onnxruntime missing): " \
           "pip install 'hf_relpos[export]'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "mine"]  # nothing created


def test_out_through_a_symlink_or_dots(folders, tmp_path, capsys, monkeypatch):
    """OUT a symbolic link to an earlier export: --overwrite replaces the export where the link points (the swap
    renamed the link aside and then failed on it: 'Cannot call rmtree on a symbolic link', the link turned into a
    folder and every later export to it failed the same way); '.' and 'x/..' are one-line errors (a traceback)."""
    import hf_relpos.commands.export as export

    def quick_write(model, tokenizer, path, out, staged, fmt):  # the swap is under test, not the program
        record = {"hf_relpos_export": 1, "format": fmt, "check": {"runtime": "-", "input_shape": [1, 1],
                                                                  "max_abs_difference": 0.0}}
        (staged / export.EXPORT_RECORD).write_text(json.dumps(record))
        (staged / "model.pt2").write_bytes(b"new")
        return record

    monkeypatch.setattr(export, "_write", quick_write)
    real = tmp_path / "real"
    real.mkdir()
    (real / "export.json").write_text(json.dumps({"hf_relpos_export": 1}))
    (real / "model.pt2").write_bytes(b"old")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    code, _, err = run(["export", str(folders("rope")), str(link), "--format", "pt2", "--overwrite"], capsys)
    assert code == 0, err
    assert link.is_symlink() and (real / "model.pt2").read_bytes() == b"new"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith((".replaced", ".saving"))]

    monkeypatch.chdir(tmp_path / "real")
    for out in (".", "real/..", str(tmp_path / "new" / "..")):
        err = one_line_error([str(folders("rope")), out, "--format", "pt2"], capsys)
        assert f"OUT {out!r} names no folder of its own" in err
    assert (real / "model.pt2").read_bytes() == b"new" and not (tmp_path / "new").exists()
