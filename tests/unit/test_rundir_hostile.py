"""Run-directory files are untrusted input: whatever lands in them, the readers return what they can,
never raise, never block and never hold more than their limits, and the supervisor still writes
summary.json (issue 33, item 3)."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.backends._local_view import LiveProgress
from orchestrator.backends.base import RunState
from orchestrator.cli import cli
from orchestrator.cli.report_cmds import build_report
from orchestrator.rundir import build_summary, iter_rank_lines, run_state
from training.contract import EventKind, JsonlTail, RunFiles, Summary, read_events, read_json, read_jsonl
from training.contract.files import MAX_LINE_BYTES
from training.contract.stacks import MAX_STACK_READ_BYTES, header, read_stack_dumps

BRACKETS = b"[" * 100_000  # json.loads raises RecursionError on it (issue 33's reproduction)


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def _healthy_run(root: Path) -> RunFiles:
    """A finished two-rank run's files, as the workers and the supervisor write them."""
    files = RunFiles(root)
    files.logs.mkdir(parents=True)
    files.job.write_text("apiVersion: torchrig/v1\nkind: TrainingJob\n")
    events = [{"time": 1.0, "rank": r, "generation": 0, "event": "start", "world_size": 2} for r in (0, 1)] + [
        {"time": 2.0, "rank": 0, "generation": 0, "event": "checkpoint_committed", "step": 10, "stores_ok": ["local"]},
        {"time": 3.0, "rank": 0, "generation": 0, "event": "finished", "final_loss": 0.5},
    ]
    files.events.write_bytes(b"".join(map(_line, events)))
    files.metrics.write_bytes(b"".join(_line({"time": 1.0 + s, "step": s, "loss": 1.0 / s}) for s in (5, 10)))
    files.result.write_text(json.dumps({"steps": 10, "final_loss": 0.5, "eval": {"accuracy": 0.9}}))
    files.supervisor.write_text(json.dumps({"pid": -1, "backend": "local"}))
    Summary(status="succeeded", steps=10, total_steps=10, run_dir=str(root)).write(files.summary)
    files.node_log(0).write_text("[rank0]:step 5\n[rank1]:step 5\n")
    stack = files.stack_file(0, 0)
    stack.parent.mkdir(parents=True)
    stack.write_text(header(rank=0, generation=0, reason="watchdog", at=1.0) + "Thread 0x1 (most recent call first):\n")
    return files


def _summary(files: RunFiles) -> Summary:
    stores = [{"name": "local", "uri": f"file://{files.checkpoints}"}]
    return build_summary(files.root, status="succeeded", wall_s=1.0, stores=stores, total_steps=10)


# -- the reproduction: 100,000 `[` -----------------------------------------------------------------
def test_a_line_of_brackets_is_skipped_by_every_events_reader(tmp_path: Path) -> None:
    files = _healthy_run(tmp_path)
    with files.events.open("ab") as fh:
        fh.write(BRACKETS + b"\n" + _line({"time": 4.0, "rank": 1, "generation": 0, "event": "finished"}))
    assert [e.time for e in read_events(files.events)] == [1.0, 1.0, 2.0, 3.0, 4.0]
    assert len(read_jsonl(files.events)) == 5
    tail = JsonlTail(files.events)
    assert len(tail.read_new()) == 5 and tail.skipped.malformed == 1
    # The supervisor's live view tails the same file in its loop, then writes summary.json from it.
    progress = LiveProgress(files.root, total_steps=10)
    assert progress.poll() and progress.world_size == 2 and progress.last_checkpoint_step == 10
    summary = _summary(files)
    assert summary.status == "succeeded" and summary.world_sizes == [2]


def test_report_and_status_explain_a_summary_of_brackets(tmp_path: Path) -> None:
    files = _healthy_run(tmp_path)
    files.summary.write_bytes(BRACKETS)
    files.events.write_bytes(files.events.read_bytes() + BRACKETS + b"\n")
    report = CliRunner().invoke(cli, ["report", str(files.root)], catch_exceptions=False)
    assert report.exit_code == 0, report.output
    assert "checkpoints committed" in report.output
    status = CliRunner().invoke(cli, ["status", f"local://{files.root}"], catch_exceptions=False)
    assert status.exit_code == RunState.UNKNOWN.exit_code, status.output
    assert "summary.json is damaged" in status.output


def test_fields_of_the_wrong_type_leave_report_status_and_the_summary_standing(tmp_path: Path) -> None:
    files = _healthy_run(tmp_path)
    files.summary.write_text(
        json.dumps({"status": "failed", "steps": "x", "eval": [1], "restored_from": [1], "checkpoints": "abc"})
    )
    files.result.write_text(
        json.dumps({"steps": "x", "eval": "abc", "final_checkpoint": {"step": 3, "stores_failed": [1]}})
    )
    junk = {"time": "x", "rank": [], "event": "restore", "store": ["a"], "step": 1e400}
    junk2 = {"event": "recovery", "path": "inplace", "inplace_generation": "x", "time": 10**400}
    junk3 = {"event": "checkpoint_committed", "step": 3, "stores_ok": 7}
    files.events.write_bytes(files.events.read_bytes() + _line(junk) + _line(junk2) + _line(junk3))
    files.metrics.write_bytes(files.metrics.read_bytes() + _line({"time": 9.0, "step": "x", "loss": 10**400}))
    files.supervisor.write_text(json.dumps({"pid": "x", "start_ticks": [1]}))
    summary = _summary(files)
    summary.write(files.summary)
    assert read_json(files.summary) is not None and summary.eval == {} and summary.steps is None
    assert summary.final_checkpoint is not None and "no store" in summary.final_checkpoint.reason()
    assert CliRunner().invoke(cli, ["report", str(files.root)], catch_exceptions=False).exit_code == 0
    LiveProgress(files.root, total_steps=10).poll()


# -- bounded -------------------------------------------------------------------------------------------
def _peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_300mb_class_line_is_never_held_whole(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with path.open("wb") as fh:
        fh.write(_line({"a": 1}))
        for _ in range(40):  # 40 MiB in one line
            fh.write(b"x" * (1 << 20))
        fh.write(b"\n" + _line({"b": 2}))
    assert read_jsonl(path) == [{"a": 1}, {"b": 2}]
    assert _peak_bytes(lambda: read_jsonl(path)) < 8 * MAX_LINE_BYTES  # the old reader: ~3x the file


def test_the_tail_holds_at_most_one_line_of_an_unfinished_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"")
    tail = JsonlTail(path)

    def append_and_read() -> None:
        for _ in range(30):
            with path.open("ab") as fh:
                fh.write(b"[" * (1 << 20))  # never a newline: the old tail kept all of it
            assert tail.read_new() == []

    assert _peak_bytes(append_and_read) < 8 * MAX_LINE_BYTES
    with path.open("ab") as fh:
        fh.write(b"\n" + _line({"ok": True}))
    assert tail.read_new() == [{"ok": True}]
    assert tail.skipped.overlong == 1


def test_a_file_over_its_limit_is_read_at_both_ends_and_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(_line({"step": s}) for s in range(1000)))
    got = [o["step"] for o in read_jsonl(path, max_bytes=2000)]
    assert got[0] == 0 and got[-1] == 999 and 50 < len(got) < 200
    assert got == sorted(got) and len(set(got)) == len(got)
    read_jsonl(path, max_bytes=2000)
    warned = [r for r in caplog.records if str(path) in r.getMessage()]
    assert len(warned) == 1 and "file size limit" in warned[0].getMessage()


def _returns_within(fn: Callable[[], object], timeout_s: float = 5.0) -> bool:
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout_s)


def test_a_fifo_under_a_files_name_never_blocks_a_reader(tmp_path: Path) -> None:
    files = _healthy_run(tmp_path)
    for path in (files.events, files.summary):
        path.unlink()
        os.mkfifo(path)
    assert _returns_within(lambda: read_jsonl(files.events))
    assert _returns_within(lambda: read_json(files.summary))
    assert _returns_within(lambda: JsonlTail(files.events).read_new())
    assert read_json(files.summary) is None and run_state(files.root)[0] is RunState.UNKNOWN
    assert _returns_within(lambda: CliRunner().invoke(cli, ["report", str(files.root)], catch_exceptions=False))


def test_a_huge_stack_file_and_an_endless_log_line_are_read_bounded(tmp_path: Path) -> None:
    files = _healthy_run(tmp_path)
    stack = files.stack_file(0, 0)
    with stack.open("a") as fh:
        fh.write("x" * (3 * MAX_STACK_READ_BYTES))
        fh.write(header(rank=0, generation=0, reason="request", at=2.0) + "Thread 0x2 (most recent call first):\n")
    text = read_stack_dumps(files.root, 0)[0]
    assert text.startswith("# torchrig stacks:") and "reason=request" in text and len(text) < MAX_STACK_READ_BYTES
    with files.node_log(0).open("a") as fh:
        fh.write("[rank1]:" + "y" * (8 << 20) + "\n[rank1]:done\n")
    lines = list(iter_rank_lines(files.root, 1))
    assert lines[-1] == "[rank1]:done" and lines[-2].endswith("[line truncated]") and len(lines[-2]) < 100_000


# -- hypothesis: any bytes appended to any run-directory file --------------------------------------
_KEYS = [
    "time", "rank", "generation", "event", "step", "world_size", "stores_ok", "store", "inplace_generation",
    "path", "loss", "samples_per_s", "metrics", "save_s", "final_loss", "eval", "final_checkpoint", "steps",
    "status", "restored_from", "checkpoints", "pid", "start_ticks", "wall_s", "committed", "stores_failed",
    "blocked_s", "table", "trace", "wall_s", "device_time_s",
]  # fmt: skip
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=3),
    max_leaves=8,
)
_EVENT = st.fixed_dictionaries(
    {"event": st.sampled_from([k.value for k in EventKind])}, optional={k: _JSON for k in _KEYS if k != "event"}
)
_GARBAGE = st.one_of(
    st.binary(max_size=300),
    st.sampled_from(["brackets", "braces"]),  # expanded in the test: their repr would flood a failure report
    st.integers(1, 40).map(lambda d: b'{"a":' + b"[" * d + b"]" * d + b"}\n"),  # deep but valid
    _EVENT.map(lambda o: (json.dumps(o, default=str) + "\n").encode()),
    st.lists(_EVENT, max_size=4).map(lambda os_: b"".join((json.dumps(o) + "\n").encode() for o in os_)),
    _JSON.map(lambda o: json.dumps(o).encode()),
)
_LARGE = {"brackets": BRACKETS, "braces": b"{" * 5000 + b"\n"}
_FILES = ["events", "metrics", "result", "summary", "supervisor", "launch", "job"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.dictionaries(st.sampled_from(_FILES), st.lists(_GARBAGE, min_size=1, max_size=3), min_size=1))
def test_bytes_appended_to_any_run_file_never_raise_and_never_lose_the_summary(
    garbage: dict[str, list[bytes | str]],
) -> None:
    with tempfile.TemporaryDirectory() as d:
        files = _healthy_run(Path(d) / "run")
        tail = JsonlTail(files.events)
        tail.read_new()
        progress = LiveProgress(files.root, total_steps=10)
        progress.poll()
        for name, chunks in garbage.items():
            with getattr(files, name).open("ab") as fh:
                for chunk in chunks:
                    fh.write(_LARGE.get(chunk, chunk) if isinstance(chunk, str) else chunk)
        tail.read_new()
        progress.poll()
        progress.line()
        read_events(files.events)
        run_state(files.root)
        build_report(files.root)
        Summary.read(files.summary)
        # The supervisor's last act: summary.json, whatever the workers' files hold.
        _summary(files).write(files.summary)
        written = read_json(files.summary)
        assert written is not None and written["status"] in ("succeeded", "failed", "preempted")
        assert run_state(files.root)[0] in (RunState.SUCCEEDED, RunState.FAILED, RunState.PREEMPTED)
        result = CliRunner().invoke(cli, ["report", str(files.root), "-o", "json"], catch_exceptions=False)
        assert result.exit_code == 0, result.output


# -- the detached supervisor: whatever ends its loop, summary.json is written ----------------------
class _RunThatBreaks:
    def request_cancel(self, reason: str = "") -> None:
        pass

    def wait(self) -> Summary:
        raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")


class _Backend:
    name = "local"

    def request_from_json(self, data: Any) -> Any:
        return data

    def launch_dry_run(self, dryrun: Any) -> _RunThatBreaks:
        return _RunThatBreaks()


def test_the_detached_supervisor_writes_a_summary_when_its_loop_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses
    import signal

    from orchestrator import backends
    from orchestrator.backends import supervise
    from orchestrator.backends.base import SubmitOptions
    from orchestrator.errors import EXIT_FAILED
    from tests.fixtures.common import REPO

    files = RunFiles(tmp_path / "run")
    files.logs.mkdir(parents=True)
    files.job.write_text((REPO / "examples" / "digits-ddp.yaml").read_text())
    launch = {"backend": "local", "options": dataclasses.asdict(SubmitOptions()), "request": {}}
    files.launch.write_text(json.dumps(launch))
    monkeypatch.setattr(backends, "get_backend", lambda name: _Backend())
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert supervise.main([str(files.root)]) == EXIT_FAILED
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    summary = Summary.read(files.summary)
    assert summary is not None and summary.status == "failed"
    assert summary.reason is not None and "RecursionError" in summary.reason


def test_the_plot_title_survives_a_job_yaml_of_brackets(tmp_path: Path) -> None:
    from orchestrator.plot import _job_name

    files = _healthy_run(tmp_path / "run")
    files.job.write_bytes(BRACKETS + b"]" * 100_000)
    assert _job_name(files.root) == "run"
    files.job.write_text("metadata: {name: digits}\n")
    assert _job_name(files.root) == "digits"
