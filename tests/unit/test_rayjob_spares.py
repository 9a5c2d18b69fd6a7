"""A RayJob that recovers in place hosts warm spares in its worker pods (`training.ray_train`): the pods ask
for each spare's share of a rank, and Ray may hand out only what the ranks reserve."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.compile import compile
from orchestrator.loader import load_spec
from orchestrator.spec import JobSpec
from tests import crds
from tests.fixtures.common import REPO


def _spec(name: str, *overrides: str) -> JobSpec:
    return load_spec(REPO / "examples" / f"{name}.yaml", list(overrides))


def _worker_group(spec: JobSpec) -> dict[str, Any]:
    objs = compile(spec, "rayjob")
    crds.assert_valid(objs)
    (job,) = [o for o in objs if o["kind"] == "RayJob"]
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    return group  # type: ignore[no-any-return]


def test_in_place_worker_pods_ask_for_each_spares_share_and_pin_rays_cpus() -> None:
    # 2 ranks per node on 2 CPUs / 4Gi, 2 warm spares: each spare is half a node more.
    group = _worker_group(_spec("digits-ddp", "spec.restarts.spares=2", "spec.procsPerNode=2"))
    res = group["template"]["spec"]["containers"][0]["resources"]
    assert res["requests"]["cpu"] == res["limits"]["cpu"] == "4000m"
    assert res["requests"]["memory"] == res["limits"]["memory"] == "8192Mi"
    assert group["rayStartParams"]["num-cpus"] == "2"  # the ranks' reservation, not the pod's limit


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("digits-ddp", ["spec.restarts.mode=restart"]),  # Ray Train's own recovery: no spare
        ("digits-ddp", ["spec.restarts.spares=0"]),
        ("tinygpt-fsdp", []),  # FSDP without in-memory replicas recovers by group restarts
    ],
)
def test_worker_pods_without_spares_keep_the_nodes_resources(name: str, overrides: list[str]) -> None:
    spec = _spec(name, *overrides)
    group = _worker_group(spec)
    res = group["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["cpu"] == spec.spec.resources.cpu and res["limits"]["memory"] == spec.spec.resources.memory
    assert "num-cpus" not in group["rayStartParams"]
