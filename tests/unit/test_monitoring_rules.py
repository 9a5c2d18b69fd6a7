"""Alert rules: promtool accepts them, every alert is unit-tested (fires and stays silent), and the
tests can fail: a rules file with a broken alert makes `promtool test rules` fail."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from orchestrator.monitoring import RULES_FILE, RULES_TEST_FILE, asset_path, load_rules, prometheus_rule
from training.metrics import names

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
needs_promtool = pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="promtool not installed")
METRIC_RE = re.compile(r"(?<![:\w])torchrig_[a-z0-9_]+(?![:\w])")


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False)


def alerts() -> list[dict]:
    return [r for g in load_rules()["groups"] for r in g["rules"] if "alert" in r]


@needs_promtool
def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", str(asset_path(RULES_FILE)))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(asset_path(RULES_TEST_FILE)))
    assert result.returncode == 0, result.stdout + result.stderr


def test_required_alerts_are_complete() -> None:
    by_name = {a["alert"]: a for a in alerts()}
    required = {
        "TorchrigTrainingStalled",
        "TorchrigThroughputDropped",
        "TorchrigGPUUtilizationLow",
        "TorchrigCheckpointOverdue",
        "TorchrigRestartsTooFrequent",
        "TorchrigCheckpointStoreFailing",
    }
    assert required <= set(by_name)
    for name, rule in by_name.items():
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert "for" in rule or name in {"TorchrigRestartsTooFrequent", "TorchrigRestartBudgetNearlyExhausted"}, name
    assert "quantile_over_time(0.5" in by_name["TorchrigThroughputDropped"]["expr"]
    assert names.LAST_STEP_TIMESTAMP in by_name["TorchrigTrainingStalled"]["expr"]


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    tests = yaml.safe_load(asset_path(RULES_TEST_FILE).read_text())["tests"]
    cases = [case for t in tests for case in t.get("alert_rule_test", [])]
    for rule in alerts():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c.get("exp_alerts") for c in mine), f"{rule['alert']} never tested firing"
        assert any(not c.get("exp_alerts") for c in mine), f"{rule['alert']} never tested silent"


def test_rules_reference_only_exported_metrics() -> None:
    known = names.series_names()
    groups = load_rules()["groups"]
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    for group in groups:
        for rule in group["rules"]:
            used = set(METRIC_RE.findall(rule["expr"]))
            uses_recorded = {r for r in recorded if r in rule["expr"]}
            assert used or uses_recorded, rule
            assert used <= known, (rule.get("alert") or rule.get("record"), used - known)


@needs_promtool
@pytest.mark.parametrize(
    "alert",
    [
        "TorchrigTrainingStalled",
        "TorchrigThroughputDropped",
        "TorchrigGPUUtilizationLow",
        "TorchrigCheckpointOverdue",
        "TorchrigRestartsTooFrequent",
        "TorchrigRestartBudgetNearlyExhausted",
        "TorchrigCheckpointStoreFailing",
    ],
)
def test_unit_tests_catch_a_broken_alert(tmp_path: Path, alert: str) -> None:
    # An alert that can never fire must fail its own promtool test: the tests are not vacuous.
    rules = load_rules()
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule["expr"] = "vector(1) > 2"
    (tmp_path / RULES_FILE).write_text(yaml.safe_dump(rules, sort_keys=False))
    shutil.copy(asset_path(RULES_TEST_FILE), tmp_path / RULES_TEST_FILE)
    result = promtool("test", "rules", RULES_TEST_FILE, cwd=tmp_path)
    assert result.returncode != 0
    assert alert in result.stdout + result.stderr


def test_prometheus_rule_wraps_the_groups() -> None:
    obj = prometheus_rule("torchrig", "monitoring", {"release": "kube-prometheus-stack"})
    assert obj["kind"] == "PrometheusRule" and obj["apiVersion"] == "monitoring.coreos.com/v1"
    assert obj["metadata"]["labels"] == {"release": "kube-prometheus-stack"}
    assert obj["spec"]["groups"] == load_rules()["groups"]
