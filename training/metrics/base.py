"""The metrics seam: the worker, the checkpoint manager and the exporters speak only these records.

`MetricsSink` is a no-op base; `FanOut` sends each call to several sinks (Prometheus, JSON lines).
Sinks must never raise into the training loop: a broken sink is logged once and ignored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from training.contract import EventKind, WorkerIdentity
from training.contract.events import Payload, payload_fields

__all__ = ["CheckpointRecord", "FanOut", "MetricsSink", "RestoreRecord", "SlowdownRecord", "StepRecord"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """One completed optimizer step, as seen by one rank."""

    step: int
    loss: float
    samples: int  # samples this rank processed in the step (all micro-batches)
    tokens: int  # tokens this rank processed (0 when the task gives no tokens per sample)
    step_s: float  # wall time of the whole step on this rank
    data_wait_s: float  # time spent waiting for the next batch
    comm_s: float  # measured time in gradient collectives (all-reduce / reduce-scatter)
    world_size: int
    lr: float
    time: float  # unix time when the step completed
    flops: float = 0.0  # model FLOPs of the step on this rank (0 when unknown)
    grad_norm: float | None = None
    # compute before the step's first gradient collective was issued (data wait excluded); None when
    # the step issued none (one process, or no timed collectives)
    pre_comm_s: float | None = None


@dataclass(frozen=True)
class SlowdownRecord:
    """Every `logEvery` steps, on every rank: how much slower than the median rank each rank computed.

    `ratios[r]` is rank r's slowdown (1.0 = the median rank); `straggler` the slowest rank when its
    slowdown exceeds `threshold`, else -1 (`training.metrics.straggler`).
    """

    step: int
    ratios: tuple[float, ...]
    straggler: int
    threshold: float


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint save as seen by one rank."""

    step: int
    blocked_s: float  # time training was blocked (staging)
    save_s: float | None = None  # staging -> committed, when known
    bytes: int = 0
    committed: bool = False
    stores_ok: list[str] = field(default_factory=list)
    stores_failed: list[str] = field(default_factory=list)
    time: float = 0.0


@dataclass(frozen=True)
class RestoreRecord:
    step: int
    store: str
    seconds: float
    source: str = "store"  # "store" or "node-local"
    certified: bool | None = None  # the manifest's `certified` (None: written without `sdc`)


class MetricsSink:
    """No-op base: override what you need."""

    def on_start(self, identity: WorkerIdentity) -> None:
        """The worker has joined its group (called again after every restart, with the new identity)."""

    def on_step(self, record: StepRecord) -> None:
        """A step completed on this rank."""

    def on_checkpoint(self, record: CheckpointRecord) -> None:
        """A save was staged (committed=False) or committed everywhere it could be (committed=True)."""

    def on_store_failure(self, store: str, error: str) -> None:
        """Writing to (or reading from) one store failed; training goes on."""

    def on_restore(self, record: RestoreRecord) -> None:
        """State was restored from a checkpoint."""

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Held-out evaluation results."""

    def on_slowdown(self, record: SlowdownRecord) -> None:
        """The ranks' slowdowns of the last window (every rank gets every rank's)."""

    def on_deadlines(self, deadlines: dict[str, float]) -> None:
        """The step watchdog's limit of each phase in seconds, when one changed (`training.watchdog`; from
        its thread, not the training loop's)."""

    def on_event(self, event: EventKind | str, **fields: Any) -> None:
        """Anything else worth a line in the run's history (faults, watchdog, the end of training).

        `fields` are the line's keys (`emit` fills them from a typed payload).
        """

    def emit(self, payload: Payload) -> None:
        """An event of the contract, from its typed payload (`training.contract.events`)."""
        self.on_event(payload.kind, **payload_fields(payload))

    def close(self) -> None:
        """Flush and release resources."""


class FanOut(MetricsSink):
    """Calls every sink; one failing sink never affects the others or training.

    The sinks are those given at construction (`on_step` binds their methods once).
    """

    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = list(sinks)
        self._broken: set[int] = set()
        # on_step runs every step: its bound methods are looked up once, not per call
        self._on_step = [(i, sink.on_step) for i, sink in enumerate(self.sinks)]

    def _failed(self, i: int, method: str) -> None:
        if i not in self._broken:
            self._broken.add(i)
            log.exception("metrics sink %s failed in %s; further errors of it are not logged", self.sinks[i], method)

    def _each(self, method: str, *args: Any, **kwargs: Any) -> None:
        for i, sink in enumerate(self.sinks):
            try:
                getattr(sink, method)(*args, **kwargs)
            except Exception:
                self._failed(i, method)

    def on_start(self, identity: WorkerIdentity) -> None:
        self._each("on_start", identity)

    def on_step(self, record: StepRecord) -> None:
        for i, on_step in self._on_step:
            try:
                on_step(record)
            except Exception:
                self._failed(i, "on_step")

    def on_checkpoint(self, record: CheckpointRecord) -> None:
        self._each("on_checkpoint", record)

    def on_store_failure(self, store: str, error: str) -> None:
        self._each("on_store_failure", store, error)

    def on_restore(self, record: RestoreRecord) -> None:
        self._each("on_restore", record)

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self._each("on_eval", step, metrics)

    def on_slowdown(self, record: SlowdownRecord) -> None:
        self._each("on_slowdown", record)

    def on_deadlines(self, deadlines: dict[str, float]) -> None:
        self._each("on_deadlines", deadlines)

    def on_event(self, event: EventKind | str, **fields: Any) -> None:
        self._each("on_event", event, **fields)

    def close(self) -> None:
        self._each("close")
