"""Run lifecycle commands: `run`, `submit`, `status`, `logs`, `cancel`, `list`.

Every command goes through `orchestrator.backends.get_backend(name)`. `run` launches the job and, on a
backend that supervises its runs from here (local, embedded Ray), watches it with a live view
(`Backend.launch` -> `SupervisedRun.wait`); elsewhere it submits and polls the status. `submit`
returns at once on every backend (`Backend.submit`).
A RUN reference is `backend://id` (`local://runs/x/20261122-230000`, `ray://...`) or a plain path
(a local run directory).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import click

from orchestrator.backends.base import (
    DryRun,
    KubernetesOptions,
    LocalOptions,
    RayOptions,
    RunState,
    RunStatus,
    SubmitOptions,
    SupervisedRun,
)
from orchestrator.cli._common import emit_json, handle_errors, output_option, set_option
from orchestrator.errors import (
    EXIT_PREEMPTED,
    FinalCheckpointLost,
    JobFailed,
    RestartsExhausted,
    SpecError,
    UnsupportedFeature,
)
from orchestrator.summary_text import final_line

__all__ = ["cancel", "list_runs", "logs", "run", "status", "submit"]

EXIT_CANCELLED = 130  # like a shell after Ctrl-C
EXIT_READER_GONE = 141  # 128 + SIGPIPE: what a pipeline reports for a writer whose reader exited
READER_GONE = "cancelled: the reader of torchrig's stdout exited (a pipe closed)"

backend_option = click.option(
    "--backend",
    "backend_name",
    default=None,
    metavar="NAME",
    help="local (torch.distributed.elastic on this machine), ray or kubernetes.",
)


_RAY = "ray"  # the backend that `--address` (a Ray Jobs API) belongs to

address_option = click.option(
    "--address",
    envvar="RAY_ADDRESS",
    default=None,
    metavar="URL",
    help="Ray: the cluster's Jobs API (http://HOST:8265); default $RAY_ADDRESS. A RUN that is a bare "
    "submission id is looked up there.",
)
verbose_option = click.option(
    "--verbose", "-v", is_flag=True, help="Ray: also print Ray's own INFO lines (packaging, uploads)."
)


def _split_ref(ref: str, backend_name: str | None, address: str | None = None) -> tuple[str, str]:
    """`ray://id` -> (ray, id); a plain path -> (local, path) unless --backend says otherwise. With a
    Ray address, a RUN that is neither a reference nor an existing path is a submission on that cluster:
    (ray, ADDRESS/RUN)."""
    if "://" in ref:
        scheme, _, rest = ref.partition("://")
        if backend_name and backend_name != scheme:
            raise SpecError(f"RUN: {ref!r} belongs to backend {scheme!r}, not --backend {backend_name!r}")
        return scheme, rest
    name = backend_name or "local"
    if address and backend_name in (None, _RAY) and not Path(ref).exists():
        return _RAY, f"{address.rstrip('/')}/{ref}"
    return name, ref


def _get_backend(name: str, address: str | None = None, *, verbose: bool = False) -> Any:
    """The backend `name`; the Ray backend with the cluster `address` and Ray's log lines as `-v` says."""
    if name == _RAY:
        from orchestrator.backends.ray import RayBackend

        return RayBackend(address=address, verbose=verbose)
    from orchestrator.backends import get_backend

    return get_backend(name)


def _status_dict(st: RunStatus) -> dict[str, Any]:
    return {"run": str(st.handle), "state": st.state.value, "message": st.message, "details": st.details}


def _install_cancel(handler: Callable[[], None]) -> dict[int, Any]:
    previous: dict[int, Any] = {}

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        handler()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, _on_signal)
    return previous


class _ReaderGuard:
    """`sys.stdout` while `torchrig run` supervises: when the reader of a piped stdout exits (`torchrig
    run JOB | head`), the run stops as on Ctrl-C (the ranks' grace period, checkpoints kept, the summary
    written) instead of the supervisor dying with its workers unwatched. Output from then on goes to
    /dev/null, so nothing fails on the closed pipe again, not even the interpreter's flush at exit."""

    def __init__(self, stream: Any, on_gone: Callable[[], None]) -> None:
        self._stream = stream
        self._on_gone = on_gone
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return int(self._stream.write(text))
            except BrokenPipeError:
                self._reader_gone()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._reader_gone()

    def _reader_gone(self) -> None:
        self.gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass  # no file descriptor (a test's stream): the `gone` flag alone keeps writes away
        click.echo("torchrig: stdout's reader exited; stopping the run (checkpoints are kept)", err=True)
        self._on_gone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _print_dry_run(dryrun: DryRun, output: str) -> None:
    from orchestrator.backends.local_plan import LocalPlan

    if output == "json" and isinstance(dryrun.request, LocalPlan):
        emit_json(dryrun.request.to_dict())
    else:
        click.echo(str(dryrun), nl=False)


def _supervise(run: SupervisedRun, spec: Any, output: str, quiet: bool, *, new_dir: bool = False) -> None:
    """`torchrig run` of a supervised backend (local, embedded Ray): watch the run, print its summary.

    `new_dir`: the run took a new run directory of its own (no `--run-dir`)."""
    stdout, guard = sys.stdout, _ReaderGuard(sys.stdout, lambda: run.request_cancel(READER_GONE))
    sys.stdout = guard
    try:
        _watch(run, spec, output, quiet, new_dir=new_dir, guard=guard)
    finally:
        sys.stdout = stdout


def _watch(run: SupervisedRun, spec: Any, output: str, quiet: bool, *, new_dir: bool, guard: _ReaderGuard) -> None:
    from orchestrator.backends._local_view import LiveProgress, create_view
    from orchestrator.backends.local_run import LocalRun
    from orchestrator.backends.ray_run import RayLocalRun

    endpoints = run.endpoints if isinstance(run, LocalRun) else []
    previous = _install_cancel(run.request_cancel)
    try:
        talk = output == "text" and not quiet
        if talk:
            click.echo(f"run dir:     {run.run_dir}")
            if isinstance(run, LocalRun):
                click.echo(f"metrics:     {', '.join(endpoints) or 'disabled (spec.metrics.enabled)'}")
                if run.standby_endpoints:
                    standby = ", ".join(run.standby_endpoints)
                    click.echo(f"             standby nodes, once one takes a lost node's ranks: {standby}")
            stores = [s.resolved_uri(run.run_dir) for s in spec.spec.checkpoint.stores]
            click.echo(f"checkpoints: {', '.join(stores)}")
            if isinstance(run, LocalRun):
                click.echo(f"logs:        torchrig logs {run.run_dir} [--rank R] [--follow]")
        if new_dir and not quiet:
            _hint_earlier_checkpoints(spec, Path(run.run_dir))
        since = run.started_at if isinstance(run, LocalRun) else 0.0  # a resubmit: not the earlier attempts' lines
        view = create_view(LiveProgress(run.run_dir, spec.spec.training.steps, since), endpoints, quiet=not talk)
        summary = run.wait(view=view) if isinstance(run, (LocalRun, RayLocalRun)) else run.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if guard.gone and summary.status == RunState.CANCELLED.value:
        sys.exit(EXIT_READER_GONE)  # stopped because the reader went: the status a pipeline gives for that
    if output == "json":
        emit_json(summary.to_dict())
    else:
        from orchestrator.cli.stacks_cmd import stacks_hint

        # A hang the watchdog ended left stack dumps: point at them (and at the rank apart) right here.
        hint = stacks_hint(summary.run_dir) if summary.run_dir else None
        click.echo(final_line(summary) + (f"; {hint}" if hint else ""))
    if summary.status == RunState.CANCELLED.value:
        last = summary.last_checkpoint()
        where = f"{last['uri']} (step {last['last_committed_step']})" if last else "none committed"
        click.echo(f"cancelled; last committed checkpoint: {where}", err=True)
        sys.exit(EXIT_CANCELLED)
    if summary.status == RunState.PREEMPTED.value:
        click.echo(f"{summary.reason}: `torchrig run JOB --run-dir {summary.run_dir}` resumes it", err=True)
        sys.exit(EXIT_PREEMPTED)
    if summary.status == RunState.FAILED.value:
        if summary.worker_exit is not None:
            raise JobFailed(summary.reason or f"a worker exited {summary.worker_exit}")
        failure = FinalCheckpointLost if summary.final_checkpoint_lost() else RestartsExhausted
        raise failure(summary.reason or "the job failed")


def _hint_earlier_checkpoints(spec: Any, run_dir: Path) -> None:
    """Say so when a new run directory leaves this job's checkpoints behind in an earlier one."""
    from orchestrator.rundir import earlier_checkpoints

    earlier = earlier_checkpoints(spec, run_dir)
    if earlier is not None:
        click.echo(
            f"note: this run starts in a new run directory, so store {earlier.store!r} starts empty; "
            f"{earlier.run_dir} ({earlier.state}) holds this job's checkpoints up to step {earlier.step}: "
            f"`torchrig run JOB --run-dir {earlier.run_dir}` resumes from them",
            err=True,
        )


def _watch_remote(backend_name: str, handle_ref: str, output: str, quiet: bool) -> None:
    from orchestrator.backends import get_backend

    backend = get_backend(backend_name)
    last_state: RunState | None = None
    while True:
        st = backend.status(handle_ref)
        if st.state != last_state and not quiet and output == "text":
            click.echo(f"{st.handle}: {st.state.value} {st.message}".rstrip())
            last_state = st.state
        if st.state.terminal:
            break
        time.sleep(2.0)
    if output == "json":
        emit_json(_status_dict(st))
    sys.exit(st.state.exit_code)


def _load(job: str, overrides: tuple[str, ...], *, allow_inline_secrets: bool = False) -> Any:
    from orchestrator.loader import load_spec

    spec = load_spec(job, list(overrides), allow_inline_secrets=allow_inline_secrets)
    for warning in spec.warnings():
        click.echo(f"warning: {warning}", err=True)
    return spec


@click.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--backend", "backend_name", default="local", show_default=True, help="local, ray or kubernetes.")
@click.option(
    "--nodes", type=int, default=None, help="Local: emulated nodes (agents) to start (default spec.nodes.min)."
)
@click.option(
    "--run-dir", type=click.Path(file_okay=False), default=None, help="Run directory (default runs/<name>/<time>/)."
)
@set_option
@click.option("--quiet", "-q", is_flag=True, help="Print only the final line.")
@output_option
@click.option("--dry-run", is_flag=True, help="Print what would be launched, launch nothing.")
@click.option("--worker", default=None, hidden=True, help="Worker module or script instead of `-m training`.")
@click.option(
    "--allow-inline-secrets",
    is_flag=True,
    help="Local backend only: accept credentials written in the job file, with a warning (they stay on this machine).",
)
@handle_errors
def run(
    job: str,
    backend_name: str,
    nodes: int | None,
    run_dir: str | None,
    overrides: tuple[str, ...],
    quiet: bool,
    output: str,
    dry_run: bool,
    worker: str | None,
    allow_inline_secrets: bool,
) -> None:
    """Run JOB and watch it until it ends (Ctrl-C cancels it; its checkpoints are kept).

    Locally, ranks run under torch.distributed.elastic with spec.restarts.max restarts; --nodes N starts
    N agents on one rendezvous to emulate N nodes. Exit codes: 0 succeeded, 1 a worker failed on an
    error no restart cures (the task, a setting, checkpoints corrupt everywhere or not fitting the
    model: not restarted),
    4 restarts exhausted, 5 final checkpoint committed to no store, 130 cancelled.
    """
    from orchestrator.backends import get_backend

    if allow_inline_secrets and backend_name != "local":
        # Elsewhere the job file leaves this machine: the Ray working directory, the cluster's objects.
        raise SpecError(
            f"--allow-inline-secrets: for the local backend only (not {backend_name}), where the job file stays on "
            "this machine; on Ray and Kubernetes give the job its credentials through a Secret or the environment"
        )
    spec = _load(job, overrides, allow_inline_secrets=allow_inline_secrets)
    options = SubmitOptions(
        run_dir=run_dir, dry_run=dry_run, quiet=quiet, local=LocalOptions(nodes=nodes, worker=worker)
    )
    backend = get_backend(backend_name)
    dryrun = backend.dry_run(spec, options)
    if dry_run:
        _print_dry_run(dryrun, output)
        return
    if backend.capabilities.supervised:
        try:
            run = backend.launch_dry_run(dryrun)
        except UnsupportedFeature:
            pass  # this request is supervised elsewhere (a Ray cluster behind the Jobs API): watch it
        else:
            _supervise(run, spec, output, quiet, new_dir=run_dir is None)
            return
    handle = backend.schedule(dryrun)
    if output == "text" and not quiet:
        click.echo(f"submitted {handle}")
    _watch_remote(handle.backend, handle.run_id, output, quiet)


@click.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--backend", "backend_name", default="kubernetes", show_default=True, help="kubernetes, ray or local.")
@click.option("--nodes", type=int, default=None, help="Local: emulated nodes (agents).")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None, help="Local: run directory.")
@address_option
@click.option(
    "--allow-node-local-stores",
    "--allow-pod-local-stores",
    "allow_node_local_stores",
    is_flag=True,
    help="Ray with --address: accept a job whose checkpoint stores all live on each node's own disk (a "
    "warning instead of an error; each node then keeps only its own shards).",
)
@click.option("--no-probe", is_flag=True, help="Ray with --address: skip the check that the cluster can run the job.")
@verbose_option
@click.option("--context", default=None, help="Kubernetes: kubeconfig context.")
@click.option("--namespace", "-n", default=None, help="Kubernetes: namespace (default metadata.namespace).")
@click.option("--fixed-size", is_flag=True, help="Run an elastic spec at fixed size on a non-elastic target.")
@set_option
@output_option
@click.option("--dry-run", is_flag=True, help="Print exactly what would be submitted, submit nothing.")
@click.option("--worker", default=None, hidden=True, help="Local: worker module or script instead of `-m training`.")
@handle_errors
def submit(
    job: str,
    backend_name: str,
    nodes: int | None,
    run_dir: str | None,
    address: str | None,
    allow_node_local_stores: bool,
    no_probe: bool,
    verbose: bool,
    context: str | None,
    namespace: str | None,
    fixed_size: bool,
    overrides: tuple[str, ...],
    output: str,
    dry_run: bool,
    worker: str | None,
) -> None:
    """Submit JOB and return at once with its RUN reference (`backend://id`) for status/logs/cancel.

    On a Ray cluster (--backend ray --address URL, or $RAY_ADDRESS) a probe job first checks that the
    cluster imports torch, ray and torchrig and has the GPUs the job asks for; the run directory lives
    on the cluster (under spec.ray.sharedDir when set)."""
    spec = _load(job, overrides)
    options = SubmitOptions(
        run_dir=run_dir,
        fixed_size=fixed_size,
        dry_run=dry_run,
        local=LocalOptions(nodes=nodes, worker=worker),
        ray=RayOptions(address=address, allow_node_local_stores=allow_node_local_stores, probe=not no_probe),
        kubernetes=KubernetesOptions(context=context, namespace=namespace),
    )
    backend = _get_backend(backend_name, address, verbose=verbose)
    dryrun = backend.dry_run(spec, options)
    if dry_run:
        click.echo(str(dryrun), nl=False)
        return
    handle = backend.schedule(dryrun)  # returns at once on every backend
    if output == "json":
        emit_json({"run": str(handle), "backend": handle.backend, "id": handle.run_id})
    else:
        click.echo(str(handle))


@click.command()
@click.argument("run_ref", metavar="RUN")
@backend_option
@address_option
@verbose_option
@output_option
@click.option("--stacks", is_flag=True, help="Local runs: every live rank dumps its Python stacks into RUN/stacks/.")
@handle_errors
def status(
    run_ref: str, backend_name: str | None, address: str | None, verbose: bool, output: str, stacks: bool
) -> None:
    """Show RUN's state. Exit code: 0 succeeded, 1 failed, 10 running/pending, 11 cancelled, 12 unknown,
    13 preempted."""
    from orchestrator.cli.stacks_cmd import report_stacks

    name, run_id = _split_ref(run_ref, backend_name, address)
    st = _get_backend(name, address, verbose=verbose).status(run_id)
    if stacks:
        st.details["stacks"] = report_stacks(name, run_id, echo=output == "text")
    if output == "json":
        emit_json(_status_dict(st))
    else:
        click.echo(f"{st.handle}: {st.state.value}" + (f" ({st.message})" if st.message else ""))
        for key, value in st.details.items():
            if not isinstance(value, (dict, list)):  # checkpoints, eval, ...: see -o json
                click.echo(f"  {key}: {value}")
    sys.exit(st.state.exit_code)


@click.command()
@click.argument("run_ref", metavar="RUN")
@backend_option
@address_option
@verbose_option
@click.option("--rank", type=int, default=None, help="Only this global rank's lines.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the run ends.")
@handle_errors
def logs(
    run_ref: str, backend_name: str | None, address: str | None, verbose: bool, rank: int | None, follow: bool
) -> None:
    """Print RUN's worker logs (every rank's lines carry a `[rank<R>]:` prefix locally)."""
    if rank is not None and rank < 0:
        raise SpecError("--rank: must be >= 0")
    name, run_id = _split_ref(run_ref, backend_name, address)
    for line in _get_backend(name, address, verbose=verbose).logs(run_id, rank=rank, follow=follow):
        click.echo(line)


@click.command()
@click.argument("run_ref", metavar="RUN")
@backend_option
@address_option
@verbose_option
@output_option
@handle_errors
def cancel(run_ref: str, backend_name: str | None, address: str | None, verbose: bool, output: str) -> None:
    """Stop RUN: ranks get SIGTERM, then SIGKILL after a grace period; checkpoints are kept."""
    name, run_id = _split_ref(run_ref, backend_name, address)
    st = _get_backend(name, address, verbose=verbose).cancel(run_id)
    if output == "json":
        emit_json(_status_dict(st))
    else:
        click.echo(f"{st.handle}: {st.state.value}")


@click.command(name="list")
@backend_option
@address_option
@verbose_option
@output_option
@handle_errors
def list_runs(backend_name: str | None, address: str | None, verbose: bool, output: str) -> None:
    """List runs (local: the run directories under ./runs, or $TORCHRIG_RUNS_DIR; ray: torchrig's jobs on
    the cluster at --address or $RAY_ADDRESS)."""
    runs = _get_backend(backend_name or "local", address, verbose=verbose).list_runs()
    if output == "json":
        emit_json([_status_dict(st) for st in runs])
        return
    if not runs:
        click.echo("no runs")
        return
    width = max(len(str(st.handle)) for st in runs)
    for st in runs:
        step = st.details.get("steps", st.details.get("step"))
        extra = f"  step {step}" if step is not None else ""
        click.echo(f"{st.handle!s:<{width}}  {st.state.value:<9}{extra}")
