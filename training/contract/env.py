"""Every environment variable that crosses the backend -> worker boundary, named once.

Backends (local agents, compiled pods, Ray workers) set these; the worker reads them through
`WorkerIdentity.from_env` and `worker_settings`. No other module spells a variable name: a test walks
the source and fails on a literal.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace

__all__ = ["Env", "WorkerIdentity"]


class Env:
    """Names of the environment variables of the contract (docs/architecture.md, "Backend -> worker")."""

    PREFIX = "TORCHRIG_"  # every torchrig variable starts with it (a backend forwards them all)

    # torchrig's own: set by a backend for its workers.
    SPEC = "TORCHRIG_SPEC"  # path of the resolved job file
    RUN_DIR = "TORCHRIG_RUN_DIR"  # the run directory (relative file:// stores resolve against it)
    METRICS_BIND = "TORCHRIG_METRICS_BIND"  # exporter bind address (local: 127.0.0.1; pods: unset = all)
    FAULTS = "TORCHRIG_FAULTS"  # drills: JSON list of faults the worker injects into itself
    LOG_LEVEL = "TORCHRIG_LOG_LEVEL"  # worker log level (INFO)
    PEAK_FLOPS = "TORCHRIG_PEAK_FLOPS"  # the device's peak FLOP/s for MFU, where the table has none
    # HMAC-SHA256 key that signs checkpoint manifests (from a Secret); set, unsigned manifests are refused.
    CHECKPOINT_KEY = "TORCHRIG_CHECKPOINT_KEY"
    # The job's own secret: a file (a local run's `secret`, mode 0600; in a pod the job's Kubernetes
    # Secret, mounted read-only) that every process of the job shares and outsiders do not. Each order
    # written to the in-place / rendezvous store carries an HMAC made with it (`training.inplace`).
    JOB_SECRET_FILE = "TORCHRIG_JOB_SECRET_FILE"
    # The image's health check (`python -m training.healthcheck`), when no spec file is mounted.
    METRICS_PORT = "TORCHRIG_METRICS_PORT"  # the exporter's base port (default 9400)
    HEALTH_MAX_STEP_AGE_S = "TORCHRIG_HEALTH_MAX_STEP_AGE_S"  # unhealthy after this long without a step
    # The local backend's bookkeeping: which processes belong to which run and emulated node.
    RUN_TOKEN = "TORCHRIG_RUN_TOKEN"  # unique per run: every agent, worker and child carries it
    LOCAL_NODE = "TORCHRIG_LOCAL_NODE"  # index of the emulated node (agent) a process belongs to
    RUNS_DIR = "TORCHRIG_RUNS_DIR"  # where new local runs go and `torchrig list` looks (default ./runs)
    # In-place recovery (`training.inplace`): the long-lived c10d store every process group generation
    # forms on (`host:port`: the local run's rendezvous store process, which outlives every trainer),
    # and which part a `python -m training` process plays (unset: the host decides; see the module).
    INPLACE_STORE = "TORCHRIG_INPLACE_STORE"
    # `INPLACE_STORE`'s value in a compiled one-node pod (PyTorchJob, TrainJob) or `torchrun` target: the
    # torchrun agent (`training.torchrun`, which a trainer's death never ends) hosts the store itself on
    # 127.0.0.1 and hands its workers the address. Left unreplaced (plain torchrun): no in-place recovery.
    INPLACE_STORE_AGENT = "agent"
    # `INPLACE_STORE`'s value in a compiled several-node launch over the c10d rendezvous (elastic
    # PyTorchJob, `torchrun` target): the rendezvous store (hosted by the agent at `--rdzv-endpoint`,
    # which every node reaches and a trainer's death never ends) carries in-place recovery too.
    INPLACE_STORE_RDZV = "rdzv"
    # Set by torchrig's torchrun agent after each c10d rendezvous (`training.torchrun.export_rendezvous_round`):
    # one token for every agent of that round, so the hosts of all nodes share one in-place key space
    # (each agent's `TORCHELASTIC_RESTART_COUNT` differs: a membership change restarts without counting).
    INPLACE_ROUND = "TORCHRIG_INPLACE_ROUND"
    # "1": this agent was launched as a run's only node (`torchrig run` of one node, no standby): its first
    # c10d round has no other agent to wait for and closes at once, without the last call (1 s); later
    # rounds (a group restart, a node added) keep it (`training.torchrun.export_rendezvous_round`).
    FIRST_ROUND_ALONE = "TORCHRIG_FIRST_ROUND_ALONE"
    INPLACE_ROLE = "TORCHRIG_INPLACE_ROLE"  # "trainer" | "spare" (set by the per-rank host for its children)
    INPLACE_SPARE = "TORCHRIG_INPLACE_SPARE"  # a spare's index on its node (its keys in the store)
    # Spare nodes (`restarts.spareNodes`, `training.inplace.standby`): a PyTorchJob Worker pod whose
    # replica index (`REPLICA_INDEX`, the operator's label) is at least `STANDBY_FROM` stands by instead
    # of joining the rendezvous; `INPLACE_STANDBY` is a standby host's slot (set by the standby for its hosts).
    STANDBY_FROM = "TORCHRIG_STANDBY_FROM"
    REPLICA_INDEX = "TORCHRIG_REPLICA_INDEX"
    INPLACE_STANDBY = "TORCHRIG_INPLACE_STANDBY"
    # "1": the rendezvous store is a pod of its own (`training.rendezvous_store`, a PyTorchJob with
    # standby nodes); an agent that ends the job with a permanent code records it there, so it ends too.
    STORE_POD = "TORCHRIG_STORE_POD"
    # The Kubernetes node a pod runs on (the downward API's `spec.nodeName`, set by every compiled pod): a
    # worker's `node` (metrics label, events, `sdc` suspects and quarantine) is the machine to cordon or
    # taint, not the pod's host name; unset (local, Ray on VMs): the host name.
    NODE_NAME = "TORCHRIG_NODE_NAME"
    # The CLI: seconds a Kubernetes / Ray Jobs API call may take, "S" or "CONNECT,READ" (default 10,30).
    API_TIMEOUT = "TORCHRIG_API_TIMEOUT"

    # torch.distributed.elastic (torchrun's agent) and the PyTorchJob operator.
    RANK = "RANK"
    WORLD_SIZE = "WORLD_SIZE"
    LOCAL_RANK = "LOCAL_RANK"
    LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
    GROUP_RANK = "GROUP_RANK"  # node rank
    GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"  # nodes
    MASTER_ADDR = "MASTER_ADDR"
    MASTER_PORT = "MASTER_PORT"
    RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # restart generation within one launch
    RUN_ID = "TORCHELASTIC_RUN_ID"  # rendezvous id of the launch
    ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
    LOG_LINE_PREFIX_TEMPLATE = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
    PET_NNODES = "PET_NNODES"
    PET_NPROC_PER_NODE = "PET_NPROC_PER_NODE"
    PET_NODE_RANK = "PET_NODE_RANK"
    # torchrun's agent, on SIGTERM, forwards it to its workers and SIGKILLs them after this many seconds
    # (default 30): backends set it above `restarts.preemptGraceSeconds` so an emergency checkpoint fits.
    ELASTIC_SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
    # The signals torchrun forwards to its workers (`--signals-to-handle`): `restarts.preemptSignal` is added.
    PET_SIGNALS_TO_HANDLE = "PET_SIGNALS_TO_HANDLE"
    # Elastic's shared rendezvous store leaves stale keys that hang restarts (pytorch#135712).
    DISABLE_SHARED_RDZV_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
    # The flight recorder of torch.distributed (hang forensics, CUDA builds): the worker sets these before
    # it creates its process group, pointing the dump into the run's stacks/gen-G/ directory. Torch up
    # to 2.6 reads the NCCL names; later versions the FR names (the NCCL ones still work, deprecated).
    NCCL_TRACE_BUFFER_SIZE = "TORCH_NCCL_TRACE_BUFFER_SIZE"  # entries kept per process group (0: off)
    NCCL_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"  # dump the recorder when a collective times out
    NCCL_DEBUG_INFO_TEMP_FILE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"  # dump file prefix (the rank is appended)
    FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
    FR_DUMP_TEMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"

    # Kubeflow Trainer v2.2+ with the alpha `TrainJobStatus` gate (KEP-2779) injects these into every
    # trainer container (pkg/runtime/framework/plugins/trainjobstatus); rank 0 reports its progress to
    # `status.trainerStatus` through them (`training.metrics.trainer_status`).
    TRAINER_STATUS_URL = "KUBEFLOW_TRAINER_SERVER_URL"  # https://.../trainjobs/<name>/status (POST)
    TRAINER_STATUS_CA_CERT = "KUBEFLOW_TRAINER_SERVER_CA_CERT"  # path of the server's CA certificate
    TRAINER_STATUS_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"  # path of the projected token (rotates: re-read)


def _int(env: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return default


@dataclass(frozen=True)
class WorkerIdentity:
    """Who this worker process is: one rank of one restart generation of one job.

    The single identity record of the worker: the training loop, the checkpoint manager and the
    metrics sinks all take this one object.

    Attributes:
        job: The job's name (`metadata.name`).
        rank: Global rank (0 .. world_size - 1).
        world_size: Number of worker processes in the group.
        local_rank: Rank within this node (selects the GPU).
        local_world_size: Worker processes on this node.
        node_rank: Index of this node (torchrun's `GROUP_RANK`).
        num_nodes: Nodes in the group.
        generation: Elastic restart count of the group within one launch (0 for the first attempt).
        run_id: The launch's rendezvous id (`TORCHELASTIC_RUN_ID`; empty without a launcher).
        run_dir: The run directory; None writes no files.
        node: The machine: the Kubernetes node (`Env.NODE_NAME`) or the host name (a metrics label).
    """

    job: str = ""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    generation: int = 0
    run_id: str = ""
    run_dir: str | None = None
    node: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"local_rank {self.local_rank} is outside local world size {self.local_world_size}")

    @property
    def is_leader(self) -> bool:
        """Rank 0 writes the run's shared files (result.json, metrics.jsonl, manifests)."""
        return self.rank == 0

    def with_run(self, job: str, run_dir: str | None) -> WorkerIdentity:
        """The same coordinates, for job `job` writing into `run_dir`."""
        return replace(self, job=job, run_dir=run_dir)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, job: str = "", run_dir: str | None = None
    ) -> WorkerIdentity:
        """Read the launcher's variables (torchrun, PyTorchJob `PET_*`) or fall back to a single process.

        Args:
            env: The environment to read (default: `os.environ`).
            job: The job's name.
            run_dir: The run directory.

        Raises:
            ValueError: A launcher variable is malformed or inconsistent.
        """
        env = os.environ if env is None else env
        world_size = _int(env, Env.WORLD_SIZE, default=1)
        rank = _int(env, Env.RANK, default=0)
        local_world_size = _int(env, Env.LOCAL_WORLD_SIZE, Env.PET_NPROC_PER_NODE, default=0)
        nnodes = env.get(Env.PET_NNODES, "")
        # PET_NNODES may be an elastic range ("1:4"): then only the actual world size tells.
        num_nodes = _int(env, Env.GROUP_WORLD_SIZE, default=0) or (int(nnodes) if nnodes.isdigit() else 0)
        if local_world_size <= 0:
            # One process per pod (PyTorchJob without torchrun): every rank is its own node.
            local_world_size = world_size // num_nodes if num_nodes > 0 else 1
        if num_nodes <= 0 or num_nodes * local_world_size != world_size:
            # Elastic ranges (PET_NNODES="1:4") and heterogeneous groups: derive from the actual size.
            num_nodes = max(1, world_size // max(1, local_world_size))
        return cls(
            job=job,
            rank=rank,
            world_size=world_size,
            local_rank=_int(env, Env.LOCAL_RANK, default=rank % local_world_size),
            local_world_size=local_world_size,
            node_rank=_int(env, Env.GROUP_RANK, Env.PET_NODE_RANK, default=rank // local_world_size),
            num_nodes=num_nodes,
            generation=_int(env, Env.RESTART_COUNT, default=0),
            run_id=env.get(Env.RUN_ID, ""),
            run_dir=run_dir,
            node=env.get(Env.NODE_NAME) or socket.gethostname(),
        )
