"""The local backend: a job on this machine through torch.distributed.elastic (the engine of torchrun).

One *agent* per emulated node runs `python -m torch.distributed.run` (elastic's own agent, restart and
rendezvous logic: nothing home-made) in its own session. All agents join one c10d rendezvous whose
TCPStore runs in a small process of its own (`_local_store`), with `is_host=false` and fast failure
detection, so any agent may die without taking the job down, and a replacement joins the running
rendezvous (`LocalRun.kill_node`, `LocalRun.add_node`: what the drills use).

The supervisor (`LocalRun`, inside `torchrig run`) owns the run directory (`_local_rundir`), shows
progress (`_local_view`) and writes summary.json at the end.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestrator.backends._local_procs import (
    NODE_ENV,
    RUN_TOKEN_ENV,
    alive,
    find_marked,
    kill_pids,
    process_start_ticks,
    terminate_then_kill,
)
from orchestrator.backends._local_rundir import (
    RunFiles,
    build_summary,
    find_run_dirs,
    latest_failure_log,
    new_run_dir,
    read_json,
    run_state,
    write_json,
)
from orchestrator.backends._local_view import LiveProgress, QuietView, RunView
from orchestrator.backends.base import (
    Backend,
    Capabilities,
    DryRun,
    RunHandle,
    RunState,
    RunStatus,
    SubmitOptions,
)
from orchestrator.errors import BackendError, SpecError, UnsupportedFeature
from orchestrator.loader import dump_spec
from orchestrator.spec import JobSpec

__all__ = ["RDZV_CONF", "LocalBackend", "LocalPlan", "LocalRun", "parse_run_ref"]

# Fast failure detection (ENVIRONMENT.md): with elastic's defaults a survivor waits ~47 s for a dead
# peer; with these ~6-9 s. keep_alive_max_attempt is 5, not 2: on a loaded machine an agent's keep-alive
# thread can lag 2 s, the agent then expires ITSELF from the complete round, and a joining node forms
# a second, separate world (seen here: two world-size-1 groups side by side). `is_host=false`: no agent
# hosts the store, the store process does.
RDZV_CONF: dict[str, str] = {
    "is_host": "false",
    "last_call_timeout": "2",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "5",
    "join_timeout": "600",
}
# Every rank's line in logs/node<i>.log starts with its global rank: `torchrig logs --rank R` greps it.
LOG_LINE_PREFIX = "[rank${rank}]:"
DEFAULT_GRACE_S = 10.0
STORE_START_TIMEOUT_S = 60.0


def parse_run_ref(ref: str) -> Path:
    """`local://runs/x/20261122-230000` or a plain path -> the run directory."""
    return Path(ref.removeprefix("local://"))


def _port_block_free(start: int, count: int) -> bool:
    for port in range(start, start + count):
        if port > 65535:
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _pick_port_block(preferred: int, count: int, taken: set[int]) -> int:
    """`preferred` if `count` ports from it are free (and not given to another node), else a free block."""
    if _port_block_free(preferred, count) and not taken & set(range(preferred, preferred + count)):
        return preferred
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            start = int(sock.getsockname()[1])
        if start + count <= 65000 and _port_block_free(start, count) and not taken & set(range(start, start + count)):
            return start
    raise BackendError(f"spec.metrics.port: no {count} free consecutive ports on 127.0.0.1")


@dataclass
class LocalPlan:
    """What a local launch will run (the dry run): the run directory, the rendezvous, each agent's command."""

    run_dir: str
    rdzv_id: str
    nodes: int
    nnodes: str
    procs_per_node: int
    max_restarts: int
    worker: list[str]
    env: dict[str, str]
    resume: bool = False
    # Per-node placement (the partition drill puts each emulated node in its own network namespace):
    # {"prefix": [...command prefix...], "addr": "address others reach it at", "ifname": "gloo interface"}.
    placements: list[dict[str, Any]] = field(default_factory=list)

    def placement(self, node: int) -> dict[str, Any]:
        """Where node `node` runs; a replacement node takes the last placement (the lost node's place)."""
        if not self.placements:
            return {"prefix": [], "addr": "127.0.0.1", "ifname": None}
        return self.placements[min(node, len(self.placements) - 1)]

    @property
    def store_host(self) -> str:
        return str(self.placement(0)["addr"])

    def agent_command(self, node: int, store_port: int | str, spec_file: str) -> list[str]:
        conf = ",".join(f"{k}={v}" for k, v in RDZV_CONF.items())
        place = self.placement(node)
        return [
            *place["prefix"],
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.procs_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.store_host}:{store_port}",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf={conf}",
            f"--max-restarts={self.max_restarts}",
            f"--local-addr={place['addr']}",
            f"--log-dir={Path(self.run_dir) / 'logs' / f'node{node}'}",
            "--tee=3",
            *self.worker,
            "--spec",
            spec_file,
        ]

    def __str__(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_dict(self) -> dict[str, Any]:
        spec_file = str(Path(self.run_dir) / "job.yaml")
        return {
            "backend": "local",
            "runDir": self.run_dir,
            "resume": self.resume,
            "rendezvous": {
                "backend": "c10d",
                "id": self.rdzv_id,
                "store": "127.0.0.1:<port chosen at launch, own process>",
                "conf": dict(RDZV_CONF),
            },
            "env": dict(self.env),
            "agents": [
                {"node": i, "command": shlex.join(self.agent_command(i, "<store-port>", spec_file))}
                for i in range(self.nodes)
            ],
        }


@dataclass
class _Agent:
    node: int
    proc: subprocess.Popen[bytes]
    killed: bool = False
    log: Any = None


@dataclass
class LocalRun:
    """A local run in flight, supervised from this process. Created by `LocalBackend.start`.

    The drills use `agent_pids`, `node_pids`, `kill_node`, `add_node` and `run_dir`; `torchrig run`
    uses `wait`, `request_cancel` and `summary`.
    """

    spec: JobSpec
    options: SubmitOptions
    plan: LocalPlan
    run_dir: Path = field(init=False)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    endpoints: list[str] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    _agents: list[_Agent] = field(default_factory=list)
    _store: subprocess.Popen[bytes] | None = None
    _store_port: int = 0
    _metrics_ports: dict[int, int] = field(default_factory=dict)
    _started: float = 0.0
    _cancel_requested: bool = False
    _force: bool = False
    _store_log: Any = None

    def __post_init__(self) -> None:
        self.run_dir = Path(self.plan.run_dir)

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def files(self) -> RunFiles:
        return RunFiles(self.run_dir)

    def start(self) -> None:
        """Prepare the run directory, start the rendezvous store and one agent per node."""
        self._started = time.monotonic()
        self._prepare_run_dir()
        try:
            self._start_store()
            for node in range(self.plan.nodes):
                self._start_agent(node)
        except BaseException:
            self._kill_everything()
            raise
        self._write_supervisor()

    def _prepare_run_dir(self) -> None:
        files = self.files
        files.logs.mkdir(parents=True, exist_ok=True)
        if self.plan.resume and files.summary.exists():
            # Never delete what a previous attempt wrote: its summary is kept under another name.
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(files.summary.stat().st_mtime))
            os.replace(files.summary, self.run_dir / f"summary.{stamp}.json")
        files.job.write_text(dump_spec(self.spec))

    def _start_store(self) -> None:
        port_file = self.run_dir / ".store-port"
        with contextlib.suppress(FileNotFoundError):
            port_file.unlink()
        self._store_log = (self.files.logs / "store.log").open("ab")
        self._store = subprocess.Popen(
            [
                *self.plan.placement(0)["prefix"],
                sys.executable,
                "-m",
                "orchestrator.backends._local_store",
                str(port_file),
                self.plan.store_host,
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._store_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, RUN_TOKEN_ENV: self.token, NODE_ENV: "store"},
        )
        deadline = time.monotonic() + STORE_START_TIMEOUT_S
        while not port_file.exists():
            if self._store.poll() is not None:
                raise BackendError(
                    f"the rendezvous store exited with {self._store.returncode}; see {self._store_log.name}"
                )
            if time.monotonic() > deadline:
                raise BackendError(f"the rendezvous store did not start in {STORE_START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        self._store_port = int(port_file.read_text())
        port_file.unlink()

    def _node_spec_file(self, node: int) -> Path:
        """job.yaml for node 0; other nodes get a copy whose metrics port does not collide on this host."""
        metrics = self.spec.spec.metrics
        procs = self.plan.procs_per_node
        spec = self.spec
        if metrics.enabled:
            taken = {p + r for p in self._metrics_ports.values() for r in range(procs)}
            port = _pick_port_block(metrics.port + node * procs, procs, taken)
            self._metrics_ports[node] = port
            self.endpoints.extend(f"http://127.0.0.1:{port + r}/metrics" for r in range(procs))
            if node == 0 and port == metrics.port:
                return self.files.job
            spec = spec.model_copy(deep=True)
            spec.spec.metrics.port = port
        elif node == 0:
            return self.files.job
        path = self.run_dir / "nodes" / f"node{node}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(dump_spec(spec))
        return path

    def _start_agent(self, node: int) -> _Agent:
        spec_file = self._node_spec_file(node)
        cmd = self.plan.agent_command(node, self._store_port, str(spec_file))
        env = {
            **os.environ,
            **self.plan.env,
            "TORCHRIG_SPEC": str(spec_file),
            RUN_TOKEN_ENV: self.token,
            NODE_ENV: str(node),
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": LOG_LINE_PREFIX,
        }
        if self.plan.placement(node)["ifname"]:
            env["GLOO_SOCKET_IFNAME"] = str(self.plan.placement(node)["ifname"])
        log = self.files.node_log(node).open("ab")
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=os.getcwd(),
        )
        agent = _Agent(node=node, proc=proc, log=log)
        self._agents.append(agent)
        return agent

    def _write_supervisor(self) -> None:
        write_json(
            self.files.supervisor,
            {
                "pid": os.getpid(),
                "start_ticks": process_start_ticks(os.getpid()),
                "started_at": time.time(),
                "run_token": self.token,
                "rdzv_id": self.plan.rdzv_id,
                "resumed": self.plan.resume,
                "store": {"pid": self._store.pid if self._store else None, "port": self._store_port},
                "agents": [{"node": a.node, "pid": a.proc.pid, "killed": a.killed} for a in self._agents],
                "metrics_endpoints": self.endpoints,
            },
        )

    # -- what the drills use ----------------------------------------------------------------------
    @property
    def store_address(self) -> str:
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
        live = len(self.agent_pids())
        if live >= self.spec.spec.nodes.max:
            raise UnsupportedFeature(f"spec.nodes.max: the job already runs on {live} of at most {live} nodes")
        node = max((a.node for a in self._agents), default=-1) + 1
        self._start_agent(node)
        self._write_supervisor()
        return node

    # -- supervision ------------------------------------------------------------------------------
    def request_cancel(self) -> None:
        """Signal-safe: ask `wait` to stop the run (a second call skips the grace period)."""
        if self._cancel_requested:
            self._force = True
        self._cancel_requested = True

    def poll(self) -> str | None:
        """None while any (not deliberately killed) agent runs; else `succeeded` or `failed`."""
        live = [a for a in self._agents if not a.killed]
        if any(a.proc.poll() is None for a in live):
            return None
        if live and all(a.proc.returncode == 0 for a in live):
            return "succeeded"
        return "failed"

    def wait(
        self, view: RunView | None = None, timeout_s: float | None = None, interval_s: float = 0.25
    ) -> dict[str, Any]:
        """Supervise until the run ends (or is cancelled, or `timeout_s` passes: then it is cancelled)."""
        view = view or QuietView(LiveProgress(self.run_dir, self.spec.spec.training.steps), self.endpoints)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        view.start()
        status: str | None = None
        try:
            while True:
                view.refresh(self._note())
                status = self.poll()
                if status is not None:
                    break
                if self._cancel_requested or (deadline is not None and time.monotonic() > deadline):
                    status = "cancelled"
                    break
                time.sleep(interval_s)
        finally:
            if status is None:  # an exception in the loop: take everything down
                self._kill_everything()
            view.stop()
        return self.finish(status)

    def _note(self) -> str:
        if not self.files.events.exists():
            return "starting agents and rendezvous"
        return ""

    def finish(self, status: str) -> dict[str, Any]:
        """Stop what is left, write summary.json and return it."""
        reason = None
        if status == "cancelled":
            self.stop(0.0 if self._force else DEFAULT_GRACE_S)
            reason = "cancelled by the user"
        else:
            self._kill_everything()
        if status == "failed":
            codes = {a.node: a.proc.returncode for a in self._agents if not a.killed}
            log = latest_failure_log(self.run_dir)
            reason = (
                f"restarts exhausted (spec.restarts.max={self.spec.spec.restarts.max}); agent exit codes {codes}"
                + (f"; failing rank's log: {log}" if log else "")
            )
        stores = [
            {"name": s.display_name, "uri": s.resolved_uri(self.run_dir)} for s in self.spec.spec.checkpoint.stores
        ]
        self.summary = build_summary(
            self.run_dir,
            status=status,
            wall_s=time.monotonic() - self._started,
            stores=stores,
            total_steps=self.spec.spec.training.steps,
            reason=reason,
        )
        if log_path := (latest_failure_log(self.run_dir) if status == "failed" else None):
            self.summary["failure_log"] = str(log_path)
        write_json(self.files.summary, self.summary)
        return self.summary

    def stop(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        """SIGTERM the agents (they stop their workers), SIGKILL whatever is left after `grace_s`."""
        pids = [a.proc.pid for a in self._agents if a.proc.poll() is None]
        terminate_then_kill(pids, grace_s, token=None)
        self._kill_everything()

    def _kill_everything(self) -> None:
        for a in self._agents:
            if a.proc.poll() is None:
                kill_pids([a.proc.pid], signal.SIGKILL)
        # Workers outlive their agents (own sessions): find them by the run's marker.
        terminate_then_kill([], 0.0, token=self.token)
        if self._store is not None and self._store.poll() is None:
            self._store.terminate()
            try:
                self._store.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._store.kill()
        for a in self._agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.proc.wait(timeout=5)
            if a.log is not None:
                a.log.close()
                a.log = None
        if self._store is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._store.wait(timeout=5)
        if self._store_log is not None:
            self._store_log.close()
            self._store_log = None

    def last_checkpoint(self) -> dict[str, Any] | None:
        """The newest committed checkpoint in the summary: `{name, uri, last_committed_step}`."""
        if not self.summary:
            return None
        found = [c for c in self.summary.get("checkpoints", []) if c.get("last_committed_step") is not None]
        return max(found, key=lambda c: c["last_committed_step"]) if found else None


def _same_job(old: dict[str, Any], new: JobSpec) -> bool:
    """A resume: same name, task and training loop (ports and node counts may differ)."""
    from orchestrator.loader import validate_document

    try:
        before = validate_document(old).to_yaml_dict()
    except SpecError:
        return False
    now = new.to_yaml_dict()
    return bool(
        before["metadata"]["name"] == now["metadata"]["name"]
        and before["spec"]["task"] == now["spec"]["task"]
        and before["spec"]["training"] == now["spec"]["training"]
    )


class LocalBackend(Backend):
    """Runs a job on this machine with torch.distributed.elastic; `--nodes N` emulates N nodes."""

    name = "local"
    capabilities = Capabilities(elastic=True, multi_node=True, gpus=True)

    def _check(self, spec: JobSpec, options: SubmitOptions) -> None:
        nodes = options.nodes if options.nodes is not None else spec.spec.nodes.min
        if nodes < 1:
            raise SpecError("--nodes: must be at least 1")
        if nodes > spec.spec.nodes.max:
            raise SpecError(f"--nodes: {nodes} exceeds spec.nodes.max ({spec.spec.nodes.max})")
        if spec.spec.resources.gpus > 0:
            import torch

            have = torch.cuda.device_count()
            need = nodes * spec.spec.procs_per_node
            if have < need:
                raise UnsupportedFeature(
                    f"spec.resources.gpus: {need} GPU(s) needed for {nodes} local node(s), {have} visible"
                )

    def _dry_run(self, spec: JobSpec, options: SubmitOptions) -> LocalPlan:
        resume = False
        if options.run_dir:
            run_dir = Path(options.run_dir)
            resume = self._check_reuse(run_dir, spec)
        else:
            run_dir = new_run_dir(spec.name)
        worker = options.extra.get("worker") or "training"
        worker_args = [str(worker)] if str(worker).endswith(".py") else ["-m", str(worker)]
        env = {
            "TORCHRIG_RUN_DIR": str(run_dir.resolve()),
            "TORCHRIG_METRICS_BIND": "127.0.0.1",
            # Elastic's shared rendezvous store leaves stale keys that hang restarts (pytorch#135712).
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "PYTHONUNBUFFERED": "1",
            **options.env,
        }
        return LocalPlan(
            run_dir=str(run_dir.resolve()),
            rdzv_id=f"{spec.name}-{uuid.uuid4().hex[:8]}",
            nodes=options.nodes if options.nodes is not None else spec.spec.nodes.min,
            nnodes=f"{spec.spec.nodes.min}:{spec.spec.nodes.max}",
            procs_per_node=spec.spec.procs_per_node,
            max_restarts=spec.spec.restarts.max,
            worker=worker_args,
            env=env,
            resume=resume,
            placements=list(options.extra.get("placements") or []),
        )

    @staticmethod
    def _check_reuse(run_dir: Path, spec: JobSpec) -> bool:
        """May `run_dir` take this run? True when it is a resume of the same job there."""
        files = RunFiles(run_dir)
        if not run_dir.exists() or not any(run_dir.iterdir()):
            return False
        state, _, _ = run_state(run_dir)
        if state is RunState.RUNNING:
            raise BackendError(f"--run-dir: {run_dir} belongs to a run that is still going")
        if not files.job.exists():
            if files.summary.exists():
                raise SpecError(f"--run-dir: {run_dir} holds a summary but no job.yaml; use another directory")
            return False
        try:
            old = yaml.safe_load(files.job.read_text()) or {}
        except yaml.YAMLError:
            old = {}
        if not _same_job(old if isinstance(old, dict) else {}, spec):
            raise SpecError(
                f"--run-dir: {run_dir} holds a run of a different job (name, task or training differ); "
                "use another directory"
            )
        return True

    def start(self, dryrun: DryRun) -> LocalRun:
        """Launch the plan of a dry run and return the supervised run (call `wait` on it)."""
        plan = dryrun.request
        if not isinstance(plan, LocalPlan):
            raise BackendError("local backend: the dry run is not a local plan")
        run = LocalRun(spec=dryrun.spec, options=dryrun.options, plan=plan)
        run.start()
        return run

    def launch(self, spec: JobSpec, options: SubmitOptions | None = None) -> LocalRun:
        """Check, plan and start a run: `start(dry_run(spec, options))`."""
        return self.start(self.dry_run(spec, options))

    def _schedule(self, dryrun: DryRun) -> RunHandle:
        run = self.start(dryrun)
        return RunHandle("local", str(run.run_dir), info={"run": run})

    def submit_detached(self, dryrun: DryRun) -> RunHandle:
        """Start `torchrig run` in the background for this plan (`torchrig submit --backend local`)."""
        plan = dryrun.request
        assert isinstance(plan, LocalPlan)
        run_dir = Path(plan.run_dir)
        files = RunFiles(run_dir)
        files.logs.mkdir(parents=True, exist_ok=True)
        files.job.write_text(dump_spec(dryrun.spec))
        cmd = [
            sys.executable,
            "-c",
            "from orchestrator.cli import main; main()",
            "run",
            str(files.job),
            "--run-dir",
            str(run_dir),
            "--quiet",
            "--nodes",
            str(plan.nodes),
        ]
        if dryrun.options.extra.get("worker"):
            cmd += ["--worker", str(dryrun.options.extra["worker"])]
        with (run_dir / "supervisor.log").open("ab") as log:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **dryrun.options.env},
            )
        # Wait until it has recorded itself, so `status` right after `submit` says running.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and not files.supervisor.exists():
            time.sleep(0.1)
        if proc.poll() not in (None, 0) and not files.summary.exists():
            raise BackendError(f"the background run exited with {proc.returncode}; see {run_dir / 'supervisor.log'}")
        return RunHandle("local", str(run_dir), info={"pid": proc.pid})

    def _status(self, run_id: str) -> RunStatus:
        run_dir = parse_run_ref(run_id)
        if not run_dir.is_dir():
            raise SpecError(f"RUN: no such run directory: {run_dir}")
        state, message, details = run_state(run_dir)
        return RunStatus(RunHandle("local", str(run_dir)), state, message, details)

    def _logs(self, run_id: str, rank: int | None, follow: bool) -> Iterator[str]:
        from orchestrator.backends._local_rundir import iter_rank_lines

        run_dir = parse_run_ref(run_id)
        if not (run_dir / "logs").is_dir():
            raise SpecError(f"RUN: no logs in {run_dir}")
        if not follow:
            yield from iter_rank_lines(run_dir, rank)
            return
        yield from _follow(run_dir, rank)

    def _cancel(self, run_id: str) -> RunStatus:
        run_dir = parse_run_ref(run_id)
        files = RunFiles(run_dir)
        state, _, _ = run_state(run_dir)
        if state.terminal:
            return self._status(run_id)
        sup = read_json(files.supervisor) or {}
        pid = int(sup.get("pid", -1))
        if state is RunState.RUNNING and alive(pid, sup.get("start_ticks")):
            # The supervisor handles SIGTERM like Ctrl-C: stops ranks, writes summary.json (cancelled).
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + DEFAULT_GRACE_S + 30
            while time.monotonic() < deadline and alive(pid):
                time.sleep(0.2)
        token = sup.get("run_token")
        if token:
            terminate_then_kill(find_marked(str(token)), 5.0, token=str(token))
        if not files.summary.exists():
            write_json(files.summary, {"status": "cancelled", "run_dir": str(run_dir), "reason": "cancelled"})
        return self._status(run_id)

    def _list(self) -> list[RunStatus]:
        out = []
        for run_dir in find_run_dirs():
            state, message, details = run_state(run_dir)
            out.append(RunStatus(RunHandle("local", str(run_dir)), state, message, details))
        return out


def _follow(run_dir: Path, rank: int | None, poll_s: float = 0.5) -> Iterator[str]:
    """Lines of the node logs as they are written, until the run is over and nothing new arrives."""
    import re

    prefix = re.compile(r"^\[rank(\d+)\]:")
    offsets: dict[Path, int] = {}
    partial: dict[Path, str] = {}
    while True:
        got = False
        for log in sorted((run_dir / "logs").glob("node*.log")):
            with log.open(errors="replace") as fh:
                fh.seek(offsets.get(log, 0))
                chunk = fh.read()
                offsets[log] = fh.tell()
            if not chunk:
                continue
            got = True
            text = partial.pop(log, "") + chunk
            lines = text.split("\n")
            if lines[-1]:
                partial[log] = lines[-1]
            for line in lines[:-1]:
                match = prefix.match(line)
                if rank is None or (match and int(match.group(1)) == rank):
                    yield line
        if not got and run_state(run_dir)[0].terminal:
            return
        time.sleep(poll_s)
