"""The trainer's side of in-place recovery: process-group generations on the long-lived store, and
the state transfer from the most advanced rank.

Generation g's default process group is `init_process_group(store=PrefixStore("pg/g/", store))`.
After a failure every member (the survivors and the spares that took the dead ranks' places) joins
g+1: a counter in the store (`join/g+1`) must reach the world size within
`restarts.inPlaceTimeoutSeconds`, else `RecoveryFailed` (the trainer exits `RECOVERY_FAILED` and
torchrun restarts the group). The member whose join completes the count sets `join/g+1/formed`; the
others wait for that key in one blocking store wait each (`KeyWait`), so a forming generation costs
the store O(world) requests, not O(world) every few milliseconds. Then every rank all-gathers its
completed step (-1: a spare), and the lowest rank among the most advanced broadcasts its progress (JSON)
and sends model and optimizer to the ranks behind it (`torch.save` bytes read with `weights_only=True`:
exact bytes, and no pickle from a peer: `training.inplace.exchange`); they load them.

Which values in the store are orders (signed, `InPlace.write`/`read`) and which are counters (`add`: no
MAC) is decided per key; of the counters read here, forging one can do this much and no more:

- `join/<g>` pushed past the world size: the members stop waiting and create the process group, whose own
  rendezvous (every rank's address under `pg/<g>/`) still waits for every rank; a rank that never comes
  makes it time out: `RecoveryFailed`, a group restart. `join/<g>/formed` (a plain key) is the same.
- `standbys` above 0: the members wait `STANDBY_GRACE_S` longer before they give a lost node up.
- a node's `beat` kept moving: a lost node is given up only at the in-place timeout; a beat cannot be
  stopped by a client (only deleted, which makes every watch see nothing: the same timeout).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import PrefixStore

from training.contract import WorkerIdentity
from training.inplace import BEAT_S, BEHIND_LOST_S, HOST_LOST_S, STANDBY_GRACE_S, InPlace, KeyWait, exchange, sockets
from training.inplace.protocol import (
    Decision,
    FallBack,
    Formed,
    FormObservation,
    HandoverObservation,
    decide_form,
    decide_handover,
)

__all__ = [
    "InPlaceGroup",
    "NodeWatch",
    "RecoveryFailed",
    "StateSync",
    "freeze_heap",
    "is_peer_failure",
]

log = logging.getLogger(__name__)

_PEER_MARKERS = ("gloo", "connection", "peer", "broken pipe", "socket", "timed out", "nccl", "closed")


def freeze_heap() -> None:
    """Move every object alive now into the collector's permanent generation (`gc.freeze`).

    Called once a process has imported torch and built what it keeps (before its first process group):
    the hundreds of thousands of objects of the imports are then never scanned again, so the
    `gc.collect` of each recovery (`InPlaceGroup.leave`) only walks what was made since. Frozen objects
    are still freed by reference counting; only cycles among them are never collected.
    """
    gc.freeze()


class RecoveryFailed(RuntimeError):
    """The new generation did not form in time: the group must restart (the fallback)."""


class LeftForSpare(RuntimeError):
    """This rank leaves so that a warm spare takes its rank (`decision`, from `protocol.decide_sdc`: the
    replicas' majority named it the suspect of a disagreement); the process exits `decision.exit_code`."""

    def __init__(self, decision: Decision, message: str) -> None:
        super().__init__(message)
        self.decision = decision


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` looks like a collective that failed because a peer went away (not a bug here)."""
    if isinstance(exc, RecoveryFailed):
        return False
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in text for marker in _PEER_MARKERS)


@dataclass(frozen=True)
class StateSync:
    """What the state transfer of one generation found."""

    step: int  # the newest completed step, which every rank now holds
    source: int  # the rank that sent it
    replaced: list[int]  # ranks that held no state (spares)
    progress: dict[str, Any]  # the source's `TrainerProgress.state_dict()`
    bucket_order: list[int] | None = None  # the source's DDP bucket layout (`Parallel.bucket_order`)
    rollback: bool = False  # after an SDC: every member reloads the newest certified checkpoint next


def nodes_behind(store: Any, inplace: InPlace, world: int, nproc: int, generation: int | None = None) -> set[int]:
    """The nodes every one of whose ranks is behind `generation` (default: the newest any rank joined),
    from the ranks' `InPlace.rank_gen_key`s in one `multi_get`; ranks are `node * nproc + local_rank`. A
    forged value counts as the newest generation: it never makes a node look behind."""
    keys = [inplace.rank_gen_key(rank) for rank in range(world)]
    if not store.check(keys):
        return set()
    opened = [inplace.open(key, raw) for key, raw in zip(keys, store.multi_get(keys), strict=True)]
    known = [int(v) for v in opened if v is not None and v.isdigit() and len(v) < 10]
    newest = (max(known) if known else 0) if generation is None else generation
    joined = [int(v) if v is not None and v.isdigit() and len(v) < 10 else newest for v in opened]
    nodes = range(world // max(nproc, 1))
    return {n for n in nodes if all(g < newest for g in joined[n * nproc : (n + 1) * nproc])}


class NodeWatch:
    """Which nodes are gone, from their beat counters (`InPlace.beat_key`), read every `BEAT_S` in one
    `multi_get`.

    A node is gone when its counter stood still for `HOST_LOST_S` of this watcher's own time, or for
    `BEHIND_LOST_S` while `behind()` names it (its ranks never joined the generation the others are
    forming: the broken group confirms the silence). A watcher that was itself held up (its checks more
    than a second apart: a loaded machine, a pause) starts its clocks over instead of blaming the others
    for its own stall.
    """

    def __init__(
        self,
        store: Any,
        inplace: InPlace,
        nodes: int,
        *,
        lost_after_s: float = HOST_LOST_S,
        behind: Callable[[], set[int]] | None = None,
    ) -> None:
        self.store = store
        self.keys = [inplace.beat_key(node) for node in range(nodes)]
        self.lost_after_s = lost_after_s
        self.behind = behind
        self.seen: dict[int, tuple[bytes, float]] = {}  # node -> (counter, when it last moved)
        # The first read one beat from now: a generation that forms faster (the common case, ~0.1 s)
        # costs the store nothing extra.
        self.last_check = time.monotonic()

    def lost(self) -> list[int]:
        """The nodes whose beat stopped (checked at most every `BEAT_S`; [] in between, and while some
        node has not beaten yet)."""
        now = time.monotonic()
        if now - self.last_check < BEAT_S:
            return []
        if now - self.last_check > 1.0:
            self.seen.clear()  # this watcher stalled: no clock to trust yet
        self.last_check = now
        if not self.store.check(self.keys):
            return []
        gone, quiet = [], []
        for node, count in enumerate(self.store.multi_get(self.keys)):
            before = self.seen.get(node)
            if before is None or before[0] != count:
                self.seen[node] = (count, now)
            elif now - before[1] >= self.lost_after_s:
                gone.append(node)
            elif now - before[1] >= BEHIND_LOST_S:
                quiet.append(node)
        if quiet and self.behind is not None:
            behind = self.behind()
            gone = sorted([*gone, *(n for n in quiet if n in behind)])
        return gone

    def silent_for(self, node: int) -> float:
        """How long `node`'s beat has stood still, as of the last check."""
        before = self.seen.get(node)
        return 0.0 if before is None else self.last_check - before[1]


class InPlaceGroup:
    """This rank's membership in the generations of the default process group.

    Args:
        inplace: Where the bookkeeping lives.
        identity: This rank.
        backend: `gloo` or `nccl`.
    """

    def __init__(self, inplace: InPlace, identity: WorkerIdentity, backend: str) -> None:
        self.inplace = inplace
        self.identity = identity
        self.backend = backend
        self.store = inplace.connect()
        self.generation = -1
        # The connections of this generation's groups (the default one here, the checkpoint manager's
        # and the preemption agreement's where they are built), cut by `leave`.
        self.ledger = sockets.SocketLedger()
        sockets.active(self.ledger)

    def form(
        self, generation: int, *, timeout_s: float | None = None, cancelled: Callable[[], bool] | None = None
    ) -> None:
        """Join generation `generation` and create its default process group.

        Args:
            generation: The generation to join.
            timeout_s: How long the members may take to join (default `restarts.inPlaceTimeoutSeconds`).
            cancelled: Polled while waiting: True gives up at once (a shutdown signal arrived: torchrun
                is restarting the group, say after a whole node was lost).

        Raises:
            RecoveryFailed: not every member joined within the timeout, or `cancelled`.
        """
        rank, world = self.identity.rank, self.identity.world_size
        limit = timeout_s if timeout_s is not None else self.inplace.timeout_s
        base = FormObservation(generation, world, rank, pid=os.getpid(), limit_s=limit)

        def give_up_if_cancelled() -> None:
            # Asked before each of the requests below, not only in the wait: on a machine cut off from the
            # store each one waits out the store's timeout, and a stopped member's host holds torchrun's
            # SIGTERM until its trainer exits (the simulator's "stop-while-forming").
            stop = cancelled is not None and cancelled()
            if isinstance(decision := decide_form(replace(base, cancelled=stop)), FallBack):
                raise RecoveryFailed(decision.reason)

        give_up_if_cancelled()
        owner = self.inplace.read(self.store, self.inplace.owner_key(rank)) if generation > 0 else None
        look = replace(base, owner=owner)
        if isinstance(decision := decide_form(look), FallBack):
            raise RecoveryFailed(decision.reason)
        give_up_if_cancelled()
        self.inplace.write(self.store, self.inplace.rank_gen_key(rank), str(generation))
        if generation > 0:
            # The owner's look above and this join are two requests: a standby that took this node in
            # between gave the rank to its own spare. One seat per rank: the first join wins, the other
            # stands down before it is counted.
            seat_key = self.inplace.seat_key(generation, rank)
            mine = self.inplace.sign(seat_key, str(os.getpid()))
            held = self.store.compare_set(seat_key, "", mine)
            seat = str(os.getpid()) if held.decode(errors="replace") == mine else self._seat(seat_key, held)
            if isinstance(decision := decide_form(replace(look, seat=seat)), FallBack):
                raise RecoveryFailed(decision.reason)
        key = self.inplace.join_key(generation)
        joined = int(self.store.add(key, 1))
        if generation > 0 and isinstance(decide_form(replace(look, joined=joined)), Formed):
            self.store.set(self.inplace.formed_key(generation), "1")  # the last member: wakes the others
        elif generation > 0:  # generation 0 starts with the job: init_process_group's own wait covers it
            # A survivor blocked on a live peer learns of the failure only through its collective's
            # timeout (below): the first ones wait that long for it, plus the time the spare takes.
            started = time.monotonic()
            lost_key = self.inplace.nodes_lost_key(generation)
            # Two members watch the nodes' beats (the first and the last rank: on different nodes when
            # there are several) and tell the others through one key: O(nodes) reads per check, not
            # O(world x nodes).
            watch = None
            if rank in (0, world - 1):
                # A ready standby node takes a lost node's ranks once its beat stood still `BEHIND_LOST_S`
                # with its ranks behind, or `HOST_LOST_S` (`training.inplace.standby`): give it the longer
                # and a margin before giving up.
                standby = int(self.store.add(self.inplace.standbys_key(), 0)) > 0
                after = HOST_LOST_S + (STANDBY_GRACE_S if standby else 0.0)
                ident = self.identity
                watch = NodeWatch(
                    self.store,
                    self.inplace,
                    ident.num_nodes,
                    lost_after_s=after,
                    # Without a standby, a node whose ranks never came is given up after BEHIND_LOST_S (the
                    # group restart comes sooner); with one, the standby takes it on the same evidence first.
                    behind=None
                    if standby
                    else lambda: nodes_behind(self.store, self.inplace, world, ident.local_world_size, generation),
                )
            next_look = time.monotonic() + BEAT_S  # a generation formed within a beat reads no extra key
            formed = KeyWait(self.inplace.connect, self.inplace.formed_key(generation), 2 * limit + 1)
            lost: str | None = None
            # 5 ms slices: the shutdown signal and the node watch are local or rate-limited reads. The
            # counter is read once a beat, and every slice only if the wait itself failed.
            while True:
                done = formed.done_within(0.005)
                stop = not done and cancelled is not None and cancelled()
                if not done and not stop:
                    if watch is not None and (gone := watch.lost()):
                        silent = min(watch.silent_for(n) for n in gone)
                        found = f"node(s) {gone} stopped beating for {silent:.1f} s (lost or cut off)"
                        self.store.compare_set(lost_key, "", self.inplace.sign(lost_key, found))
                    now = time.monotonic()
                    if now >= next_look or formed.failed is not None:
                        next_look = now + BEAT_S
                        joined = int(self.store.add(key, 0))
                        lost = None if joined >= world else self.inplace.read(self.store, lost_key)
                seen = replace(
                    look,
                    owner=None,
                    joined=joined,
                    formed=done,
                    cancelled=stop,
                    nodes_lost=lost,
                    elapsed_s=time.monotonic() - started,
                )
                decision = decide_form(seen)
                if isinstance(decision, FallBack):
                    raise RecoveryFailed(decision.reason)
                if isinstance(decision, Formed):
                    if decision.announce:
                        # Which ends this member's own wait (its thread and connection) and wakes the other
                        # members now instead of at their next beat.
                        self.store.set(self.inplace.formed_key(generation), "1")
                    break
        pg_store = PrefixStore(self.inplace.pg_prefix(generation), self.store)
        # The collective timeout is the last resort only: a survivor blocked on a live peer learns of a
        # failure when that peer cuts its connections (`leave`), a hung rank is ended by its watchdog.
        with self.ledger.recording():
            dist.init_process_group(
                backend=self.backend, store=pg_store, rank=rank, world_size=world, timeout=timedelta(seconds=limit)
            )
        self.generation = generation

    def _seat(self, key: str, held: bytes) -> str:
        """Who holds a seat this process did not win: a pid, or what a value this job did not sign is."""
        holder = self.inplace.open(key, held)
        return f"pid {holder}" if holder is not None else "a process whose seat is not signed by this job"

    def mark_stepped(self) -> None:
        """This process completed a step (its host may replace it in place from now on)."""
        self.inplace.write(self.store, self.inplace.stepped_key(os.getpid()), "1")

    def sdc_handover(self, suspects: tuple[int, ...], decided: bool) -> int | None:
        """After a replica disagreement (every rank calls it): the node a ready standby node takes
        (`protocol.decide_handover`), the same answer on every rank. Each rank proposes with one
        compare-and-set of `InPlace.sdc_handover_key` (the first proposal stored wins); the node handed
        over is then recorded in `InPlace.handover_key` for the standbys. A store that fails, or a value
        this job did not sign, hands nothing over (the suspects' own nodes' spares take their ranks)."""
        inplace, store, ident = self.inplace, self.store, self.identity
        try:
            ready = int(store.add(inplace.standbys_key(), 0))
            seen = HandoverObservation(suspects, decided, ident.world_size, ident.local_world_size, ready)
            proposal = decide_handover(seen)
            key = inplace.sdc_handover_key(self.generation)
            mine = inplace.sign(key, str(-1 if proposal is None else proposal))
            held = inplace.open(key, store.compare_set(key, "", mine))
            node = int(held) if held is not None and held.lstrip("-").isdigit() and len(held) < 10 else -1
            if node < 0 or node >= ident.world_size // max(1, ident.local_world_size):
                return None
            record = json.dumps({"node": node, "generation": self.generation})
            inplace.write(store, inplace.handover_key(), record)
        except Exception as exc:
            log.warning("sdc: the hand-over to a standby node was not decided (%s); spares of the node instead", exc)
            return None
        return node

    def mark_handed_over(self) -> None:
        """This process leaves because a standby node takes its node's ranks: its host exits 0 instead of
        claiming a spare of this node (`protocol.HandOver`). Best effort: without it the host claims one."""
        with contextlib.suppress(Exception):
            self.inplace.write(self.store, self.inplace.handed_over_key(os.getpid()), "1")

    def mark_finished(self) -> None:
        """This process completed its run: its host passes on whatever it dies of from now on (a member
        whose parent host exited first is killed in teardown). Best effort: the store may be gone."""
        with contextlib.suppress(Exception):
            self.inplace.write(self.store, self.inplace.finished_key(os.getpid()), "1")

    def spare_ready(self) -> bool:
        """Whether this node has a warm spare ready and unclaimed (a drill kills only once one is: it
        measures recovery with a warm spare, not the spare's start-up)."""
        inplace, store = self.inplace, self.store
        for index in range(inplace.spares_started(store)):
            ready, claimed = inplace.spare_key(index, "ready"), inplace.spare_key(index, "claim")
            if inplace.read(store, ready) is not None and not store.check([claimed]):
                return True
        return False

    def leave(self) -> None:
        """Cut this generation's connections, then destroy its groups.

        With 3+ ranks not every survivor sees the dead peer: one blocked on a live survivor learns of
        the failure only when that survivor's connections close. gloo cannot be aborted and destroying
        a group does not close its sockets while anything still references it, so they are shut down
        first (`sockets.SocketLedger.cut`): the peers blocked on this rank fail at once and cut theirs.
        NCCL communicators are aborted with NCCL's own abort.
        """
        cut = self.ledger.cut()
        log.debug("in-place: rank %d cut %d connections of generation %d", self.identity.rank, cut, self.generation)
        # Held until the end, then dropped last: the group's destructor joins gloo's worker threads, and
        # torch releases the GIL for that when the group's Python object goes last. Had DDP's reducer held
        # the last reference (freed by the collector below), it would join them under the GIL while one
        # of them may wait for the GIL to drop a comm hook's callback: the deadlock one spare's rehearsal
        # hit (`spare._rehearse`).
        world = dist.group.WORLD if dist.is_initialized() else None
        if self.backend == "nccl" and dist.is_initialized():
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                try:
                    abort()  # every group: in-flight NCCL kernels return instead of hanging
                except Exception:
                    log.debug("aborting the NCCL groups failed", exc_info=True)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group may refuse a clean shutdown; it is abandoned either way
                log.debug("destroying the broken process group failed", exc_info=True)
        # The broken groups sit in reference cycles (tracebacks, DDP's reducer): free them now. Cheap
        # because `freeze_heap` took everything that existed before the first group out of the
        # collector's reach (a full collection of a process that imported torch: ~0.2 s of CPU per
        # member, which 8 members on 2 cores turned into 0.8-1.0 s of the recovery).
        gc.collect()
        del world

    def sync_state(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        progress: Any,
        *,
        has_state: bool,
        bucket_order: list[int] | None = None,
        rollback: bool = False,
    ) -> StateSync:
        """Give every rank the state of the most advanced one (collective on the new group).

        Args:
            module: The unwrapped model (DDP is re-created after the transfer).
            optimizer: Its optimizer.
            progress: This rank's `TrainerProgress` (loaded here when behind).
            has_state: False for a spare (it holds no trained state).
            bucket_order: This rank's DDP bucket layout; the source's is returned to every rank, so the
                new wrappers all start from the layout the run had (`training.strategies._OrderedDDP`).
            rollback: The survivors roll back to the newest certified checkpoint after this (the source says
                so to every member, the spares too, in `StateSync.rollback`): no model or optimizer is sent,
                every member reads them from the checkpoint next.
        """
        world = self.identity.world_size
        t0 = time.perf_counter()
        mine = torch.tensor([progress.step if has_state else -1], dtype=torch.int64)
        steps = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(steps, mine)
        values = [int(t.item()) for t in steps]
        log.debug("in-place: steps %s gathered in %.3f s", values, time.perf_counter() - t0)
        best = max(values)
        if best < 0:
            raise RecoveryFailed("no member of the new group holds the training state (every rank was replaced)")
        source = values.index(best)
        rank = self.identity.rank
        behind = [r for r, v in enumerate(values) if v != best]
        mine_box = (
            {"progress": progress.state_dict(), "buckets": bucket_order, "rollback": rollback}
            if rank == source
            else None
        )
        # Small: the progress and DDP's bucket layout, to all, as JSON (no pickle from a peer).
        payload = exchange.broadcast_json(mine_box, src=source)
        rolling_back = payload.get("rollback") is True
        if rolling_back:
            behind = []
        # The model and optimizer go only to the ranks that lack them (a spare, a rank behind), point to
        # point: broadcast to all, every survivor would receive and deserialise the whole state for nothing
        # (at 8 ranks on 2 cores that was most of the transfer phase's growth with the world size).
        if rank == source:
            state = {"model": module.state_dict(), "optim": optimizer.state_dict()}
            for dst in behind:
                exchange.send_state(state, dst=dst)
        elif rank in behind:
            got = exchange.recv_state(source, max_bytes=_state_bound(module))
            module.load_state_dict(got["model"])
            optimizer.load_state_dict(got["optim"])
            progress.load_state_dict(payload["progress"])
        log.debug("in-place: state transferred in %.3f s", time.perf_counter() - t0)
        return StateSync(
            step=best,
            source=source,
            replaced=[r for r, v in enumerate(values) if v < 0],
            progress=payload["progress"],
            bucket_order=payload.get("buckets"),
            rollback=rolling_back,
        )


def _state_bound(module: nn.Module) -> int:
    """The most bytes a model's and its optimizer's state may take on the wire: the model's tensors, and
    room for an optimizer's three times as many (Adam's two moments) and the serialisation's overhead."""
    size = sum(t.numel() * t.element_size() for t in module.state_dict().values() if isinstance(t, torch.Tensor))
    return 4 * size + (64 << 20)
