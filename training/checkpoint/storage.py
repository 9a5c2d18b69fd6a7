"""Where checkpoints live: a tiny storage Protocol over fsspec.

Paths are `str`, never `Path`, because a store root may be a remote URI (`s3://bucket/prefix` is not a
filesystem path). Every method takes a path *relative to the store root*, so the manager and the CLI
never join URIs by hand, and every such path is checked before use (`check_relative`): `/`-separated,
no empty, `.` or `..` segment, no backslash, not absolute; on a `file` store the resolved path (symlinks
followed) must also stay below the root. A manifest from a hostile store therefore cannot make a reader
touch anything outside it.

`create_exclusive` is the one compare-and-swap the fence needs: create an object only if it does not
exist. It is atomic on `file` stores (a hard link of a complete temporary file, or `O_EXCL` where the
filesystem has no hard links; POSIX filesystems and NFS v3+), on `s3` (a conditional PUT,
`If-None-Match: *`, which AWS S3, MinIO and moto honor) and on `memory`. On every other fsspec store
(`gs`, `az`/`abfs`, generic HTTP) it is check, then write: `atomic_create` is False there, and the
fence reads its object back and says in a warning that it is best effort. A `file` store on a FUSE
mount without `O_EXCL` semantics (some object-store mounts) is in the same position without knowing it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlparse

from training.checkpoint.digest import digest_of
from training.store_kinds import STORE_KINDS

__all__ = [
    "ATOMIC_CREATE_SCHEMES",
    "CHUNK_BYTES",
    "S3_MIN_PART",
    "S3_PARTS",
    "CheckpointStorage",
    "FsspecStorage",
    "UnsafePathError",
    "check_relative",
    "file_digest",
    "open_storage",
    "safe_join",
]

CHUNK_BYTES = 4 * 1024 * 1024
# The most `read_bytes` takes of one object. A manifest lists every file of a checkpoint with a digest
# per part: ~1 MB for a 1 TB checkpoint of 8,000 ranks; 64 MiB leaves room and bounds a hostile one.
SMALL_OBJECT_MAX_BYTES = 64 * 1024 * 1024
S3_MIN_PART = 5 * 1024 * 1024  # S3's smallest part (but the last) of a multipart upload
S3_PARTS = 8  # parts of one object uploaded at once
# Stores whose `create_exclusive` is one atomic operation (see the module docstring; `StoreKind`).
ATOMIC_CREATE_SCHEMES = tuple(scheme for scheme, kind in STORE_KINDS.items() if kind.atomic_create)


class UnsafePathError(ValueError):
    """A relative path that would leave its root (`..`, absolute, backslash, empty segment, symlink)."""


def check_relative(rel: str) -> str:
    """`rel` when it is a clean relative path below a root ("" is the root itself); else UnsafePathError."""
    if rel == "":
        return rel
    if "\\" in rel or "\x00" in rel:
        raise UnsafePathError(f"{rel!r}: backslash or NUL in a store path")
    if rel.startswith("/"):
        raise UnsafePathError(f"{rel!r}: absolute path")
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            raise UnsafePathError(f"{rel!r}: empty, '.' or '..' path segment")
    return rel


def _inside(root: str, path: str) -> bool:
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def safe_join(root: str, rel: str) -> str:
    """`root/rel` on the local filesystem, refusing any `rel` that resolves (symlinks followed) outside `root`."""
    path = os.path.join(root, *check_relative(rel).split("/")) if rel else root
    if not _inside(root, path):
        raise UnsafePathError(f"{rel!r} resolves outside {root}")
    return path


def file_digest(path: str, part_bytes: int = 0, algorithm: str = "sha256") -> tuple[str, int]:
    """The manifest digest (`digest.py`: the whole file's when `part_bytes` is 0) and size of a local file."""
    with open(path, "rb") as fh:
        return digest_of(iter(lambda: fh.read(CHUNK_BYTES), b""), part_bytes, algorithm)


@runtime_checkable
class CheckpointStorage(Protocol):
    """One checkpoint store. All paths are relative to the store root and use `/`."""

    uri: str
    name: str

    def local_path(self, rel: str = "") -> str | None:
        """The local filesystem path of `rel` when the store is a local directory (read in place), else None."""

    def put_file(self, local_path: str, rel: str) -> None:
        """Upload a local file to `rel` (parents created as needed)."""

    def get_file(self, rel: str, local_path: str) -> None:
        """Download `rel` to a local file."""

    def read_bytes(self, rel: str, max_bytes: int = SMALL_OBJECT_MAX_BYTES) -> bytes:
        """The whole content of a small object (a manifest, a fence); ValueError when it is larger than
        `max_bytes` or, in a `file` store, not a regular file (a FIFO would block the reader forever)."""

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file (fewer at its end); safe to call from several threads at once."""

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Write a small object so that a reader sees either nothing or all of it."""

    def size(self, rel: str) -> int:
        """Size in bytes; raises FileNotFoundError when absent."""

    def exists(self, rel: str) -> bool:
        """Whether `rel` exists (file or directory)."""

    def list_dir(self, rel: str) -> list[str]:
        """Names (not paths) of the direct children of `rel`; empty when it does not exist."""

    def list_files(self, rel: str) -> list[str]:
        """Every file below `rel`, as paths relative to `rel`."""

    def delete_dir(self, rel: str) -> None:
        """Remove `rel` and everything below it."""

    def delete_file(self, rel: str) -> None:
        """Remove one object; nothing when it is absent."""

    def create_exclusive(self, rel: str, data: bytes) -> None:
        """Create a small object only if `rel` does not exist; raises FileExistsError when it does."""

    @property
    def atomic_create(self) -> bool:
        """Whether `create_exclusive` is one atomic operation on this store (else: check, then write)."""

    def digest(self, rel: str, part_bytes: int = 0, algorithm: str = "sha256") -> tuple[str, int]:
        """The manifest digest (`digest.py`; the whole file's when `part_bytes` is 0) and size of a stored
        file, streamed from the store."""


class FsspecStorage:
    """A `CheckpointStorage` on any fsspec filesystem (local, NFS/PVC, s3, gcs, azure, memory).

    Args:
        uri: the store root, e.g. `file:///ckpt`, `/ckpt` or `s3://bucket/prefix`.
        options: fsspec storage options (`endpoint_url`, `key`, `secret`, ...).
        name: short name for logs and metrics.
    """

    def __init__(self, uri: str, options: dict[str, Any] | None = None, name: str | None = None) -> None:
        import fsspec

        self.uri = uri
        self.name = name or uri
        scheme = urlparse(uri).scheme if "://" in uri else "file"
        self.scheme = scheme
        opts = dict(options or {})
        if scheme == "s3":
            # s3fs takes endpoint_url inside client_kwargs; accept it at the top level like users write it.
            endpoint = opts.pop("endpoint_url", None)
            if endpoint is not None:
                opts.setdefault("client_kwargs", {})["endpoint_url"] = endpoint
            # A lost store must fail fast, not retry for minutes while a checkpoint is in flight.
            opts.setdefault("config_kwargs", {}).setdefault("connect_timeout", 5)
            opts["config_kwargs"].setdefault("read_timeout", 30)
            opts["config_kwargs"].setdefault("retries", {"max_attempts": 2})
            # Listings must reflect what another process just wrote.
            opts.setdefault("use_listings_cache", False)
            opts.setdefault("skip_instance_cache", True)
        elif scheme == "file":
            opts.setdefault("auto_mkdir", True)
        self.fs: Any = fsspec.filesystem(scheme, **opts)
        # Object stores: the filesystem's own spelling of the root (`memory` paths start with "/"), the
        # spelling listed paths come back in, so they can be made relative to it.
        local_root = uri.split("://", 1)[1] if "://" in uri else uri
        root = os.path.abspath(local_root) if scheme == "file" else str(self.fs._strip_protocol(uri))
        self.root = root.rstrip("/") or "/"

    def __repr__(self) -> str:
        return f"FsspecStorage({self.uri!r})"

    @property
    def atomic_create(self) -> bool:
        kind = STORE_KINDS.get(self.scheme)
        return kind is not None and kind.atomic_create

    def _full(self, rel: str) -> str:
        """The store path of `rel`; raises UnsafePathError for a path that would leave the root."""
        check_relative(rel)
        if self.scheme == "file":
            return safe_join(self.root, rel)
        return f"{self.root}/{rel}" if rel else self.root

    def local_path(self, rel: str = "") -> str | None:
        """The local filesystem path of `rel` for `file` stores (read in place), else None."""
        return self._full(rel) if self.scheme == "file" else None

    def put_file(self, local_path: str, rel: str) -> None:
        full = self._full(rel)
        if self.scheme == "file":
            os.makedirs(os.path.dirname(full), exist_ok=True)
        if self.scheme == "s3":
            # A multipart upload with parts sized to the object (one round of S3_PARTS parts in flight at
            # once, none below S3's 5 MiB minimum); s3fs retries each part on its own (`retries`).
            size = os.path.getsize(local_path)
            part = max(S3_MIN_PART, -(-size // S3_PARTS))
            self.fs.put_file(local_path, full, chunksize=part, max_concurrency=S3_PARTS)
        else:
            self.fs.put_file(local_path, full)
        if self.scheme == "file":
            # The manifest commits the checkpoint, so the data must be durable before it is written: a
            # power loss must not leave a committed manifest over shards still in the page cache.
            _fsync_path(full)

    def get_file(self, rel: str, local_path: str) -> None:
        os.makedirs(os.path.dirname(local_path) or ".", exist_ok=True)
        self.fs.get_file(self._full(rel), local_path)

    def read_bytes(self, rel: str, max_bytes: int = SMALL_OBJECT_MAX_BYTES) -> bytes:
        # A store's files are untrusted: a 10 GB manifest must not be read into memory whole, and a FIFO
        # or a device under a manifest's name must not block a restore (or `torchrig checkpoints list`).
        full = self._full(rel)
        if self.scheme == "file":
            fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ValueError(f"{rel}: not a regular file")
                if st.st_size > max_bytes:
                    raise ValueError(f"{rel}: {st.st_size} bytes, more than the {max_bytes} such a file may have")
                with os.fdopen(os.dup(fd), "rb") as fh:
                    data = fh.read(max_bytes + 1)
            finally:
                os.close(fd)
        else:
            data = self.fs.cat_file(full, start=0, end=max_bytes + 1)  # one ranged GET, bounded
        assert isinstance(data, bytes)
        if len(data) > max_bytes:
            raise ValueError(f"{rel}: more than the {max_bytes} bytes such a file may have")
        return data

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        full = self._full(rel)
        if self.scheme != "file":
            data = self.fs.cat_file(full, start=start, end=end)  # one ranged GET on object stores
            assert isinstance(data, bytes)
            return data
        fd = os.open(full, os.O_RDONLY)
        try:
            chunks: list[bytes] = []
            pos = start
            while pos < end:  # pread: no shared file position between the threads reading parts
                chunk = os.pread(fd, end - pos, pos)
                if not chunk:
                    break
                chunks.append(chunk)
                pos += len(chunk)
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        finally:
            os.close(fd)

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        full = self._full(rel)
        if self.scheme == "file":
            # Rename is atomic on a POSIX filesystem; a crash leaves only a `.tmp-*` file, never half a manifest.
            tmp = _write_synced_temp(full, data)
            os.replace(tmp, full)
            _fsync_path(os.path.dirname(full))  # the rename itself must survive a power loss
        else:
            # A single PUT of an object is atomic in S3, GCS and Azure Blob.
            self.fs.pipe_file(full, data)

    def create_exclusive(self, rel: str, data: bytes) -> None:
        full = self._full(rel)
        if self.scheme in ("s3", "memory"):
            # s3fs: a conditional PUT (If-None-Match: *), FileExistsError on a precondition failure.
            self.fs.pipe_file(full, data, mode="create")
            return
        if self.scheme != "file":
            # No conditional create known to work here: check, then write (the fence reads it back).
            if self.fs.exists(full):
                raise FileExistsError(full)
            self.fs.pipe_file(full, data)
            return
        tmp = _write_synced_temp(full, data)
        try:
            # A hard link appears complete or not at all, and fails if the name exists.
            os.link(tmp, full)
        except FileExistsError:
            raise
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            # No hard links here (some FUSE mounts): O_EXCL is still atomic, the content follows.
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            os.unlink(tmp)
        _fsync_path(os.path.dirname(full))

    def delete_file(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._full(rel))

    def size(self, rel: str) -> int:
        info = self.fs.info(self._full(rel))
        return int(info["size"])

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._full(rel)))

    def list_dir(self, rel: str) -> list[str]:
        full = self._full(rel)
        if self.scheme == "file" and os.path.lexists(full) and not os.path.isdir(full):
            # fsspec lists a file as itself, which reads as an empty directory. A store whose path is now
            # a file (or a dead link where a volume was) is unknown, not empty: only an absent path is.
            raise NotADirectoryError(f"{full}: not a directory")
        try:
            entries = self.fs.ls(full, detail=False)
        except FileNotFoundError:
            return []
        prefix = full.rstrip("/") + "/"
        # Some filesystems list a directory itself among its children: keep only what lies below it.
        return sorted(
            {str(e).rstrip("/")[len(prefix) :].split("/")[0] for e in entries if str(e).startswith(prefix)} - {""}
        )

    def list_files(self, rel: str) -> list[str]:
        full = self._full(rel)
        try:
            found = self.fs.find(full)
        except FileNotFoundError:
            return []
        prefix = full.rstrip("/") + "/"
        # s3fs returns paths without the scheme; local returns absolute paths: strip the root either way.
        return sorted(str(p)[len(prefix) :] for p in found if str(p).startswith(prefix))

    def delete_dir(self, rel: str) -> None:
        full = self._full(rel)
        if self.fs.exists(full):
            self.fs.rm(full, recursive=True)

    def digest(self, rel: str, part_bytes: int = 0, algorithm: str = "sha256") -> tuple[str, int]:
        with self.fs.open(self._full(rel), "rb", block_size=CHUNK_BYTES) as fh:
            return digest_of(iter(lambda: fh.read(CHUNK_BYTES), b""), part_bytes, algorithm)


def open_storage(uri: str, options: dict[str, Any] | None = None, name: str | None = None) -> FsspecStorage:
    """Open a store by URI (a bare path is a local directory): the one place stores are constructed."""
    return FsspecStorage(uri, options, name)


def _write_synced_temp(full: str, data: bytes) -> str:
    """Write `data` to a fresh temporary file next to `full`, fsynced; returns its path (to rename or link)."""
    os.makedirs(os.path.dirname(full), exist_ok=True)
    tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return tmp


def _fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
