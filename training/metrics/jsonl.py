"""The run's history as JSON lines in the run directory (contract: docs/architecture.md).

- `MetricsJsonlSink` (rank 0 only): `metrics.jsonl`, one object per `logEvery` steps with the window's
  means: `time, step, loss, lr, samples_per_s, tokens_per_s, step_s, data_wait_s, comm_s, comm_ratio,
  world_size, generation, mfu`. `samples_per_s`/`tokens_per_s` are the job's global throughput (this
  rank's count x world size / step time: every rank runs the same batch size); `loss` and `lr` are
  those of the window's last step; `mfu` is null when FLOPs or the peak are unknown. `close()` writes
  the steps since the last record too, so the final step is always in the file.
- `EventsJsonlSink` (every rank): `events.jsonl`, one `{"time", "rank", "generation", "event", ...}`
  line per event (the kinds and payloads of `training.contract.events`), written with a single
  `write` on an `O_APPEND` descriptor so lines of concurrent ranks never interleave.

Both files are written through the contract's one JSON-lines writer (`append_jsonl`), at the paths
of `RunFiles`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

from training.contract import EventKind, RunFiles, WorkerIdentity, append_jsonl, open_append
from training.contract.events import (
    CheckpointCommitted,
    CheckpointStaged,
    Eval,
    FirstStep,
    Payload,
    Restore,
    Start,
    StepTimes,
    StoreFailure,
    payload_fields,
)
from training.metrics.base import CheckpointRecord, MetricsSink, RestoreRecord, StepRecord

__all__ = ["EventsJsonlSink", "MetricsJsonlSink"]

log = logging.getLogger(__name__)


def _finite(value: float) -> float | None:
    # JSON has no NaN/Infinity; a diverged loss is written as null rather than breaking parsers.
    return value if math.isfinite(value) else None


class _Window:
    """Sums over the steps since the last record."""

    __slots__ = ("comm_s", "data_wait_s", "flops", "n", "samples", "step_s", "tokens")

    def __init__(self) -> None:
        self.n = 0
        self.samples = 0
        self.tokens = 0
        self.step_s = 0.0
        self.data_wait_s = 0.0
        self.comm_s = 0.0
        self.flops = 0.0


class MetricsJsonlSink(MetricsSink):
    """Rank 0's `metrics.jsonl`: one line per `log_every` steps."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        identity: WorkerIdentity,
        log_every: int,
        peak_flops: float | None = None,
    ) -> None:
        self.path = RunFiles(run_dir).metrics
        self.identity = identity
        self.log_every = max(1, log_every)
        self.peak_flops = peak_flops if peak_flops and peak_flops > 0 else None
        self._window = _Window()
        self._last: StepRecord | None = None
        self._fd: int | None = open_append(self.path)

    def on_start(self, identity: WorkerIdentity) -> None:
        self.identity = identity

    def on_step(self, record: StepRecord) -> None:
        w = self._window  # this runs every step: plain additions in place
        w.n += 1
        w.samples += record.samples
        w.tokens += record.tokens
        w.step_s += record.step_s
        w.data_wait_s += record.data_wait_s
        w.comm_s += record.comm_s
        w.flops += record.flops
        self._last = record
        if record.step % self.log_every == 0:
            self._write(record)

    def _write(self, last: StepRecord) -> None:
        w, self._window = self._window, _Window()
        if self._fd is None or w.n == 0:
            return
        ws = last.world_size
        mfu = None
        if self.peak_flops is not None and w.flops > 0 and w.step_s > 0:
            mfu = w.flops / w.step_s / self.peak_flops
        obj = {
            "time": last.time,
            "step": last.step,
            "loss": _finite(last.loss),
            "lr": last.lr,
            "samples_per_s": w.samples * ws / w.step_s if w.step_s > 0 else None,
            "tokens_per_s": w.tokens * ws / w.step_s if w.step_s > 0 and w.tokens else None,
            "step_s": w.step_s / w.n,
            "data_wait_s": w.data_wait_s / w.n,
            "comm_s": w.comm_s / w.n,
            "comm_ratio": w.comm_s / w.step_s if w.step_s > 0 else None,
            "world_size": ws,
            "generation": self.identity.generation,
            "mfu": mfu,
        }
        append_jsonl(self._fd, obj)

    def close(self) -> None:
        """Write the steps since the last record (the run's final step), then close the file."""
        if self._last is not None and self._window.n:
            self._write(self._last)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class EventsJsonlSink(MetricsSink):
    """Every rank's events in the shared `events.jsonl` (O_APPEND, one `write` per line)."""

    def __init__(self, run_dir: str | os.PathLike[str], identity: WorkerIdentity, log_every: int) -> None:
        self.path = RunFiles(run_dir).events
        self.identity = identity
        self.log_every = max(1, log_every)
        self._fd: int | None = open_append(self.path)
        self._step_s_sum = 0.0
        self._comm_s_sum = 0.0
        self._steps = 0
        self._first_step_seen = False

    def write(self, event: EventKind | str, **fields: Any) -> None:
        """Append one event line (`fields["time"]`, when given, is the event's time; else now)."""
        if self._fd is None:
            return
        obj: dict[str, Any] = {
            "time": fields.pop("time", None) or time.time(),
            "rank": self.identity.rank,
            "generation": self.identity.generation,
            "event": str(event),
        }
        obj.update(fields)
        append_jsonl(self._fd, obj)

    def emit(self, payload: Payload, *, at: float | None = None) -> None:
        """Append one event of the contract, at unix time `at` (default: now)."""
        self.write(payload.kind, time=at, **payload_fields(payload))

    def on_start(self, identity: WorkerIdentity) -> None:
        self.identity = identity
        self.emit(
            Start(
                pid=os.getpid(),
                world_size=identity.world_size,
                node_rank=identity.node_rank,
                local_rank=identity.local_rank,
                node=identity.node,
            )
        )

    def on_step(self, record: StepRecord) -> None:
        if not self._first_step_seen:
            # The first step this process completed: after a restart, the end of the recovery (MTTR).
            self._first_step_seen = True
            self.emit(FirstStep(step=record.step, world_size=record.world_size), at=record.time)
        self._step_s_sum += record.step_s
        self._comm_s_sum += record.comm_s
        self._steps += 1
        if record.step % self.log_every == 0:
            n = self._steps
            step_s, comm_s = self._step_s_sum / n, self._comm_s_sum / n
            self._step_s_sum, self._comm_s_sum, self._steps = 0.0, 0.0, 0
            # compute_s separates a straggler from the ranks that wait for it inside the collectives.
            times = StepTimes(step=record.step, step_s=step_s, comm_s=comm_s, compute_s=step_s - comm_s)
            # emit(times), its fields spelled out: on the training thread, payload_fields' asdict()
            # cost as much as encoding the line (docs/performance.md)
            self.write(
                times.kind,
                time=record.time,
                step=times.step,
                step_s=times.step_s,
                comm_s=times.comm_s,
                compute_s=times.compute_s,
            )

    def on_checkpoint(self, record: CheckpointRecord) -> None:
        payload: Payload
        if record.committed:
            payload = CheckpointCommitted(
                step=record.step,
                blocked_s=record.blocked_s,
                save_s=record.save_s,
                bytes=record.bytes,
                stores_ok=list(record.stores_ok),
                stores_failed=list(record.stores_failed),
            )
        else:
            payload = CheckpointStaged(step=record.step, blocked_s=record.blocked_s, bytes=record.bytes)
        self.emit(payload, at=record.time)

    def on_store_failure(self, store: str, error: str) -> None:
        self.emit(StoreFailure(store=store, error=error))

    def on_restore(self, record: RestoreRecord) -> None:
        self.emit(
            Restore(
                step=record.step,
                store=record.store,
                seconds=record.seconds,
                source=record.source,
                certified=record.certified,
            )
        )

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.emit(Eval(step=step, metrics=metrics))

    def on_event(self, event: EventKind | str, **fields: Any) -> None:
        self.write(event, **fields)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
