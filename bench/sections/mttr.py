"""MTTR: SIGKILL of one rank, then time to the first step after recovery and steps lost, for torchrig,
plain torchrun with a naive save-every-N loop, and Ray Train."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import DIGITS, PY, REPO, run, stats
from bench.sections.base import Section
from bench.workloads import kill_worker_drill
from training.contract import EventKind, read_events

STEPS, KILL_STEP, EVERY = 60, 25, 10


def _mttr_torchrig(steps: int, kill_step: int) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as d:
        report = kill_worker_drill(steps, kill_step, 2, Path(d))
        return float(report.mttr_seconds), int(report.lost_steps)


def _mttr_torchrun_naive(steps: int, kill_step: int) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "ckpt").mkdir()
        events_file = tmp / "events.jsonl"
        run(
            [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
             "--log-dir", str(tmp / "logs"), str(REPO / "bench" / "naive_torchrun.py"), "--steps", str(steps),
             "--every", str(EVERY), "--kill-step", str(kill_step), "--ckpt-dir", str(tmp / "ckpt"),
             "--events", str(events_file)]
        )  # fmt: skip
        events = read_events(events_file)
        fault = next(e for e in events if e.kind is EventKind.FAULT)
        first = next(e for e in events if e.kind is EventKind.FIRST_STEP)
        restore = next((e for e in events if e.kind is EventKind.RESTORE), None)
        restored_step = restore.step if restore is not None and restore.step is not None else 0
        return first.time - fault.time, kill_step - restored_step


def _mttr_ray(steps: int, kill_step: int) -> tuple[float, int]:
    from orchestrator.drills import DrillOptions, run_drill
    from orchestrator.loader import load_spec

    with tempfile.TemporaryDirectory() as d:
        spec = load_spec(
            DIGITS,
            [f"spec.training.steps={steps}", f"spec.checkpoint.every.steps={EVERY}", "spec.training.evalAtEnd=false",
             "spec.nodes.min=1", "spec.nodes.max=1", "spec.metrics.port=29750"],
        )  # fmt: skip
        report = run_drill(
            "kill-worker",
            spec,
            DrillOptions(
                backend="ray", seed=0, at_step=kill_step, rank=1, reference=False, drill_dir=str(Path(d) / "r")
            ),
        )
        if report.mttr_seconds is None or report.lost_steps is None:
            raise RuntimeError(f"ray drill did not recover: {report.to_dict()}")
        return report.mttr_seconds, report.lost_steps


PEERS: tuple[tuple[str, Callable[[int, int], tuple[float, int]]], ...] = (
    ("torchrig", _mttr_torchrig),
    ("torchrun_naive", _mttr_torchrun_naive),
    ("ray_train", _mttr_ray),
)


def bench_mttr(repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"lost_steps": {}, "kill_step": KILL_STEP, "checkpoint_every": EVERY}
    for name, fn in PEERS:
        try:
            samples = [fn(STEPS, KILL_STEP) for _ in range(repeats)]
        except Exception as exc:  # a peer that cannot run here is reported, not hidden
            out[f"{name}_s"] = None
            out["lost_steps"][name] = None
            out.setdefault("errors", {})[name] = f"{exc.__class__.__name__}: {str(exc)[-400:]}"
            continue
        out[f"{name}_s"] = stats([s[0] for s in samples])["median"]
        out[f"{name}_stats"] = stats([s[0] for s in samples])
        out["lost_steps"][name] = max(s[1] for s in samples)
    peers: list[float] = [p for p in (out.get("torchrun_naive_s"), out.get("ray_train_s")) if p]
    if out.get("torchrig_s") and peers:
        out["speedup_vs_fastest_peer"] = min(peers) / out["torchrig_s"]
    out["target"] = "torchrig >= 2x faster than the fastest peer"
    return out


SECTION = Section("mttr", lambda quick: bench_mttr(1 if quick else 3))
