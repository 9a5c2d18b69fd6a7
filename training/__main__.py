"""`python -m training --spec job.yaml`: the worker entry point under every launcher.

The spec comes from `--spec` or `TORCHRIG_SPEC`; the run directory from `--run-dir`,
`TORCHRIG_RUN_DIR`, or `runs/<job name>` under the working directory (the same for every rank, so
relative checkpoint stores and `events.jsonl` are shared). Exit codes (`training.contract.ExitCode`,
Kubeflow's convention: 1-127 permanent, 128+ retryable): 0 success; 2 bad spec or task (one line on
stderr, no traceback); 200 training failed (an exception: retryable, a survivor of a lost peer raises
one too); 201 the step watchdog ended a hung rank (see `training.watchdog`); 202 preempted (SIGTERM:
stopped at an agreed step after an emergency checkpoint, `training.preemption`); 203 in-place
recovery failed (`training.inplace`: the group restarts); 205 a checkpoint store could not be read at
restore and none that could holds a checkpoint of the job (`training.checkpoint.restore`). With
`restarts.mode: inplace` under torchrig's torchrun command this process is the rank's host and runs
the trainer as its child (`training.inplace.host`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from training.contract import Env, ExitCode

EXIT_OK = int(ExitCode.OK)
EXIT_FAILED = int(ExitCode.TRAINING_FAILED)
EXIT_USAGE = int(ExitCode.TASK_INVALID)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, load the spec and run this worker. Returns the process exit code."""
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

    from training.inplace import ROLE_SPARE, InPlace

    role = os.environ.get(Env.INPLACE_ROLE)
    inplace = InPlace.from_spec(spec)
    if inplace is not None and not role:
        # In-place recovery: this process is the rank's light host; the trainer is its child.
        from training.inplace.host import run_host

        return run_host(inplace, sys.argv[1:] if argv is None else list(argv))
    if role:
        from training.inplace.host import die_with_parent

        die_with_parent()

    from training.checkpoint.results import (
        CheckpointCorruptError,
        CheckpointKeyError,
        CheckpointMismatchError,
        CheckpointStoreUnavailableError,
    )
    from training.inplace.group import RecoveryFailed
    from training.preemption import PreemptedExit
    from training.task import TaskLoadError
    from training.worker import run_worker

    try:
        if role == ROLE_SPARE and inplace is not None:
            from training.inplace.spare import run_spare

            run_spare(spec, inplace, run_dir=run_dir)
        else:
            run_worker(spec, run_dir=run_dir)
    except RecoveryFailed as exc:  # in-place recovery did not finish: the host makes torchrun restart
        print(f"torchrig: error: in-place recovery failed: {exc}".splitlines()[0], file=sys.stderr)
        return int(ExitCode.RECOVERY_FAILED)
    except PreemptedExit:  # stopped on SIGTERM after an emergency checkpoint (training.preemption)
        return int(ExitCode.PREEMPTED)
    except TaskLoadError as exc:
        print(f"torchrig: error: {args.spec}: {exc}", file=sys.stderr)
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


if __name__ == "__main__":
    from training.fastexit import exit_now

    exit_now(main())  # without the ~1 s interpreter teardown (training.fastexit)
