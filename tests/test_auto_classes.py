"""The Auto classes refuse a model of the other kind: an encoder-decoder's config given to a decoder-only class
(``AutoModelForCausalLM``, ``AutoModel``, ``AutoModelForSequenceClassification``), or a decoder-only config given to
``AutoModelForSeq2SeqLM``, is a ``ValueError`` naming the class, ``is_encoder_decoder`` and the Auto class to use,
with hf_relpos imported (its registered classes) and through remote code in a process that cannot import it.
Before, the pairing built the model and loaded none of its weights."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import transformers
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification

import hf_relpos
from hf_relpos import RelPosForCausalLM, RelPosForConditionalGeneration, RelPosModel
from hf_relpos.loading_relpos import AUTO_MAP
from test_loading_safety import SCRIPT  # its subprocess: hf_relpos blocked when remote, RLIMIT_AS capped
from tiny import make_model, tiny_config

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_auto_classes")

# (the Auto class, the kind of folder it cannot hold, the class it reaches, the Auto class the error names)
MISMATCHES = [
    ("AutoModelForCausalLM", "seq2seq", "RelPosForCausalLM", "AutoModelForSeq2SeqLM"),
    ("AutoModel", "seq2seq", "RelPosModel", "AutoModelForSeq2SeqLM"),
    ("AutoModelForSequenceClassification", "seq2seq", "RelPosForSequenceClassification", "AutoModelForSeq2SeqLM"),
    ("AutoModelForSeq2SeqLM", "causal", "RelPosForConditionalGeneration", "AutoModelForCausalLM"),
]
IDS = [f"{auto}-{kind}" for auto, kind, *_ in MISMATCHES]
SAVED = {"seq2seq": "RelPosForConditionalGeneration", "causal": "RelPosForCausalLM"}


def _refusal(cls: str, instead: str) -> re.Pattern:
    """The one-line error: the class, the field with the folder's value, the Auto class to use."""
    return re.compile(rf"^{cls} .*is_encoder_decoder=(True|False).*: load it with {instead} \(")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    make_model(RelPosForConditionalGeneration, "t5_bias", preset="seq2seq").save_pretrained(root / "seq2seq")
    make_model(RelPosForCausalLM, "t5_bias").save_pretrained(root / "causal")
    return root


def test_every_folder_maps_every_auto_class(folders):
    """Every Auto class reaches a class of ours, so that remote code refuses a mismatch with our error, not
    Transformers' "Unrecognized configuration class"."""
    for kind in SAVED:
        config = json.loads((folders / kind / "config.json").read_text())
        assert config["auto_map"] == AUTO_MAP, (kind, config["auto_map"])
        assert config["architectures"] == [SAVED[kind]]


@pytest.mark.parametrize("auto, kind, cls, instead", MISMATCHES, ids=IDS)
def test_installed_classes_refuse_the_other_kind(folders, auto, kind, cls, instead):
    auto_class = getattr(transformers, auto)
    with pytest.raises(ValueError) as error:
        auto_class.from_pretrained(folders / kind)
    message = str(error.value)
    assert _refusal(cls, instead).match(message), message
    assert f"saved from {SAVED[kind]}" in message, message  # the folder's architectures
    assert "\n" not in message
    # from_config and the class itself refuse it too: the check is in __init__
    config = tiny_config("t5_bias", preset="seq2seq") if kind == "seq2seq" else tiny_config("t5_bias")
    with pytest.raises(ValueError, match=rf"^{cls} .*is_encoder_decoder=.*load it with {instead}"):
        auto_class.from_config(config)
    with pytest.raises(ValueError, match=rf"^{cls} .*is_encoder_decoder="):
        getattr(hf_relpos, cls)(config)


def test_matching_pairs_still_load(folders):
    """The refusal leaves every pairing that holds its config alone, the encoder-decoder's own stacks included."""
    model = AutoModelForSeq2SeqLM.from_pretrained(folders / "seq2seq")
    assert type(model) is RelPosForConditionalGeneration
    assert type(model.encoder) is RelPosModel and model.encoder.config.is_encoder_decoder
    assert type(AutoModelForCausalLM.from_pretrained(folders / "causal")) is RelPosForCausalLM
    assert type(AutoModel.from_pretrained(folders / "causal")) is RelPosModel
    classifier = AutoModelForSequenceClassification.from_pretrained(folders / "causal", num_labels=3)
    assert classifier.config.num_labels == 3


def test_remote_code_refuses_the_other_kind(folders, tmp_path):
    """The same refusals through ``trust_remote_code=True`` in a process where hf_relpos cannot be imported; the
    matching pairs load there."""
    cases = [(f"{auto}-{kind}", auto, str(folders / kind)) for auto, kind, *_ in MISMATCHES]
    cases += [("seq2seq", "AutoModelForSeq2SeqLM", str(folders / "seq2seq")),
              ("causal", "AutoModelForCausalLM", str(folders / "causal"))]
    (tmp_path / "spec.json").write_text(json.dumps({"remote": True, "cases": cases, "warm_up": []}))
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"),
               HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    work = tmp_path / "cwd"
    work.mkdir()
    proc = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(tmp_path / "spec.json"),
                           str(tmp_path / "out.json")], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads((tmp_path / "out.json").read_text())
    assert results["hf_relpos_imported"] is False
    for (auto, kind, cls, instead), name in zip(MISMATCHES, IDS):
        outcome = results[name]["outcome"]
        assert outcome.startswith("ValueError: "), (name, outcome)
        assert _refusal(cls, instead).match(outcome.removeprefix("ValueError: ")), (name, outcome)
    assert results["seq2seq"]["outcome"] == results["causal"]["outcome"] == "loaded", results


def test_a_stack_saved_alone_loads_with_automodel(tmp_path):
    """``model.encoder.save_pretrained`` (or the decoder's) keeps ``is_encoder_decoder``: AutoModel loads it back whole,
    as it did before the refusal (which refused it and sent it to AutoModelForSeq2SeqLM, where every weight was
    missing); the heads refuse it naming AutoModel."""
    import torch

    model = make_model(RelPosForConditionalGeneration, "t5_bias", preset="seq2seq")
    ids, states = torch.randint(2, 61, (2, 5)), torch.randn(2, 7, model.config.hidden_size)
    for part, kwargs in (("encoder", {}), ("decoder", {"encoder_hidden_states": states})):
        getattr(model, part).save_pretrained(tmp_path / part)
        loaded, info = AutoModel.from_pretrained(tmp_path / part, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (part, info)
        with torch.no_grad():
            assert torch.equal(loaded(ids, **kwargs).last_hidden_state,
                               getattr(model, part)(ids, **kwargs).last_hidden_state), part
        for auto in (AutoModelForSeq2SeqLM, AutoModelForCausalLM):
            with pytest.raises(ValueError, match=r"cannot hold one stack of an encoder-decoder .*load it with AutoModel "
                                                 r"\(RelPosModel\)$"):
                auto.from_pretrained(tmp_path / part)
