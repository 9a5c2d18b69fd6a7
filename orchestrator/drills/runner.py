"""Runs a drill: the scenario's plan, the faulted job with its outside actions, the uninterrupted
reference, the verdict."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Iterator
from pathlib import Path

from orchestrator.backends.base import Backend, LocalOptions, NodePlacement, RunState, SubmitOptions, SupervisedRun
from orchestrator.drills.actions import ActionRunner, emulated_network, placements, supervise
from orchestrator.drills.history import RunHistory
from orchestrator.drills.plan import DrillContext, DrillOptions, Outcome, fault_dicts, faults_env
from orchestrator.drills.report import DrillReport
from orchestrator.drills.scenarios import Scenario, get_scenario
from orchestrator.drills.spec_patch import isolate_stores, revalidate
from orchestrator.errors import SpecError, UnsupportedFeature
from orchestrator.spec import JobSpec
from training.config import DEFAULT_SDC_EVERY, Strategy
from training.contract import DrillEventKind, EventKind, RunFiles, Summary
from training.inplace.protocol import ROLLBACK_PATH

__all__ = ["DrillOptions", "adopt_reference", "run_drill"]

# Uninterrupted references by (backend, nodes, job): a reference depends only on the job, so drills of
# one job in one process (a test session, a seed sweep) run it once.
_REFERENCES: dict[tuple[str, int, str], tuple[str, Summary]] = {}

# The job's own events that go into the report's timeline.
_TIMELINE_EVENTS = {
    EventKind.START,
    EventKind.RESTORE,
    EventKind.CHECKPOINT_COMMITTED,
    EventKind.STORE_FAILURE,
    EventKind.WATCHDOG,
    EventKind.FAULT,
    EventKind.FINISHED,
    EventKind.FIRST_STEP,
    EventKind.PREEMPTED,
    EventKind.RECOVERY,
    EventKind.SDC,
}


def _pick_fault(spec: JobSpec, options: DrillOptions, rng: random.Random, latest: float = 1.0) -> tuple[int, int, int]:
    """(step, rank, checkpoint every) of the fault: the options' when given, else drawn from `rng`
    between the first checkpoint and `latest` x spec.training.steps."""
    steps = spec.spec.training.steps
    every = spec.spec.checkpoint.every.steps or max(1, steps // 4)
    world = (options.nodes or spec.spec.nodes.max) * spec.spec.procs_per_node
    if options.at_step is not None:
        if not 1 <= options.at_step < steps:
            raise SpecError(f"--at-step: must be between 1 and {steps - 1} (spec.training.steps is {steps})")
        step = options.at_step
    else:
        low = min(every + 2, steps - 1)
        step = rng.randint(low, max(low, min(steps - 2, int(steps * latest))))
    if options.rank is not None:
        if not 0 <= options.rank < world:
            raise SpecError(f"--rank: must be between 0 and {world - 1} (world size {world})")
        rank = options.rank
    else:
        rank = rng.randrange(world)
    return step, rank, every


def _drill_nodes(scenario: Scenario, spec: JobSpec, options: DrillOptions) -> int:
    nodes = options.nodes or scenario.default_nodes(spec)
    if (reason := scenario.nodes_unmet(spec, nodes, options.backend)) is not None:
        raise UnsupportedFeature(f"spec.nodes: {scenario.name} {reason}")
    if nodes > spec.spec.nodes.max:
        raise SpecError(f"--nodes: at most spec.nodes.max ({spec.spec.nodes.max})")
    return nodes


def run_drill(scenario_name: str, spec: JobSpec, options: DrillOptions) -> DrillReport:
    """Run one drill end to end and return its report (the caller writes, prints and plots it)."""
    from orchestrator.backends.local_plan import standby_nodes  # lazily, as `scenarios._standby`

    scenario = get_scenario(scenario_name)
    rng = random.Random(options.seed)
    options = dataclasses.replace(options, nodes=_drill_nodes(scenario, spec, options))
    nodes = options.nodes or 1
    fault_step, fault_rank, every = _pick_fault(spec, options, rng, scenario.latest_fault)
    ctx = DrillContext(
        scenario=scenario.name,
        seed=options.seed,
        steps=spec.spec.training.steps,
        world_size=nodes * spec.spec.procs_per_node,
        nodes=nodes,
        checkpoint_every=every,
        fault_step=fault_step,
        fault_rank=fault_rank,
        options=options,
        rng=rng,
        in_memory_every=spec.spec.checkpoint.in_memory.every,
        sdc_every=spec.spec.sdc.every or DEFAULT_SDC_EVERY,
        sdc_replicas=nodes if spec.spec.training.strategy is Strategy.hsdp else nodes * spec.spec.procs_per_node,
        in_place=spec.spec.restarts.in_place,
        sharded=spec.spec.training.strategy is not Strategy.ddp,
        standby=standby_nodes(spec) > 0,
    )
    tag = time.strftime("%Y%m%d-%H%M%S")
    plan = scenario.plan(isolate_stores(spec, tag, "run"), ctx)
    faulted_spec = revalidate(plan.spec, "drill")
    drill_dir = Path(options.drill_dir or Path("runs") / spec.name / f"drill-{scenario.name}-{tag}")
    _backend(options).check(faulted_spec, SubmitOptions(local=LocalOptions(nodes=options.nodes)))  # before any file
    if drill_dir.exists() and (not drill_dir.is_dir() or any(drill_dir.iterdir())):
        what = "holds files (an earlier drill's?)" if drill_dir.is_dir() else "is not a directory"
        raise SpecError(f"--drill-dir: {drill_dir} {what}; give a new or empty directory")
    drill_dir.mkdir(parents=True, exist_ok=True)

    report = DrillReport(scenario=scenario.name, backend=options.backend, seed=options.seed)
    report.fault_step, report.fault_rank = plan.fault_step, plan.fault_rank
    outcome = Outcome(fault_step=plan.fault_step, fault_rank=plan.fault_rank)
    outcome.record(
        DrillEventKind.DRILL_STARTED,
        fault_step=plan.fault_step,
        fault_rank=plan.fault_rank,
        faults=fault_dicts(plan.faults),
    )
    with emulated_network(plan, outcome) as network:
        run = _launch(faulted_spec, drill_dir / "run", options, faults_env(plan.faults), placements(network))
        runner = ActionRunner(
            run,
            faulted_spec,
            outcome,
            timeout_s=options.timeout_s,
            network=network,
            lose_store_hook=options.lose_store_hook,
            store_back_hook=options.store_back_hook,
        )
        with _stopped_if_left(run):
            summary = supervise(run, runner, plan.actions, options.timeout_s)
        if scenario.resumes_after_preemption and options.backend == "ray" and summary.status == RunState.SUCCEEDED:
            # Nothing to resubmit: each preempted rank ended its Ray Train worker after the emergency
            # checkpoint, and Ray Train's `FailureConfig` restarted the worker group, which restored it.
            report.check(
                "Ray Train's group restart resumed the preempted run",
                summary.restarts >= 1,
                f"status {summary.status}, {summary.restarts} worker group restart(s)",
            )
        elif scenario.resumes_after_preemption and not outcome.errors:
            # The job stopped on its own after the preemption (nothing restarts it in place): start it
            # again in the same run directory, as a scheduler would resubmit it.
            report.check(
                "the preempted run stopped (exit 202), to be resubmitted",
                summary.status == RunState.PREEMPTED,
                f"status {summary.status}: {summary.reason or ''}".rstrip(": "),
            )
            if summary.status == RunState.PREEMPTED:
                # What the stores hold as the preempted run left them: a save can commit on a store and
                # the process end (the deadline's os._exit) before its `checkpoint_committed` event is
                # written, so the events alone understate what a restart may rightly restore.
                outcome.record(DrillEventKind.RESUBMITTED, status=summary.status, committed=runner.committed_by_store())
                run = _launch(faulted_spec, drill_dir / "run", options, faults_env(plan.faults), placements(network))
                with _stopped_if_left(run):
                    summary = run.wait(options.timeout_s)
    for exc in outcome.errors:
        report.notes.append(f"drill action failed: {exc!r}")
        report.check("drill actions ran", False, repr(exc))
    if (standby := runner.standby_wait) is not None:
        report.check(f"a standby node was ready before the {standby.fault}", standby.ready, standby.detail)

    history = RunHistory.load(run.run_dir)
    _fill_from_run(report, summary, history, outcome)
    if options.reference:
        # A shared reference runs the job as given (scenario patches change stores and timeouts, never the
        # numerics), keyed by the job before its stores are isolated: one per world size for a campaign.
        patched = isolate_stores(spec, tag, "reference")
        if not options.shared_reference:
            patched = scenario.patch(patched, ctx)
        reference_spec = revalidate(patched, "drill-reference")
        key_spec = spec if options.shared_reference else reference_spec
        _compare_with_reference(report, scenario, reference_spec, drill_dir / "reference", options, key_spec)
    timeline = [e.to_dict() for e in outcome.timeline]
    timeline += [e.to_dict() for e in history.events if e.kind in _TIMELINE_EVENTS]
    report.events = sorted(timeline, key=lambda e: float(e["time"]))
    report.add(scenario.judge(report, history, ctx))
    if outcome.too_late is not None:
        # Judged all the same (the checks show what the run did), but a fault that struck a finished
        # job proved neither that it recovers nor that it does not.
        report.inconclusive = outcome.too_late
    report.write(drill_dir / "report.json")
    return report


def _reference_key(backend: str, nodes: int, spec: JobSpec) -> tuple[str, int, str]:
    return (backend, nodes, spec.model_dump_json(exclude={"metadata"}))


def adopt_reference(backend: str, nodes: int, spec: JobSpec, run_dir: str | Path) -> bool:
    """Reuse the succeeded reference run in `run_dir` for drills of `spec` with `shared_reference` (a
    resumed campaign keeps its one reference per world size). False when that run did not succeed."""
    summary = Summary.read(RunFiles(run_dir).summary)
    if summary is None or summary.status != RunState.SUCCEEDED:
        return False
    _REFERENCES[_reference_key(backend, nodes, spec)] = (str(run_dir), summary)
    return True


def _compare_with_reference(
    report: DrillReport, scenario: Scenario, spec: JobSpec, run_dir: Path, options: DrillOptions, key_spec: JobSpec
) -> None:
    """Run (or reuse) the uninterrupted reference and compare the final parameters with it."""
    nodes = options.nodes or 1
    key = _reference_key(options.backend, nodes, key_spec)
    if key in _REFERENCES:
        ref_dir, ref_summary = _REFERENCES[key]
        report.notes.append(f"reference reused from {ref_dir} (same job, backend and world size)")
    else:
        ref = _launch(spec, run_dir, options, {}, [])
        with _stopped_if_left(ref):
            ref_summary = ref.wait(options.timeout_s)
        ref_dir = str(ref.run_dir)
        if ref_summary.status == RunState.SUCCEEDED:
            _REFERENCES[key] = (ref_dir, ref_summary)
    report.reference_run_dir = ref_dir
    report.reference_final_loss = ref_summary.final_loss
    report.reference_params_sha256 = ref_summary.params_sha256
    if scenario.compares(spec, options.backend) and report.params_sha256 and report.reference_params_sha256:
        report.final_params_match_reference = report.params_sha256 == report.reference_params_sha256
    elif not scenario.compares(spec, options.backend):
        report.final_params_match_reference = None


def _restart_path(backend: str) -> str:
    """How a group restart is named in a report: on Ray it is Ray Train's (`FailureConfig`), not torchrun's."""
    return "ray-restart" if backend == "ray" else "restart"


def _fill_from_run(report: DrillReport, summary: Summary, history: RunHistory, outcome: Outcome) -> None:
    report.status = summary.status
    report.group_restarts = summary.restarts
    report.run_dir = str(history.run_dir)
    report.final_loss = summary.final_loss
    report.params_sha256 = summary.params_sha256
    report.world_sizes = list(summary.world_sizes or history.world_sizes())
    report.damage = outcome.damage
    # Outside faults record the step the job had actually reached when they struck.
    report.fault_step, report.fault_rank = outcome.fault_step, outcome.fault_rank
    report.fault_node = outcome.fault_node
    # The fault time: the worker's own `fault` event (exact), else the drill's outside action.
    worker_faults = [e for e in history.of(EventKind.FAULT) if e.get("kind") not in (None, "slow")]
    if worker_faults:
        first = worker_faults[0]
        outcome.record(
            DrillEventKind.FAULT_INJECTED, at=first.time, kind=first.get("kind"), rank=first.rank, step=first.step
        )
        report.fault_step = first.step if first.step is not None else (report.fault_step or 0)
    fault_times = outcome.times(DrillEventKind.FAULT_INJECTED)
    if not fault_times:
        return
    t_fault = min(fault_times)
    restores = history.restores_after(t_fault)
    report.restored_from = [
        {"store": r.get("store"), "step": r.step, "source": r.get("source", "store")} for r in restores
    ]
    # In place (`training.inplace`): the survivors kept their state and a spare took the dead rank's
    # place; no restore. Recovered from the step every member agreed on, measured from the fault to
    # the first step completed after the new group formed.
    in_place = [e for e in history.of(EventKind.RECOVERY) if e.time >= t_fault and e.get("path") == "inplace"]
    # After an SDC whose majority named the suspect: a spare took its rank and every member reloaded the
    # newest certified checkpoint in place (its restores are no group restart's).
    rolled = [e for e in history.of(EventKind.RECOVERY) if e.time >= t_fault and e.get("path") == ROLLBACK_PATH]
    recovered_at = t_fault
    if restores and rolled:
        report.recovery_path = ROLLBACK_PATH
        report.resumed_from_step = restores[0].step or 0
        recovered_at = max(t_fault, *(e.time for e in rolled))
    elif restores:
        report.recovery_path = _restart_path(report.backend)
        report.resumed_from_step = restores[0].step or 0
        recovered_at = max(t_fault, restores[0].time)
    elif in_place:
        report.recovery_path = "inplace"
        report.resumed_from_step = min(e.step for e in in_place if e.step is not None)
        recovered_at = min(e.time for e in in_place)
    elif any(e for e in history.of(EventKind.START) if e.time > t_fault):
        report.recovery_path = _restart_path(report.backend)
        report.resumed_from_step = 0  # restarted with nothing to restore: started over
    if report.resumed_from_step is not None and report.fault_step is not None:
        # A restart redoes every step done since the restored one, those the job still completed between
        # the strike and the group's end too (a node killed from outside dies a moment after its step).
        done = max(report.fault_step, history.last_step_before(restores[0].time)) if restores else report.fault_step
        report.lost_steps = max(0, done - report.resumed_from_step)
    first_step = history.first_step_after(recovered_at)
    if first_step is not None:
        report.mttr_seconds = round(first_step.time - t_fault, 3)
        outcome.record(DrillEventKind.RECOVERED, at=first_step.time, step=first_step.step)
    report.recovered = report.status == RunState.SUCCEEDED and (first_step is not None or not restores)


def _backend(options: DrillOptions) -> Backend:
    """The drill's backend; UnsupportedFeature when it cannot supervise a run."""
    from orchestrator.backends import get_backend

    backend = get_backend(options.backend)
    if not backend.capabilities.supervised:
        raise UnsupportedFeature(f"--backend: {options.backend!r} cannot run drills (it has no supervised launch)")
    return backend


@contextlib.contextmanager
def _stopped_if_left(run: SupervisedRun) -> Iterator[None]:
    """Stop a run the drill started when the drill leaves it early (an action's error, Ctrl-C, `torchrig
    drill` sent SIGTERM): its agents and workers would otherwise train on with nobody to supervise them.
    Its run directory and checkpoints are kept."""
    try:
        yield
    except BaseException:
        run.stop(grace_s=5.0)
        raise


def _launch(
    spec: JobSpec, run_dir: Path, options: DrillOptions, env: dict[str, str], where: list[NodePlacement]
) -> SupervisedRun:
    """Start the job on the drill's backend without blocking (`Backend.launch` -> a supervised run)."""
    backend = _backend(options)
    submit = SubmitOptions(
        run_dir=str(run_dir),
        quiet=options.quiet,
        env=dict(env),
        local=LocalOptions(nodes=options.nodes, placements=list(where)),
    )
    return backend.launch(spec, submit)
