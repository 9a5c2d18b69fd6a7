"""`python -m training.torchrun ARGS...`: torchrun (`torch.distributed.run`), exiting 128 + the signal when
a signal ends it.

torchrun answers SIGTERM (a pod eviction, a node shutdown, a spot notice) by forwarding it to its workers,
waiting up to its shutdown timeout for them (their emergency checkpoint, `training.preemption`), and then
raising `SignalException` out of `main`: an uncaught exception, exit code 1. By Kubeflow's convention
(`training.contract.exit_codes`) 1 is permanent: a PyTorchJob replica with `restartPolicy: ExitCode`
would never be restarted after a preemption. Here that one case exits `128 + signal` (143 for SIGTERM),
what a signal death means to every restarter; everything else is torchrun's own behaviour. In a job that
recovers in place, this process also hands its workers the in-place store (`host_inplace_store`: one node
hosts its own, several nodes share the c10d rendezvous store) and, after each c10d rendezvous, a token
every agent of that round shares (`export_rendezvous_round`). `training.launch` runs this module in place
of a `torchrun` command; the local backend's agents (`orchestrator.backends._local_agent`) call
`export_rendezvous_round` too.

Every order in that store is signed with the job's secret (`Env.JOB_SECRET_FILE`,
`training.contract.orders`). An agent that hosts the store on 127.0.0.1 for one node makes a secret of its
own when the launch gave none (a `torchrun` target, a pod rendered without the job's Secret): only its
workers read it. Several nodes need the job's secret: without one they recover by group restarts, with
a one-line warning.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from training.contract import Env
from training.contract.orders import SECRET_FILE, SecretError, Signer, create_job_secret, load_job_secret

__all__ = [
    "ROUND_KEY",
    "exit_code_of",
    "export_rendezvous_round",
    "host_inplace_store",
    "main",
    "record_job_end",
    "run_agent",
    "stand_by_first",
    "stop_restarting_on_permanent_exit",
]

log = logging.getLogger(__name__)
# The key, in a c10d rendezvous round's own store (prefixed with the run id and round by torch), whose
# first writer's token every agent of the round adopts.
ROUND_KEY = "torchrig/inplace-round"
STORE_RECORD_TIMEOUT_S = 5.0


def host_inplace_store(env: MutableMapping[str, str] | None = None, argv: Sequence[str] = ()) -> Any:
    """Give the workers the long-lived store in-place recovery forms its groups on, when the compiled job
    asks for one (`TORCHRIG_INPLACE_STORE`):

    - `agent` (one node): host it in this process, torchrun's agent, which outlives every trainer (a
      trainer's death is seen by its per-rank host, never by the agent); returns the store (kept alive
      by the caller);
    - `rdzv` (several nodes): the c10d rendezvous store at `--rdzv-endpoint` (`argv`, or torchrun's
      `PET_RDZV_*` variables), which the agent at that endpoint hosts and every node reaches. Under any
      other rendezvous (the static one of a plain `MASTER_ADDR` launch) the variable is removed: no round
      token exists there to share a key space by, so the workers restart the group instead.

    Returns the store this process hosts, or None."""
    env = os.environ if env is None else env
    wanted = env.get(Env.INPLACE_STORE)
    if wanted not in (Env.INPLACE_STORE_RDZV, Env.INPLACE_STORE_AGENT):
        return None
    try:
        secret = load_job_secret(env)
    except SecretError as exc:
        log.warning("in-place recovery is off, the group restarts instead: %s", exc)
        del env[Env.INPLACE_STORE]
        return None
    if wanted == Env.INPLACE_STORE_RDZV:
        endpoint = _rdzv(list(argv))
        if endpoint is None:
            log.warning("in-place recovery needs the c10d rendezvous on several nodes; this launch restarts the group")
            del env[Env.INPLACE_STORE]
        elif secret is None:
            # The rendezvous store is reachable from every node: unsigned orders there could come from anyone.
            log.warning(
                "in-place recovery on several nodes needs the job's secret (%s, the job's Secret); this launch "
                "restarts the group instead",
                Env.JOB_SECRET_FILE,
            )
            del env[Env.INPLACE_STORE]
        else:
            env[Env.INPLACE_STORE] = endpoint[0]
        return None
    if secret is None:
        env[Env.JOB_SECRET_FILE] = _private_secret()
    from torch._C._distributed_c10d import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    env[Env.INPLACE_STORE] = f"127.0.0.1:{store.port}"
    return store


def _private_secret() -> str:
    """A secret of this agent's own for the store it hosts on 127.0.0.1 (a launch that gave none): in a
    directory only this user can enter (`mkdtemp`: 0700), removed when the agent exits. Other users of the
    machine reach 127.0.0.1 too, so the store's orders are signed all the same."""
    folder = tempfile.mkdtemp(prefix="torchrig-secret-")
    atexit.register(shutil.rmtree, folder, True)
    return create_job_secret(os.path.join(folder, SECRET_FILE))


def _rdzv(argv: list[str]) -> tuple[str, str] | None:
    """(`host:port`, run id) of the c10d rendezvous of torchrun's arguments `argv` (torch's own parser, so
    `PET_RDZV_BACKEND` / `PET_RDZV_ENDPOINT` count as they do for torchrun), or None for another backend."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import parse_args

    try:
        args = parse_args(argv)  # type: ignore[no-untyped-call]
    except SystemExit:  # torchrun itself reports bad arguments
        return None
    if args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return None
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
    return f"{host}:{port}", str(args.rdzv_id)


def export_rendezvous_round() -> None:
    """After each c10d rendezvous of this agent, set `TORCHRIG_INPLACE_ROUND` (which its next workers
    inherit) to a token every agent of the round shares: the first agent's random token, agreed on with
    one compare-and-set in the round's own store. In-place recovery keys its bookkeeping by it, since each
    agent's restart count is its own (torch counts failures, not membership changes). Installed once per
    process, by wrapping the handler's public `next_rendezvous`; other rendezvous backends are untouched."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    original = DynamicRendezvousHandler.next_rendezvous
    if getattr(original, "_torchrig_round", False):
        return

    @functools.wraps(original)
    def next_rendezvous(self: DynamicRendezvousHandler) -> Any:
        if os.environ.pop(Env.FIRST_ROUND_ALONE, None) == "1":
            info = _without_last_call(self, original)
        else:
            info = original(self)
        try:
            token = info.store.compare_set(ROUND_KEY, "", uuid.uuid4().hex).decode()
        except Exception as exc:  # no token: the workers restart the group instead of recovering in place
            log.warning("in-place recovery: no round token from the rendezvous store: %s", exc)
            os.environ.pop(Env.INPLACE_ROUND, None)
        else:
            os.environ[Env.INPLACE_ROUND] = token
            _publish_round(self, info, token)
        return info

    next_rendezvous._torchrig_round = True  # type: ignore[attr-defined]
    DynamicRendezvousHandler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]


def _without_last_call(handler: Any, original: Any) -> Any:
    """`original(handler)` with a last call of 0 s: the round completes as soon as this agent joins it
    (`Env.FIRST_ROUND_ALONE`). Torch keeps the timeout in a private field of the handler's settings; a
    torch without it just waits the last call. Nor does the agent sleep torch's random 0-0.3 s before its
    first round (`next_rendezvous`: `_delay(seconds=(0, 0.3))`, which spreads many nodes' joins over time):
    alone, it has no one to spread from (0.15 s on average off every local run's first step)."""
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    timeout = handler._settings.timeout
    kept = getattr(timeout, "_last_call", None)
    if kept is None:
        return original(handler)
    delay = getattr(dynamic_rendezvous, "_delay", None)

    def _no_skew(seconds: Any) -> None:
        if not isinstance(seconds, tuple):  # the executor's other delays (a busy store: 1 s) stay
            delay(seconds)  # type: ignore[misc]

    timeout._last_call = timedelta(0)
    if delay is not None:
        setattr(dynamic_rendezvous, "_delay", _no_skew)  # noqa: B010 - a private name of torch's module
    try:
        return original(handler)
    finally:
        timeout._last_call = kept
        if delay is not None:
            setattr(dynamic_rendezvous, "_delay", delay)  # noqa: B010


def _publish_round(handler: Any, info: Any, token: str) -> None:
    """Record the round this agent runs in the rendezvous store, outside every round's prefix
    (`InPlace.round_record_key`): a standby node (`training.inplace.standby`) finds the round's key space,
    its size and its exit barrier there. Every agent of the round writes the same token and round, signed
    with the job's secret (none: nothing is recorded, and no standby stands by without one)."""
    from training.inplace import InPlace
    from training.inplace.standby import Round

    record = Round(token=token, round=int(handler._state_holder.state.round), nodes=int(info.world_size))
    try:
        secret = load_job_secret()
        if secret is None:
            return
        key = InPlace.round_record_key(handler._settings.run_id)
        handler._store.set(key, Signer(secret).sign(key, record.to_json()))
    except Exception as exc:  # no standby can find this round; the job itself is unaffected
        log.warning("in-place recovery: could not record the rendezvous round for standby nodes: %s", exc)


def _permanent_codes(failures: Any) -> list[int]:
    """The permanent exit codes (`PERMANENT`: a spec, task or setting to fix) among torchelastic failures."""
    from training.contract.exit_codes import PERMANENT

    return sorted({f.exitcode for f in failures.values() if f.exitcode in PERMANENT})


def stop_restarting_on_permanent_exit() -> None:
    """Make torchrun's agent stop, instead of restarting the group, when a worker exits with a permanent
    code (2, 3, 126, 127: `training.contract.exit_codes`). torchrun restarts on any failure: a wrong
    checkpoint key or checkpoints that are corrupt everywhere would spend every restart on the same
    verdict, and the job would then end with torchrun's exit 1. Installed once per process by wrapping
    the agent's `_monitor_workers` (torch's own restart loop is untouched: it finds no restart left);
    `exit_code_of` then gives the agent's process the worker's code."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._monitor_workers
    if getattr(original, "_torchrig_permanent", False):
        return

    @functools.wraps(original)
    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        result = original(self, worker_group)
        if result.state == WorkerState.FAILED and self._remaining_restarts > 0:
            codes = _permanent_codes(result.failures)
            if codes:
                log.error(
                    "a worker exited %s (permanent: a spec, task or setting to fix); not restarting the group "
                    "(%d restart(s) left unused)",
                    "/".join(map(str, codes)),
                    self._remaining_restarts,
                )
                self._remaining_restarts = 0
        return result

    _monitor_workers._torchrig_permanent = True  # type: ignore[attr-defined]
    LocalElasticAgent._monitor_workers = _monitor_workers  # type: ignore[method-assign]


def exit_code_of(exc: BaseException) -> int | None:
    """The exit code for the agent's process when torchrun ended with `exc`: 128 + the signal that
    stopped it, a worker's permanent code, `STORE_LOST` when the rendezvous store went away, or None
    (torchrun's own: exit 1 with its traceback)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from training.contract import ExitCode

    if isinstance(exc, SignalException):
        code = 128 + int(exc.sigval)
        print(f"torchrig: torchrun stopped by {exc.sigval.name}; exiting {code} (retryable)", file=sys.stderr)
        return code
    if isinstance(exc, ChildFailedError):
        codes = _permanent_codes(exc.failures)
        if codes:
            print(f"torchrig: a worker exited {codes[0]} (permanent, see its log); not restarted", file=sys.stderr)
            return codes[0]
    if isinstance(exc, RendezvousConnectionError):
        # The pod hosting the store died (its node, an eviction): the job restarts as a whole, from the
        # checkpoint, instead of failing on torchrun's exit 1. Retryable, so the operator recreates the pod.
        code = int(ExitCode.STORE_LOST)
        cause = exc.__cause__ or exc.__context__
        print(
            f"torchrig: torchrun lost the rendezvous store ({cause or exc}); exiting {code} (retryable: the job "
            "restarts from its checkpoint)",
            file=sys.stderr,
        )
        return code
    return None


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv` (default: this process's arguments); 128 + signal when a signal ended it,
    a worker's permanent exit code when one stopped it (`stop_restarting_on_permanent_exit`)."""
    from torch.distributed.run import main as torchrun_main

    args = sys.argv[1:] if argv is None else argv
    code = stand_by_first(args)
    if code is not None:
        return code
    store = host_inplace_store(argv=args)  # noqa: F841 - lives as long as the agent
    return run_agent(torchrun_main, args)


def stand_by_first(args: list[str]) -> int | None:
    """A standby node (`restarts.spareNodes`, `training.inplace.standby`) stands by instead of running
    torchrun's agent: its exit code (a permanent one recorded for a store-only Master, as a member's agent
    records its own: `record_permanent_exit`); None when this process should run torchrun (no standby
    here, or a member's node whose round ended while it stood by)."""
    from training.inplace.standby import JOIN, run_standby, standby_wanted

    launch = standby_wanted(args)
    if launch is None:
        return None
    code = run_standby(launch)
    if code != JOIN:
        if 1 <= code <= 127:  # a standby that took a node and failed there ends the job like a member
            record_job_end(args, code)
        return code
    for sig in (signal.SIGTERM, signal.SIGINT):  # torchrun installs its own
        signal.signal(sig, signal.SIG_DFL)
    return None


def _warn(message: str) -> None:
    print(f"torchrig: warning: {message}", file=sys.stderr, flush=True)


def run_agent(torchrun_main: Any, args: list[str]) -> int:
    """torchrun's `main(args)` as torchrig's agents run it: the rendezvous round exported to the workers
    (`export_rendezvous_round`), no restart after a worker's permanent exit
    (`stop_restarting_on_permanent_exit`); returns the agent's exit code (`exit_code_of`, else 0)."""
    export_rendezvous_round()
    stop_restarting_on_permanent_exit()
    try:
        torchrun_main(args)
    except Exception as exc:
        code = exit_code_of(exc)
        if code is None or 1 <= code <= 127:
            record_job_end(args, 1 if code is None else code)
        if code is None:
            raise
        return code
    record_job_end(args, 0)  # torchrun returns once every agent of the round passed its exit barrier
    from training.pod_recreations import forget_after_success

    forget_after_success(os.environ, socket.gethostname(), _warn)  # a resubmitted job starts from 0
    return 0


def record_job_end(args: list[str], code: int, env: Mapping[str, str] | None = None) -> bool:
    """Tell a store-only rendezvous pod (`Env.STORE_POD`, `training.rendezvous_store`) that this agent ends
    the job: 0 once it passed torchrun's exit barrier, else the permanent code it ends it with; that pod
    ends with the job instead of serving a failed job's kept pods. Signed with the job's secret (without
    one, nothing is recorded: the pod trusts no unsigned record). Best effort, a few seconds at most;
    returns whether it was recorded."""
    env = os.environ if env is None else env
    if env.get(Env.STORE_POD) != "1":
        return False
    rdzv = _rdzv(args)
    if rdzv is None:
        return False
    from training.inplace import store_client
    from training.inplace.standby import job_finished
    from training.rendezvous_store import failed_key, succeeded_key

    endpoint, run_id = rdzv
    key = succeeded_key(run_id) if code == 0 else failed_key(run_id)
    try:
        secret = load_job_secret(env)
        if secret is None:
            raise SecretError(f"{Env.JOB_SECRET_FILE} is not set")
        store = store_client(endpoint, timeout_s=STORE_RECORD_TIMEOUT_S)
        if code == 0 and not job_finished(store, run_id, secret):
            # torchrun returns 0 even when its exit barrier timed out (a node still running): only a
            # barrier every agent passed is the job's end.
            log.warning("torchrun's exit barrier did not pass; the job's end is not recorded")
            return False
        store.set(key, Signer(secret).sign(key, str(code)))
    except Exception as exc:
        log.warning("could not record this agent's exit %d in the rendezvous store: %s", code, exc)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
