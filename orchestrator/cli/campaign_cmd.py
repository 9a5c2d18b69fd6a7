"""`torchrig drill campaign`: every scenario x seeds against one job, a report card, and a CI gate."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import click

from orchestrator.cli._common import (
    emit_json,
    handle_errors,
    output_option,
    raise_on_terminate,
    seconds_option,
    set_option,
)
from orchestrator.drills.campaign import CampaignProgress

if TYPE_CHECKING:
    from orchestrator.drills.campaign import Case, CaseResult
    from orchestrator.drills.plan import DrillOptions
    from orchestrator.drills.report import DrillReport
    from orchestrator.spec import JobSpec


@click.command(
    name="campaign",
    help="Run every chosen drill SCENARIO for every seed against JOB, with one uninterrupted reference per "
    "world size shared by all cases, and write a report card to --out: report.json (every case and "
    "per-scenario aggregates), junit.xml (one testcase per scenario x seed) and report.html (one "
    "self-contained page). Scenarios the job cannot take are reported as skipped with the reason. Running "
    "it again with the same --out skips the cases already finished there.",
    epilog="Examples:\n\n"
    "  torchrig drill campaign examples/digits-ddp.yaml --out drills/\n\n"
    "  torchrig drill campaign job.yaml --scenarios kill-worker,hang --seed-list 7,8 --max-failures 1 --out drills/\n\n"
    "Exit codes: 0 every case that could run passed, 1 a case failed, was inconclusive or could not run (or "
    "--max-failures stopped the campaign), 2 bad input, 130 interrupted (run it again with the same --out to "
    "resume).",
)
@click.argument("job", type=click.Path(dir_okay=False))
@click.option(
    "--scenarios",
    default="all",
    show_default=True,
    help="`all` (every registered scenario) or a comma-separated list.",
)
@click.option("--seeds", "num_seeds", type=int, default=None, help="Seeds 0..N-1 (default 3).")
@click.option("--seed-list", default=None, help="Comma-separated seeds instead of --seeds: 7,8,9.")
@click.option(
    "--backend",
    type=click.Choice(["local", "ray", "kubernetes"]),
    default="local",
    show_default=True,
    help="Where the drills run (kubernetes: kill-worker only, the others are skipped).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Directory for the cases and reports (default runs/<job>/campaign-<time>); reuse one to resume.",
)
@click.option("--max-failures", type=click.IntRange(min=1), default=None, help="Stop after K failed cases.")
@seconds_option("--timeout", "timeout_s", 900.0, "Seconds before a run counts as stuck.")
@seconds_option("--hang-timeout", "hang_timeout", 10.0, "hang, partition: watchdog seconds.")
@set_option
@output_option
@handle_errors
def campaign(
    job: str,
    scenarios: str,
    num_seeds: int | None,
    seed_list: str | None,
    backend: str,
    out_dir: str | None,
    max_failures: int | None,
    timeout_s: float,
    hang_timeout: float,
    overrides: tuple[str, ...],
    output: str,
) -> None:
    from orchestrator.drills.campaign import CampaignOptions, parse_scenarios, parse_seeds, run_campaign
    from orchestrator.drills.plan import DrillOptions
    from orchestrator.loader import load_spec

    names = parse_scenarios(scenarios)
    seeds = parse_seeds(num_seeds, seed_list)
    spec = load_spec(job, list(overrides))
    out = out_dir or f"runs/{spec.name}/campaign-{time.strftime('%Y%m%d-%H%M%S')}"
    options = CampaignOptions(
        scenarios=names,
        seeds=seeds,
        out_dir=out,
        drill=DrillOptions(backend=backend, timeout_s=timeout_s, hang_timeout_s=hang_timeout),
        max_failures=max_failures,
        job_file=job,
    )
    drill = _kubernetes_drill if backend == "kubernetes" else None
    raise_on_terminate()  # SIGTERM stops the running case's run instead of orphaning its agents
    if output == "json":
        result = run_campaign(spec, options, drill=drill)
        emit_json(result.to_dict())
    else:
        with _RichProgress() as progress:
            result = run_campaign(spec, options, drill=drill, progress=progress)
        _print_summary(result.to_dict(), out)
    sys.exit(result.exit_code)


def _kubernetes_drill(scenario: str, spec: JobSpec, options: DrillOptions) -> DrillReport:
    from orchestrator.drills.kubernetes import run_kubernetes_kill_worker

    return run_kubernetes_kill_worker(spec, seed=options.seed, timeout_s=options.timeout_s)


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


_STYLE = {
    "passed": "green",
    "failed": "red",
    "inconclusive": "magenta",
    "error": "yellow",
    "skipped": "dim",
    "not-run": "dim",
}


class _RichProgress(CampaignProgress):
    """A progress bar with the campaign's own ETA on a terminal, one line per case everywhere (CI logs)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA {task.fields[eta]}"),
            console=self.console,
            transient=True,
        )
        self.task: Any = None
        self.total = 0
        self.t0 = time.monotonic()

    def __enter__(self) -> _RichProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)

    def started(self, total: int, finished: int) -> None:
        self.total = total
        self.task = self.bar.add_task("campaign", total=total, eta="-:--")
        if finished:
            self.console.print(f"[dim]{finished} of {total} cases skipped or already finished in --out[/]")

    def case_started(self, case: Case, index: int) -> None:
        self.bar.update(self.task, description=f"{case.scenario} seed {case.seed}")

    def case_finished(self, result: CaseResult, index: int, eta_s: float | None) -> None:
        self.bar.update(self.task, completed=index, eta=_clock(eta_s))
        state = str(result.state)
        label = state.upper() if state != "passed" else "PASS"
        report = result.report or {}
        detail = result.reason or ""
        if report:
            mttr, lost = report.get("mttr_seconds"), report.get("lost_steps")
            detail = (
                f"{result.duration_s:.1f} s, MTTR {'-' if mttr is None else f'{mttr:.2f} s'}, "
                f"lost {'-' if lost is None else lost}" + (" (finished earlier)" if result.resumed else "")
            )
            failed = [c["name"] for c in result.failed_checks]
            if state == "inconclusive":
                detail += f"; {result.reason}"  # its failed checks only show the fault came too late
            elif failed:
                detail += "; failed: " + "; ".join(failed)
        elapsed = _clock(time.monotonic() - self.t0)
        self.console.print(
            f"[{index}/{self.total}] [{_STYLE.get(state, 'white')}]{label:<7}[/] {result.scenario} seed {result.seed}"
            f"  {detail}  [dim]({elapsed} elapsed, ETA {_clock(eta_s)})[/]",
            highlight=False,
            soft_wrap=True,  # one line per case in CI logs, however narrow the log's idea of a terminal
        )


def _print_summary(data: dict[str, Any], out: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def num(value: Any) -> str:
        return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)

    verdict = "[bold green]PASS[/]" if data["verdict"] == "pass" else "[bold red]FAIL[/]"
    table = Table(title=f"drill campaign {data['campaign']['job']}: {verdict}")
    for column in ("scenario", "passed", "MTTR s: median/p90/max", "lost steps: median/max", "recovery"):
        table.add_column(column, no_wrap=True)
    skipped = []
    for scenario, agg in data["scenarios"].items():
        mttr, lost = agg["mttr_s"], agg["lost_steps"]
        passed = f"{agg['passed']}/{agg['ran']}" if agg["ran"] else "skipped"
        if agg.get("inconclusive"):
            passed += f", {agg['inconclusive']} inconclusive"
        if agg["not_run"]:
            passed += f", {agg['not_run']} not run"
        if agg.get("skip_reason"):
            skipped.append(f"{scenario}: {agg['skip_reason']}")
        paths = ", ".join(f"{k} x{v}" for k, v in sorted(agg["recovery_paths"].items())) or "-"
        table.add_row(
            scenario,
            passed,
            "/".join(num(mttr[k]) for k in ("median", "p90", "max")),
            "/".join(num(lost[k]) for k in ("median", "max")),
            paths,
        )
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)  # a CI log: no need to squeeze into 80 columns
    console.print(table)
    for line in skipped:
        console.print(f"[dim]skipped {line}[/]", soft_wrap=True)
    console.print(f"report card: {out}/report.html  junit: {out}/junit.xml  json: {out}/report.json", soft_wrap=True)
