"""The TransfoXL reference fixtures (tests/fixtures/transfo_xl, made by scripts/transfo_xl_golden.py with
Transformers 4.35.2) hold what issue 39's conversion is checked against: these tests pin the facts it relies on,
with float64 oracles written from the Transformer-XL paper (Dai et al. 2019, section 3.2: memory = the previous
segment's layer inputs, SG(.) = detached) and the adaptive input / adaptive softmax papers (Baevski & Auli 2019:
per-cluster embeddings of size d / div_val**i projected to d and scaled by sqrt(d); Grave et al. 2017, eq. 3:
log p(w) = log p(head cluster) + log p(w | cluster))."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_relpos.transfo_xl_reference import adaptive_embedding, adaptive_log_softmax, transfo_xl_reference

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
    from hf_relpos.adaptive_softmax_relpos import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax

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
    """hf_relpos/adaptive_softmax_relpos.py in float32 against TransfoXL's own float32 outputs: the embedding is layer
    0's memory (the embedded input), the log-probabilities those of the last hidden state, on every segment."""
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
