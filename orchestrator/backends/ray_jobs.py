"""The Ray Jobs API side of the Ray backend: submit, status, logs, stop and list on a Ray cluster.

A submission ships a staged copy of the working directory plus the resolved spec as `job.yaml` at its
root; the entrypoint `python -m orchestrator.backends.ray_entry --spec job.yaml` runs the same code on
the cluster as the embedded Ray run here. Run ids are `ray://HOST:PORT/<submission_id>`.

What is staged (`stage_working_dir`) is what Ray would upload from the working directory, less what
must never leave this machine. Ray 2.x packs a working directory minus its `.gitignore` and
`.rayignore` patterns (`ray/_private/runtime_env/packaging.py`, on unless
`RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1`) and the runtime env's `excludes`; the staging applies the same
files with Ray's own gitwildmatch matcher, so git-ignored data is not even copied, and always leaves
out secret-like files (`SECRET_EXCLUDES`: `.env`, keys, `.netrc`, kubeconfigs, cloud CLI
directories), `.git`, `.venv` and `runs/` whatever the ignore files say. The same patterns go into the
submission's `excludes` so that Ray's packaging would drop them too. Symbolic links that leave the
working directory are not staged: Ray's zip follows links and would pack their targets.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
    "SECRET_EXCLUDES",
    "WORKING_DIR_EXCLUDES",
    "StagedUpload",
    "job_logs",
    "job_status",
    "jobs_client",
    "list_jobs",
    "runtime_env",
    "split_run_id",
    "stage_working_dir",
    "stop_job",
    "submit_job",
]

# The preflight runs first on the cluster too (no CUDA check: the driver lands on the head).
ENTRYPOINT = rayjob_entrypoint("job.yaml")
# Never uploaded, whatever .gitignore says (gitignore syntax, as Ray's `excludes`): environment files,
# private keys and certificates, ssh keys (`id_rsa`, `id_ed25519`, ...: not every `id_*`, which would
# drop modules such as `id_utils.py`), netrc and git/pypi credentials, kubeconfigs, cloud CLI directories.
SECRET_EXCLUDES = [
    ".env",
    ".env.*",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    *(f"id_{kind}*" for kind in ("rsa", "dsa", "ecdsa", "ed25519", "xmss")),
    ".netrc",
    "_netrc",
    ".git-credentials",
    ".pypirc",
    ".kube/",
    "kubeconfig*",
    ".aws/",
    ".ssh/",
    ".gnupg/",
    ".docker/",
    ".config/gcloud/",
]
# Never uploaded either: the repository, environments, torchrig's run directories, caches.
_BUILD_EXCLUDES = [".git", ".venv", "/runs/", "__pycache__", "*.pyc", ".mypy_cache", ".ruff_cache", ".pytest_cache"]
WORKING_DIR_EXCLUDES = [*_BUILD_EXCLUDES, *SECRET_EXCLUDES]
_IGNORE_FILES = (".gitignore", ".rayignore")  # what Ray's packaging reads in every directory
_SHOWN = 8  # secret-like names printed on the one line
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


@dataclass
class StagedUpload:
    """What `stage_working_dir` left out, relative to the working directory (directories end in `/`)."""

    secret_like: list[str] = field(default_factory=list)
    ignored: int = 0  # by a .gitignore or .rayignore
    build: int = 0  # .git, .venv, runs/, caches
    outside_links: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the terminal: counts, and the secret-like names (the first few)."""
        shown = ", ".join(self.secret_like[:_SHOWN]) + (", ..." if len(self.secret_like) > _SHOWN else "")
        parts = [f"{len(self.secret_like)} secret-like" + (f" ({shown})" if shown else "")]
        parts += [f"{self.ignored} git-ignored", f"{self.build} of .git/.venv/runs/caches"]
        if self.outside_links:
            parts.append(f"{len(self.outside_links)} links out of the directory")
        return "not uploaded to the Ray cluster: " + ", ".join(parts)


def _matcher(patterns: list[str]) -> Callable[[str], bool]:
    # Ray's own (vendored) pathspec, so that the patterns mean what they mean to Ray's packaging.
    from ray._private.thirdparty.pathspec.pathspec import PathSpec

    from_lines: Callable[[str, list[str]], Any] = PathSpec.from_lines
    spec = from_lines("gitwildmatch", patterns)
    return lambda path: bool(spec.match_file(path))


def _ignore_matcher(directory: Path) -> Callable[[str], bool] | None:
    """The .gitignore and .rayignore of one directory, as Ray reads them (relative to that directory)."""
    use_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"  # Ray's own switch
    lines: list[str] = []
    for name in _IGNORE_FILES:
        path = directory / name
        if (name != ".gitignore" or use_gitignore) and path.is_file():
            lines += path.read_text(errors="replace").splitlines()
    return _matcher(lines) if lines else None


def stage_working_dir(source: Path, target: Path) -> StagedUpload:
    """Copy `source` to `target` (a new directory) without what must not be uploaded.

    Left out: `SECRET_EXCLUDES` and `.git`/`.venv`/`runs/`/caches anywhere (always), what a `.gitignore`
    or `.rayignore` on the way ignores (each relative to its directory, as Ray's packaging reads them),
    and symbolic links whose target is outside `source` (Ray's zip would pack the target).

    Returns:
        What was left out, for one line on the terminal.
    """
    secret, build = _matcher(SECRET_EXCLUDES), _matcher(_BUILD_EXCLUDES)
    root = source.resolve()
    out = StagedUpload()
    ignores: list[tuple[Path, Callable[[str], bool]]] = []  # the ignore files of the current directory chain
    target.mkdir(parents=True)
    for here, dirs, files in os.walk(root):
        current = Path(here)
        while ignores and ignores[-1][0] not in (current, *current.parents):
            ignores.pop()
        matcher = _ignore_matcher(current)
        if matcher is not None:
            ignores.append((current, matcher))
        kept: list[str] = []
        for name in sorted(dirs) + sorted(files):
            path = current / name
            link = path.is_symlink()
            is_dir = name in dirs and not link
            rel = path.relative_to(root).as_posix() + ("/" if is_dir else "")
            # A link is judged by its target too: Ray's zip packs what it points to.
            pointee = path.resolve() if link else path
            inside = pointee.is_relative_to(root)
            aliases = [rel]
            if link and inside:
                aliases.append(pointee.relative_to(root).as_posix() + ("/" if pointee.is_dir() else ""))
            if any(secret(a) for a in aliases):
                out.secret_like.append(rel)
            elif any(build(a) for a in aliases):
                out.build += 1
            elif any(m(path.relative_to(base).as_posix() + ("/" if is_dir else "")) for base, m in ignores):
                out.ignored += 1
            elif not inside:
                out.outside_links.append(rel)
            elif is_dir:
                kept.append(name)
                (target / rel).mkdir()
            elif link:
                (target / rel).symlink_to(os.readlink(path))
            elif path.is_file():  # not a socket or FIFO (copying one would block)
                shutil.copy2(path, target / rel)
        dirs[:] = [d for d in dirs if d in kept]  # os.walk descends into what was kept only
    return out


def submit_job(spec: JobSpec, options: SubmitOptions, address: str) -> RunHandle:
    """Submit the job to the cluster at `address`; returns at once with `ray://HOST:PORT/<submission>`."""
    from orchestrator.loader import dump_spec

    client = jobs_client(address)
    submission_id = f"torchrig-{spec.name}-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="torchrig-ray-") as tmp:
        # A staged copy, so the resolved spec sits at the root as job.yaml without touching the user's tree.
        staged = Path(tmp) / "working_dir"
        left_out = stage_working_dir(Path.cwd(), staged)
        print(left_out.summary(), file=sys.stderr)
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
