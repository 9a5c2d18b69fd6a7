"""Standby nodes: spare pods that take a lost node's ranks in place (`restarts.spareNodes`).

A per-node spare (`training.inplace.spare`) replaces one dead rank; a lost node (its pod evicted, its
machine gone) takes every process of the node, spares included, and used to cost a group restart. A
PyTorchJob with `spareNodes: S` runs S more Worker pods than it has nodes. They run the same command:
`training.torchrun.main` asks `standby_wanted` first, and such a pod runs this module instead of
torchrun's agent. Joining the rendezvous is exactly what it must not do: a node waiting at a running
c10d rendezvous makes every healthy agent restart its workers (torchrun's membership change).

- **Who stands by**: a Worker pod whose replica index (the operator's `replica-index` label) is at
  least `TORCHRIG_STANDBY_FROM` (the spare replicas), and a member's pod that starts while its job's
  round is running (it was recreated after its node was lost, and a standby holds its ranks now).
- **Warm**: the standby reads the running round from the rendezvous store
  (`InPlace.round_record_key`, written by every agent), starts one light host per local rank
  (`training.inplace.host`, `TORCHRIG_INPLACE_STANDBY`) under a node index of its own past the
  members', whose children are spares (torch imported, model built, a step rehearsed), and counts
  itself ready (`InPlace.standbys_key`).
- **Take a lost node**: it watches every node's beat (`InPlace.beat_key`). A node that stopped
  beating for `HOST_LOST_S` without ending (`InPlace.ended_key`), or for `BEHIND_LOST_S` while every
  one of its ranks is behind the generation the others joined (their group broke and its ranks never
  came: `group.nodes_behind`), is taken with one compare-and-set
  (`InPlace.taker_key`, keyed by where its beat stopped): the node's old spares are marked taken
  (they died with it), each spare is assigned the node's rank of its local rank and the next
  generation (what the dead rank's host would have assigned), and each host is told it now is that
  node's host (`InPlace.promote_key`): from then on it is one like any other (its beat, its pool of
  spares, in-place recovery of its own ranks). The survivors, forming that generation, wait
  `STANDBY_GRACE_S` longer while a standby is ready.
- **Take an SDC suspect's node**: when the replicas decided a suspect and handed its node to a standby
  (`protocol.decide_handover`, `InPlace.handover_key`, signed), a ready standby takes that node at its next
  look, with the same compare-and-set (`InPlace.taker_key(node, "sdc<generation>")`), without waiting for a
  beat to stop: the node is alive, its ranks leave on their own (their hosts exit 0: `protocol.HandOver`),
  its spares are left to end with its hosts, and its agent passes torchrun's exit barrier itself.
- **The end**: when its hosts exit 0 the standby stands in for the lost node's agent at torchrun's
  exit barrier (the other agents would wait out `exit_barrier_timeout` for it) and exits 0. A standby
  that was never needed exits 0 once the round's agents passed that barrier, or once the store is gone
  after it saw the job run (a finished job; a store lost mid-run restarts the job anyway). When the
  round ends otherwise (the group fell back to a restart), a member's pod joins the next rendezvous
  (runs torchrun) and a spare pod stands by for the next round.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from training.contract import Env
from training.contract.orders import Assignment, Promotion, SecretError, Signer, load_job_secret
from training.healthcheck import clear_standby, mark_standby
from training.inplace import BEAT_S, HOST_LOST_S, InPlace, store_client
from training.inplace.protocol import (
    STANDBY_TRANSITIONS,
    Decision,
    Join,
    PassThrough,
    Ready,
    RoundOver,
    StandBy,
    StandbyObservation,
    StandbyState,
    StandDown,
    Take,
    Wait,
    decide_standby,
    next_state,
)

if TYPE_CHECKING:
    from training.inplace.group import NodeWatch

__all__ = ["JOIN", "Round", "exit_barrier_passed", "round_store", "run_standby", "standby_wanted"]

log = logging.getLogger(__name__)

JOIN = -1  # `run_standby`'s answer when this pod should join the rendezvous (run torchrun) after all
POLL_S = 0.05
STORE_TIMEOUT_S = 30.0  # the first connection (a pod may start before the master's store)
RECONNECT_TIMEOUT_S = 5.0  # a connection to a store reached before
ROUND_LOOK_S = 1.0  # how often a standby that holds a node asks whether a new round began
STORE_GONE_S = 10.0  # the store unreachable this long: the job ended (or its master was lost)
TERMINAL_STATE_SYNC_ID = "torchelastic/agent/terminal_state"  # torch.distributed.elastic.agent.server.api
MAX_NODES = 1 << 16  # a round record naming more nodes is no record of ours
LAST_MEMBER = "/last_member"  # set by the barrier's last arrival (torch.distributed.elastic.utils.store)


@dataclass(frozen=True)
class Round:
    """A c10d rendezvous round as its agents recorded it (`training.torchrun._publish_round`)."""

    token: str
    round: int
    nodes: int

    @classmethod
    def parse(cls, raw: bytes | str) -> Round | None:
        try:
            data = json.loads(raw)
            found = cls(token=str(data["token"]), round=int(data["round"]), nodes=int(data["nodes"]))
        except (ValueError, KeyError, TypeError, RecursionError):
            return None
        return found if 0 < found.nodes <= MAX_NODES and found.round >= 0 and len(found.token) <= 64 else None

    def to_json(self) -> str:
        return json.dumps({"token": self.token, "round": self.round, "nodes": self.nodes})


@dataclass(frozen=True)
class Launch:
    """What a standby needs from torchrun's arguments."""

    endpoint: str  # host:port of the c10d rendezvous store
    run_id: str
    nproc: int
    max_restarts: int
    program: list[str]  # `python -u -m training --spec ...`: the workers' command, as torchrun runs it
    join_timeout_s: float = 600.0  # the rendezvous' `join_timeout`: how long an agent waits for a round
    secret: bytes = field(default=b"", repr=False)  # the job's (`Env.JOB_SECRET_FILE`): orders are signed

    @classmethod
    def parse(cls, argv: list[str]) -> Launch | None:
        """torchrun's own reading of `argv` (`config_from_args`, which also sets `OMP_NUM_THREADS=1` for
        several processes per node, as torchrun does: the standby's ranks must compute like the
        members', thread count included, to stay bit-identical)."""
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
        from torch.distributed.run import config_from_args, parse_args

        try:
            args = parse_args(argv)  # type: ignore[no-untyped-call]
            if args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
                return None
            config, cmd, cmd_args = config_from_args(args)
        except (SystemExit, ValueError):
            return None
        if not isinstance(cmd, str):
            return None  # `--run-path`: no program to start
        host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        program = [cmd, *cmd_args]
        join_timeout_s = float(config.rdzv_configs.get("join_timeout", 600))
        return cls(
            f"{host}:{port}", config.run_id, int(config.nproc_per_node), config.max_restarts, program, join_timeout_s
        )


def round_store(raw: Any, run_id: str, round_: int) -> Any:
    """The store torchrun's agents of round `round_` use: the c10d handler's `_wrap_store` prefix."""
    from torch._C._distributed_c10d import PrefixStore

    return PrefixStore(f"torch.rendezvous.{run_id}.{round_}", raw)


def exit_barrier_passed(raw: Any, run_id: str, round_: int) -> bool:
    """Whether round `round_`'s agents all passed torchrun's exit barrier (the job's end)."""
    return bool(round_store(raw, run_id, round_).check([f"{TERMINAL_STATE_SYNC_ID}{LAST_MEMBER}"]))


def recorded_round(store: Any, run_id: str, secret: bytes) -> Round | None:
    """The round the agents recorded last (`InPlace.round_record_key`, signed with the job's `secret`), or
    None (none, or one this job did not sign: logged once)."""
    key = InPlace.round_record_key(run_id)
    if not store.check([key]):
        return None
    value = Signer(secret).open(key, store.get(key))
    return None if value is None else Round.parse(value)


def job_finished(store: Any, run_id: str, secret: bytes) -> bool:
    """Whether the agents of the round recorded last passed torchrun's exit barrier: the job is over.

    torchelastic's barrier keys carry no MAC (torch writes them): a forged one makes a standby stop
    standing by (the job runs on without it) and nothing more. What ends a store-only pod (the job's
    outcome) is a signed record instead (`training.rendezvous_store.job_outcome`)."""
    found = recorded_round(store, run_id, secret)
    return found is not None and exit_barrier_passed(store, run_id, found.round)


def _replica_role(env: Mapping[str, str]) -> str | None:
    """ "spare" (a spare replica), "member" (a member's pod, standby only while its round runs) or None
    (no spare nodes here: run torchrun)."""
    first, index = env.get(Env.STANDBY_FROM, ""), env.get(Env.REPLICA_INDEX, "")
    if not first.isdigit() or not index.isdigit():
        return None
    return "spare" if int(index) >= int(first) else "member"


def _beats(store: Any, inplace: InPlace, nodes: int) -> list[bytes] | None:
    keys = [inplace.beat_key(n) for n in range(nodes)]
    return list(store.multi_get(keys)) if store.check(keys) else None


def _round_running(store: Any, run_id: str, secret: bytes) -> Round | None:
    """The recorded round when its nodes are beating now (two looks a second apart), else None."""
    found = recorded_round(store, run_id, secret)
    if found is None:
        return None
    inplace = _inplace("", run_id, found, node=0, secret=secret)
    space = _space(store, inplace)
    before = _beats(space, inplace, found.nodes)
    time.sleep(4 * BEAT_S)
    after = _beats(space, inplace, found.nodes)
    return found if before is not None and after is not None and before != after else None


def _inplace(endpoint: str, run_id: str, found: Round, *, node: int, secret: bytes) -> InPlace:
    """The round's in-place key space, as node `node` of it."""
    return InPlace(
        store_addr=endpoint,
        run_id=run_id,
        restart_count=0,
        node_rank=node,
        spares=1,
        timeout_s=STORE_TIMEOUT_S,
        round_token=found.token,
        secret=secret,
    )


def _space(raw: Any, inplace: InPlace) -> Any:
    """`raw` (the rendezvous store) under the round's in-place prefix."""
    from torch._C._distributed_c10d import PrefixStore

    return PrefixStore(inplace.prefix, raw)


def standby_wanted(argv: list[str], env: Mapping[str, str] | None = None) -> Launch | None:
    """The launch this pod stands by for, or None: run torchrun (no spare nodes, a member's pod whose job
    is not running yet, or arguments without a c10d rendezvous)."""
    env = os.environ if env is None else env
    role = _replica_role(env)
    if role is None:
        return None
    launch = Launch.parse(argv)
    if launch is None:
        log.warning("spare nodes need torchrun's c10d rendezvous; this pod joins the rendezvous instead")
        return None
    try:
        secret = load_job_secret(env)
    except SecretError as exc:
        secret, why = None, str(exc)
    else:
        why = f"{Env.JOB_SECRET_FILE} is not set"
    if secret is None:
        # A standby acts on orders in the store; unsigned, anyone who reaches the store could give them.
        log.warning("spare nodes need the job's secret to check their orders (%s); this pod joins the rendezvous", why)
        return None
    launch = replace(launch, secret=secret)
    if role == "spare":
        return launch
    try:  # a member's pod: stand by only when its job's round runs without it (or the job is over: exit 0)
        store = store_client(launch.endpoint, timeout_s=5.0)
        running = _round_running(store, launch.run_id, secret) is not None
        return launch if running or job_finished(store, launch.run_id, secret) else None
    except Exception:  # no store yet: the job is starting, and this pod is one of its members
        return None


class Standby:
    """One standby node's life for one round (see the module docstring)."""

    def __init__(self, launch: Launch, raw: Any, found: Round, slot: int, env: MutableMapping[str, str]) -> None:
        self.launch = launch
        self.raw = raw
        self.found = found
        self.slot = slot
        self.node = found.nodes + slot  # this standby's own node index (its spares' keys), past the members'
        self.inplace = _inplace(launch.endpoint, launch.run_id, found, node=self.node, secret=launch.secret)
        self.store = _space(raw, self.inplace)
        self.env = env
        self.hosts: list[subprocess.Popen[bytes]] = []
        self.taken: int | None = None  # the node this standby holds
        self.handed_over = False  # it was handed over after an SDC: its own agent passes the exit barrier

    def start_hosts(self) -> None:
        """One host per local rank, each with a spare child, under this standby's own node index."""
        nproc, nodes = self.launch.nproc, self.found.nodes
        for local in range(nproc):
            env = dict(self.env)
            env.update(
                {
                    Env.INPLACE_STORE: self.launch.endpoint,
                    Env.INPLACE_ROUND: self.found.token,
                    Env.INPLACE_STANDBY: str(self.slot),
                    Env.RUN_ID: self.launch.run_id,
                    Env.RESTART_COUNT: "0",
                    Env.RANK: str(self.node * nproc + local),  # a placeholder until it takes a node's rank
                    Env.WORLD_SIZE: str(nodes * nproc),
                    Env.LOCAL_RANK: str(local),
                    Env.LOCAL_WORLD_SIZE: str(nproc),
                    Env.GROUP_RANK: str(self.node),
                    Env.GROUP_WORLD_SIZE: str(nodes),
                    # The rest of what torchrun's agent gives its workers (LocalElasticAgent._start_workers).
                    "ROLE_NAME": "default",
                    "TORCHELASTIC_MAX_RESTARTS": str(self.launch.max_restarts),
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                }
            )
            for name in (Env.STANDBY_FROM, Env.REPLICA_INDEX):
                env.pop(name, None)
            self.hosts.append(subprocess.Popen(self.launch.program, env=env))

    def spares_ready(self) -> bool:
        keys = [self.inplace.spare_key(local, "ready") for local in range(self.launch.nproc)]
        return all(self.inplace.read(self.store, key) is not None for key in keys)

    def take(self, node: int, beat: bytes, *, handover: bool = False) -> bool:
        """Take lost node `node`, whose beat counter stopped at `beat`, with one compare-and-set against
        every other standby that saw it stop there (a node taken and lost again stops at another count).
        `handover`: the node is an SDC suspect's, handed over by the replicas (`beat` is then `sdc<generation>`):
        it is alive, its processes leave on their own and its spares end with its hosts."""
        key = self.inplace.taker_key(node, beat.decode(errors="replace")[:32])
        mine = self.inplace.sign(key, f"standby{self.slot}/{os.getpid()}")
        if self.store.compare_set(key, "", mine).decode(errors="replace") != mine:
            return False  # another standby took it (or a forged taker blocks it: the group restarts instead)
        nproc, nodes = self.launch.nproc, self.found.nodes
        lost = replace(self.inplace, node_rank=node)
        for index in range(0 if handover else lost.spares_started(self.store)):  # its spares died with it
            claim_key = lost.spare_key(index, "claim")
            self.store.compare_set(claim_key, "", lost.sign(claim_key, "lost with its node"))
        next_spare = lost.spares_started(self.store)
        restart_count = max(0, self.inplace.read_int(self.store, self.inplace.restart_count_key(node)) or 0)
        for local in range(nproc):
            rank = node * nproc + local
            dead_gen = max(0, self.inplace.read_int(self.store, self.inplace.rank_gen_key(rank)) or 0)
            identity = {
                Env.RANK: str(rank),
                Env.WORLD_SIZE: str(nodes * nproc),
                Env.LOCAL_RANK: str(local),
                Env.LOCAL_WORLD_SIZE: str(nproc),
                Env.GROUP_RANK: str(node),
                Env.GROUP_WORLD_SIZE: str(nodes),
                Env.RESTART_COUNT: str(restart_count),
                Env.RUN_ID: self.launch.run_id,
            }
            spare_pid = self.inplace.read(self.store, self.inplace.spare_key(local, "ready")) or ""
            # The node's old processes stand down.
            self.inplace.write(self.store, self.inplace.owner_key(rank), spare_pid)
            # The spare first: it joins the survivors' new generation while its host takes over the node.
            assignment = Assignment(env=identity, generation=dead_gen + 1)
            self.inplace.write(self.store, self.inplace.spare_key(local, "assign"), assignment.to_json())
            orders = Promotion(env=identity, node=node, next_spare=next_spare)
            self.inplace.write(self.store, self.inplace.promote_key(local), orders.to_json())
        self.store.add(lost.beat_key(node), 1)  # it beats again from here on (the promoted host keeps it)
        self.taken = node
        self.handed_over = handover
        why = "is an SDC suspect's, handed over by the replicas" if handover else "stopped beating"
        print(
            f"torchrig: standby: node {node} {why}; this standby takes its ranks "
            f"{node * nproc}-{(node + 1) * nproc - 1} in place",
            file=sys.stderr,
            flush=True,
        )
        return True

    def handover(self) -> tuple[int, bytes] | None:
        """The node the replicas handed to a standby after an SDC (`InPlace.handover_key`, signed) and the
        taker key's tail (`sdc<generation>`), unless a standby took it already (or it names no node of the
        round)."""
        raw = self.inplace.read(self.store, self.inplace.handover_key())
        if raw is None:
            return None
        try:
            record = json.loads(raw)
            node, generation = int(record["node"]), int(record["generation"])
        except (ValueError, KeyError, TypeError, RecursionError):
            return None
        if not 0 <= node < self.found.nodes:
            return None
        tail = f"sdc{generation}"
        return None if self.store.check([self.inplace.taker_key(node, tail)]) else (node, tail.encode())

    def take_quietly(self, node: int, beat: bytes, *, handover: bool = False) -> bool:
        """`take`, False when the store fails midway (logged): the next look takes the node again, and the
        compare-and-set this standby already won answers it with its own value (a failure escaping here
        ended the standby's pod with exit 1, which Kubeflow takes as permanent)."""
        try:
            return self.take(node, beat, handover=handover)
        except Exception as exc:
            log.warning("standby: taking node %d failed: %s", node, exc)
            return False

    def new_round(self) -> bool:
        """Whether the job's agents recorded a round other than this standby's (the group restarted)."""
        try:
            found = recorded_round(self.raw, self.launch.run_id, self.launch.secret)
        except Exception:  # the store failed: nothing seen (a store gone ends the hosts' trainers anyway)
            return False
        return found is not None and (found.token, found.round) != (self.found.token, self.found.round)

    def stop_hosts(self, sig: int = signal.SIGTERM, *, grace_s: float | None = 10.0) -> None:
        """Signal the hosts and wait for them (`grace_s`, then SIGKILL; None: as long as they take, as a
        preemption's emergency checkpoint may)."""
        for proc in self.hosts:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        for proc in self.hosts:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def exit_barrier(self) -> None:
        """Stand in for the lost node's agent at torchrun's exit barrier (torch's own `store_util.barrier`
        on the round's store), so the other agents do not wait out its timeout."""
        from torch.distributed.elastic.utils.store import barrier

        try:
            barrier(self._round_store(), self.found.nodes, TERMINAL_STATE_SYNC_ID, barrier_timeout=300)
        except Exception as exc:
            log.warning("standby: the exit barrier failed: %s", exc)

    def barrier_passed(self) -> bool:
        """Whether the round's agents all passed torchrun's exit barrier (the job's end)."""
        return exit_barrier_passed(self.raw, self.launch.run_id, self.found.round)  # see `job_finished`

    def _round_store(self) -> Any:
        return round_store(self.raw, self.launch.run_id, self.found.round)


def _wait_for_round(
    launch: Launch, role: str, stopping: Callable[[], int | None], *, seen: bool
) -> tuple[Any, Round] | Decision:
    """Connect and wait until the job's round runs (its nodes beating): the store and the round, or what
    `decide_standby` decided instead (`StandbyState.WAITING`: a shutdown, a member's pod joining when no
    round runs, the job over, the store gone once reached (or once this standby saw the job run: `seen`),
    the store never reached within the rendezvous' join timeout)."""
    started = time.monotonic()
    reached = started if seen else None  # when the store last answered
    while True:
        raw, found, over = None, None, False
        signum = stopping()
        if signum is None:
            try:
                timeout_s = RECONNECT_TIMEOUT_S if reached is not None else STORE_TIMEOUT_S
                raw = store_client(launch.endpoint, timeout_s=timeout_s)
                reached = time.monotonic()
                found = _round_running(raw, launch.run_id, launch.secret)
                over = found is None and job_finished(raw, launch.run_id, launch.secret)
            except Exception:
                found, raw, over = None, None, False
        now = time.monotonic()
        look = StandbyObservation(
            stopping=signum,
            member=role == "member",
            round_running=found is not None,
            job_over=over,
            unreached_s=None if reached is None else now - reached,
            gone_after_s=STORE_GONE_S,
            elapsed_s=now - started,
            join_timeout_s=launch.join_timeout_s,
        )
        decision = decide_standby(StandbyState.WAITING, look)
        if isinstance(decision, StandBy) and found is not None:
            return raw, found
        if not isinstance(decision, Wait):
            if isinstance(decision, StandDown) and decision.reason:
                print(f"torchrig: standby: {decision.reason} ({launch.endpoint})", file=sys.stderr, flush=True)
            return decision
        time.sleep(1.0)


def run_standby(launch: Launch, env: MutableMapping[str, str] | None = None) -> int:
    """Stand by for the running round, take a lost node when one is lost; returns the exit code, or
    `JOIN` when this (member's) pod should run torchrun after all."""
    env = os.environ if env is None else env
    role = _replica_role(env) or "spare"
    stopping: list[int] = []

    def _stop(signum: int, frame: Any) -> None:
        stopping.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    seen = False
    while True:
        waited = _wait_for_round(launch, role, lambda: stopping[0] if stopping else None, seen=seen)
        if isinstance(waited, tuple):
            raw, found = waited
            seen = True
            decision = _stand_by(launch, raw, found, env, stopping, member=role == "member")
            if isinstance(decision, RoundOver):
                continue  # stand by for the next round
        else:
            decision = waited
        return _carry_out(decision)


def _carry_out(decision: Decision) -> int:
    """The end of a standby's last decision: `JOIN` (run torchrun's agent after all) or its exit code."""
    if isinstance(decision, Join):
        return JOIN
    code = decision.exit_code
    assert isinstance(decision, StandDown | PassThrough) and code is not None, decision
    return code


def _stand_by(
    launch: Launch, raw: Any, found: Round, env: MutableMapping[str, str], stopping: list[int], *, member: bool
) -> Decision:
    """One round: warm hosts, watch the beats, take a lost node, each step as `decide_standby` decides. The
    last decision: how the standby ends, or `RoundOver` (stand by for the next round)."""
    from training.inplace.group import NodeWatch, nodes_behind

    slot = int(raw.add(InPlace.standby_slots_key(launch.run_id), 1)) - 1
    standby = Standby(launch, raw, found, slot, env)
    print(
        f"torchrig: standby: round {found.round} of {launch.run_id} runs on {found.nodes} node(s); this node "
        f"stands by (slot {slot}) instead of joining the rendezvous",
        file=sys.stderr,
        flush=True,
    )
    standby.start_hosts()
    mark_standby()  # the liveness probe: no exporter here until this node takes a lost node's ranks
    store, inplace = standby.store, standby.inplace
    world, nproc = found.nodes * launch.nproc, launch.nproc
    # A node silent for BEHIND_LOST_S whose ranks never joined the generation the others are forming is
    # taken then, not after HOST_LOST_S: the broken group confirms what the beat says.
    watch = NodeWatch(
        store, inplace, found.nodes, lost_after_s=HOST_LOST_S, behind=lambda: nodes_behind(store, inplace, world, nproc)
    )
    state = StandbyState.WARMING
    last_reached = next_round_look = time.monotonic()
    try:
        while True:
            look = StandbyObservation(
                stopping=stopping[0] if stopping else None,
                member=member,
                host_codes=tuple(proc.poll() for proc in standby.hosts),
                nodes=found.nodes,
                gone_after_s=STORE_GONE_S,
            )
            handover: list[tuple[int, bytes]] = []
            if state is not StandbyState.HOLDING and look.stopping is None:
                look = _watch(standby, watch, state, look, handover)
                if look.store_failed is None:
                    last_reached = time.monotonic()
                look = replace(look, unreached_s=time.monotonic() - last_reached)
            elif look.stopping is None and time.monotonic() >= next_round_look:
                # Once a second: two store requests, and the standby's hosts go on training meanwhile.
                next_round_look = time.monotonic() + ROUND_LOOK_S
                look = replace(look, new_round=standby.new_round())
            decision = decide_standby(state, look)
            if isinstance(decision, Wait):
                time.sleep(POLL_S)
            elif isinstance(decision, Ready):
                try:
                    store.add(inplace.standbys_key(), 1)
                except Exception:  # not counted: the next look sees the store fail, or decides this again
                    time.sleep(POLL_S)
                    continue
                print(
                    f"torchrig: standby: ready for round {found.round} ({found.nodes} nodes)",
                    file=sys.stderr,
                    flush=True,
                )
            elif isinstance(decision, Take):
                # One compare-and-set per node against every other standby; losing each one is a wait, and
                # so is a store that fails midway: the next look takes the node again (`Standby.take`).
                if decision.handover:
                    handed = handover[0] if handover else None
                    took = handed is not None and standby.take_quietly(*handed, handover=True)
                else:
                    took = any(standby.take_quietly(node, watch.seen[node][0]) for node in decision.nodes)
                if took:
                    clear_standby()  # a node now: its exporter answers the liveness probe
                    store.add(inplace.standbys_key(), -1)
                else:
                    decision = Wait()
                time.sleep(POLL_S)
            else:
                if isinstance(decision, PassThrough) and decision.code == 0 and not standby.handed_over:
                    # torchrun's agent of the lost node would pass it now (a handed-over node's agent, alive,
                    # passed it itself when its hosts left)
                    standby.exit_barrier()
                if isinstance(decision, StandDown | RoundOver | Join) and decision.reason:
                    print(f"torchrig: standby: {decision.reason}", file=sys.stderr, flush=True)
                return decision
            state = next_state(STANDBY_TRANSITIONS, state, decision)
    finally:
        clear_standby()
        if standby.taken is None:
            if state is StandbyState.READY:
                with contextlib.suppress(Exception):
                    store.add(inplace.standbys_key(), -1)
            standby.stop_hosts()
        elif stopping:
            standby.stop_hosts(stopping[0], grace_s=None)
        else:
            # The round is over for the node it holds (its hosts ended, or a new round began without it): a
            # trainer still running belongs to no round; its state is not the restart's (that one restored
            # from the durable checkpoint), so it gets no chance to save one beside it.
            standby.stop_hosts(signal.SIGKILL)


def _watch(
    standby: Standby,
    watch: NodeWatch,
    state: StandbyState,
    look: StandbyObservation,
    handover: list[tuple[int, bytes]],
) -> StandbyObservation:
    """What the store says at one look of a standby that holds no node yet: the job's end, its spares
    warm, a node handed over after an SDC (also appended to `handover`, with its taker key's tail), the
    round's lost and ended nodes (or that the store failed)."""
    try:
        if any(code is not None for code in look.host_codes):
            return replace(look, job_over=standby.barrier_passed())  # all this look needs to know
        if standby.barrier_passed():
            return replace(look, job_over=True)
        ready = state is StandbyState.WARMING and standby.spares_ready()
        handed = standby.handover() if state is StandbyState.READY else None
        if handed is not None:
            handover.append(handed)
            return replace(look, handed_over=handed[0])  # taken at once: no need to look at the beats
        gone = watch.lost()
        ended = [n for n in gone if standby.inplace.read(standby.store, standby.inplace.ended_key(n)) is not None]
    except Exception as exc:
        return replace(look, store_failed=f"{type(exc).__name__}: {exc}")
    lost = tuple(n for n in gone if n not in ended)
    return replace(look, spares_ready=ready, lost=lost, ended=tuple(ended))
