"""Step watchdog: a rank that completes no step for `restarts.stepTimeoutSeconds` exits.

A hung rank (deadlock, stuck I/O, a lost peer) blocks its whole group in the next collective; the
launcher only restarts the group when a process exits. So every rank runs this watchdog: the hung one
and the healthy ones blocked in a collective all exit with `WATCHDOG_EXIT_CODE`, and torchrun / the
operator / Ray restarts the group from the last checkpoint. `os._exit` because a blocked collective
would never let a normal exit (or an exception) through.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from training.metrics.base import MetricsSink

__all__ = ["WATCHDOG_EXIT_CODE", "StepWatchdog"]

log = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 70  # EX_SOFTWARE; distinct from a crash (1) and a bad spec (2) in the logs


class StepWatchdog:
    """Background thread that kills the process when `beat()` is not called for `timeout_s`.

    Args:
        timeout_s: Seconds without a completed step (the first period also covers start-up and restore).
        events: Where the `watchdog` event goes before the exit.
        poll_s: Check interval (default: a tenth of the timeout, at most 1 s).
    """

    def __init__(self, timeout_s: float, events: MetricsSink, *, poll_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.events = events
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        self._last = time.monotonic()
        self._step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchrig-watchdog", daemon=True)

    def start(self) -> StepWatchdog:
        self._last = time.monotonic()
        self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        """A step completed (or a long phase such as the final evaluation begins)."""
        self._last = time.monotonic()
        if step is not None:
            self._step = step

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            silent = time.monotonic() - self._last
            if silent > self.timeout_s:
                self.events.on_event("watchdog", step=self._step, silent_s=round(silent, 3), timeout_s=self.timeout_s)
                msg = (
                    f"torchrig: watchdog: no step completed for {silent:.1f}s (restarts.stepTimeoutSeconds="
                    f"{self.timeout_s}) after step {self._step}; exiting so the group restarts"
                )
                print(msg, file=sys.stderr, flush=True)
                logging.shutdown()
                os._exit(WATCHDOG_EXIT_CODE)
