"""What a local launch will run (the local backend's dry run), and the free ports it needs.

`LocalPlan` is plain data: the run directory, the c10d rendezvous, each agent's exact command and
environment. `torchrig run --dry-run` prints it, `LocalRun` starts it, and a detached run stores it
(`to_json`) for its supervisor process, so what was shown is what runs.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestrator.backends._local_agent import NO_PORT_FILE, PORT_PLACEHOLDER
from orchestrator.backends.base import NodePlacement, SubmitOptions
from orchestrator.errors import BackendError
from orchestrator.spec import JobSpec
from training.contract import Env, RunFiles
from training.contract.orders import SECRET_FILE
from training.preemption_timing import launcher_env

__all__ = ["LOG_LINE_PREFIX", "RDZV_CONF", "LocalPlan", "create_local_plan", "pick_port_block", "placement_from_json"]

# Fast failure detection (ENVIRONMENT.md): with elastic's defaults a survivor waits ~47 s for a dead
# peer; with these ~6-9 s. keep_alive_max_attempt is 5, not 2: on a loaded machine an agent's keep-alive
# thread can lag 2 s, the agent then expires ITSELF from the complete round, and a joining node forms
# a second, separate world (seen here: two world-size-1 groups side by side). `is_host=false`: no agent
# hosts the store, the store process does. `last_call_timeout`: how long a round that has its minimum
# of nodes waits for more (`LocalPlan.rdzv_conf`).
RDZV_CONF: dict[str, str] = {
    "is_host": "false",
    "last_call_timeout": "2",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "5",
    "join_timeout": "600",
}
# A run launched on one node has no second agent starting beside it: its rounds (the first one and
# every group restart) wait 1 s for another node instead of 2 s (torch takes whole seconds; 0 would
# close a round before a node added later, which polls the round once a second, could join it). A node
# added later (`LocalRun.add_node`) waits in the wait list, the running agent restarts its workers and
# opens the next round, and the new node joins it within that second (tried: world sizes [2, 4]).
SINGLE_NODE_LAST_CALL_S = "1"
# Every rank's line in logs/node<i>.log starts with its global rank: `torchrig logs --rank R` greps it.
LOG_LINE_PREFIX = "[rank${rank}]:"
_DEFAULT_PLACEMENT = NodePlacement()


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


def pick_port_block(preferred: int, count: int, taken: set[int]) -> int:
    """`preferred` if `count` ports from it are free (and not given to another node), else a free block.

    Raises:
        BackendError: no free block was found.
    """
    if _port_block_free(preferred, count) and not taken & set(range(preferred, preferred + count)):
        return preferred
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            start = int(sock.getsockname()[1])
        if start + count <= 65000 and _port_block_free(start, count) and not taken & set(range(start, start + count)):
            return start
    raise BackendError(f"spec.metrics.port: no {count} free consecutive ports on 127.0.0.1")


def placement_from_json(data: dict[str, Any]) -> NodePlacement:
    """A `NodePlacement` from its `dataclasses.asdict` form (JSON turns the prefix into a list)."""
    ifname = data.get("ifname")
    return NodePlacement(
        prefix=tuple(str(p) for p in data.get("prefix") or ()),
        addr=str(data.get("addr", "127.0.0.1")),
        ifname=None if ifname is None else str(ifname),
    )


@dataclass
class LocalPlan:
    """What a local launch will run (the dry run): the run directory, the rendezvous, each agent's command.

    Attributes:
        run_dir: The run directory (absolute).
        rdzv_id: The rendezvous id every agent joins.
        nodes: Emulated nodes (agents) started at launch.
        nnodes: torchrun's `--nnodes` (`min:max`).
        procs_per_node: Workers per agent.
        max_restarts: torchrun's `--max-restarts`.
        worker: What each agent runs: `-m MODULE` or a script path.
        env: The workers' extra environment (the backend -> worker contract, drill faults).
        resume: The run directory holds an earlier attempt of the same job.
        placements: Where each node runs (the partition drill puts each in its own network
            namespace); a replacement node takes the last one.
        standby_nodes: Agents started past `nodes` that stand by instead of joining the rendezvous
            (`restarts.spareNodes`, `training.inplace.standby`).
    """

    run_dir: str
    rdzv_id: str
    nodes: int
    nnodes: str
    procs_per_node: int
    max_restarts: int
    worker: list[str]
    env: dict[str, str]
    resume: bool = False
    placements: list[NodePlacement] = field(default_factory=list)
    standby_nodes: int = 0

    def placement(self, node: int) -> NodePlacement:
        """Where node `node` runs; a replacement node takes the last placement (the lost node's place)."""
        if not self.placements:
            return _DEFAULT_PLACEMENT
        return self.placements[min(node, len(self.placements) - 1)]

    def rdzv_conf(self) -> dict[str, str]:
        """The c10d rendezvous settings of this plan's agents (`RDZV_CONF`)."""
        if self.nodes > 1:
            return dict(RDZV_CONF)
        return {**RDZV_CONF, "last_call_timeout": SINGLE_NODE_LAST_CALL_S}

    @property
    def store_host(self) -> str:
        return self.placement(0).addr

    def agent_command(
        self, node: int, store_port: int | str, spec_file: str, *, port_file: str | None = None
    ) -> list[str]:
        """Agent `node`'s command line: torchrun (`torch.distributed.run`) through `_local_agent`, which
        exports the rendezvous round to the workers (every agent of a run must: the in-place key space
        is the round's, and a node whose workers decided otherwise could never form a group with the
        rest). With `port_file`, the store is still starting: the agent imports torchrun meanwhile, then
        reads the port from that file (`store_port` is ignored); without it the store's port is known."""
        conf = ",".join(f"{k}={v}" for k, v in self.rdzv_conf().items())
        place = self.placement(node)
        if port_file is not None:
            store_port = PORT_PLACEHOLDER
        return [
            *place.prefix,
            sys.executable,
            "-m",
            "orchestrator.backends._local_agent",
            port_file if port_file is not None else NO_PORT_FILE,
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.procs_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.store_host}:{store_port}",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf={conf}",
            f"--max-restarts={self.max_restarts}",
            f"--local-addr={place.addr}",
            f"--log-dir={RunFiles(self.run_dir).node_log_dir(node)}",
            "--tee=3",
            *self.worker,
            "--spec",
            spec_file,
        ]

    def __str__(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_dict(self) -> dict[str, Any]:
        """The plan as `torchrig run --dry-run` shows it (commands as shell lines)."""
        spec_file = str(RunFiles(self.run_dir).job)
        return {
            "backend": "local",
            "runDir": self.run_dir,
            "resume": self.resume,
            "rendezvous": {
                "backend": "c10d",
                "id": self.rdzv_id,
                "store": "127.0.0.1:<port chosen at launch, own process>",
                "conf": self.rdzv_conf(),
            },
            "env": dict(self.env),
            "agents": [
                {"node": i, "command": shlex.join(self.agent_command(i, "<store-port>", spec_file))}
                for i in range(self.nodes)
            ],
            **({"standbyAgents": self.standby_nodes} if self.standby_nodes else {}),
        }

    def to_json(self) -> dict[str, Any]:
        """Every field, for `from_json` (a detached run's supervisor starts exactly this plan)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LocalPlan:
        fields = dict(data)
        fields["placements"] = [placement_from_json(p) for p in data.get("placements") or []]
        return cls(**fields)


def create_local_plan(spec: JobSpec, options: SubmitOptions, run_dir: Path, *, resume: bool) -> LocalPlan:
    """The plan of a local launch of `spec` into `run_dir` (nothing is started or written)."""
    local = options.local
    worker = local.worker or "training"
    worker_args = [worker] if worker.endswith(".py") else ["-m", worker]
    env = {
        Env.RUN_DIR: str(run_dir.resolve()),
        # The run's secret (`LocalRun` creates it, mode 0600): orders in the rendezvous store are signed with it.
        Env.JOB_SECRET_FILE: str(run_dir.resolve() / SECRET_FILE),
        Env.METRICS_BIND: "127.0.0.1",
        # Elastic's shared rendezvous store leaves stale keys that hang restarts (pytorch#135712).
        Env.DISABLE_SHARED_RDZV_STORE: "1",
        Env.GLOO_SOCKET_IFNAME: os.environ.get(Env.GLOO_SOCKET_IFNAME, "lo"),
        "PYTHONUNBUFFERED": "1",
        # torchrun's grace for its workers on SIGTERM (above restarts.preemptGraceSeconds), and the
        # extra preemption signal among those it forwards (training.preemption).
        **launcher_env(spec.spec.restarts),
        **options.env,
    }
    return LocalPlan(
        run_dir=str(run_dir.resolve()),
        rdzv_id=f"{spec.name}-{uuid.uuid4().hex[:8]}",
        nodes=local.nodes if local.nodes is not None else spec.spec.nodes.min,
        nnodes=f"{spec.spec.nodes.min}:{spec.spec.nodes.max}",
        procs_per_node=spec.spec.procs_per_node,
        max_restarts=spec.spec.restarts.max,
        worker=worker_args,
        env=env,
        resume=resume,
        placements=list(local.placements),
        standby_nodes=standby_nodes(spec),
    )


def standby_nodes(spec: JobSpec) -> int:
    """Standby agents of a local launch (`restarts.spareNodes`): only where ranks recover in place."""
    several_ranks = spec.spec.nodes.max * spec.spec.procs_per_node >= 2
    return spec.spec.restarts.standby_nodes if several_ranks else 0
