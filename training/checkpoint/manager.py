"""The checkpoint manager: sharded (DCP), redundant, verified, asynchronous, fenced checkpoints.

One save, on every rank:

1. *staging* (the only part training waits for): the state is copied to CPU memory;
2. in a background thread: `dcp.save` of the copy into a node-local staging directory, sha256 of this
   rank's files (computed once, here), upload of those files to every store in parallel;
3. the ranks exchange their file lists over a dedicated gloo group; rank 0 writes, per store where every
   rank's upload succeeded and the fence still names this writer, `step-N/manifest.json` LAST: the commit
   marker. One store failing never stops training or the other stores; it is retried at the next save.

Restore: rank 0 lists the manifests of every store (and the node-local copy), tries the newest step
first, verifies the files of one copy against its manifest (falling back to another store, then to an
older step), broadcasts the choice, and every rank loads it with `dcp.load` (which reshards when the
world size changed).

Retention (per store, after a commit): the newest `keep` committed checkpoints stay; older committed
ones are deleted, and so are uncommitted step directories older than the oldest kept one (debris of
crashed saves). Uncommitted or corrupt step directories NEWER than that are never deleted: they are the
evidence of what went wrong. Only the step just committed (and size-checked) can make room, so the last
valid checkpoint is never deleted.

Fencing: every writer holds a token (run id, generation, start time, uuid) that rank 0 records in
`<store>/fence.json` when it starts, replacing only an older writer's token. Before committing, rank 0
re-reads the fence: a different, newer token means this writer is stale, and it refuses to commit; it
also refuses when the store holds a manifest of the same step from a newer generation. Shards go under
`step-N/gen-G/`, so a stale writer cannot clobber a newer generation's files either. The check and the
write are not one atomic operation (object stores have no compare-and-swap): the window is the few
milliseconds between reading the fence and writing the manifest.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils._pytree import tree_map

from training.checkpoint.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    gen_dir,
    list_checkpoints,
    parse_step_dir,
    read_manifest,
    step_dir,
    verify_local,
    verify_store,
)
from training.checkpoint.storage import FsspecStorage, sha256_file
from training.config import CheckpointConfig, IfBusy, ResumePolicy
from training.metrics.base import CheckpointRecord, MetricsSink, RestoreRecord

__all__ = ["CheckpointContext", "CheckpointError", "CheckpointManager", "RestoreResult", "SaveOutcome"]

log = logging.getLogger(__name__)

FENCE_NAME = "fence.json"
_DCP_METADATA = ".metadata"


class CheckpointError(Exception):
    """No valid checkpoint where one was required, or a checkpoint could not be loaded."""


@dataclass(frozen=True)
class CheckpointContext:
    """Who is checkpointing: one rank of one restart generation of a job."""

    job: str
    run_dir: str | None
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    generation: int  # TORCHELASTIC_RESTART_COUNT
    run_id: str = ""  # TORCHELASTIC_RUN_ID; orders fencing tokens of one launch by generation

    @classmethod
    def from_env(cls, job: str, run_dir: str | None = None) -> CheckpointContext:
        """A context from the launcher's environment (torchrun / PyTorchJob); single process without it."""
        env = os.environ
        world_size = int(env.get("WORLD_SIZE", "1"))
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", "1"))
        return cls(
            job=job,
            run_dir=run_dir if run_dir is not None else env.get("TORCHRIG_RUN_DIR"),
            rank=int(env.get("RANK", "0")),
            world_size=world_size,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=local_world_size,
            node_rank=int(env.get("GROUP_RANK", "0")),
            num_nodes=max(1, world_size // max(1, local_world_size)),
            generation=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            run_id=env.get("TORCHELASTIC_RUN_ID", ""),
        )


@dataclass(frozen=True)
class RestoreResult:
    """Where the restored state came from."""

    step: int
    store: str  # store name, or "node-local"
    uri: str  # the checkpoint's location (store URI + step directory, or the local directory)
    world_size: int  # world size that wrote the checkpoint
    seconds: float
    source: str  # "store" | "node-local"


@dataclass
class SaveOutcome:
    """The result of one save, the same on every rank once committed (see `CheckpointManager.history`)."""

    step: int
    blocked_s: float
    save_s: float = 0.0
    bytes: int = 0
    committed: bool = False
    stores_ok: list[str] = field(default_factory=list)
    stores_failed: dict[str, str] = field(default_factory=dict)  # store name -> error


@dataclass(frozen=True)
class _Candidate:
    step: int
    manifest: Manifest
    stores: list[int]  # indexes into the manager's stores; -1 = rank 0's node-local copy


def _copy_leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        # A DTensor copies its local shard only: no collective, so staging never waits for other ranks.
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)


@contextmanager
def _quiet_single_process(distributed: bool) -> Iterator[None]:
    """DCP warns on every single-process save/load; that is the intended mode here, not a mistake."""
    if distributed:
        yield
        return
    # catch_warnings is process-global; the window is one save and only this one message is silenced.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class CheckpointManager:
    """Saves and restores a job's state; see the module docstring for the protocol.

    Args:
        config: the `spec.checkpoint` section.
        ctx: identity of this rank (rank, node, restart generation).
        sink: metrics sink for checkpoint, store-failure and restore records (default: none).

    `restore`, `should_save` and `save` are collective: every rank calls them, in the same order.
    With no process group (or world size 1) everything runs in this process.
    """

    def __init__(self, config: CheckpointConfig, ctx: CheckpointContext, sink: MetricsSink | None = None) -> None:
        self.config = config
        self.ctx = ctx
        self.sink = sink or MetricsSink()
        self.stores = [FsspecStorage(s.resolved_uri(ctx.run_dir), s.options, s.display_name) for s in config.stores]
        self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._ckpt_group: Any = None
        self._ctl_group: Any = None
        if self._distributed:
            # Own gloo groups: the background save's collectives must never share a group with training's
            # (dcp.async_save on the default group deadlocks under FSDP on gloo), nor with the
            # foreground control broadcasts of should_save/save.
            self._ckpt_group = dist.new_group(backend="gloo")
            self._ctl_group = dist.new_group(backend="gloo")
        if config.node_local.enabled:
            root = os.path.join(config.node_local.path, ctx.job)
        else:
            base = ctx.run_dir or os.path.join(tempfile.gettempdir(), f"torchrig-{ctx.job}")
            root = os.path.join(base, ".checkpoint-staging")
        # One directory per node: on one machine emulating several nodes they must not share it.
        self.node_dir = os.path.join(root, f"node-{ctx.node_rank}")
        os.makedirs(self.node_dir, exist_ok=True)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrig-ckpt")
        self._uploaders = ThreadPoolExecutor(max_workers=max(1, len(self.stores)), thread_name_prefix="torchrig-up")
        self._inflight: Future[SaveOutcome] | None = None
        self._lock = threading.Lock()
        self._last_save_time = time.monotonic()
        self._last_saved_step: int | None = None
        self._last_committed_step: int | None = None
        self.history: list[SaveOutcome] = []
        self._start_time = time.time()
        self._fence_token = f"{ctx.run_id}:{ctx.generation}:{uuid.uuid4().hex[:12]}"
        self._closed = False
        if ctx.rank == 0:
            for store in self.stores:
                try:
                    self._claim_fence(store)
                except Exception as exc:  # the store may be down now; claimed again at commit
                    log.warning("checkpoint store %s: cannot write fence: %s", store.name, exc)

    # ------------------------------------------------------------------ public API

    @property
    def last_committed_step(self) -> int | None:
        """Step of the newest checkpoint committed to at least one store (or restored), else None."""
        return self._last_committed_step

    def should_save(self, step: int) -> bool:
        """Whether a save is due at `step`; the same answer on every rank (collective when `every.seconds`)."""
        every = self.config.every
        if step == self._last_saved_step:
            return False
        due = every.steps is not None and step > 0 and step % every.steps == 0
        if every.seconds is not None:
            # Clocks differ between ranks: rank 0 decides and broadcasts, or ranks would disagree.
            flag = torch.tensor([1 if (due or time.monotonic() - self._last_save_time >= every.seconds) else 0])
            if self._distributed:
                dist.broadcast(flag, src=0, group=self._ctl_group)
            due = bool(flag.item())
        return due

    def save(self, step: int, state: dict[str, Any], *, final: bool = False) -> None:
        """Save `state` at `step` on every store (collective).

        Blocks only while the state is copied to CPU memory when `async` is on; a `final` save (and every
        save when `async` is off) returns once it is committed or failed.
        """
        if self._closed:
            raise CheckpointError("save after close()")
        if step == self._last_saved_step:
            if final:
                self.wait()
            return
        busy = torch.tensor([1 if self._inflight is not None and not self._inflight.done() else 0])
        if self._distributed:
            # Every rank must take the same branch: one rank skipping while another saves would hang.
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self._ctl_group)
        if busy.item():
            if self.config.if_busy is IfBusy.skip and not final:
                log.info("checkpoint at step %d skipped: the previous save is still in flight", step)
                self.sink.on_event("checkpoint_skipped", step=step, reason="busy")
                return
            self.wait()
        start = time.perf_counter()
        staged = self._stage(state)
        blocked_s = time.perf_counter() - start
        self._last_saved_step = step
        self._last_save_time = time.monotonic()
        self.sink.on_checkpoint(CheckpointRecord(step=step, blocked_s=blocked_s, committed=False, time=time.time()))
        synchronous = final or not self.config.async_
        self._inflight = self._executor.submit(
            self._run_save, step, staged, start, blocked_s, synchronous=synchronous, final=final
        )
        if synchronous:
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed or failed."""
        future = self._inflight
        if future is not None:
            future.result()

    def close(self) -> None:
        """Wait for the in-flight save and release the background threads."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            self._uploaders.shutdown(wait=True)

    def restore(self, state: dict[str, Any]) -> RestoreResult | None:
        """Load the newest valid checkpoint into `state` in place (collective).

        Returns:
            Where it came from, or None when there is nothing valid to restore (or `resume: never`).

        Raises:
            CheckpointError: `resume: required` and no valid checkpoint, or loading failed.
        """
        if self.config.resume is ResumePolicy.never:
            return None
        start = time.perf_counter()
        candidates = self._broadcast_obj(self._find_candidates() if self.ctx.rank == 0 else None)
        chosen: tuple[_Candidate, str, str, str, str] | None = None  # cand, dcp path, store, uri, source
        for cand in candidates:
            local = self._try_node_local(cand)
            if local is not None:
                chosen = (cand, local, "node-local", local, "node-local")
                break
            picked = self._broadcast_obj(self._pick_store_copy(cand) if self.ctx.rank == 0 else None)
            if picked is None:
                continue
            index, path = picked
            path = self._fetch_on_other_nodes(cand, index, path)
            store = self.stores[index]
            chosen = (cand, path, store.name, f"{store.uri.rstrip('/')}/{step_dir(cand.step)}", "store")
            break
        if chosen is None:
            if self.config.resume is ResumePolicy.required:
                raise CheckpointError(
                    "checkpoint.resume is `required` but no store holds a valid checkpoint "
                    f"({', '.join(s.uri for s in self.stores)})"
                )
            log.info("no valid checkpoint found; starting fresh")
            return None
        cand, path, store_name, uri, source = chosen
        try:
            with _quiet_single_process(self._distributed):
                dcp_load(
                    state,
                    storage_reader=FileSystemReader(path),
                    process_group=self._ckpt_group,
                    no_dist=not self._distributed,
                )
        except Exception as exc:
            raise CheckpointError(f"loading checkpoint step {cand.step} from {uri} failed: {exc}") from exc
        # Downloaded copies were only needed for the load; the stores (and node-local copy) keep theirs.
        self._barrier()
        if self.ctx.local_rank == 0:
            shutil.rmtree(os.path.join(self.node_dir, "restore"), ignore_errors=True)
        seconds = time.perf_counter() - start
        self._last_committed_step = cand.step
        self._last_saved_step = cand.step
        self._last_save_time = time.monotonic()
        result = RestoreResult(
            step=cand.step,
            store=store_name,
            uri=uri,
            world_size=cand.manifest.world_size,
            seconds=seconds,
            source=source,
        )
        log.info("restored step %d from %s (%s) in %.2f s", cand.step, store_name, uri, seconds)
        self.sink.on_restore(RestoreRecord(step=cand.step, store=store_name, seconds=seconds, source=source))
        return result

    # ------------------------------------------------------------------ collectives helpers

    def _broadcast_obj(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._ckpt_group)
        return box[0]

    def _min_all(self, flag: bool) -> bool:
        if not self._distributed:
            return flag
        t = torch.tensor([1 if flag else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._ckpt_group)
        return bool(t.item())

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier(group=self._ckpt_group)

    # ------------------------------------------------------------------ save pipeline

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """Copy the state to CPU memory: the floor of what training must wait for."""
        flat = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}
        staged: dict[str, Any] = tree_map(_copy_leaf, flat)
        return staged

    def _run_save(
        self, step: int, staged: dict[str, Any], start: float, blocked_s: float, *, synchronous: bool, final: bool
    ) -> SaveOutcome:
        outcome = SaveOutcome(step=step, blocked_s=blocked_s)
        try:
            self._save_pipeline(step, staged, outcome, final)
        except Exception as exc:
            # A failed save must not take training down: the next one is a fresh attempt.
            log.exception("checkpoint at step %d failed", step)
            outcome.committed = False
            outcome.stores_failed.setdefault("*", f"{type(exc).__name__}: {exc}")
        outcome.save_s = time.perf_counter() - start
        if synchronous:
            outcome.blocked_s = outcome.save_s
        if outcome.committed:
            self._last_committed_step = step
        self.history.append(outcome)
        for name, error in outcome.stores_failed.items():
            self.sink.on_store_failure(name, error)
        self.sink.on_checkpoint(
            CheckpointRecord(
                step=step,
                blocked_s=outcome.blocked_s,
                save_s=outcome.save_s,
                bytes=outcome.bytes,
                committed=outcome.committed,
                stores_ok=list(outcome.stores_ok),
                stores_failed=sorted(outcome.stores_failed),
                time=time.time(),
            )
        )
        return outcome

    def _save_pipeline(self, step: int, staged: dict[str, Any], outcome: SaveOutcome, final: bool) -> None:
        ctx = self.ctx
        local_step = os.path.join(self.node_dir, step_dir(step))
        local_dcp = os.path.join(local_step, gen_dir(ctx.generation))
        if ctx.local_rank == 0 and os.path.exists(local_step):
            # Left over by a crashed save of this step: stale shard files must not join this checkpoint.
            shutil.rmtree(local_step, ignore_errors=True)
        self._barrier()
        with _quiet_single_process(self._distributed):
            metadata = dcp_save(
                staged,
                storage_writer=FileSystemWriter(local_dcp, sync_files=False),
                process_group=self._ckpt_group,
                no_dist=not self._distributed,
            )
        del staged
        # Every rank knows every file from the metadata; it hashes and uploads only its own.
        all_files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
        mine = [f for f in all_files if f.startswith(f"__{ctx.rank}_")]
        if ctx.rank == 0:
            mine.append(_DCP_METADATA)
        entries: list[FileEntry] = []
        for name in mine:
            digest, size = sha256_file(os.path.join(local_dcp, name))
            entries.append(FileEntry(f"{gen_dir(ctx.generation)}/{name}", size, digest, ctx.rank, ctx.node_rank))
        uploads = {
            i: self._uploaders.submit(self._upload, store, step, local_step, entries)
            for i, store in enumerate(self.stores)
        }
        errors: dict[int, str] = {}
        for i, fut in uploads.items():
            err = fut.result()
            if err is not None:
                errors[i] = err
        gathered: list[Any] = [(entries, errors)]
        if self._distributed:
            gathered = [None] * ctx.world_size
            dist.all_gather_object(gathered, (entries, errors), group=self._ckpt_group)
        all_entries = [e for ents, _ in gathered for e in ents]
        manifest = Manifest(
            step=step,
            world_size=ctx.world_size,
            generation=ctx.generation,
            job=ctx.job,
            time=time.time(),
            torch_version=torch.__version__,
            files=sorted(all_entries, key=lambda e: e.path),
            num_nodes=ctx.num_nodes,
            run_id=ctx.run_id,
            final=final,
        )
        result: dict[str, Any] = {"ok": [], "failed": {}}
        if ctx.rank == 0:
            result = self._commit(manifest, [errs for _, errs in gathered])
        result = self._broadcast_obj(result)
        outcome.bytes = manifest.total_bytes
        outcome.stores_ok = list(result["ok"])
        outcome.stores_failed = dict(result["failed"])
        outcome.committed = bool(outcome.stores_ok)
        if ctx.local_rank == 0:
            self._after_commit_local(manifest, local_step, outcome)
        self._barrier()

    def _upload(self, store: FsspecStorage, step: int, local_step: str, entries: list[FileEntry]) -> str | None:
        try:
            for entry in entries:
                rel = f"{step_dir(step)}/{entry.path}"
                store.put_file(os.path.join(local_step, entry.path), rel)
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
        committed: list[FsspecStorage] = []
        for i, store in enumerate(self.stores):
            errs = [e[i] for e in per_rank_errors if i in e]
            if errs:
                failed[store.name] = errs[0]
                log.warning("checkpoint step %d: store %s failed: %s", manifest.step, store.name, errs[0])
                continue
            try:
                stale = self._fenced_out(store, manifest)
                if stale:
                    failed[store.name] = f"fenced: {stale}"
                    log.error("checkpoint step %d NOT committed to %s: %s", manifest.step, store.name, stale)
                    self.sink.on_event("checkpoint_fenced", step=manifest.step, store=store.name, reason=stale)
                    continue
                store.write_bytes_atomic(f"{step_dir(manifest.step)}/{MANIFEST_NAME}", manifest.to_json())
                ok.append(store.name)
                committed.append(store)
            except Exception as exc:
                failed[store.name] = f"{type(exc).__name__}: {exc}"
                log.warning("checkpoint step %d: commit to %s failed: %s", manifest.step, store.name, exc)
        # Retention only after the commit round, so an old checkpoint goes only once the new one is
        # committed everywhere it could be.
        for store in committed:
            try:
                self._retain(store)
            except Exception as exc:
                log.warning("retention in %s failed: %s", store.name, exc)
        return {"ok": ok, "failed": failed}

    def _fence_doc(self) -> dict[str, Any]:
        return {
            "token": self._fence_token,
            "run_id": self.ctx.run_id,
            "generation": self.ctx.generation,
            "time": self._start_time,
            "job": self.ctx.job,
        }

    def _is_newer_than(self, other: dict[str, Any]) -> bool:
        if (
            self.ctx.run_id
            and other.get("run_id") == self.ctx.run_id
            and other.get("generation") != self.ctx.generation
        ):
            return self.ctx.generation > int(other.get("generation", -1))
        return self._start_time > float(other.get("time", 0.0))

    def _read_fence(self, store: FsspecStorage) -> dict[str, Any] | None:
        import json

        try:
            doc = json.loads(store.read_bytes(FENCE_NAME))
        except FileNotFoundError:
            return None
        return doc if isinstance(doc, dict) else None

    def _claim_fence(self, store: FsspecStorage) -> bool:
        """Record this writer's token unless a newer writer holds the store; True when ours."""
        import json

        current = self._read_fence(store)
        if current is not None and current.get("token") == self._fence_token:
            return True
        if current is None or self._is_newer_than(current):
            store.write_bytes_atomic(FENCE_NAME, json.dumps(self._fence_doc()).encode())
            return True
        return False

    def _fenced_out(self, store: FsspecStorage, manifest: Manifest) -> str | None:
        """Why this writer must not commit to `store` (a newer writer holds it), or None."""
        if not self._claim_fence(store):
            holder = self._read_fence(store) or {}
            return (
                f"a newer writer holds the store (generation {holder.get('generation')}, "
                f"run {holder.get('run_id') or '?'}); this one is generation {self.ctx.generation}"
            )
        try:
            existing = read_manifest(store, manifest.step)
        except (FileNotFoundError, ValueError):
            return None
        if existing.generation > manifest.generation and existing.run_id == manifest.run_id:
            return f"step {manifest.step} is already committed by newer generation {existing.generation}"
        return None

    def _retain(self, store: FsspecStorage) -> None:
        listing = list_checkpoints(store)
        committed = [c for c in listing if c.committed]
        kept = committed[: self.config.keep]
        if not kept:
            return
        oldest_kept = min(c.step for c in kept)
        kept_steps = {c.step for c in kept}
        for c in listing:
            if c.step in kept_steps or c.step > oldest_kept:
                continue  # newer uncommitted/corrupt directories are evidence: never deleted
            log.info(
                "retention: deleting %s/%s (%s)",
                store.name,
                step_dir(c.step),
                "committed" if c.committed else "uncommitted",
            )
            store.delete_dir(step_dir(c.step))

    def _after_commit_local(self, manifest: Manifest, local_step: str, outcome: SaveOutcome) -> None:
        """Local rank 0: keep (and complete) the node-local copy, or drop the staging directory."""
        if not self.config.node_local.enabled:
            shutil.rmtree(local_step, ignore_errors=True)
            return
        if not outcome.committed:
            # Never committed: not a valid node-local copy; the previous one stays.
            shutil.rmtree(local_step, ignore_errors=True)
            return
        ctx = self.ctx
        if self.config.node_local.replicate_to_peer and ctx.num_nodes > 1:
            peer = (ctx.node_rank + 1) % ctx.num_nodes
            source = next(s for s in self.stores if s.name in outcome.stores_ok)
            try:
                for entry in manifest.files:
                    local = os.path.join(local_step, entry.path)
                    if (entry.node_rank == peer or entry.path.endswith(_DCP_METADATA)) and not os.path.exists(local):
                        source.get_file(f"{step_dir(manifest.step)}/{entry.path}", local)
            except Exception as exc:
                log.warning("peer replication of step %d from %s failed: %s", manifest.step, source.name, exc)
        with open(os.path.join(local_step, MANIFEST_NAME), "wb") as fh:
            fh.write(manifest.to_json())
        for name in os.listdir(self.node_dir):
            step = parse_step_dir(name)
            if step is not None and step != manifest.step:
                shutil.rmtree(os.path.join(self.node_dir, name), ignore_errors=True)

    # ------------------------------------------------------------------ restore helpers

    def _find_candidates(self) -> list[_Candidate]:
        """Rank 0: committed checkpoints in every store (and the node-local copy), newest first."""
        found: dict[tuple[int, int, str], _Candidate] = {}
        for i, store in enumerate(self.stores):
            try:
                listing = list_checkpoints(store)
            except Exception as exc:
                log.warning("cannot list checkpoint store %s: %s", store.name, exc)
                self.sink.on_store_failure(store.name, f"list: {type(exc).__name__}: {exc}")
                continue
            for c in listing:
                if c.manifest is None:
                    if c.error:
                        log.warning(
                            "store %s: %s has a bad manifest (%s); ignored", store.name, step_dir(c.step), c.error
                        )
                    continue
                key = (c.step, c.manifest.generation, c.manifest.run_id)
                if key in found:
                    found[key].stores.append(i)
                else:
                    found[key] = _Candidate(c.step, c.manifest, [i])
        if self.config.node_local.enabled:
            for name in os.listdir(self.node_dir):
                step = parse_step_dir(name)
                path = os.path.join(self.node_dir, name, MANIFEST_NAME)
                if step is None or not os.path.isfile(path):
                    continue
                try:
                    with open(path, "rb") as fh:
                        manifest = Manifest.from_json(fh.read())
                except (OSError, ValueError, TypeError, KeyError):
                    continue
                key = (step, manifest.generation, manifest.run_id)
                if key not in found:
                    found[key] = _Candidate(step, manifest, [])
        return sorted(found.values(), key=lambda c: (c.step, c.manifest.generation, c.manifest.time), reverse=True)

    def _try_node_local(self, cand: _Candidate) -> str | None:
        """Collective: the node-local DCP dir of `cand` when every node holds a verified full copy."""
        if not self.config.node_local.enabled:
            return None
        local_step = os.path.join(self.node_dir, step_dir(cand.step))
        ok = True
        if self.ctx.local_rank == 0:
            ok = os.path.isdir(local_step) and verify_local(local_step, cand.manifest).ok
        if not self._min_all(ok):
            return None
        return os.path.join(local_step, cand.manifest.dcp_dir)

    def _pick_store_copy(self, cand: _Candidate) -> tuple[int, str] | None:
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

    def _restore_dir(self, cand: _Candidate) -> str:
        return os.path.join(self.node_dir, "restore", step_dir(cand.step))

    def _materialize(self, store: FsspecStorage, cand: _Candidate) -> str | None:
        """Verify `cand` in `store` (downloading it when remote); the local DCP dir, or None if corrupt."""
        local_root = store.local_path(step_dir(cand.step))
        if local_root is not None:
            report = verify_store(store, cand.manifest)
            path = os.path.join(local_root, cand.manifest.dcp_dir)
        else:
            target = self._restore_dir(cand)
            shutil.rmtree(target, ignore_errors=True)
            for entry in cand.manifest.files:
                store.get_file(f"{step_dir(cand.step)}/{entry.path}", os.path.join(target, entry.path))
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
        self.sink.on_event("checkpoint_corrupt", step=cand.step, store=store.name, detail=report.summary())
        return None

    def _fetch_on_other_nodes(self, cand: _Candidate, index: int, path: str) -> str:
        """Collective: make the chosen copy readable on every node (rank 0's node already has it)."""
        store = self.stores[index]
        if store.local_path() is not None:
            return path  # a file:// store is a shared filesystem: read in place everywhere
        target = self._restore_dir(cand)
        ok = True
        rank0_node = self._rank0_node()
        if self.ctx.local_rank == 0 and self.ctx.node_rank != rank0_node:
            try:
                shutil.rmtree(target, ignore_errors=True)
                for entry in cand.manifest.files:
                    store.get_file(f"{step_dir(cand.step)}/{entry.path}", os.path.join(target, entry.path))
                ok = verify_local(target, cand.manifest).ok
            except Exception as exc:
                log.error(
                    "node %d: download of step %d from %s failed: %s", self.ctx.node_rank, cand.step, store.name, exc
                )
                ok = False
        if not self._min_all(ok):
            raise CheckpointError(f"step {cand.step} from {store.name} could not be fetched on every node")
        return os.path.join(target, cand.manifest.dcp_dir)

    def _rank0_node(self) -> int:
        node = self._broadcast_obj(self.ctx.node_rank if self.ctx.rank == 0 else None)
        return int(node)
