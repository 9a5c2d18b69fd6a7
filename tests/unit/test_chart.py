"""The chart's generated values.yaml and values.schema.json (orchestrator/chart.py), without helm.

The helm-rendered objects are compared with the compilers in tests/integration/test_helm.py; here: the
schema accepts what the model accepts and rejects what it rejects, and values.yaml's defaults survive
Helm's map merge (a default that is not the model's own would leak into every job that omits the key).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from orchestrator.chart import (
    CHART_DIR,
    JOB_KEYS,
    chart_files,
    model_shape,
    nested_model,
    values_document,
    values_schema,
)
from orchestrator.loader import load_spec
from orchestrator.spec import JobSpec
from tests.fixtures import spec_variants

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
FILES = chart_files()
VALUES = yaml.safe_load(FILES[f"{CHART_DIR}/values.yaml"])
SCHEMA = values_schema()
VALIDATOR = jsonschema.Draft7Validator(SCHEMA)


def helm_merge(defaults: Any, user: Any) -> Any:
    """Helm's coalescing of user values over chart defaults: maps merge, lists and scalars replace, a user
    null deletes a key the defaults have (and stays null otherwise)."""
    if not (isinstance(defaults, dict) and isinstance(user, dict)):
        return copy.deepcopy(user)
    out = copy.deepcopy(defaults)
    for key, value in user.items():
        if value is None and key in out:
            del out[key]
        elif key in out:
            out[key] = helm_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def job_part(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k in JOB_KEYS}


def resolved(doc: dict[str, Any]) -> dict[str, Any]:
    return JobSpec.model_validate(doc).to_yaml_dict()


# -- values.yaml --------------------------------------------------------------------------------------


def test_values_yaml_is_the_default_job() -> None:
    assert resolved(job_part(VALUES)) == values_document()


def test_values_yaml_references_the_schema_and_documents_every_key() -> None:
    text = FILES[f"{CHART_DIR}/values.yaml"]
    assert text.startswith("# yaml-language-server: $schema=values.schema.json\n")
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z]\w*:", line):
            above = i - 1
            while (
                above >= 0 and lines[above].lstrip().startswith("# ") and not lines[above].lstrip().startswith("# --")
            ):
                above -= 1
            assert above >= 0 and lines[above].lstrip().startswith("# --"), f"undocumented key: {line.strip()}"


def test_values_yaml_documents_every_field_of_the_model() -> None:
    text = FILES[f"{CHART_DIR}/values.yaml"]

    def walk(model: type[BaseModel]) -> None:
        for name, info in model.model_fields.items():
            assert f"{info.alias or name}:" in text, f"values.yaml lacks {info.alias or name}"
            assert info.description and " ".join(info.description.split())[:40] in " ".join(
                line.lstrip("# ").strip() for line in text.splitlines()
            ), f"values.yaml lacks the description of {info.alias or name}"
            sub = info.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                walk(sub)

    walk(JobSpec)


def test_examples_pass_the_schema_after_the_merge() -> None:
    for example in EXAMPLES:
        merged = helm_merge(VALUES, yaml.safe_load(example.read_text()))
        errors = [e.message for e in VALIDATOR.iter_errors(merged)]
        assert not errors, f"{example.name}: {errors}"


def _strip_optional(draw: st.DrawFn, doc: Any, model: type[BaseModel]) -> Any:
    """`doc` (a resolved model dump) with a random subset of its optional keys removed, recursively."""
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        key = info.alias or name
        if key not in doc:
            continue
        if not info.is_required() and draw(st.booleans()):
            continue
        value = doc[key]
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel) and isinstance(value, dict):
            value = _strip_optional(draw, value, sub)
        out[key] = value
    return out


@st.composite
def partial_jobs(draw: st.DrawFn) -> dict[str, Any]:
    example = draw(st.sampled_from(EXAMPLES))
    full = load_spec(example).to_yaml_dict()
    doc: dict[str, Any] = _strip_optional(draw, full, JobSpec)
    return doc


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(partial_jobs())
def test_values_defaults_survive_helms_merge(job: dict[str, Any]) -> None:
    # Whatever a valid job file omits, the chart's defaults fill in exactly what the model would.
    try:
        JobSpec.model_validate(job)
    except ValidationError:
        assume(False)  # dropping a key can break a cross-field rule (procsPerNode = gpus)
    merged = helm_merge(job_part(VALUES), job)
    assert resolved(merged) == resolved(job)
    assert not [e.message for e in VALIDATOR.iter_errors(helm_merge(VALUES, job))]


# -- values.schema.json -------------------------------------------------------------------------------


def test_schema_is_the_models_plus_chart_keys() -> None:
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    model = JobSpec.model_json_schema(by_alias=True)
    assert set(SCHEMA["definitions"]) == set(model["$defs"])
    chart_keys = {"fixedSize", "allowPodLocalStores", "monitoring", "checkpointPvc", "global"}
    assert set(SCHEMA["properties"]) == {*model["properties"], *chart_keys}
    assert SCHEMA["additionalProperties"] is False
    assert "$defs" not in json.dumps(SCHEMA) and "prefixItems" not in json.dumps(SCHEMA)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["spec", "training", "stepz"], 3, "Additional properties"),
        (["replicas"], 2, "Additional properties"),
        (["spec", "training", "steps"], -5, "less than or equal to the minimum"),
        (["spec", "nodes", "max"], "four", "is not of type 'integer'"),
        (["spec", "training", "optimizer", "betas"], [0.9], "too short"),
        (["spec", "resources", "cpu"], "two", "is not valid under any of the given schemas"),
        (["metadata", "name"], "Bad_Name", "does not match"),
        (["checkpointPvc", "accessModes"], ["ReadWriteSometimes"], "is not one of"),
    ],
)
def test_schema_rejects_bad_values(path: list[str], value: Any, message: str) -> None:
    values = copy.deepcopy(VALUES)
    node = values
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in VALIDATOR.iter_errors(values)]
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("value", ["2", 2, 0.5, "500m", "4Gi", "1e3", None])
def test_schema_takes_what_the_model_takes_for_quantities(value: Any) -> None:
    values = copy.deepcopy(VALUES)
    values["spec"]["resources"]["sharedMemory"] = value
    assert not list(VALIDATOR.iter_errors(values))
    doc = job_part(values)
    JobSpec.model_validate(doc)


# -- the shape the templates resolve values with ------------------------------------------------------


def test_model_shape_defaults_only_non_nullable_fields() -> None:
    shape = model_shape()
    spec = shape["models"]["spec"]
    # Helm deletes a key set to null; refilling a nullable default would undo the user's null.
    assert "sharedMemory" not in spec["models"]["resources"]["defaults"]
    assert "gradClip" not in spec["models"]["training"]["defaults"]
    assert "ttlSecondsAfterFinished" not in spec["models"]["kubernetes"]["defaults"]
    # What Helm's merge cannot default: list items and `checkpoint.every`.
    assert spec["models"]["checkpoint"]["defaults"]["every"] == {"steps": 100}
    assert spec["models"]["checkpoint"]["lists"]["stores"]["defaults"] == {"options": {}}
    assert spec["models"]["resources"]["quantities"] == ["cpu", "memory", "sharedMemory", "ephemeralStorage"]


def test_non_mergeable_defaults_are_left_out_of_values_yaml() -> None:
    assert "every" not in VALUES["spec"]["checkpoint"]
    assert (
        "    # every:\n    #   # -- Save every this many optimizer steps.\n    #   steps: 100\n"
        in FILES[f"{CHART_DIR}/values.yaml"]
    )


# -- the generated variants the chart's equality test renders (tests/integration/test_helm.py) ---------


def _model_leaves(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every leaf field of `model` by alias, from the pydantic model itself (list items at index 0)."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}{info.alias or name}"
        nested, is_list = nested_model(info.annotation)
        if nested is None:
            out.add(path)
        else:
            out |= _model_leaves(nested, f"{path}.0." if is_list else f"{path}.")
    return out


def test_generated_variants_change_every_field_of_the_model() -> None:
    base = values_document()
    walked = {".".join(map(str, leaf.path)) for leaf in spec_variants.leaves()}
    assert walked == _model_leaves(JobSpec)  # the schema walk misses no field of the model
    assert spec_variants.uncovered(base) == []  # a new cross-field rule needs a COMPANIONS entry
    for variant in spec_variants.variants(base):
        changed = variant.apply(base)
        assert resolved(changed) != resolved(base), f"{variant} changes nothing"


def test_monitoring_files_are_copies_of_the_shared_assets() -> None:
    monitoring = REPO / "orchestrator" / "monitoring"
    assert FILES[f"{CHART_DIR}/files/rules.yaml"] == (monitoring / "rules.yaml").read_text()
    assert FILES[f"{CHART_DIR}/files/dashboard.json"] == (monitoring / "dashboard.json").read_text()
