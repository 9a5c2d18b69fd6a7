"""A deterministic simulation of in-place recovery, driven by the policies the real processes run.

No process, socket, torch or wall clock: a model store (counters, signed orders, compare-and-set,
windows in which it refuses or stalls, machines cut off from it), a model clock, and for each node its
hosts, trainers and warm spares, and standby nodes, whose every choice is
`training.inplace.protocol`'s (`decide_host`, `decide_form`, and the transition tables). A schedule is a
short list of faults at given ticks (kill a trainer, a spare, a whole machine; a permanent bug; a
shutdown; a store that refuses or stalls; a machine cut off from the store, or from the store and its
peers, that comes back; a forged order; the run's end; a replica disagreement, `sdc`, whose suspect leaves
for a spare while the others roll back (with a standby ready, the suspect's whole node is handed to it:
`decide_handover`), or, with no majority, which restarts the group); after every tick the invariants are
checked:

- at most one member per rank per generation, and a generation forms only with every rank;
- no member of an old generation commits a checkpoint after a newer one formed (a commit is a
  collective of every member of an unbroken generation training at full size);
- a spare is claimed (or assigned by a standby) at most once;
- a rank whose trainer completed its run (its signed `finished` mark) is never replaced, and its host
  passes a later death on as 0;
- a host exits 0 only for a rank that completed its run, or whose node the replicas handed to a standby (its
  trainer's signed `handed-over` mark); a permanent code only after a permanent fault;
- every schedule ends, within a bound its timeouts give, in one of: every rank training again in a
  newer generation at full size, a group restart (a host exited and torchrun restarts the group), a
  permanent exit, a completed run (every rank's host exited 0), or a shutdown every host followed.

A failing schedule prints as a list of `Fault`s that `simulate` replays.

`python tests/unit/test_protocol_sim.py [seconds]` prints how many schedules a minute it runs (the bench's
`inplace_scale` section measures and checks the rate; this module's tests run a fixed number).
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from training.contract import ExitCode, is_retryable
from training.inplace.host import every_rank_lost_in
from training.inplace.protocol import (
    HOST_TRANSITIONS,
    SPARE_TRANSITIONS,
    STANDBY_TRANSITIONS,
    SURVIVOR_TRANSITIONS,
    ClaimSpare,
    FallBack,
    Formed,
    FormObservation,
    HandOver,
    HandoverObservation,
    HostObservation,
    HostState,
    PassThrough,
    Promote,
    Ready,
    Recovered,
    RollBack,
    RoundOver,
    SdcObservation,
    SpareObservation,
    SpareState,
    StandbyObservation,
    StandbyState,
    StandDown,
    Stop,
    SurvivorState,
    Take,
    Wait,
    decide_form,
    decide_handover,
    decide_host,
    decide_sdc,
    decide_spare,
    decide_standby,
    gives_back_lost,
    next_state,
)

DT = 0.05  # one tick of model time; a node beats once a tick (`BEAT_S` of the model)
TIMEOUT_S = 0.5  # restarts.inPlaceTimeoutSeconds of the model
HOST_LOST_S = 0.3  # a beat that stood still this long: its node is lost (`HOST_LOST_S`, 3 s, scaled)
BEHIND_LOST_S = 0.1  # ... this long while every rank of its node is behind (`BEHIND_LOST_S`, 1 s, scaled)
STANDBY_GRACE_S = 0.3  # how much longer members wait for a lost node while a standby is ready
WATCH_STALL_S = 0.1  # a watcher whose looks were this far apart starts its clocks over (`NodeWatch`)
POOL_RETRY_S = 0.5  # a spare pool whose tick failed tries again this much later (`host.POOL_RETRY_S`, 5 s)
EXIT_WAIT_S = 0.1  # a promoted spare's exit code not published this long after its death: a crash
OP_TIMEOUT_S = TIMEOUT_S  # a request of a machine cut off from the store fails after this long
COMMIT_EVERY = 5  # ticks between the checkpoint commits of a generation training at full size
MAX_TICK = 40  # the last tick a fault may come at
MAX_TARGET = 999  # a fault's target is read modulo what it picks from
# Every schedule ends this long after its last fault (a partition's end counts as one): a claim
# (TIMEOUT_S), a forming generation (2 x TIMEOUT_S plus a standby's grace), a second recovery after it,
# a stall, and the warm-up of a spare started meanwhile.
SETTLE_S = 10 * TIMEOUT_S
KINDS = (
    "kill_trainer",
    "kill_spare",
    "kill_node",
    "bug",
    "shutdown",
    "store_refuse",
    "store_stall",
    "partition",
    "forge",
    "finish",
    "sdc",
)
KILLED = 128 + 9
# Every host ends this soon after torchrun's SIGTERM (its own grace is 30 s): one cut off from the store ends
# when its request times out.
STOP_GRACE_S = 2 * TIMEOUT_S + OP_TIMEOUT_S


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule: at `tick`, `kind` on `target` (an index the kind reads modulo its range).

    `partition`: machine `target % machines` cannot reach the store for `2 + target // 7 % 19` ticks, and
    with an odd `target // 3` its peers either (a network cut, not only the store's). `finish`: the run
    reaches its last step (every rank marks itself finished, then exits 0, `target` staggering the exits).
    """

    tick: int
    kind: str
    target: int = 0


@dataclass(frozen=True)
class World:
    nodes: int = 2
    nproc: int = 2
    spares: int = 1
    warm_ticks: int = 3  # a spare's start-up (import, model, rehearsal)
    standbys: int = 0  # standby nodes (`restarts.spareNodes`), each with `nproc` spares


class StoreDown(Exception):
    pass


class Violation(AssertionError):
    pass


class KnownDefect(Violation):
    """A violation of a kind `KNOWN_DEFECTS` names: a defect of the real code (outside the policies) that
    the simulator models faithfully, reported (`simulate(strict=False)`) until it is fixed."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"known defect {name}: {detail}")
        self.name = name


KNOWN_DEFECTS: dict[str, str] = {}


@dataclass
class Store:
    """The long-lived c10d store: signed orders (value, signed), counters, compare-and-set.

    `unreachable`: the request's machine is cut off from it and its wait timed out (set by `Sim` for one
    actor's look)."""

    orders: dict[str, tuple[str, bool]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    refused: list[tuple[float, float]] = field(default_factory=list)
    stalled: list[tuple[float, float]] = field(default_factory=list)
    now: float = 0.0
    ops: int = 0
    unreachable: bool = False

    def _op(self) -> None:
        self.ops += 1
        if self.unreachable:
            raise StoreDown("timed out (cut off)")
        for start, end in self.refused:
            if start <= self.now < end:
                raise StoreDown("refused")

    def stall_end(self) -> float:
        """When a request sent now returns (the server's one loop held up: later than now in a stall)."""
        for start, end in self.stalled:
            if start <= self.now < end:
                return end
        return self.now

    def add(self, key: str, n: int) -> int:
        self._op()
        self.counters[key] = self.counters.get(key, 0) + n
        return self.counters[key]

    def multi_add0(self, keys: list[str]) -> list[int]:
        """`multi_get` of counters: one request."""
        self._op()
        return [self.counters.get(key, 0) for key in keys]

    def check(self, key: str) -> bool:
        self._op()
        return key in self.orders

    def read(self, key: str) -> str | None:
        """`InPlace.read`: None when absent or not signed by this job."""
        self._op()
        value = self.orders.get(key)
        return value[0] if value is not None and value[1] else None

    def multi_read(self, keys: list[str]) -> list[str | None]:
        """`multi_get` of orders, each opened (`nodes_behind`): one request."""
        self._op()
        return [v[0] if (v := self.orders.get(key)) is not None and v[1] else None for key in keys]

    def write(self, key: str, value: str) -> None:
        self._op()
        self.orders[key] = (value, True)

    def delete(self, key: str) -> bool:
        """`delete_key`: whether the key was there."""
        self._op()
        return self.orders.pop(key, None) is not None

    def forge(self, key: str, value: str) -> None:
        self.orders[key] = (value, False)

    def read_free(self, key: str) -> str | None:
        """(The simulator's own look, no request.) `read`."""
        value = self.orders.get(key)
        return value[0] if value is not None and value[1] else None

    def signed(self, key: str) -> bool:
        """(The simulator's own look, no request.) Whether `key` holds an order this job signed."""
        value = self.orders.get(key)
        return value is not None and value[1]

    def compare_set(self, key: str, value: str) -> bool:
        """`compare_set(key, "", value)`: whether this call set it."""
        self._op()
        if key in self.orders:
            return False
        self.orders[key] = (value, True)
        return True


@dataclass
class Proc:
    """A trainer or a spare process."""

    pid: int
    node: int  # the node whose keys it uses
    machine: int  # where it runs (what a lost machine or a partition takes)
    rank: int | None  # None: a spare not assigned yet
    parent: int  # the index of the host that started it (`PR_SET_PDEATHSIG`: it dies with that host)
    spare: int | None = None  # its index among the node's spares
    spare_state: SpareState | None = None
    ready_tick: int = 0
    warm_since: float = 0.0
    alive: bool = True
    code: int | None = None
    stepped: bool = False
    gen: int = 0
    survivor: SurvivorState | None = None  # None: training in `gen`
    rollback: bool = False  # its recovery ends in ROLLBACK (a replica disagreement's survivor)
    phase: int = 0  # FORM: 0 looks at the rank's owner, 1 joins (a tick later), 2 waits for the others
    form_start: float = 0.0
    cancellable: bool = True  # its `form` asks for a shutdown signal (a survivor's; a promoted spare's is not)
    stopping: bool = False
    exit_tick: int | None = None  # it finished its run and exits 0 at this tick
    watch: dict[int, tuple[int, float]] | None = None  # a beat watcher's (`NodeWatch`) counters
    watch_after: float = HOST_LOST_S
    watch_behind: bool = True
    last_look: float = 0.0
    blocked_since: float | None = None
    busy_until: float = 0.0


@dataclass
class Host:
    rank: int | None  # None: a standby's host not promoted yet
    node: int
    machine: int
    local: int
    state: HostState
    pid: int  # the process it watches
    alive: bool = True
    stopping: bool = False
    claim_start: float = 0.0
    dead_code: int | None = None
    seen_dead: float | None = None
    exit: int | None = None
    busy_until: float = 0.0
    blocked_since: float | None = None
    pool: bool = False  # it keeps its node's spare pool (local rank 0)
    pool_after: float = 0.0  # a store error in its pool's tick: the next one comes then (`POOL_RETRY_S`)
    next_index: int = 0  # the index its pool's next spare takes
    first_index: int = 0
    first_pid: int = 0  # the trainer it started with (its pool waits for its first step)
    children: list[Proc] = field(default_factory=list)  # the processes it started
    standby: int | None = None  # the standby node it belongs to
    replaced: int | None = None  # a promoted standby host: the host that held its rank before
    counted: bool = False  # it counted its rank lost (`lost` + 1) and has not taken it back
    blind: bool = False  # at its last look the store could not tell it whether its trainer stepped or finished
    lost_look_at: float = TIMEOUT_S  # when it next looks at its rank's lost mark (`gives_back_lost`)
    stepped_pid: int = 0  # the trainer it saw stepped at such a look


@dataclass
class StandbyNode:
    """A standby node (`training.inplace.standby.Standby`): its hosts, its node watch, its state."""

    slot: int
    node: int  # its own node index (its spares' keys), past the members'
    machine: int
    hosts: list[int]
    state: StandbyState = StandbyState.WARMING
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)
    last_look: float = 0.0
    alive: bool = True
    stopping: bool = False
    reached: float = 0.0  # when the store last answered it
    blocked_since: float | None = None
    busy_until: float = 0.0


Actor = Proc | Host | StandbyNode


class Sim:
    def __init__(self, world: World, faults: list[Fault]) -> None:
        self.w = world
        self.world = world.nodes * world.nproc
        self.machines = world.nodes + world.standbys
        self.faults = sorted(faults, key=lambda f: f.tick)
        self.store = Store()
        self.t = 0.0
        self.tick_no = 0
        self.procs: dict[int, Proc] = {}
        self.hosts: list[Host] = []
        self.holder: dict[int, int] = {}  # rank -> the index of the host that holds it now
        self.next_pid = 100
        self.members: dict[int, dict[int, set[int]]] = {0: {r: set() for r in range(self.world)}}
        self.formed: set[int] = {0}
        self.broken: set[int] = set()
        self.whole: set[int] = set()  # generations found whole since the last death, departure or tick
        self.claims: dict[tuple[int, int], int] = {}
        self.published: set[int] = set()  # spares whose exit code their pool wrote
        self.cut_store: dict[int, float] = {}  # machine -> when its cut from the store ends
        self.cut_peers: dict[int, float] = {}  # machine -> when its cut from the other machines ends
        self.finishing: int | None = None  # the run reached its last step (the fault's target)
        self.finish_marked = False
        self.shutdown_at: float | None = None
        self.permanent_fault = False
        self.outcome: str | None = None
        self.ending: str | None = None  # what the first failed host's exit means; the outcome once all ended
        self.stop_by: float | None = None
        self.log: list[str] = []
        self.standbys: list[StandbyNode] = []
        self.new_round = False  # torchrun's agents met in a new rendezvous round (after `ending`)
        self.giving_back: list[tuple[Host, float]] = []  # exited standby hosts still giving a count back
        self.lost_since: float | None = None  # every rank trains since then, with a lost count above 0
        nproc = world.nproc
        for rank in range(self.world):
            node = rank // nproc
            self.hosts.append(Host(rank, node, node, rank % nproc, HostState.TRAINING, 0, pool=rank % nproc == 0))
            proc = self._start(node, node, rank, rank)
            self.hosts[rank].pid = self.hosts[rank].first_pid = proc.pid
            self.holder[rank] = rank
            self.members[0][rank].add(proc.pid)
            self.store.orders[f"rank{rank}/gen"] = ("0", True)
        for slot in range(world.standbys):
            node = world.nodes + slot
            standby = StandbyNode(slot, node, node, [])
            for local in range(nproc):
                index = len(self.hosts)
                self.hosts.append(Host(None, node, node, local, HostState.STANDING_BY, 0, standby=slot))
                self.hosts[index].pid = self._start(node, node, None, index, spare=local).pid
                standby.hosts.append(index)
            self.standbys.append(standby)

    # -- processes ------------------------------------------------------------------------------
    def _start(self, node: int, machine: int, rank: int | None, parent: int, spare: int | None = None) -> Proc:
        self.next_pid += 1
        proc = Proc(self.next_pid, node, machine, rank, parent)
        if rank is None:
            proc.spare, proc.spare_state = spare, SpareState.WARMING
            proc.ready_tick, proc.warm_since = self.tick_no + self.w.warm_ticks, self.t
        self.procs[proc.pid] = proc
        if parent < len(self.hosts):
            self.hosts[parent].children.append(proc)
        return proc

    def _die(self, proc: Proc, code: int) -> None:
        if proc.alive:
            proc.alive, proc.code = False, code
            self.whole.clear()

    def holding(self, rank: int) -> int:
        """The index of the host that holds `rank`: the newest one that took it, unless it has ended (a
        standby's host whose spare never stepped, a standby machine lost): then the one before it."""
        index = self.holder[rank]
        while (host := self.hosts[index]).replaced is not None and (not host.alive or host.exit is not None):
            index = host.replaced
        return index

    def current(self, rank: int) -> Proc:
        return self.procs[self.hosts[self.holding(rank)].pid]

    def newest(self) -> int:
        return max(self.formed)

    # -- faults ---------------------------------------------------------------------------------
    def _apply(self, fault: Fault) -> None:
        kind, n = fault.kind, fault.target
        self.log.append(f"t={self.t:.2f} {kind} {n}")
        if kind == "kill_trainer":
            self._die(self.current(n % self.world), KILLED)
        elif kind == "bug":
            proc = self.current(n % self.world)
            if proc.alive and proc.exit_tick is None:
                self.permanent_fault = True
                self._die(proc, int(ExitCode.TASK_INVALID))
        elif kind == "kill_spare":
            spares = [p for p in self.procs.values() if p.spare is not None and p.alive]
            if spares:
                self._die(spares[n % len(spares)], KILLED)
        elif kind == "kill_node":
            machine = n % self.machines
            for host in self.hosts:
                if host.alive and host.machine == machine:
                    host.alive = False
            for proc in self.procs.values():
                if proc.machine == machine:  # PR_SET_PDEATHSIG: the machine's children die with its hosts
                    self._die(proc, KILLED)
            for standby in self.standbys:
                standby.alive = standby.alive and standby.machine != machine
        elif kind == "shutdown":
            self._stop_all(everyone=True)
        elif kind in ("store_refuse", "store_stall"):
            window = (self.t, self.t + DT * (1 + n % 12))
            (self.store.refused if kind == "store_refuse" else self.store.stalled).append(window)
        elif kind == "partition":
            machine, end = n % self.machines, self.t + DT * self._partition_ticks(n)
            self.cut_store[machine] = max(end, self.cut_store.get(machine, 0.0))
            if n // 3 % 2:
                self.cut_peers[machine] = max(end, self.cut_peers.get(machine, 0.0))
        elif kind == "forge":
            self._forge(n)
        elif kind == "finish":
            self.finishing = n if self.finishing is None else self.finishing
        elif kind == "sdc":
            self._sdc(n)

    def _sdc(self, n: int) -> None:
        """The replicas' fingerprints disagree at a check (a collective of the newest generation training at
        full size; none runs while a recovery is in flight). Rank `n % world` is the odd one out: with three
        or more replicas the majority names it, with two it is undecided. Each member acts on `decide_sdc`."""
        newest = self.newest()
        members = [self.current(rank) for rank in range(self.world)]
        if not all(
            p.alive and p.survivor is None and p.stepped and p.gen == newest and p.exit_tick is None and not p.stopping
            for p in members
        ):
            return
        suspect, decided = n % self.world, self.world >= 3
        suspects = (suspect,) if decided else tuple(range(self.world))
        handed = self._handover(suspects, decided, newest)
        for proc in members:
            assert proc.rank is not None
            node = proc.rank // self.w.nproc
            seen = SdcObservation(proc.rank, self.world, suspects, decided, True, node=node, handed_over=handed)
            decision = decide_sdc(seen)
            if isinstance(decision, RollBack):
                proc.survivor, proc.rollback = SurvivorState.LEAVE, True  # it leaves the group itself
                self.whole.clear()
            else:
                assert decision.exit_code is not None
                if handed is not None and isinstance(decision, StandDown) and not self._cut(proc.machine):
                    with contextlib.suppress(StoreDown):  # `mark_handed_over`: best effort
                        self.store.write(f"handed-over/{proc.pid}", "1")
                self._die(proc, decision.exit_code)

    def _handover(self, suspects: tuple[int, ...], decided: bool, gen: int) -> int | None:
        """`InPlaceGroup.sdc_handover`: the node a ready standby takes, one compare-and-set for every rank (the
        model asks once: the first proposal stored is every rank's), then the record the standbys read."""
        try:
            ready = self.store.add("standbys", 0)
            proposal = decide_handover(HandoverObservation(suspects, decided, self.world, self.w.nproc, ready))
            key = f"gen{gen}/sdc-handover"
            self.store.compare_set(key, str(-1 if proposal is None else proposal))
            held = self.store.read(key)
            node = int(held) if held is not None else -1
            if node < 0:
                return None
            self.store.write("sdc/handover", f"{node},{gen}")
        except StoreDown:
            return None
        return node

    @staticmethod
    def _partition_ticks(n: int) -> int:
        return 2 + n // 7 % 19

    def _forge(self, n: int) -> None:
        """An order written by someone without the job's secret (no MAC, or a MAC that does not check):
        every reader must act as if it were not there."""
        node, rank, gen = n % self.w.nodes, n % self.world, self.newest() + 1
        spawned = self.store.counters.get(f"node{node}/spawned", 0)
        pid = self.current(rank).pid
        standby = self.w.nodes + n % max(1, self.w.standbys)
        keys = [
            (f"node{node}/spare{spawned}/ready", "1"),  # a ready spare that is not one
            (f"node{node}/spare{n % max(1, spawned)}/assign", f"{rank},{gen}"),
            (f"rank{rank}/owner", "1"),
            (f"node{node}/spare{n % max(1, spawned)}/claim", "0"),  # that spare is unusable
            (f"gen{gen}/nodes-lost", "node 0 (forged)"),
            (f"exit/{pid}", "0"),
            (f"stepped/{pid}", "1"),
            (f"finished/{pid}", "1"),  # a forged end of the run: the rank's death must still be recovered
            (f"node{node}/ended", "1"),  # a lost node that looks ended: no standby takes it
            (f"node{node}/taker/{self.store.counters.get(f'node{node}/beat', 0)}", "standby9"),
            (f"node{standby}/host{n % self.w.nproc}/promote", f"{node},0,{rank}"),  # a standby's forged orders
        ]
        key, value = keys[n % len(keys)]
        if key not in self.store.orders:
            self.store.forge(key, value)

    # -- one tick -------------------------------------------------------------------------------
    def run(self) -> str:
        faults = list(self.faults)
        last = max(
            (f.tick * DT + (DT * self._partition_ticks(f.target) if f.kind == "partition" else 0.0) for f in faults),
            default=0.0,
        )
        while self.outcome is None:
            self.store.now = self.t
            self.whole.clear()
            while faults and faults[0].tick <= self.tick_no:
                self._apply(faults.pop(0))
            if self.ending is not None and all(h.exit is not None for h in self.hosts if h.alive and h.standby is None):
                # Every member's agent stopped its workers (by the last tick): they meet again in a new
                # rendezvous round, whose record is what a standby holding a node looks at.
                self.new_round = True
            for proc in list(self.procs.values()):
                if proc.alive:
                    self._step_proc(proc)
            for host, until in list(self.giving_back):
                if host.alive and self.t <= until and self._answered(host) and not self._cut(host.machine):
                    self._uncount_lost(host)
                if host.counted is False or not host.alive or self.t > until:
                    self.giving_back.remove((host, until))
            for index, host in enumerate(self.hosts):
                if host.alive and host.exit is None:
                    self._step_host(index, host)
            for standby in self.standbys:
                if standby.alive and standby.state not in (StandbyState.DONE, StandbyState.WAITING):
                    self._step_standby(standby)
            self._finish_run()
            ranked = [h for h in self.hosts if h.rank is not None and h.alive]
            if all(h.exit is not None for h in ranked) and (self.ending or self.finish_marked):
                self.outcome = self.ending or "completed"
            elif self.stop_by is not None and self.t > self.stop_by:
                late = [h for h in ranked if h.exit is None and h.standby is None]
                if late:
                    detail = f"a host still runs {STOP_GRACE_S:g} s after torchrun stopped the group: "
                    raise Violation(detail + self._describe())
            if self.outcome is None and self.tick_no % COMMIT_EVERY == 0:
                self._commit()
            self._check()
            if self.outcome is None and not any(h.exit is None for h in ranked) and self.ending is None:
                self.outcome = "every node lost"  # no agent is left: the platform starts the job again
            if self.outcome is None and self.ending is None and not faults and self._settled():
                self.outcome = f"resumed in generation {self.newest()}"
            self.t = round(self.t + DT, 6)
            self.tick_no += 1
            if self.outcome is None and self.t > last + SETTLE_S:
                raise Violation(f"no end {SETTLE_S:g} s after the last fault: {self._describe()}")
        return self.outcome

    def _stop_all(self, *, everyone: bool) -> None:
        """SIGTERM to every host torchrun started (its shutdown, or its stop of the group after a worker
        ended), forwarded to the process each watches now. A standby's hosts are no agent's workers: they
        get the signal only when their own pod does (`everyone`: the job is shut down)."""
        self.shutdown_at = self.t if self.shutdown_at is None and everyone else self.shutdown_at
        self.stop_by = self.t + STOP_GRACE_S if self.stop_by is None else self.stop_by
        for host in self.hosts:
            if everyone or host.standby is None:
                host.stopping = True
                self.procs[host.pid].stopping = True
        if everyone:
            for standby in self.standbys:
                standby.stopping = True

    def _exited(self, index: int, host: Host, *, handed_over: bool = False) -> None:
        """A host exited with `host.exit`: its children die with it (`PR_SET_PDEATHSIG`; its pool's
        unclaimed spares with the pool), and torchrun's agent acts on the code. `handed_over`: its node went
        to a standby after an SDC (`HandOver`): no `ended` mark, and its 0 is no completed run's."""
        code = host.exit
        assert code is not None
        proc = self.procs[host.pid]
        if host.counted:  # `run_host`'s finally: its rank is no longer its to recover
            self._uncount_lost(host)
            if host.counted and host.standby is not None:
                # A standby's host tries again until the in-place timeout (its end ends no round: the count
                # would stay taken); a member's host ends the round, whose count is gone with it.
                self.giving_back.append((host, self.t + TIMEOUT_S))
        for child in host.children:
            self._die(child, KILLED)
        if host.local == 0 and host.rank is not None and not handed_over:  # this node ended: no standby takes it
            with contextlib.suppress(StoreDown):
                self.store.write(f"node{host.node}/ended", "1")
        if host.standby is not None:
            # A standby's host is no agent's worker: its standby ends as `decide_standby` says, and the
            # members learn of its end from their collectives. The rank is its previous holder's again.
            return
        if code != 0 and not host.stopping and not host.blind and self.store.signed(f"finished/{proc.pid}"):
            # (Blind, a host falls back: a group restart that finds the run complete, never a replacement.)
            raise Violation(f"rank {host.rank}'s trainer finished its run; its host passed its death on as {code}")
        if self.ending is not None:
            return
        if code == 0:
            handed = self.store.signed(f"handed-over/{proc.pid}")
            if handed and proc.code != ExitCode.SDC_SUSPECT:
                raise Violation(f"rank {host.rank}'s host handed over after its trainer exited {proc.code}")
            if proc.code != 0 and not self.store.signed(f"finished/{proc.pid}") and not handed:
                raise Violation(f"rank {host.rank} exited 0 while training")
            return  # it completed its run: torchrun waits for the other workers
        stopped = self.shutdown_at is not None
        self._stop_all(everyone=False)  # torchrun's agent stops the group
        if stopped:
            self.ending = f"shutdown ({code})"
        elif not is_retryable(code):
            if not self.permanent_fault:
                raise Violation(f"rank {host.rank} exited {code} (permanent) after infrastructure faults only")
            self.ending = f"permanent ({code})"
        else:
            self.ending = f"group restart ({code})"

    def _settled(self) -> bool:
        if not self._training():
            self.lost_since = None
            return False
        if self.store.counters.get("lost", 0) != 0:
            # Every rank trains: a count its holder did not give back is given back at a look of the host
            # whose trainer trains (`gives_back_lost`, `TIMEOUT_S` apart; one may hang on a cut that long).
            self.lost_since = self.t if self.lost_since is None else self.lost_since
            if self.t - self.lost_since > TIMEOUT_S + OP_TIMEOUT_S + DT:
                marks = [self.store.read_free(f"rank{r}/lost") for r in range(self.world)]
                count = self.store.counters.get("lost")
                raise Violation(f"every rank trains again, but the lost count is {count}: {marks}")
            return False
        return True

    def _training(self) -> bool:
        """Whether every rank trains at full size in the newest generation, its holder alone holding it."""
        if self.finishing is not None or self.giving_back:
            return False
        newest = self.newest()
        holders = {self.holding(rank) for rank in range(self.world)}
        for index, host in enumerate(self.hosts):
            if host.rank is not None and host.alive and host.exit is None and index not in holders:
                return False  # a host whose rank another holds now (its node came back): not over yet
        for rank in range(self.world):
            host = self.hosts[self.holding(rank)]
            proc = self.procs[host.pid]
            if not host.alive or host.state is not HostState.TRAINING or not proc.alive:
                return False
            if proc.survivor is not None or proc.gen != newest or not proc.stepped:
                return False
        return True

    def _finish_run(self) -> None:
        """The run's last step (`finish`): once every rank trains at full size in the newest generation,
        each marks itself finished (best effort: `mark_finished` ignores a store error) and exits 0 a few
        ticks later, in an order the fault's target gives."""
        if self.finishing is None or self.finish_marked or self.ending is not None:
            return
        newest = self.newest()
        procs = [self.current(rank) for rank in range(self.world)]
        if self._gen_broken(newest) or not all(
            p.alive and p.survivor is None and p.stepped and p.gen == newest and not p.stopping for p in procs
        ):
            return
        for rank, proc in enumerate(procs):
            if not self._cut(proc.machine):
                with contextlib.suppress(StoreDown):
                    self.store.write(f"finished/{proc.pid}", "1")
            proc.exit_tick = self.tick_no + 1 + (self.finishing + rank) % 3
        self.finish_marked = True

    # -- reaching the store ------------------------------------------------------------------------
    def _cut(self, machine: int) -> bool:
        return self.cut_store.get(machine, -1.0) > self.t

    def _look(self, actor: Actor, look: Callable[[], None], *, talks: bool = True) -> None:
        """One look of `actor`'s, which sends requests to the store when `talks`: not while the store's loop
        is stalled or while its machine's requests hang (`_reach`)."""
        if talks:
            if not self._answered(actor):
                return
            reach = self._reach(actor)
            if reach is None:
                return
            self.store.unreachable = not reach
        try:
            look()
        finally:
            self.store.unreachable = False

    def _answered(self, actor: Actor) -> bool:
        """Whether the store's loop answers `actor` now (in a stall, its request is answered when the loop
        runs again: it does nothing until then)."""
        if actor.busy_until > self.t:
            return False
        if (end := self.store.stall_end()) > self.t:
            actor.busy_until = end
            return False
        return True

    def _reach(self, actor: Actor) -> bool | None:
        """Whether `actor`'s requests of this look reach the store (True), hang (None: it does nothing this
        tick; the request completes, late, once the cut ends) or time out (False: every one fails)."""
        if not self._cut(actor.machine):
            actor.blocked_since = None
            return True
        if actor.blocked_since is None:
            actor.blocked_since = self.t
        if self.t - actor.blocked_since < OP_TIMEOUT_S:
            return None
        actor.blocked_since = self.t
        return False

    # -- trainers and spares --------------------------------------------------------------------
    def _gen_broken(self, gen: int) -> bool:
        """Whether generation `gen`'s collectives fail: a member died, left for a newer generation, or is
        cut off from the others."""
        if gen in self.broken:
            return True
        if gen in self.whole:
            return False
        ranks = self.members.get(gen, {})
        machines: set[int] = set()
        for pids in ranks.values():
            for pid in pids:
                proc = self.procs[pid]
                if not proc.alive or proc.gen != gen or proc.survivor is SurvivorState.LEAVE:
                    self.broken.add(gen)
                    return True
                machines.add(proc.machine)
        if len(machines) > 1 and any(self.cut_peers.get(m, -1.0) > self.t for m in machines):
            self.broken.add(gen)
            return True
        self.whole.add(gen)
        return False

    def _step_proc(self, proc: Proc) -> None:
        if proc.exit_tick is not None:
            if self.tick_no >= proc.exit_tick:
                self._die(proc, 0)
            return
        if proc.survivor is None and proc.rank is not None and proc.stepped:
            self._proc_look(proc)  # training: it sends the store no request
        elif proc.survivor is SurvivorState.FORM and proc.blocked_since is None and proc.busy_until <= self.t:
            if not self._form_cancelled(proc):  # (asked before its next request: none is in flight)
                self._look(proc, lambda: self._proc_look(proc))
        else:
            self._look(proc, lambda: self._proc_look(proc))

    def _proc_look(self, proc: Proc) -> None:
        if proc.spare_state is SpareState.WARMING:
            if self.tick_no < proc.ready_tick:
                return
            try:
                self.store.write(f"node{proc.node}/spare{proc.spare}/ready", str(proc.pid))
                seen = SpareObservation()
            except StoreDown as exc:
                if self.t - proc.warm_since < TIMEOUT_S:
                    return  # it tries again until the in-place timeout
                seen = SpareObservation(store_failed=str(exc))
            decision = decide_spare(proc.spare_state, seen)
            proc.spare_state = next_state(SPARE_TRANSITIONS, proc.spare_state, decision)
            if isinstance(decision, StandDown):
                self._die(proc, decision.exit_code)
            return
        if proc.spare_state is SpareState.READY:
            orders = None
            try:
                orders = self.store.read(f"node{proc.node}/spare{proc.spare}/assign")
                seen = SpareObservation(assigned=orders is not None)
            except StoreDown as exc:
                seen = SpareObservation(store_failed=str(exc))
            decision = decide_spare(proc.spare_state, seen)
            proc.spare_state = next_state(SPARE_TRANSITIONS, proc.spare_state, decision)
            if isinstance(decision, StandDown):
                self._die(proc, decision.exit_code)
            elif isinstance(decision, Promote):
                assert orders is not None
                rank, gen = (int(x) for x in orders.split(","))
                proc.rank = rank
                self._enter_form(proc, gen, cancellable=False)  # `worker.py`: `form` without `cancelled`
            return
        if proc.rank is None:
            return
        if proc.survivor is None:
            if proc.stopping:
                self._die(proc, int(ExitCode.PREEMPTED))  # stops at an agreed step, after its emergency save
            elif self._gen_broken(proc.gen):
                proc.survivor = SurvivorState.LEAVE  # its collective failed: a peer is gone
                self.whole.clear()
            elif not proc.stepped and all(
                self.procs[next(iter(pids))].survivor is None and self.procs[next(iter(pids))].gen == proc.gen
                for pids in self.members[proc.gen].values()
                if pids
            ):
                try:
                    self.store.write(f"stepped/{proc.pid}", "1")
                except StoreDown:
                    self._die(proc, int(ExitCode.TRAINING_FAILED))
                    return
                proc.stepped = True
            return
        if proc.survivor is SurvivorState.LEAVE:
            proc.survivor = next_state(SURVIVOR_TRANSITIONS, proc.survivor, Wait())
            self._enter_form(proc, proc.gen + 1)
        elif proc.survivor is SurvivorState.FORM:
            self._form(proc)
        elif proc.survivor in (SurvivorState.SYNC, SurvivorState.REWIRE, SurvivorState.ROLLBACK):
            # Collective with every member: a death during it is an exception the member turns into a
            # fall-back (`Trainer._recover_in_place`). A rollback's survivor goes on from REWIRE to reload
            # the certified checkpoint with every member (`survivor.recover`).
            decision: FallBack | Wait | RollBack = Wait()
            if self._gen_broken(proc.gen):
                decision = FallBack("a member died while syncing")
            elif proc.survivor is SurvivorState.REWIRE and proc.rollback:
                decision = RollBack()
            proc.survivor = next_state(SURVIVOR_TRANSITIONS, proc.survivor, decision)
            self._survivor_end(proc)

    def _survivor_end(self, proc: Proc) -> None:
        if proc.survivor is SurvivorState.FAILED:
            assert proc.survivor.exit_code is not None
            self._die(proc, proc.survivor.exit_code)
        elif proc.survivor is SurvivorState.RESUMED:
            proc.survivor, proc.rollback = None, False

    def _enter_form(self, proc: Proc, gen: int, *, cancellable: bool = True) -> None:
        proc.survivor, proc.gen, proc.form_start, proc.phase, proc.watch = SurvivorState.FORM, gen, self.t, 0, None
        proc.cancellable = cancellable
        self._form_cancelled(proc)  # `form` asks before its first request

    def _form_cancelled(self, proc: Proc) -> bool:
        """`InPlaceGroup.form`'s look at its `cancelled` (a local flag, no request) before each store request:
        a member told to stop falls back without sending one. Whether it did."""
        if not (proc.cancellable and proc.stopping):
            return False
        assert proc.rank is not None
        decision = decide_form(FormObservation(proc.gen, self.world, proc.rank, pid=proc.pid, cancelled=True))
        assert isinstance(decision, FallBack), decision
        self._fail_form(proc, decision)
        return True

    def _fail_form(self, proc: Proc, decision: FallBack) -> None:
        proc.survivor = next_state(SURVIVOR_TRANSITIONS, SurvivorState.FORM, decision)
        self._survivor_end(proc)

    def _form(self, proc: Proc) -> None:
        """`InPlaceGroup.form`, one request at a look: the owner's look, then the join (other actors act in
        between, as between two round trips), then the wait."""
        assert proc.rank is not None
        gen, rank = proc.gen, proc.rank
        if proc.phase == 0:  # the owner's look
            try:
                owner = self.store.read(f"rank{rank}/owner")
            except StoreDown:
                self._die(proc, int(ExitCode.RECOVERY_FAILED))
                return
            look = FormObservation(gen, self.world, rank, owner=owner, pid=proc.pid, limit_s=TIMEOUT_S)
            if isinstance(decision := decide_form(look), FallBack):
                self._fail_form(proc, decision)
                return
            proc.phase = 1
            return
        if proc.phase == 1:
            try:
                self.store.write(f"rank{rank}/gen", str(gen))
                seat_key = f"join/{gen}/rank{rank}"  # `InPlace.seat_key`: the first join of the rank wins
                won = self.store.compare_set(seat_key, str(proc.pid)) or self.store.read_free(seat_key) == str(proc.pid)
                seat = str(proc.pid) if won else f"pid {self.store.read_free(seat_key)}"
                look = FormObservation(gen, self.world, rank, seat=seat, pid=proc.pid, limit_s=TIMEOUT_S)
                if isinstance(decision := decide_form(look), FallBack):
                    self._fail_form(proc, decision)
                    return
                joined = self.store.add(f"join/{gen}", 1)
                self.members.setdefault(gen, {r: set() for r in range(self.world)})[rank].add(proc.pid)
                proc.phase, proc.last_look = 2, self.t
                if isinstance(decide_form(FormObservation(gen, self.world, rank, joined=joined)), Formed):
                    self.store.write(f"join/{gen}/formed", "1")
                elif rank in (0, self.world - 1):  # the two watchers of the nodes' beats
                    standby = self.store.add("standbys", 0) > 0
                    proc.watch = {}
                    proc.watch_after = HOST_LOST_S + (STANDBY_GRACE_S if standby else 0.0)
                    proc.watch_behind = not standby
            except StoreDown:
                self._die(proc, int(ExitCode.RECOVERY_FAILED))
            return
        try:
            if proc.watch is not None and (
                gone := self._watch(proc, proc.watch_after, gen if proc.watch_behind else -1)
            ):
                self.store.compare_set(f"gen{gen}/nodes-lost", f"node(s) {gone} stopped beating")
            joined = self.store.add(f"join/{gen}", 0)
            seen = FormObservation(
                gen,
                self.world,
                rank,
                joined=joined,
                formed=self.store.check(f"join/{gen}/formed"),
                cancelled=proc.stopping,
                nodes_lost=None if joined >= self.world else self.store.read(f"gen{gen}/nodes-lost"),
                elapsed_s=self.t - proc.form_start,
                limit_s=TIMEOUT_S,
            )
        except StoreDown:
            seen = FormObservation(
                gen, self.world, rank, cancelled=proc.stopping, elapsed_s=self.t - proc.form_start, limit_s=TIMEOUT_S
            )
        decision = decide_form(seen)
        if isinstance(decision, Formed):
            if decision.announce:
                with contextlib.suppress(StoreDown):
                    self.store.write(f"join/{gen}/formed", "1")
            self.formed.add(gen)
        proc.survivor = next_state(SURVIVOR_TRANSITIONS, SurvivorState.FORM, decision)
        self._survivor_end(proc)

    def _watch(self, who: Proc | StandbyNode, after: float, behind_gen: int | None) -> list[int]:
        """`NodeWatch.lost`: the member nodes whose beat stood still `after`, or `BEHIND_LOST_S` while every
        rank of theirs is behind (`nodes_behind` of `behind_gen`, None: the newest any rank joined; -1: not
        asked). One `multi_get` of the beats, one of the ranks' generations when a node is quiet."""
        seen = who.watch if isinstance(who, Proc) else who.seen
        assert seen is not None
        if self.t - who.last_look > WATCH_STALL_S:
            seen.clear()  # this watcher was held up: no clock to trust yet
        who.last_look = self.t
        keys = [f"node{n}/beat" for n in range(self.w.nodes)]
        counts = self.store.multi_add0(keys)
        if not all(key in self.store.counters for key in keys):
            return []
        gone, quiet = [], []
        for node, count in enumerate(counts):
            before = seen.get(node)
            if before is None or before[0] != count:
                seen[node] = (count, self.t)
            elif self.t - before[1] >= after:
                gone.append(node)
            elif self.t - before[1] >= BEHIND_LOST_S:
                quiet.append(node)
        if quiet and behind_gen != -1:
            behind = self._behind(behind_gen)
            gone = sorted([*gone, *(n for n in quiet if n in behind)])
        return gone

    def _behind(self, generation: int | None) -> set[int]:
        """`group.nodes_behind`: the nodes every rank of which is behind `generation`."""
        opened = self.store.multi_read([f"rank{r}/gen" for r in range(self.world)])
        known = [int(v) for v in opened if v is not None and v.isdigit()]
        newest = (max(known) if known else 0) if generation is None else generation
        joined = [int(v) if v is not None and v.isdigit() else newest for v in opened]
        nproc = self.w.nproc
        return {n for n in range(self.w.nodes) if all(g < newest for g in joined[n * nproc : (n + 1) * nproc])}

    # -- hosts ----------------------------------------------------------------------------------
    def _step_host(self, index: int, host: Host) -> None:
        if host.state is HostState.TRAINING and not host.pool and not host.stopping and self.procs[host.pid].alive:
            if self.t >= host.lost_look_at:  # now and then, its rank's lost mark
                self._look(host, lambda: self._lost_look(host))
            return  # it sees nothing but a running trainer: `decide_host` says Wait
        talks = host.pool or host.state not in (HostState.TRAINING, HostState.STOPPING)
        # Once stopping, only the trainer's own exit code is awaited: no request (`run_host`'s `asks`).
        dead = not self.procs[host.pid].alive and host.state is not HostState.STOPPING
        self._look(host, lambda: self._host_look(index, host), talks=talks or dead)

    def _host_look(self, index: int, host: Host) -> None:
        if host.state is HostState.STANDING_BY:
            self._standing_by(index, host)
            return
        if host.pool:
            with contextlib.suppress(StoreDown):  # cut off from the store: peers will count this node lost
                self.store.add(f"node{host.node}/beat", 1)
            if not host.stopping and self.t >= host.pool_after:
                try:
                    self._pool(index, host)
                except StoreDown:  # `run_host`: tried again later (the claim loop's own ticks go on)
                    host.pool_after = self.t + (0.0 if host.state is HostState.CLAIMING else POOL_RETRY_S)
        proc = self.procs[host.pid]
        if host.state is HostState.TRAINING and proc.alive and not host.stopping and self.t >= host.lost_look_at:
            self._lost_look(host)
        if host.state is HostState.CLAIMING:
            self._claim(index, host)
            return
        code = None if proc.alive else proc.code
        if code is not None and proc.parent != index:
            # A promoted spare is its pool's host's child: its code comes through the store.
            host.seen_dead = self.t if host.seen_dead is None else host.seen_dead
            try:
                published = self.store.read(f"exit/{proc.pid}")
            except StoreDown:
                published = None
            if published is not None:
                code = int(published)
            elif self.t - host.seen_dead > EXIT_WAIT_S:
                code = KILLED
            else:
                code = None
        watching = host.state is HostState.WATCHING_SPARE
        asks = host.state is not HostState.STOPPING
        host.blind = False  # (`_marked`: a mark the store cannot be asked about is not set)
        try:
            stepped = asks and (watching or code is not None) and self.store.read(f"stepped/{proc.pid}") is not None
        except StoreDown:
            stepped, host.blind = False, True
        try:
            finished = asks and code not in (None, 0) and self.store.read(f"finished/{proc.pid}") is not None
        except StoreDown:
            finished, host.blind = False, True
        try:
            handed = asks and code not in (None, 0) and self.store.read(f"handed-over/{proc.pid}") is not None
        except StoreDown:
            handed = False
        seen = HostObservation(
            exit_code=code, stepped=stepped, finished=finished, stopping=host.stopping, handed_over=handed
        )
        decision = decide_host(host.state, seen)
        if isinstance(decision, ClaimSpare):
            if self.store.signed(f"finished/{proc.pid}"):
                raise Violation(f"rank {host.rank}'s trainer finished its run; its host claims a spare to replace it")
            if not host.counted:
                self._count_lost(index, host)
            host.dead_code, host.claim_start = code, self.t
            host.state = next_state(HOST_TRANSITIONS, host.state, decision)
            self._claim(index, host)
            return
        host.state = next_state(HOST_TRANSITIONS, host.state, decision)
        if isinstance(decision, Recovered) and host.counted:
            self._uncount_lost(host)
        elif isinstance(decision, (PassThrough, FallBack, HandOver)):
            host.exit = decision.exit_code
            self._exited(index, host, handed_over=isinstance(decision, HandOver))
        else:
            assert isinstance(decision, (Wait, Stop)), decision

    def _lost_look(self, host: Host) -> None:
        """`run_host`'s look at its rank's lost count, `TIMEOUT_S` apart while its trainer trains: the trainer's
        step (until seen), then the mark given back as `gives_back_lost` says."""
        host.lost_look_at = self.t + TIMEOUT_S
        proc = self.procs[host.pid]
        with contextlib.suppress(StoreDown):
            if host.stepped_pid != proc.pid and self.store.read(f"stepped/{proc.pid}") is not None:
                host.stepped_pid = proc.pid
            seen = HostObservation(stepped=host.stepped_pid == proc.pid, stopping=host.stopping)
            if gives_back_lost(host.state, seen):
                self._uncount_lost(host)

    def _count_lost(self, index: int, host: Host) -> None:
        """`host._count_lost`: the rank's mark (compare-and-set), and the count only by the host that set it;
        a store error: not counted."""
        key, mine = f"rank{host.rank}/lost", f"host{index}"
        with contextlib.suppress(StoreDown):
            if self.store.compare_set(key, mine):
                self.store.add("lost", 1)
                host.counted = True
            else:
                host.counted = self.store.read_free(key) is not None  # (the answer of the same request)

    def _uncount_lost(self, host: Host) -> None:
        """`host._uncount_lost`: the mark's delete; the count is given back by whoever deleted it."""
        with contextlib.suppress(StoreDown):
            if self.store.delete(f"rank{host.rank}/lost"):
                self.store.add("lost", -1)
            host.counted = False

    def _standing_by(self, index: int, host: Host) -> None:
        """`_await_promotion`: a standby's host waits for its orders (a forged one is ignored)."""
        proc = self.procs[host.pid]
        key = f"node{host.node}/host{host.local}/promote"
        if proc.alive and not host.stopping and key not in self.store.orders:
            return  # its one blocking wait for the key goes on: `decide_host` would say Wait
        try:
            orders = self.store.read(key)
        except StoreDown:
            orders = None
        seen = HostObservation(
            stopping=host.stopping, exit_code=None if proc.alive else proc.code, promoted=orders is not None
        )
        decision = decide_host(host.state, seen)
        host.state = next_state(HOST_TRANSITIONS, host.state, decision)
        if isinstance(decision, StandDown):
            host.exit = decision.exit_code
            self._exited(index, host)
        elif isinstance(decision, Promote):
            assert orders is not None
            node, next_spare, rank = (int(x) for x in orders.split(","))
            host.rank, host.node, host.pool = rank, node, host.local == 0
            host.next_index = host.first_index = next_spare
            host.first_pid, host.replaced = host.pid, self.holder[rank]
            self.holder[rank] = index
            self._count_lost(index, host)  # its trainer was lost with its node; the spare replaces it

    def _claim(self, index: int, host: Host) -> None:
        """`host._claim`: one look of the claim loop (whether to go on, then a claim), as `decide_host` says."""
        taken: tuple[int, int] | None = None
        seen = HostObservation(
            exit_code=host.dead_code, stopping=host.stopping, elapsed_s=self.t - host.claim_start, timeout_s=TIMEOUT_S
        )
        every_rank_lost, store_failed = False, None
        try:
            if isinstance(decide_host(HostState.CLAIMING, seen), Wait):
                for spare in range(max(0, self.store.add(f"node{host.node}/spawned", 0))):
                    key = f"node{host.node}/spare{spare}/claim"
                    if self.store.check(key):
                        continue
                    pid = self.store.read(f"node{host.node}/spare{spare}/ready")
                    if pid is None or not pid.isdigit() or int(pid) not in self.procs:
                        continue
                    if self.store.compare_set(key, str(host.rank)):
                        taken = (spare, int(pid))
                        break
            if taken is None:
                every_rank_lost = every_rank_lost_in(self.store, "lost", "all-lost", self.world)
        except StoreDown as exc:
            store_failed = str(exc)
        seen = HostObservation(
            exit_code=host.dead_code,
            stopping=host.stopping,
            elapsed_s=self.t - host.claim_start,
            timeout_s=TIMEOUT_S,
            every_rank_lost=every_rank_lost,
            store_failed=store_failed,
            claimed_pid=None if taken is None else taken[1],
        )
        decision = decide_host(HostState.CLAIMING, seen)
        if isinstance(decision, Wait):
            return
        if isinstance(decision, Promote):
            assert taken is not None and host.rank is not None
            if self.shutdown_at is not None:
                raise Violation(
                    f"rank {host.rank} promoted a spare after the group was stopped at t={self.shutdown_at:.2f}"
                )
            claimed = (host.node, taken[0])
            self.claims[claimed] = self.claims.get(claimed, 0) + 1
            try:
                self.store.write(f"rank{host.rank}/owner", str(decision.pid))
                dead_gen = int(self.store.read(f"rank{host.rank}/gen") or 0)
                self.store.write(f"node{host.node}/spare{taken[0]}/assign", f"{host.rank},{dead_gen + 1}")
            except StoreDown:
                decision = FallBack("assigning the spare failed")
            else:
                host.pid, host.seen_dead = decision.pid, None
        host.state = next_state(HOST_TRANSITIONS, host.state, decision)
        if isinstance(decision, (PassThrough, FallBack)):
            host.exit = decision.exit_code
            self._exited(index, host)

    def _pool(self, index: int, host: Host) -> None:
        """`SparePool.tick`: publish the codes of its dead spares, keep `spares` unclaimed ones."""
        unclaimed = 0
        for proc in host.children:
            if proc.spare is None:
                continue
            if not proc.alive and proc.pid not in self.published:
                self.store.write(f"exit/{proc.pid}", str(proc.code))
                self.published.add(proc.pid)
            waiting = proc.alive and proc.spare_state in (SpareState.WARMING, SpareState.READY)
            # `SparePool._available`: a spare with any claim, even a forged one, is no spare of the pool
            if waiting and not self.store.check(f"node{host.node}/spare{proc.spare}/claim"):
                unclaimed += 1
        if host.next_index == host.first_index and not self.procs[host.first_pid].stepped:
            return
        while unclaimed < self.w.spares:
            self._start(host.node, host.machine, None, index, spare=host.next_index)
            host.next_index += 1
            self.store.add(f"node{host.node}/spawned", 1)
            unclaimed += 1

    # -- standby nodes ----------------------------------------------------------------------------
    def _step_standby(self, standby: StandbyNode) -> None:
        self._look(standby, lambda: self._standby_look(standby))

    def _standby_look(self, standby: StandbyNode) -> None:
        """`_stand_by`'s loop, one look: what it saw, `decide_standby`'s decision, carried out."""
        hosts = [self.hosts[i] for i in standby.hosts]
        codes = tuple(h.exit if h.exit is not None or h.alive else KILLED for h in hosts)
        stopping = 15 if standby.stopping else None
        ready, lost, ended, failed, unreached = False, (), (), None, None
        handed: tuple[int, str] | None = None
        if standby.state is not StandbyState.HOLDING and stopping is None and all(c is None for c in codes):
            try:
                ready = standby.state is StandbyState.WARMING and all(
                    self.store.read(f"node{standby.node}/spare{local}/ready") is not None
                    for local in range(self.w.nproc)
                )
                record = self.store.read("sdc/handover") if standby.state is StandbyState.READY else None
                if record is not None:  # `Standby.handover`: unless a standby took it already
                    node, gen = (int(x) for x in record.split(","))
                    if not self.store.check(f"node{node}/taker/sdc{gen}"):
                        handed = (node, f"sdc{gen}")
                gone = self._watch(standby, HOST_LOST_S, None)
                ended = tuple(n for n in gone if self.store.read(f"node{n}/ended") is not None)
                lost = tuple(n for n in gone if n not in ended)
                standby.reached = self.t
            except StoreDown as exc:
                failed, unreached = str(exc), self.t - standby.reached
        new_round = False
        if standby.state is StandbyState.HOLDING and stopping is None:
            with contextlib.suppress(StoreDown):  # `Standby.new_round`: nothing seen when the store fails
                self.store.read("round-record")  # (one request; the record itself is `self.new_round`)
                new_round = self.new_round
        seen = StandbyObservation(
            stopping=stopping,
            host_codes=codes,
            nodes=self.w.nodes,
            gone_after_s=1.0,
            spares_ready=ready,
            lost=lost,
            ended=ended,
            store_failed=failed,
            unreached_s=unreached,
            new_round=new_round,
            handed_over=None if handed is None else handed[0],
        )
        decision = decide_standby(standby.state, seen)
        if isinstance(decision, Take):
            try:
                for node in decision.nodes:
                    tail = handed[1] if decision.handover and handed is not None else None
                    if self._take(standby, node, tail):
                        standby.state = next_state(STANDBY_TRANSITIONS, standby.state, decision)
                        self.store.add("standbys", -1)
                        break
            except StoreDown:
                pass  # `Standby.take_quietly`: a wait; the next look takes the node again
            return
        if isinstance(decision, Ready):
            try:
                self.store.add("standbys", 1)
            except StoreDown:
                return  # counted ready at a later look
        holding = standby.state is StandbyState.HOLDING
        standby.state = next_state(STANDBY_TRANSITIONS, standby.state, decision)
        if isinstance(decision, (RoundOver, StandDown, PassThrough)):
            code = decision.exit_code if isinstance(decision, (StandDown, PassThrough)) else None
            if holding and code is None:
                self._kill_hosts(standby)
            self._standby_ends(standby, code)

    def _kill_hosts(self, standby: StandbyNode) -> None:
        """`_stand_by`'s end of a round in which it held a node: SIGKILL to its hosts (their trainers' state
        is no round's); their children die with them."""
        for index in standby.hosts:
            host = self.hosts[index]
            if host.alive and host.exit is None:
                host.alive = False
                for child in host.children:
                    self._die(child, KILLED)
                self._die(self.procs[host.pid], KILLED)

    def _standby_ends(self, standby: StandbyNode, code: int | None) -> None:
        """Its round is over (`code` None: it stands by for the next one, which this model does not run) or
        its pod exits `code`; hosts it still has are stopped (`stop_hosts`)."""
        standby.state = StandbyState.DONE if code is not None else StandbyState.WAITING
        for index in standby.hosts:
            host = self.hosts[index]
            if host.alive and host.exit is None and not host.stopping:
                host.stopping = True
                self.procs[host.pid].stopping = True
                if host.state is HostState.STANDING_BY:
                    self._die(self.procs[host.pid], 128 + 15)  # its spare ends on the signal
        if code is not None and code != 0 and not is_retryable(code) and not self.permanent_fault:
            raise Violation(f"standby node {standby.slot} exited {code} (permanent) after infrastructure faults only")

    def _take(self, standby: StandbyNode, node: int, handover: str | None = None) -> bool:
        """`Standby.take`: node `node`'s ranks, with one compare-and-set against every other standby.
        `handover`: the taker key's tail of an SDC hand-over (`sdc<generation>`): the node is alive, its spares
        end with its hosts."""
        mine = f"standby{standby.slot}"
        key = f"node{node}/taker/{standby.seen[node][0] if handover is None else handover}"
        # (The real compare-and-set answers with the value it found: a retry after a store error wins again.)
        if not self.store.compare_set(key, mine) and self.store.read_free(key) != mine:
            return False
        spawned = max(0, self.store.add(f"node{node}/spawned", 0))
        for spare in range(0 if handover is not None else spawned):  # its spares died with it
            self.store.compare_set(f"node{node}/spare{spare}/claim", "lost with its node")
        for local in range(self.w.nproc):
            rank = node * self.w.nproc + local
            dead_gen = int(self.store.read(f"rank{rank}/gen") or 0)
            spare_pid = self.store.read(f"node{standby.node}/spare{local}/ready") or ""
            self.store.write(f"rank{rank}/owner", spare_pid)
            claimed = (standby.node, local)
            self.claims[claimed] = self.claims.get(claimed, 0) + 1
            self.store.write(f"node{standby.node}/spare{local}/assign", f"{rank},{dead_gen + 1}")
            self.store.write(f"node{standby.node}/host{local}/promote", f"{node},{spawned},{rank}")
        self.store.add(f"node{node}/beat", 1)  # it beats again from here on (the promoted host keeps it)
        return True

    # -- invariants -----------------------------------------------------------------------------
    def _commit(self) -> None:
        """A generation training at full size commits a checkpoint (a collective of all its members)."""
        newest = self.newest()
        for gen, ranks in self.members.items():
            if (gen >= newest and self.ending is None) or not all(ranks.values()) or self._gen_broken(gen):
                continue
            procs = [self.procs[pid] for pids in ranks.values() for pid in pids]
            # (A member told to stop saves the newest state as it stops: that save is the restart's.)
            if all(p.alive and p.survivor is None and p.stepped and p.gen == gen and not p.stopping for p in procs):
                if gen < newest:
                    raise Violation(f"generation {gen} committed a checkpoint after generation {newest} formed")
                if all(self.hosts[p.parent].standby is not None for p in procs):
                    if not self.new_round:
                        continue  # the old round's last commit: the restart restores only in the new round
                    raise Violation(f"generation {gen}, all standbys' ranks, commits after a new round began")
                raise Violation(f"generation {gen} committed a checkpoint after the group restarted")

    def _check(self) -> None:
        for gen, ranks in self.members.items():
            for rank, pids in ranks.items():
                if len(pids) > 1:
                    raise Violation(f"rank {rank} has members {sorted(pids)} in generation {gen}")
            if gen in self.formed and not all(ranks.values()):
                missing = [r for r, p in ranks.items() if not p]
                raise Violation(f"generation {gen} formed without ranks {missing}")
        for spare, count in self.claims.items():
            if count > 1:
                raise Violation(f"spare {spare} claimed {count} times")

    def _describe(self) -> str:
        hosts = ", ".join(
            f"r{h.rank}:{h.state.name}{'' if h.alive else '(dead)'}/{self.procs[h.pid].survivor}" for h in self.hosts
        )
        return f"t={self.t:.2f} {hosts}; {'; '.join(self.log)}"


def simulate(world: World, faults: list[Fault], *, strict: bool = False) -> str:
    """Run one schedule; its outcome, or `Violation` naming the schedule so it replays. A known defect
    (`KNOWN_DEFECTS`) is the outcome "known defect (<name>)" unless `strict`."""
    faults = sorted(faults, key=lambda f: f.tick)
    try:
        return Sim(world, faults).run()
    except KnownDefect as exc:
        if not strict:
            return f"known defect ({exc.name})"
        raise Violation(f"{exc}\nreplay: simulate({world!r}, {faults!r})") from None
    except Violation as exc:
        raise Violation(f"{exc}\nreplay: simulate({world!r}, {faults!r})") from None


def random_schedule(rng: random.Random) -> tuple[World, list[Fault]]:
    nodes, nproc = rng.randint(1, 3), rng.randint(1, 3)
    if nodes * nproc < 2:
        nproc = 2
    world = World(nodes, nproc, rng.randint(0, 2), rng.randint(1, 6), rng.choice((0, 0, 1, 2)))
    faults = [
        Fault(rng.randint(0, MAX_TICK), rng.choice(KINDS), rng.randint(0, MAX_TARGET)) for _ in range(rng.randint(0, 5))
    ]
    return world, faults


def outcome_kind(outcome: str) -> str:
    """What an outcome is, without its code or generation: "resumed", "group restart", "completed", ..."""
    return outcome.split(" (", maxsplit=1)[0].split(" in generation", maxsplit=1)[0]


def run_seeded(count: int, seed: int) -> dict[str, int]:
    """`count` schedules of `random_schedule(random.Random(seed))`: how many ended in each way."""
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    for _ in range(count):
        kind = outcome_kind(simulate(*random_schedule(rng)))
        outcomes[kind] = outcomes.get(kind, 0) + 1
    return outcomes


# -- tests ----------------------------------------------------------------------------------------------
def test_a_quiet_run_trains_on_in_generation_0() -> None:
    assert simulate(World(), []) == "resumed in generation 0"


def test_a_killed_trainer_is_replaced_and_the_group_resumes_at_full_size() -> None:
    assert simulate(World(nodes=2, nproc=2, spares=1, warm_ticks=2), [Fault(10, "kill_trainer", 3)]) == (
        "resumed in generation 1"
    )


def test_two_deaths_on_a_node_with_one_spare_end_in_one_recovery_each_or_a_group_restart() -> None:
    outcome = simulate(World(1, 3, 1, 2), [Fault(10, "kill_trainer", 1), Fault(11, "kill_trainer", 2)])
    assert outcome in ("resumed in generation 1", "resumed in generation 2", "group restart (203)")


def test_every_rank_lost_at_once_restarts_the_group_from_the_checkpoint() -> None:
    faults = [Fault(10, "kill_trainer", 0), Fault(10, "kill_trainer", 1)]
    assert simulate(World(1, 2, 1, 2), faults) == "group restart (203)"


def test_a_lost_node_restarts_the_group() -> None:
    assert simulate(World(2, 2, 1, 2), [Fault(10, "kill_node", 1)]) == "group restart (203)"


def test_a_shutdown_while_a_host_claims_a_spare_ends_the_host_at_once() -> None:
    """A spare still warming when the shutdown comes: the host passes the dead trainer's code on instead
    of waiting out the claim and assigning a rank into a stopping group (found by this simulator)."""
    outcome = simulate(
        World(1, 2, 1, 30), [Fault(3, "kill_spare", 0), Fault(10, "kill_trainer", 1), Fault(12, "shutdown")]
    )
    assert outcome.startswith("shutdown")


def test_a_forged_claim_on_the_nodes_only_spare_does_not_cost_the_next_recovery() -> None:
    """A claim key written without the job's secret makes that spare unusable (no host can claim it), but the
    pool counted it as its warm spare and started no other: the next death waited out the claim timeout
    and restarted the group (found while modelling the pool)."""
    forged_claim = 3  # `Sim._forge`: the claim key of spare 3 % spawned (spare 0) of node 0
    faults = [Fault(5, "forge", forged_claim), Fault(20, "kill_trainer", 1)]
    assert simulate(World(1, 2, 1, 2), faults) == "resumed in generation 1"


def test_a_store_refusing_a_claim_is_a_group_restart_never_a_permanent_exit() -> None:
    """The host's claim once raised out of `run_host` when the store refused (exit 1, which Kubeflow takes
    as permanent); it is a fall-back now (found by this simulator)."""
    outcome = simulate(World(1, 2, 0, 2), [Fault(10, "kill_trainer", 1), Fault(11, "store_refuse", 30)])
    assert outcome == "group restart (203)"


def test_a_completed_run_ends_with_every_host_exiting_0() -> None:
    assert simulate(World(2, 2, 1, 2), [Fault(10, "finish", 0)]) == "completed"


def test_a_finished_rank_killed_before_it_exits_is_passed_on_as_0_never_replaced() -> None:
    """Rank 3 marked itself finished (signed) and is killed before it exits (the teardown of the host that
    started it): its host passes 0 on; a replacement would wait for a generation the finished ranks never
    join (`decide_host`'s `finished`; the simulator fails this schedule if `finished` is ignored)."""
    faults = [Fault(10, "finish", 2), Fault(11, "kill_trainer", 3)]
    assert simulate(World(2, 2, 1, 2), faults) == "completed"


def test_a_promoted_spare_killed_with_the_host_that_started_it_ends_a_completed_run() -> None:
    """Rank 1's trainer was replaced by a spare of node 0's pool: a child of rank 0's host. At the end rank 0
    exits first, and its host's exit kills the spare (`PR_SET_PDEATHSIG`) after it marked itself finished:
    rank 1's host passes 0 on (the two-pod scenario's timeout, before `finished`)."""
    faults = [Fault(10, "kill_trainer", 1), Fault(30, "finish", 0)]
    assert simulate(World(1, 2, 1, 2), faults) == "completed"


def test_a_forged_finished_mark_does_not_stop_a_recovery() -> None:
    """A `finished` mark without the job's MAC: the killed trainer is replaced as if it were not there."""
    forged_finished = 7  # `Sim._forge`: key 7 % 11, the finished mark of rank 7 % 4's trainer
    faults = [Fault(5, "forge", forged_finished), Fault(12, "kill_trainer", 3)]
    assert simulate(World(2, 2, 1, 2), faults) == "resumed in generation 1"


def test_a_node_cut_off_from_the_store_a_while_trains_on() -> None:
    """Store only (`target // 3` even), 8 ticks: its beat stops and comes back; nothing fails."""
    target = 42  # machine 42 % 2 = 0, 2 + 42 // 7 % 19 = 8 ticks, 42 // 3 = 14: the store only
    assert simulate(World(2, 2, 1, 2), [Fault(10, "partition", target)]) == "resumed in generation 0"


def test_a_node_cut_off_from_its_peers_and_the_store_is_given_up_not_waited_for() -> None:
    """A network cut: the other node's ranks find their collective broken and the node silent, give the
    generation up once its ranks are behind (`BEHIND_LOST_S`), and the group restarts."""
    target = 71  # machine 71 % 2 = 1, 2 + 71 // 7 % 19 = 12 ticks, 71 // 3 = 23: its peers too
    outcome = simulate(World(2, 2, 1, 2), [Fault(10, "partition", target)])
    assert outcome == "group restart (203)"


def test_a_standby_takes_a_lost_node_and_the_group_resumes_at_full_size() -> None:
    assert simulate(World(2, 2, 1, 2, standbys=1), [Fault(12, "kill_node", 1)]) == "resumed in generation 1"


def test_two_standbys_take_one_lost_node_once() -> None:
    outcome = simulate(World(2, 2, 1, 2, standbys=2), [Fault(12, "kill_node", 0)])
    assert outcome == "resumed in generation 1"


def test_a_forged_promotion_is_ignored_by_a_standby_host() -> None:
    forged_promote = 10  # `Sim._forge`: key 10 % 11, standby node 2's host 0 told to take node 0
    faults = [Fault(5, "forge", forged_promote), Fault(12, "kill_trainer", 1)]
    assert simulate(World(2, 2, 1, 2, standbys=1), faults) == "resumed in generation 1"


def test_a_failing_schedule_prints_as_a_list_that_replays_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def planted(self: Sim) -> None:
        if self.tick_no == 1 and any(f.kind == "kill_spare" for f in self.faults):
            raise Violation("a planted violation")

    monkeypatch.setattr(Sim, "_check", planted)
    with pytest.raises(Violation) as failed:
        simulate(World(1, 2), [Fault(1, "kill_spare", 0)])
    replay = str(failed.value).split("replay: ", 1)[1]
    world = "World(nodes=1, nproc=2, spares=1, warm_ticks=3, standbys=0)"
    assert replay == f"simulate({world}, [Fault(tick=1, kind='kill_spare', target=0)])"
    with pytest.raises(Violation, match="a planted violation"):
        eval(replay)  # the printed schedule is the test's own


def test_a_spare_caught_mid_join_by_a_store_cut_is_not_joined_beside_the_standby_that_took_its_node() -> None:
    """Once the known defect "stale-join": rank 0's spare looked at its owner (itself) and its join hung while
    its node was cut off from the store (10 ticks, the store only); the node's beat stood still with its rank
    behind, so the standby took the node and gave rank 0 to its own spare, which joined; then the hung join
    completed: two members of rank 0 in generation 1. Now each rank has one seat per generation
    (`InPlace.seat_key`, a compare-and-set): the late member finds it taken and falls back."""
    faults = [Fault(1, "kill_trainer", 614), Fault(8, "partition", 992)]
    assert simulate(World(2, 1, 1, 5, standbys=2), faults, strict=True) == "group restart (203)"


def test_standbys_that_took_every_node_stop_when_the_group_restarts() -> None:
    """Once the known defect "zombie-round": node 0 cut off from the store (store only, 13 ticks) just after
    node 1 was lost; one standby takes node 1, the other node 0 (its rank behind, its beat still). Node 0's
    own trainer comes back to a rank another process owns and falls back, and torchrun restarts the group:
    the two standbys' ranks, a complete generation, trained on beside the new round. Now a standby that holds
    a node sees the new round's record (`StandbyObservation.new_round`) and ends its hosts."""
    faults = [Fault(1, "kill_node", 353), Fault(2, "partition", 212)]
    assert simulate(World(2, 1, 0, 1, standbys=2), faults, strict=True) == "group restart (203)"


def test_a_standby_host_that_ends_without_its_rank_training_takes_it_back_from_the_lost_count() -> None:
    """Once the known defect "lost-leak": a standby takes lost node 1 and is cut off from the store (store
    only, 10 ticks); the second standby takes node 1 again and its rank trains, but the first one's host had
    counted the rank lost and ended without taking it back. Now the count is taken once per rank (its mark,
    `InPlace.rank_lost_key`) and given back by whichever host ends or recovers it."""
    faults = [Fault(1, "kill_node", 673), Fault(8, "partition", 458)]
    assert simulate(World(2, 1, 0, 1, standbys=2), faults, strict=True) == "resumed in generation 1"


def test_a_rank_counted_lost_by_its_killed_host_and_by_the_standby_that_took_its_node_is_counted_once() -> None:
    """Rank 2's host counted its rank lost while it claimed a spare, then its node was lost with it (no host
    left to give the count back); the standby's host that took the node counted the rank again: the count
    stayed 1 after the rank trained again (found while fixing "lost-leak")."""
    faults = [
        Fault(2, "store_stall", 771),
        Fault(6, "kill_trainer", 389),
        Fault(13, "forge", 0),
        Fault(15, "kill_node", 970),
        Fault(35, "store_stall", 986),
    ]
    assert simulate(World(3, 1, 0, 5, standbys=1), faults, strict=True) == "resumed in generation 1"


def test_a_stopping_host_cut_off_from_the_store_ends_on_its_trainers_code_without_asking_the_store() -> None:
    """Node 0 cut off from the store and its peers twice; the group is stopped while rank 1's host is cut off.
    Its trainer ends, and the host asked the store whether it had stepped or finished: each request waited
    out the store's timeout, and torchrun's SIGTERM with it (found by this simulator). A stopping host awaits
    only its trainer's own code."""
    faults = [Fault(2, "partition", 904), Fault(22, "partition", 244)]
    assert simulate(World(2, 2, 1, 1), faults, strict=True) == "group restart (203)"


def test_a_member_cut_off_while_forming_ends_within_the_stop_grace() -> None:
    """Once the known defect "stop-while-forming": rank 0 exits permanently (a bug) while node 0 is cut off from
    the store; rank 1, forming the next generation, is told to stop, but asked for the signal only in the wait
    after its join: its owner's look hung on the cut, and its host was still waiting 1.5 s after torchrun
    stopped the group. Now `InPlaceGroup.form` asks `cancelled` before each of its requests."""
    faults = [Fault(11, "bug", 344), Fault(12, "partition", 381), Fault(22, "store_stall", 539)]
    faults.append(Fault(34, "partition", 357))
    assert simulate(World(1, 2, 1, 4), faults, strict=True) == "permanent (2)"


def test_a_standby_host_killed_while_it_counts_a_rank_lost_leaves_no_count_behind() -> None:
    """Once the known defect "lost-killed": standby 1 takes node 0, only cut off from the store (store only), and
    counts rank 0 lost; then standby 1's own machine is lost. Its host could not give the count back, node 0's
    own trainer trained on, and no other host of rank 0 recovered it: the count stayed 1. Now the host whose
    trainer trains gives its rank's count back at its next look at it (`protocol.gives_back_lost`)."""
    faults = [Fault(8, "kill_spare", 452), Fault(13, "partition", 325), Fault(26, "kill_node", 889)]
    sim = Sim(World(3, 1, 0, 5, standbys=2), faults)
    assert sim.run() == "resumed in generation 0"
    assert sim.store.counters.get("lost") == 0 and sim.store.read_free("rank0/lost") is None
    assert not sim.hosts[4].alive and sim.current(0).pid == sim.hosts[0].first_pid  # node 0's own trainer


def test_only_a_host_whose_trainer_stepped_and_trains_gives_its_ranks_lost_count_back() -> None:
    trains = HostObservation(stepped=True)
    assert gives_back_lost(HostState.TRAINING, trains)
    assert not gives_back_lost(HostState.TRAINING, HostObservation())  # not stepped yet: no evidence
    assert not gives_back_lost(HostState.TRAINING, HostObservation(exit_code=KILLED, stepped=True))
    assert not gives_back_lost(HostState.TRAINING, HostObservation(stepped=True, stopping=True))
    for state in (HostState.CLAIMING, HostState.WATCHING_SPARE, HostState.STANDING_BY, HostState.STOPPING):
        assert not gives_back_lost(state, trains), state  # a recovery of its own gives it back when it ends


def test_a_replica_disagreement_with_a_majority_rolls_back_in_place_with_a_spare_in_the_suspects_rank() -> None:
    sim = Sim(World(1, 3, 1, 2), [Fault(10, "sdc", 4)])
    assert sim.run() == "resumed in generation 1"
    # Rank 1's trainer left with SDC_SUSPECT, and its rank is held by a spare in generation 1.
    first = sim.procs[sim.hosts[1].first_pid]
    assert first.code == ExitCode.SDC_SUSPECT and sim.current(1).pid != first.pid and sim.current(1).gen == 1
    assert all(sim.current(r).pid == sim.hosts[r].first_pid for r in (0, 2))  # the survivors stayed


def test_a_replica_disagreement_without_a_majority_restarts_the_group() -> None:
    assert simulate(World(1, 2, 1, 2), [Fault(10, "sdc", 1)]) == "group restart (206)"


def test_a_suspect_with_no_spare_to_take_its_rank_falls_back_to_a_group_restart() -> None:
    """Its node has no warm spare (a rank's replacement runs on the rank's node: no other node's spare can
    be claimed): the host finds none within the in-place timeout and the group restarts."""
    assert simulate(World(1, 3, 0, 2), [Fault(10, "sdc", 2)]) == "group restart (203)"


def test_a_suspects_node_is_handed_to_a_ready_standby_and_holds_no_rank_after() -> None:
    """2 nodes x 2 ranks and a ready standby node: rank 2 (node 1) is the suspect. Node 1 is handed over (one
    compare-and-set, the signed record): both its trainers leave with SDC_SUSPECT, their hosts exit 0 without
    claiming a spare of node 1, the standby's spares hold ranks 2 and 3 in generation 1, node 0's survivors
    rolled back beside them."""
    sim = Sim(World(2, 2, 1, 2, standbys=1), [Fault(10, "sdc", 2)])
    assert sim.run() == "resumed in generation 1"
    assert sim.store.read_free("gen0/sdc-handover") == "1" and sim.store.read_free("sdc/handover") == "1,0"
    for rank in (2, 3):
        first = sim.procs[sim.hosts[rank].first_pid]
        assert first.code == ExitCode.SDC_SUSPECT and sim.hosts[rank].exit == 0  # handed over, no restart
        holder = sim.hosts[sim.holding(rank)]
        assert holder.standby == 0 and holder.machine == 2 and sim.current(rank).gen == 1
    assert not any(c for c in sim.claims if c[0] == 1), "no spare of the suspect node took a rank"
    assert all(sim.current(r).pid == sim.hosts[r].first_pid for r in (0, 1))  # node 0 rolled back in place


def test_a_suspect_with_no_ready_standby_keeps_the_same_node_spare() -> None:
    """The standby is still warming when the replicas disagree (at tick 2; its spares take 3): nothing is handed
    over (`-1` stored), the suspect's rank goes to a spare of its own node as without standby nodes."""
    sim = Sim(World(2, 2, 1, 3, standbys=1), [Fault(2, "sdc", 2)])
    assert sim.run() == "resumed in generation 1"
    assert sim.store.read_free("gen0/sdc-handover") == "-1" and sim.store.read_free("sdc/handover") is None
    assert sim.hosts[sim.holding(2)].standby is None and sim.current(2).pid != sim.hosts[2].first_pid
    assert sim.current(3).pid == sim.hosts[3].first_pid  # node 1's other rank rolled back where it was


def test_seeded_schedules_hold_every_invariant() -> None:
    outcomes = run_seeded(1500, 34)
    assert {"resumed", "group restart", "shutdown", "permanent", "completed"} <= set(outcomes), outcomes


faults_st = st.lists(
    st.builds(Fault, st.integers(0, MAX_TICK), st.sampled_from(KINDS), st.integers(0, MAX_TARGET)), max_size=6
)
worlds_st = st.builds(
    World, st.integers(1, 3), st.integers(2, 3), st.integers(0, 2), st.integers(1, 6), st.integers(0, 2)
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds_st, faults=faults_st)
def test_drawn_schedules_hold_every_invariant(world: World, faults: list[Fault]) -> None:
    simulate(world, faults)


def rate(seconds: float, seed: int = 0) -> float:
    """Schedules a minute `random_schedule` runs for `seconds` of wall time (the bench's measurement)."""
    rng, done, start = random.Random(seed), 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        simulate(*random_schedule(rng))
        done += 1
    return done / (time.perf_counter() - start) * 60


if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    print(f"{rate(seconds):,.0f} schedules/minute")
