"""Tests for ``RelPosConfig`` (hf_relpos/configuration_relpos.py): validation, round trips and fuzzing.

1. Each invalid value raises ValueError naming the field and the value (also from a dict, a JSON file and on save
   after a field was set), every scheme is accepted, and every field survives ``to_dict`` / ``save_pretrained`` /
   ``AutoConfig``.
2. Property-based fuzzing (hypothesis): construction either succeeds or raises ``ValueError`` whose message holds
   ``RelPosConfig.<field>``; an independent oracle (``config_faults``) says which fields are invalid, written from
   the README / api-contract, not from the implementation. Settings and helpers: strategies.py.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import CAUSAL_ONLY, COUNTS, chance, fuzz_settings
import tiny
from tiny import VOCAB
from transformers import AutoConfig

from hf_relpos import POSITION_ENCODINGS, RelPosConfig
from hf_relpos.configuration_relpos import HIDDEN_ACTS


def modeling_config(position_encoding: str, **overrides) -> RelPosConfig:
    """The "modeling" preset of tiny.py (vocab 61, 8 buckets): the sizes these tests were written with."""
    return tiny.tiny_config(position_encoding, preset="modeling", **overrides)


# ---------------------------------------------------------------------------
# 1. validation and round trip
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
        modeling_config(overrides.pop("position_encoding", "t5_bias"), skip_causal_only=False, **overrides)
    message = str(info.value)
    assert field in message, f"message does not name the field {field!r}: {message}"
    assert value in message, f"message does not name the given value {value!r}: {message}"


def test_config_rejects_invalid_values_from_dict_and_json(tmp_path):
    good = modeling_config("transformer_xl", mem_len=8)
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
    config = modeling_config("t5_bias")
    setattr(config, field, value)
    with pytest.raises(ValueError, match=f"RelPosConfig.{field} must be"):
        config.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_config_accepts_every_scheme(tiny_config, scheme):  # conftest fixtures: the builder, every scheme
    config = tiny_config(scheme, preset="modeling")
    assert config.position_encoding == scheme
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
    cutoffs=[20, 50],
    div_val=2,
    embedding_size=32,
    tie_projs=[True, False, True],
    norm_type="layer_norm",
    norm_position="post",
    final_norm=False,
    mlp_bias=False,
    dropout_placement="transfo_xl",
    same_length=True,
    ext_len=2,
)
# An encoder-decoder refuses Transformer-XL's memory, adaptive clusters and post-norm: its round trip takes the
# T5 bias and those fields' defaults.
SEQ2SEQ_FIELDS = dict(
    NON_DEFAULT_FIELDS, is_encoder_decoder=True, position_encoding="t5_bias", mem_len=0, cutoffs=None, div_val=1,
    embedding_size=None, tie_projs=None, norm_position="pre", dropout_placement="t5", same_length=False, ext_len=0,
    attention_scale=1.0,  # T5's (Transformer-XL, the decoder's scheme above, refuses the field)
    relative_attention_per_layer=True,  # UMT5's (the T5 bias only)
    initialization="t5",
)


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


# ---------------------------------------------------------------------------------------------------
# 2. fuzzing: every field, valid and invalid
# ---------------------------------------------------------------------------------------------------

POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "max_position_embeddings", "fire_mlp_width")
BOOLS = ("is_decoder", "shaw_value_embeddings", "attention_bias", "use_cache", "tie_word_embeddings",
         "is_encoder_decoder", "scale_decoder_outputs", "final_norm", "same_length", "relative_attention_per_layer")
# Fields whose None means "derived from the others" (the README): the config holds the derived value.
DERIVED = ("head_dim", "num_decoder_layers", "decoder_start_token_id")
POSITIVE_FLOATS = ("log_decay_scale", "fire_threshold", "rope_theta", "rms_norm_eps", "initializer_range")
PROBABILITIES = ("hidden_dropout", "attention_dropout")
NOT_VALUES = ["x", None, [], float("nan"), float("inf"), -1, 0, 1.5, True, False, 10**6]

# The valid values each field is drawn from (small model sizes so that nothing is expensive).
VALID = {
    "vocab_size": st.integers(1, 400),
    "hidden_size": st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64]),
    "intermediate_size": st.integers(1, 64),
    "num_hidden_layers": st.integers(1, 4),
    "num_attention_heads": st.sampled_from([1, 2, 3, 4, 8]),
    "max_position_embeddings": st.integers(1, 4096),
    "hidden_act": st.sampled_from(HIDDEN_ACTS),
    "position_encoding": st.sampled_from(POSITION_ENCODINGS),
    "relative_attention_num_buckets": st.integers(2, 64),
    "relative_attention_max_distance": st.integers(1, 256),
    "max_relative_position": st.integers(0, 64),
    "mem_len": st.integers(0, 64),
    "clamp_len": st.one_of(st.just(-1), st.integers(1, 64)),
    "log_decay_scale": st.floats(1e-6, 1e3),
    "fire_mlp_width": st.integers(1, 64),
    "fire_threshold": st.floats(1e-3, 1e4),
    "rope_theta": st.floats(1.0, 1e6),
    "rms_norm_eps": st.floats(1e-12, 1e-1),
    "initializer_range": st.floats(1e-4, 1.0),
    "attention_scale": st.one_of(st.none(), st.floats(1e-3, 10.0)),
    "hidden_dropout": st.floats(0.0, 0.99),
    "attention_dropout": st.floats(0.0, 0.99),
    **{name: st.booleans() for name in BOOLS},
    "pad_token_id": st.one_of(st.none(), st.integers(0, 5)),
    "decoder_start_token_id": st.one_of(st.none(), st.integers(0, 5)),
    "num_decoder_layers": st.one_of(st.none(), st.integers(1, 4)),
    "head_dim": st.one_of(st.none(), st.integers(1, 16)),
    "feed_forward_proj": st.sampled_from([None, *HIDDEN_ACTS, *(f"gated-{a}" for a in HIDDEN_ACTS)]),
    "bos_token_id": st.one_of(st.none(), st.integers(0, 5)),
    "eos_token_id": st.one_of(st.none(), st.integers(0, 5), st.lists(st.integers(0, 5), min_size=1, max_size=3)),
    "cutoffs": st.one_of(st.none(), st.lists(st.integers(1, 80), max_size=3)),
    "div_val": st.integers(1, 4),
    "embedding_size": st.one_of(st.none(), st.integers(1, 64)),
    "tie_projs": st.one_of(st.none(), st.lists(st.booleans(), max_size=4)),
    "norm_type": st.sampled_from(["rms_norm", "layer_norm"]),
    "norm_position": st.sampled_from(["pre", "post"]),
    "mlp_bias": st.one_of(st.none(), st.booleans()),
    "dropout_placement": st.sampled_from([None, "residual", "t5", "transfo_xl"]),
    "initialization": st.sampled_from(["default", "t5", "xavier", None]),
    "ext_len": st.integers(0, 8),
}
FIELDS = tuple(RelPosConfig.__annotations__)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _token_ok(v, vocab) -> bool:
    return v is None or (_is_int(v) and (not _is_int(vocab) or 0 <= v < vocab))


def config_faults(v: dict) -> set:
    """Fields whose value is invalid (given the others), from the README / contract, independent of the code."""
    bad = set()
    if v["position_encoding"] not in POSITION_ENCODINGS:
        bad.add("position_encoding")
    for name in POSITIVE_INTS:
        if not (_is_int(v[name]) and v[name] >= 1):
            bad.add(name)
    head_dim = v["head_dim"]
    if head_dim is not None and not (_is_int(head_dim) and head_dim >= 1):
        bad.add("head_dim")
    elif head_dim is None and not bad & {"hidden_size", "num_attention_heads"}:
        if v["hidden_size"] % v["num_attention_heads"]:
            bad.add("hidden_size")
        else:
            head_dim = v["hidden_size"] // v["num_attention_heads"]
    if _is_int(head_dim) and v["position_encoding"] == "rope" and head_dim % 2:
        bad.add("head_dim")
    if v["num_decoder_layers"] is not None and not (_is_int(v["num_decoder_layers"]) and v["num_decoder_layers"] >= 1):
        bad.add("num_decoder_layers")
    acts = [a for a in HIDDEN_ACTS]
    if v["feed_forward_proj"] is not None and v["feed_forward_proj"] not in acts + [f"gated-{a}" for a in acts]:
        bad.add("feed_forward_proj")
    if v["is_encoder_decoder"] is True:  # the README: what an encoder-decoder needs
        if v["position_encoding"] in CAUSAL_ONLY:
            bad.add("position_encoding")
        if _is_int(v["mem_len"]) and v["mem_len"] > 0:
            bad.add("mem_len")
    if "hidden_size" not in bad and v["position_encoding"] in ("sinusoidal", "transformer_xl") and v["hidden_size"] % 2:
        bad.add("hidden_size")
    if v["hidden_act"] not in HIDDEN_ACTS:
        bad.add("hidden_act")
    if v["position_encoding"] in CAUSAL_ONLY and v["is_decoder"] is not True:
        bad.add("is_decoder")
    for name in BOOLS:
        if not isinstance(v[name], bool):
            bad.add(name)
    nb, md = v["relative_attention_num_buckets"], v["relative_attention_max_distance"]
    if not (_is_int(nb) and nb >= 2):
        bad.add("relative_attention_num_buckets")
    elif "is_decoder" not in bad and "is_encoder_decoder" not in bad:
        one_side = nb if v["is_decoder"] and not v["is_encoder_decoder"] else nb // 2
        if one_side // 2 < 1:
            bad.add("relative_attention_num_buckets")
        elif not (_is_int(md) and md > one_side // 2):
            bad.add("relative_attention_max_distance")
    if not _is_int(md):
        bad.add("relative_attention_max_distance")
    for name in ("max_relative_position", "mem_len"):
        if not (_is_int(v[name]) and v[name] >= 0):
            bad.add(name)
    bad |= adaptive_and_norm_faults(v)
    if "mem_len" not in bad and v["mem_len"] > 0 and v["position_encoding"] != "transformer_xl":
        bad.add("mem_len")
    if not (_is_int(v["clamp_len"]) and (v["clamp_len"] == -1 or v["clamp_len"] >= 1)):
        bad.add("clamp_len")
    for name in POSITIVE_FLOATS:
        if not (_is_real(v[name]) and math.isfinite(v[name]) and v[name] > 0):
            bad.add(name)
    for name in PROBABILITIES:
        if not (_is_real(v[name]) and 0.0 <= v[name] < 1.0):
            bad.add(name)
    if v["relative_attention_per_layer"] is True and v["position_encoding"] != "t5_bias":
        bad.add("relative_attention_per_layer")
    scale = v["attention_scale"]  # None (1/sqrt(head_dim)) or a finite float > 0; Shaw and Transformer-XL: None only
    if scale is not None and (not (_is_real(scale) and math.isfinite(scale) and scale > 0)
                              or v["position_encoding"] in ("shaw", "transformer_xl")):
        bad.add("attention_scale")
    for name in ("pad_token_id", "bos_token_id", "decoder_start_token_id"):
        if not _token_ok(v[name], v["vocab_size"]):
            bad.add(name)
    eos = v["eos_token_id"]
    if not (_token_ok(eos, v["vocab_size"]) or (isinstance(eos, list) and eos and all(
            _is_int(e) and _token_ok(e, v["vocab_size"]) for e in eos))):
        bad.add("eos_token_id")
    return bad


def adaptive_and_norm_faults(v: dict) -> set:
    """The released Transformer-XL's options (the config's docstring): adaptive clusters inside the vocabulary, each
    with a vector; their sizes and ties only with clusters; same_length and ext_len only with memory; post-norm and
    clusters not in an encoder-decoder; the R dropout only for Transformer-XL."""
    bad = set()
    cutoffs = v["cutoffs"]
    listed = isinstance(cutoffs, list) and all(_is_int(c) and c >= 1 for c in cutoffs)
    if cutoffs is not None and not listed:
        bad.add("cutoffs")
    if not (_is_int(v["div_val"]) and v["div_val"] >= 1):
        bad.add("div_val")
    size = v["embedding_size"]
    if size is not None and not (_is_int(size) and size >= 1):
        bad.add("embedding_size")
    ties = v["tie_projs"]
    if ties is not None and not (isinstance(ties, list) and all(isinstance(t, bool) for t in ties)):
        bad.add("tie_projs")
    if cutoffs is None:
        bad |= {name for name, default in (("div_val", 1), ("embedding_size", None), ("tie_projs", None))
                if v[name] != default}
    elif listed:
        vocab = v["vocab_size"]
        if sorted(set(cutoffs)) != cutoffs or (cutoffs and _is_int(vocab) and cutoffs[-1] >= vocab):
            bad.add("cutoffs")
        if v["is_encoder_decoder"] is True or v["position_encoding"] == "sinusoidal":
            bad.add("cutoffs")
        largest = size if size is not None else v["hidden_size"]
        if not bad & {"div_val", "embedding_size", "hidden_size"} and _is_int(largest):
            if largest // v["div_val"] ** len(cutoffs) < 1:
                bad.add("div_val")
        if isinstance(ties, list) and len(ties) != len(cutoffs) + 1:
            bad.add("tie_projs")
    if v["norm_type"] not in ("rms_norm", "layer_norm"):
        bad.add("norm_type")
    if v["norm_position"] not in ("pre", "post"):
        bad.add("norm_position")
    elif v["norm_position"] == "post" and v["is_encoder_decoder"] is True:
        bad.add("norm_position")
    if v["mlp_bias"] is not None and not isinstance(v["mlp_bias"], bool):
        bad.add("mlp_bias")
    if v["initialization"] not in ("default", "t5"):
        bad.add("initialization")
    if v["dropout_placement"] not in (None, "residual", "t5", "transfo_xl"):
        bad.add("dropout_placement")
    elif v["dropout_placement"] == "transfo_xl" and v["position_encoding"] != "transformer_xl":
        bad.add("dropout_placement")
    memory = v["position_encoding"] == "transformer_xl" and _is_int(v["mem_len"]) and v["mem_len"] > 0
    if not (_is_int(v["ext_len"]) and v["ext_len"] >= 0) or (v["ext_len"] != 0 and not memory):
        bad.add("ext_len")
    if v["same_length"] is True and not memory:
        bad.add("same_length")
    return bad


# A field blamed by the code may be one that a cross-field check ties to the invalid one.
RELATED = {
    "hidden_size": {"num_attention_heads", "position_encoding"},
    "num_attention_heads": {"hidden_size"},
    "position_encoding": {"hidden_size", "mem_len", "is_decoder", "head_dim", "is_encoder_decoder"},
    "head_dim": {"hidden_size", "num_attention_heads", "position_encoding"},
    "is_encoder_decoder": {"position_encoding", "mem_len", "relative_attention_num_buckets"},
    "relative_attention_num_buckets": {"is_decoder", "relative_attention_max_distance", "is_encoder_decoder"},
    "relative_attention_max_distance": {"relative_attention_num_buckets", "is_decoder"},
    "is_decoder": {"relative_attention_num_buckets", "relative_attention_max_distance", "position_encoding"},
    "mem_len": {"position_encoding", "is_encoder_decoder", "same_length", "ext_len"},
    "same_length": {"position_encoding", "mem_len"},
    "ext_len": {"position_encoding", "mem_len"},
    "cutoffs": {"vocab_size", "is_encoder_decoder", "div_val", "embedding_size", "tie_projs", "position_encoding"},
    "div_val": {"cutoffs", "embedding_size", "hidden_size"},
    "embedding_size": {"cutoffs", "div_val"},
    "tie_projs": {"cutoffs"},
    "norm_position": {"is_encoder_decoder"},
    "dropout_placement": {"position_encoding"},
    "vocab_size": {"pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "cutoffs"},
    "decoder_start_token_id": {"vocab_size"},
    "pad_token_id": {"vocab_size"},
    "bos_token_id": {"vocab_size"},
    "eos_token_id": {"vocab_size"},
}


@fuzz_settings(300)
@given(st.data())
def test_fuzz_config(data):
    COUNTS["RelPosConfig"] += 1
    defaults = {name: getattr(RelPosConfig, name) for name in FIELDS}
    values = dict(defaults)
    given_kwargs = {}
    # Start from a small valid model, then perturb a few fields (usually valid, sometimes not).
    for name in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        given_kwargs[name] = {"hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32, "vocab_size": 64}[name]
    for name in data.draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        if chance(data, 0.35):
            given_kwargs[name] = data.draw(st.sampled_from(NOT_VALUES + ["gelu", "t5_bias", 2**31, -2**40]))
        else:
            given_kwargs[name] = data.draw(VALID[name])
    values.update(given_kwargs)
    expected = config_faults(values)
    try:
        config = RelPosConfig(**given_kwargs)
    except ValueError as exc:
        message = str(exc)
        named = set(re.findall(r"RelPosConfig\.([A-Za-z_]+)", message))
        assert named & set(FIELDS), f"ValueError does not name a field as 'RelPosConfig.<field>': {message}"
        assert expected, f"a valid configuration was rejected: {given_kwargs} -> {message}"
        allowed = set(expected)
        for name in expected:
            allowed |= RELATED.get(name, set())
        assert named & allowed, f"invalid fields {sorted(expected)}, but the message names {sorted(named)}: {message}"
        return
    shown = {k: values[k] for k in sorted(expected | {"vocab_size"})}
    assert not expected, f"invalid fields {sorted(expected)} were accepted: {shown}"
    for name, value in given_kwargs.items():
        got = getattr(config, name)
        if name in DERIVED and value is None:
            continue
        assert got == value or (isinstance(value, float) and math.isnan(value)), (name, got, value)


# ---------------------------------------------------------------------------------------------------
# Minimal repros of what the config fuzzer found
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["x", -5, 64, 10**9, True, 3.0, [], [1, "a"], [1, 64], (1, 2)])
def test_regression_config_eos_token_id_is_validated(value):
    # README: "every invalid value raises ValueError naming the field at construction".
    # Valid: None, an int or a non-empty list of ints, each in [0, vocab_size).
    with pytest.raises(ValueError, match=r"RelPosConfig\.eos_token_id"):
        RelPosConfig(vocab_size=64, eos_token_id=value)


@pytest.mark.parametrize("value", [None, 0, 63, [2], [0, 63]])
def test_config_eos_token_id_valid_values(value):
    assert RelPosConfig(vocab_size=64, eos_token_id=value).eos_token_id == value


def test_transformer_xl_window_set_before_mem_len_saves_as_the_memory_window(tmp_path):
    """sliding_window follows mem_len (mem_len + 1) once Transformer-XL has memory, even when a window was
    set before mem_len: the config saves and reloads with the memory window (review finding: the check on save
    refused the stale window)."""
    config = modeling_config("transformer_xl")
    config.sliding_window = 3
    config.mem_len = 4
    assert config.sliding_window == 5
    config.save_pretrained(tmp_path)
    assert RelPosConfig.from_pretrained(tmp_path).sliding_window == 5
