"""Property-based fuzzing (hypothesis) of the functional layer, ``RelPosConfig`` and the models.

Properties, for every drawn input:

1. ``hf_relpos.functional``: a call either returns finite values of the documented shape, or raises
   ``ValueError``/``TypeError`` whose message names an argument of the function (``TypeError`` for a
   non-floating ``dtype`` of ``alibi_slopes`` / ``log_decay_bias``). Every draw records
   which arguments it made invalid on purpose (``faults``): a call without faults must succeed, a call
   with faults must raise, and with one fault the message must name that argument.
   ``attention_with_bias`` (forward and its chunked backward) is also compared with float64 autograd of
   its formula.
2. ``RelPosConfig``: construction either succeeds or raises ``ValueError`` whose message holds
   ``RelPosConfig.<field>``; an independent oracle (``config_faults``) says which fields are invalid,
   written from the README / api-contract, not from the implementation.
3. Models: random tiny valid configs (every scheme, causal or not, eager/sdpa, fp32/bf16), shapes,
   padding (left, right, holes, fully padded rows), cache continuations, Transformer-XL ``mems``
   (sometimes invalid) and training steps. Every forward returns finite outputs of the right shape or
   raises ``ValueError``/``TypeError``; on valid fp32 input a cached continuation equals the full forward.
   Invalid ``mems`` raise ``ValueError`` naming ``mems[i]`` (and the dtype when that is what is wrong) or
   ``mems`` (not a list of ``num_hidden_layers`` tensors): ``test_fuzz_mems`` fuzzes that path alone and
   ``test_every_invalid_mems_kind_raises_valueerror`` runs every kind of invalid memory once.

Empty shapes: attention_with_bias with Q = 0 or K = 0 returns zeros without calling a kernel, and the models
reject a batch of 0 sequences or of 0 tokens with ValueError. Before that fix these shapes reached CPU's fused
SDPA op, which divides by zero (SIGFPE) and ends the interpreter, so they are checked in forked children
(``test_regression_empty_*``: a regression fails one case instead of killing the pytest session) and the
in-process fuzzers of attention_with_bias and of the models leave them out. shaw_attention (K = 0: zeros) and
transformer_xl_attention (Q = 0: empty) never reach that kernel and are fuzzed with empty shapes in-process.

The run is deterministic (``derandomize=True``) so that CI is stable. ``HF_RELPOS_FUZZ_SCALE=10``
multiplies every example budget; ``HF_RELPOS_FUZZ_RANDOM=1`` draws fresh random examples. Run with
``-s`` to see how many examples each property ran (``test_zz_report_example_counts``).

Minimal repros of the bugs the fuzzers found are the ``test_regression_*`` tests at the end.
"""

from __future__ import annotations

import collections
import inspect
import math
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from hf_relpos import POSITION_ENCODINGS, RelPosConfig, RelPosForCausalLM, RelPosForSequenceClassification, RelPosModel
from hf_relpos import functional as Fn
from hf_relpos.configuration_relpos import HIDDEN_ACTS

SCALE = float(os.environ.get("HF_RELPOS_FUZZ_SCALE", "1"))
RANDOM = os.environ.get("HF_RELPOS_FUZZ_RANDOM", "") not in ("", "0")
SHRINK = os.environ.get("HF_RELPOS_FUZZ_SHRINK", "") not in ("", "0")
COUNTS: collections.Counter = collections.Counter()


def fuzz_settings(examples: int):
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        print_blob=True,
        # Shrinking a failure can take minutes; the regression tests below hold minimal repros instead.
        phases=[p for p in Phase if p != Phase.shrink or SHRINK],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


DTYPES = (torch.float32, torch.float64, torch.bfloat16)
MASK_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
NON_FLOAT_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64)


def chance(data, p_true: float = 0.12) -> bool:
    """A biased coin: True with probability about ``p_true`` (hypothesis still shrinks it to False)."""
    # hypothesis favours small integers (and shrinks toward 0): small means "no"
    return data.draw(st.integers(0, 99)) >= 100 - int(p_true * 100)


def names_in(message: str, names) -> set:
    return {n for n in names if re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message)}


def run_checked(fn, faults: set, expected_shape, aliases=None, error_types=None, **kwargs):
    """Call ``fn(**kwargs)``; check the outcome against ``faults``. Returns the output or None if it raised.

    ``aliases`` maps a fault to other words that count as naming it (e.g. a tensor's derived size);
    ``error_types`` maps a fault to the exception type the contract specifies for it alone.
    """
    params = set(inspect.signature(fn).parameters)
    try:
        out = fn(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        named = names_in(message, params)
        assert named, f"{fn.__name__} raised {type(exc).__name__} naming none of its arguments {sorted(params)}: {message}"
        assert faults, f"{fn.__name__} rejected a valid call with {type(exc).__name__}: {message}"
        if len(faults) == 1:
            (fault,) = faults
            accepted = {fault, *(aliases or {}).get(fault, ())}
            assert names_in(message, accepted), (
                f"{fn.__name__}: the only invalid argument is {fault!r}, but the message names {sorted(named)}: {message}"
            )
            expected_type = (error_types or {}).get(fault)
            assert expected_type is None or isinstance(exc, expected_type), (
                f"{fn.__name__}: invalid {fault!r} raised {type(exc).__name__}, "
                f"expected {expected_type.__name__}: {message}"
            )
        return None
    assert not faults, f"{fn.__name__} accepted invalid arguments {sorted(faults)}"
    assert tuple(out.shape) == tuple(expected_shape), f"{fn.__name__}: shape {tuple(out.shape)} != {tuple(expected_shape)}"
    if out.is_floating_point():
        assert torch.isfinite(out.float()).all(), f"{fn.__name__} returned non-finite values"
    return out


def bad_int(data, minimum: int = 0):
    """An invalid value for an ``int >= minimum`` argument."""
    return data.draw(
        st.sampled_from(
            [minimum - 1, minimum - 7, 2.0, float("nan"), True, "3", None, torch.tensor(2.5), torch.tensor([1, 2])]
        )
    )


def draw_int_arg(data, name: str, faults: set, lo: int, hi: int, minimum: int = 0):
    if chance(data, 0.06):
        faults.add(name)
        return bad_int(data, minimum)
    value = data.draw(st.integers(lo, hi))
    if chance(data, 0.05):
        return torch.tensor(value)  # a 0-d integer tensor counts as an int (documented in _check_int)
    return value


def draw_qkv_values(data, shape, dtype):
    scale = data.draw(st.sampled_from([0.1, 1.0, 4.0]))
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def draw_mask(data, B, H, Q, K, faults: set):
    """None, or a bool / additive float mask broadcastable to [B, H, Q, K] (sometimes not: a fault)."""
    kind = data.draw(st.sampled_from(["none", "bool", "float", "float", "bad_dtype"]))
    if kind == "none":
        return None
    full = [B, H, Q, K]
    shape = [data.draw(st.sampled_from([1, n])) for n in full]
    drop = data.draw(st.integers(0, 4))
    if all(s == 1 for s in shape[:drop]):
        shape = shape[drop:]
    if chance(data, 0.08):
        faults.add("attention_mask")
        if chance(data, 0.3):
            shape = [1] * (5 - len(shape)) + list(shape)  # 5-D: does not broadcast to a 4-D shape
        else:
            dim = data.draw(st.integers(0, len(full) - 1))
            true = full[dim]
            wrong = data.draw(st.integers(2, 14).filter(lambda n: n not in (1, true)))
            shape = [1] * (4 - len(shape)) + list(shape)
            shape[dim] = wrong
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        p = data.draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
        return torch.rand(shape, generator=g) < p
    if kind == "bad_dtype":
        faults.add("attention_mask")
        return torch.ones(shape, dtype=data.draw(st.sampled_from([torch.long, torch.int32, torch.uint8])))
    mdtype = data.draw(st.sampled_from(MASK_FLOAT_DTYPES))
    choice = torch.randint(0, 4, shape, generator=g)
    values = torch.rand(shape, generator=g, dtype=torch.float64) * 10 - 5
    out = torch.where(choice == 0, torch.zeros_like(values), values)
    out = torch.where(choice == 1, torch.full_like(values, float("-inf")), out)
    out = torch.where(choice == 2, torch.full_like(values, float(torch.finfo(mdtype).min)), out).to(mdtype)
    return out


# ---------------------------------------------------------------------------------------------------
# 1. functional layer
# ---------------------------------------------------------------------------------------------------


def t5_valid(bidirectional: bool, num_buckets, max_distance) -> bool:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (num_buckets, max_distance)):
        return False
    one_side = num_buckets // 2 if bidirectional else num_buckets
    return one_side // 2 >= 1 and max_distance > one_side // 2


@fuzz_settings(200)
@given(st.data())
def test_fuzz_t5_relative_position_bucket(data):
    COUNTS["t5_relative_position_bucket"] += 1
    faults = set()
    bidirectional = data.draw(st.booleans())
    num_buckets = data.draw(st.integers(0, 80))
    max_distance = data.draw(st.integers(0, 300))
    if chance(data, 0.06):
        num_buckets = data.draw(st.sampled_from([8.0, True, "32", None, -4]))
    if chance(data, 0.06):
        max_distance = data.draw(st.sampled_from([128.0, False, "128", None, -1]))
    if not isinstance(num_buckets, int) or isinstance(num_buckets, bool) or num_buckets < 0:
        faults.add("num_buckets")
    elif not isinstance(max_distance, int) or isinstance(max_distance, bool) or max_distance < 0:
        faults.add("max_distance")
    elif not t5_valid(bidirectional, num_buckets, max_distance):
        one_side = num_buckets // 2 if bidirectional else num_buckets
        faults.add("num_buckets" if one_side // 2 < 1 else "max_distance")
    dtype, bound = data.draw(
        st.sampled_from([(torch.int64, 2**40), (torch.int64, 3000), (torch.int32, 2**31 - 1), (torch.int16, 2**15 - 1)])
    )
    shape = data.draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    values = data.draw(st.lists(st.integers(-bound, bound), min_size=1, max_size=16))
    numel = math.prod(shape)
    rel = torch.tensor((values * (numel // len(values) + 1))[:numel], dtype=dtype).reshape(shape)
    if chance(data, 0.05):
        faults.add("relative_position")
        rel = data.draw(st.sampled_from([rel.float(), rel.bool(), values]))
    out = run_checked(
        Fn.t5_relative_position_bucket, faults, tuple(shape),
        aliases={"num_buckets": ("bidirectional",)},
        relative_position=rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance,
    )
    if out is not None and out.numel():
        assert out.dtype in (torch.int64, torch.int32) and int(out.min()) >= 0 and int(out.max()) < num_buckets, (
            f"bucket out of [0, {num_buckets}): {int(out.min())}..{int(out.max())}"
        )


@fuzz_settings(150)
@given(st.data())
def test_fuzz_t5_position_bias(data):
    COUNTS["t5_position_bias"] += 1
    faults = set()
    bidirectional = data.draw(st.booleans())
    num_buckets = data.draw(st.integers(0, 40))
    H = data.draw(st.integers(1, 4))
    max_distance = data.draw(st.integers(0, 64))
    if not t5_valid(bidirectional, num_buckets, max_distance):
        one_side = num_buckets // 2 if bidirectional else num_buckets
        # the table's first dimension is the bucket count: the message names "weight.shape[0] (num_buckets)"
        faults.add("weight" if one_side // 2 < 1 else "max_distance")
    dtype = data.draw(st.sampled_from(DTYPES))
    weight = draw_qkv_values(data, (num_buckets, H), dtype)
    if chance(data, 0.05):
        faults.add("weight")
        weight = data.draw(st.sampled_from([weight[None], weight.long(), weight.tolist()]))
    Q = draw_int_arg(data, "query_length", faults, 0, 12)
    K = draw_int_arg(data, "key_length", faults, 0, 12)
    past = draw_int_arg(data, "past_length", faults, 0, 300)
    run_checked(
        Fn.t5_position_bias, faults, (1, H, int(Q) if not faults else 0, int(K) if not faults else 0),
        aliases={"weight": ("num_buckets",)},
        weight=weight, query_length=Q, key_length=K, bidirectional=bidirectional, max_distance=max_distance,
        past_length=past,
    )


@fuzz_settings(250)
@given(st.data())
def test_fuzz_shaw_attention(data):
    COUNTS["shaw_attention"] += 1
    faults = set()
    dtype = data.draw(st.sampled_from(DTYPES))
    B, H = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    Q, K, D = data.draw(st.integers(0, 12)), data.draw(st.integers(0, 12)), data.draw(st.integers(1, 16))
    q = draw_qkv_values(data, (B, H, Q, D), dtype)
    k = draw_qkv_values(data, (B, H, K, D), dtype)
    v = draw_qkv_values(data, (B, H, K, D), dtype)
    if chance(data, 0.1):
        which = data.draw(st.sampled_from(["k_dim", "v_len", "v_dtype", "q_int", "q_3d", "k_batch", "v_list"]))
        if which == "k_dim":
            faults.add("k")
            k = draw_qkv_values(data, (B, H, K, D + 1), dtype)
        elif which == "v_len":
            faults.add("v")
            v = draw_qkv_values(data, (B, H, K + 1, D), dtype)
        elif which == "v_dtype":
            faults.add("v")
            v = v.to(torch.float64 if dtype != torch.float64 else torch.float32)
        elif which == "q_int":
            faults.add("q")
            q = q.long()
        elif which == "q_3d":
            faults.add("q")
            q = q[0]
        elif which == "k_batch":
            faults.add("k")
            k = draw_qkv_values(data, (B + 1, H, K, D), dtype)
        else:
            faults.add("v")
            v = v.tolist()
    kmax = data.draw(st.integers(0, 6))
    n_rel = 2 * kmax + 1
    rel_dtype = data.draw(st.sampled_from(DTYPES))
    rel_k = draw_qkv_values(data, (n_rel, D), rel_dtype)
    rel_v = None if data.draw(st.booleans()) else draw_qkv_values(data, (n_rel, D), rel_dtype)
    max_relative_position = kmax
    if chance(data, 0.06):
        faults.add("max_relative_position")
        max_relative_position = bad_int(data, 0)
    elif chance(data, 0.05):
        faults.add("rel_k")
        rel_k = draw_qkv_values(data, (n_rel + data.draw(st.sampled_from([-1, 1, 2])), D), rel_dtype)
    elif rel_v is not None and chance(data, 0.05):
        faults.add("rel_v")
        rel_v = data.draw(st.sampled_from([rel_v[:, :1] if D > 1 else rel_v[:-1], rel_v.long(), rel_v[None]]))
    past = draw_int_arg(data, "past_length", faults, 0, 30)
    mask = draw_mask(data, B, H, Q, K, faults)
    dropout_p = 0.0
    if chance(data, 0.1):
        dropout_p = data.draw(st.sampled_from([0.1, 0.5, 0.9]))
    elif chance(data, 0.05):
        faults.add("dropout_p")
        dropout_p = data.draw(st.sampled_from([1.0, -0.1, float("nan"), "0.1", True]))
    out = run_checked(
        Fn.shaw_attention, faults, (B, H, Q, D),
        q=q, k=k, v=v, rel_k=rel_k, rel_v=rel_v, max_relative_position=max_relative_position,
        attention_mask=mask, is_causal=data.draw(st.booleans()), past_length=past, dropout_p=dropout_p,
    )
    if out is not None and K == 0:
        event("shaw_attention without keys")
        assert (out == 0).all(), "shaw_attention with K = 0: not zeros"


@fuzz_settings(250)
@given(st.data())
def test_fuzz_transformer_xl_attention(data):
    COUNTS["transformer_xl_attention"] += 1
    faults = set()
    dtype = data.draw(st.sampled_from(DTYPES))
    B, H = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    Q, M, D = data.draw(st.integers(0, 12)), data.draw(st.integers(0, 8)), data.draw(st.integers(1, 16))
    K = M + Q
    causal = data.draw(st.booleans())
    q = draw_qkv_values(data, (B, H, Q, D), dtype)
    kv_len = K
    if Q > 0 and chance(data, 0.06):
        faults.add("k")  # fewer keys than queries
        kv_len = data.draw(st.integers(0, Q - 1))
    k = draw_qkv_values(data, (B, H, kv_len, D), dtype)
    v = draw_qkv_values(data, (B, H, kv_len, D), dtype)
    if chance(data, 0.06):
        which = data.draw(st.sampled_from(["k_dim", "v_dtype", "q_int"]))
        faults.add({"k_dim": "k", "v_dtype": "v", "q_int": "q"}[which])
        if which == "k_dim":
            k = draw_qkv_values(data, (B, H, kv_len, D + 1), dtype)
        elif which == "v_dtype":
            v = v.to(torch.float64 if dtype != torch.float64 else torch.float32)
        else:
            q = q.long()
    need = K if causal else K + Q - 1
    extra = data.draw(st.integers(0, 5))
    if chance(data, 0.08) and need > 0:
        faults.add("r")  # too few relative positions
        extra = -data.draw(st.integers(1, need))
    param_dtype = data.draw(st.sampled_from(DTYPES))
    r = draw_qkv_values(data, (H, max(need + extra, 0), D), param_dtype)
    u = draw_qkv_values(data, (H, D), param_dtype)
    w = draw_qkv_values(data, (H, D), param_dtype)
    if chance(data, 0.06):
        which = data.draw(st.sampled_from(["r", "u", "w"]))
        faults.add(which)
        bad = {"r": draw_qkv_values(data, (H + 1, need + extra, D), param_dtype),
               "u": draw_qkv_values(data, (H, D + 1), param_dtype),
               "w": draw_qkv_values(data, (1, H, D), param_dtype)}[which]
        r, u, w = (bad if which == n else t for n, t in (("r", r), ("u", u), ("w", w)))
    mask = draw_mask(data, B, H, Q, kv_len, faults)
    dropout_p = 0.0
    if chance(data, 0.1):
        dropout_p = data.draw(st.sampled_from([0.1, 0.5]))
    elif chance(data, 0.05):
        faults.add("dropout_p")
        dropout_p = data.draw(st.sampled_from([1.0, -0.5, None]))
    run_checked(
        Fn.transformer_xl_attention, faults, (B, H, Q, D),
        q=q, k=k, v=v, r=r, u=u, w=w, attention_mask=mask, is_causal=causal, dropout_p=dropout_p,
    )


@fuzz_settings(120)
@given(st.data())
def test_fuzz_sinusoidal_embedding(data):
    COUNTS["sinusoidal_embedding"] += 1
    faults = set()
    n = data.draw(st.integers(0, 20))
    pdtype = data.draw(st.sampled_from([torch.long, torch.int32, torch.float32, torch.float64, torch.bfloat16]))
    positions = (torch.arange(n, dtype=torch.float64) * data.draw(st.sampled_from([1, -3, 97]))).to(pdtype)
    if chance(data, 0.06):
        faults.add("positions")
        positions = data.draw(st.sampled_from([positions[None], positions.tolist(), positions.reshape(1, n, 1)]))
    dim = data.draw(st.integers(1, 20).map(lambda d: 2 * d))
    if chance(data, 0.08):
        faults.add("dim")
        dim = data.draw(st.sampled_from([0, 1, 3, 7, -2, 4.0, True, None]))
    run_checked(Fn.sinusoidal_embedding, faults, (n, dim if not faults else 0), positions=positions, dim=dim)


@fuzz_settings(120)
@given(st.data())
def test_fuzz_log_decay_bias(data):
    COUNTS["log_decay_bias"] += 1
    faults = set()
    Q = draw_int_arg(data, "query_length", faults, 0, 12)
    K = draw_int_arg(data, "key_length", faults, 0, 12)
    past = draw_int_arg(data, "past_length", faults, 0, 10_000)
    scale = data.draw(st.floats(0.0, 100.0, allow_nan=False))
    if chance(data, 0.08):
        faults.add("scale")
        scale = data.draw(st.sampled_from([-1.0, float("nan"), float("inf"), "1.0", None, True]))
    dtype = data.draw(st.sampled_from([None, *DTYPES]))
    if chance(data, 0.08):
        faults.add("dtype")
        dtype = data.draw(st.sampled_from(NON_FLOAT_DTYPES))
    out = run_checked(
        Fn.log_decay_bias, faults, (int(Q), int(K)) if not faults else (), error_types={"dtype": TypeError},
        query_length=Q, key_length=K, scale=scale, past_length=past, dtype=dtype,
    )
    if out is not None:
        assert out.dtype == (dtype or torch.get_default_dtype()) and (out <= 0).all()


@fuzz_settings(100)
@given(st.data())
def test_fuzz_alibi(data):
    COUNTS["alibi_slopes+alibi_bias"] += 1
    faults = set()
    H = data.draw(st.integers(1, 70))
    if chance(data, 0.1):
        faults.add("num_heads")
        H = bad_int(data, 1)
    dtype = data.draw(st.sampled_from(DTYPES))
    if chance(data, 0.08):
        faults.add("dtype")
        dtype = data.draw(st.sampled_from(NON_FLOAT_DTYPES))
    slopes = run_checked(Fn.alibi_slopes, faults, (H,) if not faults else (), error_types={"dtype": TypeError},
                         num_heads=H, dtype=dtype)
    if slopes is None:
        return
    assert (slopes > 0).all() and (slopes <= 1).all()
    faults = set()
    if chance(data, 0.06):
        faults.add("slopes")
        slopes = data.draw(st.sampled_from([slopes[None], slopes.long(), slopes.tolist()]))
    Q = draw_int_arg(data, "query_length", faults, 0, 12)
    K = draw_int_arg(data, "key_length", faults, 0, 12)
    past = draw_int_arg(data, "past_length", faults, 0, 1000)
    run_checked(
        Fn.alibi_bias, faults, (1, H, int(Q), int(K)) if not faults else (),
        slopes=slopes, query_length=Q, key_length=K, past_length=past,
    )


def _reference_attention(q, k, v, bias, scale):
    """softmax(q k^T scale + bias) v in float64; a row with every key at -inf gives zeros."""
    bias = bias.double()
    empty = torch.isneginf(bias).all(-1, keepdim=True)  # rows with no key: zeros, and zero gradients
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale + bias.masked_fill(empty, 0.0)
    return (torch.softmax(scores, dim=-1) @ v.double()).masked_fill(empty, 0.0)


@pytest.mark.skipif(not hasattr(Fn, "attention_with_bias"), reason="hf_relpos.functional.attention_with_bias absent")
@fuzz_settings(150)
@given(st.data())
def test_fuzz_attention_with_bias(data):
    """Forward and backward (the chunked custom backward), against float64 autograd of the formula.

    Q and K are >= 1 here: empty shapes (zeros, no kernel call) are checked in forked children by
    test_regression_empty_attention_with_bias_* (a regression there would crash the interpreter).
    """
    COUNTS["attention_with_bias"] += 1
    faults = set()
    dtype = data.draw(st.sampled_from(DTYPES))
    B, H = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    Q, K, D = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12)), data.draw(st.integers(1, 16))
    q = draw_qkv_values(data, (B, H, Q, D), dtype)
    k = draw_qkv_values(data, (B, H, K, D), dtype)
    v = draw_qkv_values(data, (B, H, K, D), dtype)
    bias_shape = (data.draw(st.sampled_from([1, B])), data.draw(st.sampled_from([1, H])), Q, K)
    bias = draw_qkv_values(data, bias_shape, dtype)
    p_masked = data.draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))  # 1.0: every row fully masked
    if p_masked:
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
        fill = data.draw(st.sampled_from([float("-inf"), float(torch.finfo(dtype).min)]))
        bias = bias.masked_fill(torch.rand(bias_shape, generator=g) < p_masked, fill)
    if chance(data, 0.06):
        faults.add("bias")
        bias = data.draw(st.sampled_from([bias[0], bias[..., :-1] if K > 1 else bias[..., :1, :].expand(
            *bias_shape[:2], Q + 1, K), bias.long()]))
    if chance(data, 0.05):
        faults.add("v")
        v = v[..., :-1, :] if K > 1 else v.long()
    chunk_size = data.draw(st.sampled_from([256, 1, 2, 3, 5]))
    if chance(data, 0.06):
        faults.add("chunk_size")
        chunk_size = bad_int(data, 1)
    scale = data.draw(st.sampled_from([None, 0.5, 1.0 / 3]))
    grads = data.draw(st.sampled_from(["all", "bias", "qkv", "none"]))
    leaves = [t.clone().requires_grad_(grads == "all" or (grads == "qkv" and n < 3) or (grads == "bias" and n == 3))
              if isinstance(t, torch.Tensor) and t.is_floating_point() else t
              for n, t in enumerate((q, k, v, bias))]
    out = run_checked(Fn.attention_with_bias, faults, (B, H, Q, D), q=leaves[0], k=leaves[1], v=leaves[2],
                      bias=leaves[3], scale=scale, chunk_size=chunk_size)
    if out is None:
        return
    used_scale = 1.0 / math.sqrt(D) if scale is None else scale
    if dtype == torch.bfloat16:
        return  # finite and shaped (checked above); values are compared in float32/float64 only
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-9)
    reference = _reference_attention(q, k, v, bias, used_scale)
    torch.testing.assert_close(out.double(), reference, **tol)
    if grads == "none":
        return
    weights = draw_qkv_values(data, (B, H, Q, D), torch.float64)
    (out.double() * weights).sum().backward()
    ref_leaves = [t.double().clone().requires_grad_(True) for t in (q, k, v, bias)]
    (_reference_attention(*ref_leaves, used_scale) * weights).sum().backward()
    for name, leaf, ref in zip(("q", "k", "v", "bias"), leaves, ref_leaves):
        if leaf.requires_grad:
            assert leaf.grad is not None and torch.isfinite(leaf.grad).all(), f"non-finite gradient of {name}"
            torch.testing.assert_close(leaf.grad.double(), ref.grad, **tol, msg=lambda m: f"grad of {name}: {m}")


# ---------------------------------------------------------------------------------------------------
# 2. RelPosConfig
# ---------------------------------------------------------------------------------------------------

POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "max_position_embeddings", "fire_mlp_width")
BOOLS = ("is_decoder", "shaw_value_embeddings", "attention_bias", "use_cache", "tie_word_embeddings",
         "is_encoder_decoder", "scale_decoder_outputs")
# Fields whose None means "derived from the others" (the README): the config holds the derived value.
DERIVED = ("head_dim", "num_decoder_layers", "decoder_start_token_id")
POSITIVE_FLOATS = ("log_decay_scale", "fire_threshold", "rope_theta", "rms_norm_eps", "initializer_range")
CAUSAL_ONLY = ("fire", "nope")  # the README: defined for causal attention only
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
    for name in ("pad_token_id", "bos_token_id", "decoder_start_token_id"):
        if not _token_ok(v[name], v["vocab_size"]):
            bad.add(name)
    eos = v["eos_token_id"]
    if not (_token_ok(eos, v["vocab_size"]) or (isinstance(eos, list) and eos and all(
            _is_int(e) and _token_ok(e, v["vocab_size"]) for e in eos))):
        bad.add("eos_token_id")
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
    "mem_len": {"position_encoding", "is_encoder_decoder"},
    "vocab_size": {"pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"},
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
# 3. models
# ---------------------------------------------------------------------------------------------------


@st.composite
def model_configs(draw):
    # Transformer-XL is drawn more often: its memory adds a path (mems) the other schemes do not have.
    scheme = draw(st.sampled_from(POSITION_ENCODINGS + ("transformer_xl",) * 3))
    is_decoder = True if scheme in CAUSAL_ONLY else draw(st.booleans())
    heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([2, 4]))
    kw = dict(
        position_encoding=scheme,
        is_decoder=is_decoder,
        vocab_size=draw(st.integers(8, 24)),
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_hidden_layers=draw(st.integers(1, 2)),
        intermediate_size=draw(st.sampled_from([8, 16])),
        hidden_act=draw(st.sampled_from(HIDDEN_ACTS)),
        attention_bias=draw(st.booleans()),
        initializer_range=draw(st.sampled_from([0.02, 0.5])),
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    if scheme == "t5_bias":
        nb = draw(st.integers(2 if is_decoder else 4, 12))
        one_side = nb if is_decoder else nb // 2
        kw.update(relative_attention_num_buckets=nb, relative_attention_max_distance=draw(
            st.integers(one_side // 2 + 1, 24)))
    elif scheme == "shaw":
        kw.update(max_relative_position=draw(st.integers(0, 4)), shaw_value_embeddings=draw(st.booleans()))
    elif scheme == "transformer_xl":
        kw.update(mem_len=draw(st.sampled_from([3, 0, 1, 2, 6])), clamp_len=draw(st.sampled_from([-1, 1, 3, 8])))
    elif scheme == "log_decay":
        kw.update(log_decay_scale=draw(st.sampled_from([0.1, 1.0, 3.0])))
    elif scheme == "rope":
        kw.update(rope_theta=draw(st.sampled_from([10.0, 10000.0])))
    elif scheme == "fire":
        kw.update(fire_mlp_width=draw(st.sampled_from([1, 4])), fire_threshold=draw(st.sampled_from([2.0, 512.0])))
    elif scheme in ("kerple_log", "nope"):
        pass
    else:
        kw.update(max_position_embeddings=draw(st.integers(4, 24)))
    return kw


def draw_padding(data, batch: int, length: int):
    kind = data.draw(st.sampled_from(["none", "ones", "left", "right", "holes", "full_row"]))
    if kind == "none":
        return None
    mask = torch.ones(batch, length, dtype=torch.long)
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    for b in range(batch):
        n = int(torch.randint(0, length + 1, (1,), generator=g)) if length else 0
        if kind == "left":
            mask[b, :n] = 0
        elif kind == "right":
            mask[b, length - n :] = 0
        elif kind == "holes":
            mask[b] = (torch.rand(length, generator=g) < 0.6).long()
        elif kind == "full_row" and (b == 0 or torch.rand(1, generator=g) < 0.5):
            mask[b] = 0
    if data.draw(st.booleans()):
        mask = mask.bool()
    return mask


def check_output(out, expected_shape):
    assert tuple(out.shape) == tuple(expected_shape), f"output shape {tuple(out.shape)} != {tuple(expected_shape)}"
    assert torch.isfinite(out.float()).all(), "non-finite model output"


def model_call(model, faults_ok: bool, **kwargs):
    """Run a forward; returns (output, None) or (None, exception) for ValueError/TypeError (anything else propagates)."""
    try:
        with torch.no_grad():
            return model(**kwargs), None
    except (ValueError, TypeError) as exc:
        assert faults_ok, f"a valid forward raised {type(exc).__name__}: {exc}"
        event(f"model forward raised {type(exc).__name__}")
        return None, exc


MEMS_KINDS = ("batch", "too_long", "hidden", "layers", "ragged", "not_tensor", "none_entry", "2d", "float64", "tensor")
MEMS_LIST_KINDS = ("layers", "tensor")  # not a list of num_hidden_layers entries: the message names mems


def invalid_mems(data, mems_like: list, batch: int, config, kind: str):
    H, L, M = config.hidden_size, config.num_hidden_layers, config.mem_len
    m = mems_like[0].shape[1] if mems_like else 1
    make = lambda b, n, h, dtype=torch.float32: torch.randn(b, n, h, dtype=dtype)  # noqa: E731
    if kind == "batch":
        return [make(batch + 1, m, H) for _ in range(L)]
    if kind == "too_long":
        return [make(batch, M + 1, H) for _ in range(L)]
    if kind == "hidden":
        return [make(batch, m, H + 2) for _ in range(L)]
    if kind == "layers":
        return [make(batch, m, H) for _ in range(L + 1)]
    if kind == "ragged":
        return [make(batch, (m + i) % (M + 1), H) for i in range(L)] if L > 1 else [make(batch, m, H + 1)]
    if kind == "not_tensor":
        return [[0.0] * H for _ in range(L)]
    if kind == "none_entry":
        return [None] * L
    if kind == "2d":
        return [make(batch, H, 1)[..., 0] for _ in range(L)]
    if kind == "float64":
        return [make(batch, m, H, torch.float64) for _ in range(L)]
    return torch.randn(L, batch, m, H)


def check_mems_error(exc, kind: str, mems, model_dtype) -> None:
    """The contract for invalid mems: ValueError naming mems[i] (a bad entry) or mems (not a list of layers)."""
    message = str(exc)
    assert isinstance(exc, ValueError), f"invalid mems ({kind}) raised {type(exc).__name__}, not ValueError: {message}"
    if kind in MEMS_LIST_KINDS:
        assert re.search(r"(?<![A-Za-z0-9_])mems(?![A-Za-z0-9_])", message), f"mems ({kind}) not named: {message}"
        return
    named = re.search(r"(?<![A-Za-z0-9_])mems\[(\d+)\]", message)
    assert named, f"invalid mems entry ({kind}): the message does not name mems[i]: {message}"
    entry = mems[int(named.group(1))]
    if "dtype" in message:
        assert isinstance(entry, torch.Tensor) and entry.dtype != model_dtype, f"dtype blamed wrongly: {message}"
        assert str(entry.dtype) in message and str(model_dtype) in message, f"dtypes not named: {message}"
    elif kind in ("float64", "entry_dtype") and model_dtype != torch.float64:
        raise AssertionError(f"mems of another dtype than the model's {model_dtype}: the message does not say dtype: "
                             f"{message}")


@fuzz_settings(80)
@given(kw=model_configs(), data=st.data())
def test_fuzz_models(kw, data):
    COUNTS["models"] += 1
    impl = data.draw(st.sampled_from(["eager", "sdpa"]))
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    config = RelPosConfig(**kw)
    config._attn_implementation = impl
    decoder = config.is_decoder
    if decoder:
        model = RelPosForCausalLM(config)
        head = "lm"
    else:
        head = data.draw(st.sampled_from(["base", "cls"]))
        model = RelPosModel(config) if head == "base" else RelPosForSequenceClassification(config)
    model.config._attn_implementation = impl
    dtype = data.draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    model = model.to(dtype).eval()
    V, H = config.vocab_size, config.hidden_size

    def expected_shape(batch, length):
        return {"lm": (batch, length, V), "base": (batch, length, H), "cls": (batch, config.num_labels)}[head]

    def main_output(out):
        return out.last_hidden_state if head == "base" else out.logits

    batch = data.draw(st.integers(1, 3))
    prefix = data.draw(st.sampled_from([4, 0, 1, 2, 3, 6, 8]))  # > 0: a prefix, then a continuation (cache, or Transformer-XL mems)
    # (empty inputs are test_regression_empty_model_inputs_raise_valueerror's, in forked children)
    chunk = data.draw(st.integers(1, 6)) if prefix else data.draw(st.integers(1, 10))
    total = prefix + chunk
    faults = set()  # what makes this input invalid: some forward must raise ValueError/TypeError
    ids = torch.randint(0, V, (batch, total))
    if total and chance(data, 0.08):
        faults.add("input_ids")
        ids[data.draw(st.integers(0, batch - 1)), data.draw(st.integers(0, total - 1))] = data.draw(
            st.sampled_from([-1, V, V + 7]))
    if config.position_encoding in ("learned", "sinusoidal") and total > config.max_position_embeddings:
        faults.add("longer than max_position_embeddings")
    mask = draw_padding(data, batch, total)
    extra_mask = 0
    if mask is not None and chance(data, 0.06):
        faults.add("attention_mask")
        extra_mask = data.draw(st.sampled_from([1, 2]))
        mask = torch.cat([torch.ones(batch, extra_mask, dtype=mask.dtype), mask], dim=1)
    labels = None
    if head == "lm" and data.draw(st.booleans()):
        labels = ids.clamp(0, V - 1)
        if mask is not None:
            labels = labels.masked_fill(mask[:, extra_mask:] == 0, -100)
    elif head == "cls" and data.draw(st.booleans()):
        labels = torch.randint(0, config.num_labels, (batch,))


    def takes(labels):  # the base model has no labels argument (an unknown keyword is a TypeError)
        return {} if head == "base" else {"labels": labels}

    txl_memory = config.position_encoding == "transformer_xl" and config.mem_len > 0
    use_mems = bool(prefix) and (txl_memory or chance(data, 0.05)) and data.draw(st.booleans())
    use_cache = bool(prefix) and decoder and not use_mems
    event("path: " + ("mems" if use_mems else "cache" if use_cache else "one forward") + (" (invalid)" if faults else ""))

    if not (use_mems or use_cache):
        # One forward of the whole input.
        out, exc = model_call(model, bool(faults), input_ids=ids, attention_mask=mask, **takes(labels),
                              use_cache=False)
        if exc is None:
            assert not faults, f"invalid input accepted: {sorted(faults)}"
            check_output(main_output(out), expected_shape(batch, total))
            if labels is not None:
                assert torch.isfinite(out.loss), "non-finite loss"
            if total and data.draw(st.booleans()):
                # A training step (grad enabled: the path of the custom attention backward): finite gradients.
                event("training step")
                model.train()
                out = model(input_ids=ids, attention_mask=mask, **takes(labels), use_cache=False)
                loss = out.loss if labels is not None else main_output(out).float().square().mean()
                loss.backward()
                for name, param in model.named_parameters():
                    assert param.grad is None or torch.isfinite(param.grad.float()).all(), f"non-finite grad {name}"
        return

    first_mask = None if mask is None else mask[:, extra_mask : extra_mask + prefix]
    if use_mems:
        # Transformer-XL memory: the prefix without cache, then the chunk reading the prefix's memory.
        out1, exc = model_call(model, bool(faults), input_ids=ids[:, :prefix], attention_mask=first_mask,
                               use_cache=False)
        if exc is not None:
            return
        mems = out1.mems
        mems_kind = None
        if not txl_memory:
            faults.add("mems for a model without memory")
            mems = [torch.zeros(batch, 1, H, dtype=dtype)] * config.num_hidden_layers
        elif chance(data, 0.3):
            faults.add("mems")
            mems_kind = data.draw(st.sampled_from(MEMS_KINDS))
            event(f"invalid mems: {mems_kind}")
            mems = invalid_mems(data, mems, batch, config, mems_kind)
        elif data.draw(st.booleans()):
            mems = tuple(m.clone() for m in mems)
        m_len = mems[0].shape[1] if txl_memory and "mems" not in faults else 0
        if mask is None:
            chunk_mask = None
        elif m_len and data.draw(st.booleans()):
            # the mask of memory + current tokens
            chunk_mask = torch.cat([mask[:, extra_mask + prefix - m_len : extra_mask + prefix],
                                    mask[:, extra_mask + prefix :]], dim=1)
            if extra_mask:
                chunk_mask = torch.cat([torch.ones(batch, extra_mask, dtype=mask.dtype), chunk_mask], dim=1)
        else:
            chunk_mask = mask[:, prefix:]  # current tokens (+ extra_mask columns if that fault was drawn)
        if extra_mask and chunk_mask is not None and chunk_mask.shape[1] == m_len + chunk:
            faults.discard("attention_mask")  # the longer mask happens to be a valid memory + current mask
        chunk_labels = None if labels is None or head != "lm" else labels[:, prefix:]
        if head == "cls":
            chunk_labels = labels
        out2, exc = model_call(model, bool(faults), input_ids=ids[:, prefix:], attention_mask=chunk_mask,
                               mems=mems, **takes(chunk_labels), use_cache=False)
        if exc is not None:
            if faults == {"mems"}:
                check_mems_error(exc, mems_kind, mems, dtype)
            elif faults == {"mems for a model without memory"}:
                assert isinstance(exc, ValueError) and "mems" in str(exc), f"{type(exc).__name__}: {exc}"
            return
        assert not faults, f"invalid input accepted: {sorted(faults)}"
        check_output(main_output(out2), expected_shape(batch, chunk))
        assert len(out2.mems) == config.num_hidden_layers
        for m in out2.mems:
            assert m.shape[0] == batch and m.shape[1] <= config.mem_len and m.shape[2] == H and not m.requires_grad
            assert torch.isfinite(m.float()).all(), "non-finite mems"
        return

    # Causal LM with a cache: a prefix with use_cache=True, then the continuation chunk (mask: past + current).
    full_ref = None
    if not faults and dtype == torch.float32:
        full_ref, _ = model_call(model, False, input_ids=ids, attention_mask=mask, use_cache=False)
        check_output(full_ref.logits, (batch, total, V))
    out1, exc = model_call(model, bool(faults), input_ids=ids[:, :prefix], attention_mask=first_mask, use_cache=True)
    if exc is not None:
        return
    check_output(out1.logits, (batch, prefix, V))
    out2, exc = model_call(model, bool(faults), input_ids=ids[:, prefix:], attention_mask=mask,
                           past_key_values=out1.past_key_values, use_cache=True,
                           labels=None if labels is None else labels[:, prefix:])
    if exc is not None:
        return
    assert not faults, f"invalid input accepted: {sorted(faults)}"
    check_output(out2.logits, (batch, chunk, V))
    if labels is not None:
        assert torch.isfinite(out2.loss), "non-finite loss"
    if full_ref is not None:
        event("cached continuation compared with the full forward")
        # Every position, padded ones included: a query with no visible key gives zeros from attention under
        # every kernel, so it cannot depend on the cache either (test_regression_padded_query_... pins that).
        torch.testing.assert_close(
            out2.logits, full_ref.logits[:, prefix:], rtol=1e-4, atol=1e-4,
            msg=lambda m: f"cached continuation != full forward ({kw}, impl={impl}, mask={mask}): {m}",
        )


@fuzz_settings(60)
@given(kw=model_configs(), data=st.data())
def test_fuzz_mems(kw, data):
    """Transformer-XL memory alone: valid mems (a prefix's, any length <= mem_len) give finite outputs and
    memory; invalid ones raise ValueError naming mems[i] (a bad entry; its dtype if that is what is wrong) or
    mems (not a list of num_hidden_layers tensors). test_fuzz_models reaches this path too, but rarely."""
    COUNTS["mems"] += 1
    kw = {**kw, "position_encoding": "transformer_xl", "mem_len": data.draw(st.integers(1, 6)),
          "clamp_len": data.draw(st.sampled_from([-1, 1, 3, 8]))}
    for key in ("relative_attention_num_buckets", "relative_attention_max_distance", "max_relative_position",
                "shaw_value_embeddings", "log_decay_scale", "rope_theta", "max_position_embeddings"):
        kw.pop(key, None)
    config = RelPosConfig(**kw)
    config._attn_implementation = data.draw(st.sampled_from(["eager", "sdpa"]))
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    model_dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    model = RelPosModel(config).to(model_dtype).eval()
    V, H, L, M = config.vocab_size, config.hidden_size, config.num_hidden_layers, config.mem_len
    batch, prefix, chunk = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 8)), data.draw(st.integers(1, 5))
    with torch.no_grad():
        mems = model(input_ids=torch.randint(0, V, (batch, prefix)), use_cache=False).mems
    assert len(mems) == L and all(m.shape == (batch, min(prefix, M), H) and m.dtype == model_dtype for m in mems)
    kind = None
    kinds = MEMS_KINDS + ("entry_dtype",)
    # about half valid, every invalid kind about equally often (hypothesis's small integers are far from uniform)
    choice = data.draw(st.integers(0, 2**16)) % (2 * len(kinds)) - len(kinds)
    if choice >= 0:
        kind = kinds[choice]
        event(f"invalid mems: {kind}")
        if kind == "entry_dtype":  # one layer's memory of another dtype, the others right
            index = data.draw(st.integers(0, L - 1))
            other = data.draw(st.sampled_from([d for d in (torch.float32, torch.float64, torch.bfloat16)
                                               if d != model_dtype]))
            mems = [m.to(other) if i == index else m for i, m in enumerate(mems)]
        else:
            mems = invalid_mems(data, list(mems), batch, config, kind)
            if kind not in ("tensor", "float64") and data.draw(st.booleans()):  # the shape alone is wrong
                mems = [m.to(model_dtype) if isinstance(m, torch.Tensor) else m for m in mems]
    else:
        event("valid mems")
        if data.draw(st.booleans()):  # a shorter memory is valid too
            keep = data.draw(st.integers(0, mems[0].shape[1]))
            mems = [m[:, mems[0].shape[1] - keep :] for m in mems]
    ids = torch.randint(0, V, (batch, chunk))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, mems=mems, use_cache=False)
    except (ValueError, TypeError) as exc:
        assert kind is not None, f"valid mems rejected ({type(exc).__name__}): {exc}"
        check_mems_error(exc, kind, mems, model_dtype)
        if kind == "entry_dtype":
            assert f"mems[{index}]" in str(exc), f"wrong-dtype mems[{index}] not named: {exc}"
        return
    assert kind is None, f"invalid mems ({kind}) accepted"
    check_output(out.last_hidden_state, (batch, chunk, H))
    assert len(out.mems) == L and all(m.shape[1] <= M and m.dtype == model_dtype for m in out.mems)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", MEMS_KINDS)
def test_every_invalid_mems_kind_raises_valueerror(kind, model_dtype):
    """Each kind of invalid mems the fuzzers draw (hypothesis reaches some rarely), on fp32 and bf16 models."""
    config = RelPosConfig(position_encoding="transformer_xl", mem_len=3, hidden_size=8, num_attention_heads=2,
                          intermediate_size=8, num_hidden_layers=2, vocab_size=16)
    model = RelPosModel(config).to(model_dtype).eval()
    with torch.no_grad():
        mems = model(input_ids=torch.randint(0, 16, (2, 4)), use_cache=False).mems
        for same_dtype in (False, True):
            bad = invalid_mems(None, list(mems), 2, config, kind)
            if same_dtype and kind not in ("tensor", "float64"):
                bad = [m.to(model_dtype) if isinstance(m, torch.Tensor) else m for m in bad]
            with pytest.raises(ValueError) as info:
                model(input_ids=torch.randint(0, 16, (2, 2)), mems=bad, use_cache=False)
            check_mems_error(info.value, kind, bad, model_dtype)


# ---------------------------------------------------------------------------------------------------
# Minimal repros of what the fuzzers found (each fails until its bug is fixed)
# ---------------------------------------------------------------------------------------------------


def test_regression_shaw_attention_without_keys_gives_zeros():
    # Every query row has no key to attend to: the contract says zeros, never an error.
    q = torch.randn(1, 1, 3, 4)
    k = v = torch.randn(1, 1, 0, 4)
    out = Fn.shaw_attention(q, k, v, torch.randn(3, 4), None, max_relative_position=1)
    assert out.shape == (1, 1, 3, 4) and (out == 0).all()


def test_regression_transformer_xl_attention_without_queries():
    # Q = 0 new tokens (memory only): an empty [B, H, 0, D], not "invalid storage offset -1".
    q = torch.randn(1, 2, 0, 4)
    k = v = torch.randn(1, 2, 3, 4)
    out = Fn.transformer_xl_attention(q, k, v, torch.randn(2, 3, 4), torch.randn(2, 4), torch.randn(2, 4))
    assert out.shape == (1, 2, 0, 4)


def test_regression_t5_position_bias_too_few_buckets_names_weight_rows():
    # The bucket count is weight.shape[0]; t5_position_bias has no num_buckets argument.
    with pytest.raises(ValueError, match=re.escape("weight.shape[0] (num_buckets)")):
        Fn.t5_position_bias(torch.randn(3, 2), 4, 4, bidirectional=True)
    with pytest.raises(ValueError, match=re.escape("weight.shape[0] (num_buckets)")):
        Fn.t5_position_bias(torch.randn(1, 2), 4, 4, bidirectional=False)


@pytest.mark.parametrize("value", ["x", -5, 64, 10**9, True, 3.0, [], [1, "a"], [1, 64], (1, 2)])
def test_regression_config_eos_token_id_is_validated(value):
    # README: "every invalid value raises ValueError naming the field at construction".
    # Valid: None, an int or a non-empty list of ints, each in [0, vocab_size).
    with pytest.raises(ValueError, match=r"RelPosConfig\.eos_token_id"):
        RelPosConfig(vocab_size=64, eos_token_id=value)


@pytest.mark.parametrize("value", [None, 0, 63, [2], [0, 63]])
def test_config_eos_token_id_valid_values(value):
    assert RelPosConfig(vocab_size=64, eos_token_id=value).eos_token_id == value


def _tiny_txl(dtype=torch.float32):
    config = RelPosConfig(position_encoding="transformer_xl", mem_len=4, hidden_size=16, num_attention_heads=2,
                          intermediate_size=16, num_hidden_layers=2, vocab_size=16)
    return RelPosForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("entry", [None, [0.0], "mems", torch.zeros(2, 2), torch.zeros(3, 2, 16),
                                   torch.zeros(2, 2, 15), torch.zeros(2, 5, 16)],
                         ids=["None", "list", "str", "2d", "batch", "hidden", "too_long"])
def test_regression_mems_invalid_entry_raises_valueerror_naming_it(entry, index):
    # A non-tensor entry or a wrong shape: ValueError naming mems[i].
    mems = [torch.zeros(2, 2, 16), torch.zeros(2, 2, 16)]
    mems[index] = entry
    with pytest.raises(ValueError, match=re.escape(f"mems[{index}]")):
        _tiny_txl()(torch.randint(0, 16, (2, 3)), mems=mems)


@pytest.mark.parametrize("model_dtype, mems_dtype", [(torch.float32, torch.float64), (torch.float32, torch.bfloat16),
                                                     (torch.bfloat16, torch.float32)])
def test_regression_mems_of_another_dtype_raises_valueerror(model_dtype, mems_dtype):
    # mems must have the model's dtype (embed_tokens.weight.dtype): ValueError naming mems[i] and the dtype.
    model = _tiny_txl(model_dtype)
    for index in (0, 1):
        mems = [torch.zeros(2, 2, 16, dtype=model_dtype) for _ in range(2)]
        mems[index] = mems[index].to(mems_dtype)
        with pytest.raises(ValueError, match=re.escape(f"mems[{index}]")) as info:
            model(torch.randint(0, 16, (2, 3)), mems=mems)
        assert "dtype" in str(info.value) and str(mems_dtype) in str(info.value), str(info.value)
    # the matching dtype is accepted
    out = model(torch.randint(0, 16, (2, 3)), mems=[torch.zeros(2, 2, 16, dtype=model_dtype)] * 2)
    assert out.logits.dtype == model_dtype


@pytest.mark.parametrize("fn, kwargs", [(Fn.alibi_slopes, dict(num_heads=4)),
                                        (Fn.log_decay_bias, dict(query_length=3, key_length=3, scale=1.0))],
                         ids=["alibi_slopes", "log_decay_bias"])
@pytest.mark.parametrize("dtype", NON_FLOAT_DTYPES, ids=str)
def test_regression_non_float_dtype_raises_typeerror(fn, kwargs, dtype):
    with pytest.raises(TypeError, match=r"\bdtype\b"):
        fn(**kwargs, dtype=dtype)


EMPTY_SHAPES_SCRIPT = r"""
import json, os, sys
import torch
from hf_relpos import RelPosConfig, RelPosForCausalLM, functional as Fn

EMPTY_MESSAGE = "must hold at least one sequence of at least one token"


def attention(Q, K, bias_shape, grads):
    # attention_with_bias on Q = 0 or K = 0: zeros [B, H, Q, Dv], no kernel call; backward gives zero gradients.
    B, H, D, Dv = 2, 3, 4, 5
    q, k, v = torch.randn(B, H, Q, D), torch.randn(B, H, K, D), torch.randn(B, H, K, Dv)
    bias = torch.zeros(*bias_shape)
    leaves = {"q": q, "k": k, "v": v, "bias": bias}
    for name in grads:
        leaves[name].requires_grad_(True)
    out = Fn.attention_with_bias(q, k, v, bias)
    assert out.shape == (B, H, Q, Dv), out.shape
    assert (out == 0).all(), "not zeros"
    if grads:
        assert out.requires_grad, f"the output does not require grad although {', '.join(grads)} do"
        (out * 2).sum().backward()
        for name in grads:
            grad = leaves[name].grad
            assert grad is None or (grad == 0).all(), f"non-zero gradient of {name}"


def model_inputs(scheme, mode, report):
    # An empty batch or an empty sequence: ValueError naming input_ids / inputs_embeds, before any kernel.
    config = RelPosConfig(position_encoding=scheme, hidden_size=16, num_attention_heads=2, intermediate_size=16,
                          num_hidden_layers=1, vocab_size=16, attn_implementation=mode.split("/")[1])
    model = RelPosForCausalLM(config).train(mode.startswith("train"))
    training = mode.startswith("train")
    problems = []
    for kind in ("input_ids", "inputs_embeds"):
        for shape in ((2, 0), (0, 3)):
            report(f"{kind} {shape}")  # the parent names the input that was running if the child crashes
            if kind == "input_ids":
                inputs = {"input_ids": torch.zeros(*shape, dtype=torch.long)}
            else:
                inputs = {"inputs_embeds": torch.randn(*shape, 16, requires_grad=training)}
            labels = torch.zeros(*shape, dtype=torch.long) if training else None
            try:
                with torch.set_grad_enabled(training):
                    out = model(**inputs, labels=labels)
            except ValueError as exc:
                if not (kind in str(exc) and EMPTY_MESSAGE in str(exc)):
                    problems.append(f"{kind} {shape}: ValueError not naming {kind}: {exc}")
            except Exception as exc:
                problems.append(f"{kind} {shape}: {type(exc).__name__}: {exc}")
            else:
                problems.append(f"{kind} {shape}: no ValueError; output {tuple(out.logits.shape)}")
    assert not problems, "; ".join(problems)


def run(case, report):
    name, *args = case
    if name == "attention":
        attention(*args)
    else:
        model_inputs(*args, report)


results = {}
for case in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child runs one case: a crash (signal) ends only the child
        os.close(read)
        report = lambda step: os.write(write, (step + "\n").encode())  # noqa: E731
        try:
            run(case, report)
            message = "OK"
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}".splitlines()[0][:600]
        os.write(write, ("=" + message).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while True:
        chunk = os.read(read, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    os.close(read)
    text = b"".join(chunks).decode()
    if os.WIFSIGNALED(status):
        running = text.splitlines()[-1] if text else ""
        message = f"killed by signal {os.WTERMSIG(status)} (interpreter crash) while running {running!r}"
    else:
        message = text.rpartition("=")[2] if "=" in text else f"no result (exit status {status})"
    results[json.dumps(case)] = message
print(json.dumps(results))
"""

EMPTY_ATTENTION_CASES = [
    ["attention", Q, K, bias_shape, grads]
    for Q, K in ((0, 3), (3, 0), (0, 0))
    for bias_shape in ((2, 3, Q, K), (1, 1, Q, K))
    for grads in ((), ("bias",))
]
EMPTY_ATTENTION_GRAD_CASES = [["attention", Q, K, (1, 3, Q, K), grads]
                              for Q, K in ((0, 3), (3, 0)) for grads in (("q",), ("q", "k", "v"), ("v", "bias"))]
EMPTY_MODEL_CASES = [  # each child runs input_ids and inputs_embeds of shapes [2, 0] and [0, 3]
    ["model", scheme, mode] for scheme in POSITION_ENCODINGS for mode in ("eval/sdpa", "eval/eager", "train/sdpa")
]


@pytest.fixture(scope="module")
def empty_shape_results(tmp_path_factory):
    """Runs every empty-shape case in its own forked child: {case (json): "OK" or what went wrong}.

    On empty shapes CPU's fused SDPA op (``_scaled_dot_product_flash_attention_for_cpu``) divides by zero
    (SIGFPE): a regression that reached it again would otherwise end the whole pytest session.
    """
    import json
    import subprocess
    import sys

    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    script = tmp_path_factory.mktemp("empty") / "empty_shapes.py"
    script.write_text(EMPTY_SHAPES_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    cases = EMPTY_ATTENTION_CASES + EMPTY_ATTENTION_GRAD_CASES + EMPTY_MODEL_CASES
    proc = subprocess.run([sys.executable, str(script), json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    return results


def _failures(results, cases):
    import json

    failures = {json.dumps(case): results[json.dumps(case)] for case in cases if results[json.dumps(case)] != "OK"}
    return f"{len(failures)} of {len(cases)} cases fail:\n" + "\n".join(f"  {c}: {m}" for c, m in failures.items()) \
        if failures else ""


def test_regression_empty_attention_with_bias_gives_zeros(empty_shape_results):
    """attention_with_bias with Q = 0 or K = 0 (full or broadcast bias; bias gradient): zeros, no crash."""
    problems = _failures(empty_shape_results, EMPTY_ATTENTION_CASES)
    assert not problems, problems


def test_regression_empty_attention_with_bias_output_stays_in_the_autograd_graph(empty_shape_results):
    """Q = 0 or K = 0 with gradients on q / k / v: the zeros output requires grad (zero gradients), as it does
    when only bias requires grad, as shaw_attention's empty output does, and as torch's ops on empty tensors do."""
    problems = _failures(empty_shape_results, EMPTY_ATTENTION_GRAD_CASES)
    assert not problems, problems


def test_regression_empty_model_inputs_raise_valueerror(empty_shape_results):
    """input_ids / inputs_embeds with batch 0 or seq_len 0: ValueError naming the input, every scheme and mode."""
    problems = _failures(empty_shape_results, EMPTY_MODEL_CASES)
    assert not problems, problems


@pytest.mark.parametrize("position_encoding", ["t5_bias", "alibi", "log_decay"])
def test_regression_padded_query_does_not_read_future_tokens(position_encoding):
    # A query with every key masked (here a fully padded row) must not attend to later tokens. Under sdpa the
    # additive-bias schemes fill masked entries with finfo.min + bias: a row that is all finfo.min gets a uniform
    # softmax over *all* keys, future ones included. Eager zeroes such rows; sdpa should agree with it.
    torch.manual_seed(0)
    outputs = {}
    for impl in ("eager", "sdpa"):
        torch.manual_seed(0)
        config = RelPosConfig(position_encoding=position_encoding, vocab_size=23, hidden_size=8, num_attention_heads=2,
                              num_hidden_layers=2, intermediate_size=16, initializer_range=0.5,
                              attn_implementation=impl)
        model = RelPosForCausalLM(config).eval()
        ids = torch.randint(1, 23, (1, 6))
        changed = ids.clone()
        changed[0, 5] = ids[0, 5] % 22 + 1  # only the last (future) token differs
        mask = torch.zeros(1, 6, dtype=torch.long)
        with torch.no_grad():
            a, b = model(ids, attention_mask=mask).logits, model(changed, attention_mask=mask).logits
        torch.testing.assert_close(a[0, :5], b[0, :5], msg=lambda m: f"{impl}: position 0..4 read token 5: {m}")
        outputs[impl] = a
    torch.testing.assert_close(outputs["sdpa"], outputs["eager"], rtol=1e-5, atol=1e-5)


def test_zz_report_example_counts():
    """Prints (with -s) how many examples each fuzzer ran in this session."""
    total = sum(COUNTS.values())
    print(f"\nfuzz examples run: {total} ({', '.join(f'{k}={v}' for k, v in sorted(COUNTS.items()))})")
    if not total:
        pytest.skip("no fuzz test ran in this session")
