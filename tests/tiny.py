"""The tiny random model configuration shared by the integration and reliability tests."""

import pytest

from hf_relpos import RelPosConfig
from hf_relpos.configuration_relpos import CAUSAL_ONLY


def tiny_config(position_encoding: str, *, vocab_size: int, **overrides) -> RelPosConfig:
    kwargs = dict(
        position_encoding=position_encoding,
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        relative_attention_num_buckets=16,
        relative_attention_max_distance=32,
        max_relative_position=4,
        # a wider init than 0.02 so that random models give varied, non-degenerate outputs
        initializer_range=0.3,
    )
    kwargs.update(overrides)
    if position_encoding in CAUSAL_ONLY and kwargs.get("is_decoder", True) is False:
        pytest.skip(f"{position_encoding} is defined for causal attention only (its config refuses is_decoder=False)")
    return RelPosConfig(**kwargs)


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
