"""The socket ledger of in-place recovery: cutting a broken generation's connections wakes every peer."""

from __future__ import annotations

import os
import signal
import socket
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.inplace import sockets
from training.inplace.sockets import SocketLedger


def test_cut_shuts_the_recorded_connections_and_spares_listeners_and_older_sockets() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    older = socket.create_connection(server.getsockname())  # before the recording: never cut
    older_peer, _ = server.accept()
    ledger = SocketLedger()
    with ledger.recording():
        client = socket.create_connection(server.getsockname())
        listener = socket.create_server(("127.0.0.1", 0))  # gloo's accept thread aborts on a shut listener
    peer, _ = server.accept()
    assert len(ledger) == 2
    try:
        assert ledger.cut() == 1
        peer.settimeout(5)
        assert peer.recv(1) == b"", "the peer reads EOF at once"
        assert client.fileno() >= 0, "the descriptor stays open: its owner closes it"
        with socket.create_connection(listener.getsockname()) as probe:
            conn, _ = listener.accept()
            conn.close()
            assert probe is not None
        older.sendall(b"x")
        assert older_peer.recv(1) == b"x"
        assert len(ledger) == 0 and ledger.cut() == 0, "a cut forgets what it cut"
    finally:
        for s in (server, older, older_peer, client, listener, peer):
            s.close()


def test_a_descriptor_reused_by_another_socket_is_not_cut() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    ledger = SocketLedger()
    with ledger.recording():
        gone = socket.create_connection(server.getsockname())
    first, _ = server.accept()
    number = gone.fileno()
    gone.close()
    first.close()
    reused = socket.create_connection(server.getsockname())  # most likely the same descriptor number
    peer, _ = server.accept()
    try:
        assert ledger.cut() == 0
        reused.sendall(b"y")
        assert peer.recv(1) == b"y", f"descriptor {number} now names another socket: untouched"
    finally:
        for s in (server, reused, peer):
            s.close()


def test_module_recording_fills_only_the_active_ledger() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    ledger = SocketLedger()
    opened = []
    try:
        sockets.active(None)
        with sockets.recording():
            opened.append(socket.create_connection(server.getsockname()))
        sockets.active(ledger)
        with sockets.recording():
            opened.append(socket.create_connection(server.getsockname()))
        assert len(ledger) == 1
    finally:
        sockets.active(None)
        server.close()
        for s in opened:
            s.close()


COLLECTIVE_TIMEOUT_S = 60.0


def _rank(rank: int, world: int, port: int, victim: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))  # type: ignore[attr-defined]
    ledger = SocketLedger()
    with ledger.recording():
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("pg/", store),  # type: ignore[attr-defined]
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
    tensor = torch.ones(1 << 16)
    try:
        for i in range(100_000):
            if rank == victim and i == 20:
                store.set("killed", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(tensor)
    except RuntimeError:
        ledger.cut()  # what a survivor does first on the way to the next generation
        store.set(f"failed/{rank}", repr(time.time() - float(store.get("killed"))))
    store.wait(["done"])  # stay alive, connections open, like a survivor waiting for generation g+1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_survivor_of_four_learns_of_a_death_long_before_the_collective_timeout() -> None:
    """Without the cut a survivor blocked on a LIVE peer waits the whole collective timeout (measured: 20 s
    with a 20 s timeout at 4 ranks); with it every survivor fails within the same second."""
    world, victim = 4, 2
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))  # type: ignore[attr-defined]
    ctx = mp.get_context("spawn")
    procs: list[Any] = [ctx.Process(target=_rank, args=(r, world, server.port, victim)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        survivors = [r for r in range(world) if r != victim]
        server.wait([f"failed/{r}" for r in survivors], timedelta(seconds=COLLECTIVE_TIMEOUT_S / 2))
        seconds = {r: float(server.get(f"failed/{r}")) for r in survivors}
        assert max(seconds.values()) < COLLECTIVE_TIMEOUT_S / 4, seconds
    finally:
        server.set("done", "1")
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
