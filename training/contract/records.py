"""The records a run ends with: `result.json` (rank 0 of the worker) and `summary.json` (the backend).

Both are plain JSON objects on disk; these dataclasses are their one definition. `from_dict` accepts
files written by older versions (missing keys take their defaults, unknown keys are ignored).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from training.contract.events import Event, EventKind, read_events
from training.contract.files import RunFiles, append_jsonl, open_append, read_json, read_jsonl, write_json

__all__ = ["CheckpointSummary", "FinalCheckpoint", "Result", "RunStatusName", "Summary", "WorkerReport"]

RunStatusName = str  # "succeeded" | "failed" | "cancelled" | "preempted" (orchestrator.backends.base.RunState)


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass
class FinalCheckpoint:
    """The outcome of the final save (`checkpoint.saveFinal`): the only copy of the trained weights.

    Attributes:
        step: The step saved.
        committed: Whether at least one store committed it.
        stores_ok: The stores that committed it.
        stores_failed: Store name -> why it did not.
    """

    step: int
    committed: bool
    stores_ok: list[str] = field(default_factory=list)
    stores_failed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any) -> FinalCheckpoint | None:
        """From its JSON form; None for anything else (an older file has none)."""
        if not isinstance(data, dict) or not isinstance(data.get("step"), int):
            return None
        # Untrusted (result.json): keep only what has the declared types, so `reason()` cannot fail.
        ok, failed = data.get("stores_ok"), data.get("stores_failed")
        return cls(
            step=data["step"],
            committed=data.get("committed") is True,
            stores_ok=[s for s in ok if isinstance(s, str)] if isinstance(ok, list) else [],
            stores_failed={str(k): str(v) for k, v in failed.items()} if isinstance(failed, dict) else {},
        )

    @property
    def lost(self) -> bool:
        """No store holds it: the run's last steps exist nowhere once the process is gone."""
        return not self.committed

    def reason(self) -> str:
        """One line: which step no store took, and why each store failed."""
        why = "; ".join(f"{name}: {error}" for name, error in self.stores_failed.items()) or "no store answered"
        return f"the final checkpoint (step {self.step}) was committed to no store ({why})"


@dataclass
class Result:
    """`result.json`: what rank 0 of the worker group reports when training ends.

    Attributes:
        steps: Optimizer steps completed.
        final_loss: Mean over ranks of the last step's loss (None when it was not finite).
        eval: Held-out metrics (the task's `summarize`).
        params_sha256: SHA-256 of the full model state (bit-exactness checks compare it).
        world_size: World size at the end.
        samples_per_s: Global training throughput of this process's steps.
        wall_s: Seconds from the worker's start to the end.
        final_checkpoint: The final save's outcome (None: this process made none).
        device: The device rank 0 trained on (`cuda:0`, `cpu`).
        backend: The default process group's backend (`nccl` on GPUs, `gloo` on CPUs).
    """

    steps: int
    final_loss: float | None = None
    eval: dict[str, float] = field(default_factory=dict)
    params_sha256: str = ""
    world_size: int = 1
    samples_per_s: float | None = None
    wall_s: float = 0.0
    final_checkpoint: FinalCheckpoint | None = None
    device: str = ""
    backend: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        known = _known(cls, data)
        known["final_checkpoint"] = FinalCheckpoint.from_dict(known.get("final_checkpoint"))
        return cls(**known)

    def write(self, path: str | os.PathLike[str]) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Result | None:
        data = read_json(path)
        if data is None or not isinstance(data.get("steps"), int):
            return None
        return cls.from_dict(data)


@dataclass
class CheckpointSummary:
    """One store's last committed step, as the run's events recorded it."""

    name: str
    uri: str
    last_committed_step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Summary:
    """`summary.json`: the backend's account of the whole run (every restart included).

    Attributes:
        status: `succeeded`, `failed` or `cancelled`.
        steps: Steps reached (result.json, else the last metrics line).
        total_steps: Steps the job asked for.
        final_loss: The final training loss.
        eval: Held-out metrics.
        restarts: Restart generations the run went through.
        restored_from: `{store, step}` of every restore rank 0 made, in order.
        samples_per_s: Training throughput.
        wall_s: Seconds from launch to the end, measured by the backend.
        world_sizes: World sizes in the order the run went through them.
        params_sha256: SHA-256 of the final model state.
        run_dir: The run directory.
        checkpoints: Per store, the newest committed step.
        reason: Why it failed or was cancelled.
        failure_log: The log of the rank that failed last.
        final_checkpoint: The final save's outcome, from result.json (a run whose final checkpoint
            no store took has failed, `FinalCheckpoint.reason` says why).
        preempted: The run's last act was a preemption (status `preempted`): rank 0's `preempted` event,
            `{step, committed, reason, signal, grace_s, since_signal_s, save_s, stores_ok}`; the next
            start resumes from `step` when `committed`.
        worker_exit: A worker's permanent exit code (2: the spec or task to fix, 3: a setting, the machine
            or the checkpoints) that ended the run without a restart (`training.contract.exit_codes`).
        sdc: The replicas' disagreements (`training.sdc`), rank 0's `sdc` events: `{step, suspects,
            suspect_hosts, decided}` each, with `replaced_by` and `excluded_hosts` where the event has them (a
            standby node took the suspects' node: `excluded_hosts` holds no rank of the job any more) (absent
            when there was none).
        quarantined_hosts: Hosts named among the suspects of 2+ of them (`sdc_quarantine`): keep them out
            of the next jobs (cordon, a NoSchedule taint) until tested.
    """

    status: RunStatusName
    steps: int | None = None
    total_steps: int | None = None
    final_loss: float | None = None
    eval: dict[str, float] = field(default_factory=dict)
    restarts: int = 0
    restored_from: list[dict[str, Any]] = field(default_factory=list)
    samples_per_s: float | None = None
    wall_s: float = 0.0
    world_sizes: list[int] = field(default_factory=list)
    params_sha256: str | None = None
    run_dir: str = ""
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    reason: str | None = None
    failure_log: str | None = None
    final_checkpoint: FinalCheckpoint | None = None
    preempted: dict[str, Any] | None = None
    recoveries: dict[str, int] = field(default_factory=dict)  # recovery path -> count (`inplace`, `restart`)
    worker_exit: int | None = None
    sdc: list[dict[str, Any]] | None = None
    quarantined_hosts: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for optional in (
            "reason",
            "failure_log",
            "final_checkpoint",
            "preempted",
            "worker_exit",
            "sdc",
            "quarantined_hosts",
        ):
            if data[optional] is None:
                del data[optional]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        known = _known(cls, {"status": "unknown", **data})
        known["final_checkpoint"] = FinalCheckpoint.from_dict(known.get("final_checkpoint"))
        return cls(**known)

    def final_checkpoint_lost(self) -> bool:
        """The final save reached no store (`torchrig run` exits `EXIT_CHECKPOINT_LOST` for it)."""
        return self.final_checkpoint is not None and self.final_checkpoint.lost

    def write(self, path: str | os.PathLike[str]) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Summary | None:
        data = read_json(path)
        return None if data is None else cls.from_dict(data)

    def last_checkpoint(self) -> dict[str, Any] | None:
        """The store holding the newest committed checkpoint: `{name, uri, last_committed_step}`."""
        found = [c for c in self.checkpoints if c.get("last_committed_step") is not None]
        return max(found, key=lambda c: c["last_committed_step"]) if found else None


@dataclass
class WorkerReport:
    """What rank 0 hands a driver that does not share its run directory, when its worker ends.

    A RayJob's driver runs on the head pod and rank 0 on a worker pod, each with its own emptyDir
    run directory; Ray Train carries this record from rank 0 to the driver (`training.ray_train`),
    which writes it into its own run directory (`write_into`) before building summary.json. Only
    what the summary is built from travels: the rest (metrics.jsonl, the other ranks' events, step
    times, stack dumps, logs) stays on the worker pods.

    Attributes:
        result: rank 0's result.json (None: its worker ended without one).
        events: rank 0's `start` and `restore` lines and, of its `checkpoint_committed` lines, the
            newest one of each store (all summary.json needs), as `Event.to_dict` gives them.
        last_metrics: the last line of metrics.jsonl (the steps reached when there is no result).
    """

    SUMMARY_KINDS: ClassVar[tuple[EventKind, ...]] = (
        EventKind.START,
        EventKind.RESTORE,
        EventKind.CHECKPOINT_COMMITTED,
    )

    result: Result | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    last_metrics: dict[str, Any] | None = None

    @classmethod
    def collect(cls, run_dir: str | os.PathLike[str], *, result: Result | None, rank: int = 0) -> WorkerReport:
        """The report of `rank` from its run directory (its events.jsonl and metrics.jsonl)."""
        files = RunFiles(run_dir)
        mine = [e for e in read_events(files.events) if e.rank == rank and e.kind in cls.SUMMARY_KINDS]
        metrics = read_jsonl(files.metrics)
        return cls(
            result=result,
            events=[e.to_dict() for e in _newest_commits(mine)],
            last_metrics=metrics[-1] if metrics else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "result": None if self.result is None else self.result.to_dict(),
            "events": self.events,
            "last_metrics": self.last_metrics,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerReport:
        result = data.get("result")
        return cls(
            result=Result.from_dict(result)
            if isinstance(result, dict) and isinstance(result.get("steps"), int)
            else None,
            events=[e for e in data.get("events") or [] if isinstance(e, dict)],
            last_metrics=data.get("last_metrics") if isinstance(data.get("last_metrics"), dict) else None,
        )

    def write_into(self, run_dir: str | os.PathLike[str]) -> bool:
        """Write this report into a run directory that is not rank 0's; False (nothing written) when it is.

        A run directory with a result.json is rank 0's own (a local run, or a filesystem the nodes
        share): it has everything already. Otherwise result.json is written, the events are appended
        to events.jsonl (lines it holds already are skipped: a failed run's shared directory has
        them) and the last metrics line to an empty metrics.jsonl.
        """
        files = RunFiles(run_dir)
        if files.result.exists():
            return False
        if self.result is not None:
            self.result.write(files.result)
        present = {_line_key(o) for o in read_jsonl(files.events)}
        new = [e for e in self.events if _line_key(e) not in present]
        if new:
            fd = open_append(files.events)
            try:
                for event in new:
                    append_jsonl(fd, event)
            finally:
                os.close(fd)
        if self.last_metrics is not None and not read_jsonl(files.metrics):
            fd = open_append(files.metrics)
            try:
                append_jsonl(fd, self.last_metrics)
            finally:
                os.close(fd)
        return True


def _line_key(obj: dict[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


def _newest_commits(events: list[Event]) -> list[Event]:
    """`events` without the commits a summary does not need: per store, only the newest commit that
    includes it stays (a commit with no `stores_ok` counts for every store, as `build_summary` reads it)."""

    def stores(e: Event) -> list[str]:
        return [str(s) for s in e.get("stores_ok") or []] or ["*"]

    commits = [e for e in events if e.kind is EventKind.CHECKPOINT_COMMITTED and e.step is not None]
    newest: dict[str, int] = {}
    for e in commits:
        for name in stores(e):
            newest[name] = max(newest.get(name, -1), e.step or 0)
    kept = {id(e) for e in commits if any(newest[name] == e.step for name in stores(e))}
    return [e for e in events if e.kind is not EventKind.CHECKPOINT_COMMITTED or id(e) in kept]
