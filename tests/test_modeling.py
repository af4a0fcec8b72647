"""Tests for the hf_relpos models (``RelPosConfig``, ``RelPosModel``, ``RelPosForCausalLM``,
``RelPosForSequenceClassification``) against the public contract in ``/work/shared/api-contract.md``.

Every model here is tiny and random (hidden 32, 4 heads, 2 layers, vocab 61) with a large
``initializer_range`` so that position terms visibly change the outputs: a test that compares two
ways of computing the same thing fails when either side ignores positions, the cache or the mask.
Nothing is compared against stored numbers; every expected value is computed by a second, simpler
path (a full forward without cache, a batch of one, a manual greedy loop, ...).
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, StaticCache

import hf_relpos
from hf_relpos import (
    POSITION_ENCODINGS,
    RelPosConfig,
    RelPosForCausalLM,
    RelPosForSequenceClassification,
    RelPosModel,
)
from hf_relpos import position_schemes
from hf_relpos.configuration_relpos import CAUSAL_ONLY

ENCODINGS = tuple(POSITION_ENCODINGS)
RELATIVE = ("t5_bias", "shaw", "transformer_xl", "log_decay", "alibi")
ABSOLUTE = ("sinusoidal", "learned")
IMPLS = ("eager", "sdpa")
VOCAB = 61
ATOL = 1e-5


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def tiny_config(position_encoding: str, **overrides) -> RelPosConfig:
    kwargs = dict(
        position_encoding=position_encoding,
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=64,
        # small enough that sequences of ~10-20 tokens reach the log buckets and the clipping
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        max_relative_position=3,
        initializer_range=0.3,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,  # generation always runs max_new_tokens
    )
    kwargs.update(overrides)
    return RelPosConfig(**kwargs)


def build(position_encoding: str, cls=RelPosForCausalLM, impl: str = "eager", seed: int = 0, **overrides):
    if position_encoding in CAUSAL_ONLY and overrides.get("is_decoder", True) is False:
        pytest.skip(f"{position_encoding} is defined for causal attention only (its config refuses is_decoder=False)")
    config = tiny_config(position_encoding, **overrides)
    torch.manual_seed(seed)
    model = cls(config)
    model.set_attn_implementation(impl)
    return model.eval()


def use_impl(model, impl: str):
    model.set_attn_implementation(impl)
    assert model.config._attn_implementation == impl
    return model


def rand_ids(batch: int, length: int, seed: int = 1, low: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB, (batch, length), generator=g)


def padding_mask(batch: int, length: int, side: str, pads=(0, 3, 5)) -> torch.Tensor:
    """Row b has ``pads[b % len(pads)]`` padding tokens on ``side``; row 0 is never padded."""
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        n = pads[b % len(pads)]
        if n:
            if side == "left":
                mask[b, :n] = 0
            else:
                mask[b, length - n :] = 0
    return mask


def assert_close(actual, expected, atol=ATOL, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert diff <= atol, f"{what}: max abs diff {diff:.3g} > {atol}"


def assert_close_where(actual, expected, keep, atol=ATOL, what=""):
    """Compare ``[B, L, ...]`` tensors only at positions where ``keep[b, l]`` is true."""
    keep = keep.bool()
    assert_close(actual[keep], expected[keep], atol=atol, what=what)


def cache_snapshot(cache):
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers if getattr(layer, "keys", None) is not None]


def assert_cache_unchanged(cache, length_before, snapshot):
    assert cache.get_seq_length() == length_before, "a failing call changed the cache length"
    after = cache_snapshot(cache)
    assert len(after) == len(snapshot), "a failing call added cache layers"
    for (k0, v0), (k1, v1) in zip(snapshot, after):
        assert torch.equal(k0, k1) and torch.equal(v0, v1), "a failing call changed the cached keys/values"


def manual_greedy(model, ids, steps, attention_mask=None):
    """Greedy decoding by full forwards without any cache: the oracle for generate()."""
    with torch.no_grad():
        for _ in range(steps):
            kwargs = {}
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask
            logits = model(ids, use_cache=False, **kwargs).logits[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)], dim=1)
    return ids


def greedy(model, ids, new, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, num_beams=1, **kwargs)


# ---------------------------------------------------------------------------
# 1. RelPosConfig validation and round trip
# ---------------------------------------------------------------------------

# (overrides, field named in the message, value named in the message)
BAD_CONFIGS = [
    ({"position_encoding": "nopes"}, "position_encoding", "nopes"),
    ({"position_encoding": "nope", "is_decoder": False}, "is_decoder", "False"),  # causal only
    ({"position_encoding": "fire", "is_decoder": False}, "is_decoder", "False"),
    ({"fire_mlp_width": 0}, "fire_mlp_width", "0"),
    ({"fire_threshold": 0.0}, "fire_threshold", "0.0"),
    ({"position_encoding": "T5_BIAS"}, "position_encoding", "T5_BIAS"),
    ({"vocab_size": 0}, "vocab_size", "0"),
    ({"vocab_size": -5}, "vocab_size", "-5"),
    ({"hidden_size": 0}, "hidden_size", "0"),
    ({"hidden_size": 32.0}, "hidden_size", "32.0"),
    ({"num_hidden_layers": 0}, "num_hidden_layers", "0"),
    ({"num_attention_heads": 0}, "num_attention_heads", "0"),
    ({"num_attention_heads": -4}, "num_attention_heads", "-4"),
    ({"intermediate_size": 0}, "intermediate_size", "0"),
    ({"max_position_embeddings": 0}, "max_position_embeddings", "0"),
    ({"hidden_size": 30}, "hidden_size", "30"),  # not divisible by 4 heads
    ({"hidden_size": 36, "num_attention_heads": 12, "position_encoding": "rope"}, "head_dim", "3"),  # odd head_dim
    ({"head_dim": 5, "position_encoding": "rope"}, "head_dim", "5"),
    ({"head_dim": 0}, "head_dim", "0"),
    ({"feed_forward_proj": "gated"}, "feed_forward_proj", "gated"),
    ({"feed_forward_proj": "swiglu"}, "feed_forward_proj", "swiglu"),
    ({"num_decoder_layers": 0, "is_encoder_decoder": True}, "num_decoder_layers", "0"),
    ({"is_encoder_decoder": True, "position_encoding": "fire"}, "position_encoding", "fire"),
    ({"is_encoder_decoder": True, "position_encoding": "nope"}, "position_encoding", "nope"),
    ({"is_encoder_decoder": True, "decoder_start_token_id": VOCAB}, "decoder_start_token_id", str(VOCAB)),
    ({"is_encoder_decoder": True, "relative_attention_num_buckets": 3}, "relative_attention_num_buckets", "3"),
    ({"is_encoder_decoder": True, "position_encoding": "transformer_xl", "mem_len": 4}, "mem_len", "4"),
    ({"scale_decoder_outputs": 1}, "scale_decoder_outputs", "1"),
    ({"hidden_dropout": 1.0}, "hidden_dropout", "1.0"),
    ({"hidden_dropout": -0.1}, "hidden_dropout", "-0.1"),
    ({"attention_dropout": 1.5}, "attention_dropout", "1.5"),
    ({"hidden_act": "swishy"}, "hidden_act", "swishy"),
    ({"relative_attention_num_buckets": 1}, "relative_attention_num_buckets", "1"),
    ({"relative_attention_num_buckets": 0}, "relative_attention_num_buckets", "0"),
    ({"relative_attention_num_buckets": 3, "is_decoder": False}, "relative_attention_num_buckets", "3"),
    # 32 causal buckets: 16 exact ones, so max_distance must exceed 16
    ({"relative_attention_num_buckets": 32, "relative_attention_max_distance": 16}, "relative_attention_max_distance", "16"),
    ({"relative_attention_max_distance": 0}, "relative_attention_max_distance", "0"),
    ({"max_relative_position": -1}, "max_relative_position", "-1"),
    ({"mem_len": -1, "position_encoding": "transformer_xl"}, "mem_len", "-1"),
    ({"mem_len": 4, "position_encoding": "t5_bias"}, "mem_len", "4"),
    ({"mem_len": 4, "position_encoding": "rope"}, "mem_len", "4"),
    ({"clamp_len": 0, "position_encoding": "transformer_xl"}, "clamp_len", "0"),
    ({"clamp_len": -2, "position_encoding": "transformer_xl"}, "clamp_len", "-2"),
    ({"log_decay_scale": 0.0}, "log_decay_scale", "0.0"),
    ({"log_decay_scale": -1.0}, "log_decay_scale", "-1.0"),
    ({"log_decay_scale": float("nan")}, "log_decay_scale", "nan"),
    ({"rope_theta": 0.0}, "rope_theta", "0.0"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps", "0.0"),
    ({"initializer_range": -0.02}, "initializer_range", "-0.02"),
    ({"is_decoder": "yes"}, "is_decoder", "yes"),
    ({"pad_token_id": VOCAB}, "pad_token_id", str(VOCAB)),
    ({"pad_token_id": -1}, "pad_token_id", "-1"),
]


@pytest.mark.parametrize("overrides,field,value", BAD_CONFIGS, ids=[f"{c[1]}={c[2]}" for c in BAD_CONFIGS])
def test_config_rejects_invalid_values(overrides, field, value):
    with pytest.raises(ValueError) as info:
        tiny_config(overrides.pop("position_encoding", "t5_bias"), **overrides)
    message = str(info.value)
    assert field in message, f"message does not name the field {field!r}: {message}"
    assert value in message, f"message does not name the given value {value!r}: {message}"


def test_config_rejects_invalid_values_from_dict_and_json(tmp_path):
    good = tiny_config("transformer_xl", mem_len=8)
    data = good.to_dict()
    data["mem_len"] = -3
    with pytest.raises(ValueError, match="mem_len"):
        RelPosConfig.from_dict(data)
    good.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(path.read_text().replace('"clamp_len": -1', '"clamp_len": 0'))
    assert '"clamp_len": 0' in path.read_text()
    with pytest.raises(ValueError, match="clamp_len"):
        RelPosConfig.from_pretrained(tmp_path)


# A field set after construction is checked when the config is saved (Transformers calls config.validate()
# there): before, a config mutated to a bad value was written as it was.
@pytest.mark.parametrize("field,value", [("hidden_size", -3), ("clamp_len", 0), ("mem_len", 4)])
def test_config_set_after_construction_is_checked_on_save(tmp_path, field, value):
    config = tiny_config("t5_bias")
    setattr(config, field, value)
    with pytest.raises(ValueError, match=f"RelPosConfig.{field} must be"):
        config.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_config_accepts_every_scheme(position_encoding):
    config = tiny_config(position_encoding)
    assert config.position_encoding == position_encoding
    assert config.model_type == "relpos"


NON_DEFAULT_FIELDS = dict(
    vocab_size=77,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=6,
    hidden_act="silu",
    max_position_embeddings=99,
    position_encoding="transformer_xl",
    relative_attention_num_buckets=12,
    relative_attention_max_distance=40,
    max_relative_position=5,
    shaw_value_embeddings=False,
    mem_len=7,
    clamp_len=11,
    log_decay_scale=0.75,
    fire_mlp_width=12,
    fire_threshold=64.0,
    rope_theta=500.0,
    is_decoder=True,
    hidden_dropout=0.125,
    attention_dropout=0.25,
    rms_norm_eps=1e-5,
    initializer_range=0.05,
    attention_bias=True,
    use_cache=False,
    tie_word_embeddings=False,
    pad_token_id=3,
    bos_token_id=2,
    eos_token_id=4,
    num_decoder_layers=5,
    decoder_start_token_id=6,
    feed_forward_proj="gated-silu",
    head_dim=10,
    scale_decoder_outputs=True,
)
# An encoder-decoder refuses Transformer-XL's memory: its round trip takes the T5 bias.
SEQ2SEQ_FIELDS = dict(NON_DEFAULT_FIELDS, is_encoder_decoder=True, position_encoding="t5_bias", mem_len=0)


def _field_names():
    names = []
    for klass in reversed(RelPosConfig.__mro__):
        if klass is RelPosConfig:
            names.extend(getattr(klass, "__annotations__", {}))
    return names


@pytest.mark.parametrize("fields", [NON_DEFAULT_FIELDS, SEQ2SEQ_FIELDS], ids=["decoder", "encoder-decoder"])
def test_config_round_trip(tmp_path, fields):
    assert set(fields) <= set(_field_names())
    missing = set(_field_names()) - set(NON_DEFAULT_FIELDS) - set(SEQ2SEQ_FIELDS)
    assert not missing, f"round-trip test does not cover fields {missing}"
    config = RelPosConfig(**fields)
    for name, value in fields.items():
        assert getattr(config, name) == value, name

    as_dict = config.to_dict()
    for name, value in fields.items():
        assert as_dict[name] == value, name
    again = RelPosConfig.from_dict(as_dict)
    config.save_pretrained(tmp_path)
    loaded = RelPosConfig.from_pretrained(tmp_path)
    auto = AutoConfig.from_pretrained(tmp_path)
    assert type(auto) is RelPosConfig
    for other in (again, loaded, auto):
        for name, value in fields.items():
            assert getattr(other, name) == value, name
        _same_dict(other.to_dict(), as_dict)


def _same_dict(a, b):
    # auto_map is metadata that save_pretrained adds once any model class was saved in this process
    ignore = {"transformers_version", "_name_or_path", "auto_map"}
    assert {k: v for k, v in a.items() if k not in ignore} == {k: v for k, v in b.items() if k not in ignore}


# ---------------------------------------------------------------------------
# 2. eager == sdpa
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_eager_matches_sdpa(position_encoding, causal, padding):
    model = build(position_encoding, cls=RelPosModel, is_decoder=causal)
    B, L = 3, 13
    ids = rand_ids(B, L)
    mask = None if padding is None else padding_mask(B, L, padding)
    with torch.no_grad():
        eager = use_impl(model, "eager")(ids, attention_mask=mask, use_cache=False).last_hidden_state
        sdpa = use_impl(model, "sdpa")(ids, attention_mask=mask, use_cache=False).last_hidden_state
    keep = torch.ones(B, L) if mask is None else mask
    assert torch.isfinite(eager[keep.bool()]).all() and torch.isfinite(sdpa[keep.bool()]).all()
    assert_close_where(sdpa, eager, keep, what=f"{position_encoding} sdpa vs eager")


# Transformers' own tolerances for eager vs sdpa on CPU (test_modeling_common's eager/sdpa inference test).
HALF_TOLERANCES = {torch.bfloat16: (1e-2, 1e-2), torch.float16: (5e-3, 5e-3)}


@pytest.mark.parametrize("dtype", list(HALF_TOLERANCES), ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_eager_matches_sdpa_half_precision(position_encoding, causal, dtype):
    # initializer_range 0.02 (Transformers' default) keeps activations in the range half precision is made for
    model = build(position_encoding, cls=RelPosModel, is_decoder=causal, initializer_range=0.02).to(dtype)
    B, L = 3, 13
    ids = rand_ids(B, L)
    mask = padding_mask(B, L, "left")
    with torch.no_grad():
        eager = use_impl(model, "eager")(ids, attention_mask=mask, use_cache=False).last_hidden_state
        sdpa = use_impl(model, "sdpa")(ids, attention_mask=mask, use_cache=False).last_hidden_state
    atol, rtol = HALF_TOLERANCES[dtype]
    if dtype == torch.bfloat16:  # upstream's rule: bf16 keeps ~3 significant digits of the largest output
        atol = max(atol, 3e-2 * float(torch.maximum(eager.abs().amax(), sdpa.abs().amax())))
    for row in range(B):  # upstream lets 20% of the rows miss; here every row must match
        keep = mask[row].bool()
        assert torch.allclose(sdpa[row, keep].float(), eager[row, keep].float(), atol=atol, rtol=rtol), (
            f"row {row}: max abs diff {(sdpa[row, keep] - eager[row, keep]).abs().max().item():.3g}, atol {atol:.3g}"
        )


def reference_forward(model: RelPosModel, ids: torch.Tensor, mask: torch.Tensor, attentions=None) -> torch.Tensor:
    """A slow float64 forward written from the formulas of the contract, one score matrix per head.

    Reads the model's weights by name but none of its code paths: the position term of every scheme
    is built here from the distance matrix ``d[i, j] = j - i`` (key minus query). Each layer's
    probabilities ``[B, H, L, L]`` are appended to ``attentions`` when a list is given.
    """
    config = model.config
    pe, H, D = config.position_encoding, config.num_attention_heads, config.head_dim
    causal = config.is_decoder
    B, L = ids.shape
    dd = torch.float64
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    dist = j - i  # key position minus query position
    allowed = mask.bool()[:, None, None, :].expand(B, 1, L, L)
    if causal:
        allowed = allowed & (dist <= 0)

    def norm(x, module):
        return module.weight.to(dd) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)

    def lin(x, module):
        out = x @ module.weight.to(dd).T
        return out if module.bias is None else out + module.bias.to(dd)

    body = model
    h = body.embed_tokens.weight.to(dd)[ids]
    if pe == "sinusoidal":
        # Vaswani et al.: token embeddings times sqrt(d_model), plus the unit-amplitude sinusoids
        h = h * math.sqrt(config.hidden_size) + hf_relpos.functional.sinusoidal_embedding(
            torch.arange(L, dtype=dd), config.hidden_size)
    elif pe == "learned":
        h = h + body.position.position_embeddings.weight.to(dd)[:L]
    for layer in body.layers:
        attn = layer.self_attn
        x = norm(h, layer.input_layernorm)
        q, k, v = (lin(x, m).view(B, L, H, D).transpose(1, 2) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        if pe == "rope":
            inv = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2, dtype=dd) / D))
            ang = torch.arange(L, dtype=dd)[:, None] * inv[None]
            cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

            def rot(t):
                t1, t2 = t[..., : D // 2], t[..., D // 2 :]
                return t * cos + torch.cat([-t2, t1], -1) * sin

            q, k = rot(q), rot(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D)
        if pe == "t5_bias":
            buckets = hf_relpos.functional.t5_relative_position_bucket(
                dist, bidirectional=not causal, num_buckets=config.relative_attention_num_buckets,
                max_distance=config.relative_attention_max_distance,
            )
            table = body.position.relative_attention_bias.weight.to(dd)
            scores = scores + table[buckets].permute(2, 0, 1)[None]
        elif pe == "log_decay":
            scores = scores - config.log_decay_scale * torch.log1p(dist.abs().to(dd))
        elif pe == "alibi":
            slopes = hf_relpos.functional.alibi_slopes(H, dtype=dd)
            scores = scores - slopes[:, None, None] * dist.abs().to(dd)
        elif pe == "kerple_log":  # -r1_h ln(1 + r2_h |i - j|), r1, r2 kept >= 0.01 as KERPLE's code does
            r1 = body.position.r1.to(dd).clamp_min(0.01)[:, None, None]
            r2 = body.position.r2.to(dd).clamp_min(0.01)[:, None, None]
            scores = scores - r1 * torch.log(1 + r2 * dist.abs().to(dd))
        elif pe == "fire":  # f(psi(i - j) / psi(max(L, i))), psi(x) = ln(1 + |c x|), f a ReLU MLP per head
            fire = body.position
            c = fire.c.to(dd)
            threshold = (fire.threshold_scale.to(dd) * config.fire_threshold).abs()
            psi = lambda x: torch.log(1 + (c * x).abs())  # noqa: E731
            x = psi(-dist.to(dd)) / (psi(torch.maximum(i.to(dd), threshold)) + 1e-6)  # [L, L]
            hidden = torch.relu(x[..., None] * fire.mlp[0].weight.to(dd)[:, 0] + fire.mlp[0].bias.to(dd))
            scores = scores + (hidden @ fire.mlp[2].weight.to(dd).T + fire.mlp[2].bias.to(dd)).permute(2, 0, 1)
        elif pe == "shaw":
            kmax = config.max_relative_position
            index = dist.clamp(-kmax, kmax) + kmax
            rel_k = attn.relative.rel_k.to(dd)[index]  # [L, L, D]
            scores = scores + torch.einsum("bhid,ijd->bhij", q, rel_k) / math.sqrt(D)
        elif pe == "transformer_xl":
            rel = attn.relative
            back = (-dist) if config.clamp_len < 0 else (-dist).clamp(-config.clamp_len, config.clamp_len)
            R = hf_relpos.functional.sinusoidal_embedding(back.reshape(-1).to(dd), config.hidden_size)
            r = lin(R, rel.r_net).view(L, L, H, D)  # W_{k,R} R_{i-j}
            u, w = rel.r_w_bias.to(dd), rel.r_r_bias.to(dd)
            content = (q + u[None, :, None]) @ k.transpose(-1, -2)
            position = torch.einsum("bhid,ijhd->bhij", q + w[None, :, None], r)
            scores = (content + position) / math.sqrt(D)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, -1).nan_to_num(0.0)
        if attentions is not None:
            attentions.append(probs)
        out = probs @ v
        if pe == "shaw" and attn.relative.rel_v is not None:
            out = out + torch.einsum("bhij,ijd->bhid", probs, attn.relative.rel_v.to(dd)[index])
        h = h + lin(out.transpose(1, 2).reshape(B, L, -1), attn.o_proj)
        y = lin(layer.mlp.act_fn(lin(norm(h, layer.post_attention_layernorm), layer.mlp.up_proj)), layer.mlp.down_proj)
        h = h + y
    return norm(h, body.norm)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_matches_reference_forward(position_encoding, causal, impl):
    overrides = {"clamp_len": 4} if position_encoding == "transformer_xl" and causal else {}
    if position_encoding == "fire":
        overrides = {"fire_threshold": 4.0}  # rows past the threshold: FIRE's progressive normalisation
    model = build(position_encoding, cls=RelPosModel, impl=impl, is_decoder=causal, **overrides)
    B, L = 2, 11
    ids = rand_ids(B, L, seed=31)
    mask = padding_mask(B, L, "right", pads=(0, 3))
    with torch.no_grad():
        got = model(ids, attention_mask=mask, use_cache=False).last_hidden_state
        expected = reference_forward(model, ids, mask)
    assert_close_where(got.double(), expected, mask, atol=1e-4, what=f"{position_encoding} vs reference")


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_positions_matter(position_encoding):
    """Guard for the other tests: the tiny models really depend on token order."""
    model = build(position_encoding)
    ids = rand_ids(1, 12)
    with torch.no_grad():
        a = model(ids).logits[0, -1]
        shuffled = torch.cat([ids[:, :-1].flip(1), ids[:, -1:]], dim=1)
        b = model(shuffled).logits[0, -1]
    assert (a - b).abs().max() > 1e-3


# ---------------------------------------------------------------------------
# 3. KV cache == full forward; generate with and without cache
# ---------------------------------------------------------------------------

CHUNKS = [5, 3, 1, 1, 4, 1]  # prefill 5, then a chunk of 3, two single steps, a chunk of 4, one step


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_cached_chunks_match_full_forward(position_encoding, impl, padding):
    model = build(position_encoding, impl=impl)
    B, L = 3, sum(CHUNKS)
    ids = rand_ids(B, L, seed=2)
    mask = None if padding is None else padding_mask(B, L, "left", pads=(0, 2, 4))
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        cache, start = None, 0
        for size in CHUNKS:
            end = start + size
            kwargs = {} if mask is None else {"attention_mask": mask[:, :end]}
            out = model(ids[:, start:end], past_key_values=cache, use_cache=True, **kwargs)
            cache = out.past_key_values
            assert cache is not None and cache.get_seq_length() == end
            keep = torch.ones(B, size) if mask is None else mask[:, start:end]
            assert_close_where(out.logits, full[:, start:end], keep, what=f"tokens {start}:{end}")
            start = end


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_generate_with_and_without_cache(position_encoding, impl):
    model = build(position_encoding, impl=impl)
    ids = rand_ids(2, 6, seed=3)
    with_cache = greedy(model, ids, 10, use_cache=True)
    without_cache = greedy(model, ids, 10, use_cache=False)
    assert with_cache.shape == (2, 16)
    assert torch.equal(with_cache, without_cache), f"{with_cache}\n{without_cache}"
    assert torch.equal(with_cache, manual_greedy(model, ids, 10))


# configurations off the default path of each scheme
VARIANTS = {
    "txl_clamp_len": ("transformer_xl", {"clamp_len": 3}),
    "shaw_keys_only": ("shaw", {"shaw_value_embeddings": False}),
    "shaw_no_clipping": ("shaw", {"max_relative_position": 0}),
    "alibi_6_heads": ("alibi", {"hidden_size": 48, "num_attention_heads": 6}),
    "t5_long_distance": ("t5_bias", {"relative_attention_num_buckets": 6, "relative_attention_max_distance": 5}),
    "log_decay_scale": ("log_decay", {"log_decay_scale": 2.5}),
    "rope_theta": ("rope", {"rope_theta": 50.0}),
    "attention_bias": ("t5_bias", {"attention_bias": True}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_cache_and_kernels(variant):
    position_encoding, overrides = VARIANTS[variant]
    model = build(position_encoding, **overrides)
    B, L = 2, sum(CHUNKS)
    ids = rand_ids(B, L, seed=30)
    mask = padding_mask(B, L, "left", pads=(0, 3))
    with torch.no_grad():
        full = use_impl(model, "eager")(ids, attention_mask=mask, use_cache=False).logits
        full_sdpa = use_impl(model, "sdpa")(ids, attention_mask=mask, use_cache=False).logits
        assert_close_where(full_sdpa, full, mask, what="sdpa vs eager")
        cache, start = None, 0
        for size in CHUNKS:
            out = model(ids[:, start : start + size], attention_mask=mask[:, : start + size], past_key_values=cache)
            cache = out.past_key_values
            assert_close_where(out.logits, full[:, start : start + size], mask[:, start : start + size])
            start += size
    bidirectional = build(position_encoding, cls=RelPosModel, is_decoder=False, **overrides)
    with torch.no_grad():
        eager = use_impl(bidirectional, "eager")(ids, attention_mask=mask).last_hidden_state
        sdpa = use_impl(bidirectional, "sdpa")(ids, attention_mask=mask).last_hidden_state
    assert_close_where(sdpa, eager, mask, what="bidirectional sdpa vs eager")


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_save_and_load_same_logits(tmp_path, position_encoding):
    model = build(position_encoding)
    ids = rand_ids(2, 7)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is RelPosForCausalLM
    with torch.no_grad():
        assert_close(loaded(ids).logits, model(ids).logits, atol=0.0, what="reloaded model")


# ---------------------------------------------------------------------------
# 4. a decoding step computes positions for the new rows only, once per forward
# ---------------------------------------------------------------------------

BIAS_FUNCTIONS = {"t5_bias": "t5_position_bias", "log_decay": "log_decay_bias", "alibi": "alibi_bias"}


def _recorder(monkeypatch, name):
    calls = []
    original = getattr(position_schemes, name)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append({"args": args, "kwargs": kwargs, "shape": tuple(out.shape)})
        return out

    monkeypatch.setattr(position_schemes, name, wrapper)
    return calls


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", sorted(BIAS_FUNCTIONS))
def test_bias_computed_once_for_new_rows(monkeypatch, position_encoding, impl):
    model = build(position_encoding, impl=impl)
    assert model.config.num_hidden_layers > 1
    name = BIAS_FUNCTIONS[position_encoding]
    calls = _recorder(monkeypatch, name)
    # A prefill without padding (CPU, sdpa) makes the T5 bias as the per-distance table of the band
    # decomposition, and causal ALiBi as a bias per key.
    other = {"t5_bias": "t5_bias_by_distance", "alibi": "alibi_key_bias"}.get(position_encoding)
    per_distance = _recorder(monkeypatch, other) if other else []
    P = 7
    ids = rand_ids(2, P + 4, seed=4)
    with torch.no_grad():
        out = model(ids[:, :P], use_cache=True)
        made = len(calls) + len(per_distance)
        assert made == 1, f"the bias made {made} times for one forward (once per layer?)"
        assert len(per_distance) == (impl == "sdpa" and other is not None)
        cache = out.past_key_values
        for new in (1, 3):
            calls.clear()
            before = cache.get_seq_length()
            model(ids[:, before : before + new], past_key_values=cache, use_cache=True)
            assert len(calls) == 1, f"{name} called {len(calls)} times for one cached step"
            call = calls[0]
            q_len, k_len = call["args"][-2:] if name != "log_decay_bias" else call["args"][:2]
            assert q_len == new, f"{name} computed {q_len} query rows for {new} new tokens"
            assert k_len == before + new
            assert call["kwargs"].get("past_length") == before
            assert call["shape"][-2:] == (new, before + new)


@pytest.mark.parametrize("position_encoding", ["shaw", "transformer_xl"])
def test_per_layer_schemes_see_new_rows_only(monkeypatch, position_encoding):
    """Shaw and Transformer-XL attend per layer (per-layer parameters) but only for the new query rows."""
    model = build(position_encoding)
    fn = "shaw_attention" if position_encoding == "shaw" else "transformer_xl_attention"
    attn_calls = _recorder(monkeypatch, fn)
    emb_calls = _recorder(monkeypatch, "sinusoidal_embedding")
    P = 6
    ids = rand_ids(2, P + 2, seed=5)
    with torch.no_grad():
        cache = model(ids[:, :P], use_cache=True).past_key_values
        attn_calls.clear()
        emb_calls.clear()
        model(ids[:, P : P + 2], past_key_values=cache, use_cache=True)
    assert len(attn_calls) == model.config.num_hidden_layers
    for call in attn_calls:
        q, k = call["args"][0], call["args"][1]
        assert q.shape[2] == 2 and k.shape[2] == P + 2
        if position_encoding == "shaw":
            assert call["kwargs"]["past_length"] == P
    if position_encoding == "transformer_xl":
        # In inference each layer keeps W_{k,R} R_d for a range of distances that doubles when exceeded:
        # 16 more decoding steps build sinusoids at most once more per layer, never once per token.
        emb_calls.clear()
        with torch.no_grad():
            token = ids[:, -1:]
            for _ in range(16):
                out = model(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
        assert len(emb_calls) <= model.config.num_hidden_layers
        assert all(call["shape"][0] <= 2 * (P + 2 + 16) for call in emb_calls)


# ---------------------------------------------------------------------------
# 5. left padding in generate
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_left_padded_batch_generates_like_single_prompts(position_encoding):
    # relative schemes ignore absolute positions; rope and the absolute baselines get generate()'s
    # position_ids (cumsum of the attention mask), so they must match as well
    model = build(position_encoding, impl="sdpa")
    prompts = [rand_ids(1, n, seed=10 + n)[0] for n in (7, 3, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = p
        mask[b, width - len(p) :] = 1
    new = 6
    batch_out = greedy(model, ids, new, attention_mask=mask, use_cache=True, pad_token_id=0)
    for b, p in enumerate(prompts):
        alone = greedy(model, p[None], new, use_cache=True, pad_token_id=0)
        assert torch.equal(batch_out[b, width:], alone[0, len(p) :]), (
            f"row {b}: batch {batch_out[b, width:].tolist()} vs alone {alone[0, len(p):].tolist()}"
        )


# ---------------------------------------------------------------------------
# 6. beam search
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_beam_search(position_encoding):
    model = build(position_encoding)
    ids = rand_ids(2, 5, seed=6)
    with torch.no_grad():
        beams = model.generate(ids, max_new_tokens=5, do_sample=False, num_beams=3, use_cache=True)
        beams_nocache = model.generate(ids, max_new_tokens=5, do_sample=False, num_beams=3, use_cache=False)
        three = model.generate(
            ids, max_new_tokens=5, do_sample=False, num_beams=3, num_return_sequences=3, use_cache=True
        )
        one_beam = model.generate(ids, max_new_tokens=5, do_sample=False, num_beams=1)
    assert beams.shape == (2, 10)
    assert three.shape == (6, 10)
    assert torch.equal(beams[:, :5], ids)
    # the cache is reordered between beams: it must not change the result
    assert torch.equal(beams, beams_nocache)
    assert torch.equal(one_beam, manual_greedy(model, ids, 5))


# ---------------------------------------------------------------------------
# 7. StaticCache
# ---------------------------------------------------------------------------

STATIC_OK = ENCODINGS  # Transformer-XL's too: its distances count from the last query, not the last key slot


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", STATIC_OK)
def test_static_cache_generate_matches_dynamic(position_encoding, impl):
    model = build(position_encoding, impl=impl)
    ids = rand_ids(2, 6, seed=7)
    dynamic = greedy(model, ids, 8, use_cache=True)
    static = greedy(model, ids, 8, use_cache=True, cache_implementation="static")
    assert torch.equal(static, dynamic), f"static {static[:, 6:].tolist()} vs dynamic {dynamic[:, 6:].tolist()}"
    # a left-padded batch as well (generate builds the mask from the attention mask and the static cache)
    mask = padding_mask(2, 6, "left", pads=(0, 2))
    ids = ids.masked_fill(mask == 0, 0)
    dynamic = greedy(model, ids, 8, attention_mask=mask, use_cache=True)
    static = greedy(model, ids, 8, attention_mask=mask, use_cache=True, cache_implementation="static")
    assert torch.equal(static, dynamic), f"padded: static {static[:, 6:].tolist()} vs dynamic {dynamic[:, 6:].tolist()}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", STATIC_OK)
def test_static_cache_chunks_match_full_forward(position_encoding, impl):
    model = build(position_encoding, impl=impl)
    B, L = 2, sum(CHUNKS)
    ids = rand_ids(B, L, seed=8)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = StaticCache(config=model.config, max_cache_len=32)
        start = 0
        for size in CHUNKS:
            out = model(ids[:, start : start + size], past_key_values=cache, use_cache=True)
            assert_close(out.logits, full[:, start : start + size], what=f"static cache tokens {start}:{start + size}")
            start += size


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", STATIC_OK)
def test_bidirectional_static_cache_hides_unfilled_slots(position_encoding, impl):
    """A bidirectional model filling part of a StaticCache sees only the filled slots (Shaw used to attend
    the empty ones: causality hides them only in a decoder)."""
    model = build(position_encoding, cls=RelPosModel, impl=impl, is_decoder=False)
    ids = rand_ids(2, 11, seed=9)
    with torch.no_grad():
        full = model(ids, use_cache=False).last_hidden_state
        cached = model(ids, past_key_values=StaticCache(config=model.config, max_cache_len=32), use_cache=True)
    assert_close(cached.last_hidden_state, full, what="bidirectional forward into a StaticCache")


def test_transformer_xl_static_cache_with_memory_and_clamp():
    """Transformer-XL with a StaticCache also with clamped distances (clamp_len < the cache) and a memory
    window: chunked forwards into it give the full forward's logits."""
    model = build("transformer_xl", clamp_len=3, mem_len=8)
    ids = rand_ids(2, 10, seed=18)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = StaticCache(config=model.config, max_cache_len=16)
        start = 0
        for size in (4, 1, 3, 2):
            out = model(ids[:, start : start + size], past_key_values=cache, use_cache=True)
            assert_close(out.logits, full[:, start : start + size], what=f"tokens {start}:{start + size}")
            start += size


# ---------------------------------------------------------------------------
# 8. bad input: clear ValueError, cache untouched
# ---------------------------------------------------------------------------


def _prefilled(model, batch=2, length=5, seed=9):
    ids = rand_ids(batch, length, seed=seed)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return cache, cache.get_seq_length(), cache_snapshot(cache)


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_bad_token_ids(position_encoding):
    model = build(position_encoding)
    cache, length, snap = _prefilled(model)
    for bad in (VOCAB, VOCAB + 10, -1):
        ids = torch.tensor([[3, bad], [4, 5]])
        with pytest.raises(ValueError) as info, torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        message = str(info.value)
        assert "input_ids" in message and str(bad) in message and str(VOCAB) in message, message
        assert_cache_unchanged(cache, length, snap)
    with pytest.raises(ValueError, match=str(VOCAB)), torch.no_grad():
        model(torch.tensor([[VOCAB]]))  # no cache either


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_bad_attention_mask_shape(position_encoding):
    model = build(position_encoding)
    cache, length, snap = _prefilled(model)
    ids = rand_ids(2, 2, seed=11)
    for bad in (torch.ones(2, 2), torch.ones(2, length + 3), torch.ones(3, length + 2), torch.ones(2, 1, length + 2)):
        with pytest.raises(ValueError) as info, torch.no_grad():
            model(ids, attention_mask=bad, past_key_values=cache, use_cache=True)
        message = str(info.value)
        assert "attention_mask" in message and str(tuple(bad.shape)) in message and str(length + 2) in message, message
        assert_cache_unchanged(cache, length, snap)
    with pytest.raises(ValueError, match="attention_mask"), torch.no_grad():
        model(rand_ids(2, 4), attention_mask=torch.ones(2, 5))


@pytest.mark.parametrize("position_encoding", ABSOLUTE)
def test_absolute_positions_overflow(position_encoding):
    model = build(position_encoding, max_position_embeddings=16)
    with pytest.raises(ValueError) as info, torch.no_grad():
        model(rand_ids(1, 17))
    assert "max_position_embeddings" in str(info.value) and "16" in str(info.value)
    with torch.no_grad():
        model(rand_ids(1, 16))  # exactly the limit works
    cache, length, snap = _prefilled(model, batch=1, length=12)
    with pytest.raises(ValueError) as info, torch.no_grad():
        model(rand_ids(1, 5), past_key_values=cache, use_cache=True)  # 12 + 5 > 16
    assert "max_position_embeddings" in str(info.value) and "16" in str(info.value)
    assert_cache_unchanged(cache, length, snap)
    with torch.no_grad():
        out = model(rand_ids(1, 4), past_key_values=cache, use_cache=True)  # 12 + 4 == 16 works
    assert out.past_key_values.get_seq_length() == 16


@pytest.mark.parametrize(
    "other",
    [{"num_attention_heads": 2}, {"hidden_size": 48, "intermediate_size": 96}, {"num_hidden_layers": 3},
     {"num_hidden_layers": 1}],
    ids=["heads", "hidden", "more_layers", "fewer_layers"],
)
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_cache_from_other_configuration(position_encoding, other):
    model = build(position_encoding)
    other_model = build(position_encoding, **other)
    cache, length, snap = _prefilled(other_model)
    with pytest.raises(ValueError) as info, torch.no_grad():
        model(rand_ids(2, 1), past_key_values=cache, use_cache=True)
    assert "past_key_values" in str(info.value), str(info.value)
    assert_cache_unchanged(cache, length, snap)


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_user_created_dynamic_cache(position_encoding):
    model = build(position_encoding)
    ids = rand_ids(2, 8, seed=18)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        for cache in (DynamicCache(), DynamicCache(config=model.config)):
            first = model(ids[:, :5], past_key_values=cache, use_cache=True)
            assert first.past_key_values is cache and cache.get_seq_length() == 5
            second = model(ids[:, 5:], past_key_values=cache, use_cache=True)
            assert_close(second.logits, full[:, 5:])


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_cache_with_other_batch_size(position_encoding):
    model = build(position_encoding)
    cache, length, snap = _prefilled(model, batch=2)
    with pytest.raises(ValueError, match="past_key_values"), torch.no_grad():
        model(rand_ids(3, 1), past_key_values=cache, use_cache=True)
    assert_cache_unchanged(cache, length, snap)


def test_unsupported_attn_implementation(tmp_path):
    model = build("t5_bias")
    cache, length, snap = _prefilled(model)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError) as info, torch.no_grad():
        model(rand_ids(2, 1), past_key_values=cache, use_cache=True)
    assert "flash_attention_2" in str(info.value) and "sdpa" in str(info.value) and "eager" in str(info.value)
    assert_cache_unchanged(cache, length, snap)

    model.config._attn_implementation = "eager"
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="(?i)flex"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="(?i)flash"):
        RelPosForCausalLM.from_pretrained(tmp_path, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="(?i)flex"):
        model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="(?i)flex"):
        AutoModelForCausalLM.from_config(tiny_config("shaw"), attn_implementation="flex_attention")
    # Transformers accepts the paged eager kernel at load time; the first forward must refuse it clearly
    paged = RelPosForCausalLM.from_pretrained(tmp_path, attn_implementation="paged|eager")
    with pytest.raises(ValueError, match=r"paged\|eager"), torch.no_grad():
        paged(rand_ids(1, 3))
    # the model still works afterwards
    with torch.no_grad():
        model(rand_ids(2, 3))


# ---------------------------------------------------------------------------
# 9. fully padded rows and ignored labels
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_fully_padded_row_is_finite(position_encoding, impl):
    model = build(position_encoding, impl=impl)
    ids = rand_ids(3, 9, seed=12)
    mask = torch.ones_like(ids)
    mask[1] = 0
    mask[2, :4] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    model.train()  # dropout is 0: train mode only enables gradients paths
    out = model(ids, attention_mask=mask, labels=labels)
    assert torch.isfinite(out.logits).all(), "non-finite logits with a fully padded row"
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"non-finite gradient in {name}"
    model.eval()
    with torch.no_grad():
        # the unpadded row is unaffected by its neighbours
        alone = model(ids[:1]).logits
        assert_close(model(ids, attention_mask=mask).logits[:1], alone, what="row 0 in a padded batch")
        ignored = model(ids, attention_mask=mask, labels=torch.full_like(ids, -100)).loss
        assert torch.isfinite(ignored), "labels all -100 must give a finite loss"
    # the bidirectional body as well
    body = build(position_encoding, cls=RelPosModel, impl=impl, is_decoder=False)
    with torch.no_grad():
        hidden = body(ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(hidden).all()


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_all_ignored_labels_backward(position_encoding):
    model = build(position_encoding).train()
    ids = rand_ids(2, 6)
    out = model(ids, labels=torch.full_like(ids, -100))
    assert torch.isfinite(out.loss) and out.loss.item() == 0.0
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name


# ---------------------------------------------------------------------------
# 10. sequence classification
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_sequence_classification_padding(position_encoding, causal, impl):
    model = build(position_encoding, cls=RelPosForSequenceClassification, impl=impl, is_decoder=causal, num_labels=3)
    seqs = [rand_ids(1, n, seed=20 + n)[0] for n in (8, 5, 3)]
    width = 10
    sides = ("right", "left") if position_encoding in RELATIVE + ("rope",) else ("right",)
    with torch.no_grad():
        alone = torch.cat([model(s[None]).logits for s in seqs])
        for side in sides:
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, s in enumerate(seqs):
                sl = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
                ids[b, sl] = s
                mask[b, sl] = 1
            padded = model(ids, attention_mask=mask).logits
            assert padded.shape == (3, 3)
            assert_close(padded, alone, what=f"{side}-padded vs unpadded")
    # training: finite loss, gradients reach the body
    model.train()
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
        mask[b, : len(s)] = 1
    out = model(ids, attention_mask=mask, labels=torch.tensor([0, 2, 1]))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.score.weight.grad is not None and model.score.weight.grad.abs().sum() > 0
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------
# 11. T5's bias table lives once
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [RelPosForCausalLM, RelPosModel, RelPosForSequenceClassification])
def test_t5_table_lives_once(cls):
    model = build("t5_bias", cls=cls).train()
    named = [(n, p) for n, p in model.named_parameters() if "relative_attention_bias" in n]
    assert len(named) == 1, [n for n, _ in named]
    name, table = named[0]
    assert tuple(table.shape) == (model.config.relative_attention_num_buckets, model.config.num_attention_heads)
    ids = rand_ids(2, 12)
    out = model(ids)
    target = out.logits if hasattr(out, "logits") else out.last_hidden_state
    (target.float() ** 2).mean().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0, f"no gradient reached {name}"


# ---------------------------------------------------------------------------
# 12. activation checkpointing
# ---------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*checkpointing.*:FutureWarning")
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_gradient_checkpointing_same_gradients(position_encoding, use_reentrant):
    model = build(position_encoding).train()
    assert model.config.hidden_dropout == 0 and model.config.attention_dropout == 0
    ids = rand_ids(2, 9, seed=13)
    mask = padding_mask(2, 9, "left", pads=(0, 3))
    labels = ids.masked_fill(mask == 0, -100)

    def grads():
        model.zero_grad(set_to_none=True)
        calls = []
        # a pre-hook: torch's non-reentrant checkpoint stops recomputing once the last saved tensor is rebuilt,
        # so a post-forward hook on the layer's last op may never fire during the recompute
        hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
        try:
            loss = model(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
        finally:
            hook.remove()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, len(calls)

    loss0, plain, calls0 = grads()
    # Reentrant checkpointing carries gradients only for tensors passed positionally: T5's shared bias
    # (computed once, outside the layers) must be one of them, or its table's graph is run twice.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert model.is_gradient_checkpointing
    loss1, ckpt, calls1 = grads()
    model.gradient_checkpointing_disable()
    assert calls0 == 1 and calls1 == 2, f"layer forward ran {calls1} times with checkpointing (expected a recompute)"
    assert torch.allclose(loss0, loss1, atol=1e-6)
    assert plain.keys() == ckpt.keys()
    for name in plain:
        assert torch.allclose(plain[name], ckpt[name], atol=1e-6), name


# ---------------------------------------------------------------------------
# 13. torch.compile
# ---------------------------------------------------------------------------

COMPILE_SCHEMES = ("t5_bias", "shaw", "transformer_xl", "rope")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler")
@pytest.mark.parametrize("position_encoding", COMPILE_SCHEMES)
def test_torch_compile_matches_eager(position_encoding):
    import torch._dynamo

    torch._dynamo.reset()
    model = build(position_encoding, impl="sdpa")
    ids = rand_ids(2, 8, seed=14)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        compiled = torch.compile(model)
        got = compiled(ids, use_cache=False).logits
    assert_close(got, expected, what="compiled vs eager")


def _compile_config(backend: str):
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, backend=backend, mode=None if backend == "eager" else "default")
    config._compile_all_devices = True  # generate compiles only on accelerators unless told otherwise
    return config


@pytest.mark.parametrize("position_encoding", STATIC_OK)
def test_compiled_decode_step_is_one_graph_with_eager_logits(position_encoding):
    """A decode step into a StaticCache traces whole (fullgraph=True; a recording backend checks the tracing
    without inductor's compile time), its logits equal eager's at every step of a padded batch,
    and later steps reuse the first step's graph (the cache's offset is a tensor, not a guarded int)."""
    import torch._dynamo

    torch._dynamo.reset()
    model = build(position_encoding, impl="sdpa")
    B, L, steps, slots = 2, 7, 3, 16
    ids = rand_ids(B, L, seed=15)
    keep = torch.zeros(B, slots, dtype=torch.bool)
    keep[:, : L + steps] = True
    keep[1, :2] = False  # row 1 left-padded

    def mask_for(start, length):  # [B, 1, Q, slots], as generate builds for a static cache
        i = torch.arange(start, start + length)[:, None]
        return (keep[:, None, None, :] & (torch.arange(slots)[None, :] <= i))

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = torch.compile(
        lambda x, m, c: model(x, attention_mask=m, past_key_values=c, use_cache=True).logits,
        fullgraph=True, backend=record,
    )
    with torch.no_grad():
        caches = [StaticCache(config=model.config, max_cache_len=slots) for _ in range(2)]
        prefill = [model(ids, attention_mask=mask_for(0, L), past_key_values=c, use_cache=True).logits for c in caches]
        token = prefill[0][:, -1:].argmax(-1)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for t in range(steps):
                mask = mask_for(L + t, 1)
                expected = model(token, attention_mask=mask, past_key_values=caches[0], use_cache=True).logits
                got = step(token, mask, caches[1])
                assert_close(got, expected, what=f"compiled decode step {t}")
                token = expected[:, -1:].argmax(-1)
    # One graph, and no host read of the cache's offset in it (CUDA graphs, generate's default, cannot hold one).
    assert len(graphs) == 1
    calls = [str(node.target) for node in graphs[0].graph.nodes]
    assert not [c for c in calls if c == "item" or "local_scalar_dense" in c], calls


@pytest.mark.parametrize("position_encoding", STATIC_OK)
def test_compiled_generate_gives_eager_tokens(position_encoding):
    """generate with a static cache and a fullgraph compile config gives the eager (dynamic cache) greedy
    tokens, left padding included."""
    import torch._dynamo

    torch._dynamo.reset()
    model = build(position_encoding, impl="sdpa")
    mask = padding_mask(2, 6, "left", pads=(0, 2))
    ids = rand_ids(2, 6, seed=16).masked_fill(mask == 0, 0)
    expected = greedy(model, ids, 8, attention_mask=mask, pad_token_id=0)
    got = greedy(model, ids, 8, attention_mask=mask, pad_token_id=0, cache_implementation="static",
                 compile_config=_compile_config("eager"))
    assert torch.equal(got, expected), f"compiled {got[:, 6:].tolist()} vs eager {expected[:, 6:].tolist()}"


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler")
def test_inductor_compiled_generate_gives_eager_tokens():
    """The same through inductor (generated code, not just tracing), for T5's bias: its traced offset takes
    the per-[Q, K] bucket path of t5_position_bias."""
    import torch._dynamo

    torch._dynamo.reset()
    model = build("t5_bias", impl="sdpa")
    ids = rand_ids(2, 6, seed=17)
    expected = greedy(model, ids, 6)
    got = greedy(model, ids, 6, cache_implementation="static", compile_config=_compile_config("inductor"))
    assert torch.equal(got, expected), f"inductor {got[:, 6:].tolist()} vs eager {expected[:, 6:].tolist()}"


# ---------------------------------------------------------------------------
# 14. Transformer-XL memory
# ---------------------------------------------------------------------------


def test_transformer_xl_mems_shapes():
    mem_len = 6
    model = build("transformer_xl", cls=RelPosForCausalLM, mem_len=mem_len).train()
    ids = rand_ids(2, 4)
    out = model(ids, use_cache=False)
    assert isinstance(out.mems, list) and len(out.mems) == model.config.num_hidden_layers
    for mem in out.mems:
        assert mem.shape == (2, 4, 32) and not mem.requires_grad and mem.grad_fn is None
    out2 = model(rand_ids(2, 5, seed=3), mems=out.mems, use_cache=False)
    for mem in out2.mems:
        assert mem.shape == (2, mem_len, 32) and not mem.requires_grad
    out2.logits.sum().backward()  # the memory is cut from the graph: no error from reused graph
    # models without memory return no mems
    assert build("transformer_xl")(ids).mems is None
    assert build("t5_bias")(ids).mems is None


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("impl", IMPLS)
def test_transformer_xl_segments_match_full_pass(impl, padding):
    segments = (4, 3, 5)
    total = sum(segments)
    model = build("transformer_xl", cls=RelPosModel, impl=impl, mem_len=total)
    ids = rand_ids(2, total, seed=15)
    # the mask of a segment covers its memory too: [batch, mem + len]
    mask = torch.ones(2, total, dtype=torch.long) if padding is None else padding_mask(2, total, "left", pads=(0, 5))
    with torch.no_grad():
        full = model(ids, attention_mask=None if padding is None else mask, use_cache=False).last_hidden_state
        mems, start = None, 0
        for size in segments:
            kwargs = {} if padding is None else {"attention_mask": mask[:, : start + size]}
            out = model(ids[:, start : start + size], mems=mems, use_cache=False, **kwargs)
            assert_close_where(
                out.last_hidden_state, full[:, start : start + size], mask[:, start : start + size],
                what=f"segment {start}:{start + size}",
            )
            mems = out.mems
            start += size
        assert mems[0].shape == (2, total, 32)


@pytest.mark.parametrize("impl", IMPLS)
def test_transformer_xl_memory_window(impl):
    """With mem_len < total, segment i sees exactly the last mem_len positions of each layer's input."""
    model = build("transformer_xl", cls=RelPosModel, impl=impl, mem_len=4)
    ids = rand_ids(1, 9, seed=16)
    with torch.no_grad():
        first = model(ids[:, :5], use_cache=False)
        second = model(ids[:, 5:], mems=first.mems, use_cache=False)
        # the same, computed with an explicit 4-token prefix as memory by a model with a long memory
        long_model = build("transformer_xl", cls=RelPosModel, impl=impl, mem_len=32)
        long_model.load_state_dict(model.state_dict())
        states = long_model(ids[:, :5], use_cache=False, output_hidden_states=True).hidden_states
        mems = [h[:, -4:] for h in states[:-1]]
        expected = long_model(ids[:, 5:], mems=mems, use_cache=False).last_hidden_state
    for mem, h in zip(first.mems, states[:-1]):
        assert_close(mem, h[:, -4:], what="memory = last mem_len layer inputs")
    assert_close(second.last_hidden_state, expected)


def test_transformer_xl_bad_mems():
    model = build("transformer_xl", cls=RelPosForCausalLM, mem_len=6)
    ids = rand_ids(2, 3)
    with torch.no_grad():
        good = model(ids, use_cache=False).mems
    bad_cases = {
        "batch": [m[:1] for m in good],
        "hidden": [torch.zeros(2, 3, 16) for _ in good],
        "length": [torch.zeros(2, 7, 32) for _ in good],
        "layers": good[:1],
        "ragged": [torch.zeros(2, 3, 32), torch.zeros(2, 2, 32)],
        "dims": [torch.zeros(3, 32) for _ in good],
    }
    for name, mems in bad_cases.items():
        with pytest.raises(ValueError, match="mems"), torch.no_grad():
            model(ids, mems=mems, use_cache=False)
    other = build("t5_bias")
    with pytest.raises(ValueError, match="mems"), torch.no_grad():
        other(ids, mems=good, use_cache=False)


def test_transformer_xl_with_memory_generates_like_without_cache():
    model = build("transformer_xl", mem_len=4)
    ids = rand_ids(2, 6, seed=17)
    cached = greedy(model, ids, 8, use_cache=True)
    assert torch.equal(cached, greedy(model, ids, 8, use_cache=False))
    assert torch.equal(cached, manual_greedy(model, ids, 8))


# ---------------------------------------------------------------------------
# other inputs and dtypes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_inputs_embeds_match_input_ids(position_encoding):
    model = build(position_encoding)
    ids = rand_ids(2, 9)
    mask = padding_mask(2, 9, "left")
    with torch.no_grad():
        from_ids = model(ids, attention_mask=mask).logits
        from_embeds = model(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask).logits
    assert_close(from_embeds, from_ids, atol=0.0)
    with pytest.raises(ValueError):
        model(ids, inputs_embeds=model.get_input_embeddings()(ids))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_bfloat16_with_padding(position_encoding, impl):
    model = build(position_encoding, impl=impl)
    half = build(position_encoding, impl=impl).to(torch.bfloat16)
    ids = rand_ids(3, 9)
    mask = padding_mask(3, 9, "left")
    mask[2] = 0  # a fully padded row too
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        low = half(ids, attention_mask=mask).logits
    assert low.dtype == torch.bfloat16
    assert torch.isfinite(low).all()
    # bf16 keeps ~3 significant digits; logits here are O(5)
    assert_close_where(low.float(), reference, mask, atol=0.5, what="bf16 vs fp32")


@pytest.mark.parametrize("fused", [False, True])
def test_transformer_xl_projection_cache_follows_optimizer_steps(fused):
    """Inference keeps W_{k,R} R_d per layer; a training step (fused AdamW does not bump parameter
    versions) must not leave stale projections behind."""
    torch.manual_seed(0)
    model = build("transformer_xl")
    ids = rand_ids(2, 8, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    model.eval()
    with torch.no_grad():
        model(ids)  # fills the cache
    model.train()
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        cached = model(ids).logits
    fresh = type(model)(model.config).eval()
    fresh.load_state_dict(model.state_dict())
    fresh.config._attn_implementation = model.config._attn_implementation
    with torch.no_grad():
        torch.testing.assert_close(cached, fresh(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("position_encoding,tensor,expected", [
    # upstream T5 (factor 1): the bucket table at d_model**-0.5, not initializer_range
    ("t5_bias", lambda m: m.model.position.relative_attention_bias.weight, 64**-0.5),
    # Vaswani et al. (tensor2tensor): token embeddings at d_model**-0.5, multiplied by sqrt(d_model) in embed()
    ("sinusoidal", lambda m: m.model.embed_tokens.weight, 64**-0.5),
    # GPT-2: the position table at half the token embeddings' std
    ("learned", lambda m: m.model.position.position_embeddings.weight, 0.01),
    ("rope", lambda m: m.model.embed_tokens.weight, 0.02),  # no recipe of its own: initializer_range
], ids=["t5_bias", "sinusoidal", "learned", "rope"])
def test_each_scheme_starts_from_its_papers_initialisation(position_encoding, tensor, expected):
    """Each baseline's recipe (issue 14's 1x gap): a table initialised far from its paper's scale trains
    slower than the others within the comparison's budget."""
    model = build(position_encoding, hidden_size=64, relative_attention_num_buckets=256,
                  relative_attention_max_distance=512, max_position_embeddings=256, initializer_range=0.02)
    std = tensor(model).std().item()
    assert abs(std - expected) < 0.15 * expected, (std, expected)


def test_fire_normalises_by_the_querys_position_in_its_sequence():
    """FIRE's normaliser psi(max(L, p_i)) depends on the query's position p_i, not its index among the keys:
    with a small threshold L, cached decoding through a sliding window, a left-padded row and a packed
    document each give what the plain sequence gives (a bug fixed here: p_i was the index among the kept keys)."""
    model = build("fire", fire_threshold=2.0, sliding_window=4, impl="sdpa")
    with torch.no_grad():
        for linear in (model.model.position.mlp[0], model.model.position.mlp[2]):
            linear.weight.mul_(4.0)  # a bias large enough that a wrong normaliser shows
    ids = rand_ids(1, 12, seed=41)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        for t in range(12):
            step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
            assert_close(step[:, 0], full[:, t], atol=1e-4, what=f"sliding-window cached step {t}")
    plain = build("fire", fire_threshold=2.0, impl="sdpa")
    plain.load_state_dict(model.state_dict())
    ids = rand_ids(1, 9, seed=42)
    with torch.no_grad():
        alone = plain(ids, use_cache=False).logits
        padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
        mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # as generate passes them for left padding
        got = plain(padded, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, 3:]
        assert_close(got, alone, atol=1e-4, what="left-padded row vs alone")
        other = rand_ids(1, 5, seed=43)
        packed = torch.cat([other, ids], dim=1)
        packed_positions = torch.cat([torch.arange(5), torch.arange(9)])[None]
        got = plain(packed, position_ids=packed_positions, use_cache=False).logits[:, 5:]
        assert_close(got, alone, atol=1e-4, what="packed document vs alone")


def test_fire_mlp_starts_alive_and_kerple_recovers_below_its_floor():
    """FIRE's MLP keeps PyTorch's default Linear initialisation (non-zero first-layer biases), so that units with
    a negative input weight are not dead from the start (the MLP's input is >= 0); KERPLE's r1, r2 are clamped in
    value but keep a gradient below the floor, so a head initialised there can recover."""
    fire = build("fire", initializer_range=0.02).model.position
    first = fire.mlp[0]
    assert first.bias.abs().min() > 0 and (first.bias > 0).any() and (first.bias < 0).any()
    assert first.weight.abs().max() <= 1.0 and first.weight.std() > 0.3  # U(-1, 1) for fan_in 1, not N(0, 0.02)
    x = torch.linspace(0, 1, 50)[:, None]
    alive = (first(x) > 0).any(dim=0)
    assert alive.float().mean() > 0.5, f"{int((~alive).sum())} of {alive.numel()} FIRE units dead on [0, 1]"

    model = build("kerple_log")
    kerple = model.model.position
    with torch.no_grad():
        kerple.r1.fill_(0.005)
        kerple.r2.fill_(0.002)
    model(rand_ids(1, 6), labels=rand_ids(1, 6)).loss.backward()
    assert (kerple.r1.grad != 0).all() and (kerple.r2.grad != 0).all()
