"""What `torchrig run` shows while a local run goes: a rich live view on a terminal, plain progress
lines otherwise, nothing with `--quiet`. Everything shown comes from the run directory's
metrics.jsonl / events.jsonl, the same files `torchrig report` reads afterwards."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from orchestrator.summary_text import format_metrics, format_value
from training.contract import EventKind, JsonlTail, RunFiles

__all__ = ["LiveProgress", "PlainView", "QuietView", "RichView", "RunView", "create_view"]

log = logging.getLogger(__name__)


@dataclass
class LiveProgress:
    """The latest state of a run, folded from the new lines of metrics.jsonl and events.jsonl."""

    run_dir: Path
    total_steps: int
    since: float = 0.0  # wall clock: lines older than this (an earlier attempt's, in a resubmit) are skipped
    step: int = 0
    loss: float | None = None
    samples_per_s: float | None = None
    world_size: int | None = None
    restarts: int = 0
    last_checkpoint_step: int | None = None
    last_checkpoint_time: float | None = None
    faults: int = 0
    eval: dict[str, Any] = field(default_factory=dict)
    _metrics: JsonlTail = field(init=False)
    _events: JsonlTail = field(init=False)
    _failed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        files = RunFiles(self.run_dir)
        self._metrics = JsonlTail(files.metrics)
        self._events = JsonlTail(files.events)

    def poll(self) -> bool:
        """Read what was appended since the last call; True when something changed.

        The lines are untrusted (anyone who can write to the run directory), and this runs in the
        supervisor's loop: a value of the wrong type is ignored, and whatever else goes wrong here is
        logged once and never ends the run (the view is only what the user watches).
        """
        try:
            return self._poll()
        except Exception:
            if not self._failed:
                self._failed = True
                log.exception("the live view cannot read %s; the run goes on without it", self.run_dir)
            return False

    def _poll(self) -> bool:
        changed = False
        for rec in self._metrics.read_new():
            if (_float(rec.get("time"), self.since) or 0.0) < self.since:
                continue
            changed = True
            step = rec.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                self.step = step
            self.loss = _float(rec.get("loss"), self.loss)
            self.samples_per_s = _float(rec.get("samples_per_s"), self.samples_per_s)
            if isinstance(rec.get("world_size"), int):
                self.world_size = rec["world_size"]
        for ev in self._events.read_new():
            if (_float(ev.get("time"), self.since) or 0.0) < self.since:
                continue
            changed = True
            kind = ev.get("event")
            gen = ev.get("generation")
            if isinstance(gen, int):
                self.restarts = max(self.restarts, gen)
            if kind == EventKind.START and isinstance(ev.get("world_size"), int):
                self.world_size = ev["world_size"]
            elif kind == EventKind.CHECKPOINT_COMMITTED and isinstance(ev.get("step"), int):
                if self.last_checkpoint_step is None or ev["step"] >= self.last_checkpoint_step:
                    self.last_checkpoint_step = ev["step"]
                    self.last_checkpoint_time = _float(ev.get("time"), time.time())
            elif kind == EventKind.FAULT:
                self.faults += 1
            elif kind == EventKind.EVAL and isinstance(ev.get("metrics"), dict):
                self.eval = {str(k): v for k, v in ev["metrics"].items() if _float(v, None) is not None}
        return changed

    def checkpoint_text(self) -> str:
        if self.last_checkpoint_step is None:
            return "none yet"
        age = time.time() - (self.last_checkpoint_time or time.time())
        return f"step {self.last_checkpoint_step} ({age:.0f} s ago)"

    @property
    def loss_label(self) -> str:
        """The metrics lines are rank 0's: with several ranks the live loss is rank 0's own, while the
        run's summary reports the mean over the ranks of the last step; the label says which."""
        return "train loss (rank 0)" if (self.world_size or 1) > 1 else "train loss"

    def line(self) -> str:
        """One plain progress line."""
        parts = [f"step {self.step}/{self.total_steps}"]
        if self.loss is not None:
            parts.append(f"{self.loss_label} {format_value(self.loss)}")
        parts += format_metrics(self.eval, "eval")
        if self.samples_per_s is not None:
            parts.append(f"{self.samples_per_s:.0f} samples/s")
        if self.world_size is not None:
            parts.append(f"world {self.world_size}")
        parts.append(f"restarts {self.restarts}")
        parts.append(f"checkpoint {self.checkpoint_text()}")
        return "  ".join(parts)


def _float(value: Any, default: float | None) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float
        return default


class RunView:
    """No-op base: what the supervisor calls while a run goes."""

    def __init__(self, progress: LiveProgress, endpoints: list[str]) -> None:
        self.progress = progress
        self.endpoints = endpoints

    def start(self) -> None:
        """Before the first refresh."""

    def refresh(self, note: str = "") -> None:
        """Called a few times a second."""
        self.progress.poll()

    def stop(self) -> None:
        """After the last refresh (before the final line)."""


class QuietView(RunView):
    """`--quiet` and `-o json`: nothing while running."""


class PlainView(RunView):
    """Not a terminal: a progress line every `every_s` seconds when something changed."""

    def __init__(self, progress: LiveProgress, endpoints: list[str], out: TextIO, every_s: float = 5.0) -> None:
        super().__init__(progress, endpoints)
        self.out = out
        self.every_s = every_s
        self._last = 0.0
        self._dirty = False
        self._note = ""

    def refresh(self, note: str = "") -> None:
        self._dirty |= self.progress.poll()
        if note and note != self._note:
            self._note = note
            print(note, file=self.out, flush=True)
        now = time.monotonic()
        if self._dirty and now - self._last >= self.every_s:
            self._last = now
            self._dirty = False
            print(self.progress.line(), file=self.out, flush=True)

    def stop(self) -> None:
        self.progress.poll()
        print(self.progress.line(), file=self.out, flush=True)


class RichView(RunView):
    """A terminal: a rich live panel (progress bar, loss, throughput, world size, checkpoint age)."""

    def __init__(self, progress: LiveProgress, endpoints: list[str], out: TextIO) -> None:
        super().__init__(progress, endpoints)
        from rich.console import Console
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(file=out)
        self.bar = Progress(
            TextColumn("[bold]steps"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.task = self.bar.add_task("steps", total=progress.total_steps)
        self.live = Live(console=self.console, refresh_per_second=4, transient=False)
        self._note = ""

    def _render(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        p = self.progress
        table = Table.grid(padding=(0, 2))
        table.add_column(style="dim")
        table.add_column()
        table.add_row(p.loss_label, format_value(p.loss))
        for item in format_metrics(p.eval, "eval"):
            name, _, value = item.rpartition(" ")
            table.add_row(name, value)
        table.add_row("samples/s", "-" if p.samples_per_s is None else f"{p.samples_per_s:.0f}")
        table.add_row("world size", "-" if p.world_size is None else str(p.world_size))
        table.add_row("restarts", str(p.restarts))
        table.add_row("checkpoint", p.checkpoint_text())
        table.add_row("metrics", ", ".join(self.endpoints) or "disabled")
        if self._note:
            table.add_row("status", self._note)
        return Group(self.bar, table)

    def start(self) -> None:
        self.live.start()

    def refresh(self, note: str = "") -> None:
        self.progress.poll()
        self._note = note
        self.bar.update(self.task, completed=self.progress.step)
        self.live.update(self._render())

    def stop(self) -> None:
        self.refresh()
        self.live.stop()


def create_view(progress: LiveProgress, endpoints: list[str], *, quiet: bool, out: TextIO | None = None) -> RunView:
    """Pick the view: quiet, rich on a terminal, plain lines otherwise."""
    stream = out or sys.stdout
    if quiet:
        return QuietView(progress, endpoints)
    if stream.isatty():
        return RichView(progress, endpoints, stream)
    return PlainView(progress, endpoints, stream)
