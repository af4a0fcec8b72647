"""Causal ALiBi as a bias per key (``causal_key_bias_attention``, ``alibi_key_bias``) against float64 oracles.

The oracle is the paper's form: ``softmax_{j <= i}(q_i·k_j / sqrt(D) - m_h (i - j)) v`` with the slopes
of the independent ``alibi_slopes_ref``, in float64 loops over (i, j) for the bias.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_relpos import functional as F
from hf_relpos import kernels_relpos
from oracles import alibi_slopes_ref
from test_shaw_banded import _LargestTensor


def alibi_causal_oracle(q, k, v, slopes, keys=None):
    """Keys ``j > i`` and (per batch row) those where ``keys`` [B, 1, n] is False are masked; no key left: zeros."""
    n, D = q.shape[2], q.shape[3]
    bias = torch.zeros(len(slopes), n, n, dtype=torch.float64)
    for h, m in enumerate(slopes):
        for i in range(n):
            for j in range(n):
                bias[h, i, j] = -m * (i - j) if j <= i else float("-inf")
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D) + bias
    if keys is not None:
        scores = scores.masked_fill(~keys[:, :, None, :], float("-inf"))
    alive = torch.isfinite(scores).any(-1, keepdim=True)
    scores = scores.masked_fill(~alive, 0.0)  # no key left: zeros below, and no NaN in the gradients
    return torch.where(alive, torch.softmax(scores, dim=-1), 0.0) @ v.double()


def inputs(seed, B, H, n, D, dtype=torch.float64, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
            for _ in range(3)]


@pytest.mark.parametrize("H,n", [(1, 1), (4, 37), (6, 80), (8, 130)])  # 6: slopes of a non-power of two
def test_values_and_gradients_match_float64_oracle(H, n):
    q, k, v = inputs(H * n, 2, H, n, 8)
    slopes = torch.tensor(alibi_slopes_ref(H), dtype=torch.float64)
    key_bias = F.alibi_key_bias(slopes, n)
    got = F.causal_key_bias_attention(q, k, v, key_bias)
    want = alibi_causal_oracle(q, k, v, alibi_slopes_ref(H))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad_out = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for name, a, b in zip("qkv", torch.autograd.grad(got, (q, k, v), grad_out),
                          torch.autograd.grad(want, (q, k, v), grad_out)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=lambda m: f"grad of {name}: {m}")


def test_half_precision_takes_the_kernel_with_the_bias_in_float32():
    """bfloat16 would round ``m (j - r)`` to steps of 0.5 over 300 rows: the kernel adds the bias in float32, so the
    output is the oracle's up to its own rounding (relative 2^-8), with no ``[Q, K]`` tensor."""
    H, n = 4, 300
    q, k, v = inputs(9, 1, H, n, 16, dtype=torch.bfloat16)
    with _LargestTensor() as seen:
        got = F.causal_key_bias_attention(q, k, v, F.alibi_key_bias(F.alibi_slopes(H), n))
        got.sum().backward()
    want = alibi_causal_oracle(q, k, v, alibi_slopes_ref(H))
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).norm() / want.norm()) < torch.finfo(torch.bfloat16).eps
    assert seen.largest < H * n * n // 4, seen.largest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forms_no_query_by_key_tensor(dtype):
    B, H, n = 1, 2, 1024
    q, k, v = inputs(2, B, H, n, 8, dtype=dtype)
    with _LargestTensor() as seen:
        F.causal_key_bias_attention(q, k, v, F.alibi_key_bias(F.alibi_slopes(H), n)).sum().backward()
    assert seen.largest < B * H * n * n // 4, seen.largest


def test_rejects_a_bias_that_is_not_per_head_and_key():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"key_bias must have shape \[heads, k_len\] = \[2, 8\]"):
        F.causal_key_bias_attention(q, q, q, torch.zeros(2, 7))
    with pytest.raises(ValueError, match="self-attention"):
        F.causal_key_bias_attention(q, q[:, :, :5], q[:, :, :5], torch.zeros(2, 5))


@pytest.mark.parametrize("use_cache", [False, True])
def test_model_takes_the_per_key_form_and_matches_the_full_bias(monkeypatch, use_cache):
    """A causal ALiBi model (float64, no padding): the per-key form gives the logits and gradients of the
    full [1, H, n, n] bias, which the model tests check against the float64 model oracle; a cached
    prefill takes it too, and the decoding steps after it match."""
    from hf_relpos import RelPosConfig, RelPosForCausalLM
    from hf_relpos import attention_backends_relpos

    config = RelPosConfig(position_encoding="alibi", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=64, is_decoder=True)
    torch.manual_seed(0)
    model = RelPosForCausalLM(config).double()
    ids = torch.randint(0, 64, (2, 40))
    calls = []
    real = attention_backends_relpos.causal_key_bias_attention
    monkeypatch.setattr(attention_backends_relpos, "causal_key_bias_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))

    def run():
        model.zero_grad()
        out = model(input_ids=ids[:, :30], use_cache=use_cache)
        out.logits.pow(2).mean().backward()
        logits = [out.logits.detach()]
        if use_cache:
            with torch.no_grad():
                cache = out.past_key_values
                for t in range(30, 40):
                    logits.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        return torch.cat(logits, 1), [p.grad.clone() for p in model.parameters()]

    per_key_logits, per_key_grads = run()
    assert len(calls) == config.num_hidden_layers
    monkeypatch.setattr(model.model.position, "compact", lambda ctx, device, dtype: None)
    full_logits, full_grads = run()
    assert len(calls) == config.num_hidden_layers
    torch.testing.assert_close(per_key_logits, full_logits, rtol=0, atol=1e-12)
    for a, b in zip(per_key_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_padding_matches_float64_oracle(dtype):
    """A key mask (padding; left padding leaves the first rows no key: zeros) in the fused form (float64)
    and the exact form (bfloat16)."""
    from test_shaw_banded import padding_mask

    H, n = 4, 40
    q, k, v = inputs(11, 4, H, n, 8, dtype=dtype, requires_grad=dtype == torch.float64)
    mask = padding_mask(4, n, torch.Generator().manual_seed(3))
    got = F.causal_key_bias_attention(q, k, v, F.alibi_key_bias(F.alibi_slopes(H, dtype=dtype), n),
                                      attention_mask=mask)
    allowed = mask[:, :, 0, :]  # [B, 1, n]
    want = alibi_causal_oracle(q, k, v, alibi_slopes_ref(H), keys=allowed)
    assert not got[2].any() and not got[1, :, :7].any()
    if dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        grad_out = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), grad_out), torch.autograd.grad(want, (q, k, v), grad_out)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    else:
        assert ((got.double() - want).norm() / want.norm()) < 1e-2


def test_trained_key_bias_gets_its_gradient():
    """A key bias that requires grad (learned slopes): the kernel's gradient matches the oracle's."""
    H, n = 2, 30
    q, k, v = inputs(13, 1, H, n, 8)
    slopes = torch.tensor([0.5, 0.125], dtype=torch.float64, requires_grad=True)
    got = F.causal_key_bias_attention(q, k, v, F.alibi_key_bias(slopes, n))
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    scores = q @ k.transpose(-1, -2) / math.sqrt(8) - slopes[:, None, None] * (i - j)
    want = torch.softmax(scores.masked_fill(j > i, float("-inf")), -1) @ v
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, slopes), g), torch.autograd.grad(want, (q, slopes), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize("causal_rows_padded", [False, True])
def test_chunks_match_float64_oracle(causal_rows_padded):
    """Query rows in chunks of 16 (prefix + own block per chunk, merged by log-sum-exp), with and without
    padding: values and gradients against the loop oracle."""
    from test_shaw_banded import padding_mask

    H, n = 4, 70
    q, k, v = inputs(17, 4, H, n, 8)
    mask = padding_mask(4, n, torch.Generator().manual_seed(5)) if causal_rows_padded else None
    key_bias = F.alibi_key_bias(F.alibi_slopes(H, dtype=torch.float64), n)
    assert kernels_relpos.causal_key_bias_applies(q, k, v, key_bias, mask)
    got = kernels_relpos.causal_key_bias(q, k, v, key_bias, attention_mask=mask, chunk=16)
    want = alibi_causal_oracle(q, k, v, alibi_slopes_ref(H), keys=None if mask is None else mask[:, :, 0, :])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad_out = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad_out), torch.autograd.grad(want, (q, k, v), grad_out)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_chunks_bound_the_rounding_at_any_length():
    """float32: one chunk of n = 1024 rows rounds the first rows' logits at about eps · m · n; chunks of 128
    keep every row within eps · m · 128, as the docstring states."""
    H, n = 8, 1024
    q, k, v = inputs(19, 1, H, n, 16, dtype=torch.float32, requires_grad=False)
    slopes = F.alibi_slopes(H, dtype=torch.float64)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    scores = q.double() @ k.double().transpose(-1, -2) / 4 - slopes[:, None, None] * (i - j)
    want = torch.softmax(scores.masked_fill(j > i, float("-inf")), -1) @ v.double()
    errors = {}
    for chunk in (1024, 128):
        got = kernels_relpos.causal_key_bias(q, k, v, F.alibi_key_bias(slopes, n), chunk=chunk)
        errors[chunk] = (got.double() - want).abs().max().item()
    eps = torch.finfo(torch.float32).eps
    assert errors[128] < 4 * eps * 0.5 * 128, errors
    assert 4 * errors[128] < errors[1024], errors  # the chunks, not luck, bound it
