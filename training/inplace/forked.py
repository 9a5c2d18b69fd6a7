"""Trainers and spares forked from their host's warm interpreter instead of started from scratch.

A new `python -m training` process pays for `import torch`, the training stack and `torch._dynamo`
(the first optimizer step imports it) before it can do anything: about 4.7 s of CPU here, per
process. The host of in-place recovery (`training.inplace.host`) needs torch anyway (its store
client), so it imports the whole stack once (`warm_up`) and `fork`s every trainer and spare from
that state: the child starts with everything imported (docs/performance.md measures the start-up).

Fork is safe here because the host has done no torch work when it forks (no OpenMP pool, no CUDA
context, no process group) and runs no Python thread; its one store connection is left alone by the
child, which exits through `training.fastexit.exit_now` and never returns into the host's code. When CUDA is already
initialised in the host (a user's code did so at import) or `fork` is missing, the child is a fresh
`python -m training` process as before (`subprocess.Popen`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from training.fastexit import exit_now

__all__ = ["Process", "can_fork", "remember_signal_handlers", "start", "warm_up"]

log = logging.getLogger(__name__)

# What a trainer or a spare imports before its first step; the host imports it once for all of them.
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "torch._dynamo",
    "training.worker",
    "training.inplace.group",
    "training.inplace.spare",
)

_ORIGINAL: dict[int, Any] = {}


def warm_up() -> None:
    """Import what every trainer and spare needs (a failure here is left for the child to report); nothing
    when the children will not be forked (`can_fork`): a fresh interpreter imports its own."""
    if not can_fork():
        return
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # e.g. a torch build without some module: the child imports what it can
            log.debug("in-place: warming up %s failed", name, exc_info=True)


def remember_signal_handlers(signals: Sequence[int]) -> None:
    """Record the handlers of `signals` before the host replaces them; a forked child gets these back."""
    for sig in signals:
        _ORIGINAL.setdefault(sig, signal.getsignal(sig))


def can_fork() -> bool:
    """Whether a child can be forked from this process (no CUDA context here, `os.fork` exists, and this
    is the main thread: a host running in a thread of a multithreaded process, a Ray Train worker's
    training thread, starts fresh interpreters instead of forking a copy of the other threads' state)."""
    if not hasattr(os, "fork") or threading.current_thread() is not threading.main_thread():
        return False
    torch = sys.modules.get("torch")
    try:
        return not (torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


class Process:
    """A forked child with the part of `subprocess.Popen`'s interface the host uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status as `Popen.returncode` has it (-N for a signal death), or None while it runs."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone, its status unknown
                self.returncode = -int(signal.SIGKILL)
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["forked"], timeout or 0.0)
            time.sleep(0.01)
        return code


def start(command: list[str], argv: list[str], env: Mapping[str, str]) -> Process | subprocess.Popen[bytes]:
    """Start `python -m training ARGV` with `env` added to this environment: forked from this warm
    interpreter when `can_fork()`, else `command` (the same thing as a fresh process)."""
    if not can_fork():
        return subprocess.Popen(command, env={**os.environ, **env})
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # Signals stay blocked until the child has its original handlers back: one forwarded right after
    # the fork must reach the trainer's handler, not the copy of the host's forwarder.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, list(_ORIGINAL))
    try:
        with warnings.catch_warnings():  # Python 3.12+ warns about torch's idle native thread
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            _child(argv, env, blocked)  # never returns
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return Process(pid)


def _child(argv: list[str], env: Mapping[str, str], mask: set[int | signal.Signals]) -> NoReturn:
    code = 1
    try:
        for sig, handler in _ORIGINAL.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal that came meanwhile is handled now
        os.environ.update(env)
        from training.entry import main

        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        exit_now(code)
