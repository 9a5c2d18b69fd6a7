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

With `restarts.hangDetection: auto` (the default) a step's limit is not the fixed timeout but a
deadline derived from the steps this rank completed so far (`training.deadlines`: a multiple of their
p99 with a floor, the fixed timeout as the cap, warm-up and the first step after each phase above
apart), so a hang is detected in seconds. Other phases that are no step (the final evaluation, a
profiler's capture) run under `with watchdog.fixed(phase):` and keep the fixed timeout. The deadlines
are published as `torchrig_step_deadline_seconds{phase=...}` (`MetricsSink.on_deadlines`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from training.contract.events import EventKind, Watchdog
from training.contract.exit_codes import ExitCode
from training.deadlines import FIRST_STEP, STEP, DeadlinePolicy, StepDeadlines
from training.metrics.base import MetricsSink

if TYPE_CHECKING:
    from training.stacks import StackDumper

__all__ = ["DUMP_AT", "WATCHDOG_EXIT_CODE", "Overdue", "StepWatchdog"]

log = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = int(ExitCode.HUNG)  # 201: retryable (>= 128) and no signal death (training.contract)
DUMP_AT = 0.75  # share of the timeout after which a silent rank dumps its stacks (once per silence)
POLL_MAX_S = 0.25  # the thread checks at a twentieth of the current limit, within these bounds
POLL_MIN_S = 0.01
RECOVERY_FACTOR = 3  # an in-place recovery's limit, in restarts.inPlaceTimeoutSeconds


@dataclass(frozen=True)
class Overdue:
    """What the watchdog found: a silence past the limit of the phase it fell into."""

    silent_s: float
    timeout_s: float
    setting: str  # the setting that names the limit
    phase: str  # "step", "first_step", "checkpoint_io", "startup", or a `fixed` phase's name

    def describe(self) -> str:
        """What went silent for how long, and the limit, for the log line before the exit."""
        what = _WHAT.get(self.phase, f"{self.phase.replace('_', ' ')} unfinished")
        if self.setting == AUTO_SETTING:
            limit = f"a deadline of {self.timeout_s:.3g}s derived from the steps so far, {AUTO_SETTING}"
        else:
            limit = f"{self.setting}={self.timeout_s}"
        return f"{what} for {self.silent_s:.1f}s ({limit})"


_WHAT = {
    STEP: "no step completed",
    FIRST_STEP: "no step completed",
    "startup": "start-up unfinished",
    "checkpoint_io": "checkpoint I/O unfinished",
    "recovery": "in-place recovery unfinished",
}
AUTO_SETTING = "restarts.hangDetection: auto"


class StepWatchdog:
    """Background thread that kills the process when `beat()` is not called within the current limit.

    Args:
        timeout_s: Seconds without a completed step (`restarts.stepTimeoutSeconds`; the cap of derived
            deadlines).
        events: Where the `watchdog` event goes before the exit, and where the deadlines are published.
        poll_s: Check interval (default: a twentieth of the current limit, at most 0.25 s and at least
            0.01 s: a hang is detected at most that late).
        stacks: Dumps this rank's stacks before the exit (None: no dump).
        policy: How a step's deadline follows from the steps seen (None: always `timeout_s`).
        clock: The monotonic clock (tests pass a fake one and call `overdue` without the thread).
    """

    def __init__(
        self,
        timeout_s: float,
        events: MetricsSink,
        *,
        poll_s: float | None = None,
        stacks: StackDumper | None = None,
        policy: DeadlinePolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.policy = policy if policy is not None else DeadlinePolicy(auto=False, cap_s=timeout_s)
        self.deadlines = StepDeadlines(self.policy)
        self.clock = clock
        # (seconds, the setting that names them, the phase) of a phase that is no step, replaced whole
        # so the thread reads a consistent triple; None: a step, judged by `deadlines`.
        self._limit: tuple[float, str, str] | None = None
        self._depth = 0  # nested phases (`io` inside a recovery's `io`)
        self._phases: dict[str, float] = {}  # the last limit of each phase, for the gauge
        self._published: dict[str, float] = {}
        self.events = events
        self.stacks = stacks
        self._dumped_for: float | None = None  # the beat whose silence was dumped
        self.poll_s = poll_s
        self._last = clock()
        self._step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchrig-watchdog", daemon=True)
        # In-place recovery (`training.inplace`): a rank blocked in a gradient collective is waiting
        # for a peer, not hung itself; it gets `waiting_grace_s` more, so the hung peer's watchdog
        # (which has no collective in flight) fires first and only that rank is replaced.
        self.waiting: Callable[[], bool] | None = None
        self.waiting_grace_s = 0.0
        # This rank has a gradient collective in flight (None: `waiting`, where set). Such a rank dumps its
        # stacks early (`dump_due`): the peer it waits for may be hung under a shorter derived deadline.
        self.in_collective: Callable[[], bool] | None = None

    def start(self) -> StepWatchdog:
        self._last = self.clock()
        self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        """A step completed (or a long phase such as the final evaluation begins)."""
        now = self.clock()
        self._last = now
        if self._depth == 0:
            self.deadlines.beat(now, step)
        if step is not None:
            self._step = step

    def limit(self) -> tuple[float, str, str]:
        """(seconds, the setting that names them, the phase) that judge the silence now."""
        fixed = self._limit
        if fixed is not None:
            return fixed
        deadlines = self.deadlines
        if not self.policy.auto:  # one limit for every step: no first steps apart
            return self.timeout_s, "restarts.stepTimeoutSeconds", STEP
        phase, seconds = deadlines.phase, deadlines.deadline_s
        if seconds < self.timeout_s:
            return seconds, AUTO_SETTING, phase
        return seconds, "restarts.stepTimeoutSeconds", phase

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
    def recovery(self, in_place_timeout_s: float) -> Iterator[None]:
        """An in-place recovery (leaving the broken group, closing its checkpoint manager, forming the next
        generation): this rank is not hung. The limit is `RECOVERY_FACTOR` x `restarts.inPlaceTimeoutSeconds`,
        the new group's two plus the leaving's one; the next step is a first step."""
        limit = in_place_timeout_s * RECOVERY_FACTOR
        with self._phase(limit, f"{RECOVERY_FACTOR} x restarts.inPlaceTimeoutSeconds", "recovery"):
            yield

    @contextlib.contextmanager
    def fixed(self, phase: str) -> Iterator[None]:
        """A phase that is no step and has no limit of its own (the final evaluation, a profiler's
        capture): the fixed `restarts.stepTimeoutSeconds`, never a deadline derived from steps."""
        with self._phase(self.timeout_s, "restarts.stepTimeoutSeconds", phase):
            yield

    @contextlib.contextmanager
    def _phase(self, timeout_s: float, setting: str, phase: str) -> Iterator[None]:
        previous = self._limit
        # The thread reads `_limit` before `_last`: setting `_last` first means it never pairs the
        # old silence with a shorter limit (here or when the block ends).
        self._last = self.clock()
        self._depth += 1
        self.deadlines.pause()
        self._limit = (timeout_s, setting, phase)
        if self._phases.get(phase) != timeout_s:  # replaced whole: the watchdog thread iterates it
            self._phases = {**self._phases, phase: timeout_s}
        try:
            yield
        finally:
            now = self.clock()
            self._last = now
            self._depth -= 1
            if self._depth == 0:
                self.deadlines.resume(now)
            self._limit = previous

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.policy.auto:
            log.info("watchdog: %s", self.deadlines.summary())

    def deadline_gauges(self) -> dict[str, float]:
        """Each phase's current limit in seconds: `step` and `first_step` (derived or the cap),
        `collective` (a step's deadline plus the in-place grace of a rank waiting for its peers, where
        in place), and the last limit of every other phase entered so far."""
        deadlines = self.deadlines
        out = {STEP: deadlines.step_s, FIRST_STEP: deadlines.first_step_s, **self._phases}
        if self.waiting is not None:
            out["collective"] = deadlines.step_s + self.waiting_grace_s
        return out

    def overdue(self) -> Overdue | None:
        """The silence now, when it is past the current limit (None: within it, or a rank of an in-place
        group waiting in a collective for a peer, within its grace)."""
        timeout_s, setting, phase = self.limit()
        silent = self.clock() - self._last
        if silent <= timeout_s:
            return None
        if phase in (STEP, FIRST_STEP) and silent <= timeout_s + self.waiting_grace_s:
            waiting = self.waiting
            if waiting is not None and waiting():
                return None
        return Overdue(silent_s=silent, timeout_s=timeout_s, setting=setting, phase=phase)

    def dump_due(self) -> bool:
        """Whether the silence now calls for a stack dump: past `DUMP_AT` of the current limit, or, with
        derived deadlines, of the floor while a gradient collective is in flight. Each rank derives its
        own deadline; a hung peer whose deadline is shorter would exit first, this rank's collective
        would then fail, and the group would lose the dump that shows where it waited."""
        limit_s, _, phase = self.limit()
        silent = self.clock() - self._last
        if silent > limit_s * DUMP_AT:
            return True
        if not (self.policy.auto and phase in (STEP, FIRST_STEP) and silent > self.policy.floor_s * DUMP_AT):
            return False
        probe = self.in_collective if self.in_collective is not None else self.waiting
        return probe is not None and probe()

    def _dump(self) -> None:
        last = self._last
        if self.stacks is None or self._dumped_for == last:
            return
        self._dumped_for = last
        try:
            self.stacks.dump(EventKind.WATCHDOG.value, self._step)
        except Exception:  # forensics must never keep a hung rank from exiting
            log.exception("the stack dump failed")

    def _publish(self) -> None:
        try:  # a metrics problem must never stop the watchdog
            gauges = self.deadline_gauges()
            if gauges != self._published:
                self._published = gauges
                self.events.on_deadlines(dict(gauges))
        except Exception:
            log.debug("publishing the deadlines failed", exc_info=True)

    def _poll(self) -> float:
        if self.poll_s is not None:
            return self.poll_s
        return min(POLL_MAX_S, max(POLL_MIN_S, self.limit()[0] / 20))

    def _run(self) -> None:
        while not self._stop.wait(self._poll()):
            self._publish()
            if self.dump_due():
                self._dump()
            found = self.overdue()
            if found is None:
                continue
            self._dump()  # when a poll jumped straight past DUMP_AT
            self.events.emit(
                Watchdog(
                    step=self._step, silent_s=round(found.silent_s, 3), timeout_s=found.timeout_s, phase=found.phase
                )
            )
            print(
                f"torchrig: watchdog: {found.describe()} after step {self._step}; exiting so the group restarts",
                file=sys.stderr,
                flush=True,
            )
            logging.shutdown()
            os._exit(WATCHDOG_EXIT_CODE)
