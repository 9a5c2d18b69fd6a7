"""The unit suite's guard (tests/unit/conftest.py): a unit test that starts a process or opens a socket
fails, wherever the attempt is made from; an in-process socket pair stays allowed."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
from collections.abc import Callable, Iterator

import pytest

from tests.unit import conftest


@pytest.fixture
def forgiven() -> Iterator[None]:
    """Each refusal below is expected: it must not fail this test at teardown too."""
    yield
    conftest._violations.clear()


def _tcp_store() -> None:
    import torch.distributed as dist

    dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _gloo_group() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


ATTEMPTS: dict[str, Callable[[], object]] = {
    "subprocess.run": lambda: subprocess.run(["true"], check=False),
    "os.system": lambda: os.system("true"),
    "os.fork": os.fork,
    "multiprocessing": lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    "bind": lambda: socket.socket().bind(("127.0.0.1", 0)),
    "connect": lambda: socket.create_connection(("127.0.0.1", 9), timeout=1),
    "unix bind": lambda: socket.socket(socket.AF_UNIX).bind("\0torchrig-unit-guard"),
    "TCPStore": _tcp_store,
    "init_process_group": _gloo_group,
}


@pytest.mark.parametrize("attempt", ATTEMPTS)
def test_a_process_or_a_socket_is_refused_where_it_is_made(attempt: str, forgiven: None) -> None:
    with pytest.raises(conftest.UnitTestIsolationError, match="unit tests start no process and open no socket"):
        ATTEMPTS[attempt]()
    assert conftest._violations, "recorded, so a test that swallowed the error still fails at teardown"


def test_an_in_process_socket_pair_is_allowed() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"x")
        assert right.recv(1) == b"x"
