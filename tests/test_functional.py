"""Tests for ``hf_relpos.functional`` against slow, independent oracles.

The oracles live in ``tests/oracles.py`` and are written straight from the
formulas of the API contract (``/work/shared/api-contract.md`` section 1); T5 is
checked bit-for-bit against upstream Transformers' ``T5Attention``.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_relpos import functional as F
from oracles import (
    alibi_bias_ref,
    alibi_slopes_ref,
    fire_torch_ref,
    kerple_log_ref,
    log_decay_ref,
    shaw_ref,
    shaw_torch_ref,
    sinusoidal_ref,
    txl_ref,
    txl_torch_ref,
)

ATOL64 = 1e-10

HYP = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HYP_SMALL = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def seed_of(case):
    return zlib.crc32(repr(case).encode()) % 100_000


def gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def randn(g, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def make_mask(g, kind, B, H, Q, K, dtype=torch.float64, shape=None):
    """kind: None | 'bool' | 'float_inf' | 'float_min' | 'float_finite'.

    ``shape`` (broadcastable to [B,H,Q,K]) defaults to the full shape.
    Random masks never fully mask a row unless the caller does so explicitly.
    """
    if kind is None:
        return None
    shape = shape or (B, H, Q, K)
    keep = torch.rand(*shape, generator=g) < 0.7
    keep[..., 0] = True  # key 0 always visible so no row is fully masked by accident
    if kind == "bool":
        return keep
    vals = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    if kind == "float_finite":
        return vals
    fill = -math.inf if kind == "float_inf" else torch.finfo(dtype).min
    return vals.masked_fill(~keep, fill)


def assert_close64(actual, expected, atol=ATOL64, what=""):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert torch.isfinite(actual).all(), what
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert err <= atol, f"{what}: max abs err {err:.3e} > {atol:.1e}"


def assert_names(exc_info, *names):
    msg = str(exc_info.value)
    assert any(n in msg for n in names), f"message {msg!r} does not name any of {names}"


def upstream_t5():
    from transformers.models.t5.modeling_t5 import T5Attention

    return T5Attention


def upstream_bucket(rp, bidirectional, num_buckets, max_distance):
    return upstream_t5()._relative_position_bucket(
        rp, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )


def max_exact_of(num_buckets, bidirectional):
    return (num_buckets // 2 if bidirectional else num_buckets) // 2


def shaw_inputs(seed, B, H, Q, K, D, kk, dtype=torch.float64, with_rel_v=True):
    g = gen(seed)
    q = randn(g, B, H, Q, D, dtype=dtype)
    k = randn(g, B, H, K, D, dtype=dtype)
    v = randn(g, B, H, K, D, dtype=dtype)
    rel_k = randn(g, 2 * kk + 1, D, dtype=dtype)
    rel_v = randn(g, 2 * kk + 1, D, dtype=dtype) if with_rel_v else None
    return g, q, k, v, rel_k, rel_v


def txl_inputs(seed, B, H, Q, K, D, R, dtype=torch.float64):
    g = gen(seed)
    q = randn(g, B, H, Q, D, dtype=dtype)
    k = randn(g, B, H, K, D, dtype=dtype)
    v = randn(g, B, H, K, D, dtype=dtype)
    r = randn(g, H, R, D, dtype=dtype)
    u = randn(g, H, D, dtype=dtype)
    w = randn(g, H, D, dtype=dtype)
    return g, q, k, v, r, u, w


# ---------------------------------------------------------------------------
# self-checks of the oracles on hand-computable cases
# ---------------------------------------------------------------------------


def test_oracle_shaw_hand_example():
    # One head, D=1, two keys, k=1: everything computable by hand.
    q = torch.tensor([[[[1.0]]]], dtype=torch.float64)  # [1,1,1,1]
    k = torch.tensor([[[[0.5], [2.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[3.0], [-1.0]]]], dtype=torch.float64)
    rel_k = torch.tensor([[10.0], [20.0], [30.0]], dtype=torch.float64)
    rel_v = torch.tensor([[1.0], [2.0], [4.0]], dtype=torch.float64)
    # query at absolute position 1 (past_length=1): j=0 -> rel -1 -> row 0; j=1 -> rel 0 -> row 1
    e0, e1 = 0.5 + 10.0, 2.0 + 20.0
    a0 = math.exp(e0) / (math.exp(e0) + math.exp(e1))
    a1 = 1 - a0
    want = a0 * (3.0 + 1.0) + a1 * (-1.0 + 2.0)
    got = shaw_ref(q, k, v, rel_k, rel_v, max_relative_position=1, past_length=1)
    assert abs(got.item() - want) < 1e-12


def test_oracle_txl_hand_example():
    # K=2, Q=1 -> M=1, query at position 1; r rows: t=0 -> d=1, t=1 -> d=0.
    q = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[1.0, 1.0], [0.0, 2.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64)
    r = torch.tensor([[[3.0, 0.0], [0.0, 5.0]]], dtype=torch.float64)
    u = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    w = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    s = 1 / math.sqrt(2)
    e0 = ((1 * 1 + 1 * 1) + (1 * 3 + 1 * 0)) * s  # j=0, d=1 -> r[0]
    e1 = ((1 * 0 + 1 * 2) + (1 * 0 + 1 * 5)) * s  # j=1, d=0 -> r[1]
    a0 = 1 / (1 + math.exp(e1 - e0))
    got = txl_ref(q, k, v, r, u, w, is_causal=True)
    assert torch.allclose(got, torch.tensor([[[[a0, 1 - a0]]]], dtype=torch.float64), atol=1e-12)


def test_oracles_agree_with_each_other():
    _, q, k, v, rk, rv = shaw_inputs(0, 2, 2, 3, 5, 4, 2)
    m = make_mask(gen(1), "float_inf", 2, 2, 3, 5)
    a = shaw_ref(q, k, v, rk, rv, max_relative_position=2, attention_mask=m, is_causal=True, past_length=2)
    b = shaw_torch_ref(q, k, v, rk, rv, max_relative_position=2, attention_mask=m, is_causal=True, past_length=2)
    assert_close64(b, a, 1e-12)
    _, q, k, v, r, u, w = txl_inputs(2, 2, 2, 3, 5, 4, 7)
    a = txl_ref(q, k, v, r, u, w, attention_mask=m, is_causal=False)
    b = txl_torch_ref(q, k, v, r, u, w, attention_mask=m, is_causal=False)
    assert_close64(b, a, 1e-12)


# ---------------------------------------------------------------------------
# Shaw et al. 2018 — values
# ---------------------------------------------------------------------------

# (B, H, Q, K, D, max_rel, past_length, mask_kind, is_causal, with_rel_v, mask_shape)
SHAW_CASES = [
    (2, 2, 4, 4, 4, 2, 0, None, False, True, None),
    (1, 2, 3, 6, 5, 1, 3, None, True, True, None),  # decode-like: K = past + Q
    (2, 1, 4, 7, 3, 3, 0, "bool", False, True, None),
    (2, 2, 3, 5, 4, 2, 2, "float_inf", True, True, None),
    (1, 3, 5, 5, 4, 0, 0, None, False, True, None),  # k = 0: a single relative row
    (2, 2, 4, 6, 4, 2, 1, "bool", True, False, None),  # keys only
    (1, 2, 4, 4, 4, 10, 0, None, True, True, None),  # k larger than any distance
    (1, 2, 2, 3, 4, 1, 5, None, False, True, None),  # queries after every key
    (2, 2, 3, 5, 4, 2, 0, "float_min", False, True, None),
    (2, 2, 3, 5, 4, 2, 0, "float_finite", False, True, None),
    (2, 3, 3, 5, 4, 2, 1, "bool", False, True, (3, 5)),  # [Q, K] broadcast
    (2, 3, 3, 5, 4, 2, 1, "float_inf", False, True, (2, 1, 1, 5)),  # padding-style
    (2, 3, 3, 5, 4, 2, 0, "bool", True, True, (1, 3, 3, 5)),
    (1, 1, 6, 6, 2, 3, 0, "float_inf", True, False, (1, 1, 6, 6)),
    (1, 2, 2, 3, 4, 1, 10**6, None, True, True, None),  # far-away queries: every distance clamps to -k
]


@pytest.mark.parametrize("case", SHAW_CASES, ids=lambda c: "-".join(map(str, c)))
def test_shaw_matches_oracle(case):
    B, H, Q, K, D, kk, past, mk, causal, with_rv, mshape = case
    g, q, k, v, rk, rv = shaw_inputs(seed_of(case), B, H, Q, K, D, kk, with_rel_v=with_rv)
    mask = make_mask(g, mk, B, H, Q, K, shape=mshape)
    got = F.shaw_attention(q, k, v, rk, rv, max_relative_position=kk, attention_mask=mask,
                           is_causal=causal, past_length=past)
    want = shaw_ref(q, k, v, rk, rv, max_relative_position=kk, attention_mask=mask,
                    is_causal=causal, past_length=past)
    assert got.dtype == torch.float64
    assert_close64(got, want)


@HYP_SMALL
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), Q=st.integers(1, 5), extra=st.integers(0, 4),
    D=st.integers(1, 5), kk=st.integers(0, 6), past=st.integers(0, 6),
    mk=st.sampled_from([None, "bool", "float_inf", "float_min"]), causal=st.booleans(),
    with_rv=st.booleans(), seed=st.integers(0, 2**16),
)
def test_shaw_matches_oracle_random(B, H, Q, extra, D, kk, past, mk, causal, with_rv, seed):
    K = Q + extra
    g, q, k, v, rk, rv = shaw_inputs(seed, B, H, Q, K, D, kk, with_rel_v=with_rv)
    mask = make_mask(g, mk, B, H, Q, K)
    got = F.shaw_attention(q, k, v, rk, rv, max_relative_position=kk, attention_mask=mask,
                           is_causal=causal, past_length=past)
    want = shaw_ref(q, k, v, rk, rv, max_relative_position=kk, attention_mask=mask,
                    is_causal=causal, past_length=past)
    assert_close64(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_finite_negative_mask_is_not_treated_as_masked(dtype):
    """Only -inf / finfo.min count as masked: a row shifted by a constant -1e4 is unchanged."""
    _, q, k, v, rk, rv = shaw_inputs(15, 1, 2, 3, 4, 4, 1, dtype=dtype)
    mask = torch.zeros(1, 2, 3, 4, dtype=dtype)
    mask[0, 1, 2, :] = -1e4
    # float32: score - 1e4 is only representable to ~1e-3 (ulp of 1e4), so the float32 bound is
    # set by the arithmetic, not by the implementation; the point is "not zeroed out".
    tol = 1e-3 if dtype == torch.float32 else ATOL64
    got = F.shaw_attention(q, k, v, rk, rv, max_relative_position=1, attention_mask=mask)
    plain = shaw_ref(q, k, v, rk, rv, max_relative_position=1)
    assert_close64(got, plain, tol)
    _, q, k, v, r, u, w = txl_inputs(16, 1, 2, 3, 4, 4, 6, dtype=dtype)
    got = F.transformer_xl_attention(q, k, v, r, u, w, attention_mask=mask, is_causal=False)
    assert_close64(got, txl_ref(q, k, v, r, u, w, is_causal=False), tol)


def test_non_contiguous_inputs():
    """Views in [B, Q, H, D] storage order (as produced by a projection + transpose) work."""
    g = gen(17)
    B, H, Q, K, D, kk = 2, 3, 4, 6, 4, 2
    q = randn(g, B, Q, H, D).transpose(1, 2)
    k = randn(g, B, K, H, D).transpose(1, 2)
    v = randn(g, B, K, H, D).transpose(1, 2)
    rk = randn(g, D, 2 * kk + 1).t()
    rv = randn(g, D, 2 * kk + 1).t()
    assert not q.is_contiguous() and not rk.is_contiguous()
    got = F.shaw_attention(q, k, v, rk, rv, max_relative_position=kk, is_causal=True, past_length=2)
    assert_close64(got, shaw_ref(q, k, v, rk, rv, max_relative_position=kk, is_causal=True, past_length=2))
    r = randn(g, K + Q - 1, H, D).transpose(0, 1)
    u = randn(g, D, H).t()
    w = randn(g, D, H).t()
    got = F.transformer_xl_attention(q, k, v, r, u, w, is_causal=False)
    assert_close64(got, txl_ref(q, k, v, r, u, w, is_causal=False))


def test_shaw_rel_v_none_equals_zero_rel_v():
    _, q, k, v, rk, rv = shaw_inputs(5, 2, 2, 4, 6, 4, 2)
    a = F.shaw_attention(q, k, v, rk, None, max_relative_position=2, is_causal=True, past_length=2)
    b = F.shaw_attention(q, k, v, rk, torch.zeros_like(rv), max_relative_position=2, is_causal=True,
                         past_length=2)
    assert_close64(a, b, 1e-12)


def test_shaw_incremental_rows_match_full_call():
    """Row i of a causal call equals a one-query call with past_length = i over keys 0..i."""
    B, H, Q, D, kk = 2, 2, 6, 4, 2
    _, q, k, v, rk, rv = shaw_inputs(11, B, H, Q, Q, D, kk)
    full = F.shaw_attention(q, k, v, rk, rv, max_relative_position=kk, is_causal=True)
    for i in range(Q):
        step = F.shaw_attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], rk, rv,
                                max_relative_position=kk, is_causal=True, past_length=i)
        assert_close64(step, full[:, :, i:i + 1], 1e-12)


def test_shaw_decode_step_long_cache():
    B, H, D, kk, K = 1, 2, 8, 4, 600
    _, q, k, v, rk, rv = shaw_inputs(12, B, H, 1, K, D, kk)
    got = F.shaw_attention(q, k, v, rk, rv, max_relative_position=kk, is_causal=True, past_length=K - 1)
    want = shaw_ref(q, k, v, rk, rv, max_relative_position=kk, is_causal=True, past_length=K - 1)
    assert_close64(got, want)


def test_shaw_large_case_rows_match_oracle():
    """B=1,H=2,Q=K=512,D=64,k=4: runs, and sampled rows match the loop oracle."""
    B, H, L, D, kk = 1, 2, 512, 64, 4
    g, q, k, v, rk, rv = shaw_inputs(13, B, H, L, L, D, kk)
    mask = make_mask(g, "bool", B, 1, L, L, shape=(B, 1, L, L))
    out = F.shaw_attention(q, k, v, rk, rv, max_relative_position=kk, attention_mask=mask, is_causal=True)
    assert out.shape == (B, H, L, D)
    assert torch.isfinite(out).all()
    for i in (0, 1, 137, 511):
        want = shaw_ref(q[:, :, i:i + 1], k, v, rk, rv, max_relative_position=kk,
                        attention_mask=mask[:, :, i:i + 1], is_causal=True, past_length=i)
        assert_close64(out[:, :, i:i + 1], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shaw_output_dtype(dtype):
    _, q, k, v, rk, rv = shaw_inputs(14, 1, 2, 3, 4, 4, 1, dtype=dtype)
    out = F.shaw_attention(q, k, v, rk, rv, max_relative_position=1)
    assert out.dtype == dtype and out.device == q.device and out.shape == (1, 2, 3, 4)
    want = shaw_ref(q, k, v, rk, rv, max_relative_position=1)
    tol = 1e-5 if dtype == torch.float32 else ATOL64
    assert_close64(out, want, tol)


# ---------------------------------------------------------------------------
# Transformer-XL — values
# ---------------------------------------------------------------------------

# (B, H, Q, K, D, R, is_causal, mask_kind, mask_shape)
TXL_CASES = [
    (2, 2, 3, 5, 4, 5, True, None, None),  # memory M=2, causal, R=K
    (2, 2, 4, 4, 4, 4, True, None, None),  # M=0, causal
    (2, 2, 3, 5, 4, 7, False, None, None),  # M=2, bidirectional, R=K+Q-1
    (1, 3, 4, 4, 3, 7, False, None, None),  # M=0, bidirectional
    (2, 2, 3, 5, 4, 7, True, None, None),  # causal with a table that also covers negatives
    (2, 2, 3, 6, 4, 6, True, "bool", None),
    (2, 2, 3, 6, 4, 8, False, "float_inf", None),
    (2, 1, 2, 5, 5, 5, True, "float_min", None),
    (2, 2, 3, 5, 4, 7, False, "bool", (2, 1, 1, 5)),
    (1, 2, 1, 1, 4, 1, True, None, None),  # single token
    (1, 2, 1, 7, 4, 7, True, None, None),  # one query after six memory tokens
]


@pytest.mark.parametrize("case", TXL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_txl_matches_oracle(case):
    B, H, Q, K, D, R, causal, mk, mshape = case
    g, q, k, v, r, u, w = txl_inputs(seed_of(case), B, H, Q, K, D, R)
    mask = make_mask(g, mk, B, H, Q, K, shape=mshape)
    got = F.transformer_xl_attention(q, k, v, r, u, w, attention_mask=mask, is_causal=causal)
    want = txl_ref(q, k, v, r, u, w, attention_mask=mask, is_causal=causal)
    assert got.dtype == torch.float64
    assert_close64(got, want)


@HYP_SMALL
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), Q=st.integers(1, 5), M=st.integers(0, 4),
    D=st.integers(1, 5), causal=st.booleans(), extra_r=st.booleans(),
    mk=st.sampled_from([None, "bool", "float_inf", "float_min"]), seed=st.integers(0, 2**16),
)
def test_txl_matches_oracle_random(B, H, Q, M, D, causal, extra_r, mk, seed):
    K = Q + M
    R = K + Q - 1 if (not causal or extra_r) else K
    g, q, k, v, r, u, w = txl_inputs(seed, B, H, Q, K, D, R)
    mask = make_mask(g, mk, B, H, Q, K)
    got = F.transformer_xl_attention(q, k, v, r, u, w, attention_mask=mask, is_causal=causal)
    want = txl_ref(q, k, v, r, u, w, attention_mask=mask, is_causal=causal)
    assert_close64(got, want)


def test_txl_is_causal_default_true():
    _, q, k, v, r, u, w = txl_inputs(21, 1, 2, 3, 5, 4, 5)
    got = F.transformer_xl_attention(q, k, v, r, u, w)
    assert_close64(got, txl_ref(q, k, v, r, u, w, is_causal=True))


def test_txl_incremental_rows_match_full_call():
    """Row i equals a one-query call whose keys stop at M+i, with the table cut to match."""
    B, H, Q, M, D = 2, 2, 4, 3, 4
    K = M + Q
    _, q, k, v, r, u, w = txl_inputs(22, B, H, Q, K, D, K)
    full = F.transformer_xl_attention(q, k, v, r, u, w, is_causal=True)
    for i in range(Q):
        Kp = M + i + 1
        step = F.transformer_xl_attention(q[:, :, i:i + 1], k[:, :, :Kp], v[:, :, :Kp], r[:, K - Kp:], u, w,
                                          is_causal=True)
        assert_close64(step, full[:, :, i:i + 1], 1e-12)


def test_txl_causal_ignores_negative_distance_rows():
    """With is_causal, rows of r for negative distances must not matter."""
    _, q, k, v, r, u, w = txl_inputs(23, 1, 2, 3, 5, 4, 7)
    a = F.transformer_xl_attention(q, k, v, r, u, w, is_causal=True)
    b = F.transformer_xl_attention(q, k, v, r[:, :5], u, w, is_causal=True)
    r2 = r.clone()
    r2[:, 5:] = 1e3
    c = F.transformer_xl_attention(q, k, v, r2, u, w, is_causal=True)
    assert_close64(a, b, 1e-12)
    assert_close64(c, b, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_txl_output_dtype(dtype):
    _, q, k, v, r, u, w = txl_inputs(24, 1, 2, 3, 5, 4, 5, dtype=dtype)
    out = F.transformer_xl_attention(q, k, v, r, u, w)
    assert out.dtype == dtype and out.shape == (1, 2, 3, 4)
    tol = 1e-5 if dtype == torch.float32 else ATOL64
    assert_close64(out, txl_ref(q, k, v, r, u, w), tol)


# ---------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------


SHAW_GRAD_CASES = [
    (1, 2, 3, 5, 4, 2, 2, None, True, True),
    (2, 1, 4, 4, 3, 1, 0, "bool", False, True),
    (1, 2, 3, 4, 4, 2, 0, "float_inf", False, False),
    (1, 1, 3, 6, 2, 5, 3, "float_min", True, True),
]


@pytest.mark.parametrize("case", SHAW_GRAD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_shaw_gradients_match_oracle(case):
    B, H, Q, K, D, kk, past, mk, causal, with_rv = case
    g, q, k, v, rk, rv = shaw_inputs(31 + seed_of(case), B, H, Q, K, D, kk, with_rel_v=with_rv)
    mask = make_mask(g, mk, B, H, Q, K)
    weights = randn(g, B, H, Q, D)
    leaves = [t for t in (q, k, v, rk, rv) if t is not None]

    def grads(fn):
        xs = [t.detach().clone().requires_grad_(True) for t in leaves]
        args = xs + ([None] if not with_rv else [])
        out = fn(*args, max_relative_position=kk, attention_mask=mask, is_causal=causal, past_length=past)
        return torch.autograd.grad((out * weights).sum(), xs)

    gf = grads(F.shaw_attention)
    go = grads(shaw_torch_ref)
    for name, a, b in zip(["q", "k", "v", "rel_k", "rel_v"], gf, go):
        assert_close64(a, b, what=name)


TXL_GRAD_CASES = [
    (1, 2, 3, 5, 4, 5, True, None),
    (1, 2, 3, 3, 4, 3, True, "bool"),
    (2, 1, 3, 5, 3, 7, False, "float_inf"),
    (1, 2, 2, 2, 4, 3, False, None),
]


@pytest.mark.parametrize("case", TXL_GRAD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_txl_gradients_match_oracle(case):
    B, H, Q, K, D, R, causal, mk = case
    g, *leaves = txl_inputs(41 + seed_of(case), B, H, Q, K, D, R)
    mask = make_mask(g, mk, B, H, Q, K)
    weights = randn(g, B, H, Q, D)

    def grads(fn):
        xs = [t.detach().clone().requires_grad_(True) for t in leaves]
        out = fn(*xs, attention_mask=mask, is_causal=causal)
        return torch.autograd.grad((out * weights).sum(), xs)

    for name, a, b in zip(["q", "k", "v", "r", "u", "w"], grads(F.transformer_xl_attention),
                          grads(txl_torch_ref)):
        assert_close64(a, b, what=name)


@pytest.mark.parametrize("mk,causal,past", [(None, False, 0), ("float_inf", True, 1), ("bool", False, 2)])
def test_shaw_gradcheck(mk, causal, past):
    g, q, k, v, rk, rv = shaw_inputs(51, 1, 2, 2, 3, 3, 1)
    mask = make_mask(g, mk, 1, 2, 2, 3)
    xs = tuple(t.requires_grad_(True) for t in (q, k, v, rk, rv))

    def fn(*a):
        return F.shaw_attention(*a, max_relative_position=1, attention_mask=mask, is_causal=causal,
                                past_length=past)

    assert torch.autograd.gradcheck(fn, xs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("causal,R,mk", [(True, 4, None), (False, 5, "bool"), (True, 5, "float_inf")])
def test_txl_gradcheck(causal, R, mk):
    g, *leaves = txl_inputs(52, 1, 2, 2, 4, 3, R)
    mask = make_mask(g, mk, 1, 2, 2, 4)
    xs = tuple(t.requires_grad_(True) for t in leaves)

    def fn(*a):
        return F.transformer_xl_attention(*a, attention_mask=mask, is_causal=causal)

    assert torch.autograd.gradcheck(fn, xs, eps=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------
# fully masked rows: zeros, never NaN, finite gradients
# ---------------------------------------------------------------------------

LOWP_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-1, torch.float16: 2e-2}


def _full_mask_pattern(kind, B, H, Q, K, dtype):
    """Mask with (b=0,h=1,i=2) and (b=1, all h, i=0) fully masked; others partially."""
    keep = torch.ones(B, H, Q, K, dtype=torch.bool)
    keep[0, 1, 2, :] = False
    keep[1, :, 0, :] = False
    keep[0, 0, 1, 3:] = False
    if kind == "bool":
        return keep
    fill = -math.inf if kind == "float_inf" else torch.finfo(dtype).min
    return torch.zeros(B, H, Q, K, dtype=dtype).masked_fill(~keep, fill)


def _dead_rows():
    return [(0, 1, 2), (1, 0, 0), (1, 1, 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["bool", "float_inf", "float_min"])
def test_shaw_fully_masked_rows_are_zero(dtype, kind):
    B, H, Q, K, D, kk = 2, 2, 4, 5, 8, 2
    _, q, k, v, rk, rv = shaw_inputs(61, B, H, Q, K, D, kk, dtype=dtype)
    mask = _full_mask_pattern(kind, B, H, Q, K, dtype)
    out = F.shaw_attention(q, k, v, rk, rv, max_relative_position=kk, attention_mask=mask, past_length=1)
    assert out.dtype == dtype
    assert not torch.isnan(out).any()
    for b, h, i in _dead_rows():
        assert (out[b, h, i] == 0).all(), (b, h, i, out[b, h, i])
    want = shaw_ref(q, k, v, rk, rv, max_relative_position=kk, attention_mask=mask, past_length=1)
    assert_close64(out.double(), want, LOWP_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["bool", "float_inf", "float_min"])
def test_txl_fully_masked_rows_are_zero(dtype, kind):
    B, H, Q, K, D = 2, 2, 4, 5, 8
    _, q, k, v, r, u, w = txl_inputs(62, B, H, Q, K, D, K + Q - 1, dtype=dtype)
    mask = _full_mask_pattern(kind, B, H, Q, K, dtype)
    for causal in (True, False):
        out = F.transformer_xl_attention(q, k, v, r, u, w, attention_mask=mask, is_causal=causal)
        assert out.dtype == dtype
        assert not torch.isnan(out).any()
        for b, h, i in _dead_rows():
            assert (out[b, h, i] == 0).all(), (causal, b, h, i, out[b, h, i])
        want = txl_ref(q, k, v, r, u, w, attention_mask=mask, is_causal=causal)
        assert_close64(out.double(), want, LOWP_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows_with_dropout(dtype):
    B, H, Q, K, D, kk = 2, 2, 4, 5, 8, 2
    _, q, k, v, rk, rv = shaw_inputs(67, B, H, Q, K, D, kk, dtype=dtype)
    mask = _full_mask_pattern("float_inf", B, H, Q, K, dtype)
    torch.manual_seed(1)
    out = F.shaw_attention(q, k, v, rk, rv, max_relative_position=kk, attention_mask=mask, dropout_p=0.5)
    assert not torch.isnan(out).any()
    for b, h, i in _dead_rows():
        assert (out[b, h, i] == 0).all()
    _, q, k, v, r, u, w = txl_inputs(68, B, H, Q, K, D, K + Q - 1, dtype=dtype)
    out = F.transformer_xl_attention(q, k, v, r, u, w, attention_mask=mask, is_causal=False, dropout_p=0.5)
    assert not torch.isnan(out).any()
    for b, h, i in _dead_rows():
        assert (out[b, h, i] == 0).all()


def test_shaw_causal_plus_mask_leaves_row_empty():
    """Causal allows only key 0 for query 0 (past_length=0); the mask removes it -> zeros."""
    _, q, k, v, rk, rv = shaw_inputs(63, 1, 1, 3, 3, 4, 1, dtype=torch.float32)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[0, 0, 0, 0] = False
    out = F.shaw_attention(q, k, v, rk, rv, max_relative_position=1, attention_mask=mask, is_causal=True)
    assert (out[0, 0, 0] == 0).all() and not torch.isnan(out).any()
    want = shaw_ref(q, k, v, rk, rv, max_relative_position=1, attention_mask=mask, is_causal=True)
    assert_close64(out, want, 1e-5)


def test_txl_causal_plus_mask_leaves_row_empty():
    _, q, k, v, r, u, w = txl_inputs(64, 1, 1, 3, 3, 4, 3, dtype=torch.float32)
    mask = torch.zeros(1, 1, 3, 3)
    mask[0, 0, 0, 0] = -math.inf
    out = F.transformer_xl_attention(q, k, v, r, u, w, attention_mask=mask, is_causal=True)
    assert (out[0, 0, 0] == 0).all() and not torch.isnan(out).any()
    assert_close64(out, txl_ref(q, k, v, r, u, w, attention_mask=mask, is_causal=True), 1e-5)


@pytest.mark.parametrize("kind", ["bool", "float_inf", "float_min"])
def test_fully_masked_gradients_finite(kind):
    dtype = torch.float32
    B, H, Q, K, D, kk = 2, 2, 4, 5, 8, 2
    g, q, k, v, rk, rv = shaw_inputs(65, B, H, Q, K, D, kk, dtype=dtype)
    mask = _full_mask_pattern(kind, B, H, Q, K, dtype)
    weights = randn(g, B, H, Q, D, dtype=dtype)
    xs = [t.requires_grad_(True) for t in (q, k, v, rk, rv)]
    out = F.shaw_attention(*xs, max_relative_position=kk, attention_mask=mask, past_length=1)
    grads = torch.autograd.grad((out * weights).sum(), xs)
    for gr in grads:
        assert torch.isfinite(gr).all()
    for b, h, i in _dead_rows():
        assert (grads[0][b, h, i] == 0).all()  # q of a dead row has no influence

    _, *leaves = txl_inputs(66, B, H, Q, K, D, K + Q - 1, dtype=dtype)
    xs = [t.requires_grad_(True) for t in leaves]
    for causal in (True, False):
        out = F.transformer_xl_attention(*xs, attention_mask=mask, is_causal=causal)
        grads = torch.autograd.grad((out * weights).sum(), xs)
        for gr in grads:
            assert torch.isfinite(gr).all()
        for b, h, i in _dead_rows():
            assert (grads[0][b, h, i] == 0).all()


# ---------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------


def test_dropout_zero_is_identity():
    _, q, k, v, rk, rv = shaw_inputs(71, 1, 2, 3, 4, 4, 1)
    a = F.shaw_attention(q, k, v, rk, rv, max_relative_position=1, dropout_p=0.0)
    assert_close64(a, shaw_ref(q, k, v, rk, rv, max_relative_position=1))
    _, q, k, v, r, u, w = txl_inputs(72, 1, 2, 3, 4, 4, 4)
    a = F.transformer_xl_attention(q, k, v, r, u, w, dropout_p=0.0)
    assert_close64(a, txl_ref(q, k, v, r, u, w))


def _check_unbiased(samples, ref):
    s = torch.stack(samples)
    mean, std = s.mean(0), s.std(0)
    n = s.shape[0]
    bound = 6 * std / math.sqrt(n) + 1e-9
    assert ((mean - ref).abs() <= bound).all(), ((mean - ref).abs() / (std / math.sqrt(n))).max()


def test_shaw_dropout_is_unbiased_and_active():
    """SDPA-style dropout on the attention weights with 1/(1-p) rescaling: E[out] = out(p=0)."""
    _, q, k, v, rk, rv = shaw_inputs(73, 1, 1, 2, 4, 3, 1)
    ref = shaw_ref(q, k, v, rk, rv, max_relative_position=1)
    torch.manual_seed(0)
    samples = [F.shaw_attention(q, k, v, rk, rv, max_relative_position=1, dropout_p=0.3) for _ in range(3000)]
    assert any((s - ref).abs().max() > 1e-6 for s in samples[:10])
    assert all(torch.isfinite(s).all() for s in samples)
    _check_unbiased(samples, ref)


def test_txl_dropout_is_unbiased_and_active():
    _, q, k, v, r, u, w = txl_inputs(74, 1, 1, 2, 4, 3, 4)
    ref = txl_ref(q, k, v, r, u, w)
    torch.manual_seed(0)
    samples = [F.transformer_xl_attention(q, k, v, r, u, w, dropout_p=0.3) for _ in range(3000)]
    assert any((s - ref).abs().max() > 1e-6 for s in samples[:10])
    _check_unbiased(samples, ref)


# ---------------------------------------------------------------------------
# T5 buckets — bit-identical to upstream
# ---------------------------------------------------------------------------


@st.composite
def t5_config(draw):
    bidirectional = draw(st.booleans())
    nb = draw(st.integers(4 if bidirectional else 2, 128))
    me = max_exact_of(nb, bidirectional)
    md = draw(st.one_of(st.just(me + 1), st.integers(me + 1, me + 20), st.integers(me + 1, 5000)))
    return bidirectional, nb, md


REL_POS = st.one_of(st.integers(-300, 300), st.integers(-10**6, 10**6))


@HYP
@given(cfg=t5_config(), xs=st.lists(REL_POS, min_size=1, max_size=64),
       dtype=st.sampled_from([torch.int64, torch.int32, torch.int16, torch.int8]))
def test_t5_bucket_matches_upstream_random(cfg, xs, dtype):
    bidirectional, nb, md = cfg
    lim = {torch.int16: 2**15 - 1, torch.int8: 2**7 - 1}.get(dtype)
    if lim is not None:  # keep |x| representable (abs(-128) overflows int8 upstream too)
        xs = [max(-lim, min(lim, x)) for x in xs]
    rp = torch.tensor(xs, dtype=dtype)
    got = F.t5_relative_position_bucket(rp, bidirectional=bidirectional, num_buckets=nb, max_distance=md)
    want = upstream_bucket(rp, bidirectional, nb, md)
    assert got.dtype == torch.int64
    assert got.shape == rp.shape
    assert torch.equal(got, want.long())
    assert int(got.min()) >= 0 and int(got.max()) < nb


def test_t5_bucket_matches_upstream_exhaustive():
    """Every valid num_buckets in 2..128, both directions, a few max_distances, |x| <= 3000."""
    rp = torch.cat([
        torch.arange(-3000, 3001),
        torch.tensor([-(2**31 - 1), -10**9, -10**6, -999_999, 999_999, 10**6, 10**9, 2**31 - 1]),
    ])
    for bidirectional in (True, False):
        for nb in range(4 if bidirectional else 2, 129):
            me = max_exact_of(nb, bidirectional)
            for md in sorted({me + 1, me + 2, 2 * me + 1, 128, 1000} - set(range(me + 1))):
                got = F.t5_relative_position_bucket(rp, bidirectional=bidirectional, num_buckets=nb,
                                                    max_distance=md)
                want = upstream_bucket(rp, bidirectional, nb, md)
                assert torch.equal(got, want), (bidirectional, nb, md)


def test_t5_bucket_defaults_and_2d_shape():
    rp = torch.arange(-200, 200).view(20, 20)
    got = F.t5_relative_position_bucket(rp)
    assert got.shape == (20, 20)
    assert torch.equal(got, upstream_bucket(rp, True, 32, 128))
    # a few well-known values for the T5 default (bidirectional, 32 buckets, 128)
    known = F.t5_relative_position_bucket(torch.tensor([0, 1, -1, 7, -7, 8, -8, 127, 128, -128, 10**6]))
    assert known.tolist() == upstream_bucket(torch.tensor([0, 1, -1, 7, -7, 8, -8, 127, 128, -128, 10**6]),
                                             True, 32, 128).tolist()
    assert known.tolist()[:5] == [0, 17, 1, 23, 7]


@pytest.mark.parametrize("bidirectional,nb", [(True, 0), (True, 1), (True, 2), (True, 3), (False, 0), (False, 1)])
def test_t5_bucket_too_few_buckets_raises(bidirectional, nb):
    with pytest.raises(ValueError) as ei:
        F.t5_relative_position_bucket(torch.arange(-5, 5), bidirectional=bidirectional, num_buckets=nb,
                                      max_distance=128)
    assert_names(ei, "num_buckets")


@HYP
@given(cfg=t5_config(), delta=st.integers(0, 50))
def test_t5_bucket_small_max_distance_raises(cfg, delta):
    bidirectional, nb, _ = cfg
    me = max_exact_of(nb, bidirectional)
    md = me - delta  # <= max_exact
    with pytest.raises(ValueError) as ei:
        F.t5_relative_position_bucket(torch.arange(-5, 5), bidirectional=bidirectional, num_buckets=nb,
                                      max_distance=md)
    assert_names(ei, "max_distance")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_t5_bucket_float_input_raises_type_error(dtype):
    with pytest.raises(TypeError):
        F.t5_relative_position_bucket(torch.arange(-5, 5).to(dtype))


# ---------------------------------------------------------------------------
# T5 position bias — equal to upstream compute_bias
# ---------------------------------------------------------------------------


def upstream_bias(weight, Q, K, bidirectional, md, past):
    from transformers import T5Config

    nb, H = weight.shape
    cfg = T5Config(d_model=8, d_kv=4, num_heads=H, relative_attention_num_buckets=nb,
                   relative_attention_max_distance=md, is_decoder=not bidirectional, num_layers=1)
    attn = upstream_t5()(cfg, has_relative_attention_bias=True, layer_idx=0).to(weight.dtype)
    with torch.no_grad():
        attn.relative_attention_bias.weight.copy_(weight)
        return attn.compute_bias(Q, K, past_seen_tokens=past)


@HYP
@given(cfg=t5_config(), H=st.integers(1, 4), Q=st.integers(1, 24), K=st.integers(1, 24),
       past=st.one_of(st.integers(0, 40), st.integers(0, 10**5)), seed=st.integers(0, 2**16))
def test_t5_position_bias_matches_upstream_random(cfg, H, Q, K, past, seed):
    bidirectional, nb, md = cfg
    weight = torch.randn(nb, H, generator=gen(seed))
    got = F.t5_position_bias(weight, Q, K, bidirectional=bidirectional, max_distance=md, past_length=past)
    want = upstream_bias(weight, Q, K, bidirectional, md, past)
    assert got.shape == (1, H, Q, K)
    assert got.dtype == weight.dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "Q,K,past,bidirectional,nb,md",
    [
        (1, 5000, 4999, False, 32, 128),
        (1, 5000, 4999, True, 32, 128),
        (300, 300, 0, True, 32, 128),
        (256, 256, 0, False, 128, 2048),
        (3, 10, 10**6, False, 16, 64),
        (64, 64, 0, True, 4, 2),
        (8, 40, 32, False, 2, 2),
    ],
)
def test_t5_position_bias_long_sequences(Q, K, past, bidirectional, nb, md):
    weight = torch.randn(nb, 3, generator=gen(Q + K + nb))
    got = F.t5_position_bias(weight, Q, K, bidirectional=bidirectional, max_distance=md, past_length=past)
    want = upstream_bias(weight, Q, K, bidirectional, md, past)
    assert torch.equal(got, want)


def test_t5_position_bias_defaults_and_dtypes():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        weight = torch.randn(32, 2, generator=gen(3)).to(dtype)
        got = F.t5_position_bias(weight, 5, 7)
        assert got.dtype == dtype
        assert torch.equal(got, upstream_bias(weight, 5, 7, True, 128, 0))


def test_t5_position_bias_gradient_flows_to_weight():
    weight = torch.randn(32, 2, generator=gen(4), dtype=torch.float64, requires_grad=True)
    out = F.t5_position_bias(weight, 6, 6, bidirectional=False)
    (gw,) = torch.autograd.grad(out.sum(), weight)
    # each (i, j) pair adds 1 to the gradient of its bucket row, for every head
    counts = torch.bincount(upstream_bucket(torch.arange(6)[None] - torch.arange(6)[:, None], False, 32, 128)
                            .flatten(), minlength=32).double()
    assert torch.equal(gw, counts[:, None].expand(32, 2))


def test_t5_position_bias_errors():
    w = torch.randn(32, 2)
    with pytest.raises(ValueError) as ei:
        F.t5_position_bias(torch.randn(32), 3, 3)
    assert_names(ei, "weight")
    with pytest.raises(ValueError) as ei:
        F.t5_position_bias(torch.randn(32, 2, 1), 3, 3)
    assert_names(ei, "weight")
    with pytest.raises(ValueError) as ei:
        F.t5_position_bias(w, -1, 3)
    assert_names(ei, "query_length")
    with pytest.raises(ValueError) as ei:
        F.t5_position_bias(w, 3, -1)
    assert_names(ei, "key_length")
    with pytest.raises(ValueError) as ei:
        F.t5_position_bias(w, 3, 3, past_length=-1)
    assert_names(ei, "past_length")
    with pytest.raises(ValueError) as ei:
        F.t5_position_bias(w, 3, 3, max_distance=8)  # max_exact = 8 for 32 bidirectional buckets
    assert_names(ei, "max_distance")
    with pytest.raises(ValueError) as ei:
        F.t5_position_bias(torch.randn(2, 2), 3, 3, bidirectional=True)  # max_exact = 0
    assert_names(ei, "num_buckets", "weight")


# ---------------------------------------------------------------------------
# sinusoidal embedding
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [2, 4, 8, 16, 64])
def test_sinusoidal_matches_oracle_txl_positions(dim):
    pos = torch.arange(19, -1, -1.0, dtype=torch.float64)  # K-1 ... 0, as Transformer-XL builds R
    got = F.sinusoidal_embedding(pos, dim)
    assert got.shape == (20, dim) and got.dtype == torch.float64
    assert_close64(got, sinusoidal_ref(pos, dim), 1e-12)


@HYP_SMALL
@given(xs=st.lists(st.floats(-200, 200, allow_nan=False), min_size=1, max_size=20),
       half=st.integers(1, 40))
def test_sinusoidal_matches_oracle_random(xs, half):
    pos = torch.tensor(xs, dtype=torch.float64)
    got = F.sinusoidal_embedding(pos, 2 * half)
    assert_close64(got, sinusoidal_ref(pos, 2 * half), 1e-10)


def test_sinusoidal_layout_sin_first():
    got = F.sinusoidal_embedding(torch.tensor([0.0, 1.0], dtype=torch.float64), 4)
    want = torch.tensor([[0.0, 0.0, 1.0, 1.0],
                         [math.sin(1.0), math.sin(0.01), math.cos(1.0), math.cos(0.01)]], dtype=torch.float64)
    assert_close64(got, want, 1e-12)


def test_sinusoidal_float32_and_integer_positions():
    pos = torch.arange(0, 50)
    want = sinusoidal_ref(pos, 32)
    got32 = F.sinusoidal_embedding(pos.float(), 32)
    assert got32.dtype == torch.float32
    assert_close64(got32, want, 2e-5)
    got_int = F.sinusoidal_embedding(pos, 32)
    assert got_int.is_floating_point()
    assert_close64(got_int, want, 2e-5)


@pytest.mark.parametrize("dim", [0, -2, 3, 7])
def test_sinusoidal_bad_dim_raises(dim):
    with pytest.raises(ValueError) as ei:
        F.sinusoidal_embedding(torch.arange(4.0), dim)
    assert_names(ei, "dim")


# ---------------------------------------------------------------------------
# log-decay bias
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("Q,K,past,scale", [(4, 4, 0, 1.0), (3, 7, 4, 0.5), (1, 50, 49, 2.25), (5, 3, 10, 0.0),
                                            (6, 9, 0, 1e-3)])
def test_log_decay_matches_oracle(Q, K, past, scale):
    got = F.log_decay_bias(Q, K, scale=scale, past_length=past, dtype=torch.float64)
    assert got.shape == (Q, K) and got.dtype == torch.float64
    assert_close64(got, log_decay_ref(Q, K, scale=scale, past_length=past), 1e-12)


def test_log_decay_dtype_and_device():
    got = F.log_decay_bias(3, 5, scale=1.0, dtype=torch.float32, device="cpu")
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    assert_close64(got, log_decay_ref(3, 5, scale=1.0), 1e-6)
    assert F.log_decay_bias(3, 5, scale=1.0).is_floating_point()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_log_decay_scale_beyond_the_dtype_has_no_nan(dtype):
    """A scale past float32's range (the compute dtype of every dtype but float64) gives 0 on the diagonal and
    -inf at every other distance, as the exact product rounds to, not NaN (-inf * ln 1) on the diagonal."""
    got = F.log_decay_bias(3, 5, scale=1e39, past_length=2, dtype=dtype)
    exact = log_decay_ref(3, 5, scale=1e39, past_length=2).to(dtype)  # float64, then rounded
    assert not got.isnan().any()
    assert torch.equal(got == 0, exact == 0) and (got[exact != 0].float() < -1e38).all()


def test_log_decay_errors():
    with pytest.raises(ValueError) as ei:
        F.log_decay_bias(3, 3, scale=-0.1)
    assert_names(ei, "scale")
    with pytest.raises(ValueError) as ei:
        F.log_decay_bias(-1, 3, scale=1.0)
    assert_names(ei, "query_length")
    with pytest.raises(ValueError) as ei:
        F.log_decay_bias(3, -1, scale=1.0)
    assert_names(ei, "key_length")
    with pytest.raises(ValueError) as ei:
        F.log_decay_bias(3, 3, scale=1.0, past_length=-2)
    assert_names(ei, "past_length")


# ---------------------------------------------------------------------------
# ALiBi
# ---------------------------------------------------------------------------


def test_alibi_oracle_published_values():
    assert alibi_slopes_ref(8) == [2.0 ** -e for e in range(1, 9)]
    assert alibi_slopes_ref(1) == [2.0 ** -8]
    assert alibi_slopes_ref(3) == [2.0 ** -4, 2.0 ** -8, 2.0 ** -2]
    assert alibi_slopes_ref(16) == pytest.approx([2.0 ** (-0.5 * e) for e in range(1, 17)], rel=1e-15)
    assert alibi_slopes_ref(12) == pytest.approx(
        [2.0 ** -e for e in range(1, 9)] + [2.0 ** -(e + 0.5) for e in range(4)], rel=1e-15)


@pytest.mark.parametrize("n", list(range(1, 65)) + [80, 96, 100, 128])
def test_alibi_slopes_match_oracle(n):
    got = F.alibi_slopes(n, dtype=torch.float64)
    assert got.shape == (n,) and got.dtype == torch.float64
    want = torch.tensor(alibi_slopes_ref(n), dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-13, atol=0), (got - want).abs().max()


def test_alibi_slopes_published():
    def check(n, values):
        got = F.alibi_slopes(n, dtype=torch.float64)
        want = torch.tensor(values, dtype=torch.float64)
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-14, atol=0), (n, got)

    check(8, [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256])
    check(16, [2 ** (-0.5 * e) for e in range(1, 17)])
    check(1, [1 / 256])
    check(2, [1 / 16, 1 / 256])
    check(3, [1 / 16, 1 / 256, 1 / 4])
    check(6, [2 ** (-2 * e) for e in range(1, 5)] + [2 ** -1, 2 ** -3])
    assert F.alibi_slopes(8).is_floating_point()


@pytest.mark.parametrize("n", [1, 3, 5, 6, 8, 12, 20, 24, 32, 40, 71])
def test_alibi_slopes_agree_with_bloom(n):
    """Independent cross-check against Transformers' BLOOM ALiBi (float32)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 3, dtype=torch.long), n, torch.float32)  # [n, 1, 3]
    bloom = alibi[:, 0, 1].double()  # slope * position 1
    got = F.alibi_slopes(n, dtype=torch.float64)
    assert torch.allclose(got, bloom, rtol=1e-6, atol=0)


@pytest.mark.parametrize("n", [0, -1])
def test_alibi_slopes_bad_heads(n):
    with pytest.raises(ValueError) as ei:
        F.alibi_slopes(n)
    assert_names(ei, "num_heads")


@pytest.mark.parametrize("Q,K,past,H", [(4, 4, 0, 4), (3, 7, 4, 3), (1, 30, 29, 8), (5, 3, 9, 2), (6, 9, 0, 1)])
def test_alibi_bias_matches_oracle(Q, K, past, H):
    slopes = torch.rand(H, generator=gen(H), dtype=torch.float64)
    got = F.alibi_bias(slopes, Q, K, past_length=past)
    assert got.shape == (1, H, Q, K) and got.dtype == torch.float64
    assert_close64(got, alibi_bias_ref(slopes, Q, K, past_length=past), 1e-12)


def test_alibi_bias_float32_and_published_slopes():
    slopes = F.alibi_slopes(8, dtype=torch.float32)
    got = F.alibi_bias(slopes, 3, 5, past_length=2)
    assert got.dtype == torch.float32
    assert_close64(got, alibi_bias_ref(slopes, 3, 5, past_length=2), 1e-6)


def test_alibi_bias_errors():
    s = torch.ones(4)
    with pytest.raises(ValueError) as ei:
        F.alibi_bias(torch.ones(2, 2), 3, 3)
    assert_names(ei, "slopes")
    with pytest.raises(ValueError) as ei:
        F.alibi_bias(s, -1, 3)
    assert_names(ei, "query_length")
    with pytest.raises(ValueError) as ei:
        F.alibi_bias(s, 3, -1)
    assert_names(ei, "key_length")
    with pytest.raises(ValueError) as ei:
        F.alibi_bias(s, 3, 3, past_length=-1)
    assert_names(ei, "past_length")


# ---------------------------------------------------------------------------
# argument errors — attention functions
# ---------------------------------------------------------------------------


def _shaw_ok():
    _, q, k, v, rk, rv = shaw_inputs(81, 2, 2, 3, 4, 4, 2)
    return dict(q=q, k=k, v=v, rel_k=rk, rel_v=rv)


def _call_shaw(kw, **opts):
    kw = dict(kw)
    opts.setdefault("max_relative_position", 2)
    return F.shaw_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("rel_k"), kw.pop("rel_v"), **opts)


@pytest.mark.parametrize(
    "name,mutate,opts,errname",
    [
        ("q_rank", lambda d: d.update(q=d["q"][0]), {}, "q"),
        ("k_rank", lambda d: d.update(k=d["k"][0]), {}, "k"),
        ("v_rank", lambda d: d.update(v=d["v"][0]), {}, "v"),
        ("k_headdim", lambda d: d.update(k=d["k"][..., :3]), {}, "k"),
        ("v_len", lambda d: d.update(v=d["v"][:, :, :3]), {}, "v"),
        ("k_batch", lambda d: d.update(k=d["k"][:1], v=d["v"][:1]), {}, "k"),
        ("rel_k_rows", lambda d: d.update(rel_k=d["rel_k"][:4]), {}, "rel_k"),
        ("rel_k_dim", lambda d: d.update(rel_k=d["rel_k"][:, :3]), {}, "rel_k"),
        ("rel_k_rank", lambda d: d.update(rel_k=d["rel_k"][None]), {}, "rel_k"),
        ("rel_v_rows", lambda d: d.update(rel_v=d["rel_v"][:4]), {}, "rel_v"),
        ("rel_v_dim", lambda d: d.update(rel_v=d["rel_v"][:, :3]), {}, "rel_v"),
        ("max_rel_neg", lambda d: None, {"max_relative_position": -1}, "max_relative_position"),
        ("past_neg", lambda d: None, {"past_length": -1}, "past_length"),
        ("dropout_one", lambda d: None, {"dropout_p": 1.0}, "dropout_p"),
        ("dropout_neg", lambda d: None, {"dropout_p": -0.1}, "dropout_p"),
        ("dropout_big", lambda d: None, {"dropout_p": 1.5}, "dropout_p"),
        ("mask_shape", lambda d: None, {"attention_mask": torch.ones(2, 2, 3, 5, dtype=torch.bool)},
         "attention_mask"),
        ("mask_shape_b", lambda d: None, {"attention_mask": torch.zeros(3, 1, 1, 4, dtype=torch.float64)},
         "attention_mask"),
        ("mask_rank5", lambda d: None, {"attention_mask": torch.ones(1, 2, 2, 3, 4, dtype=torch.bool)},
         "attention_mask"),
    ],
)
def test_shaw_bad_arguments(name, mutate, opts, errname):
    kw = _shaw_ok()
    mutate(kw)
    with pytest.raises(ValueError) as ei:
        _call_shaw(kw, **opts)
    assert_names(ei, errname)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_shaw_integer_mask_rejected(dtype):
    kw = _shaw_ok()
    with pytest.raises((ValueError, TypeError)) as ei:
        _call_shaw(kw, attention_mask=torch.ones(2, 2, 3, 4, dtype=dtype))
    assert_names(ei, "attention_mask")


def _txl_ok(Q=3, K=5, R=None):
    _, q, k, v, r, u, w = txl_inputs(82, 2, 2, Q, K, 4, R if R is not None else K)
    return dict(q=q, k=k, v=v, r=r, u=u, w=w)


def _call_txl(kw, **opts):
    return F.transformer_xl_attention(kw["q"], kw["k"], kw["v"], kw["r"], kw["u"], kw["w"], **opts)


@pytest.mark.parametrize(
    "name,mutate,opts,errname",
    [
        ("q_rank", lambda d: d.update(q=d["q"][0]), {}, "q"),
        ("k_rank", lambda d: d.update(k=d["k"][0]), {}, "k"),
        ("k_shorter_than_q", lambda d: d.update(k=d["k"][:, :, :2], v=d["v"][:, :, :2], r=d["r"][:, :2]), {},
         "k"),
        ("v_len", lambda d: d.update(v=d["v"][:, :, :4]), {}, "v"),
        ("k_headdim", lambda d: d.update(k=d["k"][..., :3]), {}, "k"),
        ("r_rank", lambda d: d.update(r=d["r"][0]), {}, "r"),
        ("r_heads", lambda d: d.update(r=d["r"][:1]), {}, "r"),
        ("r_dim", lambda d: d.update(r=d["r"][..., :3]), {}, "r"),
        ("r_too_short_causal", lambda d: d.update(r=d["r"][:, :4]), {}, "r"),
        ("r_too_short_bidir", lambda d: None, {"is_causal": False}, "r"),
        ("u_shape", lambda d: d.update(u=d["u"][:, :3]), {}, "u"),
        ("u_rank", lambda d: d.update(u=d["u"][0]), {}, "u"),
        ("w_shape", lambda d: d.update(w=d["w"][:1]), {}, "w"),
        ("dropout_one", lambda d: None, {"dropout_p": 1.0}, "dropout_p"),
        ("dropout_neg", lambda d: None, {"dropout_p": -0.5}, "dropout_p"),
        ("mask_shape", lambda d: None, {"attention_mask": torch.ones(2, 2, 3, 4, dtype=torch.bool)},
         "attention_mask"),
    ],
)
def test_txl_bad_arguments(name, mutate, opts, errname):
    kw = _txl_ok()
    mutate(kw)
    with pytest.raises(ValueError) as ei:
        _call_txl(kw, **opts)
    assert_names(ei, errname)


def test_txl_bidirectional_r_one_short_raises():
    kw = _txl_ok(Q=3, K=5, R=6)  # needs K+Q-1 = 7
    with pytest.raises(ValueError) as ei:
        _call_txl(kw, is_causal=False)
    assert_names(ei, "r")
    # but it is fine for causal use
    _call_txl(kw, is_causal=True)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8])
def test_txl_integer_mask_rejected(dtype):
    kw = _txl_ok()
    with pytest.raises((ValueError, TypeError)) as ei:
        _call_txl(kw, attention_mask=torch.zeros(2, 2, 3, 5, dtype=dtype))
    assert_names(ei, "attention_mask")


# ---------------------------------------------------------------------------
# device agnosticism (runs only where CUDA is present)
# ---------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    dev = torch.device("cuda")
    _, q, k, v, rk, rv = shaw_inputs(91, 2, 2, 4, 6, 8, 2)
    mask = make_mask(gen(92), "float_inf", 2, 2, 4, 6)
    cpu = F.shaw_attention(q, k, v, rk, rv, max_relative_position=2, attention_mask=mask, is_causal=True,
                           past_length=2)
    gpu = F.shaw_attention(*(t.to(dev) for t in (q, k, v, rk, rv)), max_relative_position=2,
                           attention_mask=mask.to(dev), is_causal=True, past_length=2)
    assert gpu.device.type == "cuda"
    assert_close64(gpu.cpu(), cpu, 1e-10)
    _, q, k, v, r, u, w = txl_inputs(93, 2, 2, 4, 6, 8, 9)
    cpu = F.transformer_xl_attention(q, k, v, r, u, w, attention_mask=mask, is_causal=False)
    gpu = F.transformer_xl_attention(*(t.to(dev) for t in (q, k, v, r, u, w)), attention_mask=mask.to(dev),
                                     is_causal=False)
    assert_close64(gpu.cpu(), cpu, 1e-10)
    wt = torch.randn(32, 4)
    assert torch.equal(F.t5_position_bias(wt.to(dev), 7, 9, past_length=3).cpu(),
                       F.t5_position_bias(wt, 7, 9, past_length=3))
    assert F.alibi_slopes(8, device=dev).device.type == "cuda"
    assert F.log_decay_bias(3, 4, scale=1.0, device=dev).device.type == "cuda"


# ---------------------------------------------------------------------------
# A cache's offset as a traced tensor (compiled decoding)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("past", [0, 5, 40])
def test_traced_tensor_offset_gives_the_int_offsets_result(past):
    """Under torch.compile a static cache's offset is a 0-d tensor: the position functions take it without
    reading it on the host (no ``.item()`` in the graph) and give what the int offset gives (T5's bias
    through its own path)."""
    import torch._dynamo

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(32, 4, generator=g)
    slopes = F.alibi_slopes(4)
    q = torch.randn(2, 4, 2, 8, generator=g)
    k, v = (torch.randn(2, 4, 48, 8, generator=g) for _ in range(2))
    rel_k, rel_v = torch.randn(7, 8, generator=g), torch.randn(7, 8, generator=g)

    def terms(p):
        return (
            F.t5_position_bias(weight, 2, 48, bidirectional=False, max_distance=20, past_length=p),
            F.t5_position_bias(weight, 2, 48, bidirectional=True, max_distance=20, past_length=p),
            F.alibi_bias(slopes, 2, 48, past_length=p),
            F.log_decay_bias(2, 48, scale=0.3, past_length=p),
            F.shaw_attention(q, k, v, rel_k, rel_v, max_relative_position=3, is_causal=True, past_length=p),
        )

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    traced = torch.compile(terms, fullgraph=True, backend=record)(torch.tensor(past))
    # No host read of the offset in the graph: a sync that CUDA graphs (generate's default mode) cannot hold.
    calls = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert not [c for c in calls if c == "item" or "local_scalar_dense" in c], calls
    for got, expected in zip(traced, terms(past)):
        assert got.shape == expected.shape
        assert torch.equal(got, expected) or torch.allclose(got, expected, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------
# KERPLE (logarithmic) and FIRE
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("Q,K,past,H", [(4, 4, 0, 4), (3, 7, 4, 3), (1, 30, 29, 8), (5, 3, 9, 2)])
def test_kerple_log_bias_matches_oracle_values_and_gradients(Q, K, past, H):
    g = gen(Q * 100 + K)
    r1 = (torch.rand(H, generator=g, dtype=torch.float64) * 2 + 0.01).requires_grad_()
    r2 = (torch.rand(H, generator=g, dtype=torch.float64) + 0.01).requires_grad_()
    got = F.kerple_log_bias(r1, r2, Q, K, past_length=past)
    assert got.shape == (1, H, Q, K) and got.dtype == torch.float64
    assert_close64(got, kerple_log_ref(r1.detach(), r2.detach(), Q, K, past_length=past), 1e-12)
    # gradients against the closed form: d/dr1 = -ln(1 + r2 d), d/dr2 = -r1 d / (1 + r2 d)
    weights = torch.randn(1, H, Q, K, generator=g, dtype=torch.float64)
    g1, g2 = torch.autograd.grad((got * weights).sum(), (r1, r2))
    d = torch.tensor([[abs(j - (past + i)) for j in range(K)] for i in range(Q)], dtype=torch.float64)
    a, b = r1.detach()[:, None, None], r2.detach()[:, None, None]
    assert_close64(g1, (weights[0] * -torch.log1p(b * d)).sum((1, 2)), 1e-10)
    assert_close64(g2, (weights[0] * -a * d / (1 + b * d)).sum((1, 2)), 1e-10)


def test_kerple_log_bias_generalises_log_decay():
    """r1 = scale, r2 = 1 is the fixed log-decay bias."""
    got = F.kerple_log_bias(torch.full((3,), 0.7, dtype=torch.float64), torch.ones(3, dtype=torch.float64), 4, 9,
                            past_length=5)
    assert_close64(got[0, 2], log_decay_ref(4, 9, scale=0.7, past_length=5), 1e-12)


def test_kerple_log_bias_errors():
    ok = torch.ones(4)
    for r1, r2, name in ((torch.tensor([1.0, 0.0, 1.0, 1.0]), ok, "r1"), (ok, -ok, "r2"), (ok, torch.ones(3), "r2"),
                         (torch.ones(2, 2), ok, "r1")):
        with pytest.raises(ValueError) as ei:
            F.kerple_log_bias(r1, r2, 3, 3)
        assert_names(ei, name)
    with pytest.raises(ValueError) as ei:
        F.kerple_log_bias(ok, ok, 3, 3, past_length=-2)
    assert_names(ei, "past_length")


def _fire_params(H, width, seed, dtype=torch.float64):
    g = gen(seed)
    w1, b1 = torch.randn(width, 1, generator=g, dtype=dtype), torch.randn(width, generator=g, dtype=dtype)
    w2, b2 = torch.randn(H, width, generator=g, dtype=dtype), torch.randn(H, generator=g, dtype=dtype)
    return [w1, b1, w2, b2, torch.tensor(0.3, dtype=dtype), torch.tensor(6.0, dtype=dtype)]


@pytest.mark.parametrize("Q,K,past", [(5, 5, 0), (3, 12, 9), (1, 20, 19), (4, 6, 0)])
def test_fire_bias_matches_oracle_values_and_gradients(Q, K, past):
    """Rows below and beyond the threshold L = 6 (the normaliser switches from psi(L) to psi(p_i)); the
    gradients of all six parameters against the scalar oracle's."""
    params = [t.requires_grad_() for t in _fire_params(3, 5, Q * 31 + K)]
    got = F.fire_bias(*params, Q, K, past_length=past)
    expected = fire_torch_ref(*params, Q, K, past_length=past)
    assert got.shape == (1, 3, Q, K) and got.dtype == torch.float64
    assert_close64(got, expected.detach(), 1e-12)
    weights = torch.randn(1, 3, Q, K, generator=gen(7), dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), params)
    expected_grads = torch.autograd.grad((expected * weights).sum(), params)
    for name, a, b in zip(("w1", "b1", "w2", "b2", "c", "threshold"), grads, expected_grads):
        assert_close64(a, b, 1e-10, what=name)


def test_fire_bias_reads_each_rows_query_positions():
    """The normaliser takes the query's position in its sequence (``positions``, one row per batch entry) while
    the distance stays the index distance: rows with other positions give other biases, each the oracle's."""
    params = _fire_params(2, 4, 11)
    positions = torch.tensor([[9, 10, 11], [0, 1, 2], [30, 31, 32]])  # e.g. a sliding window, padding, packing
    got = F.fire_bias(*params, 3, 8, past_length=5, positions=positions)
    assert got.shape == (3, 2, 3, 8)
    for row in range(3):
        expected = fire_torch_ref(*params, 3, 8, past_length=5, positions=positions[row])
        assert_close64(got[row : row + 1], expected, 1e-12, what=f"row {row}")
    assert not torch.allclose(got[0], got[2])  # past the threshold (6) the position matters
    with pytest.raises(ValueError) as ei:
        F.fire_bias(*params, 3, 8, positions=torch.zeros(3, 2))
    assert_names(ei, "positions")


def test_fire_bias_errors():
    w1, b1, w2, b2, c, threshold = _fire_params(2, 4, 1)
    with pytest.raises(ValueError) as ei:
        F.fire_bias(w1, b1, w2[:, :3], b2, c, threshold, 3, 3)
    assert_names(ei, "w2")
    with pytest.raises(ValueError) as ei:
        F.fire_bias(w1, b1, w2, b2, c.reshape(1), threshold, 3, 3)
    assert_names(ei, "c")
    with pytest.raises(ValueError) as ei:
        F.fire_bias(w1, b1, w2, b2, c, threshold, 3, 3, past_length=-1)
    assert_names(ei, "past_length")



# ---------------------------------------------------------------------------
# The public module: hf_relpos.functional re-exports functional_relpos (the file remote code copies)
# ---------------------------------------------------------------------------


def test_the_public_module_reexports_the_implementation():
    """``hf_relpos.functional`` keeps its public name and its functions; the code lives in ``functional_relpos``,
    which the models import and ``save_pretrained`` copies under a name no installed package has. Each public name
    is the same object in both, with the same ``__all__``, and the public module's docstring keeps the legend its
    functions' shapes are written in."""
    import hf_relpos
    from hf_relpos import functional_relpos

    assert hf_relpos.functional is F
    assert F.__all__ == functional_relpos.__all__
    homes = (functional_relpos.__name__, "hf_relpos.position_terms_relpos")  # the attention functions; the terms
    public = {name for name in vars(functional_relpos) if not name.startswith("_")
              and getattr(getattr(functional_relpos, name), "__module__", None) in homes}
    assert set(F.__all__) == public, sorted(public ^ set(F.__all__))
    for name in F.__all__:
        assert getattr(F, name) is getattr(functional_relpos, name), name
        assert getattr(F, name).__doc__, name
    legend = functional_relpos.__doc__[functional_relpos.__doc__.index("Shapes (the layout"):]
    assert legend in F.__doc__
