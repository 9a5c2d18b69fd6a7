"""`torchrig drill`: prove a job survives a fault before a big run depends on it."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from orchestrator.cli._common import (
    check_plot_path,
    emit_json,
    handle_errors,
    output_option,
    raise_on_terminate,
    seconds_option,
    set_option,
)
from orchestrator.drills.damage import CorruptionKind

if TYPE_CHECKING:
    from orchestrator.drills.report import DrillReport
    from orchestrator.spec import JobSpec


def _scenario_help() -> str:
    """The scenario list of `--help`, from the scenarios themselves (as README and docs/drills.md are)."""
    from orchestrator.drills.scenarios import SCENARIOS

    width = max(map(len, SCENARIOS)) + 2
    lines = [f"  {name:<{width}} {cls.summary}" for name, cls in SCENARIOS.items()]
    return "\b\nScenarios:\n" + "\n".join(lines) + "\n"


_SCENARIO_HELP = _scenario_help()


class _DrillCommand(click.Command):
    """`torchrig drill SCENARIO JOB`; `torchrig drill campaign JOB` goes to `orchestrator.cli.campaign_cmd`
    (a scenario argument, not a group, keeps every existing drill command line as it is)."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        if args and args[0] == "campaign":
            from orchestrator.cli.campaign_cmd import campaign

            return campaign.make_context(f"{info_name} campaign", args[1:], parent=parent, **extra)
        return super().make_context(info_name, args, parent=parent, **extra)


@click.command(
    cls=_DrillCommand,
    help="Run JOB, inject the fault of SCENARIO, let the job recover, run an uninterrupted reference of "
    "the same job (same seed and world size), and print a verdict.\n\n" + _SCENARIO_HELP,
    epilog="Examples:\n\n"
    "  torchrig drill kill-worker examples/digits-ddp.yaml --set spec.training.steps=60 --report drill.json\n\n"
    "  torchrig drill kill-node examples/digits-ddp.yaml --nodes 2 --plot drill.png\n\n"
    "  torchrig drill campaign examples/digits-ddp.yaml --out drills/   (every scenario x 3 seeds; "
    "`torchrig drill campaign --help`)\n\n"
    "Exit codes: 0 the job passed the drill, 1 the verdict failed, 2 bad input, 3 backend error, "
    "6 inconclusive (the fault struck after the job had finished: more steps or an earlier --at-step).",
)
@click.argument("scenario", metavar="SCENARIO")
@click.argument("job", type=click.Path(dir_okay=False))
@click.option(
    "--backend",
    default="local",
    show_default=True,
    help="local or ray; kubernetes runs kill-worker against a cluster (deletes a pod through the API).",
)
@click.option("--seed", default=0, show_default=True, help="Seeds the choice of rank, step and damage.")
@click.option("--at-step", type=int, default=None, help="Inject the fault at this step (default: random).")
@click.option("--rank", type=int, default=None, help="Rank to hit (kubernetes: node index; default: random).")
@click.option(
    "--nodes", type=click.IntRange(min=1), default=None, help="Emulated nodes (local backend); kill-node needs 2."
)
@click.option("--no-reference", is_flag=True, help="Skip the uninterrupted reference run (no params check).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), help="Write the JSON report here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a PNG of throughput and world size.")
@click.option("--drill-dir", type=click.Path(file_okay=False), help="Directory for the runs (default under runs/).")
@seconds_option("--timeout", "timeout_s", 900.0, "Seconds before a run counts as stuck.")
@click.option(
    "--corruption",
    type=click.Choice([kind.value for kind in CorruptionKind]),
    help="corrupt-checkpoint: which damage (default: random by seed).",
)
@seconds_option("--hang-timeout", "hang_timeout", 10.0, "hang: watchdog seconds.")
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="kill-worker: kill N times in a row, once after each checkpoint (kill g drawn from seed + g); "
    "this soaks the group-restart path (restarts.mode: restart), the in-place soak is `make soak`.",
)
@set_option
@output_option
@handle_errors
def drill(
    scenario: str,
    job: str,
    backend: str,
    seed: int,
    at_step: int | None,
    rank: int | None,
    nodes: int | None,
    no_reference: bool,
    report_path: str | None,
    plot_path: str | None,
    drill_dir: str | None,
    timeout_s: float,
    corruption: str | None,
    hang_timeout: float,
    repeat: int,
    overrides: tuple[str, ...],
    output: str,
) -> None:
    from orchestrator.drills import DrillOptions, run_drill
    from orchestrator.drills.damage import CorruptionKind
    from orchestrator.drills.history import RunHistory
    from orchestrator.drills.report import plot_report
    from orchestrator.drills.scenarios import get_scenario
    from orchestrator.loader import load_spec

    get_scenario(scenario)  # unknown names fail before anything runs
    if plot_path:
        check_plot_path(plot_path)
    spec = load_spec(job, list(overrides))
    if backend == "kubernetes":
        report = _kubernetes_drill(scenario, spec, seed, rank, timeout_s)
        _finish(report, report_path, output)
        return
    options = DrillOptions(
        backend=backend,
        seed=seed,
        at_step=at_step,
        rank=rank,
        nodes=nodes,
        reference=not no_reference,
        drill_dir=drill_dir,
        timeout_s=timeout_s,
        corruption=CorruptionKind(corruption) if corruption else None,
        hang_timeout_s=hang_timeout,
        repeat=repeat,
    )
    if output == "text":
        then = "" if no_reference else ", then an uninterrupted reference"
        click.echo(f"drill {scenario}: running {spec.name} on {backend} with the fault{then} ...", err=True)
    raise_on_terminate()  # SIGTERM stops the drill's run (kept on disk) instead of orphaning its agents
    report = run_drill(scenario, spec, options)
    if plot_path:
        plot_report(report, RunHistory.load(report.run_dir), plot_path)
    _finish(report, report_path, output)


def _kubernetes_drill(scenario: str, spec: JobSpec, seed: int, node: int | None, timeout_s: float) -> DrillReport:
    from orchestrator.drills.kubernetes import run_kubernetes_kill_worker
    from orchestrator.errors import UnsupportedFeature

    if scenario != "kill-worker":
        raise UnsupportedFeature(f"--backend kubernetes: only kill-worker runs on a cluster (got {scenario})")
    return run_kubernetes_kill_worker(spec, seed=seed, node_index=node, timeout_s=timeout_s)


def _finish(report: DrillReport, report_path: str | None, output: str) -> None:
    from orchestrator.drills.report import render_table

    if report_path:
        report.write(report_path)
    if output == "json":
        emit_json(report.to_dict())
    else:
        from rich.console import Console

        console = Console()
        console.print(render_table(report))
        for note in report.notes:
            console.print(f"[dim]note: {note}[/]")
    sys.exit(report.exit_code)
