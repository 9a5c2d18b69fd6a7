"""`LocalRun`: a local run in flight, supervised from this process (a `SupervisedRun`).

It starts one torchrun agent per emulated node and the c10d rendezvous store (`_local_store`: in this
process, or a process of its own for a node 0 in another network namespace), records itself in
`supervisor.json` (how `torchrig status` knows it is alive), watches the agents until the run ends,
and writes `summary.json`. `kill_node` and `add_node` are what the
drills use to take a node away and bring a replacement.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.backends._local_agent import PORT_PLACEHOLDER, read_port
from orchestrator.backends._local_procs import find_marked, kill_pids, process_start_ticks, spawn, terminate_then_kill
from orchestrator.backends._local_store import open_store, write_port
from orchestrator.backends._local_view import LiveProgress, QuietView, RunView
from orchestrator.backends.base import RunState
from orchestrator.backends.local_plan import LOG_LINE_PREFIX, LocalPlan, pick_port_block
from orchestrator.errors import BackendError, UnsupportedFeature
from orchestrator.loader import dump_spec
from orchestrator.rundir import build_summary, error_line, latest_failure_log
from orchestrator.spec import JobSpec
from training.contract import Env, Result, RunFiles, Summary, read_events, write_json
from training.contract.files import private_umask
from training.contract.orders import SecretError, create_job_secret
from training.preemption_timing import torchrun_shutdown_timeout

__all__ = ["DEFAULT_GRACE_S", "LocalRun"]

DEFAULT_GRACE_S = 10.0
STORE_START_TIMEOUT_S = 60.0
_STORE_NODE = "store"  # the store process's node marker (never a node index)


@dataclass
class _Agent:
    node: int
    proc: subprocess.Popen[bytes]
    killed: bool = False
    standby: bool = False  # started as a standby node (it may have taken a lost node's ranks since)
    took_node: bool = False  # a standby that took a lost node's ranks (`LocalRun._took_a_node`)


@dataclass
class LocalRun:
    """A local run in flight, supervised from this process (`LocalBackend.launch` starts it).

    The `SupervisedRun` surface: `run_dir`, `poll`, `wait`, `kill_node`, `add_node`, `stop`. The drills
    also read `agent_pids`, `node_pids`, `worker_pids` and `store_address`; `torchrig run` passes a live
    view to `wait` and calls `request_cancel` from its signal handler.
    """

    spec: JobSpec
    plan: LocalPlan
    run_dir: Path = field(init=False)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    endpoints: list[str] = field(default_factory=list)
    # A standby node's exporters serve only once it has taken a lost node's ranks.
    standby_endpoints: list[str] = field(default_factory=list)
    summary: Summary | None = None
    _agents: list[_Agent] = field(default_factory=list)
    _store: subprocess.Popen[bytes] | None = None  # the store's process (a node 0 in another network namespace)
    _store_server: Any = None  # else the store itself, served from this process (`_local_store.open_store`)
    _store_port: int = 0
    _metrics_ports: dict[int, int] = field(default_factory=dict)
    _started: float = 0.0
    _started_at: float = 0.0  # wall clock of `start`: a result.json older than that is an earlier attempt's
    _cancel_requested: bool = False
    _cancel_reason: str = "cancelled by the user"
    _force: bool = False
    _preempt_deadline: float | None = None  # set by the first Ctrl-C when preemption is on
    _private: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # `private_umask` while it runs

    def __post_init__(self) -> None:
        self.run_dir = Path(self.plan.run_dir)

    @property
    def files(self) -> RunFiles:
        return RunFiles(self.run_dir)

    # -- start ------------------------------------------------------------------------------------
    def start(self, preflight: Callable[[], None] | None = None) -> None:
        """Start one agent per node, prepare the run directory and start the rendezvous store.

        Args:
            preflight: Called after the agents are started and before anything of the run is written
                (the run directory's files, the store). The agents spend their first seconds importing
                torchrun, then wait for the store's port file (`_local_agent`), so a preflight that
                imports torch runs beside their imports instead of before them, and one that raises
                stops them before any worker starts: the exception propagates, nothing ran.
        """
        self._started = time.monotonic()
        self._started_at = time.time()
        self._private.enter_context(private_umask())  # the run's files are its user's alone, until `finish`
        try:
            self.files.logs.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                self.files.store_port.unlink()  # a resumed run's old port: the agents wait for the new one
            for node in range(self.plan.nodes):
                self._start_agent(node, alone=self.plan.nodes == 1 and not self.plan.standby_nodes)
            for node in range(self.plan.nodes, self.plan.nodes + self.plan.standby_nodes):
                self._start_agent(node, role=self._STANDBY)
            if preflight is not None:
                preflight()
            self._prepare_run_dir()
            self._start_store()
            self._await_store_port()
        except BaseException:
            self._kill_everything()
            self._private.close()
            raise
        self._write_supervisor()

    def _prepare_run_dir(self) -> None:
        files = self.files
        if self.plan.resume and files.summary.exists():
            # Never delete what a previous attempt wrote: its summary is kept under another name.
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(files.summary.stat().st_mtime))
            os.replace(files.summary, files.archived_summary(stamp))
        files.job.write_text(dump_spec(self.spec))
        if secret := self.plan.env.get(Env.JOB_SECRET_FILE):
            try:  # a resumed run keeps its secret (processes of before may still read the store)
                create_job_secret(secret)
            except (SecretError, OSError) as exc:
                raise BackendError(f"the run's secret: {exc}") from None

    def _spawn(
        self, cmd: list[str], *, node: str, log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start one process of this run: its own session, output to `log`, the run's markers in its env."""
        marked = {**(env or {}), Env.RUN_TOKEN: self.token, Env.LOCAL_NODE: node}
        return spawn(cmd, log=log, env=marked, cwd=os.getcwd())

    def _start_store(self) -> None:
        port_file = self.files.store_port
        if not self.plan.placement(0).prefix:
            # In this process: the supervisor outlives every agent, and a store process of its own
            # imported torch beside the agents on the 2-core start-up path (docs/performance.md).
            self._store_server = open_store(self.plan.store_host)
            write_port(str(port_file), int(self._store_server.port))
            return
        cmd = [*self.plan.placement(0).prefix, sys.executable, "-m", "orchestrator.backends._local_store"]
        secret = {k: v for k, v in self.plan.env.items() if k == Env.JOB_SECRET_FILE}
        self._store = self._spawn(
            [*cmd, str(port_file), self.plan.store_host], node=_STORE_NODE, log=self.files.store_log, env=secret
        )

    def _await_store_port(self) -> None:
        """Wait for the store to write its port (kept in the file for the agents still reading it)."""
        port_file = self.files.store_port
        deadline = time.monotonic() + STORE_START_TIMEOUT_S
        while (port := read_port(str(port_file), timeout_s=0)) is None:
            if self._store is not None and self._store.poll() is not None:
                raise BackendError(
                    f"the rendezvous store exited with {self._store.returncode}; see {self.files.store_log}"
                )
            if time.monotonic() > deadline:
                raise BackendError(f"the rendezvous store did not start in {STORE_START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        self._store_port = port

    def _node_spec_file(self, node: int) -> Path:
        """job.yaml for node 0; other nodes get a copy whose metrics port does not collide on this host."""
        metrics = self.spec.spec.metrics
        procs = self.plan.procs_per_node
        spec = self.spec
        if metrics.enabled:
            taken = {p + r for p in self._metrics_ports.values() for r in range(procs)}
            port = pick_port_block(metrics.port + node * procs, procs, taken)
            self._metrics_ports[node] = port
            standby = self.plan.nodes <= node < self.plan.nodes + self.plan.standby_nodes
            listed = self.standby_endpoints if standby else self.endpoints
            listed.extend(f"http://127.0.0.1:{port + r}/metrics" for r in range(procs))
            if node == 0 and port == metrics.port:
                return self.files.job
            spec = spec.model_copy(deep=True)
            spec.spec.metrics.port = port
        elif node == 0:
            return self.files.job
        path = self.files.node_spec(node)
        path.parent.mkdir(exist_ok=True)
        path.write_text(dump_spec(spec))
        return path

    _STANDBY, _REPLACEMENT = "standby", "replacement"

    def _start_agent(self, node: int, role: str | None = None, *, alone: bool = False) -> _Agent:
        """Start agent `node`. `role`: a standby node (it stands by from the start), or a replacement in a
        run with standby nodes (it stands by while the round runs, else joins; `training.inplace.standby`).
        `alone`: the run's only node at launch, whose first round need not wait for another."""
        spec_file = self._node_spec_file(node)
        env = {**self.plan.env, Env.SPEC: str(spec_file), Env.LOG_LINE_PREFIX_TEMPLATE: LOG_LINE_PREFIX}
        if alone:
            env[Env.FIRST_ROUND_ALONE] = "1"
        if role is not None and self.plan.standby_nodes:
            env[Env.STANDBY_FROM] = str(self.plan.nodes)
            env[Env.REPLICA_INDEX] = str(node if role == self._STANDBY else 0)
        # In-place recovery forms every process-group generation on this store: it outlives every trainer.
        starting = not self._store_port  # the store is still starting: the agent reads its port file
        port_file = str(self.files.store_port) if starting else None
        env[Env.INPLACE_STORE] = f"{self.plan.store_host}:{PORT_PLACEHOLDER}" if starting else self.store_address
        if ifname := self.plan.placement(node).ifname:
            env[Env.GLOO_SOCKET_IFNAME] = ifname
        cmd = self.plan.agent_command(node, self._store_port, str(spec_file), port_file=port_file)
        agent = _Agent(node=node, proc=self._spawn(cmd, node=str(node), log=self.files.node_log(node), env=env))
        agent.standby = role == self._STANDBY
        self._agents.append(agent)
        return agent

    def _write_supervisor(self) -> None:
        write_json(
            self.files.supervisor,
            {
                "pid": os.getpid(),
                "start_ticks": process_start_ticks(os.getpid()),
                "started_at": time.time(),
                "backend": "local",
                "run_token": self.token,
                "rdzv_id": self.plan.rdzv_id,
                "resumed": self.plan.resume,
                "store": {"pid": self._store.pid if self._store else os.getpid(), "port": self._store_port},
                "agents": [{"node": a.node, "pid": a.proc.pid, "killed": a.killed} for a in self._agents],
                "metrics_endpoints": self.endpoints,
                "standby_metrics_endpoints": self.standby_endpoints,
            },
        )

    # -- what the drills use ----------------------------------------------------------------------
    @property
    def store_address(self) -> str:
        """`host:port` of the run's rendezvous store."""
        return f"{self.plan.store_host}:{self._store_port}"

    def agent_pids(self) -> dict[int, int]:
        """Node index -> pid of its (live) agent. Each agent leads its own process group."""
        return {a.node: a.proc.pid for a in self._agents if not a.killed and a.proc.poll() is None}

    def node_pids(self, node: int) -> list[int]:
        """Every live process of emulated node `node`: its agent, its workers and their children."""
        pids = set(find_marked(self.token, node))
        for a in self._agents:
            if a.node == node and a.proc.poll() is None:
                pids.add(a.proc.pid)
        return sorted(pids)

    def worker_pids(self, node: int | None = None) -> list[int]:
        """Live worker processes (not agents, not the store), of one node or of all."""
        agents = {a.proc.pid for a in self._agents}
        store = {self._store.pid} if self._store else set()
        return sorted(set(find_marked(self.token, node)) - agents - store)

    def _took_a_node(self, agent: _Agent) -> bool:
        """Whether standby `agent` took a lost node's ranks (its log says so; remembered once seen)."""
        if not agent.took_node:
            with contextlib.suppress(OSError):
                log = self.files.node_log(agent.node).read_text(errors="replace")
                agent.took_node = "torchrig: standby: node " in log
        return agent.took_node

    def standby_ready(self) -> bool:
        """Whether a standby node of this run has its spares warm (its log says so)."""
        for agent in self._agents:
            if agent.standby and not agent.killed:
                with contextlib.suppress(OSError):
                    if "torchrig: standby: ready" in self.files.node_log(agent.node).read_text(errors="replace"):
                        return True
        return False

    def kill_node(self, node: int, sig: signal.Signals = signal.SIGKILL) -> list[int]:
        """Kill emulated node `node` like a machine dying: its agent and all its workers. Returns the pids."""
        agent = next((a for a in self._agents if a.node == node and not a.killed), None)
        if agent is None:
            raise BackendError(f"node {node}: no such live node (nodes: {sorted(self.agent_pids())})")
        agent.killed = True
        pids = self.node_pids(node)
        # The agent first, so it cannot restart the workers we are about to kill.
        kill_pids([agent.proc.pid], sig)
        kill_pids([p for p in pids if p != agent.proc.pid], sig)
        # A worker the agent was starting at that instant may have been missed: scan again.
        time.sleep(0.1)
        late = [p for p in find_marked(self.token, node) if p not in pids]
        kill_pids(late, sig)
        pids += late
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.proc.wait(timeout=10)
        self._write_supervisor()
        return pids

    def add_node(self) -> int:
        """Start one more agent that joins the running rendezvous (a replacement node). Returns its index."""
        live = len([a for a in self._agents if not a.standby and not a.killed and a.proc.poll() is None])
        if live >= self.spec.spec.nodes.max:
            raise UnsupportedFeature(f"spec.nodes.max: the job already runs on {live} of at most {live} nodes")
        node = max((a.node for a in self._agents), default=-1) + 1
        self._start_agent(node, role=self._REPLACEMENT)
        self._write_supervisor()
        return node

    # -- supervision ------------------------------------------------------------------------------
    def request_cancel(self, reason: str = "cancelled by the user") -> None:
        """Signal-safe: ask `wait` to stop the run (a second call skips the grace period)."""
        if self._cancel_requested:
            self._force = True
        else:
            self._cancel_reason = reason
        self._cancel_requested = True

    def poll(self) -> RunState:
        """RUNNING while any (not deliberately killed) agent runs; else how the run ended.

        A run whose workers finished every step (`_workers_finished`) succeeded whatever its agents'
        exit codes, and whether or not a cancel came meanwhile: an agent that a signal reaches after
        its workers succeeded, before its monitor loop noticed, exits 143 (torchrun's `SignalException`: 128 + SIGTERM).
        """
        if self.summary is not None:
            return RunState(self.summary.status)
        live = [a for a in self._agents if not a.killed]
        if any(a.proc.poll() is None and (not a.standby or self._took_a_node(a)) for a in live):
            return RunState.RUNNING  # a standby that never took a node keeps nothing running
        live = [a for a in live if not a.standby or a.proc.poll() is not None]
        if self._workers_finished():
            return RunState.SUCCEEDED
        if self._cancel_requested:
            return RunState.CANCELLED
        if live and all(a.proc.returncode == 0 for a in live):
            return RunState.SUCCEEDED
        return RunState.FAILED

    def _workers_finished(self) -> bool:
        """True when rank 0 of this attempt wrote result.json with every step of `spec.training.steps` done.

        Rank 0 writes result.json last, after the final checkpoint's outcome (a lost one still turns the
        run `failed` in `build_summary`). Only a result.json written since `start` counts: a resubmitted
        run reuses the run directory, and an earlier attempt's result proves nothing about this one.
        """
        path = self.files.result
        try:
            written = path.stat().st_mtime
        except OSError:
            return False
        if written < self._started_at:
            return False
        result = Result.read(path)
        return result is not None and result.steps >= self.spec.spec.training.steps

    def wait(self, timeout_s: float | None = None, *, view: RunView | None = None, interval_s: float = 0.25) -> Summary:
        """Supervise until the run ends (or is cancelled, or `timeout_s` passes: then it is cancelled).

        Args:
            timeout_s: Cancel the run when it has not ended after this many seconds.
            view: What to show meanwhile (`torchrig run`'s live view); default nothing.
            interval_s: Seconds between two looks at the agents.

        Returns:
            The summary, also written to summary.json.
        """
        view = view or QuietView(LiveProgress(self.run_dir, self.spec.spec.training.steps), self.endpoints)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        view.start()
        state: RunState | None = None
        try:
            while True:
                view.refresh(self._note())
                state = self.poll()
                if state.terminal:
                    break
                if self._cancel_requested and not self._force and self._preempting():
                    time.sleep(interval_s)  # the workers are saving their emergency checkpoint
                    continue
                if self._cancel_requested or (deadline is not None and time.monotonic() > deadline):
                    state = RunState.CANCELLED
                    break
                self._nap(interval_s)
        finally:
            if state is None:  # an exception in the loop: take everything down
                self._kill_everything()
            view.stop()
        return self.finish(state)

    def _nap(self, interval_s: float) -> None:
        """Sleep `interval_s`, or until an agent that runs exits, whichever comes first: the run's end is
        seen when its last agent exits, not up to `interval_s` later (0.125 s on average at the end of every
        run). Waits on the agents' pidfds (Linux >= 5.3); elsewhere, or when one cannot be opened, sleeps."""
        fds: list[int] = []
        try:
            for agent in self._agents:
                if agent.proc.poll() is None:
                    fds.append(os.pidfd_open(agent.proc.pid))
            if fds:
                select.select(fds, [], [], interval_s)
                return
        except (AttributeError, OSError):  # no pidfd_open here (not Linux, an old kernel): a plain sleep
            pass
        finally:
            for fd in fds:
                os.close(fd)
        time.sleep(interval_s)

    def _note(self) -> str:
        if self._preempt_deadline is not None:
            return "preempting: the workers save an emergency checkpoint (Ctrl-C again: stop now)"
        return "" if self.files.events.exists() else "starting agents and rendezvous"

    def _preempting(self) -> bool:
        """After the first Ctrl-C, with `restarts.preemptGraceSeconds` on: SIGTERM the agents once (they
        forward it; every worker stops at one agreed step, saves an emergency checkpoint and exits 202),
        then keep supervising while they finish, up to torchrun's own shutdown timeout. True meanwhile."""
        restarts = self.spec.spec.restarts
        if restarts.preempt_grace_seconds <= 0:
            return False
        if self._preempt_deadline is None:
            self._preempt_deadline = time.monotonic() + torchrun_shutdown_timeout(restarts) + 5
            # One SIGTERM per agent (not its process group too): a second one would end torchrun's wait
            # for its workers, and with it their emergency checkpoint.
            for agent in self._agents:
                if not agent.killed and agent.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(agent.proc.pid, signal.SIGTERM)
        return time.monotonic() < self._preempt_deadline

    def finish(self, state: RunState | str, grace_s: float | None = None) -> Summary:
        """Stop what is left, write summary.json and return it (once: later calls return the same).

        Args:
            state: How the run ended; CANCELLED stops the agents with a grace period first. A run whose
                workers stopped on a preemption (a first Ctrl-C) ends `preempted` (`build_summary`); a
                run whose workers had finished every step by the time everything stopped ends
                `succeeded`, whatever `state` says (`_workers_finished`: a cancel or a signal that came
                after the work was done takes nothing away).
            grace_s: That grace period (default 10 s; none after a second Ctrl-C).
        """
        if self.summary is not None:
            return self.summary
        state = RunState(state)
        reason = None
        if state is RunState.CANCELLED:
            self._terminate(grace_s if grace_s is not None else 0.0 if self._force else DEFAULT_GRACE_S)
            reason = self._cancel_reason
        else:
            self._kill_everything()
        if state in (RunState.CANCELLED, RunState.FAILED) and self._workers_finished():
            # Checked once everything has stopped: the workers may have written their result meanwhile.
            state, reason = RunState.SUCCEEDED, None
        log = latest_failure_log(self.run_dir) if state is RunState.FAILED else None
        worker_exit = self._permanent_exit() if state is RunState.FAILED else None
        if worker_exit is not None:
            # A worker's permanent exit stopped the agents at once (`training.torchrun`): its own line says why.
            why = error_line(log) or f"a worker exited {worker_exit}"
            reason = f"{why} (worker exit {worker_exit}: permanent, not restarted)"
            reason += f"; failing rank's log: {log}" if log else ""
        elif state is RunState.FAILED:
            reason = self._failure_reason() + (f"; failing rank's log: {log}" if log else "")
        stores = [
            {"name": s.display_name, "uri": s.resolved_uri(self.run_dir)} for s in self.spec.spec.checkpoint.stores
        ]
        summary = build_summary(
            self.run_dir,
            status=state.value,
            wall_s=time.monotonic() - self._started,
            stores=stores,
            total_steps=self.spec.spec.training.steps,
            reason=reason,
            since=self._started_at,
        )
        if log is not None:
            summary.failure_log = str(log)
        summary.worker_exit = worker_exit
        summary.write(self.files.summary)
        self._private.close()
        self.summary = summary
        return summary

    @property
    def started_at(self) -> float:
        """Wall clock of `start` (what a resubmit's live view and summary count from)."""
        return self._started_at

    def _permanent_exit(self) -> int | None:
        """The permanent exit code (`PERMANENT`) an agent ended with: a worker's, passed on by the agent."""
        from training.contract.exit_codes import PERMANENT

        codes = [a.proc.returncode for a in self._agents if not a.killed and a.proc.returncode in PERMANENT]
        return codes[0] if codes else None

    def _failure_reason(self) -> str:
        """Why the agents ended the run: "restarts exhausted" only when the events show the restart budget
        was spent (the workers' highest restart generation, as `build_summary` counts `restarts`, of
        this attempt: a resubmitted run's events.jsonl holds the earlier attempts' generations too)."""
        codes = {a.node: a.proc.returncode for a in self._agents if not a.killed}
        budget = self.spec.spec.restarts.max
        events = [e for e in read_events(self.files.events) if e.time >= self._started_at]
        restarts = max((e.generation for e in events), default=0)
        if budget > 0 and restarts >= budget:
            return f"restarts exhausted (spec.restarts.max={budget}); agent exit codes {codes}"
        plural = "" if restarts == 1 else "s"
        return (
            f"the torchrun agent(s) exited with codes {codes} after {restarts} restart{plural} "
            f"(spec.restarts.max={budget})"
        )

    def stop(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        """Stop the run now: SIGTERM the agents (they stop their workers), SIGKILL whatever is left after
        `grace_s`; the summary says `cancelled` (unless the run had already ended, or its workers had
        finished every step: `finish`)."""
        state = self.poll()
        self._cancel_requested = True
        self.finish(state if state.terminal else RunState.CANCELLED, grace_s)

    def _terminate(self, grace_s: float) -> None:
        pids = [a.proc.pid for a in self._agents if a.proc.poll() is None]
        terminate_then_kill(pids, grace_s, token=None)
        self._kill_everything()

    def _kill_everything(self) -> None:
        for a in self._agents:
            if a.proc.poll() is None:
                kill_pids([a.proc.pid], signal.SIGKILL)
        # Workers outlive their agents (own sessions): find them by the run's marker.
        terminate_then_kill([], 0.0, token=self.token)
        self._store_server = None  # the in-process store closes its port (the agents are gone by now)
        if self._store is not None and self._store.poll() is None:
            self._store.terminate()
            try:
                self._store.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._store.kill()
        for a in self._agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.proc.wait(timeout=5)
        if self._store is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._store.wait(timeout=5)
