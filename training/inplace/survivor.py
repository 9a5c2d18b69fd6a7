"""A survivor's way back after its collective failed: the phases of `protocol.SurvivorState`, in order.

`training.trainer.Trainer` knows how to do each phase to its own model, optimizer, checkpoint manager and
preemption agreement (`Phases`); this module decides what follows each one: LEAVE (cut the broken
generation's connections, destroy its groups) -> FORM (join generation g+1, `InPlaceGroup.form`) -> SYNC
(the newest state from the most advanced rank) -> REWIRE (DDP, checkpoint manager, preemption group) ->
RESUMED. Any failure once the broken generation is left (a second death while forming or syncing, a
shutdown signal, a generation that does not form) is a `FallBack`: `RecoveryFailed`, and the trainer
exits `RECOVERY_FAILED` so that torchrun restarts the group. A failure while leaving is the trainer's own
(it propagates as it is). The transitions are `protocol.SURVIVOR_TRANSITIONS`, as the simulator follows
them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from training.inplace.group import RecoveryFailed
from training.inplace.protocol import SURVIVOR_TRANSITIONS, Decision, FallBack, Formed, SurvivorState, Wait, next_state

__all__ = ["Phases", "recover"]


@dataclass(frozen=True)
class Phases:
    """What a survivor does in each state (each returns once done, or raises)."""

    leave: Callable[[], None]
    form: Callable[[], None]
    sync: Callable[[], None]
    rewire: Callable[[], None]


def recover(phases: Phases, generation: int) -> None:
    """Run `phases` from LEAVE to RESUMED as `SURVIVOR_TRANSITIONS` orders them.

    Args:
        phases: The trainer's work in each state.
        generation: The generation being formed (named in a fall-back's reason).

    Raises:
        RecoveryFailed: a phase after LEAVE failed (the group restarts).
    """
    work = {
        SurvivorState.LEAVE: phases.leave,
        SurvivorState.FORM: phases.form,
        SurvivorState.SYNC: phases.sync,
        SurvivorState.REWIRE: phases.rewire,
    }
    state = SurvivorState.LEAVE
    while not state.terminal:
        decision: Decision = Formed() if state is SurvivorState.FORM else Wait()
        failed: Exception | None = None
        try:
            work[state]()
        except Exception as exc:
            if state is SurvivorState.LEAVE:
                raise
            failed = exc
            # A second failure while re-forming (a death, a shutdown signal): give up, the group restarts.
            reason = str(exc) if isinstance(exc, RecoveryFailed) else f"{type(exc).__name__}: {exc}"
            decision = FallBack(reason if isinstance(exc, RecoveryFailed) else f"generation {generation}: {reason}")
        state = next_state(SURVIVOR_TRANSITIONS, state, decision)
        if state is SurvivorState.FAILED:
            assert isinstance(decision, FallBack) and failed is not None
            if isinstance(failed, RecoveryFailed):
                raise failed
            raise RecoveryFailed(decision.reason) from failed
