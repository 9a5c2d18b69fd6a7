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
from orchestrator.drills import DrillOptions, DrillReport, run_drill
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


def _spec(*extra: str) -> Any:
    return load_spec(REPO / "examples" / "digits-ddp.yaml", [*SMALL, f"spec.metrics.port={free_port()}", *extra])


def _drill(tmp_path: Path, name: str, **options: Any) -> DrillReport:
    opts = DrillOptions(drill_dir=str(tmp_path / name), timeout_s=300, **options)
    return run_drill("kill-worker", _spec(), opts)


@pytest.mark.slow
def test_kill_rank_zero_recovers_in_place_bit_exactly(tmp_path: Path) -> None:
    # Rank 0 hosts nothing the group needs (the store is the run's own process): a spare becomes rank 0.
    # test_drills.py's kill-worker case kills rank 1 of the same default (in-place) configuration.
    rank, step = 0, 7
    report = _drill(tmp_path, f"kill-{rank}", seed=1, at_step=step, rank=rank)
    assert report.passed, json.dumps(report.to_dict(), indent=1, default=str)[-4000:]
    assert report.recovery_path == "inplace"
    assert report.lost_steps == 0 and report.resumed_from_step == step
    assert report.final_params_match_reference is True
    assert report.mttr_seconds is not None and report.mttr_seconds > 0
    summary = Summary.read(Path(report.run_dir) / "summary.json")
    assert summary is not None and summary.recoveries == {"inplace": 1}
    assert summary.restarts == 0, "the torchrun group never restarted"
    spare = [e for e in read_events(Path(report.run_dir) / "events.jsonl") if e.kind is EventKind.RECOVERY]
    assert {e.get("role") for e in spare} == {"survivor", "spare"}
    assert {tuple(e.get("replaced_ranks")) for e in spare} == {(rank,)}


@pytest.mark.slow
def test_every_rank_lost_falls_back_to_a_group_restart(tmp_path: Path) -> None:
    """Both ranks die at once: the spare that takes one place finds no survivor to copy from, so in-place
    recovery fails (exit 203) and torchrun restarts the group from the newest checkpoint."""
    spec = _spec()
    faults = [{"kind": "kill", "rank": r, "step": 12} for r in (0, 1)]
    options = SubmitOptions(run_dir=str(tmp_path / "run"), quiet=True, env={Env.FAULTS: json.dumps(faults)})
    run = get_backend("local").launch(spec, options)
    summary = run.wait(300)
    assert summary.status == RunState.SUCCEEDED, summary.reason
    assert summary.recoveries.get("restart") == 1 and "inplace" not in summary.recoveries
    assert summary.restarts == 1
    # The save of step 10 may still have been in flight when both died: then step 5 is the newest.
    assert summary.restored_from and summary.restored_from[0]["step"] in (5, 10)
    reference = _reference(tmp_path, spec)
    assert summary.params_sha256 == reference.params_sha256


def _reference(tmp_path: Path, spec: Any) -> Summary:
    run = get_backend("local").launch(spec, SubmitOptions(run_dir=str(tmp_path / "reference"), quiet=True))
    summary = run.wait(300)
    assert summary.status == RunState.SUCCEEDED, summary.reason
    return summary


@pytest.mark.slow
@pytest.mark.soak  # 100 in-place recoveries in one job (each waits for a fresh spare): `make soak` only
def test_hundred_consecutive_in_place_recoveries_end_bit_exact(tmp_path: Path) -> None:
    kills = 100
    steps = 5 * kills + 10
    spec = _spec(
        f"spec.training.steps={steps}", "spec.checkpoint.every.steps=50", "spec.restarts.inPlaceTimeoutSeconds=300"
    )
    faults = [{"kind": "kill", "rank": i % 2, "step": 5 * (i + 1), "generation": -1} for i in range(kills)]
    options = SubmitOptions(run_dir=str(tmp_path / "run"), quiet=True, env={Env.FAULTS: json.dumps(faults)})
    summary = get_backend("local").launch(spec, options).wait(3600)
    assert summary.status == RunState.SUCCEEDED, summary.reason
    assert summary.restarts == 0, "no fallback: the torchrun group never restarted"
    assert summary.recoveries == {"inplace": kills}
    assert summary.params_sha256 == _reference(tmp_path, spec).params_sha256
