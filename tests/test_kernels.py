"""Each entry point of ``hf_relpos/kernels_relpos.py`` against ``functional_relpos.py``'s reference math and the float64
oracles (``tests/oracles.py``, or the formula written out in float64 where the oracles have none), values and
gradients; the ``*_applies`` predicates with their thresholds given as arguments; the import direction.

The kernels' own edge cases (padding, strides, low precision, chunk and pass boundaries, memory) are tested
beside the scheme they serve: test_shaw_banded.py, test_bias_band.py, test_txl_chunked.py, test_key_bias.py,
test_attention_with_bias.py.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from hf_relpos import functional as F
from hf_relpos import kernels_relpos
from oracles import alibi_slopes_ref, shaw_ref, shaw_torch_ref, txl_ref, txl_torch_ref
from test_functional import _fire_params, assert_close64, gen, make_mask, randn, txl_inputs

PACKAGE = Path(F.__file__).resolve().parent


def qkv(seed, B, H, Q, K, D, requires_grad=True, dtype=torch.float64):
    g = gen(seed)
    return g, [randn(g, *shape, dtype=dtype).requires_grad_(requires_grad) for shape in
               ((B, H, Q, D), (B, H, K, D), (B, H, K, D))]


def softmax_attention64(q, k, v, logits_extra, allowed=None):
    """``softmax(q k^T / sqrt(D) + extra) v`` in float64; ``allowed`` False masks (a row with none left: zeros)."""
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]) + logits_extra
    if allowed is None:
        return torch.softmax(scores, -1) @ v.double()
    alive = allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~alive, 0.0)
    return torch.where(alive, torch.softmax(scores, -1), 0.0) @ v.double()


def grads_agree(got, want, leaves, seed=1, atol=1e-10, names=None):
    grad_out = torch.randn(got.shape, generator=gen(seed), dtype=torch.float64).to(got.dtype)
    pairs = zip(torch.autograd.grad(got, leaves, grad_out), torch.autograd.grad(want, leaves, grad_out.double()))
    for i, (a, b) in enumerate(pairs):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=atol, msg=lambda m: f"grad {names and names[i]}: {m}")


# ---------------------------------------------------------------------------------------------
# fused_bias_attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias_shape,chunk_size", [((2, 3), 256), ((1, 3), 2), ((2, 1), 3), ((1, 1), 1)])
def test_fused_bias_attention_matches_the_formula_and_functional(bias_shape, chunk_size):
    B, H, Q, K, D = 2, 3, 7, 9, 4
    g, (q, k, v) = qkv(11, B, H, Q, K, D)
    bias = randn(g, *bias_shape, Q, K).requires_grad_(True)
    assert kernels_relpos.fused_bias_applies(q)
    got = kernels_relpos.fused_bias_attention(q, k, v, bias, 1.0 / math.sqrt(D), chunk_size=chunk_size)
    want = softmax_attention64(q, k, v, bias)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    with torch.no_grad():  # functional's other path: plain SDPA
        assert not kernels_relpos.fused_bias_applies(q)
        torch.testing.assert_close(got.detach(), F.attention_with_bias(q, k, v, bias), rtol=0, atol=1e-12)
    grads_agree(got, want, (q, k, v, bias), names="q k v bias".split())
    torch.testing.assert_close(got, F.attention_with_bias(q, k, v, bias, chunk_size=chunk_size), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# The band: shaw_banded, saturating_bias_banded
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block,rows", [(64, 512), (4, 8), (3, 3)])
def test_shaw_banded_matches_the_oracles_and_the_gathered_form(causal, block, rows):
    B, H, n, D, kk = 2, 2, 23, 3, 3
    g, (q, k, v) = qkv(12, B, H, n, n, D)
    rk, rv = randn(g, 2 * kk + 1, D).requires_grad_(True), randn(g, 2 * kk + 1, D).requires_grad_(True)
    assert kernels_relpos.shaw_banded_applies(q, k, v, kk, min_length=n)
    assert not kernels_relpos.shaw_banded_applies(q, k, v, kk, min_length=n + 1)
    assert not kernels_relpos.shaw_banded_applies(q, k, v, kk)  # shorter than SHAW_BAND_MIN_LENGTH: gathered
    got = kernels_relpos.shaw_banded(q, k, v, rk, rv, max_relative_position=kk, is_causal=causal, block=block,
                                     rows=rows)
    torch.testing.assert_close(got, shaw_ref(q, k, v, rk, rv, max_relative_position=kk, is_causal=causal),
                               rtol=0, atol=1e-10)
    gathered, _ = F.shaw_attention(q, k, v, rk, rv, max_relative_position=kk, is_causal=causal, need_weights=True)
    torch.testing.assert_close(got, gathered, rtol=0, atol=1e-12)
    want = shaw_torch_ref(q, k, v, rk, rv, max_relative_position=kk, is_causal=causal)
    grads_agree(got, want, (q, k, v, rk, rv), atol=1e-9, names="q k v rel_k rel_v".split())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block,rows", [(64, 512), (4, 8)])
def test_saturating_bias_banded_matches_the_formula_and_the_spread_bias(causal, block, rows):
    B, H, n, D, s = 2, 3, 30, 4, 4
    g, (q, k, v) = qkv(13, B, H, n, n, D)
    table = randn(g, H, 2 * s + 1).requires_grad_(True)
    assert kernels_relpos.saturating_bias_banded_applies(q, k, v, table, None, causal, min_length=n)
    assert not kernels_relpos.saturating_bias_banded_applies(q, k, v, table, None, causal)  # below the default
    got = kernels_relpos.saturating_bias_banded(q, k, v, table, is_causal=causal, block=block, rows=rows)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    bias = table[:, (j - i).clamp(-s, s) + s].unsqueeze(0)  # [1, H, n, n]
    want = softmax_attention64(q, k, v, bias, allowed=(j <= i) if causal else None)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    spread = F.saturating_bias_attention(q, k, v, table, is_causal=causal)  # functional's path at this length
    torch.testing.assert_close(got, spread, rtol=0, atol=1e-12)
    grads_agree(got, want, (q, k, v, table), atol=1e-9, names="q k v bias".split())


def test_banded_attention_applies_only_where_it_computes_the_contract():
    g, (q, k, v) = qkv(14, 1, 2, 40, 40, 4, requires_grad=False)
    assert kernels_relpos.shaw_banded_applies(q, k, v, 3, None, 0, 0.0, min_length=1)
    assert not kernels_relpos.shaw_banded_applies(q, k, v, 3, None, 2, 0.0, min_length=1)  # a cache offset
    assert not kernels_relpos.shaw_banded_applies(q, k, v, 3, None, 0, 0.1, min_length=1)  # dropout
    # not self-attention
    assert not kernels_relpos.shaw_banded_applies(q[:, :, :5], k, v, 3, None, 0, 0.0, min_length=1)
    assert not kernels_relpos.shaw_banded_applies(q, k, v, 0, None, 0, 0.0, min_length=1)  # no band
    assert not kernels_relpos.shaw_banded_applies(q, k, v, 3, torch.ones(1, 1, 40, 40, dtype=torch.bool), 0, 0.0,
                                                  min_length=1)  # a [Q, K] mask, not a key mask
    assert kernels_relpos.shaw_banded_applies(q, k, v, 3, torch.ones(1, 1, 1, 40, dtype=torch.bool), 0, 0.0,
                                              min_length=1)
    table = torch.zeros(2, 9)
    assert kernels_relpos.saturating_bias_banded_applies(q, k, v, table, None, True, min_length=40)
    big = torch.zeros(1, 2, kernels_relpos.CAUSAL_BIAS_BAND_MIN_LENGTH, 4)
    assert kernels_relpos.saturating_bias_banded_applies(big, big, big, table, None, True)
    assert not kernels_relpos.saturating_bias_banded_applies(big, big, big, table, None, False)  # BIAS_BAND_MIN_LENGTH


# ---------------------------------------------------------------------------------------------
# txl_chunked
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal,mk", [(True, None), (True, "bool"), (False, "float_inf"), (False, None)])
@pytest.mark.parametrize("chunk", [256, 1, 3])
def test_txl_chunked_matches_the_oracles_and_the_explicit_form(causal, mk, chunk):
    B, H, Q, M, D = 2, 2, 7, 3, 4
    K = Q + M
    g, q, k, v, r, u, w = txl_inputs(15 + chunk, B, H, Q, K, D, K if causal else K + Q - 1)
    mask = make_mask(g, mk, B, H, Q, K)
    leaves = [t.requires_grad_(True) for t in (q, k, v, r, u, w)]
    got = kernels_relpos.txl_chunked(*leaves, attention_mask=mask, is_causal=causal, chunk=chunk)
    torch.testing.assert_close(got, txl_ref(*leaves, attention_mask=mask, is_causal=causal), rtol=0, atol=1e-10)
    explicit, _ = F.transformer_xl_attention(*leaves, attention_mask=mask, is_causal=causal, need_weights=True)
    torch.testing.assert_close(got, explicit, rtol=0, atol=1e-12)
    want = txl_torch_ref(*leaves, attention_mask=mask, is_causal=causal)
    grads_agree(got, want, leaves, names="q k v r u w".split())


# ---------------------------------------------------------------------------------------------
# causal_key_bias
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("chunk", [2048, 5, 1])
def test_causal_key_bias_matches_the_formula_and_the_exact_form(padded, chunk):
    B, H, n, D = 2, 4, 17, 3
    g, (q, k, v) = qkv(16, B, H, n, n, D)
    keys = torch.ones(B, 1, 1, n, dtype=torch.bool)
    keys[1, ..., :4] = False  # left padding
    mask = keys if padded else None
    slopes = torch.tensor(alibi_slopes_ref(H), dtype=torch.float64)
    key_bias = F.alibi_key_bias(slopes, n)
    assert kernels_relpos.causal_key_bias_applies(q, k, v, key_bias, mask)
    got = kernels_relpos.causal_key_bias(q, k, v, key_bias, attention_mask=mask, chunk=chunk)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (j <= i) & (keys if padded else True)
    want = softmax_attention64(q, k, v, -slopes[:, None, None] * (i - j), allowed=allowed)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grads_agree(got, want, (q, k, v), atol=1e-11, names="q k v".split())
    # a key bias that needs a gradient (FoX's, per batch row) takes the kernel too: its gradient from the extra channel
    trained = (key_bias + torch.randn(B, H, n, generator=g, dtype=torch.float64)).requires_grad_(True)
    assert kernels_relpos.causal_key_bias_applies(q, k, v, trained, mask)
    got = kernels_relpos.causal_key_bias(q, k, v, trained, attention_mask=mask, chunk=chunk)
    want = softmax_attention64(q, k, v, trained[:, :, None, :] - trained[:, :, :, None], allowed=allowed)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grads_agree(got, want, (q, k, v, trained), atol=1e-11, names="q k v key_bias".split())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_causal_key_bias_in_half_precision_adds_the_bias_in_float32(dtype):
    """Half-precision inputs take the kernel, which adds the bias in float32: ALiBi's ``m (j - r)`` from a chunk's
    middle row reaches 75 over 300 rows at slope 1/2, where bf16 has steps of 0.5. Values and gradients (q, k, v
    and a trained bias's) against the float64 formula over the same rounded inputs, within their rounding."""
    B, H, n, D = 2, 4, 300, 16
    g, (q, k, v) = qkv(18, B, H, n, n, D, dtype=dtype)
    keys = torch.ones(B, 1, 1, n, dtype=torch.bool)
    keys[1, ..., :7] = False  # left padding
    slopes = torch.tensor(alibi_slopes_ref(H), dtype=torch.float64)
    trained = (F.alibi_key_bias(slopes, n) + torch.randn(B, H, n, generator=g, dtype=torch.float64))
    trained.requires_grad_(True)  # the kernel runs in float32 then (test_fox.py: its sums per key)
    assert kernels_relpos.causal_key_bias_applies(q, k, v, trained, keys)
    got = kernels_relpos.causal_key_bias(q, k, v, trained, attention_mask=keys)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    want = softmax_attention64(q, k, v, trained[:, :, None, :] - trained[:, :, :, None], allowed=(j <= i) & keys)
    eps = torch.finfo(dtype).eps
    assert got.dtype == dtype
    assert (got.double() - want).abs().max() < 2 * eps * want.abs().max()  # the output's own rounding
    grad_out = torch.randn(got.shape, generator=gen(1), dtype=torch.float64)
    leaves = (q, k, v, trained)
    for name, a, b in zip("q k v key_bias".split(), torch.autograd.grad(got, leaves, grad_out.to(dtype)),
                          torch.autograd.grad(want, leaves, grad_out)):
        error = ((a.double() - b).norm() / b.norm()).item()
        assert error < 1.5 * eps, f"grad of {name}: relative error {error:.2e}"


def test_causal_key_bias_applies_only_where_it_computes_the_contract():
    g, (q, k, v) = qkv(17, 1, 2, 8, 8, 4, requires_grad=False)
    key_bias = torch.zeros(2, 8, dtype=torch.float64)
    assert kernels_relpos.causal_key_bias_applies(q, k, v, key_bias)
    for half in (torch.bfloat16, torch.float16):  # the kernel adds the bias in float32
        assert kernels_relpos.causal_key_bias_applies(q.to(half), k.to(half), v.to(half), key_bias)
    assert not kernels_relpos.causal_key_bias_applies(q, k, v, key_bias, torch.ones(1, 1, 8, 8, dtype=torch.bool))
    assert not kernels_relpos.causal_key_bias_applies(q, k, v[..., :3], key_bias)  # two head sizes


# ---------------------------------------------------------------------------------------------
# fire_mlp
# ---------------------------------------------------------------------------------------------


def test_fire_bias_blocks_of_rows_give_the_whole():
    """FIRE's MLP runs over blocks of query rows (checkpointed when a gradient is needed): blocks of 2 rows
    (``elements`` = 2 rows · 9 keys · width 4) give the single-block values and gradients, and fire_bias's."""
    w1, b1, w2, b2, c, threshold = params = [t.requires_grad_() for t in _fire_params(2, 4, 3)]
    x = torch.rand(1, 7, 9, generator=gen(4), dtype=torch.float64).requires_grad_(True)
    leaves = [x, w1, b1, w2, b2]
    whole = kernels_relpos.fire_mlp(x, w1, b1, w2, b2)
    assert_close64(whole, (torch.relu(x[..., None] * w1[:, 0] + b1) @ w2.T + b2).detach(), 1e-12)
    grads = torch.autograd.grad(whole.pow(2).sum(), leaves)
    blocks = kernels_relpos.fire_mlp(x, w1, b1, w2, b2, elements=2 * 9 * 4)
    assert_close64(blocks, whole.detach(), 0.0)
    for a, b in zip(torch.autograd.grad(blocks.pow(2).sum(), leaves), grads):
        assert_close64(a, b, 1e-12)
    bias = F.fire_bias(*params, 7, 9, past_length=2)
    assert bias.shape == (1, 2, 7, 9)
    empty = kernels_relpos.fire_mlp(x[:, :0], w1, b1, w2, b2)
    assert empty.shape == (1, 0, 9, 2)


# ---------------------------------------------------------------------------------------------
# The import direction: functional_relpos -> kernels_relpos -> attention_utils_relpos, never back
# ---------------------------------------------------------------------------------------------


def _relative_imports(name):
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}


def test_kernels_sit_below_functional_with_no_cycle():
    assert _relative_imports("functional") == {"functional_relpos"}  # the public module: re-exports only
    assert _relative_imports("functional_relpos") == {"attention_utils_relpos", "kernels_relpos", "position_terms_relpos"}
    assert _relative_imports("position_terms_relpos") == {"kernels_relpos"}
    assert _relative_imports("kernels_relpos") == {"attention_utils_relpos", "bias_kernels_relpos", "denormals_relpos"}
    assert _relative_imports("bias_kernels_relpos") == {"attention_utils_relpos", "denormals_relpos"}
    assert _relative_imports("attention_utils_relpos") == set() == _relative_imports("denormals_relpos")
    for name in ("kernels_relpos", "bias_kernels_relpos", "attention_utils_relpos", "denormals_relpos"):  # flat and Transformers-free, as remote code copies them
        source = (PACKAGE / f"{name}.py").read_text()
        assert "transformers" not in {a.name.split(".")[0] for node in ast.walk(ast.parse(source))
                                      if isinstance(node, ast.Import) for a in node.names}
        assert "from transformers" not in source
