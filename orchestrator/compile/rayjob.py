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

The submitter (K8sJobMode, KubeRay's default) runs from `submitterPodTemplate`: KubeRay takes a given
template as it is (`common/job.go` GetSubmitterTemplate) and fills in only the command `ray job submit ...`
when the container has none, the env (the token, the dashboard address) and its own labels
(`rayjob_controller.go` getSubmitterTemplate, configureSubmitterContainer). So torchrig renders what the
default lacks: the image pull Secrets, the restricted security context (its root filesystem stays
writable: the Ray CLI is KubeRay's program, not torchrig's), Guaranteed resources, no ServiceAccount
token, and no command. The submitter carries none of the labels that select the job's pods: it is no
member of the job, and the NetworkPolicy lets it reach only the head's dashboard.

A job that recovers in place (`restarts.in_place`, 2+ ranks) runs it under Ray too: each Ray Train worker
is its rank's host and the host of each node's local rank 0 keeps `restarts.spares` warm spares, processes
of the worker pod beside its ranks that Ray does not know of (`training.ray_train`). So the worker pod asks
for its node's resources plus each spare's share of a rank (CPU and memory / procsPerNode; no GPU: a
promoted spare trains on its dead rank's device), and `num-cpus` pins what Ray may hand out to what the
ranks reserve (`compile_raytrain`), leaving the spares' share to them.

After the job ends KubeRay deletes the Ray cluster (`shutdownAfterJobFinishes`) once
`ttlSecondsAfterFinished` has passed (`rayjob_controller.go` handleShutdownAfterJobFinishes); until then
its pods hold their nodes and GPUs: `spec.ray.clusterTtlSeconds` (600 s unless set; null keeps the cluster).
It is the RayJob's own field, not `kubernetes.ttlSecondsAfterFinished` (a day, for the operators' jobs,
whose finished pods hold nothing): a resolved job file writes every default, so a TTL shared with the other
targets could not tell "unset" from "set to the default" once written (the job file a run keeps).
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

from orchestrator.compile import _common as c
from orchestrator.compile import _pod as p
from orchestrator.compile.raytrain import compile_raytrain
from orchestrator.naming import RAY_WORKER_GROUP
from orchestrator.spec import JobSpec, parse_quantity

__all__ = [
    "API_VERSION",
    "DASHBOARD_PORT",
    "ENTRY_MODULE",
    "SUBMITTER_CONTAINER",
    "cluster_ttl_seconds",
    "compile_rayjob",
    "entrypoint",
    "worker_resources",
]

API_VERSION = "ray.io/v1"
ENTRY_MODULE = "orchestrator.backends.ray_entry"
DASHBOARD_PORT = 8265  # the Jobs API, which the submitter and the operator call (KubeRay DefaultDashboardPort)
SUBMITTER_CONTAINER = "ray-job-submitter"  # KubeRay's name for it (utils.SubmitterContainerName)
# KubeRay's default submitter asks for 500m/200Mi up to 1 CPU/1Gi; requests = limits keep it Guaranteed.
SUBMITTER_RESOURCES = {"cpu": "1", "memory": "1Gi"}


def cluster_ttl_seconds(spec: JobSpec) -> int | None:
    """`ttlSecondsAfterFinished` of the RayJob: `spec.ray.clusterTtlSeconds` (None: keep the cluster)."""
    return spec.spec.ray.cluster_ttl_seconds


def entrypoint(spec_path: str = c.SPEC_FILE) -> str:
    """The RayJob entrypoint: the preflight (no CUDA check on the head), then the Ray entry."""
    return c.shell_join([*p.launcher(spec_path, gpu_check=False), "python", "-m", ENTRY_MODULE, "--spec", spec_path])


def _hosts_spares(spec: JobSpec) -> bool:
    """Whether the job's Ray Train workers host spares (`training.ray_train`): in place with 2+ ranks, and
    DDP or in-memory replicas of the shards (what `training.inplace.InPlace.from_spec` asks of a launch)."""
    s = spec.spec
    recoverable = s.training.strategy.value == "ddp" or s.checkpoint.in_memory.every is not None
    return s.restarts.in_place and s.max_world_size >= 2 and recoverable


def worker_resources(spec: JobSpec) -> dict[str, Any]:
    """The worker pod's requests = limits: its node's (`_common.resources`), plus each warm spare's share of
    a rank when the job recovers in place (the module docstring)."""
    res = c.resources(spec)
    s = spec.spec
    if not _hosts_spares(spec):
        return res
    share = Decimal(s.restarts.spares) / s.procs_per_node
    millicores = math.ceil(parse_quantity(s.resources.cpu) * (1 + share) * 1000)
    mebibytes = math.ceil(parse_quantity(s.resources.memory) * (1 + share) / (1 << 20))
    for side in ("requests", "limits"):
        res[side]["cpu"] = f"{millicores}m"
        res[side]["memory"] = f"{mebibytes}Mi"
    return res


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


def _submitter(spec: JobSpec, image: str) -> dict[str, Any]:
    """`submitterPodTemplate`: see the module docstring. No command: KubeRay writes `ray job submit`."""
    k = spec.spec.kubernetes
    security = {key: v for key, v in p.container_security_context().items() if key != "readOnlyRootFilesystem"}
    container = {
        "name": SUBMITTER_CONTAINER,
        "image": image,
        "imagePullPolicy": k.image_pull_policy,
        "resources": {"requests": dict(SUBMITTER_RESOURCES), "limits": dict(SUBMITTER_RESOURCES)},
        "securityContext": security,
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "restartPolicy": "Never",  # a Job's pod; KubeRay's Job retries the submission (backoffLimit)
        "securityContext": p.pod_security_context(),
        **p.automount(),
        **c.pod_placement(spec),
    }
    pod_spec.pop("serviceAccountName", None)  # it calls the Jobs API only, never the Kubernetes API
    selector = c.selector_labels(spec)
    labels = {key: v for key, v in c.pod_labels(spec, "submitter").items() if key not in selector}
    return {"metadata": {"labels": labels}, "spec": pod_spec}


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
        {"name": "dashboard", "containerPort": DASHBOARD_PORT, "protocol": "TCP"},
        {"name": "client", "containerPort": 10001, "protocol": "TCP"},
    ]
    head = {
        # num-cpus 0: no training worker lands on the head, so losing a worker never takes the driver.
        # disable-usage-stats: the head decides for the cluster; off, as `--target raycluster` has it (KubeRay
        # turns "true" into the bare flag, common/pod.go convertParamMap).
        "rayStartParams": {"dashboard-host": "0.0.0.0", "disable-usage-stats": "true", "num-cpus": "0"},
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
            spec, "worker", _container(spec, "ray-worker", image, worker_resources(spec), c.metrics_ports(spec))
        ),
    }
    if s.resources.gpus > 0:
        worker_group["rayStartParams"]["num-gpus"] = str(s.resources.gpus)
    if _hosts_spares(spec):
        # What the ranks reserve, not the pod's limit (KubeRay's default): the rest is the spares'.
        per_rank = compile_raytrain(spec, fixed_size=fixed_size).scaling.resources_per_worker["CPU"]
        worker_group["rayStartParams"]["num-cpus"] = str(math.ceil(per_rank * s.procs_per_node))
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
    ttl_s = cluster_ttl_seconds(spec)
    job_spec: dict[str, Any] = {
        "entrypoint": entrypoint(),
        "shutdownAfterJobFinishes": ttl_s is not None,
        "rayClusterSpec": cluster,
        "submitterPodTemplate": _submitter(spec, image),
    }
    if ttl_s is not None:
        job_spec["ttlSecondsAfterFinished"] = ttl_s
    if k.active_deadline_seconds is not None:
        job_spec["activeDeadlineSeconds"] = k.active_deadline_seconds
    if s.ray.runtime_env:
        import yaml

        job_spec["runtimeEnvYAML"] = yaml.safe_dump(s.ray.runtime_env, sort_keys=True)
    return [c.spec_configmap(spec), {"apiVersion": API_VERSION, "kind": "RayJob", "metadata": meta, "spec": job_spec}]
