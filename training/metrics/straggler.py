"""Online straggler detection: every `metrics.logEvery` steps the ranks compare their compute times.

Not their step times: with DDP a step's gradient all-reduce cannot finish before the slowest rank has
issued it, so every rank's step takes as long as the straggler's. Each rank measures, per step, two
times that only its own speed changes:

- `pre_comm_s`: from the step's start to its first gradient collective (DDP's first bucket, FSDP's
  first reduce-scatter; `CommTimer.gradient_issued`), input wait excluded: its forward and its
  backward up to its first ready gradients. Blind to how a backend reports a collective's end.
- `compute_s`: the step's time outside collectives (step time minus the union of the collectives'
  intervals). Also sees slowness after the first bucket: late backward, optimizer, between steps.

At the window's last step every rank all-gathers its two window medians (a median: one step of a
rank descheduled by the OS is no straggler) (one small collective on the
default group at a step boundary; every rank runs the same steps, so all of them join it) and gets
every rank's slowdown: its time over the median rank's (`statistics.median_low`, so with two ranks
the faster one is the median), the larger of the two signals. The slowest rank is the straggler when
its slowdown exceeds `metrics.stragglerThreshold` and it is at least `MIN_EXCESS_S` slower than the
median (millisecond jitter of tiny steps is no straggler), in `CONFIRM_WINDOWS` windows in a row (a
rank the OS descheduled for a while is no straggler either). A process's first step is left out of
its window (start-up costs differ between ranks). Every rank reports the result to its sinks
(`on_slowdown`: the `torchrig_rank_slowdown_ratio` / `torchrig_straggler_rank` gauges); rank 0 writes
a `straggler` event whenever the straggler changes (`slow_rank` -1: none any more).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import torch

from training.contract import WorkerIdentity
from training.contract.events import Straggler
from training.metrics.base import MetricsSink, SlowdownRecord, StepRecord

__all__ = [
    "CONFIRM_WINDOWS",
    "MIN_EXCESS_S",
    "StragglerDetector",
    "create_straggler_detector",
    "find_straggler",
    "slowdowns",
]

MIN_EXCESS_S = 0.01  # a straggler is at least this much slower per step than the median rank
CONFIRM_WINDOWS = 2  # consecutive windows that must agree before the straggler changes

# rank's window medians -> every rank's, by rank (an all-gather)
Exchange = Callable[[list[float]], list[list[float]]]


def slowdowns(values: Sequence[float]) -> list[float]:
    """Each value over the median value (`median_low`: an actual rank's); 1.0 when the median is 0."""
    median = statistics.median_low(values)
    return [v / median if median > 0 else 1.0 for v in values]


def find_straggler(
    compute_s: Sequence[float],
    pre_comm_s: Sequence[float] | None,
    threshold: float,
    *,
    min_excess_s: float = MIN_EXCESS_S,
) -> tuple[int, list[float]]:
    """The straggler among the ranks, from their window medians.

    Args:
        compute_s: Per rank, compute time per step outside collectives (a window median).
        pre_comm_s: Per rank, time per step before the first gradient collective (None: not measured on
            every rank).
        threshold: Slowdown above which the slowest rank is a straggler.
        min_excess_s: How much slower than the median a straggler must at least be, in seconds.

    Returns:
        The straggler (-1: none) and every rank's slowdown (the larger of the two signals).
    """
    signals = [list(compute_s)] + ([list(pre_comm_s)] if pre_comm_s is not None else [])
    ratios = [0.0] * len(compute_s)
    qualifying = [0.0] * len(compute_s)  # the largest ratio of a signal that passes both tests
    for values in signals:
        median = statistics.median_low(values)
        for rank, ratio in enumerate(slowdowns(values)):
            ratios[rank] = max(ratios[rank], ratio)
            if ratio > threshold and values[rank] - median >= min_excess_s:
                qualifying[rank] = max(qualifying[rank], ratio)
    slowest = max(range(len(qualifying)), key=lambda r: qualifying[r], default=-1)
    if slowest < 0 or qualifying[slowest] <= 0:
        return -1, ratios
    return slowest, ratios


class StragglerDetector:
    """Collects this rank's window and, every `every` steps, compares it with the other ranks'.

    Args:
        identity: This rank.
        sink: Gets `on_slowdown` (every rank) and the `straggler` events (rank 0).
        every: Window length in steps (`metrics.logEvery`): the exchange runs when `step % every == 0`.
        threshold: `metrics.stragglerThreshold`.
        exchange: The all-gather of the window medians (`all_gather_exchange`); injected in tests.
    """

    def __init__(
        self, identity: WorkerIdentity, sink: MetricsSink, *, every: int, threshold: float, exchange: Exchange
    ) -> None:
        self.identity = identity
        self.sink = sink
        self.every = max(1, every)
        self.threshold = threshold
        self.exchange = exchange
        self.straggler = -1
        self._candidates: list[int] = []  # the last windows' candidates
        self._warm = False  # a process's first step is left out: its one-off start-up costs differ by rank
        self._reset()

    def _reset(self) -> None:
        self._compute: list[float] = []
        self._pre_comm: list[float | None] = []

    def observe(self, record: StepRecord) -> SlowdownRecord | None:
        """Add a completed step; at a window's end exchange and report (every rank must call this)."""
        if self._warm:
            self._compute.append(max(0.0, record.step_s - record.comm_s))
            self._pre_comm.append(record.pre_comm_s)
        self._warm = True
        if record.step % self.every:
            return None
        compute = statistics.median(self._compute) if self._compute else math.nan
        measured = [v for v in self._pre_comm if v is not None]
        pre_comm = statistics.median(measured) if measured and len(measured) == len(self._pre_comm) else math.nan
        rows = self.exchange([compute, pre_comm])  # every rank, even with an empty window: same collectives
        self._reset()
        compute_s = [row[0] for row in rows]
        pre_comm_s = [row[1] for row in rows]
        if not all(math.isfinite(v) for v in compute_s):
            return None  # some rank's window held only its first step
        have_pre_comm = all(math.isfinite(v) for v in pre_comm_s)
        candidate, ratios = find_straggler(compute_s, pre_comm_s if have_pre_comm else None, self.threshold)
        # The verdict changes only when CONFIRM_WINDOWS windows in a row agree (one noisy window is not
        # a straggler, nor is one fast window the end of one).
        self._candidates = [*self._candidates, candidate][-CONFIRM_WINDOWS:]
        confirmed = len(self._candidates) == CONFIRM_WINDOWS and len(set(self._candidates)) == 1
        straggler = candidate if confirmed else self.straggler
        result = SlowdownRecord(step=record.step, ratios=tuple(ratios), straggler=straggler, threshold=self.threshold)
        self.sink.on_slowdown(result)
        if self.identity.is_leader and straggler != self.straggler:
            shown = straggler if straggler >= 0 else max(range(len(ratios)), key=lambda r: ratios[r])
            self.sink.emit(
                Straggler(
                    step=record.step,
                    slow_rank=straggler,
                    slowdown_ratio=round(ratios[shown], 4),
                    threshold=self.threshold,
                    ratios=[round(r, 4) for r in ratios],
                )
            )
        self.straggler = straggler
        return result


def all_gather_exchange(device: torch.device) -> Exchange:
    """Every rank's window medians through one all-gather on the default process group."""
    import torch.distributed as tdist

    def exchange(mine: list[float]) -> list[list[float]]:
        local = torch.tensor(mine, dtype=torch.float64, device=device)
        out = [torch.empty_like(local) for _ in range(tdist.get_world_size())]
        tdist.all_gather(out, local)
        return [t.cpu().tolist() for t in out]

    return exchange


def create_straggler_detector(
    identity: WorkerIdentity, sink: MetricsSink, *, every: int, threshold: float, device: torch.device
) -> StragglerDetector | None:
    """The detector of a multi-rank job (None with one rank, or without a process group)."""
    import torch.distributed as tdist

    if identity.world_size <= 1 or not tdist.is_initialized():
        return None
    return StragglerDetector(identity, sink, every=every, threshold=threshold, exchange=all_gather_exchange(device))
