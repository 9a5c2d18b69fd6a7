"""Running a job with Ray Train: `run_ray_train` (on whatever Ray this process is connected to) and
`RayLocalRun`, an embedded single-node Ray run supervised from this process.

The run directory gets the same files as a local run (job.yaml, metrics.jsonl, events.jsonl,
result.json, summary.json, supervisor.json while it runs). When it is not rank 0's (a RayJob: the
driver on the head, rank 0 on a worker pod, each with its own emptyDir), rank 0's result and the events
the summary needs come through Ray (`training.contract.WorkerReport`) and are written into it first.

Recovery: a job that recovers in place (`restarts.in_place`) does so under Ray as well: each Ray Train
worker is its rank's host and a warm spare takes a dead trainer's place without Ray seeing it
(`training.ray_train`). Everything else (a lost worker actor or node, a fallback from in place, every
failure with `restarts.mode: restart`) is Ray Train's: it restarts the whole worker group up to
`restarts.max` times, and every new group restores the newest committed torchrig checkpoint (the
checkpoint manager is the source of truth, Ray holds no copy). The controller's health-check poll is set
to 0.2 s: with the 2 s default a killed worker was noticed late and the run resumed from an older
checkpoint (ENVIRONMENT.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.backends._local_procs import kill_pids, process_start_ticks
from orchestrator.backends._local_view import LiveProgress, QuietView, RunView
from orchestrator.backends.base import RunState, SubmitOptions
from orchestrator.backends.ray_embedded import RAY_AUTH_MODE, embedded_ray
from orchestrator.errors import BackendError, FinalCheckpointLost, RestartsExhausted, UnsupportedFeature
from orchestrator.spec import JobSpec, parse_quantity
from training.contract import Env, EventKind, RunFiles, Summary, WorkerReport, read_events, write_json

__all__ = [
    "RAY_ENV_DEFAULTS",
    "RayLocalRun",
    "apply_ray_env",
    "local_num_cpus",
    "process_tree",
    "ray_hosts",
    "run_ray_train",
    "worker_env",
]

# Set for the driver and propagated by Ray Train to its controller and workers. Not the auth mode: a
# driver inside a cluster (the RayJob entry) follows the cluster's, and an embedded Ray gets its own
# token (`embedded_ray`).
RAY_ENV_DEFAULTS = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",  # notice a dead worker fast (see the module docstring)
}
_FORWARDED_ENV = (Env.FAULTS, Env.METRICS_BIND, Env.DISABLE_SHARED_RDZV_STORE)
DEFAULT_GRACE_S = 10.0


def apply_ray_env() -> None:
    """Ray's settings for this driver (and, through Ray Train, its controller and workers)."""
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def worker_env(spec: JobSpec, options: SubmitOptions, run_dir: str | None) -> dict[str, str]:
    """The environment of every Ray Train worker: the backend -> worker contract plus drill faults."""
    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    env.setdefault(Env.METRICS_BIND, spec.spec.metrics.bind_address or "127.0.0.1")
    env.update({k: v for k, v in RAY_ENV_DEFAULTS.items() if k.startswith("RAY_TRAIN_")})
    if run_dir is not None:
        env[Env.RUN_DIR] = run_dir
    env.update(options.env)
    return env


def local_num_cpus(spec: JobSpec) -> int:
    """Logical CPUs of the embedded Ray: enough for every worker's request, at least the machine's."""
    per_worker = max(1.0, float(parse_quantity(spec.spec.resources.cpu)) / spec.spec.procs_per_node)
    needed = int(per_worker * spec.spec.max_world_size + 0.999)
    return max(os.cpu_count() or 1, needed)


def ray_train_summary(
    spec: JobSpec,
    run_dir: str | os.PathLike[str],
    *,
    env: dict[str, str] | None = None,
    fixed_size: bool = False,
    storage_path: str | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    cancel_reason: Callable[[], str] = lambda: "cancelled by the user",
) -> Summary:
    """Run the job with Ray Train on the Ray this process is connected to; write and return its summary.

    A training failure is a `failed` summary, not an exception; when `cancelled()` is true by the time
    the run ends, the summary says `cancelled`.
    """
    import importlib

    import ray
    from ray.train.torch import TorchTrainer

    from orchestrator.compile.raytrain import compile_raytrain
    from orchestrator.loader import dump_spec
    from training.ray_train import create_run_ledger, train_loop_per_worker

    # Ray Train v2's config classes (the default in Ray >= 2.50); typed Any because ray.train's stubs
    # describe the v1 classes it exports when v2 is switched off.
    train: Any = importlib.import_module("ray.train")

    root = Path(run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    files = RunFiles(root)
    spec_text = dump_spec(spec)
    files.job.write_text(spec_text)
    plan = compile_raytrain(spec, fixed_size=fixed_size)
    env = dict(env or {})
    env.setdefault(Env.RUN_DIR, str(root))
    stores = {s.display_name: s.resolved_uri(str(root)) for s in spec.spec.checkpoint.stores}
    ledger = create_run_ledger()
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "spec_yaml": spec_text,
            "run_dir": str(root),
            "run_ledger": ledger,
            "store_uris": stores,
        },
        scaling_config=train.ScalingConfig(**plan.scaling.kwargs()),
        run_config=train.RunConfig(
            name=plan.run.name,
            storage_path=storage_path or str(files.ray_storage),
            failure_config=train.FailureConfig(max_failures=plan.failure.max_failures),
            checkpoint_config=train.CheckpointConfig(num_to_keep=plan.checkpoint.num_to_keep),
            worker_runtime_env={"env_vars": env},
        ),
    )
    start, since = time.monotonic(), time.time()
    state, reason = RunState.SUCCEEDED, None
    try:
        if not cancelled():  # a stop that came while Ray was starting
            trainer.fit()
    except KeyboardInterrupt:
        state, reason = RunState.CANCELLED, "interrupted"
        raise
    except Exception as exc:  # Ray wraps worker failures in TrainingFailedError; any failure ends the run
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        state = RunState.FAILED
        reason = f"ray: the run failed after at most {spec.spec.restarts.max} restarts ({type(exc).__name__}: {first})"
    finally:
        if cancelled():
            state, reason = RunState.CANCELLED, cancel_reason()
        _write_worker_report(ledger, root)
        address = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
        summary = write_ray_summary(
            spec, root, state=state, reason=reason, wall_s=time.monotonic() - start, since=since, address=address
        )
    return summary


def write_ray_summary(
    spec: JobSpec,
    root: Path,
    *,
    state: RunState,
    reason: str | None,
    wall_s: float,
    since: float | None,
    address: str | None,
) -> Summary:
    """Build a Ray run's summary from its run directory and write it (with the Ray it ran on)."""
    from orchestrator.rundir import build_summary

    summary = build_summary(
        root,
        status=state.value,
        wall_s=wall_s,
        stores=[{"name": s.display_name, "uri": s.resolved_uri(str(root))} for s in spec.spec.checkpoint.stores],
        total_steps=spec.spec.training.steps,
        reason=reason,
        cancel_wins=True,  # the cancel's Ray shutdown SIGTERMs the workers: still the user's cancel
        since=since,  # a resubmit reuses the run directory: an earlier attempt's result is not this one's
    )
    auth = os.environ.get(RAY_AUTH_MODE, "unset")  # what this driver's Ray runs with (`embedded_ray`)
    write_json(
        RunFiles(root).summary, {**summary.to_dict(), "backend": "ray", "ray_address": address, "ray_auth": auth}
    )
    return summary


def _write_worker_report(ledger: Any, root: Path) -> None:
    """Rank 0's last `WorkerReport` into the run directory, unless it is rank 0's own (it has result.json)."""
    import ray

    from training.ray_train import LEDGER_CALL_TIMEOUT_S

    if not ray.is_initialized():  # a cancelled run's Ray is shut down: the directory has what it has
        return
    try:
        data = ray.get(ledger.get_report.remote(), timeout=LEDGER_CALL_TIMEOUT_S)
    except Exception:  # Ray going down under a stop(); the summary is built from the directory alone
        return
    if isinstance(data, dict):
        WorkerReport.from_dict(data).write_into(root)


def run_ray_train(
    spec: JobSpec,
    run_dir: str | os.PathLike[str],
    *,
    env: dict[str, str] | None = None,
    fixed_size: bool = False,
    storage_path: str | None = None,
) -> Summary:
    """Run the job with Ray Train on the Ray this process is connected to (the in-cluster entry).

    Writes job.yaml before and summary.json after the run into `run_dir`.

    Args:
        spec: The validated job.
        run_dir: The run directory (made absolute; shared by the ranks of a node).
        env: Extra worker environment (drill faults, metrics bind address).
        fixed_size: Run an elastic spec at its maximum size.
        storage_path: Ray Train's storage (default: `<run_dir>/ray`).

    Returns:
        The summary (also written to summary.json).

    Raises:
        RestartsExhausted: The run failed after exhausting `restarts.max` restarts.
        FinalCheckpointLost: Every step ran but no store committed the final checkpoint.
    """
    summary = ray_train_summary(spec, run_dir, env=env, fixed_size=fixed_size, storage_path=storage_path)
    if summary.status == RunState.FAILED.value:
        failure = FinalCheckpointLost if summary.final_checkpoint_lost() else RestartsExhausted
        raise failure(f"{summary.reason}; see {RunFiles(Path(run_dir).resolve()).summary}")
    return summary


class RayLocalRun:
    """An embedded-Ray run in a background thread of this process (a `SupervisedRun`).

    Ray Train's driver (`TorchTrainer.fit`) runs in-process, so this run lives as long as the process
    that launched it: `torchrig run --backend ray` and the drills wait for it; `torchrig submit` gives
    it a detached supervisor process of its own (`orchestrator.backends.supervise`). If no Ray is
    initialized in this process, the run starts a single-node Ray pinned to 127.0.0.1 and shuts it
    down at the end; otherwise it runs on the Ray this process already joined.

    Stopping the run (`stop`, `request_cancel`, a `wait` timeout) shuts down the Ray the run started:
    Ray Train offers no abort from outside the driver's main thread. A run on a Ray that someone
    else initialized cannot be stopped from here (`stop` raises UnsupportedFeature).
    """

    def __init__(self, spec: JobSpec, options: SubmitOptions, run_dir: Path, num_cpus: int) -> None:
        self.spec = spec
        self._run_dir = run_dir
        self.summary: Summary | None = None
        self.error: BaseException | None = None
        self._options = options
        self._num_cpus = num_cpus
        self._cancel_requested = False
        self._cancel_reason = "cancelled by the user"
        self._force = False
        self._owns_ray: bool | None = None  # decided by the driver thread: did it start this process's Ray?
        self._started = (time.monotonic(), time.time())
        run_dir.mkdir(parents=True, exist_ok=True)
        files = RunFiles(run_dir)
        write_json(
            files.supervisor,
            {
                "pid": os.getpid(),
                "start_ticks": process_start_ticks(os.getpid()),
                "started_at": time.time(),
                "backend": "ray",
            },
        )
        self._thread = threading.Thread(target=self._main, name="torchrig-ray", daemon=True)
        self._thread.start()

    @property
    def run_dir(self) -> Path:
        return self._run_dir

    def _main(self) -> None:
        import ray

        try:
            apply_ray_env()
            self._owns_ray = not ray.is_initialized()
            started = (
                embedded_ray(self._num_cpus, log_to_driver=not self._options.quiet)
                if self._owns_ray
                else contextlib.nullcontext()
            )
            with started:
                env = worker_env(self.spec, self._options, str(self._run_dir.resolve()))
                self.summary = ray_train_summary(
                    self.spec,
                    self._run_dir,
                    env=env,
                    fixed_size=self._options.fixed_size,
                    cancelled=lambda: self._cancel_requested,
                    cancel_reason=lambda: self._cancel_reason,
                )
        except BaseException as exc:  # reported through wait(); the thread must not die silently
            self.error = exc

    def poll(self) -> RunState:
        """RUNNING while the driver thread runs; then the summary's status."""
        if self._thread.is_alive():
            return RunState.RUNNING
        return RunState(self._final_summary().status)

    def wait(self, timeout_s: float | None = None, *, view: RunView | None = None, interval_s: float = 0.25) -> Summary:
        """Supervise until the run ends (cancelling it on `request_cancel` or when `timeout_s` passes)."""
        view = view or QuietView(LiveProgress(self._run_dir, self.spec.spec.training.steps), [])
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        view.start()
        try:
            while self._thread.is_alive():
                view.refresh()
                timed_out = deadline is not None and time.monotonic() > deadline
                if self._cancel_requested or timed_out:
                    try:
                        self.stop(0.0 if self._force else DEFAULT_GRACE_S)
                    except UnsupportedFeature as exc:
                        why = f"did not finish within {timeout_s} s" if timed_out else "was not cancelled"
                        raise BackendError(f"the Ray run {why}: {exc}; see {self._run_dir}") from None
                    break
                self._thread.join(interval_s)
        finally:
            view.stop()
        return self._final_summary()

    def _final_summary(self) -> Summary:
        if self.summary is not None:
            return self.summary
        files = RunFiles(self._run_dir)
        summary = Summary.read(files.summary)
        if summary is None:  # the driver died before it could write one (or is stuck after a stop)
            state = RunState.CANCELLED if self._cancel_requested else RunState.FAILED
            reason = repr(self.error) if self.error is not None else "the Ray driver wrote no summary"
            summary = Summary(status=state.value, run_dir=str(self._run_dir), reason=reason)
            summary.write(files.summary)
        elif self.error is not None and summary.reason is None:
            summary.reason = repr(self.error)
        self.summary = summary
        return summary

    def request_cancel(self, reason: str = "cancelled by the user") -> None:
        """Signal-safe: ask `wait` to stop the run (a second call skips the grace period)."""
        if self._cancel_requested:
            self._force = True
        else:
            self._cancel_reason = reason
        self._cancel_requested = True

    def stop(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        """Cancel the run: shut down the Ray it started (the driver thread then writes a `cancelled`
        summary); wait up to `grace_s` + 30 s for the driver to finish.

        Raises:
            UnsupportedFeature: the run joined a Ray that this process had initialized before it.
        """
        import ray

        self._cancel_requested = True  # a driver still starting Ray sees it and skips training
        if self._thread.is_alive() and self._owns_ray is False:
            raise UnsupportedFeature(
                "stopping a Ray Train run on a Ray this process did not start for it (Ray Train has no "
                "abort from outside the driver's main thread)"
            )
        if self._thread.is_alive() and self._owns_ray:
            # Written first: when the driver thread touches Ray after the shutdown, Ray's core worker may
            # end this whole process ("The core worker has already been shutdown ... The process will
            # exit") before the thread writes its own. The thread's summary, when it comes, replaces it.
            self._write_cancelled_summary()
            ray.shutdown()
        self._thread.join(grace_s + 30.0)

    def _write_cancelled_summary(self) -> None:
        # A run directory that went away leaves the thread's own summary as all there can be.
        with contextlib.suppress(OSError):
            write_ray_summary(
                self.spec,
                self._run_dir.resolve(),
                state=RunState.CANCELLED,
                reason=self._cancel_reason,
                wall_s=time.monotonic() - self._started[0],
                since=self._started[1],
                address=None,
            )

    def host_pids(self, node: int | None = None) -> list[int]:
        """The live Ray Train worker processes of emulated node `node` (None: of every node) in the newest
        worker group (`ray_hosts`)."""
        return ray_hosts(self._run_dir, self.spec.spec.procs_per_node, node)

    def kill_node(self, node: int) -> list[int]:
        """Lose emulated node `node` like a machine dying: SIGKILL its Ray Train workers with their process
        trees (trainers, warm spares). Ray Train's `FailureConfig` restarts the worker group from the newest
        committed checkpoint; on this one machine the node's CPUs come back at once, so an elastic job
        restarts at the size they allow (its full size, here). Returns the pids killed.

        Raises:
            BackendError: No live worker of that node.
        """
        hosts = self.host_pids(node)
        if not hosts:
            raise BackendError(f"node {node}: no live Ray Train worker of its ranks in {self._run_dir}")
        pids = sorted({pid for host in hosts for pid in process_tree(host)})
        kill_pids(pids, signal.SIGKILL)
        return pids

    def add_node(self) -> int:
        raise UnsupportedFeature(
            "add a node: the embedded Ray is one machine whose CPUs a lost node never took away; on a Ray "
            "cluster Ray Train's elastic resize takes in a node that joins (ScalingConfig(num_workers=(min, max)))"
        )


def ray_hosts(run_dir: str | os.PathLike[str], procs_per_node: int, node: int | None = None) -> list[int]:
    """The live Ray Train worker processes of a run's newest worker group on this machine, of emulated node
    `node` (the ranks `r` with `r // procs_per_node == node`; None: every rank).

    Each worker is its rank's host (`training.ray_train`): the parent of the trainer a `start` event of the
    run directory names, or that trainer itself when it trains in the worker (`restarts.mode: restart`).
    Only a process that Ray titled as one of its workers (`ray::`) is returned: a stale or forged pid in
    the run directory never names another process of the machine.
    """
    newest: dict[int, tuple[float, int]] = {}
    for event in read_events(RunFiles(run_dir).events):
        pid = event.get("pid")
        if event.kind is not EventKind.START or event.rank is None or not isinstance(pid, int):
            continue
        if node is not None and event.rank // max(procs_per_node, 1) != node:
            continue
        if event.rank not in newest or event.time >= newest[event.rank][0]:
            newest[event.rank] = (event.time, pid)
    hosts = {_ray_worker_of(pid) for _, pid in newest.values()}
    return sorted(pid for pid in hosts if pid is not None)


def _ray_worker_of(trainer: int) -> int | None:
    """The Ray worker process that hosts `trainer` (its parent when it is a `python -m training` child),
    or None when that is no Ray worker (gone, or the pid is not one of this run's)."""
    host = trainer
    if b"-m\x00training\x00" in _cmdline(trainer):
        host = _parent(trainer) or 0
    return host if host > 1 and host != os.getpid() and _cmdline(host).startswith(b"ray::") else None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2 :].split()[1])  # the 4th field; the name may hold ')'


def process_tree(root: int) -> list[int]:
    """`root` and every live descendant of it (from /proc), parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (parent := _parent(int(entry))) is not None:
            children.setdefault(parent, []).append(int(entry))
    tree, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        tree.append(pid)
        queue.extend(children.get(pid, []))
    return tree
