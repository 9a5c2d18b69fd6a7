"""Automatic hang deadlines: how long the step watchdog lets a rank stay silent, from the steps it saw.

A fixed `restarts.stepTimeoutSeconds` has to outlast the slowest legitimate step, so a hang costs all of
it (600 s by default, 10 s in the hang drill on a 12 ms step). Like NVIDIA Resiliency Extension's
automatically calculated timeouts, `restarts.hangDetection: auto` has every rank learn the intervals
between its own completed steps (what the watchdog measures: the step and what the loop does between
two steps, metrics and collectives included) and judge a silence by

    deadline = min(stepTimeoutSeconds, max(hangFloorSeconds, hangMultiplier x p99(recent intervals)))

The fixed timeout stays the cap; the floor keeps a millisecond step from being judged in milliseconds
(a loaded host, a garbage collection). What is not an ordinary step is neither a sample nor judged by
that deadline:

- warm-up: until `restarts.hangWarmupSteps` intervals were seen, the deadline is the cap;
- the phases the watchdog knows (start-up, checkpoint I/O, an in-place recovery, the final evaluation)
  have limits of their own (`training.watchdog`), and the interval they fall into is dropped;
- the first step after such a phase (DDP's new buckets, a new data iterator, an upload running in the
  background) is its own phase, `first_step`: the same rule over earlier first steps, with their
  maximum instead of the p99 (there are few of them), and the cap until `FIRST_STEP_WARMUP` were seen.

Everything here is arithmetic on times the caller passes in (no clock, no thread), so the rules are
tested directly (tests/unit/test_deadlines.py); `training.watchdog` feeds it from the monotonic clock.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from training.config import RestartsConfig

__all__ = ["FIRST_STEP", "FIRST_STEP_WARMUP", "STEP", "DeadlinePolicy", "Samples", "StepDeadlines"]

STEP: Final = "step"  # an ordinary step
FIRST_STEP: Final = "first_step"  # the first step after a phase that is no step
FIRST_STEP_WARMUP: Final = 3  # first steps seen before their deadline is derived (checkpoints are rare)
QUANTILE: Final = 0.99
WINDOW: Final = 1000  # the most recent intervals a deadline is derived from (the job may slow down)


@dataclass(frozen=True)
class DeadlinePolicy:
    """How a deadline follows from observed intervals (`restarts.hangDetection` and the fields after it).

    Args:
        auto: Derive deadlines (`hangDetection: auto`); False: every step has `cap_s` (`fixed`).
        cap_s: `restarts.stepTimeoutSeconds`, the longest any step may be silent.
        multiplier: `restarts.hangMultiplier`, applied to the observed quantile.
        floor_s: `restarts.hangFloorSeconds`, the shortest deadline.
        warmup_steps: `restarts.hangWarmupSteps`, intervals seen before a step's deadline is derived.
        quantile: The quantile of the recent intervals (nearest rank).
        window: How many recent intervals count.
    """

    auto: bool = True
    cap_s: float = 600.0
    multiplier: float = 10.0
    floor_s: float = 1.0
    warmup_steps: int = 20
    quantile: float = QUANTILE
    window: int = WINDOW

    def __post_init__(self) -> None:
        if not (self.cap_s > 0 and self.floor_s > 0 and self.multiplier >= 1 and 0 < self.quantile <= 1):
            raise ValueError(f"invalid deadline policy: {self}")
        if not 1 <= self.warmup_steps <= self.window:
            raise ValueError(f"invalid deadline policy: warmup_steps must be in 1..{self.window}")

    @classmethod
    def from_restarts(cls, restarts: RestartsConfig) -> DeadlinePolicy:
        """The policy `spec.restarts` describes."""
        return cls(
            auto=restarts.hang_detection == "auto",
            cap_s=restarts.step_timeout_seconds,
            multiplier=restarts.hang_multiplier,
            floor_s=restarts.hang_floor_seconds,
            warmup_steps=min(restarts.hang_warmup_steps, WINDOW),
        )

    def derive(self, observed_s: float | None) -> float:
        """The deadline for intervals whose high quantile is `observed_s` (None: too few seen yet).

        Never above the cap, never below the floor (unless the cap is lower), monotone in `observed_s`.
        """
        if not self.auto or observed_s is None:
            return self.cap_s
        return min(self.cap_s, max(self.floor_s, self.multiplier * observed_s))


class Samples:
    """The last `window` intervals, kept sorted as well, for a nearest-rank quantile in O(window) per add."""

    def __init__(self, window: int) -> None:
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []
        self.window = window

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, value: float) -> None:
        if len(self._recent) == self.window:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(value)
        bisect.insort(self._sorted, value)

    def quantile(self, q: float) -> float:
        """The nearest-rank `q` quantile (the smallest value with at least a share `q` at or below it)."""
        if not self._sorted:
            raise ValueError("no samples")
        return self._sorted[max(0, math.ceil(q * len(self._sorted)) - 1)]


class StepDeadlines:
    """One rank's step deadlines, from the times of its beats (the caller's clock, in seconds).

    A beat that names a new step means a step completed: the time since the previous beat (or since
    the end of the last phase that is no step) is a sample of `step` or, right after such a phase, of
    `first_step`. A beat that names no new step (start of training, the end of a save) only restarts
    the interval. `pause` / `resume` bracket a phase that is no step.

    The watchdog thread reads `phase` and `deadline_s` while the training thread writes: every field
    is replaced whole, and a reader that pairs an old phase with a new deadline only ever sees two
    deadlines that were each valid a moment ago.
    """

    def __init__(self, policy: DeadlinePolicy) -> None:
        self.policy = policy
        self._steps = Samples(policy.window)
        self._first_steps = Samples(policy.window)
        self._since: float | None = None  # when the interval in progress started (None: inside a phase)
        self._step: int | None = None  # the step of the last beat
        self._after_pause = True  # the interval in progress is a first step (start-up counts as a phase)
        self.step_s = policy.cap_s  # the current deadline of an ordinary step
        self.first_step_s = policy.cap_s  # ... and of a first step

    @property
    def phase(self) -> str:
        """Which deadline judges the interval in progress: `step` or `first_step`."""
        return FIRST_STEP if self._after_pause else STEP

    @property
    def deadline_s(self) -> float:
        """The deadline of the interval in progress."""
        return self.first_step_s if self._after_pause else self.step_s

    @property
    def samples(self) -> int:
        """Ordinary step intervals seen (at most the window)."""
        return len(self._steps)

    def beat(self, now: float, step: int | None = None) -> None:
        """A beat at `now`: step `step` completed when it differs from the previous beat's."""
        completed = step is not None and self._step is not None and step != self._step
        if step is not None:
            self._step = step
        if completed and self._since is not None:
            self.observe(now - self._since, first=self._after_pause)
            self._after_pause = False
        self._since = now

    def observe(self, interval_s: float, *, first: bool = False) -> None:
        """One interval of an ordinary (or a first) step; the deadlines follow."""
        policy = self.policy
        if first:
            self._first_steps.add(interval_s)
            if len(self._first_steps) >= FIRST_STEP_WARMUP:
                self.first_step_s = policy.derive(self._first_steps.quantile(1.0))
            return
        self._steps.add(interval_s)
        if len(self._steps) >= policy.warmup_steps:
            self.step_s = policy.derive(self._steps.quantile(policy.quantile))

    def summary(self) -> str:
        """One line on what the deadlines were derived from (the watchdog logs it when it stops)."""
        steps, firsts = self._steps, self._first_steps
        if not len(steps):
            return f"no step intervals seen; step deadline {self.step_s:.3g}s"
        return (
            f"step deadline {self.step_s:.3g}s from {len(steps)} step intervals (median "
            f"{steps.quantile(0.5):.3g}s, p99 {steps.quantile(self.policy.quantile):.3g}s, max "
            f"{steps.quantile(1.0):.3g}s); first-step deadline {self.first_step_s:.3g}s from {len(firsts)} "
            f"(max {firsts.quantile(1.0) if len(firsts) else 0.0:.3g}s)"
        )

    def pause(self) -> None:
        """A phase that is no step begins: the interval in progress is dropped."""
        self._since = None
        self._after_pause = True

    def resume(self, now: float) -> None:
        """That phase ended at `now`: the next step is a first step, timed from here."""
        self._since = now
        self._after_pause = True
