"""CheckpointManager in one process (world size 1) on local-directory stores: redundancy, integrity,
fallback, fencing, retention, async blocking. S3 and multi-process tests are in tests/integration."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.fixtures.checkpoint import (
    Recorder,
    assert_same,
    config,
    ctx,
    make_state,
    restored,
    save_steps,
)
from training.checkpoint import CheckpointError, CheckpointManager, list_checkpoints, open_storage
from training.checkpoint.manifest import MANIFEST_NAME, Manifest, read_manifest, step_dir, verify_store
from training.checkpoint.results import CheckpointCorruptError, CheckpointMismatchError
from training.config import CheckpointConfig

pytestmark = pytest.mark.timeout(120)


def test_save_goes_to_every_store_with_a_verifying_manifest(tmp_path: Path) -> None:
    uris = [str(tmp_path / "a"), f"file://{tmp_path / 'b'}"]
    sink = Recorder()
    mgr = CheckpointManager(config(*uris), ctx(tmp_path), sink)
    mgr.manifest_extra["ddp_buckets"] = [1, 0]  # what the trainer adds (DDP's rebuilt bucket layout)
    states = save_steps(mgr, [1, 2])
    mgr.close()
    for uri in uris:
        store = open_storage(uri)
        listing = list_checkpoints(store)
        assert [c.step for c in listing] == [2, 1]
        manifest = listing[0].manifest
        assert manifest is not None and manifest.generation == 0 and manifest.world_size == 1
        assert {f.path for f in manifest.files} == {"gen-0000/.metadata", "gen-0000/__0_0.distcp"}
        assert verify_store(store, manifest).ok
        assert manifest.extra == {"ddp_buckets": [1, 0]}
    committed = [r for r in sink.checkpoints if r.committed]
    assert [r.step for r in committed] == [1, 2] and committed[-1].stores_ok == ["s0", "s1"]
    result, target = restored(CheckpointManager(config(*uris), ctx(tmp_path, 1)))
    assert result is not None and result.step == 2 and result.store == "s0" and result.source == "store"
    assert result.extra == {"ddp_buckets": [1, 0]}
    assert_same(target, states[2])


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete_manifest", "delete_shard", "garbage_manifest"])
def test_damaged_copy_falls_back_to_other_store_then_older_step(tmp_path: Path, damage: str) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    mgr = CheckpointManager(config(a, b), ctx(tmp_path))
    states = save_steps(mgr, [1, 2])
    mgr.close()

    def hurt(root: str, step: int) -> None:
        d = Path(root) / step_dir(step)
        shard = d / "gen-0000" / "__0_0.distcp"
        if damage == "flip_byte":
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0x01
            shard.write_bytes(bytes(data))
        elif damage == "truncate":
            shard.write_bytes(shard.read_bytes()[:-7])
        elif damage == "delete_manifest":
            (d / MANIFEST_NAME).unlink()
        elif damage == "delete_shard":
            shard.unlink()
        else:
            (d / MANIFEST_NAME).write_text("{not json")

    hurt(a, 2)  # the first store's newest copy is bad: the second store's copy of step 2 wins
    sink = Recorder()
    result, target = restored(CheckpointManager(config(a, b), ctx(tmp_path, 1), sink))
    assert result is not None and (result.step, result.store) == (2, "s1")
    assert_same(target, states[2])
    hurt(b, 2)  # now step 2 is bad everywhere: step 1
    result, target = restored(CheckpointManager(config(a, b), ctx(tmp_path, 2)))
    assert result is not None and (result.step, result.store) == (1, "s0")
    assert_same(target, states[1])
    # evidence is never deleted by a restore
    assert (Path(a) / step_dir(2)).exists() and (Path(b) / step_dir(2)).exists()


def test_shards_are_written_straight_into_each_store_hashed_while_written(tmp_path: Path) -> None:
    from blake3 import blake3

    a, b = tmp_path / "a", tmp_path / "b"
    mgr = CheckpointManager(config(str(a), str(b)), ctx(tmp_path))
    save_steps(mgr, [1])
    mgr.close()
    # no staging directory: with file stores only, nothing of the checkpoint is written on the node
    assert not (Path(mgr.node_dir) / step_dir(1)).exists()
    manifest = read_manifest(open_storage(str(a)), 1)
    for root in (a, b):
        for entry in manifest.files:
            path = root / step_dir(1) / entry.path
            assert blake3(path.read_bytes()).hexdigest() == entry.digest and path.stat().st_size == entry.size
    # two stores on one filesystem are two copies (reflinked where supported, never hard-linked)
    shard = next(e.path for e in manifest.files if e.path.endswith(".distcp"))
    assert (a / step_dir(1) / shard).stat().st_ino != (b / step_dir(1) / shard).stat().st_ino
    assert (a / step_dir(1) / shard).stat().st_nlink == 1


def test_a_corrupt_only_copy_is_never_loaded_into_the_state(tmp_path: Path) -> None:
    a = str(tmp_path / "a")
    mgr = CheckpointManager(config(a), ctx(tmp_path))
    save_steps(mgr, [1])
    mgr.close()
    shard = Path(a) / step_dir(1) / "gen-0000" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    sink = Recorder()
    target = make_state(-1)
    before = {k: v.clone() for k, v in target["model"].items()}
    # The job's only checkpoint is corrupt: refuse to start over from step 0 (its progress would be lost
    # without a word); the state is untouched and the evidence stays.
    with pytest.raises(CheckpointCorruptError, match=r"committed checkpoints of steps \[1\] but every copy is corrupt"):
        CheckpointManager(config(a), ctx(tmp_path, 1), sink).restore(target)
    assert all(torch.equal(v, before[k]) for k, v in target["model"].items())
    assert [e for e in sink.events if "digest mismatch" in str(e)], sink.events
    assert shard.exists()
    # Starting over is a decision the job file states.
    assert CheckpointManager(config(a, resume="never"), ctx(tmp_path, 2)).restore(target) is None


@pytest.mark.parametrize("damage", ["flip_byte", "delete_shard", "truncate"])
def test_checkpoints_corrupt_in_every_store_that_answers_are_a_permanent_error(tmp_path: Path, damage: str) -> None:
    """Every copy failing its integrity check is a verdict no restart changes (permanent, exit 3); with a
    store that did not answer, or a copy that failed otherwise, it stays retryable (the CheckpointError
    base, exit 200)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    mgr = CheckpointManager(config(a, b), ctx(tmp_path))
    save_steps(mgr, [1, 2])
    mgr.close()
    for root in (a, b):
        for step in (1, 2):
            shard = Path(root) / step_dir(step) / "gen-0000" / "__0_0.distcp"
            if damage == "delete_shard":
                shard.unlink()
            elif damage == "truncate":
                shard.write_bytes(shard.read_bytes()[:-3])
            else:
                data = bytearray(shard.read_bytes())
                data[len(data) // 3] ^= 0x40
                shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"steps \[2, 1\] but every copy is corrupt or incomplete"):
        CheckpointManager(config(a, b), ctx(tmp_path, 1)).restore(make_state(0))

    # A third store that cannot be listed may hold a good copy: not final.
    restorer = CheckpointManager(config(a, b, str(tmp_path / "c")), ctx(tmp_path, 2))

    def unreachable(rel: str) -> list[str]:
        raise ConnectionError("store c: connection refused")

    restorer.stores[2].list_dir = unreachable  # type: ignore[method-assign]
    with pytest.raises(CheckpointError, match="no copy of any of them could be loaded") as caught:
        restorer.restore(make_state(0))
    assert not isinstance(caught.value, CheckpointCorruptError)


def test_checkpoints_that_do_not_fit_the_model_are_a_permanent_error_naming_the_difference(tmp_path: Path) -> None:
    """A model changed under the same job (a shape, a new parameter): no copy and no restart loads its
    checkpoints. CheckpointMismatchError (exit 2) names the first difference; the state is untouched."""
    a = str(tmp_path / "a")
    mgr = CheckpointManager(config(a), ctx(tmp_path))
    save_steps(mgr, [1, 2])
    mgr.close()
    smaller = make_state(5, size=32)
    before = smaller["model"]["w"].clone()
    shapes = r"model.w was saved with shape \[64, 64\], the model's is \[32, 32\]"
    with pytest.raises(CheckpointMismatchError, match=shapes):
        CheckpointManager(config(a), ctx(tmp_path, 1)).restore(smaller)
    assert torch.equal(smaller["model"]["w"], before)
    grown = make_state(5)
    grown["model"]["extra"] = torch.zeros(3)
    missing = r"steps \[2, 1\]\) do not fit its model: the checkpoint has no model.extra"
    with pytest.raises(CheckpointMismatchError, match=missing):
        CheckpointManager(config(a), ctx(tmp_path, 2)).restore(grown)
    # A store that did not answer may hold checkpoints of the new model: not final.
    restorer = CheckpointManager(config(a, str(tmp_path / "c")), ctx(tmp_path, 3))

    def unreachable(rel: str) -> list[str]:
        raise ConnectionError("store c: connection refused")

    restorer.stores[1].list_dir = unreachable  # type: ignore[method-assign]
    with pytest.raises(CheckpointError) as caught:
        restorer.restore(make_state(5, size=32))
    assert not isinstance(caught.value, CheckpointMismatchError)


def test_resume_policies(tmp_path: Path) -> None:
    a = str(tmp_path / "a")
    with pytest.raises(CheckpointError, match="required"):
        CheckpointManager(config(a, resume="required"), ctx(tmp_path)).restore(make_state(0))
    assert CheckpointManager(config(a), ctx(tmp_path)).restore(make_state(0)) is None
    mgr = CheckpointManager(config(a), ctx(tmp_path))
    save_steps(mgr, [3])
    mgr.close()
    target = make_state(7)
    assert CheckpointManager(config(a, resume="never"), ctx(tmp_path, 1)).restore(target) is None
    assert target["progress"].step == 7
    result = CheckpointManager(config(a, resume="required"), ctx(tmp_path, 1)).restore(target)
    assert result is not None and result.step == 3 and target["progress"].step == 3


def test_broken_store_does_not_stop_the_others_and_is_retried(tmp_path: Path) -> None:
    good = str(tmp_path / "good")
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where a directory is expected")  # root ignores chmod; this fails for root too
    sink = Recorder()
    mgr = CheckpointManager(config(good, str(blocker / "sub")), ctx(tmp_path), sink)
    save_steps(mgr, [1])
    assert mgr.last_committed_step == 1
    last = sink.checkpoints[-1]
    assert last.committed and last.stores_ok == ["s0"] and last.stores_failed == ["s1"]
    assert [s for s, _ in sink.failures] == ["s1"]
    blocker.unlink()  # the store comes back: the next checkpoint reaches it
    save_steps(mgr, [2])
    mgr.close()
    assert sink.checkpoints[-1].stores_ok == ["s0", "s1"]
    assert [c.step for c in list_checkpoints(open_storage(str(blocker / "sub"))) if c.committed] == [2]


def test_retention_keeps_newest_and_evidence(tmp_path: Path) -> None:
    a = str(tmp_path / "a")
    mgr = CheckpointManager(config(a, keep=2), ctx(tmp_path))
    save_steps(mgr, [1, 2])
    # debris of a crashed save older than the kept ones, and evidence newer than them
    (Path(a) / step_dir(0) / "gen-0000").mkdir(parents=True)
    (Path(a) / step_dir(50) / "gen-0000").mkdir(parents=True)
    save_steps(mgr, [3, 4])
    mgr.close()
    listing = list_checkpoints(open_storage(a))
    assert [(c.step, c.committed) for c in listing] == [(50, False), (4, True), (3, True)]


def test_stale_generation_is_fenced(tmp_path: Path) -> None:
    a = str(tmp_path / "a")
    old = CheckpointManager(config(a), ctx(tmp_path, generation=0))
    save_steps(old, [1])
    new = CheckpointManager(config(a), ctx(tmp_path, generation=1))  # the restarted group takes over
    new_states = save_steps(new, [2])
    sink = Recorder()
    old.sink = sink
    save_steps(old, [2, 3])  # the stale worker is still running
    assert not any(r.committed for r in sink.checkpoints)
    assert any(e == "checkpoint_fenced" for e, _ in sink.events)
    manifest = read_manifest(open_storage(a), 2)
    assert manifest.generation == 1  # not overwritten
    assert [c.step for c in list_checkpoints(open_storage(a)) if c.committed] == [2, 1]
    # the stale writer's step-2 shards went to gen-0000/, the newer ones in gen-0001/ are intact
    assert verify_store(open_storage(a), manifest).ok
    result, target = restored(CheckpointManager(config(a), ctx(tmp_path, generation=2)))
    assert result is not None and result.step == 2
    assert_same(target, new_states[2])
    old.close()
    new.close()


def test_a_manager_built_without_fencing_now_takes_its_generation_at_its_first_save(tmp_path: Path) -> None:
    """The manager an in-place recovery builds (`fence_now=False`) writes nothing at construction; its
    first save takes a newer writer generation, which fences the manager it replaced."""
    a = str(tmp_path / "a")
    old = CheckpointManager(config(a), ctx(tmp_path))
    save_steps(old, [1])
    fences = sorted(p.name for p in (Path(a) / "fences").iterdir())
    new = CheckpointManager(config(a), ctx(tmp_path), fence_now=False)
    assert sorted(p.name for p in (Path(a) / "fences").iterdir()) == fences  # nothing written yet
    save_steps(new, [2])
    assert read_manifest(open_storage(a), 2).generation > read_manifest(open_storage(a), 1).generation
    sink = Recorder()
    old.sink = sink
    save_steps(old, [3])  # the replaced manager, still around: fenced
    assert not any(r.committed for r in sink.checkpoints)
    old.close()
    new.close()


def test_new_launch_takes_over_from_an_older_launch(tmp_path: Path) -> None:
    a = str(tmp_path / "a")
    first = CheckpointManager(config(a), ctx(tmp_path, generation=3, run_id="launch-1"))
    save_steps(first, [1])
    first.close()
    second = CheckpointManager(config(a), ctx(tmp_path, generation=0, run_id="launch-2"))
    assert second.restore(make_state(0)) is not None
    save_steps(second, [2])
    second.close()
    assert read_manifest(open_storage(a), 2).run_id == "launch-2"
    newest_fence = sorted((Path(a) / "fences").iterdir())[-1]
    fence = json.loads(newest_fence.read_text())
    assert fence["run_id"] == "launch-2"


def test_should_save_by_steps_and_if_busy_skip(tmp_path: Path) -> None:
    cfg = CheckpointConfig.model_validate(
        {"every": {"steps": 5}, "ifBusy": "skip", "stores": [{"uri": str(tmp_path / "a")}]}
    )
    mgr = CheckpointManager(cfg, ctx(tmp_path))
    assert [s for s in range(0, 16) if mgr.should_save(s)] == [5, 10, 15]
    sink = Recorder()
    mgr.sink = sink
    big = {"model": {"w": torch.randn(1024, 1024)}}
    mgr.save(5, big)
    mgr.save(10, big)  # the first is very likely still uploading: skipped, never queued
    mgr.close()
    skipped = [f["step"] for e, f in sink.events if e == "checkpoint_skipped"]
    committed = [r.step for r in sink.checkpoints if r.committed]
    assert sorted(skipped + committed) == [5, 10] and 5 in committed


def test_should_save_by_seconds(tmp_path: Path) -> None:
    cfg = CheckpointConfig.model_validate({"every": {"seconds": 0.2}, "stores": [{"uri": str(tmp_path / "a")}]})
    mgr = CheckpointManager(cfg, ctx(tmp_path))
    assert not mgr.should_save(1)
    import time

    time.sleep(0.25)
    assert mgr.should_save(2)
    mgr.save(2, make_state(2))
    assert not mgr.should_save(3)
    mgr.close()


def test_async_save_blocks_less_than_the_full_save(tmp_path: Path) -> None:
    state = {"model": {f"w{i}": torch.randn(1024, 1024) for i in range(8)}}  # 32 MiB
    stores = [str(tmp_path / "a"), str(tmp_path / "b")]
    mgr = CheckpointManager(config(*stores), ctx(tmp_path))
    mgr.save(1, state)
    mgr.close()
    record = mgr.history[-1]
    assert record.committed and record.save_s is not None
    # staging (a CPU copy) must be a small fraction of serialise + hash + upload to two stores
    assert record.blocked_s < 0.5 * record.save_s, (record.blocked_s, record.save_s)
    sync = CheckpointManager(config(*stores, **{"async": False}), ctx(tmp_path, 1))
    sync.save(2, state)
    sync.close()
    assert sync.history[-1].blocked_s == sync.history[-1].save_s


def test_staged_copy_is_isolated_from_later_updates(tmp_path: Path) -> None:
    a = str(tmp_path / "a")
    mgr = CheckpointManager(config(a), ctx(tmp_path))
    state = make_state(1)
    expected = state["model"]["w"].clone()
    mgr.save(1, state)
    state["model"]["w"].add_(100.0)  # training goes on while the save is in flight
    state["progress"].step = 42
    mgr.close()
    result, target = restored(CheckpointManager(config(a), ctx(tmp_path, 1)))
    assert result is not None
    assert torch.equal(target["model"]["w"], expected) and target["progress"].step == 1


def test_node_local_copy_is_preferred_and_verified(tmp_path: Path) -> None:
    a = str(tmp_path / "a")
    node_local = {"enabled": True, "path": str(tmp_path / "shm")}
    mgr = CheckpointManager(config(a, nodeLocal=node_local), ctx(tmp_path))
    states = save_steps(mgr, [1, 2])
    mgr.close()
    local_steps = sorted(os.listdir(tmp_path / "shm" / "job" / "node-0"))
    assert local_steps == [step_dir(2)]  # only the newest is kept locally
    result, target = restored(CheckpointManager(config(a, nodeLocal=node_local), ctx(tmp_path, 1)))
    assert result is not None and (result.step, result.source) == (2, "node-local")
    assert_same(target, states[2])
    # corrupt the local copy: the store's copy is used instead
    shard = tmp_path / "shm" / "job" / "node-0" / step_dir(2) / "gen-0000" / "__0_0.distcp"
    shard.write_bytes(b"x" + shard.read_bytes()[1:])
    result, target = restored(CheckpointManager(config(a, nodeLocal=node_local), ctx(tmp_path, 2)))
    assert result is not None and (result.step, result.source, result.store) == (2, "store", "s0")
    assert_same(target, states[2])


def test_manifest_roundtrip() -> None:
    from training.checkpoint.manifest import FileEntry

    m = Manifest(1, 2, 3, "j", 1.5, "2.13", [FileEntry("gen-0003/a", 1, "ab", 0, 0)], run_id="r")
    assert Manifest.from_json(m.to_json()) == m


@given(
    step=st.integers(min_value=0, max_value=10**9),
    generation=st.integers(min_value=0, max_value=9999),
    paths=st.lists(st.text(alphabet="abc_./0123456789", min_size=1, max_size=20), max_size=5),
)
def test_manifest_and_step_names_roundtrip(step: int, generation: int, paths: list[str]) -> None:
    from training.checkpoint.manifest import FileEntry, gen_dir, parse_step_dir

    assert parse_step_dir(step_dir(step)) == step
    assert parse_step_dir(gen_dir(generation)) is None
    files = [FileEntry(f"{gen_dir(generation)}/{p}", i, "0" * 64, i, 0) for i, p in enumerate(paths)]
    m = Manifest(step, 2, generation, "job", 1.0, torch.__version__, files)
    assert Manifest.from_json(m.to_json()) == m


@pytest.mark.parametrize("full", ["a", "b"])  # the first target is written inline, the others on threads
def test_a_store_whose_writes_fail_is_dropped_and_the_other_commits_a_verifying_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full: str
) -> None:
    import errno

    import training.checkpoint.writer as writer

    a, b = tmp_path / "a", tmp_path / "b"
    real = writer._write_all

    def full_disk(fd: int, data: memoryview, offset: int) -> None:
        if f"{os.sep}{full}{os.sep}" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    monkeypatch.setattr(writer, "_write_all", full_disk)
    good, bad = (a, b) if full == "b" else (b, a)
    good_name, bad_name = ("s0", "s1") if full == "b" else ("s1", "s0")
    sink = Recorder()
    mgr = CheckpointManager(config(str(a), str(b)), ctx(tmp_path), sink)
    big = {"model": {"w": torch.randn(1024, 1024), "b": torch.randn(8)}, "progress": make_state(1)["progress"]}
    mgr.save(1, big)  # 4 MB: written to both stores at once, each on its own thread
    mgr.close()
    record = sink.checkpoints[-1]
    assert record.committed and record.stores_ok == [good_name] and record.stores_failed == [bad_name]
    manifest = read_manifest(open_storage(str(good)), 1)
    assert verify_store(open_storage(str(good)), manifest).ok
    assert not (bad / step_dir(1) / MANIFEST_NAME).exists()  # never committed where the bytes did not land
    target = {"model": {"w": torch.zeros(1024, 1024), "b": torch.zeros(8)}, "progress": make_state(2)["progress"]}
    result = CheckpointManager(config(str(a), str(b)), ctx(tmp_path, 1)).restore(target)
    assert result is not None and (result.step, result.store) == (1, good_name)
    assert torch.equal(target["model"]["w"], big["model"]["w"])


def test_every_byte_written_has_its_writeback_started_once_per_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tee starts each chunk's writeback as soon as it is written (`writer.start_writeback`), so the
    fsync on close has little left to do: per file and store, the ranges started cover the file exactly
    once, in order, and the files are the same bytes as without it."""
    import threading

    import training.checkpoint.writer as writer

    real = writer.start_writeback
    started: dict[str, list[tuple[int, int]]] = {}
    lock = threading.Lock()

    def record(fd: int, offset: int, nbytes: int) -> None:
        with lock:
            started.setdefault(os.readlink(f"/proc/self/fd/{fd}"), []).append((offset, nbytes))
        real(fd, offset, nbytes)

    monkeypatch.setattr(writer, "start_writeback", record)
    a, b = tmp_path / "a", tmp_path / "b"
    mgr = CheckpointManager(config(str(a), str(b)), ctx(tmp_path))
    big = {"model": {"w": torch.randn(3 * 1024, 1024), "b": torch.randn(8)}, "progress": make_state(1)["progress"]}
    mgr.save(1, big)  # 12 MB: chunks of HASH_CHUNK on both stores, the small records buffered
    mgr.close()
    files = [p for root in (a, b) for p in (root / step_dir(1)).rglob("*") if p.is_file() and p.name != MANIFEST_NAME]
    assert len(files) == 4  # a shard and DCP's .metadata in each store
    renamed = {name.removesuffix(".tmp"): r for name, r in started.items()}  # DCP renames `.metadata.tmp`
    for path in files:
        ranges = renamed[str(path)]
        ends = [offset + n for offset, n in ranges]
        assert [offset for offset, _ in ranges] == [0, *ends[:-1]], f"{path}: gaps or overlaps"
        assert ends[-1] == path.stat().st_size
    assert max(n for r in started.values() for _, n in r) == writer.HASH_CHUNK
    for path in files:
        twin = b / path.relative_to(a) if path.is_relative_to(a) else a / path.relative_to(b)
        assert path.read_bytes() == twin.read_bytes()
    manifest = read_manifest(open_storage(str(a)), 1)
    assert verify_store(open_storage(str(a)), manifest).ok


def test_a_commit_shortens_the_gil_switch_interval_only_while_it_runs() -> None:
    """The commit thread waits for the training thread's GIL turn at every return to Python; while any
    commit runs the interval is short, and the last one out restores the interpreter's own."""
    import sys
    import threading

    from training.checkpoint import manager

    own = sys.getswitchinterval()
    inside: list[float] = []
    entered, release = threading.Event(), threading.Event()

    def commit() -> None:
        with manager.commit_priority():
            inside.append(sys.getswitchinterval())
            entered.set()
            release.wait(5)

    other = threading.Thread(target=commit)
    other.start()
    assert entered.wait(5)
    with manager.commit_priority():  # a second, overlapping commit
        inside.append(sys.getswitchinterval())
    assert sys.getswitchinterval() == manager.COMMIT_SWITCH_INTERVAL_S, "still short: the other commit runs"
    release.set()
    other.join(5)
    assert inside == [manager.COMMIT_SWITCH_INTERVAL_S] * 2
    assert sys.getswitchinterval() == own
