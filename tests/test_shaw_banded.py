"""The band decomposition of Shaw attention (``kernels_relpos.shaw_banded``) against the loop oracles.

``shaw_attention`` takes this path on CPU for self-attention without mask (or with a key mask), cache or
dropout once the sequence is ``kernels_relpos.SHAW_BAND_MIN_LENGTH`` long (512). The tests call the kernel directly
on short sequences, so that the oracles (explicit per-(i, j) float64 loops from the contract's formula) stay
fast, and check that ``kernels_relpos.shaw_banded_applies`` holds for each case (with ``min_length=1``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from hf_relpos import functional as F
from hf_relpos import kernels_relpos as K
from oracles import shaw_ref, shaw_torch_ref


def banded(q, k, v, rel_k, rel_v, **kwargs):
    """Shaw attention by the band decomposition in passes of one block each (several per test sequence)."""
    return K.shaw_banded(q, k, v, rel_k, rel_v, rows=64, **kwargs)


def inputs(seed, B, H, n, D, kk, with_rel_v, dtype=torch.float64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)  # noqa: E731
    q, k, v = make(B, H, n, D), make(B, H, n, D), make(B, H, n, D)
    rel_k = make(2 * kk + 1, D)
    rel_v = make(2 * kk + 1, D) if with_rel_v else None
    return q, k, v, rel_k, rel_v


def takes_band(q, k, v, kk, min_length=1):
    return K.shaw_banded_applies(q, k, v, kk, None, 0, 0.0, min_length=min_length)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), n=st.integers(3, 40), D=st.integers(1, 6),
    kk_frac=st.floats(0.0, 1.0), causal=st.booleans(), with_rel_v=st.booleans(), seed=st.integers(0, 2**16),
)
def test_banded_values_match_loop_oracle(B, H, n, D, kk_frac, causal, with_rel_v, seed):
    kk = 1 + int(kk_frac * ((n - 1) // 2 - 1))  # 1 <= k and 2k+1 <= n
    q, k, v, rk, rv = inputs(seed, B, H, n, D, kk, with_rel_v)
    assert takes_band(q, k, v, kk)
    got = banded(q, k, v, rk, rv, max_relative_position=kk, is_causal=causal)
    want = shaw_ref(q, k, v, rk, rv, max_relative_position=kk, is_causal=causal)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "n,kk,causal,with_rel_v",
    [(9, 1, False, True), (9, 4, True, True), (13, 3, False, False), (20, 2, True, False), (70, 3, False, True)],
)
def test_banded_gradients_match_loop_oracle(n, kk, causal, with_rel_v):
    """Gradients of q, k, v, rel_k, rel_v against autograd through the per-(i, j) loop oracle.

    n = 70 crosses the band's block size (64), so a block boundary sits inside the band."""
    q, k, v, rk, rv = inputs(n * 31 + kk, 2, 2, n, 4, kk, with_rel_v, requires_grad=True)
    leaves = [t for t in (q, k, v, rk, rv) if t is not None]
    got = banded(q, k, v, rk, rv, max_relative_position=kk, is_causal=causal)
    want = shaw_torch_ref(q, k, v, rk, rv, max_relative_position=kk, is_causal=causal)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    grad_out = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for name, a, b in zip("q k v rel_k rel_v".split(), torch.autograd.grad(got, leaves, grad_out),
                          torch.autograd.grad(want, leaves, grad_out)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("causal", [False, True])
def test_banded_gradcheck(causal):
    q, k, v, rk, rv = inputs(3, 1, 2, 11, 3, 2, True, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *t: banded(*t, max_relative_position=2, is_causal=causal), (q, k, v, rk, rv)
    )


@pytest.mark.parametrize("causal", [False, True])
def test_band_wider_than_a_block_matches_gathered_form(causal):
    """k = 70 > the band's block size (64), n = 200 (not a multiple of it): the banded path against
    the gathered form (itself checked against the oracles elsewhere)."""
    q, k, v, rk, rv = inputs(5, 1, 2, 200, 8, 70, True, requires_grad=True)
    assert takes_band(q, k, v, 70)
    leaves = (q, k, v, rk, rv)
    band = banded(q, k, v, rk, rv, max_relative_position=70, is_causal=causal)
    assert not takes_band(q, k, v, 70, min_length=K.SHAW_BAND_MIN_LENGTH)  # shaw_attention gathers at this length
    gathered = F.shaw_attention(q, k, v, rk, rv, max_relative_position=70, is_causal=causal)
    torch.testing.assert_close(band, gathered, rtol=0, atol=1e-10)
    grad_out = torch.randn_like(band)
    for a, b in zip(torch.autograd.grad(band, leaves, grad_out), torch.autograd.grad(gathered, leaves, grad_out)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_banded_low_precision_close_to_float64_oracle(dtype, atol):
    n, kk = 160, 8
    q, k, v, rk, rv = inputs(9, 1, 2, n, 16, kk, True, dtype=dtype)
    assert takes_band(q, k, v, kk)
    got = banded(q, k, v, rk, rv, max_relative_position=kk)
    assert got.dtype == dtype
    want = F.shaw_attention(*(t.double() for t in (q, k, v, rk, rv)), max_relative_position=kk)
    # the float64 reference at this length: gathered form, checked against the loop oracle below
    for row in (0, 7, 80, 159):  # a query alone at index 0 after ``row`` others sits at position ``row``
        want_row = shaw_ref(q.double()[:, :, row:row + 1], k.double(), v.double(), rk.double(), rv.double(),
                            max_relative_position=kk, past_length=row)
        torch.testing.assert_close(want[:, :, row:row + 1], want_row, rtol=0, atol=1e-10)
    assert (got.double() - want).abs().max().item() <= atol * want.abs().max().item()


def outputs_and_grads(model, ids, **kwargs):
    """A model's last hidden state and its parameters' gradients for the loss mean(h²)."""
    model.zero_grad()
    out = model(input_ids=ids, **kwargs).last_hidden_state
    out.pow(2).mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of memory any op's output holds: its storage's, so a view of a small
    tensor (an unfold of the ``2n - 1`` distances) counts what it reads, not its shape."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes() // max(t.element_size(), 1))
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_banded_never_forms_a_query_by_key_tensor(causal):
    """Forward and backward stay O(B·H·n·(block + 2k)): no [B, H, n, n] tensor (the gathered form has several)."""
    B, H, n, D, kk = 1, 2, 512, 8, 4
    q, k, v, rk, rv = inputs(2, B, H, n, D, kk, True, dtype=torch.float32, requires_grad=True)
    assert takes_band(q, k, v, kk, min_length=K.SHAW_BAND_MIN_LENGTH)  # shaw_attention's own threshold
    with _LargestTensor() as seen:
        F.shaw_attention(q, k, v, rk, rv, max_relative_position=kk, is_causal=causal).sum().backward()
    assert seen.largest < B * H * n * n // 4, seen.largest
    # the same probe sees the [B, H, n, n] scores of the gathered form
    with _LargestTensor() as seen:
        F.shaw_attention(q[:, :, 1:], k, v, rk, rv, max_relative_position=kk, is_causal=causal, past_length=1)
    assert seen.largest >= B * H * (n - 1) * n


def test_banded_bfloat16_gradients_close_to_float64():
    n, kk = 160, 8
    q, k, v, rk, rv = inputs(21, 1, 2, n, 16, kk, True, dtype=torch.bfloat16, requires_grad=True)
    assert takes_band(q, k, v, kk)
    leaves = (q, k, v, rk, rv)
    grad_out = torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad(banded(*leaves, max_relative_position=kk), leaves, grad_out.bfloat16())
    ref = [t.detach().double().requires_grad_(True) for t in leaves]
    want = torch.autograd.grad(F.shaw_attention(*ref, max_relative_position=kk), ref, grad_out.double())
    for name, a, b in zip("q k v rel_k rel_v".split(), got, want):
        assert a.dtype == torch.bfloat16
        err = (a.double() - b).norm() / b.norm()
        assert err < 2e-2, (name, err.item())


def test_model_takes_the_band_and_matches_the_gathered_form(monkeypatch):
    """A Shaw model on kernels_relpos.SHAW_BAND_MIN_LENGTH tokens (no padding) takes the band; it gives the outputs
    and gradients of the gathered form (which output_attentions takes: only it has the probabilities)."""
    from hf_relpos import RelPosConfig, RelPosModel

    config = RelPosConfig(position_encoding="shaw", max_relative_position=8, vocab_size=64, hidden_size=32,
                          num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    torch.manual_seed(0)
    model = RelPosModel(config)
    for layer in model.layers:  # learned embeddings away from their zero init
        torch.nn.init.normal_(layer.self_attn.relative.rel_k, std=0.5)
        torch.nn.init.normal_(layer.self_attn.relative.rel_v, std=0.5)
    ids = torch.randint(0, 64, (2, K.SHAW_BAND_MIN_LENGTH))
    calls = []
    real = K._BandedAttention.apply
    monkeypatch.setattr(K._BandedAttention, "apply", lambda *a: calls.append(1) or real(*a))  # a spy: counts calls

    banded_out, banded_grads = outputs_and_grads(model, ids)
    assert len(calls) == config.num_hidden_layers
    gathered_out, gathered_grads = outputs_and_grads(model, ids, output_attentions=True)
    assert len(calls) == config.num_hidden_layers
    torch.testing.assert_close(banded_out, gathered_out, rtol=1e-5, atol=1e-5)
    for a, b in zip(banded_grads, gathered_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_banded_accepts_a_strided_head_dim(causal):
    """q, k, v whose last dim is not contiguous (transposed views): the raw fused kernel reads unit strides."""
    q, k, v, rk, rv = inputs(31, 1, 2, 130, 4, 3, True)
    strided = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v)]
    assert strided[0].stride(-1) != 1 and takes_band(*strided[:2], strided[2], 3)
    got = banded(*strided, rk, rv, max_relative_position=3, is_causal=causal)
    torch.testing.assert_close(got, banded(q, k, v, rk, rv, max_relative_position=3, is_causal=causal),
                               rtol=0, atol=1e-12)


def test_values_with_their_own_head_size_take_the_gathered_form():
    """v_head_dim != head_dim is allowed by the contract; the fused kernel needs one head size."""
    g = torch.Generator().manual_seed(8)
    q, k = (torch.randn(1, 2, 130, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 130, 6, generator=g, dtype=torch.float64)
    rk, rv = torch.randn(7, 4, generator=g, dtype=torch.float64), torch.randn(7, 6, generator=g, dtype=torch.float64)
    assert not takes_band(q, k, v, 3)
    got = F.shaw_attention(q, k, v, rk, rv, max_relative_position=3)
    # Each output column depends on its own value column only: the first and last four columns are
    # what the banded path (one head size) gives for those value columns.
    for cols in (slice(0, 4), slice(2, 6)):
        assert takes_band(q, k, v[..., cols], 3)
        part = banded(q, k, v[..., cols], rk, rv[:, cols], max_relative_position=3)
        torch.testing.assert_close(got[..., cols], part, rtol=0, atol=1e-12)


@pytest.mark.parametrize("B,H", [(0, 2), (1, 0)])
def test_empty_batch_or_heads(B, H):
    q, k, v, rk, rv = inputs(1, B, H, 130, 4, 3, True, requires_grad=True)
    out = F.shaw_attention(q, k, v, rk, rv, max_relative_position=3)
    assert out.shape == (B, H, 130, 4)
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_banded_refuses_double_backward_instead_of_answering_wrong():
    q, k, v, rk, rv = inputs(2, 1, 1, 9, 3, 2, True, requires_grad=True)
    (dq,) = torch.autograd.grad(banded(q, k, v, rk, rv, max_relative_position=2).sum(), q,
                                create_graph=True)
    with pytest.raises(RuntimeError):  # the backward is marked once_differentiable
        dq.pow(2).sum().backward()


def padding_mask(B, n, generator=None):
    """Bool [B, 1, 1, n] key masks: right padding, left padding, everything masked, then random."""
    keep = torch.ones(B, n, dtype=torch.bool)
    keep[0, n - 5:] = False
    if B > 1:
        keep[1, :7] = False
    if B > 2:
        keep[2] = False
    for b in range(3, B):
        keep[b] = torch.rand(n, generator=generator) < 0.7
    return keep[:, None, None, :]


@pytest.mark.parametrize("n,kk,causal,with_rel_v", [(20, 2, False, True), (20, 3, True, True), (70, 4, False, False),
                                                    (70, 5, True, True)])
def test_banded_with_padding_matches_loop_oracle(n, kk, causal, with_rel_v):
    """A key mask (padding; a row whose keys are all masked gives zeros) keeps the band: values against the
    loop oracle, gradients against autograd through the per-(i, j) torch oracle."""
    q, k, v, rk, rv = inputs(n + kk, 4, 2, n, 3, kk, with_rel_v, requires_grad=True)
    mask = padding_mask(4, n, torch.Generator().manual_seed(n))
    assert K.shaw_banded_applies(q, k, v, kk, mask, 0, 0.0, min_length=1)
    got = banded(q, k, v, rk, rv, max_relative_position=kk, attention_mask=mask, is_causal=causal)
    want = shaw_ref(q, k, v, rk, rv, max_relative_position=kk, attention_mask=mask, is_causal=causal)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert not got[2].any()  # every key masked: zeros
    leaves = [t for t in (q, k, v, rk, rv) if t is not None]
    want = shaw_torch_ref(q, k, v, rk, rv, max_relative_position=kk, attention_mask=mask, is_causal=causal)
    grad_out = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for name, a, b in zip("q k v rel_k rel_v".split(), torch.autograd.grad(got, leaves, grad_out),
                          torch.autograd.grad(want, leaves, grad_out)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9, msg=lambda m: f"grad of {name}: {m}")


def test_banded_under_cpu_autocast():
    """Under CPU bf16 autocast (Trainer's bf16=True on CPU) the band runs in float32 and the backward
    works (it used to hand the fused kernel's backward a bf16 log-sum-exp); gradients near float32's."""
    n, kk = 100, 4
    q, k, v, rk, rv = inputs(31, 1, 2, n, 16, kk, True, dtype=torch.float32, requires_grad=True)
    leaves = (q, k, v, rk, rv)
    grad_out = torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(3))
    want = torch.autograd.grad(F.shaw_attention(*leaves, max_relative_position=kk), leaves, grad_out)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = banded(*leaves, max_relative_position=kk)
    got = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    for name, a, b in zip("q k v rel_k rel_v".split(), got, want):
        assert ((a.double() - b.double()).norm() / b.double().norm()) < 3e-2, name
