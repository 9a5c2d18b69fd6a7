"""Random valid specs compile, for every target, to objects the real CRDs (and webhooks) accept, and
raise UnsupportedFeature only where documented."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.compile import MANIFEST_TARGETS, compile, compile_plan
from orchestrator.errors import UnsupportedFeature
from orchestrator.loader import validate_document
from orchestrator.spec import JobSpec
from orchestrator.targets import target_name_limit
from tests import crds

_names = st.from_regex(r"[a-z]([-a-z0-9]{0,60}[a-z0-9])?", fullmatch=True)
_label_values = st.from_regex(r"[a-z0-9]([-a-z0-9_.]{0,20}[a-z0-9])?", fullmatch=True)
_quantities = st.sampled_from(["500m", "1", "2", "16", "1.5", "64"])
_memories = st.sampled_from(["512Mi", "4Gi", "16G", "1Ti", "1000000000"])


@st.composite
def job_documents(draw: st.DrawFn) -> dict[str, Any]:
    n_min = draw(st.integers(1, 6))
    n_max = draw(st.integers(n_min, 12))
    gpus = draw(st.sampled_from([0, 0, 1, 2, 4, 8]))
    procs = gpus if gpus else draw(st.integers(1, 4))
    strategy = draw(st.sampled_from(["ddp", "fsdp"] + (["hsdp"] if n_min >= 2 else [])))
    precision = draw(st.sampled_from(["fp32", "bf16"] + (["fp16"] if strategy == "ddp" else [])))
    # Names every target accepts, so each draw checks every target's manifests (test_naming.py checks
    # the names each target rejects).
    limit = min(target_name_limit(t, n_max, elastic=True) for t in MANIFEST_TARGETS)
    name = draw(_names.filter(lambda n: len(n) <= limit))
    stores = draw(
        st.lists(
            st.sampled_from(
                [
                    {"uri": "file://./checkpoints", "name": "local"},
                    {"uri": "s3://bucket/prefix", "name": "s3", "secretRef": "s3-credentials"},
                    {"uri": "file:///mnt/ckpt", "name": "pvc", "pvc": "claim-a"},
                    {"uri": "gs://bkt/x", "name": "gcs"},
                    {"uri": "file://./shared", "name": "rwx", "pvc": "claim-b"},
                    {"uri": "/scratch/ckpt", "name": "scratch"},
                ]
            ),
            min_size=1,
            max_size=4,
            unique_by=lambda s: s["name"],
        )
    )
    gang = draw(st.sampled_from(["none", "volcano", "kueue"]))
    kube: dict[str, Any] = {"gang": gang}
    if gang == "kueue" or draw(st.booleans()):
        kube["queue"] = draw(_label_values)
    if draw(st.booleans()):
        kube["runtimeRef"] = "torch-distributed"
    for key, strategy_ in [
        ("serviceAccount", _names),
        ("priorityClass", _names),
        (
            "nodeSelector",
            st.dictionaries(st.sampled_from(["zone", "pool", "example.com/gpu"]), _label_values, max_size=2),
        ),
        ("imagePullSecrets", st.lists(_names, max_size=2)),
        (
            "env",
            st.dictionaries(st.from_regex(r"[A-Z][A-Z0-9_]{0,10}", fullmatch=True), st.text(max_size=10), max_size=2),
        ),
        ("podLabels", st.dictionaries(st.sampled_from(["tier", "example.com/cost"]), _label_values, max_size=2)),
        ("ttlSecondsAfterFinished", st.none() | st.integers(0, 10**6)),
        ("activeDeadlineSeconds", st.integers(1, 10**6)),
        ("cleanPodPolicy", st.sampled_from(["None", "Running", "All"])),
        ("tolerations", st.just([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])),
    ]:
        if draw(st.booleans()):
            kube[key] = draw(strategy_)
    spec: dict[str, Any] = {
        "task": {"entrypoint": "training.examples.digits:task"},
        "training": {"steps": draw(st.integers(1, 10**6)), "strategy": strategy, "precision": precision},
        "nodes": {"min": n_min, "max": n_max},
        "procsPerNode": procs,
        "resources": {
            "gpus": gpus,
            "cpu": draw(_quantities),
            "memory": draw(_memories),
            "sharedMemory": draw(st.none() | _memories),
        },
        "restarts": {"max": draw(st.integers(0, 100))},
        "checkpoint": {
            "stores": stores,
            "keep": draw(st.integers(1, 10)),
            "nodeLocal": {
                "enabled": draw(st.booleans()),
                "path": draw(st.sampled_from(["/dev/shm/torchrig", "/local/ckpt"])),
            },
        },
        "metrics": {"enabled": draw(st.booleans()), "port": draw(st.integers(1024, 64000))},
        "kubernetes": kube,
    }
    return {
        "apiVersion": "torchrig/v1",
        "kind": "TrainingJob",
        "metadata": {
            "name": name,
            "namespace": draw(_names.filter(lambda n: len(n) <= 63)),
            "labels": {"team": draw(_label_values)},
        },
        "spec": spec,
    }


def expected_unsupported(spec: JobSpec, target: str, fixed_size: bool) -> bool:
    k = spec.spec.kubernetes
    stores = spec.spec.checkpoint.stores
    # Issue 13 point 7: more than one pod, and no store they share.
    if spec.spec.nodes.max > 1 and all(st.scheme == "file" and st.pvc is None for st in stores):
        return True
    if target == "trainjob":
        secrets = any(st.secret_ref for st in stores)
        return (
            (spec.spec.nodes.elastic and not fixed_size)
            or (k.gang == "volcano" and k.runtime_ref is not None)
            or (secrets and k.runtime_ref is not None)
        )
    return False


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=job_documents(), fixed_size=st.booleans())
def test_random_specs_compile_to_valid_manifests(doc: dict[str, Any], fixed_size: bool) -> None:
    spec = validate_document(doc)
    for target in MANIFEST_TARGETS:
        if expected_unsupported(spec, target, fixed_size):
            with pytest.raises(UnsupportedFeature):
                compile(spec, target, monitoring=True, fixed_size=fixed_size)
            continue
        crds.assert_valid(compile(spec, target, monitoring=True, fixed_size=fixed_size))
    plan = compile_plan(spec, "raytrain", fixed_size=fixed_size)
    assert plan.scaling.max_workers == spec.spec.max_world_size
    cmd = compile_plan(spec, "torchrun", fixed_size=fixed_size)
    assert cmd.args[0] == "torchrun"
