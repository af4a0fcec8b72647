"""The tiny random models of the test suite, built in one place, and the inputs and comparisons of the model tests.

Plain functions, so that module-level ``parametrize`` lists and subprocess workers can call them; conftest.py
exposes them as the fixtures ``tiny_config``, ``make_model`` and ``scheme``. A preset names one set of sizes:
tests compare outputs across runs and backends, so each test keeps the exact config it was written with.
"""

import os

import pytest
import torch

from hf_relpos import POSITION_ENCODINGS, RelPosConfig
from hf_relpos.configuration_relpos import CAUSAL_ONLY

_BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
             # a wider init than 0.02 so that random models give varied, non-degenerate outputs
             initializer_range=0.3)
_WIDE_BUCKETS = dict(relative_attention_num_buckets=16, relative_attention_max_distance=32, max_relative_position=4)
PRESETS = {
    # test_integration, test_reliability, test_checkpoints, test_inspect (each passes its vocab_size)
    "default": dict(_BASE, **_WIDE_BUCKETS),
    # test_modeling, test_generation, test_position_schemes, test_transformers_behaviour, test_compat:
    # buckets small enough that sequences of ~10-20 tokens reach the log buckets and the clipping;
    # no eos, so that generation always runs max_new_tokens
    "modeling": dict(_BASE, vocab_size=61, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                     max_relative_position=3, pad_token_id=0, bos_token_id=None, eos_token_id=None),
    # test_seq2seq, test_compat: the modeling sizes as an encoder-decoder (3 decoder layers)
    "seq2seq": dict(_BASE, vocab_size=61, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                    max_relative_position=3, pad_token_id=0, eos_token_id=None, is_encoder_decoder=True,
                    num_decoder_layers=3, decoder_start_token_id=0),
    # test_memory: Transformer-XL at the default initializer_range (the caller gives position_encoding and mem_len)
    "memory": dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2, vocab_size=24),
}


def tiny_config(position_encoding: str, *, preset: str = "default", skip_causal_only: bool = True,
                **overrides) -> RelPosConfig:
    """The preset's config with ``overrides``; skips the test for a causal-only scheme asked to be bidirectional
    (``skip_causal_only=False`` lets RelPosConfig raise instead, for the validation tests)."""
    kwargs = dict(position_encoding=position_encoding, **PRESETS[preset])
    kwargs.update(overrides)
    if skip_causal_only and position_encoding in CAUSAL_ONLY and kwargs.get("is_decoder", True) is False:
        pytest.skip(f"{position_encoding} is defined for causal attention only (its config refuses is_decoder=False)")
    return RelPosConfig(**kwargs)


def triton_interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (conftest.py sets it where there is no GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def make_model(cls, scheme: str, impl: str | None = None, seed: int = 0, *, preset: str = "default", device="cpu",
               **overrides):
    """``cls`` on the preset's config, its weights drawn after ``torch.manual_seed(seed)``, in eval mode on
    ``device``; ``impl`` (eager / sdpa / ...) set through ``set_attn_implementation`` when given. A
    ``relpos_triton`` model on the CPU needs Triton's interpreter: without it (a GPU machine) the test is skipped,
    and test_triton_backend.py runs the kernel on the GPU instead."""
    if impl == "relpos_triton" and torch.device(device).type == "cpu" and not triton_interpreting():
        pytest.skip("relpos_triton on a CPU model runs under Triton's interpreter only (TRITON_INTERPRET=1)")
    config = tiny_config(scheme, preset=preset, **overrides)
    torch.manual_seed(seed)
    model = cls(config)
    if impl is not None:
        model.set_attn_implementation(impl)
        assert model.config._attn_implementation == impl
    return model.to(device).eval()


def build(position_encoding: str, cls=None, impl: str = "eager", seed: int = 0, **overrides):
    """A model of the "modeling" preset (RelPosForCausalLM unless ``cls``), eager unless ``impl``."""
    from hf_relpos import RelPosForCausalLM

    return make_model(cls or RelPosForCausalLM, position_encoding, impl, seed, preset="modeling", **overrides)


# ---------------------------------------------------------------------------
# Inputs, comparisons and decoding oracles of the model tests (test_modeling, test_generation,
# test_position_schemes, test_transformers_behaviour); token ids are drawn from the "modeling" preset's vocabulary.
# ---------------------------------------------------------------------------

ENCODINGS = tuple(POSITION_ENCODINGS)
IMPLS = ("eager", "sdpa")
VOCAB = PRESETS["modeling"]["vocab_size"]
ATOL = 1e-5
STATIC_OK = ENCODINGS  # StaticCache: Transformer-XL's too: its distances count from the last query, not the last key slot


def use_impl(model, impl: str):
    model.set_attn_implementation(impl)
    assert model.config._attn_implementation == impl
    return model


def rand_ids(batch: int, length: int, seed: int = 1, low: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB, (batch, length), generator=g)


def padding_mask(batch: int, length: int, side: str, pads=(0, 3, 5)) -> torch.Tensor:
    """Row b has ``pads[b % len(pads)]`` padding tokens on ``side``; row 0 is never padded."""
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        n = pads[b % len(pads)]
        if n:
            if side == "left":
                mask[b, :n] = 0
            else:
                mask[b, length - n :] = 0
    return mask


def assert_close(actual, expected, atol=ATOL, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert diff <= atol, f"{what}: max abs diff {diff:.3g} > {atol}"


def assert_close_where(actual, expected, keep, atol=ATOL, what=""):
    """Compare ``[B, L, ...]`` tensors only at positions where ``keep[b, l]`` is true."""
    keep = keep.bool()
    assert_close(actual[keep], expected[keep], atol=atol, what=what)


def cache_snapshot(cache):
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers if getattr(layer, "keys", None) is not None]


def assert_cache_unchanged(cache, length_before, snapshot):
    assert cache.get_seq_length() == length_before, "a failing call changed the cache length"
    after = cache_snapshot(cache)
    assert len(after) == len(snapshot), "a failing call added cache layers"
    for (k0, v0), (k1, v1) in zip(snapshot, after):
        assert torch.equal(k0, k1) and torch.equal(v0, v1), "a failing call changed the cached keys/values"


def manual_greedy(model, ids, steps, attention_mask=None):
    """Greedy decoding by full forwards without any cache: the oracle for generate()."""
    with torch.no_grad():
        for _ in range(steps):
            kwargs = {}
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask
            logits = model(ids, use_cache=False, **kwargs).logits[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)], dim=1)
    return ids


def greedy(model, ids, new, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, num_beams=1, **kwargs)


# Transformers 5.23 renamed gradient checkpointing "activation checkpointing" (model methods, TrainingArguments);
# the suite also runs on the oldest tested Transformers, which has only the old names.
def enable_checkpointing(model, use_reentrant=None):
    options = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def is_checkpointing(model) -> bool:
    return getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing


def checkpointing_argument() -> str:
    import inspect

    from transformers import TrainingArguments

    parameters = inspect.signature(TrainingArguments).parameters
    return "activation_checkpointing" if "activation_checkpointing" in parameters else "gradient_checkpointing"
