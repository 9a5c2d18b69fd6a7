"""KubeRay (`ray.io/v1` RayJob): a Ray cluster per job whose driver runs the job with Ray Train.

The head runs the entrypoint (`python -m orchestrator.backends.ray_entry --spec ...`, built by the Ray
backend), which starts a TorchTrainer over the worker group. The worker group spans `nodes.min` to
`nodes.max` pods; with an elastic range the in-tree autoscaler grows it and Ray Train resizes.

Ray Train's `FailureConfig` retries every worker failure alike (it cannot tell exit codes apart), so the
entrypoint starts with the preflight (`python -m training.launch --no-gpu-check -- ...`): a task that
does not import or a store that cannot be written fails the Ray job with exit 2 or 3 before `fit()`,
and no retry is spent. CUDA is not checked on the head (it has no GPU: `num-cpus 0`, no GPU request);
Ray places the GPU workers only on nodes that advertise GPUs. No probes: KubeRay gives its pods Ray's
own health checks, and a worker pod may rightly idle without a training worker (and its exporter).
The head keeps its ServiceAccount token only while KubeRay's autoscaler, a sidecar of the head, needs
the API (an elastic range); that sidecar gets the restricted security context too (`autoscalerOptions`).

Ray's token authentication is on (`authOptions: {mode: token}`, KubeRay >= 1.5.1, Ray >= 2.52; older
`spec.ray.rayVersion`s are refused by `checks.check_target`): KubeRay makes a Secret with a random token
and gives it to every Ray container and the submitter, so the dashboard (the Jobs API, on 0.0.0.0 for
the submitter) and the Ray Client port answer only to the token's holders. A KubeRay older than 1.5.1
does not know the field and drops it: the cluster then runs without authentication.
"""

from __future__ import annotations

from typing import Any

from orchestrator.compile import _common as c
from orchestrator.compile import _pod as p
from orchestrator.naming import RAY_WORKER_GROUP
from orchestrator.spec import JobSpec

__all__ = ["API_VERSION", "ENTRY_MODULE", "compile_rayjob", "entrypoint"]

API_VERSION = "ray.io/v1"
ENTRY_MODULE = "orchestrator.backends.ray_entry"


def entrypoint(spec_path: str = c.SPEC_FILE) -> str:
    """The RayJob entrypoint: the preflight (no CUDA check on the head), then the Ray entry."""
    return c.shell_join([*p.launcher(spec_path, gpu_check=False), "python", "-m", ENTRY_MODULE, "--spec", spec_path])


def _container(
    spec: JobSpec, name: str, image: str, res: dict[str, Any], ports: list[dict[str, Any]]
) -> dict[str, Any]:
    _, mounts = p.volumes_and_mounts(spec)
    container: dict[str, Any] = {
        "name": name,
        "image": image,
        "imagePullPolicy": spec.spec.kubernetes.image_pull_policy,
        "env": c.worker_env(spec, torchrun=False),
        "resources": res,
        "volumeMounts": mounts,
        "securityContext": p.container_security_context(),
    }
    env_from = p.env_from(spec)
    if env_from:
        container["envFrom"] = env_from
    if ports:
        container["ports"] = ports
    return container


def _pod(spec: JobSpec, component: str, container: dict[str, Any], *, needs_api: bool = False) -> dict[str, Any]:
    volumes, _ = p.volumes_and_mounts(spec)
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": p.pod_security_context(),
        **p.automount(needs_api=needs_api or spec.spec.kubernetes.automount_service_account_token),
        **c.pod_placement(spec),
    }
    if spec.spec.kubernetes.gang == "volcano":
        pod_spec["schedulerName"] = "volcano"
    if component == "worker":
        pod_spec.update(p.termination_grace(spec))  # the Ray workers' emergency checkpoint
    meta: dict[str, Any] = {"labels": c.pod_labels(spec, component)}
    if component == "worker":
        meta["annotations"] = c.pod_annotations(spec)
    elif spec.metadata.annotations or spec.spec.kubernetes.pod_annotations:
        meta["annotations"] = {**spec.metadata.annotations, **spec.spec.kubernetes.pod_annotations}
    return {"metadata": meta, "spec": pod_spec}


def compile_rayjob(spec: JobSpec, *, fixed_size: bool = False) -> list[dict[str, Any]]:
    """The ConfigMap and the RayJob, in apply order.

    Args:
        spec: the job.
        fixed_size: pin the worker group at `nodes.max` (no autoscaling).
    """
    s = spec.spec
    k = s.kubernetes
    image = s.ray.image or s.image
    elastic = s.nodes.elastic and not fixed_size
    head_res: dict[str, Any] = {
        "requests": {"cpu": s.ray.head_cpu, "memory": s.ray.head_memory},
        "limits": {"cpu": s.ray.head_cpu, "memory": s.ray.head_memory},
    }
    if s.resources.ephemeral_storage is not None:
        head_res["requests"]["ephemeral-storage"] = s.resources.ephemeral_storage
    head_ports = [
        {"name": "gcs", "containerPort": 6379, "protocol": "TCP"},
        {"name": "dashboard", "containerPort": 8265, "protocol": "TCP"},
        {"name": "client", "containerPort": 10001, "protocol": "TCP"},
    ]
    head = {
        # num-cpus 0: no training worker lands on the head, so losing a worker never takes the driver.
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
        "template": _pod(spec, "head", _container(spec, "ray-head", image, head_res, head_ports), needs_api=elastic),
    }
    min_nodes = s.nodes.min if elastic else s.nodes.max
    worker_group: dict[str, Any] = {
        "groupName": RAY_WORKER_GROUP,
        "replicas": s.nodes.max,
        "minReplicas": min_nodes,
        "maxReplicas": s.nodes.max,
        "numOfHosts": 1,
        "rayStartParams": {},
        "template": _pod(
            spec, "worker", _container(spec, "ray-worker", image, c.resources(spec), c.metrics_ports(spec))
        ),
    }
    if s.resources.gpus > 0:
        worker_group["rayStartParams"]["num-gpus"] = str(s.resources.gpus)
    cluster: dict[str, Any] = {
        "rayVersion": s.ray.ray_version,
        "authOptions": {"mode": "token"},  # see the module docstring
        "enableInTreeAutoscaling": elastic,
        "headGroupSpec": head,
        "workerGroupSpecs": [worker_group],
    }
    if elastic:
        # KubeRay injects the autoscaler as a sidecar of the head; without this it would run unrestricted.
        # Its root filesystem stays writable: it is KubeRay's container, not torchrig's.
        sidecar = {k: v for k, v in p.container_security_context().items() if k != "readOnlyRootFilesystem"}
        cluster["autoscalerOptions"] = {"securityContext": sidecar}
    meta = c.object_meta(spec, "training")
    if k.gang == "kueue" and k.queue:
        meta["labels"]["kueue.x-k8s.io/queue-name"] = k.queue
    elif k.gang == "volcano":
        # KubeRay's volcano integration: a PodGroup per cluster, in this queue.
        meta["labels"]["ray.io/scheduler-name"] = "volcano"
        if k.queue:
            meta["labels"]["volcano.sh/queue-name"] = k.queue
    job_spec: dict[str, Any] = {
        "entrypoint": entrypoint(),
        "shutdownAfterJobFinishes": k.ttl_seconds_after_finished is not None,
        "rayClusterSpec": cluster,
    }
    if k.ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = k.ttl_seconds_after_finished
    if k.active_deadline_seconds is not None:
        job_spec["activeDeadlineSeconds"] = k.active_deadline_seconds
    if s.ray.runtime_env:
        import yaml

        job_spec["runtimeEnvYAML"] = yaml.safe_dump(s.ray.runtime_env, sort_keys=True)
    return [c.spec_configmap(spec), {"apiVersion": API_VERSION, "kind": "RayJob", "metadata": meta, "spec": job_spec}]
