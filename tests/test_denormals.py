"""hf_relpos/denormals_relpos.py: denormals flushed to zero on the calling thread and every OpenMP worker inside
``flush_denormals()``, and each thread's previous setting back after it (an exception included); a no-op in a trace.
The speed it buys is measured by scripts/bench.py (docs/guides/performance.md), not here."""

import pytest
import torch

from hf_relpos import denormals_relpos as D

TINY = 1e-30  # TINY * 1e-10 = 1e-40: a float32 denormal, flushed to 0 under FTZ

flushes = pytest.mark.skipif(not D.supported(), reason="flushes on Linux x86-64 (glibc) with ATen on OpenMP only")


@pytest.fixture
def two_threads():
    """Two intra-op threads (conftest runs each test process on one): the second is an OpenMP worker."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _denormals(n):
    """How many of ``n`` products land as denormals: one element on this thread, or a tensor that ATen splits over
    its threads (1 << 20 elements: both halves run in parallel)."""
    return int(((torch.full((n,), TINY) * 1e-10) != 0).sum())


@flushes
def test_every_thread_flushes_inside_and_none_after(two_threads):
    big = 1 << 20
    assert _denormals(1) == 1 and _denormals(big) == big  # the default: denormals kept
    torch.set_flush_denormal(True)  # what torch offers: the calling thread only
    try:
        assert _denormals(1) == 0 and 0 < _denormals(big) < big  # the worker's half still denormal
        with D.flush_denormals():
            assert _denormals(big) == 0
        # after it, each thread has its own setting back: the caller's flushed, the worker's not
        assert _denormals(1) == 0 and 0 < _denormals(big) < big
    finally:
        torch.set_flush_denormal(False)
    with D.flush_denormals():
        assert _denormals(1) == 0 and _denormals(big) == 0
    assert _denormals(1) == 1 and _denormals(big) == big


@flushes
def test_an_exception_inside_restores_every_thread(two_threads):
    with pytest.raises(RuntimeError, match="inside"), D.flush_denormals():
        assert _denormals(1 << 20) == 0
        raise RuntimeError("inside")
    assert _denormals(1 << 20) == 1 << 20


def test_a_trace_sees_no_host_call(monkeypatch):
    """Under torch.compile's trace the context is a no-op (its ctypes calls would break the graph)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(D, "_runtime", lambda: pytest.fail("a trace reached the flush's runtime"))
    with D.flush_denormals():
        assert _denormals(1) == 1


@flushes
def test_the_causal_key_bias_kernel_flushes_and_keeps_the_oracles_values(two_threads):
    """The per-key kernel (causal ALiBi) runs flushed: its softmax weights of far keys (exp(-87) .. exp(-104)) are
    denormals otherwise; the output and gradients stay those of the float64 reference to float32 rounding."""
    from hf_relpos import kernels_relpos

    seen = []
    real = kernels_relpos._flash_cpu
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(kernels_relpos, "_flash_cpu", lambda *a, **k: seen.append(_denormals(1)) or real(*a, **k))
    try:
        g = torch.Generator().manual_seed(0)
        B, H, n, d = 1, 2, 300, 16
        q, k, v = (torch.randn(B, H, n, d, generator=g, requires_grad=True) for _ in range(3))
        slopes = torch.tensor([1.0, 0.5], dtype=torch.float64)
        key_bias = slopes[:, None] * torch.arange(n, dtype=torch.float64)  # ALiBi's per-key form: m·j
        out = kernels_relpos.causal_key_bias(q, k, v, key_bias)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    finally:
        monkeypatch.undo()
    assert seen and set(seen) == {0}  # every kernel call ran with denormals flushed
    # float64, from the paper: softmax_{j <= i}(q_i·k_j/sqrt(d) - m·(i - j)) v
    wide = [x.detach().double().requires_grad_() for x in (q, k, v)]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    bias = (-slopes[:, None, None] * (i - j)).masked_fill(j > i, float("-inf"))
    ref = torch.softmax(wide[0] @ wide[1].transpose(-1, -2) / d**0.5 + bias, dim=-1) @ wide[2]
    ref_grads = torch.autograd.grad(ref.sum(), wide)
    torch.testing.assert_close(out.double(), ref.detach(), atol=2e-5, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)


@flushes
def test_a_checkpointed_layer_recomputes_unflushed_as_it_first_ran():
    """Non-reentrant checkpointing recomputes a layer when its backward unpacks what it saved: the kernels unpack it
    before they flush, so the recomputed layer runs as the first forward did (review: it ran flushed)."""
    from hf_relpos import kernels_relpos

    seen = []
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g, requires_grad=True) for _ in range(3))
    key_bias = torch.linspace(0, 4, 40, dtype=torch.float64)[None].expand(2, 40)

    def layer(q, k, v):
        seen.append(_denormals(1))  # 1: denormals kept here, outside the kernel
        return kernels_relpos.causal_key_bias(q * 1.0, k, v, key_bias)

    out = torch.utils.checkpoint.checkpoint(layer, q, k, v, use_reentrant=False)
    out.sum().backward()
    assert seen == [1, 1]
