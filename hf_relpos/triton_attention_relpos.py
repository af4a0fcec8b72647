"""Fused attention with a relative-position term and its gradients, in Triton (``attn_implementation="relpos_triton"``).

A FlashAttention-2-style forward and backward (Dao 2023, Alg. 1 and 2): scores ``s_ij = scale·q_i·k_j + b_ij``
formed tile by tile in float32 and never stored, the softmax taken online, the backward recomputing ``p_ij`` from the
saved log-sum-exp. The position term ``b_ij`` is computed in the kernel from small inputs (``TERMS``), of the
distance ``d = j - (past + i)`` between key ``j`` and query ``i`` (queries follow ``past`` cached keys):

- ``"table"``: ``b = T[h, index[clamp(d, -R, R) + R]]``, a table ``[H, NB]`` read through an integer
  distance-to-index vector ``[2R + 1]`` made by the library's own code (T5's buckets, Raffel et al. 2020 sec. 2.1:
  exact at bucket edges, no logarithm in the kernel); beyond ``R`` the index no longer changes;
- ``"log"``: ``b = -a_h·ln(1 + c_h·|d|)`` (KERPLE's logarithmic kernel, Chi et al. 2022 eq. (9); log-decay with
  ``a = λ, c = 1``), ``[2, H]`` holding ``a`` then ``c``;
- ``"linear"``: ``b = -a_h·|d|`` (ALiBi, Press et al. 2022 sec. 3), ``[2, H]`` holding ``a`` (then unused zeros);
- ``"query_key"``: ``b = u[b, h, i] + u[b, h, Q + j]``, a term per query and one per key, each as a float32 high and
  low part ``[B, H, 2, Q + K]`` (FoX's ``c_i - c_j``, Lin et al. 2025 eq. (4); ``fox_query_key_bias``);
- ``None``: nothing beyond the mask.

The mask comes from per-token vectors: causality (``j <= past + i``), a key-validity vector ``[B, K]`` (padding on
either side) and a document id per key ``[B, K]`` (packed documents: a query sees the keys of its own document,
whose distances restart with it, since documents are contiguous). A query with no key left gives zeros.

Gradients, deterministic by default (no floating-point atomics; every sum in a fixed order): ``dk, dv`` and each
key's term gradient by one program per key block, ``dq`` and each query's by one per query block; the table's by
each key-block program into its own row of partial sums, folded by one dense sum: near-diagonal tiles through their
diagonal sums (a skew by ``tl.gather``) folded into the table's entries, far tiles (``|d| > R`` throughout) by one
sum per side; KERPLE's ``a, c`` and ALiBi's slope by closed forms (``∂b/∂a = -ln(1 + c|d|)``,
``∂b/∂c = -a|d| / (1 + c|d|)``) summed per program.

Inputs float16, bfloat16 or float32; products accumulate in float32 and the term stays float32. It runs on CUDA,
and on CPU tensors under ``TRITON_INTERPRET=1`` (set before ``import triton``), how the suite runs it; the op is a
``torch.library.custom_op`` with a fake implementation and autograd, so ``torch.compile(fullgraph=True)`` traces it.
"""

import contextlib
import os
from typing import Optional

import torch

try:  # an optional extra: ``pip install hf_relpos[triton]``
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the suite skips without it
    triton = None

# The position terms the kernel computes (see the module docstring), by name, and their codes in the kernel.
TERMS = {None: 0, "table": 1, "log": 2, "linear": 3, "query_key": 4}
# Tiles (query rows BM x key columns BN), warps and pipeline stages per kernel on a GPU, chosen with
# scripts/triton_aot.py so that no forward spills a register at head sizes up to 128 on sm_80 and sm_90 (4 warps
# spilled 128-456 bytes, 3 stages 8-48): the backward over keys walks query tiles of 32 for its key block of 64,
# the backward over queries key tiles of 32 (64 x 64 spilled up to 2 KB). Under the interpreter, where every
# program runs one after another in numpy, tiles of 16 (8 across the inner loop of each backward, as on a GPU
# smaller than the outer block) keep the tests short while still crossing tiles.
GPU_LAUNCH = {
    "forward": dict(BM=64, BN=64, num_warps=8, num_stages=2),
    "backward_kv": dict(BM=32, BN=64, num_warps=8, num_stages=2),
    "backward_q": dict(BM=64, BN=32, num_warps=8, num_stages=2),
}
INTERPRETER_LAUNCH = {
    "forward": dict(BM=16, BN=16),
    "backward_kv": dict(BM=8, BN=16),
    "backward_q": dict(BM=16, BN=8),
}


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_refusal(device) -> Optional[str]:
    """Why the kernel cannot run on ``device`` (None when it can): Triton missing, or a CPU outside the interpreter."""
    if triton is None:
        return (
            "attn_implementation='relpos_triton' needs Triton (pip install 'hf_relpos[triton]'); "
            "use 'sdpa' without it"
        )
    kind = torch.device(device).type
    if kind == "cuda" or (kind == "cpu" and interpreting()):
        return None
    if kind == "cpu":
        return (
            "attn_implementation='relpos_triton' runs on CUDA GPUs (on CPU only under TRITON_INTERPRET=1, for tests); "
            "use 'sdpa' on CPU"
        )
    return f"attn_implementation='relpos_triton' runs on CUDA GPUs, got device {str(device)!r}; use 'sdpa'"


if triton is not None:

    @triton.jit
    def _entry(IDX, at, NB):
        """The table entry of ``index[at]``, kept inside the table (the index is the library's own; checking its
        values on the host would stall a GPU)."""
        return tl.minimum(tl.maximum(tl.load(IDX + at), 0), NB - 1)

    @triton.jit
    def _term(KIND: tl.constexpr, d, b, h, offs_m, offs_n, T, IDX, R, NB, QL, KL, H, nearest, farthest):
        """The position term of a ``[BM, BN]`` tile of distances ``d`` (from ``nearest`` to ``farthest``), float32."""
        if KIND == 1:  # a table read through the distance-to-index vector
            if farthest < -R:  # beyond R on the left throughout: one entry, no gather
                term = tl.zeros(d.shape, tl.float32) + tl.load(T + h * NB + _entry(IDX, 0, NB))
            elif nearest > R:
                term = tl.zeros(d.shape, tl.float32) + tl.load(T + h * NB + _entry(IDX, 2 * R, NB))
            else:
                column = tl.load(IDX + tl.minimum(tl.maximum(d, -R), R) + R)
                term = tl.load(T + h * NB + tl.minimum(tl.maximum(column, 0), NB - 1))
            return term
        elif KIND == 2:  # -a ln(1 + c|d|)
            a = tl.load(T + h)
            c = tl.load(T + H + h)
            return -a * tl.log(1.0 + c * tl.abs(d).to(tl.float32))
        elif KIND == 3:  # -a |d|
            a = tl.load(T + h)
            return -a * tl.abs(d).to(tl.float32)
        else:  # a term per query plus one per key, high parts then low parts
            base = T + (b * H + h) * 2 * (QL + KL)
            rows = tl.minimum(offs_m, QL - 1)
            cols = QL + tl.minimum(offs_n, KL - 1)
            high = tl.load(base + rows)[:, None] + tl.load(base + cols)[None, :]
            low = tl.load(base + QL + KL + rows)[:, None] + tl.load(base + QL + KL + cols)[None, :]
            return high + low

    @triton.jit
    def _keep(offs_m, offs_n, d, b, past, QL, KL, KV, DOC,
              CAUSAL: tl.constexpr, HAS_VALID: tl.constexpr, HAS_DOC: tl.constexpr):
        """Which pairs of the tile may attend: in range, causal, valid keys, the query's own document."""
        keep = (offs_m < QL)[:, None] & (offs_n < KL)[None, :]
        if CAUSAL:
            keep = keep & (d <= 0)
        if HAS_VALID:
            valid = tl.load(KV + b * KL + offs_n, mask=offs_n < KL, other=0)
            keep = keep & (valid != 0)[None, :]
        if HAS_DOC:
            q_doc = tl.load(DOC + b * KL + tl.minimum(offs_m + past, KL - 1), mask=offs_m < QL, other=-1)
            k_doc = tl.load(DOC + b * KL + offs_n, mask=offs_n < KL, other=-2)
            keep = keep & (q_doc[:, None] == k_doc[None, :])
        return keep

    @triton.jit
    def _load_rows(P, offs, length, offs_d, D, UPCAST: tl.constexpr):
        x = tl.load(P + offs[:, None] * D + offs_d[None, :], mask=(offs < length)[:, None] & (offs_d < D)[None, :],
                    other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _forward_kernel(
        Q, K, V, OUT, LSE, OUT32, T, IDX, KV, DOC,
        H, QL, KL, D, past, R, NB, scale,
        KIND: tl.constexpr, CAUSAL: tl.constexpr, HAS_VALID: tl.constexpr, HAS_DOC: tl.constexpr, KEEP32: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ):
        start_m = tl.program_id(0) * BM
        bh = tl.program_id(1).to(tl.int64)  # offsets past 2**31 elements in int64
        b = bh // H
        h = bh % H
        offs_m = start_m + tl.arange(0, BM)
        offs_d = tl.arange(0, DP)
        q = _load_rows(Q + bh * QL * D, offs_m, QL, offs_d, D, UPCAST)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, DP], tl.float32)
        end = KL
        if CAUSAL:
            end = tl.minimum(KL, past + start_m + BM)
        for start_n in range(0, end, BN):
            offs_n = start_n + tl.arange(0, BN)
            k = _load_rows(K + bh * KL * D, offs_n, KL, offs_d, D, UPCAST)
            v = _load_rows(V + bh * KL * D, offs_n, KL, offs_d, D, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            d = offs_n[None, :] - (offs_m[:, None] + past)
            if KIND != 0:
                nearest = start_n - (start_m + BM - 1 + past)
                s += _term(KIND, d, b, h, offs_m, offs_n, T, IDX, R, NB, QL, KL, H, nearest, nearest + BM + BN - 2)
            keep = _keep(offs_m, offs_n, d, b, past, QL, KL, KV, DOC, CAUSAL, HAS_VALID, HAS_DOC)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with nothing visible yet keeps -inf: shift by 0 there, so that exp gives 0, never NaN.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - shift[:, None])
            alpha = tl.exp(m_i - shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        alive = l_i > 0
        out = tl.where(alive[:, None], acc / tl.where(alive, l_i, 1.0)[:, None], 0.0)
        # A dead row's log-sum-exp is +inf: the backward's exp(s - lse) is then 0 there.
        lse = tl.where(alive, m_i + tl.log(tl.where(alive, l_i, 1.0)), float("inf"))
        mask = (offs_m < QL)[:, None] & (offs_d < D)[None, :]
        tl.store(OUT + bh * QL * D + offs_m[:, None] * D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=mask)
        if KEEP32:  # the unrounded output, for the backward's delta (see _forward)
            tl.store(OUT32 + bh * QL * D + offs_m[:, None] * D + offs_d[None, :], out, mask=mask)
        tl.store(LSE + bh * QL + offs_m, lse, mask=offs_m < QL)

    @triton.jit
    def _scores_grad(q, k, v, do, lse, delta, start_m, start_n, offs_m, offs_n, b, h, T, IDX, KV, DOC, H, QL, KL,
                     past, R, NB, scale, KIND: tl.constexpr, CAUSAL: tl.constexpr, HAS_VALID: tl.constexpr,
                     HAS_DOC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr):
        """A tile's probabilities ``p`` and the gradient ``ds = p·(dp - delta)`` of its scores (with the term)."""
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        d = offs_n[None, :] - (offs_m[:, None] + past)
        if KIND != 0:
            nearest = start_n - (start_m + BM - 1 + past)
            s += _term(KIND, d, b, h, offs_m, offs_n, T, IDX, R, NB, QL, KL, H, nearest, nearest + BM + BN - 2)
        keep = _keep(offs_m, offs_n, d, b, past, QL, KL, KV, DOC, CAUSAL, HAS_VALID, HAS_DOC)
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        return p, p * (dp - delta[:, None]), d

    @triton.jit
    def _backward_kv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, T, IDX, KV, DOC, GT,
        H, QL, KL, D, past, R, NB, scale,
        KIND: tl.constexpr, CAUSAL: tl.constexpr, HAS_VALID: tl.constexpr, HAS_DOC: tl.constexpr,
        TERM_GRAD: tl.constexpr, NBP: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """One program per key block: ``dk, dv`` and the term's gradient of these keys, summed over query blocks in
        order. ``GT``: the table's partial sums ``[B, H, blocks, NBP]``, the closed forms' ``[B, H, blocks, 2]``,
        or the key part of ``query_key``'s gradient ``[B, H, 2, Q + K]``."""
        block = tl.program_id(0)
        start_n = block * BN
        bh = tl.program_id(1).to(tl.int64)  # offsets past 2**31 elements in int64
        b = bh // H
        h = bh % H
        offs_n = start_n + tl.arange(0, BN)
        offs_d = tl.arange(0, DP)
        k = _load_rows(K + bh * KL * D, offs_n, KL, offs_d, D, UPCAST)
        v = _load_rows(V + bh * KL * D, offs_n, KL, offs_d, D, UPCAST)
        dk = tl.zeros([BN, DP], tl.float32)
        dv = tl.zeros([BN, DP], tl.float32)
        table = tl.zeros([NBP], tl.float32)
        entries = tl.arange(0, NBP)
        left = 0.0
        right = 0.0
        grad_a = 0.0
        grad_c = 0.0
        column_sum = tl.zeros([BN], tl.float32)
        begin = 0
        if CAUSAL:
            begin = tl.maximum(start_n - past, 0) // BM * BM
        for start_m in range(begin, QL, BM):
            offs_m = start_m + tl.arange(0, BM)
            q = _load_rows(Q + bh * QL * D, offs_m, QL, offs_d, D, UPCAST)
            do = _load_rows(DO + bh * QL * D, offs_m, QL, offs_d, D, UPCAST)
            lse = tl.load(LSE + bh * QL + offs_m, mask=offs_m < QL, other=float("inf"))
            delta = tl.load(DELTA + bh * QL + offs_m, mask=offs_m < QL, other=0.0)
            p, ds, d = _scores_grad(q, k, v, do, lse, delta, start_m, start_n, offs_m, offs_n, b, h, T, IDX, KV, DOC,
                                    H, QL, KL, past, R, NB, scale, KIND, CAUSAL, HAS_VALID, HAS_DOC, BM, BN, PRECISION)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
            if TERM_GRAD:
                if KIND == 1:
                    nearest = start_n - (start_m + BM - 1 + past)  # the tile's smallest distance
                    farthest = start_n + BN - 1 - (start_m + past)  # its largest
                    if farthest < -R:  # the whole tile on the left edge's entry
                        left += tl.sum(tl.sum(ds, 1), 0)
                    elif nearest > R:
                        right += tl.sum(tl.sum(ds, 1), 0)
                    else:
                        # Diagonal sums: skew row i by i (column t of the skewed tile is distance nearest + t, t <
                        # BM + BN - 1 <= 2 BN), then sum the columns; each diagonal's entry through the index.
                        tl.static_assert(BM <= BN + 1)
                        rows = tl.arange(0, BM)[:, None]
                        t = tl.arange(0, 2 * BN)[None, :]
                        source = rows + t - (BM - 1)
                        inside = (source >= 0) & (source < BN)
                        skewed = tl.gather(ds, tl.minimum(tl.maximum(source, 0), BN - 1).to(tl.int32), 1)
                        diagonal = tl.sum(tl.where(inside, skewed, 0.0), 0)
                        distance = nearest + tl.arange(0, 2 * BN)
                        column = tl.load(IDX + tl.minimum(tl.maximum(distance, -R), R) + R)
                        column = tl.minimum(tl.maximum(column, 0), NB - 1)
                        table += tl.sum(tl.where(column[:, None] == entries[None, :], diagonal[:, None], 0.0), 0)
                elif KIND == 2:
                    a = tl.load(T + h)
                    c = tl.load(T + H + h)
                    far = tl.abs(d).to(tl.float32)
                    grad_a += tl.sum(tl.sum(-ds * tl.log(1.0 + c * far), 1), 0)
                    grad_c += tl.sum(tl.sum(-ds * a * far / (1.0 + c * far), 1), 0)
                elif KIND == 3:
                    grad_a += tl.sum(tl.sum(-ds * tl.abs(d).to(tl.float32), 1), 0)
                elif KIND == 4:
                    column_sum += tl.sum(ds, 0)
        mask = (offs_n < KL)[:, None] & (offs_d < D)[None, :]
        where = bh * KL * D + offs_n[:, None] * D + offs_d[None, :]
        tl.store(DK + where, (dk * scale).to(DK.dtype.element_ty), mask=mask)
        tl.store(DV + where, dv.to(DV.dtype.element_ty), mask=mask)
        if TERM_GRAD:
            blocks = tl.num_programs(0)
            if KIND == 1:
                table += tl.where(entries == _entry(IDX, 0, NB), left, 0.0)
                table += tl.where(entries == _entry(IDX, 2 * R, NB), right, 0.0)
                tl.store(GT + (bh * blocks + block) * NBP + entries, table)
            elif KIND == 2 or KIND == 3:
                tl.store(GT + (bh * blocks + block) * 2, grad_a)
                tl.store(GT + (bh * blocks + block) * 2 + 1, grad_c)
            elif KIND == 4:
                base = GT + bh * 2 * (QL + KL) + QL + offs_n
                tl.store(base, column_sum, mask=offs_n < KL)
                tl.store(base + QL + KL, column_sum, mask=offs_n < KL)

    @triton.jit
    def _backward_q_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, T, IDX, KV, DOC, GT,
        H, QL, KL, D, past, R, NB, scale,
        KIND: tl.constexpr, CAUSAL: tl.constexpr, HAS_VALID: tl.constexpr, HAS_DOC: tl.constexpr,
        TERM_GRAD: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """One program per query block: ``dq`` and, for ``query_key``, the query part of the term's gradient."""
        start_m = tl.program_id(0) * BM
        bh = tl.program_id(1).to(tl.int64)  # offsets past 2**31 elements in int64
        b = bh // H
        h = bh % H
        offs_m = start_m + tl.arange(0, BM)
        offs_d = tl.arange(0, DP)
        q = _load_rows(Q + bh * QL * D, offs_m, QL, offs_d, D, UPCAST)
        do = _load_rows(DO + bh * QL * D, offs_m, QL, offs_d, D, UPCAST)
        lse = tl.load(LSE + bh * QL + offs_m, mask=offs_m < QL, other=float("inf"))
        delta = tl.load(DELTA + bh * QL + offs_m, mask=offs_m < QL, other=0.0)
        dq = tl.zeros([BM, DP], tl.float32)
        row_sum = tl.zeros([BM], tl.float32)
        end = KL
        if CAUSAL:
            end = tl.minimum(KL, past + start_m + BM)
        for start_n in range(0, end, BN):
            offs_n = start_n + tl.arange(0, BN)
            k = _load_rows(K + bh * KL * D, offs_n, KL, offs_d, D, UPCAST)
            v = _load_rows(V + bh * KL * D, offs_n, KL, offs_d, D, UPCAST)
            p, ds, d = _scores_grad(q, k, v, do, lse, delta, start_m, start_n, offs_m, offs_n, b, h, T, IDX, KV, DOC,
                                    H, QL, KL, past, R, NB, scale, KIND, CAUSAL, HAS_VALID, HAS_DOC, BM, BN, PRECISION)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
            if TERM_GRAD and KIND == 4:
                row_sum += tl.sum(ds, 1)
        mask = (offs_m < QL)[:, None] & (offs_d < D)[None, :]
        tl.store(DQ + bh * QL * D + offs_m[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
                 mask=mask)
        if TERM_GRAD and KIND == 4:
            base = GT + bh * 2 * (QL + KL) + offs_m
            tl.store(base, row_sum, mask=offs_m < QL)
            tl.store(base + QL + KL, row_sum, mask=offs_m < QL)


def launch(kernel: str) -> dict:
    """The tiles (``BM``, ``BN``) and, on a GPU, ``num_warps`` and ``num_stages`` of ``kernel``'s launch."""
    return dict((INTERPRETER_LAUNCH if interpreting() else GPU_LAUNCH)[kernel])


def _setup(q: torch.Tensor):
    """Padded head size, and the dtype flags of a launch."""
    padded = max(16, triton.next_power_of_2(q.shape[-1]))
    # The interpreter multiplies bfloat16 bit patterns in tl.dot: upcast there. float32 inputs: exact products (IEEE),
    # not TF32's 10-bit mantissa.
    upcast = interpreting() and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    return padded, upcast, precision


def _common(term, index, key_valid, documents, q):
    """The kernel's view of the optional inputs (a 1-element placeholder where absent)."""
    dummy = torch.zeros(1, device=q.device, dtype=torch.float32)
    table = dummy if term is None else term.float().contiguous()
    idx = torch.zeros(1, device=q.device, dtype=torch.int32) if index is None else index.to(torch.int32).contiguous()
    valid = dummy if key_valid is None else key_valid.to(torch.int8).contiguous()
    doc = dummy if documents is None else documents.to(torch.int32).contiguous()
    return table, idx, valid, doc


def _flags(kind: int, term, index):
    """``R`` of the distance-to-index vector ``[2R + 1]`` and the table's entries ``NB`` (``"table"`` only)."""
    radius = 0 if index is None else (index.shape[0] - 1) // 2
    entries = term.shape[-1] if kind == 1 else 1
    return radius, entries


def on_device(device: torch.device):
    """The context every launch runs in: the inputs' GPU as the current device (Triton launches on the current
    one, so inputs on ``cuda:1`` under a current ``cuda:0`` would be read from the wrong device); nothing on a CPU,
    under the interpreter."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _forward(q, k, v, term, index, key_valid, documents, kind, scale, causal, past, keep32):
    """The output, the log-sum-exp of each row, and with ``keep32`` the output in float32: the backward's
    ``delta_i = do_i·o_i`` from a float16/bfloat16 output is off by its rounding. In ``dq, dk`` that error is of the
    inputs' own precision (as in FlashAttention); a term's gradient, a sum over all pairs, accumulates it (KERPLE's
    r1 off by 5e-3 in float16, 8e-2 in bfloat16)."""
    batch, heads, q_length, head_dim = q.shape
    k_length = k.shape[2]
    padded, upcast, precision = _setup(q)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, q_length, device=q.device, dtype=torch.float32)
    out32 = torch.empty(q.shape if keep32 else 0, device=q.device, dtype=torch.float32)
    table, idx, valid, doc = _common(term, index, key_valid, documents, q)
    radius, entries = _flags(kind, term, index)
    config = launch("forward")
    grid = (triton.cdiv(q_length, config["BM"]), batch * heads)
    with on_device(q.device):
        _forward_kernel[grid](
            q, k, v, out, lse, out32, table, idx, valid, doc,
            heads, q_length, k_length, head_dim, past, radius, entries, scale,
            KIND=kind, CAUSAL=causal, HAS_VALID=key_valid is not None, HAS_DOC=documents is not None, KEEP32=keep32,
            DP=padded, UPCAST=upcast, PRECISION=precision, **config,
        )
    return out, lse, out32


def _backward(q, k, v, out, lse, grad_out, term, index, key_valid, documents, kind, scale, causal, past, term_grad):
    batch, heads, q_length, head_dim = q.shape
    k_length = k.shape[2]
    padded, upcast, precision = _setup(q)
    q, k, v, grad_out = q.contiguous(), k.contiguous(), v.contiguous(), grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(-1)  # D_i = do_i · o_i (FlashAttention-2, Alg. 2 line 4)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    table, idx, valid, doc = _common(term, index, key_valid, documents, q)
    radius, entries = _flags(kind, term, index)
    over_keys, over_queries = launch("backward_kv"), launch("backward_q")
    blocks = triton.cdiv(k_length, over_keys["BN"])
    term_grad = term_grad and kind != 0
    padded_entries = triton.next_power_of_2(entries)
    if not term_grad:
        partial = table
    elif kind == 1:
        partial = torch.zeros(batch, heads, blocks, padded_entries, device=q.device, dtype=torch.float32)
    elif kind in (2, 3):
        partial = torch.zeros(batch, heads, blocks, 2, device=q.device, dtype=torch.float32)
    else:
        partial = torch.zeros(batch, heads, 2, q_length + k_length, device=q.device, dtype=torch.float32)
    flags = dict(KIND=kind, CAUSAL=causal, HAS_VALID=key_valid is not None, HAS_DOC=documents is not None,
                 TERM_GRAD=term_grad, DP=padded, UPCAST=upcast, PRECISION=precision)
    sizes = (heads, q_length, k_length, head_dim, past, radius, entries, scale)
    with on_device(q.device):
        _backward_kv_kernel[(blocks, batch * heads)](
            q, k, v, grad_out, lse, delta, dk, dv, table, idx, valid, doc, partial, *sizes, NBP=padded_entries,
            **flags, **over_keys,
        )
        _backward_q_kernel[(triton.cdiv(q_length, over_queries["BM"]), batch * heads)](
            q, k, v, grad_out, lse, delta, dq, table, idx, valid, doc, partial, *sizes, **flags, **over_queries
        )
    if not term_grad:
        grad_term = None
    elif kind == 1:  # one dense sum over the batch and the key blocks, in a fixed order
        grad_term = partial.sum(dim=(0, 2))[:, :entries].contiguous()  # as the fake: a compiled graph checks strides
    elif kind in (2, 3):
        grad_term = partial.sum(dim=(0, 2)).t().contiguous()
    else:
        grad_term = partial
    return dq, dk, dv, grad_term


# ----------------------------------------------------------------------------------
# The custom op: traced by torch.compile as one node, with its fake implementation and autograd
# ----------------------------------------------------------------------------------


def _free_op_name(base: str) -> str:
    """``hf_relpos::base``, or ``base_2``, ... when taken: a model's remote code copy of this module (loaded beside
    hf_relpos in one process) defines its ops again, and an op name can be registered once only."""
    name, n = base, 1
    while hasattr(torch.ops.hf_relpos, name):
        n += 1
        name = f"{base}_{n}"
    return f"hf_relpos::{name}"


@torch.library.custom_op(_free_op_name("relpos_attention"), mutates_args=())
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, term: Optional[torch.Tensor], index: Optional[torch.Tensor],
    key_valid: Optional[torch.Tensor], documents: Optional[torch.Tensor], kind: int, scale: float, causal: bool,
    past: int, keep32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, term, index, key_valid, documents, kind, scale, causal, past, keep32)


@_attention_op.register_fake
def _(q, k, v, term, index, key_valid, documents, kind, scale, causal, past, keep32):
    # Contiguous, as the kernel writes them (empty_like would keep a transposed query's strides).
    out32 = q.new_empty(q.shape if keep32 else 0, dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32), out32


@torch.library.custom_op(_free_op_name("relpos_attention_backward"), mutates_args=())
def _attention_backward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
    term: Optional[torch.Tensor], index: Optional[torch.Tensor], key_valid: Optional[torch.Tensor],
    documents: Optional[torch.Tensor], kind: int, scale: float, causal: bool, past: int, term_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, grad_term = _backward(
        q, k, v, out, lse, grad_out, term, index, key_valid, documents, kind, scale, causal, past, term_grad
    )
    if grad_term is None:
        grad_term = q.new_zeros(0, dtype=torch.float32)
    return dq, dk, dv, grad_term


@_attention_backward_op.register_fake
def _(q, k, v, out, lse, grad_out, term, index, key_valid, documents, kind, scale, causal, past, term_grad):
    grad_term = q.new_empty(0, dtype=torch.float32)
    if term_grad and term is not None and kind != 0:
        grad_term = term.new_empty(term.shape, dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), grad_term


def _setup_context(ctx, inputs, output):
    q, k, v, term, index, key_valid, documents, kind, scale, causal, past, keep32 = inputs
    out, lse, out32 = output
    ctx.save_for_backward(q, k, v, out32 if keep32 else out, lse, term, index, key_valid, documents)
    ctx.kind, ctx.scale, ctx.causal, ctx.past = kind, scale, causal, past


def _backward_rule(ctx, grad_out, grad_lse, grad_out32):
    q, k, v, out, lse, term, index, key_valid, documents = ctx.saved_tensors
    term_grad = term is not None and ctx.needs_input_grad[3]
    dq, dk, dv, grad_term = _attention_backward_op(
        q, k, v, out, lse, grad_out, term, index, key_valid, documents, ctx.kind, ctx.scale, ctx.causal, ctx.past,
        term_grad,
    )
    return dq, dk, dv, (grad_term.to(term.dtype) if term_grad else None), *[None] * 8


_attention_op.register_autograd(_backward_rule, setup_context=_setup_context)


def relpos_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = False, past: int = 0,
    term: Optional[str] = None, values: Optional[torch.Tensor] = None, index: Optional[torch.Tensor] = None,
    key_valid: Optional[torch.Tensor] = None, documents: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``softmax(scale·q kᵀ + b + mask) v`` for ``[B, H, Q, D]`` queries over ``[B, H, K, D]`` keys and values,
    with the position term ``b`` named by ``term`` (a key of ``TERMS``) made of ``values`` (and ``index`` for
    ``"table"``), queries at positions ``past + i``; ``key_valid`` ``[B, K]`` bool and ``documents`` ``[B, K]`` int
    mask keys (padding) and other documents' keys. Returns ``[B, H, Q, D]``; zeros for a query with no key left.
    Gradients flow to ``q, k, v`` and ``values``."""
    if term not in TERMS:
        raise ValueError(f"term must be one of {list(TERMS)}, got {term!r}")
    if (term is None) != (values is None) or (term == "table") != (index is not None):
        raise ValueError(f"term={term!r} takes values{' and index' if term == 'table' else ''}, and only those")
    refusal = device_refusal(q.device)
    if refusal is not None:
        raise ValueError(refusal)
    if torch.is_autocast_enabled(q.device.type):  # as SDPA under autocast: q, k and v in the autocast dtype (RoPE
        dtype = torch.get_autocast_dtype(q.device.type)  # hands over float32 queries and keys beside bf16 values)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            "q must be [B, H, Q, D] and k, v [B, H, K, D] (the same B, H, D), got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"q, k and v must share one of float16, bfloat16, float32 for attn_implementation='relpos_triton', got "
            f"{q.dtype}, {k.dtype}, {v.dtype}; use 'sdpa' for others"
        )
    if q.shape[-1] > 128:
        raise ValueError(f"head_dim must be at most 128 for attn_implementation='relpos_triton', got {q.shape[-1]}; "
                         "use 'sdpa' or 'flex_attention'")
    if q.shape[0] * q.shape[1] > 65535:  # the launch grid's second axis
        raise ValueError(f"batch x heads must be at most 65535 for the Triton kernel, got {q.shape[0] * q.shape[1]}")
    _check_shapes(q, k, term, values, index, key_valid, documents, past, causal)
    # A term's gradient from half-precision inputs takes the backward's delta from the float32 output (_forward).
    keep32 = q.dtype != torch.float32 and values is not None and values.requires_grad and torch.is_grad_enabled()
    out, _, _ = _attention_op(q, k, v, values, index, key_valid, documents, TERMS[term], float(scale), bool(causal),
                              int(past), keep32)
    return out


def _check_shapes(q, k, term, values, index, key_valid, documents, past, causal) -> None:
    """The term's tensors, the masks and ``past`` against q ``[B, H, Q, D]`` and k ``[B, H, K, D]``: one ValueError
    naming the argument (the kernel reads them by these sizes). A CPU index's entries are checked too, in eager calls;
    on a GPU, and traced, the kernel keeps them inside the table instead (a host read would stall the GPU, or break
    the trace)."""
    batch, heads, q_length, k_length = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    expected = {"log": (2, heads), "linear": (2, heads), "query_key": (batch, heads, 2, q_length + k_length)}
    if term == "table":
        if values.dim() != 2 or values.shape[0] != heads or values.shape[1] < 1:
            raise ValueError(f"values of term='table' must be [heads={heads}, entries], got {tuple(values.shape)}")
        if index.dim() != 1 or index.shape[0] % 2 != 1 or index.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"index must be integer [2R + 1], one entry per distance -R .. R, got {index.dtype} "
                             f"{tuple(index.shape)}")
        read = index.device.type == "cpu" and not torch.compiler.is_compiling()  # a host read: eager CPU calls only
        if read and index.numel() and (int(index.min()) < 0 or int(index.max()) >= values.shape[1]):
            raise ValueError(f"index entries must lie in [0, {values.shape[1]}), got {int(index.min())} .. "
                             f"{int(index.max())}")
    elif term is not None and tuple(values.shape) != expected[term]:
        raise ValueError(f"values of term={term!r} must be {list(expected[term])}, got {list(values.shape)}")
    for name, mask in (("key_valid", key_valid), ("documents", documents)):
        if mask is not None and tuple(mask.shape) != (batch, k_length):
            raise ValueError(f"{name} must be [batch={batch}, keys={k_length}], got {list(mask.shape)}")
    if isinstance(past, bool) or not isinstance(past, int) or past < 0:
        raise ValueError(f"past must be an int >= 0, got {past!r}")
    # Queries sit at positions past + i among the keys only where a position is read (causality, a term, the query's
    # document); cross-attention reads none, and its target may be longer than its source.
    if (causal or term is not None or documents is not None) and past + q_length > k_length:
        raise ValueError(f"the queries' positions past + Q must not pass the keys: past={past}, Q={q_length}, "
                         f"K={k_length}")
