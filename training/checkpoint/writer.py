"""The write path of a save: DCP's own `FileSystemWriter` over a filesystem that writes each byte once per target.

`dcp.save` plans, serialises and names the files exactly as it always does; only its `FileSystemBase` is
replaced (`TeeFileSystem`), so the bytes go from the staged CPU copy straight into every local target
directory, hashed (`digest.py`) in the same pass over memory:

- a *target* is a local directory that gets its own copy: each file store, the node-local copy, and,
  only when an object store has no local file to upload from, a staging directory;
- a file store on the same filesystem as a target that supports reflinks (btrfs, XFS) gets a reflink of
  the target's finished files instead (`clone_into`): copy-on-write, so damage to one never shows in the
  other, and no second write. Hard links are deliberately not used: two stores hard-linked are one copy
  under two names, and a byte flipped in one would be flipped in both (docs/architecture.md);
- each `write` of DCP's serialiser goes to every target's file descriptor in turn (the page cache), while
  a helper thread hashes the same memory; `os.write`, `os.fsync` and the hash's update on large buffers
  release the GIL, so the training loop's thread is not starved by, and does not starve, this work. On
  close, the targets' files are fsynced in parallel;
- a target that fails (a full disk, an I/O error) is dropped with its error; the others go on
  (`fail`), so one store failing never fails the others. With every target of a rank failed, the save
  still runs to its end (the bytes are hashed and dropped), so that DCP's collectives complete on every
  rank and each store's failure is reported as that store's, never as a hang or a crash.

The digests and sizes of the files written (`digests`, keyed by the path relative to the step directory)
become the manifest's entries: no file is read back to be hashed. The read path, which checks those
digests at restore, is `training.checkpoint.reader`.
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import shutil
import sys
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemWriter

from training.checkpoint.digest import DIGEST_ALGORITHM, DIGEST_PART_BYTES, PartDigest

__all__ = [
    "Target",
    "TeeFileSystem",
    "TeeWriter",
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


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's `sync_file_range(2)` through ctypes (os has no binding), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], fn)


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait for it


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing `nbytes` at `offset` to the disk now, without waiting for it.

    The fsync on close then finds most of the file already written instead of starting the whole
    write-out itself: the disk works while later chunks are still being copied into the page cache
    (PostgreSQL's `checkpoint_flush_after` and RocksDB's `bytes_per_sync` do the same). Measured on this
    machine's disk, two fsynced 50 MB copies: 0.14 s -> 0.10 s a save (`dd` of the same 100 MB: 0.09 s);
    500 MB: the close's fsync 0.63-0.74 s -> 0.01-0.02 s (docs/performance.md). A hint only: durability
    still comes from the fsync; where the call is missing or refused (not Linux, a filesystem without it)
    nothing changes. ctypes releases the GIL for the call.
    """
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    """Write `data`, which lands at `offset` of the file, then start its writeback (`start_writeback`)."""
    nbytes = data.nbytes
    while data:
        written = os.write(fd, data)
        data = data[written:]
    start_writeback(fd, offset, nbytes)


class _TeeStream(io.RawIOBase):
    """One file being written: the same bytes to every live target's descriptor, hashed once."""

    def __init__(self, fs: TeeFileSystem, rel: str) -> None:
        super().__init__()
        self._fs = fs
        self._rel = rel
        self._digest = PartDigest(fs.part_bytes, fs.algorithm)
        self._size = 0  # bytes handed to `write`
        self._sent = 0  # bytes handed to the targets (the buffer holds the rest)
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
        offset = self._sent
        self._sent += data.nbytes
        pending = {i: self._fs.writers.submit(_write_all, fd, data, offset) for i, fd in fds[1:]} if threaded else {}
        errors: dict[int, str] = {}
        for i, fd in fds:
            try:
                pending[i].result() if i in pending else _write_all(fd, data, offset)
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
        part_bytes: the part size of the files' digests (`digest.py`; 0: the whole file's).
        algorithm: the hash of the files' digests (`digest.py`).
    """

    def __init__(
        self, targets: list[Target], part_bytes: int = DIGEST_PART_BYTES, algorithm: str = DIGEST_ALGORITHM
    ) -> None:
        self.targets = targets
        self.part_bytes = part_bytes
        self.algorithm = algorithm
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
