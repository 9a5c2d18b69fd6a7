"""The function Ray Train's `TorchTrainer` runs on every worker: the torchrig worker, under Ray.

Ray Train has already created the default process group when `train_loop_per_worker` starts; this
module only translates `ray.train.get_context()` into a `training.contract.WorkerIdentity` and calls
`training.worker.run_worker`, which reuses that group. The torchrig checkpoint manager stays the
source of truth: every restarted worker group restores the newest committed torchrig checkpoint
itself, and the `ray.train.report` at the end carries the last committed step and store URIs as
metrics only. No Ray Checkpoint is reported, so Ray never holds a second copy of the state.

The driver's run directory need not be rank 0's (a RayJob's head and workers each have their own), so
rank 0 also hands its result and the events the summary needs (`training.contract.WorkerReport`) to
the run's ledger actor, which the driver reads after `fit()`. Not through `ray.train.report`: Ray
Train v2 keeps only the metrics reported with a checkpoint (`Result.metrics` is the latest
checkpoint's, None without one), and `Result.return_value` exists only in Ray releases newer than the
oldest torchrig supports (ray-project/ray#62021).

Preemption (`training.preemption`): the training function runs in a thread of the worker actor, where
Python cannot install a signal handler, and the actor's main thread sits in Ray's task loop with Ray's
own SIGTERM handler (`Worker.main_loop`: exit the process at once). `run_on_actor_main_thread` runs the
handler's installation on that main thread as an actor task (`__ray_call__`; Ray Train's worker actor
runs one task at a time on its main thread, which it leaves free while the training thread runs), so a
SIGTERM to a Ray Train worker process becomes the agreed stop step and the emergency checkpoint like
under torchrun; Ray's handler comes back when the worker ends without a signal. The training function
then raises `PreemptedExit`: Ray Train counts a worker failure and restarts the group
(`restarts.max`), which restores the emergency checkpoint, or, with no restart left, the run ends
(summary `preempted`) with that checkpoint committed, and a new run of the job resumes from it.
A node drain (Ray Train's `get_preemption_info`, e.g. a spot reclaim with its deadline) is the same
notice without a signal: `ray_drain_notice` is polled every `metrics.logEvery` steps on every rank.
(`worker_process_setup_hook` would not do: it runs before `main_loop`, which installs Ray's handler
over it.)

`ray` is imported inside functions only: `training` must stay importable without Ray.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from training.contract import Env, EventKind, Result, RunFiles, WorkerIdentity, WorkerReport, read_events

__all__ = [
    "LEDGER_CALL_TIMEOUT_S",
    "create_run_ledger",
    "last_committed_checkpoint",
    "ray_drain_notice",
    "run_on_actor_main_thread",
    "train_loop_per_worker",
]

LEDGER_CALL_TIMEOUT_S = 60.0  # a call on the ledger actor (a few bytes in memory): past this, Ray is broken
MAIN_THREAD_CALL_TIMEOUT_S = 60.0  # a task on this worker's own actor (its main thread is idle): past it, broken

_pending: dict[int, Callable[[], None]] = {}  # calls handed to the actor's main thread (same process)


def _call_pending(actor: Any, key: int) -> None:
    """Runs on the worker actor's main thread (`__ray_call__`): the function registered under `key`."""
    _pending.pop(key)()


def run_on_actor_main_thread(fn: Callable[[], None]) -> None:
    """Run `fn` on the main thread of this Ray Train worker's process and wait for it.

    `fn` stays in this process: only a key travels through Ray (the actor task runs in the same
    process, where `_pending` holds it), so it may close over anything, signal handlers included.
    """
    import ray

    key = id(fn)
    _pending[key] = fn
    try:
        actor = ray.get_runtime_context().current_actor
        ray.get(actor.__ray_call__.remote(_call_pending, key), timeout=MAIN_THREAD_CALL_TIMEOUT_S)
    finally:
        _pending.pop(key, None)


def ray_drain_notice() -> float | None:
    """Seconds until Ray reclaims a node of this worker group, or None while none is announced.

    Ray Train's `get_preemption_info` (a node being drained, e.g. a spot reclaim, with its deadline;
    Ray Train's watcher polls the draining nodes every few seconds). It is a barrier across the group's
    workers, so every rank must call it at the same steps (`PreemptionHandler.watch_notice` does).
    """
    import ray.train

    get = getattr(ray.train, "get_preemption_info", None)
    if get is None:
        return None  # a Ray without the API
    info = get()
    if info is None:
        return None
    if info.deadline_ms is None:
        return float("inf")  # announced without a deadline: the grace period applies
    return max(0.0, float(info.deadline_ms) / 1000.0 - time.time())


def create_run_ledger() -> Any:
    """A Ray actor that outlives the run's worker groups: their start count and rank 0's last report.

    Created by the driver (so it lives as long as the run, on any node), passed to the workers in
    `train_loop_config["run_ledger"]`. Rank 0 of each new group takes the next generation number and
    broadcasts it (Ray Train has no public restart count), so drill faults aimed at generation 0 fire
    once and a restarted group is generation 1; when its worker ends, rank 0 leaves its
    `WorkerReport` there (`put_report`) and the driver reads the last one (`get_report`).
    """
    import ray

    class RunLedger:
        def __init__(self) -> None:
            self.generation = -1
            self.report: dict[str, Any] | None = None

        def next_generation(self) -> int:
            self.generation += 1
            return self.generation

        def put_report(self, report: dict[str, Any]) -> None:
            self.report = report

        def get_report(self) -> dict[str, Any] | None:
            return self.report

    actor: Any = ray.remote(num_cpus=0)(RunLedger)
    return actor.remote()


def _agree_generation(ledger: Any, rank: int) -> int:
    """Rank 0 draws the generation; every rank receives it over the group Ray Train created."""
    import torch
    import torch.distributed as dist

    value = 0
    if rank == 0 and ledger is not None:
        import ray

        value = int(ray.get(ledger.next_generation.remote(), timeout=LEDGER_CALL_TIMEOUT_S))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        import ray.train.torch

        device = ray.train.torch.get_device()
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def last_committed_checkpoint(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """`{checkpoint_step, checkpoint_stores}` of the newest `checkpoint_committed` event (empty if none)."""
    best: dict[str, Any] = {}
    for event in read_events(RunFiles(run_dir).events):  # a torn last line from a killed writer is skipped
        if event.kind is not EventKind.CHECKPOINT_COMMITTED or event.step is None:
            continue
        if event.step >= int(best.get("checkpoint_step", -1)):
            best = {"checkpoint_step": event.step, "checkpoint_stores": list(event.get("stores_ok") or [])}
    return best


def _hand_over(ledger: Any, run_dir: str, result: dict[str, Any] | None) -> None:
    """Rank 0: leave its `WorkerReport` with the ledger for the driver (best effort: never fails the run)."""
    import ray

    try:
        report = WorkerReport.collect(run_dir, result=Result.from_dict(result) if result is not None else None)
        ray.get(ledger.put_report.remote(report.to_dict()), timeout=LEDGER_CALL_TIMEOUT_S)
    except Exception as exc:  # the driver then summarizes from its own run directory only
        print(f"torchrig: rank 0 could not hand its result to the driver: {exc!r}", file=sys.stderr)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry of one rank.

    Args:
        config: `spec_yaml` (the resolved job file's text), `run_dir` (absolute; shared by the ranks of
            one node), `run_ledger` (optional actor from `create_run_ledger`), and `store_uris`
            (`{name: resolved uri}` of the checkpoint stores, reported as metrics).
    """
    import ray.train

    from training.config import load_worker_spec
    from training.worker import run_worker

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    world_size = ctx.get_world_size()
    local_world_size = ctx.get_local_world_size()
    ledger = config.get("run_ledger")
    generation = _agree_generation(ledger, rank)
    run_dir = str(config["run_dir"])
    os.environ[Env.RUN_DIR] = run_dir
    identity = WorkerIdentity(
        rank=rank,
        world_size=world_size,
        local_rank=ctx.get_local_rank(),
        local_world_size=local_world_size,
        node_rank=ctx.get_node_rank(),
        num_nodes=max(1, -(-world_size // max(local_world_size, 1))),
        generation=generation,
    )
    spec = load_worker_spec(str(config["spec_yaml"]))
    result: dict[str, Any] | None = None
    try:
        result = run_worker(
            spec,
            run_dir=run_dir,
            identity=identity,
            on_main_thread=run_on_actor_main_thread,
            preemption_notice=ray_drain_notice,
        )
    finally:
        if rank == 0 and ledger is not None:  # also when training raised: the restores and commits so far
            _hand_over(ledger, run_dir, result)
    metrics: dict[str, Any] = {key: value for key, value in result.items() if isinstance(value, (int, float, str))}
    metrics.update({f"eval_{k}": v for k, v in (result.get("eval") or {}).items()})
    metrics["generation"] = generation
    checkpoint = last_committed_checkpoint(run_dir)
    stores: dict[str, str] = dict(config.get("store_uris") or {})
    if checkpoint:
        metrics["checkpoint_step"] = checkpoint["checkpoint_step"]
        names = checkpoint["checkpoint_stores"] or list(stores)
        metrics["checkpoint_uris"] = ",".join(stores.get(name, name) for name in names)
    # Every rank reports once (the call is a barrier); metrics only, no Ray Checkpoint.
    ray.train.report(metrics)
