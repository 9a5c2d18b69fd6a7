"""The restore search: find the newest valid checkpoint and load it everywhere, verified while read.

Rank 0 lists the manifests of every store (and the node-local copy), keeps this job's own checkpoints
(`owner`) and broadcasts them, newest first. For each, every rank loads it with `dcp.load` (which
reshards when the world size changed) through a `VerifiedReader`: the files this rank needs are read
once, in parallel parts, straight from the copy (the node-local copy first, then file stores, then object
stores: no download directory), hashed while read, and checked against the manifest before any of them
is loaded. A copy that fails (missing, wrong size, wrong digest, unreadable) fails on every rank at once
(DCP passes one rank's failure to all), and the next copy, then the next older step, is tried.

Whose checkpoint: a manifest names its job. Other jobs' checkpoints in a shared store are skipped,
with one log line naming them. A manifest without a job name (written before manifests carried one)
is taken as this job's only when the store holds no other job's checkpoint, and a log line says so.
The same search, with `owner=None` (any job) and a fixed step, serves `checkpoint.initFrom`.

A store that cannot be listed (an object store's timeout, a file store whose path is no longer a
directory) or whose manifests cannot be read is unknown, not empty: it may hold this job's newest
checkpoints. When no store that answered holds one, rank 0 lists again with backoff for
`list_retry_s` (a share of `checkpoint.ioTimeoutSeconds`), and if a store still does not answer, every
rank raises `CheckpointStoreUnavailableError` (the worker exits 205, retryable) instead of starting over
from step 0 or taking `initFrom`. Only rank 0 lists, and what it found (the unanswered stores too) is
broadcast, so the ranks never split over a store one of them could read and another could not.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from training.checkpoint.collectives import Collectives
from training.checkpoint.fence import damaged_owners
from training.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointListing,
    Manifest,
    list_checkpoints,
    parse_manifest,
    parse_step_dir,
    step_dir,
    verify_store,
)
from training.checkpoint.reader import VerifiedReader, VerifyError
from training.checkpoint.results import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointKeyError,
    CheckpointMismatchError,
    CheckpointStoreUnavailableError,
    RestoreResult,
)
from training.checkpoint.retention import exclusive_to
from training.checkpoint.storage import CheckpointStorage, open_storage
from training.contract import Env, EventKind, WorkerIdentity
from training.metrics.base import MetricsSink

__all__ = ["LIST_RETRY_SHARE", "Candidate", "RestoreSearch", "SafeLoadPlanner", "StateMismatch", "order_candidates"]

log = logging.getLogger(__name__)

# The share of `checkpoint.ioTimeoutSeconds` that rank 0 spends listing a store that does not answer
# again: the restore runs under that limit (the watchdog's, and the other ranks' wait in the broadcast),
# so the rest is left for loading what the listing finds once the store is back.
LIST_RETRY_SHARE = 0.5
LIST_RETRY_FIRST_S = 0.5  # the first pause between listings, doubled after each one up to the maximum
LIST_RETRY_MAX_S = 30.0
WHY_MAX_CHARS = 300  # a store's error, as the rank's one last line names it
# How the `store_failure` event of a store the restore gave up on begins (drills look for it).
RESTORE_GAVE_UP = "restore: unreadable, refusing to start over"


@dataclass(frozen=True)
class Candidate:
    """One committed checkpoint and where copies of it are."""

    step: int
    manifest: Manifest
    stores: list[int]  # indexes into the manager's stores; -1 = rank 0's node-local copy


def order_candidates(candidates: list[Candidate], *, prefer_certified: bool = False) -> list[Candidate]:
    """The restore order: newest first; with `prefer_certified` (`sdc` on), a checkpoint whose manifest says
    `certified: false` after every other. One that says nothing (`certified` absent: saved where no replica
    check runs, e.g. at one rank, under FSDP or with `sdc` off) keeps its place: it is no evidence of a
    corruption, and passing over it would retrain its steps (a job that ran at one rank for a while, then
    at two, restored the older two-rank checkpoint). With `sdc` on every save is checked first and a
    disagreement commits nothing, so the newest checkpoint after an `sdc` event is a certified one."""

    def key(c: Candidate) -> tuple[bool, int, int, float]:
        trusted = not (prefer_certified and c.manifest.certified is False)
        return (trusted, c.step, c.manifest.generation, c.manifest.time)

    return sorted(candidates, key=key, reverse=True)


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
        list_retry_s: for how long rank 0 lists again, with backoff, while no store that answered holds
            a checkpoint and another store did not answer (0: list once).
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
        list_retry_s: float = 0.0,
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
        self.list_retry_s = list_retry_s
        self._foreign: dict[tuple[str, str], list[int]] = defaultdict(list)  # (store, job) -> steps skipped
        self._legacy: dict[str, list[int]] = defaultdict(list)  # store -> job-less steps taken as ours
        # store -> steps whose manifest names this job but fails its signature (another key signed it)
        self._wrongly_signed: dict[str, list[int]] = defaultdict(list)
        # store -> steps of this job (by their fence, or the job their text names) whose manifest is damaged
        self._damaged: dict[str, list[int]] = defaultdict(list)
        self._unlisted: dict[str, str] = {}  # rank 0: store -> why it could not be listed (or read)
        self._attempts = 0  # rank 0: listings of the last search
        self._transient = False  # a copy failed otherwise than by its integrity check (see `restore`)
        self._mismatch: str | None = None  # the first copy whose keys or shapes did not fit the state
        # `sdc` on: certified checkpoints (the replicas agreed at their step) come before any newer
        # uncertified one, which may carry a corruption the replicas disagreed on (`training.sdc`).
        self.prefer_certified = False

    def restore(self, state: dict[str, Any], *, required: str | None = None) -> RestoreResult | None:
        """Load the newest valid checkpoint into `state` in place; None when this job has none.

        Args:
            state: what to load into (DCP state dict, Statefuls allowed).
            required: when set, finding nothing raises CheckpointError with this message.

        Raises:
            CheckpointError: `required` and no valid checkpoint; this job has committed checkpoints but
                not one copy loads; or loading failed after part of the state was loaded.
        """
        start = time.perf_counter()
        rank0 = self.identity.rank == 0
        candidates, wrongly_signed, damaged, unlisted, attempts = self.coll.broadcast_obj(
            (self._search(), dict(self._wrongly_signed), dict(self._damaged), dict(self._unlisted), self._attempts)
            if rank0
            else None
        )
        partial = False  # a load failed on some rank after another rank had loaded its part
        self._mismatch = None
        # Whether some copy failed for a reason a later start may not meet again (a store that did not
        # answer, an error other than a failed integrity check): only without one is the verdict final.
        self._transient = bool(unlisted)
        for cand in candidates:
            local = self._node_local_copy(cand)
            if local is not None:
                outcome = self._load(state, cand, local, "node-local")
                if outcome is None:
                    return self._result(cand, "node-local", local.uri, "node-local", start)
                partial = partial or self.coll.distributed
            # Copies in the stores, fastest first (a local filesystem before an object store); each is
            # read once, verified while read, and loaded only when every file this rank needs verified.
            order = sorted(cand.stores, key=lambda i: self.stores[i].local_path() is None)
            for i in order:
                store = self.stores[i]
                if not self.coll.min_all(self._sizes_ok(store, cand) if rank0 else True):
                    continue
                outcome = self._load(state, cand, _StoreView(store, step_dir(cand.step)), store.name)
                if outcome is None:
                    uri = f"{store.uri.rstrip('/')}/{step_dir(cand.step)}"
                    return self._result(cand, store.name, uri, self.source, start)
                partial = partial or self.coll.distributed
        # Collective, like the loop above: every rank raises the same error (and exits with the same code).
        # Retryable unless every copy failed its integrity check in a store that answered (`final`): then
        # a restart would only meet the same verdict, and the error is permanent.
        final = bool(candidates) and self.coll.min_all(not self._transient)
        steps = sorted({c.step for c in candidates}, reverse=True)
        if final and self._mismatch is not None:
            # DCP's planner hands every rank the same failures: each rank raises the same error.
            if self.owner is None:  # checkpoint.initFrom
                raise CheckpointMismatchError(
                    f"checkpoint.initFrom: the checkpoint (step {steps[0]}) does not fit this job's model: "
                    f"{self._mismatch}"
                )
            raise CheckpointMismatchError(
                f"this job's checkpoints (steps {steps}) do not fit its model: {self._mismatch}. The model or "
                "its task.args changed under the same job name, and a store's checkpoints are a job's by "
                "name: give this one another metadata.name, or set checkpoint.resume: never to start fresh "
                "on purpose"
            )
        error = CheckpointCorruptError if final else CheckpointError
        verdict = "every copy is corrupt or incomplete" if final else "no copy of any of them could be loaded"
        hint = (
            "(see the checkpoint_corrupt events). Check them with `torchrig checkpoints verify`, or set "
            "checkpoint.resume: never to start fresh on purpose"
        )
        if partial and not final:
            # Some rank may have loaded part of its state before another rank's copy failed: that state
            # is neither the checkpoint's nor a fresh one, whatever `required` says.
            raise error(
                f"this job committed checkpoints of steps {steps} but {verdict}; part of the state may "
                f"have been loaded on some rank, so this process cannot start from it {hint}"
            )
        if unlisted and not candidates:
            # A store that did not answer may hold this job's checkpoints: starting over (or from
            # initFrom) could drop all their progress. Stop, retryably; a later start may find it back.
            raise self._unavailable(unlisted, attempts, time.perf_counter() - start)
        if wrongly_signed and not candidates:
            # This job's checkpoints, by the job their manifests name, fail their signature: the key set
            # here is not the one that signed them (rotated, mistyped, another environment's Secret) or
            # they were forged. Loading them is out of the question; starting over from step 0 would
            # silently drop all their progress, and no restart fixes a key: stop, permanently, and say so.
            where = "; ".join(f"{store}: steps {_steps(steps)}" for store, steps in sorted(wrongly_signed.items()))
            raise CheckpointKeyError(
                f"job {self.owner!r}'s checkpoints ({where}) fail their signature check with this "
                f"{Env.CHECKPOINT_KEY}: they were signed with another key (or forged). Set the key that "
                "signed them, or checkpoint.resume: never to start fresh on purpose"
            )
        if damaged and not candidates:
            # Every manifest this job committed is damaged (truncated, edited, overwritten): the shards may
            # be intact, and starting over would write new manifests over them and let retention delete
            # them. As with corrupt shards, stop and say so; no restart repairs a manifest.
            where = "; ".join(f"{store}: steps {_steps(steps)}" for store, steps in sorted(damaged.items()))
            raise CheckpointCorruptError(
                f"job {self.owner!r} committed checkpoints ({where}) whose manifests are damaged and none "
                f"loads; refusing to start over from step 0 {hint}"
            )
        if required is not None:
            raise error(f"{required} ({', '.join(s.uri for s in self.stores)})")
        if candidates:
            # This job committed checkpoints and not one copy of any of them loads (corrupt, truncated,
            # unreachable, or a load that fails): starting over from step 0 would silently throw away
            # all the progress they hold. Fail instead; `resume: never` is how to start over on purpose.
            raise error(
                f"this job committed checkpoints of steps {steps} but {verdict}; "
                f"refusing to start over from step 0 {hint}"
            )
        log.info("no checkpoint of this job found; starting fresh")
        return None

    def _search(self) -> list[Candidate]:
        """Rank 0: `find_candidates`, again with backoff while it finds nothing and a store did not
        answer, for at most `list_retry_s`."""
        deadline = time.monotonic() + self.list_retry_s
        pause = LIST_RETRY_FIRST_S
        self._attempts = 0
        while True:
            self._attempts += 1
            candidates = self.find_candidates()
            left = deadline - time.monotonic()
            if candidates or not self._unlisted or left <= 0:
                return candidates
            pause = min(pause, left)
            log.warning(
                "no checkpoint found in the stores that answered, and %s did not: listing again in %.1f s "
                "(attempt %d, for %.0f s more at most)",
                ", ".join(sorted(self._unlisted)),
                pause,
                self._attempts,
                left,
            )
            time.sleep(pause)
            pause = min(2 * pause, LIST_RETRY_MAX_S)

    def _unavailable(self, unlisted: dict[str, str], attempts: int, seconds: float) -> CheckpointStoreUnavailableError:
        """The error (the same on every rank) for a search that found nothing while stores did not answer."""
        where = "; ".join(f"store {name} ({why})" for name, why in sorted(unlisted.items()))
        whose = f"job {self.owner!r}" if self.owner is not None else "checkpoint.initFrom"
        message = (
            f"{whose}: no checkpoint in the stores that answered, and {where} could not be read "
            f"({attempts} attempt{'s' if attempts != 1 else ''} in {seconds:.1f} s) and may hold them: refusing "
            "to start over from step 0. The rank stops (retryable) and the job resumes once the store answers "
            "again; set checkpoint.resume: never to start fresh on purpose"
        )
        if self.identity.rank == 0:
            log.error("%s", message)
            for name, why in sorted(unlisted.items()):
                # The run's record (events.jsonl `store_failure`): the restore gave up on this store.
                self.sink.on_store_failure(name, f"{RESTORE_GAVE_UP}: {why}")
        return CheckpointStoreUnavailableError(message, unlisted)

    def _result(self, cand: Candidate, store: str, uri: str, source: str, start: float) -> RestoreResult:
        return RestoreResult(
            step=cand.step,
            store=store,
            uri=uri,
            world_size=cand.manifest.world_size,
            seconds=time.perf_counter() - start,
            source=source,
            extra=dict(cand.manifest.extra),
            certified=cand.manifest.certified,
        )

    def _load(self, state: dict[str, Any], cand: Candidate, view: _StoreView, name: str) -> str | None:
        # (planner: SafeLoadPlanner, below: a store's bytes are never unpickled beyond plain data)
        """Collective: load `cand` from `view` with every file verified while read; None, or why it failed."""
        expected = {e.path: (e.digest, e.size) for e in cand.manifest.files}
        # At the world size that wrote it, a rank mostly loads the shards it wrote itself (FSDP) or, under
        # DDP, rank 0 holds them all: read them while DCP plans. A resharded restore reads only the plan's.
        same_world = cand.manifest.world_size == self.identity.world_size
        mine = [e.path for e in cand.manifest.files if same_world and e.rank == self.identity.rank]
        reader = VerifiedReader(
            view.read_range,
            cand.manifest.dcp_dir,
            expected,
            local_path=view.local_file,
            digest_part_bytes=cand.manifest.digest_part_bytes,
            digest_algorithm=cand.manifest.digest_algorithm,
            prefetch=mine,
        )
        try:
            with self.coll.quiet_single_process():
                dcp_load(
                    state,
                    storage_reader=reader,
                    planner=SafeLoadPlanner(),
                    process_group=self.coll.group,
                    no_dist=not self.coll.distributed,
                )
            return None
        except (Exception, CheckpointException) as exc:  # DCP hands one rank's failure to every rank
            detail = _why(exc)
            self._transient = self._transient or not _final_failure(exc)
            mismatch = next((c for c in _causes(exc) if isinstance(c, StateMismatch)), None)
            if mismatch is not None and self._mismatch is None:
                self._mismatch = str(mismatch)
        finally:
            reader.close()
        if self.identity.rank == 0:
            log.error(
                "%s: checkpoint step %d is corrupt or unreadable (%s); trying the next copy", name, cand.step, detail
            )
            self.sink.on_event(EventKind.CHECKPOINT_CORRUPT, step=cand.step, store=name, detail=detail)
        return detail

    def _sizes_ok(self, store: CheckpointStorage, cand: Candidate) -> bool:
        """Rank 0: every file of `cand` is in `store` at its size (a cheap look before reading a copy)."""
        try:
            report = verify_store(store, cand.manifest, hashes=False)
        except Exception as exc:
            self._transient = True
            log.warning("store %s: step %d unreadable: %s", store.name, cand.step, exc)
            self.sink.on_store_failure(store.name, f"read step {cand.step}: {type(exc).__name__}: {exc}")
            return False
        if any(not why.startswith(("missing", "size ")) for why in report.bad.values()):
            self._transient = True  # unreadable or refused: not a verdict on the checkpoint itself
        if not report.ok:
            log.error(
                "store %s: checkpoint step %d is incomplete (%s); trying the next copy",
                store.name,
                cand.step,
                report.summary(),
            )
            self.sink.on_event(EventKind.CHECKPOINT_CORRUPT, step=cand.step, store=store.name, detail=report.summary())
        return report.ok

    def _own(self, store: CheckpointStorage, listing: list[CheckpointListing]) -> list[Manifest]:
        """The committed manifests of `listing` that restore may take; notes the others."""
        exclusive = self.owner is None or exclusive_to(listing, self.owner)
        out: list[Manifest] = []
        for c in listing:
            m = c.manifest
            if c.unreadable:  # no verdict on this step: it may be this job's newest checkpoint
                self._unlisted.setdefault(store.name, _one_line(f"step {c.step}: {c.error}"))
            if m is None and c.untrusted and self.owner is not None and c.claimed_job == self.owner:
                self._wrongly_signed[store.name].append(c.step)
            if m is None:
                if c.error:
                    log.warning("store %s: %s has a bad manifest (%s); ignored", store.name, step_dir(c.step), c.error)
                    if not c.untrusted and self.owner is not None and self.owner in damaged_owners(store, c.step):
                        self._damaged[store.name].append(c.step)
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
        self._unlisted = {}
        self._foreign.clear()
        self._legacy.clear()
        self._wrongly_signed.clear()
        self._damaged.clear()
        for i, store in enumerate(self.stores):
            try:
                listing = list_checkpoints(store, key=self.key)
            except Exception as exc:
                # A store that did not answer may hold a good copy: unknown, not empty (see `restore`).
                self._unlisted[store.name] = _one_line(f"list: {type(exc).__name__}: {exc}")
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
        return order_candidates(list(found.values()), prefer_certified=self.prefer_certified)

    def _node_local_copy(self, cand: Candidate) -> _StoreView | None:
        """Collective: this node's node-local copy of `cand` when every node holds all its files (sizes)."""
        if not self.node_local:
            return None
        local_step = os.path.join(self.node_dir, step_dir(cand.step))
        ok = True
        if self.identity.local_rank == 0:
            ok = (
                os.path.isdir(local_step)
                and verify_store(open_storage(local_step), cand.manifest, hashes=False, base="").ok
            )
        if not self.coll.min_all(ok):
            return None
        return _StoreView(open_storage(local_step), "")


@dataclass(frozen=True)
class _StoreView:
    """The step directory of one copy: a store (or the node-local directory) and the step's place in it."""

    store: CheckpointStorage
    base: str  # the step directory below the store root ("" when the store root is the step directory)

    @property
    def uri(self) -> str:
        return self.store.uri

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        return self.store.read_range(self._rel(rel), start, end)

    def local_file(self, rel: str) -> str | None:
        """The local file of `rel` when the copy is on a local filesystem (checked to stay inside it)."""
        return self.store.local_path(self._rel(rel))

    def _rel(self, rel: str) -> str:
        return f"{self.base}/{rel}" if self.base else rel


def _why(exc: BaseException) -> str:
    """The one-line reason of a failed load (DCP wraps each rank's failure in a CheckpointException)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items())[0]
        cause = inner[0] if isinstance(inner, tuple) else inner
        return f"rank {rank}: {type(cause).__name__}: {cause}"
    return f"{type(exc).__name__}: {exc}"


def _causes(exc: BaseException) -> list[BaseException]:
    """Each rank's failure inside DCP's CheckpointException (or `exc` itself)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return [inner[0] if isinstance(inner, tuple) else inner for inner in failures.values()]
    return [exc]


def _final_failure(exc: BaseException) -> bool:
    """Whether a failed load failed on every rank for a reason a later start meets again: the copy's
    integrity (a file missing, of the wrong size or digest: `VerifyError`, `FileNotFoundError`) or a state
    that does not fit it (`StateMismatch`), rather than an error that may pass (I/O, a peer)."""
    return all(isinstance(c, (VerifyError, FileNotFoundError, StateMismatch)) for c in _causes(exc))


def _one_line(text: str) -> str:
    """`text` on one bounded line (a store's error may span lines: the rank's last line must not)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= WHY_MAX_CHARS else flat[: WHY_MAX_CHARS - 3] + "..."


def _steps(steps: list[int]) -> str:
    ordered = sorted(steps)
    return str(ordered[0]) if len(ordered) == 1 else f"{ordered[0]}-{ordered[-1]} ({len(ordered)})"


class StateMismatch(ValueError):
    """A checkpoint whose keys or shapes are not the state's: the model (or its task arguments) changed."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that the non-tensor values of a checkpoint (the progress
    counters, the optimizer's hyper-parameters) are read with `torch.load(weights_only=True)`.

    DCP's own planner unpickles them with `weights_only=False`: a store's file could then run code on
    every rank that restores it. The manifest's digests do not help against a hostile store (it writes
    the manifest too) unless manifests are signed (`TORCHRIG_CHECKPOINT_KEY`). `weights_only` admits
    tensors and plain data (numbers, strings, lists, dicts, tuples), all a torchrig checkpoint holds; any
    other object fails the load, and the restore moves on to the next copy or checkpoint.
    """

    def create_local_plan(self) -> LoadPlan:
        """DCP's plan, after checking that every key of the state is in the checkpoint at its shape
        (`StateMismatch` otherwise: the model changed, which no restart or other copy mends)."""
        saved = self.metadata.state_dict_metadata if self.metadata is not None else {}
        missing = sorted(k for k in self.state_dict if k not in saved)
        if missing and not self.allow_partial_load:
            more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
            raise StateMismatch(f"the checkpoint has no {', '.join(missing[:3])}{more}")
        for fqn, obj in self.state_dict.items():
            md = saved.get(fqn)
            size = getattr(obj, "size", None)
            if isinstance(md, TensorStorageMetadata) and callable(size) and md.size != size():
                raise StateMismatch(f"{fqn} was saved with shape {list(md.size)}, the model's is {list(size())}")
        return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # DCP's DefaultLoadPlanner.load_bytes, with weights_only=True
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
