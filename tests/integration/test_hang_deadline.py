"""Hang detection by derived step deadlines (`restarts.hangDetection: auto`, `training.deadlines`) end to end
on the local backend: real torchrun, real gloo DDP, a rank that really stops.

The hang drill's timing is checked by its own verdict (detected by the derived deadline, within 3x the
median step + 1 s); the soak (`make soak`) runs 2,000 steps with checkpoints at the drill's tight settings
and requires that no watchdog fires on a healthy job.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends import get_backend
from orchestrator.backends.base import RunState, SubmitOptions
from orchestrator.drills import DrillOptions, run_drill
from orchestrator.drills.scenarios import HANG_FLOOR_S, HANG_MULTIPLIER
from orchestrator.loader import load_spec
from tests.fixtures.common import REPO, free_port
from training.contract import EventKind, read_events

SMALL = [
    "spec.training.evalAtEnd=false",
    "spec.training.lrSchedule.warmupSteps=2",
    "spec.metrics.logEvery=5",
    "spec.nodes.min=1",
    "spec.nodes.max=1",
]
DEADLINE_LINE = re.compile(r"watchdog: step deadline ([0-9.e+-]+)s from (\d+) step intervals")


def _spec(*extra: str) -> Any:
    return load_spec(REPO / "examples" / "digits-ddp.yaml", [*SMALL, f"spec.metrics.port={free_port()}", *extra])


@pytest.mark.slow
def test_hang_drill_detects_the_hang_in_seconds(tmp_path: Path) -> None:
    """Past warm-up the hung rank is ended by its derived deadline, not the drill's 10 s step timeout."""
    spec = _spec("spec.training.steps=60", "spec.checkpoint.every.steps=10")
    opts = DrillOptions(drill_dir=str(tmp_path / "hang"), timeout_s=300, at_step=45, rank=1, reference=False)
    report = run_drill("hang", spec, opts)
    checks = {c.name: (c.passed, c.detail) for c in report.checks}
    failed = {name: detail for name, (passed, detail) in checks.items() if not passed}
    assert report.passed, failed
    assert checks["hang detected by the derived step deadline"][0]
    assert checks["hang detected within 3x the median step time + 1 s"][0]
    assert report.recovery_path == "inplace" and report.lost_steps == 0
    dog = [e for e in read_events(Path(report.run_dir) / "events.jsonl") if e.kind is EventKind.WATCHDOG]
    assert [e.rank for e in dog] == [1] and dog[0].get("phase") == "step"
    assert dog[0].get("timeout_s") < 10.0 / 2  # the drill's cap is 10 s
    assert report.mttr_seconds is not None and report.mttr_seconds < 10.0


@pytest.mark.slow
@pytest.mark.soak  # 2,000 steps on a loaded machine: `make soak`, not `make test`
@pytest.mark.timeout(1800)
def test_no_false_alarm_in_two_thousand_steps_with_checkpoints(tmp_path: Path) -> None:
    """The hang drill's settings (the tightest torchrig ships) on a healthy 2,000-step job with 80 async
    checkpoints: no watchdog fires, no recovery happens, no rank dumps its stacks, and the deadline in force
    was derived (below the cap) on every rank."""
    spec = _spec(
        "spec.training.steps=2000",
        "spec.checkpoint.every.steps=25",
        "spec.restarts.stepTimeoutSeconds=10",
        f"spec.restarts.hangFloorSeconds={HANG_FLOOR_S}",
        f"spec.restarts.hangMultiplier={HANG_MULTIPLIER}",
    )
    run_dir = tmp_path / "run"
    summary = get_backend("local").launch(spec, SubmitOptions(run_dir=str(run_dir), quiet=True)).wait(1500)
    assert summary.status == RunState.SUCCEEDED, summary.reason
    events = read_events(run_dir / "events.jsonl")
    # Not even a stack dump: a rank in a collective dumps at 3/4 of the floor, which a healthy job never reaches.
    alarms = [e for e in events if e.kind in (EventKind.WATCHDOG, EventKind.RECOVERY, EventKind.STACKS)]
    assert not alarms, [json.dumps(e.to_dict(), default=str) for e in alarms]
    assert not summary.recoveries and summary.restarts == 0
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    found = DEADLINE_LINE.findall(logs)
    assert len(found) == 2, logs[-3000:]  # one summary per rank
    for deadline, samples in found:
        assert HANG_FLOOR_S <= float(deadline) < 10.0 and int(samples) == 1000
    print("\n".join(line for line in logs.splitlines() if "step deadline" in line))
