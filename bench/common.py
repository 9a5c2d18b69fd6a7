"""Shared bench plumbing: repeats, medians and spreads, subprocess launches, the digits job file."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from training.contract import Env

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PY = sys.executable
DIGITS = REPO / "examples" / "digits-ddp.yaml"

BENCH_ENV = {
    Env.DISABLE_SHARED_RDZV_STORE: "1",
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


def digits_spec_file(directory: Path, overrides: list[str], name: str = "bench-digits") -> Path:
    """The digits example renamed `name`, with `--set` overrides (the CLI's own `apply_overrides`), written
    into `directory` where a run can read it."""
    import yaml

    from orchestrator.loader import apply_overrides, read_yaml

    doc = apply_overrides(read_yaml(DIGITS.read_text(), str(DIGITS)), [f"metadata.name={name}", *overrides])
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
