"""What a ``Trainer`` checkpoint holds and how a resume reads it (the README's "Training checkpoints do hold pickle").

A model folder holds no pickle (``tests/test_reliability.py``), but Transformers' checkpoints do:
``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth`` and ``training_args.bin`` are ``torch.save``
files. This pins down, for the installed Transformers, which files a resume reads and how: the weights
and the Transformer-XL memory through safetensors, the pickle files only through
``torch.load(..., weights_only=True)``, ``training_args.bin`` not at all, and no plain ``pickle`` load.
A few seconds on two CPU cores.
"""

from __future__ import annotations

import os
import pickle

import pytest
import safetensors.torch
import torch
from transformers import Trainer, TrainingArguments

from hf_relpos import RelPosForCausalLM
from hf_relpos.memory import MemoryTrainer, OrderedSegments
from tiny import tiny_config

torch.set_num_threads(1)

VOCAB = 64
PICKLE_FILES = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"}


class _Rows(torch.utils.data.Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(kind, out_dir, steps, ids):
    torch.manual_seed(0)
    memory = kind == "memory"
    model = RelPosForCausalLM(tiny_config("transformer_xl" if memory else "t5_bias", vocab_size=VOCAB, mem_len=8 if memory else 0))
    args = TrainingArguments(
        str(out_dir), max_steps=steps, per_device_train_batch_size=2, save_strategy="steps", save_steps=2,
        report_to=[], disable_tqdm=True, dataloader_pin_memory=False, use_cpu=True, seed=0,
    )  # fmt: skip
    if memory:
        return MemoryTrainer(model=model, args=args, train_dataset=OrderedSegments(ids.flatten(), 2, 8))
    return Trainer(model=model, args=args, train_dataset=_Rows(ids))


@pytest.mark.parametrize("kind", ["plain", "memory"])
def test_resume_reads_pickle_only_with_weights_only(kind, tmp_path, monkeypatch):
    ids = torch.randint(2, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
    _trainer(kind, tmp_path, 2, ids).train()
    checkpoint = tmp_path / "checkpoint-2"
    names = set(os.listdir(checkpoint))
    assert PICKLE_FILES <= names, f"a checkpoint holds {sorted(names)}"
    assert "model.safetensors" in names and (kind == "plain" or "mems-rank0.safetensors" in names)

    reads = []
    real_torch_load, real_safetensors_load = torch.load, safetensors.torch.load_file

    def traced_torch_load(f, *args, **kwargs):
        reads.append((os.path.basename(str(f)), "torch.load", kwargs.get("weights_only")))
        return real_torch_load(f, *args, **kwargs)

    def traced_safetensors_load(f, *args, **kwargs):
        reads.append((os.path.basename(str(f)), "safetensors", None))
        return real_safetensors_load(f, *args, **kwargs)

    def no_pickle(*args, **kwargs):
        raise AssertionError("plain pickle load during resume")

    monkeypatch.setattr(torch, "load", traced_torch_load)
    monkeypatch.setattr(safetensors.torch, "load_file", traced_safetensors_load)
    monkeypatch.setattr("hf_relpos.memory.load_file", traced_safetensors_load, raising=False)
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    _trainer(kind, tmp_path, 4, ids).train(resume_from_checkpoint=str(checkpoint))

    torch_loads = {name: weights_only for name, how, weights_only in reads if how == "torch.load"}
    assert torch_loads == {"optimizer.pt": True, "scheduler.pt": True, "rng_state.pth": True}, reads
    safetensors_loads = {name for name, how, _ in reads if how == "safetensors"}
    assert "model.safetensors" in safetensors_loads, reads
    if kind == "memory":
        assert "mems-rank0.safetensors" in safetensors_loads, reads
    assert "training_args.bin" not in {name for name, _, _ in reads}
