"""One worker process, identical under torchrun, the PyTorchJob operator, Ray Train and a bare
`python -m training`.

`run_worker(spec, run_dir=..., identity=...)` is the whole lifecycle: join (or reuse) the process
group, build the task's model and wrap it (DDP / FSDP2 / HSDP), then hand it to a `Trainer`
(`training.trainer`), which restores the newest checkpoint, trains to `training.steps` with
checkpoints, metrics, drill faults and a step watchdog, evaluates, and writes `result.json` (rank 0).
Determinism is `training.determinism`'s subject; the checkpointed state is `training.state`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from training.config import WorkerSpec
from training.contract import Env, WorkerIdentity
from training.contract.events import Recovery
from training.deadlines import DeadlinePolicy
from training.determinism import configure_determinism
from training.distributed import device_for, init_process_group
from training.faults import FaultInjector
from training.inplace import ROLE_SPARE, ROLE_TRAINER, InPlace
from training.inplace.group import InPlaceGroup, StateSync, freeze_heap
from training.inplace.protocol import ROLLBACK_PATH
from training.inplace.replica import ReplicaSet
from training.metrics import create_sinks
from training.metrics.base import MetricsSink
from training.optim import build_optimizer
from training.preemption import PreemptionHandler
from training.stacks import StackDumper, enable_flight_recorder
from training.state import ModelOptimizerState, TrainerProgress
from training.strategies import parallelize
from training.task import Task, load_task
from training.trainer import CheckpointManagerLike, Trainer, control_group
from training.watchdog import StepWatchdog

__all__ = ["Prewarmed", "run_worker"]

log = logging.getLogger(__name__)


def _default_checkpoint_manager(
    spec: WorkerSpec, identity: WorkerIdentity, sink: MetricsSink, *, fence_now: bool = True
) -> CheckpointManagerLike:
    from training.checkpoint import CheckpointManager

    manager: CheckpointManagerLike = CheckpointManager(spec.spec.checkpoint, identity, sink, fence_now=fence_now)
    return manager


@dataclasses.dataclass(frozen=True)
class Prewarmed:
    """What a warm spare built before it was assigned a rank (`training.inplace.spare`)."""

    task: Task
    model: torch.nn.Module  # built with the job's seed, on the CPU, not yet wrapped
    optimizer: torch.optim.Optimizer  # over `model`'s parameters (its first build imports dynamo: seconds)
    generation: int  # the process-group generation to join
    assigned_at: float  # `time.perf_counter()` of the assignment
    assigned_cpu: float = 0.0  # `time.thread_time()` of the assignment
    modules: frozenset[str] = frozenset()  # `sys.modules` at the assignment


def run_worker(
    spec: WorkerSpec,
    *,
    run_dir: str | None,
    identity: WorkerIdentity | None = None,
    prewarmed: Prewarmed | None = None,
    on_main_thread: Callable[[Callable[[], None]], None] | None = None,
    preemption_notice: Callable[[], float | None] | None = None,
) -> dict[str, Any]:
    """Train one worker of the job to `training.steps` and return its result.

    Args:
        spec: The resolved job (`training.config.load_worker_spec`).
        run_dir: The run directory (events, metrics, result.json, relative checkpoint stores); None
            writes no files and resolves relative stores against the working directory.
        identity: This rank's coordinates. None reads the launcher's environment (torchrun /
            PyTorchJob / none). Ray Train passes one built from `ray.train.get_context()`; a process
            group that already exists (Ray Train creates it) is reused, never re-created or destroyed.
        prewarmed: A warm spare's prebuilt task and model: join that process-group generation and
            take the trained state from a survivor instead of a checkpoint (`training.inplace`).
        on_main_thread: Where this runs outside the main thread (Ray Train), how to run a function on
            it: the preemption handler's signal handlers are installed there
            (`PreemptionHandler.install`).
        preemption_notice: A scheduler's advance notice of a reclaim (Ray Train's node drain): seconds
            left, or None; polled every `metrics.logEvery` steps on every rank, and handled like SIGTERM
            within the shorter of that and `restarts.preemptGraceSeconds`.

    Returns:
        The `result.json` fields (`training.contract.Result`), on every rank.

    Raises:
        training.task.TaskLoadError: `task.entrypoint`/`task.args` do not give a Task.
    """
    wall_start = time.perf_counter()
    identity = (identity if identity is not None else WorkerIdentity.from_env()).with_run(spec.name, run_dir)
    if not identity.node:
        identity = dataclasses.replace(identity, node=socket.gethostname())
    cfg = spec.spec.training
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    sink = create_sinks(spec, identity)
    sink.on_start(identity)
    stacks = StackDumper(identity, sink).install()  # stacks/gen-G/rank-R.txt on SIGUSR1 and the watchdog
    restarts = spec.spec.restarts  # the step deadline: derived from the step times, or fixed (`hangDetection`)
    watchdog = StepWatchdog(
        restarts.step_timeout_seconds, sink, stacks=stacks, policy=DeadlinePolicy.from_restarts(restarts)
    ).start()
    faults = FaultInjector.from_env(
        rank=identity.rank, generation=identity.generation, events=sink, replacement=prewarmed is not None
    )
    io_timeout_s = spec.spec.checkpoint.io_timeout_seconds
    preemption = PreemptionHandler.from_spec(
        spec.spec.restarts, sink, rank=identity.rank, watchdog=watchdog, io_timeout_s=io_timeout_s
    ).install(on_main_thread)  # SIGTERM -> emergency checkpoint (training.preemption)
    if preemption_notice is not None:  # a scheduler's advance notice (Ray's node drain) means the same
        preemption.watch_notice(preemption_notice, spec.spec.metrics.log_every)
    created_group = False
    trainer: Trainer | None = None
    startup = contextlib.ExitStack()  # the watchdog's start-up limit, until the Trainer takes over
    try:
        startup.enter_context(watchdog.startup(io_timeout_s))
        configure_determinism(cfg.deterministic)
        device = device_for(identity)
        enable_flight_recorder(identity)  # CUDA builds; before the process group exists
        # In-place recovery (`training.inplace`): a child of a per-rank host forms every process
        # group generation on the long-lived store instead of the launcher's env:// store.
        inplace = InPlace.from_spec(spec) if os.environ.get(Env.INPLACE_ROLE) in (ROLE_TRAINER, ROLE_SPARE) else None
        group: InPlaceGroup | None = None
        if inplace is not None:
            if prewarmed is None:
                freeze_heap()  # the imports' objects: out of every recovery's gc.collect (`InPlaceGroup.leave`)
            group = InPlaceGroup(inplace, identity, "nccl" if device.type == "cuda" else "gloo")
            # A shutdown signal while forming (torchrun stopping the group: another rank fell back) ends the
            # wait at once, as a survivor's does: the preemption handler only records it, and a spare has no
            # state to save yet, so waiting would hold torchrun's SIGTERM up until it kills the host (30 s).
            group.form(prewarmed.generation if prewarmed is not None else 0, cancelled=lambda: preemption.requested)
            created_group = True
            faults.ready = group.spare_ready  # a drill's kill waits for a warm spare (not its start-up)
            faults.ready_wait_s = min(inplace.timeout_s, spec.spec.restarts.step_timeout_seconds / 2)
            faults.ready_phase = lambda: watchdog.fixed("drill: waiting for a warm spare")
        else:
            created_group = init_process_group(identity, device)
        # FSDP/HSDP in place: snapshots of the shards in host memory, swapped with the neighbours.
        replicas: ReplicaSet | None = None
        if inplace is not None and cfg.strategy.value != "ddp":
            every = spec.spec.checkpoint.in_memory.every
            assert every is not None  # `InPlace.from_spec` requires it for sharded strategies
            replicas = ReplicaSet(rank=identity.rank, world_size=identity.world_size, every=every)
        spare_progress: TrainerProgress | None = None
        synced: StateSync | None = None
        spare_phases: dict[str, float] = {}  # a spare's `Recovery.phases`
        if prewarmed is None:
            task = load_task(spec.spec.task.entrypoint, spec.spec.task.args)
            torch.manual_seed(cfg.seed)  # identical initial weights on every rank, in every generation
            model = task.build_model()
            with contextlib.ExitStack() as recording:
                if group is not None:  # HSDP's mesh groups are cut on a failure like the rest
                    recording.enter_context(group.ledger.recording())
                par = parallelize(model, task.blocks(model), cfg, identity, device)
                if replicas is not None:
                    replicas.connect()
            optimizer = build_optimizer(par.model, cfg.optimizer)
        else:
            # A spare: the survivors' order of collectives (`Trainer.recover_in_place`): the state
            # transfer, DDP, the checkpoint manager's groups (the preemption agreement rides on one).
            assert group is not None
            task, model = prewarmed.task, prewarmed.model
            spare_phases["formed"] = round(time.perf_counter() - prewarmed.assigned_at, 4)
            spare_progress = TrainerProgress()
            if replicas is not None:
                # FSDP/HSDP: shard the prebuilt model on the new group (a new optimizer over its sharded
                # parameters), then take the lost rank's shards from its neighbour's replica.
                with watchdog.io(spec.spec.restarts.in_place_timeout_seconds):
                    with group.ledger.recording():
                        replicas.connect()
                        par = parallelize(model, task.blocks(model), cfg, identity, device)
                    optimizer = build_optimizer(par.model, cfg.optimizer)
                    state = {"app": ModelOptimizerState(par.model, optimizer), "trainer": spare_progress}
                    plan = replicas.sync(state, has_state=False)
                faults.predecessor_reached = plan.reached  # its faults up to there have fired
                synced = StateSync(
                    step=plan.step,
                    source=plan.sends[identity.rank],
                    replaced=sorted(plan.sends),
                    progress=spare_progress.state_dict(),
                )
            else:
                model.to(device)  # the same Parameter objects: the prebuilt optimizer stays valid
                optimizer = prewarmed.optimizer
                with watchdog.io(spec.spec.restarts.in_place_timeout_seconds):
                    synced = group.sync_state(model, optimizer, spare_progress, has_state=False)
                if synced.rollback:  # it re-trains steps its predecessor ran: their faults were the predecessor's
                    faults.predecessor_reached = synced.step
                par = parallelize(
                    model, task.blocks(model), cfg, identity, device, bucket_order=synced.bucket_order, in_sync=True
                )
            spare_phases["state"] = round(time.perf_counter() - prewarmed.assigned_at, 4)
        with watchdog.io(spec.spec.checkpoint.io_timeout_seconds):  # opens the stores, takes the fence
            checkpoints = _default_checkpoint_manager(spec, identity, sink)
        if prewarmed is not None:
            spare_phases["checkpoints"] = round(time.perf_counter() - prewarmed.assigned_at, 4)
        preemption.connect(control_group(checkpoints))  # collective: on the manager's control group
        if prewarmed is not None:
            spare_phases["preemption"] = round(time.perf_counter() - prewarmed.assigned_at, 4)
            log.info("spare: ready to train at %.3f s (%s)", spare_phases["preemption"], spare_phases)
        startup.close()  # from here on the step timeout (restore: the checkpoint I/O limit)
        trainer = Trainer(
            spec,
            identity,
            task,
            par,
            optimizer,
            checkpoints=checkpoints,
            sink=sink,
            faults=faults,
            watchdog=watchdog,
        )
        trainer.preemption = preemption
        if preemption is not None and trainer.sdc is not None and checkpoints is not None:
            sdc = trainer.sdc  # the emergency checkpoint certified like every other save (restore prefers those)
            preemption.before_save = lambda stop: sdc.certify(stop, checkpoints)
        watching = trainer  # with derived deadlines a rank in a collective dumps its stacks early
        watchdog.in_collective = lambda: watching.par.comm.pending > 0
        if group is not None:
            trainer.inplace = group
            trainer.replicas = replicas

            def new_checkpoints() -> CheckpointManagerLike:
                with watchdog.io(spec.spec.checkpoint.io_timeout_seconds):
                    return _default_checkpoint_manager(spec, identity, sink, fence_now=False)

            trainer.checkpoint_factory = new_checkpoints
            live = trainer
            watchdog.waiting = lambda: live.par.comm.pending > 0 or live.par.comm.failed
            watchdog.waiting_grace_s = spec.spec.restarts.in_place_timeout_seconds
        if prewarmed is not None and synced is not None:
            trainer.progress.load_state_dict(synced.progress)
            resumed_after = synced.step
            if synced.rollback:
                # After an SDC the survivors reload the newest certified checkpoint (their ROLLBACK phase): so
                # does the spare, in the same order of collectives as `run`'s restore, before its event says
                # which step it resumes after (the survivors' events name the rolled-back step too).
                trainer.restore()
                resumed_after = trainer.progress.step
            trainer.skip_restore = True
            sink.emit(
                Recovery(
                    path=ROLLBACK_PATH if synced.rollback else "inplace",
                    step=resumed_after,
                    seconds=round(time.perf_counter() - prewarmed.assigned_at, 3),
                    inplace_generation=prewarmed.generation,
                    replaced_ranks=synced.replaced,
                    role="spare",
                    source="replica" if replicas is not None else "peer",
                    cpu_s=round(time.thread_time() - prewarmed.assigned_cpu, 3),
                    phases=spare_phases,
                    imports=sorted(set(sys.modules) - prewarmed.modules) if prewarmed.modules else None,
                )
            )
        return trainer.run(wall_start).to_dict()
    finally:
        if trainer is not None:
            try:
                trainer.close()
            except Exception:
                log.exception("closing the checkpoint manager failed")
        preemption.close()
        startup.close()
        watchdog.stop()
        stacks.close()
        sink.close()
        if created_group and tdist.is_initialized():
            tdist.destroy_process_group()
