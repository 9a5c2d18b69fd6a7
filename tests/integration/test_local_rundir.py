"""Run-directory helpers (`orchestrator.rundir`): summary.json from worker files, incremental tails, run
state from the supervisor record, process liveness."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.backends._local_procs import alive, find_marked, process_start_ticks
from orchestrator.backends.base import RunState
from orchestrator.rundir import build_summary, iter_rank_lines, rank_of_line, run_state, world_sizes_from_events
from training.contract import Env, JsonlTail, read_jsonl, write_json


def _lines(path: Path, records: list[dict[str, object]], torn: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)


def test_summary_from_worker_files(tmp_path: Path) -> None:
    _lines(
        tmp_path / "events.jsonl",
        [
            {"time": 1, "rank": 0, "generation": 0, "event": "start", "world_size": 2},
            {"time": 1, "rank": 1, "generation": 0, "event": "start", "world_size": 2},
            {
                "time": 2,
                "rank": 0,
                "generation": 0,
                "event": "checkpoint_committed",
                "step": 50,
                "stores_ok": ["local"],
            },
            {"time": 3, "rank": 0, "generation": 1, "event": "start", "world_size": 1},
            {"time": 4, "rank": 0, "generation": 1, "event": "restore", "step": 50, "store": "local"},
            {"time": 4, "rank": 1, "generation": 1, "event": "restore", "step": 50, "store": "local"},
            {"time": 5, "rank": 0, "generation": 2, "event": "start", "world_size": 2},
            {"time": 6, "rank": 0, "generation": 2, "event": "checkpoint_committed", "step": 100, "stores_ok": ["s3"]},
        ],
        torn='{"time": 7, "rank": 0, "ev',
    )  # a writer killed mid-line
    _lines(tmp_path / "metrics.jsonl", [{"step": 90, "loss": 0.5, "samples_per_s": 10.0}])
    (tmp_path / "result.json").write_text(
        json.dumps(
            {"steps": 100, "final_loss": 0.25, "eval": {"accuracy": 0.97}, "params_sha256": "ab", "samples_per_s": 12.5}
        )
    )
    summary = build_summary(
        tmp_path,
        status="succeeded",
        wall_s=3.21,
        stores=[{"name": "local", "uri": "file:///x"}, {"name": "s3", "uri": "s3://b/p"}],
        total_steps=100,
    ).to_dict()
    assert summary["status"] == "succeeded"
    assert summary["steps"] == 100 and summary["final_loss"] == 0.25 and summary["eval"] == {"accuracy": 0.97}
    assert summary["restarts"] == 2
    assert summary["restored_from"] == [{"store": "local", "step": 50}]
    assert summary["world_sizes"] == [2, 1, 2]
    assert summary["params_sha256"] == "ab" and summary["samples_per_s"] == 12.5 and summary["wall_s"] == 3.21
    assert summary["checkpoints"] == [
        {"name": "local", "uri": "file:///x", "last_committed_step": 50},
        {"name": "s3", "uri": "s3://b/p", "last_committed_step": 100},
    ]


def test_summary_without_result_falls_back_to_metrics(tmp_path: Path) -> None:
    _lines(tmp_path / "metrics.jsonl", [{"step": 10, "loss": 1.5}, {"step": 20, "loss": 1.25, "samples_per_s": 3.0}])
    summary = build_summary(
        tmp_path, status="cancelled", wall_s=1.0, stores=[], reason="cancelled by the user"
    ).to_dict()
    assert (summary["steps"], summary["final_loss"], summary["samples_per_s"]) == (20, 1.25, 3.0)
    assert summary["params_sha256"] is None and summary["reason"] == "cancelled by the user"


@given(st.lists(st.integers(1, 4), max_size=20))
def test_world_sizes_collapse_consecutive_repeats(sizes: list[int]) -> None:
    events = [{"time": i, "event": "start", "world_size": s} for i, s in enumerate(sizes)]
    got = world_sizes_from_events(list(reversed(events)))  # order comes from the time, not the file
    assert all(a != b for a, b in itertools.pairwise(got))
    assert set(got) == set(sizes)
    if sizes:
        assert got[0] == sizes[0] and got[-1] == sizes[-1]


@settings(deadline=None, max_examples=40)
@given(st.lists(st.dictionaries(st.text(max_size=5), st.integers()), max_size=8), st.integers(1, 40))
def test_jsonl_tail_sees_each_record_once_whatever_the_chunking(records: list[dict[str, int]], cut: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.jsonl"
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        tail = JsonlTail(path)
        got: list[dict[str, int]] = []
        for i in range(0, len(data) + cut, cut):
            path.write_bytes(data[: i + cut])
            got += tail.read_new()
        assert got == records


def test_read_jsonl_skips_garbage(tmp_path: Path) -> None:
    (tmp_path / "e.jsonl").write_text('{"a": 1}\nnot json\n[1, 2]\n\n{"b": 2}\n')
    assert read_jsonl(tmp_path / "e.jsonl") == [{"a": 1}, {"b": 2}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_run_state_from_summary_and_supervisor(tmp_path: Path) -> None:
    assert run_state(tmp_path)[0] is RunState.UNKNOWN
    (tmp_path / "job.yaml").write_text("x: 1\n")
    assert run_state(tmp_path)[0] is RunState.PENDING
    me = os.getpid()
    write_json(tmp_path / "supervisor.json", {"pid": me, "start_ticks": process_start_ticks(me)})
    assert run_state(tmp_path)[0] is RunState.RUNNING
    # Same pid, other start time: a reused pid is not our supervisor.
    write_json(tmp_path / "supervisor.json", {"pid": me, "start_ticks": (process_start_ticks(me) or 0) + 1})
    state, message, _ = run_state(tmp_path)
    assert state is RunState.UNKNOWN and "gone" in message
    for status, expected in [("succeeded", 0), ("failed", 1), ("cancelled", 11)]:
        write_json(tmp_path / "summary.json", {"status": status})
        assert run_state(tmp_path)[0].exit_code == expected


def test_alive_and_find_marked_track_real_processes() -> None:
    token = os.urandom(6).hex()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"],
        env={**os.environ, Env.RUN_TOKEN: token, Env.LOCAL_NODE: "3"},
    )
    try:
        ticks = process_start_ticks(proc.pid)
        assert alive(proc.pid, ticks)
        deadline = time.monotonic() + 5
        while not find_marked(token) and time.monotonic() < deadline:
            time.sleep(0.05)  # the child may still be in exec for an instant
        assert find_marked(token) == [proc.pid] and find_marked(token, 3) == [proc.pid] and find_marked(token, 1) == []
        proc.kill()
        proc.wait()
        assert not alive(proc.pid, ticks) and find_marked(token) == []
    finally:
        proc.kill()
        proc.wait()


def test_rank_lines_filter_by_prefix(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "node0.log").write_text("[rank0]:a\n[rank1]:b\nagent line\n")
    (tmp_path / "logs" / "node1.log").write_text("[rank10]:c\n[rank1]:d\n")
    assert list(iter_rank_lines(tmp_path, 1)) == ["[rank1]:b", "[rank1]:d"]
    assert len(list(iter_rank_lines(tmp_path, None))) == 5
    assert [rank_of_line(x) for x in ("[rank10]:c", "agent line", "[rank]:x")] == [10, None, None]


def test_cancel_of_a_supervisor_that_ignores_sigterm_records_the_users_cancel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor that outlives the cancel's grace: `cancel_detached` writes the summary itself, with
    the same reason the supervisor would have written (scripts match on it) and why it is its own."""
    from orchestrator.backends import supervise

    monkeypatch.setattr(supervise, "CANCEL_GRACE_S", 0.5)
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline()  # its handler is in place
        (tmp_path / "supervisor.json").write_text(json.dumps({"pid": stubborn.pid}))
        supervise.cancel_detached(tmp_path)
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["status"] == "cancelled"
        assert summary["reason"].startswith("cancelled by the user"), summary
        assert "did not write a summary within 0.5 s" in summary["reason"]
    finally:
        stubborn.kill()
        stubborn.wait()


def test_a_resubmits_summary_ignores_the_earlier_attempts_result_and_metrics(tmp_path: Path) -> None:
    """A job resubmitted into its run directory that fails before its first step must not report the
    earlier attempt's "20/20 steps, loss ...": result.json and metrics older than this attempt's start
    say nothing of it."""
    import os
    import time

    _lines(tmp_path / "metrics.jsonl", [{"time": 100.0, "step": 20, "loss": 0.5}])
    (tmp_path / "result.json").write_text(json.dumps({"steps": 20, "final_loss": 0.25, "params_sha256": "ab"}))
    os.utime(tmp_path / "result.json", (100.0, 100.0))
    started = time.time()
    summary = build_summary(tmp_path, status="failed", wall_s=1.0, stores=[], total_steps=20, since=started)
    assert summary.steps is None and summary.final_loss is None and summary.params_sha256 is None
    # Without `since` (a first attempt) the same files are this run's.
    assert build_summary(tmp_path, status="failed", wall_s=1.0, stores=[], total_steps=20).steps == 20


def test_a_new_run_directory_points_at_the_earlier_unfinished_run_holding_this_jobs_checkpoints(
    tmp_path: Path,
) -> None:
    """A store under the run directory (`file://./ckpt`) stays behind when a launch takes a new run
    directory: the hint names the newest earlier run that did not finish and holds checkpoints of it, never
    a succeeded run, and says nothing for absolute stores or `resume: never`."""
    from orchestrator.loader import load_spec
    from orchestrator.rundir import earlier_checkpoints
    from tests.fixtures.checkpoint import config as ckpt_config
    from tests.fixtures.checkpoint import make_state
    from training.checkpoint import CheckpointManager
    from training.contract import RunFiles, WorkerIdentity

    job = tmp_path / "job.yaml"
    job.write_text(
        "apiVersion: torchrig/v1\nkind: TrainingJob\nmetadata: {name: j}\nspec:\n"
        "  task: {entrypoint: training.examples.digits:task}\n"
        "  training: {steps: 100}\n"
        "  checkpoint: {stores: [{uri: 'file://./ckpt', name: mine}]}\n"
    )
    spec = load_spec(job, [])
    runs = tmp_path / "runs" / "j"

    def earlier_run(stamp: str, step: int | None, status: str | None) -> Path:
        run_dir = runs / stamp
        RunFiles(run_dir).logs.mkdir(parents=True)
        if step is not None:
            mgr = CheckpointManager(ckpt_config(str(run_dir / "ckpt"), **{"async": False}), WorkerIdentity(job="j"))
            mgr.save(step, make_state(step))
            mgr.close()
        if status is not None:
            write_json(RunFiles(run_dir).summary, {"status": status})
        return run_dir

    assert earlier_checkpoints(spec, runs / "20261127-100000") is None, "no earlier run"
    cancelled = earlier_run("20261127-090000", 40, "cancelled")
    earlier_run("20261127-091000", None, "failed")  # no checkpoint of its own
    earlier_run("20261127-092000", 60, "succeeded")  # finished: starting over is what the user wants
    found = earlier_checkpoints(spec, runs / "20261127-100000")
    assert found is not None
    assert (found.run_dir, found.store, found.step, found.state) == (cancelled, "mine", 40, "cancelled")
    assert earlier_checkpoints(load_spec(job, ["spec.checkpoint.resume=never"]), runs / "20261127-100000") is None
    absolute = ["spec.checkpoint.stores[0].uri=" + str(tmp_path / "abs")]
    assert earlier_checkpoints(load_spec(job, absolute), runs / "20261127-100000") is None, "nothing stays behind"
