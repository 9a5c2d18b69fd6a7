"""`python -m training.launch [--spec PATH] [--run-dir DIR] [--no-gpu-check] -- COMMAND [ARGS...]`.

The first program of every compiled container command and launch line (PyTorchJob, TrainJob runtime,
RayJob entrypoint, the `torchrun` target): it runs `training.preflight` and then replaces itself with
COMMAND (`os.execvp`: same PID, signals go straight to torchrun; a `torchrun` COMMAND runs as
`python -m training.torchrun`, which exits 128 + signal instead of 1 when a signal ends it). A
deterministic startup error exits with a permanent code (`ExitCode.TASK_INVALID` 2,
`ExitCode.ENVIRONMENT` 3) and one line on stderr, so the operator fails the job at once instead of
restarting it (`restartPolicy: ExitCode`, a pod failure policy). Without COMMAND it only checks (exit
0 when the job can start here).

Given a COMMAND in a PyTorchJob pod, it first counts the pod's start (`training.pod_recreations`): the
operator recreates a pod after every exit code >= 128 and never bounds it, so a start past `restarts.max`
recreations exits `ExitCode.RESTARTS_SPENT` (4) and the job fails. Whenever the launcher ends the job with
a permanent code it clears that count, so the job resubmitted under its name starts from 0.

The spec and run directory default to `TORCHRIG_SPEC` and `TORCHRIG_RUN_DIR` (else `runs/<job name>`,
as the worker does).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from training.contract import Env, ExitCode

if TYPE_CHECKING:
    from training.config import WorkerSpec
    from training.pod_recreations import PodRecreations

__all__ = ["main"]


def _fail(code: ExitCode, message: str) -> int:
    print(f"torchrig: error: {message}", file=sys.stderr, flush=True)
    return int(code)


def _warn(message: str) -> None:
    print(f"torchrig: warning: {message}", file=sys.stderr, flush=True)


def _first_line(exc: BaseException) -> str:
    return (f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__])[0]


class _Recreations:
    """This pod's start count (`training.pod_recreations`), where there is one: never the reason a pod
    cannot start, so a store that fails is a warning."""

    def __init__(self, spec: WorkerSpec, spec_path: str, run_dir: str, *, starts: bool) -> None:
        from training.pod_recreations import open_for_pod

        self.count: PodRecreations | None = None
        self.pod = ""
        if not starts:  # only checking (say `kubectl exec ... python -m training.launch`): no pod start
            return
        try:
            spec_bytes = Path(spec_path).read_bytes() if Path(spec_path).is_file() else spec_path.encode()
            opened = open_for_pod(
                spec, spec_bytes, run_dir=run_dir, env=os.environ, hostname=socket.gethostname(), warn=_warn
            )
        except Exception as exc:  # the store's package or options: the preflight judges the store
            _warn(f"pod recreations are not counted this start ({_first_line(exc)})")
            return
        if opened is not None:
            self.count, self.pod = opened

    def spent(self, allowed: int) -> str | None:
        """Count this start; the message when it is one recreation too many."""
        if self.count is None:
            return None
        try:
            decision = self.count.record_start(self.pod, allowed)
        except Exception as exc:  # a store that fails (or hangs) must not stop the pod
            _warn(f"pod recreations are not counted this start ({self.count.job}: {_first_line(exc)})")
            return None
        return decision.message() if decision.spent else None

    def clear(self) -> None:
        """The job ends here (a permanent code): its count goes, so a resubmitted job starts from 0."""
        if self.count is None:
            return
        try:
            self.count.reset()
        except Exception as exc:  # the job fails anyway; a resubmission would start counted
            _warn(f"could not clear the job's count of pod recreations ({_first_line(exc)})")


def main(argv: list[str] | None = None) -> int:
    """Check, then exec the command. Returns an exit code only when it does not exec."""
    args_in = sys.argv[1:] if argv is None else list(argv)
    command: list[str] = []
    if "--" in args_in:
        split = args_in.index("--")
        args_in, command = args_in[:split], args_in[split + 1 :]
    parser = argparse.ArgumentParser(prog="python -m training.launch", description=__doc__.split("\n\n")[1])
    parser.add_argument("--spec", default=os.environ.get(Env.SPEC), help=f"resolved job file ({Env.SPEC})")
    parser.add_argument("--run-dir", default=os.environ.get(Env.RUN_DIR), help=f"run directory ({Env.RUN_DIR})")
    parser.add_argument(
        "--no-gpu-check", action="store_true", help="skip the CUDA check (a Ray head: Ray places the GPU workers)"
    )
    args = parser.parse_args(args_in)
    if not args.spec:
        return _fail(ExitCode.TASK_INVALID, f"no job file: pass --spec PATH or set {Env.SPEC}")

    from training.config import load_worker_spec
    from training.preflight import PreflightError, preflight

    try:
        spec = load_worker_spec(args.spec)
    except FileNotFoundError as exc:
        return _fail(ExitCode.TASK_INVALID, f"{args.spec}: {exc.strerror}")
    except ValueError as exc:
        return _fail(ExitCode.TASK_INVALID, f"{args.spec}: " + "; ".join(str(exc).splitlines()))
    run_dir = args.run_dir or os.path.join("runs", spec.name)
    recreations = _Recreations(spec, args.spec, run_dir, starts=bool(command))
    spent = recreations.spent(spec.spec.restarts.max)
    if spent is not None:
        recreations.clear()
        return _fail(ExitCode.RESTARTS_SPENT, spent)
    try:
        preflight(spec, run_dir=run_dir, check_gpu=not args.no_gpu_check)
    except PreflightError as exc:
        recreations.clear()
        return _fail(exc.exit_code, str(exc))
    except Exception as exc:  # not a verdict (say the factory met a network error): let the run meet it
        _warn(f"preflight could not finish ({_first_line(exc)}); starting anyway")
    if not command:
        return int(ExitCode.OK)
    if command[0] == "torchrun":
        # torchrun itself, but exiting 128 + signal (retryable) rather than 1 when a SIGTERM ends it.
        command = [sys.executable, "-m", "training.torchrun", *command[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(command[0], command)
    except OSError as exc:  # not found or not executable: the image cannot run the job
        recreations.clear()
        return _fail(ExitCode.ENVIRONMENT, f"cannot execute {command[0]!r}: {exc.strerror or exc}")
    return int(ExitCode.OK)  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main())
