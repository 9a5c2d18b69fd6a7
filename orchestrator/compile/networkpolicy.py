"""A NetworkPolicy per job (`networking.k8s.io/v1`): the job's pods admit only what the job needs.

The recovery store, torchrun's rendezvous store, gloo and NCCL answer whoever reaches them (issue 33):
one write to the store can end the job or hand a rank to a stranger. The policy selects every pod of the
job by the labels torchrig gives them (`_common.selector_labels`: the PyTorchJob's Master and Workers and
its store pod, the TrainJob's nodes, the RayJob's head and workers) and, with `policyTypes: [Ingress]`,
admits (NetworkPolicy semantics: a selected pod takes only what some rule of some policy selecting it
allows):

- any TCP port from the job's own pods: the rendezvous and recovery stores have fixed ports, but gloo,
  NCCL's socket transport and Ray's workers listen on ephemeral ones;
- the exporters' ports (`metrics.port` + local rank) from Prometheus: pods labelled
  `app.kubernetes.io/name: prometheus` (what prometheus-operator gives its Prometheus pods) in any
  namespace (`PROMETHEUS_PEER`; the chart's `networkPolicy.prometheus` changes it);
- RayJob: the head's dashboard (the Jobs API) from the job's submitter, which KubeRay labels
  `ray.io/originated-from-cr-name: <job>` and `ray.io/originated-from-crd: RayJob`
  (kuberay v1.7.0 `rayjob_controller.go` getSubmitterTemplate), and from the KubeRay operator, which
  polls the job's status there (`app.kubernetes.io/component: kuberay-operator`, the label both of its
  install methods give its pod: `helm-chart/kuberay-operator/templates/deployment.yaml`,
  `ray-operator/config/manager/manager.yaml`).

Egress is left open (object stores, DNS, image registries differ per cluster). Probes are unaffected:
torchrig's are `exec` probes, run inside the pod. A cluster whose CNI does not enforce NetworkPolicies
accepts the object and ignores it.
"""

from __future__ import annotations

import copy
from typing import Any

from orchestrator.compile import _common as c
from orchestrator.compile.rayjob import DASHBOARD_PORT
from orchestrator.spec import JobSpec

__all__ = [
    "API_VERSION",
    "KUBERAY_OPERATOR_PEER",
    "PROMETHEUS_PEER",
    "compile_network_policy",
    "network_policy_name",
    "submitter_peer",
]

API_VERSION = "networking.k8s.io/v1"
PROMETHEUS_PEER: dict[str, Any] = {
    "namespaceSelector": {},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}
KUBERAY_OPERATOR_PEER: dict[str, Any] = {
    "namespaceSelector": {},
    "podSelector": {"matchLabels": {"app.kubernetes.io/component": "kuberay-operator"}},
}


def network_policy_name(spec: JobSpec) -> str:
    return spec.name


def submitter_peer(spec: JobSpec) -> dict[str, Any]:
    """The RayJob's submitter pod, by the labels KubeRay always gives it (same namespace)."""
    return {
        "podSelector": {
            "matchLabels": {"ray.io/originated-from-cr-name": spec.name, "ray.io/originated-from-crd": "RayJob"}
        }
    }


def _tcp(port: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


def compile_network_policy(spec: JobSpec, target: str) -> list[dict[str, Any]]:
    """The job's NetworkPolicy, or [] when `kubernetes.networkPolicy` is false.

    Args:
        spec: the job.
        target: `pytorchjob`, `trainjob` or `rayjob`.
    """
    if not spec.spec.kubernetes.network_policy:
        return []
    own = {"podSelector": {"matchLabels": c.selector_labels(spec)}}
    ingress: list[dict[str, Any]] = [{"from": [own], "ports": [{"protocol": "TCP"}]}]
    metrics = [_tcp(int(port["containerPort"])) for port in c.metrics_ports(spec)]
    if metrics:
        ingress.append({"from": [copy.deepcopy(PROMETHEUS_PEER)], "ports": metrics})
    if target == "rayjob":
        peers = [submitter_peer(spec), copy.deepcopy(KUBERAY_OPERATOR_PEER)]
        ingress.append({"from": peers, "ports": [_tcp(DASHBOARD_PORT)]})
    policy = {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": c.object_meta(spec, "network-policy", network_policy_name(spec)),
        "spec": {
            "podSelector": {"matchLabels": c.selector_labels(spec)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
    return [policy]
