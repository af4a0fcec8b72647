"""Upstream T5 checkpoints as hf_relpos encoder-decoders: ``from_t5`` and the folder conversion behind
``hf-relpos convert-t5``.

T5 (Raffel et al. 2020) is an encoder-decoder with hf_relpos' ``t5_bias`` scheme, RMS norms before each
sub-layer, and attention without the ``1/sqrt(d)`` factor: ``softmax(q·k + b)``, which the converted model keeps
as ``attention_scale=1.0``. Every weight is copied as it is, so the converted model has T5's parameters, gradients
and optimiser steps: v1.0's ReLU MLP (``wi``, ``wo``) and tied output layer with its ``d_model**-0.5`` rescaling
(``scale_decoder_outputs``), v1.1/Flan's gated-GELU MLP (``wi_0`` as the gate, ``wi_1``) and untied output layer,
and any ``num_heads * d_kv`` (``head_dim``). (Conversions before ``attention_scale`` folded ``sqrt(head_dim)``
into the query projections instead: the same outputs, but Adam moved those queries ``sqrt(head_dim)`` times
slower than T5's; such folders keep loading as they are.)
"""

from __future__ import annotations

import copy

import torch

from .configuration_relpos import RelPosConfig
from .modeling_relpos import RelPosForConditionalGeneration, RelPosModel

# The upstream classes from_t5 converts, by name (checked against Transformers' own class), and what each becomes:
# an encoder-decoder (T5 v1.0, v1.1, Flan, ByT5 are model type "t5"; mT5 has v1.1's layout) or an encoder alone.
# UMT5 keeps a bias table in every layer: relative_attention_per_layer.
SEQ2SEQ_CLASSES = ("T5ForConditionalGeneration", "MT5ForConditionalGeneration", "UMT5ForConditionalGeneration")
ENCODER_CLASSES = ("T5EncoderModel", "MT5EncoderModel", "UMT5EncoderModel")
# Refused by name, in one line: never converted wrongly.
REFUSED_CLASSES = {
    "LongT5": "LongT5's local and transient-global attention is another attention function than T5's",
}


def _kind(model) -> str:
    """"seq2seq" or "encoder" for an upstream class from_t5 converts; ValueError in one line for any other."""
    import transformers

    name = type(model).__name__
    for family, reason in REFUSED_CLASSES.items():
        if name.startswith(family):
            raise ValueError(f"from_t5 does not convert {name}: {reason}")
    for kind, names in (("seq2seq", SEQ2SEQ_CLASSES), ("encoder", ENCODER_CLASSES)):
        if any(isinstance(model, getattr(transformers, n)) for n in names):
            return kind
    raise ValueError(f"from_t5 takes one of {', '.join(SEQ2SEQ_CLASSES + ENCODER_CLASSES)} (transformers), got {name}")


def t5_config_to_relpos(t5_config, *, tied: bool, encoder_only: bool = False) -> RelPosConfig:
    """The RelPosConfig of a converted T5: T5's field names mapped onto hf_relpos' (``tied``: the upstream
    model's output layer is its token table; ``encoder_only``: a bidirectional encoder alone, as
    ``T5EncoderModel``)."""
    if encoder_only:
        # pad_token_id None: hf_relpos' encoder would give the pad id a padding row that never trains, T5's trains
        return RelPosConfig(**{**_t5_fields(t5_config), "pad_token_id": None}, is_decoder=False,
                            tie_word_embeddings=False, dropout_placement="t5", eos_token_id=t5_config.eos_token_id)
    start = t5_config.decoder_start_token_id
    return RelPosConfig(
        **_t5_fields(t5_config),
        is_encoder_decoder=True,
        is_decoder=False,
        num_decoder_layers=t5_config.num_decoder_layers,
        tie_word_embeddings=tied,
        scale_decoder_outputs=_scales_decoder_outputs(t5_config),
        eos_token_id=t5_config.eos_token_id,
        decoder_start_token_id=t5_config.pad_token_id if start is None else start,
    )


def _scales_decoder_outputs(t5_config) -> bool:
    """Whether upstream multiplies the decoder's output by ``d_model**-0.5`` before the output layer: T5 v1.0's
    ``scale_decoder_outputs``; mT5 never does; UMT5 before Transformers 5.25 has no such field and always does
    (its config forces ``tie_word_embeddings``, which its forward reads)."""
    fallback = t5_config.model_type == "umt5" and t5_config.tie_word_embeddings
    return bool(getattr(t5_config, "scale_decoder_outputs", fallback))


def _t5_fields(t5_config) -> dict:
    """The fields an encoder-decoder and an encoder alone share."""
    return dict(
        position_encoding="t5_bias",
        vocab_size=t5_config.vocab_size,
        hidden_size=t5_config.d_model,
        head_dim=t5_config.d_kv,
        num_attention_heads=t5_config.num_heads,
        intermediate_size=t5_config.d_ff,
        num_hidden_layers=t5_config.num_layers,
        relative_attention_num_buckets=t5_config.relative_attention_num_buckets,
        relative_attention_max_distance=t5_config.relative_attention_max_distance,
        relative_attention_per_layer=t5_config.model_type == "umt5",  # every UMT5 layer has its own table
        feed_forward_proj=t5_config.feed_forward_proj,
        rms_norm_eps=t5_config.layer_norm_epsilon,
        hidden_dropout=float(t5_config.dropout_rate),
        attention_dropout=float(t5_config.dropout_rate),
        initializer_range=t5_config.initializer_factor * 0.02,
        initialization="t5",  # a weight the model starts afresh (a resized token table) starts as T5's would
        pad_token_id=t5_config.pad_token_id,
        attention_bias=False,
        attention_scale=1.0,  # T5 attends without 1/sqrt(d_kv)
    )


def _t5_state_dict_to_relpos(state: dict, config: RelPosConfig) -> dict:
    """Upstream T5 parameter names -> hf_relpos names (the same tensors): an encoder-decoder's, or with a config
    that is not one (``T5EncoderModel``), an encoder's alone."""
    if not config.is_encoder_decoder:
        out = {"embed_tokens.weight": state["shared.weight"]}
        out.update(_t5_stack(state, config, "encoder", config.num_hidden_layers, prefix=""))
        return out
    out = {"shared.weight": state["shared.weight"]}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    out.update(_t5_stack(state, config, "encoder", config.num_hidden_layers, prefix="encoder."))
    out.update(_t5_stack(state, config, "decoder", config.num_decoder_layers, prefix="decoder."))
    return out


def _t5_stack(state: dict, config: RelPosConfig, stack: str, layers: int, prefix: str) -> dict:
    """One upstream stack (``encoder`` or ``decoder``) as hf_relpos names under ``prefix``."""
    _, gated = config.mlp_activation
    out = {f"{prefix}norm.weight": state[f"{stack}.final_layer_norm.weight"]}
    table = "SelfAttention.relative_attention_bias.weight"
    if not config.relative_attention_per_layer:  # T5's one table, in its first layer
        out[f"{prefix}position.relative_attention_bias.weight"] = state[f"{stack}.block.0.layer.0.{table}"]
    for i in range(layers):
        block, layer = f"{stack}.block.{i}.layer", f"{prefix}layers.{i}"
        if config.relative_attention_per_layer:  # UMT5: one in each layer
            out[f"{prefix}position.layers.{i}.relative_attention_bias.weight"] = state[f"{block}.0.{table}"]
        attentions = [("0.SelfAttention", "self_attn")]
        if stack == "decoder":
            attentions.append(("1.EncDecAttention", "encoder_attn"))
            out[f"{layer}.encoder_attn_layernorm.weight"] = state[f"{block}.1.layer_norm.weight"]
        for upstream, ours in attentions:
            for name in "qkvo":
                out[f"{layer}.{ours}.{name}_proj.weight"] = state[f"{block}.{upstream}.{name}.weight"]
        out[f"{layer}.input_layernorm.weight"] = state[f"{block}.0.layer_norm.weight"]
        ff = f"{block}.{2 if stack == 'decoder' else 1}"
        out[f"{layer}.post_attention_layernorm.weight"] = state[f"{ff}.layer_norm.weight"]
        if gated:
            out[f"{layer}.mlp.gate_proj.weight"] = state[f"{ff}.DenseReluDense.wi_0.weight"]
            out[f"{layer}.mlp.up_proj.weight"] = state[f"{ff}.DenseReluDense.wi_1.weight"]
        else:
            out[f"{layer}.mlp.up_proj.weight"] = state[f"{ff}.DenseReluDense.wi.weight"]
        out[f"{layer}.mlp.down_proj.weight"] = state[f"{ff}.DenseReluDense.wo.weight"]
    return out


def from_t5(model, *, check: bool = True):
    """An hf_relpos model with the same outputs as the upstream T5 ``model``: ``RelPosForConditionalGeneration``
    (the same logits and ``generate`` outputs) for ``T5ForConditionalGeneration`` (v1.0, v1.1, Flan, ByT5) and
    ``MT5ForConditionalGeneration``, ``RelPosModel`` (the same ``last_hidden_state``; ``AutoModel`` loads it) for
    ``T5EncoderModel`` and ``MT5EncoderModel``. Every weight is copied as it is, and T5's attention without
    ``1/sqrt(d_kv)`` is the converted config's ``attention_scale=1.0``: the same parameters, gradients and
    optimiser steps. UMT5ForConditionalGeneration and UMT5EncoderModel convert the same way, with a bias table per
    layer (``relative_attention_per_layer``). Any other class (LongT5 among them) is a one-line ``ValueError``.

    With ``check`` (the default) the conversion is verified before it is returned: ``check_t5_parity`` runs both
    models in fp32 and eval mode on random padded inputs and raises ``ValueError`` naming what differs (logits,
    greedy or beam-search tokens; an encoder's hidden states at every real token). A model in another dtype is
    checked through fp32 copies (twice its fp32 size in memory for the check); ``check=False`` skips it."""
    _kind(model)
    converted = _convert(model)
    if check:
        if model.dtype == torch.float32:
            check_t5_parity(model, converted)
        else:  # the mapping is what is checked, not the rounding of a lower precision
            reference = copy.deepcopy(model).float()
            check_t5_parity(reference, _convert(reference))
    return converted


def _convert(model):
    encoder_only = _kind(model) == "encoder"
    tied = not encoder_only and model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr()
    config = t5_config_to_relpos(model.config, tied=tied, encoder_only=encoder_only)
    weight = model.shared.weight
    cls = RelPosModel if encoder_only else RelPosForConditionalGeneration
    converted = cls(config).to(device=weight.device, dtype=weight.dtype)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    missing, unexpected = converted.load_state_dict(_t5_state_dict_to_relpos(state, config), strict=False)
    # The stacks' token tables (and a tied output layer) are the shared table, absent from the mapping.
    missing = [k for k in missing if k not in converted.get_expanded_tied_weights_keys()]
    if missing or unexpected:
        raise ValueError(f"T5 conversion left parameters unmapped: missing {missing}, unexpected {unexpected}")
    if not encoder_only:
        converted.generation_config = copy.deepcopy(model.generation_config)  # its own: editing one leaves the other
    if model.config._attn_implementation in ("eager", "sdpa", "flex_attention"):  # else hf_relpos' default
        converted.set_attn_implementation(model.config._attn_implementation)
    return converted.train(model.training)


# The upstream kinds the conversion is checked on (tests, ``hf-relpos validate-t5``): T5 v1.0, v1.1 / Flan, a shape
# whose attention width ``num_heads * d_kv`` is not ``d_model`` with fewer decoder than encoder layers, and ByT5's.
T5_KINDS = {
    "v1.0 (ReLU, tied output rescaled)": dict(feed_forward_proj="relu", tie=True),
    "v1.1/Flan (gated GELU, untied)": dict(feed_forward_proj="gated-gelu", tie=False),
    "num_heads*d_kv != d_model": dict(feed_forward_proj="gated-gelu", tie=False, num_heads=3, d_kv=6,
                                      num_decoder_layers=1),
    # ByT5: a byte vocabulary (3 special ids + 256 bytes + 125 sentinels) and an encoder 3x deeper than its decoder
    "ByT5 (bytes, deep encoder)": dict(feed_forward_proj="gated-gelu", tie=False, vocab_size=384, num_layers=3,
                                       num_decoder_layers=1),
}


def random_t5(kind: str, seed: int = 0, upstream_class: str = "T5ForConditionalGeneration"):
    """A small upstream model of one of ``T5_KINDS`` (``upstream_class``: any of ``SEQ2SEQ_CLASSES`` and
    ``ENCODER_CLASSES``), every weight re-randomised (norm scales, bias tables and the output layer included) so
    that a misplaced weight changes the outputs."""
    import transformers

    spec = dict(T5_KINDS[kind])
    tie = spec.pop("tie")
    spec = {"num_heads": 4, "d_kv": 8, **spec}
    torch.manual_seed(seed)
    family = next((f for f in ("UMT5", "MT5") if upstream_class.startswith(f)), "T5")
    config_class = getattr(transformers, f"{family}Config")
    sizes = dict(vocab_size=99, d_model=32, d_ff=64, num_layers=2, relative_attention_num_buckets=8,
                 relative_attention_max_distance=20)
    config = config_class(
        **{**sizes, **spec}, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        dropout_rate=0.0, tie_word_embeddings=tie,  # upstream: tie_word_embeddings=False -> no rescaling
    )
    model = getattr(transformers, upstream_class)(config).eval()
    with torch.no_grad():
        if not tie and hasattr(model, "lm_head"):  # upstream ties whatever the config says: untie as v1.1 is
            model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight))
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.uniform_(0.5, 1.5)
            elif "relative_attention_bias" in name:
                param.normal_(0.0, 0.3)
            elif name == "lm_head.weight":
                param.normal_(0.0, 0.05)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    return model


def t5_parity(upstream, converted, seed: int = 0) -> dict:
    """The converted model against upstream on random padded inputs: the largest logit difference (and the
    logits' scale), and whether greedy and beam-search outputs are identical. An encoder alone: its
    ``last_hidden_state`` at every real (not padding) token, in the same keys (no decoding: both count as identical)."""
    if not converted.config.is_encoder_decoder:
        return _encoder_parity(upstream, converted, seed)
    generator = torch.Generator().manual_seed(seed)
    vocab = upstream.config.vocab_size
    source = torch.randint(2, vocab, (3, 30), generator=generator)
    source_mask = torch.ones_like(source)
    source_mask[1, :5] = 0  # left padding
    source_mask[2, -7:] = 0  # right padding
    target = torch.randint(2, vocab, (3, 25), generator=generator)
    target_mask = torch.ones_like(target)
    target_mask[0, -4:] = 0
    device = upstream.device  # the inputs are drawn on the CPU (the same on every device), then moved
    source, source_mask, target, target_mask = (t.to(device) for t in (source, source_mask, target, target_mask))
    inputs = dict(input_ids=source, attention_mask=source_mask, decoder_input_ids=target,
                  decoder_attention_mask=target_mask)
    with torch.no_grad():
        expected, got = upstream(**inputs).logits, converted(**inputs).logits
    decode = dict(input_ids=source, attention_mask=source_mask, max_new_tokens=10, do_sample=False)
    return {
        "max_abs_logit_diff": (expected - got).abs().max().item(),
        "max_abs_logit": expected.abs().max().item(),
        "greedy_identical": torch.equal(upstream.generate(**decode), converted.generate(**decode)),
        "beam_identical": torch.equal(upstream.generate(**decode, num_beams=3), converted.generate(**decode, num_beams=3)),
    }


def _encoder_parity(upstream, converted, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(2, upstream.config.vocab_size, (3, 30), generator=generator)
    mask = torch.ones_like(source)
    mask[1, :5] = 0  # left padding
    mask[2, -7:] = 0  # right padding
    device = next(converted.parameters()).device
    source, mask = source.to(device), mask.to(device)
    with torch.no_grad():
        expected = upstream(input_ids=source, attention_mask=mask).last_hidden_state
        got = converted(input_ids=source, attention_mask=mask).last_hidden_state
    real = mask.bool()
    return {"max_abs_logit_diff": (expected[real] - got[real]).abs().max().item(),
            "max_abs_logit": expected[real].abs().max().item(), "greedy_identical": True, "beam_identical": True}


# fp32: above the rounding of sdpa against eager (and of the folded 1/sqrt(d) of earlier conversions), relative
# to the logits' scale (a real checkpoint's logits reach tens).
LOGIT_TOLERANCE = 1e-5


def parity_holds(parity: dict) -> bool:
    """Logits within ``LOGIT_TOLERANCE`` (times the largest logit, when above 1), greedy and beam search identical."""
    tolerance = LOGIT_TOLERANCE * max(1.0, parity["max_abs_logit"])
    return parity["max_abs_logit_diff"] <= tolerance and parity["greedy_identical"] and parity["beam_identical"]


def check_t5_parity(upstream, converted, seed: int = 0) -> dict:
    """``t5_parity`` of both models in eval mode (their modes are restored); ``ValueError`` naming what differs."""
    modes = upstream.training, converted.training
    try:
        parity = t5_parity(upstream.eval(), converted.eval(), seed)
    finally:
        upstream.train(modes[0]), converted.train(modes[1])
    if not parity_holds(parity) and not converted.config.is_encoder_decoder:
        tolerance = LOGIT_TOLERANCE * max(1.0, parity["max_abs_logit"])
        raise ValueError(
            "the converted encoder does not reproduce the upstream T5 encoder (random padded inputs, fp32): max "
            f"|last_hidden_state diff| {parity['max_abs_logit_diff']:.2e} at the real tokens (tolerance {tolerance:.1e})"
        )
    if not parity_holds(parity):
        tolerance = LOGIT_TOLERANCE * max(1.0, parity["max_abs_logit"])
        raise ValueError(
            "the converted model does not reproduce the upstream T5 (random padded inputs, fp32): max |logit diff| "
            f"{parity['max_abs_logit_diff']:.2e} (tolerance {tolerance:.1e}), greedy "
            f"{'identical' if parity['greedy_identical'] else 'DIFFERENT'}, beam search "
            f"{'identical' if parity['beam_identical'] else 'DIFFERENT'}"
        )
    return parity


__all__ = [
    "from_t5", "t5_config_to_relpos", "random_t5", "t5_parity", "check_t5_parity", "parity_holds",
    "LOGIT_TOLERANCE", "T5_KINDS", "SEQ2SEQ_CLASSES", "ENCODER_CLASSES",
]
