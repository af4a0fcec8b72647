"""The first command on a lent GPU: the Triton kernel (``hf_relpos/triton_attention_relpos.py``) checked on the
device against float64 references written from its documented formulas, with torch and Triton alone.

Every position term (none, T5's table, KERPLE's log, ALiBi's linear, FoX's query-key) x dtype (float32, bfloat16,
float16) x mask (causal; bidirectional with key padding; packed documents; queries after a cache) at lengths that
span several tiles with ragged edges: the output and the gradients of q, k, v and the term's values against float64
(relative to each reference's largest entry, bounds per dtype), and two backward runs bitwise equal. Then a CUDA
graph's replay against the eager call, and each compiled kernel's registers, spills and atomic instructions read
from the JIT's own cache. The JSON report is rewritten after every case, so a run cut short keeps what it checked.
Exits 1 on any wrong number, error or case left unchecked.

    python scripts/gpu_check.py --out results/gpu-check.json      # on the GPU: about a minute, at most --budget-s
    python scripts/gpu_check.py --dry --out /tmp/gpu-check.json   # CPU, Triton's interpreter, small sizes (the suite)

The kernel file is loaded by its path, not as part of the package: no Transformers (nor anything else hf_relpos
needs) has to be installed on the device, only torch and Triton.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_FILE = ROOT / "hf_relpos" / "triton_attention_relpos.py"
TERMS = (None, "table", "log", "linear", "query_key")
MASKS = ("causal", "padding", "documents", "cache")
# The largest error relative to the reference's largest entry that counts as right: float32 differs from float64 by
# its rounding and summation order; half precision by its inputs' rounding, which a term's gradient (a sum over
# every query-key pair) accumulates. The kernel's float32 products: TF32 is off (allow_tf32 False).
BOUNDS = {"float32": dict(values=1e-4, term=1e-3), "float16": dict(values=1e-2, term=5e-2),
          "bfloat16": dict(values=5e-2, term=2e-1)}


def load_kernel():
    """The kernel module from its file alone (its imports: torch, triton)."""
    spec = importlib.util.spec_from_file_location("relpos_kernel_under_check", KERNEL_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sizes(dry: bool) -> dict:
    """Batch, heads, head size, length, and the cache case's queries: several tiles with ragged edges on a GPU
    (tiles of 32 and 64), several of the interpreter's (8 and 16) in --dry."""
    if dry:
        return dict(batch=2, heads=2, head_dim=16, length=21, cache_queries=5)
    return dict(batch=2, heads=4, head_dim=64, length=333, cache_queries=37)


def make_case(torch, term, mask, dtype, size, device, seed):
    """Inputs, the kernel's keyword arguments, and the float64 reference's bias and allowed pairs (``[B, H|1, Q, K]``)
    from the same (rounded) values, written from the kernel file's docstring formulas."""
    g = torch.Generator().manual_seed(seed)
    B, H, D, K = size["batch"], size["heads"], size["head_dim"], size["length"]
    Q = size["cache_queries"] if mask == "cache" else K
    past = K - Q
    causal = mask in ("causal", "cache", "documents") or term == "query_key"
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for n in (Q, K, K))
    d = torch.arange(K)[None, :] - (torch.arange(Q)[:, None] + past)  # key minus query position
    allowed = torch.ones(B, 1, Q, K, dtype=torch.bool)
    if causal:
        allowed &= d <= 0
    key_valid = documents = None
    if mask == "padding":
        key_valid = torch.ones(B, K, dtype=torch.bool)
        key_valid[0, :5] = False  # left padding
        key_valid[1, -9:] = False  # right padding
        allowed &= key_valid[:, None, None, :]
    if mask == "documents":
        documents = (torch.arange(K)[None, :] >= torch.tensor([[K // 3], [2 * K // 3]])).long()
        documents[1] += (torch.arange(K) >= K // 5).long()  # two boundaries in the second row
        allowed &= documents[:, None, past:, None] == documents[:, None, None, :]
    values = index = None
    bias = torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    if term == "table":
        radius, entries = 20, 12
        index = torch.randint(0, entries, (2 * radius + 1,), generator=g)  # any distance -> entry map
        values = torch.randn(H, entries, generator=g)
        bias = lambda t: t[:, index[d.clamp(-radius, radius) + radius]][None]  # noqa: E731
    elif term == "log":
        values = torch.stack([torch.rand(H, generator=g) * 1.5 + 0.5, torch.rand(H, generator=g) * 0.9 + 0.1])
        bias = lambda t: (-t[0, :, None, None] * torch.log1p(t[1, :, None, None] * d.abs()))[None]  # noqa: E731
    elif term == "linear":
        values = torch.stack([torch.rand(H, generator=g) * 0.5, torch.zeros(H)])
        bias = lambda t: (-t[0, :, None, None] * d.abs())[None]  # noqa: E731
    elif term == "query_key":
        values = torch.zeros(B, H, 2, Q + K)
        values[:, :, 0] = torch.randn(B, H, Q + K, generator=g) * 2  # a term per query, one per key, as float32
        values[:, :, 1] = torch.randn(B, H, Q + K, generator=g) * 1e-6  # high and low parts: b = hi + lo
        bias = lambda t: (t[:, :, 0] + t[:, :, 1])[..., :Q, None] + (t[:, :, 0] + t[:, :, 1])[..., None, Q:]  # noqa: E731
    kwargs = dict(scale=D**-0.5, causal=causal, past=past, term=term,
                  index=None if index is None else index.to(device, torch.int32),
                  key_valid=None if key_valid is None else key_valid.to(device),
                  documents=None if documents is None else documents.to(device))
    return dict(q=q, k=k, v=v, values=values, kwargs=kwargs, bias=bias, allowed=allowed, Q=Q)


def reference(torch, case, grad_out):
    """float64: ``softmax(scale·q kᵀ + b)`` over the allowed keys (zeros for a row with none), and its gradients."""
    leaves = [x.detach().double().requires_grad_() for x in (case["q"], case["k"], case["v"])]
    if case["values"] is not None:
        leaves.append(case["values"].double().requires_grad_())
        bias = case["bias"](leaves[3])
    else:
        bias = 0.0
    scores = case["kwargs"]["scale"] * leaves[0] @ leaves[1].transpose(-1, -2) + bias
    allowed = case["allowed"]
    alive = allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~alive, 0.0)
    out = torch.where(alive, torch.softmax(scores, -1), 0.0) @ leaves[2]
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out.double())]


def run_kernel(torch, kernel, case, device, grad_out):
    inputs = [x.to(device).requires_grad_() for x in (case["q"], case["k"], case["v"])]
    if case["values"] is not None:
        inputs.append(case["values"].to(device).requires_grad_())
    out = kernel.relpos_attention(*inputs[:3], values=inputs[3] if len(inputs) > 3 else None, **case["kwargs"])
    return [out.detach(), *torch.autograd.grad(out, inputs, grad_out.to(device))]


def check_case(torch, kernel, term, mask, dtype, size, device, seed) -> dict:
    case = make_case(torch, term, mask, dtype, size, device, seed)
    grad_out = torch.randn(case["q"].shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    first = run_kernel(torch, kernel, case, device, grad_out)
    second = run_kernel(torch, kernel, case, device, grad_out)
    want = reference(torch, case, grad_out)
    names = ["out", "dq", "dk", "dv", "dterm"][: len(want)]
    bounds = BOUNDS[str(dtype).replace("torch.", "")]
    errors, wrong = {}, []
    for name, got, ref in zip(names, first, want):
        diff = (got.double().cpu() - ref).abs().max().item()
        size_ = ref.abs().max().item()
        relative = diff / size_ if size_ > 0 else diff
        errors[name] = relative
        bound = bounds["term" if name == "dterm" else "values"]
        if not relative <= bound:  # NaN is wrong too
            wrong.append(f"{name} relative error {relative:.2e} > {bound:.0e}")
    if not all(torch.equal(a, b) for a, b in zip(first[1:], second[1:])):
        wrong.append("two identical backward runs differ")
    return dict(errors=errors, wrong=wrong)


def graph_replay(torch, kernel, size, device) -> dict:
    """A CUDA graph of the forward, replayed on new inputs copied into its buffers, equals the eager call."""
    case = make_case(torch, "table", "causal", torch.bfloat16, size, device, seed=7)
    q, k, v = (case[n].to(device) for n in "qkv")
    values = case["values"].to(device)
    call = lambda: kernel.relpos_attention(q, k, v, values=values, **case["kwargs"])  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    fresh = make_case(torch, "table", "causal", torch.bfloat16, size, device, seed=8)
    for buffer, name in ((q, "q"), (k, "k"), (v, "v")):
        buffer.copy_(fresh[name].to(device))
    graph.replay()
    torch.cuda.synchronize()
    return dict(equal=bool(torch.equal(captured, call())))


def compiled_kernels(kernel) -> list:
    """Registers, spills and atomic instructions of every kernel the JIT compiled in this run (its own cache)."""
    rows = []
    for name in ("_forward_kernel", "_backward_kv_kernel", "_backward_q_kernel"):
        jit = getattr(kernel, name)
        caches = getattr(jit, "device_caches", None) or {}
        for cache in caches.values():
            compiled = cache[0] if isinstance(cache, tuple) else cache
            for binary in compiled.values():
                asm = getattr(binary, "asm", {}) or {}
                text = asm.get("ptx", "") if isinstance(asm, dict) else ""
                rows.append(dict(kernel=name, registers=getattr(binary, "n_regs", None),
                                 spills=getattr(binary, "n_spills", None), atomics=text.count("atom.")))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU under Triton's interpreter, small sizes, float32")
    parser.add_argument("--out", type=Path, required=True, help="the JSON report (rewritten after every case)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="cases not begun by then are left unchecked")
    args = parser.parse_args(argv)
    if args.dry:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: before the kernel file loads
    import torch

    if not args.dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device: run it on a GPU, or with --dry", file=sys.stderr)
        return 2
    started = time.monotonic()
    kernel = load_kernel()
    device = torch.device("cpu" if args.dry else "cuda")
    if not args.dry:
        torch.backends.cuda.matmul.allow_tf32 = False
    size = sizes(args.dry)
    dtypes = [torch.float32] if args.dry else [torch.float32, torch.bfloat16, torch.float16]
    report = dict(device="CPU, Triton interpreter" if args.dry else torch.cuda.get_device_name(),
                  torch=torch.__version__, triton=getattr(kernel.triton, "__version__", None), sizes=size,
                  bounds=BOUNDS, cases=[], graph=None, kernels=[])
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        report["seconds"] = round(time.monotonic() - started, 1)
        args.out.write_text(json.dumps(report, indent=1) + "\n")

    seed = 0
    for dtype in dtypes:
        for term in TERMS:
            for mask in MASKS:
                row = dict(term=term, mask=mask, dtype=str(dtype).replace("torch.", ""))
                seed += 1
                if time.monotonic() - started > args.budget_s:
                    row["status"] = "unchecked (budget)"
                else:
                    try:
                        row.update(check_case(torch, kernel, term, mask, dtype, size, device, seed))
                        row["status"] = "wrong" if row["wrong"] else "ok"
                    except Exception as error:  # recorded, and the run goes on
                        row.update(status="error", error=f"{type(error).__name__}: {error}"[:400])
                report["cases"].append(row)
                save()
                print(f"[{time.monotonic() - started:6.1f} s] {row['dtype']:<8} {str(term):<9} {mask:<9} "
                      f"{row['status']} {'; '.join(row.get('wrong', [])) or row.get('error', '')}", flush=True)
    if not args.dry:
        try:
            report["graph"] = graph_replay(torch, kernel, size, device)
        except Exception as error:
            report["graph"] = dict(equal=False, error=f"{type(error).__name__}: {error}"[:400])
        report["kernels"] = compiled_kernels(kernel)
    save()
    bad = [c for c in report["cases"] if c["status"] != "ok"]
    if report["graph"] is not None and not report["graph"]["equal"]:
        bad.append(dict(term="graph", mask="", dtype="", status="CUDA graph replay differs from the eager call"))
    for row in bad:
        print(f"gpu_check: {row['dtype']} {row['term']} {row['mask']}: {row['status']} "
              f"{'; '.join(row.get('wrong', [])) or row.get('error', '')}", file=sys.stderr)
    print(f"gpu_check: {len(report['cases']) - len([c for c in bad if c['term'] != 'graph'])} of "
          f"{len(report['cases'])} cases right; report in {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
