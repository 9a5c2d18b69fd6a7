"""A real local run (agents, store, gloo workers of the stand-in) whose run directory is hostile or
watched: garbage in events.jsonl while it runs ends nothing, and what it writes is its user's alone
(issue 33, items 3 and 6)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.common import REPO
from tests.integration.test_local_backend import STANDIN, assert_no_processes_left, standin_job
from training.contract import RunFiles, read_jsonl

GARBAGE = [
    b"[" * 100_000 + b"\n",  # the RecursionError that ended the supervisor (issue 33)
    b'{"event": "start", "world_size": "x", "time": "y", "rank": [], "generation": {}}\n',
    b'{"event": "checkpoint_committed", "step": 10e400, "stores_ok": 7, "time": 1e999}\n',
    b'{"event": "recovery", "path": "inplace", "inplace_generation": "x"}\n',
    os.urandom(4096).replace(b"\n", b"") + b"\n",
    b"x" * (3 << 20) + b"\n",  # over the line limit
]


@pytest.mark.timeout(240)
def test_garbage_in_events_while_it_runs_ends_nothing_and_the_run_is_private(tmp_path: Path) -> None:
    job = standin_job(tmp_path, steps=120, every=20)
    run_dir = tmp_path / "run"
    files = RunFiles(run_dir)
    env = {**os.environ, "STANDIN_STEP_S": "0.05"}
    args = ["run", str(job), "--run-dir", str(run_dir), "--worker", STANDIN, "-o", "json"]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from orchestrator.cli import main; main()", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    deadline = time.monotonic() + 90
    # Appended to once the workers made them (a file this test created would have the test's umask).
    while not (read_jsonl(files.metrics) and any(e.get("event") == "start" for e in read_jsonl(files.events))):
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.2)
    with files.events.open("ab") as fh:
        for chunk in GARBAGE:
            fh.write(chunk)
    with files.metrics.open("ab") as fh:
        fh.write(b'{"step": "x", "loss": 1e999, "time": [1]}\n' + b"[" * 100_000 + b"\n")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    assert summary == json.loads(files.summary.read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 120 and summary["world_sizes"] == [2]
    assert "Traceback" not in err and "events.jsonl" in err  # the skipped lines are reported, once
    assert err.count("events.jsonl: ") == 1, err

    # Item 6: the run directory 0700, everything in it 0600 / 0700 (checkpoints, logs, stacks, ...).
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    opened = []
    for path in [run_dir, *run_dir.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if path.is_symlink():
            continue
        if mode & 0o077:
            opened.append(f"{path.relative_to(run_dir)}: {mode:o}")
    assert opened == [], opened
    assert list(files.checkpoints.iterdir()) and (files.logs / "node0.log").is_file()
    assert_no_processes_left(run_dir)
