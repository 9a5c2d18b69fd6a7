"""Shared bench plumbing: repeats, medians and spreads, subprocess launches, result files."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PY = sys.executable

BENCH_ENV = {
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}


def stats(values: Sequence[float]) -> dict[str, float]:
    """Median and spread (min, max, relative IQR-ish half range) of repeated measurements."""
    vals = sorted(float(v) for v in values)
    med = statistics.median(vals)
    return {
        "median": med,
        "min": vals[0],
        "max": vals[-1],
        "spread_pct": 100.0 * (vals[-1] - vals[0]) / (2 * abs(med)) if med else 0.0,
        "n": float(len(vals)),
    }


def repeat(fn: Callable[[], float], n: int) -> list[float]:
    return [fn() for _ in range(n)]


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ)
    out.update(BENCH_ENV)
    out.update(extra)
    out["PYTHONPATH"] = str(REPO) + os.pathsep + out.get("PYTHONPATH", "")
    return out


def run(
    cmd: list[str], *, cwd: Path | None = None, timeout: float = 600, extra_env: dict[str, str] | None = None
) -> str:
    """Run a command, raising with its output tail when it fails."""
    proc = subprocess.run(
        cmd, cwd=cwd, env=env(**(extra_env or {})), capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:6])}... exited {proc.returncode}:\n{tail}")
    return proc.stdout


def throughput_from_records(records: list[dict[str, Any]], global_batch: int, skip_steps: int) -> float:
    """Samples/s between the first record after `skip_steps` (warm-up) and the last one."""
    recs = sorted((r for r in records if int(r["step"]) >= skip_steps), key=lambda r: float(r["time"]))
    if len(recs) < 2:
        raise ValueError("not enough step records to measure throughput")
    steps = int(recs[-1]["step"]) - int(recs[0]["step"])
    seconds = float(recs[-1]["time"]) - float(recs[0]["time"])
    return steps * global_batch / seconds


def write_results(results: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "latest.json"
    path.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    return path


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
