"""T5's bias of the distance in the fused kernel (``kernels_relpos.distance_bias_attention``): the query rows
reversed, where the bias is a view of its ``2n - 1`` distances, and a backward that folds the bias gradient per
distance. ``saturating_bias_attention`` takes it on CPU below the band's lengths, and for bidirectional inference
without a mask at any length.

Against the float64 oracle of ``test_bias_band.py`` (upstream's own buckets, a plain softmax), values and gradients;
the two tensor tricks (the sliding window that spreads the table, the skew that folds the gradient) against their
definitions written as loops."""

from __future__ import annotations

import pytest
import torch

from hf_relpos import bias_kernels_relpos as BK
from hf_relpos import functional as F
from hf_relpos import kernels_relpos as K
from test_bias_band import inputs, t5_attention_oracle
from test_shaw_banded import _LargestTensor


@pytest.fixture
def taken(monkeypatch):
    """A record of the calls that took the distance path (a spy: each call still runs it)."""
    calls = []
    real = BK._AttentionWithDistanceBias.apply
    monkeypatch.setattr(BK._AttentionWithDistanceBias, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("n,s", [(1, 1), (2, 3), (7, 2), (40, 91), (130, 5)])
def test_toeplitz_bias_is_the_table_at_each_clipped_distance(n, s):
    table = torch.randn(3, 2 * s + 1, dtype=torch.float64)
    got = K.toeplitz_bias(table, n)
    assert got.shape == (1, 3, n, n)
    for i in range(n):
        for j in range(n):
            assert torch.equal(got[0, :, i, j], table[:, min(max(j - i, -s), s) + s])


@pytest.mark.parametrize("start,c,n,rows", [(0, 9, 9, 32), (5, 37, 50, 8), (40, 10, 50, 3), (0, 64, 64, 64)])
def test_fold_antidiagonals_sums_over_batch_and_rows(start, c, n, rows):
    g = torch.Generator().manual_seed(start + c)
    block = torch.randn(2, 3, c, n, generator=g, dtype=torch.float64)
    sums = torch.zeros(3, 2 * n - 1, dtype=torch.float64)
    BK._fold_antidiagonals(block, sums, start, rows=rows)
    want = torch.zeros_like(sums)
    for r in range(c):
        for j in range(n):
            want[:, start + r + j] += block[:, :, r, j].sum(0)
    torch.testing.assert_close(sums, want, rtol=0, atol=1e-12)


def key_mask(B, n):
    """Bool [B, 1, 1, n]: right padding, and (second row) every key masked."""
    keep = torch.ones(B, 1, 1, n, dtype=torch.bool)
    keep[0, ..., n - 3:] = False
    keep[1] = False
    return keep


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("n,num_buckets,max_distance", [(9, 4, 6), (70, 16, 30), (300, 32, 128)])
def test_values_and_gradients_match_float64_oracle(taken, n, num_buckets, max_distance, causal, padded):
    q, k, v, weight = inputs(n + num_buckets, 2, 3, n, 5, num_buckets)
    table = F.t5_bias_by_distance(weight, bidirectional=not causal, max_distance=max_distance)
    mask = key_mask(2, n) if padded else None
    got = F.saturating_bias_attention(q, k, v, table, is_causal=causal, attention_mask=mask)
    assert taken, "saturating_bias_attention did not take the distance path"
    want = t5_attention_oracle(q, k, v, weight, bidirectional=not causal, max_distance=max_distance, causal=causal,
                               keys=mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    if padded:
        assert not got[1].any()  # no key left: zeros
    grad_out = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    leaves = (q, k, v, weight)
    for name, a, b in zip("q k v weight".split(), torch.autograd.grad(got, leaves, grad_out),
                          torch.autograd.grad(want, leaves, grad_out)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9, msg=lambda m: f"grad of {name}: {m}")


def test_gradcheck_and_second_derivatives(taken):
    """gradcheck, and create_graph through the folded backward (a gradient penalty) against plain autograd of the
    spread bias: the backward spreads the table again, differentiably, so the table's second derivatives are right."""
    q, k, v, _ = inputs(3, 1, 2, 13, 3, 4)
    table = torch.randn(2, 7, dtype=torch.float64, requires_grad=True)  # any per-distance bias, s = 3
    run = lambda *t: F.saturating_bias_attention(*t, scale=0.5)  # noqa: E731
    assert torch.autograd.gradcheck(run, (q, k, v, table))

    def naive(q, k, v, table):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.5 + K.toeplitz_bias(table, q.shape[2]), -1) @ v

    def penalty_grads(fn, xs):
        (dq,) = torch.autograd.grad(fn(*xs).pow(2).sum(), xs[0], create_graph=True)
        return torch.autograd.grad(dq.pow(2).sum(), xs)

    ref = [t.detach().clone().requires_grad_(True) for t in (q, k, v, table)]
    for name, a, b in zip("q k v table".split(), penalty_grads(run, (q, k, v, table)), penalty_grads(naive, ref)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")
    assert taken


def test_float32_matches_the_gathered_bias_it_replaces(taken):
    """At model precision, the same values and gradients as the bias gathered over [1, H, n, n] and differentiated
    through ``attention_with_bias`` (the path before: its gradient scattered back index by index)."""
    q, k, v, weight = inputs(7, 2, 4, 300, 16, 32, dtype=torch.float32)
    table = F.t5_bias_by_distance(weight, bidirectional=True)
    s = table.shape[1] // 2
    index = (torch.arange(300)[None, :] - torch.arange(300)[:, None]).clamp(-s, s) + s
    got = F.saturating_bias_attention(q, k, v, table)
    want = F.attention_with_bias(q, k, v, F.t5_bias_by_distance(weight, bidirectional=True)[:, index].unsqueeze(0))
    grad_out = torch.randn_like(got)
    # The same bias into the same kernel, its rows reversed: the kernel's blocks of rows differ, so float32 rounding
    # may (once in a run of the file, seen) differ in the last place.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got, (q, k, v, weight), grad_out),
                    torch.autograd.grad(want, (q, k, v, weight), grad_out)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(taken) == 1


def test_a_value_head_size_of_its_own_takes_a_path_that_allows_it():
    """The fused kernel takes one head size for q, k and v: with another for v the distance path and
    attention_with_bias's chunked path step aside (both raised "Q/K/V should have the same head size" before)."""
    q, k, _, weight = inputs(11, 2, 3, 20, 8, 8)
    v = torch.randn(2, 3, 20, 5, dtype=torch.float64, requires_grad=True)
    table = F.t5_bias_by_distance(weight, bidirectional=True, max_distance=10)
    got = F.saturating_bias_attention(q, k, v, table)
    want = t5_attention_oracle(q, k, v, weight, bidirectional=True, max_distance=10, causal=False)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    leaves = (q, k, v, weight)
    for a, b in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    dense = K.toeplitz_bias(table.detach(), 20)
    torch.testing.assert_close(F.attention_with_bias(q, k, v, dense), want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("n", [40, K.BIAS_BAND_MIN_LENGTH])
def test_unmasked_inference_reads_the_bias_as_a_view_at_any_length(taken, monkeypatch, n):
    """Without a gradient or a mask, the distance path runs even where a training step takes the band (its forward
    costs about plain SDPA's: results/bench-band-t5_bias.md), and gives the spread bias's output."""
    banded = []
    real = K._BandedAttention.apply
    monkeypatch.setattr(K._BandedAttention, "apply", lambda *a: banded.append(1) or real(*a))
    q, k, v, weight = inputs(5, 1, 2, n, 8, 32, dtype=torch.float32, requires_grad=False)
    table = F.t5_bias_by_distance(weight, bidirectional=True)
    with torch.no_grad():
        got = F.saturating_bias_attention(q, k, v, table)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=K.toeplitz_bias(table, n))
    assert taken and not banded
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def plain(q, k, v, table, mask, scale):
    """The definition, float64 autograd: softmax(q k^T · scale + B + mask) v, a row with no key left giving zeros."""
    scores = q @ k.transpose(-1, -2) * scale + K.toeplitz_bias(table, q.shape[2]) + mask
    alive = ~torch.isneginf(scores).all(-1, keepdim=True)
    return torch.where(alive, torch.softmax(scores.masked_fill(~alive, 0.0), -1), 0.0) @ v


def test_a_float_mask_that_wants_its_gradient_gets_it():
    """Review: the distance path takes its mask as a constant, so a differentiable float mask lost its gradient
    (None); such a mask takes the dense path, whose bias gradient is the mask's too."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    table = torch.randn(2, 7, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(2, 2, 6, 6, generator=g, dtype=torch.float64, requires_grad=True)
    got = torch.autograd.grad(F.saturating_bias_attention(q, k, v, table, attention_mask=mask).sum(), (table, mask))
    want = torch.autograd.grad(plain(q, k, v, table, mask, 8**-0.5).sum(), (table, mask))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_second_derivatives_stay_finite_where_a_row_has_no_key_left(taken):
    """Review: create_graph through a row whose every key is masked gave NaN second derivatives (the softmax of an
    all -inf row is NaN before it is zeroed); now those of the float64 definition."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    table = torch.randn(2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    keys = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    keys[1] = False
    xs = (q, k, v, table)
    additive = torch.zeros(keys.shape, dtype=torch.float64).masked_fill(~keys, float("-inf"))

    def second(out):
        first = torch.autograd.grad(out.sum(), xs, create_graph=True)
        return torch.autograd.grad(sum((d ** 2).sum() for d in first), xs)

    got = second(F.saturating_bias_attention(q, k, v, table, attention_mask=keys))
    want = second(plain(q, k, v, table, additive, 8**-0.5))
    assert taken
    for name, a, b in zip("q k v table".split(), got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_toeplitz_bias_of_no_tokens_is_empty():
    assert K.toeplitz_bias(torch.randn(3, 5), 0).shape == (1, 3, 0, 0)


def alibi_oracle(q, k, v, slopes, keys=None):
    """Press et al. 2022, bidirectional, float64: softmax(q k^T / sqrt(D) - m_h |i - j|) v over the unmasked keys."""
    n, D = q.shape[2], q.shape[3]
    distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs().double()
    scores = q.double() @ k.double().transpose(-1, -2) / D**0.5 - slopes.double()[:, None, None] * distance
    if keys is not None:
        scores = scores.masked_fill(~keys, float("-inf"))
    return torch.softmax(scores, -1) @ v.double()


@pytest.mark.parametrize("n,padded", [(7, False), (70, True), (K.BIAS_BAND_MIN_LENGTH, False)])
def test_a_bias_that_never_saturates_takes_the_distance_path_not_the_band(taken, monkeypatch, n, padded):
    """Bidirectional ALiBi is a bias of every distance (s = n - 1, never constant): saturating_bias_attention gives
    the paper's values and gradients through the distance path, and the band, which would be the whole row, steps
    aside even at its threshold."""
    banded = []
    real = K._BandedAttention.apply
    monkeypatch.setattr(K._BandedAttention, "apply", lambda *a: banded.append(1) or real(*a))
    g = torch.Generator().manual_seed(n)
    B, H, D = 1, 2, 4
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    table = -slopes[:, None] * torch.arange(-(n - 1), n, dtype=torch.float64).abs()  # [H, 2n - 1]
    keys = None
    if padded:
        keys = torch.ones(B, 1, 1, n, dtype=torch.bool)
        keys[..., n - 9:] = False
    got = F.saturating_bias_attention(q, k, v, table, attention_mask=keys)
    want = alibi_oracle(q, k, v, slopes, keys)
    assert taken and not banded
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    if n < 100:  # the gradients' oracle at n = 2048 holds [B, H, n, n] float64 graphs: the values suffice there
        for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


@pytest.mark.parametrize("n,s,chunk", [(16, 4, 256), (40, 5, 7), (97, 9, 32), (300, 20, 64), (130, 91, 256)])
def test_a_saturating_tables_gradient_from_its_band_and_far_sides(monkeypatch, n, s, chunk):
    """Without a mask, a table that saturates within a quarter of the row gets its gradient from the band |j - i| < s
    (in windows of ``chunk`` rows) and each row's smaller far side from a causal call of the fused kernel, the other
    as what is left of the row's zero sum (table_gradient); q, k, v from the fused kernel's own backward. Values
    and every gradient against the float64 oracle (upstream's bucket function, a plain softmax)."""
    calls = []
    real = BK.table_gradient
    monkeypatch.setattr(BK, "table_gradient", lambda *a, **kw: calls.append(1) or real(*a, chunk=chunk))
    g = torch.Generator().manual_seed(n + s)
    B, H, D = 2, 3, 8
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    table = torch.randn(H, 2 * s + 1, generator=g, dtype=torch.float64, requires_grad=True)
    got = BK.distance_bias_attention(q, k, v, table, D**-0.5)
    entry = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).clamp(-s, s) + s
    scores = q @ k.transpose(-1, -2) / D**0.5 + table[:, entry]
    want = torch.softmax(scores, -1) @ v
    cotangent = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(got, (q, k, v, table), cotangent)
    wants = torch.autograd.grad(want, (q, k, v, table), cotangent)
    assert calls == ([1] if 4 * s <= n else [])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for name, a, b in zip(("q", "k", "v", "table"), grads, wants):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m, name=name: f"d{name}: {m}")


def padding_oracle(q, k, v, table, keep, scale):
    """softmax(q k^T · scale + table[h, clamp(j - i, -s, s) + s]) v over the keys ``keep`` holds, float64; a row with
    no key left gives zeros."""
    n, s = q.shape[2], table.shape[1] // 2
    entry = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).clamp(-s, s) + s
    scores = (q @ k.transpose(-1, -2) * scale + table[:, entry]).masked_fill(~keep, float("-inf"))
    alive = keep.any(-1, keepdim=True)
    return torch.where(alive, torch.softmax(scores.masked_fill(~alive, 0.0), -1), 0.0) @ v


@pytest.mark.parametrize("n,s,runs", [
    (97, 9, [(0, 60), (10, 97)]),  # right padding, left padding
    (97, 9, [(5, 50), (0, 0)]),  # both sides; a row with no key
    (60, 4, [(0, 1), (59, 60)]),  # one key
    (130, 20, [(7, 100), (7, 100)]),  # one run for the whole batch: one call
    (97, 9, [(10, 97), (0, 60), (10, 97), (0, 0), (0, 60)]),  # rows grouped by run, out of order
    (40, 12, [(0, 30), (2, 40)]),  # 4s > n: the chunked backward folds the gradient from the run's first key
])
def test_padding_reads_each_runs_keys_alone(monkeypatch, n, s, runs):
    """Padding that keeps one run of keys per row: the rows that keep the same run go in one call over those keys
    alone, with the bias's view over them and no mask (as without padding: the fused kernel's backward, the table's
    gradient from its band and far sides); rows with no key give zeros with no call. Values and every gradient
    against the float64 oracle (RUNS_MIN_LENGTH lowered: from it, rows of different runs are split)."""
    monkeypatch.setattr(BK, "RUNS_MIN_LENGTH", 0)
    calls, far = [], []
    real, real_far = BK._AttentionWithDistanceBias.apply, BK.table_gradient
    monkeypatch.setattr(BK._AttentionWithDistanceBias, "apply",
                        lambda *a: calls.append((a[0].shape[0], a[1].shape[2], a[4] is None, a[5])) or real(*a))
    monkeypatch.setattr(BK, "table_gradient", lambda *a, **kw: far.append(kw["first"]) or real_far(*a, **kw))
    g = torch.Generator().manual_seed(n + s)
    B, H, D = len(runs), 3, 8
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    table = torch.randn(H, 2 * s + 1, generator=g, dtype=torch.float64, requires_grad=True)
    keep = torch.zeros(B, 1, 1, n, dtype=torch.bool)
    for b, (first, stop) in enumerate(runs):
        keep[b, ..., first:stop] = True
    got = F.saturating_bias_attention(q, k, v, table, attention_mask=keep)
    want = padding_oracle(q, k, v, table, keep, D**-0.5)
    cotangent = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(got, (q, k, v, table), cotangent)
    wants = torch.autograd.grad(want, (q, k, v, table), cotangent)
    assert calls == [(runs.count(run), run[1] - run[0], True, run[0]) for run in sorted(set(runs)) if run[1] > run[0]]
    assert sorted(far) == sorted(first for first, stop in set(runs) if stop > first and 4 * s <= n)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for name, a, b in zip(("q", "k", "v", "table"), grads, wants):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m, name=name: f"d{name}: {m}")


def test_below_the_runs_length_rows_of_different_runs_keep_the_merged_mask(monkeypatch):
    """Review: one call per row cost 2.5-5x the merged mask's step for many short rows (B = 32, n = 128). Below
    RUNS_MIN_LENGTH rows of different runs take one call with the merged mask; one run for the whole batch is
    still read alone (no mask at all), rows with no key beside it too; a batch with no key at all, no rows or no
    tokens take the merged mask (n = 0 raised in key_runs)."""
    calls = []
    real = BK._AttentionWithDistanceBias.apply
    monkeypatch.setattr(BK._AttentionWithDistanceBias, "apply",
                        lambda *a: calls.append((a[1].shape[2], a[4] is None)) or real(*a))
    n = BK.RUNS_MIN_LENGTH - 1
    q = torch.randn(2, 2, n, 4)
    table = torch.randn(2, 9)
    keep = torch.ones(2, 1, 1, n, dtype=torch.bool)
    keep[1, ..., n - 5:] = False
    F.saturating_bias_attention(q, q, q, table, attention_mask=keep)
    keep[0, ..., n - 5:] = False
    F.saturating_bias_attention(q, q, q, table, attention_mask=keep)
    keep[0] = False
    F.saturating_bias_attention(q, q, q, table, attention_mask=keep)
    keep[1] = False
    out = F.saturating_bias_attention(q, q, q, table, attention_mask=keep)
    assert calls == [(n, False), (n - 5, True), (n - 5, True), (n, False)]
    assert not out.any()
    for shape in ((2, 2, 0, 4), (0, 2, 5, 4)):
        empty = torch.randn(shape)
        mask = torch.ones(shape[0], 1, 1, shape[2], dtype=torch.bool)
        assert F.saturating_bias_attention(empty, empty, empty, table, attention_mask=mask).shape == shape


def test_a_row_with_no_key_costs_no_query_by_key_tensor():
    """Review: a row with no key kept its mask, merged with the bias into [rows, H, n, n] (forward and backward), where
    the band it replaced at 2,048 tokens makes none: it now gives zeros without a call. Values and gradients against
    the float64 oracle (a row right-padded, a full one, one with no key)."""
    g = torch.Generator().manual_seed(2)
    B, H, n, D, s = 3, 2, BK.RUNS_MIN_LENGTH, 8, 8
    q, k, v = (torch.randn(B, H, n, D, generator=g, requires_grad=True) for _ in range(3))
    table = torch.randn(H, 2 * s + 1, generator=g, requires_grad=True)
    keep = torch.ones(B, 1, 1, n, dtype=torch.bool)
    keep[0, ..., n - 100:] = False
    keep[2] = False
    with _LargestTensor() as seen:
        got = F.saturating_bias_attention(q, k, v, table, attention_mask=keep)
        cotangent = torch.randn(got.shape, generator=g)
        grads = torch.autograd.grad(got, (q, k, v, table), cotangent)
    assert seen.largest < B * H * n * n // 4, seen.largest
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, table)]
    want = padding_oracle(*leaves, keep, D**-0.5)
    wants = torch.autograd.grad(want, leaves, cotangent.double())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert not got[2].any()
    for name, a, b in zip(("q", "k", "v", "table"), grads, wants):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("n,s,run", [(64, 5, (0, 64)), (64, 5, (10, 60)), (97, 9, (0, 60)), (97, 9, (40, 97))])
def test_each_row_computes_its_smaller_far_side(monkeypatch, n, s, run):
    """table_gradient's causal calls are the top half's far left and the bottom half's far right: two triangles of
    about half the run less s a side, where the whole far left was one of the run less s (at n = 1,024 about 10
    against 18 ms: the fused kernel skips masked keys only in blocks of 512). Their values are the oracle tests'."""
    monkeypatch.setattr(BK, "RUNS_MIN_LENGTH", 0)
    causal, real = [], BK._flash_cpu
    monkeypatch.setattr(BK, "_flash_cpu", lambda q, k, v, p, is_causal, **kw: (
        causal.append((q.shape[2], k.shape[2])) if is_causal else None) or real(q, k, v, p, is_causal, **kw))
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    table = torch.randn(2, 2 * s + 1, generator=g, dtype=torch.float64, requires_grad=True)
    keep = torch.zeros(2, 1, 1, n, dtype=torch.bool)
    keep[..., run[0]:run[1]] = True
    F.saturating_bias_attention(q, k, v, table, attention_mask=keep).sum().backward()
    first, stop = run
    sides = [rows for rows, keys in causal]
    assert all(rows == keys for rows, keys in causal)  # triangles, each row of its far side's keys
    assert len(sides) == 2 and sum(sides) == stop - first - 2 * s  # every row with a far side, once
    assert max(sides) - min(sides) <= 1  # halves: the whole far left was one triangle of stop - first - s


def test_key_runs_are_one_run_of_kept_keys_per_row_or_none():
    """What counts as padding: a mask of keys alone, 0 or -inf, one run kept per row (a row of one mask row
    broadcasts); padding inside a sequence, a finite additive value, a mask per query or per head: None."""
    def additive(keep):
        return torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))

    keep = torch.ones(3, 1, 1, 8, dtype=torch.bool)
    keep[0, ..., 6:] = False
    keep[1, ..., :2] = False
    keep[2] = False
    assert BK.key_runs(additive(keep), 3, 8) == [(0, 6), (2, 8), (0, 0)]
    assert BK.key_runs(additive(keep[:1]), 3, 8) == [(0, 6)] * 3
    assert BK.key_runs(additive(keep[0, 0, 0]), 3, 8) == [(0, 6)] * 3  # [n] broadcast over the batch
    inside = keep.clone()
    inside[0, ..., 3] = False
    assert BK.key_runs(additive(inside), 3, 8) is None
    assert BK.key_runs(additive(keep).masked_fill(keep, 0.5), 3, 8) is None
    assert BK.key_runs(additive(keep.expand(3, 1, 8, 8)), 3, 8) is None
    assert BK.key_runs(additive(keep.expand(3, 2, 1, 8)), 3, 8) is None
    assert BK.key_runs(None, 3, 8) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_table_with_half_precision_inputs_gets_the_gradient_of_what_the_forward_added(dtype):
    """Under autocast a T5 model hands a float32 table to bf16 inputs: the forward adds the table rounded to bf16, and
    table_gradient recomputes the probabilities with that rounded bias (with the unrounded one its relative error
    was 0.074 in bf16 and 0.013 in fp16 here, 4x and 13x the chunked backward's)."""
    g = torch.Generator().manual_seed(11)
    B, H, n, D, s = 2, 2, 256, 16, 32
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype).requires_grad_() for _ in range(3))
    table = (torch.randn(H, 2 * s + 1, generator=g) * 30).requires_grad_()
    got = BK.distance_bias_attention(q, k, v, table, D**-0.5)
    cotangent = torch.randn(got.shape, generator=g).to(dtype)
    dtable = torch.autograd.grad(got, table, cotangent)[0]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    table64 = table.detach().to(dtype).double().requires_grad_()  # the bias the forward added
    entry = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).clamp(-s, s) + s
    want = torch.softmax(q64 @ k64.transpose(-1, -2) / D**0.5 + table64[:, entry], -1) @ v64
    want_table = torch.autograd.grad(want, table64, cotangent.double())[0]
    err = ((dtable.double() - want_table).norm() / want_table.norm()).item()
    assert err < (3.5e-2 if dtype == torch.bfloat16 else 4e-3), err  # the chunked backward: 0.017, 0.001


def test_a_table_of_huge_values_keeps_the_chunked_backward(monkeypatch):
    """A float32 table whose every value is about -1e5 puts each row's log-sum-exp there, where ``exp(S - lse)`` loses
    the precision of its scores: table_gradient steps aside for the chunked backward's exact softmax, whose gradients
    hold against float64 as far as float32 scores at -1e5 can (their spacing there is 0.008)."""
    calls = []
    real = BK.table_gradient
    monkeypatch.setattr(BK, "table_gradient", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(9)
    B, H, n, D, s = 1, 2, 40, 4, 5
    q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
    table = torch.randn(H, 2 * s + 1, generator=g) - 1e5
    grads = {}
    for dtype in (torch.float32, torch.float64):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, table)]
        out = BK.distance_bias_attention(*leaves[:3], leaves[3], D**-0.5)
        grads[dtype] = torch.autograd.grad(out.sum(), leaves)
    assert calls == [1], "float64 keeps the precision: the far sides; float32 does not"
    for name, a, b in zip(("q", "k", "v", "table"), grads[torch.float32], grads[torch.float64]):
        assert (a.double() - b).abs().max() <= 2e-2 * b.abs().max(), name


@pytest.mark.parametrize("padded", [False, True])
def test_a_saturating_tables_far_sides_in_float32_hold_against_float64(padded):
    """A row's larger far side is what is left of its zero sum: in float32 its rounding stays at the chunked
    backward's level against float64 (n = 1,024, T5's 32 buckets up to 128: s = 91), padded rows too (right and
    left padding, each row its own run of keys)."""
    g = torch.Generator().manual_seed(3)
    B, H, n, D, s = 2, 4, 1024, 32, 91
    q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
    table = torch.randn(H, 2 * s + 1, generator=g)
    cotangent = torch.randn(B, H, n, D, generator=g)
    keep = torch.ones(B, 1, 1, n, dtype=torch.bool)
    keep[0, ..., 1000:] = False
    keep[1, ..., :300] = False
    grads = {}
    for dtype in (torch.float32, torch.float64):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, table)]
        mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf")) if padded else None
        out = BK.distance_bias_attention(*leaves[:3], leaves[3], D**-0.5, mask=mask)
        grads[dtype] = torch.autograd.grad(out, leaves, cotangent.to(dtype))
    for name, a, b in zip(("q", "k", "v", "table"), grads[torch.float32], grads[torch.float64]):
        err = (a.double() - b).abs().max() / b.abs().max()
        assert err < 1e-5, (name, err.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("masked", [None, "padded", "a row with no key"])
def test_a_fixed_table_takes_the_fused_kernels_own_backward(monkeypatch, dtype, masked):
    """A table that wants no gradient (ALiBi's, log-decay's slopes are fixed) is differentiated by the fused
    kernel's own backward, reading the same view as the forward (the chunked backward made ALiBi's step 1.4x
    rope's): values and gradients of q, k, v against the float64 oracle, zeros for a row with no key."""
    fused = []
    real = BK._flash_cpu_backward
    monkeypatch.setattr(BK, "_flash_cpu_backward", lambda *a, **kw: fused.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(5)
    B, H, n, D = 2, 2, 45, 8
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=dtype, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([0.5, 0.125], dtype=torch.float64)
    table = (-slopes[:, None] * torch.arange(-(n - 1), n, dtype=torch.float64).abs()).to(dtype)
    keys = torch.ones(B, 1, n, n, dtype=torch.bool)
    if masked == "padded":
        keys[1, ..., n - 7:] = False
    if masked == "a row with no key":
        keys[0, :, 3] = False
    mask = None if masked is None else torch.zeros(keys.shape, dtype=dtype).masked_fill(~keys, float("-inf"))
    got = BK.distance_bias_attention(q, k, v, table, D**-0.5, mask=mask)
    distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs().double()
    scores = q.double() @ k.double().transpose(-1, -2) / D**0.5 - slopes[:, None, None] * distance
    probs = torch.softmax(scores.masked_fill(~keys, float("-inf")), -1).nan_to_num(0.0)  # a dead row attends nothing
    want = probs @ v.double()
    cotangent = torch.randn(got.shape, generator=g, dtype=dtype)
    grads = torch.autograd.grad(got, (q, k, v), cotangent)
    assert fused, "the fused kernel's backward"
    wants = torch.autograd.grad(want, (q, k, v), cotangent.double())
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)
    for name, a, b in zip("qkv", grads, wants):
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=tol * 10, msg=lambda m, name=name: f"d{name}: {m}")
    if masked == "a row with no key":
        assert got[0, :, 3].abs().max() == 0 and grads[0][0, :, 3].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scheme", ["alibi", "log_decay", "kerple_log"])
@pytest.mark.parametrize("padded", [False, True])
def test_a_bidirectional_bias_of_the_distance_alone_takes_the_distance_path_with_the_dense_bias_results(
    taken, monkeypatch, padded, scheme, dtype
):
    """A bidirectional model's compact ALiBi, log-decay or KERPLE term (the bias of every distance) gives the outputs
    and gradients (KERPLE's r1, r2 among them) of its dense [1, H, n, n] bias, which the model tests check against
    the float64 model oracle. In float64 to float64's rounding (review: KERPLE's compact bias was rounded to float32,
    5e-7 from the dense one's)."""
    from hf_relpos import RelPosConfig, RelPosModel

    config = RelPosConfig(position_encoding=scheme, vocab_size=64, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=64, is_decoder=False)
    torch.manual_seed(0)
    model = RelPosModel(config).to(dtype)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 64, (2, 37))
    mask = torch.ones(2, 37, dtype=torch.long)
    if padded:
        mask[1, 30:] = 0

    def run():
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out.pow(2).mean().backward()
        return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    compact_out, compact_grads = run()
    assert len(taken) == config.num_hidden_layers  # padded: rows of 37 tokens keep the merged mask
    monkeypatch.setattr(model.position, "compact", lambda ctx, device, dtype: None)
    dense_out, dense_grads = run()
    assert len(taken) == config.num_hidden_layers  # the dense bias does not take the distance path
    keep = mask.bool()
    exact = dtype == torch.float64
    torch.testing.assert_close(compact_out[keep], dense_out[keep], rtol=0 if exact else 1e-6,
                               atol=1e-13 if exact else 1e-6)
    assert compact_grads.keys() == dense_grads.keys()
    assert scheme != "kerple_log" or {"position.r1", "position.r2"} <= compact_grads.keys()
    for name, grad in compact_grads.items():
        torch.testing.assert_close(grad, dense_grads[name], rtol=0 if exact else 1e-5, atol=1e-12 if exact else 1e-7,
                                   msg=name)
