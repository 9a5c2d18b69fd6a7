"""In-place recovery: survivors keep training state in memory, a warm spare takes a dead rank's place.

Without it every failure costs a group restart: torchrun kills and respawns every rank, and each new
process pays `import torch`, the model build and a checkpoint restore (docs/architecture.md has the
numbers). With `restarts.mode: auto` (the default) or `inplace` (DDP, 2+ ranks on one node, launched by
torchrig's torchrun command):

- every process torchrun starts is a light per-rank **host** (`training.inplace.host`) that runs the
  real trainer as its child and watches it, so the torchrun agent never sees a trainer die;
- the host of local rank 0 keeps `restarts.spares` warm **spares** per node (`training.inplace.spare`):
  processes that imported torch and built the task's model, blocked until a host assigns them a rank;
- when a trainer dies with a retryable status, its host claims a ready spare (an atomic
  compare-and-set in the store) and assigns it the dead rank and the next process-group
  **generation**; the survivors see their collective fail, cut their connections of the broken
  generation (`training.inplace.sockets`: the survivors blocked on them fail at once, whatever the
  world size), destroy their group, and every member
  forms generation g+1 on the same long-lived store under a new prefix (`training.inplace.group`);
  the most advanced rank broadcasts model, optimizer and progress; the step in flight is
  recomputed, so the result is bit-identical;
- whatever cannot finish within `restarts.inPlaceTimeoutSeconds` (no spare, a second death during
  recovery, a stuck survivor) exits `ExitCode.RECOVERY_FAILED` and torchrun restarts the whole group
  from the durable checkpoint (the fallback, the `restart` path).

The store is one that outlives every trainer (`Env.INPLACE_STORE`): the local run's rendezvous store
process, or in a one-node pod (and the `torchrun` target) a store the torchrun agent hosts itself
(`training.torchrun.host_inplace_store`). This module imports no torch (the host stays light); keys are named here once.

Anyone who reaches that store can write to it, so every value that makes a process act is an order signed
with the job's secret (`Env.JOB_SECRET_FILE`; `InPlace.write` / `read`, `training.contract.orders`): one
that does not check is ignored, as if it were not there. Counters (`add`) carry no MAC; what forging each
can do is bounded where it is read (`training.inplace.group`, `MAX_SPARES`). Without a secret a launch
recovers by group restarts (docs/operations.md, "Trust boundary").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from training.contract import Env
from training.contract.orders import IDENTITY_ENV, OrderError, SecretError, Signer, forged, load_job_secret

if TYPE_CHECKING:
    from training.config import WorkerSpec

__all__ = [
    "BEAT_S",
    "BEHIND_LOST_S",
    "FORGED_RETRY_S",
    "HOST_LOST_S",
    "IDENTITY_ENV",
    "MAX_SPARES",
    "ROLE_SPARE",
    "ROLE_TRAINER",
    "STANDBY_GRACE_S",
    "InPlace",
    "KeyWait",
    "store_client",
]

log = logging.getLogger(__name__)
ROLE_TRAINER = "trainer"
BEAT_S = 0.25  # how often a host adds to its beat counter (`InPlace.beat_key`)
# A host whose beat counter stood still this long is gone (its node lost, or cut off from the store).
HOST_LOST_S = 3.0
# A node whose beat stood still this long while every one of its ranks is behind the newest generation
# (the others left a broken group and are forming the next one; its ranks never came) is gone too: the
# broken group confirms what the beat alone would take HOST_LOST_S to.
BEHIND_LOST_S = 1.0
# While standby nodes are ready, the members forming a generation wait this much longer before they give
# a lost node up: a standby, which watches the beats all along, takes it first.
STANDBY_GRACE_S = 3.0
ROLE_SPARE = "spare"
T = TypeVar("T")
# A key that holds a forged order is read again this often, until the order of this job overwrites it.
FORGED_RETRY_S = 0.05
# A spare's index past this is no spare of ours: `spawned_key` is a counter (`add`), which carries no MAC,
# so a forged one could make every claim scan millions of keys. 4,096 spares started on one node within
# one rendezvous round is far past any real run (each recovery starts one).
MAX_SPARES = 4096


@dataclass(frozen=True)
class InPlace:
    """Where in-place recovery keeps its bookkeeping, and its settings.

    Attributes:
        store_addr: `host:port` of the long-lived c10d store.
        run_id: The launch's rendezvous id (`TORCHELASTIC_RUN_ID`).
        restart_count: torchrun's restart generation: a group restart starts a fresh key space.
        node_rank: This node's index (spares are per node).
        spares: Warm spares per node.
        timeout_s: `restarts.inPlaceTimeoutSeconds`.
        round_token: The c10d rendezvous round's token (`Env.INPLACE_ROUND`), shared by every node's
            agent; when set it names the key space instead of `restart_count`.
        secret: The job's secret (`Env.JOB_SECRET_FILE`): every order this launch writes to the store
            carries a MAC made with it, and an order without a good one is ignored (`read`).
    """

    store_addr: str
    run_id: str
    restart_count: int
    node_rank: int
    spares: int
    timeout_s: float
    round_token: str = ""
    secret: bytes = field(default=b"", repr=False, compare=False)

    @classmethod
    def from_spec(cls, spec: WorkerSpec, env: Mapping[str, str] | None = None) -> InPlace | None:
        """The settings when this launch recovers in place, else None (the restart path)."""
        env = os.environ if env is None else env
        restarts = spec.spec.restarts
        if not restarts.in_place:
            return None
        strategy = spec.spec.training.strategy.value
        if strategy != "ddp" and spec.spec.checkpoint.in_memory.every is None:
            # A lost rank's shards exist nowhere else in memory without replicas (`training.inplace.replica`)
            _not_in_place(restarts.mode, f"strategy {strategy} without checkpoint.inMemory.every keeps no replica")
            return None
        addr, run_id = env.get(Env.INPLACE_STORE, ""), env.get(Env.RUN_ID, "")
        if addr in (Env.INPLACE_STORE_AGENT, Env.INPLACE_STORE_RDZV):
            addr = ""  # no agent of ours replaced it (`training.torchrun`): no store
        world_size = int(env.get(Env.WORLD_SIZE, "1") or 1)
        if not addr or not run_id or world_size < 2:
            return None
        try:
            secret = load_job_secret(env)
        except SecretError as exc:  # set but unusable: say so whatever the mode (the user meant it to work)
            log.warning("in-place recovery is off, the group restarts instead: %s", exc)
            return None
        if secret is None:
            # Orders in the store must be signed (docs/operations.md, "Trust boundary"): every launcher of
            # torchrig provides a secret (the local run's file, the job's Secret in a pod, one the agent
            # makes for the store it hosts on 127.0.0.1); none here means a launch by hand.
            _not_in_place(restarts.mode, f"no job secret ({Env.JOB_SECRET_FILE}) to sign its orders with")
            return None
        round_token = env.get(Env.INPLACE_ROUND, "")
        if int(env.get(Env.GROUP_WORLD_SIZE, "1") or 1) > 1 and not round_token:
            # Each agent counts its own restarts, so without the round token of torchrig's agent
            # (`training.torchrun.export_rendezvous_round`: c10d rendezvous only) the nodes' key spaces
            # would differ.
            _not_in_place(restarts.mode, "several nodes without a c10d rendezvous round to share")
            return None
        return cls(
            store_addr=addr,
            run_id=run_id,
            restart_count=int(env.get(Env.RESTART_COUNT, "0") or 0),
            node_rank=int(env.get(Env.GROUP_RANK, "0") or 0),
            spares=restarts.spares,
            timeout_s=restarts.in_place_timeout_seconds,
            round_token=round_token,
            secret=secret,
        )

    @property
    def prefix(self) -> str:
        launch = f"round-{self.round_token}" if self.round_token else str(self.restart_count)
        return f"torchrig/inplace/{self.run_id}/{launch}/"

    def connect(self, timeout_s: float | None = None) -> Any:
        """A client of the long-lived store, under this launch's prefix (imports torch's c10d)."""
        from torch._C._distributed_c10d import PrefixStore

        limit = self.timeout_s if timeout_s is None else timeout_s
        return PrefixStore(self.prefix, store_client(self.store_addr, limit))

    # -- orders: every value that makes a process act is signed (`training.contract.orders`) ---------
    def sign(self, key: str, value: str) -> str:
        """`value` as stored under `key` (a key of this launch's prefix): with its MAC."""
        return Signer(self.secret).sign(self.prefix + key, value)

    def write(self, store: Any, key: str, value: str) -> None:
        """Set order `key` (under this launch's prefix) to `value`, signed."""
        store.set(key, self.sign(key, value))

    def read(self, store: Any, key: str) -> str | None:
        """The order under `key`: None when there is none, or when its value is not signed by this job
        (logged once per key: whoever wrote it is ignored, and the reader goes on as if it were not set)."""
        if not store.check([key]):
            return None
        return self.open(key, store.get(key))

    def open(self, key: str, raw: bytes) -> str | None:
        """The order `raw` read from `key`, or None when its MAC does not check (`read`)."""
        return Signer(self.secret).open(self.prefix + key, raw)

    def read_order(self, store: Any, key: str, parse: Callable[[str], T]) -> T | None:
        """`parse(value)` of the signed order under `key`; None when it is absent, forged or malformed (an
        order refused for its content, `OrderError`, is logged once per key as a forged one is)."""
        value = self.read(store, key)
        if value is None:
            return None
        try:
            return parse(value)
        except OrderError as exc:
            forged(self.prefix + key, str(exc))
            return None

    def read_int(self, store: Any, key: str) -> int | None:
        """`read` of an integer order; None when absent, forged or not an integer."""
        value = self.read(store, key)
        if value is None or not value.lstrip("-").isdigit() or len(value) > 12:
            return None
        return int(value)

    def spares_started(self, store: Any) -> int:
        """How many spares this node's pool started (`spawned_key`), at most `MAX_SPARES` (a counter carries
        no MAC: a forged one is bounded here)."""
        return max(0, min(int(store.add(self.spawned_key, 0)), MAX_SPARES))

    # -- keys --------------------------------------------------------------------------------------
    def spare_key(self, index: int, what: str) -> str:
        """`ready` (the spare's pid), `claim` (the claiming rank, set atomically), `assign` (JSON:
        identity env + generation) of spare `index` on this node."""
        return f"node{self.node_rank}/spare{index}/{what}"

    @property
    def waiting_key(self) -> str:
        """How many hosts of this node wait for a ready spare right now."""
        return f"node{self.node_rank}/waiting"

    @property
    def spawned_key(self) -> str:
        """How many spares this node's pool has started (indices 0 .. n-1)."""
        return f"node{self.node_rank}/spawned"

    @property
    def lost_key(self) -> str:
        """How many ranks have lost their trainer and not yet stepped again with its replacement. At
        the world size nobody holds the state any more: waiting for spares is pointless."""
        return "lost"

    @property
    def all_lost_key(self) -> str:
        """Set once a host saw `lost_key` at the world size (`host.every_rank_lost`): a latch, because the
        host that saw it falls back and gives its count back as it ends, and a host that looks after that
        must still see every rank lost (it waited out `restarts.inPlaceTimeoutSeconds` for a spare instead)."""
        return "all-lost"

    @staticmethod
    def rank_lost_key(rank: int) -> str:
        """Set (compare-and-set, signed with the pid of the host that set it) while `rank` is counted in
        `lost_key`: the count is taken once per rank, however many hosts found it lost (a host killed with
        its node while it claimed, then the standby's host that took the node), and given back once."""
        return f"rank{rank}/lost"

    @staticmethod
    def beat_key(node: int) -> str:
        """A counter node `node`'s local-rank-0 host adds to every `BEAT_S` for as long as it lives: the
        members forming a new generation learn of a lost node within `HOST_LOST_S` instead of waiting
        out the in-place timeout for ranks nobody will bring back. One key per node, not per rank: at
        1,000 nodes that is 4,000 small writes a second on the store."""
        return f"node{node}/beat"

    @staticmethod
    def nodes_lost_key(generation: int) -> str:
        """Set by a member that found a node's beat stopped while generation `generation` formed (what
        it found): every member gives up on that generation at once."""
        return f"gen{generation}/nodes-lost"

    @staticmethod
    def ended_key(node: int) -> str:
        """Set by node `node`'s local-rank-0 host when it exits on its own (any code): a node whose beat
        stopped without it was lost, one with it ended (a standby never takes its place)."""
        return f"node{node}/ended"

    @staticmethod
    def restart_count_key(node: int) -> str:
        """Node `node`'s `TORCHELASTIC_RESTART_COUNT` (its agent's own), for the standby that takes it."""
        return f"node{node}/restart-count"

    @staticmethod
    def taker_key(node: int, beat: str) -> str:
        """Which standby took node `node` when its beat counter stopped at `beat`
        (`training.inplace.standby`): set with a compare-and-set, so two standbys that saw the same loss
        never both take it; a node taken and lost again stopped at another count."""
        return f"node{node}/taker/{beat}"

    @staticmethod
    def sdc_handover_key(generation: int) -> str:
        """After a replica disagreement in generation `generation`, the node a standby takes (`-1`: none):
        each rank proposes `protocol.decide_handover`'s answer with a compare-and-set, the first one stored
        is every rank's (signed)."""
        return f"gen{generation}/sdc-handover"

    @staticmethod
    def handover_key() -> str:
        """The newest SDC hand-over (JSON: node, generation; signed), which a ready standby takes at once
        (`taker_key(node, "sdc<generation>")`) instead of waiting for the node's beat to stop."""
        return "sdc/handover"

    @staticmethod
    def handed_over_key(pid: int) -> str:
        """Set by trainer `pid` before it exits `SDC_SUSPECT` because a standby node takes its node's ranks:
        its host then exits 0 instead of claiming a spare of the suspect node (`protocol.HandOver`)."""
        return f"handed-over/{pid}"

    @staticmethod
    def standbys_key() -> str:
        """How many standby nodes stand ready for this round (their spares warm): the members forming a
        new generation then wait `STANDBY_GRACE_S` longer before they give a lost node up."""
        return "standbys"

    def promote_key(self, local_rank: int) -> str:
        """A standby host's orders (JSON: the lost node, and the identity of the rank it becomes)."""
        return f"node{self.node_rank}/host{local_rank}/promote"

    @staticmethod
    def round_record_key(run_id: str) -> str:
        """Outside every round's prefix: the c10d round the agents run now (JSON: token, round, nodes;
        `training.torchrun.export_rendezvous_round`), which a standby reads to find it."""
        return f"torchrig/inplace/{run_id}/current"

    @staticmethod
    def standby_slots_key(run_id: str) -> str:
        """Outside every round's prefix: a counter that gives each standby of the run its own slot."""
        return f"torchrig/inplace/{run_id}/standby-slots"

    @staticmethod
    def exit_key(pid: int) -> str:
        return f"exit/{pid}"

    @staticmethod
    def stepped_key(pid: int) -> str:
        """Set once trainer `pid` completed a step: one that dies before it is not replaced in place."""
        return f"stepped/{pid}"

    @staticmethod
    def finished_key(pid: int) -> str:
        """Set once trainer `pid` completed its run (every step, the final checkpoint, the `finished`
        event): a death after it is the end of a completed run, never a rank to replace."""
        return f"finished/{pid}"

    @staticmethod
    def owner_key(rank: int) -> str:
        """The pid of the process that holds `rank` now, set before a spare is assigned it: a process of
        that rank that is not its owner (a node cut off from the store long enough for a standby to take
        it, then back) must never join a generation beside its replacement."""
        return f"rank{rank}/owner"

    @staticmethod
    def rank_gen_key(rank: int) -> str:
        return f"rank{rank}/gen"

    @staticmethod
    def join_key(generation: int) -> str:
        return f"join/{generation}"

    @staticmethod
    def seat_key(generation: int, rank: int) -> str:
        """Rank `rank`'s seat in generation `generation`: the joining process's pid, set by compare-and-set
        before it counts its join (`join_key`), so that only one process joins each rank of a generation."""
        return f"join/{generation}/rank{rank}"

    @staticmethod
    def formed_key(generation: int) -> str:
        """Set by the member whose join completed generation `generation` (`join_key` reached the world
        size): the others wait on it, server-side, instead of reading the counter."""
        return f"join/{generation}/formed"

    @staticmethod
    def pg_prefix(generation: int) -> str:
        return f"pg/{generation}/"


def store_client(addr: str, timeout_s: float) -> Any:
    """A client of the c10d store at `host:port`, no prefix (imports torch's c10d)."""
    from torch._C._distributed_c10d import TCPStore

    host, _, port = addr.rpartition(":")
    return TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


class KeyWait:
    """Waits for one store key in a single blocking `TCPStore.wait`, on a connection and a thread of its
    own: the caller's connection stays free for its other reads, and the store answers the moment the
    key is set (a c10d client serves one request at a time, so the wait cannot share it).

    Polling the key instead costs a request every few milliseconds per waiter: while a generation forms
    at 8,000 ranks that was 1.6 million a second on one store (docs/performance.md).

    Args:
        connect: a new client of the store (under the launch's prefix).
        key: the key to wait for.
        limit_s: the longest wait.
    """

    def __init__(self, connect: Callable[[], Any], key: str, limit_s: float) -> None:
        self.done = threading.Event()
        self.failed: str | None = None  # why the wait itself failed (then the caller reads the key itself)
        self._thread = threading.Thread(
            target=self._run, args=(connect, key, limit_s), name="torchrig-keywait", daemon=True
        )
        self._thread.start()

    def _run(self, connect: Callable[[], Any], key: str, limit_s: float) -> None:
        try:
            connect().wait([key], timedelta(seconds=limit_s))
        except Exception as exc:  # timed out, or the store went: the caller decides what that means
            self.failed = f"{type(exc).__name__}: {exc}"
            return
        self.done.set()

    def done_within(self, slice_s: float) -> bool:
        """Whether the key is set, waiting up to `slice_s` for it (returns at once when it is)."""
        if self.failed is None:
            return self.done.wait(slice_s)
        time.sleep(slice_s)  # the wait failed: the caller falls back to reading the key
        return False


def _not_in_place(mode: str, reason: str) -> None:
    """This launch takes the restart path: `mode: inplace` says why (`auto` chooses quietly)."""
    if mode == "inplace":
        log.warning("restarts.mode is inplace, but this launch recovers by a group restart: %s", reason)
