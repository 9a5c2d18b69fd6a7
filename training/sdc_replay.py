"""Deterministic replay for the replica check (`training.sdc.decide_replay`): two replicas that disagree are
told apart by re-running the steps since their last agreement.

Each agreed check (`SdcMonitor.check`) keeps a copy of what it agreed on: every tensor of
`training.sdc.state_tensors` (parameters and optimizer state, on their devices) and the loop's position
(`TrainerProgress`: step, data cursor, loss, the fp16 scaler). On a disagreement without a majority every
rank copies that state back into its live tensors, re-runs the steps from the kept one to the disagreeing
one through the trainer's own step (same batches by global index, same per-step seeds, the same DDP
all-reduce: bit-exact, `training.determinism`) and fingerprints the result. A healthy rank reproduces its
own fingerprint; a rank whose memory or arithmetic was struck does not (a drill's `bitflip` fires once,
like a transient fault), as long as the corruption had not yet been averaged into its peer through an
all-reduce (`training.sdc`: otherwise no rank is reproduced, and the verdict stays undecided). The live
state is overwritten: the caller raises `SilentDataCorruption` next,
and the group reloads a certified checkpoint either way.

Cost: one more copy of the state in device memory while the job runs (only where a replica group has two
members: `create_sdc_monitor`), a device-to-device copy at each agreed check, and, on a disagreement only,
up to `sdc.every` steps re-run. Limits: the replay re-runs what the kept state and the data reproduce; a
device that computes the same wrong number every time reproduces it, and two replicas cannot say which
of them is wrong (`decide_replay` stays undecided), nor can a corruption inside the all-reduce be told
apart (both replicas receive it).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from training.sdc import (
    NO_DEPARTURE,
    UNKNOWN,
    _signed,
    _tensor_hash,
    decide_departures,
    fingerprint_tensors,
    tensor_constant,
)

if TYPE_CHECKING:
    from training.trainer import Trainer

__all__ = ["NO_DEPARTURE", "UNKNOWN", "GradientTrail", "ReplayPoint", "chained", "decide_departures", "replay_steps"]

log = logging.getLogger(__name__)


# The trail hashes every TRAIL_STRIDE-th element of each local gradient: a corrupted parameter or moment
# changes most of the gradient its next forward and backward compute, so a sample sees it at a fraction of
# a full hash's cost; a departure the sample misses leaves the verdict undecided, never wrong.
TRAIL_STRIDE = 8


class GradientTrail:
    """This rank's own local gradients, step by step since the newest agreed check, as DDP all-reduced them.

    Two replicas that disagree after a parameter flip cannot be told apart by their states: the flip on
    rank 1 enters rank 1's local gradient of the next step, whose all-reduce carries it to rank 0, so
    neither state is what a clean replay reproduces. But the *first* step whose local gradient departs
    from the replay is the culprit's: its gradient of step k was computed from corrupted bits while its
    peer's still came from clean ones (the peer departs one step later, once the average reached it).
    The trail keeps, for each step since the kept state, a 64-bit hash of a sample of this rank's
    gradients taken in DDP's communication hook before the all-reduce (`CommTimer.before_reduce`), on the
    device (no synchronisation per step); a replay records the same, and `departure` names the first step
    where they differ. Only where a replica group has two members (`SdcMonitor.replay`) and DDP carries the
    gradients.

    Args:
        params: The parameters whose gradients are hashed, in an order every replica shares.
        device: Where the per-step hashes are combined.
    """

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device) -> None:
        self.index = {id(p): i for i, p in enumerate(params)}
        self.count = len(params)
        self.device = device
        self.recorded: dict[int, torch.Tensor] = {}
        self.replayed: dict[int, torch.Tensor] = {}
        self.replaying = False
        self._step: int | None = None
        self._hashes: list[torch.Tensor | None] = []

    def capture(self, bucket: Any) -> None:
        """`CommTimer.before_reduce`: hash this bucket's gradients (this rank's own, before the all-reduce)."""
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            i = self.index.get(id(param))
            if i is not None and self._step is not None:
                # a dense copy of the sample (a one-element strided view counts as contiguous, yet
                # cannot be read as bytes)
                sample = grad.reshape(-1)[::TRAIL_STRIDE].clone(memory_format=torch.contiguous_format)
                self._hashes[i] = _tensor_hash(sample)

    def begin(self, step: int) -> None:
        """Before step `step`'s first forward."""
        self._step, self._hashes = step, [None] * self.count

    def end(self) -> None:
        """After the step's last backward: file its hash (none when no bucket was all-reduced)."""
        step, self._step = self._step, None
        if step is None or all(h is None for h in self._hashes):
            return
        acc = torch.zeros((), dtype=torch.int64, device=self.device)
        for t, h in enumerate(self._hashes):
            if h is not None:
                acc = acc + h.to(self.device) * _signed(tensor_constant(t))
        (self.replayed if self.replaying else self.recorded)[step] = acc

    def forget_through(self, step: int) -> None:
        """The state of `step` agreed: the steps up to it need no record."""
        for old in [s for s in self.recorded if s <= step]:
            del self.recorded[old]

    def departure(self, first: int, last: int) -> int:
        """The first step in `first..last` whose replayed gradient differs from its record; NO_DEPARTURE
        when none does, UNKNOWN when a step lacks either (one transfer to the host)."""
        steps = range(first, last + 1)
        if not steps or any(s not in self.recorded or s not in self.replayed for s in steps):
            return UNKNOWN
        differs = torch.stack([self.recorded[s] != self.replayed[s] for s in steps]).tolist()
        return next((s for s, d in zip(steps, differs, strict=True) if d), NO_DEPARTURE)


def chained(first: Callable[[Any], None] | None, second: Callable[[Any], None]) -> Callable[[Any], None]:
    """One `CommTimer.before_reduce` that calls `first` (the recompute check's capture, if any), then `second`."""
    if first is None:
        return second

    def both(bucket: Any) -> None:
        first(bucket)
        second(bucket)

    return both


class _Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class ReplayPoint:
    """The state of the newest agreed check, and the re-run of the steps after it.

    Args:
        tensors: The live state, in `state_tensors` order (copied in place both ways).
        progress: The loop's position (`TrainerProgress`).
        run_to: Re-runs the steps after the live progress's step up to the given one (`replay_steps`).
        device: Where fingerprints are combined.
        trail: This rank's gradients since the kept state (`GradientTrail`), or None (no DDP buckets).
    """

    def __init__(
        self,
        tensors: Callable[[], list[torch.Tensor]],
        progress: _Stateful,
        run_to: Callable[[int], None],
        device: torch.device,
        trail: GradientTrail | None = None,
    ) -> None:
        self.tensors = tensors
        self.progress = progress
        self.run_to = run_to
        self.device = device
        self.trail = trail
        self.departed: int = UNKNOWN  # the first replayed step whose gradient departed (`GradientTrail`)
        self.kept_step: int | None = None
        self._copy: list[torch.Tensor] = []
        self._progress: dict[str, Any] = {}

    @torch.no_grad()
    def keep(self, step: int) -> None:
        """Copy the live state (its buffers are reused while the layout stays the same)."""
        live = self.tensors()
        same = len(live) == len(self._copy) and all(
            c.shape == t.shape and c.dtype == t.dtype and c.device == t.device
            for c, t in zip(self._copy, live, strict=True)
        )
        if same:
            for c, t in zip(self._copy, live, strict=True):
                c.copy_(t)
        else:
            self._copy = [t.detach().clone() for t in live]
        self._progress = copy.deepcopy(self.progress.state_dict())
        self.kept_step = step
        if self.trail is not None:
            self.trail.forget_through(step)

    def kept_fingerprint(self) -> int:
        """The fingerprint of the kept copy (it agreed when kept; a flip in it since would show here)."""
        return fingerprint_tensors(self._copy, self.device)

    def run(self, step: int) -> int | None:
        """Load the kept state, re-run the steps up to `step` (collective) and return the new fingerprint.

        None when the live state no longer has the kept layout (the optimizer created state since): the
        caller still takes part in the exchange, and the verdict stays undecided.
        """
        live = self.tensors()
        if self.kept_step is None or len(live) != len(self._copy):
            log.warning("sdc: replay impossible: the state's layout changed since step %s", self.kept_step)
            return None
        with torch.no_grad():
            for t, c in zip(live, self._copy, strict=True):
                t.copy_(c)
        self.progress.load_state_dict(copy.deepcopy(self._progress))
        if self.trail is None:
            self.run_to(step)
        else:
            self.trail.replayed.clear()
            self.trail.replaying = True
            try:
                self.run_to(step)
            finally:
                self.trail.replaying = False
            self.departed = self.trail.departure(self.kept_step + 1, step)
        return fingerprint_tensors(self.tensors(), self.device)


def replay_steps(trainer: Trainer, last: int) -> None:
    """Re-run `trainer`'s steps after its progress's step through `last` (collective), as it ran them.

    The data order restarts from the restored cursor (`Trainer._feed`), each step is the trainer's own
    (`Trainer.step`: learning rate, seeds, micro-batches, DDP's all-reduce, clipping, the optimizer); no
    metrics, checkpoints or faults of `after_step`. The recompute spot check is off meanwhile (its own
    exchange would interleave with nothing on the other side). The watchdog judges the replay by the fixed
    step timeout, not by the deadline of one step.
    """
    spot, trainer.recompute = trainer.recompute, None
    try:
        # Asked from inside a step (the recompute check, between backward and the optimizer), `.grad` still
        # holds that step's gradients, and the first replayed backward would add to them.
        trainer.optimizer.zero_grad(set_to_none=True)
        feed = trainer._feed()
        with trainer.watchdog.fixed("sdc_replay"):
            while trainer.progress.step < last:
                trainer.step(trainer.progress.step + 1, feed)
    finally:
        trainer.recompute = spot
