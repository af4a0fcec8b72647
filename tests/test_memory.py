"""Transformer-XL segment-level recurrence: ordered data, MemoryTrainer, evaluation and decoding memory."""

import math

import pytest
import torch
from tiny import tiny_config
from transformers import TrainingArguments

from hf_relpos import RelPosForCausalLM
from hf_relpos.memory import MemoryTrainer, OrderedSegments, mems_file, segment_perplexity

SEG = 8


def txl_config(mem_len, **kw):
    return tiny_config("transformer_xl", preset="memory", mem_len=mem_len, **kw)


def copy_stream(n_blocks=400, block=SEG, seed=0):
    """Blocks of random tokens each followed by a copy: the second block is predictable only from
    the first, i.e. from one segment back when segments are blocks."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for _ in range(n_blocks):
        b = torch.randint(3, 20, (block,), generator=g)
        parts += [b, b]
    return torch.cat(parts)


def train_args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=3e-3, report_to=[],
        dataloader_pin_memory=False, use_cpu=True, save_strategy="no", logging_steps=10, disable_tqdm=True,
        num_train_epochs=1000, seed=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


# ----------------------------------------------------------------------------------------------
# OrderedSegments
# ----------------------------------------------------------------------------------------------


def test_ordered_segments_rows_continue_across_batches():
    stream = torch.arange(1000)
    ds = OrderedSegments(stream, batch_size=4, segment_length=5)
    per_row = 1000 // 4
    assert len(ds) == 4 * (per_row // 5)
    for t in range(3):
        for r in range(4):
            item = ds[t * 4 + r]
            expected = stream[r * per_row + t * 5 : r * per_row + t * 5 + 5]
            assert torch.equal(item["input_ids"], expected)
            assert torch.equal(item["labels"], expected)
            nxt = ds[(t + 1) * 4 + r]["input_ids"]
            assert int(nxt[0]) == int(item["input_ids"][-1]) + 1  # row r of batch t+1 continues row r


@pytest.mark.parametrize("kw,field", [
    (dict(batch_size=0, segment_length=4), "batch_size"),
    (dict(batch_size=2, segment_length=0), "segment_length"),
    (dict(batch_size=100, segment_length=50), "token_ids"),
])
def test_ordered_segments_bad_arguments(kw, field):
    with pytest.raises(ValueError, match=field):
        OrderedSegments(torch.arange(100), **kw)


# ----------------------------------------------------------------------------------------------
# Memory semantics in forward
# ----------------------------------------------------------------------------------------------


def test_backward_through_next_segment_leaves_previous_graph_untouched():
    torch.manual_seed(0)
    model = RelPosForCausalLM(txl_config(mem_len=SEG)).train()
    ids = torch.randint(3, 20, (2, 2 * SEG))
    first = model(ids[:, :SEG], labels=ids[:, :SEG])
    assert all(not m.requires_grad and m.grad_fn is None for m in first.mems)
    second = model(ids[:, SEG:], labels=ids[:, SEG:], mems=first.mems)
    assert all(m.shape[1] <= SEG for m in second.mems)
    second.loss.backward()
    grads_second = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # Had mems carried segment 1's graph, the backward above would have freed it and this would raise.
    model.zero_grad()
    first.loss.backward()
    assert grads_second, "segment 2 produced no gradients"


def test_memory_length_never_exceeds_mem_len():
    torch.manual_seed(0)
    model = RelPosForCausalLM(txl_config(mem_len=5)).eval()
    mems = None
    for _ in range(4):
        out = model(torch.randint(3, 20, (3, 7)), mems=mems)
        mems = out.mems
        assert len(mems) == 2 and all(m.shape == (3, 5, 32) and not m.requires_grad for m in mems)


def test_new_memory_is_last_mem_len_layer_inputs():
    torch.manual_seed(0)
    model = RelPosForCausalLM(txl_config(mem_len=6)).eval()
    a, b = torch.randint(3, 20, (1, 4)), torch.randint(3, 20, (1, 4))
    out_a = model(a, output_hidden_states=True)
    out_b = model(b, mems=out_a.mems, output_hidden_states=True)
    for layer in range(2):
        inputs_b = out_b.hidden_states[layer]  # the states entering layer `layer`
        expected = torch.cat([out_a.mems[layer], inputs_b], dim=1)[:, -6:]
        torch.testing.assert_close(out_b.mems[layer], expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Training with memory
# ----------------------------------------------------------------------------------------------


def _train_loss(tmp_path, mem_len, steps=200):
    torch.manual_seed(0)
    model = RelPosForCausalLM(txl_config(mem_len=mem_len))
    ds = OrderedSegments(copy_stream(), batch_size=8, segment_length=SEG)
    trainer = MemoryTrainer(model=model, args=train_args(tmp_path, max_steps=steps), train_dataset=ds)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return sum(losses[-3:]) / 3, model


def test_trainer_with_memory_learns_across_segments(tmp_path):
    with_memory, model = _train_loss(tmp_path / "mem", mem_len=SEG)
    without, _ = _train_loss(tmp_path / "nomem", mem_len=0)
    # Half the tokens copy the previous segment: only memory can predict them.
    assert with_memory < without - 0.15, (with_memory, without)
    stream = copy_stream(seed=1)[: 40 * SEG]
    assert segment_perplexity(model, stream, SEG) < segment_perplexity(model, stream, SEG, use_memory=False)


class RecordingTrainer(MemoryTrainer):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        given = self.train_mems if model.training else self.eval_mems
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.calls.append((model.training, given, self.train_mems if model.training else self.eval_mems))
        return result


def test_memory_carried_through_gradient_accumulation_and_reset_per_epoch(tmp_path):
    torch.manual_seed(0)
    model = RelPosForCausalLM(txl_config(mem_len=SEG))
    ds = OrderedSegments(torch.randint(3, 20, (8 * SEG * 6,)), batch_size=4, segment_length=SEG)
    args = train_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=2)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=ds)
    trainer.train()
    batches_per_epoch = len(ds) // 4
    train_calls = [c for c in trainer.calls if c[0]]
    assert len(train_calls) == 2 * batches_per_epoch
    for n, (_, given, produced) in enumerate(train_calls):
        if n % batches_per_epoch == 0:
            assert given is None, f"memory not reset at the start of epoch (call {n})"
        else:
            assert given is train_calls[n - 1][2], f"call {n} did not receive the previous micro-batch's memory"


def test_evaluation_resets_its_memory(tmp_path):
    torch.manual_seed(0)
    model = RelPosForCausalLM(txl_config(mem_len=SEG))
    ds = OrderedSegments(copy_stream(n_blocks=20), batch_size=4, segment_length=SEG)
    trainer = MemoryTrainer(model=model, args=train_args(tmp_path, per_device_eval_batch_size=4), eval_dataset=ds)
    first = trainer.evaluate()["eval_loss"]
    second = trainer.evaluate()["eval_loss"]
    assert math.isfinite(first) and first == pytest.approx(second, abs=1e-6)


def test_checkpoint_resume_restores_memory(tmp_path):
    stream = copy_stream(n_blocks=100)

    def make(output, steps):
        torch.manual_seed(0)
        model = RelPosForCausalLM(txl_config(mem_len=SEG))
        args = train_args(output, max_steps=steps, lr_scheduler_type="constant", save_strategy="steps", save_steps=3)
        return MemoryTrainer(model=model, args=args, train_dataset=OrderedSegments(stream, 8, SEG))

    straight = make(tmp_path / "straight", 6)
    straight.train()

    interrupted = make(tmp_path / "resumed", 3)
    interrupted.train()
    assert (tmp_path / "resumed" / "checkpoint-3" / mems_file(0)).is_file()
    resumed = make(tmp_path / "resumed", 6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-3"))

    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    for a, b in zip(straight.train_mems, resumed.train_mems):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Evaluation with memory
# ----------------------------------------------------------------------------------------------


def _oracle_segment_ppl(model, ids, seg):
    nll, n = 0.0, 0
    for start in range(0, len(ids) - 1, seg):
        x = ids[start : start + seg]
        y = ids[start + 1 : start + seg + 1]
        x = x[: len(y)]
        logits = model(x[None], use_cache=False).logits[0].double()
        for t in range(len(y)):
            nll -= torch.log_softmax(logits[t], -1)[y[t]].item()
            n += 1
    return math.exp(nll / n)


def test_segment_perplexity_without_memory_is_independent_segments():
    torch.manual_seed(0)
    model = RelPosForCausalLM(txl_config(mem_len=0)).eval()
    ids = torch.randint(3, 20, (45,))
    with torch.no_grad():
        assert segment_perplexity(model, ids, 8) == pytest.approx(_oracle_segment_ppl(model, ids, 8), rel=1e-5)


def test_segment_perplexity_with_full_memory_equals_one_pass():
    torch.manual_seed(0)
    model = RelPosForCausalLM(txl_config(mem_len=64)).eval()
    ids = torch.randint(3, 20, (41,))
    with torch.no_grad():
        logits = model(ids[None, :-1], use_cache=False).logits[0].double()
        nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="mean").item()
    assert segment_perplexity(model, ids, 8) == pytest.approx(math.exp(nll), rel=1e-5)


# ----------------------------------------------------------------------------------------------
# Decoding with a sliding memory
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("mem_len", [3, 6])
def test_cached_decoding_keeps_mem_len_positions_and_matches_uncached(impl, mem_len):
    torch.manual_seed(0)
    model = RelPosForCausalLM(txl_config(mem_len=mem_len, vocab_size=50)).eval()
    model.config._attn_implementation = impl
    ids = torch.randint(2, 50, (2, 9))
    cached = model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
    uncached = model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=False, pad_token_id=0)
    assert torch.equal(cached, uncached)
    out = model(ids, use_cache=True)
    assert all(layer.keys.shape[2] == mem_len for layer in out.past_key_values.layers)


def test_window_changes_what_a_query_sees():
    """The decoding window is real: a token farther back than mem_len no longer changes the output."""
    torch.manual_seed(0)
    model = RelPosForCausalLM(txl_config(mem_len=3, vocab_size=50)).eval()
    a = torch.randint(2, 50, (1, 10))
    b = a.clone()
    b[0, 0] = (a[0, 0] + 1) % 48 + 2
    # 2 layers, window 3 => receptive field 6 positions back: position 9 cannot see position 0.
    torch.testing.assert_close(model(a).logits[0, -1], model(b).logits[0, -1], rtol=0, atol=0)
    assert not torch.equal(model(a).logits[0, 3], model(b).logits[0, 3])
