"""How a drill changes a job's spec: typed copies of the `JobSpec`, validated again at the end.

`isolate_stores` points every store that could be shared with a real job (an absolute path, a bucket
prefix) at a drill-private place, so a drill never restores from (or damages) a real job's checkpoints
and its faulted run and reference never share a store. It keeps one store per original store, in the
same order and under the same name, so every spec that `validate` accepts stays valid.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from orchestrator.loader import validate_document
from orchestrator.spec import JobSpec
from training.config import ResumePolicy, StoreConfig

__all__ = ["DRILL_STORE", "isolate_stores", "patch_section", "revalidate", "with_fallback_store"]

DRILL_STORE = "drill-b"  # the second store a store scenario adds to a one-store job


def patch_section(spec: JobSpec, section: str, **update: Any) -> JobSpec:
    """A copy of `spec` with fields of `spec.spec.<section>` replaced (field names, not YAML aliases).

    Not validated: call `revalidate` once all patches are applied.
    """
    part = getattr(spec.spec, section).model_copy(update=update)
    return spec.model_copy(update={"spec": spec.spec.model_copy(update={section: part})})


def revalidate(spec: JobSpec, source: str) -> JobSpec:
    """Run every validator on a patched spec (`model_copy` runs none).

    Raises:
        SpecError: the patched spec is invalid (the message names the field).
    """
    return validate_document(spec.to_yaml_dict(), source)


def _relative_home(store: StoreConfig) -> str | None:
    """The normalised path of a file store inside the run directory; None when it is absolute or
    leaves the run directory (`../x` would be shared by the faulted run and the reference)."""
    if not store.kind.filesystem or store.path.startswith("/"):
        return None
    path = posixpath.normpath(store.path)
    return None if path == ".." or path.startswith("../") else path


def _dir_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.") or "store"


def _free(path: str, taken: set[str]) -> str:
    candidate, n = path, 2
    while candidate in taken:
        candidate, n = f"{path}-{n}", n + 1
    taken.add(candidate)
    return candidate


def isolate_stores(spec: JobSpec, tag: str, role: str) -> JobSpec:
    """`spec` with drill-private stores and `resume: auto` (not validated; see `revalidate`).

    - a file store inside the run directory stays (each run of the drill has its own directory);
    - any other file store moves to `file://./stores/<name>` in the run directory (its `pvc` dropped);
    - an object store gets the prefix `torchrig-drill-<tag>/<role>/<name>` below its own.

    Every store keeps its display name, so the names in events, metrics and the report are the job's.
    """
    stores = spec.spec.checkpoint.stores
    homes = [_relative_home(s) for s in stores]
    # A relative store keeps its place unless an earlier store already has it (two names, one directory).
    owner: dict[str, int] = {}
    for i, home in enumerate(homes):
        if home is not None:
            owner.setdefault(home, i)
    taken = set(owner)
    prefixes: set[str] = set()
    isolated: list[StoreConfig] = []
    for i, store in enumerate(stores):
        name = store.display_name
        if store.kind.filesystem:
            home = homes[i]
            if home is not None and owner[home] == i:
                isolated.append(store)
                continue
            path = _free(f"stores/{_dir_name(name)}", taken)
            isolated.append(store.model_copy(update={"uri": f"file://./{path}", "name": name, "pvc": None}))
        else:
            uri = _free(f"{store.uri.rstrip('/')}/torchrig-drill-{tag}/{role}/{_dir_name(name)}", prefixes)
            isolated.append(store.model_copy(update={"uri": uri, "name": name}))
    return patch_section(spec, "checkpoint", stores=isolated, resume=ResumePolicy.auto)


def with_fallback_store(spec: JobSpec) -> JobSpec:
    """`spec` with a second file store (`drill-b` in the run directory) when it has only one."""
    stores = spec.spec.checkpoint.stores
    if len(stores) >= 2:
        return spec
    taken = {s.display_name for s in stores} | {h for s in stores if (h := _relative_home(s)) is not None}
    name = _free(DRILL_STORE, taken)
    return patch_section(spec, "checkpoint", stores=[*stores, StoreConfig(uri=f"file://./{name}", name=name)])
