"""Run directories of local runs: layout, the supervisor record, summary.json, logs.

Layout (docs/architecture.md, "Worker -> run directory"):

    runs/<name>/<YYYYmmdd-HHMMSS>/
      job.yaml            resolved spec (what the workers read)
      supervisor.json     pid + start time of the supervising `torchrig run` (liveness), store, agents
      metrics.jsonl       rank 0, every logEvery steps
      events.jsonl        every rank
      result.json         rank 0, at the end
      summary.json        the backend, at the end
      logs/node<i>.log    agent i: its own output and every rank's lines, prefixed `[rank<R>]:`
      logs/node<i>/...    elastic's per-attempt, per-local-rank stdout.log / stderr.log / error.json
      checkpoints/        the default `file://./checkpoints` store
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.backends._local_procs import alive
from orchestrator.backends.base import RunState

__all__ = [
    "JsonlTail",
    "RunFiles",
    "build_summary",
    "find_run_dirs",
    "iter_rank_lines",
    "latest_failure_log",
    "new_run_dir",
    "read_json",
    "read_jsonl",
    "run_state",
    "write_json",
]

RUNS_ROOT_ENV = "TORCHRIG_RUNS_DIR"  # where `torchrig list` and new runs look (default ./runs)
_RANK_PREFIX_RE = re.compile(r"^\[rank(\d+)\]:")


def runs_root() -> Path:
    return Path(os.environ.get(RUNS_ROOT_ENV, "runs"))


@dataclass(frozen=True)
class RunFiles:
    """Paths inside one run directory."""

    root: Path

    @property
    def job(self) -> Path:
        return self.root / "job.yaml"

    @property
    def supervisor(self) -> Path:
        return self.root / "supervisor.json"

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

    def node_log(self, node: int) -> Path:
        return self.logs / f"node{node}.log"

    def node_log_dir(self, node: int) -> Path:
        return self.logs / f"node{node}"


def new_run_dir(name: str, root: Path | None = None) -> Path:
    """`runs/<name>/<YYYYmmdd-HHMMSS>` (a `-N` suffix when two runs start in the same second); not created."""
    base = (root or runs_root()) / name
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = base / stamp
    n = 1
    while candidate.exists():
        candidate = base / f"{stamp}-{n}"
        n += 1
    return candidate


def write_json(path: Path, data: Any) -> None:
    """Write atomically (readers such as `torchrig status` never see half a file)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON object line of a file; a torn last line (a writer killed mid-write) is skipped."""
    out: list[dict[str, Any]] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


@dataclass
class JsonlTail:
    """Incremental reader of a JSON-lines file that others append to (only complete lines are parsed)."""

    path: Path
    offset: int = 0
    _partial: bytes = field(default=b"", repr=False)

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except OSError:
            return []
        self.offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out: list[dict[str, Any]] = []
        for raw in lines:
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out


def _collapse(values: list[int]) -> list[int]:
    out: list[int] = []
    for v in values:
        if not out or out[-1] != v:
            out.append(v)
    return out


def world_sizes_from_events(events: list[dict[str, Any]]) -> list[int]:
    """World sizes in the order the run went through them (one entry per change), from `start` events."""
    starts = sorted(
        (e for e in events if e.get("event") == "start" and isinstance(e.get("world_size"), int)),
        key=lambda e: float(e.get("time", 0.0)),
    )
    return _collapse([int(e["world_size"]) for e in starts])


def build_summary(
    run_dir: Path,
    *,
    status: str,
    wall_s: float,
    stores: list[dict[str, str]],
    total_steps: int | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """summary.json from the files the workers wrote (result.json, events.jsonl, metrics.jsonl).

    Args:
        run_dir: the run directory.
        status: `succeeded`, `failed` or `cancelled`.
        wall_s: seconds from launch to the end, measured by the supervisor.
        stores: `{name, uri}` of each checkpoint store (uri resolved against the run directory).
        total_steps: the steps the job asked for.
        reason: why it failed or was cancelled.
    """
    files = RunFiles(run_dir)
    result = read_json(files.result) or {}
    events = read_jsonl(files.events)
    metrics = read_jsonl(files.metrics)
    last_metric = metrics[-1] if metrics else {}

    generations = [int(e["generation"]) for e in events if isinstance(e.get("generation"), int)]
    restored_from: list[dict[str, Any]] = []
    seen_restores: set[tuple[Any, ...]] = set()
    for e in events:
        if e.get("event") != "restore" or e.get("rank", 0) != 0:
            continue
        key = (e.get("generation"), e.get("store"), e.get("step"))
        if key not in seen_restores:
            seen_restores.add(key)
            restored_from.append({"store": e.get("store"), "step": e.get("step")})

    checkpoints: list[dict[str, Any]] = []
    committed = [e for e in events if e.get("event") == "checkpoint_committed"]
    for store in stores:
        store_steps = [
            int(e["step"])
            for e in committed
            if isinstance(e.get("step"), int) and (store["name"] in (e.get("stores_ok") or [store["name"]]))
        ]
        checkpoints.append({**store, "last_committed_step": max(store_steps) if store_steps else None})

    steps = result.get("steps", last_metric.get("step"))
    summary: dict[str, Any] = {
        "status": status,
        "steps": steps,
        "total_steps": total_steps,
        "final_loss": result.get("final_loss", last_metric.get("loss")),
        "eval": result.get("eval", {}),
        "restarts": max(generations, default=0),
        "restored_from": restored_from,
        "samples_per_s": result.get("samples_per_s", last_metric.get("samples_per_s")),
        "wall_s": round(wall_s, 3),
        "world_sizes": world_sizes_from_events(events),
        "params_sha256": result.get("params_sha256"),
        "run_dir": str(run_dir),
        "checkpoints": checkpoints,
    }
    if reason:
        summary["reason"] = reason
    return summary


def run_state(run_dir: Path) -> tuple[RunState, str, dict[str, Any]]:
    """State of a local run from its directory: summary.json if finished, else the supervisor's liveness."""
    files = RunFiles(run_dir)
    summary = read_json(files.summary)
    supervisor = read_json(files.supervisor) or {}
    running = bool(supervisor) and alive(int(supervisor.get("pid", -1)), supervisor.get("start_ticks"))
    if summary is not None and not (running and supervisor.get("resumed")):
        try:
            state = RunState(summary.get("status", "unknown"))
        except ValueError:
            state = RunState.UNKNOWN
        return state, str(summary.get("reason", "")), summary
    if running:
        details = {"supervisor_pid": supervisor.get("pid"), "run_dir": str(run_dir)}
        metrics = read_jsonl(files.metrics)
        if metrics:
            details.update({k: metrics[-1].get(k) for k in ("step", "loss", "world_size", "samples_per_s")})
        return RunState.RUNNING, "", details
    if supervisor:
        return RunState.UNKNOWN, "the supervising `torchrig run` is gone and wrote no summary", {}
    if files.job.exists():
        return RunState.PENDING, "", {}
    return RunState.UNKNOWN, "not a run directory (no job.yaml)", {}


def find_run_dirs(root: Path | None = None) -> list[Path]:
    """Run directories under `runs/` (those holding a job.yaml), oldest first."""
    base = root or runs_root()
    if not base.is_dir():
        return []
    found = [p.parent for p in base.glob("*/*/job.yaml")]
    return sorted(found, key=lambda p: (p.stat().st_mtime, str(p)))


def iter_rank_lines(run_dir: Path, rank: int | None) -> Iterator[str]:
    """Lines of the agents' logs, optionally only global rank `rank`'s (prefix `[rank<R>]:`), node by node."""
    files = RunFiles(run_dir)
    for log in sorted(files.logs.glob("node*.log"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0)):
        with log.open(errors="replace") as fh:
            for line in fh:
                if rank is None:
                    yield line.rstrip("\n")
                    continue
                match = _RANK_PREFIX_RE.match(line)
                if match and int(match.group(1)) == rank:
                    yield line.rstrip("\n")


def latest_failure_log(run_dir: Path) -> Path | None:
    """The log of the rank that failed last: its elastic error.json's stderr, else the newest non-empty stderr.log."""
    logs = RunFiles(run_dir).logs
    errors = sorted(logs.glob("node*/*/attempt_*/*/error.json"), key=lambda p: p.stat().st_mtime)
    if errors:
        stderr = errors[-1].parent / "stderr.log"
        return stderr if stderr.exists() else errors[-1]
    stderrs = [p for p in logs.glob("node*/*/attempt_*/*/stderr.log") if p.stat().st_size > 0]
    if stderrs:
        return max(stderrs, key=lambda p: p.stat().st_mtime)
    node_logs = list(logs.glob("node*.log"))
    return max(node_logs, key=lambda p: p.stat().st_mtime) if node_logs else None
