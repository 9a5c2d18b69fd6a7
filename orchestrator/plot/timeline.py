"""What the run plot shows, computed from a run's records without drawing anything.

A run's history is rank 0's `metrics.jsonl` (one record every `logEvery` steps) and every rank's
`events.jsonl`. A restart shows there as a new `start` event of rank 0: the group (re)formed. The
elastic generation is no marker of it (torchelastic does not count a membership change as a restart),
so restarts are told by rank 0's start events, and the records between two of them form one *cohort*.

Everything here is a pure function of those records, with times in seconds since the run's first
record, so that tests can check the gaps, markers and outages on synthetic events.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from training.contract import Event, EventKind

__all__ = [
    "Interval",
    "Marker",
    "RunTimeline",
    "Series",
    "break_series",
    "build_timeline",
    "outages",
    "restart_times",
]

NAN = math.nan

# Events that a rank writes right after completing the step they carry: the last of them before a
# restart is when progress stopped.
_STEP_DONE = (EventKind.STEP_TIMES, EventKind.FIRST_STEP, EventKind.FAULT, EventKind.FINISHED)


@dataclass(frozen=True)
class Marker:
    """A moment of the run: `time` in seconds since the run's first record, `step` when known."""

    time: float
    step: int | None
    label: str


@dataclass(frozen=True)
class Interval:
    """A stretch of wall time without training steps (an outage, or the start before the first step).

    Attributes:
        start: Seconds since the first record when the last step before it completed.
        end: When the first step after it completed (the end of the run when none did).
        last_step: The last step completed before it.
        first_step: The first step completed after it (None: the run never recovered).
        resumed_from: The step the group restored (the steps after it up to `last_step` were redone).
    """

    start: float
    end: float
    last_step: int | None = None
    first_step: int | None = None
    resumed_from: int | None = None


@dataclass
class Series:
    """Rank 0's metrics records, with NaN rows where a line must not be drawn (a restart between two
    records, or a step going backwards after a restore)."""

    steps: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)


@dataclass
class RunTimeline:
    """Everything the run plot draws (times in seconds since `t0`)."""

    t0: float
    end: float
    series: Series
    restarts: list[Marker]
    restores: list[Marker]
    faults: list[Marker]
    checkpoints: list[Marker]
    eval_loss: list[tuple[int, float, float]]  # (step, time, loss)
    outages: list[Interval]
    startup: Interval | None
    world_size_time: tuple[list[float], list[float]]  # x (s), size; NaN between cohorts
    world_size_step: tuple[list[float], list[float]]  # x (step), size; NaN between cohorts


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else NAN


def _as_events(events: Iterable[Event | Mapping[str, Any]]) -> list[Event]:
    out = [e if isinstance(e, Event) else Event.from_dict(dict(e)) for e in events]
    return sorted(out, key=lambda e: e.time)


def restart_times(events: Sequence[Event]) -> list[float]:
    """When the group re-formed: rank 0's `start` events after its first one (absolute times)."""
    starts = sorted(e.time for e in events if e.kind is EventKind.START and e.rank == 0)
    return starts[1:]


def _cohort(t: float, restarts: Sequence[float]) -> int:
    """0 before the first restart, i after restart i."""
    return sum(1 for r in restarts if r <= t)


def break_series(metrics: Sequence[Mapping[str, Any]], restarts: Sequence[float], t0: float) -> Series:
    """Rank 0's records in time order, a NaN row between two records a line must not join.

    A line breaks where the step does not advance (the group restored an older checkpoint) or a
    restart lies between the two records (an outage, however short, trained nothing).
    """
    records = sorted(
        (m for m in metrics if isinstance(m.get("time"), (int, float)) and isinstance(m.get("step"), int)),
        key=lambda m: float(m["time"]),
    )
    out = Series()
    prev: Mapping[str, Any] | None = None
    for m in records:
        if prev is not None and (
            m["step"] <= prev["step"] or _cohort(float(m["time"]), restarts) != _cohort(float(prev["time"]), restarts)
        ):
            for column in (out.steps, out.times, out.loss, out.samples_per_s):
                column.append(NAN)
        out.steps.append(float(m["step"]))
        out.times.append(float(m["time"]) - t0)
        out.loss.append(_num(m.get("loss")))
        out.samples_per_s.append(_num(m.get("samples_per_s")))
        prev = m
    return out


def _step_points(metrics: Sequence[Mapping[str, Any]], events: Sequence[Event]) -> list[tuple[float, int]]:
    """(absolute time, step) of every record that says a step had completed then."""
    points = [
        (float(m["time"]), int(m["step"]))
        for m in metrics
        if isinstance(m.get("time"), (int, float)) and isinstance(m.get("step"), int)
    ]
    points += [(e.time, e.step) for e in events if e.kind in _STEP_DONE and e.step is not None]
    return sorted(points)


def step_at(points: Sequence[tuple[float, int]], t: float) -> int | None:
    """The step of the newest step record at or before `t`."""
    before = [s for when, s in points if when <= t]
    return before[-1] if before else None


def _first_steps(events: Sequence[Event]) -> list[tuple[float, int]]:
    return sorted((e.time, e.step) for e in events if e.kind is EventKind.FIRST_STEP and e.step is not None)


def _restored(events: Sequence[Event], lower: float, upper: float) -> int | None:
    """The step the group restored between two restarts (None: it started from scratch)."""
    steps = [e.step for e in events if e.kind is EventKind.RESTORE and e.step is not None and lower <= e.time < upper]
    return steps[0] if steps else None


def outages(
    metrics: Sequence[Mapping[str, Any]],
    events: Sequence[Event],
    *,
    fault_times: Sequence[float] = (),
    t0: float = 0.0,
    end: float | None = None,
) -> list[Interval]:
    """The stretches without steps after the run had stepped: from the last completed step before a
    restart to the first step after it (the end of the run when none came).

    Restarts that fail before their first step (the group re-formed, then died again) belong to one
    outage. A restart before any step at all is part of the start-up, not an outage. `fault_times`
    are faults injected from outside the workers (a drill killing a node): when one falls after the
    last step record before a restart, progress stopped there (records come only every `logEvery`
    steps).
    """
    restarts = restart_times(events)
    points = _step_points(metrics, events)
    firsts = _first_steps(events)
    stop = end if end is not None else max([p[0] for p in points] + [e.time for e in events] + [t0])
    out: list[Interval] = []
    for i, r in enumerate(restarts):
        upper = restarts[i + 1] if i + 1 < len(restarts) else math.inf
        before = [(t, s) for t, s in points if t < r]
        if not before:
            continue  # still starting up
        begin, last_step = before[-1]
        late_faults = [f for f in fault_times if begin < f < r]
        if late_faults:
            begin = max(late_faults)
        after = [(t, s) for t, s in firsts if r < t < upper]
        finish, first_step = after[0] if after else (min(upper, stop), None)
        cut = Interval(
            start=begin - t0,
            end=finish - t0,
            last_step=last_step,
            first_step=first_step,
            resumed_from=_restored(events, r, upper),
        )
        if out and out[-1].first_step is None and out[-1].last_step == last_step:
            cut = Interval(out[-1].start, cut.end, last_step, first_step, cut.resumed_from)
            out.pop()  # the previous restart never stepped: one outage
        out.append(cut)
    return out


def _startup(events: Sequence[Event], t0: float, end: float) -> Interval | None:
    """From the first start to the first step (the end of the run when none came)."""
    starts = [e.time for e in events if e.kind is EventKind.START]
    if not starts:
        return None
    firsts = _first_steps(events)
    if firsts:
        return Interval(start=min(starts) - t0, end=firsts[0][0] - t0, first_step=firsts[0][1])
    return Interval(start=min(starts) - t0, end=end)


def _first_per_cohort(events: Sequence[Event], kind: EventKind, restarts: Sequence[float]) -> list[Event]:
    """The first event of `kind` per (cohort, step): every rank writes one, the plot wants one."""
    seen: set[tuple[int, int | None]] = set()
    out: list[Event] = []
    for e in events:
        if e.kind is not kind:
            continue
        key = (_cohort(e.time, restarts), e.step)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def _world_size(
    events: Sequence[Event],
    points: Sequence[tuple[float, int]],
    fault_times: Sequence[float],
    t0: float,
    end: float,
) -> tuple[tuple[list[float], list[float]], tuple[list[float], list[float]]]:
    """Each cohort's world size, by time and by the steps it covered; NaN between cohorts.

    By time, a cohort lasts from its start to its last step (a fault after it, when a drill gives
    one), or to the next restart when it never stepped; the last one lasts to the end of the run.
    """
    starts = sorted((e for e in events if e.kind is EventKind.START and e.rank == 0), key=lambda e: e.time)
    restarts = [e.time for e in starts[1:]]
    tx: list[float] = []
    ty: list[float] = []
    sx: list[float] = []
    sy: list[float] = []
    for i, start in enumerate(starts):
        size = _num(start.get("world_size"))
        upper = restarts[i] if i < len(restarts) else math.inf
        mine = [(t, s) for t, s in points if start.time <= t < upper]
        if upper == math.inf:
            stop = end + t0
        elif mine:
            stop = max([mine[-1][0]] + [f for f in fault_times if mine[-1][0] < f < upper])
        else:
            stop = upper
        if tx:
            tx.append(NAN)
            ty.append(NAN)
        tx += [start.time - t0, max(stop, start.time) - t0]
        ty += [size, size]
        if mine:
            resumed = _restored(events, start.time, upper)
            if sx:
                sx.append(NAN)
                sy.append(NAN)
            sx += [float(resumed or 0), float(max(s for _, s in mine))]
            sy += [size, size]
    return (tx, ty), (sx, sy)


def build_timeline(
    metrics: Sequence[Mapping[str, Any]],
    events: Iterable[Event | Mapping[str, Any]],
    *,
    fault_times: Sequence[float] = (),
) -> RunTimeline:
    """The run plot's data from rank 0's metrics records and the run's events.

    Args:
        metrics: metrics.jsonl records (`time`, `step`, `loss`, `samples_per_s`, ...).
        events: events.jsonl lines (`Event`s or their dicts).
        fault_times: Absolute times of faults injected from outside the workers (a drill's).
    """
    evs = _as_events(events)
    times = [float(m["time"]) for m in metrics if isinstance(m.get("time"), (int, float))]
    times += [e.time for e in evs if e.time] + list(fault_times)
    t0 = min(times) if times else 0.0
    end = (max(times) if times else 0.0) - t0
    restarts = restart_times(evs)
    cuts = outages(metrics, evs, fault_times=fault_times, t0=t0, end=end + t0)
    points = _step_points(metrics, evs)

    restores = [
        Marker(e.time - t0, e.step, f"restore @{e.step}") for e in _first_per_cohort(evs, EventKind.RESTORE, restarts)
    ]
    restart_markers: list[Marker] = []
    for i, r in enumerate(restarts):
        resumed = _restored(evs, r, restarts[i + 1] if i + 1 < len(restarts) else math.inf)
        label = f"restart {i + 1}" + (f" (from @{resumed})" if resumed is not None else "")
        restart_markers.append(Marker(r - t0, resumed, label))
    faults = [
        Marker(e.time - t0, e.step, f"fault: {e.get('kind') or '?'} rank {e.rank} @{e.step}")
        for e in evs
        # A drill's `slow` fault only paces every rank (so that an outside fault lands mid-run): no fault
        # to mark, and one label per rank at step 1 overprinted each other and the real fault's.
        if e.kind is EventKind.FAULT and e.get("kind") != "slow"
    ]
    worker_faults = [e.time for e in evs if e.kind is EventKind.FAULT]
    for f in fault_times:
        if any(abs(f - w) < 0.5 for w in worker_faults):
            continue  # a drill's copy of the worker's own fault event
        step = step_at(points, f)
        faults.append(Marker(f - t0, step, f"fault @{step}" if step is not None else "fault"))
    commits = [
        Marker(e.time - t0, e.step, f"checkpoint @{e.step}")
        for e in _first_per_cohort(evs, EventKind.CHECKPOINT_COMMITTED, restarts)
    ]
    # A restore proves its checkpoint was committed even when the commit event never made it to the log
    # (the committing rank was killed between writing the manifest and writing the event): mark it at the
    # time its step completed.
    committed = {m.step for m in commits}
    for restore in restores:
        if restore.step is None or restore.step in committed:
            continue
        reached = [when for when, s in points if s >= restore.step and when - t0 <= restore.time]
        if reached:
            commits.append(Marker(min(reached) - t0, restore.step, f"checkpoint @{restore.step} (seen on restore)"))
            committed.add(restore.step)
    commits.sort(key=lambda m: m.time)
    eval_loss: list[tuple[int, float, float]] = []
    for e in _first_per_cohort(evs, EventKind.EVAL, restarts):
        loss = (e.get("metrics") or {}).get("loss")
        if e.step is not None and isinstance(loss, (int, float)):
            eval_loss.append((e.step, e.time - t0, float(loss)))
    by_time, by_step = _world_size(evs, points, fault_times, t0, end)
    return RunTimeline(
        t0=t0,
        end=end,
        series=break_series(metrics, restarts, t0),
        restarts=restart_markers,
        restores=restores,
        faults=sorted(faults, key=lambda m: m.time),
        checkpoints=commits,
        eval_loss=eval_loss,
        outages=cuts,
        startup=_startup(evs, t0, end),
        world_size_time=by_time,
        world_size_step=by_step,
    )
