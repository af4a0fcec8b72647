"""Transformers 4.x TransfoXL checkpoints (``transfo-xl-wt103``'s format) as hf_relpos causal LMs: ``from_transfo_xl``
and the folder conversion behind ``hf-relpos convert-transfo-xl``.

TransfoXL (Dai et al. 2019, the authors' release as Transformers ported it; deleted in Transformers 5) is
hf_relpos' ``transformer_xl`` scheme with post-norm LayerNorm blocks (or pre-norm without a final norm), a ReLU
MLP with biases, bias-free q/k/v/o/r projections, an adaptive input and softmax, and ``same_length``. Each weight
is copied under its hf_relpos name (``qkv_net`` split into ``q_proj``, ``k_proj``, ``v_proj``); nothing is
rescaled. The check runs the converted model against ``transfo_xl_reference`` (float64, the upstream weights
under their own names, pinned against Transformers 4.35.2's outputs by the test fixtures) over three segments
with memory, from the authors' empty first memory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Union

import torch

from .configuration_relpos import RelPosConfig
from .modeling_relpos import RelPosForCausalLM
from .transfo_xl_reference import transfo_xl_reference

# fp32 against the float64 reference, on log-probabilities (which reach -log(vocab_size), about 12.5 for wt103).
LOG_PROB_TOLERANCE = 1e-4


# Transformers 4.35.2's TransfoXLConfig defaults (transfo-xl-wt103's architecture): what a config.json leaves out
# is read as these, as TransfoXLConfig reads it.
TRANSFO_XL_DEFAULTS = {
    "vocab_size": 267735, "cutoffs": [20000, 40000, 200000], "d_model": 1024, "d_embed": 1024, "n_head": 16,
    "d_head": 64, "d_inner": 4096, "div_val": 4, "pre_lnorm": False, "n_layer": 18, "mem_len": 1600,
    "clamp_len": 1000, "same_length": True, "proj_share_all_but_first": True, "attn_type": 0, "sample_softmax": -1,
    "adaptive": True, "dropout": 0.1, "dropatt": 0.0, "untie_r": True, "init": "normal", "init_range": 0.01,
    "proj_init_std": 0.01, "init_std": 0.02, "layer_norm_epsilon": 1e-5, "eos_token_id": 0,
    "tie_word_embeddings": True,
}


# TransfoXLConfig.attribute_map (4.35.2): a config.json key it reads as another field.
ALIASES = {"n_token": "vocab_size", "hidden_size": "d_model", "num_attention_heads": "n_head",
           "num_hidden_layers": "n_layer"}


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_POSITIVE = (lambda v: _int(v) and v >= 1, "a positive int")
FIELD_TYPES = {
    **{name: _POSITIVE for name in ("vocab_size", "d_model", "d_embed", "n_head", "d_head", "d_inner", "div_val",
                                    "n_layer")},
    "mem_len": (_int, "an int"), "clamp_len": (_int, "an int"), "attn_type": (_int, "an int"),
    "sample_softmax": (_int, "an int"),
    "cutoffs": (lambda v: isinstance(v, list) and all(_int(c) for c in v), "a list of ints"),
    "tie_projs": (lambda v: v is None or (isinstance(v, list) and all(isinstance(t, bool) for t in v)),
                  "null or a list of true/false"),
    **{name: (lambda v: isinstance(v, bool), "true or false") for name in (
        "pre_lnorm", "same_length", "proj_share_all_but_first", "tie_word_embeddings")},
    **{name: (_number, "a number") for name in ("dropout", "dropatt", "init_std", "layer_norm_epsilon")},
}


def transfo_xl_config(given: dict) -> dict:
    """A TransfoXL ``config.json`` (a dict) as TransfoXLConfig 4.35.2 reads it: its defaults filled in, ``n_token``
    (``vocab_size``'s old name) read as ``vocab_size``, and ``tie_projs`` (where the file has none) from
    ``proj_share_all_but_first``. ``ValueError`` for what TransfoXL never ran."""
    if not isinstance(given, dict) or given.get("model_type") != "transfo-xl":
        got = given.get("model_type") if isinstance(given, dict) else type(given).__name__
        raise ValueError(f"config.json model_type must be 'transfo-xl', got {got!r}")
    upstream = {**TRANSFO_XL_DEFAULTS, **given}
    for alias, name in ALIASES.items():  # TransfoXLConfig.attribute_map: the alias wins, as there
        if alias in given:
            upstream[name] = given[alias]
    for name, (valid, allowed) in FIELD_TYPES.items():
        if not valid(upstream.get(name)):
            raise ValueError(f"config.json {name} must be {allowed}, got {upstream.get(name)!r}")
    if given.get("tie_projs") is None:
        upstream["tie_projs"] = [False] + [bool(upstream["proj_share_all_but_first"])] * len(upstream["cutoffs"])
    if upstream["attn_type"] != 0:
        raise ValueError(f"config.json attn_type must be 0 (the relative attention TransfoXL ran), got "
                         f"{upstream['attn_type']!r}")
    if upstream["sample_softmax"] > 0:
        raise ValueError(f"config.json sample_softmax must be <= 0 (sampled softmax was never run by TransfoXL), got "
                         f"{upstream['sample_softmax']!r}")
    if upstream["same_length"] and upstream["mem_len"] <= 0:
        raise ValueError(f"config.json same_length must be false when mem_len is {upstream['mem_len']} (TransfoXL "
                         "then masks every key of every query)")
    return upstream


def transfo_xl_config_to_relpos(given: dict) -> RelPosConfig:
    """The RelPosConfig of a converted TransfoXL, from its ``config.json`` as a dict (:func:`transfo_xl_config`)."""
    upstream = transfo_xl_config(given)
    clamp_len = upstream["clamp_len"]
    return RelPosConfig(
        position_encoding="transformer_xl",
        vocab_size=upstream["vocab_size"],
        hidden_size=upstream["d_model"],
        embedding_size=upstream["d_embed"],
        num_attention_heads=upstream["n_head"],
        head_dim=upstream["d_head"],
        intermediate_size=upstream["d_inner"],
        num_hidden_layers=upstream["n_layer"],
        cutoffs=list(upstream["cutoffs"]),
        div_val=upstream["div_val"],
        tie_projs=[bool(t) for t in upstream["tie_projs"]],
        tie_word_embeddings=bool(upstream["tie_word_embeddings"]),
        mem_len=upstream["mem_len"],
        clamp_len=clamp_len if clamp_len > 0 else -1,
        same_length=bool(upstream["same_length"]),
        norm_type="layer_norm",
        norm_position="pre" if upstream["pre_lnorm"] else "post",
        final_norm=False,
        rms_norm_eps=upstream["layer_norm_epsilon"],
        hidden_act="relu",
        attention_bias=False,
        mlp_bias=True,
        hidden_dropout=float(upstream["dropout"]),
        attention_dropout=float(upstream["dropatt"]),
        dropout_placement="transfo_xl",
        initializer_range=upstream["init_std"],
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=upstream["eos_token_id"],
    )


def transfo_xl_state_dict_to_relpos(state: dict, config: RelPosConfig) -> dict:
    """TransfoXLLMHeadModel parameter names -> hf_relpos names. Tied output tables and projections are left out
    (the model ties them); a shared ``r_w_bias``/``r_r_bias`` (``untie_r=False``) is copied into every layer."""
    out = {}
    for key, value in state.items():
        if key.startswith("transformer.word_emb.emb_layers."):
            out["model.embed_tokens." + key.removeprefix("transformer.word_emb.")] = value
        elif key.startswith("transformer.word_emb.emb_projs."):
            out["model.embed_tokens." + key.removeprefix("transformer.word_emb.") + ".weight"] = value
    tied = RelPosForCausalLM.tied_keys(config)
    for i in range(len(config.cutoffs) + 1 if config.div_val > 1 else 1):
        if f"lm_head.out_layers.{i}.weight" not in tied:
            out[f"lm_head.out_layers.{i}.weight"] = state[f"crit.out_layers.{i}.weight"]
        out[f"lm_head.out_layers.{i}.bias"] = state[f"crit.out_layers.{i}.bias"]
    for key, value in state.items():
        if key.startswith("crit.out_projs.") and value is not None:
            name = f"lm_head.out_projs.{key.removeprefix('crit.out_projs.')}.weight"
            if name not in tied:
                out[name] = value
    if config.cutoffs:
        out["lm_head.cluster_weight"], out["lm_head.cluster_bias"] = state["crit.cluster_weight"], state["crit.cluster_bias"]
    for n in range(config.num_hidden_layers):
        upstream, ours = f"transformer.layers.{n}.", f"model.layers.{n}."
        q, k, v = state[upstream + "dec_attn.qkv_net.weight"].chunk(3, dim=0)
        out[ours + "self_attn.q_proj.weight"], out[ours + "self_attn.k_proj.weight"] = q, k
        out[ours + "self_attn.v_proj.weight"] = v
        out[ours + "self_attn.o_proj.weight"] = state[upstream + "dec_attn.o_net.weight"]
        out[ours + "self_attn.relative.r_net.weight"] = state[upstream + "dec_attn.r_net.weight"]
        for bias in ("r_w_bias", "r_r_bias"):  # each layer's, or the one all layers share (untie_r=False)
            own, shared = upstream + f"dec_attn.{bias}", f"transformer.{bias}"
            out[ours + f"self_attn.relative.{bias}"] = state[shared if own not in state and shared in state else own]
        for part in ("weight", "bias"):
            out[ours + f"input_layernorm.{part}"] = state[upstream + f"dec_attn.layer_norm.{part}"]
            out[ours + f"post_attention_layernorm.{part}"] = state[upstream + f"pos_ff.layer_norm.{part}"]
            out[ours + f"mlp.up_proj.{part}"] = state[upstream + f"pos_ff.CoreNet.0.{part}"]
            out[ours + f"mlp.down_proj.{part}"] = state[upstream + f"pos_ff.CoreNet.3.{part}"]
    return out


def read_transfo_xl_folder(folder: Union[str, Path]) -> tuple[dict, dict]:
    """``(config dict, state dict)`` of a local TransfoXL folder: ``config.json`` and ``model.safetensors``, or a
    ``pytorch_model.bin`` read with ``torch.load(weights_only=True)`` (tensors only: no object is unpickled)."""
    folder = Path(folder)
    upstream = transfo_xl_config(json.loads((folder / "config.json").read_text()))
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(folder / "model.safetensors"))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise ValueError(f"{folder / 'pytorch_model.bin'} must hold a state dict (parameter names -> tensors), "
                             f"got a {type(state).__name__} of other values")
    else:
        raise ValueError(f"{folder} holds neither model.safetensors nor pytorch_model.bin")
    return upstream, state


def _upstream_of(folder_or_model) -> tuple[dict, dict]:
    if isinstance(folder_or_model, (str, Path)):
        return read_transfo_xl_folder(folder_or_model)
    config = getattr(folder_or_model, "config", None)
    if getattr(config, "model_type", None) != "transfo-xl" or not hasattr(folder_or_model, "state_dict"):
        raise ValueError(f"from_transfo_xl takes a TransfoXL folder or a transformers 4.x TransfoXLLMHeadModel, got "
                         f"{type(folder_or_model).__name__}")
    return transfo_xl_config(config.to_dict()), {k: v.detach() for k, v in folder_or_model.state_dict().items()}


def from_transfo_xl(folder_or_model, *, check: bool = True) -> RelPosForCausalLM:
    """An hf_relpos ``RelPosForCausalLM`` with the log-probabilities of a Transformers 4.x ``TransfoXLLMHeadModel``
    (a local folder, or the model object), in float32 and eval mode. Its ``logits`` are log-probabilities (the
    adaptive softmax's); memory is ``mems`` and the first segment starts from ``model.init_mems(batch)``, empty, as
    the authors' code did (Transformers' port started from ``mem_len`` zero vectors).

    With ``check`` (the default) the conversion is verified before it is returned (:func:`check_transfo_xl_parity`)
    and a ``ValueError`` names what differs."""
    upstream, state = _upstream_of(folder_or_model)
    return convert_transfo_xl_state(upstream, state, check=check)


def convert_transfo_xl_state(upstream: dict, state: dict, *, check: bool = True) -> RelPosForCausalLM:
    """:func:`from_transfo_xl` of a TransfoXL ``config.json`` dict and state dict (upstream names). The weights are
    matched against the shapes ``config.json`` gives on the meta device first: a config asking for other or more
    weights than the state dict holds is one ``ValueError`` naming the weight, before anything is allocated."""
    upstream = transfo_xl_config(upstream)
    config = transfo_xl_config_to_relpos(upstream)
    state = {k: v for k, v in state.items() if v is not None}
    inv_freq = state.pop("transformer.pos_emb.inv_freq", None)
    if inv_freq is not None:  # a buffer of the formula the scheme computes: checked (in its own dtype), not kept
        d_model = config.hidden_size
        if tuple(inv_freq.shape) != (d_model // 2,):  # before the formula is computed at config.json's size
            raise ValueError(f"config.json gives d_model={d_model}: transformer.pos_emb.inv_freq would have "
                             f"{d_model // 2} values, the weights hold {list(inv_freq.shape)}")
        expected = (1 / 10000 ** (torch.arange(0.0, d_model, 2.0) / d_model)).to(inv_freq.dtype)
        if inv_freq.shape != expected.shape or not torch.allclose(inv_freq.float(), expected.float()):
            raise ValueError("transformer.pos_emb.inv_freq is not 1/10000**(2i/d_model): not TransfoXL's sinusoid")
    state = {k: v.float() for k, v in state.items()}
    try:
        mapped = transfo_xl_state_dict_to_relpos(state, config)
    except KeyError as error:
        raise ValueError(f"the weights hold no {error.args[0]}, which config.json's architecture needs") from None
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in RelPosForCausalLM(config).state_dict().items()}
    for name, value in mapped.items():
        if name in shapes and shapes[name] != tuple(value.shape):
            raise ValueError(f"config.json gives {name} the shape {list(shapes[name])}, the weights hold "
                             f"{list(value.shape)}")
    converted = RelPosForCausalLM(config)
    used = _upstream_keys_used(state, config)
    unused = sorted(set(state) - used)
    missing, unexpected = converted.load_state_dict(mapped, strict=False)
    missing = [k for k in missing if k not in converted.get_expanded_tied_weights_keys()]
    if missing or unexpected or unused:
        raise ValueError(f"TransfoXL conversion left parameters unmapped: missing {missing}, unexpected {unexpected}, "
                         f"not converted {unused}")
    converted.tie_weights()
    converted.eval()
    if check:
        check_transfo_xl_parity(upstream, state, converted)
    return converted


def _upstream_keys_used(state: dict, config: RelPosConfig) -> set:
    """The upstream keys the conversion reads or knows to be copies (tied output tables and projections)."""
    used = set()
    for key in state:
        if key.startswith(("transformer.word_emb.", "crit.")) or key in ("transformer.r_w_bias", "transformer.r_r_bias"):
            used.add(key)
        elif key.startswith("transformer.layers."):
            n = int(key.split(".")[2])
            if n < config.num_hidden_layers:
                used.add(key)
    return used


def transfo_xl_parity(upstream: dict, state: dict, converted: RelPosForCausalLM, seed: int = 0, segments: int = 3,
                      length: int = 6, batch: int = 2) -> dict:
    """The converted model (its dtype) against the float64 reference over ``segments`` segments with memory from
    empty memories: the largest difference of log-probabilities and of memories, on random token ids."""
    upstream = transfo_xl_config(upstream)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, converted.config.vocab_size, (segments, batch, length), generator=generator)
    reference_state = {k: v.double() for k, v in state.items()}
    reference_mems = [torch.zeros(batch, 0, upstream["d_model"], dtype=torch.float64)] * upstream["n_layer"]
    mems = converted.init_mems(batch)
    log_prob_diff = mem_diff = 0.0
    device = next(converted.parameters()).device
    for s in range(segments):
        with torch.no_grad():
            expected, reference_mems = transfo_xl_reference(upstream, reference_state, ids[s], reference_mems)
            output = converted(input_ids=ids[s].to(device), mems=mems)
        mems = output.mems
        # NaN (a NaN weight) counts as infinitely far: Python's max would skip it
        log_prob_diff = max(log_prob_diff, (output.logits.double().cpu() - expected).abs().nan_to_num(math.inf).max().item())
        for ours, theirs in zip(mems, reference_mems):
            mem_diff = max(mem_diff, (ours.double().cpu() - theirs).abs().nan_to_num(math.inf).max().item())
    return {"max_abs_log_prob_diff": log_prob_diff, "max_abs_memory_diff": mem_diff, "segments": segments,
            "length": length, "batch": batch}


def check_transfo_xl_parity(upstream: dict, state: dict, converted: RelPosForCausalLM, seed: int = 0) -> dict:
    """:func:`transfo_xl_parity` in eval mode (the mode is restored); ``ValueError`` when the log-probabilities
    differ by more than ``LOG_PROB_TOLERANCE``."""
    training = converted.training
    try:
        parity = transfo_xl_parity(upstream, state, converted.eval(), seed)
    finally:
        converted.train(training)
    if not parity["max_abs_log_prob_diff"] <= LOG_PROB_TOLERANCE:
        raise ValueError(
            "the converted model does not reproduce the TransfoXL checkpoint (float64 reference, three segments with "
            f"memory): max |log-prob diff| {parity['max_abs_log_prob_diff']:.2e} (tolerance {LOG_PROB_TOLERANCE:g})"
        )
    return parity


# A small TransfoXLLMHeadModel's config.json (4.35.2's keys) for examples and checks; wt103's is WT103_CONFIG.
SMALL_CONFIG = {
    "model_type": "transfo-xl", "architectures": ["TransfoXLLMHeadModel"], "vocab_size": 60, "cutoffs": [20, 40],
    "d_model": 32, "d_embed": 32, "n_head": 4, "d_head": 8, "d_inner": 64, "div_val": 2, "pre_lnorm": False,
    "n_layer": 2, "mem_len": 8, "clamp_len": 16, "same_length": True, "proj_share_all_but_first": True,
    "attn_type": 0, "sample_softmax": -1, "adaptive": True, "dropout": 0.1, "dropatt": 0.0, "untie_r": True,
    "init": "normal", "init_range": 0.01, "proj_init_std": 0.01, "init_std": 0.02, "layer_norm_epsilon": 1e-5,
    "eos_token_id": 0, "tie_projs": [False, True, True],
}
WT103_CONFIG = {
    "model_type": "transfo-xl", "architectures": ["TransfoXLLMHeadModel"], **TRANSFO_XL_DEFAULTS,
    "tie_projs": [False, True, True, True],
}


def random_transfo_xl_state(upstream: dict, seed: int = 0) -> dict:
    """Random weights of a TransfoXLLMHeadModel under its 4.x names, as its ``save_pretrained`` writes them to
    safetensors (tied output tables and projections left out); norms and biases drawn too, so that a misplaced
    weight shows. For examples and checks: no TransfoXL (Transformers 5 has none) is needed."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, std=0.02, mean=0.0):
        return torch.randn(*shape, generator=generator) * std + mean

    d_model, heads, d_head, inner = upstream["d_model"], upstream["n_head"], upstream["d_head"], upstream["d_inner"]
    d_embed, div_val, cutoffs = upstream["d_embed"], upstream["div_val"], upstream["cutoffs"]
    edges = [0, *cutoffs, upstream["vocab_size"]]
    ties = upstream["tie_projs"]
    state = {}
    if div_val == 1:
        state["transformer.word_emb.emb_layers.0.weight"] = draw(edges[-1], d_embed)
        state["crit.out_layers.0.bias"] = draw(edges[-1])
        if d_model != d_embed:
            state["transformer.word_emb.emb_projs.0"] = draw(d_model, d_embed, std=0.01)
            state.update({f"crit.out_projs.{i}": draw(d_model, d_embed, std=0.01)
                          for i, tie in enumerate(ties) if not tie})
    else:
        for i, (low, high) in enumerate(zip(edges[:-1], edges[1:])):
            size = d_embed // div_val**i
            state[f"transformer.word_emb.emb_layers.{i}.weight"] = draw(high - low, size)
            state[f"transformer.word_emb.emb_projs.{i}"] = draw(d_model, size, std=0.01)
            state[f"crit.out_layers.{i}.bias"] = draw(high - low)
            if not ties[i]:
                state[f"crit.out_projs.{i}"] = draw(d_model, size, std=0.01)
    if cutoffs:
        state["crit.cluster_weight"], state["crit.cluster_bias"] = draw(len(cutoffs), d_embed), draw(len(cutoffs))
    for n in range(upstream["n_layer"]):
        p = f"transformer.layers.{n}."
        state[p + "dec_attn.qkv_net.weight"] = draw(3 * heads * d_head, d_model)
        state[p + "dec_attn.r_net.weight"] = draw(heads * d_head, d_model)
        state[p + "dec_attn.o_net.weight"] = draw(d_model, heads * d_head)
        state[p + "dec_attn.r_w_bias"], state[p + "dec_attn.r_r_bias"] = draw(heads, d_head), draw(heads, d_head)
        state[p + "pos_ff.CoreNet.0.weight"], state[p + "pos_ff.CoreNet.0.bias"] = draw(inner, d_model), draw(inner)
        state[p + "pos_ff.CoreNet.3.weight"], state[p + "pos_ff.CoreNet.3.bias"] = draw(d_model, inner), draw(d_model)
        for norm in ("dec_attn.layer_norm", "pos_ff.layer_norm"):
            state[p + norm + ".weight"], state[p + norm + ".bias"] = draw(d_model, mean=1.0), draw(d_model)
    state["transformer.pos_emb.inv_freq"] = 1 / 10000 ** (torch.arange(0.0, d_model, 2.0) / d_model)
    return state


def write_random_transfo_xl(folder: Union[str, Path], upstream: dict = SMALL_CONFIG, seed: int = 0) -> Path:
    """A TransfoXL folder as Transformers 4.x saved one (``config.json``, ``model.safetensors``) with random weights
    (:func:`random_transfo_xl_state`)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**upstream, "transformers_version": "4.35.2"}, indent=2))
    save_file(random_transfo_xl_state(upstream, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


__all__ = [
    "from_transfo_xl", "convert_transfo_xl_state", "transfo_xl_config", "transfo_xl_config_to_relpos",
    "transfo_xl_state_dict_to_relpos", "read_transfo_xl_folder", "transfo_xl_parity", "check_transfo_xl_parity",
    "write_random_transfo_xl", "random_transfo_xl_state", "LOG_PROB_TOLERANCE", "TRANSFO_XL_DEFAULTS",
    "SMALL_CONFIG", "WT103_CONFIG",
]
