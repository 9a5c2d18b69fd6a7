"""The training state a checkpoint holds, as DCP `Stateful`s, and the hash of the final model.

`Trainer.state` is `{"app": ModelOptimizerState, "trainer": TrainerProgress}`: the checkpoint manager
saves and restores exactly this dict, and everything else of the loop is derived from it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from training.strategies import Parallel

__all__ = ["ModelOptimizerState", "TrainerProgress", "full_params_sha256", "params_sha256"]


class ModelOptimizerState:
    """DCP Stateful of model + optimizer through `get_state_dict`/`set_state_dict`: the same keys for
    DDP, FSDP2 and a plain module, and DTensor shards that DCP reshards to a new world size."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


class TrainerProgress:
    """DCP Stateful of the loop's position: everything else is derived from it.

    Attributes:
        step: Optimizer steps completed.
        cursor: Global samples consumed (the sampler's whole state, see `training.data`).
        world_size: World size when saved (a restore at another size is a resize).
        lr_step: Step the LR schedule is at (equals `step`; kept for readers of checkpoints).
        loss: This rank's loss of the last completed step (so a restored, finished run reports it).
        scaler: fp16 gradient scaler state (empty otherwise).
    """

    def __init__(self, scaler: torch.amp.GradScaler | None = None) -> None:
        self.step = 0
        self.cursor = 0
        self.world_size = 0
        self.loss = float("nan")
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {
            "step": self.step,
            "cursor": self.cursor,
            "world_size": self.world_size,
            "lr_step": self.step,
            "loss": self.loss,
        }
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.cursor = int(state_dict["cursor"])
        self.world_size = int(state_dict["world_size"])
        self.loss = float(state_dict["loss"])
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])


def params_sha256(state_dict: Mapping[str, Any]) -> str:
    """SHA-256 of the tensors of a full state dict, as raw bytes in sorted key order."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        value = state_dict[key]
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def full_params_sha256(par: Parallel) -> str:
    """Gather the full model state dict (collective; rank 0 gets it on the CPU) and hash it there.

    Every rank returns rank 0's digest.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    distributed = tdist.is_initialized() and tdist.get_world_size() > 1
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(par.model, options=options)
    digest = params_sha256(sd) if not distributed or tdist.get_rank() == 0 else ""
    if distributed:
        holder = [digest]
        tdist.broadcast_object_list(holder, src=0)
        digest = holder[0]
    return digest
