"""Transformer-XL segment-level recurrence with ``transformers.Trainer`` (Dai et al. 2019, sec. 3.2).

- ``OrderedSegments``: lays a long token stream out as ``batch_size`` parallel rows, so that row ``r``
  of batch ``t + 1`` continues row ``r`` of batch ``t`` (the original's ordered iterator).
- ``MemoryTrainer``: a ``Trainer`` that reads the segments in order and carries ``mems`` from step to
  step; resets it at each epoch and each evaluation; keeps it through gradient accumulation and saves
  it (safetensors) with every checkpoint so that a resumed run continues with its memory.
- ``segment_perplexity``: perplexity of a long text read segment by segment, with memory or without.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset, SequentialSampler
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

def mems_file(rank: int = 0) -> str:
    """The checkpoint file that holds process ``rank``'s memory (each DDP rank carries its own)."""
    return f"mems-rank{rank}.safetensors"


class OrderedSegments(Dataset):
    """A token stream cut into ``batch_size`` rows read left to right in segments of ``segment_length``.

    Item ``t * batch_size + r`` is segment ``t`` of row ``r``; a sequential sampler with batch size
    ``batch_size`` therefore yields batch ``t`` = segment ``t`` of every row. Each item holds
    ``input_ids`` and ``labels`` (the same tokens: the model shifts them, as every Transformers causal LM).
    """

    def __init__(self, token_ids: Sequence[int] | torch.Tensor, batch_size: int, segment_length: int):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if isinstance(segment_length, bool) or not isinstance(segment_length, int) or segment_length < 1:
            raise ValueError(f"segment_length must be an int >= 1, got {segment_length!r}")
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        per_row = ids.numel() // batch_size
        if per_row < segment_length:
            raise ValueError(
                f"token_ids holds {ids.numel()} tokens: too few for batch_size={batch_size} rows of at least "
                f"segment_length={segment_length}"
            )
        self.batch_size = batch_size
        self.segment_length = segment_length
        self.rows = ids[: per_row * batch_size].view(batch_size, per_row)
        self.num_segments = per_row // segment_length

    def __len__(self) -> int:
        return self.num_segments * self.batch_size

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(f"index must be in [0, {len(self)}), got {index}")
        segment, row = divmod(index, self.batch_size)
        start = segment * self.segment_length
        ids = self.rows[row, start : start + self.segment_length]
        return {"input_ids": ids, "labels": ids.clone()}


class _ResetMemoryAtEpoch(TrainerCallback):
    def __init__(self, trainer: "MemoryTrainer"):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.trainer._keep_resumed_mems:
            self.trainer._keep_resumed_mems = False  # the resumed epoch continues with its saved memory
        else:
            self.trainer.train_mems = None


class MemoryTrainer(Trainer):
    """``Trainer`` for Transformer-XL with memory: ordered batches, ``mems`` carried across steps.

    Use it with ``OrderedSegments`` datasets whose ``batch_size`` is ``per_device_train_batch_size``
    (``per_device_eval_batch_size`` for evaluation). Memory is reset at each epoch start and at the start
    of each evaluation, and saved per process (``mems-rank{r}.safetensors``) in each checkpoint.

    Under DDP, set ``TrainingArguments(accelerator_config={"split_batches": True})``: each loader batch
    (one segment of every row) is then split by rows over the processes, so that every rank reads the
    next segment of the same rows at every step. accelerate's default hands whole batches out round-robin instead, and a
    rank's memory would come from another segment.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.world_size > 1 and not self.args.accelerator_config.split_batches:
            raise ValueError(
                "MemoryTrainer under distributed training needs TrainingArguments(accelerator_config="
                '{"split_batches": True}) so that each rank continues its own rows; got split_batches=False'
            )
        world = max(1, self.args.world_size)
        for name, dataset in (("train_dataset", self.train_dataset), ("eval_dataset", self.eval_dataset)):
            loader_batch = self.args.per_device_train_batch_size if name == "train_dataset" else self.args.per_device_eval_batch_size
            if isinstance(dataset, OrderedSegments) and (dataset.batch_size != loader_batch or loader_batch % world):
                raise ValueError(
                    f"{name}.batch_size must equal the loader's batch (per_device_{name.split('_')[0]}_batch_size="
                    f"{loader_batch}, split by rows over {world} processes, so divisible by {world}), got {dataset.batch_size}"
                )
        self.train_mems: Optional[list] = None
        self.eval_mems: Optional[list] = None
        self._keep_resumed_mems = False
        self.add_callback(_ResetMemoryAtEpoch(self))

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def _get_eval_sampler(self, eval_dataset):
        return SequentialSampler(eval_dataset)

    @staticmethod
    def _fits(mems, inputs) -> bool:
        return mems is not None and mems[0].shape[0] == inputs["input_ids"].shape[0]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        training = model.training
        mems = self.train_mems if training else self.eval_mems
        inputs = {**inputs, "mems": mems if self._fits(mems, inputs) else None}
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        new_mems = outputs.get("mems") if isinstance(outputs, dict) else None
        if training:
            self.train_mems = new_mems
        else:
            self.eval_mems = new_mems
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # Route evaluation through compute_loss so that evaluation carries its own memory.
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        if prediction_loss_only:
            return loss.detach(), None, None
        return loss.detach(), outputs["logits"].detach(), inputs.get("labels")

    def evaluate(self, *args, **kwargs):
        self.eval_mems = None
        return super().evaluate(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.train_mems is not None:  # every rank saves its own memory
            folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            tensors = {f"layer_{i}": m.detach().contiguous().cpu() for i, m in enumerate(self.train_mems)}
            save_file(tensors, os.path.join(folder, mems_file(self.args.process_index)))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)
        memory = getattr(getattr(self.model, "config", None), "mem_len", 0) or 0
        if isinstance(path, str) and memory > 0 and not os.path.isfile(os.path.join(path, mems_file(self.args.process_index))):
            # a checkpoint cut short after trainer_state.json would otherwise resume silently without its memory
            raise ValueError(
                f"resume_from_checkpoint {path!r} holds no {mems_file(self.args.process_index)}: it is not a "
                "complete MemoryTrainer checkpoint (resume from an earlier one)"
            )
        if isinstance(path, str) and os.path.isfile(os.path.join(path, mems_file(self.args.process_index))):
            tensors = load_file(os.path.join(path, mems_file(self.args.process_index)))
            device = self.args.device
            self.train_mems = [tensors[f"layer_{i}"].to(device) for i in range(len(tensors))]
            self._keep_resumed_mems = True
        return super().train(resume_from_checkpoint, *args, **kwargs)


def _evaluated_tokens(token_ids, max_tokens: Optional[int]) -> torch.Tensor:
    """The token stream as a 1-D long tensor, cut to ``max_tokens`` predicted tokens (plus the first)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if max_tokens is not None:
        ids = ids[: max_tokens + 1]
    if ids.numel() < 2:
        raise ValueError(f"token_ids must hold at least 2 tokens, got {ids.numel()}")
    return ids


@torch.no_grad()
def segment_perplexity(
    model,
    token_ids: Sequence[int] | torch.Tensor,
    segment_length: int,
    *,
    use_memory: bool = True,
    max_tokens: Optional[int] = None,
    progress: bool = False,
) -> float:
    """Perplexity of one long text read in consecutive segments of ``segment_length`` tokens.

    Every token after the first is predicted exactly once: segment ``t`` reads tokens
    ``[tL, tL + L)`` and predicts ``[tL + 1, tL + L + 1)``. With ``use_memory`` (and a Transformer-XL
    model with ``mem_len > 0``) each segment attends to the previous segments' memory, as the paper
    evaluates; otherwise segments are independent.
    """
    if isinstance(segment_length, bool) or not isinstance(segment_length, int) or segment_length < 1:
        raise ValueError(f"segment_length must be an int >= 1, got {segment_length!r}")
    ids = _evaluated_tokens(token_ids, max_tokens)
    device = next(model.parameters()).device
    model.eval()
    carry = use_memory and getattr(model.config, "mem_len", 0) > 0
    mems, total_nll, count = None, 0.0, 0
    starts = range(0, ids.numel() - 1, segment_length)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=f"eval L={segment_length}", leave=False)
    for start in starts:
        inputs = ids[start : start + segment_length].to(device)
        targets = ids[start + 1 : start + segment_length + 1].to(device)
        inputs = inputs[: targets.numel()]
        kwargs = {"mems": mems} if carry else {}
        out = model(input_ids=inputs[None], use_cache=False, **kwargs)
        logits = out.logits[0].float()
        total_nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += targets.numel()
        if carry:
            mems = out.mems
    return math.exp(total_nll / count)


@torch.no_grad()
def sliding_perplexity(
    model,
    token_ids: Sequence[int] | torch.Tensor,
    window: int,
    stride: int,
    *,
    max_tokens: Optional[int] = None,
) -> float:
    """Perplexity with a sliding window (Press et al. 2022's sliding evaluation, with a stride).

    Windows of ``window`` tokens start every ``stride`` tokens; each scores only the tokens the previous
    window did not, so that every token after the first is predicted exactly once, with at least
    ``window - stride`` tokens of context (all it has, near the start).
    """
    for name, value in (("window", window), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if stride > window:
        raise ValueError(f"stride must be <= window={window}, got {stride}")
    ids = _evaluated_tokens(token_ids, max_tokens)
    device = next(model.parameters()).device
    model.eval()
    total_nll, count, scored = 0.0, 0, 0  # scored: targets ids[1 .. scored] are done
    while scored < ids.numel() - 1:
        end = min(scored + stride, ids.numel() - 1) if scored else min(window, ids.numel() - 1)
        start = max(0, end - window)
        inputs, targets = ids[start:end].to(device), ids[start + 1 : end + 1].to(device)
        logits = model(input_ids=inputs[None], use_cache=False).logits[0].float()
        new = end - scored  # the last `new` positions predict tokens not scored before
        total_nll += torch.nn.functional.cross_entropy(logits[-new:], targets[-new:], reduction="sum").item()
        count += new
        scored = end
    return math.exp(total_nll / count)


__all__ = ["OrderedSegments", "MemoryTrainer", "segment_perplexity", "sliding_perplexity", "mems_file"]
