"""attention_with_bias: fused forward, chunked backward that also returns the bias gradient."""

import math

import pytest
import torch

from hf_relpos.functional import attention_with_bias


def loop_oracle(q, k, v, bias, scale):
    """softmax_j(q_i·k_j·scale + bias_ij) v_j with explicit loops in float64; -inf entries excluded,
    a row with nothing left gives zeros."""
    B, H, Q, D = q.shape
    K = k.shape[2]
    bias = bias.expand(B, H, Q, K)
    out = torch.zeros(B, H, Q, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                scores = []
                for j in range(K):
                    extra = float(bias[b, h, i, j])
                    if extra == -math.inf:
                        scores.append(None)
                        continue
                    scores.append(sum(float(q[b, h, i, d]) * float(k[b, h, j, d]) for d in range(D)) * scale + extra)
                live = [s for s in scores if s is not None]
                if not live:
                    continue
                m = max(live)
                weights = [0.0 if s is None else math.exp(s - m) for s in scores]
                total = sum(weights)
                for j in range(K):
                    out[b, h, i] += (weights[j] / total) * v[b, h, j].double()
    return out


def naive(q, k, v, bias, scale):
    probs = torch.softmax(q @ k.transpose(-1, -2) * scale + bias, dim=-1)
    return probs.nan_to_num(0.0) @ v


def inputs(bias_shape, B=2, H=3, Q=9, K=11, D=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=dtype) for n in (Q, K, K))
    bias = torch.randn(*bias_shape, generator=g, dtype=dtype)
    return q, k, v, bias


@pytest.mark.parametrize("bias_shape", [(1, 3, 9, 11), (2, 3, 9, 11), (2, 1, 9, 11), (1, 1, 9, 11)])
def test_values_match_loop_oracle(bias_shape):
    q, k, v, bias = inputs(bias_shape)
    bias[..., 2, 4:] = -math.inf
    bias[..., 5, :] = -math.inf  # a row with nothing to attend to
    bias.requires_grad_(True)
    out = attention_with_bias(q, k, v, bias, scale=0.37)
    expected = loop_oracle(q, k, v, bias.detach(), 0.37)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert torch.equal(out[..., 5, :], torch.zeros_like(out[..., 5, :]))


@pytest.mark.parametrize("chunk_size", [1, 4, 9, 64])
@pytest.mark.parametrize("bias_shape", [(1, 3, 9, 11), (2, 3, 9, 11), (2, 1, 9, 11)])
def test_gradients_match_autograd_of_the_formula(bias_shape, chunk_size):
    q, k, v, bias = inputs(bias_shape, seed=chunk_size)
    bias[..., 3, :7] = torch.finfo(torch.float64).min  # large finite mask values, as Transformers uses
    weights = torch.randn(2, 3, 9, 5, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    (attention_with_bias(*leaves, scale=0.5, chunk_size=chunk_size) * weights).sum().backward()
    ours = [t.grad for t in leaves]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    (naive(*leaves, 0.5) * weights).sum().backward()
    for name, a, b in zip("qkv", ours, [t.grad for t in leaves]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(ours[3], leaves[3].grad, rtol=1e-10, atol=1e-12, msg="bias")


def test_rows_with_every_key_at_minus_inf_have_zero_output_and_finite_gradients():
    q, k, v, bias = inputs((1, 3, 9, 11), dtype=torch.float32)
    bias[..., 4, :] = -math.inf
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    out = attention_with_bias(*leaves)
    out.sum().backward()
    assert torch.equal(out[..., 4, :], torch.zeros_like(out[..., 4, :]))
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    assert torch.equal(leaves[0].grad[..., 4, :], torch.zeros_like(leaves[0].grad[..., 4, :]))


def test_gradcheck_small():
    q, k, v, bias = inputs((1, 2, 4, 5), B=1, H=2, Q=4, K=5, D=3)
    leaves = [t.requires_grad_(True) for t in (q, k, v, bias)]
    assert torch.autograd.gradcheck(lambda *t: attention_with_bias(*t, chunk_size=3), leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_grad_and_low_precision_match_sdpa(dtype):
    q, k, v, bias = inputs((1, 3, 9, 11), dtype=dtype)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    with torch.no_grad():
        torch.testing.assert_close(attention_with_bias(q, k, v, bias), expected)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    out = attention_with_bias(*leaves)
    out.float().sum().backward()
    assert out.dtype == dtype and all(t.grad.dtype == dtype and torch.isfinite(t.grad).all() for t in leaves)


@pytest.mark.parametrize("bad,name", [
    (dict(bias=torch.zeros(1, 3, 9, 10)), "bias"),
    (dict(bias=torch.zeros(3, 3, 9, 11)), "bias"),
    (dict(bias=torch.zeros(9, 11)), "bias"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_bad_arguments_name_the_argument(bad, name):
    q, k, v, bias = inputs((1, 3, 9, 11), dtype=torch.float32)
    kwargs = dict(bias=bias, chunk_size=8)
    kwargs.update(bad)
    with pytest.raises(ValueError, match=name):
        attention_with_bias(q, k, v, kwargs.pop("bias"), **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_entirely_at_finfo_min_gets_softmax_gradients(dtype):
    """Transformers' masks use finfo.min: a row of only finfo.min attends uniformly in the forward
    kernel, and the backward must agree with that (its log-sum-exp is lost in rounding there)."""
    q, k, v, bias = inputs((1, 3, 9, 11), seed=4, dtype=dtype)
    bias[..., 3, :] = torch.finfo(dtype).min
    bias[..., 6, 5:] = torch.finfo(dtype).min
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    grad_out = torch.randn(2, 3, 9, 5, generator=torch.Generator().manual_seed(5), dtype=dtype)
    got = torch.autograd.grad(attention_with_bias(*leaves, scale=0.5, chunk_size=4), leaves, grad_out)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, bias)]
    want = torch.autograd.grad(naive(*ref_leaves, 0.5), ref_leaves, grad_out.double())
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for name, a, b in zip("q k v bias".split(), got, want):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol, msg=lambda m: f"grad of {name}: {m}")


def test_row_at_a_huge_finite_bias_gets_softmax_gradients():
    """-1e9 on every key of a row: float32 cannot hold log K next to such a log-sum-exp. The reference
    is autograd through the plain formula at the same precision (float32 loses q·k next to -1e9 too)."""
    q, k, v, bias = inputs((1, 3, 9, 11), seed=6, dtype=torch.float32)
    bias[..., 1, :] = -1e9
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    grad_out = torch.randn(2, 3, 9, 5, generator=torch.Generator().manual_seed(7))
    got = torch.autograd.grad(attention_with_bias(*leaves, scale=0.5), leaves, grad_out)
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias)]
    want = torch.autograd.grad(naive(*ref_leaves, 0.5), ref_leaves, grad_out)
    for name, a, b in zip("q k v bias".split(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"grad of {name}: {m}")


def test_second_derivatives_match_autograd():
    """create_graph through the chunked backward (e.g. a gradient penalty) differentiates correctly."""
    q, k, v, bias = inputs((1, 3, 9, 11), seed=8)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    ref = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias)]

    def penalty_grads(fn, xs):
        (dq,) = torch.autograd.grad(fn(*xs).pow(2).sum(), xs[0], create_graph=True)
        return torch.autograd.grad(dq.pow(2).sum(), xs)

    got = penalty_grads(lambda *t: attention_with_bias(*t, scale=0.5, chunk_size=4), leaves)
    want = penalty_grads(lambda *t: naive(*t, 0.5), ref)
    for name, a, b in zip("q k v bias".split(), got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_strided_head_dim_matches_contiguous():
    q, k, v, bias = inputs((1, 3, 9, 11), seed=9)
    strided = [t.transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_(True) for t in (q, k, v)]
    assert strided[0].stride(-1) != 1
    torch.testing.assert_close(attention_with_bias(*strided, bias.requires_grad_(True)),
                               attention_with_bias(q, k, v, bias), rtol=0, atol=1e-12)
