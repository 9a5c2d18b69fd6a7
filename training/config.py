"""The runtime's view of a job: the sections of a TrainingJob that a worker acts on.

These models are the single source of truth for `spec.task`, `spec.training`, `spec.restarts`,
`spec.checkpoint` and `spec.metrics`. The control plane's `orchestrator.spec.JobSpec` composes them
with its own sections (nodes, resources, kubernetes, ray), so the worker and the orchestrator can
never disagree on what a field means, while `training` stays importable without the orchestrator.

This module imports neither torch nor the orchestrator: it is cheap to import everywhere.
"""

from __future__ import annotations

import os
import re
from enum import Enum
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

__all__ = [
    "SUPPORTED_STORE_SCHEMES",
    "CheckpointConfig",
    "CheckpointEvery",
    "IfBusy",
    "LrScheduleConfig",
    "MetricsConfig",
    "NodeLocalConfig",
    "OptimizerConfig",
    "Precision",
    "RestartsConfig",
    "ResumePolicy",
    "StoreConfig",
    "Strategy",
    "TaskConfig",
    "TrainingConfig",
    "WorkerSpec",
    "load_worker_spec",
]

# Object stores go through fsspec; `file` is a local or shared (NFS, PVC) filesystem.
SUPPORTED_STORE_SCHEMES = ("file", "s3", "gs", "gcs", "az", "abfs", "memory")

_ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class Model(BaseModel):
    """Base for every spec model: unknown keys rejected, camelCase in YAML, snake_case in Python."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        validate_default=True,
        use_attribute_docstrings=False,
    )

    def to_yaml_dict(self) -> dict[str, Any]:
        """The model as the YAML a user would write: camelCase keys, no unset optional noise."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Strategy(str, Enum):
    ddp = "ddp"
    fsdp = "fsdp"
    hsdp = "hsdp"


class TaskConfig(Model):
    """What to train: a user's `Task` factory and its arguments."""

    entrypoint: str = Field(
        description=(
            "Import path `module:callable` of a factory returning a `training.Task` "
            "(e.g. `training.examples.digits:task`). It is called with `args` as keyword arguments."
        ),
        examples=["training.examples.digits:task"],
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the task factory (model size, data options).",
    )

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, value: str) -> str:
        if not _ENTRYPOINT_RE.match(value):
            raise ValueError("must be an import path of the form `package.module:callable`")
        return value


class OptimizerConfig(Model):
    """The optimizer; its learning rate is the base rate before warm-up and world-size scaling."""

    name: Literal["adamw", "adam", "sgd"] = Field(default="adamw", description="Optimizer.")
    lr: float = Field(default=1e-3, gt=0, description="Base learning rate (at `lrSchedule.baseWorldSize`).")
    weight_decay: float = Field(default=0.0, ge=0, description="Decoupled (adamw) or L2 weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="Adam betas.")
    momentum: float = Field(default=0.0, ge=0, lt=1, description="SGD momentum.")

    @field_validator("betas")
    @classmethod
    def _betas_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError("each beta must be in [0, 1)")
        return value


class LrScheduleConfig(Model):
    """Warm-up, decay and the world-size scaling rule, re-applied when an elastic restart resizes."""

    warmup_steps: int = Field(default=0, ge=0, description="Linear warm-up from 0 over this many steps.")
    decay: Literal["constant", "cosine", "linear"] = Field(
        default="constant", description="Decay after warm-up, down to `minLrRatio` x the peak rate at the last step."
    )
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="Final rate as a fraction of the peak.")
    scale_with_world_size: Literal["none", "linear", "sqrt"] = Field(
        default="none",
        description=(
            "Scale the rate with the data-parallel world size W: `linear` multiplies it by "
            "W / baseWorldSize, `sqrt` by its square root. Applied again after every elastic resize."
        ),
    )
    base_world_size: int = Field(
        default=1, ge=1, description="World size at which `optimizer.lr` is the intended rate."
    )


class TrainingConfig(Model):
    """The training loop: length, batch, numerics, parallelism and optimisation."""

    steps: int = Field(gt=0, description="Optimizer steps to run in total (across restarts).")
    batch_size: int = Field(
        default=32,
        gt=0,
        description=(
            "Samples per rank per micro-step. The global batch of one optimizer step is "
            "batchSize x gradAccumulation x world size."
        ),
    )
    grad_accumulation: int = Field(default=1, ge=1, description="Micro-steps per optimizer step.")
    precision: Precision = Field(
        default=Precision.fp32,
        description="`fp32`, `bf16` (autocast / FSDP mixed precision) or `fp16` (with a gradient scaler).",
    )
    strategy: Strategy = Field(
        default=Strategy.ddp,
        description=(
            "`ddp` replicates the model; `fsdp` shards it (FSDP2 `fully_shard`, one unit per block); "
            "`hsdp` shards within a node and replicates across nodes (2-D device mesh)."
        ),
    )
    activation_checkpointing: bool = Field(
        default=False, description="Recompute activations of each block in the backward pass."
    )
    grad_clip: float | None = Field(
        default=1.0, gt=0, description="Clip the global gradient norm to this value (null: no clipping)."
    )
    seed: int = Field(default=0, ge=0, description="Seeds model init, dropout and data shuffling.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    lr_schedule: LrScheduleConfig = Field(default_factory=LrScheduleConfig, description="Learning-rate schedule.")
    eval_batch_size: int = Field(default=256, gt=0, description="Batch size of the held-out evaluation.")
    eval_at_end: bool = Field(default=True, description="Evaluate on the task's held-out set when training ends.")
    deterministic: bool = Field(
        default=True,
        description="Use deterministic kernels so that a resumed run matches an uninterrupted one bit for bit.",
    )
    num_workers: int = Field(default=0, ge=0, description="DataLoader worker processes per rank.")

    @model_validator(mode="after")
    def _fp16_needs_scaler_path(self) -> TrainingConfig:
        # FSDP2 with fp16 params has no sharded grad-scaler path in torch; bf16 needs none.
        if self.precision is Precision.fp16 and self.strategy is not Strategy.ddp:
            raise ValueError(
                "precision: fp16 needs a gradient scaler, supported with strategy ddp only; use bf16 with fsdp/hsdp"
            )
        return self


class RestartsConfig(Model):
    """Failure handling: how often the group restarts and when a silent rank counts as hung."""

    max: int = Field(default=3, ge=0, description="Restarts of the worker group before the job fails.")
    step_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        description=(
            "Watchdog: a rank that completes no step for this long exits, so the launcher restarts the "
            "group from the last checkpoint (hang detection). Covers restore and the first step too."
        ),
    )


class StoreConfig(Model):
    """One checkpoint store. Every checkpoint is written to every store."""

    uri: str = Field(
        description=(
            "Where checkpoints go: `file:///abs/path`, `file://./relative` (relative to the run "
            "directory), a bare path, or an fsspec URL such as `s3://bucket/prefix`."
        ),
        examples=["file://./ckpt", "s3://bucket/prefix"],
    )
    name: str | None = Field(
        default=None, description="Short name for logs and metrics (default: derived from the URI)."
    )
    pvc: str | None = Field(
        default=None,
        description="Kubernetes only: PersistentVolumeClaim mounted at the path of this `file://` store.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec storage options, e.g. `{endpoint_url: ...}` for an S3-compatible endpoint.",
    )

    @field_validator("uri")
    @classmethod
    def _supported_scheme(cls, value: str) -> str:
        scheme = urlparse(value).scheme if "://" in value else "file"
        if scheme not in SUPPORTED_STORE_SCHEMES:
            raise ValueError(f"unsupported scheme {scheme!r}; use one of: {', '.join(SUPPORTED_STORE_SCHEMES)}")
        if scheme == "file" and value.startswith("file://") and not value[len("file://") :]:
            raise ValueError("file:// URI needs a path")
        return value

    @model_validator(mode="after")
    def _pvc_only_for_files(self) -> StoreConfig:
        if self.pvc is not None and (self.scheme != "file" or not self.path.startswith("/")):
            raise ValueError("pvc: needs an absolute `file:///...` uri (the mount path)")
        return self

    @property
    def scheme(self) -> str:
        return urlparse(self.uri).scheme if "://" in self.uri else "file"

    @property
    def path(self) -> str:
        """The path part; for `file://./x` this is `./x`, relative to the run directory."""
        if "://" not in self.uri:
            return self.uri
        return self.uri.split("://", 1)[1]

    @property
    def display_name(self) -> str:
        if self.name:
            return self.name
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.uri.split("://")[-1]).strip("_.") or self.scheme

    def resolved_uri(self, run_dir: str | os.PathLike[str] | None) -> str:
        """The URI with a relative file path resolved against the run directory."""
        if self.scheme != "file":
            return self.uri
        path = self.path
        if not path.startswith("/"):
            base = Path(run_dir) if run_dir is not None else Path.cwd()
            path = str((base / path).resolve())
        return "file://" + path


class CheckpointEvery(Model):
    """When to checkpoint: by steps, by wall time, or both (whichever comes first)."""

    steps: int | None = Field(default=None, ge=1, description="Save every this many optimizer steps.")
    seconds: float | None = Field(default=None, gt=0, description="Save when this long has passed since the last save.")

    @model_validator(mode="after")
    def _one_trigger(self) -> CheckpointEvery:
        if self.steps is None and self.seconds is None:
            raise ValueError("set steps, seconds, or both")
        return self


class IfBusy(str, Enum):
    wait = "wait"
    skip = "skip"


class ResumePolicy(str, Enum):
    auto = "auto"
    required = "required"
    never = "never"


class NodeLocalConfig(Model):
    """A fast per-node copy of the newest checkpoint, replicated to a peer node (Gemini, SOSP'23)."""

    enabled: bool = Field(default=False, description="Keep the newest checkpoint in node-local storage too.")
    path: str = Field(default="/dev/shm/torchrig", description="Node-local directory (tmpfs or local disk).")
    replicate_to_peer: bool = Field(
        default=True, description="Also hold a copy of the next node's shards, so losing one node loses no copy."
    )


class CheckpointConfig(Model):
    """Redundant, verified checkpoints. A restart is only as good as the checkpoint it finds."""

    every: CheckpointEvery = Field(default_factory=lambda: CheckpointEvery(steps=100), description="When to save.")
    keep: int = Field(default=3, ge=1, description="Committed checkpoints kept per store (the newest ones).")
    async_: bool = Field(
        default=True,
        alias="async",
        description=(
            "Training blocks only while the state is staged in memory; writing and upload run in the background."
        ),
    )
    if_busy: IfBusy = Field(
        default=IfBusy.wait,
        description="When a save is due while the previous one is still in flight: `wait` for it, or `skip` this one.",
    )
    resume: ResumePolicy = Field(
        default=ResumePolicy.auto,
        description=(
            "`auto`: restore the newest valid checkpoint, start fresh if none; `required`: fail if "
            "none is valid; `never`: always start fresh (existing checkpoints are kept)."
        ),
    )
    stores: list[StoreConfig] = Field(
        default_factory=lambda: [StoreConfig(uri="file://./checkpoints")],
        min_length=1,
        description="Every checkpoint goes to every store; restore falls back from store to store.",
    )
    node_local: NodeLocalConfig = Field(default_factory=NodeLocalConfig, description="Fast local recovery copy.")
    save_final: bool = Field(default=True, description="Save a checkpoint at the last step.")

    @model_validator(mode="after")
    def _unique_store_names(self) -> CheckpointConfig:
        seen: dict[str, str] = {}
        for store in self.stores:
            key = store.display_name
            if key in seen:
                raise ValueError(f"stores: two stores share the name {key!r}; give them distinct `name`s")
            seen[key] = store.uri
        return self


class MetricsConfig(Model):
    """The Prometheus exporter of every worker and the JSON-lines history of rank 0."""

    enabled: bool = Field(default=True, description="Serve Prometheus metrics from every worker.")
    port: int = Field(
        default=9400, ge=1024, le=65000, description="Port of local rank 0; local rank r serves on port + r."
    )
    bind_address: str | None = Field(
        default=None,
        description="Address to bind (default: all interfaces in a pod, 127.0.0.1 for local runs).",
    )
    log_every: int = Field(default=10, ge=1, description="Steps between JSON-lines records and log lines.")
    gpu: bool = Field(default=True, description="Export per-device GPU metrics through NVML when available.")


class _SpecBody(BaseModel):
    """The worker ignores the control-plane sections (nodes, resources, kubernetes, ray)."""

    model_config = ConfigDict(extra="ignore", alias_generator=to_camel, populate_by_name=True)

    task: TaskConfig
    training: TrainingConfig
    restarts: RestartsConfig = Field(default_factory=RestartsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)


class _Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class WorkerSpec(BaseModel):
    """What a worker reads from the job file (the orchestrator validated the rest already)."""

    model_config = ConfigDict(extra="ignore")

    metadata: _Metadata
    spec: _SpecBody

    @property
    def name(self) -> str:
        return self.metadata.name


def load_worker_spec(source: str | os.PathLike[str]) -> WorkerSpec:
    """Load the runtime's view of a job file (YAML or JSON; the spec text itself is accepted too).

    Raises:
        ValueError: with one `path: message` line per problem.
    """
    text = str(source)
    if "\n" not in text and Path(text).exists():
        text = Path(text).read_text()
    data = yaml.safe_load(text)
    try:
        return WorkerSpec.model_validate(data)
    except ValidationError as exc:
        lines = [f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()]
        raise ValueError("\n".join(lines)) from None
