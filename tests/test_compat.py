"""Working with the Transformers a user installs (issue 21): the cache under its two names, no keyword argument
silently ignored, T5 conversions that refuse to differ, and the declared, tested and warned-about versions.

Transformers 5.24 renamed the cache ``past_key_values`` -> ``cache`` (inputs and outputs) and ``generate`` passes
the new name; models that took only the old one and swallowed ``**kwargs`` decoded every step as a fresh forward.
These tests call the models with each name directly, so they fail on such code under any Transformers; the
compatibility job (``make compat``) runs the whole suite on the oldest and newest tested Transformers too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from tiny import make_model
from transformers import DynamicCache, EncoderDecoderCache

import hf_relpos
from hf_relpos import POSITION_ENCODINGS, RelPosConfig, RelPosForCausalLM, RelPosForSequenceClassification, RelPosModel
from hf_relpos import versions
from hf_relpos.inputs_relpos import CACHE_FIELD
from hf_relpos.t5_conversion import random_t5
from hf_relpos_cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 61


def tiny(scheme: str, cls=RelPosForCausalLM, seed: int = 0, **overrides):
    """The "modeling" preset of tiny.py (vocab 61)."""
    return make_model(cls, scheme, seed=seed, preset="modeling", **overrides)


def ids(batch=2, length=9, seed=1):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def seq2seq(scheme="t5_bias"):
    """The "seq2seq" preset of tiny.py with the decoder depth and the position table at their defaults."""
    return make_model(hf_relpos.RelPosForConditionalGeneration, scheme, preset="seq2seq", num_decoder_layers=None,
                      max_position_embeddings=RelPosConfig.max_position_embeddings)


# ---------------------------------------------------------------------------
# 1. The cache under Transformers 5.24's name and under the earlier one
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
@pytest.mark.parametrize("scheme", POSITION_ENCODINGS)
def test_cached_steps_under_either_cache_name_equal_the_full_forward(scheme, name):
    """Prefill, then one token at a time, passing the cache as ``cache=`` or ``past_key_values=``: each step's
    logits equal the full forward's, and the output carries the same cache object in the field the installed
    Transformers declares (``cache`` from 5.24, ``past_key_values`` before)."""
    model, tokens = tiny(scheme), ids()
    with torch.no_grad():
        full = model(tokens, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        out = model(tokens[:, :5], use_cache=True, **{name: cache})
        assert getattr(out, CACHE_FIELD) is cache and out[CACHE_FIELD] is cache
        steps = [out.logits]
        for i in range(5, tokens.shape[1]):
            out = model(tokens[:, i : i + 1], use_cache=True, **{name: getattr(out, CACHE_FIELD)})
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)
    assert cache.get_seq_length() == tokens.shape[1]


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_the_base_model_takes_either_cache_name(name):
    model, tokens = tiny("alibi", cls=RelPosModel, is_decoder=True), ids()
    with torch.no_grad():
        full = model(tokens).last_hidden_state
        first = model(tokens[:, :6], use_cache=True, **{name: DynamicCache(config=model.config)})
        second = model(tokens[:, 6:], use_cache=True, **{name: getattr(first, CACHE_FIELD)})
    torch.testing.assert_close(second.last_hidden_state, full[:, 6:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_encoder_decoder_takes_either_cache_name(name):
    model, source, target = seq2seq(), ids(2, 7, seed=2), ids(2, 6, seed=3)
    with torch.no_grad():
        full = model(input_ids=source, decoder_input_ids=target).logits
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        out = model(input_ids=source, decoder_input_ids=target[:, :3], use_cache=True, **{name: cache})
        assert getattr(out, CACHE_FIELD) is cache
        rest = model(input_ids=source, decoder_input_ids=target[:, 3:], use_cache=True, **{name: cache})
    torch.testing.assert_close(torch.cat([out.logits, rest.logits], 1), full, rtol=1e-4, atol=1e-5)
    assert cache.self_attention_cache.get_seq_length() == 6


@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
def test_trainer_predictions_hold_the_logits_not_the_cache(tmp_path, kind):
    """``Trainer.predict`` leaves out the output keys in ``config.keys_to_ignore_at_inference``; the cache's key
    is ``cache`` from Transformers 5.24 (it was ``past_key_values``): predictions are the logits alone."""
    from transformers import Trainer, TrainingArguments

    model = tiny("t5_bias") if kind == "causal" else seq2seq()
    tokens = ids(4, 6)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(tokens)

        def __getitem__(self, i):
            row = {"input_ids": tokens[i], "labels": tokens[i]}
            return row if kind == "causal" else {**row, "decoder_input_ids": tokens[i]}

    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to=[],
                             dataloader_pin_memory=False, use_cpu=True)
    predictions = Trainer(model=model, args=args).predict(Rows()).predictions
    assert not isinstance(predictions, tuple) or kind == "seq2seq", type(predictions)
    logits = predictions[0] if isinstance(predictions, tuple) else predictions
    assert logits.shape == (4, 6, VOCAB)
    if kind == "seq2seq":  # logits, then the encoder's last states: nothing from the cache
        assert [p.shape for p in predictions] == [(4, 6, VOCAB), (4, 6, 32)]


def test_the_old_cache_name_warns_only_where_transformers_renamed_it():
    """From 5.24 (``CACHE_FIELD == "cache"``) ``past_key_values=`` warns as upstream models do (Transformers' own
    ``test_bc_cache_name_forward``); before, it is the current name and stays quiet."""
    import warnings

    model, tokens = tiny("alibi"), ids()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(tokens, past_key_values=DynamicCache(config=model.config), use_cache=True)
        model(tokens, cache=DynamicCache(config=model.config), use_cache=True)
    deprecations = [w for w in caught if "`past_key_values` is deprecated" in str(w.message)]
    assert len(deprecations) == (1 if CACHE_FIELD == "cache" else 0), [str(w.message) for w in caught]
    assert all(w.category is FutureWarning for w in deprecations)


def test_encoder_decoder_generate_hands_its_encoder_only_what_it_takes():
    """``generate`` passes every model keyword argument to an encoder whose forward takes ``**kwargs``: the
    decoder's ``logits_to_keep`` (given by the caller, or by assisted decoding) must not reach the encoder,
    which refuses unknown keywords, and must still act in the decoding steps."""
    model, source = seq2seq(), ids(1, 7, seed=4)  # assisted decoding takes one sequence
    decode = dict(input_ids=source, max_new_tokens=6, do_sample=False)
    greedy = model.generate(**decode)
    assert torch.equal(model.generate(**decode, logits_to_keep=1), greedy)
    assistant = seq2seq()
    assert torch.equal(model.generate(**decode, assistant_model=assistant), greedy)


def test_the_cache_under_both_names_at_once_is_refused():
    model, tokens = tiny("rope"), ids()
    with pytest.raises(ValueError, match=rf"as cache= and another as past_key_values=.* give yours as {CACHE_FIELD}="):
        model(tokens, cache=DynamicCache(), past_key_values=DynamicCache())


def test_a_cache_with_activation_checkpointing_in_training_is_refused_not_dropped():
    """A checkpointed layer runs again in backward, so a cache cannot ride along; the cache a caller passes (PEFT's
    prefix tuning passes its prefix as one) is refused, never dropped."""
    from tiny import enable_checkpointing

    model, tokens = tiny("t5_bias").train(), ids()
    enable_checkpointing(model)
    prefix = DynamicCache(config=model.config)
    with torch.no_grad():
        model.eval()(tokens[:, :3], cache=prefix, use_cache=True)
    model.train()
    with pytest.raises(ValueError, match="cannot be used with activation checkpointing in training"):
        model(tokens[:, 3:], cache=prefix, labels=tokens[:, 3:])
    assert model(tokens, labels=tokens).loss.isfinite()  # without a cache it trains
    with torch.no_grad():  # and without gradients nothing runs twice: the cache is used
        assert model(tokens[:, 3:], cache=prefix, use_cache=True).logits.shape[1] == tokens.shape[1] - 3


# ---------------------------------------------------------------------------
# 2. Nothing silently ignored
# ---------------------------------------------------------------------------


def _calls():
    causal, tokens = tiny("t5_bias"), ids()
    return {
        "RelPosModel": (tiny("t5_bias", cls=RelPosModel, is_decoder=True), dict(input_ids=tokens)),
        "RelPosForCausalLM": (causal, dict(input_ids=tokens)),
        "RelPosForSequenceClassification": (tiny("t5_bias", cls=RelPosForSequenceClassification), dict(input_ids=tokens)),
        "RelPosForConditionalGeneration": (seq2seq(), dict(input_ids=tokens, decoder_input_ids=tokens[:, :4])),
    }


@pytest.mark.parametrize("owner", ["RelPosModel", "RelPosForCausalLM", "RelPosForSequenceClassification",
                                   "RelPosForConditionalGeneration"])
@pytest.mark.parametrize("keyword", ["past_key_value", "cache_params", "head_mask", "decoder_head_mask"])
def test_an_unknown_keyword_argument_is_a_type_error_naming_it(owner, keyword):
    model, inputs = _calls()[owner]
    with pytest.raises(TypeError, match=rf"{owner}\.forward\(\) got an unexpected keyword argument '{keyword}'"):
        model(**inputs, **{keyword: None})


@pytest.mark.parametrize("owner", ["RelPosModel", "RelPosForCausalLM", "RelPosForSequenceClassification",
                                   "RelPosForConditionalGeneration"])
def test_one_segment_token_type_ids_are_taken_other_segments_refused(owner):
    """BERT-style tokenizers return ``token_type_ids`` (pipelines and collators pass them on): all 0 is one
    segment, what these models compute; another segment would need segment embeddings they do not have."""
    model, inputs = _calls()[owner]
    with torch.no_grad():
        expected = model(**inputs)[0]
        segments = torch.zeros_like(inputs["input_ids"])
        torch.testing.assert_close(model(**inputs, token_type_ids=segments)[0], expected, rtol=0, atol=0)
        segments[:, -3:] = 1
        with pytest.raises(ValueError, match="token_type_ids with a segment other than 0"):
            model(**inputs, token_type_ids=segments)


def test_transformers_model_keyword_arguments_stay_accepted():
    """The keyword arguments Transformers defines for models (``TransformersKwargs``) and the loss's are taken,
    and they act: output flags return what they ask for, the loss keywords change the loss."""
    model, tokens = tiny("alibi"), ids()
    out = model(tokens, output_attentions=True, output_hidden_states=True, max_length_q=9, max_length_k=9,
                is_causal=True, output_router_logits=False)
    assert len(out.attentions) == 2 and len(out.hidden_states) == 3
    labels = tokens.clone()
    labels[:, :4] = 7
    plain = model(tokens, labels=labels).loss
    ignored = model(tokens, labels=labels, ignore_index=7).loss
    halved = model(tokens, labels=labels, num_items_in_batch=torch.tensor(2 * (tokens.numel() - 2))).loss
    assert not torch.allclose(plain, ignored)
    torch.testing.assert_close(halved, plain / 2)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    torch.testing.assert_close(model(tokens, shift_labels=shifted).loss, plain)
    encdec = seq2seq()
    with pytest.raises(TypeError, match="shift_labels"):  # T5's loss aligns labels with the logits: no shift
        encdec(input_ids=tokens, labels=tokens, shift_labels=tokens)
    assert encdec(input_ids=tokens, labels=tokens, ignore_index=3, output_attentions=True).cross_attentions


def test_model_keyword_arguments_that_ask_for_something_else_are_refused():
    model, tokens = tiny("rope"), ids(1, 6)
    with pytest.raises(ValueError, match="is_causal=False"):
        model(tokens, is_causal=False)
    with pytest.raises(ValueError, match="output_router_logits"):
        model(tokens, output_router_logits=True)
    with pytest.raises(ValueError, match="cu_seq_lens_k must equal cu_seq_lens_q"):
        model(tokens, cu_seq_lens_q=torch.tensor([0, 2, 6]), cu_seq_lens_k=torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match="keeps no cache"):
        tiny("rope", cls=RelPosForSequenceClassification)(tokens, use_cache=True)


# ---------------------------------------------------------------------------
# 3-4. Declared versions = tested versions; the warning and --version
# ---------------------------------------------------------------------------


def test_declared_tested_and_pinned_versions_agree():
    """pyproject's lower bound is the oldest tested Transformers, the Makefile's compatibility job runs it, the
    development pin (the whole suite, `make test`) is the newest, and the development torch is a tested one."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = {re.match(r"[A-Za-z_-]+", r).group(0): r for r in project["dependencies"]}
    low, high = versions.TESTED_TRANSFORMERS
    assert re.fullmatch(rf"transformers>={re.escape(low)}(,<6)?", requirements["transformers"].split(";")[0].strip())
    oldest_torch = min(versions.TESTED_TORCH, key=versions.release)
    assert re.fullmatch(rf"torch>={re.escape(oldest_torch.removesuffix('.0'))}(\.0)?", requirements["torch"])
    assert project["version"] == hf_relpos.__version__
    compat = re.search(r"^COMPAT_TRANSFORMERS \?= (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    assert compat == [low]
    pins = dict(line.split("==") for line in (ROOT / "constraints-dev.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["transformers"] == high and versions.torch_tested(pins["torch"])


VERSION_CASES = [("5.20.0", True), ("5.26.0", True), ("6.0.0", True), ("5.24.1", False),
                 (versions.TESTED_TRANSFORMERS[0], False), ("5.23.0", False), (versions.TESTED_TRANSFORMERS[1], False)]


@pytest.mark.parametrize("installed, warned", VERSION_CASES)
def test_the_import_warning_is_one_line_outside_the_tested_transformers(installed, warned):
    """What ``import hf_relpos`` logs for each installed version (the import itself: the next test, in a child)."""
    warning = versions.untested_transformers_warning(installed)
    if warned:
        low, high = versions.TESTED_TRANSFORMERS
        assert "\n" not in warning and f"transformers {installed} is installed" in warning and f"{low} to {high}" in warning
    else:
        assert warning is None


# A fresh interpreter per case (about 7 s each on the 2-core CI): one version outside the range and one inside.
@pytest.mark.parametrize("installed, warned", [VERSION_CASES[0], VERSION_CASES[4]])
def test_import_warns_in_one_line_outside_the_tested_transformers(installed, warned, tmp_path):
    code = f"import transformers; transformers.__version__ = {installed!r}; import hf_relpos"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "hf_relpos" in line]
    if warned:
        assert len(lines) == 1, result.stderr
        low, high = versions.TESTED_TRANSFORMERS
        assert f"transformers {installed} is installed" in lines[0] and f"{low} to {high}" in lines[0]
    else:
        assert lines == [], result.stderr


def test_version_names_hf_relpos_torch_and_transformers(capsys):
    import transformers

    with pytest.raises(SystemExit) as stop:
        cli_main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert re.search(rf"^torch {re.escape(versions.installed('torch'))}$", out, re.M)
    assert re.search(rf"^transformers {re.escape(transformers.__version__)} ", out, re.M)
    together = versions.tested_together(torch.__version__, transformers.__version__)
    assert out.startswith("hf-relpos ") and f"tested together: {'yes' if together else 'no'} (" in out


def test_version_support_helpers():
    assert versions.release("2.13.0+cpu") == (2, 13, 0) and versions.release("5.25.0.dev0") == (5, 25, 0)
    low, high = versions.TESTED_TRANSFORMERS
    assert versions.transformers_tested(low) and versions.transformers_tested(high)
    assert not versions.transformers_tested("5.0.0") and not versions.transformers_tested("6.0.0")
    assert versions.transformers_tested("5.24.3") and not versions.transformers_tested("5.20.9")
    assert versions.untested_transformers_warning(high) is None
    assert versions.tested_together("2.13.0+cpu", low) and versions.tested_together("2.13.0+cpu", high)
    assert versions.tested_together("2.15.0+cu132", "5.24.0") and not versions.tested_together("2.15.0", "5.25.0")
    assert not versions.tested_together("2.15.0", low) and not versions.tested_together("2.9.0", high)


def test_softmax_gradients_do_not_depend_on_clamp_mins_rule_at_its_bound(monkeypatch):
    """Found running the suite on torch 2.15 (the newest release): its ``clamp_min`` passes no gradient where the
    input equals the bound (2.13 passed it), and the masked softmax divided by ``sum.clamp_min(1.0)``, whose input
    is exactly 1 in a row with one key left, such as a causal sequence's first query. Under torch 2.15's rule,
    simulated here, such a row's gradient must stay zero, and Shaw's gradients must still pass gradcheck."""
    from hf_relpos import functional_relpos as functional  # _masked_softmax: private, not re-exported

    def clamp_min_without_gradient_at_the_bound(self, bound):
        return torch.where(self > bound, self, torch.full_like(self, bound))

    monkeypatch.setattr(torch.Tensor, "clamp_min", clamp_min_without_gradient_at_the_bound)
    scores = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0.0, float("-inf"), float("-inf"), float("-inf")], [0.0] * 4], dtype=torch.float64)
    weights = torch.randn(2, 4, dtype=torch.float64)
    (functional._masked_softmax(scores, mask) * weights).sum().backward()
    assert torch.equal(scores.grad[0], torch.zeros(4, dtype=torch.float64))  # one key: probability 1, constant
    q, k, v = (torch.randn(1, 2, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    rel_k, rel_v = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(
        lambda *a: functional.shaw_attention(*a, max_relative_position=1, is_causal=True), (q, k, v, rel_k, rel_v)
    )


# ---------------------------------------------------------------------------
# 6. T5 conversions that differ from their source are refused
# ---------------------------------------------------------------------------


def _off_by_a_little(monkeypatch):
    """Make the conversion misplace nothing but scale one decoder MLP weight: a silent, plausible mismatch."""
    from hf_relpos import t5_conversion

    original = t5_conversion._t5_state_dict_to_relpos

    def slightly_wrong(state, config):
        out = original(state, config)
        out["decoder.layers.0.mlp.down_proj.weight"] = out["decoder.layers.0.mlp.down_proj.weight"] * 1.01
        return out

    monkeypatch.setattr(t5_conversion, "_t5_state_dict_to_relpos", slightly_wrong)


def test_from_t5_refuses_a_conversion_that_differs(monkeypatch):
    upstream = random_t5("v1.1/Flan (gated GELU, untied)")
    hf_relpos.from_t5(upstream)  # the real conversion passes its own check
    _off_by_a_little(monkeypatch)
    with pytest.raises(ValueError, match=r"max \|logit diff\| .* \(tolerance"):
        hf_relpos.from_t5(upstream)
    assert hf_relpos.from_t5(upstream, check=False) is not None  # asked for: no check
    assert not upstream.training  # the check restores the modes


def test_from_t5_checks_a_half_precision_model_through_fp32(monkeypatch):
    upstream = random_t5("v1.0 (ReLU, tied output rescaled)").to(torch.bfloat16)
    assert hf_relpos.from_t5(upstream).dtype == torch.bfloat16
    _off_by_a_little(monkeypatch)
    with pytest.raises(ValueError, match="does not reproduce the upstream T5"):
        hf_relpos.from_t5(upstream)


def test_convert_t5_refuses_a_conversion_that_differs_and_writes_nothing(monkeypatch, tmp_path, capsys):
    random_t5("v1.0 (ReLU, tied output rescaled)").save_pretrained(tmp_path / "t5")
    out = tmp_path / "converted"
    assert cli_main(["convert-t5", str(tmp_path / "t5"), str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _off_by_a_little(monkeypatch)
    assert cli_main(["convert-t5", str(tmp_path / "t5"), str(tmp_path / "new")]) == 2
    assert not (tmp_path / "new").exists()
    assert cli_main(["convert-t5", str(tmp_path / "t5"), str(out), "--overwrite"]) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier model is untouched
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not the save's progress bars
    assert len(err) == 2 and all(re.match(r"hf-relpos convert-t5: error: .*does not reproduce the upstream T5.*"
                                          r"nothing written$", line) for line in err), err
