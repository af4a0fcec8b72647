"""The fast autograd paths behind ``functional.py``'s attention functions, as plain entry points.

Each entry point computes exactly what its ``functional.py`` counterpart defines (the reference math, checked
against the float64 oracles in ``tests/oracles.py``) with less memory or time on CPU; ``tests/test_kernels.py``
checks each against both, values and gradients. ``functional.py`` checks the arguments and dispatches here when
the matching ``*_applies`` predicate holds; the entry points assume it holds and do not check again. Thresholds
and chunk sizes are arguments whose defaults are the module constants below, so a test or a benchmark picks a
path or a chunk by passing them.

Shapes as in ``functional.py``'s legend: ``B`` batch, ``H`` heads, ``Q`` query rows, ``K`` keys (``n`` for
self-attention), ``D`` head size.

=================================  ========================================  ====================================
entry point                        computes                                  used by
=================================  ========================================  ====================================
:func:`fused_bias_attention`       ``softmax(q k^T · scale + bias) v``       ``attention_with_bias``
:func:`distance_bias_attention`    the same, a bias of the clipped distance  ``saturating_bias_attention``
:func:`shaw_banded`                Shaw's attention, self-attention          ``shaw_attention``
:func:`saturating_bias_banded`     a bias of the clipped distance            ``saturating_bias_attention``
:func:`txl_chunked`                Transformer-XL attention                  ``transformer_xl_attention``
:func:`causal_key_bias`            causal attention with a per-key bias      ``causal_key_bias_attention``
:func:`fire_mlp`                   FIRE's MLP over blocks of query rows      ``fire_bias``
=================================  ========================================  ====================================

Flat module (remote code copies it beside ``modeling_relpos.py``): relative imports only, no Transformers.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.autograd.function import once_differentiable

from .attention_utils_relpos import _additive_mask, _causal_pattern, _exporting, _is_zero, _rel_shift
from .bias_kernels_relpos import (  # noqa: F401 (re-exported: this module is the fast paths' one entry)
    FUSED_BIAS_CHUNK,
    _flash_cpu,
    _flash_cpu_backward,
    _unit_stride,
    distance_bias_applies,
    distance_bias_attention,
    fused_bias_applies,
    fused_bias_attention,
    key_runs,
    read_by_runs,
    toeplitz_bias,
)
from .denormals_relpos import flushing_backward, flushing_denormals

__all__ = [
    "fused_bias_applies",
    "fused_bias_attention",
    "toeplitz_bias",
    "distance_bias_applies",
    "distance_bias_attention",
    "key_runs",
    "read_by_runs",
    "shaw_banded_applies",
    "shaw_banded",
    "saturating_bias_banded_applies",
    "saturating_bias_banded",
    "banded_attention",
    "txl_chunked_applies",
    "txl_chunked",
    "causal_key_bias_applies",
    "causal_key_bias",
    "fire_mlp_applies",
    "fire_mlp",
]

# Defaults of the entry points' thresholds and chunk sizes.
BAND_BLOCK = 64  # query rows per block of the band
BAND_ROWS = 512  # query rows per pass over the band (a multiple of the block): bounds its temporaries
# Below this the gathered [B, H, n, n] form is faster on CPU (scripts/bench_band.py --scheme shaw measures the crossover).
SHAW_BAND_MIN_LENGTH = 512
# Below these the bias spread over [1, H, n, n] in the fused kernel is as fast on CPU (T5's 32 buckets up to 128:
# band |d| < 91), bidirectional and causal: scripts/bench_band.py --scheme t5_bias [--causal] measures the crossover.
BIAS_BAND_MIN_LENGTH = 2048
CAUSAL_BIAS_BAND_MIN_LENGTH = 1024
TXL_CHUNK = 256  # query rows per chunk of Transformer-XL attention
# Query rows per call of the per-key kernel: the bias the kernel adds stays within m·1024 (ALiBi, slope m).
KEY_BIAS_CHUNK = 2048
# The most a learned per-key bias (FoX's -cumsum(log f)) may spread over one chunk of the per-key kernel: fewer rows
# where it spreads faster, so that float32 logits round at most about eps·1024 (1.2e-4) whatever the gate, as ALiBi's
# do with slope 1; FoX's initial gate (f about 1/2) spreads by 1420 over 2048 rows: one chunk. More chunks cost time
# (each chunk's own causal block runs slower than its share of one causal call).
KEY_BIAS_SPAN = 2048.0
# Rows of the FIRE MLP's [rows, K, width] hidden layer formed at a time: memory stays bounded at any length.
FIRE_ELEMENTS = 1 << 22


# ----------------------------------------------------------------------------------
# The band decomposition: Shaw's relative embeddings, saturating per-distance biases
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


class _Band:
    """Scores and values inside the band ``|j - i| <= reach`` for the query rows ``rows`` (self-attention,
    ``past_length = 0``).

    Query rows go in blocks of ``block``; each block meets the ``block + width - 1`` keys its rows can
    reach in one matmul, and :func:`_diagonals` keeps each row's ``width`` band entries (``2·reach + 1``;
    ``reach + 1`` when causal, which has no keys to the right), so the band costs
    ``O(n·(block + width)·D)`` with no ``[.., q, k, D]`` tensor. Band slot ``t`` holds key
    ``j = i - reach + t`` (distance ``t - reach``), which is slot ``t + 1`` of the per-distance tables
    (``self.slots``). ``keys`` (bool ``[B|1, H|1, n]``, True = may attend) masks keys, as padding does.
    """

    def __init__(self, n: int, reach: int, causal: bool, block: int, device, keys: Optional[torch.Tensor] = None,
                 rows: Optional[tuple] = None):
        self.n, self.reach, self.block = n, reach, block
        self.start, self.stop = rows if rows is not None else (0, n)
        self.width = reach + 1 if causal else 2 * reach + 1
        self.slots = slice(1, 1 + self.width)  # the band's distances -reach .. (0 or reach) in a per-distance table
        t = torch.arange(self.width, device=device)
        j = torch.arange(self.start, self.stop, device=device)[:, None] - reach + t
        valid = (j >= 0) & (j < n)
        if keys is not None:  # each row's band slots read the key mask through the same sliding window
            window = F.pad(keys, (reach, reach), value=False).unfold(-1, 2 * reach + 1, 1)[..., : self.width]
            valid = valid & window[..., self.start : self.stop, :]
        self.invalid = ~valid  # [rows, width] or [B|1, H|1, rows, width]

    @property
    def key_range(self) -> tuple:
        """``(lo, hi)``: the keys the band's rows reach, ``k[:, :, lo:hi]``."""
        span = self.block + self.width - 1
        first = self.start - self.reach  # the key row the first block's window starts at
        blocks = -(-(self.stop - self.start) // self.block)
        last = first + (blocks - 1) * self.block + span  # one past the last window's end
        return max(first, 0), min(last, self.n)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, rows, ..] -> [B, H, rows/block, block, ..]``, the band's rows (zero rows past them)."""
        x = F.pad(x, (0, 0, 0, -x.shape[2] % self.block))
        return x.view(*x.shape[:2], -1, self.block, x.shape[-1])

    def _key_windows(self, x: torch.Tensor) -> torch.Tensor:
        """``k[:, :, lo:hi]`` (``key_range``) ``-> [B, H, rows/block, D, block + width - 1]``: the keys
        ``b·block - reach ..`` each block of the band's rows can reach (zero rows outside the sequence), a view of
        one padded copy."""
        span = self.block + self.width - 1
        first = self.start - self.reach
        last = first + (-(-(self.stop - self.start) // self.block) - 1) * self.block + span
        padded = F.pad(x, (0, 0, max(0, -first), max(0, last - self.n)))
        return padded.unfold(2, span, self.block)

    def scores(self, q, k, rel_k, bias, scale):
        """``[B, H, rows, width]``: ``(q_i·k_j + q_i·rel_k[d]) · scale + bias[h, d]``, ``-inf`` outside the sequence;
        ``q`` the band's rows ``q[:, :, start:stop]``, ``k`` its keys ``k[:, :, lo:hi]`` (``key_range``)."""
        rows = self.stop - self.start
        full = self._blocks(q) @ self._key_windows(k)
        band = _diagonals(full, self.width).flatten(2, 3)[:, :, :rows]
        if rel_k is not None:
            band = band + q @ rel_k[self.slots].transpose(0, 1)
        band = band * scale
        if bias is not None:
            band = band + bias[:, None, self.slots]
        return band.masked_fill(self.invalid, float("-inf"))

    def _spread(self, band: torch.Tensor) -> torch.Tensor:
        """``[B, H, rows, width] -> [B, H, rows/block, block, block + width - 1]``: each block's band entries at their
        keys' columns of the block's window (:func:`_undiagonals`), zeros elsewhere and in the rows past the band's."""
        padded = F.pad(band, (0, 0, 0, -(self.stop - self.start) % self.block))
        return _undiagonals(padded.view(*padded.shape[:2], -1, self.block, padded.shape[-1]))

    def _fold(self, windows: torch.Tensor, keys: int) -> torch.Tensor:
        """The adjoint of :meth:`_key_windows`: ``[B, H, rows/block, block + width - 1, D]`` added back onto the
        ``keys`` rows ``lo:hi`` they were read from (windows overlap: a key is in up to ``span/block + 1``)."""
        B, H, blocks, span, D = windows.shape
        out = windows.new_zeros(B, H, blocks * self.block + span, D)
        for piece in range(0, span, self.block):  # each window's rows piece .. piece + block, every window at once
            width = min(self.block, span - piece)
            rows = out[:, :, piece:piece + blocks * self.block].view(B, H, blocks, self.block, D)
            rows[:, :, :, :width] += windows[:, :, :, piece:piece + width]
        front = max(0, self.reach - self.start)  # the zero rows _key_windows put before key 0
        return out[:, :, front:front + keys]

    def values(self, probs, v, rel_v):
        """``Σ_t probs[.., i, t] · (v_j + rel_v[d])`` for the band's rows (``probs`` holds only them; ``v`` its keys'
        values ``v[:, :, lo:hi]``) -> ``[B, H, rows, D]``."""
        rows = self.stop - self.start
        out = (self._spread(probs) @ self._key_windows(v).transpose(-1, -2)).flatten(2, 3)[:, :, :rows]
        if rel_v is not None:
            out = out + probs @ rel_v[self.slots]
        return out

    def gradients(self, q, k, v, rel_k, rel_v, bias, scale, grad_out, lse, delta):
        """The band's part of every gradient, its rows' ``q``, ``grad_out``, ``lse`` (the merged one) and
        ``delta = rowsum(dO ⊙ O)``, its keys' ``k``, ``v`` (``key_range``): with ``P = exp(s - lse)`` and
        ``dS = P ⊙ (dO·(v_j + rel_v[d]) - delta)`` (FlashAttention's softmax gradient), ``dq = scale·Σ_t dS (k_j +
        rel_k[d])``, ``dk_j``, ``dv_j`` summed over the rows that reach key ``j``, the tables' over their band slots
        -> ``(dq, dk, dv, drel_k, drel_v, dbias)`` (None for an absent table)."""
        rows = self.stop - self.start
        probs = torch.exp(self.scores(q, k, rel_k, bias, scale) - lse[..., None])  # 0 where the band is masked
        keys, values, grads = self._key_windows(k), self._key_windows(v), self._blocks(grad_out)
        dprobs = _diagonals(grads @ values, self.width).flatten(2, 3)[:, :, :rows]
        if rel_v is not None:
            dprobs = dprobs + grad_out @ rel_v[self.slots].transpose(0, 1)
        dscores = probs * (dprobs - delta[..., None])  # of the logits, bias included; of q·k, times scale
        dbias = None if bias is None else dscores.sum((0, 2))
        dscores = dscores * scale
        spread = self._spread(dscores)
        dq = (spread @ keys.transpose(-1, -2)).flatten(2, 3)[:, :, :rows]
        drel_k = drel_v = None
        if rel_k is not None:
            dq = dq + dscores @ rel_k[self.slots]
            drel_k = torch.einsum("bhit,bhid->td", dscores, q)
        if rel_v is not None:
            drel_v = torch.einsum("bhit,bhid->td", probs, grad_out)
        dk = self._fold(spread.transpose(-1, -2) @ self._blocks(q), k.shape[2])
        dv = self._fold(self._spread(probs).transpose(-1, -2) @ grads, v.shape[2])
        return dq, dk, dv, drel_k, drel_v, dbias


def _row_chunks(n: int, rows: int):
    """The passes ``(start, stop)`` of ``rows`` query rows each over ``n`` rows."""
    return [(start, min(start + rows, n)) for start in range(0, n, rows)]


def _without_autocast(backward):
    """``backward(ctx, saved, grad_out)`` with autocast off: its matmuls run in the working dtype it casts to."""

    @functools.wraps(backward)
    def wrapper(ctx, saved, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return backward(ctx, saved, grad_out)

    return wrapper


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
    and probability mass. The band's is that softmax gradient too, recomputed a pass of rows at a time
    (:meth:`_Band.gradients`; written out, where autograd over the recomputed band paid for its copies, fills
    and the windows' unfold).

    ``keys`` (bool ``[B|1, H|1, n]`` or None) masks keys (padding): in the band through the band's
    mask, in the far parts as a ``[B|1, H|1, 1, n]`` mask the fused kernel broadcasts over rows. A
    row with no key left in a part has that part's log-sum-exp at ``-inf`` (the kernel reports 0);
    a row with no key at all gives zeros.
    """

    @staticmethod
    @flushing_denormals
    def forward(ctx, q, k, v, rel_k, rel_v, bias, keys, reach, causal, scale, block, pass_rows):
        with torch.autocast(q.device.type, enabled=False):  # the band in float32 whatever autocast asks
            return _BandedAttention._forward(
                ctx, q, k, v, rel_k, rel_v, bias, keys, reach, causal, scale, block, pass_rows
            )

    @staticmethod
    def _forward(ctx, q, k, v, rel_k, rel_v, bias, keys, reach, causal, scale, block, pass_rows):
        work = torch.promote_types(q.dtype, torch.float32)
        cast = lambda t: None if t is None else t.to(work)  # noqa: E731
        n = q.shape[2]
        qw, kw, vw, rel_kw, rel_vw, biasw = q.to(work), k.to(work), v.to(work), cast(rel_k), cast(rel_v), cast(bias)
        out, lse = q.new_empty(*q.shape[:3], v.shape[-1], dtype=work), q.new_empty(q.shape[:3], dtype=work)
        for start, stop in _row_chunks(n, pass_rows):
            band = _Band(n, reach, causal, block, q.device, keys, (start, stop))
            lo, hi = band.key_range
            s = band.scores(qw[:, :, start:stop], kw[:, :, lo:hi], rel_kw, biasw, scale)
            rows_lse = torch.logsumexp(s, dim=-1)  # -inf only for a row whose band keys are all masked
            out[:, :, start:stop] = band.values(torch.exp(s - _finite(rows_lse)[..., None]), vw[:, :, lo:hi], rel_vw)
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
        ctx.reach, ctx.causal, ctx.scale, ctx.block, ctx.pass_rows = reach, causal, scale, block, pass_rows
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
    @flushing_backward
    @_without_autocast
    def backward(ctx, saved, grad_out):
        q, k, v, rel_k, rel_v, bias, keys, out, lse, *parts = saved
        reach, causal, scale = ctx.reach, ctx.causal, ctx.scale
        work = torch.promote_types(q.dtype, torch.float32)
        grad_out = grad_out.contiguous()
        g = grad_out.to(work)
        delta = (g * out.to(work)).sum(-1)
        # The band, recomputed against the merged log-sum-exp (_Band.gradients), a pass of rows at a time
        n = q.shape[2]
        qw, kw, vw = q.detach().to(work), k.detach().to(work), v.detach().to(work)
        tables = [None if t is None else t.detach().to(work) for t in (rel_k, rel_v, bias)]
        dq, dk, dv = torch.zeros_like(qw), torch.zeros_like(kw), torch.zeros_like(vw)
        table_sums = [None if t is None else torch.zeros_like(t) for t in tables]
        for start, stop in _row_chunks(n, ctx.pass_rows):
            rows = slice(start, stop)
            band = _Band(n, reach, causal, ctx.block, q.device, keys, (start, stop))
            lo, hi = band.key_range
            gq, gk, gv, *gtables = band.gradients(qw[:, :, rows], kw[:, :, lo:hi], vw[:, :, lo:hi], *tables, scale,
                                                  g[:, :, rows], lse[:, :, rows], delta[:, :, rows])
            dq[:, :, rows] += gq
            dk[:, :, lo:hi] += gk
            dv[:, :, lo:hi] += gv
            for total, part, dim in zip(table_sums, gtables, (0, 0, 1)):  # rel_k, rel_v: [d, D]; bias: [H, d]
                if total is not None:
                    total.narrow(dim, band.slots.start, band.width).add_(part)
        drel_k, drel_v, dbias = table_sums
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
        return (*grads, None, None, None, None, None, None)


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
        not _exporting()
        # a traced training step takes the exact dense path: the band's backward called torch.autograd.grad, which
        # Dynamo does not trace; written out since (_Band.gradients), it traced in a first check, untested as yet
        and not (torch.compiler.is_compiling() and torch.is_grad_enabled())
        and q.device.type == "cpu"
        and (attention_mask is None or _key_mask(attention_mask, n) is not None)
        and _is_zero(past_length)
        and dropout_p == 0.0
        and k.shape[2] == n
        and v.shape[-1] == q.shape[-1]  # the fused kernel needs one head size
        and q.numel() > 0
        and n >= max(min_length, reach + 2)  # each far part has a row
    )


def banded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, reach: int, scale: float,
    rel_k: Optional[torch.Tensor] = None, rel_v: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None, is_causal: bool = False, block: int = BAND_BLOCK,
    rows: int = BAND_ROWS,
) -> torch.Tensor:
    """Self-attention whose position terms are per clipped distance ``d = clamp(j - i, -(reach+1), reach+1)``
    (:class:`_BandedAttention`) -> ``[B, H, n, D]``.

    ``rel_k``, ``rel_v``: ``[2·reach+3, D]`` per-distance key and value vectors (Shaw), ``bias``: ``[H, 2·reach+3]``
    per-distance logits, each optional. ``attention_mask``: None or a bool key mask ``[B|1, H|1, 1, n]``.
    ``block`` query rows per block of the band, ``rows`` per pass over it (a multiple of ``block``).
    """
    q, k, v = _unit_stride(q, k, v)
    keys = _key_mask(attention_mask, q.shape[2])
    return _BandedAttention.apply(q, k, v, rel_k, rel_v, bias, keys, reach, is_causal, scale, block, rows)


def shaw_banded_applies(
    q, k, v, max_relative_position: int, attention_mask=None, past_length=0, dropout_p: float = 0.0, *,
    min_length: int = SHAW_BAND_MIN_LENGTH,
) -> bool:
    """True where :func:`shaw_banded` computes ``functional.shaw_attention`` (self-attention, ``n >= min_length``)."""
    return max_relative_position >= 1 and _banded_applies(
        q, k, v, max_relative_position - 1, attention_mask, past_length, dropout_p, min_length
    )


def shaw_banded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_k: torch.Tensor, rel_v: Optional[torch.Tensor], *,
    max_relative_position: int, attention_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
    block: int = BAND_BLOCK, rows: int = BAND_ROWS,
) -> torch.Tensor:
    """Shaw et al.'s attention (``functional.shaw_attention``, ``past_length = 0``) by the band decomposition:
    far-left and far-right keys in the fused kernel, the band ``|j - i| < k`` explicit -> ``[B, H, n, D]``.

    Reference: ``functional.shaw_attention``; oracles ``shaw_ref``, ``shaw_torch_ref``.
    """
    return banded_attention(
        q, k, v, reach=max_relative_position - 1, scale=1.0 / math.sqrt(q.shape[-1]), rel_k=rel_k, rel_v=rel_v,
        attention_mask=attention_mask, is_causal=is_causal, block=block, rows=rows,
    )


def saturating_bias_banded_applies(
    q, k, v, bias, attention_mask=None, is_causal: bool = False, *, min_length: Optional[int] = None
) -> bool:
    """True where :func:`saturating_bias_banded` computes ``functional.saturating_bias_attention``; ``min_length``
    None means :data:`CAUSAL_BIAS_BAND_MIN_LENGTH` or :data:`BIAS_BAND_MIN_LENGTH`."""
    if min_length is None:
        min_length = CAUSAL_BIAS_BAND_MIN_LENGTH if is_causal else BIAS_BAND_MIN_LENGTH
    reach = bias.shape[1] // 2 - 1
    # The band pays only where it is a small part of each row (T5's: 181 of 2,048); a bias that never saturates
    # (bidirectional ALiBi's, s = n - 1) would make it the whole row.
    return 4 * (reach + 1) <= q.shape[2] and _banded_applies(q, k, v, reach, attention_mask, 0, 0.0, min_length)


def saturating_bias_banded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, *,
    attention_mask: Optional[torch.Tensor] = None, is_causal: bool = False, scale: Optional[float] = None,
    block: int = BAND_BLOCK, rows: int = BAND_ROWS,
) -> torch.Tensor:
    """``softmax(q k^T · scale + bias[h, clamp(j - i, -s, s) + s] + mask) v`` by the band decomposition
    -> ``[B, H, n, D]``; ``bias``: ``[H, 2s+1]``. Reference: ``functional.saturating_bias_attention``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return banded_attention(
        q, k, v, reach=bias.shape[1] // 2 - 1, scale=scale, bias=bias, attention_mask=attention_mask,
        is_causal=is_causal, block=block, rows=rows,
    )


# ----------------------------------------------------------------------------------
# Transformer-XL in chunks of query rows
# ----------------------------------------------------------------------------------


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


def txl_chunked_applies() -> bool:
    """True where :func:`txl_chunked` may run (it needs ``B·H·Q > 0``, no dropout, no weights: the caller checks)."""
    return not _exporting()


def txl_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor, u: torch.Tensor, w: torch.Tensor, *,
    attention_mask: Optional[torch.Tensor] = None, is_causal: bool = True, chunk: int = TXL_CHUNK,
) -> torch.Tensor:
    """Transformer-XL attention (``functional.transformer_xl_attention`` without dropout or weights) ``chunk``
    query rows at a time (:class:`_TransformerXLAttention`) -> ``[B, H, Q, D]``; needs ``B·H·Q > 0``.

    Reference: ``functional.transformer_xl_attention``; oracles ``txl_ref``, ``txl_torch_ref``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    user_mask = _additive_mask(attention_mask, None)
    q, k, v = _unit_stride(q, k, v)
    return _TransformerXLAttention.apply(q, k, v, r, u, w, user_mask, is_causal, scale, chunk)


# ----------------------------------------------------------------------------------
# Causal attention with a bias per key (causal ALiBi)
# ----------------------------------------------------------------------------------


class _CausalKeyBiasAttention(torch.autograd.Function):
    """Causal attention with a per-key bias in the fused CPU kernel, a chunk of query rows at a time.

    Rows ``a .. b-1`` meet the keys before ``a`` (all visible) and their own square block (causal) in
    two kernel calls merged by log-sum-exp. ``key_bias`` is ``[B|1, H, n]`` (ALiBi's is the same for every
    row of the batch; FoX's depends on the tokens). Each chunk measures the bias from its middle row ``r``,
    ``key_bias[j] - key_bias[r]`` (formed in the key bias's own precision, float64 from the models), and
    the kernel adds it as a mask in float32 at least (bf16/fp16 inputs too: the kernel takes a float mask
    beside them): a key that matters to row ``i`` (one not decayed away) carries about
    ``|key_bias[i] - key_bias[r]|``, so the logits round at float32's ``eps`` times half the chunk's spread
    of the bias. A chunk ends after ``chunk`` rows, or earlier (``span``) where the bias spreads by
    more than ``span`` over it (a strongly forgetting FoX gate), which bounds that error by about
    ``eps · span / 2`` whatever the gate; a key far in the past carries a larger error only in proportion
    to its decayed weight (``x · e^-x <= 1/e``). The backward runs the kernel's backward for each part with
    the merged output and log-sum-exp; the bias's gradient ``Σ_i dS_ij`` comes from the same backward with
    one more channel: ``q' = [q, 1]``, ``k' = [k, 0]``, ``v' = [v, 0]`` leave the scores as they are, and the
    key gradient's last channel is ``scale · Σ_i dS_ij · 1``. ``keys`` (bool ``[B|1, H|1, n]``) masks keys; a
    row with no key left gives zeros.
    """

    @staticmethod
    def _chunks(key_bias, n, chunk, span):
        """The ``(start, stop)`` row ranges: ``chunk`` rows each, fewer where the bias spreads by more than ``span``."""
        if span is None:
            return [(start, min(start + chunk, n)) for start in range(0, n, chunk)]
        bounds, start = [], 0
        while start < n:
            window = key_bias[..., start : start + chunk]
            spread = (window - window[..., :1]).abs().amax(dim=(0, 1))  # [rows]: from the chunk's first row
            over = torch.nonzero(spread > span)
            stop = start + (int(over[0, 0]) if over.numel() else window.shape[-1])
            bounds.append((start, max(stop, start + 1)))
            start = bounds[-1][1]
        return bounds

    @staticmethod
    def _parts(q, key_bias, keys, start, stop):
        """The chunk's (keys slice, causal, additive mask, alive rows or None) for the prefix and its own block."""
        ref = (start + stop - 1) // 2  # the chunk's middle row: its rows' own keys carry at most half its spread
        # float32 at least: bf16 would round ALiBi's m·1024 to steps of 4
        rel = (key_bias[..., :stop] - key_bias[..., ref : ref + 1]).to(torch.promote_types(q.dtype, torch.float32))
        mask = rel[:, :, None, :]  # [B|1, H, 1, stop]
        if keys is not None:  # -inf (not finfo.min): the kernel then gives a row with no key zeros
            mask = mask.masked_fill(~keys[..., None, :stop], float("-inf"))
            seen = keys[..., :stop].cumsum(-1)
        parts = [(slice(start, stop), True, mask[..., start:stop],
                  None if keys is None else (seen[..., start:stop] - seen[..., start - 1 : start] if start else
                                             seen[..., start:stop]) > 0)]
        if start:
            alive = None if keys is None else (seen[..., start - 1 : start] > 0).expand(*seen.shape[:-1], stop - start)
            parts.append((slice(0, start), False, mask[..., :start], alive))
        return parts

    @staticmethod
    @flushing_denormals
    def forward(ctx, q, k, v, key_bias, keys, scale, chunk, span):
        work = torch.promote_types(q.dtype, torch.float32)
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=work)
        chunks = _CausalKeyBiasAttention._chunks(key_bias.detach(), q.shape[2], chunk, span)
        for start, stop in chunks:
            acc = acc_lse = None
            for cols, causal, mask, alive in _CausalKeyBiasAttention._parts(q, key_bias.detach(), keys, start, stop):
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
        ctx.scale, ctx.chunks = scale, chunks
        return out

    @staticmethod
    @once_differentiable
    @flushing_backward
    def backward(ctx, saved, grad_out):
        q, k, v, key_bias, keys, out, lse = saved
        grad_bias = ctx.needs_input_grad[3]
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        B, H, n, D = q.shape
        drel = q.new_zeros(B, H, n, dtype=torch.promote_types(q.dtype, key_bias.dtype)) if grad_bias else None
        if grad_bias:  # one more channel that adds nothing to the scores: q' = [q, 1], k' = [k, 0], v' = [v, 0]
            pad = lambda t, value: F.pad(t, (0, 1), value=value)  # noqa: E731
            q, k, v, out, grad_out = pad(q, 1.0), pad(k, 0.0), pad(v, 0.0), pad(out, 0.0), pad(grad_out, 0.0)
        for start, stop in ctx.chunks:
            rows = slice(start, stop)
            for cols, causal, mask, _ in _CausalKeyBiasAttention._parts(q, key_bias, keys, start, stop):
                kc, vc = k[:, :, cols], v[:, :, cols]
                gq, gk, gv = _flash_cpu_backward(
                    grad_out[:, :, rows], q[:, :, rows], kc, vc, out[:, :, rows].contiguous(),
                    lse[:, :, rows].contiguous(), 0.0, causal, attn_mask=mask, scale=ctx.scale,
                )
                dq[:, :, rows] += gq[..., :D]
                dk[:, :, cols] += gk[..., :D]
                dv[:, :, cols] += gv[..., : dv.shape[-1]]
                if grad_bias:
                    # rel_j = key_bias[j] - key_bias[ref]: the second term's share (zero up to rounding, as
                    # each row's dS sums to zero) is kept so that the gradient is that of what was computed.
                    g = gk[..., D] / ctx.scale
                    drel[:, :, cols] += g
                    drel[:, :, (start + stop - 1) // 2] -= g.sum(-1)
        dbias = None
        if grad_bias:
            dbias = drel.sum_to_size(key_bias.shape).to(key_bias.dtype)
        return dq, dk, dv, dbias, None, None, None, None


def causal_key_bias_applies(q, k, v, key_bias, attention_mask=None) -> bool:
    """True where :func:`causal_key_bias` computes ``functional.causal_key_bias_attention``: CPU, a floating
    dtype, no mask or a key mask, one head size."""
    B, H, n, D = q.shape
    return (
        not _exporting()
        and q.device.type == "cpu" and q.is_floating_point() and n > 0 and B * H > 0
        and v.shape[-1] == D  # the fused kernel needs one head size
        and (attention_mask is None or _key_mask(attention_mask, n) is not None)
    )


def causal_key_bias(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor, *,
    attention_mask: Optional[torch.Tensor] = None, scale: Optional[float] = None, chunk: int = KEY_BIAS_CHUNK,
    span: Optional[float] = None,
) -> torch.Tensor:
    """``softmax_{j <= i}(q_i·k_j · scale + key_bias[b, h, j] + mask) v`` -> ``[B, H, n, D]`` in the fused kernel,
    ``chunk`` query rows per call, fewer where ``key_bias`` (``[H, n]`` or ``[B|1, H, n]``, differentiable)
    spreads by more than ``span`` over them (:class:`_CausalKeyBiasAttention`); the logits round at about
    ``eps`` times the bias's spread over a chunk. In half precision a bias that wants its gradient runs the kernel
    in float32: that gradient is the kernel's ``Σ_i dS_ij`` per key, whose half-precision rounding no longer sums
    to zero over the keys, and FoX's cumsum adds the errors up (20-40x the merged bias's in its gate's gradient).
    Reference: ``functional.causal_key_bias_attention``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    keys = _key_mask(attention_mask, q.shape[2])
    q, k, v = _unit_stride(q, k, v)
    if key_bias.dim() == 2:
        key_bias = key_bias[None]
    if q.dtype in (torch.float32, torch.float64) or not (key_bias.requires_grad and torch.is_grad_enabled()):
        return _CausalKeyBiasAttention.apply(q, k, v, key_bias, keys, scale, chunk, span)
    work = (t.float() for t in (q, k, v))
    return _CausalKeyBiasAttention.apply(*work, key_bias, keys, scale, chunk, span).to(q.dtype)


# ----------------------------------------------------------------------------------
# FIRE's MLP over blocks of query rows
# ----------------------------------------------------------------------------------


def _fire_mlp(x, w1, b1, w2, b2):
    return F.linear(F.relu(F.linear(x[..., None], w1, b1)), w2, b2)


def fire_mlp_applies() -> bool:
    """True where :func:`fire_mlp`'s blocks may run (their loop over query rows would fix an exported length)."""
    return not _exporting()


def fire_mlp(
    x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, *,
    elements: int = FIRE_ELEMENTS,
) -> torch.Tensor:
    """FIRE's ``f(x) = w2·relu(w1·x + b1) + b2`` for each entry of ``x`` ``[B|1, Q, K]`` -> ``[B|1, Q, K, H]``.

    Blocks of query rows whose ``[rows, K, width]`` hidden layer holds about ``elements`` numbers, each
    recomputed in backward (checkpointed) when a gradient is needed. Reference: ``functional.fire_bias``.
    """
    key_length, width, heads = x.shape[-1], w1.shape[0], w2.shape[0]
    rows = max(1, elements // max(1, key_length * width))
    checkpoint = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, b1, w2, b2))
    blocks = []
    for start in range(0, x.shape[1], rows):
        part = x[:, start : start + rows]
        if checkpoint:  # keep only x for backward, not the hidden layer
            blocks.append(torch.utils.checkpoint.checkpoint(_fire_mlp, part, w1, b1, w2, b2, use_reentrant=False))
        else:
            blocks.append(_fire_mlp(part, w1, b1, w2, b2))
    return torch.cat(blocks, dim=1) if blocks else x.new_zeros(x.shape[0], 0, key_length, heads)
