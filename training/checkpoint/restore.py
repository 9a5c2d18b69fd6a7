"""The restore search: find the newest valid checkpoint, verify one copy of it, load it everywhere.

Rank 0 lists the manifests of every store (and the node-local copy), keeps this job's own checkpoints
(`owner`), tries the newest step first, verifies the files of one copy against its manifest (falling
back to another store, then to an older step), broadcasts the choice, and every rank loads it with
`dcp.load` (which reshards when the world size changed).

Whose checkpoint: a manifest names its job. Other jobs' checkpoints in a shared store are skipped,
with one log line naming them. A manifest without a job name (written before manifests carried one)
is taken as this job's only when the store holds no other job's checkpoint, and a log line says so.
The same search, with `owner=None` (any job) and a fixed step, serves `checkpoint.initFrom`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from training.checkpoint.collectives import Collectives
from training.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointListing,
    Manifest,
    list_checkpoints,
    parse_manifest,
    parse_step_dir,
    step_dir,
    verify_local,
    verify_store,
)
from training.checkpoint.results import CheckpointError, RestoreResult
from training.checkpoint.retention import exclusive_to
from training.checkpoint.storage import CheckpointStorage, safe_join
from training.contract import EventKind, WorkerIdentity
from training.metrics.base import MetricsSink

__all__ = ["Candidate", "RestoreSearch"]

log = logging.getLogger(__name__)

_DOWNLOADS = "restore"  # below the node directory: copies downloaded for one restore, removed after it


@dataclass(frozen=True)
class Candidate:
    """One committed checkpoint and where copies of it are."""

    step: int
    manifest: Manifest
    stores: list[int]  # indexes into the manager's stores; -1 = rank 0's node-local copy


class RestoreSearch:
    """Finds, verifies and loads the checkpoint to restore (collective).

    Args:
        identity: this rank.
        sink: receives store failures and corrupt-copy events.
        stores: the stores to search, in order of preference.
        collectives: the manager's gloo groups.
        node_dir: this node's node-local copy (and download) directory.
        owner: take only this job's checkpoints; None: any job's.
        node_local: also consider this node's node-local copy.
        key: the manifest signing key; set, unsigned or wrongly signed manifests are ignored.
        step: only this step (None: the newest valid one).
        source: what `RestoreResult.source` says for a store copy.
    """

    def __init__(
        self,
        identity: WorkerIdentity,
        sink: MetricsSink,
        stores: list[CheckpointStorage],
        collectives: Collectives,
        node_dir: str,
        *,
        owner: str | None,
        node_local: bool = False,
        key: bytes | None = None,
        step: int | None = None,
        source: str = "store",
    ) -> None:
        self.identity = identity
        self.sink = sink
        self.stores = stores
        self.coll = collectives
        self.node_dir = node_dir
        self.owner = owner
        self.node_local = node_local
        self.key = key
        self.step = step
        self.source = source
        self._foreign: dict[tuple[str, str], list[int]] = defaultdict(list)  # (store, job) -> steps skipped
        self._legacy: dict[str, list[int]] = defaultdict(list)  # store -> job-less steps taken as ours

    def restore(self, state: dict[str, Any], *, required: str | None = None) -> RestoreResult | None:
        """Load the newest valid checkpoint into `state` in place; None when there is none.

        Args:
            state: what to load into (DCP state dict, Statefuls allowed).
            required: when set, finding nothing raises CheckpointError with this message.

        Raises:
            CheckpointError: `required` and no valid checkpoint, or loading failed.
        """
        start = time.perf_counter()
        rank0 = self.identity.rank == 0
        candidates = self.coll.broadcast_obj(self.find_candidates() if rank0 else None)
        chosen: tuple[Candidate, str, str, str, str] | None = None  # cand, dcp path, store, uri, source
        for cand in candidates:
            local = self._try_node_local(cand)
            if local is not None:
                chosen = (cand, local, "node-local", local, "node-local")
                break
            picked = self.coll.broadcast_obj(self._pick_store_copy(cand) if rank0 else None)
            if picked is None:
                continue
            index, path = picked
            path = self._fetch_on_other_nodes(cand, index, path)
            store = self.stores[index]
            chosen = (cand, path, store.name, f"{store.uri.rstrip('/')}/{step_dir(cand.step)}", self.source)
            break
        if chosen is None:
            if required is not None:
                raise CheckpointError(f"{required} ({', '.join(s.uri for s in self.stores)})")
            log.info("no valid checkpoint found; starting fresh")
            return None
        cand, path, store_name, uri, source = chosen
        try:
            with self.coll.quiet_single_process():
                dcp_load(
                    state,
                    storage_reader=FileSystemReader(path),
                    process_group=self.coll.group,
                    no_dist=not self.coll.distributed,
                )
        except Exception as exc:
            raise CheckpointError(f"loading checkpoint step {cand.step} from {uri} failed: {exc}") from exc
        # Downloaded copies were only needed for the load; the stores (and node-local copy) keep theirs.
        self.coll.barrier()
        if self.identity.local_rank == 0:
            shutil.rmtree(os.path.join(self.node_dir, _DOWNLOADS), ignore_errors=True)
        return RestoreResult(
            step=cand.step,
            store=store_name,
            uri=uri,
            world_size=cand.manifest.world_size,
            seconds=time.perf_counter() - start,
            source=source,
        )

    def _own(self, store: CheckpointStorage, listing: list[CheckpointListing]) -> list[Manifest]:
        """The committed manifests of `listing` that restore may take; notes the others."""
        exclusive = self.owner is None or exclusive_to(listing, self.owner)
        out: list[Manifest] = []
        for c in listing:
            m = c.manifest
            if m is None:
                if c.error:
                    log.warning("store %s: %s has a bad manifest (%s); ignored", store.name, step_dir(c.step), c.error)
                continue
            if self.owner is None or m.job == self.owner:
                out.append(m)
            elif not m.job and exclusive:
                self._legacy[store.name].append(m.step)
                out.append(m)
            else:
                self._foreign[(store.name, m.job or "?")].append(m.step)
        return out

    def _say_whose(self) -> None:
        """One line for the other jobs' checkpoints skipped, one for job-less manifests taken as ours."""
        if self._foreign:
            parts = [
                f"{store}: job {job} step{'s' if len(steps) > 1 else ''} {_steps(steps)}"
                for (store, job), steps in sorted(self._foreign.items())
            ]
            log.warning("restore skipped other jobs' checkpoints (not job %s): %s", self.owner, "; ".join(parts))
        if self._legacy:
            parts = [f"{store}: steps {_steps(steps)}" for store, steps in sorted(self._legacy.items())]
            log.warning(
                "restore takes manifests without a job name (written by an older version) as job %s's, since "
                "their stores hold no other job's checkpoints: %s",
                self.owner,
                "; ".join(parts),
            )

    def find_candidates(self) -> list[Candidate]:
        """Rank 0: committed checkpoints in every store (and the node-local copy), newest first."""
        found: dict[tuple[int, int, str], Candidate] = {}
        self._foreign.clear()
        self._legacy.clear()
        for i, store in enumerate(self.stores):
            try:
                listing = list_checkpoints(store, key=self.key)
            except Exception as exc:
                log.warning("cannot list checkpoint store %s: %s", store.name, exc)
                self.sink.on_store_failure(store.name, f"list: {type(exc).__name__}: {exc}")
                continue
            for m in self._own(store, listing):
                if self.step is not None and m.step != self.step:
                    continue
                key = (m.step, m.generation, m.run_id)
                if key in found:
                    found[key].stores.append(i)
                else:
                    found[key] = Candidate(m.step, m, [i])
        self._say_whose()
        if self.node_local:
            for name in os.listdir(self.node_dir):
                step = parse_step_dir(name)
                path = os.path.join(self.node_dir, name, MANIFEST_NAME)
                if step is None or not os.path.isfile(path):
                    continue
                try:
                    with open(path, "rb") as fh:
                        manifest = parse_manifest(fh.read(), step=step, key=self.key)
                except (OSError, ValueError) as exc:
                    log.warning("node-local copy %s ignored: %s", name, exc)
                    continue
                if self.owner is not None and manifest.job != self.owner:
                    continue
                key = (step, manifest.generation, manifest.run_id)
                if key not in found:
                    found[key] = Candidate(step, manifest, [])
        return sorted(found.values(), key=lambda c: (c.step, c.manifest.generation, c.manifest.time), reverse=True)

    def _try_node_local(self, cand: Candidate) -> str | None:
        """Collective: the node-local DCP dir of `cand` when every node holds a verified full copy."""
        if not self.node_local:
            return None
        local_step = os.path.join(self.node_dir, step_dir(cand.step))
        ok = True
        if self.identity.local_rank == 0:
            ok = os.path.isdir(local_step) and verify_local(local_step, cand.manifest).ok
        if not self.coll.min_all(ok):
            return None
        return os.path.join(local_step, cand.manifest.dcp_dir)

    def _pick_store_copy(self, cand: Candidate) -> tuple[int, str] | None:
        """Rank 0: the first store whose copy of `cand` verifies, with a local DCP dir to load from."""
        for i in cand.stores:
            store = self.stores[i]
            try:
                path = self._materialize(store, cand)
            except Exception as exc:
                log.warning("store %s: step %d unreadable: %s", store.name, cand.step, exc)
                self.sink.on_store_failure(store.name, f"read step {cand.step}: {type(exc).__name__}: {exc}")
                continue
            if path is not None:
                return i, path
        return None

    def _restore_dir(self, cand: Candidate) -> str:
        return os.path.join(self.node_dir, _DOWNLOADS, step_dir(cand.step))

    def _download(self, store: CheckpointStorage, cand: Candidate, target: str) -> None:
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target, exist_ok=True)
        for entry in cand.manifest.files:
            # The manifest's layout was checked when it was read; every write still stays below `target`.
            store.get_file(f"{step_dir(cand.step)}/{entry.path}", safe_join(target, entry.path))

    def _materialize(self, store: CheckpointStorage, cand: Candidate) -> str | None:
        """Verify `cand` in `store` (downloading it when remote); the local DCP dir, or None if corrupt."""
        local_root = store.local_path(step_dir(cand.step))
        if local_root is not None:
            report = verify_store(store, cand.manifest)
            path = os.path.join(local_root, cand.manifest.dcp_dir)
        else:
            target = self._restore_dir(cand)
            self._download(store, cand, target)
            report = verify_local(target, cand.manifest)
            path = os.path.join(target, cand.manifest.dcp_dir)
        if report.ok:
            return path
        # The corrupt copy stays where it is: it is evidence, and another store may still hold a good one.
        log.error(
            "store %s: checkpoint step %d is corrupt (%s); trying the next copy",
            store.name,
            cand.step,
            report.summary(),
        )
        self.sink.on_event(EventKind.CHECKPOINT_CORRUPT, step=cand.step, store=store.name, detail=report.summary())
        return None

    def _fetch_on_other_nodes(self, cand: Candidate, index: int, path: str) -> str:
        """Collective: make the chosen copy readable on every node (rank 0's node already has it)."""
        store = self.stores[index]
        if store.local_path() is not None:
            return path  # a file:// store is a shared filesystem: read in place everywhere
        target = self._restore_dir(cand)
        ok = True
        ident = self.identity
        rank0_node = int(self.coll.broadcast_obj(ident.node_rank if ident.rank == 0 else None))
        if ident.local_rank == 0 and ident.node_rank != rank0_node:
            try:
                self._download(store, cand, target)
                ok = verify_local(target, cand.manifest).ok
            except Exception as exc:
                log.error(
                    "node %d: download of step %d from %s failed: %s", ident.node_rank, cand.step, store.name, exc
                )
                ok = False
        if not self.coll.min_all(ok):
            raise CheckpointError(f"step {cand.step} from {store.name} could not be fetched on every node")
        return os.path.join(target, cand.manifest.dcp_dir)


def _steps(steps: list[int]) -> str:
    ordered = sorted(steps)
    return str(ordered[0]) if len(ordered) == 1 else f"{ordered[0]}-{ordered[-1]} ({len(ordered)})"
