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

- it serves until an agent records that it passed torchrun's exit barrier (`succeeded_key`, written by
  `training.torchrun.run_agent` once torchrun returned 0: every agent of the round got there), waits
  `EXIT_GRACE_S` for the agents to close their rendezvous, and exits 0;
- an agent that ends the job with a permanent code (1-127: torchrun's restarts spent, a worker's
  permanent error) records it (`failed_key`, `training.torchrun.run_agent`): this pod exits with the same
  code, so it does not outlive a failed job whose pods are kept (`cleanPodPolicy: None`);
- SIGTERM (a deletion, an eviction) exits 143, retryable: the operator recreates it, and the agents,
  which lost their store, exit `STORE_LOST` and are recreated too.

Both records are orders: signed with the job's secret (`Env.JOB_SECRET_FILE`, `training.contract.orders`)
over their key, which names the run. This pod listens on every interface (the job's pods reach it by its
Service), so whoever else reaches the port may write there too: a record whose MAC does not check is
ignored (logged once), and torchelastic's own barrier keys, which carry none, decide nothing here. Without
a usable secret this pod cannot tell the agents' records from anyone's: it refuses to start (exit 3, the
job's Secret is missing from the pod).
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

from training.contract import Env, ExitCode
from training.contract.orders import SecretError, Signer, load_job_secret

__all__ = ["EXIT_GRACE_S", "failed_code", "failed_key", "job_outcome", "main", "serve", "succeeded_key"]

POLL_S = 0.5
EXIT_GRACE_S = 5.0  # after the exit barrier: the agents' rendezvous shutdown still writes to the store


def failed_key(run_id: str) -> str:
    """Where an agent records the permanent exit code it ends run `run_id` with (signed)."""
    return f"torchrig/job/{run_id}/failed"


def succeeded_key(run_id: str) -> str:
    """Where an agent records that it passed torchrun's exit barrier in run `run_id` (signed)."""
    return f"torchrig/job/{run_id}/succeeded"


def failed_code(value: str) -> int | None:
    """The permanent exit code an agent recorded (`failed_key`), or None when it is not one (1-127)."""
    if not value.isdigit() or len(value) > 3:
        return None
    code = int(value)
    return code if 1 <= code <= 127 else None


def _record(store: Any, key: str, signer: Signer) -> str | None:
    return signer.open(key, store.get(key)) if store.check([key]) else None


def job_outcome(store: Any, run_id: str, secret: bytes) -> int | None:
    """An agent's permanent exit code, 0 once an agent passed torchrun's exit barrier, or None while the job
    runs (or has not started); only records signed with the job's `secret` count."""
    signer = Signer(secret)
    failed = _record(store, failed_key(run_id), signer)
    if failed is not None and (code := failed_code(failed)) is not None:
        return code
    return 0 if _record(store, succeeded_key(run_id), signer) == "0" else None


def serve(port: int, run_id: str, secret: bytes, *, grace_s: float = EXIT_GRACE_S) -> int:
    """Host the store on every interface at `port` (0: a free one, printed) until the job's outcome
    (`job_outcome`, records signed with `secret`) or a signal; returns the exit code."""
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
        code = job_outcome(store, run_id, secret)
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
    try:
        secret = load_job_secret()
    except SecretError as exc:
        print(f"torchrig: error: rendezvous store: {exc}", file=sys.stderr)
        return int(ExitCode.ENVIRONMENT)
    if secret is None:
        print(
            f"torchrig: error: rendezvous store: {Env.JOB_SECRET_FILE} is not set: without the job's secret "
            "this pod cannot tell the agents' records of the job's end from anyone's (mount the job's Secret)",
            file=sys.stderr,
        )
        return int(ExitCode.ENVIRONMENT)
    return serve(args.port, args.run_id, secret)


if __name__ == "__main__":
    from training.fastexit import exit_now

    logging.basicConfig(level=logging.INFO)
    exit_now(main())
