"""Reliability tests: PEFT LoRA, mixed precision, fully masked rows, save/load integrity.

Every model is tiny and random (hidden 32, 4 heads, 2 layers, vocab 60); nothing is downloaded,
all folders live under ``tmp_path``. Every test runs for all eight position schemes.

1. PEFT LoRA on ``q_proj``/``v_proj``: only adapter weights train, the adapter saves as
   safetensors and ``PeftModel.from_pretrained`` on a base reloaded through the Auto classes
   reproduces the trained model's logits and greedy tokens.
2. Mixed precision: a bf16 autocast training step, bf16 and fp16 inference of a padded batch
   (one row fully padded) close to fp32, under sdpa and eager.
3. Fully masked query rows: finite logits, loss and gradients in fp32, bf16 and fp16, and the
   same result under both backends.
4. Save/load integrity: bit-identical round trips (both heads, fp32 and bf16), weights from
   another configuration refused, truncated files refused, unknown schemes refused, no pickle.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from hf_relpos import (
    POSITION_ENCODINGS,
    RelPosConfig,
    RelPosForCausalLM,
    RelPosForSequenceClassification,
    RelPosModel,
)
from tiny import make_model
from tiny import tiny_config as shared_tiny_config
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

torch.set_num_threads(1)

SCHEMES = POSITION_ENCODINGS
IMPLS = ("sdpa", "eager")
HALF_DTYPES = (torch.bfloat16, torch.float16)
ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
VOCAB = 60
PAD = 0
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

# Half precision vs fp32 on the non-padded positions, as max |diff| / max |fp32 logit|.
# Measured on these models (torch 2.13 CPU, all schemes, both backends): bf16 <= 0.022,
# fp16 <= 0.0022 (bf16 has 8 mantissa bits, fp16 11). Tolerances leave ~2x headroom; a scheme
# whose position term is lost or mis-cast in half precision is off by O(1).
HALF_TOLERANCE = {torch.bfloat16: 0.05, torch.float16: 0.01}

# bf16 autocast training vs fp32 on a batch without fully masked rows. Measured: loss within
# 0.2%, gradient relative L2 error <= 0.05 (all schemes, both backends).
AUTOCAST_LOSS_RTOL = 0.02
AUTOCAST_GRAD_RTOL = 0.15


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def tiny_config(position_encoding: str, **overrides) -> RelPosConfig:
    return shared_tiny_config(position_encoding, **{"vocab_size": VOCAB, "pad_token_id": PAD, **overrides})


def make(cls, position_encoding: str, impl: str = "sdpa", seed: int = 0, **overrides):
    return make_model(cls, position_encoding, impl, seed, **{"vocab_size": VOCAB, "pad_token_id": PAD, **overrides})


def padded_batch():
    """[3, 10] ids: row 0 unpadded, row 1 left-padded by 4, row 2 fully padded."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (3, 10), generator=g)
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    input_ids[1, :4] = PAD
    attention_mask[1, :4] = 0
    input_ids[2] = PAD
    attention_mask[2] = 0
    assert attention_mask[2].sum() == 0  # a fully padded row: every query row of it has no key
    return input_ids, attention_mask


def right_padded_batch():
    """[3, 10] ids, right padding only: every query row keeps at least one key (causal)."""
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(3, VOCAB, (3, 10), generator=g)
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    input_ids[1, 7:] = PAD
    attention_mask[1, 7:] = 0
    return input_ids, attention_mask


def ignore_padding(input_ids, attention_mask):
    return input_ids.masked_fill(attention_mask == 0, -100)


def grads_of(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name} got no gradient"
            out[name] = p.grad.detach().float().clone()
    return out


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[k].flatten() for k in sorted(grads)])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def files_in(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def assert_no_pickle(folder: Path):
    pickled = sorted(n for n in files_in(folder) if n.endswith(PICKLE_SUFFIXES))
    assert not pickled, f"pickle-format files written to {folder.name}: {pickled}"


def assert_state_dicts_equal(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, f"{key}: {sa[key].dtype} vs {sb[key].dtype}"
        assert sa[key].shape == sb[key].shape, key
        assert torch.equal(sa[key], sb[key]), f"state_dict[{key!r}] differs after save/load"


def assert_no_loading_problems(info: dict):
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(kind), f"{kind}: {info.get(kind)}"


@contextlib.contextmanager
def transformers_log():
    """Collect what Transformers logs (its library logger does not propagate to the root logger)."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    root = logging.getLogger("transformers")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()  # the default; TRANSFORMERS_VERBOSITY may have raised it
    root.addHandler(handler)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        transformers.logging.set_verbosity(verbosity)


# ---------------------------------------------------------------------------
# 1. PEFT LoRA
# ---------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT calls it
@pytest.mark.parametrize("position_encoding", SCHEMES)
def test_peft_lora_train_save_reload(tmp_path, position_encoding):
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.tuners.lora import LoraLayer

    base = make(RelPosForCausalLM, position_encoding)
    # Save the base before wrapping: get_peft_model injects the LoRA layers into `base` in place,
    # so a base saved afterwards holds `base_layer`/`lora_*` keys (PEFT's behaviour, Llama too).
    base_folder = tmp_path / "base"
    base.save_pretrained(base_folder)
    before = {name: p.detach().clone() for name, p in base.named_parameters()}
    base_params = dict(base.named_parameters())

    model = get_peft_model(
        base, LoraConfig(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM")
    )
    wrapped = sorted(name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LoraLayer))
    assert wrapped == ["q_proj", "q_proj", "v_proj", "v_proj"], wrapped
    trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    expected = sorted(
        f"base_model.model.model.layers.{i}.self_attn.{proj}.lora_{ab}.default.weight"
        for i in range(2)
        for proj in ("q_proj", "v_proj")
        for ab in "AB"
    )
    assert trainable == expected, f"only the LoRA matrices may train, got {trainable}"
    assert all(not p.requires_grad for p in base_params.values()), "a base weight is trainable"

    # A learnable batch: each row repeats a short pattern.
    g = torch.Generator().manual_seed(3)
    pattern = torch.randint(3, VOCAB, (4, 4), generator=g)
    train_ids = pattern.repeat(1, 3)  # [4, 12]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(10):
        loss = model(input_ids=train_ids, labels=train_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.1, f"LoRA training did not lower the loss: {losses}"
    for name, p in model.named_parameters():
        if "lora_B" in name:  # initialised to zero by PEFT: training must have moved it
            assert p.abs().max() > 0, f"{name} did not change"
    for name, p in base_params.items():  # the base stayed frozen, bit for bit
        assert torch.equal(p.detach(), before[name]), f"base weight {name} changed during LoRA training"

    adapter_folder = tmp_path / "adapter"
    model.save_pretrained(adapter_folder)
    names = files_in(adapter_folder)
    assert "adapter_model.safetensors" in names and "adapter_config.json" in names, names
    assert_no_pickle(adapter_folder)
    saved = load_file(adapter_folder / "adapter_model.safetensors")
    assert saved and all("lora_" in key for key in saved), sorted(saved)

    reloaded_base, info = AutoModelForCausalLM.from_pretrained(
        base_folder, trust_remote_code=True, output_loading_info=True
    )
    assert_no_loading_problems(info)
    reloaded = PeftModel.from_pretrained(reloaded_base, adapter_folder).eval()
    assert not any(p.requires_grad for p in reloaded.parameters())

    input_ids, attention_mask = padded_batch()
    input_ids, attention_mask = input_ids[:2], attention_mask[:2]
    with torch.no_grad():
        expected_logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        got = reloaded(input_ids=input_ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    assert (got - expected_logits)[keep].abs().max().item() <= 1e-6, "reloaded adapter gives other logits"

    prompt = train_ids[:1, :5]
    with torch.no_grad():
        tokens = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
        tokens_reloaded = reloaded.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens, tokens_reloaded)

    merged = reloaded.merge_and_unload()  # LoRA folds into hf_relpos' own Linear layers
    assert type(merged) is RelPosForCausalLM
    with torch.no_grad():
        merged_logits = merged(input_ids=input_ids, attention_mask=attention_mask).logits
    assert (merged_logits - expected_logits)[keep].abs().max().item() <= 1e-5


# ---------------------------------------------------------------------------
# 2. Mixed precision
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", SCHEMES)
def test_autocast_bf16_training_step(position_encoding, impl):
    input_ids, attention_mask = right_padded_batch()
    labels = ignore_padding(input_ids, attention_mask)

    reference = make(RelPosForCausalLM, position_encoding, impl).train()
    model = copy.deepcopy(reference)
    ref_loss = reference(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    ref_loss.backward()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits.dtype == torch.bfloat16, "autocast did not reach the model's matmuls"
    assert torch.isfinite(out.loss), out.loss
    out.loss.backward()
    grads = grads_of(model)  # every parameter (T5 table, Shaw/XL per-layer terms, ...) gets one
    for name, g in grads.items():
        assert torch.isfinite(g).all(), f"non-finite gradient in {name}"
    assert abs(out.loss.item() - ref_loss.item()) <= AUTOCAST_LOSS_RTOL * ref_loss.item()
    err = relative_error(flat(grads), flat(grads_of(reference)))
    assert err <= AUTOCAST_GRAD_RTOL, f"bf16 autocast gradients off by {err:.3f} (relative L2)"

    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        again = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    assert torch.isfinite(again)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", SCHEMES)
def test_half_precision_inference_on_padded_batch(position_encoding, impl, dtype):
    # fp16 on CPU: every op the models use (matmul, SDPA, softmax, embedding, RMSNorm) runs in
    # torch 2.13; an unsupported op would raise here, not be skipped.
    input_ids, attention_mask = padded_batch()
    model = make(RelPosForCausalLM, position_encoding, impl)
    with torch.no_grad():
        reference = model(input_ids=input_ids, attention_mask=attention_mask).logits
    half = copy.deepcopy(model).to(dtype)
    assert half.config._attn_implementation == impl
    with torch.no_grad():
        logits = half(input_ids=input_ids, attention_mask=attention_mask).logits
    assert logits.dtype == dtype
    assert torch.isfinite(logits).all(), "non-finite logits (the fully padded row included)"
    keep = attention_mask.bool()
    scale = reference[keep].abs().max().item()
    diff = (logits.float() - reference)[keep].abs().max().item()
    assert diff <= HALF_TOLERANCE[dtype] * scale, f"{dtype} vs fp32: {diff / scale:.4f} of max |logit|"


# ---------------------------------------------------------------------------
# 3. Fully masked query rows
# ---------------------------------------------------------------------------


def _check_finite(out, model, what):
    assert torch.isfinite(out.logits).all(), f"{what}: non-finite logits"
    assert out.loss is not None and torch.isfinite(out.loss), f"{what}: loss {out.loss}"
    out.loss.backward()
    for name, g in grads_of(model).items():
        assert torch.isfinite(g).all(), f"{what}: non-finite gradient in {name}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", SCHEMES)
def test_fully_masked_rows_finite_in_every_dtype(position_encoding, impl):
    input_ids, attention_mask = padded_batch()
    for dtype in ALL_DTYPES:
        body = make(RelPosModel, position_encoding, impl).to(dtype)
        with torch.no_grad():
            hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        assert hidden.dtype == dtype and torch.isfinite(hidden).all(), f"{dtype}: RelPosModel hidden states"

        for name, labels in (
            ("labels on every token", input_ids.clone()),  # the loss reads the fully masked rows too
            ("padding ignored", ignore_padding(input_ids, attention_mask)),
            ("every label ignored", torch.full_like(input_ids, -100)),
        ):
            model = make(RelPosForCausalLM, position_encoding, impl).to(dtype).train()
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
            _check_finite(out, model, f"causal LM {dtype} {name}")

        for is_decoder in (True, False):
            model = make(
                RelPosForSequenceClassification, position_encoding, impl, num_labels=3, is_decoder=is_decoder
            ).to(dtype).train()
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=torch.tensor([0, 1, 2]))
            _check_finite(out, model, f"sequence classification {dtype} is_decoder={is_decoder}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position_encoding", SCHEMES)
def test_float64_padded_batch_finite(position_encoding, impl):
    """model.double() (e.g. for gradcheck) keeps fully masked rows finite and matches fp32."""
    input_ids, attention_mask = padded_batch()
    model = make(RelPosForCausalLM, position_encoding, impl)
    with torch.no_grad():
        reference = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = model.double()(input_ids=input_ids, attention_mask=attention_mask).logits
    assert logits.dtype == torch.float64
    keep = attention_mask.bool()
    bad = (~torch.isfinite(logits)).any(-1)
    count = int(bad.sum())
    assert count == 0, (
        f"non-finite float64 logits at {bad.sum().item()} positions, {(bad & keep).sum().item()} of them not padding"
    )
    assert (logits.float() - reference)[keep].abs().max().item() <= 1e-4


@pytest.mark.parametrize("position_encoding", SCHEMES)
def test_fully_masked_rows_same_under_both_backends(position_encoding):
    """A query row with no key left gives the same output (zeros from attention) under sdpa and eager.

    With left padding the causal LM loss reads the logits of the last padding position (they
    predict the first real token), so this decides the loss and the gradients of ordinary
    left-padded training batches, not only values at positions nobody looks at.
    """
    input_ids, attention_mask = padded_batch()
    labels = ignore_padding(input_ids, attention_mask)
    results = {}
    for impl in IMPLS:
        model = make(RelPosForCausalLM, position_encoding, impl).train()
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        out.loss.backward()
        results[impl] = (out.logits.detach(), out.loss.item(), flat(grads_of(model)))
    (eager_logits, eager_loss, eager_grads), (sdpa_logits, sdpa_loss, sdpa_grads) = results["eager"], results["sdpa"]
    masked_rows = (eager_logits - sdpa_logits).abs().amax(-1)[attention_mask == 0].max().item()
    err = relative_error(sdpa_grads, eager_grads)
    assert masked_rows <= 1e-5 and abs(eager_loss - sdpa_loss) <= 1e-5 and err <= 1e-4, (
        f"sdpa vs eager with fully masked query rows: logits of those rows differ by {masked_rows:.3g}, "
        f"loss {sdpa_loss:.6f} vs {eager_loss:.6f}, gradients by {err:.3g} (relative L2)"
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_transformer_xl_memory_fully_masked_row(impl):
    """A row whose memory and current tokens are all masked: finite in every dtype."""
    input_ids, _ = padded_batch()
    for dtype in ALL_DTYPES:
        model = make(RelPosForCausalLM, "transformer_xl", impl, mem_len=4).to(dtype).train()
        with torch.no_grad():
            mems = model(input_ids=input_ids[:, :4]).mems
        mask = torch.ones(3, 4 + 10, dtype=torch.long)  # memory + current
        mask[2] = 0
        mask[1, :8] = 0  # memory and the first current tokens
        out = model(input_ids=input_ids, attention_mask=mask, mems=mems, labels=input_ids)
        _check_finite(out, model, f"transformer_xl mems {dtype}")


# ---------------------------------------------------------------------------
# 4. Save/load integrity
# ---------------------------------------------------------------------------

HEADS = [
    pytest.param(RelPosForCausalLM, AutoModelForCausalLM, {}, id="causal_lm"),
    pytest.param(RelPosForSequenceClassification, AutoModelForSequenceClassification, {"num_labels": 3}, id="seq_cls"),
]


# Scheme fields away from their defaults, so that a field lost on the way through config.json shows.
NON_DEFAULT_FIELDS = dict(log_decay_scale=0.7, rope_theta=500.0, clamp_len=6, mem_len=3)
CONFIG_FIELDS = sorted(set(RelPosConfig.__annotations__) | {"num_labels", "_attn_implementation"})


@pytest.mark.parametrize("cls, auto, overrides", HEADS)
@pytest.mark.parametrize("position_encoding", SCHEMES)
def test_save_load_bit_identical(tmp_path, position_encoding, cls, auto, overrides):
    fields = dict(NON_DEFAULT_FIELDS) if position_encoding == "transformer_xl" else {
        k: v for k, v in NON_DEFAULT_FIELDS.items() if k not in ("clamp_len", "mem_len")
    }
    model = make(cls, position_encoding, **fields, **overrides)
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        reference = model(input_ids=input_ids, attention_mask=attention_mask).logits
    model.save_pretrained(tmp_path)
    assert "model.safetensors" in files_in(tmp_path)
    assert_no_pickle(tmp_path)
    for loaded, info in (
        cls.from_pretrained(tmp_path, output_loading_info=True),
        auto.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True),
    ):
        assert_no_loading_problems(info)
        assert type(loaded) is cls
        for key in CONFIG_FIELDS:
            assert getattr(loaded.config, key) == getattr(model.config, key), f"config.{key} lost in save/load"
        assert_state_dicts_equal(model, loaded)
        with torch.no_grad():
            logits = loaded.eval()(input_ids=input_ids, attention_mask=attention_mask).logits
        assert torch.equal(logits, reference)


@pytest.mark.parametrize("position_encoding", SCHEMES)
def test_bf16_save_load_bit_identical(tmp_path, position_encoding):
    """A model cast to bf16, saved and reloaded behaves exactly as before."""
    model = make(RelPosForCausalLM, position_encoding).to(torch.bfloat16)
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        reference = model(input_ids=input_ids, attention_mask=attention_mask).logits
    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert_no_loading_problems(info)
    assert loaded.dtype == torch.bfloat16
    assert_state_dicts_equal(model, loaded)
    with torch.no_grad():
        logits = loaded.eval()(input_ids=input_ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    diff = (logits.float() - reference.float())[keep].abs().max().item()
    same = torch.equal(logits, reference)
    assert same, f"bf16 logits changed by save/load (max |diff| {diff:.3g} on non-padded positions)"


@pytest.mark.parametrize("position_encoding", SCHEMES)
def test_save_pretrained_never_writes_pickle(tmp_path, position_encoding):
    model = make(RelPosForCausalLM, position_encoding)
    model.save_pretrained(tmp_path / "unsafe_asked", safe_serialization=False)
    assert "model.safetensors" in files_in(tmp_path / "unsafe_asked")
    assert_no_pickle(tmp_path / "unsafe_asked")

    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    names = files_in(sharded)
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in names, sorted(names)
    assert_no_pickle(sharded)
    loaded, info = RelPosForCausalLM.from_pretrained(sharded, output_loading_info=True)
    assert_no_loading_problems(info)
    assert_state_dicts_equal(model, loaded)


def _swap_weights(tmp_path: Path, scheme: str, other: dict) -> Path:
    """A folder saved with the tiny config whose model.safetensors comes from another config."""
    folder, donor = tmp_path / "model", tmp_path / "donor"
    make(RelPosForCausalLM, scheme).save_pretrained(folder)
    other = dict(other)
    donor_scheme = other.pop("position_encoding", scheme)
    make(RelPosForCausalLM, donor_scheme, seed=1, **other).save_pretrained(donor)
    shutil.copyfile(donor / "model.safetensors", folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("position_encoding", SCHEMES)
@pytest.mark.parametrize("other", [{"hidden_size": 48}, {"vocab_size": VOCAB + 10}], ids=["hidden_size", "vocab_size"])
def test_weights_of_another_size_are_refused(tmp_path, position_encoding, other):
    folder = _swap_weights(tmp_path, position_encoding, other)
    for load in (
        lambda: RelPosForCausalLM.from_pretrained(folder),
        lambda: AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True),
    ):
        # Refused before Transformers allocates anything (it allocated each mismatched parameter at the config's
        # size, then raised "You set `ignore_mismatched_sizes` to `False`"): the field and both shapes are named.
        field = next(iter(other))
        with pytest.raises(ValueError, match=rf"RelPosConfig\.{field}={getattr(tiny_config(position_encoding), field)} "
                                             r"in .*config\.json gives .* the shape \[.*\], but .*model\.safetensors "
                                             r"holds \[.*\]: the config does not describe this checkpoint"):
            load()


@pytest.mark.parametrize(
    "other",
    [{"num_hidden_layers": 1}, {"position_encoding": "t5_bias"}],
    ids=["fewer_layers", "other_scheme"],
)
def test_weights_with_missing_tensors_are_reported(tmp_path, other):
    """Documents Transformers' behaviour: missing tensors are re-initialised with a logged warning.

    The user gets a partly random model; it is not an error, but it is never silent at the default
    verbosity: the load report names every missing key.
    """
    folder = _swap_weights(tmp_path, "shaw", other)
    with transformers_log() as log:
        model, info = RelPosForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"], info
    report = "\n".join(log)
    assert "MISSING" in report, report
    for key in info["missing_keys"]:
        assert key.rsplit(".", 1)[-1] in report
    donor = load_file(tmp_path / "donor" / "model.safetensors")
    assert not set(info["missing_keys"]) & set(donor)


@pytest.mark.parametrize("keep_fraction", [0.999, 0.5, 0.001])
@pytest.mark.parametrize("position_encoding", ["t5_bias", "shaw", "transformer_xl"])
def test_truncated_weights_are_refused(tmp_path, position_encoding, keep_fraction):
    make(RelPosForCausalLM, position_encoding).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: max(1, int(len(data) * keep_fraction))])
    for load in (
        lambda: RelPosForCausalLM.from_pretrained(tmp_path),
        lambda: AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True),
    ):
        with pytest.raises(Exception) as excinfo:
            load()
        assert "SafetensorError" in type(excinfo.value).__name__ or "deserializ" in str(excinfo.value).lower(), (
            repr(excinfo.value)
        )


@pytest.mark.parametrize("cls, auto, overrides", HEADS)
def test_unknown_position_encoding_is_refused(tmp_path, cls, auto, overrides):
    make(cls, "shaw", **overrides).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["position_encoding"] = "relative_sinusoid"
    path.write_text(json.dumps(config))
    for load in (
        lambda: AutoConfig.from_pretrained(tmp_path, trust_remote_code=True),
        lambda: RelPosConfig.from_pretrained(tmp_path),
        lambda: cls.from_pretrained(tmp_path),
        lambda: auto.from_pretrained(tmp_path, trust_remote_code=True),
    ):
        with pytest.raises(ValueError, match="position_encoding") as excinfo:
            load()
        assert "relative_sinusoid" in str(excinfo.value)
    with pytest.raises(ValueError, match="position_encoding"):
        tiny_config("relative_sinusoid")
