"""Slow, obviously-correct reference implementations for ``hf_relpos.functional``.

Every oracle here is written straight from the formulas of the API contract
(``/work/shared/api-contract.md`` section 1) with explicit Python loops.
Nothing in this module imports ``hf_relpos``.

Two families:

* ``*_ref``: pure Python floats (IEEE double) with ``math.exp`` etc.; inputs are
  turned into nested lists with ``tolist()``.  Used for value tests.
* ``*_torch_ref``: the same loops, but every elementary operation is a float64
  torch op on 0-d / 1-d tensors, so autograd works.  Used for gradient tests.

Masking convention (shared by both families): a mask entry is "masked" when it is
boolean ``False``, or an additive float equal to ``-inf`` or to
``torch.finfo(mask.dtype).min``.  Masked entries are excluded from the softmax;
a row with no unmasked key gives an all-zero output row.
"""

from __future__ import annotations

import math

import torch


# ---------------------------------------------------------------------------
# mask helpers
# ---------------------------------------------------------------------------


def expand_mask(mask, B, H, Q, K):
    """Return (allowed, additive) as nested Python lists [B][H][Q][K].

    ``allowed[b][h][i][j]`` is a bool, ``additive[b][h][i][j]`` a float that is
    added to the score (0.0 for boolean masks).
    """
    if mask is None:
        allowed = [[[[True] * K for _ in range(Q)] for _ in range(H)] for _ in range(B)]
        additive = [[[[0.0] * K for _ in range(Q)] for _ in range(H)] for _ in range(B)]
        return allowed, additive
    full = mask.expand(B, H, Q, K)
    vals = full.tolist()
    if mask.dtype == torch.bool:
        additive = [[[[0.0] * K for _ in range(Q)] for _ in range(H)] for _ in range(B)]
        return vals, additive
    fmin = float(torch.finfo(mask.dtype).min)
    allowed = [
        [[[not (x == -math.inf or x == fmin) for x in row] for row in hh] for hh in bb] for bb in vals
    ]
    additive = [
        [[[(0.0 if (x == -math.inf or x == fmin) else float(x)) for x in row] for row in hh] for hh in bb]
        for bb in vals
    ]
    return allowed, additive


def softmax_excluding(scores, allowed):
    """Hand-written softmax over a Python list, excluding disallowed entries.

    Returns a list of weights; all zeros when nothing is allowed.
    """
    live = [s for s, ok in zip(scores, allowed) if ok]
    if not live:
        return [0.0] * len(scores)
    m = max(live)
    ex = [math.exp(s - m) if ok else 0.0 for s, ok in zip(scores, allowed)]
    tot = sum(ex)
    return [x / tot for x in ex]


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def clamp(x, lo, hi):
    return max(lo, min(hi, x))


# ---------------------------------------------------------------------------
# pure-Python value oracles
# ---------------------------------------------------------------------------


def shaw_ref(q, k, v, rel_k, rel_v, *, max_relative_position, attention_mask=None,
             is_causal=False, past_length=0):
    """Shaw et al. 2018, float64 Python loops. Returns a float64 tensor [B,H,Q,D]."""
    B, H, Q, D = q.shape
    K = k.shape[2]
    kk = max_relative_position
    Lq, Lk, Lv = q.double().tolist(), k.double().tolist(), v.double().tolist()
    RK = rel_k.double().tolist()
    RV = None if rel_v is None else rel_v.double().tolist()
    allowed, additive = expand_mask(attention_mask, B, H, Q, K)
    scale = 1.0 / math.sqrt(D)
    out = [[[[0.0] * D for _ in range(Q)] for _ in range(H)] for _ in range(B)]
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                qpos = past_length + i
                scores, ok = [], []
                for j in range(K):
                    r = clamp(j - qpos, -kk, kk) + kk
                    e = (dot(Lq[b][h][i], Lk[b][h][j]) + dot(Lq[b][h][i], RK[r])) * scale
                    e += additive[b][h][i][j]
                    allowed_ij = allowed[b][h][i][j] and not (is_causal and j > qpos)
                    scores.append(e)
                    ok.append(allowed_ij)
                a = softmax_excluding(scores, ok)
                for d in range(D):
                    acc = 0.0
                    for j in range(K):
                        if a[j] == 0.0:
                            continue
                        r = clamp(j - qpos, -kk, kk) + kk
                        val = Lv[b][h][j][d] + (RV[r][d] if RV is not None else 0.0)
                        acc += a[j] * val
                    out[b][h][i][d] = acc
    return torch.tensor(out, dtype=torch.float64)


def txl_ref(q, k, v, r, u, w, *, attention_mask=None, is_causal=True):
    """Transformer-XL (Dai et al. 2019), float64 Python loops. [B,H,Q,D]."""
    B, H, Q, D = q.shape
    K = k.shape[2]
    M = K - Q
    Lq, Lk, Lv = q.double().tolist(), k.double().tolist(), v.double().tolist()
    Lr, Lu, Lw = r.double().tolist(), u.double().tolist(), w.double().tolist()
    allowed, additive = expand_mask(attention_mask, B, H, Q, K)
    scale = 1.0 / math.sqrt(D)
    out = [[[[0.0] * D for _ in range(Q)] for _ in range(H)] for _ in range(B)]
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                qu = [Lq[b][h][i][d] + Lu[h][d] for d in range(D)]
                qw = [Lq[b][h][i][d] + Lw[h][d] for d in range(D)]
                scores, ok = [], []
                for j in range(K):
                    dist = (M + i) - j
                    causal_block = is_causal and j > M + i
                    t = K - 1 - dist  # row of r holding distance `dist`
                    if causal_block:
                        pos_term = 0.0  # never used
                    else:
                        pos_term = dot(qw, Lr[h][t])
                    e = (dot(qu, Lk[b][h][j]) + pos_term) * scale + additive[b][h][i][j]
                    scores.append(e)
                    ok.append(allowed[b][h][i][j] and not causal_block)
                a = softmax_excluding(scores, ok)
                for d in range(D):
                    out[b][h][i][d] = sum(a[j] * Lv[b][h][j][d] for j in range(K) if a[j] != 0.0)
    return torch.tensor(out, dtype=torch.float64)


def sinusoidal_ref(positions, dim):
    """[len, dim] float64: [sin(p f_0..f_{dim/2-1}), cos(p f_0..)], f_k = 10000^(-2k/dim)."""
    half = dim // 2
    freqs = [10000.0 ** (-2.0 * kk / dim) for kk in range(half)]
    rows = []
    for p in [float(x) for x in positions.tolist()]:
        rows.append([math.sin(p * f) for f in freqs] + [math.cos(p * f) for f in freqs])
    return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), dim)


def log_decay_ref(Q, K, *, scale, past_length=0):
    return torch.tensor(
        [[-scale * math.log(1.0 + abs(j - (past_length + i))) for j in range(K)] for i in range(Q)],
        dtype=torch.float64,
    ).reshape(Q, K)


def alibi_slopes_ref(n):
    """Press et al. 2022 rule, written independently."""

    def pow2_slopes(c):
        # start = 2^(-8/c); slope_e = start^e, evaluated as one power of two for accuracy
        return [2.0 ** (-8.0 * e / c) for e in range(1, c + 1)]

    if n & (n - 1) == 0:
        return pow2_slopes(n)
    c = 1
    while c * 2 <= n:
        c *= 2
    extra = pow2_slopes(2 * c)[0::2]
    return pow2_slopes(c) + extra[: n - c]


def alibi_bias_ref(slopes, Q, K, *, past_length=0):
    m = [float(x) for x in slopes.tolist()]
    return torch.tensor(
        [[[[-mh * abs(j - (past_length + i)) for j in range(K)] for i in range(Q)] for mh in m]],
        dtype=torch.float64,
    ).reshape(1, len(m), Q, K)


def kerple_log_ref(r1, r2, Q, K, *, past_length=0):
    """Chi et al. 2022, logarithmic kernel: -r1_h * ln(1 + r2_h * |j - (past + i)|)."""
    a, b = [float(x) for x in r1.tolist()], [float(x) for x in r2.tolist()]
    return torch.tensor(
        [[[[-a[h] * math.log(1.0 + b[h] * abs(j - (past_length + i))) for j in range(K)] for i in range(Q)]
          for h in range(len(a))]],
        dtype=torch.float64,
    ).reshape(1, len(a), Q, K)


def fire_torch_ref(w1, b1, w2, b2, c, threshold, Q, K, *, past_length=0, positions=None, eps=1e-6):
    """Li et al. 2024 (FIRE), entry by entry with float64 torch scalars (differentiable), one batch row
    (``positions``: that row's query positions, default past_length + i):
    f(psi(|past + i - j|) / (psi(max(L, p_i)) + eps)) with psi(x) = ln(1 + |c x|) and f = w2 relu(w1 x + b1) + b2."""
    H, width = w2.shape
    out = torch.zeros(1, H, Q, K, dtype=torch.float64)
    rows = []
    for i in range(Q):
        p = past_length + i if positions is None else int(positions[i])
        norm = torch.log(1.0 + (c * torch.maximum(threshold, torch.tensor(float(p), dtype=torch.float64))).abs()) + eps
        row = []
        for j in range(K):
            x = torch.log(1.0 + (c * float(past_length + i - j)).abs()) / norm
            hidden = [torch.relu(w1[u, 0] * x + b1[u]) for u in range(width)]
            row.append(torch.stack([b2[h] + sum(w2[h, u] * hidden[u] for u in range(width)) for h in range(H)]))
        rows.append(torch.stack(row, dim=-1))  # [H, K]
    return torch.stack(rows, dim=1).unsqueeze(0) if rows else out  # [1, H, Q, K]


# ---------------------------------------------------------------------------
# differentiable (torch scalar-op) oracles, still loops
# ---------------------------------------------------------------------------


def _softmax_torch(scores, ok):
    """scores: list of 0-d tensors; ok: list of bools. Returns list of 0-d tensors / None."""
    live = [s for s, o in zip(scores, ok) if o]
    if not live:
        return [None] * len(scores)
    m = max(float(s.detach()) for s in live)
    ex = [torch.exp(s - m) if o else None for s, o in zip(scores, ok)]
    tot = sum(x for x in ex if x is not None)
    return [None if x is None else x / tot for x in ex]


def shaw_torch_ref(q, k, v, rel_k, rel_v, *, max_relative_position, attention_mask=None,
                   is_causal=False, past_length=0):
    B, H, Q, D = q.shape
    K = k.shape[2]
    kk = max_relative_position
    allowed, additive = expand_mask(attention_mask, B, H, Q, K)
    scale = 1.0 / math.sqrt(D)
    rows = []
    for b in range(B):
        hs = []
        for h in range(H):
            is_ = []
            for i in range(Q):
                qpos = past_length + i
                scores, ok = [], []
                for j in range(K):
                    r = clamp(j - qpos, -kk, kk) + kk
                    e = (torch.dot(q[b, h, i], k[b, h, j]) + torch.dot(q[b, h, i], rel_k[r])) * scale
                    scores.append(e + additive[b][h][i][j])
                    ok.append(allowed[b][h][i][j] and not (is_causal and j > qpos))
                a = _softmax_torch(scores, ok)
                z = torch.zeros(D, dtype=torch.float64)
                for j in range(K):
                    if a[j] is None:
                        continue
                    r = clamp(j - qpos, -kk, kk) + kk
                    val = v[b, h, j] if rel_v is None else v[b, h, j] + rel_v[r]
                    z = z + a[j] * val
                is_.append(z)
            hs.append(torch.stack(is_))
        rows.append(torch.stack(hs))
    return torch.stack(rows)


def txl_torch_ref(q, k, v, r, u, w, *, attention_mask=None, is_causal=True):
    B, H, Q, D = q.shape
    K = k.shape[2]
    M = K - Q
    allowed, additive = expand_mask(attention_mask, B, H, Q, K)
    scale = 1.0 / math.sqrt(D)
    rows = []
    for b in range(B):
        hs = []
        for h in range(H):
            is_ = []
            for i in range(Q):
                qu = q[b, h, i] + u[h]
                qw = q[b, h, i] + w[h]
                scores, ok = [], []
                for j in range(K):
                    dist = (M + i) - j
                    blocked = is_causal and j > M + i
                    content = torch.dot(qu, k[b, h, j])
                    pos = torch.zeros((), dtype=torch.float64) if blocked else torch.dot(qw, r[h, K - 1 - dist])
                    scores.append((content + pos) * scale + additive[b][h][i][j])
                    ok.append(allowed[b][h][i][j] and not blocked)
                a = _softmax_torch(scores, ok)
                z = torch.zeros(D, dtype=torch.float64)
                for j in range(K):
                    if a[j] is not None:
                        z = z + a[j] * v[b, h, j]
                is_.append(z)
            hs.append(torch.stack(is_))
        rows.append(torch.stack(hs))
    return torch.stack(rows)
