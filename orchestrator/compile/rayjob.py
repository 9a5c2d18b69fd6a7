"""KubeRay (`ray.io/v1` RayJob): a Ray cluster per job whose driver runs the job with Ray Train.

The head runs the entrypoint (`python -m orchestrator.backends.ray_entry --spec ...`, built by the Ray
backend), which starts a TorchTrainer over the worker group. The worker group spans `nodes.min` to
`nodes.max` pods; with an elastic range the in-tree autoscaler grows it and Ray Train resizes.
"""

from __future__ import annotations

from typing import Any

from orchestrator.compile import _common as c
from orchestrator.naming import RAY_WORKER_GROUP
from orchestrator.spec import JobSpec

__all__ = ["API_VERSION", "ENTRY_MODULE", "compile_rayjob", "entrypoint"]

API_VERSION = "ray.io/v1"
ENTRY_MODULE = "orchestrator.backends.ray_entry"


def entrypoint(spec_path: str = c.SPEC_FILE) -> str:
    return f"python -m {ENTRY_MODULE} --spec {spec_path}"


def _container(
    spec: JobSpec, name: str, image: str, res: dict[str, Any], ports: list[dict[str, Any]]
) -> dict[str, Any]:
    _, mounts = c.volumes_and_mounts(spec)
    container: dict[str, Any] = {
        "name": name,
        "image": image,
        "imagePullPolicy": spec.spec.kubernetes.image_pull_policy,
        "env": c.worker_env(spec),
        "resources": res,
        "volumeMounts": mounts,
        "securityContext": c.container_security_context(),
    }
    if ports:
        container["ports"] = ports
    return container


def _pod(spec: JobSpec, component: str, container: dict[str, Any]) -> dict[str, Any]:
    volumes, _ = c.volumes_and_mounts(spec)
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": c.pod_security_context(),
        **c.pod_placement(spec),
    }
    if spec.spec.kubernetes.gang == "volcano":
        pod_spec["schedulerName"] = "volcano"
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
    head_res = {
        "requests": {"cpu": s.ray.head_cpu, "memory": s.ray.head_memory},
        "limits": {"cpu": s.ray.head_cpu, "memory": s.ray.head_memory},
    }
    head_ports = [
        {"name": "gcs", "containerPort": 6379, "protocol": "TCP"},
        {"name": "dashboard", "containerPort": 8265, "protocol": "TCP"},
        {"name": "client", "containerPort": 10001, "protocol": "TCP"},
    ]
    head = {
        # num-cpus 0: no training worker lands on the head, so losing a worker never takes the driver.
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
        "template": _pod(spec, "head", _container(spec, "ray-head", image, head_res, head_ports)),
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
        "enableInTreeAutoscaling": elastic,
        "headGroupSpec": head,
        "workerGroupSpecs": [worker_group],
    }
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
