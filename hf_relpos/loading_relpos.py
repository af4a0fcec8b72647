"""Loading: a checkpoint's config checked against its weights before anything is allocated, and the Auto classes'
refusals of a config of the other kind of model.

Transformers builds the model on the meta device, reads the weights and only then allocates every parameter the
checkpoint lacks or holds at another size (to report it): a config.json whose max_relative_position is 1e9 asked
for 64 GB before any error, and num_hidden_layers=1e6 spent minutes building the meta model. So
``RelPosPreTrainedModel.from_pretrained`` first reads the checkpoint's header (shapes only) and compares it with the
shapes the config gives (``check_checkpoint_fits``).
"""

import copy
import dataclasses
import itertools
import json
import math
import os
import re
from typing import Optional

import torch

from transformers import PreTrainedConfig
from transformers.modeling_utils import load_state_dict

from .configuration_relpos import RelPosConfig
from .position_schemes_relpos import POSITION_SCHEMES

# The config fields that size each dimension of each parameter (by the end of its name), to name the field when a
# config does not describe its checkpoint (tests/test_loading_safety.py checks that every parameter matches one).
_HEADS = ("num_attention_heads", "head_dim")
_PARAMETER_FIELDS = (
    (r"(embed_tokens|shared|lm_head)\.weight", (("vocab_size",), ("hidden_size",))),
    (r"(q_proj|k_proj|v_proj)\.weight", (_HEADS, ("hidden_size",))),
    (r"(q_proj|k_proj|v_proj)\.bias", (_HEADS,)),
    (r"o_proj\.weight", (("hidden_size",), _HEADS)),
    (r"(o_proj|down_proj)\.bias|\w*norm\.(weight|bias)", (("hidden_size",),)),
    (r"(up_proj|gate_proj)\.weight", (("intermediate_size",), ("hidden_size",))),
    (r"(up_proj|gate_proj)\.bias", (("intermediate_size",),)),
    (r"down_proj\.weight", (("hidden_size",), ("intermediate_size",))),
    (r"score\.weight", (("num_labels",), ("hidden_size",))),
    # adaptive input and softmax (cutoffs): clusters of vocab_size cut at cutoffs, vectors sized by div_val
    (r"(emb_layers|out_layers)\.\d+\.weight", (("vocab_size", "cutoffs"), ("embedding_size", "div_val"))),
    (r"out_layers\.\d+\.bias", (("vocab_size", "cutoffs"),)),
    (r"(emb_projs|out_projs)\.\d+\.weight", (("hidden_size",), ("embedding_size", "div_val"))),
    (r"cluster_weight", (("cutoffs",), ("embedding_size",))),
    (r"cluster_bias", (("cutoffs",),)),
) + tuple(entry for scheme in dict.fromkeys(POSITION_SCHEMES.values()) for entry in scheme.parameter_fields)
# What a checkpoint may lack (parameters Transformers creates and initialises, non-persistent buffers): as many
# values as it holds, and at least this many (a new classification head or position table on a tiny model).
MISSING_VALUES_FLOOR = 1 << 24


class CheckpointMismatchError(ValueError, RuntimeError):
    """A config that does not describe its checkpoint: a ValueError (a wrong input, named), and the RuntimeError
    Transformers' ``from_pretrained`` raises for weights of another size (its common model tests expect that)."""


def parameter_fields(name: str) -> Optional[tuple]:
    """The config fields sizing each dimension of the parameter ``name`` (None: not a parameter of these models)."""
    for pattern, dims in _PARAMETER_FIELDS:
        if re.search(rf"(^|\.)({pattern})$", name):
            return dims
    return None


def _named_fields(config, config_file: Optional[str], fields: list) -> str:
    """``RelPosConfig.<field>=<value>, ... in <config.json>`` (or ``in the config given`` where the file does not
    hold that value: a config object or a keyword argument of ``from_pretrained`` set it)."""
    if not fields:
        return "the config"
    named = "RelPosConfig." + ", ".join(f"{field}={getattr(config, field)}" for field in fields)
    if config_file is not None:
        try:
            with open(config_file) as file:
                saved = json.load(file)
        except (OSError, ValueError):
            saved = {}
        if saved.get(fields[0]) == getattr(config, fields[0]):
            return f"{named} in {config_file}"
    return f"{named} in the config given"


def _fields_sizing(name: str, shape: tuple, held: Optional[tuple] = None) -> list:
    """The config fields sizing the dimensions of parameter ``name`` that differ from ``held`` (all without)."""
    dims = parameter_fields(name)
    if dims is None or len(dims) != len(shape):
        return []
    differ = [i for i in range(len(shape)) if held is None or len(held) != len(shape) or held[i] != shape[i]]
    return list(dict.fromkeys(field for i in differ for field in dims[i])) or [f for dim in dims for f in dim]


def _add_variant(name: str, variant: Optional[str]) -> str:
    """``model.safetensors`` -> ``model.<variant>.safetensors``, as Transformers names a variant's files."""
    if not variant:
        return name
    stem, extension = name.rsplit(".", 1)
    return f"{stem}.{variant}.{extension}"


def _checkpoint_files(folder: str, subfolder: str, variant, use_safetensors, config) -> Optional[tuple[list, str]]:
    """The weight files ``from_pretrained`` reads in a local ``folder`` (as Transformers 5.23 resolves them), and the
    name to report; None where there are none (Transformers then says so)."""
    base = os.path.join(folder, subfolder or "")
    explicit = getattr(config, "transformers_weights", None)
    if explicit is not None:
        if not isinstance(explicit, str):
            raise ValueError(f"RelPosConfig.transformers_weights must be a file name in the folder, got {explicit!r}")
        if not _inside(base, explicit) or not explicit.endswith((".safetensors", ".safetensors.index.json")):
            return None  # Transformers refuses a file outside the folder, or of another kind
        names = [explicit]
    else:
        names = []
        if use_safetensors is not False:
            names += [_add_variant("model.safetensors", variant), _add_variant("model.safetensors.index.json", variant)]
        if not use_safetensors:
            names += [_add_variant("pytorch_model.bin", variant), _add_variant("pytorch_model.bin.index.json", variant)]
    for name in names:
        path = os.path.join(base, name)
        if not os.path.isfile(path):
            continue
        if not name.endswith(".json"):  # an index: model.safetensors.index.json, or .index.<variant>.json
            return [path], path
        with open(path) as index:
            weight_map = json.load(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{path} is not a weights index: it needs a weight_map naming each parameter's file")
        kind = "safetensors" if ".safetensors" in name else "bin"  # as the index's own name
        for shard in weight_map.values():  # read here before Transformers reads them: only the folder's own files
            if not _inside(base, shard) or not shard.endswith(f".{kind}"):
                raise ValueError(f"{path} names {shard!r} as a weights file: it must be a .{kind} file in the folder")
        return [os.path.join(base, shard) for shard in sorted(set(weight_map.values()))], path
    return None


def _inside(base: str, name: str) -> bool:
    return os.path.abspath(os.path.join(base, name)).startswith(os.path.abspath(base) + os.sep)


def check_checkpoint_fits(cls, folder, kwargs: dict) -> None:
    """Raise ``ValueError`` naming the config field when the config asks for a parameter of another shape than the
    checkpoint's, or for more values the checkpoint lacks than it holds (``MISSING_VALUES_FLOOR`` at least).

    Reads the local folder's config and the weight files' headers (or a ``state_dict``'s shapes) and builds the
    model on the meta device with no more layers than the checkpoint holds; a Hub id is left to Transformers.
    """
    state_dict, config = kwargs.get("state_dict"), kwargs.get("config")
    subfolder = kwargs.get("subfolder") or ""
    local = folder is not None and os.path.isdir(folder)
    if kwargs.get("gguf_file") is not None or (state_dict is None and not local):
        return
    if isinstance(config, PreTrainedConfig):  # AutoConfig records the folder it read as name_or_path
        config_file = os.path.join(config.name_or_path or "", subfolder, "config.json") if config.name_or_path else None
    else:
        config_file = config if config is not None else folder
        if config_file is None or not os.path.exists(config_file):
            return
        if os.path.isdir(config_file):
            config_file = os.path.join(config_file, subfolder, "config.json")
            if not os.path.isfile(config_file):  # an adapter's folder: Transformers loads the base model it names
                return
        # The kwargs that set config fields, as Transformers passes them to the config (dtype is the model's).
        names = {f.name for f in dataclasses.fields(cls.config_class)} | {"num_labels"}
        overrides = {k: v for k, v in kwargs.items() if k in names and k != "dtype"}
        config = cls.config_class.from_pretrained(config_file, **overrides)
    if state_dict is not None:
        shapes, where = {k: tuple(v.shape) for k, v in state_dict.items()}, "the state_dict"
    else:
        found = _checkpoint_files(folder, subfolder, kwargs.get("variant"), kwargs.get("use_safetensors"), config)
        if found is None:
            return
        files, where = found
        shapes = {}
        for file in files:
            meta = load_state_dict(file, map_location="meta", weights_only=kwargs.get("weights_only", True))
            shapes.update((k, tuple(v.shape)) for k, v in meta.items())
    for pattern, replacement in (kwargs.get("key_mapping") or {}).items():  # as Transformers renames keys
        shapes = {re.sub(pattern, replacement, k): v for k, v in shapes.items()}
    _compare_shapes(cls, config, shapes, config_file, where, bool(kwargs.get("ignore_mismatched_sizes")))


def _compare_shapes(cls, config, shapes: dict, config_file, where: str, ignore_mismatched_sizes: bool) -> None:
    prefix = cls.base_model_prefix
    built, layers = copy.deepcopy(config), []
    for field, stack in cls._layer_stacks:
        pattern = re.compile(rf"^(?:{prefix}\.)?{stack}layers\.(\d+)\.")
        wanted = getattr(config, field)
        held = {int(m.group(1)) for key in shapes if (m := pattern.match(key))}
        count = max(1, min(wanted, len([i for i in held if i < wanted])))
        setattr(built, field, count)  # the meta model gets no more layers than the checkpoint holds
        layers.append((field, stack, pattern, wanted, count, len(held)))
    with torch.device("meta"):
        model = cls(built)
    missing, mismatched = [], []
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        shape = tuple(tensor.shape)
        key = next((k for k in (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")) if k in shapes), None)
        if key is None or (shapes[key] != shape and ignore_mismatched_sizes):
            missing.append((math.prod(shape), name, shape))
        elif shapes[key] != shape:
            mismatched.append((math.prod(shape), name, shape, shapes[key]))
    if mismatched:
        _, name, shape, held = max(mismatched, key=lambda m: m[0])
        raise CheckpointMismatchError(
            f"{_named_fields(config, config_file, _fields_sizing(name, shape, held))} gives {name} the shape "
            f"{list(shape)}, but {where} holds {list(held)}: the config does not describe this checkpoint"
        )
    lacking = sum(size for size, *_ in missing)
    extra = []
    for field, stack, pattern, wanted, count, held in layers:
        per_layer = sum(t.numel() for n, t in model.named_parameters() if (m := pattern.match(n)) and m.group(1) == "0")
        extra.append(((wanted - count) * per_layer, field, wanted, held))
        lacking += (wanted - count) * per_layer
    allowed = max(sum(math.prod(shape) for shape in shapes.values()), MISSING_VALUES_FLOOR)
    if lacking <= allowed:
        return
    bound = (
        f"the {lacking:,} values it lacks are more than a checkpoint may lack ({allowed:,}: as many as it holds, at "
        f"least {MISSING_VALUES_FLOOR:,})"
    )
    values, field, wanted, held = max(extra, key=lambda e: e[0])
    if not missing or values >= max(size for size, *_ in missing):
        raise CheckpointMismatchError(f"{_named_fields(config, config_file, [field])}, but {where} holds {held} layers: {bound}")
    _, name, shape = max(missing, key=lambda m: m[0])
    raise CheckpointMismatchError(
        f"{_named_fields(config, config_file, _fields_sizing(name, shape))} asks for {name} {list(shape)}, which "
        f"{where} does not hold: {bound}"
    )


# ----------------------------------------------------------------------------------
# The Auto classes: the folder's auto_map, and a config of the other kind of model refused
# ----------------------------------------------------------------------------------

AUTO_MAP = {
    "AutoConfig": "configuration_relpos.RelPosConfig",
    "AutoModel": "modeling_relpos.RelPosModel",
    "AutoModelForCausalLM": "modeling_relpos.RelPosForCausalLM",
    "AutoModelForSequenceClassification": "modeling_relpos.RelPosForSequenceClassification",
    "AutoModelForSeq2SeqLM": "modeling_relpos.RelPosForConditionalGeneration",
}


_STACKS = ("RelPosModel", "RelPosCrossDecoder")  # an encoder-decoder's encoder and decoder classes
AUTO_CLASS_OF = {
    "RelPosModel": "AutoModel",
    "RelPosForCausalLM": "AutoModelForCausalLM",
    "RelPosForSequenceClassification": "AutoModelForSequenceClassification",
    "RelPosForConditionalGeneration": "AutoModelForSeq2SeqLM",
}


def check_holds(name: str, config: RelPosConfig, encoder_decoder: bool) -> None:
    """Raise ``ValueError`` when ``config`` describes the other kind of model than class ``name`` holds (an
    encoder-decoder's or a decoder-only one's): Transformers would build it and load none of the weights.
    One stack saved alone (``model.encoder.save_pretrained``: ``is_encoder_decoder`` with architectures
    ``RelPosModel`` or ``RelPosCrossDecoder``) is held by ``RelPosModel`` alone."""
    saved = next(iter(getattr(config, "architectures", None) or []), None)
    stack = bool(config.is_encoder_decoder) and saved in _STACKS
    if stack and name in _STACKS:
        return
    if stack:
        raise ValueError(
            f"{name} cannot hold one stack of an encoder-decoder (config.is_encoder_decoder=True, saved from {saved}: "
            "its encoder or decoder saved alone): load it with AutoModel (RelPosModel)"
        )
    if bool(config.is_encoder_decoder) == encoder_decoder:
        return
    if encoder_decoder:
        instead = (f"{AUTO_CLASS_OF[saved]} (it was saved from {saved})" if saved in AUTO_CLASS_OF
                   else "AutoModelForCausalLM, AutoModel or AutoModelForSequenceClassification")
        raise ValueError(
            f"{name} holds an encoder-decoder (config.is_encoder_decoder=True), got is_encoder_decoder=False (a "
            f"decoder-only config): load it with {instead}"
        )
    raise ValueError(
        f"{name} cannot hold an encoder-decoder config (config.is_encoder_decoder=True"
        + (f", saved from {saved}" if saved else "")
        + "): load it with AutoModelForSeq2SeqLM (RelPosForConditionalGeneration"
        + ("; its stacks are its .encoder and .decoder)" if name == "RelPosModel" else ")")
    )
