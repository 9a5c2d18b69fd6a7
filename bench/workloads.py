"""Runs that more than one section measures: the real worker under torchrun, and a kill-worker drill."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench.common import DIGITS, PY, digits_spec_file, run, stats, throughput_from_records
from training.contract import Env, RunFiles, read_jsonl


def worker_throughput(steps: int, metrics_enabled: bool) -> tuple[float, float]:
    """(samples/s, median step seconds) of the real worker, 2 ranks under torchrun, metrics on or off."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spec = digits_spec_file(
            tmp,
            [
                f"spec.training.steps={steps}",
                f"spec.checkpoint.every.steps={steps * 10}",
                "spec.checkpoint.saveFinal=false",
                "spec.training.evalAtEnd=false",
                "spec.metrics.logEvery=1",
                f"spec.metrics.enabled={str(metrics_enabled).lower()}",
                "spec.metrics.port=29650",
            ],
        )
        run_dir = RunFiles(tmp / "run")
        run(
            [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--log-dir",
             str(tmp / "logs"), "-m", "training", "--spec", str(spec)],
            extra_env={Env.RUN_DIR: str(run_dir.root)},
        )  # fmt: skip
        records = read_jsonl(run_dir.metrics)
        step_s = stats([float(r["step_s"]) for r in records if int(r["step"]) >= 10])["median"]
        return throughput_from_records(records, 64, skip_steps=10), step_s


def kill_worker_drill(
    steps: int,
    kill_step: int,
    world: int,
    workdir: Path,
    *,
    extra: tuple[str, ...] = (),
    reference: bool = False,
    rank: int | None = None,
) -> Any:
    """One kill-worker drill on the local backend; returns its DrillReport.

    Args:
        extra: More `--set` overrides (`spec.restarts.mode=restart` for the restart path).
        reference: Also run the uninterrupted reference (the report says whether the params match).
        rank: The rank to kill (default: the last one).
    """
    from orchestrator.drills import DrillOptions, run_drill
    from orchestrator.loader import load_spec

    spec = load_spec(
        DIGITS,
        [
            f"spec.training.steps={steps}",
            "spec.checkpoint.every.steps=10",
            "spec.training.evalAtEnd=false",
            "spec.metrics.port=29700",
            f"spec.procsPerNode={world}",
            "spec.nodes.min=1",
            "spec.nodes.max=1",
            *extra,
        ],
    )
    victim = world - 1 if rank is None else rank
    report = run_drill(
        "kill-worker",
        spec,
        DrillOptions(seed=0, at_step=kill_step, rank=victim, reference=reference, drill_dir=str(workdir / "drill")),
    )
    if report.mttr_seconds is None or report.lost_steps is None:
        raise RuntimeError(f"torchrig drill did not recover: {report.to_dict()}")
    return report
