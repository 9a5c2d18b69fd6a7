"""The on-store layout of checkpoints, the manifest (commit marker) and verification.

Layout of one store::

    <root>/fences/00000002.json                # writer generation 2 took the fence (fence.py)
    <root>/step-00000100/manifest.json         # written LAST: its presence means "committed"
    <root>/step-00000100/gen-0002/.metadata    # DCP metadata (rank 0)
    <root>/step-00000100/gen-0002/__0_0.distcp # DCP shards, one or more per rank

`gen-NNNN` is the writer generation: the fence number the writer took when it started, unique in the
store and growing across restarts and launches, so a stale writer can never clobber the files of a
newer one, even at the same step. (Manifests of version 1 named it after the restart count.)

A manifest is only accepted in the exact shape the writer produces (`check_layout`): every file path is
`gen-<its generation>/.metadata` or `gen-<its generation>/__<rank>_<n>.distcp`, so a manifest from a
hostile store cannot name a path outside its step directory. The manifest carries the job's name
(`job`, what restore and retention filter on) and, for diagnostics, the launch (`run_id`), the
restart count within it (`restart_count`) and the writer's random id (`writer`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from training.checkpoint.digest import DIGEST_ALGORITHMS, valid_part_bytes
from training.checkpoint.signing import SIGNATURE_FIELD, SignatureError, check_signature, sign
from training.checkpoint.storage import CheckpointStorage, UnsafePathError, file_digest, safe_join

__all__ = [
    "DCP_METADATA",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "CheckpointListing",
    "FileEntry",
    "Manifest",
    "ManifestLayoutError",
    "VerifyReport",
    "check_layout",
    "gen_dir",
    "list_checkpoints",
    "parse_gen_dir",
    "parse_manifest",
    "parse_step_dir",
    "read_manifest",
    "step_dir",
    "verify_local",
    "verify_store",
]

MANIFEST_NAME = "manifest.json"
DCP_METADATA = ".metadata"  # DCP's metadata file, written by rank 0 into the generation directory
MANIFEST_VERSION = 4  # 3: digests over parts (`digest_part_bytes`); 4: `digest_algorithm` (digest.py)
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_GEN_RE = re.compile(r"^gen-(\d{4,})$")
# The only file paths a writer puts in a manifest (relative to the step directory).
_FILE_RE = re.compile(r"^gen-(\d{4,})/(?:\.metadata|__(\d{1,9})_\d{1,9}\.distcp)$")
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


class ManifestLayoutError(ValueError):
    """A manifest that is not in the shape the writer produces (a path outside its layout, a bad field)."""


def step_dir(step: int) -> str:
    """Directory name of a step: `step-00000100` (8 digits so names sort like numbers)."""
    return f"step-{step:08d}"


def gen_dir(generation: int) -> str:
    """Directory name of the shards of one writer generation."""
    return f"gen-{generation:04d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a `step-NNNNNNNN` directory name, or None for anything else."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def parse_gen_dir(name: str) -> int | None:
    """The generation of a `gen-NNNN` directory name, or None for anything else."""
    match = _GEN_RE.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the step directory, size, digest, writer.

    `digest` is the file's digest by the manifest's `digest_algorithm` (`digest.py`); manifests before
    version 4 name the field `sha256`.
    """

    path: str
    size: int
    digest: str
    rank: int
    node_rank: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FileEntry:
        fields = dict(raw)
        if "digest" not in fields and "sha256" in fields:  # a manifest before version 4
            fields["digest"] = fields.pop("sha256")
        return cls(**fields)


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint holds. Written last, as the commit marker.

    Attributes:
        step: The optimizer step.
        world_size: Processes that wrote it (restore reshards to another size).
        generation: The writer generation (fence number); the shards live in `gen-<generation>/`.
        job: The job's name: restore and retention only take this job's checkpoints.
        time: Wall-clock commit time.
        torch_version: torch of the writer.
        files: Every file, with its size and digest.
        num_nodes: Nodes that wrote it.
        run_id: The launch's rendezvous id (diagnostics).
        final: The last checkpoint of a finished run.
        version: Manifest format version.
        extra: Free-form additions.
        restart_count: Elastic restart count within the launch (diagnostics).
        writer: The writer's random id (diagnostics; ties a manifest to its fence object).
        digest_part_bytes: The part size of the files' digests (`digest.py`); 0 (manifests before version
            3): each file's digest is its whole SHA-256.
        digest_algorithm: The hash of the files' digests (`digest.py`): `blake3` or `sha256` (every
            manifest before version 4).
        certified: Whether the data-parallel replicas agreed at this step (`training.sdc`: their
            fingerprints were equal when it was staged); None: written without `sdc` (unknown). Signed
            with the rest, so it cannot be forged where manifests are signed.
    """

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
    restart_count: int = 0
    writer: str = ""
    digest_part_bytes: int = 0
    digest_algorithm: str = "sha256"
    certified: bool | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def dcp_dir(self) -> str:
        """The DCP checkpoint directory, relative to the step directory."""
        return gen_dir(self.generation)

    def to_json(self, key: bytes | None = None) -> bytes:
        """The manifest's bytes; signed (`signing.sign`) when a key is given."""
        payload = asdict(self)
        if key is not None:
            payload[SIGNATURE_FIELD] = sign(payload, key)
        return json.dumps(payload, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """Parse a manifest (no layout or signature check: `parse_manifest` does both)."""
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("manifest is not a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Manifest:
        files = [FileEntry.from_dict(f) for f in raw["files"]]
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__ and k != "files"}
        known.setdefault("job", "")  # not written by pre-release versions: the owner is unknown
        return cls(files=files, **known)


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_layout(manifest: Manifest) -> None:
    """Raise ManifestLayoutError unless `manifest` has exactly the shape the writer produces."""
    m = manifest
    if not (_is_int(m.step) and _is_int(m.generation) and _is_int(m.world_size, 1) and _is_int(m.num_nodes, 1)):
        raise ManifestLayoutError("step, generation, world_size and num_nodes must be non-negative integers")
    if not isinstance(m.job, str) or not isinstance(m.run_id, str):
        raise ManifestLayoutError("job and run_id must be strings")
    if not isinstance(m.extra, dict):
        raise ManifestLayoutError("extra must be a JSON object")
    if not valid_part_bytes(m.digest_part_bytes):
        raise ManifestLayoutError("digest_part_bytes must be 0 or a power of two from 64 KiB to 1 GiB")
    if m.certified is not None and not isinstance(m.certified, bool):
        raise ManifestLayoutError("certified must be true, false or absent")
    if m.digest_algorithm not in DIGEST_ALGORITHMS:
        raise ManifestLayoutError(f"digest_algorithm must be one of {', '.join(DIGEST_ALGORITHMS)}")
    seen: set[str] = set()
    metadata = 0
    for f in m.files:
        match = _FILE_RE.match(f.path) if isinstance(f.path, str) else None
        if match is None or int(match.group(1)) != m.generation:
            layout = f"{gen_dir(m.generation)}/<dcp file>"
            raise ManifestLayoutError(f"file path {f.path!r} is outside the layout `{layout}`")
        if f.path in seen:
            raise ManifestLayoutError(f"file {f.path!r} listed twice")
        seen.add(f.path)
        if not (_is_int(f.size) and _is_int(f.rank) and _is_int(f.node_rank) and f.rank < m.world_size):
            raise ManifestLayoutError(f"file {f.path!r}: size, rank and node_rank must be in range")
        if not isinstance(f.digest, str) or not _DIGEST_RE.match(f.digest):
            raise ManifestLayoutError(f"file {f.path!r}: digest is not 64 lowercase hex digits")
        shard_rank = match.group(2)
        if shard_rank is None:
            metadata += 1
        elif int(shard_rank) != f.rank:
            raise ManifestLayoutError(f"file {f.path!r} is recorded as written by rank {f.rank}")
    if metadata != 1:
        raise ManifestLayoutError(f"expected one {DCP_METADATA} file, found {metadata}")


def parse_manifest(data: bytes | str, *, step: int | None = None, key: bytes | None = None) -> Manifest:
    """Parse, authenticate (when `key` is set) and layout-check a manifest read from a store.

    Raises:
        SignatureError: `key` is set and the manifest is unsigned or wrongly signed.
        ValueError: Unreadable, not in the writer's layout (ManifestLayoutError), or of another step.
    """
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: `[[[[...` nested past the parser's depth
        raise ValueError(f"unreadable manifest: {type(exc).__name__}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("unreadable manifest: not a JSON object")
    if key is not None:
        check_signature(raw, key)
    try:
        manifest = Manifest.from_dict(raw)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"unreadable manifest: {exc}") from exc
    check_layout(manifest)
    if step is not None and manifest.step != step:
        raise ValueError(f"manifest says step {manifest.step}, directory says {step}")
    return manifest


def read_manifest(storage: CheckpointStorage, step: int, *, key: bytes | None = None) -> Manifest:
    """Read and check the manifest of a step; raises FileNotFoundError, SignatureError or ValueError."""
    return parse_manifest(storage.read_bytes(f"{step_dir(step)}/{MANIFEST_NAME}"), step=step, key=key)


@dataclass(frozen=True)
class CheckpointListing:
    """One step directory in a store: committed (manifest readable) or not.

    Attributes:
        step: The step.
        manifest: The manifest, None when absent or rejected.
        error: Why the manifest was rejected; None when absent or fine.
        owner: The job the directory belongs to, when known otherwise than from its manifest (retention
            sets it for uncommitted directories, from the fence of their writer generation).
        untrusted: The manifest failed its signature check (a signing key is configured).
        claimed_job: For an untrusted manifest, the job its unverified text names (never trusted for
            anything but saying "these look like this job's checkpoints, signed with another key").
        unreadable: The manifest could not be read (an I/O error such as a timeout): no verdict on it,
            so the step may well be a committed checkpoint.
    """

    step: int
    manifest: Manifest | None
    error: str | None = None
    owner: str | None = None
    untrusted: bool = False
    claimed_job: str | None = None
    unreadable: bool = False

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    @property
    def job(self) -> str | None:
        """The owning job: `owner`, else the manifest's job; None when unknown."""
        if self.owner is not None:
            return self.owner
        if self.manifest is not None and self.manifest.job:
            return self.manifest.job
        return None


def list_checkpoints(storage: CheckpointStorage, *, key: bytes | None = None) -> list[CheckpointListing]:
    """Every step directory of a store, newest first.

    Whatever one manifest holds, it is that step's row (bad, untrusted or unreadable), never an exception.

    Raises:
        OSError: The store cannot be listed (unreachable; a `file` store whose path is not a directory).
    """
    out: list[CheckpointListing] = []
    for name in storage.list_dir(""):
        step = parse_step_dir(name)
        if step is None:
            continue
        try:
            out.append(CheckpointListing(step, read_manifest(storage, step, key=key)))
        except FileNotFoundError:
            out.append(CheckpointListing(step, None))
        except SignatureError as exc:
            out.append(
                CheckpointListing(step, None, error=str(exc), untrusted=True, claimed_job=_claimed_job(storage, step))
            )
        except (NotADirectoryError, IsADirectoryError) as exc:  # a file where the step directory should be
            out.append(CheckpointListing(step, None, error=f"not a checkpoint: {exc}"))
        except OSError as exc:  # the read failed (a timeout, a reset): nothing is known of this manifest
            out.append(CheckpointListing(step, None, error=f"unreadable: {type(exc).__name__}: {exc}", unreadable=True))
        except ValueError as exc:
            out.append(CheckpointListing(step, None, error=str(exc)))
    return sorted(out, key=lambda c: c.step, reverse=True)


def _claimed_job(storage: CheckpointStorage, step: int) -> str | None:
    """The job an unverified manifest names (plain JSON, parsed without its signature check), or None."""
    try:
        return read_manifest(storage, step).job or None
    except (ValueError, OSError):
        return None


@dataclass
class VerifyReport:
    """The result of checking every file of a checkpoint against its manifest."""

    step: int
    ok: bool
    bad: dict[str, str] = field(default_factory=dict)  # file -> "missing" | "size a != b" | "digest mismatch"
    checked_bytes: int = 0

    def summary(self) -> str:
        if self.ok:
            return "ok"
        items = ", ".join(f"{k}: {v}" for k, v in sorted(self.bad.items())[:5])
        more = f" (+{len(self.bad) - 5} more)" if len(self.bad) > 5 else ""
        return f"{len(self.bad)} bad file(s): {items}{more}"


def verify_store(
    storage: CheckpointStorage, manifest: Manifest, *, hashes: bool = True, base: str | None = None
) -> VerifyReport:
    """Check each file of a committed checkpoint in a store (size always; digest unless `hashes=False`).

    A path that would leave the store (`..`, a symlink pointing outside a `file` store) is reported as
    refused and never read. `base` is the step's directory in the store (default `step-N`; "" when the
    store's root is the step directory, as for a node-local copy).
    """
    report = VerifyReport(step=manifest.step, ok=True)
    base = step_dir(manifest.step) if base is None else base
    for entry in manifest.files:
        rel = f"{base}/{entry.path}" if base else entry.path
        try:
            if hashes:
                digest, size = storage.digest(rel, manifest.digest_part_bytes, manifest.digest_algorithm)
            else:
                digest, size = entry.digest, storage.size(rel)
        except UnsafePathError as exc:
            report.bad[entry.path] = f"refused: {exc}"
            continue
        except FileNotFoundError:
            report.bad[entry.path] = "missing"
            continue
        except OSError as exc:
            report.bad[entry.path] = f"unreadable: {exc}"
            continue
        report.checked_bytes += size
        if size != entry.size:
            report.bad[entry.path] = f"size {size} != {entry.size}"
        elif digest != entry.digest:
            report.bad[entry.path] = "digest mismatch"
    report.ok = not report.bad
    return report


def verify_local(directory: str, manifest: Manifest, paths: list[str] | None = None) -> VerifyReport:
    """Check files of a checkpoint held in a local step directory (all files, or only `paths`)."""
    report = VerifyReport(step=manifest.step, ok=True)
    wanted = set(paths) if paths is not None else None
    for entry in manifest.files:
        if wanted is not None and entry.path not in wanted:
            continue
        try:
            local = safe_join(directory, entry.path)
        except UnsafePathError as exc:
            report.bad[entry.path] = f"refused: {exc}"
            continue
        if not os.path.isfile(local):
            report.bad[entry.path] = "missing"
            continue
        if os.path.getsize(local) != entry.size:
            report.bad[entry.path] = f"size {os.path.getsize(local)} != {entry.size}"
            continue
        digest, size = file_digest(local, manifest.digest_part_bytes, manifest.digest_algorithm)
        report.checked_bytes += size
        if digest != entry.digest:
            report.bad[entry.path] = "digest mismatch"
    report.ok = not report.bad
    return report
