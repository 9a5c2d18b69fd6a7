"""Retention as a pure function of a store's listing (`training.checkpoint.steps_to_delete`), with and
without the job filter, and the writer fence's generations."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from tests.fixtures.checkpoint import ckpt_identity
from training.checkpoint import CheckpointListing, Manifest, open_storage, steps_to_delete
from training.checkpoint.fence import FENCE_DIR, Fence


def committed(step: int) -> CheckpointListing:
    return CheckpointListing(step, Manifest(step, 1, 0, "job", 0.0, "2.x", []))


def uncommitted(step: int, error: str | None = None) -> CheckpointListing:
    return CheckpointListing(step, None, error=error)


def owned(step: int, job: str) -> CheckpointListing:
    return CheckpointListing(step, Manifest(step, 1, 0, job, 0.0, "2.x", []))


def test_newest_keep_committed_stay_and_older_committed_go() -> None:
    listing = [committed(s) for s in (50, 40, 30, 20, 10)]
    assert steps_to_delete(listing, 2) == [30, 20, 10]
    assert steps_to_delete(listing, 5) == []
    assert steps_to_delete(listing, 9) == []


def test_uncommitted_newer_dirs_are_evidence_and_stay() -> None:
    listing = [uncommitted(60), uncommitted(45, error="bad json"), committed(40), committed(30), uncommitted(35)]
    assert steps_to_delete(listing, 2) == []
    assert steps_to_delete(listing, 1) == [35, 30]


def test_older_debris_goes() -> None:
    listing = [committed(40), uncommitted(39), committed(30), uncommitted(5), uncommitted(0, error="torn")]
    assert steps_to_delete(listing, 2) == [5, 0]


def test_nothing_committed_deletes_nothing() -> None:
    assert steps_to_delete([uncommitted(3), uncommitted(2)], 1) == []
    assert steps_to_delete([], 3) == []


def test_the_step_just_committed_is_never_deleted() -> None:
    # a store still holding an earlier run's newer steps: the new run's first commit stays
    listing = [committed(5000), committed(4900), committed(4800), committed(100)]
    assert steps_to_delete(listing, 3) == [100]
    assert steps_to_delete(listing, 3, committed_step=100) == []
    assert steps_to_delete(listing, 1, committed_step=100) == [4900, 4800]


def test_listing_order_does_not_matter() -> None:
    listing = [committed(10), uncommitted(1), committed(30), committed(20)]
    assert steps_to_delete(listing, 2) == [10, 1]


@st.composite
def listings(draw: st.DrawFn) -> list[CheckpointListing]:
    steps = draw(st.lists(st.integers(min_value=0, max_value=60), unique=True, max_size=12))
    return [committed(s) if draw(st.booleans()) else uncommitted(s) for s in steps]


@given(listing=listings(), keep=st.integers(min_value=1, max_value=5), data=st.data())
def test_retention_rules_hold_for_any_listing(listing: list[CheckpointListing], keep: int, data: st.DataObject) -> None:
    steps = [c.step for c in listing]
    just = data.draw(st.sampled_from(steps)) if steps and data.draw(st.booleans()) else None
    doomed = steps_to_delete(listing, keep, committed_step=just)
    assert doomed == sorted(set(doomed), reverse=True) and set(doomed) <= set(steps)
    assert just not in doomed
    newest_committed = sorted((c.step for c in listing if c.committed), reverse=True)[:keep]
    assert not set(newest_committed) & set(doomed)
    if newest_committed:
        oldest_kept = min(newest_committed)
        # everything newer than the oldest kept checkpoint stays; everything older goes (but `just`)
        assert all(s < oldest_kept for s in doomed)
        assert set(doomed) == {s for s in steps if s < oldest_kept and s != just}
    else:
        assert doomed == []


def test_only_this_jobs_checkpoints_count_and_go() -> None:
    # a store still holding another run's steps 4800-5000: this job's steps are counted on their own
    foreign = [owned(s, "earlier") for s in (5000, 4900, 4800)]
    mine = [owned(s, "job") for s in (400, 300, 200, 100)]
    assert steps_to_delete([*foreign, owned(100, "job")], 3, committed_step=100, job="job") == []
    assert steps_to_delete(foreign + mine, 3, committed_step=400, job="job") == [100]
    assert steps_to_delete(foreign + mine, 1, committed_step=400, job="earlier") == [4900, 4800]
    # unknown owner (job-less manifest, uncommitted directory of an unknown writer): never this job's
    assert steps_to_delete([*mine, owned(50, ""), uncommitted(10)], 2, job="job") == [200, 100]


def test_the_just_committed_step_survives_a_store_full_of_newer_foreign_steps() -> None:
    listing = [owned(s, "other") for s in range(1000, 5001, 100)] + [owned(7, "job")]
    for keep in (1, 3):
        assert 7 not in steps_to_delete(listing, keep, committed_step=7, job="job")
        assert steps_to_delete(listing, keep, committed_step=7, job="job") == []


@given(listing=listings(), keep=st.integers(min_value=1, max_value=5), data=st.data())
def test_other_jobs_directories_are_never_deleted(
    listing: list[CheckpointListing], keep: int, data: st.DataObject
) -> None:
    jobs = [data.draw(st.sampled_from(["job", "other", ""])) for _ in listing]
    mixed = [
        CheckpointListing(c.step, c.manifest, owner=j) if c.manifest is None else owned(c.step, j)
        for c, j in zip(listing, jobs, strict=True)
    ]
    doomed = steps_to_delete(mixed, keep, job="job")
    assert all(c.job == "job" for c in mixed if c.step in doomed)


def test_fence_generations_grow_across_restarts_and_launches(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path / "a"))
    # restart counts 1, then 0 again in a resubmitted launch, then another run id: the number only grows
    gens = [
        Fence(ckpt_identity(tmp_path, generation=g, run_id=r)).acquire([store])
        for g, r in ((1, "r"), (0, "r"), (5, "x"))
    ]
    assert gens == [0, 1, 2]
    assert Fence.numbers(store) == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "a" / FENCE_DIR).iterdir()) == [
        "00000000.json",
        "00000001.json",
        "00000002.json",
    ]


def test_fence_a_newer_writer_of_the_same_job_fences_an_older_one(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path / "a"))
    old = Fence(ckpt_identity(tmp_path, generation=0))
    new = Fence(ckpt_identity(tmp_path, generation=0))
    assert old.acquire([store]) == 0 and old.newer_holder(store) is None
    assert new.acquire([store]) == 1
    holder = old.newer_holder(store)
    assert holder is not None and holder.writer == new.writer and holder.generation == 1
    assert new.newer_holder(store) is None
    # another job sharing the store takes a higher number but fences nobody of this job
    other = Fence(ckpt_identity(tmp_path, job="other"))
    assert other.acquire([store]) == 2
    assert new.newer_holder(store) is None and other.newer_holder(store) is None
    assert old.job_of(store, 2) == "other" and old.job_of(store, 7) is None
