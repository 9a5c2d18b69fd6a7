"""Checks that fail a job at once, before any restart is spent on an error no restart can fix.

A typo in `task.entrypoint` or a GPU job on a node without CUDA fails the same way on every attempt;
under torchrun each attempt costs a rendezvous and a restart, and the cause ends up in a worker log. So
every compiled command starts with `python -m training.launch` (`training.launch`), which runs
`preflight` and only then execs torchrun (or the Ray entry): a deterministic error exits the container
with a permanent code (`training.contract.ExitCode`: 2 or 3) and one line naming the field.

What is checked, in this order, cheapest first:

1. the run directory and every `file://` store root (and the node-local directory) can be created and
   written: `ENVIRONMENT`. Object stores are not contacted (a network call at start-up is neither cheap
   nor deterministic);
2. no `file://` store holds another job's writer fence (`<root>/fences/<n>.json`): two jobs in one store
   would collide on its `step-N` directories, and the second would silently fail to commit every step
   the first already holds: `TASK_INVALID` (give the job its own store, or read the other job's
   checkpoint with `checkpoint.initFrom`);
3. with `TORCHRIG_CHECKPOINT_KEY` set (and `checkpoint.resume` not `never`), no `file://` store holds this
   job's checkpoints only under another key (manifests that name this job but fail their signature, and
   not one that passes): `ENVIRONMENT`. Else the restore would find nothing it may load and the job
   would be stopped there, after the rendezvous (`training.checkpoint.results.CheckpointKeyError`);
4. `task.entrypoint` imports and `task.args` build a Task: `TASK_INVALID`;
5. with `resources.gpus > 0`, CUDA is available with that many devices: `ENVIRONMENT`.

Anything else a check raises is not a verdict: it propagates, and the launcher lets the job start (the
worker meets the same error and the launcher's restarts handle it as any other failure).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path

from training.config import WorkerSpec
from training.contract import Env, ExitCode

__all__ = [
    "PreflightError",
    "check_checkpoint_key",
    "check_gpus",
    "check_store_owners",
    "check_stores",
    "check_task",
    "preflight",
]

_FENCE_NAME = re.compile(r"^\d{8,}\.json$")  # training.checkpoint.fence's objects (no torch import here)
_FENCE_MAX_BYTES = 64 * 1024


class PreflightError(Exception):
    """A deterministic startup error: the job cannot run as written, or not on this machine.

    Attributes:
        exit_code: `ExitCode.TASK_INVALID` or `ExitCode.ENVIRONMENT` (both permanent).
    """

    def __init__(self, exit_code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _check_writable(directory: Path, field: str) -> None:
    probe = directory / f".torchrig-preflight-{uuid.uuid4().hex[:8]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise PreflightError(
            ExitCode.ENVIRONMENT, f"{field}: cannot create or write {str(directory)!r} here: {reason}"
        ) from None


def _check_fsspec_backend(scheme: str, field: str) -> None:
    """fsspec has an implementation of `scheme` here (`gs://` needs gcsfs, `s3://` s3fs, `az://` adlfs):
    without it every save and restore fails, and each restart fails the same way."""
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise PreflightError(
            ExitCode.ENVIRONMENT, f"{field}: no {scheme}:// support on this machine: {reason}"
        ) from None


def check_stores(spec: WorkerSpec, run_dir: str | None) -> None:
    """The run directory, each `file://` store root and the node-local directory are writable, and fsspec
    can open every object store's scheme (its package is installed; the store itself is not contacted:
    a store out of reach is one the run goes on without, `lose-store`).

    Raises:
        PreflightError: `ENVIRONMENT`, naming the store's field.
    """
    if run_dir is not None:
        _check_writable(Path(run_dir), "run directory")
    ckpt = spec.spec.checkpoint
    for i, store in enumerate(ckpt.stores):
        field = f"spec.checkpoint.stores[{i}].uri ({store.uri})"
        if store.kind.filesystem:
            path = store.resolved_uri(run_dir).removeprefix("file://")
            _check_writable(Path(path), field)
        else:
            _check_fsspec_backend(store.scheme, field)
    if ckpt.node_local.enabled:
        _check_writable(Path(ckpt.node_local.path), "spec.checkpoint.nodeLocal.path")


def _fence_jobs(root: Path) -> dict[str, str]:
    """The jobs named by the writer fences under `root/fences/`: job -> the first fence file naming it."""
    jobs: dict[str, str] = {}
    try:
        names = sorted(os.listdir(root / "fences"))
    except OSError:
        return jobs
    for name in names:
        path = root / "fences" / name
        if not _FENCE_NAME.match(name) or path.is_symlink() or not path.is_file():
            continue
        try:
            if path.stat().st_size > _FENCE_MAX_BYTES:
                continue
            job = json.loads(path.read_bytes()).get("job")
        except (OSError, ValueError, AttributeError):
            continue  # unreadable: the checkpoint manager warns about it
        if isinstance(job, str) and job:
            jobs.setdefault(job, f"fences/{name}")
    return jobs


def check_store_owners(spec: WorkerSpec, run_dir: str | None) -> None:
    """No `file://` store is already another job's: its fences name only this job (or none).

    Raises:
        PreflightError: `TASK_INVALID`, naming the store's field and the other job.
    """
    for i, store in enumerate(spec.spec.checkpoint.stores):
        if not store.kind.filesystem:
            continue
        root = Path(store.resolved_uri(run_dir).removeprefix("file://"))
        others = {job: where for job, where in _fence_jobs(root).items() if job != spec.name}
        if not others:
            continue
        job, where = sorted(others.items())[0]
        more = f" (and {len(others) - 1} more)" if len(others) > 1 else ""
        raise PreflightError(
            ExitCode.TASK_INVALID,
            f"spec.checkpoint.stores[{i}].uri: {store.uri} is already used by job {job!r}{more} ({where}); "
            f"two jobs in one store collide on its step directories: give job {spec.name!r} its own store "
            "(another path or prefix), or start from that job's checkpoint with spec.checkpoint.initFrom",
        )


def check_checkpoint_key(spec: WorkerSpec, run_dir: str | None, env: dict[str, str] | None = None) -> None:
    """This job's checkpoints in `file://` stores are not all signed with another key than the one set.

    Raises:
        PreflightError: `ENVIRONMENT`, naming `TORCHRIG_CHECKPOINT_KEY`, the store and the steps.
    """
    from training.checkpoint_config import ResumePolicy

    ckpt = spec.spec.checkpoint
    if not (os.environ if env is None else env).get(Env.CHECKPOINT_KEY) or ckpt.resume is ResumePolicy.never:
        # No key (`signing_key_from_env`: None when unset or empty): nothing to check, and no import of the
        # checkpoint stack (DCP, torch._dynamo: 0.6 s of CPU on the way to a local run's store, docs/performance.md).
        return
    from training.checkpoint.manifest import list_checkpoints
    from training.checkpoint.signing import signing_key_from_env
    from training.checkpoint.storage import open_storage

    key = signing_key_from_env(env)
    if key is None:
        return
    wrong: list[tuple[int, str, list[int]]] = []
    for i, store in enumerate(ckpt.stores):
        if not store.kind.filesystem:
            continue
        try:
            listing = list_checkpoints(open_storage(store.resolved_uri(run_dir)), key=key)
        except (OSError, ValueError):
            continue  # not listable (yet): the worker reports it
        if any(c.manifest is not None and c.manifest.job == spec.name for c in listing):
            return  # a checkpoint of this job that the key verifies: the restore has one to take
        steps = [c.step for c in listing if c.untrusted and c.claimed_job == spec.name]
        if steps:
            wrong.append((i, store.uri, steps))
    if wrong:
        i, uri, steps = wrong[0]
        shown = ", ".join(map(str, sorted(steps, reverse=True)[:5])) + (" ..." if len(steps) > 5 else "")
        raise PreflightError(
            ExitCode.ENVIRONMENT,
            f"{Env.CHECKPOINT_KEY}: job {spec.name!r}'s checkpoints in spec.checkpoint.stores[{i}] ({uri}, "
            f"steps {shown}) fail their signature check with this key: they were signed with another key (or "
            "forged); set the key that signed them, or checkpoint.resume: never to start fresh on purpose",
        )


def check_task(spec: WorkerSpec) -> None:
    """`task.entrypoint` imports and returns a Task for `task.args`.

    Raises:
        PreflightError: `TASK_INVALID`, with `training.task.load_task`'s message; the factory raising
            ValueError, TypeError or LookupError for the given arguments counts too.
    """
    from training.task import TaskLoadError, load_task

    task = spec.spec.task
    try:
        load_task(task.entrypoint, task.args)
    except TaskLoadError as exc:
        # The job file's path to the field (the loader's message names it relative to `spec`).
        message = str(exc)
        raise PreflightError(
            ExitCode.TASK_INVALID, message if message.startswith("spec.") else f"spec.{message}"
        ) from None
    except (ValueError, TypeError, LookupError) as exc:
        raise PreflightError(
            ExitCode.TASK_INVALID, f"spec.task.args: {task.entrypoint} rejected them: {type(exc).__name__}: {exc}"
        ) from None


def _torch_cuda() -> tuple[bool, int]:
    import torch

    available = torch.cuda.is_available()
    return available, torch.cuda.device_count() if available else 0


def check_gpus(spec: WorkerSpec, probe: Callable[[], tuple[bool, int]] = _torch_cuda) -> None:
    """With `resources.gpus > 0`, CUDA is available and shows at least that many devices.

    Args:
        spec: the job.
        probe: returns (CUDA available, device count); tests pass a fake.

    Raises:
        PreflightError: `ENVIRONMENT`.
    """
    wanted = spec.spec.resources.gpus
    if wanted <= 0:
        return
    available, count = probe()
    if not available:
        raise PreflightError(
            ExitCode.ENVIRONMENT,
            f"spec.resources.gpus: the job needs {wanted} GPU(s) per node but CUDA is not available here "
            "(no GPU, no driver, or a CPU-only torch); run it where GPUs are, or set spec.resources.gpus: 0",
        )
    if count < wanted:
        raise PreflightError(
            ExitCode.ENVIRONMENT,
            f"spec.resources.gpus: the job needs {wanted} GPU(s) per node but only {count} are visible here",
        )


def preflight(spec: WorkerSpec, *, run_dir: str | os.PathLike[str] | None = None, check_gpu: bool = True) -> None:
    """Fail fast on what no restart can fix: unwritable or foreign stores, a task that does not load, no CUDA.

    Args:
        spec: the job (`training.config.load_worker_spec`).
        run_dir: the run directory (relative `file://` stores resolve against it); None: the working
            directory, as the worker does without one.
        check_gpu: check CUDA. False where this process is not where the GPUs are: the head of a Ray
            cluster, whose GPU workers Ray places only on nodes that advertise GPUs.

    Raises:
        PreflightError: with a permanent `exit_code` and one line naming the field to change.
    """
    run_dir_s = None if run_dir is None else os.fspath(run_dir)
    check_stores(spec, run_dir_s)
    check_store_owners(spec, run_dir_s)
    check_checkpoint_key(spec, run_dir_s)
    check_task(spec)
    if check_gpu:
        check_gpus(spec)
