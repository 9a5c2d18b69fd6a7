"""`events.jsonl`: the run's history, one JSON object a line, written by every rank.

Each line is `{"time", "rank", "generation", "event", ...payload}`. `EventKind` names every kind the
worker writes and `DrillEventKind` every kind a drill adds to its report's timeline; the payload of
each worker kind is a dataclass below (its fields are the line's extra keys), so writers and readers
agree on one definition. Readers get `Event` objects from `read_events`, never raw strings to compare.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from training.contract.files import read_jsonl

__all__ = [
    "SDC_QUARANTINE_AFTER",
    "CheckpointCommitted",
    "CheckpointCorrupt",
    "CheckpointFenced",
    "CheckpointSkipped",
    "CheckpointStaged",
    "DrillEventKind",
    "Eval",
    "Event",
    "EventKind",
    "Fault",
    "Finished",
    "FirstStep",
    "MetricsExporter",
    "Preempted",
    "Profile",
    "Recovery",
    "Restore",
    "Sdc",
    "Stacks",
    "Start",
    "StepTimes",
    "StoreFailure",
    "Straggler",
    "Watchdog",
    "read_events",
    "sdc_quarantine",
]


class EventKind(str, enum.Enum):
    """What a worker writes into events.jsonl (the value is the line's `event`)."""

    START = "start"  # the process joined its group (every rank, every generation)
    RESTORE = "restore"  # state restored from a checkpoint
    CHECKPOINT_STAGED = "checkpoint_staged"  # a save was copied off the training state (training resumes)
    CHECKPOINT_COMMITTED = "checkpoint_committed"  # the manifest is written on every store that could take it
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # a save was skipped (the previous one still in flight)
    CHECKPOINT_FENCED = "checkpoint_fenced"  # a stale writer refused to commit
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"  # a restore candidate failed verification
    STORE_FAILURE = "store_failure"  # one store failed; training goes on
    FIRST_STEP = "first_step"  # the first step this process completed: after a restart, the end of recovery
    STEP_TIMES = "step_times"  # every logEvery steps: this rank's window means
    STRAGGLER = "straggler"  # rank 0: the slowest rank crossed metrics.stragglerThreshold (or fell back: -1)
    STACKS = "stacks"  # this rank dumped its Python stacks (the watchdog; before it exits)
    WATCHDOG = "watchdog"  # no step within stepTimeoutSeconds: the worker exits to be restarted
    FAULT = "fault"  # a drill fault fired inside the worker
    METRICS_EXPORTER = "metrics_exporter"  # the Prometheus exporter listens (port, url)
    EVAL = "eval"  # held-out metrics
    FINISHED = "finished"  # training reached its last step on this rank
    RECOVERY = "recovery"  # the group recovered from a lost rank: in place (spare) or by a group restart
    PREEMPTED = "preempted"  # SIGTERM (eviction, spot notice, Ctrl-C): stopped after an emergency checkpoint
    PROFILE = "profile"  # `metrics.profile`: this rank captured steps with torch.profiler (trace, table)
    SDC = "sdc"  # rank 0: the data-parallel replicas' fingerprints disagreed (`training.sdc`)

    def __str__(self) -> str:
        return self.value


class DrillEventKind(str, enum.Enum):
    """What a drill records in its report's timeline (not in events.jsonl)."""

    DRILL_STARTED = "drill_started"
    SUBMITTED = "submitted"  # kubernetes drill: the job was submitted
    RUNNING = "running"  # kubernetes drill: the job reached Running
    FAULT_INJECTED = "fault_injected"
    CHECKPOINT_DAMAGED = "checkpoint_damaged"
    DAMAGE_SKIPPED = "damage_skipped"
    SHRUNK = "shrunk"
    DID_NOT_SHRINK = "did_not_shrink"
    NODE_ADDED = "node_added"
    NETNS_CREATED = "netns_created"
    RECOVERED = "recovered"
    RESUBMITTED = "resubmitted"  # preempt drill: the preempted job was started again in its run directory

    def __str__(self) -> str:
        return self.value


# -- payloads: the keys each kind adds to its line -------------------------------------------------
@dataclass(frozen=True)
class Start:
    pid: int
    world_size: int
    node_rank: int
    local_rank: int
    node: str = ""
    kind: EventKind = field(default=EventKind.START, init=False, repr=False)


@dataclass(frozen=True)
class Restore:
    step: int
    store: str
    seconds: float
    source: str = "store"  # "store" | "node-local"
    certified: bool | None = None  # the manifest's `certified` (None: written without `sdc`)
    kind: EventKind = field(default=EventKind.RESTORE, init=False, repr=False)


@dataclass(frozen=True)
class CheckpointStaged:
    step: int
    blocked_s: float
    bytes: int = 0
    kind: EventKind = field(default=EventKind.CHECKPOINT_STAGED, init=False, repr=False)


@dataclass(frozen=True)
class CheckpointCommitted:
    step: int
    blocked_s: float
    save_s: float | None
    bytes: int = 0
    stores_ok: list[str] = field(default_factory=list)
    stores_failed: list[str] = field(default_factory=list)
    kind: EventKind = field(default=EventKind.CHECKPOINT_COMMITTED, init=False, repr=False)


@dataclass(frozen=True)
class CheckpointSkipped:
    step: int
    reason: str
    kind: EventKind = field(default=EventKind.CHECKPOINT_SKIPPED, init=False, repr=False)


@dataclass(frozen=True)
class CheckpointFenced:
    step: int
    store: str
    reason: str
    kind: EventKind = field(default=EventKind.CHECKPOINT_FENCED, init=False, repr=False)


@dataclass(frozen=True)
class CheckpointCorrupt:
    step: int
    store: str
    detail: str
    kind: EventKind = field(default=EventKind.CHECKPOINT_CORRUPT, init=False, repr=False)


@dataclass(frozen=True)
class StoreFailure:
    store: str
    error: str
    kind: EventKind = field(default=EventKind.STORE_FAILURE, init=False, repr=False)


@dataclass(frozen=True)
class FirstStep:
    step: int
    world_size: int
    kind: EventKind = field(default=EventKind.FIRST_STEP, init=False, repr=False)


@dataclass(frozen=True)
class StepTimes:
    """Window means of this rank: a straggler has the largest `compute_s`, the ranks waiting for it
    the largest `comm_s`."""

    step: int
    step_s: float
    comm_s: float
    compute_s: float
    kind: EventKind = field(default=EventKind.STEP_TIMES, init=False, repr=False)


@dataclass(frozen=True)
class Straggler:
    """Rank 0, when the straggler changes: `slow_rank` (-1: none any more) and its slowdown.

    A rank's slowdown is its compute time over the median rank's (`training.metrics.straggler`), in the
    window of `logEvery` steps that ends at `step`; `ratios` holds every rank's, by rank.
    """

    step: int
    slow_rank: int
    slowdown_ratio: float
    threshold: float
    ratios: list[float] = field(default_factory=list)
    kind: EventKind = field(default=EventKind.STRAGGLER, init=False, repr=False)


@dataclass(frozen=True)
class Sdc:
    """Rank 0: the replicas' fingerprints disagreed at `step` (`training.sdc`); the group restarts from the
    newest certified checkpoint.

    `suspects` are the ranks outside the majority, the ones a replay or the recompute's witnesses named
    (`decided`), or, when nothing told them apart (two ranks), every rank outside the largest group
    (`decided` false: `detail` says so); `suspect_hosts` their host names (a pod's name on Kubernetes);
    `fingerprints` every rank's, by rank (16 hex digits): of its replica, or, with `evidence` "recompute",
    of its own pre-reduce gradient.
    """

    step: int
    suspects: list[int]
    suspect_hosts: list[str]
    decided: bool
    fingerprints: list[str]
    last_agreed_step: int | None
    detail: str
    quarantined_hosts: list[str] = field(default_factory=list)  # `sdc_quarantine`: suspects seen before
    # Which fingerprints differed: "replica" (parameters and optimizer state) or "recompute" (a rank's own
    # pre-reduce gradient against its neighbour's recomputation of it: `recomputed`, by recomputing rank).
    evidence: str = "replica"
    recomputed: list[str] = field(default_factory=list)
    # Who takes the suspects' ranks in place: "standby" (a standby node, `restarts.spareNodes`, takes the
    # suspects' whole node: `excluded_node` is its index, `excluded_hosts` its host name; it holds no rank of
    # the job any more), "spare" (warm spares of the suspects' own nodes: the suspect hardware still runs the
    # ranks) or "" (a group restart).
    replaced_by: str = ""
    excluded_hosts: list[str] = field(default_factory=list)
    excluded_node: int | None = None
    kind: EventKind = field(default=EventKind.SDC, init=False, repr=False)


SDC_QUARANTINE_AFTER = 2  # `sdc` events naming a host before it is quarantined


def sdc_quarantine(events: Iterable[Event]) -> list[str]:
    """The hosts named among the suspects of at least SDC_QUARANTINE_AFTER `sdc` events: a device seen
    computing wrong twice should be kept out (drained, tainted) until it is tested. Untrusted input: a
    host that is not a string is skipped."""
    seen: dict[str, int] = {}
    for event in events:
        if event.kind != EventKind.SDC:
            continue
        hosts = event.get("suspect_hosts")
        for host in set(hosts) if isinstance(hosts, list) else ():
            if isinstance(host, str):
                seen[host] = seen.get(host, 0) + 1
    return sorted(h for h, n in seen.items() if n >= SDC_QUARANTINE_AFTER)


@dataclass(frozen=True)
class Stacks:
    """This rank dumped its Python stacks into `path` (`RunFiles.stack_file`), e.g. before the watchdog
    exits; `py_spy` and `flight_recorder` are the other dumps of the same moment, when there are."""

    step: int
    reason: str  # "watchdog" (no step for most of stepTimeoutSeconds)
    path: str
    py_spy: str | None = None
    flight_recorder: str | None = None
    kind: EventKind = field(default=EventKind.STACKS, init=False, repr=False)


@dataclass(frozen=True)
class Watchdog:
    step: int
    silent_s: float
    timeout_s: float
    phase: str = "step"  # "step", or "checkpoint_io" under `checkpoint.ioTimeoutSeconds` (`StepWatchdog.io`)
    kind: EventKind = field(default=EventKind.WATCHDOG, init=False, repr=False)


@dataclass(frozen=True)
class Fault:
    fault: str  # the fault kind (kill, hang, slow, slow_backward, exit, kill_during_checkpoint)
    step: int
    pid: int | None = None
    seconds: float | None = None
    kind: EventKind = field(default=EventKind.FAULT, init=False, repr=False)


@dataclass(frozen=True)
class MetricsExporter:
    port: int
    url: str
    local_rank: int
    kind: EventKind = field(default=EventKind.METRICS_EXPORTER, init=False, repr=False)


@dataclass(frozen=True)
class Eval:
    step: int
    metrics: dict[str, float]
    kind: EventKind = field(default=EventKind.EVAL, init=False, repr=False)


@dataclass(frozen=True)
class Finished:
    step: int
    final_loss: float | None
    wall_s: float
    kind: EventKind = field(default=EventKind.FINISHED, init=False, repr=False)


@dataclass(frozen=True)
class Preempted:
    """This rank stopped on a preemption notice (`training.preemption`).

    `step` is the stop step every rank agreed on (the last step trained); `committed` whether the
    emergency checkpoint of it reached a store (`stores_ok`), `save_s` how long it took, `since_signal_s`
    the time from the signal to this line, `grace_s` the budget (`restarts.preemptGraceSeconds`).
    `reason`: `saved`, `deadline` (the grace ran out first) or `second_signal` (asked to stop now).
    """

    step: int
    committed: bool
    reason: str
    signal: str
    grace_s: float
    since_signal_s: float
    save_s: float | None = None
    stores_ok: list[str] = field(default_factory=list)
    kind: EventKind = field(default=EventKind.PREEMPTED, init=False, repr=False)


@dataclass(frozen=True)
class Recovery:
    """The group is whole again after a failure (`training.inplace`).

    `path` is `inplace` (survivors kept their state, a warm spare took the dead ranks' places; written
    by every member of the new group) or `restart` (torchrun restarted the whole group and it restored
    from a checkpoint; written by rank 0 of the new generation). `step` is the last completed step the
    group resumes after, `inplace_generation` the process-group generation it formed, `seconds` from
    noticing the failure to the state being in sync (in place) or the restore's duration (restart).
    `source` says where the in-place state came from: `peer` (DDP: the most advanced survivor's state,
    no step lost) or `replica` (FSDP/HSDP: every member's in-memory snapshot of `step`, so the steps
    after it are recomputed: at most `checkpoint.inMemory.every`).
    """

    path: str  # "inplace" | "restart"
    step: int
    seconds: float
    inplace_generation: int = 0
    replaced_ranks: list[int] = field(default_factory=list)  # ranks a spare took over (in place)
    role: str = "survivor"  # "survivor" | "spare" (in place); "restarted" (restart)
    source: str = ""  # "peer" | "replica" (in place); "" (restart)
    # CPU seconds the recovering thread spent in the recovery (its own work, not the exporter's or
    # gloo's threads): against `seconds`, how much of the recovery was work and how much waiting (for
    # peers, for cores) (docs/performance.md, scaling).
    cpu_s: float | None = None
    # Seconds since the start of the recovery at which each phase ended, in order (in place): a
    # survivor's `destroyed` (the broken groups cut and destroyed) and `left` (the old checkpoint
    # manager and replica exchange abandoned); then everyone's `formed` (every member joined the new
    # generation), `state` (the state transfer done), `checkpoints` (the checkpoint manager rebuilt),
    # `preemption` (its agreement group re-formed). A spare's clock starts at its assignment.
    phases: dict[str, float] = field(default_factory=dict)
    # A spare: the modules it imported between its assignment and being ready to train (each one's
    # import is CPU inside the recovery that its warm-up should have paid; `training.inplace.spare`).
    imports: list[str] | None = None
    kind: EventKind = field(default=EventKind.RECOVERY, init=False, repr=False)


@dataclass(frozen=True)
class Profile:
    """This rank captured steps `first_step`..`last_step` with torch.profiler (`metrics.profile`).

    `trace` and `table` are the files it wrote (run-directory paths), `device_time_s` and `host_time_s`
    the total self time of the ops on the device (CUDA; 0 on a CPU) and on the host, `wall_s` the
    captured steps' wall time: a device time well below the wall time is a host-bound step.
    """

    first_step: int
    last_step: int
    trace: str
    table: str
    wall_s: float
    host_time_s: float
    device_time_s: float
    kind: EventKind = field(default=EventKind.PROFILE, init=False, repr=False)


Payload = (
    Start
    | Restore
    | CheckpointStaged
    | CheckpointCommitted
    | CheckpointSkipped
    | CheckpointFenced
    | CheckpointCorrupt
    | StoreFailure
    | FirstStep
    | StepTimes
    | Straggler
    | Sdc
    | Stacks
    | Watchdog
    | Fault
    | MetricsExporter
    | Eval
    | Finished
    | Recovery
    | Preempted
    | Profile
)


def payload_fields(payload: Payload) -> dict[str, Any]:
    """The keys a payload adds to its events.jsonl line (its `kind` is the line's `event`)."""
    data = asdict(payload)
    data.pop("kind", None)
    if isinstance(payload, Fault):
        # On the line the fault kind is `kind`, next to `event: fault` (the format readers know).
        data["kind"] = data.pop("fault")
        data = {k: v for k, v in data.items() if v is not None}
    return data


@dataclass(frozen=True)
class Event:
    """One line of events.jsonl as a reader sees it."""

    time: float
    rank: int
    generation: int
    kind: EventKind | str  # an unknown kind (a newer worker) stays a plain string
    data: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    @property
    def step(self) -> int | None:
        value = self.data.get("step")
        return value if isinstance(value, int) else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "rank": self.rank,
            "generation": self.generation,
            "event": str(self.kind),
            **self.data,
        }

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Event:
        data = {k: v for k, v in obj.items() if k not in ("time", "rank", "generation", "event")}
        raw = str(obj.get("event", ""))
        kind: EventKind | str
        try:
            kind = EventKind(raw)
        except ValueError:
            kind = raw
        rank = obj.get("rank", 0)
        generation = obj.get("generation", 0)
        return cls(
            time=_time_of(obj.get("time")),
            rank=rank if isinstance(rank, int) else 0,
            generation=generation if isinstance(generation, int) else 0,
            kind=kind,
            data=data,
        )


def _time_of(value: Any) -> float:
    """A line's `time`; a line is untrusted input, so anything but a finite number reads as 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    try:
        at = float(value)
    except OverflowError:  # an integer beyond any float
        return 0.0
    return at if math.isfinite(at) else 0.0


def read_events(path: str | os.PathLike[str]) -> list[Event]:
    """Every complete line of an events.jsonl, in time order."""
    return sorted((Event.from_dict(o) for o in read_jsonl(path)), key=lambda e: e.time)
