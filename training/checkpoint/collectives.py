"""The checkpoint manager's collectives: its own gloo groups and the few operations it runs on them.

Every method is collective (every rank calls it, in the same order) and a no-op pass-through when the
job runs in one process (no process group, or world size 1).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Collectives"]


class Collectives:
    """Two dedicated gloo groups, created at construction when a process group of size > 1 exists,
    whose collectives fail after `timeout_s` (default: torch's).

    At construction, not at the first collective: built lazily at the first save after an in-place
    recovery, `new_group`'s wait for every member's address would sit in the failure window of that
    save. A rank killed there (the 100-recovery soak kills at every 5th step, checkpoints every 50)
    left the survivors waiting in the store until the group timeout instead of failing at once on a
    closed connection, as a collective on groups that already exist does (measured: the soak stalled
    at its 10th recovery). The recovery builds them instead (~0.05-0.1 s at 8 ranks, docs/performance.md).

    `group` carries the background save's and the restore's traffic (DCP and the object exchanges);
    `control` carries the foreground decisions of `should_save`/`save`. The background save's
    collectives must never share a group with training's (`dcp.async_save` on the default group
    deadlocks under FSDP on gloo), nor with those foreground broadcasts.
    """

    def __init__(self, timeout_s: float | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.group: Any = None
        self.control: Any = None
        if self.distributed:
            from training.inplace import sockets

            # `checkpoint.ioTimeoutSeconds`: the longest any checkpoint I/O may take (the watchdog's limit
            # while training waits for it). A peer that stops answering (a network partition, a hung
            # rank) fails these collectives after it, not after gloo's default 30 minutes.
            timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
            with sockets.recording():  # in-place recovery cuts these connections when the group breaks
                self.group = dist.new_group(backend="gloo", timeout=timeout)
                self.control = dist.new_group(backend="gloo", timeout=timeout)

    def broadcast_obj(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_gather_obj(self, obj: Any, world_size: int) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        if not self.distributed:
            return [obj]
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def min_all(self, flag: bool) -> bool:
        """True only when `flag` is true on every rank."""
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def any_control(self, flag: bool) -> bool:
        """True when `flag` is true on any rank (on the control group)."""
        t = torch.tensor([1 if flag else 0])
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return bool(t.item())

    def broadcast_control(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank (on the control group)."""
        t = torch.tensor([1 if flag else 0])
        if self.distributed:
            dist.broadcast(t, src=0, group=self.control)
        return bool(t.item())

    @contextmanager
    def quiet_single_process(self) -> Iterator[None]:
        """DCP warns on every single-process save/load; that is the intended mode here, not a mistake."""
        if self.distributed:
            yield
            return
        # catch_warnings is process-global; the window is one save and only this one message is silenced.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            yield
