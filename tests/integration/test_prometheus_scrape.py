"""A real Prometheus scrapes real exporters.

(a) two OS processes, each a rank running `PrometheusSink` with a synthetic training loop;
(b) the real job: `torch.distributed.run --nproc-per-node 2 -m training` (skipped until the worker's
    entry point exists).
Assertions go through Prometheus' HTTP API, as a dashboard or an alert would see the data.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.common import REPO, free_port
from tests.fixtures.prometheus import PrometheusServer

pytestmark = pytest.mark.prometheus


def synthetic_rank(rank: int, world_size: int, ports: Any, stop: Any) -> None:
    """One rank: a PrometheusSink on an ephemeral port and a 20 steps/s loop until `stop` is set."""
    from training.contract import WorkerIdentity
    from training.metrics.base import CheckpointRecord, StepRecord
    from training.metrics.prometheus import PrometheusSink

    info = WorkerIdentity(job="synthetic", rank=rank, local_rank=rank, node_rank=0, world_size=world_size,
                          local_world_size=world_size, generation=0, node="localhost")  # fmt: skip
    sink = PrometheusSink(info, port=0, bind_address="127.0.0.1", stores=["local"], checkpoint_every_steps=10)
    sink.on_start(info)
    ports.put((rank, sink.port))
    step = 0
    while not stop.is_set() and step < 10_000:
        step += 1
        time.sleep(0.05)
        sink.on_step(StepRecord(step=step, loss=1.0 / step, samples=16, tokens=0, step_s=0.05, data_wait_s=0.001,
                                comm_s=0.01, world_size=world_size, lr=1e-3, time=time.time()))  # fmt: skip
        if step % 10 == 0:
            now = time.time()
            sink.on_checkpoint(CheckpointRecord(step=step, blocked_s=0.01, time=now))
            sink.on_checkpoint(CheckpointRecord(step=step, blocked_s=0.01, save_s=0.1, committed=True, time=now))
    sink.close()


def by_rank(result: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"]["rank"]: float(r["value"][1]) for r in result}


@pytest.mark.timeout(120)
def test_two_rank_processes_scraped(prometheus_server: PrometheusServer) -> None:
    ctx = multiprocessing.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=synthetic_rank, args=(r, 2, ports, stop), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(ports.get(timeout=60) for _ in procs)
        prometheus_server.set_targets([f"127.0.0.1:{got[r]}" for r in (0, 1)])
        sel = '{training_job="synthetic"}'

        up = prometheus_server.wait_for(
            'up{job="torchrig"}', lambda r: len(r) == 2 and all(x["value"][1] == "1" for x in r)
        )
        assert len(up) == 2
        rates = prometheus_server.wait_for(
            f"rate(torchrig_samples_total{sel}[5s])", lambda r: len(r) == 2 and all(float(x["value"][1]) > 0 for x in r)
        )
        # 16 samples per 50 ms step (+ loop overhead): a few hundred samples/s per rank
        assert all(50 < v < 400 for v in by_rank(rates).values()), rates
        assert set(by_rank(rates)) == {"0", "1"}

        steps = by_rank(prometheus_server.query(f"torchrig_step{sel}"))
        assert set(steps) == {"0", "1"} and all(v > 0 for v in steps.values())
        assert by_rank(prometheus_server.query(f"torchrig_world_size{sel}")) == {"0": 2.0, "1": 2.0}
        ckpt = prometheus_server.wait_for(f"torchrig_checkpoint_last_step{sel} > 0", lambda r: len(r) == 2)
        assert all(v % 10 == 0 for v in by_rank(ckpt).values())
        age = prometheus_server.query(f"time() - max(torchrig_checkpoint_last_timestamp_seconds{sel})")
        assert 0 <= float(age[0]["value"][1]) < 30
        failures = by_rank(
            prometheus_server.query('torchrig_store_failures_total{training_job="synthetic",store="local"}')
        )
        assert failures == {"0": 0.0, "1": 0.0}
        # the job-level view the dashboard and alerts use
        total = prometheus_server.query(f"sum(torchrig_samples_per_second{sel})")
        assert float(total[0]["value"][1]) == pytest.approx(640.0, rel=0.05)
        quantile = prometheus_server.query(
            f"histogram_quantile(0.5, sum by (le) (rate(torchrig_step_duration_seconds_bucket{sel}[5s])))"
        )
        assert 0.025 <= float(quantile[0]["value"][1]) <= 0.05
        # the alert rules are loaded and evaluate without errors against live data
        rules = prometheus_server.api("rules")
        loaded = [r for g in rules["groups"] for r in g["rules"]]
        assert len(loaded) >= 7 and all(r["health"] == "ok" for r in loaded), loaded
        firing = prometheus_server.query('ALERTS{alertstate="firing"}')
        assert firing == [], firing
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


WORKER_MAIN = REPO / "training" / "__main__.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not WORKER_MAIN.exists(), reason="the worker entry point (python -m training) does not exist yet")
def test_real_two_rank_job_scraped(prometheus_server: PrometheusServer, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = run_dir / "job.yaml"
    spec.write_text(
        f"""
apiVersion: torchrig/v1
kind: TrainingJob
metadata: {{name: scrape-demo}}
spec:
  task: {{entrypoint: "training.examples.digits:task", args: {{hidden: 64}}}}
  training: {{steps: 400, batchSize: 16}}
  checkpoint: {{every: {{steps: 50}}, stores: [{{uri: "file://./checkpoints", name: local}}]}}
  metrics: {{port: {free_port()}, logEvery: 10}}
"""
    )
    env = {
        **os.environ,
        "TORCHRIG_RUN_DIR": str(run_dir),
        "TORCHRIG_SPEC": str(spec),
        "TORCHRIG_METRICS_BIND": "127.0.0.1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
        # Pace every rank (20 ms per step, ~8 s in all): a 400-step digits run otherwise finishes in about
        # a second, before Prometheus (1 s interval) has the two scrapes `rate()` needs.
        "TORCHRIG_FAULTS": json.dumps([{"kind": "slow", "rank": -1, "step": 1, "generation": -1, "seconds": 0.02}]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(tmp_path / "torchrun-logs"), "-m", "training", "--spec", str(spec)]  # fmt: skip
    log = (tmp_path / "job.log").open("wb")
    job = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # the exporters' real ports come from the `metrics_exporter` events
        events_file = run_dir / "events.jsonl"
        deadline = time.monotonic() + 120
        ports: dict[int, int] = {}
        while len(ports) < 2 and time.monotonic() < deadline and job.poll() is None:
            if events_file.exists():
                for line in events_file.read_text().splitlines():
                    event = json.loads(line)
                    if event["event"] == "metrics_exporter":
                        ports[event["rank"]] = event["port"]
            time.sleep(0.2)
        assert len(ports) == 2, (tmp_path / "job.log").read_text()[-3000:]
        prometheus_server.set_targets([f"127.0.0.1:{p}" for p in ports.values()])
        sel = '{training_job="scrape-demo"}'
        # max_over_time: the job may finish (and its series go stale) before the assertions run
        rates = prometheus_server.wait_for(
            f"max_over_time(rate(torchrig_samples_total{sel}[3s])[2m:1s])",
            lambda r: len(r) == 2 and all(float(x["value"][1]) > 0 for x in r),
            timeout_s=120,
        )
        assert set(by_rank(rates)) == {"0", "1"}
        sizes = by_rank(prometheus_server.query(f"max_over_time(torchrig_world_size{sel}[2m])"))
        assert sizes == {"0": 2.0, "1": 2.0}
        steps = by_rank(prometheus_server.query(f"max_over_time(torchrig_step{sel}[2m])"))
        assert all(v > 0 for v in steps.values())
        assert job.wait(timeout=240) == 0, (tmp_path / "job.log").read_text()[-3000:]
        ckpt = by_rank(prometheus_server.query(f"max_over_time(torchrig_checkpoint_last_step{sel}[5m])"))
        assert ckpt and all(v >= 50 for v in ckpt.values()), ckpt
        metrics_lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        assert json.loads(metrics_lines[-1])["world_size"] == 2
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait(timeout=10)
        log.close()
