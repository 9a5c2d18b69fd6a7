"""How a local run starts (issue 36): the preflight runs while the agents import torchrun, and the c10d
rendezvous store is served by the supervisor's own process (no store process importing torch beside the
agents); a preflight error still stops everything before a worker starts or a file of the run is written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.backends._local_procs import find_marked
from orchestrator.backends.base import LocalOptions, RunState, SubmitOptions
from orchestrator.backends.local import LocalBackend, LocalPlan, LocalRun
from orchestrator.errors import SpecError
from orchestrator.loader import load_spec
from tests.fixtures.jobs import write_job
from tests.integration.test_local_backend import STANDIN, standin_job, torchrig
from training.contract import RunFiles


def _run(tmp_path: Path, job: Path) -> LocalRun:
    options = SubmitOptions(run_dir=str(tmp_path / "run"), local=LocalOptions(worker=STANDIN))
    dryrun = LocalBackend().dry_run(load_spec(job), options)
    assert isinstance(dryrun.request, LocalPlan)
    return LocalRun(spec=dryrun.spec, plan=dryrun.request)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.timeout(180)
def test_the_preflight_runs_while_the_agents_start_and_its_error_stops_them(tmp_path: Path) -> None:
    run = _run(tmp_path, standin_job(tmp_path))
    seen: dict[str, object] = {}

    def preflight() -> None:
        seen["agents"] = sorted(run.agent_pids())
        seen["job_written"] = run.files.job.exists()
        seen["store_port"] = run.files.store_port.exists()
        raise SpecError("spec.task.entrypoint: no module named 'nope'")

    with pytest.raises(SpecError, match=r"spec\.task\.entrypoint"):
        run.start(preflight=preflight)
    assert seen["agents"], "the agents were started before the preflight (their torch import overlaps it)"
    assert seen["job_written"] is False and seen["store_port"] is False, "nothing of the run before the preflight"
    assert find_marked(run.token) == [], "the preflight's error stopped every agent"
    assert not run.files.job.exists() and not run.files.supervisor.exists()


@pytest.mark.timeout(180)
def test_the_store_is_served_by_the_supervisor_and_closed_with_the_run(tmp_path: Path) -> None:
    run = _run(tmp_path, standin_job(tmp_path, steps=10))
    run.start()
    try:
        record = json.loads(run.files.supervisor.read_text())
        assert record["store"]["pid"] == os.getpid(), "no store process of its own (a second torch import)"
        assert not [p for p in find_marked(run.token) if "_local_store" in _cmdline(p)]
        port = int(record["store"]["port"])
        summary = run.wait(timeout_s=150)
    finally:
        run.stop(grace_s=0)
    assert summary.status == RunState.SUCCEEDED.value, summary.reason
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # the store closed its port when the run ended


@pytest.mark.timeout(180)
def test_a_preflight_error_of_run_is_one_line_with_its_exit_code_and_leaves_nothing_running(tmp_path: Path) -> None:
    job = write_job(tmp_path, standin_job(tmp_path), {"spec": {"task": {"entrypoint": "no_such_module_xyz:task"}}})
    run_dir = tmp_path / "run"
    proc = torchrig("run", str(job), "--run-dir", str(run_dir), "--worker", STANDIN)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "spec.task.entrypoint" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    files = RunFiles(run_dir)
    assert not files.supervisor.exists() and not files.job.exists() and not files.summary.exists()
    leftover = [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if str(run_dir) in _cmdline(p)]
    assert leftover == [], "an agent of the failed run is still running"


@pytest.mark.timeout(60)
def test_an_agent_loads_no_spec_model_before_its_torch_import() -> None:
    """Each agent (and each node's standby or replacement) imports `_local_agent` first; its package
    `orchestrator.backends` loads no spec model (`orchestrator.spec`, pydantic: 0.2 s of CPU, a second
    or more on a loaded machine) before the agent's torchrun import, on the run's way to its first step."""
    heavy = ("orchestrator.spec", "orchestrator.backends.base", "pydantic", "torch")
    code = f"import sys, orchestrator.backends._local_agent\nprint([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=50)
    assert done.stdout.strip() == "[]", f"loaded by the agent's module: {done.stdout.strip()}"


def test_the_supervisor_wakes_when_an_agent_exits_not_at_its_next_look(tmp_path: Path) -> None:
    """`LocalRun.wait` looks at the agents every interval, and sooner when one exits (its pidfd): the run's
    end is seen at once (issue 36: up to 0.25 s at the end of every run), and an agent that already exited
    is not waited on again."""
    import time

    from orchestrator.backends.local_run import _Agent

    run = _run(tmp_path, standin_job(tmp_path))
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    run._agents = [_Agent(node=0, proc=live), _Agent(node=1, proc=done)]
    start = time.monotonic()
    run._nap(60)
    assert live.poll() == 0, "woke when the agent exited"
    assert time.monotonic() - start < 30, "not after the whole interval"
    start = time.monotonic()
    run._nap(0.2)  # nothing left running: a plain sleep of the interval
    assert time.monotonic() - start >= 0.2
