"""Shared CLI plumbing: typed errors -> one-line messages and exit codes; --set and --output options."""

from __future__ import annotations

import functools
import json
import signal
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from orchestrator.errors import TorchrigError

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["check_plot_path", "emit_json", "handle_errors", "output_option", "seconds_option", "set_option"]


def seconds_option(flag: str, dest: str, default: float, help_: str) -> Callable[[F], F]:
    """A duration option that must be positive (a zero timeout would count every run as stuck)."""
    return click.option(
        flag, dest, type=click.FloatRange(min=0, min_open=True), default=default, show_default=True, help=help_
    )


PLOT_FORMATS = ("png", "svg", "pdf")


def check_plot_path(path: str) -> None:
    """`--plot FILE` can be written: its folder exists and its extension is a format the plot takes.
    Checked before any work (a drill runs for minutes before it plots); matplotlib's own errors there
    were tracebacks.

    Raises:
        SpecError: naming `--plot`.
    """
    import os

    from orchestrator.errors import SpecError

    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise SpecError(f"--plot: {path}: no such directory {folder}")
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        raise SpecError(f"--plot: {path}: give a .png, .svg or .pdf file")


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) as an exception: what a command cleans up on Ctrl-C (`finally`, context managers)
    it cleans up on it too, and it exits 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def raise_on_terminate() -> None:
    """Make SIGTERM and SIGHUP raise `Terminated` in the main thread (a command whose work must not outlive it:
    `torchrig drill` stops the run it started)."""

    def _raise(signum: int, frame: object) -> None:
        raise Terminated(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)


def handle_errors(func: F) -> F:
    """Turn TorchrigError into `error: ...` lines on stderr and its exit code; never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except TorchrigError as exc:
            for line in exc.lines():
                click.echo(f"error: {line}", err=True)
            sys.exit(exc.exit_code)
        except Terminated as exc:
            click.echo(f"stopped by {signal.Signals(exc.signum).name}", err=True)
            sys.exit(128 + exc.signum)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]


set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="PATH=VALUE",
    help="Override a field of the job file, Helm-style (repeatable): --set spec.training.steps=10. "
    "Precedence: --set > file > defaults.",
)

output_option = click.option(
    "--output",
    "-o",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="`json` prints one machine-readable JSON document on stdout.",
)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
