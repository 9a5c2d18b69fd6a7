"""`RayLocalRun.stop` without a real Ray: the order of what it does, which decides whether a cancelled
run leaves a summary when Ray's core worker ends the process during the shutdown."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import ray

from orchestrator.backends.base import RunState, SubmitOptions
from orchestrator.backends.ray_run import RayLocalRun
from orchestrator.loader import load_spec
from training.contract import RunFiles


def test_stop_writes_a_cancelled_summary_before_it_shuts_ray_down(
    tmp_path: Path, examples_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI saw it: the shutdown made Ray's core worker exit the supervisor ("The core worker has already
    been shutdown ... The process will exit") before the driver thread wrote its summary, so `cancel`
    found none. The summary that `stop` writes first carries the run's progress from the directory."""
    release = threading.Event()
    seen: dict[str, object] = {}

    def driver(self: RayLocalRun) -> None:  # a Ray Train driver that never gets to write its summary
        self._owns_ray = True
        release.wait(30)

    def shutdown() -> None:
        files = RunFiles(run_dir)
        seen["summary"] = json.loads(files.summary.read_text()) if files.summary.exists() else None
        release.set()

    monkeypatch.setattr(RayLocalRun, "_main", driver)
    monkeypatch.setattr(ray, "shutdown", shutdown)
    spec = load_spec(examples_dir / "digits-ddp.yaml", ["spec.training.steps=100"])
    run_dir = tmp_path / "run"
    files = RunFiles(run_dir)
    files.logs.mkdir(parents=True)
    old = files.metrics
    old.write_text(json.dumps({"time": time.time() - 3600, "step": 90, "loss": 0.1}) + "\n")  # an earlier attempt's
    run = RayLocalRun(spec, SubmitOptions(run_dir=str(run_dir)), run_dir, num_cpus=1)
    while run._owns_ray is None:
        time.sleep(0.01)
    with old.open("a") as f:
        f.write(json.dumps({"time": time.time(), "step": 7, "loss": 1.5}) + "\n")
    run.stop(0.0)
    summary = seen["summary"]
    assert isinstance(summary, dict), "stop shut Ray down before any summary was written"
    assert summary["status"] == RunState.CANCELLED.value
    assert summary["reason"] == "cancelled by the user"
    assert summary["backend"] == "ray"
    assert summary["steps"] == 7, summary  # this attempt's progress, not the earlier attempt's step 90
    assert run.poll() is RunState.CANCELLED
