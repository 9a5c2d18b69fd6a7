"""The launcher bounds a PyTorchJob pod's recreations (issue 40 point 5), run as the operator runs it.

Each start is `python -m training.launch ... -- <command>` in a UTS namespace whose hostname is the
operator's pod name (`<job>-worker-0`; kubeflow/training-operator v1.9.4 `common/util.go`
`GenGeneralName`, no `spec.hostname`) with the operator's `MASTER_ADDR` (`pytorch/master.go`), over a
`file://` store on a shared directory standing for the job's PVC. The command exits 137 as an OOM-killed
container would; the operator recreates the pod after every exit >= 128 (`common/pod.go`
`ReconcilePods`, `tests/pods/operators.py` `operator_action`) and its `backoffLimit` never stops it
(`common/job.go` `ReconcileJobs`, `core/job.go` `PastBackoffLimit`; see tests/unit/test_pod_recreations.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training.contract import ExitCode, is_retryable
from training.pod_recreations import RECREATIONS_DIR

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare for a pod's hostname"
    ),
]

JOB = "job"


def job_file(tmp_path: Path, restarts_max: int) -> Path:
    path = tmp_path / "job.yaml"
    doc = {
        "apiVersion": "torchrig/v1",
        "kind": "TrainingJob",
        "metadata": {"name": JOB},
        "spec": {
            "task": {"entrypoint": "training.examples.digits:task", "args": {"hidden": 8}},
            "training": {"steps": 1},
            "restarts": {"max": restarts_max},
            "checkpoint": {"stores": [{"uri": "file://./checkpoints", "pvc": "claim"}]},
        },
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def start_pod(tmp_path: Path, spec: Path, pod: str, exit_code: int) -> subprocess.CompletedProcess[str]:
    """One start of pod `pod` whose container ends with `exit_code` once the launcher lets it run."""
    launch = [sys.executable, "-m", "training.launch", "--spec", str(spec), "--run-dir", str(tmp_path / "run")]
    command = [*launch, "--", "sh", "-c", f"exit {exit_code}"]
    script = 'hostname "$1" && shift && exec "$@"'
    env = {**os.environ, "MASTER_ADDR": f"{JOB}-master-0", "MASTER_PORT": "23456"}
    return subprocess.run(
        ["unshare", "--uts", "sh", "-c", script, "pod", pod, *command],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_pod_oom_killed_at_every_start_fails_the_job_after_restarts_max_recreations(tmp_path: Path) -> None:
    spec = job_file(tmp_path, restarts_max=1)
    codes: list[int] = []
    while len(codes) < 10:  # the operator: recreate on >= 128, stop on anything else
        done = start_pod(tmp_path, spec, f"{JOB}-worker-0", 137)
        codes.append(done.returncode)
        if not is_retryable(done.returncode):
            break
    assert codes == [137, 137, int(ExitCode.RESTARTS_SPENT)], done.stderr
    assert done.stderr.splitlines() == [
        f"torchrig: error: spec.restarts.max: pod {JOB}-worker-0 has been recreated 2 times and restarts.max allows 1 "
        "(the PyTorchJob operator recreates a pod after every exit code >= 128 and counts none of them, "
        f"runPolicy.backoffLimit included), so job '{JOB}' fails here: find the cause in the earlier exits "
        f"(kubectl describe pytorchjob {JOB}), then resubmit it (its count starts again from 0) or raise "
        "spec.restarts.max"
    ]
    # The job ended: its count went with it, and the same job submitted again runs (and counts) from 0.
    assert not (tmp_path / "run" / "checkpoints" / RECREATIONS_DIR / JOB).exists()
    assert start_pod(tmp_path, spec, f"{JOB}-worker-0", 137).returncode == 137


def test_outside_a_pytorchjob_pod_nothing_is_counted(tmp_path: Path) -> None:
    spec = job_file(tmp_path, restarts_max=0)
    # A TrainJob pod's hostname (`<job>-node-0-0`): its JobSet counts the restarts.
    codes = [start_pod(tmp_path, spec, f"{JOB}-node-0-0", 137).returncode for _ in range(2)]
    assert codes == [137, 137]
    assert not (tmp_path / "run" / "checkpoints" / RECREATIONS_DIR).exists()
