"""Every drill scenario end to end on the local backend (real torch.distributed.elastic, real SIGKILLs),
and kill-worker on a real local Ray. Each must pass its own verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.drills import DrillOptions, DrillReport, run_drill
from orchestrator.drills.damage import CorruptionKind
from orchestrator.drills.netns import netns_supported
from orchestrator.loader import load_spec
from tests.fixtures.common import REPO, free_port

# A small, fast job: 30 steps, a checkpoint every 5, no eval; steps are a few ms, so restarts dominate.
SMALL = [
    "spec.training.steps=30",
    "spec.checkpoint.every.steps=5",
    "spec.training.evalAtEnd=false",
    "spec.training.lrSchedule.warmupSteps=2",
    "spec.metrics.logEvery=5",
    "spec.nodes.min=1",
    "spec.nodes.max=1",
]


# Each run of a drill (the faulted run, its resubmit after a preemption, the uninterrupted reference) is
# cancelled by the drill itself after `timeout_s`, and the drill then gives its verdict. A test's own timeout
# comes after every run its drill may make and a margin (cancelling, judging, writing the report), so that a
# slow machine gets the drill's verdict, not pytest's traceback in the middle of it.
RUN_TIMEOUT_S = 300
NODE_RUN_TIMEOUT_S = 400  # two emulated nodes: a second agent's start-up and rendezvous, a paced job
VERDICT_MARGIN_S = 60


def drill_timeout(runs: int, run_timeout_s: float = RUN_TIMEOUT_S) -> pytest.MarkDecorator:
    """pytest's timeout for a test whose drill makes `runs` runs of at most `run_timeout_s` each."""
    return pytest.mark.timeout(runs * run_timeout_s + VERDICT_MARGIN_S)


# One metrics port for the whole module (a busy port only moves the exporter to the next one): the
# uninterrupted reference is keyed by the job, so every drill of the same job and backend shares one
# (`shared_reference`, as campaigns do) instead of each running its own (~10 s apiece).
_PORT = free_port()


def _spec(*extra: str) -> Any:
    return load_spec(REPO / "examples" / "digits-ddp.yaml", [*SMALL, f"spec.metrics.port={_PORT}", *extra])


def _drill(scenario: str, tmp_path: Path, *extra: str, **options: Any) -> DrillReport:
    opts = DrillOptions(
        drill_dir=str(tmp_path / scenario), timeout_s=RUN_TIMEOUT_S, **{"shared_reference": True, **options}
    )
    report = run_drill(scenario, _spec(*extra), opts)
    assert report.passed, _failure(report)
    return report


def _failure(report: DrillReport) -> str:
    """The failed checks first (a truncated CI log keeps its head), then the report's tail."""
    failed = [(c.name, c.detail) for c in report.checks if not c.passed]
    return f"failed checks: {failed}\n" + json.dumps(report.to_dict(), indent=1, default=str)[-3000:]


@pytest.mark.slow
@drill_timeout(runs=2)  # the faulted run and the reference
def test_kill_worker_recovers_bit_exactly(tmp_path: Path) -> None:
    report = _drill("kill-worker", tmp_path, seed=1, at_step=13, rank=1)
    assert report.fault_step == 13 and report.fault_rank == 1
    assert report.final_params_match_reference is True
    # In place (`restarts.mode: auto`, the default, at 2 ranks): a warm spare took rank 1's place, nothing
    # restored, no step lost.
    assert report.recovery_path == "inplace"
    assert report.resumed_from_step == 13 and report.lost_steps == 0
    assert report.mttr_seconds is not None and report.mttr_seconds > 0
    assert (tmp_path / "kill-worker" / "report.json").exists()


@pytest.mark.slow
@drill_timeout(runs=2)
def test_crash_during_checkpoint_never_restores_a_partial_save(tmp_path: Path) -> None:
    # The restart path (in place nothing is restored: the survivors' state is newer than any save): the
    # scenario's own patch sets `restarts.mode: restart`, so the job as given, and its reference, is the
    # module's one (`shared_reference`).
    report = _drill("crash-during-checkpoint", tmp_path, seed=2, at_step=17, rank=0)
    assert report.recovery_path == "restart"
    # The save of step 15 was in flight when rank 0 died: it must not be the one restored.
    assert report.resumed_from_step is not None and report.resumed_from_step < 15
    assert report.final_params_match_reference is True


@pytest.mark.slow
@drill_timeout(runs=2)
@pytest.mark.parametrize("corruption", ["flip", "delete-manifest"])
def test_corrupt_checkpoint_falls_back(tmp_path: Path, corruption: str) -> None:
    report = _drill("corrupt-checkpoint", tmp_path, seed=3, at_step=12, rank=1, corruption=CorruptionKind(corruption))
    assert report.damage is not None and report.damage["kind"] == corruption
    assert report.final_params_match_reference is True


@pytest.mark.slow
@drill_timeout(runs=2)
def test_lose_store_keeps_training(tmp_path: Path) -> None:
    report = _drill("lose-store", tmp_path, seed=4, at_step=8)
    assert report.status == "succeeded"
    assert any(c.name == "store failure visible" and c.passed for c in report.checks)


@drill_timeout(runs=2)
def test_lose_store_at_restart_waits_for_the_store_and_resumes(tmp_path: Path) -> None:
    """The only store is gone when the group restarts: the restore lists it again, gives up (exit 205)
    instead of training from step 0, the group restarts again, and once the store is back the job
    resumes from the checkpoint it committed before the outage, bit-identical to the reference."""
    report = _drill("lose-store-at-restart", tmp_path, seed=8, at_step=12, rank=1)
    assert report.resumed_from_step == 10 and report.final_params_match_reference is True
    assert report.damage is not None and "back_at" in report.damage
    logs = "".join(p.read_text() for p in (Path(report.run_dir) / "logs").glob("*.log"))
    assert "refusing to start over from step 0" in logs and "(exitcode: 205)" in logs


@pytest.mark.slow
@drill_timeout(runs=2)
def test_hang_is_detected_by_the_watchdog(tmp_path: Path) -> None:
    report = _drill("hang", tmp_path, seed=5, at_step=11, rank=1, hang_timeout_s=6.0)
    # In place: only the hung rank's watchdog fired (rank 0 waited in the all-reduce), a spare replaced it.
    assert report.recovery_path == "inplace" and report.resumed_from_step == 11 and report.lost_steps == 0
    assert report.final_params_match_reference is True
    checks = {c.name: c.passed for c in report.checks}
    assert checks["every rank dumped its stacks"] and checks["stacks name the hung rank"], report.checks


@pytest.mark.slow
@drill_timeout(runs=2)
def test_straggler_is_named(tmp_path: Path) -> None:
    report = _drill("straggler", tmp_path, seed=6, rank=1, slow_s=0.05)
    named = [c for c in report.checks if c.name == "online detector named the slow rank"]
    assert named and named[0].passed, [(c.name, c.passed, c.detail) for c in report.checks]
    assert report.passed, [(c.name, c.passed, c.detail) for c in report.checks]


@pytest.mark.slow
@drill_timeout(runs=1, run_timeout_s=NODE_RUN_TIMEOUT_S)  # no reference
def test_kill_node_shrinks_and_grows_back(tmp_path: Path) -> None:
    report = run_drill(
        "kill-node",
        _paced_two_node_spec(400),
        # No reference: the world size changes on purpose, so no parameters are compared with one.
        DrillOptions(
            seed=7, nodes=2, at_step=30, reference=False, drill_dir=str(tmp_path / "kn"), timeout_s=NODE_RUN_TIMEOUT_S
        ),
    )
    assert report.passed, _failure(report)
    assert report.final_params_match_reference is None  # the world size changed on purpose
    assert report.world_sizes[:2] == [2, 1] and report.world_sizes[-1] == 2


@drill_timeout(runs=2, run_timeout_s=NODE_RUN_TIMEOUT_S)
def test_kill_node_with_a_standby_node_keeps_the_world_size_and_loses_no_step(tmp_path: Path) -> None:
    """`restarts.spareNodes: 1` on 2 nodes x 2 ranks: the drill kills node 1 (its agent, ranks and spare)
    once the standby is warm; the standby takes ranks 2 and 3 in place (`training.inplace.standby`), the
    world stays at 4, no step is lost and the end is bit-identical to the uninterrupted reference."""
    spec = load_spec(
        REPO / "examples" / "digits-ddp.yaml",
        # Steps enough for the standby to warm up first on a loaded machine (200 ran out once beside the
        # 100-recovery test: the drill is then inconclusive).
        [*SMALL[:-2], "spec.training.steps=500", "spec.nodes.min=2", "spec.nodes.max=2", "spec.restarts.spareNodes=1"],
    )
    spec.spec.metrics.port = _PORT
    report = run_drill(
        "kill-node", spec, DrillOptions(seed=3, nodes=2, drill_dir=str(tmp_path / "kn"), timeout_s=NODE_RUN_TIMEOUT_S)
    )
    assert report.passed, _failure(report)
    assert report.recovery_path == "inplace" and report.lost_steps == 0
    assert report.world_sizes == [4]
    assert report.final_params_match_reference is True
    assert (report.fault_node, report.fault_rank) == (1, None)  # a node was killed, not one rank
    logs = (Path(report.run_dir) / "logs" / "node2.log").read_text()
    assert "torchrig: standby: node 1 stopped beating; this standby takes its ranks 2-3 in place" in logs


@pytest.mark.slow
@drill_timeout(runs=3)  # the preempted run, its resubmit and the reference
def test_preempt_stops_with_an_emergency_checkpoint_and_resumes_losing_no_step(tmp_path: Path) -> None:
    """SIGTERM to every process mid-run: one agreed stop step, its checkpoint committed within the grace,
    the job stops as `preempted` (no in-place restart), and started again it ends bit-identical."""
    report = _drill("preempt", tmp_path, "spec.training.steps=40", seed=3, at_step=12)
    assert report.lost_steps == 0 and report.resumed_from_step is not None and report.resumed_from_step >= 12
    assert report.fault_rank is None and report.fault_node is None, "the signal struck every process, no one rank"


@pytest.mark.slow
@drill_timeout(runs=2)  # the preempted run and its resubmit; no reference
def test_preempt_with_too_short_a_grace_resumes_from_the_previous_checkpoint(tmp_path: Path) -> None:
    """The deadline strikes before the emergency checkpoint commits: nothing of it is restored. (No
    reference run: bit-exact resumes from a periodic checkpoint are kill-worker's subject.)"""
    report = _drill("preempt-short-grace", tmp_path, "spec.training.steps=40", seed=3, at_step=12, reference=False)
    assert report.resumed_from_step is not None and report.resumed_from_step % 5 == 0  # a periodic checkpoint
    # The resubmit records what the stores held, the verdict's evidence besides the events.
    (resubmitted,) = [e for e in report.events if e["event"] == "resubmitted"]
    assert report.resumed_from_step in resubmitted["committed"]["local"], resubmitted


def _paced_two_node_spec(steps: int) -> Any:
    return load_spec(
        REPO / "examples" / "digits-ddp.yaml",
        [
            f"spec.training.steps={steps}",
            "spec.checkpoint.every.steps=10",
            "spec.training.evalAtEnd=false",
            "spec.procsPerNode=1",
            "spec.nodes.min=1",
            "spec.nodes.max=2",
            f"spec.metrics.port={free_port()}",
        ],
    )


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(netns_supported() is not None, reason=f"partition drill: {netns_supported()}")
@drill_timeout(runs=1, run_timeout_s=NODE_RUN_TIMEOUT_S)  # no reference
def test_partition_restarts_at_the_remaining_world_size(tmp_path: Path) -> None:
    report = run_drill(
        "partition",
        _paced_two_node_spec(400),
        DrillOptions(
            seed=9, nodes=2, at_step=60, reference=False, drill_dir=str(tmp_path / "p"), timeout_s=NODE_RUN_TIMEOUT_S
        ),
    )
    assert report.passed, _failure(report)
    assert report.world_sizes[:2] == [2, 1], "the cut-off node's rank left the world"
    assert report.resumed_from_step is not None and report.resumed_from_step <= 60
    # This drill's own namespaces (another test on the second worker may hold `trg*` ones of its own).
    made = [n for e in report.events if e.get("event") == "netns_created" for n in e.get("namespaces", [])]
    assert len(made) == 2, report.events
    assert not set(made) & set(_netns_list()), "namespaces are cleaned up"


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.ray
@drill_timeout(runs=2)
def test_kill_worker_on_ray(ray_local_2cpu: object, tmp_path: Path) -> None:
    # On the module's one embedded Ray: the faulted run and its reference do not each start their own.
    report = _drill("kill-worker", tmp_path, backend="ray", seed=8, at_step=12, rank=1)
    assert report.final_params_match_reference is True


@pytest.mark.slow
@pytest.mark.soak  # 20 recoveries in one job, ~2.5 min: `make soak`, not `make test`
@drill_timeout(runs=2)
def test_kill_worker_twenty_seeded_kills_in_a_row_end_bit_exact(tmp_path: Path) -> None:
    """20 kills in one job, kill g in restart generation g, its rank and step drawn from seed g: every
    recovery builds on the previous one, and the result must still match the reference bit for bit."""
    report = _drill("kill-worker", tmp_path, "spec.training.steps=110", seed=0, repeat=20)
    assert report.final_params_match_reference is True
    checks = {c.name: c for c in report.checks}
    assert checks["every kill fired"].detail == "20 of 20 kills fired"
    assert checks["each restart resumed from the newest checkpoint committed before its kill"].passed
    faults = json.loads((tmp_path / "kill-worker" / "report.json").read_text())["events"]
    ranks = {e["rank"] for e in faults if e.get("event") == "fault"}
    assert ranks == {0, 1}, "the seeds hit both ranks"


def test_drill_cli_rejects_bad_input_without_traceback(tmp_path: Path) -> None:
    job = REPO / "examples" / "digits-ddp.yaml"
    cases = [
        (["drill", "explode", str(job)], "valid drills: kill-worker"),
        (["drill", "kill-worker", str(job), "--at-step", "9999"], "--at-step"),
        (["drill", "kill-node", str(job), "--set", "spec.nodes.max=1"], "spec.nodes"),
    ]
    for args, expected in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *args, "--drill-dir", str(tmp_path / "x")],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr and "Traceback" not in proc.stderr


def test_every_drill_test_outlasts_its_drills_own_timeout() -> None:
    """A drill test without `drill_timeout` would get the suite's 300 s, no more than one run's `timeout_s`."""
    drill_tests = {
        name: func
        for name, func in globals().items()
        if name.startswith("test_") and {"_drill", "run_drill"} & set(func.__code__.co_names)
    }
    assert len(drill_tests) >= 10
    for name, func in drill_tests.items():
        limits = [m.args[0] for m in getattr(func, "pytestmark", []) if m.name == "timeout"]
        assert limits and limits[0] >= RUN_TIMEOUT_S + VERDICT_MARGIN_S, f"{name}: timeout {limits or 'the default'}"
