"""`python -m training.torchrun ARGS...`: torchrun (`torch.distributed.run`), exiting 128 + the signal when
a signal ends it.

torchrun answers SIGTERM (a pod eviction, a node shutdown, a spot notice) by forwarding it to its workers,
waiting up to its shutdown timeout for them (their emergency checkpoint, `training.preemption`), and then
raising `SignalException` out of `main`: an uncaught exception, exit code 1. By Kubeflow's convention
(`training.contract.exit_codes`) 1 is permanent: a PyTorchJob replica with `restartPolicy: ExitCode`
would never be restarted after a preemption. Here that one case exits `128 + signal` (143 for SIGTERM),
what a signal death means to every restarter; everything else is torchrun's own behaviour.
`training.launch` runs this module in place of a `torchrun` command.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv` (default: this process's arguments); 128 + signal when a signal ended it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except SignalException as exc:
        code = 128 + int(exc.sigval)
        print(f"torchrig: torchrun stopped by {exc.sigval.name}; exiting {code} (retryable)", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
