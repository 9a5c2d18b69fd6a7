"""What each checkpoint store scheme can do, declared once: the `StoreKind` registry.

Everything that asks "is this store a local path, shared between pods, atomic on create" reads the
store's kind (`StoreConfig.kind`, `store_kind(uri)`) instead of comparing scheme strings: the model's
URI check, the storage (`training.checkpoint.storage`), the preflight, the pod volumes
(`orchestrator.compile._pod`), Ray Train's storage path, the pod-local-stores rule, the run directory's
hint, the drills. It lives in `training` beside the store model because the worker needs it and
`training` never imports `orchestrator`; it imports nothing heavier than the standard library, so the
job model can. Anchor: torchx's one registry of schedulers, each declaring what it supports.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

__all__ = ["STORE_KINDS", "SUPPORTED_STORE_SCHEMES", "StoreKind", "scheme_of", "store_kind"]


@dataclass(frozen=True)
class StoreKind:
    """One store scheme.

    Attributes:
        scheme: the URI scheme (`file` for a bare path).
        service: the scheme of the service it names: fsspec's aliases (`gcs` of `gs`, `abfs` of `az`)
            name one service, so two such stores with one bucket and prefix are one place and share the
            same credential variables.
        filesystem: its paths are a filesystem of the machine or pod (a local disk, NFS, a mounted
            PersistentVolumeClaim): preflight checks them writable, a pod mounts a volume there, a drill
            isolates it in its run directory.
        in_process: it lives in each worker process's memory and is gone with it (tests only).
        atomic_create: `create_exclusive` is one atomic operation (`training.checkpoint.storage`).
        package: the package fsspec imports for it; None where fsspec has it built in.
    """

    scheme: str
    service: str
    filesystem: bool = False
    in_process: bool = False
    atomic_create: bool = False
    package: str | None = None

    @property
    def object_store(self) -> bool:
        """A remote object store (a bucket and a prefix), reachable from every node without a volume."""
        return not (self.filesystem or self.in_process)

    @property
    def shared(self) -> bool:
        """Every pod and node of a job reaches the same store by itself. A `file://` store is shared only
        on a volume they all mount (`StoreConfig.shared`: `pvc`); `memory://` never is."""
        return self.object_store


STORE_KINDS: dict[str, StoreKind] = {
    k.scheme: k
    for k in (
        StoreKind("file", "file", filesystem=True, atomic_create=True),
        StoreKind("s3", "s3", atomic_create=True, package="s3fs"),
        StoreKind("gs", "gs", package="gcsfs"),
        StoreKind("gcs", "gs", package="gcsfs"),
        StoreKind("az", "az", package="adlfs"),
        StoreKind("abfs", "az", package="adlfs"),
        StoreKind("memory", "memory", in_process=True, atomic_create=True),
    )
}
# Object stores go through fsspec; `file` is a local or shared (NFS, PVC) filesystem.
SUPPORTED_STORE_SCHEMES: tuple[str, ...] = tuple(STORE_KINDS)


def scheme_of(uri: str) -> str:
    """The scheme of a store URI: `file` for a bare path."""
    return urlparse(uri).scheme if "://" in uri else "file"


def store_kind(uri: str) -> StoreKind:
    """The kind of the store at `uri`.

    Raises:
        ValueError: an unsupported scheme; the message lists the supported ones.
    """
    scheme = scheme_of(uri)
    kind = STORE_KINDS.get(scheme)
    if kind is None:
        raise ValueError(f"unsupported scheme {scheme!r}; use one of: {', '.join(SUPPORTED_STORE_SCHEMES)}")
    return kind
