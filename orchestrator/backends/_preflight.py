"""The preflight of a run that starts on this machine: fail before any process is spawned.

Compiled pods run `training.preflight` in their container (`python -m training.launch`); a local or
embedded-Ray run runs the same checks here, in the CLI's process, so a typo in `task.entrypoint` is
the CLI's last line at once instead of a restart loop and a path to a worker log.
"""

from __future__ import annotations

import os

from orchestrator.errors import BackendError, SpecError
from orchestrator.loader import dump_spec
from orchestrator.spec import JobSpec

__all__ = ["preflight_here"]


def preflight_here(spec: JobSpec, run_dir: str | os.PathLike[str] | None) -> None:
    """Run `training.preflight` for a run whose workers start on this machine.

    Raises:
        SpecError: the task does not load (exit 2, permanent).
        BackendError: this machine cannot run the job (a store cannot be written, no CUDA; exit 3).
    """
    from training.config import load_worker_spec
    from training.contract import ExitCode
    from training.preflight import PreflightError, preflight

    worker_spec = load_worker_spec(dump_spec(spec))
    try:
        preflight(worker_spec, run_dir=run_dir)
    except PreflightError as exc:
        if exc.exit_code == ExitCode.TASK_INVALID:
            raise SpecError(str(exc)) from None
        raise BackendError(str(exc)) from None
