"""The Grafana dashboard: valid JSON, the `job` variable, the panels users look for, every expression
naming only metrics the exporter really exports (that each is valid PromQL: tests/integration/test_promtool.py)."""

from __future__ import annotations

import json
import re

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.monitoring import DASHBOARD_FILE, asset_path, load_dashboard
from tests.fixtures.prometheus import populated_sink
from training.metrics import names

METRIC_RE = re.compile(r"(?<![:\w])torchrig_[a-z0-9_]+(?![:\w])")


def exprs() -> list[str]:
    return [t["expr"] for p in load_dashboard()["panels"] for t in p.get("targets", [])]


def test_valid_json_with_job_variable() -> None:
    dash = json.loads(asset_path(DASHBOARD_FILE).read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert "job" in variables and variables["job"]["type"] == "query"
    assert "training_job" in variables["job"]["definition"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            # every query is scoped to the selected jobs
            assert 'training_job=~"$job"' in target["expr"], (panel["title"], target["expr"])


def test_panels_cover_what_users_watch() -> None:
    joined = "\n".join(exprs())
    for metric in (
        names.SAMPLES_PER_SECOND,
        names.TOKENS_PER_SECOND,
        names.COMM,
        names.GPU_UTILIZATION,
        names.GPU_MEMORY_USED,
        names.RESTART_GENERATION,
        names.CHECKPOINT_LAST_TIMESTAMP,
        names.WORLD_SIZE,
        names.STORE_FAILURES,
        names.LOSS,
        names.RANK_SLOWDOWN,
        names.STRAGGLER_RANK,
    ):
        assert metric in joined, metric
    assert "histogram_quantile" in joined and names.STEP_DURATION + "_bucket" in joined
    assert f"time() - max by (training_job) ({names.CHECKPOINT_LAST_TIMESTAMP}" in joined


def test_every_metric_is_exported() -> None:
    used = {m for e in exprs() for m in METRIC_RE.findall(e)}
    assert used <= names.series_names(), used - names.series_names()
    # ... and present in a live registry's exposition
    text = generate_latest(populated_sink().registry).decode()
    exposed = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert used <= exposed, used - exposed
