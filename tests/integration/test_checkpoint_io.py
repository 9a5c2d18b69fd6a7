"""Checkpoint I/O as the run sees it (issue 13.5 and 13.6), with the real worker:

- a final save that no store commits is not a clean success: result.json and summary.json record it,
  the run is `failed`, and `torchrig run` says so on its last line with exit code 5;
- the step watchdog gives checkpoint I/O its own limit (`checkpoint.ioTimeoutSeconds`): a restore and a
  final save slower than `restarts.stepTimeoutSeconds` complete, one slower than the I/O limit still
  ends the rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import EXIT_CHECKPOINT_LOST
from tests.fixtures.common import REPO
from tests.fixtures.jobs import events, write_job
from training.contract import Env, ExitCode, RunFiles, read_jsonl

pytestmark = pytest.mark.slow

_LAUNCHER_VARS = (Env.RANK, Env.WORLD_SIZE, Env.LOCAL_RANK, Env.LOCAL_WORLD_SIZE, Env.GROUP_RANK, Env.MASTER_ADDR)


def digits_job(tmp_path: Path, *, steps: int, checkpoint: dict[str, Any], restarts: dict[str, Any]) -> Path:
    """The digits task, one process, tiny; checkpoint and restart sections as given."""
    doc = {
        "apiVersion": "torchrig/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "ckpt-io"},
        "spec": {
            "task": {"entrypoint": "training.examples.digits:task", "args": {"hidden": 16}},
            "training": {"steps": steps, "batchSize": 8, "seed": 0, "evalAtEnd": False},
            "procsPerNode": 1,
            "restarts": {"max": 0, **restarts},
            "checkpoint": {"every": {"steps": 1000}, **checkpoint},
            "metrics": {"enabled": False, "logEvery": 5},
        },
    }
    return write_job(tmp_path, doc)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and k != Env.FAULTS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **extra)
    return env


def _finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout_s} s:\n{out[-2000:]}\n{err[-3000:]}")


# -- 13.5: a failed final save -----------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_a_final_checkpoint_no_store_took_fails_the_run_with_exit_5(tmp_path: Path) -> None:
    """The only store turns into a file while the job trains: every step runs, the final save reaches
    no store, and the run must not look like a success."""
    store = tmp_path / "store"
    job = digits_job(
        tmp_path,
        steps=60,
        checkpoint={"stores": [{"uri": f"file://{store}", "name": "only"}]},
        restarts={"stepTimeoutSeconds": 120},
    )
    run_dir = tmp_path / "run"
    slow = [{"kind": "slow", "rank": 0, "step": 1, "seconds": 0.15}]  # ~9 s of steps: time to break the store
    proc = subprocess.Popen(
        [sys.executable, "-c", "from orchestrator.cli import main; main()", "run", str(job), "--run-dir", str(run_dir)],
        cwd=REPO,
        env=_env(**{Env.FAULTS: json.dumps(slow)}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    metrics = RunFiles(run_dir).metrics
    deadline = time.monotonic() + 180
    while not read_jsonl(metrics) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    step_then = read_jsonl(metrics)[-1]["step"] if read_jsonl(metrics) else None
    # Unwritable even for root: the store's directory moves aside and a file takes its place.
    os.replace(store, tmp_path / "store-aside")
    store.write_text("not a directory any more\n")
    out, err = _finish(proc, 240)

    assert step_then is not None and step_then < 60, f"the store broke too late (step {step_then}):\n{err[-3000:]}"
    assert proc.returncode == EXIT_CHECKPOINT_LOST, f"{out}\n{err[-3000:]}"
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the final checkpoint (step 60) was committed to no store (only: "), err[-3000:]
    assert out.strip().splitlines()[-2].startswith("failed: 60/60 steps"), out

    final = {"step": 60, "committed": False, "stores_ok": []}
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == 60 and final.items() <= result["final_checkpoint"].items()
    assert list(result["final_checkpoint"]["stores_failed"]) == ["only"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 60
    assert summary["final_checkpoint"] == result["final_checkpoint"]
    assert summary["reason"] == last.removeprefix("error: ")
    status = subprocess.run(
        [sys.executable, "-c", "from orchestrator.cli import main; main()", "status", str(run_dir)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert status.returncode == 1 and "committed to no store" in status.stdout, status.stdout + status.stderr


# -- 13.6: checkpoint I/O has its own watchdog limit ---------------------------------------------------
SLOW_MANAGER = """
import json, sys, time

# Imported before the watchdog starts: on a loaded machine they alone can take longer than its limit.
import torch.distributed.checkpoint, torch.nn.parallel, torch.optim
import training.checkpoint, training.examples.digits, training.strategies
from training import worker
from training.__main__ import main

delays = json.loads(sys.argv[3])
build = worker._default_checkpoint_manager


class SlowStore:
    # A checkpoint manager whose restore and final save take `delays` seconds longer (a slow store).
    def __init__(self, inner):
        self.inner = inner

    def restore(self, state):
        time.sleep(delays.get("restore", 0))
        return self.inner.restore(state)

    def should_save(self, step):
        return self.inner.should_save(step)

    def save(self, step, state, *, final=False):
        if final:
            time.sleep(delays.get("final", 0))
        return self.inner.save(step, state, final=final)

    def close(self):
        self.inner.close()


worker._default_checkpoint_manager = lambda spec, identity, sink: SlowStore(build(spec, identity, sink))
sys.exit(main(["--spec", sys.argv[1], "--run-dir", sys.argv[2]]))
"""

STEP_TIMEOUT_S = 15.0  # covers the worker's start-up too: generous on a loaded machine
SLOW_S = 17.0  # longer than the step timeout


def _slow_worker(tmp_path: Path, run_dir: Path, *, io_timeout_s: float, delays: dict[str, float]) -> tuple[int, str]:
    job = digits_job(
        tmp_path,
        steps=4,
        checkpoint={"ioTimeoutSeconds": io_timeout_s, "stores": [{"uri": "file://./checkpoints", "name": "local"}]},
        restarts={"stepTimeoutSeconds": STEP_TIMEOUT_S},
    )
    script = tmp_path / "slow_worker.py"
    script.write_text(SLOW_MANAGER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(job), str(run_dir), json.dumps(delays)],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out, _ = _finish(proc, 200)
    return proc.returncode, out


@pytest.mark.timeout(300)
def test_checkpoint_io_slower_than_the_step_timeout_completes_and_past_its_own_limit_still_fires(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    code, out = _slow_worker(tmp_path, run_dir, io_timeout_s=120, delays={"restore": SLOW_S, "final": SLOW_S})
    assert code == 0, out[-4000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == 4 and result["final_checkpoint"]["committed"] is True
    assert not [e for e in events(run_dir) if e["event"] == "watchdog"]

    # Past checkpoint.ioTimeoutSeconds the rank is still taken for hung (here: a restore that never ends).
    again = tmp_path / "again"
    code, out = _slow_worker(tmp_path, again, io_timeout_s=3, delays={"restore": 120})
    assert code == ExitCode.HUNG, out[-4000:]
    assert "watchdog: checkpoint I/O unfinished" in out and "checkpoint.ioTimeoutSeconds=3.0" in out, out[-4000:]
    dog = next(e for e in events(again) if e["event"] == "watchdog")
    assert dog["phase"] == "checkpoint_io" and dog["timeout_s"] == 3.0 and 3.0 < dog["silent_s"] < STEP_TIMEOUT_S
