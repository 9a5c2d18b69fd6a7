"""The preflight of a run that starts on this machine: fail before any process is spawned.

Compiled pods run `training.preflight` in their container (`python -m training.launch`); a local or
embedded-Ray run runs the same checks here, in the CLI's process, so a typo in `task.entrypoint` is
the CLI's last line at once instead of a restart loop and a path to a worker log.
"""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.errors import BackendError, SpecError
from orchestrator.loader import dump_spec, load_spec
from orchestrator.spec import JobSpec

__all__ = ["check_stores_not_in_use", "preflight_here"]


def check_stores_not_in_use(spec: JobSpec, run_dir: str | os.PathLike[str] | None) -> None:
    """Refuse a store a running local run (under `runs/`, `torchrig list`) writes to: two runs in one store
    fence each other, and the older one trains on with every checkpoint refused, to end `failed` (a job
    submitted twice by mistake). Runs of other machines cannot be seen from here; their fences still
    keep the store consistent.

    Raises:
        BackendError: naming the store and the running run (exit 3).
    """
    from orchestrator.backends.base import RunState
    from orchestrator.rundir import find_run_dirs, run_state
    from training.checkpoint_config import store_location

    mine = {store_location(s.resolved_uri(run_dir)): (i, s.uri) for i, s in enumerate(spec.spec.checkpoint.stores)}
    here = Path(run_dir).resolve() if run_dir is not None else None
    for other in find_run_dirs():
        if other.resolve() == here or run_state(other)[0] is not RunState.RUNNING:
            continue
        try:
            theirs = load_spec(other / "job.yaml", allow_inline_secrets=True)  # its run accepted them
        except SpecError:
            continue
        for store in theirs.spec.checkpoint.stores:
            hit = mine.get(store_location(store.resolved_uri(other)))
            if hit is not None:
                raise BackendError(
                    f"spec.checkpoint.stores[{hit[0]}].uri: {hit[1]} is in use by the running run {other} (job "
                    f"{theirs.name}): two runs writing one store fence each other and the older one's checkpoints "
                    f"are refused; cancel it (torchrig cancel {other}) or give this run another store"
                )


def preflight_here(spec: JobSpec, run_dir: str | os.PathLike[str] | None) -> None:
    """Run `training.preflight` for a run whose workers start on this machine.

    Raises:
        SpecError: the task does not load (exit 2, permanent).
        BackendError: this machine cannot run the job (a store cannot be written, no CUDA; exit 3).
    """
    from training.config import load_worker_spec
    from training.contract import ExitCode
    from training.preflight import PreflightError, preflight

    check_stores_not_in_use(spec, run_dir)
    worker_spec = load_worker_spec(dump_spec(spec))
    try:
        preflight(worker_spec, run_dir=run_dir)
    except PreflightError as exc:
        if exc.exit_code == ExitCode.TASK_INVALID:
            raise SpecError(str(exc)) from None
        raise BackendError(str(exc)) from None
