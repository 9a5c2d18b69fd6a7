"""Submitting through the Ray Jobs API to a head started by the test (`ray start --head` on 127.0.0.1)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from orchestrator.backends.base import RayOptions, RunState, SubmitOptions
from orchestrator.backends.ray import RayBackend
from tests.integration.test_ray_backend import STEPS, tiny_digits

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]


def test_jobs_api_submission_runs_the_job_on_the_cluster(ray_head_cluster: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    backend = RayBackend(address=ray_head_cluster)
    # The run directory is a path of the cluster (here this machine), under the directory every node mounts.
    spec = tiny_digits(**{"spec.ray.sharedDir": str(tmp_path)})
    handle = backend.submit(spec, SubmitOptions(run_dir=str(run_dir), ray=RayOptions(address=ray_head_cluster)))
    host = ray_head_cluster.removeprefix("http://")
    assert str(handle).startswith(f"ray://{host}/torchrig-digits-ddp-")

    deadline = time.monotonic() + 300
    status = backend.status(handle.run_id)
    while not status.state.terminal and time.monotonic() < deadline:
        time.sleep(2)
        status = backend.status(handle.run_id)
    logs = "\n".join(backend.logs(handle.run_id, rank=None, follow=False))
    assert status.state is RunState.SUCCEEDED, logs[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS
    assert "torchrig: finished" in logs
    assert [str(r.handle) for r in backend.list_runs()] == [str(handle)]
