"""The runtime's view of a job: the sections of a TrainingJob that a worker acts on.

These models are the single source of truth for `spec.task`, `spec.training`, `spec.restarts`,
`spec.checkpoint` (in `training.checkpoint_config`, re-exported here) and `spec.metrics`. The control
plane's `orchestrator.spec.JobSpec` composes them with its own sections (nodes, resources, kubernetes,
ray), so the worker and the orchestrator can never disagree on what a field means, while `training`
stays importable without the orchestrator.

This module imports neither torch nor the orchestrator: it is cheap to import everywhere.
"""

from __future__ import annotations

import os
import re
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from training.checkpoint_config import (
    SUPPORTED_STORE_SCHEMES,
    CheckpointConfig,
    CheckpointEvery,
    IfBusy,
    InitFromConfig,
    InitMode,
    InMemoryConfig,
    NodeLocalConfig,
    ResumePolicy,
    StoreConfig,
)
from training.config_base import MAX_GRACE_S, MAX_TIMEOUT_S, Model

__all__ = [
    "SUPPORTED_STORE_SCHEMES",
    "CheckpointConfig",
    "CheckpointEvery",
    "IfBusy",
    "InMemoryConfig",
    "InitFromConfig",
    "InitMode",
    "LrScheduleConfig",
    "MetricsConfig",
    "Model",
    "NodeLocalConfig",
    "OptimizerConfig",
    "Precision",
    "ProfileConfig",
    "RestartsConfig",
    "ResumePolicy",
    "SdcConfig",
    "StoreConfig",
    "Strategy",
    "TaskConfig",
    "TrainingConfig",
    "WorkerSpec",
    "load_worker_spec",
]

_ENTRYPOINT_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")  # dotted names, no empty part


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
        if not _ENTRYPOINT_RE.fullmatch(value):
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
        le=MAX_TIMEOUT_S,
        description=(
            "Watchdog: a rank that completes no step for this long exits, so the launcher restarts the "
            "group from the last checkpoint (hang detection). Covers the first step too; start-up (process group, "
            "model, opening the stores) has the larger of this and `checkpoint.ioTimeoutSeconds`, and "
            "checkpoint I/O has its own limit, `checkpoint.ioTimeoutSeconds`. With `hangDetection: auto` this is "
            "the cap of the derived step deadline."
        ),
    )
    hang_detection: Literal["auto", "fixed"] = Field(
        default="auto",
        description=(
            "`auto`: each rank derives its step deadline from the intervals between the steps it completed "
            "(hangMultiplier x their p99, at least hangFloorSeconds, at most stepTimeoutSeconds), so a hung "
            "rank is ended in seconds instead of after stepTimeoutSeconds; the first hangWarmupSteps steps, "
            "checkpoint I/O, start-up, recoveries and the final evaluation are not judged by it, and the first "
            "step after any of these has a deadline of its own (torchrig_step_deadline_seconds shows both). "
            "`fixed`: every step has stepTimeoutSeconds."
        ),
    )
    hang_multiplier: float = Field(
        default=10.0,
        ge=2.0,
        le=1000.0,
        description="`hangDetection: auto`: the step deadline is this multiple of the p99 of recent step intervals.",
    )
    hang_floor_seconds: float = Field(
        default=1.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description=(
            "`hangDetection: auto`: the shortest step deadline, whatever the step times (a loaded host, a "
            "garbage collection or a slow collective must not look like a hang). Raise it when a job's steps "
            "vary a lot after warm-up."
        ),
    )
    hang_warmup_steps: int = Field(
        default=20,
        ge=5,
        le=1000,
        description="`hangDetection: auto`: steps each rank completes (per process) before its deadline is derived.",
    )
    preempt_grace_seconds: float = Field(
        default=30.0,
        ge=0,
        le=MAX_GRACE_S,
        description=(
            "Preemption: on SIGTERM (a pod eviction, a spot notice, Ctrl-C) every rank stops at the next step "
            "boundary they agree on, saves a synchronous emergency checkpoint of that step and exits with the "
            "retryable code 202, so the next start loses no step. The save must commit within this many "
            "seconds of the signal (a second signal, or the deadline, ends it at once; a partial save is never "
            "committed). Pods get terminationGracePeriodSeconds and torchrun its shutdown timeout from it. "
            "0 turns preemption handling off (SIGTERM ends the workers at once)."
        ),
    )
    preempt_signal: Literal["SIGUSR2", "SIGHUP", "SIGINT"] | None = Field(
        default=None,
        description=(
            "A second signal that means preemption, besides SIGTERM (e.g. SIGUSR2 from Slurm's `--signal` or a "
            "node-drain hook); torchrun forwards it to the workers. SIGUSR1 is taken by the stack dumps."
        ),
    )
    mode: Literal["auto", "inplace", "restart"] = Field(
        default="auto",
        description=(
            "How the group recovers from a lost rank. `inplace`: the surviving ranks keep their state in memory, "
            "a warm spare takes the dead rank's place and receives the state from a survivor (0 lost steps), "
            "falling back to `restart` when that cannot finish within inPlaceTimeoutSeconds. `restart`: torchrun "
            "restarts every rank from the newest checkpoint. `auto` (the default): `inplace` where it applies, "
            "`restart` elsewhere. In-place applies to jobs of 2+ ranks launched by the local backend, a PyTorchJob "
            "or TrainJob (any number of pods) or the torchrun target: DDP, and FSDP/HSDP with "
            "checkpoint.inMemory.every (it returns to the newest in-memory snapshot of the shards); a rank is "
            "replaced by a spare of its own node, and a whole node lost restarts the group unless a standby pod "
            "takes it (`spareNodes`; docs/operations.md). "
            "`inplace` differs from "
            "`auto` only in the warning it logs when the job cannot recover in place."
        ),
    )
    spares: int = Field(
        default=1,
        ge=0,
        le=64,
        description=(
            "Warm spare processes per node for `mode: inplace`: each has imported torch and built the model and "
            "optimizer, and waits to be assigned a dead rank's place; a used spare is replaced in the background. "
            "0: no spares (every failure takes the restart path)."
        ),
    )
    spare_nodes: int = Field(
        default=0,
        ge=0,
        le=64,
        description=(
            "Standby nodes for `mode: inplace`: on Kubernetes (a fixed-size PyTorchJob) this many more Worker pods "
            "than nodes, in a local run this many more emulated nodes, which stand by outside the rendezvous with "
            "a warm spare per local rank. When a node is "
            "lost (its pod evicted or killed, its machine gone) one of them takes all of that node's ranks in "
            "place: the other pods keep running and their state, 0 steps are lost, and the lost node's recreated "
            "pod stands by in turn. Without one a lost node restarts the group from the checkpoint. Detection "
            "takes 1-3 s (the node's heartbeat). On Kubernetes the PyTorchJob's Master then only hosts the "
            "rendezvous store (a small pod without a GPU), so that any training node can be taken. 0: none."
        ),
    )
    in_place_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description=(
            "In-place recovery: the collective timeout of every process group (the last resort: a failure reaches "
            "every survivor in milliseconds through closed connections), how long a host waits for a spare to be "
            "ready, and half the time a new group may take to form (the spare's assignment, every member joining, "
            "the state transfer); past it the group falls back to a restart from the checkpoint."
        ),
    )

    # The one home of "does this job recover in place" as far as the spec says: the compilers, the local
    # backend, the warnings and the worker (`training.inplace.InPlace.from_spec`) all ask these.
    @property
    def in_place(self) -> bool:
        """In-place recovery is on: not `mode: restart`, and at least one warm spare per node.

        Whether a given launch can (2+ ranks, DDP or in-memory snapshots) the worker decides on top.
        """
        return self.mode != "restart" and self.spares >= 1

    @property
    def standby_nodes(self) -> int:
        """The standby nodes a launch that may stand them by runs: `spareNodes` when in place, else 0."""
        return self.spare_nodes if self.in_place else 0


class ProfileConfig(Model):
    """A `torch.profiler` capture of a few steps: where a step's time goes, on the host and the device."""

    start_step: int = Field(ge=1, description="The first step captured (a step after warm-up: 10 or later).")
    steps: int = Field(default=5, ge=1, le=100, description="How many consecutive steps are captured.")
    ranks: list[int] = Field(
        default_factory=lambda: [0],
        min_length=1,
        description="The ranks that profile (each writes its own trace); ranks outside the world size never do.",
    )


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
    straggler_threshold: float = Field(
        default=1.3,
        gt=1.0,
        description=(
            "A rank whose compute time per step (outside collectives, or before its first gradient "
            "collective) exceeds this multiple of the median rank's over a logEvery window is the straggler "
            "(torchrig_straggler_rank, a `straggler` event, the TorchrigStraggler alert)."
        ),
    )
    profile: ProfileConfig | None = Field(
        default=None,
        description=(
            "Capture `profile.steps` steps from `profile.startStep` with `torch.profiler` (CPU, and CUDA "
            "on GPUs): a Chrome/Perfetto trace and a table of the costliest ops per rank under "
            "`profile/` in the run directory, and a `profile` event. Off by default."
        ),
    )


# `python -m bench --only sdc` on the 2-core machine under load (2026-11-28): one check cost 8.1 ms against a
# 12.9 ms digits step (2 ranks, gloo; the all-gather waits for the other rank to be scheduled), so every 100
# steps is 0.63% of a step; tinygpt's replica fingerprint is 5% of one of its steps, 0.05% at every 100.
DEFAULT_SDC_EVERY = 100
# A recompute check (`training.sdc_recompute`) costs about one more forward and backward of a rank's batch:
# tinygpt's was 105% of one of its steps (bench section `sdc`; digits' 8%, in noise), so every 100 steps costs
# about 1% of a step, under the 5% above which it would be off by default (docs/operations.md).
DEFAULT_SDC_RECOMPUTE_EVERY = 100


class SdcConfig(Model):
    """Silent data corruption: data-parallel replicas compared bit for bit (`training.sdc`)."""

    every: int = Field(
        default=DEFAULT_SDC_EVERY,
        ge=0,
        description=(
            "Steps between replica-agreement checks: each rank hashes its parameters and optimizer state "
            "(a 64-bit fingerprint of the raw bits) and the group compares them; a checkpoint is also "
            "checked before it is saved, and its manifest records `certified`. On a disagreement an `sdc` "
            "event names the suspect ranks; a decided suspect is replaced in place by a warm spare while the "
            "others reload the newest certified checkpoint, else the group restarts from it. DDP, and HSDP "
            "along its replica dimension; FSDP holds no two copies of one shard: off there. 0: off."
        ),
    )
    recompute_every: int = Field(
        default=DEFAULT_SDC_RECOMPUTE_EVERY,
        ge=0,
        description=(
            "Steps between redundant compute spot checks, which find a rank whose local gradient is wrong "
            "before the all-reduce averages it into every replica (the replica check cannot see that): each "
            "rank also computes its right neighbour's gradient from the same samples and seed, and the group "
            "compares their fingerprints; the suspect is named in an `sdc` event (evidence `recompute`) and "
            "the group restarts from the newest certified checkpoint. A check costs about one more forward "
            "and backward of a rank's batch. DDP only. Not seen by either check: corruption inside the "
            "all-reduce itself. 0: off."
        ),
    )


class _Resources(BaseModel):
    """Of `spec.resources`, the worker reads the GPU count only (`training.preflight` checks CUDA)."""

    model_config = ConfigDict(extra="ignore")

    gpus: int = 0


class _SpecBody(BaseModel):
    """The worker ignores the control-plane sections (nodes, kubernetes, ray) and most of resources."""

    model_config = ConfigDict(extra="ignore", alias_generator=to_camel, populate_by_name=True)

    task: TaskConfig
    training: TrainingConfig
    restarts: RestartsConfig = Field(default_factory=RestartsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    sdc: SdcConfig = Field(default_factory=SdcConfig)
    resources: _Resources = Field(default_factory=_Resources)


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
