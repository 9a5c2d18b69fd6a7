"""Drill scenarios: pure policies that decide how a drill prepares the job, what breaks, and the verdict.

A scenario turns a `DrillContext` into a `DrillPlan` (`plan`): a patched copy of the spec (a second
store, a short watchdog), the faults the workers inject into themselves (exact step, real SIGKILL),
and the outside actions to carry out on the running job (kill a node, damage a store). After the run,
`judge` turns what the run left behind into a `Verdict`. Scenarios run nothing themselves: the runner
(`orchestrator.drills.runner`) launches the job and `orchestrator.drills.actions` carries out the plan.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from typing import Any, ClassVar

from orchestrator.backends.base import RunState
from orchestrator.drills.damage import CorruptionKind
from orchestrator.drills.history import RunHistory
from orchestrator.drills.plan import (
    Action,
    AwaitCommit,
    AwaitProgress,
    AwaitStandby,
    AwaitStep,
    AwaitStoreFailure,
    AwaitWorldSize,
    DrillContext,
    DrillPlan,
    Fault,
    LinkCut,
    LinkHeal,
    NodeAdd,
    NodeKill,
    Preempt,
    RankKill,
    ReleaseFaults,
    StoreBack,
    StoreCorrupt,
    StoreLoss,
)
from orchestrator.drills.report import DrillReport, Verdict
from orchestrator.drills.spec_patch import patch_section, with_fallback_store
from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec
from training.contract import DrillEventKind, Event, EventKind, RunFiles
from training.faults import BITFLIP_TARGETS

__all__ = ["SCENARIOS", "Scenario", "get_scenario"]


def _fault_time(report: DrillReport) -> float | None:
    times = report.event_times(DrillEventKind.FAULT_INJECTED)
    return min(times) if times else None


def _stored_at_resubmit(report: DrillReport) -> list[int]:
    """The steps some store held a manifest for when the drill resubmitted the job (oldest first)."""
    for entry in report.events:
        if entry.get("event") == DrillEventKind.RESUBMITTED:
            committed = entry.get("committed") or {}
            return sorted({int(s) for steps in committed.values() for s in steps})
    return []


def _standby(spec: JobSpec) -> bool:
    """The job runs standby nodes (`restarts.spareNodes`, where in-place recovery applies)."""
    from orchestrator.backends.local_plan import standby_nodes

    return standby_nodes(spec) > 0


def _params_check(verdict: Verdict, report: DrillReport) -> None:
    verdict.check(
        "final parameters bit-identical to the uninterrupted reference",
        bool(report.final_params_match_reference),
        f"{(report.params_sha256 or '-')[:16]} vs {(report.reference_params_sha256 or '-')[:16]}",
    )


def _succeeded_check(verdict: Verdict, report: DrillReport) -> None:
    verdict.check("job succeeded", report.status == RunState.SUCCEEDED, f"status {report.status}")


def _short_watchdog(spec: JobSpec, ctx: DrillContext) -> JobSpec:
    timeout = min(spec.spec.restarts.step_timeout_seconds, ctx.options.hang_timeout_s)
    return patch_section(spec, "restarts", step_timeout_seconds=timeout)


class Scenario:
    """Base: a kill-free scenario that expects bit-exact recovery; subclasses override what differs."""

    name: ClassVar[str]
    summary: ClassVar[str]
    proves: ClassVar[str]
    needs_nodes: ClassVar[int] = 1
    compares_params: ClassVar[bool] = True  # same world size -> params must match the reference bit for bit
    needs_restore: ClassVar[bool] = True
    needs_network: ClassVar[bool] = False  # each emulated node in its own network namespace
    resumes_after_preemption: ClassVar[bool] = False  # a run that ends `preempted` is started again
    # The drawn fault step is at most this fraction of spec.training.steps (what follows the fault
    # must fit in the rest of the job: kill-node shrinks, then grows back).
    latest_fault: ClassVar[float] = 1.0

    # -- decisions ---------------------------------------------------------------------------------
    def default_nodes(self, spec: JobSpec) -> int:
        """How many emulated nodes the drill starts without `--nodes`: what it needs, at least spec.nodes.min
        (fewer would leave the rendezvous waiting for nodes that never start)."""
        return max(self.needs_nodes, spec.spec.nodes.min)

    def unmet(self, spec: JobSpec, nodes: int | None = None) -> str | None:
        """Why this drill cannot run `spec` on `nodes` emulated nodes (default: `needs_nodes`) here, or None.

        A single drill fails with it; a campaign reports the case as skipped with it.
        """
        if (reason := self.nodes_unmet(spec, nodes or self.default_nodes(spec))) is not None:
            return reason
        if self.needs_network:
            from orchestrator.drills.netns import netns_supported

            return netns_supported()
        return None

    def nodes_unmet(self, spec: JobSpec, nodes: int, backend: str = "local") -> str | None:
        """Why `spec` cannot lose one of `nodes` nodes on `backend` when this drill needs to, or None."""
        if self.needs_nodes > 1 and (not spec.spec.nodes.elastic or spec.spec.nodes.min > nodes - 1):
            return (
                f"needs an elastic job that can lose a node (spec.nodes.min <= {nodes - 1} < spec.nodes.max); "
                f"got {spec.spec.nodes.min}..{spec.spec.nodes.max}"
            )
        return None

    def patch(self, spec: JobSpec, ctx: DrillContext) -> JobSpec:
        """The spec of the faulted run and of its reference (default: unchanged)."""
        return spec

    def faults(self, ctx: DrillContext) -> list[Fault]:
        """Faults the workers inject into themselves (default: none)."""
        return []

    def actions(self, spec: JobSpec, ctx: DrillContext) -> list[Action]:
        """Outside actions on the running job, in order (default: none)."""
        return []

    def plan(self, spec: JobSpec, ctx: DrillContext) -> DrillPlan:
        """Every decision for one drill. The fault is aimed where the first self-injected fault that
        breaks something fires (a `slow` fault only paces), else at the drawn step and rank."""
        patched = self.patch(spec, ctx)
        faults = self.faults(ctx)
        aim = next((f for f in faults if f.kind != "slow"), None)
        return DrillPlan(
            spec=patched,
            faults=tuple(faults),
            actions=tuple(self.actions(patched, ctx)),
            fault_step=aim.step if aim else ctx.fault_step,
            fault_rank=aim.rank if aim else ctx.fault_rank,
            network=self.needs_network,
        )

    # -- verdict -------------------------------------------------------------------------------------
    def compares(self, spec: JobSpec, backend: str = "local") -> bool:
        """Whether the final parameters of `spec`'s drill on `backend` must equal the reference's."""
        return self.compares_params

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> Verdict:
        verdict = Verdict()
        _succeeded_check(verdict, report)
        if self.needs_restore and report.recovery_path == "inplace":
            # `restarts.mode: inplace`: survivors kept their state, a spare took the dead rank's place.
            verdict.check(
                "recovered in place (a warm spare took the lost rank's place)",
                bool(history.of(EventKind.RECOVERY)),
                f"resumed after step {report.resumed_from_step}, MTTR {report.mttr_seconds} s",
            )
            detail = f"fault at step {report.fault_step}, resumed after step {report.resumed_from_step}"
            sources = {e.get("source") for e in history.of(EventKind.RECOVERY) if e.get("path") == "inplace"}
            if "replica" in sources:  # FSDP/HSDP: back to the newest in-memory snapshot every member held
                limit = ctx.in_memory_every or 0
                verdict.check(
                    f"at most checkpoint.inMemory.every ({limit}) steps lost",
                    report.lost_steps is not None and report.lost_steps <= limit,
                    detail,
                )
            else:
                verdict.check("no step lost", report.lost_steps == 0, detail)
        elif self.needs_restore:
            restored = report.resumed_from_step is not None
            verdict.check(
                "restored after the fault",
                restored,
                f"restored from step {report.resumed_from_step}" if restored else "no restore after the fault",
            )
            # The event of a commit can land after the fault even when the manifest was written before it
            # (rank 0 lives on for a moment), so the invariant is a range: nothing older than what was
            # committed before the fault, nothing later than the fault step.
            expected = history.last_committed_before(_fault_time(report))
            if expected is not None and report.resumed_from_step is not None:
                verdict.check(
                    "resumed from the newest checkpoint committed before the fault",
                    expected <= report.resumed_from_step <= (report.fault_step or expected),
                    f"committed before the fault: {expected}, resumed {report.resumed_from_step}, "
                    f"fault at {report.fault_step}",
                )
        if self.compares_params and report.reference_params_sha256 is not None:
            _params_check(verdict, report)
        return verdict


class KillWorker(Scenario):
    name = "kill-worker"
    summary = "SIGKILL one rank at a step; a warm spare takes its place in memory (or the group restarts)."
    proves = (
        "a dead worker costs no step in place (at most the steps since the last checkpoint on the restart "
        "path), and the result is unchanged."
    )

    def patch(self, spec: JobSpec, ctx: DrillContext) -> JobSpec:
        repeat = ctx.options.repeat
        if repeat <= 1:
            return spec
        needed = ctx.checkpoint_every * (repeat + 1) + 1
        if ctx.steps < needed or ctx.checkpoint_every < 2:
            raise SpecError(
                f"--repeat {repeat}: needs spec.training.steps >= {needed} and spec.checkpoint.every.steps >= 2 "
                f"(one kill after each checkpoint); got steps {ctx.steps}, every {ctx.checkpoint_every}"
            )
        # Kill g fires in restart generation g: this drill exercises the restart path (the soak test
        # `tests/integration/test_inplace.py` repeats in-place recoveries).
        return patch_section(spec, "restarts", max=max(spec.spec.restarts.max, repeat), mode="restart")

    def faults(self, ctx: DrillContext) -> list[Fault]:
        repeat = ctx.options.repeat
        if repeat <= 1:
            return [Fault(kind="kill", rank=ctx.fault_rank, step=ctx.fault_step)]
        # Kill g (in restart generation g) draws its rank and its offset past the g-th checkpoint from
        # seed + g: each generation resumes from a checkpoint at or after every * g, so it always fires.
        out: list[Fault] = []
        for g in range(repeat):
            rng = random.Random(ctx.seed + g)
            step = ctx.checkpoint_every * (g + 1) + rng.randint(1, ctx.checkpoint_every - 1)
            out.append(Fault(kind="kill", rank=rng.randrange(ctx.world_size), step=step, generation=g))
        return out

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> Verdict:
        repeat = ctx.options.repeat
        if repeat <= 1:
            return super().judge(report, history, ctx)
        verdict = Verdict()
        _succeeded_check(verdict, report)
        kills = [e for e in history.of(EventKind.FAULT) if e.get("kind") == "kill"]
        verdict.check("every kill fired", len(kills) == repeat, f"{len(kills)} of {repeat} kills fired")
        wrong = []
        for i, kill in enumerate(kills):
            end = kills[i + 1].time if i + 1 < len(kills) else float("inf")
            restores = [e for e in history.of(EventKind.RESTORE) if kill.time < e.time < end and e.rank == 0]
            expected = history.last_committed_before(kill.time) or 0
            got = (restores[0].step or 0) if restores else 0
            if not expected <= got <= (kill.step if kill.step is not None else got):
                wrong.append(f"kill {i} at step {kill.step}: resumed {got}, committed before it {expected}")
        verdict.check(
            "each restart resumed from the newest checkpoint committed before its kill",
            not wrong,
            "; ".join(wrong) or f"{len(kills)} restarts checked",
        )
        if report.reference_params_sha256 is not None:
            _params_check(verdict, report)
        return verdict


class CrashDuringCheckpoint(Scenario):
    name = "crash-during-checkpoint"
    summary = "SIGKILL a rank while a checkpoint save is in flight (staged, not yet committed)."
    proves = "a half-written checkpoint is never restored; the job resumes from the previous committed one."

    def patch(self, spec: JobSpec, ctx: DrillContext) -> JobSpec:
        # In place, the survivors keep the state in memory and nothing is restored after the crash: the
        # half-written checkpoint would never be put to the test. The group restarts here, so the
        # resubmitted ranks find it beside the previous committed one and must pick the latter.
        return patch_section(spec, "restarts", mode="restart")

    def faults(self, ctx: DrillContext) -> list[Fault]:
        return [Fault(kind="kill_during_checkpoint", rank=ctx.fault_rank, step=ctx.checkpoint_at_fault)]

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> Verdict:
        verdict = super().judge(report, history, ctx)
        # The fault strikes the first save at or after the aimed one that runs; the final save is
        # synchronous (committed before the fault could fire), so striking it proves nothing.
        struck = report.fault_step
        verdict.check(
            "the kill struck a save in flight (not the final one)",
            struck is not None and struck < ctx.steps,
            f"aimed at the save of step {ctx.checkpoint_at_fault}, struck the save of step {struck}",
        )
        return verdict


# The hang drill's `restarts.hangFloorSeconds` and `hangMultiplier` (at most the job's own): tighter than
# the defaults, as its step timeout is shorter; `make soak` runs 2,000 steps at these without an alarm.
HANG_FLOOR_S = 0.5
HANG_MULTIPLIER = 5.0
HANG_DETECTION_SLACK_S = 1.0  # the target: detected within 3x the median step time plus this


class Hang(Scenario):
    name = "hang"
    summary = "One rank stops making progress without dying; the step watchdog detects it and the group restarts."
    proves = (
        "a silent hang is detected in seconds (a step deadline derived from the step times, restarts.hangDetection "
        "auto; restarts.stepTimeoutSeconds when fixed) and recovered from, not a stuck job."
    )

    def patch(self, spec: JobSpec, ctx: DrillContext) -> JobSpec:
        spec = _short_watchdog(spec, ctx)
        restarts = spec.spec.restarts
        if restarts.hang_detection != "auto":
            return spec
        return patch_section(
            spec,
            "restarts",
            hang_floor_seconds=min(restarts.hang_floor_seconds, HANG_FLOOR_S),
            hang_multiplier=min(restarts.hang_multiplier, HANG_MULTIPLIER),
        )

    def faults(self, ctx: DrillContext) -> list[Fault]:
        return [Fault(kind="hang", rank=ctx.fault_rank, step=ctx.fault_step)]

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> Verdict:
        from training.contract.stacks import innermost_frames, ranks_apart, read_stack_dumps

        fired = history.of(EventKind.WATCHDOG)
        verdict = Verdict()
        verdict.check("watchdog fired", bool(fired), f"{len(fired)} watchdog events")
        # Forensics: every rank of the hung generation dumped its stacks before the restart, and the
        # dumps single out the hung rank (the one not at the collective the others wait in).
        generation = fired[0].generation if fired else 0
        dumped = sorted({e.rank for e in history.of(EventKind.STACKS) if e.generation == generation})
        world = report.world_sizes[0] if report.world_sizes else 0
        verdict.check(
            "every rank dumped its stacks",
            bool(world) and dumped == list(range(world)),
            f"generation {generation}: ranks {dumped} of {world}",
        )
        dumps = read_stack_dumps(history.run_dir, generation)
        apart = ranks_apart(dumps)
        verdict.check(
            "stacks name the hung rank", apart == [ctx.fault_rank], f"injected {ctx.fault_rank}, apart {apart}"
        )
        verdict.note(f"stack dumps: {RunFiles(history.run_dir).stacks_dir(generation)}")
        for rank, frame in sorted(innermost_frames(dumps).items()):
            verdict.note(f"rank {rank} was in {frame}")
        self._judge_detection(verdict, history, ctx, fired)
        verdict.add(super().judge(report, history, ctx))
        return verdict

    @staticmethod
    def _judge_detection(verdict: Verdict, history: RunHistory, ctx: DrillContext, fired: list[Event]) -> None:
        """With `hangDetection: auto` and the fault past warm-up, the hung rank's watchdog judged it by a
        derived deadline and fired within 3x the median step time + 1 s of its last step."""
        from orchestrator.loader import load_spec

        try:
            restarts = load_spec(RunFiles(history.run_dir).job, allow_inline_secrets=True).spec.restarts
        except SpecError as exc:  # no job file in the run directory: nothing says how it was judged
            verdict.note(f"hang detection not judged: {RunFiles(history.run_dir).job}: {exc}")
            return
        if restarts.hang_detection != "auto" or ctx.fault_step < restarts.hang_warmup_steps + 2:
            verdict.note(f"hang detection: {restarts.hang_detection}, judged by restarts.stepTimeoutSeconds")
            return
        hung = [e for e in fired if e.rank == ctx.fault_rank]
        verdict.check(
            "the hung rank's watchdog fired", bool(hung), f"watchdog events of ranks {[e.rank for e in fired]}"
        )
        if not hung:
            return
        fault = min((e.time for e in history.of(EventKind.FAULT) if e.get("kind") == "hang"), default=hung[0].time)
        steps = [
            float(e.get("step_s")) for e in history.of(EventKind.STEP_TIMES) if e.time <= fault and e.get("step_s")
        ]
        median = statistics.median(steps) if steps else 0.0
        silent, deadline = float(hung[0].get("silent_s")), float(hung[0].get("timeout_s"))
        bound = 3 * median + HANG_DETECTION_SLACK_S
        verdict.check(
            "hang detected by the derived step deadline",
            deadline < restarts.step_timeout_seconds,
            f"deadline {deadline:.3f} s (restarts.stepTimeoutSeconds {restarts.step_timeout_seconds:g} s)",
        )
        verdict.check(
            "hang detected within 3x the median step time + 1 s",
            silent <= bound,
            f"silent {silent:.3f} s, bound {bound:.3f} s (median step {median * 1000:.1f} ms)",
        )


class Straggler(Scenario):
    name = "straggler"
    summary = "One rank is slowed inside its backward pass; the online detector names it while the job runs."
    proves = "a slow rank is named online (`torchrig_straggler_rank`, a `straggler` event) though DDP hides it."
    needs_restore = False

    def faults(self, ctx: DrillContext) -> list[Fault]:
        # Slowed inside its backward pass only: under DDP the other ranks then wait for it inside the
        # overlapped all-reduce, so whole-step times are equal and only the online detector can tell.
        return [Fault(kind="slow_backward", rank=ctx.fault_rank, step=1, seconds=ctx.options.slow_s)]

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> Verdict:
        verdict = Verdict()
        per_rank = history.per_rank_step_s()
        verdict.note("per-rank compute seconds per step: " + ", ".join(f"{r}: {v:.4f}" for r, v in per_rank.items()))
        found = history.of(EventKind.STRAGGLER)
        named = [e for e in found if e.get("slow_rank") == ctx.fault_rank]
        last = found[-1].get("slow_rank") if found else None
        verdict.check(
            "online detector named the slow rank",
            bool(named) and last == ctx.fault_rank,
            f"injected rank {ctx.fault_rank}; straggler events name {[e.get('slow_rank') for e in found]}",
        )
        faults = [e for e in history.of(EventKind.FAULT) if e.get("kind") == "slow_backward"]
        if named and faults:
            first = named[0]
            verdict.note(
                f"detected {first.time - faults[0].time:.1f} s after the slowdown began, at step {first.step} "
                f"(slowdown {float(first.get('slowdown_ratio') or 0):.2f}x the median rank)"
            )
        verdict.add(super().judge(report, history, ctx))
        return verdict


class SilentCorruption(Scenario):
    name = "sdc"
    summary = (
        "Flip one bit of a parameter, an optimizer moment or a gradient on one rank (silent data corruption); "
        "the replicas' fingerprints disagree: with a majority and in-place recovery the suspect leaves for a "
        "spare and the others reload the newest certified checkpoint in place, else the group restarts from it. "
        "With restarts.spareNodes the flip waits for a ready standby node, which takes the suspect's node."
    )
    proves = (
        "a flipped bit is found within sdc.every steps and its rank named (majority; with two ranks: "
        "deterministic replay), no checkpoint of a disagreeing step is restored, the recovery takes the "
        "path the decision names (inplace-rollback or restart; with a standby node ready, the suspect's node swapped "
        "for it, no restart), and the result is unchanged."
    )
    latest_fault = 0.8  # a check (every sdc.every steps, or the final save) must follow the flip

    def patch(self, spec: JobSpec, ctx: DrillContext) -> JobSpec:
        # `sdc.every` 0 (off) is turned on at its default. The recovery is the job's own
        # (`training.inplace.protocol.decide_sdc`): in place (a rollback) where a majority names the suspect
        # and the job recovers in place, a group restart from the certified checkpoint otherwise.
        if spec.spec.sdc.every <= 0:
            from training.config import DEFAULT_SDC_EVERY

            spec = patch_section(spec, "sdc", every=DEFAULT_SDC_EVERY)
        return spec

    def unmet(self, spec: JobSpec, nodes: int | None = None) -> str | None:
        from training.config import Strategy

        if spec.spec.training.strategy is Strategy.fsdp:
            return "needs replicas to compare (spec.training.strategy ddp, or hsdp on 2+ nodes): FSDP only shards"
        if spec.spec.training.strategy is Strategy.hsdp and (nodes or self.needs_nodes) < 2:
            return "hsdp compares its replicas across nodes: run it on 2+ nodes (--nodes 2)"
        return super().unmet(spec, nodes)

    @staticmethod
    def _swaps(ctx: DrillContext) -> bool:
        """A standby node may take the suspect's node (`restarts.spareNodes`, standby agents: not on Ray):
        the flip then waits for one to be ready, or the suspect's own node's spare would take its rank."""
        return ctx.standby and ctx.nodes >= 2 and ctx.options.backend != "ray"

    def faults(self, ctx: DrillContext) -> list[Fault]:
        # The seed picks where the bit flips: seeds 0, 1, 2 cover the parameter, the moment and the gradient.
        target = BITFLIP_TARGETS[ctx.seed % len(BITFLIP_TARGETS)]
        if self._swaps(ctx):
            # From the drawn step on, the flip waits for the drill's gate (opened once a standby is ready: the
            # `actions`) while the paced job goes on training; it strikes at the first step after the gate.
            # The pace ends there too: what follows the flip need not outlast anything.
            flip = Fault(kind="bitflip", rank=ctx.fault_rank, step=ctx.fault_step, target=target, gated=True)
            return [*(dataclasses.replace(f, until_gate=True) for f in _pace(ctx)), flip]
        return [Fault(kind="bitflip", rank=ctx.fault_rank, step=ctx.fault_step, target=target)]

    def actions(self, spec: JobSpec, ctx: DrillContext) -> list[Action]:
        if not self._swaps(ctx):
            return []  # the flip is the workers' own, at its step
        # As kill-node's: the fault lands once a standby is warm (else a same-node spare takes the rank and the
        # swap goes untested); a job that ends first makes the drill inconclusive (`ActionRunner._await_standby`).
        return [
            AwaitStep(ctx.fault_step),
            AwaitStandby(fault="bit flip", withheld="no bit was flipped"),
            ReleaseFaults(),
        ]

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> Verdict:
        verdict = Verdict()
        _succeeded_check(verdict, report)
        every = ctx.sdc_every or 0
        flips = [e for e in history.of(EventKind.FAULT) if e.get("kind") == "bitflip"]
        flip = flips[0] if flips else None
        found = [e for e in history.of(EventKind.SDC) if flip is None or e.time >= flip.time]
        sdc = found[0] if found else None
        flip_step = flip.step if flip is not None else None
        verdict.check(
            f"corruption detected within sdc.every ({every}) steps of the flip",
            flip_step is not None and sdc is not None and sdc.step is not None and 0 <= sdc.step - flip_step < every,
            f"flipped at step {flip_step} on rank {flip.rank if flip else None}, "
            f"detected at step {sdc.step if sdc else None}",
        )
        suspects = list(sdc.get("suspects") or []) if sdc is not None else []
        if ctx.sdc_replicas >= 3:
            verdict.check(
                "the majority named the flipped rank",
                sdc is not None and bool(sdc.get("decided")) and suspects == [ctx.fault_rank],
                f"flipped rank {ctx.fault_rank}, suspects {suspects} ({sdc.get('detail') if sdc else '-'})",
            )
        else:
            # No majority between two replicas: deterministic replay from the last agreed state decides
            # (`training.sdc.decide_replay`). Only a flip before any state was kept (the first check) leaves
            # it undecided, the flipped rank among the suspects and the detail saying so.
            first_window = sdc is not None and "no agreed state kept" in str(sdc.get("detail"))
            verdict.check(
                "two replicas: the replay named the flipped rank",
                sdc is not None
                and (
                    (bool(sdc.get("decided")) and suspects == [ctx.fault_rank])
                    or (first_window and not sdc.get("decided") and ctx.fault_rank in suspects)
                ),
                f"flipped rank {ctx.fault_rank}, suspects {suspects} ({sdc.get('detail') if sdc else '-'})",
            )
        self._judge_path(verdict, report, history, ctx, sdc)
        restores = [e for e in history.of(EventKind.RESTORE) if sdc is not None and e.time > sdc.time]
        uncertified = [e.step for e in restores if e.get("certified") is not True]
        late = [e.step for e in restores if flip_step is None or e.step is None or e.step >= flip_step]
        verdict.check(
            "restored a certified checkpoint from before the flip (none uncertified)",
            bool(restores) and not uncertified and not late,
            f"restores after detection: steps {[e.step for e in restores]}; uncertified {uncertified}; "
            f"at or after the flip {late}",
        )
        if report.reference_params_sha256 is not None:
            _params_check(verdict, report)
        return verdict

    @staticmethod
    def _judge_path(
        verdict: Verdict, report: DrillReport, history: RunHistory, ctx: DrillContext, sdc: Event | None
    ) -> None:
        """The recovery `decide_sdc` names: decided suspects of a job that recovers in place are replaced by
        spares while the others roll back (`inplace-rollback`); anything else (undecided, every rank a
        suspect, no in-place recovery, FSDP/HSDP) restarts the group."""
        from training.inplace.protocol import ROLLBACK_PATH

        decided = sdc is not None and bool(sdc.get("decided"))
        suspects = (sdc.get("suspects") or []) if sdc is not None else []
        left = set(range(ctx.world_size)) - set(suspects)  # someone to roll back
        restart = "ray-restart" if report.backend == "ray" else "restart"
        want = ROLLBACK_PATH if decided and left and ctx.in_place and not ctx.sharded else restart
        verdict.check(
            f"recovered by {want}",
            report.recovery_path == want,
            f"path {report.recovery_path} (decided {decided}, in place {ctx.in_place}), MTTR {report.mttr_seconds} s",
        )
        if want == ROLLBACK_PATH:
            verdict.check(
                "no worker group restart (the rollback stayed in place)",
                report.group_restarts == 0,
                f"{report.group_restarts} worker group restart(s)",
            )
            rolled = [e for e in history.of(EventKind.RECOVERY) if e.get("path") == ROLLBACK_PATH]
            spares = [e for e in rolled if e.get("role") == "spare"]
            survivors = [e for e in rolled if e.get("role") == "survivor"]
            # A standby node took the suspect's whole node (`restarts.spareNodes`, `decide_handover`): its
            # spares hold every rank of that node; else a spare of the suspect's own node holds its rank.
            node = sdc.get("excluded_node") if sdc is not None and sdc.get("replaced_by") == "standby" else None
            nproc = max(1, ctx.world_size // max(1, ctx.nodes))
            replaced = list(range(node * nproc, (node + 1) * nproc)) if isinstance(node, int) else [ctx.fault_rank]
            by = (
                f"the standby node's spares took node {node}'s ranks"
                if isinstance(node, int)
                else "a warm spare took the suspect's rank"
            )
            if SilentCorruption._swaps(ctx):
                # A standby was ready before the flip (`actions`): the decision must have handed the node to it.
                want_node = ctx.fault_rank // max(1, ctx.world_size // max(1, ctx.nodes))
                verdict.check(
                    f"a standby node took the suspect's node {want_node} (replaced_by standby)",
                    sdc is not None and sdc.get("replaced_by") == "standby" and node == want_node,
                    f"replaced_by {sdc.get('replaced_by') if sdc else None}, excluded node {node}",
                )
            verdict.check(
                f"{by}, every survivor and spare reloaded the same certified step",
                sorted(e.rank for e in spares) == replaced
                and sorted(e.rank for e in survivors) == [r for r in range(ctx.world_size) if r not in replaced]
                and len({e.step for e in rolled}) == 1,
                f"rollback events (rank, role, step): {[(e.rank, e.get('role'), e.step) for e in rolled]}",
            )


class _StoreScenario(Scenario):
    """Scenarios that need a second store to fall back on."""

    def patch(self, spec: JobSpec, ctx: DrillContext) -> JobSpec:
        return with_fallback_store(spec)


class CorruptCheckpoint(_StoreScenario):
    name = "corrupt-checkpoint"
    summary = "Damage the newest checkpoint in one store (flip bytes / truncate / delete), then kill a worker."
    proves = "restore verifies hashes and falls back to another store or an older step; corrupt data is never loaded."

    def patch(self, spec: JobSpec, ctx: DrillContext) -> JobSpec:
        # The kill must lead to a restore (in place, the survivors' memory would make the damage moot).
        return patch_section(super().patch(spec, ctx), "restarts", mode="restart")

    def actions(self, spec: JobSpec, ctx: DrillContext) -> list[Action]:
        drawn = CorruptionKind(ctx.rng.choice([k.value for k in CorruptionKind]))
        return [
            AwaitCommit(store=0, step=ctx.checkpoint_at_fault, required=True),
            StoreCorrupt(store=0, kind=ctx.options.corruption or drawn),
            RankKill(rank=ctx.fault_rank),
        ]

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> Verdict:
        verdict = super().judge(report, history, ctx)
        if report.damage is None:
            verdict.check("checkpoint damaged", False, "the drill found no committed checkpoint to damage")
            return verdict
        first = report.restored_from[0] if report.restored_from else {}
        bad_store, bad_step = report.damage["store_name"], report.damage["step"]
        avoided = not (first.get("store") == bad_store and first.get("step") == bad_step)
        verdict.check(
            "damaged copy not restored",
            avoided,
            f"damaged {bad_store}@{bad_step} ({report.damage['kind']}); "
            f"restored {first.get('store')}@{first.get('step')}",
        )
        return verdict


class LoseStore(_StoreScenario):
    name = "lose-store"
    summary = "Make one checkpoint store unreachable mid-run; training continues on the others."
    proves = "losing a store is visible in metrics and the report, and never stops training."
    needs_restore = False

    def actions(self, spec: JobSpec, ctx: DrillContext) -> list[Action]:
        # Lose the last store: the drill's own second store unless the job has several.
        last = len(spec.spec.checkpoint.stores) - 1
        wait: list[Action] = []
        if spec.spec.checkpoint.stores[last].kind.filesystem:
            wait = [AwaitCommit(store=last, step=ctx.checkpoint_at_fault)]
        return [*wait, StoreLoss(store=last)]

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> Verdict:
        verdict = super().judge(report, history, ctx)
        lost = (report.damage or {}).get("store_name")
        failures = [e for e in history.of(EventKind.STORE_FAILURE) if e.get("store") == lost]
        verdict.check("store failure visible", bool(failures), f"{len(failures)} store_failure events for {lost}")
        t = _fault_time(report) or 0.0
        later = [e for e in history.of(EventKind.CHECKPOINT_COMMITTED) if e.time > t]
        verdict.check(
            "checkpoints continued on the other stores",
            bool(later),
            f"{len(later)} checkpoints committed after the store was lost",
        )
        return verdict


class LoseStoreAtRestart(Scenario):
    name = "lose-store-at-restart"
    summary = (
        "The job's only checkpoint store becomes unreachable and a worker is killed: the group restarts while "
        "the store is gone; the store comes back later."
    )
    proves = (
        "a store that cannot be read at restart is unknown, not empty: no step is re-trained from zero (the "
        "restore waits, then stops retryably), and the job resumes from its newest checkpoint once the store "
        "is back."
    )
    # checkpoint.ioTimeoutSeconds for the drill: the restore lists an unreachable store again for half of
    # it before the rank gives up (exit 205) and the group restarts; a short one keeps the drill short.
    io_timeout_s: ClassVar[float] = 20.0

    def patch(self, spec: JobSpec, ctx: DrillContext) -> JobSpec:
        # The only store: nothing else may hold a copy the restore could fall back on. The group restarts
        # (in place the survivors keep the state and nothing would be restored): once for the kill, once
        # for the rank that gives up on the store.
        first = spec.spec.checkpoint.stores[0]
        io_timeout = min(spec.spec.checkpoint.io_timeout_seconds, self.io_timeout_s)
        spec = patch_section(spec, "checkpoint", stores=[first], io_timeout_seconds=io_timeout)
        return patch_section(spec, "restarts", mode="restart", max=max(spec.spec.restarts.max, 3))

    def faults(self, ctx: DrillContext) -> list[Fault]:
        return _pace(ctx)  # steps long enough for the drill to act between the commit and the job's end

    def actions(self, spec: JobSpec, ctx: DrillContext) -> list[Action]:
        from training.checkpoint.restore import RESTORE_GAVE_UP

        # In this order, from outside: the checkpoint committed, the store lost, then the kill, so that the
        # restarted ranks (new processes, torch, a process group: seconds) meet the outage at their restore.
        # (A kill of the worker's own at a fixed step raced the save before it: on a loaded machine the
        # async commit of the checkpoint the drill waits for came only after the restart had restored.)
        return [
            AwaitCommit(store=0, step=ctx.checkpoint_at_fault, required=True),
            StoreLoss(store=0),
            RankKill(rank=ctx.fault_rank),
            # The store stays away until a restarted rank has given up on it (so that path is taken too).
            AwaitStoreFailure(store=0, prefix=RESTORE_GAVE_UP),
            StoreBack(store=0),
        ]

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> Verdict:
        from training.checkpoint.restore import RESTORE_GAVE_UP

        verdict = super().judge(report, history, ctx)
        return judge_store_at_restart(verdict, report, history, RESTORE_GAVE_UP)


def judge_store_at_restart(verdict: Verdict, report: DrillReport, history: RunHistory, gave_up: str) -> Verdict:
    """The checks of `lose-store-at-restart` beyond a restore's: the restart met the outage, waited for the
    store instead of starting over from step 0, and resumed once it was back."""
    damage = report.damage or {}
    lost, back = damage.get("store_name"), damage.get("back_at")
    t_fault = _fault_time(report) or 0.0
    failures = [e for e in history.of(EventKind.STORE_FAILURE) if e.get("store") == lost and e.time >= t_fault]
    listing = [e for e in failures if str(e.get("error") or "").startswith("list:")]
    stopped = [e for e in failures if str(e.get("error") or "").startswith(gave_up)]
    verdict.check(
        "the restart found the store unreadable and stopped (retryably) instead of starting over",
        bool(listing) and bool(stopped),
        f"{len(listing)} failed listings of {lost}, {len(stopped)} restore(s) gave up on it",
    )
    expected = history.last_committed_before(t_fault) or 0
    firsts = sorted(e.step for e in history.of(EventKind.FIRST_STEP) if e.time > t_fault and e.step is not None)
    verdict.check(
        "no step before the outage re-trained from zero",
        bool(firsts) and firsts[0] > expected,
        f"first steps after the outage {firsts[:6]}, committed before it {expected}",
    )
    restores = [e for e in history.restores_after(t_fault) if e.rank == 0]
    first = restores[0].step if restores else None
    verdict.check(
        "resumed from the newest checkpoint once the store was back",
        isinstance(back, (int, float))
        and first is not None
        and all(e.time >= back for e in restores)
        and expected <= first <= (report.fault_step or first),
        f"store back at {back}, restores after the outage (step, time) "
        f"{[(e.step, round(e.time, 1)) for e in restores]}, committed before it {expected}",
    )
    return verdict


def _pace(ctx: DrillContext) -> list[Fault]:
    """Every rank sleeps `pace_s` per step, so a small job lasts long enough to lose and regain a node."""
    pace = ctx.options.pace_s
    return [Fault(kind="slow", rank=-1, step=1, generation=-1, seconds=pace)] if pace > 0 else []


class KillNode(Scenario):
    name = "kill-node"
    summary = (
        "Kill a whole node (agent and its ranks); survivors continue smaller, then a new node rejoins. With "
        "restarts.spareNodes a standby node takes the lost node's ranks in place instead."
    )
    proves = (
        "elastic jobs shrink and grow back without losing more than the steps since the last checkpoint; with a "
        "standby node the job keeps its size, loses no step and ends bit-identical."
    )
    needs_nodes = 2
    compares_params = False  # the world size changes on purpose (not with a standby node: `compares`)
    # On `--backend ray` (one embedded Ray: a machine whose CPUs a lost node never takes away) the lost
    # node's Ray Train workers are killed with their trainers and spares, and Ray Train's group restart
    # brings the job back at its size from the newest checkpoint (`RayLocalRun.kill_node`).
    kills_on_ray: ClassVar[bool] = True

    def _on_ray(self, backend: str) -> bool:
        return self.kills_on_ray and backend == "ray"

    def compares(self, spec: JobSpec, backend: str = "local") -> bool:
        return _standby(spec) or self._on_ray(backend)

    def nodes_unmet(self, spec: JobSpec, nodes: int, backend: str = "local") -> str | None:
        if _standby(spec) or self._on_ray(backend):  # the size is kept: any job of `nodes` nodes can lose one
            n = spec.spec.nodes
            ok = n.min <= nodes <= n.max
            return None if ok else f"needs spec.nodes to allow {nodes} nodes; got {n.min}..{n.max}"
        return super().nodes_unmet(spec, nodes)

    # Losing the node, the restart at the smaller size, the progress there and the rejoin (a second
    # restart) must all happen before the job ends: a fault drawn at step 270 of 300 left no time to
    # grow back (campaign, seeds 0 and 2).
    latest_fault = 0.4

    def faults(self, ctx: DrillContext) -> list[Fault]:
        return _pace(ctx)

    def actions(self, spec: JobSpec, ctx: DrillContext) -> list[Action]:
        victim = ctx.rng.randrange(1, ctx.nodes) if ctx.nodes > 1 else 0
        if self._on_ray(ctx.options.backend):
            return [AwaitStep(ctx.fault_step), NodeKill(victim), AwaitProgress(2)]
        if _standby(spec):  # the kill lands once a standby is warm: it measures the standby, not its start
            return [AwaitStep(ctx.fault_step), AwaitStandby(), NodeKill(victim), AwaitProgress(2)]
        return [
            AwaitStep(ctx.fault_step),
            NodeKill(victim),
            AwaitWorldSize(ctx.world_size - ctx.world_size // ctx.nodes),
            AwaitProgress(max(2, ctx.checkpoint_every // 2)),
            NodeAdd(),
        ]

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> Verdict:
        verdict = super().judge(report, history, ctx)
        sizes = report.world_sizes
        if self._on_ray(ctx.options.backend):
            verdict.check(
                "Ray Train's group restart took the lost node's ranks back",
                report.recovery_path == "ray-restart",
                f"path {report.recovery_path}, world sizes {sizes}",
            )
            if report.reference_params_sha256 is not None and sizes == [ctx.world_size]:
                _params_check(verdict, report)  # an elastic job restarted smaller is compared by no one
            return verdict
        if report.recovery_path == "inplace":  # a standby node took the lost node's ranks
            verdict.check("kept the full world size", sizes == [ctx.world_size], f"world sizes {sizes}")
            if report.reference_params_sha256 is not None:
                _params_check(verdict, report)
            return verdict
        full, small = ctx.world_size, ctx.world_size - ctx.world_size // ctx.nodes
        shrank = small in sizes
        grew_back = shrank and sizes.index(small) < len(sizes) - 1 and full in sizes[sizes.index(small) + 1 :]
        verdict.check("continued at the smaller world size", shrank, f"world sizes {sizes}")
        verdict.check("world grew back after the node rejoined", grew_back, f"world sizes {sizes}")
        if shrank and not grew_back and report.status == "succeeded":
            report.inconclusive = _finished_before_regrowth(report.events)
        return verdict


REGROW_WINDOW_S = 30.0  # a rejoined node waits for the agents' next rendezvous round: seconds here


def _finished_before_regrowth(events: list[dict[str, Any]]) -> str | None:
    """Why a kill-node drill whose job never grew back proved nothing, or None when it had the time to.

    The job ended before the node came back, or within `REGROW_WINDOW_S` of it (before a rendezvous
    round could take it in): it neither grew back nor failed to (a short job, a late fault). A job that
    ran on longer than that at the smaller size did fail to grow back."""
    added = [float(e["time"]) for e in events if e.get("event") == DrillEventKind.NODE_ADDED]
    finished = [float(e["time"]) for e in events if e.get("event") == EventKind.FINISHED]
    if not finished:
        return None
    if not added:
        return "the job finished before the killed node could rejoin (more steps, or an earlier --at-step)"
    after = max(finished) - added[-1]
    if after < REGROW_WINDOW_S:
        return (
            f"the job finished {after:.1f} s after the node rejoined, before a rendezvous round could take it in "
            f"(under {REGROW_WINDOW_S:g} s; more steps, or an earlier --at-step)"
        )
    return None


class Partition(KillNode):
    name = "partition"
    kills_on_ray = False  # its nodes are network namespaces of the local backend
    summary = "Cut the network link of one of two emulated nodes (network namespaces joined by a veth pair)."
    proves = (
        "a partitioned node is detected (step watchdog, rendezvous keep-alive); the rest restarts from the last "
        "checkpoint at the world size that remains, and grows back when a node rejoins."
    )
    needs_network = True

    def patch(self, spec: JobSpec, ctx: DrillContext) -> JobSpec:
        # Survivors block inside a collective when packets stop (no reset arrives): the watchdog ends it.
        # A partition during a checkpoint save blocks the save's collectives and the training loop that
        # waits for it; both are bounded by checkpoint.ioTimeoutSeconds (default 30 min), so the drill
        # bounds it too (seen: a cut during the final save held the job for the drill's whole timeout).
        spec = _short_watchdog(spec, ctx)
        io_timeout = min(spec.spec.checkpoint.io_timeout_seconds, 3 * spec.spec.restarts.step_timeout_seconds)
        return patch_section(spec, "checkpoint", io_timeout_seconds=io_timeout)

    def actions(self, spec: JobSpec, ctx: DrillContext) -> list[Action]:
        # The cut-off node is declared lost (a cluster would replace it); after the link is healed a new
        # node joins from the same namespace and the world grows back.
        return [
            AwaitStep(ctx.fault_step),
            LinkCut(1),
            AwaitWorldSize(ctx.world_size - ctx.world_size // ctx.nodes),
            NodeKill(1, fault=False),
            LinkHeal(1),
            AwaitProgress(max(2, ctx.checkpoint_every // 2)),
            NodeAdd(),
        ]


def _preempted_event(history: RunHistory) -> Event | None:
    """Rank 0's `preempted` event (another rank's when rank 0 wrote none)."""
    found = history.of(EventKind.PREEMPTED)
    return next((e for e in found if e.rank == 0), found[0] if found else None)


class Preemption(Scenario):
    name = "preempt"
    summary = (
        "SIGTERM every process of the job mid-run (a node drain, a spot reclaim); SIGKILL after the pod grace "
        "period; then start the job again."
    )
    proves = (
        "a preemption costs no step: every rank stops at one agreed step, its emergency checkpoint commits "
        "within restarts.preemptGraceSeconds, and the resumed job ends bit-identical."
    )
    resumes_after_preemption = True
    # The signal must land while the job still runs: drawn at step 296 of 300, the paced job finished
    # before its ranks agreed on a stop step (campaign, seed 2).
    latest_fault = 0.8

    def faults(self, ctx: DrillContext) -> list[Fault]:
        return _pace(ctx)

    def actions(self, spec: JobSpec, ctx: DrillContext) -> list[Action]:
        from training.preemption_timing import pod_grace_period_seconds

        return [AwaitStep(ctx.fault_step), Preempt(grace_s=pod_grace_period_seconds(spec.spec.restarts))]

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> Verdict:
        verdict = Verdict()
        _succeeded_check(verdict, report)
        event = _preempted_event(history)
        grace = float(event.get("grace_s") or 0) if event else 0.0
        since = float(event.get("since_signal_s") or 0) if event else 0.0
        verdict.check(
            "emergency checkpoint committed within the grace period",
            event is not None and bool(event.get("committed")) and since <= grace,
            f"step {event.step}, {event.get('reason')}, save {event.get('save_s')} s, {since} s after the signal "
            f"(grace {grace} s)"
            if event
            else "no preempted event",
        )
        stop = event.step if event else None
        verdict.check(
            "resumed from the emergency checkpoint: 0 lost steps",
            stop is not None and report.resumed_from_step == stop,
            f"stopped at {stop}, resumed from {report.resumed_from_step}",
        )
        if stop is not None and report.resumed_from_step == stop:
            report.lost_steps = 0
        if report.reference_params_sha256 is not None:
            _params_check(verdict, report)
        return verdict


class PreemptionShortGrace(Preemption):
    name = "preempt-short-grace"
    summary = "Preempt with a grace period too short for the emergency checkpoint; then start the job again."
    proves = (
        "a save the deadline cuts short is never committed nor restored: the job resumes from the previous "
        "checkpoint and still ends bit-identical."
    )

    def patch(self, spec: JobSpec, ctx: DrillContext) -> JobSpec:
        pace = ctx.options.pace_s
        if pace <= 0:
            raise SpecError(f"--pace: {self.name} needs paced steps (> 0) so that the grace period is shorter")
        # A quarter of one paced step: the deadline strikes before the ranks reach their agreed stop step.
        return patch_section(spec, "restarts", preempt_grace_seconds=round(pace / 4, 4))

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> Verdict:
        verdict = Verdict()
        _succeeded_check(verdict, report)
        event = _preempted_event(history)
        verdict.check(
            "the deadline ended the emergency checkpoint uncommitted",
            event is not None and not event.get("committed") and event.get("reason") == "deadline",
            f"step {event.step}, committed {event.get('committed')}, {event.get('reason')}" if event else "none",
        )
        # The newest checkpoint the preempted run committed (a periodic save may land between the signal
        # and the deadline): the resubmitted job must restore exactly that one, no newer than the step the
        # deadline struck at. It equals that step when the deadline struck just after a periodic save of
        # it committed (seen under load: stopped at 15, periodic checkpoint 15): a committed checkpoint,
        # not a partial one, so restoring it is right. What was committed is read from the stores as the
        # preempted run left them (the resubmit's record), not only from the events: the deadline's
        # os._exit can end a process between a manifest's commit and its event (seen in CI: events said
        # 10, the store held 15, and the restart rightly restored 15).
        restores = history.restores_after(_fault_time(report) or 0.0)
        resubmitted = restores[0].time if restores else float("inf")
        stored = _stored_at_resubmit(report)
        candidates = (history.last_committed_before(resubmitted), *stored[-1:])
        previous = max([s for s in candidates if s is not None], default=None)
        stop = event.step if event else None
        resumed = report.resumed_from_step
        verdict.check(
            "nothing partial restored: resumed from the previous checkpoint",
            resumed is not None
            and resumed == (previous or 0)
            and (stop is None or resumed <= stop)
            and (resumed == 0 or not stored or resumed in stored),
            f"stopped at {stop}, newest committed before the restart {previous} (stores held {stored or 'none'}), "
            f"resumed from {resumed}",
        )
        if report.reference_params_sha256 is not None:
            _params_check(verdict, report)
        return verdict


SCENARIOS: dict[str, type[Scenario]] = {
    cls.name: cls
    for cls in (
        KillWorker,
        KillNode,
        CrashDuringCheckpoint,
        CorruptCheckpoint,
        LoseStore,
        LoseStoreAtRestart,
        Hang,
        Straggler,
        SilentCorruption,
        Partition,
        Preemption,
        PreemptionShortGrace,
    )
}


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise SpecError(f"SCENARIO: unknown drill {name!r}; valid drills: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]()
