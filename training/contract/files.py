"""The run directory: its layout and the one reader/writer of its JSON and JSON-lines files.

    <run_dir>/
      job.yaml            resolved spec (what the workers read)
      supervisor.json     local/embedded-Ray backends: pid + start time of the supervisor (liveness), store, agents
      supervisor.log      a detached run (`torchrig submit`): the supervisor's own output
      launch.json         a detached run: what its supervisor starts (backend, options, plan)
      metrics.jsonl       rank 0, every logEvery steps
      events.jsonl        every rank (`training.contract.events`)
      result.json         rank 0, at the end (`training.contract.records.Result`)
      summary.json        the backend, at the end (`training.contract.records.Summary`)
      logs/node<i>.log    agent i: its own output and every rank's lines, prefixed `[rank<R>]:`
      logs/node<i>/...    elastic's per-attempt, per-local-rank stdout.log / stderr.log / error.json
      nodes/node<i>.yaml  local backend: node i's copy of the spec (its own metrics port)
      checkpoints/        the default `file://./checkpoints` store
      stacks/gen-<G>/     hang forensics of restart generation G: rank-<R>.txt (Python stacks of every
                          thread, appended per dump: the watchdog, `torchrig status --stacks`),
                          rank-<R>.py-spy.txt (when py-spy is installed), flight-recorder-rank-<R>
                          (torch.distributed's flight recorder, CUDA builds)
      profile/gen-<G>/    `metrics.profile`: rank-<R>.trace.json.gz (torch.profiler's Chrome/Perfetto trace)
                          and rank-<R>.txt (its costliest ops) of the captured steps
      ray/                Ray backend: Ray Train's own storage (no checkpoint copies)

Every backend writes this layout (a pod's emptyDir, a Ray run's directory, a local run), so the CLI,
the drills and the benchmarks read all of them the same way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO

__all__ = [
    "MAX_JSONL_BYTES",
    "MAX_JSON_BYTES",
    "MAX_LINE_BYTES",
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "PRIVATE_UMASK",
    "JsonlTail",
    "RunFiles",
    "Skipped",
    "append_jsonl",
    "make_private_dirs",
    "open_private_append",
    "parse_object",
    "private_umask",
    "read_json",
    "read_jsonl",
    "read_text",
    "write_json",
]


@dataclass(frozen=True)
class RunFiles:
    """Paths inside one run directory (`str` or `Path` in, `Path` out)."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def job(self) -> Path:
        return self.root / "job.yaml"

    @property
    def supervisor(self) -> Path:
        return self.root / "supervisor.json"

    @property
    def supervisor_log(self) -> Path:
        """A detached run's supervisor output (`torchrig submit --backend local|ray`)."""
        return self.root / "supervisor.log"

    @property
    def launch(self) -> Path:
        """A detached run: the launch request its supervisor process starts (backend, options, plan)."""
        return self.root / "launch.json"

    @property
    def fault_gate(self) -> Path:
        """Created by a drill to release the faults that wait for it (`training.faults`, `"gated": true`)."""
        return self.root / "fault-gate"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def result(self) -> Path:
        return self.root / "result.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        """The default store (`file://./checkpoints` resolves here)."""
        return self.root / "checkpoints"

    @property
    def ray_storage(self) -> Path:
        """Ray backend: Ray Train's storage path (its own bookkeeping; torchrig keeps no checkpoint there)."""
        return self.root / "ray"

    @property
    def nodes(self) -> Path:
        return self.root / "nodes"

    @property
    def store_port(self) -> Path:
        """Local backend: the rendezvous store process writes its port here once it listens."""
        return self.root / ".store-port"

    @property
    def store_log(self) -> Path:
        """Local backend: the rendezvous store process's output."""
        return self.logs / "store.log"

    @property
    def stacks(self) -> Path:
        """Hang forensics: one directory per restart generation (`stacks_dir`)."""
        return self.root / "stacks"

    def stacks_dir(self, generation: int) -> Path:
        return self.stacks / f"gen-{generation}"

    def stack_file(self, generation: int, rank: int) -> Path:
        """Rank `rank`'s Python stacks (faulthandler, every thread; one section per dump)."""
        return self.stacks_dir(generation) / f"rank-{rank}.txt"

    def profile_dir(self, generation: int) -> Path:
        """`metrics.profile`'s captures of restart generation `generation`."""
        return self.root / "profile" / f"gen-{generation}"

    def profile_trace(self, generation: int, rank: int) -> Path:
        """Rank `rank`'s torch.profiler trace (Chrome trace JSON, gzipped: open it in Perfetto)."""
        return self.profile_dir(generation) / f"rank-{rank}.trace.json.gz"

    def profile_table(self, generation: int, rank: int) -> Path:
        """Rank `rank`'s costliest ops of the captured steps (torch.profiler's `key_averages` table)."""
        return self.profile_dir(generation) / f"rank-{rank}.txt"

    def py_spy_file(self, generation: int, rank: int) -> Path:
        """`py-spy dump` of rank `rank` (native frames too), when py-spy is installed."""
        return self.stacks_dir(generation) / f"rank-{rank}.py-spy.txt"

    def flight_recorder_prefix(self, generation: int) -> Path:
        """Prefix of the flight-recorder dumps; torch appends the rank (`flight-recorder-rank-<R>`)."""
        return self.stacks_dir(generation) / "flight-recorder-rank-"

    def node_spec(self, node: int) -> Path:
        return self.nodes / f"node{node}.yaml"

    def node_log(self, node: int) -> Path:
        return self.logs / f"node{node}.log"

    def node_log_dir(self, node: int) -> Path:
        return self.logs / f"node{node}"

    def archived_summary(self, stamp: str) -> Path:
        """Where a resumed run keeps the summary of the attempt before it."""
        return self.root / f"summary.{stamp}.json"


# Local runs are private to the user who starts them (weights, the store port, stack dumps): the
# supervisor and everything it starts run under this umask (directories 0700, files 0600). Kubernetes
# pods and Ray keep their own umask (a shared checkpoint volume is read by other pods and jobs).
PRIVATE_UMASK = 0o077
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Within: files and directories this process or its children create are its user's alone."""
    previous = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(previous)


def make_private_dirs(path: str | os.PathLike[str], levels: int = 1) -> Path:
    """Create `path` (and its parents), the last `levels` of them mode 0700 whatever the umask
    (stack dumps: `stacks/gen-<G>`); directories that exist keep their mode."""
    path = Path(path)
    private = [path, *path.parents][:levels]
    for directory in reversed([path, *path.parents]):
        if directory.is_dir():
            continue
        with contextlib.suppress(FileExistsError):  # another rank made it meanwhile
            directory.mkdir(mode=PRIVATE_DIR_MODE if directory in private else 0o777)
            if directory in private:
                os.chmod(directory, PRIVATE_DIR_MODE)  # mkdir's mode is masked by the umask
    return path


def open_private_append(path: str | os.PathLike[str]) -> IO[str]:
    """A text file opened for appending, line-buffered, created mode 0600 (an existing one keeps its mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE_MODE)
    return os.fdopen(fd, "a", buffering=1)


def write_json(path: str | os.PathLike[str], data: Any, *, indent: int | None = 2) -> None:
    """Write atomically (readers such as `torchrig status` never see half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=indent, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


# -- reading: every run-directory file is untrusted input ------------------------------------------
# Anyone who can write to the run directory (a worker gone wrong, a user's stray `echo >>`, a shared
# volume) can put anything in these files, and the supervisor reads them while the job runs: a reader
# returns what it could parse and never raises, never blocks (a FIFO under a file's name) and never
# holds more than its limits in memory. What it skipped is counted and logged once per file.
MAX_LINE_BYTES = 1 << 20  # a JSON-lines record; the writers' lines are well under 1 KiB
MAX_JSONL_BYTES = 64 << 20  # a JSON-lines file read whole (~2M metrics records at ~30 bytes/step each)
MAX_JSON_BYTES = 8 << 20  # result.json, summary.json, supervisor.json, launch.json
MAX_NESTING = 32  # deeper values are refused: writing them back (summary.json) would recurse too deep
_CHUNK_BYTES = 1 << 20
_TAIL_READ_BYTES = 8 << 20  # the most one `JsonlTail.read_new` call reads: the rest waits for the next

log = logging.getLogger(__name__)


@dataclass
class Skipped:
    """What a reader of one file left out.

    Attributes:
        malformed: Lines that are not one JSON object (or nest deeper than `MAX_NESTING`).
        overlong: Lines longer than the line limit (never held in memory whole).
        unread_bytes: Bytes of a file over its size limit that were not read (the middle of it).
        not_regular: The path is a FIFO, a device or a directory (never opened for reading).
    """

    malformed: int = 0
    overlong: int = 0
    unread_bytes: int = 0
    not_regular: bool = False

    def __bool__(self) -> bool:
        return bool(self.malformed or self.overlong or self.unread_bytes or self.not_regular)

    def describe(self) -> str:
        """One phrase: what was skipped."""
        parts = []
        if self.not_regular:
            parts.append("not a regular file, not read")
        if self.malformed:
            parts.append(f"{self.malformed} malformed line(s) skipped")
        if self.overlong:
            parts.append(f"{self.overlong} line(s) over {MAX_LINE_BYTES} bytes skipped")
        if self.unread_bytes:
            parts.append(f"{self.unread_bytes} bytes over the file size limit not read")
        return ", ".join(parts)


_reported: set[str] = set()


def _report_once(path: Path, skipped: Skipped) -> None:
    """Log what a reader of `path` skipped, once per file and process (the supervisor polls often)."""
    key = str(path)
    if skipped and key not in _reported:
        _reported.add(key)
        log.warning("%s: %s (the file is damaged or was written by something else)", path, skipped.describe())


def _open_regular(path: str | os.PathLike[str], skipped: Skipped) -> BinaryIO | None:
    """`path` opened for reading when it is a regular file; None when it is missing or anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            skipped.not_regular = True
            os.close(fd)
            return None
        return os.fdopen(fd, "rb")
    except OSError:
        os.close(fd)
        return None


def _depth_within(value: Any, limit: int) -> bool:
    """Whether `value` nests at most `limit` containers deep (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return False
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return True


def parse_object(raw: bytes | str) -> dict[str, Any] | None:
    """One JSON object from untrusted text; None for anything else (malformed, another type, too deep).

    Catches what `json.loads` raises on hostile input besides `ValueError`: `RecursionError` for
    deeply nested arrays (`[[[[...`).
    """
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) and _depth_within(obj, MAX_NESTING) else None


class _LineSplitter:
    """Complete lines out of chunks of bytes, holding at most `max_line_bytes` of an unfinished line."""

    def __init__(self, max_line_bytes: int, skipped: Skipped) -> None:
        self.max_line_bytes = max_line_bytes
        self.skipped = skipped
        self.partial = bytearray()
        self.discarding = False  # inside an over-long line: drop bytes until its newline

    def feed(self, chunk: bytes) -> list[bytes]:
        pieces = chunk.split(b"\n")
        lines: list[bytes] = []
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            if not self.discarding:
                self.partial += piece
                if len(self.partial) > self.max_line_bytes:
                    self.skipped.overlong += 1
                    self.partial.clear()
                    self.discarding = True
            if last:
                break
            if not self.discarding:
                lines.append(bytes(self.partial))
            self.partial.clear()
            self.discarding = False
        return lines

    def reset(self) -> None:
        self.partial.clear()
        self.discarding = False


def _parse_lines(lines: list[bytes], skipped: Skipped) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for raw in lines:
        if not raw.strip():
            continue
        obj = parse_object(raw)
        if obj is None:
            skipped.malformed += 1
        else:
            out.append(obj)
    return out


def read_text(path: str | os.PathLike[str], *, max_bytes: int) -> str | None:
    """A regular file's text (undecodable bytes replaced), or None when it is missing, unreadable, not a
    regular file or over `max_bytes` (job.yaml for a reader that is no worker: the plot's title)."""
    skipped = Skipped()
    fh = _open_regular(path, skipped)
    if fh is None:
        return None
    try:
        with fh:
            data = fh.read(max_bytes + 1)
    except OSError:
        return None
    return None if len(data) > max_bytes else data.decode("utf-8", "replace")


def read_json(path: str | os.PathLike[str], *, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any] | None:
    """A JSON object file, or None when it is missing, unreadable, over `max_bytes` or not an object."""
    skipped = Skipped()
    fh = _open_regular(path, skipped)
    if fh is None:
        _report_once(Path(path), skipped)
        return None
    try:
        with fh:
            data = fh.read(max_bytes + 1)
    except OSError:
        return None
    if len(data) > max_bytes:
        skipped.overlong += 1
        obj = None
    else:
        obj = parse_object(data)
        skipped.malformed += obj is None and bool(data.strip())
    _report_once(Path(path), skipped)
    return obj


def read_jsonl(
    path: str | os.PathLike[str], *, max_bytes: int = MAX_JSONL_BYTES, max_line_bytes: int = MAX_LINE_BYTES
) -> list[dict[str, Any]]:
    """Every complete JSON object line of a file; a torn last line (a writer killed mid-write) is skipped.

    Lines that are not one JSON object, or longer than `max_line_bytes`, are skipped (counted, and
    logged once per file). A file over `max_bytes` is read at both ends, `max_bytes // 2` each: its
    first lines (the run's start) and its newest ones (where the run is now) count most; the middle
    is skipped.
    """
    skipped = Skipped()
    fh = _open_regular(path, skipped)
    if fh is None:
        _report_once(Path(path), skipped)
        return []
    splitter = _LineSplitter(max_line_bytes, skipped)
    out: list[dict[str, Any]] = []
    try:
        with fh:
            size = os.fstat(fh.fileno()).st_size
            if size <= max_bytes:
                out += _read_span(fh, splitter, max_bytes)
            else:
                head = max_bytes // 2
                out += _read_span(fh, splitter, head)
                splitter.reset()  # the head's unfinished line is cut by the skipped middle
                start = size - (max_bytes - head)
                skipped.unread_bytes = start - head
                fh.seek(start)
                splitter.discarding = True  # from the middle of a line: skip to its end
                out += _read_span(fh, splitter, max_bytes - head)
    except OSError:
        pass
    if splitter.partial.strip() and not splitter.discarding:
        # No newline after it: a torn write when it does not parse, silently skipped.
        last = parse_object(bytes(splitter.partial))
        if last is not None:
            out.append(last)
    _report_once(Path(path), skipped)
    return out


def _read_span(fh: BinaryIO, splitter: _LineSplitter, limit: int) -> list[dict[str, Any]]:
    """The objects of the complete lines in the next `limit` bytes of `fh`, read a chunk at a time."""
    out: list[dict[str, Any]] = []
    left = limit
    while left > 0 and (chunk := fh.read(min(_CHUNK_BYTES, left))):
        left -= len(chunk)
        out += _parse_lines(splitter.feed(chunk), splitter.skipped)
    return out


# json.dumps(obj, separators=..., default=str) builds this encoder on every call; the metrics sinks
# write a line per logEvery steps on the training thread, so build it once (encode() keeps no state).
_LINE_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)


def append_jsonl(fd: int, obj: dict[str, Any]) -> None:
    """Append one object as one line with a single `write` on an `O_APPEND` descriptor.

    POSIX appends of one `write` call are not interleaved with other writers' appends, so lines of
    concurrent ranks never mix.
    """
    os.write(fd, (_LINE_ENCODER.encode(obj) + "\n").encode())


def open_append(path: str | os.PathLike[str]) -> int:
    """An `O_APPEND` descriptor for `append_jsonl` (the parent directory is created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


@dataclass
class JsonlTail:
    """Incremental reader of a JSON-lines file that others append to (only complete lines are parsed).

    Bounded like `read_jsonl`: a line over `max_line_bytes` is skipped without being held, and one
    call reads at most `max_read_bytes` (a flood is worked through over several calls). `skipped`
    counts what was left out; the first skip is logged once.
    """

    path: Path
    offset: int = 0
    max_line_bytes: int = MAX_LINE_BYTES
    max_read_bytes: int = _TAIL_READ_BYTES
    skipped: Skipped = field(default_factory=Skipped)
    _splitter: _LineSplitter | None = field(default=None, repr=False)

    def read_new(self) -> list[dict[str, Any]]:
        if self._splitter is None:
            self._splitter = _LineSplitter(self.max_line_bytes, self.skipped)
        fh = _open_regular(self.path, self.skipped)
        if fh is None:
            _report_once(Path(self.path), self.skipped)
            return []
        try:
            with fh:
                if os.fstat(fh.fileno()).st_size < self.offset:  # replaced or truncated: start over
                    self.offset = 0
                    self._splitter.reset()
                fh.seek(self.offset)
                out: list[dict[str, Any]] = []
                left = self.max_read_bytes
                while left > 0 and (chunk := fh.read(min(_CHUNK_BYTES, left))):
                    left -= len(chunk)
                    self.offset += len(chunk)
                    out += _parse_lines(self._splitter.feed(chunk), self.skipped)
        except OSError:
            return []
        _report_once(Path(self.path), self.skipped)
        return out
