"""torchrig's public Python API: load a job, compile it, submit it.

    >>> from orchestrator.api import load_spec, compile, submit
    >>> spec = load_spec("examples/digits-ddp.yaml", ["spec.training.steps=50"])
    >>> manifests = compile(spec, "pytorchjob")
    >>> handle = submit(spec, backend="local")

Everything else in `orchestrator` is internal and may change between releases.
"""

from __future__ import annotations

from typing import Any

from orchestrator.backends.base import RunHandle, SubmitOptions
from orchestrator.compile import compile, compile_plan, render
from orchestrator.loader import dump_spec, load_spec
from orchestrator.spec import JobSpec

__all__ = [
    "JobSpec",
    "RunHandle",
    "SubmitOptions",
    "compile",
    "compile_plan",
    "dump_spec",
    "load_spec",
    "render",
    "submit",
]


def submit(spec: JobSpec, backend: str = "local", **options: Any) -> RunHandle:
    """Submit a job to a backend (`local`, `ray`, `kubernetes` or a plugin).

    Args:
        spec: the validated job.
        backend: backend name.
        **options: fields of `SubmitOptions` (run_dir, nodes, address, context, namespace, dry_run,
            fixed_size, monitoring, quiet, env, extra).

    Returns:
        The handle of the submitted run (`backend://id`).

    Raises:
        SpecError: unknown backend or option.
        UnsupportedFeature: the backend cannot run this spec.
        BackendError: the backend failed.
    """
    from dataclasses import fields

    from orchestrator.backends import get_backend
    from orchestrator.errors import SpecError

    valid = {f.name for f in fields(SubmitOptions)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise SpecError(f"submit: unknown option(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
    return get_backend(backend).submit(spec, SubmitOptions(**options))
