"""The embedded Ray of the Ray backend: a single-node Ray for one process, with token authentication on.

`torchrig run --backend ray` (and its detached supervisor, and the drills) start Ray in-process through
`embedded_ray`. Ray's token authentication (Ray >= 2.52, docs.ray.io "Ray token authentication") is on
for it, with a token that never touches the disk: Ray's own default for a new local Ray would write one to
~/.ray/auth_token, which outlives the run and is shared by every Ray of the user.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import Any

__all__ = ["RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "embedded_auth_env", "embedded_ray"]

# Ray's token authentication (Ray >= 2.52; docs.ray.io ray-security/token-auth): the mode, and where the
# token comes from: the variable's value, else the file it names, else ~/.ray/auth_token.
RAY_AUTH_MODE = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
_process_token: str | None = None  # one per process: Ray's token loader caches the first token it reads


def embedded_auth_env() -> dict[str, str]:
    """The environment that turns on Ray's token authentication for a Ray this process starts.

    The token is the user's own when `RAY_AUTH_TOKEN` or `RAY_AUTH_TOKEN_PATH` names one, else a random
    one made for this process and passed in the environment only (never ~/.ray/auth_token).
    """
    global _process_token
    if os.environ.get(RAY_AUTH_TOKEN) or os.environ.get(RAY_AUTH_TOKEN_PATH):
        return {RAY_AUTH_MODE: "token"}
    if _process_token is None:
        _process_token = secrets.token_hex(32)
    return {RAY_AUTH_MODE: "token", RAY_AUTH_TOKEN: _process_token}


@contextlib.contextmanager
def embedded_ray(num_cpus: int, *, log_to_driver: bool = True, **init_kwargs: Any) -> Iterator[Any]:
    """A single-node Ray for this process, with token authentication on, shut down on exit.

    Every Ray process (GCS, raylet, workers) inherits the token through the environment, and a client
    without it is refused. Ray 2.60 listens on every interface whatever the node address (it resolves
    127.0.0.1 to the machine's address), so the token is what keeps other hosts out; 127.0.0.1 is
    still what the node is told. An inherited `RAY_AUTH_MODE=disabled` does not apply here: this Ray
    is private to the run. The previous environment is put back afterwards.

    Args:
        num_cpus: Logical CPUs of the node.
        log_to_driver: Print the workers' output here.
        init_kwargs: More `ray.init` arguments (the tests give each Ray its own `_temp_dir`).

    Yields:
        `ray.init`'s context.
    """
    import ray

    auth = embedded_auth_env()
    saved = {key: os.environ.get(key) for key in auth}
    os.environ.update(auth)
    _reload_ray_config()
    try:
        yield ray.init(
            num_cpus=num_cpus,
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            log_to_driver=log_to_driver,
            **init_kwargs,
        )
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _reload_ray_config()


def _reload_ray_config() -> None:
    """Make this process's Ray read `RAY_AUTH_MODE` again: it reads it once, when `ray` is imported (Ray's
    own `ray.init` does the same when it turns token auth on: `authentication_token_setup`)."""
    from ray._raylet import Config  # type: ignore[attr-defined]  # not in the stub of the extension

    Config.initialize("")
