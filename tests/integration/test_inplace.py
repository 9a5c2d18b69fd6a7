"""In-place recovery end to end on the local backend (`training.inplace`): real torchrun, real SIGKILLs,
real gloo DDP, a real warm spare. The survivors keep their state, the spare takes the dead rank's place,
no step is lost and the final parameters match an uninterrupted run bit for bit; when no spare can
help (every rank died at once) the group falls back to a restart from the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends import get_backend
from orchestrator.backends.base import RunState, SubmitOptions
from orchestrator.drills import DrillOptions, run_drill
from orchestrator.loader import load_spec
from tests.fixtures.common import REPO, free_port
from training.contract import Env, EventKind, Summary, read_events

SMALL = [
    "spec.training.steps=24",
    "spec.checkpoint.every.steps=5",
    "spec.training.evalAtEnd=false",
    "spec.training.lrSchedule.warmupSteps=2",
    "spec.metrics.logEvery=5",
    "spec.nodes.min=1",
    "spec.nodes.max=1",
]
# 4 ranks: the 2-rank case runs in test_drills.py (kill-worker). At 4 ranks a survivor can be blocked on a
# live peer (only the connection cut wakes it) and DDP's bucket layout decides the rounding (only the
# carried-over layout keeps the run bit-identical): both are proven here end to end.
FOUR = ["spec.procsPerNode=4"]
_PORT = free_port()  # one job for the module: its one uninterrupted reference serves every test


def _spec(*extra: str) -> Any:
    return load_spec(REPO / "examples" / "digits-ddp.yaml", [*SMALL, *FOUR, f"spec.metrics.port={_PORT}", *extra])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Summary:
    run_dir = tmp_path_factory.mktemp("inplace") / "reference"
    summary = get_backend("local").launch(_spec(), SubmitOptions(run_dir=str(run_dir), quiet=True)).wait(300)
    assert summary.status == RunState.SUCCEEDED, summary.reason
    assert summary.params_sha256
    return summary


@pytest.mark.slow
def test_kill_rank_zero_of_four_recovers_in_place_bit_exactly(tmp_path: Path, reference: Summary) -> None:
    # Rank 0 hosts nothing the group needs (the store is the run's own process): a spare becomes rank 0.
    rank, step = 0, 7
    opts = DrillOptions(
        drill_dir=str(tmp_path / "kill-0"), timeout_s=300, seed=1, at_step=step, rank=rank, reference=False
    )
    report = run_drill("kill-worker", _spec(), opts)
    assert report.passed, json.dumps(report.to_dict(), indent=1, default=str)[-4000:]
    assert report.recovery_path == "inplace"
    assert report.lost_steps == 0 and report.resumed_from_step == step
    assert report.mttr_seconds is not None and report.mttr_seconds > 0
    summary = Summary.read(Path(report.run_dir) / "summary.json")
    assert summary is not None and summary.recoveries == {"inplace": 1}
    assert summary.restarts == 0, "the torchrun group never restarted"
    assert summary.params_sha256 == reference.params_sha256, "bit-identical to the uninterrupted run"
    recoveries = [e for e in read_events(Path(report.run_dir) / "events.jsonl") if e.kind is EventKind.RECOVERY]
    assert sorted(e.get("role") for e in recoveries) == ["spare", "survivor", "survivor", "survivor"]
    assert {tuple(e.get("replaced_ranks")) for e in recoveries} == {(rank,)}
    # Each member says where its recovery's time went, in order (the scaling analysis rests on it).
    for e in recoveries:
        phases = e.get("phases")
        expected = ["formed", "state", "checkpoints", "preemption"]
        if e.get("role") == "survivor":
            expected = ["destroyed", "left", *expected]
        assert list(phases) == expected, phases
        times = list(phases.values())
        assert times == sorted(times) and times[-1] <= e.get("seconds") + 0.01, phases
    # The spare's warm-up imported everything its rank's set-up needs: no import inside the recovery.
    spare = next(e for e in recoveries if e.get("role") == "spare")
    assert spare.get("imports") == [], spare.get("imports")


@pytest.mark.slow
def test_hsdp_on_two_nodes_recovers_a_rank_in_place_on_its_node_bit_exactly(tmp_path: Path) -> None:
    """Two emulated nodes of 2 ranks (two torchrun agents, one c10d rendezvous), HSDP (2 x 2 mesh) with
    in-memory replicas: the agents share one in-place key space through the rendezvous round's token,
    rank 2 (node 1) dies, node 1's warm spare takes its place, every member rebuilds its 2-D mesh on the
    new generation (DTensor's cached plans must not hand back the old mesh's destroyed groups), and the
    run ends bit-identical to an uninterrupted one, having lost at most the steps since the replica.
    (DDP across pods: tests/pods/test_pods.py, the two-pod in-place test.)"""
    spec = _spec(
        "spec.nodes.min=2",
        "spec.nodes.max=2",
        "spec.procsPerNode=2",
        "spec.training.strategy=hsdp",
        "spec.checkpoint.inMemory.every=5",
    )
    opts = DrillOptions(drill_dir=str(tmp_path / "hsdp"), timeout_s=300, seed=1, at_step=12, rank=2, nodes=2)
    report = run_drill("kill-worker", spec, opts)
    assert report.passed, json.dumps(report.to_dict(), indent=1, default=str)[-4000:]
    assert report.recovery_path == "inplace" and report.lost_steps is not None and report.lost_steps <= 5
    assert report.final_params_match_reference is True
    summary = Summary.read(Path(report.run_dir) / "summary.json")
    assert summary is not None and summary.recoveries == {"inplace": 1} and summary.restarts == 0
    node1 = (Path(report.run_dir) / "logs" / "node1.log").read_text()
    assert "rank 2's trainer died; spare 0" in node1, "node 1's own spare took the rank"
    recoveries = [e for e in read_events(Path(report.run_dir) / "events.jsonl") if e.kind is EventKind.RECOVERY]
    assert sorted(e.get("role") for e in recoveries) == ["spare", "survivor", "survivor", "survivor"]
    spare = next(e for e in recoveries if e.get("role") == "spare")
    assert spare.get("imports") == [], spare.get("imports")  # FSDP's sharding too: warmed by the rehearsal


@pytest.mark.slow
def test_every_rank_lost_falls_back_to_a_bit_exact_group_restart(tmp_path: Path, reference: Summary) -> None:
    """All 4 ranks die at once: no survivor holds the state, so the hosts give up on in-place recovery at
    once (exit 203, without waiting for spares) and torchrun restarts the group from the newest
    checkpoint. The restarted DDP takes the bucket layout named in the manifest, so even at 4 ranks the
    end is bit-identical."""
    faults = [{"kind": "kill", "rank": r, "step": 12} for r in range(4)]
    options = SubmitOptions(run_dir=str(tmp_path / "run"), quiet=True, env={Env.FAULTS: json.dumps(faults)})
    # A timeout longer than this test's wait: the fallback must come from seeing every rank lost, not
    # from waiting for spares. The timeout never changes the numerics: the module's reference applies.
    spec = _spec("spec.restarts.inPlaceTimeoutSeconds=900")
    summary = get_backend("local").launch(spec, options).wait(300)
    assert summary.status == RunState.SUCCEEDED, summary.reason
    # Either the hosts saw every rank lost before spares were ready, or each rank got a spare and the new
    # group found no member with the state (forked spares are ready within about a second here).
    log = (tmp_path / "run" / "logs" / "node0.log").read_text()
    assert "every rank lost its trainer" in log or "no member of the new group holds the training state" in log
    # torchrun's SIGTERM to the other hosts ended them within its grace: a spare still forming its generation
    # gives up on that signal (it used to wait its preemption grace out, and torchrun killed its host 30 s on).
    assert "forcefully exiting via 9" not in log, "a host outlived torchrun's SIGTERM"
    assert summary.recoveries.get("restart") == 1 and "inplace" not in summary.recoveries
    assert summary.restarts == 1
    # The save of step 10 may still have been in flight when they died: then step 5 is the newest.
    assert summary.restored_from and summary.restored_from[0]["step"] in (5, 10)
    assert summary.params_sha256 == reference.params_sha256


def _reference(tmp_path: Path, spec: Any) -> Summary:
    run = get_backend("local").launch(spec, SubmitOptions(run_dir=str(tmp_path / "reference"), quiet=True))
    summary = run.wait(300)
    assert summary.status == RunState.SUCCEEDED, summary.reason
    return summary


@pytest.mark.slow
@pytest.mark.soak  # 100 in-place recoveries in one job (each waits for a fresh spare): `make soak` only
@pytest.mark.timeout(3600)
def test_hundred_consecutive_in_place_recoveries_end_bit_exact(tmp_path: Path) -> None:
    kills = 100
    steps = 5 * kills + 10
    spec = _spec(
        f"spec.training.steps={steps}", "spec.checkpoint.every.steps=50", "spec.restarts.inPlaceTimeoutSeconds=300"
    )
    faults = [{"kind": "kill", "rank": i % 4, "step": 5 * (i + 1), "generation": -1} for i in range(kills)]
    options = SubmitOptions(run_dir=str(tmp_path / "run"), quiet=True, env={Env.FAULTS: json.dumps(faults)})
    summary = get_backend("local").launch(spec, options).wait(3600)
    assert summary.status == RunState.SUCCEEDED, summary.reason
    assert summary.restarts == 0, "no fallback: the torchrun group never restarted"
    assert summary.recoveries == {"inplace": kills}
    assert summary.params_sha256 == _reference(tmp_path, spec).params_sha256


@pytest.mark.slow
def test_fsdp_recovers_in_place_from_replicas_and_falls_back_when_two_neighbours_die(tmp_path: Path) -> None:
    """FSDP, 4 ranks, in-memory replicas every 3 steps. Rank 0 dies after step 7: the group re-forms in
    place and returns to the step-6 snapshot (rank 1 holds rank 0's shards). Then ranks 1 and 2 die
    together after step 17: rank 1's shards lived only on rank 2, so no in-place recovery is possible and
    the group restarts from the durable checkpoint. Both paths end bit-identical to an uninterrupted run."""
    spec = _spec("spec.training.strategy=fsdp", "spec.checkpoint.inMemory.every=3")
    faults = [
        {"kind": "kill", "rank": 0, "step": 7},
        {"kind": "kill", "rank": 1, "step": 17},
        {"kind": "kill", "rank": 2, "step": 17},
    ]
    options = SubmitOptions(run_dir=str(tmp_path / "run"), quiet=True, env={Env.FAULTS: json.dumps(faults)})
    summary = get_backend("local").launch(spec, options).wait(300)
    assert summary.status == RunState.SUCCEEDED, summary.reason
    assert summary.recoveries == {"inplace": 1, "restart": 1}
    assert summary.restarts == 1, "the second failure took the fallback"
    events = read_events(tmp_path / "run" / "events.jsonl")
    in_place = [e for e in events if e.kind is EventKind.RECOVERY and e.get("path") == "inplace"]
    assert {e.step for e in in_place} == {6}, "back to the newest snapshot every member held"
    assert {e.get("source") for e in in_place} == {"replica"}
    assert sorted(e.get("role") for e in in_place) == ["spare", "survivor", "survivor", "survivor"]
    log = (tmp_path / "run" / "logs" / "node0.log").read_text()
    assert "rank 1's shards were held by rank 2, which was lost too" in log
    assert summary.restored_from and summary.restored_from[0]["step"] in (10, 15)
    assert summary.params_sha256 == _reference(tmp_path, spec).params_sha256
