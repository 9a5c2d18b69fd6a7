"""The training loop of one rank: `Trainer` takes a built model, optimizer and checkpoint manager and
runs them to `training.steps`.

`Trainer.run` is restore -> train (steps with metrics, drill faults, the step watchdog and checkpoint
saves) -> evaluate -> result. Setting up the process group and building the pieces is
`training.worker.run_worker`'s job; what makes a resume bit-identical is in `training.determinism`.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as tdist
from torch import nn
from torch.utils.data import DataLoader

from training.config import WorkerSpec
from training.contract import RunFiles, WorkerIdentity
from training.contract.events import Finished, Recovery
from training.contract.records import FinalCheckpoint, Result
from training.data import BatchIndices, GlobalOrder, StepPlan, to_device
from training.determinism import seed_step_rng, step_seed
from training.evaluation import evaluate
from training.faults import FaultInjector
from training.metrics.base import MetricsSink, StepRecord
from training.metrics.straggler import create_straggler_detector
from training.optim import lr_at
from training.profiling import create_step_profiler
from training.sdc import SilentDataCorruption, create_sdc_monitor, fingerprint, replica_shards, state_tensors
from training.sdc_recompute import create_recompute_check
from training.sdc_replay import GradientTrail, ReplayPoint, chained, replay_steps
from training.state import ModelOptimizerState, TrainerProgress, full_params_sha256
from training.strategies import Parallel, clip_grad_norm, ddp_bucket_order, rewrap_ddp
from training.task import Task
from training.watchdog import StepWatchdog

if TYPE_CHECKING:
    from training.inplace.group import InPlaceGroup
    from training.inplace.replica import ReplicaSet
    from training.preemption import PreemptionHandler

__all__ = ["CheckpointManagerLike", "Trainer"]

log = logging.getLogger(__name__)


class CheckpointManagerLike(Protocol):
    """The part of `training.checkpoint.CheckpointManager` the loop uses (docs/architecture.md)."""

    def restore(self, state: dict[str, Any]) -> Any: ...

    def should_save(self, step: int) -> bool: ...

    def save(self, step: int, state: dict[str, Any], *, final: bool = False) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class _Feed:
    """What every step of one `train` call consumes: the batches and this rank's share of the step."""

    batches: Iterator[Any]
    plan: StepPlan
    samples: int  # samples this rank processes per step (all micro-batches)
    tokens_per_sample: int
    flops_per_sample: float


def control_group(checkpoints: CheckpointManagerLike | None) -> Any:
    """The checkpoint manager's control group, for the preemption agreement to share (None where the
    manager has none: no stores, one process, or a stand-in without one)."""
    return getattr(checkpoints, "control_group", None)


MANIFEST_BUCKETS = "ddp_buckets"  # manifest `extra`: DDP's rebuilt bucket layout (`_publish_bucket_order`)


class Trainer:
    """One rank's training of one job.

    Args:
        spec: The resolved job.
        identity: This rank's coordinates (`job` and `run_dir` set).
        task: The user's task.
        par: The task's model, parallelized (`training.strategies.parallelize`).
        optimizer: The optimizer over `par.model`'s parameters.
        checkpoints: The checkpoint manager (None: no checkpoints).
        sink: Where metrics and events go.
        faults: The drill's faults for this rank and generation.
        watchdog: The step watchdog, started.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        identity: WorkerIdentity,
        task: Task,
        par: Parallel,
        optimizer: torch.optim.Optimizer,
        *,
        checkpoints: CheckpointManagerLike | None,
        sink: MetricsSink,
        faults: FaultInjector,
        watchdog: StepWatchdog,
    ) -> None:
        self.spec = spec
        self.cfg = spec.spec.training
        self.identity = identity
        self.task = task
        self.par = par
        self.optimizer = optimizer
        self.progress = TrainerProgress(par.scaler)
        # What a checkpoint holds (DCP Statefuls).
        self.state: dict[str, Any] = {"app": ModelOptimizerState(par.model, optimizer), "trainer": self.progress}
        self.checkpoints = checkpoints
        self.sink = sink
        self.faults = faults
        self.watchdog = watchdog
        self.io_timeout_s = spec.spec.checkpoint.io_timeout_seconds  # the watchdog's limit for checkpoint I/O
        self.final_checkpoint: FinalCheckpoint | None = None  # the final save's outcome, once made
        # SIGTERM -> agreed stop step -> emergency checkpoint -> exit 202 (set by the worker; None: off).
        self.preemption: PreemptionHandler | None = None
        # In-place recovery (`training.inplace`, set by the worker; None: a failure ends the process).
        self.inplace: InPlaceGroup | None = None
        self.checkpoint_factory: Callable[[], CheckpointManagerLike] | None = None  # a new group's manager
        # FSDP/HSDP in place: this rank's in-memory snapshots and its neighbour's (`training.inplace.replica`).
        self.replicas: ReplicaSet | None = None
        self.skip_restore = False  # a spare got its state from a survivor, not from a checkpoint
        self._buckets_for: object = None  # the manager whose manifests carry DDP's bucket layout already
        metrics = spec.spec.metrics
        # `metrics.profile`: torch.profiler over a window of steps on the ranks named (None: off).
        self.profiler = create_step_profiler(metrics.profile, identity, sink, cuda=par.device.type == "cuda")
        self.straggler = create_straggler_detector(
            identity, sink, every=metrics.log_every, threshold=metrics.straggler_threshold, device=par.device
        )
        # `sdc.every`: DDP replicas compared bit for bit every N steps and before every save (`training.sdc`).
        self.sdc = create_sdc_monitor(
            identity,
            sink,
            every=spec.spec.sdc.every,
            state=lambda: fingerprint(self.par.model, self.optimizer, self.par.device),
            device=par.device,
            shards=replica_shards(par.model, par.mesh),
            replay=ReplayPoint(
                lambda: state_tensors(self.par.model, self.optimizer),
                self.progress,
                lambda last: replay_steps(self, last),
                par.device,
                # DDP: this rank's own gradients step by step, so a replay can name who departed first
                trail=GradientTrail([p for p in par.module.parameters() if p.requires_grad], par.device)
                if isinstance(par.model, nn.parallel.DistributedDataParallel)
                else None,
            )
            if self.cfg.deterministic  # a replay must reproduce a healthy rank bit for bit
            else None,
        )
        if self.sdc is not None:
            self.sdc.prefer_certified(checkpoints)
        # Only where the monitor keeps a replay point (a replica group of two): the gradient trail's hooks.
        replay_point = self.sdc.replay if self.sdc is not None else None
        self.trail = replay_point.trail if isinstance(replay_point, ReplayPoint) else None
        # `sdc.recomputeEvery`: each rank recomputes its neighbour's pre-reduce gradient (`training.sdc_recompute`).
        self.recompute = create_recompute_check(
            identity,
            sink,
            every=spec.spec.sdc.recompute_every,
            par=par,
            task=task,
            cfg=self.cfg,
            phase=lambda: self.watchdog.fixed("sdc_recompute"),
            undecided=None if self.sdc is None else self.sdc.check,
        )
        for check in (self.sdc, self.recompute):  # in place with standby nodes: who takes a suspect's node
            if check is not None:
                check.handover = self._sdc_handover
        faults.arm(par.module, optimizer)

    # -- lifecycle --------------------------------------------------------------------------------
    def run(self, wall_start: float) -> Result:
        """Restore, train to `training.steps`, evaluate and report (`result.json` on rank 0).

        Args:
            wall_start: `time.perf_counter()` when the worker started (for `wall_s`).
        """
        self.restore()
        self.watchdog.beat(self.progress.step)
        final_loss, samples_per_s = self.train()
        self.watchdog.beat(self.progress.step)
        with self.watchdog.fixed("evaluation"):  # no step: never judged by a deadline derived from steps
            eval_metrics = self.evaluate() if self.cfg.eval_at_end else {}
        self.watchdog.beat(self.progress.step)
        self.close()
        result = Result(
            steps=self.progress.step,
            final_loss=final_loss,
            eval=eval_metrics,
            params_sha256=full_params_sha256(self.par),
            world_size=self.identity.world_size,
            samples_per_s=samples_per_s,
            wall_s=time.perf_counter() - wall_start,
            final_checkpoint=self.final_checkpoint,
            device=str(self.par.device),
            backend=str(tdist.get_backend()) if tdist.is_initialized() else "",
        )
        self.report(result)
        return result

    def restore(self) -> None:
        """Load the newest checkpoint the manager finds into `state` (nothing when there is none)."""
        if self.checkpoints is None or self.skip_restore:
            return
        start = time.perf_counter()
        with self.watchdog.io(self.io_timeout_s):
            restored = self.checkpoints.restore(self.state)
        if restored is None:
            return
        self._adopt_bucket_order(getattr(restored, "extra", None) or {})
        if self.identity.generation > 0 and self.identity.is_leader:
            # The group restarted (torchrun) and resumed from a checkpoint: the `restart` path.
            seconds = round(time.perf_counter() - start, 3)
            self.sink.emit(Recovery(path="restart", step=self.progress.step, seconds=seconds, role="restarted"))
        log.info(
            "rank %d: resumed at step %d (saved at world size %d, now %d)",
            self.identity.rank,
            self.progress.step,
            self.progress.world_size,
            self.identity.world_size,
        )

    def _adopt_bucket_order(self, extra: dict[str, Any]) -> None:
        """Re-wrap DDP in the bucket layout the checkpoint's writer had rebuilt to (collective: every rank
        restored the same checkpoint). With 3+ ranks the layout decides the rounding of the gradient
        all-reduce, so a resumed run's first steps in module order would not be bit-identical."""
        order = extra.get(MANIFEST_BUCKETS)
        if not isinstance(self.par.model, nn.parallel.DistributedDataParallel) or not isinstance(order, list):
            return
        if not all(type(i) is int for i in order) or ddp_bucket_order(self.par.model) == order:
            return  # (an unusable order from the store is ignored; `_OrderedDDP` also checks the permutation)
        self.par.bucket_order = order
        rewrap_ddp(self.par)
        self.state["app"] = ModelOptimizerState(self.par.model, self.optimizer)

    def _publish_bucket_order(self) -> None:
        """Once DDP has rebuilt its buckets, name the layout in every manifest of this manager."""
        if self.checkpoints is None or self._buckets_for is self.checkpoints:
            return
        if not isinstance(self.par.model, nn.parallel.DistributedDataParallel):
            self._buckets_for = self.checkpoints  # nothing to record (FSDP, one process)
            return
        order = ddp_bucket_order(self.par.model)
        extra = getattr(self.checkpoints, "manifest_extra", None)
        if order is None or extra is None:
            return  # not rebuilt yet (the first step), or a manager without manifests
        extra[MANIFEST_BUCKETS] = order
        self._buckets_for = self.checkpoints

    def close(self) -> None:
        """Wait for the last checkpoint to commit and release the manager (idempotent)."""
        if self.profiler is not None:
            self.profiler.close()
        if self.replicas is not None:
            self.replicas.close()
        checkpoints, self.checkpoints = self.checkpoints, None
        if checkpoints is not None:
            with self.watchdog.io(self.io_timeout_s):
                checkpoints.close()

    # -- training ---------------------------------------------------------------------------------
    def train(self) -> tuple[float | None, float | None]:
        """Train from the restored step to `training.steps`.

        Returns:
            The final loss (mean over ranks of the last step; None when not finite) and the global
            samples per second of the steps this process ran (None when it ran none).
        """
        feed = self._feed()
        self.par.model.train()
        first_step = self.progress.step
        train_s = 0.0
        stepped = False
        self._snapshot()  # FSDP in place: a replica of the starting state (restored or fresh)
        while self.progress.step < self.cfg.steps:
            try:
                if self.profiler is not None and not self.profiler.done:  # its start and export are no step
                    with self.watchdog.fixed("profile"):
                        self.profiler.before_step(self.progress.step + 1)
                record = self.step(self.progress.step + 1, feed)
                train_s += record.step_s
                if not stepped and self.inplace is not None:
                    self.inplace.mark_stepped()
                stepped = True
                self.after_step(record)
                if self.profiler is not None and not self.profiler.done:
                    with self.watchdog.fixed("profile"):
                        self.profiler.after_step(record.step)
                continue
            except Exception as exc:
                from training.inplace.group import is_peer_failure

                # The replicas disagreed: leave for a spare, roll back in place, or raise (a group restart).
                rollback = isinstance(exc, SilentDataCorruption) and self._rolls_back(exc)
                if not rollback and (self.inplace is None or not is_peer_failure(exc)):
                    raise
                failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            # Outside the handler: the traceback (and the old DDP wrapper it references) is gone.
            self.recover_in_place(failure, rollback=rollback)
            self._snapshot()  # the spare took one on joining: every member takes this one
            feed = self._feed()  # the data order from the cursor: the step in flight is recomputed
            self.par.model.train()
        steps_run = self.progress.step - first_step
        samples_per_s = steps_run * feed.plan.global_batch / train_s if train_s > 0 else None
        return self._final_loss(), samples_per_s

    def _sdc_handover(self, suspects: tuple[int, ...], decided: bool) -> int | None:
        """`SdcMonitor.handover`: the node a ready standby node takes (`InPlaceGroup.sdc_handover`; every rank
        asks, one answer for all); None without in-place recovery or under FSDP/HSDP (the group restarts)."""
        if self.inplace is None or self.replicas is not None:
            return None
        return self.inplace.sdc_handover(suspects, decided)

    def _rolls_back(self, exc: SilentDataCorruption) -> bool:
        """`protocol.decide_sdc`: True when this rank rolls back in place (the majority named others).

        Raises:
            LeftForSpare: the majority named this rank: it leaves, and its host gives its rank to a spare.
        """
        from training.inplace.group import LeftForSpare
        from training.inplace.protocol import RollBack, SdcObservation, StandDown, decide_sdc

        seen = SdcObservation(
            rank=self.identity.rank,
            world=self.identity.world_size,
            suspects=exc.suspects,
            decided=exc.decided,
            in_place=self.inplace is not None,
            sharded=self.replicas is not None,
            node=self.identity.rank // max(1, self.identity.local_world_size),
            handed_over=exc.handed_over,
        )
        decision = decide_sdc(seen)
        if isinstance(decision, StandDown):
            if exc.handed_over is not None and self.inplace is not None:
                self.inplace.mark_handed_over()  # its host then leaves instead of claiming a spare of this node
            raise LeftForSpare(decision, decision.reason) from exc
        return isinstance(decision, RollBack)

    def recover_in_place(self, failure: str, *, rollback: bool = False) -> None:
        """A collective failed (a peer died): re-form the group with a spare in the dead rank's place.

        Keeps model, optimizer and progress in memory; destroys the broken group, joins the next
        generation (`InPlaceGroup.form`), takes the newest state from the most advanced rank, wraps
        the model in a new DDP and opens a new checkpoint manager (a new writer fence) for the new
        group. The step that was in flight is recomputed by the caller from `progress.cursor`. With
        `rollback` (the replicas disagreed, `protocol.RollBack`) every member then reloads the newest
        certified checkpoint, and training resumes from its step.

        Raises:
            RecoveryFailed: the new generation did not form (the host then restarts the group).
        """
        group = self.inplace
        assert group is not None
        limit = self.spec.spec.restarts.in_place_timeout_seconds
        # The whole recovery (leaving the broken group, abandoning its checkpoint manager, forming the
        # next one) runs under the in-place limit, not the step timeout: this rank is not hung.
        with self.watchdog.recovery(limit):
            from training.inplace import survivor

            survivor.recover_trainer(self, group, failure, limit, control_group=control_group, rollback=rollback)
        self.par.comm.failed = False

    def _snapshot(self) -> None:
        """FSDP in place: snapshot this rank's shards and swap copies with its neighbours (collective)."""
        if self.replicas is not None:
            with self.watchdog.io(self.io_timeout_s):  # it first waits for the previous exchange
                self.replicas.take(self.progress.step, self.state)
            log.debug(
                "in-memory replica of step %d: training blocked %.3f s (the previous one took %.3f s)",
                self.progress.step,
                self.replicas.blocked_s,
                self.replicas.last_s,
            )

    def _feed(self) -> _Feed:
        cfg, identity, progress = self.cfg, self.identity, self.progress
        dataset = self.task.train_dataset()
        order = GlobalOrder(len(dataset), cfg.seed)  # type: ignore[arg-type]
        plan = StepPlan(identity.world_size, cfg.batch_size, cfg.grad_accumulation)
        if progress.world_size and progress.world_size != identity.world_size:
            log.info(
                "rank %d: world size changed %d -> %d at step %d",
                identity.rank,
                progress.world_size,
                identity.world_size,
                progress.step,
            )
        progress.world_size = identity.world_size
        loader = DataLoader(
            dataset,
            batch_sampler=BatchIndices(order, plan, identity.rank, progress.cursor),
            collate_fn=self.task.collate,
            num_workers=cfg.num_workers,
            persistent_workers=False,
        )
        return _Feed(
            batches=iter(loader),
            plan=plan,
            samples=cfg.batch_size * cfg.grad_accumulation,
            tokens_per_sample=self.task.tokens_per_sample(),
            flops_per_sample=self.task.flops_per_sample(),
        )

    def step(self, step: int, feed: _Feed) -> StepRecord:
        """Optimizer step `step` (every micro-batch, then a drill's delay); returns what it measured."""
        cfg, par, progress = self.cfg, self.par, self.progress
        t0 = time.perf_counter()
        lr = lr_at(step - 1, self.identity.world_size, cfg.optimizer.lr, cfg.steps, cfg.lr_schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        seed_step_rng(step_seed(cfg.seed, step, self.identity.rank), par.device)
        data_wait = 0.0
        loss_sum = torch.zeros((), device=par.device)
        par.comm.take()
        par.comm.take_first_gradient()
        if self.recompute is not None:  # on its steps, fingerprint DDP's buckets before their all-reduce
            self.recompute.before_step(step)
        if self.trail is not None:  # two replicas: this rank's own gradients, for a replay to name a culprit
            self.trail.begin(step)
            par.comm.before_reduce = chained(par.comm.before_reduce, self.trail.capture)
        for micro in range(cfg.grad_accumulation):
            td = time.perf_counter()
            batch = to_device(next(feed.batches), par.device)
            data_wait += time.perf_counter() - td
            with par.micro_step(sync=micro == cfg.grad_accumulation - 1):
                loss = self.task.loss(par.model, batch) / cfg.grad_accumulation
                self.faults.before_backward(loss, step)
                if par.scaler is not None:
                    par.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
                else:
                    loss.backward()  # type: ignore[no-untyped-call]
            loss_sum += loss.detach().float()
        if self.trail is not None:
            self.trail.end()
            if self.recompute is None:
                par.comm.before_reduce = None
        if self.recompute is not None:  # before the optimizer step: raises SilentDataCorruption on a mismatch
            self.recompute.after_backward(step, progress.cursor)
        grad_norm = self._apply_gradients()
        loss_value = progress.loss = float(loss_sum)
        delay = self.faults.step_delay(step)
        if delay:
            time.sleep(delay)
        progress.step = step
        progress.cursor += feed.plan.global_batch
        step_s = time.perf_counter() - t0
        first_gradient = par.comm.take_first_gradient()
        return StepRecord(
            step=step,
            loss=loss_value,
            samples=feed.samples,
            tokens=feed.samples * feed.tokens_per_sample,
            step_s=step_s,
            data_wait_s=data_wait,
            comm_s=par.comm.take(),
            world_size=self.identity.world_size,
            lr=lr,
            time=time.time(),
            flops=feed.samples * feed.flops_per_sample,
            grad_norm=grad_norm,
            pre_comm_s=None if first_gradient is None else max(0.0, first_gradient - t0 - data_wait),
        )

    def _apply_gradients(self) -> float | None:
        """Unscale (fp16), clip, step the optimizer and clear the gradients; the norm before clipping."""
        par, optimizer = self.par, self.optimizer
        grad_norm: float | None = None
        if par.scaler is not None:
            par.scaler.unscale_(optimizer)
        if self.cfg.grad_clip is not None:
            grad_norm = clip_grad_norm(par, self.cfg.grad_clip)
        if par.scaler is not None:
            par.scaler.step(optimizer)
            par.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def after_step(self, record: StepRecord) -> None:
        """Report a completed step, fire the drill's faults, and save a checkpoint when one is due."""
        step, cfg = record.step, self.cfg
        self.watchdog.beat(step)
        self.sink.on_step(record)
        if self.straggler is not None:
            self.straggler.observe(record)  # a collective every logEvery steps, on every rank
        if self.identity.is_leader and (step % self.spec.spec.metrics.log_every == 0 or step == cfg.steps):
            print(
                f"torchrig: step {step}/{cfg.steps} loss {record.loss:.4f} lr {record.lr:.3g} "
                f"{record.step_s * 1000:.0f} ms",
                file=sys.stderr,
                flush=True,
            )
        self.faults.after_step(step)
        if self.sdc is not None:
            self.sdc.after_step(step)  # every sdc.every steps; raises SilentDataCorruption on a disagreement
        if step == cfg.steps:
            # The run reports the ranks' mean loss of its last step. Each rank's progress holds its own,
            # and a checkpoint keeps one rank's copy of that replicated value: keep the mean instead, so
            # a finished run resubmitted (it restores this step and trains nothing) reports the same loss.
            mean = self._final_loss()  # one collective, once per run
            if mean is not None:
                self.progress.loss = mean
        if self.checkpoints is not None:
            self._publish_bucket_order()
            final = step == cfg.steps and self.spec.spec.checkpoint.save_final
            if final or self.checkpoints.should_save(step):
                if self.sdc is not None:  # the saved step's replicas agree (or it raises): `certified`
                    self.sdc.certify(step, self.checkpoints)
                with self.watchdog.io(self.io_timeout_s):  # a synchronous save, or one waiting for the last
                    outcome = self.checkpoints.save(step, self.state, final=final)
                if final and outcome is not None:
                    self.final_checkpoint = FinalCheckpoint(
                        outcome.step, outcome.committed, list(outcome.stores_ok), dict(outcome.stores_failed)
                    )
                self.faults.after_save_staged(step)
                self.watchdog.beat(step)
        if self.replicas is not None and self.replicas.due(step) and step < cfg.steps:
            self._snapshot()
        if self.preemption is not None:  # collective: raises PreemptedExit at the agreed stop step
            self.preemption.at_step_boundary(step, self.checkpoints, self.state)  # type: ignore[arg-type]

    def _final_loss(self) -> float | None:
        # The reported loss is the mean over ranks of the last step (one collective, at the end only).
        loss_value = self.progress.loss
        final_loss = torch.tensor([loss_value], dtype=torch.float64)
        world_size = self.identity.world_size
        if world_size > 1 and tdist.is_initialized():
            final_loss = final_loss.to(self.par.device)
            tdist.all_reduce(final_loss)
            final_loss /= world_size
        return float(final_loss.item()) if math.isfinite(loss_value) else None

    # -- evaluation and the result ----------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current model (every rank takes part), reported to the sink."""
        metrics = evaluate(self.task, self.par, self.identity, self.cfg.eval_batch_size)
        if metrics:
            self.sink.on_eval(self.progress.step, metrics)
        return metrics

    def report(self, result: Result) -> None:
        """`result.json` (rank 0, when there is a run directory), the `finished` event, the last line."""
        if self.identity.is_leader and self.identity.run_dir is not None:
            result.write(RunFiles(self.identity.run_dir).result)
        self.sink.emit(Finished(step=result.steps, final_loss=result.final_loss, wall_s=result.wall_s))
        if self.inplace is not None:
            self.inplace.mark_finished()
        if self.identity.is_leader and result.final_checkpoint is not None and result.final_checkpoint.lost:
            print(f"torchrig: {result.final_checkpoint.reason()}", file=sys.stderr, flush=True)
        if self.identity.is_leader:
            print(
                f"torchrig: finished {result.steps} steps, loss {result.final_loss}, eval {result.eval}, "
                f"params_sha256 {result.params_sha256[:16]}",
                file=sys.stderr,
                flush=True,
            )
