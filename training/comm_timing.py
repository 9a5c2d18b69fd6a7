"""How long a step spends in gradient collectives: `CommTimer`, fed by a timed DDP all-reduce hook and by
timed FSDP2 all-gather and reduce-scatter collectives.

`comm_s` of every step record and the straggler signal (`training.metrics.straggler`) come from here;
`training.strategies` installs the hooks on the wrappers it builds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import GradBucket  # type: ignore[attr-defined]

__all__ = ["CommTimer", "time_fsdp_comms", "timed_allreduce_hook"]

log = logging.getLogger(__name__)


class CommTimer:
    """Wall time covered by gradient collectives, as the union of their [issue, done] intervals.

    Collectives overlap with compute and with each other (DDP buckets); the union counts each second
    of communication once. Callbacks may run on the backend's threads, hence the lock.

    It also keeps when the step's first *gradient* collective was issued (DDP's first bucket,
    FSDP's first reduce-scatter; not FSDP's all-gathers): the time before it is this rank's own
    forward and backward up to its first ready gradients, which no other rank's speed changes (the
    straggler signal that DDP's overlap cannot blur, `training.metrics.straggler`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._first_gradient: float | None = None
        self.pending = 0  # gradient collectives issued and not done (a rank waiting on its peers)
        # A gradient collective failed (a peer is gone): this rank is about to recover, not hung. Set
        # before the error reaches the training loop, so its watchdog cannot fire in between.
        self.failed = False
        # Called with each DDP bucket before its all-reduce, while it holds this rank's own local gradients
        # (`training.sdc_recompute` fingerprints them on its check steps; None: nothing to see).
        self.before_reduce: Callable[[GradBucket], None] | None = None

    def gradient_issued(self, start: float) -> None:
        """A gradient collective was issued at `start` (`time.perf_counter()`)."""
        with self._lock:
            if self._first_gradient is None or start < self._first_gradient:
                self._first_gradient = start

    def take_first_gradient(self) -> float | None:
        """When the first gradient collective since the last call was issued (and forget it)."""
        with self._lock:
            first, self._first_gradient = self._first_gradient, None
        return first

    def record(self, start: float, end: float) -> None:
        with self._lock:
            self._intervals.append((start, end))

    def track(self, start: float, work: dist.Work | None) -> None:
        """Record the interval of a collective issued at `start` (sync: done now; async: when its future is)."""
        if work is None:
            self.record(start, time.perf_counter())
            return
        fut = work.get_future()
        fut.add_done_callback(lambda _: self.record(start, time.perf_counter()))

    def take(self) -> float:
        """Seconds of communication since the last call (and forget them)."""
        with self._lock:
            intervals, self._intervals = sorted(self._intervals), []
        total, cur_start, cur_end = 0.0, None, None
        for start, end in intervals:
            if cur_end is None or start > cur_end:
                if cur_end is not None and cur_start is not None:
                    total += cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        if cur_end is not None and cur_start is not None:
            total += cur_end - cur_start
        return total


def timed_allreduce_hook(timer: CommTimer) -> Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]:
    """A DDP communication hook: DDP's default all-reduce, its [issue, done] interval and failure recorded
    in `timer`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()
        timer.gradient_issued(start)
        timer.pending += 1
        if timer.before_reduce is not None:
            timer.before_reduce(bucket)
        fut = default_hooks.allreduce_hook(process_group, bucket)

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            try:
                return f.value()
            except Exception:
                timer.failed = True
                raise
            finally:
                timer.pending -= 1
                timer.record(start, time.perf_counter())

        return fut.then(done)

    # DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
    hook.__annotations__ = {
        "process_group": Any,
        "bucket": GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook


def time_fsdp_comms(model: nn.Module, timer: CommTimer) -> None:
    """Route FSDP2's all-gather and reduce-scatter through timed wrappers of the default collectives.

    Uses FSDP2's custom-comm hooks (`set_custom_all_gather/reduce_scatter`); on a torch without them
    comm time is reported as 0 rather than guessed.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:  # pragma: no cover - older torch
        log.info("FSDP2 custom comms unavailable in this torch; comm_s is reported as 0")
        return

    def _empty(size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    class TimedAllGather(AllGather):
        def allocate(
            self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
        ) -> torch.Tensor:
            return _empty(size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            async_op: bool = False,
        ) -> dist.Work | None:
            start = time.perf_counter()
            work: dist.Work | None = dist.all_gather_into_tensor(
                output_tensor, input_tensor, group=group, async_op=async_op
            )
            timer.track(start, work if async_op else None)
            return work

    class TimedReduceScatter(ReduceScatter):
        def allocate(
            self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
        ) -> torch.Tensor:
            return _empty(size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: Any,
            async_op: bool = False,
        ) -> dist.Work | None:
            start = time.perf_counter()
            timer.gradient_issued(start)
            work: dist.Work | None = dist.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
            timer.track(start, work if async_op else None)
            return work

    from torch.distributed.fsdp import FSDPModule

    gather, scatter = TimedAllGather(), TimedReduceScatter()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
