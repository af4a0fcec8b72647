"""Tests for the hf_relpos models (``RelPosModel``, ``RelPosForCausalLM``, ``RelPosForSequenceClassification``)
against the public contract in ``/work/shared/api-contract.md``: eager == sdpa, save and load, bad input, fully
padded rows, sequence classification, T5's shared bias table, activation checkpointing, torch.compile, other inputs.

Every model here is tiny and random (the "modeling" preset of tiny.py: hidden 32, 4 heads, 2 layers, vocab 61)
with a large ``initializer_range`` so that position terms visibly change the outputs: a test that compares two
ways of computing the same thing fails when either side ignores positions, the cache or the mask.
Nothing is compared against stored numbers; every expected value is computed by a second, simpler
path (a full forward without cache, a batch of one, a manual greedy loop, ...).
Elsewhere: RelPosConfig in test_configuration_relpos.py, caches and generate in test_generation.py, each scheme's
math in test_position_schemes.py, fuzzing in test_modeling_fuzz.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from tiny import (
    ENCODINGS,
    IMPLS,
    STATIC_OK,
    VOCAB,
    assert_cache_unchanged,
    assert_close,
    assert_close_where,
    build,
    cache_snapshot,
    greedy,
    padding_mask,
    rand_ids,
    tiny_config,
    use_impl,
)
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from hf_relpos import RelPosForCausalLM, RelPosForSequenceClassification, RelPosModel

RELATIVE = ("t5_bias", "shaw", "transformer_xl", "log_decay", "alibi")
ABSOLUTE = ("sinusoidal", "learned")


# ---------------------------------------------------------------------------
# 1. eager == sdpa
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_eager_matches_sdpa(position_encoding, causal, padding):
    model = build(position_encoding, cls=RelPosModel, is_decoder=causal)
    B, L = 3, 13
    ids = rand_ids(B, L)
    mask = None if padding is None else padding_mask(B, L, padding)
    with torch.no_grad():
        eager = use_impl(model, "eager")(ids, attention_mask=mask, use_cache=False).last_hidden_state
        sdpa = use_impl(model, "sdpa")(ids, attention_mask=mask, use_cache=False).last_hidden_state
    keep = torch.ones(B, L) if mask is None else mask
    assert torch.isfinite(eager[keep.bool()]).all() and torch.isfinite(sdpa[keep.bool()]).all()
    assert_close_where(sdpa, eager, keep, what=f"{position_encoding} sdpa vs eager")


# Transformers' own tolerances for eager vs sdpa on CPU (test_modeling_common's eager/sdpa inference test).
HALF_TOLERANCES = {torch.bfloat16: (1e-2, 1e-2), torch.float16: (5e-3, 5e-3)}


@pytest.mark.parametrize("dtype", list(HALF_TOLERANCES), ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_eager_matches_sdpa_half_precision(position_encoding, causal, dtype):
    # initializer_range 0.02 (Transformers' default) keeps activations in the range half precision is made for
    model = build(position_encoding, cls=RelPosModel, is_decoder=causal, initializer_range=0.02).to(dtype)
    B, L = 3, 13
    ids = rand_ids(B, L)
    mask = padding_mask(B, L, "left")
    with torch.no_grad():
        eager = use_impl(model, "eager")(ids, attention_mask=mask, use_cache=False).last_hidden_state
        sdpa = use_impl(model, "sdpa")(ids, attention_mask=mask, use_cache=False).last_hidden_state
    atol, rtol = HALF_TOLERANCES[dtype]
    if dtype == torch.bfloat16:  # upstream's rule: bf16 keeps ~3 significant digits of the largest output
        atol = max(atol, 3e-2 * float(torch.maximum(eager.abs().amax(), sdpa.abs().amax())))
    for row in range(B):  # upstream lets 20% of the rows miss; here every row must match
        keep = mask[row].bool()
        assert torch.allclose(sdpa[row, keep].float(), eager[row, keep].float(), atol=atol, rtol=rtol), (
            f"row {row}: max abs diff {(sdpa[row, keep] - eager[row, keep]).abs().max().item():.3g}, atol {atol:.3g}"
        )


# ---------------------------------------------------------------------------
# 2. save and load
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_save_and_load_same_logits(tmp_path, position_encoding):
    model = build(position_encoding)
    ids = rand_ids(2, 7)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is RelPosForCausalLM
    with torch.no_grad():
        assert_close(loaded(ids).logits, model(ids).logits, atol=0.0, what="reloaded model")


# ---------------------------------------------------------------------------
# 3. bad input: clear ValueError, cache untouched
# ---------------------------------------------------------------------------


def _prefilled(model, batch=2, length=5, seed=9):
    ids = rand_ids(batch, length, seed=seed)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return cache, cache.get_seq_length(), cache_snapshot(cache)


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_bad_token_ids(position_encoding):
    model = build(position_encoding)
    cache, length, snap = _prefilled(model)
    for bad in (VOCAB, VOCAB + 10, -1):
        ids = torch.tensor([[3, bad], [4, 5]])
        with pytest.raises(ValueError) as info, torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        message = str(info.value)
        assert "input_ids" in message and str(bad) in message and str(VOCAB) in message, message
        assert_cache_unchanged(cache, length, snap)
    with pytest.raises(ValueError, match=str(VOCAB)), torch.no_grad():
        model(torch.tensor([[VOCAB]]))  # no cache either


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_bad_attention_mask_shape(position_encoding):
    model = build(position_encoding)
    cache, length, snap = _prefilled(model)
    ids = rand_ids(2, 2, seed=11)
    for bad in (torch.ones(2, 2), torch.ones(2, length + 3), torch.ones(3, length + 2), torch.ones(2, 1, length + 2)):
        with pytest.raises(ValueError) as info, torch.no_grad():
            model(ids, attention_mask=bad, past_key_values=cache, use_cache=True)
        message = str(info.value)
        assert "attention_mask" in message and str(tuple(bad.shape)) in message and str(length + 2) in message, message
        assert_cache_unchanged(cache, length, snap)
    with pytest.raises(ValueError, match="attention_mask"), torch.no_grad():
        model(rand_ids(2, 4), attention_mask=torch.ones(2, 5))


@pytest.mark.parametrize("position_encoding", ABSOLUTE)
def test_absolute_positions_overflow(position_encoding):
    model = build(position_encoding, max_position_embeddings=16)
    with pytest.raises(ValueError) as info, torch.no_grad():
        model(rand_ids(1, 17))
    assert "max_position_embeddings" in str(info.value) and "16" in str(info.value)
    with torch.no_grad():
        model(rand_ids(1, 16))  # exactly the limit works
    cache, length, snap = _prefilled(model, batch=1, length=12)
    with pytest.raises(ValueError) as info, torch.no_grad():
        model(rand_ids(1, 5), past_key_values=cache, use_cache=True)  # 12 + 5 > 16
    assert "max_position_embeddings" in str(info.value) and "16" in str(info.value)
    assert_cache_unchanged(cache, length, snap)
    with torch.no_grad():
        out = model(rand_ids(1, 4), past_key_values=cache, use_cache=True)  # 12 + 4 == 16 works
    assert out.past_key_values.get_seq_length() == 16


def test_token_ids_of_another_dtype_name_input_ids():
    """Float or bool input_ids are a ValueError naming input_ids and the dtypes allowed (nn.Embedding's torch
    error before); a cache is left as it was."""
    model = build("t5_bias")
    cache, length, snap = _prefilled(model)
    for bad in (rand_ids(2, 2).float(), rand_ids(2, 2).bool(), rand_ids(2, 2).to(torch.int16)):
        with pytest.raises(ValueError, match=rf"input_ids must be integer token ids .*{bad.dtype}"), torch.no_grad():
            model(bad, past_key_values=cache, use_cache=True)
        assert_cache_unchanged(cache, length, snap)
    with torch.no_grad():  # int32 ids are nn.Embedding's other dtype: the same logits as int64
        ids = rand_ids(2, 4)
        assert_close(model(ids.int(), use_cache=False).logits, model(ids, use_cache=False).logits)


def test_position_ids_of_another_batch_name_position_ids():
    """position_ids of another batch than the input's (1 broadcasts, as in Transformers) are a ValueError
    naming position_ids (a torch expand error before)."""
    model = build("rope")
    ids = rand_ids(2, 4)
    for bad in (torch.arange(4).expand(3, -1), torch.arange(4).expand(4, -1)):
        with pytest.raises(ValueError, match=r"position_ids must be \[batch=2 \(or 1\), seq_len=4\]"), torch.no_grad():
            model(ids, position_ids=bad)
    with torch.no_grad():
        assert_close(model(ids, position_ids=torch.arange(4)[None]).logits, model(ids).logits)


@pytest.mark.parametrize("position_encoding", ABSOLUTE)
def test_negative_position_is_named_as_such(position_encoding):
    """A negative position is reported as negative, not as past max_position_embeddings."""
    model = build(position_encoding, max_position_embeddings=16)
    with pytest.raises(ValueError) as info, torch.no_grad():
        model(rand_ids(1, 3), position_ids=torch.tensor([[-1, 0, 1]]))
    message = str(info.value)
    assert "negative position -1" in message and "past max_position_embeddings" not in message, message


@pytest.mark.parametrize("position_encoding", ["t5_bias", "transformer_xl", "learned"])
def test_static_cache_overflow_names_the_cache(position_encoding):
    """More tokens than a StaticCache's max_cache_len hold are a ValueError naming the cache, its size and the
    size needed (an index_copy_ IndexError before); the cache is left as it was, and exactly full works."""
    model = build(position_encoding)
    cache = StaticCache(config=model.config, max_cache_len=6)
    with torch.no_grad():
        model(rand_ids(1, 4), past_key_values=cache, use_cache=True)
        snap = cache_snapshot(cache)
        with pytest.raises(ValueError, match=r"StaticCache of max_cache_len=6 holding 4 tokens.*max_cache_len >= 7"):
            model(rand_ids(1, 3), past_key_values=cache, use_cache=True)
        assert_cache_unchanged(cache, 4, snap)
        model(rand_ids(1, 2), past_key_values=cache, use_cache=True)
    assert int(cache.get_seq_length()) == 6


@pytest.mark.parametrize(
    "other",
    [{"num_attention_heads": 2}, {"hidden_size": 48, "intermediate_size": 96}, {"num_hidden_layers": 3},
     {"num_hidden_layers": 1}],
    ids=["heads", "hidden", "more_layers", "fewer_layers"],
)
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_cache_from_other_configuration(position_encoding, other):
    model = build(position_encoding)
    other_model = build(position_encoding, **other)
    cache, length, snap = _prefilled(other_model)
    with pytest.raises(ValueError) as info, torch.no_grad():
        model(rand_ids(2, 1), past_key_values=cache, use_cache=True)
    assert "past_key_values" in str(info.value), str(info.value)
    assert_cache_unchanged(cache, length, snap)


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_user_created_dynamic_cache(position_encoding):
    model = build(position_encoding)
    ids = rand_ids(2, 8, seed=18)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        for cache in (DynamicCache(), DynamicCache(config=model.config)):
            first = model(ids[:, :5], past_key_values=cache, use_cache=True)
            assert first.past_key_values is cache and cache.get_seq_length() == 5
            second = model(ids[:, 5:], past_key_values=cache, use_cache=True)
            assert_close(second.logits, full[:, 5:])


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_cache_with_other_batch_size(position_encoding):
    model = build(position_encoding)
    cache, length, snap = _prefilled(model, batch=2)
    with pytest.raises(ValueError, match="past_key_values"), torch.no_grad():
        model(rand_ids(3, 1), past_key_values=cache, use_cache=True)
    assert_cache_unchanged(cache, length, snap)


def test_unsupported_attn_implementation(tmp_path):
    model = build("t5_bias")
    cache, length, snap = _prefilled(model)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError) as info, torch.no_grad():
        model(rand_ids(2, 1), past_key_values=cache, use_cache=True)
    assert "flash_attention_2" in str(info.value) and "sdpa" in str(info.value) and "eager" in str(info.value)
    assert_cache_unchanged(cache, length, snap)

    model.config._attn_implementation = "eager"
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="(?i)flash"):
        RelPosForCausalLM.from_pretrained(tmp_path, attn_implementation="flash_attention_2")
    # FlexAttention serves T5's bias (tests/test_flex_attention.py), not Shaw's relative values
    assert AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="flex_attention").config._attn_implementation == "flex_attention"
    with pytest.raises(ValueError, match="(?i)flex"):
        AutoModelForCausalLM.from_config(tiny_config("shaw", preset="modeling"), attn_implementation="flex_attention")
    # Transformers accepts the paged eager kernel at load time; the first forward must refuse it clearly
    paged = RelPosForCausalLM.from_pretrained(tmp_path, attn_implementation="paged|eager")
    with pytest.raises(ValueError, match=r"paged\|eager"), torch.no_grad():
        paged(rand_ids(1, 3))
    # the model still works afterwards
    with torch.no_grad():
        model(rand_ids(2, 3))


# ---------------------------------------------------------------------------
# 4. fully padded rows and ignored labels
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_fully_padded_row_is_finite(position_encoding, impl):
    model = build(position_encoding, impl=impl)
    ids = rand_ids(3, 9, seed=12)
    mask = torch.ones_like(ids)
    mask[1] = 0
    mask[2, :4] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    model.train()  # dropout is 0: train mode only enables gradients paths
    out = model(ids, attention_mask=mask, labels=labels)
    assert torch.isfinite(out.logits).all(), "non-finite logits with a fully padded row"
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"non-finite gradient in {name}"
    model.eval()
    with torch.no_grad():
        # the unpadded row is unaffected by its neighbours
        alone = model(ids[:1]).logits
        assert_close(model(ids, attention_mask=mask).logits[:1], alone, what="row 0 in a padded batch")
        ignored = model(ids, attention_mask=mask, labels=torch.full_like(ids, -100)).loss
        assert torch.isfinite(ignored), "labels all -100 must give a finite loss"
    # the bidirectional body as well
    body = build(position_encoding, cls=RelPosModel, impl=impl, is_decoder=False)
    with torch.no_grad():
        hidden = body(ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(hidden).all()


@pytest.mark.parametrize("by", ["labels", "shift_labels"])
def test_infinite_cross_entropy_is_infinite_not_zero(by):
    """A loss whose cross-entropy overflows float32 (logits spanning +-3e38) is inf, as torch's cross-entropy
    (float64, then float32) on the same logits, and NaN logits give NaN: only labels that are all ignored
    give 0 (the loss was 0.0 for every non-finite value before)."""
    model = build("t5_bias")
    ids = rand_ids(2, 5, seed=3)
    logits = torch.zeros(2, 5, VOCAB)
    logits[0, 0, 0], logits[0, 0, 1] = 3e38, -3e38
    shift = torch.full((2, 5), -100)
    shift[0, 0] = 1  # the one counted label: the token after position 0 is 1, at logit -3e38
    labels = torch.cat([torch.full((2, 1), -100), shift[:, :-1]], dim=1)
    target = dict(labels=labels) if by == "labels" else dict(shift_labels=shift)
    expected = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB).double(), shift.view(-1)).float()
    assert expected.isinf()
    crafted = {"logits": logits}
    model.lm_head.register_forward_hook(lambda module, args, out: crafted["logits"].clone())
    with torch.no_grad():
        assert model(ids, **target).loss == expected
        crafted["logits"] = torch.zeros(2, 5, VOCAB).index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(float("nan")))
        assert model(ids, **target).loss.isnan()
        ignored = model(ids, **{k: torch.full_like(v, -100) for k, v in target.items()}).loss
    assert ignored.item() == 0.0


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_all_ignored_labels_backward(position_encoding):
    model = build(position_encoding).train()
    ids = rand_ids(2, 6)
    out = model(ids, labels=torch.full_like(ids, -100))
    assert torch.isfinite(out.loss) and out.loss.item() == 0.0
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name


# ---------------------------------------------------------------------------
# 5. sequence classification
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_sequence_classification_padding(position_encoding, causal, impl):
    model = build(position_encoding, cls=RelPosForSequenceClassification, impl=impl, is_decoder=causal, num_labels=3)
    seqs = [rand_ids(1, n, seed=20 + n)[0] for n in (8, 5, 3)]
    width = 10
    sides = ("right", "left") if position_encoding in RELATIVE + ("rope",) else ("right",)
    with torch.no_grad():
        alone = torch.cat([model(s[None]).logits for s in seqs])
        for side in sides:
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, s in enumerate(seqs):
                sl = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
                ids[b, sl] = s
                mask[b, sl] = 1
            padded = model(ids, attention_mask=mask).logits
            assert padded.shape == (3, 3)
            assert_close(padded, alone, what=f"{side}-padded vs unpadded")
    # training: finite loss, gradients reach the body
    model.train()
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
        mask[b, : len(s)] = 1
    out = model(ids, attention_mask=mask, labels=torch.tensor([0, 2, 1]))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.score.weight.grad is not None and model.score.weight.grad.abs().sum() > 0
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------
# 6. T5's bias table lives once
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [RelPosForCausalLM, RelPosModel, RelPosForSequenceClassification])
def test_t5_table_lives_once(cls):
    model = build("t5_bias", cls=cls).train()
    named = [(n, p) for n, p in model.named_parameters() if "relative_attention_bias" in n]
    assert len(named) == 1, [n for n, _ in named]
    name, table = named[0]
    assert tuple(table.shape) == (model.config.relative_attention_num_buckets, model.config.num_attention_heads)
    ids = rand_ids(2, 12)
    out = model(ids)
    target = out.logits if hasattr(out, "logits") else out.last_hidden_state
    (target.float() ** 2).mean().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0, f"no gradient reached {name}"


# ---------------------------------------------------------------------------
# 7. activation checkpointing
# ---------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*checkpointing.*:FutureWarning")
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_gradient_checkpointing_same_gradients(position_encoding, use_reentrant):
    model = build(position_encoding).train()
    assert model.config.hidden_dropout == 0 and model.config.attention_dropout == 0
    ids = rand_ids(2, 9, seed=13)
    mask = padding_mask(2, 9, "left", pads=(0, 3))
    labels = ids.masked_fill(mask == 0, -100)

    def grads():
        model.zero_grad(set_to_none=True)
        calls = []
        # a pre-hook: torch's non-reentrant checkpoint stops recomputing once the last saved tensor is rebuilt,
        # so a post-forward hook on the layer's last op may never fire during the recompute
        hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
        try:
            loss = model(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
        finally:
            hook.remove()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, len(calls)

    loss0, plain, calls0 = grads()
    # Reentrant checkpointing carries gradients only for tensors passed positionally: T5's shared bias
    # (computed once, outside the layers) must be one of them, or its table's graph is run twice.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert model.is_gradient_checkpointing
    loss1, ckpt, calls1 = grads()
    model.gradient_checkpointing_disable()
    assert calls0 == 1 and calls1 == 2, f"layer forward ran {calls1} times with checkpointing (expected a recompute)"
    assert torch.allclose(loss0, loss1, atol=1e-6)
    assert plain.keys() == ckpt.keys()
    for name in plain:
        assert torch.allclose(plain[name], ckpt[name], atol=1e-6), name


# ---------------------------------------------------------------------------
# 8. torch.compile
# ---------------------------------------------------------------------------

COMPILE_SCHEMES = ("t5_bias", "shaw", "transformer_xl", "rope")
# The tests that run inductor share one pytest-xdist worker: its first compile in a process starts inductor
# (about 20 s of CPU here), which two workers would each pay.
INDUCTOR = pytest.mark.xdist_group("test_modeling-inductor")


@INDUCTOR
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler")
@pytest.mark.parametrize("position_encoding", COMPILE_SCHEMES)
def test_torch_compile_matches_eager(position_encoding):
    import torch._dynamo

    torch._dynamo.reset()
    model = build(position_encoding, impl="sdpa")
    ids = rand_ids(2, 8, seed=14)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        compiled = torch.compile(model)
        got = compiled(ids, use_cache=False).logits
    assert_close(got, expected, what="compiled vs eager")


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_fullgraph_compile_traces_a_training_step_whole(position_encoding):
    """torch.compile(fullgraph=True) traces a training forward of a padded batch whole, its loss included and the
    backward of every autograd Function it calls (Dynamo traces those too), and gives eager's loss and gradients:
    nothing is read on the host when traced (T5's band reach is a constant of the config; the fused bias backward's
    exactness test and FoX's chunks bounded by the gate's spread step aside; the loss of no label is chosen on the
    device). Before, every model with labels failed to trace, T5 and FoX without labels too, KERPLE and FIRE in
    training. The "eager" backend: tracing without a compiler's time; one layer: the tracing time grows with it."""
    import torch._dynamo

    torch._dynamo.reset()
    model = build(position_encoding, impl="sdpa", num_hidden_layers=1).train()
    ids, mask = rand_ids(2, 12, seed=17), padding_mask(2, 12, "right")
    labels = ids.masked_fill(mask == 0, -100)

    def step(forward):
        model.zero_grad()
        loss = forward(ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    want_loss, want_grads = step(model)
    got_loss, got_grads = step(torch.compile(model, fullgraph=True, backend="eager"))
    assert_close(got_loss, want_loss, what="compiled loss")
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert_close(got_grads[name], grad, what=f"compiled gradient of {name}")


@pytest.mark.parametrize("position_encoding, causal", [("t5_bias", True), ("shaw", False)])
def test_fullgraph_compile_of_a_training_step_at_a_band_length(position_encoding, causal):
    """At the lengths where the band decomposition pays (T5's causal bias from 1,024 tokens, Shaw's from 512) a
    compiled training step takes the dense path (review: fullgraph=True failed there while the band's backward called
    torch.autograd.grad, which Dynamo does not trace); eager keeps the band. Loss and gradients equal eager's."""
    import torch._dynamo

    from hf_relpos import kernels_relpos

    n = kernels_relpos.CAUSAL_BIAS_BAND_MIN_LENGTH if causal else kernels_relpos.SHAW_BAND_MIN_LENGTH
    torch._dynamo.reset()
    cls, field = (RelPosForCausalLM, "logits") if causal else (RelPosModel, "last_hidden_state")
    model = build(position_encoding, cls=cls, impl="sdpa", num_hidden_layers=1, is_decoder=causal).train()
    ids = rand_ids(1, n, seed=5)

    def step(forward):
        model.zero_grad()
        out = getattr(forward(input_ids=ids, use_cache=False), field)
        out.float().pow(2).mean().backward()
        return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    banded = []
    real = kernels_relpos._BandedAttention.apply
    kernels_relpos._BandedAttention.apply = lambda *a: banded.append(1) or real(*a)
    try:
        want, want_grads = step(model)
        assert banded, "eager takes the band at this length"
        got, got_grads = step(torch.compile(model, fullgraph=True, backend="eager"))
    finally:
        kernels_relpos._BandedAttention.apply = real
        torch._dynamo.reset()
    assert_close(got, want, atol=1e-4, what="compiled logits")
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert_close(got_grads[name], grad, atol=1e-4, what=f"compiled gradient of {name}")


def _compile_config(backend: str):
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, backend=backend, mode=None if backend == "eager" else "default")
    config._compile_all_devices = True  # generate compiles only on accelerators unless told otherwise
    return config


@pytest.mark.parametrize("position_encoding", STATIC_OK)
def test_compiled_decode_step_is_one_graph_with_eager_logits(position_encoding):
    """A decode step into a StaticCache traces whole (fullgraph=True; a recording backend checks the tracing
    without inductor's compile time), its logits equal eager's at every step of a padded batch,
    and later steps reuse the first step's graph (the cache's offset is a tensor, not a guarded int)."""
    import torch._dynamo

    torch._dynamo.reset()
    model = build(position_encoding, impl="sdpa")
    B, L, steps, slots = 2, 7, 3, 16
    ids = rand_ids(B, L, seed=15)
    keep = torch.zeros(B, slots, dtype=torch.bool)
    keep[:, : L + steps] = True
    keep[1, :2] = False  # row 1 left-padded

    def mask_for(start, length):  # [B, 1, Q, slots], as generate builds for a static cache
        i = torch.arange(start, start + length)[:, None]
        return (keep[:, None, None, :] & (torch.arange(slots)[None, :] <= i))

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = torch.compile(
        lambda x, m, c: model(x, attention_mask=m, past_key_values=c, use_cache=True).logits,
        fullgraph=True, backend=record,
    )
    with torch.no_grad():
        caches = [StaticCache(config=model.config, max_cache_len=slots) for _ in range(2)]
        prefill = [model(ids, attention_mask=mask_for(0, L), past_key_values=c, use_cache=True).logits for c in caches]
        token = prefill[0][:, -1:].argmax(-1)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for t in range(steps):
                mask = mask_for(L + t, 1)
                expected = model(token, attention_mask=mask, past_key_values=caches[0], use_cache=True).logits
                got = step(token, mask, caches[1])
                assert_close(got, expected, what=f"compiled decode step {t}")
                token = expected[:, -1:].argmax(-1)
    # One graph, and no host read of the cache's offset in it (CUDA graphs, generate's default, cannot hold one).
    assert len(graphs) == 1
    calls = [str(node.target) for node in graphs[0].graph.nodes]
    assert not [c for c in calls if c == "item" or "local_scalar_dense" in c], calls


@pytest.mark.parametrize("position_encoding", STATIC_OK)
def test_compiled_generate_gives_eager_tokens(position_encoding):
    """generate with a static cache and a fullgraph compile config gives the eager (dynamic cache) greedy
    tokens, left padding included."""
    import torch._dynamo

    torch._dynamo.reset()
    model = build(position_encoding, impl="sdpa")
    mask = padding_mask(2, 6, "left", pads=(0, 2))
    ids = rand_ids(2, 6, seed=16).masked_fill(mask == 0, 0)
    expected = greedy(model, ids, 8, attention_mask=mask, pad_token_id=0)
    got = greedy(model, ids, 8, attention_mask=mask, pad_token_id=0, cache_implementation="static",
                 compile_config=_compile_config("eager"))
    assert torch.equal(got, expected), f"compiled {got[:, 6:].tolist()} vs eager {expected[:, 6:].tolist()}"


@INDUCTOR
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler")
def test_inductor_compiled_generate_gives_eager_tokens():
    """The same through inductor (generated code, not just tracing), for T5's bias: its traced offset takes
    the per-[Q, K] bucket path of t5_position_bias."""
    import torch._dynamo

    torch._dynamo.reset()
    model = build("t5_bias", impl="sdpa")
    ids = rand_ids(2, 6, seed=17)
    expected = greedy(model, ids, 6)
    got = greedy(model, ids, 6, cache_implementation="static", compile_config=_compile_config("inductor"))
    assert torch.equal(got, expected), f"inductor {got[:, 6:].tolist()} vs eager {expected[:, 6:].tolist()}"


# ---------------------------------------------------------------------------
# other inputs and dtypes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_inputs_embeds_match_input_ids(position_encoding):
    model = build(position_encoding)
    ids = rand_ids(2, 9)
    mask = padding_mask(2, 9, "left")
    with torch.no_grad():
        from_ids = model(ids, attention_mask=mask).logits
        from_embeds = model(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask).logits
    assert_close(from_embeds, from_ids, atol=0.0)
    with pytest.raises(ValueError):
        model(ids, inputs_embeds=model.get_input_embeddings()(ids))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_bfloat16_with_padding(position_encoding, impl):
    model = build(position_encoding, impl=impl)
    half = build(position_encoding, impl=impl).to(torch.bfloat16)
    ids = rand_ids(3, 9)
    mask = padding_mask(3, 9, "left")
    mask[2] = 0  # a fully padded row too
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        low = half(ids, attention_mask=mask).logits
    assert low.dtype == torch.bfloat16
    assert torch.isfinite(low).all()
    # bf16 keeps ~3 significant digits; logits here are O(5)
    assert_close_where(low.float(), reference, mask, atol=0.5, what="bf16 vs fp32")
