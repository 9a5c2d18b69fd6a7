"""Finding the slow rank and the stuck line while the job runs, on real 2-rank gloo jobs under torchrun:

- a rank slowed only inside its backward pass (`slow_backward`: the other rank waits for it in DDP's
  overlapped all-reduce, so both ranks' step times are the same) is named the straggler within
  3 x logEvery steps;
- a hung rank: `torchrig status --stacks` makes every live rank dump its stacks, and the watchdog
  dumps them again before the group exits; each rank's file holds its frames, rank 1's the hang's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.cli.stacks_cmd import stacks_hint
from tests.fixtures.common import REPO
from tests.fixtures.jobs import events
from tests.integration.test_worker import _env, run_torchrun, write_spec
from training.contract import RunFiles
from training.contract.stacks import innermost_frames, ranks_apart, read_stack_dumps
from training.watchdog import WATCHDOG_EXIT_CODE

LOG_EVERY = 5  # write_spec's metrics.logEvery


@pytest.mark.timeout(240)
def test_backward_only_slowdown_of_rank_1_is_found_within_3_windows(tmp_path: Path) -> None:
    fault_step, seconds = 11, 0.15
    spec = write_spec(tmp_path / "straggler.yaml", steps=40)
    run_dir = tmp_path / "run"
    proc = run_torchrun(
        spec, run_dir, faults=[{"kind": "slow_backward", "rank": 1, "step": fault_step, "seconds": seconds}]
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    evs = events(run_dir)
    found = [e for e in evs if e["event"] == "straggler"]
    named = [e for e in found if e["slow_rank"] == 1]
    assert named, [e for e in evs if e["event"] in ("step_times", "straggler")]
    first = named[0]
    assert first["rank"] == 0 and first["slowdown_ratio"] > 1.3 and first["ratios"][1] > 1.3
    assert fault_step <= first["step"] < fault_step + 3 * LOG_EVERY, found  # found within 3 windows
    assert found[-1]["slow_rank"] == 1  # and stays the straggler (a busy CI host may add noise before)

    # DDP's overlap at work: after the fault both ranks' step times are the slow rank's (rank 0 waits
    # in the all-reduce), so step time alone could not tell; compute time outside collectives does.
    late = {e["rank"]: e for e in evs if e["event"] == "step_times" and e["step"] == 30}
    assert late[0]["step_s"] > 0.7 * late[1]["step_s"] and late[1]["step_s"] > seconds
    assert late[1]["compute_s"] > 2 * late[0]["compute_s"]


def _wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.timeout(240)
def test_hang_leaves_one_stack_file_per_rank_with_the_hung_frame(tmp_path: Path) -> None:
    timeout_s = 20.0
    spec = write_spec(tmp_path / "hang.yaml", steps=50, step_timeout_s=timeout_s)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
        "--monitor-interval=0.5", "-m", "training", "--spec", str(spec), "--run-dir", str(run_dir),
    ]  # fmt: skip
    env = _env([{"kind": "hang", "rank": 1, "step": 3}])
    job = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        files = RunFiles(run_dir)
        _wait_for(lambda: any(e["event"] == "fault" for e in _events(files.events)), 120, "the hang fault")
        time.sleep(1.0)  # rank 0 reaches the next step's all-reduce and blocks there

        # 1. On demand, while the job hangs: every live rank dumps, the CLI says who is elsewhere.
        status = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "status", "--stacks", str(run_dir)],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        out = status.stdout + status.stderr
        assert "stacks of generation 0:" in out and "not where the others are: rank 1" in out, out
        assert f"rank 0: {files.stack_file(0, 0)}" in out and "training/faults.py" in out, out
        requested = read_stack_dumps(run_dir, 0)
        assert sorted(requested) == [0, 1] and ranks_apart(requested) == [1]

        # 2. The watchdog: every rank dumps again before the group exits.
        out, _ = job.communicate(timeout=timeout_s * 3)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert job.returncode != 0 and f"exitcode  : {WATCHDOG_EXIT_CODE}" in out, out[-3000:]
    evs = events(run_dir)
    stacks = {e["rank"]: e for e in evs if e["event"] == "stacks"}
    assert sorted(stacks) == [0, 1], evs
    assert {e["path"] for e in stacks.values()} == {str(files.stack_file(0, 0)), str(files.stack_file(0, 1))}
    dumps = read_stack_dumps(run_dir, 0)
    assert sorted(dumps) == [0, 1]  # one file per rank
    for rank, text in dumps.items():
        assert "reason=request" in text and "reason=watchdog" in text  # two sections, newest last
        assert "most recent call first" in text.rsplit("reason=watchdog", 1)[1], rank
    frames = innermost_frames(dumps)  # from the newest (the watchdog's) section
    assert frames[1].path.endswith("training/faults.py") and frames[1].function == "_fire"
    assert frames[0].path.endswith("training/trainer.py"), frames[0]  # waiting in the next step's backward
    assert ranks_apart(dumps) == [1]
    assert stacks_hint(run_dir) == f"stacks: {files.stacks_dir(0)} (2 ranks; not where the others were: rank 1)"
    first_exit = min(e["time"] for e in evs if e["event"] == "watchdog")
    assert all(e["time"] < first_exit for e in stacks.values())  # dumped before the first rank exited


def _events(path: Path) -> list[dict[str, object]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
