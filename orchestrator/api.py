"""torchrig's public Python API: load a job, compile it, submit it.

    >>> from orchestrator.api import load_spec, compile, submit
    >>> spec = load_spec("examples/digits-ddp.yaml", ["spec.training.steps=50"])
    >>> manifests = compile(spec, "pytorchjob")
    >>> handle = submit(spec, backend="local")            # returns at once
    >>> summary = launch(spec, backend="local").wait()   # supervised from this process

Everything else in `orchestrator` is internal and may change between releases.
"""

from __future__ import annotations

from typing import Any

from orchestrator.backends.base import (
    KubernetesOptions,
    LocalOptions,
    NodePlacement,
    RayOptions,
    RunHandle,
    RunState,
    SubmitOptions,
    SupervisedRun,
)
from orchestrator.compile import compile, compile_plan, render
from orchestrator.loader import dump_spec, load_spec
from orchestrator.spec import JobSpec

__all__ = [
    "JobSpec",
    "KubernetesOptions",
    "LocalOptions",
    "NodePlacement",
    "RayOptions",
    "RunHandle",
    "RunState",
    "SubmitOptions",
    "SupervisedRun",
    "compile",
    "compile_plan",
    "dump_spec",
    "launch",
    "load_spec",
    "render",
    "submit",
]


def _options(what: str, options: dict[str, Any]) -> SubmitOptions:
    from dataclasses import fields

    from orchestrator.errors import SpecError

    valid = {f.name for f in fields(SubmitOptions)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise SpecError(f"{what}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
    return SubmitOptions(**options)


def submit(spec: JobSpec, backend: str = "local", **options: Any) -> RunHandle:
    """Submit a job to a backend (`local`, `ray`, `kubernetes` or a plugin); returns at once.

    Args:
        spec: The validated job.
        backend: Backend name.
        **options: Fields of `SubmitOptions`: run_dir, dry_run, fixed_size, monitoring, quiet, env,
            and the per-backend sections `local=LocalOptions(...)`, `ray=RayOptions(...)`,
            `kubernetes=KubernetesOptions(...)`.

    Returns:
        The handle of the submitted run (`backend://id`).

    Raises:
        SpecError: unknown backend or option.
        UnsupportedFeature: the backend cannot run this spec.
        BackendError: the backend failed.
    """
    from orchestrator.backends import get_backend

    return get_backend(backend).submit(spec, _options("submit", options))


def launch(spec: JobSpec, backend: str = "local", **options: Any) -> SupervisedRun:
    """Start a job supervised from this process (`local`, or `ray` without a Jobs API address).

    Args:
        spec: The validated job.
        backend: Backend name.
        **options: Fields of `SubmitOptions`, as for `submit`.

    Returns:
        The running job: `poll()`, `wait(timeout_s)` (returns its summary), `kill_node`, `add_node`, `stop`.

    Raises:
        SpecError: unknown backend or option.
        UnsupportedFeature: the backend cannot supervise a run from this process.
        BackendError: the backend failed.
    """
    from orchestrator.backends import get_backend

    return get_backend(backend).launch(spec, _options("launch", options))
