"""The run plot's data on synthetic runs: where lines break, where outages and restarts are, the world
size over the whole run; and that a run directory renders to a PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli.report_cmds import loss_figures
from orchestrator.plot import build_timeline, plot_run
from orchestrator.plot.timeline import break_series, outages, restart_times
from training.contract import Event, EventKind


def ev(time: float, event: EventKind, rank: int = 0, generation: int = 0, **data: Any) -> Event:
    return Event(time=time, rank=rank, generation=generation, kind=event, data=data)


def rec(time: float, step: int, loss: float = 1.0, rate: float = 100.0, generation: int = 0) -> dict[str, Any]:
    return {"time": time, "step": step, "loss": loss, "samples_per_s": rate, "world_size": 2, "generation": generation}


# A 2-rank run: starts at t=100, first step at 102, rank 1 killed at step 35 (t=110), checkpoint 30
# committed at 108; the group re-forms at 130 (generation 1), restores step 30 at 138, first step 31
# at 140, finishes step 50 at 150.
EVENTS = [
    ev(100.0, EventKind.START, 0, world_size=2),
    ev(100.1, EventKind.START, 1, world_size=2),
    ev(102.0, EventKind.FIRST_STEP, 0, step=1, world_size=2),
    ev(102.0, EventKind.FIRST_STEP, 1, step=1, world_size=2),
    ev(108.0, EventKind.CHECKPOINT_COMMITTED, 0, step=30, blocked_s=0.01),
    ev(108.0, EventKind.CHECKPOINT_COMMITTED, 1, step=30, blocked_s=0.01),
    ev(110.0, EventKind.FAULT, 1, step=35, kind="kill"),
    ev(130.0, EventKind.START, 1, 1, world_size=2),
    ev(130.2, EventKind.START, 0, 1, world_size=2),
    ev(138.0, EventKind.RESTORE, 1, 1, step=30, store="local"),
    ev(138.1, EventKind.RESTORE, 0, 1, step=30, store="local"),
    ev(140.0, EventKind.FIRST_STEP, 0, 1, step=31, world_size=2),
    ev(140.1, EventKind.FIRST_STEP, 1, 1, step=31, world_size=2),
    ev(145.0, EventKind.CHECKPOINT_COMMITTED, 0, 1, step=40, blocked_s=0.01),
    ev(150.0, EventKind.EVAL, 0, 1, step=50, metrics={"loss": 0.3, "accuracy": 0.9, "count": 360.0}),
    ev(150.0, EventKind.EVAL, 1, 1, step=50, metrics={"loss": 0.3, "accuracy": 0.9, "count": 360.0}),
]
METRICS = [
    rec(105.0, 10, 2.0),
    rec(107.0, 20, 1.5),
    rec(109.0, 30, 1.0),
    rec(142.0, 40, 0.8, generation=1),  # steps 31-40: after the restore, step 40 again is fine
    rec(150.0, 50, 0.5, generation=1),
]


def nan_positions(values: list[float]) -> list[int]:
    return [i for i, v in enumerate(values) if math.isnan(v)]


def test_restarts_are_rank0_starts_after_the_first() -> None:
    assert restart_times(EVENTS) == [130.2]
    assert restart_times(EVENTS[:4]) == []


def test_lines_break_at_a_restart_and_where_the_step_goes_back() -> None:
    s = break_series(METRICS, [130.2], t0=100.0)
    # A NaN row between step 30 (before the restart) and step 40 (after it), none elsewhere.
    assert s.steps[:3] == [10.0, 20.0, 30.0] and math.isnan(s.steps[3]) and s.steps[4:] == [40.0, 50.0]
    assert nan_positions(s.times) == nan_positions(s.loss) == nan_positions(s.samples_per_s) == [3]
    assert s.times[0] == pytest.approx(5.0)
    # Without any restart event, a step that goes backwards (a restore) still breaks the line.
    back = [rec(1.0, 10), rec(2.0, 20), rec(3.0, 15), rec(4.0, 25)]
    assert nan_positions(break_series(back, [], t0=0.0).steps) == [2]
    # Records in one cohort, steps advancing: one unbroken line.
    assert nan_positions(break_series(METRICS[:3], [], t0=0.0).steps) == []


def test_outage_runs_from_the_last_step_before_the_restart_to_the_first_step_after() -> None:
    (cut,) = outages(METRICS, EVENTS, t0=100.0)
    # The last step record before the restart is the fault at step 35 (t=110), after the metrics
    # record of step 30 (t=109); the first step after it is first_step 31 at t=140.
    assert (cut.start, cut.end) == (pytest.approx(10.0), pytest.approx(40.0))
    assert (cut.last_step, cut.first_step, cut.resumed_from) == (35, 31, 30)


def test_outage_of_an_external_fault_and_of_a_run_that_never_recovered() -> None:
    events = [e for e in EVENTS if e.kind is not EventKind.FAULT]
    (cut,) = outages(METRICS, events, t0=100.0)
    assert cut.start == pytest.approx(9.0) and cut.last_step == 30  # the step-30 record
    (cut,) = outages(METRICS, events, fault_times=[112.0], t0=100.0)
    assert cut.start == pytest.approx(12.0), "a drill's fault after the last record is when steps stopped"
    # The group re-formed, restored, and died before its first step: the outage lasts to the end.
    dead = [e for e in events if e.time < 139.0]
    (cut,) = outages(METRICS[:3], dead, t0=100.0, end=170.0)
    assert cut.end == pytest.approx(70.0) and cut.first_step is None and cut.resumed_from == 30


def test_timeline_markers_world_size_and_startup() -> None:
    tl = build_timeline(METRICS, EVENTS)
    assert tl.t0 == 100.0 and tl.end == pytest.approx(50.0)
    assert [(m.time, m.step) for m in tl.restarts] == [(pytest.approx(30.2), 30)]
    assert tl.restarts[0].label == "restart 1 (from @30)"
    # One restore and one commit per step per cohort, though every rank writes them.
    assert [(m.time, m.step, m.label) for m in tl.restores] == [(pytest.approx(38.0), 30, "restore @30")]
    assert [m.step for m in tl.checkpoints] == [30, 40]
    assert [(m.step, m.label) for m in tl.faults] == [(35, "fault: kill rank 1 @35")]
    assert tl.eval_loss == [(50, pytest.approx(50.0), 0.3)]
    assert tl.startup is not None and (tl.startup.start, tl.startup.end) == (0.0, pytest.approx(2.0))
    # World size over the whole run: each cohort from its start to where it stopped training,
    # the last one to the end of the run; by step, each cohort over the steps it covered.
    tx, ty = tl.world_size_time
    assert tx[:2] == [0.0, pytest.approx(10.0)] and math.isnan(tx[2]) and tx[3:] == [pytest.approx(30.2), 50.0]
    assert ty[:2] == [2.0, 2.0] and ty[3:] == [2.0, 2.0]
    sx, _ = tl.world_size_step
    assert sx[:2] == [0.0, 35.0] and math.isnan(sx[2]) and sx[3:] == [30.0, 50.0]


def test_a_restored_checkpoint_whose_commit_event_was_lost_is_still_marked() -> None:
    # The committing rank was killed between writing step 30's manifest and logging it: the restore of
    # step 30 proves the commit, drawn where step 30 completed (the metrics record at t=109).
    events = [e for e in EVENTS if not (e.kind is EventKind.CHECKPOINT_COMMITTED and e.step == 30)]
    tl = build_timeline(METRICS, events)
    assert [(m.time, m.step, m.label) for m in tl.checkpoints] == [
        (pytest.approx(9.0), 30, "checkpoint @30 (seen on restore)"),
        (pytest.approx(45.0), 40, "checkpoint @40"),
    ]


def test_world_size_change_and_an_external_fault_marker() -> None:
    events = [
        ev(1000.0, EventKind.START, 0, world_size=4),
        ev(1001.0, EventKind.FIRST_STEP, 0, step=1, world_size=4),
        ev(1020.0, EventKind.START, 0, 0, world_size=2),  # a membership change: the same generation
        ev(1025.0, EventKind.RESTORE, 0, 0, step=10, store="local"),
        ev(1026.0, EventKind.FIRST_STEP, 0, 0, step=11, world_size=2),
    ]
    metrics = [rec(1005.0, 10), rec(1009.0, 15), rec(1030.0, 20)]
    # A paced drill's `slow` faults (every rank, step 1) are no faults to mark: only the node kill is.
    pacing = [ev(1001.5, EventKind.FAULT, r, step=1, kind="slow") for r in range(4)]
    tl = build_timeline(metrics, events + pacing, fault_times=[1010.0])
    assert [m.label for m in tl.faults] == ["fault @15"]
    assert len(tl.restarts) == 1 and tl.outages[0].start == pytest.approx(10.0)
    tx, ty = tl.world_size_time
    assert [v for v in ty if not math.isnan(v)] == [4.0, 4.0, 2.0, 2.0]
    assert tx[0] == 0.0 and tx[-1] == pytest.approx(30.0), "the world size spans the whole run"


def test_min_loss_includes_the_final_loss() -> None:
    metrics = [{"loss": 2.0}, {"loss": 0.5}, {"loss": 0.4}, {"step": 3}]
    assert loss_figures(metrics, 0.25) == (2.0, 0.25)
    assert loss_figures(metrics, 0.9) == (2.0, 0.4)
    assert loss_figures(metrics, None) == (2.0, 0.4)
    assert loss_figures([], 0.3) == (None, 0.3)


def test_plot_run_writes_a_png(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS))
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e.to_dict()) + "\n" for e in EVENTS))
    png = tmp_path / "run.png"
    # A drill passes its outside faults; its copy of the worker's own fault event is drawn once.
    tl = plot_run(tmp_path, png, fault_times=[110.0, 111.0], title="a drill")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [m.label for m in tl.faults] == ["fault: kill rank 1 @35", "fault @35"] and len(tl.outages) == 1


def test_restarts_that_never_stepped_make_one_outage_and_none_before_the_first_step() -> None:
    events = [
        ev(1000.0, EventKind.START, 0, world_size=2),
        ev(1002.0, EventKind.FIRST_STEP, 0, step=1, world_size=2),
        ev(1010.0, EventKind.START, 0, 1, world_size=2),  # re-formed, died before its first step
        ev(1020.0, EventKind.START, 0, 2, world_size=2),
        ev(1022.0, EventKind.RESTORE, 0, 2, step=10, store="local"),
        ev(1025.0, EventKind.FIRST_STEP, 0, 2, step=11, world_size=2),
    ]
    tl = build_timeline([rec(1005.0, 10), rec(1030.0, 15)], events)
    assert [(c.start, c.end, c.last_step, c.first_step, c.resumed_from) for c in tl.outages] == [
        (5.0, 25.0, 10, 11, 10)
    ]
    assert [m.label for m in tl.restarts] == ["restart 1", "restart 2 (from @10)"]
    tx, _ = tl.world_size_time
    assert tx[3:5] == [10.0, 20.0], "a cohort that never stepped lasts until the next restart"
    # A run that never stepped: all start-up, no outage.
    never = build_timeline([], [e for e in events if e.kind is EventKind.START])
    assert never.outages == [] and never.startup is not None
    assert (never.startup.start, never.startup.end) == (0.0, 20.0)
