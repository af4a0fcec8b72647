"""Transformer-XL's per-layer position parameters (Dai et al. 2019, sec. 3.3): ``W_{k,R}`` (``r_net``), ``u``
(``r_w_bias``) and ``v`` (``r_r_bias``), with the inference cache of ``W_{k,R} R_d`` that lets a decoding step read
its slice instead of projecting every sinusoid again; and the distances (``RelativeDistances``) the scheme
(``position_schemes_relpos.TransformerXLScheme``) hands them once per forward."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from transformers import initialization as init

from .configuration_relpos import RelPosConfig
from .functional_relpos import sinusoidal_embedding


@dataclass
class _Kept:
    """Inference's kept projections: ``table`` ``[H, top - low + 1, D]``, ``W_{k,R} R_d`` for ``d = top .. low``
    (descending), made with ``weights`` (copies) on ``device`` in ``dtype``. Rows below ``floor`` are zeros, not
    projections: the distances there belonged to masked slots only (a static cache's unfilled ones).
    ``bounds``: ``[top, floor]`` as a tensor, which a traced step reads without a guard on their values."""

    weights: list
    device: torch.device
    dtype: torch.dtype
    top: int
    low: int
    floor: int
    table: torch.Tensor
    bounds: torch.Tensor


class TransformerXLRelative(nn.Module):
    """One layer's ``W_{k,R}`` (``r_net``) and global biases ``u`` (``r_w_bias``), ``v`` (``r_r_bias``)."""

    def __init__(self, config: RelPosConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.r_net = nn.Linear(config.hidden_size, config.num_attention_heads * config.head_dim, bias=False)
        self.r_w_bias = nn.Parameter(torch.zeros(config.num_attention_heads, config.head_dim))
        self.r_r_bias = nn.Parameter(torch.zeros(config.num_attention_heads, config.head_dim))
        self._projected: Optional[_Kept] = None  # inference only

    def init_position_weights(self, std: float) -> None:
        """``_init_weights``: ``u`` and ``v`` N(0, std) (``r_net`` is a Linear, initialised as the others)."""
        init.normal_(self.r_w_bias, mean=0.0, std=std)
        init.normal_(self.r_r_bias, mean=0.0, std=std)

    def train(self, mode: bool = True):
        self._projected = None
        return super().train(mode)

    def _load_from_state_dict(self, *args, **kwargs):
        self._projected = None  # other weights, loaded in place
        return super()._load_from_state_dict(*args, **kwargs)

    def _project(self, distances: torch.Tensor, dtype, sinusoid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``W_{k,R} R_d`` per head: ``[H, len(distances), D]`` (``sinusoid``: ``R`` already made, and dropped)."""
        if sinusoid is None:
            sinusoid = sinusoidal_embedding(distances, self.hidden_size)
        r = self.r_net(sinusoid.to(dtype))
        # shape[0], not len(): len() of a traced length would fix it to the traced value
        return r.view(distances.shape[0], self.num_heads, self.head_dim).transpose(0, 1).contiguous()

    def forward(self, distances: "RelativeDistances", dtype):
        """``W_{k,R} R_d`` for each distance (``[H, R, D]``), ``u`` and ``v``.

        In inference the projections of a range of distances are kept, highest distance first, and
        reused: a decoding step reads the slice for ``K-1 .. 0`` (a view, no copy) instead of
        projecting ``K`` sinusoids again (an ``O(K·hidden²)`` matmul per layer and token). The
        range doubles when exceeded; a static cache's prefill covers every distance its later steps reach. The kept
        projections are dropped by every forward with gradients, every ``train()``/``eval()`` switch and
        ``load_state_dict``, and rebuilt unless ``r_net``'s weights equal, value for value, a copy taken with them:
        an update through ``.data``, a fused optimizer or a merged adapter changes no version counter that could be
        trusted instead. A traced static-cache step (``_traced``) makes the same check in its graph.
        """
        kept = distances.sinusoid is None  # a dropped R is this forward's alone
        if torch.compiler.is_compiling():
            return self._traced(distances, dtype, kept), self.r_w_bias, self.r_r_bias
        weights = [p.detach() for p in self.r_net.parameters()]
        # Weights offloaded by accelerate sit on the meta device outside r_net's own forward: nothing to compare.
        if torch.is_grad_enabled() or any(w.is_meta for w in weights) or not kept:
            self._projected = None
            return self._project(distances.values, dtype, distances.sinusoid), self.r_w_bias, self.r_r_bias
        device = distances.values.device
        cached = self._projected
        valid = cached is not None and self._same(cached.weights, weights) and (cached.device, cached.dtype) == (
            device, dtype)
        # The view spans low .. high; distances below the reach belong to masked slots alone (zero rows); a static
        # cache's prefill also covers the distances its later (compiled) steps reach.
        high, low = max(distances.high, distances.reach[1]), distances.low
        floor = max(low, distances.reach[0])
        if not valid or high > cached.top or low < cached.low or floor < cached.floor:
            if valid:  # a growing cache doubles its range; a static cache's reach is already all it will need
                high = max(2 * distances.high, distances.reach[1], cached.top)
                low, floor = min(low, cached.low), min(floor, cached.floor)
            table = torch.zeros(self.num_heads, high - low + 1, self.head_dim, device=device, dtype=dtype)
            table[:, : high - floor + 1] = self._project(torch.arange(high, floor - 1, -1, device=device), dtype)
            bounds = torch.tensor([high, floor], device=device)
            cached = self._projected = _Kept([w.clone() for w in weights], device, dtype, high, low, floor, table,
                                             bounds)
        top, table = cached.top, cached.table
        if distances.consecutive:
            return table[:, top - distances.high : top - distances.low + 1], self.r_w_bias, self.r_r_bias
        return table[:, top - distances.values], self.r_w_bias, self.r_r_bias

    def _traced(self, distances: "RelativeDistances", dtype, kept: bool) -> torch.Tensor:
        """``W_{k,R} R_d`` in a trace. A static cache's step (its offset a tensor: ``high`` unknown) gathers the
        kept projections where, checked in the graph (``torch.cond``: the trace reads no value on the host), they
        were made with these very weights and cover every distance the step reaches; else, and everywhere else
        (with gradients, while exporting: a program holds no table), it projects them."""
        cached = self._projected
        values = distances.values
        if (torch.is_grad_enabled() or not kept or distances.high is not None or torch.compiler.is_exporting()
                or cached is None or (cached.device, cached.dtype) != (values.device, dtype)):
            return self._project(values, dtype, distances.sinusoid)
        low, high = distances.reach
        weights = list(self.r_net.parameters())
        usable = (cached.bounds[0] >= high) & (cached.bounds[1] <= low)
        for weight, copy in zip(weights, cached.weights, strict=True):
            usable = usable & (weight == copy).all()

        def gather(table, bounds, values):
            # Slots outside the reach (a static cache's unfilled ones) are masked: any row of the table will do.
            return table[:, (bounds[0] - values).clamp(0, table.shape[1] - 1)]

        def project(table, bounds, values):
            return self._project(values, dtype)

        return torch.cond(usable, gather, project, (cached.table, cached.bounds, values))

    @staticmethod
    def _same(kept: list, weights: list) -> bool:
        """The weights the projections were made with, bit for bit: ``O(hidden²)``, on CPU by numpy (as long as
        one matrix-vector product with them; ``torch.equal`` takes 3-5 times longer there)."""

        def words(t):  # the raw bytes, as int64 words where size and alignment allow
            t = t.reshape(-1)
            whole = t.storage_offset() * t.element_size() % 8 == 0 and t.numel() * t.element_size() % 8 == 0
            return t.view(torch.uint8).view(torch.int64) if whole else t.view(torch.uint8)

        def host(t):
            # A numpy view of the memory, not Tensor.numpy(): that marks the storage non-resizable for good, and
            # FSDP2 frees a layer's gathered weights after its forward by resizing their storage to 0.
            ctype = ctypes.c_int64 if t.dtype == torch.int64 else ctypes.c_uint8
            return np.ctypeslib.as_array((ctype * t.numel()).from_address(t.data_ptr()))

        def same(k, w):
            if k.shape != w.shape or k.dtype != w.dtype or k.device != w.device:
                return False
            if w.device.type == "cpu":
                k, w = words(k), words(w)  # kept alive while numpy reads their memory
                return k.numel() == 0 or bool(np.array_equal(host(k), host(w)))
            return torch.equal(words(k), words(w))

        return len(kept) == len(weights) and all(same(k, w) for k, w in zip(kept, weights))


@dataclass
class RelativeDistances:
    """Transformer-XL's distances ``K-1, K-2, ...`` (clamped), with their range known without a sync."""

    values: torch.Tensor
    low: Optional[int]  # None in a traced static cache, whose offset is not known on the host
    high: Optional[int]
    # The lowest and highest distance an unmasked pair of this forward can have, known from the shapes alone: a
    # static cache's prefill builds the kept projections over it for the decoding steps that follow.
    reach: tuple = (0, 0)
    # Training with dropout_placement="transfo_xl": the sinusoids R of ``values``, dropped once for all layers
    # (Dai et al.'s ``pos_emb = self.drop(pos_emb)``); None otherwise (each layer computes and may keep its own).
    sinusoid: Optional[torch.Tensor] = None

    @property
    def consecutive(self) -> bool:
        """``values`` is ``high, high-1, .., low`` (nothing clamped)."""
        return len(self.values) == self.high - self.low + 1
