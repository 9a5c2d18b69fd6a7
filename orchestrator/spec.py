"""The job model: one typed description of a distributed PyTorch training run.

A job file is a Kubernetes-style document (`apiVersion: torchrig/v1`, `kind: TrainingJob`). Keys are
camelCase in YAML and snake_case in Python; unknown keys are rejected. The runtime sections (task,
training, restarts, checkpoint, metrics) are the models of `training.config`, shared with the worker.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from orchestrator.naming import DNS1035_RE, DNS1123_LABEL_RE, MAX_NAME_LEN
from training.config import (
    CheckpointConfig,
    MetricsConfig,
    Model,
    Precision,
    RestartsConfig,
    Strategy,
    TaskConfig,
    TrainingConfig,
)

__all__ = [
    "API_VERSION",
    "KIND",
    "JobSpec",
    "JobSpecBody",
    "KubernetesConfig",
    "Metadata",
    "NodesConfig",
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
_LABEL_KEY_RE = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


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


def _check_labels(value: dict[str, str]) -> dict[str, str]:
    for key, val in value.items():
        if len(key.split("/")[-1]) > 63 or not _LABEL_KEY_RE.match(key):
            raise ValueError(f"label key {key!r} is not a valid Kubernetes label key")
        if len(val) > 63 or not _LABEL_VALUE_RE.match(val):
            raise ValueError(f"label value {val!r} (key {key!r}) is not a valid Kubernetes label value")
    return value


Labels = Annotated[dict[str, str], AfterValidator(_check_labels)]


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
    )
    namespace: str = Field(default="default", description="Kubernetes namespace to submit to.")
    labels: Labels = Field(default_factory=dict, description="Labels copied onto every object and pod.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations copied onto every object.")

    @field_validator("name")
    @classmethod
    def _dns1035(cls, value: str) -> str:
        if not DNS1035_RE.match(value):
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
        if len(value) > 63 or not DNS1123_LABEL_RE.match(value):
            raise ValueError("must be a DNS-1123 label of at most 63 characters")
        return value


class NodesConfig(Model):
    """How many nodes (hosts, pods) the job spans; elastic when `min < max`."""

    min: int = Field(default=1, ge=1, description="Fewest nodes the job runs on (it keeps running down to this).")
    max: int = Field(default=1, ge=1, description="Most nodes; the job starts when `min` are ready and grows to `max`.")

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
        description="Size of the memory-backed /dev/shm (DataLoader workers and NCCL need more than the default 64Mi).",
    )
    gpu_resource: str = Field(default="nvidia.com/gpu", description="Extended resource name of a GPU.")
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


class KubernetesConfig(Model):
    """Kubernetes placement and policy; ignored by the local and Ray backends."""

    target: Literal["pytorchjob", "trainjob"] = Field(
        default="pytorchjob",
        description="What `torchrig submit` creates: a Kubeflow PyTorchJob (v1, elastic) or a Trainer v2 TrainJob.",
    )
    service_account: str | None = Field(default=None, description="ServiceAccount of the pods.")
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
    priority_class: str | None = Field(default=None, description="PriorityClass of the pods.")
    gang: Literal["none", "volcano", "kueue"] = Field(
        default="none",
        description="Gang scheduling: `volcano` (PodGroup via the operator), `kueue` (admission by queue) or `none`.",
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node selector of the pods.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Tolerations of the pods.")
    image_pull_secrets: list[str] = Field(default_factory=list, description="Names of image pull Secrets.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy of the containers."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables of the workers.")
    pod_labels: Labels = Field(default_factory=dict, description="Extra labels on the pods only.")
    pod_annotations: dict[str, str] = Field(default_factory=dict, description="Extra annotations on the pods only.")
    ttl_seconds_after_finished: int | None = Field(
        default=86400, ge=0, description="Delete the finished job after this many seconds (null: keep)."
    )
    active_deadline_seconds: int | None = Field(default=None, gt=0, description="Fail the job after this long.")
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        default="None", description="PyTorchJob: which pods to delete when the job finishes."
    )
    runtime_ref: str | None = Field(
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
    head_cpu: Quantity = Field(default="2", description="RayJob head CPU.")
    head_memory: Quantity = Field(default="8Gi", description="RayJob head memory.")


class JobSpecBody(Model):
    """What to run and how (the `spec` section)."""

    image: str = Field(default=DEFAULT_IMAGE, description="Container image of the workers (Kubernetes, RayJob).")
    task: TaskConfig = Field(description="What to train.")
    training: TrainingConfig = Field(description="The training loop.")
    nodes: NodesConfig = Field(default_factory=NodesConfig, description="Node count; elastic when min < max.")
    procs_per_node: int = Field(
        default=1, ge=1, description="Worker processes per node; must equal `resources.gpus` when GPUs are used."
    )
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="Per-node resources.")
    restarts: RestartsConfig = Field(default_factory=RestartsConfig, description="Failure handling.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus and JSON-lines metrics.")
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig, description="Kubernetes settings.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray settings.")

    @model_validator(mode="after")
    def _cross_section_rules(self) -> JobSpecBody:
        if self.resources.gpus > 0 and self.procs_per_node != self.resources.gpus:
            raise ValueError(
                f"procsPerNode: must equal spec.resources.gpus ({self.resources.gpus}): one process per GPU"
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
        out += _in_memory_warnings(s)
        out += _spare_node_warnings(s)
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
    if body.restarts.mode == "restart" or body.restarts.spares == 0:
        return [f"{field}: has no effect without in-place recovery (restarts.mode restart or restarts.spares 0)"]
    return []


def _spare_node_warnings(body: JobSpecBody) -> list[str]:
    """`restarts.spareNodes` runs standby pods in a fixed-size PyTorchJob only (`compile.pytorchjob`)."""
    r = body.restarts
    if r.spare_nodes == 0:
        return []
    field = "spec.restarts.spareNodes"
    if r.mode == "restart" or r.spares == 0:
        return [f"{field}: has no effect without in-place recovery (restarts.mode restart or restarts.spares 0)"]
    if body.kubernetes.target != "pytorchjob" or body.nodes.elastic:
        return [
            f"{field}: on Kubernetes standby nodes run in a fixed-size PyTorchJob only (kubernetes.target "
            "pytorchjob, nodes.min == nodes.max; elsewhere a lost node restarts the group); local runs start them"
        ]
    return []


def _shared_credential_warnings(body: JobSpecBody) -> list[str]:
    """Two stores of one scheme with different Secrets: their keys become the same variables (AWS_*)."""
    out: list[str] = []
    first: dict[str, tuple[int, str]] = {}
    for i, store in enumerate(body.checkpoint.stores):
        if not store.secret_ref:
            continue
        seen = first.setdefault(store.scheme, (i, store.secret_ref))
        if seen[1] != store.secret_ref:
            out.append(
                f"spec.checkpoint.stores[{i}].secretRef: stores[{seen[0]}] is also {store.scheme}:// with another "
                "Secret; both become the pods' environment, so a key both hold takes one value"
            )
    return out
