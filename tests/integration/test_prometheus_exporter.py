"""The exporter's HTTP side: promtool accepts a live exposition, busy ports fall back, create_sinks
serves on `metrics.port + local_rank` and records the real port in events.jsonl."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from tests.fixtures import jobs
from tests.fixtures.common import free_port
from tests.fixtures.prometheus import needs_promtool, populated_sink, promtool
from training.config import load_worker_spec
from training.contract import WorkerIdentity
from training.metrics import create_sinks, names
from training.metrics.prometheus import PrometheusSink


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


@pytest.mark.timeout(60)
@needs_promtool
def test_promtool_check_metrics_on_live_exposition() -> None:
    sink = populated_sink(port=0)
    try:
        assert sink.url is not None and sink.url.startswith("http://127.0.0.1:")
        text = fetch(sink.url)
    finally:
        sink.close()
    assert names.GPU_UTILIZATION in text and names.STEP_DURATION + "_bucket" in text
    result = promtool("check", "metrics", stdin=text)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr


@pytest.mark.timeout(60)
def test_busy_port_falls_back_and_reports_the_real_port(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        info = WorkerIdentity(job="j", rank=0, local_rank=0, node_rank=0, world_size=2, local_world_size=2)
        sink = PrometheusSink(info, port=taken, bind_address="127.0.0.1")
        try:
            assert sink.port is not None and sink.port != taken
            text = fetch(f"http://127.0.0.1:{sink.port}/metrics")
            assert f'port="{sink.port}"' in text
            assert "unavailable" in caplog.text
        finally:
            sink.close()
    # closed: the port is released (SO_REUSEADDR: the scrape's connection may linger in TIME_WAIT)
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", sink.port))


@pytest.mark.timeout(60)
def test_create_sinks_serves_on_port_plus_local_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHRIG_METRICS_BIND", "127.0.0.1")
    base = free_port()
    spec = load_worker_spec(
        f"""
metadata: {{name: demo}}
spec:
  task: {{entrypoint: "training.examples.digits:task"}}
  training: {{steps: 10}}
  checkpoint: {{every: {{steps: 5}}, stores: [{{uri: "file://./ckpt", name: local}}]}}
  metrics: {{port: {base}, logEvery: 2}}
"""
    )
    info = WorkerIdentity(job="demo", rank=1, local_rank=1, node_rank=0, world_size=2, local_world_size=2,
                          generation=0, run_dir=str(tmp_path), node="h")  # fmt: skip
    sink = create_sinks(spec, info)
    try:
        (exporter,) = [s for s in sink.sinks if isinstance(s, PrometheusSink)]
        assert exporter.port is not None
        if exporter.port != base + 1:  # the neighbour port was taken by another test run meanwhile
            assert exporter.port != base
        text = fetch(f"http://127.0.0.1:{exporter.port}/metrics")
        assert 'torchrig_store_failures_total{node="h",rank="1",store="local",training_job="demo"} 0.0' in text
        assert 'torchrig_checkpoint_interval_steps{node="h",rank="1",training_job="demo"} 5.0' in text
        assert "torchrig_gpu_available" in text
    finally:
        sink.close()
    events = jobs.events(tmp_path)
    (exp,) = [e for e in events if e["event"] == "metrics_exporter"]
    assert exp["port"] == exporter.port and exp["rank"] == 1
