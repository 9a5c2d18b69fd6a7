"""The writer fence: which writer of a job may commit to a store.

A writer (rank 0 of one restart of one launch) takes a *writer generation* when it starts: the lowest
number above every fence object in every store it can reach, created as `<store>/fences/<n>.json` with
an exclusive create (`CheckpointStorage.create_exclusive`) on every store. The number is unique in a
store (two writers cannot both create the same object) and grows across restarts AND launches: a
resubmitted job, a recreated pod or a fixed-size job whose restart count starts again at 0 still gets a
number above every earlier writer's. `TORCHELASTIC_RESTART_COUNT` and the run id are recorded for
diagnostics only, never compared.

Before each commit rank 0 lists `fences/`: a fence above its own that belongs to the same job means a
newer writer holds the store, and this one refuses to commit (`checkpoint_fenced`). Right after writing
a manifest it looks again, and removes the manifest it just wrote if a newer writer took the fence in
between, so a stale writer's manifest is visible for at most one listing round trip. Fences of other
jobs sharing the store never fence this one; the numbers are shared only so shard directories
(`gen-<n>`) never collide between jobs either. A store that was down when the writer started is
fenced at its first commit there.

Where `create_exclusive` is atomic (`file`, `s3` with conditional writes, `memory`) two writers can
never take the same number. On other fsspec stores (`gs`, `az`/`abfs`, generic HTTP, FUSE mounts
without `O_EXCL`) it is check-then-write: the writer reads its fence back to detect a lost race, which
leaves a window of one round trip; a warning says so once per store.

Fence objects are small (one per writer start) and never rewritten; they are not pruned, because
retention uses them to tell whose uncommitted step directories are whose.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import time
import uuid
from dataclasses import asdict, dataclass

from training.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    parse_gen_dir,
    parse_step_dir,
    read_manifest,
    step_dir,
)
from training.checkpoint.storage import SMALL_OBJECT_MAX_BYTES, CheckpointStorage
from training.contract import WorkerIdentity

__all__ = ["FENCE_DIR", "Fence", "FenceRecord", "damaged_owners", "fence_path"]

log = logging.getLogger(__name__)

FENCE_DIR = "fences"
_FENCE_RE = re.compile(r"^(\d{8,})\.json$")
_ACQUIRE_ATTEMPTS = 32
FENCE_MAX_BYTES = 64 * 1024  # a fence object is a line of JSON


def fence_path(generation: int) -> str:
    """The fence object of a writer generation, relative to the store root."""
    return f"{FENCE_DIR}/{generation:08d}.json"


def damaged_owners(store: CheckpointStorage, step: int) -> set[str]:
    """The jobs a step directory whose manifest is damaged may belong to: the jobs that took the writer
    generations of its `gen-N` folders (their fences), and the job the manifest's text names if it is
    still JSON. Never trusted to load anything; only to refuse to start over on top of it."""
    objects = [f"{step_dir(step)}/{MANIFEST_NAME}"]
    with contextlib.suppress(OSError, ValueError):
        gens = (parse_gen_dir(name) for name in store.list_dir(step_dir(step)))
        objects += [fence_path(gen) for gen in gens if gen is not None]
    jobs: set[str] = set()
    for rel in objects:
        # RecursionError: 64 KiB of `[` nests deeper than the JSON parser goes.
        with contextlib.suppress(OSError, ValueError, AttributeError, RecursionError):
            limit = FENCE_MAX_BYTES if rel.startswith(FENCE_DIR) else SMALL_OBJECT_MAX_BYTES
            job = json.loads(store.read_bytes(rel, max_bytes=limit)).get("job")
            if isinstance(job, str) and job:
                jobs.add(job)
    return jobs


@dataclass(frozen=True)
class FenceRecord:
    """What a fence object holds: which writer took that generation."""

    generation: int
    job: str
    writer: str
    run_id: str = ""
    restart_count: int = 0
    time: float = 0.0

    def describe(self) -> str:
        return f"generation {self.generation} (run {self.run_id or '?'}, restart {self.restart_count})"


class Fence:
    """This writer's generation and the take / check of it on each store (rank 0 only).

    Args:
        identity: The writer (its job owns the fence; run id and restart count are recorded).
    """

    def __init__(self, identity: WorkerIdentity) -> None:
        self.identity = identity
        self.writer = uuid.uuid4().hex
        self.generation: int | None = None
        self._held: set[str] = set()  # store URIs where this writer's fence object exists
        self._records: dict[tuple[str, int], FenceRecord] = {}  # fence objects never change: cached
        self._warned: set[str] = set()

    # -- reading ----------------------------------------------------------------------------------
    @staticmethod
    def numbers(store: CheckpointStorage) -> list[int]:
        """The generations that have a fence object in `store`, ascending."""
        found = (_FENCE_RE.match(name) for name in store.list_dir(FENCE_DIR))
        return sorted(int(m.group(1)) for m in found if m)

    def record(self, store: CheckpointStorage, generation: int) -> FenceRecord | None:
        """The fence object of `generation` in `store`; None when absent or unreadable."""
        cached = self._records.get((store.uri, generation))
        if cached is not None:
            return cached
        try:
            raw = json.loads(store.read_bytes(fence_path(generation), max_bytes=FENCE_MAX_BYTES))
            rec = FenceRecord(**{k: raw[k] for k in FenceRecord.__dataclass_fields__ if k in raw})
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            # Not cached: with O_EXCL on a filesystem without hard links the content follows the name.
            log.warning("store %s: fence %s is unreadable (%s); ignored", store.name, fence_path(generation), exc)
            return None
        self._records[(store.uri, generation)] = rec
        return rec

    def job_of(self, store: CheckpointStorage, generation: int) -> str | None:
        """The job that took `generation` in `store`, or None when unknown."""
        rec = self.record(store, generation)
        return rec.job if rec is not None else None

    # -- taking -----------------------------------------------------------------------------------
    def _doc(self, generation: int) -> bytes:
        ident = self.identity
        rec = FenceRecord(generation, ident.job, self.writer, ident.run_id, ident.generation, time.time())
        return json.dumps(asdict(rec)).encode()

    def _take(self, store: CheckpointStorage, generation: int) -> bool:
        """Create this writer's fence object for `generation` in `store`; False when another writer has it."""
        if not store.atomic_create and store.uri not in self._warned:
            self._warned.add(store.uri)
            log.warning(
                "checkpoint store %s cannot create objects atomically: the writer fence is best effort there",
                store.name,
            )
        try:
            store.create_exclusive(fence_path(generation), self._doc(generation))
        except FileExistsError:
            pass  # another writer, or our own earlier attempt whose reply was lost: the content tells
        else:
            if store.atomic_create:
                return True
        self._records.pop((store.uri, generation), None)
        rec = self.record(store, generation)
        return rec is not None and rec.writer == self.writer

    @staticmethod
    def written(store: CheckpointStorage) -> list[int]:
        """The writer generations that have a `gen-N` folder in some step directory of `store`. A store
        whose fences are gone (deleted, or written before fences existed) still holds their shards: a new
        writer numbered from the fences alone would write DCP files into another writer's `gen-N`."""
        found: set[int] = set()
        for name in store.list_dir(""):
            if parse_step_dir(name) is not None:
                with contextlib.suppress(NotADirectoryError):  # a file under a step's name holds no shards
                    found.update(g for g in (parse_gen_dir(n) for n in store.list_dir(name)) if g is not None)
        return sorted(found)

    def acquire(self, stores: list[CheckpointStorage]) -> int | None:
        """Take a generation above every fence and every `gen-N` folder in every reachable store, on all
        of them.

        Returns:
            The generation, or None when no store could be listed (taken again at the next save).
        """
        for _ in range(_ACQUIRE_ATTEMPTS):
            reachable: list[CheckpointStorage] = []
            highest = -1
            for store in stores:
                try:
                    highest = max([highest, *self.numbers(store), *self.written(store)])
                    reachable.append(store)
                except Exception as exc:
                    log.warning("checkpoint store %s: cannot list fences: %s", store.name, exc)
            if not reachable:
                return None
            generation = highest + 1
            held: set[str] = set()
            lost = False
            for store in reachable:
                try:
                    if not self._take(store, generation):
                        lost = True
                        break
                    held.add(store.uri)
                except Exception as exc:  # down now: fenced at its first commit
                    log.warning("checkpoint store %s: cannot write fence: %s", store.name, exc)
            if not lost:
                self.generation, self._held = generation, held
                log.info("checkpoint writer generation %d (job %s)", generation, self.identity.job)
                return generation
            time.sleep(random.uniform(0.01, 0.2))  # another writer raced us: retry above its number
        raise RuntimeError(f"could not take a writer generation in {_ACQUIRE_ATTEMPTS} attempts")

    # -- checking ---------------------------------------------------------------------------------
    def newer_holder(self, store: CheckpointStorage) -> FenceRecord | None:
        """A fence of this job above this writer's generation in `store` (a newer writer), or None."""
        assert self.generation is not None
        for generation in reversed(self.numbers(store)):
            if generation <= self.generation:
                break
            rec = self.record(store, generation)
            if rec is not None and rec.job == self.identity.job:
                return rec
        return None

    def check(self, store: CheckpointStorage, manifest: Manifest) -> str | None:
        """Why this writer must not commit `manifest` to `store`, or None when it may."""
        if self.generation is None:
            return "this writer holds no generation"
        if store.uri not in self._held:
            # The store was unreachable when the writer started: take the same generation there now.
            if not self._take(store, self.generation):
                holder = self.record(store, self.generation)
                who = f"job {holder.job}" if holder is not None else "another writer"
                return f"generation {self.generation} in this store was taken by {who}"
            self._held.add(store.uri)
        newer = self.newer_holder(store)
        if newer is not None:
            return f"a newer writer holds the store ({newer.describe()}); this one is generation {self.generation}"
        try:
            existing = read_manifest(store, manifest.step)
        except (FileNotFoundError, ValueError):
            return None
        if existing.job != manifest.job:
            return f"step {manifest.step} in this store is committed by job {existing.job or '?'}"
        if existing.generation > manifest.generation:
            return f"step {manifest.step} is already committed by newer generation {existing.generation}"
        return None
