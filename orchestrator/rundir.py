"""Reading and naming run directories: where new runs go, what state a run is in, its summary and logs.

The layout itself is `training.contract.RunFiles` (docs/architecture.md, "Worker -> run directory");
every backend writes it, so `torchrig status/list/logs/report`, the drills and the benchmarks read
any run through these functions.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.backends._local_procs import alive
from orchestrator.backends.base import RunState
from training.contract import (
    Env,
    Event,
    EventKind,
    FinalCheckpoint,
    RunFiles,
    Summary,
    read_events,
    read_json,
    read_jsonl,
)
from training.contract.events import sdc_quarantine

__all__ = [
    "EarlierCheckpoints",
    "build_summary",
    "earlier_checkpoints",
    "error_line",
    "find_run_dirs",
    "iter_rank_lines",
    "last_save",
    "latest_failure_log",
    "metric_map",
    "new_run_dir",
    "preempt_grace_warning",
    "preemption_of",
    "preemption_reason",
    "rank_of_line",
    "recoveries_from_events",
    "run_state",
    "runs_root",
    "sdc_of",
    "world_sizes_from_events",
]

_RANK_PREFIX_RE = re.compile(r"^\[rank(\d+)\]:")
MAX_LOG_LINE_CHARS = 64 * 1024  # `torchrig logs`: a longer line is cut (the rest of it is never held)


def runs_root() -> Path:
    """Where new local runs go and `torchrig list` looks: `$TORCHRIG_RUNS_DIR`, default `./runs`."""
    return Path(os.environ.get(Env.RUNS_DIR, "runs"))


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


@dataclass(frozen=True)
class EarlierCheckpoints:
    """An earlier, unfinished run directory of the same job whose run-directory store holds checkpoints."""

    run_dir: Path
    store: str  # the store's name
    step: int  # its newest step with a manifest
    state: str  # how that run ended: failed, cancelled, preempted, unknown (no summary)


def earlier_checkpoints(spec: Any, new_run_dir: Path, *, look_back: int = 20) -> EarlierCheckpoints | None:
    """The newest earlier run of this job that did not finish and holds checkpoints that a run in
    `new_run_dir` would not see.

    Only stores under the run directory (a relative `file://` path) stay behind when a launch takes a
    new run directory; a job that resumes (`checkpoint.resume` not `never`) then starts over without a
    word unless it is told. A run that succeeded or still runs is no candidate. Looks at the
    `look_back` newest sibling run directories; a store it cannot list counts as empty (this is a hint,
    never a reason to fail a launch).
    """
    from training.checkpoint import list_checkpoints, open_storage
    from training.checkpoint_config import ResumePolicy

    ckpt = spec.spec.checkpoint
    relative = [s for s in ckpt.stores if s.kind.filesystem and not s.path.startswith("/")]
    if not relative or ckpt.resume is ResumePolicy.never:
        return None
    new_run_dir = new_run_dir.resolve()
    try:
        siblings = sorted((d for d in new_run_dir.parent.iterdir() if d.is_dir()), reverse=True)
    except OSError:
        return None
    for run_dir in [d for d in siblings if d.resolve() != new_run_dir][:look_back]:
        state = run_state(run_dir)[0]
        if state in (RunState.SUCCEEDED, RunState.RUNNING, RunState.PENDING):
            continue
        for store in relative:
            try:
                listing = list_checkpoints(open_storage(store.resolved_uri(run_dir)))
            except Exception:  # a hint: an unreadable directory is just not one
                continue
            steps = [c.step for c in listing if c.manifest is not None or c.untrusted]
            if steps:
                return EarlierCheckpoints(run_dir, store.display_name, max(steps), state.value)
    return None


def _as_event(event: Event | Mapping[str, Any]) -> Event:
    return event if isinstance(event, Event) else Event.from_dict(dict(event))


def recoveries_from_events(events: Iterable[Event]) -> dict[str, int]:
    """How often the group recovered, by path: `inplace` (one per process-group generation a spare
    joined) and `restart` (one per restarted generation that restored)."""
    seen: dict[str, set[tuple[int, int]]] = {}
    for e in events:
        if e.kind is EventKind.RECOVERY:
            path = str(e.get("path", ""))
            seen.setdefault(path, set()).add((e.generation, _int(e.get("inplace_generation")) or 0))
    return {path: len(keys) for path, keys in sorted(seen.items())}


def world_sizes_from_events(events: Iterable[Event | Mapping[str, Any]]) -> list[int]:
    """World sizes in the order the run went through them (one entry per change), from `start` events."""
    starts = sorted(
        (e for e in map(_as_event, events) if e.kind is EventKind.START and isinstance(e.get("world_size"), int)),
        key=lambda e: e.time,
    )
    out: list[int] = []
    for size in (int(e.get("world_size")) for e in starts):
        if not out or out[-1] != size:
            out.append(size)
    return out


def build_summary(
    run_dir: Path,
    *,
    status: str,
    wall_s: float,
    stores: list[dict[str, str]],
    total_steps: int | None = None,
    reason: str | None = None,
    cancel_wins: bool = False,
    since: float | None = None,
) -> Summary:
    """summary.json from the files the workers wrote (result.json, events.jsonl, metrics.jsonl).

    A run whose processes all succeeded but whose final checkpoint no store committed has `failed`:
    its last steps exist nowhere (result.json's `final_checkpoint`; the reason names each store's error).

    Args:
        run_dir: The run directory.
        status: `succeeded`, `failed` or `cancelled` (a `RunState` value) as the processes ended;
            a run whose last act was a preemption (`preemption_of`) is `preempted` unless it succeeded.
        wall_s: Seconds from launch to the end, measured by the supervisor.
        stores: `{name, uri}` of each checkpoint store (uri resolved against the run directory).
        total_steps: The steps the job asked for.
        reason: Why it failed or was cancelled.
        cancel_wins: A `cancelled` status stays `cancelled` even when the workers' last act was a
            preemption: on Ray a cancel shuts Ray down, which SIGTERMs the workers, so their emergency
            checkpoint is the cancel's doing (locally a first Ctrl-C is a preemption on purpose).
        since: Wall time this attempt started: a result.json written before it is an earlier attempt's
            (a resubmit reuses the run directory) and says nothing of this one.
    """
    files = RunFiles(run_dir)
    result = read_json(files.result) or {}
    if result and since is not None:
        try:
            if files.result.stat().st_mtime < since:
                result = {}
        except OSError:
            result = {}
    events = read_events(files.events)
    metrics = read_jsonl(files.metrics)
    if since is not None:  # an earlier attempt's last step is not this attempt's progress
        metrics = [m for m in metrics if isinstance(m.get("time"), (int, float)) and m["time"] >= since]
    last_metric = metrics[-1] if metrics else {}

    restored_from: list[dict[str, Any]] = []
    seen_restores: set[tuple[Any, ...]] = set()
    for e in events:
        if e.kind is not EventKind.RESTORE or e.rank != 0:
            continue
        source, step = _str(e.get("store")), e.step
        key = (e.generation, source, step)
        if key not in seen_restores:
            seen_restores.add(key)
            restored_from.append({"store": source, "step": step})

    committed = [e for e in events if e.kind is EventKind.CHECKPOINT_COMMITTED and e.step is not None]
    checkpoints: list[dict[str, Any]] = []
    for store in stores:
        steps = [e.step for e in committed if e.step is not None and store["name"] in _stores_ok(e, store["name"])]
        checkpoints.append({**store, "last_committed_step": max(steps) if steps else None})

    final = FinalCheckpoint.from_dict(result.get("final_checkpoint"))
    if final is not None and final.lost and status == RunState.SUCCEEDED.value:
        status, reason = RunState.FAILED.value, final.reason()
    preempted = preemption_of(events)
    user_cancel = cancel_wins and status == RunState.CANCELLED.value
    if preempted is not None and status != RunState.SUCCEEDED.value and not user_cancel:
        status, reason = RunState.PREEMPTED.value, preemption_reason(preempted)

    # result.json and the metrics lines are untrusted input: a value of the wrong type is left out
    # rather than carried into summary.json (and into every reader of it).
    return Summary(
        status=status,
        steps=_int(result.get("steps", preempted.get("step") if preempted else last_metric.get("step"))),
        total_steps=total_steps,
        final_loss=_number(result.get("final_loss", last_metric.get("loss"))),
        eval=metric_map(result.get("eval")),
        restarts=max((e.generation for e in events), default=0),
        restored_from=restored_from,
        samples_per_s=_number(result.get("samples_per_s", last_metric.get("samples_per_s"))),
        wall_s=round(wall_s, 3),
        world_sizes=world_sizes_from_events(events),
        recoveries=recoveries_from_events(events),
        params_sha256=_str(result.get("params_sha256")),
        run_dir=str(run_dir),
        checkpoints=checkpoints,
        reason=reason or None,
        final_checkpoint=final,
        preempted=preempted,
        sdc=sdc_of(events),
        quarantined_hosts=sdc_quarantine(events) or None,
    )


def sdc_of(events: Iterable[Event]) -> list[dict[str, Any]] | None:
    """Rank 0's `sdc` events, as summary.json lists them (None: there was none)."""
    found = [
        {key: e.get(key) for key in ("suspects", "suspect_hosts", "decided")}
        | {
            key: e.get(key)
            for key in ("replaced_by", "excluded_hosts", "excluded_node")
            if e.get(key) not in (None, "", [])
        }
        | {"step": e.step}
        for e in events
        if e.kind is EventKind.SDC and e.rank == 0
    ]
    return found or None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if isinstance(value, float) or abs(value) <= sys.float_info.max else None  # 400 digits: no float


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def metric_map(value: Any) -> dict[str, float]:
    """The `{name: number}` entries of an untrusted metrics mapping (result.json's or summary.json's `eval`)."""
    if not isinstance(value, Mapping):
        return {}
    return {str(k): v for k, v in value.items() if _number(v) is not None}


def _stores_ok(event: Event, default: str) -> list[str]:
    """The stores a `checkpoint_committed` event names (older workers name none: the only store)."""
    named = event.get("stores_ok")
    if not named:
        return [default]
    return [s for s in named if isinstance(s, str)] if isinstance(named, list) else []


def preemption_of(events: Iterable[Event | Mapping[str, Any]]) -> dict[str, Any] | None:
    """The run's preemption when it was the run's last act (no process started after it): rank 0's
    `preempted` event of that generation (another rank's when rank 0 wrote none), as a dict."""
    ordered = sorted(map(_as_event, events), key=lambda e: e.time)
    preempted = [e for e in ordered if e.kind is EventKind.PREEMPTED]
    if not preempted:
        return None
    last = preempted[-1]
    if any(e.kind is EventKind.START and e.time > last.time for e in ordered):
        return None  # the job went on (survivors restarted in place): not how it ended
    started = max((e.time for e in ordered if e.kind is EventKind.START and e.time <= last.time), default=0.0)
    mine = [e for e in preempted if e.generation == last.generation and e.time >= started]
    chosen = next((e for e in mine if e.rank == 0), last)
    return {"rank": chosen.rank, "generation": chosen.generation, **chosen.data}


def last_save(run_dir: Path) -> tuple[int, float] | None:
    """(step, seconds) of the newest committed checkpoint whose save time a run recorded (rank 0's
    `checkpoint_committed` event, `save_s`: staging to commit), None when the run has none."""
    found = [
        e
        for e in read_events(RunFiles(run_dir).events)
        if e.kind is EventKind.CHECKPOINT_COMMITTED and isinstance(e.get("save_s"), (int, float)) and e.step
    ]
    if not found:
        return None
    last = next((e for e in reversed(found) if e.rank == 0), found[-1])
    return int(last.step or 0), float(last.get("save_s"))


def preempt_grace_warning(grace_s: float, run_dir: Path) -> str | None:
    """A warning when `run_dir`'s last checkpoint took longer to save than `restarts.preemptGraceSeconds`:
    an emergency checkpoint would then not commit before the deadline (`torchrig validate --run-dir`)."""
    save = last_save(run_dir)
    if save is None or grace_s <= 0 or save[1] <= grace_s:
        return None
    step, seconds = save
    return (
        f"spec.restarts.preemptGraceSeconds: {grace_s:g} s is shorter than the last checkpoint save of "
        f"{run_dir} (step {step}: {seconds:.1f} s); an emergency checkpoint on SIGTERM would not commit in "
        "time and a preemption would lose the steps since the previous checkpoint"
    )


def preemption_reason(preempted: Mapping[str, Any]) -> str:
    """One line: where the run stopped and whether its emergency checkpoint committed."""
    step, grace = preempted.get("step"), preempted.get("grace_s")
    head = f"preempted ({preempted.get('signal') or 'signal'}) at step {step}"
    if preempted.get("committed"):
        return (
            f"{head}: emergency checkpoint committed in {preempted.get('save_s')} s "
            f"({preempted.get('since_signal_s')} s after the signal, grace {grace} s); run it again to resume"
        )
    why = {
        "deadline": f"the grace period ({grace} s) ran out first",
        "second_signal": "stopped at once by a second signal",
    }.get(str(preempted.get("reason")), "the save failed")
    return f"{head}: emergency checkpoint NOT committed ({why}); a new start resumes from the previous checkpoint"


def run_state(run_dir: Path) -> tuple[RunState, str, dict[str, Any]]:
    """State of a run from its directory: summary.json if finished, else the supervisor's liveness.

    Returns:
        The state, a message (why it failed or is unknown) and details (the summary, or the live
        supervisor's pid and the last metrics line).
    """
    files = RunFiles(run_dir)
    summary = read_json(files.summary)
    supervisor = read_json(files.supervisor) or {}
    raw_ticks = supervisor.get("start_ticks")
    ticks = None if raw_ticks is None else _int(raw_ticks) or -1  # junk there matches no process
    running = bool(supervisor) and alive(_int(supervisor.get("pid")) or -1, ticks)
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
    if files.summary.exists():
        return RunState.UNKNOWN, f"{files.summary} is damaged (not one JSON object of a readable size)", {}
    if supervisor:
        return RunState.UNKNOWN, "the supervising process is gone and wrote no summary", {}
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
            while line := fh.readline(MAX_LOG_LINE_CHARS):
                if not line.endswith("\n") and len(line) == MAX_LOG_LINE_CHARS:
                    # An endless line is not held whole: its first part, then skip to its end.
                    line += " [line truncated]"
                    while (rest := fh.readline(MAX_LOG_LINE_CHARS)) and not rest.endswith("\n"):
                        pass
                if rank is None:
                    yield line.rstrip("\n")
                    continue
                match = _RANK_PREFIX_RE.match(line)
                if match and int(match.group(1)) == rank:
                    yield line.rstrip("\n")


def rank_of_line(line: str) -> int | None:
    """The global rank of a `[rank<R>]:`-prefixed log line, None for an agent's own line."""
    match = _RANK_PREFIX_RE.match(line)
    return int(match.group(1)) if match else None


def error_line(log: Path | None, tail_bytes: int = 64 * 1024) -> str | None:
    """The last `torchrig: error: ...` line a worker wrote to `log` (its one-line account of a failure,
    `training.__main__`), without the prefix; None when there is none."""
    if log is None:
        return None
    try:
        with log.open("rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - tail_bytes))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    marker = "torchrig: error: "
    lines = [ln[ln.index(marker) + len(marker) :].strip() for ln in text.splitlines() if marker in ln]
    return lines[-1] if lines else None


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
