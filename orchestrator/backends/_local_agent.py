"""A local run's torchrun agent, started before the rendezvous store exists.

The supervisor opens the store (`_local_store`) once the run's preflight passed and writes its port to a
file; the preflight, the store and torchrun all need torch, whose import takes seconds. Here the agent
imports torchrun first and only then waits for the port, so its import overlaps the supervisor's
instead of following it (and a failed preflight stops the agent before it did anything).

Usage: `python -m orchestrator.backends._local_agent PORT_FILE TORCHRUN_ARGS...`: every occurrence
of `STORE_PORT` in TORCHRUN_ARGS and in `TORCHRIG_INPLACE_STORE` becomes the port (PORT_FILE `-`: the
arguments already name it, as for a node added to a running job); then this process
is `python -m torch.distributed.run TORCHRUN_ARGS...` (same exit status, same output), with the
rendezvous round exported to its workers (`training.torchrun.export_rendezvous_round`). A standby node
(`TORCHRIG_STANDBY_FROM`, `training.inplace.standby`) stands by first.
"""

from __future__ import annotations

import os
import sys
import time

from training.contract import Env

__all__ = ["NO_PORT_FILE", "PORT_PLACEHOLDER", "main", "read_port"]

PORT_PLACEHOLDER = "STORE_PORT"
NO_PORT_FILE = "-"
WAIT_S = 60.0  # as long as the supervisor waits for the store


def read_port(port_file: str, timeout_s: float = WAIT_S) -> int | None:
    """The port in `port_file` once the store has written it (atomically), or None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(port_file) as fh:
                return int(fh.read())
        except (FileNotFoundError, ValueError):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)


def main(argv: list[str]) -> int:
    port_file, args = argv[0], argv[1:]
    from torch.distributed.run import main as torchrun_main  # the slow import, beside the store's

    if port_file != NO_PORT_FILE:
        port = read_port(port_file)
        if port is None:
            print(f"torchrig: the rendezvous store wrote no port to {port_file} in {WAIT_S:.0f} s", file=sys.stderr)
            return 1
        args = [a.replace(PORT_PLACEHOLDER, str(port)) for a in args]
        if Env.INPLACE_STORE in os.environ:
            os.environ[Env.INPLACE_STORE] = os.environ[Env.INPLACE_STORE].replace(PORT_PLACEHOLDER, str(port))
    sys.argv = ["torchrun", *args]
    from training.torchrun import run_agent, stand_by_first

    code = stand_by_first(args)  # a standby node (`restarts.spareNodes`) runs no agent while it stands by
    if code is not None:
        return code

    # The in-place key space every node's hosts share; a worker's permanent exit ends the run at once.
    return run_agent(torchrun_main, args)


if __name__ == "__main__":
    from training.fastexit import exit_now

    exit_now(main(sys.argv[1:]))  # a failure raises out of torchrun: a traceback and exit 1, as torchrun's own
