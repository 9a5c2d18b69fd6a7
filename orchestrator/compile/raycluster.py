"""The `raycluster` target: a Ray cluster-launcher file (`ray up`) for aws or gcp, sized from the job.

`torchrig render JOB --target raycluster --cloud aws|gcp` prints the YAML Ray's cluster launcher reads
(docs.ray.io "Cluster YAML Configuration Options"; the schema is `ray/autoscaler/ray-schema.json`):

- a head node type that runs no training worker (`CPU: 0`: the Jobs API driver and Ray Train's
  controller need none), and a worker node type per node of the job, its VM chosen from
  `spec.resources` (the smallest default type of the cloud with the GPUs and CPUs asked for) unless
  `spec.ray.cluster.workerInstanceType` names one; `min_workers`/`max_workers` from `spec.nodes`;
- with `spot` (the default), the workers on spot (aws) or preemptible (gcp) VMs, and an on-demand
  worker type of the same shape (or `fallbackInstanceType`) that the autoscaler launches when spot
  capacity is short (lower `priority`, no `min_workers`);
- the torchrig image through `docker:` (`spec.ray.image`, default `spec.image`), or with `docker:
  false` setup commands that pin torch (`spec.ray.cluster.torchVersion`), ray (`spec.ray.rayVersion`)
  and torchrig (this version) on the VM image;
- Ray's token authentication, as the RayJob turns it on: every node starts Ray with
  `RAY_AUTH_MODE=token` and the token of the machine that runs `ray up` (`~/.ray/auth_token`, made by
  `ray get-auth-token --generate`, copied by `file_mounts`), so the Jobs API answers only its holders.
  The dashboard stays on the head's loopback: `ray dashboard CLUSTER.yaml` forwards it over ssh;
- `spec.ray.sharedDir`, when set, mounted into the containers at the same path (the file system itself
  is the cloud's: EFS, Filestore, NFS; mount it on the VMs with `initialization_commands`).

The compiler is pure: no cloud call; the tests run Ray's own `prepare_config` and schema on the result.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from typing import Any

import yaml

from orchestrator import __version__
from orchestrator.errors import SpecError, UnsupportedFeature
from orchestrator.spec import JobSpec, RayClusterConfig, parse_quantity

__all__ = ["INSTANCE_TYPES", "InstanceType", "RayClusterFile", "compile_raycluster", "pick_instance_type"]

HEAD_TYPE = "head"
WORKER_TYPE = "worker"
FALLBACK_TYPE = "worker-on-demand"
RAY_PORT = 6379
DEFAULT_REGION = {"aws": "us-west-2", "gcp": "us-central1"}
DEFAULT_HEAD = {"aws": "m5.2xlarge", "gcp": "n2-standard-8"}
# The token file `ray get-auth-token --generate` writes, where Ray reads it on every node (in the
# container too: the launcher syncs `file_mounts` into it).
AUTH_TOKEN_FILE = "~/.ray/auth_token"
# gcp: Deep Learning VM families (with docker, and with the NVIDIA driver for GPUs).
GCP_IMAGE = {
    False: "projects/deeplearning-platform-release/global/images/family/common-cpu",
    True: "projects/deeplearning-platform-release/global/images/family/common-cu124-debian-11-py310",
}


@dataclass(frozen=True)
class InstanceType:
    """A VM type the defaults choose from: its vCPUs, GPUs and memory."""

    name: str
    cpus: int
    gpus: int
    memory_gib: int


# Sorted by size: the first that fits is the default (on-demand list prices grow with size).
INSTANCE_TYPES: dict[str, tuple[InstanceType, ...]] = {
    "aws": (
        InstanceType("m5.xlarge", 4, 0, 16),
        InstanceType("m5.2xlarge", 8, 0, 32),
        InstanceType("m5.4xlarge", 16, 0, 64),
        InstanceType("m5.8xlarge", 32, 0, 128),
        InstanceType("m5.16xlarge", 64, 0, 256),
        InstanceType("m5.24xlarge", 96, 0, 384),
        InstanceType("g5.xlarge", 4, 1, 16),
        InstanceType("g5.2xlarge", 8, 1, 32),
        InstanceType("g5.12xlarge", 48, 4, 192),
        InstanceType("g5.48xlarge", 192, 8, 768),
        InstanceType("p4d.24xlarge", 96, 8, 1152),
    ),
    "gcp": (
        InstanceType("n2-standard-4", 4, 0, 16),
        InstanceType("n2-standard-8", 8, 0, 32),
        InstanceType("n2-standard-16", 16, 0, 64),
        InstanceType("n2-standard-32", 32, 0, 128),
        InstanceType("n2-standard-64", 64, 0, 256),
        InstanceType("n2-standard-96", 96, 0, 384),
        InstanceType("a2-highgpu-1g", 12, 1, 85),
        InstanceType("a2-highgpu-2g", 24, 2, 170),
        InstanceType("a2-highgpu-4g", 48, 4, 340),
        InstanceType("a2-highgpu-8g", 96, 8, 680),
    ),
}


def pick_instance_type(cloud: str, gpus: int, cpu: float, memory_gib: float) -> InstanceType | None:
    """The smallest default VM type of `cloud` without GPUs for a CPU job (with at least `gpus` for a
    GPU job), at least `cpu` vCPUs and `memory_gib` of memory; None when none fits."""
    for t in INSTANCE_TYPES[cloud]:
        if (t.gpus == 0) == (gpus == 0) and t.gpus >= gpus and t.cpus >= cpu and t.memory_gib >= memory_gib:
            return t
    return None


@dataclass(frozen=True)
class RayClusterFile:
    """The cluster-launcher config of one job (plain data), and the commands that use it."""

    config: dict[str, Any]
    job_name: str
    cloud: str

    def to_dict(self) -> dict[str, Any]:
        return self.config

    def render(self) -> str:
        """The YAML `ray up` reads, after a comment with the life cycle of the cluster."""
        header = (
            f"# Ray cluster for torchrig job {self.job_name} on {self.cloud} (torchrig render --target raycluster).\n"
            "#   ray get-auth-token --generate          # once: the token every node and the submitter share\n"
            "#   ray up -y cluster.yaml\n"
            "#   ray dashboard cluster.yaml &           # the Jobs API on http://127.0.0.1:8265, over ssh\n"
            "#   RAY_AUTH_MODE=token torchrig submit JOB.yaml --backend ray --address http://127.0.0.1:8265\n"
            "#   ray down -y cluster.yaml\n"
        )
        return header + yaml.safe_dump(self.config, sort_keys=False, width=120)


def _worker_shape(spec: JobSpec, cluster: RayClusterConfig) -> tuple[str, int, int]:
    """(VM type, CPUs, GPUs) of a worker node: the named type (its shape is the job's request), else the
    smallest default that fits the job's per-node request."""
    res = spec.spec.resources
    cpu = float(parse_quantity(res.cpu))
    gpus = res.gpus
    if cluster.worker_instance_type:
        known = {t.name: t for t in INSTANCE_TYPES[cluster.cloud]}.get(cluster.worker_instance_type)
        if known is not None:
            return known.name, known.cpus, known.gpus
        return cluster.worker_instance_type, max(1, math.ceil(cpu)), gpus
    memory_gib = float(parse_quantity(res.memory)) / 2**30
    picked = pick_instance_type(cluster.cloud, gpus, cpu, memory_gib)
    if picked is None:
        raise UnsupportedFeature(
            f"spec.resources: no default {cluster.cloud} VM type has {gpus} GPUs, {res.cpu} CPUs and {res.memory} "
            "of memory; name one in spec.ray.cluster.workerInstanceType"
        )
    return picked.name, picked.cpus, picked.gpus


def _node_config(cluster: RayClusterConfig, instance_type: str, *, gpus: int, spot: bool) -> dict[str, Any]:
    if cluster.cloud == "aws":
        config: dict[str, Any] = {
            "InstanceType": instance_type,
            "BlockDeviceMappings": [
                {"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": cluster.disk_gb, "VolumeType": "gp3"}}
            ],
        }
        if spot:
            config["InstanceMarketOptions"] = {"MarketType": "spot"}
        return config
    scheduling: dict[str, Any] = {"onHostMaintenance": "TERMINATE"} if gpus else {}
    if spot:
        scheduling.update(preemptible=True, automaticRestart=False)
    config = {
        "machineType": instance_type,
        "disks": [
            {
                "boot": True,
                "autoDelete": True,
                "type": "PERSISTENT",
                "initializeParams": {"diskSizeGb": cluster.disk_gb, "sourceImage": GCP_IMAGE[gpus > 0]},
            }
        ],
    }
    if scheduling:
        config["scheduling"] = scheduling
    return config


def _setup_commands(spec: JobSpec, cluster: RayClusterConfig) -> list[str]:
    """Without docker: the VM's Python gets the versions the job was tested with (the probe at submit
    checks them)."""
    if cluster.docker:
        return []
    packages = [
        f"torch=={cluster.torch_version}",
        f"ray[default,train]=={spec.spec.ray.ray_version}",
        f"torchrig[ray]=={__version__}",
    ]
    return ["python3 -m pip install --upgrade " + " ".join(shlex.quote(p) for p in packages)]


def _start_commands(head: bool) -> list[str]:
    # Token mode on every node; the launcher sets RAY_HEAD_IP and passes each type's resources.
    auth = "RAY_AUTH_MODE=token"  # the token: ~/.ray/auth_token, Ray's default place
    if head:
        start = (
            f"{auth} ray start --head --port={RAY_PORT} --object-manager-port=8076 "
            "--autoscaling-config=~/ray_bootstrap_config.yaml --dashboard-host=127.0.0.1 --disable-usage-stats"
        )
    else:
        start = f"{auth} ray start --address=$RAY_HEAD_IP:{RAY_PORT} --object-manager-port=8076"
    return ["ray stop", "ulimit -n 65536; " + start]


def compile_raycluster(spec: JobSpec, *, fixed_size: bool = False) -> RayClusterFile:
    """The cluster-launcher file of `spec` for `spec.ray.cluster.cloud`.

    Args:
        spec: the validated job.
        fixed_size: start `nodes.max` workers from the beginning (`min_workers = max_workers`).

    Raises:
        UnsupportedFeature: no default VM type fits `spec.resources` (name one).
        SpecError: gcp without `spec.ray.cluster.projectId`.
    """
    s = spec.spec
    cluster = s.ray.cluster
    cloud = cluster.cloud
    worker_type, worker_cpus, worker_gpus = _worker_shape(spec, cluster)
    min_nodes = s.nodes.max if fixed_size else s.nodes.min
    worker_resources = {"CPU": worker_cpus, **({"GPU": worker_gpus} if worker_gpus else {})}
    head_type = cluster.head_instance_type or DEFAULT_HEAD[cloud]
    node_types: dict[str, Any] = {
        HEAD_TYPE: {
            "resources": {"CPU": 0},  # no training worker on the head
            "node_config": _node_config(cluster, head_type, gpus=0, spot=False),
        },
        WORKER_TYPE: {
            "min_workers": min_nodes,
            "max_workers": s.nodes.max,
            "resources": worker_resources,
            "node_config": _node_config(cluster, worker_type, gpus=worker_gpus, spot=cluster.spot),
        },
    }
    if cluster.spot:
        node_types[WORKER_TYPE]["priority"] = 1
        node_types[FALLBACK_TYPE] = {
            "min_workers": 0,
            "max_workers": s.nodes.max,
            "priority": 0,
            "resources": dict(worker_resources),
            "node_config": _node_config(
                cluster, cluster.fallback_instance_type or worker_type, gpus=worker_gpus, spot=False
            ),
        }
    if cloud == "gcp" and not cluster.project_id:
        raise SpecError("spec.ray.cluster.projectId: required for gcp (the project the VMs are billed to)")
    provider: dict[str, Any] = {"type": cloud, "region": cluster.region or DEFAULT_REGION[cloud]}
    if cloud == "aws":
        provider["cache_stopped_nodes"] = False  # a stopped spot VM is no capacity
    else:
        provider["availability_zone"] = cluster.zone or f"{provider['region']}-a"
        provider["project_id"] = cluster.project_id
    config: dict[str, Any] = {
        "cluster_name": spec.name,
        "max_workers": s.nodes.max,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": cluster.idle_timeout_minutes,
        "provider": provider,
        "auth": {"ssh_user": cluster.ssh_user},
    }
    if cluster.docker:
        run_options = ["--ulimit nofile=65536:65536"]
        if s.resources.shared_memory:
            run_options.append(f"--shm-size={int(parse_quantity(s.resources.shared_memory))}b")
        if s.ray.shared_dir:
            run_options.append(f"-v {shlex.quote(s.ray.shared_dir)}:{shlex.quote(s.ray.shared_dir)}")
        config["docker"] = {
            "image": s.ray.image or s.image,
            "container_name": "torchrig",
            "pull_before_run": True,
            "run_options": run_options,
        }
    config.update(
        head_node_type=HEAD_TYPE,
        available_node_types=node_types,
        file_mounts={AUTH_TOKEN_FILE: AUTH_TOKEN_FILE},
        setup_commands=_setup_commands(spec, cluster),
        head_start_ray_commands=_start_commands(head=True),
        worker_start_ray_commands=_start_commands(head=False),
    )
    return RayClusterFile(config, spec.name, cloud)
