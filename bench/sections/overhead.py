"""Runtime overhead: torchrig's worker loop against a hand-written DDP loop, both under plain torchrun."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench.common import PY, REPO, run, stats, throughput_from_records
from bench.sections.base import Section
from bench.workloads import worker_throughput
from training.contract import read_jsonl

BATCH, WORLD = 32, 2


def _bare_ddp_throughput(steps: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out = tmp / "bare.jsonl"
        run(
            [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD), "--log-dir",
             str(tmp / "logs"), str(REPO / "bench" / "bare_ddp.py"), "--steps", str(steps), "--out", str(out)]
        )  # fmt: skip
        return throughput_from_records(read_jsonl(out), BATCH * WORLD, skip_steps=10)


def bench_overhead(repeats: int, steps: int) -> dict[str, Any]:
    """torchrig's worker loop vs a hand-written DDP loop, both under plain torchrun, 2 ranks, gloo."""
    torchrig, bare = [], []
    for _ in range(repeats):
        torchrig.append(worker_throughput(steps, metrics_enabled=True)[0])
        bare.append(_bare_ddp_throughput(steps))
    ratios = [t / b for t, b in zip(torchrig, bare, strict=True)]
    return {
        "torchrig_samples_per_s": stats(torchrig)["median"],
        "bare_ddp_samples_per_s": stats(bare)["median"],
        "ratio": stats(ratios)["median"],
        "ratio_stats": stats(ratios),
        "target": ">= 0.98",
        "steps": steps,
        "repeats": repeats,
    }


SECTION = Section("overhead", lambda quick: bench_overhead(2 if quick else 5, 60 if quick else 200))
