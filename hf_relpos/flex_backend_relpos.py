"""The FlexAttention backend (``attn_implementation="flex_attention"``): a position term as a score function over
small tables, the mask as a ``BlockMask``, no ``[B, H, Q, K]`` tensor.

A scheme names its term's score form (``PositionScheme.score_form``); this module turns the small tensor the scheme
computes for it into torch's ``score_mod`` (``SCORE_MODS``):

- ``"distance"``: a bias per signed distance, ``[H, Q + K - 1]`` indexed by ``kv - q + Q - 1`` (T5, log-decay,
  ALiBi, KERPLE: the scheme's own bias of every distance, so T5's buckets come from the library's bucket function,
  never from a logarithm inside the kernel);
- ``"query_key"``: a bias per query plus one per key, ``[B, H, 2, Q + K]`` (FoX: ``c_{past+i}`` then ``-c_j``,
  each as a high and a low float32 part, so that their sum keeps float64's digits where they cancel);
- ``""``: nothing beyond the mask (NoPE, RoPE, the absolute baselines).

``block_mask`` renders the forward's mask from the same mask functions the other backends render
(``PositionContext.mask_recipe``: padding, packed documents, a window), with causality, the cache's offsets and a
static cache's unfilled slots, through Transformers' mask helpers and torch's ``create_block_mask``; it is made
once per forward and kept on the context. The attention runs in torch's FlexAttention, compiled on
an accelerator, unfused on a CPU (``_flex_kernel``).
"""

from typing import Callable, Optional

import torch

from transformers.masking_utils import (
    add_offsets_to_mask_function,
    and_masks,
    causal_mask_function,
    padding_mask_function,
    prepare_padding_mask,
)
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from .position_context_relpos import PositionContext

FLEX = "flex_attention"


def _distance_score(table: torch.Tensor, query_length: int) -> Callable:
    """``score + T[h, j - i + Q - 1]``: the bias of the signed distance between key ``j`` and query ``i``."""
    last = table.shape[-1] - 1

    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        # Clamped: the kernel may evaluate the padded tail of its last block, whose indices lie past the table.
        return score + table[head_idx, (kv_idx - q_idx + query_length - 1).clamp(0, last)].to(score.dtype)

    return score_mod


def _query_key_score(vectors: torch.Tensor, query_length: int) -> Callable:
    """``score + a[b, h, i] + a[b, h, Q + j]``, a bias per query plus one per key, each held as two float32 parts
    (``vectors``: ``[B, H, 2, Q + K]``, high then low) and summed part by part: the large parts cancel first (FoX's
    ``c`` grows along the sequence, and ``c_i - c_j`` of float32 roundings of each would lose its low digits)."""
    last = vectors.shape[-1] - 1

    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        row, column = q_idx.clamp(max=query_length - 1), (kv_idx + query_length).clamp(max=last)
        high = vectors[batch_idx, head_idx, 0, row] + vectors[batch_idx, head_idx, 0, column]
        low = vectors[batch_idx, head_idx, 1, row] + vectors[batch_idx, head_idx, 1, column]
        return score + (high + low).to(score.dtype)

    return score_mod


# A score form (``PositionScheme.score_form``) and the score function made of the scheme's tensor for it.
SCORE_MODS = {"distance": _distance_score, "query_key": _query_key_score}


def _within(function: Callable, q_length: int, kv_length: int) -> Callable:
    """``function`` with its indices clamped to the inputs: torch evaluates whole blocks (128 rows and columns),
    and a vector the function reads (padding, documents) is as long as the inputs."""

    def inside(batch_idx, head_idx, q_idx, kv_idx):
        return function(batch_idx, head_idx, q_idx.clamp(max=q_length - 1), kv_idx.clamp(max=kv_length - 1))

    return inside


def _prepared_mask_function(mask: torch.Tensor) -> Callable:
    """A caller's 4-D bool mask ``[B|1, 1, Q, K]`` (with causality) read as a mask function."""
    batched = mask.shape[0] > 1

    def prepared(batch_idx, head_idx, q_idx, kv_idx):
        return mask[batch_idx if batched else 0, 0, q_idx, kv_idx]

    return prepared


def self_block_mask(ctx: PositionContext, device) -> Optional[BlockMask]:
    """The self-attention mask of ``ctx`` as a ``BlockMask`` (None: nothing masked), made once per forward.

    From ``ctx.mask_recipe``'s mask functions (padding, documents, window) and causality ``kv <= q`` (key and
    query indices offset as in the recipe, so key ``j`` is visible from query ``i`` when ``j <= past + i``), or,
    bidirectionally over a static cache, its filled slots; a caller's 4-D mask is read as it is."""
    if "self" in ctx.block_masks:
        return ctx.block_masks["self"]
    q_length, kv_length = ctx.query_length, ctx.key_length
    recipe = ctx.mask_recipe
    if ctx.mask is not None and recipe is None:  # prepared by the caller (a 4-D attention_mask)
        full = ctx.full_mask(device)
        function, batch, padding, q_offset, kv_offset = _prepared_mask_function(full), full.shape[0], None, 0, 0
    else:
        q_offset = ctx.q_offset if recipe is None else recipe.q_offset
        kv_offset = q_offset - ctx.past_length if recipe is None else recipe.kv_offset
        functions = []
        if ctx.causal:
            functions.append(causal_mask_function)
        elif not ctx.keys_end_at_query:  # a static cache's slots past the queries hold no key yet
            end = q_offset + q_length
            functions.append(lambda batch_idx, head_idx, q_idx, kv_idx: kv_idx < end)
        batch, padding = 1, None
        if recipe is not None:
            functions.append(recipe.function)
            batch, padding = recipe.batch, recipe.padding
        if padding is not None:
            functions.append(padding_mask_function(prepare_padding_mask(padding, kv_length, kv_offset)))
        if not functions:
            ctx.block_masks["self"] = None
            return None
        function = add_offsets_to_mask_function(and_masks(*functions), q_offset, kv_offset)
    mask = _render(_within(function, q_length, kv_length), batch, q_length, kv_length, device)
    ctx.block_masks["self"] = mask
    return mask


def cross_block_mask(key_mask: Optional[torch.Tensor], q_length: int, ctx: PositionContext) -> Optional[BlockMask]:
    """An encoder-decoder's cross-attention mask (bool ``[B, 1, 1, S]`` of the source's keys) as a ``BlockMask``,
    made once per forward; None when nothing is masked."""
    if key_mask is None:
        return None
    if "cross" not in ctx.block_masks:
        padding = key_mask[:, 0, 0, :]
        function = _within(padding_mask_function(padding), q_length, padding.shape[-1])
        ctx.block_masks["cross"] = _render(function, padding.shape[0], q_length, padding.shape[-1], key_mask.device)
    return ctx.block_masks["cross"]


def _render(function: Callable, batch: int, q_length: int, kv_length: int, device) -> BlockMask:
    # Compiled on a GPU (no [B, Q, K] tensor); on a CPU, where compiling the mask costs 5-20 s and FlexAttention
    # serves inference only, evaluated eagerly (a [B, Q, K] bool, as the other backends render).
    device = torch.device(device)
    return create_block_mask(function, batch, None, q_length, kv_length, device=device, _compile=device.type != "cpu")


_COMPILED: dict = {}


def _flex_kernel(device_type: str) -> Callable:
    """torch's ``flex_attention`` as it runs on ``device_type``: compiled once per device type (as Transformers'
    ``WrappedFlexAttention``) on an accelerator, left to the enclosing graph when one is being traced, and
    unfused on a CPU (torch's reference implementation: the same score and mask functions, the scores formed
    whole). torch 2.13's compiled CPU kernel returns wrong values and NaN at some shapes (a causal mask at length
    8, head_dim 8, reproduced with torch alone; ``tests/test_flex_attention.py::test_length_8``)
    and fails to build some others (FoX's for dynamic shapes)."""
    if torch.compiler.is_compiling() or device_type == "cpu":
        return flex_attention
    if device_type not in _COMPILED:
        _COMPILED[device_type] = torch.compile(flex_attention)
    return _COMPILED[device_type]


def flex_attend(attn, query, key, value, block_mask: Optional[BlockMask], score_mod: Optional[Callable] = None,
                alive: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FlexAttention of ``[B, H, Q, D]`` queries over ``[B, H, K, D]`` keys; returns ``[B, Q, H, D]``, zeros for
    a query row with no key left (``alive``, ``[B, 1, Q, 1]``: torch gives them already; kept for the contract)."""
    # Contiguous: a stride that differs from the last call's (FoX's keys are a slice of their cached channels)
    # would compile the kernel again, for dynamic strides.
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    out = _flex_kernel(query.device.type)(query, key, value, score_mod=score_mod, block_mask=block_mask,
                                          scale=attn.scaling)
    if alive is not None:
        out = out * alive
    return out.transpose(1, 2)


def flex_self_attention(attn, query, key, value, ctx: PositionContext, form: str = "",
                        term: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Self-attention under FlexAttention: the mask of ``ctx`` and the score function of the scheme's ``form``
    made of ``term`` (its small tensor; none for ``""``)."""
    score_mod = SCORE_MODS[form](term, ctx.query_length) if form else None
    return flex_attend(attn, query, key, value, self_block_mask(ctx, query.device), score_mod, ctx.alive)


def flex_refusal(scheme_class, config, device=None, training: bool = False, needs_grad: bool = False) -> Optional[str]:
    """Why a forward cannot run under FlexAttention (None when it can): the scheme's term is no score function
    (its ``score_form`` is None), attention dropout in training (FlexAttention has none), or a gradient on a CPU
    tensor (torch's FlexAttention has no CPU backward)."""
    if scheme_class.score_form is None:
        return (
            f"attn_implementation='flex_attention' does not serve position_encoding={config.position_encoding!r}: "
            f"{scheme_class.score_refusal}; use 'sdpa' or 'eager'"
        )
    if training and config.attention_dropout > 0:
        return (
            f"attn_implementation='flex_attention' with attention_dropout={config.attention_dropout} in training: "
            "FlexAttention has no attention dropout; set attention_dropout=0.0, or use 'sdpa' or 'eager'"
        )
    if needs_grad and device is not None and torch.device(device).type == "cpu":
        return (
            "attn_implementation='flex_attention' on CPU serves inference only: torch's FlexAttention has no CPU "
            "backward; run under torch.no_grad(), or use 'sdpa' to train on CPU"
        )
    return None
