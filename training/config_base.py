"""The base of every spec model (`training.config`, `training.checkpoint_config`, `orchestrator.spec`)."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic.alias_generators import to_camel

__all__ = ["MAX_GRACE_S", "MAX_TIMEOUT_S", "Model"]

# The longest a timeout or an interval of a spec may be. Pods carry them as integer seconds (probes,
# terminationGracePeriodSeconds), so an unbounded float (1e300) would render a manifest no API server
# takes; a week is longer than any step, restore or save a job should be allowed to sit in.
MAX_TIMEOUT_S = 7 * 24 * 3600
MAX_GRACE_S = 24 * 3600  # preemption grace: a pod's terminationGracePeriodSeconds


def _is_number_field(annotation: Any) -> bool:
    """`int`, `float`, or either `| None` (pydantic's lax mode would take YAML's `yes`/`true` as 1)."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args in ([int], [float])
    return False


class Model(BaseModel):
    """Base for every spec model: unknown keys rejected, camelCase in YAML, snake_case in Python,
    no infinite or NaN numbers, and no boolean where a number is expected (`steps: yes` is a typo, not 1)."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        validate_default=True,
        use_attribute_docstrings=False,
        allow_inf_nan=False,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_int(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _is_number_field(field.annotation):
                raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
        return value

    def to_yaml_dict(self) -> dict[str, Any]:
        """The model as the YAML a user would write: camelCase keys, and a null only where it means something.

        A null is left out where the field defaults to null anyway, and written where the default is not
        (`gradClip: null`, no clipping, against a default of 1.0): the resolved job file is read back by the
        workers and by torchrig itself, and a dropped null would come back as the default.
        """
        return _drop_default_nulls(self, self.model_dump(mode="json", by_alias=True))


def _drop_default_nulls(model: BaseModel, data: dict[str, Any]) -> dict[str, Any]:
    """`data` (`model` dumped by alias) without the nulls of fields whose default is null, recursively."""
    for name, info in type(model).model_fields.items():
        key = info.alias or name
        value = getattr(model, name)
        if value is None:
            if not info.is_required() and info.get_default(call_default_factory=True) is None:
                del data[key]
        elif isinstance(value, BaseModel):
            _drop_default_nulls(value, data[key])
        elif isinstance(value, (list, tuple)):
            for item, dumped in zip(value, data[key], strict=True):
                if isinstance(item, BaseModel):
                    _drop_default_nulls(item, dumped)
        elif isinstance(value, dict):
            for item_key, item in value.items():
                if isinstance(item, BaseModel):
                    _drop_default_nulls(item, data[key][item_key])
    return data
