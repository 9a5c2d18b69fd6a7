"""Online straggler detection (training.metrics.straggler), its inputs (the first-gradient time of
`CommTimer`, the `slow_backward` fault) and its outputs (gauges, `straggler` events, the config field).
The same on a real gloo job under torchrun: tests/integration/test_straggler_hang.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from training.comm_timing import CommTimer
from training.config import MetricsConfig
from training.contract import EventKind, WorkerIdentity
from training.faults import FaultInjector, parse_faults
from training.metrics import names
from training.metrics.base import MetricsSink, SlowdownRecord, StepRecord
from training.metrics.prometheus import PrometheusSink
from training.metrics.straggler import MIN_EXCESS_S, StragglerDetector, find_straggler, slowdowns


class Recorder(MetricsSink):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.slowdowns: list[SlowdownRecord] = []

    def on_event(self, event: Any, **fields: Any) -> None:
        self.events.append((str(event), fields))

    def on_slowdown(self, record: SlowdownRecord) -> None:
        self.slowdowns.append(record)


def record(step: int, step_s: float, comm_s: float, pre_comm_s: float | None = None) -> StepRecord:
    return StepRecord(
        step=step,
        loss=1.0,
        samples=8,
        tokens=0,
        step_s=step_s,
        data_wait_s=0.0,
        comm_s=comm_s,
        world_size=3,
        lr=0.1,
        time=time.time(),
        pre_comm_s=pre_comm_s,
    )


# -- the pure decision ---------------------------------------------------------------------------------


def test_slowdowns_are_relative_to_the_median_rank() -> None:
    assert slowdowns([0.1, 0.2, 0.1]) == [1.0, 2.0, 1.0]
    # two ranks: median_low is the faster one, so a 2x slower rank reads 2.0, not 1.33
    assert slowdowns([0.1, 0.2]) == [1.0, 2.0]
    assert slowdowns([0.0, 0.0]) == [1.0, 1.0]


def test_find_straggler_names_the_slowest_rank_over_the_threshold() -> None:
    slow, ratios = find_straggler([0.10, 0.25, 0.10], None, 1.3)
    assert slow == 1 and ratios == pytest.approx([1.0, 2.5, 1.0])
    assert find_straggler([0.10, 0.12, 0.11], None, 1.3)[0] == -1  # within 30%
    # over the ratio but by less than MIN_EXCESS_S a step: millisecond jitter of a tiny model
    assert find_straggler([0.001, 0.002 + MIN_EXCESS_S / 2, 0.001], None, 1.3)[0] == -1


def test_ddp_overlap_compute_outside_collectives_alone_can_be_blind_pre_comm_is_not() -> None:
    # With a backend that reports collectives as done at once (comm_s ~ 0), every rank's time outside
    # collectives equals its step time, which DDP makes equal on all ranks; the time before the
    # first gradient collective still singles out rank 1 (slowed inside its backward).
    compute = [0.30, 0.30, 0.30]
    pre_comm = [0.05, 0.25, 0.05]
    assert find_straggler(compute, None, 1.3)[0] == -1
    slow, ratios = find_straggler(compute, pre_comm, 1.3)
    assert slow == 1 and ratios == pytest.approx([1.0, 5.0, 1.0])


# -- the detector, with a fake all-gather ---------------------------------------------------------------


def detectors(n: int, every: int = 5, threshold: float = 1.3) -> tuple[list[StragglerDetector], list[Recorder]]:
    """`n` ranks in one process, exchanging through a real all-gather (threads and a barrier)."""
    sinks = [Recorder() for _ in range(n)]
    barrier = threading.Barrier(n, timeout=10)
    slots: list[list[float]] = [[] for _ in range(n)]

    def exchange_for(rank: int) -> Any:
        def exchange(mine: list[float]) -> list[list[float]]:
            slots[rank] = mine
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

        return exchange

    dets = [
        StragglerDetector(
            WorkerIdentity(rank=r, world_size=n), sinks[r], every=every, threshold=threshold, exchange=exchange_for(r)
        )
        for r in range(n)
    ]
    return dets, sinks


def run_ranks(dets: list[StragglerDetector], records: Callable[[int], list[StepRecord]]) -> None:
    """Every rank observes its records in its own thread (the exchange blocks like a collective)."""
    errors: list[BaseException] = []

    def loop(rank: int) -> None:
        try:
            for rec in records(rank):
                dets[rank].observe(rec)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(r,)) for r in range(len(dets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors, errors


def run_steps(dets: list[StragglerDetector], steps: range, slow_rank: int | None, extra_s: float) -> None:
    def records(rank: int) -> list[StepRecord]:
        slow = extra_s if rank == slow_rank else 0.0
        # DDP: every rank's step time is the slow one's; the waiting ranks spend it in the all-reduce
        step_s = 0.02 + extra_s if slow_rank is not None else 0.02
        return [record(step, step_s, step_s - 0.015 - slow, pre_comm_s=0.01 + slow) for step in steps]

    run_ranks(dets, records)


def test_detector_reports_every_window_and_rank_0_writes_events_on_change() -> None:
    dets, sinks = detectors(3)
    run_steps(dets, range(1, 11), None, 0.0)
    assert [r.step for r in sinks[0].slowdowns] == [5, 10] and all(r.straggler == -1 for r in sinks[1].slowdowns)
    assert not sinks[0].events  # no straggler, no change, no event
    run_steps(dets, range(11, 16), 1, 0.05)
    last = [s.slowdowns[-1] for s in sinks]
    assert last[0].ratios[1] > 1.3 and last[0].ratios[0] == pytest.approx(1.0)  # the ratios at once ...
    assert {r.straggler for r in last} == {-1} and not sinks[0].events  # ... the verdict after 2 windows
    run_steps(dets, range(16, 21), 1, 0.05)
    assert {s.slowdowns[-1].straggler for s in sinks} == {1}  # every rank knows
    kinds = [e for e, _ in sinks[0].events]
    assert kinds == [EventKind.STRAGGLER.value] and not sinks[1].events and not sinks[2].events
    fields = sinks[0].events[0][1]
    assert fields["slow_rank"] == 1 and fields["slowdown_ratio"] > 1.3 and fields["step"] == 20
    assert len(fields["ratios"]) == 3 and fields["threshold"] == 1.3
    run_steps(dets, range(21, 31), 1, 0.05)
    assert len(sinks[0].events) == 1  # unchanged: no new event
    run_steps(dets, range(31, 36), None, 0.0)
    assert len(sinks[0].events) == 1  # one fast window does not end it
    run_steps(dets, range(36, 41), None, 0.0)
    assert sinks[0].events[-1][1]["slow_rank"] == -1 and sinks[0].events[-1][1]["step"] == 40  # cleared


def test_one_noisy_window_is_no_straggler() -> None:
    dets, sinks = detectors(3)
    run_steps(dets, range(1, 6), None, 0.0)
    run_steps(dets, range(6, 11), 2, 0.05)  # rank 2 descheduled for one window
    run_steps(dets, range(11, 16), 0, 0.05)  # then rank 0
    run_steps(dets, range(16, 21), None, 0.0)
    assert sinks[0].slowdowns[1].ratios[2] > 1.3 and sinks[0].slowdowns[2].ratios[0] > 1.3
    assert all(r.straggler == -1 for r in sinks[0].slowdowns) and not sinks[0].events


def test_detector_without_pre_comm_on_some_rank_uses_compute_only() -> None:
    dets, sinks = detectors(2, every=1)
    run_ranks(dets, lambda r: [record(s, 0.2 if r else 0.05, 0.0, None if r else 0.01) for s in (1, 2, 3)])
    assert len(sinks[0].slowdowns) == 2  # step 1 (each process's first) is left out: no window yet
    got = sinks[0].slowdowns[-1]
    assert got.straggler == 1 and got.ratios == pytest.approx((1.0, 4.0))


# -- where the measurements come from ------------------------------------------------------------------


def test_comm_timer_keeps_the_first_gradient_collective_until_taken() -> None:
    timer = CommTimer()
    assert timer.take_first_gradient() is None
    timer.gradient_issued(5.0)
    timer.gradient_issued(3.0)
    timer.gradient_issued(4.0)
    assert timer.take_first_gradient() == 3.0
    assert timer.take_first_gradient() is None


def test_slow_backward_fault_parses_and_needs_seconds() -> None:
    (fault,) = parse_faults('[{"kind": "slow_backward", "rank": 1, "step": 3, "seconds": 0.2}]')
    assert fault.kind == "slow_backward" and fault.seconds == 0.2
    with pytest.raises(ValueError, match="slow_backward fault needs seconds > 0"):
        parse_faults('[{"kind": "slow_backward", "rank": 1, "step": 3}]')


def test_slow_backward_delays_the_backward_pass_before_any_gradient_is_ready() -> None:
    """The delay runs inside autograd, before the first parameter gradient (hence before DDP's first
    bucket) and only from the fault's step on, once per step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    ready: list[float] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: ready.append(time.perf_counter()))
    sink = Recorder()
    faults = FaultInjector(
        parse_faults('[{"kind": "slow_backward", "rank": 1, "step": 2, "seconds": 0.2}]'),
        rank=1,
        generation=0,
        events=sink,
    )

    def backward(step: int) -> tuple[float, float]:
        ready.clear()
        loss = model(torch.randn(8, 4)).pow(2).mean()
        faults.before_backward(loss, step)
        faults.before_backward(loss, step)  # a second micro-batch of the same step: no second delay
        start = time.perf_counter()
        loss.backward()  # type: ignore[no-untyped-call]
        return min(ready) - start, time.perf_counter() - start

    first_ready, total = backward(1)
    assert total < 0.15
    first_ready, total = backward(2)
    assert first_ready >= 0.2 and 0.2 <= total < 0.4
    assert [e for e, _ in sink.events] == [EventKind.FAULT.value]
    assert sink.events[0][1] == {"kind": "slow_backward", "step": 2, "seconds": 0.2}
    other_rank = FaultInjector(faults.faults, rank=0, generation=0, events=sink)
    assert other_rank.faults == []


# -- outputs ----------------------------------------------------------------------------------------------


def gauge(sink: PrometheusSink, name: str) -> float | None:
    return sink.registry.get_sample_value(name, {"training_job": "j", "rank": "1", "node": "n"})


def test_prometheus_exports_the_slowdown_and_the_straggler() -> None:
    sink = PrometheusSink(WorkerIdentity(job="j", rank=1, world_size=3, local_rank=1, local_world_size=3, node="n"))
    try:
        assert gauge(sink, names.STRAGGLER_RANK) == -1
        assert gauge(sink, names.RANK_SLOWDOWN) is None  # no series before the first window
        sink.on_slowdown(SlowdownRecord(step=10, ratios=(1.0, 2.5, 0.9), straggler=1, threshold=1.3))
        assert gauge(sink, names.RANK_SLOWDOWN) == 2.5 and gauge(sink, names.STRAGGLER_RANK) == 1
        sink.on_event(EventKind.STRAGGLER, slow_rank=1)
        sample = {"training_job": "j", "rank": "1", "node": "n", "event": "straggler"}
        assert sink.registry.get_sample_value(names.EVENTS, sample) == 1
    finally:
        sink.close()


def test_threshold_is_a_documented_config_field_above_one() -> None:
    assert MetricsConfig().straggler_threshold == 1.3
    assert MetricsConfig.model_validate({"stragglerThreshold": 2}).straggler_threshold == 2.0
    assert MetricsConfig.model_fields["straggler_threshold"].description
    with pytest.raises(ValidationError, match="stragglerThreshold"):
        MetricsConfig.model_validate({"stragglerThreshold": 1.0})
