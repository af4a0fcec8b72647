"""``relative_attention_per_layer``: a T5 bias table in every layer (UMT5's), a property of the t5_bias scheme.

Values against upstream UMT5 are in test_seq2seq.py (the conversion of every UMT5 class, eager and sdpa). Here: each
layer reads its own table (and only its own: gradients), every backend that serves the T5 bias serves it (the CPU
fast paths, FlexAttention's and the Triton kernel's forward, against eager), cached decoding grows one bias row per
token with each layer's table, and the config refuses the field for any other scheme in one line.
"""

import pytest
import torch
from transformers import DynamicCache

from hf_relpos import RelPosConfig, RelPosForCausalLM, RelPosForConditionalGeneration, RelPosModel
from tiny import PRESETS, assert_close, assert_close_where, build, padding_mask, rand_ids

PER_LAYER = dict(relative_attention_per_layer=True, num_hidden_layers=3)


def _distinct_tables(model, seed=5):
    """Every table drawn anew (std 1: the bias dominates the scores), so a layer reading another's table shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "relative_attention_bias" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    return model


def test_each_stack_has_one_table_per_layer_and_nothing_shared():
    model = build("t5_bias", cls=RelPosForConditionalGeneration, **PER_LAYER, is_encoder_decoder=True,
                  num_decoder_layers=2, decoder_start_token_id=0)
    tables = sorted(n for n, _ in model.named_parameters() if "relative_attention_bias" in n)
    assert tables == [f"decoder.position.layers.{i}.relative_attention_bias.weight" for i in range(2)] + [
        f"encoder.position.layers.{i}.relative_attention_bias.weight" for i in range(3)]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_equal_tables_give_the_shared_models_outputs_bitwise(impl):
    """The per-layer path is the shared path run once per layer: with every table equal to the shared one, the
    same logits to the bit."""
    shared = build("t5_bias", impl=impl, num_hidden_layers=3)
    per_layer = build("t5_bias", impl=impl, **PER_LAYER)
    state = {k: v for k, v in shared.state_dict().items() if "relative_attention_bias" not in k}
    per_layer.load_state_dict(state, strict=False)
    with torch.no_grad():
        for table in per_layer.model.position.layers:
            table.relative_attention_bias.weight.copy_(shared.model.position.relative_attention_bias.weight)
        ids, mask = rand_ids(2, 20), padding_mask(2, 20, "left", pads=(0, 3))
        assert torch.equal(per_layer(ids, attention_mask=mask).logits, shared(ids, attention_mask=mask).logits)


def test_each_layer_reads_its_own_table_and_only_its_own():
    """Layer i's output depends on table i alone: changing table 2 leaves the first two layers' hidden states
    unchanged and changes the third's; each table's gradient flows from its own layer (a loss on layer 1's output
    reaches tables 0 and 1, not 2)."""
    model = _distinct_tables(build("t5_bias", **PER_LAYER))
    ids = rand_ids(2, 16)
    before = model.model(ids, output_hidden_states=True).hidden_states
    with torch.no_grad():
        model.model.position.layers[2].relative_attention_bias.weight.add_(1.0)
    after = model.model(ids, output_hidden_states=True).hidden_states
    assert torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])  # after layers 0 and 1
    assert not torch.allclose(before[3], after[3])
    model.zero_grad()
    model.model(ids, output_hidden_states=True).hidden_states[2].sum().backward()
    grads = [t.relative_attention_bias.weight.grad for t in model.model.position.layers]
    assert grads[0].abs().sum() > 0 and grads[1].abs().sum() > 0
    assert grads[2] is None or not grads[2].any()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [12, 200])
def test_sdpa_and_its_cpu_fast_paths_equal_eager(causal, length):
    """200 tokens (buckets of distance 16 saturate at 16): the compact bias per clipped distance and its fused
    band; the gradients of every table too."""
    models = [_distinct_tables(build("t5_bias", cls=RelPosModel, impl=impl, is_decoder=causal, **PER_LAYER).train())
              for impl in ("eager", "sdpa")]
    ids, mask = rand_ids(2, length), padding_mask(2, length, "right" if not causal else "left", pads=(0, 5))
    results = []
    for model in models:
        out = model(ids, attention_mask=mask).last_hidden_state
        (out * mask[..., None]).sum().backward()
        results.append((out.detach(), [t.relative_attention_bias.weight.grad for t in model.position.layers]))
    assert_close_where(results[1][0], results[0][0], mask, atol=1e-4, what="sdpa")
    for got, expected in zip(results[1][1], results[0][1]):
        assert expected.abs().sum() > 0
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["eager", "sdpa", "flex_attention", "relpos_triton"])
def test_cached_decoding_grows_one_row_per_token_with_each_layers_table(impl):
    """A prefill into a DynamicCache (left padding), then two single-token steps: the logits of the full forward."""
    model = _distinct_tables(build("t5_bias", impl=impl, **PER_LAYER))
    ids, mask = rand_ids(2, 14), padding_mask(2, 14, "left", pads=(0, 3))
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :12], attention_mask=mask[:, :12], past_key_values=cache).logits]
        for i in (12, 13):
            steps.append(model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], past_key_values=cache).logits)
    assert_close_where(torch.cat(steps, dim=1), full, mask, atol=2e-5, what=impl)


@pytest.mark.parametrize("impl", ["flex_attention", "relpos_triton"])
def test_flex_and_triton_encoder_decoders_equal_eager(impl):
    overrides = {k: v for k, v in PRESETS["seq2seq"].items() if k not in PRESETS["modeling"]}
    eager, other = (_distinct_tables(build("t5_bias", cls=RelPosForConditionalGeneration, impl=i, **overrides,
                                           relative_attention_per_layer=True)) for i in ("eager", impl))
    ids, mask = rand_ids(2, 12), padding_mask(2, 12, "right", pads=(0, 3))
    target = rand_ids(2, 9, seed=2)
    with torch.no_grad():
        expected = eager(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        got = other(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    assert_close(got, expected, atol=2e-5, what=impl)


def test_saved_and_reloaded_with_the_auto_classes(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _distinct_tables(build("t5_bias", **PER_LAYER))
    model.save_pretrained(tmp_path)
    for trust in (False, True):
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=trust, attn_implementation="eager")
        reloaded = reloaded.eval()
        ids = rand_ids(2, 10)
        with torch.no_grad():
            assert torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("scheme", ["alibi", "rope", "shaw"])
def test_another_scheme_is_refused_in_one_line(scheme):
    with pytest.raises(ValueError, match=r"^RelPosConfig\.relative_attention_per_layer must be False unless "
                                         rf"position_encoding='t5_bias'.*got True with position_encoding='{scheme}'$"):
        RelPosConfig(position_encoding=scheme, relative_attention_per_layer=True)
    with pytest.raises(ValueError, match=r"relative_attention_per_layer must be True or False, got .yes.$"):
        RelPosConfig(relative_attention_per_layer="yes")
