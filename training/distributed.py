"""This rank's device and its default process group.

The same entry point runs under torchrun / torch.distributed.elastic, under the Kubeflow PyTorchJob
operator (which starts torchrun with `PET_*` variables, or one process per pod with `RANK`/`WORLD_SIZE`),
under Ray Train (which creates the group itself; the Ray entry passes a `WorkerIdentity` built from
`ray.train.get_context()`) and as a plain single process with no launcher at all. Who this process is
comes from `training.contract.WorkerIdentity`; this module only acts on it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from training.contract import Env, WorkerIdentity

__all__ = ["device_for", "init_process_group"]

log = logging.getLogger(__name__)


def device_for(identity: WorkerIdentity) -> torch.device:
    """The device this rank trains on: its local GPU when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        index = identity.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_process_group(identity: WorkerIdentity, device: torch.device, *, env: Mapping[str, str] | None = None) -> bool:
    """Join the default process group unless one exists already (Ray Train creates it first).

    nccl on GPU, gloo on CPU. A launcher sets `MASTER_ADDR`/`MASTER_PORT` (env:// rendezvous); a single
    process without a launcher gets an in-memory store, so it needs no port at all.

    Returns:
        True when this call created the group (and the caller should destroy it at the end).
    """
    env = os.environ if env is None else env
    if dist.is_initialized():
        if dist.get_world_size() != identity.world_size:
            raise ValueError(
                f"existing process group has world size {dist.get_world_size()}, expected {identity.world_size}"
            )
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if Env.MASTER_ADDR in env and Env.MASTER_PORT in env:
        dist.init_process_group(
            backend=backend, init_method="env://", rank=identity.rank, world_size=identity.world_size
        )
    elif identity.world_size == 1:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
    else:
        raise ValueError(
            f"{Env.WORLD_SIZE}={identity.world_size} but {Env.MASTER_ADDR}/{Env.MASTER_PORT} are not set; "
            "start the workers with torchrun (or `torchrig run`)"
        )
    log.debug("joined %s process group as rank %d of %d", backend, identity.rank, identity.world_size)
    return True
