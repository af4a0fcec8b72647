"""Worker for tests/test_distributed.py: tiny Trainer / MemoryTrainer runs, under torchrun or alone.

    python -m torch.distributed.run --nproc_per_node 2 tests/ddp_worker.py OUT_DIR SCENARIO [SCENARIO ...]
    python tests/ddp_worker.py OUT_DIR plain-single          # the single-process reference

Scenarios (each writes OUT_DIR/<scenario>/result-rank<R>.json; models and checkpoints under OUT_DIR/<scenario>/):

- ``plain``: Trainer on the CLI's ``tiny`` preset (t5_bias), sequential sampling, ``PER_DEVICE`` rows per rank,
  ``STEPS`` steps, a checkpoint at the last step and ``save_model`` to ``model/``.
- ``plain-single``: the same with one process and ``PER_DEVICE * 2`` rows per step (the same global batch).
- ``memory``: the MemoryTrainer configurations that must be refused under DDP (no ``split_batches``; an
  OrderedSegments whose rows are not the loader's batch; a batch that does not split over the processes; an eval
  set of the wrong rows) and a valid one; records each constructor's exception.
- ``memory-split``: MemoryTrainer on one shared stream of ``2 * PER_DEVICE`` rows with
  ``accelerator_config.split_batches=True`` (each rank reads its own rows of every segment): a straight run and its
  evaluation (recording, per forward, which segment of which row each rank read and whether it received the
  previous forward's memory; final memories in ``final-mems-rank<R>.safetensors``), and a run interrupted at a
  checkpoint then resumed (each rank from its own ``mems-rank<R>.safetensors``), to compare.
- ``memory-single``: ``memory-split``'s straight run in one process reading all rows (the reference).
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from transformers import Trainer, TrainingArguments, set_seed  # noqa: E402

from hf_relpos import RelPosConfig, RelPosForCausalLM  # noqa: E402
from hf_relpos.commands.train import PRESETS  # noqa: E402
from hf_relpos.memory import MemoryTrainer, OrderedSegments, mems_file  # noqa: E402

VOCAB = 64
SEQ = 16
PER_DEVICE = 2
STEPS = 4
SEG = 8
LR = 3e-3


def rank_and_world():
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def tiny_model(position_encoding: str, **extra) -> RelPosForCausalLM:
    set_seed(0)
    config = RelPosConfig(position_encoding=position_encoding, vocab_size=VOCAB, **PRESETS["tiny"], **extra)
    return RelPosForCausalLM(config)


def training_args(output_dir: str, per_device: int, steps: int, **extra) -> TrainingArguments:
    kwargs = dict(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo" if rank_and_world()[1] > 1 else None,  # with one process "gloo" asks for a process group
        dataloader_pin_memory=False,
        disable_tqdm=True,
        seed=0,
        train_sampling_strategy="sequential",
    )
    kwargs.update(extra)
    return TrainingArguments(**kwargs)


class Rows(torch.utils.data.Dataset):
    """Fixed random token rows (labels = inputs); the same on every rank."""

    def __init__(self, n: int, length: int = SEQ, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(3, VOCAB, (n, length), generator=g)

    def __len__(self):
        return self.data.shape[0]

    def __getitem__(self, index):
        return {"input_ids": self.data[index], "labels": self.data[index].clone()}


class RecordingTrainer(Trainer):
    """Records, per training forward, the dataset rows it read (identified by their tokens)."""

    def __init__(self, *args, row_ids=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.row_ids = row_ids
        self.rows_seen = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            self.rows_seen.append([self.row_ids[tuple(r.tolist())] for r in inputs["input_ids"].cpu()])
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def logged_losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def plain(out_dir: str, single: bool) -> dict:
    rank, world = rank_and_world()
    per_device = PER_DEVICE * 2 if single else PER_DEVICE
    dataset = Rows(per_device * world * STEPS)
    row_ids = {tuple(r.tolist()): i for i, r in enumerate(dataset.data)}
    model = tiny_model("t5_bias")
    args = training_args(os.path.join(out_dir, "trainer"), per_device, STEPS, save_strategy="steps", save_steps=STEPS)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=dataset, row_ids=row_ids)
    trainer.train()
    trainer.save_model(os.path.join(out_dir, "model"))
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).double()
    return {
        "rank": rank,
        "world": world,
        "losses": logged_losses(trainer),
        "rows_seen": trainer.rows_seen,
        "param_norm": params.norm().item(),
        "param_sample": params[:: max(1, params.numel() // 64)].tolist(),
        "is_world_process_zero": trainer.is_world_process_zero(),
    }


class MemoryRecorder(MemoryTrainer):
    """Per training forward: which (segment, row) each input row is, and whether it got the previous memory."""

    def __init__(self, *args, locate=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.locate = locate
        self.steps = []
        self.eval_steps = []
        self.finite = True

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        training = model.training
        steps = self.steps if training else self.eval_steps
        given = self.train_mems if training else self.eval_mems
        previous = steps[-1]["produced"] if steps else None
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = result[0] if isinstance(result, tuple) else result
        self.finite &= bool(torch.isfinite(loss.detach()).all())
        steps.append({
            "rows": [list(self.locate[tuple(r.tolist())]) for r in inputs["input_ids"].cpu()],
            "got_previous_mems": given is not None and given is previous,
            "got_mems": given is not None,
            "produced": self.train_mems if training else self.eval_mems,
        })
        return result


def segments_index(dataset: OrderedSegments) -> dict:
    index = {}
    for i in range(len(dataset)):
        segment, row = divmod(i, dataset.batch_size)
        index[tuple(dataset[i]["input_ids"].tolist())] = (segment, row)
    return index


def stream(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g)


def memory_result(trainer, rank, world, extra=None) -> dict:
    mems = trainer.train_mems
    result = {
        "rank": rank,
        "world": world,
        "losses": logged_losses(trainer),
        "finite": trainer.finite,
        "steps": [{k: v for k, v in s.items() if k != "produced"} for s in trainer.steps],
        "eval_steps": [{k: v for k, v in s.items() if k != "produced"} for s in trainer.eval_steps],
        "mems_shapes": [list(m.shape) for m in mems] if mems is not None else None,
        "mems_sample": mems[-1].flatten()[:16].tolist() if mems is not None else None,
        "mems_norm": float(sum(m.double().norm() ** 2 for m in mems) ** 0.5) if mems is not None else None,
    }
    result.update(extra or {})
    return result


def memory(out_dir: str) -> dict:
    """The configurations MemoryTrainer must refuse under DDP: each constructor's exception, as ``Type: message``."""
    rank, world = rank_and_world()
    steps, rows = 4, PER_DEVICE * world
    model = tiny_model("transformer_xl", mem_len=SEG)

    def attempt(dataset, per_device, eval_dataset=None, per_device_eval=None, **extra):
        args = training_args(os.path.join(out_dir, "trainer"), per_device, steps,
                             per_device_eval_batch_size=per_device_eval or per_device, **extra)
        try:
            MemoryTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset)
        except Exception as exc:  # noqa: BLE001 -- the type is part of what the test checks
            return f"{type(exc).__name__}: {exc}"
        return None

    split = {"accelerator_config": {"split_batches": True}}
    per_rank = OrderedSegments(stream(100 + rank, PER_DEVICE * SEG * steps), PER_DEVICE, SEG)
    shared = OrderedSegments(stream(7, rows * SEG * steps), rows, SEG)
    odd = OrderedSegments(stream(7, 3 * SEG * steps), 3, SEG)
    return {
        "rank": rank,
        "world": world,
        # The pre-fix README usage: per-device OrderedSegments, accelerate's default batch handling.
        "no_split_batches": attempt(per_rank, PER_DEVICE),
        # split_batches, but the dataset's rows are not the loader's batch.
        "split_per_device_rows": attempt(per_rank, rows, **split),
        # split_batches, dataset = loader batch, but 3 rows do not split over 2 processes.
        "split_indivisible": attempt(odd, 3, **split),
        # split_batches, a valid training set, an eval set whose rows are not per_device_eval_batch_size.
        "split_bad_eval": attempt(shared, rows, eval_dataset=shared, per_device_eval=PER_DEVICE, **split),
        # The valid configuration, for contrast.
        "split_valid": attempt(shared, rows, eval_dataset=shared, **split),
    }


def save_mems(out_dir: str, rank: int, train_mems, eval_mems) -> None:
    from safetensors.torch import save_file

    tensors = {f"train_{i}": m.detach().contiguous().cpu() for i, m in enumerate(train_mems)}
    tensors.update({f"eval_{i}": m.detach().contiguous().cpu() for i, m in enumerate(eval_mems or [])})
    save_file(tensors, os.path.join(out_dir, f"final-mems-rank{rank}.safetensors"))


def memory_split(out_dir: str, single: bool = False) -> dict:
    """MemoryTrainer with split_batches: a straight run (and its evaluation), and a run interrupted and resumed.

    ``single``: the straight run alone, in one process reading all ``PER_DEVICE * 2`` rows (the reference).
    """
    rank, world = rank_and_world()
    steps, rows = 4, PER_DEVICE * 2 if single else PER_DEVICE * world
    dataset = OrderedSegments(stream(7, rows * SEG * steps * 2), rows, SEG)
    eval_dataset = OrderedSegments(stream(8, rows * SEG * 3), rows, SEG)
    locate = segments_index(dataset)
    locate.update({k: ("eval", *v) for k, v in segments_index(eval_dataset).items()})

    def make(name, max_steps, cls=None, **extra):
        args = training_args(os.path.join(out_dir, name), rows, max_steps, per_device_eval_batch_size=rows,
                             accelerator_config={"split_batches": True}, **extra)
        return (cls or MemoryRecorder)(model=tiny_model("transformer_xl", mem_len=SEG), args=args,
                                       train_dataset=dataset, eval_dataset=eval_dataset, locate=locate)

    straight = make("straight", steps)
    straight.train()
    straight_mems = [m.detach().clone() for m in straight.train_mems]
    straight.evaluate()
    save_mems(out_dir, rank, straight_mems, straight.eval_mems)
    if single:
        return memory_result(straight, rank, world, {"losses": logged_losses(straight)})
    interrupted = make("resumed", steps // 2, save_strategy="steps", save_steps=steps // 2)
    interrupted.train()
    checkpoint = os.path.join(out_dir, "resumed", f"checkpoint-{steps // 2}")
    from safetensors.torch import load_file, save_file

    interrupted_mems = [m.detach().cpu() for m in interrupted.train_mems]
    own_file = os.path.join(out_dir, f"own-mems-rank{rank}.safetensors")
    save_file({f"layer_{i}": m.contiguous() for i, m in enumerate(interrupted_mems)}, own_file)
    if world > 1:
        torch.distributed.barrier()  # every rank's checkpoint files are written
    checkpoint_files = sorted(os.listdir(checkpoint))
    saved = {}
    for r in range(world):
        path = os.path.join(checkpoint, mems_file(r))
        if os.path.isfile(path):
            tensors = load_file(path)
            saved[r] = [tensors[f"layer_{i}"] for i in range(len(tensors))]
    own_saved = saved.get(rank)
    resumed = make("resumed", steps, save_strategy="no")
    resumed.train(resume_from_checkpoint=checkpoint)

    class OwnMemory(MemoryRecorder):
        """Control: resume with this rank's memory as the worker kept it, whatever the checkpoint holds."""

        def train(self, resume_from_checkpoint=None, **kwargs):
            tensors = load_file(own_file)
            self.train_mems = [tensors[f"layer_{i}"] for i in range(len(tensors))]
            self._keep_resumed_mems = True
            return Trainer.train(self, resume_from_checkpoint, **kwargs)

    control = make("resumed", steps, cls=OwnMemory, save_strategy="no")
    control.train(resume_from_checkpoint=checkpoint)
    params = lambda t: torch.cat([p.detach().flatten() for p in t.model.parameters()]).double()  # noqa: E731

    def mems_diff(a, b):
        return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))

    return memory_result(straight, rank, world, {
        "mems_sample": straight_mems[-1].flatten()[:16].tolist(),
        "mems_norm": float(sum(m.double().norm() ** 2 for m in straight_mems) ** 0.5),
        "mems_shapes": [list(m.shape) for m in straight_mems],
        "eval_mems_shapes": [list(m.shape) for m in straight.eval_mems] if straight.eval_mems else None,
        "checkpoint_files": checkpoint_files,
        "checkpoint_mems_ranks": sorted(saved),
        "checkpoint_mems_is_this_ranks": None if own_saved is None else all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(own_saved, interrupted_mems)),
        "checkpoint_mems_differ_between_ranks": None if len(saved) < 2 else not all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(saved[0], saved[1])),
        "resumed_losses": logged_losses(resumed),
        "resumed_steps": [{k: v for k, v in s.items() if k != "produced"} for s in resumed.steps],
        "resumed_param_diff": (params(straight) - params(resumed)).abs().max().item(),
        "resumed_mems_diff": mems_diff(straight_mems, resumed.train_mems),
        "control_losses": logged_losses(control),
        "control_param_diff": (params(straight) - params(control)).abs().max().item(),
        "control_mems_diff": mems_diff(straight_mems, control.train_mems),
    })


SCENARIOS = {
    "plain": lambda out: plain(out, single=False),
    "plain-single": lambda out: plain(out, single=True),
    "memory": memory,
    "memory-split": memory_split,
    "memory-single": lambda out: memory_split(out, single=True),
}


def main(argv):
    out_dir, names = argv[0], argv[1:]
    rank, world = rank_and_world()
    for name in names:
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        try:
            result = SCENARIOS[name](folder)
        except Exception as exc:  # recorded, so that one failing scenario does not hide the others
            import traceback

            result = {"rank": rank, "world": world, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()[-4000:]}
        result = json.loads(json.dumps(result, default=float))
        for key in ("losses", "resumed_losses"):
            if key in result and any(not math.isfinite(x) for x in result[key]):
                result["finite"] = False
        with open(os.path.join(folder, f"result-rank{rank}.json"), "w") as f:
            json.dump(result, f)
        if world > 1:
            torch.distributed.barrier()
    if world > 1 and torch.distributed.is_initialized():
        # Destroy the process group for real before the interpreter exits: the trainers (MemoryTrainer's callback
        # makes a reference cycle) hold the DDP models, which hold it. Its last reference gone, gloo joins its
        # worker threads; one left running can take the GIL during finalization and abort the process (SIGABRT).
        gc.collect()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
