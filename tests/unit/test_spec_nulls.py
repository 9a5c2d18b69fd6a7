"""A null that means something survives the resolved job file.

Every backend hands its workers `orchestrator.loader.dump_spec(spec)` and re-reads it itself (run
directories, drills, the Ray staging area). A field whose null differs from its default (`gradClip: null`:
no clipping, against 1.0) must come back null, not as the default: the dump writes that null, and leaves out
only the nulls that are defaults anyway. The fields are found by walking the model, not listed, so a new one
is covered the day it is added.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from orchestrator.chart import CHART_DIR, chart_files, model_shape, nested_model, values_document
from orchestrator.loader import dump_spec, spec_json, validate_document
from orchestrator.spec import JobSpec
from tests.fixtures import spec_variants
from training.config import load_worker_spec

Path_ = tuple[str | int, ...]
BASE = values_document()
VARIANTS = spec_variants.variants(BASE)
WORKER_SECTIONS = ("task", "training", "restarts", "checkpoint", "metrics", "sdc")


def _nullable(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(
        annotation
    )


def null_means_something(model: type[BaseModel] = JobSpec, path: Path_ = ()) -> Iterator[Path_]:
    """Paths of the fields that take null and default to something else (list items at index 0)."""
    for name, info in model.model_fields.items():
        key = info.alias or name
        nested, is_list = nested_model(info.annotation)
        if nested is not None:
            yield from null_means_something(nested, (*path, key, 0) if is_list else (*path, key))
        elif (
            _nullable(info.annotation)
            and not info.is_required()
            and info.get_default(call_default_factory=True) is not None
        ):
            yield (*path, key)


NULL_FIELDS = sorted(null_means_something())


def _set(doc: dict[str, Any], path: Path_, value: Any) -> dict[str, Any]:
    return spec_variants.Variant(path, value).apply(doc)


def _get(doc: Any, path: Path_) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def test_the_walk_finds_the_fields_whose_null_is_not_their_default() -> None:
    found = {".".join(map(str, p)) for p in NULL_FIELDS}
    # The four the last session noticed; the walk may find more as the model grows, never fewer.
    assert found >= {
        "spec.training.gradClip",
        "spec.resources.sharedMemory",
        "spec.resources.ephemeralStorage",
        "spec.kubernetes.ttlSecondsAfterFinished",
    }


@pytest.mark.parametrize("path", NULL_FIELDS, ids=lambda p: ".".join(map(str, p)))
def test_an_explicit_null_survives_the_resolved_job_file(path: Path_) -> None:
    spec = validate_document(_set(BASE, path, None))
    text = dump_spec(spec)
    assert _get(yaml.safe_load(text), path) is None  # written, not dropped
    again = validate_document(yaml.safe_load(text))
    assert again == spec
    assert validate_document(yaml.safe_load(spec_json(spec))) == spec


def test_the_worker_reads_grad_clip_null_as_no_clipping() -> None:
    spec = validate_document(_set(BASE, ("spec", "training", "gradClip"), None))
    worker = load_worker_spec(dump_spec(spec))
    assert worker.spec.training.grad_clip is None
    assert load_worker_spec(dump_spec(validate_document(BASE))).spec.training.grad_clip == 1.0


def test_nulls_that_are_defaults_stay_out_of_the_dump() -> None:
    # No noise: the default job writes no null at all (serviceAccount, queue, profile, ... are left out).
    def nulls(node: Any) -> int:
        if isinstance(node, dict):
            return sum(v is None or nulls(v) for v in node.values())
        return sum(nulls(v) for v in node) if isinstance(node, list) else 0

    assert nulls(yaml.safe_load(dump_spec(validate_document(BASE)))) == 0


@st.composite
def resolved_specs(draw: st.DrawFn) -> JobSpec:
    """The chart's default job with a few leaves changed at once (every leaf of the model can be drawn,
    nulls of nullable fields included), then a few of the null-means-something fields set to null."""
    doc = BASE
    for variant in draw(st.lists(st.sampled_from(VARIANTS), max_size=8)):
        doc = variant.apply(doc)
    for path in draw(st.lists(st.sampled_from(NULL_FIELDS), max_size=len(NULL_FIELDS), unique=True)):
        doc = _set(doc, path, None)
    try:
        return JobSpec.model_validate(doc)
    except ValidationError:
        assume(False)  # two variants may break a cross-field rule together
        raise


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(resolved_specs())
def test_dump_then_load_gives_the_same_spec(spec: JobSpec) -> None:
    text = dump_spec(spec)
    again = validate_document(yaml.safe_load(text))
    assert again == spec
    assert dump_spec(again) == text  # a fixed point: a re-read job file dumps to the same text
    worker = load_worker_spec(text)
    for section in WORKER_SECTIONS:
        assert getattr(worker.spec, section) == getattr(spec.spec, section), section


# -- the chart: Helm deletes a key set to null, so a missing key is the user's null --------------------


def _shape_at(shape: dict[str, Any], path: Path_) -> dict[str, Any]:
    for key in path:
        if not isinstance(key, int):  # a list's items share one shape
            shape = shape["models"].get(key) or shape["lists"][key]
    return shape


def test_the_chart_shape_reads_a_missing_key_as_null_where_values_yaml_sets_it() -> None:
    shape = model_shape()
    values = yaml.safe_load(chart_files()[f"{CHART_DIR}/values.yaml"])
    for path in NULL_FIELDS:
        *parent, key = path
        level = _shape_at(shape, tuple(parent))
        try:
            in_values = key in _get(values, tuple(parent))
        except (KeyError, IndexError, TypeError):
            in_values = False
        if in_values:
            # Helm deletes the key when the user's values set it to null: its absence is that null.
            assert key in level["nulls"] and key not in level["defaults"], path
        else:
            # Nothing to delete from (a list item, a sub-model values.yaml leaves out): absent is the default.
            assert key in level["defaults"] and key not in level["nulls"], path


@pytest.mark.parametrize("ttl", [None, 600, 30, "unset"])
def test_a_rayjob_compiled_from_a_resolved_job_file_keeps_its_cluster_ttl(ttl: int | str | None) -> None:
    """The resolved job file (what a run keeps and a pod reads) writes every default; the RayJob's cluster
    TTL is its own field (`spec.ray.clusterTtlSeconds`), so unset, null and a value all read back the same
    (the TTL shared with the other targets read back as a day once written)."""
    from orchestrator.compile.rayjob import cluster_ttl_seconds

    doc = _set(BASE, ("spec", "ray", "clusterTtlSeconds"), ttl)
    if ttl == "unset":
        del doc["spec"]["ray"]["clusterTtlSeconds"]
    spec = validate_document(doc)
    want = 600 if ttl == "unset" else ttl
    assert cluster_ttl_seconds(spec) == want
    assert cluster_ttl_seconds(validate_document(yaml.safe_load(dump_spec(spec)))) == want
