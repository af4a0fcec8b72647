"""Attention with a learned additive bias on CPU: SDPA's fused kernel forward, a backward in chunks of query rows.

Two entry points, re-exported by ``kernels_relpos.py`` (the fast paths' one entry, whose table lists them):
:func:`fused_bias_attention` for a dense bias ``[B|1, H|1, Q, K]`` and :func:`distance_bias_attention` for a bias of
the clipped distance ``[H, 2s+1]`` (T5's), which reads the bias as a view of its ``2n - 1`` distances and folds its
gradient per distance: no ``[H, n, n]`` bias is kept, and no ``[H, n, n]`` gradient is made. Both share
:func:`_bias_attention_backward`. Checked against the float64 oracles in ``tests/test_attention_with_bias.py`` and
``tests/test_bias_band.py``.

Flat module (remote code copies it beside ``modeling_relpos.py``): relative imports only, no Transformers.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.nn.functional as F

from .attention_utils_relpos import _exporting
from .denormals_relpos import flushing_backward, flushing_denormals

FUSED_BIAS_CHUNK = 256  # query rows per chunk of the backward
# From this length, rows padded to different lengths take one call per length (read_by_runs); below it the calls'
# own cost is more than the merged mask's (measured: scripts/bench_runs.py)
RUNS_MIN_LENGTH = 512


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


def _exp_is_exact(lse: torch.Tensor) -> bool:
    """``exp(S - lse)`` is exact only while ``lse`` keeps the precision of ``log K``: a row whose every key sits at a
    huge negative value (finfo.min masks, -1e9 biases) rounds it away. Traced (torch.compile), the test cannot read
    the host: False, so that the caller takes the form exact for every row."""
    return not torch.compiler.is_compiling() and bool(lse.abs().amax() * torch.finfo(lse.dtype).eps < 2.0**-10)


def _bias_attention_backward(q, k, v, bias, out, lse, grad_out, scale, chunk, take_dscores):
    """``(dq, dk, dv)`` of ``softmax(q k^T · scale + bias) v`` in the working dtype, ``chunk`` query rows at a time.

    The probabilities ``P = exp(S - lse)`` are recomputed from the fused kernel's log-sum-exp and the softmax gradient
    is ``dS = P ⊙ (dO V^T - rowsum(dO ⊙ O))`` (as FlashAttention's backward). ``take_dscores(dS, start)``, if given,
    receives each chunk's ``dS`` ``[B, H, rows, K]``: the bias gradient is what it makes of them.
    """
    work = torch.promote_types(q.dtype, torch.float32)
    qs, gf = (q.to(work) * scale), grad_out.to(work)
    kf, vf = k.to(work), v.to(work)
    # Transposed once here, not by every chunk's matmul (which copies a transposed operand on CPU).
    kt, vt = kf.transpose(-1, -2).contiguous(), vf.transpose(-1, -2).contiguous()
    delta = (gf * out.to(work)).sum(-1, keepdim=True)
    lse = lse.to(work).unsqueeze(-1)
    # Rows whose lse lost that precision, and a backward that must itself be differentiable (create_graph), take a
    # full softmax instead.
    exact = not torch.is_grad_enabled() and _exp_is_exact(lse)
    dq, dk, dv = torch.empty_like(qs), torch.zeros_like(kf), torch.zeros_like(vf)
    for start in range(0, q.shape[2], chunk):
        rows = slice(start, start + chunk)
        # P = exp(s - lse) with the forward kernel's log-sum-exp: whole rows need no max or sum pass.
        # A row with every key at -inf has scores -inf (and lse 0 from the kernel): P = 0, as its output.
        scores = (qs[:, :, rows] @ kt).add_(bias[:, :, rows].to(work))
        if exact:
            probs = scores.sub_(lse[:, :, rows]).exp_()
        else:  # out of place: create_graph may need it; a row with no key left gives zeros, and finite derivatives
            dead = torch.isneginf(scores).all(-1, keepdim=True)
            probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
        del scores
        g = gf[:, :, rows]
        dv += probs.transpose(-1, -2) @ g
        dscores = g @ vt
        dscores.sub_(delta[:, :, rows]).mul_(probs)  # the softmax gradient dS = P ⊙ (dP - rowsum(dO ⊙ O))
        del probs
        dq[:, :, rows] = dscores @ kf
        dk += dscores.transpose(-1, -2) @ qs[:, :, rows]
        if take_dscores is not None:
            take_dscores(dscores, start)
    return dq * scale, dk, dv


class _AttentionWithBias(torch.autograd.Function):
    """``softmax(q k^T · scale + bias) v`` whose backward also returns the bias gradient.

    PyTorch's CPU SDPA leaves its fused kernel for the math path (which keeps the whole
    ``[B, H, Q, K]`` probability tensor for backward) as soon as the mask needs a gradient. Here the
    forward runs the fused kernel with the bias as a constant and keeps only its output; the
    backward recomputes the probabilities a chunk of query rows at a time (:func:`_bias_attention_backward`).
    """

    @staticmethod
    @flushing_denormals
    def forward(ctx, q, k, v, bias, scale, chunk_size):
        out, lse = _flash_cpu(q, k, v, 0.0, False, attn_mask=bias.detach(), scale=scale)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        return out

    @staticmethod
    @flushing_backward
    def backward(ctx, saved, grad_out):
        q, k, v, bias, out, lse = saved
        work = torch.promote_types(q.dtype, torch.float32)
        dbias = torch.empty(bias.shape, dtype=work, device=bias.device) if ctx.needs_input_grad[3] else None

        def take(dscores, start):
            for dim in (0, 1):  # a bias broadcast over batch or heads gets the summed gradient
                if bias.shape[dim] == 1 and dscores.shape[dim] != 1:
                    dscores = dscores.sum(dim, keepdim=True)
            dbias[:, :, start:start + dscores.shape[2]] = dscores

        dq, dk, dv = _bias_attention_backward(q, k, v, bias, out, lse, grad_out, ctx.scale, ctx.chunk_size,
                                              take if dbias is not None else None)
        cast = lambda t, like: None if t is None else t.to(like.dtype)  # noqa: E731
        return cast(dq, q), cast(dk, k), cast(dv, v), cast(dbias, bias), None, None


def fused_bias_applies(q: torch.Tensor) -> bool:
    """The fused forward with a chunked backward pays on CPU when a gradient is wanted (else plain SDPA)."""
    return not _exporting() and q.device.type == "cpu" and torch.is_grad_enabled()


def fused_bias_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, *,
    chunk_size: int = FUSED_BIAS_CHUNK,
) -> torch.Tensor:
    """``softmax(q k^T · scale + bias) v`` -> ``[B, H, Q, D]`` (:class:`_AttentionWithBias`), CPU only.

    ``bias``: additive ``[B|1, H|1, Q, K]``, differentiable. The backward recomputes the probabilities
    ``chunk_size`` query rows at a time. Reference: ``functional.attention_with_bias``.
    """
    q, k, v = _unit_stride(q, k, v)
    return _AttentionWithBias.apply(q, k, v, bias.to(q.dtype).contiguous(), scale, chunk_size)


def _distance_entries(n: int, reach: int, device) -> torch.Tensor:
    """The table entry of each distance ``j - i = m - (n - 1)``, ``m`` in ``[0, 2n - 1)``: ``clamp(j - i) + reach``."""
    return torch.arange(-(n - 1), n, device=device).clamp_(-reach, reach).add_(reach)


def _reversed_rows(table: torch.Tensor, n: int) -> torch.Tensor:
    """The bias of ``table`` ``[H, 2s+1]`` with its query rows reversed, ``[1, H, n, n]``, as a view of ``[H, 2n-1]``.

    Row ``r`` (query ``i = n-1-r``) is the window ``ext[r : r+n]`` of the bias of every distance ``ext`` (``ext[m]``:
    distance ``m - (n-1)``, so key ``j`` reads distance ``r + j - (n-1) = j - i``): rows one element apart, no copy.
    """
    ext = table[:, _distance_entries(n, table.shape[1] // 2, table.device)]
    return ext.unfold(-1, n, 1).unsqueeze(0)


def toeplitz_bias(table: torch.Tensor, n: int) -> torch.Tensor:
    """``[H, 2s+1] -> [1, H, n, n]``: ``out[0, h, i, j] = table[h, clamp(j - i, -s, s) + s]``.

    :func:`_reversed_rows` put back in order: one copy. Gathering ``n²`` indices costs about 4x as much on CPU.
    """
    if n == 0:
        return table.new_zeros(1, table.shape[0], 0, 0)
    return _reversed_rows(table, n).flip(-2)


def _fold_antidiagonals(dscores: torch.Tensor, sums: torch.Tensor, start: int, rows: int = 32) -> None:
    """Add each anti-diagonal of ``dscores`` (``[B, H, c, n]``, rows ``start..``) to ``sums`` ``[H, 2n-1]``:
    ``sums[:, m] += Σ dscores[b, :, r, j]`` over ``start + r + j = m``.

    ``rows`` at a time, summed over the batch: padding each row on the right by ``c`` and reading the result back
    with rows one shorter puts ``(r, j)`` in column ``r + j`` (Transformer-XL's skew), so a sum over the rows gives
    the anti-diagonals; the small blocks stay in cache (the whole ``[H, n, 2n]`` skew costs 5x as much here).
    """
    n = dscores.shape[-1]
    for first in range(0, dscores.shape[2], rows):
        block = dscores[:, :, first:first + rows].sum(0)  # [H, c, n]
        heads, c = block.shape[:2]
        skewed = F.pad(block, (0, c)).flatten(-2)[:, : c * (n + c - 1)].view(heads, c, n + c - 1)
        sums[:, start + first:start + first + n + c - 1] += skewed.sum(1)


def far_sums_apply(table: torch.Tensor, mask: Optional[torch.Tensor], lse: torch.Tensor) -> bool:
    """:func:`table_gradient` applies: no mask, a table that saturates within a quarter of the row, and a log-sum-exp
    that keeps the precision ``exp(S - lse)`` needs (:func:`_exp_is_exact`)."""
    return mask is None and 4 * (table.shape[1] // 2) <= lse.shape[-1] and _exp_is_exact(lse)


def table_gradient(q, k, v, table, out, lse, grad_out, scale, chunk: int = 128, first: int = 0) -> torch.Tensor:
    """The gradient of a saturating table ``[H, 2s+1]`` (``B[h, i, j] = table[h, clamp(j - i, -s, s) + s]``, no
    mask): ``Σ dS`` over each distance class, ``dS = P ⊙ (dO V^T - δ)``, ``δ_i = dO_i · O_i``, without the whole
    ``dS``. Its rows sum to zero (``Σ_j P_ij dO_i·v_j = dO_i·O_i``), so a row's two far sides add up to minus its
    band ``|j - i| < s``. The band is computed ``chunk`` rows at a time, read from each window of scores as a skewed
    view (row ``r``'s band starts ``r`` columns in); of the far sides, where the bias is a constant ``b``
    (``table[:, 0]`` left, ``table[:, -1]`` right), each row computes its smaller one, the top half's left
    ``j <= i - s`` and the bottom half's right ``j >= i + s``, each from one causal call of the fused kernel over
    shifted keys (the right's rows and keys reversed): ``Σ_{j<=i-s} dS_ij = e^{lse'_i + b - lse_i} (dO_i · O'_i -
    δ_i)`` (``O'``, ``lse'``: that call's); its other side is what is left, exact to rounding against the row's other
    terms (so either far entry, where its true gradient is far below the others', gets their float32 rounding, about
    1e-6 of the largest: 1e-3 of its own for an entry 1e-3 of the largest). Two triangles of half the side cost
    about half the one triangle of the whole left side (measured: 10 against 18 ms at n = 1,024). ``lse``: of the
    rows in order. ``k``, ``v``: the keys at positions ``first ..`` (a padded row's run of keys, every other key
    masked). Reference: the float64 oracle in ``tests/test_distance_bias.py``.
    """
    work = torch.promote_types(q.dtype, torch.float32)
    B, H, n, _ = q.shape
    s, stop = table.shape[1] // 2, first + k.shape[2]
    qs, gf = (q.to(work) * scale), grad_out.to(work)
    # Transposed once, at their positions among s - 1 zero keys before position 0 and after n - 1: every row's band
    # is then a full window.
    kt, vt = (F.pad(t.to(work).transpose(-1, -2), (s - 1 + first, s - 1 + n - stop)) for t in (k, v))
    delta = (gf * out.to(work)).sum(-1)  # [B, H, n]
    lse = lse.to(work)
    # The bias as the forward added it: rounded to the inputs' dtype (a bf16 model under autocast, a float32 table).
    bias = table.detach().to(q.dtype).to(work)
    inner = bias[:, 1:-1, None].transpose(1, 2)  # [H, 1, 2s-1]: distances -(s-1) .. s-1
    band = torch.zeros(H, 2 * s - 1, dtype=work, device=q.device)
    # Rows i < half have no more keys on the left than on the right: they compute their far left, the others their
    # far right; lower sums the band of the rows from half on (their far left is minus it, less their far right).
    half = min((first + stop + 1) // 2, n)
    lower = torch.zeros(H, dtype=work, device=q.device)
    offsets = torch.arange(2 * s - 1, device=q.device) - (s - 1)
    for a in range(0, n, chunk):
        c = min(chunk, n - a)
        width = c + 2 * s - 2  # keys a - (s-1) .. a + c - 1 + (s-1), padded: row r's band starts at column r

        def band_of(window):  # [B, H, c, width] -> its band [B, H, c, 2s-1], a view: row r, columns r .. r + 2s-2
            return window.as_strided((B, H, c, 2 * s - 1), (H * c * width, c * width, width + 1, 1))

        probs = (band_of(qs[:, :, a:a + c] @ kt[..., a:a + width]) + inner).sub_(lse[:, :, a:a + c, None]).exp_()
        if a - (s - 1) < first or a + c + s - 2 >= stop:  # the zero keys take no share
            key = torch.arange(a, a + c, device=q.device)[:, None] + offsets
            probs.masked_fill_((key < first) | (key >= stop), 0.0)
        dscores = (band_of(gf[:, :, a:a + c] @ vt[..., a:a + width]) - delta[:, :, a:a + c, None]).mul_(probs)
        band += dscores.sum((0, 2))
        if a + c > half:
            lower += dscores[:, :, max(half - a, 0):].sum((0, 2, 3))

    def far_side(low, high, keys, constant, reverse):  # Σ dS over rows low .. high - 1's far keys, one causal call
        inputs = (q[:, :, low:high], k[:, :, keys], v[:, :, keys])
        far_out, far_lse = _flash_cpu(*(t.flip(2) for t in inputs) if reverse else inputs, 0.0, True, scale=scale)
        if reverse:
            far_out, far_lse = far_out.flip(2), far_lse.flip(-1)
        share = torch.exp(far_lse.to(work) + constant[:, None] - lse[:, :, low:high])
        return (share * ((gf[:, :, low:high] * far_out.to(work)).sum(-1) - delta[:, :, low:high])).sum((0, 2))

    left = -lower
    top = first + s  # rows top + r (up to half) see keys first .. first + r, the run's first r + 1
    if top < half:
        left += far_side(top, half, slice(0, half - top), bias[:, 0], reverse=False)
    bottom = stop - s  # rows bottom - 1 - r (down to half) see keys stop - 1 - r .. stop - 1, the run's last r + 1
    if half < bottom:
        left -= far_side(half, bottom, slice(k.shape[2] - (bottom - half), None), bias[:, -1], reverse=True)
    right = -(band.sum(-1) + left)  # every row's dS sums to zero, so all of them do
    return torch.cat([left[:, None], band, right[:, None]], dim=1)


class _AttentionWithDistanceBias(torch.autograd.Function):
    """``softmax(q k^T · scale + B + mask) v`` with ``B[h, i, j] = table[h, clamp(j - i, -s, s) + s]``.

    :class:`_AttentionWithBias` for a bias of the distance, run with the query rows reversed: there the bias is a
    view of its ``2n - 1`` distances (:func:`_reversed_rows`), which the fused kernel reads in place, so without a
    mask no ``[H, n, n]`` bias is made or kept for the backward; the backward folds each chunk's score gradient
    into the distances it belongs to (:func:`_fold_antidiagonals`) instead of scattering an ``[H, n, n]`` gradient.
    ``k``, ``v`` may hold the keys at positions ``first ..`` alone (a padded row's run): the view's columns there.
    """

    @staticmethod
    def _bias(table, mask, n, first, keys, dtype):
        """The reversed rows' bias in ``dtype`` (keys ``first .. first + keys``); with a mask, merged with it (its rows
        reversed too) in at least float32, as ``functional.saturating_bias_attention`` merges them."""
        rows = _reversed_rows(table if mask is not None else table.to(dtype), n)[..., first:first + keys]
        if mask is None:
            return rows
        return (rows.to(torch.promote_types(rows.dtype, torch.float32)) + mask.flip(-2)).to(dtype)

    @staticmethod
    @flushing_denormals
    def forward(ctx, q, k, v, table, mask, first, scale, chunk_size):
        bias = _AttentionWithDistanceBias._bias(table.detach(), mask, q.shape[2], first, k.shape[2], q.dtype)
        out, lse = _flash_cpu(q.flip(2), k, v, 0.0, False, attn_mask=bias, scale=scale)
        out = out.flip(2)
        ctx.save_for_backward(q, k, v, table, mask, out, lse)  # lse: of the reversed rows
        ctx.first, ctx.scale, ctx.chunk_size = first, scale, chunk_size
        return out

    @staticmethod
    @flushing_backward
    def backward(ctx, saved, grad_out):
        q, k, v, table, mask, out, lse = saved
        n, first = q.shape[2], ctx.first
        fixed = not ctx.needs_input_grad[3]
        if not torch.is_grad_enabled() and (fixed or far_sums_apply(table, mask, lse)):
            # The fused kernel's own backward reads the same view as its forward; a fixed bias (ALiBi's, log-decay's)
            # needs nothing more, a saturating one's gradient comes from its band and far sides (table_gradient).
            bias = _AttentionWithDistanceBias._bias(table, mask, n, first, k.shape[2], q.dtype)
            dq, dk, dv = _flash_cpu_backward(grad_out.flip(2), q.flip(2), k, v, out.flip(2), lse, 0.0, False,
                                             attn_mask=bias, scale=ctx.scale)
            dtable = None if fixed else table_gradient(q, k, v, table, out, lse.flip(2), grad_out, ctx.scale,
                                                       first=first)
            return dq.flip(2), dk, dv, None if fixed else dtable.to(table.dtype), None, None, None, None
        # Made again (a view, or the view plus the mask): nothing [n, n] was kept. Under create_graph, from the
        # table itself, so that it is differentiated too.
        bias = _AttentionWithDistanceBias._bias(table if torch.is_grad_enabled() else table.detach(), mask, n, first,
                                                k.shape[2], q.dtype)
        work = torch.promote_types(q.dtype, torch.float32)
        sums = torch.zeros(table.shape[0], 2 * n - 1, dtype=work, device=q.device) if ctx.needs_input_grad[3] else None
        # reversed row r, key column c: distance entry r + first + c
        take = None if sums is None else (lambda dscores, start: _fold_antidiagonals(dscores, sums, start + first))
        dq, dk, dv = _bias_attention_backward(q.flip(2), k, v, bias, out.flip(2), lse, grad_out.flip(2), ctx.scale,
                                              ctx.chunk_size, take)
        dtable = None
        if sums is not None:
            entries = _distance_entries(n, table.shape[1] // 2, table.device)
            dtable = torch.zeros(table.shape, dtype=work, device=table.device).index_add(1, entries, sums)
        cast = lambda t, like: None if t is None else t.to(like.dtype)  # noqa: E731
        return cast(dq.flip(2), q), cast(dk, k), cast(dv, v), cast(dtable, table), None, None, None, None


def key_runs(mask: Optional[torch.Tensor], batch: int, n: int) -> Optional[list]:
    """The keys an additive padding mask (``-inf`` where masked, broadcast as ``[B|1, 1, 1, n]``) keeps, as one run
    ``(first, stop)`` per batch row; None where the mask does more than mask keys, keeps more than one run in a row
    (padding inside a sequence), or is traced (reading it needs the host); None for no rows or no keys too."""
    if mask is None or torch.compiler.is_compiling() or not batch * n:
        return None
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[0] not in (1, batch):
        return None
    row = mask[:, 0, 0].expand(mask.shape[0], n)
    kept = row == 0
    count = kept.sum(-1)
    first = kept.int().argmax(-1)  # the first key kept (0 where none is)
    position = torch.arange(n, device=row.device)
    run = (position >= first[:, None]) & (position < (first + count)[:, None])
    if not bool(((kept | torch.isneginf(row)) & (kept == run)).all()):
        return None
    runs = [(f, f + c) for f, c in zip(first.tolist(), count.tolist())]
    return runs * batch if len(runs) == 1 else runs


def distance_bias_applies(q: torch.Tensor, v: torch.Tensor) -> bool:
    """The distance path runs on CPU, with or without a gradient, outside an export (its private kernel), where the
    fused kernel runs: one head size for queries and values."""
    return not _exporting() and q.device.type == "cpu" and v.shape[-1] == q.shape[-1]


def distance_bias_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, scale: float, *,
    mask: Optional[torch.Tensor] = None, chunk_size: int = FUSED_BIAS_CHUNK,
) -> torch.Tensor:
    """Self-attention ``softmax(q k^T · scale + B + mask) v``, ``B[h, i, j] = table[h, clamp(j - i, -s, s) + s]``
    (:class:`_AttentionWithDistanceBias`), CPU only; applies where :func:`distance_bias_applies`.

    ``table``: ``[H, 2s+1]``, differentiable; ``mask``: additive, broadcast as ``[B|1, H|1, n, n]``, a constant (it
    gets no gradient: ``functional.saturating_bias_attention`` sends a mask that wants one to the dense path).
    Reference: ``functional.saturating_bias_attention``'s spread bias through ``attention_with_bias``.
    """
    q, k, v = _unit_stride(q, k, v)
    mask = None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    runs = read_by_runs(mask, q.shape[0], q.shape[2])
    if runs is None:
        return _AttentionWithDistanceBias.apply(q, k, v, table, mask, 0, scale, chunk_size)
    return _by_runs(q, k, v, table, runs, scale, chunk_size)


def read_by_runs(mask: Optional[torch.Tensor], batch: int, n: int) -> Optional[list]:
    """The padding's runs (:func:`key_runs`) where :func:`distance_bias_attention` reads the batch run by run: some
    row keeps a key, and every row that does keeps the same run, or there are ``RUNS_MIN_LENGTH`` tokens (below, one
    call per run costs more than the merged mask: ``scripts/bench_runs.py``); None where it takes the merged mask."""
    runs = key_runs(mask, batch, n)
    kept = set() if runs is None else {run for run in runs if run[1] > run[0]}
    return runs if kept and (len(kept) == 1 or n >= RUNS_MIN_LENGTH) else None


def _by_runs(q, k, v, table, runs, scale, chunk_size):
    """Padding that keeps one run of keys per row: the rows that keep the same run (the whole batch, or the full
    rows and each padded length) in one call over those keys alone, with the bias's view over them and no mask, as
    without padding; a row with no key gives zeros (its every score masked) and no gradient. Rows are put in order
    of their runs first (one gather each way), so that each group is a split of the batch: its gradient is one
    concatenation, not a batch-sized zero tensor per group."""
    order = sorted(range(len(runs)), key=runs.__getitem__)
    moved = order != list(range(len(runs)))
    if moved:
        index = torch.tensor(order, device=q.device)
        q, k, v = q[index], k[index], v[index]
    sizes = [len(list(rows)) for _, rows in itertools.groupby(order, key=runs.__getitem__)]
    firsts = itertools.accumulate([0] + sizes)
    parts = []
    for q_g, k_g, v_g, start in zip(q.split(sizes), k.split(sizes), v.split(sizes), firsts):
        first, stop = runs[order[start]]
        if stop == first:
            parts.append(q_g.new_zeros(q_g.shape[:-1] + v_g.shape[-1:]))
        else:
            parts.append(_AttentionWithDistanceBias.apply(q_g, k_g[:, :, first:stop], v_g[:, :, first:stop], table,
                                                          None, first, scale, chunk_size))
    out = torch.cat(parts)
    return out[torch.tensor(order, device=q.device).argsort()] if moved else out
