"""The `spec.checkpoint` section: stores, when to save, resume policy, node-local copies, warm start.

Part of the runtime's view of a job (`training.config` re-exports every name); imports neither torch
nor the orchestrator.
"""

from __future__ import annotations

import os
import re
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pydantic import Field, field_validator, model_validator

from training.config_base import MAX_TIMEOUT_S, Model
from training.store_kinds import STORE_KINDS, SUPPORTED_STORE_SCHEMES, StoreKind, scheme_of, store_kind

__all__ = [
    "SUPPORTED_STORE_SCHEMES",
    "CheckpointConfig",
    "CheckpointEvery",
    "IfBusy",
    "InMemoryConfig",
    "InitFromConfig",
    "InitMode",
    "NodeLocalConfig",
    "ResumePolicy",
    "StoreConfig",
    "check_store_uri",
    "store_location",
]


def check_store_uri(value: str) -> str:
    """`value` when it is a store URI of a supported scheme; else ValueError naming what to write."""
    if not value.strip():
        raise ValueError("must not be empty; e.g. file://./checkpoints or s3://bucket/prefix")
    kind = store_kind(value)  # ValueError listing the supported schemes
    scheme = kind.scheme
    if kind.filesystem and value.startswith("file://") and not value[len("file://") :]:
        raise ValueError("file:// URI needs a path")
    if "://" not in value and value.startswith("file:"):  # would be a relative folder named `file:`
        raise ValueError(f"{value!r}: write file:///absolute/path, file://./relative or a bare path")
    path = value.split("://", 1)[-1]
    if kind.filesystem and path.startswith("~"):
        raise ValueError(f"{value!r}: `~` is not expanded; write the absolute path")
    if kind.object_store and not urlparse(value).netloc:
        raise ValueError(f"{scheme}:// URI needs a bucket, e.g. {scheme}://bucket/prefix")
    return value


def store_location(uri: str) -> str:
    """Where a store's files go, for telling two stores that are one place apart: the scheme (aliases
    folded), the bucket and the normalised path (`./ckpt`, `ckpt/` and `file://./ckpt` are one)."""
    if "://" not in uri:
        uri = "file://" + uri
    scheme, rest = uri.split("://", 1)
    scheme = scheme.lower()  # RFC 3986 3.1: `S3://b` is `s3://b`, one place
    kind = STORE_KINDS.get(scheme)
    if kind is not None and kind.filesystem:
        return f"{kind.service}://" + os.path.normpath(rest)
    service = kind.service if kind is not None else scheme
    bucket, _, key = rest.partition("/")
    return f"{service}://{bucket}/{os.path.normpath(key or '.')}"


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
        description=(
            "Kubernetes only: PersistentVolumeClaim mounted at the path of this `file://` store (a relative "
            "path under the pod's run directory, where a local run keeps it too). Shared by every pod of a "
            "multi-node job, so it must be ReadWriteMany."
        ),
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "fsspec storage options, e.g. `{endpoint_url: ...}` for an S3-compatible endpoint. No credentials "
            "here for Kubernetes targets: they would land in the spec ConfigMap; use `secretRef`."
        ),
    )
    secret_ref: str | None = Field(
        default=None,
        description=(
            "Kubernetes only: name of a Secret in the job's namespace whose keys become environment variables "
            "of the pods (`envFrom`), e.g. `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`, which s3fs reads."
        ),
    )

    @field_validator("uri")
    @classmethod
    def _supported_scheme(cls, value: str) -> str:
        return check_store_uri(value)

    @model_validator(mode="after")
    def _pvc_only_for_files(self) -> StoreConfig:
        if self.pvc is not None and not self.kind.filesystem:
            raise ValueError("pvc: needs a `file://` uri (the mount path; a relative one is under the run directory)")
        return self

    @property
    def scheme(self) -> str:
        return scheme_of(self.uri)

    @property
    def kind(self) -> StoreKind:
        """What the store's scheme can do (`training.store_kinds`)."""
        return STORE_KINDS[self.scheme]  # the URI validator admits supported schemes only

    @property
    def shared(self) -> bool:
        """It outlives a pod and every pod of the job reaches it: an object store, or a filesystem store
        on a PersistentVolumeClaim (`pvc`). A `file://` store without one is the pod's own filesystem;
        `memory://` lives in one process."""
        return self.kind.shared or (self.kind.filesystem and self.pvc is not None)

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
        if not self.kind.filesystem:
            return self.uri
        path = self.path
        if not path.startswith("/"):
            base = Path(run_dir) if run_dir is not None else Path.cwd()
            path = str((base / path).resolve())
        return "file://" + path


class CheckpointEvery(Model):
    """When to checkpoint: by steps, by wall time, or both (whichever comes first)."""

    steps: int | None = Field(default=None, ge=1, description="Save every this many optimizer steps.")
    seconds: float | None = Field(
        default=None, gt=0, le=MAX_TIMEOUT_S, description="Save when this long has passed since the last save."
    )

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


class InMemoryConfig(Model):
    """In-memory replicas of sharded state, for in-place recovery of FSDP/HSDP jobs (Gemini, SOSP'23)."""

    every: int | None = Field(
        default=None,
        ge=1,
        description=(
            "FSDP/HSDP: every this many steps each rank copies its own shards (model, optimizer, progress) "
            "into host memory and hands a copy to the next rank, so a lost rank's shards survive on its "
            "neighbour and the group recovers in place (`restarts.mode`), losing at most this many steps. "
            "Costs four times a rank's shards in host memory (its own and its neighbour's, two deep) and one "
            "copy plus one exchange per snapshot. Unset: FSDP/HSDP recover by a group restart. DDP needs "
            "none (every rank holds the whole state)."
        ),
    )


class InitMode(str, Enum):
    weights = "weights"
    full = "full"


class InitFromConfig(Model):
    """Warm start from another job's checkpoint; used only while this job has no checkpoint of its own."""

    uri: str = Field(
        description=(
            "Store root that holds the source checkpoint, as in `stores[].uri` (another job's store, or a "
            "prefix of a shared one). Checkpoints of any job there are eligible."
        ),
        examples=["s3://bucket/pretrain", "file:///data/ckpt/base"],
    )
    step: int | None = Field(
        default=None, ge=0, description="Step to start from (default: the newest valid checkpoint in that store)."
    )
    mode: InitMode = Field(
        default=InitMode.weights,
        description=(
            "`weights`: only the model's weights; the optimizer state and the progress start fresh at step 0. "
            "`full`: the whole state (model, optimizer, step, data position), as a resume would."
        ),
    )
    options: dict[str, Any] = Field(default_factory=dict, description="fsspec storage options of that store.")

    @field_validator("uri")
    @classmethod
    def _supported_scheme(cls, value: str) -> str:
        return check_store_uri(value)

    def store(self) -> StoreConfig:
        """The source as a store (name `init`)."""
        return StoreConfig(uri=self.uri, name="init", options=self.options)


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
            "`auto`: restore the newest valid checkpoint; start fresh when the job has none, fail when it "
            "has some but no copy of any loads (never silently back to step 0); `required`: fail if none "
            "is valid; `never`: always start fresh (existing checkpoints are kept)."
        ),
    )
    stores: list[StoreConfig] = Field(
        default_factory=lambda: [StoreConfig(uri="file://./checkpoints")],
        min_length=1,
        description="Every checkpoint goes to every store; restore falls back from store to store.",
    )
    node_local: NodeLocalConfig = Field(default_factory=NodeLocalConfig, description="Fast local recovery copy.")
    in_memory: InMemoryConfig = Field(
        default_factory=InMemoryConfig, description="In-memory replicas of sharded state (in-place recovery)."
    )
    save_final: bool = Field(default=True, description="Save a checkpoint at the last step.")
    io_timeout_seconds: float = Field(
        default=1800.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description=(
            "Watchdog limit while a rank does checkpoint I/O: opening the stores, restore, a save training "
            "waits for (synchronous, the final one, one still in flight) and the last wait at the end. "
            "Takes the place of `restarts.stepTimeoutSeconds` for that time only, so a large restore or "
            "a slow store is not taken for a hang; a rank silent for longer still exits."
        ),
    )
    init_from: InitFromConfig | None = Field(
        default=None,
        description=(
            "Warm start from another job's checkpoint, used only when this job has no checkpoint of its own "
            "(`resume: auto` found none, or `resume: never`). A resume never takes another job's checkpoint."
        ),
    )

    @model_validator(mode="after")
    def _unique_store_names(self) -> CheckpointConfig:
        seen: dict[str, str] = {}
        for store in self.stores:
            key = store.display_name
            if key in seen:
                raise ValueError(f"stores: two stores share the name {key!r}; give them distinct `name`s")
            seen[key] = store.uri
        return self

    @model_validator(mode="after")
    def _distinct_store_locations(self) -> CheckpointConfig:
        # Two stores in one place would race each other's writes (and a user would count two copies
        # where there is one): every store must be somewhere else.
        first: dict[str, int] = {}
        for i, store in enumerate(self.stores):
            j = first.setdefault(store_location(store.uri), i)
            if j != i:
                raise ValueError(
                    f"stores[{i}].uri: {store.uri!r} is the same location as stores[{j}] ({self.stores[j].uri!r}); "
                    "each store must be a separate copy"
                )
        return self

    @model_validator(mode="after")
    def _init_from_needs_fresh_start(self) -> CheckpointConfig:
        if self.init_from is not None and self.resume is ResumePolicy.required:
            raise ValueError(
                "initFrom: `resume: required` fails on the first launch, before initFrom is used; use `resume: auto`"
            )
        return self
