"""`python -m training.torchrun ARGS...`: torchrun (`torch.distributed.run`), exiting 128 + the signal when
a signal ends it.

torchrun answers SIGTERM (a pod eviction, a node shutdown, a spot notice) by forwarding it to its workers,
waiting up to its shutdown timeout for them (their emergency checkpoint, `training.preemption`), and then
raising `SignalException` out of `main`: an uncaught exception, exit code 1. By Kubeflow's convention
(`training.contract.exit_codes`) 1 is permanent: a PyTorchJob replica with `restartPolicy: ExitCode`
would never be restarted after a preemption. Here that one case exits `128 + signal` (143 for SIGTERM),
what a signal death means to every restarter; everything else is torchrun's own behaviour. In a one-node
job that recovers in place, this process also hosts the in-place store (`host_inplace_store`).
`training.launch` runs this module in place of a `torchrun` command.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from typing import Any

from training.contract import Env

__all__ = ["main"]


def host_inplace_store(env: MutableMapping[str, str] | None = None) -> Any:
    """When the compiled job asks for it (`TORCHRIG_INPLACE_STORE=agent`: one node, in-place recovery), host
    the long-lived store in-place recovery forms its groups on, in this process: torchrun's agent, which
    outlives every trainer (a trainer's death is seen by its per-rank host, never by the agent). Its
    workers inherit the address. Returns the store (kept alive by the caller), or None."""
    env = os.environ if env is None else env
    if env.get(Env.INPLACE_STORE) != Env.INPLACE_STORE_AGENT:
        return None
    from torch._C._distributed_c10d import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    env[Env.INPLACE_STORE] = f"127.0.0.1:{store.port}"
    return store


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv` (default: this process's arguments); 128 + signal when a signal ended it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    store = host_inplace_store()  # noqa: F841 - lives as long as the agent

    try:
        torchrun_main(argv)
    except SignalException as exc:
        code = 128 + int(exc.sigval)
        print(f"torchrig: torchrun stopped by {exc.sigval.name}; exiting {code} (retryable)", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
