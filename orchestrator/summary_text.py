"""How a run's numbers read in one line: `torchrig run`'s final line, the live view, `torchrig report`.

Every number says what it is (`train loss`, `eval loss`, `eval accuracy`), counts print as integers
(`eval count 360`, not `360.0000`), and a run that never completed a step says so instead of
`None/10 steps`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from orchestrator.backends.base import RunState
from training.contract import Summary

__all__ = ["final_line", "format_metrics", "format_value", "is_count_key", "no_step_ran"]

_COUNT_KEYS = frozenset({"count", "n", "num", "samples", "examples", "tokens", "total", "correct", "steps", "batches"})


def is_count_key(key: str) -> bool:
    """Whether a metric named `key` counts things (its integral floats print as integers)."""
    k = key.lower()
    return (
        k in _COUNT_KEYS or k.endswith(("_count", "_samples", "_tokens", "_examples")) or k.startswith(("num_", "n_"))
    )


def format_value(value: Any, key: str = "") -> str:
    """A number as a person reads it: 4 decimals, integers for counts, `-` for missing."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if value.is_integer() and is_count_key(key):
        return str(int(value))
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:.4f}"
    return f"{value:.4g}"


def format_metrics(metrics: Mapping[str, Any], prefix: str) -> list[str]:
    """`{loss: .1, accuracy: .9, count: 360.0}` -> `["eval loss 0.1000", "eval accuracy 0.9000", "eval count 360"]`
    (the loss first, the rest by name)."""
    keys = sorted(metrics, key=lambda k: (k != "loss", k))
    return [f"{prefix} {k} {format_value(metrics[k], k)}" for k in keys]


def no_step_ran(summary: Summary) -> bool:
    return not isinstance(summary.steps, int) or summary.steps <= 0


def final_line(summary: Summary) -> str:
    """The run's last line: what it reached, labelled (`train loss`, `eval loss`, ...), then where its
    summary is.

    Examples:
        `succeeded: 300/300 steps, train loss 0.0161, eval loss 0.1107, eval accuracy 0.9694, eval count 360, ...`
        `failed before the first step: cannot import 'training.examples.digitz'; 3.2 s, restarts 0`
    """
    tail: list[str] = []
    if isinstance(summary.samples_per_s, (int, float)):
        tail.append(f"{summary.samples_per_s:.0f} samples/s")
    tail.append(f"{summary.wall_s:.1f} s")
    tail.append(f"restarts {summary.restarts}")
    if summary.world_sizes:
        tail.append("world sizes " + " -> ".join(str(w) for w in summary.world_sizes))
    if no_step_ran(summary) and summary.status != RunState.SUCCEEDED.value:
        reason = summary.reason or "no step completed"
        head = f"{summary.status} before the first step: {reason}"
        return f"{head}; {', '.join(tail)}\nsummary: {summary.run_dir}/summary.json"
    total = f"/{summary.total_steps}" if summary.total_steps is not None else ""
    parts = [f"{summary.status}: {format_value(summary.steps)}{total} steps"]
    if isinstance(summary.final_loss, (int, float)):
        parts.append(f"train loss {format_value(summary.final_loss)}")
    parts += format_metrics(summary.eval, "eval")
    return ", ".join(parts + tail) + f"\nsummary: {summary.run_dir}/summary.json"
