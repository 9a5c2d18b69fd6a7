"""create_sinks (without the HTTP server) and the overhead benchmark."""

from __future__ import annotations

import json
from pathlib import Path

from tests.fixtures import jobs
from training.config import load_worker_spec
from training.contract import WorkerIdentity
from training.metrics import FanOut, create_sinks
from training.metrics.base import StepRecord
from training.metrics.bench import measure_on_step_overhead
from training.metrics.jsonl import EventsJsonlSink, MetricsJsonlSink

SPEC = """
metadata: {name: demo}
spec:
  task: {entrypoint: "training.examples.digits:task"}
  training: {steps: 10}
  metrics: {enabled: false, logEvery: 2}
"""


def info(rank: int, run_dir: str | None) -> WorkerIdentity:
    return WorkerIdentity(job="demo", rank=rank, local_rank=rank, node_rank=0, world_size=2, local_world_size=2,
                          generation=0, run_dir=run_dir)  # fmt: skip


def test_rank0_gets_both_jsonl_sinks_other_ranks_only_events(tmp_path: Path) -> None:
    spec = load_worker_spec(SPEC)
    r0 = create_sinks(spec, info(0, str(tmp_path)))
    r1 = create_sinks(spec, info(1, str(tmp_path)))
    assert isinstance(r0, FanOut)
    assert sorted(type(s).__name__ for s in r0.sinks) == ["EventsJsonlSink", "MetricsJsonlSink"]
    assert [type(s) for s in r1.sinks] == [EventsJsonlSink]
    for rank, sink in ((0, r0), (1, r1)):
        sink.on_start(info(rank, str(tmp_path)))
        for i in range(1, 5):
            sink.on_step(StepRecord(i, 1.0, 8, 0, 0.1, 0.0, 0.0, 2, 0.1, float(i)))
        sink.close()
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 4]
    events = jobs.events(tmp_path)
    assert sorted(e["rank"] for e in events if e["event"] == "start") == [0, 1]
    assert not any(isinstance(s, MetricsJsonlSink) for s in r1.sinks)


def test_no_run_dir_no_sinks() -> None:
    assert create_sinks(load_worker_spec(SPEC), info(0, None)).sinks == []


def test_on_step_overhead_below_half_a_percent_of_a_50ms_step() -> None:
    result = measure_on_step_overhead(calls=3000, step_s=0.05)
    assert result.per_call_us > 0
    assert result.overhead_ratio < 0.005, result
