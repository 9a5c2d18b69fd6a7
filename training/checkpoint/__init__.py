"""Redundant, verified, asynchronous checkpoints (torch.distributed.checkpoint + fsspec).

`CheckpointManager` is the worker's whole interface: `restore`, `should_save`, `save`, `wait`, `close`.
The store layout, manifest and verification live in `manifest`, the storage Protocol in `storage`.
"""

from training.checkpoint.manager import (
    CheckpointContext,
    CheckpointError,
    CheckpointManager,
    RestoreResult,
    SaveOutcome,
)
from training.checkpoint.manifest import (
    CheckpointListing,
    FileEntry,
    Manifest,
    VerifyReport,
    list_checkpoints,
    read_manifest,
    verify_store,
)
from training.checkpoint.storage import CheckpointStorage, FsspecStorage, open_storage

__all__ = [
    "CheckpointContext",
    "CheckpointError",
    "CheckpointListing",
    "CheckpointManager",
    "CheckpointStorage",
    "FileEntry",
    "FsspecStorage",
    "Manifest",
    "RestoreResult",
    "SaveOutcome",
    "VerifyReport",
    "list_checkpoints",
    "open_storage",
    "read_manifest",
    "verify_store",
]
