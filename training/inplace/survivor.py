"""A survivor's way back after its collective failed: the phases of `protocol.SurvivorState`, carried out.

A `training.trainer.Trainer` whose collective failed because a peer died calls `recover_trainer`. It runs
the phases on the trainer's own model, optimizer, checkpoint manager and preemption agreement, in the
order `recover` takes from the survivor's table: LEAVE (cut the broken generation's connections, destroy
its groups, abandon its checkpoint manager) -> FORM (join generation g+1, `InPlaceGroup.form`, whose
decisions are `protocol.decide_form`'s) -> SYNC (the newest state from the most advanced rank, or from
the in-memory replicas under FSDP/HSDP) -> REWIRE (DDP, checkpoint manager, preemption group) -> RESUMED.
After a replica disagreement whose majority named other ranks (`protocol.decide_sdc`: `RollBack`), the
survivor has no failed collective: it leaves the group itself (the suspect is leaving for a spare), and
after REWIRE every member, the spare too, reloads the newest certified checkpoint (ROLLBACK): the
majority's state took the suspect's gradients in, so only a certified step is known good.
Any failure once the broken generation is left (a second death while forming or syncing, a shutdown
signal, a generation that does not form) is a `FallBack`: `RecoveryFailed`, and the trainer exits
`RECOVERY_FAILED` so that torchrun restarts the group. A failure while leaving is the trainer's own (it
propagates as it is). The transitions are `protocol.SURVIVOR_TRANSITIONS`, as the simulator follows them.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from training.contract.events import Recovery
from training.inplace import sockets
from training.inplace.group import RecoveryFailed, StateSync
from training.inplace.protocol import (
    ROLLBACK_PATH,
    SURVIVOR_TRANSITIONS,
    Decision,
    FallBack,
    Formed,
    RollBack,
    SurvivorState,
    Wait,
    next_state,
)
from training.optim import build_optimizer
from training.state import ModelOptimizerState
from training.strategies import parallelize, rewrap_ddp, unwrap_ddp

if TYPE_CHECKING:
    from training.inplace.group import InPlaceGroup
    from training.strategies import Parallel
    from training.trainer import CheckpointManagerLike, Trainer

__all__ = ["ABANDON_WAIT_S", "Phases", "recover", "recover_trainer"]

log = logging.getLogger(__name__)

ABANDON_WAIT_S = 5.0  # how long a recovery waits for the broken group's checkpoint manager to close


@dataclass(frozen=True)
class Phases:
    """What a survivor does in each state (each returns once done, or raises)."""

    leave: Callable[[], None]
    form: Callable[[], None]
    sync: Callable[[], None]
    rewire: Callable[[], None]
    rollback: Callable[[], None] | None = None  # after an SDC (`RollBack`): the collective reload


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
        SurvivorState.ROLLBACK: phases.rollback or (lambda: None),
    }
    state = SurvivorState.LEAVE
    while not state.terminal:
        decision: Decision = Wait()
        if state is SurvivorState.FORM:
            decision = Formed()
        elif state is SurvivorState.REWIRE and phases.rollback is not None:
            decision = RollBack()
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


def _abandon(checkpoints: CheckpointManagerLike, limit_s: float) -> None:
    """Close the broken group's checkpoint manager (a save in flight fails with its group), waiting at
    most `limit_s`: a manager that does not close in time is left to its daemon thread."""

    def close() -> None:
        try:
            checkpoints.close()
        except Exception:
            log.debug("closing the broken group's checkpoint manager failed", exc_info=True)

    closer = threading.Thread(target=close, name="torchrig-abandon-ckpt", daemon=True)
    closer.start()
    closer.join(timeout=limit_s)


class _Survivor:
    """One recovery of `trainer`: each phase's work on its pieces, and when each phase ended."""

    def __init__(
        self,
        trainer: Trainer,
        group: InPlaceGroup,
        limit: float,
        control_group: Callable[[Any], Any],
        *,
        rollback: bool = False,
    ) -> None:
        self.trainer = trainer
        self.rollback = rollback
        self.group = group
        self.limit = limit
        self.control_group = control_group
        self.generation = group.generation + 1
        self.sharded = trainer.replicas is not None
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.synced: StateSync | None = None  # what SYNC found

    def mark(self, phase: str) -> None:
        self.phases[phase] = round(time.perf_counter() - self.start, 4)
        log.debug("in-place: %s at %.3f s", phase, self.phases[phase])

    def leave(self) -> None:
        t, group = self.trainer, self.group
        old_checkpoints, t.checkpoints = t.checkpoints, None
        if self.rollback and old_checkpoints is not None:
            # No peer died: the group still works, and the suspect closes its manager as it exits. Closing
            # ours with it commits the save in flight (a certified step) instead of abandoning it, so the
            # rollback returns to the newest certified step, not the one before.
            try:  # (under the recovery's limit, `Trainer.recover_in_place`)
                old_checkpoints.close()
            except Exception:
                log.warning("in-place: the checkpoint save in flight did not commit", exc_info=True)
        # Drop every reference to the broken groups before destroying them (DDP's reducer would keep them
        # alive); `group.leave` first cuts their connections, which wakes the survivors blocked on us.
        if self.sharded:
            t.state["app"] = None  # the old model and optimizer go with the broken group
        else:
            unwrap_ddp(t.par)
            t.state["app"] = ModelOptimizerState(t.par.module, t.optimizer)
        if t.preemption is not None:
            t.preemption.disconnect()
        if t.replicas is not None:
            t.replicas.disconnect()
        group.leave()
        self.mark("destroyed")
        if t.replicas is not None:  # its exchange in flight fails on the cut connections
            t.replicas.abandon(min(self.limit, ABANDON_WAIT_S))
        if old_checkpoints is not None:
            _abandon(old_checkpoints, min(self.limit, ABANDON_WAIT_S))
            del old_checkpoints
        self.mark("left")

    def form(self) -> None:
        preemption = self.trainer.preemption
        self.group.form(self.generation, cancelled=lambda: preemption is not None and preemption.requested)
        self.mark("formed")

    def sync(self) -> None:
        t, group = self.trainer, self.group
        if t.replicas is not None:
            with group.ledger.recording():
                t.replicas.connect()
            reached = t.progress.step
            t.par, t.optimizer = self._rebuild_sharded()
            t.state["app"] = ModelOptimizerState(t.par.model, t.optimizer)
            plan = t.replicas.sync(t.state, has_state=True, at=reached)
            found = StateSync(step=plan.step, source=-1, replaced=sorted(plan.sends), progress=t.progress.state_dict())
        else:
            found = group.sync_state(
                t.par.module,
                t.optimizer,
                t.progress,
                has_state=True,
                bucket_order=t.par.bucket_order,
                rollback=self.rollback,
            )
            t.par.bucket_order = found.bucket_order
            rewrap_ddp(t.par)
            t.state["app"] = ModelOptimizerState(t.par.model, t.optimizer)
        self.synced = found
        self.mark("state")

    def _rebuild_sharded(self) -> tuple[Parallel, torch.optim.Optimizer]:
        """A new model and optimizer on the new group, as a restarted worker builds them (its state comes
        from the in-memory replicas next)."""
        t = self.trainer
        device = t.par.device
        torch.manual_seed(t.cfg.seed)
        model = t.task.build_model()
        with sockets.recording():  # HSDP's mesh creates groups: cut on the next failure like the rest
            par = parallelize(model, t.task.blocks(model), t.cfg, t.identity, device)
        return par, build_optimizer(par.model, t.cfg.optimizer)

    def rewire(self) -> None:
        t = self.trainer
        t.optimizer.zero_grad(set_to_none=True)
        if t.checkpoint_factory is not None:
            t.checkpoints = t.checkpoint_factory()
        self.mark("checkpoints")
        if t.preemption is not None:
            t.preemption.reconnect(self.control_group(t.checkpoints))
        self.mark("preemption")

    def reload_certified(self) -> None:
        """ROLLBACK: every member (the spares in `Trainer.run`) restores the newest certified checkpoint."""
        t = self.trainer
        reached = t.progress.step
        t.skip_restore = False  # a former spare's: its state came from a peer once, now from the store
        t.restore()
        if t.progress.step >= reached:
            raise RecoveryFailed(f"no certified checkpoint before step {reached} to roll back to")
        assert self.synced is not None
        self.synced = dataclasses.replace(self.synced, step=t.progress.step)
        self.mark("restored")


def recover_trainer(
    trainer: Trainer,
    group: InPlaceGroup,
    failure: str,
    limit: float,
    *,
    control_group: Callable[[Any], Any],
    rollback: bool = False,
) -> None:
    """Bring `trainer` back after its collective failed (`failure`): the phases, then the recovery event.

    Args:
        trainer: The survivor's trainer; its model, optimizer, checkpoint manager and preemption agreement
            are replaced by the new generation's.
        group: Its in-place group (the broken generation's; the next one's once this returns).
        failure: What failed, for the log.
        limit: `restarts.inPlaceTimeoutSeconds`.
        control_group: The checkpoint manager's control group (`training.trainer.control_group`), which the
            preemption agreement rides on.
        rollback: The replicas disagreed and the majority named another rank (`protocol.RollBack`): re-form,
            then reload the newest certified checkpoint (ROLLBACK); the event's path is `inplace-rollback`.

    Raises:
        RecoveryFailed: a phase after LEAVE failed (the group restarts).
    """
    survivor = _Survivor(trainer, group, limit, control_group, rollback=rollback)
    cpu_start = time.thread_time()
    what = "replicas disagreed" if rollback else "collective failed"
    print(
        f"torchrig: in-place: rank {trainer.identity.rank}: {what} after step {trainer.progress.step} "
        f"({failure}); re-forming the group",
        file=sys.stderr,
        flush=True,
    )
    # LEAVE -> FORM -> SYNC -> REWIRE -> RESUMED; a failure after LEAVE is `RecoveryFailed` (the fallback).
    recover(
        Phases(
            leave=survivor.leave,
            form=survivor.form,
            sync=survivor.sync,
            rewire=survivor.rewire,
            rollback=survivor.reload_certified if rollback else None,
        ),
        survivor.generation,
    )
    synced = survivor.synced
    assert synced is not None
    seconds = round(time.perf_counter() - survivor.start, 3)
    trainer.sink.emit(
        Recovery(
            path=ROLLBACK_PATH if rollback else "inplace",
            step=synced.step,
            seconds=seconds,
            inplace_generation=group.generation,
            replaced_ranks=synced.replaced,
            role="survivor",
            source="checkpoint" if rollback else "replica" if survivor.sharded else "peer",
            cpu_s=round(time.thread_time() - cpu_start, 3),
            phases=survivor.phases,
        )
    )
    trainer.watchdog.beat(trainer.progress.step)
    print(
        f"torchrig: in-place: rank {trainer.identity.rank}: generation {group.generation} formed in {seconds:.2f} s, "
        f"resuming after step {synced.step} (replaced ranks {synced.replaced})",
        file=sys.stderr,
        flush=True,
    )
