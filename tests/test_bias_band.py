"""T5's bias through the band decomposition (``saturating_bias_attention``) against float64 oracles.

The oracle builds the bias of every (query, key) pair from upstream Transformers' own
``T5Attention._relative_position_bucket`` and runs a plain float64 softmax: nothing in it comes
from the banded code. On CPU ``saturating_bias_attention`` takes the band from ``kernels_relpos.BIAS_BAND_MIN_LENGTH``
tokens (``CAUSAL_BIAS_BAND_MIN_LENGTH`` causal); the tests call the kernel (``kernels_relpos.saturating_bias_banded``)
directly on short sequences so the oracles stay fast, and check that the banded path really ran.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_relpos import functional as F
from hf_relpos import kernels_relpos as K
from test_shaw_banded import _LargestTensor, outputs_and_grads


def upstream_bucket(distance, bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    return T5Attention._relative_position_bucket(
        distance, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )


def t5_attention_oracle(q, k, v, weight, *, bidirectional, max_distance, causal, keys=None):
    """softmax(q k^T / sqrt(D) + weight[bucket(j - i)]) v in float64, keys j > i masked when causal and
    where the bool ``keys`` mask is False; a row with no key left gives zeros."""
    n, D = q.shape[2], q.shape[3]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    buckets = upstream_bucket(j - i, bidirectional, weight.shape[0], max_distance)
    bias = weight.double()[buckets].permute(2, 0, 1)  # [H, n, n]
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D) + bias
    allowed = torch.ones(n, n, dtype=torch.bool) if not causal else (j <= i)
    if keys is not None:
        allowed = allowed & keys
    alive = allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~alive, 0.0)  # no NaN in the gradients
    return torch.where(alive, torch.softmax(scores, dim=-1), 0.0) @ v.double()


def inputs(seed, B, H, n, D, num_buckets, dtype=torch.float64, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)  # noqa: E731
    return make(B, H, n, D), make(B, H, n, D), make(B, H, n, D), make(num_buckets, H)


@pytest.fixture
def band(monkeypatch):
    """A record of the calls that took the band (a spy: each call still runs the kernel)."""
    calls = []
    real = K._BandedAttention.apply
    monkeypatch.setattr(K._BandedAttention, "apply", lambda *a: calls.append(a[6]) or real(*a))
    return calls


def banded(q, k, v, bias, **kwargs):
    """``saturating_bias_attention`` by the band decomposition, in passes of one block each (several per test
    sequence)."""
    return K.saturating_bias_banded(q, k, v, bias, rows=64, **kwargs)


@settings(max_examples=40, deadline=None)
@given(bidirectional=st.booleans(), num_buckets=st.integers(2, 40), max_distance=st.integers(2, 300))
def test_saturation_distance_is_where_upstream_buckets_stop_changing(bidirectional, num_buckets, max_distance):
    one_side = num_buckets // 2 if bidirectional else num_buckets
    if one_side // 2 < 1 or max_distance <= one_side // 2:
        return  # configurations upstream cannot bucket (t5_relative_position_bucket refuses them)
    s = F.t5_saturation_distance(bidirectional, num_buckets, max_distance)
    d = torch.arange(0, 3 * max_distance + 5)
    left = upstream_bucket(-d, bidirectional, num_buckets, max_distance)
    assert (left[s:] == left[-1]).all() and left[s - 1] != left[-1]
    if bidirectional:
        right = upstream_bucket(d, bidirectional, num_buckets, max_distance)
        assert (right[s:] == right[-1]).all() and right[s - 1] != right[-1]


@pytest.mark.parametrize(
    "n,num_buckets,max_distance,causal",
    [
        (9, 4, 6, False),  # s = 1: the band is the diagonal alone
        (40, 8, 20, False),
        (40, 8, 20, True),
        (70, 16, 30, False),  # n crosses the band's block (64)
        (200, 32, 128, False),  # s = 91: a band wider than a block, n not a multiple of it
        (100, 32, 128, False),  # the band reaches past both ends of most rows
        (200, 32, 128, True),
    ],
)
def test_values_and_gradients_match_float64_oracle(band, n, num_buckets, max_distance, causal):
    q, k, v, weight = inputs(n + num_buckets, 2, 3, n, 5, num_buckets)
    table = F.t5_bias_by_distance(weight, bidirectional=not causal, max_distance=max_distance)
    got = banded(q, k, v, table, is_causal=causal)
    assert len(band) == 1
    want = t5_attention_oracle(q, k, v, weight, bidirectional=not causal, max_distance=max_distance, causal=causal)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    grad_out = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    leaves = (q, k, v, weight)
    for name, a, b in zip("q k v weight".split(), torch.autograd.grad(got, leaves, grad_out),
                          torch.autograd.grad(want, leaves, grad_out)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(band, causal):
    q, k, v, _ = inputs(3, 1, 2, 13, 3, 4)
    table = torch.randn(2, 7, dtype=torch.float64, requires_grad=True)  # any per-distance bias, s = 3
    assert torch.autograd.gradcheck(lambda *t: banded(*t, is_causal=causal), (q, k, v, table))
    assert band


@pytest.mark.parametrize("causal", [False, True])
def test_band_matches_the_spread_bias_it_replaces(band, causal):
    """The banded path against the bias spread over [1, H, n, n] in attention_with_bias (fp32, as models run),
    which saturating_bias_attention takes below kernels_relpos.BIAS_BAND_MIN_LENGTH."""
    q, k, v, weight = inputs(7, 2, 4, 300, 16, 32, dtype=torch.float32)
    leaves = (q, k, v, weight)
    run = lambda attention: attention(  # noqa: E731
        q, k, v, F.t5_bias_by_distance(weight, bidirectional=not causal), is_causal=causal
    )
    band_out = run(banded)
    grad_out = torch.randn_like(band_out)
    banded_grads = torch.autograd.grad(band_out, leaves, grad_out)
    spread = run(F.saturating_bias_attention)
    spread_grads = torch.autograd.grad(spread, leaves, grad_out)
    assert len(band) == 1
    torch.testing.assert_close(band_out, spread, rtol=1e-5, atol=1e-5)
    for a, b in zip(banded_grads, spread_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_bfloat16_close_to_float64(band):
    n = 160
    q, k, v, weight = inputs(21, 1, 2, n, 16, 8, dtype=torch.bfloat16)
    table = F.t5_bias_by_distance(weight, max_distance=20)
    out = banded(q, k, v, table)
    assert out.dtype == torch.bfloat16 and band
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad(out, (q, k, v, weight), grad_out.bfloat16())
    ref = [t.detach().double().requires_grad_(True) for t in (q, k, v, weight)]
    want_out = t5_attention_oracle(*ref, bidirectional=True, max_distance=20, causal=False)
    want = torch.autograd.grad(want_out, ref, grad_out.double())
    assert ((out.double() - want_out).norm() / want_out.norm()) < 1e-2
    for name, a, b in zip("q k v weight".split(), got, want):
        assert a.dtype == torch.bfloat16
        assert ((a.double() - b).norm() / b.norm()) < 2e-2, name


@pytest.mark.parametrize("causal", [False, True])
def test_never_forms_a_query_by_key_tensor(causal):
    """At the real thresholds: forward and backward stay O(B·H·n·(block + 2s)), no [B, H, n, n] tensor."""
    B, H, n = 1, 2, K.CAUSAL_BIAS_BAND_MIN_LENGTH if causal else K.BIAS_BAND_MIN_LENGTH
    q, k, v, weight = inputs(2, B, H, n, 8, 8, dtype=torch.float32)
    table = F.t5_bias_by_distance(weight, bidirectional=not causal, max_distance=20)
    with _LargestTensor() as seen:
        F.saturating_bias_attention(q, k, v, table, is_causal=causal).sum().backward()
    assert seen.largest < B * H * n * n // 4, seen.largest


def test_rejects_a_bias_that_is_not_per_head_and_distance():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"bias must have shape \[heads=2, 2s\+1\]"):
        F.saturating_bias_attention(q, q, q, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="bias must have shape"):
        F.saturating_bias_attention(q, q, q, torch.zeros(3, 5))
    with pytest.raises(ValueError, match="self-attention"):
        F.saturating_bias_attention(q, q[:, :, :5], q[:, :, :5], torch.zeros(2, 5))


@pytest.mark.parametrize("is_decoder", [False, True])
def test_model_takes_its_fast_path_and_matches_the_full_bias(band, monkeypatch, is_decoder):
    """A T5-bias model at the band's threshold (no padding): the band (causal) or the distance path with the table's
    gradient from its band and far sides (bidirectional: ``bias_kernels_relpos.table_gradient``) gives the outputs
    and gradients (the shared table's included) of the model with the full [1, H, n, n] bias, which the model tests
    check against the float64 model oracle."""
    from hf_relpos import RelPosConfig, RelPosModel
    from hf_relpos import bias_kernels_relpos as BK

    far = []
    real = BK.table_gradient
    monkeypatch.setattr(BK, "table_gradient", lambda *a, **kw: far.append(1) or real(*a, **kw))

    config = RelPosConfig(position_encoding="t5_bias", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=64, is_decoder=is_decoder,
                          relative_attention_num_buckets=16, relative_attention_max_distance=40)
    torch.manual_seed(0)
    model = RelPosModel(config)
    torch.nn.init.normal_(model.position.relative_attention_bias.weight, std=1.0)
    n = K.CAUSAL_BIAS_BAND_MIN_LENGTH if is_decoder else K.BIAS_BAND_MIN_LENGTH
    ids = torch.randint(0, 64, (2, n))

    banded_out, banded_grads = outputs_and_grads(model, ids)
    taken = band if is_decoder else far
    assert (len(band), len(far)) == ((config.num_hidden_layers, 0) if is_decoder else (0, config.num_hidden_layers))
    monkeypatch.setattr(model.position, "compact", lambda ctx, device, dtype: None)
    full_out, full_grads = outputs_and_grads(model, ids)
    assert len(taken) == config.num_hidden_layers
    torch.testing.assert_close(banded_out, full_out, rtol=1e-5, atol=1e-5)
    for a, b in zip(banded_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("n,causal", [(40, False), (40, True), (150, False), (150, True)])
def test_padding_keeps_the_band_and_matches_float64_oracle(band, n, causal):
    """A key mask (padding), including a row of all-masked keys (zeros, finite gradients)."""
    from test_shaw_banded import padding_mask

    q, k, v, weight = inputs(n, 4, 2, n, 5, 16)
    mask = padding_mask(4, n, torch.Generator().manual_seed(n))
    table = F.t5_bias_by_distance(weight, bidirectional=not causal, max_distance=30)
    got = banded(q, k, v, table, attention_mask=mask, is_causal=causal)
    assert len(band) == 1
    want = t5_attention_oracle(q, k, v, weight, bidirectional=not causal, max_distance=30, causal=causal, keys=mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert not got[2].any()
    grad_out = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    leaves = (q, k, v, weight)
    for name, a, b in zip("q k v weight".split(), torch.autograd.grad(got, leaves, grad_out),
                          torch.autograd.grad(want, leaves, grad_out)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("position_encoding,is_decoder", [("t5_bias", False), ("t5_bias", True), ("shaw", False),
                                                          ("shaw", True), ("alibi", True)])
def test_padded_batch_keeps_the_fast_path(band, monkeypatch, position_encoding, is_decoder):
    """A padded batch (right and left padding) at the band's threshold takes the band / per-key path, or for
    bidirectional T5 the distance path one call per run of keys over those keys: the same outputs and gradients as the
    same padding given as a [B, 1, Q, K] mask, which takes the general path."""
    from hf_relpos import RelPosConfig, RelPosModel
    from hf_relpos import attention_backends_relpos, position_schemes_relpos
    from hf_relpos import bias_kernels_relpos as BK

    firsts = []  # the first key each call of the distance path reads
    real_distance = BK._AttentionWithDistanceBias.apply
    monkeypatch.setattr(BK._AttentionWithDistanceBias, "apply", lambda *a: firsts.append(a[5]) or real_distance(*a))

    config = RelPosConfig(position_encoding=position_encoding, vocab_size=64, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=64, is_decoder=is_decoder,
                          relative_attention_num_buckets=16, relative_attention_max_distance=40,
                          max_relative_position=6)
    torch.manual_seed(0)
    model = RelPosModel(config).double()
    for name, p in model.named_parameters():  # relative tables away from their zero init
        if "relative" in name:
            torch.nn.init.normal_(p, std=0.5)
    n = {"t5_bias": K.CAUSAL_BIAS_BAND_MIN_LENGTH if is_decoder else K.BIAS_BAND_MIN_LENGTH,
         "shaw": K.SHAW_BAND_MIN_LENGTH, "alibi": 120}[position_encoding]
    ids = torch.randint(0, 64, (3, n))
    keep = torch.ones(3, n, dtype=torch.long)
    keep[0, n - 17:] = 0  # right padding
    keep[1, :23] = 0  # left padding
    fast = {"t5_bias": "saturating_bias_attention", "shaw": "shaw_attention", "alibi": "causal_key_bias_attention"}
    fast_calls = []
    # Shaw's whole attention call is the scheme's; the compact forms' fused paths are the backend's.
    module = position_schemes_relpos if position_encoding == "shaw" else attention_backends_relpos
    real = getattr(module, fast[position_encoding])
    monkeypatch.setattr(module, fast[position_encoding],
                        lambda *a, **k: fast_calls.append(k.get("attention_mask")) or real(*a, **k))

    def run(mask):
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        (out * keep[..., None]).pow(2).mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    fast_out, fast_grads = run(keep)
    assert len(fast_calls) == 2 and all(m is not None and m.shape == (3, 1, 1, n) for m in fast_calls)
    by_distance = position_encoding == "t5_bias" and not is_decoder
    banded = 0 if position_encoding == "alibi" or by_distance else 2
    assert len(band) == banded
    assert firsts == ([0, 0, 23] * 2 if by_distance else [])  # rows 0 and 2 keep keys from 0, row 1 from 23
    general_out, general_grads = run(keep.bool()[:, None, None, :].expand(3, 1, n, n))
    assert len(band) == banded  # the general path does not take the band
    torch.testing.assert_close(fast_out, general_out, rtol=0, atol=1e-10)
    for a, b in zip(fast_grads, general_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_passes_over_the_band_do_not_change_the_result(band):
    """The band is computed a pass of ``rows`` query rows at a time (forward and backward): one pass,
    passes of two blocks and passes of one block give the same values and gradients."""
    q, k, v, weight = inputs(23, 2, 3, 300, 8, 16)
    mask = torch.ones(2, 1, 1, 300, dtype=torch.bool)
    mask[1, ..., 250:] = False
    results = []
    for rows in (10**6, 128, 64):
        out = K.saturating_bias_banded(q, k, v, F.t5_bias_by_distance(weight, max_distance=40), attention_mask=mask,
                                       rows=rows)
        results.append((out, *torch.autograd.grad(out.pow(2).sum(), (q, k, v, weight))))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _band_oracle(q, k, v, rel_k, rel_v, bias, reach, keys, causal, scale):
    """float64, from the definition: every term of the clipped distance clamp(j - i, -(reach+1), reach+1), a full
    [n, n] softmax with causality and the key mask, zeros for a row with no key."""
    n = q.shape[2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    idx = (j - i).clamp(-reach - 1, reach + 1) + reach + 1
    s = q @ k.transpose(-1, -2)
    if rel_k is not None:
        s = s + torch.einsum("bhid,ijd->bhij", q, rel_k[idx])
    s = s * scale
    if bias is not None:
        s = s + bias[:, idx]
    hidden = (j > i) if causal else torch.zeros(n, n, dtype=torch.bool)
    hidden = hidden.expand(q.shape[0], q.shape[1], n, n)
    if keys is not None:
        hidden = hidden | ~keys[..., None, :]
    p = torch.softmax(s.masked_fill(hidden, float("-inf")), -1).nan_to_num(0.0)
    out = p @ v
    return out if rel_v is None else out + torch.einsum("bhij,ijd->bhid", p, rel_v[idx])


@pytest.mark.parametrize("seed", range(4))
def test_the_band_against_its_definition_over_random_shapes(seed):
    """The band decomposition (every term: Shaw's rel_k and rel_v, a per-distance bias) against the float64
    definition, values and every gradient, over random shapes: causal and not, a reach wider than a pass, blocks
    that do not divide the rows, passes that overlap in their key windows, padding on either side (review)."""
    import math
    import random

    from hf_relpos import kernels_relpos

    rng = random.Random(seed)
    for trial in range(12):
        B, H, D = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([3, 4])
        reach = rng.choice([0, 1, 2, 3, 5, 9, 17])
        n = rng.randint(reach + 2, 70)
        block, rows = rng.choice([1, 3, 4, 7, 16, 64]), rng.choice([1, 2, 5, 8, 13, 100])
        causal, kind = rng.random() < 0.6, rng.choice(["shaw", "shaw_k", "bias", "all"])
        g = torch.Generator().manual_seed(100 * seed + trial)
        q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
        table = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
        rel_k = table(2 * reach + 3, D) if kind in ("shaw", "shaw_k", "all") else None
        rel_v = table(2 * reach + 3, D) if kind in ("shaw", "all") else None
        bias = table(H, 2 * reach + 3) if kind in ("bias", "all") else None
        keys = None
        if rng.random() < 0.5:
            keys = torch.rand(rng.choice([1, B]), 1, n, generator=g) < rng.choice([0.3, 0.7, 0.95])
            if rng.random() < 0.3:
                keys[..., : rng.randint(0, n)] = False  # left padding
        inputs = [t for t in (q, k, v, rel_k, rel_v, bias) if t is not None]
        scale = 1 / math.sqrt(D)
        out = kernels_relpos._BandedAttention.apply(q, k, v, rel_k, rel_v, bias, keys, reach, causal, scale, block, rows)
        want = _band_oracle(q, k, v, rel_k, rel_v, bias, reach, keys, causal, scale)
        grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
        got_grads = torch.autograd.grad(out, inputs, grad_out)
        want_grads = torch.autograd.grad(want, inputs, grad_out, allow_unused=True)
        case = dict(B=B, H=H, D=D, reach=reach, n=n, block=block, rows=rows, causal=causal, kind=kind,
                    keys=keys is not None)
        torch.testing.assert_close(out, want, atol=1e-9, rtol=0, msg=lambda m: f"{case}: {m}")
        for got, expected in zip(got_grads, want_grads):
            expected = torch.zeros_like(got) if expected is None else expected
            torch.testing.assert_close(got, expected, atol=1e-9, rtol=0, msg=lambda m: f"{case}: {m}")
