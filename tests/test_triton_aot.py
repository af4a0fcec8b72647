"""The Triton kernels compile for real GPUs (sm_80, sm_90) within the hardware's limits, checked on a CPU machine:
``scripts/triton_aot.py --quick`` (bfloat16, head size 64, the table and query_key terms, all three kernels)
compiled by Triton's NVIDIA backend and measured by ``ptxas -v``. What the interpreter the other tests run under
cannot see: shape rules of the GPU targets, register pressure, shared memory, atomics in the PTX."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "triton_aot.py"


def test_quick_aot_compile_within_limits(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0")  # the backend compile, not the interpreter
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--targets", "80,90", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    report_path = tmp_path / "triton-aot.json"
    assert report_path.exists(), done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    cases = report["cases"]
    assert {(c["kernel"], c["kind"], c["target"]) for c in cases} == {
        (kernel, kind, target) for kernel in ("forward", "backward_kv", "backward_q")
        for kind in ("table", "query_key") for target in ("sm_80", "sm_90")
    }
    for case in cases:
        name = f"{case['kernel']} {case['kind']} {case['target']}"
        assert "error" not in case, f"{name}: {case.get('error')}"
        assert case["registers"] <= 255, name
        assert not case["float_atomics"], f"{name}: {case['float_atomics']}"
        assert case["shared"] <= {"sm_80": 163 * 1024, "sm_90": 227 * 1024}[case["target"]], name
        if case["kernel"] == "forward":
            assert case["spill_stores"] == 0 and case["spill_loads"] == 0, name
    assert report["violations"] == []
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "triton-aot.md").exists()
