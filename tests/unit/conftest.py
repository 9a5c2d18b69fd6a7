"""The unit suite starts no process and opens no network socket (issue 34: "the unit suite has no process
or socket"); tests that need either live in tests/integration/.

An autouse guard fails the test that tries: a child process (`subprocess`, `os.fork`, `os.posix_spawn`,
`os.system`, `multiprocessing`), a socket bound or connected (Python's `socket` module, any
family: a Unix socket server is inter-process I/O too), or torch's C++ paths to the same (`TCPStore`,
`init_process_group`, whose gloo device binds a TCP listener even at world size 1). `socket.socketpair()`
stays allowed: an unnamed pair inside one process reaches nothing, and the standard library's own
plumbing (`asyncio`'s self-pipe, selectors) uses it. The Python-level checks ride on audit hooks
(PEP 578), so they also catch a library that calls these functions from C; an attempt raises
`UnitTestIsolationError` where it is made, and the test fails at teardown even if something swallowed it.
"""

from __future__ import annotations

import multiprocessing.process
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# Audit events of starting a process or opening a socket to somewhere (docs.python.org/3/library/audit_events).
# `os.exec*` is not among them: it starts no process (a unit test may check a launcher's exec of a
# command that does not exist; one that succeeded would replace pytest itself and fail loudly anyway).
_PROCESS_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "pty.spawn"}
)
_SOCKET_EVENTS = frozenset({"socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg"})

_state = threading.local()
_violations: list[str] = []  # what the running test tried (any thread), reported at its teardown
_active = [False]  # a unit test is running (the hook outlives every test: audit hooks cannot be removed)


class UnitTestIsolationError(RuntimeError):
    """A unit test started a process or opened a socket (move it to tests/integration/)."""


def _refuse(what: str) -> None:
    message = f"unit tests start no process and open no socket: {what} (move the test to tests/integration/)"
    _violations.append(message)
    raise UnitTestIsolationError(message)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _active[0] or getattr(_state, "inside", False):
        return
    if event in _PROCESS_EVENTS:
        _state.inside = True
        try:
            _refuse(f"{event} {_argv(args)}")
        finally:
            _state.inside = False
    elif event in _SOCKET_EVENTS:
        _state.inside = True
        try:
            _refuse(f"{event} to {args[1]!r}" if len(args) > 1 else event)
        finally:
            _state.inside = False


def _argv(args: tuple[Any, ...]) -> str:
    """The command of a process event, shortened (`subprocess.Popen`'s args are (executable, args, ...))."""
    if len(args) >= 2 and isinstance(args[1], (list, tuple)):
        return " ".join(map(str, args[1]))[:200]
    return ""


# urllib3 probes IPv6 support at import by binding `::1` (urllib3/util/connection.py, HAS_IPV6): a test
# that first imports it (Ray, requests, kubernetes do) would fail on plumbing, not on what it does.
import urllib3.util.connection  # noqa: E402, F401

sys.addaudithook(_audit)


def _guarded(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        if _active[0]:
            _refuse(name)
        return original(*args, **kwargs)

    return refuse


def _torch_guards() -> list[tuple[Any, str, Any]]:
    """(object, attribute, replacement) for torch's C++ socket paths, if torch is installed."""
    try:
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d
    except ImportError:  # pragma: no cover - torch is a dependency
        return []
    original = c10d.TCPStore

    class GuardedTCPStore(original):  # type: ignore[misc,valid-type]
        """`TCPStore` that refuses to be made during a unit test (a server binds, a client connects)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if _active[0]:
                _refuse("torch TCPStore")
            super().__init__(*args, **kwargs)

    guards: list[tuple[Any, str, Any]] = [(c10d, "TCPStore", GuardedTCPStore)]
    if getattr(dist, "TCPStore", None) is original:
        guards.append((dist, "TCPStore", GuardedTCPStore))
    if hasattr(dist, "init_process_group"):
        guards.append(
            (dist, "init_process_group", _guarded("torch.distributed.init_process_group", dist.init_process_group))
        )
    return guards


# Installed before any test module imports these names, so `from torch.distributed import TCPStore` at
# a test module's top binds the guarded class too.
for _obj, _attr, _replacement in [
    (
        multiprocessing.process.BaseProcess,
        "start",
        _guarded("multiprocessing start", multiprocessing.process.BaseProcess.start),
    ),
    *_torch_guards(),
]:
    setattr(_obj, _attr, _replacement)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    report = yield
    if report.when in ("setup", "call") and report.failed:
        item.stash[_FAILED] = True
    return report


_FAILED = pytest.StashKey[bool]()  # the test's setup or call failed already (it reports the refusal itself)


@pytest.fixture(autouse=True)
def _no_process_or_socket(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test if it started a process or opened a socket, even if the error was caught."""
    _violations.clear()
    _active[0] = True
    try:
        yield
    finally:
        _active[0] = False
    # A test that failed already reports the refusal itself; one that caught it fails here.
    if _violations and not request.node.stash.get(_FAILED, False):
        pytest.fail(_violations[0], pytrace=False)
