"""The `torchrig` command line. Subcommands live in their own modules and load lazily, so
`torchrig validate` never imports torch, ray or kubernetes."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from orchestrator import __version__

__all__ = ["cli", "main"]

# name -> "module:attribute"; each module owns its commands.
_COMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("orchestrator.cli.spec_cmds:validate", "Check a job file; one line per problem."),
    "render": ("orchestrator.cli.spec_cmds:render", "Print the manifests or command a target would get."),
    "schema": ("orchestrator.cli.spec_cmds:schema", "Print the JSON Schema of job files."),
    "run": ("orchestrator.cli.run_cmds:run", "Run a job (local elastic launcher or Ray) and watch it."),
    "submit": ("orchestrator.cli.run_cmds:submit", "Submit a job and return at once (Kubernetes, Ray, local)."),
    "status": ("orchestrator.cli.run_cmds:status", "Show a run's state; the exit code says it too."),
    "logs": ("orchestrator.cli.run_cmds:logs", "Print (or follow) a run's worker logs."),
    "cancel": ("orchestrator.cli.run_cmds:cancel", "Stop a run; its last checkpoint is kept."),
    "list": ("orchestrator.cli.run_cmds:list_runs", "List runs on a backend."),
    "checkpoints": ("orchestrator.cli.checkpoint_cmds:checkpoints", "List, verify and inspect checkpoints in stores."),
    "drill": ("orchestrator.cli.drill_cmds:drill", "Inject a fault into a job and judge its recovery."),
    "report": ("orchestrator.cli.report_cmds:report", "Summarise a finished run from its run directory."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when invoked (or listed in --help)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | {n for n, _ in self._available()})

    def _available(self) -> list[tuple[str, str]]:
        return [(name, target) for name, (target, _) in _COMMANDS.items()]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _COMMANDS:
            module_name, attr = _COMMANDS[cmd_name][0].split(":")
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name == module_name:
                    return _unavailable(cmd_name, _COMMANDS[cmd_name][1])
                raise
            command = getattr(module, attr)
            assert isinstance(command, click.Command)
            return command
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help without importing every module.
        rows = [(name, help_) for name, (_, help_) in sorted(_COMMANDS.items())]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _unavailable(name: str, help_: str) -> click.Command:
    @click.command(name=name, help=help_ + " (not available in this build)")
    def _cmd() -> None:
        raise click.ClickException(f"`torchrig {name}` is not available in this build")

    return _cmd


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=(
        "Examples:\n\n"
        "  torchrig validate examples/digits-ddp.yaml\n\n"
        "  torchrig render examples/digits-ddp.yaml --target pytorchjob | kubectl apply -f -\n\n"
        "  torchrig run examples/digits-ddp.yaml --set spec.training.steps=50\n\n"
        "  torchrig drill kill-worker examples/digits-ddp.yaml --report drill.json\n\n"
        "Exit codes: 0 ok, 1 job or verdict failed, 2 bad input, 3 backend error, 4 recovery failed, "
        "5 final checkpoint committed to no store, 6 drill inconclusive, 130 cancelled, 141 stdout's reader exited, "
        "143 a drill stopped by SIGTERM (docs/operations.md)."
    ),
)
@click.version_option(__version__, prog_name="torchrig")
def cli() -> None:
    """torchrig: one job spec for distributed PyTorch training, run on a laptop, Ray or Kubernetes.

    Workers restart elastically, resume from redundant verified checkpoints, export Prometheus
    metrics, and can be put through fault-tolerance drills before a big run depends on them.
    """


def main(argv: list[str] | None = None) -> Any:
    """Console-script entry point."""
    if argv is not None:
        return cli.main(args=argv, prog_name="torchrig")
    try:
        return cli.main(prog_name="torchrig")
    except SystemExit as exc:
        # The process's own entry point with torch imported (a run's preflight loads the task): end without
        # the interpreter's teardown, ~1 s of freeing torch's modules after `submit` or a run has ended
        # (`training.fastexit`: threads joined, atexit handlers run, streams flushed).
        if (exc.code is None or isinstance(exc.code, int)) and "torch" in sys.modules:
            from training.fastexit import exit_now

            exit_now(exc.code or 0)
        raise
