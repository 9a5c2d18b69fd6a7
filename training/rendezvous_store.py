"""`python -m training.rendezvous_store --port P --run-id ID`: a pod that only hosts the c10d rendezvous store.

In a fixed-size PyTorchJob the store lives in the Master pod's torchrun agent (the c10d handler hosts it
where the endpoint's hostname is its own). Losing that pod loses the store, and with it every agent's
rendezvous: the job restarts from its checkpoint (`ExitCode.STORE_LOST`), and no standby node
(`restarts.spareNodes`, `training.inplace.standby`) can take the Master's ranks in place, since the
in-place bookkeeping lives in the same store. With standby nodes the compiler therefore makes the Master
replica this process: no GPU, no trainer, a small Guaranteed pod; every training node is a Worker and
joins as a client, so any training node can be lost and taken in place. Only this pod's own loss still
restarts the job: it is the one single point the job keeps, and the lightest (no GPU to fail, no
trainer to run out of memory).

Its life follows the job's, as the operator reads it (a PyTorchJob with a Master succeeds when the
Master does, `pytorchjob_controller.go UpdateJobStatus`):

- it serves until the running round's agents all passed torchrun's exit barrier (the job's success,
  read from the round every agent records: `InPlace.round_record_key`), waits `EXIT_GRACE_S` for them
  to close their rendezvous, and exits 0;
- an agent that ends the job with a permanent code (1-127: torchrun's restarts spent, a worker's
  permanent error) records it (`FAILED_KEY`, `training.torchrun.run_agent`): this pod exits with the same
  code, so it does not outlive a failed job whose pods are kept (`cleanPodPolicy: None`);
- SIGTERM (a deletion, an eviction) exits 143, retryable: the operator recreates it, and the agents,
  which lost their store, exit `STORE_LOST` and are recreated too.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from datetime import timedelta
from types import FrameType
from typing import Any

__all__ = ["EXIT_GRACE_S", "FAILED_KEY", "failed_code", "job_outcome", "main", "serve"]

POLL_S = 0.5
EXIT_GRACE_S = 5.0  # after the exit barrier: the agents' rendezvous shutdown still writes to the store
FAILED_KEY = "torchrig/job/failed"  # an agent's permanent exit code (`training.torchrun.run_agent`)


def failed_code(raw: bytes) -> int | None:
    """The permanent exit code an agent recorded (`FAILED_KEY`), or None when it is not one (1-127)."""
    try:
        code = int(raw.decode())
    except ValueError:
        return None
    return code if 1 <= code <= 127 else None


def job_outcome(store: Any, run_id: str) -> int | None:
    """0 once the recorded round's agents passed torchrun's exit barrier, an agent's permanent exit code,
    or None while the job runs (or has not started)."""
    from training.inplace.standby import job_finished

    if store.check([FAILED_KEY]):
        code = failed_code(store.get(FAILED_KEY))
        if code is not None:
            return code
    return 0 if job_finished(store, run_id) else None


def serve(port: int, run_id: str, *, grace_s: float = EXIT_GRACE_S) -> int:
    """Host the store on every interface at `port` (0: a free one, printed) until the job's outcome
    (`job_outcome`) or a signal; returns the exit code."""
    from torch._C._distributed_c10d import TCPStore

    stopping: list[int] = []

    def _stop(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    timeout = timedelta(seconds=30)
    store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, multi_tenant=True, timeout=timeout)
    print(f"torchrig: rendezvous store of {run_id} listening on port {store.port}", file=sys.stderr, flush=True)
    while not stopping:
        code = job_outcome(store, run_id)
        if code is not None:
            what = "the job's agents passed torchrun's exit barrier" if not code else f"an agent ended the job ({code})"
            print(f"torchrig: rendezvous store: {what}; exiting {code} in {grace_s:.0f} s", file=sys.stderr, flush=True)
            deadline = time.monotonic() + grace_s
            while not stopping and time.monotonic() < deadline:
                time.sleep(0.05)
            return code
        time.sleep(POLL_S)
    return 128 + stopping[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.rendezvous_store", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the rendezvous port (the Master's pytorchjob-port)")
    parser.add_argument("--run-id", required=True, help="torchrun's --rdzv-id (the job's name)")
    args = parser.parse_args(argv)
    return serve(args.port, args.run_id)


if __name__ == "__main__":
    from training.fastexit import exit_now

    logging.basicConfig(level=logging.INFO)
    exit_now(main())
