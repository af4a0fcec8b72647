"""Where one forward's queries and keys sit, and what they may attend to: the cache geometry read once
(``read_cache``, the one function that asks the cache) into one record (``Geometry``), the composed mask functions
rendered by Transformers' ``sdpa_mask`` (``self_attention_mask``), and ``PositionContext``, built once per forward
from the record and handed to every layer.
"""

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

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

from .configuration_relpos import RelPosConfig


@dataclass(frozen=True)
class Geometry:
    """One forward's tokens and what precedes them, one name per quantity, from the input checks
    (``inputs_relpos.check_inputs``) to ``PositionContext`` and the layers.

    ``length`` queries at positions ``q_offset + i``; the cache hands the layers ``kv_length`` keys (held and
    current, or a static cache's slots) at positions ``kv_offset + j``, after ``mem_length`` memory keys
    (Transformer-XL's). A static cache's offsets are tensors in a traced graph. ``cache_layers``, ``cache_keys``
    (``[batch, heads, channels]`` of the keys held, None when none are) and ``room`` (tokens a static cache
    holds at most; None: no bound, or not read in a traced graph) are what the checks read of the cache.
    ``paged``: a continuous-batching step's ``(cu_seq_lens_q, cu_seq_lens_k, key count)``
    (``inputs_relpos._check_paged``), whose tokens sit at their own requests' positions: its other fields
    are then the defaults and ``kv_length`` the step's key count, read by nothing else."""

    batch: int
    length: int
    q_offset: Any = 0
    kv_length: Any = None
    kv_offset: Any = 0
    mem_length: int = 0
    cache_layers: int = 0
    cache_keys: Optional[tuple] = None
    room: Optional[int] = None
    paged: Optional[tuple] = None

    @property
    def fresh(self) -> bool:
        """Self-attention of the inputs alone: no past in the cache (nor a static cache's slots), no memory."""
        return is_fresh(self.q_offset, self.kv_length, self.length, self.mem_length)


def read_cache(cache, batch: int, length: int) -> Geometry:
    """The geometry of ``length`` new tokens after what ``cache`` (a Transformers ``Cache`` or None) holds, read
    before any layer updates it: the only place the cache is asked for its geometry (a paged cache's
    allocators are ``inputs_relpos._check_paged``'s). Offsets are read as Python ints in eager
    calls and kept as they are (a static cache's tensors) in a traced graph."""
    if cache is None:
        return Geometry(batch, length, kv_length=length)
    q_offset = cache.get_query_offset(0)
    kv_length, kv_offset = cache.get_mask_sizes(length, 0)
    room = None
    if not torch.compiler.is_compiling():
        q_offset, kv_length, kv_offset = int(q_offset), int(kv_length), int(kv_offset)
        # A StaticCache's full-attention layers hold max_cache_len tokens (a sliding layer rolls over instead).
        sizes = [layer.get_max_length() for layer in cache.layers if not getattr(layer, "is_sliding", True)]
        room = min((size for size in sizes if size >= 0), default=None)
    layer = cache.layers[0] if len(cache.layers) else None
    keys = getattr(layer, "keys", None)
    held = layer is not None and getattr(layer, "is_initialized", False) and keys is not None and keys.numel()
    return Geometry(
        batch, length, q_offset=q_offset, kv_length=kv_length, kv_offset=kv_offset, cache_layers=len(cache.layers),
        cache_keys=(keys.shape[0], keys.shape[1], keys.shape[3]) if held else None, room=room,
    )


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


@dataclass(frozen=True)
class MaskRecipe:
    """What a rendered mask is made of, for any backend to render its own way (FlexAttention's ``BlockMask``
    later): the ``[B, Q]`` document index of packed rows (``documents``), a causal (``one_sided``) or
    bidirectional ``window``, and a 2-D ``padding`` of keys, for ``batch`` rows; ``function`` composes them as
    Transformers' mask functions of ``(batch_idx, head_idx, q_idx, kv_idx)``, over query indices
    ``q_offset + i`` (``i < q_length``) and key indices ``kv_offset + j`` (``j < kv_length``), ``padding``
    indexed by the key index. The indices are positions, except that Transformer-XL's memory keys come first
    among the keys (the memory has no window or documents; ``padding`` covers it). Causality is not in it: a key
    index ``j`` is visible from query ``i`` when ``j <= ctx.past_length + i`` (``PositionContext.full_mask``)."""

    documents: Optional[torch.Tensor]
    window: Optional[int]
    one_sided: bool
    padding: Optional[torch.Tensor]
    batch: int
    q_length: int
    kv_length: int
    q_offset: Any
    kv_offset: Any

    @property
    def function(self) -> Callable:
        functions = [] if self.documents is None else [packed_sequence_mask_function(self.documents)]
        if self.window is not None:
            overlay = sliding_window_overlay if self.one_sided else sliding_window_bidirectional_overlay
            functions.append(overlay(self.window))
        return and_masks(bidirectional_mask_function, *functions)

    def to(self, device, non_blocking: bool = False) -> "MaskRecipe":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, documents=move(self.documents), padding=move(self.padding))

    def render(self, device) -> torch.Tensor:
        """bool ``[batch, 1, q_length, kv_length]`` (True = may attend), by Transformers' ``sdpa_mask``."""
        return sdpa_mask(
            batch_size=self.batch,
            q_length=self.q_length,
            kv_length=self.kv_length,
            q_offset=self.q_offset,
            kv_offset=self.kv_offset,
            mask_function=self.function,
            attention_mask=self.padding,
            allow_is_causal_skip=False,
            device=device,
        )


def self_attention_mask(
    attention_mask, documents, window, *, one_sided, batch, length, q_offset, kv_length, kv_offset, mem_length, device
) -> tuple[Optional[torch.Tensor], Optional[MaskRecipe]]:
    """What the queries may attend to besides causality: bool ``[B|1, 1, Q, M + K]`` (True = may attend) over
    the memory, cache and current keys, or None when nothing else is masked; and the ``MaskRecipe`` it was
    rendered from (None when nothing is masked or the mask was prepared by the caller).

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
    if padding is None and documents is None and window is None:
        return prepared, None
    recipe = MaskRecipe(
        documents=documents,
        window=window,
        one_sided=one_sided,
        padding=padding,
        batch=batch if padding is not None or documents is not None else 1,
        q_length=length,
        kv_length=mem_length + kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
    )
    mask = recipe.render(device)
    return (mask, recipe) if prepared is None else (prepared & mask, None)


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
    scheme: nn.Module  # the model's PositionScheme (position_schemes_relpos.py)
    # ``mask`` as bool ``[B, 1, 1, K]`` when it masks keys alone (padding of a fresh forward), else None:
    # the fused paths (band decomposition, per-key ALiBi) take such a mask without a [Q, K] tensor.
    key_mask: Optional[torch.Tensor] = None
    # Explicit positions (a continuous-batching step, ``from_paged``): ``[Q, K]`` long, each key's position minus
    # each query's, which every scheme's term reads instead of the band ``past_length + i``; ``mask`` then holds
    # causality too. None otherwise.
    relative_position: Optional[torch.Tensor] = None
    # The paged cache's keyword arguments for ``cache.update`` (read/write indices, cu_seq_lens_k, ...), or None.
    paged: Optional[dict] = None
    # What ``mask`` was rendered from (``MaskRecipe``), for a backend that renders masks its own way; None when
    # ``mask`` is None, was prepared by the caller (a 4-D ``attention_mask``) or holds explicit positions.
    mask_recipe: Optional[MaskRecipe] = None
    # Masks a backend rendered its own way from the above, made once per forward and shared by the layers
    # (FlexAttention's ``BlockMask``s, by ``flex_backend_relpos``), by name.
    block_masks: dict = field(default_factory=dict)

    @classmethod
    def from_inputs(
        cls, config: RelPosConfig, scheme: nn.Module, inputs_embeds: torch.Tensor, attention_mask, position_ids,
        geometry: Geometry, mems, packed: dict, attn_implementation: str, output_attentions: bool,
    ) -> "PositionContext":
        """The context of one forward over checked inputs (``geometry``, read from the cache before any layer
        updates it): packed documents, position ids, the mask and the live query rows. ``packed`` holds the
        ``cu_seq_lens_q`` / ``seq_idx`` keyword arguments (None when absent)."""
        batch, length, mem_length = geometry.batch, geometry.length, geometry.mem_length
        q_offset, kv_length, kv_offset = geometry.q_offset, geometry.kv_length, geometry.kv_offset
        device = inputs_embeds.device
        fresh = geometry.fresh
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
        window_offset = q_offset
        if mems is not None and config.same_length:
            # Every query sees mem_len keys, itself included (Dai et al.'s same_length): the memory's keys come
            # first among the key indices, so query i sits at index mem_length + i for the window.
            window, window_offset = config.mem_len, q_offset + mem_length
            if documents is not None:
                raise ValueError("packed sequences (cu_seq_lens_q, seq_idx or restarting position_ids) cannot be "
                                 "combined with mems and same_length=True: pass one sequence per row")
        mask, recipe = self_attention_mask(
            attention_mask, documents, window, one_sided=config.is_decoder or config.memory_window is not None,
            batch=batch, length=length, q_offset=window_offset, kv_length=kv_length, kv_offset=kv_offset,
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
            mask_recipe=recipe,
        )
        ctx.alive = ctx.live_rows(device)
        if mask is not None and documents is None and attention_mask is not None and config.sliding_window is None:
            if fresh and attention_mask.dim() == 2:
                ctx.key_mask = attention_mask.bool()[:, None, None, :]
        return ctx

    @classmethod
    def from_paged(
        cls, config: RelPosConfig, scheme: nn.Module, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
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
        recipe = None if self.mask_recipe is None else self.mask_recipe.to(device, non_blocking=non_blocking)
        block_masks = {name: None if m is None else m.to(device) for name, m in self.block_masks.items()}
        return replace(self, mask=move(self.mask), position_ids=move(self.position_ids), alive=move(self.alive),
                       key_mask=move(self.key_mask), relative_position=move(self.relative_position),
                       mask_recipe=recipe, block_masks=block_masks)

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
