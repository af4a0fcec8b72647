"""scripts/bench.py's results header: the CPU it names, and the instruction sets its kernels were held to. The
timings themselves are the script's job, never a test's (docs/guides/performance.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_header_says_when_the_kernels_were_held_to_an_older_instruction_set(monkeypatch):
    """A run with ATEN_CPU_CAPABILITY (or oneDNN's, MKL's switch) takes an older CPU's code paths on this one: its
    header must say so, beside the CPU's own extensions, or its ratios would read as this CPU's."""
    bench = load_bench()
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)
    assert "held to" not in bench.machine_line(2)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    line = bench.machine_line(2)
    assert "kernels held to ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2" in line
    assert f"(ATen runs {torch.backends.cpu.get_cpu_capability()})" in line
