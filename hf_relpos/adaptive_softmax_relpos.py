"""Adaptive input embeddings (Baevski & Auli 2019) and the projected adaptive softmax (Grave et al. 2017), as the
released Transformer-XL uses them (Dai et al. 2019; Transformers' TransfoXL): the vocabulary is cut at ``cutoffs``
into a frequent head and tail clusters; cluster ``i`` has vectors of size ``embedding_size // div_val**i``, each
projected to ``hidden_size``.

Parameter names and shapes follow TransfoXL's (``emb_layers``, ``emb_projs``, ``out_layers``, ``out_projs``,
``cluster_weight``, ``cluster_bias``), with each projection a module of its own holding ``weight`` (so that
Transformers can tie it by name). Every cluster is computed for every token and chosen with ``torch.where``: no
tensor value is read on the host, so both trace (torch.compile, torch.export).
"""

from __future__ import annotations

import torch
from torch import nn


class AdaptiveProjection(nn.Module):
    """A bias-free projection between ``hidden_size`` and a cluster's size, stored as TransfoXL stores it:
    ``weight`` is ``[hidden_size, size]`` (the embedding maps ``e -> e W^T``, the softmax ``h -> h W``)."""

    def __init__(self, hidden_size: int, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, size))


def cluster_edges(vocab_size: int, cutoffs) -> list:
    """``[(low, high), ...]``: the head's ids, then each tail cluster's (``cutoffs`` strictly increasing, inside
    the vocabulary)."""
    edges = [0, *cutoffs, vocab_size]
    return list(zip(edges[:-1], edges[1:]))


def cluster_sizes(embedding_size: int, div_val: int, clusters: int) -> list:
    """Each cluster's vector size: ``embedding_size // div_val**i`` (Baevski & Auli, section 3)."""
    return [embedding_size // div_val**i for i in range(clusters)]


class AdaptiveEmbedding(nn.Module):
    """Baevski & Auli's adaptive input: token ``t`` of cluster ``i`` -> ``E_i[t - low_i] P_i^T * sqrt(hidden_size)``.

    With ``div_val == 1`` one table of ``embedding_size`` serves every cluster, projected only where
    ``embedding_size != hidden_size`` (TransfoXL's layout)."""

    def __init__(self, vocab_size: int, hidden_size: int, embedding_size: int, cutoffs, div_val: int):
        super().__init__()
        self.clusters = cluster_edges(vocab_size, cutoffs)
        self.hidden_size, self.div_val = hidden_size, div_val
        self.scale = hidden_size**0.5
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ModuleDict()
        if div_val == 1:
            self.emb_layers.append(nn.Embedding(vocab_size, embedding_size))
            if embedding_size != hidden_size:
                self.emb_projs["0"] = AdaptiveProjection(hidden_size, embedding_size)
        else:
            sizes = cluster_sizes(embedding_size, div_val, len(self.clusters))
            for i, ((low, high), size) in enumerate(zip(self.clusters, sizes)):
                self.emb_layers.append(nn.Embedding(high - low, size))
                self.emb_projs[str(i)] = AdaptiveProjection(hidden_size, size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.div_val == 1:
            embedded = self.emb_layers[0](input_ids)
            if "0" in self.emb_projs:
                embedded = embedded @ self.emb_projs["0"].weight.T
            return embedded * self.scale
        out = None
        for i, (low, high) in enumerate(self.clusters):
            inside = (input_ids >= low) & (input_ids < high)
            rows = self.emb_layers[i]((input_ids - low).clamp(0, high - low - 1)) @ self.emb_projs[str(i)].weight.T
            out = rows if out is None else torch.where(inside[..., None], rows, out)
        return out * self.scale


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """Grave et al.'s adaptive softmax (eq. 3) with TransfoXL's projections: cluster ``i``'s logits are
    ``(h P_i) W_i^T + b_i``; the head scores its own ids and one entry per tail cluster (``cluster_weight``,
    ``cluster_bias``), and ``log p(w) = log p_head(cluster of w) + log p_cluster(w)`` for a tail id.
    :meth:`forward` returns log-probabilities over the whole vocabulary.

    With ``div_val == 1`` one output table (``out_layers.0``) is sliced per cluster, each cluster with its own
    projection where ``embedding_size != hidden_size``; otherwise each cluster has its table and projection."""

    def __init__(self, vocab_size: int, hidden_size: int, embedding_size: int, cutoffs, div_val: int):
        super().__init__()
        self.clusters = cluster_edges(vocab_size, cutoffs)
        self.div_val = div_val
        tails = len(self.clusters) - 1
        if tails:
            self.cluster_weight = nn.Parameter(torch.empty(tails, embedding_size))
            self.cluster_bias = nn.Parameter(torch.empty(tails))
        self.out_layers = nn.ModuleList()
        self.out_projs = nn.ModuleDict()
        if div_val == 1:
            self.out_layers.append(nn.Linear(embedding_size, vocab_size))
            if embedding_size != hidden_size:
                for i in range(len(self.clusters)):
                    self.out_projs[str(i)] = AdaptiveProjection(hidden_size, embedding_size)
        else:
            sizes = cluster_sizes(embedding_size, div_val, len(self.clusters))
            for i, ((low, high), size) in enumerate(zip(self.clusters, sizes)):
                self.out_layers.append(nn.Linear(size, high - low))
                self.out_projs[str(i)] = AdaptiveProjection(hidden_size, size)

    def _table(self, i: int) -> tuple:
        if self.div_val == 1:
            low, high = self.clusters[i]
            layer = self.out_layers[0]
            return layer.weight[low:high], layer.bias[low:high]
        return self.out_layers[i].weight, self.out_layers[i].bias

    def _logits(self, hidden: torch.Tensor, i: int, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        projection = self.out_projs[str(i)] if str(i) in self.out_projs else None
        projected = hidden if projection is None else hidden @ projection.weight
        return nn.functional.linear(projected, weight, bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight, bias = self._table(0)
        if len(self.clusters) == 1:
            return self._logits(hidden, 0, weight, bias).log_softmax(-1)
        weight = torch.cat([weight, self.cluster_weight])
        bias = torch.cat([bias, self.cluster_bias])
        head = self._logits(hidden, 0, weight, bias).log_softmax(-1)
        shortlist = self.clusters[0][1]
        parts = [head[..., :shortlist]]
        for i in range(1, len(self.clusters)):
            tail = self._logits(hidden, i, *self._table(i)).log_softmax(-1)
            parts.append(head[..., shortlist + i - 1 : shortlist + i] + tail)
        return torch.cat(parts, -1)


def tied_names(clusters: int, hidden_size: int, embedding_size: int, div_val: int, tables: bool, projs) -> dict:
    """``{softmax parameter: embedding parameter}`` that TransfoXL ties: each cluster's output table to its input
    table (``tables``), each output projection flagged in ``projs`` to the input's (the one projection of a single
    table, else the cluster's own; none where a single table needs no projection)."""
    tied = {}
    if tables:
        for i in range(1 if div_val == 1 else clusters):
            tied[f"out_layers.{i}.weight"] = f"emb_layers.{i}.weight"
    if div_val == 1 and embedding_size == hidden_size:
        return tied
    for i, tie in enumerate(projs):
        if tie:
            tied[f"out_projs.{i}.weight"] = f"emb_projs.{0 if div_val == 1 else i}.weight"
    return tied

