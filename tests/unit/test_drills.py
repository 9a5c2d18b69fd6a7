"""Drill logic on synthetic run directories: history, damage, verdict arithmetic, report, plot."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends.base import RunState
from orchestrator.drills.damage import (
    CorruptionKind,
    committed_steps,
    corrupt_newest,
    make_store_unreachable,
    restore_store,
)
from orchestrator.drills.history import RunHistory
from orchestrator.drills.plan import DrillContext, DrillOptions, Outcome
from orchestrator.drills.report import DrillReport, plot_report
from orchestrator.drills.runner import _fill_from_run, _pick_fault
from orchestrator.drills.scenarios import (
    SCENARIOS,
    Hang,
    KillNode,
    KillWorker,
    LoseStoreAtRestart,
    SilentCorruption,
    Straggler,
    get_scenario,
)
from orchestrator.drills.spec_patch import isolate_stores
from orchestrator.errors import SpecError
from orchestrator.loader import load_spec
from training.contract import DrillEventKind, Summary, read_jsonl


def _write_jsonl(path: Path, records: list[dict[str, Any]], torn_tail: bool = False) -> None:
    text = "".join(json.dumps(r) + "\n" for r in records)
    if torn_tail:
        text += '{"time": 99, "ev'
    path.write_text(text)


def _ctx(**kw: Any) -> DrillContext:
    base: dict[str, Any] = {
        "scenario": "kill-worker",
        "seed": 0,
        "rng": random.Random(0),
        "steps": 40,
        "world_size": 2,
        "checkpoint_every": 10,
        "fault_step": 23,
        "fault_rank": 1,
        "nodes": 1,
    }
    base.update(kw)
    return DrillContext(**base)


def _outcome(fault_step: int = 23, fault_rank: int = 1) -> Outcome:
    return Outcome(fault_step=fault_step, fault_rank=fault_rank)


def _timeline(outcome: Outcome) -> list[dict[str, Any]]:
    return [e.to_dict() for e in outcome.timeline]


def _kill_worker_run(tmp_path: Path) -> Path:
    """A run killed at step 23 (generation 0) that resumed from step 20 and finished."""
    events = [
        {"time": 1.0, "event": "start", "rank": 0, "world_size": 2, "pid": 11, "generation": 0},
        {"time": 1.0, "event": "start", "rank": 1, "world_size": 2, "pid": 12, "generation": 0},
        {"time": 5.0, "event": "checkpoint_committed", "step": 10, "rank": 0},
        {"time": 9.0, "event": "checkpoint_committed", "step": 20, "rank": 0},
        {"time": 10.0, "event": "fault", "kind": "kill", "rank": 1, "step": 23, "generation": 0},
        {"time": 13.0, "event": "start", "rank": 0, "world_size": 2, "pid": 21, "generation": 1},
        {"time": 14.0, "event": "restore", "step": 20, "store": "local", "rank": 0, "generation": 1},
        {"time": 15.5, "event": "first_step", "step": 21, "rank": 0, "generation": 1},
    ]
    _write_jsonl(tmp_path / "events.jsonl", events, torn_tail=True)
    _write_jsonl(
        tmp_path / "metrics.jsonl",
        [
            {"time": 8.0, "step": 20, "samples_per_s": 100.0, "world_size": 2},
            {"time": 20.0, "step": 40, "world_size": 2},
        ],
    )
    return tmp_path


def test_read_jsonl_skips_a_torn_last_line(tmp_path: Path) -> None:
    run = _kill_worker_run(tmp_path)
    assert len(read_jsonl(run / "events.jsonl")) == 8
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_fill_from_run_computes_mttr_lost_steps_and_restore(tmp_path: Path) -> None:
    run = _kill_worker_run(tmp_path)
    history = RunHistory.load(run)
    report = DrillReport("kill-worker", "local", 0)
    _fill_from_run(report, Summary(status="succeeded", final_loss=0.1, params_sha256="ab"), history, _outcome())
    assert report.fault_step == 23
    assert report.resumed_from_step == 20
    assert report.lost_steps == 3
    assert report.mttr_seconds == pytest.approx(5.5)
    assert report.restored_from == [{"store": "local", "step": 20, "source": "store"}]
    assert report.recovered is True


def test_kill_worker_verdict_requires_newest_checkpoint_and_equal_params(tmp_path: Path) -> None:
    run = _kill_worker_run(tmp_path)
    history = RunHistory.load(run)
    ctx, outcome = _ctx(), _outcome()
    report = DrillReport("kill-worker", "local", 0)
    _fill_from_run(report, Summary(status="succeeded", params_sha256="ab"), history, outcome)
    report.events = _timeline(outcome)
    report.reference_params_sha256 = "ab"
    report.final_params_match_reference = True
    report.add(KillWorker().judge(report, history, ctx))
    assert report.passed, report.checks

    # Resuming from an older checkpoint than the newest committed one fails the verdict.
    stale = DrillReport("kill-worker", "local", 0)
    _fill_from_run(stale, Summary(status="succeeded"), history, outcome)
    stale.events = _timeline(outcome)
    stale.resumed_from_step = 10
    stale.add(KillWorker().judge(stale, history, ctx))
    assert not stale.passed
    assert any("newest checkpoint" in c.name and not c.passed for c in stale.checks)


def test_params_mismatch_fails_the_verdict(tmp_path: Path) -> None:
    history = RunHistory.load(_kill_worker_run(tmp_path))
    outcome = _outcome()
    report = DrillReport("kill-worker", "local", 0)
    _fill_from_run(report, Summary(status="succeeded", params_sha256="ab"), history, outcome)
    report.events = _timeline(outcome)
    report.reference_params_sha256 = "cd"
    report.final_params_match_reference = False
    report.add(KillWorker().judge(report, history, _ctx()))
    assert not report.passed


def test_straggler_is_identified_from_compute_time(tmp_path: Path) -> None:
    # Whole-step times are equal (ranks wait for each other); compute = step - comm tells them apart.
    events = []
    for i in range(5):
        events.append({"time": i, "event": "step_times", "rank": 0, "step_s": 0.30, "comm_s": 0.25})
        events.append({"time": i, "event": "step_times", "rank": 1, "step_s": 0.30, "comm_s": 0.01})
        events.append({"time": i, "event": "step_times", "rank": 2, "step_s": 0.30, "comm_s": 0.24})
    _write_jsonl(tmp_path / "events.jsonl", events)
    history = RunHistory.load(tmp_path)
    assert history.slowest_rank() == 1


def _straggler_events(slow_ranks: list[int]) -> list[dict[str, object]]:
    events: list[dict[str, object]] = [
        {"time": 0.5, "event": "fault", "rank": 1, "kind": "slow_backward", "step": 1, "seconds": 0.05}
    ]
    for i, slow in enumerate(slow_ranks):
        events.append(
            {
                "time": 2.0 + i,
                "event": "straggler",
                "rank": 0,
                "step": 10 * (i + 1),
                "slow_rank": slow,
                "slowdown_ratio": 3.0 if slow >= 0 else 1.0,
            }
        )
    return events


@pytest.mark.parametrize(
    ("slow_ranks", "fault_rank", "passes"),
    [([1], 1, True), ([-1, 1], 1, True), ([1], 2, False), ([1, -1], 1, False), ([], 1, False), ([0], 1, False)],
)
def test_straggler_verdict_reads_the_online_detector(
    tmp_path: Path, slow_ranks: list[int], fault_rank: int, passes: bool
) -> None:
    """The verdict is the online detector's: a `straggler` event naming the injected rank, still named at the end."""
    _write_jsonl(tmp_path / "events.jsonl", _straggler_events(slow_ranks))
    history = RunHistory.load(tmp_path)
    report = DrillReport("straggler", "local", 0, status="succeeded")
    report.add(Straggler().judge(report, history, _ctx(fault_rank=fault_rank)))
    check = next(c for c in report.checks if c.name == "online detector named the slow rank")
    assert check.passed is passes
    if passes and slow_ranks[0] == fault_rank:
        assert any(n.startswith("detected 1.5 s after the slowdown began, at step 10") for n in report.notes)


def test_no_straggler_when_ranks_are_even(tmp_path: Path) -> None:
    events = [
        {"time": i, "event": "step_times", "rank": r, "step_s": 0.3, "comm_s": 0.1} for i in range(3) for r in (0, 1)
    ]
    _write_jsonl(tmp_path / "events.jsonl", events)
    assert RunHistory.load(tmp_path).slowest_rank() is None


def test_kill_node_verdict_needs_shrink_and_regrow(tmp_path: Path) -> None:
    ctx = _ctx(scenario="kill-node", nodes=2, world_size=4)
    history = RunHistory.load(tmp_path)
    ok = DrillReport("kill-node", "local", 0, status="succeeded", world_sizes=[4, 2, 4], resumed_from_step=20)
    ok.add(KillNode().judge(ok, history, ctx))
    assert all(c.passed for c in ok.checks if "world" in c.name)
    never_grew = DrillReport("kill-node", "local", 0, status="succeeded", world_sizes=[4, 2], resumed_from_step=20)
    never_grew.events = [{"event": "node_added", "time": 10.0}, {"event": "finished", "time": 80.0}]
    never_grew.add(KillNode().judge(never_grew, history, ctx))
    assert not never_grew.passed and never_grew.inconclusive is None, "60 s at the smaller size: it failed to grow"
    # The job ended 2 s after the node came back (or before it could): the drill proved nothing either way.
    for events in (
        [{"event": "node_added", "time": 39.2}, {"event": "finished", "time": 41.3}],
        [{"event": "finished", "time": 5.0}],
    ):
        short = DrillReport("kill-node", "local", 0, status="succeeded", world_sizes=[4, 2], resumed_from_step=20)
        short.events = events
        short.add(KillNode().judge(short, history, ctx))
        assert short.verdict == "inconclusive" and not short.passed and "more steps" in str(short.inconclusive)


def _committed_store(root: Path, steps: list[int]) -> Path:
    for step in steps:
        d = root / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
        (d / ".metadata").write_bytes(b"meta")
        (d / "manifest.json").write_text("{}")
    (root / "step-00000099").mkdir()  # uncommitted: no manifest
    return root


@pytest.mark.parametrize("kind", list(CorruptionKind))
def test_corrupt_newest_damages_only_the_newest_committed(tmp_path: Path, kind: CorruptionKind) -> None:
    store = _committed_store(tmp_path / "store", [10, 20])
    assert committed_steps(f"file://{store}") == [10, 20]
    original = (store / "step-00000010" / "__0_0.distcp").read_bytes()
    damage = corrupt_newest(f"file://{store}", kind)
    assert damage.step == 20
    newest = store / "step-00000020"
    shard = newest / "__0_0.distcp"
    if kind is CorruptionKind.flip:
        assert shard.read_bytes() != original and len(shard.read_bytes()) == len(original)
    elif kind is CorruptionKind.truncate:
        assert len(shard.read_bytes()) == len(original) // 2
    elif kind is CorruptionKind.delete_file:
        assert not shard.exists()
    else:
        assert not (newest / "manifest.json").exists()
    assert (store / "step-00000010" / "__0_0.distcp").read_bytes() == original, "older checkpoint untouched"


def test_corrupt_newest_needs_a_committed_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        corrupt_newest(f"file://{tmp_path / 'empty'}", CorruptionKind.flip)


def test_unreachable_store_defeats_root_and_is_restored(tmp_path: Path) -> None:
    store = _committed_store(tmp_path / "store", [10])
    aside = make_store_unreachable(str(store))
    assert store.is_file()
    with pytest.raises(OSError):
        (store / "step-00000020").mkdir(parents=True)  # even root cannot write below a file
    restore_store(str(store), aside)
    assert (store / "step-00000010" / "manifest.json").exists()


def test_scenario_registry_and_unknown_name() -> None:
    assert set(SCENARIOS) == {
        "kill-worker",
        "kill-node",
        "crash-during-checkpoint",
        "corrupt-checkpoint",
        "lose-store",
        "lose-store-at-restart",
        "hang",
        "straggler",
        "partition",
        "preempt",
        "preempt-short-grace",
        "sdc",
    }
    with pytest.raises(SpecError, match="valid drills: kill-worker"):
        get_scenario("explode")


def test_fault_choice_is_seeded_and_bounded(examples_dir: Path) -> None:
    spec = load_spec(examples_dir / "digits-ddp.yaml", ["spec.training.steps=60", "spec.checkpoint.every.steps=10"])
    picks = {_pick_fault(spec, DrillOptions(seed=s), random.Random(s))[:2] for s in range(20)}
    assert len(picks) > 3, "different seeds hit different steps/ranks"
    for step, rank in picks:
        assert 12 <= step <= 58 and 0 <= rank < 4
    assert _pick_fault(spec, DrillOptions(seed=3), random.Random(3)) == _pick_fault(
        spec, DrillOptions(seed=3), random.Random(3)
    )
    # kill-node must leave time to lose the node, restart smaller and grow back: drawn early.
    early = [_pick_fault(spec, DrillOptions(seed=s), random.Random(s), KillNode.latest_fault)[0] for s in range(30)]
    assert all(12 <= step <= int(60 * KillNode.latest_fault) for step in early), early
    assert len(set(early)) > 3
    assert get_scenario("preempt").latest_fault < 1 and get_scenario("preempt-short-grace").latest_fault < 1
    with pytest.raises(SpecError, match="--at-step"):
        _pick_fault(spec, DrillOptions(at_step=60), random.Random(0))
    with pytest.raises(SpecError, match="--rank"):
        _pick_fault(spec, DrillOptions(rank=9), random.Random(0))


def test_isolate_stores_never_touches_real_checkpoints(examples_dir: Path) -> None:
    spec = load_spec(
        examples_dir / "digits-ddp.yaml",
        [
            'spec.checkpoint.stores=[{"uri": "file:///mnt/checkpoints", "name": "pvc", "pvc": "claim"}, '
            '{"uri": "s3://bucket/prefix", "name": "s3"}, {"uri": "file://./checkpoints", "name": "local"}]'
        ],
    )
    out = isolate_stores(spec, "t1", "run").spec.checkpoint.stores
    uris = [s.uri for s in out]
    assert uris == ["file://./stores/pvc", "s3://bucket/prefix/torchrig-drill-t1/run/s3", "file://./checkpoints"]
    assert out[0].pvc is None


def test_report_json_and_plot(tmp_path: Path) -> None:
    run = _kill_worker_run(tmp_path)
    history = RunHistory.load(run)
    outcome = _outcome()
    report = DrillReport("kill-worker", "local", 7)
    _fill_from_run(report, Summary(status="succeeded"), history, outcome)
    report.events = _timeline(outcome)
    report.check("job succeeded", True, "ok")
    out = tmp_path / "report.json"
    report.write(out)
    data = json.loads(out.read_text())
    for key in (
        "scenario",
        "backend",
        "seed",
        "recovered",
        "fault_step",
        "resumed_from_step",
        "lost_steps",
        "mttr_seconds",
        "restored_from",
        "final_params_match_reference",
        "final_loss",
        "reference_final_loss",
        "events",
    ):
        assert key in data
    assert data["verdict"] == "pass" and data["seed"] == 7
    png = tmp_path / "drill.png"
    plot_report(report, history, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_outside_faults_report_the_step_actually_reached(tmp_path: Path) -> None:
    """A drill that kills from outside (corrupt-checkpoint) strikes later than planned: the report must use
    the step the job had reached, or a correct resume from a later checkpoint looks like a failure."""
    events = [
        {"time": 1.0, "event": "start", "rank": 0, "world_size": 2, "pid": 11, "generation": 0},
        {"time": 4.0, "event": "checkpoint_committed", "step": 15, "rank": 0},
        {"time": 8.0, "event": "start", "rank": 0, "world_size": 2, "pid": 21, "generation": 1},
        {"time": 9.0, "event": "restore", "step": 15, "store": "drill-b", "rank": 0, "generation": 1},
        {"time": 9.5, "event": "first_step", "step": 16, "rank": 0, "generation": 1},
    ]
    _write_jsonl(tmp_path / "events.jsonl", events)
    ctx = _ctx(scenario="corrupt-checkpoint", fault_step=12)  # planned
    outcome = _outcome(fault_step=17)  # reached when the drill struck (the actions record it)
    outcome.record(DrillEventKind.FAULT_INJECTED, at=5.0, kind="kill", rank=1, step=17)
    report = DrillReport("corrupt-checkpoint", "local", 0)
    history = RunHistory.load(tmp_path)
    _fill_from_run(report, Summary(status="succeeded"), history, outcome)
    report.events = _timeline(outcome)
    assert report.fault_step == 17 and report.resumed_from_step == 15 and report.lost_steps == 2
    report.add(KillWorker().judge(report, history, ctx))
    assert all(c.passed for c in report.checks), report.checks


def test_hang_verdict_needs_every_rank_dumped_and_the_hung_rank_apart(tmp_path: Path) -> None:
    """The hang drill reads the forensics: a stack file from every rank, and they single out the hung rank."""
    from tests.integration.test_stacks import HUNG, IN_ALLREDUCE
    from training.contract import RunFiles

    files = RunFiles(tmp_path)
    files.stacks_dir(0).mkdir(parents=True)
    files.stack_file(0, 0).write_text(IN_ALLREDUCE)
    files.stack_file(0, 1).write_text(HUNG)
    events = [{"time": 5.0, "event": "watchdog", "rank": r, "generation": 0, "step": 3} for r in (0, 1)]
    events += [
        {"time": 4.0, "event": "stacks", "rank": r, "generation": 0, "path": str(files.stack_file(0, r))}
        for r in (0, 1)
    ]
    _write_jsonl(tmp_path / "events.jsonl", events)
    history = RunHistory.load(tmp_path)

    def checks(fault_rank: int) -> dict[str, bool]:
        report = DrillReport("hang", "local", 0, status="succeeded", world_sizes=[2])
        report.add(Hang().judge(report, history, _ctx(scenario="hang", fault_rank=fault_rank)))
        return {c.name: c.passed for c in report.checks}

    right = checks(1)
    assert right["watchdog fired"] and right["every rank dumped its stacks"] and right["stacks name the hung rank"]
    assert not checks(0)["stacks name the hung rank"]
    files.stack_file(0, 0).unlink()
    _write_jsonl(tmp_path / "events.jsonl", [e for e in events if not (e["event"] == "stacks" and e["rank"] == 0)])
    history = RunHistory.load(tmp_path)
    assert not checks(1)["every rank dumped its stacks"]


def test_crash_during_checkpoint_restarts_the_group_and_must_strike_an_in_flight_save(examples_dir: Path) -> None:
    spec = load_spec(examples_dir / "digits-ddp.yaml")
    scenario = get_scenario("crash-during-checkpoint")
    ctx = _ctx(scenario=scenario.name, steps=300, checkpoint_every=50, fault_step=262)
    plan = scenario.plan(spec, ctx)
    # In place nothing would be restored: the drill makes the group restart to test the half-written save.
    assert plan.spec.spec.restarts.mode == "restart"
    assert plan.faults[0].kind == "kill_during_checkpoint" and plan.faults[0].step == 250

    def verdict(struck: int) -> dict[str, bool]:
        report = DrillReport(scenario=scenario.name, backend="local", seed=0, status="succeeded")
        report.fault_step, report.resumed_from_step = struck, 200
        history = RunHistory(run_dir=Path("."), events=[], metrics=[])
        return {c.name: c.passed for c in scenario.judge(report, history, ctx).checks}

    name = "the kill struck a save in flight (not the final one)"
    assert verdict(250)[name] and not verdict(300)[name]


def test_partition_bounds_the_checkpoint_io_limit(examples_dir: Path) -> None:
    spec = load_spec(examples_dir / "digits-ddp.yaml")
    scenario = get_scenario("partition")
    plan = scenario.plan(spec, _ctx(scenario=scenario.name, steps=300, checkpoint_every=50, nodes=2, world_size=4))
    restarts, checkpoint = plan.spec.spec.restarts, plan.spec.spec.checkpoint
    assert restarts.step_timeout_seconds == 10
    assert checkpoint.io_timeout_seconds == 30, "a cut during a save must not hold the job for 30 minutes"


def test_short_grace_verdict_accepts_a_periodic_checkpoint_of_the_stop_step_but_nothing_newer() -> None:
    """The deadline can strike just after a periodic save of the same step committed (seen under load:
    stopped at 15, periodic checkpoint 15): restoring that committed checkpoint is right; restoring an
    older one than the newest committed, or an emergency save that claims to have committed, is not."""
    from training.contract import Event

    scenario = get_scenario("preempt-short-grace")

    def verdict(
        resumed: int, *, committed: bool = False, newest: int = 15, stored: list[int] | None = None
    ) -> dict[str, bool]:
        events = [
            {"time": 1.0, "rank": 0, "generation": 0, "event": "checkpoint_committed", "step": 10},
            {"time": 2.0, "rank": 0, "generation": 0, "event": "checkpoint_committed", "step": newest},
            {
                "time": 2.1,
                "rank": 0,
                "generation": 0,
                "event": "preempted",
                "step": 15,
                "committed": committed,
                "reason": "deadline",
            },
            {"time": 5.0, "rank": 0, "generation": 0, "event": "restore", "step": resumed, "store": "local"},
        ]
        history = RunHistory(run_dir=Path("."), events=[Event.from_dict(e) for e in events], metrics=[])
        report = DrillReport(scenario=scenario.name, backend="local", seed=0, status="succeeded")
        report.resumed_from_step = resumed
        if stored is not None:  # what the stores held when the drill resubmitted the job
            report.events = [{"time": 4.0, "event": "resubmitted", "committed": {"local": stored}}]
        ctx = _ctx(scenario=scenario.name, checkpoint_every=5, fault_step=12)
        return {c.name: c.passed for c in scenario.judge(report, history, ctx).checks}

    restored = "nothing partial restored: resumed from the previous checkpoint"
    uncommitted = "the deadline ended the emergency checkpoint uncommitted"
    assert all(verdict(15).values())
    assert not verdict(10)[restored]  # an older checkpoint than the newest committed one
    assert verdict(10, newest=10)[restored]
    assert not verdict(15, committed=True)[uncommitted]
    # CI: the deadline's os._exit ended the process between step 15's commit and its event. The stores
    # held 15; the events said 10; restoring 15 is right, and 10 would have lost a committed checkpoint.
    assert verdict(15, newest=10, stored=[5, 10, 15])[restored]
    assert not verdict(10, newest=10, stored=[5, 10, 15])[restored]
    # A restore of a step no store held a manifest for at the resubmit (nor newer than the stop step).
    assert not verdict(15, newest=10, stored=[5, 10])[restored]
    assert not verdict(20, newest=10, stored=[5, 10, 20])[restored]


# -- a fault that strikes a finished job: inconclusive ---------------------------------------------------
def _finished_at(run_dir: Path, step: int) -> Path:
    """A run directory whose rank 0 has logged `step` (the drill reads the job's progress there)."""
    _write_jsonl(run_dir / "events.jsonl", [{"time": 1.0, "event": "start", "rank": 0, "world_size": 4, "pid": 1}])
    _write_jsonl(run_dir / "metrics.jsonl", [{"time": 2.0, "step": step, "world_size": 4}])
    return run_dir


@pytest.mark.parametrize(
    ("step", "state", "too_late"),
    [
        (60, RunState.RUNNING, True),  # every step done, the agent not yet noticed: the poll came too late
        (55, RunState.SUCCEEDED, True),  # the run already ended well (its last records not read yet)
        (30, RunState.RUNNING, False),  # work left: a real fault
        (30, RunState.FAILED, False),  # ended badly before the fault: the checks fail it, not "unproven"
    ],
)
def test_a_strike_after_the_job_finished_is_recorded_as_too_late(
    tmp_path: Path, step: int, state: RunState, too_late: bool
) -> None:
    from orchestrator.drills.actions import ActionRunner
    from orchestrator.drills.plan import AwaitStep, NodeKill
    from tests.unit.test_drill_plans import FakeRun

    spec = load_spec(Path(__file__).parents[2] / "examples" / "digits-ddp.yaml", ["spec.training.steps=60"])
    run = FakeRun(_finished_at(tmp_path, step), state=state)
    runner = ActionRunner(run, spec, _outcome(fault_step=48), timeout_s=2.0)
    runner.run_all([AwaitStep(48), NodeKill(1)])
    assert run.calls == [("kill_node", 1)], "the fault is still carried out (and recorded)"
    assert runner.outcome.fault_step == step
    if too_late:
        assert runner.outcome.too_late == (
            f"the job finished before the fault: step {step} of 60; run it with more steps "
            "(--set spec.training.steps=...) or an earlier --at-step"
        )
    else:
        assert runner.outcome.too_late is None


def test_an_inconclusive_report_neither_passes_nor_fails() -> None:
    report = DrillReport("preempt-short-grace", "local", 0)
    report.check("job succeeded", True, "status succeeded")
    assert (report.passed, report.verdict, report.exit_code) == (True, "pass", 0)
    report.check("the deadline ended the emergency checkpoint uncommitted", False, "none")
    assert (report.passed, report.verdict, report.exit_code) == (False, "fail", 1)

    report.inconclusive = "the job finished before the fault: step 60 of 60"
    assert (report.passed, report.verdict, report.exit_code) == (False, "inconclusive", 6)
    data = report.to_dict()
    assert data["verdict"] == "inconclusive" and data["inconclusive"] == report.inconclusive
    assert [c["passed"] for c in data["checks"]] == [True, False], "the checks stay for people to read"
    passing = DrillReport("kill-node", "local", 0, inconclusive="too late")
    passing.check("job succeeded", True, "ok")
    assert not passing.passed and passing.verdict == "inconclusive", "passing checks prove nothing then"

    from rich.console import Console

    from orchestrator.drills.report import render_table

    console = Console(record=True, width=200)
    console.print(render_table(report))
    title = " ".join(console.export_text().split())  # the title wraps at the table's width
    assert "(seed 0): INCONCLUSIVE (the job finished before the fault: step 60 of 60)" in title


def test_torchrig_drill_exits_6_when_inconclusive(examples_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    import orchestrator.drills
    from orchestrator.cli import cli
    from orchestrator.errors import EXIT_INCONCLUSIVE

    def too_late(scenario: str, spec: Any, options: DrillOptions) -> DrillReport:
        report = DrillReport(scenario, options.backend, options.seed, inconclusive="the job finished before the fault")
        report.check("job succeeded", True, "status succeeded")
        return report

    monkeypatch.setattr(orchestrator.drills, "run_drill", too_late)
    job = str(examples_dir / "digits-ddp.yaml")
    text = CliRunner().invoke(cli, ["drill", "kill-node", job, "--no-reference"])
    assert text.exit_code == EXIT_INCONCLUSIVE == 6, text.output
    assert "INCONCLUSIVE" in text.output
    as_json = CliRunner().invoke(cli, ["drill", "kill-node", job, "--no-reference", "--output", "json"])
    assert as_json.exit_code == 6 and json.loads(as_json.stdout)["verdict"] == "inconclusive"
    assert "6 inconclusive" in CliRunner().invoke(cli, ["drill", "--help"]).output


def test_a_node_fault_is_reported_as_a_node_and_a_rank_fault_as_a_rank() -> None:
    from rich.console import Console

    from orchestrator.drills.report import fault_text, render_table

    node = DrillReport("kill-node", "local", 0, fault_step=30, fault_node=1)
    rank = DrillReport("kill-worker", "local", 0, fault_step=23, fault_rank=1)
    assert fault_text(node.to_dict()) == "step 30, node 1"
    assert fault_text(rank.to_dict()) == "step 23, rank 1"
    everyone = DrillReport("preempt", "local", 0, fault_step=40)  # a preemption of the whole job
    assert fault_text(everyone.to_dict()) == "step 40, every process"
    console = Console(record=True, width=200)
    console.print(render_table(node))
    assert "step 30, node 1" in console.export_text()


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["kill-worker", "--repeat", "0"], "--repeat"),
        (["kill-worker", "--timeout", "0"], "--timeout"),
        (["hang", "--hang-timeout", "-1"], "--hang-timeout"),
        (["kill-node", "--nodes", "0"], "--nodes"),
        (["campaign", "--timeout", "-5"], "--timeout"),
        (["campaign", "--hang-timeout", "0"], "--hang-timeout"),
    ],
)
def test_a_drill_option_out_of_range_is_refused_before_anything_runs(
    examples_dir: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], option: str
) -> None:
    """`--repeat 0` used to run the whole drill (and a reference) with no kill at all; a zero timeout
    would count every run as stuck. Exit 2 and the option's name, and no run is started."""
    from click.testing import CliRunner

    import orchestrator.drills
    from orchestrator.cli import cli

    def never(*_: Any, **__: Any) -> Any:
        raise AssertionError("a drill started")

    monkeypatch.setattr(orchestrator.drills, "run_drill", never)
    job = str(examples_dir / "digits-ddp.yaml")
    done = CliRunner().invoke(cli, ["drill", args[0], job, *args[1:]])
    assert done.exit_code == 2, done.output
    assert f"Invalid value for '{option}'" in done.output


def test_a_drill_refused_for_its_spec_or_an_occupied_drill_dir_writes_nothing(
    examples_dir: Path, tmp_path: Path
) -> None:
    """A spec the backend cannot run left an empty drill directory behind, and the next drill into it
    (the spec fixed) failed with a FileExistsError traceback. Both are one line, exit 2, before any file."""
    from click.testing import CliRunner

    from orchestrator.cli import cli

    job = str(examples_dir / "digits-ddp.yaml")
    fresh = tmp_path / "d9"
    gpus = ["--set", "spec.resources.gpus=2", "--drill-dir", str(fresh)]
    done = CliRunner().invoke(cli, ["drill", "kill-worker", job, *gpus])
    assert done.exit_code == 2 and "spec.resources.gpus" in done.output, done.output
    assert not fresh.exists()
    used = tmp_path / "d1"
    (used / "run").mkdir(parents=True)
    done = CliRunner().invoke(cli, ["drill", "kill-worker", job, "--drill-dir", str(used)])
    assert done.exit_code == 2, done.output
    assert f"--drill-dir: {used} holds files (an earlier drill's?)" in done.output and "Traceback" not in done.output


def test_lost_steps_count_what_the_job_still_did_between_the_strike_and_its_end(tmp_path: Path) -> None:
    """A node killed from outside at step 20 dies a moment later: rank 0 logged step 21 first. The table
    said 10 steps lost while the plot said 11 redone; a restart redoes both, and both now say 11."""
    events = [
        {"time": 1.0, "event": "start", "rank": 0, "world_size": 4, "pid": 11, "generation": 0},
        {"time": 9.0, "event": "checkpoint_committed", "step": 10, "rank": 0},
        {"time": 30.0, "event": "start", "rank": 0, "world_size": 2, "pid": 21, "generation": 1},
        {"time": 31.0, "event": "restore", "step": 10, "store": "local", "rank": 0, "generation": 1},
        {"time": 32.0, "event": "first_step", "step": 11, "rank": 0, "generation": 1},
    ]
    _write_jsonl(tmp_path / "events.jsonl", events)
    metrics = [{"time": 20.0, "step": 20, "world_size": 4}, {"time": 21.0, "step": 21, "world_size": 4}]
    _write_jsonl(tmp_path / "metrics.jsonl", metrics)
    outcome = Outcome(fault_step=20, fault_rank=None)
    outcome.record(DrillEventKind.FAULT_INJECTED, at=20.5, kind="kill-node", node=1, step=20)
    report = DrillReport("kill-node", "local", 0)
    _fill_from_run(report, Summary(status="succeeded"), RunHistory.load(tmp_path), outcome)
    assert report.recovery_path == "restart" and report.resumed_from_step == 10
    assert report.lost_steps == 11
    from orchestrator.plot import build_timeline

    tl = build_timeline(RunHistory.load(tmp_path).metrics, RunHistory.load(tmp_path).events, fault_times=[20.5])
    assert (
        sum(c.last_step - c.resumed_from for c in tl.outages if c.last_step is not None and c.resumed_from is not None)
        == 11
    )


# -- lose-store-at-restart ------------------------------------------------------------------------------
GAVE_UP = "restore: unreadable, refusing to start over"  # training.checkpoint.restore.RESTORE_GAVE_UP


def _store_outage_run(
    tmp_path: Path, *, fresh: bool = False, early_restore: bool = False, gave_up: bool = True
) -> Path:
    """Killed at step 12 (generation 0) after step 10 was committed, with the only store lost at t=10;
    the restart lists it in vain, gives up (generation 1), and generation 2 resumes from step 10 once the
    store is back (t=30). `fresh`: generation 1 started over from step 0 instead; `early_restore`: a
    restore before the store was back (from some copy the drill did not take away)."""
    tmp_path.mkdir()
    events: list[dict[str, Any]] = [
        {"time": 1.0, "event": "start", "rank": 0, "world_size": 2, "pid": 11, "generation": 0},
        {"time": 8.0, "event": "checkpoint_committed", "step": 10, "rank": 0},
        {"time": 11.0, "event": "fault", "kind": "kill", "rank": 1, "step": 12, "generation": 0},
        {"time": 14.0, "event": "start", "rank": 0, "world_size": 2, "pid": 21, "generation": 1},
    ]
    if fresh:
        events.append({"time": 15.0, "event": "first_step", "step": 1, "rank": 0, "generation": 1})
    else:
        events.append(
            {"time": 15.0, "event": "store_failure", "store": "local", "error": "list: OSError: x", "rank": 0}
        )
        if gave_up:
            events.append(
                {"time": 25.0, "event": "store_failure", "store": "local", "error": f"{GAVE_UP}: x", "rank": 0}
            )
    restore_at = 20.0 if early_restore else 33.0
    events += [
        {"time": restore_at, "event": "restore", "step": 10, "store": "local", "rank": 0, "generation": 2},
        {"time": restore_at + 1, "event": "first_step", "step": 11, "rank": 0, "generation": 2},
    ]
    _write_jsonl(tmp_path / "events.jsonl", sorted(events, key=lambda e: float(e["time"])))
    _write_jsonl(tmp_path / "metrics.jsonl", [{"time": 40.0, "step": 30, "world_size": 2}])
    return tmp_path


def _judge_outage(run: Path) -> DrillReport:
    history = RunHistory.load(run)
    outcome = _outcome(fault_step=12)
    outcome.record(DrillEventKind.FAULT_INJECTED, at=10.0, kind="lose-store", store="local", step=11)
    outcome.damage = {"store_name": "local", "back_at": 30.0}
    report = DrillReport("lose-store-at-restart", "local", 0)
    _fill_from_run(report, Summary(status="succeeded", params_sha256="ab"), history, outcome)
    report.events = _timeline(outcome)
    report.reference_params_sha256 = "ab"
    report.final_params_match_reference = True
    report.add(LoseStoreAtRestart().judge(report, history, _ctx(scenario="lose-store-at-restart", fault_step=12)))
    return report


def _failed(report: DrillReport) -> list[str]:
    return [c.name for c in report.checks if not c.passed]


def test_lose_store_at_restart_verdict(tmp_path: Path) -> None:
    report = _judge_outage(_store_outage_run(tmp_path / "ok"))
    assert report.passed, report.checks
    assert report.resumed_from_step == 10 and report.lost_steps == 2
    # A generation that started over from step 0 while the store was gone fails the verdict, even though a
    # later one restored step 10.
    fresh = _judge_outage(_store_outage_run(tmp_path / "fresh", fresh=True))
    assert "no step before the outage re-trained from zero" in _failed(fresh)
    assert "the restart found the store unreadable and stopped (retryably) instead of starting over" in _failed(fresh)
    # A restore while the store was still away restored something the drill did not mean to leave.
    early = _judge_outage(_store_outage_run(tmp_path / "early", early_restore=True))
    assert _failed(early) == ["resumed from the newest checkpoint once the store was back"]
    # The restart must have met the outage and given up on it (retryably), not merely waited it out.
    waited = _judge_outage(_store_outage_run(tmp_path / "waited", gave_up=False))
    assert _failed(waited) == [
        "the restart found the store unreadable and stopped (retryably) instead of starting over"
    ]


def test_lose_store_at_restart_gives_up_under_the_drills_marker() -> None:
    """The verdict and the drill's wait read the restore's own marker: the two must not drift apart."""
    from training.checkpoint.restore import RESTORE_GAVE_UP

    assert GAVE_UP == RESTORE_GAVE_UP


def _sdc_rollback_run(tmp_path: Path) -> Path:
    """A 3-rank run whose rank 1 flipped a bit at step 13; the check at 15 named it (a majority): it left,
    a spare took rank 1, and every member reloaded the certified step 10 in place (`inplace-rollback`)."""
    events: list[dict[str, Any]] = [
        {"time": 1.0, "event": "start", "rank": r, "world_size": 3, "pid": 10 + r, "generation": 0} for r in range(3)
    ]
    events += [
        {"time": 5.0, "event": "checkpoint_committed", "step": 10, "rank": 0, "certified": True},
        {"time": 6.0, "event": "fault", "kind": "bitflip", "rank": 1, "step": 13, "generation": 0},
        {"time": 6.5, "event": "sdc", "step": 15, "rank": 0, "suspects": [1], "decided": True},
        *(
            {"time": 7.5, "event": "restore", "step": 10, "store": "local", "rank": r, "certified": True}
            for r in range(3)
        ),
        {"time": 7.55, "event": "recovery", "path": "inplace-rollback", "step": 10, "rank": 1, "role": "spare"},
        *(
            {"time": 7.6, "event": "recovery", "path": "inplace-rollback", "step": 10, "rank": r, "role": "survivor"}
            for r in (0, 2)
        ),
        {"time": 8.0, "event": "first_step", "step": 11, "rank": 0, "generation": 0},
    ]
    _write_jsonl(tmp_path / "events.jsonl", events)
    return tmp_path


def test_an_sdc_rolled_back_in_place_is_its_own_recovery_path_and_the_verdict_wants_it(tmp_path: Path) -> None:
    history = RunHistory.load(_sdc_rollback_run(tmp_path))
    ctx = _ctx(scenario="sdc", world_size=3, fault_step=13, sdc_every=5, sdc_replicas=3, in_place=True)
    report = DrillReport("sdc", "local", 0)
    _fill_from_run(report, Summary(status="succeeded", params_sha256="ab"), history, _outcome(13, 1))
    assert report.recovery_path == "inplace-rollback" and report.resumed_from_step == 10
    assert report.mttr_seconds == pytest.approx(2.0)  # the flip (6.0) to the first step after the rollback
    report.add(SilentCorruption().judge(report, history, ctx))
    assert report.passed, report.checks

    # A standby node took the suspect's node (2 nodes x 2, rank 2 flipped): its spares hold ranks 2 and 3.
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    events = [
        {"time": 1.0, "event": "start", "rank": r, "world_size": 4, "pid": 10 + r, "generation": 0} for r in range(4)
    ]
    events += [
        {"time": 6.0, "event": "fault", "kind": "bitflip", "rank": 2, "step": 13, "generation": 0},
        {"time": 6.5, "event": "sdc", "step": 15, "rank": 0, "suspects": [2], "decided": True}
        | {"replaced_by": "standby", "excluded_node": 1, "excluded_hosts": ["n1"]},
        *({"time": 7.5, "event": "restore", "step": 10, "store": "local", "rank": r, "certified": True}
          for r in range(4)),
        *({"time": 7.55, "event": "recovery", "path": "inplace-rollback", "step": 10, "rank": r, "role": "spare"}
          for r in (2, 3)),
        *({"time": 7.6, "event": "recovery", "path": "inplace-rollback", "step": 10, "rank": r, "role": "survivor"}
          for r in (0, 1)),
        {"time": 8.0, "event": "first_step", "step": 11, "rank": 0, "generation": 0},
    ]  # fmt: skip
    _write_jsonl(swapped / "events.jsonl", events)
    node_ctx = _ctx(
        scenario="sdc", world_size=4, nodes=2, fault_step=13, fault_rank=2, sdc_every=5, sdc_replicas=4, in_place=True
    )
    history = RunHistory.load(swapped)
    taken = DrillReport("sdc", "local", 0)
    _fill_from_run(taken, Summary(status="succeeded", params_sha256="ab"), history, _outcome(13, 2))
    taken.add(SilentCorruption().judge(taken, history, node_ctx))
    assert taken.passed, taken.checks
    assert any("the standby node's spares took node 1's ranks" in c.name for c in taken.checks)
    history = RunHistory.load(_sdc_rollback_run(tmp_path))

    # The same detection with a job that recovers in place, ended by a group restart: the wrong path.
    restarted = DrillReport("sdc", "local", 0)
    _fill_from_run(restarted, Summary(status="succeeded", params_sha256="ab"), history, _outcome(13, 1))
    restarted.recovery_path = "restart"
    restarted.add(SilentCorruption().judge(restarted, history, ctx))
    assert [c.name for c in restarted.checks if not c.passed] == ["recovered by inplace-rollback"]

    # A spare that resumed after the suspect step (15) rather than the certified one (10) fails the check.
    stale = tmp_path / "stale"
    stale.mkdir()
    lines = (
        (tmp_path / "events.jsonl")
        .read_text()
        .replace('"step": 10, "rank": 1, "role": "spare"', '"step": 15, "rank": 1, "role": "spare"')
    )
    (stale / "events.jsonl").write_text(lines)
    late = DrillReport("sdc", "local", 0)
    history = RunHistory.load(stale)
    _fill_from_run(late, Summary(status="succeeded", params_sha256="ab"), history, _outcome(13, 1))
    late.add(SilentCorruption().judge(late, history, ctx))
    failed = [c.name for c in late.checks if not c.passed]
    assert failed == ["a warm spare took the suspect's rank, every survivor and spare reloaded the same certified step"]


def test_a_drill_starts_at_least_spec_nodes_min_and_refuses_fewer(examples_dir: Path, tmp_path: Path) -> None:
    """`--nodes 1` on a job of 2..2 nodes ran 2 nodes without a word (the drill) or left a rendezvous
    waiting for a node that never starts (`torchrig run`): one line naming `--nodes`, exit 2, nothing written.
    Without `--nodes` a drill starts spec.nodes.min when its scenario needs fewer."""
    from click.testing import CliRunner

    from orchestrator.cli import cli
    from orchestrator.drills.scenarios import get_scenario
    from orchestrator.loader import load_spec

    job = str(examples_dir / "digits-ddp.yaml")
    two = ["--set", "spec.nodes.min=2", "--set", "spec.nodes.max=2"]
    assert get_scenario("kill-worker").default_nodes(load_spec(job, two[1::2])) == 2
    assert get_scenario("kill-worker").default_nodes(load_spec(job, [])) == 1
    assert get_scenario("kill-node").default_nodes(load_spec(job, ["spec.nodes.max=3"])) == 2
    drill_dir = tmp_path / "d"
    done = CliRunner().invoke(cli, ["drill", "kill-worker", job, "--nodes", "1", *two, "--drill-dir", str(drill_dir)])
    assert done.exit_code == 2, done.output
    assert "--nodes: 1 is below spec.nodes.min (2)" in done.output and "Traceback" not in done.output
    assert not drill_dir.exists()


def test_a_drill_left_early_stops_the_run_it_started() -> None:
    """An error, Ctrl-C or SIGTERM (`Terminated`) inside a drill's wait stops its run before it propagates;
    the CLI turns SIGTERM into one line and exit 143."""
    import click

    from orchestrator.cli._common import Terminated, handle_errors
    from orchestrator.drills.runner import _stopped_if_left

    class Run:
        def __init__(self) -> None:
            self.stopped: list[float] = []

        def stop(self, grace_s: float = 10.0) -> None:
            self.stopped.append(grace_s)

    run = Run()
    with pytest.raises(Terminated), _stopped_if_left(run):  # type: ignore[arg-type]
        raise Terminated(15)
    assert run.stopped == [5.0]
    with _stopped_if_left(run):  # type: ignore[arg-type]
        pass
    assert run.stopped == [5.0], "a drill that ends normally leaves its run to end on its own"

    @click.command()
    @handle_errors
    def stopped() -> None:
        raise Terminated(15)

    from click.testing import CliRunner

    done = CliRunner().invoke(stopped, [])
    assert done.exit_code == 143 and done.output.strip() == "stopped by SIGTERM"


def test_an_sdc_rollback_that_also_restarted_the_group_fails_the_verdict(tmp_path: Path) -> None:
    """The rollback's events alone do not prove it stayed in place: a worker group restart on top (the
    summary's `restarts`) fails the check that says so, and the report carries the count."""
    history = RunHistory.load(_sdc_rollback_run(tmp_path))
    ctx = _ctx(scenario="sdc", world_size=3, fault_step=13, sdc_every=5, sdc_replicas=3, in_place=True)
    report = DrillReport("sdc", "local", 0)
    _fill_from_run(report, Summary(status="succeeded", params_sha256="ab", restarts=1), history, _outcome(13, 1))
    report.add(SilentCorruption().judge(report, history, ctx))
    assert report.group_restarts == 1 and report.to_dict()["group_restarts"] == 1
    failed = [(c.name, c.detail) for c in report.checks if not c.passed]
    assert failed == [("no worker group restart (the rollback stayed in place)", "1 worker group restart(s)")]
