"""What a drill decides before anything runs, as plain typed values.

A scenario (`orchestrator.drills.scenarios`) turns a `DrillContext` into a `DrillPlan`: the patched
spec, the faults the workers inject into themselves (`training.faults.Fault`, carried in `Env.FAULTS`),
and the outside actions below, in order. `orchestrator.drills.actions` carries the actions out on the
running job and records what happened in an `Outcome`. Nothing here runs anything.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.drills.damage import CorruptionKind
from orchestrator.spec import JobSpec
from training.contract import DrillEventKind, Env
from training.faults import Fault

__all__ = [
    "Action",
    "AwaitCommit",
    "AwaitProgress",
    "AwaitStandby",
    "AwaitStep",
    "AwaitStoreFailure",
    "AwaitWorldSize",
    "DrillContext",
    "DrillEvent",
    "DrillOptions",
    "DrillPlan",
    "Fault",
    "LinkCut",
    "LinkHeal",
    "NodeAdd",
    "NodeKill",
    "Outcome",
    "Preempt",
    "RankKill",
    "ReleaseFaults",
    "StoreBack",
    "StoreCorrupt",
    "StoreLoss",
    "fault_dicts",
    "faults_env",
]


@dataclass(frozen=True)
class DrillOptions:
    """How to run a drill (the CLI flags)."""

    backend: str = "local"
    seed: int = 0
    at_step: int | None = None  # the fault's step (default: drawn from the seed)
    rank: int | None = None  # the rank hit (default: drawn from the seed)
    nodes: int | None = None  # emulated nodes (default: what the scenario needs)
    reference: bool = True  # also run the uninterrupted reference (the bit-exactness check)
    shared_reference: bool = False  # the reference runs the unpatched job: one per world size (campaigns)
    drill_dir: str | None = None
    timeout_s: float = 600.0  # per run, and per wait of an outside action
    quiet: bool = True
    corruption: CorruptionKind | None = None  # corrupt-checkpoint: which damage (default: drawn from the seed)
    hang_timeout_s: float = 10.0  # hang, partition: spec.restarts.stepTimeoutSeconds is at most this
    slow_s: float = 0.05  # straggler: seconds added to every step of the slow rank
    pace_s: float = 0.05  # kill-node, partition, sdc with a standby: seconds each rank sleeps a step (0: none)
    repeat: int = 1  # kill-worker: kills in a row, one after each checkpoint
    lose_store_hook: Callable[[str], None] | None = None  # lose-store: makes a non-file store unreachable
    store_back_hook: Callable[[str], None] | None = None  # lose-store-at-restart: brings a non-file store back


@dataclass(frozen=True)
class DrillContext:
    """What a scenario decides from: the job's shape and the fault drawn for this seed."""

    scenario: str
    seed: int
    steps: int
    world_size: int
    nodes: int
    checkpoint_every: int
    fault_step: int
    fault_rank: int
    options: DrillOptions = field(default_factory=DrillOptions)
    # `checkpoint.inMemory.every`: FSDP/HSDP in place returns to a snapshot at most this many steps back.
    in_memory_every: int | None = None
    sdc_every: int | None = None  # spec.sdc.every (the sdc drill turns an off one, 0, on at its default)
    sdc_replicas: int = 0  # ranks that hold each replica's bits: the world (DDP), the nodes (HSDP)
    in_place: bool = False  # spec.restarts recovers in place (a spare per node, not mode restart)
    sharded: bool = False  # FSDP/HSDP: its in-place state is in-memory snapshots, not every rank's
    standby: bool = False  # the job runs standby nodes (`restarts.spareNodes`, in place)
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    @property
    def checkpoint_at_fault(self) -> int:
        """The newest checkpoint step at or before the planned fault (at least the first one)."""
        every = self.checkpoint_every
        return max(every, (self.fault_step // every) * every)


# -- outside actions: what the drill does to the running job, in order --------------------------------
@dataclass(frozen=True)
class AwaitStep:
    """Wait until the job has reached `step`."""

    step: int


@dataclass(frozen=True)
class AwaitProgress:
    """Wait until the job has made `steps` more steps than when this action starts."""

    steps: int


@dataclass(frozen=True)
class AwaitCommit:
    """Wait until store `store` (an index into the spec's stores) holds a committed step >= `step`.

    When `required` and it never does, the drill records `damage_skipped` and stops its actions.
    """

    store: int
    step: int
    required: bool = False


@dataclass(frozen=True)
class AwaitWorldSize:
    """Wait until the newest world size is `size`; records `shrunk` or `did_not_shrink`."""

    size: int


@dataclass(frozen=True)
class StoreCorrupt:
    """Damage the newest committed checkpoint of store `store`."""

    store: int
    kind: CorruptionKind


@dataclass(frozen=True)
class StoreLoss:
    """Make store `store` unreachable (the fault of lose-store)."""

    store: int


@dataclass(frozen=True)
class StoreBack:
    """Bring back store `store`, which a `StoreLoss` made unreachable, with what it held."""

    store: int


@dataclass(frozen=True)
class AwaitStoreFailure:
    """Wait until the job records a `store_failure` of store `store`, after the fault, whose error begins
    with `prefix` (e.g. the restore giving up on a store it cannot list)."""

    store: int
    prefix: str


@dataclass(frozen=True)
class RankKill:
    """SIGKILL the live worker holding `rank`, from outside (a fault)."""

    rank: int


@dataclass(frozen=True)
class NodeKill:
    """Kill emulated node `node` (agent and workers); `fault`: this is the drill's fault, not cleanup."""

    node: int
    fault: bool = True


@dataclass(frozen=True)
class Preempt:
    """SIGTERM every process of emulated node `node` (None: of the whole job), as a node drain or a spot
    reclaim does, then SIGKILL what is left after `grace_s` (the kubelet's terminationGracePeriodSeconds)."""

    grace_s: float
    node: int | None = None


@dataclass(frozen=True)
class LinkCut:
    """Take the network link of emulated node `node` down (a partition; the drill's fault)."""

    node: int


@dataclass(frozen=True)
class LinkHeal:
    """Bring the link of emulated node `node` back up."""

    node: int


@dataclass(frozen=True)
class NodeAdd:
    """Start a replacement node that joins the running job."""


@dataclass(frozen=True)
class AwaitStandby:
    """Wait until a standby node of the run has its spares warm (`restarts.spareNodes`)."""

    fault: str = "node fault"  # what waits for it (the report's check names it)
    withheld: str = "no node was killed"  # what did not happen when no standby got ready


@dataclass(frozen=True)
class ReleaseFaults:
    """Create the run's fault gate (`RunFiles.fault_gate`): the workers' gated faults strike from their next step."""


Action = (
    AwaitStep
    | AwaitProgress
    | AwaitCommit
    | AwaitWorldSize
    | StoreCorrupt
    | StoreLoss
    | StoreBack
    | AwaitStoreFailure
    | RankKill
    | NodeKill
    | Preempt
    | LinkCut
    | LinkHeal
    | NodeAdd
    | AwaitStandby
    | ReleaseFaults
)


@dataclass(frozen=True)
class DrillPlan:
    """A scenario's decisions for one drill."""

    spec: JobSpec  # the faulted run's spec (validated)
    faults: tuple[Fault, ...] = ()  # injected by the workers themselves
    actions: tuple[Action, ...] = ()  # carried out from outside, in order, while the job runs
    fault_step: int = 0  # where the fault is aimed (outside faults record the step actually reached)
    fault_rank: int = 0
    network: bool = False  # the emulated nodes need their own network namespaces (partition)


def fault_dicts(faults: Sequence[Fault]) -> list[dict[str, Any]]:
    """The faults as `Env.FAULTS` lists them (`seconds` only where it matters)."""
    entries = []
    for fault in faults:
        entry = dataclasses.asdict(fault)
        if not fault.seconds:
            del entry["seconds"]
        if fault.kind != "bitflip":  # where a bitflip strikes; no other kind takes these keys
            for key in ("target", "tensor", "element", "bit"):
                del entry[key]
        for key in ("gated", "until_gate"):  # only where set
            if not entry[key]:
                del entry[key]
        entries.append(entry)
    return entries


def faults_env(faults: Sequence[Fault]) -> dict[str, str]:
    """The worker environment that carries `faults`: `Env.FAULTS`, the JSON list `training.faults` parses."""
    return {Env.FAULTS: json.dumps(fault_dicts(faults))} if faults else {}


# -- what happened ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DrillEvent:
    """One entry of the drill's own timeline (merged with the job's events in the report)."""

    time: float
    kind: DrillEventKind
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "event": str(self.kind), **self.data}


@dataclass
class Outcome:
    """What the drill did and where its fault struck (updated by the actions as they run)."""

    fault_step: int
    fault_rank: int | None
    timeline: list[DrillEvent] = field(default_factory=list)
    damage: dict[str, Any] | None = None
    errors: list[BaseException] = field(default_factory=list)
    # Why an outside fault proved nothing: it struck a job that had done every step (or already succeeded).
    too_late: str | None = None
    fault_node: int | None = None  # a node fault (kill-node, partition) names the node, not a rank

    def record(self, event: DrillEventKind, /, *, at: float | None = None, **data: Any) -> None:
        """Add `event` to the timeline, now or `at` a time the job's own records give."""
        self.timeline.append(DrillEvent(time.time() if at is None else at, event, data))

    def times(self, event: DrillEventKind) -> list[float]:
        return [e.time for e in self.timeline if e.kind is event]
