"""Where this worker sits in its group: launcher detection and process-group set-up.

The same entry point runs under torchrun / torch.distributed.elastic, under the Kubeflow PyTorchJob
operator (which starts torchrun with `PET_*` variables, or one process per pod with `RANK`/`WORLD_SIZE`),
under Ray Train (the Ray entry builds a `DistEnv` from `ray.train.get_context()` and passes it in) and
as a plain single process with no launcher at all.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "detect_env", "device_for", "init_process_group"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """This process's coordinates in the worker group.

    Attributes:
        rank: Global rank (0 .. world_size - 1).
        world_size: Number of worker processes in the group.
        local_rank: Rank within this node (selects the GPU).
        local_world_size: Worker processes on this node.
        node_rank: Index of this node (torchrun's `GROUP_RANK`).
        num_nodes: Nodes in the group.
        generation: Elastic restart count of the group (0 for the first attempt).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    generation: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"local_rank {self.local_rank} is outside local world size {self.local_world_size}")

    @property
    def is_leader(self) -> bool:
        """Rank 0 writes the run's shared files (result.json)."""
        return self.rank == 0


def _int(env: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return default


def detect_env(env: Mapping[str, str] | None = None) -> DistEnv:
    """Read the launcher's variables (torchrun, PyTorchJob `PET_*`) or fall back to a single process.

    Args:
        env: The environment to read (default: `os.environ`).

    Raises:
        ValueError: A launcher variable is malformed or inconsistent.
    """
    env = os.environ if env is None else env
    world_size = _int(env, "WORLD_SIZE", default=1)
    rank = _int(env, "RANK", default=0)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", "PET_NPROC_PER_NODE", default=0)
    nnodes = env.get("PET_NNODES", "")
    # PET_NNODES may be an elastic range ("1:4"): then only the actual world size tells.
    num_nodes = _int(env, "GROUP_WORLD_SIZE", default=0) or (int(nnodes) if nnodes.isdigit() else 0)
    if local_world_size <= 0:
        # One process per pod (PyTorchJob without torchrun): every rank is its own node.
        local_world_size = world_size // num_nodes if num_nodes > 0 else 1
    if num_nodes <= 0 or num_nodes * local_world_size != world_size:
        # Elastic ranges (PET_NNODES="1:4") and heterogeneous groups: derive from the actual size.
        num_nodes = max(1, world_size // max(1, local_world_size))
    local_rank = _int(env, "LOCAL_RANK", default=rank % local_world_size)
    node_rank = _int(env, "GROUP_RANK", "PET_NODE_RANK", default=rank // local_world_size)
    generation = _int(env, "TORCHELASTIC_RESTART_COUNT", default=0)
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        generation=generation,
    )


def device_for(dist_env: DistEnv) -> torch.device:
    """The device this rank trains on: its local GPU when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        index = dist_env.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_process_group(dist_env: DistEnv, device: torch.device, *, env: Mapping[str, str] | None = None) -> bool:
    """Join the default process group unless one exists already (Ray Train creates it first).

    nccl on GPU, gloo on CPU. A launcher sets `MASTER_ADDR`/`MASTER_PORT` (env:// rendezvous); a single
    process without a launcher gets an in-memory store, so it needs no port at all.

    Returns:
        True when this call created the group (and the caller should destroy it at the end).
    """
    env = os.environ if env is None else env
    if dist.is_initialized():
        if dist.get_world_size() != dist_env.world_size:
            raise ValueError(
                f"existing process group has world size {dist.get_world_size()}, expected {dist_env.world_size}"
            )
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "MASTER_ADDR" in env and "MASTER_PORT" in env:
        dist.init_process_group(
            backend=backend, init_method="env://", rank=dist_env.rank, world_size=dist_env.world_size
        )
    elif dist_env.world_size == 1:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
    else:
        raise ValueError(
            f"WORLD_SIZE={dist_env.world_size} but MASTER_ADDR/MASTER_PORT are not set; start the workers "
            "with torchrun (or `torchrig run`)"
        )
    log.debug("joined %s process group as rank %d of %d", backend, dist_env.rank, dist_env.world_size)
    return True
