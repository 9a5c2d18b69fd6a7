"""Stack dumps and what a local run writes are private to their user: directories 0700, files 0600
(issue 33, item 6). The end-to-end check of a whole local run is
tests/integration/test_rundir_hostile_run.py."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from training.checkpoint.storage import open_storage
from training.contract import RunFiles, WorkerIdentity
from training.contract.files import private_umask
from training.metrics.base import MetricsSink
from training.stacks import StackDumper


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The usual umask (022), whatever the test process had: what a private file must not depend on."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


class _Sink(MetricsSink):
    def on_event(self, event: Any, **fields: Any) -> None:
        pass


@pytest.mark.usefixtures("open_umask")
def test_stack_dumps_are_private_on_any_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no py-spy
    files = RunFiles(tmp_path / "run")
    dumper = StackDumper(WorkerIdentity(rank=1, world_size=2, generation=3, run_dir=str(files.root)), _Sink())
    dumper.install()
    try:
        assert dumper.dump("request", step=7) == files.stack_file(3, 1)
    finally:
        dumper.close()
    assert _mode(files.stack_file(3, 1)) == 0o600
    assert _mode(files.stacks_dir(3)) == 0o700 and _mode(files.stacks) == 0o700
    assert _mode(files.root) == 0o755  # the run directory is the backend's to make (local: 0700)


@pytest.mark.usefixtures("open_umask")
def test_a_file_store_written_under_a_local_runs_umask_is_private(tmp_path: Path) -> None:
    source = tmp_path / "shard.bin"
    source.write_bytes(b"x" * 100)
    store = open_storage(f"file://{tmp_path / 'ckpt'}")
    with private_umask():
        store.put_file(str(source), "gen-0/step-1/shard-0.bin")
        store.write_bytes_atomic("gen-0/step-1/manifest.json", b"{}")
        store.create_exclusive("gen-0/fence.json", b"{}")
    root = tmp_path / "ckpt"
    made = [root, *root.rglob("*")]
    assert {p.name: _mode(p) for p in made if p.is_file()} == dict.fromkeys(
        ("shard-0.bin", "manifest.json", "fence.json"), 0o600
    )
    assert {_mode(p) for p in made if p.is_dir()} == {0o700}
    assert os.umask(0o022) == 0o022  # restored after the block
