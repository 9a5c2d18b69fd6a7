"""The checkpoint manager's groups exist from construction on, their connections recorded for in-place
recovery's cut, and a background thread (the save's) uses them (real 2-process gloo groups)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from training.checkpoint.collectives import Collectives
from training.inplace import sockets
from training.inplace.sockets import SocketLedger


def _rank(rank: int, world: int, port: int, results: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank, world_size=world)  # type: ignore[attr-defined]
    ledger = SocketLedger()
    sockets.active(ledger)
    try:
        coll = Collectives(timeout_s=30)
        # Built now, not at the first save: a rank lost at that save must fail the others' collective
        # at once (a closed connection), not leave them in new_group's wait for its address.
        recorded = len(ledger)
        anyone = coll.any_control(rank == 1)
        gathered: list[Any] = []
        t = threading.Thread(target=lambda: gathered.append(coll.all_gather_obj(rank * 10, world)))
        t.start()
        t.join()
        results.put((rank, recorded, anyone, coll.broadcast_control(rank == 0), gathered[0]))
    finally:
        sockets.active(None)
        dist.destroy_process_group()


def _two_ranks(target: Any) -> list[Any]:
    """Run `target(rank, world, port, results)` in two spawned processes on one store; their results, sorted."""
    world = 2
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, server.port, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted(results.get(timeout=90) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.mark.timeout(120)
def test_groups_exist_from_construction_and_are_recorded_for_the_recovery_cut() -> None:
    got = _two_ranks(_rank)
    for rank, recorded, anyone, from_rank_0, gathered in got:
        assert recorded > 0, f"rank {rank}: the groups' connections were not recorded for the recovery's cut"
        assert anyone is True and from_rank_0 is True
        assert gathered == [0, 10]


def test_one_process_needs_no_group() -> None:
    coll = Collectives()
    assert not coll.distributed and coll.group is None and coll.control is None
    assert coll.any_control(True) and not coll.broadcast_control(False) and coll.all_gather_obj(3, 1) == [3]


def _agreement_rank(rank: int, world: int, port: int, results: Any) -> None:
    from training.preemption import Agreement

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank, world_size=world)  # type: ignore[attr-defined]
    try:
        coll = Collectives(timeout_s=30)
        groups = len(dist.distributed_c10d._world.pg_map)
        agreement = Agreement(coll.control)
        answers, decisions = [], []
        for boundary in range(4):
            # Rank 1 is signalled at boundary 2; the exchange started there is read at boundary 3. Between
            # two polls the checkpoint manager's control decisions run on the same group, in flight with it.
            answers.append(agreement.poll(rank == 1 and boundary >= 2))
            decisions.append((coll.any_control(rank == 0 and boundary == 1), coll.broadcast_control(boundary % 2 == 0)))
        agreement.close()
        results.put((rank, len(dist.distributed_c10d._world.pg_map) - groups, answers, decisions))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_the_preemption_agreement_rides_on_the_control_group_in_step_with_its_decisions() -> None:
    """One group fewer per generation (an in-place recovery builds every group anew): the agreement's
    in-flight exchange and the control decisions interleave on one group and agree on every rank."""
    got = _two_ranks(_agreement_rank)
    for rank, new_groups, answers, decisions in got:
        assert new_groups == 0, f"rank {rank}: the agreement built a group of its own"
        assert answers == [False, False, False, True], (rank, answers)  # the same stop step on both ranks
        assert decisions == [(False, True), (True, False), (False, True), (False, False)]
