"""`python -m training.launch` as the compiled containers run it (issue 15 point 3): the preflight, then
the command in its place (same PID, so signals reach torchrun); a deterministic error exits 2 or 3 before
torchrun spends a single restart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training.contract import ExitCode

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
