"""The per-rank host of in-place recovery: what torchrun starts when `restarts.mode` is `inplace`.

`python -m training` decides to be a host (`training.__main__`); the host runs the real trainer as
its child (the same command, `TORCHRIG_INPLACE_ROLE=trainer`) and watches it every 20 ms. What it does
next is `training.inplace.protocol.decide_host`'s decision (this module only carries it out):

- the trainer exits 0, with a permanent code (2, 3, 126, 127), `PREEMPTED` or `RECOVERY_FAILED`: the
  host exits with the same code (torchrun sees exactly what it would have seen);
- it dies before completing a step (a start-up crash, a spare failing at once): exit
  `RECOVERY_FAILED` (a spare would fail the same way; the group restart is bounded by `restarts.max`);
- the trainer left as an SDC suspect's node-mate whose node a standby node takes (`SDC_SUSPECT` with its
  signed `handed-over` mark): the host exits 0 without claiming a spare of the suspect node (`HandOver`);
- any other death (a signal, 1, 200, 201 from the watchdog): the host claims a ready spare of the
  node (an atomic compare-and-set of its `claim` key in the store), assigns it this rank and the
  next process-group generation, and from then on watches that process (a pidfd: the spare is the
  local-rank-0 host's child; that host publishes its exit code in the store). No spare ready within
  `restarts.inPlaceTimeoutSeconds`: it exits `RECOVERY_FAILED` and torchrun restarts the group
  (the fallback).

The host of local rank 0 also keeps `restarts.spares` spares per node started (from its trainer's first
completed step on, so they do not slow the trainers' start-up), replacing each one as soon as it is
claimed. A standby node's host (`TORCHRIG_INPLACE_STANDBY`, `training.inplace.standby`) starts its child
as a spare instead and waits: when the standby takes a lost node, it becomes that node's host for its
local rank, its child that rank's trainer. Signals: SIGTERM, SIGINT, SIGHUP, SIGUSR2 (torchrun's shutdown, a preemption
notice) and SIGUSR1 (stack dumps) are forwarded to the current trainer; after SIGTERM/SIGINT/SIGHUP
the host only waits for the trainer's exit code and passes it through, and ends its spares. Spares and
trainers die with their parent (`PR_SET_PDEATHSIG`), so a SIGKILLed host leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import Any

from training.contract import Env
from training.contract.orders import IDENTITY_ENV, Assignment, Promotion
from training.inplace import BEAT_S, FORGED_RETRY_S, ROLE_SPARE, ROLE_TRAINER, InPlace, KeyWait, forked
from training.inplace.protocol import (
    HOST_TRANSITIONS,
    REAL_CLOCK,
    ClaimSpare,
    Clock,
    Decision,
    FallBack,
    HandOver,
    HostObservation,
    HostState,
    PassThrough,
    Promote,
    Recovered,
    StandDown,
    Stop,
    Wait,
    decide_host,
    gives_back_lost,
    next_state,
)

__all__ = ["run_host"]

log = logging.getLogger(__name__)

POLL_S = 0.02
PROMOTION_WAIT_S = 24 * 86400.0  # a standby may stand by for the whole job
SPARE_TERM_GRACE_S = 10.0  # an unclaimed spare still alive this long after its SIGTERM is killed
STUCK_SPARE_S = 60.0  # an unclaimed spare not ready this long after its start (or the in-place timeout) is killed
POOL_RETRY_S = 5.0  # a spare pool whose tick failed (the store) tries again this much later
EXIT_CODE_WAIT_S = 2.0  # how long a host waits for a dead spare's exit code to be published
_FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2, signal.SIGUSR1)
_STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _status(code: int) -> int:
    """A `Popen.returncode` as an exit status (a signal death -N is 128 + N)."""
    return 128 - code if code < 0 else code


class _Watched:
    """A trainer process this host watches through a pidfd (readable once it exits; None before Linux
    5.3 or when the process is already gone)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        with contextlib.suppress(OSError):
            self._fd = os.pidfd_open(pid)

    def _sleep_on(self, fd: int | None, timeout_s: float) -> None:
        """Sleep `timeout_s`, or less: until `fd` (the pidfd) turns readable, i.e. the process exited."""
        if fd is None:
            time.sleep(timeout_s)
        else:
            select.select([fd], [], [], timeout_s)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _Child(_Watched):
    """The first trainer: this host's own child."""

    def __init__(self, proc: subprocess.Popen[bytes] | forked.Process) -> None:
        super().__init__(proc.pid)
        self.proc = proc

    def poll(self) -> int | None:
        code = self.proc.poll()
        return None if code is None else _status(code)

    def sleep(self, timeout_s: float) -> None:
        """Between two polls: `timeout_s`, cut short when the trainer exits (its death is seen at once,
        not up to a poll interval later: that wait was inside every recovery)."""
        self._sleep_on(self._fd, timeout_s)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)


class _Promoted(_Watched):
    """A spare that took this rank: watched through a pidfd, its exit code read from the store."""

    def __init__(self, pid: int, store: Any, inplace: InPlace) -> None:
        super().__init__(pid)
        self.store = store
        self.inplace = inplace
        self._dead_at: float | None = None

    def _exited(self) -> bool:
        if self._fd is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True
            return False
        ready, _, _ = select.select([self._fd], [], [], 0)
        return bool(ready)

    def poll(self) -> int | None:
        if self._dead_at is None:
            if not self._exited():
                return None
            self._dead_at = time.monotonic()
        try:
            code = self.inplace.read_int(self.store, self.inplace.exit_key(self.pid))
        except Exception:  # the store failed: as if unpublished (a traceback here made the host exit 1)
            code = None
        if code is not None and 0 <= code <= 255:
            return code
        if time.monotonic() - self._dead_at > EXIT_CODE_WAIT_S:
            return 128 + int(signal.SIGKILL)  # nobody saw its status: count it as a crash
        return None

    def sleep(self, timeout_s: float) -> None:
        """Between two polls: cut short when the spare exits, but not once it has (its pidfd stays
        readable while its exit code is awaited in the store)."""
        self._sleep_on(self._fd if self._dead_at is None else None, timeout_s)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)


class SparePool:
    """Local rank 0's host: keeps `spares` warm spares of this node started and reaps them.

    A claimed spare is another rank's trainer but still this host's child: the pool publishes its
    exit code (`InPlace.exit_key`) for the host that watches it, and waits for it before this host
    exits, so a finished rank 0 never takes a still-running rank down with it (`PR_SET_PDEATHSIG`).
    """

    def __init__(
        self,
        inplace: InPlace,
        store: Any,
        command: list[str],
        argv: list[str],
        first_trainer: int,
        *,
        first_index: int = 0,
    ) -> None:
        self.inplace = inplace
        self.store = store
        self.command = command
        self.argv = argv
        self.first_trainer = first_trainer
        self.first_index = first_index  # a standby taking a lost node's place numbers on from its spares
        self.spawned = first_index
        self.last_spawn = 0.0
        self.procs: dict[int, tuple[int, subprocess.Popen[bytes] | forked.Process]] = {}  # pid -> (index, process)
        self.started: dict[int, float] = {}  # pid -> when it was started, until it is known ready or claimed

    def tick(self, *, spawn: bool = True) -> None:
        """Publish the exit codes of spares that ended; start spares until `spares` unclaimed ones live
        (one that died before it was claimed is replaced too)."""
        for pid, (_, proc) in list(self.procs.items()):
            code = proc.poll()
            if code is not None:
                self.inplace.write(self.store, self.inplace.exit_key(pid), str(_status(code)))
                del self.procs[pid]
                self.started.pop(pid, None)
        if not spawn:
            return
        if self.spawned == self.first_index and not _stepped(self.store, self.inplace, self.first_trainer):
            return  # the first spares start once training runs: they would slow the trainers' start-up
        unclaimed = sum(1 for index, _ in self.procs.values() if self._available(index))
        waiting = int(self.store.add(self.inplace.waiting_key, 0)) > 0
        if unclaimed < self.inplace.spares and not waiting and int(self.store.add(self.inplace.lost_key, 0)) > 0:
            # A recovery is under way (a rank's replacement has not stepped yet) and no host of this node
            # waits for a spare: a new spare's start-up (model, rehearsed step) would take cores from the
            # members re-forming the group. It starts once the replacement has stepped.
            return
        if waiting and self._starting_too_long():
            unclaimed = 0  # a host waits and the spares starting seem stuck (seen: one never got ready)
            self._end_stuck(self.inplace.timeout_s / 3)
        elif self._end_stuck(max(self.inplace.timeout_s, STUCK_SPARE_S)):
            unclaimed = sum(1 for index, _ in self.procs.values() if self._available(index))
        while unclaimed < self.inplace.spares:
            env = {Env.INPLACE_ROLE: ROLE_SPARE, Env.INPLACE_SPARE: str(self.spawned)}
            proc = forked.start(self.command, self.argv, env)
            self.procs[proc.pid] = (self.spawned, proc)
            self.started[proc.pid] = time.monotonic()
            self.spawned += 1
            self.store.add(self.inplace.spawned_key, 1)
            self.last_spawn = time.monotonic()
            unclaimed += 1

    def _starting_too_long(self) -> bool:
        """No spare of this pool is ready and unclaimed, and the newest was started a third of the
        in-place timeout ago: start another one beside it."""
        for index, _ in self.procs.values():
            if not self._claimed(index) and self._ready(index):
                return False
        return time.monotonic() - self.last_spawn > self.inplace.timeout_s / 3

    def _end_stuck(self, after_s: float) -> bool:
        """SIGKILL every unclaimed spare that is not ready `after_s` after its start, so that it no longer
        counts as one of the pool's spares; returns whether one was. Seen once in ~100 recoveries: a spare
        deadlocked for good at the end of its rehearsal step (gloo's process group destroyed under the GIL
        while a worker thread waited for it to drop a comm hook's callback), and every later recovery then
        waited a third of the in-place timeout for a spare started beside it."""
        now, ended = time.monotonic(), False
        for pid, (index, proc) in list(self.procs.items()):
            if pid not in self.started or now - self.started[pid] < after_s or proc.poll() is not None:
                continue
            if self._claimed(index) or self._ready(index):
                del self.started[pid]  # ready or claimed: never looked at again (no store request per tick)
                continue
            claim_key = self.inplace.spare_key(index, "claim")
            stuck = self.inplace.sign(claim_key, "stuck")
            if self.store.compare_set(claim_key, "", stuck).decode() != stuck:
                continue  # a host claimed it just now
            log.warning(
                "in-place: spare %d (pid %d) not ready after %.0f s; killing it", index, pid, now - self.started[pid]
            )
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            ended = True
        return ended

    def _available(self, index: int) -> bool:
        """Whether spare `index` can still be claimed: it has no claim key at all. A forged claim (no MAC)
        makes a spare unusable as a real one does (`_take_ready_spare` skips it), so such a spare is no
        spare of the pool: another one starts beside it (it is ended with the pool). Counted as available,
        it left the node without a usable spare, and the next death waited out the claim timeout."""
        return not self.store.check([self.inplace.spare_key(index, "claim")])

    def _claimed(self, index: int) -> bool:
        """Claimed by a process of this job (a forged claim is none: such a spare is ended with the pool)."""
        return self.inplace.read(self.store, self.inplace.spare_key(index, "claim")) is not None

    def _ready(self, index: int) -> bool:
        return self.inplace.read(self.store, self.inplace.spare_key(index, "ready")) is not None

    def _claimed_quietly(self, index: int) -> bool:
        """`_claimed`, True when the store cannot say (a claimed spare is another rank's trainer: never
        killed on a guess)."""
        try:
            return self._claimed(index)
        except Exception:
            return True

    def signal(self, sig: int, *, claimed: bool = True) -> None:
        for index, proc in self.procs.values():
            if claimed or not self._claimed(index):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    def close(self) -> None:
        """End the unclaimed spares and wait for the claimed ones (other ranks' trainers: their own
        hosts forward torchrun's shutdown to them, a second SIGTERM would cut a preemption save short)."""
        with contextlib.suppress(Exception):  # the store may be gone with the run
            self.signal(signal.SIGTERM, claimed=False)
        killed_at: float | None = time.monotonic() + SPARE_TERM_GRACE_S
        while self.procs:
            if killed_at is not None and time.monotonic() > killed_at:
                killed_at = None  # an unclaimed spare that outlives its SIGTERM must not keep the node up
                for index, proc in self.procs.values():
                    if not self._claimed_quietly(index):
                        log.warning("in-place: spare %d (pid %d) ignored SIGTERM; killing it", index, proc.pid)
                        with contextlib.suppress(ProcessLookupError):
                            proc.send_signal(signal.SIGKILL)
            try:
                self.tick(spawn=False)
            except Exception:
                # The store failed: the claimed spares are still other ranks' trainers (this host's exit
                # would kill them), so they are still waited for; their codes go unpublished (their hosts
                # count an unpublished code as a crash).
                for pid, (_, proc) in list(self.procs.items()):
                    if proc.poll() is not None:
                        del self.procs[pid]
            time.sleep(POLL_S)
        for _, proc in self.procs.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)


def _take_ready_spare(inplace: InPlace, store: Any, rank: int) -> tuple[int, int] | None:
    """(index, pid) of a ready spare this call claimed (an atomic compare-and-set), else None. A spare
    counts as ready only when its pid is signed (a forged one would have this host watch and signal any
    process); a forged claim makes that spare unusable, as a deleted key would."""
    for index in range(inplace.spares_started(store)):
        claim_key = inplace.spare_key(index, "claim")
        if store.check([claim_key]):
            continue
        pid = inplace.read_int(store, inplace.spare_key(index, "ready"))
        if pid is None or pid <= 1:
            continue
        mine = inplace.sign(claim_key, str(rank))
        if store.compare_set(claim_key, "", mine).decode() == mine:
            return index, pid
    return None


def every_rank_lost(inplace: InPlace, store: Any) -> bool:
    """Whether every rank has lost its trainer (`InPlace.lost_key`): no survivor holds the state. Once seen
    it stays seen (`InPlace.all_lost_key`): the host that saw it gives its count back as it falls back."""
    world_size = int(os.environ.get(Env.WORLD_SIZE, "0") or 0)
    return world_size > 0 and every_rank_lost_in(store, inplace.lost_key, inplace.all_lost_key, world_size)


def every_rank_lost_in(store: Any, lost_key: str, all_lost_key: str, world_size: int) -> bool:
    """The lost count at `world_size` now, or seen there before (the latch `all_lost_key`, set here)."""
    if int(store.add(lost_key, 0)) >= world_size:
        store.add(all_lost_key, 1)
        return True
    return int(store.add(all_lost_key, 0)) > 0


def claim_spare(
    inplace: InPlace, store: Any, rank: int, pool: SparePool | None, beat: _Beat | None = None
) -> int | None:
    """Claim a ready spare of this node and assign it `rank`; its pid, or None when none got ready in
    time or every rank lost its trainer (nothing left to recover from in memory)."""
    decision = _claim(inplace, store, rank, pool, beat)
    return decision.pid if isinstance(decision, Promote) else None


def _claim(
    inplace: InPlace,
    store: Any,
    rank: int,
    pool: SparePool | None,
    beat: _Beat | None = None,
    *,
    code: int | None = None,
    stopping: Callable[[], bool] = lambda: False,
    clock: Clock = REAL_CLOCK,
) -> Decision:
    """Claim a ready spare of this node until `decide_host` says otherwise (`HostState.CLAIMING`); on
    `Promote` the spare is assigned `rank` and the next generation. `code`: what the trainer died of.

    `beat`: this node's heartbeat when this host keeps it (local rank 0). It beats on while it waits:
    a wait of over `HOST_LOST_S` for a spare still starting (a loaded machine) made the members count
    the whole node lost and restart the group (seen in the 100-recovery soak run beside other tests).
    """
    started = clock.monotonic()
    try:
        store.add(inplace.waiting_key, 1)
    except Exception as exc:
        return decide_host(HostState.CLAIMING, HostObservation(exit_code=code, store_failed=str(exc)))
    try:
        while True:
            # One look: first whether to go on at all (a shutdown, the timeout), then a claim (a spare this
            # look claimed is always assigned: `decide_host` promotes it), and only when none was ready the
            # lost count (a store request the common case, a spare ready at once, does without).
            taken: tuple[int, int] | None = None
            seen = HostObservation(
                exit_code=code, stopping=stopping(), elapsed_s=clock.monotonic() - started, timeout_s=inplace.timeout_s
            )
            try:
                if isinstance(decide_host(HostState.CLAIMING, seen), Wait):
                    taken = _take_ready_spare(inplace, store, rank)
                if taken is None:
                    seen = replace(seen, every_rank_lost=every_rank_lost(inplace, store))
            except Exception as exc:  # the store is gone: nothing to recover in place with
                seen = replace(seen, store_failed=f"{type(exc).__name__}: {exc}")
            decision = decide_host(HostState.CLAIMING, replace(seen, claimed_pid=None if taken is None else taken[1]))
            if isinstance(decision, Promote) and taken is not None:
                break
            if not isinstance(decision, Wait):
                return decision
            if beat is not None:
                beat.tick()
            if pool is not None:
                with contextlib.suppress(Exception):  # a store error shows at the next look
                    pool.tick()  # this host starts the spares: the one to claim may not exist yet
            clock.sleep(POLL_S)
    finally:
        with contextlib.suppress(Exception):
            store.add(inplace.waiting_key, -1)
    index, pid = taken
    try:
        inplace.write(store, inplace.owner_key(rank), str(pid))
        dead_gen = max(0, inplace.read_int(store, inplace.rank_gen_key(rank)) or 0)
        identity = {name: os.environ[name] for name in IDENTITY_ENV if name in os.environ}
        # Checked here as the spare will check it: an identity it would refuse fails this recovery at once.
        assignment = Assignment.parse(Assignment(env=identity, generation=dead_gen + 1).to_json())
        inplace.write(store, inplace.spare_key(index, "assign"), assignment.to_json())
    except Exception as exc:
        return FallBack(f"assigning spare {index} failed: {type(exc).__name__}: {exc}")
    print(
        f"torchrig: in-place: rank {rank}'s trainer died; spare {index} (pid {pid}) takes its place "
        f"in generation {dead_gen + 1}",
        file=sys.stderr,
        flush=True,
    )
    return decision


class _Beat:
    """This node's heartbeat (`InPlace.beat_key`), kept by its local-rank-0 host: one `add` every `BEAT_S`."""

    def __init__(self, inplace: InPlace, store: Any) -> None:
        self.store = store
        self.key = inplace.beat_key(inplace.node_rank)
        self.next = 0.0
        self.warned = False

    def tick(self) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + BEAT_S
        try:
            self.store.add(self.key, 1)
        except Exception as exc:  # cut off from the store: peers will count this node lost, rightly
            if not self.warned:
                log.warning("in-place: the heartbeat failed: %s", exc)
                self.warned = True


def _count_lost(store: Any, inplace: InPlace, rank: int) -> bool:
    """Count `rank` among the ranks that lost their trainer (`InPlace.lost_key`), unless another host
    already did (`InPlace.rank_lost_key`); whether it is counted now (this host then gives it back)."""
    key = inplace.rank_lost_key(rank)
    mine = inplace.sign(key, str(os.getpid()))
    try:
        held = store.compare_set(key, "", mine).decode(errors="replace")
        if held == mine:
            store.add(inplace.lost_key, 1)
        # A mark this job did not sign counts nothing: giving it back would take another rank's count.
        return held == mine or inplace.open(key, held.encode()) is not None
    except Exception as exc:  # a store error shows at the host's next request
        log.warning("in-place: rank %d could not be counted lost: %s", rank, exc)
        return False


def _uncount_lost(store: Any, inplace: InPlace, rank: int) -> bool:
    """Take `rank` out of the lost count (once, whichever host counted it); whether it is out of it now."""
    try:
        if store.delete_key(inplace.rank_lost_key(rank)):
            store.add(inplace.lost_key, -1)
    except Exception as exc:
        log.warning("in-place: rank %d could not be taken out of the lost count: %s", rank, exc)
        return False
    return True


def _look_at_lost(
    store: Any, inplace: InPlace, rank: int, state: HostState, seen: HostObservation, pid: int, stepped_pid: int
) -> tuple[int, bool]:
    """A training host's look at its rank's lost count (`gives_back_lost`): whether trainer `pid` stepped (read
    until seen once: `stepped_pid`), then the count given back if the policy says so. Returns the trainer seen
    stepped and whether the count is out now (given back by this look)."""
    if stepped_pid != pid and _stepped(store, inplace, pid):
        stepped_pid = pid
    if gives_back_lost(state, replace(seen, stepped=stepped_pid == pid)):
        return stepped_pid, _uncount_lost(store, inplace, rank)
    return stepped_pid, False


def _stepped(store: Any, inplace: InPlace, pid: int) -> bool:
    return _marked(store, inplace, inplace.stepped_key(pid))


def _marked(store: Any, inplace: InPlace, key: str) -> bool:
    """Whether the (signed) mark `key` is set; False without a store (no in-place recovery then)."""
    try:
        return inplace.read(store, key) is not None
    except Exception:
        return False


def _await_promotion(
    inplace: InPlace, store: Any, local_rank: int, child: _Child | _Promoted, stopping: Any
) -> tuple[InPlace, int] | None:
    """A standby host: wait until the standby takes a lost node (`InPlace.promote_key`); then this
    process is that node's host of local rank `local_rank` (its environment, its node's keys) and its
    spare child, assigned the same rank by the standby, is its trainer. Returns the lost node's
    `InPlace` and the index its next spare takes; None when the spare died or `stopping()` first."""
    key = inplace.promote_key(local_rank)
    # One blocking wait on a connection of its own (`KeyWait`), not a read of the key every POLL_S; the
    # loop below only looks at local things: the flag, a shutdown, the spare's exit (through its pidfd).
    promoted = KeyWait(inplace.connect, key, PROMOTION_WAIT_S)
    while True:
        # Set (or the wait failed: read the key, as before). Forged orders are ignored: the standby's own
        # overwrite is read at a later look.
        looked = promoted.done.is_set() or (promoted.failed is not None and store.check([key]))
        orders = inplace.read_order(store, key, Promotion.parse) if looked else None
        seen = HostObservation(stopping=stopping(), exit_code=child.poll(), promoted=orders is not None)
        decision = decide_host(HostState.STANDING_BY, seen)
        if isinstance(decision, StandDown):
            return None
        if isinstance(decision, Promote) and orders is not None:
            break
        child.sleep(FORGED_RETRY_S if looked else POLL_S)
    os.environ.update(orders.env)
    os.environ.pop(Env.INPLACE_STANDBY, None)
    return dataclasses.replace(inplace, node_rank=orders.node), orders.next_spare


def run_host(
    inplace: InPlace, argv: list[str], *, on_main_thread: Callable[[Callable[[], None]], None] | None = None
) -> int:
    """Run this rank's trainer, replace it with a spare when it dies; returns the exit status.

    `on_main_thread`: where the host runs outside the main thread (a Ray Train worker,
    `training.ray_train`), how to run a function there: the signal forwarding is installed through it.
    """
    rank = int(os.environ.get(Env.RANK, "0"))
    local_rank = int(os.environ.get(Env.LOCAL_RANK, "0"))
    command = [sys.executable, "-m", "training", *argv]
    # The trainer and every spare are forked from this interpreter once it has imported their stack
    # (`training.inplace.forked`), before this host opens its store connection.
    forked.remember_signal_handlers(_FORWARD)
    forked.warm_up()
    standby = Env.INPLACE_STANDBY in os.environ
    # A standby node's host (`training.inplace.standby`) starts its child as a spare of its own, which
    # it hands a lost node's rank when the standby takes that node's place.
    first = {Env.INPLACE_ROLE: ROLE_SPARE, Env.INPLACE_SPARE: str(local_rank)} if standby else {}
    current: _Child | _Promoted = _Child(forked.start(command, argv, first or {Env.INPLACE_ROLE: ROLE_TRAINER}))
    store = inplace.connect()
    stopping = False

    def _forward(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if signum in _STOPPING:
            stopping = True
        current.signal(signum)

    def _install_forwarding() -> None:
        for sig in _FORWARD:
            signal.signal(sig, _forward)

    if on_main_thread is None:
        _install_forwarding()
    else:
        on_main_thread(_install_forwarding)
    state = HostState.STANDING_BY if standby else HostState.TRAINING
    first_index = 0
    counted = False  # this host counted its rank lost (`lost_key`) and has not taken it back
    handed_over = False  # its node's ranks went to a standby node (`HandOver`): the node did not end
    if standby:
        promoted = _await_promotion(inplace, store, local_rank, current, lambda: stopping)
        if promoted is None:  # the spare died, or a shutdown signal came first
            current.close()
            seen = HostObservation(stopping=stopping, exit_code=current.poll())
            return _carry_out_exit(decide_host(state, seen), rank)
        state = next_state(HOST_TRANSITIONS, state, Promote(0))
        inplace, first_index = promoted
        rank = int(os.environ[Env.RANK])
        # This rank's trainer was lost with its node; the spare replaces it. A store error here is the
        # spare's to meet (it joins through the store): the count is then simply not taken.
        counted = _count_lost(store, inplace, rank)
    elif local_rank == 0:
        inplace.write(store, inplace.restart_count_key(inplace.node_rank), os.environ.get(Env.RESTART_COUNT, "0"))
    pool = SparePool(inplace, store, command, argv, current.pid, first_index=first_index) if local_rank == 0 else None
    beat = _Beat(inplace, store) if local_rank == 0 else None  # one beat per node (`InPlace.beat_key`)
    next_tick = 0.0
    # Its rank's lost count is looked at now and then (`gives_back_lost`): one a host killed while it counted
    # the rank is given back by the host whose trainer trains. `stepped_pid`: the trainer seen stepped.
    next_lost_look, stepped_pid = time.monotonic() + inplace.timeout_s, 0
    try:
        while True:
            if beat is not None:
                beat.tick()
            # The pool reads a few keys per tick: once a beat, not at every look at the trainer (every
            # POLL_S was ~200 store requests a second per node, 200k/s on one store at 1,000 nodes).
            if pool is not None and not stopping and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + BEAT_S
                try:
                    pool.tick()
                except Exception as exc:  # the store failed: tried again later (a store gone ends the run)
                    log.warning("in-place: the spare pool's tick failed: %s", exc)
                    next_tick = time.monotonic() + POOL_RETRY_S
            code = current.poll()
            # A replacement that has not stepped yet is asked at every look (it ends the rank's `lost`
            # count); otherwise only a dead trainer's step matters, and nothing once stopping (only the
            # trainer's own code is awaited then: a store cut off must not hold torchrun's SIGTERM up).
            watching = state is HostState.WATCHING_SPARE
            asks = state is not HostState.STOPPING
            stepped = asks and (watching or code is not None) and _stepped(store, inplace, current.pid)
            finished = asks and code not in (None, 0) and _marked(store, inplace, inplace.finished_key(current.pid))
            handed = asks and code not in (None, 0) and _marked(store, inplace, inplace.handed_over_key(current.pid))
            seen = HostObservation(
                exit_code=code, stepped=stepped, finished=finished, stopping=stopping, handed_over=handed
            )
            if state is HostState.TRAINING and code is None and not stopping and time.monotonic() >= next_lost_look:
                next_lost_look = time.monotonic() + inplace.timeout_s
                stepped_pid, given_back = _look_at_lost(store, inplace, rank, state, seen, current.pid, stepped_pid)
                counted = counted and not given_back
            decision = decide_host(state, seen)
            if isinstance(decision, ClaimSpare):
                if not counted:  # a replacement not yet stepped is counted lost already
                    counted = _count_lost(store, inplace, rank)  # a store error shows while claiming
                state = next_state(HOST_TRANSITIONS, state, decision)
                decision = _claim(inplace, store, rank, pool, beat, code=code, stopping=lambda: stopping)
            state = next_state(HOST_TRANSITIONS, state, decision)
            if isinstance(decision, Wait | Stop):
                current.sleep(POLL_S)
            elif isinstance(decision, Recovered):
                counted = counted and not _uncount_lost(store, inplace, rank)
            elif isinstance(decision, Promote):
                current.close()
                current = _Promoted(decision.pid, store, inplace)
            else:
                handed_over = isinstance(decision, HandOver)
                return _carry_out_exit(decision, rank)
    finally:
        current.close()
        if counted:
            # Its rank is no longer this host's to recover: a standby's host whose spare never stepped (the
            # node was only cut off, and its own trainer trains on) gives the count back, else every spare
            # pool would go on starting spares only once a host already waits.
            _uncount_lost(store, inplace, rank)
        if local_rank == 0 and not handed_over:  # this node ended, it was not lost: no standby takes its place
            with contextlib.suppress(Exception):
                inplace.write(store, inplace.ended_key(inplace.node_rank), "1")
        if pool is not None:
            pool.close()


def _carry_out_exit(decision: Decision, rank: int) -> int:
    """The exit code of a host's last decision, saying why on stderr when it falls back to a group restart."""
    if isinstance(decision, FallBack):
        print(f"torchrig: in-place: rank {rank}: {decision.reason}; the group restarts", file=sys.stderr, flush=True)
    if isinstance(decision, HandOver):
        print(
            f"torchrig: in-place: rank {rank}: a standby node takes this node's ranks (an SDC suspect's node); "
            "this host leaves",
            file=sys.stderr,
            flush=True,
        )
    code = decision.exit_code
    assert isinstance(decision, PassThrough | FallBack | StandDown | HandOver) and code is not None, decision
    return code
