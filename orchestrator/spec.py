"""The job model: one typed description of a distributed PyTorch training run.

A job file is a Kubernetes-style document (`apiVersion: torchrig/v1`, `kind: TrainingJob`). Keys are
camelCase in YAML and snake_case in Python; unknown keys are rejected. The runtime sections (task,
training, restarts, checkpoint, metrics) are the models of `training.config`, shared with the worker.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import InitErrorDetails, PydanticCustomError

from orchestrator.credentials import inline_secrets
from orchestrator.naming import DNS1035_RE, DNS1123_LABEL_RE, MAX_NAME_LEN
from orchestrator.targets import DEFAULT_TARGET, SubmitTarget, get_target
from training.config import (
    CheckpointConfig,
    MetricsConfig,
    Model,
    Precision,
    RestartsConfig,
    SdcConfig,
    Strategy,
    TaskConfig,
    TrainingConfig,
)
from training.contract.env import Env

__all__ = [
    "API_VERSION",
    "KIND",
    "MAX_DEADLINE_S",
    "MAX_NODES",
    "MAX_PROCS_PER_NODE",
    "USER_ENV",
    "JobSpec",
    "JobSpecBody",
    "KubernetesConfig",
    "Metadata",
    "NodesConfig",
    "RayClusterConfig",
    "RayConfig",
    "ResourcesConfig",
    "parse_quantity",
]

API_VERSION = "torchrig/v1"
KIND = "TrainingJob"
DEFAULT_IMAGE = "ghcr.io/torchrig/torchrig-worker:0.1.0"

_QUANTITY_RE = re.compile(
    r"^(?P<num>[+]?(\d+(\.\d*)?|\.\d+))(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?$"
)
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
}
# Kubernetes' name rules (apimachinery `validation.IsDNS1123Subdomain`, `IsQualifiedName`, `IsValidLabelValue`,
# `IsEnvVarName`), matched whole (`fullmatch`: a `$` would let a trailing newline through).
_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_NAME_PART_RE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")  # a label value; a qualified name's name
_ENV_NAME_RE = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_CLOUD_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# Upper bounds of the counts and durations that become manifest fields or processes. Each is far beyond
# any real job, so that a typo (an extra digit, a pasted number) is an error rather than a manifest no API
# server takes or a render that allocates a container port per process until memory runs out.
MAX_NODES = 100_000  # the largest Kubernetes clusters have tens of thousands of nodes
MAX_PROCS_PER_NODE = 1024  # a node has at most a few hundred cores and 8-16 GPUs
MAX_PORT = 65535
MAX_INT32 = 2**31 - 1  # ttlSecondsAfterFinished is an int32 (PyTorchJob runPolicy, RayJob, JobSet)
MAX_DEADLINE_S = 10 * 365 * 24 * 3600  # ten years; fits the RayJob's int32 activeDeadlineSeconds

# The contract's variables a user sets on purpose (`spec.kubernetes.env`): the log level, an unknown GPU's
# peak FLOP/s, and the faults a drill on a cluster has its workers inject into themselves (`TORCHRIG_FAULTS`).
# The others are the backend's. (TORCHRIG_CHECKPOINT_KEY is a secret: a Secret through `stores[].secretRef`.)
USER_ENV = frozenset({Env.LOG_LEVEL, Env.PEAK_FLOPS, Env.FAULTS})
# torchrun reads each of its arguments from PET_<ARG>; the PyTorchJob and TrainJob operators set several
# (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_RDZV_*, ...) on every pod, after the spec's env.
_OPERATOR_ENV_PREFIX = "PET_"
# torchrun's and the operator's variables: one overridden in the spec would give every worker one rank.
_LAUNCHER_ENV = frozenset(
    {Env.RANK, Env.WORLD_SIZE, Env.LOCAL_RANK, Env.LOCAL_WORLD_SIZE, Env.GROUP_RANK, Env.GROUP_WORLD_SIZE}
    | {Env.MASTER_ADDR, Env.MASTER_PORT, Env.RESTART_COUNT, Env.RUN_ID, Env.ERROR_FILE}
)


def parse_quantity(value: str | int | float) -> Decimal:
    """Parse a Kubernetes resource quantity (`500m`, `2`, `4Gi`, `1e3`) into a Decimal."""
    text = str(value).strip()
    match = _QUANTITY_RE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)")
    try:
        number = Decimal(match.group("num"))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from exc
    suffix = match.group("suffix") or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    return number * (Decimal(10) ** int(suffix[1:]))


def _check_quantity(value: str) -> str:
    parse_quantity(value)
    return value


def _quantity_to_str(value: Any) -> Any:
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


Quantity = Annotated[str, BeforeValidator(_quantity_to_str), AfterValidator(_check_quantity)]


def _is_subdomain(value: str) -> bool:
    """A DNS-1123 subdomain: the name of most Kubernetes objects (Secret, PVC, ServiceAccount, PriorityClass)."""
    return len(value) <= 253 and _SUBDOMAIN_RE.fullmatch(value) is not None


def _is_qualified_name(value: str, *, prefixed: bool = False) -> bool:
    """A Kubernetes qualified name, `[prefix/]name` (a label key; with `prefixed`, an extended resource name)."""
    prefix, slash, name = value.rpartition("/")
    if (slash and not _is_subdomain(prefix)) or (prefixed and not slash):
        return False
    return len(name) <= 63 and _NAME_PART_RE.fullmatch(name) is not None


def _is_label_value(value: str) -> bool:
    return value == "" or (len(value) <= 63 and _NAME_PART_RE.fullmatch(value) is not None)


def _check_labels(value: dict[str, str]) -> dict[str, str]:
    for key, val in value.items():
        if not _is_qualified_name(key):
            raise ValueError(f"label key {key!r} is not a valid Kubernetes label key")
        if not _is_label_value(val):
            raise ValueError(f"label value {val!r} (key {key!r}) is not a valid Kubernetes label value")
    return value


_OBJECT_NAME_RULE = (
    "must be the name of a Kubernetes object, a DNS-1123 subdomain: lowercase letters, digits, '-' and '.', "
    "starting and ending with a letter or digit, at most 253 characters"
)


def _check_object_name(value: str) -> str:
    if not _is_subdomain(value):
        raise ValueError(_OBJECT_NAME_RULE)
    return value


def _check_image(value: str) -> str:
    if not value or any(c.isspace() for c in value):
        raise ValueError("must be an image reference such as ghcr.io/org/worker:tag (not empty, no whitespace)")
    return value


def _error_at(loc: tuple[str | int, ...], message: str, value: Any) -> ValidationError:
    """A problem at `loc` below the model that raises it (pydantic puts the model's own location in front):
    for a path that a ValueError's `path: message` cannot name, one with a list index or a map key."""
    error = InitErrorDetails(type=PydanticCustomError("value_error", message), loc=loc, input=value)
    return ValidationError.from_exception_data("JobSpec", [error])


Labels = Annotated[dict[str, str], AfterValidator(_check_labels)]
# The pattern is for editors and the chart's values.schema.json; the validator gives the one-line error.
ObjectName = Annotated[
    str,
    AfterValidator(_check_object_name),
    Field(json_schema_extra={"pattern": f"^{_SUBDOMAIN_RE.pattern}$", "maxLength": 253}),
]


class Metadata(Model):
    """Identity of the job, as in any Kubernetes object."""

    name: str = Field(
        description=(
            "Job name: a DNS-1035 label (lowercase letters, digits, '-'; starts with a letter) of at most "
            "63 characters. The Kubernetes targets allow less, checked when rendering or submitting to "
            "them: rayjob 47; pytorchjob 54 and trainjob 48 up to 10 nodes, one less per extra digit of "
            "the node count."
        ),
        examples=["digits-ddp"],
        # For editors (`torchrig schema`): the validator below gives the one-line error.
        json_schema_extra={"pattern": DNS1035_RE.pattern, "maxLength": 63},
    )
    namespace: str = Field(default="default", description="Kubernetes namespace to submit to.")
    labels: Labels = Field(default_factory=dict, description="Labels copied onto every object and pod.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations copied onto every object.")

    @field_validator("name")
    @classmethod
    def _dns1035(cls, value: str) -> str:
        if not DNS1035_RE.fullmatch(value):
            raise ValueError(
                "must be a DNS-1035 label: lowercase letters, digits and '-', starting with a letter "
                "and ending with a letter or digit"
            )
        if len(value) > MAX_NAME_LEN:
            raise ValueError(f"must be a DNS-1035 label of at most {MAX_NAME_LEN} characters (got {len(value)})")
        return value

    @field_validator("namespace")
    @classmethod
    def _dns1123(cls, value: str) -> str:
        if len(value) > 63 or not DNS1123_LABEL_RE.fullmatch(value):
            raise ValueError("must be a DNS-1123 label of at most 63 characters")
        return value


class NodesConfig(Model):
    """How many nodes (hosts, pods) the job spans; elastic when `min < max`."""

    min: int = Field(
        default=1,
        ge=1,
        le=MAX_NODES,
        description=f"Fewest nodes the job runs on (it keeps running down to this); at most {MAX_NODES}.",
    )
    max: int = Field(
        default=1,
        ge=1,
        le=MAX_NODES,
        description=f"Most nodes; the job starts when `min` are ready and grows to `max`; at most {MAX_NODES}.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> NodesConfig:
        if self.max < self.min:
            raise ValueError(f"max: must be >= spec.nodes.min ({self.min})")
        return self

    @property
    def elastic(self) -> bool:
        return self.min < self.max


class ResourcesConfig(Model):
    """Per-node (per-pod) resources."""

    gpus: int = Field(default=0, ge=0, description="GPUs per node (whole devices).")
    cpu: Quantity = Field(default="2", description="CPU request and limit per node (Kubernetes quantity).")
    memory: Quantity = Field(default="4Gi", description="Memory request and limit per node (Kubernetes quantity).")
    shared_memory: Quantity | None = Field(
        default="1Gi",
        description=(
            "Size of the memory-backed /dev/shm (DataLoader workers and NCCL need more than the default 64Mi). "
            "null: none (the container runtime's own 64Mi /dev/shm)."
        ),
    )
    gpu_resource: str = Field(
        default="nvidia.com/gpu",
        description="Extended resource name of a GPU: `domain/name`, such as `nvidia.com/gpu` or `amd.com/gpu`.",
    )
    ephemeral_storage: Quantity | None = Field(
        default="10Gi",
        description=(
            "Local disk per node requested for the pod's writable emptyDirs (run directory and logs, /tmp, "
            "caches, pod-local checkpoint stores). Requested, not limited: the kubelet evicts a pod over its "
            "limit. null: no request."
        ),
    )

    @field_validator("gpus", mode="before")
    @classmethod
    def _whole_gpus(cls, value: Any) -> Any:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError("must be a whole number of GPUs")
        return value

    @field_validator("gpu_resource")
    @classmethod
    def _extended_resource(cls, value: str) -> str:
        if not _is_qualified_name(value, prefixed=True):
            raise ValueError(
                "must be an extended resource name: a DNS subdomain, '/' and a name of at most 63 characters, "
                "such as nvidia.com/gpu"
            )
        return value


class KubernetesConfig(Model):
    """Kubernetes placement and policy; ignored by the local and Ray backends."""

    target: SubmitTarget = Field(
        default=DEFAULT_TARGET,
        description="What `torchrig submit` creates: a Kubeflow PyTorchJob (v1, elastic) or a Trainer v2 TrainJob.",
    )
    service_account: ObjectName | None = Field(default=None, description="ServiceAccount of the pods.")
    automount_service_account_token: bool = Field(
        default=False,
        description=(
            "Mount the ServiceAccount's API token in the pods; only for a task that calls the Kubernetes API, "
            "and then with a dedicated `serviceAccount`. Off: the pods hold no credentials to the API."
        ),
    )
    queue: str | None = Field(
        default=None, description="Queue: the Volcano queue with `gang: volcano`, else the Kueue LocalQueue."
    )
    priority_class: ObjectName | None = Field(default=None, description="PriorityClass of the pods.")
    gang: Literal["none", "volcano", "kueue"] = Field(
        default="none",
        description="Gang scheduling: `volcano` (PodGroup via the operator), `kueue` (admission by queue) or `none`.",
    )
    node_selector: Labels = Field(default_factory=dict, description="Node selector of the pods (node labels).")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Tolerations of the pods.")
    image_pull_secrets: list[ObjectName] = Field(default_factory=list, description="Names of image pull Secrets.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy of the containers."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Extra environment variables of the workers. Names: letters, digits, `_`, `-` and `.`, no leading "
            f"digit (as Kubernetes takes them); none starting with `{Env.PREFIX}` (torchrig's own, set by the backend) "
            f"but {', '.join(sorted(USER_ENV))}, and none of torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, `PET_*`, ...). "
            "No credentials (`*_TOKEN`, `*SECRET*`, `*_KEY`, a key's value): name a Secret in "
            "`checkpoint.stores[].secretRef`, whose keys become the workers' environment."
        ),
    )
    pod_labels: Labels = Field(default_factory=dict, description="Extra labels on the pods only.")
    pod_annotations: dict[str, str] = Field(default_factory=dict, description="Extra annotations on the pods only.")
    ttl_seconds_after_finished: int | None = Field(
        default=86400,
        ge=0,
        le=MAX_INT32,
        description=(
            f"PyTorchJob and TrainJob: delete the finished job after this many seconds (null: keep); at most "
            f"{MAX_INT32} (int32). A RayJob's is `spec.ray.clusterTtlSeconds`."
        ),
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        gt=0,
        le=MAX_DEADLINE_S,
        description=f"Fail the job after this many seconds; at most {MAX_DEADLINE_S} (ten years).",
    )
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        default="None", description="PyTorchJob: which pods to delete when the job finishes."
    )
    network_policy: bool = Field(
        default=True,
        description=(
            "Render a NetworkPolicy named after the job that admits to its pods only what the job needs: any TCP "
            "port from the job's own pods (rendezvous and recovery stores, gloo/NCCL, Ray), the metrics ports "
            "from Prometheus (pods labelled `app.kubernetes.io/name: prometheus`), and on a RayJob the head's "
            "dashboard from its submitter and the KubeRay operator. false: none (your own policy, or a CNI "
            "that enforces none)."
        ),
    )
    runtime_ref: ObjectName | None = Field(
        default=None,
        description=(
            "TrainJob: name of an existing runtime of kind `runtimeKind` (default: emit a namespaced "
            "TrainingRuntime `torchrig-<name>`, used by this job only)."
        ),
    )
    runtime_kind: Literal["ClusterTrainingRuntime", "TrainingRuntime"] = Field(
        default="ClusterTrainingRuntime",
        description=(
            "TrainJob with `runtimeRef`: its kind, a cluster-wide ClusterTrainingRuntime (Trainer's own, such "
            "as `torch-distributed`) or a TrainingRuntime in the job's namespace."
        ),
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, val in value.items():
            if not _ENV_NAME_RE.fullmatch(name):
                raise _error_at(
                    (name,),
                    "not a variable name Kubernetes takes: letters, digits, '_', '-' and '.', no leading digit",
                    val,
                )
            if name in USER_ENV:
                continue
            if name.startswith(_OPERATOR_ENV_PREFIX):
                raise _error_at(
                    (name,),
                    f"{_OPERATOR_ENV_PREFIX}* are torchrun's arguments, which the Kubeflow operators set on every pod "
                    "(PyTorchJob and TrainJob) and which override the spec's value without a word; the backend sets "
                    "torchrun's arguments from spec.nodes and spec.procsPerNode",
                    val,
                )
            if name.startswith(Env.PREFIX) or name in _LAUNCHER_ENV:
                raise _error_at(
                    (name,),
                    f"{Env.PREFIX}* and the launcher's variables are torchrig's contract with its workers "
                    f"(training.contract.env), set by the backend; the spec may set only {', '.join(sorted(USER_ENV))}",
                    val,
                )
        return value


class RayClusterConfig(Model):
    """The Ray cluster-launcher file of `torchrig render --target raycluster` (`ray up`): instance types and
    the cloud's placement. A null instance type is chosen from `spec.resources` for the cloud
    (`orchestrator.compile.raycluster`)."""

    cloud: Literal["aws", "gcp"] = Field(default="aws", description="Cloud of the cluster file (`--cloud`).")
    region: str | None = Field(
        default=None, description="Region (null: us-west-2 on aws, us-central1 on gcp).", max_length=64
    )
    zone: str | None = Field(default=None, description="gcp: availability zone (null: the region's `-a` zone).")
    project_id: str | None = Field(default=None, description="gcp: the project the VMs are billed to.")
    head_instance_type: str | None = Field(
        default=None,
        description="Head VM type (null: m5.2xlarge on aws, n2-standard-8 on gcp). The head runs no training worker.",
    )
    worker_instance_type: str | None = Field(
        default=None,
        description=(
            "Worker VM type, one per node of the job (null: the smallest default type with `resources.gpus` "
            "GPUs and at least `resources.cpu` CPUs for the cloud)."
        ),
    )
    spot: bool = Field(
        default=True,
        description=(
            "Workers on spot (aws) or preemptible (gcp) VMs, with an on-demand worker type the autoscaler "
            "falls back to when spot capacity is short. Preemptions drain the node (emergency checkpoint)."
        ),
    )
    fallback_instance_type: str | None = Field(
        default=None, description="On-demand fallback worker VM type (null: the worker type, on demand)."
    )
    idle_timeout_minutes: int = Field(
        default=10, ge=1, le=7 * 24 * 60, description="The autoscaler removes a worker idle this long."
    )
    docker: bool = Field(
        default=True,
        description=(
            "Run Ray in the torchrig image (`spec.ray.image`, default `spec.image`) through the launcher's "
            "`docker:`; false: setup commands pin torch, ray and torchrig on the VM image instead."
        ),
    )
    torch_version: str = Field(
        default="2.13.0",
        pattern=r"^[0-9]+(\.[0-9]+){1,2}([a-z0-9.+]*)$",
        description="With `docker: false`: the torch the setup commands install (ray is `spec.ray.rayVersion`).",
    )
    ssh_user: str = Field(default="ubuntu", description="SSH user of the VM image.", max_length=64)
    disk_gb: int = Field(default=200, ge=10, le=65536, description="Boot disk of each VM, GB.")

    @field_validator(
        "region",
        "zone",
        "project_id",
        "head_instance_type",
        "worker_instance_type",
        "fallback_instance_type",
        "ssh_user",
    )
    @classmethod
    def _plain_name(cls, value: str | None) -> str | None:
        # These land in YAML and in shell commands of the launcher: names only.
        if value is not None and not _CLOUD_NAME_RE.fullmatch(value):
            raise ValueError("must be a cloud name: letters, digits, '.', '_' and '-' (at most 64)")
        return value


class RayConfig(Model):
    """Ray placement: a local embedded cluster, or an existing one through the Ray Jobs API."""

    address: str | None = Field(
        default=None,
        description="Ray dashboard address (`http://HOST:8265`) to submit to; null starts a local Ray.",
    )
    runtime_env: dict[str, Any] = Field(default_factory=dict, description="Extra Ray runtime environment.")
    image: str | None = Field(
        default=None,
        description=(
            "RayJob image (default: `spec.image`); needs torchrig with its `ray` extra (the images in "
            "images/ have it) at `rayVersion`."
        ),
    )
    ray_version: str = Field(
        default="2.60.0",
        description=(
            "Ray version of the RayJob image. The RayJob turns on Ray's token authentication (KubeRay "
            "`authOptions: {mode: token}`, KubeRay >= 1.5.1), which needs Ray >= 2.52: the rayjob target "
            "refuses an older version (or one that does not parse) rather than rendering a cluster whose "
            "Jobs API runs anyone's code."
        ),
    )
    cluster_ttl_seconds: int | None = Field(
        default=600,
        ge=0,
        le=MAX_INT32,
        description=(
            "RayJob: delete the RayJob and its Ray cluster this many seconds after the job finished (KubeRay "
            "`ttlSecondsAfterFinished` with `shutdownAfterJobFinishes`); until then the cluster's pods hold "
            "their nodes and GPUs. The default leaves time to read the workers' logs without billing a day of "
            f"GPUs; null keeps the cluster (`shutdownAfterJobFinishes: false`). At most {MAX_INT32} (int32)."
        ),
    )
    head_cpu: Quantity = Field(default="2", description="RayJob head CPU.")
    head_memory: Quantity = Field(default="8Gi", description="RayJob head memory.")
    shared_dir: str | None = Field(
        default=None,
        description=(
            "A directory every node of a remote Ray cluster mounts (NFS, EFS, Filestore), absolute. A run "
            "submitted with `--address` keeps its run directory there (`<sharedDir>/runs/<name>/<submission>`), "
            "so relative `file://` stores and `torchrig report` work; a `file://` store under it is shared "
            "between nodes. Null: a remote run's directory is on the head node (`~/torchrig/runs/...`) and "
            "its stores must be absolute or object stores."
        ),
    )
    cluster: RayClusterConfig = Field(
        default_factory=RayClusterConfig, description="The cluster file of `torchrig render --target raycluster`."
    )

    @field_validator("shared_dir")
    @classmethod
    def _absolute_dir(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("/") or "\0" in value or "/../" in value + "/"):
            raise ValueError("must be an absolute directory (a path every node mounts), without '..'")
        return value.rstrip("/") or "/" if value is not None else None

    @field_validator("image")
    @classmethod
    def _image(cls, value: str | None) -> str | None:
        return value if value is None else _check_image(value)


class JobSpecBody(Model):
    """What to run and how (the `spec` section)."""

    image: str = Field(default=DEFAULT_IMAGE, description="Container image of the workers (Kubernetes, RayJob).")
    task: TaskConfig = Field(description="What to train.")
    training: TrainingConfig = Field(description="The training loop.")
    nodes: NodesConfig = Field(default_factory=NodesConfig, description="Node count; elastic when min < max.")
    procs_per_node: int = Field(
        default=1,
        ge=1,
        le=MAX_PROCS_PER_NODE,
        description=(
            f"Worker processes per node, at most {MAX_PROCS_PER_NODE}; must equal `resources.gpus` when GPUs "
            f"are used. Local rank r exports metrics on `metrics.port` + r: `metrics.port` + procsPerNode - 1 "
            f"must be at most {MAX_PORT}."
        ),
    )
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="Per-node resources.")
    restarts: RestartsConfig = Field(default_factory=RestartsConfig, description="Failure handling.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus and JSON-lines metrics.")
    sdc: SdcConfig = Field(
        default_factory=SdcConfig, description="Silent data corruption: replica agreement checks (DDP)."
    )
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig, description="Kubernetes settings.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray settings.")

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        return _check_image(value)

    @model_validator(mode="after")
    def _cross_section_rules(self) -> JobSpecBody:
        if self.resources.gpus > 0 and self.procs_per_node != self.resources.gpus:
            raise ValueError(
                f"procsPerNode: must equal spec.resources.gpus ({self.resources.gpus}): one process per GPU"
            )
        port = self.metrics.port
        if self.metrics.enabled and port + self.procs_per_node - 1 > MAX_PORT:
            raise ValueError(
                f"procsPerNode: spec.metrics.port ({port}) + procsPerNode - 1 must be <= {MAX_PORT}, as local rank r "
                f"exports metrics on port + r: at most {MAX_PORT - port + 1} processes, or a lower port"
            )
        if self.training.strategy is Strategy.hsdp and self.nodes.min < 2:
            raise ValueError(
                "training.strategy: hsdp shards within a node and replicates across nodes, so it needs "
                "spec.nodes.min >= 2 (use fsdp on one node)"
            )
        profile = self.metrics.profile
        if profile is not None and (outside := sorted(r for r in profile.ranks if r >= self.max_world_size)):
            raise ValueError(
                f"metrics.profile.ranks: {outside} outside the job's {self.max_world_size} ranks "
                f"(0..{self.max_world_size - 1}): such a rank never runs, so it would never profile"
            )
        if profile is not None and profile.start_step > self.training.steps:
            raise ValueError(
                f"metrics.profile.startStep: must be <= spec.training.steps ({self.training.steps}), or nothing "
                "is captured"
            )
        if self.kubernetes.gang == "kueue" and not self.kubernetes.queue:
            raise ValueError("kubernetes.queue: required with gang kueue (the name of the Kueue LocalQueue)")
        if self.kubernetes.automount_service_account_token and not self.kubernetes.service_account:
            raise ValueError(
                "kubernetes.automountServiceAccountToken: needs spec.kubernetes.serviceAccount, a dedicated "
                "account with only the RBAC the task needs (the namespace's default account is never mounted)"
            )
        return self

    @model_validator(mode="after")
    def _store_names(self) -> JobSpecBody:
        """The Kubernetes objects a store names (StoreConfig is the worker's model, with no such rule)."""
        for i, store in enumerate(self.checkpoint.stores):
            for key, name in (("pvc", store.pvc), ("secretRef", store.secret_ref)):
                if name is not None and not _is_subdomain(name):
                    raise _error_at(("checkpoint", "stores", i, key), _OBJECT_NAME_RULE, name)
        return self

    @property
    def max_world_size(self) -> int:
        return self.nodes.max * self.procs_per_node

    @property
    def min_world_size(self) -> int:
        return self.nodes.min * self.procs_per_node


class JobSpec(Model):
    """A TrainingJob document: the one typed description of a distributed training run."""

    api_version: Literal["torchrig/v1"] = Field(default="torchrig/v1", description="Always `torchrig/v1`.")
    kind: Literal["TrainingJob"] = Field(default="TrainingJob", description="Always `TrainingJob`.")
    metadata: Metadata = Field(description="Name, namespace, labels.")
    spec: JobSpecBody = Field(description="The job.")

    @property
    def name(self) -> str:
        return self.metadata.name

    def warnings(self) -> list[str]:
        """Options that are set but have no effect, as `path: message` lines."""
        out: list[str] = []
        s = self.spec
        if s.checkpoint.node_local.enabled and s.checkpoint.node_local.replicate_to_peer and s.nodes.max == 1:
            out.append("spec.checkpoint.nodeLocal.replicateToPeer: has no effect with one node (no peer)")
        lr = s.training.lr_schedule
        if lr.scale_with_world_size == "none" and lr.base_world_size != 1:
            out.append("spec.training.lrSchedule.baseWorldSize: has no effect while scaleWithWorldSize is none")
        if s.kubernetes.gang == "none" and s.kubernetes.queue and s.kubernetes.target == "trainjob":
            out.append("spec.kubernetes.queue: TrainJob uses it as the Kueue queue label only")
        if s.kubernetes.runtime_kind != "ClusterTrainingRuntime" and not s.kubernetes.runtime_ref:
            out.append("spec.kubernetes.runtimeKind: has no effect without runtimeRef")
        out += _shared_credential_warnings(s)
        out += [finding.warning() for finding in inline_secrets(self)]  # only a local run accepts them
        out += _in_memory_warnings(s)
        out += _spare_node_warnings(s)
        out += _hang_detection_warnings(s)
        out += [
            f"spec.checkpoint.stores[{i}].uri: memory:// lives in each worker process and is gone when it exits: "
            "nothing in it outlives the run or a restart (for tests; use file:// or an object store)"
            for i, store in enumerate(s.checkpoint.stores)
            if store.kind.in_process
        ]
        if s.training.precision is Precision.fp16 and s.resources.gpus == 0:
            out.append("spec.training.precision: fp16 on CPU runs slowly and is emulated; prefer bf16 or fp32")
        if s.training.lr_schedule.decay == "constant" and s.training.lr_schedule.min_lr_ratio != 0.0:
            out.append("spec.training.lrSchedule.minLrRatio: has no effect with decay constant")
        return out


def _in_memory_warnings(body: JobSpecBody) -> list[str]:
    """`checkpoint.inMemory.every` serves only FSDP/HSDP recovering in place (`training.inplace.replica`)."""
    if body.checkpoint.in_memory.every is None:
        return []
    field = "spec.checkpoint.inMemory.every"
    if body.training.strategy is Strategy.ddp:
        return [
            f"{field}: has no effect with strategy ddp (every rank holds the whole state; a survivor hands it over)"
        ]
    if not body.restarts.in_place:
        return [f"{field}: has no effect without in-place recovery (restarts.mode restart or restarts.spares 0)"]
    return []


def _spare_node_warnings(body: JobSpecBody) -> list[str]:
    """`restarts.spareNodes` runs standby pods in a fixed-size PyTorchJob only (`compile.pytorchjob`)."""
    r = body.restarts
    if r.spare_nodes == 0:
        return []
    field = "spec.restarts.spareNodes"
    if not r.in_place:
        return [f"{field}: has no effect without in-place recovery (restarts.mode restart or restarts.spares 0)"]
    if not get_target(body.kubernetes.target).standby_nodes or body.nodes.elastic:
        return [
            f"{field}: on Kubernetes standby nodes run in a fixed-size PyTorchJob only (kubernetes.target "
            "pytorchjob, nodes.min == nodes.max; elsewhere a lost node restarts the group); local runs start them"
        ]
    return []


def _hang_detection_warnings(body: JobSpecBody) -> list[str]:
    """`restarts.hangDetection: auto` derives step deadlines below `stepTimeoutSeconds` only (`training.deadlines`)."""
    r = body.restarts
    tuned = sorted(r.model_fields_set & {"hang_multiplier", "hang_floor_seconds", "hang_warmup_steps"})
    if r.hang_detection == "fixed" and tuned:
        names = ", ".join(f"spec.restarts.{to_camel(name)}" for name in tuned)
        return [f"{names}: no effect with spec.restarts.hangDetection fixed (every step has stepTimeoutSeconds)"]
    if r.hang_detection == "auto" and r.hang_floor_seconds >= r.step_timeout_seconds:
        return [
            f"spec.restarts.hangFloorSeconds: {r.hang_floor_seconds:g} is not below stepTimeoutSeconds "
            f"({r.step_timeout_seconds:g}): every step deadline is the fixed timeout; lower it, or set "
            "hangDetection: fixed"
        ]
    return []


def _shared_credential_warnings(body: JobSpecBody) -> list[str]:
    """Two stores of one service with different Secrets: their keys become the same variables (AWS_*).
    Keyed by the service, not the scheme: `gs://` and `gcs://` (`az://`, `abfs://`) read one set."""
    out: list[str] = []
    first: dict[str, tuple[int, str]] = {}
    for i, store in enumerate(body.checkpoint.stores):
        if not store.secret_ref:
            continue
        service = store.kind.service
        seen = first.setdefault(service, (i, store.secret_ref))
        if seen[1] != store.secret_ref:
            out.append(
                f"spec.checkpoint.stores[{i}].secretRef: stores[{seen[0]}] is also {service}:// with another "
                "Secret; both become the pods' environment, so a key both hold takes one value"
            )
    return out
