"""Drill campaigns with an injected drill runner (recorded-style reports): case selection, skips,
aggregates, JUnit, resume, --max-failures, exit codes and the CLI."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from orchestrator.drills.campaign import (
    CampaignOptions,
    CaseState,
    aggregate,
    parse_scenarios,
    parse_seeds,
    run_campaign,
    skip_reason,
)
from orchestrator.drills.plan import DrillOptions
from orchestrator.drills.report import DrillReport
from orchestrator.drills.scenarios import SCENARIOS
from orchestrator.errors import BackendError, SpecError
from orchestrator.loader import load_spec
from orchestrator.spec import JobSpec
from tests.fixtures.campaign import FakeDrill
from training.contract import write_json

ONE_NODE = ["spec.nodes.min=1", "spec.nodes.max=1"]


def _spec(examples_dir: Path, *overrides: str) -> JobSpec:
    return load_spec(examples_dir / "digits-ddp.yaml", list(overrides))


def _options(tmp_path: Path, scenarios: str = "kill-worker,hang", seeds: int = 3, **kw: Any) -> CampaignOptions:
    return CampaignOptions(
        scenarios=parse_scenarios(scenarios), seeds=parse_seeds(seeds, None), out_dir=str(tmp_path / "out"), **kw
    )


def test_scenarios_and_seeds_are_parsed_and_all_is_the_registry() -> None:
    assert parse_scenarios("all") == tuple(SCENARIOS)
    assert parse_scenarios("hang, kill-worker,hang") == ("hang", "kill-worker")
    with pytest.raises(SpecError, match="--scenarios: unknown drill 'explode'"):
        parse_scenarios("kill-worker,explode")
    assert parse_seeds(None, None) == (0, 1, 2)
    assert parse_seeds(2, None) == (0, 1)
    assert parse_seeds(None, "7, 9,7") == (7, 9)
    for args, field_name in (((0, None), "--seeds"), ((None, "x"), "--seed-list"), ((2, "1"), "--seeds, --seed-list")):
        with pytest.raises(SpecError, match=field_name):
            parse_seeds(*args)


def test_skip_reasons_name_what_the_job_or_backend_lacks(examples_dir: Path) -> None:
    one_node = _spec(examples_dir, *ONE_NODE)
    assert skip_reason("kill-worker", one_node, DrillOptions()) is None
    reason = skip_reason("kill-node", one_node, DrillOptions())
    assert reason is not None and "spec.nodes.max is 1" in reason
    fixed = _spec(examples_dir, "spec.nodes.min=2", "spec.nodes.max=2")
    reason = skip_reason("kill-node", fixed, DrillOptions())
    assert reason is not None and "elastic job that can lose a node" in reason
    reason = skip_reason("hang", one_node, DrillOptions(backend="kubernetes"))
    assert reason is not None and "only kill-worker runs on a cluster" in reason
    assert skip_reason("kill-worker", one_node, DrillOptions(backend="kubernetes")) is None


def test_campaign_runs_every_case_with_its_seed_and_aggregates(tmp_path: Path, examples_dir: Path) -> None:
    fake = FakeDrill(recovery_path={"kill-worker": "restart"})
    result = run_campaign(_spec(examples_dir), _options(tmp_path), drill=fake)

    assert [(s, o.seed) for s, o in fake.calls] == [(s, seed) for seed in (0, 1, 2) for s in ("kill-worker", "hang")]
    assert all(o.shared_reference and o.nodes == 1 for _, o in fake.calls)
    assert {Path(o.drill_dir or "").name for _, o in fake.calls} == {
        f"{s}-seed{n}" for s in ("kill-worker", "hang") for n in range(3)
    }
    assert result.exit_code == 0 and result.passed

    data = json.loads((tmp_path / "out" / "report.json").read_text())
    agg = data["scenarios"]["kill-worker"]
    assert agg["pass_rate"] == 1.0 and agg["ran"] == 3
    assert agg["mttr_s"] == {"n": 3, "median": 4.0, "p90": 9.0, "max": 9.0}
    assert agg["lost_steps"] == {"n": 3, "median": 4, "max": 5}
    assert agg["recovery_paths"] == {"restart": 3}
    assert data["scenarios"]["hang"]["recovery_paths"] == {}  # absent from the report: tolerated
    assert data["verdict"] == "pass" and data["counts"]["passed"] == 6
    case = data["cases"][0]
    assert case["timeline"]["faults"] and max(v for v in case["timeline"]["world_size"] if v) == 2
    assert (tmp_path / "out" / "junit.xml").is_file() and (tmp_path / "out" / "report.html").is_file()


def test_nearest_rank_p90_and_pass_rate_count_only_cases_that_ran(tmp_path: Path, examples_dir: Path) -> None:
    fake = FakeDrill(mttr={s: float(s + 1) for s in range(10)}, failing={("kill-worker", 3)})
    result = run_campaign(
        _spec(examples_dir, *ONE_NODE), _options(tmp_path, "kill-worker,kill-node", seeds=10), drill=fake
    )
    agg = aggregate(result.cases)
    assert agg["kill-worker"]["mttr_s"]["p90"] == 9.0 and agg["kill-worker"]["mttr_s"]["median"] == 5.5
    assert agg["kill-worker"]["pass_rate"] == 0.9
    assert agg["kill-node"]["pass_rate"] is None and agg["kill-node"]["skipped"] == 10
    assert "spec.nodes.max is 1" in agg["kill-node"]["skip_reason"]


def test_skipped_scenarios_are_reported_and_a_failure_fails_the_gate(tmp_path: Path, examples_dir: Path) -> None:
    fake = FakeDrill(failing={("kill-worker", 1)})
    result = run_campaign(_spec(examples_dir, *ONE_NODE), _options(tmp_path, "kill-worker,kill-node"), drill=fake)

    assert {s for s, _ in fake.calls} == {"kill-worker"}
    states = {(r.scenario, r.seed): r.state for r in result.cases}
    assert states[("kill-node", 0)] is CaseState.SKIPPED and states[("kill-worker", 1)] is CaseState.FAILED
    assert result.exit_code == 1

    junit = ET.parse(tmp_path / "out" / "junit.xml").getroot()
    assert junit.tag == "testsuites" and junit.get("tests") == "6" and junit.get("failures") == "1"
    assert junit.get("skipped") == "3" and junit.get("errors") == "0"
    suites = {s.get("name"): s for s in junit.iter("testsuite")}
    assert set(suites) == {"drill.kill-worker", "drill.kill-node"}
    failed = suites["drill.kill-worker"].find("testcase[@name='seed 1']")
    assert failed is not None and failed.get("classname") == "drill.kill-worker"
    failure = failed.find("failure")
    assert failure is not None and failure.get("message") == "restored after the fault: no restore"
    assert failed.find("system-out") is not None and "run dir:" in (failed.findtext("system-out") or "")
    passed = suites["drill.kill-worker"].find("testcase[@name='seed 0']")
    assert passed is not None and len(passed.findall("failure")) == 0
    skipped = suites["drill.kill-node"].find("testcase[@name='seed 2']/skipped")
    assert skipped is not None and "spec.nodes.max is 1" in (skipped.get("message") or "")


def test_nothing_runnable_is_not_a_pass(tmp_path: Path, examples_dir: Path) -> None:
    result = run_campaign(_spec(examples_dir, *ONE_NODE), _options(tmp_path, "kill-node", seeds=1), drill=FakeDrill())
    assert result.count(CaseState.SKIPPED) == 1 and result.exit_code == 1


def test_max_failures_stops_early_and_reports_the_rest_not_run(tmp_path: Path, examples_dir: Path) -> None:
    fake = FakeDrill(failing={(s, n) for s in ("kill-worker", "hang") for n in range(3)})
    result = run_campaign(_spec(examples_dir), _options(tmp_path, max_failures=2), drill=fake)
    assert len(fake.calls) == 2
    assert [r.state for r in result.cases].count(CaseState.NOT_RUN) == 4
    assert result.exit_code == 1
    junit = ET.parse(tmp_path / "out" / "junit.xml").getroot()
    assert junit.get("failures") == "2" and junit.get("skipped") == "4"
    assert "--max-failures 2 reached" in (junit.find(".//skipped").get("message") or "")  # type: ignore[union-attr]


def test_a_drill_that_cannot_run_is_a_case_error_and_the_campaign_goes_on(tmp_path: Path, examples_dir: Path) -> None:
    fake = FakeDrill(raising={("hang", 0): BackendError("launcher refused")})
    result = run_campaign(_spec(examples_dir), _options(tmp_path, seeds=1), drill=fake)
    states = {r.scenario: r for r in result.cases}
    assert states["hang"].state is CaseState.ERROR and states["hang"].reason == "launcher refused"
    assert states["kill-worker"].state is CaseState.PASSED and result.exit_code == 1
    error = ET.parse(tmp_path / "out" / "junit.xml").getroot().find(".//testcase[@classname='drill.hang']/error")
    assert error is not None and error.get("message") == "launcher refused"


def test_rerun_skips_finished_cases_and_redoes_an_interrupted_one(tmp_path: Path, examples_dir: Path) -> None:
    spec = _spec(examples_dir)
    first = FakeDrill(raising={("hang", 1): KeyboardInterrupt()})
    with pytest.raises(KeyboardInterrupt):
        run_campaign(spec, _options(tmp_path), drill=first)
    assert len(first.calls) == 4  # kill-worker 0, hang 0, kill-worker 1, then hang 1 was interrupted
    interrupted = tmp_path / "out" / "cases" / "hang-seed1"
    assert interrupted.is_dir() and not (interrupted / "report.json").exists()

    second = FakeDrill()
    result = run_campaign(spec, _options(tmp_path), drill=second)
    assert [(s, o.seed) for s, o in second.calls] == [("hang", 1), ("kill-worker", 2), ("hang", 2)]
    resumed = [r for r in result.cases if r.resumed]
    assert [(r.scenario, r.seed) for r in resumed] == [("kill-worker", 0), ("hang", 0), ("kill-worker", 1)]
    assert all(r.report and r.timeline for r in resumed)
    assert result.exit_code == 0 and len(result.cases) == 6

    third = FakeDrill()
    assert run_campaign(spec, _options(tmp_path), drill=third).exit_code == 0 and third.calls == []


def test_cli_campaign_exit_codes_and_reports(
    tmp_path: Path, examples_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.cli import cli
    from orchestrator.drills import runner

    fake = FakeDrill(failing={("hang", 1)})
    monkeypatch.setattr(runner, "run_drill", fake)
    job = str(examples_dir / "digits-ddp.yaml")
    base = ["drill", "campaign", job, "--scenarios", "kill-worker,hang,kill-node", "--set", "spec.nodes.max=1"]

    ok = CliRunner().invoke(cli, [*base, "--seed-list", "0", "--out", str(tmp_path / "a")])
    assert ok.exit_code == 0, ok.output
    assert "kill-node" in ok.output and "skipped" in ok.output

    bad = CliRunner().invoke(cli, [*base, "--seeds", "2", "--out", str(tmp_path / "b"), "--output", "json"])
    assert bad.exit_code == 1, bad.output
    data = json.loads(bad.stdout)
    assert data["verdict"] == "fail" and data["counts"] == {
        "passed": 3,
        "failed": 1,
        "inconclusive": 0,
        "error": 0,
        "skipped": 2,
        "not-run": 0,
    }
    for name in ("report.json", "junit.xml", "report.html"):
        assert (tmp_path / "b" / name).is_file()

    usage = CliRunner().invoke(cli, ["drill", "campaign", job, "--scenarios", "nope"])
    assert usage.exit_code == 2 and "--scenarios: unknown drill 'nope'" in usage.output


def test_a_resumed_campaign_adopts_its_succeeded_reference(
    tmp_path: Path, examples_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.drills import runner
    from training.contract import RunFiles, Summary

    monkeypatch.setattr(runner, "_REFERENCES", {})  # this process's cache stays as other tests left it
    spec = _spec(examples_dir)
    good, bad = tmp_path / "ref-good", tmp_path / "ref-bad"
    for run_dir, status in ((good, "succeeded"), (bad, "failed")):
        run_dir.mkdir()
        Summary(status=status, params_sha256="ab" * 32).write(RunFiles(run_dir).summary)
    assert runner.adopt_reference("local", 1, spec, good)
    assert not runner.adopt_reference("local", 2, spec, bad)

    out = tmp_path / "out"
    out.mkdir()
    write_json(out / "references.json", {"by_nodes": {"1": str(good), "2": str(bad)}})
    result = run_campaign(spec, _options(tmp_path, "kill-worker", seeds=1), drill=FakeDrill())
    assert result.references == {"2": str(good)}  # world size 2 = 1 node x 2 ranks; the failed one is not kept


class TooLateDrill(FakeDrill):
    """FakeDrill whose `too_late` cases struck a finished job: their reports are inconclusive."""

    def __init__(self, too_late: set[tuple[str, int]]) -> None:
        super().__init__()
        self.too_late = too_late

    def __call__(self, scenario: str, spec: JobSpec, options: DrillOptions) -> DrillReport:
        report = super().__call__(scenario, spec, options)
        if (scenario, options.seed) in self.too_late:
            report.inconclusive = "the job finished before the fault: step 60 of 60"
            report.write(Path(options.drill_dir or "") / "report.json")
        return report


def test_an_inconclusive_case_is_reported_and_does_not_pass_the_campaign(tmp_path: Path, examples_dir: Path) -> None:
    fake = TooLateDrill({("hang", 1)})
    result = run_campaign(_spec(examples_dir), _options(tmp_path), drill=fake)
    [case] = [r for r in result.cases if r.state is CaseState.INCONCLUSIVE]
    assert (case.scenario, case.seed) == ("hang", 1)
    assert case.reason == "the job finished before the fault: step 60 of 60"
    assert not result.passed and result.exit_code == 1

    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["verdict"] == "fail"
    assert data["counts"]["inconclusive"] == 1 and data["counts"]["passed"] == 5 and data["counts"]["failed"] == 0
    hang = data["scenarios"]["hang"]
    assert (hang["ran"], hang["passed"], hang["failed"], hang["inconclusive"]) == (3, 2, 0, 1)
    assert hang["pass_rate"] == round(2 / 3, 4), "an unproven case counts against the pass rate"

    junit = ET.parse(tmp_path / "out" / "junit.xml").getroot()
    assert junit.get("failures") == "1" and junit.get("errors") == "0"
    failure = junit.find(".//testcase[@classname='drill.hang'][@name='seed 1']/failure")
    assert failure is not None and failure.get("type") == "DrillInconclusive"
    assert failure.get("message") == "inconclusive: the job finished before the fault: step 60 of 60"

    page = (tmp_path / "out" / "report.html").read_text()
    assert ">INCONCLUSIVE</a>" in page and "1 inconclusive" in page

    # A re-run reads the finished case back as inconclusive, not failed.
    again = run_campaign(_spec(examples_dir), _options(tmp_path), drill=FakeDrill())
    assert [r.state for r in again.cases if r.resumed].count(CaseState.INCONCLUSIVE) == 1
    assert again.exit_code == 1


def test_inconclusive_cases_count_towards_max_failures(tmp_path: Path, examples_dir: Path) -> None:
    fake = TooLateDrill({("kill-worker", 0), ("hang", 0)})
    result = run_campaign(_spec(examples_dir), _options(tmp_path, max_failures=2), drill=fake)
    assert len(fake.calls) == 2
    assert [r.state for r in result.cases] == [CaseState.INCONCLUSIVE] * 2 + [CaseState.NOT_RUN] * 4
    assert result.exit_code == 1
