"""A null that means something (`gradClip: null`: no clipping) through the Helm chart, with the real helm.

Helm deletes a key that the user's values set to null from the chart's values.yaml, so the templates see no
key at all; the chart's shape (`nulls` in templates/_model.tpl) says which missing keys are such a null, and
the job file the pods mount must carry it, as `torchrig render` does, or the workers read the default back.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.loader import dump_spec, load_spec
from tests.fixtures.jobs import write_job
from training.config import load_worker_spec

pytestmark = [pytest.mark.helm, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "torchrig"
DIGITS = REPO / "examples" / "digits-ddp.yaml"
HELM = shutil.which("helm", path=str(REPO / ".venv" / "bin")) or shutil.which("helm")
if HELM is None:  # pragma: no cover - `make tools` installs it
    pytest.skip("helm not installed (make tools)", allow_module_level=True)

NULLS = {
    "spec": {
        "training": {"gradClip": None},
        "resources": {"sharedMemory": None, "ephemeralStorage": None},
        "kubernetes": {"ttlSecondsAfterFinished": None},
    }
}


def render(*args: str) -> dict[str, dict[str, Any]]:
    proc = subprocess.run(
        [str(HELM), "template", "t", str(CHART), *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return {d["kind"]: d for d in yaml.safe_load_all(proc.stdout) if d is not None and d["kind"] != "Secret"}


def job_text(objs: dict[str, dict[str, Any]]) -> str:
    text = objs["ConfigMap"]["data"]["job.yaml"]
    assert isinstance(text, str)
    return text


def test_a_users_nulls_reach_the_job_file_and_the_pods(tmp_path: Path) -> None:
    job = write_job(tmp_path, DIGITS, NULLS)
    objs = render("-f", str(job))
    text = job_text(objs)
    assert yaml.safe_load(text) == yaml.safe_load(dump_spec(load_spec(job)))  # what `torchrig render` mounts
    assert load_worker_spec(text).spec.training.grad_clip is None  # the trainer does not clip
    spec = yaml.safe_load(text)["spec"]
    assert spec["resources"]["sharedMemory"] is None and spec["resources"]["ephemeralStorage"] is None
    assert spec["kubernetes"]["ttlSecondsAfterFinished"] is None
    pytorchjob = objs["PyTorchJob"]["spec"]
    assert "ttlSecondsAfterFinished" not in pytorchjob["runPolicy"]  # kept, not deleted after a day
    for replicas in pytorchjob["pytorchReplicaSpecs"].values():
        pod = replicas["template"]["spec"]
        assert "dshm" not in [v["name"] for v in pod["volumes"]]
        assert "ephemeral-storage" not in pod["containers"][0]["resources"]["requests"]


def test_set_null_on_the_command_line_is_the_same_null(tmp_path: Path) -> None:
    objs = render("-f", str(DIGITS), "--set", "spec.training.gradClip=null")
    assert load_worker_spec(job_text(objs)).spec.training.grad_clip is None


def test_a_key_the_user_leaves_out_keeps_its_default() -> None:
    objs = render("-f", str(DIGITS))
    spec = yaml.safe_load(job_text(objs))["spec"]
    assert spec["training"]["gradClip"] == 1.0 and spec["resources"]["sharedMemory"] == "1Gi"
    assert objs["PyTorchJob"]["spec"]["runPolicy"]["ttlSecondsAfterFinished"] == 86400
