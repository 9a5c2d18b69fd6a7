"""torchrig's torchrun (`python -m training.torchrun`, and the local backend's agent): a worker's permanent
exit (a setting or spec to fix) ends the run at once with that code, a retryable one spends the restarts.

Real torchrun agents with `--max-restarts 3` over a worker that records each start and exits with a given
code."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training.contract import Env, ExitCode
from training.contract.orders import create_job_secret

pytestmark = pytest.mark.timeout(180)

WORKER = """
import sys
with open(sys.argv[1], "a") as fh:
    fh.write("start\\n")
sys.exit(int(sys.argv[2]))
"""


def _run(module: list[str], tmp_path: Path, code: int) -> tuple[int, int, str]:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    starts = tmp_path / f"starts-{code}"
    args = [
        "--standalone",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.1",
        str(worker),
        str(starts),
        str(code),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", *module, *args], capture_output=True, text=True, timeout=150, check=False
    )
    return proc.returncode, len(starts.read_text().splitlines()), proc.stderr


AGENTS = {"training.torchrun": ["training.torchrun"], "local agent": ["orchestrator.backends._local_agent", "-"]}


@pytest.mark.parametrize("agent", sorted(AGENTS))
@pytest.mark.parametrize("code", [2, 3])
def test_a_permanent_worker_exit_stops_the_agent_at_once_with_that_code(tmp_path: Path, agent: str, code: int) -> None:
    rc, starts, stderr = _run(AGENTS[agent], tmp_path, code)
    assert (rc, starts) == (code, 1), stderr[-2000:]
    assert f"a worker exited {code} (permanent" in stderr
    assert "Traceback" not in stderr


def test_a_retryable_worker_exit_spends_the_restarts(tmp_path: Path) -> None:
    rc, starts, stderr = _run(AGENTS["training.torchrun"], tmp_path, 200)
    assert starts == 4 and rc == 1, stderr[-2000:]  # torchrun's own end: every restart tried


class _StorePod:
    """`python -m training.rendezvous_store` on a free port (read from its first line)."""

    def __init__(self, run_id: str, secret_file: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "training.rendezvous_store", "--port", "0", "--run-id", run_id],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, Env.JOB_SECRET_FILE: secret_file},  # it trusts only records signed with it
        )
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        assert "listening on port" in line, line
        self.port = int(line.rsplit(" ", 1)[1])

    def finish(self, timeout_s: float) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode, err


SLEEPER = """
import sys, time
with open(sys.argv[1], "a") as fh:
    fh.write("start\\n")
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
sys.exit(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
"""


def _agent(tmp_path: Path, port: int, *worker_args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """torchrig's torchrun, one node of one rank, a client of the c10d store at `port` (never its host)."""
    worker = tmp_path / "sleeper.py"
    worker.write_text(SLEEPER)
    args = [
        *("--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "0", "--monitor-interval", "0.1"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job"),
        *("--rdzv-conf", "is_host=false", str(worker), str(tmp_path / "starts"), *worker_args),
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "training.torchrun", *args],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_an_agent_that_loses_its_rendezvous_store_exits_retryable(tmp_path: Path) -> None:
    """The pod hosting the store dies (a PyTorchJob's Master): torchrun would exit 1, which a PyTorchJob
    takes as permanent (the job fails); torchrig's exits STORE_LOST, so the pod is recreated and the job
    restarts from its checkpoint."""
    store = _StorePod("job", create_job_secret(tmp_path / "secret"))
    agent = _agent(tmp_path, store.port, "120")
    deadline = time.monotonic() + 60
    while not (tmp_path / "starts").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "starts").exists(), "the worker never started"
    store.proc.kill()
    store.finish(10)
    _, stderr = agent.communicate(timeout=90)
    assert agent.returncode == int(ExitCode.STORE_LOST), stderr[-3000:]
    assert "torchrun lost the rendezvous store" in stderr and "(retryable" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


@pytest.mark.parametrize("code", [0, 2])
def test_the_store_pod_ends_with_the_job(tmp_path: Path, code: int) -> None:
    """A store-only Master exits 0 once the agents passed torchrun's exit barrier (the PyTorchJob
    succeeds with it), or with the permanent code an agent ended the job with (so it does not outlive a
    failed job's kept pods)."""
    secret = create_job_secret(tmp_path / "secret")
    store = _StorePod("job", secret)
    agent = _agent(tmp_path, store.port, "0", str(code), env={Env.STORE_POD: "1", Env.JOB_SECRET_FILE: secret})
    _, agent_err = agent.communicate(timeout=90)
    assert agent.returncode == code, agent_err[-3000:]
    rc, err = store.finish(60)
    assert rc == code, err
    what = "passed torchrun's exit barrier" if code == 0 else f"an agent ended the job ({code})"
    assert what in err, err
