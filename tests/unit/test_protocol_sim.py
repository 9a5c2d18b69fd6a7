"""A deterministic simulation of in-place recovery, driven by the policies the real processes run.

No process, socket, torch or wall clock: a model store (counters, signed orders, compare-and-set,
windows in which it refuses or stalls), a model clock, and for each node its hosts, trainers and warm
spares, whose every choice is `training.inplace.protocol`'s (`decide_host`, `decide_form`, and the
transition tables). A schedule is a short list of faults at given ticks (kill a trainer, a spare, a whole
node; a permanent bug; a shutdown; a store that refuses or stalls; a forged order); after every tick the
invariants are checked, and every schedule must end, within a bound its timeouts give, in one of: every
rank training again in a newer generation at full size, a group restart (a host exited and torchrun
restarts the group), a permanent exit (only after a permanent fault), or a shutdown that every host
followed. A failing schedule prints as a list of `Fault`s that `simulate` replays.

`python tests/unit/test_protocol_sim.py [seconds]` prints how many schedules a minute it runs.
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from training.contract import ExitCode, is_retryable
from training.inplace.protocol import (
    HOST_TRANSITIONS,
    SPARE_TRANSITIONS,
    SURVIVOR_TRANSITIONS,
    ClaimSpare,
    FallBack,
    Formed,
    FormObservation,
    HostObservation,
    HostState,
    PassThrough,
    Promote,
    Recovered,
    SpareState,
    Stop,
    SurvivorState,
    Wait,
    decide_form,
    decide_host,
    next_state,
)

DT = 0.05  # one tick of model time
TIMEOUT_S = 0.5  # restarts.inPlaceTimeoutSeconds of the model
LOST_AFTER_S = 0.3  # a node's beat stood still this long: its node is lost (HOST_LOST_S of the model)
EXIT_WAIT_S = 0.1  # a promoted spare's exit code not published this long after its death: a crash
COMMIT_EVERY = 5  # ticks between the checkpoint commits of a generation training at full size
MAX_TICK = 40  # the last tick a fault may come at
# Every schedule ends this long after its last fault: a claim (TIMEOUT_S), a forming generation (2 x
# TIMEOUT_S), a second recovery after it, a stall, and the warm-up of a spare started meanwhile.
SETTLE_S = 8 * TIMEOUT_S
KINDS = ("kill_trainer", "kill_spare", "kill_node", "bug", "shutdown", "store_refuse", "store_stall", "forge")
KILLED = 128 + 9
STOP_GRACE_S = 2 * TIMEOUT_S  # every host ends this soon after torchrun's SIGTERM (its own grace is 30 s)


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule: at `tick`, `kind` on `target` (an index the kind reads modulo its range)."""

    tick: int
    kind: str
    target: int = 0


@dataclass(frozen=True)
class World:
    nodes: int = 2
    nproc: int = 2
    spares: int = 1
    warm_ticks: int = 3  # a spare's start-up (import, model, rehearsal)


class StoreDown(Exception):
    pass


class Violation(AssertionError):
    pass


@dataclass
class Store:
    """The long-lived c10d store: signed orders (value, signed), counters, compare-and-set."""

    orders: dict[str, tuple[str, bool]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    refused: list[tuple[float, float]] = field(default_factory=list)
    stalled: list[tuple[float, float]] = field(default_factory=list)
    now: float = 0.0
    ops: int = 0

    def _op(self) -> None:
        self.ops += 1
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

    def check(self, key: str) -> bool:
        self._op()
        return key in self.orders

    def read(self, key: str) -> str | None:
        """`InPlace.read`: None when absent or not signed by this job."""
        self._op()
        value = self.orders.get(key)
        return value[0] if value is not None and value[1] else None

    def write(self, key: str, value: str) -> None:
        self._op()
        self.orders[key] = (value, True)

    def forge(self, key: str, value: str) -> None:
        self.orders[key] = (value, False)

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
    node: int
    rank: int | None  # None: a spare not assigned yet
    spare: int | None = None  # its index among the node's spares
    spare_state: SpareState | None = None
    ready_tick: int = 0
    alive: bool = True
    code: int | None = None
    stepped: bool = False
    gen: int = 0
    survivor: SurvivorState | None = None  # None: training in `gen`
    form_start: float = 0.0
    stopping: bool = False


@dataclass
class Host:
    rank: int
    node: int
    state: HostState
    pid: int  # the process it watches
    alive: bool = True
    stopping: bool = False
    claim_start: float = 0.0
    dead_code: int | None = None
    seen_dead: float | None = None
    exit: int | None = None
    busy_until: float = 0.0


class Sim:
    def __init__(self, world: World, faults: list[Fault]) -> None:
        self.w = world
        self.world = world.nodes * world.nproc
        self.faults = sorted(faults, key=lambda f: f.tick)
        self.store = Store()
        self.t = 0.0
        self.tick_no = 0
        self.procs: dict[int, Proc] = {}
        self.hosts: list[Host] = []
        self.next_pid = 100
        self.spawned = [0] * world.nodes
        self.node_dead_at: dict[int, float] = {}
        self.members: dict[int, dict[int, set[int]]] = {0: {r: set() for r in range(self.world)}}
        self.formed: set[int] = {0}
        self.claims: dict[tuple[int, int], int] = {}
        self.shutdown_at: float | None = None
        self.permanent_fault = False
        self.outcome: str | None = None
        self.ending: str | None = None  # what the first host's exit means; the outcome once every host ended
        self.stop_by: float | None = None
        self.log: list[str] = []
        for rank in range(self.world):
            proc = self._start(rank // world.nproc, rank)
            proc.stepped = False
            self.members[0][rank].add(proc.pid)
            self.hosts.append(Host(rank, rank // world.nproc, HostState.TRAINING, proc.pid))

    # -- processes ------------------------------------------------------------------------------
    def _start(self, node: int, rank: int | None) -> Proc:
        self.next_pid += 1
        proc = Proc(self.next_pid, node, rank)
        if rank is None:
            proc.spare = self.spawned[node]
            proc.spare_state = SpareState.WARMING
            proc.ready_tick = self.tick_no + self.w.warm_ticks
            self.spawned[node] += 1
        self.procs[proc.pid] = proc
        return proc

    def _die(self, proc: Proc, code: int) -> None:
        if proc.alive:
            proc.alive, proc.code = False, code

    def current(self, rank: int) -> Proc:
        return self.procs[self.hosts[rank].pid]

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
            if proc.alive:
                self.permanent_fault = True
                self._die(proc, int(ExitCode.TASK_INVALID))
        elif kind == "kill_spare":
            spares = [p for p in self.procs.values() if p.spare is not None and p.alive]
            if spares:
                self._die(spares[n % len(spares)], KILLED)
        elif kind == "kill_node":
            node = n % self.w.nodes
            self.node_dead_at.setdefault(node, self.t)
            for host in self.hosts:
                if host.node == node:
                    host.alive = False
            for proc in self.procs.values():
                if proc.node == node:  # PR_SET_PDEATHSIG: the node's children die with its hosts
                    self._die(proc, KILLED)
        elif kind == "shutdown":
            self._stop_all()
        elif kind in ("store_refuse", "store_stall"):
            window = (self.t, self.t + DT * (1 + n % 12))
            (self.store.refused if kind == "store_refuse" else self.store.stalled).append(window)
        elif kind == "forge":
            self._forge(n)

    def _forge(self, n: int) -> None:
        """An order written by someone without the job's secret: every reader must act as if it were not there."""
        node, rank, gen = n % self.w.nodes, n % self.world, self.newest() + 1
        keys = [
            (f"node{node}/spare{self.spawned[node]}/ready", "1"),  # a ready spare that is not one
            (f"node{node}/spare{n % max(1, self.spawned[node])}/assign", f"{rank},{gen}"),
            (f"rank{rank}/owner", "1"),
            (f"node{node}/spare{n % max(1, self.spawned[node])}/claim", "0"),  # that spare is unusable
            (f"gen{gen}/nodes-lost", "node 0 (forged)"),
            (f"exit/{self.hosts[rank].pid}", "0"),
            (f"stepped/{self.hosts[rank].pid}", "1"),
        ]
        key, value = keys[n % len(keys)]
        if key not in self.store.orders:
            self.store.forge(key, value)

    # -- one tick -------------------------------------------------------------------------------
    def run(self) -> str:
        faults = list(self.faults)
        last = max((f.tick for f in faults), default=0) * DT
        while self.outcome is None:
            self.store.now = self.t
            while faults and faults[0].tick <= self.tick_no:
                self._apply(faults.pop(0))
            for proc in list(self.procs.values()):
                if proc.alive:
                    self._step_proc(proc)
            for host in self.hosts:
                if host.alive and host.exit is None and host.busy_until <= self.t:
                    self._step_host(host)
                    if host.exit is not None and self.ending is None:
                        self._ended(host)
            if self.ending is not None and all(h.exit is not None for h in self.hosts if h.alive):
                self.outcome = self.ending
            elif self.stop_by is not None and self.t > self.stop_by:
                raise Violation(
                    f"a host still runs {STOP_GRACE_S:g} s after torchrun stopped the group: {self._describe()}"
                )
            if self.outcome is None and self.tick_no % COMMIT_EVERY == 0:
                self._commit()
            self._check()
            if self.outcome is None and not any(h.alive and h.exit is None for h in self.hosts) and self.ending is None:
                self.outcome = "every node lost"  # no agent is left: the platform starts the job again
            if self.outcome is None and self.ending is None and not faults and self._settled():
                self.outcome = f"resumed in generation {self.newest()}"
            self.t = round(self.t + DT, 6)
            self.tick_no += 1
            if self.outcome is None and self.t > last + SETTLE_S:
                raise Violation(f"no end {SETTLE_S:g} s after the last fault: {self._describe()}")
        return self.outcome

    def _stop_all(self) -> None:
        """SIGTERM to every host (torchrun's shutdown, or its stop of the group after a worker ended),
        forwarded to the process each watches now."""
        self.shutdown_at = self.t if self.shutdown_at is None else self.shutdown_at
        self.stop_by = self.t + STOP_GRACE_S if self.stop_by is None else self.stop_by
        for host in self.hosts:
            host.stopping = True
            self.procs[host.pid].stopping = True

    def _ended(self, host: Host) -> None:
        """The first host exited: torchrun's agent sees its worker end and stops the others; the group
        restarts (or the job ends) once they have."""
        code = host.exit
        assert code is not None
        stopped = self.shutdown_at is not None
        self._stop_all()
        if stopped:
            self.ending = f"shutdown ({code})"
        elif code != 0 and not is_retryable(code):
            if not self.permanent_fault:
                raise Violation(f"rank {host.rank} exited {code} (permanent) after infrastructure faults only")
            self.ending = f"permanent ({code})"
        elif code == 0:
            raise Violation(f"rank {host.rank} exited 0 while training")
        else:
            self.ending = f"group restart ({code})"

    def _settled(self) -> bool:
        newest = self.newest()
        for host in self.hosts:
            proc = self.procs[host.pid]
            if not host.alive or host.state is not HostState.TRAINING or not proc.alive:
                return False
            if proc.survivor is not None or proc.gen != newest or not proc.stepped:
                return False
        if self.store.counters.get("lost", 0) != 0:
            raise Violation(f"every rank trains again, but the lost count is {self.store.counters.get('lost')}")
        return True

    # -- trainers and spares --------------------------------------------------------------------
    def _gen_broken(self, gen: int) -> bool:
        return any(not self.procs[pid].alive for pids in self.members.get(gen, {}).values() for pid in pids)

    def _step_proc(self, proc: Proc) -> None:
        if proc.spare_state is SpareState.WARMING:
            if self.tick_no >= proc.ready_tick:
                try:
                    self.store.write(f"node{proc.node}/spare{proc.spare}/ready", str(proc.pid))
                except StoreDown:
                    return
                proc.spare_state = next_state(SPARE_TRANSITIONS, proc.spare_state, Wait())
            return
        if proc.spare_state is SpareState.READY:
            try:
                orders = self.store.read(f"node{proc.node}/spare{proc.spare}/assign")
            except StoreDown:
                return
            if orders is None:
                return
            rank, gen = (int(x) for x in orders.split(","))
            proc.spare_state = next_state(SPARE_TRANSITIONS, proc.spare_state, Promote(proc.pid))
            proc.rank = rank
            self._join(proc, gen, has_state=False)
            return
        if proc.rank is None:
            return
        if proc.survivor is None:
            if proc.stopping:
                self._die(proc, int(ExitCode.PREEMPTED))  # stops at an agreed step, after its emergency save
            elif self._gen_broken(proc.gen):
                proc.survivor = SurvivorState.LEAVE  # its collective failed: a peer is gone
            elif all(
                self.procs[next(iter(pids))].survivor is None and self.procs[next(iter(pids))].gen == proc.gen
                for pids in self.members[proc.gen].values()
                if pids
            ):
                if not proc.stepped:
                    try:
                        self.store.write(f"stepped/{proc.pid}", "1")
                    except StoreDown:
                        self._die(proc, int(ExitCode.TRAINING_FAILED))
                        return
                proc.stepped = True
            return
        if proc.survivor is SurvivorState.LEAVE:
            proc.survivor = next_state(SURVIVOR_TRANSITIONS, proc.survivor, Wait())
            self._join(proc, proc.gen + 1, has_state=True)
        elif proc.survivor is SurvivorState.FORM:
            self._form(proc)
        elif proc.survivor in (SurvivorState.SYNC, SurvivorState.REWIRE):
            # Collective with every member: a death during it is an exception the member turns into a
            # fall-back (`Trainer._recover_in_place`).
            decision = FallBack("a member died while syncing") if self._gen_broken(proc.gen) else Wait()
            proc.survivor = next_state(SURVIVOR_TRANSITIONS, proc.survivor, decision)
            self._survivor_end(proc)

    def _survivor_end(self, proc: Proc) -> None:
        if proc.survivor is SurvivorState.FAILED:
            assert proc.survivor.exit_code is not None
            self._die(proc, proc.survivor.exit_code)
        elif proc.survivor is SurvivorState.RESUMED:
            proc.survivor = None

    def _join(self, proc: Proc, gen: int, *, has_state: bool) -> None:
        assert proc.rank is not None
        proc.survivor, proc.gen, proc.form_start = SurvivorState.FORM, gen, self.t
        try:
            owner = self.store.read(f"rank{proc.rank}/owner")
            look = FormObservation(gen, self.world, proc.rank, owner=owner, pid=proc.pid, limit_s=TIMEOUT_S)
            if isinstance(decision := decide_form(look), FallBack):
                proc.survivor = next_state(SURVIVOR_TRANSITIONS, SurvivorState.FORM, decision)
                self._survivor_end(proc)
                return
            self.store.write(f"rank{proc.rank}/gen", str(gen))
            joined = self.store.add(f"join/{gen}", 1)
        except StoreDown:
            self._die(proc, int(ExitCode.RECOVERY_FAILED))
            return
        self.members.setdefault(gen, {r: set() for r in range(self.world)})[proc.rank].add(proc.pid)
        if isinstance(decide_form(FormObservation(gen, self.world, proc.rank, joined=joined)), Formed):
            self.store.write(f"join/{gen}/formed", "1")

    def _form(self, proc: Proc) -> None:
        assert proc.rank is not None
        gen = proc.gen
        try:
            if proc.rank in (0, self.world - 1):  # the two watchers of the nodes' beats
                for node, died in self.node_dead_at.items():
                    if self.t - died >= LOST_AFTER_S:
                        self.store.compare_set(f"gen{gen}/nodes-lost", f"node {node} stopped beating")
            seen = FormObservation(
                gen,
                self.world,
                proc.rank,
                joined=self.store.add(f"join/{gen}", 0),
                formed=self.store.check(f"join/{gen}/formed"),
                cancelled=proc.stopping,
                nodes_lost=self.store.read(f"gen{gen}/nodes-lost"),
                elapsed_s=self.t - proc.form_start,
                limit_s=TIMEOUT_S,
            )
        except StoreDown:
            seen = FormObservation(gen, self.world, proc.rank, elapsed_s=self.t - proc.form_start, limit_s=TIMEOUT_S)
        decision = decide_form(seen)
        if isinstance(decision, Formed):
            if decision.announce:
                self.store.orders[f"join/{gen}/formed"] = ("1", True)
            self.formed.add(gen)
        proc.survivor = next_state(SURVIVOR_TRANSITIONS, SurvivorState.FORM, decision)
        self._survivor_end(proc)

    # -- hosts ----------------------------------------------------------------------------------
    def _step_host(self, host: Host) -> None:
        if (end := self.store.stall_end()) > self.t:
            host.busy_until = end  # its request is answered when the store's loop runs again
            return
        if host.rank % self.w.nproc == 0 and not host.stopping:
            self._pool(host.node)
        proc = self.procs[host.pid]
        if host.state is HostState.CLAIMING:
            self._claim(host)
            return
        code = None if proc.alive else proc.code
        own_child = proc.spare is None or host.rank % self.w.nproc == 0
        if code is not None and not own_child:
            # A promoted spare is the local-rank-0 host's child: its code comes through the store.
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
        try:
            stepped = (watching or code is not None) and self.store.read(f"stepped/{proc.pid}") is not None
        except StoreDown:
            stepped = False
        decision = decide_host(host.state, HostObservation(exit_code=code, stepped=stepped, stopping=host.stopping))
        if isinstance(decision, ClaimSpare):
            if host.state is HostState.TRAINING:
                with contextlib.suppress(StoreDown):
                    self.store.add("lost", 1)
            host.dead_code, host.claim_start = code, self.t
            host.state = next_state(HOST_TRANSITIONS, host.state, decision)
            self._claim(host)
            return
        host.state = next_state(HOST_TRANSITIONS, host.state, decision)
        if isinstance(decision, Recovered):
            with contextlib.suppress(StoreDown):
                self.store.add("lost", -1)
        elif isinstance(decision, (PassThrough, FallBack)):
            host.exit = decision.exit_code
        else:
            assert isinstance(decision, (Wait, Stop)), decision

    def _claim(self, host: Host) -> None:
        """`host._claim`: one look of the claim loop (whether to go on, then a claim), as `decide_host` says."""
        taken: tuple[int, int] | None = None
        seen = HostObservation(
            exit_code=host.dead_code, stopping=host.stopping, elapsed_s=self.t - host.claim_start, timeout_s=TIMEOUT_S
        )
        try:
            if isinstance(decide_host(HostState.CLAIMING, seen), Wait):
                for index in range(self.spawned[host.node]):
                    key = f"node{host.node}/spare{index}/claim"
                    if self.store.check(key):
                        continue
                    pid = self.store.read(f"node{host.node}/spare{index}/ready")
                    if pid is None or not pid.isdigit() or int(pid) not in self.procs:
                        continue
                    if self.store.compare_set(key, str(host.rank)):
                        taken = (index, int(pid))
                        break
            if taken is None:
                seen = replace(seen, every_rank_lost=self.store.add("lost", 0) >= self.world)
        except StoreDown as exc:
            seen = replace(seen, store_failed=str(exc))
        seen = replace(seen, claimed_pid=None if taken is None else taken[1])
        decision = decide_host(HostState.CLAIMING, seen)
        if isinstance(decision, Wait):
            return
        if isinstance(decision, Promote):
            assert taken is not None
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

    def _pool(self, node: int) -> None:
        """`SparePool.tick`: publish the codes of the node's dead spares, keep `spares` unclaimed ones."""
        try:
            unclaimed = 0
            for proc in self.procs.values():
                if proc.node != node or proc.spare is None:
                    continue
                if not proc.alive and f"exit/{proc.pid}" not in self.store.orders:
                    self.store.write(f"exit/{proc.pid}", str(proc.code))
                waiting = proc.alive and proc.spare_state in (SpareState.WARMING, SpareState.READY)
                # `SparePool._available`: a spare with any claim, even a forged one, is no spare of the pool
                if waiting and not self.store.check(f"node{node}/spare{proc.spare}/claim"):
                    unclaimed += 1
            first = self.procs[self.hosts[node * self.w.nproc].pid]
            if not first.stepped and self.spawned[node] == 0:
                return
            while unclaimed < self.w.spares:
                self._start(node, None)
                self.store.add(f"node{node}/spawned", 1)
                unclaimed += 1
        except StoreDown:
            return

    # -- invariants -----------------------------------------------------------------------------
    def _commit(self) -> None:
        """A generation training at full size commits a checkpoint (a collective of all its members)."""
        gens = {self.procs[h.pid].gen for h in self.hosts if self.procs[h.pid].alive}
        if len(gens) != 1:
            return
        gen = gens.pop()
        training = all(self.procs[h.pid].survivor is None and self.procs[h.pid].stepped for h in self.hosts)
        if training and gen < self.newest():
            raise Violation(f"generation {gen} committed a checkpoint after generation {self.newest()} formed")

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


def simulate(world: World, faults: list[Fault]) -> str:
    """Run one schedule; its outcome, or `Violation` naming the schedule so it replays."""
    faults = sorted(faults, key=lambda f: f.tick)
    try:
        return Sim(world, faults).run()
    except Violation as exc:
        raise Violation(f"{exc}\nreplay: simulate({world!r}, {faults!r})") from None


def random_schedule(rng: random.Random) -> tuple[World, list[Fault]]:
    nodes, nproc = rng.randint(1, 3), rng.randint(1, 3)
    if nodes * nproc < 2:
        nproc = 2
    world = World(nodes, nproc, rng.randint(0, 2), rng.randint(1, 6))
    faults = [Fault(rng.randint(0, MAX_TICK), rng.choice(KINDS), rng.randint(0, 50)) for _ in range(rng.randint(0, 5))]
    return world, faults


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


def test_seeded_schedules_hold_every_invariant_and_report_their_rate(capsys: object) -> None:
    rng = random.Random(34)
    started = time.perf_counter()
    outcomes: dict[str, int] = {}
    count = 1500
    for _ in range(count):
        world, faults = random_schedule(rng)
        outcome = simulate(world, faults).split(" (")[0].split(" in generation")[0]
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    rate = count / (time.perf_counter() - started) * 60
    with capsys.disabled():  # type: ignore[attr-defined]
        print(f"\nprotocol simulation: {rate:,.0f} schedules/minute; outcomes {dict(sorted(outcomes.items()))}")
    assert {"resumed", "group restart", "shutdown", "permanent"} <= set(outcomes)


faults_st = st.lists(st.builds(Fault, st.integers(0, MAX_TICK), st.sampled_from(KINDS), st.integers(0, 50)), max_size=6)
worlds_st = st.builds(World, st.integers(1, 3), st.integers(2, 3), st.integers(0, 2), st.integers(1, 6))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds_st, faults=faults_st)
def test_drawn_schedules_hold_every_invariant(world: World, faults: list[Fault]) -> None:
    simulate(world, faults)


if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    rng, done, start = random.Random(0), 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        simulate(*random_schedule(rng))
        done += 1
    print(f"{done / (time.perf_counter() - start) * 60:,.0f} schedules/minute ({done} in {seconds:g} s)")
