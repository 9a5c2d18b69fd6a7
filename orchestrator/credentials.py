"""Credentials written inline in a job: found anywhere in the spec, reported by path, never echoed.

A job file travels: into the run directory (`job.yaml`), the spec ConfigMap, the pods' `env: value:`,
the RayJob's `runtimeEnvYAML`, a Ray working directory, shell history and code review. A secret written
in it is readable by everyone who can read any of those. `inline_secrets` walks every string of a
validated job (model fields, and the keys and values of its free-form maps: `kubernetes.env`,
`ray.runtimeEnv`, store `options`, `task.args`, tolerations, ...) for two kinds of evidence:

- a *name* that says credential (`*SECRET*`, `*PASSWORD*`, `*CREDENTIAL*`, a `token` word (in task
  arguments only `token` itself or `access_token`, `hf_token`, ...: `eos_token` is text), `*_KEY` in
  an environment map, `api_key`/`access_key`/... anywhere, `key` among a store's fsspec options), with a
  non-empty value that is not a reference (`$(VAR)`, `${VAR}`) or a setting about the credential (a
  name ending in `_FILE`, `_PATH`, `_URL`, `_NAME`, ...). Label, annotation and node-selector keys are
  Kubernetes names, not credentials, and are not judged by name;
- a *value* with the shape of one: an AWS access key id (`AKIA`/`ASIA` + 16) and a 40-character secret
  key beside it, a PEM private key or a GCP service-account JSON (`"private_key"`), a Hugging Face
  (`hf_`), GitHub (`ghp_`, `github_pat_`), Slack (`xox?-`, a hooks URL) or Google API (`AIza`) token,
  a JWT, an `Authorization: Bearer` value, and a password in a URI's userinfo (`scheme://user:pass@host`).

The loader refuses a job with any finding (`orchestrator.loader.load_spec`): `validate`, `render`,
`submit`, `run`, drills and the chart's generated values all read jobs through it. `torchrig run
--allow-inline-secrets` (local backend only: nothing leaves the machine) turns the refusal into the
warnings `JobSpec.warnings` prints. Messages name the field and where the secret should live instead;
they never contain the value (nor a map key that itself looks like a credential).
"""

from __future__ import annotations

import enum
import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

__all__ = ["SECRET_OPTION_RE", "Finding", "chart_rules", "inline_secrets", "re2", "scan_value", "secret_option_paths"]

# -- what a credential looks like ------------------------------------------------------------------------

# (what it is, pattern). Searched, not matched whole: a token may sit inside a URL, a header or a JSON text.
_VALUE_SHAPES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an AWS access key id", re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])")),
    ("a PEM private key", re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")),
    ("a GCP service-account key (JSON)", re.compile(r"\"private_key(?:_id)?\"\s*:|\"type\"\s*:\s*\"service_account\"")),
    ("a Hugging Face token", re.compile(r"(?<![A-Za-z0-9_])hf_[A-Za-z0-9]{30,}")),
    ("a GitHub token", re.compile(r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,})")),
    ("a Slack token", re.compile(r"(?<![A-Za-z0-9])xox[abposr]-[A-Za-z0-9-]{10,}")),
    ("a Slack webhook URL", re.compile(r"hooks\.slack\.com/services/T[A-Za-z0-9_]+/B[A-Za-z0-9_]+/[A-Za-z0-9_]+")),
    ("a Google API key", re.compile(r"(?<![A-Za-z0-9_])AIza[0-9A-Za-z_-]{35}")),
    # Each part of a token starts where no token character stands before it: a search from every `eyJ` of
    # a long word was quadratic.
    (
        "a JSON Web Token",
        re.compile(r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    ),
    ("a bearer token", re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/-]{16,}")),
    # userinfo with a non-empty password (RFC 3986 3.2.1); `user@host` alone names no secret. The scheme
    # starts where no scheme character stands before it and is at most 32 long: unbounded, a search
    # tried every start of a long word and backtracked over its rest (quadratic: a 100,000-character
    # task argument took minutes to render).
    (
        "a password in a URI (user:password@host)",
        re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]{0,31}://[^/?#\s@:]*:[^/?#\s@]+@"),
    ),
)
_AWS_ACCESS_KEY = _VALUE_SHAPES[0][1]
# An AWS secret access key: 40 characters of base64 (no `=`), recognisable only beside its key id.
_AWS_SECRET_KEY = re.compile(r"[A-Za-z0-9/+]{40}")

# Words of a key name that say "this holds a credential", found as substrings (they are distinctive)...
_SECRET_SUBSTRINGS = ("secret", "passw", "passphrase", "credential", "privatekey", "apikey", "accesskey")
# ...or as whole words (`token` would otherwise match `tokenizer`, `max_tokens`).
_SECRET_WORDS = frozenset({"token", "pat", "sas", "connectionstring"})
# In task arguments and other general maps a token is usually text (`eos_token`, `pad_token_id`): there a
# `token` word counts alone (`token`, gcsfs's option) or after a word of authentication.
_TOKEN_QUALIFIERS = frozenset(
    {"access", "auth", "api", "session", "bearer", "refresh", "oauth", "sas", "security", "hf", "huggingface"}
    | {"github", "gh", "gitlab", "wandb", "slack", "bot", "service", "client", "personal", "private", "secret"}
    | {"app", "registry", "npm", "pypi", "docker", "user", "identity", "jwt", "csrf", "webhook"}
)
# `<qualifier>_key` is a credential anywhere (`api_key`, `account_key`, `WANDB_API_KEY`)...
_KEY_QUALIFIERS = frozenset(
    {"api", "access", "secret", "private", "account", "signing", "encryption", "decryption", "master", "auth"}
    | {"client", "app", "license", "ssh", "hmac", "session", "service", "storage", "shared", "consumer"}
    | {"subscription", "sas", "gpg", "pgp", "jwt", "crypto", "checkpoint"}
)
# ...and any `*_KEY` in an environment map, where names are conventional (`OPENAI_API_KEY`, `STRIPE_KEY`).
_ENV_MAPS = frozenset({"env", "env_vars", "envVars", "environment"})
# Maps whose keys are Kubernetes names (label keys, annotation keys): not judged by name.
_NAME_MAPS = frozenset({"labels", "annotations", "podLabels", "podAnnotations", "nodeSelector"})
# A name ending in one of these is a setting *about* a credential (`AWS_WEB_IDENTITY_TOKEN_FILE`,
# `SECRET_NAME`, `TOKEN_URL`, `TOKEN_TTL`), not the credential.
_ABOUT_WORDS = frozenset(
    {"file", "path", "dir", "directory", "url", "uri", "endpoint", "host", "name", "names", "ref", "arn"}
    | {"region", "type", "method", "mode", "version", "provider", "profile", "source", "kind", "header", "field"}
    | {"enabled", "disabled", "enable", "disable", "ttl", "expiry", "expires", "expiration", "lifetime"}
    | {"interval", "timeout", "seconds", "duration", "length", "size", "count", "limit", "env", "var"}
)
# gcsfs's `token` may name an authentication method instead of holding one.
_TOKEN_METHODS = frozenset({"anon", "google_default", "cache", "cloud", "browser"})
_NOT_SECRET_VALUES = frozenset({"true", "false", "yes", "no", "on", "off", "none", "null"})
# A value that points at a variable set elsewhere (Kubernetes `$(VAR)`, shell `${VAR}`) holds no secret.
_REFERENCE = re.compile(r"\$\([A-Za-z_][A-Za-z0-9_.-]*\)|\$\{[A-Za-z_][A-Za-z0-9_]*\}")
# A file the credential is read from (`GOOGLE_APPLICATION_CREDENTIALS: /var/run/secrets/sa.json`), not the credential.
_PATH = re.compile(r"(?:/|\./|\.\./|~/)[^\s:]*")
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
_PLAIN_KEY = re.compile(r"^[\w.\-/]+$")


class _Context(enum.Enum):
    """How the keys of a free-form map are judged by name."""

    GENERAL = "general"  # task args, runtime env, tolerations: credential words
    OPTIONS = "options"  # a store's fsspec options: also s3fs's bare `key`
    ENV = "env"  # an environment map: also any `*_KEY`
    NAMES = "names"  # labels, annotations, node selector: keys are Kubernetes names


@dataclass(frozen=True)
class Finding:
    """One credential written inline: where it is and what it looks like, never its value."""

    path: str
    what: str

    @property
    def alternative(self) -> str:
        """Where this secret belongs instead, for the section it was found in."""
        store = re.match(r"spec\.checkpoint\.stores\[\d+\]", self.path)
        if store:
            return (
                f"put it in a Kubernetes Secret named in {store.group(0)}.secretRef (its keys, e.g. AWS_ACCESS_KEY_ID, "
                "become the pods' environment, which fsspec reads); for a run elsewhere, export it in the environment"
            )
        if self.path.startswith("spec.checkpoint.initFrom"):
            return (
                "put it in a Kubernetes Secret named in spec.checkpoint.stores[].secretRef (its keys become the pods' "
                "environment, which fsspec reads); for a run elsewhere, export it in the environment"
            )
        if self.path.startswith("spec.ray."):
            return (
                "give it to the Ray cluster outside the job file: the environment of its nodes, or for a RayJob a "
                "Kubernetes Secret named in spec.checkpoint.stores[].secretRef (envFrom on the head and workers)"
            )
        return (
            "keep it out of the job file: on Kubernetes put it in a Secret named in spec.checkpoint.stores[].secretRef "
            "(every key of that Secret becomes the workers' environment through envFrom); elsewhere export it in "
            "the environment the job starts from"
        )

    def error(self) -> str:
        """The one-line refusal (`path: ...`)."""
        return (
            f"{self.path}: {self.what} written inline, refused: the job file is kept in plain text (job.yaml, the "
            f"spec ConfigMap, the pods' env, the RayJob's runtimeEnvYAML); {self.alternative} (a local run may "
            "accept it: torchrig run --allow-inline-secrets)"
        )

    def warning(self) -> str:
        """The line `JobSpec.warnings` prints when a local run accepted it."""
        return (
            f"{self.path}: {self.what} written inline (accepted by --allow-inline-secrets): it is stored in plain "
            "text in the run directory's job.yaml; " + self.alternative
        )


def _words(name: str) -> list[str]:
    return [w.lower() for w in _WORD_SPLIT.split(name) if w]


def _name_says_secret(name: str, context: _Context) -> bool:
    """Whether a map key names a credential (in `context`)."""
    if context is _Context.NAMES:
        return False
    words = _words(name)
    if not words or words[-1] in _ABOUT_WORDS:
        return False
    if context is _Context.OPTIONS and words == ["key"]:
        return True  # s3fs's access key id
    joined = "".join(words)
    if any(s in joined for s in _SECRET_SUBSTRINGS):
        return True
    if context is not _Context.GENERAL and any(w in _SECRET_WORDS for w in words):
        return True
    if context is _Context.GENERAL and (
        words == ["token"] or any(a in _TOKEN_QUALIFIERS and b == "token" for a, b in itertools.pairwise(words))
    ):
        return True
    if any(a in _KEY_QUALIFIERS and b == "key" for a, b in itertools.pairwise(words)):
        return True
    return context is _Context.ENV and len(words) > 1 and words[-1] == "key"


def _holds_value(value: Any, name: str, context: _Context) -> bool:
    """Whether a value under a credential-like name could be the credential itself."""
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, int | float):  # a number among fsspec's options may be a PIN; elsewhere a setting
        return context is _Context.OPTIONS and value != 0
    if not isinstance(value, str):
        return False
    text = value.strip()
    if not text or text.lower() in _NOT_SECRET_VALUES or _REFERENCE.fullmatch(text) or _PATH.fullmatch(text):
        return False
    return not ("token" in _words(name) and text in _TOKEN_METHODS)


def scan_value(text: str) -> str | None:
    """What `text` looks like if it holds a credential (e.g. "a GitHub token"), else None."""
    for what, pattern in _VALUE_SHAPES:
        if pattern.search(text):
            return what
    return None


def _key_path(prefix: str, key: str) -> str:
    if scan_value(key):
        return f"{prefix}[<redacted>]"  # a key can be the secret too: never echo it
    if _PLAIN_KEY.fullmatch(key):
        return f"{prefix}.{key}"
    return f"{prefix}[{key!r}]"


def _context_of(key: str, parent: _Context) -> _Context:
    if key in _NAME_MAPS and parent is _Context.GENERAL:
        return _Context.NAMES
    if key in _ENV_MAPS:
        return _Context.ENV
    if key == "options":
        return _Context.OPTIONS
    return parent


def _walk_data(node: Any, path: str, context: _Context) -> Iterator[Finding]:
    """Plain data (a free-form map or list): names and values."""
    if isinstance(node, str):
        what = scan_value(node)
        if what:
            yield Finding(path, what)
        return
    if isinstance(node, Mapping):
        yield from _walk_map(node, path, context)
    elif isinstance(node, Sequence) and not isinstance(node, bytes | bytearray):
        for i, item in enumerate(node):
            yield from _walk_data(item, f"{path}[{i}]", context)


def _walk_map(node: Mapping[Any, Any], path: str, context: _Context) -> Iterator[Finding]:
    has_access_key = any(isinstance(v, str) and _AWS_ACCESS_KEY.search(v) for v in node.values())
    for key in sorted(node, key=str):
        value = node[key]
        name = str(key)
        where = _key_path(path, name)
        if where.endswith("[<redacted>]"):
            yield Finding(where, f"a map key that looks like {scan_value(name)}")
        if isinstance(value, Mapping | list | tuple):
            yield from _walk_data(value, where, _context_of(name, context))
            continue
        what = scan_value(value) if isinstance(value, str) else None
        if what is None and has_access_key and isinstance(value, str) and _AWS_SECRET_KEY.fullmatch(value.strip()):
            what = "an AWS secret access key (beside an access key id)"
        if what is None and _name_says_secret(name, context) and _holds_value(value, name, context):
            what = "a value named like a credential"
        if what:
            yield Finding(where, what)


def _walk_model(model: BaseModel, path: str) -> Iterator[Finding]:
    for name, info in type(model).model_fields.items():
        key = info.alias or name
        value = getattr(model, name)
        where = f"{path}.{key}" if path else key
        if isinstance(value, BaseModel):
            yield from _walk_model(value, where)
        elif isinstance(value, Mapping):
            yield from _walk_map(value, where, _context_of(key, _Context.GENERAL))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from _walk_model(item, f"{where}[{i}]")
                else:
                    yield from _walk_data(item, f"{where}[{i}]", _Context.GENERAL)
        elif isinstance(value, str) and not isinstance(value, enum.Enum):
            what = scan_value(value)
            if what:
                yield Finding(where, what)


def inline_secrets(spec: BaseModel) -> list[Finding]:
    """Every credential written inline in a validated job (a `JobSpec`), in field order.

    Pure: reads the model, prints nothing. Paths are the YAML ones (`spec.kubernetes.env.HF_TOKEN`,
    `spec.checkpoint.stores[0].options.client_kwargs.aws_secret_access_key`).
    """
    return list(_walk_model(spec, ""))


# -- credentials among a store's fsspec options -----------------------------------------------------------

# Option keys of fsspec stores that hold a credential (s3fs `key`/`secret`/`token`, botocore's
# `aws_*` in `client_kwargs`, adlfs `account_key`/`sas_token`/`connection_string`, passwords). RE2 and
# Python read it alike: the chart uses it too (helm/torchrig/templates/_checks.tpl), as do the Kubernetes
# targets' checks, `--set` and `torchrig checkpoint --option`.
SECRET_OPTION_RE = re.compile(
    r"(?i)^key$|secret|passw|token|credential|private_key|account_key|connection_string|api_key|access_key"
)


def secret_option_paths(options: Mapping[str, Any], prefix: str) -> Iterator[str]:
    """Dotted paths (`prefix.key...`) of the credential-like keys in store `options`, depth first in key
    order (as Helm walks maps); gcsfs's `token` naming an authentication method is not one."""
    for key in sorted(options):
        value = options[key]
        path = f"{prefix}.{key}"
        if isinstance(value, Mapping):
            yield from secret_option_paths(value, path)
        elif SECRET_OPTION_RE.search(key) and not (
            key == "token" and isinstance(value, str) and value in _TOKEN_METHODS
        ):
            yield path


# -- the same rules for the Helm chart ---------------------------------------------------------------------

# A lookaround of one character class, the only kind the patterns above use: RE2 (Go, Helm) has none.
_LOOKBEHIND = re.compile(r"\(\?<!\[([^\]]*)\]\)")
_LOOKAHEAD = re.compile(r"\(\?!\[([^\]]*)\]\)")


def re2(pattern: str) -> str:
    """`pattern` without its one-class lookarounds, for RE2: `(?<![X])` becomes `(?:^|[^X])` and `(?![X])`
    `(?:[^X]|$)`. The translation consumes the neighbouring character, so it is equivalent for `search`
    (whether a text holds a match), which is all the chart asks; a test checks that on drawn texts."""
    out = _LOOKBEHIND.sub(lambda m: f"(?:^|[^{m.group(1)}])", pattern)
    out = _LOOKAHEAD.sub(lambda m: f"(?:[^{m.group(1)}]|$)", out)
    if "(?<" in out or "(?=" in out or "(?!" in out:
        raise ValueError(f"pattern {pattern!r} has a lookaround RE2 cannot express")
    return out


def chart_rules() -> dict[str, Any]:
    """Everything `inline_secrets` judges by, as data the Helm chart reads (`templates/_credentials.tpl`,
    generated by orchestrator/chart.py): the chart walks a job given as values, which never passes through
    the loader, and refuses what the loader would, with the loader's message."""
    marker = "@STORE@"
    store = Finding(f"spec.checkpoint.stores[0].{marker}", "").alternative.replace("spec.checkpoint.stores[0]", marker)
    return {
        "shapes": [[what, re2(pattern.pattern)] for what, pattern in _VALUE_SHAPES],
        "awsSecretKey": f"^(?:{_AWS_SECRET_KEY.pattern})$",
        "secretSubstrings": list(_SECRET_SUBSTRINGS),
        "secretWords": sorted(_SECRET_WORDS),
        "tokenQualifiers": sorted(_TOKEN_QUALIFIERS),
        "keyQualifiers": sorted(_KEY_QUALIFIERS),
        "envMaps": sorted(_ENV_MAPS),
        "nameMaps": sorted(_NAME_MAPS),
        "aboutWords": sorted(_ABOUT_WORDS),
        "tokenMethods": sorted(_TOKEN_METHODS),
        "notSecretValues": sorted(_NOT_SECRET_VALUES),
        "reference": f"^(?:{_REFERENCE.pattern})$",
        "path": f"^(?:{_PATH.pattern})$",
        "plainKey": _PLAIN_KEY.pattern,
        "alternatives": {
            "store": store,
            "initFrom": Finding("spec.checkpoint.initFrom", "").alternative,
            "ray": Finding("spec.ray.x", "").alternative,
            "other": Finding("spec.x", "").alternative,
        },
        "error": Finding("@PATH@", "@WHAT@").error().replace(Finding("@PATH@", "").alternative, "@ALT@"),
    }
