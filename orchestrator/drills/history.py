"""Reading what a run left behind (events.jsonl, metrics.jsonl, result/summary) for drill verdicts.

Everything here reads the run directory through `training.contract` (`RunFiles`, `read_events`,
`Summary`, `Result`), so it judges a local run, a Ray run or a run directory copied from a pod the same
way.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from training.contract import Event, EventKind, Result, RunFiles, Summary, read_events, read_jsonl

__all__ = ["Reached", "RunHistory"]


class Reached(NamedTuple):
    """A step the job completed, and when."""

    time: float
    step: int | None


def _time(record: dict[str, Any]) -> float:
    value = record.get("time", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


@dataclass
class RunHistory:
    """The timeline of one run directory."""

    run_dir: Path
    events: list[Event] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl: rank 0's step records
    summary: Summary | None = None
    result: Result | None = None

    @classmethod
    def load(cls, run_dir: str | os.PathLike[str]) -> RunHistory:
        files = RunFiles(run_dir)
        return cls(
            run_dir=files.root,
            events=read_events(files.events),
            metrics=sorted(read_jsonl(files.metrics), key=_time),
            summary=Summary.read(files.summary),
            result=Result.read(files.result),
        )

    def of(self, kind: EventKind) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def latest_step(self) -> int:
        """The newest step any record of the run names (0 before the first one)."""
        steps = [m["step"] for m in self.metrics if isinstance(m.get("step"), int)]
        steps += [e.step for e in self.events if e.step is not None]
        return max(steps, default=0)

    def last_step_before(self, t: float) -> int:
        """The newest step a record of the run names from before time `t` (0 before the first one)."""
        steps = [m["step"] for m in self.metrics if isinstance(m.get("step"), int) and _time(m) < t]
        steps += [e.step for e in self.events if e.step is not None and e.time < t]
        return max(steps, default=0)

    def first_step_after(self, t: float) -> Reached | None:
        """The first step completed after time `t` (a `first_step` event of a new generation, else a step record)."""
        candidates = [Reached(e.time, e.step) for e in self.of(EventKind.FIRST_STEP) if e.time > t]
        candidates += [
            Reached(_time(m), m["step"] if isinstance(m.get("step"), int) else None)
            for m in self.metrics
            if _time(m) > t
        ]
        return min(candidates, key=lambda r: r.time) if candidates else None

    def restores_after(self, t: float) -> list[Event]:
        return [e for e in self.of(EventKind.RESTORE) if e.time >= t]

    def last_committed_before(self, t: float | None) -> int | None:
        """The newest step whose commit was recorded at or before time `t`."""
        if t is None:
            return None
        steps = [e.step for e in self.of(EventKind.CHECKPOINT_COMMITTED) if e.time <= t and e.step is not None]
        return max(steps) if steps else None

    def world_size_points(self) -> list[tuple[float, int]]:
        """(time, world size) of every start event and metrics record that names one, in time order."""
        points = [(e.time, e.get("world_size")) for e in self.of(EventKind.START)]
        points += [(_time(m), m.get("world_size")) for m in self.metrics]
        return sorted(((t, ws) for t, ws in points if isinstance(ws, int)), key=lambda p: p[0])

    def world_sizes(self) -> list[int]:
        """World sizes in order of appearance (consecutive duplicates collapsed)."""
        seen: list[int] = []
        for _, ws in self.world_size_points():
            if not seen or seen[-1] != ws:
                seen.append(ws)
        return seen

    def worker_pids(self, rank: int) -> list[int]:
        """PIDs of the live worker(s) holding `rank` (from the newest `start` events)."""
        starts = [e for e in self.of(EventKind.START) if e.rank == rank and isinstance(e.get("pid"), int)]
        if not starts:
            return []
        return [int(max(starts, key=lambda e: e.time).get("pid"))]

    def per_rank_step_s(self) -> dict[int, float]:
        """Median step time per rank from the `step_times` events (straggler detection)."""
        by_rank: dict[int, list[float]] = {}
        for e in self.of(EventKind.STEP_TIMES):
            if e.get("step_s") is None:
                continue
            # Compute time = step time minus time blocked in gradient collectives: fast ranks wait for
            # the straggler inside the all-reduce, so only compute time tells them apart.
            compute = float(e.get("compute_s", float(e.get("step_s")) - float(e.get("comm_s", 0.0))))
            by_rank.setdefault(e.rank, []).append(compute)
        return {rank: statistics.median(values) for rank, values in sorted(by_rank.items()) if values}

    def slowest_rank(self, factor: float = 1.5) -> int | None:
        """The rank whose median step time exceeds `factor` x the median of the others, if any.

        In a synchronous data-parallel job every rank waits for the slowest one in the collectives, so
        whole-step times converge; compute time (step minus collective time) singles out the straggler.
        """
        per_rank = self.per_rank_step_s()
        if len(per_rank) < 2:
            return None
        rank, worst = max(per_rank.items(), key=lambda kv: kv[1])
        others = [v for r, v in per_rank.items() if r != rank]
        baseline = statistics.median(others)
        return rank if baseline > 0 and worst > factor * baseline else None
