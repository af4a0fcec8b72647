"""Empty shapes, checked in forked children (minimal repros of what the fuzzers found).

attention_with_bias with Q = 0 or K = 0 returns zeros without calling a kernel, and the models
reject a batch of 0 sequences or of 0 tokens with ValueError. Before that fix these shapes reached CPU's fused
SDPA op, which divides by zero (SIGFPE) and ends the interpreter, so they are checked in forked children
(``test_regression_empty_*``: a regression fails one case instead of killing the pytest session) and the
in-process fuzzers of attention_with_bias (test_functional_fuzz.py) and of the models (test_modeling_fuzz.py)
leave them out.
"""

from __future__ import annotations

import os

import pytest

from hf_relpos import POSITION_ENCODINGS


EMPTY_SHAPES_SCRIPT = r"""
import json, os, sys
import torch
from hf_relpos import RelPosConfig, RelPosForCausalLM, functional as Fn

EMPTY_MESSAGE = "must hold at least one sequence of at least one token"


def attention(Q, K, bias_shape, grads):
    # attention_with_bias on Q = 0 or K = 0: zeros [B, H, Q, Dv], no kernel call; backward gives zero gradients.
    B, H, D, Dv = 2, 3, 4, 5
    q, k, v = torch.randn(B, H, Q, D), torch.randn(B, H, K, D), torch.randn(B, H, K, Dv)
    bias = torch.zeros(*bias_shape)
    leaves = {"q": q, "k": k, "v": v, "bias": bias}
    for name in grads:
        leaves[name].requires_grad_(True)
    out = Fn.attention_with_bias(q, k, v, bias)
    assert out.shape == (B, H, Q, Dv), out.shape
    assert (out == 0).all(), "not zeros"
    if grads:
        assert out.requires_grad, f"the output does not require grad although {', '.join(grads)} do"
        (out * 2).sum().backward()
        for name in grads:
            grad = leaves[name].grad
            assert grad is None or (grad == 0).all(), f"non-zero gradient of {name}"


def model_inputs(scheme, mode, report):
    # An empty batch or an empty sequence: ValueError naming input_ids / inputs_embeds, before any kernel.
    config = RelPosConfig(position_encoding=scheme, hidden_size=16, num_attention_heads=2, intermediate_size=16,
                          num_hidden_layers=1, vocab_size=16, attn_implementation=mode.split("/")[1])
    model = RelPosForCausalLM(config).train(mode.startswith("train"))
    training = mode.startswith("train")
    problems = []
    for kind in ("input_ids", "inputs_embeds"):
        for shape in ((2, 0), (0, 3)):
            report(f"{kind} {shape}")  # the parent names the input that was running if the child crashes
            if kind == "input_ids":
                inputs = {"input_ids": torch.zeros(*shape, dtype=torch.long)}
            else:
                inputs = {"inputs_embeds": torch.randn(*shape, 16, requires_grad=training)}
            labels = torch.zeros(*shape, dtype=torch.long) if training else None
            try:
                with torch.set_grad_enabled(training):
                    out = model(**inputs, labels=labels)
            except ValueError as exc:
                if not (kind in str(exc) and EMPTY_MESSAGE in str(exc)):
                    problems.append(f"{kind} {shape}: ValueError not naming {kind}: {exc}")
            except Exception as exc:
                problems.append(f"{kind} {shape}: {type(exc).__name__}: {exc}")
            else:
                problems.append(f"{kind} {shape}: no ValueError; output {tuple(out.logits.shape)}")
    assert not problems, "; ".join(problems)


def run(case, report):
    name, *args = case
    if name == "attention":
        attention(*args)
    else:
        model_inputs(*args, report)


results = {}
for case in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child runs one case: a crash (signal) ends only the child
        os.close(read)
        report = lambda step: os.write(write, (step + "\n").encode())  # noqa: E731
        try:
            run(case, report)
            message = "OK"
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}".splitlines()[0][:600]
        os.write(write, ("=" + message).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while True:
        chunk = os.read(read, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    os.close(read)
    text = b"".join(chunks).decode()
    if os.WIFSIGNALED(status):
        running = text.splitlines()[-1] if text else ""
        message = f"killed by signal {os.WTERMSIG(status)} (interpreter crash) while running {running!r}"
    else:
        message = text.rpartition("=")[2] if "=" in text else f"no result (exit status {status})"
    results[json.dumps(case)] = message
print(json.dumps(results))
"""

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_empty_shapes")

EMPTY_ATTENTION_CASES = [
    ["attention", Q, K, bias_shape, grads]
    for Q, K in ((0, 3), (3, 0), (0, 0))
    for bias_shape in ((2, 3, Q, K), (1, 1, Q, K))
    for grads in ((), ("bias",))
]
EMPTY_ATTENTION_GRAD_CASES = [["attention", Q, K, (1, 3, Q, K), grads]
                              for Q, K in ((0, 3), (3, 0)) for grads in (("q",), ("q", "k", "v"), ("v", "bias"))]
EMPTY_MODEL_CASES = [  # each child runs input_ids and inputs_embeds of shapes [2, 0] and [0, 3]
    ["model", scheme, mode] for scheme in POSITION_ENCODINGS for mode in ("eval/sdpa", "eval/eager", "train/sdpa")
]


@pytest.fixture(scope="module")
def empty_shape_results(tmp_path_factory):
    """Runs every empty-shape case in its own forked child: {case (json): "OK" or what went wrong}.

    On empty shapes CPU's fused SDPA op (``_scaled_dot_product_flash_attention_for_cpu``) divides by zero
    (SIGFPE): a regression that reached it again would otherwise end the whole pytest session.
    """
    import json
    import subprocess
    import sys

    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    script = tmp_path_factory.mktemp("empty") / "empty_shapes.py"
    script.write_text(EMPTY_SHAPES_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    cases = EMPTY_ATTENTION_CASES + EMPTY_ATTENTION_GRAD_CASES + EMPTY_MODEL_CASES
    proc = subprocess.run([sys.executable, str(script), json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    return results


def _failures(results, cases):
    import json

    failures = {json.dumps(case): results[json.dumps(case)] for case in cases if results[json.dumps(case)] != "OK"}
    return f"{len(failures)} of {len(cases)} cases fail:\n" + "\n".join(f"  {c}: {m}" for c, m in failures.items()) \
        if failures else ""


def test_regression_empty_attention_with_bias_gives_zeros(empty_shape_results):
    """attention_with_bias with Q = 0 or K = 0 (full or broadcast bias; bias gradient): zeros, no crash."""
    problems = _failures(empty_shape_results, EMPTY_ATTENTION_CASES)
    assert not problems, problems


def test_regression_empty_attention_with_bias_output_stays_in_the_autograd_graph(empty_shape_results):
    """Q = 0 or K = 0 with gradients on q / k / v: the zeros output requires grad (zero gradients), as it does
    when only bias requires grad, as shaw_attention's empty output does, and as torch's ops on empty tensors do."""
    problems = _failures(empty_shape_results, EMPTY_ATTENTION_GRAD_CASES)
    assert not problems, problems


def test_regression_empty_model_inputs_raise_valueerror(empty_shape_results):
    """input_ids / inputs_embeds with batch 0 or seq_len 0: ValueError naming the input, every scheme and mode."""
    problems = _failures(empty_shape_results, EMPTY_MODEL_CASES)
    assert not problems, problems
