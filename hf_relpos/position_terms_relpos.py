"""Each scheme's position term, from its paper: T5's buckets and bias, sinusoids, log-decay, ALiBi's slopes and
biases, FoX's forget-gate sums, KERPLE's and FIRE's biases; and the argument checks and distance grids they share
with the attention functions. Pure PyTorch, no Transformers import.

``functional_relpos.py`` holds the attention functions that take these terms (and re-exports every function here,
so ``hf_relpos.functional`` lists them all); its docstring has the shapes' legend and the conventions these follow.
Each public function states its equation, the shapes of its arguments and what it returns, and names the reference
it is tested against (``tests/oracles.py`` unless said otherwise).

Flat module (remote code copies it beside ``modeling_relpos.py``): relative imports only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .kernels_relpos import fire_mlp, fire_mlp_applies

__all__ = [
    "t5_exact_buckets",
    "t5_relative_position_bucket",
    "t5_position_bias",
    "t5_saturation_distance",
    "t5_bias_by_distance",
    "sinusoidal_embedding",
    "log_decay_bias",
    "alibi_slopes",
    "alibi_bias",
    "alibi_key_bias",
    "fox_key_bias",
    "fox_bias",
    "fox_query_key_bias",
    "kerple_log_bias",
    "fire_bias",
]


# ----------------------------------------------------------------------------------
# Argument checks and distance grids (the attention functions of functional_relpos.py use them too)
# ----------------------------------------------------------------------------------


def _check_int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, torch.SymInt):  # a traced (torch.export) length: its bounds are the exporter's to check
        return value
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
    a tensor (reading it on the host would break the graph); ``attention_utils_relpos._is_zero`` tells the two apart."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() and torch.compiler.is_compiling():
        return value
    return _check_int(name, value)


def _check_tensor(name: str, x, ndim: int, shape_doc: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape_doc}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims {shape_doc}, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def _relative_distance(query_length: int, key_length: int, past_length: int, device) -> torch.Tensor:
    """[Q, K] long: j - (past_length + i), key position minus query position."""
    i = torch.arange(query_length, device=device)[:, None] + past_length
    j = torch.arange(key_length, device=device)[None, :]
    return j - i


def _distances(query_length: int, key_length: int, past_length, device, relative_position) -> torch.Tensor:
    """[Q, K]: ``relative_position`` when given (explicit positions: requests packed in one row of a paged cache,
    each key at its own request's position), else the band ``j - (past_length + i)``."""
    if relative_position is None:
        return _relative_distance(query_length, key_length, past_length, device)
    if not isinstance(relative_position, torch.Tensor) or relative_position.is_floating_point() or (
        relative_position.dtype == torch.bool
    ):
        raise TypeError(f"relative_position must be an integer torch.Tensor [q_len, k_len], got {relative_position!r:.60}")
    if tuple(relative_position.shape) != (query_length, key_length):
        raise ValueError(
            f"relative_position must be [q_len={query_length}, k_len={key_length}] (key position minus query "
            f"position), got shape {tuple(relative_position.shape)}"
        )
    return relative_position.to(device)


# ----------------------------------------------------------------------------------
# T5 bucketed bias (Raffel et al. 2020)
# ----------------------------------------------------------------------------------


def t5_exact_buckets(bidirectional: bool, num_buckets: int) -> int:
    """How many of a direction's T5 buckets hold one exact distance each (``0 .. max_exact - 1``): half of
    its buckets, a direction having all ``num_buckets`` (causal) or half of them (bidirectional). T5 needs at
    least one, and ``max_distance > max_exact`` to leave room for the log-spaced buckets."""
    return (num_buckets // 2 if bidirectional else num_buckets) // 2


def _check_t5_buckets(bidirectional: bool, num_buckets, max_distance, buckets_name: str = "num_buckets") -> None:
    _check_int(buckets_name, num_buckets, 0)
    _check_int("max_distance", max_distance, 0)
    max_exact = t5_exact_buckets(bidirectional, num_buckets)
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

    Args:
        relative_position: an integer tensor of any shape.
        bidirectional, num_buckets, max_distance: T5's configuration.

    Returns:
        a long tensor of ``relative_position``'s shape, in ``[0, num_buckets)``.

    Reference: upstream ``T5Attention._relative_position_bucket`` (``tests/test_functional.py``).
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
    relative_position: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """T5's additive bias ``B[h, i, j] = weight[bucket(j - (past_length + i)), h]``.

    Equals upstream ``T5Attention.compute_bias(Q, K, past_seen_tokens=past_length)``. Only the ``Q`` query
    rows asked for are computed, so a decoding step costs one row per new token.

    Args:
        weight: ``[num_buckets, H]``, the table (T5's ``nn.Embedding.weight``).
        query_length, key_length: ``Q``, ``K``.
        bidirectional, max_distance: T5's configuration; past_length: the queries' offset.
        relative_position: ``[Q, K]`` integer, key position minus query position for each pair, in place of
            ``j - (past_length + i)`` (explicit positions: packed requests of a paged cache).

    Returns:
        ``[1, H, Q, K]`` in ``weight``'s dtype.

    Reference: upstream ``T5Attention.compute_bias`` (``tests/test_functional.py``).
    """
    _check_tensor("weight", weight, 2, "[num_buckets, heads]")
    query_length = _check_int("query_length", query_length)
    key_length = _check_int("key_length", key_length)
    past_length = _check_offset("past_length", past_length)
    _check_t5_buckets(bidirectional, weight.shape[0], max_distance, buckets_name="weight.shape[0] (num_buckets)")
    # The bias depends on j - (past + i) only: bucket each of the Q + K - 1 distances once (the same
    # function, so the same buckets as upstream), then spread the per-distance values over [Q, K].
    device = weight.device
    if relative_position is not None:  # explicit positions: the bias per clipped distance, read for each pair
        per_distance = t5_bias_by_distance(weight, bidirectional=bidirectional, max_distance=max_distance)
        s = (per_distance.shape[1] - 1) // 2  # constant beyond s on each side (t5_saturation_distance)
        index = _distances(query_length, key_length, past_length, device, relative_position).clamp(-s, s) + s
        return per_distance[:, index].unsqueeze(0)
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


@torch.compiler.assume_constant_result  # a function of its ints alone: traced (torch.compile), a constant
def t5_saturation_distance(bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128) -> int:
    """The smallest ``s`` from which every distance ``|d| >= s`` (on a side) falls in that side's last bucket.

    Buckets grow with ``|d|`` and the last one is reached by ``max_distance`` at the latest, so
    T5's bias is constant per head and side beyond ``s - 1``.

    Returns:
        ``s``, an int >= 1.

    Reference: upstream buckets (``tests/test_bias_band.py``).
    """
    _check_t5_buckets(bidirectional, num_buckets, max_distance)
    distances = torch.arange(max_distance + 1)
    buckets = t5_relative_position_bucket(-distances, bidirectional, num_buckets, max_distance)
    return int((buckets != buckets[-1]).nonzero().max()) + 1


def t5_bias_by_distance(weight: torch.Tensor, *, bidirectional: bool = True, max_distance: int = 128) -> torch.Tensor:
    """T5's bias per clipped distance: column ``s + d`` holds the bias of ``d = j - i`` for ``d = -s .. s``.

    ``s`` = :func:`t5_saturation_distance`; columns ``0`` and ``2s`` hold the bias of every farther
    distance on their side. The input :func:`saturating_bias_attention` takes.

    Args:
        weight: ``[num_buckets, H]``; bidirectional, max_distance: T5's configuration.

    Returns:
        ``[H, 2s+1]``.
    """
    _check_tensor("weight", weight, 2, "[num_buckets, heads]")
    s = t5_saturation_distance(bidirectional, weight.shape[0], max_distance)
    distances = torch.arange(-s, s + 1, device=weight.device)
    buckets = t5_relative_position_bucket(distances, bidirectional, weight.shape[0], max_distance)
    return F.embedding(buckets, weight).t()


# ----------------------------------------------------------------------------------
# Sinusoidal embeddings (Vaswani et al. 2017; Transformer-XL's R)
# ----------------------------------------------------------------------------------


def sinusoidal_embedding(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Transformer-XL's ``R`` (Vaswani et al. 2017 frequencies): ``[sin(p·f_k), cos(p·f_k)]``.

    ``f_k = 10000^(-2k/dim)`` for ``k = 0 .. dim/2-1``; the sin half first, then the cos half,
    as in the original code.

    Args:
        positions: ``[len]``; dim: even.

    Returns:
        ``[len, dim]`` in ``positions``' float dtype (float32 for integer positions).

    Reference: ``sinusoidal_ref``.
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
    relative_position: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The parameter-free bias ``B_ij = -scale · ln(1 + |j - (past_length + i)|)`` (or ``|relative_position|``:
    ``[Q, K]`` integer key minus query positions, for explicit positions).

    Returns:
        ``[Q, K]`` in ``dtype`` (default: torch's default dtype).

    Reference: ``log_decay_ref``.
    """
    query_length = _check_int("query_length", query_length)
    key_length = _check_int("key_length", key_length)
    past_length = _check_offset("past_length", past_length)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise ValueError(f"scale must be a finite number >= 0, got {scale!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    distance = _distances(query_length, key_length, past_length, device, relative_position).abs()
    dtype = dtype or torch.get_default_dtype()
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    # A scale beyond the compute dtype's range would be -inf there, and -inf * ln(1 + 0) NaN on the diagonal:
    # at its largest value the bias is already -inf (or past any score) at every distance > 0, as the scale's.
    scale = min(float(scale), torch.finfo(compute).max)
    # "+ 0.0" turns the -0.0 on the diagonal into 0.0.
    return (-scale * torch.log1p(distance.to(compute)) + 0.0).to(dtype)


def alibi_slopes(
    num_heads: int, *, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """ALiBi head slopes (Press et al. 2022, sec. 3): a geometric sequence from ``2^(-8/n)``.

    For ``n`` a power of two, ``m_h = 2^(-8h/n)``, ``h = 1 .. n``. Otherwise take the slopes of
    the largest power of two ``c < n`` and append every other slope of the ``2c`` sequence.

    Returns:
        ``[H]`` with ``H = num_heads``.

    Reference: ``alibi_slopes_ref``.
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


def alibi_bias(
    slopes: torch.Tensor, query_length: int, key_length: int, *, past_length: int = 0,
    relative_position: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """ALiBi's bias ``B[h, i, j] = -m_h · |j - (past_length + i)|``.

    Args:
        slopes: ``[H]`` (:func:`alibi_slopes`).
        relative_position: ``[Q, K]`` integer key minus query positions in place of ``j - (past_length + i)``.

    Returns:
        ``[1, H, Q, K]``.

    Reference: ``alibi_bias_ref``.
    """
    _check_tensor("slopes", slopes, 1, "[heads]")
    query_length = _check_int("query_length", query_length)
    key_length = _check_int("key_length", key_length)
    past_length = _check_offset("past_length", past_length)
    distance = _distances(query_length, key_length, past_length, slopes.device, relative_position).abs()
    compute = torch.float64 if slopes.dtype == torch.float64 else torch.float32
    bias = -slopes.to(compute)[:, None, None] * distance.to(compute) + 0.0
    return bias.to(slopes.dtype).unsqueeze(0)


def alibi_key_bias(slopes: torch.Tensor, key_length: int) -> torch.Tensor:
    """ALiBi's causal bias as a bias per key: ``m_h · (j - (K - 1))``.

    For a query at ``i`` and keys ``j <= i``, ``-m_h (i - j) = m_h (j - (K-1)) - m_h (i - (K-1))``, and the
    last term is constant along the query's row, which softmax ignores. Measured from the last key,
    so the most recent keys carry the smallest values. :func:`causal_key_bias_attention` takes it.

    Args:
        slopes: ``[H]``; key_length: ``K``.

    Returns:
        ``[H, K]``.

    Reference: ``alibi_causal_oracle`` in ``tests/test_key_bias.py``.
    """
    _check_tensor("slopes", slopes, 1, "[heads]")
    key_length = _check_int("key_length", key_length)
    compute = torch.float64 if slopes.dtype == torch.float64 else torch.float32
    j = torch.arange(key_length, device=slopes.device, dtype=compute)
    return (slopes.to(compute)[:, None] * (j - (key_length - 1)) + 0.0).to(slopes.dtype)


# ----------------------------------------------------------------------------------
# The Forgetting Transformer (Lin et al. 2025)
# ----------------------------------------------------------------------------------


def _fox_cumsum(log_forget: torch.Tensor) -> torch.Tensor:
    """``c = cumsum(log f)`` in float64 (float32 where the device has no float64): its differences stay exact."""
    _check_tensor("log_forget", log_forget, 3, "[batch, heads, k_len]")
    wide = torch.float32 if log_forget.device.type == "mps" else torch.float64
    return torch.cumsum(log_forget.to(wide), dim=-1)


def fox_key_bias(log_forget: torch.Tensor) -> torch.Tensor:
    """FoX's causal bias as a bias per key: ``-c_j`` with ``c = cumsum(log f)`` over the keys.

    Lin et al. 2025, eq. (3)-(4): query ``i`` scores key ``j <= i`` with ``q_i·k_j + D_ij``,
    ``D_ij = Σ_{l=j+1..i} log f_l = c_i - c_j``; ``c_i`` is constant along the query's row, which softmax
    ignores, so the term is ``-c_j``, one value per key. :func:`causal_key_bias_attention` takes it (with
    ``span=kernels_relpos.KEY_BIAS_SPAN``: a strongly forgetting gate moves ``c`` fast).

    Args:
        log_forget: ``[B, H, K]``, ``log f_t = logsigmoid(w_f · x_t + b_f)`` of each key's token.

    Returns:
        ``[B, H, K]`` in float64 (float32 on MPS), differentiable.

    Reference: ``fox_oracle`` in ``tests/test_fox.py`` (the explicit sum over ``l``).
    """
    return -_fox_cumsum(log_forget)


def fox_bias(log_forget: torch.Tensor, query_length: int, *, past_length: int = 0) -> torch.Tensor:
    """FoX's bias ``D[b, h, i, j] = c_{past_length + i} - c_j``, ``c = cumsum(log f)`` over the keys.

    Lin et al. 2025, eq. (3)-(4): ``D_ij = Σ_{l=j+1..i} log f_l``, for cached, masked and half-precision
    calls (the per-key form needs self-attention of a fresh forward). Entries with ``j > past_length + i``
    (causally masked) hold ``-D_ji``: the caller masks them.

    Args:
        log_forget: ``[B, H, K]`` over all keys (cached and new); query ``i`` is key ``past_length + i``.
        query_length: ``Q``; past_length: an int, or a static cache's traced offset.

    Returns:
        ``[B, H, Q, K]`` in float64 (float32 on MPS), differentiable.

    Reference: ``fox_oracle`` in ``tests/test_fox.py``.
    """
    query_length = _check_int("query_length", query_length)
    past_length = _check_offset("past_length", past_length)
    c = _fox_cumsum(log_forget)
    rows = torch.arange(query_length, device=c.device) + past_length
    rows = rows.clamp(max=c.shape[-1] - 1)  # a static cache's query always has its own slot; keep traced reads in range
    return c[..., rows, None] - c[..., None, :]


def fox_query_key_bias(log_forget: torch.Tensor, query_length: int, *, past_length: int = 0) -> torch.Tensor:
    """FoX's bias as a term per query plus one per key: ``[B, H, 2, Q + K]`` float32 holding ``c_{past_length + i}``
    for the ``Q`` queries, then ``-c_j`` for the ``K`` keys, each as a high part (``[..., 0, :]``, its float32
    rounding) and a low part (``[..., 1, :]``, the rest), with ``c = cumsum(log f)`` in float64 as in ``fox_bias``,
    whose ``D[b, h, i, j]`` is their sum (Lin et al. 2025, eq. (3)-(4)). Summed high with high and low with low,
    they keep the difference's digits where ``c_i`` and ``c_j`` are large and close. FlexAttention's score form
    "query_key"."""
    query_length = _check_int("query_length", query_length)
    past_length = _check_offset("past_length", past_length)
    c = _fox_cumsum(log_forget)
    rows = (torch.arange(query_length, device=c.device) + past_length).clamp(max=c.shape[-1] - 1)
    terms = torch.cat([c[..., rows], -c], dim=-1)
    high = terms.float()
    return torch.stack([high, (terms - high.to(terms.dtype)).float()], dim=-2)


# ----------------------------------------------------------------------------------
# Learned biases of the distance: KERPLE (Chi et al. 2022), FIRE (Li et al. 2024)
# ----------------------------------------------------------------------------------


def kerple_log_bias(
    r1: torch.Tensor, r2: torch.Tensor, query_length: int, key_length: int, *, past_length: int = 0,
    relative_position: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """KERPLE's logarithmic kernel ``B[h, i, j] = -r1_h · ln(1 + r2_h · |j - (past_length + i)|)``.

    Chi et al. 2022, the "log" variant of their conditionally positive definite kernels. The fixed
    log-decay bias is the case ``r1 = scale``, ``r2 = 1``.

    Args:
        r1, r2: ``[H]``, positive.
        relative_position: ``[Q, K]`` integer key minus query positions in place of ``j - (past_length + i)``.

    Returns:
        ``[1, H, Q, K]``.

    Reference: ``kerple_log_ref``.
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
    distance = _distances(query_length, key_length, past_length, r1.device, relative_position).abs()
    compute = torch.float64 if r1.dtype == torch.float64 else torch.float32
    bias = -r1.to(compute)[:, None, None] * torch.log1p(r2.to(compute)[:, None, None] * distance.to(compute)) + 0.0
    return bias.to(r1.dtype).unsqueeze(0)


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
    relative_position: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """FIRE (Li et al. 2024, its bias with a learned threshold): ``B[h, i, j] = f(ψ(i' - j) / ψ(max(L, p_i)))_h``.

    ``i' = past_length + i`` is the query's index among the keys (distances are ``i' - j``); ``p_i`` its
    position in its sequence, which differs from ``i'`` when keys were dropped (a sliding window), in
    packed rows or after left padding; ``ψ(x) = ln(1 + |c·x|)`` the log transform with a learned ``c``;
    ``L = threshold`` the learned length below which the normaliser stays ``ψ(L)`` (progressive
    interpolation beyond it); ``f(x) = w2·relu(w1·x + b1) + b2`` the learned MLP. ``eps`` keeps
    ``ψ(max(L, p_i))`` away from 0, as the paper's code does. Meant for causal attention (``j <= p_i``).

    Args:
        w1, b1, w2, b2: an ``nn.Linear`` pair's weights, ``[width, 1]``, ``[width]``, ``[H, width]``, ``[H]``.
        c, threshold: 0-d.
        positions: ``[B|1, Q]``, the ``p_i`` (default ``i'``).
        relative_position: ``[Q, K]`` integer ``j - i'`` for each pair (explicit positions: packed requests of a
            paged cache), in place of ``j - (past_length + i)``.

    Returns:
        ``[B|1, H, Q, K]``.

    Note:
        The MLP runs over blocks of query rows (:func:`kernels_relpos.fire_mlp`), each recomputed in backward,
        so its ``[rows, K, width]`` hidden layer is never whole.

    Reference: ``fire_torch_ref``.
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
    distance = _distances(query_length, key_length, past_length, device, relative_position).to(compute)
    x = psi(distance) / normaliser[:, :, None]  # [B|1, Q, K]: |i' - j| through ψ's absolute value
    weights = [t.to(compute) for t in (w1, b1, w2, b2)]
    if fire_mlp_applies():
        bias = fire_mlp(x, *weights)  # [B|1, Q, K, H]
    else:  # the same MLP over all rows at once
        bias = F.linear(F.relu(F.linear(x[..., None], weights[0], weights[1])), weights[2], weights[3])
    return bias.permute(0, 3, 1, 2).to(w1.dtype)
