"""A float64 Transformer-XL with adaptive input and softmax over a TransfoXL state dict (Transformers 4.x key names),
written from the papers, not from hf_relpos' model: Dai et al. 2019 (section 3.3; memory = the previous segment's
layer inputs, SG(.) = detached), Baevski & Auli 2019 (per-cluster embeddings of size d / div_val**i projected to d
and scaled by sqrt(d)) and Grave et al. 2017 (eq. 3: log p(w) = log p(head cluster) + log p(w | cluster)).

``from_transfo_xl`` checks each conversion against it; tests/test_transfo_xl_fixtures.py pins it against
Transformers 4.35.2's own outputs (tests/fixtures/transfo_xl). Slow and memory-hungry by design: one einsum per
term, every distance's sinusoid projected per query and key.
"""

from __future__ import annotations

import math

import torch


def clusters(config: dict) -> list:
    edges = [0, *config["cutoffs"], config["vocab_size"]]
    return list(zip(edges[:-1], edges[1:]))


def adaptive_embedding(config: dict, weights: dict, ids: torch.Tensor) -> torch.Tensor:
    """Baevski & Auli's adaptive input: token t of cluster i -> E_i[t - l_i] P_i^T * sqrt(d_model), with d_i =
    d_embed / div_val**i; div_val 1 is one table of d_embed, projected only where d_embed != d_model."""
    d_model = config["d_model"]
    out = torch.zeros(*ids.shape, d_model, dtype=torch.float64)
    if config["div_val"] == 1:
        table = weights["transformer.word_emb.emb_layers.0.weight"][ids]
        projection = weights.get("transformer.word_emb.emb_projs.0")
        out = table if projection is None else table @ projection.T
    else:
        for i, (low, high) in enumerate(clusters(config)):
            inside = (ids >= low) & (ids < high)
            table = weights[f"transformer.word_emb.emb_layers.{i}.weight"]
            rows = table[(ids[inside] - low)] @ weights[f"transformer.word_emb.emb_projs.{i}"].T
            out[inside] = rows
    return out * math.sqrt(d_model)


def adaptive_log_softmax(config: dict, weights: dict, hidden: torch.Tensor) -> torch.Tensor:
    """Grave et al.'s adaptive softmax (eq. 3) as TransfoXL projects it: cluster i's logits are (h P_i) W_i^T + b_i;
    the head scores the shortlist and one entry per tail cluster (the cluster weights), and log p(w in tail i) =
    log p_head(i) + log p_i(w). div_val 1 has one output table (sliced per cluster) and a projection per cluster;
    tied tables and projections are read from the embedding (``tie_word_embeddings``, ``tie_projs``)."""
    parts, one = clusters(config), config["div_val"] == 1
    tied_tables = config.get("tie_word_embeddings", True)

    def table(i):
        key = f"crit.out_layers.{0 if one else i}.weight"
        if tied_tables or key not in weights:
            key = f"transformer.word_emb.emb_layers.{0 if one else i}.weight"
        w, b = weights[key], weights[f"crit.out_layers.{0 if one else i}.bias"]
        return (w[parts[i][0] : parts[i][1]], b[parts[i][0] : parts[i][1]]) if one else (w, b)

    def projected(i):
        key = f"crit.out_projs.{i}"
        if config["tie_projs"][i]:
            key = f"transformer.word_emb.emb_projs.{0 if one else i}"
        p = weights.get(key)
        return hidden if p is None else hidden @ p

    w, b = table(0)
    if len(parts) > 1:
        w, b = torch.cat([w, weights["crit.cluster_weight"]]), torch.cat([b, weights["crit.cluster_bias"]])
    head = (projected(0) @ w.T + b).log_softmax(-1)
    shortlist = parts[0][1]
    out = [head[..., :shortlist]]
    for i in range(1, len(parts)):
        w, b = table(i)
        out.append(head[..., shortlist + i - 1 : shortlist + i] + (projected(i) @ w.T + b).log_softmax(-1))
    return torch.cat(out, -1)


def transfo_xl_reference(config: dict, weights: dict, ids: torch.Tensor, mems: list) -> tuple:
    """Transformer-XL's forward in float64, written from Dai et al. 2019 (section 3.3): for each layer, the keys
    and values come from [SG(memory), h]; the score of query i (absolute position M + i) and key j is
    ``(q_i + u) k_j + (q_i + v) W_r R(min(M + i - j, clamp_len))``, scaled by 1/sqrt(d_head), over the keys with
    j <= M + i (and, with ``same_length``, M + i - j < mem_len); R is the sinusoid [sin, cos] of the distance;
    post-norm ``LN(h + attention)`` then ``LN(o + FF(o))`` (pre-norm: ``h + attention(LN([memory, h]))`` and
    ``o + FF(LN(o))``); no final norm; the adaptive softmax of the last layer. ``mems``: each layer's input of the
    segments before (batch-major), the new ones keep the last ``mem_len``."""
    d_model, heads, d_head = config["d_model"], config["n_head"], config["d_head"]
    eps, pre = config["layer_norm_epsilon"], config["pre_lnorm"]
    h = adaptive_embedding(config, weights, ids)
    batch, length, _ = h.shape
    new_mems = []

    def norm(x, prefix):
        return torch.nn.functional.layer_norm(x, (d_model,), weights[prefix + ".weight"], weights[prefix + ".bias"], eps)

    for layer in range(config["n_layer"]):
        p = f"transformer.layers.{layer}."
        memory = mems[layer]
        new_mems.append(torch.cat([memory, h], 1)[:, -config["mem_len"]:])
        context = torch.cat([memory, h], 1)
        m, keys = memory.shape[1], context.shape[1]
        attn_in = norm(context, p + "dec_attn.layer_norm") if pre else context
        q, k, v = (attn_in @ weights[p + "dec_attn.qkv_net.weight"].T).chunk(3, -1)
        q = q[:, -length:].reshape(batch, length, heads, d_head)
        k, v = (t.reshape(batch, keys, heads, d_head) for t in (k, v))
        u = weights.get(p + "dec_attn.r_w_bias", weights.get("transformer.r_w_bias"))
        w = weights.get(p + "dec_attn.r_r_bias", weights.get("transformer.r_r_bias"))
        query_pos = m + torch.arange(length)[:, None]
        distance = query_pos - torch.arange(keys)[None, :]
        visible = distance >= 0
        if config["same_length"]:
            visible &= distance < config["mem_len"]
        clamped = distance.clamp(min=0)
        if config["clamp_len"] > 0:
            clamped = clamped.clamp(max=config["clamp_len"])
        inv_freq = 1 / 10000 ** (torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
        angles = clamped[..., None].double() * inv_freq
        sinusoid = torch.cat([angles.sin(), angles.cos()], -1)  # [length, keys, d_model]
        r = (sinusoid @ weights[p + "dec_attn.r_net.weight"].T).reshape(length, keys, heads, d_head)
        scores = torch.einsum("bihd,bjhd->bhij", q + u, k) + torch.einsum("bihd,ijhd->bhij", q + w, r)
        scores = (scores / d_head**0.5).masked_fill(~visible, float("-inf"))
        attended = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v).reshape(batch, length, heads * d_head)
        out = attended @ weights[p + "dec_attn.o_net.weight"].T
        o = h + out if pre else norm(h + out, p + "dec_attn.layer_norm")
        ff_in = norm(o, p + "pos_ff.layer_norm") if pre else o
        hidden = torch.relu(ff_in @ weights[p + "pos_ff.CoreNet.0.weight"].T + weights[p + "pos_ff.CoreNet.0.bias"])
        ff = hidden @ weights[p + "pos_ff.CoreNet.3.weight"].T + weights[p + "pos_ff.CoreNet.3.bias"]
        h = o + ff if pre else norm(o + ff, p + "pos_ff.layer_norm")
    return adaptive_log_softmax(config, weights, h), new_mems
