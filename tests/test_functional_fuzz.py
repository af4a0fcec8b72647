"""Property-based fuzzing (hypothesis) of ``hf_relpos.functional``, and minimal repros of what it found.

For every drawn input a call either returns finite values of the documented shape, or raises
``ValueError``/``TypeError`` whose message names an argument of the function (``TypeError`` for a
non-floating ``dtype`` of ``alibi_slopes`` / ``log_decay_bias``). Every draw records
which arguments it made invalid on purpose (``faults``): a call without faults must succeed, a call
with faults must raise, and with one fault the message must name that argument.
``attention_with_bias`` (forward and its chunked backward) is also compared with float64 autograd of
its formula.

attention_with_bias with Q = 0 or K = 0 is left out here (test_empty_shapes.py runs it in forked children);
shaw_attention (K = 0: zeros) and transformer_xl_attention (Q = 0: empty) never reach the fused SDPA kernel and
are fuzzed with empty shapes in-process. Settings and drawing helpers: strategies.py.
"""

from __future__ import annotations

import inspect
import math
import re

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from strategies import (
    COUNTS,
    DTYPES,
    NON_FLOAT_DTYPES,
    bad_int,
    chance,
    draw_int_arg,
    draw_mask,
    draw_qkv_values,
    fuzz_settings,
)

from hf_relpos import functional as Fn


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



# ---------------------------------------------------------------------------------------------------
# hf_relpos.functional
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


@pytest.mark.parametrize("fn, kwargs", [(Fn.alibi_slopes, dict(num_heads=4)),
                                        (Fn.log_decay_bias, dict(query_length=3, key_length=3, scale=1.0))],
                         ids=["alibi_slopes", "log_decay_bias"])
@pytest.mark.parametrize("dtype", NON_FLOAT_DTYPES, ids=str)
def test_regression_non_float_dtype_raises_typeerror(fn, kwargs, dtype):
    with pytest.raises(TypeError, match=r"\bdtype\b"):
        fn(**kwargs, dtype=dtype)
