"""hf_relpos models: a pre-norm Transformer whose attention uses one of hf_relpos' position schemes.

Read top to bottom, in the order data flows: outputs, norm and MLP, attention (self-attention through the
scheme's seam, cross-attention), the decoder layer, the pre-trained base, ``RelPosModel`` and the heads
(causal LM, sequence classification, encoder-decoder). The schemes themselves, ``PositionContext`` and the
eager attention kernel live in ``position_schemes.py``.

Positions come from one place: ``RelPosModel.forward`` checks its inputs (``_check_inputs``), then
``PositionContext.from_inputs`` reads the query offset and the key range from the cache (and the
Transformer-XL memory) before the first layer and builds the mask from Transformers' mask functions; the
forward asks the scheme for its per-forward term once and hands both to every layer.
"""

import copy
import dataclasses
import inspect
import itertools
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import torch
from torch import nn

from transformers import PreTrainedConfig
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache, StaticCache
from transformers.generation import GenerationMixin
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPast,
    BaseModelOutputWithPastAndCrossAttentions,
    CausalLMOutputWithPast,
    Seq2SeqLMOutput,
    SequenceClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, load_state_dict, slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils.generic import TransformersKwargs, can_return_tuple
from transformers.utils.output_capturing import capture_outputs

from .configuration_relpos import RelPosConfig
from .model_card_relpos import model_card, write_card
from .position_schemes import (
    POSITION_SCHEMES,
    FireScheme,
    KerpleLogScheme,
    PositionContext,
    ShawRelative,
    TransformerXLRelative,
    cache_offsets,
    eager_attention_forward,
    is_fresh,
    unpadded,
)

SUPPORTED_ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


# ----------------------------------------------------------------------------------
# Keyword arguments, across Transformers versions
# ----------------------------------------------------------------------------------

# Transformers 5.24 renamed the cache `past_key_values` -> `cache` in model inputs and outputs, and `generate` passes
# the name of the installed version. Every forward here takes both names; outputs carry the cache in the field the
# installed version declares (`outputs.cache` from 5.24, `outputs.past_key_values` before), which is also the key
# under which `generate` keeps it in its model kwargs.
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"

# The keyword arguments Transformers defines for every model's forward (output flags, packed sequences, the loss's
# `num_items_in_batch`, ...) and those its token losses take, plus the `token_type_ids` that BERT-style tokenizers
# (and so pipelines and collators) hand every model: taken when they say one segment, refused otherwise. Anything
# else is a TypeError naming it, so that an argument renamed by the next Transformers fails at once instead of
# being ignored.
MODEL_KWARGS = frozenset(TransformersKwargs.__optional_keys__ | TransformersKwargs.__required_keys__) | {"token_type_ids"}
TOKEN_LOSS_KWARGS = frozenset({"num_items_in_batch", "ignore_index"})  # ForMaskedLMLoss (the encoder-decoder)
CAUSAL_LOSS_KWARGS = TOKEN_LOSS_KWARGS | {"shift_labels"}  # ForCausalLMLoss
# Continuous batching's step arguments (`PagedAttentionArgs`) beyond the model keyword arguments: the paged cache's
# indices, taken with a PagedAttentionCache only (its `logits_indices` and `logits_processor_args` are the causal LM
# head's).
PAGED_KWARGS = frozenset({"read_index", "write_index", "block_table"})


def continuous_batching_refusal(config) -> Optional[str]:
    """Why a model of ``config`` cannot take part in continuous batching (None when it can)."""
    if config.is_encoder_decoder:
        return (
            "is_encoder_decoder=True: continuous batching packs decoder-only requests in one row of a paged cache, "
            "and an encoder-decoder's source and cross-attention have no place there; use generate"
        )
    if not config.is_decoder:
        return "is_decoder=False: a bidirectional model does not decode token by token; continuous batching is causal"
    if config.position_encoding == "fox":
        return (
            "position_encoding='fox': FoX carries each token's forget gate in one more channel of its cached key, "
            "which the paged cache's blocks (sized head_dim) have no room for; use generate"
        )
    if config.position_encoding == "transformer_xl" and config.mem_len > 0:
        return (
            f"position_encoding='transformer_xl' with mem_len={config.mem_len}: Transformer-XL's memory (the hidden "
            "states of the previous segment) has no place in a paged cache of keys and values; use generate, or a "
            "model with mem_len=0"
        )
    return None


def _refuse_unknown_kwargs(owner: str, kwargs: dict, allowed: frozenset) -> None:
    """Raise ``TypeError`` for the first keyword argument of ``owner.forward`` outside ``allowed``, as Python does
    for a function without ``**kwargs``."""
    for name in kwargs:
        if name not in allowed:
            raise TypeError(
                f"{owner}.forward() got an unexpected keyword argument {name!r} (it takes its named arguments and "
                f"Transformers' model keyword arguments: {', '.join(sorted(allowed))})"
            )


def _split_loss_kwargs(owner: str, kwargs: dict, loss: frozenset) -> dict:
    """Check a head's keyword arguments (model ones and ``loss``'s) and take the loss-only ones out of ``kwargs``;
    returns what the loss gets (``num_items_in_batch`` stays in ``kwargs`` too: it is also a model argument)."""
    _refuse_unknown_kwargs(owner, kwargs, MODEL_KWARGS | PAGED_KWARGS | loss)  # the model checks the paged ones
    return {name: kwargs.pop(name) if name not in MODEL_KWARGS else kwargs[name] for name in loss if name in kwargs}


def _one_cache(cache: Optional[Cache], past_key_values: Optional[Cache]) -> Optional[Cache]:
    """The cache passed under its name from Transformers 5.24 (``cache``) or its earlier one (``past_key_values``),
    which warns as upstream models do where the installed Transformers has renamed it."""
    if past_key_values is None:
        return cache
    if cache is not None:
        import transformers

        raise ValueError(
            f"got a cache as cache= and another as past_key_values=: pass one (Transformers {transformers.__version__} "
            f"names it {CACHE_FIELD}; its generate passes its own cache under that name, so give yours as "
            f"{CACHE_FIELD}= there)"
        )
    if CACHE_FIELD == "cache" and not torch.compiler.is_compiling():
        warnings.warn(
            "`past_key_values` is deprecated: Transformers 5.24 renamed it `cache`; pass the cache as cache=",
            FutureWarning,
        )
    return past_key_values


# ----------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------


class _MemsLast:
    """``to_tuple`` in the order of the fields (``mems`` last), as upstream tuples are, even when
    ``capture_outputs`` fills ``hidden_states`` and ``attentions`` after the output was built."""

    def to_tuple(self) -> tuple:
        return tuple(self[f.name] for f in fields(self) if self.get(f.name) is not None)


@dataclass
class RelPosModelOutput(_MemsLast, BaseModelOutputWithPast):
    """``BaseModelOutputWithPast`` plus Transformer-XL's ``mems``."""

    mems: Optional[list] = None


@dataclass
class RelPosCausalLMOutput(_MemsLast, CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus Transformer-XL's ``mems``."""

    mems: Optional[list] = None


@dataclass
class RelPosSequenceClassifierOutput(_MemsLast, SequenceClassifierOutput):
    """``SequenceClassifierOutput`` plus Transformer-XL's ``mems``."""

    mems: Optional[list] = None


# ----------------------------------------------------------------------------------
# Norm and MLP
# ----------------------------------------------------------------------------------


class RelPosRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class RelPosMLP(nn.Module):
    """``down(act(up(x)))``, or with ``feed_forward_proj="gated-ACT"`` ``down(act(gate(x)) * up(x))`` (T5 v1.1)."""

    def __init__(self, config: RelPosConfig):
        super().__init__()
        act, gated = config.mlp_activation
        self.gate_proj = (
            nn.Linear(config.hidden_size, config.intermediate_size, bias=config.attention_bias) if gated else None
        )
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.attention_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.attention_bias)
        self.act_fn = ACT2FN[act]
        # An encoder-decoder drops the activations too, as T5's DenseReluDense (decoder-only models do not).
        self.dropout = nn.Dropout(config.hidden_dropout) if config.is_encoder_decoder else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.dropout(self.act_fn(self.up_proj(x))))
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))




# ----------------------------------------------------------------------------------
# Attention and decoder layer
# ----------------------------------------------------------------------------------


class RelPosAttention(nn.Module):
    def __init__(self, config: RelPosConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = config.is_decoder
        inner = config.num_attention_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=config.attention_bias)
        self.relative = POSITION_SCHEMES[config.position_encoding].layer_module(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        term: Any,
        ctx: PositionContext,
        memory: Optional[torch.Tensor] = None,
        cache: Optional[Cache] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        scheme = ctx.scheme
        batch, length, _ = hidden_states.shape
        shape = (batch, -1, self.num_heads, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        # Transformer-XL memory: keys and values also come from the (stop-gradient) previous segment.
        kv_input = hidden_states if memory is None else torch.cat([memory, hidden_states], dim=1)
        key = self.k_proj(kv_input).view(shape).transpose(1, 2)
        value = self.v_proj(kv_input).view(shape).transpose(1, 2)
        query, key = scheme.rotate(query, key, term, ctx)
        query, key = scheme.prepare(self, hidden_states, query, key, ctx)
        if ctx.paged is not None:  # a paged cache updates kwargs in place (this layer's cu_seq_lens_k): a copy each
            key, value = cache.update(key, value, self.layer_idx, dict(ctx.paged))
        elif cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        out, weights = scheme.attend(self, query, key, value, term, ctx)
        return self.o_proj(out.reshape(batch, length, -1)), weights


class RelPosCrossAttention(nn.Module):
    """An encoder-decoder's attention from decoder queries to the encoder's states, without a position
    term (as T5). Its keys and values are projected once per source and kept in the cross-attention cache."""

    def __init__(self, config: RelPosConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        inner = config.num_attention_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=config.attention_bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_mask: Optional[torch.Tensor],
        ctx: PositionContext,
        cache: Optional[EncoderDecoderCache] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        batch, length, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        cross_cache = cache.cross_attention_cache if cache is not None else None
        if cross_cache is not None and any(cross_cache.is_sliding[self.layer_idx : self.layer_idx + 1]):
            raise ValueError(
                "cache.cross_attention_cache has sliding-window layers (a cache built from a config with "
                "sliding_window): they would keep only the last source tokens. Build it without the window, e.g. "
                "EncoderDecoderCache(DynamicCache(config=config), DynamicCache()), as generate does"
            )
        if cross_cache is not None and cache.is_updated.get(self.layer_idx):
            key, value = cross_cache.layers[self.layer_idx].keys, cross_cache.layers[self.layer_idx].values
        else:
            shape = (batch, -1, self.num_heads, self.head_dim)
            key = self.k_proj(encoder_hidden_states).view(shape).transpose(1, 2)
            value = self.v_proj(encoder_hidden_states).view(shape).transpose(1, 2)
            if cross_cache is not None:
                key, value = cross_cache.update(key, value, self.layer_idx)
                cache.is_updated[self.layer_idx] = True
        interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(ctx.attn_implementation, eager_attention_forward)
        out, weights = interface(
            self, query, key, value, encoder_mask,
            dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling, is_causal=False,
        )
        if encoder_mask is not None:
            # A source that is all padding leaves a query no key: zeros, never NaN (as the self-attention paths).
            out = out * encoder_mask.any(dim=-1, keepdim=True).transpose(1, 2).to(out.dtype)
        return self.o_proj(out.reshape(batch, length, -1)), weights


class RelPosDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm: self-attention with the position scheme, then (an encoder-decoder's decoder) cross-attention
    to the encoder's states, then the MLP; each adds to the residual stream."""

    def __init__(self, config: RelPosConfig, layer_idx: int):
        super().__init__()
        self.self_attn = RelPosAttention(config, layer_idx)
        self.input_layernorm = RelPosRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.is_encoder_decoder and config.is_decoder:
            self.encoder_attn = RelPosCrossAttention(config, layer_idx)
            self.encoder_attn_layernorm = RelPosRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = RelPosMLP(config)
        self.post_attention_layernorm = RelPosRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        term: Any,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        ctx: PositionContext = None,
        memory: Optional[torch.Tensor] = None,
        cache: Optional[Cache] = None,
        encoder_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        residual = hidden_states
        normed_memory = None if memory is None else self.input_layernorm(memory)
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), term, ctx, normed_memory, self_cache
        )
        hidden_states = residual + self.dropout(hidden_states)
        if encoder_hidden_states is not None:
            residual = hidden_states
            cross_cache = cache if isinstance(cache, EncoderDecoderCache) else None
            hidden_states, _ = self.encoder_attn(
                self.encoder_attn_layernorm(hidden_states), encoder_hidden_states, encoder_mask, ctx, cross_cache
            )
            hidden_states = residual + self.dropout(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + self.dropout(hidden_states)


# ----------------------------------------------------------------------------------
# Loading: the config checked against the checkpoint before anything is allocated
# ----------------------------------------------------------------------------------

# Transformers builds the model on the meta device, reads the weights and only then allocates every parameter the
# checkpoint lacks or holds at another size (to report it): a config.json whose max_relative_position is 1e9 asked
# for 64 GB before any error, and num_hidden_layers=1e6 spent minutes building the meta model. So `from_pretrained`
# first reads the checkpoint's header (shapes only) and compares it with the shapes the config gives.

# The config fields that size each dimension of each parameter (by the end of its name), to name the field when a
# config does not describe its checkpoint (tests/test_loading_safety.py checks that every parameter matches one).
_HEADS = ("num_attention_heads", "head_dim")
_PARAMETER_FIELDS = (
    (r"(embed_tokens|shared|lm_head)\.weight", (("vocab_size",), ("hidden_size",))),
    (r"(q_proj|k_proj|v_proj|r_net)\.weight", (_HEADS, ("hidden_size",))),
    (r"(q_proj|k_proj|v_proj)\.bias", (_HEADS,)),
    (r"o_proj\.weight", (("hidden_size",), _HEADS)),
    (r"(o_proj|down_proj)\.bias|\w*norm\.weight", (("hidden_size",),)),
    (r"(up_proj|gate_proj)\.weight", (("intermediate_size",), ("hidden_size",))),
    (r"(up_proj|gate_proj)\.bias", (("intermediate_size",),)),
    (r"down_proj\.weight", (("hidden_size",), ("intermediate_size",))),
    (r"r_[wr]_bias", (("num_attention_heads",), ("head_dim",))),
    (r"rel_[kv]", (("max_relative_position",), ("head_dim",))),
    (r"position_embeddings\.weight", (("max_position_embeddings",), ("hidden_size",))),
    (r"relative_attention_bias\.weight", (("relative_attention_num_buckets",), ("num_attention_heads",))),
    (r"position\.r[12]|position\.mlp\.2\.bias", (("num_attention_heads",),)),
    (r"position\.mlp\.0\.weight", (("fire_mlp_width",), ())),
    (r"position\.mlp\.0\.bias", (("fire_mlp_width",),)),
    (r"position\.mlp\.2\.weight", (("num_attention_heads",), ("fire_mlp_width",))),
    (r"position\.(c|threshold_scale)", ()),
    (r"fgate_proj\.weight", (("num_attention_heads",), ("hidden_size",))),  # FoX's forget gate
    (r"fgate_proj\.bias", (("num_attention_heads",),)),
    (r"score\.weight", (("num_labels",), ("hidden_size",))),
)
# What a checkpoint may lack (parameters Transformers creates and initialises, non-persistent buffers): as many
# values as it holds, and at least this many (a new classification head or position table on a tiny model).
MISSING_VALUES_FLOOR = 1 << 24


class CheckpointMismatchError(ValueError, RuntimeError):
    """A config that does not describe its checkpoint: a ValueError (a wrong input, named), and the RuntimeError
    Transformers' ``from_pretrained`` raises for weights of another size (its common model tests expect that)."""


def parameter_fields(name: str) -> Optional[tuple]:
    """The config fields sizing each dimension of the parameter ``name`` (None: not a parameter of these models)."""
    for pattern, dims in _PARAMETER_FIELDS:
        if re.search(rf"(^|\.)({pattern})$", name):
            return dims
    return None


def _named_fields(config, config_file: Optional[str], fields: list) -> str:
    """``RelPosConfig.<field>=<value>, ... in <config.json>`` (or ``in the config given`` where the file does not
    hold that value: a config object or a keyword argument of ``from_pretrained`` set it)."""
    if not fields:
        return "the config"
    named = "RelPosConfig." + ", ".join(f"{field}={getattr(config, field)}" for field in fields)
    if config_file is not None:
        try:
            with open(config_file) as file:
                saved = json.load(file)
        except (OSError, ValueError):
            saved = {}
        if saved.get(fields[0]) == getattr(config, fields[0]):
            return f"{named} in {config_file}"
    return f"{named} in the config given"


def _fields_sizing(name: str, shape: tuple, held: Optional[tuple] = None) -> list:
    """The config fields sizing the dimensions of parameter ``name`` that differ from ``held`` (all without)."""
    dims = parameter_fields(name)
    if dims is None or len(dims) != len(shape):
        return []
    differ = [i for i in range(len(shape)) if held is None or len(held) != len(shape) or held[i] != shape[i]]
    return list(dict.fromkeys(field for i in differ for field in dims[i])) or [f for dim in dims for f in dim]


def _add_variant(name: str, variant: Optional[str]) -> str:
    """``model.safetensors`` -> ``model.<variant>.safetensors``, as Transformers names a variant's files."""
    if not variant:
        return name
    stem, extension = name.rsplit(".", 1)
    return f"{stem}.{variant}.{extension}"


def _checkpoint_files(folder: str, subfolder: str, variant, use_safetensors, config) -> Optional[tuple[list, str]]:
    """The weight files ``from_pretrained`` reads in a local ``folder`` (as Transformers 5.23 resolves them), and the
    name to report; None where there are none (Transformers then says so)."""
    base = os.path.join(folder, subfolder or "")
    explicit = getattr(config, "transformers_weights", None)
    if explicit is not None:
        if not isinstance(explicit, str):
            raise ValueError(f"RelPosConfig.transformers_weights must be a file name in the folder, got {explicit!r}")
        if not _inside(base, explicit) or not explicit.endswith((".safetensors", ".safetensors.index.json")):
            return None  # Transformers refuses a file outside the folder, or of another kind
        names = [explicit]
    else:
        names = []
        if use_safetensors is not False:
            names += [_add_variant("model.safetensors", variant), _add_variant("model.safetensors.index.json", variant)]
        if not use_safetensors:
            names += [_add_variant("pytorch_model.bin", variant), _add_variant("pytorch_model.bin.index.json", variant)]
    for name in names:
        path = os.path.join(base, name)
        if not os.path.isfile(path):
            continue
        if not name.endswith(".json"):  # an index: model.safetensors.index.json, or .index.<variant>.json
            return [path], path
        with open(path) as index:
            weight_map = json.load(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{path} is not a weights index: it needs a weight_map naming each parameter's file")
        kind = "safetensors" if ".safetensors" in name else "bin"  # as the index's own name
        for shard in weight_map.values():  # read here before Transformers reads them: only the folder's own files
            if not _inside(base, shard) or not shard.endswith(f".{kind}"):
                raise ValueError(f"{path} names {shard!r} as a weights file: it must be a .{kind} file in the folder")
        return [os.path.join(base, shard) for shard in sorted(set(weight_map.values()))], path
    return None


def _inside(base: str, name: str) -> bool:
    return os.path.abspath(os.path.join(base, name)).startswith(os.path.abspath(base) + os.sep)


def _check_checkpoint_fits(cls, folder, kwargs: dict) -> None:
    """Raise ``ValueError`` naming the config field when the config asks for a parameter of another shape than the
    checkpoint's, or for more values the checkpoint lacks than it holds (``MISSING_VALUES_FLOOR`` at least).

    Reads the local folder's config and the weight files' headers (or a ``state_dict``'s shapes) and builds the
    model on the meta device with no more layers than the checkpoint holds; a Hub id is left to Transformers.
    """
    state_dict, config = kwargs.get("state_dict"), kwargs.get("config")
    subfolder = kwargs.get("subfolder") or ""
    local = folder is not None and os.path.isdir(folder)
    if kwargs.get("gguf_file") is not None or (state_dict is None and not local):
        return
    if isinstance(config, PreTrainedConfig):  # AutoConfig records the folder it read as name_or_path
        config_file = os.path.join(config.name_or_path or "", subfolder, "config.json") if config.name_or_path else None
    else:
        config_file = config if config is not None else folder
        if config_file is None or not os.path.exists(config_file):
            return
        if os.path.isdir(config_file):
            config_file = os.path.join(config_file, subfolder, "config.json")
            if not os.path.isfile(config_file):  # an adapter's folder: Transformers loads the base model it names
                return
        # The kwargs that set config fields, as Transformers passes them to the config (dtype is the model's).
        names = {f.name for f in dataclasses.fields(cls.config_class)} | {"num_labels"}
        overrides = {k: v for k, v in kwargs.items() if k in names and k != "dtype"}
        config = cls.config_class.from_pretrained(config_file, **overrides)
    if state_dict is not None:
        shapes, where = {k: tuple(v.shape) for k, v in state_dict.items()}, "the state_dict"
    else:
        found = _checkpoint_files(folder, subfolder, kwargs.get("variant"), kwargs.get("use_safetensors"), config)
        if found is None:
            return
        files, where = found
        shapes = {}
        for file in files:
            meta = load_state_dict(file, map_location="meta", weights_only=kwargs.get("weights_only", True))
            shapes.update((k, tuple(v.shape)) for k, v in meta.items())
    for pattern, replacement in (kwargs.get("key_mapping") or {}).items():  # as Transformers renames keys
        shapes = {re.sub(pattern, replacement, k): v for k, v in shapes.items()}
    _compare_shapes(cls, config, shapes, config_file, where, bool(kwargs.get("ignore_mismatched_sizes")))


def _compare_shapes(cls, config, shapes: dict, config_file, where: str, ignore_mismatched_sizes: bool) -> None:
    prefix = cls.base_model_prefix
    built, layers = copy.deepcopy(config), []
    for field, stack in cls._layer_stacks:
        pattern = re.compile(rf"^(?:{prefix}\.)?{stack}layers\.(\d+)\.")
        wanted = getattr(config, field)
        held = {int(m.group(1)) for key in shapes if (m := pattern.match(key))}
        count = max(1, min(wanted, len([i for i in held if i < wanted])))
        setattr(built, field, count)  # the meta model gets no more layers than the checkpoint holds
        layers.append((field, stack, pattern, wanted, count, len(held)))
    with torch.device("meta"):
        model = cls(built)
    missing, mismatched = [], []
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        shape = tuple(tensor.shape)
        key = next((k for k in (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")) if k in shapes), None)
        if key is None or (shapes[key] != shape and ignore_mismatched_sizes):
            missing.append((math.prod(shape), name, shape))
        elif shapes[key] != shape:
            mismatched.append((math.prod(shape), name, shape, shapes[key]))
    if mismatched:
        _, name, shape, held = max(mismatched, key=lambda m: m[0])
        raise CheckpointMismatchError(
            f"{_named_fields(config, config_file, _fields_sizing(name, shape, held))} gives {name} the shape "
            f"{list(shape)}, but {where} holds {list(held)}: the config does not describe this checkpoint"
        )
    lacking = sum(size for size, *_ in missing)
    extra = []
    for field, stack, pattern, wanted, count, held in layers:
        per_layer = sum(t.numel() for n, t in model.named_parameters() if (m := pattern.match(n)) and m.group(1) == "0")
        extra.append(((wanted - count) * per_layer, field, wanted, held))
        lacking += (wanted - count) * per_layer
    allowed = max(sum(math.prod(shape) for shape in shapes.values()), MISSING_VALUES_FLOOR)
    if lacking <= allowed:
        return
    bound = (
        f"the {lacking:,} values it lacks are more than a checkpoint may lack ({allowed:,}: as many as it holds, at "
        f"least {MISSING_VALUES_FLOOR:,})"
    )
    values, field, wanted, held = max(extra, key=lambda e: e[0])
    if not missing or values >= max(size for size, *_ in missing):
        raise CheckpointMismatchError(f"{_named_fields(config, config_file, [field])}, but {where} holds {held} layers: {bound}")
    _, name, shape = max(missing, key=lambda m: m[0])
    raise CheckpointMismatchError(
        f"{_named_fields(config, config_file, _fields_sizing(name, shape))} asks for {name} {list(shape)}, which "
        f"{where} does not hold: {bound}"
    )


# ----------------------------------------------------------------------------------
# Pre-trained base
# ----------------------------------------------------------------------------------

AUTO_MAP = {
    "AutoConfig": "configuration_relpos.RelPosConfig",
    "AutoModel": "modeling_relpos.RelPosModel",
    "AutoModelForCausalLM": "modeling_relpos.RelPosForCausalLM",
    "AutoModelForSequenceClassification": "modeling_relpos.RelPosForSequenceClassification",
    "AutoModelForSeq2SeqLM": "modeling_relpos.RelPosForConditionalGeneration",
}


class RelPosPreTrainedModel(PreTrainedModel):
    config_class = RelPosConfig
    config: RelPosConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["RelPosDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    # A decode step with a StaticCache traces into one graph (torch.compile fullgraph=True) for every scheme:
    # the cache's offset stays a tensor (PositionContext.traced_offset), never read on the host.
    _can_compile_fullgraph = True
    # Transformers' `capture_outputs` records these modules' outputs for `output_hidden_states` (each
    # layer's input, then the final normed state) and `output_attentions` (the attention's second output).
    _can_record_outputs = {"hidden_states": RelPosDecoderLayer, "attentions": RelPosAttention}
    # The layer stacks: the config field counting each one's layers, and its name before `layers.<i>.`.
    _layer_stacks = (("num_hidden_layers", ""),)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Transformers' ``from_pretrained``, after the config is checked against the checkpoint (a local folder or a
        ``state_dict``): a config asking for parameters of other shapes, or for far more than the checkpoint holds,
        is a ``ValueError`` naming the field before anything is allocated."""
        _check_checkpoint_fits(cls, pretrained_model_name_or_path, kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    @property
    def supports_context_parallel(self) -> bool:
        """Context parallelism shards the sequence and keeps only a plain causal mask: a position term
        in attention (a bias over global distances, Shaw's and Transformer-XL's terms) or a window would
        be dropped. Only schemes that act before attention, on position ids, survive it."""
        return self.config.position_encoding in ("rope", "sinusoidal", "learned") and self.config.sliding_window is None

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, nn.Linear) and getattr(module, "torch_default_init", False):
            init.kaiming_uniform_(module.weight, a=math.sqrt(5))  # nn.Linear.reset_parameters
            bound = 1 / math.sqrt(module.in_features)
            if module.bias is not None:
                init.uniform_(module.bias, -bound, bound)
        elif isinstance(module, (nn.Linear,)):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", std))
        elif isinstance(module, RelPosRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, ShawRelative):
            init.normal_(module.rel_k, mean=0.0, std=std)
            if module.rel_v is not None:
                init.normal_(module.rel_v, mean=0.0, std=std)
        elif isinstance(module, TransformerXLRelative):
            init.normal_(module.r_w_bias, mean=0.0, std=std)
            init.normal_(module.r_r_bias, mean=0.0, std=std)
        elif isinstance(module, KerpleLogScheme):
            # As KERPLE's code: r1 ~ U(0, 2), r2 ~ U(0, 1).
            init.uniform_(module.r1, 0.0, 2.0)
            init.uniform_(module.r2, 0.0, 1.0)
        elif isinstance(module, FireScheme):
            # As FIRE's code: c = 0.1, threshold multiplier 1 (the MLP's Linear layers are initialised above).
            init.constant_(module.c, 0.1)
            init.constant_(module.threshold_scale, 1.0)

    def _token_loss(self, logits, labels, **kwargs) -> torch.Tensor:
        """Transformers' loss of token logits (loss kwargs reach it); every label ignored gives 0, not NaN.
        An infinite or NaN loss of counted labels is returned as it is: only the labels tell the two apart."""
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        counted = kwargs.get("shift_labels")
        if counted is None:  # a causal LM's loss shifts its labels; ForMaskedLM's are aligned with the logits
            counted = labels if self.loss_type == "ForMaskedLM" else labels[..., 1:]
        if bool((counted != kwargs.get("ignore_index", -100)).any()):
            return loss
        return loss.nan_to_num(0.0)  # a mean over no label (0 / 0); its gradient is 0, as the logits' are

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save safetensors, the config with a complete ``auto_map``, the code files (remote code) and a model card.

        ``auto_map`` names every Auto class, the ones that cannot hold this config too: loaded with remote code,
        a mismatched Auto class then reaches a class of ours, which refuses it in one line naming
        ``is_encoder_decoder`` and the Auto class to use (instead of Transformers' "Unrecognized configuration
        class"). The card (``README.md``, ``model_card_relpos``) is written unless the folder holds a README that
        is not an unedited card of ours: a user's README is never replaced."""
        self.config.auto_map = dict(AUTO_MAP)
        if type(self)._auto_class is None:
            type(self).register_for_auto_class(_AUTO_CLASS_OF.get(type(self).__name__, "AutoModel"))
        if type(self.config)._auto_class is None:
            type(self.config).register_for_auto_class()
        result = super().save_pretrained(save_directory, *args, **kwargs)
        is_main_process = args[0] if args else kwargs.get("is_main_process", True)
        # Who writes, as Transformers decides it: should_save_on_this_rank (rank 0 under torch.distributed).
        writes = getattr(self, "should_save_on_this_rank", lambda main: main)(is_main_process)
        if writes and os.path.isdir(save_directory):
            name = next(c.__name__ for c in type(self).__mro__ if c.__name__ in _AUTO_CLASS_OF)
            card = model_card(self.config, type(self).__name__, _AUTO_CLASS_OF[name], self.num_parameters())
            write_card(save_directory, card)
        return result


_STACKS = ("RelPosModel", "RelPosCrossDecoder")  # an encoder-decoder's encoder and decoder classes
_AUTO_CLASS_OF = {
    "RelPosModel": "AutoModel",
    "RelPosForCausalLM": "AutoModelForCausalLM",
    "RelPosForSequenceClassification": "AutoModelForSequenceClassification",
    "RelPosForConditionalGeneration": "AutoModelForSeq2SeqLM",
}


def _check_holds(name: str, config: RelPosConfig, encoder_decoder: bool) -> None:
    """Raise ``ValueError`` when ``config`` describes the other kind of model than class ``name`` holds (an
    encoder-decoder's or a decoder-only one's): Transformers would build it and load none of the weights.
    One stack saved alone (``model.encoder.save_pretrained``: ``is_encoder_decoder`` with architectures
    ``RelPosModel`` or ``RelPosCrossDecoder``) is held by ``RelPosModel`` alone."""
    saved = next(iter(getattr(config, "architectures", None) or []), None)
    stack = bool(config.is_encoder_decoder) and saved in _STACKS
    if stack and name in _STACKS:
        return
    if stack:
        raise ValueError(
            f"{name} cannot hold one stack of an encoder-decoder (config.is_encoder_decoder=True, saved from {saved}: "
            "its encoder or decoder saved alone): load it with AutoModel (RelPosModel)"
        )
    if bool(config.is_encoder_decoder) == encoder_decoder:
        return
    if encoder_decoder:
        instead = (f"{_AUTO_CLASS_OF[saved]} (it was saved from {saved})" if saved in _AUTO_CLASS_OF
                   else "AutoModelForCausalLM, AutoModel or AutoModelForSequenceClassification")
        raise ValueError(
            f"{name} holds an encoder-decoder (config.is_encoder_decoder=True), got is_encoder_decoder=False (a "
            f"decoder-only config): load it with {instead}"
        )
    raise ValueError(
        f"{name} cannot hold an encoder-decoder config (config.is_encoder_decoder=True"
        + (f", saved from {saved}" if saved else "")
        + "): load it with AutoModelForSeq2SeqLM (RelPosForConditionalGeneration"
        + ("; its stacks are its .encoder and .decoder)" if name == "RelPosModel" else ")")
    )


# ----------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------


class RelPosModel(RelPosPreTrainedModel):
    def __init__(self, config: RelPosConfig, *, stack: bool = False):
        """``stack=True``: one of an encoder-decoder's stacks, which ``RelPosForConditionalGeneration`` builds from
        its config's ``stack_config``; otherwise an encoder-decoder's config is refused."""
        if not stack:
            _check_holds(type(self).__name__, config, encoder_decoder=False)
        super().__init__(config)
        # An encoder-decoder's pad id is also its decoder start token (T5): its row is trained, as upstream's.
        self.padding_idx = None if config.is_encoder_decoder else config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.position = POSITION_SCHEMES[config.position_encoding](config)
        if self.position.token_init_std is not None:
            self.embed_tokens.init_std = self.position.token_init_std
        self.layers = nn.ModuleList(RelPosDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RelPosRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    # -- input checks: every one runs before any state (cache, memory) changes ---------------

    def _check_inputs(
        self, input_ids, inputs_embeds, attention_mask, position_ids, cache, mems, encoder_hidden_states,
        encoder_attention_mask, kwargs,
    ) -> Optional[tuple]:
        """Every check of ``forward``'s arguments, in the order they are read; a host read of a tensor's values
        runs in eager calls only (``torch.compiler.is_compiling()``), so a traced graph keeps none. A
        continuous-batching step returns what ``_check_paged`` does (None otherwise)."""
        _refuse_unknown_kwargs(type(self).__name__, kwargs, MODEL_KWARGS | PAGED_KWARGS)
        paged = isinstance(cache, PagedAttentionCache)
        self._check_model_kwargs(kwargs, paged)
        self._check_setup(cache)
        batch, length = self._check_tokens(input_ids, inputs_embeds)
        if paged:
            return self._check_paged(cache, kwargs, attention_mask, position_ids, mems, encoder_hidden_states, batch, length)
        given = sorted(PAGED_KWARGS & {name for name, value in kwargs.items() if value is not None})
        if given:
            raise ValueError(
                f"{', '.join(given)}: continuous batching's paged-cache arguments need its PagedAttentionCache as cache"
            )
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        past = self._check_cache(self_cache, batch, length)
        mem_length = self._check_mems(mems, self_cache, past, batch)
        self._check_mask(attention_mask, self_cache, mems, batch, length, past, mem_length)
        if position_ids is not None and (
            position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[-1] != length
        ):
            raise ValueError(
                f"position_ids must be [batch={batch} (or 1), seq_len={length}], got shape {tuple(position_ids.shape)}"
            )
        self._check_encoder(encoder_hidden_states, encoder_attention_mask, batch)
        self._check_packing(kwargs, attention_mask, self_cache, batch, length, mem_length)

    def _check_model_kwargs(self, kwargs: dict, paged: bool = False) -> None:
        """Transformers' model keyword arguments that these models cannot honour in every value: refused when
        they ask for something else than what the model does, never dropped. (Continuous batching passes
        ``is_causal=False`` with its own mask, and ``cu_seq_lens_k`` per layer type: ``_check_paged`` checks them.)"""
        is_causal = kwargs.get("is_causal")
        if is_causal is not None and not paged and bool(is_causal) != bool(self.config.is_decoder):
            raise ValueError(
                f"is_causal={is_causal!r}: this model's attention is {'causal' if self.config.is_decoder else 'bidirectional'}"
                f" (config.is_decoder={self.config.is_decoder}); build the model with the other is_decoder instead"
            )
        segments = kwargs.get("token_type_ids")
        if segments is not None and not torch.compiler.is_compiling() and bool(segments.any()):
            raise ValueError(
                "token_type_ids with a segment other than 0: hf_relpos models have no segment embeddings (a "
                "tokenizer's one-segment token_type_ids, all 0, are accepted)"
            )
        if kwargs.get("output_router_logits"):
            raise ValueError("output_router_logits=True: hf_relpos models have no mixture-of-experts router")
        q, k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if paged:
            return
        if k is not None and not torch.compiler.is_compiling() and (q is None or not torch.equal(q.cpu(), k.cpu())):
            raise ValueError(
                "cu_seq_lens_k must equal cu_seq_lens_q (packed sequences whose keys are their own tokens), got "
                f"cu_seq_lens_q={None if q is None else q.tolist()}, cu_seq_lens_k={k.tolist()}"
            )

    def _check_setup(self, cache) -> None:
        """The cache's kind, the attention implementation, and a cache under activation checkpointing."""
        if isinstance(cache, EncoderDecoderCache) and not (self.config.is_encoder_decoder and self.config.is_decoder):
            raise ValueError("an EncoderDecoderCache is for an encoder-decoder's decoder; this stack has no cross-attention")
        impl = self.config._attn_implementation or "eager"
        if isinstance(cache, PagedAttentionCache):  # continuous batching's paged|eager: our eager path
            impl = _attn_implementation(self.config)
        if impl not in SUPPORTED_ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation must be one of {list(SUPPORTED_ATTN_IMPLEMENTATIONS)} for hf_relpos, got {impl!r}"
                + (" (continuous batching's, for its steps with a PagedAttentionCache)" if impl == "paged|eager" else "")
            )
        if cache is not None and self._checkpointing():
            # A checkpointed layer runs twice (forward, then again in backward): a cache would take its keys twice.
            raise ValueError(
                "a cache (cache= / past_key_values=) cannot be used with activation checkpointing in training: a "
                "checkpointed layer runs again in backward and would add its keys twice. Pass no cache, or "
                "disable checkpointing (model.gradient_checkpointing_disable())"
            )

    def _checkpointing(self) -> bool:
        return self.gradient_checkpointing and self.training and torch.is_grad_enabled()

    def _check_tokens(self, input_ids, inputs_embeds) -> tuple[int, int]:
        """Exactly one of ids (in the vocabulary) or embeddings, of at least one token: ``(batch, seq_len)``."""
        config = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
            if input_ids.dtype not in (torch.long, torch.int32):  # what nn.Embedding takes
                raise ValueError(f"input_ids must be integer token ids (torch.long or torch.int32), got {input_ids.dtype}")
            if input_ids.numel() and not torch.compiler.is_compiling():
                low, high = int(input_ids.min()), int(input_ids.max())
                if low < 0 or high >= config.vocab_size:
                    bad = low if low < 0 else high
                    raise ValueError(
                        f"input_ids must be token ids in [0, vocab_size={config.vocab_size}), got {bad}"
                    )
            batch, length = input_ids.shape
        else:
            if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.is_floating_point():
                raise ValueError("inputs_embeds must be a floating-point tensor [batch, seq_len, hidden_size]")
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
                raise ValueError(
                    f"inputs_embeds must be [batch, seq_len, hidden_size={config.hidden_size}], "
                    f"got shape {tuple(inputs_embeds.shape)}"
                )
            batch, length = inputs_embeds.shape[:2]
        if batch == 0 or length == 0:
            what = "input_ids" if input_ids is not None else "inputs_embeds"
            raise ValueError(f"{what} must hold at least one sequence of at least one token, got batch={batch}, seq_len={length}")
        return batch, length

    def _check_cache(self, cache, batch: int, length: int) -> Optional[int]:
        """A Transformers cache of this configuration with room for ``length`` more tokens: the tokens it holds
        (None in a traced graph, where a static cache's length is a tensor; 0 without a cache)."""
        config = self.config
        if cache is None:
            return 0
        if not isinstance(cache, Cache):
            raise ValueError(
                f"cache (past_key_values) must be a transformers Cache (e.g. DynamicCache), got {type(cache).__name__}"
            )
        if len(cache.layers) > config.num_hidden_layers or (
            len(cache.layers) != config.num_hidden_layers and cache.get_seq_length() > 0
        ):
            raise ValueError(
                f"cache (past_key_values) has {len(cache.layers)} layers, this model has num_hidden_layers="
                f"{config.num_hidden_layers}: the cache comes from a different configuration"
            )
        layer = cache.layers[0] if len(cache.layers) else None
        keys = getattr(layer, "keys", None)
        if layer is not None and getattr(layer, "is_initialized", False) and keys is not None and keys.numel():
            # a scheme may carry more channels in its keys (FoX's forget gate)
            channels = POSITION_SCHEMES[config.position_encoding].key_channels
            expected = (batch, config.num_attention_heads, config.head_dim + channels)
            got = (keys.shape[0], keys.shape[1], keys.shape[3])
            if got != expected:
                why = "for this input and configuration"
                if channels and got[2] == config.head_dim:
                    why = (f"for position_encoding={config.position_encoding!r}, whose keys carry {channels} more "
                           "channel (the forget gate): this cache was sized for keys of head_dim (a model of another "
                           "scheme, or a StaticCache initialised before its first keys, as ExecuTorch's recipe does); "
                           "use a DynamicCache or a StaticCache left to initialise itself")
                raise ValueError(
                    f"cache (past_key_values) holds keys of [batch, heads, head_dim] = {list(got)}, expected {list(expected)} "
                    + why
                )
        # A static cache's length is a tensor in a traced graph: checks that read it on the host run in eager
        # calls only, as the token-id range check does.
        if torch.compiler.is_compiling():
            return None
        past = int(cache.get_seq_length())
        # A StaticCache's full-attention layers hold max_cache_len tokens (a sliding layer rolls over instead).
        room = [layer.get_max_length() for layer in cache.layers if not getattr(layer, "is_sliding", True)]
        room = min((r for r in room if r >= 0), default=None)
        if room is not None and past + length > room:
            raise ValueError(
                f"cache (past_key_values) is a {type(cache).__name__} of max_cache_len={room} holding {past} tokens: "
                f"no room for {length} more; build it with max_cache_len >= {past + length}"
            )
        return past

    def _check_mems(self, mems, cache, past: Optional[int], batch: int) -> int:
        """Transformer-XL memories, one ``[batch, mem <= mem_len, hidden_size]`` per layer: their length (0 without)."""
        config = self.config
        if mems is None:
            return 0
        if config.mem_len == 0 or config.position_encoding != "transformer_xl":
            raise ValueError(
                "mems is only accepted by position_encoding='transformer_xl' with mem_len > 0, got "
                f"position_encoding={config.position_encoding!r}, mem_len={config.mem_len}"
            )
        if cache is not None and past:
            raise ValueError("mems and a filled cache (past_key_values) cannot be combined: use one kind of memory")
        if not isinstance(mems, (list, tuple)) or len(mems) != config.num_hidden_layers:
            got = len(mems) if isinstance(mems, (list, tuple)) else type(mems).__name__
            raise ValueError(f"mems must be a list of num_hidden_layers={config.num_hidden_layers} tensors, got {got}")
        first = mems[0]
        mem_length = first.shape[1] if isinstance(first, torch.Tensor) and first.dim() == 3 else -1
        dtype = self.embed_tokens.weight.dtype
        for layer_idx, mem in enumerate(mems):
            if isinstance(mem, torch.Tensor) and mem.dtype != dtype:
                raise ValueError(f"mems[{layer_idx}] must have the model's dtype {dtype}, got {mem.dtype}")
            if (
                not isinstance(mem, torch.Tensor)
                or mem.dim() != 3
                or mem.shape[0] != batch
                or mem.shape[1] != mem_length
                or mem.shape[2] != config.hidden_size
                or mem_length > config.mem_len
            ):
                got = tuple(mem.shape) if isinstance(mem, torch.Tensor) else type(mem).__name__
                raise ValueError(
                    f"mems[{layer_idx}] must be [batch={batch}, mem <= mem_len={config.mem_len}, "
                    f"hidden_size={config.hidden_size}] (all layers the same length), got {got}"
                )
        return mem_length

    def _check_mask(self, attention_mask, cache, mems, batch: int, length: int, past: Optional[int], mem_length: int):
        """A 2-D padding mask over past (and memory) and current tokens, or a prepared 4-D one."""
        if attention_mask is not None and attention_mask.dim() == 4:
            # A prepared 4-D mask (generate builds one for static caches): [batch, 1, seq_len, keys].
            keys = cache.get_mask_sizes(length, 0)[0] if cache is not None else length
            if tuple(attention_mask.shape) != (batch, 1, length, keys) or mems is not None:
                raise ValueError(
                    f"a 4-D attention_mask must be [batch={batch}, 1, seq_len={length}, keys={keys}] (and cannot be "
                    f"combined with mems), got shape {tuple(attention_mask.shape)}"
                )
        elif attention_mask is not None and past is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] not in (
                length + past,
                length + past + mem_length,
            ):
                allowed = f"[batch={batch}, {past + length}]"
                if mem_length:
                    allowed += f" or [batch={batch}, {mem_length + length}] (memory included)"
                raise ValueError(
                    f"attention_mask must be {allowed} (past + current tokens), got shape {tuple(attention_mask.shape)}"
                )

    def _check_encoder(self, encoder_hidden_states, encoder_attention_mask, batch: int) -> None:
        """An encoder-decoder's decoder takes the encoder's states ``[batch, source_len, hidden_size]`` (and their
        ``[batch, source_len]`` mask); any other stack takes none."""
        if not (self.config.is_encoder_decoder and self.config.is_decoder):
            if encoder_hidden_states is not None:
                raise ValueError("encoder_hidden_states are for an encoder-decoder's decoder (is_encoder_decoder=True)")
            return
        hidden = self.config.hidden_size
        if not isinstance(encoder_hidden_states, torch.Tensor) or encoder_hidden_states.dim() != 3 or (
            encoder_hidden_states.shape[0] != batch or encoder_hidden_states.shape[2] != hidden
        ):
            got = tuple(encoder_hidden_states.shape) if isinstance(encoder_hidden_states, torch.Tensor) else encoder_hidden_states
            raise ValueError(f"encoder_hidden_states must be [batch={batch}, source_len, hidden_size={hidden}], got {got}")
        source = encoder_hidden_states.shape[1]
        if encoder_attention_mask is not None and (
            encoder_attention_mask.dim() != 2 or tuple(encoder_attention_mask.shape) != (batch, source)
        ):
            raise ValueError(
                f"encoder_attention_mask (the source's attention_mask) must be [batch={batch}, source_len={source}], "
                f"got shape {tuple(encoder_attention_mask.shape)}"
            )

    def _check_paged(self, cache, kwargs, attention_mask, position_ids, mems, encoder_hidden_states, batch, length):
        """One continuous-batching step (``PagedAttentionArgs``): a config that can take part, requests packed in one
        row with their own ``position_ids`` and ``cu_seq_lens_q``, and the paged cache's arguments for this
        model's one group of layers: ``cu_seq_lens_k`` with as many requests, a read and a write index per group,
        no block table (flash attention's), a 4-D mask (or none) over the step's queries and keys. Returns this
        group's ``(cu_seq_lens_q, cu_seq_lens_k, key count)``."""
        refusal = continuous_batching_refusal(self.config)
        if refusal is not None:
            raise ValueError(f"a PagedAttentionCache (continuous batching) cannot be used: {refusal}")
        if mems is not None or encoder_hidden_states is not None:
            raise ValueError("a PagedAttentionCache (continuous batching) takes no mems or encoder_hidden_states")
        if batch != 1:
            raise ValueError(f"continuous batching packs its requests in one row: batch must be 1, got {batch}")
        if position_ids is None or tuple(position_ids.shape) != (1, length) or position_ids.is_floating_point():
            got = None if position_ids is None else f"{tuple(position_ids.shape)} {position_ids.dtype}"
            raise ValueError(
                f"a PagedAttentionCache needs each token's position in its request: position_ids [1, {length}] of "
                f"integers, got {got}"
            )
        allocators = {cache.layer_to_allocator[i] for i in range(self.config.num_hidden_layers)}
        if len(allocators) != 1:
            raise ValueError(f"the PagedAttentionCache gives this model's layers {len(allocators)} groups; they are one")
        allocator = allocators.pop()
        groups = len(cache.cache_allocators)
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if isinstance(cu_k, dict):
            cu_k = cu_k.get(allocator.layer_type)
        read, write = kwargs.get("read_index"), kwargs.get("write_index")
        if not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor) or cu_q.dim() != 1 or (
            cu_k.shape != cu_q.shape or cu_q.numel() < 2
        ):
            raise ValueError(
                "a PagedAttentionCache needs cu_seq_lens_q and cu_seq_lens_k (by layer type "
                f"{allocator.layer_type!r}) as 1-D cumulative lengths of the same requests, got "
                f"{cu_q!r:.80} and {cu_k!r:.80}"
            )
        if not all(isinstance(x, (list, tuple)) and len(x) == groups for x in (read, write)):
            raise ValueError(f"read_index and write_index must be lists of {groups} index tensors (one per cache group)")
        if kwargs.get("block_table") is not None:
            raise ValueError("block_table is flash attention's paged path; hf_relpos attends with eager or sdpa")
        key_length = read[allocator.index].numel() or length  # no past read: the keys are the step's own
        if not torch.compiler.is_compiling():
            q_lens, k_lens = cu_q.diff(), cu_k.diff()
            if int(cu_q[0]) != 0 or int(cu_k[0]) != 0 or bool((q_lens < 0).any()) or bool((k_lens < q_lens).any()) or (
                int(cu_q[-1]) > length or int(cu_k[-1]) > key_length
            ):
                raise ValueError(
                    f"cu_seq_lens_q {cu_q.tolist()} and cu_seq_lens_k {cu_k.tolist()} must be cumulative lengths from 0 "
                    f"within the step's {length} tokens and {key_length} keys, each request with at least its new "
                    "tokens as keys"
                )
        masks = attention_mask.values() if isinstance(attention_mask, dict) else [attention_mask]
        for mask in masks:
            if mask is not None and (mask.dim() != 4 or tuple(mask.shape[-2:]) != (length, key_length)):
                raise ValueError(
                    f"continuous batching's attention_mask must be [1, 1, {length}, {key_length}] (the step's queries "
                    f"and keys), got shape {tuple(mask.shape)}"
                )
        return cu_q, cu_k, key_length

    def _check_packing(self, kwargs, attention_mask, cache, batch: int, length: int, mem_length: int) -> None:
        """``cu_seq_lens_q`` / ``seq_idx`` (packed sequences) describe this row's documents, in a forward with
        nothing else to go by."""
        cu_seq_lens, seq_idx = kwargs.get("cu_seq_lens_q"), kwargs.get("seq_idx")
        if cu_seq_lens is not None:
            if batch != 1 or (not torch.compiler.is_compiling() and int(cu_seq_lens[-1]) != length):
                raise ValueError(
                    f"cu_seq_lens_q must hold cumulative document lengths ending at seq_len={length} of one packed "
                    f"row (batch 1), got {cu_seq_lens.tolist()} with batch={batch}"
                )
        elif seq_idx is not None:
            if tuple(seq_idx.shape) != (batch, length):
                raise ValueError(f"seq_idx must be [batch={batch}, seq_len={length}], got {tuple(seq_idx.shape)}")
        else:
            return
        q_offset, kv_length, _ = cache_offsets(cache, length)
        if not (is_fresh(q_offset, kv_length, length, mem_length) and unpadded(attention_mask)):
            raise ValueError(
                "cu_seq_lens_q / seq_idx (packed sequences) need a forward without a cache, mems or an "
                "attention_mask with padding"
            )

    # -- the forward ---------------------------------------------------------------------------

    @capture_outputs
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        use_cache: Optional[bool] = None,
        mems: Optional[list] = None,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        encoder_attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[Cache] = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RelPosModelOutput:
        """``output_attentions``, ``output_hidden_states`` and ``return_dict`` (call arguments or config
        fields) are served by Transformers' ``capture_outputs``. Packed sequences (one row of documents
        whose ``position_ids`` restart at 0, read as Transformers does only without an ``attention_mask``
        and a past, or the ``cu_seq_lens_q`` / ``seq_idx`` kwargs of ``DataCollatorWithFlattening``) attend
        only within their document.

        An encoder-decoder's decoder also takes ``encoder_hidden_states`` (with ``encoder_attention_mask``)
        and an ``EncoderDecoderCache``, whose self-attention part holds the positions.

        The cache is ``cache`` (Transformers 5.24's name) or ``past_key_values`` (its name before); a keyword
        argument that is neither named here nor one of Transformers' model keyword arguments is a ``TypeError``."""
        config = self.config
        cache = _one_cache(cache, past_key_values)
        paged_step = self._check_inputs(
            input_ids, inputs_embeds, attention_mask, position_ids, cache, mems, encoder_hidden_states,
            encoder_attention_mask, kwargs,
        )
        cross = config.is_encoder_decoder and config.is_decoder
        # The cache that holds the positions: an encoder-decoder's self-attention part.
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        if use_cache is None:
            use_cache = config.use_cache and not self.training
        # A checkpointed layer would add its keys twice; Transformer-XL memory replaces the cache within a forward.
        use_cache = use_cache and not self._checkpointing() and not (mems is not None and self_cache is None)
        if use_cache and self_cache is None:
            self_cache = DynamicCache(config=config)
            # The cross-attention cache holds the whole source: no window, whatever the config's sliding_window.
            cache = EncoderDecoderCache(self_cache, DynamicCache()) if cross else self_cache

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        output_attentions = kwargs.get("output_attentions")
        output_attentions = bool(config.output_attentions if output_attentions is None else output_attentions)
        if paged_step is not None:  # a continuous-batching step: each request's own positions
            cu_q, cu_k, key_length = paged_step
            update = {name: kwargs.get(name) for name in ("read_index", "write_index", "block_table", "max_length_k")}
            ctx = PositionContext.from_paged(
                config, self.position, inputs_embeds, position_ids, cu_q, cu_k, key_length,
                {**update, "cu_seq_lens_k": kwargs["cu_seq_lens_k"]},
                attn_implementation=_attn_implementation(config), output_attentions=output_attentions,
            )
        else:
            ctx = PositionContext.from_inputs(
                config, self.position, inputs_embeds, attention_mask, position_ids, self_cache, mems, kwargs,
                attn_implementation=_attn_implementation(config), output_attentions=output_attentions,
            )
        encoder_mask = _key_padding_mask(encoder_attention_mask) if cross else None
        hidden_states = self.dropout(self.position.embed(inputs_embeds, ctx))
        term = self.position(ctx, inputs_embeds.device, hidden_states.dtype)

        new_mems = [] if config.mem_len > 0 else None
        for layer_idx, layer in enumerate(self.layers):
            memory = mems[layer_idx] if mems is not None else None
            if new_mems is not None:
                new_mems.append(self._update_memory(memory, hidden_states))
            # Tensors that need gradients positionally: reentrant checkpointing carries gradients only for those.
            hidden_states = layer(
                hidden_states, term, encoder_hidden_states,
                ctx=ctx, memory=memory, cache=cache, encoder_mask=encoder_mask,
            )
        hidden_states = self.norm(hidden_states)
        if config.is_encoder_decoder:  # T5's stacks drop their normed output (decoder-only models do not)
            hidden_states = self.dropout(hidden_states)
        outputs = {"last_hidden_state": hidden_states, CACHE_FIELD: cache if use_cache else None}
        if cross:
            return BaseModelOutputWithPastAndCrossAttentions(**outputs)
        return RelPosModelOutput(**outputs, mems=new_mems)

    def _update_memory(self, memory: Optional[torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
        """Dai et al.'s memory: the last ``mem_len`` inputs of this layer, cut from the graph."""
        with torch.no_grad():
            states = hidden_states if memory is None else torch.cat([memory, hidden_states], dim=1)
            return states[:, -self.config.mem_len :].detach()


def _request_refusal(prompt: int, max_new_tokens, limit: Optional[int], encoding: str) -> Optional[str]:
    """Why a continuous-batching request of ``prompt`` tokens and ``max_new_tokens`` cannot run (None when it can):
    an empty prompt (its step would have no row to read the next token from), or one that runs past an absolute
    position table of ``limit`` positions (``generate`` raises at the same position)."""
    if prompt == 0:
        return "input_ids is an empty prompt: a request needs at least one token to continue from (a BOS token)"
    if limit is None:
        return None
    last = prompt - 1 + max(int(max_new_tokens or 0) - 1, 0)  # the last token fed to the model (the final one is not)
    if last < limit:
        return None
    answer = f" and max_new_tokens={max_new_tokens}" if max_new_tokens else ""
    return (
        f"a prompt of {prompt} tokens{answer} needs position {last}, past max_position_embeddings={limit} of the "
        f"{encoding!r} position table: prompt plus max_new_tokens may be at most {limit + 1} tokens"
    )


def _check_requests(manager, add_request, limit: Optional[int], encoding: str):
    """``add_request`` refusing a request that cannot run (``_request_refusal``), at the caller: its step's forward
    would raise in the manager's thread, which then fails every request and stops."""
    signature = inspect.signature(add_request)

    def checked(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        new = bound.arguments.get("max_new_tokens")
        new = manager.generation_config.max_new_tokens if new is None else new
        refusal = _request_refusal(len(bound.arguments["input_ids"]), new, limit, encoding)
        if refusal is not None:
            raise ValueError(refusal)
        return add_request(*args, **kwargs)

    checked._relpos_checked = True
    return checked


def _attn_implementation(config) -> str:
    """The config's attention implementation; continuous batching's ``paged|eager`` is our eager path (the paged
    cache is updated by the attention layer itself, for every implementation)."""
    return (config._attn_implementation or "eager").removeprefix("paged|")


def _key_padding_mask(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The decoder's view of the source: bool ``[B, 1, 1, S]`` (True = may attend), None when nothing is padding.

    Own code, not ``create_bidirectional_mask``: that renders ``[B, 1, Q, S]`` (a float one under eager), while the
    cross-attention takes the keys' mask once for all query rows, as T5 does."""
    if attention_mask is None or (not torch.compiler.is_compiling() and bool(attention_mask.all())):
        return None
    return attention_mask.bool()[:, None, None, :]


class RelPosCrossDecoder(RelPosModel):
    """An encoder-decoder's decoder stack: ``RelPosModel`` whose layers also cross-attend to the encoder
    (its config has ``is_encoder_decoder`` and ``is_decoder``); its outputs add ``cross_attentions``."""

    _can_record_outputs = {**RelPosModel._can_record_outputs, "cross_attentions": RelPosCrossAttention}


# ----------------------------------------------------------------------------------
# Heads
# ----------------------------------------------------------------------------------


class RelPosGenerationMixin(GenerationMixin):
    """``GenerationMixin`` whose model inputs leave out what ``generate`` keeps for its own use: its decoding loop
    (``_sample``) takes ``tokenizer`` / ``assistant_tokenizer`` (given for ``stop_strings``) into the model
    keyword arguments, which upstream forwards swallow in ``**kwargs`` and ours, naming all they take, refuse."""

    def prepare_inputs_for_generation(self, *args, **kwargs):
        for name in ("tokenizer", "assistant_tokenizer"):
            kwargs.pop(name, None)
        return super().prepare_inputs_for_generation(*args, **kwargs)

    # generate (and Transformers' tests) read this method's parameters: `inputs_embeds` among them is what lets
    # `generate(inputs_embeds=...)` run, so it keeps the signature of the method it wraps.
    prepare_inputs_for_generation.__signature__ = inspect.signature(GenerationMixin.prepare_inputs_for_generation)

    def _get_static_cache_init_shape(self, *args, **kwargs):
        """Transformers sizes an eagerly initialised StaticCache (``prefill_chunk_size``) for keys of head_dim: where
        the scheme carries more channels in its keys (FoX), the cache initialises from the first keys instead."""
        if POSITION_SCHEMES[self.config.get_text_config(decoder=True).position_encoding].key_channels:
            return None  # as Transformers does for keys and values of different sizes (MLA)
        return super()._get_static_cache_init_shape(*args, **kwargs)


class RelPosForCausalLM(RelPosPreTrainedModel, RelPosGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: RelPosConfig):
        _check_holds(type(self).__name__, config, encoder_decoder=False)
        if not config.is_decoder:
            raise ValueError(
                "RelPosForCausalLM needs config.is_decoder=True (causal attention), got is_decoder=False"
            )
        super().__init__(config)
        self.model = RelPosModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        mems: Optional[list] = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Optional[Cache] = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RelPosCausalLMOutput:
        """Transformers' model keyword arguments reach the model, and ``num_items_in_batch``, ``ignore_index`` and
        ``shift_labels`` Transformers' loss; a loss is computed from ``labels`` or ``shift_labels``. The cache is
        ``cache`` or ``past_key_values`` (its name before Transformers 5.24); any other keyword is a ``TypeError``.
        Continuous batching's steps also pass ``logits_indices`` (the rows it reads: ``logits_to_keep`` when given)."""
        logits_indices = kwargs.pop("logits_indices", None)
        kwargs.pop("logits_processor_args", None)  # read by continuous batching's processors, not the model
        logits_to_keep = self._check_logits_indices(logits_indices, logits_to_keep, input_ids, inputs_embeds)
        loss_kwargs = _split_loss_kwargs(type(self).__name__, kwargs, CAUSAL_LOSS_KWARGS)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=_one_cache(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            mems=mems,
            return_dict=True,  # the head builds its own output (a tuple when asked for, by can_return_tuple)
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None or loss_kwargs.get("shift_labels") is not None:
            for name, target in (("labels", labels), ("shift_labels", loss_kwargs.get("shift_labels"))):
                if target is not None and target.shape != logits.shape[:2]:
                    raise ValueError(
                        f"{name} must be [batch, seq_len] = {list(logits.shape[:2])}, got {tuple(target.shape)}"
                    )
            loss = self._token_loss(logits, labels, **loss_kwargs)
        return RelPosCausalLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            mems=outputs.mems,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )

    @staticmethod
    def _check_logits_indices(logits_indices, logits_to_keep, input_ids, inputs_embeds):
        """Check a step's ``logits_indices`` (the rows continuous batching reads): row indices, the same rows as a
        tensor ``logits_to_keep`` (it passes both when the model takes ``logits_to_keep``, which slices here)."""
        if logits_indices is None:
            return logits_to_keep
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if not isinstance(logits_indices, torch.Tensor) or logits_indices.dim() != 1 or logits_indices.is_floating_point():
            raise ValueError(f"logits_indices must be a 1-D tensor of row indices, got {logits_indices!r:.80}")
        if not torch.compiler.is_compiling():
            if logits_indices.numel() and (int(logits_indices.min()) < 0 or int(logits_indices.max()) >= length):
                raise ValueError(f"logits_indices must index the {length} input rows, got {logits_indices.tolist()}")
            keep = logits_to_keep
            if not (isinstance(keep, int) and keep == 0) and not (
                isinstance(keep, torch.Tensor) and torch.equal(keep.cpu().long(), logits_indices.cpu().long())
            ):
                raise ValueError(
                    f"logits_indices {logits_indices.tolist()} and logits_to_keep {keep!r:.80} name different rows"
                )
        return logits_to_keep  # 0: every row, which the caller then indexes by logits_indices itself

    def init_continuous_batching(self, *args, **kwargs):
        """Transformers' continuous batching (``generate_batch`` and ``continuous_batching_context_manager`` start
        here), refused in one ``ValueError`` for a model that cannot take part (``continuous_batching_refusal``)."""
        refusal = continuous_batching_refusal(self.config)
        if refusal is not None:
            raise ValueError(f"{type(self).__name__} cannot use continuous batching (generate_batch): {refusal}")
        manager = super().init_continuous_batching(*args, **kwargs)
        if not getattr(manager.add_request, "_relpos_checked", False):
            limit = getattr(self.model.position, "max_positions", None)
            manager.add_request = _check_requests(manager, manager.add_request, limit, self.config.position_encoding)
        return manager

    def generate_batch(self, inputs, generation_config=None, *args, **kwargs):
        """Transformers' ``generate_batch``, with the requests that cannot run (an empty prompt, one past an absolute
        position table) refused before any runs (Transformers' own logs an error raised while adding requests and
        returns no result)."""
        limit = getattr(self.model.position, "max_positions", None)
        config = self.generation_config if generation_config is None else generation_config
        new = kwargs.get("max_new_tokens")
        new = config.max_new_tokens if new is None else new
        for index, prompt in enumerate(inputs):
            refusal = _request_refusal(len(prompt), new, limit, self.config.position_encoding)
            if refusal is not None:
                raise ValueError(f"generate_batch: inputs[{index}]: {refusal}")
        return super().generate_batch(inputs, generation_config, *args, **kwargs)

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        # Transformers' generate before 5.24 reads an output named `mems` as the cache (XLNet's legacy); our
        # decoding memory is the (sliding) KV cache, so never feed mems back as past_key_values. (5.24 reads
        # only `cache`: then this finds nothing to remove.)
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)
        if isinstance(model_kwargs.get("past_key_values"), list):
            # Removed, not set to None: beam search reorders any cache it finds among the kwargs.
            del model_kwargs["past_key_values"]
        return model_kwargs


class RelPosForSequenceClassification(RelPosPreTrainedModel):
    """Pools the last non-padding token (causal models) or the mean of non-padding tokens (bidirectional)."""

    def __init__(self, config: RelPosConfig):
        _check_holds(type(self).__name__, config, encoder_decoder=False)
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = RelPosModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        mems: Optional[list] = None,
        use_cache: Optional[bool] = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RelPosSequenceClassifierOutput:
        """Transformers' model keyword arguments reach the model; any other keyword is a ``TypeError``. A classifier
        keeps no cache: ``use_cache`` may be None or False."""
        _refuse_unknown_kwargs(type(self).__name__, kwargs, MODEL_KWARGS)
        if use_cache:
            raise ValueError("use_cache=True: RelPosForSequenceClassification keeps no cache (pass None or False)")
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,
            mems=mems,
            return_dict=True,  # the head builds its own output (a tuple when asked for, by can_return_tuple)
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        batch, length = hidden.shape[:2]
        if attention_mask is not None:
            keep = attention_mask[:, -length:].to(hidden.dtype)
        elif input_ids is not None and self.config.pad_token_id is not None:
            keep = (input_ids != self.config.pad_token_id).to(hidden.dtype)
        else:
            keep = torch.ones(batch, length, dtype=hidden.dtype, device=hidden.device)
        if self.config.is_decoder:
            # The last kept token sees the whole sequence; works for left and right padding.
            index = (keep * torch.arange(1, length + 1, device=hidden.device, dtype=hidden.dtype)).argmax(-1)
            pooled = hidden[torch.arange(batch, device=hidden.device), index]
        else:
            pooled = (hidden * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp_min(1.0)
        logits = self.score(pooled)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=logits, config=self.config)
        return RelPosSequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
            mems=outputs.mems,
        )


class RelPosForConditionalGeneration(RelPosPreTrainedModel, RelPosGenerationMixin):
    """An encoder-decoder in T5's layout: one token table (``shared``) for the encoder, the decoder and (with
    ``tie_word_embeddings``) the output layer; a bidirectional encoder and a causal decoder (``RelPosModel``
    stacks, each with its own position parameters: T5's one bias table per stack); the decoder's layers
    cross-attend to the encoder's last states. ``labels`` give the loss, and ``decoder_input_ids`` default
    to the labels shifted right behind ``decoder_start_token_id`` (T5's ``_shift_right``)."""

    _layer_stacks = (("num_hidden_layers", "encoder."), ("num_decoder_layers", "decoder."))
    # Both stacks always read the shared table; the output layer does when tie_word_embeddings (see below).
    _tied_weights_keys = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
        "lm_head.weight": "shared.weight",
    }

    def __init__(self, config: RelPosConfig):
        _check_holds(type(self).__name__, config, encoder_decoder=True)
        super().__init__(config)
        self.loss_type = "ForMaskedLM"  # labels are aligned with the logits (no shift inside the loss), as T5's
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size)  # no padding_idx: see RelPosModel
        self.encoder = RelPosModel(config.stack_config(decoder=False), stack=True)
        self.decoder = RelPosCrossDecoder(config.stack_config(decoder=True), stack=True)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def init_continuous_batching(self, *args, **kwargs):
        """Refused in one ``ValueError``: continuous batching is for decoder-only models (``generate_batch`` too)."""
        raise ValueError(
            f"{type(self).__name__} cannot use continuous batching (generate_batch): "
            f"{continuous_batching_refusal(self.config)}"
        )

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        """Transformers ties ``_tied_weights_keys`` only with ``tie_word_embeddings``; here the stacks' tables
        are always the shared one (they are one table in T5), the output layer only when tied."""
        tied = dict(self._tied_weights_keys)
        if not self.config.tie_word_embeddings:
            del tied["lm_head.weight"]
        return tied

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """Transformers builds generate's cross-attention cache from the decoder's config, so with a
        ``sliding_window`` its layers would keep only the last source tokens: rebuild it without the window, of
        the same kind (dynamic or static, offloaded or not), as upstream T5Gemma does."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_FIELD)
        if (
            not isinstance(cache, EncoderDecoderCache)
            or getattr(cache, "_is_user_defined", False)
            or not any(cache.cross_attention_cache.is_sliding)
        ):
            return
        cross = cache.cross_attention_cache
        config = self.config.get_text_config(decoder=True)
        config.sliding_window = None
        if isinstance(cross, StaticCache):
            source_length = model_kwargs["encoder_outputs"][0].shape[1]
            cache.cross_attention_cache = StaticCache(
                config=config, max_cache_len=source_length, offloading=cross.offloading
            )
        else:
            cache.cross_attention_cache = DynamicCache(config=config, offloading=cross.offloading)

    def _prepare_text_encoder_decoder_kwargs_for_generation(self, inputs_tensor, model_kwargs, *args, **kwargs):
        """``generate`` hands the encoder every model keyword argument when the encoder's forward takes ``**kwargs``
        (ours does, for Transformers' model keyword arguments), ``logits_to_keep`` included, which the encoder
        would refuse: hand it only what it takes, and keep the rest for the decoding steps."""
        takes = (set(inspect.signature(self.encoder.forward).parameters) | MODEL_KWARGS) - {"cache", "past_key_values"}
        held = {name: model_kwargs.pop(name) for name in list(model_kwargs) if name not in takes}
        model_kwargs = super()._prepare_text_encoder_decoder_kwargs_for_generation(
            inputs_tensor, model_kwargs, *args, **kwargs
        )
        return {**model_kwargs, **held}

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, value):
        self.shared = value
        self.encoder.set_input_embeddings(value)
        self.decoder.set_input_embeddings(value)

    def get_encoder(self, modality: Optional[str] = None):
        return self.encoder

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """Transformers updates ``config.vocab_size``; the stacks' configs are copies (``stack_config``) whose
        ``vocab_size`` bounds the token ids each stack accepts: they follow."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        for stack in (self.encoder, self.decoder):
            stack.config.vocab_size = self.config.vocab_size
        return embeddings

    def _shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """T5's decoder inputs from labels: ``decoder_start_token_id`` then the labels but the last, ``-100`` as padding."""
        start, pad = self.config.decoder_start_token_id, self.config.pad_token_id
        if start is None or pad is None:
            raise ValueError(
                "decoder_start_token_id and pad_token_id must be set to derive decoder_input_ids from labels, got "
                f"decoder_start_token_id={start!r}, pad_token_id={pad!r}"
            )
        shifted = labels.new_full(labels.shape, start)
        shifted[..., 1:] = labels[..., :-1]
        return shifted.masked_fill(shifted == -100, pad)

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return self._shift_right(labels)

    @can_return_tuple
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        decoder_input_ids: Optional[torch.LongTensor] = None,
        decoder_attention_mask: Optional[torch.Tensor] = None,
        encoder_outputs: Optional[Any] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        decoder_inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Optional[Cache] = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqLMOutput:
        """Encode (unless ``encoder_outputs`` are given, as ``generate`` does after its first step), decode, and
        score. Transformers' model keyword arguments reach both stacks, and ``num_items_in_batch`` and
        ``ignore_index`` Transformers' loss. The cache (an ``EncoderDecoderCache``) is ``cache`` or
        ``past_key_values`` (its name before Transformers 5.24); any other keyword is a ``TypeError``."""
        loss_kwargs = _split_loss_kwargs(type(self).__name__, kwargs, TOKEN_LOSS_KWARGS)
        cache = _one_cache(cache, past_key_values)
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, return_dict=True,
                **kwargs,
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(
                last_hidden_state=encoder_outputs[0],
                hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
                attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None,
            )
        if labels is not None:
            if labels.dim() != 2:
                raise ValueError(f"labels must be [batch, target_len], got shape {tuple(labels.shape)}")
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self._shift_right(labels)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            inputs_embeds=decoder_inputs_embeds,
            cache=cache,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        hidden = slice_logits_to_keep(decoder_outputs.last_hidden_state, logits_to_keep)
        if self.config.scale_decoder_outputs:  # T5 v1.0: the tied output layer reads d_model**-0.5-scaled states
            hidden = hidden * self.config.hidden_size**-0.5
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            if labels.shape != logits.shape[:2]:
                raise ValueError(f"labels must be [batch, target_len] = {list(logits.shape[:2])}, got {tuple(labels.shape)}")
            loss = self._token_loss(logits, labels, **loss_kwargs)
        return Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            **{CACHE_FIELD: getattr(decoder_outputs, CACHE_FIELD)},
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


__all__ = [
    "RelPosPreTrainedModel",
    "RelPosModel",
    "RelPosForCausalLM",
    "RelPosForSequenceClassification",
    "RelPosForConditionalGeneration",
    "POSITION_SCHEMES",
]
