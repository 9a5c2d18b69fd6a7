"""Backend registry: name -> module, imported lazily; plugins add more through the
`torchrig.backends` entry-point group."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from orchestrator.errors import SpecError

if TYPE_CHECKING:  # not at run time: the local run's agents and store import modules of this package
    from orchestrator.backends.base import Backend

__all__ = ["BACKENDS", "available_backends", "get_backend"]

BACKENDS: dict[str, str] = {
    "local": "orchestrator.backends.local:LocalBackend",
    "ray": "orchestrator.backends.ray:RayBackend",
    "kubernetes": "orchestrator.backends.kubernetes:KubernetesBackend",
}


def available_backends() -> dict[str, str]:
    found = dict(BACKENDS)
    for ep in entry_points(group="torchrig.backends"):
        found.setdefault(ep.name, ep.value)
    return found


def get_backend(name: str) -> Backend:
    """Instantiate a backend by name.

    Raises:
        SpecError: unknown name (the message lists the valid ones).
    """
    found = available_backends()
    if name not in found:
        raise SpecError(f"--backend: unknown backend {name!r}; valid backends: {', '.join(sorted(found))}")
    from orchestrator.backends.base import Backend

    module_name, _, attr = found[name].partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    backend = cls()
    assert isinstance(backend, Backend)
    return backend
