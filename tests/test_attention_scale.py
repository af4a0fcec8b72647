"""``RelPosConfig.attention_scale``: the factor of ``q·k`` (default ``1/sqrt(head_dim)``; T5 attends with 1.0),
read by every backend.

The oracle is an identity, not the fast code: a model with ``attention_scale=s`` must equal the same model with the
default scale whose query projections are multiplied by ``c = s·sqrt(head_dim)``, since ``(c·q)·k / sqrt(d) =
s·q·k`` (rotations and every scheme's position term are unchanged by the factor). Compared: logits on padded
batches (the CPU fast paths they pick), every other parameter's gradient, cached greedy decoding; under eager,
sdpa, FlexAttention (torch's unfused CPU path) and the Triton kernel (under the interpreter). Shaw and
Transformer-XL, whose attention functions divide by ``sqrt(head_dim)`` as their papers do, refuse the field.
"""

import math

import pytest
import torch

from hf_relpos import POSITION_ENCODINGS, RelPosConfig, RelPosForCausalLM, RelPosForConditionalGeneration, RelPosModel
from hf_relpos.configuration_relpos import CAUSAL_ONLY
from tiny import assert_close, build, padding_mask, rand_ids

SCALED = tuple(s for s in POSITION_ENCODINGS if s not in ("shaw", "transformer_xl"))
SCALE = 1.0  # T5's
BATCH, LENGTH = 3, 11


def twins(scheme: str, impl: str, cls=RelPosForCausalLM, scale: float = SCALE, **overrides):
    """(the model with ``attention_scale=scale``, the same weights at the default scale with the query
    projections times ``scale·sqrt(head_dim)``)."""
    scaled = build(scheme, cls=cls, impl=impl, attention_scale=scale, **overrides)
    folded = build(scheme, cls=cls, impl=impl, **overrides)
    folded.load_state_dict(scaled.state_dict())
    factor = scale * math.sqrt(scaled.config.head_dim)
    with torch.no_grad():
        for name, param in folded.named_parameters():
            if name.endswith("q_proj.weight"):
                param.mul_(factor)
    assert factor != 1.0 and scaled.config.attention_scale == scale and folded.config.attention_scale is None
    return scaled, folded


def step(model, **inputs):
    """Logits and the gradients of every parameter but the query projections (which differ by the factor)."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    logits = out.logits
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()
                             if p.grad is not None and not n.endswith("q_proj.weight")}


def assert_same(scaled, folded, atol=1e-4, what=""):  # the factor rounds differently in q and in the scores
    (logits, grads), (expected, expected_grads) = scaled, folded
    assert_close(logits, expected, atol=atol, what=f"{what}: logits")
    assert grads.keys() == expected_grads.keys() and grads, what
    for name, grad in grads.items():
        norm = expected_grads[name].abs().max().clamp_min(1.0)
        assert_close(grad / norm, expected_grads[name] / norm, atol=atol, what=f"{what}: {name}")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("scheme", SCALED)
def test_the_scale_reaches_every_causal_scheme(scheme, impl):
    """Training step (the gradient paths) and an inference forward (the fused CPU paths), left padding."""
    scaled, folded = twins(scheme, impl)
    ids, mask = rand_ids(BATCH, LENGTH), padding_mask(BATCH, LENGTH, "left")
    keep = mask.bool()
    for model in (scaled, folded):
        model.train()
    a, b = step(scaled, input_ids=ids, attention_mask=mask), step(folded, input_ids=ids, attention_mask=mask)
    assert_same((a[0][keep], a[1]), (b[0][keep], b[1]), what=f"{scheme}/{impl} training")
    with torch.no_grad():
        got = scaled.eval()(ids, attention_mask=mask).logits[keep]
        expected = folded.eval()(ids, attention_mask=mask).logits[keep]
    assert_close(got, expected, atol=1e-4, what=f"{scheme}/{impl} inference")
    # and the scale matters: the same weights at the default scale give other logits
    with torch.no_grad():
        default = build(scheme, impl=impl)
        default.load_state_dict(scaled.state_dict())
        assert (default(ids, attention_mask=mask).logits[keep] - got).abs().max() > 1e-3


@pytest.mark.parametrize("scheme", SCALED)
def test_cached_greedy_decoding_keeps_the_scale(scheme):
    scaled, folded = twins(scheme, "sdpa")
    ids, mask = rand_ids(2, 7), padding_mask(2, 7, "left")
    out = [m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
           for m in (scaled, folded)]
    uncached = scaled.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                               use_cache=False)
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], uncached), scheme


@pytest.mark.parametrize("scheme", [s for s in SCALED if s not in CAUSAL_ONLY])
def test_a_bidirectional_model_and_an_encoder_decoder_keep_the_scale(scheme):
    scaled, folded = twins(scheme, "sdpa", cls=RelPosModel, is_decoder=False)
    ids, mask = rand_ids(BATCH, LENGTH), padding_mask(BATCH, LENGTH, "right")
    with torch.no_grad():
        got, expected = (m(ids, attention_mask=mask).last_hidden_state for m in (scaled, folded))
    assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-4, what=scheme)
    scaled, folded = _seq2seq_twins(scheme)
    target = rand_ids(BATCH, 5, seed=3)
    with torch.no_grad():
        got, expected = (m(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits for m in (scaled, folded))
    assert_close(got, expected, atol=1e-4, what=f"{scheme} encoder-decoder (self- and cross-attention)")


def _seq2seq_twins(scheme):
    from tiny import make_model

    scaled = make_model(RelPosForConditionalGeneration, scheme, "sdpa", preset="seq2seq", attention_scale=SCALE)
    folded = make_model(RelPosForConditionalGeneration, scheme, "sdpa", preset="seq2seq")
    folded.load_state_dict(scaled.state_dict())
    with torch.no_grad():
        for name, param in folded.named_parameters():
            if name.endswith("q_proj.weight"):
                param.mul_(SCALE * math.sqrt(scaled.config.head_dim))
    return scaled, folded


@pytest.mark.parametrize("scheme", ["t5_bias", "alibi", "fox"])
def test_flex_attention_keeps_the_scale(scheme):
    scaled, folded = twins(scheme, "flex_attention")
    ids, mask = rand_ids(2, LENGTH), padding_mask(2, LENGTH, "left")
    with torch.no_grad():
        got, expected = (m(ids, attention_mask=mask).logits for m in (scaled, folded))
    assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-4, what=scheme)


@pytest.mark.parametrize("scheme", ["t5_bias", "alibi", "fox"])
def test_the_triton_kernel_keeps_the_scale(scheme):
    pytest.importorskip("triton")
    scaled, folded = twins(scheme, "relpos_triton", attention_dropout=0.0)
    ids, mask = rand_ids(2, LENGTH), padding_mask(2, LENGTH, "left")
    keep = mask.bool()
    for model in (scaled, folded):
        model.train()
    a, b = step(scaled, input_ids=ids, attention_mask=mask), step(folded, input_ids=ids, attention_mask=mask)
    assert_same((a[0][keep], a[1]), (b[0][keep], b[1]), what=f"{scheme}/relpos_triton")


def test_the_field_is_checked_saved_and_refused_where_it_cannot_be_honoured(tmp_path):
    for bad in (0.0, -1.0, float("inf"), float("nan"), "1", True):
        with pytest.raises(ValueError, match=r"^RelPosConfig.attention_scale must be None \(1/sqrt\(head_dim\)\) or a "):
            RelPosConfig(attention_scale=bad)
    for scheme in ("shaw", "transformer_xl"):
        with pytest.raises(ValueError, match=rf"attention_scale must be None for position_encoding='{scheme}'"):
            RelPosConfig(position_encoding=scheme, attention_scale=1.0)
    config = RelPosConfig(position_encoding="alibi", attention_scale=0.25)
    config.save_pretrained(tmp_path)
    assert RelPosConfig.from_pretrained(tmp_path).attention_scale == 0.25
    assert RelPosConfig().attention_scale is None
