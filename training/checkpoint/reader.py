"""The read path of a restore: DCP's own `FileSystemReader` over files read once and verified first.

`dcp.load` plans and loads exactly as it always does; only the files under it are replaced: every file
this rank needs is read (a local file mapped read-only, an object in parallel ranged reads), hashed in
parallel parts while it is read (`digest.py`) and checked against the manifest's size and digest before
the first tensor is loaded, so a corrupt copy raises `VerifyError` and leaves the state untouched (the
restore then tries the next store: `training.checkpoint.restore`). DCP's metadata is unpickled with the
allow-list of `dcp_metadata`, and each tensor is copied once, straight from the verified bytes into its
place in the state. The write path that produced the digests is `training.checkpoint.writer`.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import mmap
import os
import sys
import warnings
import zipfile
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any, cast

from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader

from training.checkpoint.digest import new_hash, root_of
from training.checkpoint.manifest import DCP_METADATA

__all__ = [
    "LocalPath",
    "ReadRange",
    "VerifiedReader",
    "VerifyError",
]

_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+: fault a range in, one call


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
