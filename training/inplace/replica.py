"""In-memory replicas of sharded state: how an FSDP/HSDP group recovers in place (Gemini, SOSP'23).

DDP needs none of this: every rank holds the whole state, so a survivor hands it to the spare
(`InPlaceGroup.sync_state`). Under FSDP a rank holds only its shards; when it dies they are gone from
the group. So every `checkpoint.inMemory.every` steps each rank takes a **snapshot**: its own local
shards (model, optimizer) and its progress, copied on the training thread (the memcpy floor), then
serialised into host memory and handed to the next rank by a ring exchange on a dedicated gloo group,
both on a thread of their own (Gemini's "off the critical path"): rank r holds its own snapshot and
rank r-1's, each kept once its exchange completed.

A recovery re-forms the group as for DDP, then (`ReplicaSet.sync`, collective on the new group):

1. every member says which snapshot steps it holds of its own and of its left neighbour (a spare: none);
2. the newest step S is chosen that every survivor holds of its own, and that the right neighbour of
   every replaced rank holds for it; none (two neighbours lost, or a failure before the first exchange)
   raises `RecoveryFailed`, and the group restarts from the durable checkpoint (the fallback);
3. each replaced rank's neighbour sends it its snapshot of step S;
4. every member rebuilds the model on the new group and loads its step-S shards into it the way DCP's
   restore does (into the new state dict's local shards, then `set_state_dict`), so the run continues
   from S exactly as a restore of a step-S checkpoint would: bit-identical, at most `every` steps lost.

Two snapshots deep, because an exchange interrupted by the failure may have completed on some ranks
and not on others: the one before it is complete everywhere. Snapshots cross only this job's own
process group (trusted peers, never a store), and are read back with `weights_only=True` all the same.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from training.inplace import exchange
from training.inplace.group import RecoveryFailed

__all__ = [
    "DEPTH",
    "ReplicaPlan",
    "ReplicaSet",
    "Snapshot",
    "copy_state",
    "load_snapshot",
    "plan_recovery",
    "serialise",
    "take_snapshot",
]

log = logging.getLogger(__name__)
DEPTH = 2  # snapshots kept per kind: the newest may be incomplete on some ranks after a failure
CLOSE_WAIT_S = 60.0  # how long a finished run waits for its last exchange (seconds of gloo traffic)


def _to_local(tree: Any) -> Any:
    """A copy of `tree` in host memory, every tensor (a DTensor: its local shard) detached and copied: the
    replica must not cost GPU memory, and the exchange runs on gloo."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.to_local().detach().to("cpu", copy=True)
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, Mapping):
        return {k: _to_local(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_local(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_to_local(v) for v in tree)
    return tree


def _fill(dst: Any, src: Any, path: str = "") -> Any:
    """`src` (a snapshot's local tree) poured into `dst` (a fresh state dict of the same model): local
    shards copied into the new DTensors in place, everything else taken from `src`."""
    from torch.distributed.tensor import DTensor

    if isinstance(dst, DTensor):
        local = dst.to_local()
        if not isinstance(src, torch.Tensor) or tuple(local.shape) != tuple(src.shape):
            raise RecoveryFailed(f"in-memory replica: {path or 'state'} does not match this rank's shard")
        local.copy_(src)
        return dst
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor) or tuple(dst.shape) != tuple(src.shape):
            raise RecoveryFailed(f"in-memory replica: {path or 'state'} does not match the model")
        dst.copy_(src)
        return dst
    if isinstance(src, Mapping):
        base = dst if isinstance(dst, Mapping) else {}
        return {k: _fill(base.get(k), v, f"{path}.{k}" if path else str(k)) for k, v in src.items()}
    if isinstance(src, list):
        base_list = dst if isinstance(dst, list) and len(dst) == len(src) else [None] * len(src)
        return [_fill(d, v, f"{path}[{i}]") for i, (d, v) in enumerate(zip(base_list, src, strict=True))]
    return src


@dataclass(frozen=True)
class Snapshot:
    """One rank's state at `step`, serialised (`torch.save` of `{"app": local tree, "trainer": progress}`)."""

    step: int
    data: bytes


def copy_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A private copy of this rank's checkpoint state (`Trainer.state`: `app` and `trainer` Statefuls):
    local shards cloned, so training may go on while it is serialised and exchanged."""
    return {"app": _to_local(state["app"].state_dict()), "trainer": dict(state["trainer"].state_dict())}


def serialise(step: int, tree: Mapping[str, Any]) -> Snapshot:
    buf = io.BytesIO()
    torch.save(dict(tree), buf)
    return Snapshot(step=step, data=buf.getvalue())


def take_snapshot(step: int, state: Mapping[str, Any]) -> Snapshot:
    """Serialise this rank's checkpoint state at `step` (copy and serialisation in one call)."""
    return serialise(step, copy_state(state))


def load_snapshot(snapshot: Snapshot, state: Mapping[str, Any]) -> None:
    """Load `snapshot` into the checkpoint state of a model rebuilt on the new group (same world size and
    rank as the snapshot's writer, so every local shard has its old shape)."""
    tree = torch.load(io.BytesIO(snapshot.data), map_location="cpu", weights_only=True)
    app = state["app"]
    app.load_state_dict(_fill(app.state_dict(), tree["app"]))
    state["trainer"].load_state_dict(tree["trainer"])


@dataclass(frozen=True)
class ReplicaPlan:
    """What a recovery does: the step everyone returns to, and who sends whom which snapshot."""

    step: int
    sends: dict[int, int]  # replaced rank -> the rank that sends it its snapshot (its right neighbour)
    reached: int  # the furthest step any survivor had completed (the steps from `step` on are recomputed)


def plan_recovery(holdings: list[dict[str, Any]]) -> ReplicaPlan:
    """Choose the step to return to from what every member holds (pure: unit-tested).

    Args:
        holdings: Per rank, `{"spare": bool, "own": [steps], "peer": [steps], "at": step}`: the snapshot
            steps it holds of its own state and of its left neighbour's (rank - 1 mod world), and the
            step it had completed (a spare: -1).

    Raises:
        RecoveryFailed: no step is held by everyone who needs it.
    """
    world = len(holdings)
    survivors = [r for r, h in enumerate(holdings) if not h["spare"]]
    if not survivors:
        raise RecoveryFailed("no member of the new group holds the training state (every rank was replaced)")
    replaced = [r for r, h in enumerate(holdings) if h["spare"]]
    for r in replaced:
        if holdings[(r + 1) % world]["spare"]:
            raise RecoveryFailed(
                f"in-memory replica: rank {r}'s shards were held by rank {(r + 1) % world}, which was lost too"
            )
    candidates = set.intersection(*(set(holdings[r]["own"]) for r in survivors))
    for r in replaced:
        candidates &= set(holdings[(r + 1) % world]["peer"])
    if not candidates:
        raise RecoveryFailed(
            "in-memory replica: no snapshot step is held by every survivor and by every lost rank's neighbour "
            "(a failure before the first exchange completed)"
        )
    return ReplicaPlan(
        step=max(candidates),
        sends={r: (r + 1) % world for r in replaced},
        reached=max(int(holdings[r].get("at", -1)) for r in survivors),
    )


@dataclass
class ReplicaSet:
    """This rank's snapshots: its own and its left neighbour's, newest last, `DEPTH` of each.

    Args:
        rank: This rank.
        world_size: The group's size (in-place recovery keeps it).
        every: `checkpoint.inMemory.every`.
    """

    rank: int
    world_size: int
    every: int
    own: list[Snapshot] = field(default_factory=list)
    peer: list[Snapshot] = field(default_factory=list)
    group: Any = None  # the gloo group the exchange runs on (one per process-group generation)
    background: bool = True  # serialise and exchange on a thread of their own (off the training thread)
    blocked_s: float = 0.0  # seconds the newest snapshot held the training thread (the copy)
    last_s: float = 0.0  # seconds the newest completed snapshot took (copy, serialisation, exchange)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)
    _epoch: int = 0  # bumped when a generation is abandoned: a late exchange of it commits nothing
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def connect(self) -> None:
        """Create this generation's exchange group (collective; record its connections first)."""
        self.group = dist.new_group(backend="gloo")

    def disconnect(self) -> None:
        self.group = None

    def abandon(self, limit_s: float) -> None:
        """After the broken generation's connections were cut: let its exchange in flight end (it fails
        at once on a cut connection), waiting at most `limit_s`, and keep nothing it may still commit."""
        with self._lock:
            self._epoch += 1
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=limit_s)
            if thread.is_alive():
                log.warning("in-place: the in-memory replica exchange of the broken group did not end in %g s", limit_s)
        self._error = None

    def wait(self) -> None:
        """Join the exchange in flight; its failure (a peer died mid-exchange) is raised here, where the
        training loop takes it for the failed collective it is."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """The run ends: let the last exchange finish (its failure no longer matters), waiting at most
        `timeout_s`: a finished run must exit even when a neighbour never took part in it."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning(
                    "in-place: the last in-memory replica exchange did not end within %g s of the run's end; "
                    "exiting without it",
                    timeout_s,
                )
                self._thread = None
                return
        try:
            self.wait()
        except Exception:
            log.debug("the last in-memory replica exchange failed", exc_info=True)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def _keep(self, kind: list[Snapshot], snapshot: Snapshot) -> None:
        kind[:] = [*[s for s in kind if s.step != snapshot.step][-(DEPTH - 1) :], snapshot]

    def take(self, step: int, state: Mapping[str, Any]) -> None:
        """Snapshot this rank's state at `step` and swap copies with the neighbours (collective).

        The training thread only copies the local shards (and first waits for the previous exchange:
        snapshots never queue up); serialisation and the exchange run on a thread of their own, on this
        set's own gloo group, and the pair is kept only once the exchange completed.
        """
        self.wait()
        start = time.perf_counter()
        tree = copy_state(state)
        self.blocked_s = time.perf_counter() - start
        if not self.background:
            self._complete(step, tree, start, self._epoch)
            return
        self._thread = threading.Thread(
            target=self._run, args=(step, tree, start, self._epoch), name="torchrig-replica", daemon=True
        )
        self._thread.start()

    def _run(self, step: int, tree: dict[str, Any], start: float, epoch: int) -> None:
        try:
            self._complete(step, tree, start, epoch)
        except BaseException as exc:  # raised on the training thread by the next `wait`
            self._error = exc

    def _complete(self, step: int, tree: dict[str, Any], start: float, epoch: int) -> None:
        mine = serialise(step, tree)
        theirs = self._exchange(mine)
        with self._lock:  # kept only once the exchange completed here, and only for a live generation
            if epoch != self._epoch:
                return
            self._keep(self.own, mine)
            self._keep(self.peer, theirs)
        self.last_s = time.perf_counter() - start

    def _exchange(self, mine: Snapshot) -> Snapshot:
        world, rank = self.world_size, self.rank
        right, left = (rank + 1) % world, (rank - 1) % world
        size = torch.tensor([len(mine.data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, size, group=self.group)
        incoming = torch.empty(int(sizes[left].item()), dtype=torch.uint8)
        outgoing = torch.frombuffer(bytearray(mine.data), dtype=torch.uint8)
        ops = [
            dist.P2POp(dist.isend, outgoing, right, group=self.group),
            dist.P2POp(dist.irecv, incoming, left, group=self.group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return Snapshot(step=mine.step, data=incoming.numpy().tobytes())

    def holdings(self, at: int) -> dict[str, Any]:
        with self._lock:
            return {"spare": False, "own": [s.step for s in self.own], "peer": [s.step for s in self.peer], "at": at}

    def sync(self, state: Mapping[str, Any], *, has_state: bool, at: int = -1) -> ReplicaPlan:
        """After the new generation formed: agree on a step, move snapshots to the replaced ranks, and load
        this rank's step-S snapshot into `state` (collective on this generation's replica group; see the
        module docstring). `state` is the checkpoint state of a model already rebuilt on the new group; `at`
        the step this rank had completed before the failure.

        Raises:
            RecoveryFailed: no common step (the caller falls back to a group restart).
        """
        start = time.perf_counter()
        mine = self.holdings(at) if has_state else {"spare": True, "own": [], "peer": [], "at": -1}
        with self._lock:  # what a replaced neighbour will receive, so it can size its buffer
            mine["peer_bytes"] = {str(s.step): len(s.data) for s in self.peer}  # JSON: keys are strings
        # JSON, not `all_gather_object`: no pickle from a peer (`training.inplace.exchange`).
        everyone = exchange.all_gather_json(mine, self.world_size, group=self.group)
        plan = plan_recovery(everyone)
        rank = self.rank
        snapshot = next(s for s in self.own if s.step == plan.step) if has_state else None
        ops: list[dist.P2POp] = []
        received: torch.Tensor | None = None
        for lost, sender in plan.sends.items():
            if sender == rank:
                data = next(s for s in self.peer if s.step == plan.step).data
                outgoing = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                ops.append(dist.P2POp(dist.isend, outgoing, lost, group=self.group))
            elif lost == rank:
                received = torch.empty(int(everyone[sender]["peer_bytes"][str(plan.step)]), dtype=torch.uint8)
                ops.append(dist.P2POp(dist.irecv, received, sender, group=self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if received is not None:
            snapshot = Snapshot(step=plan.step, data=received.numpy().tobytes())
        assert snapshot is not None
        load_snapshot(snapshot, state)
        # Start over from the agreed step: newer snapshots describe a future that no longer happens.
        self.own = [s for s in self.own if s.step <= plan.step]
        self.peer = [s for s in self.peer if s.step <= plan.step]
        log.debug(
            "in-place: rank %d back at step %d from in-memory replicas in %.3f s",
            rank,
            plan.step,
            time.perf_counter() - start,
        )
        return plan
