"""Runs a drill: the faulted job, the outside actions, the uninterrupted reference, the verdict."""

from __future__ import annotations

import copy
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.drills.history import RunHistory
from orchestrator.drills.report import DrillReport
from orchestrator.drills.scenarios import DrillContext, get_scenario
from orchestrator.errors import SpecError, UnsupportedFeature
from orchestrator.loader import validate_document
from orchestrator.spec import JobSpec

__all__ = ["DrillOptions", "run_drill"]

# Uninterrupted references by (backend, nodes, job): a reference depends only on the job, so drills of
# one job in one process (a test session, a seed sweep) run it once.
_REFERENCES: dict[tuple[str, int, str], tuple[str, dict[str, Any]]] = {}


@dataclass
class DrillOptions:
    """How to run a drill (the CLI flags)."""

    backend: str = "local"
    seed: int = 0
    at_step: int | None = None
    rank: int | None = None
    nodes: int | None = None
    reference: bool = True
    drill_dir: str | None = None
    timeout_s: float = 600.0
    quiet: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # scenario options (hang_timeout_s, slow_s, corruption, repeat)


def _isolate_stores(spec: dict[str, Any], tag: str) -> dict[str, Any]:
    """Point absolute and remote stores at drill-private locations, so a drill never restores from (or
    damages) a real job's checkpoints and the faulted run and the reference never share a store."""
    for store in spec["spec"]["checkpoint"]["stores"]:
        uri: str = store["uri"]
        if (uri.startswith("file://") and uri[len("file://") :].startswith("/")) or uri.startswith("/"):
            store["uri"] = f"file://./stores/{store.get('name') or 'store'}"
            store.pop("pvc", None)
        elif "://" in uri and not uri.startswith("file://"):
            store["uri"] = uri.rstrip("/") + f"/torchrig-drill-{tag}"
    spec["spec"]["checkpoint"]["resume"] = "auto"
    return spec


def _pick_fault(spec: JobSpec, options: DrillOptions, rng: random.Random) -> tuple[int, int, int]:
    steps = spec.spec.training.steps
    every = spec.spec.checkpoint.every.steps or max(1, steps // 4)
    world = (options.nodes or spec.spec.nodes.max) * spec.spec.procs_per_node
    if options.at_step is not None:
        if not 1 <= options.at_step < steps:
            raise SpecError(f"--at-step: must be between 1 and {steps - 1} (spec.training.steps is {steps})")
        step = options.at_step
    else:
        low = min(every + 2, steps - 1)
        step = rng.randint(low, max(low, steps - 2))
    if options.rank is not None:
        if not 0 <= options.rank < world:
            raise SpecError(f"--rank: must be between 0 and {world - 1} (world size {world})")
        rank = options.rank
    else:
        rank = rng.randrange(world)
    return step, rank, every


def run_drill(scenario_name: str, spec: JobSpec, options: DrillOptions) -> DrillReport:
    """Run one drill end to end and return its report (the caller writes, prints and plots it)."""
    scenario = get_scenario(scenario_name)
    rng = random.Random(options.seed)
    nodes = options.nodes or (scenario.needs_nodes if scenario.needs_nodes > 1 else 1)
    if scenario.needs_nodes > 1:
        if not spec.spec.nodes.elastic or spec.spec.nodes.min > nodes - 1:
            raise UnsupportedFeature(
                f"spec.nodes: {scenario.name} needs an elastic job that can lose a node "
                f"(spec.nodes.min <= {nodes - 1} < spec.nodes.max); got {spec.spec.nodes.min}..{spec.spec.nodes.max}"
            )
        options.nodes = nodes
    if nodes > spec.spec.nodes.max:
        raise SpecError(f"--nodes: at most spec.nodes.max ({spec.spec.nodes.max})")
    options.nodes = nodes
    fault_step, fault_rank, every = _pick_fault(spec, options, rng)
    world = nodes * spec.spec.procs_per_node
    ctx = DrillContext(
        scenario=scenario.name,
        backend=options.backend,
        seed=options.seed,
        rng=rng,
        steps=spec.spec.training.steps,
        world_size=world,
        checkpoint_every=every,
        fault_step=fault_step,
        fault_rank=fault_rank,
        nodes=nodes,
        options={"timeout_s": options.timeout_s, **options.extra},
    )
    tag = time.strftime("%Y%m%d-%H%M%S")
    drill_dir = Path(options.drill_dir or Path("runs") / spec.name / f"drill-{scenario.name}-{tag}")
    drill_dir.mkdir(parents=True, exist_ok=False)

    base = _isolate_stores(copy.deepcopy(spec.to_yaml_dict()), tag)
    faulted = scenario.prepare(copy.deepcopy(base), ctx)
    faulted_spec = validate_document(faulted, "drill")
    faults = scenario.faults(ctx)

    report = DrillReport(scenario=scenario.name, backend=options.backend, seed=options.seed)
    report.fault_step, report.fault_rank = ctx.fault_step, ctx.fault_rank
    ctx.event("drill_started", fault_step=ctx.fault_step, fault_rank=ctx.fault_rank, faults=faults)

    errors: list[BaseException] = []
    try:
        extra = scenario.launch_extra(ctx)
        env = {"TORCHRIG_FAULTS": json.dumps(faults)} if faults else {}
        run = _launch(faulted_spec, drill_dir / "run", options, env, extra=extra)
        summary = _supervise(scenario, run, ctx, faulted, options, errors)
    finally:
        scenario.cleanup(ctx)
    for exc in errors:
        report.notes.append(f"drill action failed: {exc!r}")
        report.check("drill actions ran", False, repr(exc))

    history = RunHistory.load(run.run_dir)
    _fill_from_run(report, summary, history, ctx)

    if options.reference:
        reference_spec = validate_document(scenario.prepare(copy.deepcopy(base), ctx), "drill-reference")
        key = (options.backend, nodes, reference_spec.model_dump_json(exclude={"metadata"}))
        if key in _REFERENCES:
            ref_dir, ref_summary = _REFERENCES[key]
            report.notes.append(f"reference reused from {ref_dir} (same job, backend and world size)")
        else:
            ref = _launch(reference_spec, drill_dir / "reference", options, {}, nodes=nodes)
            ref_summary = ref.wait(options.timeout_s)
            ref_dir = str(ref.run_dir)
            if ref_summary.get("status") == "succeeded":
                _REFERENCES[key] = (ref_dir, ref_summary)
        report.reference_run_dir = ref_dir
        report.reference_final_loss = ref_summary.get("final_loss")
        report.reference_params_sha256 = ref_summary.get("params_sha256")
        if scenario.compares_params and report.params_sha256 and report.reference_params_sha256:
            report.final_params_match_reference = report.params_sha256 == report.reference_params_sha256
        elif not scenario.compares_params:
            report.final_params_match_reference = None
    report.events = sorted(ctx.events + _job_events(history), key=lambda e: float(e["time"]))
    scenario.judge(report, history, ctx)
    report.write(drill_dir / "report.json")
    return report


def _supervise(
    scenario: Any,
    run: _Run,
    ctx: DrillContext,
    spec: dict[str, Any],
    options: DrillOptions,
    errors: list[BaseException],
) -> dict[str, Any]:
    """Wait for the run while the scenario's outside actions run in a thread."""

    def _during() -> None:
        try:
            scenario.during(run, ctx, spec)
        except BaseException as exc:  # reported, never swallowed: the verdict fails
            errors.append(exc)

    actor = threading.Thread(target=_during, name="drill-actions", daemon=True)
    actor.start()
    summary = run.wait(options.timeout_s)
    actor.join(timeout=5)
    return summary


def _job_events(history: RunHistory) -> list[dict[str, Any]]:
    keep = {"start", "restore", "checkpoint_committed", "store_failure", "watchdog", "fault", "finished", "first_step"}
    return [e for e in history.events if e.get("event") in keep]


def _fill_from_run(report: DrillReport, summary: dict[str, Any], history: RunHistory, ctx: DrillContext) -> None:
    report.status = str(summary.get("status", "unknown"))
    report.run_dir = str(history.run_dir)
    report.final_loss = summary.get("final_loss")
    report.params_sha256 = summary.get("params_sha256")
    report.world_sizes = list(summary.get("world_sizes") or history.world_sizes())
    report.damage = ctx.damage
    # Outside faults record the step the job had actually reached when they struck.
    report.fault_step, report.fault_rank = ctx.fault_step, ctx.fault_rank
    # The fault time: the worker's own `fault` event (exact), else the drill's outside action.
    worker_faults = [e for e in history.of("fault") if e.get("kind") not in (None, "slow")]
    if worker_faults:
        first = min(worker_faults, key=lambda e: float(e["time"]))
        ctx.event("fault_injected", kind=first.get("kind"), rank=first.get("rank"), step=first.get("step"))
        ctx.events[-1]["time"] = float(first["time"])
        report.fault_step = int(first.get("step", report.fault_step or 0))
    fault_times = [float(e["time"]) for e in ctx.events if e.get("event") == "fault_injected"]
    if not fault_times:
        return
    t_fault = min(fault_times)
    restores = history.restores_after(t_fault)
    report.restored_from = [
        {"store": r.get("store"), "step": r.get("step"), "source": r.get("source", "store")} for r in restores
    ]
    if restores:
        report.resumed_from_step = int(restores[0]["step"])
    elif any(e for e in history.of("start") if float(e["time"]) > t_fault):
        report.resumed_from_step = 0  # restarted with nothing to restore: started over
    if report.resumed_from_step is not None and report.fault_step is not None:
        report.lost_steps = max(0, report.fault_step - report.resumed_from_step)
    first_step = history.first_step_after(max([t_fault] + [float(r["time"]) for r in restores[:1]]))
    if first_step is not None:
        report.mttr_seconds = round(float(first_step["time"]) - t_fault, 3)
        ctx.event("recovered", step=first_step.get("step"))
        ctx.events[-1]["time"] = float(first_step["time"])
    report.recovered = report.status == "succeeded" and (first_step is not None or not restores)


class _Run:
    """Adapter over a backend's running job: what scenarios and the runner need."""

    def __init__(self, handle: Any, run_dir: Path) -> None:
        self.handle = handle
        self.run_dir = run_dir

    def alive(self) -> bool:
        return self.handle.poll() is None

    def kill_node(self, index: int) -> None:
        self.handle.kill_node(index)

    def add_node(self) -> None:
        self.handle.add_node()

    def wait(self, timeout_s: float) -> dict[str, Any]:
        summary: dict[str, Any] | None = self.handle.wait(timeout_s=timeout_s)
        return dict(summary or {})


def _launch(
    spec: JobSpec,
    run_dir: Path,
    options: DrillOptions,
    env: dict[str, str],
    nodes: int | None = None,
    extra: dict[str, Any] | None = None,
) -> _Run:
    """Start the job on the drill's backend without blocking (`Backend.launch` -> a supervised run)."""
    from orchestrator.backends import get_backend
    from orchestrator.backends.base import SubmitOptions

    backend = get_backend(options.backend)
    submit = SubmitOptions(
        run_dir=str(run_dir), nodes=nodes or options.nodes, quiet=True, env=dict(env), extra=dict(extra or {})
    )
    launch = getattr(backend, "launch", None)
    if launch is None:
        raise UnsupportedFeature(f"--backend: {options.backend!r} cannot run drills (it has no supervised launch)")
    handle = launch(spec, submit)
    return _Run(handle, Path(handle.run_dir))
