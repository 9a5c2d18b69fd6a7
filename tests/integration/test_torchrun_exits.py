"""torchrig's torchrun (`python -m training.torchrun`, and the local backend's agent): a worker's permanent
exit (a setting or spec to fix) ends the run at once with that code, a retryable one spends the restarts.

Real torchrun agents with `--max-restarts 3` over a worker that records each start and exits with a given
code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
