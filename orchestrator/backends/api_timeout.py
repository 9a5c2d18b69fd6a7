"""How long one call to a cluster's API (Kubernetes, the Ray Jobs API) may take before the CLI gives up.

A dead or unreachable API server must give a one-line error, not a hung command: every Kubernetes
client call passes `_request_timeout=(connect, read)` and every Jobs API request a `timeout=(connect,
read)`, both from `api_timeout()`. Neither client retries a call that timed out, so a command that
makes one call fails within `connect_s + read_s`. `TORCHRIG_API_TIMEOUT` overrides the default: one
number for both (`5`) or `CONNECT,READ` (`5,120`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from orchestrator.errors import SpecError
from training.contract import Env

__all__ = ["DEFAULT_CONNECT_S", "DEFAULT_READ_S", "STREAM_READ_S", "ApiTimeout", "api_timeout"]

DEFAULT_CONNECT_S = 10.0  # a TCP connect to a healthy API server takes milliseconds
DEFAULT_READ_S = 30.0  # the slowest single call: a server-side dry run of a large object
STREAM_READ_S = 86400.0  # a followed log may be quiet for as long as a step or an evaluation takes


@dataclass(frozen=True)
class ApiTimeout:
    """Seconds to wait for the connection and then for each read of the answer."""

    connect_s: float = DEFAULT_CONNECT_S
    read_s: float = DEFAULT_READ_S

    def pair(self) -> tuple[float, float]:
        """`(connect, read)`: the form both `_request_timeout` and requests' `timeout` take."""
        return (self.connect_s, self.read_s)

    def stream(self) -> tuple[float, float]:
        """For a stream that may stay silent for long (`logs --follow`): the connect as usual, a day per
        read (the Kubernetes client takes no unbounded read; the call before it checked the server)."""
        return (self.connect_s, STREAM_READ_S)


def api_timeout(env: Mapping[str, str] | None = None) -> ApiTimeout:
    """The timeout of cluster API calls: `TORCHRIG_API_TIMEOUT` (`S` or `CONNECT,READ`), else the default.

    Raises:
        SpecError: the variable is not one or two positive numbers.
    """
    text = (os.environ if env is None else env).get(Env.API_TIMEOUT, "").strip()
    if not text:
        return ApiTimeout()
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or not all(v > 0 for v in values):
        raise SpecError(f"{Env.API_TIMEOUT}={text!r}: expected seconds (`5`) or `CONNECT,READ` (`5,120`), all > 0")
    return ApiTimeout(values[0], values[-1])
