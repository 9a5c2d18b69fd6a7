"""Pieces every Kubernetes target shares: names, labels, the spec ConfigMap, the worker's environment.

Everything here is a pure function of the `JobSpec`; the target modules assemble these pieces (and the
hardened pod of `_pod`) into their operator's resource. Paths and names that other components rely on
are constants here.
"""

from __future__ import annotations

import shlex
from typing import Any

from orchestrator.loader import dump_spec
from orchestrator.spec import JobSpec
from training.contract import Env
from training.preemption_timing import launcher_env

__all__ = [
    "JOB_SECRET_DIR",
    "JOB_SECRET_FILE",
    "JOB_SECRET_KEY",
    "JOB_SECRET_VOLUME",
    "RUN_DIR",
    "SHM_PATH",
    "SPEC_DIR",
    "SPEC_FILE",
    "SPEC_KEY",
    "WORKER_MODULE",
    "configmap_name",
    "job_secret",
    "job_secret_mount",
    "job_secret_name",
    "job_secret_volume",
    "labels",
    "metrics_ports",
    "object_meta",
    "pod_annotations",
    "pod_labels",
    "resources",
    "spec_configmap",
    "worker_env",
]

SPEC_DIR = "/etc/torchrig"
SPEC_KEY = "job.yaml"
SPEC_FILE = f"{SPEC_DIR}/{SPEC_KEY}"
RUN_DIR = "/var/run/torchrig"
WORKER_MODULE = "training"
SHM_PATH = "/dev/shm"
PART_OF = "torchrig"
# The job's own secret (`Env.JOB_SECRET_FILE`): a Secret `<job>-job-secret` whose key `job-secret` every
# pod of the job mounts read-only here. `torchrig submit` creates it (a resubmit keeps it: the pods of a
# running job must keep agreeing); `render` and the chart only name it, and no value is ever rendered.
JOB_SECRET_KEY = "job-secret"
JOB_SECRET_DIR = "/etc/torchrig-secret"
JOB_SECRET_FILE = f"{JOB_SECRET_DIR}/{JOB_SECRET_KEY}"
JOB_SECRET_VOLUME = "torchrig-job-secret"
# Owner read, group read (the pods run as uid 1000 with fsGroup 1000; the kubelet owns the file by root).
JOB_SECRET_MODE = 0o440


def configmap_name(spec: JobSpec) -> str:
    """Name of the ConfigMap that carries the resolved spec to the pods."""
    return f"{spec.name}-spec"


def job_secret_name(job_name: str) -> str:
    """Name of the Secret that holds the secret (`JOB_SECRET_KEY`) of the job `job_name`."""
    return f"{job_name}-job-secret"


def job_secret_volume(spec: JobSpec) -> dict[str, Any]:
    """The pod volume of the job's secret: required (`optional: false`), so a pod whose Secret is missing
    waits in ContainerCreating instead of running without it."""
    items = [{"key": JOB_SECRET_KEY, "path": JOB_SECRET_KEY}]
    secret = {
        "secretName": job_secret_name(spec.name),
        "optional": False,
        "defaultMode": JOB_SECRET_MODE,
        "items": items,
    }
    return {"name": JOB_SECRET_VOLUME, "secret": secret}


def job_secret_mount() -> dict[str, Any]:
    return {"name": JOB_SECRET_VOLUME, "mountPath": JOB_SECRET_DIR, "readOnly": True}


def job_secret(spec: JobSpec) -> dict[str, Any]:
    """The job's Secret as `submit` creates it, without its value (`submit` adds 32 random bytes, hex)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(spec, "secret", job_secret_name(spec.name)),
        "type": "Opaque",
    }


def _own_labels(spec: JobSpec, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": PART_OF,
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/managed-by": PART_OF,
        "app.kubernetes.io/component": component,
        "torchrig.io/job": spec.name,
    }


def labels(spec: JobSpec, component: str) -> dict[str, str]:
    """Labels of every object: the user's `metadata.labels`, then torchrig's (which win)."""
    return {**spec.metadata.labels, **_own_labels(spec, component)}


def selector_labels(spec: JobSpec) -> dict[str, str]:
    """The labels that select this job's worker pods (PodMonitor, kubectl)."""
    return {"app.kubernetes.io/instance": spec.name, "torchrig.io/job": spec.name}


def object_meta(spec: JobSpec, component: str, name: str | None = None, namespaced: bool = True) -> dict[str, Any]:
    """`metadata` of a top-level object."""
    meta: dict[str, Any] = {"name": name or spec.name}
    if namespaced:
        meta["namespace"] = spec.metadata.namespace
    meta["labels"] = labels(spec, component)
    if spec.metadata.annotations:
        meta["annotations"] = dict(spec.metadata.annotations)
    return meta


def pod_labels(spec: JobSpec, component: str = "worker") -> dict[str, str]:
    """Labels of the job's pods: `metadata.labels`, `kubernetes.podLabels`, then torchrig's, which win:
    the NetworkPolicy and the PodMonitor select the job's pods by them."""
    return {**spec.metadata.labels, **spec.spec.kubernetes.pod_labels, **_own_labels(spec, component)}


def pod_annotations(spec: JobSpec) -> dict[str, str]:
    """Pod annotations: Prometheus scrape hints for local rank 0 (the PodMonitor covers every rank)."""
    out: dict[str, str] = dict(spec.metadata.annotations)
    if spec.spec.metrics.enabled:
        out.update(
            {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(spec.spec.metrics.port),
                "prometheus.io/path": "/metrics",
            }
        )
    out.update(spec.spec.kubernetes.pod_annotations)
    return out


def metrics_port_name(local_rank: int) -> str:
    # Port names are IANA service names: at most 15 characters, so `metrics-r<N>` for N < 100000.
    return "metrics" if local_rank == 0 else f"metrics-r{local_rank}"


def metrics_ports(spec: JobSpec) -> list[dict[str, Any]]:
    """Container ports of the exporters: local rank r serves on `metrics.port + r`."""
    if not spec.spec.metrics.enabled:
        return []
    base = spec.spec.metrics.port
    return [
        {"name": metrics_port_name(r), "containerPort": base + r, "protocol": "TCP"}
        for r in range(spec.spec.procs_per_node)
    ]


def resources(spec: JobSpec) -> dict[str, Any]:
    """Requests = limits for CPU, memory and GPUs (Guaranteed QoS: a training pod should not be the first
    one evicted); ephemeral storage is requested only, since the kubelet evicts a pod over its limit."""
    res = spec.spec.resources
    requests: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory}
    limits: dict[str, Any] = dict(requests)
    if res.gpus > 0:
        limits[res.gpu_resource] = res.gpus
        requests[res.gpu_resource] = res.gpus
    if res.ephemeral_storage is not None:
        requests["ephemeral-storage"] = res.ephemeral_storage
    return {"requests": requests, "limits": limits}


def inplace_store_env(spec: JobSpec, *, standby: bool = False) -> dict[str, str]:
    """Where a torchrun launch that may recover in place finds its long-lived store: on one node its agent
    hosts one (`Env.INPLACE_STORE_AGENT`, `training.torchrun.host_inplace_store`); on several nodes every
    node shares the c10d rendezvous store (`Env.INPLACE_STORE_RDZV`: every Kubernetes target launches such
    a job over c10d, `in_place_c10d`); with standby nodes (`standby`, PyTorchJob) one node shares it too,
    as the standby pods must reach it. The worker still decides (`training.inplace.InPlace`)."""
    s = spec.spec
    if not s.restarts.in_place:
        return {}
    if s.nodes.max == 1 and not standby:
        return {Env.INPLACE_STORE: Env.INPLACE_STORE_AGENT} if s.procs_per_node >= 2 else {}
    return {Env.INPLACE_STORE: Env.INPLACE_STORE_RDZV}


def in_place_c10d(spec: JobSpec) -> bool:
    """Whether several nodes share the rendezvous store for in-place recovery (`inplace_store_env` gives
    `rdzv`): their torchrun must then run the c10d rendezvous, whose rounds the nodes agree on."""
    return inplace_store_env(spec).get(Env.INPLACE_STORE) == Env.INPLACE_STORE_RDZV


def worker_env(spec: JobSpec, *, torchrun: bool = True, standby: bool = False) -> list[dict[str, Any]]:
    """Environment of the worker container (architecture.md: backend -> worker contract); `torchrun`: the
    container runs torchrun (PyTorchJob, TrainJob), not a Ray head; `c10d`: over the c10d rendezvous;
    `standby`: the PyTorchJob runs standby nodes (`compile.pytorchjob.spare_nodes`)."""
    env: dict[str, str] = {
        Env.SPEC: SPEC_FILE,
        Env.RUN_DIR: RUN_DIR,
        Env.JOB_SECRET_FILE: JOB_SECRET_FILE,
        # The agent's shared rendezvous TCPStore leaves stale keys behind after a restart and the new
        # worker group can hang in init_process_group (ENVIRONMENT.md); a store per group avoids it.
        Env.DISABLE_SHARED_RDZV_STORE: "1",
        "PYTHONUNBUFFERED": "1",
        # torchrun waits past restarts.preemptGraceSeconds before it SIGKILLs its workers on a SIGTERM, so
        # their emergency checkpoint fits (training.preemption); the pod's grace period covers both.
        **launcher_env(spec.spec.restarts),
        **(inplace_store_env(spec, standby=standby) if torchrun else {}),
    }
    builtin: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in env.items()]
    # The node the pod runs on (downward API), the last built-in: the machine a worker names in its
    # metrics and `sdc` events (`Env.NODE_NAME`), to cordon or taint.
    builtin.append({"name": Env.NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    # A key of spec.kubernetes.env that names a built-in replaces its value in place; the others follow.
    user = spec.spec.kubernetes.env
    names = {item["name"] for item in builtin}
    out = [{"name": item["name"], "value": user[item["name"]]} if item["name"] in user else item for item in builtin]
    return out + [{"name": k, "value": v} for k, v in user.items() if k not in names]


def pod_placement(spec: JobSpec) -> dict[str, Any]:
    """Pod-spec fields that place the pod: service account, selectors, tolerations, pull secrets."""
    k = spec.spec.kubernetes
    out: dict[str, Any] = {}
    if k.service_account:
        out["serviceAccountName"] = k.service_account
    if k.priority_class:
        out["priorityClassName"] = k.priority_class
    if k.node_selector:
        out["nodeSelector"] = dict(k.node_selector)
    if k.tolerations:
        out["tolerations"] = [dict(t) for t in k.tolerations]
    if k.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": n} for n in k.image_pull_secrets]
    return out


def spec_configmap(spec: JobSpec) -> dict[str, Any]:
    """The ConfigMap holding the resolved spec, mounted at `SPEC_FILE` in every pod."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(spec, "spec", configmap_name(spec)),
        "data": {SPEC_KEY: dump_spec(spec)},
    }


def worker_program(spec_path: str = SPEC_FILE) -> list[str]:
    """The program torchrun starts on every rank: `-m training --spec PATH`."""
    return ["-m", WORKER_MODULE, "--spec", spec_path]


def shell_join(args: list[str]) -> str:
    """Join args for a POSIX shell; `$VAR` references stay expandable (double quotes), the rest is quoted."""
    out = []
    for arg in args:
        if "$" in arg and all(c not in arg for c in '"`\\'):
            out.append(f'"{arg}"' if any(c.isspace() for c in arg) or arg != shlex.quote(arg) else arg)
        else:
            out.append(shlex.quote(arg))
    return " ".join(out)
