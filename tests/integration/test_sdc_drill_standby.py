"""The `sdc` drill with a standby node (`restarts.spareNodes: 1`) on the local backend: the flip waits for the
drill's gate, which opens once the standby is ready (as kill-node's kill waits), so the decision hands the
suspect's whole node to the standby instead of a spare of its own node; the verdict wants exactly that, no
group restart, and the end bit-identical to an uninterrupted reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.drills import DrillOptions, run_drill
from tests.fixtures.common import free_port
from tests.integration.test_sdc_standby import sdc_standby_spec
from training.contract import EventKind, RunFiles, Summary, read_events

RUN_TIMEOUT_S = 300.0
STEPS = 300
PACE_S = 0.2  # until the flip: up to 60 s of paced steps (a standby was warm after 20-35 s at a load of 11 on 2 cores)


@pytest.mark.slow
@pytest.mark.timeout(int(2 * RUN_TIMEOUT_S + 120))
def test_the_sdc_drill_with_a_standby_node_swaps_the_suspects_node(tmp_path: Path) -> None:
    spec = sdc_standby_spec(1, free_port(), STEPS)
    options = DrillOptions(
        seed=0, nodes=2, at_step=13, rank=2, pace_s=PACE_S, drill_dir=str(tmp_path / "sdc"), timeout_s=RUN_TIMEOUT_S
    )
    report = run_drill("sdc", spec, options)
    failed = [(c.name, c.detail) for c in report.checks if not c.passed]
    assert report.verdict == "pass", (
        f"{report.inconclusive or ''} failed checks: {failed}\n" + json.dumps(report.to_dict(), default=str)[-3000:]
    )
    names = [c.name for c in report.checks]
    assert "a standby node was ready before the bit flip" in names
    assert "a standby node took the suspect's node 1 (replaced_by standby)" in names
    events = read_events(RunFiles(report.run_dir).events)
    (flip,) = [e for e in events if e.kind == EventKind.FAULT and e.get("kind") == "bitflip"]
    assert flip.rank == 2 and flip.step is not None and flip.step >= 13
    (sdc,) = [e for e in events if e.kind == EventKind.SDC]
    assert sdc.get("replaced_by") == "standby" and sdc.get("excluded_node") == 1 and sdc.get("suspects") == [2]
    spares = sorted(e.rank for e in events if e.kind == EventKind.RECOVERY and e.get("role") == "spare")
    assert spares == [2, 3], "the standby's spares hold node 1's ranks"
    summary = Summary.read(RunFiles(report.run_dir).summary)
    assert summary is not None and summary.restarts == 0
    assert report.recovery_path == "inplace-rollback" and report.final_params_match_reference is True
