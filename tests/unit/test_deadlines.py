"""Automatic hang deadlines (`training.deadlines`) and the watchdog's use of them, on a fake clock.

No thread, process or socket: `StepWatchdog.overdue()` is called directly with an injected clock.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from training.config import RestartsConfig
from training.deadlines import FIRST_STEP, FIRST_STEP_WARMUP, STEP, DeadlinePolicy, Samples, StepDeadlines
from training.metrics.base import MetricsSink
from training.watchdog import AUTO_SETTING, StepWatchdog

POSITIVE = st.floats(min_value=1e-4, max_value=1e4, allow_nan=False, allow_infinity=False)
# the first interval after start-up is a first step: 21 intervals finish a warm-up of 20 steps
INTERVALS = st.lists(st.floats(min_value=1e-4, max_value=5.0, allow_nan=False), min_size=21, max_size=300)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Gauges(MetricsSink):
    def __init__(self) -> None:
        self.published: list[dict[str, float]] = []

    def on_deadlines(self, deadlines: dict[str, float]) -> None:
        self.published.append(deadlines)


def _policy(**kw: float | int | bool) -> DeadlinePolicy:
    base: dict[str, float | int | bool] = {"cap_s": 10.0, "multiplier": 10.0, "floor_s": 0.5, "warmup_steps": 20}
    base.update(kw)
    return DeadlinePolicy(**base)  # type: ignore[arg-type]


def _watchdog(policy: DeadlinePolicy, clock: Clock, sink: MetricsSink | None = None) -> StepWatchdog:
    return StepWatchdog(policy.cap_s, sink or MetricsSink(), policy=policy, clock=clock)


def _train(dog: StepWatchdog, clock: Clock, intervals: list[float], first: int = 1) -> int:
    """Beat once to start (as `Trainer.run` does), then once per completed step `intervals` apart."""
    dog.beat(first - 1)
    step = first - 1
    for interval in intervals:
        clock.advance(interval)
        step += 1
        dog.beat(step)
        assert dog.overdue() is None
    return step


def _trained(intervals: list[float]) -> tuple[DeadlinePolicy, Clock, StepWatchdog, int]:
    policy, clock = _policy(cap_s=600.0), Clock()
    dog = _watchdog(policy, clock)
    return policy, clock, dog, _train(dog, clock, intervals)


# -- the rule ------------------------------------------------------------------------------------------
@given(observed=POSITIVE, cap=POSITIVE, floor=POSITIVE, multiplier=st.floats(min_value=1, max_value=100))
def test_derived_deadline_within_floor_and_cap(observed: float, cap: float, floor: float, multiplier: float) -> None:
    policy = DeadlinePolicy(cap_s=cap, floor_s=floor, multiplier=multiplier)
    deadline = policy.derive(observed)
    assert deadline <= cap
    assert deadline >= min(floor, cap)
    assert policy.derive(None) == cap  # warm-up: the cap


@given(a=POSITIVE, b=POSITIVE, cap=POSITIVE, floor=POSITIVE, multiplier=st.floats(min_value=1, max_value=100))
def test_derived_deadline_monotone_in_the_quantile(
    a: float, b: float, cap: float, floor: float, multiplier: float
) -> None:
    policy = DeadlinePolicy(cap_s=cap, floor_s=floor, multiplier=multiplier)
    low, high = sorted((a, b))
    assert policy.derive(low) <= policy.derive(high)


def test_fixed_mode_is_the_cap() -> None:
    policy = _policy(auto=False)
    deadlines = StepDeadlines(policy)
    for i in range(100):
        deadlines.beat(float(i) * 0.01, i)
    assert deadlines.deadline_s == policy.cap_s == policy.derive(0.001)


@given(
    values=st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), min_size=1, max_size=80),
    window=st.integers(min_value=1, max_value=40),
    q=st.floats(min_value=0.01, max_value=1.0),
)
def test_samples_quantile_is_the_nearest_rank_of_the_window(values: list[float], window: int, q: float) -> None:
    samples = Samples(window)
    for v in values:
        samples.add(v)
    recent = sorted(values[-window:])
    assert len(samples) == len(recent)
    assert samples.quantile(q) == recent[max(0, math.ceil(q * len(recent)) - 1)]


# -- step deadlines from beats ------------------------------------------------------------------------
@settings(max_examples=60)
@given(intervals=INTERVALS)
def test_no_alarm_on_a_step_within_the_observed_distribution(intervals: list[float]) -> None:
    """After warm-up, a step no longer than the p99 of what was seen is never overdue (cap above it)."""
    policy, clock, dog, step = _trained(intervals)
    p99 = Samples(len(intervals))
    for v in intervals[1:]:
        p99.add(v)
    clock.advance(p99.quantile(0.99))  # a step as slow as the p99 (the previous ones all passed above)
    assert dog.overdue() is None
    assert dog.limit()[0] >= max(policy.floor_s, policy.multiplier * p99.quantile(0.99)) - 1e-9
    dog.beat(step + 1)


@settings(max_examples=60)
@given(intervals=INTERVALS)
def test_a_hang_is_caught_at_the_derived_deadline(intervals: list[float]) -> None:
    policy, clock, dog, _ = _trained(intervals)
    deadline, setting, phase = dog.limit()
    assert phase == STEP
    assert deadline == dog.deadlines.step_s < policy.cap_s
    assert setting == AUTO_SETTING
    clock.advance(deadline * 0.999)
    assert dog.overdue() is None
    clock.advance(deadline * 0.002)
    found = dog.overdue()
    assert found is not None and found.phase == STEP and found.timeout_s == deadline
    assert "derived from the steps" in found.describe()


def test_warm_up_is_judged_by_the_cap() -> None:
    policy = _policy(warmup_steps=20)
    clock = Clock()
    dog = _watchdog(policy, clock)
    _train(dog, clock, [0.01] * 20)
    assert dog.limit()[0] == policy.cap_s  # a first step and 19 steps: still warming up
    clock.advance(5.0)  # far past any derived deadline, within the cap
    assert dog.overdue() is None
    dog.beat(21)  # the 20th interval (5 s) is a sample too: the p99 of twenty is their maximum
    assert dog.limit()[0] == min(policy.cap_s, 10 * 5.0)


def test_a_beat_without_a_new_step_is_no_sample() -> None:
    deadlines = StepDeadlines(_policy())
    deadlines.beat(0.0, 5)
    deadlines.beat(3.0, 5)  # the end of a save, say: same step
    deadlines.beat(3.5, None)
    assert deadlines.samples == 0
    deadlines.beat(3.51, 6)
    assert deadlines.samples == 0  # the first interval after start-up is a first step
    deadlines.beat(3.52, 7)
    assert deadlines.samples == 1


# -- phases that are no step --------------------------------------------------------------------------
def test_a_checkpoint_step_is_never_judged_by_the_step_deadline() -> None:
    policy = _policy()
    clock = Clock()
    dog = _watchdog(policy, clock)
    step = _train(dog, clock, [0.01] * 51)
    step_deadline = dog.limit()[0]
    assert step_deadline == policy.floor_s  # 10 x 10 ms is below the floor
    with dog.io(30.0):
        clock.advance(step_deadline * 20)  # a save far longer than any step
        assert dog.overdue() is None
        assert dog.limit()[2] == "checkpoint_io"
        dog.beat(step)  # the trainer's beat after its save names the same step
    # The first step after it is its own phase, at the cap until first steps were seen.
    assert dog.limit() == (policy.cap_s, "restarts.stepTimeoutSeconds", FIRST_STEP)
    clock.advance(step_deadline * 5)
    assert dog.overdue() is None
    dog.beat(step + 1)
    assert dog.deadlines.samples == 50  # neither the save nor the step after it is a step sample
    assert dog.limit()[2] == STEP
    with dog.io(30.0):
        clock.advance(31.0)
        found = dog.overdue()
        assert found is not None and found.phase == "checkpoint_io" and found.timeout_s == 30.0
        text = found.describe()
        assert "checkpoint I/O unfinished" in text and "(checkpoint.ioTimeoutSeconds=30.0)" in text


def test_first_steps_get_a_deadline_of_their_own() -> None:
    policy = _policy(cap_s=100.0)
    clock = Clock()
    dog = _watchdog(policy, clock)
    step = _train(dog, clock, [0.01] * 30)
    for _ in range(FIRST_STEP_WARMUP):
        with dog.io(10.0):
            clock.advance(1.0)
        clock.advance(0.2)  # the step after a save is slower than the others
        step += 1
        dog.beat(step)
        clock.advance(0.01)
        step += 1
        dog.beat(step)
    assert dog.deadlines.first_step_s == pytest.approx(10 * 0.2)
    with dog.io(10.0):
        pass
    assert dog.limit()[:1] == (pytest.approx(2.0),) and dog.limit()[2] == FIRST_STEP
    clock.advance(1.9)
    assert dog.overdue() is None
    clock.advance(0.2)
    found = dog.overdue()
    assert found is not None and found.phase == FIRST_STEP


def test_evaluation_and_start_up_keep_fixed_limits() -> None:
    policy = _policy(cap_s=20.0)
    clock = Clock()
    dog = _watchdog(policy, clock)
    with dog.startup(60.0):
        clock.advance(50.0)
        assert dog.overdue() is None
    step = _train(dog, clock, [0.01] * 40)
    with dog.fixed("evaluation"):
        clock.advance(19.0)  # far past the step deadline
        assert dog.overdue() is None
        clock.advance(2.0)
        found = dog.overdue()
        assert found is not None and found.phase == "evaluation" and found.timeout_s == 20.0
    assert step == 40


def test_nested_phases_resume_once() -> None:
    policy = _policy()
    clock = Clock()
    dog = _watchdog(policy, clock)
    step = _train(dog, clock, [0.01] * 31)
    with dog.io(30.0):  # a recovery's limit, with the new group's checkpoint manager inside
        with dog.io(10.0):
            clock.advance(1.0)
        clock.advance(1.0)
        dog.beat(step + 1)  # the recovery's beat, even at a new step: no sample inside a phase
    assert dog.deadlines.samples == 30


def test_a_rank_waiting_in_a_collective_gets_the_in_place_grace() -> None:
    policy = _policy()
    clock = Clock()
    sink = Gauges()
    dog = _watchdog(policy, clock, sink)
    _train(dog, clock, [0.01] * 30)
    dog.waiting, dog.waiting_grace_s = (lambda: True), 60.0
    clock.advance(30.0)
    assert dog.overdue() is None
    clock.advance(31.0)
    assert dog.overdue() is not None
    gauges = dog.deadline_gauges()
    assert gauges["collective"] == gauges[STEP] + 60.0 and gauges[STEP] == policy.floor_s
    # The first step after a phase (here: a recovery's) waits for its peers with the same grace.
    with dog.io(30.0):
        pass
    assert dog.limit()[2] == FIRST_STEP
    clock.advance(policy.cap_s + 30.0)
    assert dog.overdue() is None
    clock.advance(31.0)
    assert dog.overdue() is not None
    dog._publish()
    dog._publish()  # unchanged: not published again
    assert sink.published == [{**gauges, "checkpoint_io": 30.0}]


def test_policy_from_the_spec() -> None:
    restarts = RestartsConfig.model_validate(
        {"stepTimeoutSeconds": 30, "hangMultiplier": 4, "hangFloorSeconds": 0.7, "hangWarmupSteps": 50}
    )
    policy = DeadlinePolicy.from_restarts(restarts)
    assert (policy.auto, policy.cap_s, policy.multiplier, policy.floor_s, policy.warmup_steps) == (True, 30, 4, 0.7, 50)
    assert not DeadlinePolicy.from_restarts(RestartsConfig.model_validate({"hangDetection": "fixed"})).auto
    with pytest.raises(ValueError, match="hangMultiplier"):
        RestartsConfig.model_validate({"hangMultiplier": 1})


def test_the_deadlines_are_exported_as_a_gauge_by_phase() -> None:
    from training.contract import WorkerIdentity
    from training.metrics import names
    from training.metrics.base import FanOut
    from training.metrics.prometheus import PrometheusSink

    identity = WorkerIdentity(job="j", rank=1, local_rank=1, node_rank=0, world_size=2, local_world_size=2, node="h")
    prometheus = PrometheusSink(identity)
    clock = Clock()
    policy = _policy()
    dog = _watchdog(policy, clock, FanOut(prometheus))
    with dog.io(30.0):
        pass
    _train(dog, clock, [0.01] * 31)
    dog._publish()

    def gauge(phase: str) -> float | None:
        labels = {"training_job": "j", "rank": "1", "node": "h", "phase": phase}
        return prometheus.registry.get_sample_value(names.STEP_DEADLINE, labels)

    assert gauge(STEP) == policy.floor_s
    assert gauge(FIRST_STEP) == policy.cap_s  # no first steps seen yet
    assert gauge("checkpoint_io") == 30.0
    assert gauge("collective") is None  # not in place


def test_a_rank_in_a_collective_dumps_before_a_peer_with_a_shorter_deadline_exits() -> None:
    """Each rank derives its own deadline: a rank waiting in a collective dumps at 3/4 of the floor, the
    shortest deadline any peer can have, so its dump is written before the hung peer exits."""
    policy = _policy(floor_s=0.5, cap_s=100.0)
    clock = Clock()
    dog = _watchdog(policy, clock)
    _train(dog, clock, [0.2] * 31)  # slow steps: this rank's deadline is 10 x 0.2 = 2 s
    assert dog.limit()[0] == pytest.approx(2.0)
    busy = [False]
    dog.in_collective = lambda: busy[0]
    clock.advance(0.4)  # past 3/4 of the floor, far from 3/4 of this rank's deadline
    assert not dog.dump_due()
    busy[0] = True
    assert dog.dump_due()
    with dog.io(30.0):  # checkpoint I/O is judged by its own limit, collectives or not
        clock.advance(0.4)
        assert not dog.dump_due()
    fixed = _watchdog(_policy(auto=False, cap_s=2.0), clock)
    fixed.in_collective = lambda: True
    clock.advance(0.4)
    assert not fixed.dump_due()  # one limit for every rank: the group dumps at 3/4 of it together
    clock.advance(1.2)
    assert fixed.dump_due()


def test_the_spec_warns_when_a_hang_setting_has_no_effect() -> None:
    from orchestrator.loader import load_spec
    from tests.fixtures.common import REPO

    def hang_warnings(*extra: str) -> list[str]:
        spec = load_spec(REPO / "examples" / "digits-ddp.yaml", list(extra))
        return [w for w in spec.warnings() if "hang" in w]

    assert hang_warnings() == []
    assert hang_warnings("spec.restarts.stepTimeoutSeconds=1") == [
        "spec.restarts.hangFloorSeconds: 1 is not below stepTimeoutSeconds (1): every step deadline is the fixed "
        "timeout; lower it, or set hangDetection: fixed"
    ]
    fixed = hang_warnings("spec.restarts.hangDetection=fixed", "spec.restarts.hangMultiplier=4")
    assert fixed == ["spec.restarts.hangMultiplier: no effect with spec.restarts.hangDetection fixed (every step has "
                     "stepTimeoutSeconds)"]  # fmt: skip
    assert hang_warnings("spec.restarts.hangDetection=fixed") == []


def test_an_in_place_recovery_is_its_own_phase() -> None:
    policy = _policy(cap_s=10.0)
    clock = Clock()
    sink = Gauges()
    dog = _watchdog(policy, clock, sink)
    step = _train(dog, clock, [0.01] * 31)
    with dog.recovery(60.0):
        assert dog.limit() == (180.0, "3 x restarts.inPlaceTimeoutSeconds", "recovery")
        clock.advance(100.0)  # far past the step deadline and the cap: forming a group is no step
        assert dog.overdue() is None
        dog.beat(step)  # the survivor's beat once the new generation formed
        clock.advance(181.0)
        found = dog.overdue()
        assert found is not None and "in-place recovery unfinished" in found.describe()
    assert dog.limit()[2] == FIRST_STEP  # the step after it: new DDP buckets, a new data iterator
    assert dog.deadlines.samples == 30
    dog._publish()
    assert sink.published[-1]["recovery"] == 180.0
