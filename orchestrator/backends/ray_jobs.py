"""The Ray Jobs API side of the Ray backend: submit, status, logs, stop and list on a Ray cluster.

A submission ships the working directory (without .venv, runs, .git) plus the resolved spec as
`job.yaml` at its root; the entrypoint `python -m orchestrator.backends.ray_entry --spec job.yaml`
runs the same code on the cluster as the embedded Ray run here. Run ids are
`ray://HOST:PORT/<submission_id>`.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from orchestrator.backends.api_timeout import api_timeout
from orchestrator.backends.base import RunHandle, RunState, RunStatus, SubmitOptions
from orchestrator.backends.ray_run import worker_env
from orchestrator.compile.rayjob import entrypoint as rayjob_entrypoint
from orchestrator.errors import BackendError
from orchestrator.spec import JobSpec

__all__ = [
    "ENTRYPOINT",
    "JOB_METADATA_KEY",
    "WORKING_DIR_EXCLUDES",
    "job_logs",
    "job_status",
    "jobs_client",
    "list_jobs",
    "runtime_env",
    "split_run_id",
    "stop_job",
    "submit_job",
]

# The preflight runs first on the cluster too (no CUDA check: the driver lands on the head).
ENTRYPOINT = rayjob_entrypoint("job.yaml")
WORKING_DIR_EXCLUDES = [".venv", "runs", ".git", "__pycache__", "*.pyc", ".mypy_cache", ".ruff_cache", ".pytest_cache"]
JOB_METADATA_KEY = "torchrig.io/job"  # submission metadata: the job's name (how `list` finds torchrig's jobs)
_STATES = {
    "PENDING": RunState.PENDING,
    "RUNNING": RunState.RUNNING,
    "SUCCEEDED": RunState.SUCCEEDED,
    "FAILED": RunState.FAILED,
    "STOPPED": RunState.CANCELLED,
}


def split_run_id(run_id: str) -> tuple[str | None, str]:
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


def jobs_client(address: str) -> Any:
    """A `JobSubmissionClient` for `address` whose every request is bounded by `api_timeout()`.

    Ray's client sends its requests without a timeout (a Jobs API that accepts and never answers
    hangs it forever) and takes none: the subclass adds one to each request it makes. Token
    authentication is Ray's own: with `RAY_AUTH_MODE=token` and the cluster's token in
    `RAY_AUTH_TOKEN` (or a file named by `RAY_AUTH_TOKEN_PATH`), the client sends it.

    Raises:
        BackendError: the Jobs API cannot be reached (one line, never a traceback).
    """
    from ray.job_submission import JobSubmissionClient

    timeout = api_timeout().pair()

    class _BoundedClient(JobSubmissionClient):
        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", timeout)
            return super()._do_request(method, endpoint, **kwargs)

    try:
        return _BoundedClient(address)
    except Exception as exc:  # ConnectionError, requests' Timeout and friends
        raise BackendError(f"cannot reach the Ray Jobs API at {address}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def runtime_env(spec: JobSpec, options: SubmitOptions, working_dir: str) -> dict[str, Any]:
    """The submission's runtime env: `spec.ray.runtimeEnv` plus the worker env and the working directory."""
    env: dict[str, Any] = dict(spec.spec.ray.runtime_env)
    env_vars = dict(env.get("env_vars") or {})
    env_vars.update(worker_env(spec, options, options.run_dir))
    env["env_vars"] = env_vars
    env["working_dir"] = working_dir
    env["excludes"] = [*env.get("excludes", []), *WORKING_DIR_EXCLUDES]
    return env


def submit_job(spec: JobSpec, options: SubmitOptions, address: str) -> RunHandle:
    """Submit the job to the cluster at `address`; returns at once with `ray://HOST:PORT/<submission>`."""
    from orchestrator.loader import dump_spec

    client = jobs_client(address)
    submission_id = f"torchrig-{spec.name}-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="torchrig-ray-") as tmp:
        # A staged copy, so the resolved spec sits at the root as job.yaml without touching the user's tree.
        staged = Path(tmp) / "working_dir"
        shutil.copytree(Path.cwd(), staged, ignore=shutil.ignore_patterns(*WORKING_DIR_EXCLUDES), symlinks=True)
        (staged / "job.yaml").write_text(dump_spec(spec))
        try:
            client.submit_job(
                entrypoint=ENTRYPOINT,
                submission_id=submission_id,
                runtime_env=runtime_env(spec, options, working_dir=str(staged)),
                metadata={JOB_METADATA_KEY: spec.name},
            )
        except Exception as exc:
            raise BackendError(f"Ray Jobs API at {address} refused the job: {_first_line(exc)}") from None
    host = address.split("://", 1)[1].rstrip("/")
    return RunHandle("ray", f"{host}/{submission_id}", info={"address": address})


def job_status(handle: RunHandle, address: str, ident: str) -> RunStatus:
    """The state of submission `ident` on the cluster."""
    client = jobs_client(address)
    try:
        info = client.get_job_info(ident)
    except Exception as exc:
        raise BackendError(f"ray job {ident} at {address}: {_first_line(exc)}") from None
    state = _STATES.get(str(getattr(info.status, "value", info.status)), RunState.UNKNOWN)
    return RunStatus(handle, state, str(info.message or ""), details={"entrypoint": info.entrypoint})


def job_logs(address: str, ident: str, rank: int | None, follow: bool) -> Iterator[str]:
    """The driver's log, which carries every worker's output (prefixed by Ray); `rank` filters on `rank=R`."""
    client = jobs_client(address)
    marker = f"rank={rank}" if rank is not None else None
    if not follow:
        try:
            text = client.get_job_logs(ident)
        except Exception as exc:
            raise BackendError(f"logs of ray job {ident} at {address}: {_first_line(exc)}") from None
        for line in str(text).splitlines():
            if marker is None or marker in line:
                yield line
        return
    import asyncio
    import queue
    import threading

    try:  # the tail's websocket has no timeout of its own: see that the server answers first
        client.get_job_status(ident)
    except Exception as exc:
        raise BackendError(f"logs of ray job {ident} at {address}: {_first_line(exc)}") from None
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


def stop_job(address: str, ident: str) -> None:
    client = jobs_client(address)
    try:
        client.stop_job(ident)
    except Exception as exc:
        raise BackendError(f"stopping ray job {ident} at {address}: {_first_line(exc)}") from None


def list_jobs(address: str) -> list[str]:
    """Submission ids of torchrig's jobs on the cluster."""
    client = jobs_client(address)
    try:
        jobs = client.list_jobs()
    except Exception as exc:
        raise BackendError(f"listing the jobs of the Ray cluster at {address}: {_first_line(exc)}") from None
    return [
        str(job.submission_id)
        for job in jobs
        if job.submission_id and (job.metadata or {}).get(JOB_METADATA_KEY) is not None
    ]
