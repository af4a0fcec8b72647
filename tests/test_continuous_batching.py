"""Continuous batching (Transformers' ``generate_batch`` and its manager, a paged cache): each request gets exactly
the tokens that greedy ``generate`` gives it alone, and each packed step's logits equal the request's own forward,
for every causal scheme under eager and sdpa; the models that cannot take part are refused in one line."""

import math
import time

import pytest
import torch

from hf_relpos import RelPosForConditionalGeneration
from tiny import ENCODINGS, IMPLS, VOCAB, build, make_model

transformers_cb = pytest.importorskip("transformers.generation.continuous_batching")
from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

# Small pages and steps: prompts longer than max_batch_tokens are split over steps (chunked prefill), and decoding
# requests share steps with other requests' prefill chunks, so the packed path with a past really runs.
CB_CONFIG = dict(page_size=16, num_blocks=64, max_batch_tokens=12, max_requests_per_batch=4)
PROMPT_LENGTHS = (3, 17, 1, 9, 26)
MAX_NEW = (6, 3, 9, 5, 4)


def prompts(seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def continuous(model, inputs, max_new, generation_config=None, **cb_config):
    """Each request's result (in the order given) from one continuous-batching session, requests of their own
    max_new_tokens."""
    generation_config = generation_config or GenerationConfig(do_sample=False, max_new_tokens=max(max_new))
    config = ContinuousBatchingConfig(**{**CB_CONFIG, **cb_config})
    deadline = time.monotonic() + 120
    with model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=config, warmup=False
    ) as manager:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(inputs, max_new)]
        results = {}
        while len(results) < len(ids):
            assert time.monotonic() < deadline, "continuous batching did not finish"
            result = manager.get_result(timeout=1)
            if result is None:
                assert manager.is_running(), "the continuous batching loop stopped"
            elif result.is_finished():
                results[result.request_id] = result
    out = [results[i] for i in ids]
    for result in out:
        assert result.error is None, result.error
    return out


class StepRecorder:
    """Records every step of the model: its inputs (tokens, positions, requests by id) and the logits it returned."""

    def __init__(self, model):
        self.steps = []
        self.handle = model.register_forward_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs, output):
        if kwargs.get("read_index") is None:
            return
        cu_q = kwargs["cu_seq_lens_q"].long().clone()
        # Each packed request by its id: the paged block its first new token is written to is one of its own.
        allocator = kwargs["cache"].layer_to_allocator[0]
        written = kwargs["write_index"][allocator.index]
        blocks = [int(written[first]) // allocator.block_physical_stride for first in cu_q[:-1].tolist()]
        owners = [next(rid for rid, table in allocator.block_table.items() if block in table) for block in blocks]
        self.steps.append(dict(
            input_ids=kwargs["input_ids"][0].clone(), position_ids=kwargs["position_ids"][0].long().clone(),
            cu_q=cu_q, owners=owners, logits_indices=kwargs["logits_indices"].long().clone(),
            past=any(index.numel() for index in kwargs["read_index"]), logits=output.logits[0].detach().clone(),
        ))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scheme", [s for s in ENCODINGS if s != "fox"])  # fox: refused (tests/test_fox.py)
def test_continuous_batching_equals_generate(scheme, impl):
    """Greedy tokens equal ``generate`` of each request alone, and every step's logits equal each request's own
    forward over its tokens so far (a wrong distance cannot hide behind a greedy tie); the steps packed several
    requests with a past and split a prompt over steps."""
    model = build(scheme, impl=impl)
    inputs = prompts()
    recorder = StepRecorder(model)
    try:
        results = continuous(model, inputs, MAX_NEW)
    finally:
        recorder.handle.remove()
    assert model.config._attn_implementation == impl  # restored after the session
    sequences = {}
    for prompt, n, result in zip(inputs, MAX_NEW, results):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt) :]
        assert result.generated_tokens == expected.tolist(), f"{scheme}/{impl}: prompt of {len(prompt)} tokens"
        sequences[result.request_id] = prompt + result.generated_tokens

    steps = recorder.steps
    assert any(s["past"] and s["cu_q"].numel() > 2 for s in steps), "no step packed several requests with a past"
    chunked = [s for s in steps if s["past"] and bool((s["cu_q"].diff() > 1).any())]
    assert chunked, "no prompt was split over steps (chunked prefill)"
    checked = 0
    with torch.no_grad():
        for step in steps:
            for row, index in zip(step["logits"], step["logits_indices"].tolist()):
                request = int(torch.searchsorted(step["cu_q"][1:], torch.tensor(index), right=True))
                first = int(step["cu_q"][request])
                start, end = int(step["position_ids"][first]), int(step["position_ids"][index]) + 1
                sequence = sequences[step["owners"][request]]
                assert sequence[start:end] == step["input_ids"][first : index + 1].tolist()
                alone = model(torch.tensor([sequence[:end]])).logits[0, -1]
                torch.testing.assert_close(row, alone, atol=1e-4, rtol=1e-4)
                checked += 1
    assert checked >= sum(MAX_NEW)  # a row for each generated token (and any the manager drew and dropped)


@pytest.mark.parametrize("scheme", ["t5_bias", "shaw", "transformer_xl"])
def test_continuous_batching_sliding_window(scheme):
    """A sliding window (the paged cache keeps each request's latest ``sliding_window - 1`` keys) gives generate's
    tokens: the window is measured in each request's own positions."""
    model = build(scheme, impl="sdpa", sliding_window=5)
    inputs = prompts(seed=7)
    results = continuous(model, inputs, MAX_NEW)
    for prompt, n, result in zip(inputs, MAX_NEW, results):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt) :]
        assert result.generated_tokens == expected.tolist()


def test_continuous_batching_sampling_is_reproducible():
    """Sampling with the manager's seed draws the same tokens twice; another seed draws others."""
    model = build("alibi", impl="sdpa")
    inputs = prompts()
    config = GenerationConfig(do_sample=True, temperature=2.0, max_new_tokens=8)

    def sample(seed):
        return [r.generated_tokens for r in continuous(model, inputs, [8] * len(inputs), config, seed=seed)]

    first = sample(3)
    assert sample(3) == first
    assert sample(4) != first
    assert all(0 <= t < VOCAB for tokens in first for t in tokens)


def test_generate_batch_refuses_transformer_xl_memory():
    model = build("transformer_xl", mem_len=4)
    with pytest.raises(ValueError, match=r"mem_len=4") as error:
        model.generate_batch(inputs=prompts(), generation_config=GenerationConfig(max_new_tokens=2, do_sample=False))
    assert "\n" not in str(error.value) and "RelPosForCausalLM cannot use continuous batching" in str(error.value)


def test_generate_batch_refuses_encoder_decoder():
    model = make_model(RelPosForConditionalGeneration, "t5_bias", preset="seq2seq")
    with pytest.raises(ValueError, match=r"is_encoder_decoder=True") as error:
        model.generate_batch(inputs=prompts(), generation_config=GenerationConfig(max_new_tokens=2, do_sample=False))
    assert "\n" not in str(error.value)


def test_paged_step_is_checked():
    """A recorded continuous-batching step replayed on a model that cannot honour it raises (no silent answer); the
    paged arguments without a paged cache, or rows that disagree with logits_to_keep, raise too."""
    model = build("rope", impl="sdpa")
    captured = []

    def copy(value):  # the manager reuses its index buffers from step to step
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, (list, tuple)):
            return [copy(v) for v in value]
        return {k: copy(v) for k, v in value.items()} if isinstance(value, dict) else value

    def capture(module, args, kwargs):
        if kwargs.get("read_index") is not None and not captured:
            captured.append(copy(kwargs))

    handle = model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        continuous(model, prompts()[:2], [2, 2])
    finally:
        handle.remove()
    step = captured[0]
    with torch.no_grad():
        model(**step)  # the step replayed as it ran
        txl = build("transformer_xl", mem_len=4)
        with pytest.raises(ValueError, match=r"PagedAttentionCache .* mem_len=4"):
            txl(**step)
        with pytest.raises(ValueError, match=r"read_index, write_index: .* PagedAttentionCache"):
            model(step["input_ids"], read_index=step["read_index"], write_index=step["write_index"])
        wrong = step["logits_indices"].flip(0) if step["logits_indices"].numel() > 1 else step["logits_indices"] + 1
        with pytest.raises(ValueError, match=r"logits_indices .* logits_to_keep"):
            model(**{**step, "logits_to_keep": wrong})
        with pytest.raises(ValueError, match=r"position_ids \[1, \d+\]"):
            model(**{**step, "position_ids": None})


def test_functional_relative_position_equals_the_band():
    """Each position term given explicit positions (``relative_position``, key minus query) equals its band form
    when the explicit positions are the band's: the one seam every scheme's continuous-batching term goes through."""
    from hf_relpos import functional as F

    g = torch.Generator().manual_seed(0)
    Q, K, past, H, D = 5, 9, 4, 3, 8
    relative = torch.arange(K)[None, :] - (torch.arange(Q)[:, None] + past)
    q, k, v = (torch.randn(1, H, n, D, generator=g, dtype=torch.float64) for n in (Q, K, K))
    slopes, r1, r2 = (torch.rand(H, generator=g, dtype=torch.float64) + 0.1 for _ in range(3))
    weight = torch.randn(8, H, generator=g, dtype=torch.float64)
    mlp = [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((6, 1), (6,), (H, 6), (H,))]
    c, threshold = torch.tensor(0.3, dtype=torch.float64), torch.tensor(4.0, dtype=torch.float64)
    pairs = [
        lambda **kw: F.t5_position_bias(weight, Q, K, bidirectional=False, max_distance=6, **kw),
        lambda **kw: F.alibi_bias(slopes, Q, K, **kw),
        lambda **kw: F.log_decay_bias(Q, K, scale=0.7, dtype=torch.float64, **kw),
        lambda **kw: F.kerple_log_bias(r1, r2, Q, K, **kw),
        lambda **kw: F.fire_bias(*mlp, c, threshold, Q, K, positions=torch.arange(Q)[None] + past, **kw),
        lambda **kw: F.shaw_attention(q, k, v, torch.randn(7, D, generator=torch.Generator().manual_seed(1),
                                      dtype=torch.float64), torch.randn(7, D, generator=torch.Generator().manual_seed(2),
                                      dtype=torch.float64), max_relative_position=3, is_causal=True, **kw),
    ]
    for term in pairs:
        torch.testing.assert_close(term(past_length=past), term(relative_position=relative), rtol=0, atol=1e-12)
        # a wrong distance shows: the positions of another request (shifted by one) give another term
        assert not torch.allclose(term(past_length=past), term(relative_position=relative + 1))
    r = torch.randn(H, K, D, generator=g, dtype=torch.float64)
    u, w = torch.randn(H, D, generator=g, dtype=torch.float64), torch.randn(H, D, generator=g, dtype=torch.float64)
    band = F.transformer_xl_attention(q[:, :, :Q], k, v, r, u, w, is_causal=True)
    explicit = F.transformer_xl_attention(q[:, :, :Q], k, v, r, u, w, is_causal=True, relative_position=relative)
    torch.testing.assert_close(band, explicit, rtol=0, atol=1e-12)


@pytest.mark.parametrize("scheme", ["learned", "sinusoidal"])
def test_request_past_the_position_table_is_refused_alone(scheme):
    """A request whose prompt, or prompt and answer, runs past an absolute position table is refused where it is
    added, in one line naming max_position_embeddings; the manager goes on and the other requests get generate's
    tokens (the step's forward would raise in the manager's thread, which fails every request and stops)."""
    model = build(scheme, impl="sdpa")  # max_position_embeddings=64
    fits, long_prompt, long_answer = [3, 4, 5], list(range(2, 60)) + [7] * 12, list(range(2, 60))
    config = GenerationConfig(do_sample=False, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"inputs\[1\]: a prompt of 70 tokens .*max_position_embeddings=64") as error:
        model.generate_batch(inputs=[fits, long_prompt], generation_config=config)
    assert "\n" not in str(error.value)
    cb = ContinuousBatchingConfig(**CB_CONFIG)
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb, warmup=False
    ) as manager:
        for prompt, n in ((long_prompt, 1), (long_answer, 8)):
            with pytest.raises(ValueError, match=rf"max_new_tokens={n} needs position \d+, past max_position_embeddings"):
                manager.add_request(prompt, max_new_tokens=n)
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in ((fits, 4), (long_answer, 7))]  # 58 + 7 fits
        results = {}
        deadline = time.monotonic() + 60
        while len(results) < len(ids) and time.monotonic() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
        assert manager.is_running()
    for request_id, (prompt, n) in zip(ids, ((fits, 4), (long_answer, 7))):
        assert results[request_id].error is None, results[request_id].error
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt) :]
        assert results[request_id].generated_tokens == expected.tolist()


def _t5_bucket(d: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucket of the distance ``d = j - i`` (Raffel et al. 2020, as in Mesh TensorFlow), on Python ints."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket, n = (num_buckets if d > 0 else 0), abs(d)
    else:
        n = max(-d, 0)
    exact = num_buckets // 2
    if n < exact:
        return bucket + n
    large = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return bucket + min(large, num_buckets - 1)


def test_functional_relative_position_equals_the_paper_formulas():
    """Each term given explicit, packed positions (two requests in one row, the second with a past: not a band)
    equals a float64 oracle written from the papers' formulas pair by pair, in value and in gradient; a
    relative_position that is not an integer [Q, K] tensor is refused."""
    from hf_relpos import functional as F

    g = torch.Generator().manual_seed(3)
    f64 = dict(dtype=torch.float64)
    H, D, k_clip = 2, 4, 3
    # request A: positions 0..3 (4 keys, 2 new queries at 2, 3); request B: positions 5..9 (5 keys, 3 queries at 7..9)
    key_pos, key_req = [0, 1, 2, 3, 5, 6, 7, 8, 9], [0] * 4 + [1] * 5
    query_pos, query_req = [2, 3, 7, 8, 9], [0, 0, 1, 1, 1]
    Q, K = len(query_pos), len(key_pos)
    rel = torch.tensor([[kp - qp for kp in key_pos] for qp in query_pos])
    allowed = [[kr == qr and kp <= qp for kp, kr in zip(key_pos, key_req)] for qp, qr in zip(query_pos, query_req)]
    mask = torch.tensor(allowed)[None, None]
    leaf = lambda *shape: torch.randn(*shape, generator=g, **f64).requires_grad_()  # noqa: E731

    def check(term, oracle, params):
        got, expected = term(), oracle()
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        cotangent = torch.randn(got.shape, generator=g, **f64)
        grads = torch.autograd.grad((got * cotangent).sum(), params, allow_unused=True)
        oracle_grads = torch.autograd.grad((oracle() * cotangent).sum(), params, allow_unused=True)
        for a, b in zip(grads, oracle_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)

    pairs = [(i, j, int(rel[i, j])) for i in range(Q) for j in range(K)]
    for bidirectional in (False, True):
        weight = leaf(8, H)
        check(lambda: F.t5_position_bias(weight, Q, K, bidirectional=bidirectional, max_distance=6, relative_position=rel),
              lambda: torch.stack([weight[_t5_bucket(d, bidirectional, 8, 6)] for _, _, d in pairs]).T.reshape(1, H, Q, K),
              [weight])
    slopes = leaf(H)
    check(lambda: F.alibi_bias(slopes, Q, K, relative_position=rel),
          lambda: torch.stack([-slopes * abs(d) for _, _, d in pairs]).T.reshape(1, H, Q, K), [slopes])
    r1, r2 = (torch.rand(H, generator=g, **f64).add(0.1).requires_grad_() for _ in range(2))
    check(lambda: F.kerple_log_bias(r1, r2, Q, K, relative_position=rel),
          lambda: torch.stack([-r1 * torch.log(1 + r2 * abs(d)) for _, _, d in pairs]).T.reshape(1, H, Q, K), [r1, r2])
    torch.testing.assert_close(
        F.log_decay_bias(Q, K, scale=0.7, relative_position=rel, **f64),
        torch.tensor([[-0.7 * math.log(1 + abs(int(d))) for d in row] for row in rel], **f64), rtol=1e-12, atol=1e-12)
    w1, b1, w2, b2 = leaf(6, 1), leaf(6), leaf(H, 6), leaf(H)
    c, threshold = torch.tensor(0.3, **f64, requires_grad=True), torch.tensor(4.0, **f64, requires_grad=True)
    positions = torch.tensor([query_pos])

    def fire_oracle():  # f(ψ(i - j) / ψ(max(L, i))), ψ(x) = log(1 + |c x|), f a ReLU MLP (Li et al. 2024)
        psi = lambda x: torch.log(1 + (c * x).abs())  # noqa: E731
        out = [w2 @ torch.relu(w1[:, 0] * psi(torch.tensor(float(-d), **f64)) / (psi(torch.maximum(
               torch.tensor(float(query_pos[i]), **f64), threshold)) + 1e-6) + b1) + b2 for i, _, d in pairs]
        return torch.stack(out).T.reshape(1, H, Q, K)

    check(lambda: F.fire_bias(w1, b1, w2, b2, c, threshold, Q, K, positions=positions, relative_position=rel),
          fire_oracle, [w1, b1, w2, b2, c, threshold])

    q, k, v = leaf(1, H, Q, D), leaf(1, H, K, D), leaf(1, H, K, D)

    def attend(scores, values):  # softmax over the allowed keys of each query (its own request, not after it)
        out = torch.zeros(1, H, Q, D, **f64)
        rows = []
        for i in range(Q):
            keys = [j for j in range(K) if allowed[i][j]]
            a = torch.softmax(torch.stack([scores(i, j) for j in keys], -1), -1)  # [H, n]
            rows.append(sum(a[:, n, None] * values(i, j) for n, j in enumerate(keys)))
        return out + torch.stack(rows, 1)[None]

    rel_k, rel_v = leaf(2 * k_clip + 1, D), leaf(2 * k_clip + 1, D)
    clip = lambda d: max(-k_clip, min(k_clip, d)) + k_clip  # noqa: E731
    check(lambda: F.shaw_attention(q, k, v, rel_k, rel_v, max_relative_position=k_clip, is_causal=True,
                                   attention_mask=mask, relative_position=rel),
          lambda: attend(lambda i, j: ((q[0, :, i] * k[0, :, j]).sum(-1) + q[0, :, i] @ rel_k[clip(int(rel[i, j]))]) / D**0.5,
                         lambda i, j: v[0, :, j] + rel_v[clip(int(rel[i, j]))]),
          [q, k, v, rel_k, rel_v])
    R = 4  # distances 0 .. 3; farther ones read distance 3 (clamp_len)
    r, u, w = leaf(H, R, D), leaf(H, D), leaf(H, D)
    check(lambda: F.transformer_xl_attention(q, k, v, r, u, w, attention_mask=mask, is_causal=True,
                                             relative_position=rel),
          lambda: attend(lambda i, j: (((q[0, :, i] + u) * k[0, :, j]).sum(-1) + ((q[0, :, i] + w) * r[:, R - 1 - min(
              -int(rel[i, j]), R - 1)]).sum(-1)) / D**0.5, lambda i, j: v[0, :, j]),
          [q, k, v, r, u, w])

    for bad, error in ((rel.double(), TypeError), (rel.bool(), TypeError), (rel[:, :-1], ValueError), (rel.tolist(), TypeError)):
        with pytest.raises(error, match="relative_position must be"):
            F.alibi_bias(slopes, Q, K, relative_position=bad)


def test_empty_prompt_is_refused_alone():
    """An empty prompt is refused where it is added (its step had no row to read a token from: the manager's thread
    raised and failed every request); the other requests get generate's tokens."""
    model = build("t5_bias", impl="sdpa")
    config = GenerationConfig(do_sample=False, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"inputs\[0\]: input_ids is an empty prompt") as error:
        model.generate_batch(inputs=[[], [3, 4]], generation_config=config)
    assert "\n" not in str(error.value)
    cb = ContinuousBatchingConfig(**CB_CONFIG)
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb, warmup=False
    ) as manager:
        with pytest.raises(ValueError, match=r"input_ids is an empty prompt"):
            manager.add_request([], max_new_tokens=3)
        request_id = manager.add_request([3, 4], max_new_tokens=3)
        result, deadline = None, time.monotonic() + 60
        while (result is None or not result.is_finished()) and time.monotonic() < deadline:
            result = manager.get_result(timeout=1)
    assert result is not None and result.error is None, result
    assert result.request_id == request_id
    assert result.generated_tokens == model.generate(torch.tensor([[3, 4]]), max_new_tokens=3, do_sample=False)[0, 2:].tolist()


# ---------------------------------------------------------------------------
# The paged cache's size: what the requests can need, not the machine's free memory
# ---------------------------------------------------------------------------

_RSS_PROBE = """
import sys, torch
sys.path.insert(0, {tests!r})
from transformers import GenerationConfig
from tiny import build
model = build("alibi", impl="sdpa")
inputs = [[2 + (i * 7 + j) % 50 for j in range(3 + i)] for i in range(8)]
config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
out = model.generate_batch(inputs=inputs, generation_config=config)
assert all(len(r.generated_tokens) == 6 for r in out.values()), out
# VmHWM: this process's own peak (ru_maxrss also counts the parent's resident memory at the fork: a pytest worker's)
status = open("/proc/self/status").read()
print(int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) // 1024)
"""


def test_generate_batch_peaks_far_below_the_machines_memory():
    """``generate_batch`` with no cache budget given: Transformers alone fills 60-90% of the free memory with cache
    blocks (14.4 GB peak RSS on a 24 GB machine for this 2-layer, hidden-32 model); sized for its 8 requests it
    peaks under 1 GiB (torch and Transformers themselves take ~0.4)."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", _RSS_PROBE.format(tests=tests)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    peak_mib = int(done.stdout.split()[-1])
    assert peak_mib < 1024, f"generate_batch peaked at {peak_mib} MiB"


def test_the_default_cache_holds_the_workload_and_a_given_budget_is_kept():
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from hf_relpos.generation_relpos import CONCURRENT_REQUESTS, CPU_BATCH_TOKENS, size_paged_cache

    cpu = torch.device("cpu")
    hints = WorkloadHints(max_prompt_length=300, max_generated_length=100, num_requests=5)
    sized = size_paged_cache(ContinuousBatchingConfig(page_size=256), hints, 64, cpu)
    assert (sized.num_blocks, sized.max_requests_per_batch) == (5 * 2, 5)  # 400 tokens: two pages a request
    assert sized.max_batch_tokens == CPU_BATCH_TOKENS
    no_hints = size_paged_cache(None, None, 1000, cpu)
    assert no_hints.num_blocks == CONCURRENT_REQUESTS * 4 and no_hints.max_batch_tokens == CPU_BATCH_TOKENS
    given = ContinuousBatchingConfig(num_blocks=3)
    assert size_paged_cache(given, hints, 64, cpu).num_blocks == 3
    share = size_paged_cache(ContinuousBatchingConfig(max_memory_percent=0.2), hints, 64, cpu)
    assert share.num_blocks is None and share.max_memory_percent == 0.2
    assert size_paged_cache(ContinuousBatchingConfig(max_requests_per_batch=2), hints, 64, cpu).num_blocks == 4
    # no max_new_tokens (generate_batch's hints then say 0): the answer's length is unknown, nominal_length more
    unbounded = WorkloadHints(max_prompt_length=200, max_generated_length=0, num_requests=2)
    assert size_paged_cache(ContinuousBatchingConfig(page_size=256), unbounded, 64, cpu).num_blocks == 2 * 2
    gpu = size_paged_cache(None, hints, 64, torch.device("meta"))
    assert gpu.max_batch_tokens is None  # Transformers' own on an accelerator
    caller = ContinuousBatchingConfig()
    size_paged_cache(caller, hints, 64, cpu)
    assert caller.num_blocks is None  # the caller's configuration is not changed


def test_a_request_longer_than_the_whole_cache_is_refused_at_the_caller():
    model = build("alibi", impl="sdpa")
    config = ContinuousBatchingConfig(page_size=16, num_blocks=2, max_batch_tokens=12, max_requests_per_batch=2)
    with model.continuous_batching_context_manager(
        generation_config=GenerationConfig(do_sample=False, max_new_tokens=4), continuous_batching_config=config,
        warmup=False,
    ) as manager:
        with pytest.raises(ValueError, match="need 34 tokens of paged cache, which holds 32"):
            manager.add_request(list(range(2, 32)), max_new_tokens=4)
        assert manager.is_running()


def test_a_kept_manager_too_small_for_a_later_batch_is_one_line_not_an_empty_result():
    """persistent_manager=True keeps the first batch's manager and its cache; a later, longer batch was answered
    with {} (Transformers logs the error it raised in its loop) whatever configuration it gave."""
    model = build("alibi", impl="sdpa")
    config = GenerationConfig(do_sample=False, max_new_tokens=3, eos_token_id=None, pad_token_id=0)
    try:
        first = model.generate_batch(inputs=[[2, 3, 4]], generation_config=config, persistent_manager=True)
        assert len(first) == 1
        with pytest.raises(ValueError, match=r"inputs\[0\]: .*destroy_cached_continuous_batching_manager"):
            model.generate_batch(inputs=[list(range(2, 50)) * 8], generation_config=config,
                                 continuous_batching_config=ContinuousBatchingConfig(num_blocks=64))
    finally:
        model.destroy_cached_continuous_batching_manager()
