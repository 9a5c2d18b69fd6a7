"""The `sdc` drill with a standby node (`restarts.spareNodes`): the flip waits for the drill's gate, opened once a
standby is ready, so that the swap of the suspect's node is what the drill tests; the verdict wants the swap.

The gated fault (`training.faults`: `gated_step`, the injector against a real gate file), the plan, the gate
opened or withheld from outside (`ActionRunner` against a scripted run) and the verdict on recorded events.
No process is started.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from orchestrator.drills.actions import ActionRunner
from orchestrator.drills.history import RunHistory
from orchestrator.drills.plan import AwaitStandby, AwaitStep, DrillContext, DrillOptions, Outcome, ReleaseFaults
from orchestrator.drills.report import DrillReport
from orchestrator.drills.runner import _fill_from_run
from orchestrator.drills.scenarios import SilentCorruption
from orchestrator.loader import load_spec
from tests.fixtures.common import REPO
from tests.unit.test_drill_standby_wait import StandbyRun
from training.contract import Env, RunFiles, Summary
from training.faults import Fault, FaultInjector, gated_step, parse_faults
from training.metrics.base import MetricsSink

STANDBY = ["spec.nodes.min=2", "spec.nodes.max=2", "spec.procsPerNode=2", "spec.restarts.spareNodes=1"]


class Recorder(MetricsSink):
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def on_event(self, event: Any, **fields: Any) -> None:
        self.events.append(event.to_dict() if hasattr(event, "to_dict") else {"event": str(event), **fields})


# -- the gated fault ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("completed", "gate_open", "due"),
    [
        (1, True, None),  # open early: it waits for its own step (5), released once step 4 is done
        (4, True, 5),
        (9, True, 10),  # open late: the step after the gate was seen
        (9, False, None),  # closed: it waits
        (4, False, None),
    ],
)
def test_a_gated_fault_strikes_at_its_step_or_the_first_after_the_gate_opens(
    completed: int, gate_open: bool, due: int | None
) -> None:
    assert gated_step(Fault(kind="bitflip", rank=0, step=5, gated=True), completed, gate_open) == due
    assert gated_step(Fault(kind="bitflip", rank=0, step=5), completed, gate_open) == 5  # not gated: its step


def test_gated_parses_on_a_bitflip_only_and_a_bad_value_names_the_field() -> None:
    (fault,) = parse_faults('[{"kind": "bitflip", "rank": 2, "step": 7, "gated": true}]')
    assert fault.gated and fault.step == 7
    (plain,) = parse_faults('[{"kind": "bitflip", "step": 7}]')
    assert not plain.gated
    with pytest.raises(ValueError, match=r"TORCHRIG_FAULTS\[0\]\.gated: must be true or false"):
        parse_faults('[{"kind": "bitflip", "step": 7, "gated": "yes"}]')
    with pytest.raises(ValueError, match="unknown keys"):
        parse_faults('[{"kind": "kill", "step": 7, "gated": true}]')
    (pace,) = parse_faults('[{"kind": "slow", "rank": -1, "step": 1, "seconds": 0.1, "until_gate": true}]')
    assert pace.until_gate
    with pytest.raises(ValueError, match="unknown keys"):
        parse_faults('[{"kind": "bitflip", "step": 7, "until_gate": true}]')


def test_a_pace_until_the_gate_ends_once_the_gate_exists(tmp_path: Path) -> None:
    faults = parse_faults('[{"kind": "slow", "rank": -1, "step": 2, "seconds": 0.1, "until_gate": true}]')
    injector = FaultInjector(faults, rank=3, generation=0, events=Recorder(), gate=RunFiles(tmp_path).fault_gate)
    assert [injector.step_delay(s) for s in (1, 2, 3)] == [0.0, 0.1, 0.1]
    RunFiles(tmp_path).fault_gate.touch()
    assert [injector.step_delay(s) for s in (4, 5)] == [0.0, 0.0]


@pytest.mark.parametrize("target", ["param", "grad"])
def test_the_injector_holds_a_gated_flip_until_the_run_directorys_gate_exists(tmp_path: Path, target: str) -> None:
    """The gate appears during step 4 (the fault's step is 2): the flip strikes in step 5, once."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    sink = Recorder()
    env = {
        Env.FAULTS: json.dumps([{"kind": "bitflip", "rank": 0, "step": 2, "target": target, "gated": True}]),
        Env.RUN_DIR: str(tmp_path),
    }
    injector = FaultInjector.from_env(rank=0, generation=0, events=sink, env=env)
    assert injector.gate == RunFiles(tmp_path).fault_gate
    injector.arm(model, optimizer)
    for step in range(1, 9):
        loss = model(torch.ones(1, 3)).sum()
        injector.before_backward(loss, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 4:  # the drill opens it while step 4 runs: seen once step 4 is done
            RunFiles(tmp_path).fault_gate.touch()
        injector.after_step(step)
    assert [(e.get("kind"), e.get("step")) for e in sink.events] == [("bitflip", 5)]


# -- the plan ----------------------------------------------------------------------------------------------
def _ctx(**kw: Any) -> DrillContext:
    base: dict[str, Any] = {
        "scenario": "sdc",
        "seed": 0,
        "rng": random.Random(0),
        "steps": 300,
        "world_size": 4,
        "nodes": 2,
        "checkpoint_every": 10,
        "fault_step": 13,
        "fault_rank": 2,
        "sdc_every": 5,
        "sdc_replicas": 4,
        "in_place": True,
        "standby": True,
    }
    base.update(kw)
    return DrillContext(**base)


def test_with_a_standby_node_the_paced_flip_waits_for_the_gate_opened_once_a_standby_is_ready() -> None:
    spec = load_spec(REPO / "examples" / "digits-ddp.yaml", STANDBY)
    plan = SilentCorruption().plan(spec, _ctx())
    pace, flip = plan.faults
    assert pace.kind == "slow" and pace.rank == -1 and pace.seconds == DrillOptions().pace_s and pace.until_gate
    assert (flip.kind, flip.rank, flip.step, flip.gated) == ("bitflip", 2, 13, True)
    assert plan.actions == (AwaitStep(13), AwaitStandby("bit flip", "no bit was flipped"), ReleaseFaults())
    assert (plan.fault_step, plan.fault_rank) == (13, 2)
    for ctx in (_ctx(standby=False), _ctx(options=DrillOptions(backend="ray")), _ctx(nodes=1, world_size=2)):
        other = SilentCorruption().plan(spec, ctx)  # no standby to wait for: the flip is the workers' own
        ((alone,),) = [other.faults]
        assert not alone.gated and other.actions == ()


# -- the gate, opened or withheld from outside -------------------------------------------------------------
def _act(run: StandbyRun, timeout_s: float = 2.0) -> ActionRunner:
    spec = load_spec(REPO / "examples" / "digits-ddp.yaml", STANDBY)
    actions = ActionRunner(run, spec, Outcome(fault_step=13, fault_rank=2), timeout_s=timeout_s)
    actions.run_all(list(SilentCorruption().plan(spec, _ctx()).actions))
    return actions


def test_the_gate_opens_once_a_standby_is_ready(tmp_path: Path) -> None:
    run = StandbyRun(tmp_path, ready_after=2)
    actions = _act(run)
    assert RunFiles(tmp_path).fault_gate.exists()
    assert actions.standby_wait is not None and actions.standby_wait.ready
    assert actions.standby_wait.fault == "bit flip"


def test_a_job_that_ends_before_a_standby_is_ready_gets_no_flip_and_is_inconclusive(tmp_path: Path) -> None:
    run = StandbyRun(tmp_path, ready_after=None, ends_after=2)
    actions = _act(run)
    assert not RunFiles(tmp_path).fault_gate.exists(), "the gate opened with no standby ready"
    assert actions.standby_wait is not None and not actions.standby_wait.ready
    assert actions.outcome.too_late is not None and "no bit was flipped" in actions.outcome.too_late


# -- the verdict -------------------------------------------------------------------------------------------
def _run(tmp_path: Path, swapped: bool) -> RunHistory:
    """2 nodes x 2, rank 2 flipped at step 32, the check at 35 named it; a standby took node 1 (ranks 2 and 3)
    or, `swapped` False, a spare of node 1 took rank 2."""
    replaced = (2, 3) if swapped else (2,)
    sdc: dict[str, Any] = {"time": 6.5, "event": "sdc", "step": 35, "rank": 0, "suspects": [2], "decided": True}
    sdc |= {"replaced_by": "standby", "excluded_node": 1} if swapped else {"replaced_by": "spare"}
    events: list[dict[str, Any]] = [
        {"time": 1.0, "event": "start", "rank": r, "world_size": 4, "pid": 10 + r, "generation": 0} for r in range(4)
    ]
    events += [
        {"time": 6.0, "event": "fault", "kind": "bitflip", "rank": 2, "step": 32, "generation": 0},
        sdc,
        *({"time": 7.5, "event": "restore", "step": 30, "store": "local", "rank": r, "certified": True}
          for r in range(4)),
        *({"time": 7.55, "event": "recovery", "path": "inplace-rollback", "step": 30, "rank": r, "role": "spare"}
          for r in replaced),
        *({"time": 7.6, "event": "recovery", "path": "inplace-rollback", "step": 30, "rank": r, "role": "survivor"}
          for r in range(4) if r not in replaced),
        {"time": 8.0, "event": "first_step", "step": 31, "rank": 0, "generation": 0},
    ]  # fmt: skip
    RunFiles(tmp_path).events.write_text("".join(json.dumps(e) + "\n" for e in events))
    return RunHistory.load(tmp_path)


@pytest.mark.parametrize("swapped", [True, False])
def test_with_a_standby_node_the_verdict_wants_the_suspects_node_swapped(tmp_path: Path, swapped: bool) -> None:
    history = _run(tmp_path, swapped)
    report = DrillReport("sdc", "local", 0)
    summary = Summary(status="succeeded", params_sha256="ab")
    _fill_from_run(report, summary, history, Outcome(fault_step=13, fault_rank=2))
    report.reference_params_sha256, report.final_params_match_reference = "ab", True
    report.add(SilentCorruption().judge(report, history, _ctx()))
    checks = {c.name: c.passed for c in report.checks}
    assert checks["a standby node took the suspect's node 1 (replaced_by standby)"] is swapped
    assert report.passed is swapped, report.checks
    # The same same-node spare without a standby node in the spec is the right path.
    if not swapped:
        alone = DrillReport("sdc", "local", 0)
        _fill_from_run(alone, summary, history, Outcome(fault_step=13, fault_rank=2))
        alone.add(SilentCorruption().judge(alone, history, _ctx(standby=False)))
        assert alone.passed, alone.checks
