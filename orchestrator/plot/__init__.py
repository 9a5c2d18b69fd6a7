"""The run plot: loss, throughput and world size against step and wall time, with the run's faults,
restarts, restores, outages and checkpoint commits.

One drawing for `torchrig report RUN --plot` and `torchrig drill --plot`:

    from orchestrator.plot import plot_run
    plot_run(run_dir, "run.png")                                        # report
    plot_run(history, "drill.png", fault_times=[...], title="drill ...")  # drill (a RunHistory)

`timeline` computes what is drawn (pure, tested on synthetic events); `render` draws it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from orchestrator.plot.timeline import Interval, Marker, RunTimeline, Series, build_timeline
from training.contract import Event, RunFiles, Summary, read_events, read_jsonl

__all__ = ["Interval", "Marker", "RunRecords", "RunTimeline", "Series", "build_timeline", "plot_run"]


class RunRecords(Protocol):
    """A run already read (the drills' `RunHistory` is one)."""

    run_dir: Path
    events: list[Event]
    metrics: list[dict[str, Any]]
    summary: Summary | None


def _job_name(run_dir: Path) -> str:
    """metadata.name from the run's job.yaml (the run directory's name when it cannot be read)."""
    from orchestrator.errors import SpecError
    from orchestrator.loader import MAX_SPEC_BYTES, read_yaml
    from training.contract.files import read_text

    # Bounded in size and depth: a run directory's files are untrusted (`[[[[...` made yaml recurse).
    text = read_text(RunFiles(run_dir).job, max_bytes=MAX_SPEC_BYTES)
    try:
        name = read_yaml(text)["metadata"]["name"] if text is not None else None
    except (SpecError, KeyError, TypeError):
        name = None
    return run_dir.name if name is None else str(name)


def _describe(run_dir: Path, summary: Summary | None, tl: RunTimeline) -> str:
    parts = [str(run_dir)]
    if summary is not None:
        parts.append(f"{summary.status}, {summary.steps}/{summary.total_steps} steps")
    restarts = len(tl.restarts)
    parts.append(f"{restarts} restart{'s' if restarts != 1 else ''}")
    lost = sum(
        c.last_step - c.resumed_from for c in tl.outages if c.last_step is not None and c.resumed_from is not None
    )
    if tl.outages:
        down = sum(c.end - c.start for c in tl.outages)
        parts.append(f"{down:.1f} s without steps, {lost} steps redone")
    parts.append(f"{len(tl.checkpoints)} checkpoint commits")
    return "  |  ".join(parts)


def plot_run(
    run: str | os.PathLike[str] | RunRecords,
    path: str | os.PathLike[str],
    *,
    fault_times: Sequence[float] = (),
    title: str | None = None,
) -> RunTimeline:
    """Draw the run plot of a run directory (or of a run already read) into the PNG `path`.

    Args:
        run: The run directory, or its records (an object with `run_dir`, `events`, `metrics`, `summary`).
        path: Where the PNG goes.
        fault_times: Absolute times (`time.time()`) of faults injected from outside the workers (a
            drill killing a node), drawn like the workers' own `fault` events.
        title: The figure's title (default: "torchrig run <name>").

    Returns:
        What was drawn.
    """
    from orchestrator.plot.render import render

    if isinstance(run, (str, os.PathLike)):
        files = RunFiles(run)
        run_dir, events, metrics, summary = (
            files.root,
            read_events(files.events),
            read_jsonl(files.metrics),
            Summary.read(files.summary),
        )
    else:
        run_dir, events, metrics, summary = run.run_dir, run.events, run.metrics, run.summary
    tl = build_timeline(metrics, events, fault_times=fault_times)
    render(tl, path, title=title or f"torchrig run {_job_name(run_dir)}", subtitle=_describe(run_dir, summary, tl))
    return tl
