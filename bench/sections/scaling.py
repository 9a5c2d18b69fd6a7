"""Scaling: checkpoint save, restore and MTTR against world size, from kill-worker drills (local, tiny model).

The drills recover in place (`restarts.mode: inplace`, which `auto` also chooses on one node; the
drill's kill waits until a warm spare is ready): the MTTR target is flat, world size 8 at most 1.5x
world size 2 (`mttr_ratio_max_vs_min`). Restore times come from restart-path runs
only (in place nothing is restored), so they are NaN here unless a run fell back.

On a machine with fewer cores than ranks, a larger world size also means less CPU per rank, and every
collective round of the recovery slows with it. `equal_cpu_per_rank` separates the two: the same drills
at half of each world size, pinned to half the cores (`sched_setaffinity`, inherited by every process
of the run), have the CPU per rank of the full size on all cores. Each doubling of the world size at
equal CPU per rank is then one ratio, and their product estimates the largest/smallest ratio on a
machine with a core per rank."""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.sections.base import Section
from bench.workloads import kill_worker_drill
from training.contract import EventKind, RunFiles, read_events, read_jsonl

# A recovery this much slower than the in-place path's ~0.1-0.2 s here is kept for a look: its run
# directory's events and logs go to `bench/_tmp/outliers/` (one 5.1 s recovery at 4 ranks in session
# 16 left nothing to read).
OUTLIER_MTTR_S = 1.0
OUTLIERS = Path(__file__).resolve().parents[1] / "_tmp" / "outliers"


def _keep_outlier(run_dir: Path, w: int, mttr: float) -> None:
    dest = OUTLIERS / f"scaling-w{w}-{time.strftime('%Y%m%d-%H%M%S')}-mttr{mttr:.2f}"
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("checkpoints", "*.distcp"), dirs_exist_ok=True)
    print(f"scaling: a {mttr:.2f} s recovery at {w} ranks; its run directory is kept in {dest}", flush=True)


def _one_drill(w: int, kill_step: int = 35) -> dict[str, Any]:
    """One kill-worker drill at world size `w`: its MTTR, path, save/restore times, CPU, phases and the
    step time before the kill."""
    with tempfile.TemporaryDirectory() as d:
        report = kill_worker_drill(40, kill_step, w, Path(d), extra=("spec.restarts.mode=inplace",))
        events = read_events(RunFiles(report.run_dir).events)
        metrics = read_jsonl(RunFiles(report.run_dir).metrics)
        if report.mttr_seconds is not None and report.mttr_seconds > OUTLIER_MTTR_S:
            _keep_outlier(Path(report.run_dir), w, float(report.mttr_seconds))
    # A step's time at this world size, before the kill: the MTTR ends with one completed step, and on
    # this machine's 2 cores a step of 8 ranks takes about 4x one of 2 (8 processes share the cores).
    step_s = [
        float(m["step_s"])
        for m in metrics
        if isinstance(m.get("step_s"), (int, float)) and isinstance(m.get("step"), int) and 5 < m["step"] < kill_step
    ]
    commits = [
        float(e.get("save_s"))
        for e in events
        if e.kind is EventKind.CHECKPOINT_COMMITTED and e.get("save_s") is not None
    ]
    restores = [float(e.get("seconds")) for e in events if e.kind is EventKind.RESTORE and e.get("seconds") is not None]
    # CPU each member spent in its recovery: flat while MTTR grows = the members wait for cores
    spent = sorted(
        float(e.get("cpu_s"))
        for e in events
        if e.kind is EventKind.RECOVERY and e.get("path") == "inplace" and e.get("cpu_s") is not None
    )
    # Where the survivors' recovery time went: the median member's end of each phase (seconds).
    survivors = [
        e.get("phases") or {}
        for e in events
        if e.kind is EventKind.RECOVERY and e.get("path") == "inplace" and e.get("role") == "survivor"
    ]
    recovered = [
        float(e.get("seconds"))
        for e in events
        if e.kind is EventKind.RECOVERY and e.get("role") == "survivor" and e.get("seconds") is not None
    ]
    return {
        "mttr": float(report.mttr_seconds),
        "step": statistics.median(step_s) if step_s else float("nan"),
        "recovery": statistics.median(recovered) if recovered else float("nan"),
        "path": report.recovery_path,
        "save": max(commits, default=float("nan")),
        "restore": max(restores, default=float("nan")),
        "cpu": spent[len(spent) // 2] if spent else float("nan"),
        "phases": {
            name: statistics.median(float(p[name]) for p in survivors if name in p)
            for name in (survivors[0] if survivors else {})
        },
    }


def _median(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.median(finite) if finite else float("nan")


@contextmanager
def _pinned(cores: set[int]) -> Iterator[None]:
    """This process (and every process it starts meanwhile) on `cores` only."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _equal_cpu_per_rank(world_sizes: list[int], mttr_s: list[float], repeats: int) -> dict[str, Any] | None:
    """MTTR at half of each world size on half the cores; each doubling's ratio at equal CPU per rank."""
    cores = sorted(os.sched_getaffinity(0))
    half = [w // 2 for w in world_sizes if w // 2 >= 2]
    if len(cores) < 2 or not half:
        return None
    pinned_cores = set(cores[: len(cores) // 2])
    runs: dict[int, list[float]] = {w: [] for w in half}
    with _pinned(pinned_cores):
        for _ in range(repeats):
            for w in half:
                runs[w].append(_one_drill(w)["mttr"])
    pinned = {w: _median(runs[w]) for w in half}
    full = dict(zip(world_sizes, mttr_s, strict=True))
    doublings = [
        {"world_sizes": [w // 2, w], "ranks_per_core": w / len(cores), "ratio": full[w] / pinned[w // 2]}
        for w in world_sizes
        if w // 2 in pinned and pinned[w // 2] > 0
    ]
    return {
        "cores": len(cores),
        "pinned_cores": len(pinned_cores),
        "pinned_world_sizes": half,
        "pinned_mttr_s": [pinned[w] for w in half],
        "pinned_mttr_s_runs": [[round(v, 4) for v in runs[w]] for w in half],
        "doublings": doublings,
        # the product of the doublings: largest/smallest world size with the same CPU per rank throughout
        "mttr_ratio_max_vs_min": math.prod(d["ratio"] for d in doublings) if doublings else float("nan"),
    }


def bench_scaling(world_sizes: list[int], repeats: int = 3, equal_cpu: bool = True) -> dict[str, Any]:
    """Checkpoint save, restore and MTTR against world size (local, tiny model), from kill-worker drills:
    `repeats` drills per size, taken in rounds over the sizes (2, 4, 8, 2, 4, 8, ...) so that the
    machine's drift reaches every size alike; the medians are reported, every run's MTTR too. With
    `equal_cpu`, also the drills of `equal_cpu_per_rank` (module docstring)."""
    runs: dict[int, list[dict[str, Any]]] = {w: [] for w in world_sizes}
    for _ in range(repeats):
        for w in world_sizes:
            runs[w].append(_one_drill(w))
    mttr_s = [_median([r["mttr"] for r in runs[w]]) for w in world_sizes]
    phases = []
    for w in world_sizes:
        middle = sorted(runs[w], key=lambda r: r["mttr"])[len(runs[w]) // 2]  # the median run's phases
        phases.append(middle["phases"])
    out: dict[str, Any] = {
        "world_sizes": world_sizes,
        "repeats": repeats,
        "save_s": [_median([r["save"] for r in runs[w]]) for w in world_sizes],
        "restore_s": [_median([r["restore"] for r in runs[w]]) for w in world_sizes],
        "mttr_s": mttr_s,
        "mttr_s_runs": [[round(r["mttr"], 4) for r in runs[w]] for w in world_sizes],
        "recovery_paths": [sorted({str(r["path"]) for r in runs[w]}) for w in world_sizes],
        "recovery_cpu_s_median": [_median([r["cpu"] for r in runs[w]]) for w in world_sizes],
        # The survivors' own recovery (failure seen -> ready to step) and a step's time: the MTTR is
        # about the detection, this recovery and one step; only the recovery is the mechanism's.
        "survivor_recovery_s": [_median([r["recovery"] for r in runs[w]]) for w in world_sizes],
        "step_s": [_median([r["step"] for r in runs[w]]) for w in world_sizes],
        "survivor_phases_median": phases,
    }
    if mttr_s and mttr_s[0] > 0:
        out["mttr_ratio_max_vs_min"] = mttr_s[-1] / mttr_s[0]
        out["target"] = "in-place MTTR at the largest world size <= 1.5x the smallest (medians)"
    rec = out["survivor_recovery_s"]
    if rec and rec[0] == rec[0] and rec[0] > 0:
        out["survivor_recovery_ratio_max_vs_min"] = rec[-1] / rec[0]
    equal = _equal_cpu_per_rank(world_sizes, mttr_s, repeats) if equal_cpu else None
    if equal is not None:
        out["equal_cpu_per_rank"] = equal
    return out


SECTION = Section(
    "scaling", lambda quick: bench_scaling([2, 4], 1, equal_cpu=False) if quick else bench_scaling([2, 4, 8], 3)
)
