"""Drawing the run plot (matplotlib, Agg backend): the one figure of `torchrig report --plot` and
`torchrig drill --plot`.

Two columns share their rows: the left one against the training step, the right one against wall
time. Rows: train loss (rank 0, one point per `logEvery` steps; the eval loss as a star), samples/s,
world size. Lines break where the run did not train; outages are shaded on the time axis and the
redone steps (restored step -> last step before the fault) on the step axis; faults, restarts and
restores are vertical lines labelled with their step; checkpoint commits are ticks along the bottom.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from orchestrator.plot.timeline import Marker, RunTimeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["render"]

C_LOSS = "tab:blue"
C_EVAL = "tab:brown"
C_RATE = "tab:cyan"
C_WORLD = "tab:green"
C_FAULT = "tab:red"
C_RESTART = "tab:orange"
C_RESTORE = "tab:purple"
C_COMMIT = "0.25"
C_OUTAGE = "tab:red"
C_REDONE = "tab:orange"
C_STARTUP = "0.6"


def _vline(ax: Axes, x: float | None, color: str, style: str, label: str | None, text: str | None) -> None:
    if x is None:
        return
    ax.axvline(x, color=color, linestyle=style, linewidth=1.2, label=label, zorder=3)
    if text:
        ax.annotate(
            text,
            xy=(x, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, -3),
            textcoords="offset points",
            rotation=90,
            va="top",
            ha="left",
            fontsize=7.5,
            color=color,
        )


def _ticks(ax: Axes, xs: Sequence[float], label: str | None) -> None:
    if xs:
        ax.plot(
            list(xs),
            [0.0] * len(xs),
            linestyle="none",
            marker="|",
            markersize=9,
            markeredgewidth=1.5,
            color=C_COMMIT,
            transform=ax.get_xaxis_transform(),
            clip_on=False,
            label=label,
            zorder=4,
        )


def _note(ax: Axes, x: float, text: str) -> None:
    ax.annotate(
        text,
        xy=(x, 0.86),
        xycoords=("data", "axes fraction"),
        ha="center",
        va="center",
        fontsize=8,
        color="0.25",
        bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "0.7", "alpha": 0.85},
        zorder=7,
    )


def _markers(ax: Axes, tl: RunTimeline, *, by_step: bool, top: bool, note: bool = False) -> None:
    """Faults, restarts, restores, outages and commits on one panel (texts on the top row only)."""

    def x(m: Marker) -> float | None:
        return (None if m.step is None else float(m.step)) if by_step else m.time

    def once(label: str, seen: set[str]) -> str | None:
        if label in seen:
            return None
        seen.add(label)
        return label

    seen: set[str] = set()
    if by_step:
        for cut in tl.outages:
            if cut.resumed_from is not None and cut.last_step is not None and cut.last_step > cut.resumed_from:
                ax.axvspan(
                    cut.resumed_from,
                    cut.last_step,
                    color=C_REDONE,
                    alpha=0.15,
                    lw=0,
                    label=once("redone steps (lost work)", seen),
                )
                if note:
                    _note(
                        ax, (cut.resumed_from + cut.last_step) / 2, f"{cut.last_step - cut.resumed_from} steps redone"
                    )
    else:
        if tl.startup is not None:
            ax.axvspan(
                tl.startup.start, tl.startup.end, color=C_STARTUP, alpha=0.15, lw=0, label=once("starting", seen)
            )
        for cut in tl.outages:
            ax.axvspan(cut.start, cut.end, color=C_OUTAGE, alpha=0.12, lw=0, label=once("outage (no steps)", seen))
            if note:
                _note(ax, (cut.start + cut.end) / 2, f"no steps for {cut.end - cut.start:.1f} s")
    for m in tl.faults:
        _vline(ax, x(m), C_FAULT, "--", once("fault", seen), m.label if top else None)
    if not by_step:  # on the step axis a restart sits on its restore
        for m in tl.restarts:
            _vline(ax, x(m), C_RESTART, "-.", once("restart (group re-formed)", seen), m.label if top else None)
    for m in tl.restores:
        _vline(ax, x(m), C_RESTORE, ":", once("restore", seen), m.label if top else None)
    xs = [v for v in (x(m) for m in tl.checkpoints) if v is not None]
    _ticks(ax, xs, once("checkpoint commit", seen))


def _loss_scale(ax: Axes, values: Sequence[float]) -> None:
    finite = [v for v in values if not math.isnan(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        ax.set_yscale("log")


def render(tl: RunTimeline, path: str | os.PathLike[str], *, title: str, subtitle: str = "") -> None:
    """Write the run plot of `tl` to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        3,
        2,
        figsize=(13, 9),
        dpi=100,
        sharex="col",
        gridspec_kw={"height_ratios": [3, 2.2, 1.3], "hspace": 0.12, "wspace": 0.14},
    )
    s = tl.series
    columns: list[tuple[bool, list[float]]] = [(True, s.steps), (False, s.times)]
    for col, (by_step, xs) in enumerate(columns):
        loss_ax, rate_ax, world_ax = axes[0][col], axes[1][col], axes[2][col]
        loss_ax.plot(xs, s.loss, marker=".", color=C_LOSS, label="train loss (rank 0)", zorder=5)
        if tl.eval_loss:
            loss_ax.plot(
                [float(st) if by_step else t for st, t, _ in tl.eval_loss],
                [v for _, _, v in tl.eval_loss],
                linestyle="none",
                marker="*",
                markersize=11,
                color=C_EVAL,
                label="eval loss",
                zorder=6,
            )
        _loss_scale(loss_ax, s.loss + [v for _, _, v in tl.eval_loss])
        rate_ax.plot(xs, s.samples_per_s, marker=".", color=C_RATE, label="samples/s", zorder=5)
        rate_ax.set_ylim(bottom=0)
        wx, wy = tl.world_size_step if by_step else tl.world_size_time
        world_ax.plot(wx, wy, color=C_WORLD, linewidth=2.5, label="world size", zorder=5)
        finite_sizes = [v for v in wy if not math.isnan(v)]
        world_ax.set_ylim(0, (max(finite_sizes) if finite_sizes else 1) * 1.35 + 0.5)
        world_ax.yaxis.get_major_locator().set_params(integer=True)
        for row, ax in enumerate((loss_ax, rate_ax, world_ax)):
            _markers(ax, tl, by_step=by_step, top=row == 0, note=row == 2)
            ax.grid(True, alpha=0.3)
        if not by_step:
            world_ax.set_xlim(left=0, right=max(tl.end, 1e-3) * 1.01)
        elif all(math.isnan(v) for v in xs):
            world_ax.set_xlim(0, 1)
            loss_ax.text(0.5, 0.5, "no step completed", transform=loss_ax.transAxes, ha="center", color="0.3")
        loss_ax.set_title("by training step" if by_step else "by wall time", fontsize=10)
        world_ax.set_xlabel("step" if by_step else "seconds since the run started")
    axes[0][0].set_ylabel("train loss")
    axes[1][0].set_ylabel("samples/s")
    axes[2][0].set_ylabel("world size")
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(6, len(handles)), fontsize=8.5)
    fig.suptitle(title, fontsize=12, y=0.985)
    if subtitle:
        fig.text(0.5, 0.945, subtitle, ha="center", fontsize=9, color="0.3")
    fig.subplots_adjust(left=0.07, right=0.98, top=0.91, bottom=0.12)
    fig.savefig(path)
    plt.close(fig)
