"""Ahead-of-time compile of the Triton attention kernels (``hf_relpos/triton_attention_relpos.py``) for sm_80 and sm_90,
on a machine without a GPU: register count, spills, shared memory and floating-point atomics per kernel.

``triton.compile`` runs Triton's full NVIDIA backend on the CPU (shape rules, layouts, shared-memory allocation,
PTX); ``ptxas -v`` (shipped inside the triton package; the one Triton's build uses per target), given the options Triton's own build passes
(``-lineinfo --regAllocOptLevel=2``, so the numbers are the cubin's that runs; plain ``ptxas -v`` also recorded),
then reports registers and spill stores/loads. This catches
what the interpreter the test suite runs under cannot (a shape a GPU target rejects, register pressure, shared
memory over the card's limit); it says nothing about speed.

Configuration compiled: the GPU launch of ``_forward`` / ``_backward`` (tiles, warps and stages of each kernel
from ``triton_attention_relpos.GPU_LAUNCH``, ``UPCAST=False``, ``PRECISION="tf32"``), head sizes DP = 64 and 128,
bfloat16 and float16 inputs, every KIND
(0 none, 1 table, 2 log, 3 linear, 4 query_key), with ``CAUSAL``, ``HAS_VALID`` and ``HAS_DOC`` all True (the
heaviest mask) and ``TERM_GRAD`` True where a term exists (the backward that also sums the term's gradient; the
forward then also keeps its float32 output, ``KEEP32``); the signature is read from each kernel's parameters;
the table has 32 entries (T5's buckets: ``NBP = 32``), the other kinds ``NBP = 1``, as the launcher pads them.

Limits checked (exit status 1 when one is broken, or a kernel fails to compile): no spills in the forward kernel,
no floating-point atomics in any kernel, registers <= 255, shared memory <= 227 KB (sm_90) / 163 KB (sm_80).

    python scripts/triton_aot.py                     # both targets, all cases: results/triton-aot.{md,json}
    python scripts/triton_aot.py --quick --out /tmp/aot --targets 90   # bfloat16, DP 64, table and query_key
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# The backend compile must not be routed to the interpreter: set before triton is imported.
os.environ["TRITON_INTERPRET"] = "0"

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = {0: "none", 1: "table", 2: "log", 3: "linear", 4: "query_key"}
DTYPES = {"bfloat16": "bf16", "float16": "fp16"}
# Per-block shared memory a kernel may opt into (CUDA programming guide, compute capabilities table).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
PTXAS_ARCH = {80: "sm_80", 90: "sm_90a"}  # Triton emits `.target sm_90a` for capability 90
MAX_REGISTERS = 255
TABLE_ENTRIES = 32  # T5's 32 buckets, padded to a power of two by the launcher (NBP)

# Atomic instructions in PTX: atom/red, a state space, then modifiers and a type (e.g. red.global.add.f32,
# atom.global.gpu.acq_rel.add.noftz.bf16x2, atom.shared.cas.b32).
ATOMIC = re.compile(r"\b(?:atom|red)(?:\.[A-Za-z0-9_]+)+")
FLOAT_TYPE = re.compile(r"\.(?:f16|f16x2|bf16|bf16x2|f32|f64|e4m3\w*|e5m2\w*)\b")


# Argument types by name ("X": the inputs' dtype), read against each kernel's own parameter list, so that a new
# argument fails loudly here instead of compiling a stale signature.
POINTER_TYPES = {**{n: "X" for n in ("Q", "K", "V", "OUT", "DO", "DK", "DV", "DQ")},
                 **{n: "*fp32" for n in ("LSE", "OUT32", "T", "DELTA", "GT")},
                 "IDX": "*i32", "DOC": "*i32", "KV": "*i8"}
SCALAR_TYPES = {**{n: "i32" for n in ("H", "QL", "KL", "D", "past", "R", "NB")}, "scale": "fp32"}


def constexpr_values(kernel: str, kind: int, dp: int) -> dict:
    """The representative launch: the heaviest mask, the term's gradient where a term exists."""
    return dict(KIND=kind, CAUSAL=True, HAS_VALID=True, HAS_DOC=True,
                TERM_GRAD=kind != 0,  # the launcher turns it off without a term
                KEEP32=kind != 0,  # the float32 output the backward's delta reads with a term's gradient
                NBP=TABLE_ENTRIES if kind == 1 else 1,
                DP=dp, UPCAST=False, PRECISION="tf32", **tiles(kernel))


def tiles(kernel: str) -> dict:
    """``BM``, ``BN`` of the kernel's GPU launch (``triton_attention_relpos.GPU_LAUNCH``)."""
    from hf_relpos.triton_attention_relpos import GPU_LAUNCH

    config = GPU_LAUNCH[kernel]
    return dict(BM=config["BM"], BN=config["BN"])


def options(kernel: str) -> dict:
    """``num_warps``, ``num_stages`` of the kernel's GPU launch."""
    from hf_relpos.triton_attention_relpos import GPU_LAUNCH

    config = GPU_LAUNCH[kernel]
    return dict(num_warps=config["num_warps"], num_stages=config["num_stages"])


def signature(fn, dtype: str, kind: int, dp: int, kernel: str = "") -> tuple[dict, dict]:
    """``(signature, constexprs)`` for ``triton.compile`` from the kernel's parameters."""
    values = constexpr_values(kernel, kind, dp)
    sig, consts = {}, {}
    for param in fn.params:
        name = param.name
        if param.is_constexpr:
            if name not in values:
                raise KeyError(f"{fn.__name__}: no value for the constexpr {name} (add it to constexpr_values)")
            sig[name], consts[name] = "constexpr", values[name]
        elif name in POINTER_TYPES:
            sig[name] = "*" + DTYPES[dtype] if POINTER_TYPES[name] == "X" else POINTER_TYPES[name]
        elif name in SCALAR_TYPES:
            sig[name] = SCALAR_TYPES[name]
        else:
            raise KeyError(f"{fn.__name__}: no type for the argument {name} (add it to POINTER_TYPES/SCALAR_TYPES)")
    return sig, consts


# The options Triton 3.8's make_cubin passes to ptxas (triton/backends/nvidia/compiler.py): the cubin that runs.
# Plain `ptxas -v` (no options) allocates registers differently; both are recorded, the limits read Triton's.
TRITON_PTXAS_FLAGS = ["-lineinfo", "--regAllocOptLevel=2"]


def ptxas_for(triton, arch: int) -> Path:
    """The ptxas Triton's own build uses for ``arch``: Triton 3.9 ships two (``ptxas`` for sm_80, a newer
    ``ptxas-blackwell`` for sm_90 and later, which reads the PTX version it emits there); 3.8 uses ``ptxas`` below
    sm_100. Asked of Triton (``get_ptxas``), else the bundled ``ptxas``."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(arch).path)
    except (ImportError, AttributeError):
        return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def ptxas_report(ptxas: Path, ptx: str, arch: int, flags=()) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([str(ptxas), *flags, "-v", f"--gpu-name={PTXAS_ARCH[arch]}", str(path),
                               "-o", os.devnull], capture_output=True, text=True)
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed ({done.returncode}): {text.strip()}")

    def number(pattern):
        found = re.search(pattern, text)
        return int(found.group(1)) if found else None

    return dict(registers=number(r"Used (\d+) registers"), spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"), stack_frame=number(r"(\d+) bytes stack frame"))


def compile_case(triton, kernels: dict, ptxas: Path, kernel: str, kind: int, dtype: str, dp: int, arch: int) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = dict(kernel=kernel, kind=KINDS[kind], dtype=dtype, dp=dp, target=f"sm_{arch}")
    start = time.perf_counter()
    try:
        sig, values = signature(kernels[kernel], dtype, kind, dp, kernel)
        row["constexprs"] = values
        compiled = triton.compile(ASTSource(fn=kernels[kernel], signature=sig, constexprs=values),
                                  target=GPUTarget("cuda", arch, 32), options=options(kernel))
    except Exception as error:  # the point of the script: report the backend's refusal verbatim
        row["error"] = f"{type(error).__name__}: {error}"
        row["traceback"] = traceback.format_exc(limit=3)
        return row
    row["compile_s"] = round(time.perf_counter() - start, 2)
    ptx = compiled.asm["ptx"]
    row["shared"] = compiled.metadata.shared
    row["num_warps"] = compiled.metadata.num_warps
    row["num_stages"] = compiled.metadata.num_stages
    atomics = sorted(set(ATOMIC.findall(ptx)))
    row["atomics"] = atomics
    row["float_atomics"] = [a for a in atomics if FLOAT_TYPE.search(a)]
    # Which tensor-core path the dots took (wgmma on Hopper, mma.sync on Ampere).
    row["mma"] = "wgmma" if "wgmma." in ptx else ("mma.sync" if "mma.sync" in ptx else "none")
    try:
        row |= ptxas_report(ptxas, ptx, arch, TRITON_PTXAS_FLAGS)
        row["plain_ptxas"] = ptxas_report(ptxas, ptx, arch)
    except Exception as error:
        row["error"] = f"{type(error).__name__}: {error}"
    return row


def violations(row: dict) -> list[str]:
    if "error" in row:
        return ["does not compile"]
    found = []
    if row["registers"] is None or row["registers"] > MAX_REGISTERS:
        found.append(f"registers {row['registers']} > {MAX_REGISTERS}")
    if row["kernel"] == "forward" and (row["spill_stores"] or row["spill_loads"]):
        found.append(f"forward spills {row['spill_stores']} B stores / {row['spill_loads']} B loads")
    if row["float_atomics"]:
        found.append(f"floating-point atomics {row['float_atomics']}")
    arch = int(row["target"][3:])
    if row["shared"] > SHARED_LIMIT[arch]:
        found.append(f"shared {row['shared']} B > {SHARED_LIMIT[arch]} B")
    return found


def markdown(report: dict) -> str:
    lines = [
        "# Triton kernels compiled ahead of time (no GPU)",
        "",
        f"`python scripts/triton_aot.py{' ' + ' '.join(report['argv']) if report['argv'] else ''}` — Triton "
        f"{report['triton']}, {report['ptxas']}. Each kernel compiled by `triton.compile(ASTSource(...), "
        "target=GPUTarget(\"cuda\", arch, 32))` on a CPU machine, the PTX passed to `ptxas -v --gpu-name=sm_80 / "
        "sm_90a` with the options Triton's own build passes (`-lineinfo --regAllocOptLevel=2`: the cubin that "
        "runs; plain `ptxas -v` in the last column). Configuration: the GPU launch (each kernel's tiles BM x BN, "
        "warps and stages in the table, from `triton_attention_relpos.GPU_LAUNCH`; tf32 dots), CAUSAL, "
        "HAS_VALID and HAS_DOC True, TERM_GRAD (and the forward's KEEP32) True for every kind with a term (False for "
        "`none`), NBP = 32 for "
        "the table (T5's 32 buckets), 1 otherwise.",
        "",
        "Limits: registers <= 255; no spills in the forward kernel (the backward's are listed, not a limit); no "
        "floating-point atomics (`atom`/`red` with an f16/bf16/f32/f64 type) in any kernel; shared memory <= "
        "227 KB on sm_90, <= 163 KB on sm_80.",
        "",
        f"**Result: {'all limits hold' if not report['violations'] else 'LIMITS BROKEN'}** "
        f"({len(report['cases'])} compiles, {report['seconds']:.0f} s).",
        "",
        "| kernel | kind | dtype | DP | target | tiles, warps/stages | registers | spill st/ld (B) | shared (B) "
        "| atomics | mma | limits | plain ptxas -v: regs, spill st/ld |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["cases"]:
        head = f"| {row['kernel']} | {row['kind']} | {row['dtype']} | {row['dp']} | {row['target']} |"
        if "error" in row:
            lines.append(f"{head} — | — | — | — | — | — | compile error (below) | — |")
            continue
        head += f" {row['constexprs']['BM']}x{row['constexprs']['BN']}, {row['num_warps']}/{row['num_stages']} |"
        atomics = ", ".join(f"`{a}`" for a in row["atomics"]) or "none"
        plain = row["plain_ptxas"]
        bad = violations(row)
        lines.append(f"{head} {row['registers']} | {row['spill_stores']}/{row['spill_loads']} | {row['shared']} | "
                     f"{atomics} | {row['mma']} | {'; '.join(bad) if bad else 'ok'} | "
                     f"{plain['registers']}, {plain['spill_stores']}/{plain['spill_loads']} |")
    errors = [row for row in report["cases"] if "error" in row]
    if errors:
        lines += ["", "## Compile errors", ""]
        for row in errors:
            lines += [f"- {row['kernel']} {row['kind']} {row['dtype']} DP {row['dp']} {row['target']}:", "",
                      "```", row["error"].strip(), "```", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="80,90", help="compute capabilities, comma-separated (80, 90)")
    parser.add_argument("--quick", action="store_true", help="bfloat16, DP 64, kinds table and query_key only")
    parser.add_argument("--out", type=Path, default=ROOT / "results", help="folder for triton-aot.md / .json")
    args = parser.parse_args(argv)
    targets = [int(t) for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in SHARED_LIMIT]
    if unknown:
        parser.error(f"--targets: {unknown} not in {sorted(SHARED_LIMIT)}")

    import triton

    from hf_relpos import triton_attention_relpos as ta

    kernels = {"forward": ta._forward_kernel, "backward_kv": ta._backward_kv_kernel,
               "backward_q": ta._backward_q_kernel}
    ptxas = {arch: ptxas_for(triton, arch) for arch in targets}
    version = subprocess.run([str(ptxas[targets[0]]), "--version"], capture_output=True,
                             text=True).stdout.strip().splitlines()
    dtypes = ["bfloat16"] if args.quick else list(DTYPES)
    dps = [64] if args.quick else [64, 128]
    kinds = [1, 4] if args.quick else list(KINDS)

    start = time.perf_counter()
    cases = []
    for arch in targets:
        for dtype in dtypes:
            for dp in dps:
                for kind in kinds:
                    for kernel in kernels:
                        row = compile_case(triton, kernels, ptxas[arch], kernel, kind, dtype, dp, arch)
                        row["violations"] = violations(row)
                        cases.append(row)
                        status = row.get("error") or (
                            f"{row['registers']} regs, spills {row['spill_stores']}/{row['spill_loads']}, "
                            f"shared {row['shared']}, float atomics {row['float_atomics'] or 'none'}")
                        print(f"sm_{arch} {dtype} DP{dp} {KINDS[kind]:>9} {kernel:<11}: {status}", flush=True)
    report = dict(
        argv=list(argv if argv is not None else sys.argv[1:]), triton=triton.__version__,
        ptxas=version[-1] if version else "ptxas", targets=[f"sm_{t}" for t in targets],
        limits=dict(max_registers=MAX_REGISTERS, forward_spills=0, float_atomics=0,
                    shared_bytes={f"sm_{k}": v for k, v in SHARED_LIMIT.items()}),
        seconds=round(time.perf_counter() - start, 1), cases=cases,
        violations=[f"{r['kernel']} {r['kind']} {r['dtype']} DP{r['dp']} {r['target']}: {v}"
                    for r in cases for v in r["violations"]],
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "triton-aot.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "triton-aot.md").write_text(markdown(report))
    for line in report["violations"]:
        print("LIMIT:", line, file=sys.stderr)
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
