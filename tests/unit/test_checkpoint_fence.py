"""The writer fence across launches (issue 13, point 1) on local-directory stores: a resubmitted job whose
restart count starts again at 0 keeps committing; a stale writer never commits, not even one whose
fence check passed just before a newer writer took the fence. The S3 variants are in
tests/integration/test_checkpoint_s3.py, the multi-process one in test_checkpoint_dist.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.checkpoint import Recorder, assert_same, ckpt_identity, config, make_state, save_steps
from training.checkpoint import CheckpointManager, FsspecStorage, list_checkpoints, open_storage, read_manifest
from training.checkpoint.fence import Fence
from training.checkpoint.manifest import MANIFEST_NAME, step_dir
from training.contract import EventKind, WorkerIdentity

pytestmark = pytest.mark.timeout(120)


def launch(tmp_path: Path, generation: int, run_id: str = "job") -> WorkerIdentity:
    """Rank 0 of job `job`; the launch's rendezvous id is the job name, as on Kubernetes."""
    return ckpt_identity(tmp_path / "run", generation=generation, run_id=run_id)


def committed_steps(uri: str) -> list[int]:
    return [c.step for c in list_checkpoints(open_storage(uri)) if c.committed]


@pytest.mark.parametrize("run_id", ["job", "none"])  # the job name (elastic), `none` (fixed size)
def test_resubmitted_job_restores_and_commits_every_later_checkpoint(tmp_path: Path, run_id: str) -> None:
    stores = [str(tmp_path / "a"), f"file://{tmp_path / 'b'}"]
    step = 0
    for generation in (0, 1, 2, 0):  # restarted twice, then resubmitted under the same name
        sink = Recorder()
        mgr = CheckpointManager(config(*stores, keep=10), launch(tmp_path, generation, run_id), sink)
        result = mgr.restore(make_state(999))
        assert (result.step if result else 0) == step
        states = save_steps(mgr, [step + 1, step + 2])
        mgr.close()
        step += 2
        assert [r.stores_ok for r in sink.checkpoints if r.committed] == [["s0", "s1"]] * 2, sink.checkpoints
        assert not any(e == EventKind.CHECKPOINT_FENCED for e, _ in sink.events)
    for uri in stores:
        assert committed_steps(uri) == [8, 7, 6, 5, 4, 3, 2, 1]
        newest = read_manifest(open_storage(uri), 8)
        assert newest.generation == 3 and newest.restart_count == 0 and newest.run_id == run_id
    mgr = CheckpointManager(config(*stores), launch(tmp_path, 0, run_id))
    target = make_state(999)
    result = mgr.restore(target)
    assert result is not None and result.step == 8
    assert_same(target, states[8])


def test_a_stale_writer_never_commits_after_a_newer_launch_took_the_fence(tmp_path: Path) -> None:
    a = str(tmp_path / "a")
    stale = CheckpointManager(config(a), launch(tmp_path, generation=2))  # the old launch's last restart
    save_steps(stale, [1])
    newer = CheckpointManager(config(a), launch(tmp_path, generation=0))  # resubmitted: restart count 0
    assert newer.restore(make_state(0)) is not None
    sink = Recorder()
    stale.sink = sink
    save_steps(stale, [2, 3])  # still alive (a partitioned node, a pod not yet gone)
    assert not any(r.committed for r in sink.checkpoints)
    assert [e for e, _ in sink.events] == [EventKind.CHECKPOINT_FENCED] * 2
    assert "newer writer" in sink.events[0][1]["reason"]
    save_steps(newer, [2])
    assert newer.history[-1].committed
    save_steps(stale, [4])  # the stale writer cannot overwrite the newer one's step either
    assert not stale.history[-1].committed
    assert committed_steps(a) == [2, 1]
    assert read_manifest(open_storage(a), 2).generation == 1
    stale.close()
    newer.close()


def test_a_commit_racing_a_newer_writer_is_withdrawn(tmp_path: Path) -> None:
    a = str(tmp_path / "a")
    stale = CheckpointManager(config(a), launch(tmp_path, generation=0))
    save_steps(stale, [1])
    store: Any = stale.stores[0]
    write = store.write_bytes_atomic
    newer: list[CheckpointManager] = []

    def write_after_takeover(rel: str, data: bytes) -> None:
        if rel.endswith(MANIFEST_NAME) and not newer:
            # The fence check of the stale writer has passed; a newer writer starts before its write lands.
            newer.append(CheckpointManager(config(a), launch(tmp_path, generation=1)))
        write(rel, data)

    store.write_bytes_atomic = write_after_takeover
    sink = Recorder()
    stale.sink = sink
    save_steps(stale, [2])
    assert newer and not stale.history[-1].committed
    assert [e for e, _ in sink.events] == [EventKind.CHECKPOINT_FENCED]
    assert "withdrawn" in sink.events[0][1]["reason"]
    assert committed_steps(a) == [1]
    assert not (tmp_path / "a" / step_dir(2) / MANIFEST_NAME).exists()
    stale.close()
    save_steps(newer[0], [2])
    newer[0].close()
    assert committed_steps(a) == [2, 1]


def test_a_store_down_at_start_is_fenced_at_its_first_commit(tmp_path: Path) -> None:
    good, flaky = str(tmp_path / "good"), tmp_path / "flaky"
    flaky.write_text("a file where the store directory should be")
    mgr = CheckpointManager(config(good, str(flaky / "sub")), launch(tmp_path, generation=0))
    save_steps(mgr, [1])
    assert mgr.history[-1].stores_ok == ["s0"]
    flaky.unlink()
    save_steps(mgr, [2])
    mgr.close()
    assert mgr.history[-1].stores_ok == ["s0", "s1"]
    assert Fence.numbers(open_storage(str(flaky / "sub"))) == [0]


def test_two_writers_racing_for_one_generation_get_one_each(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path / "a"))
    first, second = Fence(launch(tmp_path, 0)), Fence(launch(tmp_path, 0))
    first.generation = second.generation = 0
    assert first._take(store, 0)
    assert not second._take(store, 0)  # the exclusive create fails, and the object names the first writer
    assert second.acquire([store]) == 1


def test_a_store_without_atomic_create_reads_its_fence_back_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class CheckThenWrite(FsspecStorage):
        @property
        def atomic_create(self) -> bool:
            return False

    store = CheckThenWrite(str(tmp_path / "a"), name="gcs-like")
    first, second = Fence(launch(tmp_path, 0)), Fence(launch(tmp_path, 0))
    assert first.acquire([store]) == 0
    assert first._take(store, 0)  # its own object, read back
    assert not second._take(store, 0)  # another writer's
    assert second.acquire([store]) == 1
    warnings = [r.getMessage() for r in caplog.records if "best effort" in r.getMessage()]
    assert (
        warnings
        == ["checkpoint store gcs-like cannot create objects atomically: the writer fence is best effort there"] * 2
    )


def test_a_fence_of_nested_brackets_is_an_unreadable_fence_not_a_recursion_error(tmp_path: Path) -> None:
    """A fence object is the store's, hence anyone's with write access to the bucket: 64 KiB of `[` nests
    deeper than the JSON parser goes (RecursionError, which no reader caught), and must read as the
    unreadable fence it is; the next writer still takes a generation above it and commits."""
    from training.checkpoint.fence import FENCE_MAX_BYTES, damaged_owners, fence_path

    a = str(tmp_path / "a")
    save_steps(CheckpointManager(config(a), launch(tmp_path, generation=0)), [1])
    store = open_storage(a)
    hostile = Path(a) / fence_path(5)
    hostile.write_bytes(b"[" * (FENCE_MAX_BYTES - 1))
    assert Fence(launch(tmp_path, generation=1)).record(store, 5) is None
    assert damaged_owners(store, 1) == {"job"}
    mgr = CheckpointManager(config(a), launch(tmp_path, generation=1))
    assert (mgr.restore(make_state(999)) or pytest.fail("no restore")).step == 1
    save_steps(mgr, [2])
    mgr.close()
    assert committed_steps(a)[0] == 2
