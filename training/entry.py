"""What a training process runs once it knows its role: a worker, or an in-place host's trainer or spare.

`python -m training` (`training.__main__`) loads the job and either becomes the rank's in-place host
(`training.inplace.host`) or runs its role here. The host's children run `main` here directly, whether
forked from its warm interpreter (`training.inplace.forked`) or started as `python -m training` with
`TORCHRIG_INPLACE_ROLE` set; so the host starts its children without importing the command line that
made it a host, and nothing in this module imports the host.

The spec comes from `--spec` or `TORCHRIG_SPEC`; the run directory from `--run-dir`,
`TORCHRIG_RUN_DIR`, or `runs/<job name>` under the working directory (the same for every rank, so
relative checkpoint stores and `events.jsonl` are shared). Exit codes (`training.contract.ExitCode`,
Kubeflow's convention: 1-127 permanent, 128+ retryable): 0 success; 2 bad spec or task (one line on
stderr, no traceback); 200 training failed (an exception: retryable, a survivor of a lost peer raises
one too); 201 the step watchdog ended a hung rank (see `training.watchdog`); 202 preempted (SIGTERM:
stopped at an agreed step after an emergency checkpoint, `training.preemption`); 203 in-place
recovery failed (`training.inplace`: the group restarts); 205 a checkpoint store could not be read at
restore and none that could holds a checkpoint of the job (`training.checkpoint.restore`); 206 the
data-parallel replicas disagreed (`training.sdc`: the group restarts from the newest certified
checkpoint); 207 the replicas' majority named this rank the suspect and the job recovers in place (it
leaves, a warm spare takes its rank, the others roll back: `training.inplace.protocol.decide_sdc`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

from training.contract import Env, ExitCode

if TYPE_CHECKING:
    from training.config import WorkerSpec

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "Invocation",
    "die_with_parent",
    "load_invocation",
    "main",
    "run",
    "run_role",
]

EXIT_OK = int(ExitCode.OK)
EXIT_FAILED = int(ExitCode.TRAINING_FAILED)
EXIT_USAGE = int(ExitCode.TASK_INVALID)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Invocation:
    """One `python -m training` process: its job, where it came from, its run directory and its role.

    Attributes:
        spec: The validated job.
        spec_path: The job file as given (named in a bad task's message).
        run_dir: The run directory.
        role: `TORCHRIG_INPLACE_ROLE` (`training.inplace.ROLE_TRAINER` or `ROLE_SPARE`): this process is an
            in-place host's child; empty when it is not.
    """

    spec: WorkerSpec
    spec_path: str
    run_dir: str
    role: str


def load_invocation(argv: list[str] | None = None) -> Invocation | int:
    """Parse the command line, set up logging and load the job.

    Returns:
        The invocation, or `EXIT_USAGE` once a one-line error naming the job file is on stderr.
    """
    parser = argparse.ArgumentParser(prog="python -m training", description="Run one torchrig training worker.")
    parser.add_argument("--spec", default=os.environ.get(Env.SPEC), help=f"resolved job file ({Env.SPEC})")
    parser.add_argument("--run-dir", default=os.environ.get(Env.RUN_DIR), help=f"run directory ({Env.RUN_DIR})")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get(Env.LOG_LEVEL, "INFO").upper(),
        format="%(asctime)s %(levelname)s [rank " + os.environ.get(Env.RANK, "0") + "] %(name)s: %(message)s",
    )
    if not args.spec:
        print(f"torchrig: error: no job file: pass --spec PATH or set {Env.SPEC}", file=sys.stderr)
        return EXIT_USAGE

    from training.config import load_worker_spec

    try:
        spec = load_worker_spec(args.spec)
    except FileNotFoundError as exc:
        print(f"torchrig: error: {args.spec}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:
        problems = "; ".join(str(exc).splitlines())
        print(f"torchrig: error: {args.spec}: {problems}", file=sys.stderr)
        return EXIT_USAGE
    run_dir = args.run_dir or os.path.join("runs", spec.name)
    return Invocation(spec, str(args.spec), run_dir, os.environ.get(Env.INPLACE_ROLE, ""))


def main(argv: list[str] | None = None) -> int:
    """A process that runs its role and never hosts: an in-place host's trainer or spare. Returns its exit code."""
    invocation = load_invocation(argv)
    return invocation if isinstance(invocation, int) else run(invocation)


def run(invocation: Invocation) -> int:
    """Run `invocation`'s role; a host's child first makes sure it cannot outlive its host."""
    if invocation.role:
        die_with_parent()
    return run_role(invocation.spec, invocation.role, invocation.run_dir, spec_path=invocation.spec_path)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux; a no-op elsewhere)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def run_role(spec: WorkerSpec, role: str, run_dir: str, *, spec_path: str | None = None) -> int:
    """Train as `role` and turn how it ended into this process's exit code (the module's docstring lists them).

    Args:
        spec: The validated job.
        role: `training.inplace.ROLE_SPARE` to stand by as an in-place spare (when the launch recovers in
            place); anything else trains (`training.worker.run_worker`).
        run_dir: The run directory.
        spec_path: The job file, named in the message when its task cannot be loaded.

    Returns:
        The exit code; a failure's one-line reason is on stderr (an exception in training also leaves its
        traceback there, and its record in torchelastic's error file).
    """
    from training.checkpoint.results import (
        CheckpointCorruptError,
        CheckpointKeyError,
        CheckpointMismatchError,
        CheckpointStoreUnavailableError,
    )
    from training.inplace import ROLE_SPARE, InPlace
    from training.inplace.group import LeftForSpare, RecoveryFailed
    from training.preemption import PreemptedExit
    from training.sdc import SilentDataCorruption
    from training.task import TaskLoadError
    from training.worker import run_worker

    inplace = InPlace.from_spec(spec) if role == ROLE_SPARE else None
    try:
        if inplace is not None:
            from training.inplace.spare import run_spare

            run_spare(spec, inplace, run_dir=run_dir)
        else:
            run_worker(spec, run_dir=run_dir)
    except RecoveryFailed as exc:  # in-place recovery did not finish: the host makes torchrun restart
        print(f"torchrig: error: in-place recovery failed: {exc}".splitlines()[0], file=sys.stderr)
        return int(ExitCode.RECOVERY_FAILED)
    except PreemptedExit:  # stopped on SIGTERM after an emergency checkpoint (training.preemption)
        return int(ExitCode.PREEMPTED)
    except SilentDataCorruption as exc:  # the replicas disagreed: the group restarts from a certified checkpoint
        print(f"torchrig: error: {exc}", file=sys.stderr)
        return int(ExitCode.SDC_DETECTED)
    except LeftForSpare as exc:  # the majority named this rank: its host gives the rank to a spare
        print(f"torchrig: error: {exc.__cause__ or exc}; {exc}".splitlines()[0], file=sys.stderr)
        code = exc.decision.exit_code
        return EXIT_FAILED if code is None else code
    except TaskLoadError as exc:
        print(f"torchrig: error: {f'{spec_path}: ' if spec_path else ''}{exc}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointMismatchError as exc:  # the task changed under its checkpoints: permanent
        print(f"torchrig: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointKeyError, CheckpointCorruptError) as exc:  # permanent; the checkpoints are left as they are
        print(f"torchrig: error: {exc}", file=sys.stderr)
        return int(ExitCode.ENVIRONMENT)
    except CheckpointStoreUnavailableError as exc:  # a store did not answer at restore: retryable
        print(f"torchrig: error: {exc}", file=sys.stderr)
        return int(ExitCode.STORE_UNAVAILABLE)
    except Exception as exc:
        # A failure inside training (the user's task, OOM, a lost peer): the traceback belongs in the
        # worker log, the last line says what happened; torchrun's error file gets the root cause.
        traceback.print_exc()
        _record_for_torchelastic(exc)
        print(f"torchrig: error: worker failed: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _record_for_torchelastic(exc: BaseException) -> None:
    if not os.environ.get(Env.ERROR_FILE):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(exc)
    except Exception:  # the error report must never mask the error itself
        pass
