"""Step watchdog: a rank that completes no step for `restarts.stepTimeoutSeconds` exits.

A hung rank (deadlock, stuck I/O, a lost peer) blocks its whole group in the next collective; the
launcher only restarts the group when a process exits. So every rank runs this watchdog: the hung one
and the healthy ones blocked in a collective all exit with `WATCHDOG_EXIT_CODE`, and torchrun / the
operator / Ray restarts the group from the last checkpoint. `os._exit` because a blocked collective
would never let a normal exit (or an exception) through.

Checkpoint I/O (opening the stores, restore, a save training waits for, the last wait at the end) is
not a step: a large restore or a slow store must not be taken for a hang. Inside `with watchdog.io(s):`
the limit is `checkpoint.ioTimeoutSeconds` instead, counted from the start of the I/O; the step clock
starts again when it ends. A rank silent past that limit still exits.

Start-up (before the first step: the process group, the model, DDP's first broadcast, opening the
stores) runs under `with watchdog.startup(...)`, whose limit is the larger of the two: peers that are
still importing torch are not a hang.

Before that, at `DUMP_AT` of the timeout, every rank dumps its stacks (`training.stacks`): all ranks
of a hung group fall silent at the same step, so each writes its dump while every peer is still alive
(a rank that exits first would turn its peers' blocked collective into an error, and no dump).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from training.contract.events import EventKind, Watchdog
from training.contract.exit_codes import ExitCode
from training.metrics.base import MetricsSink

if TYPE_CHECKING:
    from training.stacks import StackDumper

__all__ = ["DUMP_AT", "WATCHDOG_EXIT_CODE", "StepWatchdog"]

log = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = int(ExitCode.HUNG)  # 201: retryable (>= 128) and no signal death (training.contract)
DUMP_AT = 0.75  # share of the timeout after which a silent rank dumps its stacks (once per silence)


class StepWatchdog:
    """Background thread that kills the process when `beat()` is not called for `timeout_s`.

    Args:
        timeout_s: Seconds without a completed step (the first period also covers start-up and restore).
        events: Where the `watchdog` event goes before the exit.
        poll_s: Check interval (default: a tenth of the timeout, at most 0.25 s: a hang is detected at
            most that late, and in-place recovery's target is the timeout + 1 s).
        stacks: Dumps this rank's stacks before the exit (None: no dump).
    """

    def __init__(
        self,
        timeout_s: float,
        events: MetricsSink,
        *,
        poll_s: float | None = None,
        stacks: StackDumper | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        # (seconds, the setting that names them, the phase): replaced whole, so the thread reads a
        # consistent pair; `io` switches it for the duration of checkpoint I/O.
        self._limit: tuple[float, str, str] = (timeout_s, "restarts.stepTimeoutSeconds", "step")
        self.events = events
        self.stacks = stacks
        self._dumped_for: float | None = None  # the beat whose silence was dumped
        self.poll_s = poll_s if poll_s is not None else min(0.25, timeout_s / 10)
        self._last = time.monotonic()
        self._step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchrig-watchdog", daemon=True)
        # In-place recovery (`training.inplace`): a rank blocked in a gradient collective is waiting
        # for a peer, not hung itself; it gets `waiting_grace_s` more, so the hung peer's watchdog
        # (which has no collective in flight) fires first and only that rank is replaced.
        self.waiting: Callable[[], bool] | None = None
        self.waiting_grace_s = 0.0

    def start(self) -> StepWatchdog:
        self._last = time.monotonic()
        self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        """A step completed (or a long phase such as the final evaluation begins)."""
        self._last = time.monotonic()
        if step is not None:
            self._step = step

    @contextlib.contextmanager
    def io(self, timeout_s: float) -> Iterator[None]:
        """Checkpoint I/O: the limit is `timeout_s` (`checkpoint.ioTimeoutSeconds`) until the block ends.

        Both edges count as a beat: the I/O gets its whole limit, and the next step its whole step
        timeout. Nested blocks keep the outer limit when they end.
        """
        with self._phase(timeout_s, "checkpoint.ioTimeoutSeconds", "checkpoint_io"):
            yield

    @contextlib.contextmanager
    def startup(self, io_timeout_s: float) -> Iterator[None]:
        """Start-up (process group, model, DDP's first broadcast, opening the stores): the limit is the
        larger of the step timeout and `checkpoint.ioTimeoutSeconds`. A peer still importing torch on a
        loaded node keeps this rank waiting in the first collective; that is not a hang, and a short
        step timeout (a drill's) must not end a rank that has not reached its first step."""
        limit = max(self.timeout_s, io_timeout_s)
        with self._phase(limit, "max(restarts.stepTimeoutSeconds, checkpoint.ioTimeoutSeconds)", "startup"):
            yield

    @contextlib.contextmanager
    def _phase(self, timeout_s: float, setting: str, phase: str) -> Iterator[None]:
        previous = self._limit
        # The thread reads `_limit` before `_last`: setting `_last` first means it never pairs the
        # old silence with a shorter limit (here or when the block ends).
        self._last = time.monotonic()
        self._limit = (timeout_s, setting, phase)
        try:
            yield
        finally:
            self._last = time.monotonic()
            self._limit = previous

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _dump(self) -> None:
        last = self._last
        if self.stacks is None or self._dumped_for == last:
            return
        self._dumped_for = last
        try:
            self.stacks.dump(EventKind.WATCHDOG.value, self._step)
        except Exception:  # forensics must never keep a hung rank from exiting
            log.exception("the stack dump failed")

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            timeout_s, setting, phase = self._limit
            silent = time.monotonic() - self._last
            if silent > timeout_s * DUMP_AT:
                self._dump()
            if silent > timeout_s and phase == "step" and silent <= timeout_s + self.waiting_grace_s:
                waiting = self.waiting
                if waiting is not None and waiting():
                    continue
            if silent > timeout_s:
                self._dump()  # when a poll jumped straight past DUMP_AT
                self.events.emit(Watchdog(step=self._step, silent_s=round(silent, 3), timeout_s=timeout_s, phase=phase))
                what = {"step": "no step completed", "startup": "start-up unfinished"}.get(
                    phase, "checkpoint I/O unfinished"
                )
                msg = (
                    f"torchrig: watchdog: {what} for {silent:.1f}s ({setting}={timeout_s}) after step "
                    f"{self._step}; exiting so the group restarts"
                )
                print(msg, file=sys.stderr, flush=True)
                logging.shutdown()
                os._exit(WATCHDOG_EXIT_CODE)
