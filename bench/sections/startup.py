"""Start-up: a short job end to end, `torchrig run` against plain torchrun running the same job.

Both train the digits MLP for 300 steps at 2 ranks on this machine with a checkpoint every 50 steps:
torchrig through the CLI a user types (`torchrig run examples/digits-ddp.yaml`: rendezvous store,
agent, in-place hosts with their forked trainers, metrics, verified checkpoints), the peer through
`torchrun --standalone` and the naive loop of `bench/naive_torchrun.py` (no kill). Repeats alternate
the two. Reported: wall from the command to its exit, each one's time to the first completed step,
torchrig's time from the last rank's `finished` event to the exit (the teardown), the ratios of the
walls and of the first steps (of the medians, and of each alternated pair), the load average while it
ran (this 2-core machine is shared: only ratios of alternated runs compare), and how long `torchrig
submit --backend local` of the same job takes to return once its detached supervisor has started
(issue 36: within 1 s).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import DIGITS, PY, REPO, run, stats
from bench.sections.base import Section
from orchestrator.backends._local_procs import process_start_ticks
from training.contract import EventKind, RunFiles, read_events, read_json

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


def _torchrun(tmp: Path) -> dict[str, float]:
    (tmp / "ckpt").mkdir()
    start = time.time()
    run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp / "logs"),
         str(REPO / "bench" / "naive_torchrun.py"), "--steps", str(STEPS), "--every", str(EVERY),
         "--kill-step", "0", "--ckpt-dir", str(tmp / "ckpt"), "--events", str(tmp / "events.jsonl")],
        cwd=tmp,
    )  # fmt: skip
    end = time.time()
    first = min(e.time for e in read_events(tmp / "events.jsonl") if e.kind is EventKind.FIRST_STEP)
    return {"wall_s": end - start, "first_step_s": first - start}


def _boot_time() -> float:
    line = next(x for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime "))
    return float(line.split()[1])


def _submit(tmp: Path) -> float:
    """Seconds from the start of `submit`'s detached supervisor to the CLI's exit (then the run is waited for)."""
    run_dir = tmp / "run"
    run([PY, "-m", "orchestrator.cli", "submit", str(DIGITS), "--backend", "local", "--run-dir", str(run_dir)], cwd=tmp)
    returned = time.time()
    pid = int((read_json(RunFiles(run_dir).supervisor) or {})["pid"])
    ticks = process_start_ticks(pid)
    if ticks is None:
        raise RuntimeError(f"the supervisor (pid {pid}) was gone when submit returned")
    started = _boot_time() + ticks / os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + 300
    while not RunFiles(run_dir).summary.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    return returned - started


def bench_startup(repeats: int) -> dict[str, Any]:
    ours: list[dict[str, float]] = []
    peer: list[dict[str, float]] = []
    submit: list[float] = []
    load: list[float] = []
    for _ in range(repeats):
        load.append(os.getloadavg()[0])
        with tempfile.TemporaryDirectory() as d:
            ours.append(_torchrig(Path(d)))
        with tempfile.TemporaryDirectory() as d:
            peer.append(_torchrun(Path(d)))
        with tempfile.TemporaryDirectory() as d:
            submit.append(_submit(Path(d)))
    load.append(os.getloadavg()[0])
    pairs = list(zip(ours, peer, strict=True))
    out: dict[str, Any] = {
        "steps": STEPS,
        "torchrig_wall": stats([r["wall_s"] for r in ours]),
        "torchrig_first_step": stats([r["first_step_s"] for r in ours]),
        "torchrig_teardown": stats([r["teardown_s"] for r in ours]),
        "torchrun_naive_wall": stats([r["wall_s"] for r in peer]),
        "torchrun_naive_first_step": stats([r["first_step_s"] for r in peer]),
        "submit_return_after_supervisor_start": stats(submit),
        "load_average_1m": stats(load),
        "first_step_ratio_pairs": stats([a["first_step_s"] / b["first_step_s"] for a, b in pairs]),
        "wall_ratio_pairs": stats([a["wall_s"] / b["wall_s"] for a, b in pairs]),
    }
    out["wall_ratio_vs_torchrun"] = statistics.median(r["wall_s"] for r in ours) / statistics.median(
        r["wall_s"] for r in peer
    )
    out["first_step_ratio_vs_torchrun"] = statistics.median(r["first_step_s"] for r in ours) / statistics.median(
        r["first_step_s"] for r in peer
    )
    return out


SECTION = Section("startup", lambda quick: bench_startup(1 if quick else 4))
