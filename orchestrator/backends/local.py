"""The local backend: a job on this machine through torch.distributed.elastic (the engine of torchrun).

One *agent* per emulated node runs `python -m torch.distributed.run` (elastic's own agent, restart and
rendezvous logic: nothing home-made) in its own session. All agents join one c10d rendezvous whose
TCPStore is served by the supervisor (`_local_store`), with `is_host=false` and fast failure
detection, so any agent may die without taking the job down, and a replacement joins the running
rendezvous (`LocalRun.kill_node`, `LocalRun.add_node`: what the drills use).

The pieces, one job each: `local_plan` (what will run: the dry run, ports), `local_reuse` (may a run
directory take this run), `local_run` (`LocalRun`, the supervisor: start, watch, stop, summary.json),
`supervise` (a detached supervisor process for `schedule`), and this module, the `Backend` over them.
`launch` supervises from the calling process (`torchrig run`, drills); `schedule`/`submit` return at
once and leave the run to a detached supervisor (`torchrig submit`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from orchestrator.backends._preflight import preflight_here
from orchestrator.backends.base import Backend, Capabilities, DryRun, RunHandle, RunStatus, SubmitOptions
from orchestrator.backends.local_plan import RDZV_CONF, LocalPlan, create_local_plan
from orchestrator.backends.local_reuse import check_reuse
from orchestrator.backends.local_run import LocalRun
from orchestrator.backends.supervise import cancel_detached, start_detached
from orchestrator.errors import BackendError, SpecError, UnsupportedFeature
from orchestrator.rundir import find_run_dirs, iter_rank_lines, new_run_dir, rank_of_line, run_state
from orchestrator.spec import JobSpec
from training.contract import RunFiles
from training.contract.files import private_umask

__all__ = ["RDZV_CONF", "LocalBackend", "LocalPlan", "LocalRun", "parse_run_ref"]


def parse_run_ref(ref: str) -> Path:
    """`local://runs/x/20261122-230000` or a plain path -> the run directory."""
    return Path(ref.removeprefix("local://"))


class LocalBackend(Backend):
    """Runs a job on this machine with torch.distributed.elastic; `--nodes N` emulates N nodes."""

    name: ClassVar[str] = "local"
    capabilities: ClassVar[Capabilities] = Capabilities(elastic=True, multi_node=True, gpus=True, supervised=True)

    def _check(self, spec: JobSpec, options: SubmitOptions) -> None:
        nodes = options.local.nodes if options.local.nodes is not None else spec.spec.nodes.min
        if nodes < 1:
            raise SpecError("--nodes: must be at least 1")
        if nodes > spec.spec.nodes.max:
            raise SpecError(f"--nodes: {nodes} exceeds spec.nodes.max ({spec.spec.nodes.max})")
        if nodes < spec.spec.nodes.min:
            raise SpecError(
                f"--nodes: {nodes} is below spec.nodes.min ({spec.spec.nodes.min}): the rendezvous would wait for "
                "nodes that never start"
            )
        if spec.spec.resources.gpus > 0:
            import torch

            have = torch.cuda.device_count()
            need = nodes * spec.spec.procs_per_node
            if have < need:
                raise UnsupportedFeature(
                    f"spec.resources.gpus: {need} GPU(s) needed for {nodes} local node(s), {have} visible"
                )

    def _dry_run(self, spec: JobSpec, options: SubmitOptions) -> LocalPlan:
        if options.run_dir:
            run_dir = Path(options.run_dir)
            resume = check_reuse(run_dir, spec)
        else:
            run_dir, resume = new_run_dir(spec.name), False
        return create_local_plan(spec, options, run_dir, resume=resume)

    @staticmethod
    def _plan(dryrun: DryRun) -> LocalPlan:
        if not isinstance(dryrun.request, LocalPlan):
            raise BackendError("local backend: the dry run is not a local plan")
        return dryrun.request

    def _launch(self, dryrun: DryRun) -> LocalRun:
        """Start the plan of a dry run, supervised from this process (call `wait` on the run).

        The preflight runs once the agents are started (`LocalRun.start`): its `import torch` and theirs
        overlap instead of following each other, and its error still stops everything before a worker
        starts or a file of the run is written (the agents wait for the store, opened after it)."""
        plan = self._plan(dryrun)
        run = LocalRun(spec=dryrun.spec, plan=plan)
        run.start(preflight=lambda: preflight_here(dryrun.spec, plan.run_dir))  # under the run's private umask
        return run

    def launch_preflighted(self, dryrun: DryRun) -> LocalRun:
        """Start the plan of a dry run whose preflight already ran (the detached supervisor of `submit`,
        whose CLI ran it: the second run cost a torch import, seconds, before the run could start)."""
        run = LocalRun(spec=dryrun.spec, plan=self._plan(dryrun))
        run.start()
        return run

    def _schedule(self, dryrun: DryRun) -> RunHandle:
        """Start the plan under a detached supervisor process and return at once (`torchrig submit`): the
        preflight runs here, once, so its one-line error and exit code reach the user."""
        plan = self._plan(dryrun)
        with private_umask():
            preflight_here(dryrun.spec, plan.run_dir)
        return start_detached(dryrun, Path(plan.run_dir), plan.to_json(), preflighted=True)

    def request_from_json(self, data: Any) -> LocalPlan:
        """The plan a detached run stored (`supervise`)."""
        return LocalPlan.from_json(dict(data))

    def _status(self, run_id: str) -> RunStatus:
        run_dir = parse_run_ref(run_id)
        if not run_dir.is_dir():
            raise SpecError(f"RUN: no such run directory: {run_dir}")
        state, message, details = run_state(run_dir)
        return RunStatus(RunHandle(self.name, str(run_dir)), state, message, details)

    def _logs(self, run_id: str, rank: int | None, follow: bool) -> Iterator[str]:
        run_dir = parse_run_ref(run_id)
        if not RunFiles(run_dir).logs.is_dir():
            raise SpecError(f"RUN: no logs in {run_dir}")
        if rank is not None:
            _check_rank(run_dir, rank)
        if not follow:
            yield from iter_rank_lines(run_dir, rank)
            return
        yield from _follow(run_dir, rank)

    def _cancel(self, run_id: str) -> RunStatus:
        cancel_detached(parse_run_ref(run_id))
        return self._status(run_id)

    def _list(self) -> list[RunStatus]:
        out = []
        for run_dir in find_run_dirs():
            state, message, details = run_state(run_dir)
            out.append(RunStatus(RunHandle(self.name, str(run_dir)), state, message, details))
        return out


def _check_rank(run_dir: Path, rank: int) -> None:
    """`--rank` names a rank the run can have (its job's largest world), not an empty filter."""
    from orchestrator.loader import load_spec

    try:
        spec = load_spec(RunFiles(run_dir).job, allow_inline_secrets=True)  # the run accepted them
    except SpecError:
        return  # no readable job.yaml: the lines say what there is
    world = spec.spec.nodes.max * spec.spec.procs_per_node
    if rank >= world:
        raise SpecError(f"--rank: no rank {rank} in this run (ranks 0-{world - 1})")


def _follow(run_dir: Path, rank: int | None, poll_s: float = 0.5) -> Iterator[str]:
    """Lines of the node logs as they are written, until the run is over and nothing new arrives."""
    offsets: dict[Path, int] = {}
    partial: dict[Path, str] = {}
    while True:
        got = False
        for log in sorted(RunFiles(run_dir).logs.glob("node*.log")):
            with log.open(errors="replace") as fh:
                fh.seek(offsets.get(log, 0))
                chunk = fh.read()
                offsets[log] = fh.tell()
            if not chunk:
                continue
            got = True
            lines = (partial.pop(log, "") + chunk).split("\n")
            if lines[-1]:
                partial[log] = lines[-1]
            for line in lines[:-1]:
                if rank is None or rank_of_line(line) == rank:
                    yield line
        if not got and run_state(run_dir)[0].terminal:
            return
        time.sleep(poll_s)
