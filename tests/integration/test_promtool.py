"""torchrig's alert rules and dashboard through the real promtool: the rules load, every alert's unit
tests pass and can fail (a broken alert fails its own test), every dashboard expression parses.
The pure checks of the same files are in tests/unit/test_monitoring_rules.py and
test_monitoring_dashboard.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from orchestrator.monitoring import RULES_FILE, RULES_TEST_FILE, asset_path, load_dashboard, load_rules
from tests.fixtures.prometheus import needs_promtool, promtool

pytestmark = needs_promtool


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", str(asset_path(RULES_FILE)))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(asset_path(RULES_TEST_FILE)))
    assert result.returncode == 0, result.stdout + result.stderr


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
        "TorchrigStraggler",
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


def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    # promtool has no query linter, but it parses recording rules: wrap each expression in one.
    exprs = [t["expr"] for p in load_dashboard()["panels"] for t in p.get("targets", [])]
    rules = [
        {"record": f"dashboard:expr_{i}", "expr": e.replace("$__rate_interval", "1m").replace("$job", ".+")}
        for i, e in enumerate(exprs)
    ]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
