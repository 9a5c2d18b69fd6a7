"""kill-node with a standby node strikes only once a standby is warm, and says so when none ever is.

`AwaitStandby` waits (at most the drill's `timeout_s`) for the run's `standby_ready`; on a loaded machine the
job can finish first, or the standby never warm up. The node is then not killed, and the verdict says which:
inconclusive when the job finished first (the drill proved nothing), a failed check when the standby was not
ready while the job ran on. Fakes only: the runs here are scripted, no process is started.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from orchestrator.backends import BACKENDS
from orchestrator.backends.base import (
    Backend,
    Capabilities,
    DryRun,
    RunHandle,
    RunState,
    RunStatus,
    SubmitOptions,
    SupervisedRun,
)
from orchestrator.drills import DrillOptions, DrillReport, run_drill, runner
from orchestrator.drills.actions import ActionRunner
from orchestrator.drills.plan import AwaitStandby, AwaitStep, NodeKill, Outcome
from orchestrator.errors import UnsupportedFeature
from orchestrator.loader import load_spec
from orchestrator.spec import JobSpec
from tests.fixtures.common import REPO
from training.contract import RunFiles, Summary

STANDBY = ["spec.nodes.min=2", "spec.nodes.max=2", "spec.restarts.spareNodes=1", "spec.training.steps=200"]


def _spec() -> JobSpec:
    return load_spec(REPO / "examples" / "digits-ddp.yaml", STANDBY)


class StandbyRun:
    """A run at step 40 whose standby turns ready after `ready_after` looks (None: never), and which ends
    in `ends` after `ends_after` looks (None: runs on)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        ready_after: int | None,
        ends_after: int | None = None,
        ends: RunState = RunState.SUCCEEDED,
    ) -> None:
        self._run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        events = [{"time": 1.0, "event": "start", "rank": 0, "world_size": 4, "pid": 1}]
        events += [{"time": 2.0, "event": "step", "rank": 0, "step": 40}]
        RunFiles(run_dir).events.write_text("".join(json.dumps(e) + "\n" for e in events))
        self.ready_after, self.ends_after, self.ends = ready_after, ends_after, ends
        self.looks = 0
        self.killed: list[int] = []

    @property
    def run_dir(self) -> Path:
        return self._run_dir

    def standby_ready(self) -> bool:
        self.looks += 1
        return self.ready_after is not None and self.looks > self.ready_after

    def poll(self) -> RunState:
        if self.ends_after is not None and self.looks >= self.ends_after:
            return self.ends
        return RunState.RUNNING

    def wait(self, timeout_s: float | None = None) -> Summary:
        return Summary(status=str(self.poll()), world_sizes=[4])

    def kill_node(self, node: int) -> list[int]:
        self.killed.append(node)
        return [99]

    def add_node(self) -> int:
        raise NotImplementedError

    def stop(self, grace_s: float = 10.0) -> None:
        pass

    def request_cancel(self) -> None:
        pass


def _act(run: Any, timeout_s: float = 2.0) -> ActionRunner:
    actions = ActionRunner(run, _spec(), Outcome(fault_step=30, fault_rank=None), timeout_s=timeout_s)
    actions.run_all([AwaitStep(30), AwaitStandby(), NodeKill(1)])
    return actions


def test_the_node_is_killed_once_the_standby_is_ready(tmp_path: Path) -> None:
    run = StandbyRun(tmp_path, ready_after=3)
    actions = _act(run)
    assert run.killed == [1] and run.looks == 4
    assert actions.standby_wait is not None and actions.standby_wait.ready
    assert actions.outcome.too_late is None


def test_a_job_that_finishes_before_its_standby_is_ready_is_not_struck(tmp_path: Path) -> None:
    run = StandbyRun(tmp_path, ready_after=None, ends_after=2)
    actions = _act(run)
    assert run.killed == [], "the node of a finished job was killed"
    assert actions.standby_wait is not None and not actions.standby_wait.ready
    assert actions.outcome.too_late is not None
    assert actions.outcome.too_late.startswith("the job finished before a standby node was ready")


def test_a_standby_never_ready_while_the_job_runs_stops_the_plan(tmp_path: Path) -> None:
    run = StandbyRun(tmp_path, ready_after=None)
    actions = _act(run, timeout_s=0.3)
    assert run.killed == []
    assert actions.standby_wait is not None and not actions.standby_wait.ready
    assert "no standby node was ready within" in actions.standby_wait.detail
    assert actions.outcome.too_late is None  # not inconclusive: the standby failed to warm up


def test_a_run_that_cannot_tell_refuses_rather_than_strikes_blind(tmp_path: Path) -> None:
    class Blind(StandbyRun):
        standby_ready = None

    run = Blind(tmp_path, ready_after=0)
    with pytest.raises(UnsupportedFeature, match="cannot tell when a standby is ready"):
        _act(run)
    assert run.killed == []


# -- the verdict of the whole drill, against a backend whose runs are StandbyRun ----------------------
class StandbyBackend(Backend):
    name = "standby-scripted"
    capabilities: ClassVar[Capabilities] = Capabilities(supervised=True)
    script: ClassVar[dict[str, Any]] = {}

    def _dry_run(self, spec: JobSpec, options: SubmitOptions) -> Any:
        return {}

    def _launch(self, dryrun: DryRun) -> SupervisedRun:
        assert dryrun.options.run_dir is not None
        return StandbyRun(Path(dryrun.options.run_dir), **StandbyBackend.script)

    def _schedule(self, dryrun: DryRun) -> RunHandle:
        raise NotImplementedError

    def _status(self, run_id: str) -> RunStatus:
        raise NotImplementedError

    def _logs(self, run_id: str, rank: int | None, follow: bool) -> Iterator[str]:
        raise NotImplementedError

    def _cancel(self, run_id: str) -> RunStatus:
        raise NotImplementedError

    def _list(self) -> list[RunStatus]:
        return []


@pytest.fixture
def standby_backend(monkeypatch: pytest.MonkeyPatch) -> type[StandbyBackend]:
    monkeypatch.setitem(BACKENDS, StandbyBackend.name, f"{__name__}:StandbyBackend")
    monkeypatch.setattr(runner, "_REFERENCES", {})
    return StandbyBackend


def _drill(tmp_path: Path, **options: Any) -> DrillReport:
    opts = DrillOptions(backend=StandbyBackend.name, seed=3, nodes=2, reference=False, drill_dir=str(tmp_path / "d"))
    return run_drill("kill-node", _spec(), dataclasses.replace(opts, **options))


def test_the_drill_is_inconclusive_when_the_job_ends_before_its_standby_is_ready(
    tmp_path: Path, standby_backend: type[StandbyBackend]
) -> None:
    standby_backend.script = {"ready_after": None, "ends_after": 2}
    report = _drill(tmp_path, at_step=30)
    assert report.verdict == "inconclusive"
    assert report.inconclusive is not None
    assert report.inconclusive.startswith("the job finished before a standby node was ready")
    checks = {c.name: c for c in report.checks}
    assert checks["a standby node was ready before the node fault"].passed is False


def test_the_drill_fails_naming_the_standby_when_none_is_ready_in_time(
    tmp_path: Path, standby_backend: type[StandbyBackend]
) -> None:
    standby_backend.script = {"ready_after": None}
    report = _drill(tmp_path, at_step=30, timeout_s=0.3)
    assert report.verdict == "fail" and report.inconclusive is None
    check = next(c for c in report.checks if c.name == "a standby node was ready before the node fault")
    assert not check.passed and "no standby node was ready within" in check.detail
