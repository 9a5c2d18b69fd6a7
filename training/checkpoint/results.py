"""What the checkpoint manager hands back: its error, a restore's origin and a save's outcome."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointKeyError",
    "CheckpointMismatchError",
    "CheckpointStoreUnavailableError",
    "RestoreResult",
    "SaveOutcome",
]


class CheckpointError(Exception):
    """No valid checkpoint where one was required, or a checkpoint could not be loaded."""


class CheckpointKeyError(CheckpointError):
    """This job's checkpoints are there but signed with another key than `TORCHRIG_CHECKPOINT_KEY`: a
    setting to fix (the worker exits `ExitCode.ENVIRONMENT`, permanent), not a failure a restart cures."""


class CheckpointCorruptError(CheckpointError):
    """Every copy of every checkpoint this job committed failed its integrity check (a missing file, a
    wrong size or digest) in stores that all answered: no restart brings them back, so the worker exits
    `ExitCode.ENVIRONMENT` (permanent) instead of spending the job's restarts on the same verdict."""


class CheckpointMismatchError(CheckpointError):
    """This job's checkpoints load nowhere because their keys or shapes are not the model's: the model or
    its task arguments changed under the same job. The worker exits `ExitCode.TASK_INVALID` (permanent)."""


class CheckpointStoreUnavailableError(CheckpointError):
    """No store that answered holds a checkpoint of this job, and a store did not answer (its listing
    failed, or it is no longer a directory) within the retries of `checkpoint.ioTimeoutSeconds`: it may
    hold the job's checkpoints, so starting over from step 0 could drop all their progress. The worker
    exits `ExitCode.STORE_UNAVAILABLE` (retryable): a later start may find the store back."""

    def __init__(self, message: str, stores: dict[str, str]) -> None:
        super().__init__(message)
        self.stores = dict(stores)  # store name -> why it could not be read


@dataclass(frozen=True)
class RestoreResult:
    """Where the restored state came from."""

    step: int
    store: str  # store name, or "node-local"
    uri: str  # the checkpoint's location (store URI + step directory, or the local directory)
    world_size: int  # world size that wrote the checkpoint
    seconds: float
    source: str  # "store" | "node-local" | "init" (a `checkpoint.initFrom` warm start)
    extra: dict[str, Any] = field(default_factory=dict)  # the manifest's `extra` (untrusted: validate before use)
    certified: bool | None = None  # the manifest's `certified` (`training.sdc`)


@dataclass
class SaveOutcome:
    """The result of one save, the same on every rank once committed (see `CheckpointManager.history`)."""

    step: int
    blocked_s: float
    save_s: float = 0.0
    bytes: int = 0
    committed: bool = False
    stores_ok: list[str] = field(default_factory=list)
    stores_failed: dict[str, str] = field(default_factory=dict)  # store name -> error
