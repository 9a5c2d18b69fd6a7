"""`torchrig submit --backend local` (issue 36): the preflight runs once, in the CLI, and the CLI returns
as soon as the detached supervisor is started; a preflight error is still the CLI's one line and exit
code, and a cancel that comes while the run is starting stops it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from orchestrator.backends._local_procs import alive, process_start_ticks
from tests.fixtures.jobs import write_job
from tests.integration.test_local_backend import STANDIN, assert_no_processes_left, standin_job, torchrig

# A task module that notes each import of itself (the preflight imports the task; the stand-in worker
# does not), then serves the digits task.
COUNTING_TASK = """
import os
with open(os.environ["IMPORTS_FILE"], "a") as fh:
    fh.write(f"{os.getpid()}\\n")
from training.examples.digits import task
"""


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise AssertionError("no btime in /proc/stat")


def _started_at(pid: int) -> float:
    """The wall-clock time process `pid` started (to the clock tick)."""
    ticks = process_start_ticks(pid)
    assert ticks is not None, f"process {pid} is gone"
    return _boot_time() + ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(240)
def test_submit_preflights_once_and_returns_within_a_second_of_starting_the_supervisor(tmp_path: Path) -> None:
    (tmp_path / "counting_task.py").write_text(COUNTING_TASK)
    imports = tmp_path / "imports.txt"
    job = write_job(tmp_path, standin_job(tmp_path, steps=40), {"spec": {"task": {"entrypoint": "counting_task:task"}}})
    run_dir = tmp_path / "run"
    env = {
        "STANDIN_STEP_S": "0.05",
        "IMPORTS_FILE": str(imports),
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    args = ["submit", str(job), "--backend", "local", "--run-dir", str(run_dir), "--worker", STANDIN, "-o", "json"]
    proc = torchrig(*args, env=env)
    returned = time.time()
    assert proc.returncode == 0, proc.stderr
    pid = json.loads((run_dir / "supervisor.json").read_text())["pid"]
    # Scheduled = the supervisor process started. The CLI used to wait for the supervisor's own preflight
    # and the run's store and agents, then tear down torch: 3-10 s. The target is 1 s (`make bench`,
    # `startup`, measures it on a quiet machine); 1.4 s was seen at a load average of 23 on 2 cores.
    assert returned - _started_at(pid) < 2.0, returned - _started_at(pid)
    assert torchrig("status", f"local://{run_dir}").returncode == 10, "running right after submit"
    deadline = time.monotonic() + 180
    while (code := torchrig("status", str(run_dir)).returncode) == 10 and time.monotonic() < deadline:
        time.sleep(1)
    assert code == 0, (run_dir / "supervisor.log").read_text()[-3000:]
    # One import of the task: the CLI's preflight; the supervisor did not run it again.
    assert len(imports.read_text().split()) == 1, imports.read_text()
    supervisor = json.loads((run_dir / "supervisor.json").read_text())
    assert supervisor["pid"] == pid and "run_token" in supervisor, "the supervisor completed its record"
    assert_no_processes_left(run_dir)


def test_a_preflight_error_is_still_the_cli_s_one_line_and_exit_code(tmp_path: Path) -> None:
    job = write_job(tmp_path, standin_job(tmp_path), {"spec": {"task": {"entrypoint": "no_such_module_xyz:task"}}})
    run_dir = tmp_path / "run"
    proc = torchrig("submit", str(job), "--backend", "local", "--run-dir", str(run_dir), "--worker", STANDIN)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "spec.task.entrypoint" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "supervisor.json").exists(), "no supervisor was started"


@pytest.mark.timeout(180)
def test_a_cancel_while_the_run_starts_stops_it(tmp_path: Path) -> None:
    """`cancel` right after `submit`, while the supervisor is still importing and starting the run: it is
    cancelled (summary.json says so) and leaves no process behind."""
    job = standin_job(tmp_path, steps=2000)
    run_dir = tmp_path / "run"
    proc = torchrig("submit", str(job), "--backend", "local", "--run-dir", str(run_dir), "--worker", STANDIN)
    assert proc.returncode == 0, proc.stderr
    cancel = torchrig("cancel", str(run_dir))
    assert cancel.returncode == 0, cancel.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "cancelled", summary
    record = json.loads((run_dir / "supervisor.json").read_text())
    deadline = time.monotonic() + 30  # the supervisor stops what it started before it exits
    while alive(record["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(record["pid"])
    if "run_token" in record:  # else the signal came before the supervisor's code ran: it started nothing
        assert_no_processes_left(run_dir)
