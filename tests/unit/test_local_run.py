"""`LocalRun.poll` and `LocalRun.finish` with hand-written agent processes (no torchrun, no signals):
how the exit codes, a cancel and this attempt's result.json decide the run's state and reason."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from orchestrator.backends.base import RunState
from orchestrator.backends.local_plan import LocalPlan
from orchestrator.backends.local_run import LocalRun, _Agent
from orchestrator.loader import load_spec
from training.contract import Result, RunFiles

STEPS = 20


class ExitedAgent:
    """A torchrun agent process that has already exited with `returncode` (what `poll`/`finish` read)."""

    def __init__(self, returncode: int, pid: int) -> None:
        self.returncode = returncode
        self.pid = pid

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


def _run(tmp_path: Path, examples_dir: Path, *codes: int, restarts: int = 3) -> LocalRun:
    """A run of `STEPS` steps that started just now, whose agents exited with `codes`."""
    overrides = [f"spec.training.steps={STEPS}", f"spec.restarts.max={restarts}"]
    spec = load_spec(examples_dir / "digits-ddp.yaml", overrides)
    run_dir = tmp_path / "run"
    RunFiles(run_dir).logs.mkdir(parents=True)
    plan = LocalPlan(
        run_dir=str(run_dir),
        rdzv_id="test",
        nodes=len(codes),
        nnodes=f"1:{len(codes)}",
        procs_per_node=2,
        max_restarts=restarts,
        worker=["-m", "training"],
        env={},
    )
    run = LocalRun(spec=spec, plan=plan)
    # A second back: the kernel stamps a file's mtime from a coarse clock that can lag `time.time()` by a
    # tick, so a result.json written right after this line could otherwise look older than the start.
    run._started, run._started_at = time.monotonic(), time.time() - 1.0
    # Pids above any kernel's pid_max (2**22): were one signalled by mistake, no process could get it.
    agents = [ExitedAgent(code, pid=2**30 + i) for i, code in enumerate(codes)]
    run._agents = [_Agent(node=i, proc=agent) for i, agent in enumerate(agents)]  # type: ignore[arg-type]
    return run


def _result(run: LocalRun, steps: int = STEPS, *, age_s: float = 0.0) -> None:
    """Rank 0's result.json, written `age_s` seconds before the run started (0: after it)."""
    path = RunFiles(run.run_dir).result
    Result(steps=steps, final_loss=0.25, params_sha256="ab" * 32).write(path)
    if age_s:
        then = run._started_at - age_s
        os.utime(path, (then, then))


def _events(run: LocalRun, *generations: int) -> None:
    lines = [
        {"time": time.time(), "rank": 0, "generation": g, "event": "start", "world_size": 2, "pid": 1}
        for g in generations
    ]
    RunFiles(run.run_dir).events.write_text("".join(json.dumps(e) + "\n" for e in lines))


def test_a_late_signal_after_every_step_is_a_success(tmp_path: Path, examples_dir: Path) -> None:
    """The agent got a SIGTERM in its monitor loop's sleep after its workers succeeded: it exits 1."""
    run = _run(tmp_path, examples_dir, 1)
    _events(run, 0)
    _result(run)
    assert run.poll() is RunState.SUCCEEDED
    summary = run.finish(run.poll())
    assert summary.status == "succeeded" and summary.reason is None and summary.steps == STEPS
    assert json.loads(RunFiles(run.run_dir).summary.read_text())["status"] == "succeeded"


@pytest.mark.parametrize(
    ("steps", "age_s"),
    [(STEPS - 1, 0.0), (STEPS, 3600.0)],
    ids=["steps-short-of-the-job", "an-earlier-attempts-result"],
)
def test_a_result_proves_success_only_when_this_attempt_did_every_step(
    tmp_path: Path, examples_dir: Path, steps: int, age_s: float
) -> None:
    run = _run(tmp_path, examples_dir, 1)
    _events(run, 0)
    _result(run, steps, age_s=age_s)
    assert run.poll() is RunState.FAILED
    assert run.finish(RunState.FAILED).status == "failed"


def test_the_reason_says_restarts_exhausted_only_when_they_were(tmp_path: Path, examples_dir: Path) -> None:
    early = _run(tmp_path / "a", examples_dir, 1, 0)
    _events(early, 0)
    reason = early.finish(early.poll()).reason or ""
    assert reason.startswith("the torchrun agent(s) exited with codes {0: 1, 1: 0} after 0 restarts")
    assert "restarts exhausted" not in reason and "(spec.restarts.max=3)" in reason

    spent = _run(tmp_path / "b", examples_dir, 1, restarts=2)
    _events(spent, 0, 1, 2)
    summary = spent.finish(spent.poll())
    assert summary.status == "failed" and summary.restarts == 2
    assert (summary.reason or "").startswith("restarts exhausted (spec.restarts.max=2); agent exit codes {0: 1}")


def test_a_cancel_after_the_workers_finished_keeps_the_success(tmp_path: Path, examples_dir: Path) -> None:
    finished = _run(tmp_path / "a", examples_dir, 1)
    _result(finished)
    finished.request_cancel()
    assert finished.poll() is RunState.SUCCEEDED
    summary = finished.finish(RunState.CANCELLED, grace_s=0)
    assert summary.status == "succeeded" and summary.reason is None

    cancelled = _run(tmp_path / "b", examples_dir, 1)
    _result(cancelled, STEPS - 5)
    cancelled.request_cancel()
    assert cancelled.poll() is RunState.CANCELLED
    summary = cancelled.finish(RunState.CANCELLED, grace_s=0)
    assert summary.status == "cancelled" and summary.reason == "cancelled by the user"


def test_agents_that_all_exit_zero_succeed_without_a_result(tmp_path: Path, examples_dir: Path) -> None:
    """A custom `--worker` may write no result.json: the agents' own success still counts."""
    run = _run(tmp_path, examples_dir, 0, 0)
    assert run.poll() is RunState.SUCCEEDED
