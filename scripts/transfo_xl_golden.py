"""Reference outputs of Transformers' last TransfoXL (4.35.2) for hf_relpos's Transformer-XL conversion (issue 39).

Runs in a side environment, never in the suite: Transformers 5 has no TransfoXL, and 4.36+ deprecated it (its
tokenizer unpickles ``vocab.pkl``; from 4.5x its forward fails on recent torch). Make the environment and run::

    python3.11 -m venv /work/venv-txl
    /work/venv-txl/bin/pip install torch==2.13.0 transformers==4.35.2 numpy safetensors sacremoses
    /work/venv-txl/bin/python scripts/transfo_xl_golden.py tests/fixtures/transfo_xl

For each case below it writes ``<out>/<case>/``: the model as TransfoXL saved it (``config.json`` with the legacy
keys, ``model.safetensors``; a ``.bin`` case's state dict, tied copies
included, is converted to safetensors so that no pickle is committed), and ``reference.safetensors``: the input ids of three
consecutive segments (``input_ids``, ``[3, batch, length]``) and, per segment ``s``, what TransfoXLLMHeadModel gives
with the memories of the segment before: ``s{s}.log_probs`` (``[batch, length, vocab]``), ``s{s}.mems.{layer}``
(time-major ``[memory, batch, d_model]``, as TransfoXL returns them), ``s{s}.last_hidden`` (the last layer's
output, what the adaptive softmax reads), ``s{s}.losses`` (``[batch, length - 1]``, labels
= the input ids) and ``s{s}.loss``. The first segment starts from empty memories (a list of ``n_layer`` tensors of
length 0: the authors' start); ``zero_start.log_probs`` is the first segment from TransfoXL's own default
(``mems=None``: ``mem_len`` zero vectors per layer). The weights are random (wider than TransfoXL's 0.01-0.02
initialisation, so that every term moves the log-probabilities), seeded per case.

The cases cover what issue 39 asks: ``div_val`` 1 (with and without an embedding projection) and > 1, tied and
untied projections, ``same_length`` True and False, ``clamp_len`` below the key length, ``pre_lnorm`` True and
False, ``mem_len`` shorter and longer than a segment, ``untie_r=False``, ``n_head * d_head != d_model``, and a
wt103-shaped one (three clusters, ``div_val`` 4) saved as a ``.bin`` state dict.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

BATCH, LENGTH, SEGMENTS = 2, 5, 3
COMMON = dict(dropout=0.0, dropatt=0.0, init="normal", init_range=0.01, init_std=0.02, proj_init_std=0.01)
CASES = {
    # cutoffs, no embedding projection (d_embed == d_model), post-norm, all memory visible, memory > a segment
    "div1_post": dict(vocab_size=40, cutoffs=[10, 25], div_val=1, d_model=16, d_embed=16, n_head=2, d_head=8,
                      d_inner=32, n_layer=2, mem_len=8, clamp_len=1000, same_length=False, pre_lnorm=False),
    # an embedding projection (d_embed != d_model), pre-norm, same_length, memory < a segment, clamp below klen
    "div1_proj_pre_same": dict(vocab_size=40, cutoffs=[10, 25], div_val=1, d_model=16, d_embed=12, n_head=2,
                               d_head=8, d_inner=32, n_layer=2, mem_len=3, clamp_len=4, same_length=True,
                               pre_lnorm=True),
    # div_val 2 with the default tie_projs [False, True, True], post-norm, same_length
    "div2_tied_same": dict(vocab_size=40, cutoffs=[10, 25], div_val=2, d_model=16, d_embed=16, n_head=2, d_head=8,
                           d_inner=32, n_layer=2, mem_len=4, clamp_len=1000, same_length=True, pre_lnorm=False),
    # div_val 2, nothing tied (projections nor embeddings), pre-norm, shared u/v, n_head * d_head != d_model,
    # memory longer than two segments, clamp 3
    "div2_untied_pre": dict(vocab_size=40, cutoffs=[10, 25], div_val=2, d_model=16, d_embed=16, n_head=3, d_head=4,
                            d_inner=32, n_layer=2, mem_len=12, clamp_len=3, same_length=False, pre_lnorm=True,
                            proj_share_all_but_first=False, tie_word_embeddings=False, untie_r=False),
    # wt103's shape, small: three clusters, div_val 4 (cluster sizes 64, 16, 4, 1), same_length, saved as .bin
    "wt103_shape": dict(vocab_size=60, cutoffs=[8, 16, 30], div_val=4, d_model=32, d_embed=64, n_head=4, d_head=8,
                        d_inner=64, n_layer=3, mem_len=6, clamp_len=1000, same_length=True, pre_lnorm=False),
}
BIN_CASES = {"wt103_shape"}


def randomise(model, seed: int) -> None:
    """Wider random weights than TransfoXL's initialisation, parameter by parameter (tied ones stay tied: each
    shared tensor is one parameter of ``model.parameters()``)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if "layer_norm.weight" in name:
                parameter.copy_(1 + 0.2 * noise)
            else:
                parameter.copy_(0.3 * noise)


def make_case(name: str, options: dict, out: Path, seed: int) -> None:
    from safetensors.torch import save_file
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    torch.manual_seed(seed)
    config = TransfoXLConfig(**COMMON, **options)
    model = TransfoXLLMHeadModel(config).eval()
    randomise(model, seed)
    folder = out / name
    model.save_pretrained(folder, safe_serialization=name not in BIN_CASES)
    if name in BIN_CASES:  # its .bin state dict (tied copies included) kept as safetensors: no pickle is committed;
        # tests/test_transfo_xl_fixtures.py writes it back as a .bin to read through torch.load(weights_only=True)
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        save_file({key: value.clone().contiguous() for key, value in state.items()}, str(folder / "model.safetensors"))
        (folder / "pytorch_model.bin").unlink()
    ids = torch.randint(0, config.vocab_size, (SEGMENTS, BATCH, LENGTH), generator=torch.Generator().manual_seed(seed))
    reference = {"input_ids": ids.contiguous()}
    mems = [torch.empty(0, BATCH, config.d_model) for _ in range(config.n_layer)]  # the authors' empty start
    with torch.no_grad():
        zero = model(input_ids=ids[0])
        reference["zero_start.log_probs"] = zero.prediction_scores.contiguous()
        for s in range(SEGMENTS):
            out_s = model(input_ids=ids[s], mems=mems)
            trained = model(input_ids=ids[s], mems=mems, labels=ids[s].clone())  # TransfoXL edits labels in place
            reference[f"s{s}.log_probs"] = out_s.prediction_scores.contiguous()
            hidden = model.transformer(input_ids=ids[s], mems=mems).last_hidden_state  # what the head reads
            reference[f"s{s}.last_hidden"] = hidden.contiguous()
            reference[f"s{s}.losses"] = trained.losses.contiguous()
            reference[f"s{s}.loss"] = trained.loss.reshape(1).contiguous()
            for layer, mem in enumerate(out_s.mems):
                reference[f"s{s}.mems.{layer}"] = mem.contiguous()
            assert all(torch.equal(a, b) for a, b in zip(out_s.mems, trained.mems))
            mems = out_s.mems
    save_file(reference, str(folder / "reference.safetensors"))
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, {size / 1024:.0f} KiB in {folder}")


def main(argv: list) -> int:
    import transformers

    if transformers.__version__ != "4.35.2":
        print(f"needs transformers 4.35.2 (the last release before TransfoXL's deprecation), got "
              f"{transformers.__version__}", file=sys.stderr)
        return 2
    out = Path(argv[0] if argv else "tests/fixtures/transfo_xl")
    out.mkdir(parents=True, exist_ok=True)
    for seed, (name, options) in enumerate(CASES.items()):
        make_case(name, options, out, seed)
    (out / "versions.json").write_text(json.dumps(
        {"transformers": transformers.__version__, "torch": torch.__version__, "script": "scripts/transfo_xl_golden.py"},
        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
