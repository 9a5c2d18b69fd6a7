"""Resumable, deterministic data order that survives restarts and world-size changes.

The order of samples is defined globally, independent of the world size: epoch e visits the dataset in
the permutation seeded by (seed, e), and the run consumes that stream through one global cursor (the
number of samples consumed so far). Optimizer step s at world size W with per-rank batch B and A
micro-steps takes the next W*B*A indices; micro-step m of rank r reads the slice `[(m*W + r)*B, +B)`.

So the whole sampler state is the cursor: after a restart at the same world size training continues
with exactly the batches it would have seen, and after a resize no sample of the epoch is repeated or
skipped. And because micro-step m reads one contiguous block of W*B indices, a run at world size W
sees the same samples per micro-step as a single process with batch W*B (the equivalence tests rely
on it).

`BatchIndices` hands this rank's micro-batches to a `DataLoader`, and `to_device` moves what its
collate function made to the training device.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["BatchIndices", "GlobalOrder", "StepPlan", "micro_batches", "to_device"]


class GlobalOrder:
    """The global sample stream: epoch permutations seeded by (seed, epoch), cached one at a time.

    Args:
        num_samples: Size of the dataset.
        seed: `training.seed`.
        shuffle: False keeps the natural order (useful for tests and streaming-like data).
    """

    def __init__(self, num_samples: int, seed: int, *, shuffle: bool = True) -> None:
        if num_samples <= 0:
            raise ValueError("the training dataset is empty")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = -1
        self._perm: np.ndarray = np.empty(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        """The visiting order of `epoch` (a pure function of seed and epoch)."""
        if epoch != self._epoch:
            if self.shuffle:
                rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
                self._perm = rng.permutation(self.num_samples).astype(np.int64)
            else:
                self._perm = np.arange(self.num_samples, dtype=np.int64)
            self._epoch = epoch
        return self._perm

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices at global positions `[start, start + count)`, crossing epochs as needed."""
        out: list[int] = []
        pos = start
        while len(out) < count:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(count - len(out), self.num_samples - offset)
            out.extend(int(i) for i in self.permutation(epoch)[offset : offset + take])
            pos += take
        return out


@dataclass(frozen=True)
class StepPlan:
    """How one optimizer step consumes the stream."""

    world_size: int
    batch_size: int
    grad_accumulation: int = 1

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step across all ranks (the cursor advances by this much)."""
        return self.world_size * self.batch_size * self.grad_accumulation

    def rank_slices(self, cursor: int, rank: int) -> list[tuple[int, int]]:
        """Global `(start, count)` of each micro-batch of `rank` in the step that starts at `cursor`."""
        b, w = self.batch_size, self.world_size
        return [(cursor + (m * w + rank) * b, b) for m in range(self.grad_accumulation)]


def micro_batches(order: GlobalOrder, plan: StepPlan, rank: int, cursor: int) -> Iterator[list[int]]:
    """Endless stream of this rank's micro-batches (lists of dataset indices) starting at `cursor`.

    A pure function of its arguments, so a DataLoader may prefetch from it: the trainer tracks the cursor
    of what it has *consumed* (`cursor + steps_done * plan.global_batch`), never what was prefetched.
    """
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} outside world size {plan.world_size}")
    while True:
        for start, count in plan.rank_slices(cursor, rank):
            yield order.indices(start, count)
        cursor += plan.global_batch


class BatchIndices:
    """`micro_batches` as a DataLoader batch sampler (a DataLoader needs an iterable, not an iterator)."""

    def __init__(self, order: GlobalOrder, plan: StepPlan, rank: int, cursor: int) -> None:
        self.order, self.plan, self.rank, self.cursor = order, plan, rank, cursor

    def __iter__(self) -> Iterator[list[int]]:
        return micro_batches(self.order, self.plan, self.rank, self.cursor)


def to_device(batch: Any, device: torch.device) -> Any:
    """A collated batch with every tensor in it (nested in mappings, lists, tuples) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
