"""`torchrig drill kill-worker --backend kubernetes` against the fake API server.

A test thread plays the operator: the job goes Running, the drill deletes a worker pod through the API,
the 'operator' recreates the pod (new uid) whose logs show the restore, and the job succeeds.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from orchestrator.backends.kubernetes import JOB_LABEL, KubernetesBackend
from orchestrator.drills.kubernetes import run_kubernetes_kill_worker
from orchestrator.loader import load_spec
from tests.fixtures.common import REPO
from tests.fixtures.k8s_fake import FakeKubeAPI

pytestmark = pytest.mark.timeout(60)


def _worker_pod(fake: FakeKubeAPI, index: int, uid: str, log: str) -> None:
    labels = {
        JOB_LABEL: "digits-ddp",
        "training.kubeflow.org/replica-type": "worker",
        "training.kubeflow.org/replica-index": str(index),
    }
    fake.add_pod("default", f"digits-ddp-worker-{index}", labels, log)
    pod = fake.objects[("", "v1", "pods", "default", f"digits-ddp-worker-{index}")]
    pod["metadata"]["uid"] = uid
    pod["status"] = {"phase": "Running"}


def _set_conditions(fake: FakeKubeAPI, *types: str) -> None:
    job = fake.objects[("kubeflow.org", "v1", "pytorchjobs", "default", "digits-ddp")]
    job["status"] = {"conditions": [{"type": t, "status": "True"} for t in types]}


def _operator(fake: FakeKubeAPI, outcome: str, stop: threading.Event) -> None:
    """Run the job, then recreate a deleted worker pod and finish the job with `outcome`."""
    key = ("kubeflow.org", "v1", "pytorchjobs", "default", "digits-ddp")
    while key not in fake.objects and not stop.is_set():
        time.sleep(0.02)
    for i in (0, 1):
        _worker_pod(fake, i, f"uid-{i}", "torchrig: step 20/300\n")
    _set_conditions(fake, "Created", "Running")
    while not fake.sent("DELETE") and not stop.is_set():
        time.sleep(0.02)
    deleted = fake.sent("DELETE")[0].path.rsplit("/", 1)[-1]
    index = int(deleted.rsplit("-", 1)[-1])
    time.sleep(0.3)
    log = "INFO training.checkpoint.manager: restored step 150 from s3 (s3://b/p/step-00000150) in 0.4 s\n"
    _worker_pod(fake, index, f"uid-new-{index}", log)
    time.sleep(0.2)
    _set_conditions(fake, "Created", "Running", outcome)


@pytest.mark.parametrize(("outcome", "passes"), [("Succeeded", True), ("Failed", False)])
def test_kill_worker_on_kubernetes_deletes_a_pod_and_judges_the_recovery(
    k8s_kubeconfig: Path, k8s_fake_server: FakeKubeAPI, outcome: str, passes: bool
) -> None:
    spec = load_spec(REPO / "examples" / "digits-ddp.yaml")
    stop = threading.Event()
    operator = threading.Thread(target=_operator, args=(k8s_fake_server, outcome, stop), daemon=True)
    operator.start()
    try:
        report = run_kubernetes_kill_worker(
            spec, seed=3, timeout_s=30, poll_s=0.05, backend=KubernetesBackend(kubeconfig=str(k8s_kubeconfig))
        )
    finally:
        stop.set()
        operator.join(5)
    deletes = k8s_fake_server.sent("DELETE")
    assert len(deletes) == 1 and "/pods/digits-ddp-worker-" in deletes[0].path
    assert report.passed is passes, report.to_dict()
    assert report.mttr_seconds is not None and report.mttr_seconds > 0
    assert report.resumed_from_step == 150
    assert report.restored_from == [{"store": "s3", "step": 150, "source": "store"}]
    names = [e["event"] for e in report.events]
    assert names[:3] == ["submitted", "running", "fault_injected"]


def test_kubernetes_drill_reports_a_job_that_never_runs(k8s_kubeconfig: Path, k8s_fake_server: FakeKubeAPI) -> None:
    spec = load_spec(REPO / "examples" / "digits-ddp.yaml")
    report = run_kubernetes_kill_worker(
        spec, timeout_s=0.5, poll_s=0.05, backend=KubernetesBackend(kubeconfig=str(k8s_kubeconfig))
    )
    assert not report.passed
    assert not k8s_fake_server.sent("DELETE"), "nothing is deleted before the job runs"
    assert any(c.name == "job running before the fault" and not c.passed for c in report.checks)
