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

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["JsonlTail", "RunFiles", "append_jsonl", "read_json", "read_jsonl", "write_json"]


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


def write_json(path: str | os.PathLike[str], data: Any, *, indent: int | None = 2) -> None:
    """Write atomically (readers such as `torchrig status` never see half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=indent, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A JSON object file, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _parse_lines(raw_lines: list[bytes] | list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for raw in raw_lines:
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete JSON object line of a file; a torn last line (a writer killed mid-write) is skipped."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    return _parse_lines(text.splitlines())


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
    """Incremental reader of a JSON-lines file that others append to (only complete lines are parsed)."""

    path: Path
    offset: int = 0
    _partial: bytes = field(default=b"", repr=False)

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with Path(self.path).open("rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except OSError:
            return []
        self.offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        return _parse_lines(lines)
