"""Monitoring assets shipped with torchrig: Prometheus alert rules and the Grafana dashboard.

- `rules.yaml`: a plain Prometheus rules file (`groups:`); `prometheus_rule()` wraps it in a
  prometheus-operator `PrometheusRule` for the Helm chart / manifests.
- `rules.test.yaml`: its `promtool test rules` unit tests.
- `dashboard.json`: a Grafana dashboard (template variables `datasource` and `job`).

Metric names come from `training.metrics.names`; the training job is the `training_job` label.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "DASHBOARD_FILE",
    "RULES_FILE",
    "RULES_TEST_FILE",
    "asset_path",
    "load_dashboard",
    "load_rules",
    "prometheus_rule",
]

RULES_FILE = "rules.yaml"
RULES_TEST_FILE = "rules.test.yaml"
DASHBOARD_FILE = "dashboard.json"


def asset_path(name: str) -> Path:
    """Filesystem path of a shipped asset (`rules.yaml`, `rules.test.yaml`, `dashboard.json`)."""
    return Path(str(resources.files(__name__).joinpath(name)))


def load_rules() -> dict[str, Any]:
    """The rules file as a dict (`{"groups": [...]}`)."""
    data: dict[str, Any] = yaml.safe_load(asset_path(RULES_FILE).read_text())
    return data


def load_dashboard() -> dict[str, Any]:
    """The Grafana dashboard as a dict."""
    data: dict[str, Any] = json.loads(asset_path(DASHBOARD_FILE).read_text())
    return data


def prometheus_rule(name: str, namespace: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """The rules as a prometheus-operator `PrometheusRule` object (monitoring.coreos.com/v1).

    Args:
        name: metadata.name of the object.
        namespace: metadata.namespace.
        labels: metadata.labels, e.g. the `release` label a Prometheus `ruleSelector` matches.
    """
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
        "spec": load_rules(),
    }
