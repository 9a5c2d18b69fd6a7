"""A campaign as JUnit XML: one testsuite per scenario, one testcase per scenario x seed.

The dialect is the one GitHub Actions (test reporter actions), GitLab (`artifacts:reports:junit`) and
Jenkins (`junit` step) all read: `<testsuites>` of `<testsuite>`s with `tests`/`failures`/`errors`/
`skipped`/`time` counts, each `<testcase>` with `classname`, `name` and `time`, and at most one
`<failure>` (the verdict failed: the failed checks; or it was inconclusive: why), `<error>` (the drill
could not run) or `<skipped>` (the job cannot take the scenario, or --max-failures stopped the
campaign) child. An inconclusive case is a failure: a gate must not pass on a drill that proved nothing.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from orchestrator.drills.report import fault_text

__all__ = ["render_junit"]


def _facts(case: dict[str, Any]) -> str:
    report = case.get("report") or {}
    lines = [
        f"case dir: {case.get('dir') or '-'}",
        f"run dir: {report.get('run_dir') or '-'}",
        f"reference run dir: {report.get('reference_run_dir') or '-'}",
        f"fault: {fault_text(report)}",
        f"resumed from step {report.get('resumed_from_step')}, lost steps {report.get('lost_steps')}, "
        f"MTTR {report.get('mttr_seconds')} s",
    ]
    lines += [
        f"{'ok' if c.get('passed') else 'FAILED'}: {c.get('name')}: {c.get('detail')}" for c in report.get("checks", [])
    ]
    lines += [f"note: {n}" for n in report.get("notes", [])]
    return "\n".join(lines) + "\n"


def render_junit(data: dict[str, Any]) -> str:
    """The JUnit XML of a campaign's `report.json` document (`CampaignResult.to_dict()`)."""
    campaign = data["campaign"]
    root = ET.Element("testsuites", name=f"torchrig drill campaign {campaign['job']}")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    total_time = 0.0
    for scenario in campaign["scenarios"]:
        cases = [c for c in data["cases"] if c["scenario"] == scenario]
        if not cases:
            continue
        suite = ET.SubElement(root, "testsuite", name=f"drill.{scenario}")
        counts = {"tests": len(cases), "failures": 0, "errors": 0, "skipped": 0}
        suite_time = 0.0
        for case in cases:
            seconds = float(case.get("duration_s") or 0.0)
            suite_time += seconds
            tc = ET.SubElement(
                suite, "testcase", classname=f"drill.{scenario}", name=f"seed {case['seed']}", time=f"{seconds:.3f}"
            )
            state = case["state"]
            if state == "failed":
                counts["failures"] += 1
                failed = case.get("failed_checks") or []
                message = "; ".join(f"{c['name']}: {c['detail']}" for c in failed) or "verdict failed"
                body = "\n".join(f"FAILED: {c['name']}: {c['detail']}" for c in failed)
                ET.SubElement(tc, "failure", message=message, type="DrillVerdictFailed").text = body + "\n"
            elif state == "inconclusive":
                counts["failures"] += 1
                message = f"inconclusive: {case.get('reason') or 'the drill proved nothing'}"
                ET.SubElement(tc, "failure", message=message, type="DrillInconclusive").text = message + "\n"
            elif state == "error":
                counts["errors"] += 1
                ET.SubElement(tc, "error", message=case.get("reason") or "error", type="DrillError")
            elif state in ("skipped", "not-run"):
                counts["skipped"] += 1
                ET.SubElement(tc, "skipped", message=case.get("reason") or state)
            if case.get("report"):
                ET.SubElement(tc, "system-out").text = _facts(case)
        for key, value in counts.items():
            suite.set(key, str(value))
            totals[key] += value
        suite.set("time", f"{suite_time:.3f}")
        total_time += suite_time
    for key, value in totals.items():
        root.set(key, str(value))
    root.set("time", f"{float(campaign.get('wall_s') or total_time):.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
