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

Before the job is queued, a probe job with the same runtime env and the same entrypoint `python`
(`probe_cluster`) imports torch, ray and torchrig on the cluster and lists its nodes' GPUs; a cluster
that cannot run the job is refused in one line naming what is missing (a cluster started from a venv
that was not activated runs the system `python`, which has none of them).

Where a remote run's directory lives (`remote_run_dir`): `--run-dir` (absolute, a path of the
cluster), else `<spec.ray.sharedDir>/runs/<name>/<submission>` on the directory every node mounts,
else `$HOME/torchrig/runs/<name>/<submission>` on the head node (`ray rsync-down` brings it back for
`torchrig report`). Never the entrypoint's working directory: that is Ray's working-dir cache,
deleted with the session. The entrypoint gets it as `TORCHRIG_RUN_DIR`.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator import __version__
from orchestrator.backends.api_timeout import api_timeout
from orchestrator.backends.base import RunHandle, RunState, RunStatus, SubmitOptions
from orchestrator.backends.ray_run import worker_env
from orchestrator.compile.rayjob import entrypoint as rayjob_entrypoint
from orchestrator.errors import BackendError, SpecError
from orchestrator.spec import JobSpec
from training.contract import Env

log = logging.getLogger(__name__)

__all__ = [
    "ENTRYPOINT",
    "JOB_METADATA_KEY",
    "PROBE_MARKER",
    "SECRET_EXCLUDES",
    "WORKING_DIR_EXCLUDES",
    "ClusterProbe",
    "StagedUpload",
    "configure_logging",
    "job_logs",
    "job_status",
    "jobs_client",
    "list_jobs",
    "new_submission_id",
    "parse_probe",
    "probe_cluster",
    "probe_problem",
    "remote_run_dir",
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


# The probe (`probe_cluster`): one JSON line after this marker in its log, read back bounded.
PROBE_MARKER = "torchrig-probe: "  # a log line marker, not an environment variable
PROBE_METADATA_KEY = "torchrig.io/probe"
PROBE_TIMEOUT_S = 180.0  # the runtime env's setup (upload, pip) counts too
_PROBE_LOG_CHARS = 64 * 1024
# pyproject's floors: torch>=2.6, ray[train]>=2.50 (Ray Train v2).
MIN_VERSIONS = {"torch": (2, 6), "ray": (2, 50)}
# What the probe imports: the packages, then torchrig's modules that the entrypoint's job imports.
_PROBE_CODE = """
import importlib, json, sys
out = {"python": sys.executable, "python_version": sys.version.split()[0], "versions": {}, "missing": {}}
for name, module in (("torch", "torch"), ("ray", "ray"), ("torchrig", "orchestrator"),
                     ("torchrig", "orchestrator.backends.ray_run"), ("torchrig", "training.ray_train")):
    try:
        imported = importlib.import_module(module)
        if "." not in module:
            out["versions"][name] = str(getattr(imported, "__version__", "?"))
    except BaseException as exc:
        out["missing"].setdefault(name, (type(exc).__name__ + ": " + str(exc))[:300])
if "ray" in out["versions"]:
    try:
        import ray
        ray.init(logging_level="ERROR", log_to_driver=False)
        out["gpus_per_node"] = [float(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
        try:
            from ray._private.state import state
            config = state.get_cluster_config()
            groups = config.node_group_configs if config else []
            out["node_groups"] = [[float(g.resources.get("GPU", 0)), int(g.max_count)] for g in groups]
        except Exception:
            out["node_groups"] = []
    except BaseException as exc:
        out["missing"]["cluster"] = (type(exc).__name__ + ": " + str(exc))[:300]
print(MARKER + json.dumps(out), flush=True)
""".replace("MARKER", repr(PROBE_MARKER))
_verbose = False  # `-v`: Ray's own INFO lines (packaging, uploads) reach the terminal


class _WarningsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _verbose or record.levelno >= logging.WARNING


def configure_logging(verbose: bool) -> None:
    """Let Ray's own INFO lines through (`-v`) or keep them out of the CLI's output (the default)."""
    global _verbose
    _verbose = verbose


def _quiet_ray_logs() -> None:
    # Ray's loggers set INFO on themselves (ray.dashboard.modules.*) and print through the handler of the
    # `ray` logger: a filter there drops what is below WARNING whatever the logger's level.
    for handler in logging.getLogger("ray").handlers:
        if not any(isinstance(f, _WarningsOnly) for f in handler.filters):
            handler.addFilter(_WarningsOnly())


def new_submission_id(spec: JobSpec) -> str:
    """A fresh Jobs API submission id for the job (also the name of its run directory on the cluster)."""
    return f"torchrig-{spec.name}-{uuid.uuid4().hex[:8]}"


def remote_run_dir(spec: JobSpec, run_dir: str | None, submission_id: str) -> str:
    """The run directory of a remote run, as a shell word the entrypoint expands on the cluster.

    Raises:
        SpecError: a relative `--run-dir` (it would land in Ray's working-dir cache).
    """
    if run_dir is not None:
        if not run_dir.startswith("/"):
            raise SpecError(
                f"--run-dir: {run_dir!r} is relative; on a remote Ray cluster give an absolute path of the cluster "
                "(under spec.ray.sharedDir to read the run from here), or leave it out"
            )
        return shlex.quote(run_dir)
    tail = f"runs/{spec.name}/{submission_id}"  # DNS-1035 name and hex: nothing to quote
    shared = spec.spec.ray.shared_dir
    return shlex.quote(f"{shared.rstrip('/')}/{tail}") if shared else f'"$HOME"/torchrig/{tail}'


@dataclass(frozen=True)
class ClusterProbe:
    """What the probe found on the cluster, with the entrypoint's `python`."""

    python: str
    python_version: str
    versions: dict[str, str]  # torch, ray, torchrig -> version
    missing: dict[str, str]  # package (or "cluster") -> the error importing it
    gpus_per_node: list[float]  # of the nodes alive now
    node_groups: list[tuple[float, int]]  # autoscaler node types: (GPUs per node, max nodes; -1 unbounded)


def _strings(value: Any, limit: int = 16) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k)[:40]: str(v)[:300] for k, v in list(value.items())[:limit]}


def parse_probe(log: str) -> ClusterProbe | None:
    """The probe's report from its log (untrusted: the last marker line of the log's tail, types checked),
    or None when there is none."""
    lines = [line for line in log[-_PROBE_LOG_CHARS:].splitlines() if line.startswith(PROBE_MARKER)]
    if not lines:
        return None
    try:
        data = json.loads(lines[-1][len(PROBE_MARKER) :])
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None

    def numbers(key: str) -> list[Any]:
        value = data.get(key)
        return value[:4096] if isinstance(value, list) else []

    gpus = [float(g) for g in numbers("gpus_per_node") if isinstance(g, (int, float))]
    groups = [
        (float(g[0]), int(g[1]))
        for g in numbers("node_groups")
        if isinstance(g, list) and len(g) == 2 and all(isinstance(x, (int, float)) for x in g)
    ]
    return ClusterProbe(
        python=str(data.get("python", "?"))[:300],
        python_version=str(data.get("python_version", "?"))[:40],
        versions=_strings(data.get("versions")),
        missing=_strings(data.get("missing")),
        gpus_per_node=gpus,
        node_groups=groups,
    )


def _version(text: str) -> tuple[int, ...] | None:
    parts = text.split("+", maxsplit=1)[0].split(".")[:2]
    return tuple(int(p) for p in parts) if len(parts) == 2 and all(p.isdigit() for p in parts) else None


def probe_problem(spec: JobSpec, probe: ClusterProbe) -> str | None:
    """Why the cluster cannot run `spec`, in one line, else None."""
    python = f"its entrypoint python ({probe.python}, Python {probe.python_version})"
    packages = {k: v for k, v in probe.missing.items() if k != "cluster"}
    if packages:
        what = "; ".join(f"{name} ({error})" for name, error in packages.items())
        return (
            f"{python} cannot import {what}: install torch>=2.6, ray[train,default]>=2.50 and torchrig's "
            "dependencies into the Python that runs `ray start` on every node, and start Ray from that "
            "environment activated (the entrypoint runs the `python` on ray start's PATH)"
        )
    if "cluster" in probe.missing:
        return f"{python} could not connect to the cluster: {probe.missing['cluster']}"
    for name, floor in MIN_VERSIONS.items():
        found = _version(probe.versions.get(name, ""))
        if found is not None and found < floor:
            need = ".".join(map(str, floor))
            return f"{python} has {name} {probe.versions[name]}; torchrig needs {name} >= {need}"
    if probe.versions.get("torchrig") not in (None, __version__):
        return (
            f"{python} imports torchrig {probe.versions['torchrig']}, this is torchrig {__version__}: the job's "
            "working directory should bring its own (an installed torchrig shadows it on the cluster's sys.path)"
        )
    gpus = spec.spec.resources.gpus
    if gpus:
        fit = sum(1 for g in probe.gpus_per_node if g >= gpus)
        for per_node, most in probe.node_groups:
            if per_node >= gpus:
                fit = spec.spec.nodes.min if most < 0 else fit + most
        if fit < spec.spec.nodes.min:
            seen = ", ".join(f"{g:g}" for g in probe.gpus_per_node) or "none"
            return (
                f"spec.resources.gpus: the job needs {spec.spec.nodes.min} node(s) with {gpus} GPU(s) each "
                f"(spec.nodes.min), and the cluster has {fit} (GPUs per live node: {seen}; no autoscaler node "
                "type adds more)"
            )
    return None


# The Jobs API's answer while the head node's job agent has not registered yet (a cluster just started, or
# one whose head is busy): Ray's `job_head.py` waits WAIT_AVAILABLE_AGENT_TIMEOUT for one, then answers 500
# with this text and asks to try again. Nothing was submitted: the same submission id is retried.
NO_AGENT_YET = "No available agent to submit job"
AGENT_RETRY_S = 1.0


def submit_when_an_agent_is_up(client: Any, deadline: float, **job: Any) -> None:
    """`client.submit_job(**job)`, again every `AGENT_RETRY_S` while the cluster answers that no job agent is
    available yet, until `deadline` (`time.monotonic()`); any other error is raised as it came, and that one
    past the deadline as a RuntimeError that says what usually keeps a head's job agent away."""
    while True:
        try:
            client.submit_job(**job)
            return
        except Exception as exc:
            if NO_AGENT_YET not in str(exc):
                raise
            if time.monotonic() + AGENT_RETRY_S > deadline:
                # Measured: a second Ray on the head's host holding the agent's port (52365 by default) leaves
                # the head's job agent unbound for good, and every submission gets this answer.
                raise RuntimeError(
                    f"{_first_line(exc)} (the head's job agent never registered: another Ray on the head's host "
                    "may hold the agent's port, 52365 unless `ray start --dashboard-agent-listen-port` says "
                    "otherwise; its dashboard_agent.log says)"
                ) from None
            log.info("ray jobs: %s; trying again in %g s", _first_line(exc), AGENT_RETRY_S)
            time.sleep(AGENT_RETRY_S)


def probe_cluster(client: Any, address: str, spec: JobSpec, env: dict[str, Any], timeout_s: float) -> None:
    """Run the probe on the cluster with the job's runtime env; raise when the cluster cannot run the job.

    The probe is a Jobs API job of its own, so its `python` is the one the job's entrypoint will get (a
    Ray task would run in the Python of Ray's workers instead). It is deleted once read.

    Raises:
        BackendError: in one line, what is missing (or that the probe did not finish in `timeout_s`).
    """
    probe_id = f"torchrig-probe-{spec.name}-{uuid.uuid4().hex[:8]}"
    where = f"the Ray cluster at {address}"
    deadline = time.monotonic() + timeout_s
    try:
        submit_when_an_agent_is_up(
            client,
            deadline,
            entrypoint="python -c " + shlex.quote(_PROBE_CODE),
            submission_id=probe_id,
            runtime_env=env,
            metadata={PROBE_METADATA_KEY: spec.name},
        )
    except Exception as exc:
        raise BackendError(f"{where} refused the probe job: {_first_line(exc)}") from None
    try:
        status = ""
        while time.monotonic() < deadline:
            status = str(getattr(client.get_job_status(probe_id), "value", ""))
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            time.sleep(0.25)
        else:
            with _suppressed():
                client.stop_job(probe_id)
            raise BackendError(f"{where}: the probe job {probe_id} did not finish in {timeout_s:g} s (state {status})")
        log = str(client.get_job_logs(probe_id))
    except BackendError:
        raise
    except Exception as exc:
        raise BackendError(f"{where}: reading the probe job {probe_id}: {_first_line(exc)}") from None
    finally:
        with _suppressed():
            client.delete_job(probe_id)
    probe = parse_probe(log)
    if probe is None:
        last = (log.strip().splitlines() or [f"no output; the job {status}"])[-1][:300]
        raise BackendError(f"{where} cannot run the job: its entrypoint `python` did not run the probe: {last}")
    problem = probe_problem(spec, probe)
    if problem:
        raise BackendError(f"{where} cannot run the job: {problem}")


def _suppressed() -> Any:
    import contextlib

    return contextlib.suppress(Exception)


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

    _quiet_ray_logs()
    try:
        return _BoundedClient(address)
    except Exception as exc:  # ConnectionError, requests' Timeout and friends
        raise BackendError(f"cannot reach the Ray Jobs API at {address}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def runtime_env(spec: JobSpec, options: SubmitOptions, working_dir: str, run_dir: str | None = None) -> dict[str, Any]:
    """The submission's runtime env: `spec.ray.runtimeEnv` plus the worker env and the working directory
    (`run_dir`: none here when the entrypoint sets it)."""
    env: dict[str, Any] = dict(spec.spec.ray.runtime_env)
    env_vars = dict(env.get("env_vars") or {})
    env_vars.update(worker_env(spec, options, run_dir))
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


def submit_job(
    spec: JobSpec,
    options: SubmitOptions,
    address: str,
    *,
    submission_id: str | None = None,
    probe: bool = True,
    probe_timeout_s: float = PROBE_TIMEOUT_S,
) -> RunHandle:
    """Submit the job to the cluster at `address`; returns at once with `ray://HOST:PORT/<submission>`.

    Args:
        spec: the validated job.
        options: `run_dir` is a path of the cluster (`remote_run_dir`).
        address: the Jobs API.
        submission_id: default a new one (`new_submission_id`).
        probe: first check that the cluster can run the job (`probe_cluster`).
        probe_timeout_s: how long the probe may take.

    Raises:
        BackendError: the cluster cannot be reached, cannot run the job (the probe), or refused it.
    """
    from orchestrator.loader import dump_spec

    client = jobs_client(address)
    submission_id = submission_id or new_submission_id(spec)
    run_dir = remote_run_dir(spec, options.run_dir, submission_id)
    with tempfile.TemporaryDirectory(prefix="torchrig-ray-") as tmp:
        # A staged copy, so the resolved spec sits at the root as job.yaml without touching the user's tree.
        staged = Path(tmp) / "working_dir"
        left_out = stage_working_dir(Path.cwd(), staged)
        print(left_out.summary(), file=sys.stderr)
        (staged / "job.yaml").write_text(dump_spec(spec))
        # The run directory comes with the entrypoint, expanded on the cluster ($HOME is the head's).
        env = runtime_env(spec, options, working_dir=str(staged), run_dir=None)
        if probe:  # same runtime env: Ray uploads the working directory once (content-addressed)
            probe_cluster(client, address, spec, env, probe_timeout_s)
        try:
            submit_when_an_agent_is_up(
                client,
                time.monotonic() + probe_timeout_s,
                entrypoint=f"{Env.RUN_DIR}={run_dir} {ENTRYPOINT}",
                submission_id=submission_id,
                runtime_env=env,
                metadata={JOB_METADATA_KEY: spec.name},
            )
        except Exception as exc:
            raise BackendError(f"Ray Jobs API at {address} refused the job: {_first_line(exc)}") from None
    print(f"run dir (on the cluster): {run_dir}", file=sys.stderr)
    host = address.split("://", 1)[1].rstrip("/")
    return RunHandle("ray", f"{host}/{submission_id}", info={"address": address, "run_dir": run_dir})


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
