"""``initialization="t5"``: weights start as upstream T5's do (``T5PreTrainedModel._init_weights``), checked
against upstream's own initialisation of the same shapes, parameter by parameter, for an encoder-decoder and a
causal LM; the default initialisation is N(0, initializer_range) as before."""

import pytest
import torch

from hf_relpos import RelPosConfig, RelPosForCausalLM, RelPosForConditionalGeneration
from hf_relpos.t5_conversion import _t5_state_dict_to_relpos, t5_config_to_relpos

SIZES = dict(vocab_size=300, d_model=128, d_kv=48, num_heads=4, d_ff=384, num_layers=2, num_decoder_layers=2,
             relative_attention_num_buckets=32)


@pytest.mark.parametrize("feed_forward_proj", ["relu", "gated-gelu"])
@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_every_parameter_starts_at_upstream_t5s_std(feed_forward_proj, factor):
    """Upstream T5 initialises a model of these shapes; ours with initialization="t5" (the converted config) starts
    every mapped parameter at the same std (within 10%, or the sampling error of a small table) and mean 0;
    norms at T5's factor. num_heads * d_kv != d_model, so a query std over d_model alone would show."""
    from transformers import T5Config, T5ForConditionalGeneration

    t5_config = T5Config(**SIZES, feed_forward_proj=feed_forward_proj, tie_word_embeddings=False,
                         initializer_factor=factor, decoder_start_token_id=0)
    torch.manual_seed(0)
    upstream = T5ForConditionalGeneration(t5_config)
    config = t5_config_to_relpos(t5_config, tied=False)
    assert config.initialization == "t5"
    torch.manual_seed(1)
    ours = RelPosForConditionalGeneration(config)
    theirs = _t5_state_dict_to_relpos(upstream.state_dict(), config)
    assert len(theirs) >= 25
    for name, expected in theirs.items():
        got = ours.get_parameter(name)
        if "norm" in name:  # T5's norms start at its factor
            assert torch.equal(got, torch.full_like(got, factor)) and torch.equal(got, expected), name
            continue
        tolerance = max(0.1, 4 / got.numel() ** 0.5)  # two samples' stds: ~1/sqrt(2n) relative error each
        assert abs(got.std().item() / expected.std().item() - 1) < tolerance, (name, got.std(), expected.std())
        assert abs(got.mean().item()) < 4 * expected.std().item() / got.numel() ** 0.5, name


def test_a_causal_lm_starts_as_t5s_decoder_and_the_default_is_unchanged():
    config = dict(hidden_size=128, head_dim=48, num_attention_heads=4, intermediate_size=384, num_hidden_layers=1,
                  vocab_size=300, tie_word_embeddings=False)
    t5 = RelPosForCausalLM(RelPosConfig(**config, initialization="t5"))
    default = RelPosForCausalLM(RelPosConfig(**config))
    expected_t5 = {"q_proj": (128 * 48) ** -0.5, "k_proj": 128**-0.5, "o_proj": (4 * 48) ** -0.5,
                   "down_proj": 384**-0.5, "embed_tokens": 1.0, "lm_head": 1.0}
    for name, param in t5.named_parameters():
        for part, std in expected_t5.items():
            if f"{part}." in name:
                assert abs(param.std().item() / std - 1) < 0.1, (name, param.std().item(), std)
                assert abs(default.get_parameter(name).std().item() / 0.02 - 1) < 0.1, name


def test_an_unknown_initialization_is_one_line():
    with pytest.raises(ValueError, match=r"^RelPosConfig\.initialization must be one of \['default', 't5'\], "
                                         r"got 'xavier'$"):
        RelPosConfig(initialization="xavier")


def test_a_causal_lm_rescales_its_output_as_t5_v1_0_when_asked():
    """scale_decoder_outputs (T5 v1.0's d_model**-0.5 before the tied output layer) in a decoder-only model too:
    it was read by the encoder-decoder only, and silently ignored here."""
    from tiny import build, rand_ids

    model = build("t5_bias", scale_decoder_outputs=True)
    ids = rand_ids(2, 9)
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        expected = model.lm_head(hidden * model.config.hidden_size**-0.5)
        assert torch.equal(model(ids).logits, expected)
        # the last row alone, as the model computes it (a GEMM of another shape may round differently)
        assert torch.equal(model(ids, logits_to_keep=1).logits,
                           model.lm_head(hidden[:, -1:] * model.config.hidden_size**-0.5))
