"""Behaviour Transformers defines for every model: output flags, loss kwargs, packed sequences, config fields.

Each test states the upstream behaviour it checks; the attention-weight oracle is the float64
``reference_forward`` of test_position_schemes.py (written from the formulas, not from the model's code).
"""

import copy
import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F
from test_position_schemes import reference_forward
from tiny import (
    ENCODINGS,
    IMPLS,
    VOCAB,
    assert_close,
    build,
    greedy,
    padding_mask,
    rand_ids,
)

from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, DynamicCache

from hf_relpos import RelPosConfig, RelPosForCausalLM, RelPosForSequenceClassification, RelPosModel

# ---------------------------------------------------------------------------
# 1. output_attentions: the probabilities each layer used
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_attentions_are_the_layer_probabilities(position_encoding, causal, impl):
    overrides = {"clamp_len": 4} if position_encoding == "transformer_xl" and causal else {}
    model = build(position_encoding, cls=RelPosModel, impl=impl, is_decoder=causal, **overrides)
    B, L = 2, 11
    ids = rand_ids(B, L, seed=31)
    mask = padding_mask(B, L, "right", pads=(0, 3))
    expected = []
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
        plain = model(ids, attention_mask=mask)
        reference_forward(model, ids, mask, attentions=expected)
    assert plain.attentions is None
    assert len(out.attentions) == model.config.num_hidden_layers
    for layer, (got, want) in enumerate(zip(out.attentions, expected)):
        assert got.shape == (B, model.config.num_attention_heads, L, L)
        assert_close(got.double(), want, atol=2e-5, what=f"layer {layer} attention weights")
        visible = mask.bool()[:, None, None, :].expand_as(got)
        assert (got[~visible] == 0).all(), "weight on a padded key"
        assert_close(got.sum(-1).double(), torch.ones(got.shape[:-1], dtype=torch.float64), atol=1e-5, what="row sums")
    # Asking for the weights does not change the outputs.
    assert_close(out.last_hidden_state, plain.last_hidden_state, atol=1e-5, what="hidden states")


@pytest.mark.parametrize("cls", [RelPosModel, RelPosForCausalLM, RelPosForSequenceClassification])
def test_forward_declares_transformers_kwargs(cls):
    """Transformers (its tests, generation, Trainer) learns which kwargs a forward takes, output_attentions and
    the packed-sequence ones among them, from ``**kwargs: Unpack[TransformersKwargs]``: a real annotation,
    not a string left by ``from __future__ import annotations``."""
    annotation = inspect.signature(cls.forward).parameters["kwargs"].annotation
    declared = annotation.__args__[0].__annotations__
    for name in ("output_attentions", "output_hidden_states", "cu_seq_lens_q", "num_items_in_batch"):
        assert name in declared


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_attentions_fully_masked_rows_are_zero(position_encoding, impl):
    model = build(position_encoding, cls=RelPosModel, impl=impl, is_decoder=False)
    ids = rand_ids(2, 6, seed=3)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1] = 0  # a row with no key at all
    with torch.no_grad():
        attentions = model(ids, attention_mask=mask, output_attentions=True).attentions
    for weights in attentions:
        assert torch.isfinite(weights).all()
        assert (weights[1] == 0).all()
        assert_close(weights[0].sum(-1), torch.ones(weights.shape[1:3]), atol=1e-5, what="row sums")


@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_generate_returns_attentions_with_the_cache(position_encoding):
    model = build(position_encoding, impl="sdpa")
    ids, new = rand_ids(2, 5, seed=4), 3
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, output_attentions=True,
                             return_dict_in_generate=True)
        full = model(out.sequences[:, :-1], output_attentions=True, use_cache=False).attentions
    assert len(out.attentions) == new
    for step, per_layer in enumerate(out.attentions):
        assert len(per_layer) == model.config.num_hidden_layers
        for layer, weights in enumerate(per_layer):
            q_len = 5 if step == 0 else 1
            keys = 5 + step
            assert weights.shape == (2, model.config.num_attention_heads, q_len, keys)
            # The cached step's rows equal the same rows of one uncached forward over the whole sequence.
            want = full[layer][:, :, keys - q_len : keys, :keys]
            assert_close(weights, want, atol=1e-5, what=f"step {step} layer {layer}")


@pytest.mark.parametrize("position_encoding", ["t5_bias", "shaw", "transformer_xl", "rope"])
def test_assisted_decoding(position_encoding):
    model = build(position_encoding)
    assistant = copy.deepcopy(model)
    ids = rand_ids(1, 6, seed=8)
    plain = greedy(model, ids, 5)
    assisted = greedy(model, ids, 5, assistant_model=assistant)
    assert torch.equal(plain, assisted)
    # with the weights asked for, each step's attentions cover the keys seen so far
    out = greedy(model, ids, 5, assistant_model=assistant, output_attentions=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.attentions is not None and len(out.attentions) == 5
    for step, per_layer in enumerate(out.attentions):
        weights = per_layer[-1]
        assert weights.shape[-1] == 6 + step and torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-5)


# ---------------------------------------------------------------------------
# 2. config flags and return_dict
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("position_encoding", ["t5_bias", "transformer_xl"])
def test_config_output_flags_from_pretrained(tmp_path, position_encoding):
    model = build(position_encoding, mem_len=3 if position_encoding == "transformer_xl" else 0)
    model.save_pretrained(tmp_path)
    ids = rand_ids(2, 5)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, output_hidden_states=True, output_attentions=True).eval()
    assert loaded.config.output_hidden_states and loaded.config.output_attentions
    with torch.no_grad():
        out = loaded(ids)
        quiet = loaded(ids, output_hidden_states=False, output_attentions=False)
    assert len(out.hidden_states) == loaded.config.num_hidden_layers + 1
    assert len(out.attentions) == loaded.config.num_hidden_layers
    assert quiet.hidden_states is None and quiet.attentions is None
    # the last hidden state is the final (normed) one, the first the embeddings
    with torch.no_grad():
        base = loaded.model(ids)
    assert torch.equal(out.hidden_states[-1], base.last_hidden_state)
    assert torch.equal(out.hidden_states[0], loaded.model.embed_tokens(ids))


@pytest.mark.parametrize("cls", [RelPosForCausalLM, RelPosForSequenceClassification, RelPosModel])
def test_return_dict_false_gives_upstream_tuples(cls):
    model = build("transformer_xl", cls=cls, mem_len=3)
    ids = rand_ids(2, 5)
    labels = ids if cls is RelPosForCausalLM else torch.tensor([0, 1])
    kwargs = {} if cls is RelPosModel else {"labels": labels}
    with torch.no_grad():
        full = model(ids, output_hidden_states=True, output_attentions=True, use_cache=False, **kwargs)
        as_tuple = model(ids, output_hidden_states=True, output_attentions=True, use_cache=False, return_dict=False,
                         **kwargs)
        model.config.return_dict = False
        from_config = model(ids, output_hidden_states=True, output_attentions=True, use_cache=False, **kwargs)
    # upstream order: the fields of the output class, Nones left out
    expected = [getattr(full, f.name) for f in dataclasses.fields(full) if getattr(full, f.name) is not None]
    for got in (as_tuple, from_config):
        assert isinstance(got, tuple) and len(got) == len(expected)
        for a, b in zip(got, expected):
            if isinstance(b, torch.Tensor):
                assert torch.equal(a, b)
            else:
                assert all(torch.equal(x, y) for x, y in zip(a, b))
    names = [f.name for f in dataclasses.fields(full)]
    first = {RelPosForCausalLM: "loss", RelPosForSequenceClassification: "loss", RelPosModel: "last_hidden_state"}[cls]
    assert names[0] == first and names[-3:] == ["hidden_states", "attentions", "mems"]
    assert len(expected) == (4 if cls is RelPosModel else 5)


# ---------------------------------------------------------------------------
# 3. loss keyword arguments
# ---------------------------------------------------------------------------


def test_shift_labels_reach_the_loss():
    model = build("alibi")
    ids = rand_ids(2, 7)
    targets = rand_ids(2, 7, seed=5)
    targets[0, :2] = -100
    with torch.no_grad():
        out = model(ids, shift_labels=targets)
        logits = model(ids).logits
    want = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
    assert out.loss is not None
    assert torch.allclose(out.loss, want, atol=1e-6)
    # with labels too, shift_labels (already shifted) win, as in Transformers' loss
    with torch.no_grad():
        both = model(ids, labels=ids, shift_labels=targets).loss
    assert torch.allclose(both, want, atol=1e-6)


def test_num_items_in_batch_gives_the_full_batch_loss():
    """Gradient accumulation: the two halves' losses with the batch's item count add up to the batch's loss."""
    model = build("t5_bias")
    ids = rand_ids(4, 8)
    labels = ids.clone()
    labels[1, :5] = -100  # uneven token counts per half
    with torch.no_grad():
        full = model(ids, labels=labels).loss
        items = int((labels[:, 1:] != -100).sum())
        halves = sum(model(ids[s], labels=labels[s], num_items_in_batch=items).loss for s in (slice(0, 2), slice(2, 4)))
        naive = sum(model(ids[s], labels=labels[s]).loss for s in (slice(0, 2), slice(2, 4))) / 2
    assert torch.allclose(halves, full, atol=1e-6)
    assert not torch.allclose(naive, full, atol=1e-4)  # the mean of means differs: the kwarg matters


# ---------------------------------------------------------------------------
# 4. packed sequences
# ---------------------------------------------------------------------------

DOCS = (4, 6, 3)


def _packed(seed=21):
    docs = [rand_ids(1, n, seed=seed + i)[0] for i, n in enumerate(DOCS)]
    ids = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(n) for n in DOCS])[None]
    return docs, ids, position_ids


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", ENCODINGS)
def test_packed_documents_match_documents_alone(position_encoding, impl, causal):
    model = build(position_encoding, cls=RelPosModel, impl=impl, is_decoder=causal)
    docs, ids, position_ids = _packed()
    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        alone = torch.cat([model(doc[None]).last_hidden_state[0] for doc in docs])
        by_positions = model(ids, position_ids=position_ids).last_hidden_state[0]
        by_cu = model(ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                      max_length_q=max(DOCS), max_length_k=max(DOCS)).last_hidden_state[0]
        by_seq_idx = model(ids, position_ids=position_ids, seq_idx=torch.repeat_interleave(
            torch.arange(len(DOCS)), torch.tensor(DOCS))[None]).last_hidden_state[0]
        # the collator's kwargs alone: positions restart at each document (absolute schemes need that)
        by_cu_only = model(ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu).last_hidden_state[0]
    for name, got in (("position_ids", by_positions), ("cu_seq_lens", by_cu), ("seq_idx", by_seq_idx),
                      ("cu_seq_lens without position_ids", by_cu_only)):
        assert_close(got, alone, atol=1e-5, what=f"packed by {name}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", ["alibi", "t5_bias", "shaw"])
def test_restarting_position_ids_with_an_attention_mask_are_positions_only(position_encoding, impl, causal):
    """As in Transformers' masks (packing is read from position_ids only when attention_mask is None), restarting
    position_ids with a 2-D mask, even one of ones, separate no documents: these relative schemes, which take
    no positions from position_ids, give the unpacked row. Before, a mask of ones was read as packing (the
    row's logits changed by 0.24-0.31)."""
    model = build(position_encoding, cls=RelPosModel, impl=impl, is_decoder=causal)
    _, ids, position_ids = _packed()
    ones = torch.ones_like(ids)
    with torch.no_grad():
        unpacked = model(ids, attention_mask=ones).last_hidden_state
        with_mask = model(ids, attention_mask=ones, position_ids=position_ids).last_hidden_state
        packed = model(ids, position_ids=position_ids).last_hidden_state
    assert_close(with_mask, unpacked, atol=1e-5, what="position_ids with a mask of ones vs no position_ids")
    assert not torch.allclose(packed, unpacked, atol=1e-3)  # without the mask, the same position_ids do pack


@pytest.mark.parametrize("padded", [False, True], ids=["mask-of-ones", "padded"])
@pytest.mark.parametrize("position_encoding", ["alibi", "t5_bias"])
def test_compiled_packed_rows_with_an_attention_mask_match_eager(position_encoding, padded):
    """Traced by torch.compile, restarting position_ids with a 2-D attention_mask are read exactly as eager
    reads them: as positions only, never as packed documents (as Transformers' masks), whether the mask is
    all ones or pads. (Review finding, before: a traced forward let documents attend to each other where
    eager separated them, logits off by 5-8; since issue 23 neither separates them with a mask.)"""
    model = build(position_encoding, cls=RelPosModel)
    _, ids, position_ids = _packed()
    mask = torch.ones_like(ids)
    if padded:
        mask[:, :2] = 0
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
        traced = compiled(ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
        unpacked = model(ids, attention_mask=mask).last_hidden_state
    live = mask[0].bool()
    assert_close(traced[0, live], eager[0, live], atol=1e-5, what="compiled vs eager")
    assert_close(eager[0, live], unpacked[0, live], atol=1e-5, what="eager vs no position_ids")


@pytest.mark.parametrize("position_encoding", ["t5_bias", "shaw", "rope"])
def test_flattening_collator_loss_matches_padded_batch(position_encoding):
    """DataCollatorWithFlattening's padding-free batch gives the loss of the padded batch."""
    model = build(position_encoding)
    docs, _, _ = _packed(seed=40)
    features = [{"input_ids": doc.tolist(), "labels": doc.tolist()} for doc in docs]
    packed = DataCollatorWithFlattening(return_tensors="pt")(features)
    L = max(DOCS)
    ids = torch.zeros(len(docs), L, dtype=torch.long)
    mask = torch.zeros(len(docs), L, dtype=torch.long)
    for b, doc in enumerate(docs):
        ids[b, : len(doc)], mask[b, : len(doc)] = doc, 1
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        flat = model(**packed).loss
    assert torch.allclose(flat, padded, atol=1e-5)


# ---------------------------------------------------------------------------
# 6. Transformer-XL beam search without a cache
# ---------------------------------------------------------------------------


def test_transformer_xl_beam_search_without_cache():
    model = build("transformer_xl", mem_len=4)
    ids = rand_ids(2, 5, seed=6)
    kwargs = dict(max_new_tokens=4, num_beams=3, do_sample=False)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


# ---------------------------------------------------------------------------
# 7. sliding_window, a standard config attribute
# ---------------------------------------------------------------------------


def test_sliding_window_is_a_config_field(tmp_path):
    config = RelPosConfig(sliding_window=None)
    config.sliding_window = 2
    assert config.sliding_window == 2
    config.save_pretrained(tmp_path)
    assert RelPosConfig.from_pretrained(tmp_path).sliding_window == 2
    for bad in (0, -3, 2.5, "4"):
        with pytest.raises(ValueError, match="RelPosConfig.sliding_window"):
            RelPosConfig(sliding_window=bad)
        with pytest.raises(ValueError, match="RelPosConfig.sliding_window"):
            config.sliding_window = bad
    assert config.sliding_window == 2  # a refused value changes nothing


def test_transformer_xl_window_follows_mem_len(tmp_path):
    """Transformer-XL's decoding memory is the window mem_len + 1, whenever and however mem_len is set."""
    xl = RelPosConfig(position_encoding="transformer_xl", mem_len=6)
    assert xl.sliding_window == 7
    with pytest.raises(ValueError, match="RelPosConfig.sliding_window"):
        RelPosConfig(position_encoding="transformer_xl", mem_len=6, sliding_window=3)
    xl.mem_len = 2
    assert xl.sliding_window == 3
    xl.save_pretrained(tmp_path)
    assert RelPosConfig.from_pretrained(tmp_path).sliding_window == 3
    longer = RelPosConfig.from_pretrained(tmp_path, mem_len=16)  # a longer memory at evaluation time
    assert longer.mem_len == 16 and longer.sliding_window == 17
    assert RelPosConfig.from_pretrained(tmp_path, mem_len=0).sliding_window is None
    # a model saved after its mem_len changed reloads as the same model
    model = build("transformer_xl", mem_len=5)
    model.config.mem_len = 2
    model.save_pretrained(tmp_path / "m")
    again = RelPosForCausalLM.from_pretrained(tmp_path / "m").eval()
    ids = rand_ids(1, 9)
    with torch.no_grad():
        assert_close(again(ids).logits, model(ids).logits, what="reloaded")


@pytest.mark.parametrize("position_encoding", ["t5_bias", "alibi", "rope", "shaw", "transformer_xl"])
def test_bidirectional_sliding_window_is_symmetric(position_encoding):
    """As Transformers' bidirectional sliding-window mask: a query sees keys within distance W on both sides."""
    W, L = 2, 9
    model = build(position_encoding, cls=RelPosModel, is_decoder=False, sliding_window=W, num_hidden_layers=1)
    ids = rand_ids(1, L, seed=2)
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions[0][0]
    distance = (torch.arange(L)[:, None] - torch.arange(L)[None, :]).abs()
    assert (weights[:, distance > W] == 0).all()
    assert (weights[:, distance <= W] > 0).all()


@pytest.mark.parametrize("position_encoding", ["t5_bias", "alibi", "rope", "shaw", "learned"])
def test_sliding_window_is_honoured(position_encoding):
    """A query sees only the W latest positions: through two layers, tokens more than 2(W-1) back do not
    change its output (one more does), in a full forward and in cached decoding (whose cache keeps W keys)."""
    W, L = 3, 9
    model = build(position_encoding, sliding_window=W)
    assert model.config.num_hidden_layers == 2
    reach = 2 * (W - 1)
    ids = rand_ids(1, L, seed=2)
    changed = ids.clone()
    changed[0, : L - 1 - reach] = (changed[0, : L - 1 - reach] + 1) % VOCAB
    inside = ids.clone()
    inside[0, L - 1 - reach] = (inside[0, L - 1 - reach] + 1) % VOCAB
    with torch.no_grad():
        assert not torch.allclose(model(inside, use_cache=False).logits[0, -1], model(ids, use_cache=False).logits[0, -1])
    with torch.no_grad():
        a = model(ids, use_cache=False).logits[0, -1]
        b = model(changed, use_cache=False).logits[0, -1]
        assert_close(a, b, atol=1e-5, what="last row with its window unchanged")
        cache = DynamicCache(config=model.config)
        model(ids[:, :-1], past_key_values=cache)
        step = model(ids[:, -1:], past_key_values=cache).logits[0, -1]
    assert_close(step, a, atol=1e-5, what="cached step")
    assert len(cache.layers[0].keys[0, 0]) <= W


# ---------------------------------------------------------------------------
# 8. Sequence classification and Transformer-XL mems
# ---------------------------------------------------------------------------


def test_sequence_classification_output_flags_with_mems():
    model = build("transformer_xl", cls=RelPosForSequenceClassification, mem_len=3)
    ids = rand_ids(2, 5)
    with torch.no_grad():
        first = model(ids)
        out = model(ids, mems=first.mems, output_attentions=True, output_hidden_states=True)
        as_tuple = model(ids, mems=first.mems, return_dict=False)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert len(out.attentions) == model.config.num_hidden_layers
    assert out.attentions[0].shape == (2, model.config.num_attention_heads, 5, 3 + 5)  # memory keys in front
    assert_close(out.attentions[0].sum(-1), torch.ones(2, model.config.num_attention_heads, 5), what="row sums")
    assert_close(as_tuple[0], out.logits, what="tuple logits") and len(as_tuple[1]) == model.config.num_hidden_layers
