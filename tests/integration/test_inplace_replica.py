"""FSDP/HSDP in-place recovery's pieces (`training.inplace.replica`) without a job: the choice of the step
to return to from what every member holds, and a snapshot's round trip through a real FSDP2 model on a
one-process gloo group, rebuilt the way a recovery rebuilds it (a process group: here, not in tests/unit).
The whole path (real kills, spares, 4 ranks, bit-exact ends) runs in tests/integration/test_inplace.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from training.faults import Fault, FaultInjector
from training.inplace.group import RecoveryFailed
from training.inplace.replica import DEPTH, ReplicaSet, Snapshot, load_snapshot, plan_recovery, take_snapshot
from training.metrics.base import MetricsSink
from training.state import ModelOptimizerState, TrainerProgress


def _holding(own: list[int], peer: list[int], at: int = 12) -> dict[str, Any]:
    return {"spare": False, "own": own, "peer": peer, "at": at}


SPARE: dict[str, Any] = {"spare": True, "own": [], "peer": [], "at": -1}


def test_the_newest_step_every_survivor_and_the_lost_ranks_neighbour_hold_is_chosen() -> None:
    # Rank 1 died; rank 2 (its right neighbour) holds its snapshots. The exchange of step 10 completed on
    # ranks 0 and 2 but not on rank 3: step 5 is the newest step everyone holds.
    holdings = [_holding([5, 10], [5, 10]), SPARE, _holding([5, 10], [5, 10], at=11), _holding([0, 5], [0, 5])]
    plan = plan_recovery(holdings)
    assert plan.step == 5
    assert plan.sends == {1: 2}
    assert plan.reached == 12


def test_two_neighbours_lost_or_no_common_snapshot_fall_back_to_a_restart() -> None:
    with pytest.raises(RecoveryFailed, match="rank 1's shards were held by rank 2, which was lost too"):
        plan_recovery([_holding([5], [5]), SPARE, SPARE, _holding([5], [5])])
    with pytest.raises(RecoveryFailed, match="no snapshot step is held"):
        plan_recovery([_holding([10], [10]), SPARE, _holding([5], [5])])
    with pytest.raises(RecoveryFailed, match="every rank was replaced"):
        plan_recovery([SPARE, SPARE])
    # Before the first exchange completed nobody holds anything.
    with pytest.raises(RecoveryFailed, match="no snapshot step is held"):
        plan_recovery([_holding([], []), SPARE])


@given(
    world=st.integers(min_value=2, max_value=9),
    data=st.data(),
)
def test_a_plan_only_names_steps_that_whoever_must_provide_them_holds(world: int, data: st.DataObject) -> None:
    steps = st.lists(st.sampled_from([0, 5, 10, 15]), max_size=DEPTH, unique=True)
    holdings = [
        SPARE if data.draw(st.booleans(), label=f"spare{r}") else _holding(data.draw(steps), data.draw(steps))
        for r in range(world)
    ]
    try:
        plan = plan_recovery(holdings)
    except RecoveryFailed:
        return
    for rank, holding in enumerate(holdings):
        if holding["spare"]:
            sender = plan.sends[rank]
            assert sender == (rank + 1) % world and not holdings[sender]["spare"]
            assert plan.step in holdings[sender]["peer"]
        else:
            assert plan.step in holding["own"] and rank not in plan.sends
    # The newest such step: no larger step satisfies every holder.
    assert all(
        not all(s in h["own"] for h in holdings if not h["spare"])
        or any(s not in holdings[plan.sends[r]]["peer"] for r in plan.sends)
        for s in (0, 5, 10, 15)
        if s > plan.step
    )


def test_a_replica_set_keeps_the_two_newest_snapshots_of_each_kind() -> None:
    replicas = ReplicaSet(rank=0, world_size=2, every=5)
    for step in (0, 5, 10, 10):
        replicas._keep(replicas.own, Snapshot(step, b"x"))
    assert [s.step for s in replicas.own] == [5, 10]
    assert replicas.due(10) and not replicas.due(11)


@pytest.fixture
def one_process_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fsdp_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer, {"app": ModelOptimizerState(model, optimizer), "trainer": TrainerProgress()}


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        torch.manual_seed(100 + i)
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.usefixtures("one_process_group")
def test_a_snapshot_loaded_into_a_rebuilt_fsdp_model_continues_bit_identically() -> None:
    model, optimizer, state = _fsdp_state()
    _train(model, optimizer, 3)
    state["trainer"].step, state["trainer"].cursor = 3, 96
    snapshot = take_snapshot(3, state)
    _train(model, optimizer, 2)  # what the group did after the snapshot: undone by the recovery
    reference = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}

    rebuilt, rebuilt_optimizer, rebuilt_state = _fsdp_state()  # a fresh model, as a recovery builds it
    load_snapshot(snapshot, rebuilt_state)
    assert (rebuilt_state["trainer"].step, rebuilt_state["trainer"].cursor) == (3, 96)
    _train(rebuilt, rebuilt_optimizer, 2)  # the same two steps, recomputed
    for key, value in rebuilt.state_dict().items():
        assert torch.equal(value.full_tensor(), reference[key]), key


@pytest.mark.usefixtures("one_process_group")
def test_a_snapshot_of_another_shape_is_refused_not_loaded() -> None:
    _, _, state = _fsdp_state()
    snapshot = take_snapshot(0, state)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    other = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    fully_shard(other, mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("shard",)))
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.01)
    with pytest.raises(RecoveryFailed, match="does not match"):
        load_snapshot(snapshot, {"app": ModelOptimizerState(other, other_optimizer), "trainer": TrainerProgress()})


def test_a_spare_skips_the_faults_its_predecessor_passed_before_the_rollback() -> None:
    # FSDP in place resumes after step 10 while the group had reached step 13, where rank 1's kill fired:
    # the spare recomputes 11..13 without firing it again, and keeps the later one.
    faults = [Fault(kind="kill", rank=1, step=13), Fault(kind="kill", rank=1, step=20)]
    injector = FaultInjector(faults, rank=1, generation=0, events=MetricsSink(), replacement=True)
    injector.predecessor_reached = 13
    injector.after_step(11)
    assert [f.step for f in injector.faults] == [20]


@pytest.mark.usefixtures("one_process_group")
def test_a_snapshot_is_kept_once_its_background_exchange_completed_and_a_failure_reaches_the_loop() -> None:
    model, optimizer, state = _fsdp_state()
    replicas = ReplicaSet(rank=0, world_size=1, every=2)
    # gloo cannot send to itself: one process swaps with itself by hand (2+ ranks exchange for real in
    # tests/integration/test_inplace.py); serialisation, the thread and the bookkeeping are the real ones.
    replicas._exchange = lambda mine: mine  # type: ignore[method-assign]
    replicas.take(0, state)
    _train(model, optimizer, 1)  # training goes on while the exchange runs: the snapshot is a private copy
    replicas.wait()
    assert replicas.holdings(at=1) == {"spare": False, "own": [0], "peer": [0], "at": 1}
    assert replicas.blocked_s <= replicas.last_s

    def broken(mine: Snapshot) -> Snapshot:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1")

    replicas._exchange = broken  # type: ignore[method-assign]
    replicas.take(2, state)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        replicas.take(4, state)  # the next snapshot first joins the failed one: the loop recovers
    assert [s.step for s in replicas.own] == [0], "a failed exchange keeps nothing"


def test_an_abandoned_generation_commits_nothing_late() -> None:
    replicas = ReplicaSet(rank=0, world_size=2, every=1)
    epoch = replicas._epoch
    replicas.abandon(0.1)
    replicas._exchange = lambda mine: mine  # type: ignore[method-assign]
    replicas._complete(3, {"app": {}, "trainer": {}}, 0.0, epoch)  # an exchange of the broken generation
    assert replicas.own == [] and replicas.peer == []
