"""The job's NetworkPolicy (orchestrator/compile/networkpolicy.py) over the pods the operators would run.

The pods come from operators.py (their labels as the operators leave them, KubeRay's included); the
policy is evaluated by netpol.py, a model of the API's NetworkPolicy semantics (no CNI runs here). What
it shows (issue 33.1): a pod outside the job reaches neither the rendezvous/recovery store nor the ports
gloo and NCCL open, the job's own pods reach each other on every TCP port, Prometheus reaches the
exporters only, and a RayJob's submitter reaches the head's dashboard only.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.chart import values_document
from orchestrator.compile import compile as compile_manifests
from orchestrator.compile.networkpolicy import compile_network_policy
from orchestrator.errors import UnsupportedFeature
from orchestrator.loader import load_spec, validate_document
from tests.fixtures import spec_variants
from tests.pods.kubelet import Pod
from tests.pods.netpol import Endpoint, admits, selects
from tests.pods.operators import pytorchjob_pods, rayjob_pods, trainjob_pods
from tests.pods.scenario import EXAMPLE, SCENARIO_SETS, render

PT_RDZV_PORT = 23456  # the PyTorchJob's rendezvous / store port (compile/pytorchjob.py RDZV_PORT)
TJ_MASTER_PORT = 29500  # Trainer's PET_MASTER_PORT (plugins/torch/torch.go, constants.ContainerTrainerPort)
GLOO_PORT = 41237  # an ephemeral port, as gloo's and NCCL's listeners take
RAY_GCS_PORT, RAY_DASHBOARD_PORT = 6379, 8265
METRICS_PORT = 9400  # the example's metrics.port

OUTSIDER = Endpoint(labels={"app": "intruder"})
PROMETHEUS = Endpoint(
    labels={"app.kubernetes.io/name": "prometheus", "prometheus": "k8s"},
    namespace="monitoring",
    namespace_labels={"kubernetes.io/metadata.name": "monitoring"},
)


def _endpoint(pod: Pod) -> Endpoint:
    ports = {p["name"]: int(p["containerPort"]) for p in pod.container.get("ports", []) if "name" in p}
    return Endpoint(labels=dict(pod.labels), namespace=pod.namespace, named_ports=ports)


def _policies(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "NetworkPolicy"]


def _job_pods(target: str) -> tuple[list[dict[str, Any]], list[Pod], list[Pod]]:
    """(objects, the job's pods, the pods that are no member: a RayJob's submitter)."""
    if target == "pytorchjob":
        objs = render("pytorchjob", fixed_size=True)
        return objs, pytorchjob_pods(objs), []
    if target == "standby":
        objs = render("pytorchjob", "spec.restarts.spareNodes=1", "spec.restarts.spares=1", fixed_size=True)
        return objs, pytorchjob_pods(objs), []
    if target == "trainjob":
        objs = render("trainjob", fixed_size=True)
        return objs, trainjob_pods(objs), []
    objs = render("rayjob")
    ray = rayjob_pods(objs)
    return objs, [ray.head, *ray.workers], [ray.submitter]


TARGETS = ["pytorchjob", "standby", "trainjob", "rayjob"]


@pytest.mark.parametrize("target", TARGETS)
def test_the_policy_selects_exactly_the_jobs_pods(target: str) -> None:
    objs, members, others = _job_pods(target)
    (policy,) = _policies(objs)
    assert members
    assert all(selects(policy["spec"]["podSelector"], p.labels) for p in members)
    assert not any(selects(policy["spec"]["podSelector"], p.labels) for p in others)
    assert not selects(policy["spec"]["podSelector"], OUTSIDER.labels)


@pytest.mark.parametrize("target", TARGETS)
def test_an_outsider_is_refused_and_the_jobs_pods_are_admitted(target: str) -> None:
    objs, members, _ = _job_pods(target)
    policies = _policies(objs)
    ports = {"pytorchjob": [PT_RDZV_PORT], "standby": [PT_RDZV_PORT], "trainjob": [TJ_MASTER_PORT]}.get(
        target, [RAY_GCS_PORT, RAY_DASHBOARD_PORT]
    )
    for dst in members:
        for port in [*ports, GLOO_PORT]:
            assert not admits(policies, _endpoint(dst), OUTSIDER, port), (dst.name, port)
            for src in members:
                assert admits(policies, _endpoint(dst), _endpoint(src), port), (src.name, dst.name, port)
    # The same outsider with no policy at all: admitted (the model refuses only because of the policy).
    assert admits([], _endpoint(members[0]), OUTSIDER, GLOO_PORT)


@pytest.mark.parametrize("target", TARGETS)
def test_prometheus_reaches_the_exporters_and_nothing_else(target: str) -> None:
    objs, members, _ = _job_pods(target)
    policies = _policies(objs)
    workers = [
        p for p in members if any(port.get("containerPort") == METRICS_PORT for port in p.container.get("ports", []))
    ]
    assert workers
    for dst in workers:
        assert admits(policies, _endpoint(dst), PROMETHEUS, METRICS_PORT)
        assert not admits(policies, _endpoint(dst), PROMETHEUS, GLOO_PORT)
    # Anything else labelled like Prometheus' pods but elsewhere in the policy's terms would be admitted too:
    # the selector is documented (docs/operations.md), and the metrics are all such a pod can read.


def test_the_rayjob_submitter_reaches_the_dashboard_only() -> None:
    objs, _, (submitter,) = _job_pods("rayjob")
    policies = _policies(objs)
    head = rayjob_pods(objs).head
    assert admits(policies, _endpoint(head), _endpoint(submitter), RAY_DASHBOARD_PORT)
    assert not admits(policies, _endpoint(head), _endpoint(submitter), RAY_GCS_PORT)
    operator = Endpoint(
        labels={"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/component": "kuberay-operator"},
        namespace="ray-system",
    )
    assert admits(policies, _endpoint(head), operator, RAY_DASHBOARD_PORT)
    assert not admits(policies, _endpoint(head), operator, RAY_GCS_PORT)


def test_opting_out_renders_no_policy() -> None:
    spec = load_spec(EXAMPLE, [*SCENARIO_SETS, "spec.kubernetes.networkPolicy=false"])
    assert compile_network_policy(spec, "pytorchjob") == []
    assert _policies(render("pytorchjob", "spec.kubernetes.networkPolicy=false", fixed_size=True)) == []


_VARIANTS = spec_variants.variants(values_document())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(variant=st.sampled_from(_VARIANTS), target=st.sampled_from(["pytorchjob", "trainjob", "rayjob"]))
def test_any_spec_variant_admits_its_own_pods_and_prometheus_only(variant: spec_variants.Variant, target: str) -> None:
    """Over the model's one-field variants (tests/fixtures/spec_variants.py): the operators' pods of the job
    are exactly the selected ones, reach each other, and an outsider reaches none of them; Prometheus
    reaches exactly the exporters' ports."""
    spec = validate_document(variant.apply(values_document()))
    try:
        objs = compile_manifests(spec, target, fixed_size=True)
        if target == "pytorchjob":
            members, others = pytorchjob_pods(objs), []
        elif target == "trainjob":
            members, others = trainjob_pods(objs), []
        else:
            ray = rayjob_pods(objs)
            members, others = [ray.head, *ray.workers], [ray.submitter]
    except (UnsupportedFeature, NotImplementedError):
        return
    policies = _policies(objs)
    if not spec.spec.kubernetes.network_policy:
        assert policies == []
        return
    (policy,) = policies
    exporters = (
        {spec.spec.metrics.port + r for r in range(spec.spec.procs_per_node)} if spec.spec.metrics.enabled else set()
    )
    for dst in members:
        assert selects(policy["spec"]["podSelector"], dst.labels)
        for port in [GLOO_PORT, *exporters]:
            assert not admits(policies, _endpoint(dst), OUTSIDER, port)
            assert admits(policies, _endpoint(dst), _endpoint(members[-1]), port)
            assert admits(policies, _endpoint(dst), PROMETHEUS, port) == (port in exporters)
    assert not any(selects(policy["spec"]["podSelector"], p.labels) for p in others)
