"""``attn_implementation="flex_attention"`` (flex_backend_relpos.py) against eager, forward only on CPU (torch's
FlexAttention has no CPU backward): every scheme whose term is a score function, in every mask setting of issue 36.

On a CPU hf_relpos runs torch's unfused FlexAttention (its reference implementation of the same score and mask
functions): torch 2.13's compiled CPU kernel gives wrong values at some shapes (``flex_backend_relpos._flex_kernel``),
so nothing here compiles a kernel; ``test_a_static_cache_step_traces_whole`` traces the whole forward
(``fullgraph=True``) with a recording backend. The GPU gradient check at the end skips without CUDA.
"""

import pytest
import torch
from transformers import DynamicCache, StaticCache

from hf_relpos import (
    POSITION_ENCODINGS,
    RelPosConfig,
    RelPosForCausalLM,
    RelPosForConditionalGeneration,
    RelPosModel,
)
from hf_relpos.configuration_relpos import CAUSAL_ONLY
from hf_relpos.position_schemes_relpos import POSITION_SCHEMES
from tiny import PRESETS, assert_close, assert_close_where, build, padding_mask, rand_ids

pytestmark = pytest.mark.xdist_group("test_flex_attention")

SERVED = tuple(name for name in POSITION_ENCODINGS if POSITION_SCHEMES[name].score_form is not None)
REFUSED = tuple(name for name in POSITION_ENCODINGS if POSITION_SCHEMES[name].score_form is None)
BIDIRECTIONAL = tuple(name for name in SERVED if name not in CAUSAL_ONLY)
BATCH, LENGTH = 2, 12


def pair(scheme, cls=RelPosForCausalLM, **overrides):
    """The same random model twice: eager, and flex."""
    eager = build(scheme, cls=cls, impl="eager", **overrides)
    flex = build(scheme, cls=cls, impl="flex_attention", **overrides)
    return eager, flex


def test_every_scheme_is_served_or_refused():
    assert set(SERVED) == set(POSITION_ENCODINGS) - {"shaw", "transformer_xl", "fire"}
    assert set(REFUSED) == {"shaw", "transformer_xl", "fire"}


def test_a_cpu_runs_torchs_unfused_flex_attention():
    """Not the compiled CPU kernel: in torch 2.13 it gives wrong values and NaN for a causal mask at length 8
    (head_dim 8), with torch alone; a GPU compiles."""
    from torch.nn.attention.flex_attention import flex_attention

    from hf_relpos.flex_backend_relpos import _flex_kernel

    assert _flex_kernel("cpu") is flex_attention
    assert _flex_kernel("cuda") is not flex_attention


# ---------------------------------------------------------------------------
# Values against eager, in every mask setting
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SERVED)
def test_causal_with_left_padding(scheme):
    eager, flex = pair(scheme)
    ids, mask = rand_ids(BATCH, LENGTH), padding_mask(BATCH, LENGTH, "left")
    with torch.no_grad():
        expected, actual = eager(ids, attention_mask=mask).logits, flex(ids, attention_mask=mask).logits
    assert_close_where(actual, expected, mask, what=scheme)


@pytest.mark.parametrize("scheme", ["t5_bias", "rope"])
def test_length_8(scheme):
    """Causal, nothing padded, 8 tokens: torch 2.13's compiled CPU kernel gave NaN (T5) or errors of 1.5-3 here
    (review of issue 36), which the unfused CPU path does not."""
    eager, flex = pair(scheme)
    ids = rand_ids(BATCH, 8)
    with torch.no_grad():
        for _ in range(2):
            assert_close(flex(ids).logits, eager(ids).logits, what=scheme)


@pytest.mark.parametrize("scheme", BIDIRECTIONAL)
def test_bidirectional_with_right_padding_and_a_row_of_padding(scheme):
    eager, flex = pair(scheme, cls=RelPosModel, is_decoder=False)
    ids, mask = rand_ids(BATCH, LENGTH), padding_mask(BATCH, LENGTH, "right", pads=(3,))
    mask[1] = 0  # a row with no key at all: its attention gives zeros under every backend
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask).last_hidden_state
        actual = flex(ids, attention_mask=mask).last_hidden_state
    assert_close(actual, expected, what=scheme)


@pytest.mark.parametrize("scheme", SERVED)
def test_packed_documents(scheme):
    """Rows packed from documents (position_ids restarting, no attention_mask): distances per document."""
    eager, flex = pair(scheme)
    ids = rand_ids(BATCH, LENGTH)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        expected = eager(ids, position_ids=position_ids).logits
        actual = flex(ids, position_ids=position_ids).logits
    assert_close(actual, expected, what=scheme)


@pytest.mark.parametrize("scheme", SERVED)
def test_sliding_window_with_left_padding(scheme):
    eager, flex = pair(scheme, sliding_window=4)
    ids, mask = rand_ids(BATCH, LENGTH), padding_mask(BATCH, LENGTH, "left")
    with torch.no_grad():
        expected, actual = eager(ids, attention_mask=mask).logits, flex(ids, attention_mask=mask).logits
    assert_close_where(actual, expected, mask, what=scheme)


@pytest.mark.parametrize("scheme", SERVED)
def test_a_cached_decoding_step(scheme):
    """A prefill of LENGTH tokens (left padding) into a DynamicCache, then one token: queries offset by the cache,
    each backend with its own cache."""
    eager, flex = pair(scheme)
    ids, mask = rand_ids(BATCH, LENGTH + 1), padding_mask(BATCH, LENGTH + 1, "left")
    with torch.no_grad():
        steps = []
        for model in (eager, flex):
            cache = DynamicCache(config=model.config)
            model(ids[:, :-1], attention_mask=mask[:, :-1], past_key_values=cache)
            steps.append(model(ids[:, -1:], attention_mask=mask, past_key_values=cache).logits)
    assert_close(steps[1], steps[0], what=scheme)


@pytest.mark.parametrize("scheme", BIDIRECTIONAL)
def test_the_encoder_decoder(scheme):
    """Bidirectional encoder (right padding), causal decoder, and cross-attention with no position term."""
    overrides = {k: v for k, v in PRESETS["seq2seq"].items() if k not in PRESETS["modeling"]}
    eager, flex = pair(scheme, cls=RelPosForConditionalGeneration, **overrides)
    ids, mask = rand_ids(BATCH, LENGTH), padding_mask(BATCH, LENGTH, "right", pads=(3,))
    labels = rand_ids(BATCH, LENGTH, seed=2)
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask, labels=labels).logits
        actual = flex(ids, attention_mask=mask, labels=labels).logits
    assert_close(actual, expected, what=scheme)


# ---------------------------------------------------------------------------
# generate, static caches, torch.compile of the whole forward
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme,kwargs", [
    ("t5_bias", {}),
    ("fox", {}),
    ("alibi", {"num_beams": 2}),
    ("t5_bias", {"cache_implementation": "static"}),
])
def test_generate_gives_eager_tokens(scheme, kwargs):
    eager, flex = pair(scheme)
    ids, mask = rand_ids(BATCH, LENGTH - 3), padding_mask(BATCH, LENGTH - 3, "left")
    outputs = []
    with torch.no_grad():
        for model in (eager, flex):
            outputs.append(model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, **kwargs))
    assert torch.equal(outputs[1], outputs[0])


def test_a_static_cache_step_traces_whole():
    """``torch.compile(fullgraph=True)`` of decoding steps over a StaticCache: one graph (a recording backend:
    the FlexAttention call and its mask traced, the cache's offset a tensor never read on the host), eager's
    logits at every step, left padding included."""
    import torch._dynamo

    torch._dynamo.reset()
    eager, flex = pair("t5_bias")
    slots, prompt = LENGTH + 4, LENGTH - 4
    ids, mask = rand_ids(BATCH, prompt), padding_mask(BATCH, prompt, "left")
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = torch.compile(
        lambda x, m, c: flex(x, attention_mask=m, past_key_values=c, use_cache=True).logits, fullgraph=True,
        backend=record,
    )
    with torch.no_grad():
        caches = [StaticCache(config=eager.config, max_cache_len=slots) for _ in range(2)]
        eager(ids, attention_mask=mask, past_key_values=caches[0])
        flex(ids, attention_mask=mask, past_key_values=caches[1])
        token = rand_ids(BATCH, 1, seed=3)
        keep = torch.cat([mask, torch.ones(BATCH, slots - prompt, dtype=mask.dtype)], dim=1).bool()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for t in range(3):
                # [B, 1, 1, slots], as generate renders it for a static cache: one shape at every step.
                step_mask = keep[:, None, None, :] & (torch.arange(slots) <= prompt + t)
                expected = eager(token, attention_mask=step_mask, past_key_values=caches[0]).logits
                assert_close(step(token, step_mask, caches[1]), expected, what=f"step {t}")
                token = expected.argmax(-1)
    assert len(graphs) == 1
    calls = [str(node.target) for node in graphs[0].graph.nodes]
    assert not [c for c in calls if c == "item" or "local_scalar_dense" in c], calls


# ---------------------------------------------------------------------------
# The small tables: what the kernel reads
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", [name for name in SERVED if POSITION_SCHEMES[name].score_form == "distance"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_table_of_distances_is_the_dense_bias(scheme, causal):
    """Entry ``j - i + Q - 1`` of ``bias_by_distance`` is the dense bias of query ``i`` and key ``j``, after a
    past of 5 tokens, value for value; and a gradient on it reaches the scheme's parameters (T5's table, KERPLE's
    r1 and r2) as the same gradient on the dense bias does (on CPU, where torch's FlexAttention has no backward)."""
    model = build(scheme, cls=None if causal else RelPosModel, is_decoder=causal).train()
    scheme_module = model.position if isinstance(model, RelPosModel) else model.model.position
    from hf_relpos.position_context_relpos import PositionContext

    past, q_length = 5, 7
    ctx = PositionContext(
        query_length=q_length, key_length=past + q_length, q_offset=past, past_length=past, causal=causal, mask=None,
        position_ids=torch.arange(past, past + q_length)[None], attn_implementation="eager", output_attentions=False,
        alive=None, scheme=scheme_module,
    )
    dense = scheme_module.bias(ctx, "cpu", torch.float32).float().expand(1, model.config.num_attention_heads, -1, -1)
    table = scheme_module.bias_by_distance(ctx, "cpu")
    i = torch.arange(q_length)[:, None]
    j = torch.arange(past + q_length)[None, :]
    gathered = table[:, j - i + q_length - 1]
    assert torch.equal(gathered, dense[0])
    parameters = [p for p in scheme_module.parameters() if p.requires_grad]
    if parameters:  # what FlexAttention's backward hands the table reaches the parameters as the dense bias's would
        upstream = torch.randn_like(dense[0])
        through_table = torch.autograd.grad((gathered * upstream).sum(), parameters)
        through_dense = torch.autograd.grad((dense[0] * upstream).sum(), parameters)
        for a, b in zip(through_table, through_dense):
            assert a.abs().sum() > 0
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("length", [9, 2000])
def test_fox_query_key_vectors_sum_to_its_bias(length):
    """FoX's vectors, summed in float32 part by part as the score function does, give its float64 bias to 1e-5
    at 2,000 tokens, where ``c`` is near -1,400 (float32 roundings of ``c_i`` and ``c_j`` alone lose 1e-4 near the
    diagonal)."""
    from hf_relpos.functional import fox_bias, fox_query_key_bias

    torch.manual_seed(0)
    log_forget = torch.nn.functional.logsigmoid(torch.randn(2, 3, length, dtype=torch.float64))
    queries = 4
    vectors = fox_query_key_bias(log_forget, queries, past_length=length - queries)
    assert vectors.shape == (2, 3, 2, queries + length) and vectors.dtype == torch.float32
    high = vectors[:, :, 0, :queries, None] + vectors[:, :, 0, None, queries:]
    low = vectors[:, :, 1, :queries, None] + vectors[:, :, 1, None, queries:]
    expected = fox_bias(log_forget, queries, past_length=length - queries)
    causal = torch.arange(length)[None, :] <= torch.arange(length - queries, length)[:, None]
    # 1e-5, plus float32's own rounding of the sum (far keys, whose bias is ~-1,400, are rounded as eager rounds them)
    torch.testing.assert_close((high + low).double()[..., causal], expected[..., causal], atol=1e-5, rtol=2e-7)
    if length > 1000:
        with pytest.raises(AssertionError):  # the high parts alone: c_i - c_j of float32 roundings
            torch.testing.assert_close(high.double()[..., causal], expected[..., causal], atol=1e-5, rtol=2e-7)


# ---------------------------------------------------------------------------
# What flex does not serve: one ValueError each
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", REFUSED)
def test_schemes_without_a_score_function_are_refused(scheme):
    model = build(scheme)
    with pytest.raises(ValueError, match=rf"flex_attention.*position_encoding='{scheme}'.*use 'sdpa' or 'eager'"):
        model.set_attn_implementation("flex_attention")
    config = RelPosConfig(position_encoding=scheme, **PRESETS["modeling"])
    config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=rf"position_encoding='{scheme}'"):
        RelPosForCausalLM(config)


def test_a_forward_with_gradients_on_cpu_is_refused():
    model = build("t5_bias", impl="flex_attention")
    with pytest.raises(ValueError, match=r"flex_attention.*no CPU backward.*'sdpa'"):
        model(rand_ids(1, 4))
    embeds = torch.randn(1, 4, model.config.hidden_size, requires_grad=True)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no CPU backward"):
        model(inputs_embeds=embeds)


def test_attention_dropout_in_training_is_refused():
    model = build("alibi", impl="flex_attention", attention_dropout=0.1).train()
    with torch.no_grad(), pytest.raises(ValueError, match=r"attention_dropout=0.1 in training"):
        model(rand_ids(1, 4))


# ---------------------------------------------------------------------------
# On a GPU: gradients into the captured tables, against SDPA with the dense bias
# ---------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs a GPU (none on CPU in torch)")
@pytest.mark.parametrize("scheme", ["t5_bias", "kerple_log", "fox", "alibi"])
def test_gradients_on_gpu_equal_sdpa(scheme):
    sdpa, flex = (build(scheme, impl=impl).cuda().train() for impl in ("sdpa", "flex_attention"))
    ids, mask = rand_ids(BATCH, LENGTH).cuda(), padding_mask(BATCH, LENGTH, "left").cuda()
    grads = []
    for model in (sdpa, flex):
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert_close(grads[1][name], grads[0][name], atol=1e-4, what=name)
