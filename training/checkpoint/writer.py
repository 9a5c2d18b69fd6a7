"""The write path of a save: DCP's own `FileSystemWriter` over a filesystem that writes each byte once per target.

`dcp.save` plans, serialises and names the files exactly as it always does; only its `FileSystemBase` is
replaced (`TeeFileSystem`), so the bytes go from the staged CPU copy straight into every local target
directory, hashed (sha256) in the same pass over memory:

- a *target* is a local directory that gets its own copy: each file store, the node-local copy, and,
  only when an object store has no local file to upload from, a staging directory;
- a file store on the same filesystem as a target that supports reflinks (btrfs, XFS) gets a reflink of
  the target's finished files instead (`clone_into`): copy-on-write, so damage to one never shows in the
  other, and no second write. Hard links are deliberately not used: two stores hard-linked are one copy
  under two names, and a byte flipped in one would be flipped in both (docs/architecture.md);
- each `write` of DCP's serialiser goes to every target's file descriptor in turn (the page cache), while
  a helper thread hashes the same memory; `os.write`, `os.fsync` and hashlib's update on large buffers
  release the GIL, so the training loop's thread is not starved by, and does not starve, this work. On
  close, the targets' files are fsynced in parallel;
- a target that fails (a full disk, an I/O error) is dropped with its error; the others go on
  (`fail`), so one store failing never fails the others. With every target of a rank failed, the save
  still runs to its end (the bytes are hashed and dropped), so that DCP's collectives complete on every
  rank and each store's failure is reported as that store's, never as a hang or a crash.

The digests and sizes of the files written (`digests`, keyed by the path relative to the step directory)
become the manifest's entries: no file is read back to be hashed.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import mmap
import os
import shutil
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter

from training.checkpoint.manifest import DCP_METADATA

__all__ = [
    "Target",
    "TeeFileSystem",
    "TeeWriter",
    "VerifiedReader",
    "VerifyError",
    "can_reflink",
    "clone_into",
    "device_of",
]

log = logging.getLogger(__name__)

HASH_CHUNK = 8 * 1024 * 1024  # a large write is written and hashed in chunks of this size, in parallel
_SMALL = 64 * 1024  # writes below this are gathered in a buffer (torch.save writes ~40 tiny records per tensor)


@dataclass
class Target:
    """One local directory that gets a physical copy of every file (the step directory of a store, say)."""

    root: str
    stores: list[int] = field(default_factory=list)  # the store indexes this copy is for (-1: none)
    error: str | None = None


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


class _TeeStream(io.RawIOBase):
    """One file being written: the same bytes to every live target's descriptor, hashed once."""

    def __init__(self, fs: TeeFileSystem, rel: str) -> None:
        super().__init__()
        self._fs = fs
        self._rel = rel
        self._digest = hashlib.sha256()
        self._size = 0
        self._buffer = bytearray()
        self._fds: dict[int, int] = {}  # target index -> fd
        for i, target in fs.live_targets():
            try:
                path = os.path.join(target.root, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self._fds[i] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            except OSError as exc:
                fs.fail(i, f"open {rel}: {exc}")

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    def fileno(self) -> int:
        # DCP fsyncs through this only when `sync_files` is on; the tee fsyncs every target on close instead.
        raise io.UnsupportedOperation("fileno")

    def _to_targets(self, data: memoryview) -> None:
        fds = list(self._fds.items())
        # A large chunk goes to the second and later targets on threads of their own (os.write releases
        # the GIL: two stores on one disk are written at once, not one after the other), the first one
        # here. Every copy is awaited before the caller may reuse its buffer, so each descriptor still
        # gets its chunks in order.
        threaded = len(fds) > 1 and data.nbytes >= _SMALL
        pending = {i: self._fs.writers.submit(_write_all, fd, data) for i, fd in fds[1:]} if threaded else {}
        errors: dict[int, str] = {}
        for i, fd in fds:
            try:
                pending[i].result() if i in pending else _write_all(fd, data)
            except OSError as exc:
                errors[i] = str(exc)
        for i, why in errors.items():
            self._drop(i, f"write {self._rel}: {why}")

    def _drop(self, i: int, error: str) -> None:
        fd = self._fds.pop(i)
        with suppress(OSError):
            os.close(fd)
        self._fs.fail(i, error)

    def _flush_buffer(self) -> None:
        if self._buffer:
            data = memoryview(bytes(self._buffer))
            self._buffer.clear()
            self._digest.update(data)
            self._to_targets(data)

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        n = data.nbytes
        self._size += n
        if n < _SMALL:
            self._buffer += data
            if len(self._buffer) >= _SMALL:
                self._flush_buffer()
            return n
        self._flush_buffer()
        # Hash chunk k on the helper thread while chunk k is written; both release the GIL. The caller may
        # reuse its buffer once this returns, so every hash of this call is awaited before returning.
        pending: list[Future[None]] = []
        for off in range(0, n, HASH_CHUNK):
            chunk = data[off : off + HASH_CHUNK]
            pending.append(self._fs.hasher.submit(self._digest.update, chunk))
            self._to_targets(chunk)
        for fut in pending:
            fut.result()
        return n

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._flush_buffer()
            # Durable before the manifest can name it: fsync every target's copy, in parallel.
            futures = {i: self._fs.syncer.submit(os.fsync, fd) for i, fd in self._fds.items()}
            for i, fut in futures.items():
                try:
                    fut.result()
                except OSError as exc:
                    self._drop(i, f"fsync {self._rel}: {exc}")
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._fs.record(self._rel, self._digest.hexdigest(), self._size)
        finally:
            for fd in self._fds.values():
                os.close(fd)
            super().close()


class TeeFileSystem(FileSystemBase):
    """DCP's filesystem interface over several local directories at once (see the module docstring).

    Paths handed to DCP are relative to the targets' roots (`gen-G/...`), so one path names the file in
    every target.

    Args:
        targets: the directories that each get a physical copy.
    """

    def __init__(self, targets: list[Target]) -> None:
        self.targets = targets
        self.digests: dict[str, tuple[str, int]] = {}
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrig-hash")
        self.syncer = ThreadPoolExecutor(max_workers=max(1, len(targets)), thread_name_prefix="torchrig-sync")
        self.writers = ThreadPoolExecutor(max_workers=max(1, len(targets) - 1), thread_name_prefix="torchrig-write")

    def shutdown(self) -> None:
        self.hasher.shutdown(wait=True)
        self.syncer.shutdown(wait=True)
        self.writers.shutdown(wait=True)

    def live_targets(self) -> list[tuple[int, Target]]:
        return [(i, t) for i, t in enumerate(self.targets) if t.error is None]

    def fail(self, i: int, error: str) -> None:
        if self.targets[i].error is None:
            self.targets[i].error = error
            log.warning("checkpoint target %s failed: %s", self.targets[i].root, error)

    def record(self, rel: str, digest: str, size: int) -> None:
        self.digests[rel] = (digest, size)

    def _each(self, what: str, op: Callable[[str], None], rel: str) -> None:
        for i, target in self.live_targets():
            try:
                op(os.path.join(target.root, rel))
            except OSError as exc:
                self.fail(i, f"{what} {rel}: {exc}")

    # -- FileSystemBase ------------------------------------------------------------------------------------
    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            raise io.UnsupportedOperation(f"{path}: the checkpoint tee only writes")
        stream = _TeeStream(self, str(path))
        try:
            yield cast(io.IOBase, stream)
        finally:
            stream.close()

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{path}/{suffix}" if str(path) else suffix

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        src, dst = str(path), str(new_path)
        for i, target in self.live_targets():
            try:
                os.replace(os.path.join(target.root, src), os.path.join(target.root, dst))
            except OSError as exc:
                self.fail(i, f"rename {src}: {exc}")
        if src in self.digests:
            self.digests[dst] = self.digests.pop(src)

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        self._each("mkdir", lambda p: os.makedirs(p, exist_ok=True), str(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never picked by DCP on its own: only handed in as a writer's filesystem

    def exists(self, path: str | os.PathLike[str]) -> bool:
        live = self.live_targets()
        return bool(live) and os.path.exists(os.path.join(live[0][1].root, str(path)))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        for _, target in self.live_targets():
            with suppress(FileNotFoundError):
                os.unlink(os.path.join(target.root, str(path)))

    def sync_dirs(self, rels: list[str]) -> None:
        """fsync the directories holding `rels` in every live target (the new names must survive a crash)."""
        dirs = {os.path.dirname(r) for r in rels}
        for i, target in self.live_targets():
            try:
                for d in sorted(dirs):
                    _fsync_dir(os.path.join(target.root, d) if d else target.root)
            except OSError as exc:
                self.fail(i, f"fsync directory: {exc}")


class TeeWriter(FileSystemWriter):
    """DCP's `FileSystemWriter` writing through a `TeeFileSystem` (one file per rank, as DCP's default).

    Args:
        fs: where the files go.
        path: the directory of this checkpoint, relative to the targets' roots (`gen-G`).
    """

    def __init__(self, fs: TeeFileSystem, path: str) -> None:
        # The tee fsyncs on close itself (every target in parallel): DCP's own fsync is off.
        super().__init__(path, sync_files=False)
        self.fs = cast(Any, fs)  # DCP types the attribute as its own FileSystem; it uses the FileSystemBase API
        self.path = cast(Path, path)  # DCP only passes it back to `fs`, which takes a str


_FICLONE = 0x40049409  # linux/fs.h: share the extents of another file, copy-on-write


def _reflink(src: str, dst: str) -> None:
    import fcntl

    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
        os.fsync(fout.fileno())


def can_reflink(src_dir: str, dst_dir: str) -> bool:
    """Whether a file in `src_dir` can be reflinked into `dst_dir` (btrfs, XFS with reflink, bcachefs...)."""
    probe = f".reflink-probe-{os.getpid()}"
    src, dst = os.path.join(src_dir, probe), os.path.join(dst_dir, probe)
    try:
        with open(src, "wb") as fh:
            fh.write(b"x")
        _reflink(src, dst)
        return True
    except OSError:
        return False
    finally:
        for p in (src, dst):
            with suppress(OSError):
                os.unlink(p)


def clone_into(source_root: str, dest_root: str, rels: list[str]) -> None:
    """Reflink the files `rels` of `source_root` into `dest_root`: a copy that shares the source's blocks
    until either is written (so damage to one never shows in the other), made without writing the data
    again. Copies the bytes where the filesystem refuses."""
    for rel in rels:
        src = os.path.join(source_root, rel)
        dst = os.path.join(dest_root, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            _reflink(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
            with open(dst, "rb") as fh:
                os.fsync(fh.fileno())
    for d in sorted({os.path.dirname(r) for r in rels}):
        _fsync_dir(os.path.join(dest_root, d) if d else dest_root)


def device_of(path: str) -> int | None:
    """The device id of the filesystem `path` is (or would be created) on; None when nothing is reachable."""
    p = os.path.abspath(path)
    while True:
        try:
            return os.stat(p).st_dev
        except FileNotFoundError:
            parent = os.path.dirname(p)
            if parent == p:
                return None
            p = parent
        except OSError:
            return None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the read path ------------------------------------------------------------------------------------------


class VerifyError(OSError):
    """A file read for a restore is missing, of the wrong size, or does not match its manifest digest."""


class _ViewStream(io.RawIOBase):
    """A seekable reader over a buffer (a file's read-only mapping, or bytes): no copy until read."""

    def __init__(self, buf: Any) -> None:
        super().__init__()
        self._view = memoryview(buf)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._view.release()
        super().close()


class _MemoryFS(FileSystemBase):
    """DCP's filesystem interface over files already read (and verified): bytes, or read-only mappings."""

    def __init__(self) -> None:
        self.files: dict[str, Any] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        stream = _ViewStream(self.files[str(path)])
        try:
            yield cast(io.IOBase, stream)
        finally:
            stream.close()

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{path}/{suffix}" if str(path) else suffix

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        raise io.UnsupportedOperation("rename")

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        raise io.UnsupportedOperation("mkdir")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return str(path) in self.files

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        raise io.UnsupportedOperation("rm_file")


ReadRange = Callable[[str, int, int], bytes]  # (path below the step directory, start, end) -> the bytes
LocalPath = Callable[[str], "str | None"]  # path below the step directory -> a local file to map, or None


class VerifiedReader(FileSystemReader):
    """DCP's `FileSystemReader` that reads each file it needs once, in parallel parts, hashing while reading.

    A file is checked against its manifest entry (size and sha256) before any of it is handed to DCP, and
    every file this rank needs is read and checked before the first tensor is loaded: a corrupt copy
    raises `VerifyError` (DCP passes it to every rank) and leaves this rank's state untouched.

    Args:
        read_range: reads bytes [start, end) of a file of the step directory (a local file or an object).
        dcp_dir: the checkpoint's directory below the step directory (`gen-G`).
        expected: path below the step directory -> (sha256, size), from the manifest.
        part_bytes: the size of the parts read in parallel.
        threads: how many parts are read at once.
    """

    def __init__(
        self,
        read_range: ReadRange,
        dcp_dir: str,
        expected: dict[str, tuple[str, int]],
        *,
        local_path: LocalPath | None = None,
        part_bytes: int = 16 * 1024 * 1024,
        threads: int = 8,
    ) -> None:
        super().__init__(dcp_dir)
        self._read_range = read_range
        self._local_path = local_path
        self._maps: list[mmap.mmap] = []
        self._expected = expected
        self._part = part_bytes
        self._threads = threads
        self._mem = _MemoryFS()
        self.fs = cast(Any, self._mem)
        self.path = cast(Path, dcp_dir)
        self.bytes_read = 0

    def _fetch(self, rels: list[str]) -> None:
        """Read and verify `rels` (paths below the step directory) into memory, in parallel parts."""
        todo = [r for r in dict.fromkeys(rels) if r not in self._mem.files]
        for rel in todo:
            if rel not in self._expected:
                raise VerifyError(errno.ENOENT, f"{rel}: not in the manifest")
        local = {r: p for r in todo if (p := self._local_path(r) if self._local_path else None) is not None}
        for rel, path in local.items():
            self._map_and_check(rel, path)
        todo = [r for r in todo if r not in local]
        with ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="torchrig-read") as pool:
            parts: dict[str, list[Future[bytes]]] = {}
            for rel in todo:
                size = self._expected[rel][1]
                bounds = [(o, min(o + self._part, size)) for o in range(0, size, self._part)] or [(0, 0)]
                parts[rel] = [pool.submit(self._read_range, rel, a, b) for a, b in bounds]
            for rel in todo:
                digest = hashlib.sha256()
                chunks: list[bytes] = []
                for fut in parts[rel]:
                    chunk = fut.result()
                    digest.update(chunk)  # releases the GIL: hashes part k while parts k+1.. are read
                    chunks.append(chunk)
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                want_digest, want_size = self._expected[rel]
                if len(data) != want_size:
                    raise VerifyError(errno.EIO, f"{rel}: size {len(data)} != {want_size}")
                if digest.hexdigest() != want_digest:
                    raise VerifyError(errno.EIO, f"{rel}: sha256 mismatch")
                self._mem.files[rel] = data
                self.bytes_read += len(data)

    def _map_and_check(self, rel: str, path: str) -> None:
        """A local file: map it read-only (the page cache is the buffer: no copy), hash the mapping."""
        want_digest, want_size = self._expected[rel]
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size != want_size:
                    raise VerifyError(errno.EIO, f"{rel}: size {size} != {want_size}")
                if size == 0:
                    data: Any = b""
                else:
                    # The kernel reads the whole file ahead while the mapping is hashed from its start.
                    os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
                    data = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
                    self._maps.append(data)
        except FileNotFoundError as exc:
            raise VerifyError(errno.ENOENT, f"{rel}: missing") from exc
        digest = hashlib.sha256()
        view = memoryview(data)
        for off in range(0, size, HASH_CHUNK):
            digest.update(view[off : off + HASH_CHUNK])  # releases the GIL; page faults read the disk
        view.release()
        if digest.hexdigest() != want_digest:
            raise VerifyError(errno.EIO, f"{rel}: sha256 mismatch")
        self._mem.files[rel] = data
        self.bytes_read += size

    def close(self) -> None:
        """Unmap the local files (the loaded tensors are copies: nothing points into them any more)."""
        self._mem.files.clear()
        for m in self._maps:
            with suppress(BufferError):  # a view still exported: the mapping goes with its last user
                m.close()
        self._maps.clear()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """DCP's metadata, verified, then unpickled with the allow-list of `dcp_metadata` (DCP's own reader
        unpickles anything: a hostile store could run code on every restoring rank)."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        from training.checkpoint.dcp_metadata import load_metadata

        self._fetch([f"{self.path}/{DCP_METADATA}"])
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
            metadata = load_metadata(cast(Any, stream))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        needed = sorted({f"{self.path}/{self.storage_data[i.storage_index].relative_path}" for i in plan.items})
        self._fetch(needed)
        return super().read_data(plan, planner)
