"""The on-store layout of checkpoints, the manifest (commit marker) and verification.

Layout of one store::

    <root>/fence.json                          # the current writer (fencing token), see manager.py
    <root>/step-00000100/manifest.json         # written LAST: its presence means "committed"
    <root>/step-00000100/gen-0002/.metadata    # DCP metadata (rank 0)
    <root>/step-00000100/gen-0002/__0_0.distcp # DCP shards, one or more per rank

Shards live under a generation-specific directory so a stale writer of an older restart generation
can never clobber the files of a newer one, even at the same step.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from training.checkpoint.storage import CheckpointStorage, sha256_file

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "CheckpointListing",
    "FileEntry",
    "Manifest",
    "VerifyReport",
    "gen_dir",
    "list_checkpoints",
    "parse_step_dir",
    "read_manifest",
    "step_dir",
    "verify_local",
    "verify_store",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d{8,})$")


def step_dir(step: int) -> str:
    """Directory name of a step: `step-00000100` (8 digits so names sort like numbers)."""
    return f"step-{step:08d}"


def gen_dir(generation: int) -> str:
    """Directory name of the shards of one restart generation."""
    return f"gen-{generation:04d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a `step-NNNNNNNN` directory name, or None for anything else."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the step directory, size, sha256, writer."""

    path: str
    size: int
    sha256: str
    rank: int
    node_rank: int


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint holds. Written last, as the commit marker."""

    step: int
    world_size: int
    generation: int
    job: str
    time: float
    torch_version: str
    files: list[FileEntry]
    num_nodes: int = 1
    run_id: str = ""
    final: bool = False
    version: int = MANIFEST_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def dcp_dir(self) -> str:
        """The DCP checkpoint directory, relative to the step directory."""
        return gen_dir(self.generation)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("manifest is not a JSON object")
        files = [FileEntry(**f) for f in raw.pop("files")]
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(files=files, **known)


def read_manifest(storage: CheckpointStorage, step: int) -> Manifest:
    """Read and parse the manifest of a step; raises FileNotFoundError or ValueError."""
    data = storage.read_bytes(f"{step_dir(step)}/{MANIFEST_NAME}")
    try:
        manifest = Manifest.from_json(data)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"unreadable manifest: {exc}") from exc
    if manifest.step != step:
        raise ValueError(f"manifest says step {manifest.step}, directory says {step}")
    return manifest


@dataclass(frozen=True)
class CheckpointListing:
    """One step directory in a store: committed (manifest readable) or not."""

    step: int
    manifest: Manifest | None
    error: str | None = None  # why the manifest could not be read; None when absent or fine

    @property
    def committed(self) -> bool:
        return self.manifest is not None


def list_checkpoints(storage: CheckpointStorage) -> list[CheckpointListing]:
    """Every step directory of a store, newest first (raises if the store cannot be listed)."""
    out: list[CheckpointListing] = []
    for name in storage.list_dir(""):
        step = parse_step_dir(name)
        if step is None:
            continue
        try:
            out.append(CheckpointListing(step, read_manifest(storage, step)))
        except FileNotFoundError:
            out.append(CheckpointListing(step, None))
        except (ValueError, OSError) as exc:
            out.append(CheckpointListing(step, None, error=str(exc)))
    return sorted(out, key=lambda c: c.step, reverse=True)


@dataclass
class VerifyReport:
    """The result of checking every file of a checkpoint against its manifest."""

    step: int
    ok: bool
    bad: dict[str, str] = field(default_factory=dict)  # file -> "missing" | "size a != b" | "sha256 mismatch"
    checked_bytes: int = 0

    def summary(self) -> str:
        if self.ok:
            return "ok"
        items = ", ".join(f"{k}: {v}" for k, v in sorted(self.bad.items())[:5])
        more = f" (+{len(self.bad) - 5} more)" if len(self.bad) > 5 else ""
        return f"{len(self.bad)} bad file(s): {items}{more}"


def verify_store(storage: CheckpointStorage, manifest: Manifest, *, hashes: bool = True) -> VerifyReport:
    """Check each file of a committed checkpoint in a store (size always; sha256 unless `hashes=False`)."""
    report = VerifyReport(step=manifest.step, ok=True)
    base = step_dir(manifest.step)
    for entry in manifest.files:
        rel = f"{base}/{entry.path}"
        try:
            if hashes:
                digest, size = storage.sha256(rel)
            else:
                digest, size = entry.sha256, storage.size(rel)
        except FileNotFoundError:
            report.bad[entry.path] = "missing"
            continue
        except OSError as exc:
            report.bad[entry.path] = f"unreadable: {exc}"
            continue
        report.checked_bytes += size
        if size != entry.size:
            report.bad[entry.path] = f"size {size} != {entry.size}"
        elif digest != entry.sha256:
            report.bad[entry.path] = "sha256 mismatch"
    report.ok = not report.bad
    return report


def verify_local(directory: str, manifest: Manifest, paths: list[str] | None = None) -> VerifyReport:
    """Check files of a checkpoint held in a local step directory (all files, or only `paths`)."""
    report = VerifyReport(step=manifest.step, ok=True)
    wanted = set(paths) if paths is not None else None
    for entry in manifest.files:
        if wanted is not None and entry.path not in wanted:
            continue
        local = os.path.join(directory, entry.path)
        if not os.path.isfile(local):
            report.bad[entry.path] = "missing"
            continue
        if os.path.getsize(local) != entry.size:
            report.bad[entry.path] = f"size {os.path.getsize(local)} != {entry.size}"
            continue
        digest, size = sha256_file(local)
        report.checked_bytes += size
        if digest != entry.sha256:
            report.bad[entry.path] = "sha256 mismatch"
    report.ok = not report.bad
    return report
