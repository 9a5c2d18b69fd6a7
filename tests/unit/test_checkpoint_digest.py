"""Digests over parts (manifest version 3), their hash (version 4: BLAKE3) and the one-copy load: what a
restore verifies and loads.

Files above one digest part (4 MiB) are what the other checkpoint tests never write: here a ~9 MB state
goes through a file store (mapped, parts faulted in and hashed on threads) and an object store (ranged
reads), a byte flipped in a middle part is caught, and manifests written before version 4 (SHA-256 parts)
and before version 3 (whole-file SHA-256) still restore."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import time
import uuid
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from blake3 import blake3
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.cli import cli
from tests.fixtures.checkpoint import Progress, Recorder, config, ctx
from training.checkpoint import CheckpointManager, open_storage
from training.checkpoint.digest import (
    DIGEST_ALGORITHM,
    DIGEST_ALGORITHMS,
    DIGEST_PART_BYTES,
    digest_of,
    new_hash,
    root_of,
    valid_part_bytes,
)
from training.checkpoint.manifest import MANIFEST_NAME, MANIFEST_VERSION, read_manifest, step_dir, verify_store
from training.checkpoint.reader import _tensor_in
from training.checkpoint.results import CheckpointCorruptError
from training.checkpoint.storage import file_digest

pytestmark = pytest.mark.timeout(120)

SIDE = 1500  # a 1500 x 1500 float32 tensor: 9 MB, three digest parts


_PLAIN = {"sha256": hashlib.sha256, "blake3": blake3}  # the hashes themselves, not digest.py's


def _reference(data: bytes, part: int, algorithm: str = "sha256") -> str:
    """The digest as digest.py defines it, written out plainly."""
    h = _PLAIN[algorithm]
    if part == 0 or len(data) <= part:
        return str(h(data).hexdigest())
    leaves = b"".join(h(data[o : o + part]).digest() for o in range(0, len(data), part))
    return str(h(leaves).hexdigest())


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(max_size=300),
    part=st.sampled_from([0, 1, 7, 16, 64]),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=6),
    algorithm=st.sampled_from(DIGEST_ALGORITHMS),
)
def test_part_digest_of_any_chunking_matches_the_definition(
    data: bytes, part: int, cuts: list[int], algorithm: str
) -> None:
    bounds = sorted({0, len(data), *[c for c in cuts if c <= len(data)]})
    chunks = [data[a:b] for a, b in itertools.pairwise(bounds)]
    assert digest_of(chunks, part, algorithm) == (_reference(data, part, algorithm), len(data))


def test_a_file_of_one_part_has_its_plain_hash() -> None:
    for algorithm, plain in _PLAIN.items():
        for data in (b"", b"x", bytes(64)):
            assert digest_of([data], 64, algorithm)[0] == plain(data).hexdigest()
        two = bytes(range(65))
        assert digest_of([two], 64, algorithm)[0] != plain(two).hexdigest()
        assert root_of([b"\x01" * 32], algorithm) == "01" * 32
    # BLAKE3's published test vector (the empty input): the binding computes BLAKE3 itself
    assert digest_of([b""], 0, "blake3")[0] == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    with pytest.raises(ValueError, match="unknown digest algorithm 'md5'"):
        new_hash("md5")


def test_valid_part_sizes() -> None:
    assert valid_part_bytes(0) and valid_part_bytes(DIGEST_PART_BYTES) and valid_part_bytes(64 * 1024)
    for bad in (-1, 1, 1000, 3 * 2**20, 2**31, True, "4194304", None, 4.0):
        assert not valid_part_bytes(bad), bad


def _big_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {
        "model": {"w": torch.randn(SIDE, SIDE), "t": torch.randn(40, 30).t(), "h": torch.randn(33).bfloat16()},
        "progress": Progress(seed),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in ("w", "t", "h"):
        assert a["model"][k].dtype == b["model"][k].dtype and torch.equal(a["model"][k], b["model"][k]), k
    assert a["progress"].step == b["progress"].step


def _save(uris: list[str], tmp_path: Path) -> dict[str, Any]:
    mgr = CheckpointManager(config(*uris), ctx(tmp_path))
    state = _big_state(1)
    mgr.save(1, state)
    mgr.wait()
    mgr.close()
    return state


def test_a_multi_part_checkpoint_is_verified_and_loaded_exactly_from_file_and_object_stores(tmp_path: Path) -> None:
    file_uri, mem_uri = str(tmp_path / "a"), f"memory://digest-{uuid.uuid4().hex[:8]}"
    saved = _save([file_uri, mem_uri], tmp_path)
    manifest = read_manifest(open_storage(file_uri), 1)
    assert manifest.version == MANIFEST_VERSION == 4 and manifest.digest_part_bytes == DIGEST_PART_BYTES
    assert manifest.digest_algorithm == DIGEST_ALGORITHM == "blake3"
    shard = next(e for e in manifest.files if e.path.endswith(".distcp"))
    path = Path(file_uri) / step_dir(1) / shard.path
    assert shard.size > 2 * DIGEST_PART_BYTES  # several parts: the tree digest, not the plain sha256
    data = path.read_bytes()
    assert shard.digest == _reference(data, DIGEST_PART_BYTES, "blake3") != blake3(data).hexdigest()
    assert file_digest(str(path), DIGEST_PART_BYTES, "blake3") == (shard.digest, shard.size)
    assert verify_store(open_storage(file_uri), manifest).ok and verify_store(open_storage(mem_uri), manifest).ok
    shown = CliRunner().invoke(cli, ["checkpoints", "inspect", file_uri])
    assert shown.exit_code == 0 and "manifest version 4; digest: blake3 of 4.0 MiB parts" in shown.output
    assert CliRunner().invoke(cli, ["checkpoints", "verify", file_uri]).exit_code == 0
    for uris, store in (([file_uri, mem_uri], "s0"), ([mem_uri], "s0")):
        target = _big_state(7)
        result = CheckpointManager(config(*uris), ctx(tmp_path, 1)).restore(target)
        assert result is not None and (result.step, result.store) == (1, store)
        _same(target, saved)
        assert not target["model"]["t"].is_contiguous()  # loaded into the state's own (strided) tensor


def test_a_flipped_byte_in_a_middle_part_is_caught_and_the_other_copy_loads(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    saved = _save([a, b], tmp_path)
    manifest = read_manifest(open_storage(a), 1)
    shard = next(e for e in manifest.files if e.path.endswith(".distcp"))
    path = Path(a) / step_dir(1) / shard.path
    data = bytearray(path.read_bytes())
    data[DIGEST_PART_BYTES + 12345] ^= 0x10  # inside the second part, in the tensor's bytes
    path.write_bytes(bytes(data))
    report = verify_store(open_storage(a), manifest)
    assert not report.ok and report.bad == {shard.path: "digest mismatch"}
    sink = Recorder()
    target = _big_state(7)
    before = target["model"]["w"].clone()
    result = CheckpointManager(config(a), ctx(tmp_path, 1), sink)
    with pytest.raises(CheckpointCorruptError, match="every copy is corrupt or incomplete"):
        result.restore(target)
    assert torch.equal(target["model"]["w"], before)  # the corrupt copy never reached the state
    assert any(e == "checkpoint_corrupt" and "digest mismatch" in f["detail"] for e, f in sink.events)
    got = CheckpointManager(config(a, b), ctx(tmp_path, 2)).restore(target)
    assert got is not None and got.store == "s1"
    _same(target, saved)


@pytest.mark.parametrize("version", [2, 3])
def test_a_manifest_written_before_blake3_still_restores(tmp_path: Path, version: int) -> None:
    """Manifests as the earlier releases wrote them stay readable, from both read paths: version 3 (SHA-256
    of 4 MiB parts, each file's `sha256`) and version 2 (no digest_part_bytes: the whole file's SHA-256)."""
    file_uri, mem_uri = str(tmp_path / "a"), f"memory://digest-{uuid.uuid4().hex[:8]}"
    saved = _save([file_uri, mem_uri], tmp_path)
    part = DIGEST_PART_BYTES if version == 3 else 0
    for uri in (file_uri, mem_uri):
        store: Any = open_storage(uri)
        raw = json.loads(store.read_bytes(f"{step_dir(1)}/{MANIFEST_NAME}"))
        raw["version"] = version
        del raw["digest_algorithm"]
        if version == 2:
            del raw["digest_part_bytes"]
        for entry in raw["files"]:
            del entry["digest"]
            entry["sha256"] = _reference(store.read_bytes(f"{step_dir(1)}/{entry['path']}"), part)
        store.write_bytes_atomic(f"{step_dir(1)}/{MANIFEST_NAME}", json.dumps(raw).encode())
        old = read_manifest(store, 1)
        assert (old.digest_part_bytes, old.digest_algorithm) == (part, "sha256") and verify_store(store, old).ok
        target = _big_state(7)
        result = CheckpointManager(config(uri), ctx(tmp_path, 1)).restore(target)
        assert result is not None and result.step == 1
        _same(target, saved)


_ODD_PART = "digest_part_bytes must be 0 or a power of two"
_UNKNOWN_HASH = "digest_algorithm must be one of sha256, blake3"


@pytest.mark.parametrize(
    ("field", "bad", "error"),
    [("digest_part_bytes", v, _ODD_PART) for v in (3 * 2**20, 1, -4, "4194304")]
    + [("digest_algorithm", v, _UNKNOWN_HASH) for v in ("md5", "BLAKE3", "", None, 3)],
)
def test_a_manifest_with_an_odd_part_size_or_an_unknown_hash_is_rejected(
    tmp_path: Path, field: str, bad: Any, error: str
) -> None:
    a = str(tmp_path / "a")
    _save([a], tmp_path)
    store = open_storage(a)
    raw = json.loads(store.read_bytes(f"{step_dir(1)}/{MANIFEST_NAME}"))
    raw[field] = bad
    store.write_bytes_atomic(f"{step_dir(1)}/{MANIFEST_NAME}", json.dumps(raw).encode())
    with pytest.raises(ValueError, match=error):
        read_manifest(store, 1)


def _saved_item(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_tensor_items_are_viewed_in_place_with_their_strides_and_dtype() -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    for t in (base, base.t(), base[1:3, 2:5], base.to(torch.bfloat16), torch.empty(0, 3)):
        item = memoryview(_saved_item(t))
        got = _tensor_in(item)
        assert got is not None and got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    assert _tensor_in(memoryview(_saved_item({"not": "a tensor"}))) is None  # type: ignore[arg-type]


def _with_byte_order(item: bytes, order: bytes) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(item))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, order if info.filename.endswith("/byteorder") else src.read(info))
    return out.getvalue()


def test_an_item_in_another_byte_order_is_left_to_dcp() -> None:
    """(torch.load to "meta" of an archive in the other byte order crashes the process: never reached.)"""
    item = _saved_item(torch.arange(6, dtype=torch.int32))
    assert _tensor_in(memoryview(item)) is not None
    assert _tensor_in(memoryview(_with_byte_order(item, b"big"))) is None
    assert _tensor_in(memoryview(_with_byte_order(item, b"x" * 4096))) is None  # not read: not torch's


def test_the_shards_a_rank_wrote_are_read_while_dcp_plans_and_an_unneeded_bad_one_is_never_checked(
    tmp_path: Path,
) -> None:
    """`prefetch`: the rank's own files are queued with the metadata's, before DCP's planning asks for
    them; only files the plan needs are checked, so a prefetched file it never asks for cannot fail it."""
    from torch.distributed.checkpoint import load as dcp_load

    from training.checkpoint.reader import VerifiedReader
    from training.checkpoint.restore import SafeLoadPlanner

    mem_uri = f"memory://digest-{uuid.uuid4().hex[:8]}"
    saved = _save([mem_uri], tmp_path)
    store = open_storage(mem_uri)
    manifest = read_manifest(store, 1)
    shard = next(e for e in manifest.files if e.path.endswith(".distcp"))
    stray = f"{manifest.dcp_dir}/__9_0.distcp"  # in the manifest, not in DCP's plan, and corrupt
    store.write_bytes_atomic(f"{step_dir(1)}/{stray}", b"not what the manifest says")
    expected = {e.path: (e.digest, e.size) for e in manifest.files}
    expected[stray] = (blake3(b"something else").hexdigest(), 26)
    reads: list[str] = []

    def read_range(rel: str, start: int, end: int) -> bytes:
        reads.append(rel)
        return store.read_range(f"{step_dir(1)}/{rel}", start, end)

    reader = VerifiedReader(
        read_range,
        manifest.dcp_dir,
        expected,
        digest_part_bytes=DIGEST_PART_BYTES,
        digest_algorithm=manifest.digest_algorithm,
        prefetch=[shard.path, stray],
    )
    try:
        reader.read_metadata()
        # Queued with the metadata: their reads start on the pool's threads without DCP asking (on a
        # loaded machine a moment after the metadata's own parts, hence the wait; CI saw it once).
        deadline = time.monotonic() + 10
        while not (shard.path in reads and stray in reads) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shard.path in reads and stray in reads, "the prefetch did not start with the metadata"
        target = _big_state(7)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming ... a single process" (it is one)
            dcp_load(target, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    finally:
        reader.close()
    _same(target, saved)
    assert reads.count(shard.path) == -(-shard.size // (16 * 1024 * 1024)), "a part was read twice"
