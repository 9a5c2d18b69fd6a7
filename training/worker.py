"""One worker process, identical under torchrun, the PyTorchJob operator, Ray Train and a bare
`python -m training`.

`run_worker(spec, run_dir=..., identity=...)` is the whole lifecycle: join (or reuse) the process
group, build the task's model and wrap it (DDP / FSDP2 / HSDP), then hand it to a `Trainer`
(`training.trainer`), which restores the newest checkpoint, trains to `training.steps` with
checkpoints, metrics, drill faults and a step watchdog, evaluates, and writes `result.json` (rank 0).
Determinism is `training.determinism`'s subject; the checkpointed state is `training.state`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from training.config import WorkerSpec
from training.contract import WorkerIdentity
from training.determinism import configure_determinism
from training.distributed import device_for, init_process_group
from training.faults import FaultInjector
from training.metrics import create_sinks
from training.metrics.base import MetricsSink
from training.stacks import StackDumper, enable_flight_recorder
from training.strategies import build_optimizer, parallelize
from training.task import load_task
from training.trainer import CheckpointManagerLike, Trainer
from training.watchdog import StepWatchdog

__all__ = ["run_worker"]

log = logging.getLogger(__name__)


def _default_checkpoint_manager(spec: WorkerSpec, identity: WorkerIdentity, sink: MetricsSink) -> CheckpointManagerLike:
    from training.checkpoint import CheckpointManager

    manager: CheckpointManagerLike = CheckpointManager(spec.spec.checkpoint, identity, sink)
    return manager


def run_worker(spec: WorkerSpec, *, run_dir: str | None, identity: WorkerIdentity | None = None) -> dict[str, Any]:
    """Train one worker of the job to `training.steps` and return its result.

    Args:
        spec: The resolved job (`training.config.load_worker_spec`).
        run_dir: The run directory (events, metrics, result.json, relative checkpoint stores); None
            writes no files and resolves relative stores against the working directory.
        identity: This rank's coordinates. None reads the launcher's environment (torchrun /
            PyTorchJob / none). Ray Train passes one built from `ray.train.get_context()`; a process
            group that already exists (Ray Train creates it) is reused, never re-created or destroyed.

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
    watchdog = StepWatchdog(spec.spec.restarts.step_timeout_seconds, sink, stacks=stacks).start()
    faults = FaultInjector.from_env(rank=identity.rank, generation=identity.generation, events=sink)
    created_group = False
    trainer: Trainer | None = None
    try:
        configure_determinism(cfg.deterministic)
        device = device_for(identity)
        enable_flight_recorder(identity)  # CUDA builds; before the process group exists
        created_group = init_process_group(identity, device)
        task = load_task(spec.spec.task.entrypoint, spec.spec.task.args)

        torch.manual_seed(cfg.seed)  # identical initial weights on every rank, in every generation
        model = task.build_model()
        par = parallelize(model, task.blocks(model), cfg, identity, device)
        optimizer = build_optimizer(par.model, cfg.optimizer)
        with watchdog.io(spec.spec.checkpoint.io_timeout_seconds):  # opens the stores, takes the fence
            checkpoints = _default_checkpoint_manager(spec, identity, sink)
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
        return trainer.run(wall_start).to_dict()
    finally:
        if trainer is not None:
            try:
                trainer.close()
            except Exception:
                log.exception("closing the checkpoint manager failed")
        watchdog.stop()
        stacks.close()
        sink.close()
        if created_group and tdist.is_initialized():
            tdist.destroy_process_group()
