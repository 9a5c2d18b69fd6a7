"""Read DCP's `.metadata` without executing anything it contains.

`torch.distributed.checkpoint` writes its metadata as a pickle (`FileSystemWriter.finish`) and reads it
back with `pickle.load`, which runs whatever callable the file names: inspecting a hostile store that
way is code execution on the operator's machine. `load_metadata` unpickles with a `find_class` that
resolves only the exact classes a DCP metadata file refers to (found by recording what real saves of
tensors of every dtype, bytes values and nested state need) and refuses everything else, so nothing
outside that list can be constructed or called.
"""

from __future__ import annotations

import enum
import io
import pickle
from typing import IO, Any

__all__ = ["ALLOWED_GLOBALS", "UnsafeMetadataError", "load_metadata"]

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# (module, name) pairs a DCP metadata pickle may name; each resolves to a data class, an enum, torch.Size,
# a dtype, a path or torch's layout-by-name lookup: none of them runs code on its arguments.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA_MODULE, "Metadata"),
        (_DCP_METADATA_MODULE, "MetadataIndex"),
        (_DCP_METADATA_MODULE, "StorageMeta"),
        (_DCP_METADATA_MODULE, "TensorProperties"),
        (_DCP_METADATA_MODULE, "TensorStorageMetadata"),
        (_DCP_METADATA_MODULE, "ChunkStorageMetadata"),
        (_DCP_METADATA_MODULE, "BytesStorageMetadata"),
        (_DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


class UnsafeMetadataError(pickle.UnpicklingError):
    """The metadata names something outside the allow-list (or is not DCP metadata at all)."""


def _enum_member(cls: Any, name: Any) -> Any:
    """`getattr(cls, name)` for an enum member only. Early Python 3.11 releases (Debian bookworm's 3.11.2,
    the images' base; 3.11.7 no longer does) pickle an enum member as `getattr(EnumClass, "NAME")`:
    `_MEM_FORMAT_ENCODING` in every DCP metadata file. `cls` is a class the allow-list resolved."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise UnsafeMetadataError(
        f"refused getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) in checkpoint metadata"
    )


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch":
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise UnsafeMetadataError(f"refused to load {module}.{name} from checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadataError("refused a persistent id in checkpoint metadata")


def load_metadata(source: bytes | IO[bytes]) -> Any:
    """The DCP `Metadata` in `source` (bytes or a binary file), unpickled with the allow-list.

    Raises:
        UnsafeMetadataError: The pickle names a global outside `ALLOWED_GLOBALS`, or it is not DCP metadata.
        pickle.UnpicklingError: The data is not a valid pickle.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    stream = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        metadata = _RestrictedUnpickler(stream).load()
    except UnsafeMetadataError:
        raise
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise pickle.UnpicklingError(f"unreadable checkpoint metadata: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadataError(f"not DCP metadata (a {type(metadata).__name__})")
    return metadata
