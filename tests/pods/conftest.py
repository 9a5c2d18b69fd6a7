"""Fixtures of the pods harness: the scenario spec, its reference `torchrig run`, and a PodCluster
factory whose clusters are always torn down (namespaces, processes, mount points)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.common import REPO, free_port
from tests.pods.kubelet import Pod
from tests.pods.runtime import PodCluster
from tests.pods.scenario import EXAMPLE, SCENARIO_SETS, TORCHRIG_ENV

# Probe periods run twice as fast as rendered (a 30 s liveness period is probed every 15 s), so the scenarios
# exercise the probes within their minutes; TORCHRIG_PODS_TIME_SCALE=1 runs them at the real pace.
TIME_SCALE = float(os.environ.get("TORCHRIG_PODS_TIME_SCALE", "0.5"))


_REFERENCE: dict[str, Any] = {}  # `reference_result`, once per process


@pytest.fixture(scope="session")
def reference_result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`torchrig run` of the scenario spec on 2 emulated nodes (world size 4, like the 2-pod jobs).

    Only the metrics port differs (127.0.0.1:9400 may be taken on a shared machine; it changes no
    numbers). Run once per test process: tests/containers re-exports this fixture, which pytest then
    holds as a second session fixture with a cache of its own (the run took place twice)."""
    if _REFERENCE:
        return _REFERENCE
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    sets = [a for s in [*SCENARIO_SETS, f"spec.metrics.port={free_port()}"] for a in ("--set", s)]
    cmd = [sys.executable, "-c", "from orchestrator.cli import main; main()", "run", str(EXAMPLE), "--nodes", "2"]
    proc = subprocess.run(
        [*cmd, *sets, "--run-dir", str(run_dir), "-o", "json"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=run_dir.parent,
        env={**os.environ, **TORCHRIG_ENV, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads(proc.stdout)
    assert summary["status"] == "succeeded" and summary["world_sizes"] == [4], summary
    _REFERENCE.update(summary)
    return _REFERENCE


@pytest.fixture
def pod_cluster(tmp_path: Path) -> Iterator[Callable[[list[dict[str, Any]], list[Pod]], PodCluster]]:
    """`make(objects, pods)` -> an entered PodCluster; every cluster made is closed at teardown."""
    made: list[PodCluster] = []

    def make(objects: list[dict[str, Any]], pods: list[Pod]) -> PodCluster:
        cluster = PodCluster(tmp_path / f"cluster{len(made)}", objects, pods, time_scale=TIME_SCALE)
        made.append(cluster)
        return cluster.__enter__()

    yield make
    for cluster in made:
        cluster.close()
