"""Retention: which step directories of a store go after a commit, and whose they are.

Per store, after a commit, counting only this job's checkpoints: the newest `keep` committed
checkpoints stay; older committed ones are deleted, and so are uncommitted step directories older than
the oldest kept one (debris of crashed saves). Uncommitted or corrupt step directories NEWER than that
are never deleted: they are the evidence of what went wrong. The step just committed is never deleted,
so the last valid checkpoint always stays. Other jobs' checkpoints in a shared store are never counted
and never deleted.

Whose is what (`attribute`): a committed step belongs to the job its manifest names; an uncommitted one
to the job whose fence holds the generation of its `gen-NNNN` directories. A manifest without a job
name (written before manifests carried one) and an uncommitted directory whose writer is unknown are
taken as this job's only when the store holds no other job's checkpoint; otherwise they are left alone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from training.checkpoint.manifest import CheckpointListing, list_checkpoints, parse_gen_dir, step_dir
from training.checkpoint.storage import CheckpointStorage

__all__ = ["apply_retention", "attribute", "exclusive_to", "steps_to_delete"]

log = logging.getLogger(__name__)


def steps_to_delete(
    listing: Sequence[CheckpointListing], keep: int, *, committed_step: int | None = None, job: str | None = None
) -> list[int]:
    """The steps of `listing` that retention deletes, newest first (a pure function of the listing).

    Args:
        listing: every step directory of one store (`list_checkpoints`; any order).
        keep: how many committed checkpoints stay (the newest ones).
        committed_step: the step this writer just committed: never deleted, whatever else the store holds.
        job: count and delete only the directories of this job (`CheckpointListing.job`); None: all.
    """
    mine = [c for c in listing if job is None or c.job == job]
    ordered = sorted(mine, key=lambda c: c.step, reverse=True)
    kept_steps = set([c.step for c in ordered if c.committed][:keep])
    if not kept_steps:
        return []
    oldest_kept = min(kept_steps)
    return [
        c.step
        for c in ordered
        # newer uncommitted/corrupt directories are evidence: never deleted
        if c.step not in kept_steps and c.step <= oldest_kept and c.step != committed_step
    ]


def exclusive_to(listing: Sequence[CheckpointListing], job: str) -> bool:
    """Whether no committed checkpoint of another (named) job is in the listing."""
    return all(c.manifest is None or c.manifest.job in ("", job) for c in listing)


def attribute(
    store: CheckpointStorage,
    listing: Sequence[CheckpointListing],
    job: str,
    job_of_generation: Callable[[CheckpointStorage, int], str | None],
) -> list[CheckpointListing]:
    """`listing` with the owner of job-less manifests and of uncommitted directories filled in."""
    exclusive = exclusive_to(listing, job)
    out: list[CheckpointListing] = []
    for c in listing:
        if c.manifest is not None:
            if not c.manifest.job:
                c = dataclasses.replace(c, owner=job if exclusive else "")
            out.append(c)
            continue
        try:
            names = store.list_dir(step_dir(c.step))
        except NotADirectoryError:  # a file under a step's name: no writer generation owns it
            names = []
        gens = [g for g in (parse_gen_dir(n) for n in names) if g is not None]
        owners = {job_of_generation(store, g) for g in gens}
        known = owners - {None}
        if known == {job} and (None not in owners or exclusive):
            owner = job
        elif not known and exclusive:
            owner = job  # empty, or written before fences: this job's when the store is its alone
        else:
            owner = ""
        out.append(dataclasses.replace(c, owner=owner))
    return out


def apply_retention(
    store: CheckpointStorage,
    keep: int,
    *,
    committed_step: int | None = None,
    job: str | None = None,
    job_of_generation: Callable[[CheckpointStorage, int], str | None] | None = None,
    key: bytes | None = None,
) -> list[int]:
    """List `store`, delete what `steps_to_delete` names (for `job` when given), and return those steps."""
    listing = list_checkpoints(store, key=key)
    if job is not None:
        listing = attribute(store, listing, job, job_of_generation or (lambda _s, _g: None))
    committed = {c.step: c.committed for c in listing}
    doomed = steps_to_delete(listing, keep, committed_step=committed_step, job=job)
    for step in doomed:
        log.info(
            "retention: deleting %s/%s (%s)",
            store.name,
            step_dir(step),
            "committed" if committed[step] else "uncommitted",
        )
        store.delete_dir(step_dir(step))
    return doomed
