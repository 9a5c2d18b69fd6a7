"""The resumable sampler's arithmetic: exact continuation, and no repeats or gaps across resizes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from training.data import BatchIndices, GlobalOrder, StepPlan, micro_batches, to_device


def _step(order: GlobalOrder, plan: StepPlan, cursor: int) -> list[list[int]]:
    """Every rank's micro-batches of the step starting at `cursor` (rank-major)."""
    out = []
    for rank in range(plan.world_size):
        it = micro_batches(order, plan, rank, cursor)
        out.append([i for _ in range(plan.grad_accumulation) for i in next(it)])
    return out


def test_permutation_is_a_pure_function_of_seed_and_epoch() -> None:
    a, b = GlobalOrder(100, seed=3), GlobalOrder(100, seed=3)
    assert list(a.permutation(0)) == list(b.permutation(0))
    assert list(a.permutation(1)) != list(a.permutation(0))
    assert list(GlobalOrder(100, seed=4).permutation(0)) != list(a.permutation(0))
    assert sorted(a.permutation(5)) == list(range(100))


def test_indices_cross_epoch_boundaries_in_order() -> None:
    order = GlobalOrder(10, seed=0)
    assert order.indices(8, 4) == [*order.permutation(0)[8:], *order.permutation(1)[:2]]


def test_empty_dataset_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        GlobalOrder(0, seed=0)


@settings(max_examples=200, deadline=None)
@given(
    num_samples=st.integers(1, 300),
    seed=st.integers(0, 2**32),
    phases=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(1, 3), st.integers(1, 5)), min_size=1, max_size=4
    ),
)
def test_world_size_changes_never_repeat_or_skip(
    num_samples: int, seed: int, phases: list[tuple[int, int, int, int]]
) -> None:
    """Phases of (world size, batch, accumulation, steps), each resumed from the cursor alone: together
    they read exactly the global stream, so every epoch is each sample once before any sample twice."""
    order = GlobalOrder(num_samples, seed)
    cursor = 0
    consumed: list[int] = []
    for world, batch, accum, steps in phases:
        plan = StepPlan(world, batch, accum)
        for _ in range(steps):
            per_rank = _step(order, plan, cursor)
            # micro-step m of every rank, then m + 1: the global order of consumption
            for m in range(accum):
                for rank in range(world):
                    consumed.extend(per_rank[rank][m * batch : (m + 1) * batch])
            cursor += plan.global_batch
    assert consumed == GlobalOrder(num_samples, seed).indices(0, cursor)
    full_epochs, rest = divmod(len(consumed), num_samples)
    for e in range(full_epochs):
        assert sorted(consumed[e * num_samples : (e + 1) * num_samples]) == list(range(num_samples))
    tail = Counter(consumed[full_epochs * num_samples :])
    assert len(tail) == rest and all(c == 1 for c in tail.values())


@settings(max_examples=100, deadline=None)
@given(
    num_samples=st.integers(1, 200),
    world=st.integers(1, 4),
    batch=st.integers(1, 8),
    accum=st.integers(1, 3),
    before=st.integers(0, 20),
    after=st.integers(1, 10),
)
def test_resume_at_same_world_size_continues_exactly(
    num_samples: int, world: int, batch: int, accum: int, before: int, after: int
) -> None:
    order = GlobalOrder(num_samples, seed=7)
    plan = StepPlan(world, batch, accum)
    for rank in range(world):
        uninterrupted = micro_batches(order, plan, rank, 0)
        for _ in range(before * accum):
            next(uninterrupted)
        resumed = micro_batches(GlobalOrder(num_samples, seed=7), plan, rank, before * plan.global_batch)
        for _ in range(after * accum):
            assert next(resumed) == next(uninterrupted)


@settings(max_examples=100, deadline=None)
@given(world=st.integers(1, 4), batch=st.integers(1, 8), accum=st.integers(1, 3), cursor=st.integers(0, 500))
def test_micro_step_reads_the_same_samples_as_one_big_batch(world: int, batch: int, accum: int, cursor: int) -> None:
    """Micro-step m at world size W, batch B holds the samples of micro-step m of one process with batch W*B."""
    order = GlobalOrder(97, seed=1)
    single = micro_batches(order, StepPlan(1, world * batch, accum), 0, cursor)
    streams = [micro_batches(order, StepPlan(world, batch, accum), r, cursor) for r in range(world)]
    for _ in range(accum):
        assert next(single) == [i for s in streams for i in next(s)]


def test_rank_outside_world_is_rejected() -> None:
    with pytest.raises(ValueError, match="outside"):
        next(micro_batches(GlobalOrder(10, 0), StepPlan(2, 1), 2, 0))


def test_batch_indices_restart_the_stream_at_its_cursor_on_every_iteration() -> None:
    order, plan = GlobalOrder(50, seed=1), StepPlan(world_size=2, batch_size=3)
    sampler = BatchIndices(order, plan, rank=1, cursor=12)
    first, again = iter(sampler), iter(sampler)
    assert next(first) == next(again) == next(micro_batches(order, plan, 1, 12))


def test_to_device_moves_nested_tensors_and_keeps_the_rest() -> None:
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), "label"), "ids": [torch.arange(3)], "n": 4}
    moved = to_device(batch, torch.device("meta"))
    assert moved["x"].device.type == "meta" and moved["ids"][0].device.type == "meta"
    assert isinstance(moved["pair"], tuple) and moved["pair"][0].device.type == "meta" and moved["pair"][1] == "label"
    assert moved["n"] == 4
