"""Drill campaigns: every chosen scenario x every seed against one job, judged as one gate.

A campaign is a loop over `run_drill`, with what a platform team needs around it before a large job
depends on a cluster:

- cases the job cannot take (kill-node on a one-node job, partition without network namespaces) are
  reported as skipped with the reason, never dropped;
- one uninterrupted reference per world size serves every case (`DrillOptions.shared_reference`;
  scenario patches change stores and timeouts, never the numerics), and `references.json` in the out
  directory keeps it for a resumed campaign;
- each case runs in `OUT/cases/<scenario>-seed<N>/`; a case whose `report.json` is there is finished and
  a re-run skips it, a case directory without one was interrupted and is run again from scratch;
- after every case, `report.json` (every case's report and per-scenario aggregates), `junit.xml` and
  `report.html` are rewritten, so a campaign killed halfway still leaves a readable report card.

The drill itself is injected (`DrillRunner`), so the campaign logic is tested with recorded reports.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.drills.campaign_report import (
    REPORT_JSON,
    Case,
    CaseResult,
    CaseState,
    aggregate,
    timeline_of,
    write_reports,
)
from orchestrator.drills.plan import DrillOptions
from orchestrator.drills.report import DrillReport
from orchestrator.drills.scenarios import SCENARIOS, get_scenario
from orchestrator.errors import EXIT_FAILED, EXIT_OK, SpecError, TorchrigError
from orchestrator.spec import JobSpec
from training.contract import read_json, write_json

__all__ = [
    "CampaignOptions",
    "CampaignProgress",
    "CampaignResult",
    "Case",
    "CaseResult",
    "CaseState",
    "DrillRunner",
    "aggregate",
    "parse_scenarios",
    "parse_seeds",
    "run_campaign",
    "skip_reason",
]

DrillRunner = Callable[[str, JobSpec, DrillOptions], DrillReport]

REFERENCES_JSON = "references.json"
ERROR_TXT = "error.txt"  # a case that raised: its traceback
CASES_DIR = "cases"


@dataclass(frozen=True)
class CampaignOptions:
    """What a campaign runs (the `torchrig drill campaign` flags).

    Attributes:
        scenarios: Scenario names, in order.
        seeds: Seeds; each picks the fault's step, rank and damage of every scenario.
        out_dir: Where cases, references and the reports go (a re-run resumes there).
        drill: Options of every drill (backend, timeouts); seed, nodes and drill_dir are set per case.
        max_failures: Stop after this many failed cases (the rest are reported as not run).
        job_file: The job file's path, for the reports.
    """

    scenarios: tuple[str, ...]
    seeds: tuple[int, ...]
    out_dir: str
    drill: DrillOptions = field(default_factory=DrillOptions)
    max_failures: int | None = None
    job_file: str = ""

    def cases(self) -> list[Case]:
        """Seed-major order: with --max-failures, every scenario gets its first seed before any its second."""
        return [Case(scenario, seed) for seed in self.seeds for scenario in self.scenarios]


class CampaignProgress:
    """Told as the campaign goes (no-op here; the CLI draws a progress bar)."""

    def started(self, total: int, finished: int) -> None:
        """`total` cases, of which `finished` are done already (skipped, or finished by an earlier run)."""

    def case_started(self, case: Case, index: int) -> None:
        """Case number `index` (from 1) starts running."""

    def case_finished(self, result: CaseResult, index: int, eta_s: float | None) -> None:
        """Case number `index` is done; `eta_s` estimates the seconds the remaining cases need."""


def parse_scenarios(value: str) -> tuple[str, ...]:
    """`all` (every registered scenario) or a comma-separated list of scenario names."""
    if value.strip() == "all":
        return tuple(SCENARIOS)
    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise SpecError(
            f"--scenarios: unknown drill {', '.join(map(repr, unknown)) or repr(value)}; "
            f"valid: all or a comma-separated list of {', '.join(SCENARIOS)}"
        )
    return names


def parse_seeds(num_seeds: int | None, seed_list: str | None) -> tuple[int, ...]:
    """`--seeds N` (0..N-1, default 3) or `--seed-list 1,5,9`, not both."""
    if num_seeds is not None and seed_list is not None:
        raise SpecError("--seeds, --seed-list: give one of them, not both")
    if seed_list is not None:
        try:
            seeds = tuple(dict.fromkeys(int(s) for s in seed_list.split(",") if s.strip()))
        except ValueError:
            raise SpecError(f"--seed-list: must be comma-separated integers, got {seed_list!r}") from None
        if not seeds:
            raise SpecError("--seed-list: must name at least one seed")
        return seeds
    count = 3 if num_seeds is None else num_seeds
    if count < 1:
        raise SpecError(f"--seeds: must be at least 1, got {count}")
    return tuple(range(count))


def skip_reason(scenario_name: str, spec: JobSpec, drill: DrillOptions) -> str | None:
    """Why this job cannot take this scenario on this backend and machine, or None."""
    scenario = get_scenario(scenario_name)
    nodes = drill.nodes or scenario.default_nodes(spec)
    if drill.backend == "kubernetes" and scenario_name != "kill-worker":
        return "only kill-worker runs on a cluster (--backend kubernetes); run the others on the local backend"
    if drill.backend != "local" and (scenario.needs_nodes > 1 or scenario.needs_network):
        return f"needs the local backend's emulated nodes (got --backend {drill.backend})"
    if nodes > spec.spec.nodes.max:
        return f"needs {nodes} nodes; spec.nodes.max is {spec.spec.nodes.max}"
    return scenario.unmet(spec, nodes)


@dataclass
class CampaignResult:
    """Every case of one campaign, and what the reports are made from."""

    job: str
    options: CampaignOptions
    cases: list[CaseResult]
    started: float
    wall_s: float = 0.0
    references: dict[str, str] = field(default_factory=dict)  # world size -> reference run dir

    def count(self, state: CaseState) -> int:
        return sum(r.state is state for r in self.cases)

    @property
    def passed(self) -> bool:
        """Every case that could run did, and passed (skipped cases are reported, not failed; an
        inconclusive case did not pass)."""
        ran = [r for r in self.cases if r.state is not CaseState.SKIPPED]
        return bool(ran) and all(r.state is CaseState.PASSED for r in ran)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.passed else EXIT_FAILED

    def to_dict(self) -> dict[str, Any]:
        drill = self.options.drill
        return {
            "campaign": {
                "job": self.job,
                "job_file": self.options.job_file,
                "out_dir": str(Path(self.options.out_dir).absolute()),
                "backend": drill.backend,
                "scenarios": list(self.options.scenarios),
                "seeds": list(self.options.seeds),
                "max_failures": self.options.max_failures,
                "started": self.started,
                "wall_s": round(self.wall_s, 3),  # this invocation (a resumed campaign: only the rest)
                "cases_s": round(sum(r.duration_s for r in self.cases), 3),  # every case, earlier runs too
                "references": dict(self.references),
            },
            "verdict": "pass" if self.passed else "fail",
            "counts": {str(s): self.count(s) for s in CaseState},
            "scenarios": aggregate(self.cases),
            "cases": [r.to_dict() for r in self.cases],
        }


# -- running --------------------------------------------------------------------------------------------
def _result_of(case: Case, report: dict[str, Any], duration_s: float, case_dir: str) -> CaseResult:
    verdict = report.get("verdict")
    reason = None
    if verdict == "pass":
        state = CaseState.PASSED
    elif verdict == "inconclusive":
        state, reason = CaseState.INCONCLUSIVE, str(report.get("inconclusive") or "inconclusive")
    else:
        state = CaseState.FAILED
    return CaseResult(case.scenario, case.seed, state, round(duration_s, 3), case_dir, reason=reason, report=report)


def _load_references(out: Path, spec: JobSpec, drill: DrillOptions) -> dict[str, str]:
    """Adopt the references an earlier invocation ran (world size -> run dir) that still succeeded."""
    from orchestrator.drills.runner import adopt_reference

    known = read_json(out / REFERENCES_JSON) or {}
    adopted: dict[str, str] = {}
    for nodes, run_dir in known.get("by_nodes", {}).items():
        if adopt_reference(drill.backend, int(nodes), spec, run_dir):
            adopted[str(int(nodes) * spec.spec.procs_per_node)] = str(run_dir)
    return adopted


def run_campaign(
    spec: JobSpec,
    options: CampaignOptions,
    *,
    drill: DrillRunner | None = None,
    progress: CampaignProgress | None = None,
) -> CampaignResult:
    """Run every case of `options` against `spec` (resuming in `options.out_dir`) and write the reports.

    Args:
        spec: The job.
        options: Scenarios, seeds, out directory, drill options, --max-failures.
        drill: Runs one drill (default `run_drill`; tests pass recorded reports).
        progress: Told as cases start and finish.

    Returns:
        Every case's result; `exit_code` is the campaign's verdict.
    """
    if drill is None:
        from orchestrator.drills.runner import run_drill

        drill = run_drill
    progress = progress or CampaignProgress()
    out = Path(options.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reference = options.drill.reference and options.drill.backend != "kubernetes"
    references = _load_references(out, spec, options.drill) if reference else {}
    by_nodes = {str(int(ws) // spec.spec.procs_per_node): d for ws, d in references.items()}
    result = CampaignResult(spec.name, options, [], started=time.time(), references=references)
    t_start = time.monotonic()

    cases = options.cases()
    skips = {c: skip_reason(c.scenario, spec, options.drill) for c in cases}
    done = {c for c in cases if skips[c] is None and (out / CASES_DIR / c.name / REPORT_JSON).is_file()}
    progress.started(len(cases), sum(r is not None for r in skips.values()) + len(done))
    durations: list[float] = []
    failures = 0
    for index, case in enumerate(cases, start=1):
        rel = f"{CASES_DIR}/{case.name}"
        case_dir = out / rel
        scenario = get_scenario(case.scenario)
        nodes = options.drill.nodes or scenario.default_nodes(spec)
        if skips[case] is not None:
            res = CaseResult(case.scenario, case.seed, CaseState.SKIPPED, reason=skips[case])
        elif options.max_failures is not None and failures >= options.max_failures:
            reason = f"not run: --max-failures {options.max_failures} reached"
            res = CaseResult(case.scenario, case.seed, CaseState.NOT_RUN, reason=reason)
        elif case in done:
            report = read_json(case_dir / REPORT_JSON) or {}
            res = _result_of(case, report, float(report.get("campaign_duration_s") or 0.0), rel)
            res.resumed = True
            res.timeline = timeline_of(report)
        else:
            if case_dir.exists():
                shutil.rmtree(case_dir)  # interrupted by an earlier invocation: run it again from scratch
            progress.case_started(case, index)
            case_options = dataclasses.replace(
                options.drill,
                seed=case.seed,
                nodes=nodes,
                drill_dir=str(case_dir.absolute()),
                shared_reference=reference,
            )
            t0 = time.monotonic()
            try:
                drilled = drill(case.scenario, spec, case_options)
            except TorchrigError as exc:
                duration = time.monotonic() - t0
                res = CaseResult(case.scenario, case.seed, CaseState.ERROR, round(duration, 3), rel, reason=str(exc))
            except Exception as exc:  # one broken case must not cost the campaign its other cases
                duration = time.monotonic() - t0
                case_dir.mkdir(parents=True, exist_ok=True)
                (case_dir / ERROR_TXT).write_text(traceback.format_exc())
                reason = f"{type(exc).__name__}: {exc} (traceback in {rel}/{ERROR_TXT})"
                res = CaseResult(case.scenario, case.seed, CaseState.ERROR, round(duration, 3), rel, reason=reason)
            else:
                duration = time.monotonic() - t0
                data = drilled.to_dict()
                data["campaign_duration_s"] = round(duration, 3)
                case_dir.mkdir(parents=True, exist_ok=True)
                write_json(case_dir / REPORT_JSON, data)
                res = _result_of(case, data, duration, rel)
                res.timeline = timeline_of(data)
                if drilled.reference_run_dir and reference and str(nodes) not in by_nodes:
                    by_nodes[str(nodes)] = drilled.reference_run_dir
                    references[str(nodes * spec.spec.procs_per_node)] = drilled.reference_run_dir
                    write_json(out / REFERENCES_JSON, {"by_nodes": by_nodes})
            durations.append(duration)
        if res.state.counts_as_failure:
            failures += 1
        result.cases.append(res)
        result.wall_s = time.monotonic() - t_start
        write_reports(result.to_dict(), out)
        stopped = options.max_failures is not None and failures >= options.max_failures
        progress.case_finished(res, index, 0.0 if stopped else _eta(cases[index:], skips, done, durations))
    return result


def _eta(rest: Sequence[Case], skips: dict[Case, str | None], done: set[Case], durations: list[float]) -> float | None:
    """The mean duration of the cases run so far, times the cases still to run."""
    if not durations:
        return None
    left = sum(1 for c in rest if skips[c] is None and c not in done)
    return statistics.fmean(durations) * left
