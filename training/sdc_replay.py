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

from training.sdc import fingerprint_tensors

if TYPE_CHECKING:
    from training.trainer import Trainer

__all__ = ["ReplayPoint", "replay_steps"]

log = logging.getLogger(__name__)


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
    """

    def __init__(
        self,
        tensors: Callable[[], list[torch.Tensor]],
        progress: _Stateful,
        run_to: Callable[[int], None],
        device: torch.device,
    ) -> None:
        self.tensors = tensors
        self.progress = progress
        self.run_to = run_to
        self.device = device
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
        self.run_to(step)
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
