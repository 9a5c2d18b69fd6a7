"""Redundant compute spot checks (`sdc.recomputeEvery`): corruption before the gradient all-reduce.

The replica check (`training.sdc`) cannot see a rank that computes a wrong local gradient: DDP averages it
into every replica alike, and the replicas still agree, all of them wrong. Every `recomputeEvery` steps
each rank r therefore also computes the local gradient of rank n = (r + 1) mod world for that step, from
the same global sample indices (`training.data`: the batch of a rank is a pure function of the cursor) and
the same per-step seed (`training.determinism.step_seed(seed, step, n)`), on the pre-step parameters every
replica shares, and the group all-gathers two 8-byte fingerprints per rank (`training.sdc.fingerprint_tensors`
over the gradients in parameter order): its own pre-reduce gradient and its recomputation of its
neighbour's. `decide_recompute` names the suspect.

Where the own gradient is captured: in DDP's communication hook, bucket by bucket, before the all-reduce
(`CommTimer.before_reduce`, called by `training.comm_timing.timed_allreduce_hook`): exactly the bytes this
rank sends, accumulated over its micro-batches, with no extra copy and no change to the collective (a
`no_sync` step with a manual all-reduce would round differently from DDP's buckets at 3+ ranks and break
bit-identity with a run without checks). The recomputation runs on the unwrapped module with
`torch.autograd.grad`, after the step's own backward and before its optimizer step: it neither touches
`.grad` nor fires DDP's reducer, and the parameters are still the pre-step ones. Buffers (BatchNorm's
running statistics) are put back afterwards, and the step's random state is reseeded by the next step.
A disagreement raises before the optimizer step, so the corrupted average is never applied.

Cost (bench section `sdc`): one more forward and backward of one rank's batch on a check step, about a
step's compute; spread over `recomputeEvery` steps. DDP only: FSDP/HSDP hold no full parameters to
recompute a neighbour's gradient with (off there, with a log line).

Not covered: corruption inside the all-reduce (every replica receives the same wrong sum, and every
rank's own pre-reduce gradient was right); a fault that strikes only a rank's recomputation names the
rank it recomputed (`decide_recompute`'s single-fault assumption), which costs a restart, and two such
detections are needed before a host is quarantined.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from training.config import TrainingConfig
from training.contract import WorkerIdentity
from training.data import GlobalOrder, StepPlan, to_device
from training.determinism import seed_step_rng, step_seed
from training.metrics.base import MetricsSink
from training.sdc import (
    MASK64,
    Decision,
    Handover,
    HostExchange,
    _signed,
    _tensor_hash,
    all_gather_hosts,
    combine_hashes,
    report_disagreement,
)
from training.strategies import Parallel
from training.task import Task

__all__ = ["GradientCapture", "RecomputeCheck", "create_recompute_check", "decide_recompute"]

log = logging.getLogger(__name__)

# (own, recomputed) of this rank -> every rank's, by rank (one all-gather of 16 bytes per rank)
PairExchange = Callable[[int, int], list[tuple[int, int]]]


def decide_recompute(own: Sequence[int], recomputed: Sequence[int]) -> Decision:
    """Name the suspects from the pre-reduce gradient fingerprints (index = rank).

    `own[r]` is rank r's own local gradient, `recomputed[r]` rank r's recomputation of rank (r + 1)'s. Edge r
    fails when `recomputed[r] != own[r + 1]`. Under one faulty rank f (its own gradient or its
    recomputation wrong, or both) only edges f - 1 and f can fail. For each failing edge r:

    - edge r - 1 holds: rank r's own gradient was reproduced by its neighbour, so rank r computes right
      and its recomputation is trusted: rank r + 1 is the suspect (named with a witness);
    - edge r - 1 fails too: rank r's own gradient and its recomputation both disagree: rank r is the suspect.

    Decided when every suspect was named by a witness (one failing edge, or two adjacent ones at 3+ ranks);
    undecided otherwise (two ranks whose edges both fail: their gradients disagree both ways, as when their
    parameters differ; every edge failing; chains of failures).
    """
    world = len(own)
    if len(recomputed) != world:
        raise ValueError(f"{world} own fingerprints but {len(recomputed)} recomputed")
    failing = [r for r in range(world) if recomputed[r] != own[(r + 1) % world]]
    if not failing:
        return Decision(agreed=True, suspects=(), decided=True, how="recompute")
    witnessed: set[int] = set()
    unwitnessed: set[int] = set()
    for r in failing:
        if (r - 1) % world in failing:
            unwitnessed.add(r)
        else:
            witnessed.add((r + 1) % world)
    suspects = tuple(sorted(witnessed | unwitnessed))
    decided = unwitnessed <= witnessed
    note = "" if decided else "the recomputed gradients disagree both ways (no rank vouched for)"
    return Decision(False, suspects, decided, how="recompute", note=note)


class GradientCapture:
    """Fingerprints DDP's buckets before their all-reduce (`CommTimer.before_reduce`), per parameter.

    Each bucket hands over views of its flat buffer per parameter (`GradBucket.gradients`); their hashes
    stay on the device until `fingerprint` combines them in `params` order (a parameter no bucket carried
    counts as a zero gradient, whose hash is 0, as `recompute` counts one that got no gradient).
    """

    def __init__(self, params: Sequence[nn.Parameter], device: torch.device) -> None:
        self.index = {id(p): i for i, p in enumerate(params)}
        self.device = device
        self.hashes: list[torch.Tensor | None] = [None] * len(params)

    def __call__(self, bucket: Any) -> None:
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            i = self.index.get(id(param))
            if i is not None:
                self.hashes[i] = _tensor_hash(grad)

    def fingerprint(self) -> int:
        return combine_hashes(self.hashes, self.device)


class RecomputeCheck:
    """Every `every` steps: this rank's pre-reduce gradient against its left neighbour's recomputation of it.

    The trainer calls `before_step` before the step's first forward and `after_backward` after its last
    backward, before the optimizer step (every rank: the exchange is a collective).

    Args:
        identity: This rank.
        sink: Gets the `sdc` event (rank 0).
        every: Steps between checks (`sdc.recomputeEvery`).
        par: The DDP model (its `comm` timer carries the capture).
        task: The user's task (its dataset, collate function and loss).
        cfg: `spec.training` (seed, batch size, micro-batches).
        exchange: All-gathers (own, recomputed) pairs.
        hosts: All-gathers host names (on a disagreement).
        phase: The watchdog's phase for the recomputation (a step's deadline does not cover a second
            forward and backward).
        undecided: Called with the step before the check's, when the verdict is undecided (the replica
            check, whose replay may decide; it raises on a disagreement of its own).
    """

    def __init__(
        self,
        identity: WorkerIdentity,
        sink: MetricsSink,
        *,
        every: int,
        par: Parallel,
        task: Task,
        cfg: TrainingConfig,
        exchange: PairExchange,
        hosts: HostExchange,
        phase: Callable[[], AbstractContextManager[None]] = nullcontext,
        undecided: Callable[[int], object] | None = None,
    ) -> None:
        self.identity = identity
        self.sink = sink
        self.every = max(1, every)
        self.par = par
        self.task = task
        self.cfg = cfg
        self.exchange = exchange
        self.hosts = hosts
        self.phase = phase
        self.undecided = undecided
        self.params = [p for p in par.module.parameters() if p.requires_grad]
        self._dataset: Any = None
        self._order: GlobalOrder | None = None
        self._capture: GradientCapture | None = None
        self.last_checked: int | None = None
        self.handover: Handover | None = None  # set by an in-place DDP trainer (`report_disagreement`)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def before_step(self, step: int) -> None:
        """On a check step, fingerprint DDP's buckets before their all-reduce."""
        self._capture = GradientCapture(self.params, self.par.device) if self.due(step) else None
        self.par.comm.before_reduce = self._capture

    def after_backward(self, step: int, cursor: int) -> Decision | None:
        """On a check step: recompute the neighbour's gradient, exchange, decide (collective).

        Args:
            step: The step in progress.
            cursor: Its first global sample (`TrainerProgress.cursor` before it advances).

        Raises:
            SilentDataCorruption: the fingerprints disagree.
        """
        capture, self._capture = self._capture, None
        self.par.comm.before_reduce = None
        if capture is None:
            return None
        own = capture.fingerprint()
        world, rank = self.identity.world_size, self.identity.rank
        with self.phase():
            recomputed = self.recompute(step, cursor, (rank + 1) % world)
            pairs = self.exchange(own, recomputed)
        self.last_checked = step
        decision = decide_recompute([p[0] for p in pairs], [p[1] for p in pairs])
        if decision.agreed:
            return decision
        if not decision.decided and self.undecided is not None:
            self.undecided(step - 1)  # the replicas may disagree already: the replica check (and replay) decides
        report_disagreement(
            self.identity,
            self.sink,
            self.hosts,
            step=step,
            decision=decision,
            fingerprints=[p[0] for p in pairs],
            last_agreed=None,
            evidence="recompute",
            recomputed=[p[1] for p in pairs],
            handover=self.handover,
        )

    def _batch(self, indices: list[int]) -> Any:
        """What the DataLoader would hand the rank for these indices (`_MapDatasetFetcher`'s way)."""
        dataset = self._dataset
        getitems = getattr(dataset, "__getitems__", None)
        samples = getitems(indices) if getitems else [dataset[i] for i in indices]
        return self.task.collate(samples)

    def recompute(self, step: int, cursor: int, rank: int) -> int:
        """The fingerprint of `rank`'s local gradient of `step` (its micro-batches summed as DDP accumulates
        them), computed here on the unwrapped module without touching `.grad`."""
        cfg, par = self.cfg, self.par
        if self._order is None:
            self._dataset = self.task.train_dataset()
            self._order = GlobalOrder(len(self._dataset), cfg.seed)
        plan = StepPlan(self.identity.world_size, cfg.batch_size, cfg.grad_accumulation)
        module = par.module
        buffers = [b.detach().clone() for b in module.buffers()]
        seed_step_rng(step_seed(cfg.seed, step, rank), par.device)
        total: list[torch.Tensor | None] = [None] * len(self.params)
        for start, count in plan.rank_slices(cursor, rank):
            batch = to_device(self._batch(self._order.indices(start, count)), par.device)
            with par.eval_autocast():  # the training micro-step's autocast (DDP: the same condition)
                loss = self.task.loss(module, batch) / cfg.grad_accumulation
                if par.scaler is not None:
                    loss = par.scaler.scale(loss)
                grads = torch.autograd.grad(loss, self.params, allow_unused=True)
            for i, grad in enumerate(grads):
                if grad is not None:
                    # AccumulateGrad's order: the first micro-batch's gradient, then each next one added
                    previous = total[i]
                    total[i] = grad if previous is None else previous + grad
        with torch.no_grad():
            for live, saved in zip(module.buffers(), buffers, strict=True):
                live.copy_(saved)
        return combine_hashes([None if g is None else _tensor_hash(g) for g in total], par.device)


def all_gather_pairs(device: torch.device) -> PairExchange:
    """Every rank's (own, recomputed) through one all-gather of two int64 per rank on the default group."""
    import torch.distributed as tdist

    def exchange(own: int, recomputed: int) -> list[tuple[int, int]]:
        local = torch.tensor([_signed(own), _signed(recomputed)], dtype=torch.int64, device=device)
        out = [torch.empty_like(local) for _ in range(tdist.get_world_size())]
        tdist.all_gather(out, local)
        return [(int(t[0].item()) & MASK64, int(t[1].item()) & MASK64) for t in out]

    return exchange


def create_recompute_check(
    identity: WorkerIdentity,
    sink: MetricsSink,
    *,
    every: int,
    par: Parallel,
    task: Task,
    cfg: TrainingConfig,
    phase: Callable[[], AbstractContextManager[None]] = nullcontext,
    undecided: Callable[[int], object] | None = None,
) -> RecomputeCheck | None:
    """The spot check of a DDP job (None: `sdc.recomputeEvery` 0, one rank, no group, or not DDP)."""
    import torch.distributed as tdist

    if every <= 0 or identity.world_size <= 1 or not tdist.is_initialized():
        return None
    if not cfg.deterministic:
        if identity.is_leader:
            log.warning("sdc: recompute spot checks are off: they need training.deterministic (bit-exact kernels)")
        return None
    if not isinstance(par.model, nn.parallel.DistributedDataParallel):
        if identity.is_leader:
            log.info("sdc: recompute spot checks are off: DDP only (FSDP/HSDP hold no full parameters)")
        return None
    return RecomputeCheck(
        identity,
        sink,
        every=every,
        par=par,
        task=task,
        cfg=cfg,
        exchange=all_gather_pairs(par.device),
        hosts=all_gather_hosts(par.device),
        phase=phase,
        undecided=undecided,
    )
