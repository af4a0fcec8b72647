"""``from_transfo_xl`` against Transformers 4.35.2's TransfoXL (tests/fixtures/transfo_xl, made by
scripts/transfo_xl_golden.py): the converted model's log-probabilities, memories and loss on three consecutive
segments with memory, its gradients against the float64 reference (hf_relpos/transfo_xl_reference.py, pinned
against the same fixtures by test_transfo_xl_fixtures.py), and the architecture options it is built from."""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_relpos import RelPosConfig, RelPosForCausalLM
from hf_relpos.transfo_xl_conversion import (
    from_transfo_xl, transfo_xl_config_to_relpos, transfo_xl_state_dict_to_relpos,
)
from hf_relpos.transfo_xl_reference import transfo_xl_reference
from test_transfo_xl_fixtures import BIN_CASES, CASES, FIXTURES, load_case

TOLERANCE = dict(rtol=1e-5, atol=1e-5)  # float32 against TransfoXL's float32


def converted(case: str) -> RelPosForCausalLM:
    return from_transfo_xl(FIXTURES / case)


@pytest.mark.parametrize("case", CASES)
def test_three_segments_with_memory_give_transfo_xls_log_probs_memories_and_loss(case):
    """From the authors' empty first memory (``init_mems``), as the fixtures were made: every segment's
    log-probabilities, every layer's memory and the loss equal TransfoXL 4.35.2's."""
    config, _, reference = load_case(case)
    model = converted(case)
    mems = model.init_mems(2)
    assert all(m.shape == (2, 0, config["d_model"]) for m in mems)
    for s in range(3):
        ids = reference["input_ids"][s].long()
        with torch.no_grad():
            output = model(input_ids=ids, mems=mems, labels=ids)
        torch.testing.assert_close(output.logits, reference[f"s{s}.log_probs"], **TOLERANCE)
        for layer, memory in enumerate(output.mems):
            torch.testing.assert_close(memory.transpose(0, 1), reference[f"s{s}.mems.{layer}"], **TOLERANCE)
        torch.testing.assert_close(output.loss, reference[f"s{s}.loss"].reshape(()), **TOLERANCE)
        mems = output.mems


@pytest.mark.parametrize("case", CASES)
def test_transfo_xls_zero_vector_start_is_mem_len_zero_memories(case):
    """Transformers' TransfoXL started from mem_len zero vectors per layer: passing those as mems reproduces it."""
    config, _, reference = load_case(case)
    model = converted(case)
    zeros = [torch.zeros(2, config["mem_len"], config["d_model"])] * config["n_layer"]
    with torch.no_grad():
        output = model(input_ids=reference["input_ids"][0].long(), mems=zeros)
    torch.testing.assert_close(output.logits, reference["zero_start.log_probs"], **TOLERANCE)
    with torch.no_grad():
        empty = model(input_ids=reference["input_ids"][0].long(), mems=model.init_mems(2)).logits
    assert not torch.allclose(empty, output.logits, atol=1e-4)


@pytest.mark.parametrize("case", ["div1_proj_pre_same", "div2_untied_pre", "wt103_shape"])
def test_gradients_equal_the_float64_reference(case):
    """Training in float64 over two segments: the gradient of a random weighting of the second segment's
    log-probabilities with respect to every parameter equals the reference's, mapped by the conversion (tied
    parameters, read twice, get the sum)."""
    config, weights, reference = load_case(case)
    model = converted(case).double()
    generator = torch.Generator().manual_seed(3)
    weighting = torch.randn(2, 5, config["vocab_size"], dtype=torch.float64, generator=generator)
    ids = reference["input_ids"].long()
    first = model(input_ids=ids[0], mems=model.init_mems(2))
    second = model(input_ids=ids[1], mems=first.mems).logits
    (second * weighting).sum().backward()

    leaves = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
    empty = [torch.zeros(2, 0, config["d_model"], dtype=torch.float64)] * config["n_layer"]
    _, mems = transfo_xl_reference(config, leaves, ids[0], empty)
    log_probs, _ = transfo_xl_reference(config, leaves, ids[1], [m.detach() for m in mems])
    torch.testing.assert_close(second, log_probs, rtol=1e-5, atol=1e-5)
    (log_probs * weighting).sum().backward()
    grads = {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in leaves.items()}
    expected = transfo_xl_state_dict_to_relpos(grads, model.config)
    got = dict(model.named_parameters())
    assert set(expected) <= set(got)
    shared = "transformer.r_w_bias" in weights  # untie_r=False: one u and v, copied into each layer's
    for name, grad in expected.items():
        mine = got[name].grad
        if shared and name.endswith(("r_w_bias", "r_r_bias")):
            kind = name.rsplit(".", 1)[1]
            mine = sum(p.grad for n, p in got.items() if n.endswith(kind))
        # 1e-5, not float64's 1e-12: the sinusoid R is computed in float32 whatever the model's dtype (as TransfoXL)
        torch.testing.assert_close(mine, grad, rtol=1e-5, atol=1e-5)


def test_a_bin_state_dict_with_tied_copies_converts_like_safetensors(tmp_path):
    """A pytorch_model.bin (read with weights_only=True) holding the tied output tables as copies."""
    folder = tmp_path / "bin"
    shutil.copytree(FIXTURES / "wt103_shape", folder)
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(weights, folder / "pytorch_model.bin")
    assert "crit.out_layers.1.weight" in weights
    model, expected = from_transfo_xl(folder), from_transfo_xl(FIXTURES / "wt103_shape")
    for (name, a), (_, b) in zip(model.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(a, b), name
    assert "wt103_shape" in BIN_CASES


def test_a_model_object_converts_like_its_folder():
    """A TransfoXLLMHeadModel object (duck-typed here: Transformers 5 has no TransfoXL): its config and state dict."""
    config = json.loads((FIXTURES / "div2_tied_same" / "config.json").read_text())
    weights = load_file(str(FIXTURES / "div2_tied_same" / "model.safetensors"))
    upstream = types.SimpleNamespace(config=types.SimpleNamespace(model_type="transfo-xl", to_dict=lambda: config),
                                     state_dict=lambda: weights)
    model = from_transfo_xl(upstream)
    reference = from_transfo_xl(FIXTURES / "div2_tied_same")
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    with pytest.raises(ValueError, match="from_transfo_xl takes a TransfoXL folder"):
        from_transfo_xl(torch.nn.Linear(2, 2))


def test_the_conversion_refuses_a_wrong_mapping_and_unknown_keys(tmp_path, monkeypatch):
    """The parity check (against the reference, which reads the upstream names) catches a mapping that puts a weight
    under the wrong name; a key the conversion does not know is named; an attention type or sampled softmax
    TransfoXL never ran is refused."""
    from hf_relpos import transfo_xl_conversion

    mapping = transfo_xl_conversion.transfo_xl_state_dict_to_relpos

    def swapped(state, config):  # the query and key projections exchanged
        out = mapping(state, config)
        q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
        out[q], out[k] = out[k], out[q]
        return out

    monkeypatch.setattr(transfo_xl_conversion, "transfo_xl_state_dict_to_relpos", swapped)
    with pytest.raises(ValueError, match="does not reproduce the TransfoXL checkpoint"):
        from_transfo_xl(FIXTURES / "div1_post")
    assert from_transfo_xl(FIXTURES / "div1_post", check=False) is not None
    monkeypatch.undo()
    folder = tmp_path / "extra"
    shutil.copytree(FIXTURES / "div1_post", folder)
    weights = load_file(str(folder / "model.safetensors"))
    weights["transformer.extra"] = torch.zeros(2)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="not converted \\['transformer.extra'\\]"):
        from_transfo_xl(folder, check=False)
    config = json.loads((FIXTURES / "div1_post" / "config.json").read_text())
    for field, value in (("attn_type", 1), ("sample_softmax", 100), ("model_type", "gpt2")):
        with pytest.raises(ValueError, match=f"config.json {field} must be"):
            transfo_xl_config_to_relpos({**config, field: value})


def test_the_converted_config_says_what_transfo_xl_is():
    config = transfo_xl_config_to_relpos(json.loads((FIXTURES / "div1_proj_pre_same" / "config.json").read_text()))
    assert (config.norm_type, config.norm_position, config.final_norm) == ("layer_norm", "pre", False)
    assert (config.hidden_act, config.attention_bias, config.mlp_bias) == ("relu", False, True)
    assert config.same_length and config.sliding_window == config.mem_len
    assert config.pad_token_id is None and config.dropout_placement == "transfo_xl"
    legacy = {"model_type": "transfo-xl", "n_token": 50, "d_model": 8, "d_embed": 8, "n_head": 2, "d_head": 4,
              "d_inner": 16, "n_layer": 1, "cutoffs": [10, 20], "div_val": 2, "proj_share_all_but_first": False,
              "clamp_len": 0}
    config = transfo_xl_config_to_relpos(legacy)
    assert config.vocab_size == 50 and config.projection_ties == [False, False, False] and config.clamp_len == -1


# ----------------------------------------------------------------------------------------------------------------
# The architecture options, for new models too
# ----------------------------------------------------------------------------------------------------------------


def small(**fields) -> RelPosConfig:
    base = dict(position_encoding="transformer_xl", vocab_size=40, hidden_size=16, num_attention_heads=2,
                intermediate_size=32, num_hidden_layers=2, mem_len=4)
    return RelPosConfig(**{**base, **fields})


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(cutoffs=[10, 10]), "RelPosConfig.cutoffs must increase strictly and stay below vocab_size=40, got [10, 10]"),
        (dict(cutoffs=[10, 40]), "RelPosConfig.cutoffs must increase strictly"),
        (dict(div_val=2), "RelPosConfig.div_val must be 1 without cutoffs"),
        (dict(tie_projs=[True]), "RelPosConfig.tie_projs must be None without cutoffs"),
        (dict(cutoffs=[10], tie_projs=[True]), "RelPosConfig.tie_projs must have one bool per cluster"),
        (dict(cutoffs=[10, 20], div_val=8), "RelPosConfig.div_val must leave the last cluster a vector"),
        (dict(norm_type="batch_norm"), "RelPosConfig.norm_type must be one of ['rms_norm', 'layer_norm']"),
        (dict(norm_position="sandwich"), "RelPosConfig.norm_position must be one of ['pre', 'post']"),
        (dict(mem_len=0, same_length=True), "RelPosConfig.same_length must be False unless"),
        (dict(mem_len=0, ext_len=1), "RelPosConfig.ext_len must be 0 unless"),
        (dict(position_encoding="alibi", mem_len=0, dropout_placement="transfo_xl"),
         "RelPosConfig.dropout_placement='transfo_xl' (which drops the sinusoid R) needs"),
        (dict(mlp_bias="yes"), "RelPosConfig.mlp_bias must be None (attention_bias), True or False, got 'yes'"),
        (dict(position_encoding="sinusoidal", mem_len=0, cutoffs=[10]),
         "RelPosConfig.cutoffs must be None for position_encoding='sinusoidal'"),
    ],
)
def test_each_option_is_refused_in_one_line_naming_it(fields, message):
    with pytest.raises(ValueError) as error:
        small(**fields)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_ext_len_keeps_the_memory_that_ends_ext_len_tokens_before_the_segment():
    """Dai et al.'s code: the new memory is cat(memory, h)[end - mem_len : end] with end = M + max(0, L - ext_len);
    layer 0's memory is the embedded tokens."""
    torch.manual_seed(0)
    model = RelPosForCausalLM(small(ext_len=2, mem_len=5)).eval()
    ids = torch.randint(0, 40, (2, 4, 6))
    embedded = [model.model.embed_tokens(ids[s]) for s in range(2)]
    with torch.no_grad():
        first = model(input_ids=ids[0], mems=model.init_mems(4))
        second = model(input_ids=ids[1], mems=first.mems)
    torch.testing.assert_close(first.mems[0], embedded[0][:, :4])  # end = 0 + 6 - 2
    torch.testing.assert_close(second.mems[0], torch.cat([embedded[0][:, :4], embedded[1][:, :4]], 1)[:, -5:])


def test_post_norm_and_layer_norm_and_mlp_bias_build_what_they_say():
    model = RelPosForCausalLM(small(norm_type="layer_norm", norm_position="post", final_norm=False, mlp_bias=True))
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, torch.nn.LayerNorm) and layer.mlp.up_proj.bias is not None
    assert layer.self_attn.q_proj.bias is None and isinstance(model.model.norm, torch.nn.Identity)
    assert "model.norm.weight" not in model.state_dict()
    # post-norm: every layer's output is normed (LayerNorm with its initial weight 1 and bias 0: mean 0, variance 1)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.randint(0, 40, (2, 7))).last_hidden_state
    torch.testing.assert_close(hidden.mean(-1), torch.zeros(2, 7), atol=1e-5, rtol=0)


@pytest.mark.parametrize("same_length", [False, True])
def test_an_adaptive_model_trains_saves_and_reloads_tied(tmp_path, same_length):
    """A new adaptive model: one training step moves the tied tables together, and save/load keeps the ties."""
    torch.manual_seed(0)
    config = small(cutoffs=[10, 25], div_val=2, embedding_size=16, same_length=same_length, hidden_dropout=0.1,
                   dropout_placement="transfo_xl", norm_type="layer_norm", norm_position="post", final_norm=False)
    model = RelPosForCausalLM(config)
    head, embedding = model.lm_head, model.model.embed_tokens
    assert head.out_layers[1].weight is embedding.emb_layers[1].weight
    assert head.out_projs["1"].weight is embedding.emb_projs["1"].weight
    assert head.out_projs["0"].weight is not embedding.emb_projs["0"].weight  # tie_projs: all but the first
    ids = torch.randint(0, 40, (2, 9))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert head.out_layers[1].weight is embedding.emb_layers[1].weight
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.out_layers.1.weight" not in saved and "lm_head.out_projs.0.weight" in saved
    loaded = RelPosForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.out_layers[1].weight is loaded.model.embed_tokens.emb_layers[1].weight
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    with pytest.raises(ValueError, match="RelPosConfig.cutoffs=\\[10, 25\\]: an adaptive input and softmax cannot"):
        model.resize_token_embeddings(50)


def test_dropout_placement_transfo_xl_drops_where_transfo_xl_does():
    """Training mode: the MLP's activations and the stack's output are dropped, and the sinusoid R once per forward
    for every layer (TransfoXL's ``pos_emb = self.drop(pos_emb)``): each layer's r_net reads the same dropped R,
    zeros where kept values are scaled by 1 / (1 - p). Eval mode and the other placements read R as it is."""
    from hf_relpos.functional import sinusoidal_embedding

    torch.manual_seed(0)

    def r_net_inputs(model, ids):
        seen = []
        hooks = [layer.self_attn.relative.r_net.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
                 for layer in model.model.layers]
        try:
            model(input_ids=ids)
        finally:
            for hook in hooks:
                hook.remove()
        return seen

    ids = torch.randint(0, 40, (1, 12))
    plain_r = sinusoidal_embedding(torch.arange(11, -1, -1), 16)
    model = RelPosForCausalLM(small(hidden_dropout=0.5, dropout_placement="transfo_xl")).train()
    assert isinstance(model.model.layers[0].mlp.dropout, torch.nn.Dropout)
    first, second = r_net_inputs(model, ids)
    assert torch.equal(first, second)  # one mask for all layers
    kept = first != 0
    torch.testing.assert_close(first[kept], 2 * plain_r[kept])
    assert 0.3 < 1 - kept[plain_r != 0].float().mean() < 0.7
    for placement, mode in (("transfo_xl", "eval"), ("residual", "train"), ("t5", "train")):
        other = RelPosForCausalLM(small(hidden_dropout=0.5, dropout_placement=placement))
        getattr(other, mode)()
        for seen in r_net_inputs(other, ids):
            torch.testing.assert_close(seen, plain_r)
    plain = RelPosForCausalLM(small(hidden_dropout=0.5))
    assert isinstance(plain.model.layers[0].mlp.dropout, torch.nn.Identity)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_same_length_with_memory_shows_each_query_mem_len_keys():
    """same_length=True: with a memory, query i sees the keys at distances 0 .. mem_len - 1 (its window), which the
    attention probabilities show; without, every memory key and the causal past."""
    torch.manual_seed(0)
    for same_length, visible in ((True, 4), (False, None)):
        model = RelPosForCausalLM(small(same_length=same_length)).eval()
        mems = [torch.randn(1, 4, 16)] * 2
        with torch.no_grad():
            attentions = model(input_ids=torch.randint(0, 40, (1, 3)), mems=mems, output_attentions=True).attentions
        seen = (attentions[0][0, 0] > 0).sum(-1)
        expected = torch.tensor([4, 4, 4]) if visible else torch.tensor([5, 6, 7])
        assert torch.equal(seen, expected), (same_length, seen)


def test_default_models_keep_their_parameters_and_norms():
    """Defaults build today's models: RMSNorm, a final norm, one table and output layer, no MLP bias."""
    model = RelPosForCausalLM(RelPosConfig(hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                           num_hidden_layers=1, vocab_size=40))
    names = set(model.state_dict())
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= names
    assert not any(name.endswith(".bias") for name in names)
    # a config.json saved before these options existed reads as today's model
    saved = {k: v for k, v in model.config.to_dict().items()
             if k not in ("cutoffs", "div_val", "embedding_size", "tie_projs", "norm_type", "norm_position",
                          "final_norm", "mlp_bias", "dropout_placement", "same_length", "ext_len")}
    old = RelPosConfig.from_dict(saved)
    assert (old.norm_type, old.norm_position, old.final_norm, old.cutoffs, old.dropout_rule) == (
        "rms_norm", "pre", True, None, "residual")


# ----------------------------------------------------------------------------------------------------------------
# Generation, Trainer, the command and remote code
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["div1_post", "div1_proj_pre_same", "div2_untied_pre"])
def test_generate_equals_decoding_one_token_segments_with_mems(case):
    """generate's decoding memory is the sliding cache of mem_len + 1 keys (mem_len with same_length): greedy
    tokens and scores equal Transformer-XL's own decoding, one-token segments carrying mems from empty memories."""
    model = converted(case)
    prompt = load_case(case)[2]["input_ids"][0, :1, :3].long()
    out = model.generate(prompt, max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0)
    mems, tokens, scores = model.init_mems(1), prompt[0].tolist(), []
    with torch.no_grad():
        for step in range(prompt.shape[1] + 11):
            output = model(input_ids=torch.tensor([[tokens[step]]]), mems=mems)
            mems = output.mems
            if step >= prompt.shape[1] - 1:
                scores.append(output.logits[0, -1])
                if step + 1 >= len(tokens):
                    tokens.append(int(output.logits[0, -1].argmax()))
    assert out.sequences[0].tolist() == tokens
    for got, expected in zip(out.scores, scores):
        torch.testing.assert_close(got[0], expected, **TOLERANCE)


def test_memory_trainer_evaluates_with_memory_as_the_reference():
    """MemoryTrainer carries mems across ordered segments: its evaluation loss is the float64 reference's mean
    next-token loss over the same segments with memory (same_length: the first segment's window is mem_len either
    way)."""
    from transformers import TrainingArguments

    from hf_relpos.memory import MemoryTrainer, OrderedSegments

    config, weights, _ = load_case("div2_tied_same")
    model = converted("div2_tied_same")
    stream = torch.randint(0, config["vocab_size"], (2 * 20,), generator=torch.Generator().manual_seed(5))
    data = OrderedSegments(stream, batch_size=2, segment_length=5)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(output_dir=folder, per_device_eval_batch_size=2, report_to=[], use_cpu=True,
                                 disable_tqdm=True, dataloader_pin_memory=False)
        loss = MemoryTrainer(model=model, args=args, eval_dataset=data).evaluate()["eval_loss"]
    rows = stream.view(2, 20)
    mems = [torch.zeros(2, 0, config["d_model"], dtype=torch.float64)] * config["n_layer"]
    losses = []
    for s in range(4):
        ids = rows[:, 5 * s : 5 * s + 5]
        log_probs, mems = transfo_xl_reference(config, weights, ids, mems)
        losses.append(-log_probs[:, :-1].gather(-1, ids[:, 1:, None]).mean())
    assert loss == pytest.approx(torch.stack(losses).mean().item(), abs=1e-5)


WORDS = [f"w{i}" for i in range(40)]
WORDS[0], WORDS[1] = "<eos>", "<unk>"


def write_vocab(folder, **overrides):
    """A vocab.pkl of the authors' Vocab (a plain pickle of its __dict__) for the fixture's 40 ids."""
    import collections
    import pickle

    vocab = {"special": ["<eos>"], "min_freq": 0, "max_size": None, "lower_case": False, "delimiter": None,
             "vocab_file": None, "counter": collections.Counter(WORDS), "idx2sym": list(WORDS),
             "sym2idx": collections.OrderedDict((w, i) for i, w in enumerate(WORDS)), "eos_idx": 0, "unk_idx": 1}
    vocab.update(overrides)
    (folder / "vocab.pkl").write_bytes(pickle.dumps(vocab, protocol=2))


REMOTE = r'''
import json, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "hf_relpos" or name.startswith("hf_relpos."):
            raise ImportError("hf_relpos is blocked in this process")
sys.meta_path.insert(0, Block())
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, reference = sys.argv[1], load_file(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
mems, worst = model.init_mems(2), 0.0
for s in range(3):
    with torch.no_grad():
        out = model(input_ids=reference["input_ids"][s].long(), mems=mems)
    mems = out.mems
    worst = max(worst, (out.logits - reference[f"s{s}.log_probs"]).abs().max().item())
tokenizer = AutoTokenizer.from_pretrained(folder)
ids = tokenizer("w5 w7 nothing w39 <eos>", add_special_tokens=False)["input_ids"]
greedy = model.generate(torch.tensor([ids[:3]]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0].tolist()
result = {"worst": worst, "ids": ids, "greedy": greedy, "eos": tokenizer.eos_token_id,
          "modules": sorted(m for m in sys.modules if m.startswith("hf_relpos"))}
open(sys.argv[3], "w").write(json.dumps(result))
'''


def test_convert_transfo_xl_writes_a_folder_that_runs_through_remote_code(tmp_path, capsys):
    """The command converts a folder with its vocab.pkl; the folder (no pickle in it) loads with remote code and
    AutoTokenizer in a process that cannot import hf_relpos, and gives TransfoXL's log-probabilities over three
    segments with memory, the vocabulary's ids, and the converting process's greedy tokens."""
    import os
    import subprocess
    import sys

    from hf_relpos.commands.transfo_xl import convert_transfo_xl

    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(FIXTURES / "div2_tied_same", src)
    write_vocab(src)
    parity = convert_transfo_xl(str(src), str(out))
    assert parity["max_abs_log_prob_diff"] < 1e-4 and "vocab.pkl -> tokenizer.json" in capsys.readouterr().out
    assert (out / "tokenizer.json").is_file() and not list(out.glob("*.pkl")) and not list(out.glob("*.bin"))
    (tmp_path / "remote.py").write_text(REMOTE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HF_MODULES_CACHE=str(tmp_path / "modules"),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    work = tmp_path / "cwd"
    work.mkdir()
    proc = subprocess.run([sys.executable, str(tmp_path / "remote.py"), str(out),
                           str(FIXTURES / "div2_tied_same" / "reference.safetensors"), str(tmp_path / "result.json")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["worst"] < 1e-5 and result["modules"] == []
    assert result["ids"] == [5, 7, 1, 39, 0] and result["eos"] == 0
    model = RelPosForCausalLM.from_pretrained(out)
    expected = model.generate(torch.tensor([[5, 7, 1]]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert result["greedy"] == expected[0].tolist()


def test_convert_transfo_xl_refuses_in_one_line_and_writes_nothing(tmp_path):
    """A tampered vocab.pkl (it would run code), a folder of another model, an existing model without --overwrite,
    weights that do not fit config.json: one line each, the output folder not created."""
    import pickle

    from hf_relpos.commands.errors import UserError
    from hf_relpos.commands.transfo_xl import convert_transfo_xl

    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(FIXTURES / "div1_post", src)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('x')",))

    (src / "vocab.pkl").write_bytes(pickle.dumps({"sym2idx": Payload()}, protocol=2))
    with pytest.raises(UserError) as error:
        convert_transfo_xl(str(src), str(out))
    assert "vocab.pkl" in str(error.value) and "nothing written" in str(error.value) and "\n" not in str(error.value)
    assert not marker.exists() and not out.exists()
    (src / "vocab.pkl").unlink()

    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "d_inner": 48}))
    with pytest.raises(UserError, match="its weights do not match its config.json") as error:
        convert_transfo_xl(str(src), str(out))
    assert "\n" not in str(error.value) and not out.exists()
    (src / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UserError, match="holds a 'gpt2' model; convert-transfo-xl converts 'transfo-xl' models"):
        convert_transfo_xl(str(src), str(out))
    (src / "config.json").write_text(json.dumps(config))
    convert_transfo_xl(str(src), str(out))
    with pytest.raises(UserError, match="already holds an hf-relpos model: pass --overwrite"):
        convert_transfo_xl(str(src), str(out))
    convert_transfo_xl(str(src), str(out), overwrite=True)


def test_a_converted_model_exports_as_a_torch_export_program(tmp_path):
    """hf-relpos export (pt2) of a converted folder: the program (log-probabilities, no memory) is checked against
    the model by the command itself, and reads back with the same log-probabilities."""
    from hf_relpos.commands.export import export_folder
    from hf_relpos.commands.transfo_xl import convert_transfo_xl

    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(FIXTURES / "div2_tied_same", src)
    write_vocab(src)
    convert_transfo_xl(str(src), str(out))
    result = export_folder(str(out), str(tmp_path / "pt2"), "pt2")
    program = torch.export.load(str(tmp_path / "pt2" / "model.pt2")).module()
    ids = torch.tensor([[5, 7, 9, 11, 2, 3, 4]])
    model = RelPosForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = program(ids, torch.ones_like(ids))
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert result is not None


def test_init_mems_needs_a_model_with_memory():
    model = RelPosForCausalLM(small(mem_len=0))
    with pytest.raises(ValueError, match="init_mems needs a model with memory \\(RelPosConfig.mem_len > 0\\), got"):
        model.init_mems(2)


def test_config_json_forms_transfo_xl_reads_convert(tmp_path):
    """What TransfoXLConfig 4.35.2 fills in itself: n_token for vocab_size, tie_projs from proj_share_all_but_first,
    fields left at its defaults; and weights saved in float16 (inv_freq too). Each converts and passes the check."""
    config = json.loads((FIXTURES / "div1_post" / "config.json").read_text())
    weights = load_file(str(FIXTURES / "div1_post" / "model.safetensors"))
    expected = from_transfo_xl(FIXTURES / "div1_post")
    legacy = {k: v for k, v in config.items() if k not in ("vocab_size", "tie_projs", "init_std", "untie_r")}
    legacy["n_token"] = config["vocab_size"]
    folder = tmp_path / "legacy"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(legacy))
    save_file(weights, str(folder / "model.safetensors"))
    model = from_transfo_xl(folder)
    for name, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    save_file({k: v.half() for k, v in weights.items()}, str(folder / "model.safetensors"))
    assert from_transfo_xl(folder).config.vocab_size == config["vocab_size"]


def test_a_config_that_does_not_fit_its_weights_is_refused_before_allocation(tmp_path):
    """config.json asking for weights of other shapes (d_inner 10**8: 12.8 GB a matrix) is named in one line from
    the meta device; same_length without memory (TransfoXL masks every key then) is refused."""
    folder = tmp_path / "big"
    shutil.copytree(FIXTURES / "div1_post", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "d_inner": 10**8}))
    with pytest.raises(ValueError, match="config.json gives model.layers.0.mlp.up_proj.weight the shape "
                                         "\\[100000000, 16\\], the weights hold \\[32, 16\\]"):
        from_transfo_xl(folder)
    (folder / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    with pytest.raises(ValueError, match="the weights hold no transformer.layers.2.dec_attn.qkv_net.weight, which"):
        from_transfo_xl(folder)
    with pytest.raises(ValueError, match="config.json same_length must be false when mem_len is 0"):
        transfo_xl_config_to_relpos({**config, "mem_len": 0, "same_length": True})


def test_the_command_refuses_a_vocabulary_larger_than_the_model_and_drops_a_stale_tokenizer(tmp_path):
    """A vocab.pkl with ids past vocab_size is refused, nothing written; an --overwrite from a source without
    vocab.pkl leaves no tokenizer of the model it replaced."""
    from hf_relpos.commands.errors import UserError
    from hf_relpos.commands.transfo_xl import convert_transfo_xl

    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(FIXTURES / "div2_tied_same", src)
    write_vocab(src, idx2sym=WORDS + ["extra"], sym2idx={**{w: i for i, w in enumerate(WORDS)}, "extra": 40})
    with pytest.raises(UserError, match="holds 41 symbols, more than the model's vocab_size=40") as error:
        convert_transfo_xl(str(src), str(out))
    assert "nothing written" in str(error.value) and not out.exists()
    write_vocab(src)
    convert_transfo_xl(str(src), str(out))
    assert (out / "tokenizer.json").is_file()
    (src / "vocab.pkl").unlink()
    convert_transfo_xl(str(src), str(out), overwrite=True)
    assert not (out / "tokenizer.json").exists() and not (out / "tokenizer_config.json").exists()


def test_resizing_an_adaptive_model_is_refused_in_one_line_by_every_class():
    from hf_relpos import RelPosForSequenceClassification, RelPosModel

    config = small(cutoffs=[10, 25], div_val=2)
    for cls in (RelPosModel, RelPosForSequenceClassification, RelPosForCausalLM):
        with pytest.raises(ValueError, match="RelPosConfig.cutoffs=\\[10, 25\\]: an adaptive input and softmax"):
            cls(config).resize_token_embeddings(50)


def test_the_model_card_says_what_a_converted_model_is(tmp_path):
    converted("div2_tied_same").save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "| norms | layer_norm, post-norm, no final norm |" in card
    assert "adaptive input and softmax cut at [10, 25], div_val 2: the causal LM's logits are log-probabilities" in card
    RelPosForCausalLM(small()).save_pretrained(tmp_path / "plain")
    plain = (tmp_path / "plain" / "README.md").read_text()
    assert "| norms |" not in plain and "clusters" not in plain


def test_memory_trainer_trains_a_converted_model_with_memory_and_keeps_its_ties(tmp_path):
    """Training (dropout 0.1 where TransfoXL drops, R included): memory carried from step to step, the loss falls on
    a repeated stream, and the tied tables and projections stay one parameter each."""
    from transformers import TrainingArguments

    from hf_relpos.memory import MemoryTrainer, OrderedSegments

    torch.manual_seed(0)
    model = converted("div2_tied_same")
    model.config.hidden_dropout = 0.1
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    model.model.position.sinusoid_dropout = 0.1
    stream = torch.arange(10).repeat(24) % 40
    data = OrderedSegments(stream, batch_size=4, segment_length=6)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, learning_rate=3e-3, report_to=[],
                             use_cpu=True, disable_tqdm=True, dataloader_pin_memory=False, save_strategy="no",
                             max_steps=30, logging_steps=10, seed=0)
    trainer = MemoryTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < losses[0]
    assert trainer.train_mems is not None and trainer.train_mems[0].shape == (4, 4, 16)  # mem_len 4
    assert model.lm_head.out_layers[1].weight is model.model.embed_tokens.emb_layers[1].weight
    assert model.lm_head.out_projs["1"].weight is model.model.embed_tokens.emb_projs["1"].weight


def test_odd_folders_are_refused_in_one_line(tmp_path):
    """Second review: a missing u or v, a .bin that is no flat state dict, config.json values of the wrong type, a
    d_model whose sinusoid would not fit the weights (refused before the formula is computed at its size), NaN
    weights (Python's max skips NaN: the check must not), and TransfoXLConfig's aliases read as it reads them."""
    from hf_relpos.commands.errors import UserError
    from hf_relpos.commands.transfo_xl import convert_transfo_xl
    from hf_relpos.transfo_xl_conversion import transfo_xl_config

    config = json.loads((FIXTURES / "div1_post" / "config.json").read_text())
    weights = load_file(str(FIXTURES / "div1_post" / "model.safetensors"))

    def folder(name, cfg=config, state=weights, bin_state=None):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(cfg))
        if bin_state is not None:
            torch.save(bin_state, path / "pytorch_model.bin")
        else:
            save_file(state, str(path / "model.safetensors"))
        return path

    missing = folder("missing", state={k: v for k, v in weights.items() if k != "transformer.layers.0.dec_attn.r_w_bias"})
    with pytest.raises(ValueError, match="the weights hold no transformer.layers.0.dec_attn.r_w_bias, which"):
        from_transfo_xl(missing)
    nested = folder("nested", bin_state={"state_dict": weights})
    with pytest.raises(UserError, match="must hold a state dict \\(parameter names -> tensors\\), got a dict") as error:
        convert_transfo_xl(str(nested), str(tmp_path / "out"))
    assert "\n" not in str(error.value) and not (tmp_path / "out").exists()
    for field, value in (("mem_len", None), ("cutoffs", None), ("sample_softmax", None), ("d_model", "16")):
        with pytest.raises(UserError, match=f"config.json {field} must be"):
            convert_transfo_xl(str(folder(f"type-{field}", cfg={**config, field: value})), str(tmp_path / "out"))
    wide = folder("wide", cfg={**config, "d_model": 2**30})
    with pytest.raises(ValueError, match="config.json gives d_model=1073741824: transformer.pos_emb.inv_freq would"):
        from_transfo_xl(wide)
    nan = folder("nan", state={**weights, "transformer.layers.0.dec_attn.r_w_bias":
                               torch.full_like(weights["transformer.layers.0.dec_attn.r_w_bias"], float("nan"))})
    with pytest.raises(ValueError, match="max \\|log-prob diff\\| inf"):
        from_transfo_xl(nan)
    read = transfo_xl_config({**config, "num_hidden_layers": 1, "n_token": 33, "hidden_size": 8})
    assert (read["n_layer"], read["vocab_size"], read["d_model"]) == (1, 33, 8)
