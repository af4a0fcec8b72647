"""torch.export and ONNX of every scheme, with a padding mask and dynamic batch and lengths.

Each model is traced on one shape and run on another (another batch, length and padding); its outputs must equal
eager's on the tokens that are not padding. Under export the fast CPU paths step aside for functional_relpos.py's
public-op math (``attention_utils_relpos._exporting``); the eager paths stay as they are. One layer per stack keeps
the file fast.
"""

import functools

import pytest
import torch
from torch.export import Dim
from transformers import DynamicCache, EncoderDecoderCache

from hf_relpos import (
    POSITION_ENCODINGS,
    RelPosForCausalLM,
    RelPosForConditionalGeneration,
    RelPosForSequenceClassification,
    RelPosModel,
)
from hf_relpos.attention_utils_relpos import _exporting
from hf_relpos.configuration_relpos import CAUSAL_ONLY
from tiny import VOCAB, make_model

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_export")

ENCODINGS = tuple(POSITION_ENCODINGS)
SEQ2SEQ = tuple(s for s in ENCODINGS if s not in CAUSAL_ONLY)
ONE_LAYER = dict(num_hidden_layers=1)
BATCH, LENGTH = Dim("batch", min=1, max=64), Dim("length", min=2, max=60)


def _tokens(batch: int, length: int, seed: int):
    """Token ids and a left-padding mask: row 0 has 3 pads, row 1 none, a third row (if any) 1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :3] = 0
    if batch > 2:
        mask[2, :1] = 0
    return ids, mask


class _Outputs(torch.nn.Module):
    """``module(input_ids, attention_mask)``'s ``field`` as a plain tensor (what an exported graph returns)."""

    def __init__(self, module, field: str, **kwargs):
        super().__init__()
        self.module, self.field, self.kwargs = module, field, kwargs

    def forward(self, input_ids, attention_mask):
        return getattr(self.module(input_ids=input_ids, attention_mask=attention_mask, **self.kwargs), self.field)


class _DecoderStep(torch.nn.Module):
    """One cached decoding step of an encoder-decoder: the next token's logits and the grown self-attention cache,
    from the encoder's states, the source's mask and the past keys and values (``[layers, B, H, past, D]``)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, decoder_input_ids, encoder_hidden_states, attention_mask, past_keys, past_values):
        pairs = [(past_keys[i], past_values[i]) for i in range(past_keys.shape[0])]
        past = DynamicCache(pairs)  # grown in place by the forward
        cache = EncoderDecoderCache(past, DynamicCache())
        out = self.model(
            decoder_input_ids=decoder_input_ids, encoder_outputs=(encoder_hidden_states,), attention_mask=attention_mask,
            cache=cache, use_cache=True,
        )
        return (out.logits, torch.stack([layer.keys for layer in past.layers]),
                torch.stack([layer.values for layer in past.layers]))


def _step_inputs(config, batch: int, source: int, past: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    _, mask = _tokens(batch, source, seed)
    cached = (config.num_decoder_layers, batch, config.num_attention_heads, past, config.head_dim)
    return (
        torch.randint(1, VOCAB, (batch, 1), generator=g),
        torch.randn(batch, source, config.hidden_size, generator=g),
        mask,
        torch.randn(cached, generator=g),
        torch.randn(cached, generator=g),
    )


STEP_SHAPES = ({0: BATCH}, {0: BATCH, 1: LENGTH}, {0: BATCH, 1: LENGTH},
               {1: BATCH, 3: Dim("past", min=1, max=50)}, {1: BATCH, 3: Dim("past", min=1, max=50)})


def _wrapped(kind: str, scheme: str):
    """``(module, traced inputs, other inputs, dynamic_shapes)`` of one class."""
    if kind == "decoder_step":
        model = make_model(RelPosForConditionalGeneration, scheme, "sdpa", preset="seq2seq", num_decoder_layers=1,
                           **ONE_LAYER)
        return (_DecoderStep(model).eval(), _step_inputs(model.config, 3, 9, 5, 0), _step_inputs(model.config, 2, 12, 7, 1),
                STEP_SHAPES)
    if kind == "encoder":
        model = make_model(RelPosForConditionalGeneration, scheme, "sdpa", preset="seq2seq", num_decoder_layers=1,
                           **ONE_LAYER)
        module = _Outputs(model.encoder, "last_hidden_state")
    elif kind == "model":
        module = _Outputs(make_model(RelPosModel, scheme, "sdpa", preset="modeling", **ONE_LAYER), "last_hidden_state",
                          use_cache=False)
    elif kind == "sequence_classification":
        model = make_model(RelPosForSequenceClassification, scheme, "sdpa", preset="modeling", num_labels=3, **ONE_LAYER)
        module = _Outputs(model, "logits")
    else:
        module = _Outputs(make_model(RelPosForCausalLM, scheme, "sdpa", preset="modeling", **ONE_LAYER), "logits",
                          use_cache=False)
    shapes = {"input_ids": {0: BATCH, 1: LENGTH}, "attention_mask": {0: BATCH, 1: LENGTH}}
    return module.eval(), _tokens(3, 9, 0), _tokens(2, 14, 1), shapes


def _difference(got, want, inputs, kind: str) -> float:
    """Max |got - want| over every output, on the tokens that are not padding ([B, L, ...] outputs)."""
    got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
    worst = 0.0
    for g, w in zip(got, want):
        assert g.shape == w.shape
        diff = (g - w).abs()
        if kind != "decoder_step" and diff.dim() == 3:
            diff = diff.masked_fill(~inputs[1].bool()[..., None], 0.0)
        worst = max(worst, diff.max().item())
    return worst


@functools.lru_cache(maxsize=None)
def _exported(kind: str, scheme: str):
    """``_wrapped``'s and its ``torch.export`` program, made once for both tests (the ONNX exporter takes it)."""
    module, traced, other, shapes = _wrapped(kind, scheme)
    return module, traced, other, torch.export.export(module, traced, dynamic_shapes=shapes)


CASES = [(kind, s) for kind in ("causal_lm", "model") for s in ENCODINGS]
CASES += [("sequence_classification", s) for s in ENCODINGS]
CASES += [(kind, s) for kind in ("encoder", "decoder_step") for s in SEQ2SEQ]


@pytest.mark.parametrize("kind,scheme", CASES)
def test_torch_export_with_padding_and_dynamic_shapes_equals_eager(kind, scheme):
    module, traced, other, program = _exported(kind, scheme)
    with torch.no_grad():
        want = module(*other)
        got = program.module()(*other)
    assert _difference(got, want, other, kind) < 1e-5


def test_the_fast_paths_step_aside_only_under_export():
    from hf_relpos import kernels_relpos

    q = torch.randn(1, 2, 600, 8)
    assert not _exporting()
    assert kernels_relpos.fused_bias_applies(q) and kernels_relpos.txl_chunked_applies()
    assert kernels_relpos.fire_mlp_applies()
    assert kernels_relpos.shaw_banded_applies(q, q, q, 3)

    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append((_exporting(), kernels_relpos.fused_bias_applies(x),
                         kernels_relpos.shaw_banded_applies(x, x, x, 3), kernels_relpos.txl_chunked_applies(),
                         kernels_relpos.fire_mlp_applies()))
            return x + 1

    torch.export.export(Probe(), (q,))
    assert seen == [(True, False, False, False, False)]


ONNX_CASES = [("causal_lm", s) for s in ENCODINGS] + [("sequence_classification", "alibi"), ("decoder_step", "t5_bias"),
                                                       ("encoder", "transformer_xl")]


@pytest.mark.parametrize("kind,scheme", ONNX_CASES)
def test_onnx_runs_in_onnxruntime_with_padding_and_dynamic_shapes(kind, scheme, tmp_path):
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    module, traced, other, exported = _exported(kind, scheme)
    # The exported program (with its dynamic shapes) is what torch.onnx.export(module, ..., dynamo=True) makes first.
    program = torch.onnx.export(exported, verbose=False, optimize=False)
    program.save(str(tmp_path / "model.onnx"))
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    got = [torch.from_numpy(x) for x in session.run(None, {n: t.numpy() for n, t in zip(names, other)})]
    with torch.no_grad():
        want = module(*other)
    assert _difference(got if len(got) > 1 else got[0], want, other, kind) <= 1e-4


@pytest.mark.parametrize("scheme,causal", [("rope", True), ("learned", False)])
def test_onnx_padding_rows_give_eagers_zeros(scheme, causal, tmp_path):
    """A query with no key left (left padding under causality; a row that is all padding) gives zero attention in
    eager SDPA; the ONNX translation of SDPA with a boolean mask averages the masked values instead."""
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    cls, field = (RelPosForCausalLM, "logits") if causal else (RelPosModel, "last_hidden_state")
    overrides = {} if causal else dict(is_decoder=False)
    module = _Outputs(make_model(cls, scheme, "sdpa", preset="modeling", **ONE_LAYER, **overrides), field,
                      use_cache=False).eval()
    shapes = {"input_ids": {0: BATCH, 1: LENGTH}, "attention_mask": {0: BATCH, 1: LENGTH}}
    torch.onnx.export(module, _tokens(3, 9, 0), dynamo=True, dynamic_shapes=shapes, verbose=False,
                      optimize=False).save(str(tmp_path / "model.onnx"))
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    ids, mask = _tokens(3, 12, 1)
    mask[0] = 0  # a row that is all padding
    (got,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    with torch.no_grad():
        want = module(ids, mask)
    assert (torch.from_numpy(got) - want).abs().max().item() <= 1e-4  # every position, padding included
