"""Stores that hold damage a crash does not leave: every manifest of a job broken, fences deleted under
committed shards, a FIFO or a gigabyte where a manifest should be. None of them may make a job start
over on top of its own checkpoints, write into another writer's shards, hang, or fill memory."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from orchestrator.cli import cli
from tests.fixtures.checkpoint import assert_same, ckpt_identity, config, make_state, save_steps
from training.checkpoint import CheckpointManager, list_checkpoints, open_storage
from training.checkpoint.manifest import MANIFEST_NAME, step_dir
from training.checkpoint.results import CheckpointCorruptError
from training.checkpoint.storage import SMALL_OBJECT_MAX_BYTES

pytestmark = pytest.mark.timeout(120)


def _ident(tmp_path: Path, job: str = "job", generation: int = 0) -> Any:
    return ckpt_identity(tmp_path / "run", generation=generation, job=job)


def _saved(tmp_path: Path, steps: tuple[int, ...], job: str = "job") -> tuple[str, dict[int, dict[str, Any]]]:
    store = str(tmp_path / "store")
    mgr = CheckpointManager(config(store, keep=10), _ident(tmp_path, job))
    states = save_steps(mgr, list(steps))
    mgr.close()
    return store, states


def _tree(root: str) -> dict[str, str]:
    """Every file of the step directories under `root` with a hash of its bytes (not the fences: a new
    writer takes its generation there when it starts)."""
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(base, name), root)
            if not rel.startswith("fences/"):
                out[rel] = hashlib.sha256(Path(root, rel).read_bytes()).hexdigest()
    return out


def _manifest(store: str, step: int) -> Path:
    return Path(store) / step_dir(step) / MANIFEST_NAME


@pytest.mark.parametrize("damage", ["truncated", "invalid field"])
def test_a_job_whose_every_manifest_is_damaged_refuses_to_start_over(tmp_path: Path, damage: str) -> None:
    """Before, every manifest unreadable meant "no checkpoint of this job": the job trained from step 0,
    committed new manifests over its old steps, and retention deleted their intact shards. Now it stops
    (permanently, as for corrupt shards), the store untouched; `resume: never` still starts over."""
    store, _ = _saved(tmp_path, (1, 2, 3))
    for step in (1, 2, 3):
        path = _manifest(store, step)
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[:200])
        else:
            raw = json.loads(path.read_text())
            raw["files"][0]["size"] = -5
            path.write_text(json.dumps(raw))
    before = _tree(store)
    with pytest.raises(CheckpointCorruptError, match=r"\(s0: steps 1-3 \(3\)\) whose manifests are damaged"):
        CheckpointManager(config(store, keep=10), _ident(tmp_path, generation=1)).restore(make_state(0))
    assert _tree(store) == before
    never = CheckpointManager(config(store, keep=10, resume="never"), _ident(tmp_path, generation=2))
    assert never.restore(make_state(0)) is None


def test_another_jobs_damaged_manifests_do_not_stop_this_one(tmp_path: Path) -> None:
    """The refusal is for the job whose fences took the damaged steps' writer generations: a new job in a
    store where only another job's manifests are broken starts fresh (the preflight's fence check is
    what stops two jobs sharing a store)."""
    store, _ = _saved(tmp_path, (1,), job="other")
    _manifest(store, 1).write_bytes(b"{")
    assert CheckpointManager(config(store), _ident(tmp_path, job="mine")).restore(make_state(0)) is None


def test_a_writer_never_writes_into_a_gen_folder_whose_fence_is_gone(tmp_path: Path) -> None:
    """A store whose `fences/` was deleted (or written before fences): the next writer numbered its
    generation from the fences alone, took gen 0 again and DCP overwrote the first job's committed shards
    (the manifest commit was refused, too late). It now numbers above every `gen-N` folder as well."""
    store, states = _saved(tmp_path, (1, 2), job="first")
    shutil.rmtree(Path(store) / "fences")
    before = {k: v for k, v in _tree(store).items() if k.startswith(step_dir(1))}
    mgr = CheckpointManager(config(store, keep=10), _ident(tmp_path, job="second"))
    save_steps(mgr, [1, 3])
    mgr.close()
    after = _tree(store)
    assert all(after[k] == v for k, v in before.items()), "the first job's committed step 1 was overwritten"
    assert any(k.startswith(f"{step_dir(3)}/gen-0001/") for k in after), sorted(after)
    assert CliRunner().invoke(cli, ["checkpoints", "verify", store, "--step", "2"]).exit_code == 0
    target = make_state(0)
    result = CheckpointManager(config(store), _ident(tmp_path, job="first", generation=1)).restore(target)
    assert result is not None and result.step == 2
    assert_same(target, states[2])


def test_a_fifo_for_a_manifest_neither_hangs_nor_hides_the_older_steps(tmp_path: Path) -> None:
    store, states = _saved(tmp_path, (1, 2))
    _manifest(store, 2).unlink()
    os.mkfifo(_manifest(store, 2))
    listed: list[Any] = []
    reader = threading.Thread(target=lambda: listed.extend(list_checkpoints(open_storage(store))), daemon=True)
    reader.start()
    reader.join(20)
    assert not reader.is_alive(), "listing blocked on the FIFO"
    bad = next(c for c in listed if c.step == 2)
    assert bad.manifest is None and "not a regular file" in str(bad.error)
    target = make_state(0)
    result = CheckpointManager(config(store), _ident(tmp_path, generation=1)).restore(target)
    assert result is not None and result.step == 1
    assert_same(target, states[1])


def test_an_oversized_manifest_is_refused_without_reading_it(tmp_path: Path) -> None:
    """A 1.5 GB manifest took 3.3 GB of memory to list. A sparse file: its size says it all."""
    store, _ = _saved(tmp_path, (1, 2))
    with open(_manifest(store, 2), "r+b") as fh:
        fh.truncate(SMALL_OBJECT_MAX_BYTES + 1)
    bad = next(c for c in list_checkpoints(open_storage(store)) if c.step == 2)
    assert bad.manifest is None and "more than the" in str(bad.error)
    done = CliRunner().invoke(cli, ["checkpoints", "list", store, "-o", "json"])
    assert done.exit_code == 0
    rows = {r["step"]: r for r in json.loads(done.output)[store]}
    assert rows[1]["committed"] and not rows[2]["committed"]


def test_an_oversized_object_in_an_object_store_is_refused() -> None:
    storage = open_storage("memory://hostile-store")
    storage.fs.pipe_file(f"{storage.root}/{step_dir(1)}/{MANIFEST_NAME}", b" " * 2048)
    with pytest.raises(ValueError, match="more than the 1024 bytes"):
        storage.read_bytes(f"{step_dir(1)}/{MANIFEST_NAME}", max_bytes=1024)
    assert storage.read_bytes(f"{step_dir(1)}/{MANIFEST_NAME}", max_bytes=4096) == b" " * 2048


def test_verify_fails_when_the_newest_manifest_is_damaged(tmp_path: Path) -> None:
    store, _ = _saved(tmp_path, (1, 2))
    _manifest(store, 2).write_bytes(_manifest(store, 2).read_bytes()[:100])
    done = CliRunner().invoke(cli, ["checkpoints", "verify", store])
    assert done.exit_code == 1 and "newest committed step 2 does not verify" in done.output


@pytest.mark.parametrize("command", ["list", "verify"])
def test_a_store_path_that_is_no_directory_is_bad_input_not_an_empty_store(tmp_path: Path, command: str) -> None:
    (tmp_path / "afile").write_text("x")
    for path, says in ((tmp_path / "nosuch", "no such directory"), (tmp_path / "afile", "not a directory")):
        done = CliRunner().invoke(cli, ["checkpoints", command, str(path)])
        assert done.exit_code == 2, done.output
        assert done.output.strip() == f"error: STORE_URI {path}: {says}"


def test_verify_fails_a_manifest_that_leaves_a_shard_out(tmp_path: Path) -> None:
    """Every file a manifest lists intact, but one the checkpoint reads left out: the restore refuses it
    (`not in the manifest`) and falls back, so `verify` must not call it ok."""
    store, _ = _saved(tmp_path, (1, 2))
    raw = json.loads(_manifest(store, 2).read_text())
    raw["files"] = [f for f in raw["files"] if not f["path"].endswith(".distcp")]
    _manifest(store, 2).write_text(json.dumps(raw))
    done = CliRunner().invoke(cli, ["checkpoints", "verify", store, "-o", "json"])
    rows = {r["step"]: r for r in json.loads(done.output)["stores"][store]}
    assert done.exit_code == 1, done.output
    assert rows[2]["status"] == "CORRUPT" and rows[1]["status"] == "ok"
    assert rows[2]["bad"] == {"gen-0000/__0_0.distcp": "read by the checkpoint, not in the manifest"}
