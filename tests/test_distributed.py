"""Distributed data-parallel training on CPU: torchrun, gloo, 2 processes, the CLI's ``tiny`` preset.

One ``torchrun --nproc_per_node 2`` launch runs every scenario of ``tests/ddp_worker.py`` (start-up dominates
the cost); the single-process reference runs in this process. Each scenario writes one JSON per rank.

- ``Trainer``: both ranks finish; rank 0 alone writes the model folder and the checkpoint; the loss after each
  of 4 steps matches one process with the same global batch (2 ranks x 2 rows vs 1 x 4 rows, sequential order:
  accelerate hands rank r the rows [2r, 2r+1] of each global batch of 4 -- checked, not assumed).
  Measured (torch 2.13 CPU, transformers 5.23, fp32, lr 3e-3, Adam): logged losses differ by <= 4.3e-6
  (tolerance 1e-4); saved weights by <= 3.6e-5 relative L2 per tensor (tolerance 1e-3; Adam's normalised
  step turns the ~1e-7 gradient differences of the all-reduce into up to ~7e-5 absolute).
- ``MemoryTrainer`` (Transformer-XL memory) under DDP requires ``accelerator_config={"split_batches": True}`` and
  an OrderedSegments whose rows are the loader's batch (divisible by the world size); it refuses anything else
  with ValueError. With it, rank r reads rows [2r, 2r+1] of every segment, consecutively (training and
  evaluation), and carries its own memory: rows [2r, 2r+1] of the memory of one process reading all 4 rows.
  Measured: per-rank memory vs the single-process rows <= 2.9e-6 relative L2 (9.2e-6 absolute; tolerance 1e-4;
  the other rank's rows differ by ~0.1-1). Each rank checkpoints its own ``mems-rank<r>.safetensors`` and
  loads it on resume: the resumed run reproduces the straight run exactly (measured 0.0 on parameters and
  memory; tolerance 1e-6).
- Exit: every rank destroys the process group, and so joins gloo's threads, before its interpreter finalizes
  (``tests/exit_probe/sitecustomize.py`` records the threads alive at exit). A gloo worker still running then can
  take the GIL to release a finished collective's tensors during finalization, which aborts the rank (SIGABRT
  after training, "terminate called without an active exception"): rank 1 of ``hf-relpos train`` exits ~2 ms
  after its last collective, Trainer's final all_gather.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "ddp_worker.py"
EXIT_PROBE = HERE / "exit_probe"  # a sitecustomize: each rank records the threads alive when its interpreter exits
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")
SCENARIOS = ("plain", "memory", "memory-split")
SINGLE_SCENARIOS = ("plain-single", "memory-single")
LOSS_ATOL = 1e-4  # measured max |DDP - single| over 4 steps: 4.3e-6
WEIGHT_RTOL = 1e-3  # measured max per-tensor relative L2 difference of the saved weights: 3.6e-5
MEMS_RTOL = 1e-4  # measured max relative L2 of a rank's memory vs its rows of the single-process memory: 2.9e-6
RESUME_ATOL = 1e-6  # measured max |resumed - straight| (parameters and memory), every rank: 0.0
LAUNCH_TIMEOUT = 300

# One pytest-xdist worker runs this whole module (make test: --dist loadgroup): its shared fixtures are built once.
pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="torch.distributed with gloo is not available",
    ),
    pytest.mark.xdist_group("test_distributed"),
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readable(log: str, lines: int = 60) -> str:
    """The launch's output for a failure message: progress bars dropped, each rank's abort or traceback kept.

    torchrun's own summary ("exitcode: -6 ... Signal 6 (SIGABRT)") names the rank; what the rank printed
    ("terminate called without an active exception", "Fatal Python error") comes earlier, so it is kept wherever
    it is.
    """
    kept = [re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line.rsplit("\r", 1)[-1]) for line in log.splitlines()]
    kept = [line for line in kept if line.strip() and "it/s]" not in line and "s/it]" not in line]
    markers = ("terminate called", "Fatal Python error", "Aborted", "Signal ", "exitcode", "Error")
    flagged = [line for line in kept[:-lines] if any(m in line for m in markers)]
    return "\n".join(flagged + (["..."] if flagged else []) + kept[-lines:])


def torchrun_env(probe_dir: Path, **extra) -> dict:
    """The environment of a torchrun launch: one thread each, no inherited rank, the exit probe on the path."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_RELPOS_EXIT_PROBE": str(probe_dir),
        **extra,
    }
    path = extra.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join([str(EXIT_PROBE), path] if path else [str(EXIT_PROBE)])
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    return env


def gloo_threads_at_exit(probe_dir: Path, world: int) -> dict:
    """{rank: the gloo threads still alive when that rank's interpreter began to finalize} (ranks with any)."""
    alive = {}
    for rank in range(world):
        path = probe_dir / f"threads-rank{rank}.json"
        assert path.is_file(), f"rank {rank} did not reach interpreter exit normally (no {path.name})"
        names = json.loads(path.read_text())
        if names is None:  # no /proc on this platform
            continue
        gloo = [name for name in names if name in GLOO_THREADS]
        if gloo:
            alive[rank] = gloo
    return alive


def read_results(folder: Path, world: int) -> list:
    results = []
    for rank in range(world):
        path = folder / f"result-rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.is_file() else None)
    return results


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """Runs every scenario under ``torchrun --nproc_per_node 2`` once; returns (out_dir, returncode, log)."""
    out = tmp_path_factory.mktemp("ddp")
    port = free_port()
    env = torchrun_env(out, MKL_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return (out, *torchrun(port, [str(WORKER), str(out), *SCENARIOS], env, LAUNCH_TIMEOUT))


def torchrun(port: int, arguments: list, env: dict, timeout: float) -> tuple[int, str]:
    """``(exit status, output)`` of two local ranks of ``torch.distributed.run`` on 127.0.0.1:``port``; the test
    fails (torchrun and both workers killed) past ``timeout`` seconds."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(port), *arguments,
    ]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both workers: the session this launch started
        log, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout} s:\n{readable(log)}")
    return proc.returncode, log


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process references (same global batch), run in this process: {scenario: (folder, result)}."""
    out = tmp_path_factory.mktemp("single")
    sys.path.insert(0, str(HERE))
    try:
        import ddp_worker
    finally:
        sys.path.remove(str(HERE))
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    try:
        ddp_worker.main([str(out), *SINGLE_SCENARIOS])
    finally:
        os.environ.update(saved)
    references = {}
    for name in SINGLE_SCENARIOS:
        (result,) = read_results(out / name, 1)
        assert result is not None and "error" not in result, result
        references[name] = (out / name, result)
    return references


def scenario(ddp, name):
    out, returncode, log = ddp
    results = read_results(out / name, 2)
    missing = [rank for rank, r in enumerate(results) if r is None]
    assert not missing, f"ranks {missing} wrote no result for {name!r} (torchrun exit {returncode}):\n{log[-4000:]}"
    errors = {r["rank"]: r["error"] + "\n" + r["traceback"] for r in results if "error" in r}
    assert not errors, f"{name!r} raised on ranks {sorted(errors)}:\n" + "\n".join(errors.values())
    return out / name, results


# -------------------------------------------------------------------------------------------------------------
# Trainer
# -------------------------------------------------------------------------------------------------------------


def test_both_ranks_finish(ddp):
    out, returncode, log = ddp
    assert returncode == 0, f"torchrun exit code {returncode}:\n{readable(log)}"
    for name in SCENARIOS:
        results = read_results(out / name, 2)
        assert [r and (r["rank"], r["world"]) for r in results] == [(0, 2), (1, 2)], (name, readable(log))
    # The process group is destroyed, and gloo's threads joined, before the interpreter exits (see
    # test_hf_relpos_train_under_torchrun).
    assert not gloo_threads_at_exit(out, 2), gloo_threads_at_exit(out, 2)


def test_only_rank_zero_writes_one_model_and_one_checkpoint(ddp):
    folder, results = scenario(ddp, "plain")
    assert [r["is_world_process_zero"] for r in results] == [True, False]
    weights = sorted(str(p.parent.relative_to(folder)) for p in folder.rglob("model.safetensors"))
    assert weights == ["model", "trainer/checkpoint-4"], weights
    checkpoints = sorted(p.name for p in (folder / "trainer").iterdir() if p.is_dir())
    assert checkpoints == ["checkpoint-4"], checkpoints
    configs = sorted(str(p.parent.relative_to(folder)) for p in folder.rglob("config.json"))
    assert configs == ["model", "trainer/checkpoint-4"], configs
    # The written model is the trained one, and it loads.
    from transformers import AutoModelForCausalLM

    import hf_relpos  # noqa: F401  (registers the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(folder / "model")
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    assert params.norm().item() == pytest.approx(results[0]["param_norm"], rel=1e-6)


def test_ddp_sees_the_single_process_batches(ddp, single):
    _, results = scenario(ddp, "plain")
    _, reference = single["plain-single"]
    per_step = [sorted(a + b) for a, b in zip(results[0]["rows_seen"], results[1]["rows_seen"])]
    assert per_step == [sorted(rows) for rows in reference["rows_seen"]], (results[0]["rows_seen"],
                                                                          results[1]["rows_seen"],
                                                                          reference["rows_seen"])
    assert not set(sum(results[0]["rows_seen"], [])) & set(sum(results[1]["rows_seen"], []))


def test_ddp_loss_matches_single_process(ddp, single):
    folder, results = scenario(ddp, "plain")
    single_folder, reference = single["plain-single"]
    ddp_losses, single_losses = results[0]["losses"], reference["losses"]
    assert results[1]["losses"] == ddp_losses  # the logged loss is the mean over ranks, the same on both
    assert len(ddp_losses) == len(single_losses) == 4 and all(math.isfinite(x) for x in ddp_losses)
    worst = max(abs(a - b) for a, b in zip(ddp_losses, single_losses))
    assert worst <= LOSS_ATOL, f"DDP {ddp_losses} vs single {single_losses}: max difference {worst:.3g}"

    from safetensors.torch import load_file

    ddp_weights = load_file(folder / "model" / "model.safetensors")
    single_weights = load_file(single_folder / "model" / "model.safetensors")
    assert ddp_weights.keys() == single_weights.keys()
    relative = {k: ((ddp_weights[k] - single_weights[k]).norm() / single_weights[k].norm().clamp_min(1e-12)).item()
                for k in ddp_weights}
    name = max(relative, key=relative.get)
    assert relative[name] <= WEIGHT_RTOL, f"weights differ most in {name}: relative L2 {relative[name]:.3g}"


# -------------------------------------------------------------------------------------------------------------
# MemoryTrainer (Transformer-XL memory)
# -------------------------------------------------------------------------------------------------------------


def test_memory_trainer_refuses_ddp_without_split_batches(ddp):
    """MemoryTrainer's constructor under 2 processes: ValueError for every configuration that would misalign memory."""
    _, results = scenario(ddp, "memory")
    for r in results:
        refused = r["no_split_batches"]
        assert refused and refused.startswith("ValueError:") and "split_batches" in refused, refused
        for key, field, loader in (("split_per_device_rows", "train_dataset", "per_device_train_batch_size"),
                                   ("split_indivisible", "train_dataset", "per_device_train_batch_size"),
                                   ("split_bad_eval", "eval_dataset", "per_device_eval_batch_size")):
            message = r[key]
            assert message and message.startswith("ValueError:"), (key, message)
            assert f"{field}.batch_size" in message and loader in message, (key, message)
        assert r["split_valid"] is None, r["split_valid"]


def consecutive_segments(steps):
    """The problems with 'row r of step t+1 continues row r of step t' on one rank, as readable strings."""
    problems = []
    for t in range(1, len(steps)):
        before, now = steps[t - 1]["rows"], steps[t]["rows"]
        for (*seg0, row0), (*seg1, row1) in zip(before, now):
            if row1 != row0 or seg1[:-1] != seg0[:-1] or seg1[-1] != seg0[-1] + 1:
                problems.append(f"step {t}: read (segment {seg1}, row {row1}) after (segment {seg0}, row {row0})")
    return problems


def test_memory_trainer_with_split_batches_reads_consecutive_segments_of_own_rows(ddp):
    """split_batches: rank r reads rows [2r, 2r+1] of segment t at step t, in training and in evaluation."""
    _, results = scenario(ddp, "memory-split")
    for r in results:
        rank = r["rank"]
        own = [2 * rank, 2 * rank + 1]
        assert r["finite"] and r["losses"] and all(math.isfinite(x) for x in r["losses"]), r["losses"]
        assert [s["rows"] for s in r["steps"]] == [[[t, row] for row in own] for t in range(4)], r["steps"]
        assert [s["rows"] for s in r["eval_steps"]] == [[["eval", t, row] for row in own] for t in range(3)], (
            r["eval_steps"])
        for kind in ("steps", "eval_steps"):
            steps = r[kind]
            assert not consecutive_segments(steps), consecutive_segments(steps)
            assert not steps[0]["got_mems"], f"{kind}: memory not reset at the start"
            assert all(s["got_previous_mems"] for s in steps[1:]), f"{kind}: a forward missed the previous memory"
        assert r["mems_shapes"] == [[2, 8, 128], [2, 8, 128]], r["mems_shapes"]  # [rows per rank, mem_len, hidden]
        assert r["eval_mems_shapes"] == [[2, 8, 128], [2, 8, 128]], r["eval_mems_shapes"]
    assert results[0]["losses"] == results[1]["losses"]  # the logged loss is the mean over ranks


def test_memory_trainer_each_rank_carries_its_own_rows_memory(ddp, single):
    """Rank r's memory (training and evaluation) is rows [2r, 2r+1] of the single-process memory over all 4 rows."""
    from safetensors.torch import load_file

    folder, results = scenario(ddp, "memory-split")
    single_folder, reference = single["memory-single"]
    worst = max(abs(a - b) for a, b in zip(results[0]["losses"], reference["losses"]))
    assert worst <= LOSS_ATOL, (results[0]["losses"], reference["losses"])
    full = load_file(single_folder / "final-mems-rank0.safetensors")
    assert sorted(full) == ["eval_0", "eval_1", "train_0", "train_1"], sorted(full)
    for rank in (0, 1):
        mine = load_file(folder / f"final-mems-rank{rank}.safetensors")
        assert mine.keys() == full.keys()
        for key, value in mine.items():
            own, other = full[key][2 * rank : 2 * rank + 2], full[key][2 * (1 - rank) : 2 * (1 - rank) + 2]
            relative = ((value - own).norm() / own.norm()).item()
            assert relative <= MEMS_RTOL, f"rank {rank} {key}: relative L2 {relative:.3g} from its rows' memory"
            assert ((value - other).norm() / other.norm()).item() > 100 * MEMS_RTOL, f"rank {rank} {key}: not distinct"


def test_memory_trainer_checkpoint_holds_one_mems_file_per_rank(ddp):
    from hf_relpos.memory import mems_file

    _, results = scenario(ddp, "memory-split")
    assert [mems_file(r) for r in (0, 1)] == ["mems-rank0.safetensors", "mems-rank1.safetensors"]
    for r in results:
        memory_files = [f for f in r["checkpoint_files"] if f.startswith("mems")]
        assert memory_files == ["mems-rank0.safetensors", "mems-rank1.safetensors"], r["checkpoint_files"]
        assert r["checkpoint_mems_ranks"] == [0, 1]
        assert r["checkpoint_mems_is_this_ranks"], f"rank {r['rank']}'s checkpoint file is not its memory"
        assert r["checkpoint_mems_differ_between_ranks"], "both ranks saved the same memory"


def test_memory_trainer_resume_restores_every_ranks_memory(ddp):
    """Interrupt at a checkpoint and resume under DDP: the same parameters and memory as a straight run.

    The control run resumes from the same checkpoint but injects each rank's memory as the worker kept it:
    if it matches the straight run and the real resume does not, the difference is the memory MemoryTrainer
    restored.
    """
    _, results = scenario(ddp, "memory-split")
    for r in results:
        own = [2 * r["rank"], 2 * r["rank"] + 1]
        expected = [[[t, row] for row in own] for t in (2, 3)]  # the resumed run continues at segment 2
        assert [s["rows"] for s in r["resumed_steps"]] == expected, r["resumed_steps"]
        assert r["resumed_steps"][0]["got_mems"], "the resumed run's first step got no memory"
        assert r["resumed_losses"][2:] and r["resumed_losses"] == pytest.approx(r["losses"], abs=RESUME_ATOL), (
            r["losses"], r["resumed_losses"])
    diffs = {r["rank"]: (r["resumed_param_diff"], r["resumed_mems_diff"]) for r in results}
    controls = {r["rank"]: (r["control_param_diff"], r["control_mems_diff"]) for r in results}
    exact = all(p <= RESUME_ATOL and m <= RESUME_ATOL for p, m in diffs.values())
    assert exact, (
        f"resumed DDP run differs from the straight run (max |param diff|, max |mems diff| per rank): {diffs}; "
        f"control run with each rank's own memory injected: {controls}"
    )


@pytest.mark.parametrize("scheme", ["t5_bias", "transformer_xl"])
def test_hf_relpos_train_under_torchrun(tmp_path, scheme):
    """The CLI itself under torchrun (2 processes, gloo): both ranks train, rank 0 alone writes the folder."""
    port = free_port()
    env = torchrun_env(tmp_path)
    out = tmp_path / "model"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(port), "-m", "hf_relpos.cli", "train", "--position-encoding", scheme, "--steps", "4",
        "--seq-len", "32", "--batch-size", "4", "--vocab-size", "300", "--eval-tokens", "300", "--output-dir", str(out),
    ]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"torchrun exit code {proc.returncode}:\n{readable(log)}"
    # The cause of an occasional SIGABRT of rank 1 after training: a rank whose interpreter finalizes with
    # gloo's worker threads alive, right after its last collective (Trainer's final all_gather), while such a
    # thread still has to take the GIL to release that collective's tensors. Each rank must destroy the process
    # group (joining gloo's threads) before it exits.
    assert not gloo_threads_at_exit(tmp_path, 2), (
        f"gloo threads alive at interpreter exit: {gloo_threads_at_exit(tmp_path, 2)}")
    assert log.count("Saved to") == 1, "exactly one rank must write the model folder"
    run = json.loads((out / "hf_relpos_run.json").read_text())
    assert run["processes"] == 2, "the ranks trained alone instead of as one DDP job"
    assert run["steps"] == 4 and math.isfinite(run["test_ppl"])
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))


def test_hf_relpos_train_under_accelerate_launch_on_cpu(tmp_path):
    """The documented CPU recipe: ``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2`` starts two
    ranks that train as one DDP job (``--cpu`` alone would start one process)."""
    pytest.importorskip("accelerate")
    port = free_port()
    env = torchrun_env(tmp_path, ACCELERATE_USE_CPU="1")
    out = tmp_path / "model"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
        "-m", "hf_relpos.cli", "train", "--position-encoding", "alibi", "--steps", "4", "--seq-len", "32",
        "--batch-size", "4", "--vocab-size", "300", "--eval-tokens", "300", "--output-dir", str(out), "--quiet",
    ]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"accelerate launch exit code {proc.returncode}:\n{readable(log)}"
    assert not gloo_threads_at_exit(tmp_path, 2), gloo_threads_at_exit(tmp_path, 2)
    run = json.loads((out / "hf_relpos_run.json").read_text())
    assert run["processes"] == 2, "accelerate started one process, not a 2-rank job"
    assert log.count("Saved to") == 1, "exactly one rank must write the model folder"
    assert run["steps"] == 4 and math.isfinite(run["test_ppl"])
