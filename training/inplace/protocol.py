"""In-place recovery as data: each role's states, what it observes, and the decision it takes.

The processes of in-place recovery (`training.inplace`) only carry decisions out: the per-rank host
(`training.inplace.host`), a member forming a new generation (`training.inplace.group`), a warm spare
(`training.inplace.spare`) and a standby node (`training.inplace.standby`) look at the store, their
children and the clock, put what they saw into an observation, and ask `decide_host` / `decide_form` /
`decide_spare` / `decide_standby` what to do; a trainer whose replicas disagreed (`training.sdc`) asks
`decide_sdc` whether it leaves, rolls back in place, or makes the group restart (and `decide_handover`
whether a ready standby node takes the suspect's whole node instead of a spare of that node). Every exit code a
recovery ends with is chosen here, so the policy can be read in one place, tested as a table and checked
by a deterministic simulation (`tests/unit/test_protocol_sim.py`), which drives these same functions with
a model store, an injected clock and fault schedules drawn at random.

The transitions are data too (`HOST_TRANSITIONS`, `SURVIVOR_TRANSITIONS`, `SPARE_TRANSITIONS`,
`STANDBY_TRANSITIONS`): `next_state` follows them, and `mermaid` draws them for docs/architecture.md (a
unit test keeps the drawing and the table equal). The survivor's table orders its phases
(`training.inplace.survivor`; its decisions are `decide_form`'s, whether a generation formed, and
`decide_sdc`'s, whether it reloads the newest certified checkpoint after re-wiring: ROLLBACK). Nothing
here imports torch, touches a process or the store, or reads time except through a `Clock`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, TypeVar

from training.contract import PERMANENT, ExitCode

__all__ = [
    "HOST_TRANSITIONS",
    "PASS_THROUGH",
    "REAL_CLOCK",
    "ROLLBACK_PATH",
    "SPARE_TRANSITIONS",
    "STANDBY_TRANSITIONS",
    "SURVIVOR_TRANSITIONS",
    "ClaimSpare",
    "Clock",
    "Decision",
    "FallBack",
    "FormObservation",
    "Formed",
    "HandOver",
    "HandoverObservation",
    "HostObservation",
    "HostState",
    "Join",
    "PassThrough",
    "Promote",
    "Ready",
    "RealClock",
    "Recovered",
    "RollBack",
    "RoundOver",
    "SdcObservation",
    "SpareObservation",
    "SpareState",
    "StandBy",
    "StandDown",
    "StandbyObservation",
    "StandbyState",
    "Stop",
    "SurvivorState",
    "Take",
    "Wait",
    "decide_form",
    "decide_handover",
    "decide_host",
    "decide_sdc",
    "decide_spare",
    "decide_standby",
    "gives_back_lost",
    "mermaid",
    "next_state",
]

# What a trainer's exit means beyond its host, passed on as it is: torchrun sees exactly what it would
# have seen without a host. A store unreadable at restore (205) is retried by the group as such, not as
# the in-place failure (203) a start-up crash becomes.
PASS_THROUGH: frozenset[int] = frozenset(
    {
        0,
        *PERMANENT,
        int(ExitCode.PREEMPTED),
        int(ExitCode.RECOVERY_FAILED),
        int(ExitCode.STORE_UNAVAILABLE),
        int(ExitCode.SDC_DETECTED),  # every replica may hold the corruption: no survivor to keep
    }
)


# `Recovery.path` of an in-place return to the newest certified checkpoint after an SDC (`RollBack`): what
# the drill report calls the recovery (beside `inplace` and `restart`).
ROLLBACK_PATH = "inplace-rollback"


class Clock(Protocol):
    """Where the protocol reads time and waits (the real one wraps `time`; the simulator's is a counter)."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class RealClock:
    """`time.monotonic` and `time.sleep`."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


REAL_CLOCK = RealClock()


# -- states -----------------------------------------------------------------------------------------
class HostState(Enum):
    """A per-rank host's states. `terminal`: the host has exited (its code is the decision's)."""

    TRAINING = "training"  # watching a trainer that has completed a step (or the first one, starting)
    CLAIMING = "claiming"  # its trainer died after a step: claiming a ready spare of the node
    WATCHING_SPARE = "watching spare"  # a replacement holds the rank and has not completed a step yet
    STANDING_BY = "standing by"  # a standby node's host: its child is a spare until the node is taken
    STOPPING = "stopping"  # a shutdown signal was forwarded: only the trainer's own exit code is awaited
    DONE = "done"

    @property
    def terminal(self) -> bool:
        return self is HostState.DONE


class SurvivorState(Enum):
    """A member's states from a failed collective back to training. `exit_code`: what the member's
    process exits with in that state (None: it goes on)."""

    LEAVE = "leave"  # cut the broken generation's connections, destroy its groups
    FORM = "form"  # join generation g+1 and wait until every rank has
    SYNC = "sync"  # take the newest state from the most advanced rank
    REWIRE = "rewire"  # new DDP wrapper, checkpoint manager, preemption group
    ROLLBACK = "rollback"  # after an SDC: every member reloads the newest certified checkpoint (collective)
    RESUMED = "resumed"  # training again, in generation g+1
    FAILED = "failed"  # the generation could not form: the group restarts

    @property
    def terminal(self) -> bool:
        return self in (SurvivorState.RESUMED, SurvivorState.FAILED)

    @property
    def exit_code(self) -> int | None:
        return int(ExitCode.RECOVERY_FAILED) if self is SurvivorState.FAILED else None


class SpareState(Enum):
    """A warm spare's states (`training.inplace.spare`)."""

    WARMING = "warming"  # importing, building the model, rehearsing a step
    READY = "ready"  # its pid is published: a host may claim it (compare-and-set of its claim key)
    ASSIGNED = "assigned"  # a host gave it a rank and a generation: it is that rank's trainer now
    ENDED = "ended"  # killed unclaimed (stuck, or its pool closed)

    @property
    def terminal(self) -> bool:
        return self in (SpareState.ASSIGNED, SpareState.ENDED)


class StandbyState(Enum):
    """A standby node's states (`training.inplace.standby`: a spare pod that takes a lost node's ranks)."""

    WAITING = "waiting"  # for a round of the job to run (its nodes beating) without this node
    WARMING = "warming"  # its hosts started, their spares warming; watching the round's nodes
    READY = "ready"  # every spare warm, counted ready (`InPlace.standbys_key`): it may take a lost node
    HOLDING = "holding"  # it took a lost node: its hosts are that node's hosts now
    DONE = "done"  # it exited, or its pod joins the rendezvous (`Join`)

    @property
    def terminal(self) -> bool:
        return self is StandbyState.DONE


# -- decisions --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wait:
    """Nothing to do yet: look again after a poll interval."""

    exit_code = None


@dataclass(frozen=True)
class Stop:
    """A shutdown signal arrived (it was forwarded to the trainer): wait for the trainer's own code."""

    exit_code = None


@dataclass(frozen=True)
class PassThrough:
    """Exit with the trainer's code, as torchrun would have seen it without a host."""

    code: int

    @property
    def exit_code(self) -> int:
        return self.code


@dataclass(frozen=True)
class ClaimSpare:
    """The trainer died after a step: count the rank lost and claim a ready spare of the node."""

    exit_code = None


@dataclass(frozen=True)
class Promote:
    """A spare was claimed (`pid`; 0 when a standby's own child takes the rank): assign it the rank and
    the next generation, and watch it from now on. To a spare (`decide_spare`): its assignment came, it is
    that rank's trainer now (`pid` 0: itself)."""

    pid: int

    exit_code = None


@dataclass(frozen=True)
class Recovered:
    """The replacement completed a step: the rank is no longer lost."""

    exit_code = None


@dataclass(frozen=True)
class Formed:
    """Every rank joined the generation. `announce`: this member says so for the last one (which joined
    and did not set the key: it died right after)."""

    announce: bool = False

    exit_code = None


@dataclass(frozen=True)
class FallBack:
    """In-place recovery cannot finish: exit `RECOVERY_FAILED`, torchrun restarts the group from the
    durable checkpoint."""

    reason: str

    @property
    def exit_code(self) -> int:
        return int(ExitCode.RECOVERY_FAILED)


@dataclass(frozen=True)
class RollBack:
    """The replicas disagreed and the majority named other ranks (`decide_sdc`): this survivor stays, re-forms
    the group with spares in the suspects' ranks and, once re-wired, reloads the newest certified checkpoint
    with every member (the majority's own state took the suspect's gradients in: it is consistent, not
    right). To a survivor's REWIRE: go on to ROLLBACK."""

    exit_code = None


@dataclass(frozen=True)
class HandOver:
    """To a host whose trainer left because a standby node takes this node's ranks (an SDC suspect's node,
    `decide_handover`): no spare of this node replaces it, the host exits 0 (its node's agent ends as a
    finished one, burning no restart) and writes no `ended` mark (the node's index lives on in the standby)."""

    exit_code = 0


@dataclass(frozen=True)
class StandDown:
    """A standby (a standby node, a standby host, a spare) ends without having taken a rank or a node:
    exit `code`. `reason`, when set, is said on stderr (it is no part of the decision's identity)."""

    code: int
    reason: str = field(default="", compare=False)

    @property
    def exit_code(self) -> int:
        return self.code


@dataclass(frozen=True)
class StandBy:
    """A round of the job runs without this node: start its hosts (one warm spare per local rank) and watch
    the round's nodes."""

    exit_code = None


@dataclass(frozen=True)
class Ready:
    """Every spare of this standby is warm: count it ready (`InPlace.standbys_key`), so that survivors
    forming a generation wait for it (`STANDBY_GRACE_S`)."""

    exit_code = None


@dataclass(frozen=True)
class Take:
    """Nodes `nodes` stopped beating without ending: take the first of them this standby wins (one
    compare-and-set per node against every other standby); losing every race is a `Wait`. `handover`: the
    node is an SDC suspect's, handed to a standby by the replicas' decision (`decide_handover`), alive: its
    processes leave on their own, its spares are not this standby's to mark, its agent passes torchrun's exit
    barrier itself."""

    nodes: tuple[int, ...]
    handover: bool = False

    exit_code = None


@dataclass(frozen=True)
class RoundOver:
    """The round ended without needing this standby (a group restart, every node gone): stop its hosts and
    stand by for the next round. `reason`, when set, is said on stderr."""

    reason: str = field(default="", compare=False)

    exit_code = None


@dataclass(frozen=True)
class Join:
    """A member's pod whose round no longer needs it as a standby: join the rendezvous (run torchrun's
    agent) after all. No exit code: the pod goes on."""

    reason: str = field(default="", compare=False)

    exit_code = None


Decision = (
    Wait
    | Stop
    | PassThrough
    | ClaimSpare
    | Promote
    | Recovered
    | Formed
    | FallBack
    | StandDown
    | StandBy
    | Ready
    | Take
    | RoundOver
    | Join
    | RollBack
    | HandOver
)


# -- observations -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostObservation:
    """What a host saw at one look.

    Attributes:
        exit_code: The watched trainer's exit status (a signal death is 128 + N); None while it runs.
        stepped: The watched trainer completed a step (`InPlace.stepped_key`).
        finished: The watched trainer completed its run (`InPlace.finished_key`).
        stopping: A shutdown signal (SIGTERM, SIGINT, SIGHUP) arrived.
        claimed_pid: CLAIMING: the pid of the ready spare this look claimed, if any.
        every_rank_lost: Every rank has lost its trainer (`InPlace.lost_key`): no survivor holds state.
        store_failed: A store request of this look failed (why).
        promoted: STANDING_BY: the standby took a lost node and this host's orders came.
        handed_over: The watched trainer left because a standby node takes this node's ranks
            (`InPlace.handed_over_key`, set by the trainer before it exits `SDC_SUSPECT`).
        elapsed_s: Time spent in the current state.
        timeout_s: `restarts.inPlaceTimeoutSeconds`.
    """

    exit_code: int | None = None
    stepped: bool = False
    finished: bool = False
    stopping: bool = False
    claimed_pid: int | None = None
    every_rank_lost: bool = False
    store_failed: str | None = None
    promoted: bool = False
    handed_over: bool = False
    elapsed_s: float = 0.0
    timeout_s: float = 60.0


@dataclass(frozen=True)
class FormObservation:
    """What a member forming generation `generation` saw at one look (`InPlaceGroup.form`).

    Attributes:
        generation: The generation being formed.
        world: The world size.
        rank: This member's rank.
        joined: The join counter (`InPlace.join_key`); None when not read at this look.
        formed: The formed key is set (the member whose join completed the count said so).
            `joined` reaching `world` without it: this member says so (the last one died after joining).
        owner: The pid that holds this rank (`InPlace.owner_key`), None when unset.
        seat: The pid that took this rank's seat in the generation (`InPlace.seat_key`, one compare-and-set
            per rank: the first join wins), None when not asked at this look. The owner's look and the
            join are two requests: a standby may give the rank to its own spare in between (the member's
            requests hung while its node was cut off), and only one of the two may join.
        pid: This process's pid.
        cancelled: A shutdown signal arrived while forming.
        nodes_lost: What a watcher found (`InPlace.nodes_lost_key`): a node whose beat stopped.
        elapsed_s: Time since this member joined.
        limit_s: How long the members may take (`restarts.inPlaceTimeoutSeconds`); the wait is twice it:
            a survivor blocked on a live peer learns of the failure only through its collective's timeout.
    """

    generation: int
    world: int
    rank: int = 0
    joined: int | None = None
    formed: bool = False
    owner: str | None = None
    seat: str | None = None
    pid: int = 0
    cancelled: bool = False
    nodes_lost: str | None = None
    elapsed_s: float = 0.0
    limit_s: float = 60.0


@dataclass(frozen=True)
class SpareObservation:
    """What a warm spare saw at one look (`training.inplace.spare`).

    Attributes:
        assigned: READY: a valid assignment signed by this job is in its `assign` key.
        store_failed: The store failed (why): WARMING, it could not be reached within the in-place timeout;
            READY, the wait for an assignment failed (the run ended, or the store was lost).
    """

    assigned: bool = False
    store_failed: str | None = None


@dataclass(frozen=True)
class StandbyObservation:
    """What a standby node saw at one look (`training.inplace.standby`).

    Attributes:
        stopping: The shutdown signal (SIGTERM, SIGINT) that arrived, if any.
        member: A member's pod (standing by only while its round runs without it), not a spare replica.
        round_running: WAITING: the recorded round's nodes are beating.
        job_over: The round's agents passed torchrun's exit barrier (the job ended).
        unreached_s: How long the store has not answered (0 when it answered at this look); None when it
            never answered.
        gone_after_s: The store unreachable this long: the job ended, or its master was lost.
        elapsed_s: WAITING: time spent waiting for a round.
        join_timeout_s: The rendezvous' `join_timeout` (a store never reached within it fails the pod, as
            torchrun's agent does).
        host_codes: The exit status of each of this standby's hosts (None while it runs).
        spares_ready: WARMING: every host's spare published its pid.
        nodes: The round's node count.
        lost: Nodes whose beat stopped (`group.NodeWatch`) and that did not end (`InPlace.ended_key`).
        ended: Nodes whose beat stopped after they ended.
        handed_over: A node the replicas handed to a standby after an SDC (`InPlace.handover_key`, signed) and
            that no standby took yet.
        new_round: HOLDING: the job's agents recorded a newer round than the one this standby joined (the
            group restarted without its nodes: its ranks, however complete, are no part of the job now).
        store_failed: A store request of this look failed (why).
    """

    stopping: int | None = None
    member: bool = False
    round_running: bool = False
    job_over: bool = False
    unreached_s: float | None = None
    gone_after_s: float = 10.0
    elapsed_s: float = 0.0
    join_timeout_s: float = 600.0
    host_codes: tuple[int | None, ...] = ()
    spares_ready: bool = False
    nodes: int = 0
    lost: tuple[int, ...] = ()
    ended: tuple[int, ...] = ()
    handed_over: int | None = None
    new_round: bool = False
    store_failed: str | None = None


@dataclass(frozen=True)
class SdcObservation:
    """What a trainer knows when its replicas disagreed (`training.sdc.SilentDataCorruption`).

    Attributes:
        rank: This rank.
        world: The world size.
        suspects: The ranks the fingerprints suspect.
        decided: A strict majority of each replica group agreed, so the suspects are the culprits; False
            with two replicas (no majority: both are suspects).
        in_place: The trainer recovers in place (an in-place host watches it, `restarts.mode` auto/inplace).
        sharded: FSDP/HSDP (its state lives in shards and in-memory replicas, not in every rank).
        node: This rank's node (`GROUP_RANK`).
        handed_over: The node the group's record hands to a standby node (`decide_handover`, one
            compare-and-set in the store for every rank); None: the suspects' ranks go to spares of their
            own nodes.
    """

    rank: int
    world: int
    suspects: tuple[int, ...]
    decided: bool
    in_place: bool
    sharded: bool = False
    node: int = 0
    handed_over: int | None = None


@dataclass(frozen=True)
class HandoverObservation:
    """What a rank knows when its replicas disagreed, to propose whether a standby node takes the suspects'
    node (`decide_handover`). Every rank proposes; the first proposal stored wins (one compare-and-set), so
    every rank acts on the same answer even where their reads of `standbys_ready` differed.

    Attributes:
        suspects: The ranks the fingerprints suspect.
        decided: A strict majority (or a replay) named them.
        world: The world size.
        nproc: Ranks per node (`LOCAL_WORLD_SIZE`; rank = node * nproc + local rank).
        standbys_ready: Standby nodes counted ready (`InPlace.standbys_key`).
        sharded: FSDP/HSDP (no in-place rollback: the group restarts).
    """

    suspects: tuple[int, ...]
    decided: bool
    world: int
    nproc: int
    standbys_ready: int
    sharded: bool = False


# -- policies ---------------------------------------------------------------------------------------
def decide_host(state: HostState, seen: HostObservation) -> Decision:
    """What a host does next in `state`, having seen `seen`."""
    if state is HostState.STANDING_BY:
        if seen.stopping:
            return StandDown(0)
        if seen.exit_code is not None:  # its spare died before the standby took a node
            return StandDown(seen.exit_code or int(ExitCode.RECOVERY_FAILED))
        return Promote(0) if seen.promoted else Wait()
    if state is HostState.STOPPING:
        return Wait() if seen.exit_code is None else PassThrough(seen.exit_code)
    if state is HostState.CLAIMING:
        # The trainer is dead; `exit_code` is what it died of.
        code = int(ExitCode.RECOVERY_FAILED) if seen.exit_code is None else seen.exit_code
        if seen.stopping:  # torchrun is stopping the group: no rank is recovered into a shutdown
            return PassThrough(code)
        if seen.claimed_pid is not None:
            return Promote(seen.claimed_pid)
        if seen.store_failed is not None:
            return FallBack(f"the store failed while claiming a spare ({seen.store_failed})")
        if seen.every_rank_lost:
            return FallBack("every rank lost its trainer: no survivor holds the state")
        if seen.elapsed_s > seen.timeout_s:
            return FallBack(f"no spare ready within {seen.timeout_s:g} s (restarts.inPlaceTimeoutSeconds)")
        return Wait()
    if state is HostState.DONE:
        raise ValueError("a host that is done decides nothing")
    # TRAINING or WATCHING_SPARE
    if state is HostState.WATCHING_SPARE and seen.stepped and seen.exit_code is None:
        return Recovered()
    if seen.exit_code is None:
        return Stop() if seen.stopping else Wait()
    if seen.stopping or seen.exit_code in PASS_THROUGH:
        return PassThrough(seen.exit_code)
    if seen.handed_over and seen.exit_code == int(ExitCode.SDC_SUSPECT):
        return HandOver()  # a standby node takes this node's ranks: no spare of this (suspect) node
    if seen.finished:
        # Its run was complete (the final checkpoint committed) before it died: a death in teardown (a
        # promoted spare killed with the host that started it) ends a finished rank, it leaves none to
        # replace; a replacement would form a generation the finished ranks never join.
        return PassThrough(0)
    if not seen.stepped:
        # A crash at start-up, a spare that fails at once: a spare would most likely fail the same way,
        # so the group restarts (bounded by restarts.max).
        return FallBack(f"the trainer exited {seen.exit_code} before completing a step")
    return ClaimSpare()


def gives_back_lost(state: HostState, seen: HostObservation) -> bool:
    """Whether a host takes its rank out of the lost count (`InPlace.lost_key`, once per rank: the mark
    `InPlace.rank_lost_key`), whoever counted it: its own trainer completed a step and runs, so the rank
    has a trainer (what the count says it lacks). The host that counted a rank gives it back when it ends
    or recovers it; one killed first (a standby's, its machine lost after it took a node that was only cut
    off from the store) cannot, and the node's own trainer trains on: its host, looking at the mark now and
    then (`restarts.inPlaceTimeoutSeconds` apart), gives the count back. A recovery of the rank still under
    way then counts one rank fewer until it ends (its own give-back finds no mark and takes nothing)."""
    return state is HostState.TRAINING and seen.exit_code is None and seen.stepped and not seen.stopping


def decide_sdc(seen: SdcObservation) -> Decision:
    """What a rank does once its replicas disagreed: `StandDown(SDC_SUSPECT)` (the majority named it: it
    leaves, its host gives its rank to a warm spare, as for any trainer dead after a step), `RollBack` (a
    survivor: it re-forms the group and reloads the newest certified checkpoint in place) or
    `PassThrough(SDC_DETECTED)` (the group restarts from the newest certified checkpoint: undecided, so no
    survivor is known good; every rank a suspect, so none would be left to roll back; no in-place host; or
    FSDP/HSDP, whose in-place recovery restores in-memory replicas of a step that may postdate the
    corruption).

    With standby nodes (`restarts.spareNodes`) the group may hand the suspects' node to a ready standby
    (`decide_handover`, `seen.handed_over`): every rank of that node leaves (`StandDown(SDC_SUSPECT)`, its
    host then hands over: `decide_host`'s `HandOver`), the standby's spares take the node's ranks, and the
    suspect hardware holds no rank of the job any more. Otherwise a suspect's rank goes to a spare of its own
    node (a rank's replacement runs where its host runs: the host watches its trainer by pid), which runs on
    the suspect hardware still; the `sdc` event says which (`replaced_by`). The node is named in the event
    (`suspect_hosts`), and once suspected twice in `quarantined_hosts`: keeping it out is the scheduler's
    (a Kubernetes taint, docs/operations.md)."""
    every_rank = set(range(seen.world)) <= set(seen.suspects)
    if not seen.decided or not seen.in_place or seen.sharded or not seen.suspects or every_rank:
        return PassThrough(int(ExitCode.SDC_DETECTED))
    if seen.handed_over is not None and seen.node == seen.handed_over:
        why = "the replicas' majority names this rank" if seen.rank in seen.suspects else "a rank of this node is"
        return StandDown(int(ExitCode.SDC_SUSPECT), f"{why} the suspect: a standby node takes node {seen.node}'s ranks")
    if seen.rank in seen.suspects:
        return StandDown(int(ExitCode.SDC_SUSPECT), "the replicas' majority names this rank: it leaves for a spare")
    return RollBack()


def decide_handover(seen: HandoverObservation) -> int | None:
    """The node a ready standby node takes after a replica disagreement, or None (the suspects' ranks go to
    spares of their own nodes, or the group restarts: `decide_sdc`).

    A node is handed over when the suspects are decided, all on one node, a standby is ready, and another
    node is left to hold survivors (a one-node job has none: its spares roll back on the same machine).
    Suspects on several nodes keep their nodes' spares: a standby takes one node."""
    if not seen.decided or seen.sharded or not seen.suspects or seen.standbys_ready < 1 or seen.nproc < 1:
        return None
    nodes = {rank // seen.nproc for rank in seen.suspects}
    if len(nodes) != 1 or seen.world // seen.nproc < 2 or set(range(seen.world)) <= set(seen.suspects):
        return None
    return nodes.pop()


def decide_form(seen: FormObservation) -> Decision:
    """What a member forming a generation does next: `Formed`, `FallBack` (the member raises
    `RecoveryFailed` and exits `RECOVERY_FAILED`) or `Wait`."""
    gen = seen.generation
    if seen.owner is not None and seen.owner != str(seen.pid):
        # This rank was given to another process meanwhile (a standby took this node while it was cut
        # off): joining beside it would put two processes in one rank.
        return FallBack(f"generation {gen}: rank {seen.rank} is held by pid {seen.owner} now; this process stands down")
    if seen.seat is not None and seen.seat != str(seen.pid):
        # Another process of this rank joined first (the owner's look and the join are two requests).
        return FallBack(f"generation {gen}: rank {seen.rank} was joined by {seen.seat} first; this process stands down")
    if seen.formed:
        return Formed()
    if seen.cancelled:
        return FallBack(f"generation {gen}: a shutdown signal arrived while forming")
    if seen.joined is not None and seen.joined >= seen.world:
        # Formed, though its last member did not say so (it died right after joining): say it for it.
        return Formed(announce=True)
    if seen.nodes_lost is not None:
        return FallBack(f"generation {gen}: {seen.nodes_lost}; nobody can bring their ranks back in place")
    if seen.elapsed_s > 2 * seen.limit_s:
        joined = "?" if seen.joined is None else str(seen.joined)
        return FallBack(
            f"generation {gen}: {joined} of {seen.world} ranks joined within {2 * seen.limit_s:g} s "
            "(2 x restarts.inPlaceTimeoutSeconds)"
        )
    return Wait()


def decide_spare(state: SpareState, seen: SpareObservation) -> Decision:
    """What a warm spare does next: `Wait` (WARMING: it published its pid, on to READY; READY: no valid
    assignment yet, a forged one is ignored), `Promote` (it takes the rank assigned) or `StandDown` (the
    store is gone: the spare ends as a failed worker, `TRAINING_FAILED`, with the store's error)."""
    if state.terminal:
        raise ValueError(f"a spare {state.value} decides nothing")
    if seen.store_failed is not None:
        return StandDown(int(ExitCode.TRAINING_FAILED))
    if state is SpareState.READY and seen.assigned:
        return Promote(0)
    return Wait()


def decide_standby(state: StandbyState, seen: StandbyObservation) -> Decision:
    """What a standby node does next in `state`, having seen `seen`."""
    if state.terminal:
        raise ValueError("a standby that is done decides nothing")
    if seen.stopping is not None:  # torchrun's shutdown (a held node's hosts get the signal, and are awaited)
        return StandDown(128 + seen.stopping)

    def round_over(reason: str = "") -> Decision:
        return Join(reason) if seen.member else RoundOver(reason)

    gone = seen.unreached_s is not None and seen.unreached_s > seen.gone_after_s
    if state is StandbyState.WAITING:
        if seen.round_running:
            return StandBy()
        if seen.job_over:  # a member's pod recreated as the job ended must not join a closed rendezvous
            return StandDown(0, "the job's agents passed torchrun's exit barrier; the job is over")
        if seen.member:
            return Join()  # no round runs: a member's pod is one of the next round's members
        if gone:  # the store, reached before, is gone: the job ended (or its launcher died)
            return StandDown(0, "the rendezvous store is gone; the job ended")
        if seen.unreached_s is None and seen.elapsed_s > seen.join_timeout_s:
            # As torchrun's agent fails then (`RendezvousTimeoutError`).
            return StandDown(
                1, f"the rendezvous store did not answer within the join timeout ({seen.join_timeout_s:.0f} s)"
            )
        return Wait()
    if state is StandbyState.HOLDING:
        if seen.new_round:
            # Standbys that took every node, one at a time, hold a complete generation the restarted round
            # knows nothing of: left running, it would train and commit checkpoints beside that round.
            return round_over("a new round of the job began without this standby's node; its ranks end")
        # Its hosts are the lost node's: it ends as that node's agent would.
        if any(code is None for code in seen.host_codes):
            return Wait()
        failed = [code for code in seen.host_codes if code]
        if not failed:
            return PassThrough(0)
        if all(code == int(ExitCode.RECOVERY_FAILED) for code in failed):
            return round_over()  # the group falls back to a restart: this round is over
        return PassThrough(next(code for code in failed if code != int(ExitCode.RECOVERY_FAILED)))
    # WARMING or READY: no node taken yet.
    if any(code is not None for code in seen.host_codes):
        # Its spares end with the store: at the job's end, or when the master was lost.
        if seen.job_over or seen.store_failed is not None:
            return StandDown(0)
        return round_over("a host of this standby ended before it was needed; starting over")
    if seen.store_failed is not None:
        return StandDown(0, "the rendezvous store is gone; the job ended") if gone else Wait()
    if seen.job_over:
        return StandDown(0)  # the job's agents finished: nothing left to stand by for
    if state is StandbyState.WARMING and seen.spares_ready:
        return Ready()
    if seen.handed_over is not None and state is StandbyState.READY:
        # Before the checks on ended nodes: the handed-over node's hosts leave (and its beat may stop).
        return Take((seen.handed_over,), handover=True)
    if seen.ended and len(seen.ended) + len(seen.lost) == seen.nodes:
        return round_over()  # every node ended
    if seen.lost and len(seen.lost) == seen.nodes:
        return round_over()  # every node stopped at once: a group restart, no node to take
    if seen.lost and state is StandbyState.READY:
        return Take(seen.lost)
    return Wait()


# -- transitions ------------------------------------------------------------------------------------
HOST_TRANSITIONS: Mapping[tuple[HostState, type], HostState] = {
    (HostState.STANDING_BY, Wait): HostState.STANDING_BY,
    (HostState.STANDING_BY, Promote): HostState.WATCHING_SPARE,
    (HostState.STANDING_BY, StandDown): HostState.DONE,
    (HostState.TRAINING, Wait): HostState.TRAINING,
    (HostState.TRAINING, Stop): HostState.STOPPING,
    (HostState.TRAINING, PassThrough): HostState.DONE,
    (HostState.TRAINING, FallBack): HostState.DONE,
    (HostState.TRAINING, ClaimSpare): HostState.CLAIMING,
    (HostState.TRAINING, HandOver): HostState.DONE,
    (HostState.CLAIMING, Wait): HostState.CLAIMING,
    (HostState.CLAIMING, Promote): HostState.WATCHING_SPARE,
    (HostState.CLAIMING, PassThrough): HostState.DONE,
    (HostState.CLAIMING, FallBack): HostState.DONE,
    (HostState.WATCHING_SPARE, Wait): HostState.WATCHING_SPARE,
    (HostState.WATCHING_SPARE, Recovered): HostState.TRAINING,
    (HostState.WATCHING_SPARE, Stop): HostState.STOPPING,
    (HostState.WATCHING_SPARE, PassThrough): HostState.DONE,
    (HostState.WATCHING_SPARE, FallBack): HostState.DONE,
    (HostState.WATCHING_SPARE, ClaimSpare): HostState.CLAIMING,
    (HostState.WATCHING_SPARE, HandOver): HostState.DONE,
    (HostState.STOPPING, Wait): HostState.STOPPING,
    (HostState.STOPPING, PassThrough): HostState.DONE,
}

SURVIVOR_TRANSITIONS: Mapping[tuple[SurvivorState, type], SurvivorState] = {
    (SurvivorState.LEAVE, Wait): SurvivorState.FORM,
    (SurvivorState.FORM, Wait): SurvivorState.FORM,
    (SurvivorState.FORM, Formed): SurvivorState.SYNC,
    (SurvivorState.FORM, FallBack): SurvivorState.FAILED,
    (SurvivorState.SYNC, Wait): SurvivorState.REWIRE,
    (SurvivorState.SYNC, FallBack): SurvivorState.FAILED,
    (SurvivorState.REWIRE, Wait): SurvivorState.RESUMED,
    (SurvivorState.REWIRE, RollBack): SurvivorState.ROLLBACK,
    (SurvivorState.REWIRE, FallBack): SurvivorState.FAILED,
    (SurvivorState.ROLLBACK, Wait): SurvivorState.RESUMED,
    (SurvivorState.ROLLBACK, FallBack): SurvivorState.FAILED,
}

SPARE_TRANSITIONS: Mapping[tuple[SpareState, type], SpareState] = {
    (SpareState.WARMING, Wait): SpareState.READY,
    (SpareState.WARMING, StandDown): SpareState.ENDED,
    (SpareState.READY, Wait): SpareState.READY,
    (SpareState.READY, Promote): SpareState.ASSIGNED,
    (SpareState.READY, StandDown): SpareState.ENDED,
}

STANDBY_TRANSITIONS: Mapping[tuple[StandbyState, type], StandbyState] = {
    (StandbyState.WAITING, Wait): StandbyState.WAITING,
    (StandbyState.WAITING, StandBy): StandbyState.WARMING,
    (StandbyState.WAITING, Join): StandbyState.DONE,
    (StandbyState.WAITING, StandDown): StandbyState.DONE,
    (StandbyState.WARMING, Wait): StandbyState.WARMING,
    (StandbyState.WARMING, Ready): StandbyState.READY,
    (StandbyState.WARMING, RoundOver): StandbyState.WAITING,
    (StandbyState.WARMING, Join): StandbyState.DONE,
    (StandbyState.WARMING, StandDown): StandbyState.DONE,
    (StandbyState.READY, Wait): StandbyState.READY,
    (StandbyState.READY, Take): StandbyState.HOLDING,
    (StandbyState.READY, RoundOver): StandbyState.WAITING,
    (StandbyState.READY, Join): StandbyState.DONE,
    (StandbyState.READY, StandDown): StandbyState.DONE,
    (StandbyState.HOLDING, Wait): StandbyState.HOLDING,
    (StandbyState.HOLDING, PassThrough): StandbyState.DONE,
    (StandbyState.HOLDING, RoundOver): StandbyState.WAITING,
    (StandbyState.HOLDING, Join): StandbyState.DONE,
    (StandbyState.HOLDING, StandDown): StandbyState.DONE,
}

S = TypeVar("S", HostState, SurvivorState, SpareState, StandbyState)


def next_state(table: Mapping[tuple[S, type], S], state: S, decision: Decision) -> S:
    """The state `decision` leads to from `state` in `table`.

    Raises:
        ValueError: `table` has no such transition (a policy decided something its role cannot do).
    """
    try:
        return table[(state, type(decision))]
    except KeyError:
        raise ValueError(f"no transition from {state.name} on {type(decision).__name__}") from None


def mermaid() -> str:
    """The four roles' state diagrams as one Mermaid block (docs/architecture.md holds its output)."""
    tables: list[tuple[str, Mapping[tuple[Any, type], Any], tuple[str, ...]]] = [
        ("host", HOST_TRANSITIONS, ("TRAINING", "STANDING_BY")),
        ("survivor", SURVIVOR_TRANSITIONS, ("LEAVE",)),
        ("spare", SPARE_TRANSITIONS, ("WARMING",)),
        ("standby", STANDBY_TRANSITIONS, ("WAITING",)),
    ]
    lines = ["```mermaid", "stateDiagram-v2"]
    for role, table, starts in tables:
        lines.append(f"    state {role} {{")
        lines.extend(f"        [*] --> {role}_{name}" for name in starts)
        for (source, kind), target in table.items():
            if kind is Wait and source == target:
                continue  # every state waits: a loop on each would only clutter the drawing
            label = "" if kind is Wait else f": {kind.__name__}"
            lines.append(f"        {role}_{source.name} --> {role}_{target.name}{label}")
        ends = {state.name for pair, target in table.items() for state in (pair[0], target) if state.terminal}
        lines.extend(f"        {role}_{name} --> [*]" for name in sorted(ends))
        lines.append("    }")
    lines.append("```")
    return "\n".join(lines)
