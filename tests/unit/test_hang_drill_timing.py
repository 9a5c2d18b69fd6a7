"""The hang drill's timing verdict (`Hang._judge_detection`): detected by the derived deadline, within 3x
the median step time + 1 s, read from a run directory's files (no process)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

from orchestrator.drills.history import RunHistory
from orchestrator.drills.plan import DrillContext
from orchestrator.drills.report import Verdict
from orchestrator.drills.scenarios import Hang
from tests.fixtures.common import REPO

DETECTED = "hang detected within 3x the median step time + 1 s"
DERIVED = "hang detected by the derived step deadline"


def _ctx(fault_step: int = 60) -> DrillContext:
    return DrillContext(
        scenario="hang", seed=0, steps=100, world_size=2, nodes=1, checkpoint_every=10,
        fault_step=fault_step, fault_rank=1, rng=random.Random(0),
    )  # fmt: skip


def _run(tmp_path: Path, *, silent_s: float, timeout_s: float, mode: str = "auto") -> RunHistory:
    job = (REPO / "examples" / "digits-ddp.yaml").read_text()
    job = job.replace("stepTimeoutSeconds: 120}", f"stepTimeoutSeconds: 10, hangDetection: {mode}}}")
    assert f"hangDetection: {mode}" in job
    (tmp_path / "job.yaml").write_text(job)
    events: list[dict[str, Any]] = [
        {"time": 100.0 + i, "rank": r, "generation": 0, "event": "step_times", "step": 10 * i, "step_s": 0.02}
        for i in range(1, 6)
        for r in (0, 1)
    ]
    events += [
        {"time": 110.0, "rank": 1, "generation": 0, "event": "fault", "step": 60, "kind": "hang"},
        {"time": 110.0 + silent_s, "rank": 1, "generation": 0, "event": "watchdog", "step": 60,
         "silent_s": silent_s, "timeout_s": timeout_s, "phase": "step"},
    ]  # fmt: skip
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return RunHistory.load(tmp_path)


def _checks(history: RunHistory, ctx: DrillContext | None = None) -> Verdict:
    verdict = Verdict()
    hung = [e for e in history.events if e.get("silent_s") is not None]
    Hang._judge_detection(verdict, history, ctx or _ctx(), hung)
    return verdict


def test_a_hang_caught_by_the_derived_deadline_in_time_passes(tmp_path: Path) -> None:
    verdict = _checks(_run(tmp_path, silent_s=0.55, timeout_s=0.5))
    assert {c.name: c.passed for c in verdict.checks} == {
        "the hung rank's watchdog fired": True,
        DERIVED: True,
        DETECTED: True,
    }
    assert "median step 20.0 ms" in next(c.detail for c in verdict.checks if c.name == DETECTED)


def test_a_hang_caught_by_the_fixed_timeout_fails(tmp_path: Path) -> None:
    # The 10 s cap fired: derived deadlines were not in force past warm-up (a regression), too late too.
    checks = {c.name: c.passed for c in _checks(_run(tmp_path, silent_s=10.2, timeout_s=10.0)).checks}
    assert checks == {"the hung rank's watchdog fired": True, DERIVED: False, DETECTED: False}
    # A derived deadline, but a detection slower than 3 x 20 ms + 1 s.
    shutil.rmtree(tmp_path)
    tmp_path.mkdir()
    checks = {c.name: c.passed for c in _checks(_run(tmp_path, silent_s=1.2, timeout_s=1.1)).checks}
    assert checks[DERIVED] and not checks[DETECTED]


def test_fixed_mode_warm_up_and_a_missing_job_file_are_not_judged_by_time(tmp_path: Path) -> None:
    history = _run(tmp_path, silent_s=10.2, timeout_s=10.0, mode="fixed")
    verdict = _checks(history)
    assert not verdict.checks and "hang detection: fixed" in verdict.notes[0]
    _run(tmp_path, silent_s=10.2, timeout_s=10.0)
    assert not _checks(RunHistory.load(tmp_path), _ctx(fault_step=15)).checks  # within warm-up: the cap
    (tmp_path / "job.yaml").unlink()
    verdict = _checks(RunHistory.load(tmp_path))
    assert not verdict.checks and "not judged" in verdict.notes[0]
