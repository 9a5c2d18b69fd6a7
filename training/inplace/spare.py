"""A warm spare: `python -m training` with `TORCHRIG_INPLACE_ROLE=spare`, started by the host of local
rank 0 (`training.inplace.host`).

It pays the start-up costs ahead of time (import torch and the training stack, load the task, build
the model with the job's seed), announces itself in the store (`spare<i>/ready` = its pid) and blocks
until a host assigns it a dead rank (`spare<i>/assign`: that rank's launcher variables and the
process-group generation to join). Then it becomes that rank: `run_worker` with the prebuilt pieces,
joining the new generation and receiving the trained state from a survivor instead of restoring a
checkpoint.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from training.config import Strategy, WorkerSpec
from training.contract import Env, WorkerIdentity
from training.contract.orders import Assignment
from training.inplace import FORGED_RETRY_S, InPlace
from training.inplace.group import freeze_heap
from training.inplace.protocol import Promote, SpareObservation, SpareState, StandDown, decide_spare
from training.optim import build_optimizer
from training.strategies import Parallel, ddp_wrap, parallelize
from training.task import load_task
from training.worker import Prewarmed, run_worker

__all__ = ["run_spare"]

log = logging.getLogger(__name__)


# One `wait` for the whole time a spare stands by: the store answers the moment the key is set. Below
# 2^31 ms, the longest timeout c10d's socket poll takes; a spare unused for that long ends, and its host
# starts another.
ASSIGN_WAIT = timedelta(days=24)


def _wait_assignment(inplace: InPlace, store: Any, index: int) -> Assignment:
    """Block until a host assigns this spare a rank (`spare<i>/assign`), and return the assignment.

    One blocking `TCPStore.wait` on a thread of its own, not a poll: polling every 10 ms made each
    idle spare 100 store requests a second, which at 1,000 nodes is the whole throughput of one
    TCPStore (docs/performance.md), and added 5 ms on average to a recovery. The main thread waits on
    an event in 1 s slices so that Python signal handlers still run; a spare whose host is gone is
    killed by the kernel (`training.entry.die_with_parent`), one whose store is gone sees the wait fail.

    An assignment that is not signed by this job, or not a valid one (`Assignment.parse`), is ignored
    (logged once): the spare goes on waiting, reading the key every `FORGED_RETRY_S` until the host's own
    assignment overwrites it.
    """
    key = inplace.spare_key(index, "assign")
    done = threading.Event()
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            store.wait([key], ASSIGN_WAIT)
        except BaseException as exc:  # the store is gone (the run ended) or the wait timed out
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=wait, name="torchrig-assign", daemon=True).start()
    while not done.wait(1.0):
        pass
    while True:
        assignment: Assignment | None = None
        try:
            if failed:
                raise failed[0]
            assignment = inplace.read_order(store, key, Assignment.parse)
            seen = SpareObservation(assigned=assignment is not None)
        except Exception as exc:
            failed[:] = [exc]
            seen = SpareObservation(store_failed=f"{type(exc).__name__}: {exc}")
        decision = decide_spare(SpareState.READY, seen)
        if isinstance(decision, Promote) and assignment is not None:
            return assignment
        if isinstance(decision, StandDown):
            raise failed[0]  # this process ends on the store's error (`training.entry`: the decision's code)
        time.sleep(FORGED_RETRY_S)


CONNECT_ATTEMPT_S = 5.0  # one attempt at the store; a spare retries until the in-place timeout


def _connect(inplace: InPlace) -> Any:
    """A client of the long-lived store, retried in short attempts: once in about eight 4-rank drills a
    spare sat in the client's connect for the whole in-place timeout while every other process of the
    run reached the store (cause not found); a fresh attempt after a few seconds gets through."""
    deadline = time.monotonic() + inplace.timeout_s
    while True:
        try:
            store = inplace.connect(timeout_s=CONNECT_ATTEMPT_S)
            store.set_timeout(timedelta(seconds=inplace.timeout_s))  # for what follows the connect
            return store
        except Exception as exc:  # c10d raises DistStoreError / RuntimeError on a timeout
            if time.monotonic() > deadline:
                raise
            log.warning("spare: connecting to the in-place store failed (%s); retrying", str(exc).splitlines()[0])


_REHEARSAL_GROUPS: list[Any] = []


def _rehearse(spec: WorkerSpec, task: Any, model: torch.nn.Module) -> None:
    """Pay every first-use cost of a step now, on a throwaway copy: the lazy imports of the checkpoint
    stack and DDP, the data pipeline, autograd and the optimizer's first step (seconds on a loaded
    machine, which would otherwise fall inside the recovery)."""
    import copy

    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks
    import torch.distributed.checkpoint.state_dict

    import training.checkpoint  # noqa: F401
    from training.data import to_device

    cfg = spec.spec.training
    try:
        dataset = task.train_dataset()
        batch = task.collate([dataset[i] for i in range(min(cfg.batch_size, len(dataset)))])
        scratch = copy.deepcopy(model)
        optimizer = build_optimizer(scratch, cfg.optimizer)
        # The strategy's first construction and step in a process (DDP; FSDP's fully_shard, its device
        # mesh and its hooks) cost about a second: rehearse them on a one-process group of its own (no
        # port), destroyed before the real generation forms.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
        # Kept for the process's life: when DDP's reducer dropped the last reference, gloo's destructor
        # joined its worker threads under the GIL while one waited for the GIL to drop the comm hook's
        # Python callback, and the spare deadlocked for good (once in ~100 spares). Held here, the group
        # outlives the reducer and is never destroyed (the process ends through `exit_now`).
        _REHEARSAL_GROUPS.append(dist.group.WORLD)
        try:
            if cfg.strategy is Strategy.ddp:
                par = Parallel(
                    model=scratch,
                    module=scratch,
                    strategy=cfg.strategy,
                    device=torch.device("cpu"),
                    precision=cfg.precision,
                )
                par.model = ddp_wrap(par)  # `parallelize` wraps only above one rank
            else:
                par = parallelize(scratch, task.blocks(scratch), cfg, WorkerIdentity(), torch.device("cpu"))
                optimizer = build_optimizer(par.model, cfg.optimizer)  # over the sharded parameters
            with par.micro_step(sync=True):
                loss = task.loss(par.model, to_device(batch, torch.device("cpu")))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        finally:
            dist.destroy_process_group()
    except Exception:  # only a warm-up: the real step will report any real problem
        log.debug("spare: the rehearsal step failed", exc_info=True)


def _preimport(spec: WorkerSpec) -> None:
    """Import now what the assigned rank's set-up imports: its metrics sinks (prometheus_client and the
    HTTP server behind its exporter), fsspec with each store's filesystem, torch's serialisation config.
    Measured before this: 54 modules imported after the assignment, 0.05-0.1 s of the spare's CPU inside
    the recovery, most of it before the spare joins the new generation, which every survivor waits for.
    The recovery event lists what a spare still imported (`Recovery.imports`)."""
    import encodings.idna  # noqa: F401  (the exporter's bind resolves its host name through it)
    import http.server  # noqa: F401
    import wsgiref.simple_server  # noqa: F401

    import fsspec
    import prometheus_client.exposition  # noqa: F401
    import torch.utils.serialization.config  # noqa: F401

    import training.metrics.gpu
    import training.metrics.jsonl
    import training.metrics.prometheus
    import training.metrics.trainer_status  # noqa: F401

    for store in spec.spec.checkpoint.stores:
        try:
            fsspec.get_filesystem_class(store.scheme)  # imports the implementation (s3fs for s3://), connects nowhere
        except (ImportError, ValueError):  # the store's own set-up reports it
            log.debug("spare: no fsspec filesystem for %r", store.scheme, exc_info=True)


def run_spare(spec: WorkerSpec, inplace: InPlace, *, run_dir: str) -> dict[str, Any]:
    """Warm up, wait for an assignment, then train as the assigned rank (see the module docstring)."""
    index = int(os.environ[Env.INPLACE_SPARE])
    cfg = spec.spec.training
    task = load_task(spec.spec.task.entrypoint, spec.spec.task.args)
    torch.manual_seed(cfg.seed)
    model = task.build_model()
    optimizer = build_optimizer(model, cfg.optimizer)  # the first optimizer imports torch._dynamo
    _rehearse(spec, task, model)
    _preimport(spec)
    gc.collect()  # the rehearsal's garbage, before the rest is frozen
    freeze_heap()  # a recovery's gc.collect then skips everything built so far
    try:
        store = _connect(inplace)
        inplace.write(store, inplace.spare_key(index, "ready"), str(os.getpid()))
    except Exception as exc:
        # Unreachable within the in-place timeout: the spare ends on the store's error (`training.entry`
        # exits with the decision's code, `TRAINING_FAILED`); its host's pool starts another.
        decision = decide_spare(SpareState.WARMING, SpareObservation(store_failed=f"{type(exc).__name__}: {exc}"))
        assert isinstance(decision, StandDown), decision
        raise
    log.info("spare %d: ready (pid %d)", index, os.getpid())
    assignment = _wait_assignment(inplace, store, index)
    assigned_at, assigned_cpu, modules = time.perf_counter(), time.thread_time(), frozenset(sys.modules)
    os.environ.update(assignment.env)  # this process IS that rank now (logs, identity, faults)
    identity = WorkerIdentity.from_env()
    log.info("spare %d: assigned rank %d, generation %d", index, identity.rank, assignment.generation)
    prewarmed = Prewarmed(
        task=task,
        model=model,
        optimizer=optimizer,
        generation=assignment.generation,
        assigned_at=assigned_at,
        assigned_cpu=assigned_cpu,
        modules=modules,
    )
    return run_worker(spec, run_dir=run_dir, identity=identity, prewarmed=prewarmed)
