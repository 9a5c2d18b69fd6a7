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

Standby nodes (`restarts.spareNodes: S`, fixed size only): the Master replica is a store-only pod
(`training.rendezvous_store`: the c10d store at the rendezvous port, no GPU, a small Guaranteed pod), every
training node is a Worker (indices 0..nodes-1), and S more Worker replicas, from replica index `nodes` on,
stand by outside the rendezvous (`training.inplace.standby`: `TORCHRIG_STANDBY_FROM`, and the operator's
`replica-index` label through the downward API) and take a lost node's ranks in place. With the store in
a training node's agent, that node's loss would take the rendezvous and the in-place bookkeeping with it:
the one node no standby could replace. The store pod exits 0 when the agents pass torchrun's exit barrier
(the job succeeds with its Master), and with an agent's permanent code when one ends the job.

Readiness (issue 40): the operator's Services are headless without `publishNotReadyAddresses`
(`pkg/controller.v1/common/service.go`), so cluster DNS answers `<job>-master-0` (the fixed-size rendezvous
endpoint, and what the Workers' `init-pytorch` waits for) and `<job>-worker-0` (the elastic one) only while
that pod is Ready. The worker container therefore has no startup or readiness probe: it is Ready as soon
as it runs, before the rendezvous it hosts. Its liveness probe (`_pod.probes`) covers the start itself
(the health check's `--start-budget-s`, from the container's age) and a standby Worker (healthy while it
stands by without an exporter). A startup probe that waits for the exporter, as rendered before, held the
host unresolvable until after the rendezvous that needs it: the job never started. The Workers of a job
with a Master get the operator's `init-pytorch` (no securityContext; `init_container_warning`).

Every replica has `restartPolicy: ExitCode` (the operator runs the pods with `restartPolicy: Never` and
reads the `pytorch` container's exit code, `pkg/controller.v1/common/pod.go` `ReconcilePods`): 128 and
above (a signal: a lost node, an OOM kill, the liveness probe) recreates the pod; 1-127 fails the job at
once. So the preflight's 2 and 3 end the job with their message instead of restarting it, and torchrun's
own 1, its worker group failed with `restarts.max` group restarts spent, ends it too: torchrun owns the
restart budget here. The operator does not bound the recreated pods: `runPolicy.backoffLimit` is rendered
but counts only in-place container restarts of Running pods (`pkg/core/job.go` `PastBackoffLimit`: 0
under `Never`) and work-queue requeues (`common/job.go` `ReconcileJobs`; `NumRequeues` of the
controller's `FakeWorkQueue` is always 0), so it acts only at 0. The launcher bounds them instead
(`training.pod_recreations`): it counts each start of a pod in the job's shared checkpoint store and
exits 4 (`ExitCode.RESTARTS_SPENT`, permanent) once a pod was recreated more than `restarts.max` times.
"""

from __future__ import annotations

import copy
from typing import Any

from orchestrator.compile import _common as c
from orchestrator.compile import _pod as p
from orchestrator.spec import JobSpec
from training.contract import Env

__all__ = [
    "API_VERSION",
    "CONTAINER_NAME",
    "KIND",
    "RDZV_PORT",
    "STORE_POD_LABEL",
    "check_pytorchjob",
    "compile_pytorchjob",
    "init_container_warning",
    "spare_nodes",
    "store_command",
    "worker_command",
]

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
# On every pod of a job whose Master is the store-only pod: Worker i is then node i, and the Master no node.
STORE_POD_LABEL = ("torchrig.io/rendezvous", "store-pod")
STORE_COMPONENT = "rendezvous-store"
STORE_MODULE = "training.rendezvous_store"
# The store pod: Guaranteed QoS (requests = limits), so it is among the last pods a node evicts; an idle
# TCPStore server with torch imported holds ~300 MB.
STORE_RESOURCES = {"cpu": "1", "memory": "1Gi"}


def check_pytorchjob(spec: JobSpec, *, fixed_size: bool = False) -> list[str]:
    """The PyTorchJob's own warnings (`Target.check`): the operator's init container, if it adds one."""
    warning = init_container_warning(spec, fixed_size=fixed_size)
    return [warning] if warning else []


def init_container_warning(spec: JobSpec, *, fixed_size: bool = False) -> str | None:
    """The warning for a job whose Workers get the operator's `init-pytorch` (a Master and Workers), else None.

    The Training Operator adds it to every Worker pod whenever a Master exists
    (`pkg/controller.v1/pytorch/initcontainer.go` `setInitContainer`), from its built-in template: image
    alpine:3.10, no securityContext. No field of the job turns it off; a namespace enforcing the Pod
    Security Standard "restricted" refuses those Worker pods.
    """
    s = spec.spec
    elastic = s.nodes.elastic and not fixed_size
    if elastic or s.nodes.max + spare_nodes(spec, elastic=elastic) < 2:
        return None
    return (
        "spec.nodes: this PyTorchJob has a Master and Workers; the Training Operator adds its init container "
        "init-pytorch (alpine:3.10, no securityContext) to every Worker, which a namespace enforcing Pod Security "
        '"restricted" refuses: give the operator the restricted template docs/operators/pytorch-init-container.yaml '
        "(--pytorch-init-container-template-file), or run elastic (nodes.min < nodes.max, no --fixed-size, no "
        "restarts.spareNodes), or label the namespace pod-security.kubernetes.io/enforce=baseline"
    )


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


def store_command(spec: JobSpec) -> list[str]:
    """The store-only Master's command (`training.rendezvous_store`)."""
    return ["python", "-m", STORE_MODULE, "--port", str(RDZV_PORT), "--run-id", spec.name]


def _store_template(spec: JobSpec) -> dict[str, Any]:
    """The store-only Master: the rendezvous port the operator reads, /tmp writable, the job's secret."""
    s = spec.spec
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": s.image,
        "imagePullPolicy": s.kubernetes.image_pull_policy,
        "command": store_command(spec),
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": Env.JOB_SECRET_FILE, "value": c.JOB_SECRET_FILE}],
        "ports": [{"name": PORT_NAME, "containerPort": RDZV_PORT, "protocol": "TCP"}],
        "resources": {"requests": dict(STORE_RESOURCES), "limits": dict(STORE_RESOURCES)},
        "volumeMounts": [{"name": "torchrig-tmp", "mountPath": p.TMP_DIR}, c.job_secret_mount()],
        "securityContext": p.container_security_context(),
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "torchrig-tmp", "emptyDir": {}}, c.job_secret_volume(spec)],
        "securityContext": p.pod_security_context(),
        **p.automount(),
        **c.pod_placement(spec),
    }
    if s.kubernetes.gang == "volcano":
        pod_spec["schedulerName"] = "volcano"
    labels = {**c.pod_labels(spec, STORE_COMPONENT), STORE_POD_LABEL[0]: STORE_POD_LABEL[1]}
    annotations = {**spec.metadata.annotations, **s.kubernetes.pod_annotations}
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}


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
    return 0 if elastic else spec.spec.restarts.standby_nodes


def _standby_template(template: dict[str, Any], members: int) -> dict[str, Any]:
    """The Worker template of a job with standby nodes: Workers from replica index `members` on stand by
    (`training.inplace.standby`); every Worker learns its index from the operator's label, and that the
    rendezvous store is a pod of its own (`Env.STORE_POD`)."""
    out = copy.deepcopy(template)
    out["metadata"]["labels"][STORE_POD_LABEL[0]] = STORE_POD_LABEL[1]
    env = out["spec"]["containers"][0]["env"]
    env.append({"name": Env.STORE_POD, "value": "1"})
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
    elif spare := spare_nodes(spec, elastic=elastic):
        # The Master only hosts the store; the nodes and their standbys are Workers.
        replica_specs["Master"] = {"replicas": 1, "restartPolicy": RESTART_POLICY, "template": _store_template(spec)}
        replica_specs["Worker"] = {
            "replicas": s.nodes.max + spare,
            "restartPolicy": RESTART_POLICY,
            "template": _standby_template(template, s.nodes.max),
        }
    else:
        replica_specs["Master"] = {"replicas": 1, "restartPolicy": RESTART_POLICY, "template": template}
        if s.nodes.max > 1:
            replica_specs["Worker"] = {
                "replicas": s.nodes.max - 1,
                "restartPolicy": RESTART_POLICY,
                # A copy: one object under both keys prints as a YAML anchor and alias (`&id001`), which
                # `kubectl` reads but people and other tools do not expect in a manifest.
                "template": copy.deepcopy(template),
            }
    meta = c.object_meta(spec, "training")
    if s.kubernetes.gang == "kueue" and s.kubernetes.queue:
        meta["labels"]["kueue.x-k8s.io/queue-name"] = s.kubernetes.queue
    job_spec: dict[str, Any] = {
        # Top-level nprocPerNode (a string in the CRD) is what the webhook wants; elasticPolicy.nProcPerNode
        # is deprecated there.
        "nprocPerNode": str(s.procs_per_node),
        # The gang: the nodes, plus the store pod when there is one (standbys are not needed to start).
        "runPolicy": _run_policy(
            spec, s.nodes.min if elastic else s.nodes.max + (1 if spare_nodes(spec, elastic=elastic) else 0)
        ),
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
