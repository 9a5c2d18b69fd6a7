"""Reading what a run left behind (events.jsonl, metrics.jsonl, result/summary) for drill verdicts.

Everything here works on the run-directory contract of docs/architecture.md, so it judges a local run,
a Ray run or a run directory copied from a pod the same way.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.backends._local_rundir import read_jsonl

__all__ = ["RunHistory", "read_jsonl"]


@dataclass
class RunHistory:
    """The timeline of one run directory."""

    run_dir: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, run_dir: str | Path) -> RunHistory:
        run_dir = Path(run_dir)

        def _json(name: str) -> dict[str, Any]:
            path = run_dir / name
            if not path.exists():
                return {}
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError:
                return {}
            return data if isinstance(data, dict) else {}

        events = sorted(read_jsonl(run_dir / "events.jsonl"), key=lambda e: float(e.get("time", 0.0)))
        metrics = sorted(read_jsonl(run_dir / "metrics.jsonl"), key=lambda m: float(m.get("time", 0.0)))
        return cls(run_dir, events, metrics, _json("summary.json"), _json("result.json"))

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == event]

    def first_step_after(self, t: float) -> dict[str, Any] | None:
        """The first step completed after time `t` (a `first_step` event of a new generation, else a step record)."""
        candidates = [e for e in self.events if e.get("event") in ("first_step", "step") and float(e["time"]) > t]
        candidates += [m for m in self.metrics if float(m.get("time", 0)) > t]
        if not candidates:
            return None
        return min(candidates, key=lambda r: float(r["time"]))

    def restores_after(self, t: float) -> list[dict[str, Any]]:
        return [e for e in self.of("restore") if float(e["time"]) >= t]

    def world_sizes(self) -> list[int]:
        """World sizes in order of appearance (consecutive duplicates collapsed)."""
        seen: list[int] = []
        for record in sorted(self.of("start") + self.metrics, key=lambda r: float(r.get("time", 0))):
            ws = record.get("world_size")
            if isinstance(ws, int) and (not seen or seen[-1] != ws):
                seen.append(ws)
        return seen

    def per_rank_step_s(self) -> dict[int, float]:
        """Median step time per rank from the `step_times` events (straggler detection)."""
        by_rank: dict[int, list[float]] = {}
        for e in self.of("step_times"):
            if "rank" not in e or "step_s" not in e:
                continue
            # Compute time = step time minus time blocked in gradient collectives: fast ranks wait for
            # the straggler inside the all-reduce, so only compute time tells them apart.
            compute = float(e.get("compute_s", float(e["step_s"]) - float(e.get("comm_s", 0.0))))
            by_rank.setdefault(int(e["rank"]), []).append(compute)
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
