"""Scenario policies return decisions (spec patch, faults, actions) and the action runner carries them
out on a `SupervisedRun`: both checked with a hand-written fake run over a synthetic run directory."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends.base import RunState
from orchestrator.drills.actions import ActionRunner, supervise
from orchestrator.drills.damage import CorruptionKind
from orchestrator.drills.plan import (
    AwaitCommit,
    AwaitProgress,
    AwaitStep,
    AwaitStoreFailure,
    AwaitWorldSize,
    DrillContext,
    DrillOptions,
    LinkCut,
    LinkHeal,
    NodeAdd,
    NodeKill,
    Outcome,
    RankKill,
    StoreBack,
    StoreCorrupt,
    StoreLoss,
    faults_env,
)
from orchestrator.drills.scenarios import SCENARIOS, get_scenario
from orchestrator.errors import SpecError, UnsupportedFeature
from orchestrator.loader import load_spec
from orchestrator.spec import JobSpec
from tests.fixtures.common import REPO
from training.contract import DrillEventKind, Env, Summary
from training.faults import parse_faults


def _spec(*overrides: str) -> JobSpec:
    return load_spec(REPO / "examples" / "digits-ddp.yaml", ["spec.checkpoint.every.steps=10", *overrides])


def _ctx(**kw: Any) -> DrillContext:
    base: dict[str, Any] = {
        "scenario": "test",
        "seed": 0,
        "steps": 300,
        "world_size": 4,
        "nodes": 2,
        "checkpoint_every": 10,
        "fault_step": 23,
        "fault_rank": 1,
        "rng": random.Random(0),
    }
    base.update(kw)
    return DrillContext(**base)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenarios_faults_reach_the_worker_unchanged(name: str) -> None:
    plan = get_scenario(name).plan(_spec(), _ctx())
    env = faults_env(plan.faults)
    assert parse_faults(env.get(Env.FAULTS)) == list(plan.faults)


def test_kill_worker_repeat_plans_one_kill_per_generation() -> None:
    ctx = _ctx(options=DrillOptions(repeat=3))
    plan = get_scenario("kill-worker").plan(_spec(), ctx)
    assert [f.generation for f in plan.faults] == [0, 1, 2]
    for g, fault in enumerate(plan.faults):
        assert fault.kind == "kill" and 10 * (g + 1) < fault.step < 10 * (g + 2)
    assert (plan.fault_step, plan.fault_rank) == (plan.faults[0].step, plan.faults[0].rank)
    assert plan.spec.spec.restarts.max == 3  # max(spec's 3, repeat 3)
    assert get_scenario("kill-worker").plan(_spec(), _ctx(options=DrillOptions(repeat=5))).spec.spec.restarts.max == 5
    with pytest.raises(SpecError, match="--repeat 40"):
        get_scenario("kill-worker").plan(_spec(), _ctx(options=DrillOptions(repeat=40)))


def test_crash_during_checkpoint_aims_at_the_save_before_the_fault() -> None:
    plan = get_scenario("crash-during-checkpoint").plan(_spec(), _ctx(fault_step=27))
    assert [(f.kind, f.step, f.rank) for f in plan.faults] == [("kill_during_checkpoint", 20, 1)]
    assert plan.fault_step == 20


def test_hang_and_partition_shorten_the_watchdog_only() -> None:
    for name in ("hang", "partition"):
        patched = get_scenario(name).plan(_spec(), _ctx(options=DrillOptions(hang_timeout_s=6.0))).spec
        assert patched.spec.restarts.step_timeout_seconds == 6.0
        assert patched.spec.restarts.max == 3
    long = get_scenario("hang").plan(_spec("spec.restarts.stepTimeoutSeconds=2"), _ctx()).spec
    assert long.spec.restarts.step_timeout_seconds == 2.0


def test_corrupt_checkpoint_plans_damage_then_a_kill_on_a_two_store_job() -> None:
    ctx = _ctx(options=DrillOptions(corruption=CorruptionKind.truncate))
    plan = get_scenario("corrupt-checkpoint").plan(_spec(), ctx)
    assert [s.display_name for s in plan.spec.spec.checkpoint.stores] == ["local", "drill-b"]
    assert plan.actions == (
        AwaitCommit(store=0, step=20, required=True),
        StoreCorrupt(store=0, kind=CorruptionKind.truncate),
        RankKill(rank=1),
    )
    drawn = get_scenario("corrupt-checkpoint").plan(_spec(), _ctx(rng=random.Random(5)))
    assert isinstance(drawn.actions[1], StoreCorrupt), "the damage is drawn from the seed when not given"


def test_lose_store_waits_for_a_commit_only_on_a_file_store() -> None:
    plan = get_scenario("lose-store").plan(_spec(), _ctx())
    assert plan.actions == (AwaitCommit(store=1, step=20), StoreLoss(store=1))
    s3 = _spec('spec.checkpoint.stores=[{"uri": "file://./c"}, {"uri": "s3://b/p", "name": "s3"}]')
    assert get_scenario("lose-store").plan(s3, _ctx()).actions == (StoreLoss(store=1),)


def test_lose_store_at_restart_keeps_one_store_kills_and_brings_the_store_back_after_a_give_up() -> None:
    from training.checkpoint.restore import RESTORE_GAVE_UP

    spec = _spec('spec.checkpoint.stores=[{"uri": "file://./c", "name": "c"}, {"uri": "file://./d"}]')
    plan = get_scenario("lose-store-at-restart").plan(spec, _ctx())
    ckpt, restarts = plan.spec.spec.checkpoint, plan.spec.spec.restarts
    assert [s.display_name for s in ckpt.stores] == ["c"], "the only store: nothing to fall back on"
    assert ckpt.io_timeout_seconds == 20.0 and restarts.mode == "restart" and restarts.max >= 3
    # The kill comes from outside after the store is gone (a worker's own kill at a step raced the commit).
    assert [f.kind for f in plan.faults] == ["slow"]
    assert plan.actions == (
        AwaitCommit(store=0, step=20, required=True),
        StoreLoss(store=0),
        RankKill(rank=1),
        AwaitStoreFailure(store=0, prefix=RESTORE_GAVE_UP),
        StoreBack(store=0),
    )


def test_a_lost_store_comes_back_after_the_restore_gave_up_on_it(tmp_path: Path) -> None:
    _committed(tmp_path / "a", 10)
    run = FakeRun(tmp_path)
    runner = _runner(tmp_path, run, "file://./a")
    _append(tmp_path, {"time": 1.0, "event": "store_failure", "store": "a", "error": "gave up: before the fault"})
    runner.run_all([StoreLoss(0)])
    assert (tmp_path / "a").is_file()
    # Not yet: the only store_failure that matches came before the store was lost.
    runner.timeout_s = 0.3
    runner.run_all([AwaitStoreFailure(0, "gave up")])
    assert (tmp_path / "a").is_file()
    _append(tmp_path, {"time": 4e9, "event": "store_failure", "store": "a", "error": "gave up: s0"})
    runner.run_all([AwaitStoreFailure(0, "gave up"), StoreBack(0)])
    assert (tmp_path / "a" / "step-00000010" / "manifest.json").exists()
    assert runner.outcome.damage is not None and runner.outcome.damage["back_at"] > 0
    back: list[str] = []
    remote = _runner(tmp_path, FakeRun(tmp_path), "s3://bucket/p", store_back_hook=back.append)
    remote.run_all([StoreBack(0)])
    assert back == ["bucket_p"]
    with pytest.raises(UnsupportedFeature, match="pass a hook"):
        _runner(tmp_path, FakeRun(tmp_path), "s3://bucket/p").run_all([StoreBack(0)])


def test_node_scenarios_pace_the_job_and_plan_kill_then_rejoin() -> None:
    kill = get_scenario("kill-node").plan(_spec(), _ctx())
    assert [(f.kind, f.rank, f.generation) for f in kill.faults] == [("slow", -1, -1)]
    assert kill.actions == (AwaitStep(23), NodeKill(1), AwaitWorldSize(2), AwaitProgress(5), NodeAdd())
    assert not kill.network
    part = get_scenario("partition").plan(_spec(), _ctx())
    assert part.network
    assert part.actions == (
        AwaitStep(23),
        LinkCut(1),
        AwaitWorldSize(2),
        NodeKill(1, fault=False),
        LinkHeal(1),
        AwaitProgress(5),
        NodeAdd(),
    )
    unpaced = get_scenario("kill-node").plan(_spec(), _ctx(options=DrillOptions(pace_s=0)))
    assert unpaced.faults == ()


# -- the action runner --------------------------------------------------------------------------------
class FakeRun:
    """A run whose progress the test writes into its run directory; records what was done to it."""

    def __init__(self, run_dir: Path, state: RunState = RunState.RUNNING) -> None:
        self._run_dir = run_dir
        self.state = state
        self.calls: list[tuple[str, int]] = []

    @property
    def run_dir(self) -> Path:
        return self._run_dir

    def poll(self) -> RunState:
        return self.state

    def wait(self, timeout_s: float | None = None) -> Summary:
        self.state = RunState.SUCCEEDED
        return Summary(status="succeeded")

    def kill_node(self, node: int) -> list[int]:
        self.calls.append(("kill_node", node))
        # The survivors restart smaller.
        _append(self._run_dir, {"time": 50.0, "event": "start", "rank": 0, "world_size": 2, "pid": 3, "step": 31})
        return [123]

    def add_node(self) -> int:
        self.calls.append(("add_node", 2))
        return 2

    def stop(self, grace_s: float = 10.0) -> None:
        self.state = RunState.CANCELLED

    def request_cancel(self) -> None:
        self.state = RunState.CANCELLED


def _append(run_dir: Path, record: dict[str, Any]) -> None:
    with (run_dir / "events.jsonl").open("a") as fh:
        fh.write(json.dumps(record) + "\n")


def _runner(tmp_path: Path, run: FakeRun, *stores: str, **kw: Any) -> ActionRunner:
    uris = ", ".join(f'{{"uri": "{u}"}}' for u in stores or ("file://./ckpt",))
    spec = _spec(f"spec.checkpoint.stores=[{uris}]")
    return ActionRunner(run, spec, Outcome(fault_step=23, fault_rank=0), timeout_s=2.0, **kw)


def _committed(root: Path, *steps: int) -> None:
    for step in steps:
        d = root / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"x" * 64)
        (d / "manifest.json").write_text("{}")


def test_kill_node_shrink_and_rejoin_are_recorded(tmp_path: Path) -> None:
    run = FakeRun(tmp_path)
    _append(tmp_path, {"time": 1.0, "event": "start", "rank": 0, "world_size": 4, "pid": 1})
    _append(tmp_path, {"time": 2.0, "event": "checkpoint_committed", "rank": 0, "step": 30})
    runner = _runner(tmp_path, run)
    runner.run_all([AwaitStep(30), NodeKill(1), AwaitWorldSize(2), AwaitProgress(0), NodeAdd()])
    assert run.calls == [("kill_node", 1), ("add_node", 2)]
    kinds = [e.kind for e in runner.outcome.timeline]
    assert kinds == [DrillEventKind.FAULT_INJECTED, DrillEventKind.SHRUNK, DrillEventKind.NODE_ADDED]
    assert runner.outcome.timeline[0].data == {"kind": "kill-node", "node": 1, "step": 30}
    # A node fault names the node, not a rank: the report reads "step 30, node 1".
    assert (runner.outcome.fault_step, runner.outcome.fault_rank, runner.outcome.fault_node) == (30, None, 1)


def test_a_required_commit_that_never_comes_stops_the_plan(tmp_path: Path) -> None:
    run = FakeRun(tmp_path, state=RunState.FAILED)  # ended: the wait gives up at once
    runner = _runner(tmp_path, run)
    runner.run_all([AwaitCommit(store=0, step=20, required=True), RankKill(0), NodeAdd()])
    assert run.calls == []
    [skipped] = runner.outcome.timeline
    assert skipped.kind is DrillEventKind.DAMAGE_SKIPPED and "ckpt" in skipped.data["reason"]


def test_store_damage_and_loss_on_file_stores(tmp_path: Path) -> None:
    _committed(tmp_path / "a", 10, 20)
    _committed(tmp_path / "b", 10)
    runner = _runner(tmp_path, FakeRun(tmp_path), "file://./a", "file://./b")
    runner.run_all([AwaitCommit(0, 20, required=True), StoreCorrupt(0, CorruptionKind.delete_manifest), StoreLoss(1)])
    assert not (tmp_path / "a" / "step-00000020" / "manifest.json").exists()
    assert (tmp_path / "b").is_file(), "the lost store is replaced by a file"
    assert runner.outcome.damage is not None and runner.outcome.damage["store_name"] == "b"
    events = [(e.kind, e.data.get("kind")) for e in runner.outcome.timeline]
    assert events == [
        (DrillEventKind.CHECKPOINT_DAMAGED, "delete-manifest"),
        (DrillEventKind.FAULT_INJECTED, "lose-store"),
    ]


def test_losing_a_remote_store_needs_a_hook(tmp_path: Path) -> None:
    lost: list[str] = []
    runner = _runner(tmp_path, FakeRun(tmp_path), "file://./a", "s3://bucket/p", lose_store_hook=lost.append)
    runner.run_all([StoreLoss(1)])
    assert lost == ["bucket_p"]
    bare = _runner(tmp_path, FakeRun(tmp_path), "file://./a", "s3://bucket/p")
    with pytest.raises(UnsupportedFeature, match="pass a hook"):
        bare.run_all([StoreLoss(1)])


def test_an_action_failure_lands_in_the_outcome(tmp_path: Path) -> None:
    run = FakeRun(tmp_path)
    runner = _runner(tmp_path, run)  # no network namespaces: a link cut cannot run
    summary = supervise(run, runner, [LinkCut(1)], timeout_s=5.0)
    assert summary.status == "succeeded"
    [error] = runner.outcome.errors
    assert isinstance(error, UnsupportedFeature)
