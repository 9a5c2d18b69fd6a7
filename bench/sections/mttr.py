"""MTTR: SIGKILL of one rank, then time to the first step after recovery (at the original world size) and
steps lost, for torchrig in place (a warm spare, the default `restarts.mode: auto` at 2 ranks), torchrig's
group restart (`restarts.mode: restart`), plain torchrun with a naive save-every-N loop, Ray Train's own
recovery (`FailureConfig`: a worker group restart from the newest checkpoint) and torchrig in place on Ray
(each Ray Train worker hosts its rank's trainer, a warm spare takes a dead one's place: `training.ray_train`).

The in-place row also checks the targets of issue 14: 0 lost steps and final parameters bit-identical
to an uninterrupted run, for a kill of the last rank and of rank 0."""

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
_BIT_EXACT: list[bool] = []  # in-place runs whose final params matched the reference
_RAY_BIT_EXACT: list[bool] = []  # the same, in place on Ray


def _mttr_torchrig(steps: int, kill_step: int, *, inplace: bool, attempt: int = 0) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as d:
        extra = () if inplace else ("spec.restarts.mode=restart",)
        # In place: the first two attempts run the reference too (bit-exactness), killing rank 1, then rank 0.
        reference = inplace and attempt < 2
        rank = attempt % 2 if inplace else None
        report = kill_worker_drill(steps, kill_step, 2, Path(d), extra=extra, reference=reference, rank=rank)
        if inplace and report.recovery_path != "inplace":
            raise RuntimeError(f"recovered by {report.recovery_path}, not in place: {report.notes}")
        if reference:
            _BIT_EXACT.append(report.final_params_match_reference is True)
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


def _mttr_ray(steps: int, kill_step: int, *, inplace: bool, attempt: int = 0) -> tuple[float, int]:
    """The kill-worker drill on `--backend ray`: Ray Train's `FailureConfig` (`restarts.mode: restart`), or
    in place (the default); the first in-place attempt also runs the reference (bit-exactness)."""
    from orchestrator.drills import DrillOptions, run_drill
    from orchestrator.loader import load_spec

    with tempfile.TemporaryDirectory() as d:
        spec = load_spec(
            DIGITS,
            [f"spec.training.steps={steps}", f"spec.checkpoint.every.steps={EVERY}", "spec.training.evalAtEnd=false",
             "spec.nodes.min=1", "spec.nodes.max=1", "spec.metrics.port=29750",
             *(() if inplace else ("spec.restarts.mode=restart",))],
        )  # fmt: skip
        reference = inplace and attempt == 0
        report = run_drill(
            "kill-worker",
            spec,
            DrillOptions(
                backend="ray", seed=0, at_step=kill_step, rank=1, reference=reference, drill_dir=str(Path(d) / "r")
            ),
        )
        if report.mttr_seconds is None or report.lost_steps is None:
            raise RuntimeError(f"ray drill did not recover: {report.to_dict()}")
        expected = "inplace" if inplace else "ray-restart"
        if report.recovery_path != expected:
            raise RuntimeError(f"recovered by {report.recovery_path}, not {expected}: {report.notes}")
        if reference:
            _RAY_BIT_EXACT.append(report.final_params_match_reference is True)
        return report.mttr_seconds, report.lost_steps


PEERS: tuple[tuple[str, Callable[[int, int, int], tuple[float, int]]], ...] = (
    ("torchrig_inplace", lambda steps, kill, i: _mttr_torchrig(steps, kill, inplace=True, attempt=i)),
    ("torchrig_restart", lambda steps, kill, i: _mttr_torchrig(steps, kill, inplace=False)),
    ("torchrun_naive", lambda steps, kill, i: _mttr_torchrun_naive(steps, kill)),
    ("ray_train", lambda steps, kill, i: _mttr_ray(steps, kill, inplace=False)),
    ("ray_inplace", lambda steps, kill, i: _mttr_ray(steps, kill, inplace=True, attempt=i)),
)


def bench_mttr(repeats: int, peers: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every peer `repeats` times (in place at least twice: a kill of rank 1 and of rank 0)."""
    out: dict[str, Any] = {"lost_steps": {}, "kill_step": KILL_STEP, "checkpoint_every": EVERY}
    _BIT_EXACT.clear()
    _RAY_BIT_EXACT.clear()
    for name, fn in PEERS:
        if peers is not None and name not in peers:
            continue
        n = max(repeats, 2) if name == "torchrig_inplace" else repeats
        try:
            samples = [fn(STEPS, KILL_STEP, i) for i in range(n)]
        except Exception as exc:  # a peer that cannot run here is reported, not hidden
            out[f"{name}_s"] = None
            out["lost_steps"][name] = None
            out.setdefault("errors", {})[name] = f"{exc.__class__.__name__}: {str(exc)[-400:]}"
            continue
        out[f"{name}_s"] = stats([s[0] for s in samples])["median"]
        out[f"{name}_stats"] = stats([s[0] for s in samples])
        out["lost_steps"][name] = max(s[1] for s in samples)
    out["torchrig_s"] = out.get("torchrig_inplace_s")  # the default path (earlier results' key)
    out["inplace_bit_exact"] = f"{sum(_BIT_EXACT)}/{len(_BIT_EXACT)}"
    out["ray_inplace_bit_exact"] = f"{sum(_RAY_BIT_EXACT)}/{len(_RAY_BIT_EXACT)}"
    ray_inplace, ray_train = out.get("ray_inplace_s"), out.get("ray_train_s")
    if ray_inplace and ray_train:
        out["ray_inplace_vs_ray_train_ratio"] = ray_inplace / ray_train
    inplace, naive = out.get("torchrig_inplace_s"), out.get("torchrun_naive_s")
    if inplace and naive:
        out["inplace_vs_torchrun_ratio"] = inplace / naive
    if inplace and out.get("torchrig_restart_s"):
        out["inplace_vs_restart_ratio"] = inplace / out["torchrig_restart_s"]
    peer_times: list[float] = [p for p in (naive, out.get("ray_train_s")) if p]
    if inplace and peer_times:
        out["speedup_vs_fastest_peer"] = min(peer_times) / inplace
    out["target"] = (
        "in place: MTTR <= 0.5x plain torchrun (inplace_vs_torchrun_ratio <= 0.5), 0 lost steps, bit-exact; "
        "on Ray: MTTR <= 0.1x Ray Train FailureConfig (ray_inplace_vs_ray_train_ratio <= 0.1), 0 lost steps, bit-exact"
    )
    return out


SECTION = Section("mttr", lambda quick: bench_mttr(1 if quick else 3))
