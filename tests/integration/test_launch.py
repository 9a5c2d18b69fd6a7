"""`python -m training.launch` as the compiled containers run it (issue 15 point 3): the preflight, then
the command in its place (same PID, so signals reach torchrun); a deterministic error exits 2 or 3 before
torchrun spends a single restart."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from training.contract import ExitCode, is_retryable

pytestmark = pytest.mark.timeout(120)


def job(tmp_path: Path, entrypoint: str = "training.examples.digits:task") -> Path:
    path = tmp_path / "job.yaml"
    doc = {
        "apiVersion": "torchrig/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "launch"},
        "spec": {"task": {"entrypoint": entrypoint, "args": {"hidden": 8}}, "training": {"steps": 1}},
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def launch(tmp_path: Path, spec: Path, *command: str) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "training.launch", "--spec", str(spec), "--run-dir", str(tmp_path / "run")]
    return subprocess.Popen([*args, "--", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_command_replaces_the_launcher(tmp_path: Path) -> None:
    proc = launch(tmp_path, job(tmp_path), sys.executable, "-c", "import os; print('ran', os.getpid())")
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    assert out.split() == ["ran", str(proc.pid)]


def test_an_entrypoint_typo_never_starts_torchrun(tmp_path: Path) -> None:
    spec = job(tmp_path, "training.examples.digitz:task")
    proc = launch(
        tmp_path, spec, sys.executable, "-m", "torch.distributed.run", "--max-restarts", "3", "-m", "training"
    )
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == ExitCode.TASK_INVALID
    assert out == "" and err.splitlines() == [
        "torchrig: error: spec.task.entrypoint: cannot import 'training.examples.digitz': "
        "No module named 'training.examples.digitz'"
    ]


def test_a_command_that_cannot_run_is_an_environment_error(tmp_path: Path) -> None:
    proc = launch(tmp_path, job(tmp_path), "no-such-torchrun")
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == ExitCode.ENVIRONMENT
    assert err.strip().startswith("torchrig: error: cannot execute 'no-such-torchrun'")


def test_a_torchrun_ended_by_sigterm_exits_retryable_143_not_1(tmp_path: Path) -> None:
    """torchrun raises SignalException (exit 1: permanent for a PyTorchJob) after shutting its workers
    down on SIGTERM; through the launcher it exits 128 + 15, as a preempted pod must to be restarted."""
    script = tmp_path / "sleeper.py"
    script.write_text("import pathlib, sys, time\npathlib.Path(sys.argv[1]).touch()\ntime.sleep(120)\n")
    started = tmp_path / "started"
    proc = launch(tmp_path, job(tmp_path), "torchrun", "--standalone", "--nproc-per-node=1", str(script), str(started))
    try:
        deadline = time.monotonic() + 90
        while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert started.exists(), proc.communicate(timeout=10)[1][-2000:]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-2000:]
    assert "torchrig: torchrun stopped by SIGTERM; exiting 143 (retryable)" in err
    assert is_retryable(proc.returncode)
