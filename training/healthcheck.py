"""Container health check: `python -m training.healthcheck` exits 0 while this pod's worker is healthy.

Healthy means the local rank 0 exporter answers on `metrics.port` and its last-step timestamp is more
recent than the longer of `restarts.stepTimeoutSeconds` and `checkpoint.ioTimeoutSeconds` (a restore or
the final save completes no step for up to the latter). The exporter starts that timestamp at process
start, so a worker stuck in rendezvous or restore turns unhealthy no earlier than the watchdog; Docker's
`--start-period` covers the time before the exporter is up. Standard library only: adds nothing to the image.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request

from training.contract import Env

LAST_STEP_METRIC = "torchrig_last_step_timestamp_seconds"


def parse_last_step(exposition: str) -> float | None:
    """The newest last-step timestamp in a Prometheus text exposition (None before the first step)."""
    newest: float | None = None
    for line in exposition.splitlines():
        if line.startswith(LAST_STEP_METRIC) and not line.startswith("#"):
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            if value > 0 and (newest is None or value > newest):
                newest = value
    return newest


def check(url: str, max_age_s: float, now: float | None = None) -> tuple[bool, str]:
    """Probe one exporter; returns (healthy, reason)."""
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            body = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        return False, f"exporter at {url} not answering: {exc}"
    last = parse_last_step(body)
    if last is None:
        return True, "exporter up, no step completed yet"
    age = (now if now is not None else time.time()) - last
    if age > max_age_s:
        return False, f"no step completed for {age:.0f}s (limit {max_age_s:.0f}s)"
    return True, f"last step {age:.0f}s ago"


def main() -> int:
    port = int(os.environ.get(Env.METRICS_PORT, "9400"))
    max_age = float(os.environ.get(Env.HEALTH_MAX_STEP_AGE_S, "0")) or None
    spec_path = os.environ.get(Env.SPEC)
    if spec_path and os.path.exists(spec_path):
        from training.config import load_worker_spec

        try:
            spec = load_worker_spec(spec_path).spec
        except ValueError:
            spec = None
        if spec is not None:
            port = spec.metrics.port
            # A restore or the final save completes no step for up to `checkpoint.ioTimeoutSeconds`.
            max_age = max_age or max(spec.restarts.step_timeout_seconds, spec.checkpoint.io_timeout_seconds)
    healthy, reason = check(f"http://127.0.0.1:{port}/metrics", max_age or 600.0)
    print(("healthy: " if healthy else "unhealthy: ") + reason)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
