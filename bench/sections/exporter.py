"""Exporter overhead: the real worker with the Prometheus exporter on and off, and the cost of one step
through every metrics sink as a share of the measured step time."""

from __future__ import annotations

from typing import Any

from bench.common import stats
from bench.sections.base import Results, Section
from bench.workloads import worker_throughput


def bench_exporter(repeats: int, steps: int) -> dict[str, Any]:
    """Exporter overhead: (a) the real worker with the Prometheus exporter on and off, alternated in one
    run; (b) the cost of one `on_step` through every sink, as a share of the measured step time."""
    from training.metrics import bench as metrics_bench

    on, off, step_times = [], [], []
    for _ in range(repeats):
        t_on, s_on = worker_throughput(steps, True)
        t_off, _ = worker_throughput(steps, False)
        on.append(t_on)
        off.append(t_off)
        step_times.append(s_on)
    step_s = stats(step_times)["median"]
    micro = metrics_bench.measure_on_step_overhead(step_s=step_s)
    end_to_end = [1.0 - a / b for a, b in zip(on, off, strict=True)]
    return {
        "overhead_ratio": micro.overhead_ratio,
        "on_step_us": micro.per_call_us,
        "measured_step_s": step_s,
        "end_to_end_ratio": stats(end_to_end)["median"],
        "end_to_end_stats": stats(end_to_end),
        "samples_per_s_with_exporter": stats(on)["median"],
        "samples_per_s_without_exporter": stats(off)["median"],
        "target": "< 0.0015",
        "on_step_target_us": 5.0,
        "note": "overhead_ratio = cost of on_step through all sinks (median of 5 timed runs) / median step "
        "time of the same job; end_to_end_ratio = 1 - throughput(on)/throughput(off), alternated runs "
        "(noise-limited here)",
    }


def publish(results: Results, value: Results) -> None:
    # The headline figure also sits at the top level of latest.json (docs/performance.md reads it there).
    results["exporter_overhead_ratio"] = value.get("overhead_ratio")
    results["exporter"] = value


SECTION = Section("exporter", lambda quick: bench_exporter(2 if quick else 5, 60 if quick else 200), publish)
