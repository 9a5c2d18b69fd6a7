"""The checkpoint manager's groups are built at their first collective, by the training thread only,
and recorded for in-place recovery's cut (real 2-process gloo groups)."""

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
        built_at_construction = coll.built or len(ledger) > 0

        # Another thread may not be the one that creates them (it would race the training thread's
        # order of `new_group` calls).
        errors: list[str] = []

        def touch() -> None:
            try:
                _ = coll.group
            except RuntimeError as exc:
                errors.append(str(exc))

        t = threading.Thread(target=touch)
        t.start()
        t.join()

        anyone = coll.any_control(rank == 1)  # the first collective builds both groups
        recorded = len(ledger)
        # Built now: a background thread (the save's) uses them.
        gathered: list[Any] = []
        t = threading.Thread(target=lambda: gathered.append(coll.all_gather_obj(rank * 10, world)))
        t.start()
        t.join()
        results.put((rank, built_at_construction, errors, anyone, coll.built, recorded, gathered[0]))
    finally:
        sockets.active(None)
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_groups_are_built_at_the_first_collective_by_the_training_thread_and_recorded() -> None:
    world = 2
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, server.port, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=90) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, built_at_construction, errors, anyone, built, recorded, gathered in got:
        assert not built_at_construction, f"rank {rank}: groups built before they were needed"
        assert errors and "training thread" in errors[0], f"rank {rank}: {errors}"
        assert anyone is True and built
        assert recorded > 0, f"rank {rank}: the groups' connections were not recorded for the recovery's cut"
        assert gathered == [0, 10]


def test_one_process_needs_no_group() -> None:
    coll = Collectives()
    assert not coll.distributed and coll.group is None and coll.control is None and not coll.built
    assert coll.any_control(True) and not coll.broadcast_control(False) and coll.all_gather_obj(3, 1) == [3]
