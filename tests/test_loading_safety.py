"""A config.json that asks for more than its checkpoint holds is refused before anything is allocated.

Transformers 5.23 builds the model on the meta device, reads the weights, and then allocates every parameter the
checkpoint lacks or holds at another size: a tampered ``max_relative_position=10**9`` asked for 64 GB before its
error, ``num_hidden_layers=10**6`` spent minutes building the meta model. ``from_pretrained`` now compares the
config's shapes with the checkpoint's header first. The loads run in a subprocess whose address space is capped
(``RLIMIT_AS``: what it had after its imports, plus 3 GiB), so that a regression fails here instead of taking the
machine's memory; the remote-code loads run in a process that cannot import ``hf_relpos``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_relpos import (
    POSITION_ENCODINGS,
    RelPosConfig,
    RelPosForCausalLM,
    RelPosForConditionalGeneration,
    RelPosForSequenceClassification,
    RelPosModel,
)
from hf_relpos.configuration_relpos import CAUSAL_ONLY
from hf_relpos.loading_relpos import MISSING_VALUES_FLOOR, check_checkpoint_fits, parameter_fields
from tiny import make_model

BIG, DEEP = 10**9, 10**6
# In this process a regression would allocate what the config asks for: sizes that fit (tens of MB) but that
# still exceed what the checkpoint holds.
MID = 10**6
# What one refused load may take, in the subprocess, after a first load has warmed it up. Measured on 2 shared
# cores: at most 0.05 s through the installed classes; 0.2-0.6 s through AutoModel*(trust_remote_code=True), which
# copies and imports each folder's code before the check runs (the check itself: 5-50 ms).
SECONDS = {"installed": 1.0, "remote": 3.0}

# (name, class saved, scheme, preset, config.json edits, the field the error names)
BOMBS = [
    ("shaw_max_relative_position", "causal", "shaw", {"max_relative_position": BIG}, "max_relative_position"),
    ("learned_max_position_embeddings", "causal", "learned", {"max_position_embeddings": BIG}, "max_position_embeddings"),
    ("fire_mlp_width", "causal", "fire", {"fire_mlp_width": BIG}, "fire_mlp_width"),
    ("vocab_size", "causal", "alibi", {"vocab_size": BIG}, "vocab_size"),
    ("hidden_size", "causal", "alibi", {"hidden_size": BIG}, "hidden_size"),
    ("intermediate_size", "causal", "rope", {"intermediate_size": BIG}, "intermediate_size"),
    ("num_attention_heads", "causal", "kerple_log", {"num_attention_heads": BIG}, "num_attention_heads"),
    ("head_dim", "causal", "transformer_xl", {"head_dim": BIG}, "head_dim"),
    ("t5_buckets", "causal", "t5_bias",
     {"relative_attention_num_buckets": BIG, "relative_attention_max_distance": 2 * BIG}, "relative_attention_num_buckets"),
    ("num_hidden_layers", "causal", "t5_bias", {"num_hidden_layers": DEEP}, "num_hidden_layers"),
    # a scheme whose table the checkpoint lacks: Transformers would create and initialise it
    ("learned_table_not_in_checkpoint", "causal", "shaw",
     {"position_encoding": "learned", "max_position_embeddings": BIG}, "max_position_embeddings"),
    ("base_shaw_max_relative_position", "base", "shaw", {"max_relative_position": BIG}, "max_relative_position"),
    ("base_num_hidden_layers", "base", "alibi", {"num_hidden_layers": DEEP}, "num_hidden_layers"),
    ("base_vocab_size", "base", "nope", {"vocab_size": BIG}, "vocab_size"),
    ("seq2seq_learned_max_position_embeddings", "seq2seq", "learned", {"max_position_embeddings": BIG},
     "max_position_embeddings"),
    ("seq2seq_t5_buckets", "seq2seq", "t5_bias",
     {"relative_attention_num_buckets": BIG, "relative_attention_max_distance": 2 * BIG}, "relative_attention_num_buckets"),
    ("seq2seq_num_hidden_layers", "seq2seq", "t5_bias", {"num_hidden_layers": DEEP}, "num_hidden_layers"),
    ("seq2seq_num_decoder_layers", "seq2seq", "shaw", {"num_decoder_layers": DEEP}, "num_decoder_layers"),
    ("seq2seq_intermediate_size", "seq2seq", "alibi", {"intermediate_size": BIG}, "intermediate_size"),
]
# Fields that size no tensor: a huge value loads at once and allocates nothing more.
HARMLESS = [
    ("sinusoidal_max_position_embeddings", "causal", "sinusoidal", {"max_position_embeddings": BIG}),
    ("rope_max_position_embeddings", "causal", "rope", {"max_position_embeddings": BIG}),
    ("transformer_xl_mem_len", "causal", "transformer_xl", {"mem_len": BIG}),
    ("t5_max_distance", "causal", "t5_bias", {"relative_attention_max_distance": BIG}),
]
CLASSES = {
    "causal": ("RelPosForCausalLM", "AutoModelForCausalLM"),
    "base": ("RelPosModel", "AutoModel"),
    "seq2seq": ("RelPosForConditionalGeneration", "AutoModelForSeq2SeqLM"),
}

SCRIPT = r'''
import json, os, resource, sys, time, traceback

spec = json.loads(open(sys.argv[1]).read())
if spec["remote"]:
    import importlib.abc

    class _BlockHfRelpos(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_relpos" or name.startswith("hf_relpos."):
                raise ModuleNotFoundError(f"hf_relpos is blocked in this process: {name}", name=name)
            return None

    sys.meta_path.insert(0, _BlockHfRelpos())
import torch
import transformers

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
if spec["remote"]:
    load = lambda cls, folder: getattr(transformers, cls).from_pretrained(folder, trust_remote_code=True)
else:
    import hf_relpos
    load = lambda cls, folder: getattr(hf_relpos, cls).from_pretrained(folder)

for cls, folder in spec["warm_up"]:  # imports and remote-code modules, outside the timed loads
    load(cls, folder)
size = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
limit = size + (3 << 30)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
results = {}
for name, cls, folder in spec["cases"]:
    start = time.perf_counter()
    try:
        load(cls, folder)
        outcome = "loaded"
    except Exception as error:
        outcome = f"ValueError: {error}" if isinstance(error, ValueError) else traceback.format_exc()[-3000:]
    results[name] = {"outcome": outcome, "seconds": time.perf_counter() - start}
results["hf_relpos_imported"] = "hf_relpos" in sys.modules
json.dump(results, open(sys.argv[2], "w"))
'''

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_loading_safety")


def _save(kind: str, scheme: str, folder: Path) -> None:
    if kind == "seq2seq":
        model = make_model(RelPosForConditionalGeneration, scheme, preset="seq2seq")
    else:
        model = make_model(RelPosModel if kind == "base" else RelPosForCausalLM, scheme)
    model.save_pretrained(folder)


def _tamper(root: Path, name: str, kind: str, scheme: str, edits: dict) -> Path:
    folder = root / name
    _save(kind, scheme, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(edits)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _run(root: Path, remote: bool) -> dict:
    cases, warm_up = [], []
    for name, kind, scheme, edits, *_ in BOMBS + HARMLESS:
        folder = root / name
        cls = CLASSES[kind][remote]
        cases.append((name, cls, str(folder)))
    for kind, (installed, auto) in CLASSES.items():
        warm_up.append((auto if remote else installed, str(root / f"good_{kind}")))
    tag = "remote" if remote else "installed"
    (root / f"{tag}.json").write_text(json.dumps({"remote": remote, "cases": cases, "warm_up": warm_up}))
    (root / "script.py").write_text(SCRIPT)
    work = root / f"cwd_{tag}"
    work.mkdir()
    # The installed process imports hf_relpos as this one does; the remote one must not find it.
    dropped = ("PYTHONPATH", "HF_", "TRANSFORMERS_") if remote else ("HF_", "TRANSFORMERS_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(root / "hf_home"),
               HF_MODULES_CACHE=str(root / f"modules_{tag}"), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(root / "script.py"), str(root / f"{tag}.json"), str(root / f"{tag}-out.json")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((root / f"{tag}-out.json").read_text())


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    root = tmp_path_factory.mktemp("bombs")
    for name, kind, scheme, edits, *_ in BOMBS + HARMLESS:
        _tamper(root, name, kind, scheme, edits)
    for kind in CLASSES:
        _save(kind, "t5_bias", root / f"good_{kind}")
    return {"installed": _run(root, remote=False), "remote": _run(root, remote=True)}


@pytest.mark.parametrize("how", ["installed", "remote"])
@pytest.mark.parametrize("name,kind,scheme,edits,field", BOMBS, ids=[b[0] for b in BOMBS])
def test_a_config_asking_for_more_than_its_checkpoint_fails_at_once(loads, how, name, kind, scheme, edits, field):
    result = loads[how][name]
    value = edits[field]
    assert re.match(rf"ValueError: RelPosConfig\.(\w+=\d+, )*{field}={value}\b.* in .*{name}/config\.json", result["outcome"]), (
        result["outcome"]
    )
    assert "\n" not in result["outcome"]
    assert result["seconds"] < SECONDS[how], result


@pytest.mark.parametrize("how", ["installed", "remote"])
@pytest.mark.parametrize("name", [h[0] for h in HARMLESS])
def test_fields_that_size_no_tensor_load(loads, how, name):
    """A huge value of a field that sizes no tensor (positions, memory and distances are computed per forward for the
    tokens in use, never as a table of the config's size) loads within the address-space cap."""
    result = loads[how][name]
    assert result["outcome"] == "loaded", result["outcome"]
    assert result["seconds"] < SECONDS[how], result


def test_the_remote_process_never_imported_hf_relpos(loads):
    assert loads["remote"]["hf_relpos_imported"] is False
    assert loads["installed"]["hf_relpos_imported"] is True


# ---------------------------------------------------------------------------
# In process: the error's content, the bound on what a checkpoint may lack, sharded and state_dict loads
# ---------------------------------------------------------------------------


def test_the_error_names_the_field_the_shapes_and_the_files(tmp_path):
    folder = _tamper(tmp_path, "shaw", "causal", "shaw", {"max_relative_position": MID})
    with pytest.raises(ValueError) as excinfo:
        RelPosForCausalLM.from_pretrained(folder)
    assert str(excinfo.value) == (
        f"RelPosConfig.max_relative_position={MID} in {folder}/config.json gives "
        f"model.layers.0.self_attn.relative.rel_k the shape [{2 * MID + 1}, 8], but {folder}/model.safetensors holds "
        "[9, 8]: the config does not describe this checkpoint"
    )
    # Transformers raises a RuntimeError for weights of another size, and its common tests expect one.
    assert isinstance(excinfo.value, RuntimeError)


def test_a_sharded_checkpoint_is_checked_through_its_index(tmp_path):
    model = make_model(RelPosForCausalLM, "learned")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": MID}))
    with pytest.raises(ValueError, match=rf"max_position_embeddings={MID} .* but {tmp_path}/model.safetensors.index.json holds \[64, 32\]"):
        RelPosForCausalLM.from_pretrained(tmp_path)


def test_a_sharded_variant_loads_and_is_checked_through_its_index(tmp_path):
    """A variant's index is model.safetensors.index.<variant>.json: read as an index (it was read as a weights
    file, and every sharded variant failed to load)."""
    model = make_model(RelPosForCausalLM, "learned")
    model.save_pretrained(tmp_path, variant="v1", max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.v1.json").is_file()
    loaded = RelPosForCausalLM.from_pretrained(tmp_path, variant="v1")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": MID}))
    with pytest.raises(ValueError, match=rf"max_position_embeddings={MID} .* but .*index.v1.json holds \[64, 32\]"):
        RelPosForCausalLM.from_pretrained(tmp_path, variant="v1")


@pytest.mark.parametrize("shard", ["x.bin", "../elsewhere.safetensors"])
def test_an_index_naming_a_file_of_another_kind_or_outside_the_folder_is_refused(tmp_path, shard):
    """The check reads only the folder's own .safetensors shards (a .bin was unpickled by it, a path outside the
    folder read): a ValueError naming the index and the file."""
    folder = tmp_path / "model"
    make_model(RelPosForCausalLM, "learned").save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    (folder / "x.bin").write_bytes(b"not a pickle" * 10)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": shard}}))
    with pytest.raises(ValueError, match=rf"model.safetensors.index.json names '{re.escape(shard)}' as a weights file"):
        RelPosForCausalLM.from_pretrained(folder)


def test_a_state_dict_is_checked_too():
    model = make_model(RelPosForCausalLM, "shaw")
    config = RelPosConfig(**{**model.config.to_dict(), "max_relative_position": MID})
    with pytest.raises(ValueError, match=rf"max_relative_position={MID} in the config given .* but the state_dict holds"):
        RelPosForCausalLM.from_pretrained(None, config=config, state_dict=model.state_dict())


def test_ignore_mismatched_sizes_is_bounded_by_what_the_checkpoint_holds(tmp_path):
    """With ``ignore_mismatched_sizes=True`` Transformers re-initialises a mismatched parameter at the config's size:
    a small one loads as before, a huge one counts against the bound on what a checkpoint may lack."""
    folder = _tamper(tmp_path, "small", "causal", "shaw", {"max_relative_position": 6})
    model = RelPosForCausalLM.from_pretrained(folder, ignore_mismatched_sizes=True)
    assert model.model.layers[0].self_attn.relative.rel_k.shape == (13, 8)
    folder = _tamper(tmp_path, "huge", "causal", "shaw", {"max_relative_position": MID})
    with pytest.raises(ValueError, match=rf"max_relative_position={MID}, head_dim=8 in .* asks for .*rel_k \[{2 * MID + 1}, 8\], "
                                         r"which .* does not hold: the [\d,]+ values it lacks are more than"):
        RelPosForCausalLM.from_pretrained(folder, ignore_mismatched_sizes=True)


def test_what_a_checkpoint_lacks_within_the_bound_still_loads(tmp_path):
    """A new classification head, a deeper model, another scheme's table: Transformers initialises what the
    checkpoint lacks and names it in its load report; that stays allowed up to the bound."""
    folder = tmp_path / "lm"
    make_model(RelPosForCausalLM, "shaw").save_pretrained(folder)
    model = RelPosForSequenceClassification.from_pretrained(folder, num_labels=3)
    assert model.score.weight.shape == (3, 32)
    assert len(RelPosForCausalLM.from_pretrained(folder, num_hidden_layers=4).model.layers) == 4
    # just over and just under the bound (the checkpoint holds fewer values than MISSING_VALUES_FLOOR)
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    fits = 2 + MISSING_VALUES_FLOOR // per_layer
    deeper = {**model.config.to_dict(), "num_hidden_layers": fits + 1}
    with pytest.raises(ValueError, match=rf"RelPosConfig\.num_hidden_layers={fits + 1} in the config given, but .* holds "
                                         r"2 layers: the [\d,]+ values it lacks are more than a checkpoint may lack \(16,777,216"):
        RelPosForCausalLM.from_pretrained(folder, config=RelPosConfig(**deeper))
    # (the check alone: loading would build and initialise those 1,300 layers)
    check_checkpoint_fits(RelPosForCausalLM, str(folder), {"config": RelPosConfig(**{**deeper, "num_hidden_layers": fits})})


def test_a_folder_without_weights_is_left_to_transformers(tmp_path):
    make_model(RelPosForCausalLM, "shaw").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(OSError, match="model.safetensors"):
        RelPosForCausalLM.from_pretrained(tmp_path)


def _all_parameters():
    """Every parameter name and shape of every model class and scheme, with biases, a gated MLP and untied output."""
    sizes = dict(vocab_size=101, hidden_size=22, num_attention_heads=3, head_dim=6, intermediate_size=13,
                 max_position_embeddings=17, relative_attention_num_buckets=11, relative_attention_max_distance=19,
                 max_relative_position=4, fire_mlp_width=23, attention_bias=True, tie_word_embeddings=False,
                 feed_forward_proj="gated-gelu", num_hidden_layers=1, num_decoder_layers=1)
    for scheme in POSITION_ENCODINGS:
        for cls, extra in ((RelPosForCausalLM, {}), (RelPosModel, {}), (RelPosForSequenceClassification, {"num_labels": 5}),
                           (RelPosForConditionalGeneration, {"is_encoder_decoder": True})):
            if scheme in CAUSAL_ONLY and cls is RelPosForConditionalGeneration:
                continue
            config = RelPosConfig(position_encoding=scheme, **sizes, **extra)
            with torch.device("meta"):
                model = cls(config)
            for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
                yield config, name, tuple(tensor.shape)


def test_every_parameter_names_the_fields_that_size_it():
    """The table that names the field in the error covers every parameter, and names the right fields: each
    dimension is the product of its fields (2 * max_relative_position + 1 for Shaw's tables)."""
    seen = 0
    for config, name, shape in _all_parameters():
        dims = parameter_fields(name)
        assert dims is not None and len(dims) == len(shape), (name, shape, dims)
        for size, fields in zip(shape, dims):
            product = 1
            for field in fields:
                product *= getattr(config, field)
            expected = 2 * product + 1 if fields == ("max_relative_position",) else product
            assert size == expected, (name, shape, dims)
        seen += 1
    assert seen > 300


def test_the_weights_file_a_config_names_is_the_one_checked(tmp_path):
    """``transformers_weights`` in config.json names the weights file Transformers reads: it is checked too."""
    make_model(RelPosForCausalLM, "shaw").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(transformers_weights="weights.safetensors", max_relative_position=MID)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"max_relative_position={MID} .* but {tmp_path}/weights.safetensors holds \[9, 8\]"):
        RelPosForCausalLM.from_pretrained(tmp_path)
