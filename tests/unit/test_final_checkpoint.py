"""The final checkpoint's outcome in the run records (issue 13.5) and the watchdog's checkpoint-I/O limit
(issue 13.6), without launching a job (tests/integration/test_checkpoint_io.py runs both for real)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import training.watchdog as watchdog_module
from orchestrator.errors import (
    EXIT_BACKEND,
    EXIT_CHECKPOINT_LOST,
    EXIT_FAILED,
    EXIT_RECOVERY,
    EXIT_USAGE,
    FinalCheckpointLost,
)
from orchestrator.rundir import build_summary
from tests.fixtures.checkpoint import Recorder
from training.contract import EventKind, ExitCode, FinalCheckpoint, Result, Summary
from training.watchdog import StepWatchdog

STORES = [{"name": "a", "uri": "file:///a"}, {"name": "b", "uri": "s3://b/p"}]
LOST = FinalCheckpoint(step=10, committed=False, stores_failed={"a": "OSError: disk full", "b": "fenced: newer"})
SAVED = FinalCheckpoint(step=10, committed=True, stores_ok=["a"], stores_failed={"b": "timeout"})


def _run_dir(tmp_path: Path, final: FinalCheckpoint | None) -> Path:
    Result(steps=10, final_loss=0.5, params_sha256="ab", final_checkpoint=final).write(tmp_path / "result.json")
    return tmp_path


def test_a_final_checkpoint_no_store_took_fails_the_summary_with_a_reason(tmp_path: Path) -> None:
    summary = build_summary(_run_dir(tmp_path, LOST), status="succeeded", wall_s=1.0, stores=STORES, total_steps=10)
    assert summary.status == "failed" and summary.steps == 10
    assert summary.reason == (
        "the final checkpoint (step 10) was committed to no store (a: OSError: disk full; b: fenced: newer)"
    )
    assert summary.final_checkpoint == LOST and summary.final_checkpoint_lost()
    on_disk = summary.to_dict()
    assert on_disk["final_checkpoint"] == {
        "step": 10,
        "committed": False,
        "stores_ok": [],
        "stores_failed": {"a": "OSError: disk full", "b": "fenced: newer"},
    }
    assert Summary.from_dict(json.loads(json.dumps(on_disk))) == summary


@pytest.mark.parametrize(
    ("final", "status", "reason", "expected"),
    [
        (SAVED, "succeeded", None, ("succeeded", None)),  # one store is enough
        (None, "succeeded", None, ("succeeded", None)),  # no final save (saveFinal off, or a finished run resumed)
        (LOST, "failed", "restarts exhausted", ("failed", "restarts exhausted")),  # the first cause stays
        (LOST, "cancelled", "cancelled by the user", ("cancelled", "cancelled by the user")),
    ],
)
def test_only_a_lost_final_checkpoint_of_a_succeeded_run_changes_its_status(
    tmp_path: Path, final: FinalCheckpoint | None, status: str, reason: str | None, expected: tuple[str, str | None]
) -> None:
    summary = build_summary(_run_dir(tmp_path, final), status=status, wall_s=1.0, stores=STORES, reason=reason)
    assert (summary.status, summary.reason) == expected
    assert summary.final_checkpoint == final
    assert ("final_checkpoint" in summary.to_dict()) is (final is not None)


def test_records_without_a_final_checkpoint_still_read(tmp_path: Path) -> None:
    """result.json / summary.json written before the field existed."""
    (tmp_path / "result.json").write_text(json.dumps({"steps": 3, "final_loss": 1.0}))
    result = Result.read(tmp_path / "result.json")
    assert result is not None and result.final_checkpoint is None
    assert Result.from_dict({"steps": 3, "final_checkpoint": {"committed": False}}).final_checkpoint is None
    assert Summary.from_dict({"status": "succeeded"}).final_checkpoint_lost() is False
    written = Result(steps=3, final_checkpoint=SAVED)
    written.write(tmp_path / "again.json")
    assert Result.read(tmp_path / "again.json") == written


def test_the_exit_code_of_a_lost_final_checkpoint_is_its_own() -> None:
    assert FinalCheckpointLost.exit_code == EXIT_CHECKPOINT_LOST == 5
    assert EXIT_CHECKPOINT_LOST not in (EXIT_FAILED, EXIT_USAGE, EXIT_BACKEND, EXIT_RECOVERY)


# -- the watchdog's checkpoint-I/O limit ----------------------------------------------------------------------


class _Exits:
    """Stands in for `os._exit` in the watchdog's thread: records the code and stops the watchdog."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.dog: StepWatchdog | None = None
        self.fired = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        assert self.dog is not None
        self.dog._stop.set()
        self.fired.set()


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> _Exits:
    fake = _Exits()
    monkeypatch.setattr(watchdog_module.os, "_exit", fake)
    monkeypatch.setattr(watchdog_module.logging, "shutdown", lambda: None)
    return fake


def _watchdog(exits: _Exits, timeout_s: float) -> tuple[StepWatchdog, Recorder]:
    sink = Recorder()
    dog = StepWatchdog(timeout_s, sink, poll_s=0.02)
    exits.dog = dog
    return dog.start(), sink


def test_checkpoint_io_longer_than_the_step_timeout_is_not_a_hang(exits: _Exits) -> None:
    dog, sink = _watchdog(exits, 1.0)
    try:
        dog.beat(3)
        with dog.io(10.0):
            time.sleep(1.5)  # longer than the step timeout
            with dog.io(10.0):  # nested (close() inside a save): the outer limit comes back after it
                time.sleep(0.1)
            time.sleep(1.0)
        time.sleep(0.3)  # the step clock started again when the I/O ended
        assert exits.codes == [] and not sink.events
        assert exits.fired.wait(5.0), "a silent step after the I/O must still fire"
        assert exits.codes == [int(ExitCode.HUNG)]
        fields: dict[str, Any] = dict(sink.events)[EventKind.WATCHDOG]
        assert fields["phase"] == "step" and fields["timeout_s"] == 1.0 and fields["step"] == 3
    finally:
        dog.stop()


def test_checkpoint_io_past_its_own_limit_still_fires(exits: _Exits, capsys: pytest.CaptureFixture[str]) -> None:
    dog, sink = _watchdog(exits, 60.0)
    try:
        dog.beat(7)
        with dog.io(0.3):
            assert exits.fired.wait(3.0), "I/O past checkpoint.ioTimeoutSeconds must fire"
        fields: dict[str, Any] = dict(sink.events)[EventKind.WATCHDOG]
        assert fields["phase"] == "checkpoint_io" and fields["timeout_s"] == 0.3 and fields["step"] == 7
        err = capsys.readouterr().err
        assert "watchdog: checkpoint I/O unfinished" in err and "(checkpoint.ioTimeoutSeconds=0.3)" in err
    finally:
        dog.stop()


def test_start_up_gets_the_larger_limit_and_the_first_step_the_step_timeout(
    exits: _Exits, capsys: pytest.CaptureFixture[str]
) -> None:
    # A drill's short step timeout must not end a rank whose peers are still importing torch.
    dog, sink = _watchdog(exits, 0.5)
    try:
        with dog.startup(3.0):
            time.sleep(1.2)  # past the step timeout, within the start-up limit
        assert exits.codes == [] and not sink.events
        assert exits.fired.wait(5.0), "a silent first step after start-up must still fire"
        fields: dict[str, Any] = dict(sink.events)[EventKind.WATCHDOG]
        assert fields["phase"] == "step" and fields["timeout_s"] == 0.5
    finally:
        dog.stop()
    exits.codes.clear()
    exits.fired.clear()
    dog, sink = _watchdog(exits, 0.2)
    try:
        with dog.startup(0.4):  # a start-up past its own (larger) limit is still a hang
            assert exits.fired.wait(3.0)
        fields = dict(sink.events)[EventKind.WATCHDOG]
        assert fields["phase"] == "startup" and fields["timeout_s"] == 0.4
        assert "watchdog: start-up unfinished" in capsys.readouterr().err
    finally:
        dog.stop()
