"""Scaling: checkpoint save, restore and MTTR against world size, from kill-worker drills (local, tiny model).

The drills recover in place (`restarts.mode: inplace`, which `auto` also chooses on one node; the
drill's kill waits until a warm spare is ready): the MTTR target is flat, world size 8 at most 1.5x
world size 2 (`mttr_ratio_max_vs_min`). Restore times come from restart-path runs
only (in place nothing is restored), so they are NaN here unless a run fell back."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.sections.base import Section
from bench.workloads import kill_worker_drill
from training.contract import EventKind, RunFiles, read_events


def bench_scaling(world_sizes: list[int]) -> dict[str, Any]:
    """Checkpoint save, restore and MTTR against world size (local, tiny model), from kill-worker drills."""
    save_s, restore_s, mttr_s, paths, cpu_s = [], [], [], [], []
    phases: list[dict[str, float]] = []
    for w in world_sizes:
        with tempfile.TemporaryDirectory() as d:
            report = kill_worker_drill(40, 35, w, Path(d), extra=("spec.restarts.mode=inplace",))
            events = read_events(RunFiles(report.run_dir).events)
        mttr_s.append(float(report.mttr_seconds))
        paths.append(report.recovery_path)
        commits = [
            float(e.get("save_s"))
            for e in events
            if e.kind is EventKind.CHECKPOINT_COMMITTED and e.get("save_s") is not None
        ]
        restores = [
            float(e.get("seconds")) for e in events if e.kind is EventKind.RESTORE and e.get("seconds") is not None
        ]
        # CPU each member spent in its recovery: flat while MTTR grows = the members wait for cores
        spent = sorted(
            float(e.get("cpu_s"))
            for e in events
            if e.kind is EventKind.RECOVERY and e.get("path") == "inplace" and e.get("cpu_s") is not None
        )
        cpu_s.append(spent[len(spent) // 2] if spent else float("nan"))
        # Where the survivors' recovery time went: the median member's end of each phase (seconds).
        survivors = [
            e.get("phases") or {}
            for e in events
            if e.kind is EventKind.RECOVERY and e.get("path") == "inplace" and e.get("role") == "survivor"
        ]
        phases.append(
            {
                name: statistics.median(float(p[name]) for p in survivors if name in p)
                for name in (survivors[0] if survivors else {})
            }
        )
        save_s.append(max(commits, default=float("nan")))
        restore_s.append(max(restores, default=float("nan")))
    out: dict[str, Any] = {
        "world_sizes": world_sizes,
        "save_s": save_s,
        "restore_s": restore_s,
        "mttr_s": mttr_s,
        "recovery_paths": paths,
        "recovery_cpu_s_median": cpu_s,
        "survivor_phases_median": phases,
    }
    if mttr_s and mttr_s[0] > 0:
        out["mttr_ratio_max_vs_min"] = mttr_s[-1] / mttr_s[0]
        out["target"] = "in-place MTTR at the largest world size <= 1.5x the smallest"
    return out


SECTION = Section("scaling", lambda quick: bench_scaling([2, 4] if quick else [2, 4, 8]))
