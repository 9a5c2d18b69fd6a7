"""Orders in the job's store: the job's secret, the MAC every order carries, and the records they hold.

The store that in-place recovery, standby nodes and a store-only rendezvous pod share (a torch
`TCPStore`) has no authentication of its own: any process that reaches its port can `set` any key. So
every value that makes a process act (a spare's assignment, a standby's promotion, a job's failure or
success, the round record, a rank's owner, an exit code, ...) is written as `MAC.value`, where MAC is
HMAC-SHA256 with the job's secret over the full key (prefix included: a value copied under another key,
another round or another run does not check) and the value. A reader that finds a value whose MAC does
not check ignores it, logs it once per key (`Signer.open`), and goes on as if it were not there. Counters
(`TCPStore.add`) cannot carry a MAC: `training.inplace` says of each what forging it can do.

The secret is a file every process of the job can read and outsiders cannot (`Env.JOB_SECRET_FILE`: a
local run's `secret` in its run directory, mode 0600; in a pod the job's Kubernetes Secret, mounted
read-only). torch's own keys (the rendezvous, gloo's peer addresses) carry none: docs/operations.md,
"Trust boundary", says what that leaves.

The environment a host or a standby hands a spare (`Assignment`, `Promotion`) is a typed record: only
the launcher variables of a `WorkerIdentity` (`IDENTITY_ENV`), each validated; anything else is refused.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from training.contract.env import Env, WorkerIdentity

__all__ = [
    "IDENTITY_ENV",
    "MAX_ORDER_BYTES",
    "SECRET_BYTES",
    "SECRET_FILE",
    "Assignment",
    "OrderError",
    "Promotion",
    "SecretError",
    "Signer",
    "create_job_secret",
    "forged",
    "load_job_secret",
]

log = logging.getLogger(__name__)

SECRET_FILE = "secret"  # a local run's secret, in its run directory
SECRET_BYTES = 32  # what `create_job_secret` writes, and the least a secret file may hold
MAX_SECRET_BYTES = 4096  # a secret file is read this far, no further
MAX_ORDER_BYTES = 64 * 1024  # a longer store value is no order of ours (an assignment is ~300 bytes)
MAX_LOGGED_KEYS = 64  # forged keys logged one by one; past that, one line says the rest are not
_MAC_HEX = 64

# What a host or a standby hands a spare: the launcher variables that make up a `WorkerIdentity`.
IDENTITY_ENV = (
    Env.RANK,
    Env.WORLD_SIZE,
    Env.LOCAL_RANK,
    Env.LOCAL_WORLD_SIZE,
    Env.GROUP_RANK,
    Env.GROUP_WORLD_SIZE,
    Env.RESTART_COUNT,
    Env.RUN_ID,
)
_INT_ENV = frozenset(IDENTITY_ENV) - {Env.RUN_ID}
_INT = re.compile(r"[0-9]{1,9}")
# A torchrun `--rdzv-id` (a job's name, the local plan's name and suffix, a user's own id): never a path.
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}")


class SecretError(ValueError):
    """The job's secret file is set but unusable (missing, not a regular file, too short)."""


class OrderError(ValueError):
    """A store value that is no valid order (after its MAC checked, or before: not JSON, wrong shape)."""


def load_job_secret(env: Mapping[str, str] | None = None) -> bytes | None:
    """The job's secret, read from the file `Env.JOB_SECRET_FILE` names; None when it names none.

    Read with a bound, a regular file only (not a FIFO that blocks, not a device), and at least
    `SECRET_BYTES` long: a short secret is guessable.

    Raises:
        SecretError: the variable is set and the file is unusable (the message names the variable).
    """
    env = os.environ if env is None else env
    path = env.get(Env.JOB_SECRET_FILE, "")
    if not path:
        return None
    where = f"{Env.JOB_SECRET_FILE}={path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        # O_NOFOLLOW: a Kubernetes Secret volume's file is a symlink into `..data/`; follow it then.
        if exc.errno != errno.ELOOP:
            raise SecretError(f"{where}: {exc.strerror or exc}") from None
        try:
            fd = os.open(os.path.realpath(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as again:
            raise SecretError(f"{where}: {again.strerror or again}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SecretError(f"{where}: not a regular file")
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_BYTES:
        raise SecretError(f"{where}: longer than {MAX_SECRET_BYTES} bytes")
    if len(data) < SECRET_BYTES:
        raise SecretError(f"{where}: holds {len(data)} bytes; at least {SECRET_BYTES} are needed")
    return data  # as it is, newline and all: every process of the job reads the same file


def create_job_secret(path: str | os.PathLike[str]) -> str:
    """Create a new secret at `path` (`SECRET_BYTES` random bytes, mode 0600, never over an existing
    file), or keep the one there (a resumed run: its processes of before may still be alive); returns
    the path as a string.

    Raises:
        SecretError: the file exists and is unusable.
    """
    where = os.fspath(path)
    try:
        fd = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        load_job_secret({Env.JOB_SECRET_FILE: where})  # the one there must be usable
        return where
    try:
        os.write(fd, secrets.token_bytes(SECRET_BYTES))
    finally:
        os.close(fd)
    return where


@dataclass(frozen=True)
class Signer:
    """Signs and checks orders with the job's secret.

    Attributes:
        secret: The job's secret (`load_job_secret`).
    """

    secret: bytes = field(repr=False)

    def _mac(self, key: str, value: bytes) -> str:
        # The key's length first: (key, value) pairs never collide however the key's text ends.
        message = f"{len(key)}:{key}:".encode() + value
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def sign(self, key: str, value: str) -> str:
        """`value` as it is stored under `key` (the full key, prefix included): `MAC.value`."""
        return f"{self._mac(key, value.encode())}.{value}"

    def open(self, key: str, raw: bytes | str) -> str | None:
        """The value of order `raw` stored under `key`, or None (logged once per key) when its MAC does
        not check: no MAC, another key's, a changed value, too long, not text."""
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        why = None
        if len(data) > MAX_ORDER_BYTES:
            why = f"{len(data)} bytes"
        elif len(data) <= _MAC_HEX or data[_MAC_HEX : _MAC_HEX + 1] != b".":
            why = "no MAC"
        else:
            mac, value = data[:_MAC_HEX], data[_MAC_HEX + 1 :]
            if not hmac.compare_digest(mac, self._mac(key, value).encode()):
                why = "its MAC does not check"
            else:
                try:
                    return value.decode()
                except UnicodeDecodeError:
                    why = "not UTF-8"
        forged(key, why)
        return None


_logged: set[str] = set()
_logged_lock = threading.Lock()


def forged(key: str, why: str) -> None:
    """Log an order that was ignored: once per key, and at most `MAX_LOGGED_KEYS` keys per process (a
    flood of forgeries must not fill the logs)."""
    with _logged_lock:
        if key in _logged or len(_logged) > MAX_LOGGED_KEYS:
            return
        _logged.add(key)
        full = len(_logged) > MAX_LOGGED_KEYS
    if full:
        log.warning("more store values that are no orders of this job are ignored without a log line")
        return
    log.warning("ignored a store value that is no order of this job (%s): %s", why, key[:200])


def _identity_env(data: Any, what: str) -> dict[str, str]:
    """The `env` map of an order: exactly the launcher variables of `IDENTITY_ENV`, validated."""
    if not isinstance(data, dict):
        raise OrderError(f"{what}.env: not a map")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise OrderError(f"{what}.env: an entry that is not a string")
    unknown = sorted(set(data) - set(IDENTITY_ENV))
    if unknown:
        raise OrderError(f"{what}.env.{unknown[0][:64]}: not a launcher variable a spare may be handed")
    missing = [name for name in IDENTITY_ENV if name not in data]
    if missing:
        raise OrderError(f"{what}.env.{missing[0]}: missing")
    for name in _INT_ENV:
        if not _INT.fullmatch(data[name]):
            raise OrderError(f"{what}.env.{name}: {data[name][:32]!r} is not a non-negative integer")
    if not _RUN_ID.fullmatch(data[Env.RUN_ID]):
        raise OrderError(f"{what}.env.{Env.RUN_ID}: {data[Env.RUN_ID][:32]!r} is not a run id")
    try:
        WorkerIdentity.from_env(data)  # rank within the world, local rank within the node
    except ValueError as exc:
        raise OrderError(f"{what}.env: {exc}") from None
    return {name: data[name] for name in IDENTITY_ENV}


def _object(text: str, what: str) -> dict[str, Any]:
    if len(text) > MAX_ORDER_BYTES:
        raise OrderError(f"{what}: {len(text)} bytes")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise OrderError(f"{what}: not JSON") from None
    if not isinstance(data, dict):
        raise OrderError(f"{what}: not a JSON object")
    return data


def _count(data: dict[str, Any], name: str, what: str) -> int:
    value = data.get(name)
    if type(value) is not int or not 0 <= value < 2**31:
        raise OrderError(f"{what}.{name}: not a non-negative integer")
    return value


@dataclass(frozen=True)
class Assignment:
    """A spare's orders (`InPlace.spare_key(i, "assign")`): the rank it becomes and the generation it joins.

    Attributes:
        env: The rank's launcher variables (`IDENTITY_ENV`, nothing else).
        generation: The process-group generation to join.
    """

    env: dict[str, str]
    generation: int

    def to_json(self) -> str:
        return json.dumps({"env": self.env, "generation": self.generation})

    @classmethod
    def parse(cls, text: str) -> Assignment:
        """From its JSON form. Raises `OrderError` (one line naming the field) on anything else."""
        data = _object(text, "assign")
        return cls(env=_identity_env(data.get("env"), "assign"), generation=_count(data, "generation", "assign"))


@dataclass(frozen=True)
class Promotion:
    """A standby host's orders (`InPlace.promote_key`): the lost node it now hosts a rank of.

    Attributes:
        env: The rank's launcher variables (`IDENTITY_ENV`, nothing else).
        node: The lost node's index.
        next_spare: The index the node's next spare takes.
    """

    env: dict[str, str]
    node: int
    next_spare: int

    def to_json(self) -> str:
        return json.dumps({"env": self.env, "node": self.node, "next_spare": self.next_spare})

    @classmethod
    def parse(cls, text: str) -> Promotion:
        """From its JSON form. Raises `OrderError` (one line naming the field) on anything else."""
        data = _object(text, "promote")
        env = _identity_env(data.get("env"), "promote")
        node = _count(data, "node", "promote")
        if env[Env.GROUP_RANK] != str(node):
            raise OrderError(f"promote.node: {node} is not the rank's node {env[Env.GROUP_RANK]}")
        return cls(env=env, node=node, next_spare=_count(data, "next_spare", "promote"))
