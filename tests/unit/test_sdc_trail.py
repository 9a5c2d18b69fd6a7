"""The gradient trail (training.sdc_replay.GradientTrail, decide_departures): two replicas whose states cannot
tell them apart any more (a corrupted parameter was averaged into the peer) are told apart by whose own
pre-reduce gradient departed from a clean replay first. No process group: buckets and exchanges are fakes;
the same on a real two-rank DDP job: tests/integration/test_sdc_drill.py (tinygpt at 2 ranks)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from tests.unit.test_sdc_recompute import Bucket, Recorder
from training.contract import WorkerIdentity
from training.sdc import Decision, SdcMonitor, SilentDataCorruption
from training.sdc_replay import NO_DEPARTURE, UNKNOWN, GradientTrail, chained, decide_departures

UNDECIDED = Decision(False, (0, 1), False, how="replay", note="the replay reproduced no rank")


# -- decide_departures ------------------------------------------------------------------------------------
@given(culprit=st.integers(0, 1), first=st.integers(1, 500), lag=st.integers(1, 50))
def test_the_rank_whose_gradient_departed_first_is_the_suspect(culprit: int, first: int, lag: int) -> None:
    departures = [first + lag, first + lag]
    departures[culprit] = first
    decision = decide_departures(departures, [[0, 1]], UNDECIDED)
    assert decision.decided and decision.suspects == (culprit,) and decision.how == "replay"


@given(culprit=st.integers(0, 1), first=st.integers(1, 500))
def test_a_peer_that_never_departed_leaves_the_one_that_did(culprit: int, first: int) -> None:
    departures = [NO_DEPARTURE, NO_DEPARTURE]
    departures[culprit] = first
    assert decide_departures(departures, [[0, 1]], UNDECIDED).suspects == (culprit,)


@pytest.mark.parametrize(
    ("departures", "why"),
    [
        ([7, 7], "every rank's gradients departed at step 7"),
        ([NO_DEPARTURE, NO_DEPARTURE], "no rank's gradients departed"),
        ([UNKNOWN, 7], "had no gradient record"),
    ],
)
def test_what_the_trail_cannot_tell_stays_undecided(departures: list[int], why: str) -> None:
    decision = decide_departures(departures, [[0, 1]], UNDECIDED)
    assert not decision.decided and decision.suspects == (0, 1) and why in decision.note


def test_replica_groups_decide_each_on_their_own() -> None:
    # HSDP-like groups {0, 2} and {1, 3}: rank 2 departed first in its group, group {1, 3} agreed throughout
    undecided = Decision(False, (0, 2), False, how="replay", note="the replay reproduced no rank")
    decision = decide_departures([9, NO_DEPARTURE, 8, NO_DEPARTURE], [[0, 2], [1, 3]], undecided)
    assert decision.decided and decision.suspects == (2,)


# -- GradientTrail ----------------------------------------------------------------------------------------
def run_step(trail: GradientTrail, step: int, params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
    trail.begin(step)
    trail.capture(Bucket(params[::-1], grads[::-1]))  # DDP hands buckets in reverse order
    trail.end()


def test_the_trail_finds_the_first_step_whose_gradient_departs() -> None:
    params = [nn.Parameter(torch.zeros(64)) for _ in range(2)]
    trail = GradientTrail(params, torch.device("cpu"))
    grads = {s: [torch.randn(64), torch.randn(64)] for s in range(1, 6)}
    for s in range(1, 6):
        run_step(trail, s, params, grads[s])
    struck = {s: [g.clone() for g in grads[s]] for s in grads}
    struck[3][1][16] += 1.0  # an element the sample reads (every TRAIL_STRIDE-th)
    struck[4][0].mul_(1.0001)
    trail.replaying = True
    for s in range(1, 6):
        run_step(trail, s, params, struck[s])
    trail.replaying = False
    assert trail.departure(1, 5) == 3
    assert trail.departure(1, 2) == NO_DEPARTURE
    assert trail.departure(1, 6) == UNKNOWN  # step 6 was never recorded


def test_an_agreed_check_forgets_the_steps_up_to_it_and_no_bucket_files_nothing() -> None:
    params = [nn.Parameter(torch.zeros(5))]  # fewer elements than the stride: a sample of one
    trail = GradientTrail(params, torch.device("cpu"))
    for s in range(1, 4):
        run_step(trail, s, params, [torch.randn(5)])
    trail.forget_through(2)
    assert sorted(trail.recorded) == [3]
    trail.begin(4)  # HSDP: no DDP bucket is ever handed over
    trail.end()
    assert 4 not in trail.recorded


def test_chained_calls_both_captures_in_order() -> None:
    seen: list[str] = []
    both = chained(lambda b: seen.append(f"first {b}"), lambda b: seen.append(f"second {b}"))
    both("x")
    assert seen == ["first x", "second x"]
    alone = chained(None, lambda b: seen.append("only"))
    alone("y")
    assert seen[-1] == "only"


# -- the monitor: the trail decides where the states could not ----------------------------------------------
class TrailReplay:
    """A replay point whose replay reproduced no rank, and whose trail departed at `departed`."""

    def __init__(self, departed: int) -> None:
        self.kept_step: int | None = None
        self.departed = departed

    def keep(self, step: int) -> None:
        self.kept_step = step

    def kept_fingerprint(self) -> int:
        return 3

    def run(self, step: int) -> int | None:
        return 99  # the clean replay: neither rank's original


def test_the_monitor_asks_the_trail_when_no_state_was_reproduced() -> None:
    sink = Recorder()
    # step 5 agrees; step 10: 11 vs 12; the kept copies agree; both replays give 99 (no rank reproduced);
    # departures (sent as step + 1): rank 0 departed at 8, rank 1 at 7
    answers = iter([[11, 11], [11, 12], [3, 3], [99, 99], [9, 8]])
    mon = SdcMonitor(
        WorkerIdentity(job="j", rank=0, world_size=2, node="host-0"),
        sink,
        every=5,
        state=lambda: 0,
        exchange=lambda _mine: next(answers),
        hosts=lambda h: [h, "host-1"],
        replay=TrailReplay(departed=8),
    )
    mon.after_step(5)
    with pytest.raises(SilentDataCorruption, match="replay: rank\\(s\\) 1") as raised:
        mon.after_step(10)
    assert raised.value.suspects == (1,) and raised.value.decided
    assert sink.events[0][1]["suspect_hosts"] == ["host-1"]
