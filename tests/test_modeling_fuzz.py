"""Property-based fuzzing (hypothesis) of the models, Transformer-XL ``mems``, and minimal repros of what it found.

Random tiny valid configs (every scheme, causal or not, eager/sdpa, fp32/bf16), shapes,
padding (left, right, holes, fully padded rows), cache continuations, Transformer-XL ``mems``
(sometimes invalid) and training steps. Every forward returns finite outputs of the right shape or
raises ``ValueError``/``TypeError``; on valid fp32 input a cached continuation equals the full forward.
Invalid ``mems`` raise ``ValueError`` naming ``mems[i]`` (and the dtype when that is what is wrong) or
``mems`` (not a list of ``num_hidden_layers`` tensors): ``test_fuzz_mems`` fuzzes that path alone and
``test_every_invalid_mems_kind_raises_valueerror`` runs every kind of invalid memory once.

Batches of 0 sequences or of 0 tokens are left out here (test_empty_shapes.py checks them in forked children).
Settings and strategies: strategies.py. Run with ``-s`` to see how many examples each property ran in the
session (``test_zz_report_example_counts``, last in this file, which sorts after the functional and
configuration fuzz files).
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from strategies import COUNTS, MEMS_KINDS, chance, draw_padding, fuzz_settings, invalid_mems, model_configs

from hf_relpos import RelPosConfig, RelPosForCausalLM, RelPosForSequenceClassification, RelPosModel

# One pytest-xdist worker runs this whole module, in order (make test: --dist loadgroup): test_zz_report_example_counts
# reports the examples its fuzzers ran in this process.
pytestmark = pytest.mark.xdist_group("test_modeling_fuzz")


def check_output(out, expected_shape):
    assert tuple(out.shape) == tuple(expected_shape), f"output shape {tuple(out.shape)} != {tuple(expected_shape)}"
    assert torch.isfinite(out.float()).all(), "non-finite model output"


def model_call(model, faults_ok: bool, **kwargs):
    """Run a forward; returns (output, None) or (None, exception) for ValueError/TypeError (anything else propagates)."""
    try:
        with torch.no_grad():
            return model(**kwargs), None
    except (ValueError, TypeError) as exc:
        assert faults_ok, f"a valid forward raised {type(exc).__name__}: {exc}"
        event(f"model forward raised {type(exc).__name__}")
        return None, exc


MEMS_LIST_KINDS = ("layers", "tensor")  # not a list of num_hidden_layers entries: the message names mems


def check_mems_error(exc, kind: str, mems, model_dtype) -> None:
    """The contract for invalid mems: ValueError naming mems[i] (a bad entry) or mems (not a list of layers)."""
    message = str(exc)
    assert isinstance(exc, ValueError), f"invalid mems ({kind}) raised {type(exc).__name__}, not ValueError: {message}"
    if kind in MEMS_LIST_KINDS:
        assert re.search(r"(?<![A-Za-z0-9_])mems(?![A-Za-z0-9_])", message), f"mems ({kind}) not named: {message}"
        return
    named = re.search(r"(?<![A-Za-z0-9_])mems\[(\d+)\]", message)
    assert named, f"invalid mems entry ({kind}): the message does not name mems[i]: {message}"
    entry = mems[int(named.group(1))]
    if "dtype" in message:
        assert isinstance(entry, torch.Tensor) and entry.dtype != model_dtype, f"dtype blamed wrongly: {message}"
        assert str(entry.dtype) in message and str(model_dtype) in message, f"dtypes not named: {message}"
    elif kind in ("float64", "entry_dtype") and model_dtype != torch.float64:
        raise AssertionError(f"mems of another dtype than the model's {model_dtype}: the message does not say dtype: "
                             f"{message}")


@fuzz_settings(80)
@given(kw=model_configs(), data=st.data())
def test_fuzz_models(kw, data):
    COUNTS["models"] += 1
    impl = data.draw(st.sampled_from(["eager", "sdpa"]))
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    config = RelPosConfig(**kw)
    config._attn_implementation = impl
    decoder = config.is_decoder
    if decoder:
        model = RelPosForCausalLM(config)
        head = "lm"
    else:
        head = data.draw(st.sampled_from(["base", "cls"]))
        model = RelPosModel(config) if head == "base" else RelPosForSequenceClassification(config)
    model.config._attn_implementation = impl
    dtype = data.draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    model = model.to(dtype).eval()
    V, H = config.vocab_size, config.hidden_size

    def expected_shape(batch, length):
        return {"lm": (batch, length, V), "base": (batch, length, H), "cls": (batch, config.num_labels)}[head]

    def main_output(out):
        return out.last_hidden_state if head == "base" else out.logits

    batch = data.draw(st.integers(1, 3))
    prefix = data.draw(st.sampled_from([4, 0, 1, 2, 3, 6, 8]))  # > 0: a prefix, then a continuation (cache, or Transformer-XL mems)
    # (empty inputs are test_regression_empty_model_inputs_raise_valueerror's, in forked children)
    chunk = data.draw(st.integers(1, 6)) if prefix else data.draw(st.integers(1, 10))
    total = prefix + chunk
    faults = set()  # what makes this input invalid: some forward must raise ValueError/TypeError
    ids = torch.randint(0, V, (batch, total))
    if total and chance(data, 0.08):
        faults.add("input_ids")
        ids[data.draw(st.integers(0, batch - 1)), data.draw(st.integers(0, total - 1))] = data.draw(
            st.sampled_from([-1, V, V + 7]))
    if config.position_encoding in ("learned", "sinusoidal") and total > config.max_position_embeddings:
        faults.add("longer than max_position_embeddings")
    mask = draw_padding(data, batch, total)
    extra_mask = 0
    if mask is not None and chance(data, 0.06):
        faults.add("attention_mask")
        extra_mask = data.draw(st.sampled_from([1, 2]))
        mask = torch.cat([torch.ones(batch, extra_mask, dtype=mask.dtype), mask], dim=1)
    labels = None
    if head == "lm" and data.draw(st.booleans()):
        labels = ids.clamp(0, V - 1)
        if mask is not None:
            labels = labels.masked_fill(mask[:, extra_mask:] == 0, -100)
    elif head == "cls" and data.draw(st.booleans()):
        labels = torch.randint(0, config.num_labels, (batch,))


    def takes(labels):  # the base model has no labels argument (an unknown keyword is a TypeError)
        return {} if head == "base" else {"labels": labels}

    txl_memory = config.position_encoding == "transformer_xl" and config.mem_len > 0
    use_mems = bool(prefix) and (txl_memory or chance(data, 0.05)) and data.draw(st.booleans())
    use_cache = bool(prefix) and decoder and not use_mems
    event("path: " + ("mems" if use_mems else "cache" if use_cache else "one forward") + (" (invalid)" if faults else ""))

    if not (use_mems or use_cache):
        # One forward of the whole input.
        out, exc = model_call(model, bool(faults), input_ids=ids, attention_mask=mask, **takes(labels),
                              use_cache=False)
        if exc is None:
            assert not faults, f"invalid input accepted: {sorted(faults)}"
            check_output(main_output(out), expected_shape(batch, total))
            if labels is not None:
                assert torch.isfinite(out.loss), "non-finite loss"
            if total and data.draw(st.booleans()):
                # A training step (grad enabled: the path of the custom attention backward): finite gradients.
                event("training step")
                model.train()
                out = model(input_ids=ids, attention_mask=mask, **takes(labels), use_cache=False)
                loss = out.loss if labels is not None else main_output(out).float().square().mean()
                loss.backward()
                for name, param in model.named_parameters():
                    assert param.grad is None or torch.isfinite(param.grad.float()).all(), f"non-finite grad {name}"
        return

    first_mask = None if mask is None else mask[:, extra_mask : extra_mask + prefix]
    if use_mems:
        # Transformer-XL memory: the prefix without cache, then the chunk reading the prefix's memory.
        out1, exc = model_call(model, bool(faults), input_ids=ids[:, :prefix], attention_mask=first_mask,
                               use_cache=False)
        if exc is not None:
            return
        mems = out1.mems
        mems_kind = None
        if not txl_memory:
            faults.add("mems for a model without memory")
            mems = [torch.zeros(batch, 1, H, dtype=dtype)] * config.num_hidden_layers
        elif chance(data, 0.3):
            faults.add("mems")
            mems_kind = data.draw(st.sampled_from(MEMS_KINDS))
            event(f"invalid mems: {mems_kind}")
            mems = invalid_mems(data, mems, batch, config, mems_kind)
        elif data.draw(st.booleans()):
            mems = tuple(m.clone() for m in mems)
        m_len = mems[0].shape[1] if txl_memory and "mems" not in faults else 0
        if mask is None:
            chunk_mask = None
        elif m_len and data.draw(st.booleans()):
            # the mask of memory + current tokens
            chunk_mask = torch.cat([mask[:, extra_mask + prefix - m_len : extra_mask + prefix],
                                    mask[:, extra_mask + prefix :]], dim=1)
            if extra_mask:
                chunk_mask = torch.cat([torch.ones(batch, extra_mask, dtype=mask.dtype), chunk_mask], dim=1)
        else:
            chunk_mask = mask[:, prefix:]  # current tokens (+ extra_mask columns if that fault was drawn)
        if extra_mask and chunk_mask is not None and chunk_mask.shape[1] == m_len + chunk:
            faults.discard("attention_mask")  # the longer mask happens to be a valid memory + current mask
        chunk_labels = None if labels is None or head != "lm" else labels[:, prefix:]
        if head == "cls":
            chunk_labels = labels
        out2, exc = model_call(model, bool(faults), input_ids=ids[:, prefix:], attention_mask=chunk_mask,
                               mems=mems, **takes(chunk_labels), use_cache=False)
        if exc is not None:
            if faults == {"mems"}:
                check_mems_error(exc, mems_kind, mems, dtype)
            elif faults == {"mems for a model without memory"}:
                assert isinstance(exc, ValueError) and "mems" in str(exc), f"{type(exc).__name__}: {exc}"
            return
        assert not faults, f"invalid input accepted: {sorted(faults)}"
        check_output(main_output(out2), expected_shape(batch, chunk))
        assert len(out2.mems) == config.num_hidden_layers
        for m in out2.mems:
            assert m.shape[0] == batch and m.shape[1] <= config.mem_len and m.shape[2] == H and not m.requires_grad
            assert torch.isfinite(m.float()).all(), "non-finite mems"
        return

    # Causal LM with a cache: a prefix with use_cache=True, then the continuation chunk (mask: past + current).
    full_ref = None
    if not faults and dtype == torch.float32:
        full_ref, _ = model_call(model, False, input_ids=ids, attention_mask=mask, use_cache=False)
        check_output(full_ref.logits, (batch, total, V))
    out1, exc = model_call(model, bool(faults), input_ids=ids[:, :prefix], attention_mask=first_mask, use_cache=True)
    if exc is not None:
        return
    check_output(out1.logits, (batch, prefix, V))
    out2, exc = model_call(model, bool(faults), input_ids=ids[:, prefix:], attention_mask=mask,
                           past_key_values=out1.past_key_values, use_cache=True,
                           labels=None if labels is None else labels[:, prefix:])
    if exc is not None:
        return
    assert not faults, f"invalid input accepted: {sorted(faults)}"
    check_output(out2.logits, (batch, chunk, V))
    if labels is not None:
        assert torch.isfinite(out2.loss), "non-finite loss"
    if full_ref is not None:
        event("cached continuation compared with the full forward")
        # Every position, padded ones included: a query with no visible key gives zeros from attention under
        # every kernel, so it cannot depend on the cache either (test_regression_padded_query_... pins that).
        torch.testing.assert_close(
            out2.logits, full_ref.logits[:, prefix:], rtol=1e-4, atol=1e-4,
            msg=lambda m: f"cached continuation != full forward ({kw}, impl={impl}, mask={mask}): {m}",
        )


@fuzz_settings(60)
@given(kw=model_configs(), data=st.data())
def test_fuzz_mems(kw, data):
    """Transformer-XL memory alone: valid mems (a prefix's, any length <= mem_len) give finite outputs and
    memory; invalid ones raise ValueError naming mems[i] (a bad entry; its dtype if that is what is wrong) or
    mems (not a list of num_hidden_layers tensors). test_fuzz_models reaches this path too, but rarely."""
    COUNTS["mems"] += 1
    kw = {**kw, "position_encoding": "transformer_xl", "mem_len": data.draw(st.integers(1, 6)),
          "clamp_len": data.draw(st.sampled_from([-1, 1, 3, 8]))}
    for key in ("relative_attention_num_buckets", "relative_attention_max_distance", "max_relative_position",
                "shaw_value_embeddings", "log_decay_scale", "rope_theta", "max_position_embeddings"):
        kw.pop(key, None)
    config = RelPosConfig(**kw)
    config._attn_implementation = data.draw(st.sampled_from(["eager", "sdpa"]))
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    model_dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    model = RelPosModel(config).to(model_dtype).eval()
    V, H, L, M = config.vocab_size, config.hidden_size, config.num_hidden_layers, config.mem_len
    batch, prefix, chunk = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 8)), data.draw(st.integers(1, 5))
    with torch.no_grad():
        mems = model(input_ids=torch.randint(0, V, (batch, prefix)), use_cache=False).mems
    assert len(mems) == L and all(m.shape == (batch, min(prefix, M), H) and m.dtype == model_dtype for m in mems)
    kind = None
    kinds = MEMS_KINDS + ("entry_dtype",)
    # about half valid, every invalid kind about equally often (hypothesis's small integers are far from uniform)
    choice = data.draw(st.integers(0, 2**16)) % (2 * len(kinds)) - len(kinds)
    if choice >= 0:
        kind = kinds[choice]
        event(f"invalid mems: {kind}")
        if kind == "entry_dtype":  # one layer's memory of another dtype, the others right
            index = data.draw(st.integers(0, L - 1))
            other = data.draw(st.sampled_from([d for d in (torch.float32, torch.float64, torch.bfloat16)
                                               if d != model_dtype]))
            mems = [m.to(other) if i == index else m for i, m in enumerate(mems)]
        else:
            mems = invalid_mems(data, list(mems), batch, config, kind)
            if kind not in ("tensor", "float64") and data.draw(st.booleans()):  # the shape alone is wrong
                mems = [m.to(model_dtype) if isinstance(m, torch.Tensor) else m for m in mems]
    else:
        event("valid mems")
        if data.draw(st.booleans()):  # a shorter memory is valid too
            keep = data.draw(st.integers(0, mems[0].shape[1]))
            mems = [m[:, mems[0].shape[1] - keep :] for m in mems]
    ids = torch.randint(0, V, (batch, chunk))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, mems=mems, use_cache=False)
    except (ValueError, TypeError) as exc:
        assert kind is not None, f"valid mems rejected ({type(exc).__name__}): {exc}"
        check_mems_error(exc, kind, mems, model_dtype)
        if kind == "entry_dtype":
            assert f"mems[{index}]" in str(exc), f"wrong-dtype mems[{index}] not named: {exc}"
        return
    assert kind is None, f"invalid mems ({kind}) accepted"
    check_output(out.last_hidden_state, (batch, chunk, H))
    assert len(out.mems) == L and all(m.shape[1] <= M and m.dtype == model_dtype for m in out.mems)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", MEMS_KINDS)
def test_every_invalid_mems_kind_raises_valueerror(kind, model_dtype):
    """Each kind of invalid mems the fuzzers draw (hypothesis reaches some rarely), on fp32 and bf16 models."""
    config = RelPosConfig(position_encoding="transformer_xl", mem_len=3, hidden_size=8, num_attention_heads=2,
                          intermediate_size=8, num_hidden_layers=2, vocab_size=16)
    model = RelPosModel(config).to(model_dtype).eval()
    with torch.no_grad():
        mems = model(input_ids=torch.randint(0, 16, (2, 4)), use_cache=False).mems
        for same_dtype in (False, True):
            bad = invalid_mems(None, list(mems), 2, config, kind)
            if same_dtype and kind not in ("tensor", "float64"):
                bad = [m.to(model_dtype) if isinstance(m, torch.Tensor) else m for m in bad]
            with pytest.raises(ValueError) as info:
                model(input_ids=torch.randint(0, 16, (2, 2)), mems=bad, use_cache=False)
            check_mems_error(info.value, kind, bad, model_dtype)


# ---------------------------------------------------------------------------------------------------
# Minimal repros of what the fuzzers found (each fails until its bug is fixed)
# ---------------------------------------------------------------------------------------------------




def _tiny_txl(dtype=torch.float32):
    config = RelPosConfig(position_encoding="transformer_xl", mem_len=4, hidden_size=16, num_attention_heads=2,
                          intermediate_size=16, num_hidden_layers=2, vocab_size=16)
    return RelPosForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("entry", [None, [0.0], "mems", torch.zeros(2, 2), torch.zeros(3, 2, 16),
                                   torch.zeros(2, 2, 15), torch.zeros(2, 5, 16)],
                         ids=["None", "list", "str", "2d", "batch", "hidden", "too_long"])
def test_regression_mems_invalid_entry_raises_valueerror_naming_it(entry, index):
    # A non-tensor entry or a wrong shape: ValueError naming mems[i].
    mems = [torch.zeros(2, 2, 16), torch.zeros(2, 2, 16)]
    mems[index] = entry
    with pytest.raises(ValueError, match=re.escape(f"mems[{index}]")):
        _tiny_txl()(torch.randint(0, 16, (2, 3)), mems=mems)


@pytest.mark.parametrize("model_dtype, mems_dtype", [(torch.float32, torch.float64), (torch.float32, torch.bfloat16),
                                                     (torch.bfloat16, torch.float32)])
def test_regression_mems_of_another_dtype_raises_valueerror(model_dtype, mems_dtype):
    # mems must have the model's dtype (embed_tokens.weight.dtype): ValueError naming mems[i] and the dtype.
    model = _tiny_txl(model_dtype)
    for index in (0, 1):
        mems = [torch.zeros(2, 2, 16, dtype=model_dtype) for _ in range(2)]
        mems[index] = mems[index].to(mems_dtype)
        with pytest.raises(ValueError, match=re.escape(f"mems[{index}]")) as info:
            model(torch.randint(0, 16, (2, 3)), mems=mems)
        assert "dtype" in str(info.value) and str(mems_dtype) in str(info.value), str(info.value)
    # the matching dtype is accepted
    out = model(torch.randint(0, 16, (2, 3)), mems=[torch.zeros(2, 2, 16, dtype=model_dtype)] * 2)
    assert out.logits.dtype == model_dtype



@pytest.mark.parametrize("position_encoding", ["t5_bias", "alibi", "log_decay"])
def test_regression_padded_query_does_not_read_future_tokens(position_encoding):
    # A query with every key masked (here a fully padded row) must not attend to later tokens. Under sdpa the
    # additive-bias schemes fill masked entries with finfo.min + bias: a row that is all finfo.min gets a uniform
    # softmax over *all* keys, future ones included. Eager zeroes such rows; sdpa should agree with it.
    torch.manual_seed(0)
    outputs = {}
    for impl in ("eager", "sdpa"):
        torch.manual_seed(0)
        config = RelPosConfig(position_encoding=position_encoding, vocab_size=23, hidden_size=8, num_attention_heads=2,
                              num_hidden_layers=2, intermediate_size=16, initializer_range=0.5,
                              attn_implementation=impl)
        model = RelPosForCausalLM(config).eval()
        ids = torch.randint(1, 23, (1, 6))
        changed = ids.clone()
        changed[0, 5] = ids[0, 5] % 22 + 1  # only the last (future) token differs
        mask = torch.zeros(1, 6, dtype=torch.long)
        with torch.no_grad():
            a, b = model(ids, attention_mask=mask).logits, model(changed, attention_mask=mask).logits
        torch.testing.assert_close(a[0, :5], b[0, :5], msg=lambda m: f"{impl}: position 0..4 read token 5: {m}")
        outputs[impl] = a
    torch.testing.assert_close(outputs["sdpa"], outputs["eager"], rtol=1e-5, atol=1e-5)


def test_zz_report_example_counts():
    """Prints (with -s) how many examples each fuzzer ran in this session."""
    total = sum(COUNTS.values())
    print(f"\nfuzz examples run: {total} ({', '.join(f'{k}={v}' for k, v in sorted(COUNTS.items()))})")
    if not total:
        pytest.skip("no fuzz test ran in this session")
