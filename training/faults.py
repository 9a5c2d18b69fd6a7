"""Drill fault injection: the worker breaks itself on purpose, exactly when a drill asks.

`TORCHRIG_FAULTS` holds a JSON list of `{"kind", "rank", "step", "generation" (default 0),
"seconds"}` (docs/architecture.md). A fault fires when global rank `rank` in restart generation
`generation` has completed optimizer step `step`:

- `kill`: SIGKILL of this process (a hard crash: no cleanup, no exception handler runs);
- `exit`: `os._exit(1)` (a crash with a non-zero exit code);
- `hang`: the main thread sleeps forever (the watchdog must catch it);
- `slow`: every step from `step` on takes `seconds` longer (a straggler);
- `kill_during_checkpoint`: SIGKILL right after the first save at or after `step` is staged, while its
  upload is still in flight.

Every fault writes a `fault` event before it fires.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

from training.metrics.base import MetricsSink

__all__ = ["FAULT_EXIT_CODE", "Fault", "FaultInjector", "parse_faults"]

FaultKind = Literal["kill", "hang", "slow", "exit", "kill_during_checkpoint"]
_KINDS = ("kill", "hang", "slow", "exit", "kill_during_checkpoint")
FAULT_EXIT_CODE = 1


@dataclass(frozen=True)
class Fault:
    """One fault of a drill."""

    kind: FaultKind
    rank: int
    step: int
    generation: int = 0
    seconds: float = 0.0


def parse_faults(text: str | None) -> list[Fault]:
    """Parse `TORCHRIG_FAULTS` (empty or unset: no faults).

    Raises:
        ValueError: one line naming TORCHRIG_FAULTS and the bad entry.
    """
    if not text or not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"TORCHRIG_FAULTS: not JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValueError("TORCHRIG_FAULTS: must be a JSON list of faults")
    faults = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"TORCHRIG_FAULTS[{i}]: must be an object")
        kind = item.get("kind")
        if kind not in _KINDS:
            raise ValueError(f"TORCHRIG_FAULTS[{i}].kind: {kind!r} is not one of {', '.join(_KINDS)}")
        unknown = set(item) - {"kind", "rank", "step", "generation", "seconds"}
        if unknown:
            raise ValueError(f"TORCHRIG_FAULTS[{i}]: unknown keys {sorted(unknown)}")
        try:
            fault = Fault(
                kind=cast(FaultKind, kind),
                rank=int(item.get("rank", 0)),
                step=int(item["step"]),
                generation=int(item.get("generation", 0)),
                seconds=float(item.get("seconds", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"TORCHRIG_FAULTS[{i}]: bad or missing field: {exc}") from None
        if fault.kind == "slow" and fault.seconds <= 0:
            raise ValueError(f"TORCHRIG_FAULTS[{i}].seconds: a slow fault needs seconds > 0")
        faults.append(fault)
    return faults


class FaultInjector:
    """Fires this rank's faults of this generation at the right moments of the loop."""

    def __init__(self, faults: list[Fault], *, rank: int, generation: int, events: MetricsSink) -> None:
        # rank -1 / generation -1 match every rank / generation (drills pace a whole job this way).
        self.faults = [f for f in faults if f.rank in (rank, -1) and f.generation in (generation, -1)]
        self.events = events
        self._fired: set[Fault] = set()

    @classmethod
    def from_env(
        cls, *, rank: int, generation: int, events: MetricsSink, env: Mapping[str, str] | None = None
    ) -> FaultInjector:
        env = os.environ if env is None else env
        return cls(parse_faults(env.get("TORCHRIG_FAULTS")), rank=rank, generation=generation, events=events)

    def step_delay(self, step: int) -> float:
        """Extra seconds a `slow` fault adds to `step` (events are written once, when it starts)."""
        delay = 0.0
        for fault in self.faults:
            if fault.kind == "slow" and step >= fault.step:
                if fault not in self._fired:
                    self._fired.add(fault)
                    self.events.on_event("fault", kind="slow", step=step, seconds=fault.seconds)
                delay += fault.seconds
        return delay

    def after_step(self, step: int) -> None:
        """Called once step `step` has completed (before any checkpoint of it)."""
        for fault in self.faults:
            if fault.step == step and fault.kind in ("kill", "exit", "hang"):
                self._fire(fault, step)

    def after_save_staged(self, step: int) -> None:
        """Called right after the save of `step` returned (staged; the upload may still run)."""
        for fault in self.faults:
            if fault.kind == "kill_during_checkpoint" and step >= fault.step and fault not in self._fired:
                self._fire(fault, step)

    def _fire(self, fault: Fault, step: int) -> None:
        self._fired.add(fault)
        self.events.on_event("fault", kind=fault.kind, step=step, pid=os.getpid())
        print(f"torchrig: drill fault {fault.kind} at step {step} (rank {fault.rank})", file=sys.stderr, flush=True)
        if fault.kind in ("kill", "kill_during_checkpoint"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "exit":
            os._exit(FAULT_EXIT_CODE)
        elif fault.kind == "hang":
            while True:  # the watchdog (or the drill's timeout) ends this
                time.sleep(3600)
