"""Scaling: checkpoint save, restore and MTTR against world size, from kill-worker drills (local, tiny model)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench.sections.base import Section
from bench.workloads import kill_worker_drill
from training.contract import EventKind, RunFiles, read_events


def bench_scaling(world_sizes: list[int]) -> dict[str, Any]:
    """Checkpoint save, restore and MTTR against world size (local, tiny model), from kill-worker drills."""
    save_s, restore_s, mttr_s = [], [], []
    for w in world_sizes:
        with tempfile.TemporaryDirectory() as d:
            report = kill_worker_drill(40, 35, w, Path(d))
            events = read_events(RunFiles(report.run_dir).events)
        mttr_s.append(float(report.mttr_seconds))
        commits = [
            float(e.get("save_s"))
            for e in events
            if e.kind is EventKind.CHECKPOINT_COMMITTED and e.get("save_s") is not None
        ]
        restores = [
            float(e.get("seconds")) for e in events if e.kind is EventKind.RESTORE and e.get("seconds") is not None
        ]
        save_s.append(max(commits, default=float("nan")))
        restore_s.append(max(restores, default=float("nan")))
    return {"world_sizes": world_sizes, "save_s": save_s, "restore_s": restore_s, "mttr_s": mttr_s}


SECTION = Section("scaling", lambda quick: bench_scaling([2, 4] if quick else [2, 4, 8]))
