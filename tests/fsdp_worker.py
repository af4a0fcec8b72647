"""FSDP2 worker of tests/test_fsdp.py: run under ``torchrun --nproc_per_node 2`` (gloo, CPU).

Each scenario builds one tiny model (the same weights on every rank, ``torch.manual_seed``), keeps an unsharded
copy as the single-process reference, and shards the other with ``fully_shard`` per layer
(``RelPosDecoderLayer``; both stacks' layers for the encoder-decoder), then the root. The reference reads the
whole global batch of 4 rows in this process, with no collective; the sharded model reads rank r's rows
[2r, 2r+1]. Every row has the same number of label tokens, so the mean of the two ranks' mean losses is the
global mean loss and FSDP2's averaging reduce-scatter gives its gradient. Written per rank to
``OUT/<scenario>-rank<r>.json``: the loss (local, and averaged over ranks), the largest gradient difference of
every parameter (``full_tensor()`` of its shard against the reference's gradient), and after one optimizer
step the largest difference of every updated parameter; before training, the largest difference of the logits
of the rank's rows in inference.

``<scheme>:checkpointing``: the sharded model also recomputes each layer's activations in the backward (the
reference does not). ``<scheme>:swapped`` is a control: rank 1 reads rank 0's rows instead of its own, so the
sharded gradients are those of rows 0-1 alone; the test must see them differ from the reference.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from hf_relpos import RelPosConfig, RelPosForCausalLM, RelPosForConditionalGeneration
from tiny import enable_checkpointing, is_checkpointing  # tests/ is this script's folder

VOCAB = 61
ROWS = 4  # the global batch; 2 per rank
SEQ = 12
SEG = 6  # Transformer-XL: two segments of SEG tokens, memory carried from the first to the second
LR = 0.1
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, initializer_range=0.3, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, max_relative_position=3, pad_token_id=0)
SCENARIOS = {
    "t5_bias": (RelPosForCausalLM, dict(position_encoding="t5_bias")),
    "shaw": (RelPosForCausalLM, dict(position_encoding="shaw")),
    "transformer_xl": (RelPosForCausalLM, dict(position_encoding="transformer_xl", mem_len=SEG)),
    "alibi": (RelPosForCausalLM, dict(position_encoding="alibi")),
    "rope": (RelPosForCausalLM, dict(position_encoding="rope")),
    "seq2seq_t5_bias": (RelPosForConditionalGeneration,
                        dict(position_encoding="t5_bias", is_encoder_decoder=True, num_decoder_layers=3,
                             decoder_start_token_id=0)),
}


def build(name: str):
    cls, extra = SCENARIOS[name]
    torch.manual_seed(0)
    model = cls(RelPosConfig(**BASE, **extra))
    # Shaw's and Transformer-XL's position parameters start at zero: give them values, so their gradients
    # depend on every term of the attention.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.train()


def batch(name: str, rows: slice) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=g)[rows]
    if SCENARIOS[name][0] is RelPosForConditionalGeneration:
        labels = torch.randint(3, VOCAB, (ROWS, SEQ - 3), generator=g)[rows]
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids.clone()}


def loss_of(model, name: str, inputs: dict):
    """(the training loss, the memory after it or None); Transformer-XL: two segments, the second reading the
    first one's memory, the loss their mean."""
    if name != "transformer_xl":
        return model(**inputs).loss, None
    ids = inputs["input_ids"]
    first = model(input_ids=ids[:, :SEG], labels=ids[:, :SEG])
    second = model(input_ids=ids[:, SEG:], labels=ids[:, SEG:], mems=first.mems)
    return (first.loss + second.loss) / 2, [first.mems, second.mems]


@torch.no_grad()
def eval_logits(model, name: str, inputs: dict) -> torch.Tensor:
    """Inference (eval mode, no gradients): the logits; Transformer-XL: the second segment's, read with the
    first one's memory (and its kept projections of the distances)."""
    model.eval()
    try:
        if name != "transformer_xl":
            return model(**inputs).logits
        ids = inputs["input_ids"]
        first = model(input_ids=ids[:, :SEG])
        return model(input_ids=ids[:, SEG:], mems=first.mems).logits
    finally:
        model.train()


def shard(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    stacks = [model.encoder, model.decoder] if model.config.is_encoder_decoder else [model.model]
    layers = [layer for stack in stacks for layer in stack.layers]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return len(layers)


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def scenario(label: str) -> dict:
    name, _, control = label.partition(":")
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = build(name)
    sharded = copy.deepcopy(reference)
    if control == "checkpointing":  # each layer's activations recomputed in the backward (accelerate's FSDP option)
        enable_checkpointing(sharded, use_reentrant=False)
    layers = shard(sharded)
    per_rank = ROWS // world
    own = 0 if control == "swapped" else rank
    rows = slice(own * per_rank, (own + 1) * per_rank)

    eval_diff = (eval_logits(sharded, name, batch(name, rows)) - eval_logits(reference, name, batch(name, rows)))
    eval_diff = eval_diff.abs().max().item()

    ref_loss, ref_mems = loss_of(reference, name, batch(name, slice(None)))
    ref_loss.backward()
    loss, mems = loss_of(sharded, name, batch(name, rows))
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world

    ref_params = dict(reference.named_parameters())
    sharded_params = dict(sharded.named_parameters())
    grad_diff, grad_scale, missing = {}, {}, []
    for key, ref in ref_params.items():
        param = sharded_params.get(key)
        if param is None or param.grad is None or ref.grad is None:
            missing.append(key)
            continue
        grad = full(param.grad)
        grad_diff[key] = (grad - ref.grad).abs().max().item()
        grad_scale[key] = ref.grad.abs().max().item()

    for model in (reference, sharded):
        torch.optim.SGD(model.parameters(), lr=LR).step()
    step_diff = {key: (full(sharded_params[key].detach()) - ref.detach()).abs().max().item()
                 for key, ref in ref_params.items() if key in sharded_params}
    if sharded.config.is_encoder_decoder:  # the one token table, still one parameter after sharding
        tables = [sharded.shared.weight, sharded.encoder.embed_tokens.weight, sharded.decoder.embed_tokens.weight,
                  sharded.lm_head.weight]
    else:
        tables = [sharded.model.embed_tokens.weight, sharded.lm_head.weight]
    # Transformer-XL: each rank's memory (both segments, every layer) against its rows of the reference memory.
    mems_diff = None if mems is None else max(
        (m - r[rows]).abs().max().item() for segment, ref_segment in zip(mems, ref_mems)
        for m, r in zip(segment, ref_segment))
    mems_shapes = None if mems is None else [[list(m.shape) for m in segment] for segment in mems]
    return {
        "rank": rank,
        "world": world,
        "sharded_layers": layers,
        "checkpointing": bool(is_checkpointing(sharded)),
        "dtensor_params": sum(type(p).__name__ == "DTensor" for p in sharded.parameters()),
        "params": len(ref_params),
        # the largest parameter: this rank holds a shard of it, not all of it
        "largest_local_numel": max(p.to_local().numel() for p in sharded.parameters()),
        "largest_numel": max(p.numel() for p in reference.parameters()),
        "tied": all(t is tables[0] for t in tables),
        "mems_diff": mems_diff,
        "mems_shapes": mems_shapes,
        "missing_grads": missing,
        "eval_logits_diff": eval_diff,
        "reference_loss": ref_loss.item(),
        "local_loss": loss.item(),
        "mean_loss": mean_loss.item(),
        "grad_diff": grad_diff,
        "grad_scale": grad_scale,
        "step_diff": step_diff,
    }


def main(argv):
    out_dir, names = argv[0], argv[1:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for name in names:
            try:
                result = scenario(name)
            except Exception as exc:  # recorded, so that one failing scenario does not hide the others
                result = {"rank": rank, "error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()[-4000:]}
            with open(os.path.join(out_dir, f"{name.replace(':', '-')}-rank{rank}.json"), "w") as f:
                json.dump(result, f, default=float)
            dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
    # destroy_process_group does not join gloo's threads here: DTensor's sharding caches keep the device mesh,
    # and so the process group, alive. A gloo thread alive while the interpreter finalizes can abort the rank
    # (SIGABRT, see tests/test_distributed.py), so the rank leaves without finalizing; its results are on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
