"""The worker pod every Kubernetes target builds on, hardened: what runs first, what may be written,
how the kubelet tells a hung worker, and where credentials come from.

- Every container command starts with `python -m training.launch` (`training.preflight`): a typo in the
  task, a GPU job without CUDA or an unwritable store exits 2 or 3 (permanent) before torchrun starts.
- The Pod Security Standard "restricted": non-root, no privilege escalation, every capability dropped,
  RuntimeDefault seccomp; plus a read-only root filesystem with emptyDirs where something writes: the
  run directory, /tmp (torchelastic, Ray, inductor), the cache under the image's HOME (torch, datasets),
  /dev/shm, the node-local checkpoint directory and any pod-local absolute `file://` store.
- No ServiceAccount token, unless `kubernetes.automountServiceAccountToken` asks for one (or KubeRay's
  autoscaler needs it on the head).
- A liveness probe runs `python -m training.healthcheck` (the image's Docker HEALTHCHECK is ignored by
  Kubernetes): healthy while local rank 0's exporter answers and a step completed within
  `restarts.stepTimeoutSeconds`, before the first exporter for as long as a start may take, and while
  the pod stands by. No startup or readiness probe: a pod is Ready from its container's start, so its
  Service name resolves before the rendezvous that needs it (see `probes`). No probe without an
  exporter (`metrics.enabled: false`) or when it binds an address the probe cannot reach.
- Store credentials come from the Secrets named by `stores[].secretRef` (`envFrom`), never inline.
"""

from __future__ import annotations

import math
import posixpath
from typing import Any

from orchestrator.compile._common import (
    RUN_DIR,
    SHM_PATH,
    SPEC_DIR,
    SPEC_FILE,
    SPEC_KEY,
    configmap_name,
    job_secret_mount,
    job_secret_volume,
)
from orchestrator.spec import JobSpec
from training.preemption_timing import pod_grace_period_seconds

__all__ = [
    "CACHE_DIR",
    "HEALTHCHECK",
    "LAUNCH_MODULE",
    "RDZV_JOIN_TIMEOUT_S",
    "TMP_DIR",
    "automount",
    "container_security_context",
    "env_from",
    "launcher",
    "pod_security_context",
    "probes",
    "store_mount_path",
    "termination_grace",
    "volumes_and_mounts",
]

# The user every torchrig image runs as; a fixed id lets `fsGroup` make PVCs writable.
RUN_AS_USER = 1000
TMP_DIR = "/tmp"
# The images' user is `torchrig` (uid 1000) with HOME /home/torchrig; only its cache is mounted over, so
# whatever a derived image puts in HOME (the working directory) stays visible.
CACHE_DIR = "/home/torchrig/.cache"
LAUNCH_MODULE = "training.launch"
HEALTHCHECK = ["python", "-m", "training.healthcheck"]
# torchrun's rendezvous waits this long for its peers before the first worker (and exporter) starts.
RDZV_JOIN_TIMEOUT_S = 600
_LIVENESS_PERIOD_S = 30
_PROBE_TIMEOUT_S = 10
# Addresses a probe inside the pod reaches the exporter on (None: all interfaces).
_PROBEABLE_BINDS = (None, "0.0.0.0", "::", "127.0.0.1", "localhost")


def launcher(spec_path: str = SPEC_FILE, *, gpu_check: bool = True) -> list[str]:
    """`python -m training.launch --spec PATH [--no-gpu-check] --`: what every command starts with."""
    return ["python", "-m", LAUNCH_MODULE, "--spec", spec_path, *([] if gpu_check else ["--no-gpu-check"]), "--"]


def termination_grace(spec: JobSpec) -> dict[str, Any]:
    """`terminationGracePeriodSeconds` of a worker pod: on an eviction the workers get
    `restarts.preemptGraceSeconds` for their emergency checkpoint, torchrun and the container a margin
    on top (`training.preemption_timing.pod_grace_period_seconds`). Nothing when preemption handling is off."""
    restarts = spec.spec.restarts
    if restarts.preempt_grace_seconds <= 0:
        return {}
    return {"terminationGracePeriodSeconds": pod_grace_period_seconds(restarts)}


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """The `restricted` Pod Security Standard, container part, and a read-only root filesystem."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def automount(*, needs_api: bool = False) -> dict[str, Any]:
    """`automountServiceAccountToken`: false unless the pod needs the Kubernetes API."""
    return {"automountServiceAccountToken": needs_api}


def _under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def store_mount_path(path: str) -> str:
    """Where a `file://` store's path is in the pod: absolute as written, relative under the run directory."""
    return path if path.startswith("/") else posixpath.normpath(f"{RUN_DIR}/{path}")


def volumes_and_mounts(spec: JobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Volumes of the pod and mounts of the worker container.

    The spec ConfigMap and the job's secret (read-only), then the writable emptyDirs (run directory, /tmp, the cache,
    /dev/shm, the node-local directory unless it lies on /dev/shm), then per store: its PVC at its path,
    or an emptyDir at a pod-local absolute path no other mount already holds.
    """
    s = spec.spec
    volumes: list[dict[str, Any]] = [
        {
            "name": "torchrig-spec",
            "configMap": {"name": configmap_name(spec), "items": [{"key": SPEC_KEY, "path": SPEC_KEY}]},
        },
        job_secret_volume(spec),
        {"name": "torchrig-run", "emptyDir": {}},
        {"name": "torchrig-tmp", "emptyDir": {}},
        {"name": "torchrig-cache", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "torchrig-spec", "mountPath": SPEC_DIR, "readOnly": True},
        job_secret_mount(),
        {"name": "torchrig-run", "mountPath": RUN_DIR},
        {"name": "torchrig-tmp", "mountPath": TMP_DIR},
        {"name": "torchrig-cache", "mountPath": CACHE_DIR},
    ]
    writable = [RUN_DIR, TMP_DIR, CACHE_DIR]
    shm = [SHM_PATH] if s.resources.shared_memory is not None else []
    if shm:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": s.resources.shared_memory}})
        mounts.append({"name": "dshm", "mountPath": SHM_PATH})
    node_local = s.checkpoint.node_local
    if node_local.enabled and not _under(node_local.path, shm):
        volumes.append({"name": "torchrig-node-local", "emptyDir": {}})
        mounts.append({"name": "torchrig-node-local", "mountPath": node_local.path})
    writable += shm + ([node_local.path] if node_local.enabled else [])
    for i, store in enumerate(s.checkpoint.stores):
        if not store.kind.filesystem:
            continue
        path = store_mount_path(store.path)
        name = f"store-{i}"
        if store.pvc is not None:
            volumes.append({"name": name, "persistentVolumeClaim": {"claimName": store.pvc}})
            mounts.append({"name": name, "mountPath": path})
        elif not _under(path, writable):
            volumes.append({"name": name, "emptyDir": {}})
            mounts.append({"name": name, "mountPath": path})
            writable.append(path)
    return volumes, mounts


def env_from(spec: JobSpec) -> list[dict[str, Any]]:
    """`envFrom` of the worker containers: every Secret named by `stores[].secretRef`, once, in store order."""
    names = [s.secret_ref for s in spec.spec.checkpoint.stores if s.secret_ref]
    return [{"secretRef": {"name": name}} for name in dict.fromkeys(names)]


def probes(spec: JobSpec) -> dict[str, Any]:
    """The `livenessProbe` of a torchrun worker container (empty without an exporter).

    Liveness only, on purpose. The operators' Services are headless and (PyTorchJob's) do not publish
    not-ready addresses, so a pod's name resolves only once the pod is Ready; a startup probe that waits
    for the exporter (which starts after torchrun's rendezvous) kept the rendezvous host unresolvable
    until the rendezvous it hosts had completed: a fixed-size job deadlocked (issue 40). Without a startup
    or readiness probe the pod is Ready as soon as its container runs. The health check itself grants
    the start (`--start-budget-s`: torchrun's rendezvous, `RDZV_JOIN_TIMEOUT_S`, then the longer of a
    step timeout and the checkpoint I/O timeout for the restore and the first step) from the container's
    age, and a standby node (`restarts.spareNodes`) is healthy while it stands by without an exporter.
    After that, the probe lets the exporter be down (a torchrun group restart) or report no step for about
    as long again before the kubelet kills the container: the in-process step watchdog acts first, the
    probe catches what it cannot (a process frozen whole).
    """
    m = spec.spec.metrics
    if not m.enabled or (m.bind_address or None) not in _PROBEABLE_BINDS:  # "" binds all, like None
        return {}
    # A restore or the final save may run up to checkpoint.ioTimeoutSeconds without a step (the worker's
    # watchdog and health check allow it): the probes must not kill what the watchdog still allows.
    timeout_s = max(spec.spec.restarts.step_timeout_seconds, spec.spec.checkpoint.io_timeout_seconds)
    period = _LIVENESS_PERIOD_S
    command = [*HEALTHCHECK, "--start-budget-s", str(math.ceil(RDZV_JOIN_TIMEOUT_S + timeout_s))]
    return {"livenessProbe": _exec_probe(command, period, max(3, math.ceil(timeout_s / period)))}


def _exec_probe(command: list[str], period_s: int, failure_threshold: int) -> dict[str, Any]:
    return {
        "exec": {"command": command},
        "timeoutSeconds": _PROBE_TIMEOUT_S,
        "periodSeconds": period_s,
        "failureThreshold": failure_threshold,
    }
