"""FoX, the Forgetting Transformer (Lin et al. 2025), against a float64 oracle written from the paper, and its
cache: cached == uncached, greedy / static / beam / left-padded generation.

The oracle is the paper's eq. (3)-(4) as written: ``log f_t = logsigmoid(w_f · x_t + b_f)`` per head,
``D_ij = Σ_{l=j+1..i} log f_l`` summed explicitly for each pair (no cumsum), ``softmax_{j <= i}(q_i·k_j / sqrt(D)
+ D_ij) v`` in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as TF

from hf_relpos import functional as F
from hf_relpos import kernels_relpos
from tiny import build


def fox_oracle(q, k, v, x, w, b, keys=None):
    """``q, k, v`` [B, H, n, D], gate input ``x`` [B, n, C], gate ``w`` [H, C], ``b`` [H]; ``keys`` [B, n] bool."""
    B, H, n, D = q.shape
    log_f = TF.logsigmoid(x.double() @ w.double().T + b.double())  # [B, n, H]
    rows = []
    for i in range(n):
        row = []
        for j in range(n):
            if j > i:
                row.append(torch.full((B, H), float("-inf"), dtype=torch.float64))
            else:
                row.append(sum((log_f[:, l] for l in range(j + 1, i + 1)), torch.zeros(B, H, dtype=torch.float64)))
        rows.append(torch.stack(row, -1))
    bias = torch.stack(rows, -2)  # [B, H, n, n]
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D) + bias
    if keys is not None:
        scores = scores.masked_fill(~keys[:, None, None, :], float("-inf"))
    alive = torch.isfinite(scores).any(-1, keepdim=True)
    scores = scores.masked_fill(~alive, 0.0)
    return torch.where(alive, torch.softmax(scores, dim=-1), 0.0) @ v.double()


def case(seed, B=2, H=3, n=40, D=8, C=6, dtype=torch.float64, gate_bias=0.0, gate_std=1.0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, std=1.0: (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype)  # noqa: E731
    q, k, v, x = rand(B, H, n, D), rand(B, H, n, D), rand(B, H, n, D), rand(B, n, C)
    w, b = rand(H, C, std=gate_std), rand(H, std=0.5) + gate_bias
    return [t.requires_grad_() for t in (q, k, v, x, w, b)]


def fused(q, k, v, x, w, b, keys=None, **kw):
    log_f = TF.logsigmoid(x @ w.T + b).transpose(1, 2)  # [B, H, n]
    mask = None if keys is None else keys[:, None, None, :]
    if kw:
        return kernels_relpos.causal_key_bias(q, k, v, F.fox_key_bias(log_f), attention_mask=mask, **kw)
    return F.causal_key_bias_attention(q, k, v, F.fox_key_bias(log_f), attention_mask=mask,
                                       span=kernels_relpos.KEY_BIAS_SPAN)


def exact(q, k, v, x, w, b, keys=None):
    log_f = TF.logsigmoid(x @ w.T + b).transpose(1, 2)
    n = q.shape[2]
    bias = F.fox_bias(log_f, n).to(q.dtype)
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    if keys is not None:
        mask = mask & keys[:, None, None, :]
    return F.attention_with_bias(q, k, v, torch.where(mask, bias, torch.finfo(q.dtype).min), scale=q.shape[-1] ** -0.5)


def errors(path, inputs, keys=None):
    """Max abs errors of the values and of the gradients w.r.t. q, k, v, w, b against the oracle."""
    q, k, v, x, w, b = inputs
    got = path(q, k, v, x, w, b, keys)
    want = fox_oracle(*(t.double() for t in (q, k, v, x, w, b)), keys)
    if keys is not None:
        got = got.masked_fill(~keys[:, None, :, None], 0.0)  # padded query rows: anything finite
        want = want.masked_fill(~keys[:, None, :, None], 0.0)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    wrt = (q, k, v, w, b)
    got_grads = torch.autograd.grad(got, wrt, grad.to(got.dtype))
    want_grads = torch.autograd.grad(want, wrt, grad)
    return [(got - want).abs().max().item()] + [
        (a.double() - b).abs().max().item() for a, b in zip(got_grads, want_grads)
    ]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
@pytest.mark.parametrize("path", [fused, exact])
def test_values_and_gradients_match_the_paper(path, dtype, tol):
    """Values and gradients w.r.t. q, k, v and the gate's weight and bias, fused per-key kernel and exact form."""
    inputs = case(3, dtype=dtype)
    keys = torch.ones(2, 40, dtype=torch.bool)
    keys[1, :9] = False  # left padding
    for err in (errors(path, inputs), errors(path, inputs, keys)):
        assert max(err) < tol, err


def test_half_precision_gate_gradient_matches_the_paper():
    """In bf16 training the per-key kernel runs in float32: its half-precision ``Σ_i dS_ij`` per key (its rows no
    longer summing to zero) summed by FoX's cumsum gave 0.17 / 0.35 relative error in w / b here, the merged bias
    0.008, float32 0.005. Against ``Σ_{l=j+1..i} log f_l = c_i - c_j`` in float64."""
    n = 128
    q, k, v, x, w, b = case(7, B=2, H=2, n=n, D=16, C=6, dtype=torch.bfloat16)
    keys = torch.ones(2, n, dtype=torch.bool)
    keys[1, : n // 4] = False  # left padding
    log_f = TF.logsigmoid(x.double() @ w.double().T + b.double()).transpose(1, 2)  # [B, H, n]
    c = log_f.cumsum(-1)
    allowed = torch.ones(n, n, dtype=torch.bool).tril() & keys[:, None, None, :]
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(16) + c[..., :, None] - c[..., None, :]
    want = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.double()
    got = fused(q, k, v, x, w, b, keys)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grad = grad.masked_fill(~keys[:, None, :, None], 0.0)  # padded query rows: not compared
    pairs = zip(torch.autograd.grad(got, (w, b), grad.to(got.dtype)), torch.autograd.grad(want, (w, b), grad))
    for name, (a, e) in zip("wb", pairs):
        error = ((a.double() - e).norm() / e.norm()).item()
        assert error < 0.01, f"grad of the gate's {name}: relative error {error:.3f}"
    assert kernels_relpos.causal_key_bias_applies(q, k, v, F.fox_key_bias(log_f))


def test_chunks_and_strong_forgetting():
    """Chunks of 16 rows with prefix parts, and a strongly forgetting gate (log f about -6 per token) that the
    span splits into smaller chunks: values and gradients still match the oracle in float32."""
    inputs = case(5, n=60, dtype=torch.float32, gate_bias=-6.0, gate_std=0.3)
    log_f = TF.logsigmoid(inputs[3] @ inputs[4].T + inputs[5]).detach()
    assert log_f.mean() < -5
    chunks = kernels_relpos._CausalKeyBiasAttention._chunks(F.fox_key_bias(log_f.transpose(1, 2)), 60, 16, 64.0)
    assert len(chunks) > 60 // 16 + 1 and all(stop - start <= 16 for start, stop in chunks)
    err = errors(lambda *a: fused(*a, chunk=16, span=64.0), inputs)
    assert max(err) < 2e-4, err


def test_a_constant_gate_is_alibi():
    """A gate with zero weights forgets at a constant rate per head: FoX is then ALiBi with slopes -log f."""
    H, n = 4, 30
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    log_f = (-slopes)[None, :, None].expand(1, H, n)
    fox, alibi = F.fox_key_bias(log_f)[0], F.alibi_key_bias(slopes, n)
    torch.testing.assert_close(fox - fox[:, -1:], alibi - alibi[:, -1:], rtol=0, atol=1e-12)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    want = -slopes[:, None, None] * (i - j)
    torch.testing.assert_close(F.fox_bias(log_f, n)[0].masked_fill(j > i, 0), want.masked_fill(j > i, 0), rtol=0,
                               atol=1e-12)


# ----------------------------------------------------------------------------------
# The model: the gate, the cache
# ----------------------------------------------------------------------------------


def test_gate_is_initialised_as_the_authors():
    model = build("fox")
    gate = model.model.layers[0].self_attn.relative.fgate_proj
    assert tuple(gate.weight.shape) == (4, 32) and torch.equal(gate.bias, torch.zeros(4))
    names = [n for n, _ in model.named_parameters() if "fgate" in n]
    assert names[:2] == ["model.layers.0.self_attn.relative.fgate_proj.weight",
                         "model.layers.0.self_attn.relative.fgate_proj.bias"]


@pytest.mark.parametrize("impl,overrides", [("eager", {}), ("sdpa", {}), ("sdpa", {"sliding_window": 4})])
def test_cached_equals_uncached(impl, overrides):
    """Also with a sliding window, whose cache keeps only the latest keys (and their log f)."""
    from transformers import DynamicCache

    model = build("fox", impl=impl, **overrides)
    ids = torch.randint(1, 61, (2, 13), generator=torch.Generator().manual_seed(0))
    full = model(ids).logits
    cache = DynamicCache(config=model.config)
    parts = [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in ((0, 6), (6, 7), (7, 13))]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=2e-5)
    assert cache.layers[0].keys.shape[-1] == model.config.head_dim + 1  # log f rides in the keys


@pytest.mark.parametrize("cache_implementation,prefill_chunk_size", [(None, None), ("static", None), ("static", 2)])
def test_greedy_generate_equals_uncached_argmax(cache_implementation, prefill_chunk_size):
    """A chunked prefill initialises the StaticCache before the first keys (Transformers sizes it head_dim): FoX's
    keys need head_dim + 1, so the cache must wait for them."""
    model = build("fox", impl="sdpa")
    prompt = torch.randint(1, 61, (2, 5), generator=torch.Generator().manual_seed(1))
    got = model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation=cache_implementation,
                         prefill_chunk_size=prefill_chunk_size)
    want = prompt
    for _ in range(6):
        want = torch.cat([want, model(want).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, want)


def test_beam_search_and_left_padding():
    """Beam search reorders the cache's keys and so their log f; a left-padded batch gives each row's own
    tokens (padding precedes every real key, so its log f never enters a real pair's sum)."""
    model = build("fox", impl="sdpa")
    g = torch.Generator().manual_seed(2)
    beams = model.generate(torch.randint(1, 61, (2, 5), generator=g), max_new_tokens=5, num_beams=3, do_sample=False)
    assert beams.shape == (2, 10)
    rows = [torch.randint(1, 61, (1, 7), generator=g), torch.randint(1, 61, (1, 4), generator=g)]
    batch = torch.cat([rows[0], torch.cat([torch.zeros(1, 3, dtype=torch.long), rows[1]], 1)])
    mask = (batch != 0).long()
    mask[0] = 1
    together = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False)
    for r, row in enumerate(rows):
        alone = model.generate(row, max_new_tokens=5, do_sample=False)
        assert torch.equal(together[r, -5:], alone[0, -5:])


def test_continuous_batching_is_refused():
    """The paged cache's blocks are sized head_dim: no room for the gate's channel. One line naming the scheme."""
    pytest.importorskip("transformers.generation.continuous_batching")
    from transformers import GenerationConfig

    model = build("fox")
    with pytest.raises(ValueError, match=r"position_encoding='fox'") as error:
        model.generate_batch(inputs=[[1, 2, 3]], generation_config=GenerationConfig(max_new_tokens=2, do_sample=False))
    assert "\n" not in str(error.value)


def test_a_cache_sized_for_head_dim_keys_is_refused_naming_the_gate():
    """A cache filled by a model of another scheme holds keys of head_dim: one line saying why FoX needs one more."""
    from transformers import DynamicCache

    ids = torch.randint(1, 61, (2, 6), generator=torch.Generator().manual_seed(3))
    other = build("alibi", impl="sdpa")
    cache = DynamicCache(config=other.config)
    other(ids, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"position_encoding='fox', whose keys carry 1 more channel") as error:
        build("fox", impl="sdpa")(ids[:, :1], past_key_values=cache, use_cache=True)
    assert "\n" not in str(error.value)
