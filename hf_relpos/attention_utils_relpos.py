"""Index and mask helpers shared by the math (``functional.py``) and the fast paths (``kernels_relpos.py``).

Below both: it imports neither, so ``functional_relpos`` -> ``kernels_relpos`` -> ``attention_utils_relpos`` has no
cycle. Shapes as in ``functional_relpos.py``'s legend: ``Q`` query rows, ``K`` keys.
"""

from __future__ import annotations

from typing import Optional

import torch


def _exporting() -> bool:
    """True while ``torch.export`` (and the ONNX exporter built on it) traces: the fast paths step aside for the
    public-op reference math, since their private kernels, autograd Functions, Python loops over a length and
    host reads cannot be exported. Every ``kernels_relpos.*_applies`` predicate asks this first; eager calls pay one
    cheap Python call and keep their paths, and ``torch.compile`` (which traces those paths) keeps them too."""
    return torch.compiler.is_exporting()


def _is_zero(offset) -> bool:
    """True for the int 0; a traced tensor offset is never known to be 0, so the paths for any offset run."""
    return isinstance(offset, int) and offset == 0


def _causal_pattern(query_length: int, key_length: int, offset: int, device) -> torch.Tensor:
    """[Q, K] bool, True where key j <= offset + i (the query's own absolute position)."""
    i = torch.arange(query_length, device=device)[:, None]
    j = torch.arange(key_length, device=device)[None, :]
    return j <= i + offset


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
