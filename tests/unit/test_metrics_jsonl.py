"""metrics.jsonl (rank 0) and events.jsonl (every rank): the run-directory contract."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from training.contract import EventKind, WorkerIdentity
from training.contract.events import Fault, Watchdog
from training.metrics.base import CheckpointRecord, FanOut, RestoreRecord, StepRecord
from training.metrics.jsonl import EventsJsonlSink, MetricsJsonlSink

INFO = WorkerIdentity(
    job="j", rank=0, local_rank=0, node_rank=0, world_size=2, local_world_size=2, generation=1, node="h"
)
METRICS_KEYS = {
    "time", "step", "loss", "lr", "samples_per_s", "tokens_per_s", "step_s", "data_wait_s",
    "comm_s", "comm_ratio", "world_size", "generation", "mfu",
}  # fmt: skip


def rec(i: int, step_s: float = 0.1, loss: float = 1.0, flops: float = 0.0) -> StepRecord:
    return StepRecord(
        step=i, loss=loss, samples=16, tokens=160, step_s=step_s, data_wait_s=0.01, comm_s=0.025,
        world_size=2, lr=0.001, time=100.0 + i, flops=flops,
    )  # fmt: skip


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_line_every_log_every_steps(tmp_path: Path) -> None:
    sink = MetricsJsonlSink(tmp_path, INFO, log_every=5, peak_flops=1e12)
    for i in range(1, 13):
        sink.on_step(rec(i, flops=5e10))
    sink.close()
    got = lines(tmp_path / "metrics.jsonl")
    assert [g["step"] for g in got] == [5, 10, 12]  # close() writes the final partial window
    first = got[0]
    assert set(first) == METRICS_KEYS
    assert first["time"] == 105.0
    assert first["step_s"] == pytest.approx(0.1)
    assert first["data_wait_s"] == pytest.approx(0.01)
    assert first["comm_s"] == pytest.approx(0.025)
    assert first["comm_ratio"] == pytest.approx(0.25)
    # global throughput: 16 samples per rank x 2 ranks per 0.1 s
    assert first["samples_per_s"] == pytest.approx(320.0)
    assert first["tokens_per_s"] == pytest.approx(3200.0)
    assert first["world_size"] == 2 and first["generation"] == 1
    assert first["mfu"] == pytest.approx(0.5)  # 5e10 FLOPs / 0.1 s / 1e12


def test_mfu_null_without_peak_and_nan_loss_is_null(tmp_path: Path) -> None:
    sink = MetricsJsonlSink(tmp_path, INFO, log_every=1)
    sink.on_step(rec(1, loss=math.nan, flops=1e9))
    sink.close()
    (line,) = lines(tmp_path / "metrics.jsonl")
    assert line["mfu"] is None and line["loss"] is None


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=1e-4, max_value=100.0), min_size=1, max_size=20))
def test_window_means(tmp_path_factory: pytest.TempPathFactory, step_times: list[float]) -> None:
    run_dir = tmp_path_factory.mktemp("run")
    n = len(step_times)
    sink = MetricsJsonlSink(run_dir, INFO, log_every=n)
    for i, s in enumerate(step_times, start=1):
        sink.on_step(rec(i, step_s=s))
    sink.close()
    (line,) = lines(run_dir / "metrics.jsonl")
    assert line["step_s"] == pytest.approx(sum(step_times) / n)
    assert line["samples_per_s"] == pytest.approx(16 * 2 * n / sum(step_times))


def test_events_contract(tmp_path: Path) -> None:
    sink = EventsJsonlSink(tmp_path, INFO, log_every=2)
    sink.on_start(INFO)
    sink.on_restore(RestoreRecord(step=10, store="local", seconds=0.5))
    for i in range(11, 15):
        sink.on_step(rec(i, step_s=0.1 * (i - 10)))
    sink.on_checkpoint(CheckpointRecord(step=14, blocked_s=0.1, time=200.0))
    sink.on_checkpoint(
        CheckpointRecord(step=14, blocked_s=0.1, save_s=2.0, committed=True, stores_ok=["a"], stores_failed=["b"])
    )
    sink.on_store_failure("b", "timeout")
    sink.on_event("finished", steps=14)
    sink.close()
    sink.on_event("after_close")  # ignored, no error
    got = lines(tmp_path / "events.jsonl")
    assert [g["event"] for g in got] == [
        "start", "restore", "first_step", "step_times", "step_times", "checkpoint_staged", "checkpoint_committed",
        "store_failure", "finished",
    ]  # fmt: skip
    for g in got:
        assert g["rank"] == 0 and g["generation"] == 1 and g["time"] > 0
    start, restore, first, st12, st14, staged, committed, failure, finished = got
    assert first["step"] == 11, "the first step after a restore marks the end of the recovery"
    assert start["world_size"] == 2 and start["local_rank"] == 0 and start["node_rank"] == 0 and start["pid"] > 0
    assert restore == {**restore, "step": 10, "store": "local", "seconds": 0.5, "source": "store"}
    assert st12["step"] == 12 and st12["step_s"] == pytest.approx(0.15)
    assert st14["step"] == 14 and st14["step_s"] == pytest.approx(0.35)
    assert st14["compute_s"] == pytest.approx(st14["step_s"] - st14["comm_s"])
    assert staged["step"] == 14 and staged["time"] == 200.0
    assert committed["stores_ok"] == ["a"] and committed["stores_failed"] == ["b"] and committed["save_s"] == 2.0
    assert failure["store"] == "b" and failure["error"] == "timeout"
    assert finished["steps"] == 14


def test_typed_payloads_reach_the_file_through_a_fan_out(tmp_path: Path) -> None:
    sink = FanOut(EventsJsonlSink(tmp_path, INFO, log_every=1))
    sink.emit(Fault(fault="slow", step=3, seconds=0.5))
    sink.emit(Watchdog(step=3, silent_s=1.5, timeout_s=1.0))
    sink.on_event(EventKind.FINISHED, step=4, final_loss=None, wall_s=2.0)
    sink.close()
    fault, dog, finished = lines(tmp_path / "events.jsonl")
    # the fault's kind is `kind` next to `event: fault`; unset optional keys are left out
    assert {k: fault[k] for k in ("event", "kind", "step", "seconds")} == {
        "event": "fault", "kind": "slow", "step": 3, "seconds": 0.5,
    }  # fmt: skip
    assert "pid" not in fault
    assert dog["event"] == "watchdog" and dog["silent_s"] == 1.5 and dog["timeout_s"] == 1.0
    assert finished["event"] == "finished" and finished["final_loss"] is None
    assert all(line["rank"] == 0 and line["generation"] == 1 for line in (fault, dog, finished))


def _append_many(run_dir: str, rank: int, count: int) -> None:
    info = WorkerIdentity(job="j", rank=rank, local_rank=rank, node_rank=0, world_size=4, local_world_size=4)
    sink = EventsJsonlSink(run_dir, info, log_every=1)
    for i in range(count):
        sink.on_event("fault", i=i, padding="x" * 200)
    sink.close()


def test_concurrent_ranks_never_interleave_lines(tmp_path: Path) -> None:
    # Each sink has its own O_APPEND descriptor, as each rank process does; the kernel appends every
    # single write() atomically whichever thread or process issues it.
    threads = [threading.Thread(target=_append_many, args=(str(tmp_path), r, 500)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    got = lines(tmp_path / "events.jsonl")  # every line parses: no torn writes
    assert len(got) == 2000
    for r in range(4):
        assert [g["i"] for g in got if g["rank"] == r] == list(range(500))
