"""The function Ray Train's `TorchTrainer` runs on every worker: the torchrig worker, under Ray.

Ray Train has already created the default process group when `train_loop_per_worker` starts; this
module only translates `ray.train.get_context()` into a `training.contract.WorkerIdentity` and calls
`training.worker.run_worker`, which reuses that group. The torchrig checkpoint manager stays the
source of truth: every restarted worker group restores the newest committed torchrig checkpoint
itself, and the `ray.train.report` at the end carries the last committed step and store URIs as
metrics only. No Ray Checkpoint is reported, so Ray never holds a second copy of the state.

The driver's run directory need not be rank 0's (a RayJob's head and workers each have their own), so
rank 0 also hands its result and the events the summary needs (`training.contract.WorkerReport`) to
the run's ledger actor, which the driver reads after `fit()`. Not through `ray.train.report`: Ray
Train v2 keeps only the metrics reported with a checkpoint (`Result.metrics` is the latest
checkpoint's, None without one), and `Result.return_value` exists only in Ray releases newer than the
oldest torchrig supports (ray-project/ray#62021).

Preemption (`training.preemption`): the training function runs in a thread of the worker actor, where
Python cannot install a signal handler, and the actor's main thread sits in Ray's task loop with Ray's
own SIGTERM handler (`Worker.main_loop`: exit the process at once). `run_on_actor_main_thread` runs the
handler's installation on that main thread as an actor task (`__ray_call__`; Ray Train's worker actor
runs one task at a time on its main thread, which it leaves free while the training thread runs), so a
SIGTERM to a Ray Train worker process becomes the agreed stop step and the emergency checkpoint like
under torchrun; Ray's handler comes back when the worker ends without a signal. The training function
then raises `PreemptedExit`: Ray Train counts a worker failure and restarts the group
(`restarts.max`), which restores the emergency checkpoint, or, with no restart left, the run ends
(summary `preempted`) with that checkpoint committed, and a new run of the job resumes from it.
A node drain (Ray Train's `get_preemption_info`, e.g. a spot reclaim with its deadline) is the same
notice without a signal: `ray_drain_notice` is polled every `metrics.logEvery` steps on every rank.
(`worker_process_setup_hook` would not do: it runs before `main_loop`, which installs Ray's handler
over it.)

In-place recovery (`restarts.in_place`, 2+ ranks, `training.inplace`): the training function becomes the
rank's host (`training.inplace.host.run_host`, as under torchrun) instead of training in the actor. It
starts the trainer as a child process (a fresh interpreter: a fork of Ray's multithreaded worker would
copy its threads' state; the actor's `CUDA_VISIBLE_DEVICES` is inherited), and the host of each node's
local rank 0 keeps that node's warm spares. The trainers form their process group on an in-place store
that rank 0's worker hosts (`TCPStore` at the node's address, every order signed with the job's secret,
which rank 0 hands to the group through the ledger actor with the store's address); Ray Train's own group
serves only this agreement and the final `ray.train.report`. A trainer that dies is replaced in place by a
spare, and Ray never sees it; what the host cannot recover in place (no spare in time, every rank lost,
an exit code that is the run's) ends the training function with `TrainerExit`, which Ray Train counts as
a worker failure: its `FailureConfig` group restart resumes from the newest committed checkpoint, as it
does when a worker actor or a node is lost. Ray's drain notice becomes a SIGTERM to the host, which
forwards it to its trainer (the emergency checkpoint, as on a signal).

`ray` is imported inside functions only: `training` must stay importable without Ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from training.contract import Env, EventKind, Result, RunFiles, WorkerIdentity, WorkerReport, read_events
from training.contract.orders import SECRET_BYTES, SECRET_FILE, SecretError, load_job_secret

__all__ = [
    "LEDGER_CALL_TIMEOUT_S",
    "TrainerExit",
    "create_run_ledger",
    "last_committed_checkpoint",
    "ray_drain_notice",
    "run_on_actor_main_thread",
    "train_loop_per_worker",
]

LEDGER_CALL_TIMEOUT_S = 60.0  # a call on the ledger actor (a few bytes in memory): past this, Ray is broken
MAIN_THREAD_CALL_TIMEOUT_S = 60.0  # a task on this worker's own actor (its main thread is idle): past it, broken
INPLACE_RECORD_WAIT_S = 120.0  # how long a rank waits for rank 0's in-place store record (rank 0 starts Ray-slow)
DRAIN_POLL_S = 0.25  # how often a host looks at Ray's drain notice (a local read, no barrier)
MAX_KEPT_RECORDS = 4  # the ledger keeps the in-place records of this many newest worker groups

log = logging.getLogger(__name__)

_pending: dict[int, Callable[[], None]] = {}  # calls handed to the actor's main thread (same process)


def _call_pending(actor: Any, key: int) -> None:
    """Runs on the worker actor's main thread (`__ray_call__`): the function registered under `key`."""
    _pending.pop(key)()


def run_on_actor_main_thread(fn: Callable[[], None]) -> None:
    """Run `fn` on the main thread of this Ray Train worker's process and wait for it.

    `fn` stays in this process: only a key travels through Ray (the actor task runs in the same
    process, where `_pending` holds it), so it may close over anything, signal handlers included.
    """
    import ray

    key = id(fn)
    _pending[key] = fn
    try:
        actor = ray.get_runtime_context().current_actor
        ray.get(actor.__ray_call__.remote(_call_pending, key), timeout=MAIN_THREAD_CALL_TIMEOUT_S)
    finally:
        _pending.pop(key, None)


def ray_drain_notice() -> float | None:
    """Seconds until Ray reclaims a node of this worker group, or None while none is announced.

    Ray Train's `get_preemption_info` (a node being drained, e.g. a spot reclaim, with its deadline;
    Ray Train's watcher polls the draining nodes every few seconds). It is a barrier across the group's
    workers, so every rank must call it at the same steps (`PreemptionHandler.watch_notice` does).
    """
    import ray.train

    get = getattr(ray.train, "get_preemption_info", None)
    if get is None:
        return None  # a Ray without the API
    info = get()
    if info is None:
        return None
    if info.deadline_ms is None:
        return float("inf")  # announced without a deadline: the grace period applies
    return max(0.0, float(info.deadline_ms) / 1000.0 - time.time())


def create_run_ledger() -> Any:
    """A Ray actor that outlives the run's worker groups: their start count and rank 0's last report.

    Created by the driver, on the driver's node (so it lives as long as the run), passed to the workers
    in `train_loop_config["run_ledger"]`. Rank 0 of each new group takes the next generation number and
    broadcasts it (Ray Train has no public restart count), so drill faults aimed at generation 0 fire
    once and a restarted group is generation 1; when its worker ends, rank 0 leaves its
    `WorkerReport` there (`put_report`) and the driver reads the last one (`get_report`). A group that
    recovers in place finds rank 0's store there (`put_inplace` / `get_inplace`, by generation).
    """
    import ray

    class RunLedger:
        def __init__(self) -> None:
            self.generation = -1
            self.report: dict[str, Any] | None = None
            self.inplace: dict[int, dict[str, str]] = {}  # generation -> rank 0's in-place store record

        def put_inplace(self, generation: int, record: dict[str, str]) -> None:
            self.inplace[generation] = record
            for old in sorted(self.inplace)[:-MAX_KEPT_RECORDS]:
                del self.inplace[old]

        def get_inplace(self, generation: int) -> dict[str, str] | None:
            return self.inplace.get(generation)

        def next_generation(self) -> int:
            self.generation += 1
            return self.generation

        def put_report(self, report: dict[str, Any]) -> None:
            self.report = report

        def get_report(self) -> dict[str, Any] | None:
            return self.report

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On the driver's own node: an actor dies with its node, and one placed on a worker host took every
    # later group down with that host (each restart failed on it; tests/integration/test_ray_multinode.py).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor: Any = ray.remote(num_cpus=0)(RunLedger)
    return actor.options(scheduling_strategy=here).remote()


@dataclass(frozen=True)
class GroupFacts:
    """What the ranks of one Ray Train worker group agree on before training (`_agree`).

    Attributes:
        generation: The group's number (rank 0 draws it from the ledger; 0 without one).
        num_nodes: The nodes the group spans (the highest node rank + 1).
        uniform: Every node holds the same number of ranks, numbered node by node (rank // local world
            size is the node rank): in-place recovery's per-node keys assume it.
    """

    generation: int
    num_nodes: int
    uniform: bool


def _agree(ledger: Any, identity: WorkerIdentity) -> GroupFacts:
    """Rank 0 draws the generation; every rank receives it and the group's shape in one all-reduce (MAX)
    over the group Ray Train created."""
    import torch
    import torch.distributed as dist

    value = 0
    if identity.rank == 0 and ledger is not None:
        import ray

        value = int(ray.get(ledger.next_generation.remote(), timeout=LEDGER_CALL_TIMEOUT_S))
    local = identity.local_world_size
    misplaced = int(identity.rank // max(local, 1) != identity.node_rank)
    facts = [value, identity.node_rank, local, -local, misplaced]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            import ray.train.torch

            device = ray.train.torch.get_device()
        tensor = torch.tensor(facts, dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)  # only rank 0 holds a generation above 0
        facts = [int(x) for x in tensor.tolist()]
    generation, top_node, most, least, any_misplaced = facts
    return GroupFacts(generation=generation, num_nodes=top_node + 1, uniform=most == -least and not any_misplaced)


def last_committed_checkpoint(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """`{checkpoint_step, checkpoint_stores}` of the newest `checkpoint_committed` event (empty if none)."""
    best: dict[str, Any] = {}
    for event in read_events(RunFiles(run_dir).events):  # a torn last line from a killed writer is skipped
        if event.kind is not EventKind.CHECKPOINT_COMMITTED or event.step is None:
            continue
        if event.step >= int(best.get("checkpoint_step", -1)):
            best = {"checkpoint_step": event.step, "checkpoint_stores": list(event.get("stores_ok") or [])}
    return best


def _hand_over(ledger: Any, run_dir: str, result: dict[str, Any] | None) -> None:
    """Rank 0: leave its `WorkerReport` with the ledger for the driver (best effort: never fails the run)."""
    import ray

    try:
        report = WorkerReport.collect(run_dir, result=Result.from_dict(result) if result is not None else None)
        ray.get(ledger.put_report.remote(report.to_dict()), timeout=LEDGER_CALL_TIMEOUT_S)
    except Exception as exc:  # the driver then summarizes from its own run directory only
        print(f"torchrig: rank 0 could not hand its result to the driver: {exc!r}", file=sys.stderr)


class TrainerExit(RuntimeError):
    """A hosted rank ended with a code in-place recovery does not take back (`training.inplace.host`): a
    failure Ray Train's `FailureConfig` answers with a group restart (or ends the run, none left).

    Attributes:
        rank: The rank.
        code: Its host's exit status (`training.contract.ExitCode`).
    """

    def __init__(self, rank: int, code: int) -> None:
        super().__init__(rank, code)  # the arguments, not a message: Ray pickles it to its controller
        self.rank = rank
        self.code = code

    def __str__(self) -> str:
        return f"rank {self.rank}: its trainer ended with exit code {self.code} and was not recovered in place"


def _open_store() -> tuple[Any, dict[str, str]]:
    """Rank 0: the in-place store (a `TCPStore` server in this actor, at this node's address) and the record
    the other ranks find it by: its address and the secret every order in it is signed with. The job's
    own secret when the launch mounted one (a KubeRay pod's `Env.JOB_SECRET_FILE`), else a new one for
    this worker group."""
    import ray
    from torch._C._distributed_c10d import TCPStore

    try:
        secret = load_job_secret()
    except SecretError as exc:
        log.warning("in-place on Ray: the job's secret is unusable (%s); this worker group makes its own", exc)
        secret = None
    if secret is None:
        secret = secrets.token_bytes(SECRET_BYTES)
    node_address: Callable[[], str] = ray.util.get_node_ip_address  # untyped in Ray's stubs
    host = node_address()
    # The server accepts anyone who reaches the node; what it holds is only acted on when signed.
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    return store, {"addr": f"{host}:{store.port}", "secret": secret.hex()}


def _await_record(ledger: Any, generation: int) -> dict[str, str]:
    """The other ranks: rank 0's store record for `generation`, checked (it crossed a process boundary)."""
    import ray

    deadline = time.monotonic() + INPLACE_RECORD_WAIT_S
    while True:
        record = ray.get(ledger.get_inplace.remote(generation), timeout=LEDGER_CALL_TIMEOUT_S)
        if record is not None:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 published no in-place store for worker group {generation}")
        time.sleep(0.05)
    addr, secret = record.get("addr") if isinstance(record, dict) else None, record.get("secret")
    host, _, port = str(addr).rpartition(":")
    hex_ok = isinstance(secret, str) and 2 * SECRET_BYTES <= len(secret) <= 8192
    if not (host and port.isdigit() and 0 < int(port) < 65536 and hex_ok):
        raise RuntimeError(f"the in-place store record of worker group {generation} is malformed")
    return {"addr": str(addr), "secret": str(secret)}


def _write_private(path: str, data: bytes) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return path


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """`values` in this actor's environment (its host's children inherit it), as before afterwards."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _host_env(identity: WorkerIdentity, job: str, record: dict[str, str], files: dict[str, str]) -> dict[str, str]:
    """The launcher's variables torchrun would give a rank's host (`training.inplace.InPlace.from_spec`,
    `WorkerIdentity.from_env`), for this Ray Train worker. The group's number names its key space
    (`Env.INPLACE_ROUND`), so every worker group starts on fresh keys, whatever the nodes."""
    return {
        Env.SPEC: files["spec"],
        Env.JOB_SECRET_FILE: files["secret"],
        Env.INPLACE_STORE: record["addr"],
        Env.INPLACE_ROUND: f"ray-{identity.generation}",
        Env.RUN_ID: f"ray-{job}"[:128],
        Env.RESTART_COUNT: str(identity.generation),
        Env.RANK: str(identity.rank),
        Env.WORLD_SIZE: str(identity.world_size),
        Env.LOCAL_RANK: str(identity.local_rank),
        Env.LOCAL_WORLD_SIZE: str(identity.local_world_size),
        Env.GROUP_RANK: str(identity.node_rank),
        Env.GROUP_WORLD_SIZE: str(identity.num_nodes),
    }


class _DrainToSignal:
    """Ray's drain notice for this worker's node (Ray Train's `PreemptionContext`, read locally: the public
    `get_preemption_info` is a barrier of every worker, which a host watching its trainer cannot join)
    sent as a SIGTERM to this process once the host forwards signals to its trainer.

    `install` is the host's `on_main_thread`: it records the actor's handlers (Ray's own) before the host
    replaces them, and `close` puts them back once no SIGTERM can be sent any more (under the lock, so
    a SIGTERM sent is handled by the host's forwarder, never by Ray's handler, which exits at once).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed = False
        self._closed = threading.Event()
        self._saved: dict[int, Any] = {}
        self._thread = threading.Thread(target=self._watch, name="torchrig-ray-drain", daemon=True)

    def install(self, fn: Callable[[], None]) -> None:
        def save_and_run() -> None:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
                self._saved[sig] = signal.getsignal(sig)
            fn()

        run_on_actor_main_thread(save_and_run)
        with self._lock:
            self._armed = True
        self._thread.start()

    def _watch(self) -> None:
        while not self._closed.wait(DRAIN_POLL_S):
            if _drain_announced():
                with self._lock:
                    if self._armed:
                        print("torchrig: Ray drains this node: stopping the trainer", file=sys.stderr, flush=True)
                        os.kill(os.getpid(), signal.SIGTERM)  # the host's forwarder: an emergency checkpoint
                return

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            armed, self._armed = self._armed, False
        if not armed:
            return

        def restore() -> None:
            for sig, handler in self._saved.items():
                if handler is not None:
                    signal.signal(sig, handler)

        run_on_actor_main_thread(restore)


def _drain_announced() -> bool:
    """Whether Ray Train announced a drain of a node of this worker group (False on a Ray without it)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info is not None
    except Exception:  # another Ray layout, or no train context: only signals stop the trainer then
        return False


def _run_hosted(
    spec_yaml: str, run_dir: str, identity: WorkerIdentity, ledger: Any, keep: contextlib.ExitStack
) -> dict[str, Any] | None:
    """Be this rank's in-place host (the module docstring); rank 0's result.json ({} on the other ranks),
    or None when the job turns out not to recover in place (`InPlace.from_spec`, alike on every rank).
    `keep` holds rank 0's store until the caller's final report: the other ranks' trainers may need it
    until then."""
    import ray

    from training.config import load_worker_spec
    from training.inplace import InPlace
    from training.inplace.host import run_host

    spec = load_worker_spec(spec_yaml)
    if identity.rank == 0:
        store, record = _open_store()
        keep.callback(lambda: store)  # referenced until the report: the server lives as long
        ray.get(ledger.put_inplace.remote(identity.generation, record), timeout=LEDGER_CALL_TIMEOUT_S)
    else:
        record = _await_record(ledger, identity.generation)
    folder = tempfile.mkdtemp(prefix="torchrig-ray-")  # 0700: the secret's file is this user's only
    try:
        files = {
            "spec": _write_private(os.path.join(folder, "job.yaml"), spec_yaml.encode()),
            "secret": _write_private(os.path.join(folder, SECRET_FILE), bytes.fromhex(record["secret"])),
        }
        with _environ(_host_env(identity, spec.name, record, files)):
            inplace = InPlace.from_spec(spec)
            if inplace is None:
                return None
            drain = _DrainToSignal()
            try:
                code = run_host(inplace, ["--spec", files["spec"], "--run-dir", run_dir], on_main_thread=drain.install)
            finally:
                drain.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if code != 0:
        raise TrainerExit(identity.rank, code)
    result = Result.read(RunFiles(run_dir).result) if identity.rank == 0 else None
    return result.to_dict() if result is not None else {}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry of one rank.

    Args:
        config: `spec_yaml` (the resolved job file's text), `run_dir` (absolute; shared by the ranks of
            one node), `run_ledger` (optional actor from `create_run_ledger`), and `store_uris`
            (`{name: resolved uri}` of the checkpoint stores, reported as metrics).
    """
    import ray.train

    from training.config import load_worker_spec
    from training.worker import run_worker

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    world_size = ctx.get_world_size()
    local_world_size = ctx.get_local_world_size()
    ledger = config.get("run_ledger")
    identity = WorkerIdentity(
        rank=rank,
        world_size=world_size,
        local_rank=ctx.get_local_rank(),
        local_world_size=local_world_size,
        node_rank=ctx.get_node_rank(),
        num_nodes=max(1, -(-world_size // max(local_world_size, 1))),
    )
    facts = _agree(ledger, identity)
    generation = facts.generation
    identity = dataclasses.replace(identity, generation=generation, num_nodes=facts.num_nodes)
    run_dir = str(config["run_dir"])
    os.environ[Env.RUN_DIR] = run_dir
    spec_yaml = str(config["spec_yaml"])
    spec = load_worker_spec(spec_yaml)
    # Rank 0's in-place store (`_run_hosted`) lives until every rank has reported.
    with contextlib.ExitStack() as keep:
        result: dict[str, Any] | None = None
        try:
            hosted = spec.spec.restarts.in_place and world_size >= 2 and ledger is not None
            if hosted and not facts.uniform:
                log.warning("in-place recovery is off on Ray: the nodes hold different numbers of ranks")
                hosted = False
            if hosted:
                result = _run_hosted(spec_yaml, run_dir, identity, ledger, keep)
            if result is None:
                result = run_worker(
                    spec,
                    run_dir=run_dir,
                    identity=identity,
                    on_main_thread=run_on_actor_main_thread,
                    preemption_notice=ray_drain_notice,
                )
        finally:
            if rank == 0 and ledger is not None:  # also when training raised: the restores and commits so far
                _hand_over(ledger, run_dir, result or None)
        metrics: dict[str, Any] = {key: value for key, value in result.items() if isinstance(value, (int, float, str))}
        metrics.update({f"eval_{k}": v for k, v in (result.get("eval") or {}).items()})
        metrics["generation"] = generation
        checkpoint = last_committed_checkpoint(run_dir)
        stores: dict[str, str] = dict(config.get("store_uris") or {})
        if checkpoint:
            metrics["checkpoint_step"] = checkpoint["checkpoint_step"]
            names = checkpoint["checkpoint_stores"] or list(stores)
            metrics["checkpoint_uris"] = ",".join(stores.get(name, name) for name in names)
        # Every rank reports once (the call is a barrier); metrics only, no Ray Checkpoint.
        ray.train.report(metrics)
