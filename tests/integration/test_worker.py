"""The worker end to end: `python -m training` alone and under torchrun (CPU/gloo, 2 ranks), with real
checkpoints, restarts, drill faults and the watchdog. Models are tiny and runs short: 2 shared cores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.common import REPO
from tests.fixtures.jobs import events, write_job
from training.watchdog import WATCHDOG_EXIT_CODE

DIGITS = ("training.examples.digits:task", {"hidden": 32})
TINYGPT = ("training.examples.tinygpt:task", {"dim": 32, "layers": 2, "heads": 2, "seq_len": 16, "max_bytes": 40000})


def write_spec(
    path: Path,
    *,
    task: tuple[str, dict[str, Any]] = DIGITS,
    steps: int = 10,
    checkpoint_every: int = 1000,
    async_save: bool = False,
    step_timeout_s: float = 120.0,
    **training: Any,
) -> Path:
    """A job file with `training` overrides (snake_case keys map to the camelCase aliases)."""
    train: dict[str, Any] = {
        "steps": steps,
        "batchSize": 8,
        "gradClip": 1.0,
        "seed": 0,
        "optimizer": {"name": "adamw", "lr": 0.01},
    }
    for key, value in training.items():
        head, *rest = key.split("_")
        train[head + "".join(w.title() for w in rest)] = value
    doc = {
        "apiVersion": "torchrig/v1",
        "kind": "TrainingJob",
        "metadata": {"name": path.stem},
        "spec": {
            "task": {"entrypoint": task[0], "args": task[1]},
            "training": train,
            "restarts": {"max": 1, "stepTimeoutSeconds": step_timeout_s},
            "checkpoint": {"every": {"steps": checkpoint_every}, "async": async_save, "keep": 2},
            "metrics": {"enabled": False, "logEvery": 5},
        },
    }
    return write_job(path.parent, doc, name=path.name)


def _env(faults: list[dict[str, Any]] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("TORCHRIG_FAULTS", None)
    if faults:
        env["TORCHRIG_FAULTS"] = json.dumps(faults)
    return env


_LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run in its own session and kill the whole group on timeout (torchrun's workers too)."""
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:6])} timed out after {timeout_s}s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def run_single(
    spec: Path, run_dir: Path, *, faults: list[dict[str, Any]] | None = None, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python -m training` with no launcher at all."""
    cmd = [sys.executable, "-m", "training", "--spec", str(spec), "--run-dir", str(run_dir)]
    return _run(cmd, _env(faults), spec.parent, timeout_s)


def run_torchrun(
    spec: Path,
    run_dir: Path,
    *,
    nproc: int = 2,
    max_restarts: int = 0,
    faults: list[dict[str, Any]] | None = None,
    timeout_s: float = 150,
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.5",
        "--log-dir", str(run_dir.parent / f"{run_dir.name}-torchrun"),
        "-m", "training", "--spec", str(spec), "--run-dir", str(run_dir),
    ]  # fmt: skip
    return _run(cmd, _env(faults), spec.parent, timeout_s)


def result(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "result.json").read_text())  # type: ignore[no-any-return]


def final_checkpoint(run_dir: Path, tmp: Path) -> dict[str, Any]:
    """The newest checkpoint of the default store, read with DCP's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step_dir = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    dcp_dir = sorted(step_dir.glob("gen-*"))[-1]
    out = tmp / f"{run_dir.name}-final.pt"
    dcp_to_torch_save(dcp_dir, out)
    return torch.load(out, weights_only=True)  # type: ignore[no-any-return]


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:]


# --- single process -------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_single_process_trains_writes_result_and_resumes_when_done(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "single.yaml", steps=20, checkpoint_every=10)
    run_dir = tmp_path / "run"
    _ok(run_single(spec, run_dir))
    first = result(run_dir)
    assert first["steps"] == 20 and first["world_size"] == 1
    assert len(first["params_sha256"]) == 64
    assert 0.3 < first["eval"]["accuracy"] <= 1.0 and first["eval"]["count"] == 360
    assert first["final_loss"] < 2.3  # below chance (ln 10)
    kinds = [e["event"] for e in events(run_dir)]
    assert kinds[0] == "start" and kinds[-1] == "finished" and "checkpoint_committed" in kinds
    assert events(run_dir)[0]["pid"] > 0
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 4  # logEvery 5

    # Again in the same run directory: restores the final checkpoint, trains nothing, same weights.
    _ok(run_single(spec, run_dir))
    again = result(run_dir)
    assert again["params_sha256"] == first["params_sha256"] and again["steps"] == 20
    assert again["final_loss"] == pytest.approx(first["final_loss"])
    assert any(e["event"] == "restore" and e["step"] == 20 for e in events(run_dir))


def test_bad_spec_exits_2_with_one_line(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "bad.yaml", steps=0)
    proc = run_single(spec, tmp_path / "run", timeout_s=60)
    assert proc.returncode == 2
    lines = proc.stdout.strip().splitlines()
    assert lines == [f"torchrig: error: {spec}: spec.training.steps: Input should be greater than 0"]


def test_bad_entrypoint_exits_2_naming_the_field(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "bad.yaml", task=("training.examples.digits:task", {"hiddn": 3}))
    proc = run_single(spec, tmp_path / "run", timeout_s=60)
    assert proc.returncode == 2, proc.stdout
    assert "Traceback" not in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith(f"torchrig: error: {spec}: task.args:")


@pytest.mark.timeout(120)
def test_fp16_with_grad_scaler_and_accumulation_trains(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "fp16.yaml", steps=12, precision="fp16", grad_accumulation=2, eval_at_end=True)
    _ok(run_single(spec, tmp_path / "run"))
    got = result(tmp_path / "run")
    assert got["final_loss"] < 2.3 and got["eval"]["accuracy"] > 0.3


# --- two ranks under torchrun ---------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_digits_example_reaches_95_percent(tmp_path: Path, examples_dir: Path) -> None:
    """The shipped example, unchanged except for the exporter (off: no fixed ports in tests)."""
    spec = write_job(
        tmp_path, examples_dir / "digits-ddp.yaml", overrides=["spec.metrics.enabled=false"], name="digits-ddp.yaml"
    )
    run_dir = tmp_path / "run"
    _ok(run_torchrun(spec, run_dir))
    got = result(run_dir)
    assert got["steps"] == 300 and got["world_size"] == 2
    assert got["eval"]["accuracy"] >= 0.95, got
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["comm_s"] > 0 and m["world_size"] == 2 for m in metrics)  # the DDP comm hook measured something
    starts = {e["rank"] for e in events(run_dir) if e["event"] == "start"}
    assert starts == {0, 1}


@pytest.mark.timeout(300)
def test_killed_run_resumes_bit_exact(tmp_path: Path) -> None:
    """Kill rank 1 (SIGKILL) at step 8; torchrun restarts the group, which resumes from step 5 and ends
    with the same parameters, bit for bit, as a run that was never interrupted."""
    spec = write_spec(
        tmp_path / "exact.yaml",
        steps=12,
        checkpoint_every=5,
        grad_accumulation=2,
        lr_schedule={"warmupSteps": 3, "decay": "cosine"},
    )
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _ok(run_torchrun(spec, straight))
    _ok(run_torchrun(spec, killed, max_restarts=1, faults=[{"kind": "kill", "rank": 1, "step": 8}]))
    assert result(killed)["params_sha256"] == result(straight)["params_sha256"]
    assert result(killed)["final_loss"] == result(straight)["final_loss"]
    evs = events(killed)
    assert any(e["event"] == "fault" and e["rank"] == 1 and e["step"] == 8 for e in evs)
    restores = [e for e in evs if e["event"] == "restore"]
    assert {(e["rank"], e["generation"], e["step"]) for e in restores} == {(0, 1, 5), (1, 1, 5)}
    # Resubmitted when finished: restores step 12, trains nothing, reports the same mean loss of 2 ranks
    # (the final checkpoint keeps the mean, not one rank's loss).
    first = result(straight)
    _ok(run_torchrun(spec, straight))
    again = result(straight)
    assert (again["steps"], again["params_sha256"]) == (12, first["params_sha256"])
    assert again["final_loss"] == first["final_loss"]


@pytest.mark.timeout(300)
def test_world_size_change_2_1_2_resumes_without_repeating_samples(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    spec = tmp_path / "elastic.yaml"
    plan = [(2, 6), (1, 10), (2, 14)]  # (world size, run until step)
    for world, until in plan:
        write_spec(spec, steps=until, lr_schedule={"scaleWithWorldSize": "linear", "baseWorldSize": 2})
        _ok(run_torchrun(spec, run_dir, nproc=world) if world > 1 else run_single(spec, run_dir))
        assert result(run_dir)["steps"] == until and result(run_dir)["world_size"] == world
    restores = sorted({(e["generation"], e["step"], e["rank"]) for e in events(run_dir) if e["event"] == "restore"})
    assert [step for _, step, _ in restores] == [6, 10, 10]
    trainer = final_checkpoint(run_dir, tmp_path)["trainer"]
    # the global cursor counts every sample exactly once: 6 steps x 16 + 4 x 8 + 4 x 16
    assert trainer["cursor"] == 6 * 16 + 4 * 8 + 4 * 16
    assert trainer["step"] == 14 and trainer["world_size"] == 2


@pytest.mark.timeout(200)
def test_watchdog_ends_a_hung_group(tmp_path: Path) -> None:
    """Rank 1 hangs after step 3; the watchdog exits it (and the group goes down) instead of blocking forever."""
    spec = write_spec(tmp_path / "hang.yaml", steps=50, step_timeout_s=10.0)
    run_dir = tmp_path / "run"
    proc = run_torchrun(spec, run_dir, faults=[{"kind": "hang", "rank": 1, "step": 3}], timeout_s=120)
    assert proc.returncode != 0
    evs = events(run_dir)
    assert any(e["event"] == "fault" and e["kind"] == "hang" for e in evs)
    dogs = [e for e in evs if e["event"] == "watchdog"]
    assert dogs and all(e["step"] == 3 and e["silent_s"] > 10.0 for e in dogs), evs
    assert f"exitcode  : {WATCHDOG_EXIT_CODE}" in proc.stdout
    assert not (run_dir / "result.json").exists()


@pytest.mark.timeout(240)
def test_fsdp_bf16_activation_checkpointing_tinygpt(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "gpt.yaml",
        task=TINYGPT,
        steps=6,
        checkpoint_every=3,
        strategy="fsdp",
        precision="bf16",
        activation_checkpointing=True,
        grad_accumulation=2,
        batch_size=4,
        eval_batch_size=16,
    )
    run_dir = tmp_path / "run"
    _ok(run_torchrun(spec, run_dir))
    got = result(run_dir)
    assert got["steps"] == 6 and got["eval"]["loss"] < 5.6  # below uniform over 256 bytes (ln 256 = 5.55) + noise
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics and metrics[-1]["comm_s"] > 0  # FSDP's all-gathers / reduce-scatters were timed
    assert metrics[-1]["tokens_per_s"] > 0


@pytest.mark.timeout(120)
def test_run_worker_reuses_an_existing_process_group(tmp_path: Path) -> None:
    """The Ray Train path: the group exists before `run_worker`, which must neither re-create nor destroy it."""
    import torch.distributed as dist

    from training.config import load_worker_spec
    from training.contract import WorkerIdentity
    from training.worker import run_worker

    spec = load_worker_spec(write_spec(tmp_path / "ray.yaml", steps=3))
    deterministic = torch.are_deterministic_algorithms_enabled()  # the worker sets it process-wide
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        out = run_worker(spec, run_dir=str(tmp_path / "run"), identity=WorkerIdentity(generation=2))
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
        torch.use_deterministic_algorithms(deterministic)
    assert out["steps"] == 3 and out == result(tmp_path / "run")
    assert {e["generation"] for e in events(tmp_path / "run")} == {2}


@pytest.mark.timeout(180)
def test_a_profile_window_writes_a_trace_a_table_and_an_event_and_changes_nothing_else(tmp_path: Path) -> None:
    import gzip

    plain = write_spec(tmp_path / "plain.yaml", steps=8)
    profiled = write_job(
        tmp_path, plain, {"spec": {"metrics": {"profile": {"startStep": 3, "steps": 2}}}}, name="p.yaml"
    )
    _ok(run_single(plain, tmp_path / "plain"))
    _ok(run_single(profiled, tmp_path / "profiled"))
    run_dir = tmp_path / "profiled"
    found = [e for e in events(run_dir) if e["event"] == "profile"]
    assert len(found) == 1
    event = found[0]
    assert (event["first_step"], event["last_step"], event["rank"]) == (3, 4, 0)
    assert event["wall_s"] > 0 and event["host_time_s"] > 0 and event["device_time_s"] == 0.0  # a CPU
    trace = json.loads(gzip.decompress((run_dir / event["trace"]).read_bytes()))
    assert any(ev.get("name") == "aten::addmm" for ev in trace["traceEvents"])  # the model's own ops
    table = (run_dir / event["table"]).read_text()
    assert (
        table.startswith("torchrig profile: rank 0, generation 0, steps 3-4") and "Optimizer.step#AdamW.step" in table
    )
    # The capture observes: the weights are the ones an unprofiled run ends with.
    assert result(run_dir)["params_sha256"] == result(tmp_path / "plain")["params_sha256"]
