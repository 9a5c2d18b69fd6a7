"""Alert rules: every alert is complete and unit-tested (fires and stays silent) and uses only exported
metrics. That promtool accepts them and that their unit tests pass and can fail: tests/integration/test_promtool.py."""

from __future__ import annotations

import re

import yaml

from orchestrator.monitoring import RULES_TEST_FILE, asset_path, load_rules, prometheus_rule
from training.metrics import names

METRIC_RE = re.compile(r"(?<![:\w])torchrig_[a-z0-9_]+(?![:\w])")


def alerts() -> list[dict]:
    return [r for g in load_rules()["groups"] for r in g["rules"] if "alert" in r]


def test_required_alerts_are_complete() -> None:
    by_name = {a["alert"]: a for a in alerts()}
    required = {
        "TorchrigTrainingStalled",
        "TorchrigThroughputDropped",
        "TorchrigGPUUtilizationLow",
        "TorchrigCheckpointOverdue",
        "TorchrigRestartsTooFrequent",
        "TorchrigCheckpointStoreFailing",
        "TorchrigStraggler",
        "TorchrigSilentDataCorruption",
    }
    assert required <= set(by_name)
    for name, rule in by_name.items():
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert "for" in rule or name in {
            "TorchrigRestartsTooFrequent",
            "TorchrigRestartBudgetNearlyExhausted",
            "TorchrigSilentDataCorruption",  # one disagreement is enough: no `for`
        }, name
    assert "quantile_over_time(0.5" in by_name["TorchrigThroughputDropped"]["expr"]
    assert names.LAST_STEP_TIMESTAMP in by_name["TorchrigTrainingStalled"]["expr"]
    assert names.STRAGGLER_RANK in by_name["TorchrigStraggler"]["expr"]


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


def test_prometheus_rule_wraps_the_groups() -> None:
    obj = prometheus_rule("torchrig", "monitoring", {"release": "kube-prometheus-stack"})
    assert obj["kind"] == "PrometheusRule" and obj["apiVersion"] == "monitoring.coreos.com/v1"
    assert obj["metadata"]["labels"] == {"release": "kube-prometheus-stack"}
    assert obj["spec"]["groups"] == load_rules()["groups"]
