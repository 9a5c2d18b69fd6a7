"""Container health check: `python -m training.healthcheck` exits 0 while this pod's worker is healthy.

Healthy means one of:

- the local rank 0 exporter answers on `metrics.port` and its last-step timestamp is more recent than the
  longer of `restarts.stepTimeoutSeconds` and `checkpoint.ioTimeoutSeconds` (a restore or the final save
  completes no step for up to the latter). The exporter starts that timestamp at process start, so a
  worker stuck in a restore turns unhealthy no earlier than the watchdog;
- no exporter answers yet and the container started less than `--start-budget-s` seconds ago: the
  launcher is in its preflight, torchrun's rendezvous or the first restore (the Kubernetes liveness probe
  passes this budget; the container's age is its PID 1's, from /proc);
- no exporter answers and this container stands by (`restarts.spareNodes`): a standby node runs no
  trainer, hence no exporter, until it takes a lost node's ranks (`mark_standby`).

Kubernetes runs it as the liveness probe only: no startup probe gates readiness on the rendezvous, so a
pod is Ready (and its Service name resolves) from its container's start, which the rendezvous host needs
(orchestrator/compile/pytorchjob.py). Docker's HEALTHCHECK runs it without a budget (its `--start-period`
covers the start). Standard library only: adds nothing to the image.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from training.contract import Env

LAST_STEP_METRIC = "torchrig_last_step_timestamp_seconds"
# In the run directory while this container stands by; holds the container's start (`container_start`),
# so a marker left by an earlier container of the same pod (the run directory is an emptyDir) is ignored.
STANDBY_MARKER = "standby"


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


def container_start(proc: str = "/proc") -> str | None:
    """The start of this PID namespace's PID 1 (clock ticks since boot, /proc/1/stat field 22), or None."""
    try:
        stat = Path(proc, "1", "stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces and parentheses
    return fields[19] if len(fields) > 19 else None


def container_age_s(proc: str = "/proc") -> float | None:
    """Seconds since this container's PID 1 started, or None where /proc does not tell."""
    start = container_start(proc)
    try:
        uptime = float(Path(proc, "uptime").read_text().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return None if start is None else max(0.0, uptime - int(start) / ticks)


def _marker(run_dir: str | None) -> Path | None:
    run_dir = run_dir if run_dir is not None else os.environ.get(Env.RUN_DIR)
    return Path(run_dir, STANDBY_MARKER) if run_dir else None


def mark_standby(run_dir: str | None = None) -> None:
    """Record that this container stands by (no exporter until it takes a node); best effort."""
    marker, start = _marker(run_dir), container_start()
    if marker is not None and start is not None:
        with contextlib.suppress(OSError):
            marker.write_text(start)


def clear_standby(run_dir: str | None = None) -> None:
    """This container no longer stands by (it took a node's ranks, or it ends)."""
    marker = _marker(run_dir)
    if marker is not None:
        with contextlib.suppress(OSError):
            marker.unlink()


def standing_by(run_dir: str | None = None) -> bool:
    """Whether this container (not an earlier one of the pod) marked itself standing by."""
    marker = _marker(run_dir)
    try:
        return marker is not None and marker.read_text() == container_start()
    except OSError:
        return False


def check(
    url: str,
    max_age_s: float,
    now: float | None = None,
    *,
    start_budget_s: float = 0.0,
    age_s: float | None = None,
    standby: bool = False,
) -> tuple[bool, str]:
    """Probe one exporter; returns (healthy, reason). `age_s` is the container's age (None: unknown)."""
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            body = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        if standby:
            return True, "standing by: no exporter until this node takes a lost node's ranks"
        if age_s is not None and age_s < start_budget_s:
            return True, f"starting ({age_s:.0f}s of {start_budget_s:.0f}s): no exporter yet"
        return False, f"exporter at {url} not answering: {exc}"
    last = parse_last_step(body)
    if last is None:
        return True, "exporter up, no step completed yet"
    age = (now if now is not None else time.time()) - last
    if age > max_age_s:
        return False, f"no step completed for {age:.0f}s (limit {max_age_s:.0f}s)"
    return True, f"last step {age:.0f}s ago"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.healthcheck")
    parser.add_argument(
        "--start-budget-s",
        type=float,
        default=0.0,
        help="healthy without an exporter while the container is younger than this (rendezvous, first restore)",
    )
    args = parser.parse_args(argv)
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
    healthy, reason = check(
        f"http://127.0.0.1:{port}/metrics",
        max_age or 600.0,
        start_budget_s=args.start_budget_s,
        age_s=container_age_s() if args.start_budget_s > 0 else None,
        standby=standing_by(),
    )
    print(("healthy: " if healthy else "unhealthy: ") + reason)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
