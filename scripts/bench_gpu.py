"""GPU benchmark of ``relpos_attention`` (the Triton kernel, ``attn_implementation="relpos_triton"``) against the
usual ways of adding a relative-position term to attention: time of forward + backward, peak memory, accuracy and
determinism. Meant for one run of at most 8 minutes on one H100 / H200.

What it measures, bfloat16, causal, 16 heads of size 64, a fixed 16384 tokens per batch (batch = 16384 // n) at
n = 1024 .. 16384:

- ``relpos_triton`` with each term: T5's table (32 buckets, max distance 128, ``index`` from
  ``t5_relative_position_bucket`` over distances -R..R, R = ``t5_saturation_distance(False, 32, 128)``), ALiBi
  (``linear``), KERPLE (``log``), FoX (``query_key``); gradients into q, k, v and the term's values;
- SDPA without a bias (the floor: flash where torch takes it), SDPA with a materialised ``[B, H, n, n]`` T5 bias
  built from the table in the timed step (upstream T5's way, gradient into the table);
- FlexAttention (``torch.compile``d) with score functions reading the same small tables, gradients into them;
- when installed: upstream T5's eager attention (Transformers' ``T5Attention.compute_bias`` + matmul/softmax),
  ``flash_attn`` with ``alibi_slopes``, fla's FoX kernel (``fla.ops.forgetting_attn``), x-transformers' T5 bias;
  otherwise reported "not installed".

Times are CUDA-event medians after warm-up (forward alone and forward + backward from the same steps); memory is
``torch.cuda.max_memory_allocated`` during the timed steps, reset per case, also as "extra" above the case's
inputs. Accuracy, at every size it times: each relpos_triton output and gradient (q, k, v, term) against SDPA's
math backend in float32 with the float32 bias materialised, batch 2 with the second row's first n/8 keys padding,
the gradient flowing from ``CHECKED_ROWS`` queries (so the reference holds their scores alone); determinism: two
backward runs give bitwise-equal term gradients (``torch.equal``); a wrong number makes the run exit 1. A failed
case (out of memory or an error) is recorded and the run goes on; a case whose ``[B, H, n, n]`` tensors would
take more than ``MEMORY_SHARE`` of the card's free memory is skipped with its estimate; a case's steps stop after
``--case-cap-s`` seconds; past the global deadline (``--budget-s``) the remaining cases are skipped. Order: accuracy, the core cases at every n,
third parties, then FlexAttention (its compiles are the slow part).

    python scripts/bench_gpu.py                          # on the GPU: results/bench-gpu.{md,json}
    python scripts/bench_gpu.py --budget-s 300 --sizes 1024,4096
    python scripts/bench_gpu.py --dry --out /tmp/bench   # CPU plumbing check under TRITON_INTERPRET=1, tiny sizes

``--dry`` runs everything but FlexAttention and the third parties on CPU through Triton's interpreter at n = 32, 48
(batch 1, 2 heads of size 16, float32): the numbers mean nothing there, the plumbing is what it checks.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("table", "linear", "log", "query_key")
LABEL = {"table": "T5", "linear": "ALiBi", "log": "KERPLE", "query_key": "FoX", None: "none"}
BUCKETS, MAX_DISTANCE = 32, 128
# The queries the accuracy check compares at each size (the first and the last half of them): its float32 reference
# holds their scores alone, [2, H, 256, n] (512 MiB at n = 16,384), not the [2, H, n, n] of every query.
CHECKED_ROWS = 256
# A case that would materialise more than this share of the card's free memory is skipped (recorded, with its
# estimate), rather than run out of memory after minutes; a case's steps stop once it has run CASE_CAP_S seconds.
MEMORY_SHARE = 0.85


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU plumbing check under TRITON_INTERPRET=1")
    parser.add_argument("--out", type=Path, default=None, help="folder for bench-gpu.md / .json (default results/)")
    # 7 minutes of cases: the last one started (a FlexAttention compile) and the writing stay within 8.
    parser.add_argument("--budget-s", type=float, default=420.0, help="global deadline; later cases are skipped")
    parser.add_argument("--sizes", default=None, help="sequence lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per case (median)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per case")
    parser.add_argument("--case-cap-s", type=float, default=30.0,
                        help="a case's warm-up and timed steps stop after this many seconds (at least one timed)")
    args = parser.parse_args(argv)
    if args.dry and args.out is None:
        parser.error("--dry needs --out DIR (its numbers must not replace results/bench-gpu.*)")
    return args


class Bench:
    def __init__(self, args, torch):
        self.torch = torch
        self.args = args
        self.dry = args.dry
        self.device = torch.device("cpu" if args.dry else "cuda")
        self.cuda = not args.dry
        if args.dry:  # the interpreter multiplies bfloat16 bit patterns: float32 there
            self.dtype, self.heads, self.head_dim, self.tokens = torch.float32, 2, 16, None
            self.sizes = [32, 48]
            self.check_batch = 2
            self.warmup, self.repeats = 1, 1  # the interpreter takes ~0.2-0.8 s a step: plumbing, not timing
        else:
            self.dtype, self.heads, self.head_dim, self.tokens = torch.bfloat16, 16, 64, 16384
            self.sizes = [1024, 2048, 4096, 8192, 16384]
            self.check_batch = 2
            self.warmup, self.repeats = 3, 7
        if args.sizes:
            self.sizes = [int(s) for s in args.sizes.split(",")]
        self.warmup = args.warmup if args.warmup is not None else self.warmup
        self.repeats = args.repeats if args.repeats is not None else self.repeats
        self.scale = self.head_dim ** -0.5
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s

        from hf_relpos import functional as F

        self.F = F
        self.R = F.t5_saturation_distance(False, BUCKETS, MAX_DISTANCE)
        distances = torch.arange(-self.R, self.R + 1)
        # T5's buckets as an integer vector: exact at bucket edges on any device (no logarithm in the kernel).
        self.index = F.t5_relative_position_bucket(distances, bidirectional=False, num_buckets=BUCKETS,
                                                   max_distance=MAX_DISTANCE).to(self.device, torch.int32)

    # -- inputs ---------------------------------------------------------------------------------------------------

    def batch(self, n):
        return 1 if self.dry else max(1, self.tokens // n)

    def qkv(self, batch, n, layout="bhnd"):
        torch = self.torch
        shape = (batch, self.heads, n, self.head_dim) if layout == "bhnd" else (batch, n, self.heads, self.head_dim)
        return [torch.randn(shape, device=self.device, dtype=self.dtype, requires_grad=True) for _ in range(3)]

    def values(self, kind, batch, n):
        """The term's small float32 inputs, as relpos_attention takes them (``values``), needing a gradient."""
        torch, F, H = self.torch, self.F, self.heads
        dev = self.device
        if kind == "table":
            v = 0.5 * torch.randn(H, BUCKETS, device=dev)
        elif kind == "linear":
            v = torch.stack([F.alibi_slopes(H).to(dev), torch.zeros(H, device=dev)])
        elif kind == "log":
            v = torch.stack([0.5 + torch.rand(H, device=dev), 0.5 + torch.rand(H, device=dev)])
        else:  # FoX: forget gates near 1, c = cumsum(log f), as fox_query_key_bias's high and low parts
            log_forget = torch.nn.functional.logsigmoid(torch.randn(batch, H, n, device=dev) + 3.0)
            v = F.fox_query_key_bias(log_forget, n)
        return v.float().requires_grad_(True)

    def distances(self, n, rows=None):
        """Key minus query position, ``[n, n]`` (or ``[len(rows), n]`` for the queries ``rows``)."""
        positions = self.torch.arange(n, device=self.device)
        queries = positions if rows is None else rows
        return positions[None, :] - queries[:, None]

    def dense_bias(self, kind, values, n, dtype, rows=None):
        """The term materialised ``[1 or B, H, n, n]`` with the causal mask, differentiable in ``values`` (only the
        queries ``rows`` when given: ``[1 or B, H, len(rows), n]``)."""
        torch = self.torch
        d = self.distances(n, rows)
        if kind == "table":
            bias = values[:, self.index.long()[d.clamp(-self.R, self.R) + self.R]]
        elif kind == "linear":
            bias = -values[0][:, None, None] * d.abs()
        elif kind == "log":
            bias = -values[0][:, None, None] * torch.log1p(values[1][:, None, None] * d.abs())
        else:
            u = values[..., 0, :] + values[..., 1, :]
            query_part = u[..., :n] if rows is None else u[..., :n][..., rows]
            bias = query_part[..., :, None] + u[..., None, n:]
        if bias.dim() == 3:
            bias = bias[None]
        return bias.to(dtype).masked_fill(d > 0, float("-inf"))

    # -- the methods: each returns (forward, leaves, note); forward() -> output, gradients taken into leaves -------

    def relpos(self, kind, n):
        from hf_relpos.triton_attention_relpos import relpos_attention

        b = self.batch(n)
        q, k, v = self.qkv(b, n)
        values = self.values(kind, b, n)
        index = self.index if kind == "table" else None

        def forward():
            return relpos_attention(q, k, v, scale=self.scale, causal=True, term=kind, values=values, index=index)

        return forward, [q, k, v, values], ""

    def sdpa_plain(self, kind, n):
        torch = self.torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        b = self.batch(n)
        q, k, v = self.qkv(b, n)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def default():
            return sdpa(q, k, v, is_causal=True, scale=self.scale)

        if not self.cuda:
            return default, [q, k, v], "default dispatch"

        def flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return sdpa(q, k, v, is_causal=True, scale=self.scale)

        try:  # the floor: flash where torch can take it
            flash()
            return flash, [q, k, v], "flash"
        except RuntimeError:
            return default, [q, k, v], "default dispatch (flash refused)"

    def sdpa_materialised(self, kind, n):
        torch = self.torch
        b = self.batch(n)
        q, k, v = self.qkv(b, n)
        values = self.values(kind, b, n)

        def forward():
            # As upstream T5: the [1, H, n, n] bias gathered from the table each step, plus the causal mask,
            # broadcast to [B, H, n, n] (the batch's mask in upstream), then attention with it as attn_mask.
            bias = self.dense_bias(kind, values, n, q.dtype).expand(b, -1, -1, -1).contiguous()
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale)

        return forward, [q, k, v, values], "[B, H, n, n] bias"

    def flex(self, kind, n, grad=True):
        torch = self.torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if not hasattr(self, "_flex"):
            # One compiled function for every score function and length: allow their recompiles.
            for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                         "accumulated_recompile_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 256)
            self._flex = torch.compile(flex_attention, dynamic=False)
        b = self.batch(n)
        q, k, v = self.qkv(b, n)
        values = self.values(kind, b, n)
        if kind == "query_key":  # the small table: one float32 value per query and per key, [B, H, 2n]
            values = (values[..., 0, :] + values[..., 1, :]).detach().requires_grad_(True)
        if not grad:
            values = values.detach()
        index, R = self.index, self.R

        def score(s, bb, h, qi, kv):
            if kind == "table":
                return s + values[h, index[(kv - qi).clamp(-R, R) + R]]
            distance = (qi - kv).abs().to(torch.float32)
            if kind == "linear":
                return s - values[0, h] * distance
            if kind == "log":
                return s - values[0, h] * torch.log1p(values[1, h] * distance)
            return s + values[bb, h, qi] + values[bb, h, n + kv]

        mask = create_block_mask(lambda bb, h, qi, kv: qi >= kv, None, None, n, n, device=self.device)

        def forward():
            return self._flex(q, k, v, score_mod=score, block_mask=mask, scale=self.scale)

        note = "compiled, gradient into the table" if grad else "compiled, NO gradient into the table (refused)"
        return forward, [q, k, v, values] if grad else [q, k, v], note

    def t5_upstream(self, kind, n):
        torch = self.torch
        from transformers import T5Config
        from transformers.models.t5.modeling_t5 import T5Attention

        config = T5Config(d_model=self.heads * self.head_dim, d_kv=self.head_dim, num_heads=self.heads,
                          relative_attention_num_buckets=BUCKETS, relative_attention_max_distance=MAX_DISTANCE,
                          is_decoder=True)
        layer = T5Attention(config, has_relative_attention_bias=True, layer_idx=0).to(self.device, self.dtype)
        b = self.batch(n)
        q, k, v = self.qkv(b, n)
        weight = layer.relative_attention_bias.weight
        causal = torch.zeros(n, n, device=self.device, dtype=self.dtype).masked_fill(
            self.distances(n) > 0, torch.finfo(self.dtype).min)[None, None].expand(b, 1, n, n)

        def forward():
            # T5Attention.forward's eager path after its projections: no scaling, bias + mask, float32 softmax.
            bias = layer.compute_bias(n, n, device=self.device) + causal
            scores = torch.matmul(q, k.transpose(3, 2)) + bias
            weights = torch.nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
            return torch.matmul(weights, v)

        return forward, [q, k, v, weight], "eager, compute_bias + [B, H, n, n] scores"

    def flash_alibi(self, kind, n):
        from flash_attn import flash_attn_func

        b = self.batch(n)
        q, k, v = self.qkv(b, n, layout="bnhd")
        slopes = self.F.alibi_slopes(self.heads).to(self.device, self.torch.float32)

        def forward():
            return flash_attn_func(q, k, v, softmax_scale=self.scale, causal=True, alibi_slopes=slopes)

        return forward, [q, k, v], "alibi_slopes (no gradient into them)"

    def fla_fox(self, kind, n):
        from fla.ops.forgetting_attn import parallel_forgetting_attn

        torch = self.torch
        b = self.batch(n)
        q, k, v = self.qkv(b, n, layout="bnhd")
        # float32 log forget gates, as fla's FoX layer computes them
        g = torch.nn.functional.logsigmoid(torch.randn(b, n, self.heads, device=self.device) + 3.0)
        g = g.requires_grad_(True)

        def forward():
            return parallel_forgetting_attn(q, k, v, g, scale=self.scale)

        return forward, [q, k, v, g], "gradient into log f"

    def x_transformers_t5(self, kind, n):
        torch = self.torch
        from x_transformers.x_transformers import RelativePositionBias

        module = RelativePositionBias(scale=1.0, causal=True, heads=self.heads, num_buckets=BUCKETS,
                                      max_distance=MAX_DISTANCE).to(self.device)
        b = self.batch(n)
        q, k, v = self.qkv(b, n)
        weight = next(module.parameters())
        keep = self.distances(n) <= 0

        def forward():
            bias = module(n, n).to(q.dtype).masked_fill(~keep, float("-inf"))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias[None], scale=self.scale)

        return forward, [q, k, v, weight], "RelativePositionBias + SDPA"

    # -- running a case -------------------------------------------------------------------------------------------

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def release(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def measure(self, build, kind, n):
        """Median forward and forward+backward time and peak memory of one case. After its first call (which
        compiles), its warm-up and timed steps take at most ``--case-cap-s`` seconds: warm-up stops there, and the
        timed steps are as many as the warm-up's pace says fit in what is left (at least one; ``repeats`` in the
        row). The timed steps run back to back, one synchronisation after them, as before the cap."""
        torch = self.torch
        self.release()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        forward, leaves, note = build(kind, n)
        grad_out = None
        started = time.perf_counter()
        out = forward()
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, grad_out)
        self.sync()
        first = time.perf_counter() - started  # includes JIT / compile
        del out, grads
        cap_start, pace = time.perf_counter(), first  # seconds per step: the first call's until a warm-up step
        for done in range(max(0, self.warmup - 1)):
            if time.perf_counter() - cap_start > self.args.case_cap_s:
                break
            step_start = time.perf_counter()
            grads = torch.autograd.grad(forward(), leaves, grad_out)
            del grads
            self.sync()
            pace = time.perf_counter() - step_start
        self.sync()
        self.release()
        left = self.args.case_cap_s - (time.perf_counter() - cap_start)
        repeats = max(1, min(self.repeats, int(left / max(pace, 1e-6))))
        base = 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        fwd, total = [], []
        if self.cuda:
            marks = []
            for _ in range(repeats):
                e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                e[0].record()
                out = forward()
                e[1].record()
                grads = torch.autograd.grad(out, leaves, grad_out)
                e[2].record()
                del out, grads
                marks.append(e)
            torch.cuda.synchronize()
            fwd = [e[0].elapsed_time(e[1]) for e in marks]
            total = [e[0].elapsed_time(e[2]) for e in marks]
        else:
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = forward()
                t1 = time.perf_counter()
                torch.autograd.grad(out, leaves, grad_out)
                t2 = time.perf_counter()
                del out
                fwd.append(1e3 * (t1 - t0))
                total.append(1e3 * (t2 - t0))
        row = dict(status="ok", note=note, first_call_s=round(first, 3), repeats=len(total),
                   fwd_ms=round(statistics.median(fwd), 4), fwd_bwd_ms=round(statistics.median(total), 4))
        if self.cuda:
            peak = torch.cuda.max_memory_allocated()
            row.update(peak_mb=round(peak / 2**20, 1), extra_mb=round((peak - base) / 2**20, 1),
                       inputs_mb=round(base / 2**20, 1))
        del forward, leaves, grad_out
        return row

    def quadratic_bytes(self, method, n):
        """What a method that materialises ``[B, H, n, n]`` tensors needs of them in a forward + backward (an
        estimate from its tensors, read off the code: the bias, its gradient and their masked copies; upstream T5's
        float32 scores, softmax and their gradients); 0 for the methods linear in n."""
        # bytes per element of the [B, H, n, n] tensors, and of the [1, H, n, n] ones shared by the batch: the
        # materialised bias is gathered from the float32 table ([H, n, n] float32, and its gradient), cast and
        # masked in bf16, and its gradient from SDPA is [B, H, n, n] (as the broadcast mask's) before it is summed
        per_batch, shared = {"sdpa_materialised": (4, 10), "x_transformers": (4, 10), "t5_upstream": (20, 8)}.get(
            method, (0, 0))
        return (per_batch * self.batch(n) + shared) * self.heads * n * n

    def run_case(self, method, build, kind, n, reserve_s=3.0):
        row = dict(method=method, term=kind, n=n, batch=self.batch(n))
        left = self.deadline - time.monotonic()
        need = self.quadratic_bytes(method, n)
        free = self.torch.cuda.mem_get_info()[0] if self.cuda else None
        if left < reserve_s:
            row["status"] = f"skipped (budget: {left:.0f} s left)"
        elif free is not None and need > MEMORY_SHARE * free:
            row["status"] = "skipped (memory)"
            row["error"] = f"needs about {need / 2**30:.0f} GiB of n² tensors, {free / 2**30:.0f} GiB free"
        else:
            try:
                row |= self.measure(build, kind, n)
            except ImportError as error:
                row["status"] = f"not installed ({error.name or error})"
            except Exception as error:  # recorded, and the run goes on
                text = f"{type(error).__name__}: {error}"
                oom = "out of memory" in text.lower() or type(error).__name__ == "OutOfMemoryError"
                row["status"] = "oom" if oom else "error"
                row["error"] = text[:500]
            self.release()
        shown = row.get("fwd_bwd_ms", row.get("error", ""))
        print(f"[{time.monotonic() - self.start:6.1f} s] {method:<20} {LABEL[kind]:<7} n={n:<6} "
              f"{row['status']:<10} {shown}", flush=True)
        return row

    # -- accuracy and determinism ---------------------------------------------------------------------------------

    def checked_rows(self, n):
        """The queries whose outputs the accuracy check compares: the first and the last ``CHECKED_ROWS // 2``
        (all of them at n <= CHECKED_ROWS). In the padded row the first are padding themselves at n >= 1,024 (no
        key left: their zeros are checked); the last see every key, the padding keys masked among them."""
        torch, half = self.torch, CHECKED_ROWS // 2
        if n <= CHECKED_ROWS:
            return torch.arange(n, device=self.device)
        return torch.cat([torch.arange(half, device=self.device), torch.arange(n - half, n, device=self.device)])

    def accuracy(self, kind, n):
        """One size's accuracy and determinism, batch 2, the second row's first n/8 keys padding (left padding:
        its first queries have no key and give zeros). The gradient flows from the checked rows' outputs only, so
        the float32 reference needs those rows' scores alone (``[2, H, rows, n]``, not ``n²``) and every gradient
        (q's on those rows; k's, v's and the term's, which sum over them) is compared whole."""
        torch = self.torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from hf_relpos.triton_attention_relpos import relpos_attention

        b = self.check_batch
        torch.manual_seed(n)
        q, k, v = self.qkv(b, n)
        values = self.values(kind, b, n)
        index = self.index if kind == "table" else None
        key_valid = torch.ones(b, n, dtype=torch.bool, device=self.device)
        key_valid[1, : n // 8] = False
        rows = self.checked_rows(n)
        grad_out = torch.zeros_like(q)
        grad_out[:, :, rows] = torch.randn(b, self.heads, len(rows), self.head_dim, device=self.device,
                                           dtype=self.dtype)

        def run():
            out = relpos_attention(q, k, v, scale=self.scale, causal=True, term=kind, values=values, index=index,
                                   key_valid=key_valid)
            return (out.detach()[:, :, rows], *torch.autograd.grad(out, [q, k, v, values], grad_out))

        first, second = run(), run()
        leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v, values)]
        bias = self.dense_bias(kind, leaves[3], n, torch.float32, rows=rows)
        bias = bias.masked_fill(~key_valid[:, None, None, :], float("-inf"))
        dead = ~torch.isfinite(bias).any(-1, keepdim=True)  # a query with no key left: zeros, as the kernel gives
        with sdpa_kernel([SDPBackend.MATH]):  # float32 throughout, the bias materialised for the checked rows
            ref = torch.nn.functional.scaled_dot_product_attention(
                leaves[0][:, :, rows], *leaves[1:3], attn_mask=bias.masked_fill(dead, 0.0), scale=self.scale)
        ref = ref.masked_fill(dead, 0.0)
        reference = (ref.detach(), *torch.autograd.grad(ref, leaves, grad_out[:, :, rows].float()))
        errors = {}
        for name, got, want in zip(("out", "dq", "dk", "dv", "dterm"), first, reference):
            diff = (got.float() - want).abs().max().item()
            size = want.abs().max().item()
            errors[name] = dict(max_abs=diff, max_rel=diff / size if size > 0 else diff)
        return dict(term=kind, n=n, batch=b, rows=len(rows), padded_keys=n // 8,
                    dtype=str(self.dtype).replace("torch.", ""), errors=errors,
                    deterministic_term_grad=bool(torch.equal(first[4], second[4])),
                    deterministic_qkv_grad=all(bool(torch.equal(x, y)) for x, y in zip(first[1:4], second[1:4])))

    def run_accuracy(self, kind, n):
        if self.deadline - time.monotonic() < 3.0:
            return dict(term=kind, n=n, status="skipped (budget)")
        try:
            row = dict(status="ok") | self.accuracy(kind, n)
        except Exception as error:
            row = dict(term=kind, n=n, status="error", error=f"{type(error).__name__}: {error}"[:500])
        self.release()
        print(f"[{time.monotonic() - self.start:6.1f} s] accuracy {LABEL[kind]:<7} n={n:<6} {row['status']} "
              f"{ {k: '%.2e' % e['max_abs'] for k, e in row.get('errors', {}).items()} } "
              f"deterministic={row.get('deterministic_term_grad')}", flush=True)
        return row


# The largest error, relative to the reference's largest entry, that still counts as right: float32 differs from
# the float32 reference by its summation order alone; bfloat16 by its inputs' rounding (8 bits), which a term's
# gradient, a sum over every query-key pair, accumulates. A wrong kernel is off by far more.
ACCURACY_BOUNDS = {"float32": dict(values=1e-4, term=1e-3), "float16": dict(values=1e-2, term=5e-2),
                   "bfloat16": dict(values=5e-2, term=2e-1)}


def wrong_numbers(row: dict) -> list:
    """What makes an accuracy row wrong: its status, a non-finite or out-of-bounds error, a term gradient that
    differs between two identical backward runs."""
    what = f"{LABEL[row['term']]} n={row.get('n')}"
    if row["status"] != "ok":
        return [f"{what}: {row['status']}"]
    bounds = ACCURACY_BOUNDS[row["dtype"]]
    wrong = [f"{what} {name}: relative error {error['max_rel']:.2e} > "
             f"{bounds['term' if name == 'dterm' else 'values']:.0e}" for name, error in row["errors"].items()
             if not error["max_rel"] <= bounds["term" if name == "dterm" else "values"]]  # nan is wrong too
    if not row["deterministic_term_grad"]:
        wrong.append(f"{what}: the term's gradient differs between two identical backward runs")
    return wrong


def versions(torch):
    found = {"torch": torch.__version__}
    for name in ("triton", "transformers", "flash_attn", "fla", "x_transformers"):
        try:
            module = __import__(name)
            found[name] = getattr(module, "__version__", "installed")
        except Exception:
            found[name] = "not installed"
    return found


def ratios(cases, sizes):
    """relpos_triton T5 / no-bias SDPA, materialised SDPA / relpos_triton T5, per n."""
    def time_of(method, kind, n):
        for row in cases:
            if (row["method"], row["term"], row["n"]) == (method, kind, n) and row["status"] == "ok":
                return row["fwd_bwd_ms"]
        return None

    out = []
    for n in sizes:
        t5, floor = time_of("relpos_triton", "table", n), time_of("sdpa", None, n)
        dense, flex = time_of("sdpa_materialised", "table", n), time_of("flex", "table", n)
        out.append(dict(n=n, t5_over_floor=t5 / floor if t5 and floor else None,
                        materialised_over_t5=dense / t5 if t5 and dense else None,
                        flex_over_t5=flex / t5 if t5 and flex else None))
    return out


def markdown(report) -> str:
    sizes = report["config"]["sizes"]
    cases = report["cases"]
    keys = []
    for row in cases:
        if (row["method"], row["term"]) not in keys:
            keys.append((row["method"], row["term"]))

    def cell(method, kind, n, field, fmt):
        for row in cases:
            if (row["method"], row["term"], row["n"]) == (method, kind, n):
                if row["status"] != "ok":
                    return row["status"].split(" (")[0]
                value = row.get(field)
                return "—" if value is None else fmt.format(value)
        return "—"

    def table(field, fmt):
        lines = ["| method | term | " + " | ".join(f"n = {n}" for n in sizes) + " |",
                 "| --- | --- |" + " --- |" * len(sizes)]
        for method, kind in keys:
            lines.append(f"| {method} | {LABEL[kind]} | " +
                         " | ".join(cell(method, kind, n, field, fmt) for n in sizes) + " |")
        return lines

    c = report["config"]
    lines = [
        "# GPU benchmark: relpos_triton against SDPA, FlexAttention and others",
        "",
        f"`python scripts/bench_gpu.py{' ' + ' '.join(report['argv']) if report['argv'] else ''}` on "
        f"**{report['device']}**; " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".",
        "",
        f"{c['dtype']}, causal, {c['heads']} heads of size {c['head_dim']}, batch = "
        f"{'1' if c['tokens'] is None else str(c['tokens']) + ' // n'}; medians of {c['repeats']} steps after "
        f"{c['warmup']} warm-up (fewer where a case reached its cap: see the notes). T5: {BUCKETS} buckets, max distance {MAX_DISTANCE}, R = {c['R']}. "
        f"Run time {report['seconds']:.0f} s of a {c['budget_s']:.0f} s budget."
        + (" **Dry run (CPU, Triton interpreter): the numbers mean nothing.**" if c["dry"] else ""),
        "",
        "## Forward + backward (ms)", "", *table("fwd_bwd_ms", "{:.2f}"),
        "", "## Forward (ms)", "", *table("fwd_ms", "{:.2f}"),
    ]
    if not c["dry"]:
        lines += ["", "## Extra memory above the inputs during a step (MiB; peak = this + inputs)", "",
                  *table("extra_mb", "{:.0f}"), "", "## Peak memory (MiB)", "", *table("peak_mb", "{:.0f}")]
    lines += ["", "## Ratios of forward + backward time", "",
              "| n | relpos_triton T5 / SDPA no bias | SDPA materialised T5 / relpos_triton T5 "
              "| flex T5 / relpos_triton T5 |",
              "| --- | --- | --- | --- |"]
    for r in report["ratios"]:
        f = lambda x: "—" if x is None else f"{x:.3g}"  # noqa: E731
        lines.append(f"| {r['n']} | {f(r['t5_over_floor'])} | {f(r['materialised_over_t5'])} | "
                     f"{f(r['flex_over_t5'])} |")
    lines += ["", f"## Accuracy against float32 (SDPA math backend, bias materialised in float32), batch "
                  f"{c['check_batch']}, the second row's first n/8 keys padding", "",
              f"At every size: the outputs of {CHECKED_ROWS} queries (the first and last half; all of them at small n) "
              "and every gradient from them. max |relpos_triton - reference| (relative to max |reference| in "
              "brackets); deterministic: two backward runs bitwise equal (`torch.equal`).", "",
              "| term | n | out | dq | dk | dv | d term | term grad deterministic | dq, dk, dv deterministic |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in report["accuracy"]:
        if row["status"] != "ok":
            lines.append(f"| {LABEL[row['term']]} | {row.get('n', '')} | {row['status']} {row.get('error', '')} "
                         "| | | | | | |")
            continue
        e = row["errors"]
        lines.append(f"| {LABEL[row['term']]} | {row['n']} | " + " | ".join(
            f"{e[k]['max_abs']:.2e} ({e[k]['max_rel']:.1e})" for k in ("out", "dq", "dk", "dv", "dterm"))
            + f" | {row['deterministic_term_grad']} | {row['deterministic_qkv_grad']} |")
    failed = [r for r in cases if r["status"] not in ("ok",)]
    if failed:
        lines += ["", "## Not measured", ""]
        for r in failed:
            lines.append(f"- {r['method']} {LABEL[r['term']]} n = {r['n']}: {r['status']}"
                         + (f" — `{r['error']}`" if r.get("error") else ""))
    notes = sorted({(r["method"], r["note"]) for r in cases if r.get("note")})
    notes += [(r["method"], f"{LABEL[r['term']]} n = {r['n']}: {r['repeats']} timed steps (the case's cap, "
                            f"{c.get('case_cap_s')} s)") for r in cases
              if r["status"] == "ok" and r.get("repeats", c["repeats"]) < c["repeats"]]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {m}: {note}" for m, note in notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    if args.dry:
        # Triton reads this when kernels are defined: before anything imports triton (torch may). A process that
        # already defined them compiled (a GPU machine's test process) cannot run them on CPU tensors: say so.
        if "hf_relpos.triton_attention_relpos" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            print("--dry needs TRITON_INTERPRET=1 before the kernels are defined: run it in a process of its own",
                  file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.dry and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or --dry for the CPU plumbing check", file=sys.stderr)
        return 2
    bench = Bench(args, torch)
    if not args.dry:
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in true float32
    out = args.out or ROOT / "results"
    started = time.monotonic()

    accuracy = [bench.run_accuracy(kind, n) for n in bench.sizes for kind in KINDS]
    cases = []
    for n in bench.sizes:  # the core cases first, every length
        cases.append(bench.run_case("sdpa", bench.sdpa_plain, None, n))
        cases.append(bench.run_case("relpos_triton", bench.relpos, "table", n))
        cases.append(bench.run_case("sdpa_materialised", bench.sdpa_materialised, "table", n))
        for kind in ("linear", "log", "query_key"):
            cases.append(bench.run_case("relpos_triton", bench.relpos, kind, n))
    if args.dry:
        cases += [dict(method=m, term=k, n=n, batch=bench.batch(n), status="skipped (dry)")
                  for m, k in (("flash_attn", "linear"), ("fla", "query_key"), ("x_transformers", "table"))
                  for n in bench.sizes]
    else:
        for method, build, kind in (("flash_attn", bench.flash_alibi, "linear"), ("fla", bench.fla_fox, "query_key"),
                                    ("x_transformers", bench.x_transformers_t5, "table")):
            for n in bench.sizes:
                cases.append(bench.run_case(method, build, kind, n))
    for n in bench.sizes:  # upstream T5 (Transformers, an optional reference), eager and materialised
        cases.append(bench.run_case("t5_upstream", bench.t5_upstream, "table", n))
    for kind in KINDS:  # FlexAttention last: a compile per score function and length
        for n in bench.sizes:
            if args.dry:
                cases.append(dict(method="flex", term=kind, n=n, batch=bench.batch(n), status="skipped (dry)"))
            else:
                row = bench.run_case("flex", bench.flex, kind, n, reserve_s=60.0)
                if row["status"] == "error":  # e.g. a backend refusing captured gradients: time it without them
                    retry = bench.run_case("flex", lambda kind, n: bench.flex(kind, n, grad=False), kind, n,
                                           reserve_s=60.0)
                    if retry["status"] == "ok":
                        row = retry | dict(error_with_term_grad=row["error"])
                cases.append(row)

    report = dict(
        argv=list(argv if argv is not None else sys.argv[1:]),
        device=torch.cuda.get_device_name() if not args.dry else f"CPU ({platform.processor() or platform.machine()})"
        + ", Triton interpreter",
        versions=versions(torch),
        config=dict(dry=args.dry, dtype=str(bench.dtype).replace("torch.", ""), heads=bench.heads,
                    head_dim=bench.head_dim, tokens=bench.tokens, sizes=bench.sizes, warmup=bench.warmup,
                    repeats=bench.repeats, checked_rows=CHECKED_ROWS, check_batch=bench.check_batch, R=bench.R,
                    budget_s=args.budget_s, case_cap_s=args.case_cap_s, causal=True, buckets=BUCKETS, max_distance=MAX_DISTANCE),
        seconds=round(time.monotonic() - started, 1),
        accuracy=accuracy, cases=cases, ratios=ratios(cases, bench.sizes),
    )
    # Extra memory against n, per method (MiB), for the reader who wants the growth at a glance.
    report["extra_memory_mb"] = {
        f"{r['method']}:{LABEL[r['term']]}": {str(x['n']): x.get("extra_mb") for x in cases
                                              if (x["method"], x["term"]) == (r["method"], r["term"])}
        for r in cases
    } if not args.dry else {}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-gpu.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "bench-gpu.md").write_text(markdown(report))
    print(f"wrote {out / 'bench-gpu.md'} and .json")
    bad = [line for row in accuracy for line in wrong_numbers(row)]
    for line in bad:
        print(f"bench_gpu: wrong numbers: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
