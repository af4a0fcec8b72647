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


class TransformerXLRelative(nn.Module):
    """One layer's ``W_{k,R}`` (``r_net``) and global biases ``u`` (``r_w_bias``), ``v`` (``r_r_bias``)."""

    def __init__(self, config: RelPosConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.r_net = nn.Linear(config.hidden_size, config.num_attention_heads * config.head_dim, bias=False)
        self.r_w_bias = nn.Parameter(torch.zeros(config.num_attention_heads, config.head_dim))
        self.r_r_bias = nn.Parameter(torch.zeros(config.num_attention_heads, config.head_dim))
        self._projected = None  # inference only: (weights, device, dtype, highest distance, [H, span, D] descending)
        self.register_load_state_dict_pre_hook(lambda *args: setattr(self, "_projected", None))

    def init_position_weights(self, std: float) -> None:
        """``_init_weights``: ``u`` and ``v`` N(0, std) (``r_net`` is a Linear, initialised as the others)."""
        init.normal_(self.r_w_bias, mean=0.0, std=std)
        init.normal_(self.r_r_bias, mean=0.0, std=std)

    def train(self, mode: bool = True):
        self._projected = None
        return super().train(mode)

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
        range doubles when exceeded. The kept projections are dropped by every forward with
        gradients and every ``train()``/``eval()`` switch, and rebuilt unless ``r_net``'s weights
        equal, value for value, a copy taken with them: an update through ``.data``, a fused
        optimizer or ``load_state_dict`` changes no version counter that could be trusted instead.
        """
        kept = distances.sinusoid is None  # a dropped R is this forward's alone
        if torch.compiler.is_compiling():
            table = None if torch.is_grad_enabled() or not kept else self._table_for(distances, dtype)
            if table is None:
                return self._project(distances.values, dtype, distances.sinusoid), self.r_w_bias, self.r_r_bias
            top, projected = table
            # Slots outside the reach (a static cache's unfilled ones) are masked: any row of the table will do.
            index = (top - distances.values).clamp(0, projected.shape[1] - 1)
            return projected[:, index], self.r_w_bias, self.r_r_bias
        weights = [p.detach() for p in self.r_net.parameters()]
        # Weights offloaded by accelerate sit on the meta device outside r_net's own forward: nothing to compare.
        if torch.is_grad_enabled() or any(w.is_meta for w in weights) or not kept:
            self._projected = None
            return self._project(distances.values, dtype, distances.sinusoid), self.r_w_bias, self.r_r_bias
        device = distances.values.device
        cached = self._projected
        valid = cached is not None and self._same(cached[0], weights) and cached[1:3] == (device, dtype)
        # A static cache's prefill also makes the distances its later (compiled) steps reach.
        high, low = max(distances.high, distances.reach[1]), min(distances.low, distances.reach[0])
        if not valid or high > cached[3] or low <= cached[3] - cached[4].shape[1]:
            if valid:
                high, low = max(2 * high, cached[3]), min(low, cached[3] - cached[4].shape[1] + 1)
            projected = self._project(torch.arange(high, low - 1, -1, device=device), dtype)
            cached = ([w.clone() for w in weights], device, dtype, high, projected)
            self._projected = cached
        top, projected = cached[3], cached[4]
        if distances.consecutive:
            return projected[:, top - distances.high : top - distances.low + 1], self.r_w_bias, self.r_r_bias
        return projected[:, top - distances.values], self.r_w_bias, self.r_r_bias

    def _table_for(self, distances: "RelativeDistances", dtype):
        """In a traced step: the kept ``(highest distance, [H, span, D])`` if it covers every distance the step can
        reach, else None. Its weights are not compared (a trace reads no value on the host): the table is the one
        the last eager inference forward checked or made, as ``generate``'s eager prefill does before every
        compiled step; ``train()``, ``eval()``, a forward with gradients and ``load_state_dict`` drop it."""
        cached = self._projected
        if cached is None or cached[1:3] != (distances.values.device, dtype):
            return None
        top, projected = cached[3], cached[4]
        low, high = distances.reach
        return (top, projected) if high <= top and low > top - projected.shape[1] else None

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
