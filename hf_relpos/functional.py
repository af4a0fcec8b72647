"""The math of every position scheme, in pure PyTorch (no Transformers import).

Layout everywhere is ``[batch, heads, seq, head_dim]`` as in
``torch.nn.functional.scaled_dot_product_attention``. A query at index ``i`` of a
call that follows ``past_length`` earlier tokens sits at absolute position
``past_length + i``; key ``j`` sits at absolute position ``j``.

``attention_mask`` follows SDPA: a boolean tensor (True = may attend) or an additive
float tensor, broadcastable to ``[batch, heads, q_len, k_len]``. In an additive mask,
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
import torch.utils.checkpoint
from torch.autograd.function import once_differentiable

__all__ = [
    "attention_with_bias",
    "t5_relative_position_bucket",
    "t5_position_bias",
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
    "kerple_log_bias",
    "fire_bias",
]


# ----------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------


def _check_int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = int(value.item())
        else:
            raise TypeError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def _check_offset(name: str, value):
    """A position offset: an int >= 0, or, while ``torch.compile`` traces, a cache's 0-d integer tensor, kept
    a tensor (reading it on the host would break the graph); :func:`_is_zero` tells the two apart."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() and torch.compiler.is_compiling():
        return value
    return _check_int(name, value)


def _is_zero(offset) -> bool:
    """True for the int 0; a traced tensor offset is never known to be 0, so the paths for any offset run."""
    return isinstance(offset, int) and offset == 0


def _check_tensor(name: str, x, ndim: int, shape_doc: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape_doc}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims {shape_doc}, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


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


def _additive_mask(attention_mask: Optional[torch.Tensor], causal: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Fold a bool/additive mask and a bool causal pattern into one float32 mask with -inf."""
    out = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            out = torch.zeros(attention_mask.shape, dtype=torch.float32, device=attention_mask.device)
            out = out.masked_fill(~attention_mask, float("-inf"))
        else:
            # Transformers' masks use finfo.min, not -inf: treat both as "masked".
            masked = attention_mask <= torch.finfo(attention_mask.dtype).min
            out = attention_mask.to(torch.promote_types(attention_mask.dtype, torch.float32))
            out = out.masked_fill(masked, float("-inf"))
    if causal is not None:
        causal_add = torch.zeros(causal.shape, dtype=torch.float32, device=causal.device)
        causal_add = causal_add.masked_fill(~causal, float("-inf"))
        out = causal_add if out is None else out + causal_add
    return out


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


def _causal_pattern(query_length: int, key_length: int, offset: int, device) -> torch.Tensor:
    """[Q, K] bool, True where key j <= offset + i (the query's own absolute position)."""
    i = torch.arange(query_length, device=device)[:, None]
    j = torch.arange(key_length, device=device)[None, :]
    return j <= i + offset


def _relative_distance(query_length: int, key_length: int, past_length: int, device) -> torch.Tensor:
    """[Q, K] long: j - (past_length + i), key position minus query position."""
    i = torch.arange(query_length, device=device)[:, None] + past_length
    j = torch.arange(key_length, device=device)[None, :]
    return j - i


# ----------------------------------------------------------------------------------
# Attention with a learned additive bias: fused forward, chunked backward
# ----------------------------------------------------------------------------------


# SDPA's fused CPU kernel and its backward, called directly for their log-sum-exp output and input.
# Unlike the public SDPA entry point they assume a unit stride along head_dim: see _unit_stride.
_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _unit_stride(*tensors: torch.Tensor):
    """The tensors with a unit stride along the last dim (copied only where needed), as the raw kernel reads them."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


class _AttentionWithBias(torch.autograd.Function):
    """``softmax(q k^T · scale + bias) v`` whose backward also returns the bias gradient.

    PyTorch's CPU SDPA leaves its fused kernel for the math path (which keeps the whole
    ``[B, H, Q, K]`` probability tensor for backward) as soon as the mask needs a gradient. Here the
    forward runs the fused kernel with the bias as a constant and keeps only its output; the
    backward recomputes the probabilities ``P = exp(S - lse)`` from the kernel's log-sum-exp, a chunk
    of query rows at a time, and applies the softmax gradient ``dS = P ⊙ (dO V^T - rowsum(dO ⊙ O))``
    (as FlashAttention does).
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, chunk_size):
        out, lse = _flash_cpu(q, k, v, 0.0, False, attn_mask=bias.detach(), scale=scale)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, out, lse = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk_size
        work = torch.promote_types(q.dtype, torch.float32)
        qs, kf, vf, gf = (q.to(work) * scale), k.to(work), v.to(work), grad_out.to(work)
        delta = (gf * out.to(work)).sum(-1, keepdim=True)
        lse = lse.to(work).unsqueeze(-1)
        # exp(S - lse) is exact only while lse keeps the precision of log K: a row whose every key
        # sits at a huge negative value (finfo.min masks, -1e9 biases) rounds it away. Such rows, and a
        # backward that must itself be differentiable (create_graph), take a full softmax instead.
        exact = bool((lse.abs().amax() * torch.finfo(lse.dtype).eps < 2.0**-10)) and not torch.is_grad_enabled()
        dq, dk, dv = torch.empty_like(qs), torch.zeros_like(kf), torch.zeros_like(vf)
        dbias = torch.empty(bias.shape, dtype=work, device=bias.device) if ctx.needs_input_grad[3] else None
        for start in range(0, q.shape[2], chunk):
            rows = slice(start, start + chunk)
            # P = exp(s - lse) with the forward kernel's log-sum-exp: whole rows need no max or sum pass.
            # A row with every key at -inf has scores -inf (and lse 0 from the kernel): P = 0, as its output.
            scores = (qs[:, :, rows] @ kf.transpose(-1, -2)).add_(bias[:, :, rows].to(work))
            if exact:
                probs = scores.sub_(lse[:, :, rows]).exp_()
            else:
                probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # out of place: create_graph may need it
            del scores
            g = gf[:, :, rows]
            dv += probs.transpose(-1, -2) @ g
            dscores = g @ vf.transpose(-1, -2)
            dscores.sub_(delta[:, :, rows]).mul_(probs)  # the softmax gradient dS = P ⊙ (dP - rowsum(dO ⊙ O))
            del probs
            dq[:, :, rows] = dscores @ kf
            dk += dscores.transpose(-1, -2) @ qs[:, :, rows]
            if dbias is not None:
                for dim in (0, 1):  # a bias broadcast over batch or heads gets the summed gradient
                    if bias.shape[dim] == 1 and dscores.shape[dim] != 1:
                        dscores = dscores.sum(dim, keepdim=True)
                dbias[:, :, rows] = dscores
        dq *= scale
        cast = lambda t, like: None if t is None else t.to(like.dtype)  # noqa: E731
        return cast(dq, q), cast(dk, k), cast(dv, v), cast(dbias, bias), None, None


def attention_with_bias(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    *,
    scale: Optional[float] = None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """``softmax(q k^T · scale + bias) v`` -> ``[B, H, Q, D]`` for a bias that is trained (e.g. T5's).

    ``bias`` is an additive float tensor ``[B|1, H|1, Q, K]``. On CPU the forward runs SDPA's fused
    kernel and the backward recomputes the probabilities in chunks of ``chunk_size`` query rows, so
    no ``[B, H, Q, K]`` probability tensor is kept between forward and backward (extra backward memory
    O(B·H·chunk_size·K) besides the bias gradient). Elsewhere it is plain SDPA.
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
    if q.device.type != "cpu" or not torch.is_grad_enabled():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=scale)
    q, k, v = _unit_stride(q, k, v)
    return _AttentionWithBias.apply(q, k, v, bias.to(q.dtype).contiguous(), scale, chunk_size)


# ----------------------------------------------------------------------------------
# T5 bucketed bias (Raffel et al. 2020)
# ----------------------------------------------------------------------------------


def _check_t5_buckets(bidirectional: bool, num_buckets, max_distance, buckets_name: str = "num_buckets") -> None:
    _check_int(buckets_name, num_buckets, 0)
    _check_int("max_distance", max_distance, 0)
    one_side = num_buckets // 2 if bidirectional else num_buckets
    max_exact = one_side // 2
    if max_exact < 1:
        need = 4 if bidirectional else 2
        raise ValueError(
            f"{buckets_name} must be >= {need} when bidirectional={bidirectional} (so that each direction has an "
            f"exact bucket), got {num_buckets}"
        )
    if max_distance <= max_exact:
        raise ValueError(
            f"max_distance must be > {max_exact} (the exact-bucket region for num_buckets={num_buckets}, "
            f"bidirectional={bidirectional}) to leave room for log-spaced buckets, got {max_distance}"
        )


def t5_relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """T5's bucket of ``relative_position = key_pos - query_pos`` (Raffel et al. 2020, sec. 2.1).

    Half of a direction's buckets hold exact distances ``0 .. max_exact-1``; the other half are
    log-spaced up to ``max_distance``; farther distances share the last bucket. Bit-identical to
    Transformers' ``T5Attention._relative_position_bucket`` (the same float32 operations in the
    same order), but raises where upstream would return out-of-range buckets.
    """
    if not isinstance(relative_position, torch.Tensor):
        raise TypeError(f"relative_position must be an integer torch.Tensor, got {type(relative_position).__name__}")
    if relative_position.is_floating_point() or relative_position.is_complex() or relative_position.dtype == torch.bool:
        raise TypeError(f"relative_position must be an integer tensor, got dtype {relative_position.dtype}")
    _check_t5_buckets(bidirectional, num_buckets, max_distance)

    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))

    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    # Keep upstream's exact op order (float32 log, divide by a Python float, scale, truncate):
    # bucket boundaries are sensitive to rounding.
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
    )
    return relative_buckets + torch.where(is_small, relative_position, relative_position_if_large)


def t5_position_bias(
    weight: torch.Tensor,
    query_length: int,
    key_length: int,
    *,
    bidirectional: bool = True,
    max_distance: int = 128,
    past_length: int = 0,
) -> torch.Tensor:
    """T5's additive bias ``B[h, i, j] = weight[bucket(j - (past_length + i)), h]`` -> ``[1, H, Q, K]``.

    ``weight`` is the ``[num_buckets, H]`` table (T5's ``nn.Embedding.weight``). Equals upstream
    ``T5Attention.compute_bias(Q, K, past_seen_tokens=past_length)``. Only the ``Q`` query rows
    asked for are computed, so a decoding step costs one row per new token.
    """
    _check_tensor("weight", weight, 2, "[num_buckets, heads]")
    query_length = _check_int("query_length", query_length)
    key_length = _check_int("key_length", key_length)
    past_length = _check_offset("past_length", past_length)
    _check_t5_buckets(bidirectional, weight.shape[0], max_distance, buckets_name="weight.shape[0] (num_buckets)")
    # The bias depends on j - (past + i) only: bucket each of the Q + K - 1 distances once (the same
    # function, so the same buckets as upstream), then spread the per-distance values over [Q, K].
    device = weight.device
    if isinstance(past_length, torch.Tensor):  # traced decoding: the distances' range is not known on the host
        buckets = t5_relative_position_bucket(
            _relative_distance(query_length, key_length, past_length, device),
            bidirectional=bidirectional, num_buckets=weight.shape[0], max_distance=max_distance,
        )
        return F.embedding(buckets, weight).permute(2, 0, 1).unsqueeze(0)
    lowest = -(past_length + query_length - 1)
    distances = torch.arange(lowest, key_length - past_length, device=device)
    buckets = t5_relative_position_bucket(
        distances, bidirectional=bidirectional, num_buckets=weight.shape[0], max_distance=max_distance
    )
    per_distance = F.embedding(buckets, weight).t()  # [H, Q + K - 1]
    index = _relative_distance(query_length, key_length, past_length, device) - lowest
    return per_distance[:, index].unsqueeze(0)


def t5_saturation_distance(bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128) -> int:
    """The smallest ``s`` from which every distance ``|d| >= s`` (on a side) falls in that side's last bucket.

    Buckets grow with ``|d|`` and the last one is reached by ``max_distance`` at the latest, so
    T5's bias is constant per head and side beyond ``s - 1``.
    """
    _check_t5_buckets(bidirectional, num_buckets, max_distance)
    distances = torch.arange(max_distance + 1)
    buckets = t5_relative_position_bucket(-distances, bidirectional, num_buckets, max_distance)
    return int((buckets != buckets[-1]).nonzero().max()) + 1


def t5_bias_by_distance(weight: torch.Tensor, *, bidirectional: bool = True, max_distance: int = 128) -> torch.Tensor:
    """T5's bias per clipped distance -> ``[H, 2s+1]``: column ``s + d`` holds the bias of ``d = j - i``
    for ``d = -s .. s``, where ``s`` = :func:`t5_saturation_distance`; columns ``0`` and ``2s`` hold the
    bias of every farther distance on their side. The input :func:`saturating_bias_attention` takes."""
    _check_tensor("weight", weight, 2, "[num_buckets, heads]")
    s = t5_saturation_distance(bidirectional, weight.shape[0], max_distance)
    distances = torch.arange(-s, s + 1, device=weight.device)
    buckets = t5_relative_position_bucket(distances, bidirectional, weight.shape[0], max_distance)
    return F.embedding(buckets, weight).t()


# ----------------------------------------------------------------------------------
# Shaw et al. 2018: relative key and value embeddings
# ----------------------------------------------------------------------------------


def _diagonals(full: torch.Tensor, width: int) -> torch.Tensor:
    """``[.., c, c+width-1] -> [.., c, width]`` with ``out[.., i, t] = full[.., i, i+t]`` (a block's band).

    Padding every flattened block by ``c`` and reading it back with rows one longer shifts row ``i``
    left by ``i``: the pad-and-reshape skew of Transformer-XL's relative shift.
    """
    c = full.shape[-2]
    flat = F.pad(full.flatten(-2), (0, c))
    return flat.view(*full.shape[:-2], c, c + width)[..., :width]


def _undiagonals(band: torch.Tensor) -> torch.Tensor:
    """The inverse placement of :func:`_diagonals`: ``out[.., i, i+t] = band[.., i, t]``, zeros elsewhere."""
    c, width = band.shape[-2:]
    flat = F.pad(band, (0, c)).flatten(-2)[..., : c * (c + width - 1)]
    return flat.view(*band.shape[:-2], c, c + width - 1)


_BAND_BLOCK = 64  # query rows per block of the band
_BAND_ROWS = 512  # query rows per pass over the band (a multiple of the block): bounds its temporaries


class _Band:
    """Scores and values inside the band ``|j - i| <= reach`` for the query rows ``rows`` (self-attention,
    ``past_length = 0``).

    Query rows go in blocks of ``block``; each block meets the ``block + 2·reach`` keys its rows can
    reach in one matmul, and :func:`_diagonals` keeps each row's ``2·reach + 1`` band entries, so the
    band costs ``O(n·(block + 2·reach)·D)`` with no ``[.., q, k, D]`` tensor. Band slot ``t`` holds key
    ``j = i - reach + t`` (distance ``t - reach``), which is slot ``t + 1`` of the per-distance tables.
    ``keys`` (bool ``[B|1, H|1, n]``, True = may attend) masks keys, as padding does.
    """

    def __init__(self, n: int, reach: int, causal: bool, block: int, device, keys: Optional[torch.Tensor] = None,
                 rows: Optional[tuple] = None):
        self.n, self.reach, self.block = n, reach, block
        self.start, self.stop = rows if rows is not None else (0, n)
        self.width = 2 * reach + 1
        t = torch.arange(self.width, device=device)
        j = torch.arange(self.start, self.stop, device=device)[:, None] - reach + t
        valid = (j >= 0) & (j < n)
        if causal:
            valid &= t <= reach
        if keys is not None:  # each row's band slots read the key mask through the same sliding window
            window = F.pad(keys, (reach, reach), value=False).unfold(-1, self.width, 1)
            valid = valid & window[..., self.start : self.stop, :]
        self.invalid = ~valid  # [rows, width] or [B|1, H|1, rows, width]

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, n, ..] -> [B, H, rows/block, block, ..]``, the band's rows (zero rows past them)."""
        x = x[:, :, self.start : self.stop]
        x = F.pad(x, (0, 0, 0, -x.shape[2] % self.block))
        return x.view(*x.shape[:2], -1, self.block, x.shape[-1])

    def _key_windows(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, n, D] -> [B, H, rows/block, D, block + 2·reach]``: the keys ``b·block - reach ..`` each
        block of the band's rows can reach (zero rows outside the sequence), a view of one padded copy."""
        first = self.start - self.reach  # the key row the first block's window starts at
        last = self.start + -(-(self.stop - self.start) // self.block) * self.block + self.reach  # one past the end
        x = x[:, :, max(first, 0) : min(last, self.n)]
        padded = F.pad(x, (0, 0, max(0, -first), max(0, last - self.n)))
        return padded.unfold(2, self.block + 2 * self.reach, self.block)

    def scores(self, q, k, rel_k, bias, scale):
        """``[B, H, rows, 2·reach+1]``: ``(q_i·k_j + q_i·rel_k[d]) · scale + bias[h, d]``, ``-inf`` outside the sequence."""
        rows = self.stop - self.start
        full = self._blocks(q) @ self._key_windows(k)
        band = _diagonals(full, self.width).flatten(2, 3)[:, :, :rows]
        if rel_k is not None:
            band = band + q[:, :, self.start : self.stop] @ rel_k[1:-1].transpose(0, 1)
        band = band * scale
        if bias is not None:
            band = band + bias[:, None, 1:-1]
        return band.masked_fill(self.invalid, float("-inf"))

    def values(self, probs, v, rel_v):
        """``Σ_t probs[.., i, t] · (v_j + rel_v[d])`` for the band's rows (``probs`` holds only them) -> ``[B, H, rows, D]``."""
        rows = self.stop - self.start
        padded = F.pad(probs, (0, 0, 0, -rows % self.block))
        full = _undiagonals(padded.view(*padded.shape[:2], -1, self.block, padded.shape[-1]))
        out = (full @ self._key_windows(v).transpose(-1, -2)).flatten(2, 3)[:, :, :rows]
        if rel_v is not None:
            out = out + probs @ rel_v[1:-1]
        return out


def _row_chunks(n: int):
    return [(start, min(start + _BAND_ROWS, n)) for start in range(0, n, _BAND_ROWS)]


class _BandedAttention(torch.autograd.Function):
    """Attention whose position terms stop changing beyond a distance, as three parts merged by log-sum-exp.

    The terms are per clipped distance ``d = clamp(j - i, -(reach+1), reach+1)``: a key vector
    ``rel_k[d]`` (Shaw), a value vector ``rel_v[d]`` (Shaw) and a per-head logit ``bias[h, d]`` (T5's
    bucketed bias, which saturates at its last bucket). For ``j <= i - (reach+1)`` they are constant:
    ``q_i·k_j + q_i·rel_k[0] = q_i·(k_j + rel_k[0])``, values ``v_j + rel_v[0]``, and a constant logit
    ``bias[h, 0]``, which leaves that part's softmax unchanged and adds to its log-sum-exp. So the
    far-left (and, unless causal, far-right) key range is plain causal attention over shifted keys
    and values, run by SDPA's fused CPU kernel (the right on the reversed sequence); only the band
    ``|j - i| <= reach`` is explicit (:class:`_Band`). The parts' outputs merge with weights
    ``exp(lse_part - lse)``. The backward runs the fused kernel's backward for each far part with the
    merged output and log-sum-exp (less the part's constant logit), which makes that part's gradient
    exact; the constant logit's gradient is ``Σ_i mass_i (dO_i·O_part_i - dO_i·O_i)``, the sum of the
    softmax gradient ``dS = P ⊙ (dP - rowsum(dO ⊙ O))`` over the part, from the part's own output
    and probability mass. The band is differentiated by recomputing it.

    ``keys`` (bool ``[B|1, H|1, n]`` or None) masks keys (padding): in the band through the band's
    mask, in the far parts as a ``[B|1, H|1, 1, n]`` mask the fused kernel broadcasts over rows. A
    row with no key left in a part has that part's log-sum-exp at ``-inf`` (the kernel reports 0);
    a row with no key at all gives zeros.
    """

    @staticmethod
    def forward(ctx, q, k, v, rel_k, rel_v, bias, keys, reach, causal, scale, block):
        with torch.autocast(q.device.type, enabled=False):  # the band in float32 whatever autocast asks
            return _BandedAttention._forward(ctx, q, k, v, rel_k, rel_v, bias, keys, reach, causal, scale, block)

    @staticmethod
    def _forward(ctx, q, k, v, rel_k, rel_v, bias, keys, reach, causal, scale, block):
        work = torch.promote_types(q.dtype, torch.float32)
        cast = lambda t: None if t is None else t.to(work)  # noqa: E731
        n = q.shape[2]
        qw, kw, vw, rel_kw, rel_vw, biasw = q.to(work), k.to(work), v.to(work), cast(rel_k), cast(rel_v), cast(bias)
        out, lse = q.new_empty(*q.shape[:3], v.shape[-1], dtype=work), q.new_empty(q.shape[:3], dtype=work)
        for start, stop in _row_chunks(n):
            band = _Band(n, reach, causal, block, q.device, keys, (start, stop))
            s = band.scores(qw, kw, rel_kw, biasw, scale)
            rows_lse = torch.logsumexp(s, dim=-1)  # -inf only for a row whose band keys are all masked
            out[:, :, start:stop] = band.values(torch.exp(s - _finite(rows_lse)[..., None]), vw, rel_vw)
            lse[:, :, start:stop] = rows_lse
            del s
        parts = []
        for side in _BandedAttention._sides(q, k, v, rel_k, rel_v, bias, keys, reach, causal):
            part_out, part_lse = _flash_cpu(*side["qkv"], 0.0, True, attn_mask=side["mask"], scale=scale)
            rows = side["rows"]
            part_out, part_lse = side["unflip"](part_out).to(work), side["unflip"](part_lse) + side["logit"]
            if side["alive"] is not None:
                part_lse = part_lse.masked_fill(~side["alive"], float("-inf"))
            merged = torch.logaddexp(lse[:, :, rows], part_lse)
            weight = _finite(merged)
            out[:, :, rows] = out[:, :, rows] * torch.exp(lse[:, :, rows] - weight)[..., None] + part_out * torch.exp(
                part_lse - weight
            )[..., None]
            lse[:, :, rows] = merged
            if bias is not None and ctx.needs_input_grad[5]:
                parts += [part_out, part_lse]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, rel_k, rel_v, bias, keys, out, _finite(lse), *parts)
        ctx.reach, ctx.causal, ctx.scale, ctx.block = reach, causal, scale, block
        return out

    @staticmethod
    def _sides(q, k, v, rel_k, rel_v, bias, keys, reach, causal):
        """The far-left part (and far-right unless causal) as causal-kernel inputs: rows ``i > reach`` of
        the (reversed, for the right) sequence attend keys ``j < i - reach``, i.e. the top-left causal
        pattern of the query rows shifted by ``reach + 1``; ``logit`` is the part's ``[H, 1]`` constant,
        ``mask`` its additive key mask and ``alive`` its rows that have a key left (None: all)."""
        n, first = q.shape[2], reach + 1
        shift = lambda x, table, idx: x if table is None else x + table[idx].to(x.dtype)  # noqa: E731
        logit = lambda idx: 0.0 if bias is None else bias[:, idx, None].to(torch.promote_types(q.dtype, torch.float32))  # noqa: E731
        same = lambda t: t  # noqa: E731
        flip = lambda t: t.flip(2)  # noqa: E731
        mask = left_alive = right_alive = None
        if keys is not None:
            mask = torch.zeros(keys.shape, dtype=q.dtype, device=q.device).masked_fill_(~keys, float("-inf"))
            mask = mask.unsqueeze(-2)
            seen = keys.cumsum(-1)  # keys allowed in [0, j]; row i of the left part sees [0, i - first]
            left_alive = seen[..., : n - first] > 0
            right_alive = (seen[..., -1:] - seen + keys)[..., first:] > 0  # allowed in [i + first, n)
        sides = [
            dict(qkv=(q[:, :, first:], shift(k, rel_k, 0), shift(v, rel_v, 0)), rows=slice(first, n), unflip=same,
                 index=0, logit=logit(0), mask=mask, alive=left_alive)
        ]
        if not causal:
            sides.append(
                dict(qkv=(flip(q)[:, :, first:], flip(shift(k, rel_k, -1)), flip(shift(v, rel_v, -1))),
                     rows=slice(0, n - first), unflip=flip, index=-1, logit=logit(-1),
                     mask=None if mask is None else mask.flip(-1), alive=right_alive)
            )
        return sides

    @staticmethod
    @once_differentiable  # the fused kernel's backward has no derivative of its own
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _BandedAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, rel_k, rel_v, bias, keys, out, lse, *parts = ctx.saved_tensors
        reach, causal, scale = ctx.reach, ctx.causal, ctx.scale
        work = torch.promote_types(q.dtype, torch.float32)
        grad_out = grad_out.contiguous()
        g = grad_out.to(work)
        delta = (g * out.to(work)).sum(-1)
        # The band, differentiated by recomputing it against the merged log-sum-exp: with
        # P = exp(s - lse) and delta_i = dO_i·O_i, the surrogate Σ dO·(P V') - Σ_i delta_i Σ_t P_it
        # has d/ds = P ⊙ (dO·v' - delta), the softmax gradient.
        n = q.shape[2]
        leaves = [None if t is None else t.detach().to(work).requires_grad_() for t in (q, k, v, rel_k, rel_v, bias)]
        wanted = [t for t in leaves if t is not None]
        sums = None
        for start, stop in _row_chunks(n):  # a pass at a time keeps the recomputed band's graph small
            rows = slice(start, stop)
            with torch.enable_grad():
                band = _Band(n, reach, causal, ctx.block, q.device, keys, (start, stop))
                probs = torch.exp(band.scores(leaves[0], leaves[1], leaves[3], leaves[5], scale) - lse[:, :, rows, None])
                surrogate = (band.values(probs, leaves[2], leaves[4]) * g[:, :, rows]).sum()
                surrogate = surrogate - (probs.sum(-1) * delta[:, :, rows]).sum()
                grads = torch.autograd.grad(surrogate, wanted, allow_unused=True)
            grads = [torch.zeros_like(t) if d is None else d for d, t in zip(grads, wanted)]
            sums = grads if sums is None else [a.add_(b) for a, b in zip(sums, grads)]
        found = iter(sums)
        dq, dk, dv, drel_k, drel_v, dbias = (None if t is None else next(found) for t in leaves)
        for number, side in enumerate(_BandedAttention._sides(q, k, v, rel_k, rel_v, bias, keys, reach, causal)):
            rows, flip, first = side["rows"], side["unflip"], reach + 1
            sq, sk, sv = side["qkv"]
            kernel_lse = (lse[:, :, rows] - side["logit"]) if bias is not None else lse[:, :, rows]
            gq, gk, gv = _flash_cpu_backward(
                flip(grad_out)[:, :, first:], sq, sk, sv, flip(out)[:, :, first:].contiguous(),
                flip(kernel_lse).to(lse.dtype).contiguous(), 0.0, True, attn_mask=side["mask"], scale=scale,
            )
            gq, gk, gv = flip(gq), flip(gk), flip(gv)
            dq[:, :, rows] += gq
            dk += gk
            dv += gv
            index = side["index"]
            if drel_k is not None:
                drel_k[index] += gk.sum((0, 1, 2))
            if drel_v is not None:
                drel_v[index] += gv.sum((0, 1, 2))
            if dbias is not None and parts:
                part_out, part_lse = parts[2 * number], parts[2 * number + 1]
                mass = torch.exp(part_lse - lse[:, :, rows])
                dbias[:, index] += (mass * ((g[:, :, rows] * part_out).sum(-1) - delta[:, :, rows])).sum((0, 2))
        cast = lambda t, like: None if t is None else t.to(like.dtype)  # noqa: E731
        grads = [cast(d, t) for d, t in zip((dq, dk, dv, drel_k, drel_v, dbias), (q, k, v, rel_k, rel_v, bias))]
        return (*grads, None, None, None, None, None)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp with the ``-inf`` of rows that have no key replaced by 0, so ``exp(s - lse)`` gives 0, not NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _key_mask(attention_mask: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
    """A bool mask of keys alone (``[B|1, H|1, 1, n]``, as padding makes) as ``[B|1, H|1, n]``; None otherwise."""
    if attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        return None
    if attention_mask.shape[-2] != 1 or attention_mask.shape[-1] != n:
        return None
    return attention_mask[..., 0, :]


def _banded_applies(q, k, v, reach, attention_mask, past_length, dropout_p, min_length) -> bool:
    """The band decomposition runs for CPU self-attention without cache or dropout, and without a mask
    or with one that masks keys alone (padding), when long enough to pay."""
    n = q.shape[2]
    return (
        q.device.type == "cpu"
        and (attention_mask is None or _key_mask(attention_mask, n) is not None)
        and _is_zero(past_length)
        and dropout_p == 0.0
        and k.shape[2] == n
        and v.shape[-1] == q.shape[-1]  # the fused kernel needs one head size
        and q.numel() > 0
        and n >= max(min_length, reach + 2)  # each far part has a row
    )


def _shaw_banded_applies(q, k, v, max_relative_position, attention_mask, past_length, dropout_p) -> bool:
    return max_relative_position >= 1 and _banded_applies(
        q, k, v, max_relative_position - 1, attention_mask, past_length, dropout_p, _SHAW_BAND_MIN_LENGTH
    )


# Below this the gathered [B, H, n, n] form is faster on CPU (scripts/bench_band.py --scheme shaw measures the crossover).
_SHAW_BAND_MIN_LENGTH = 512


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
    """Self-attention with a per-head bias of the relative distance that is constant beyond ``s`` -> ``[B, H, n, D]``.

    ``bias`` is ``[H, 2s+1]``: ``B[h, i, j] = bias[h, clamp(j - i, -s, s) + s]`` (T5's bucketed bias
    is such a bias: :func:`t5_bias_by_distance`). ``softmax(q k^T · scale + B + mask) v``; ``is_causal``
    masks keys ``j > i``. On CPU, once ``n`` is long enough and the mask masks keys alone (bool
    ``[B|1, H|1, 1, n]``, as padding does) or is None, the band ``|j - i| < s`` is explicit and the
    ranges beyond it run in the fused kernel (:class:`_BandedAttention`): no ``[B|1, H, n, n]`` tensor,
    and a causal model skips the masked half. Otherwise the bias is spread over ``[B|1, H, n, n]``.
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
    reach = bias.shape[1] // 2 - 1
    min_length = _CAUSAL_BIAS_BAND_MIN_LENGTH if is_causal else _BIAS_BAND_MIN_LENGTH
    if _banded_applies(q, k, v, reach, attention_mask, 0, 0.0, min_length):
        q, k, v = _unit_stride(q, k, v)
        keys = _key_mask(attention_mask, n)
        return _BandedAttention.apply(q, k, v, None, None, bias, keys, reach, is_causal, scale, _BAND_BLOCK)
    index = _relative_distance(n, n, 0, bias.device).clamp(-reach - 1, reach + 1) + reach + 1
    full = bias[:, index].unsqueeze(0)
    mask = _additive_mask(attention_mask, _causal_pattern(n, n, 0, q.device) if is_causal else None)
    if mask is None:
        return attention_with_bias(q, k, v, full, scale=scale)
    # -inf where masked (a row with no key left then gives zeros); the bias may be half precision.
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    full = full.to(torch.promote_types(full.dtype, torch.float32)) + mask  # [B|1, H, n, n]
    return attention_with_bias(q, k, v, full, scale=scale)


# Below these the bias spread over [1, H, n, n] in the fused kernel is as fast on CPU (T5's 32 buckets up to 128:
# band |d| < 91), bidirectional and causal: scripts/bench_band.py --scheme t5_bias [--causal] measures the crossover.
_BIAS_BAND_MIN_LENGTH = 1536
_CAUSAL_BIAS_BAND_MIN_LENGTH = 1024


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
):
    """Self-attention with relative position representations (Shaw et al. 2018, eqs. 3-5).

    With ``r_ij = clamp(j - (past_length + i), -k, k) + k``:
    ``e_ij = (q_i·k_j + q_i·rel_k[r_ij]) / sqrt(D)``, ``a = softmax_j(e + mask)``,
    ``z_i = Σ_j a_ij (v_j + rel_v[r_ij])``.

    Never forms a ``[.., q, k, D]`` tensor. On CPU, self-attention without mask, cache or dropout
    splits into far-left and far-right parts run by the fused kernel and a band ``|j - i| < k``
    (:class:`_BandedAttention`), so no ``[B, H, Q, K]`` tensor is formed either. Otherwise the key term is
    ``q @ rel_k.T`` (``[B, H, Q, 2k+1]``) gathered by ``r_ij``, and the value term sums ``a`` per
    clipped distance (``[B, H, Q, 2k+1]``) and multiplies by ``rel_v``.

    With ``need_weights=True`` returns ``(z, a)``: the probabilities ``a`` ``[B, H, Q, K]`` (after
    dropout, zeros for a query with no key left) come from the gathered form, which materialises them.
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

    if not need_weights and _shaw_banded_applies(q, k, v, max_relative_position, attention_mask, past_length, dropout_p):
        q, k, v = _unit_stride(q, k, v)
        keys = _key_mask(attention_mask, K)
        return _BandedAttention.apply(
            q, k, v, rel_k, rel_v, None, keys, max_relative_position - 1, is_causal, 1.0 / math.sqrt(D), _BAND_BLOCK
        )

    rel_index = _relative_distance(Q, K, past_length, q.device)
    rel_index = rel_index.clamp(-max_relative_position, max_relative_position) + max_relative_position
    rel_index = rel_index.expand(B, H, Q, K)

    scores = q @ k.transpose(-1, -2)
    scores = scores + torch.gather(q @ rel_k.transpose(0, 1).to(q.dtype), -1, rel_index)
    scores = scores * (1.0 / math.sqrt(D))

    causal = _causal_pattern(Q, K, past_length, q.device) if is_causal else None
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


def _rel_shift(x: torch.Tensor, key_length: int) -> torch.Tensor:
    """Transformer-XL's relative shift: ``out[.., i, j] = x[.., i, j + Q - 1 - i]`` -> ``[.., Q, K]``.

    ``x[.., i, t]`` holds distance ``d = K-1-t``; the query at ``M+i`` needs ``d = M+i-j``, i.e.
    ``t = j + Q-1-i``. The original code pads a zero column and reshapes; reading the same flat
    buffer through a strided view (row stride ``R-1``, offset ``Q-1``) is the identical indexing
    without the copy. Entries for ``t >= R`` are read from the next row and must be masked
    (causal use with ``R = K``).
    """
    Q, R = x.shape[-2], x.shape[-1]
    if torch.compiler.is_compiling():  # Dynamo cannot trace storage offsets: the same entries by index
        t = torch.arange(key_length, device=x.device)[None, :] + (Q - 1 - torch.arange(Q, device=x.device))[:, None]
        return x.gather(-1, t.clamp_max(R - 1).expand(*x.shape[:-2], Q, key_length))
    x = x.contiguous()
    lead = x.shape[:-2]
    lead_strides = x.stride()[:-2]
    return x.as_strided((*lead, Q, key_length), (*lead_strides, R - 1, 1), x.storage_offset() + Q - 1)


def _rel_unshift(grad: torch.Tensor, width: int) -> torch.Tensor:
    """The adjoint of ``_rel_shift(x, K)`` for an ``x`` of ``width`` columns: ``[.., Q, K] -> [.., Q, width]``.

    The original code's pad-and-reshape run backwards: ``grad`` padded to ``width`` columns, laid
    out flat after ``Q`` zeros and read as rows of ``width + 1`` without their first column.
    Wrapped-around entries (``t >= width``) must carry zero gradient (they are masked).
    """
    *lead, Q, K = grad.shape
    flat = grad.new_empty(*lead, Q * (width + 1))
    flat[..., :Q] = 0
    rows = flat[..., Q:].view(*lead, Q, width)
    rows[..., K:] = 0
    rows[..., :K] = grad
    return flat.view(*lead, Q, width + 1)[..., 1:]


_TXL_CHUNK = 256  # query rows per chunk of Transformer-XL attention


def _fused_attention(q, k, v, mask):
    """``softmax(q k^T + mask) v`` in the fused kernel (``q`` pre-scaled; a row with every key at -inf gives zeros)."""
    if q.device.type == "cpu":
        return _flash_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=1.0)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)


class _TransformerXLAttention(torch.autograd.Function):
    """Transformer-XL attention in chunks of query rows, with its own backward.

    For the rows ``a .. a+c`` of a chunk, the position scores ``(q_i + w)·r[d]`` need only the
    ``r`` rows the chunk's distances reach: one ``[c, K_c + c - 1]`` matmul read through the
    relative shift (a strided view, no copy). They ride as the additive mask of the fused kernel
    for ``q + u`` against the keys (with causality, only the ``K_c = M + a + c`` keys the chunk
    can see). The backward recomputes each chunk's probabilities and forms
    ``dS = P ⊙ (dO V^T - rowsum(dO ⊙ O))``; ``dS`` shifted back (:func:`_rel_unshift`) gives the
    gradients of ``q + w`` and ``r``. No ``[B, H, Q, K]`` tensor is kept or formed: memory
    ``O(B·H·c·K)`` beyond the inputs. The scale is folded into ``q + u`` and ``q + w``.
    """

    @staticmethod
    def _chunk(q, k, r, u, w, user_mask, causal, scale, start, stop):
        """The chunk's scaled ``q + u`` and ``q + w``, keys kept, ``r`` window and position scores + mask."""
        Q, K, R = q.shape[2], k.shape[2], r.shape[1]
        c, M = stop - start, K - Q
        keys = M + stop if causal else K
        first = Q - stop  # the r column the chunk's last row reads at key 0, less the c-1 rows of shift
        width = min(keys + c - 1, R - first)
        qu = (q[:, :, start:stop] + u[:, None, :]) * scale
        qw = (q[:, :, start:stop] + w[:, None, :]) * scale
        r_window = r[:, first:first + width]
        bias = _rel_shift(qw @ r_window.transpose(-1, -2), keys)
        if user_mask is not None:
            bias = bias + user_mask[..., start:stop, :keys]
        if causal and c > 1:  # also hides the shift's wrapped-around entries (a lone last row has none)
            bias = bias.masked_fill(~_causal_pattern(c, keys, M + start, q.device), float("-inf"))
        return qu, qw, keys, first, width, bias

    @staticmethod
    def forward(ctx, q, k, v, r, u, w, user_mask, causal, scale, chunk):
        B, H, Q, D = q.shape
        ctx.dtypes = (r.dtype, u.dtype, w.dtype)
        ctx.mask_shape = None if user_mask is None else (user_mask.shape, user_mask.dtype)
        r, u, w = r.to(q.dtype), u.to(q.dtype), w.to(q.dtype)
        if user_mask is not None:
            user_mask = user_mask.to(q.dtype).expand(B, H, Q, k.shape[2])
        out = q.new_empty(B, H, Q, v.shape[-1])
        for start in range(0, Q, chunk):
            stop = min(start + chunk, Q)
            qu, _, keys, _, _, bias = _TransformerXLAttention._chunk(q, k, r, u, w, user_mask, causal, scale, start, stop)
            out[:, :, start:stop] = _fused_attention(qu, k[:, :, :keys], v[:, :, :keys], bias)
        ctx.save_for_backward(q, k, v, r, u, w, user_mask, out)
        ctx.causal, ctx.scale, ctx.chunk = causal, scale, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, r, u, w, user_mask, out = ctx.saved_tensors
        dtypes = (q.dtype, k.dtype, v.dtype, *ctx.dtypes)
        causal, scale = ctx.causal, ctx.scale
        work = torch.promote_types(q.dtype, torch.float32)
        q, k, v, r, u, w, out, g_all = (t.to(work) for t in (q, k, v, r, u, w, out, grad_out))
        if user_mask is not None:
            user_mask = user_mask.to(work)
        delta = (g_all * out).sum(-1, keepdim=True)
        dq, dk, dv, dr = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(r)
        du, dw = torch.zeros_like(u), torch.zeros_like(w)
        # A float mask that requires grad (rare) gets dS, the gradient of the scores it is added to.
        dmask = torch.zeros(user_mask.shape, dtype=work, device=q.device) if ctx.needs_input_grad[6] else None
        for start in range(0, q.shape[2], ctx.chunk):
            stop = min(start + ctx.chunk, q.shape[2])
            qu, qw, keys, first, width, bias = _TransformerXLAttention._chunk(
                q, k, r, u, w, user_mask, causal, scale, start, stop
            )
            kc, vc, g = k[:, :, :keys], v[:, :, :keys], g_all[:, :, start:stop]
            probs = torch.softmax((qu @ kc.transpose(-1, -2)).add_(bias), dim=-1)
            if user_mask is not None:  # a row with every key masked: zeros (causality always leaves one)
                probs.nan_to_num_(0.0)
            dv[:, :, :keys] += probs.transpose(-1, -2) @ g
            dscores = (g @ vc.transpose(-1, -2)).sub_(delta[:, :, start:stop]).mul_(probs)
            del probs
            dk[:, :, :keys] += dscores.transpose(-1, -2) @ qu
            if dmask is not None:
                dmask[:, :, start:stop, :keys] = dscores
            dposition = _rel_unshift(dscores, width)
            dr[:, first:first + width] += (dposition.transpose(-1, -2) @ qw).sum(0)
            dqu, dqw = (dscores @ kc).mul_(scale), (dposition @ r[:, first:first + width]).mul_(scale)
            dq[:, :, start:stop] = dqu + dqw
            du += dqu.sum((0, 2))
            dw += dqw.sum((0, 2))
        grads = [t.to(dtype) for t, dtype in zip((dq, dk, dv, dr, du, dw), dtypes)]
        if dmask is not None:
            shape, dtype = ctx.mask_shape
            dmask = dmask.sum_to_size(shape).to(dtype)
        return (*grads, dmask, None, None, None)


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
):
    """Transformer-XL relative attention (Dai et al. 2019, eq. in sec. 3.3).

    ``e_ij = ((q_i + u)·k_j + (q_i + w)·r[d = (M+i) - j]) / sqrt(D)`` where the ``K`` keys are
    ``M = K - Q`` memory positions followed by the ``Q`` current ones. ``r`` is ``[H, R, D]``
    (projected relative embeddings ``W_{k,R} R_d``, distances descending from ``K-1``); ``u`` and
    ``w`` (the paper's ``v``) are ``[H, D]``. Terms (b)+(d) are one matmul with ``q + w`` followed by
    the relative shift; that score matrix is an additive bias for the fused attention of ``q + u``
    against the keys (terms (a)+(c)), in chunks of query rows (:class:`_TransformerXLAttention`).

    With ``need_weights=True`` (or dropout) the scores are formed explicitly; then it returns
    ``(z, a)`` with the probabilities ``a`` ``[B, H, Q, K]`` (after dropout, zeros for a query with
    no key left).
    """
    _check_qkv(q, k, v)
    dropout_p = _check_dropout(dropout_p)
    B, H, Q, D = q.shape
    K = k.shape[2]
    if K < Q:
        raise ValueError(f"k must have at least as many positions as q (memory + current), got K={K} < Q={Q}")
    _check_tensor("r", r, 3, "[heads, R, head_dim]")
    if r.shape[0] != H or r.shape[2] != D:
        raise ValueError(f"r must have shape [heads={H}, R, head_dim={D}], got {tuple(r.shape)}")
    R = r.shape[1]
    need = K if is_causal else K + Q - 1
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
    user_mask = _additive_mask(attention_mask, None)
    if dropout_p == 0.0 and not need_weights:
        q, k, v = _unit_stride(q, k, v)
        return _TransformerXLAttention.apply(q, k, v, r, u, w, user_mask, is_causal, scale, _TXL_CHUNK)
    M = K - Q
    causal = _causal_pattern(Q, K, M, q.device) if is_causal else None
    content = (q + u[:, None, :].to(q.dtype)) @ k.transpose(-1, -2)  # terms (a) + (c)
    position = (q + w[:, None, :].to(q.dtype)) @ r.to(q.dtype).transpose(-1, -2)  # terms (b) + (d)
    probs = _masked_softmax((content + _rel_shift(position, K)) * scale, _additive_mask(attention_mask, causal))
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    probs = probs.to(v.dtype)
    out = probs @ v
    return (out, probs) if need_weights else out


def sinusoidal_embedding(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Transformer-XL's ``R`` (Vaswani et al. 2017 frequencies): ``[sin(p·f_k), cos(p·f_k)]``.

    ``f_k = 10000^(-2k/dim)`` for ``k = 0 .. dim/2-1``; the sin half first, then the cos half,
    as in the original code. Returns ``[len(positions), dim]`` in ``positions``' float dtype
    (float32 for integer positions).
    """
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a 1-D torch.Tensor, got {type(positions).__name__}")
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D [len], got shape {tuple(positions.shape)}")
    dim = _check_int("dim", dim, 2)
    if dim % 2:
        raise ValueError(f"dim must be even (a sin half and a cos half), got {dim}")
    dtype = positions.dtype if positions.is_floating_point() else torch.float32
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=positions.device, dtype=compute) / dim))
    angles = positions.to(compute)[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(dtype)


# ----------------------------------------------------------------------------------
# Fixed biases: log-decay and ALiBi (Press et al. 2022)
# ----------------------------------------------------------------------------------


def log_decay_bias(
    query_length: int,
    key_length: int,
    *,
    scale: float,
    past_length: int = 0,
    device: Optional[torch.device] = None,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """The parameter-free bias ``B_ij = -scale · ln(1 + |j - (past_length + i)|)`` -> ``[Q, K]``."""
    query_length = _check_int("query_length", query_length)
    key_length = _check_int("key_length", key_length)
    past_length = _check_offset("past_length", past_length)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise ValueError(f"scale must be a finite number >= 0, got {scale!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    distance = _relative_distance(query_length, key_length, past_length, device).abs()
    dtype = dtype or torch.get_default_dtype()
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    # "+ 0.0" turns the -0.0 on the diagonal into 0.0.
    return (-float(scale) * torch.log1p(distance.to(compute)) + 0.0).to(dtype)


def alibi_slopes(
    num_heads: int, *, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """ALiBi head slopes (Press et al. 2022, sec. 3): a geometric sequence from ``2^(-8/n)``.

    For ``n`` a power of two, ``m_h = 2^(-8h/n)``, ``h = 1 .. n``. Otherwise take the slopes of
    the largest power of two ``c < n`` and append every other slope of the ``2c`` sequence.
    """
    num_heads = _check_int("num_heads", num_heads, 1)
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")

    def power_of_two(n: int) -> list:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(closest)
    if closest != num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, device=device, dtype=dtype or torch.get_default_dtype())


def alibi_bias(slopes: torch.Tensor, query_length: int, key_length: int, *, past_length: int = 0) -> torch.Tensor:
    """ALiBi's bias ``B[h, i, j] = -m_h · |j - (past_length + i)|`` -> ``[1, H, Q, K]``."""
    _check_tensor("slopes", slopes, 1, "[heads]")
    query_length = _check_int("query_length", query_length)
    key_length = _check_int("key_length", key_length)
    past_length = _check_offset("past_length", past_length)
    distance = _relative_distance(query_length, key_length, past_length, slopes.device).abs()
    compute = torch.float64 if slopes.dtype == torch.float64 else torch.float32
    bias = -slopes.to(compute)[:, None, None] * distance.to(compute) + 0.0
    return bias.to(slopes.dtype).unsqueeze(0)


def alibi_key_bias(slopes: torch.Tensor, key_length: int) -> torch.Tensor:
    """ALiBi's causal bias as a bias per key -> ``[H, K]``: ``m_h · (j - (K - 1))``.

    For a query at ``i`` and keys ``j <= i``, ``-m_h (i - j) = m_h (j - (K-1)) - m_h (i - (K-1))``, and the
    last term is constant along the query's row, which softmax ignores. Measured from the last key,
    so the most recent keys carry the smallest values. :func:`causal_key_bias_attention` takes it.
    """
    _check_tensor("slopes", slopes, 1, "[heads]")
    key_length = _check_int("key_length", key_length)
    compute = torch.float64 if slopes.dtype == torch.float64 else torch.float32
    j = torch.arange(key_length, device=slopes.device, dtype=compute)
    return (slopes.to(compute)[:, None] * (j - (key_length - 1)) + 0.0).to(slopes.dtype)


class _CausalKeyBiasAttention(torch.autograd.Function):
    """Causal attention with a per-key bias in the fused CPU kernel, ``chunk`` query rows at a time.

    Rows ``a .. b-1`` meet the keys before ``a`` (all visible) and their own square block (causal) in
    two kernel calls merged by log-sum-exp. Each chunk measures the bias from its last row,
    ``key_bias[j] - key_bias[b-1]`` (formed in the key bias's own precision, float64 from the model),
    so the values the kernel adds stay within ``|key_bias[b-1-chunk] - key_bias[b-1]|`` for the keys that
    matter, whatever the length: the kernel's rounding of the logits stays ``eps`` times that. The
    backward runs the kernel's backward for each part with the merged output and log-sum-exp.
    ``keys`` (bool ``[B|1, H|1, n]``) masks keys; a row with no key left gives zeros.
    """

    @staticmethod
    def _parts(q, k, v, key_bias, keys, start, stop):
        """The chunk's (keys slice, causal, additive mask, alive rows or None) for the prefix and its own block."""
        rel = (key_bias[:, :stop] - key_bias[:, stop - 1 : stop]).to(q.dtype)[None, :, None, :]  # [1, H, 1, stop]
        if keys is not None:  # -inf (not finfo.min): the kernel then gives a row with no key zeros
            rel = rel.masked_fill(~keys[..., None, :stop], float("-inf"))
            seen = keys[..., :stop].cumsum(-1)
        parts = [(slice(start, stop), True, rel[..., start:stop],
                  None if keys is None else (seen[..., start:stop] - seen[..., start - 1 : start] if start else
                                             seen[..., start:stop]) > 0)]
        if start:
            alive = None if keys is None else (seen[..., start - 1 : start] > 0).expand(*seen.shape[:-1], stop - start)
            parts.append((slice(0, start), False, rel[..., :start], alive))
        return parts

    @staticmethod
    def forward(ctx, q, k, v, key_bias, keys, scale, chunk):
        work = torch.promote_types(q.dtype, torch.float32)
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=work)
        for start in range(0, q.shape[2], chunk):
            stop = min(start + chunk, q.shape[2])
            acc = acc_lse = None
            for cols, causal, mask, alive in _CausalKeyBiasAttention._parts(q, k, v, key_bias, keys, start, stop):
                part, part_lse = _flash_cpu(q[:, :, start:stop], k[:, :, cols], v[:, :, cols], 0.0, causal,
                                            attn_mask=mask, scale=scale)
                part, part_lse = part.to(work), part_lse.to(work)
                if alive is not None:
                    part_lse = part_lse.masked_fill(~alive, float("-inf"))
                if acc is None:
                    acc, acc_lse = part, part_lse
                    continue
                merged = torch.logaddexp(acc_lse, part_lse)
                weight = _finite(merged)
                acc = acc * torch.exp(acc_lse - weight)[..., None] + part * torch.exp(part_lse - weight)[..., None]
                acc_lse = merged
            out[:, :, start:stop], lse[:, :, start:stop] = acc, _finite(acc_lse)
        ctx.save_for_backward(q, k, v, key_bias, keys, out, lse)
        ctx.scale, ctx.chunk = scale, chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, key_bias, keys, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for start in range(0, q.shape[2], ctx.chunk):
            stop = min(start + ctx.chunk, q.shape[2])
            rows = slice(start, stop)
            for cols, causal, mask, _ in _CausalKeyBiasAttention._parts(q, k, v, key_bias, keys, start, stop):
                gq, gk, gv = _flash_cpu_backward(
                    grad_out[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols], out[:, :, rows].contiguous(),
                    lse[:, :, rows].contiguous(), 0.0, causal, attn_mask=mask, scale=ctx.scale,
                )
                dq[:, :, rows] += gq
                dk[:, :, cols] += gk
                dv[:, :, cols] += gv
        return dq, dk, dv, None, None, None, None


# Query rows per call of the per-key kernel: the bias the kernel adds stays within m·2048 (ALiBi, slope m).
_KEY_BIAS_CHUNK = 2048


def causal_key_bias_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor,
    *,
    attention_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal self-attention with a bias per key: ``softmax_{j <= i}(q_i·k_j · scale + key_bias[h, j] + mask) v`` -> ``[B, H, n, D]``.

    ``key_bias`` is ``[H, n]`` (causal ALiBi: :func:`alibi_key_bias`; give it in float64 so that its
    differences stay exact). On CPU in float32/float64, with no mask or one that masks keys alone
    (bool ``[B|1, H|1, 1, n]``, as padding does), the bias rides as a ``[B|1, H, 1, n]`` mask in SDPA's
    fused kernel together with its causal flag, which skips the masked half: no ``[Q, K]`` tensor
    (:class:`_CausalKeyBiasAttention`). The kernel adds the bias to the scores in the inputs'
    precision: measured from the last row of each chunk of ``_KEY_BIAS_CHUNK`` rows, the values it
    adds for the keys that matter stay below ALiBi's ``m_h · 2048``, so the logits carry at most about
    ``eps · m_h · 2048`` (6e-5 in float32 for slope 1/2, against 1e-6 for the exact form). Elsewhere
    (other devices, half precision, where that error would be large, other masks, a key bias that
    needs a gradient) the bias is applied exactly as ``key_bias[h, j] - key_bias[h, i]`` over
    ``[B|1, H, n, n]``. A row with no key left gives zeros.
    """
    _check_qkv(q, k, v)
    B, H, n, D = q.shape
    if k.shape[2] != n:
        raise ValueError(f"k must have q's length {n} (self-attention), got k of shape {tuple(k.shape)}")
    _check_tensor("key_bias", key_bias, 2, "[heads, k_len]")
    if tuple(key_bias.shape) != (H, n):
        raise ValueError(f"key_bias must have shape [heads, k_len] = [{H}, {n}], got {tuple(key_bias.shape)}")
    _check_mask(attention_mask, (B, H, n, n))
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    keys = _key_mask(attention_mask, n)
    fused = (
        q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and n > 0 and B * H > 0
        and v.shape[-1] == D  # the fused kernel needs one head size
        and (attention_mask is None or keys is not None)
        # the kernel gives no gradient for its mask: a trained key bias takes the exact form
        and not (key_bias.requires_grad and torch.is_grad_enabled())
    )
    if fused:
        q, k, v = _unit_stride(q, k, v)
        return _CausalKeyBiasAttention.apply(q, k, v, key_bias, keys, scale, _KEY_BIAS_CHUNK)
    work = torch.promote_types(key_bias.dtype, torch.float32)
    exact = (key_bias.to(work)[:, None, :] - key_bias.to(work)[:, :, None]).unsqueeze(0)
    exact = exact + _additive_mask(attention_mask, _causal_pattern(n, n, 0, q.device))
    alive = torch.isfinite(exact).any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=exact.to(q.dtype), scale=scale)
    return out.masked_fill(~alive, 0.0) if not bool(alive.all()) else out


# ----------------------------------------------------------------------------------
# Learned biases of the distance: KERPLE (Chi et al. 2022), FIRE (Li et al. 2024)
# ----------------------------------------------------------------------------------


def kerple_log_bias(
    r1: torch.Tensor, r2: torch.Tensor, query_length: int, key_length: int, *, past_length: int = 0
) -> torch.Tensor:
    """KERPLE's logarithmic kernel ``B[h, i, j] = -r1_h · ln(1 + r2_h · |j - (past_length + i)|)`` -> ``[1, H, Q, K]``.

    ``r1``, ``r2``: ``[H]``, positive (Chi et al. 2022, the "log" variant of their conditionally positive
    definite kernels). The fixed log-decay bias is the case ``r1 = scale``, ``r2 = 1``.
    """
    _check_tensor("r1", r1, 1, "[heads]")
    _check_tensor("r2", r2, 1, "[heads]")
    if r1.shape != r2.shape:
        raise ValueError(f"r1 and r2 must both be [heads], got shapes {tuple(r1.shape)} and {tuple(r2.shape)}")
    query_length = _check_int("query_length", query_length)
    key_length = _check_int("key_length", key_length)
    past_length = _check_offset("past_length", past_length)
    if not torch.compiler.is_compiling():  # a host read: checked in eager calls
        for name, value in (("r1", r1), ("r2", r2)):
            if not bool((value > 0).all()):
                raise ValueError(f"{name} must be positive (KERPLE's r1, r2 > 0), got {value.detach().tolist()}")
    distance = _relative_distance(query_length, key_length, past_length, r1.device).abs()
    compute = torch.float64 if r1.dtype == torch.float64 else torch.float32
    bias = -r1.to(compute)[:, None, None] * torch.log1p(r2.to(compute)[:, None, None] * distance.to(compute)) + 0.0
    return bias.to(r1.dtype).unsqueeze(0)


# Rows of the FIRE MLP's [rows, K, width] hidden layer formed at a time: memory stays bounded at any length.
_FIRE_ELEMENTS = 1 << 22


def _fire_mlp(x, w1, b1, w2, b2):
    return F.linear(F.relu(F.linear(x[..., None], w1, b1)), w2, b2)


def fire_bias(
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    c: torch.Tensor,
    threshold: torch.Tensor,
    query_length: int,
    key_length: int,
    *,
    past_length: int = 0,
    positions: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """FIRE (Li et al. 2024, its bias with a learned threshold): ``B[h, i, j] = f(ψ(i' - j) / ψ(max(L, p_i)))_h``
    -> ``[B|1, H, Q, K]``.

    ``i' = past_length + i`` is the query's index among the keys (distances are ``i' - j``); ``p_i`` its
    position in its sequence, ``positions`` ``[B|1, Q]`` (default ``i'``), which differs from ``i'`` when keys
    were dropped (a sliding window), in packed rows or after left padding; ``ψ(x) = ln(1 + |c·x|)`` the log transform with a
    learned ``c``; ``L = threshold`` the learned length below which the normaliser stays ``ψ(L)``
    (progressive interpolation beyond it); ``f(x) = w2·relu(w1·x + b1) + b2`` the learned MLP, given as an
    ``nn.Linear`` pair's weights: ``w1`` ``[width, 1]``, ``b1`` ``[width]``, ``w2`` ``[H, width]``, ``b2``
    ``[H]``; ``c`` and ``threshold`` are 0-d. ``eps`` keeps ``ψ(max(L, p_i))`` away from 0, as the paper's
    code does. Meant for causal attention (``j <= p_i``); the MLP runs over blocks of query rows, each
    recomputed in backward, so its ``[rows, K, width]`` hidden layer is never whole.
    """
    for name, x, ndim, doc in (("w1", w1, 2, "[width, 1]"), ("b1", b1, 1, "[width]"), ("w2", w2, 2, "[heads, width]"),
                               ("b2", b2, 1, "[heads]"), ("c", c, 0, "[] (a scalar)"),
                               ("threshold", threshold, 0, "[] (a scalar)")):
        _check_tensor(name, x, ndim, doc)
    width, heads = w1.shape[0], w2.shape[0]
    if w1.shape[1] != 1 or tuple(b1.shape) != (width,) or tuple(w2.shape) != (heads, width) or tuple(b2.shape) != (heads,):
        raise ValueError(
            f"w1, b1, w2, b2 must be [width, 1], [width], [heads, width], [heads] (an nn.Linear pair), got "
            f"{[tuple(t.shape) for t in (w1, b1, w2, b2)]}"
        )
    query_length = _check_int("query_length", query_length)
    key_length = _check_int("key_length", key_length)
    past_length = _check_offset("past_length", past_length)
    device = w1.device
    compute = torch.float64 if w1.dtype == torch.float64 else torch.float32
    c, threshold = c.to(compute), threshold.to(compute)
    if positions is None:
        positions = (torch.arange(query_length, device=device) + past_length)[None]
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[1] != query_length:
        got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"positions must be [batch|1, query_length={query_length}], got {got}")

    def psi(x):
        return torch.log1p((c * x).abs())

    normaliser = psi(torch.maximum(positions.to(compute), threshold)) + eps  # [B|1, Q]
    distance = _relative_distance(query_length, key_length, past_length, device).to(compute)
    x = psi(distance) / normaliser[:, :, None]  # [B|1, Q, K]: |i' - j| through ψ's absolute value
    weights = [t.to(compute) for t in (w1, b1, w2, b2)]
    rows = max(1, _FIRE_ELEMENTS // max(1, key_length * width))
    checkpoint = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *weights))
    blocks = []
    for start in range(0, query_length, rows):
        part = x[:, start : start + rows]
        if checkpoint:  # keep only x for backward, not the hidden layer
            blocks.append(torch.utils.checkpoint.checkpoint(_fire_mlp, part, *weights, use_reentrant=False))
        else:
            blocks.append(_fire_mlp(part, *weights))
    bias = torch.cat(blocks, dim=1) if blocks else x.new_zeros(x.shape[0], 0, key_length, heads)
    return bias.permute(0, 3, 1, 2).to(w1.dtype)

