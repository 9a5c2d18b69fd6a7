"""What a campaign reports: each case's result, per-scenario aggregates, run timelines, and the three
files (`report.json`, `junit.xml` in `campaign_junit`, `report.html` in `campaign_html`)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from orchestrator.drills.report import DrillReport
from training.contract import write_json

__all__ = [
    "JUNIT_XML",
    "REPORT_HTML",
    "REPORT_JSON",
    "Case",
    "CaseResult",
    "CaseState",
    "aggregate",
    "timeline_of",
    "write_reports",
]

REPORT_JSON = "report.json"
JUNIT_XML = "junit.xml"
REPORT_HTML = "report.html"
_TIMELINE_POINTS = 240  # per series in report.json: enough for a 600-pixel-wide drawing


class CaseState(StrEnum):
    PASSED = "passed"
    FAILED = "failed"  # the verdict failed
    INCONCLUSIVE = "inconclusive"  # the drill proved nothing: its fault struck a job that had finished
    ERROR = "error"  # the drill could not be carried out (a backend error, a timeout)
    SKIPPED = "skipped"  # the job (or this machine) cannot take the scenario
    NOT_RUN = "not-run"  # stopped early by --max-failures

    @property
    def counts_as_failure(self) -> bool:
        """Fails the campaign and counts towards --max-failures: an unproven case is no proof either."""
        return self in (CaseState.FAILED, CaseState.INCONCLUSIVE, CaseState.ERROR)


@dataclass(frozen=True)
class Case:
    scenario: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.scenario}-seed{self.seed}"


@dataclass
class CaseResult:
    """One scenario x seed: its state, its drill report (as JSON), and its run's timeline."""

    scenario: str
    seed: int
    state: CaseState
    duration_s: float = 0.0
    dir: str | None = None  # the case directory, relative to the out directory
    reason: str | None = None  # why skipped, not run, inconclusive or in error
    report: dict[str, Any] | None = None  # `DrillReport.to_dict()`
    timeline: dict[str, Any] | None = None  # `timeline_of` the faulted run
    resumed: bool = False  # finished by an earlier invocation of the campaign

    @property
    def case(self) -> Case:
        return Case(self.scenario, self.seed)

    @property
    def failed_checks(self) -> list[dict[str, Any]]:
        return [c for c in (self.report or {}).get("checks", []) if not c.get("passed")]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["name"] = self.case.name
        data["state"] = str(self.state)
        data["failed_checks"] = self.failed_checks
        return data


def _nearest_rank(values: Sequence[float], q: float) -> float:
    """The q-quantile by the nearest-rank method (an observed value: small campaigns have 3 seeds)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def aggregate(results: Sequence[CaseResult]) -> dict[str, Any]:
    """Per-scenario pass rate, MTTR median/p90/max, lost steps median/max, and recovery paths.

    An inconclusive case ran but passed nothing: it is in `ran` (the pass rate counts it against the
    scenario) and counted apart from `failed`."""
    out: dict[str, Any] = {}
    for scenario in dict.fromkeys(r.scenario for r in results):
        mine = [r for r in results if r.scenario == scenario]
        ran = [r for r in mine if r.state not in (CaseState.SKIPPED, CaseState.NOT_RUN)]
        passed = sum(r.state is CaseState.PASSED for r in ran)
        inconclusive = sum(r.state is CaseState.INCONCLUSIVE for r in ran)
        reports = [r.report for r in ran if r.report is not None]
        mttr = [float(x["mttr_seconds"]) for x in reports if x.get("mttr_seconds") is not None]
        lost = [int(x["lost_steps"]) for x in reports if x.get("lost_steps") is not None]
        paths: dict[str, int] = {}
        for x in reports:
            if x.get("recovery_path"):  # reported by the scenarios that recover in place or by restart
                paths[str(x["recovery_path"])] = paths.get(str(x["recovery_path"]), 0) + 1
        out[scenario] = {
            "cases": len(mine),
            "ran": len(ran),
            "passed": passed,
            "failed": len(ran) - passed - inconclusive,
            "inconclusive": inconclusive,
            "skipped": sum(r.state is CaseState.SKIPPED for r in mine),
            "not_run": sum(r.state is CaseState.NOT_RUN for r in mine),
            "pass_rate": round(passed / len(ran), 4) if ran else None,
            "mttr_s": {
                "n": len(mttr),
                "median": round(statistics.median(mttr), 3) if mttr else None,
                "p90": round(_nearest_rank(mttr, 0.9), 3) if mttr else None,
                "max": round(max(mttr), 3) if mttr else None,
            },
            "lost_steps": {
                "n": len(lost),
                "median": statistics.median(lost) if lost else None,
                "max": max(lost) if lost else None,
            },
            "recovery_paths": paths,
            "skip_reason": next((r.reason for r in mine if r.state is CaseState.SKIPPED), None),
        }
    return out


# -- timelines ------------------------------------------------------------------------------------------
def _clean(values: Sequence[float]) -> list[float | None]:
    return [None if math.isnan(v) else round(v, 3) for v in values]


def _thin(xs: Sequence[float], ys: Sequence[float], limit: int) -> tuple[list[float], list[float]]:
    """Every k-th point (NaN breaks kept, so lines stay broken across restarts)."""
    if len(xs) <= limit:
        return list(xs), list(ys)
    k = math.ceil(len(xs) / limit)
    keep = [i for i in range(len(xs)) if i % k == 0 or math.isnan(ys[i]) or i == len(xs) - 1]
    return [xs[i] for i in keep], [ys[i] for i in keep]


def timeline_of(report: DrillReport | dict[str, Any]) -> dict[str, Any] | None:
    """Throughput and world size over time of the drill's faulted run (seconds since its first record),
    with its faults, restarts and restores; None when the run directory is gone."""
    from orchestrator.drills.history import RunHistory
    from orchestrator.plot import build_timeline
    from training.contract import DrillEventKind

    data = report.to_dict() if isinstance(report, DrillReport) else report
    run_dir = data.get("run_dir")
    if not run_dir or not Path(run_dir).is_dir():
        return None
    history = RunHistory.load(run_dir)
    if not history.metrics and not history.events:
        return None
    outside = [float(e["time"]) for e in data.get("events", []) if e.get("event") == DrillEventKind.FAULT_INJECTED]
    tl = build_timeline(history.metrics, history.events, fault_times=outside)
    t, sps = _thin(tl.series.times, tl.series.samples_per_s, _TIMELINE_POINTS)
    wt, ws = _thin(*tl.world_size_time, _TIMELINE_POINTS)
    return {
        "end_s": round(tl.end, 3),
        "t": _clean(t),
        "samples_per_s": _clean(sps),
        "world_size_t": _clean(wt),
        "world_size": _clean(ws),
        "faults": [{"t": round(m.time, 3), "label": m.label} for m in tl.faults],
        "restarts": [{"t": round(m.time, 3), "label": m.label} for m in tl.restarts],
    }


# -- files -------------------------------------------------------------------------------------------
def write_reports(data: dict[str, Any], out_dir: str | Path) -> None:
    """report.json, junit.xml and report.html in `out_dir`, from a campaign's document
    (`CampaignResult.to_dict()`)."""
    from orchestrator.drills.campaign_html import render_html
    from orchestrator.drills.campaign_junit import render_junit

    out = Path(out_dir)
    write_json(out / REPORT_JSON, data)
    (out / JUNIT_XML).write_text(render_junit(data))
    (out / REPORT_HTML).write_text(render_html(data))
