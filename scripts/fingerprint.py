"""What the models compute, as hashes of the exact bytes: run before and after a change meant to change nothing.

    python scripts/fingerprint.py OUT.json            # write the fingerprint of this checkout
    python scripts/fingerprint.py --compare A.json B.json   # exit 1 and list what differs

For every scheme, tiny random models (fixed seeds; one thread) give, each as the SHA-256 of its float32 bytes:
- the causal LM's logits under eager and SDPA, padded left, and the gradients of its loss for every parameter;
- the bidirectional model's last hidden state (padded right) and a sequence classifier's logits, where the scheme
  is defined bidirectionally;
- cached greedy decoding: the tokens and each step's logits (``generate(output_logits=True)``), padded left;
- continuous batching (``generate_batch``) tokens, where the model can take part in it;
- a ``torch.export`` program's logits on another batch and length than it was traced on;
- the encoder-decoder's logits and greedy tokens (T5 bias and the other bidirectional schemes).
Bit-identical means the same hash; the script reports the first differing items.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
             initializer_range=0.3, vocab_size=61, relative_attention_num_buckets=8, relative_attention_max_distance=16,
             max_relative_position=3, pad_token_id=0, bos_token_id=None, eos_token_id=None)


def digest(tensor) -> str:
    import torch

    data = tensor.detach().to(torch.float32).contiguous() if tensor.is_floating_point() else tensor.detach().to(torch.int64)
    return hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest()[:16] + f" {tuple(tensor.shape)}"


def _ids(batch: int, length: int, seed: int, pad_left: int = 0, pad_right: int = 0):
    import torch

    ids = torch.randint(1, SIZES["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if pad_left:
        ids[-1, :pad_left], mask[-1, :pad_left] = 0, 0
    if pad_right:
        ids[-1, length - pad_right:], mask[-1, length - pad_right:] = 0, 0
    return ids, mask


def _model(cls, scheme: str, seed: int = 0, impl: str = "eager", **fields):
    import torch

    from hf_relpos import RelPosConfig

    torch.manual_seed(seed)
    model = cls(RelPosConfig(position_encoding=scheme, **{**SIZES, **fields}))
    model.set_attn_implementation(impl)
    return model.eval()


def causal(scheme: str, out: dict) -> None:
    import torch

    from hf_relpos import RelPosForCausalLM

    import hf_relpos.modeling_relpos

    if hasattr(hf_relpos.modeling_relpos, "continuous_batching_refusal"):  # where it lived before issue 35's split
        continuous_batching_refusal = hf_relpos.modeling_relpos.continuous_batching_refusal
    else:
        from hf_relpos.inputs_relpos import continuous_batching_refusal

    ids, mask = _ids(2, 11, seed=1, pad_left=3)
    for impl in ("eager", "sdpa"):
        model = _model(RelPosForCausalLM, scheme, impl=impl)
        with torch.no_grad():
            out[f"{scheme}/causal/{impl}/logits"] = digest(model(ids, attention_mask=mask).logits)
    model = _model(RelPosForCausalLM, scheme, impl="sdpa")
    model.train()
    torch.manual_seed(5)  # dropout is 0 in these configs; the seed keeps any sampling fixed
    labels = ids.masked_fill(mask == 0, -100)
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    for name, parameter in sorted(model.named_parameters()):
        if parameter.grad is not None:
            out[f"{scheme}/causal/grad/{name}"] = digest(parameter.grad)
    model.eval()
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True, pad_token_id=0)
    out[f"{scheme}/causal/generate/tokens"] = digest(generated.sequences)
    out[f"{scheme}/causal/generate/logits"] = digest(torch.stack(generated.logits))
    if continuous_batching_refusal(model.config) is None:
        from transformers import GenerationConfig

        prompts = [ids[0].tolist(), ids[1, 3:].tolist()]
        config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            results = model.generate_batch(prompts, generation_config=config, progress_bar=False)
        tokens = [results[key].generated_tokens for key in sorted(results)]
        out[f"{scheme}/causal/generate_batch"] = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
    from torch.export import Dim

    traced_ids, traced_mask = _ids(2, 9, seed=2, pad_left=2)
    other_ids, other_mask = _ids(3, 13, seed=3, pad_left=4)

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids, attention_mask=attention_mask, use_cache=False).logits

    batch, length = Dim("batch", min=1, max=16), Dim("length", min=2, max=60)
    shapes = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
    program = torch.export.export(Logits(model), (traced_ids, traced_mask), dynamic_shapes=shapes)
    with torch.no_grad():
        out[f"{scheme}/causal/export/logits"] = digest(program.module()(other_ids, other_mask))


def bidirectional(scheme: str, out: dict) -> None:
    import torch

    from hf_relpos import RelPosForConditionalGeneration, RelPosForSequenceClassification, RelPosModel

    ids, mask = _ids(2, 10, seed=4, pad_right=3)
    with torch.no_grad():
        model = _model(RelPosModel, scheme, is_decoder=False)
        out[f"{scheme}/bidirectional/hidden"] = digest(model(ids, attention_mask=mask).last_hidden_state)
        model = _model(RelPosForSequenceClassification, scheme, is_decoder=False, num_labels=3)
        out[f"{scheme}/classifier/logits"] = digest(model(ids, attention_mask=mask).logits)
        model = _model(RelPosForConditionalGeneration, scheme, is_encoder_decoder=True, num_decoder_layers=3,
                       decoder_start_token_id=0)
        target, target_mask = _ids(2, 7, seed=6)
        out[f"{scheme}/seq2seq/logits"] = digest(
            model(ids, attention_mask=mask, decoder_input_ids=target, decoder_attention_mask=target_mask).logits)
        out[f"{scheme}/seq2seq/generate"] = digest(
            model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0))


def fingerprint() -> dict:
    import torch

    import hf_relpos
    from hf_relpos.configuration_relpos import CAUSAL_ONLY

    torch.set_num_threads(1)
    out = {}
    for scheme in hf_relpos.POSITION_ENCODINGS:
        causal(scheme, out)
        if scheme not in CAUSAL_ONLY:
            bidirectional(scheme, out)
        print(f"{scheme}: {sum(key.startswith(scheme + '/') for key in out)} items", file=sys.stderr)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = parser.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(path)) for path in args.compare)
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        print(f"{len(a)} and {len(b)} items; {len(differ)} differ")
        for key in differ[:20]:
            print(f"  {key}: {a.get(key)} != {b.get(key)}")
        return 1 if differ else 0
    if not args.out:
        parser.error("give OUT.json, or --compare A.json B.json")
    result = fingerprint()
    with open(args.out, "w") as file:
        json.dump(result, file, indent=1, sort_keys=True)
    print(f"{len(result)} items written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
