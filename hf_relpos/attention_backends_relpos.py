"""Attention backends: how a position term is computed, given what the scheme says it is.

A scheme says what its term is (``position_schemes_relpos.py``): nothing beyond the mask (NoPE, the absolute baselines),
rotated queries and keys (RoPE, then the mask), an additive bias (``bias_term``: a dense bias and, where it has
one, a compact form named by the scheme's ``compact_form``), or a whole attention call of its own (Shaw's values,
Transformer-XL's position-dependent query). This module decides how it is computed, from the config's
``attn_implementation``, the device and the inputs:

- ``eager_attention_forward``: plain attention that materialises the probabilities (``output_attentions``);
- ``interface_attention``: the config's ``attn_implementation`` through Transformers' attention interface
  (eager, SDPA, or one a user registered), a mask or a bias merged with it as the additive term;
- ``cpu_fast_path``: the one predicate for the fused CPU paths (``kernels_relpos.py``) that a compact bias takes;
- ``bias_term``: the compact form where ``cpu_fast_path`` holds, else the dense bias merged with the mask;
- ``attend_bias``: a compact form in its fused path (``COMPACT_PATHS``), a merged bias through
  ``attend_merged_bias``, kept on CPU SDPA's fused kernel when it needs a gradient;
- under ``attn_implementation="flex_attention"``, every one of them hands the scheme's score form
  (``PositionScheme.score_form``: a table of distances, FoX's vectors, or nothing) to ``flex_backend_relpos.py``;
- under ``attn_implementation="relpos_triton"`` (``TRITON``), the scheme's kernel term (``kernel_term``: a table
  through a distance-to-index vector, a closed form, FoX's vectors, or nothing) and the mask's per-token vectors
  (``kernel_masks``) to the fused Triton kernel of ``triton_attention_relpos.py``, imported on first use.
"""

from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention_utils_relpos import _exporting
from .flex_backend_relpos import FLEX, cross_block_mask, flex_attend, flex_self_attention
from .functional_relpos import attention_with_bias, causal_key_bias_attention, saturating_bias_attention
from .position_context_relpos import PositionContext

# The fused Triton kernel's name as an attention implementation (triton_attention_relpos.py).
TRITON = "relpos_triton"


def _triton_interface(*args, **kwargs):
    raise ValueError(
        "attn_implementation='relpos_triton' is hf_relpos' own kernel: its models call it with their position "
        "term; other models cannot (use 'sdpa')"
    )


# Registered so that Transformers accepts the name (config, from_pretrained, set_attn_implementation).
ALL_ATTENTION_FUNCTIONS.register(TRITON, _triton_interface)


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


def cpu_fast_path(ctx: PositionContext, device: torch.device, dropout: float) -> bool:
    """Whether a scheme's compact term takes a fused CPU path of ``kernels_relpos.py``: CPU's SDPA path,
    self-attention of a fresh forward with nothing masked but keys (``ctx.keys_only``), no attention dropout, and not
    while exporting (those paths are eager fast paths: T5's band reads its reach on the host)."""
    return (
        not _exporting()
        and ctx.attn_implementation == "sdpa"
        and device.type == "cpu"
        and ctx.keys_only
        and dropout == 0.0
    )


def mask_term(ctx: PositionContext, device) -> Optional[torch.Tensor]:
    """The per-forward term of a scheme without a bias: the bool mask with causality (``full_mask``), or None where
    the kernel masks on its own: SDPA's ``is_causal`` flag (top-left aligned, right only when queries and keys
    coincide or a single query sees every key), FlexAttention's ``BlockMask``."""
    if ctx.attn_implementation in (FLEX, TRITON):
        return None
    if ctx.attn_implementation == "sdpa" and ctx.mask is None and ctx.keys_end_at_query:
        if not ctx.causal or ctx.query_length in (1, ctx.key_length):
            return None
    return ctx.full_mask(device)


def interface_attention(attn: nn.Module, query, key, value, mask: Optional[torch.Tensor], ctx: PositionContext):
    """``ctx.attn_implementation`` through Transformers' attention interface; ``mask`` is the bool mask or a bias
    merged with it (None: nothing masked, SDPA's own causal flag where the model is causal). FlexAttention masks
    by ``ctx``'s ``BlockMask`` instead, with no score function."""
    if ctx.attn_implementation == FLEX:
        return flex_self_attention(attn, query, key, value, ctx), None
    if ctx.attn_implementation == TRITON:
        return triton_self_attention(attn, query, key, value, ctx), None
    interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(ctx.attn_implementation, eager_attention_forward)
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


def cross_attention(attn: nn.Module, query, key, value, key_mask: Optional[torch.Tensor], ctx: PositionContext):
    """An encoder-decoder's cross-attention, without a position term (as T5): ``key_mask`` is the bool
    ``[B, 1, 1, S]`` of the source's keys (None: nothing masked). Returns ``([B, Q, H, D], probabilities or None)``;
    a source that is all padding leaves a query no key: zeros, never NaN (as the self-attention paths)."""
    alive = None if key_mask is None else key_mask.any(dim=-1, keepdim=True).transpose(1, 2)
    if ctx.attn_implementation == FLEX:
        block_mask = cross_block_mask(key_mask, query.shape[2], ctx)
        return flex_attend(attn, query, key, value, block_mask, alive=alive), None
    if ctx.attn_implementation == TRITON:
        from .triton_attention_relpos import relpos_attention

        valid = None if key_mask is None else key_mask[:, 0, 0, :].expand(query.shape[0], -1).contiguous()
        out = relpos_attention(query, key, value, scale=attn.scaling, key_valid=valid)
        return out.transpose(1, 2), None
    interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(ctx.attn_implementation, eager_attention_forward)
    out, weights = interface(
        attn, query, key, value, key_mask,
        dropout=attn.attention_dropout if attn.training else 0.0, scaling=attn.scaling, is_causal=False,
    )
    if alive is not None:
        out = out * alive.to(out.dtype)
    return out, weights


def attend_merged_bias(attn: nn.Module, query, key, value, bias: torch.Tensor, ctx: PositionContext):
    """Attention with a bias merged with the mask (``[B|1, H, Q, K]``, masked entries at the dtype's minimum)."""
    dropout = attn.attention_dropout if attn.training else 0.0
    if ctx.attn_implementation == "sdpa" and bias.requires_grad and dropout == 0.0 and query.is_cpu:
        # A trained bias (T5's) would push CPU SDPA onto its slow math path: keep the fused kernel.
        out, weights = attention_with_bias(query, key, value, bias, scale=attn.scaling).transpose(1, 2), None
    else:
        out, weights = interface_attention(attn, query, key, value, bias, ctx)
    if ctx.alive is not None:
        # A query with no key left (padding) gives zeros under every kernel, as in plain SDPA: the
        # finfo.min entries of the merged bias would otherwise average the masked values.
        out = out * ctx.alive.transpose(1, 2)
    if _exporting():
        # A copy in the exported graph: with a bias that needs a gradient, the ONNX exporter decomposes SDPA into
        # an output of another layout than the traced one, which the layer's reshape (traced as a view) cannot view.
        out = out.clone(memory_format=torch.contiguous_format)
    return out, weights


def bias_term(
    ctx: PositionContext, device, dtype, dropout: float, form: Optional[str], compact: Callable, dense: Callable,
    score: Callable, kernel: Optional[Callable] = None,
):
    """A bias term as the backend computes it: under FlexAttention ``score()``, the small tensor of the scheme's
    ``score_form``; under the Triton kernel ``kernel`` itself, which each layer calls for the scheme's kernel term;
    else ``compact()``, the scheme's compact form ``form``, where its fused CPU path takes it (``cpu_fast_path``;
    the scheme returns None where its form does not apply), else ``dense()`` (``[B|1, H, Q, K]``) merged with the
    mask, masked entries at the dtype's minimum. Made once per forward (a scheme's bias) or per layer (FoX's gates),
    and handed to ``attend_bias``."""
    if ctx.attn_implementation == FLEX:
        return score()
    if ctx.attn_implementation == TRITON:
        # Made in each layer (attend_bias calls it): a learned term's graph then lies inside the layer, which
        # reentrant activation checkpointing recomputes; a tuple made once per forward would reach the layers as
        # no tensor, and the second layer's backward would run through the first's freed graph.
        return kernel
    takes = form is not None and cpu_fast_path(ctx, device, dropout)
    term = compact() if takes else None
    if term is not None:
        return term
    bias = dense().to(dtype)
    mask = ctx.full_mask(device)
    return bias if mask is None else torch.where(mask, bias, torch.finfo(dtype).min)


def _distance_bias_path(attn, query, key, value, table, ctx, span):
    """A bias per clipped distance ``[H, 2s+1]`` (T5's): the band decomposition, far keys in the fused kernel
    (``span`` unused: the table is bounded)."""
    return saturating_bias_attention(
        query, key, value, table, attention_mask=ctx.key_mask, is_causal=ctx.causal, scale=attn.scaling
    )


def _key_bias_path(attn, query, key, value, key_bias, ctx, span):
    """A bias per key ``[H, K]`` or ``[B, H, K]`` of causal attention (ALiBi's, FoX's): the fused causal kernel."""
    return causal_key_bias_attention(query, key, value, key_bias, attention_mask=ctx.key_mask, scale=attn.scaling,
                                     span=span)


# The compact forms a bias may take (a scheme's ``compact_form``) and the fused CPU path that computes each
# (``functional``'s entry points: they check their inputs and compute exactly where a kernel of ``kernels_relpos.py``
# cannot run).
COMPACT_PATHS = {"distance": _distance_bias_path, "key": _key_bias_path}


def attend_bias(attn: nn.Module, query, key, value, term: torch.Tensor, ctx: PositionContext, form: Optional[str],
                span: Optional[float] = None):
    """Attention with a ``bias_term``: a compact one (a scheme's ``form``, fewer than 4 dims) in the fused path
    of its form (``span``: how far a per-key bias may spread over one chunk of rows, None: no limit), a merged
    one (``[B|1, H, Q, K]``) through ``attend_merged_bias``; under FlexAttention, the score function of the
    scheme's ``score_form`` over it. Returns ``([B, Q, H, D], probabilities or None)``."""
    if ctx.attn_implementation == FLEX:
        return flex_self_attention(attn, query, key, value, ctx, ctx.scheme.score_form, term), None
    if ctx.attn_implementation == TRITON:
        return triton_self_attention(attn, query, key, value, ctx, term()), None
    if form is not None and term.dim() < 4:
        return COMPACT_PATHS[form](attn, query, key, value, term, ctx, span).transpose(1, 2), None
    return attend_merged_bias(attn, query, key, value, term, ctx)


def kernel_masks(ctx: PositionContext, device, batch: int):
    """The mask of ``ctx`` as the Triton kernel takes it, besides causality: ``(key_valid, documents)``, bool and
    int ``[B, K]`` or None (padding on either side; packed documents, read at ``past + i`` for query ``i``; a static
    cache's unfilled slots invalid). A mask it cannot take is one ValueError saying which."""
    recipe = ctx.mask_recipe
    if ctx.traced_offset:
        raise ValueError("attn_implementation='relpos_triton' cannot take a static cache's offsets under "
                         "torch.compile (traced tensors); use 'sdpa'")
    if ctx.relative_position is not None:
        raise ValueError("attn_implementation='relpos_triton' cannot take a continuous-batching step (explicit "
                         "positions); use 'sdpa'")
    if ctx.mask is not None and recipe is None:
        raise ValueError("attn_implementation='relpos_triton' takes a 2-D attention_mask, not a prepared 4-D one "
                         "(generate hands a static cache one); use 'sdpa'")
    key_valid = documents = None
    if recipe is not None:
        if recipe.window is not None:
            raise ValueError(
                f"attn_implementation='relpos_triton' has no sliding window, got sliding_window={recipe.window}; "
                "use 'sdpa' or 'flex_attention'"
            )
        key_valid, documents = recipe.padding, recipe.documents
    if key_valid is not None and key_valid.shape[-1] < ctx.key_length:
        # A static cache's slots past the mask's columns hold no key yet.
        key_valid = F.pad(key_valid, (0, ctx.key_length - key_valid.shape[-1]), value=False)
    if not ctx.causal and not ctx.keys_end_at_query:  # a static cache's slots past the queries hold no key yet
        filled = (torch.arange(ctx.key_length, device=device) < ctx.past_length + ctx.query_length)[None]
        key_valid = filled if key_valid is None else key_valid & filled
    shaped = lambda t: None if t is None else t.to(device).expand(batch, -1).contiguous()  # noqa: E731
    return shaped(key_valid), shaped(documents)


def triton_self_attention(attn: nn.Module, query, key, value, ctx: PositionContext, term=None) -> torch.Tensor:
    """Self-attention in the fused Triton kernel: the scheme's kernel term ``(name, values, index)`` (None: the
    mask alone) computed in the kernel, the mask from ``kernel_masks``. Returns ``[B, Q, H, D]``."""
    from .triton_attention_relpos import relpos_attention

    name, values, index = (None, None, None) if term is None else term
    key_valid, documents = kernel_masks(ctx, query.device, query.shape[0])
    out = relpos_attention(
        query, key, value, scale=attn.scaling, causal=ctx.causal, past=ctx.past_length, term=name, values=values,
        index=index, key_valid=key_valid, documents=documents,
    )
    return out.transpose(1, 2)


def triton_refusal(scheme_class, config, device=None, training: bool = False) -> Optional[str]:
    """Why a forward cannot run in the Triton kernel (None when it can): the scheme's term is no function of small
    tables (its ``score_form`` is None: Shaw's, Transformer-XL's, FIRE's), a sliding window, attention dropout in
    training, or a device the kernel does not run on (``triton_attention_relpos.device_refusal``)."""
    if scheme_class.score_form is None:
        return (
            f"attn_implementation='relpos_triton' does not serve position_encoding={config.position_encoding!r} "
            f"({scheme_class.score_refusal}); the backends that serve it: 'eager', 'sdpa'"
        )
    if config.sliding_window is not None:
        return (
            f"attn_implementation='relpos_triton' has no sliding window, got sliding_window={config.sliding_window}; "
            "use 'sdpa' or 'flex_attention'"
        )
    if training and config.attention_dropout > 0:
        return (
            f"attn_implementation='relpos_triton' with attention_dropout={config.attention_dropout} in training: the "
            "kernel has no attention dropout; set attention_dropout=0.0, or use 'sdpa' or 'eager'"
        )
    if device is not None:
        from .triton_attention_relpos import device_refusal

        return device_refusal(device)
    return None
