"""The job's NetworkPolicy enforced by nftables in the pods harness's network namespaces (netpol_nft.py):
real TCP connections between the pods PodCluster sets up for a rendered fixed-size PyTorchJob, a pod
outside the job and a Prometheus pod of another namespace.

A pod outside the job cannot open a connection to the rendezvous/store port or to a port like gloo's;
the job's pods can; Prometheus reaches the exporter's port and nothing else.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.pods.jobs import pytorchjob_succeeded, run_job
from tests.pods.kubelet import Pod
from tests.pods.netpol_nft import enforce, nft_reason
from tests.pods.operators import pytorchjob_pods
from tests.pods.runtime import PodCluster, PodState, netns_reason
from tests.pods.scenario import render

pytestmark = [pytest.mark.pods, pytest.mark.root, pytest.mark.timeout(120)]

STORE_PORT, GLOO_PORT, METRICS_PORT = 23456, 41237, 9400
MONITORING_NS = {"monitoring": {"kubernetes.io/metadata.name": "monitoring"}}

_LISTEN = """
import socket, sys, threading
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(16)
    while True:
        c, _ = s.accept(); c.close()
for p in sys.argv[1:]:
    threading.Thread(target=serve, args=(int(p),), daemon=True).start()
print("listening", flush=True)
threading.Event().wait()
"""
_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except OSError:
    sys.exit(1)
"""


@pytest.fixture(autouse=True)
def _can_run() -> None:
    reason = netns_reason() or nft_reason()
    if reason:
        pytest.skip(reason)


def _bare_pod(name: str, namespace: str, labels: dict[str, str]) -> Pod:
    container = {"name": "c", "command": ["sleep", "3600"]}  # a pod that only holds its address
    return Pod(name=name, namespace=namespace, hostname=name, container=container, labels=labels, role=name)


@pytest.fixture
def listeners() -> Iterator[Callable[[PodState, list[int]], None]]:
    procs: list[subprocess.Popen[str]] = []

    def start(state: PodState, ports: list[int]) -> None:
        cmd = ["ip", "netns", "exec", state.netns, sys.executable, "-c", _LISTEN, *map(str, ports)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


def _connects(src: PodState, dst: PodState, port: int, timeout_s: float = 1.0) -> bool:
    cmd = ["ip", "netns", "exec", src.netns, sys.executable, "-c", _CONNECT, dst.ip, str(port), str(timeout_s)]
    return subprocess.run(cmd, capture_output=True, timeout=30, check=False).returncode == 0


def test_an_outsider_cannot_reach_the_store_or_gloo_and_the_jobs_pods_can(
    pod_cluster: Callable[[list[dict[str, Any]], list[Pod]], PodCluster],
    listeners: Callable[[PodState, list[int]], None],
) -> None:
    objs = render("pytorchjob", fixed_size=True)
    members = pytorchjob_pods(objs)
    outsider = _bare_pod("intruder", "default", {"app": "intruder"})
    prometheus = _bare_pod("prometheus-k8s-0", "monitoring", {"app.kubernetes.io/name": "prometheus"})
    cluster = pod_cluster(objs, [*members, outsider, prometheus])
    master, worker = (cluster.pods[p.name] for p in members[:2])
    intruder, prom = cluster.pods["intruder"], cluster.pods["prometheus-k8s-0"]
    ports = [STORE_PORT, GLOO_PORT, METRICS_PORT]
    listeners(master, ports)
    # Without the policy everybody gets in (so what follows is the policy's doing, not the network's).
    assert _connects(intruder, master, STORE_PORT)
    rulesets = enforce(cluster, [o for o in objs if o["kind"] == "NetworkPolicy"], MONITORING_NS)
    assert rulesets["intruder"] is None and rulesets[master.pod.name] is not None
    started = time.monotonic()
    assert _connects(worker, master, STORE_PORT) and _connects(worker, master, GLOO_PORT)
    assert not _connects(intruder, master, STORE_PORT)
    assert not _connects(intruder, master, GLOO_PORT)
    assert not _connects(intruder, master, METRICS_PORT)
    assert _connects(prom, master, METRICS_PORT)
    assert not _connects(prom, master, STORE_PORT)
    # A refused connection is a dropped SYN: the client gives up at its own timeout.
    assert time.monotonic() - started < 20


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_job_trains_under_its_own_policy(
    pod_cluster: Callable[[list[dict[str, Any]], list[Pod]], PodCluster],
) -> None:
    """The same fixed-size PyTorchJob runs to success with the policy enforced from before its first
    start: the rendezvous, gloo's ephemeral ports and the exec probes all pass it, and an outsider on the
    same network is still refused while the job runs."""
    objs = render("pytorchjob", fixed_size=True)
    job = next(o for o in objs if o["kind"] == "PyTorchJob")
    members = pytorchjob_pods(objs)
    cluster = pod_cluster(objs, [*members, _bare_pod("intruder", "default", {"app": "intruder"})])
    enforce(cluster, [o for o in objs if o["kind"] == "NetworkPolicy"])
    intruder, master = cluster.pods["intruder"], cluster.pods[members[0].name]
    refused: list[bool] = []

    def probe_once(c: PodCluster, events: list[str]) -> None:
        if not refused and c.pods[master.pod.name].proc is not None:
            refused.append(not _connects(intruder, master, STORE_PORT, timeout_s=0.5))

    outcome = run_job(
        cluster,
        pytorchjob_succeeded(job),
        timeout_s=300,
        backoff_limit=job["spec"]["runPolicy"].get("backoffLimit"),
        on_tick=probe_once,
    )
    assert outcome.status == "Succeeded", outcome
    assert {n: s.exit_codes for n, s in cluster.pods.items() if n != "intruder"} == {p.name: [0] for p in members}
    assert refused == [True]
