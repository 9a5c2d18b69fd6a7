"""Deliberate damage to checkpoint stores: the faults of the `corrupt-checkpoint` and `lose-store` drills.

Works through fsspec on the store layout of `training.checkpoint` (`<store>/step-<NNNNNNNN>/` with a
`manifest.json` commit marker), so the same drill damages a local directory or an S3 prefix.
"""

from __future__ import annotations

import enum
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

__all__ = ["CorruptionKind", "Damage", "corrupt_newest", "make_store_unreachable", "restore_store"]

_STEP_DIR_RE = re.compile(r"step-(\d+)$")
MANIFEST = "manifest.json"


class CorruptionKind(str, enum.Enum):
    flip = "flip"  # flip bytes in the middle of the largest shard
    truncate = "truncate"  # cut the largest shard in half
    delete_file = "delete-file"  # remove the largest shard
    delete_manifest = "delete-manifest"  # remove the commit marker


@dataclass(frozen=True)
class Damage:
    """What was done, for the drill report."""

    store: str
    step: int
    kind: str
    path: str

    def to_dict(self) -> dict[str, Any]:
        return {"store": self.store, "step": self.step, "kind": self.kind, "path": self.path}


def _fs(uri: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
    fs, _, paths = fsspec.get_fs_token_paths(uri, storage_options=options or {})
    return fs, paths[0]


def committed_steps(uri: str, options: dict[str, Any] | None = None) -> list[int]:
    """Steps with a manifest in a store, oldest first."""
    fs, root = _fs(uri, options)
    if not fs.exists(root):
        return []
    steps = []
    for entry in fs.ls(root, detail=False):
        match = _STEP_DIR_RE.search(str(entry).rstrip("/"))
        if match and fs.exists(f"{str(entry).rstrip('/')}/{MANIFEST}"):
            steps.append(int(match.group(1)))
    return sorted(steps)


def corrupt_newest(uri: str, kind: CorruptionKind, options: dict[str, Any] | None = None) -> Damage:
    """Damage the newest committed checkpoint of one store.

    Raises:
        FileNotFoundError: the store holds no committed checkpoint.
    """
    fs, root = _fs(uri, options)
    steps = committed_steps(uri, options)
    if not steps:
        raise FileNotFoundError(f"no committed checkpoint in {uri}")
    step = steps[-1]
    step_dir = f"{root.rstrip('/')}/step-{step:08d}"
    if kind is CorruptionKind.delete_manifest:
        target = f"{step_dir}/{MANIFEST}"
        fs.rm(target)
        return Damage(uri, step, kind.value, target)
    files = [f for f in fs.find(step_dir, detail=True).values() if not str(f["name"]).endswith(MANIFEST)]
    if not files:
        raise FileNotFoundError(f"checkpoint step {step} in {uri} has no data files")
    largest = max(files, key=lambda f: int(f.get("size") or 0))
    target = str(largest["name"])
    if kind is CorruptionKind.delete_file:
        fs.rm(target)
    else:
        with fs.open(target, "rb") as fh:
            data = bytearray(fh.read())
        if kind is CorruptionKind.truncate:
            data = data[: len(data) // 2]
        else:
            middle = len(data) // 2
            for i in range(middle, min(middle + 16, len(data))):
                data[i] ^= 0xFF
        with fs.open(target, "wb") as fh:
            fh.write(bytes(data))
    return Damage(uri, step, kind.value, target)


def make_store_unreachable(path: str) -> str:
    """Make a local store unusable in a way root cannot bypass: move it aside, put a file in its place.

    Returns the path of the moved-aside directory (restore it with `restore_store`). Permissions do not
    work for this because the tests and many containers run as root.
    """
    store = Path(path)
    aside = store.with_name(store.name + ".drill-aside")
    if store.exists():
        os.replace(store, aside)
    store.write_text("this store was made unreachable by a torchrig drill\n")
    return str(aside)


def restore_store(path: str, aside: str) -> None:
    """Undo `make_store_unreachable`, keeping everything written on either side."""
    store = Path(path)
    if store.is_file():
        store.unlink()
    if Path(aside).exists():
        if store.exists():
            for item in Path(aside).iterdir():
                if not (store / item.name).exists():
                    shutil.move(str(item), store / item.name)
        else:
            os.replace(aside, store)
