"""Standby nodes (`restarts.spareNodes`) without pods, processes or a store: what the compiled PyTorchJob
gives them and how a local run lays them out. Who stands by and how a standby takes a lost node's ranks
through a real c10d store: tests/integration/test_standby.py; the whole path (a pod killed, its ranks
taken in place, bit-identical): tests/pods/test_pods.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator.compile import compile as compile_manifests
from orchestrator.compile.pytorchjob import REPLICA_INDEX_LABEL, STORE_POD_LABEL
from orchestrator.loader import load_spec
from tests.crds import assert_valid
from tests.fixtures.common import REPO
from training.contract import Env

EXAMPLE = REPO / "examples" / "digits-ddp.yaml"


def _job(*sets: str) -> dict[str, Any]:
    spec = load_spec(EXAMPLE, list(sets))
    objects = compile_manifests(spec, "pytorchjob")
    return next(o for o in objects if o["kind"] == "PyTorchJob")


def _env(template: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in template["spec"]["containers"][0]["env"]}


def test_spare_nodes_are_extra_worker_replicas_that_learn_their_index_from_the_operators_label() -> None:
    job = _job("spec.nodes.min=3", "spec.nodes.max=3", "spec.restarts.spareNodes=2")
    assert_valid([job])
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 3 + 2
    worker = _env(replicas["Worker"]["template"])
    assert worker[Env.STANDBY_FROM] == "3", "workers 0-2 are the nodes, 3 and 4 stand by"
    assert worker[Env.REPLICA_INDEX] == {"fieldRef": {"fieldPath": f"metadata.labels['{REPLICA_INDEX_LABEL}']"}}
    assert worker[Env.INPLACE_STORE] == Env.INPLACE_STORE_RDZV and worker[Env.STORE_POD] == "1"
    assert replicas["Worker"]["template"]["metadata"]["labels"][STORE_POD_LABEL[0]] == STORE_POD_LABEL[1]


def test_with_spare_nodes_the_master_is_a_store_only_pod() -> None:
    """No training node hosts the rendezvous store, so any of them can be lost and taken in place: the
    Master runs `training.rendezvous_store` at the port the operator gives as MASTER_PORT, with no GPU,
    no spec, no probe, and Guaranteed resources of its own."""
    job = _job(
        "spec.nodes.min=2", "spec.restarts.spareNodes=1", "spec.resources.gpus=2", "spec.kubernetes.gang=volcano"
    )
    assert_valid([job])
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    (container,) = master["spec"]["containers"]
    assert container["command"] == [
        "python",
        "-m",
        "training.rendezvous_store",
        "--port",
        "23456",
        "--run-id",
        job["metadata"]["name"],
    ]
    assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"}]
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert not [k for k in container["resources"]["limits"] if "gpu" in k]
    assert "livenessProbe" not in container and "startupProbe" not in container
    # The job's secret: the store pod trusts only records signed with it (`training.rendezvous_store`).
    assert [v["name"] for v in master["spec"]["volumes"]] == ["torchrig-tmp", "torchrig-job-secret"]
    assert Env.JOB_SECRET_FILE in _env(master)
    assert master["spec"]["automountServiceAccountToken"] is False
    assert master["spec"]["schedulerName"] == "volcano"
    assert master["metadata"]["labels"]["app.kubernetes.io/component"] == "rendezvous-store"
    assert "prometheus.io/scrape" not in master["metadata"]["annotations"], "it exports no metrics"
    # The gang holds the nodes and the store; the standby is not needed to start.
    assert job["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == 3


def test_a_one_node_job_with_a_spare_node_shares_the_rendezvous_store_not_the_agents() -> None:
    replicas = _job("spec.nodes.min=1", "spec.nodes.max=1", "spec.restarts.spareNodes=1")["spec"]["pytorchReplicaSpecs"]
    assert replicas["Worker"]["replicas"] == 2
    worker = _env(replicas["Worker"]["template"])
    assert worker[Env.INPLACE_STORE] == Env.INPLACE_STORE_RDZV and worker[Env.STANDBY_FROM] == "1"


@pytest.mark.parametrize(
    ("sets", "warning"),
    [
        ((), "fixed-size PyTorchJob only"),  # the example is elastic (nodes 1..2)
        (("spec.nodes.min=2", "spec.restarts.mode=restart"), "without in-place recovery"),
        (("spec.nodes.min=2", "spec.kubernetes.target=trainjob"), "fixed-size PyTorchJob only"),
    ],
)
def test_spare_nodes_where_they_cannot_run_add_no_pods_and_say_why(sets: tuple[str, ...], warning: str) -> None:
    spec = load_spec(EXAMPLE, [*sets, "spec.restarts.spareNodes=1"])
    assert [w for w in spec.warnings() if w.startswith("spec.restarts.spareNodes: ") and warning in w]
    if spec.spec.kubernetes.target == "pytorchjob":
        replicas = _job(*sets, "spec.restarts.spareNodes=1")["spec"]["pytorchReplicaSpecs"]
        assert all(Env.STANDBY_FROM not in _env(r["template"]) for r in replicas.values())
        assert all("torchrun" in r["template"]["spec"]["containers"][0]["command"] for r in replicas.values())
        assert sum(r["replicas"] for r in replicas.values()) == spec.spec.nodes.max


@pytest.mark.parametrize(
    ("sets", "standby"), [((), 1), (("spec.restarts.mode=restart",), 0), (("spec.restarts.spares=0",), 0)]
)
def test_a_local_run_starts_its_standby_nodes_past_its_members(
    sets: tuple[str, ...], standby: int, tmp_path: Any
) -> None:
    from orchestrator.backends.base import SubmitOptions
    from orchestrator.backends.local_plan import create_local_plan

    spec = load_spec(EXAMPLE, ["spec.nodes.min=2", "spec.restarts.spareNodes=1", *sets])
    plan = create_local_plan(spec, SubmitOptions(run_dir=str(tmp_path)), tmp_path, resume=False)
    assert (plan.nodes, plan.standby_nodes) == (2, standby)
    assert plan.to_dict().get("standbyAgents", 0) == standby, "the dry run shows them"
    assert type(plan).from_json(json.loads(json.dumps(plan.to_json()))) == plan
