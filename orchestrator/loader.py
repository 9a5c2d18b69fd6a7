"""Reading job files: YAML -> overrides -> JobSpec, with one-line errors that name the field.

Precedence is code, in one place (`load_spec`): `--set` overrides > the file > the model's defaults.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec

__all__ = ["apply_overrides", "format_validation_error", "load_spec", "parse_set", "read_yaml"]

_PATH_PREFIX_RE = re.compile(r"^([A-Za-z][\w]*(\.[A-Za-z][\w]*)*): ")
_PLAIN_KEY_RE = re.compile(r"^[\w.\-/]+$")
_INDEX_RE = re.compile(r"^(?P<key>[^\[\]]+)(\[(?P<idx>\d+)\])?$")


def read_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text; syntax errors become a SpecError with line and column."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise SpecError(f"{where}YAML syntax error: {problem}", source) from None
    except yaml.reader.ReaderError as exc:
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise SpecError(f"position {exc.position}: YAML error: unacceptable character #x{char:04x}", source) from None
    except yaml.YAMLError as exc:
        # Keep the one-line-per-problem contract: PyYAML messages can span lines.
        raise SpecError("YAML error: " + " ".join(str(exc).split()), source) from None
    if not docs:
        raise SpecError("the file is empty; expected a TrainingJob document", source)
    if len(docs) > 1:
        raise SpecError(f"expected one document, found {len(docs)}", source)
    return docs[0]


def parse_set(expr: str) -> tuple[list[str | int], Any]:
    """Parse one `--set path.to.key=value` (Helm-like; values are YAML scalars, `a[0].b` indexes lists)."""
    if "=" not in expr:
        raise SpecError(f"--set {expr!r}: expected PATH=VALUE, e.g. spec.training.steps=10")
    path_text, _, value_text = expr.partition("=")
    path_text = path_text.strip()
    if not path_text:
        raise SpecError(f"--set {expr!r}: empty path")
    path: list[str | int] = []
    for part in path_text.split("."):
        match = _INDEX_RE.match(part)
        if not match:
            raise SpecError(f"--set {expr!r}: bad path element {part!r}")
        path.append(match.group("key"))
        if match.group("idx") is not None:
            path.append(int(match.group("idx")))
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else ""
    except yaml.YAMLError:
        value = value_text
    return path, value


def apply_overrides(data: Any, overrides: list[str]) -> Any:
    """Apply `--set` expressions in order to a parsed document (creating maps as needed)."""
    for expr in overrides:
        path, value = parse_set(expr)
        if not isinstance(data, dict):
            raise SpecError(f"--set {expr!r}: the document is not a mapping")
        node: Any = data
        for i, key in enumerate(path[:-1]):
            nxt = path[i + 1]
            if isinstance(key, int):
                if not isinstance(node, list) or key > len(node):
                    raise SpecError(f"--set {expr!r}: index {key} out of range")
                if key == len(node):  # one past the end appends, as for a final index
                    node.append([] if isinstance(nxt, int) else {})
                node = node[key]
                continue
            if not isinstance(node, dict):
                raise SpecError(f"--set {expr!r}: {key!r} is not inside a mapping")
            if key not in node or node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        last = path[-1]
        if isinstance(last, int):
            if not isinstance(node, list) or last > len(node):
                raise SpecError(f"--set {expr!r}: index {last} out of range")
            if last == len(node):
                node.append(value)
            else:
                node[last] = value
        else:
            if not isinstance(node, dict):
                raise SpecError(f"--set {expr!r}: cannot set {last!r} on a non-mapping")
            node[last] = value
    return data


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY_RE.fullmatch(str(part)):
            out += ("." if out else "") + str(part)
        else:
            # Keys with spaces or control characters are quoted so that a problem stays on one line.
            out += f"[{str(part)!r}]"
    return out


def format_validation_error(exc: ValidationError) -> list[str]:
    """One `path: message` line per error; cross-field messages that start with a field name extend the path."""
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        msg = str(err["msg"])
        for prefix in ("Value error, ", "Assertion failed, "):
            if msg.startswith(prefix):
                msg = msg[len(prefix) :]
        path = _loc_to_path(loc)
        match = _PATH_PREFIX_RE.match(msg)
        if match and err["type"] == "value_error":
            sub = match.group(1)
            # A message naming a full path (`spec.nodes.max: ...`) replaces the location; a relative one extends it.
            path = sub if sub.startswith(("spec.", "metadata.")) or not path else f"{path}.{sub}"
            msg = msg[match.end() :]
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; keys are camelCase)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"{path or '<document>'}: {' '.join(msg.split())}")
    return lines


def validate_document(data: Any, source: str | None = None) -> JobSpec:
    """Validate a parsed document into a JobSpec, raising SpecError with every problem."""
    if not isinstance(data, dict):
        raise SpecError("expected a mapping with apiVersion, kind, metadata and spec", source)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc), source) from None


def load_spec(path: str | os.PathLike[str], overrides: list[str] | None = None) -> JobSpec:
    """Load a job file, apply `--set` overrides, and validate.

    Raises:
        SpecError: the file is missing, not YAML, or not a valid TrainingJob.
    """
    source = str(path)
    try:
        text = Path(path).read_text() if source != "-" else os.read(0, 1 << 24).decode()
    except FileNotFoundError:
        raise SpecError("no such file", source) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read: {exc.__class__.__name__}", source) from None
    data = read_yaml(text, source)
    data = apply_overrides(data, list(overrides or []))
    return validate_document(data, source)


def dump_spec(spec: JobSpec) -> str:
    """The resolved spec as YAML (what workers receive)."""
    return yaml.safe_dump(spec.to_yaml_dict(), sort_keys=False)


def spec_json(spec: JobSpec) -> str:
    return json.dumps(spec.to_yaml_dict(), sort_keys=True)
