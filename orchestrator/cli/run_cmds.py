"""Run lifecycle commands: `run`, `submit`, `status`, `logs`, `cancel`, `list`.

Every command goes through `orchestrator.backends.get_backend(name)`; the local backend adds a
foreground supervisor with a live view (`run`) and a detached one (`submit --backend local`).
A RUN reference is `backend://id` (`local://runs/x/20261122-230000`, `ray://...`) or a plain path
(a local run directory).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import click

from orchestrator.backends.base import RunState, RunStatus, SubmitOptions
from orchestrator.cli._common import emit_json, handle_errors, output_option, set_option
from orchestrator.errors import RecoveryFailed, SpecError

__all__ = ["cancel", "list_runs", "logs", "run", "status", "submit"]

EXIT_CANCELLED = 130  # like a shell after Ctrl-C

backend_option = click.option(
    "--backend",
    "backend_name",
    default=None,
    metavar="NAME",
    help="local (torch.distributed.elastic on this machine), ray or kubernetes.",
)


def _split_ref(ref: str, backend_name: str | None) -> tuple[str, str]:
    """`ray://id` -> (ray, id); a plain path -> (local, path) unless --backend says otherwise."""
    if "://" in ref:
        scheme, _, rest = ref.partition("://")
        if backend_name and backend_name != scheme:
            raise SpecError(f"RUN: {ref!r} belongs to backend {scheme!r}, not --backend {backend_name!r}")
        return scheme, rest
    return backend_name or "local", ref


def _status_dict(st: RunStatus) -> dict[str, Any]:
    return {"run": str(st.handle), "state": st.state.value, "message": st.message, "details": st.details}


def _final_line(summary: dict[str, Any]) -> str:
    parts = [f"{summary['status']}:", f"{summary.get('steps')}/{summary.get('total_steps')} steps"]
    if isinstance(summary.get("final_loss"), (int, float)):
        parts.append(f"loss {summary['final_loss']:.4f}")
    for key, value in sorted((summary.get("eval") or {}).items()):
        parts.append(f"{key} {value:.4f}" if isinstance(value, float) else f"{key} {value}")
    if isinstance(summary.get("samples_per_s"), (int, float)):
        parts.append(f"{summary['samples_per_s']:.0f} samples/s")
    parts.append(f"{summary.get('wall_s', 0):.1f} s")
    parts.append(f"restarts {summary.get('restarts', 0)}")
    parts.append(f"world sizes {summary.get('world_sizes')}")
    return " ".join(parts) + f"\nsummary: {summary.get('run_dir')}/summary.json"


def _install_cancel(handler: Callable[[], None]) -> dict[int, Any]:
    previous: dict[int, Any] = {}

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        handler()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, _on_signal)
    return previous


def _run_local(spec: Any, options: SubmitOptions, output: str) -> None:
    from orchestrator.backends import get_backend
    from orchestrator.backends._local_view import LiveProgress, create_view
    from orchestrator.backends.local import LocalBackend

    backend = get_backend("local")
    assert isinstance(backend, LocalBackend)
    dryrun = backend.dry_run(spec, options)
    if options.dry_run:
        if output == "json":
            emit_json(dryrun.request.to_dict())
        else:
            click.echo(str(dryrun.request), nl=False)
        return
    run = backend.start(dryrun)
    previous = _install_cancel(run.request_cancel)
    try:
        talk = output == "text" and not options.quiet
        if talk:
            click.echo(f"run dir:     {run.run_dir}")
            click.echo(f"metrics:     {', '.join(run.endpoints) or 'disabled (spec.metrics.enabled)'}")
            stores = [s.resolved_uri(run.run_dir) for s in spec.spec.checkpoint.stores]
            click.echo(f"checkpoints: {', '.join(stores)}")
            click.echo(f"logs:        torchrig logs {run.run_dir} [--rank R] [--follow]")
        progress = LiveProgress(run.run_dir, spec.spec.training.steps)
        view = create_view(progress, run.endpoints, quiet=not talk)
        summary = run.wait(view)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if output == "json":
        emit_json(summary)
    else:
        click.echo(_final_line(summary))
    if summary["status"] == "cancelled":
        last = run.last_checkpoint()
        where = f"{last['uri']} (step {last['last_committed_step']})" if last else "none committed"
        click.echo(f"cancelled; last committed checkpoint: {where}", err=True)
        sys.exit(EXIT_CANCELLED)
    if summary["status"] == "failed":
        raise RecoveryFailed(str(summary.get("reason", "the job failed")))


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


def _load(job: str, overrides: tuple[str, ...]) -> Any:
    from orchestrator.loader import load_spec

    spec = load_spec(job, list(overrides))
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
) -> None:
    """Run JOB and watch it until it ends (Ctrl-C cancels it; its checkpoints are kept).

    Locally, ranks run under torch.distributed.elastic with spec.restarts.max restarts; --nodes N starts
    N agents on one rendezvous to emulate N nodes. Exit codes: 0 succeeded, 4 restarts exhausted,
    130 cancelled.
    """
    spec = _load(job, overrides)
    options = SubmitOptions(
        run_dir=run_dir, nodes=nodes, dry_run=dry_run, quiet=quiet, extra={"worker": worker} if worker else {}
    )
    if backend_name == "local":
        _run_local(spec, options, output)
        return
    from orchestrator.backends import get_backend

    backend = get_backend(backend_name)
    dryrun = backend.dry_run(spec, options)
    if dry_run:
        click.echo(str(dryrun), nl=False)
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
@click.option("--address", default=None, help="Ray: Jobs API address (http://HOST:8265).")
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
    context: str | None,
    namespace: str | None,
    fixed_size: bool,
    overrides: tuple[str, ...],
    output: str,
    dry_run: bool,
    worker: str | None,
) -> None:
    """Submit JOB and return at once with its RUN reference (`backend://id`) for status/logs/cancel."""
    from orchestrator.backends import get_backend

    spec = _load(job, overrides)
    options = SubmitOptions(
        run_dir=run_dir,
        nodes=nodes,
        address=address,
        context=context,
        namespace=namespace,
        fixed_size=fixed_size,
        dry_run=dry_run,
        extra={"worker": worker} if worker else {},
    )
    backend = get_backend(backend_name)
    dryrun = backend.dry_run(spec, options)
    if dry_run:
        click.echo(str(dryrun), nl=False)
        return
    if backend_name == "local":
        from orchestrator.backends.local import LocalBackend

        assert isinstance(backend, LocalBackend)
        handle = backend.submit_detached(dryrun)
    else:
        handle = backend.schedule(dryrun)
    if output == "json":
        emit_json({"run": str(handle), "backend": handle.backend, "id": handle.run_id})
    else:
        click.echo(str(handle))


@click.command()
@click.argument("run_ref", metavar="RUN")
@backend_option
@output_option
@handle_errors
def status(run_ref: str, backend_name: str | None, output: str) -> None:
    """Show RUN's state. Exit code: 0 succeeded, 1 failed, 10 running/pending, 11 cancelled, 12 unknown."""
    from orchestrator.backends import get_backend

    name, run_id = _split_ref(run_ref, backend_name)
    st = get_backend(name).status(run_id)
    if output == "json":
        emit_json(_status_dict(st))
    else:
        click.echo(f"{st.handle}: {st.state.value}" + (f" ({st.message})" if st.message else ""))
        for key, value in st.details.items():
            if key not in ("checkpoints", "eval") and not isinstance(value, (dict, list)):
                click.echo(f"  {key}: {value}")
    sys.exit(st.state.exit_code)


@click.command()
@click.argument("run_ref", metavar="RUN")
@backend_option
@click.option("--rank", type=int, default=None, help="Only this global rank's lines.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the run ends.")
@handle_errors
def logs(run_ref: str, backend_name: str | None, rank: int | None, follow: bool) -> None:
    """Print RUN's worker logs (every rank's lines carry a `[rank<R>]:` prefix locally)."""
    from orchestrator.backends import get_backend

    if rank is not None and rank < 0:
        raise SpecError("--rank: must be >= 0")
    name, run_id = _split_ref(run_ref, backend_name)
    for line in get_backend(name).logs(run_id, rank=rank, follow=follow):
        click.echo(line)


@click.command()
@click.argument("run_ref", metavar="RUN")
@backend_option
@output_option
@handle_errors
def cancel(run_ref: str, backend_name: str | None, output: str) -> None:
    """Stop RUN: ranks get SIGTERM, then SIGKILL after a grace period; checkpoints are kept."""
    from orchestrator.backends import get_backend

    name, run_id = _split_ref(run_ref, backend_name)
    st = get_backend(name).cancel(run_id)
    if output == "json":
        emit_json(_status_dict(st))
    else:
        click.echo(f"{st.handle}: {st.state.value}")


@click.command(name="list")
@backend_option
@output_option
@handle_errors
def list_runs(backend_name: str | None, output: str) -> None:
    """List runs (local: the run directories under ./runs, or $TORCHRIG_RUNS_DIR)."""
    from orchestrator.backends import get_backend

    runs = get_backend(backend_name or "local").list_runs()
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
