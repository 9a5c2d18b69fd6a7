"""A dead cluster API never hangs the CLI (issue 13.13): every Kubernetes and Ray Jobs API call has a
timeout, and an API server that accepts the connection and never answers gives one error line within
it. The "server" here is a blackhole on 127.0.0.1; `TORCHRIG_API_TIMEOUT=2` keeps the test short."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.backends.api_timeout import STREAM_READ_S, ApiTimeout, api_timeout
from orchestrator.cli import cli
from orchestrator.errors import EXIT_BACKEND, EXIT_USAGE, SpecError
from tests.fixtures.common import REPO
from tests.fixtures.k8s_fake import write_kubeconfig
from training.contract import Env

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 2.0
SLACK_S = 6.0  # start-up of the client and a loaded machine; a hang would take forever


@pytest.fixture
def blackhole_server() -> Iterator[str]:
    """A TCP server on 127.0.0.1 that accepts every connection and never sends a byte; yields host:port."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def _accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)  # read nothing, answer nothing, keep it open

    thread = threading.Thread(target=_accept, name="blackhole", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        server.close()


def _cli(*args: str, env: dict[str, str]) -> tuple[int, str, float]:
    start = time.monotonic()
    result = CliRunner().invoke(cli, list(args), env={Env.API_TIMEOUT: str(TIMEOUT_S), **env}, catch_exceptions=False)
    return result.exit_code, result.stderr, time.monotonic() - start


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [
        ["status", "kubernetes://default/pytorchjob/digits-ddp"],
        ["status", "kubernetes://default/digits-ddp"],  # tries both targets: still one timeout, not two
        ["submit", str(REPO / "examples" / "digits-ddp.yaml"), "--backend", "kubernetes"],
        ["cancel", "kubernetes://default/pytorchjob/digits-ddp"],
        ["list", "--backend", "kubernetes"],
    ],
    ids=["status", "status-any-target", "submit", "cancel", "list"],
)
def test_a_dead_kubernetes_api_server_fails_in_one_line_within_the_timeout(
    blackhole_server: str, tmp_path: Path, args: list[str]
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://{blackhole_server}")
    code, stderr, took = _cli(*args, env={"KUBECONFIG": str(kubeconfig)})
    assert code == EXIT_BACKEND, stderr
    line = _one_error_line(stderr)
    assert "cannot reach the Kubernetes API server" in line and "timed out" in line, line
    assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S + SLACK_S, f"took {took:.1f} s: {line}"


@pytest.mark.parametrize(
    "args",
    [["status", "ray://{addr}/torchrig-x-1"], ["cancel", "ray://{addr}/torchrig-x-1"], ["logs", "ray://{addr}/x"]],
    ids=["status", "cancel", "logs"],
)
def test_a_dead_ray_jobs_api_fails_in_one_line_within_the_timeout(blackhole_server: str, args: list[str]) -> None:
    code, stderr, took = _cli(*[a.format(addr=blackhole_server) for a in args], env={})
    assert code == EXIT_BACKEND, stderr
    line = _one_error_line(stderr)
    assert f"cannot reach the Ray Jobs API at http://{blackhole_server}" in line and "timed out" in line, line
    assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S + SLACK_S, f"took {took:.1f} s: {line}"


def test_api_timeout_setting() -> None:
    assert api_timeout({}) == ApiTimeout(10.0, 30.0)
    assert api_timeout({Env.API_TIMEOUT: "2"}).pair() == (2.0, 2.0)
    assert api_timeout({Env.API_TIMEOUT: " 5,120 "}) == ApiTimeout(5.0, 120.0)
    assert api_timeout({Env.API_TIMEOUT: "5,120"}).stream() == (5.0, STREAM_READ_S)
    for bad in ("0", "-1", "a", "1,2,3", "1,"):
        with pytest.raises(SpecError, match=Env.API_TIMEOUT):
            api_timeout({Env.API_TIMEOUT: bad})


def test_a_malformed_timeout_is_a_usage_error(tmp_path: Path) -> None:
    # A kubeconfig of its own: without one the CLI stops at "no usable kubeconfig" first, unless the
    # kubernetes client was imported while another test's $KUBECONFIG was set (it keeps that default).
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:9")
    env = {Env.API_TIMEOUT: "soon", "KUBECONFIG": str(kubeconfig)}
    result = CliRunner().invoke(cli, ["status", "kubernetes://default/x"], env=env, catch_exceptions=False)
    assert result.exit_code == EXIT_USAGE
    assert _one_error_line(result.stderr).startswith(f"error: {Env.API_TIMEOUT}='soon'")
