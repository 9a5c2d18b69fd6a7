"""Cost of the exporter on the training hot path: `on_step` time per call vs a typical step.

`python -m training.metrics.bench` prints the result as JSON. The budget: 5 us per step, 0.15% of the
bench job's 3.8 ms step (docs/performance.md).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

from training.contract import WorkerIdentity
from training.metrics.base import FanOut, MetricsSink, StepRecord

__all__ = ["OverheadResult", "measure_on_step_overhead"]


@dataclass(frozen=True)
class OverheadResult:
    """What `measure_on_step_overhead` measured."""

    calls: int
    per_call_us: float  # mean wall time of one `on_step` (median over the repeats), microseconds
    step_s: float  # the step time it is compared to
    overhead_ratio: float  # per_call / step_s
    sinks: str


def measure_on_step_overhead(
    calls: int = 20_000, step_s: float = 0.05, with_jsonl: bool = True, log_every: int = 10, repeats: int = 5
) -> OverheadResult:
    """Time `on_step` of the real sinks (Prometheus registry, no HTTP server; JSON lines in a temp dir).

    Args:
        calls: `on_step` calls to time (after 1,000 warm-up calls), in `repeats` equal runs; the mean
            per call of the median run is the result (a shared machine's noise hits single runs).
        step_s: the step time to compare against (50 ms: a small model's DDP step).
        with_jsonl: include rank 0's JSON-lines sinks (one buffered line per `log_every` steps).
        log_every: `metrics.logEvery` of the JSON-lines sinks.
        repeats: runs the calls are split into.

    Returns:
        The mean cost per call and its share of `step_s`.
    """
    from training.metrics.jsonl import EventsJsonlSink, MetricsJsonlSink
    from training.metrics.prometheus import PrometheusSink

    identity = WorkerIdentity(job="bench", world_size=8, local_world_size=8)
    with tempfile.TemporaryDirectory() as tmp:
        sinks: list[MetricsSink] = [PrometheusSink(identity, port=None, peak_flops=989e12)]
        if with_jsonl:
            sinks += [MetricsJsonlSink(tmp, identity, log_every), EventsJsonlSink(tmp, identity, log_every)]
        sink = FanOut(*sinks)
        now = time.time()
        records = [
            StepRecord(
                step=i + 1,
                loss=2.0 / (i + 1),
                samples=32,
                tokens=32 * 256,
                step_s=step_s * (0.9 + 0.2 * (i % 7) / 7),
                data_wait_s=0.001,
                comm_s=step_s * 0.2,
                world_size=8,
                lr=1e-3,
                time=now + i * step_s,
                flops=1e12,
                grad_norm=1.0,
            )
            for i in range(calls + 1000)
        ]
        for r in records[:1000]:
            sink.on_step(r)
        runs = max(1, repeats)
        per_run = max(1, calls // runs)
        per_call_s: list[float] = []
        for k in range(runs):
            chunk = records[1000 + k * per_run : 1000 + (k + 1) * per_run]
            t0 = time.perf_counter()
            for r in chunk:
                sink.on_step(r)
            per_call_s.append((time.perf_counter() - t0) / len(chunk))
        sink.close()
    per_call = statistics.median(per_call_s)
    return OverheadResult(
        calls=per_run * runs,
        per_call_us=per_call * 1e6,
        step_s=step_s,
        overhead_ratio=per_call / step_s,
        sinks=", ".join(type(s).__name__ for s in sinks),
    )


if __name__ == "__main__":
    print(json.dumps(asdict(measure_on_step_overhead())))
