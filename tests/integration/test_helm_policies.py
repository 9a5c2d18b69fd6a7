"""The chart applies the compilers' safety rules with their messages (issue 13 points 7, 10, 12, 14;
issue 15 point 3): pod-local stores, inline credentials, Secrets as envFrom, the TrainJob's runtime kinds,
the hardened pod. Rendered with the real helm binary and compared with `torchrig render`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.compile import compile as compile_objects
from orchestrator.errors import CompileError, SpecError
from orchestrator.loader import load_spec
from tests.fixtures.jobs import write_job
from tests.integration.test_helm import (
    CHART,
    DIGITS,
    MONITORING,
    assert_same_objects,
    compiled,
    helm_template,
    run_helm,
)

pytestmark = [pytest.mark.helm, pytest.mark.timeout(120)]

POD_LOCAL: dict[str, Any] = {"spec": {"checkpoint": {"stores": [{"uri": "file://./checkpoints"}]}}}


def refused_alike(job: Path, target: str, *helm_args: str) -> str:
    with pytest.raises(CompileError) as info:
        compiled(job, target, fixed_size=True)
    proc = run_helm("template", "t", str(CHART), "-f", str(job), "--set", "fixedSize=true", *helm_args, check=False)
    assert proc.returncode != 0 and str(info.value) in proc.stderr, proc.stderr
    return str(info.value)


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
def test_pod_local_stores_are_refused_unless_allowed(target: str, tmp_path: Path) -> None:
    job = write_job(
        tmp_path, DIGITS, {**POD_LOCAL, "metadata": {"name": "local"}}, overrides=[f"spec.kubernetes.target={target}"]
    )
    assert refused_alike(job, target).startswith("spec.checkpoint.stores: every store is pod-local")
    allowed = helm_template("-f", str(job), "--set", "fixedSize=true,allowPodLocalStores=true")
    want = compile_objects(load_spec(job), target, fixed_size=True, allow_pod_local_stores=True)
    assert_same_objects(allowed, [yaml.safe_load(yaml.safe_dump(o)) for o in want])


@pytest.mark.parametrize(
    "options",
    [{"key": "AKIA", "secret": "x"}, {"client_kwargs": {"aws_session_token": "t", "region_name": "eu"}}],
)
def test_inline_credentials_are_refused_like_the_compiler(options: dict[str, Any], tmp_path: Path) -> None:
    stores = [{"uri": "s3://bucket/x", "options": options}]
    job = write_job(tmp_path, DIGITS, {"spec": {"checkpoint": {"stores": stores}}})
    with pytest.raises(SpecError, match=r"secretRef"):
        load_spec(job)  # torchrig's loader refuses them first (orchestrator.credentials)
    # The compiler's own rule (for a JobSpec built without the loader) and the chart's agree.
    with pytest.raises(CompileError) as info:
        compile_objects(load_spec(job, allow_inline_secrets=True), "pytorchjob", fixed_size=True)
    proc = run_helm("template", "t", str(CHART), "-f", str(job), "--set", "fixedSize=true", check=False)
    assert proc.returncode != 0 and str(info.value) in proc.stderr, proc.stderr
    assert "secretRef" in str(info.value)


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
def test_secrets_relative_claims_and_pod_local_paths_render_what_torchrig_renders(target: str, tmp_path: Path) -> None:
    stores = [
        {"uri": "file://./checkpoints", "name": "rwx", "pvc": "claim"},
        {"uri": "s3://bucket/x", "name": "s3", "secretRef": "s3-creds", "options": {"token": "anon"}},
        {"uri": "gs://bucket/y", "name": "gs", "secretRef": "s3-creds"},
        {"uri": "file:///scratch/ckpt", "name": "scratch"},
        {"uri": "/tmp/ckpt", "name": "tmp"},
    ]
    changes = {
        "spec": {
            "checkpoint": {"stores": stores, "nodeLocal": {"enabled": True, "path": "/local/copy"}},
            "metrics": {"bindAddress": "0.0.0.0"},
            "restarts": {"stepTimeoutSeconds": 61.5},
            "resources": {"ephemeralStorage": None},
            "kubernetes": {"target": target, "serviceAccount": "api-user", "automountServiceAccountToken": True},
        }
    }
    job = write_job(tmp_path, DIGITS, changes)
    assert_same_objects(
        helm_template("-f", str(job), "--set", "fixedSize=true", *MONITORING),
        compiled(job, target, monitoring=True, fixed_size=True),
    )


def test_unreachable_exporter_means_no_probes(tmp_path: Path) -> None:
    job = write_job(tmp_path, DIGITS, {"spec": {"metrics": {"bindAddress": "10.0.0.5"}}})
    objs = helm_template("-f", str(job))
    assert_same_objects(objs, compiled(job, "pytorchjob"))
    (pj,) = [o for o in objs if o["kind"] == "PyTorchJob"]
    assert "livenessProbe" not in pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("kind", ["ClusterTrainingRuntime", "TrainingRuntime"])
def test_runtime_ref_kinds_render_what_torchrig_renders(kind: str, tmp_path: Path) -> None:
    k8s = {"target": "trainjob", "gang": "none", "runtimeRef": "rt", "runtimeKind": kind}
    job = write_job(tmp_path, DIGITS, {"spec": {"kubernetes": k8s}})
    objs = helm_template("-f", str(job), "--set", "fixedSize=true")
    assert_same_objects(objs, compiled(job, "trainjob", fixed_size=True))
    secret = write_job(
        tmp_path, job, {"spec": {"checkpoint": {"stores": [{"uri": "s3://b/x", "secretRef": "c"}]}}}, name="s.yaml"
    )
    assert refused_alike(secret, "trainjob").startswith("spec.checkpoint.stores[].secretRef: ")
