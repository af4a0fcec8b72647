"""``attn_implementation="relpos_triton"`` (the Triton kernel of ``triton_attention_relpos.py``) through the models,
against SDPA: values, the loss and every parameter's gradient, in the mask settings the kernel takes; generate; the
refusals; ``torch.compile(fullgraph=True)`` of a training step through the custom op.

Without a GPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py before anything
imports Triton) on CPU models; with one, the models and inputs live on it (``DEVICE``) and the compiled kernels run.
The module skips without Triton (the optional extra ``hf_relpos[triton]``). The kernel's own checks against float64
oracles are in ``test_triton_attention.py``.
"""

import pytest
import torch
from transformers import DynamicCache, StaticCache

pytest.importorskip("triton")

from hf_relpos import (  # noqa: E402
    POSITION_ENCODINGS,
    RelPosConfig,
    RelPosForCausalLM,
    RelPosForConditionalGeneration,
    RelPosModel,
)
from hf_relpos.position_schemes_relpos import POSITION_SCHEMES  # noqa: E402
from tiny import (  # noqa: E402
    PRESETS, assert_close, assert_close_where, build, enable_checkpointing, triton_interpreting, use_impl,
)
from tiny import padding_mask as cpu_padding_mask  # noqa: E402
from tiny import rand_ids as cpu_rand_ids  # noqa: E402

if triton_interpreting():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("no GPU and TRITON_INTERPRET unset: the kernel cannot run here", allow_module_level=True)

pytestmark = pytest.mark.xdist_group("test_triton_backend")

TRITON = "relpos_triton"
SERVED = tuple(name for name in POSITION_ENCODINGS if POSITION_SCHEMES[name].score_form is not None)
REFUSED = tuple(name for name in POSITION_ENCODINGS if POSITION_SCHEMES[name].score_form is None)
BATCH, LENGTH = 2, 12
# The kernel's float32 products and online softmax against SDPA's: a few ulps of logits and gradients.
ATOL = 2e-5


def rand_ids(*args, **kwargs):
    return cpu_rand_ids(*args, **kwargs).to(DEVICE)


def padding_mask(*args, **kwargs):
    return cpu_padding_mask(*args, **kwargs).to(DEVICE)


def pair(scheme, cls=RelPosForCausalLM, **overrides):
    """The same random model twice on DEVICE, in training mode without dropout: SDPA, and the Triton kernel."""
    overrides.setdefault("attention_dropout", 0.0)
    return tuple(build(scheme, cls=cls, impl=impl, device=DEVICE, **overrides).train() for impl in ("sdpa", TRITON))


def weights(n, like):
    """``n`` weights from -1 to 1 beside ``like``: a summed output whose gradient differs per position."""
    return torch.linspace(-1, 1, n, device=like.device)


def step(model, output: str = "logits", **inputs):
    """One forward and backward of a summed output (the loss where labels are given): ``(output, gradients)``."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    value = out.loss if out.get("loss") is not None else getattr(out, output)
    value = value if value.dim() == 0 else (value * weights(value.shape[-1], value)).sum()
    value.backward()
    return getattr(out, output).detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(reference, actual, keep=None, what=""):
    (expected, expected_grads), (value, grads) = reference, actual
    if keep is None:
        assert_close(value, expected, atol=ATOL, what=what)
    else:
        assert_close_where(value, expected, keep, atol=ATOL, what=what)
    assert grads.keys() == expected_grads.keys(), what
    for name, grad in grads.items():
        scale = expected_grads[name].abs().max().clamp_min(1.0)
        assert_close(grad / scale, expected_grads[name] / scale, atol=ATOL, what=f"{what}: {name}")


def test_every_scheme_is_served_or_refused():
    assert set(SERVED) == set(POSITION_ENCODINGS) - {"shaw", "transformer_xl", "fire"}
    assert set(REFUSED) == {"shaw", "transformer_xl", "fire"}


@pytest.mark.parametrize("scheme", SERVED)
def test_a_training_step_with_left_padding_equals_sdpa(scheme):
    """Causal, left padding: the loss, the logits of real tokens and every parameter's gradient (the T5 table's,
    KERPLE's r1/r2, FoX's gate through the kernel's term gradients)."""
    sdpa, triton = pair(scheme)
    ids, mask = rand_ids(BATCH, LENGTH), padding_mask(BATCH, LENGTH, "left")
    labels = ids.masked_fill(mask == 0, -100)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    assert_same_step(step(sdpa, **inputs), step(triton, **inputs), keep=mask, what=scheme)


@pytest.mark.parametrize("scheme", ["t5_bias", "kerple_log", "alibi"])
def test_bidirectional_with_right_padding_and_a_row_of_padding(scheme):
    """A row with no key at all gives zeros (as SDPA), and no NaN reaches a gradient."""
    sdpa, triton = pair(scheme, cls=RelPosModel, is_decoder=False)
    ids, mask = rand_ids(BATCH, LENGTH), padding_mask(BATCH, LENGTH, "right", pads=(3,))
    mask[1] = 0
    inputs = dict(input_ids=ids, attention_mask=mask)
    assert_same_step(step(sdpa, "last_hidden_state", **inputs), step(triton, "last_hidden_state", **inputs),
                     what=scheme)


@pytest.mark.parametrize("scheme", ["t5_bias", "fox", "kerple_log"])
def test_packed_documents(scheme):
    """Rows packed from documents (position_ids restarting): a query sees its own document, distances restart."""
    sdpa, triton = pair(scheme)
    ids = rand_ids(BATCH, LENGTH)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]], device=DEVICE)
    inputs = dict(input_ids=ids, position_ids=position_ids, labels=ids)
    assert_same_step(step(sdpa, **inputs), step(triton, **inputs), what=scheme)


@pytest.mark.parametrize("scheme", ["t5_bias", "fox", "alibi"])
def test_a_cached_decoding_step(scheme):
    """A prefill into a DynamicCache (left padding), then two tokens: queries offset by the cache."""
    sdpa, triton = (model.eval() for model in pair(scheme))
    ids, mask = rand_ids(BATCH, LENGTH + 2), padding_mask(BATCH, LENGTH + 2, "left")
    steps = []
    with torch.no_grad():
        for model in (sdpa, triton):
            cache = DynamicCache(config=model.config)
            model(ids[:, :-2], attention_mask=mask[:, :-2], past_key_values=cache)
            steps.append(model(ids[:, -2:], attention_mask=mask, past_key_values=cache).logits)
    assert_close(steps[1], steps[0], atol=ATOL, what=scheme)


def test_the_encoder_decoder():
    """Bidirectional encoder (right padding), causal decoder, cross-attention over the source's valid keys."""
    overrides = {k: v for k, v in PRESETS["seq2seq"].items() if k not in PRESETS["modeling"]}
    sdpa, triton = pair("t5_bias", cls=RelPosForConditionalGeneration, **overrides)
    ids, mask = rand_ids(BATCH, LENGTH), padding_mask(BATCH, LENGTH, "right", pads=(3,))
    inputs = dict(input_ids=ids, attention_mask=mask, labels=rand_ids(BATCH, LENGTH, seed=2))
    assert_same_step(step(sdpa, **inputs), step(triton, **inputs), what="seq2seq")

@pytest.mark.parametrize("scheme", SERVED)
def test_autocast_computes_in_its_dtype_as_sdpa_does(scheme):
    """Under autocast the kernel takes q, k and v in the autocast dtype, as SDPA does (RoPE handed it float32
    queries and keys beside bfloat16 values: a TypeError); a training step equals SDPA's under the same autocast to
    bfloat16's rounding, gradients included."""
    sdpa, triton = pair(scheme)
    ids = rand_ids(BATCH, LENGTH)
    results = []
    for model in (sdpa, triton):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            logits = model(ids).logits
        (logits.float() * weights(logits.shape[-1], logits)).sum().backward()
        results.append((logits.float().detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (expected, expected_grads), (got, grads) = results
    assert got.dtype == expected.dtype and torch.isfinite(got).all()
    assert (got - expected).abs().max() <= 0.05 * expected.abs().max(), scheme
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        scale = expected_grads[name].abs().max().clamp_min(1e-3)
        assert (grad - expected_grads[name]).abs().max() <= 0.05 * scale, (scheme, name)


def test_the_encoder_decoder_with_a_target_longer_than_the_source():
    """Cross-attention queries outnumber the source's keys (a short source, a long target, padding): served, and a
    training step equals SDPA's, gradients included (it was refused as queries past the keys)."""
    overrides = {k: v for k, v in PRESETS["seq2seq"].items() if k not in PRESETS["modeling"]}
    sdpa, triton = pair("t5_bias", cls=RelPosForConditionalGeneration, **overrides)
    ids, mask = rand_ids(BATCH, 5), padding_mask(BATCH, 5, "right", pads=(0, 2))
    inputs = dict(input_ids=ids, attention_mask=mask, labels=rand_ids(BATCH, LENGTH + 5, seed=2))  # 17 over 5 keys
    assert_same_step(step(sdpa, **inputs), step(triton, **inputs), what="longer target")



@pytest.mark.parametrize("scheme", ["t5_bias", "fox"])
def test_generate_gives_sdpa_tokens(scheme):
    sdpa, triton = (model.eval() for model in pair(scheme))
    ids, mask = rand_ids(BATCH, LENGTH - 3), padding_mask(BATCH, LENGTH - 3, "left")
    with torch.no_grad():
        outputs = [m.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False) for m in (sdpa, triton)]
    assert torch.equal(outputs[1], outputs[0])


@pytest.mark.parametrize("scheme", ["t5_bias", "kerple_log"])
def test_reentrant_activation_checkpointing(scheme):
    """Each layer makes its kernel term inside itself (review: T5's, made once per forward, reached the layers as
    no tensor, and reentrant checkpointing's second layer ran backward through the first's freed graph)."""
    sdpa, triton = pair(scheme)
    for model in (sdpa, triton):
        enable_checkpointing(model, use_reentrant=True)
    ids = rand_ids(BATCH, LENGTH)
    assert_same_step(step(sdpa, input_ids=ids, labels=ids), step(triton, input_ids=ids, labels=ids), what=scheme)


def test_a_static_cache_with_a_padding_mask():
    """A prefill into a StaticCache with left padding: the mask's columns end before the cache's slots (review:
    an internal shape error)."""
    sdpa, triton = (model.eval() for model in pair("t5_bias"))
    ids, mask = rand_ids(BATCH, 8), padding_mask(BATCH, 8, "left", pads=(3,))
    with torch.no_grad():
        logits = [m(ids, attention_mask=mask, past_key_values=StaticCache(config=m.config, max_cache_len=20)).logits
                  for m in (sdpa, triton)]
    assert_close_where(logits[1], logits[0], mask, atol=ATOL, what="static cache")


def test_bias_gradients_are_bitwise_deterministic():
    """Two backward passes of the same step give the same table gradient, bit for bit (no atomics)."""
    _, triton = pair("t5_bias")
    ids, mask = rand_ids(BATCH, LENGTH), padding_mask(BATCH, LENGTH, "left")
    grads = [step(triton, input_ids=ids, attention_mask=mask, labels=ids)[1] for _ in range(2)]
    name = next(n for n in grads[0] if "relative_attention_bias" in n)
    assert grads[0][name].abs().sum() > 0
    assert torch.equal(grads[0][name], grads[1][name])


# ---------------------------------------------------------------------------
# torch.compile(fullgraph=True): the custom op traced as one node, its fake implementation and autograd
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["t5_bias", "fox"])
def test_fullgraph_compile_of_a_training_step(scheme):
    sdpa, triton = pair(scheme)
    ids = rand_ids(BATCH, LENGTH)
    expected = step(sdpa, input_ids=ids, labels=ids)
    torch._dynamo.reset()
    compiled = torch.compile(triton, fullgraph=True, backend="aot_eager")
    try:
        actual = step(compiled, input_ids=ids, labels=ids)
    finally:
        torch._dynamo.reset()
    assert_same_step(expected, (actual[0], {n.removeprefix("_orig_mod."): g for n, g in actual[1].items()}),
                     what=scheme)


# ---------------------------------------------------------------------------
# What the kernel does not serve: one ValueError each
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", REFUSED)
def test_schemes_the_kernel_does_not_serve_are_refused(scheme):
    model = build(scheme)
    pattern = rf"relpos_triton' does not serve position_encoding='{scheme}'.*the backends that serve it: 'eager', "
    pattern += "'sdpa'"
    with pytest.raises(ValueError, match=pattern):
        model.set_attn_implementation(TRITON)
    config = RelPosConfig(position_encoding=scheme, **PRESETS["modeling"])
    config._attn_implementation = TRITON
    with pytest.raises(ValueError, match=rf"position_encoding='{scheme}'"):
        RelPosForCausalLM(config)


def test_a_sliding_window_is_refused():
    with pytest.raises(ValueError, match=r"relpos_triton' has no sliding window, got sliding_window=4"):
        build("alibi", impl=TRITON, device=DEVICE, sliding_window=4)


def test_attention_dropout_in_training_is_refused():
    model = build("alibi", impl=TRITON, device=DEVICE, attention_dropout=0.1).train()
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 in training"):
        model(rand_ids(1, 4))


def test_a_cpu_outside_the_interpreter_is_pointed_to_sdpa(monkeypatch):
    model = use_impl(build("t5_bias", impl="sdpa"), TRITON)  # on the CPU, whatever DEVICE is
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"relpos_triton' runs on CUDA GPUs \(on CPU only under TRITON_INTERPRET=1"):
        model(cpu_rand_ids(1, 4))


def test_a_static_cache_is_refused_in_one_line():
    model = build("t5_bias", impl=TRITON, device=DEVICE).eval()
    ids = rand_ids(1, 5)
    with torch.no_grad(), pytest.raises(ValueError, match=r"relpos_triton' takes a 2-D attention_mask, not a prepared"):
        model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="static")
