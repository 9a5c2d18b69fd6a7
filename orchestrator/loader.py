"""Reading job files: YAML -> overrides -> JobSpec, with one-line errors that name the field.

Precedence is code, in one place (`load_spec`): `--set` overrides > the file > the model's defaults.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
from typing import Any

import yaml
from pydantic import ValidationError

from orchestrator.credentials import SECRET_OPTION_RE
from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec

__all__ = [
    "MAX_SPEC_BYTES",
    "apply_overrides",
    "format_validation_error",
    "load_spec",
    "parse_set",
    "read_spec_text",
    "read_yaml",
]

# What a job file may be. Real specs are a few KiB; the bounds keep a hostile or mistaken input (an
# alias bomb, a generated file, a stream that never ends) to one error line in well under a second.
MAX_SPEC_BYTES = 1 << 20
MAX_YAML_DEPTH = 64  # nesting levels (the model itself is under 10 deep)
MAX_YAML_NODES = 100_000  # nodes after expanding aliases (a spec has a few hundred)

_PATH_PREFIX_RE = re.compile(r"^([A-Za-z]\w*(\[\d+\])*(\.[A-Za-z]\w*(\[\d+\])*)*): ")
_PLAIN_KEY_RE = re.compile(r"^[\w.\-/]+$")
_INDEX_RE = re.compile(r"^(?P<key>[^\[\]]+)(\[(?P<idx>\d+)\])?$")


class _TooLarge(yaml.YAMLError):
    """A bound or rule of the loader was crossed (depth, expanded size, a duplicate key)."""


class _BoundedLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` with bounds: nesting depth while composing, and the size of each document
    with its aliases expanded, checked before anything is constructed (a 700-byte "billion laughs"
    composes into a few dozen nodes but expands to billions)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise _TooLarge(f"line {mark.line + 1}: nesting deeper than {MAX_YAML_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        # PyYAML keeps the last of two equal keys without a word: `steps: 300` then `steps: 5` would run 5.
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _TooLarge(f"line {line}: duplicate key {key!r} (first on line {seen[key]})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_document(self, node: Any) -> Any:
        size = _expanded_size(node, {})
        if size > MAX_YAML_NODES:
            raise _TooLarge(f"more than {MAX_YAML_NODES} values once its aliases are expanded (an alias bomb?)")
        return super().construct_document(node)


def _expanded_size(node: Any, memo: dict[int, int]) -> int:
    """Nodes in `node` with every alias expanded; shared nodes are counted once per use, computed once."""
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = MAX_YAML_NODES + 1  # a recursive alias reaches itself: treat as unbounded
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    else:
        size = 1
    memo[key] = min(size, MAX_YAML_NODES + 1)
    return memo[key]


def read_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text; syntax errors become a SpecError with line and column.

    Bounded: at most `MAX_YAML_DEPTH` levels deep and `MAX_YAML_NODES` values with aliases expanded.
    """
    try:
        docs = [d for d in yaml.load_all(text, Loader=_BoundedLoader) if d is not None]
    except _TooLarge as exc:
        raise SpecError(f"YAML rejected: {exc}", source) from None
    except RecursionError:
        raise SpecError(f"YAML rejected: nesting deeper than {MAX_YAML_DEPTH} levels", source) from None
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
        value = yaml.load(value_text, Loader=_BoundedLoader) if value_text.strip() else ""
    except _TooLarge as exc:  # the same bounds as a file's
        raise SpecError(f"--set {path_text}: YAML rejected: {exc}") from None
    except RecursionError:
        raise SpecError(f"--set {path_text}: YAML rejected: nesting deeper than {MAX_YAML_DEPTH} levels") from None
    except yaml.YAMLError:
        value = value_text
    return path, value


def _refuse_credentials(expr: str, path: list[str | int]) -> None:
    """A credential in `--set` would sit in shell history and `ps` output: refuse it, name the fix."""
    keys = [p for p in path if isinstance(p, str)]
    if "options" in keys[:-1] and SECRET_OPTION_RE.search(keys[-1]):
        raise SpecError(
            f"--set {expr.partition('=')[0]}: credentials are not taken from the command line; set them in the "
            "environment (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or, on Kubernetes, name a Secret in "
            "spec.checkpoint.stores[].secretRef"
        )


def _check_index(expr: str, node: Any, index: int) -> None:
    """`node[index]` may be set by `--set` (an index one past the end appends)."""
    if not isinstance(node, list):
        raise SpecError(f"--set {expr!r}: [{index}] needs a list there, found {type(node).__name__}")
    if index > len(node):
        raise SpecError(f"--set {expr!r}: index {index} out of range (the list has {len(node)})")


def apply_overrides(data: Any, overrides: list[str]) -> Any:
    """Apply `--set` expressions in order to a parsed document (creating maps as needed)."""
    for expr in overrides:
        path, value = parse_set(expr)
        _refuse_credentials(expr, path)
        if not isinstance(data, dict):
            raise SpecError(f"--set {expr!r}: the document is not a mapping")
        node: Any = data
        for i, key in enumerate(path[:-1]):
            nxt = path[i + 1]
            if isinstance(key, int):
                _check_index(expr, node, key)
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
            _check_index(expr, node, last)
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


@functools.cache
def _schema() -> dict[str, Any]:
    return JobSpec.model_json_schema(by_alias=True)


def _deref(node: dict[str, Any]) -> dict[str, Any]:
    root = _schema()
    while "$ref" in node:
        node = root["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    return node


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the model accepts in the mapping at `loc` (empty when it cannot tell)."""
    candidates = [_deref(_schema())]
    for part in loc:
        nxt: list[dict[str, Any]] = []
        for node in candidates:
            for option in [node, *node.get("anyOf", []), *node.get("oneOf", []), *node.get("allOf", [])]:
                option = _deref(option)
                if isinstance(part, int) and "items" in option:
                    nxt.append(_deref(option["items"]))
                elif isinstance(part, str) and part in option.get("properties", {}):
                    nxt.append(_deref(option["properties"][part]))
                elif isinstance(part, str) and isinstance(option.get("additionalProperties"), dict):
                    nxt.append(_deref(option["additionalProperties"]))
        candidates = nxt
    keys: set[str] = set()
    for node in candidates:
        for option in [node, *node.get("anyOf", []), *node.get("oneOf", [])]:
            keys.update(_deref(option).get("properties", {}))
    return sorted(keys)


def _unknown_field_message(loc: tuple[Any, ...]) -> str:
    msg = "unknown field"
    if loc and isinstance(loc[-1], str):
        valid = _keys_at(loc[:-1])
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.6) or difflib.get_close_matches(
            loc[-1].lower(), [k.lower() for k in valid], n=1, cutoff=0.6
        )
        if close:
            match = next(k for k in valid if k.lower() == close[0].lower())
            return f"{msg}; did you mean {match!r}?"
        if valid:
            shown = ", ".join(valid[:12]) + (", ..." if len(valid) > 12 else "")
            return f"{msg}; valid keys here: {shown}"
    return f"{msg} (check the spelling; keys are camelCase)"


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
            msg = _unknown_field_message(loc)
        elif err["type"] in ("model_type", "model_attributes_type", "dict_type"):
            msg = f"expected a mapping, got {type(err.get('input')).__name__}"  # not pydantic's class names
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


def _read_bounded(fd: int, source: str) -> bytes:
    """Read `fd` to EOF (pipes deliver in pieces), failing once it passes `MAX_SPEC_BYTES`."""
    chunks: list[bytes] = []
    total = 0
    while chunk := os.read(fd, 1 << 16):
        total += len(chunk)
        if total > MAX_SPEC_BYTES:
            raise SpecError(f"larger than {MAX_SPEC_BYTES // 1024} KiB; a job file is a few KiB", source)
        chunks.append(chunk)
    return b"".join(chunks)


def read_spec_text(source: str) -> str:
    """The text of a job file, or of standard input for `-`, read to the end and bounded in size.

    Raises:
        SpecError: missing, unreadable, not UTF-8, or larger than `MAX_SPEC_BYTES`.
    """
    try:
        if source == "-":
            raw = _read_bounded(0, "<stdin>")
        else:
            fd = os.open(source, os.O_RDONLY)
            try:
                raw = _read_bounded(fd, source)
            finally:
                os.close(fd)
        return raw.decode()
    except FileNotFoundError:
        raise SpecError("no such file", source) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read: {exc.__class__.__name__}", source) from None


def load_spec(
    path: str | os.PathLike[str], overrides: list[str] | None = None, *, allow_inline_secrets: bool = False
) -> JobSpec:
    """Load a job file, apply `--set` overrides, and validate.

    Every command reads jobs here, so this is where credentials written in the job are refused
    (`orchestrator.credentials`: one line per field, never the value).

    Args:
        path: the job file, or `-` for standard input.
        overrides: `--set PATH=VALUE` expressions, applied in order.
        allow_inline_secrets: accept inline credentials (`torchrig run --allow-inline-secrets`, a local run;
            and torchrig's own re-reads of such a run's job.yaml); `JobSpec.warnings` still names them.

    Raises:
        SpecError: the file is missing, not YAML, not a valid TrainingJob, or holds an inline credential.
    """
    from orchestrator.credentials import inline_secrets

    source = str(path)
    data = read_yaml(read_spec_text(source), source)
    data = apply_overrides(data, list(overrides or []))
    spec = validate_document(data, source)
    findings = [] if allow_inline_secrets else inline_secrets(spec)
    if findings:
        raise SpecError([f.error() for f in findings], source)
    return spec


def dump_spec(spec: JobSpec) -> str:
    """The resolved spec as YAML: what the workers receive, and what torchrig reads back (run directories,
    drills, the Ray staging area). Loading it gives `spec` again: a null is written wherever it differs from
    its field's default (`gradClip: null`: no clipping), so no re-read turns it into the default
    (`training.config_base.Model.to_yaml_dict`)."""
    return yaml.safe_dump(spec.to_yaml_dict(), sort_keys=False)


def spec_json(spec: JobSpec) -> str:
    """The resolved spec as canonical JSON (sorted keys), with the nulls `dump_spec` keeps."""
    return json.dumps(spec.to_yaml_dict(), sort_keys=True)
