"""Transformer-XL attention in chunks of query rows (``kernels_relpos.txl_chunked``).

The tests pass a small ``chunk`` so that small inputs span several chunks (the default,
``kernels_relpos.TXL_CHUNK`` = 256 rows, leaves the oracle cases of test_functional.py in one chunk); values and
gradients are checked against the per-(i, j) float64 loop oracles written from the contract's formula.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_relpos import functional as F
from hf_relpos import kernels_relpos
from oracles import txl_ref, txl_torch_ref
from test_functional import _dead_rows, _full_mask_pattern, make_mask, txl_inputs
from test_shaw_banded import _LargestTensor

FIXTURE_OK = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def chunked(rows):
    """``transformer_xl_attention``'s chunked path (no dropout, no weights) with ``rows`` query rows per chunk."""
    return functools.partial(kernels_relpos.txl_chunked, chunk=rows)


@FIXTURE_OK
@given(
    B=st.integers(1, 2), H=st.integers(1, 2), Q=st.integers(1, 9), M=st.integers(0, 4), D=st.integers(1, 5),
    causal=st.booleans(), extra_r=st.integers(0, 2), mk=st.sampled_from([None, "bool", "float_inf", "float_min"]),
    chunk=st.integers(1, 4), seed=st.integers(0, 2**16),
)
def test_chunked_values_match_loop_oracle(B, H, Q, M, D, causal, extra_r, mk, chunk, seed):
    K = Q + M
    R = (K if causal else K + Q - 1) + extra_r
    g, q, k, v, r, u, w = txl_inputs(seed, B, H, Q, K, D, R)
    mask = make_mask(g, mk, B, H, Q, K)
    got = chunked(chunk)(q, k, v, r, u, w, attention_mask=mask, is_causal=causal)
    want = txl_ref(q, k, v, r, u, w, attention_mask=mask, is_causal=causal)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "Q,M,causal,mk,chunk",
    [(7, 0, True, None, 2), (7, 3, True, "bool", 3), (6, 2, False, "float_inf", 4), (5, 0, False, None, 1)],
)
def test_chunked_gradients_match_loop_oracle(Q, M, causal, mk, chunk):
    K = Q + M
    g, *leaves = txl_inputs(Q * 100 + M, 2, 2, Q, K, 3, K if causal else K + Q - 1)
    mask = make_mask(g, mk, 2, 2, Q, K)
    weights = torch.randn(2, 2, Q, 3, generator=g, dtype=torch.float64)

    def grads(fn):
        xs = [t.detach().clone().requires_grad_(True) for t in leaves]
        out = fn(*xs, attention_mask=mask, is_causal=causal)
        return torch.autograd.grad((out * weights).sum(), xs)

    for name, a, b in zip("q k v r u w".split(), grads(chunked(chunk)), grads(txl_torch_ref)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_gradcheck(causal):
    Q, K = 5, 7
    g, *leaves = txl_inputs(7, 1, 2, Q, K, 3, K if causal else K + Q - 1)
    xs = tuple(t.requires_grad_(True) for t in leaves)
    assert torch.autograd.gradcheck(lambda *a: chunked(2)(*a, is_causal=causal), xs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_fully_masked_rows_are_zero_with_zero_gradient(dtype):
    # every row its own chunk (chunked(1)): a dead row is a whole dead chunk
    B, H, Q, K, D = 2, 2, 4, 5, 8
    _, q, k, v, r, u, w = txl_inputs(62, B, H, Q, K, D, K + Q - 1, dtype=dtype)
    mask = _full_mask_pattern("float_inf", B, H, Q, K, dtype)
    q.requires_grad_(True)
    out = chunked(1)(q, k, v, r, u, w, attention_mask=mask, is_causal=False)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    for b, h, i in _dead_rows():
        assert (out[b, h, i] == 0).all() and (q.grad[b, h, i] == 0).all()


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_never_forms_a_query_by_key_tensor(causal):
    """With the default chunk (256 rows) at n = 1024, forward and backward stay O(B·H·256·K)."""
    B, H, n, D = 1, 2, 1024, 8
    _, q, k, v, r, u, w = txl_inputs(3, B, H, n, n, D, n if causal else 2 * n - 1, dtype=torch.float32)
    leaves = [t.requires_grad_(True) for t in (q, k, v, r, u, w)]
    with _LargestTensor() as seen:
        F.transformer_xl_attention(*leaves, is_causal=causal).sum().backward()
    assert seen.largest <= B * H * 256 * (2 * n), seen.largest
    assert seen.largest < B * H * n * n


@pytest.mark.parametrize("causal", [True, False])
def test_strided_head_dim_matches_contiguous(causal):
    _, q, k, v, r, u, w = txl_inputs(17, 1, 2, 6, 9, 4, 9 if causal else 14)
    strided = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v)]
    assert strided[0].stride(-1) != 1
    got = F.transformer_xl_attention(*strided, r, u, w, is_causal=causal)
    torch.testing.assert_close(got, F.transformer_xl_attention(q, k, v, r, u, w, is_causal=causal), rtol=0, atol=1e-12)


@pytest.mark.parametrize("B,H", [(0, 2), (1, 0)])
def test_empty_batch_or_heads(B, H):
    _, q, k, v, r, u, w = txl_inputs(18, B, H, 5, 5, 4, 5)
    q.requires_grad_(True)
    out = F.transformer_xl_attention(q, k, v, r, u, w)
    assert out.shape == (B, H, 5, 4)
    out.sum().backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("shape", [(2, 2, 4, 6), (4, 6), (1, 1, 1, 6)])
def test_float_mask_gets_its_gradient(shape):
    """An additive float mask that requires grad receives dS, summed over its broadcast dims: checked
    against autograd through an independent gather-based formulation of the same scores."""
    B, H, Q, M, D = 2, 2, 4, 2, 3
    K = Q + M
    g, q, k, v, r, u, w = txl_inputs(19, B, H, Q, K, D, K + Q - 1)
    mask = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    out = chunked(3)(q, k, v, r, u, w, attention_mask=mask, is_causal=False)
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (got,) = torch.autograd.grad((out * weights).sum(), mask)
    ref_mask = mask.detach().clone().requires_grad_(True)
    # r[t] holds distance K-1-t; query i (position M+i) meets key j at distance M+i-j
    t = (K - 1) - (M + torch.arange(Q)[:, None] - torch.arange(K)[None, :])
    position = torch.einsum("bhid,hijd->bhij", q + w[:, None], r[:, t])
    scores = (torch.einsum("bhid,bhjd->bhij", q + u[:, None], k) + position) / D**0.5 + ref_mask
    want_out = torch.softmax(scores, -1) @ v
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    (want,) = torch.autograd.grad((want_out * weights).sum(), ref_mask)
    assert got.shape == mask.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
