"""The c10d rendezvous store of a local run: in the supervisor's process, or in a small one of its own.

When an agent hosts the rendezvous store, killing that agent kills the job (every other agent loses
its rendezvous: RendezvousConnectionError). Here no agent hosts it: every agent joins with
`is_host=false`, so any agent (emulated node) can die and the rest re-rendezvous. `LocalRun` opens it
in its own process (`open_store`): the supervisor outlives every agent, and the run ends with it anyway.
A process of its own costs a second `import torch` beside the agents' on the run's critical path
(docs/performance.md); it is kept for runs whose node 0 lives in another network namespace (the
network drills), where the store must listen inside that namespace.

Usage: `python -m orchestrator.backends._local_store PORT_FILE [HOST]`: binds HOST (default 127.0.0.1) on a
free port, writes the port to PORT_FILE (atomically), and serves until its parent (the supervisor) is gone or a
SIGTERM arrives.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from types import FrameType
from typing import Any

__all__ = ["main", "open_store", "write_port"]


def open_store(host: str) -> Any:
    """A c10d `TCPStore` server on `host` and a free port (`.port`); it serves until the object is dropped."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(host, 0, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def write_port(port_file: str, port: int) -> None:
    """Write `port` to `port_file` atomically (agents poll it: `_local_agent.read_port`)."""
    tmp = port_file + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(str(port))
    os.replace(tmp, port_file)


def main(argv: list[str]) -> int:
    """Serve the store; see the module docstring for the arguments."""
    port_file = argv[0]
    host = argv[1] if len(argv) > 1 else "127.0.0.1"
    parent = os.getppid()
    stop = False

    def _on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when the run ends
    store = open_store(host)
    write_port(port_file, store.port)
    # Outlive nothing: when the supervisor dies we are re-parented, and stop. The SIGTERM handler's
    # flag is checked every 50 ms: the supervisor waits for this exit at the end of every run.
    while not stop and os.getppid() == parent:
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    from training.fastexit import exit_now

    exit_now(main(sys.argv[1:]))  # the store's sockets close with the process
