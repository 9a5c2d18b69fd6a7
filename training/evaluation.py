"""Held-out evaluation at the end of training, across all ranks."""

from __future__ import annotations

import math

import torch
import torch.distributed as tdist

from training.contract import WorkerIdentity
from training.data import to_device
from training.strategies import Parallel
from training.task import Task

__all__ = ["evaluate"]


def evaluate(task: Task, par: Parallel, identity: WorkerIdentity, batch_size: int) -> dict[str, float]:
    """Held-out metrics across all ranks: each rank evaluates a strided shard, the sums are combined.

    Every rank runs the same number of forward passes (FSDP's forward is collective), padding with a
    discarded repeat of a real batch where its shard is shorter.

    Returns:
        The task's `summarize` of the summed metrics (empty when the task has no eval dataset).
    """
    dataset = task.eval_dataset()
    if dataset is None:
        return {}
    world_size = identity.world_size
    n = len(dataset)  # type: ignore[arg-type]
    mine = list(range(identity.rank, n, world_size))
    per_rank = math.ceil(n / world_size)
    num_batches = math.ceil(per_rank / batch_size)
    model = par.eval_model()
    was_training = model.training
    model.eval()
    totals: dict[str, float] = {}
    with torch.no_grad(), par.eval_autocast():
        for b in range(num_batches):
            idx = mine[b * batch_size : (b + 1) * batch_size]
            real = bool(idx)
            if not real:
                idx = [0]
            batch = to_device(task.collate([dataset[i] for i in idx]), par.device)
            out = task.evaluate(model, batch)
            if real:
                for key, value in out.items():
                    totals[key] = totals.get(key, 0.0) + float(value)
    model.train(was_training)
    if world_size > 1 and tdist.is_initialized():
        gathered: list[dict[str, float] | None] = [None] * world_size
        tdist.all_gather_object(gathered, totals)
        totals = {}
        for part in gathered:
            for key, value in (part or {}).items():
                totals[key] = totals.get(key, 0.0) + value
    return task.summarize(totals)
