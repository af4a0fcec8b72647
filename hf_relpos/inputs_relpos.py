"""A model's inputs: Transformers' keyword arguments across its versions, and every check of ``RelPosModel.forward``'s
arguments, run before any state (cache, memory) changes.

``check_inputs`` runs the checks in the order the forward reads its arguments; a check that reads a tensor's values
on the host runs in eager calls only (``torch.compiler.is_compiling()``), so a traced graph keeps none.
"""

import warnings
from dataclasses import replace
from typing import Optional

import torch

from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils.generic import TransformersKwargs

from .attention_backends_relpos import TRITON, triton_refusal
from .flex_backend_relpos import flex_refusal
from .position_context_relpos import Geometry, read_cache, unpadded
from .position_schemes_relpos import POSITION_SCHEMES

SUPPORTED_ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", TRITON)


def attention_implementation(config) -> str:
    """The config's attention implementation; continuous batching's ``paged|eager`` is our eager path (the paged
    cache is updated by the attention layer itself, for every implementation)."""
    return (config._attn_implementation or "eager").removeprefix("paged|")


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
    return POSITION_SCHEMES[config.position_encoding].continuous_batching_refusal(config)


def refuse_unknown_kwargs(owner: str, kwargs: dict, allowed: frozenset) -> None:
    """Raise ``TypeError`` for the first keyword argument of ``owner.forward`` outside ``allowed``, as Python does
    for a function without ``**kwargs``."""
    for name in kwargs:
        if name not in allowed:
            raise TypeError(
                f"{owner}.forward() got an unexpected keyword argument {name!r} (it takes its named arguments and "
                f"Transformers' model keyword arguments: {', '.join(sorted(allowed))})"
            )


def split_loss_kwargs(owner: str, kwargs: dict, loss: frozenset) -> dict:
    """Check a head's keyword arguments (model ones and ``loss``'s) and take the loss-only ones out of ``kwargs``;
    returns what the loss gets (``num_items_in_batch`` stays in ``kwargs`` too: it is also a model argument)."""
    refuse_unknown_kwargs(owner, kwargs, MODEL_KWARGS | PAGED_KWARGS | loss)  # the model checks the paged ones
    return {name: kwargs.pop(name) if name not in MODEL_KWARGS else kwargs[name] for name in loss if name in kwargs}


def one_cache(cache: Optional[Cache], past_key_values: Optional[Cache]) -> Optional[Cache]:
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
# The checks of RelPosModel.forward's arguments
# ----------------------------------------------------------------------------------


def check_inputs(
    model, input_ids, inputs_embeds, attention_mask, position_ids, cache, mems, encoder_hidden_states,
    encoder_attention_mask, kwargs,
) -> Geometry:
    """Every check of ``forward``'s arguments, in the order they are read; a host read of a tensor's values
    runs in eager calls only (``torch.compiler.is_compiling()``), so a traced graph keeps none. Returns the
    forward's ``Geometry``: the cache read once (``read_cache``), the memory's length, or a continuous-batching
    step's ``paged`` arguments."""
    refuse_unknown_kwargs(type(model).__name__, kwargs, MODEL_KWARGS | PAGED_KWARGS)
    paged = isinstance(cache, PagedAttentionCache)
    _check_model_kwargs(model, kwargs, paged)
    _check_setup(model, cache, inputs_embeds)
    batch, length = _check_tokens(model, input_ids, inputs_embeds)
    if paged:
        step = _check_paged(model, cache, kwargs, attention_mask, position_ids, mems, encoder_hidden_states, batch, length)
        return Geometry(batch, length, kv_length=step[2], paged=step)
    given = sorted(PAGED_KWARGS & {name for name, value in kwargs.items() if value is not None})
    if given:
        raise ValueError(
            f"{', '.join(given)}: continuous batching's paged-cache arguments need its PagedAttentionCache as cache"
        )
    self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    geometry = _check_cache(model, self_cache, batch, length)
    # The tokens a cache holds, for checks that read them on the host: unknown in a traced graph (a static cache's
    # tensor).
    past = None if torch.compiler.is_compiling() and self_cache is not None else geometry.q_offset
    geometry = replace(geometry, mem_length=_check_mems(model, mems, self_cache, past, batch))
    _check_mask(model, attention_mask, geometry, mems, past)
    if position_ids is not None and (
        position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[-1] != length
    ):
        raise ValueError(
            f"position_ids must be [batch={batch} (or 1), seq_len={length}], got shape {tuple(position_ids.shape)}"
        )
    _check_encoder(model, encoder_hidden_states, encoder_attention_mask, batch)
    _check_packing(model, kwargs, attention_mask, geometry)
    return geometry

def _check_model_kwargs(model, kwargs: dict, paged: bool = False) -> None:
    """Transformers' model keyword arguments that these models cannot honour in every value: refused when
    they ask for something else than what the model does, never dropped. (Continuous batching passes
    ``is_causal=False`` with its own mask, and ``cu_seq_lens_k`` per layer type: ``_check_paged`` checks them.)"""
    is_causal = kwargs.get("is_causal")
    if is_causal is not None and not paged and bool(is_causal) != bool(model.config.is_decoder):
        raise ValueError(
            f"is_causal={is_causal!r}: this model's attention is {'causal' if model.config.is_decoder else 'bidirectional'}"
            f" (config.is_decoder={model.config.is_decoder}); build the model with the other is_decoder instead"
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

def _check_setup(model, cache, inputs_embeds=None) -> None:
    """The cache's kind, the attention implementation (and what FlexAttention cannot serve), and a cache under
    activation checkpointing."""
    if isinstance(cache, EncoderDecoderCache) and not (model.config.is_encoder_decoder and model.config.is_decoder):
        raise ValueError("an EncoderDecoderCache is for an encoder-decoder's decoder; this stack has no cross-attention")
    impl = model.config._attn_implementation or "eager"
    if isinstance(cache, PagedAttentionCache):  # continuous batching's paged|eager: our eager path
        impl = attention_implementation(model.config)
    if impl not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation must be one of {list(SUPPORTED_ATTN_IMPLEMENTATIONS)} for hf_relpos, got {impl!r}"
            + (" (continuous batching's, for its steps with a PagedAttentionCache)" if impl == "paged|eager" else "")
        )
    if impl == "flex_attention":
        if isinstance(cache, PagedAttentionCache):
            raise ValueError(
                "attn_implementation='flex_attention' with a PagedAttentionCache (continuous batching): its steps "
                "run hf_relpos' own paged path; use 'sdpa' or 'eager'"
            )
        needs_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in model.parameters())
            or (isinstance(inputs_embeds, torch.Tensor) and inputs_embeds.requires_grad)
        )
        refusal = flex_refusal(
            POSITION_SCHEMES[model.config.position_encoding], model.config, model.device, model.training, needs_grad
        )
        if refusal is not None:
            raise ValueError(refusal)
    if impl == TRITON:
        if isinstance(cache, PagedAttentionCache):
            raise ValueError(
                "attn_implementation='relpos_triton' with a PagedAttentionCache (continuous batching): its steps "
                "run hf_relpos' own paged path; use 'sdpa' or 'eager'"
            )
        refusal = triton_refusal(
            POSITION_SCHEMES[model.config.position_encoding], model.config, model.device, model.training
        )
        if refusal is not None:
            raise ValueError(refusal)
    if cache is not None and model._checkpointing():
        # A checkpointed layer runs twice (forward, then again in backward): a cache would take its keys twice.
        raise ValueError(
            "a cache (cache= / past_key_values=) cannot be used with activation checkpointing in training: a "
            "checkpointed layer runs again in backward and would add its keys twice. Pass no cache, or "
            "disable checkpointing (model.gradient_checkpointing_disable())"
        )

def _check_tokens(model, input_ids, inputs_embeds) -> tuple[int, int]:
    """Exactly one of ids (in the vocabulary) or embeddings, of at least one token: ``(batch, seq_len)``."""
    config = model.config
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

def _check_cache(model, cache, batch: int, length: int) -> Geometry:
    """A Transformers cache of this configuration with room for ``length`` more tokens; returns the forward's
    geometry as read from it (``read_cache``; no cache: nothing precedes)."""
    config = model.config
    if cache is not None and not isinstance(cache, Cache):
        raise ValueError(
            f"cache (past_key_values) must be a transformers Cache (e.g. DynamicCache), got {type(cache).__name__}"
        )
    # More layers than the model has: refused before the cache is read (a linear-attention layer has no geometry).
    too_many = cache is not None and len(cache.layers) > config.num_hidden_layers
    geometry = None if too_many else read_cache(cache, batch, length)
    if cache is None:
        return geometry
    if too_many or (geometry.cache_layers != config.num_hidden_layers and geometry.q_offset > 0):
        raise ValueError(
            f"cache (past_key_values) has {len(cache.layers)} layers, this model has num_hidden_layers="
            f"{config.num_hidden_layers}: the cache comes from a different configuration"
        )
    if geometry.cache_keys is not None:
        # a scheme may carry more channels in its keys (FoX's forget gate)
        channels = POSITION_SCHEMES[config.position_encoding].key_channels
        expected = (batch, config.num_attention_heads, config.head_dim + channels)
        got = geometry.cache_keys
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
    past, room = geometry.q_offset, geometry.room
    if not torch.compiler.is_compiling() and room is not None and past + length > room:
        raise ValueError(
            f"cache (past_key_values) is a {type(cache).__name__} of max_cache_len={room} holding {past} tokens: "
            f"no room for {length} more; build it with max_cache_len >= {past + length}"
        )
    return geometry

def _check_mems(model, mems, cache, past: Optional[int], batch: int) -> int:
    """Transformer-XL memories, one ``[batch, mem <= mem_len, hidden_size]`` per layer: their length (0 without)."""
    config = model.config
    if mems is None:
        return 0
    if config.mem_len == 0 or not POSITION_SCHEMES[config.position_encoding].takes_memory:
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
    dtype = next(model.embed_tokens.parameters()).dtype
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

def _check_mask(model, attention_mask, geometry: Geometry, mems, past: Optional[int]):
    """A 2-D padding mask over past (and memory) and current tokens, or a prepared 4-D one (``past``: the tokens the
    cache holds, None in a traced graph)."""
    batch, length, mem_length = geometry.batch, geometry.length, geometry.mem_length
    if attention_mask is not None and attention_mask.dim() == 4:
        # A prepared 4-D mask (generate builds one for static caches): [batch, 1, seq_len, keys].
        keys = geometry.kv_length
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

def _check_encoder(model, encoder_hidden_states, encoder_attention_mask, batch: int) -> None:
    """An encoder-decoder's decoder takes the encoder's states ``[batch, source_len, hidden_size]`` (and their
    ``[batch, source_len]`` mask); any other stack takes none."""
    if not (model.config.is_encoder_decoder and model.config.is_decoder):
        if encoder_hidden_states is not None:
            raise ValueError("encoder_hidden_states are for an encoder-decoder's decoder (is_encoder_decoder=True)")
        return
    hidden = model.config.hidden_size
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

def _check_paged(model, cache, kwargs, attention_mask, position_ids, mems, encoder_hidden_states, batch, length):
    """One continuous-batching step (``PagedAttentionArgs``): a config that can take part, requests packed in one
    row with their own ``position_ids`` and ``cu_seq_lens_q``, and the paged cache's arguments for this
    model's one group of layers: ``cu_seq_lens_k`` with as many requests, a read and a write index per group,
    no block table (flash attention's), a 4-D mask (or none) over the step's queries and keys. Returns this
    group's ``(cu_seq_lens_q, cu_seq_lens_k, key count)``."""
    refusal = continuous_batching_refusal(model.config)
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
    allocators = {cache.layer_to_allocator[i] for i in range(model.config.num_hidden_layers)}
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

def _check_packing(model, kwargs, attention_mask, geometry: Geometry) -> None:
    """``cu_seq_lens_q`` / ``seq_idx`` (packed sequences) describe this row's documents, in a forward with
    nothing else to go by."""
    cu_seq_lens, seq_idx = kwargs.get("cu_seq_lens_q"), kwargs.get("seq_idx")
    batch, length = geometry.batch, geometry.length
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
    if not (geometry.fresh and unpadded(attention_mask)):
        raise ValueError(
            "cu_seq_lens_q / seq_idx (packed sequences) need a forward without a cache, mems or an "
            "attention_mask with padding"
        )
