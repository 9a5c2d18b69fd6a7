"""The Ray backend: the torchrig worker under Ray Train's `TorchTrainer`.

Two ways to run:

- no address: an embedded single-node Ray pinned to 127.0.0.1, with Ray's token authentication on
  (`ray_run.RayLocalRun`, `ray_embedded.embedded_ray`). `launch`
  (`torchrig run JOB.yaml --backend ray`, the drills) supervises it from the calling process;
  `schedule`/`submit` (`torchrig submit --backend ray`) return at once and leave it to a detached
  supervisor process (`supervise`), because Ray Train's driver runs inside the process that starts it.
  The run directory gets the same files as a local run. Run ids are `ray://<run dir>`.
- `--address http://HOST:8265` (or `spec.ray.address`): submits through the Ray Jobs API
  (`ray_jobs`); the entrypoint `python -m orchestrator.backends.ray_entry --spec job.yaml` runs the
  same code on the cluster. Run ids are `ray://HOST:PORT/<submission_id>`. Such a cluster's nodes are
  other machines: the remote-Ray store rules apply (`compile.checks.remote_ray_stores_problem`), a
  probe checks that the cluster can run the job before it is queued, and the run directory lives on
  the cluster (`ray_jobs.remote_run_dir`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from orchestrator.backends import ray_jobs
from orchestrator.backends._preflight import preflight_here
from orchestrator.backends.base import Backend, Capabilities, DryRun, RunHandle, RunStatus, SubmitOptions
from orchestrator.backends.ray_jobs import ENTRYPOINT, WORKING_DIR_EXCLUDES, split_run_id
from orchestrator.backends.ray_run import RAY_ENV_DEFAULTS, RayLocalRun, local_num_cpus, run_ray_train, worker_env
from orchestrator.backends.supervise import cancel_detached, start_detached
from orchestrator.errors import BackendError, SpecError, UnsupportedFeature
from orchestrator.rundir import new_run_dir, run_state
from orchestrator.spec import JobSpec
from training.contract import RunFiles

__all__ = [
    "ENTRYPOINT",
    "RAY_ENV_DEFAULTS",
    "WORKING_DIR_EXCLUDES",
    "RayBackend",
    "RayLocalRun",
    "run_ray_train",
]


class RayBackend(Backend):
    """Ray Train backend (embedded local Ray, or an existing cluster through the Jobs API)."""

    name: ClassVar[str] = "ray"
    capabilities: ClassVar[Capabilities] = Capabilities(elastic=True, multi_node=True, gpus=True, supervised=True)

    def __init__(self, address: str | None = None, *, verbose: bool = False) -> None:
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        ray_jobs.configure_logging(verbose)

    def _address(self, spec: JobSpec, options: SubmitOptions) -> str | None:
        address = options.ray.address or spec.spec.ray.address
        if address and not address.startswith(("http://", "https://")):
            raise SpecError(f"--address: {address!r} must be the Jobs API address, e.g. http://127.0.0.1:8265")
        return address

    def _dry_run(self, spec: JobSpec, options: SubmitOptions) -> dict[str, Any]:
        from orchestrator.compile.raytrain import compile_raytrain

        plan = compile_raytrain(spec, fixed_size=options.fixed_size)
        address = self._address(spec, options)
        request: dict[str, Any] = {"plan": plan.to_dict()}
        if address:
            from orchestrator.compile.checks import remote_ray_stores_warnings

            warnings = remote_ray_stores_warnings(spec, allow_node_local_stores=options.ray.allow_node_local_stores)
            working_dir = "<staged copy of the working directory>"
            submission_id = ray_jobs.new_submission_id(spec)
            request["jobs_api"] = {
                "address": address,
                "submission_id": submission_id,
                "run_dir": ray_jobs.remote_run_dir(spec, options.run_dir, submission_id),
                "entrypoint": ENTRYPOINT,
                "runtime_env": ray_jobs.runtime_env(spec, options, working_dir=working_dir),
                "probe": options.ray.probe,
                "warnings": warnings,
            }
        else:
            run_dir = str(Path(options.run_dir or new_run_dir(spec.name)).resolve())
            request["local"] = {
                "num_cpus": local_num_cpus(spec),
                "node_ip_address": "127.0.0.1",
                "auth": "token (a random token for this run's Ray, in its processes' environment only)",
                "run_dir": run_dir,
                "env": worker_env(spec, options, run_dir),
            }
        return request

    def request_from_json(self, data: Any) -> dict[str, Any]:
        """The request a detached run stored (`supervise`): plain data already."""
        return dict(data)

    def _local_run_dir(self, dryrun: DryRun) -> Path:
        if "jobs_api" in dryrun.request:
            raise UnsupportedFeature("--address: a Jobs API run is supervised by the cluster, not from this process")
        run_dir = Path(dryrun.request["local"]["run_dir"])
        if RunFiles(run_dir).summary.exists():
            raise SpecError(f"--run-dir: {run_dir} holds a finished run (summary.json); choose a new directory")
        return run_dir

    def _launch(self, dryrun: DryRun) -> RayLocalRun:
        """Start an embedded-Ray run in a background thread of this process (call `wait` on it)."""
        run_dir = self._local_run_dir(dryrun)
        preflight_here(dryrun.spec, run_dir)
        return RayLocalRun(dryrun.spec, dryrun.options, run_dir, num_cpus=int(dryrun.request["local"]["num_cpus"]))

    def _schedule(self, dryrun: DryRun) -> RunHandle:
        """Jobs API: submit and return. Embedded Ray: a detached supervisor process runs it; return at once."""
        if "jobs_api" in dryrun.request:
            jobs_api = dryrun.request["jobs_api"]
            for warning in jobs_api.get("warnings", []):
                print(f"warning: {warning}", file=sys.stderr)
            return ray_jobs.submit_job(
                dryrun.spec,
                dryrun.options,
                str(jobs_api["address"]),
                submission_id=str(jobs_api["submission_id"]),
                probe=bool(jobs_api.get("probe", True)),
            )
        run_dir = self._local_run_dir(dryrun)
        preflight_here(dryrun.spec, run_dir)
        return start_detached(dryrun, run_dir, dryrun.request)

    # -- lifecycle -------------------------------------------------------------------------------
    def _status(self, run_id: str) -> RunStatus:
        address, ident = split_run_id(run_id)
        handle = RunHandle(self.name, run_id.removeprefix("ray://"))
        if address is None:
            state, message, details = run_state(Path(ident))
            return RunStatus(handle, state, message or ("" if state.terminal else "no summary.json yet"), details)
        return ray_jobs.job_status(handle, address, ident)

    def _logs(self, run_id: str, rank: int | None, follow: bool) -> Iterator[str]:
        address, ident = split_run_id(run_id)
        if address is None:
            files = RunFiles(ident)
            raise BackendError(
                "logs of a local Ray run were printed by `torchrig run` (or went to "
                f"{files.supervisor_log} for `torchrig submit`); Ray keeps them under "
                f"/tmp/ray/session_latest/logs (events: {files.events})"
            )
        return ray_jobs.job_logs(address, ident, rank, follow)

    def _cancel(self, run_id: str) -> RunStatus:
        address, ident = split_run_id(run_id)
        if address is None:
            cancel_detached(Path(ident))
        else:
            ray_jobs.stop_job(address, ident)
        return self._status(run_id)

    def _list(self) -> list[RunStatus]:
        if not self.address:
            raise BackendError(
                "ray: give --address http://HOST:8265 (or set RAY_ADDRESS) to list the jobs of a Ray cluster"
            )
        host = self.address.split("://", 1)[-1].rstrip("/")
        return [self._status(f"{host}/{sub}") for sub in ray_jobs.list_jobs(self.address)]
