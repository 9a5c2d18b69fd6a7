"""In-place recovery under Ray Train (`training.ray_train`: each Ray Train worker is its rank's host) on a
real local Ray (2 CPUs, CPU/gloo): a trainer's death is taken back by a warm spare and Ray never sees it;
what in place cannot take back (the worker actor itself lost, a preemption) is Ray Train's group restart
from the newest committed checkpoint."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends import get_backend
from orchestrator.backends.base import SubmitOptions, SupervisedRun
from orchestrator.drills import DrillOptions, DrillReport, run_drill
from orchestrator.loader import load_spec
from orchestrator.spec import JobSpec
from tests.fixtures.common import REPO, free_port
from tests.fixtures.jobs import events
from tests.integration.test_drills import SMALL
from tests.integration.test_ray_backend import STEPS, assert_preempted_and_resumed_losing_no_step
from training.contract import Env, read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]

_PORT = free_port()


def _spec(*extra: str) -> JobSpec:
    return load_spec(REPO / "examples" / "digits-ddp.yaml", [*SMALL, f"spec.metrics.port={_PORT}", *extra])


def _drill(scenario: str, tmp_path: Path, **options: Any) -> DrillReport:
    opts = DrillOptions(drill_dir=str(tmp_path / scenario), timeout_s=300, backend="ray", **options)
    report = run_drill(scenario, _spec(), opts)
    failed = [(c.name, c.detail) for c in report.checks if not c.passed]
    assert report.passed, f"failed checks: {failed}\n" + json.dumps(report.to_dict(), default=str)[-3000:]
    return report


def test_kill_worker_on_ray_recovers_in_place_bit_exactly(ray_local_2cpu: object, tmp_path: Path) -> None:
    """A SIGKILLed trainer under Ray Train: its host (the Ray Train worker) gives its rank to the node's
    warm spare; no worker group restart, nothing restored, no step lost, the result bit-identical."""
    report = _drill("kill-worker", tmp_path, seed=8, at_step=12, rank=1)
    assert report.recovery_path == "inplace", report.notes
    assert report.resumed_from_step == 12 and report.lost_steps == 0
    assert report.restored_from == []
    assert report.final_params_match_reference is True
    summary = json.loads((Path(report.run_dir) / "summary.json").read_text())
    assert summary["restarts"] == 0, "Ray Train restarted the worker group"


def _launch_slowed(tmp_path: Path, *extra: str) -> tuple[SupervisedRun, Path]:
    """A hosted run whose worker group 0 is slowed from step 2 on (0.3 s a step), so an outside fault lands
    mid-run; the restarted group runs at speed."""
    run_dir = tmp_path / "run"
    fault = [{"kind": "slow", "rank": 0, "step": 2, "seconds": 0.3}]
    options = SubmitOptions(run_dir=str(run_dir), env={Env.FAULTS: json.dumps(fault)})
    return get_backend("ray").launch(_spec(*extra), options), run_dir


def _host_of_rank_1(run_dir: Path, after_step: int) -> int:
    """The pid of rank 1's host (its Ray Train worker: the parent of rank 1's trainer), once a checkpoint
    after `after_step` is committed."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        live = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
        started = [e for e in live if e.get("event") == "start" and e.get("rank") == 1]
        if started and any(e.get("event") == "checkpoint_committed" and e["step"] > after_step for e in live):
            trainer = int(started[0]["pid"])
            # A hosted trainer is a `python -m training` child of the Ray Train worker (without a host the
            # trainer is the worker itself, whose parent is Ray's: never signal that).
            assert b"-m\x00training\x00" in Path(f"/proc/{trainer}/cmdline").read_bytes(), "no host"
            stat = Path(f"/proc/{trainer}/stat").read_text()
            host = int(stat.rsplit(")", 1)[1].split()[1])  # the 4th field: the parent
            assert host not in (os.getpid(), 1)
            return host
        time.sleep(0.2)
    raise AssertionError("the run never reached its checkpoint")


def test_a_lost_worker_actor_is_ray_trains_group_restart_from_the_newest_checkpoint(
    ray_local_2cpu: object, tmp_path: Path
) -> None:
    """What Ray still handles: rank 1's Ray Train worker (its host) SIGKILLed takes its trainer with it
    (`PR_SET_PDEATHSIG`); no host is left to claim a spare, Ray Train restarts the worker group, and the
    new group resumes from the newest committed checkpoint."""
    run, run_dir = _launch_slowed(tmp_path)
    host = _host_of_rank_1(run_dir, after_step=5)
    killed_at = time.time()
    os.kill(host, signal.SIGKILL)
    summary = run.wait().to_dict()

    history = events(run_dir)
    restore = next(e for e in history if e["event"] == "restore" and e["rank"] == 0)
    committed = [e["step"] for e in history if e["event"] == "checkpoint_committed" and e["time"] < killed_at]
    assert restore["generation"] == 1 and restore["step"] == max(committed)
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS and summary["restarts"] == 1
    first = next(e for e in history if e["event"] == "first_step" and e["time"] > restore["time"])
    print(f"worker actor lost: Ray Train group restart, first step {first['time'] - killed_at:.2f} s after the kill")


def test_sigterm_to_a_hosted_ray_worker_reaches_its_trainer_and_loses_no_step(
    ray_local_2cpu: object, tmp_path: Path
) -> None:
    """A SIGTERM to a Ray Train worker (what a drain notice becomes, `_DrainToSignal`) is forwarded by its
    host to its trainer: both ranks stop at one agreed step after an emergency checkpoint, and Ray Train's
    group restart resumes exactly there."""
    run, run_dir = _launch_slowed(tmp_path)
    os.kill(_host_of_rank_1(run_dir, after_step=5), signal.SIGTERM)
    summary = run.wait().to_dict()
    assert_preempted_and_resumed_losing_no_step(run_dir, summary)
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS and summary["restarts"] == 1
