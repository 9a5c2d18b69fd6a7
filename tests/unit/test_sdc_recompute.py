"""Redundant compute spot checks (training.sdc_recompute) and deterministic replay (training.sdc.decide_replay,
training.sdc_replay): the pure decisions, the gradient capture, the recomputation against the trainer's own
data path, and the monitor's replay with fakes. No process group: the exchanges are fakes. The same on real
DDP groups: tests/integration/test_sdc_drill.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader

from training.config import DEFAULT_SDC_RECOMPUTE_EVERY, Precision, SdcConfig, Strategy, TrainingConfig
from training.contract import EventKind, WorkerIdentity
from training.data import BatchIndices, GlobalOrder, StepPlan
from training.determinism import seed_step_rng, step_seed
from training.metrics.base import MetricsSink
from training.sdc import SdcMonitor, SilentDataCorruption, decide_replay, fingerprint_tensors
from training.sdc_recompute import GradientCapture, RecomputeCheck, decide_recompute
from training.sdc_replay import ReplayPoint
from training.state import TrainerProgress
from training.strategies import Parallel
from training.task import load_task


class Recorder(MetricsSink):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def on_event(self, event: Any, **fields: Any) -> None:
        self.events.append((str(event), fields))


# -- decide_recompute -------------------------------------------------------------------------------------
def corrupt(value: int) -> int:
    return value ^ (1 << 20)


@st.composite
def one_faulty_rank(draw: st.DrawFn, min_world: int = 2) -> tuple[list[int], list[int], int, bool, bool]:
    """Fingerprints of `world` ranks where rank f's own gradient and/or its recomputation went wrong."""
    world = draw(st.integers(min_world, 9))
    truth = draw(st.lists(st.integers(0, 2**64 - 1), min_size=world, max_size=world, unique=True))
    f = draw(st.integers(0, world - 1))
    own_bad, rec_bad = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
    own = list(truth)
    recomputed = [truth[(r + 1) % world] for r in range(world)]
    if own_bad:
        own[f] = corrupt(own[f])
    if rec_bad:
        recomputed[f] = corrupt(recomputed[f])
    return own, recomputed, f, own_bad, rec_bad


@given(one_faulty_rank())
def test_a_wrong_own_gradient_names_its_rank(case: tuple[list[int], list[int], int, bool, bool]) -> None:
    own, recomputed, f, own_bad, rec_bad = case
    decision = decide_recompute(own, recomputed)
    assert not decision.agreed and decision.how == "recompute"
    # the pre-reduce flip (its neighbour's recomputation is the witness), or a rank wrong both times at 3+
    if (own_bad and not rec_bad) or (own_bad and rec_bad and len(own) >= 3):
        assert decision.suspects == (f,) and decision.decided
    elif own_bad and rec_bad:  # two ranks that disagree both ways: nothing tells them apart
        assert decision.suspects == (0, 1) and not decision.decided
    else:  # only the recomputation went wrong: the documented limit names the rank it recomputed
        assert decision.suspects == ((f + 1) % len(own),) and decision.decided


@given(st.lists(st.integers(0, 3), min_size=2, max_size=8), st.lists(st.integers(0, 3), min_size=8, max_size=8))
def test_a_rank_vouched_for_both_ways_is_never_a_suspect(own: list[int], pool: list[int]) -> None:
    world = len(own)
    recomputed = pool[:world]
    decision = decide_recompute(own, recomputed)
    holds = [recomputed[r] == own[(r + 1) % world] for r in range(world)]
    for r in range(world):
        if holds[(r - 1) % world] and holds[r]:
            assert r not in decision.suspects
    assert decision.agreed == all(holds)


def test_agreement_and_bad_input() -> None:
    assert decide_recompute([1, 2, 3], [2, 3, 1]).agreed
    with pytest.raises(ValueError, match="recomputed"):
        decide_recompute([1, 2], [2])


# -- decide_replay ----------------------------------------------------------------------------------------
@given(
    st.integers(2, 6),
    st.integers(0, 2**64 - 1),
    st.data(),
)
def test_a_replay_names_the_ranks_that_do_not_reproduce_themselves(world: int, truth: int, data: Any) -> None:
    struck = data.draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world - 1))
    original = [corrupt(truth) if r in struck else truth for r in range(world)]
    decision = decide_replay(original, [truth] * world)
    assert decision.suspects == tuple(sorted(struck)) and decision.decided and decision.how == "replay"


def test_two_replays_that_differ_stay_undecided_and_groups_decide_alone() -> None:
    undecided = decide_replay([1, 2], [1, 2])  # each reproduces itself: a deterministic disagreement
    assert undecided.suspects == (0, 1) and not undecided.decided and "replays differ" in undecided.describe()
    nobody = decide_replay([1, 2], [3, 3])  # no rank reproduced itself: the kept state proves nothing
    assert nobody.suspects == (0, 1) and not nobody.decided and "reproduced no rank" in nobody.describe()
    # HSDP, 2 shards x 2 replicas: ranks 1 and 3 hold the same shard; rank 3 does not reproduce itself
    hsdp = decide_replay([5, 6, 5, 7], [5, 6, 5, 6], [[0, 2], [1, 3]])
    assert hsdp.suspects == (3,) and hsdp.decided
    assert decide_replay([5, 5], [5, 5]).agreed


# -- the monitor's replay, with fakes ---------------------------------------------------------------------
class FakeReplay:
    def __init__(self, kept: int, replayed: int) -> None:
        self.kept_step: int | None = None
        self.kept, self.replayed = kept, replayed
        self.ran: list[int] = []

    def keep(self, step: int) -> None:
        self.kept_step = step

    def kept_fingerprint(self) -> int:
        return self.kept

    def run(self, step: int) -> int | None:
        self.ran.append(step)
        return self.replayed


def two_replicas(rounds: list[list[int]], replay: FakeReplay | None, sink: MetricsSink) -> SdcMonitor:
    """Rank 0 of 2; each exchange answers the next of `rounds` (every rank's fingerprints)."""
    answers = iter(rounds)
    return SdcMonitor(
        WorkerIdentity(job="j", rank=0, world_size=2, node="host-0"),
        sink,
        every=5,
        state=lambda: 0,
        exchange=lambda _mine: next(answers),
        hosts=lambda h: [h, "host-1"],
        replay=replay,
    )


def test_two_replicas_are_decided_by_replaying_from_the_agreed_state() -> None:
    sink, replay = Recorder(), FakeReplay(kept=3, replayed=11)
    # step 5 agrees (kept); step 10 differs; the kept copies agree; the replays say rank 1 did not reproduce
    mon = two_replicas([[11, 11], [11, 12], [3, 3], [11, 11]], replay, sink)
    mon.after_step(5)
    assert replay.kept_step == 5
    with pytest.raises(SilentDataCorruption, match="replay: rank\\(s\\) 1") as raised:
        mon.after_step(10)
    assert raised.value.suspects == (1,) and raised.value.decided
    assert replay.ran == [10]
    (kind, fields), *_ = sink.events
    assert kind == str(EventKind.SDC) and fields["decided"] and fields["suspects"] == [1]
    assert fields["evidence"] == "replica" and fields["suspect_hosts"] == ["host-1"]


@pytest.mark.parametrize(
    ("rounds", "note"),
    [
        ([[11, 12]], "no agreed state kept"),  # the first window: nothing kept yet
        ([[11, 11], [11, 12], [3, 4]], "no longer agrees"),  # a flip struck the kept copy
        ([[11, 11], [11, 12], [3, 3], [11, 2**64 - 1]], "could not run"),  # a rank could not replay
    ],
)
def test_a_replay_that_cannot_decide_says_why(rounds: list[list[int]], note: str) -> None:
    sink = Recorder()
    mon = two_replicas(rounds, FakeReplay(kept=3, replayed=11), sink)
    if len(rounds) > 1:
        mon.after_step(5)
    with pytest.raises(SilentDataCorruption, match=note):
        mon.after_step(10)
    assert not sink.events[0][1]["decided"] and sink.events[0][1]["suspects"] == [0, 1]


def test_a_replay_is_only_from_a_state_kept_at_or_before_the_disagreement() -> None:
    sink, replay = Recorder(), FakeReplay(kept=3, replayed=11)
    mon = two_replicas([[11, 11], [11, 12], [3, 3], [11, 11]], replay, sink)
    mon.after_step(10)  # kept at 10
    with pytest.raises(SilentDataCorruption, match="no agreed state kept"):
        mon.check(8)  # a state kept after the step asked about (an in-place rollback since) is no replay point
    assert replay.ran == []
    mon = two_replicas([[11, 12], [3, 3], [11, 11]], replay, Recorder())
    with pytest.raises(SilentDataCorruption, match="replay: rank\\(s\\) 1"):
        mon.check(10)  # kept at this very step: the replay re-runs nothing and compares with the kept copy
    assert replay.ran == [10]


def test_a_replay_point_restores_the_kept_state_and_reruns_from_it() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    progress = TrainerProgress()

    def tensors() -> list[torch.Tensor]:
        from training.sdc import state_tensors

        return state_tensors(model, optimizer)

    def train_to(last: int) -> None:
        while progress.step < last:
            progress.step += 1
            progress.cursor += 4
            model(torch.full((1, 3), float(progress.step))).sum().backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad()

    point = ReplayPoint(tensors, progress, train_to, torch.device("cpu"))
    train_to(2)
    point.keep(2)
    kept = fingerprint_tensors(tensors())
    assert point.kept_fingerprint() == kept
    train_to(5)
    clean = fingerprint_tensors(tensors())
    with torch.no_grad():
        model.weight[0, 0] += 1.0  # struck after step 5
    assert point.run(5) == clean and progress.step == 5 and progress.cursor == 20
    point.keep(5)  # the buffers are reused in place
    assert point.kept_fingerprint() == clean


# -- the gradient capture and the recomputation -----------------------------------------------------------
class Bucket:
    def __init__(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
        self._params, self._grads = params, grads

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._grads


def test_the_capture_fingerprints_buckets_in_parameter_order_whatever_their_order() -> None:
    params = [nn.Parameter(torch.zeros(3)) for _ in range(3)]
    grads = [torch.randn(3) for _ in range(3)]
    capture = GradientCapture(params, torch.device("cpu"))
    capture(Bucket([params[2]], [grads[2]]))  # DDP's buckets come in reverse order
    capture(Bucket([params[0], params[1]], [grads[0], grads[1]]))
    assert capture.fingerprint() == fingerprint_tensors(grads)
    partial = GradientCapture(params, torch.device("cpu"))
    partial(Bucket([params[0], params[2]], [grads[0], grads[2]]))  # a parameter no bucket carried: zeros
    assert partial.fingerprint() == fingerprint_tensors([grads[0], torch.zeros(3), grads[2]])


def digits_check(accumulation: int, world: int = 3, rank: int = 0) -> tuple[RecomputeCheck, TrainingConfig]:
    task = load_task("training.examples.digits:task", {"hidden": 16, "dropout": 0.25})
    torch.manual_seed(0)
    model = task.build_model()
    cfg = TrainingConfig.model_validate({"steps": 10, "batchSize": 4, "gradAccumulation": accumulation, "seed": 3})
    par = Parallel(
        model=model, module=model, strategy=Strategy.ddp, device=torch.device("cpu"), precision=Precision.fp32
    )
    identity = WorkerIdentity(job="j", rank=rank, world_size=world, node="host-0")
    check = RecomputeCheck(
        identity, Recorder(), every=1, par=par, task=task, cfg=cfg, exchange=lambda a, b: [], hosts=lambda h: [h]
    )
    return check, cfg


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_recomputation_is_bit_identical_to_the_ranks_own_backward(accumulation: int) -> None:
    """Rank 1's gradient of step 4 as the trainer computes it (its DataLoader, its seed, loss.backward
    accumulating over micro-batches) against rank 0's recomputation of it: the same fingerprint."""
    check, cfg = digits_check(accumulation)
    task, module = check.task, check.par.module
    plan = StepPlan(3, cfg.batch_size, accumulation)
    cursor, step, rank = 7 * plan.global_batch, 4, 1
    order = GlobalOrder(len(task.train_dataset()), cfg.seed)  # type: ignore[arg-type]
    loader = DataLoader(
        task.train_dataset(), batch_sampler=BatchIndices(order, plan, rank, cursor), collate_fn=task.collate
    )
    batches = iter(loader)
    seed_step_rng(step_seed(cfg.seed, step, rank), torch.device("cpu"))
    for _ in range(accumulation):
        (task.loss(module, next(batches)) / accumulation).backward()  # type: ignore[no-untyped-call]
    own = fingerprint_tensors([p.grad for p in module.parameters()])  # type: ignore[misc]
    grads_before = [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]
    assert check.recompute(step, cursor, rank) == own
    assert all(torch.equal(p.grad, g) for p, g in zip(module.parameters(), grads_before, strict=True))  # untouched
    assert check.recompute(step, cursor, 2) != own  # another rank's batch
    assert check.recompute(step + 1, cursor, rank) != own  # another step's seed (dropout)


def test_buffers_are_put_back_after_a_recomputation() -> None:
    check, _ = digits_check(1)
    bn = nn.BatchNorm1d(10)
    check.par.module.add_module("bn", bn)  # the digits model is a Sequential: its logits go through it
    before = [b.clone() for b in bn.buffers()]
    check.recompute(1, 0, 1)
    assert all(torch.equal(a, b) for a, b in zip(bn.buffers(), before, strict=True))


def test_a_mismatch_raises_with_recompute_evidence_and_undecided_asks_the_replica_check() -> None:
    check, _ = digits_check(1, world=2)
    sink, asked = Recorder(), []
    check.sink = sink
    check.hosts = lambda h: [h, "host-1"]
    check.recompute = lambda step, cursor, rank: 0  # type: ignore[method-assign]
    check.undecided = asked.append
    answers: Iterator[list[tuple[int, int]]] = iter([[(1, 2), (2, 1)], [(1, 9), (2, 1)], [(1, 9), (2, 8)]])
    check.exchange = lambda own, rec: next(answers)
    for step in (1, 2, 3):
        check.before_step(step)
        assert check.par.comm.before_reduce is not None
        if step == 1:
            assert check.after_backward(step, 0) is not None and check.par.comm.before_reduce is None
            continue
        with pytest.raises(SilentDataCorruption) as raised:
            check.after_backward(step, 0)
        assert raised.value.suspects == ((1,) if step == 2 else (0, 1))
    assert asked == [2]  # only the undecided verdict (step 3) asked the replica check, about step 2
    kinds = [(f["evidence"], f["decided"], f["fingerprints"], f["recomputed"]) for _, f in sink.events]
    assert kinds[0] == ("recompute", True, [f"{1:016x}", f"{2:016x}"], [f"{9:016x}", f"{1:016x}"])
    assert kinds[1][:2] == ("recompute", False)


def test_not_due_steps_capture_nothing() -> None:
    check, _ = digits_check(1)
    check.every = 4
    check.before_step(3)
    assert check.par.comm.before_reduce is None and check.after_backward(3, 0) is None


def test_recompute_every_defaults_and_bounds() -> None:
    assert SdcConfig().recompute_every == DEFAULT_SDC_RECOMPUTE_EVERY
    assert SdcConfig.model_validate({"recomputeEvery": 0}).recompute_every == 0
    with pytest.raises(ValueError, match="recomputeEvery"):
        SdcConfig.model_validate({"recomputeEvery": -1})
