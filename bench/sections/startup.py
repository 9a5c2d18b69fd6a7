"""Start-up: a short job end to end, `torchrig run` against plain torchrun running the same job.

Both train the digits MLP for 300 steps at 2 ranks on this machine with a checkpoint every 50 steps:
torchrig through the CLI a user types (`torchrig run examples/digits-ddp.yaml`: rendezvous store,
agent, in-place hosts with their forked trainers, metrics, verified checkpoints), the peer through
`torchrun --standalone` and the naive loop of `bench/naive_torchrun.py` (no kill). Repeats alternate
the two. Reported: wall from the command to its exit, torchrig's time to the first completed step and
from the last rank's `finished` event to the exit (the teardown), and the ratio of the walls.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import DIGITS, PY, REPO, run, stats
from bench.sections.base import Section
from training.contract import EventKind, RunFiles, read_events

STEPS = 300
EVERY = 50


def _torchrig(tmp: Path) -> dict[str, float]:
    run_dir = tmp / "run"
    start = time.time()
    run([PY, "-m", "orchestrator.cli", "run", str(DIGITS), "--run-dir", str(run_dir), "--quiet"], cwd=tmp)
    end = time.time()
    events = read_events(RunFiles(run_dir).events)
    first = min(e.time for e in events if e.kind is EventKind.FIRST_STEP)
    finished = max(e.time for e in events if e.kind is EventKind.FINISHED)
    return {"wall_s": end - start, "first_step_s": first - start, "teardown_s": end - finished}


def _torchrun(tmp: Path) -> float:
    (tmp / "ckpt").mkdir()
    start = time.time()
    run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp / "logs"),
         str(REPO / "bench" / "naive_torchrun.py"), "--steps", str(STEPS), "--every", str(EVERY),
         "--kill-step", "0", "--ckpt-dir", str(tmp / "ckpt"), "--events", str(tmp / "events.jsonl")],
        cwd=tmp,
    )  # fmt: skip
    return time.time() - start


def bench_startup(repeats: int) -> dict[str, Any]:
    ours: list[dict[str, float]] = []
    peer: list[float] = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as d:
            ours.append(_torchrig(Path(d)))
        with tempfile.TemporaryDirectory() as d:
            peer.append(_torchrun(Path(d)))
    out: dict[str, Any] = {
        "steps": STEPS,
        "torchrig_wall": stats([r["wall_s"] for r in ours]),
        "torchrig_first_step": stats([r["first_step_s"] for r in ours]),
        "torchrig_teardown": stats([r["teardown_s"] for r in ours]),
        "torchrun_naive_wall": stats(peer),
    }
    out["wall_ratio_vs_torchrun"] = statistics.median(r["wall_s"] for r in ours) / statistics.median(peer)
    return out


SECTION = Section("startup", lambda quick: bench_startup(1 if quick else 3))
