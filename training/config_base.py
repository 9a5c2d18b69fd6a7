"""The base of every spec model (`training.config`, `training.checkpoint_config`, `orchestrator.spec`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

__all__ = ["Model"]


class Model(BaseModel):
    """Base for every spec model: unknown keys rejected, camelCase in YAML, snake_case in Python."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        validate_default=True,
        use_attribute_docstrings=False,
    )

    def to_yaml_dict(self) -> dict[str, Any]:
        """The model as the YAML a user would write: camelCase keys, no unset optional noise."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
