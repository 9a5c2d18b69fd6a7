"""Kubeflow Training Operator v1 (`kubeflow.org/v1` PyTorchJob) + the spec ConfigMap.

Two shapes, following the operator (release-1.9) and its validating webhook:

- elastic (`nodes.min < nodes.max`): `elasticPolicy` and Worker replicas only. The operator injects
  `PET_NNODES=min:max`, `PET_RDZV_ENDPOINT=<job>-worker-0:<pytorchjob-port>`, `PET_RDZV_BACKEND`,
  `PET_RDZV_ID`, `PET_MAX_RESTARTS` and `PET_NPROC_PER_NODE`, which `torchrun` reads as its defaults.
- fixed size: Master (exactly 1 replica, webhook rule) + Worker (nodes - 1, omitted when 0). The
  operator injects `MASTER_ADDR` and `MASTER_PORT` only when a Master exists; the command passes them to
  torchrun (`$(VAR)` expansion) as the endpoint of a c10d rendezvous, like the elastic shape's: the
  master pod's agent hosts the store (its hostname is the endpoint's), a recreated pod rejoins the
  running job (a static rendezvous could not take it back), and in-place recovery shares that store
  across nodes (`Env.INPLACE_STORE_RDZV`).

Standby nodes (`restarts.spareNodes: S`, fixed size only): S more Worker replicas, whose pods from
replica index `nodes - 1` on stand by outside the rendezvous (`training.inplace.standby`:
`TORCHRIG_STANDBY_FROM`, and the operator's `replica-index` label through the downward API) and take a
lost node's ranks in place.

Every replica has `restartPolicy: ExitCode` (the operator runs the pods with `restartPolicy: Never` and
reads the `pytorch` container's exit code, `pkg/controller.v1/common/pod.go` `ReconcilePods`): 128 and
above (a signal: a lost node, an OOM kill, the liveness probe) recreates the pod; 1-127 fails the job at
once. So the preflight's 2 and 3 end the job with their message instead of restarting it, and torchrun's
own 1, its worker group failed with `restarts.max` group restarts spent, ends it too: torchrun owns the
restart budget here. `runPolicy.backoffLimit` still bounds the recreated pods.
"""

from __future__ import annotations

import copy
from typing import Any

from orchestrator.compile import _common as c
from orchestrator.compile import _pod as p
from orchestrator.spec import JobSpec
from training.contract import Env

__all__ = ["API_VERSION", "CONTAINER_NAME", "KIND", "RDZV_PORT", "compile_pytorchjob", "spare_nodes", "worker_command"]

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
# The operator finds the training container by this name (webhook: "must have a container named pytorch").
CONTAINER_NAME = "pytorch"
# The operator reads the rendezvous/master port from the container port with this name.
PORT_NAME = "pytorchjob-port"
RDZV_PORT = 23456
# training-operator: 1-127 fail the job, 128+ recreate the pod (training.contract.ExitCode).
RESTART_POLICY = "ExitCode"
# The operator labels every pod with its index within its replica type (common/pod.go createNewPod).
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"


def worker_command(spec: JobSpec, *, elastic: bool) -> list[str]:
    """The container command: the preflight, then torchrun on each node, the rest from operator-injected env."""
    s = spec.spec
    cmd = [*p.launcher(), "torchrun", "--nproc-per-node", str(s.procs_per_node)]
    if not elastic:
        cmd += [
            "--nnodes",
            str(s.nodes.max),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"$({Env.MASTER_ADDR}):$({Env.MASTER_PORT})",
            "--rdzv-id",
            spec.name,
            "--max-restarts",
            str(s.restarts.max),
        ]
    return cmd + c.worker_program()


def _pod_template(spec: JobSpec, *, elastic: bool) -> dict[str, Any]:
    s = spec.spec
    volumes, mounts = p.volumes_and_mounts(spec)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": s.image,
        "imagePullPolicy": s.kubernetes.image_pull_policy,
        "command": worker_command(spec, elastic=elastic),
        "env": c.worker_env(spec, standby=spare_nodes(spec, elastic=elastic) > 0),
        "ports": [{"name": PORT_NAME, "containerPort": RDZV_PORT, "protocol": "TCP"}, *c.metrics_ports(spec)],
        "resources": c.resources(spec),
        "volumeMounts": mounts,
        "securityContext": p.container_security_context(),
        **p.probes(spec),
    }
    env_from = p.env_from(spec)
    if env_from:
        container["envFrom"] = env_from
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": p.pod_security_context(),
        **p.automount(needs_api=s.kubernetes.automount_service_account_token),
        **c.pod_placement(spec),
        **p.termination_grace(spec),
    }
    if s.kubernetes.gang == "volcano":
        pod_spec["schedulerName"] = "volcano"
    return {
        "metadata": {"labels": c.pod_labels(spec), "annotations": c.pod_annotations(spec)},
        "spec": pod_spec,
    }


def _run_policy(spec: JobSpec, min_available: int) -> dict[str, Any]:
    k = spec.spec.kubernetes
    policy: dict[str, Any] = {"cleanPodPolicy": k.clean_pod_policy, "backoffLimit": spec.spec.restarts.max}
    if k.ttl_seconds_after_finished is not None:
        policy["ttlSecondsAfterFinished"] = k.ttl_seconds_after_finished
    if k.active_deadline_seconds is not None:
        policy["activeDeadlineSeconds"] = k.active_deadline_seconds
    if k.gang == "volcano":
        sched: dict[str, Any] = {"minAvailable": min_available}
        if k.queue:
            sched["queue"] = k.queue
        if k.priority_class:
            sched["priorityClass"] = k.priority_class
        policy["schedulingPolicy"] = sched
    return policy


def spare_nodes(spec: JobSpec, *, elastic: bool) -> int:
    """How many standby Worker pods the job runs (`restarts.spareNodes`): the fixed-size shape only (an
    elastic job's operator and rendezvous handle a lost node themselves), and only with in-place recovery."""
    r = spec.spec.restarts
    if elastic or r.mode == "restart" or r.spares < 1:
        return 0
    return r.spare_nodes


def _standby_template(template: dict[str, Any], members: int) -> dict[str, Any]:
    """The Worker template of a job with standby nodes: Workers from replica index `members` on stand by
    (`training.inplace.standby`); every Worker learns its index from the operator's label."""
    out = copy.deepcopy(template)
    env = out["spec"]["containers"][0]["env"]
    env.append({"name": Env.STANDBY_FROM, "value": str(members)})
    env.append(
        {
            "name": Env.REPLICA_INDEX,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{REPLICA_INDEX_LABEL}']"}},
        }
    )
    return out


def compile_pytorchjob(spec: JobSpec, *, fixed_size: bool = False) -> list[dict[str, Any]]:
    """The ConfigMap and the PyTorchJob, in apply order.

    Args:
        spec: the job.
        fixed_size: run an elastic spec at `nodes.max` nodes with a Master (no elasticPolicy).
    """
    s = spec.spec
    elastic = s.nodes.elastic and not fixed_size
    template = _pod_template(spec, elastic=elastic)
    replica_specs: dict[str, Any] = {}
    if elastic:
        replica_specs["Worker"] = {"replicas": s.nodes.max, "restartPolicy": RESTART_POLICY, "template": template}
    else:
        spare = spare_nodes(spec, elastic=elastic)
        replica_specs["Master"] = {"replicas": 1, "restartPolicy": RESTART_POLICY, "template": template}
        if s.nodes.max > 1 or spare:
            replica_specs["Worker"] = {
                "replicas": s.nodes.max - 1 + spare,
                "restartPolicy": RESTART_POLICY,
                "template": _standby_template(template, s.nodes.max - 1) if spare else template,
            }
    meta = c.object_meta(spec, "training")
    if s.kubernetes.gang == "kueue" and s.kubernetes.queue:
        meta["labels"]["kueue.x-k8s.io/queue-name"] = s.kubernetes.queue
    job_spec: dict[str, Any] = {
        # Top-level nprocPerNode (a string in the CRD) is what the webhook wants; elasticPolicy.nProcPerNode
        # is deprecated there.
        "nprocPerNode": str(s.procs_per_node),
        "runPolicy": _run_policy(spec, s.nodes.min if elastic else s.nodes.max),
        "pytorchReplicaSpecs": replica_specs,
    }
    if elastic:
        job_spec["elasticPolicy"] = {
            "minReplicas": s.nodes.min,
            "maxReplicas": s.nodes.max,
            "rdzvBackend": "c10d",
            "rdzvId": spec.name,
            "maxRestarts": s.restarts.max,
        }
    job = {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": job_spec}
    return [c.spec_configmap(spec), job]
