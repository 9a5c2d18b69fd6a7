"""Optional manifest signing: HMAC-SHA256 of the manifest with a key the job and the operator share.

Without a key a store is trusted like the image (docs/operations.md, "Trust boundary"): whoever can write
to it can make a job load anything. With a key (`TORCHRIG_CHECKPOINT_KEY`, `Env.CHECKPOINT_KEY`, set
from a Kubernetes Secret), every manifest the job writes carries `"signature": "hmac-sha256:<hex>"`,
and a manifest that is unsigned or wrongly signed is never restored (nor used by `initFrom`);
`torchrig checkpoints verify` reports why. The manifest holds the sha256 of every file of the
checkpoint, and restore checks every file against it before loading, so an authentic manifest
authenticates the whole checkpoint.

What is signed: the manifest's JSON object without its `signature` member, serialised canonically
(keys sorted, no whitespace, ASCII), so the signature survives re-indentation and covers members a
newer version adds.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from typing import Any

from training.contract import Env

__all__ = ["MIN_KEY_BYTES", "SIGNATURE_FIELD", "SignatureError", "check_signature", "sign", "signing_key_from_env"]

SIGNATURE_FIELD = "signature"
MIN_KEY_BYTES = 16
_PREFIX = "hmac-sha256:"
_SIGNATURE_CHARS = len(_PREFIX) + 2 * hashlib.sha256().digest_size


class SignatureError(ValueError):
    """A manifest is unsigned or its signature does not match, while a signing key is configured."""


def signing_key_from_env(env: Mapping[str, str] | None = None) -> bytes | None:
    """The signing key from `Env.CHECKPOINT_KEY` (its UTF-8 bytes), or None when unset or empty.

    Raises:
        ValueError: The key is shorter than `MIN_KEY_BYTES` bytes (use e.g. `openssl rand -hex 32`).
    """
    value = (os.environ if env is None else env).get(Env.CHECKPOINT_KEY, "")
    if not value:
        return None
    key = value.encode()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{Env.CHECKPOINT_KEY} is shorter than {MIN_KEY_BYTES} bytes; use e.g. `openssl rand -hex 32`")
    return key


def _canonical(payload: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in payload.items() if k != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(payload: Mapping[str, Any], key: bytes) -> str:
    """The signature of a manifest's JSON object (its `signature` member, if any, excluded)."""
    return _PREFIX + hmac.new(key, _canonical(payload), hashlib.sha256).hexdigest()


def check_signature(payload: Mapping[str, Any], key: bytes) -> None:
    """Raise SignatureError unless `payload` carries a valid signature under `key`.

    The signature member is a store's text: any JSON value can sit there (a number, a list, a huge or
    non-ASCII string, on which `hmac.compare_digest` raises TypeError). Whatever it holds, the outcome is
    a SignatureError for this one manifest, never another exception.
    """
    found = payload.get(SIGNATURE_FIELD)
    if found is None:
        raise SignatureError("unsigned manifest (a signing key is configured)")
    if not isinstance(found, str) or len(found) != _SIGNATURE_CHARS or not found.isascii():
        raise SignatureError(f"manifest signature is malformed (not {_PREFIX}<64 hex digits>)")
    try:
        expected = sign(payload, key)
    except (ValueError, TypeError, RecursionError) as exc:  # a body json cannot write back (too deep)
        raise SignatureError(f"manifest cannot be checked against its signature ({type(exc).__name__})") from None
    if not hmac.compare_digest(found.encode(), expected.encode()):
        raise SignatureError("manifest signature does not match the configured key")
