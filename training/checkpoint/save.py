"""The save pipeline: staging, the background DCP save straight into every store, the commit.

1. *staging* (`stage`, the only part training waits for): the state is copied to CPU memory;
2. in a background thread (`SavePipeline.run`): `dcp.save` of the copy through a tee (`writer`): each
   byte goes once from memory into every file store (and the node-local copy), its digest computed in the
   same pass, every copy fsynced in parallel; file stores on one reflink-capable filesystem share blocks
   copy-on-write; object stores upload from a written copy, in parallel (a node-local staging directory
   is written only when no file store or node-local copy exists to upload from);
3. the ranks exchange their file lists; rank 0 writes, per store where every rank's write succeeded
   and the fence still names this writer, `step-N/manifest.json` LAST: the commit marker (signed when a
   key is configured), looks at the fence once more (a writer that lost it in between takes its
   manifest back), then applies retention to this job's checkpoints. One store failing never stops
   training or the other stores.

Shards go under `step-N/gen-G/`, G being the writer generation the fence gave rank 0, broadcast to every
rank at each save (a writer that could reach no store when it started takes one at its first save).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils._pytree import tree_map

from training.checkpoint.collectives import Collectives
from training.checkpoint.digest import DIGEST_ALGORITHM, DIGEST_PART_BYTES
from training.checkpoint.fence import Fence
from training.checkpoint.manifest import (
    DCP_METADATA,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    gen_dir,
    parse_step_dir,
    read_manifest,
    step_dir,
)
from training.checkpoint.results import CheckpointError, SaveOutcome
from training.checkpoint.retention import apply_retention
from training.checkpoint.storage import CheckpointStorage
from training.checkpoint.writer import Target, TeeFileSystem, TeeWriter, can_reflink, clone_into
from training.config import CheckpointConfig
from training.contract import EventKind, WorkerIdentity
from training.metrics.base import CheckpointRecord, MetricsSink

__all__ = ["SavePipeline", "stage"]

log = logging.getLogger(__name__)

_NODE_LOCAL = -1  # Target.stores entry: the node-local copy
_STAGING = -2  # Target.stores entry: a staging directory object stores upload from


@dataclass
class _Plan:
    """Where one rank's files go in one save."""

    targets: list[Target] = field(default_factory=list)  # written directly, each its own copy
    clones: list[tuple[int, int, str]] = field(default_factory=list)  # (target, store, root): reflinked
    errors: dict[int, str] = field(default_factory=dict)  # store -> why it gets nothing


def _guard(fn: Callable[..., object], *args: Any) -> str | None:
    """Run `fn`; its failure as the one-line error a store's result carries."""
    try:
        fn(*args)
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _copy_leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        # A DTensor copies its local shard only: no collective, so staging never waits for other ranks.
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)


def stage(state: dict[str, Any]) -> dict[str, Any]:
    """Copy the state to CPU memory: the floor of what training must wait for."""
    flat = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}
    staged: dict[str, Any] = tree_map(_copy_leaf, flat)
    return staged


class SavePipeline:
    """Writes staged copies to every store and commits them (run in the manager's background thread).

    Args:
        config: the `spec.checkpoint` section.
        identity: this rank.
        sink: receives the checkpoint, store-failure and fenced records.
        stores: the stores, in `config.stores` order.
        collectives: the manager's gloo groups.
        fence: this writer's fence (checked by rank 0 before each commit).
        node_dir: this node's staging (and node-local copy) directory.
        key: the manifest signing key (None: manifests are not signed).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        identity: WorkerIdentity,
        sink: MetricsSink,
        stores: list[CheckpointStorage],
        collectives: Collectives,
        fence: Fence,
        node_dir: str,
        key: bytes | None = None,
    ) -> None:
        self.config = config
        self.identity = identity
        self.sink = sink
        self.stores = stores
        self.coll = collectives
        self.fence = fence
        self.node_dir = node_dir
        self.key = key
        self._uploaders = ThreadPoolExecutor(max_workers=max(1, len(stores)), thread_name_prefix="torchrig-up")
        self._reflink_ok: dict[int, bool] = {}  # filesystem -> whether reflinks work on it
        # Plain JSON facts the trainer adds to every manifest from now on (`CheckpointManager.manifest_extra`).
        self.manifest_extra: dict[str, Any] = {}
        # Step -> whether the replicas agreed at it (`CheckpointManager.certify`); by step, since an
        # asynchronous save commits after later steps have run.
        self.certified: dict[int, bool] = {}
        self._retention_due: list[tuple[CheckpointStorage, Manifest]] = []  # `_commit` -> `retire`

    def close(self) -> None:
        self._uploaders.shutdown(wait=True)

    def run(
        self, step: int, staged: dict[str, Any], start: float, blocked_s: float, *, synchronous: bool, final: bool
    ) -> SaveOutcome:
        """Save, upload and commit one staged copy (collective); never raises."""
        outcome = SaveOutcome(step=step, blocked_s=blocked_s)
        try:
            self._save(step, staged, outcome, final)
        except (Exception, CheckpointException) as exc:  # DCP raises CheckpointException (a BaseException)
            # A failed save must not take training down: the next one is a fresh attempt.
            log.exception("checkpoint at step %d failed", step)
            outcome.committed = False
            outcome.stores_failed.setdefault("*", f"{type(exc).__name__}: {exc}")
        outcome.save_s = time.perf_counter() - start
        if synchronous:
            outcome.blocked_s = outcome.save_s
        return outcome

    def report(self, outcome: SaveOutcome) -> None:
        """Hand the outcome of a save to the sink: one record per failed store, then the checkpoint."""
        for name, error in outcome.stores_failed.items():
            self.sink.on_store_failure(name, error)
        self.sink.on_checkpoint(
            CheckpointRecord(
                step=outcome.step,
                blocked_s=outcome.blocked_s,
                save_s=outcome.save_s,
                bytes=outcome.bytes,
                committed=outcome.committed,
                stores_ok=list(outcome.stores_ok),
                stores_failed=sorted(outcome.stores_failed),
                time=time.time(),
            )
        )

    def _generation(self) -> tuple[int, str]:
        """Collective: rank 0's writer generation and id (it takes a generation now if it could not at start)."""
        generation = None
        if self.identity.rank == 0:
            generation = self.fence.generation
            if generation is None:
                try:
                    generation = self.fence.acquire(self.stores)
                except Exception as exc:
                    log.warning("checkpoint: cannot take a writer generation: %s", exc)
        generation, writer = self.coll.broadcast_obj((generation, self.fence.writer))
        if generation is None:
            raise CheckpointError("no checkpoint store could be reached to take a writer generation")
        return int(generation), str(writer)

    def _plan_targets(self, step: int, generation: int, local_step: str) -> _Plan:
        """Where this rank's files go: the directories written (targets), the reflinked stores, the errors."""
        plan = _Plan()
        gen = gen_dir(generation)
        by_device: dict[int, list[int]] = {}  # filesystem -> indexes of the targets on it

        def add(root: str, store: int) -> None:
            try:
                os.makedirs(os.path.join(root, gen), exist_ok=True)
                device = os.stat(root).st_dev
            except OSError as exc:
                # Recorded, never raised: the other ranks are about to enter DCP's collectives. A failed
                # node-local copy is not kept; a failed staging directory fails the object stores.
                plan.errors[store] = f"{type(exc).__name__}: {exc}"
                log.warning("checkpoint step %d: cannot write %s: %s", step, root, exc)
                return
            for t in by_device.get(device, []):
                if self._reflinks(plan.targets[t].root, root, device):
                    plan.clones.append((t, store, root))
                    return
            by_device.setdefault(device, []).append(len(plan.targets))
            plan.targets.append(Target(root, [store]))

        if self.config.node_local.enabled:
            add(local_step, _NODE_LOCAL)
        for i, store in enumerate(self.stores):
            root = store.local_path(step_dir(step))
            if root is not None:
                add(root, i)
        if not plan.targets and any(s.local_path() is None for s in self.stores):
            add(local_step, _STAGING)  # object stores need a local file to upload from
        return plan

    def _reflinks(self, src_dir: str, dst_dir: str, device: int) -> bool:
        if device not in self._reflink_ok:
            self._reflink_ok[device] = can_reflink(src_dir, dst_dir)
        return self._reflink_ok[device]

    def _save(self, step: int, staged: dict[str, Any], outcome: SaveOutcome, final: bool) -> None:
        ident = self.identity
        generation, writer = self._generation()
        local_step = os.path.join(self.node_dir, step_dir(step))
        # The node directory is written only for a node-local copy or for object stores to upload from;
        # otherwise the shards go to the file stores alone and the ranks need not meet here.
        uses_node_dir = self.config.node_local.enabled or any(s.local_path() is None for s in self.stores)
        if uses_node_dir:
            if ident.local_rank == 0 and os.path.exists(local_step):
                # Left over by a crashed save of this step: stale shard files must not join this checkpoint.
                shutil.rmtree(local_step, ignore_errors=True)
            self.coll.barrier()
        plan = self._plan_targets(step, generation, local_step)
        tee = TeeFileSystem(plan.targets, DIGEST_PART_BYTES, DIGEST_ALGORITHM)
        try:
            with self.coll.quiet_single_process():
                metadata = dcp_save(
                    staged,
                    storage_writer=TeeWriter(tee, gen_dir(generation)),
                    process_group=self.coll.group,
                    no_dist=not self.coll.distributed,
                )
            del staged
            # Every rank knows every file from the metadata; it records (and commits) only its own.
            all_files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
            mine = [f for f in all_files if f.startswith(f"__{ident.rank}_")]
            if ident.rank == 0:
                mine.append(DCP_METADATA)
            rels = [f"{gen_dir(generation)}/{name}" for name in mine]
            tee.sync_dirs(rels)
        finally:
            tee.shutdown()
        entries: list[FileEntry] = []
        for rel in rels:
            digest, size = tee.digests[rel]  # hashed while written: nothing is read back
            entries.append(FileEntry(rel, size, digest, ident.rank, ident.node_rank))
        errors = dict(plan.errors)
        for target in plan.targets:
            for i in target.stores:
                if target.error is not None:
                    errors[i] = target.error
        keep_local = _NODE_LOCAL not in errors
        errors = {i: e for i, e in errors.items() if i >= 0}  # the node's own directories are no store
        live = [t for t in plan.targets if t.error is None]
        jobs: dict[int, Future[str | None]] = {}
        for t, i, root in plan.clones:
            if plan.targets[t].error is not None:
                errors[i] = plan.targets[t].error or ""
            else:
                jobs[i] = self._uploaders.submit(_guard, clone_into, plan.targets[t].root, root, rels)
        for i, store in enumerate(self.stores):
            if store.local_path() is None:
                if live:
                    jobs[i] = self._uploaders.submit(self._upload, store, step, live[0].root, entries)
                else:
                    errors[i] = "no local copy of the shards to upload from"
        for i, fut in jobs.items():
            err = fut.result()
            if err is not None:
                errors[i] = err
        gathered = self.coll.all_gather_obj((entries, errors), ident.world_size)
        all_entries = [e for ents, _ in gathered for e in ents]
        manifest = Manifest(
            step=step,
            world_size=ident.world_size,
            generation=generation,
            job=ident.job,
            time=time.time(),
            torch_version=torch.__version__,
            files=sorted(all_entries, key=lambda e: e.path),
            num_nodes=ident.num_nodes,
            run_id=ident.run_id,
            final=final,
            restart_count=ident.generation,
            writer=writer,
            extra=dict(self.manifest_extra),
            certified=self.certified.pop(step, None),
            digest_part_bytes=DIGEST_PART_BYTES,
            digest_algorithm=DIGEST_ALGORITHM,
        )
        result: dict[str, Any] = {"ok": [], "failed": {}}
        if ident.rank == 0:
            result = self._commit(manifest, [errs for _, errs in gathered])
        result = self.coll.broadcast_obj(result)
        outcome.bytes = manifest.total_bytes
        outcome.stores_ok = list(result["ok"])
        outcome.stores_failed = dict(result["failed"])
        outcome.committed = bool(outcome.stores_ok)
        if ident.local_rank == 0:
            self._after_commit_local(manifest, local_step, outcome, keep_local)
        if uses_node_dir:
            self.coll.barrier()  # the node-local copy is complete on every node before the next save

    @staticmethod
    def _upload(store: CheckpointStorage, step: int, source_root: str, entries: list[FileEntry]) -> str | None:
        try:
            for entry in entries:
                rel = f"{step_dir(step)}/{entry.path}"
                store.put_file(os.path.join(source_root, entry.path), rel)
                size = store.size(rel)
                if size != entry.size:
                    return f"{rel}: uploaded {size} bytes, expected {entry.size}"
            return None
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    def _commit(self, manifest: Manifest, per_rank_errors: list[dict[int, str]]) -> dict[str, Any]:
        """Rank 0: write the manifest to every store where all ranks uploaded, then apply retention."""
        ok: list[str] = []
        failed: dict[str, str] = {}
        committed: list[CheckpointStorage] = []
        for i, store in enumerate(self.stores):
            errs = [e[i] for e in per_rank_errors if i in e]
            if errs:
                failed[store.name] = errs[0]
                log.warning("checkpoint step %d: store %s failed: %s", manifest.step, store.name, errs[0])
                continue
            try:
                stale = self.fence.check(store, manifest)
                if not stale:
                    store.write_bytes_atomic(f"{step_dir(manifest.step)}/{MANIFEST_NAME}", manifest.to_json(self.key))
                    stale = self._lost_fence_since(store, manifest)
                if stale:
                    failed[store.name] = f"fenced: {stale}"
                    log.error("checkpoint step %d NOT committed to %s: %s", manifest.step, store.name, stale)
                    self.sink.on_event(EventKind.CHECKPOINT_FENCED, step=manifest.step, store=store.name, reason=stale)
                    continue
                ok.append(store.name)
                committed.append(store)
            except Exception as exc:
                failed[store.name] = f"{type(exc).__name__}: {exc}"
                log.warning("checkpoint step %d: commit to %s failed: %s", manifest.step, store.name, exc)
        # Retention only after the commit round, so an old checkpoint goes only once the new one is
        # committed everywhere it could be; and after the commit is recorded (`retire`), so deleting an
        # old checkpoint (many objects on S3) never delays the event, the metric or `save_s`.
        self._retention_due = [(store, manifest) for store in committed]
        return {"ok": ok, "failed": failed}

    def retire(self) -> None:
        """Rank 0, after a commit is reported: apply retention to the stores that took it (`_commit`).

        The manager's background thread calls it before the next save can start, so a deletion never
        runs beside a write; a process that ends first (an emergency checkpoint) leaves the old
        checkpoints for the next commit's retention."""
        due, self._retention_due = self._retention_due, []
        for store, manifest in due:
            try:
                apply_retention(
                    store,
                    self.config.keep,
                    committed_step=manifest.step,
                    job=manifest.job,
                    job_of_generation=self.fence.job_of,
                    key=self.key,
                )
            except Exception as exc:
                log.warning("retention in %s failed: %s", store.name, exc)

    def _lost_fence_since(self, store: CheckpointStorage, manifest: Manifest) -> str | None:
        """After writing `manifest`: if a newer writer took the fence meanwhile, take the manifest back."""
        try:
            newer = self.fence.newer_holder(store)
        except Exception as exc:  # the check before the write passed: the commit stands
            log.warning("checkpoint step %d: fence re-check in %s failed: %s", manifest.step, store.name, exc)
            return None
        if newer is None:
            return None
        rel = f"{step_dir(manifest.step)}/{MANIFEST_NAME}"
        try:
            if read_manifest(store, manifest.step).writer == manifest.writer:
                store.delete_file(rel)
        except (FileNotFoundError, ValueError):
            pass
        return f"a newer writer took the store while this one committed ({newer.describe()}); manifest withdrawn"

    def _after_commit_local(self, manifest: Manifest, local_step: str, outcome: SaveOutcome, keep: bool) -> None:
        """Local rank 0: keep (and complete) the node-local copy, or drop the staging directory."""
        if not self.config.node_local.enabled or not outcome.committed or not keep:
            # Without node-local copies the staging directory is done; a save that was never committed
            # is not a valid node-local copy either (the previous one stays).
            shutil.rmtree(local_step, ignore_errors=True)
            return
        ident = self.identity
        if self.config.node_local.replicate_to_peer and ident.num_nodes > 1:
            peer = (ident.node_rank + 1) % ident.num_nodes
            source = next(s for s in self.stores if s.name in outcome.stores_ok)
            try:
                for entry in manifest.files:
                    local = os.path.join(local_step, entry.path)
                    if (entry.node_rank == peer or entry.path.endswith(DCP_METADATA)) and not os.path.exists(local):
                        source.get_file(f"{step_dir(manifest.step)}/{entry.path}", local)
            except Exception as exc:
                log.warning("peer replication of step %d from %s failed: %s", manifest.step, source.name, exc)
        with open(os.path.join(local_step, MANIFEST_NAME), "wb") as fh:
            fh.write(manifest.to_json(self.key))
        for name in os.listdir(self.node_dir):
            step = parse_step_dir(name)
            if step is not None and step != manifest.step:
                shutil.rmtree(os.path.join(self.node_dir, name), ignore_errors=True)
