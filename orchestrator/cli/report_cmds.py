"""`torchrig report RUN_DIR`: what a finished run did, from summary.json, metrics.jsonl and events.jsonl."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import click

from orchestrator.cli._common import emit_json, handle_errors, output_option
from orchestrator.errors import SpecError

__all__ = ["build_report", "report", "write_plot"]


def build_report(run_dir: Path) -> dict[str, Any]:
    """The summary plus figures derived from the metrics and events history.

    Raises:
        SpecError: RUN_DIR holds no run (no summary.json, metrics.jsonl or events.jsonl).
    """
    from orchestrator.backends._local_rundir import RunFiles, read_json, read_jsonl, world_sizes_from_events

    files = RunFiles(run_dir)
    summary = read_json(files.summary)
    metrics = read_jsonl(files.metrics)
    events = read_jsonl(files.events)
    if summary is None and not metrics and not events:
        raise SpecError(f"RUN_DIR: {run_dir} holds no summary.json, metrics.jsonl or events.jsonl")
    rate = [float(m["samples_per_s"]) for m in metrics if isinstance(m.get("samples_per_s"), (int, float))]
    losses = [float(m["loss"]) for m in metrics if isinstance(m.get("loss"), (int, float))]
    commits = [e for e in events if e.get("event") == "checkpoint_committed" and e.get("rank", 0) == 0]
    blocked = [float(e["blocked_s"]) for e in commits if isinstance(e.get("blocked_s"), (int, float))]
    derived = {
        "records": len(metrics),
        "first_loss": losses[0] if losses else None,
        "min_loss": min(losses) if losses else None,
        "samples_per_s_median": statistics.median(rate) if rate else None,
        "checkpoints_committed": len(commits),
        "checkpoint_blocked_s_max": max(blocked) if blocked else None,
        "store_failures": sum(1 for e in events if e.get("event") == "store_failure"),
        "faults": sum(1 for e in events if e.get("event") == "fault"),
        "watchdog": sum(1 for e in events if e.get("event") == "watchdog"),
        "world_sizes": world_sizes_from_events(events),
    }
    return {"run_dir": str(run_dir), "summary": summary or {}, "derived": derived}


def write_plot(run_dir: Path, out: Path) -> None:
    """Loss, samples/s and world size over time (seconds since the first record) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from orchestrator.backends._local_rundir import RunFiles, read_jsonl

    files = RunFiles(run_dir)
    metrics = [m for m in read_jsonl(files.metrics) if isinstance(m.get("time"), (int, float))]
    starts = sorted(
        (e for e in read_jsonl(files.events) if e.get("event") == "start" and isinstance(e.get("time"), (int, float))),
        key=lambda e: float(e["time"]),
    )
    times = [float(m["time"]) for m in metrics] + [float(e["time"]) for e in starts]
    if not times:
        raise SpecError(f"RUN_DIR: {run_dir} has no timed metrics or events to plot")
    t0 = min(times)
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    xs = [float(m["time"]) - t0 for m in metrics]
    axes[0].plot(xs, [m.get("loss") for m in metrics], marker=".")
    axes[0].set_ylabel("loss")
    axes[1].plot(xs, [m.get("samples_per_s") for m in metrics], marker=".")
    axes[1].set_ylabel("samples/s")
    if starts:
        axes[2].step([float(e["time"]) - t0 for e in starts], [e.get("world_size") for e in starts], where="post")
    axes[2].set_ylabel("world size")
    axes[2].set_xlabel("seconds since start")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(value.items())) or "-"
    return "-" if value is None else str(value)


@click.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(file_okay=False))
@output_option
@click.option(
    "--plot",
    "plot",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a PNG of loss, samples/s and world size over time.",
)
@handle_errors
def report(run_dir: str, output: str, plot: str | None) -> None:
    """Summarise a finished run from its run directory (a path or local://path)."""
    from rich.console import Console
    from rich.table import Table

    path = Path(run_dir.removeprefix("local://"))
    if not path.is_dir():
        raise SpecError(f"RUN_DIR: no such directory: {path}")
    data = build_report(path)
    if plot:
        write_plot(path, Path(plot))
    if output == "json":
        emit_json(data)
        return
    summary, derived = data["summary"], data["derived"]
    table = Table(title=f"run {path}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("status", summary.get("status")),
        ("steps", f"{_fmt(summary.get('steps'))} / {_fmt(summary.get('total_steps'))}"),
        ("final loss", summary.get("final_loss")),
        ("first / min loss", f"{_fmt(derived['first_loss'])} / {_fmt(derived['min_loss'])}"),
        ("eval", summary.get("eval")),
        (
            "samples/s (result / median)",
            f"{_fmt(summary.get('samples_per_s'))} / {_fmt(derived['samples_per_s_median'])}",
        ),
        ("wall s", summary.get("wall_s")),
        ("restarts", summary.get("restarts")),
        ("world sizes", summary.get("world_sizes") or derived["world_sizes"]),
        ("restored from", [f"{r.get('store')}@{r.get('step')}" for r in summary.get("restored_from", [])]),
        ("checkpoints committed", derived["checkpoints_committed"]),
        ("max blocked s", derived["checkpoint_blocked_s_max"]),
        (
            "store failures / faults / watchdog",
            f"{derived['store_failures']} / {derived['faults']} / {derived['watchdog']}",
        ),
        ("params sha256", summary.get("params_sha256")),
    ]
    for ck in summary.get("checkpoints", []):
        rows.append((f"store {ck.get('name')}", f"{ck.get('uri')} (last step {_fmt(ck.get('last_committed_step'))})"))
    if summary.get("reason"):
        rows.append(("reason", summary["reason"]))
    for key, value in rows:
        table.add_row(key, _fmt(value))
    Console().print(table)
    if plot:
        click.echo(f"plot: {plot}")
