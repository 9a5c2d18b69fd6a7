"""A store that cannot be read at restart is unknown, not empty (issue 33, point 2).

Before: `find_candidates` caught every listing error and skipped the store, so a listing that raised
(an S3 timeout at the moment of a restart), or a file store whose path was no longer a directory, left
no candidate and the job started over from step 0 (or took `initFrom`) on top of its own checkpoints.
Likewise one manifest whose signature held a non-ASCII character made `hmac.compare_digest` raise
TypeError out of the listing: restore found nothing and `checkpoints list`/`verify` failed whole.
Now an unlisted store is retried with backoff within `checkpoint.ioTimeoutSeconds`, then the rank stops
with a retryable error naming the store; a malformed signature is one UNTRUSTED step.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.cli import cli
from tests.fixtures.checkpoint import Recorder, assert_same, ckpt_identity, config, make_state, save_steps
from training.checkpoint import CheckpointManager, list_checkpoints, open_storage, parse_manifest
from training.checkpoint.manifest import MANIFEST_NAME, step_dir
from training.checkpoint.results import CheckpointStoreUnavailableError
from training.checkpoint.signing import SignatureError
from training.checkpoint.storage import FsspecStorage
from training.contract import Env, ExitCode

pytestmark = pytest.mark.timeout(120)

KEY = "0123456789abcdef0123456789abcdef"


def _saved(tmp_path: Path, steps: tuple[int, ...], name: str = "store") -> tuple[str, dict[int, dict[str, Any]]]:
    store = str(tmp_path / name)
    mgr = CheckpointManager(config(store, keep=10), ckpt_identity(tmp_path / "run"))
    states = save_steps(mgr, list(steps))
    mgr.close()
    return store, states


def _manager(tmp_path: Path, *stores: str, generation: int = 1, **kw: Any) -> CheckpointManager:
    kw.setdefault("ioTimeoutSeconds", 0.4)  # the listing is retried for half of it
    return CheckpointManager(config(*stores, **kw), ckpt_identity(tmp_path / "run", generation=generation))


def _failing_listing(monkeypatch: pytest.MonkeyPatch, root: str, failures: int | None = None) -> list[int]:
    """Make the listing of the store at `root` raise OSError (`failures` times; None: always)."""
    calls: list[int] = []
    original = FsspecStorage.list_dir

    def list_dir(self: FsspecStorage, rel: str) -> list[str]:
        if self.root == os.path.abspath(root) and rel == "":
            calls.append(1)
            if failures is None or len(calls) <= failures:
                raise OSError("Read timeout on endpoint URL\n" + "(details) " * 100)
        return original(self, rel)

    monkeypatch.setattr(FsspecStorage, "list_dir", list_dir)
    return calls


# -- (a) a store that cannot be listed -------------------------------------------------------------------
def test_a_listing_that_raises_stops_the_rank_retryably_instead_of_starting_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(Env.CHECKPOINT_KEY, KEY)
    store, _ = _saved(tmp_path, (1, 2))
    calls = _failing_listing(monkeypatch, store)
    mgr = _manager(tmp_path, store)
    sink = Recorder()
    mgr.sink = sink
    with pytest.raises(CheckpointStoreUnavailableError, match=r"s0 .*OSError: Read timeout") as info:
        mgr.restore(make_state(0))
    assert "refusing to start over from step 0" in str(info.value) and "resume: never" in str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 800, "one bounded line"
    assert len(calls) >= 2, "the listing was not retried"
    assert sink.failures and all(store_name == "s0" for store_name, _ in sink.failures)
    assert int(ExitCode.STORE_UNAVAILABLE) >= 128 and ExitCode.STORE_UNAVAILABLE.retryable
    # Starting over stays possible, on purpose only.
    assert _manager(tmp_path, store, resume="never", generation=2).restore(make_state(0)) is None


def test_an_unlisted_store_is_retried_until_it_answers_and_holds_up_no_store_that_has_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    mgr = CheckpointManager(config(a, b, keep=10), ckpt_identity(tmp_path / "run"))
    states = save_steps(mgr, [1, 2])
    mgr.close()
    # b holds the checkpoint: no wait for a.
    calls = _failing_listing(monkeypatch, a)
    mgr = _manager(tmp_path, a, b, ioTimeoutSeconds=60)
    before = len(calls)  # (rank 0 took its writer generation at construction: that lists the store too)
    target = make_state(0)
    result = mgr.restore(target)
    assert result is not None and (result.step, result.store) == (2, "s1") and len(calls) - before == 1
    assert_same(target, states[2])
    # a is the only store: listed again until it answers (the third listing here), then restored from.
    mgr = _manager(tmp_path, a, ioTimeoutSeconds=60, generation=2)
    monkeypatch.undo()
    calls = _failing_listing(monkeypatch, a, failures=2)
    target = make_state(0)
    result = mgr.restore(target)
    assert result is not None and (result.step, result.store) == (2, "s0") and len(calls) == 3
    assert_same(target, states[2])


def test_init_from_is_not_taken_while_the_jobs_store_is_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = _saved(tmp_path, (1, 2))
    other, _ = _saved(tmp_path, (5,), name="other")
    _failing_listing(monkeypatch, store)
    mgr = _manager(tmp_path, store, initFrom={"uri": other})
    with pytest.raises(CheckpointStoreUnavailableError):
        mgr.restore(make_state(0))


def test_a_file_store_whose_path_is_no_longer_a_directory_is_unknown(tmp_path: Path) -> None:
    """A volume not mounted back, a path replaced by a file: its listing said "empty" and the job started
    over. Only an absent root is a store that holds nothing yet."""
    store, _ = _saved(tmp_path, (1, 2))
    os.replace(store, store + ".aside")
    Path(store).write_text("not a directory")
    with pytest.raises(CheckpointStoreUnavailableError, match="s0"):
        _manager(tmp_path, store).restore(make_state(0))
    Path(store).unlink()
    assert _manager(tmp_path, store, generation=2).restore(make_state(0)) is None  # absent: fresh, on purpose


def test_a_file_under_a_step_name_is_a_bad_step_not_an_unknown_store(tmp_path: Path) -> None:
    """Only an I/O error leaves a manifest unknown: a file where a step directory should be is junk, and a
    job whose store holds nothing else starts fresh, saves and keeps its checkpoints beside it."""
    store = tmp_path / "store"
    store.mkdir()
    (store / step_dir(7)).write_text("junk")
    (row,) = list_checkpoints(open_storage(str(store)))
    assert not row.unreadable and not row.committed and "not a checkpoint" in str(row.error)
    mgr = _manager(tmp_path, str(store), keep=1)
    assert mgr.restore(make_state(0)) is None
    save_steps(mgr, [1, 2])
    mgr.close()
    assert sorted(p.name for p in store.iterdir()) == ["fences", step_dir(2), step_dir(7)]


def test_an_unreadable_manifest_makes_the_store_unknown_not_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing answers but every manifest read fails with an I/O error (a timeout): not a verdict on
    the manifests, so not "no checkpoint of this job" either."""
    store, _ = _saved(tmp_path, (1, 2))
    original = FsspecStorage.read_bytes

    def read_bytes(self: FsspecStorage, rel: str, max_bytes: int = 1 << 20) -> bytes:
        if rel.endswith(MANIFEST_NAME):
            raise TimeoutError("read timeout")
        return original(self, rel, max_bytes)

    monkeypatch.setattr(FsspecStorage, "read_bytes", read_bytes)
    listing = list_checkpoints(open_storage(store))
    assert [c.unreadable for c in listing] == [True, True]
    with pytest.raises(CheckpointStoreUnavailableError, match="s0"):
        _manager(tmp_path, store).restore(make_state(0))


# -- ranks agree: only rank 0 lists, every rank raises or restores the same -------------------------------
def _rank(rank: int, world: int, port: int, store: str, run: str, failing_rank: int, results: Any) -> None:
    tcp = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", tcp), rank=rank, world_size=world)  # type: ignore[attr-defined]
    try:
        if rank == failing_rank:
            _failing_listing(pytest.MonkeyPatch(), store)
        ident = ckpt_identity(run, generation=1, rank=rank, world_size=world)
        mgr = CheckpointManager(config(store, ioTimeoutSeconds=4), ident)
        try:
            result = mgr.restore(make_state(0))
            results.put((rank, "restored", result.step if result else None))
        except CheckpointStoreUnavailableError as exc:
            results.put((rank, "unavailable", str(exc)[:40]))
        mgr.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.serial  # four spawned torch processes within the module's 120 s timeout: the cores to itself
def test_ranks_never_split_over_a_store_one_of_them_cannot_list(tmp_path: Path) -> None:
    store, _ = _saved(tmp_path, (1, 2))
    # Rank 0 lists for everyone: its failure stops every rank alike; rank 1's listing is never consulted.
    assert _two_ranks(tmp_path, store, failing_rank=0) == {("unavailable", "job 'job': no checkpoint in the stores t")}
    assert _two_ranks(tmp_path, store, failing_rank=1) == {("restored", 2)}


def _two_ranks(tmp_path: Path, store: str, failing_rank: int) -> set[tuple[str, Any]]:
    """What two ranks' restores of `store` gave, when `failing_rank` cannot list it (one entry: they agree)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (2, server.port, store, str(tmp_path / "run"), failing_rank, results)
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {(kind, detail) for _, kind, detail in got}


# -- (b) a malformed signature is one UNTRUSTED step ------------------------------------------------------
MALFORMED = [
    "hmac-sha256:" + "é" * 64,
    "hmac-sha256:\udcff",
    "ü",
    5,
    1.5,
    True,
    [1, 2],
    {"a": "b"},
    "",
    "hmac-sha256:" + "0" * 2_000_000,
]


def _signed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[int, dict[str, Any]]]:
    monkeypatch.setenv(Env.CHECKPOINT_KEY, KEY)
    return _saved(tmp_path, (1, 2, 3))


def _set_signature(store: str, step: int, value: Any) -> None:
    path = Path(store) / step_dir(step) / MANIFEST_NAME
    raw = json.loads(path.read_text())
    raw["signature"] = value
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize("value", MALFORMED, ids=lambda v: type(v).__name__ + str(len(repr(v))))
def test_a_malformed_signature_is_one_untrusted_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: Any
) -> None:
    store, states = _signed(tmp_path, monkeypatch)
    _set_signature(store, 3, value)
    listing = {c.step: c for c in list_checkpoints(open_storage(store), key=KEY.encode())}
    assert listing[3].untrusted and listing[3].manifest is None, listing[3]
    assert listing[2].committed and listing[1].committed
    target = make_state(0)
    result = _manager(tmp_path, store).restore(target)
    assert result is not None and result.step == 2
    assert_same(target, states[2])


def test_list_and_verify_report_a_non_ascii_signature_per_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, _ = _signed(tmp_path, monkeypatch)
    _set_signature(store, 2, "hmac-sha256:" + "é" * 64)
    runner = CliRunner()
    done = runner.invoke(cli, ["checkpoints", "list", store, "-o", "json"])
    assert done.exit_code == 0, done.output
    rows = {r["step"]: r for r in json.loads(done.output)[store]}
    assert rows[3]["committed"] and rows[1]["committed"] and not rows[2]["committed"]
    assert "signature" in rows[2]["error"]
    done = runner.invoke(cli, ["checkpoints", "verify", store, "-o", "json"])
    assert done.exit_code == 0, done.output  # the newest committed step verifies
    rows = {r["step"]: r for r in json.loads(done.output)["stores"][store]}
    assert (rows[3]["status"], rows[2]["status"], rows[1]["status"]) == ("ok", "UNTRUSTED", "ok")
    done = runner.invoke(cli, ["checkpoints", "verify", store, "--step", "2"])
    assert done.exit_code == 1 and "step 2 is UNTRUSTED" in done.output and "Traceback" not in done.output


def test_preflight_survives_a_non_ascii_signature(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every manifest of the job forged with a malformed signature: the preflight's one line (the key
    does not verify them), not a TypeError traceback."""
    from training.config import load_worker_spec
    from training.preflight import PreflightError, check_checkpoint_key

    store, _ = _signed(tmp_path, monkeypatch)
    for step in (1, 2, 3):
        _set_signature(store, step, "hmac-sha256:" + "é" * 64)
    doc = {
        "apiVersion": "torchrig/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "job"},
        "spec": {
            "task": {"entrypoint": "training.examples.digits:task"},
            "training": {"steps": 1},
            "checkpoint": {"stores": [{"uri": store}]},
        },
    }
    (tmp_path / "job.yaml").write_text(json.dumps(doc))
    spec = load_worker_spec(tmp_path / "job.yaml")
    with pytest.raises(PreflightError, match="fail their signature check"):
        check_checkpoint_key(spec, str(tmp_path / "run"))


# -- property: nothing in a manifest raises out of the reader ---------------------------------------------
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_json)
def test_any_json_signature_is_a_signature_error_and_nothing_else(value: Any) -> None:
    body = {"step": 1, "files": [], "signature": value}
    with pytest.raises(SignatureError):
        parse_manifest(json.dumps(body), key=KEY.encode())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=512) | st.builds(lambda n: b"[" * n, st.integers(1, 200_000)))
def test_random_manifest_bytes_are_one_bad_step_never_an_exception(tmp_path_factory: Any, data: bytes) -> None:
    root = tmp_path_factory.mktemp("bytes")
    (root / step_dir(1)).mkdir()
    (root / step_dir(1) / MANIFEST_NAME).write_bytes(data)
    for key in (None, KEY.encode()):
        (row,) = list_checkpoints(open_storage(str(root)), key=key)
        assert row.step == 1 and row.manifest is None and row.error


def test_the_worker_exits_205_with_one_line_naming_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import training.__main__ as worker
    import training.worker

    def unavailable(*_: Any, **__: Any) -> None:
        raise CheckpointStoreUnavailableError("job 'job': ... store s3 (list: OSError: timeout) ...", {"s3": "x"})

    monkeypatch.setattr(training.worker, "run_worker", unavailable)
    doc = {
        "apiVersion": "torchrig/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "job"},
        "spec": {"task": {"entrypoint": "training.examples.digits:task"}, "training": {"steps": 1}},
    }
    (tmp_path / "job.yaml").write_text(json.dumps(doc))
    code = worker.main(["--spec", str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "run")])
    assert code == ExitCode.STORE_UNAVAILABLE == 205
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["torchrig: error: job 'job': ... store s3 (list: OSError: timeout) ..."]
