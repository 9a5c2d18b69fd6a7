"""`torchrig report RUN_DIR`: what a finished run did, from summary.json, metrics.jsonl and events.jsonl."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any

import click

from orchestrator.backends.base import RunState
from orchestrator.cli._common import check_plot_path, emit_json, handle_errors, output_option
from orchestrator.errors import SpecError
from orchestrator.summary_text import format_value, is_count_key

__all__ = ["build_report", "loss_figures", "report", "typed_summary", "write_plot"]


def loss_figures(metrics: list[dict[str, Any]], final_loss: Any) -> tuple[float | None, float | None]:
    """First and lowest training loss of a run.

    metrics.jsonl holds rank 0's loss once per `logEvery` steps; the final loss (result.json: the mean
    over ranks of the last step) is a loss the run reached too, so the minimum includes it and can never
    be above it.
    """
    losses = [float(m["loss"]) for m in metrics if _is_number(m.get("loss"))]
    first = losses[0] if losses else None
    if _is_number(final_loss) and math.isfinite(final_loss):
        losses.append(float(final_loss))
    return first, (min(losses) if losses else None)


def _is_number(value: Any) -> bool:
    """A JSON number that converts to a float (an integer of 400 digits does not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, float) or abs(value) <= sys.float_info.max


def build_report(run_dir: Path) -> dict[str, Any]:
    """The summary plus figures derived from the metrics and events history.

    Raises:
        SpecError: RUN_DIR holds no run (no summary.json, metrics.jsonl or events.jsonl).
    """
    from orchestrator.rundir import world_sizes_from_events
    from training.contract import EventKind, RunFiles, read_events, read_json, read_jsonl

    files = RunFiles(run_dir)
    raw_summary = read_json(files.summary)
    summary = None if raw_summary is None else typed_summary(raw_summary)
    metrics = read_jsonl(files.metrics)
    events = read_events(files.events)
    if summary is None and not metrics and not events:
        raise SpecError(f"RUN_DIR: {run_dir} holds no summary.json, metrics.jsonl or events.jsonl")
    rate = [float(m["samples_per_s"]) for m in metrics if _is_number(m.get("samples_per_s"))]
    final_loss = (summary or {}).get("final_loss")
    if final_loss is None:
        finished = [e for e in events if e.kind is EventKind.FINISHED and e.rank == 0]
        final_loss = finished[-1].get("final_loss") if finished else None
    first_loss, min_loss = loss_figures(metrics, final_loss)
    commits = [e for e in events if e.kind is EventKind.CHECKPOINT_COMMITTED and e.rank == 0]
    blocked = [float(e.get("blocked_s")) for e in commits if _is_number(e.get("blocked_s"))]
    derived = {
        "records": len(metrics),
        "first_loss": first_loss,
        "min_loss": min_loss,
        "samples_per_s_median": statistics.median(rate) if rate else None,
        "checkpoints_committed": len(commits),
        "checkpoint_blocked_s_max": max(blocked) if blocked else None,
        "store_failures": sum(1 for e in events if e.kind is EventKind.STORE_FAILURE),
        "faults": sum(1 for e in events if e.kind is EventKind.FAULT),
        "watchdog": sum(1 for e in events if e.kind is EventKind.WATCHDOG),
        "world_sizes": world_sizes_from_events(events),
        # `metrics.profile` captures: where each one is, and how busy the device was in it.
        "profiles": [
            {
                "rank": e.rank,
                "generation": e.generation,
                "steps": [e.get("first_step"), e.get("last_step")],
                "table": str(run_dir / str(e.get("table"))),
                "trace": str(run_dir / str(e.get("trace"))),
                "wall_s": e.get("wall_s"),
                "host_time_s": e.get("host_time_s"),
                "device_time_s": e.get("device_time_s"),
            }
            for e in events
            if e.kind is EventKind.PROFILE
        ],
    }
    return {"run_dir": str(run_dir), "summary": summary or {}, "derived": derived}


# summary.json's fields by type: the file is untrusted input, and a field of another type is left out
# of the report rather than failing it (`torchrig report` must explain a damaged run too).
_NUMBER = (int, float)
_SUMMARY_TYPES: dict[str, tuple[type, ...]] = {
    "status": (str,),
    "steps": (int,),
    "total_steps": (int,),
    "restarts": (int,),
    "worker_exit": (int,),
    "final_loss": _NUMBER,
    "samples_per_s": _NUMBER,
    "wall_s": _NUMBER,
    "params_sha256": (str,),
    "run_dir": (str,),
    "reason": (str,),
    "failure_log": (str,),
    "recoveries": (dict,),
    "preempted": (dict,),
    "final_checkpoint": (dict,),
}


def typed_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """summary.json's object with every known field of the wrong type dropped (unknown fields kept)."""
    from orchestrator.rundir import metric_map

    out = {
        k: v
        for k, v in raw.items()
        if k not in _SUMMARY_TYPES or (isinstance(v, _SUMMARY_TYPES[k]) and not isinstance(v, bool))
    }
    out["eval"] = metric_map(raw.get("eval"))
    for key in ("restored_from", "checkpoints"):
        value = raw.get(key)
        out[key] = [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []
    sizes = raw.get("world_sizes")
    out["world_sizes"] = (
        [w for w in sizes if isinstance(w, int) and not isinstance(w, bool)] if isinstance(sizes, list) else []
    )
    return out


def write_plot(run_dir: Path, out: Path) -> None:
    """The run plot (`orchestrator.plot`): loss, samples/s and world size against step and wall time,
    with faults, restarts, restores, outages and checkpoint commits.

    Raises:
        SpecError: the run has no timed metrics or events to plot.
    """
    from orchestrator.plot import plot_run
    from training.contract import RunFiles, read_jsonl

    files = RunFiles(run_dir)
    if not read_jsonl(files.metrics) and not read_jsonl(files.events):
        raise SpecError(f"RUN_DIR: {run_dir} has no timed metrics or events to plot")
    plot_run(run_dir, out)


def _fmt(value: Any, key: str = "") -> str:
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_fmt(v, k)}" for k, v in sorted(value.items())) or "-"
    if isinstance(value, float) and not (value.is_integer() and is_count_key(key)):
        return f"{value:.4g}"
    return format_value(value, key)


def _status_text(summary: dict[str, Any]) -> str:
    status, steps = summary.get("status"), summary.get("steps")
    if status in (RunState.FAILED.value, RunState.CANCELLED.value) and not (isinstance(steps, int) and steps > 0):
        return f"{status} before the first step"
    return _fmt(status)


@click.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(file_okay=False))
@output_option
@click.option(
    "--plot",
    "plot",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a PNG of loss, samples/s and world size against step and wall time, with faults, "
    "restarts, restores, outages and checkpoint commits marked.",
)
@handle_errors
def report(run_dir: str, output: str, plot: str | None) -> None:
    """Summarise a finished run from its run directory (a path or local://path)."""
    from rich.console import Console
    from rich.table import Table

    path = Path(run_dir.removeprefix("local://"))
    if not path.is_dir():
        raise SpecError(f"RUN_DIR: no such directory: {path}")
    if plot:
        check_plot_path(plot)
    data = build_report(path)
    if plot:
        write_plot(path, Path(plot))
    if output == "json":
        emit_json(data)
        return
    summary, derived = data["summary"], data["derived"]
    table = Table(title=f"run {path}", show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")  # paths and hashes whole: people copy them
    rows: list[tuple[str, Any]] = [
        ("status", _status_text(summary)),
        ("steps", f"{_fmt(summary.get('steps') or 0)} / {_fmt(summary.get('total_steps'))}"),
        ("train loss (final)", summary.get("final_loss")),
        ("train loss (first / min)", f"{_fmt(derived['first_loss'])} / {_fmt(derived['min_loss'])}"),
    ]
    eval_metrics = summary.get("eval") or {}
    rows += [(f"eval {k}", _fmt(eval_metrics[k], k)) for k in sorted(eval_metrics, key=lambda k: (k != "loss", k))]
    rows += [
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
    for prof in derived["profiles"]:
        first, last = prof["steps"]
        busy = (
            f", device busy {prof['device_time_s'] / prof['wall_s']:.0%}"
            if _is_number(prof["wall_s"])
            and prof["wall_s"]
            and _is_number(prof["device_time_s"])
            and prof["device_time_s"] > 0
            else ""
        )
        rows.append(
            (f"profile rank {prof['rank']} gen {prof['generation']}", f"steps {first}-{last}{busy}: {prof['table']}")
        )
    if summary.get("reason"):
        rows.append(("reason", summary["reason"]))
    for key, value in rows:
        table.add_row(key, _fmt(value))
    Console().print(table)
    if plot:
        click.echo(f"plot: {plot}")
