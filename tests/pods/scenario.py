"""The scenario spec of the pods tests and how it is rendered (shared by conftest and the tests)."""

from __future__ import annotations

import base64
import secrets
from typing import Any

from orchestrator.compile import compile as compile_manifests
from orchestrator.compile._common import JOB_SECRET_KEY, job_secret
from orchestrator.loader import load_spec
from tests.fixtures.common import REPO

__all__ = ["EXAMPLE", "SCENARIO_SETS", "TORCHRIG_ENV", "one", "render"]

EXAMPLE = REPO / "examples" / "digits-ddp.yaml"
# The scenarios' spec: the example, with few steps and a checkpoint every 10 (its store is a PVC).
SCENARIO_SETS = ["spec.training.steps=40", "spec.checkpoint.every.steps=10"]
TORCHRIG_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def render(target: str, *extra_sets: str, fixed_size: bool = False) -> list[dict[str, Any]]:
    """The scenario spec with `extra_sets`, compiled for `target` (what `torchrig render` prints), after
    the job's Secret with a value (what `torchrig submit` creates first: orchestrator/backends/kubernetes.py)."""
    spec = load_spec(EXAMPLE, [*SCENARIO_SETS, *extra_sets])
    secret = job_secret(spec)
    secret["data"] = {JOB_SECRET_KEY: base64.b64encode(secrets.token_hex(32).encode()).decode()}
    return [secret, *compile_manifests(spec, target, fixed_size=fixed_size)]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind)
