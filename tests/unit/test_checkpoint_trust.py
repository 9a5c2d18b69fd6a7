"""A store's content is data, never code or a path elsewhere (issue 13, points 3 and 4): DCP metadata is
unpickled with an allow-list, manifests can be HMAC-signed, and manifest paths cannot leave the store
(crafted `..`, absolute, backslash, empty segments, symlinks) for restore, verify and inspect."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from blake3 import blake3
from click.testing import CliRunner

from orchestrator.cli import cli
from tests.fixtures.checkpoint import assert_same, config, ctx, make_state, save_steps
from training.checkpoint import (
    CheckpointManager,
    ManifestLayoutError,
    UnsafePathError,
    list_checkpoints,
    open_storage,
    parse_manifest,
)
from training.checkpoint.dcp_metadata import UnsafeMetadataError, load_metadata
from training.checkpoint.manifest import DCP_METADATA, MANIFEST_NAME, step_dir
from training.checkpoint.results import CheckpointKeyError
from training.checkpoint.storage import check_relative, safe_join
from training.contract import Env

pytestmark = pytest.mark.timeout(120)

KEY = "0123456789abcdef0123456789abcdef"


class _Reducer:
    """Pickles as a call of `func(*args)`: what a hostile `.metadata` would contain."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def _one_checkpoint(tmp_path: Path, steps: tuple[int, ...] = (1,)) -> tuple[str, dict[int, dict[str, Any]]]:
    store = str(tmp_path / "store")
    mgr = CheckpointManager(config(store, keep=10), ctx(tmp_path))
    states = save_steps(mgr, list(steps))
    mgr.close()
    return store, states


def _manifest_raw(store: str, step: int) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads((Path(store) / step_dir(step) / MANIFEST_NAME).read_text())
    return raw


# -- point 3: DCP metadata without code execution ------------------------------------------------------
def test_real_metadata_of_every_kind_of_value_loads() -> None:
    import tempfile
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.metadata import Metadata

    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.complex64]
    state = {
        "t": {str(d): torch.zeros(2, 3, dtype=d) for d in dtypes},
        "optim": {"param_groups": [{"lr": 0.1, "params": ["w"]}], "state": {"w": {"step": torch.tensor(3.0)}}},
        "step": 5,
        "name": "x",
        "nested": {"a": [1, 2.5, None]},
    }
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(d), no_dist=True)
        metadata = load_metadata(Path(d, DCP_METADATA).read_bytes())
    assert isinstance(metadata, Metadata)
    assert {"t.torch.bfloat16", "step", "optim.param_groups.0.lr"} <= set(metadata.state_dict_metadata)


def test_metadata_pickled_by_python_3_11_2_loads_its_enum_members_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Debian bookworm's Python 3.11.2 (the images' base) pickles an enum member as `getattr(Enum, "NAME")`:
    a checkpoint saved in the container must restore (found by tests/containers: the drained pod's
    successor refused every checkpoint). Only an allowed enum's member resolves that way."""
    import warnings
    from pathlib import PosixPath

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    monkeypatch.setattr(_MEM_FORMAT_ENCODING, "__reduce_ex__", lambda self, proto: (getattr, (type(self), self.name)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True)
    raw = Path(tmp_path, DCP_METADATA).read_bytes()
    assert b"getattr" in raw
    props = load_metadata(raw).state_dict_metadata["w"].properties
    assert props.memory_format == torch.contiguous_format
    for payload in (_Reducer(getattr, PosixPath, "touch"), _Reducer(getattr, _MEM_FORMAT_ENCODING, "__class__")):
        with pytest.raises(UnsafeMetadataError, match="refused getattr"):
            load_metadata(pickle.dumps(payload))


@pytest.mark.parametrize(
    "payload",
    [
        lambda marker: _Reducer(os.system, f"touch {marker}"),
        lambda marker: _Reducer(exec, f"open({str(marker)!r}, 'w').close()"),
        lambda marker: _Reducer(Path.touch, Path(marker)),
        lambda marker: [_Reducer(os.system, f"touch {marker}")],  # nested below a harmless container
    ],
    ids=["os.system", "exec", "pathlib-method", "nested"],
)
def test_a_crafted_metadata_pickle_is_refused_and_runs_nothing(tmp_path: Path, payload: Any) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafeMetadataError, match="refused"):
        load_metadata(pickle.dumps(payload(marker)))
    assert not marker.exists()
    with pytest.raises(UnsafeMetadataError, match="not DCP metadata"):
        load_metadata(pickle.dumps({"a": 1}))


def test_inspect_of_a_hostile_store_runs_no_code(tmp_path: Path) -> None:
    store, _ = _one_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    metadata = Path(store) / step_dir(1) / "gen-0000" / DCP_METADATA
    metadata.write_bytes(pickle.dumps(_Reducer(os.system, f"touch {marker}")))
    res = CliRunner().invoke(cli, ["checkpoints", "inspect", store])
    assert res.exit_code != 0 and "refused to load posix.system" in res.output, res.output
    assert not marker.exists()


def _forge(store: str, step: int, rel: str, data: bytes) -> None:
    """Replace a file of a checkpoint and fix its manifest entry, as whoever can write the store can."""
    (Path(store) / step_dir(step) / rel).write_bytes(data)
    raw = _manifest_raw(store, step)
    for entry in raw["files"]:
        if entry["path"] == rel:
            entry["digest"], entry["size"] = blake3(data).hexdigest(), len(data)
    (Path(store) / step_dir(step) / MANIFEST_NAME).write_text(json.dumps(raw))


def test_a_restore_from_a_hostile_store_runs_no_code(tmp_path: Path) -> None:
    """Without a signing key a store writer can forge a checkpoint whose digests match; the restore still
    unpickles nothing but DCP's metadata classes and plain data, so the payload never runs and the forged
    step is skipped for the older authentic one."""
    store, states = _one_checkpoint(tmp_path, (1, 2))
    marker = tmp_path / "pwned"
    _forge(store, 2, f"gen-0000/{DCP_METADATA}", pickle.dumps(_Reducer(os.system, f"touch {marker}")))
    target = make_state(0)
    result = CheckpointManager(config(store), ctx(tmp_path, 1)).restore(target)
    assert not marker.exists(), "the hostile metadata ran"
    assert result is not None and result.step == 1
    assert_same(target, states[1])


# -- point 3: signed manifests -------------------------------------------------------------------------
def test_signed_manifests_restore_and_tampered_ones_never_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(Env.CHECKPOINT_KEY, KEY)
    store, states = _one_checkpoint(tmp_path, (1, 2, 3))
    assert _manifest_raw(store, 3)["signature"].startswith("hmac-sha256:")
    raw = _manifest_raw(store, 3)
    raw["files"][0]["digest"] = "0" * 64  # e.g. pointing the manifest at substituted files
    (Path(store) / step_dir(3) / MANIFEST_NAME).write_text(json.dumps(raw))
    raw = _manifest_raw(store, 2)
    del raw["signature"]
    (Path(store) / step_dir(2) / MANIFEST_NAME).write_text(json.dumps(raw))
    target = make_state(0)
    result = CheckpointManager(config(store), ctx(tmp_path, 1)).restore(target)
    assert result is not None and result.step == 1
    assert_same(target, states[1])
    runner = CliRunner()
    res = runner.invoke(cli, ["checkpoints", "verify", store, "-o", "json"])
    assert res.exit_code == 1
    rows = {r["step"]: r for r in json.loads(res.output)["stores"][store]}
    assert rows[3]["status"] == rows[2]["status"] == "UNTRUSTED" and rows[1]["status"] == "ok"
    assert "does not match" in rows[3]["error"] and "unsigned" in rows[2]["error"]
    res = runner.invoke(cli, ["checkpoints", "verify", store])
    assert res.exit_code == 1 and "step 3 does not verify (manifest signature does not match" in res.output
    # A wrong key trusts nothing, and the job stops (permanently: a setting to fix) instead of starting
    # over from step 0 behind its own checkpoints; they stay as they are. No key checks no signature.
    monkeypatch.setenv(Env.CHECKPOINT_KEY, "f" * 32)
    before = sorted(p.name for p in Path(store).iterdir())
    with pytest.raises(
        CheckpointKeyError,
        match=r"\(s0: steps 1-3 \(3\)\) fail their signature check with this TORCHRIG_CHECKPOINT_KEY",
    ):
        CheckpointManager(config(store), ctx(tmp_path, 2)).restore(make_state(0))
    assert sorted(p.name for p in Path(store).iterdir()) == before
    # resume: never starts fresh on purpose, whatever the store holds
    assert CheckpointManager(config(store, resume="never"), ctx(tmp_path, 3)).restore(make_state(0)) is None
    monkeypatch.delenv(Env.CHECKPOINT_KEY)
    assert runner.invoke(cli, ["checkpoints", "verify", store, "--step", "2"]).exit_code == 0


def test_a_short_key_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(Env.CHECKPOINT_KEY, "short")
    with pytest.raises(ValueError, match="shorter than 16 bytes"):
        CheckpointManager(config(str(tmp_path / "s")), ctx(tmp_path))
    res = CliRunner().invoke(cli, ["checkpoints", "verify", str(tmp_path / "s")])
    assert res.exit_code == 2 and "shorter than 16 bytes" in res.output


# -- point 4: paths that would leave the store ---------------------------------------------------------
BAD_PATHS = [
    "gen-0000/../../x",
    "gen-0000/../../../../../../escaped",
    "/etc/passwd",
    "gen-0000\\..\\..\\x",
    "gen-0000//__0_0.distcp",
    "gen-0000/./__0_0.distcp",
    "gen-0000/__0_0.distcp/..",
    "gen-0001/__0_0.distcp",  # another generation's directory
    "gen-0000/__1_0.distcp",  # another rank's file
    "gen-0000/notes.txt",
    "",
]


@pytest.mark.parametrize("bad", BAD_PATHS)
def test_manifest_paths_outside_the_writers_layout_are_refused(tmp_path: Path, bad: str) -> None:
    store, _ = _one_checkpoint(tmp_path)
    raw = _manifest_raw(store, 1)
    parse_manifest(json.dumps(raw), step=1)  # the writer's own manifest passes
    raw["files"][-1]["path"] = bad
    with pytest.raises(ManifestLayoutError):
        parse_manifest(json.dumps(raw), step=1)


@pytest.mark.parametrize("extra", [["ddp_buckets", [0]], "x", 3, None])
def test_a_manifest_extra_that_is_not_an_object_is_refused(tmp_path: Path, extra: Any) -> None:
    store, _ = _one_checkpoint(tmp_path)
    raw = _manifest_raw(store, 1)
    assert isinstance(parse_manifest(json.dumps(raw), step=1).extra, dict)
    raw["extra"] = extra
    with pytest.raises(ManifestLayoutError):
        parse_manifest(json.dumps(raw), step=1)


@pytest.mark.parametrize("rel", ["../x", "a/../../x", "/abs", "a//b", "a/./b", "a\\b", "a/", "nul\x00"])
def test_store_paths_cannot_leave_the_root(tmp_path: Path, rel: str) -> None:
    with pytest.raises(UnsafePathError):
        check_relative(rel)
    store = open_storage(str(tmp_path / "s"))
    with pytest.raises(UnsafePathError):
        store.read_bytes(rel)
    with pytest.raises(UnsafePathError):
        safe_join(str(tmp_path / "s"), rel)


def _escape(base: str, bad: str) -> Path:
    return Path(os.path.normpath(os.path.join(base, bad)))


def test_restore_from_an_object_store_never_writes_outside_its_directory(tmp_path: Path) -> None:
    uri = f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    mgr = CheckpointManager(config(uri), ctx(tmp_path))
    states = save_steps(mgr, [1])
    mgr.close()
    store: Any = open_storage(uri)
    manifest = json.loads(store.read_bytes(f"{step_dir(1)}/{MANIFEST_NAME}"))
    # step 2: a copy of step 1 whose shard is named so that the download lands outside its directory
    bad = "gen-0000/../../../escaped"
    manifest["step"] = 2
    shard = next(f for f in manifest["files"] if f["path"].endswith(".distcp"))
    store.fs.pipe_file(f"{store.root}/{step_dir(2)}/{bad}", store.read_bytes(f"{step_dir(1)}/{shard['path']}"))
    metadata = f"gen-0000/{DCP_METADATA}"
    store.fs.pipe_file(f"{store.root}/{step_dir(2)}/{metadata}", store.read_bytes(f"{step_dir(1)}/{metadata}"))
    shard["path"] = bad
    store.fs.pipe_file(f"{store.root}/{step_dir(2)}/{MANIFEST_NAME}", json.dumps(manifest).encode())
    listing = list_checkpoints(store)
    assert not listing[0].committed and "outside the layout" in str(listing[0].error)
    restorer = CheckpointManager(config(uri), ctx(tmp_path, 1))
    download_dir = os.path.join(restorer.node_dir, "restore", step_dir(2))
    target = make_state(0)
    result = restorer.restore(target)
    assert result is not None and result.step == 1
    assert_same(target, states[1])
    assert not _escape(download_dir, bad).exists(), _escape(download_dir, bad)


def test_verify_never_reads_outside_a_file_store(tmp_path: Path) -> None:
    store, _ = _one_checkpoint(tmp_path, (1, 2))
    outside = tmp_path / "outside"
    outside.mkdir()
    # step 2's manifest names a file outside the store, with the right size and hash
    shard = Path(store) / step_dir(2) / "gen-0000" / "__0_0.distcp"
    shutil.copy(shard, outside / "secret")
    raw = _manifest_raw(store, 2)
    entry = next(f for f in raw["files"] if f["path"].endswith(".distcp"))
    entry["path"] = "gen-0000/../../../outside/secret"
    (Path(store) / step_dir(2) / MANIFEST_NAME).write_text(json.dumps(raw))
    res = CliRunner().invoke(cli, ["checkpoints", "verify", store, "--step", "2", "-o", "json"])
    assert res.exit_code == 1
    (row,) = json.loads(res.output)["stores"][store]
    assert row["status"] == "bad manifest" and "outside the layout" in row["error"]


def test_symlinks_out_of_a_file_store_are_refused(tmp_path: Path) -> None:
    store, states = _one_checkpoint(tmp_path, (1, 2, 3))
    outside = tmp_path / "outside"
    outside.mkdir()
    # step 2: its shard moved out and linked back (same bytes); step 3: the whole directory linked in
    shard = Path(store) / step_dir(2) / "gen-0000" / "__0_0.distcp"
    shutil.move(shard, outside / "shard")
    shard.symlink_to(outside / "shard")
    shutil.move(Path(store) / step_dir(3), outside / step_dir(3))
    (Path(store) / step_dir(3)).symlink_to(outside / step_dir(3))
    res = CliRunner().invoke(cli, ["checkpoints", "verify", store, "-o", "json"])
    assert res.exit_code == 1
    rows = {r["step"]: r for r in json.loads(res.output)["stores"][store]}
    assert rows[3]["status"] == "bad manifest" and "outside" in rows[3]["error"]
    assert rows[2]["status"] == "CORRUPT" and "refused" in rows[2]["bad"]["gen-0000/__0_0.distcp"]
    assert rows[1]["status"] == "ok"
    target = make_state(0)
    result = CheckpointManager(config(store), ctx(tmp_path, 1)).restore(target)
    assert result is not None and result.step == 1
    assert_same(target, states[1])
