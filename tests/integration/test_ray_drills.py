"""The drills on `--backend ray` (one embedded Ray, 2 CPUs, CPU/gloo) that the other Ray tests leave out:
`kill-node` (the node's Ray Train workers SIGKILLed with their trainers and warm spares: nothing is left
to recover in place, so Ray Train's `FailureConfig` restarts the worker group from the newest committed
checkpoint), `preempt` (a SIGTERM to every Ray Train worker, what Ray's drain notice becomes there: the
emergency checkpoint at one agreed step, then Ray Train's group restart resumes exactly there) and `hang`
(in place: the watchdog ends the hung trainer and a warm spare takes its rank; kill-worker in place is
`test_ray_inplace.py`'s). All end bit-identical to one shared uninterrupted reference
(`shared_reference`: the same job, backend and size). How the drills find a run's Ray Train workers
(`ray_hosts`, `process_tree`) is checked on stand-in processes, and elastic resize on the two-host
cluster of `test_ray_multinode.py`: a host lost for good, the job goes on at the smaller size."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends.ray_run import process_tree, ray_hosts
from orchestrator.drills import DrillOptions, DrillReport, run_drill
from orchestrator.drills.netns import netns_supported
from orchestrator.loader import load_spec
from tests.fixtures.common import REPO, free_port
from tests.integration import test_ray_multinode
from tests.integration.test_drills import SMALL
from tests.integration.test_ray_multinode import STEPS as MULTINODE_STEPS
from tests.integration.test_ray_multinode import (
    TwoHosts,
    _events,
    _job,
    _slow,
    _submit,
    _summary,
    _wait_for,
)
from tests.integration.test_worker import final_checkpoint

_PORT = free_port()
two_hosts = test_ray_multinode.two_hosts  # the fixture: a two-host cluster of this module's own


def _drill(scenario: str, tmp_path: Path, **options: Any) -> DrillReport:
    spec = load_spec(REPO / "examples" / "digits-ddp.yaml", [*SMALL, f"spec.metrics.port={_PORT}"])
    opts = DrillOptions(
        drill_dir=str(tmp_path / scenario), timeout_s=400, backend="ray", shared_reference=True, nodes=1, **options
    )
    report = run_drill(scenario, spec, opts)
    failed = [(c.name, c.detail) for c in report.checks if not c.passed]
    assert report.passed, f"failed checks: {failed}\n" + json.dumps(report.to_dict(), default=str)[-3000:]
    print(f"{scenario} on Ray: {report.recovery_path}, MTTR {report.mttr_seconds} s, {report.lost_steps} lost steps")
    return report


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_node_on_ray_is_ray_trains_group_restart_from_the_newest_checkpoint(
    ray_local_2cpu: object, tmp_path: Path
) -> None:
    report = _drill("kill-node", tmp_path, seed=3, at_step=12)
    assert report.recovery_path == "ray-restart" and report.fault_node == 0
    assert report.world_sizes == [2]
    killed = [e for e in report.events if e.get("event") == "fault_injected" and e.get("kind") == "kill-node"]
    assert killed, "the node was killed from outside"
    fault, resumed, lost = report.fault_step, report.resumed_from_step, report.lost_steps
    assert fault is not None and resumed is not None and lost is not None and resumed % 5 == 0
    # The steps since that checkpoint: Ray's restart path loses them (kill-worker in place loses none).
    assert lost >= fault - resumed >= 0
    assert report.final_params_match_reference is True
    summary = json.loads((Path(report.run_dir) / "summary.json").read_text())
    assert summary["restarts"] >= 1, "Ray Train restarted the worker group"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hang_on_ray_is_taken_back_in_place(ray_local_2cpu: object, tmp_path: Path) -> None:
    """A hung trainer under Ray Train: its step watchdog ends it and the host gives its rank to a warm spare
    (Ray never sees it); back within the watchdog's deadline and a few seconds, no step lost."""
    report = _drill("hang", tmp_path, seed=5, at_step=11, rank=1)
    assert report.recovery_path == "inplace" and report.lost_steps == 0
    assert report.restored_from == [] and report.final_params_match_reference is True
    summary = json.loads((Path(report.run_dir) / "summary.json").read_text())
    assert summary["restarts"] == 0, "Ray Train restarted the worker group"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_preempt_on_ray_checkpoints_at_once_and_loses_no_step(ray_local_2cpu: object, tmp_path: Path) -> None:
    report = _drill("preempt", tmp_path, seed=4, at_step=12)
    assert report.recovery_path == "ray-restart"
    assert report.lost_steps == 0 and report.resumed_from_step is not None and report.resumed_from_step >= 12
    assert report.final_params_match_reference is True
    checks = {c.name for c in report.checks}
    assert "Ray Train's group restart resumed the preempted run" in checks


@pytest.fixture
def fake_ray_worker() -> Iterator[tuple[int, int]]:
    """A process titled like a Ray worker (`ray::RayTrainWorker`) with a `... -m training` child and a
    grandchild: (worker pid, trainer pid). Ended by its id."""
    inner = "sh -c 'sleep 60 & wait' -m training & wait"
    worker = subprocess.Popen(["bash", "-c", f'exec -a ray::RayTrainWorker bash -c "{inner}"'])
    try:
        deadline = time.monotonic() + 10
        trainer = None
        while trainer is None and time.monotonic() < deadline:
            kids = [p for p in process_tree(worker.pid) if p != worker.pid]
            trainer = next((p for p in kids if b"-m\x00training\x00" in Path(f"/proc/{p}/cmdline").read_bytes()), None)
            time.sleep(0.05)
        assert trainer is not None, "the fake trainer did not start"
        yield worker.pid, trainer
    finally:
        for pid in reversed(process_tree(worker.pid)):
            os.kill(pid, signal.SIGKILL)
        worker.wait(5)


def _starts(run_dir: Path, pids: dict[int, int]) -> None:
    lines = [{"event": "start", "time": time.time(), "rank": rank, "pid": pid} for rank, pid in pids.items()]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_ray_hosts_are_the_trainers_ray_workers_and_nothing_else(
    tmp_path: Path, fake_ray_worker: tuple[int, int]
) -> None:
    worker, trainer = fake_ray_worker
    # Rank 0 trains in a hosted child; rank 1 names a process that is no Ray worker (this test's own).
    _starts(tmp_path, {0: trainer, 1: os.getpid()})
    assert ray_hosts(tmp_path, 1) == [worker]
    assert ray_hosts(tmp_path, 1, node=0) == [worker]
    assert ray_hosts(tmp_path, 1, node=1) == []
    assert ray_hosts(tmp_path, 2, node=0) == [worker]  # both ranks on node 0; only one is a Ray worker
    # The worker's whole tree goes with it: its trainer and what the trainer started.
    tree = process_tree(worker)
    assert tree[0] == worker and trainer in tree and len(tree) >= 3


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.soak  # ~250 s, 180 s of it Ray Train's worker-group start timeout: `make soak` runs it
@pytest.mark.timeout(900)
@pytest.mark.skipif(netns_supported() is not None, reason=str(netns_supported()))
def test_an_elastic_job_that_loses_a_host_goes_on_smaller_from_the_newest_checkpoint(
    two_hosts: TwoHosts, tmp_path: Path
) -> None:
    """Elastic resize on a real two-host Ray cluster (`tests/integration/test_ray_multinode.py`'s): a job of
    1..2 nodes runs as ScalingConfig(num_workers=(1, 2)); the worker host is lost for good (its raylet
    SIGKILLed, no replacement), and Ray Train restarts the group at the one worker the head can hold, from
    the newest checkpoint committed before the loss. The data pipeline is by global index: the final
    checkpoint's cursor counts every sample once (the steps before at 2 ranks, the rest at 1)."""
    run, run_dir = _submit(two_hosts, _job(tmp_path, two_hosts.shared, "spec.nodes.min=1"), **_slow())
    _wait_for(
        run_dir,
        "a checkpoint past step 5",
        lambda ev: any(e.get("event") == "checkpoint_committed" and e["step"] >= 5 for e in ev),
    )
    lost_at = time.time()
    two_hosts.stop_worker()  # the spot VM is gone: its raylet and its workers, and nothing takes its place
    summary = _summary(two_hosts, run, run_dir)
    logs = two_hosts.torchrig("logs", run).stdout if summary["status"] != "succeeded" else ""
    assert summary["status"] == "succeeded" and summary["steps"] == MULTINODE_STEPS, f"{summary}\n{logs[-6000:]}"
    assert summary["world_sizes"] == [2, 1] and summary["restarts"] >= 1, summary
    history = _events(run_dir)
    committed = [e["step"] for e in history if e.get("event") == "checkpoint_committed" and e["time"] < lost_at]
    restore = next(e for e in history if e.get("event") == "restore" and e["time"] > lost_at and e["rank"] == 0)
    assert restore["step"] == max(committed), restore
    first = next(e for e in history if e.get("event") == "first_step" and e["time"] > restore["time"])
    print(f"elastic on Ray: lost a host, back at world size 1 {first['time'] - lost_at:.1f} s later")
    stop = int(restore["step"])
    cursor = final_checkpoint(run_dir, tmp_path)["trainer"]["cursor"]
    assert cursor == stop * 32 * 2 + (MULTINODE_STEPS - stop) * 32, "every sample counted once across the resize"
