"""The position schemes of hf_relpos models, one small class each behind one seam, and what they share:
``PositionContext`` (where one forward's queries and keys sit) and the eager attention kernel.

``modeling_relpos.RelPosModel`` builds the context once per forward and asks its scheme for the per-forward
term; every attention layer hands queries, keys and values to ``scheme.attend``. Adding a scheme means one
function in ``functional.py``, one class here and one line in ``POSITION_SCHEMES``.
"""

import ctypes
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from transformers.masking_utils import (
    and_masks,
    bidirectional_mask_function,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
    sdpa_mask,
    sliding_window_bidirectional_overlay,
    sliding_window_overlay,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention_utils import _exporting
from .configuration_relpos import CAUSAL_ONLY, RelPosConfig
from .functional import (
    alibi_bias,
    alibi_key_bias,
    alibi_slopes,
    attention_with_bias,
    causal_key_bias_attention,
    fire_bias,
    fox_bias,
    fox_key_bias,
    kerple_log_bias,
    log_decay_bias,
    saturating_bias_attention,
    shaw_attention,
    sinusoidal_embedding,
    t5_bias_by_distance,
    t5_position_bias,
    transformer_xl_attention,
)
from .kernels import KEY_BIAS_SPAN

def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    """Plain attention in (at least) float32; a query row with no key left gives zeros, as SDPA does."""
    work = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query, key.transpose(2, 3)).to(work) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            keep = attention_mask
        else:
            keep = attention_mask > torch.finfo(attention_mask.dtype).min / 2
            scores = scores + attention_mask.to(work).masked_fill(~keep, 0.0)
        scores = scores.masked_fill(~keep, torch.finfo(work).min)
    weights = F.softmax(scores, dim=-1)
    if attention_mask is not None:
        weights = weights.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)
    weights = weights.to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


# ----------------------------------------------------------------------------------
# Where one forward's queries and keys sit, and what they may attend to
# ----------------------------------------------------------------------------------


def cache_offsets(cache, length: int) -> tuple:
    """``(q_offset, kv_length, kv_offset)``: queries at ``q_offset + i``, keys at ``kv_offset + j`` for
    ``j < kv_length``, read from the cache before any layer updates it (a static cache's are tensors, read
    once in eager calls and kept as tensors in a traced graph)."""
    if cache is None:
        return 0, length, 0
    q_offset = cache.get_query_offset(0)
    kv_length, kv_offset = cache.get_mask_sizes(length, 0)
    if not torch.compiler.is_compiling():
        q_offset, kv_length, kv_offset = int(q_offset), int(kv_length), int(kv_offset)
    return q_offset, kv_length, kv_offset


def is_fresh(q_offset, kv_length: int, length: int, mem_length: int) -> bool:
    """Self-attention of the inputs alone: no past in the cache (nor a static cache's slots), no memory."""
    return isinstance(q_offset, int) and q_offset == 0 and kv_length == length and not mem_length


def unpadded(attention_mask: Optional[torch.Tensor]) -> bool:
    """No padding known: no mask, or a 2-D mask of ones (read in eager calls only: a traced graph cannot)."""
    if attention_mask is None:
        return True
    return attention_mask.dim() == 2 and not torch.compiler.is_compiling() and bool(attention_mask.all())


def packed_documents(packed: dict, position_ids, attention_mask, fresh: bool, batch: int, length: int, device):
    """``[B, Q]`` document index of each token of packed rows, or None when the rows are not packed.

    From ``cu_seq_lens_q`` or ``seq_idx`` (``DataCollatorWithFlattening``; checked by the model), else, as
    Transformers' masks do (``_preprocess_mask_arguments``), from ``position_ids`` that restart
    (``find_packed_sequence_indices``), and then only in a forward with nothing else to go by: no past and no
    ``attention_mask`` (generate's position_ids for left padding also restart at each row's first token, and a
    row of ones is no sign of packing), in eager and traced calls alike.
    """
    cu_seq_lens, seq_idx = packed.get("cu_seq_lens_q"), packed.get("seq_idx")
    if cu_seq_lens is not None:
        return torch.searchsorted(cu_seq_lens[1:].to(device), torch.arange(length, device=device), right=True)[None]
    if seq_idx is not None:
        return seq_idx.to(device)
    if not fresh or position_ids is None or length < 2 or attention_mask is not None:
        return None
    return find_packed_sequence_indices(position_ids.expand(batch, -1))  # None in eager when not packed


def self_attention_mask(
    attention_mask, documents, window, *, one_sided, batch, length, q_offset, kv_length, kv_offset, mem_length, device
) -> Optional[torch.Tensor]:
    """What the queries may attend to besides causality: bool ``[B|1, 1, Q, M + K]`` (True = may attend) over
    the memory, cache and current keys, or None when nothing else is masked.

    Transformers' mask functions (padding, packed documents, a causal ``i - j < W`` or bidirectional
    ``|i - j| <= W`` window) joined by ``and_masks`` and rendered by its boolean renderer ``sdpa_mask``, for
    every attention implementation: the schemes merge the mask with their own terms. Own code for what
    ``create_causal_mask`` / ``create_bidirectional_mask`` do otherwise (the padding rides in ``sdpa_mask``'s
    ``attention_mask``, its ``padding_mask_function``):

    - causality stays out (``PositionContext.causal``): with nothing else masked the mask is None and the
      fused causal kernels stay available (``create_causal_mask`` materialises causality under eager and as
      soon as an extra mask function joins, and for every batch row);
    - a mask of batch 1 when nothing differs between rows (a window alone), so that a bias merged with it
      stays ``[1, H, Q, K]``;
    - Transformer-XL's memory keys precede the cache's positions, which Transformers' masks know nothing
      of: they are always visible, unless the 2-D mask has columns for them;
    - a prepared 4-D mask (generate's, for static caches) is taken as it is, a float one read as bool.
    """
    prepared = attention_mask if attention_mask is not None and attention_mask.dim() == 4 else None
    padding = attention_mask if prepared is None else None
    if prepared is not None and prepared.dtype != torch.bool:
        prepared = prepared > torch.finfo(prepared.dtype).min / 2
    if padding is not None:
        padding = padding.to(device=device, dtype=torch.bool)
        covers_memory = mem_length and padding.shape[1] == mem_length + length
        if not covers_memory and not torch.compiler.is_compiling() and bool(padding.all()):
            padding = None
        elif mem_length and not covers_memory:
            padding = F.pad(padding, (mem_length, 0), value=True)
    functions = [] if documents is None else [packed_sequence_mask_function(documents)]
    if window is not None:
        functions.append(sliding_window_overlay(window) if one_sided else sliding_window_bidirectional_overlay(window))
    if padding is None and not functions:
        return prepared
    mask = sdpa_mask(
        batch_size=batch if padding is not None or documents is not None else 1,
        q_length=length,
        kv_length=mem_length + kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=and_masks(bidirectional_mask_function, *functions),
        attention_mask=padding,
        allow_is_causal_skip=False,
        device=device,
    )
    return mask if prepared is None else prepared & mask


@dataclass
class PositionContext:
    """Where the queries and keys of one forward sit, computed once and shared by all layers.

    Queries sit at absolute positions ``q_offset + i`` (or ``position_ids``); the ``key_length`` keys
    the layers attend to (memory + cache + current) start at absolute position ``q_offset - past_length``.
    ``mask`` is a bool ``[B, 1, Q, K]`` (True = may attend) or None when nothing is masked beyond
    causality, which ``causal`` states; ``alive`` is ``[B, 1, Q, 1]``, the query rows with a key left
    (None: all of them). ``attn_implementation`` is ``"eager"`` whenever the layers must return
    their attention probabilities (``output_attentions``), which only a materialising path has.
    """

    query_length: int
    key_length: int
    q_offset: int
    past_length: int
    causal: bool
    mask: Optional[torch.Tensor]
    position_ids: torch.Tensor
    attn_implementation: str
    output_attentions: bool
    alive: Optional[torch.Tensor]
    # The model-level scheme, referenced here rather than passed to layers as a module argument: device
    # hooks (accelerate) would otherwise move its weights on every call.
    scheme: "PositionScheme"
    # ``mask`` as bool ``[B, 1, 1, K]`` when it masks keys alone (padding of a fresh forward), else None:
    # the fused paths (band decomposition, per-key ALiBi) take such a mask without a [Q, K] tensor.
    key_mask: Optional[torch.Tensor] = None
    # Explicit positions (a continuous-batching step, ``from_paged``): ``[Q, K]`` long, each key's position minus
    # each query's, which every scheme's term reads instead of the band ``past_length + i``; ``mask`` then holds
    # causality too. None otherwise.
    relative_position: Optional[torch.Tensor] = None
    # The paged cache's keyword arguments for ``cache.update`` (read/write indices, cu_seq_lens_k, ...), or None.
    paged: Optional[dict] = None

    @classmethod
    def from_inputs(
        cls, config: RelPosConfig, scheme: "PositionScheme", inputs_embeds: torch.Tensor, attention_mask, position_ids,
        cache, mems, packed: dict, attn_implementation: str, output_attentions: bool,
    ) -> "PositionContext":
        """The context of one forward over checked inputs: offsets read from the cache before any layer updates it,
        packed documents, position ids, the mask and the live query rows. ``packed`` holds the
        ``cu_seq_lens_q`` / ``seq_idx`` keyword arguments (None when absent)."""
        batch, length = inputs_embeds.shape[:2]
        device = inputs_embeds.device
        mem_length = mems[0].shape[1] if mems is not None else 0
        q_offset, kv_length, kv_offset = cache_offsets(cache, length)
        fresh = is_fresh(q_offset, kv_length, length, mem_length)
        documents = packed_documents(packed, position_ids, attention_mask, fresh, batch, length, device)
        if position_ids is None and documents is not None:  # packed by cu_seq_lens_q / seq_idx alone
            token = torch.arange(length, device=device).expand(batch, -1)
            first = torch.ones_like(documents, dtype=torch.bool)
            first[:, 1:] = documents[:, 1:] != documents[:, :-1]
            position_ids = token - torch.where(first, token, 0).cummax(-1).values
        elif position_ids is None:
            position_ids = (torch.arange(length, device=device) + q_offset)[None]
        scheme.check_positions(position_ids)
        window = config.sliding_window if mems is None else None
        mask = self_attention_mask(
            attention_mask, documents, window, one_sided=config.is_decoder or config.memory_window is not None,
            batch=batch, length=length, q_offset=q_offset, kv_length=kv_length, kv_offset=kv_offset,
            mem_length=mem_length, device=device,
        )
        ctx = cls(
            query_length=length,
            key_length=mem_length + kv_length,
            q_offset=q_offset,
            past_length=mem_length + q_offset - kv_offset,
            causal=config.is_decoder,
            mask=mask,
            position_ids=position_ids,
            # Attention probabilities exist only on the materialising (eager) paths: take them when asked.
            attn_implementation="eager" if output_attentions else attn_implementation,
            output_attentions=output_attentions,
            alive=None,
            scheme=scheme,
        )
        ctx.alive = ctx.live_rows(device)
        if mask is not None and documents is None and attention_mask is not None and config.sliding_window is None:
            if fresh and attention_mask.dim() == 2:
                ctx.key_mask = attention_mask.bool()[:, None, None, :]
        return ctx

    @classmethod
    def from_paged(
        cls, config: RelPosConfig, scheme: "PositionScheme", inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
        cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor, key_length: int, paged: dict,
        attn_implementation: str, output_attentions: bool,
    ) -> "PositionContext":
        """The context of one continuous-batching step (checked by the model): requests packed in one row
        (``cu_seq_lens_q``), each query at its own request's position (``position_ids``), and the ``key_length``
        keys the paged cache hands back, each request's (past and new, in order) in its ``cu_seq_lens_k`` segment,
        the last one at its last query's position (a sliding window's cache keeps only the latest). Each pair gets
        its own distance; keys of another request, later keys and keys beyond ``sliding_window`` are masked."""
        device = inputs_embeds.device
        length = inputs_embeds.shape[1]
        cu_q = cu_seq_lens_q.to(device=device, dtype=torch.long)
        cu_k = cu_seq_lens_k.to(device=device, dtype=torch.long)
        positions = position_ids.to(device=device, dtype=torch.long)
        query_request = torch.searchsorted(cu_q[1:], torch.arange(length, device=device), right=True)
        key = torch.arange(key_length, device=device)
        key_request = torch.searchsorted(cu_k[1:], key, right=True)  # past the last segment: no request's
        last_query = positions[0, (cu_q[1:] - 1).clamp(0, length - 1)]  # [R]: each request's last query position
        segment_end = torch.cat([cu_k[1:], cu_k[-1:]])  # a key past the segments reads the sentinel, masked
        key_positions = last_query[key_request.clamp(max=last_query.numel() - 1)] - (segment_end[key_request] - 1 - key)
        relative = key_positions[None, :] - positions[0][:, None]  # [Q, K]
        mask = (query_request[:, None] == key_request[None, :]) & (relative <= 0)
        if config.sliding_window is not None:
            mask &= relative > -config.sliding_window
        scheme.check_positions(positions)
        ctx = cls(
            query_length=length,
            key_length=key_length,
            q_offset=0,
            past_length=0,
            causal=True,
            mask=mask[None, None],
            position_ids=positions,
            attn_implementation="eager" if output_attentions else attn_implementation,
            output_attentions=output_attentions,
            alive=None,
            scheme=scheme,
            relative_position=relative,
            paged=paged,
        )
        ctx.alive = ctx.live_rows(device)
        return ctx

    def to(self, device, non_blocking: bool = False) -> "PositionContext":
        """Called by accelerate's hooks when a layer sits on another device."""
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, mask=move(self.mask), position_ids=move(self.position_ids), alive=move(self.alive),
                       key_mask=move(self.key_mask), relative_position=move(self.relative_position))

    @property
    def traced_offset(self) -> bool:
        """The offsets are a static cache's tensors, traced by ``torch.compile``: their values are unknown
        on the host, so every branch that depends on them takes the path that is right for any value."""
        return isinstance(self.past_length, torch.Tensor)

    @property
    def keys_end_at_query(self) -> bool:
        """The keys end at the last query (every key slot filled); not so in a StaticCache, whose unfilled
        slots follow the queries (and a traced offset may leave any number of them)."""
        if self.relative_position is not None:
            return False
        return not self.traced_offset and self.key_length == self.past_length + self.query_length

    @property
    def keys_only(self) -> bool:
        """Nothing is masked beyond causality but keys (padding): self-attention of a fresh forward."""
        fresh = not self.traced_offset and self.past_length == 0 and self.key_length == self.query_length
        return fresh and self.relative_position is None and (self.mask is None or self.key_mask is not None)

    def causal_mask(self, device) -> torch.Tensor:
        """[1, 1, Q, K] bool: key j is at or before the query's position."""
        i = torch.arange(self.query_length, device=device)[:, None] + self.past_length
        j = torch.arange(self.key_length, device=device)[None, :]
        return (j <= i)[None, None]

    def full_mask(self, device) -> Optional[torch.Tensor]:
        """The bool mask including causality (and a static cache's unfilled slots), or None if nothing is masked."""
        mask = self.mask
        if self.relative_position is not None:  # explicit positions: the mask holds causality already
            return mask
        if self.causal:
            causal = self.causal_mask(device)
            mask = causal if mask is None else mask & causal
        elif not self.keys_end_at_query:
            filled = (torch.arange(self.key_length, device=device) < self.past_length + self.query_length)
            mask = filled[None, None, None] if mask is None else mask & filled
        return mask

    def live_rows(self, device) -> Optional[torch.Tensor]:
        """``[B, 1, Q, 1]`` bool: query rows with at least one visible key, or None when every row has one."""
        if self.mask is None:  # causality and a static cache's fill always leave a query its own key
            return None
        alive = self.full_mask(device).any(dim=-1, keepdim=True)
        if torch.compiler.is_compiling():  # no host sync in a traced graph: keep the (cheap) mask
            return alive
        return None if bool(alive.all()) else alive


# ----------------------------------------------------------------------------------
# Position schemes: the seam
# ----------------------------------------------------------------------------------


class PositionScheme(nn.Module):
    """A position scheme answers four questions; the default answer is "nothing".

    - ``embed``: what it adds to the token embeddings (absolute baselines);
    - ``forward``: the per-forward term, computed once for the new query rows against all keys and
      handed to every layer (a bias merged into the mask, RoPE's cos/sin, Transformer-XL's distances);
    - ``rotate``: what it does to queries and keys before the cache (RoPE);
    - ``prepare``: what it derives from each layer's input before the cache (FoX's forget gate, carried in
      ``key_channels`` extra channels of the keys, so that every cache operation keeps it with its key);
    - ``attend``: the attention call, returning the output ``[B, Q, H, D]`` and the probabilities
      ``[B, H, Q, K]`` when ``ctx.output_attentions`` (else None); the default runs Transformers'
      attention interface with the term as the mask, so an additive bias rides in SDPA's fused kernel.

    Per-layer parameters (Shaw's embeddings, Transformer-XL's ``W_{k,R}``, ``u``, ``v``) come from
    ``layer_module`` and live in each attention module as ``relative``.
    """

    # The std the token embeddings start with, where the scheme's recipe asks for one (None: initializer_range).
    token_init_std: Optional[float] = None
    # Channels the scheme appends to the keys (and so to the cache's keys) beyond head_dim, in ``prepare``.
    key_channels: int = 0

    def __init__(self, config: RelPosConfig):
        super().__init__()
        if config.position_encoding in CAUSAL_ONLY and not config.is_decoder:  # is_decoder set after construction
            raise ValueError(
                f"RelPosConfig.is_decoder must be True for position_encoding={config.position_encoding!r} (defined "
                f"for causal attention only), got {config.is_decoder!r}"
            )
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim

    @staticmethod
    def layer_module(config: RelPosConfig) -> Optional[nn.Module]:
        return None

    def check_positions(self, position_ids: torch.Tensor) -> None:
        """Refuse positions the scheme cannot embed (an absolute table's end); runs before any layer."""

    def embed(self, inputs_embeds: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        return inputs_embeds

    def forward(self, ctx: PositionContext, device, dtype) -> Any:
        # With nothing masked beyond causality, SDPA's own is_causal flag keeps the fused kernel; it
        # aligns the causal pattern top-left, which is right only when queries and keys coincide.
        if ctx.attn_implementation == "sdpa" and ctx.mask is None and ctx.keys_end_at_query:
            if not ctx.causal or ctx.query_length in (1, ctx.key_length):
                return None
        return ctx.full_mask(device)

    def rotate(self, query, key, term, ctx):
        return query, key

    def prepare(self, attn: nn.Module, hidden_states, query, key, ctx: PositionContext):
        """Queries and keys after what the scheme derives from the layer's input ``hidden_states`` (what
        ``q_proj`` reads), before the cache update; ``attend`` gets the keys as cached."""
        return query, key

    def attend(self, attn: nn.Module, query, key, value, term, ctx: PositionContext):
        interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(ctx.attn_implementation, eager_attention_forward)
        mask = term if isinstance(term, torch.Tensor) else None
        out, weights = interface(
            attn,
            query,
            key,
            value,
            mask,
            dropout=attn.attention_dropout if attn.training else 0.0,
            scaling=attn.scaling,
            is_causal=ctx.causal and mask is None,
        )
        if ctx.alive is not None and _exporting():
            # Zeros for a query with no key left, as eager SDPA gives: the ONNX translation of SDPA with a boolean
            # mask averages the masked values there instead.
            out = out * ctx.alive.transpose(1, 2)
        return out, weights


class AdditiveBiasScheme(PositionScheme):
    """A scheme whose whole position term is an additive ``[1, H, Q, K]`` bias.

    The bias is computed once per forward and merged with the mask into one float tensor
    (masked entries at the dtype's minimum) that every layer passes to the kernel as its mask. That
    tensor is the whole per-forward term, so that it reaches the layers as a positional tensor, which
    reentrant activation checkpointing needs to carry a trained bias's gradient back to its table.

    A scheme whose bias has a compact form that a fused CPU path takes (T5's bias per clipped distance,
    causal ALiBi's bias per key) returns that 2-D tensor from ``compact`` and attends with it in
    ``attend_compact``; ``compact`` is asked only for unmasked (or padded) self-attention of a fresh
    forward on CPU's sdpa path without attention dropout.
    """

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.attention_dropout = config.attention_dropout

    def bias(self, ctx: PositionContext, device, dtype) -> torch.Tensor:
        raise NotImplementedError

    def compact(self, ctx: PositionContext, device, dtype) -> Optional[torch.Tensor]:
        return None

    def attend_compact(self, attn, query, key, value, compact, ctx) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, ctx: PositionContext, device, dtype) -> torch.Tensor:
        """The compact form where one applies, else the bias merged with the mask: ``[B|1, H, Q, K]``."""
        fused_cpu = (
            not _exporting()  # the compact forms' paths are eager fast paths (T5's band reads its reach on the host)
            and ctx.attn_implementation == "sdpa"
            and device.type == "cpu"
            and ctx.keys_only
            and not (self.training and self.attention_dropout > 0.0)
        )
        compact = self.compact(ctx, device, dtype) if fused_cpu else None
        if compact is not None:
            return compact
        bias = self.bias(ctx, device, dtype).to(dtype)
        mask = ctx.full_mask(device)
        return bias if mask is None else torch.where(mask, bias, torch.finfo(dtype).min)

    def attend(self, attn, query, key, value, bias, ctx):
        if bias.dim() == 2:  # the compact form of forward()
            return self.attend_compact(attn, query, key, value, bias, ctx).transpose(1, 2), None
        return attend_merged_bias(self, attn, query, key, value, bias, ctx)


def attend_merged_bias(scheme: PositionScheme, attn, query, key, value, bias, ctx):
    """Attention with a bias merged with the mask (``[B|1, H, Q, K]``, masked entries at the dtype's minimum)."""
    dropout = attn.attention_dropout if attn.training else 0.0
    if ctx.attn_implementation == "sdpa" and bias.requires_grad and dropout == 0.0 and query.is_cpu:
        # A trained bias (T5's) would push CPU SDPA onto its slow math path: keep the fused kernel.
        out, weights = attention_with_bias(query, key, value, bias, scale=attn.scaling).transpose(1, 2), None
    else:
        out, weights = PositionScheme.attend(scheme, attn, query, key, value, bias, ctx)
    if ctx.alive is not None:
        # A query with no key left (padding) gives zeros under every kernel, as in plain SDPA: the
        # finfo.min entries of the merged bias would otherwise average the masked values.
        out = out * ctx.alive.transpose(1, 2)
    if _exporting():
        # A copy in the exported graph: with a bias that needs a gradient, the ONNX exporter decomposes SDPA into
        # an output of another layout than the traced one, which the layer's reshape (traced as a view) cannot view.
        out = out.clone(memory_format=torch.contiguous_format)
    return out, weights


class T5BiasScheme(AdditiveBiasScheme):
    """Raffel et al. 2020: a learned scalar per (distance bucket, head), one table for all layers."""

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.bidirectional = not config.is_decoder
        self.max_distance = config.relative_attention_max_distance
        self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_attention_heads)
        # Upstream T5's initialisation of the table (T5PreTrainedModel._init_weights, factor 1), not initializer_range.
        self.relative_attention_bias.init_std = config.hidden_size**-0.5

    def bias(self, ctx, device, dtype):
        return t5_position_bias(
            self._weight(device),
            ctx.query_length,
            ctx.key_length,
            bidirectional=self.bidirectional,
            max_distance=self.max_distance,
            past_length=ctx.past_length,
            relative_position=ctx.relative_position,
        )

    def _weight(self, device) -> torch.Tensor:
        table = self.relative_attention_bias
        return table(torch.arange(table.num_embeddings, device=device))

    def compact(self, ctx, device, dtype):
        """The bias per clipped distance ``[H, 2s+1]``: beyond ``s`` it is constant, and those key ranges run
        in the fused kernel (saturating_bias_attention, which takes the band once the sequence is long
        enough to pay); no ``[1, H, Q, K]`` bias is formed."""
        weight = self._weight(device)
        return t5_bias_by_distance(weight, bidirectional=self.bidirectional, max_distance=self.max_distance).to(dtype)

    def attend_compact(self, attn, query, key, value, compact, ctx):
        return saturating_bias_attention(
            query, key, value, compact, attention_mask=ctx.key_mask, is_causal=ctx.causal, scale=attn.scaling
        )


class LogDecayScheme(AdditiveBiasScheme):
    """The fixed bias ``-λ·ln(1 + |i - j|)``, the same for every head."""

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.scale = config.log_decay_scale

    def bias(self, ctx, device, dtype):
        bias = log_decay_bias(
            ctx.query_length, ctx.key_length, scale=self.scale, past_length=ctx.past_length, device=device,
            dtype=torch.float32, relative_position=ctx.relative_position,
        )
        return bias[None, None]


class AlibiScheme(AdditiveBiasScheme):
    """Press et al. 2022: ``-m_h·|i - j|`` with fixed geometric head slopes."""

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        # The fixed slopes in float32 as a plain attribute, not a buffer, which `.to(bf16)` would round (and
        # `from_pretrained` would rebuild in float32: a model that changes when reloaded); made here, on the CPU
        # (also under from_pretrained's meta device), not in forward, where torch.export's strict tracing would
        # lift a fresh tensor under the path it reached the module by (after Transformers' DynamoExporter,
        # `model.forward.__self__...`, which unlifting cannot find).
        self.slopes = alibi_slopes(self.num_heads, device="cpu", dtype=torch.float32)

    def bias(self, ctx, device, dtype):
        return alibi_bias(
            self.slopes.to(device), ctx.query_length, ctx.key_length, past_length=ctx.past_length,
            relative_position=ctx.relative_position,
        )

    def compact(self, ctx, device, dtype):
        """Causal ALiBi as a bias per key ``[H, K]`` (softmax ignores the row constant), which rides in the
        fused causal kernel (causal_key_bias_attention); in float64, so that the kernel's per-chunk
        differences of it are exact. Full precision only: half precision keeps the exact form."""
        if not ctx.causal or ctx.query_length < 2 or dtype not in (torch.float32, torch.float64):
            return None
        return alibi_key_bias(alibi_slopes(self.num_heads, device=device, dtype=torch.float64), ctx.key_length)

    def attend_compact(self, attn, query, key, value, compact, ctx):
        return causal_key_bias_attention(query, key, value, compact, attention_mask=ctx.key_mask, scale=attn.scaling)


class KerpleLogScheme(AdditiveBiasScheme):
    """Chi et al. 2022 (KERPLE, logarithmic variant): ``-r1_h·ln(1 + r2_h·|i - j|)``, learned ``r1_h, r2_h > 0``."""

    # KERPLE's code keeps r1, r2 positive by clamping them at this floor.
    floor = 1e-2

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.r1 = nn.Parameter(torch.ones(config.num_attention_heads))
        self.r2 = nn.Parameter(torch.ones(config.num_attention_heads))

    def bias(self, ctx, device, dtype):
        # Clamped in value, not in gradient (straight through): a parameter below the floor can still come back,
        # as with KERPLE's in-place clamp of the data; a plain clamp_min would freeze it there for good.
        r1, r2 = (r + (r.clamp_min(self.floor) - r).detach() for r in (self.r1, self.r2))
        return kerple_log_bias(
            r1, r2, ctx.query_length, ctx.key_length, past_length=ctx.past_length,
            relative_position=ctx.relative_position,
        )


class FireScheme(AdditiveBiasScheme):
    """Li et al. 2024 (FIRE): a learned MLP of the progressively normalised log distance, causal."""

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.init_threshold = config.fire_threshold
        self.mlp = nn.Sequential(
            nn.Linear(1, config.fire_mlp_width), nn.ReLU(), nn.Linear(config.fire_mlp_width, config.num_attention_heads)
        )
        # PyTorch's default Linear initialisation, as the paper's code: with the model's (zero biases, inputs
        # >= 0) every unit with a negative input weight would start, and stay, dead under the ReLU.
        for linear in (self.mlp[0], self.mlp[2]):
            linear.torch_default_init = True
        self.c = nn.Parameter(torch.tensor(0.1))
        # The threshold L as the paper's code learns it: a multiplier of its initial value.
        self.threshold_scale = nn.Parameter(torch.tensor(1.0))

    def bias(self, ctx, device, dtype):
        first, last = self.mlp[0], self.mlp[2]
        threshold = (self.threshold_scale * self.init_threshold).abs()
        # The normaliser reads each query's position in its sequence (ctx.position_ids: a sliding window's
        # dropped keys, left padding and packed documents make it differ from its index among the keys).
        return fire_bias(
            first.weight, first.bias, last.weight, last.bias, self.c, threshold, ctx.query_length, ctx.key_length,
            past_length=ctx.past_length, positions=ctx.position_ids, relative_position=ctx.relative_position,
        )


class ForgetGate(nn.Module):
    """One layer's FoX forget gate, ``log f_t = logsigmoid(fgate_proj(x_t))`` per head, in float32.

    Named and initialised as the authors' ``fgate_proj`` (zhixuan-lin/forgetting-transformer,
    ``modeling_forgetting_transformer.py``, ``fgate_type="full"``): ``Linear(hidden, heads, bias=True)``, weights
    ``N(0, initializer_range)`` and zero bias (their ``_init_weights``; the model's), so ``f`` starts near 1/2.
    """

    def __init__(self, config: RelPosConfig):
        super().__init__()
        self.fgate_proj = nn.Linear(config.hidden_size, config.num_attention_heads, bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[B, T, hidden] -> [B, H, T]``."""
        return F.logsigmoid(self.fgate_proj(hidden_states).float()).transpose(1, 2)


class FoxScheme(PositionScheme):
    """Lin et al. 2025 (the Forgetting Transformer): no position encoding, and a forget gate per layer and
    head: query ``i`` scores key ``j <= i`` with ``q_i·k_j + Σ_{l=j+1..i} log f_l`` (causal only).

    ``prepare`` computes each token's ``log f`` from the layer's input and carries it as one more channel of
    its key (keys cached as ``[B, H, T, head_dim + 1]``), so the cache's every operation (beam reorder, crop,
    batch select, a StaticCache's slots, a sliding window) keeps it with its key; ``attend`` splits it off and
    takes ``c = cumsum(log f)`` over the keys it holds: the fused per-key path (``-c_j``) for self-attention of
    a fresh forward on CPU, else the exact ``c_{past+i} - c_j`` merged with the mask. In half precision the
    cached ``log f`` rounds to the keys' dtype (the same for cached and uncached calls).
    """

    key_channels = 1

    @staticmethod
    def layer_module(config):
        return ForgetGate(config)

    def forward(self, ctx, device, dtype):
        return None  # the term depends on each layer's gate: made in attend

    def prepare(self, attn, hidden_states, query, key, ctx):
        log_forget = attn.relative(hidden_states)  # [B, H, T]
        return query, torch.cat([key, log_forget.to(key.dtype)[..., None]], dim=-1)

    def attend(self, attn, query, key, value, term, ctx):
        key, log_forget = key[..., :-1], key[..., -1]
        dropout = attn.attention_dropout if attn.training else 0.0
        fused_cpu = (
            not _exporting()
            and ctx.attn_implementation == "sdpa"
            and query.device.type == "cpu"
            and query.dtype in (torch.float32, torch.float64)
            and ctx.keys_only
            and dropout == 0.0
        )
        if fused_cpu:
            out = causal_key_bias_attention(
                query, key, value, fox_key_bias(log_forget), attention_mask=ctx.key_mask, scale=attn.scaling,
                span=KEY_BIAS_SPAN,
            )
            return out.transpose(1, 2), None
        bias = fox_bias(log_forget, ctx.query_length, past_length=ctx.past_length).to(query.dtype)
        bias = torch.where(ctx.full_mask(query.device), bias, torch.finfo(query.dtype).min)
        return attend_merged_bias(self, attn, query, key, value, bias, ctx)


class RopeScheme(PositionScheme):
    """Su et al. 2021: rotate query/key pairs by ``position · θ^(-2k/d)`` (the plain-SDPA floor)."""

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.theta = config.rope_theta

    def forward(self, ctx, device, dtype):
        exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
        freqs = ctx.position_ids[..., None].float() * (1.0 / self.theta**exponents)[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B|1, Q, D]
        return super().forward(ctx, device, dtype), emb.cos().to(dtype), emb.sin().to(dtype)

    def rotate(self, query, key, term, ctx):
        _, cos, sin = term
        cos, sin = cos[:, None], sin[:, None]

        def rotate_half(x):
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((-x2, x1), dim=-1)

        return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin

    def attend(self, attn, query, key, value, term, ctx):
        return super().attend(attn, query, key, value, term[0], ctx)


class AbsoluteScheme(PositionScheme):
    """Absolute positions added to the token embeddings, limited to ``max_position_embeddings``."""

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.max_positions = config.max_position_embeddings
        self.encoding = config.position_encoding

    def check_positions(self, position_ids):
        if not torch.compiler.is_compiling():  # a host read: eager calls only
            first, last = int(position_ids.min()), int(position_ids.max())
            if first < 0:
                raise ValueError(
                    f"position_ids hold a negative position {first}: the {self.encoding!r} position table starts at 0"
                )
            if last >= self.max_positions:
                raise ValueError(
                    f"position {last} is past max_position_embeddings={self.max_positions} of the "
                    f"{self.encoding!r} position table: inputs (with cache) may hold at most "
                    f"{self.max_positions} tokens"
                )


class SinusoidalScheme(AbsoluteScheme):
    """Vaswani et al. 2017's fixed sinusoidal absolute positions."""

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.hidden_size = config.hidden_size
        # The paper's (tensor2tensor's) token embeddings start at std d_model**-0.5: times sqrt(d_model),
        # unit-size vectors beside unit-amplitude sinusoids.
        self.token_init_std = config.hidden_size**-0.5

    def embed(self, inputs_embeds, ctx):
        """Vaswani et al. 2017, sec. 3.4: the token embeddings are multiplied by ``sqrt(d_model)`` before the
        unit-amplitude sinusoids are added, so that neither drowns the other as training moves them."""
        positions = ctx.position_ids.flatten().float()
        table = sinusoidal_embedding(positions, self.hidden_size).view(*ctx.position_ids.shape, -1)
        return inputs_embeds * math.sqrt(self.hidden_size) + table.to(inputs_embeds.dtype)


class LearnedScheme(AbsoluteScheme):
    """A learned absolute position embedding table (GPT-2 style)."""

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        # GPT-2's recipe: the position table starts at half the token embeddings' std (0.01 beside 0.02).
        self.position_embeddings.init_std = config.initializer_range / 2

    def embed(self, inputs_embeds, ctx):
        return inputs_embeds + self.position_embeddings(ctx.position_ids).to(inputs_embeds.dtype)


class NoPEScheme(PositionScheme):
    """Kazemnejad et al. 2023: no position information; the causal mask alone orders the tokens."""


class ShawRelative(nn.Module):
    """One layer's relative key (and value) embeddings for distances ``-k .. k`` (shared by heads)."""

    def __init__(self, config: RelPosConfig):
        super().__init__()
        n = 2 * config.max_relative_position + 1
        self.rel_k = nn.Parameter(torch.zeros(n, config.head_dim))
        self.rel_v = nn.Parameter(torch.zeros(n, config.head_dim)) if config.shaw_value_embeddings else None

    def forward(self):
        # called (not just read) so that accelerate's offload hooks load these parameters
        return self.rel_k, self.rel_v


class ShawScheme(PositionScheme):
    """Shaw et al. 2018: learned relative key/value embeddings, distances clipped to ``[-k, k]``."""

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.max_relative_position = config.max_relative_position

    @staticmethod
    def layer_module(config):
        return ShawRelative(config)

    def forward(self, ctx, device, dtype):
        return None

    @staticmethod
    def _mask(ctx: PositionContext, device) -> Optional[torch.Tensor]:
        """Padding alone as a key mask (the band keeps it); bidirectional attention also masks a static
        cache's unfilled slots, which causality hides otherwise."""
        if ctx.key_mask is not None:
            return ctx.key_mask
        return ctx.mask if ctx.causal else ctx.full_mask(device)

    def attend(self, attn, query, key, value, term, ctx):
        rel_k, rel_v = attn.relative()
        out = shaw_attention(
            query,
            key,
            value,
            rel_k,
            rel_v,
            max_relative_position=self.max_relative_position,
            attention_mask=self._mask(ctx, query.device),
            is_causal=ctx.causal,
            past_length=ctx.past_length,
            dropout_p=attn.attention_dropout if attn.training else 0.0,
            need_weights=ctx.output_attentions,
            relative_position=ctx.relative_position,
        )
        out, weights = out if ctx.output_attentions else (out, None)
        return out.transpose(1, 2), weights


class TransformerXLRelative(nn.Module):
    """One layer's ``W_{k,R}`` (``r_net``) and global biases ``u`` (``r_w_bias``), ``v`` (``r_r_bias``)."""

    def __init__(self, config: RelPosConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.r_net = nn.Linear(config.hidden_size, config.num_attention_heads * config.head_dim, bias=False)
        self.r_w_bias = nn.Parameter(torch.zeros(config.num_attention_heads, config.head_dim))
        self.r_r_bias = nn.Parameter(torch.zeros(config.num_attention_heads, config.head_dim))
        self._projected = None  # inference only: (weights, device, dtype, highest distance, [H, span, D] descending)

    def train(self, mode: bool = True):
        self._projected = None
        return super().train(mode)

    def _project(self, distances: torch.Tensor, dtype) -> torch.Tensor:
        """``W_{k,R} R_d`` per head: ``[H, len(distances), D]``."""
        r = self.r_net(sinusoidal_embedding(distances, self.hidden_size).to(dtype))
        # shape[0], not len(): len() of a traced length would fix it to the traced value
        return r.view(distances.shape[0], self.num_heads, self.head_dim).transpose(0, 1).contiguous()

    def forward(self, distances: "RelativeDistances", dtype):
        """``W_{k,R} R_d`` for each distance (``[H, R, D]``), ``u`` and ``v``.

        In inference the projections of a range of distances are kept, highest distance first, and
        reused: a decoding step reads the slice for ``K-1 .. 0`` (a view, no copy) instead of
        projecting ``K`` sinusoids again (an ``O(K·hidden²)`` matmul per layer and token). The
        range doubles when exceeded. The kept projections are dropped by every forward with
        gradients and every ``train()``/``eval()`` switch, and rebuilt unless ``r_net``'s weights
        equal, value for value, a copy taken with them: an update through ``.data``, a fused
        optimizer or ``load_state_dict`` changes no version counter that could be trusted instead.
        """
        weights = [p.detach() for p in self.r_net.parameters()]
        # Weights offloaded by accelerate sit on the meta device outside r_net's own forward: nothing to compare.
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or any(w.is_meta for w in weights):
            self._projected = None
            return self._project(distances.values, dtype), self.r_w_bias, self.r_r_bias
        device = distances.values.device
        cached = self._projected
        valid = cached is not None and self._same(cached[0], weights) and cached[1:3] == (device, dtype)
        if not valid or distances.high > cached[3] or distances.low <= cached[3] - cached[4].shape[1]:
            high, low = distances.high, distances.low
            if valid:
                high, low = max(2 * high, cached[3]), min(low, cached[3] - cached[4].shape[1] + 1)
            projected = self._project(torch.arange(high, low - 1, -1, device=device), dtype)
            cached = ([w.clone() for w in weights], device, dtype, high, projected)
            self._projected = cached
        top, projected = cached[3], cached[4]
        if distances.consecutive:
            return projected[:, top - distances.high : top - distances.low + 1], self.r_w_bias, self.r_r_bias
        return projected[:, top - distances.values], self.r_w_bias, self.r_r_bias

    @staticmethod
    def _same(kept: list, weights: list) -> bool:
        """The weights the projections were made with, bit for bit: ``O(hidden²)``, on CPU by numpy (as long as
        one matrix-vector product with them; ``torch.equal`` takes 3-5 times longer there)."""

        def words(t):  # the raw bytes, as int64 words where size and alignment allow
            t = t.reshape(-1)
            whole = t.storage_offset() * t.element_size() % 8 == 0 and t.numel() * t.element_size() % 8 == 0
            return t.view(torch.uint8).view(torch.int64) if whole else t.view(torch.uint8)

        def host(t):
            # A numpy view of the memory, not Tensor.numpy(): that marks the storage non-resizable for good, and
            # FSDP2 frees a layer's gathered weights after its forward by resizing their storage to 0.
            ctype = ctypes.c_int64 if t.dtype == torch.int64 else ctypes.c_uint8
            return np.ctypeslib.as_array((ctype * t.numel()).from_address(t.data_ptr()))

        def same(k, w):
            if k.shape != w.shape or k.dtype != w.dtype or k.device != w.device:
                return False
            if w.device.type == "cpu":
                k, w = words(k), words(w)  # kept alive while numpy reads their memory
                return k.numel() == 0 or bool(np.array_equal(host(k), host(w)))
            return torch.equal(words(k), words(w))

        return len(kept) == len(weights) and all(same(k, w) for k, w in zip(kept, weights))


@dataclass
class RelativeDistances:
    """Transformer-XL's distances ``K-1, K-2, ...`` (clamped), with their range known without a sync."""

    values: torch.Tensor
    low: int
    high: int

    @property
    def consecutive(self) -> bool:
        """``values`` is ``high, high-1, .., low`` (nothing clamped)."""
        return len(self.values) == self.high - self.low + 1


class TransformerXLScheme(PositionScheme):
    """Dai et al. 2019: sinusoidal ``R`` for distances ``K-1 .. 0`` (and negative ones when bidirectional)."""

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.clamp_len = config.clamp_len

    @staticmethod
    def layer_module(config):
        return TransformerXLRelative(config)

    def forward(self, ctx, device, dtype):
        """Distances from the last query's, ``past + Q - 1``, down over the ``R`` positions the relative shift
        reads: ``K`` (causal) or ``K + Q - 1``. The keys end at the last query (``past + Q = K``) except in a
        StaticCache, whose unfilled slots get negative distances that the mask hides."""
        length = ctx.key_length if ctx.causal else ctx.key_length + ctx.query_length - 1
        high = ctx.past_length + ctx.query_length - 1
        if ctx.relative_position is not None:  # explicit positions: every distance K-1 .. 0 a pair may have
            high = ctx.key_length - 1
        values = high - torch.arange(length, device=device)
        if ctx.traced_offset:  # a traced static cache: the projection is computed whole (see TransformerXLRelative)
            if self.clamp_len > 0:
                values = values.clamp(-self.clamp_len, self.clamp_len)
            return RelativeDistances(values, None, None), dtype
        low = high - length + 1
        if self.clamp_len > 0:
            values = values.clamp(-self.clamp_len, self.clamp_len)
            high, low = min(high, self.clamp_len), max(low, -self.clamp_len)
        return RelativeDistances(values, low, high), dtype

    def attend(self, attn, query, key, value, term, ctx):
        distances, dtype = term
        r, u, w = attn.relative(distances, dtype)
        out = transformer_xl_attention(
            query,
            key,
            value,
            r,
            u,
            w,
            # The kernel's causality assumes the keys end at the last query: a StaticCache's do not.
            attention_mask=ctx.mask if ctx.keys_end_at_query else ctx.full_mask(query.device),
            is_causal=ctx.causal,
            dropout_p=attn.attention_dropout if attn.training else 0.0,
            need_weights=ctx.output_attentions,
            relative_position=ctx.relative_position,
        )
        out, weights = out if ctx.output_attentions else (out, None)
        return out.transpose(1, 2), weights


POSITION_SCHEMES: dict[str, type[PositionScheme]] = {
    "t5_bias": T5BiasScheme,
    "shaw": ShawScheme,
    "transformer_xl": TransformerXLScheme,
    "log_decay": LogDecayScheme,
    "alibi": AlibiScheme,
    "kerple_log": KerpleLogScheme,
    "fire": FireScheme,
    "fox": FoxScheme,
    "rope": RopeScheme,
    "sinusoidal": SinusoidalScheme,
    "learned": LearnedScheme,
    "nope": NoPEScheme,
}
