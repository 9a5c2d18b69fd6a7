"""Preemption handling (`training.preemption`): the signal, the deadline, the emergency save and how a
preempted run is summarised. The multi-process path (agreement, torchrun, resume) is the `preempt` drill's
(tests/integration/test_drills.py)."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends.base import RunState
from orchestrator.loader import load_spec
from orchestrator.rundir import build_summary, preemption_of
from training.config import RestartsConfig
from training.contract import Env, EventKind, ExitCode, RunFiles, append_jsonl, open_append, read_events
from training.contract.events import Preempted, Start, payload_fields
from training.metrics.base import MetricsSink
from training.preemption import DUPLICATE_WINDOW_S, PreemptedExit, PreemptionHandler
from training.preemption_timing import launcher_env, pod_grace_period_seconds, torchrun_shutdown_timeout

REPO = Path(__file__).resolve().parents[2]


class _Events(MetricsSink):
    def __init__(self) -> None:
        self.emitted: list[Any] = []

    def emit(self, payload: Any) -> None:
        self.emitted.append(payload)


@dataclass
class _Outcome:
    step: int
    stores_ok: list[str] = field(default_factory=lambda: ["local"])


class _Saver:
    """A checkpoint manager whose save takes `seconds` and commits unless `fail`."""

    def __init__(self, seconds: float = 0.0, fail: bool = False, already: bool = False) -> None:
        self.seconds, self.fail, self.already = seconds, fail, already
        self.last_committed_step: int | None = None
        self.history: list[Any] = []
        self.calls: list[tuple[int, bool]] = []

    def save(self, step: int, state: dict[str, Any], *, final: bool = False, synchronous: bool = False) -> Any:
        self.calls.append((step, synchronous))
        time.sleep(self.seconds)
        outcome = _Outcome(step, [] if self.fail else ["local"])
        if not self.fail:
            self.last_committed_step = step
        self.history.append(outcome)
        return None if self.already else outcome

    def wait(self) -> None:
        pass


class _Exit:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


def _handler(grace_s: float = 5.0) -> tuple[PreemptionHandler, _Events, _Exit]:
    events, exit = _Events(), _Exit()
    handler = PreemptionHandler(grace_s, events, exit=exit)
    handler._installed = True  # as `install` leaves it, without touching this process's handlers
    return handler, events, exit


def test_a_signal_stops_at_the_next_boundary_with_a_synchronous_save() -> None:
    handler, events, exit = _handler()
    saver = _Saver()
    handler.at_step_boundary(6, saver, {})  # nothing asked: training goes on
    assert saver.calls == []
    handler.request()
    with pytest.raises(PreemptedExit) as raised:
        handler.at_step_boundary(7, saver, {})
    handler.uninstall()
    assert (raised.value.step, raised.value.committed) == (7, True)
    assert saver.calls == [(7, True)]
    [event] = events.emitted
    assert isinstance(event, Preempted) and event.kind is EventKind.PREEMPTED
    assert (event.step, event.committed, event.reason, event.stores_ok) == (7, True, "saved", ["local"])
    assert event.since_signal_s <= event.grace_s and exit.codes == []


def test_the_emergency_save_is_certified_first_and_a_disagreement_saves_nothing() -> None:
    """`before_save` (the trainer's sdc check: restore prefers certified checkpoints, so an uncertified
    emergency save would be passed over for an older one) runs at the stop step, before the save; when it
    raises (the replicas disagree) nothing is saved."""
    handler, _, _ = _handler()
    saver, order = _Saver(), []
    handler.before_save = lambda step: order.append(("certify", step, list(saver.calls)))
    handler.request()
    with pytest.raises(PreemptedExit):
        handler.at_step_boundary(9, saver, {})
    handler.uninstall()
    assert order == [("certify", 9, [])] and saver.calls == [(9, True)]

    class Disagreement(Exception):
        pass

    def disagree(step: int) -> None:
        raise Disagreement(step)

    handler, _, _ = _handler()
    saver = _Saver()
    handler.before_save = disagree
    handler.request()
    with pytest.raises(Disagreement):
        handler.at_step_boundary(9, saver, {})
    handler.uninstall()
    assert saver.calls == []


def test_a_step_already_saved_at_the_boundary_waits_for_that_save() -> None:
    handler, events, _ = _handler()
    saver = _Saver(already=True)
    handler.request()
    with pytest.raises(PreemptedExit):
        handler.at_step_boundary(10, saver, {})
    handler.uninstall()
    assert events.emitted[0].committed and events.emitted[0].stores_ok == ["local"]


def test_a_failed_emergency_save_is_recorded_as_not_committed() -> None:
    handler, events, _ = _handler()
    handler.request()
    with pytest.raises(PreemptedExit) as raised:
        handler.at_step_boundary(3, _Saver(fail=True), {})
    handler.uninstall()
    assert not raised.value.committed
    assert (events.emitted[0].committed, events.emitted[0].reason) == (False, "save_failed")


def test_the_deadline_ends_a_save_that_does_not_finish_in_the_grace() -> None:
    handler, events, exit = _handler(grace_s=0.2)
    handler.request()
    with pytest.raises(PreemptedExit) as raised:
        handler.at_step_boundary(4, _Saver(seconds=1.0), {})  # outlives the grace: the deadline strikes
    assert exit.codes == [int(ExitCode.PREEMPTED)]
    assert not raised.value.committed
    [event] = events.emitted  # the deadline's record only: the late save is not reported as committed
    assert (event.step, event.committed, event.reason) == (4, False, "deadline")


def test_the_deadline_strikes_before_the_stop_step_too() -> None:
    handler, events, exit = _handler(grace_s=0.1)
    handler.should_stop(9)
    handler.request()
    assert exit.called.wait(5)
    assert exit.codes == [202] and events.emitted[0].reason == "deadline" and events.emitted[0].step == 9


def test_a_repeat_within_the_window_is_the_same_notice_a_later_one_stops_now() -> None:
    handler, events, exit = _handler()
    handler.request()
    handler.request()  # the same SIGTERM forwarded by the agent a moment later
    assert exit.codes == []
    assert handler.requested_at is not None
    handler.requested_at -= DUPLICATE_WINDOW_S  # as if the second signal came later
    handler.request()
    handler.uninstall()
    assert exit.codes == [202]
    assert (events.emitted[0].reason, events.emitted[0].committed) == ("second_signal", False)


def test_off_with_a_zero_grace_and_the_real_signal_sets_the_flag() -> None:
    off = PreemptionHandler(0.0, _Events()).install()
    assert not off.enabled and off._previous == {} and not off.should_stop(1)
    before = signal.getsignal(signal.SIGTERM)
    handler = PreemptionHandler(30.0, _Events(), extra_signal="SIGUSR2").install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while not handler.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handler.requested and handler.signal_name == "SIGUSR2"
        assert handler.should_stop(1)  # one process: nothing to agree on
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def test_off_the_main_thread_the_handler_is_installed_on_it_through_the_launcher() -> None:
    """Ray Train's case (`training.ray_train.run_on_actor_main_thread`): the worker runs in another
    thread and hands the installation (and the uninstallation) to the main thread; without such a
    runner nothing is installed there."""
    import queue

    calls: queue.Queue[Any] = queue.Queue()

    def on_main_thread(fn: Any) -> None:  # what the launcher does: run it on the main thread, wait
        done = threading.Event()
        calls.put((fn, done))
        assert done.wait(10)

    before = signal.getsignal(signal.SIGUSR2)
    handlers: dict[str, PreemptionHandler] = {}

    def worker() -> None:
        handlers["plain"] = PreemptionHandler(30.0, _Events(), extra_signal="SIGUSR2").install()
        handler = handlers["ray"] = PreemptionHandler(30.0, _Events(), extra_signal="SIGUSR2").install(on_main_thread)
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while not handler.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        handler.uninstall()
        calls.put(None)

    thread = threading.Thread(target=worker)
    thread.start()
    ran = 0
    while (item := calls.get(timeout=20)) is not None:
        item[0]()
        item[1].set()
        ran += 1
    thread.join(10)
    assert ran == 2  # the installation and the uninstallation, both on this (the main) thread
    assert not handlers["plain"]._installed and handlers["plain"]._previous == {}
    assert handlers["ray"].requested and handlers["ray"].signal_name == "SIGUSR2"
    assert signal.getsignal(signal.SIGUSR2) == before


def test_launchers_get_the_grace_period() -> None:
    restarts = RestartsConfig(preempt_grace_seconds=42.5, preempt_signal="SIGUSR2")
    assert torchrun_shutdown_timeout(restarts) == 48 and pod_grace_period_seconds(restarts) == 53
    env = launcher_env(restarts)
    assert env[Env.ELASTIC_SHUTDOWN_TIMEOUT] == "48" and env[Env.PET_SIGNALS_TO_HANDLE].endswith(",SIGUSR2")
    assert launcher_env(RestartsConfig(preempt_grace_seconds=0)) == {}


def test_the_spec_rejects_a_negative_grace_and_sigusr1() -> None:
    with pytest.raises(ValueError, match=r"preempt_grace_seconds|preemptGraceSeconds"):
        RestartsConfig.model_validate({"preemptGraceSeconds": -1})
    with pytest.raises(ValueError, match=r"preempt_signal|preemptSignal"):
        RestartsConfig.model_validate({"preemptSignal": "SIGUSR1"})


def test_the_local_plan_gives_torchrun_the_grace(tmp_path: Path) -> None:
    from orchestrator.backends.base import SubmitOptions
    from orchestrator.backends.local_plan import create_local_plan

    spec = load_spec(REPO / "examples" / "digits-ddp.yaml", ["spec.restarts.preemptGraceSeconds=60"])
    plan = create_local_plan(spec, SubmitOptions(), tmp_path / "r", resume=False)
    assert plan.env[Env.ELASTIC_SHUTDOWN_TIMEOUT] == "65"


# -- summary.json of a preempted run ----------------------------------------------------------------
def _write(run_dir: Path, *lines: tuple[float, int, Any]) -> None:
    fd = open_append(RunFiles(run_dir).events)
    try:
        for t, rank, payload in lines:
            append_jsonl(
                fd, {"time": t, "rank": rank, "generation": 0, "event": payload.kind, **payload_fields(payload)}
            )
    finally:
        os.close(fd)


def _preempted(step: int, committed: bool = True) -> Preempted:
    reason = "saved" if committed else "deadline"
    return Preempted(step=step, committed=committed, reason=reason, signal="SIGTERM", grace_s=30.0, since_signal_s=1.0)


def test_a_run_that_ended_preempted_is_summarised_as_preempted(tmp_path: Path) -> None:
    _write(
        tmp_path,
        (1.0, 0, Start(pid=1, world_size=2, node_rank=0, local_rank=0)),
        (1.0, 1, Start(pid=2, world_size=2, node_rank=0, local_rank=1)),
        (5.0, 1, _preempted(37)),
        (5.1, 0, _preempted(37)),
    )
    summary = build_summary(tmp_path, status=RunState.FAILED.value, wall_s=6.0, stores=[])
    assert summary.status == RunState.PREEMPTED.value and summary.steps == 37
    assert summary.preempted is not None and summary.preempted["rank"] == 0 and summary.preempted["committed"]
    assert summary.reason is not None and "committed" in summary.reason
    assert summary.to_dict()["preempted"]["step"] == 37
    assert RunState.PREEMPTED.terminal and RunState.PREEMPTED.exit_code == 13


def test_a_ray_cancel_stays_a_cancel_though_its_shutdown_made_the_workers_save(tmp_path: Path) -> None:
    # Ray: `torchrig cancel` shuts the run's Ray down, which SIGTERMs the workers; they may write their
    # emergency checkpoint's `preempted` events before the summary is built. The user asked for a cancel.
    _write(tmp_path, (1.0, 0, Start(pid=1, world_size=1, node_rank=0, local_rank=0)), (5.0, 0, _preempted(60)))
    cancelled = RunState.CANCELLED.value
    ray = build_summary(
        tmp_path, status=cancelled, wall_s=6.0, stores=[], reason="cancelled by the user", cancel_wins=True
    )
    assert (ray.status, ray.reason) == (cancelled, "cancelled by the user")
    # Locally a first Ctrl-C is a graceful stop on purpose: the run ends preempted (resumable).
    local = build_summary(tmp_path, status=cancelled, wall_s=6.0, stores=[], reason="cancelled by the user")
    assert local.status == RunState.PREEMPTED.value


def test_a_preemption_the_job_went_on_after_is_not_how_it_ended(tmp_path: Path) -> None:
    _write(
        tmp_path,
        (1.0, 0, Start(pid=1, world_size=2, node_rank=0, local_rank=0)),
        (5.0, 0, _preempted(37, committed=False)),
        (9.0, 0, Start(pid=3, world_size=1, node_rank=0, local_rank=0)),
    )
    assert preemption_of(read_events(RunFiles(tmp_path).events)) is None
    summary = build_summary(tmp_path, status=RunState.FAILED.value, wall_s=6.0, stores=[])
    assert summary.status == RunState.FAILED.value and summary.preempted is None


def test_validate_warns_when_the_last_save_outlasts_the_grace(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from orchestrator.cli import cli
    from training.contract.events import CheckpointCommitted

    _write(tmp_path, (1.0, 0, CheckpointCommitted(step=50, blocked_s=0.1, save_s=45.2)))
    job = str(REPO / "examples" / "digits-ddp.yaml")
    slow = CliRunner().invoke(cli, ["validate", job, "--run-dir", str(tmp_path)])
    assert slow.exit_code == 0 and "preemptGraceSeconds: 30 s is shorter" in slow.output, slow.output
    assert "step 50: 45.2 s" in slow.output
    fine = CliRunner().invoke(
        cli, ["validate", job, "--run-dir", str(tmp_path), "--set", "spec.restarts.preemptGraceSeconds=60"]
    )
    assert fine.exit_code == 0 and "preemptGraceSeconds" not in fine.output
    assert "preemptGraceSeconds" not in CliRunner().invoke(cli, ["validate", job]).output


def _pod_specs(obj: Any) -> list[dict[str, Any]]:
    """Every pod spec (a dict holding `containers`) anywhere in a compiled object."""
    found: list[dict[str, Any]] = []
    if isinstance(obj, dict):
        if "containers" in obj:
            found.append(obj)
        for value in obj.values():
            found += _pod_specs(value)
    elif isinstance(obj, list):
        for value in obj:
            found += _pod_specs(value)
    return found


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob", "rayjob"])
def test_worker_pods_get_the_grace_period_and_torchrun_its_timeout(target: str) -> None:
    from orchestrator.compile import compile as compile_job
    from orchestrator.compile import compile_plan
    from orchestrator.compile.rayjob import SUBMITTER_CONTAINER

    spec = load_spec(REPO / "examples" / "digits-ddp.yaml", ["spec.restarts.preemptGraceSeconds=90"])
    objects = compile_job(spec, target, fixed_size=True)
    pods = [pod for obj in objects for pod in _pod_specs(obj)]
    # Worker pods: not a TrainJob's own pod patch (env and mounts only: its runtime holds the pod), not the
    # Ray head, not the RayJob's submitter (it runs `ray job submit`, no training).
    not_workers = ("ray-head", SUBMITTER_CONTAINER)
    workers = [p for p in pods if any("image" in c and c["name"] not in not_workers for c in p["containers"])]
    assert workers and all(p["terminationGracePeriodSeconds"] == 100 for p in workers)
    # A TrainJob's worker env is `spec.trainer.env` (Trainer refuses env in a runtime patch).
    trainer_env = [e for obj in objects if obj["kind"] == "TrainJob" for e in obj["spec"]["trainer"].get("env", [])]
    env = {e["name"]: e["value"] for p in pods for c in p["containers"] for e in c.get("env", []) if "value" in e}
    env.update({e["name"]: e["value"] for e in trainer_env if "value" in e})
    assert env[Env.ELASTIC_SHUTDOWN_TIMEOUT] == "95"
    assert compile_plan(spec, "torchrun").env[Env.ELASTIC_SHUTDOWN_TIMEOUT] == "95"
    off = load_spec(REPO / "examples" / "digits-ddp.yaml", ["spec.restarts.preemptGraceSeconds=0"])
    pods = [pod for obj in compile_job(off, target, fixed_size=True) for pod in _pod_specs(obj)]
    assert all("terminationGracePeriodSeconds" not in p for p in pods)


def test_the_bench_report_has_the_preempt_table() -> None:
    from bench.report import markdown
    from bench.sections import SECTIONS

    assert "preempt" in SECTIONS
    row = {"sigterm_to_commit_s": 0.7, "sync_save_s": 1.0, "torch_save_s": 0.7, "ratio_vs_sync_save": 0.7}
    results = {"timestamp": "t", "machine": {"cpus": 2}, "preempt": {"50MB": {**row, "grace_headroom": 42.9}}}
    assert "| 50MB | 0.700 s | 1.000 s | 0.700 s | 0.70 | 42.9x |" in markdown(results)


def test_a_schedulers_drain_notice_stops_the_group_like_sigterm_within_its_deadline() -> None:
    events, done = _Events(), _Exit()
    handler = PreemptionHandler(30.0, events, exit=done)
    calls: list[int] = []
    answers = iter([None, 4.0])

    def notice() -> float | None:
        calls.append(handler._step)
        return next(answers)

    handler.watch_notice(notice, every_steps=5)
    # Polled only every 5th boundary (every rank at the same steps: it may be a barrier), never before.
    assert [handler.should_stop(s) for s in range(1, 10)] == [False] * 9
    assert calls == [5]
    assert handler.should_stop(10) is True and calls == [5, 10]
    assert handler.signal_name == "DRAIN" and handler.requested
    assert handler._timer is not None and handler._timer.interval == 4.0  # the notice's deadline, not 30 s
    saver = _Saver()
    with pytest.raises(PreemptedExit):
        handler.stop(10, saver, {})
    assert saver.calls == [(10, True)]
    handler.uninstall()
    assert not done.codes  # saved in time: no forced exit


def test_a_failing_notice_is_dropped_and_an_off_handler_never_polls() -> None:
    handler = PreemptionHandler(30.0, _Events(), exit=_Exit())

    def broken() -> float | None:
        raise RuntimeError("no train context")

    handler.watch_notice(broken, every_steps=1)
    assert handler.should_stop(1) is False and handler.should_stop(2) is False
    assert handler._notice is None
    off = PreemptionHandler(0.0, _Events(), exit=_Exit()).watch_notice(lambda: 1.0, every_steps=1)
    assert off.should_stop(1) is False and not off.requested
