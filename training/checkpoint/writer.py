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
become the manifest's entries: no file is read back to be hashed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import io
import logging
import mmap
import os
import shutil
import sys
import warnings
import zipfile
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter

from training.checkpoint.digest import DIGEST_ALGORITHM, DIGEST_PART_BYTES, PartDigest, new_hash, root_of
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

_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+: fault a range in, one call
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


def _tensor_in(item: memoryview) -> Any:
    """The tensor `torch.save` wrote in `item`, as a CPU view of `item`'s bytes (no copy); None when the item
    is something else or in a byte order other than this machine's (the caller then lets DCP load it)."""
    import torch

    # The byte order first: torch.load(map_location="meta") of an archive in the other byte order crashes
    # the process (torch 2.13 byte-swaps the meta storage: a segmentation fault), where DCP's path swaps.
    if _byte_order(item) != sys.byteorder:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.frombuffer on a read-only buffer: it is only read from here
        meta = torch.load(cast(IO[bytes], _ViewStream(item)), map_location="meta", weights_only=True)
        if not isinstance(meta, torch.Tensor) or type(meta) is not torch.Tensor:
            return None
        storage = meta.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)
        if offset is None:
            return None
        nbytes = storage.nbytes()
        if offset < 0 or offset + nbytes > item.nbytes:
            raise VerifyError(errno.EIO, f"tensor storage [{offset}, {offset + nbytes}) outside its item")
        if nbytes == 0:
            return torch.empty(meta.size(), dtype=meta.dtype)
        base = torch.frombuffer(item, dtype=torch.uint8, count=nbytes, offset=offset).view(meta.dtype)
        # as_strided checks that the shape and strides stay inside the storage
        return base.as_strided(meta.size(), meta.stride(), meta.storage_offset())


def _byte_order(item: memoryview) -> str:
    """The byte order a `torch.save` archive records ("little" when it records none, as torch.load assumes)."""
    with zipfile.ZipFile(_ViewStream(item)) as archive:
        for info in archive.infolist():
            if info.filename.endswith("/byteorder"):
                if info.file_size > 16:  # "little" or "big": anything larger is not torch's (nor read)
                    return "unknown"
                return archive.read(info).decode("ascii", "replace")
    return "little"


ReadRange = Callable[[str, int, int], bytes]  # (path below the step directory, start, end) -> the bytes
LocalPath = Callable[[str], "str | None"]  # path below the step directory -> a local file to map, or None


class VerifiedReader(FileSystemReader):
    """DCP's `FileSystemReader` that reads each file it needs once, in parallel parts, hashing while reading.

    A file is checked against its manifest entry (size and digest) before any of it is handed to DCP, and
    every file this rank needs is read and checked before the first tensor is loaded: a corrupt copy
    raises `VerifyError` (DCP passes it to every rank) and leaves this rank's state untouched.

    A local file is mapped read-only (the page cache is the buffer: no copy, no memory of this process's
    own); its parts are faulted in (`MADV_POPULATE_READ`, one call per part instead of one page fault per
    4 KiB) and hashed on several threads at once. An object is read in parallel ranged reads, each part
    hashed on the thread that read it. Digests over parts (manifest version 3, `digest.py`) are hashed in
    parallel; an older manifest's whole-file SHA-256 is one stream, hashed in order while the later parts
    are still being read.

    Args:
        read_range: reads bytes [start, end) of a file of the step directory (a local file or an object).
        dcp_dir: the checkpoint's directory below the step directory (`gen-G`).
        expected: path below the step directory -> (digest, size), from the manifest.
        local_path: path below the step directory -> a local file to map, or None (then `read_range`).
        digest_part_bytes: the manifest's `digest_part_bytes` (0: the whole file's digest).
        digest_algorithm: the manifest's `digest_algorithm`.
        part_bytes: the size of the parts read at once (rounded up to a multiple of the digest's parts).
        threads: how many parts are read (and hashed) at once.
        prefetch: files (below the step directory) this rank will most likely need: their reads start
            with the metadata's, so DCP's planning runs while they are read. Only read and hashed ahead:
            nothing of them is loaded before every file the plan needs is verified.
    """

    def __init__(
        self,
        read_range: ReadRange,
        dcp_dir: str,
        expected: dict[str, tuple[str, int]],
        *,
        local_path: LocalPath | None = None,
        digest_part_bytes: int = 0,
        digest_algorithm: str = "sha256",
        part_bytes: int = 16 * 1024 * 1024,
        threads: int = 8,
        prefetch: list[str] | None = None,
    ) -> None:
        super().__init__(dcp_dir)
        self._read_range = read_range
        self._local_path = local_path
        self._maps: list[mmap.mmap] = []
        self._expected = expected
        self._digest_part = digest_part_bytes
        self._algorithm = digest_algorithm
        new_hash(digest_algorithm)  # an unknown one fails here, before anything is read
        dp = digest_part_bytes
        self._part = -(-part_bytes // dp) * dp if dp else part_bytes
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._mem = _MemoryFS()
        self.fs = cast(Any, self._mem)
        self.path = cast(Path, dcp_dir)
        self.bytes_read = 0
        self._reading: dict[str, tuple[Any, list[Future[Any]]]] = {}  # queued, not yet checked
        self._prefetch = [r for r in prefetch or [] if r in expected]

    def _start(self, rels: list[str]) -> None:
        """Queue every part of `rels` (those not read or queued yet) on the read pool."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="torchrig-read")
        for rel in rels:
            if rel in self._mem.files or rel in self._reading:
                continue
            path = self._local_path(rel) if self._local_path else None
            self._reading[rel] = (
                self._map_parts(self._pool, rel, path) if path is not None else self._read_parts(self._pool, rel)
            )

    def _abandon_reads(self) -> None:
        """Cancel the queued parts of every file not checked yet, and wait for the ones running."""
        reading, self._reading = self._reading, {}
        for _, parts in reading.values():
            for fut in parts:
                fut.cancel()
        wait([f for _, parts in reading.values() for f in parts])

    def _fetch(self, rels: list[str]) -> None:
        """Read and verify `rels` (paths below the step directory) into memory, all at once in parallel parts."""
        todo = [r for r in dict.fromkeys(rels) if r not in self._mem.files]
        for rel in todo:
            if rel not in self._expected:
                raise VerifyError(errno.ENOENT, f"{rel}: not in the manifest")
        try:
            self._start(todo)  # every part of every file is queued before the first is awaited
            for rel in todo:
                data, parts = self._reading.pop(rel)
                self._check(rel, data, parts)
        except BaseException:
            self._abandon_reads()  # a failed file: the others' parts are not left running
            raise

    def _bounds(self, size: int, part: int) -> list[tuple[int, int]]:
        return [(o, min(o + part, size)) for o in range(0, size, part)] or [(0, 0)]

    def _part_digests(self, data: Any) -> list[bytes]:
        """The raw digests of the digest parts of one read part (its offset is a multiple of them)."""
        dp = self._digest_part
        with memoryview(data) as view:
            return [new_hash(self._algorithm, view[o : o + dp]).digest() for o in range(0, max(len(view), 1), dp)]

    def _read_parts(self, pool: ThreadPoolExecutor, rel: str) -> tuple[None, list[Future[Any]]]:
        """An object: ranged reads in parallel, each part's digest parts hashed on the thread that read it."""

        def read(a: int, b: int) -> tuple[bytes, list[bytes] | None]:
            chunk = self._read_range(rel, a, b)
            return chunk, self._part_digests(chunk) if self._digest_part else None

        return None, [pool.submit(read, a, b) for a, b in self._bounds(self._expected[rel][1], self._part)]

    def _map_parts(self, pool: ThreadPoolExecutor, rel: str, path: str) -> tuple[Any, list[Future[Any]]]:
        """A local file: map it read-only; fault each part in and hash it on the pool's threads."""
        want_size = self._expected[rel][1]
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size != want_size:
                    raise VerifyError(errno.EIO, f"{rel}: size {size} != {want_size}")
                if size == 0:
                    return b"", []
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
                data = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
                self._maps.append(data)
        except FileNotFoundError as exc:
            raise VerifyError(errno.ENOENT, f"{rel}: missing") from exc
        part = self._digest_part or self._part

        def fault_in(a: int, b: int) -> list[bytes] | tuple[int, int]:
            with suppress(OSError, ValueError):  # before Linux 5.14: the hash's page faults read the part
                data.madvise(_MADV_POPULATE_READ, a, b - a)
            if not self._digest_part:
                return (a, b)  # hashed in order by `_check`
            with memoryview(data) as view:
                return [new_hash(self._algorithm, view[a:b]).digest()]

        return data, [pool.submit(fault_in, a, b) for a, b in self._bounds(size, part)]

    def _check(self, rel: str, data: Any, parts: list[Future[Any]]) -> None:
        """Wait for `rel`'s parts, check its size and digest, and hand it to DCP's view of the files."""
        want_digest, want_size = self._expected[rel]
        digests: list[bytes] = []
        whole = new_hash(self._algorithm)
        chunks: list[bytes] = []
        for fut in parts:  # in order; the hash releases the GIL: part k is hashed while k+1.. are read
            got = fut.result()
            if data is None:  # an object: (bytes, its digest parts' digests or None)
                chunk, got = got
                chunks.append(chunk)
                if got is None:
                    whole.update(chunk)
            if isinstance(got, tuple):  # a mapped part faulted in, for the whole-file digest
                with memoryview(data) as view:
                    whole.update(view[got[0] : got[1]])
            elif got is not None:
                digests.extend(got)
        if data is None:
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if len(data) != want_size:
            raise VerifyError(errno.EIO, f"{rel}: size {len(data)} != {want_size}")
        digest = root_of(digests, self._algorithm) if self._digest_part else whole.hexdigest()
        if digest != want_digest:
            raise VerifyError(errno.EIO, f"{rel}: digest mismatch")
        self._mem.files[rel] = data
        self.bytes_read += len(data)

    def close(self) -> None:
        """Unmap the local files (the loaded tensors are copies: nothing points into them any more)."""
        self._abandon_reads()  # prefetched files the plan did not need
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
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

        metadata_file = f"{self.path}/{DCP_METADATA}"
        try:
            self._start([metadata_file, *self._prefetch])  # the likely data files read during the planning
        except VerifyError:
            self._abandon_reads()  # a prefetched file missing or of the wrong size: found again when needed
            self._prefetch = []
        self._fetch([metadata_file])
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
            metadata = load_metadata(cast(Any, stream))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        """Load the plan's items from the verified files: each tensor with one copy, straight from the
        verified bytes (the page cache for a mapped local file) into its place in the state.

        DCP's own reader `torch.load`s every item into a new tensor and then copies that into the state: two
        passes over memory. Here `torch.load(map_location="meta")` reads only the item's pickle (dtype,
        shape, strides, and where its storage's bytes lie in the item, as torch's own experimental
        `checkpoint_reader` does), and the state's tensor is filled from a view of those bytes. Items this
        cannot take (non-tensor values, DCP extensions such as compression, a byte order other than this
        machine's) go through DCP's own path.
        """
        from torch.distributed.checkpoint.planner import LoadItemType

        needed = sorted({f"{self.path}/{self.storage_data[i.storage_index].relative_path}" for i in plan.items})
        self._fetch(needed)
        rest = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                rest.append(item)
                continue
            # (No `with` on these views: a tensor over them still alive when an error leaves the block would
            # turn that error into a BufferError; the mapping is closed in `close`, tolerating late users.)
            view = memoryview(self._mem.files[f"{self.path}/{info.relative_path}"])[
                info.offset : info.offset + info.length
            ]
            source = _tensor_in(view)
            if source is None:
                rest.append(item)
                continue
            target = planner.resolve_tensor(item).detach()
            source = narrow_tensor_by_index(source, item.storage_offsets, item.lengths)
            if target.size() != source.size():
                raise VerifyError(
                    errno.EIO,
                    f"{info.relative_path}: item {item.storage_index.fqn} has shape "
                    f"{tuple(source.size())}, the state's is {tuple(target.size())}",
                )
            target.copy_(source)
            del source, view
            planner.commit_tensor(item, target)
        return super().read_data(dataclasses.replace(plan, items=rest), planner)
