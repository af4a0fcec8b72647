"""Each position scheme's math inside the model: a float64 forward written from the formulas of every scheme
(``reference_forward``), order sensitivity, Transformer-XL's memory, and each scheme's initialisation and details
(FIRE's normaliser, KERPLE's floor, Transformer-XL's projection cache).

The tiny models are the "modeling" preset of tiny.py; ``reference_forward`` is also the attention-weight oracle of
test_transformers_behaviour.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny import (
    ENCODINGS,
    IMPLS,
    assert_close,
    assert_close_where,
    build,
    greedy,
    manual_greedy,
    padding_mask,
    rand_ids,
)
from transformers import DynamicCache

import hf_relpos
from hf_relpos import RelPosForCausalLM, RelPosModel

# ---------------------------------------------------------------------------
# 1. each scheme against a float64 forward written from its formula
# ---------------------------------------------------------------------------


def reference_forward(model: RelPosModel, ids: torch.Tensor, mask: torch.Tensor, attentions=None) -> torch.Tensor:
    """A slow float64 forward written from the formulas of the contract, one score matrix per head.

    Reads the model's weights by name but none of its code paths: the position term of every scheme
    is built here from the distance matrix ``d[i, j] = j - i`` (key minus query). Each layer's
    probabilities ``[B, H, L, L]`` are appended to ``attentions`` when a list is given.
    """
    config = model.config
    pe, H, D = config.position_encoding, config.num_attention_heads, config.head_dim
    causal = config.is_decoder
    B, L = ids.shape
    dd = torch.float64
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    dist = j - i  # key position minus query position
    allowed = mask.bool()[:, None, None, :].expand(B, 1, L, L)
    if causal:
        allowed = allowed & (dist <= 0)

    def norm(x, module):
        return module.weight.to(dd) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)

    def lin(x, module):
        out = x @ module.weight.to(dd).T
        return out if module.bias is None else out + module.bias.to(dd)

    body = model
    h = body.embed_tokens.weight.to(dd)[ids]
    if pe == "sinusoidal":
        # Vaswani et al.: token embeddings times sqrt(d_model), plus the unit-amplitude sinusoids
        h = h * math.sqrt(config.hidden_size) + hf_relpos.functional.sinusoidal_embedding(
            torch.arange(L, dtype=dd), config.hidden_size)
    elif pe == "learned":
        h = h + body.position.position_embeddings.weight.to(dd)[:L]
    for layer in body.layers:
        attn = layer.self_attn
        x = norm(h, layer.input_layernorm)
        q, k, v = (lin(x, m).view(B, L, H, D).transpose(1, 2) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        if pe == "rope":
            inv = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2, dtype=dd) / D))
            ang = torch.arange(L, dtype=dd)[:, None] * inv[None]
            cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

            def rot(t):
                t1, t2 = t[..., : D // 2], t[..., D // 2 :]
                return t * cos + torch.cat([-t2, t1], -1) * sin

            q, k = rot(q), rot(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D)
        if pe == "t5_bias":
            buckets = hf_relpos.functional.t5_relative_position_bucket(
                dist, bidirectional=not causal, num_buckets=config.relative_attention_num_buckets,
                max_distance=config.relative_attention_max_distance,
            )
            table = body.position.relative_attention_bias.weight.to(dd)
            scores = scores + table[buckets].permute(2, 0, 1)[None]
        elif pe == "log_decay":
            scores = scores - config.log_decay_scale * torch.log1p(dist.abs().to(dd))
        elif pe == "alibi":
            slopes = hf_relpos.functional.alibi_slopes(H, dtype=dd)
            scores = scores - slopes[:, None, None] * dist.abs().to(dd)
        elif pe == "kerple_log":  # -r1_h ln(1 + r2_h |i - j|), r1, r2 kept >= 0.01 as KERPLE's code does
            r1 = body.position.r1.to(dd).clamp_min(0.01)[:, None, None]
            r2 = body.position.r2.to(dd).clamp_min(0.01)[:, None, None]
            scores = scores - r1 * torch.log(1 + r2 * dist.abs().to(dd))
        elif pe == "fire":  # f(psi(i - j) / psi(max(L, i))), psi(x) = ln(1 + |c x|), f a ReLU MLP per head
            fire = body.position
            c = fire.c.to(dd)
            threshold = (fire.threshold_scale.to(dd) * config.fire_threshold).abs()
            psi = lambda x: torch.log(1 + (c * x).abs())  # noqa: E731
            x = psi(-dist.to(dd)) / (psi(torch.maximum(i.to(dd), threshold)) + 1e-6)  # [L, L]
            hidden = torch.relu(x[..., None] * fire.mlp[0].weight.to(dd)[:, 0] + fire.mlp[0].bias.to(dd))
            scores = scores + (hidden @ fire.mlp[2].weight.to(dd).T + fire.mlp[2].bias.to(dd)).permute(2, 0, 1)
        elif pe == "fox":  # Lin et al. 2025: + sum_{l=j+1..i} log f_l, log f = logsigmoid(fgate_proj(x)) per head
            log_f = torch.nn.functional.logsigmoid(lin(x, attn.relative.fgate_proj))  # [B, L, H]
            after = (j[..., None] < torch.arange(L)) & (torch.arange(L) <= i[..., None])  # [L, L, l]: j < l <= i
            scores = scores + torch.einsum("ijl,blh->bhij", after.to(dd), log_f)
        elif pe == "shaw":
            kmax = config.max_relative_position
            index = dist.clamp(-kmax, kmax) + kmax
            rel_k = attn.relative.rel_k.to(dd)[index]  # [L, L, D]
            scores = scores + torch.einsum("bhid,ijd->bhij", q, rel_k) / math.sqrt(D)
        elif pe == "transformer_xl":
            rel = attn.relative
            back = (-dist) if config.clamp_len < 0 else (-dist).clamp(-config.clamp_len, config.clamp_len)
            R = hf_relpos.functional.sinusoidal_embedding(back.reshape(-1).to(dd), config.hidden_size)
            r = lin(R, rel.r_net).view(L, L, H, D)  # W_{k,R} R_{i-j}
            u, w = rel.r_w_bias.to(dd), rel.r_r_bias.to(dd)
            content = (q + u[None, :, None]) @ k.transpose(-1, -2)
            position = torch.einsum("bhid,ijhd->bhij", q + w[None, :, None], r)
            scores = (content + position) / math.sqrt(D)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, -1).nan_to_num(0.0)
        if attentions is not None:
            attentions.append(probs)
        out = probs @ v
        if pe == "shaw" and attn.relative.rel_v is not None:
            out = out + torch.einsum("bhij,ijd->bhid", probs, attn.relative.rel_v.to(dd)[index])
        h = h + lin(out.transpose(1, 2).reshape(B, L, -1), attn.o_proj)
        y = lin(layer.mlp.act_fn(lin(norm(h, layer.post_attention_layernorm), layer.mlp.up_proj)), layer.mlp.down_proj)
        h = h + y
    return norm(h, body.norm)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_matches_reference_forward(position_encoding, causal, impl):
    overrides = {"clamp_len": 4} if position_encoding == "transformer_xl" and causal else {}
    if position_encoding == "fire":
        overrides = {"fire_threshold": 4.0}  # rows past the threshold: FIRE's progressive normalisation
    model = build(position_encoding, cls=RelPosModel, impl=impl, is_decoder=causal, **overrides)
    B, L = 2, 11
    ids = rand_ids(B, L, seed=31)
    mask = padding_mask(B, L, "right", pads=(0, 3))
    with torch.no_grad():
        got = model(ids, attention_mask=mask, use_cache=False).last_hidden_state
        expected = reference_forward(model, ids, mask)
    assert_close_where(got.double(), expected, mask, atol=1e-4, what=f"{position_encoding} vs reference")


def test_positions_matter(make_model, scheme):  # conftest fixtures: the builder, every scheme
    """Guard for the other tests: the tiny models really depend on token order."""
    model = make_model(RelPosForCausalLM, scheme, "eager", preset="modeling")
    ids = rand_ids(1, 12)
    with torch.no_grad():
        a = model(ids).logits[0, -1]
        shuffled = torch.cat([ids[:, :-1].flip(1), ids[:, -1:]], dim=1)
        b = model(shuffled).logits[0, -1]
    assert (a - b).abs().max() > 1e-3


# ---------------------------------------------------------------------------
# 2. Transformer-XL memory
# ---------------------------------------------------------------------------


def test_transformer_xl_mems_shapes():
    mem_len = 6
    model = build("transformer_xl", cls=RelPosForCausalLM, mem_len=mem_len).train()
    ids = rand_ids(2, 4)
    out = model(ids, use_cache=False)
    assert isinstance(out.mems, list) and len(out.mems) == model.config.num_hidden_layers
    for mem in out.mems:
        assert mem.shape == (2, 4, 32) and not mem.requires_grad and mem.grad_fn is None
    out2 = model(rand_ids(2, 5, seed=3), mems=out.mems, use_cache=False)
    for mem in out2.mems:
        assert mem.shape == (2, mem_len, 32) and not mem.requires_grad
    out2.logits.sum().backward()  # the memory is cut from the graph: no error from reused graph
    # models without memory return no mems
    assert build("transformer_xl")(ids).mems is None
    assert build("t5_bias")(ids).mems is None


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("impl", IMPLS)
def test_transformer_xl_segments_match_full_pass(impl, padding):
    segments = (4, 3, 5)
    total = sum(segments)
    model = build("transformer_xl", cls=RelPosModel, impl=impl, mem_len=total)
    ids = rand_ids(2, total, seed=15)
    # the mask of a segment covers its memory too: [batch, mem + len]
    mask = torch.ones(2, total, dtype=torch.long) if padding is None else padding_mask(2, total, "left", pads=(0, 5))
    with torch.no_grad():
        full = model(ids, attention_mask=None if padding is None else mask, use_cache=False).last_hidden_state
        mems, start = None, 0
        for size in segments:
            kwargs = {} if padding is None else {"attention_mask": mask[:, : start + size]}
            out = model(ids[:, start : start + size], mems=mems, use_cache=False, **kwargs)
            assert_close_where(
                out.last_hidden_state, full[:, start : start + size], mask[:, start : start + size],
                what=f"segment {start}:{start + size}",
            )
            mems = out.mems
            start += size
        assert mems[0].shape == (2, total, 32)


@pytest.mark.parametrize("impl", IMPLS)
def test_transformer_xl_memory_window(impl):
    """With mem_len < total, segment i sees exactly the last mem_len positions of each layer's input."""
    model = build("transformer_xl", cls=RelPosModel, impl=impl, mem_len=4)
    ids = rand_ids(1, 9, seed=16)
    with torch.no_grad():
        first = model(ids[:, :5], use_cache=False)
        second = model(ids[:, 5:], mems=first.mems, use_cache=False)
        # the same, computed with an explicit 4-token prefix as memory by a model with a long memory
        long_model = build("transformer_xl", cls=RelPosModel, impl=impl, mem_len=32)
        long_model.load_state_dict(model.state_dict())
        states = long_model(ids[:, :5], use_cache=False, output_hidden_states=True).hidden_states
        mems = [h[:, -4:] for h in states[:-1]]
        expected = long_model(ids[:, 5:], mems=mems, use_cache=False).last_hidden_state
    for mem, h in zip(first.mems, states[:-1]):
        assert_close(mem, h[:, -4:], what="memory = last mem_len layer inputs")
    assert_close(second.last_hidden_state, expected)


def test_transformer_xl_bad_mems():
    model = build("transformer_xl", cls=RelPosForCausalLM, mem_len=6)
    ids = rand_ids(2, 3)
    with torch.no_grad():
        good = model(ids, use_cache=False).mems
    bad_cases = {
        "batch": [m[:1] for m in good],
        "hidden": [torch.zeros(2, 3, 16) for _ in good],
        "length": [torch.zeros(2, 7, 32) for _ in good],
        "layers": good[:1],
        "ragged": [torch.zeros(2, 3, 32), torch.zeros(2, 2, 32)],
        "dims": [torch.zeros(3, 32) for _ in good],
    }
    for name, mems in bad_cases.items():
        with pytest.raises(ValueError, match="mems"), torch.no_grad():
            model(ids, mems=mems, use_cache=False)
    other = build("t5_bias")
    with pytest.raises(ValueError, match="mems"), torch.no_grad():
        other(ids, mems=good, use_cache=False)


def test_transformer_xl_with_memory_generates_like_without_cache():
    model = build("transformer_xl", mem_len=4)
    ids = rand_ids(2, 6, seed=17)
    cached = greedy(model, ids, 8, use_cache=True)
    assert torch.equal(cached, greedy(model, ids, 8, use_cache=False))
    assert torch.equal(cached, manual_greedy(model, ids, 8))


# ---------------------------------------------------------------------------
# per-scheme initialisation and details
# ---------------------------------------------------------------------------



@pytest.mark.parametrize("fused", [False, True])
def test_transformer_xl_projection_cache_follows_optimizer_steps(fused):
    """Inference keeps W_{k,R} R_d per layer; a training step (fused AdamW does not bump parameter
    versions) must not leave stale projections behind."""
    torch.manual_seed(0)
    model = build("transformer_xl")
    ids = rand_ids(2, 8, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    model.eval()
    with torch.no_grad():
        model(ids)  # fills the cache
    model.train()
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        cached = model(ids).logits
    fresh = type(model)(model.config).eval()
    fresh.load_state_dict(model.state_dict())
    fresh.config._attn_implementation = model.config._attn_implementation
    with torch.no_grad():
        torch.testing.assert_close(cached, fresh(ids).logits, rtol=0, atol=1e-6)


def _through_data_copy(weight):
    weight.data.copy_(weight.data.flip(0))


def _through_data_mul(weight):
    weight.data.mul_(1.5)


def _in_place_without_grad(weight):
    with torch.no_grad():
        weight.add_(0.25)


MUTATIONS = {"data.copy_": _through_data_copy, "data.mul_": _through_data_mul, "no_grad add_": _in_place_without_grad}


@pytest.mark.parametrize("how", [*MUTATIONS, "load_state_dict"])
def test_transformer_xl_projection_cache_follows_any_weight_update(how):
    """The kept W_{k,R} R_d are rebuilt after any change of W_{k,R}: an update through .data changes neither
    its storage nor its version (the cache's key before; cached and fresh logits differed by ~1)."""
    model = build("transformer_xl")
    other = build("transformer_xl", seed=1)
    ids = rand_ids(2, 8, seed=3)
    with torch.no_grad():
        model(ids)  # fills each layer's cache
        model(ids[:, :5])  # and reads it (a slice)
    if how == "load_state_dict":
        model.load_state_dict(other.state_dict())
    else:
        for layer in model.model.layers:
            MUTATIONS[how](layer.self_attn.relative.r_net.weight)
    fresh = build("transformer_xl", seed=2)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits, rtol=0, atol=1e-6)


def _record_graphs():
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return graphs, record


@pytest.mark.parametrize("clamp_len", [-1, 5])
def test_transformer_xl_compiled_step_reads_the_projections_its_eager_prefill_kept(clamp_len):
    """A compiled decoding step into a StaticCache gathers the W_{k,R} R_d that the eager prefill kept over every
    distance the cache can reach (it projected all slots' in every step before: 0.42-0.59x eager's tokens/s) and
    gives eager's logits; the gathered rows are the kept ones (a table changed in place changes its logits)."""
    import copy

    import torch._dynamo
    from transformers import StaticCache

    torch._dynamo.reset()
    model = build("transformer_xl", impl="sdpa", clamp_len=clamp_len).eval()
    ids, slots = rand_ids(2, 6, seed=21), 12
    graphs, record = _record_graphs()
    step = torch.compile(lambda x, c: model(x, past_key_values=c, use_cache=True).logits, fullgraph=True,
                         backend=record)
    with torch.no_grad():
        caches = [StaticCache(config=model.config, max_cache_len=slots) for _ in range(2)]
        token = [model(ids, past_key_values=c, use_cache=True).logits for c in caches][0][:, -1:].argmax(-1)
        for t in range(4):
            expected = model(token, past_key_values=caches[0], use_cache=True).logits
            assert_close(step(token, caches[1]), expected, what=f"compiled step {t}")
            token = expected[:, -1:].argmax(-1)
        layers = [layer.self_attn.relative for layer in model.model.layers]
        for relative in layers:
            kept = relative._projected
            assert kept.top >= (slots - 1 if clamp_len < 0 else clamp_len), "the prefill keeps what the steps reach"
            assert kept.floor >= 0, "a causal row's negative distances are masked slots': not projected"
        other = copy.deepcopy(model)  # its own copy of the kept projections
        for relative in layers:
            relative._projected.table.mul_(0.5)
        assert not torch.allclose(step(token, caches[1]), other(token, past_key_values=caches[0], use_cache=True).logits)
    assert len(graphs) == 1


def test_transformer_xl_compiled_forward_checks_the_kept_projections_against_the_weights():
    """With the whole forward compiled (Transformers' recipe for a static cache, so no eager forward checks the kept
    projections), a change of W_{k,R} in place after an eager forward makes the compiled prefill and steps project
    again, in the same graphs: the check is in the graph (they read stale projections before: tokens differed)."""
    import torch._dynamo
    from transformers import StaticCache

    torch._dynamo.reset()
    model = build("transformer_xl", impl="sdpa").eval()
    ids, slots = rand_ids(2, 6, seed=22), 12
    graphs, record = _record_graphs()
    forward = torch.compile(lambda x, c: model(x, past_key_values=c, use_cache=True).logits, fullgraph=True,
                            backend=record)

    def decode(run):
        cache, out = StaticCache(config=model.config, max_cache_len=slots), []
        token = ids
        for _ in range(4):
            out.append(run(token, cache))
            token = out[-1][:, -1:].argmax(-1)
        return out

    with torch.no_grad():
        decode(lambda x, c: model(x, past_key_values=c, use_cache=True).logits)  # eager: keeps the projections
        decode(forward)
        compiled = len(graphs)
        for layer in model.model.layers:
            _through_data_mul(layer.self_attn.relative.r_net.weight)
        got = decode(forward)
        fresh = build("transformer_xl", impl="sdpa", seed=3).eval()
        fresh.load_state_dict(model.state_dict())
        expected = decode(lambda x, c: fresh(x, past_key_values=c, use_cache=True).logits)
    for t, (a, b) in enumerate(zip(got, expected)):
        assert_close(a, b, what=f"compiled forward {t}")
    assert len(graphs) == compiled


def test_transformer_xl_with_kept_projections_pickles_and_copies():
    """The model pickles with its kept projections (a lambda hook did not), and a copy's load_state_dict drops
    the copy's kept projections, not the original's."""
    import copy
    import pickle

    model = build("transformer_xl").eval()
    ids = rand_ids(2, 8, seed=3)
    with torch.no_grad():
        expected = model(ids).logits
        pickle.loads(pickle.dumps(model))
        twin = copy.deepcopy(model)
        twin.load_state_dict(build("transformer_xl", seed=1).state_dict())
        assert all(layer.self_attn.relative._projected is not None for layer in model.model.layers)
        assert_close(model(ids).logits, expected, what="the original after its copy loaded other weights")
        assert_close(twin(ids).logits, build("transformer_xl", seed=1).eval()(ids).logits, what="the copy")


def test_transformer_xl_projection_cache_leaves_the_weights_storage_resizable():
    """The kept projections' key check reads W_{k,R} on the host without ``Tensor.numpy()``, which marks the
    weight's storage non-resizable for good: FSDP2 frees each layer's gathered weights by resizing their storage
    to 0, so inference of a sharded Transformer-XL on CPU raised "Trying to resize storage that is not
    resizable" (tests/test_fsdp.py checks the sharded run itself)."""
    model = build("transformer_xl")
    ids = rand_ids(2, 8, seed=3)
    with torch.no_grad():
        expected = model(ids).logits  # fills each layer's cache
        got = model(ids).logits  # and checks its key against the weights
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for layer in model.model.layers:
        weight = layer.self_attn.relative.r_net.weight
        storage = weight.untyped_storage()
        size = storage.nbytes()
        storage.resize_(0)  # what FSDP2 does to a gathered parameter after the layer's forward
        storage.resize_(size)


def test_log_decay_scale_beyond_float32_gives_finite_outputs():
    """A log_decay_scale past float32's range (the bias' compute dtype) attends each query to itself alone, as
    any scale large enough does, in every implementation and dtype: NaN logits with SDPA before."""
    ids = rand_ids(2, 6, seed=5)
    for impl in ("eager", "sdpa"):
        for dtype in (torch.float32, torch.bfloat16):
            huge = build("log_decay", log_decay_scale=1e39, impl=impl).to(dtype)
            large = build("log_decay", log_decay_scale=1e38, impl=impl).to(dtype)  # same weights (same seed)
            with torch.no_grad():
                got, expected = huge(ids).logits, large(ids).logits
            assert torch.isfinite(got).all(), (impl, dtype)
            assert torch.equal(got, expected), (impl, dtype)


@pytest.mark.parametrize("position_encoding,tensor,expected", [
    # upstream T5 (factor 1): the bucket table at d_model**-0.5, not initializer_range
    ("t5_bias", lambda m: m.model.position.relative_attention_bias.weight, 64**-0.5),
    # Vaswani et al. (tensor2tensor): token embeddings at d_model**-0.5, multiplied by sqrt(d_model) in embed()
    ("sinusoidal", lambda m: m.model.embed_tokens.weight, 64**-0.5),
    # GPT-2: the position table at half the token embeddings' std
    ("learned", lambda m: m.model.position.position_embeddings.weight, 0.01),
    ("rope", lambda m: m.model.embed_tokens.weight, 0.02),  # no recipe of its own: initializer_range
], ids=["t5_bias", "sinusoidal", "learned", "rope"])
def test_each_scheme_starts_from_its_papers_initialisation(position_encoding, tensor, expected):
    """Each baseline's recipe (issue 14's 1x gap): a table initialised far from its paper's scale trains
    slower than the others within the comparison's budget."""
    model = build(position_encoding, hidden_size=64, relative_attention_num_buckets=256,
                  relative_attention_max_distance=512, max_position_embeddings=256, initializer_range=0.02)
    std = tensor(model).std().item()
    assert abs(std - expected) < 0.15 * expected, (std, expected)


def test_fire_normalises_by_the_querys_position_in_its_sequence():
    """FIRE's normaliser psi(max(L, p_i)) depends on the query's position p_i, not its index among the keys:
    with a small threshold L, cached decoding through a sliding window, a left-padded row and a packed
    document each give what the plain sequence gives (a bug fixed here: p_i was the index among the kept keys)."""
    model = build("fire", fire_threshold=2.0, sliding_window=4, impl="sdpa")
    with torch.no_grad():
        for linear in (model.model.position.mlp[0], model.model.position.mlp[2]):
            linear.weight.mul_(4.0)  # a bias large enough that a wrong normaliser shows
    ids = rand_ids(1, 12, seed=41)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        for t in range(12):
            step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
            assert_close(step[:, 0], full[:, t], atol=1e-4, what=f"sliding-window cached step {t}")
    plain = build("fire", fire_threshold=2.0, impl="sdpa")
    plain.load_state_dict(model.state_dict())
    ids = rand_ids(1, 9, seed=42)
    with torch.no_grad():
        alone = plain(ids, use_cache=False).logits
        padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
        mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # as generate passes them for left padding
        got = plain(padded, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, 3:]
        assert_close(got, alone, atol=1e-4, what="left-padded row vs alone")
        other = rand_ids(1, 5, seed=43)
        packed = torch.cat([other, ids], dim=1)
        packed_positions = torch.cat([torch.arange(5), torch.arange(9)])[None]
        got = plain(packed, position_ids=packed_positions, use_cache=False).logits[:, 5:]
        assert_close(got, alone, atol=1e-4, what="packed document vs alone")


def test_fire_mlp_starts_alive_and_kerple_recovers_below_its_floor():
    """FIRE's MLP keeps PyTorch's default Linear initialisation (non-zero first-layer biases), so that units with
    a negative input weight are not dead from the start (the MLP's input is >= 0); KERPLE's r1, r2 are clamped in
    value but keep a gradient below the floor, so a head initialised there can recover."""
    fire = build("fire", initializer_range=0.02).model.position
    first = fire.mlp[0]
    assert first.bias.abs().min() > 0 and (first.bias > 0).any() and (first.bias < 0).any()
    assert first.weight.abs().max() <= 1.0 and first.weight.std() > 0.3  # U(-1, 1) for fan_in 1, not N(0, 0.02)
    x = torch.linspace(0, 1, 50)[:, None]
    alive = (first(x) > 0).any(dim=0)
    assert alive.float().mean() > 0.5, f"{int((~alive).sum())} of {alive.numel()} FIRE units dead on [0, 1]"

    model = build("kerple_log")
    kerple = model.model.position
    with torch.no_grad():
        kerple.r1.fill_(0.005)
        kerple.r2.fill_(0.002)
    model(rand_ids(1, 6), labels=rand_ids(1, 6)).loss.backward()
    assert (kerple.r1.grad != 0).all() and (kerple.r2.grad != 0).all()
