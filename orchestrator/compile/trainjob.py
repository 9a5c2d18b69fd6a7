"""Kubeflow Trainer v2 (`trainer.kubeflow.org/v1alpha1` TrainJob), for Trainer >= v2.2.

Emits the spec ConfigMap, a namespaced TrainingRuntime `torchrig-<name>` (unless `kubernetes.runtimeRef`
names an existing runtime, a ClusterTrainingRuntime unless `runtimeKind` says otherwise) and the
TrainJob. A namespaced runtime of the job's own name is used by this job only: nothing another namespace
runs depends on it, and replacing it for a resubmit touches no other job. The runtime follows Trainer's
own `torch-distributed`: a JobSet with one replicatedJob named `node` labelled
`trainer.kubeflow.org/trainjob-ancestor-step: trainer` and a container named `node`, into which the torch
plugin injects `PET_NNODES`, `PET_NPROC_PER_NODE`, `PET_NODE_RANK`, `PET_MASTER_ADDR` and
`PET_MASTER_PORT` (torchrun's defaults). What the job adds to any runtime goes where Trainer takes it for
any runtime, so a user-supplied runtime (`runtimeRef`) gets it too: the worker's environment into
`spec.trainer.env` (the torch plugin merges it into the `node` container; Trainer's webhook refuses `env`
on the `node` container in a runtimePatch, `pkg/runtime/framework/plugins/jobset/jobset.go` Validate, and
the five `PET_*` variables it injects in `spec.trainer.env`, `plugins/torch/torch.go`), volumes, mounts and
placement into `runtimePatches` (their `ContainerPatch` has no `envFrom`: a store's `secretRef` needs
torchrig's own runtime). The runtime must exist before the TrainJob: Trainer's webhook refuses a TrainJob
whose runtime it cannot read (`pkg/runtime/core/trainingruntime.go` ValidateObjects). Trainer v2.2 removed
elastic training: elastic specs are refused.

Volcano (`gang: volcano`): the runtime's `podGroupPolicy.volcano` makes Trainer create the PodGroup, whose
queue it reads only from the JobSet template's annotation `scheduling.volcano.sh/queue-name`
(`plugins/volcano/volcano.go` Build); the runtime's pods name `schedulerName: volcano`, which Trainer does
not set.

Failures (Kubeflow's exit-code convention, `training.contract.ExitCode`): the runtime's pods run with
`restartPolicy: Never` and `backoffLimit: 0`, so a failed pod fails its Job and the JobSet restarts the
whole group from the last checkpoint (`failurePolicy.maxRestarts` = `restarts.max`; one replaced pod
could not rejoin the others' rendezvous). A rank that dies inside a pod of a job that recovers in place
is replaced there by a spare and fails no pod: several nodes then rendezvous over c10d at node 0
(`worker_command`) and share its store, as a PyTorchJob's do. A permanent exit code (the preflight's 2
and 3, 126, 127) fails the Job through its `podFailurePolicy` (reason `PodFailurePolicy`), and the JobSet's rule
`FailJobSet` on that reason ends the job without spending a restart. torchrun here runs with no restart
of its own, so its exit 1 (the group failed) is one failure to restart, not a permanent one.
"""

from __future__ import annotations

from typing import Any

from orchestrator.compile import _common as c
from orchestrator.compile import _pod as p
from orchestrator.errors import UnsupportedFeature
from orchestrator.naming import TRAINJOB_REPLICATED_JOB
from orchestrator.spec import JobSpec
from training.contract import PERMANENT

__all__ = [
    "API_VERSION",
    "CONTAINER_NAME",
    "PATCH_MANAGER",
    "RUNTIME_KIND",
    "check_trainjob",
    "compile_trainjob",
    "runtime_kind",
    "runtime_name",
]

API_VERSION = "trainer.kubeflow.org/v1alpha1"
CONTAINER_NAME = "node"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
PATCH_MANAGER = "torchrig.io/torchrig"
RUNTIME_KIND = "TrainingRuntime"  # of the runtime torchrig emits: namespaced, this job's own
# What the torch plugin injects as node 0's address and port (torchrun's static rendezvous reads them).
MASTER_ADDR_ENV, MASTER_PORT_ENV = "PET_MASTER_ADDR", "PET_MASTER_PORT"
# Batch's Job failure reason when a podFailurePolicy rule with action FailJob matched.
PERMANENT_FAILURE_REASON = "PodFailurePolicy"
# Where Trainer's volcano plugin reads a PodGroup's queue (volcano's QueueNameAnnotationKey).
VOLCANO_QUEUE_ANNOTATION = "scheduling.volcano.sh/queue-name"


def runtime_name(spec: JobSpec) -> str:
    return spec.spec.kubernetes.runtime_ref or f"torchrig-{spec.name}"


def runtime_kind(spec: JobSpec) -> str:
    """The kind the TrainJob's `runtimeRef` names: the user's `runtimeKind`, else torchrig's own runtime."""
    k = spec.spec.kubernetes
    return k.runtime_kind if k.runtime_ref else RUNTIME_KIND


def check_trainjob(spec: JobSpec, *, fixed_size: bool = False) -> None:
    """Raise UnsupportedFeature for what a TrainJob cannot express."""
    s = spec.spec
    if s.nodes.elastic and not fixed_size:
        raise UnsupportedFeature(
            f"spec.nodes: TrainJob (Trainer >= v2.2) has no elastic training (min {s.nodes.min} < max "
            f"{s.nodes.max}); use --target pytorchjob or rayjob, set min = max, or pass --fixed-size "
            f"to run at {s.nodes.max} nodes"
        )
    if s.kubernetes.gang == "volcano" and s.kubernetes.runtime_ref:
        raise UnsupportedFeature(
            "spec.kubernetes.gang: with runtimeRef the runtime's podGroupPolicy decides gang scheduling; "
            "set gang: none (and configure the runtime) or drop runtimeRef"
        )
    if s.kubernetes.runtime_ref and p.env_from(spec):
        raise UnsupportedFeature(
            "spec.checkpoint.stores[].secretRef: a TrainJob's runtimePatches cannot add envFrom to a user "
            "runtime (runtimeRef); drop runtimeRef, or give the runtime's container the Secret yourself"
        )


def worker_command(spec: JobSpec) -> list[str]:
    """Nodes, node rank and master address come from the PET_* variables the torch plugin injects (the
    static rendezvous). Several nodes that recover in place rendezvous over c10d at the same address
    instead (`c.in_place_c10d`): node 0's agent hosts the store there, and the round's token lets every
    node's ranks share it for in-place recovery; the static rendezvous has no round to agree on."""
    cmd = [*p.launcher(), "torchrun", "--nproc-per-node", str(spec.spec.procs_per_node)]
    if c.in_place_c10d(spec):
        endpoint = f"$({MASTER_ADDR_ENV}):$({MASTER_PORT_ENV})"
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", spec.name]
    return cmd + c.worker_program()


def _failure_policies() -> tuple[dict[str, Any], dict[str, Any]]:
    """The Job's `podFailurePolicy` and the JobSet's `failurePolicy` rules: permanent codes end the job."""
    pod_failure = {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": CONTAINER_NAME, "operator": "In", "values": list(PERMANENT)},
            }
        ]
    }
    rule = {"name": "PermanentExitCode", "action": "FailJobSet", "onJobFailureReasons": [PERMANENT_FAILURE_REASON]}
    return pod_failure, rule


def _runtime(spec: JobSpec) -> dict[str, Any]:
    s = spec.spec
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": s.image,
        "imagePullPolicy": s.kubernetes.image_pull_policy,
        "command": worker_command(spec),
        "ports": c.metrics_ports(spec),
        "resources": c.resources(spec),
        "securityContext": p.container_security_context(),
        **p.probes(spec),
    }
    if not container["ports"]:
        del container["ports"]
    env_from = p.env_from(spec)
    if env_from:
        container["envFrom"] = env_from
    pod_spec: dict[str, Any] = {
        "containers": [container],
        # podFailurePolicy needs Never; the JobSet, not the kubelet, restarts the group.
        "restartPolicy": "Never",
        **p.automount(needs_api=s.kubernetes.automount_service_account_token),
        **p.termination_grace(spec),
    }
    if s.kubernetes.priority_class:
        pod_spec["priorityClassName"] = s.kubernetes.priority_class
    if s.kubernetes.gang == "volcano":
        pod_spec["schedulerName"] = "volcano"  # not patchable in runtimePatches
    pod_failure, rule = _failure_policies()
    jobset_spec: dict[str, Any] = {
        # JobSet restarts the whole group from the last checkpoint, at most restarts.max times, except
        # on a permanent exit code.
        "failurePolicy": {"maxRestarts": s.restarts.max, "rules": [rule]},
        "replicatedJobs": [
            {
                "name": TRAINJOB_REPLICATED_JOB,
                "replicas": 1,
                "template": {
                    "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                    "spec": {
                        "backoffLimit": 0,
                        "podFailurePolicy": pod_failure,
                        "template": {
                            "metadata": {"labels": c.pod_labels(spec), "annotations": c.pod_annotations(spec)},
                            "spec": pod_spec,
                        },
                    },
                },
            }
        ],
    }
    template: dict[str, Any] = {"spec": jobset_spec}
    runtime_spec: dict[str, Any] = {"mlPolicy": {"numNodes": s.nodes.max, "torch": {}}, "template": template}
    if s.kubernetes.gang == "volcano":
        runtime_spec["podGroupPolicy"] = {"volcano": {}}
        if s.kubernetes.queue:
            template["metadata"] = {"annotations": {VOLCANO_QUEUE_ANNOTATION: s.kubernetes.queue}}
    return {
        "apiVersion": API_VERSION,
        "kind": RUNTIME_KIND,
        "metadata": c.object_meta(spec, "runtime", runtime_name(spec)),
        "spec": runtime_spec,
    }


def _runtime_patch(spec: JobSpec) -> dict[str, Any]:
    volumes, mounts = p.volumes_and_mounts(spec)
    pod_spec: dict[str, Any] = {
        "securityContext": p.pod_security_context(),
        "volumes": volumes,
        "containers": [
            {
                "name": CONTAINER_NAME,
                "volumeMounts": mounts,
                "securityContext": p.container_security_context(),
            }
        ],
    }
    placement = c.pod_placement(spec)
    placement.pop("priorityClassName", None)  # not patchable; set in the generated runtime
    pod_spec.update(placement)
    return {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": TRAINJOB_REPLICATED_JOB,
                            "template": {
                                "spec": {
                                    "template": {
                                        "metadata": {
                                            "labels": c.pod_labels(spec),
                                            "annotations": c.pod_annotations(spec),
                                        },
                                        "spec": pod_spec,
                                    }
                                }
                            },
                        }
                    ]
                }
            }
        },
    }


def compile_trainjob(spec: JobSpec, *, fixed_size: bool = False) -> list[dict[str, Any]]:
    """The ConfigMap, the TrainingRuntime (unless `runtimeRef`) and the TrainJob, in apply order.

    Raises:
        UnsupportedFeature: elastic spec without `fixed_size`; volcano gang or a store's `secretRef`
            with a user runtime.
    """
    check_trainjob(spec, fixed_size=fixed_size)
    s = spec.spec
    meta = c.object_meta(spec, "training")
    if s.kubernetes.queue and s.kubernetes.gang != "volcano":
        meta["labels"]["kueue.x-k8s.io/queue-name"] = s.kubernetes.queue
    trainer: dict[str, Any] = {
        "image": s.image,
        "command": worker_command(spec),
        "numNodes": s.nodes.max,
        "numProcPerNode": s.procs_per_node,
        "resourcesPerNode": c.resources(spec),
        "env": c.worker_env(spec),
    }
    job_spec: dict[str, Any] = {
        "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": runtime_kind(spec), "name": runtime_name(spec)},
        "trainer": trainer,
        "runtimePatches": [_runtime_patch(spec)],
    }
    if s.kubernetes.active_deadline_seconds is not None:
        job_spec["activeDeadlineSeconds"] = s.kubernetes.active_deadline_seconds
    out = [c.spec_configmap(spec)]
    if not s.kubernetes.runtime_ref:
        out.append(_runtime(spec))
    out.append({"apiVersion": API_VERSION, "kind": "TrainJob", "metadata": meta, "spec": job_spec})
    return out
