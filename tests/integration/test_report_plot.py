"""`torchrig report RUN --plot` on a real run with a worker kill: the plot's timeline matches what the
run went through (one restart, the outage from the fault to the first step after the restore, the
world size to the end), and the report's minimum loss is never above its final loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.backends import get_backend
from orchestrator.backends.base import SubmitOptions
from orchestrator.cli import cli
from orchestrator.loader import load_spec
from orchestrator.plot import plot_run
from tests.fixtures.common import REPO
from training.contract import Env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_report_plot_of_a_run_with_a_worker_kill(tmp_path: Path) -> None:
    spec = load_spec(
        REPO / "examples" / "digits-ddp.yaml",
        [
            "spec.training.steps=60",
            "spec.checkpoint.every.steps=10",
            "spec.metrics.logEvery=5",
            "spec.metrics.enabled=false",
            "spec.restarts.mode=restart",  # the drawing of a group restart (outage, restore, loss-line break)
        ],
    )
    faults = json.dumps([{"kind": "kill", "rank": 1, "step": 25, "generation": 0}])
    run_dir = tmp_path / "run"
    summary = (
        get_backend("local")
        .launch(spec, SubmitOptions(run_dir=str(run_dir), env={Env.FAULTS: faults}))
        .wait(timeout_s=280)
    )
    assert summary.status == "succeeded" and summary.restarts == 1, summary

    tl = plot_run(run_dir, tmp_path / "direct.png")
    assert (tmp_path / "direct.png").read_bytes()[:8] == PNG_MAGIC
    (restart,) = tl.restarts
    (cut,) = tl.outages
    restored = summary.restored_from[0]["step"]  # 20, or 10 when step 20's async commit was not done yet
    assert cut.last_step == 25 and cut.resumed_from == restored and cut.first_step == restored + 1
    assert cut.start < restart.time < cut.end, "the group re-formed inside the outage"
    assert [m.step for m in tl.faults] == [25] and [m.step for m in tl.restores] == [restored]
    assert {10, restored, 60} <= {m.step for m in tl.checkpoints}
    assert sum(math.isnan(x) for x in tl.series.steps) == 1, "one break in the loss line: the restart"
    tx, ty = tl.world_size_time
    assert tx[-1] == pytest.approx(tl.end) and ty[-1] == 2, "the world size reaches the end of the run"

    png = tmp_path / "report.png"
    result = CliRunner().invoke(cli, ["report", str(run_dir), "--plot", str(png), "-o", "json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == PNG_MAGIC
    derived = json.loads(result.stdout)["derived"]
    assert summary.final_loss is not None and derived["min_loss"] <= summary.final_loss
