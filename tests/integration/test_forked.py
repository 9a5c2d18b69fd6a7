"""Start-up shortcuts of a local run: forked trainers/spares, the fast exit, the agent's port file.

Each case runs in a fresh interpreter (a fork from a pytest worker would carry its threads and atexit
handlers into the child).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from orchestrator.backends._local_agent import read_port

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_a_forked_trainer_runs_python_m_training_and_reports_its_exit_status(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    fifo = tmp_path / "job.fifo"
    os.mkfifo(fifo)  # opening it to read the job blocks until a writer comes: a trainer that hangs
    out = _python(
        f"""
        import os, signal, sys
        from training.inplace import forked
        forked.remember_signal_handlers([signal.SIGTERM])
        signal.signal(signal.SIGTERM, lambda *a: None)  # the host's forwarder; the child gets the original back
        cmd = [sys.executable, "-m", "training", "--spec", {str(missing)!r}]
        child = forked.start(cmd, ["--spec", {str(missing)!r}], {{"TORCHRIG_INPLACE_ROLE": "trainer"}})
        assert isinstance(child, forked.Process), type(child)
        print("usage error", child.wait(30), flush=True)
        assert "TORCHRIG_INPLACE_ROLE" not in os.environ, "the child's environment stays in the child"
        hung = forked.start(cmd, ["--spec", {str(fifo)!r}], {{}})  # blocks opening the fifo...
        hung.send_signal(signal.SIGTERM)  # ...until the default SIGTERM ends it
        print("terminated", hung.wait(30), flush=True)
        print("host still here", flush=True)
        """
    )
    assert out.returncode == 0, out.stderr
    assert "usage error 2" in out.stdout, "exit 2: the trainer's own status for a missing job file"
    assert f"torchrig: error: {missing}" in out.stderr
    assert "terminated -15" in out.stdout, "a signal death reads as Popen's -N"
    assert out.stdout.strip().endswith("host still here"), "the child never returns into the host's code"


def test_no_fork_once_cuda_is_initialised_in_the_host() -> None:
    out = _python(
        """
        import sys, types
        from training.inplace import forked
        sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
        print(forked.can_fork())
        """
    )
    assert out.stdout.strip() == "False", out.stderr


def test_exit_now_finishes_threads_and_atexit_handlers_then_exits_with_the_code() -> None:
    out = _python(
        """
        import atexit, threading, time
        from training.fastexit import exit_now
        atexit.register(lambda: print("atexit ran", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print("upload finished", flush=True))).start()
        print("buffered line without a flush")
        exit_now(3)
        """
    )
    assert out.returncode == 3
    assert out.stdout.splitlines() == ["buffered line without a flush", "upload finished", "atexit ran"]


def test_the_agent_reads_the_store_port_once_written(tmp_path: Path) -> None:
    port_file = tmp_path / ".store-port"
    assert read_port(str(port_file), timeout_s=0) is None
    port_file.write_text("")  # being written: not a port yet
    assert read_port(str(port_file), timeout_s=0.05) is None
    port_file.write_text("41899")
    assert read_port(str(port_file), timeout_s=0) == 41899
