"""The TransfoXL reference fixtures (tests/fixtures/transfo_xl, made by scripts/transfo_xl_golden.py with
Transformers 4.35.2) hold what issue 39's conversion is checked against: these tests pin the facts it relies on,
with float64 oracles written from the Transformer-XL paper (Dai et al. 2019, section 3.2: memory = the previous
segment's layer inputs, SG(.) = detached) and the adaptive input / adaptive softmax papers (Baevski & Auli 2019:
per-cluster embeddings of size d / div_val**i projected to d and scaled by sqrt(d); Grave et al. 2017, eq. 3:
log p(w) = log p(head cluster) + log p(w | cluster))."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).parent / "fixtures" / "transfo_xl"
CASES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


# Saved by TransfoXL as a .bin state dict (tied copies included), committed as safetensors (no pickle in the
# repository) and written back as a .bin here, read as a converter reads one: tensors only, weights_only=True.
BIN_CASES = {"wt103_shape"}


def load_case(name: str):
    folder = FIXTURES / name
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    if name in BIN_CASES:
        buffer = io.BytesIO()
        torch.save(weights, buffer)
        buffer.seek(0)
        weights = torch.load(buffer, map_location="cpu", weights_only=True)
    return config, {k: v.double() for k, v in weights.items()}, load_file(str(folder / "reference.safetensors"))


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


@pytest.mark.parametrize("case", CASES)
def test_the_fixture_is_a_transfo_xl_folder_of_4_35_2(case):
    config, weights, reference = load_case(case)
    assert config["model_type"] == "transfo-xl" and config["transformers_version"] == "4.35.2"
    assert json.loads((FIXTURES / "versions.json").read_text())["transformers"] == "4.35.2"
    ids = reference["input_ids"]
    assert ids.shape == (3, 2, 5) and int(ids.max()) < config["vocab_size"]
    for s in range(3):
        # log-probabilities: each row sums to 1, and they depend on the segment (memory and input)
        assert reference[f"s{s}.log_probs"].double().logsumexp(-1).abs().max() < 1e-5
    assert not torch.allclose(reference["s0.log_probs"], reference["zero_start.log_probs"], atol=1e-3)
    assert len([k for k in weights if k.endswith("r_w_bias")]) >= 1


@pytest.mark.parametrize("case", CASES)
def test_the_memory_is_each_layers_input_and_keeps_the_last_mem_len(case):
    """Dai et al. 3.2: layer 0's memory is the embedded tokens (no dropout: 0 here); the memory after segment s is
    the last mem_len of (memory before, this segment), starting empty (the authors' start)."""
    config, weights, reference = load_case(case)
    ids, length, memory = reference["input_ids"], 5, 0
    embedded = [adaptive_embedding(config, weights, ids[s]).transpose(0, 1) for s in range(3)]  # time-major
    for s in range(3):
        memory = min(config["mem_len"], memory + length)
        layer0 = reference[f"s{s}.mems.0"].double()
        assert layer0.shape == (memory, 2, config["d_model"])
        expected = torch.cat(embedded[: s + 1])[-memory:]
        assert torch.allclose(layer0, expected, rtol=1e-5, atol=1e-5), (layer0 - expected).abs().max()
        assert all(reference[f"s{s}.mems.{n}"].shape[0] == memory for n in range(config["n_layer"]))


@pytest.mark.parametrize("case", CASES)
def test_the_losses_are_the_shifted_negative_log_probabilities_grouped_by_cluster(case):
    """TransfoXL's labelled forward: the NLL of token t+1 at position t, and the loss their mean. Its ``losses``
    come out grouped by the target's cluster (the head's targets first, each group in position order: the adaptive
    softmax's ``keep_order=False``), not in position order: the port must say which order it returns."""
    config, _, reference = load_case(case)
    ids = reference["input_ids"]
    edges = torch.tensor([0, *config["cutoffs"], config["vocab_size"]])
    for s in range(3):
        log_probs = reference[f"s{s}.log_probs"].double()
        targets = ids[s][:, 1:].long()
        nll = -log_probs[:, :-1].gather(-1, targets[..., None])[..., 0]
        cluster = torch.bucketize(targets.flatten(), edges[1:-1], right=True)
        order = torch.sort(cluster, stable=True).indices
        assert torch.allclose(reference[f"s{s}.losses"].double().flatten(), nll.flatten()[order], atol=1e-4)
        assert reference[f"s{s}.loss"].item() == pytest.approx(nll.mean().item(), abs=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_the_adaptive_softmax_oracle_gives_transfo_xls_log_probabilities(case):
    """The float64 oracle over the last layer's output gives TransfoXL's log-probabilities on every segment (so it
    can check the port's head), and a tied checkpoint does not save its output tables twice."""
    config, weights, reference = load_case(case)
    for s in range(3):
        log_probs = adaptive_log_softmax(config, weights, reference[f"s{s}.last_hidden"].double())
        assert log_probs.logsumexp(-1).abs().max() < 1e-12
        expected = reference[f"s{s}.log_probs"].double()
        assert torch.allclose(log_probs, expected, rtol=1e-5, atol=1e-4), (log_probs - expected).abs().max()
    if case not in BIN_CASES and config["div_val"] > 1:  # .bin files keep tied copies
        assert config.get("tie_word_embeddings", True) == ("crit.out_layers.1.weight" not in weights)


def adaptive_modules(config: dict, weights: dict, dtype=torch.float32):
    """hf_relpos's AdaptiveEmbedding and ProjectedAdaptiveLogSoftmax with the fixture's weights, tied tables and
    projections read from the embedding as TransfoXL ties them."""
    from hf_relpos.adaptive_softmax import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax

    sizes = (config["vocab_size"], config["d_model"], config["d_embed"], config["cutoffs"], config["div_val"])
    embedding, head = AdaptiveEmbedding(*sizes), ProjectedAdaptiveLogSoftmax(*sizes)
    one = config["div_val"] == 1
    state, sources = {}, {}
    for key, value in weights.items():
        if key.startswith("transformer.word_emb.emb_layers."):
            state[("emb", key[len("transformer.word_emb."):])] = value
        elif key.startswith("transformer.word_emb.emb_projs."):
            state[("emb", key[len("transformer.word_emb."):] + ".weight")] = value
    tied = config.get("tie_word_embeddings", True)
    for i in range(len(head.out_layers)):
        name = f"crit.out_layers.{i}.weight"
        sources[f"out_layers.{i}.weight"] = (
            f"transformer.word_emb.emb_layers.{i}.weight" if tied or name not in weights else name)
        sources[f"out_layers.{i}.bias"] = f"crit.out_layers.{i}.bias"
    for i in head.out_projs:
        source = f"crit.out_projs.{i}"
        if config["tie_projs"][int(i)]:
            source = f"transformer.word_emb.emb_projs.{0 if one else i}"
        sources[f"out_projs.{i}.weight"] = source
    for name in ("cluster_weight", "cluster_bias"):
        if f"crit.{name}" in weights:
            sources[name] = f"crit.{name}"
    state.update({("head", name): weights[source] for name, source in sources.items()})
    for module, which in ((embedding, "emb"), (head, "head")):
        mine = {name: value.to(dtype) for (owner, name), value in state.items() if owner == which}
        module.load_state_dict(mine, strict=True)
        module.to(dtype)
    return embedding, head, sources


@pytest.mark.parametrize("case", CASES)
def test_hf_relpos_adaptive_modules_give_transfo_xls_embeddings_and_log_probs(case):
    """hf_relpos/adaptive_softmax.py in float32 against TransfoXL's own float32 outputs: the embedding is layer 0's
    memory (the embedded input), the log-probabilities those of the last hidden state, on every segment."""
    config, weights, reference = load_case(case)
    embedding, head, _ = adaptive_modules(config, weights)
    ids = reference["input_ids"]
    with torch.no_grad():
        first = embedding(ids[0]).transpose(0, 1)  # time-major, as TransfoXL keeps its memory
        memory = reference["s0.mems.0"]
        torch.testing.assert_close(first[-memory.shape[0]:], memory, rtol=1e-5, atol=1e-5)
        for s in range(3):
            log_probs = head(reference[f"s{s}.last_hidden"])
            torch.testing.assert_close(log_probs, reference[f"s{s}.log_probs"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_hf_relpos_adaptive_modules_match_the_float64_oracle_values_and_gradients(case):
    """Against the oracles written from the papers above, in float64: values, and the gradients of a random
    weighting of the outputs with respect to the input hidden state and every parameter."""
    config, weights, reference = load_case(case)
    embedding, head, sources = adaptive_modules(config, weights, torch.float64)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, config["d_model"], dtype=torch.float64, generator=generator, requires_grad=True)
    weighting = torch.randn(2, 5, config["vocab_size"], dtype=torch.float64, generator=generator)
    (head(hidden) * weighting).sum().backward()
    mine = {name: p.grad.clone() for name, p in head.named_parameters()}
    mine_hidden = hidden.grad.clone()

    oracle_weights = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
    hidden_oracle = hidden.detach().clone().requires_grad_(True)
    log_probs = adaptive_log_softmax(config, oracle_weights, hidden_oracle)
    torch.testing.assert_close(head(hidden.detach()), log_probs.detach(), rtol=1e-12, atol=1e-12)
    (log_probs * weighting).sum().backward()
    torch.testing.assert_close(mine_hidden, hidden_oracle.grad, rtol=1e-10, atol=1e-10)
    # each parameter's gradient is the oracle's for the weight it was loaded from (only the head ran, so a tied
    # table's or projection's whole gradient is the head's)
    # (projections tied to one embedding projection share it: their gradients add up there)
    assert set(mine) == set(sources)
    for source in set(sources.values()):
        total = sum(mine[name] for name, origin in sources.items() if origin == source)
        torch.testing.assert_close(total, oracle_weights[source].grad, rtol=1e-10, atol=1e-10, msg=source)

    ids = reference["input_ids"][0]
    ids_grad_check = embedding(ids)
    expected = adaptive_embedding(config, weights, ids)
    torch.testing.assert_close(ids_grad_check.detach(), expected, rtol=1e-12, atol=1e-12)


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


@pytest.mark.parametrize("case", CASES)
def test_the_float64_transformer_xl_oracle_gives_transfo_xls_three_segments(case):
    """The paper's Transformer-XL in float64 (above) reproduces TransfoXL 4.35.2 on every segment, from empty
    memories: the log-probabilities and every layer's memory. It is the oracle the port is checked against; its
    one reading of the code is the same_length window (each query sees mem_len keys, itself included)."""
    config, weights, reference = load_case(case)
    mems = [torch.zeros(2, 0, config["d_model"], dtype=torch.float64) for _ in range(config["n_layer"])]
    for s in range(3):
        log_probs, mems = transfo_xl_reference(config, weights, reference["input_ids"][s], mems)
        torch.testing.assert_close(log_probs, reference[f"s{s}.log_probs"].double(), rtol=1e-5, atol=1e-5)
        for layer, memory in enumerate(mems):
            torch.testing.assert_close(memory.transpose(0, 1), reference[f"s{s}.mems.{layer}"].double(),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_transfo_xls_own_first_segment_is_mem_len_zero_vectors(case):
    """TransfoXL's default first segment (``mems=None``) attends to ``mem_len`` zero vectors per layer, which the
    authors' code did not have: the oracle given those zeros as memory reproduces it (how to get the port's start)."""
    config, weights, reference = load_case(case)
    zeros = [torch.zeros(2, config["mem_len"], config["d_model"], dtype=torch.float64)
             for _ in range(config["n_layer"])]
    log_probs, _ = transfo_xl_reference(config, weights, reference["input_ids"][0], zeros)
    torch.testing.assert_close(log_probs, reference["zero_start.log_probs"].double(), rtol=1e-5, atol=1e-5)
