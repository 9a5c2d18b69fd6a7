"""The training loop of one worker process, identical under torchrun, the PyTorchJob operator, Ray
Train and a bare `python -m training`.

`run_worker(spec, run_dir=..., dist=...)` is the whole lifecycle: join (or reuse) the process group,
build the task's model and wrap it (DDP / FSDP2 / HSDP), restore the newest checkpoint, train to
`training.steps` with checkpoints, metrics, drill faults and a step watchdog, evaluate, and write
`result.json` (rank 0).

Determinism: model init is seeded by `training.seed` alone, per-step randomness by (seed, step, rank),
the data order by (seed, epoch) and a global cursor, and the learning rate is a pure function of
(step, world size, config). Nothing random lives only in process memory, so a run killed and
resumed from a checkpoint at the same world size ends bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as tdist
from torch import nn
from torch.utils.data import DataLoader

from training.config import WorkerSpec
from training.data import GlobalOrder, StepPlan, micro_batches
from training.env import DistEnv, detect_env, device_for, init_process_group
from training.faults import FaultInjector
from training.metrics.base import MetricsSink, RunInfo, StepRecord
from training.strategies import Parallel, build_optimizer, clip_grad_norm, lr_at, parallelize
from training.task import Task, load_task
from training.watchdog import StepWatchdog

__all__ = ["CheckpointManagerLike", "ModelOptimizerState", "TrainerProgress", "params_sha256", "run_worker"]

log = logging.getLogger(__name__)


class CheckpointManagerLike(Protocol):
    """The part of `training.checkpoint.CheckpointManager` the loop uses (docs/architecture.md)."""

    def restore(self, state: dict[str, Any]) -> Any: ...

    def should_save(self, step: int) -> bool: ...

    def save(self, step: int, state: dict[str, Any], *, final: bool = False) -> Any: ...

    def close(self) -> None: ...


CheckpointFactory = Callable[[WorkerSpec, DistEnv, "str | None", MetricsSink], "CheckpointManagerLike | None"]


class ModelOptimizerState:
    """DCP Stateful of model + optimizer through `get_state_dict`/`set_state_dict`: the same keys for
    DDP, FSDP2 and a plain module, and DTensor shards that DCP reshards to a new world size."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


class TrainerProgress:
    """DCP Stateful of the loop's position: everything else is derived from it.

    Attributes:
        step: Optimizer steps completed.
        cursor: Global samples consumed (the sampler's whole state, see `training.data`).
        world_size: World size when saved (a restore at another size is a resize).
        lr_step: Step the LR schedule is at (equals `step`; kept for readers of checkpoints).
        loss: This rank's loss of the last completed step (so a restored, finished run reports it).
        scaler: fp16 gradient scaler state (empty otherwise).
    """

    def __init__(self, scaler: torch.amp.GradScaler | None = None) -> None:
        self.step = 0
        self.cursor = 0
        self.world_size = 0
        self.loss = float("nan")
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {
            "step": self.step,
            "cursor": self.cursor,
            "world_size": self.world_size,
            "lr_step": self.step,
            "loss": self.loss,
        }
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.cursor = int(state_dict["cursor"])
        self.world_size = int(state_dict["world_size"])
        self.loss = float(state_dict["loss"])
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the RNG for (seed, step, rank): dropout and any other per-step randomness."""
    return (seed * 1_000_003 + step * 65_537 + rank) % (2**63 - 1)


def params_sha256(state_dict: Mapping[str, Any]) -> str:
    """SHA-256 of the tensors of a full state dict, as raw bytes in sorted key order."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        value = state_dict[key]
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def seed_step_rng(seed: int, device: torch.device) -> None:
    """Seed the generators a step draws from (dropout etc.): the CPU default generator, and the current
    CUDA device's on GPU.

    Not `torch.manual_seed`: on a machine where CUDA is not initialised it queues a lazy seeding call
    with a captured stack trace for every device backend, about 1 ms per call here (20% of a small
    model's step) and a queue that grows every step.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)  # CUDA is initialised by now: applied at once, nothing queued


def _configure_determinism(deterministic: bool) -> None:
    if deterministic:
        # cuBLAS needs a fixed workspace for deterministic GEMMs; must be set before CUDA initialises.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if "torch._inductor.config" in sys.modules:
            torch.use_deterministic_algorithms(True)
        else:
            # `use_deterministic_algorithms` also imports torch._inductor only to set its config flag:
            # 1.7 s at every worker start (every recovery). Inductor reads the same flag from this
            # variable when (if ever) a task compiles something.
            os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")
            torch._C._set_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class _BatchIndices:
    """Batch sampler over the endless micro-batch stream of this rank (DataLoader needs an iterable)."""

    def __init__(self, order: GlobalOrder, plan: StepPlan, rank: int, cursor: int) -> None:
        self.order, self.plan, self.rank, self.cursor = order, plan, rank, cursor

    def __iter__(self) -> Iterator[list[int]]:
        return micro_batches(self.order, self.plan, self.rank, self.cursor)


def _default_checkpoint_manager(
    spec: WorkerSpec, env: DistEnv, run_dir: str | None, sink: MetricsSink
) -> CheckpointManagerLike | None:
    try:
        from training.checkpoint import CheckpointContext, CheckpointManager
    except ImportError:
        log.warning("training.checkpoint.CheckpointManager is not available: this run saves no checkpoints")
        return None
    ctx = CheckpointContext(
        job=spec.name,
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        node_rank=env.node_rank,
        num_nodes=env.num_nodes,
        generation=env.generation,
        run_dir=run_dir,
        run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""),
    )
    manager: CheckpointManagerLike = CheckpointManager(spec.spec.checkpoint, ctx, sink)
    return manager


def _create_sink(spec: WorkerSpec, info: RunInfo) -> MetricsSink:
    from training.metrics import create_sinks

    return create_sinks(spec, info)


def run_worker(spec: WorkerSpec, *, run_dir: str | None, dist: DistEnv | None = None) -> dict[str, Any]:
    """Train one worker of the job to `training.steps` and return its result.

    Args:
        spec: The resolved job (`training.config.load_worker_spec`).
        run_dir: The run directory (events, metrics, result.json, relative checkpoint stores); None
            writes no files and resolves relative stores against the working directory.
        dist: This rank's coordinates. None reads the launcher's environment (torchrun / PyTorchJob /
            none). Ray Train passes one built from `ray.train.get_context()`; a process group that
            already exists (Ray Train creates it) is reused, never re-created or destroyed.

    Returns:
        The `result.json` fields (`steps, final_loss, eval, params_sha256, world_size, samples_per_s,
        wall_s`), on every rank.

    Raises:
        training.task.TaskLoadError: `task.entrypoint`/`task.args` do not give a Task.
    """
    return _run(spec, run_dir=run_dir, env=dist if dist is not None else detect_env())


def _run(
    spec: WorkerSpec,
    *,
    run_dir: str | None,
    env: DistEnv,
    checkpoint_factory: CheckpointFactory = _default_checkpoint_manager,
) -> dict[str, Any]:
    wall_start = time.perf_counter()
    cfg = spec.spec.training
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    info = RunInfo(
        job=spec.name,
        rank=env.rank,
        local_rank=env.local_rank,
        node_rank=env.node_rank,
        world_size=env.world_size,
        local_world_size=env.local_world_size,
        generation=env.generation,
        run_dir=run_dir,
        node=socket.gethostname(),
    )
    sink = _create_sink(spec, info)
    sink.on_start(info)
    watchdog = StepWatchdog(spec.spec.restarts.step_timeout_seconds, sink).start()
    faults = FaultInjector.from_env(rank=env.rank, generation=env.generation, events=sink)
    created_group = False
    mgr: CheckpointManagerLike | None = None
    try:
        _configure_determinism(cfg.deterministic)
        device = device_for(env)
        created_group = init_process_group(env, device)
        task = load_task(spec.spec.task.entrypoint, spec.spec.task.args)

        torch.manual_seed(cfg.seed)  # identical initial weights on every rank, in every generation
        model = task.build_model()
        par = parallelize(model, task.blocks(model), cfg, env, device)
        optimizer = build_optimizer(par.model, cfg.optimizer)
        progress = TrainerProgress(par.scaler)
        state: dict[str, Any] = {"app": ModelOptimizerState(par.model, optimizer), "trainer": progress}

        mgr = checkpoint_factory(spec, env, run_dir, sink)
        if mgr is not None:
            restored = mgr.restore(state)
            if restored is not None:
                log.info(
                    "rank %d: resumed at step %d (saved at world size %d, now %d)",
                    env.rank,
                    progress.step,
                    progress.world_size,
                    env.world_size,
                )
        watchdog.beat(progress.step)

        train_result = _train(spec, task, par, optimizer, progress, state, mgr, env, sink, faults, watchdog)
        watchdog.beat(progress.step)
        eval_metrics: dict[str, float] = {}
        if cfg.eval_at_end:
            eval_metrics = evaluate(task, par, env, cfg.eval_batch_size)
            if eval_metrics:
                sink.on_eval(progress.step, eval_metrics)
        watchdog.beat(progress.step)
        if mgr is not None:
            mgr.close()
            mgr = None
        digest = _full_params_sha256(par)
        result: dict[str, Any] = {
            "steps": progress.step,
            "final_loss": train_result["final_loss"],
            "eval": eval_metrics,
            "params_sha256": digest,
            "world_size": env.world_size,
            "samples_per_s": train_result["samples_per_s"],
            "wall_s": time.perf_counter() - wall_start,
        }
        if env.rank == 0 and run_dir is not None:
            tmp = Path(run_dir) / "result.json.tmp"
            tmp.write_text(json.dumps(result, indent=2) + "\n")
            tmp.replace(Path(run_dir) / "result.json")
        sink.on_event("finished", step=progress.step, final_loss=result["final_loss"], wall_s=result["wall_s"])
        if env.rank == 0:
            print(
                f"torchrig: finished {progress.step} steps, loss {result['final_loss']}, eval {eval_metrics}, "
                f"params_sha256 {digest[:16]}",
                file=sys.stderr,
                flush=True,
            )
        return result
    finally:
        if mgr is not None:
            try:
                mgr.close()
            except Exception:
                log.exception("closing the checkpoint manager failed")
        watchdog.stop()
        sink.close()
        if created_group and tdist.is_initialized():
            tdist.destroy_process_group()


def _train(
    spec: WorkerSpec,
    task: Task,
    par: Parallel,
    optimizer: torch.optim.Optimizer,
    progress: TrainerProgress,
    state: dict[str, Any],
    mgr: CheckpointManagerLike | None,
    env: DistEnv,
    sink: MetricsSink,
    faults: FaultInjector,
    watchdog: StepWatchdog,
) -> dict[str, Any]:
    cfg = spec.spec.training
    ckpt_cfg = spec.spec.checkpoint
    log_every = spec.spec.metrics.log_every
    dataset = task.train_dataset()
    order = GlobalOrder(len(dataset), cfg.seed)  # type: ignore[arg-type]
    plan = StepPlan(env.world_size, cfg.batch_size, cfg.grad_accumulation)
    if progress.world_size and progress.world_size != env.world_size:
        log.info(
            "rank %d: world size changed %d -> %d at step %d",
            env.rank,
            progress.world_size,
            env.world_size,
            progress.step,
        )
    progress.world_size = env.world_size
    loader = DataLoader(
        dataset,
        batch_sampler=_BatchIndices(order, plan, env.rank, progress.cursor),
        collate_fn=task.collate,
        num_workers=cfg.num_workers,
        persistent_workers=False,
    )
    batches = iter(loader)
    tokens_per_sample = task.tokens_per_sample()
    flops_per_sample = task.flops_per_sample()
    samples_per_rank = cfg.batch_size * cfg.grad_accumulation
    par.model.train()

    first_step = progress.step
    train_s = 0.0
    for step in range(progress.step + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        lr = lr_at(step - 1, env.world_size, cfg.optimizer.lr, cfg.steps, cfg.lr_schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        seed_step_rng(step_seed(cfg.seed, step, env.rank), par.device)
        data_wait = 0.0
        loss_sum = torch.zeros((), device=par.device)
        par.comm.take()
        for micro in range(cfg.grad_accumulation):
            td = time.perf_counter()
            batch = _to_device(next(batches), par.device)
            data_wait += time.perf_counter() - td
            with par.micro_step(sync=micro == cfg.grad_accumulation - 1):
                loss = task.loss(par.model, batch) / cfg.grad_accumulation
                if par.scaler is not None:
                    par.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
                else:
                    loss.backward()  # type: ignore[no-untyped-call]
            loss_sum += loss.detach().float()
        grad_norm: float | None = None
        if par.scaler is not None:
            par.scaler.unscale_(optimizer)
        if cfg.grad_clip is not None:
            grad_norm = clip_grad_norm(par, cfg.grad_clip)
        if par.scaler is not None:
            par.scaler.step(optimizer)
            par.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = progress.loss = float(loss_sum)
        delay = faults.step_delay(step)
        if delay:
            time.sleep(delay)
        progress.step = step
        progress.cursor += plan.global_batch
        step_s = time.perf_counter() - t0
        train_s += step_s
        watchdog.beat(step)
        sink.on_step(
            StepRecord(
                step=step,
                loss=loss_value,
                samples=samples_per_rank,
                tokens=samples_per_rank * tokens_per_sample,
                step_s=step_s,
                data_wait_s=data_wait,
                comm_s=par.comm.take(),
                world_size=env.world_size,
                lr=lr,
                time=time.time(),
                flops=samples_per_rank * flops_per_sample,
                grad_norm=grad_norm,
            )
        )
        if env.rank == 0 and (step % log_every == 0 or step == cfg.steps):
            print(
                f"torchrig: step {step}/{cfg.steps} loss {loss_value:.4f} lr {lr:.3g} {step_s * 1000:.0f} ms",
                file=sys.stderr,
                flush=True,
            )
        faults.after_step(step)
        if mgr is not None:
            final = step == cfg.steps and ckpt_cfg.save_final
            if final or mgr.should_save(step):
                mgr.save(step, state, final=final)
                faults.after_save_staged(step)
                watchdog.beat(step)

    # The reported loss is the mean over ranks of the last step (one collective, at the end only).
    loss_value = progress.loss
    final_loss = torch.tensor([loss_value], dtype=torch.float64)
    if env.world_size > 1 and tdist.is_initialized():
        final_loss = final_loss.to(par.device)
        tdist.all_reduce(final_loss)
        final_loss /= env.world_size
    steps_run = progress.step - first_step
    return {
        "final_loss": float(final_loss.item()) if math.isfinite(loss_value) else None,
        "samples_per_s": steps_run * plan.global_batch / train_s if train_s > 0 else None,
    }


def evaluate(task: Task, par: Parallel, env: DistEnv, batch_size: int) -> dict[str, float]:
    """Held-out metrics across all ranks: each rank evaluates a strided shard, the sums are combined.

    Every rank runs the same number of forward passes (FSDP's forward is collective), padding with a
    discarded repeat of a real batch where its shard is shorter.
    """
    dataset = task.eval_dataset()
    if dataset is None:
        return {}
    n = len(dataset)  # type: ignore[arg-type]
    mine = list(range(env.rank, n, env.world_size))
    per_rank = math.ceil(n / env.world_size)
    num_batches = math.ceil(per_rank / batch_size)
    model = par.eval_model()
    was_training = model.training
    model.eval()
    totals: dict[str, float] = {}
    with torch.no_grad(), par.eval_autocast():
        for b in range(num_batches):
            idx = mine[b * batch_size : (b + 1) * batch_size]
            real = bool(idx)
            if not real:
                idx = [0]
            batch = _to_device(task.collate([dataset[i] for i in idx]), par.device)
            out = task.evaluate(model, batch)
            if real:
                for key, value in out.items():
                    totals[key] = totals.get(key, 0.0) + float(value)
    model.train(was_training)
    if env.world_size > 1 and tdist.is_initialized():
        gathered: list[dict[str, float] | None] = [None] * env.world_size
        tdist.all_gather_object(gathered, totals)
        totals = {}
        for part in gathered:
            for key, value in (part or {}).items():
                totals[key] = totals.get(key, 0.0) + value
    return task.summarize(totals)


def _full_params_sha256(par: Parallel) -> str:
    """Gather the full model state dict (collective; rank 0 gets it on the CPU) and hash it there."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    distributed = tdist.is_initialized() and tdist.get_world_size() > 1
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(par.model, options=options)
    digest = params_sha256(sd) if not distributed or tdist.get_rank() == 0 else ""
    if distributed:
        holder = [digest]
        tdist.broadcast_object_list(holder, src=0)
        digest = holder[0]
    return digest
