"""Detached runs: `schedule` returns at once, a supervisor process of its own runs the plan.

`torchrig submit --backend local` (and `--backend ray` without a Jobs API address) must not block
until the job ends, yet a local run needs a process that watches it and writes summary.json. So
`start_detached` stores the dry run in the run directory (job.yaml, launch.json: backend, options,
plan) and starts `python -m orchestrator.backends.supervise RUN_DIR` in a session of its own. That
process starts exactly the stored plan (`Backend.launch_dry_run`), supervises it (`SupervisedRun.wait`)
and so writes summary.json; SIGTERM (`torchrig cancel`) or SIGINT cancel it like Ctrl-C cancels
`torchrig run`. No backend starts the `torchrig` CLI.

Exit codes of the supervisor: 0 succeeded, 1 failed, 2 bad launch request, 130 cancelled, 202 preempted.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, runtime_checkable

from orchestrator.backends._local_procs import alive, find_marked, process_start_ticks, spawn, terminate_then_kill
from orchestrator.backends.base import (
    DryRun,
    KubernetesOptions,
    LocalOptions,
    RayOptions,
    RunHandle,
    RunState,
    SubmitOptions,
    SupervisedRun,
)
from orchestrator.errors import EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE, BackendError, SpecError
from orchestrator.loader import dump_spec
from orchestrator.rundir import run_state
from training.contract import RunFiles, Summary, read_json, write_json
from training.contract.files import private_umask

__all__ = [
    "DetachableBackend",
    "PreflightedBackend",
    "cancel_detached",
    "main",
    "options_from_json",
    "start_detached",
]

CANCEL_GRACE_S = 40.0  # the supervisor's own grace period (10 s) plus the time to write its summary
EXIT_CANCELLED = 130


@runtime_checkable
class DetachableBackend(Protocol):
    """A backend whose dry-run request survives JSON (what a detached supervisor starts)."""

    name: str

    def request_from_json(self, data: Any) -> Any:
        """The dry run's request from the JSON that `start_detached` stored."""
        ...

    def launch_dry_run(self, dryrun: DryRun) -> SupervisedRun: ...


@runtime_checkable
class PreflightedBackend(Protocol):
    """A backend that can start a dry run whose preflight its `submit` ran already."""

    def launch_preflighted(self, dryrun: DryRun) -> SupervisedRun:
        """Start exactly what `dryrun` describes without running the preflight again."""
        ...


def options_from_json(data: dict[str, Any]) -> SubmitOptions:
    """`SubmitOptions` from its `dataclasses.asdict` form."""
    from orchestrator.backends.local_plan import placement_from_json

    local = dict(data.get("local") or {})
    local["placements"] = [placement_from_json(p) for p in local.get("placements") or []]
    return SubmitOptions(
        **{
            **data,
            "local": LocalOptions(**local),
            "ray": RayOptions(**(data.get("ray") or {})),
            "kubernetes": KubernetesOptions(**(data.get("kubernetes") or {})),
        }
    )


def start_detached(dryrun: DryRun, run_dir: Path, request: Any, *, preflighted: bool = False) -> RunHandle:
    """Store the dry run in `run_dir`, start its supervisor process, record it and return at once.

    The supervisor is recorded here (`supervisor.json`: its pid and start time), so `status` right after
    `submit` says running; the supervisor completes the record once the run's processes are up. What goes
    wrong after this returns (the store or an agent cannot start) ends the run `failed` with the reason
    in summary.json, as any later failure does.

    Args:
        dryrun: What to run (its spec and options).
        run_dir: The run directory.
        request: The dry run's request as JSON data (the backend's `request_from_json` reads it back).
        preflighted: The caller ran the preflight (`preflight_here`) already: the supervisor does not run
            it a second time (a torch import: seconds) when its backend can start without it
            (`PreflightedBackend`).

    Raises:
        BackendError: the supervisor process could not be started.
    """
    files = RunFiles(run_dir)
    cmd = [sys.executable, "-m", "orchestrator.backends.supervise", str(run_dir)]
    # The run directory and what runs in it are private to the user (the supervisor inherits the umask).
    with private_umask():
        files.logs.mkdir(parents=True, exist_ok=True)
        files.job.write_text(dump_spec(dryrun.spec))
        write_json(
            files.launch,
            {
                "backend": dryrun.backend,
                "options": dataclasses.asdict(dryrun.options),
                "request": request,
                "preflighted": preflighted,
            },
        )
        try:
            proc = spawn(cmd, log=files.supervisor_log, env=dryrun.options.env)
        except OSError as exc:
            raise BackendError(f"the background run could not start: {exc}") from None
        ticks = process_start_ticks(proc.pid)
        # Not over a record the supervisor already wrote (it only does once its run is up: seconds).
        if (read_json(files.supervisor) or {}).get("pid") != proc.pid:
            record = {"pid": proc.pid, "start_ticks": ticks, "started_at": time.time(), "backend": dryrun.backend}
            write_json(files.supervisor, {**record, "starting": True})
    return RunHandle(dryrun.backend, str(run_dir), info={"pid": proc.pid})


def cancel_detached(run_dir: Path) -> None:
    """Cancel the run supervised in `run_dir` (detached or `torchrig run`): SIGTERM its supervisor,
    which stops the run and writes summary.json; kill what it left; record `cancelled` if it could not."""
    files = RunFiles(run_dir)
    if not run_dir.is_dir():
        raise SpecError(f"RUN: no such run directory: {run_dir}")
    if not files.job.exists() and not files.supervisor.exists():  # never write a summary into any directory
        raise SpecError(f"RUN: {run_dir} is not a run directory (no job.yaml)")
    state, _, _ = run_state(run_dir)
    if state.terminal:
        return
    sup = read_json(files.supervisor) or {}
    pid = int(sup.get("pid", -1))
    if state is RunState.RUNNING and alive(pid, sup.get("start_ticks")):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + CANCEL_GRACE_S
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.2)
    token = sup.get("run_token")
    if token:
        terminate_then_kill(find_marked(str(token)), 5.0, token=str(token))
    if not files.summary.exists():
        # The same words as the supervisor's own summary (`local_run`, `ray_run`), and why it is ours.
        reason = f"cancelled by the user (the supervisor did not write a summary within {CANCEL_GRACE_S:g} s)"
        Summary(status=RunState.CANCELLED.value, run_dir=str(run_dir), reason=reason).write(files.summary)


def main(argv: list[str] | None = None) -> int:
    """Supervise the detached run stored in RUN_DIR (see the module docstring)."""
    from orchestrator.backends import get_backend
    from orchestrator.errors import TorchrigError
    from orchestrator.loader import load_spec

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m orchestrator.backends.supervise RUN_DIR", file=sys.stderr)
        return EXIT_USAGE
    files = RunFiles(args[0])
    # `submit` has returned already: a cancel may come while the run starts. It is remembered and carried
    # out once the run is up (the run stops its processes and writes summary.json).
    cancelled: list[int] = []
    run: SupervisedRun | None = None

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        cancelled.append(signum)
        if run is not None:
            run.request_cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    try:
        launch = read_json(files.launch)
        if launch is None:
            raise BackendError(f"{files.launch}: missing or not JSON")
        backend = get_backend(str(launch["backend"]))
        if not isinstance(backend, DetachableBackend):
            raise BackendError(f"backend {backend.name!r} cannot run detached")
        spec = load_spec(files.job)
        options = options_from_json(dict(launch["options"]))
        request = backend.request_from_json(launch["request"])
        dryrun = DryRun(backend=backend.name, spec=spec, options=options, request=request)
        if launch.get("preflighted") is True and isinstance(backend, PreflightedBackend):
            run = backend.launch_preflighted(dryrun)
        else:
            run = backend.launch_dry_run(dryrun)
    except TorchrigError as exc:
        for line in exc.lines():
            print(f"error: {line}", file=sys.stderr)
        # `submit` returned before this: the run's summary says why it never started (`status`).
        if not files.summary.exists() and files.root.is_dir():
            reason = f"the run could not start: {exc.lines()[0] if exc.lines() else exc}"[:2000]
            Summary(status=RunState.FAILED.value, run_dir=str(files.root), reason=reason).write(files.summary)
        return exc.exit_code
    if cancelled:
        run.request_cancel()
    try:
        summary = run.wait()
    except Exception as exc:  # the run was taken down; a run directory without a summary says "unknown"
        traceback.print_exc()
        if files.summary.exists():
            return EXIT_FAILED
        reason = f"the supervisor failed: {type(exc).__name__}: {exc}"[:2000]
        Summary(status=RunState.FAILED.value, run_dir=str(files.root), reason=reason).write(files.summary)
        return EXIT_FAILED
    from orchestrator.summary_text import final_line

    print(final_line(summary))  # it ends with the summary's path
    return {
        RunState.SUCCEEDED.value: EXIT_OK,
        RunState.CANCELLED.value: EXIT_CANCELLED,
        RunState.PREEMPTED.value: EXIT_PREEMPTED,
    }.get(summary.status, EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main())
