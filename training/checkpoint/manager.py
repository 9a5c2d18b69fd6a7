"""The checkpoint manager: sharded (DCP), redundant, verified, asynchronous, fenced checkpoints.

This module is the facade; each part of the protocol lives in its own module.

One save, on every rank (`save`):

1. *staging* (the only part training waits for): the state is copied to CPU memory;
2. in a background thread: `dcp.save` of the copy written once into every store (and the node-local
   copy) in parallel, digests computed while writing (no staging directory, no read-back; `writer`);
   object stores upload from a written copy;
3. the ranks exchange their file lists over a dedicated gloo group; rank 0 writes, per store where every
   rank's upload succeeded and the fence still names this writer, `step-N/manifest.json` LAST: the commit
   marker. One store failing never stops training or the other stores; it is retried at the next save.

Restore (`restore`): rank 0 lists the manifests of every store (and the node-local copy), keeps this
job's own (a manifest names its job; other jobs' checkpoints in a shared store are skipped, with one log
line) and broadcasts them, newest first; every rank loads one copy with `dcp.load` (which reshards when
the world size changed), the node-local copy first, then file stores, then object stores, reading each
file it needs once and checking it against the manifest before any of it is loaded (a bad copy fails on
every rank at once: the next copy, then an older step, is tried). A store that cannot be listed is
unknown, not empty: with nothing found elsewhere the restore lists again within the I/O limit, then
stops the rank retryably (exit 205) rather than start over. Only when every store answered and none
holds a checkpoint of the job does `checkpoint.initFrom` warm-start it from another job's (`warmstart`).

Retention (`retention`, per store, after a commit is recorded, this job's checkpoints only): the newest `keep`
committed checkpoints stay; older committed ones are deleted, and so are uncommitted step directories
older than the oldest kept one (debris of crashed saves). Uncommitted or corrupt step directories NEWER
than that are never deleted: they are the evidence of what went wrong. Only the step just committed (and
size-checked) can make room, and it is never deleted itself, so the last valid checkpoint is never deleted.

Fencing (`fence`): when a writer starts, rank 0 takes a writer generation: a number above every earlier
writer's, created exclusively as `<store>/fences/<n>.json` (atomic on file stores and S3), so it grows
across restarts and across launches (a resubmitted job, a recreated pod). Before committing, rank 0 lists
the fences: a newer fence of the same job means this writer is stale, and it refuses to commit; right
after committing it looks again and withdraws its manifest if it lost the fence meanwhile. Shards go under
`step-N/gen-G/`, so a stale writer cannot clobber a newer generation's files either.

Trust (`signing`, `storage`): manifest file paths are accepted only in the writer's layout and every path
is checked to stay inside its store; with `TORCHRIG_CHECKPOINT_KEY` set, manifests are HMAC-signed and an
unsigned or wrongly signed one is never restored.

Modules: `save` (staging, background save, upload, commit), `writer` (the tee DCP writes through),
`fence`, `retention`, `restore` (the search), `warmstart` (`initFrom`), `collectives` (the gloo groups),
`manifest` (layout, commit marker, verification), `signing`, `storage` (the store Protocol),
`dcp_metadata` (reading DCP metadata safely).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from training.checkpoint.collectives import Collectives
from training.checkpoint.fence import Fence
from training.checkpoint.restore import LIST_RETRY_SHARE, RestoreSearch
from training.checkpoint.results import CheckpointError, RestoreResult, SaveOutcome
from training.checkpoint.save import SavePipeline, stage
from training.checkpoint.signing import signing_key_from_env
from training.checkpoint.storage import CheckpointStorage, open_storage
from training.checkpoint.warmstart import weights_only
from training.config import CheckpointConfig, IfBusy, InitMode, ResumePolicy
from training.contract import EventKind, WorkerIdentity
from training.metrics.base import CheckpointRecord, MetricsSink, RestoreRecord

__all__ = ["CheckpointError", "CheckpointManager", "RestoreResult", "SaveOutcome"]

log = logging.getLogger(__name__)


def _restore_record(result: RestoreResult) -> RestoreRecord:
    return RestoreRecord(
        step=result.step, store=result.store, seconds=result.seconds, source=result.source, certified=result.certified
    )


def _node_dir(config: CheckpointConfig, identity: WorkerIdentity) -> str:
    """This node's staging (and node-local copy) directory."""
    if config.node_local.enabled:
        root = os.path.join(config.node_local.path, identity.job)
    else:
        base = identity.run_dir or os.path.join(tempfile.gettempdir(), f"torchrig-{identity.job}")
        root = os.path.join(base, ".checkpoint-staging")
    # One directory per node: on one machine emulating several nodes they must not share it.
    return os.path.join(root, f"node-{identity.node_rank}")


class CheckpointManager:
    """Saves and restores a job's state; see the module docstring for the protocol.

    Args:
        config: the `spec.checkpoint` section.
        identity: this rank (job, rank, node, restart count, run id, run directory).
        sink: metrics sink for checkpoint, store-failure and restore records (default: none).
        fence_now: rank 0 takes its writer generation at construction (False: at the first save).

    The manifest signing key comes from `Env.CHECKPOINT_KEY` (`signing.signing_key_from_env`).
    Construction, `restore`, `should_save` and `save` are collective: every rank calls them, in the same
    order. With no process group (or world size 1) everything runs in this process.

    Raises:
        ValueError: The signing key in the environment is too short.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        identity: WorkerIdentity,
        sink: MetricsSink | None = None,
        *,
        fence_now: bool = True,
    ) -> None:
        self.config = config
        self.identity = identity
        self._sink = sink or MetricsSink()
        self.stores: list[CheckpointStorage] = [
            open_storage(s.resolved_uri(identity.run_dir), s.options, s.display_name) for s in config.stores
        ]
        self._coll = Collectives(timeout_s=config.io_timeout_seconds)
        self.node_dir = _node_dir(config, identity)
        os.makedirs(self.node_dir, exist_ok=True)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrig-ckpt")
        self._inflight: Future[SaveOutcome] | None = None
        self._last_save_time = time.monotonic()
        self._last_saved_step: int | None = None
        self._last_committed_step: int | None = None
        self.history: list[SaveOutcome] = []
        self._key = signing_key_from_env()
        self._fence = Fence(identity)
        self._pipeline = SavePipeline(
            config, identity, self._sink, self.stores, self._coll, self._fence, self.node_dir, self._key
        )
        self._search = RestoreSearch(
            identity,
            self._sink,
            self.stores,
            self._coll,
            self.node_dir,
            owner=identity.job,
            node_local=config.node_local.enabled,
            key=self._key,
            list_retry_s=config.io_timeout_seconds * LIST_RETRY_SHARE,
        )
        self._init_search: RestoreSearch | None = None
        if config.init_from is not None:
            source = config.init_from.store()
            init_store = open_storage(source.resolved_uri(identity.run_dir), source.options, source.display_name)
            self._init_search = RestoreSearch(
                identity,
                self._sink,
                [init_store],
                self._coll,
                self.node_dir,
                owner=None,
                key=self._key,
                step=config.init_from.step,
                source="init",
                list_retry_s=config.io_timeout_seconds * LIST_RETRY_SHARE,
            )
        self._closed = False
        # Rank 0 takes its writer generation now (a store write per store) unless `fence_now` is off: the
        # manager that an in-place recovery builds leaves it to its first save's background thread, out
        # of the recovery's critical path (the abandoned manager's saves cannot commit: a member is gone).
        if identity.rank == 0 and fence_now:
            try:
                self._fence.acquire(self.stores)
            except Exception as exc:  # the stores may be down now; taken again at the first save
                log.warning("checkpoint: cannot take a writer generation now: %s", exc)

    @property
    def sink(self) -> MetricsSink:
        """Where checkpoint, store-failure, restore and event records go (replaceable at any time)."""
        return self._sink

    @sink.setter
    def sink(self, sink: MetricsSink) -> None:
        self._sink = self._pipeline.sink = self._search.sink = sink
        if self._init_search is not None:
            self._init_search.sink = sink

    @property
    def control_group(self) -> Any:
        """The gloo group of the foreground decisions (None in one process): the preemption agreement
        rides on it (`training.preemption.Agreement`) instead of building a group of its own."""
        return self._coll.control

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
            due = self._coll.broadcast_control(due or time.monotonic() - self._last_save_time >= every.seconds)
        return due

    def save(
        self, step: int, state: dict[str, Any], *, final: bool = False, synchronous: bool = False
    ) -> SaveOutcome | None:
        """Save `state` at `step` on every store (collective).

        Blocks only while the state is copied to CPU memory when `async` is on; a `final` or `synchronous`
        save (and every save when `async` is off) returns once it is committed or failed, and is never
        skipped for a save in flight (it waits for it): the preemption handler's emergency checkpoint.

        Returns:
            The outcome of a save that returns once done (None when it runs on, or was skipped).
        """
        if self._closed:
            raise CheckpointError("save after close()")
        if step == self._last_saved_step:
            if final:
                self.wait()
            return None
        # Every rank must take the same branch: one rank skipping while another saves would hang.
        if self._coll.any_control(self._inflight is not None and not self._inflight.done()):
            if self.config.if_busy is IfBusy.skip and not (final or synchronous):
                log.info("checkpoint at step %d skipped: the previous save is still in flight", step)
                self.sink.on_event(EventKind.CHECKPOINT_SKIPPED, step=step, reason="busy")
                return None
            self.wait()
        start = time.perf_counter()
        staged = stage(state)
        blocked_s = time.perf_counter() - start
        self._last_saved_step = step
        self._last_save_time = time.monotonic()
        self.sink.on_checkpoint(CheckpointRecord(step=step, blocked_s=blocked_s, committed=False, time=time.time()))
        synchronous = synchronous or final or not self.config.async_
        self._inflight = self._executor.submit(
            self._run_save, step, staged, start, blocked_s, synchronous=synchronous, final=final
        )
        if synchronous:
            return self._inflight.result()  # committed or failed (the pipeline never raises)
        return None

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed or failed."""
        future = self._inflight
        if future is not None:
            future.result()

    def certify(self, step: int, agreed: bool) -> None:
        """Record whether the replicas agreed at `step` (`training.sdc`), for the manifest of its save."""
        self._pipeline.certified[step] = agreed

    @property
    def prefer_certified(self) -> bool:
        """Restore the newest certified checkpoint before any newer uncertified one (`sdc` on)."""
        return self._search.prefer_certified

    @prefer_certified.setter
    def prefer_certified(self, value: bool) -> None:
        self._search.prefer_certified = value

    @property
    def manifest_extra(self) -> dict[str, Any]:
        """Plain JSON facts added to every manifest this manager commits from now on (rank 0's count)."""
        return self._pipeline.manifest_extra

    def close(self) -> None:
        """Wait for the in-flight save and release the background threads."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            self._pipeline.close()

    def restore(self, state: dict[str, Any]) -> RestoreResult | None:
        """Load this job's newest valid checkpoint into `state` in place (collective).

        With none (or `resume: never`) and `initFrom` set, warm-start from that checkpoint instead.

        Returns:
            Where it came from (`source` "init" for a warm start), or None when there is nothing to load.

        Raises:
            CheckpointError: `resume: required` and no valid checkpoint; `initFrom` set and no valid
                checkpoint there; or loading failed.
        """
        result = None
        if self.config.resume is not ResumePolicy.never:
            required = None
            if self.config.resume is ResumePolicy.required:
                required = "checkpoint.resume is `required` but no store holds a valid checkpoint of this job"
            result = self._search.restore(state, required=required)
        if result is None and self._init_search is not None:
            return self._warm_start(state, self._init_search)
        if result is None:
            return None
        self._last_committed_step = result.step
        self._last_saved_step = result.step
        self._last_save_time = time.monotonic()
        log.info("restored step %d from %s (%s) in %.2f s", result.step, result.store, result.uri, result.seconds)
        self.sink.on_restore(_restore_record(result))
        return result

    def _warm_start(self, state: dict[str, Any], search: RestoreSearch) -> RestoreResult:
        """Load the `initFrom` checkpoint (all of it, or the model weights only) into `state`."""
        init = self.config.init_from
        assert init is not None
        target, apply = (state, None) if init.mode is InitMode.full else weights_only(state)
        at = f" step {init.step}" if init.step is not None else ""
        result = search.restore(target, required=f"checkpoint.initFrom: no valid checkpoint{at} in {init.uri}")
        assert result is not None
        if apply is not None:
            apply()
        log.info(
            "no checkpoint of job %s: warm start (%s) from step %d of %s",
            self.identity.job,
            init.mode.value,
            result.step,
            result.uri,
        )
        self.sink.on_restore(_restore_record(result))
        return result

    def _run_save(
        self, step: int, staged: dict[str, Any], start: float, blocked_s: float, *, synchronous: bool, final: bool
    ) -> SaveOutcome:
        """The background thread's job: the pipeline, then the bookkeeping and the records."""
        with commit_priority():
            outcome = self._pipeline.run(step, staged, start, blocked_s, synchronous=synchronous, final=final)
        if outcome.committed:
            self._last_committed_step = step
        self.history.append(outcome)
        self._pipeline.report(outcome)
        self._pipeline.retire()  # retention, once the commit is on record
        return outcome


# While a commit runs beside the training loop, the interpreter hands the GIL over every this many
# seconds instead of its default 5 ms (`sys.setswitchinterval`). The commit thread's work between its
# GIL-releasing calls (hashing, writes, fsync) is short Python, and each return to Python waits for the
# training thread to give the GIL up: at 5 ms a turn that wait dominates a busy job's commit
# (docs/performance.md, `checkpoint_commit`). None keeps the interpreter's setting.
COMMIT_SWITCH_INTERVAL_S: float | None = 0.0005
_priority_lock = threading.Lock()
_priority_users = 0
_priority_saved: float | None = None


@contextlib.contextmanager
def commit_priority() -> Iterator[None]:
    """Shorten the GIL switch interval for as long as any commit runs (nested and concurrent uses share
    one change; the last one out restores the interpreter's value)."""
    global _priority_users, _priority_saved
    interval = COMMIT_SWITCH_INTERVAL_S
    if interval is None:
        yield
        return
    with _priority_lock:
        if _priority_users == 0:
            _priority_saved = sys.getswitchinterval()
            if interval < _priority_saved:
                sys.setswitchinterval(interval)
        _priority_users += 1
    try:
        yield
    finally:
        with _priority_lock:
            _priority_users -= 1
            if _priority_users == 0 and _priority_saved is not None:
                sys.setswitchinterval(_priority_saved)
                _priority_saved = None
