"""Redundant, verified, asynchronous checkpoints (torch.distributed.checkpoint + fsspec).

`CheckpointManager` is the worker's whole interface: `restore`, `should_save`, `save`, `wait`, `close`;
`manager`'s docstring describes the commit protocol. Its parts: `save` (the save pipeline), `writer`
(its data path: a tee into every store, hashing while writing), `fence`, `retention`, `restore` (the
restore search), `reader` (its data path: each file read once and verified before DCP loads it),
`warmstart` (`initFrom`), `collectives`; the store layout, manifest and verification live in
`manifest`, manifest signing in `signing`, the storage Protocol in `storage`, the safe reader of DCP
metadata in `dcp_metadata`.
"""

from training.checkpoint.manager import CheckpointManager
from training.checkpoint.manifest import (
    CheckpointListing,
    FileEntry,
    Manifest,
    ManifestLayoutError,
    VerifyReport,
    list_checkpoints,
    parse_manifest,
    read_manifest,
    verify_store,
)
from training.checkpoint.results import CheckpointError, RestoreResult, SaveOutcome
from training.checkpoint.retention import steps_to_delete
from training.checkpoint.signing import SignatureError, signing_key_from_env
from training.checkpoint.storage import CheckpointStorage, FsspecStorage, UnsafePathError, open_storage

__all__ = [
    "CheckpointError",
    "CheckpointListing",
    "CheckpointManager",
    "CheckpointStorage",
    "FileEntry",
    "FsspecStorage",
    "Manifest",
    "ManifestLayoutError",
    "RestoreResult",
    "SaveOutcome",
    "SignatureError",
    "UnsafePathError",
    "VerifyReport",
    "list_checkpoints",
    "open_storage",
    "parse_manifest",
    "read_manifest",
    "signing_key_from_env",
    "steps_to_delete",
    "verify_store",
]
