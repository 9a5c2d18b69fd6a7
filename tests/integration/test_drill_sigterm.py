"""`torchrig drill` sent SIGTERM (a CI job cancelled, a terminal closed) stops the run it started: before,
the drill's process died at once and its run's agents and workers trained on with nobody supervising them.
It exits 128 + 15 with one line, and the drill directory (run dir, checkpoints) is kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.common import REPO
from training.contract import EventKind, RunFiles, read_events


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _processes_of(folder: Path, but: int) -> list[int]:
    return [
        pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if pid != but and str(folder) in _cmdline(pid)
    ]


@pytest.mark.timeout(240)
def test_a_drill_sent_sigterm_stops_its_run_and_keeps_its_directory(tmp_path: Path) -> None:
    drill_dir = tmp_path / "drill"
    cmd = [sys.executable, "-c", "from orchestrator.cli import main; main()", "drill", "kill-worker"]
    cmd += [str(REPO / "examples" / "digits-ddp.yaml"), "--drill-dir", str(drill_dir), "--no-reference"]
    cmd += ["--at-step", "20000", "--set", "spec.training.steps=30000", "--set", "spec.checkpoint.every.steps=5"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        events = RunFiles(drill_dir / "run").events
        deadline = time.monotonic() + 150
        # Training: a committed checkpoint in the drill's run (the run's processes name its directory).
        while not any(e.kind == EventKind.CHECKPOINT_COMMITTED for e in read_events(events)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the drill's run never checkpointed"
            time.sleep(0.5)
        assert _processes_of(drill_dir, proc.pid), "the run's processes name the drill directory"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "stopped by SIGTERM", err
    assert "Traceback" not in err
    deadline = time.monotonic() + 20
    while (left := _processes_of(drill_dir, proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], [_cmdline(p) for p in left]
    assert (drill_dir / "run").is_dir(), "the drill's run directory is kept"
