"""``scripts/bench_gpu.py --dry``: the GPU benchmark's plumbing on CPU under Triton's interpreter, at tiny sizes —
every core case measured, each relpos_triton term within reach of the float32 reference, term gradients bitwise
equal over two backward runs, the report written. The GPU numbers come from a run on a GPU, not from here."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_gpu.py"
KINDS = ("table", "linear", "log", "query_key")


def test_dry_run_measures_every_case(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    # one length: the plumbing of every case is the same at each (the dry default times 32 and 48)
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--out", str(tmp_path), "--sizes", "32"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "bench-gpu.json").read_text())
    assert report["config"]["dry"] and report["config"]["sizes"] == [32]

    accuracy = {row["term"]: row for row in report["accuracy"]}
    assert set(accuracy) == set(KINDS) and len(report["accuracy"]) == len(KINDS)
    for kind, row in accuracy.items():
        assert row["status"] == "ok", (kind, row)
        assert (row["n"], row["rows"], row["padded_keys"]) == (32, 32, 4), row
        for name in ("out", "dq", "dk", "dv", "dterm"):
            error = row["errors"][name]["max_abs"]
            # float32 under the interpreter: products exact, only the summation order differs
            assert math.isfinite(error) and error < 1e-3, (kind, name, error)
        assert row["deterministic_term_grad"] is True, kind

    measured = {(row["method"], row["term"], row["n"]): row for row in report["cases"]}
    expected = [("sdpa", None), ("sdpa_materialised", "table")] + [("relpos_triton", kind) for kind in KINDS]
    for n in (32,):
        for method, kind in expected:
            row = measured[(method, kind, n)]
            assert row["status"] == "ok", row
            assert math.isfinite(row["fwd_bwd_ms"]) and row["fwd_bwd_ms"] > 0, row
        assert measured[("flex", "table", n)]["status"] == "skipped (dry)"
    assert all(r["t5_over_floor"] is not None for r in report["ratios"])
    assert "relpos_triton" in (tmp_path / "bench-gpu.md").read_text()


# The tests below run the dry bench in this process: the kernels must have been defined under the interpreter
# (conftest.py sets it where there is no GPU; on a GPU machine test_dry_run_measures_every_case's child covers --dry).
in_process = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="runs the kernels on CPU tensors in this process")


def _load_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@in_process
@pytest.mark.parametrize("plant", ["off by 1%", "nan", "nondeterministic"])
def test_a_planted_wrong_kernel_fails_the_run(plant, tmp_path, monkeypatch, capsys):
    """The accuracy check against the float32 reference decides the exit status: a kernel whose output is 1% off,
    gives a NaN, or whose term gradient changes between two identical backward runs makes the run exit 1, naming
    it (it exited 0 unless an error was non-finite). The timed cases are skipped here: they time, not check."""
    import torch

    import hf_relpos.triton_attention_relpos as TA

    bench = _load_bench()
    real, calls = TA.relpos_attention, []

    def planted(q, k, v, **kwargs):
        out = real(q, k, v, **kwargs)
        calls.append(1)
        if plant == "off by 1%":
            return out * 1.01
        if plant == "nan":
            return out + torch.where(torch.arange(out.shape[-1]) == 3, float("nan"), 0.0)
        values = kwargs["values"]  # a term gradient that depends on the call: the second backward differs
        return out + 1e-3 * len(calls) * (values.sum() - values.sum().detach())

    monkeypatch.setattr(TA, "relpos_attention", planted)
    monkeypatch.setattr(bench, "KINDS", ("table",))  # one term is enough to see the check decide
    monkeypatch.setattr(bench.Bench, "run_case", lambda self, method, build, kind, n, reserve_s=3.0: dict(
        method=method, term=kind, n=n, status="skipped (test)"))
    assert bench.main(["--dry", "--out", str(tmp_path), "--sizes", "32"]) == 1
    err = capsys.readouterr().err
    assert "bench_gpu: wrong numbers: T5" in err and len(calls) == 2, err
    expected = {"off by 1%": "out: relative error", "nan": "relative error nan",
                "nondeterministic": "differs between two identical backward runs"}[plant]
    assert expected in err, err  # (the kernel itself passes: test_dry_run_measures_every_case exits 0)


@in_process
@pytest.mark.parametrize("plant", [None, "ignores padding", "last query off"])
def test_the_accuracy_check_covers_padding_and_rows_past_its_sample(plant, monkeypatch):
    """At a size past the checked rows (16 of 48 here; 256 of up to 16,384 on a GPU) the reference holds those rows'
    scores alone, and the check still passes a right kernel and fails one that ignores the padding or is wrong on
    the last query only."""
    import torch

    import hf_relpos.triton_attention_relpos as TA

    bench = _load_bench()
    monkeypatch.setattr(bench, "CHECKED_ROWS", 16)
    real = TA.relpos_attention

    def planted(q, k, v, **kwargs):
        if plant == "ignores padding":
            kwargs["key_valid"] = None
        out = real(q, k, v, **kwargs)
        if plant == "last query off":
            out = out + torch.where(torch.arange(out.shape[2]) == out.shape[2] - 1, 0.05, 0.0)[:, None]
        return out

    monkeypatch.setattr(TA, "relpos_attention", planted)
    run = bench.Bench(bench.parse(["--dry", "--out", "unused", "--sizes", "48"]), torch)
    assert run.checked_rows(48).tolist() == list(range(8)) + list(range(40, 48))
    rows = [run.run_accuracy(kind, 48) for kind in ("table", "query_key")]
    assert all(row["status"] == "ok" and row["rows"] == 16 for row in rows), rows
    wrong = [line for row in rows for line in bench.wrong_numbers(row)]
    if plant is None:
        assert wrong == [], wrong
    else:
        assert any("out: relative error" in line for line in wrong), (plant, wrong)


@in_process
def test_a_case_too_big_for_the_card_is_skipped_and_a_slow_one_capped(monkeypatch):
    """The n² methods are sized against the card's free memory before they run (skipped with the estimate, not run
    out of memory after minutes); the others run. After its first call a case's steps stop at --case-cap-s: no
    time left gives one timed step, time enough all of --repeats."""
    import torch

    bench = _load_bench()
    for cap, steps in (("0", 1), ("1000", 3)):
        run = bench.Bench(bench.parse(["--dry", "--out", "unused", "--case-cap-s", cap, "--repeats", "3",
                                       "--warmup", "3"]), torch)
        row = run.run_case("relpos_triton", run.relpos, "table", 32)
        assert row["status"] == "ok" and row["repeats"] == steps, (cap, row)

    run.cuda = True  # as on a card with 1 GiB free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2**30, 80 * 2**30))
    monkeypatch.setattr(run, "release", lambda: None)
    measured = []
    monkeypatch.setattr(run, "measure", lambda build, kind, n: measured.append(n) or dict(status="ok"))
    n = 4096  # (4 + 10) bytes x 2 heads x n^2 = 0.44 GiB: under 0.85 of 1 GiB at 4,096, over it at 8,192 (batch 1)
    assert run.quadratic_bytes("sdpa_materialised", n) == 14 * 2 * n * n
    assert run.run_case("sdpa_materialised", None, "table", n)["status"] == "ok" and measured == [n]
    skipped = run.run_case("sdpa_materialised", None, "table", 2 * n)
    assert skipped["status"] == "skipped (memory)" and "GiB" in skipped["error"] and measured == [n], skipped
    assert run.run_case("relpos_triton", None, "table", 2 * n)["status"] == "ok"  # linear in n: not sized
    assert measured == [n, 2 * n]
