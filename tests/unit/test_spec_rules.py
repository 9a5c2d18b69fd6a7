"""Every validation rule of the job model: one test each, asserting the exact `path: message` line."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from orchestrator.errors import SpecError
from orchestrator.loader import apply_overrides, validate_document
from orchestrator.naming import MAX_NAME_LEN
from orchestrator.spec import JobSpec

BASE: dict[str, Any] = {
    "apiVersion": "torchrig/v1",
    "kind": "TrainingJob",
    "metadata": {"name": "t"},
    "spec": {"task": {"entrypoint": "training.examples.digits:task"}, "training": {"steps": 10}},
}


def problems(*overrides: str) -> list[str]:
    try:
        validate_document(apply_overrides(copy.deepcopy(BASE), list(overrides)))
    except SpecError as exc:
        return exc.problems
    return []


def spec_of(*overrides: str) -> JobSpec:
    return validate_document(apply_overrides(copy.deepcopy(BASE), list(overrides)))


def test_minimal_document_is_valid() -> None:
    assert problems() == []


def test_nodes_max_below_min() -> None:
    assert problems("spec.nodes.min=3", "spec.nodes.max=2") == ["spec.nodes.max: must be >= spec.nodes.min (3)"]


def test_procs_per_node_must_match_gpus() -> None:
    assert problems("spec.resources.gpus=2", "spec.procsPerNode=1") == [
        "spec.procsPerNode: must equal spec.resources.gpus (2): one process per GPU"
    ]


def test_hsdp_needs_two_nodes() -> None:
    assert problems("spec.training.strategy=hsdp") == [
        "spec.training.strategy: hsdp shards within a node and replicates across nodes, so it needs "
        "spec.nodes.min >= 2 (use fsdp on one node)"
    ]


def test_fp16_needs_ddp() -> None:
    assert problems("spec.training.precision=fp16", "spec.training.strategy=fsdp") == [
        "spec.training.precision: fp16 needs a gradient scaler, supported with strategy ddp only; "
        "use bf16 with fsdp/hsdp"
    ]


@pytest.mark.parametrize("max_nodes", [1, 3, 100])
def test_name_is_at_most_63_characters_whatever_the_node_count(max_nodes: int) -> None:
    # The job model's only length rule; each Kubernetes target's own limit applies when compiling to it.
    nodes = [f"spec.nodes.max={max_nodes}"]
    assert MAX_NAME_LEN == 63
    assert problems(f"metadata.name={'a' * 63}", *nodes) == []
    assert problems(f"metadata.name={'a' * 64}", *nodes) == [
        "metadata.name: must be a DNS-1035 label of at most 63 characters (got 64)"
    ]


def test_name_must_be_dns1035() -> None:
    assert problems("metadata.name=Foo") == [
        "metadata.name: must be a DNS-1035 label: lowercase letters, digits and '-', starting with a letter "
        "and ending with a letter or digit"
    ]


def test_namespace_must_be_dns1123() -> None:
    assert problems("metadata.namespace=Team_A") == [
        "metadata.namespace: must be a DNS-1123 label of at most 63 characters"
    ]


def test_label_keys_validated() -> None:
    assert problems("metadata.labels={'a b': c}") == [
        "metadata.labels: label key 'a b' is not a valid Kubernetes label key"
    ]


def test_pvc_needs_a_file_uri() -> None:
    assert problems("spec.checkpoint.stores=[{uri: 's3://b/x', pvc: c}]") == [
        "spec.checkpoint.stores[0].pvc: needs a `file://` uri (the mount path; a relative one is under the run "
        "directory)"
    ]


def test_pvc_may_hold_a_relative_store() -> None:
    # Issue 13 point 7: the run directory's own store can be shared, mounted at the same place on every pod.
    store = spec_of("spec.checkpoint.stores=[{uri: 'file://./checkpoints', pvc: claim}]").spec.checkpoint.stores[0]
    assert (store.pvc, store.path) == ("claim", "./checkpoints")


def test_automount_needs_a_service_account() -> None:
    assert problems("spec.kubernetes.automountServiceAccountToken=true") == [
        "spec.kubernetes.automountServiceAccountToken: needs spec.kubernetes.serviceAccount, a dedicated account "
        "with only the RBAC the task needs (the namespace's default account is never mounted)"
    ]
    assert not problems("spec.kubernetes.automountServiceAccountToken=true", "spec.kubernetes.serviceAccount=sa")


def test_ephemeral_storage_is_a_quantity() -> None:
    assert problems("spec.resources.ephemeralStorage=10GB") == [
        "spec.resources.ephemeralStorage: '10GB' is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)"
    ]
    assert spec_of("spec.resources.ephemeralStorage=null").spec.resources.ephemeral_storage is None


def test_store_names_unique() -> None:
    assert problems("spec.checkpoint.stores=[{uri: 'file:///a', name: x}, {uri: 's3://b', name: x}]") == [
        "spec.checkpoint.stores: two stores share the name 'x'; give them distinct `name`s"
    ]


def test_store_scheme_supported() -> None:
    assert problems("spec.checkpoint.stores=[{uri: 'ftp://x'}]") == [
        "spec.checkpoint.stores[0].uri: unsupported scheme 'ftp'; use one of: file, s3, gs, gcs, az, abfs, memory"
    ]


def test_kueue_needs_queue() -> None:
    assert problems("spec.kubernetes.gang=kueue") == [
        "spec.kubernetes.queue: required with gang kueue (the name of the Kueue LocalQueue)"
    ]


def test_profile_window_must_fall_inside_the_job() -> None:
    # BASE: 1 node x 1 process, 10 steps.
    assert problems("spec.metrics.profile.startStep=3", "spec.metrics.profile.ranks=[0,2,1]") == [
        "spec.metrics.profile.ranks: [1, 2] outside the job's 1 ranks (0..0): such a rank never runs, so it "
        "would never profile"
    ]
    assert problems("spec.metrics.profile.startStep=11") == [
        "spec.metrics.profile.startStep: must be <= spec.training.steps (10), or nothing is captured"
    ]
    assert problems("spec.metrics.profile.startStep=0") == [
        "spec.metrics.profile.startStep: Input should be greater than or equal to 1"
    ]
    # An elastic job's ranks are those of its largest size.
    assert problems("spec.nodes.max=2", "spec.procsPerNode=2", "spec.metrics.profile={startStep: 2, ranks: [3]}") == []


def test_checkpoint_every_needs_a_trigger() -> None:
    assert problems("spec.checkpoint.every={}") == ["spec.checkpoint.every: set steps, seconds, or both"]


def test_entrypoint_shape() -> None:
    assert problems("spec.task.entrypoint=foo") == [
        "spec.task.entrypoint: must be an import path of the form `package.module:callable`"
    ]


def test_whole_gpus() -> None:
    assert problems("spec.resources.gpus=1.5") == ["spec.resources.gpus: must be a whole number of GPUs"]


def test_quantities_validated() -> None:
    assert problems("spec.resources.memory=4GB") == [
        "spec.resources.memory: '4GB' is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)"
    ]


def test_betas_range() -> None:
    assert problems("spec.training.optimizer.betas=[0.9, 1.5]") == [
        "spec.training.optimizer.betas: each beta must be in [0, 1)"
    ]


def test_unknown_field_named_with_a_suggestion() -> None:
    assert problems("spec.trainig={}") == ["spec.trainig: unknown field; did you mean 'training'?"]
    assert problems("spec.training.stratgy=ddp") == ["spec.training.stratgy: unknown field; did you mean 'strategy'?"]
    assert "spec.checkpoint.stores[0].urii: unknown field; did you mean 'uri'?" in problems(
        "spec.checkpoint.stores[0].urii=x"
    )
    assert problems("spec.nodes.Min=1") == ["spec.nodes.Min: unknown field; did you mean 'min'?"]


def test_unknown_field_without_a_close_match_lists_the_valid_keys() -> None:
    assert problems("spec.training.optimizer.zzzz=1") == [
        "spec.training.optimizer.zzzz: unknown field; valid keys here: betas, lr, momentum, name, weightDecay"
    ]


def test_missing_field_named() -> None:
    assert problems("spec.training={}") == ["spec.training.steps: required field is missing"]


def test_every_problem_reported_at_once() -> None:
    assert len(problems("metadata.name=Foo", "spec.trainig={}", "spec.training.steps=0")) == 3


@pytest.mark.parametrize(
    ("overrides", "warning"),
    [
        (
            ["spec.checkpoint.nodeLocal.enabled=true"],
            "spec.checkpoint.nodeLocal.replicateToPeer: has no effect with one node (no peer)",
        ),
        (
            ["spec.training.lrSchedule.baseWorldSize=4"],
            "spec.training.lrSchedule.baseWorldSize: has no effect while scaleWithWorldSize is none",
        ),
        (
            ["spec.kubernetes.target=trainjob", "spec.kubernetes.queue=q"],
            "spec.kubernetes.queue: TrainJob uses it as the Kueue queue label only",
        ),
        (
            ["spec.training.precision=fp16"],
            "spec.training.precision: fp16 on CPU runs slowly and is emulated; prefer bf16 or fp32",
        ),
        (
            ["spec.training.lrSchedule.minLrRatio=0.1"],
            "spec.training.lrSchedule.minLrRatio: has no effect with decay constant",
        ),
        (
            ["spec.kubernetes.runtimeKind=TrainingRuntime"],
            "spec.kubernetes.runtimeKind: has no effect without runtimeRef",
        ),
        (
            ["spec.checkpoint.stores=[{uri: 's3://a/x', secretRef: a}, {uri: 's3://b/y', secretRef: b}]"],
            "spec.checkpoint.stores[1].secretRef: stores[0] is also s3:// with another Secret; both become the "
            "pods' environment, so a key both hold takes one value",
        ),
        (
            ["spec.checkpoint.stores=[{uri: 'gs://a/x', secretRef: a}, {uri: 'gcs://b/y', secretRef: b}]"],
            "spec.checkpoint.stores[1].secretRef: stores[0] is also gs:// with another Secret; both become the "
            "pods' environment, so a key both hold takes one value",
        ),
        (
            ["spec.checkpoint.inMemory.every=5"],
            "spec.checkpoint.inMemory.every: has no effect with strategy ddp (every rank holds the whole state; "
            "a survivor hands it over)",
        ),
        (
            ["spec.training.strategy=fsdp", "spec.checkpoint.inMemory.every=5", "spec.restarts.mode=restart"],
            "spec.checkpoint.inMemory.every: has no effect without in-place recovery (restarts.mode restart or "
            "restarts.spares 0)",
        ),
    ],
)
def test_warnings_for_options_without_effect(overrides: list[str], warning: str) -> None:
    assert spec_of(*overrides).warnings() == [warning]


def test_no_warnings_by_default() -> None:
    assert spec_of().warnings() == []
    # FSDP on one node with replicas: the setting is what makes it recover in place; HSDP on several
    # nodes too (in-place recovery spans nodes over the c10d rendezvous).
    assert spec_of("spec.training.strategy=fsdp", "spec.checkpoint.inMemory.every=5").warnings() == []
    hsdp = ("spec.training.strategy=hsdp", "spec.nodes.min=2", "spec.nodes.max=2", "spec.checkpoint.inMemory.every=5")
    assert spec_of(*hsdp).warnings() == []
    assert problems("spec.checkpoint.inMemory.every=0") == [
        "spec.checkpoint.inMemory.every: Input should be greater than or equal to 1"
    ]
