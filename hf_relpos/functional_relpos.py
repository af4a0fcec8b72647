"""The math of every position scheme, in pure PyTorch (no Transformers import): ``hf_relpos.functional``'s code.

This module holds the attention functions; each scheme's position term (T5's buckets and bias, ALiBi's slopes, FoX's
sums, KERPLE's and FIRE's biases, sinusoids) is in ``position_terms_relpos.py``, re-exported here.

Users import the public module ``hf_relpos.functional``, which re-exports this module's public functions; the model
code imports this one, which ``save_pretrained`` copies into the saved folder (remote code) under a name that no
installed package has (see ``functional.py``).

Each public function states its equation, the shapes of its arguments and what it returns, and names the
slow, obviously correct reference it is tested against (in ``tests/oracles.py`` unless said otherwise). The
fast paths some of them take on CPU live in ``kernels_relpos.py`` (see each ``Note``); they compute the same
equation. The functions here check their arguments and choose the path.

Shapes (the layout of ``torch.nn.functional.scaled_dot_product_attention``: ``[B, H, seq, D]``):

- ``B`` batch, ``H`` heads, ``D`` head size (``D_v`` of the values where it differs);
- ``Q`` query rows of the call, ``K`` keys, ``n`` the length of a self-attention call (``Q = K = n``);
- ``M = K - Q`` Transformer-XL's memory, ``R`` the rows of its relative embeddings ``r``;
- ``k`` Shaw's ``max_relative_position``, ``s`` the distance beyond which a saturating bias is constant;
- ``X|1``: of size ``X`` or 1 (broadcast).

Positions: a query at index ``i`` of a call that follows ``past_length`` earlier tokens sits at absolute
position ``past_length + i``; key ``j`` sits at absolute position ``j``.

``attention_mask`` follows SDPA: a boolean tensor (True = may attend) or an additive
float tensor, broadcastable to ``[B, H, Q, K]``. In an additive mask,
``-inf`` and the dtype's most negative finite value (Transformers' convention) both
mean "masked". A query row with no key left gives zeros, never NaN.

Every function validates its arguments and raises ``ValueError``/``TypeError`` naming
the argument, what was given and what is allowed.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .attention_utils_relpos import _additive_mask, _causal_pattern, _exporting, _rel_shift
from .kernels_relpos import (  # noqa: F401 (KEY_BIAS_SPAN: the schemes' FoX span, read through this module)
    KEY_BIAS_SPAN,
    causal_key_bias,
    causal_key_bias_applies,
    distance_bias_applies,
    distance_bias_attention,
    fused_bias_applies,
    fused_bias_attention,
    read_by_runs,
    saturating_bias_banded,
    saturating_bias_banded_applies,
    shaw_banded,
    shaw_banded_applies,
    toeplitz_bias,
    txl_chunked,
    txl_chunked_applies,
)
from .position_terms_relpos import (  # each scheme's term, re-exported: this module's __all__ lists the whole API
    _check_int,
    _check_offset,
    _check_tensor,
    _distances,
    _relative_distance,
    alibi_bias,
    alibi_key_bias,
    alibi_slopes,
    fire_bias,
    fox_bias,
    fox_key_bias,
    fox_query_key_bias,
    kerple_log_bias,
    log_decay_bias,
    sinusoidal_embedding,
    t5_bias_by_distance,
    t5_exact_buckets,
    t5_position_bias,
    t5_relative_position_bucket,
    t5_saturation_distance,
)

__all__ = [
    "attention_with_bias",
    "t5_relative_position_bucket",
    "t5_position_bias",
    "t5_exact_buckets",
    "t5_saturation_distance",
    "t5_bias_by_distance",
    "saturating_bias_attention",
    "shaw_attention",
    "transformer_xl_attention",
    "sinusoidal_embedding",
    "log_decay_bias",
    "alibi_slopes",
    "alibi_bias",
    "alibi_key_bias",
    "causal_key_bias_attention",
    "fox_key_bias",
    "fox_bias",
    "fox_query_key_bias",
    "kerple_log_bias",
    "fire_bias",
]


# ----------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------


def _check_qkv(q, k, v) -> None:
    _check_tensor("q", q, 4, "[batch, heads, q_len, head_dim]")
    _check_tensor("k", k, 4, "[batch, heads, k_len, head_dim]")
    _check_tensor("v", v, 4, "[batch, heads, k_len, head_dim]")
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q, k and v must share [batch, heads]: got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k must have q's head_dim {q.shape[3]}, got k of shape {tuple(k.shape)}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v must have k's length {k.shape[2]}, got v {tuple(v.shape)} and k {tuple(k.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_dropout(dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def _check_mask(attention_mask, shape: Sequence[int]) -> None:
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
    if attention_mask.dtype != torch.bool and not attention_mask.is_floating_point():
        raise TypeError(
            f"attention_mask must be bool (True = attend) or floating (additive), got dtype {attention_mask.dtype}"
        )
    ok = attention_mask.dim() <= 4 and all(
        m in (1, s) for m, s in zip(reversed(attention_mask.shape), reversed(shape))
    )
    if not ok:
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask.shape)} does not broadcast to "
            f"[batch, heads, q_len, k_len] = {list(shape)}"
        )


# ----------------------------------------------------------------------------------
# Shared attention core for the schemes whose position term is not an additive bias
# ----------------------------------------------------------------------------------


def _masked_softmax(scores: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Softmax over the last dim in at least float32; a row with every key masked gives zeros (and zero grads)."""
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    if mask is not None:
        scores = scores + mask
    if scores.shape[-1] == 0:  # no keys at all: every row is "fully masked"
        return scores
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(scores - row_max)
    # A row with any key left sums to >= 1 (its max gives exp(0) = 1); a fully masked row sums to 0 and is
    # divided by 1 instead (0/0 -> 0). A `where`, not `clamp_min(1.0)`: from torch 2.15 clamp_min passes no
    # gradient where its input equals the bound, which a row with one key left does (its sum is exactly 1).
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


# ----------------------------------------------------------------------------------
# Attention with a learned additive bias: fused forward, chunked backward
# ----------------------------------------------------------------------------------


def attention_with_bias(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    *,
    scale: Optional[float] = None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """``z = softmax(q k^T · scale + bias) v`` for a bias that is trained (e.g. T5's).

    Args:
        q: ``[B, H, Q, D]``; k: ``[B, H, K, D]``; v: ``[B, H, K, D_v]``.
        bias: additive float ``[B|1, H|1, Q, K]``; gets its gradient.
        scale: default ``1 / sqrt(D)``.
        chunk_size: query rows per chunk of the CPU backward.

    Returns:
        ``[B, H, Q, D_v]``.

    Note:
        On CPU with a gradient wanted, :func:`kernels_relpos.fused_bias_attention`: SDPA's fused kernel forward, a
        backward that recomputes the probabilities ``chunk_size`` rows at a time, so no ``[B, H, Q, K]``
        probability tensor is kept (extra backward memory ``O(B·H·chunk_size·K)`` besides the bias
        gradient). Elsewhere plain SDPA.

    Reference: the float64 softmax in ``tests/test_attention_with_bias.py``.
    """
    _check_qkv(q, k, v)
    B, H, Q, D = q.shape
    K = k.shape[2]
    _check_tensor("bias", bias, 4, "[batch|1, heads|1, q_len, k_len]")
    if bias.shape[2:] != (Q, K) or bias.shape[0] not in (1, B) or bias.shape[1] not in (1, H):
        raise ValueError(f"bias must broadcast as [batch|1, heads|1, {Q}, {K}], got {tuple(bias.shape)}")
    chunk_size = _check_int("chunk_size", chunk_size, 1)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if 0 in (B, H, Q, K):  # nothing to attend (and the fused CPU kernel crashes on empty inputs)
        return q.new_zeros(B, H, Q, v.shape[-1]) + 0.0 * (q.sum() + k.sum() + v.sum() + bias.sum())
    if not fused_bias_applies(q) or v.shape[-1] != D:  # the fused kernel takes one head size
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=scale)
    return fused_bias_attention(q, k, v, bias, scale, chunk_size=chunk_size)


# ----------------------------------------------------------------------------------
# Shaw et al. 2018: relative key and value embeddings
# ----------------------------------------------------------------------------------


def saturating_bias_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    *,
    attention_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Self-attention with a per-head bias of the distance that is constant beyond ``s``.

    ``B[h, i, j] = bias[h, clamp(j - i, -s, s) + s]``, ``z = softmax(q k^T · scale + B + mask) v``;
    ``is_causal`` masks keys ``j > i``. T5's bucketed bias is such a bias (:func:`t5_bias_by_distance`).

    Args:
        q, k: ``[B, H, n, D]``; v: ``[B, H, n, D_v]``.
        bias: ``[H, 2s+1]``, ``s >= 1``.
        attention_mask: see the module docstring; scale: default ``1 / sqrt(D)``.

    Returns:
        ``[B, H, n, D_v]``.

    Note:
        On CPU, :func:`kernels_relpos.distance_bias_attention`: the fused kernel with the query rows reversed,
        where the bias is a view of its ``2n - 1`` distances; without a mask, or with padding that keeps one run
        of keys per row (the rows of each run then read those keys alone: ``bias_kernels_relpos.read_by_runs``
        says where), its backward is the fused kernel's own, the bias gradient from the band and each row's smaller
        far side (``bias_kernels_relpos.table_gradient``), else chunks that fold it per distance; no
        ``[H, n, n]`` tensor there (else the mask merged with the bias). For another mask or causal attention, from
        ``kernels_relpos.BIAS_BAND_MIN_LENGTH`` tokens (``CAUSAL_BIAS_BAND_MIN_LENGTH`` causal) and with no mask
        or a key mask (bool ``[B|1, H|1, 1, n]``, as padding makes), :func:`kernels_relpos.saturating_bias_banded`
        instead: the band ``|j - i| < s`` explicit, the ranges beyond it in the fused kernel; no
        ``[B|1, H, n, n]`` tensor, and a causal model skips the masked half. Elsewhere (another device, an export,
        a float mask that wants its gradient) the bias spread over ``[B|1, H, n, n]`` in
        :func:`attention_with_bias`.

    Reference: ``t5_attention_oracle`` in ``tests/test_bias_band.py`` (upstream's buckets, float64).
    """
    _check_qkv(q, k, v)
    B, H, n, D = q.shape
    if k.shape[2] != n:
        raise ValueError(f"k must have q's length {n} (self-attention), got k of shape {tuple(k.shape)}")
    _check_tensor("bias", bias, 2, "[heads, 2s+1]")
    if bias.shape[0] != H or bias.shape[1] % 2 != 1 or bias.shape[1] < 3:
        raise ValueError(f"bias must have shape [heads={H}, 2s+1] with s >= 1, got {tuple(bias.shape)}")
    _check_mask(attention_mask, (B, H, n, n))
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    wants_grad = attention_mask is not None and attention_mask.requires_grad  # the distance path's mask is a constant
    # Bidirectional attention without a mask, or with padding read run by run (read_by_runs: one run of keys per
    # row), reads the bias as a view in the fused kernel (distance_bias_attention) at any length, faster than the
    # band: its backward is the fused kernel's own, and a table's gradient comes from its band and each row's smaller
    # far side (table_gradient). Another mask or causality would be spread over [B|1, H, n, n] there, and a backward
    # costs more than the band's.
    whole = not is_causal and distance_bias_applies(q, v) and not wants_grad and (
        attention_mask is None or read_by_runs(_additive_mask(attention_mask, None), B, n) is not None)
    if not whole and saturating_bias_banded_applies(q, k, v, bias, attention_mask, is_causal):
        return saturating_bias_banded(q, k, v, bias, attention_mask=attention_mask, is_causal=is_causal, scale=scale)
    mask = _additive_mask(attention_mask, _causal_pattern(n, n, 0, q.device) if is_causal else None)
    if B * H * n and distance_bias_applies(q, v) and not wants_grad:
        return distance_bias_attention(q, k, v, bias, scale, mask=mask)
    if _exporting() or not n:  # gathered: the indexing every exporter knows
        reach = bias.shape[1] // 2 - 1
        index = _relative_distance(n, n, 0, bias.device).clamp(-reach - 1, reach + 1) + reach + 1
        full = bias[:, index].unsqueeze(0)
    else:
        full = toeplitz_bias(bias, n)
    if mask is None:
        return attention_with_bias(q, k, v, full, scale=scale)
    # -inf where masked (a row with no key left then gives zeros); the bias may be half precision.
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    full = full.to(torch.promote_types(full.dtype, torch.float32)) + mask  # [B|1, H, n, n]
    return attention_with_bias(q, k, v, full, scale=scale)


def shaw_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_k: torch.Tensor,
    rel_v: Optional[torch.Tensor],
    *,
    max_relative_position: int,
    attention_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    past_length: int = 0,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    relative_position: Optional[torch.Tensor] = None,
):
    """Self-attention with relative position representations (Shaw et al. 2018, eqs. 3-5).

    With ``r_ij = clamp(j - (past_length + i), -k, k) + k``:
    ``e_ij = (q_i·k_j + q_i·rel_k[r_ij]) / sqrt(D)``, ``a = softmax_j(e + mask)``,
    ``z_i = Σ_j a_ij (v_j + rel_v[r_ij])``. ``is_causal`` masks keys ``j > past_length + i``.

    Args:
        q: ``[B, H, Q, D]``; k: ``[B, H, K, D]``; v: ``[B, H, K, D_v]``.
        rel_k: ``[2k+1, D]``; rel_v: ``[2k+1, D_v]`` or None (keys only); shared by all heads.
        max_relative_position: ``k``; past_length: the queries' offset; dropout_p: on ``a``.
        need_weights: also return ``a``.
        relative_position: ``[Q, K]`` integer, key minus query position, in place of ``j - (past_length + i)``
            (explicit positions: packed requests of a paged cache); ``is_causal`` then masks keys after the query.

    Returns:
        ``z`` ``[B, H, Q, D_v]``; with ``need_weights``, ``(z, a)`` with ``a`` ``[B, H, Q, K]`` (after
        dropout, zeros for a query with no key left).

    Note:
        Never forms a ``[.., Q, K, D]`` tensor: the key term is ``q @ rel_k.T`` (``[B, H, Q, 2k+1]``)
        gathered by ``r_ij``, the value term sums ``a`` per clipped distance and multiplies by ``rel_v``.
        On CPU self-attention without cache, dropout or weights, with no mask or a key mask, from
        ``kernels_relpos.SHAW_BAND_MIN_LENGTH`` tokens: :func:`kernels_relpos.shaw_banded` (far-left and far-right
        parts in the fused kernel, a band ``|j - i| < k``), no ``[B, H, Q, K]`` tensor either.

    Reference: ``shaw_ref`` (float64 loops), ``shaw_torch_ref`` (for gradients).
    """
    _check_qkv(q, k, v)
    max_relative_position = _check_int("max_relative_position", max_relative_position)
    past_length = _check_offset("past_length", past_length)
    dropout_p = _check_dropout(dropout_p)
    n_rel = 2 * max_relative_position + 1
    _check_tensor("rel_k", rel_k, 2, "[2*max_relative_position+1, head_dim]")
    if tuple(rel_k.shape) != (n_rel, q.shape[-1]):
        raise ValueError(
            f"rel_k must have shape [2*max_relative_position+1, head_dim] = [{n_rel}, {q.shape[-1]}], "
            f"got {tuple(rel_k.shape)}"
        )
    if rel_v is not None:
        _check_tensor("rel_v", rel_v, 2, "[2*max_relative_position+1, head_dim]")
        if tuple(rel_v.shape) != (n_rel, v.shape[-1]):
            raise ValueError(
                f"rel_v must have shape [2*max_relative_position+1, v_head_dim] = [{n_rel}, {v.shape[-1]}], "
                f"got {tuple(rel_v.shape)}"
            )
    B, H, Q, D = q.shape
    K = k.shape[2]
    _check_mask(attention_mask, (B, H, Q, K))

    if relative_position is None and not need_weights and shaw_banded_applies(
        q, k, v, max_relative_position, attention_mask, past_length, dropout_p
    ):
        return shaw_banded(q, k, v, rel_k, rel_v, max_relative_position=max_relative_position,
                           attention_mask=attention_mask, is_causal=is_causal)

    rel_index = _distances(Q, K, past_length, q.device, relative_position)
    after = rel_index > 0  # keys after the query
    rel_index = rel_index.clamp(-max_relative_position, max_relative_position) + max_relative_position
    rel_index = rel_index.expand(B, H, Q, K)

    scores = q @ k.transpose(-1, -2)
    scores = scores + torch.gather(q @ rel_k.transpose(0, 1).to(q.dtype), -1, rel_index)
    scores = scores * (1.0 / math.sqrt(D))

    causal = None
    if is_causal:
        causal = _causal_pattern(Q, K, past_length, q.device) if relative_position is None else ~after
    probs = _masked_softmax(scores, _additive_mask(attention_mask, causal))
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    probs = probs.to(v.dtype)

    out = probs @ v
    if rel_v is not None:
        per_distance = torch.zeros(B, H, Q, n_rel, dtype=probs.dtype, device=probs.device)
        per_distance = per_distance.scatter_add(-1, rel_index, probs)
        out = out + per_distance @ rel_v.to(v.dtype)
    return (out, probs) if need_weights else out


# ----------------------------------------------------------------------------------
# Transformer-XL (Dai et al. 2019)
# ----------------------------------------------------------------------------------


def transformer_xl_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r: torch.Tensor,
    u: torch.Tensor,
    w: torch.Tensor,
    *,
    attention_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    relative_position: Optional[torch.Tensor] = None,
):
    """Transformer-XL relative attention (Dai et al. 2019, sec. 3.3).

    ``e_ij = ((q_i + u)·k_j + (q_i + w)·r[d = (M+i) - j]) / sqrt(D)``: the ``K`` keys are ``M = K - Q``
    memory positions followed by the ``Q`` current ones; terms (a)+(c) are the content, (b)+(d) the
    position. With ``is_causal`` keys ``j > M+i`` are masked; without it ``r`` must cover the negative
    distances.

    Args:
        q: ``[B, H, Q, D]``; k, v: ``[B, H, K, D]`` with ``K >= Q``.
        r: ``[H, R, D]``, the projected relative embeddings ``W_{k,R} R_d`` for ``d = K-1, K-2, ..``
            descending: ``R >= K`` causal, ``R >= K + Q - 1`` otherwise.
        u, w: ``[H, D]``, the paper's ``u`` and ``v``.
        dropout_p: on the probabilities; need_weights: also return them.
        relative_position: ``[Q, K]`` integer, key minus query position, in place of ``j - (M+i)``
            (explicit positions: packed requests of a paged cache); causal only: ``r`` covers ``d = R-1 .. 0``,
            the distances ``d = -relative_position`` are clipped to it and keys after the query are masked.

    Returns:
        ``z`` ``[B, H, Q, D]``; with ``need_weights``, ``(z, a)`` with ``a`` ``[B, H, Q, K]`` (after
        dropout, zeros for a query with no key left).

    Note:
        Without dropout or weights, :func:`kernels_relpos.txl_chunked`: (b)+(d) is one matmul with ``q + w``
        read through the relative shift, an additive bias for the fused attention of ``q + u``, in
        chunks of query rows; no ``[B, H, Q, K]`` tensor. Otherwise the scores are formed explicitly.

    Reference: ``txl_ref`` (float64 loops), ``txl_torch_ref`` (for gradients).
    """
    _check_qkv(q, k, v)
    dropout_p = _check_dropout(dropout_p)
    B, H, Q, D = q.shape
    K = k.shape[2]
    if K < Q and relative_position is None:
        raise ValueError(f"k must have at least as many positions as q (memory + current), got K={K} < Q={Q}")
    _check_tensor("r", r, 3, "[heads, R, head_dim]")
    if r.shape[0] != H or r.shape[2] != D:
        raise ValueError(f"r must have shape [heads={H}, R, head_dim={D}], got {tuple(r.shape)}")
    R = r.shape[1]
    need = K if is_causal else K + Q - 1
    if relative_position is not None:
        if not is_causal:
            raise ValueError("relative_position is for causal attention (is_causal=True): r covers distances >= 0")
        need = 1
    if R < need:
        what = "K (distances K-1 .. 0)" if is_causal else "K + Q - 1 (distances K-1 .. -(Q-1), is_causal=False)"
        raise ValueError(f"r must cover R >= {what} = {need} relative positions, got R={R}")
    for name, bias in (("u", u), ("w", w)):
        _check_tensor(name, bias, 2, "[heads, head_dim]")
        if tuple(bias.shape) != (H, D):
            raise ValueError(f"{name} must have shape [heads, head_dim] = [{H}, {D}], got {tuple(bias.shape)}")
    _check_mask(attention_mask, (B, H, Q, K))

    if (Q == 0 or B * H == 0) and not need_weights:  # nothing to attend (the fused CPU kernel divides by the head count)
        return q.new_zeros(B, H, Q, v.shape[-1]) + 0.0 * sum(t.sum() for t in (q, k, v, r, u, w))
    scale = 1.0 / math.sqrt(D)
    if relative_position is None and dropout_p == 0.0 and not need_weights and txl_chunked_applies():
        return txl_chunked(q, k, v, r, u, w, attention_mask=attention_mask, is_causal=is_causal)
    content = (q + u[:, None, :].to(q.dtype)) @ k.transpose(-1, -2)  # terms (a) + (c)
    position = (q + w[:, None, :].to(q.dtype)) @ r.to(q.dtype).transpose(-1, -2)  # terms (b) + (d)
    if relative_position is None:
        M = K - Q
        causal = _causal_pattern(Q, K, M, q.device) if is_causal else None
        position = _rel_shift(position, K)
    else:  # r's column R-1-d holds distance d: read each pair's own distance
        distance = -_distances(Q, K, 0, q.device, relative_position)
        causal = distance >= 0
        column = (R - 1 - distance.clamp(0, R - 1)).expand(B, H, Q, K)
        position = torch.gather(position, -1, column)
    probs = _masked_softmax((content + position) * scale, _additive_mask(attention_mask, causal))
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    probs = probs.to(v.dtype)
    out = probs @ v
    return (out, probs) if need_weights else out


# ----------------------------------------------------------------------------------
# Causal attention with a bias per key (causal ALiBi, FoX)
# ----------------------------------------------------------------------------------


def causal_key_bias_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor,
    *,
    attention_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    span: Optional[float] = None,
) -> torch.Tensor:
    """Causal self-attention with a bias per key.

    ``z_i = softmax_{j <= i}(q_i·k_j · scale + key_bias[b, h, j] + mask) v``.

    Args:
        q, k, v: ``[B, H, n, D]``.
        key_bias: ``[H, n]`` or ``[B|1, H, n]``, may need a gradient (causal ALiBi: :func:`alibi_key_bias`;
            FoX: :func:`fox_key_bias`; give it in float64 so that its differences stay exact).
        attention_mask: see the module docstring; scale: default ``1 / sqrt(D)``.
        span: the most the bias may spread over one chunk of the fused path's query rows (FoX:
            ``kernels_relpos.KEY_BIAS_SPAN``), or None for ``kernels_relpos.KEY_BIAS_CHUNK`` rows whatever the spread.

    Returns:
        ``[B, H, n, D]``; a row with no key left gives zeros.

    Note:
        On CPU, with no mask or a key mask (bool ``[B|1, H|1, 1, n]``, as padding makes), in half precision
        only for a bias that needs no gradient (ALiBi's; FoX's at inference),
        :func:`kernels_relpos.causal_key_bias`: the bias rides as a ``[B|1, H, 1, n]`` mask in SDPA's
        fused kernel with its causal flag, which skips the masked half; no ``[Q, K]`` tensor, and the
        bias's gradient ``Σ_i dS_ij`` comes from the kernel's backward (in the inputs' dtype). The kernel
        adds the bias in float32 at least (bf16/fp16 inputs too), measured from the middle row of each
        chunk: the values it adds for the keys that matter stay below half the bias's spread over the
        chunk, ALiBi's ``m_h · 1024`` over ``kernels_relpos.KEY_BIAS_CHUNK`` rows (3e-5 for slope 1/2,
        against 1e-6 for the exact form in float32), at most ``span / 2`` where it is given (FoX: 1024,
        1.2e-4 whatever the gate). Elsewhere (other devices, other masks, export) the bias is applied
        exactly as ``key_bias[j] - key_bias[i]`` over ``[B|1, H, n, n]``.

    Reference: ``alibi_causal_oracle`` in ``tests/test_key_bias.py``; ``fox_oracle`` in ``tests/test_fox.py``.
    """
    _check_qkv(q, k, v)
    B, H, n, D = q.shape
    if k.shape[2] != n:
        raise ValueError(f"k must have q's length {n} (self-attention), got k of shape {tuple(k.shape)}")
    ndim = key_bias.dim() if isinstance(key_bias, torch.Tensor) and key_bias.dim() == 3 else 2
    _check_tensor("key_bias", key_bias, ndim, "[heads, k_len] or [batch|1, heads, k_len]")
    if tuple(key_bias.shape[-2:]) != (H, n) or (key_bias.dim() == 3 and key_bias.shape[0] not in (1, B)):
        raise ValueError(
            f"key_bias must have shape [heads, k_len] = [{H}, {n}] or [batch|1, heads, k_len] = [{B}|1, {H}, {n}], "
            f"got {tuple(key_bias.shape)}"
        )
    _check_mask(attention_mask, (B, H, n, n))
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    # The chunks a span bounds are found on the host (data-dependent): a traced graph takes the exact form.
    traced_span = span is not None and torch.compiler.is_compiling()
    if causal_key_bias_applies(q, k, v, key_bias, attention_mask) and not traced_span:
        return causal_key_bias(q, k, v, key_bias, attention_mask=attention_mask, scale=scale, span=span)
    work = torch.promote_types(key_bias.dtype, torch.float32)
    key_bias = key_bias.to(work) if key_bias.dim() == 3 else key_bias.to(work)[None]
    exact = key_bias[:, :, None, :] - key_bias[:, :, :, None]
    exact = exact + _additive_mask(attention_mask, _causal_pattern(n, n, 0, q.device))
    alive = torch.isfinite(exact).any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=exact.to(q.dtype), scale=scale)
    if torch.compiler.is_compiling():  # no host read in a traced graph
        return out.masked_fill(~alive, 0.0)
    return out.masked_fill(~alive, 0.0) if not bool(alive.all()) else out
