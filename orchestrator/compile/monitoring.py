"""prometheus-operator objects for a job: a PodMonitor over its workers and a PrometheusRule.

The rule groups come from `orchestrator/monitoring/rules.yaml` (a plain Prometheus rules file,
`{groups: [...]}`) when it exists; without it the PrometheusRule has an empty group list, which the
operator accepts and which loads no rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from orchestrator.compile import _common as c
from orchestrator.errors import CompileError
from orchestrator.spec import JobSpec

__all__ = ["API_VERSION", "RULES_FILE", "compile_monitoring", "load_rule_groups"]

API_VERSION = "monitoring.coreos.com/v1"
RULES_FILE = Path(__file__).resolve().parents[1] / "monitoring" / "rules.yaml"
COMPONENT_LABEL = "app.kubernetes.io/component"


def load_rule_groups(path: Path = RULES_FILE) -> list[dict[str, Any]]:
    """The `groups` of the shared rules file; [] when it does not exist (yet).

    Raises:
        CompileError: the file exists but is not a rules file.
    """
    if not path.exists():
        return []
    data = yaml.safe_load(path.read_text())
    if data is None:
        return []
    if not isinstance(data, dict) or not isinstance(data.get("groups", []), list):
        raise CompileError(f"{path}: expected a Prometheus rules file with a `groups` list")
    groups: list[dict[str, Any]] = data.get("groups", [])
    return groups


def compile_monitoring(spec: JobSpec) -> list[dict[str, Any]]:
    """The PodMonitor (one endpoint per local rank's exporter) and the PrometheusRule.

    Returns [] when the job's metrics are disabled.
    """
    if not spec.spec.metrics.enabled:
        return []
    endpoints = [
        {"port": p["name"], "path": "/metrics", "interval": "15s", "scheme": "http"} for p in c.metrics_ports(spec)
    ]
    pod_monitor = {
        "apiVersion": API_VERSION,
        "kind": "PodMonitor",
        "metadata": c.object_meta(spec, "monitoring"),
        "spec": {
            # The workers only: KubeRay gives the Ray head a port named `metrics` too, Ray's own on 8080
            # (kuberay common/pod.go, DefaultMetricsPort), which is no torchrig exporter.
            "selector": {"matchLabels": {**c.selector_labels(spec), COMPONENT_LABEL: "worker"}},
            "namespaceSelector": {"matchNames": [spec.metadata.namespace]},
            "podMetricsEndpoints": endpoints,
        },
    }
    rule = {
        "apiVersion": API_VERSION,
        "kind": "PrometheusRule",
        "metadata": c.object_meta(spec, "monitoring"),
        "spec": {"groups": load_rule_groups()},
    }
    return [pod_monitor, rule]
