"""Walking the job model for the chart: its shape (defaults, nested models, lists, quantities) and the
draft-07 JSON Schema rewrite Helm 3 reads. Pure functions of the pydantic model; `orchestrator.chart`
turns them into the chart's generated files.
"""

from __future__ import annotations

import enum
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from orchestrator.spec import JobSpec

__all__ = ["all_models", "draft7", "is_quantity", "mergeable", "model_shape", "nested_model", "quantities"]


# Go's RE2 has no named groups; same language as orchestrator.spec._QUANTITY_RE.
_QUANTITY_PATTERN = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$"


def nested_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model inside an annotation and whether it is a list of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = typing.get_origin(annotation)
    if origin is list:
        inner, _ = nested_model(typing.get_args(annotation)[0])
        return inner, True
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            inner, is_list = nested_model(arg)
            if inner is not None:
                return inner, is_list
    return None, False


def _nullable(info: FieldInfo) -> bool:
    annotation = info.annotation
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(
        annotation
    )


def is_quantity(info: FieldInfo) -> bool:
    # Quantity is Annotated[str, ..._check_quantity]; pydantic moves that metadata onto the FieldInfo.
    return "_check_quantity" in " ".join(repr(m) for m in info.metadata) or "_check_quantity" in repr(info.annotation)


def _dump_default(info: FieldInfo) -> Any:
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True, exclude_none=True)
    if isinstance(value, list):
        return [
            v.model_dump(mode="json", by_alias=True, exclude_none=True) if isinstance(v, BaseModel) else v
            for v in value
        ]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


def model_shape(model: type[BaseModel] = JobSpec, *, merged: bool = True) -> dict[str, Any]:
    """What the chart's templates must know to resolve values like pydantic does.

    Args:
        model: the model of this level.
        merged: values.yaml sets this level's keys, so Helm merges the user's values over them (false for
            list items and for sub-models values.yaml leaves out, whose user map is taken as it is).

    Returns:
        `{"defaults": {key: default}, "nulls": [key], "models": {key: shape}, "lists": {key: shape},
        "quantities": [key]}`: the non-null defaults of optional fields (a missing key gets them: list
        items and keys Helm's merge cannot default, such as `checkpoint.every`), the fields whose null is not
        their default (`gradClip`) where Helm merges (a user's null deletes the key values.yaml sets, so a
        missing key is that null; elsewhere a missing key is the default), the sub-model and list-of-model
        fields, and the quantity fields (numbers in values become strings, as the model's validator does).
    """
    shape: dict[str, Any] = {"defaults": {}, "nulls": [], "models": {}, "lists": {}, "quantities": []}
    for name, info in model.model_fields.items():
        key = info.alias or name
        nested, is_list = nested_model(info.annotation)
        if nested is not None:
            sub_merged = merged and not is_list and _helm_merges(info, nested)
            shape["lists" if is_list else "models"][key] = model_shape(nested, merged=sub_merged)
        if not info.is_required():
            default = _dump_default(info)
            if not _nullable(info) or (default is not None and not merged):
                shape["defaults"][key] = default
            elif default is not None:
                shape["nulls"].append(key)
        if is_quantity(info):
            shape["quantities"].append(key)
    return shape


def _helm_merges(info: FieldInfo, nested: type[BaseModel]) -> bool:
    """values.yaml sets the keys of this sub-model (`orchestrator.chart.values_yaml`): it is required (the
    default job has it) or its default is what its own fields default to."""
    return info.is_required() or mergeable(nested, _dump_default(info))


def mergeable(model: type[BaseModel], default: Any) -> bool:
    """Whether a sub-model's default equals what its own fields default to (so Helm's map merge is exact)."""
    try:
        fresh = model.model_validate({}).model_dump(mode="json", by_alias=True, exclude_none=True)
    except ValueError:
        return False
    return bool(fresh == default)


# -- values.schema.json -------------------------------------------------------------------------------


def draft7(node: Any) -> Any:
    """pydantic's draft 2020-12 -> draft-07 (`$defs` -> `definitions`, `prefixItems` -> `items: [...]`)."""
    if isinstance(node, list):
        return [draft7(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$defs":
            out["definitions"] = draft7(value)
        elif key == "$ref" and isinstance(value, str):
            out["$ref"] = value.replace("#/$defs/", "#/definitions/")
        elif key == "prefixItems":
            out["items"] = draft7(value)
            out["additionalItems"] = False
        else:
            out[key] = draft7(value)
    return out


def quantities(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Quantity fields: a string matching the Kubernetes quantity syntax, or a plain number (the model takes 2)."""
    defs = schema["$defs"]
    for sub in [model, *all_models(model)]:
        props = defs.get(sub.__name__, {}).get("properties", {}) if sub is not model else schema["properties"]
        for name, info in sub.model_fields.items():
            if not is_quantity(info):
                continue
            prop = props[info.alias or name]
            quantity = [{"type": "string", "pattern": _QUANTITY_PATTERN}, {"type": "number", "minimum": 0}]
            if _nullable(info):
                quantity.append({"type": "null"})
            prop.pop("type", None)
            prop["anyOf"] = quantity


def all_models(model: type[BaseModel]) -> list[type[BaseModel]]:
    out: list[type[BaseModel]] = []
    for info in model.model_fields.values():
        nested, _ = nested_model(info.annotation)
        if nested is not None and nested not in out:
            out.append(nested)
            out.extend(m for m in all_models(nested) if m not in out)
    return out
