"""Carrying out a drill's planned outside actions on a running job.

The scenario decided what to do (`orchestrator.drills.plan`); this module does it to a
`SupervisedRun` of any backend, from a thread beside the one waiting for the run, and records what it
did and where the fault struck in the drill's `Outcome`. It reads the job's progress from its run
directory (`RunHistory`), the way an operator would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.backends.base import NodePlacement, RunState, SupervisedRun
from orchestrator.drills.damage import committed_steps, corrupt_newest, make_store_unreachable, restore_store
from orchestrator.drills.history import RunHistory
from orchestrator.drills.plan import (
    Action,
    AwaitCommit,
    AwaitProgress,
    AwaitStandby,
    AwaitStep,
    AwaitStoreFailure,
    AwaitWorldSize,
    DrillPlan,
    LinkCut,
    LinkHeal,
    NodeAdd,
    NodeKill,
    Outcome,
    Preempt,
    RankKill,
    ReleaseFaults,
    StoreBack,
    StoreCorrupt,
    StoreLoss,
)
from orchestrator.errors import UnsupportedFeature
from orchestrator.spec import JobSpec
from training.contract import DrillEventKind, EventKind, RunFiles, Summary

if TYPE_CHECKING:
    from orchestrator.drills.netns import NetnsPair

__all__ = ["ActionRunner", "StandbyWait", "emulated_network", "placements", "supervise", "wait_for"]


def wait_for(predicate: Callable[[], bool], timeout_s: float, run: SupervisedRun, poll_s: float = 0.1) -> bool:
    """Poll `predicate` until it holds, the run ends (one last look) or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        if run.poll().terminal:
            return bool(predicate())
        time.sleep(poll_s)
    return False


@dataclass(frozen=True)
class StandbyWait:
    """How the wait for a warm standby node before a node fault (`AwaitStandby`) ended."""

    ready: bool
    waited_s: float
    detail: str  # one line for the report's check
    fault: str = "node fault"  # what waited for the standby (`AwaitStandby.fault`)


@dataclass(frozen=True)
class _Store:
    name: str
    uri: str  # resolved against the run directory
    options: dict[str, Any]


class ActionRunner:
    """Carries out one plan's actions in order; an `AwaitCommit(required=True)` that times out stops them."""

    def __init__(
        self,
        run: SupervisedRun,
        spec: JobSpec,
        outcome: Outcome,
        *,
        timeout_s: float,
        network: NetnsPair | None = None,
        lose_store_hook: Callable[[str], None] | None = None,
        store_back_hook: Callable[[str], None] | None = None,
    ) -> None:
        self.run = run
        self.outcome = outcome
        self.total_steps = spec.spec.training.steps
        self.timeout_s = timeout_s
        self.network = network
        self.lose_store_hook = lose_store_hook
        self.store_back_hook = store_back_hook
        self.stores = [
            _Store(s.display_name, s.resolved_uri(run.run_dir), dict(s.options)) for s in spec.spec.checkpoint.stores
        ]
        self.standby_wait: StandbyWait | None = None  # how `AwaitStandby` ended, once it ran

    def run_all(self, actions: Sequence[Action]) -> None:
        for action in actions:
            if not self.do(action):
                return

    def committed_by_store(self) -> dict[str, list[int]]:
        """Each store's steps with a manifest (oldest first), as the stores show them now."""
        return {store.name: committed_steps(store.uri, store.options) for store in self.stores}

    # -- what the job shows -------------------------------------------------------------------------
    def _history(self) -> RunHistory:
        return RunHistory.load(self.run.run_dir)

    def _latest_step(self) -> int:
        return self._history().latest_step()

    def _wait(self, predicate: Callable[[], bool]) -> bool:
        return wait_for(predicate, self.timeout_s, self.run)

    def _strike(self, kind: str, **where: Any) -> None:
        """Record the fault at the step the job had actually reached (later than planned, from outside).

        A fault that strikes a job which already did every step (or whose run already ended
        successfully) tests nothing: the drill's poll saw the planned step too late. That is recorded
        in `Outcome.too_late`, and the runner makes the verdict inconclusive rather than pass or fail.
        """
        step = self._latest_step()
        self.outcome.fault_step = step
        if self.outcome.too_late is None:
            self.outcome.too_late = self._too_late(step)
        self.outcome.record(DrillEventKind.FAULT_INJECTED, kind=kind, **where, step=step)

    def _too_late(self, step: int) -> str | None:
        """Why a fault striking now, at `step`, comes after the job's end; None while there is work left."""
        total = self.total_steps
        # Only a successful end counts: a run that failed before the fault is the drill's failure to
        # report (its checks say so), not a reason to call the drill unproven.
        if step < total and self.run.poll() is not RunState.SUCCEEDED:
            return None
        return (
            f"the job finished before the fault: step {step} of {total}; run it with more steps "
            "(--set spec.training.steps=...) or an earlier --at-step"
        )

    # -- one action ---------------------------------------------------------------------------------
    def do(self, action: Action) -> bool:
        """Carry out one action; False when the rest of the plan must not run."""
        match action:
            case AwaitStep(step=step):
                self._wait(lambda: self._latest_step() >= step)
            case AwaitProgress(steps=steps):
                target = self._latest_step() + steps
                self._wait(lambda: self._latest_step() >= target)
            case AwaitCommit(store=index, step=step, required=required):
                store = self.stores[index]
                done = self._wait(lambda: any(s >= step for s in committed_steps(store.uri, store.options)))
                if not done and required:
                    reason = f"no checkpoint >= step {step} was committed in {store.name}"
                    self.outcome.record(DrillEventKind.DAMAGE_SKIPPED, reason=reason)
                    return False
            case AwaitWorldSize(size=size):
                shrunk = self._wait(lambda: self._history().world_sizes()[-1:] == [size])
                self.outcome.record(DrillEventKind.SHRUNK if shrunk else DrillEventKind.DID_NOT_SHRINK)
            case StoreCorrupt(store=index, kind=kind):
                store = self.stores[index]
                damage = corrupt_newest(store.uri, kind, store.options)
                self.outcome.damage = {**damage.to_dict(), "store_name": store.name}
                self.outcome.record(DrillEventKind.CHECKPOINT_DAMAGED, **damage.to_dict())
            case StoreLoss(store=index):
                self._lose_store(self.stores[index])
            case StoreBack(store=index):
                self._store_back(self.stores[index])
            case AwaitStoreFailure(store=index, prefix=prefix):
                name = self.stores[index].name
                since = min(self.outcome.times(DrillEventKind.FAULT_INJECTED), default=0.0)
                self._wait(
                    lambda: any(
                        e.time >= since and e.get("store") == name and str(e.get("error") or "").startswith(prefix)
                        for e in self._history().of(EventKind.STORE_FAILURE)
                    )
                )
            case RankKill(rank=rank):
                pids = self._history().worker_pids(rank)
                if pids:
                    self._strike("kill", rank=rank)
                    for pid in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
            case NodeKill(node=node, fault=fault):
                if fault:
                    self._strike("kill-node", node=node)
                self.run.kill_node(node)
                if fault:
                    self.outcome.fault_rank, self.outcome.fault_node = None, node
            case Preempt(grace_s=grace_s, node=node):
                self._strike("preempt", node="all" if node is None else node)
                # Every process of a node (None: of the job) gets the signal: no one rank is the victim.
                self.outcome.fault_rank, self.outcome.fault_node = None, node
                self._preempt(node, grace_s)
            case LinkCut(node=node):
                network = self._network()
                self._strike("partition", node=node)
                self.outcome.fault_rank, self.outcome.fault_node = None, node
                network.cut(node)
            case LinkHeal(node=node):
                self._network().heal(node)
            case NodeAdd():
                self.outcome.record(DrillEventKind.NODE_ADDED)
                self.run.add_node()
            case AwaitStandby(fault=fault, withheld=withheld):
                return self._await_standby(fault, withheld)
            case ReleaseFaults():
                RunFiles(self.run.run_dir).fault_gate.touch()
        return True

    def _await_standby(self, fault: str = "node fault", withheld: str = "no node was killed") -> bool:
        """Wait (at most `timeout_s`) until a standby node of the run has its spares warm, and say how it ended
        (`standby_wait`). Only then may the fault strike (`fault`: a node fault, the sdc drill's bit flip): one
        before it measures the standby's start-up (or a flip, the same-node spare), or, if the job ends first (a
        loaded machine warms the standby slowly), nothing at all (`withheld` says what did not happen)."""
        ready = getattr(self.run, "standby_ready", None)
        if ready is None:
            raise UnsupportedFeature(
                f"a {fault} that waits for a standby node: this backend cannot tell when a standby is ready"
            )
        start = time.monotonic()
        warm = self._wait(ready)
        waited_s = time.monotonic() - start
        state = self.run.poll()
        if warm:
            detail = f"a standby node was ready {waited_s:.1f} s after the fault step"
        elif state is RunState.SUCCEEDED:
            step = self._latest_step()
            detail = f"the job finished (step {step} of {self.total_steps}) {waited_s:.0f} s into the wait"
            self.outcome.too_late = self.outcome.too_late or (
                f"the job finished before a standby node was ready (step {step} of {self.total_steps}, after "
                f"{waited_s:.0f} s of waiting): {withheld}; run it with more steps "
                "(--set spec.training.steps=...) or on a less loaded machine"
            )
        elif state.terminal:
            detail = f"the run ended ({state}) after {waited_s:.0f} s with no standby node ready; {withheld}"
        else:
            detail = f"no standby node was ready within {waited_s:.0f} s (the drill's timeout); {withheld}"
        self.standby_wait = StandbyWait(ready=warm, waited_s=waited_s, detail=detail, fault=fault)
        return warm

    def _preempt(self, node: int | None, grace_s: float) -> None:
        """SIGTERM every process of `node` (None: all nodes), SIGKILL what is left after `grace_s`."""
        from orchestrator.backends._local_procs import alive, kill_pids, process_start_ticks
        from orchestrator.backends.local_run import LocalRun
        from orchestrator.backends.ray_run import RayLocalRun, process_tree

        run = self.run
        if isinstance(run, LocalRun):
            nodes = [node] if node is not None else sorted(run.agent_pids())
            pids = [pid for n in nodes for pid in run.node_pids(n)]
            signalled = pids
        elif isinstance(run, RayLocalRun):
            # The SIGTERM goes to each Ray Train worker, as Ray's drain notice becomes one there
            # (`training.ray_train`); its host forwards it to its trainer. The deadline takes the whole tree.
            signalled = run.host_pids(node)
            pids = [pid for host in signalled for pid in process_tree(host)]
        else:
            raise UnsupportedFeature("preempt: signalling every process of a node needs the local or the Ray backend")
        started = {pid: process_start_ticks(pid) for pid in pids}  # pids get reused: SIGKILL only these
        for pid in signalled:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(p, started[p]) for p in pids):
            time.sleep(0.1)
        kill_pids([p for p in pids if alive(p, started[p])], signal.SIGKILL)

    def _lose_store(self, store: _Store) -> None:
        if not _remote(store, self.lose_store_hook, "lose-store", "stop it"):
            aside = make_store_unreachable(store.uri[len("file://") :])
            self.outcome.damage = {"store_name": store.name, "uri": store.uri, "moved_aside_to": aside}
        self._strike("lose-store", store=store.name)

    def _store_back(self, store: _Store) -> None:
        """Undo `_lose_store`: the store's path (or, through the hook, a remote store) answers again."""
        if not _remote(store, self.store_back_hook, "lose-store-at-restart", "bring it back"):
            aside = (self.outcome.damage or {}).get("moved_aside_to")
            if aside is None:
                raise UnsupportedFeature(f"store {store.name!r} was not made unreachable by this drill")
            restore_store(store.uri[len("file://") :], aside)
        # When it came back: the verdict wants the resume after this moment.
        self.outcome.damage = {**(self.outcome.damage or {"store_name": store.name}), "back_at": time.time()}

    def _network(self) -> NetnsPair:
        if self.network is None:
            raise UnsupportedFeature("this drill's plan cuts a link but its nodes share one network")
        return self.network


def _remote(store: _Store, hook: Callable[[str], None] | None, drill: str, what: str) -> bool:
    """Call `hook` on a store that is not a local path (False for a local one, which the caller handles)."""
    if store.uri.startswith("file://"):
        return False
    if hook is None:
        raise UnsupportedFeature(f"{drill}: store {store.name!r} is not a local path; pass a hook to {what}")
    hook(store.name)
    return True


@contextlib.contextmanager
def emulated_network(plan: DrillPlan, outcome: Outcome) -> Iterator[NetnsPair | None]:
    """Network namespaces for the emulated nodes when the plan needs them (destroyed on exit)."""
    if not plan.network:
        yield None
        return
    from orchestrator.drills.netns import NetnsPair, netns_supported

    reason = netns_supported()
    if reason:
        raise UnsupportedFeature(f"partition: {reason}")
    pair = NetnsPair().create()
    try:
        outcome.record(DrillEventKind.NETNS_CREATED, namespaces=list(pair.names), addrs=list(pair.addrs))
        yield pair
    finally:
        pair.destroy()


def placements(network: NetnsPair | None) -> list[NodePlacement]:
    """Where each emulated node runs: node i inside namespace i (none: all on this host's network)."""
    if network is None:
        return []
    return [
        NodePlacement(prefix=tuple(network.exec_prefix(i)), addr=network.addrs[i], ifname=network.links[i])
        for i in (0, 1)
    ]


def supervise(run: SupervisedRun, runner: ActionRunner, actions: Sequence[Action], timeout_s: float) -> Summary:
    """Wait for the run while the actions run in a thread; an action's exception lands in the outcome
    (reported, never swallowed: the verdict fails)."""

    def _act() -> None:
        try:
            runner.run_all(actions)
        except BaseException as exc:
            runner.outcome.errors.append(exc)

    actor = threading.Thread(target=_act, name="drill-actions", daemon=True)
    actor.start()
    summary = run.wait(timeout_s)
    actor.join(timeout=5)
    return summary
