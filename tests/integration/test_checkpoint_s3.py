"""Checkpoints on two local stores and a real S3 endpoint (moto on 127.0.0.1): redundancy, fallback to the
object store, a store lost mid-run, the `torchrig checkpoints` CLI against all of them, the writer fence
across launches on S3's conditional writes, and a crafted manifest that tries to escape on restore."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from orchestrator.cli import cli
from tests.fixtures.checkpoint import ckpt_identity
from tests.fixtures.s3 import S3Server
from training.checkpoint import CheckpointManager, list_checkpoints, open_storage, read_manifest
from training.checkpoint.fence import Fence
from training.checkpoint.manifest import step_dir, verify_store
from training.config import CheckpointConfig
from training.contract import WorkerIdentity
from training.metrics.base import CheckpointRecord, MetricsSink

pytestmark = [pytest.mark.s3, pytest.mark.timeout(180)]


class Recorder(MetricsSink):
    def __init__(self) -> None:
        self.checkpoints: list[CheckpointRecord] = []
        self.failures: list[str] = []

    def on_checkpoint(self, record: CheckpointRecord) -> None:
        self.checkpoints.append(record)

    def on_store_failure(self, store: str, error: str) -> None:
        self.failures.append(store)


def _cfg(tmp_path: Path, s3: S3Server, *, local: int = 2) -> CheckpointConfig:
    stores: list[dict[str, Any]] = [{"uri": str(tmp_path / n), "name": n} for n in "ab"[:local]]
    stores.append({"uri": s3.uri(), "name": "s3", "options": s3.options})
    return CheckpointConfig.model_validate({"every": {"steps": 1}, "stores": stores})


def _ctx(tmp_path: Path, generation: int) -> WorkerIdentity:
    return ckpt_identity(tmp_path / "run", generation=generation)


def _state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((256, 256), float(step))}, "step": step}


def _restore(tmp_path: Path, s3: S3Server, generation: int, **kw: Any) -> tuple[Any, dict[str, Any]]:
    target = _state(-1)
    mgr = CheckpointManager(_cfg(tmp_path, s3, **kw), _ctx(tmp_path, generation))
    result = mgr.restore(target)
    mgr.close()
    return result, target


def test_three_stores_and_a_lost_s3(tmp_path: Path, s3_server: S3Server) -> None:
    sink = Recorder()
    mgr = CheckpointManager(_cfg(tmp_path, s3_server), _ctx(tmp_path, 0), sink)
    for step in (1, 2):
        mgr.save(step, _state(step))
        mgr.wait()
    assert [r.stores_ok for r in sink.checkpoints if r.committed] == [["a", "b", "s3"]] * 2
    s3 = open_storage(s3_server.uri(), s3_server.options)
    listing = list_checkpoints(s3)
    assert [c.step for c in listing if c.committed] == [2, 1]
    assert listing[0].manifest is not None and verify_store(s3, listing[0].manifest).ok

    s3_server.stop()  # the object store goes away mid-run: training and the other stores go on
    mgr.save(3, _state(3))
    mgr.close()
    last = sink.checkpoints[-1]
    assert last.committed and last.stores_ok == ["a", "b"] and last.stores_failed == ["s3"]
    assert sink.failures == ["s3"]
    result, target = _restore(tmp_path, s3_server, 1)  # with S3 still down: the listing failure is tolerated
    assert result is not None and (result.step, result.store) == (3, "a")
    assert torch.equal(target["model"]["w"], _state(3)["model"]["w"]) and target["step"] == 3


def test_restore_falls_back_to_s3_copy_when_local_is_corrupt(tmp_path: Path, s3_server: S3Server) -> None:
    mgr = CheckpointManager(_cfg(tmp_path, s3_server, local=1), _ctx(tmp_path, 0))
    for step in (1, 2):
        mgr.save(step, _state(step))
    mgr.close()
    shard = tmp_path / "a" / step_dir(2) / "gen-0000" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    result, target = _restore(tmp_path, s3_server, 1, local=1)
    assert result is not None and (result.step, result.store, result.source) == (2, "s3", "store")
    assert result.uri == f"{s3_server.uri()}/{step_dir(2)}"
    assert torch.equal(target["model"]["w"], _state(2)["model"]["w"])
    # the S3 copy is now corrupt too (truncated object): the newest valid is step 1
    s3 = open_storage(s3_server.uri(), s3_server.options)
    rel = f"{step_dir(2)}/gen-0000/__0_0.distcp"
    s3.fs.pipe_file(f"{s3.root}/{rel}", s3.read_bytes(rel)[:-100])
    result, target = _restore(tmp_path, s3_server, 2, local=1)
    assert result is not None and (result.step, result.store) == (1, "a")
    assert target["step"] == 1


def test_cli_list_verify_inspect_across_stores(
    tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = CheckpointManager(_cfg(tmp_path, s3_server, local=1), _ctx(tmp_path, 0))
    for step in (1, 2):
        mgr.save(step, _state(step))
    mgr.close()
    (tmp_path / "a" / step_dir(2) / "manifest.json").unlink()  # step 2 uncommitted in store a
    # Credentials come from the environment, as s3fs (botocore) reads them; never from argv.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    opts = ["--option", f"endpoint_url={s3_server.endpoint_url}"]
    runner = CliRunner()
    a = str(tmp_path / "a")

    res = runner.invoke(cli, ["checkpoints", "list", s3_server.uri(), *opts, "--option", "secret=testing"])
    assert res.exit_code == 2 and "--option secret: credentials are not taken from the command line" in res.output

    res = runner.invoke(cli, ["checkpoints", "list", a, s3_server.uri(), *opts, "-o", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [(r["step"], r["committed"]) for r in data[a]] == [(2, False), (1, True)]
    assert [(r["step"], r["committed"]) for r in data[s3_server.uri()]] == [(2, True), (1, True)]
    res = runner.invoke(cli, ["checkpoints", "list", a, s3_server.uri(), *opts])
    assert res.exit_code == 0 and "uncommitted" in res.output and "committed" in res.output

    res = runner.invoke(cli, ["checkpoints", "verify", s3_server.uri(), *opts])
    assert res.exit_code == 0, res.output
    s3 = open_storage(s3_server.uri(), s3_server.options)
    rel = f"{step_dir(2)}/gen-0000/__0_0.distcp"
    blob = bytearray(s3.read_bytes(rel))
    blob[0] ^= 1
    s3.fs.pipe_file(f"{s3.root}/{rel}", bytes(blob))
    res = runner.invoke(cli, ["checkpoints", "verify", s3_server.uri(), *opts, "-o", "json"])
    assert res.exit_code == 1
    report = json.loads(res.output)
    assert report["stores"][s3_server.uri()][0] == {
        "step": 2,
        "status": "CORRUPT",
        "bad": {"gen-0000/__0_0.distcp": "digest mismatch"},
    }
    # store a: its newest committed step (1) verifies, the uncommitted step 2 is not a failure
    assert runner.invoke(cli, ["checkpoints", "verify", a]).exit_code == 0

    res = runner.invoke(cli, ["checkpoints", "inspect", s3_server.uri(), *opts, "--step", "1", "-o", "json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["manifest"]["step"] == 1
    assert {"key": "model.w", "kind": "tensor", "dtype": "float32", "shape": [256, 256], "chunks": 1} in info["state"]

    res = runner.invoke(cli, ["checkpoints", "list", "ftp://nope"])
    assert res.exit_code == 2 and "unsupported scheme" in res.output
    res = runner.invoke(cli, ["checkpoints", "list", a, "--option", "novalue"])
    assert res.exit_code == 2 and "key=value" in res.output


def _launch(tmp_path: Path, generation: int) -> WorkerIdentity:
    """Rank 0 of job `job` whose rendezvous id is the job name (as on Kubernetes)."""
    return ckpt_identity(tmp_path / "run", generation=generation, run_id="job")


def test_resubmitted_job_commits_to_every_store_and_a_stale_writer_to_none(tmp_path: Path, s3_server: S3Server) -> None:
    cfg = _cfg(tmp_path, s3_server, local=1)

    def launch_and_save(generation: int, first_step: int) -> CheckpointManager:
        sink = Recorder()
        mgr = CheckpointManager(cfg, _launch(tmp_path, generation), sink)
        result = mgr.restore(_state(-1))
        assert (result.step if result else 0) == first_step - 1
        for step in (first_step, first_step + 1):
            mgr.save(step, _state(step))
            mgr.wait()
        assert [r.stores_ok for r in sink.checkpoints if r.committed] == [["a", "s3"]] * 2
        return mgr

    for generation, first_step in ((0, 1), (1, 3), (2, 5)):
        launch_and_save(generation, first_step).close()
    stale = launch_and_save(0, 7)  # resubmitted under the same name: restart count 0 again
    s3 = open_storage(s3_server.uri(), s3_server.options)
    assert [c.step for c in list_checkpoints(s3) if c.committed] == [8, 7, 6]  # keep: 3
    assert Fence.numbers(s3) == [0, 1, 2, 3]
    newer = CheckpointManager(cfg, _launch(tmp_path, 1))
    assert newer.restore(_state(-1)) is not None
    stale.save(9, _state(9))
    stale.close()
    assert not stale.history[-1].committed
    assert all(e.startswith("fenced: a newer writer") for e in stale.history[-1].stores_failed.values())
    newer.save(9, _state(9))
    newer.close()
    assert newer.history[-1].stores_ok == ["a", "s3"]
    assert read_manifest(s3, 9).generation == 4


def test_two_writers_racing_on_s3_get_distinct_generations(tmp_path: Path, s3_server: S3Server) -> None:
    s3 = open_storage(s3_server.uri(), s3_server.options)
    assert s3.atomic_create
    first, second = Fence(_launch(tmp_path, 0)), Fence(_launch(tmp_path, 0))
    assert first._take(s3, 0)
    assert not second._take(s3, 0)  # If-None-Match: * refused the second create of the same object
    holder = Fence(_launch(tmp_path, 0)).record(s3, 0)
    assert holder is not None and holder.writer == first.writer
    assert second.acquire([s3]) == 1


def test_restore_from_s3_never_writes_outside_its_download_directory(tmp_path: Path, s3_server: S3Server) -> None:
    cfg = CheckpointConfig.model_validate(
        {"every": {"steps": 1}, "stores": [{"uri": s3_server.uri(), "name": "s3", "options": s3_server.options}]}
    )
    mgr = CheckpointManager(cfg, _ctx(tmp_path, 0))
    mgr.save(1, _state(1))
    mgr.close()
    s3: Any = open_storage(s3_server.uri(), s3_server.options)
    manifest = json.loads(s3.read_bytes(f"{step_dir(1)}/manifest.json"))
    bad = "gen-0000/../../../escaped"
    shard = next(f for f in manifest["files"] if f["path"].endswith(".distcp"))
    s3.fs.pipe_file(f"{s3.root}/{step_dir(2)}/{bad}", s3.read_bytes(f"{step_dir(1)}/{shard['path']}"))
    s3.fs.pipe_file(f"{s3.root}/{step_dir(2)}/gen-0000/.metadata", s3.read_bytes(f"{step_dir(1)}/gen-0000/.metadata"))
    manifest["step"], shard["path"] = 2, bad
    s3.fs.pipe_file(f"{s3.root}/{step_dir(2)}/manifest.json", json.dumps(manifest).encode())
    restorer = CheckpointManager(cfg, _ctx(tmp_path, 1))
    escaped = os.path.normpath(os.path.join(restorer.node_dir, "restore", step_dir(2), bad))
    target = _state(-1)
    result = restorer.restore(target)
    assert result is not None and result.step == 1 and target["step"] == 1
    assert not os.path.exists(escaped), escaped


def test_a_large_shard_goes_up_as_a_multipart_upload_and_restores_verified(tmp_path: Path, s3_server: S3Server) -> None:
    cfg = _cfg(tmp_path, s3_server, local=0)  # S3 only: the shards are staged on the node to upload from
    weights = torch.arange(3 * 2**20, dtype=torch.float32)  # 12 MiB: parts of 5 MiB, uploaded at once
    mgr = CheckpointManager(cfg, _ctx(tmp_path, 0))
    mgr.save(7, {"model": {"w": weights}, "step": 7})
    mgr.close()
    s3: Any = open_storage(s3_server.uri(), s3_server.options)
    manifest = read_manifest(s3, 7)
    shard = next(e for e in manifest.files if e.path.endswith(".distcp"))
    etag = s3.fs.info(f"{s3.root}/{step_dir(7)}/{shard.path}")["ETag"].strip('"')
    assert etag.endswith("-3"), etag  # S3 names a multipart object's ETag after its part count
    assert not (Path(mgr.node_dir) / step_dir(7)).exists()  # the staging copy is gone after the commit
    target = {"model": {"w": torch.zeros(3 * 2**20)}, "step": 0}
    result = CheckpointManager(cfg, _ctx(tmp_path, 1)).restore(target)
    assert result is not None and (result.step, result.store) == (7, "s3")
    assert torch.equal(target["model"]["w"], weights) and target["step"] == 7


def test_an_s3_store_down_at_restart_stops_the_rank_instead_of_starting_over(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """The only store is S3 and it is down when the job restarts (connection refused): before, the
    failed listing was skipped and the job started over from step 0 over its own checkpoints. Now the
    restore lists it again for half of `checkpoint.ioTimeoutSeconds`, then stops retryably, naming it."""
    import time

    from training.checkpoint.results import CheckpointStoreUnavailableError

    stores = [{"uri": s3_server.uri(), "name": "s3", "options": s3_server.options}]
    cfg = CheckpointConfig.model_validate({"every": {"steps": 1}, "stores": stores, "ioTimeoutSeconds": 4})
    mgr = CheckpointManager(cfg, _ctx(tmp_path, 0))
    for step in (1, 2):
        mgr.save(step, _state(step))
        mgr.wait()
    mgr.close()
    s3_server.stop()
    restorer = CheckpointManager(cfg, _ctx(tmp_path, 1))
    start = time.monotonic()
    with pytest.raises(CheckpointStoreUnavailableError, match=r"store s3 \(list: .*refusing to start over"):
        restorer.restore(_state(-1))
    took = time.monotonic() - start
    assert took < 60, f"the restore gave up after {took:.1f} s"
