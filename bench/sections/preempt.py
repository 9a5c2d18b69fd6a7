"""Preemption: the time from SIGTERM to a committed emergency checkpoint, for the 50 MB and 500 MB states.

One process trains a stand-in loop (steps of `STEP_S`, the state of `checkpoint_stall._state_of`) with
the real `training.preemption.PreemptionHandler` installed and the real `CheckpointManager` (one file
store); a thread sends SIGTERM to the process at a random point of a step; the clock stops when the
handler has the emergency checkpoint committed (`PreemptedExit`). Its peers, measured side by side on
the same state: the same manager's plain synchronous save (what the emergency save costs without the
signal and the wait for the step boundary) and `torch.save` of the state. One process has nothing to
agree with, so the multi-process path's extra (one step of lag and a 4-byte all-reduce) is not in here;
the `preempt` drill measures it end to end (`since_signal_s` of its `preempted` event).
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import stats
from bench.sections.base import Section
from bench.sections.checkpoint_stall import _state_of

STEP_S = 0.05  # the stand-in step
DEFAULT_GRACE_S = 30.0  # restarts.preemptGraceSeconds' default: the headroom is measured against it


class _Stateful:
    """The model and optimizer as one DCP Stateful, like `training.state.ModelOptimizerState`."""

    def __init__(self, model: Any, opt: Any) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # pragma: no cover - never restored here
        raise NotImplementedError


def _manager(tmp: Path, name: str) -> Any:
    from training.checkpoint import CheckpointManager
    from training.config import CheckpointConfig
    from training.contract import WorkerIdentity

    config = CheckpointConfig.model_validate(
        {"every": {"steps": 10**9}, "keep": 1, "async": True, "stores": [{"uri": f"file://{tmp}/{name}", "name": "a"}]}
    )
    return CheckpointManager(config, WorkerIdentity(job="bench", run_dir=str(tmp)))


def _sigterm_to_commit(state: dict[str, Any], tmp: Path, i: int, rng: random.Random) -> float:
    """One preemption: SIGTERM at a random point of a step, seconds until the checkpoint is committed."""
    from training.metrics.base import MetricsSink
    from training.preemption import PreemptedExit, PreemptionHandler

    mgr = _manager(tmp, f"p{i}")
    handler = PreemptionHandler(DEFAULT_GRACE_S, MetricsSink(), exit=lambda code: None).install()
    sent: list[float] = []

    def _signal() -> None:
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGTERM)

    timer = threading.Timer(STEP_S * (2 + rng.random()), _signal)
    timer.start()
    seconds = float("nan")
    try:
        for step in range(1, 10**6):
            time.sleep(STEP_S)
            handler.at_step_boundary(step, mgr, state)
    except PreemptedExit as stop:
        seconds = time.perf_counter() - sent[0]
        if not stop.committed:
            raise RuntimeError("the emergency checkpoint did not commit") from None
    finally:
        timer.cancel()
        handler.uninstall()
        mgr.close()
    return seconds


def _sync_save(state: dict[str, Any], tmp: Path, i: int) -> float:
    mgr = _manager(tmp, f"s{i}")
    t = time.perf_counter()
    outcome = mgr.save(1, state, synchronous=True)
    seconds = time.perf_counter() - t
    mgr.close()
    if outcome is None or not outcome.committed:
        raise RuntimeError("the synchronous save did not commit")
    return seconds


def _torch_save(state: dict[str, Any], tmp: Path, i: int) -> float:
    import torch

    flat = {k: v.state_dict() for k, v in state.items()}
    t = time.perf_counter()
    torch.save(flat, tmp / f"ts{i}.pt")
    return time.perf_counter() - t


def bench_preempt(sizes_mb: list[int], repeats: int) -> dict[str, Any]:
    """SIGTERM -> committed emergency checkpoint, against a synchronous save and torch.save of the state."""
    out: dict[str, Any] = {}
    rng = random.Random(0)
    for mb in sizes_mb:
        model, opt = _state_of(mb)
        state = {"app": _Stateful(model, opt)}
        res: dict[str, list[float]] = {"sigterm_to_commit": [], "sync_save": [], "torch_save": []}
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            for i in range(repeats):
                res["sigterm_to_commit"].append(_sigterm_to_commit(state, tmp, i, rng))
                res["sync_save"].append(_sync_save(state, tmp, i))
                res["torch_save"].append(_torch_save(state, tmp, i))
        med = {k: stats(v)["median"] for k, v in res.items()}
        out[f"{mb}MB"] = {
            "sigterm_to_commit_s": med["sigterm_to_commit"],
            "sync_save_s": med["sync_save"],
            "torch_save_s": med["torch_save"],
            "step_s": STEP_S,
            "ratio_vs_sync_save": med["sigterm_to_commit"] / med["sync_save"],
            "ratio_vs_torch_save": med["sigterm_to_commit"] / med["torch_save"],
            "grace_headroom": DEFAULT_GRACE_S / med["sigterm_to_commit"],
            "spread_pct": {k: round(stats(v)["spread_pct"], 1) for k, v in res.items()},
            "targets": {"sigterm_to_commit_s": f"<= {DEFAULT_GRACE_S:g} (restarts.preemptGraceSeconds)"},
        }
    return out


SECTION = Section("preempt", lambda quick: bench_preempt([50] if quick else [50, 500], 2 if quick else 5))
