"""Generation and caches: a KV cache equals the full forward, a decoding step computes positions for its new
rows only, left padding and beam search in ``generate``, ``StaticCache``.

Every expected value is computed by a second, simpler path (a full forward without cache, a batch of one, a manual
greedy loop); the tiny models are the "modeling" preset of tiny.py.
"""

from __future__ import annotations

import pytest
import torch
from tiny import (
    ENCODINGS,
    IMPLS,
    STATIC_OK,
    assert_close,
    assert_close_where,
    build,
    greedy,
    manual_greedy,
    padding_mask,
    rand_ids,
    use_impl,
    VOCAB,
)
from transformers import StaticCache

from hf_relpos import RelPosModel
from hf_relpos import position_schemes_relpos


# ---------------------------------------------------------------------------
# 1. KV cache == full forward; generate with and without cache
# ---------------------------------------------------------------------------

CHUNKS = [5, 3, 1, 1, 4, 1]  # prefill 5, then a chunk of 3, two single steps, a chunk of 4, one step


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_cached_chunks_match_full_forward(position_encoding, impl, padding):
    model = build(position_encoding, impl=impl)
    B, L = 3, sum(CHUNKS)
    ids = rand_ids(B, L, seed=2)
    mask = None if padding is None else padding_mask(B, L, "left", pads=(0, 2, 4))
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        cache, start = None, 0
        for size in CHUNKS:
            end = start + size
            kwargs = {} if mask is None else {"attention_mask": mask[:, :end]}
            out = model(ids[:, start:end], past_key_values=cache, use_cache=True, **kwargs)
            cache = out.past_key_values
            assert cache is not None and cache.get_seq_length() == end
            keep = torch.ones(B, size) if mask is None else mask[:, start:end]
            assert_close_where(out.logits, full[:, start:end], keep, what=f"tokens {start}:{end}")
            start = end


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_generate_with_and_without_cache(position_encoding, impl):
    model = build(position_encoding, impl=impl)
    ids = rand_ids(2, 6, seed=3)
    with_cache = greedy(model, ids, 10, use_cache=True)
    without_cache = greedy(model, ids, 10, use_cache=False)
    assert with_cache.shape == (2, 16)
    assert torch.equal(with_cache, without_cache), f"{with_cache}\n{without_cache}"
    assert torch.equal(with_cache, manual_greedy(model, ids, 10))


# configurations off the default path of each scheme
VARIANTS = {
    "txl_clamp_len": ("transformer_xl", {"clamp_len": 3}),
    "shaw_keys_only": ("shaw", {"shaw_value_embeddings": False}),
    "shaw_no_clipping": ("shaw", {"max_relative_position": 0}),
    "alibi_6_heads": ("alibi", {"hidden_size": 48, "num_attention_heads": 6}),
    "t5_long_distance": ("t5_bias", {"relative_attention_num_buckets": 6, "relative_attention_max_distance": 5}),
    "log_decay_scale": ("log_decay", {"log_decay_scale": 2.5}),
    "rope_theta": ("rope", {"rope_theta": 50.0}),
    "attention_bias": ("t5_bias", {"attention_bias": True}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_cache_and_kernels(variant):
    position_encoding, overrides = VARIANTS[variant]
    model = build(position_encoding, **overrides)
    B, L = 2, sum(CHUNKS)
    ids = rand_ids(B, L, seed=30)
    mask = padding_mask(B, L, "left", pads=(0, 3))
    with torch.no_grad():
        full = use_impl(model, "eager")(ids, attention_mask=mask, use_cache=False).logits
        full_sdpa = use_impl(model, "sdpa")(ids, attention_mask=mask, use_cache=False).logits
        assert_close_where(full_sdpa, full, mask, what="sdpa vs eager")
        cache, start = None, 0
        for size in CHUNKS:
            out = model(ids[:, start : start + size], attention_mask=mask[:, : start + size], past_key_values=cache)
            cache = out.past_key_values
            assert_close_where(out.logits, full[:, start : start + size], mask[:, start : start + size])
            start += size
    bidirectional = build(position_encoding, cls=RelPosModel, is_decoder=False, **overrides)
    with torch.no_grad():
        eager = use_impl(bidirectional, "eager")(ids, attention_mask=mask).last_hidden_state
        sdpa = use_impl(bidirectional, "sdpa")(ids, attention_mask=mask).last_hidden_state
    assert_close_where(sdpa, eager, mask, what="bidirectional sdpa vs eager")


# ---------------------------------------------------------------------------
# 2. a decoding step computes positions for the new rows only, once per forward
# ---------------------------------------------------------------------------

BIAS_FUNCTIONS = {"t5_bias": "t5_position_bias", "log_decay": "log_decay_bias", "alibi": "alibi_bias"}


def _recorder(monkeypatch, name):
    calls = []
    original = getattr(position_schemes_relpos, name)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append({"args": args, "kwargs": kwargs, "shape": tuple(out.shape)})
        return out

    monkeypatch.setattr(position_schemes_relpos, name, wrapper)
    return calls


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", sorted(BIAS_FUNCTIONS))
def test_bias_computed_once_for_new_rows(monkeypatch, position_encoding, impl):
    model = build(position_encoding, impl=impl)
    assert model.config.num_hidden_layers > 1
    name = BIAS_FUNCTIONS[position_encoding]
    calls = _recorder(monkeypatch, name)
    # A prefill without padding (CPU, sdpa) makes the T5 bias as the per-distance table of the band
    # decomposition, and causal ALiBi as a bias per key.
    other = {"t5_bias": "t5_bias_by_distance", "alibi": "alibi_key_bias"}.get(position_encoding)
    per_distance = _recorder(monkeypatch, other) if other else []
    P = 7
    ids = rand_ids(2, P + 4, seed=4)
    with torch.no_grad():
        out = model(ids[:, :P], use_cache=True)
        made = len(calls) + len(per_distance)
        assert made == 1, f"the bias made {made} times for one forward (once per layer?)"
        assert len(per_distance) == (impl == "sdpa" and other is not None)
        cache = out.past_key_values
        for new in (1, 3):
            calls.clear()
            before = cache.get_seq_length()
            model(ids[:, before : before + new], past_key_values=cache, use_cache=True)
            assert len(calls) == 1, f"{name} called {len(calls)} times for one cached step"
            call = calls[0]
            q_len, k_len = call["args"][-2:] if name != "log_decay_bias" else call["args"][:2]
            assert q_len == new, f"{name} computed {q_len} query rows for {new} new tokens"
            assert k_len == before + new
            assert call["kwargs"].get("past_length") == before
            assert call["shape"][-2:] == (new, before + new)


@pytest.mark.parametrize("position_encoding", ["shaw", "transformer_xl"])
def test_per_layer_schemes_see_new_rows_only(monkeypatch, position_encoding):
    """Shaw and Transformer-XL attend per layer (per-layer parameters) but only for the new query rows."""
    model = build(position_encoding)
    fn = "shaw_attention" if position_encoding == "shaw" else "transformer_xl_attention"
    attn_calls = _recorder(monkeypatch, fn)
    emb_calls = _recorder(monkeypatch, "sinusoidal_embedding")
    P = 6
    ids = rand_ids(2, P + 2, seed=5)
    with torch.no_grad():
        cache = model(ids[:, :P], use_cache=True).past_key_values
        attn_calls.clear()
        emb_calls.clear()
        model(ids[:, P : P + 2], past_key_values=cache, use_cache=True)
    assert len(attn_calls) == model.config.num_hidden_layers
    for call in attn_calls:
        q, k = call["args"][0], call["args"][1]
        assert q.shape[2] == 2 and k.shape[2] == P + 2
        if position_encoding == "shaw":
            assert call["kwargs"]["past_length"] == P
    if position_encoding == "transformer_xl":
        # In inference each layer keeps W_{k,R} R_d for a range of distances that doubles when exceeded:
        # 16 more decoding steps build sinusoids at most once more per layer, never once per token.
        emb_calls.clear()
        with torch.no_grad():
            token = ids[:, -1:]
            for _ in range(16):
                out = model(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
        assert len(emb_calls) <= model.config.num_hidden_layers
        assert all(call["shape"][0] <= 2 * (P + 2 + 16) for call in emb_calls)


# ---------------------------------------------------------------------------
# 3. left padding in generate
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_left_padded_batch_generates_like_single_prompts(position_encoding):
    # relative schemes ignore absolute positions; rope and the absolute baselines get generate()'s
    # position_ids (cumsum of the attention mask), so they must match as well
    model = build(position_encoding, impl="sdpa")
    prompts = [rand_ids(1, n, seed=10 + n)[0] for n in (7, 3, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = p
        mask[b, width - len(p) :] = 1
    new = 6
    batch_out = greedy(model, ids, new, attention_mask=mask, use_cache=True, pad_token_id=0)
    for b, p in enumerate(prompts):
        alone = greedy(model, p[None], new, use_cache=True, pad_token_id=0)
        assert torch.equal(batch_out[b, width:], alone[0, len(p) :]), (
            f"row {b}: batch {batch_out[b, width:].tolist()} vs alone {alone[0, len(p):].tolist()}"
        )


# ---------------------------------------------------------------------------
# 4. beam search
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_beam_search(position_encoding):
    model = build(position_encoding)
    ids = rand_ids(2, 5, seed=6)
    with torch.no_grad():
        beams = model.generate(ids, max_new_tokens=5, do_sample=False, num_beams=3, use_cache=True)
        beams_nocache = model.generate(ids, max_new_tokens=5, do_sample=False, num_beams=3, use_cache=False)
        three = model.generate(
            ids, max_new_tokens=5, do_sample=False, num_beams=3, num_return_sequences=3, use_cache=True
        )
        one_beam = model.generate(ids, max_new_tokens=5, do_sample=False, num_beams=1)
    assert beams.shape == (2, 10)
    assert three.shape == (6, 10)
    assert torch.equal(beams[:, :5], ids)
    # the cache is reordered between beams: it must not change the result
    assert torch.equal(beams, beams_nocache)
    assert torch.equal(one_beam, manual_greedy(model, ids, 5))


# ---------------------------------------------------------------------------
# 5. StaticCache
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", STATIC_OK)
def test_static_cache_generate_matches_dynamic(position_encoding, impl):
    model = build(position_encoding, impl=impl)
    ids = rand_ids(2, 6, seed=7)
    dynamic = greedy(model, ids, 8, use_cache=True)
    static = greedy(model, ids, 8, use_cache=True, cache_implementation="static")
    assert torch.equal(static, dynamic), f"static {static[:, 6:].tolist()} vs dynamic {dynamic[:, 6:].tolist()}"
    # a left-padded batch as well (generate builds the mask from the attention mask and the static cache)
    mask = padding_mask(2, 6, "left", pads=(0, 2))
    ids = ids.masked_fill(mask == 0, 0)
    dynamic = greedy(model, ids, 8, attention_mask=mask, use_cache=True)
    static = greedy(model, ids, 8, attention_mask=mask, use_cache=True, cache_implementation="static")
    assert torch.equal(static, dynamic), f"padded: static {static[:, 6:].tolist()} vs dynamic {dynamic[:, 6:].tolist()}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", STATIC_OK)
def test_static_cache_chunks_match_full_forward(position_encoding, impl):
    model = build(position_encoding, impl=impl)
    B, L = 2, sum(CHUNKS)
    ids = rand_ids(B, L, seed=8)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = StaticCache(config=model.config, max_cache_len=32)
        start = 0
        for size in CHUNKS:
            out = model(ids[:, start : start + size], past_key_values=cache, use_cache=True)
            assert_close(out.logits, full[:, start : start + size], what=f"static cache tokens {start}:{start + size}")
            start += size


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", STATIC_OK)
def test_bidirectional_static_cache_hides_unfilled_slots(position_encoding, impl):
    """A bidirectional model filling part of a StaticCache sees only the filled slots (Shaw used to attend
    the empty ones: causality hides them only in a decoder)."""
    model = build(position_encoding, cls=RelPosModel, impl=impl, is_decoder=False)
    ids = rand_ids(2, 11, seed=9)
    with torch.no_grad():
        full = model(ids, use_cache=False).last_hidden_state
        cached = model(ids, past_key_values=StaticCache(config=model.config, max_cache_len=32), use_cache=True)
    assert_close(cached.last_hidden_state, full, what="bidirectional forward into a StaticCache")


def test_transformer_xl_static_cache_with_memory_and_clamp():
    """Transformer-XL with a StaticCache also with clamped distances (clamp_len < the cache) and a memory
    window: chunked forwards into it give the full forward's logits."""
    model = build("transformer_xl", clamp_len=3, mem_len=8)
    ids = rand_ids(2, 10, seed=18)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = StaticCache(config=model.config, max_cache_len=16)
        start = 0
        for size in (4, 1, 3, 2):
            out = model(ids[:, start : start + size], past_key_values=cache, use_cache=True)
            assert_close(out.logits, full[:, start : start + size], what=f"tokens {start}:{start + size}")
            start += size


@pytest.mark.parametrize("seq2seq", [False, True], ids=["causal", "seq2seq"])
def test_stop_strings_with_a_tokenizer(seq2seq):
    """``generate(stop_strings=..., tokenizer=...)``: generate leaves the tokenizer in the model keyword arguments,
    which the forward refused (TypeError). Stops where the stop string is first produced, as its criterion says."""
    from hf_relpos import RelPosForConditionalGeneration
    from hf_relpos.data import train_tokenizer
    from tiny import make_model

    text = "the cat sat on the mat and the dog ran to the cat " * 20
    tokenizer = train_tokenizer([text], vocab_size=VOCAB)
    if seq2seq:
        model = make_model(RelPosForConditionalGeneration, "t5_bias", "eager", 0, preset="seq2seq")
    else:
        model = build("alibi")
    prompt = rand_ids(1, 5, seed=3)
    free = model.generate(prompt, max_new_tokens=8, do_sample=False)
    answer = free[0] if seq2seq else free[0, prompt.shape[1]:]
    # A stop string made of the third generated token's text: generation must end right after that token.
    stop = tokenizer.decode(answer[2:3])
    assert stop.strip(), f"token {answer[2].item()} decodes to blank text; pick another seed"
    first = next(i for i in range(len(answer)) if stop in tokenizer.decode(answer[: i + 1]))
    stopped = model.generate(prompt, max_new_tokens=8, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    got = stopped[0] if seq2seq else stopped[0, prompt.shape[1]:]
    assert got.tolist() == answer[: first + 1].tolist()


@pytest.mark.parametrize("scheme", ["alibi", "rope"])
def test_generate_from_inputs_embeds(scheme):
    """``generate(inputs_embeds=...)`` gives the tokens ``generate(input_ids)`` gives (generate reads
    ``inputs_embeds`` among prepare_inputs_for_generation's parameters; a wrapper without them refused it)."""
    model = build(scheme)
    ids = rand_ids(2, 6, seed=5)
    from_ids = model.generate(ids, max_new_tokens=5, do_sample=False)[:, ids.shape[1]:]
    from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), max_new_tokens=5, do_sample=False)
    assert from_embeds.tolist() == from_ids.tolist()


@pytest.mark.parametrize("scheme", ["rope", "t5_bias", "transformer_xl"])
def test_generate_compiles_a_decoding_step_on_its_own_for_every_scheme(scheme, monkeypatch):
    """Transformers compiles the decoding step by itself with a static cache on a GPU (here, its criteria met as on
    one), Transformer-XL's too: its compiled step reads the W_{k,R} R_d its eager prefill kept (1.8x eager's
    tokens/s); it was kept eager while a compiled step projected them all again (0.42-0.59x)."""
    from transformers import GenerationConfig, GenerationMixin

    monkeypatch.setattr(GenerationMixin, "_valid_auto_compile_criteria", lambda self, kwargs, config: True)
    model = build(scheme, impl="sdpa")
    cache = StaticCache(config=model.config, max_cache_len=16)
    kwargs = {"cache": cache, "past_key_values": cache}  # the cache's keyword: 5.24 renamed it
    assert model._valid_auto_compile_criteria(kwargs, GenerationConfig()) is True
