"""``scripts/gpu_check.py --dry``: the first GPU command's checks, run under Triton's interpreter on CPU: every term
x mask right against its float64 reference, a planted wrong kernel caught, and the kernel file loaded with torch and
Triton alone."""

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_every_term_and_mask_is_right_under_the_interpreter(tmp_path):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--dry", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    cases = {(c["term"], c["mask"]): c for c in report["cases"]}
    assert set(cases) == {(t, m) for t in gpu_check.TERMS for m in gpu_check.MASKS}
    for key, case in cases.items():
        assert case["status"] == "ok", (key, case)
        expected = {"out", "dq", "dk", "dv"} | ({"dterm"} if key[0] else set())
        assert set(case["errors"]) == expected, key


@pytest.mark.parametrize("plant", ["output", "term gradient"])
def test_a_planted_wrong_kernel_fails_the_check(plant, tmp_path, monkeypatch, capsys):
    """A kernel 0.1% off in its output, or whose term gradient is off by a constant: exit 1, naming the case."""
    import torch

    real = gpu_check.load_kernel()

    def planted(q, k, v, **kwargs):
        out = real.relpos_attention(q, k, v, **kwargs)
        if plant == "output":
            return out * 1.001
        values = kwargs["values"]
        return out + 1e-2 * (values.sum() - values.sum().detach())  # the value unchanged, the gradient off

    monkeypatch.setattr(gpu_check, "load_kernel", lambda: types.SimpleNamespace(relpos_attention=planted,
                                                                               triton=real.triton))
    monkeypatch.setattr(gpu_check, "TERMS", ("log",))
    monkeypatch.setattr(gpu_check, "MASKS", ("padding",))
    out = tmp_path / "check.json"
    assert gpu_check.main(["--dry", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"gpu_check: float32 log padding: wrong {'out' if plant == 'output' else 'dterm'} relative error" in err
    assert json.loads(out.read_text())["cases"][0]["status"] == "wrong"


def test_the_kernel_file_loads_with_torch_and_triton_alone():
    """No Transformers, no hf_relpos package: the device needs torch and Triton only."""
    code = ("import sys; sys.modules['transformers'] = None; sys.modules['hf_relpos'] = None; import runpy; "
            f"kernel = runpy.run_path({str(SCRIPT)!r})['load_kernel'](); print(sorted(kernel.TERMS, key=str))")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "'table'" in done.stdout
