"""The Ray backend: the torchrig worker under Ray Train's `TorchTrainer`.

Two ways to run:

- no address (`torchrig run JOB.yaml --backend ray`): starts an embedded single-node Ray pinned to
  127.0.0.1 and runs the job in the foreground; the run directory gets the same files as a local
  run (job.yaml, metrics.jsonl, events.jsonl, result.json, summary.json).
- `--address http://HOST:8265` (or `spec.ray.address`): submits through the Ray Jobs API, shipping
  the working directory (without .venv, runs, .git) plus the resolved spec as `job.yaml` at its
  root; the entrypoint `python -m orchestrator.backends.ray_entry --spec job.yaml` runs the same
  code on the cluster. Run ids are `ray://HOST:PORT/<submission_id>`; local runs are `ray://<run dir>`.

Recovery: Ray Train restarts the whole worker group up to `restarts.max` times; every new group
restores the newest committed torchrig checkpoint (the checkpoint manager is the source of truth, Ray
holds no copy). The controller's health-check poll is set to 0.2 s: with the 2 s default a killed
worker was noticed late and the run resumed from an older checkpoint (ENVIRONMENT.md).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from orchestrator.backends.base import Backend, Capabilities, DryRun, RunHandle, RunState, RunStatus, SubmitOptions
from orchestrator.errors import BackendError, RecoveryFailed, SpecError, UnsupportedFeature
from orchestrator.spec import JobSpec, parse_quantity

__all__ = [
    "ENTRYPOINT",
    "RAY_ENV_DEFAULTS",
    "WORKING_DIR_EXCLUDES",
    "RayBackend",
    "run_ray_train",
]

ENTRYPOINT = "python -m orchestrator.backends.ray_entry --spec job.yaml"
WORKING_DIR_EXCLUDES = [".venv", "runs", ".git", "__pycache__", "*.pyc", ".mypy_cache", ".ruff_cache", ".pytest_cache"]
# Set for the driver and propagated by Ray Train to its controller and workers.
RAY_ENV_DEFAULTS = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",  # else Ray writes ~/.ray/auth_token
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",  # notice a dead worker fast (see the module docstring)
}
_FORWARDED_ENV = ("TORCHRIG_FAULTS", "TORCHRIG_METRICS_BIND", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


def _apply_ray_env() -> None:
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def _store_uris(spec: JobSpec, run_dir: str) -> dict[str, str]:
    return {s.display_name: s.resolved_uri(run_dir) for s in spec.spec.checkpoint.stores}


def _worker_env(spec: JobSpec, options: SubmitOptions, run_dir: str | None) -> dict[str, str]:
    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    env.setdefault("TORCHRIG_METRICS_BIND", spec.spec.metrics.bind_address or "127.0.0.1")
    env.update({k: v for k, v in RAY_ENV_DEFAULTS.items() if k.startswith("RAY_TRAIN_")})
    if run_dir is not None:
        env["TORCHRIG_RUN_DIR"] = run_dir
    env.update(options.env)
    return env


def run_ray_train(
    spec: JobSpec,
    run_dir: str | os.PathLike[str],
    *,
    env: dict[str, str] | None = None,
    fixed_size: bool = False,
    storage_path: str | None = None,
) -> dict[str, Any]:
    """Run the job with Ray Train on the Ray this process is connected to (or a new local one).

    Writes job.yaml before and summary.json after the run into `run_dir`.

    Args:
        spec: the validated job.
        run_dir: the run directory (made absolute; shared by the ranks of a node).
        env: extra worker environment (drill faults, metrics bind address).
        fixed_size: run an elastic spec at its maximum size.
        storage_path: Ray Train's storage (default: `<run_dir>/ray`).

    Returns:
        The summary (also written to summary.json).

    Raises:
        RecoveryFailed: the run failed after exhausting `restarts.max` restarts.
    """
    import importlib

    import ray
    from ray.train.torch import TorchTrainer

    # Ray Train v2's config classes (the default in Ray >= 2.50); typed Any because ray.train's stubs
    # describe the v1 classes it exports when v2 is switched off.
    train: Any = importlib.import_module("ray.train")

    from orchestrator.backends._local_rundir import RunFiles, build_summary, write_json
    from orchestrator.compile.raytrain import compile_raytrain
    from orchestrator.loader import dump_spec
    from training.ray_train import create_generation_counter, train_loop_per_worker

    root = Path(run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    files = RunFiles(root)
    spec_text = dump_spec(spec)
    files.job.write_text(spec_text)
    plan = compile_raytrain(spec, fixed_size=fixed_size)
    env = dict(env or {})
    env.setdefault("TORCHRIG_RUN_DIR", str(root))
    stores = _store_uris(spec, str(root))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "spec_yaml": spec_text,
            "run_dir": str(root),
            "generation_counter": create_generation_counter(),
            "store_uris": stores,
        },
        scaling_config=train.ScalingConfig(**plan.scaling.kwargs()),
        run_config=train.RunConfig(
            name=plan.run.name,
            storage_path=storage_path or str(root / "ray"),
            failure_config=train.FailureConfig(max_failures=plan.failure.max_failures),
            checkpoint_config=train.CheckpointConfig(num_to_keep=plan.checkpoint.num_to_keep),
            worker_runtime_env={"env_vars": env},
        ),
    )
    start = time.monotonic()
    status, reason = "succeeded", None
    try:
        trainer.fit()
    except KeyboardInterrupt:
        status, reason = "cancelled", "interrupted"
        raise
    except Exception as exc:  # Ray wraps worker failures in TrainingFailedError; any failure ends the run
        status, reason = "failed", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    finally:
        summary = build_summary(
            root,
            status=status,
            wall_s=time.monotonic() - start,
            stores=[{"name": n, "uri": u} for n, u in stores.items()],
            total_steps=spec.spec.training.steps,
            reason=reason,
        )
        summary["backend"] = "ray"
        summary["ray_address"] = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
        write_json(files.summary, summary)
    if status == "failed":
        raise RecoveryFailed(
            f"ray: the run failed after at most {spec.spec.restarts.max} restarts ({reason}); see {files.summary}"
        )
    return summary


def _local_num_cpus(spec: JobSpec) -> int:
    """Logical CPUs of the embedded Ray: enough for every worker's request, at least the machine's."""
    per_worker = max(1.0, float(parse_quantity(spec.spec.resources.cpu)) / spec.spec.procs_per_node)
    needed = int(per_worker * spec.spec.max_world_size + 0.999)
    return max(os.cpu_count() or 1, needed)


def _split_run_id(run_id: str) -> tuple[str | None, str]:
    """`HOST:PORT/<submission>` -> (http://HOST:PORT, submission); a run dir -> (None, dir)."""
    text = run_id.removeprefix("ray://")
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            host, _, sub = text[len(scheme) :].partition("/")
            return scheme + host, sub
    head, _, rest = text.partition("/")
    if ":" in head and rest and not Path(text).exists():
        return f"http://{head}", rest
    return None, text


class RayBackend(Backend):
    """Ray Train backend (embedded local Ray, or an existing cluster through the Jobs API)."""

    name: ClassVar[str] = "ray"
    capabilities: ClassVar[Capabilities] = Capabilities(elastic=True, multi_node=True, gpus=True)

    def __init__(self, address: str | None = None) -> None:
        self.address = address or os.environ.get("RAY_ADDRESS") or None

    def _address(self, spec: JobSpec, options: SubmitOptions) -> str | None:
        address = options.address or spec.spec.ray.address
        if address and not address.startswith(("http://", "https://")):
            raise SpecError(f"--address: {address!r} must be the Jobs API address, e.g. http://127.0.0.1:8265")
        return address

    def _dry_run(self, spec: JobSpec, options: SubmitOptions) -> dict[str, Any]:
        from orchestrator.compile.raytrain import compile_raytrain

        plan = compile_raytrain(spec, fixed_size=options.fixed_size)
        address = self._address(spec, options)
        request: dict[str, Any] = {"plan": plan.to_dict()}
        if address:
            request["jobs_api"] = {
                "address": address,
                "entrypoint": ENTRYPOINT,
                "runtime_env": self._runtime_env(spec, options, working_dir="<staged copy of the working directory>"),
            }
        else:
            request["local"] = {
                "num_cpus": _local_num_cpus(spec),
                "node_ip_address": "127.0.0.1",
                "run_dir": options.run_dir or "runs/<name>/<time>",
                "env": _worker_env(spec, options, options.run_dir),
            }
        return request

    def _runtime_env(self, spec: JobSpec, options: SubmitOptions, working_dir: str) -> dict[str, Any]:
        runtime_env: dict[str, Any] = dict(spec.spec.ray.runtime_env)
        env_vars = dict(runtime_env.get("env_vars") or {})
        env_vars.update(_worker_env(spec, options, options.run_dir))
        runtime_env["env_vars"] = env_vars
        runtime_env["working_dir"] = working_dir
        runtime_env["excludes"] = [*runtime_env.get("excludes", []), *WORKING_DIR_EXCLUDES]
        return runtime_env

    def _schedule(self, dryrun: DryRun) -> RunHandle:
        if "jobs_api" in dryrun.request:
            return self._submit_jobs_api(dryrun)
        return self._run_local(dryrun)

    # -- embedded local Ray ----------------------------------------------------------------------
    def _run_local(self, dryrun: DryRun) -> RunHandle:
        import ray

        from orchestrator.backends._local_rundir import new_run_dir

        spec, options = dryrun.spec, dryrun.options
        run_dir = Path(options.run_dir) if options.run_dir else new_run_dir(spec.name)
        if (run_dir / "summary.json").exists():
            raise SpecError(f"--run-dir: {run_dir} holds a finished run (summary.json); choose a new directory")
        _apply_ray_env()
        started = False
        if not ray.is_initialized():
            ray.init(
                num_cpus=dryrun.request["local"]["num_cpus"],
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                log_to_driver=not options.quiet,
            )
            started = True
        try:
            env = _worker_env(spec, options, str(run_dir.resolve()))
            summary = run_ray_train(spec, run_dir, env=env, fixed_size=options.fixed_size)
        finally:
            if started:
                ray.shutdown()
        return RunHandle(self.name, str(run_dir), info={"summary": summary})

    # -- supervised background run (drills, benchmarks) -------------------------------------------
    def launch(self, spec: JobSpec, options: SubmitOptions | None = None) -> RayLocalRun:
        """Start an embedded-Ray run in a background thread; the drills watch its run directory."""
        from orchestrator.backends._local_rundir import new_run_dir

        options = options or SubmitOptions()
        dryrun = self.dry_run(spec, options)
        if "jobs_api" in dryrun.request:
            raise UnsupportedFeature("--address: drills run on an embedded local Ray, not through the Jobs API")
        run_dir = Path(options.run_dir) if options.run_dir else new_run_dir(spec.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        options.run_dir = str(run_dir)
        return RayLocalRun(self, dryrun, run_dir)

    # -- Jobs API --------------------------------------------------------------------------------
    def _jobs_client(self, address: str) -> Any:
        from ray.job_submission import JobSubmissionClient

        try:
            return JobSubmissionClient(address)
        except Exception as exc:  # ConnectionError and friends: one line, never a traceback
            raise BackendError(f"cannot reach the Ray Jobs API at {address}: {str(exc).splitlines()[0]}") from None

    def _submit_jobs_api(self, dryrun: DryRun) -> RunHandle:
        from orchestrator.loader import dump_spec

        spec, options = dryrun.spec, dryrun.options
        address = str(dryrun.request["jobs_api"]["address"])
        client = self._jobs_client(address)
        submission_id = f"torchrig-{spec.name}-{uuid.uuid4().hex[:8]}"
        with tempfile.TemporaryDirectory(prefix="torchrig-ray-") as tmp:
            # A staged copy, so the resolved spec sits at the root as job.yaml without touching the user's tree.
            staged = Path(tmp) / "working_dir"
            shutil.copytree(Path.cwd(), staged, ignore=shutil.ignore_patterns(*WORKING_DIR_EXCLUDES), symlinks=True)
            (staged / "job.yaml").write_text(dump_spec(spec))
            runtime_env = self._runtime_env(spec, options, working_dir=str(staged))
            try:
                client.submit_job(
                    entrypoint=ENTRYPOINT,
                    submission_id=submission_id,
                    runtime_env=runtime_env,
                    metadata={"torchrig.io/job": spec.name},
                )
            except Exception as exc:
                raise BackendError(f"Ray Jobs API at {address} refused the job: {str(exc).splitlines()[0]}") from None
        host = address.split("://", 1)[1].rstrip("/")
        return RunHandle(self.name, f"{host}/{submission_id}", info={"address": address})

    # -- lifecycle -------------------------------------------------------------------------------
    def _status(self, run_id: str) -> RunStatus:
        address, ident = _split_run_id(run_id)
        handle = RunHandle(self.name, run_id.removeprefix("ray://"))
        if address is None:
            from orchestrator.backends._local_rundir import read_json

            summary = read_json(Path(ident) / "summary.json")
            if summary is None:
                state = RunState.RUNNING if (Path(ident) / "job.yaml").exists() else RunState.UNKNOWN
                return RunStatus(handle, state, "no summary.json yet")
            return RunStatus(handle, RunState(summary["status"]), str(summary.get("reason", "")), details=summary)
        client = self._jobs_client(address)
        try:
            info = client.get_job_info(ident)
        except Exception as exc:
            raise BackendError(f"ray job {ident} at {address}: {str(exc).splitlines()[0]}") from None
        states = {
            "PENDING": RunState.PENDING,
            "RUNNING": RunState.RUNNING,
            "SUCCEEDED": RunState.SUCCEEDED,
            "FAILED": RunState.FAILED,
            "STOPPED": RunState.CANCELLED,
        }
        state = states.get(str(getattr(info.status, "value", info.status)), RunState.UNKNOWN)
        return RunStatus(handle, state, str(info.message or ""), details={"entrypoint": info.entrypoint})

    def _logs(self, run_id: str, rank: int | None, follow: bool) -> Iterator[str]:
        address, ident = _split_run_id(run_id)
        if address is None:
            raise BackendError(
                "logs of a local Ray run were printed by `torchrig run`; Ray keeps them under "
                "/tmp/ray/session_latest/logs (events: " + str(Path(ident) / "events.jsonl") + ")"
            )
        client = self._jobs_client(address)
        # The Jobs API serves the driver's log, which carries every worker's output (prefixed by Ray).
        marker = f"rank={rank}" if rank is not None else None
        if not follow:
            text = client.get_job_logs(ident)
            for line in str(text).splitlines():
                if marker is None or marker in line:
                    yield line
            return
        import asyncio
        import queue
        import threading

        chunks: queue.Queue[str | None] = queue.Queue()

        def _pump() -> None:
            async def _tail() -> None:
                async for chunk in client.tail_job_logs(ident):
                    chunks.put(str(chunk))

            try:
                asyncio.run(_tail())
            finally:
                chunks.put(None)

        threading.Thread(target=_pump, name="ray-log-tail", daemon=True).start()
        while (chunk := chunks.get()) is not None:
            for line in chunk.splitlines():
                if marker is None or marker in line:
                    yield line

    def _cancel(self, run_id: str) -> RunStatus:
        address, ident = _split_run_id(run_id)
        if address is None:
            raise BackendError("a local Ray run runs in the foreground of `torchrig run`: stop it with Ctrl-C")
        client = self._jobs_client(address)
        try:
            client.stop_job(ident)
        except Exception as exc:
            raise BackendError(f"stopping ray job {ident} at {address}: {str(exc).splitlines()[0]}") from None
        return self._status(run_id)

    def _list(self) -> list[RunStatus]:
        if not self.address:
            raise BackendError("ray: set RAY_ADDRESS=http://HOST:8265 to list the jobs of a Ray cluster")
        client = self._jobs_client(self.address)
        host = self.address.split("://", 1)[-1].rstrip("/")
        out: list[RunStatus] = []
        for job in client.list_jobs():
            if not job.submission_id or (job.metadata or {}).get("torchrig.io/job") is None:
                continue
            out.append(self._status(f"{host}/{job.submission_id}"))
        return out


class RayLocalRun:
    """An embedded-Ray run in a background thread, with the supervision surface of a local run."""

    def __init__(self, backend: RayBackend, dryrun: DryRun, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.summary: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(backend, dryrun), name="torchrig-ray", daemon=True)
        self._thread.start()

    def _main(self, backend: RayBackend, dryrun: DryRun) -> None:
        try:
            handle = backend._run_local(dryrun)
            self.summary = dict(handle.info.get("summary") or {})
        except BaseException as exc:  # reported through wait(); the thread must not die silently
            self.error = exc

    def poll(self) -> str | None:
        if self._thread.is_alive():
            return None
        return "succeeded" if self.error is None else "failed"

    def wait(self, timeout_s: float | None = None) -> dict[str, Any]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise BackendError(f"the Ray run did not finish within {timeout_s} s; see {self.run_dir}")
        if self.summary is None:
            path = self.run_dir / "summary.json"
            self.summary = json.loads(path.read_text()) if path.exists() else {"status": "failed"}
            if self.error is not None:
                self.summary.setdefault("reason", repr(self.error))
        return self.summary

    def kill_node(self, index: int) -> None:
        raise UnsupportedFeature("kill-node: the Ray backend runs one emulated node; use --backend local")

    def add_node(self) -> None:
        raise UnsupportedFeature("kill-node: the Ray backend runs one emulated node; use --backend local")
