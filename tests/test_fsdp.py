"""FSDP2 on CPU: ``fully_shard`` per layer and on the root, torchrun, gloo, 2 processes, every scheme family.

One ``torchrun --nproc_per_node 2`` launch runs every scenario of ``tests/fsdp_worker.py``: T5 bias, Shaw,
Transformer-XL (``mem_len`` 6, memory carried from a first segment to a second), ALiBi, RoPE (decoder-only) and
a T5-bias encoder-decoder (encoder and decoder layers sharded, one token table tied to both stacks and the
output layer). The single-process reference is computed in each rank by an unsharded copy of the same weights
reading the whole global batch of 4 rows, with no collective; the sharded model reads its rank's 2 rows. Every
row has as many label tokens, so the mean of the ranks' losses is the global mean loss, and FSDP2's averaging
reduce-scatter gives its gradient.

Before training, the sharded model's inference logits (eval mode, no gradients; Transformer-XL reading the
first segment's memory) equal the reference's on the rank's rows. Transformer-XL and the encoder-decoder run
once more with activation checkpointing of each layer (the sharded model only).

Measured (torch 2.13 CPU, float32): losses within 4.8e-7 of the reference, every parameter's gradient
(``full_tensor()`` of its shard) within 3.1e-7 (largest gradients ~0.5), after one SGD step (lr 0.1) every
parameter within 1.2e-7; inference logits and Transformer-XL's per-rank memory equal (0.0). Tolerance: 2e-6
absolute for each (float32 sums in another order). A loss scaled by 1.0001 on one rank fails the comparison
(measured 2e-5 to 4e-5 off); the control ``t5_bias:swapped`` (rank 1 reads rank 0's rows) differs by 0.085 in
the loss and 0.27 in a gradient. The launch takes ~10 s on 2 idle cores.

Training needed no change in the models: the model-level position module (read by every layer), the
``PositionContext`` handed to each layer, Transformer-XL's memory and the tied token tables shard as they are.
Inference of Transformer-XL did: the check of its kept projections read ``W_{k,R}`` with ``Tensor.numpy()``,
which made the gathered weight's storage non-resizable, and FSDP2 could not free it after the layer's forward
("Trying to resize storage that is not resizable").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from test_distributed import free_port, readable, torchrun, torchrun_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "fsdp_worker.py"
SCHEMES = ("t5_bias", "shaw", "transformer_xl", "alibi", "rope", "seq2seq_t5_bias")
CHECKPOINTED = ("transformer_xl:checkpointing", "seq2seq_t5_bias:checkpointing")  # + activation checkpointing
CONTROL = "t5_bias:swapped"
ATOL = 2e-6  # loss, each gradient, each updated parameter, Transformer-XL memory; measured at most 4.8e-7
LAUNCH_TIMEOUT = 180

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="torch.distributed with gloo is not available",
    ),
    pytest.mark.xdist_group("test_fsdp"),
]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """Every scenario under one ``torchrun --nproc_per_node 2``; returns (out_dir, returncode, log)."""
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (torch.distributed.fsdp.fully_shard) is missing")
    from torch.distributed import fsdp as fsdp_module

    if not hasattr(fsdp_module, "fully_shard"):
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    out = tmp_path_factory.mktemp("fsdp")
    port = free_port()
    env = torchrun_env(out, MKL_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return (out, *torchrun(port, [str(WORKER), str(out), *SCHEMES, *CHECKPOINTED, CONTROL], env, LAUNCH_TIMEOUT))


def results(fsdp, name):
    out, returncode, log = fsdp
    found = []
    for rank in (0, 1):
        path = out / f"{name.replace(':', '-')}-rank{rank}.json"
        assert path.is_file(), (
            f"rank {rank} wrote no result for {name!r} (torchrun exit {returncode}):\n{readable(log)}")
        result = json.loads(path.read_text())
        assert "error" not in result, f"{name!r} raised on rank {rank}: {result['error']}\n{result['traceback']}"
        found.append(result)
    return found


def test_launch_finishes_cleanly(fsdp):
    out, returncode, log = fsdp
    assert returncode == 0, f"torchrun exit code {returncode}:\n{readable(log)}"


@pytest.mark.parametrize("name", SCHEMES + CHECKPOINTED)
def test_fsdp2_matches_single_process(fsdp, name):
    for r in results(fsdp, name):
        assert r["checkpointing"] == name.endswith(":checkpointing")
        # Really sharded: every parameter a DTensor, each rank holding part of the largest one.
        assert r["sharded_layers"] == (5 if name.startswith("seq2seq") else 2), r["sharded_layers"]
        assert r["dtensor_params"] == r["params"] > 0, (r["dtensor_params"], r["params"])
        assert r["largest_local_numel"] * 2 == r["largest_numel"], (r["largest_local_numel"], r["largest_numel"])
        assert r["tied"], "the token table and the output layer are no longer one parameter"
        assert not r["missing_grads"], f"no gradient under FSDP2 for {r['missing_grads']}"
        assert r["eval_logits_diff"] <= ATOL, f"rank {r['rank']}: inference logits off by {r['eval_logits_diff']:.3g}"
        assert abs(r["mean_loss"] - r["reference_loss"]) <= ATOL, (r["mean_loss"], r["reference_loss"])
        worst = max(r["grad_diff"], key=r["grad_diff"].get)
        assert r["grad_diff"][worst] <= ATOL, f"rank {r['rank']}: {worst}'s gradient off by {r['grad_diff'][worst]:.3g}"
        assert len(r["grad_diff"]) == r["params"]
        worst = max(r["step_diff"], key=r["step_diff"].get)
        assert r["step_diff"][worst] <= ATOL, (
            f"rank {r['rank']}: {worst} after one SGD step off by {r['step_diff'][worst]:.3g}")
        if name.startswith("transformer_xl"):  # each rank carries the memory of its own rows over the two segments
            assert r["mems_shapes"] == [[[2, 6, 32]] * 2] * 2, r["mems_shapes"]
            assert r["mems_diff"] <= ATOL, r["mems_diff"]


def test_comparison_sees_a_rank_reading_the_wrong_rows(fsdp):
    """The control: rank 1 reads rank 0's rows, so the averaged gradient is that of rows 0-1 alone."""
    for r in results(fsdp, CONTROL):
        assert abs(r["mean_loss"] - r["reference_loss"]) > 100 * ATOL, (r["mean_loss"], r["reference_loss"])
        worst = max(r["grad_diff"].values())
        assert worst > 1000 * ATOL, worst
        off = [k for k, v in r["grad_diff"].items() if v > 100 * ATOL]
        assert len(off) >= r["params"] // 2, f"only {off} differ"
