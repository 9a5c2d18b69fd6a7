"""Drill scenarios: how each one prepares the job, injects its fault, and judges the recovery.

A scenario is a small policy object: `prepare` adjusts the spec (a second store, a short watchdog),
`faults` returns the faults the workers inject into themselves (exact step, real SIGKILL), `during`
performs outside actions on the running job (kill a node, damage a store), and `judge` turns what the
run left behind into checks. The runner (`orchestrator.drills.runner`) executes them in order.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from orchestrator.drills.damage import CorruptionKind, committed_steps, corrupt_newest, make_store_unreachable
from orchestrator.drills.history import RunHistory
from orchestrator.drills.report import DrillReport
from orchestrator.errors import SpecError, UnsupportedFeature

__all__ = ["SCENARIOS", "DrillContext", "LaunchedRun", "Scenario", "get_scenario"]

DRILL_STORE = "drill-b"


class LaunchedRun(Protocol):
    """What a scenario may do to a running job (the runner adapts each backend to this)."""

    run_dir: Path

    def alive(self) -> bool: ...

    def kill_node(self, index: int) -> None: ...

    def add_node(self) -> None: ...


@dataclass
class DrillContext:
    scenario: str
    backend: str
    seed: int
    rng: random.Random
    steps: int
    world_size: int
    checkpoint_every: int
    fault_step: int
    fault_rank: int
    nodes: int
    options: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    damage: dict[str, Any] | None = None

    def event(self, name: str, **fields: Any) -> None:
        self.events.append({"time": time.time(), "event": name, **fields})


def wait_for(predicate: Any, timeout_s: float, run: LaunchedRun, poll_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        if not run.alive():
            return bool(predicate())
        time.sleep(poll_s)
    return False


def _store_uris(spec: dict[str, Any], run_dir: Path) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, resolved uri, options) of each store of a (dict) spec."""
    out = []
    for store in spec["spec"]["checkpoint"]["stores"]:
        uri = store["uri"]
        if uri.startswith("file://") and not uri[len("file://") :].startswith("/"):
            uri = "file://" + str((run_dir / uri[len("file://") :]).resolve())
        elif "://" not in uri and not uri.startswith("/"):
            uri = "file://" + str((run_dir / uri).resolve())
        name = store.get("name") or uri
        out.append((name, uri, store.get("options") or {}))
    return out


class Scenario:
    """Base: a kill-free scenario that expects bit-exact recovery; subclasses override what differs."""

    name: ClassVar[str]
    summary: ClassVar[str]
    proves: ClassVar[str]
    needs_nodes: ClassVar[int] = 1
    compares_params: ClassVar[bool] = True  # same world size -> params must match the reference bit for bit
    needs_restore: ClassVar[bool] = True

    def prepare(self, spec: dict[str, Any], ctx: DrillContext) -> dict[str, Any]:
        return spec

    def faults(self, ctx: DrillContext) -> list[dict[str, Any]]:
        return []

    def during(self, run: LaunchedRun, ctx: DrillContext, spec: dict[str, Any]) -> None:
        """Outside actions while the job runs (default: none)."""

    def launch_extra(self, ctx: DrillContext) -> dict[str, Any]:
        """Backend options for the faulted run (e.g. network namespaces); default none."""
        return {}

    def cleanup(self, ctx: DrillContext) -> None:
        """Undo what `launch_extra` set up; called even when the drill fails."""

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> None:
        report.check("job succeeded", report.status == "succeeded", f"status {report.status}")
        if self.needs_restore:
            restored = report.resumed_from_step is not None
            report.check(
                "restored after the fault",
                restored,
                f"restored from step {report.resumed_from_step}" if restored else "no restore after the fault",
            )
            # The event of a commit can land after the fault even when the manifest was written before it
            # (rank 0 lives on for a moment), so the invariant is a range: nothing older than what was
            # committed before the fault, nothing later than the fault step.
            expected = last_committed_before(history, _fault_time(report))
            if expected is not None and report.resumed_from_step is not None:
                report.check(
                    "resumed from the newest checkpoint committed before the fault",
                    expected <= report.resumed_from_step <= (report.fault_step or expected),
                    f"committed before the fault: {expected}, resumed {report.resumed_from_step}, "
                    f"fault at {report.fault_step}",
                )
        if self.compares_params and report.reference_params_sha256 is not None:
            report.check(
                "final parameters bit-identical to the uninterrupted reference",
                bool(report.final_params_match_reference),
                f"{(report.params_sha256 or '-')[:16]} vs {(report.reference_params_sha256 or '-')[:16]}",
            )


def _fault_time(report: DrillReport) -> float | None:
    times = [float(e["time"]) for e in report.events if e.get("event") == "fault_injected"]
    return min(times) if times else None


def last_committed_before(history: RunHistory, t: float | None) -> int | None:
    if t is None:
        return None
    steps = [int(e["step"]) for e in history.of("checkpoint_committed") if float(e["time"]) <= t and "step" in e]
    return max(steps) if steps else None


class KillWorker(Scenario):
    name = "kill-worker"
    summary = "SIGKILL one rank at a step; the group restarts and resumes from the newest checkpoint."
    proves = "a dead worker costs at most the steps since the last checkpoint, and the result is unchanged."

    def prepare(self, spec: dict[str, Any], ctx: DrillContext) -> dict[str, Any]:
        repeat = int(ctx.options.get("repeat", 1))
        if repeat > 1:
            needed = ctx.checkpoint_every * (repeat + 1) + 1
            if ctx.steps < needed or ctx.checkpoint_every < 2:
                raise SpecError(
                    f"--repeat {repeat}: needs spec.training.steps >= {needed} and spec.checkpoint.every.steps >= 2 "
                    f"(one kill after each checkpoint); got steps {ctx.steps}, every {ctx.checkpoint_every}"
                )
            restarts = spec["spec"].setdefault("restarts", {})
            restarts["max"] = max(int(restarts.get("max", 0)), repeat)
        return spec

    def faults(self, ctx: DrillContext) -> list[dict[str, Any]]:
        repeat = int(ctx.options.get("repeat", 1))
        if repeat <= 1:
            return [{"kind": "kill", "rank": ctx.fault_rank, "step": ctx.fault_step, "generation": 0}]
        # Kill g (in restart generation g) draws its rank and its offset past the g-th checkpoint from
        # seed + g: each generation resumes from a checkpoint at or after every * g, so it always fires.
        out: list[dict[str, Any]] = []
        for g in range(repeat):
            rng = random.Random(ctx.seed + g)
            step = ctx.checkpoint_every * (g + 1) + rng.randint(1, ctx.checkpoint_every - 1)
            out.append({"kind": "kill", "rank": rng.randrange(ctx.world_size), "step": step, "generation": g})
        ctx.fault_step, ctx.fault_rank = out[0]["step"], out[0]["rank"]
        return out

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> None:
        repeat = int(ctx.options.get("repeat", 1))
        if repeat <= 1:
            super().judge(report, history, ctx)
            return
        report.check("job succeeded", report.status == "succeeded", f"status {report.status}")
        kills = sorted((e for e in history.of("fault") if e.get("kind") == "kill"), key=lambda e: float(e["time"]))
        report.check("every kill fired", len(kills) == repeat, f"{len(kills)} of {repeat} kills fired")
        wrong = []
        for i, kill in enumerate(kills):
            t = float(kill["time"])
            end = float(kills[i + 1]["time"]) if i + 1 < len(kills) else float("inf")
            restores = [e for e in history.of("restore") if t < float(e["time"]) < end and e.get("rank") == 0]
            expected = last_committed_before(history, t) or 0
            got = int(restores[0]["step"]) if restores else 0
            if not expected <= got <= int(kill.get("step", got)):
                wrong.append(f"kill {i} at step {kill.get('step')}: resumed {got}, committed before it {expected}")
        report.check(
            "each restart resumed from the newest checkpoint committed before its kill",
            not wrong,
            "; ".join(wrong) or f"{len(kills)} restarts checked",
        )
        if report.reference_params_sha256 is not None:
            report.check(
                "final parameters bit-identical to the uninterrupted reference",
                bool(report.final_params_match_reference),
                f"{(report.params_sha256 or '-')[:16]} vs {(report.reference_params_sha256 or '-')[:16]}",
            )


class CrashDuringCheckpoint(Scenario):
    name = "crash-during-checkpoint"
    summary = "SIGKILL a rank while a checkpoint save is in flight (staged, not yet committed)."
    proves = "a half-written checkpoint is never restored; the job resumes from the previous committed one."

    def faults(self, ctx: DrillContext) -> list[dict[str, Any]]:
        step = max(ctx.checkpoint_every, (ctx.fault_step // ctx.checkpoint_every) * ctx.checkpoint_every)
        ctx.fault_step = step
        return [{"kind": "kill_during_checkpoint", "rank": ctx.fault_rank, "step": step, "generation": 0}]


class Hang(Scenario):
    name = "hang"
    summary = "One rank stops making progress without dying; the step watchdog detects it and the group restarts."
    proves = "a silent hang is turned into a restart within restarts.stepTimeoutSeconds, not a stuck job."

    def prepare(self, spec: dict[str, Any], ctx: DrillContext) -> dict[str, Any]:
        timeout = float(ctx.options.get("hang_timeout_s", 10.0))
        restarts = spec["spec"].setdefault("restarts", {})
        restarts["stepTimeoutSeconds"] = min(float(restarts.get("stepTimeoutSeconds", timeout)), timeout)
        return spec

    def faults(self, ctx: DrillContext) -> list[dict[str, Any]]:
        return [{"kind": "hang", "rank": ctx.fault_rank, "step": ctx.fault_step, "generation": 0}]

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> None:
        report.check("watchdog fired", bool(history.of("watchdog")), f"{len(history.of('watchdog'))} watchdog events")
        super().judge(report, history, ctx)


class Straggler(Scenario):
    name = "straggler"
    summary = "One rank is slowed down; the report names the slow rank from per-rank step times."
    proves = "a slow rank is identified from the job's own telemetry."
    needs_restore = False

    def faults(self, ctx: DrillContext) -> list[dict[str, Any]]:
        delay = float(ctx.options.get("slow_s", 0.05))
        return [{"kind": "slow", "rank": ctx.fault_rank, "step": 1, "generation": 0, "seconds": delay}]

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> None:
        per_rank = history.per_rank_step_s()
        slow = history.slowest_rank()
        report.notes.append(
            "per-rank compute seconds per step: " + ", ".join(f"{r}: {v:.4f}" for r, v in per_rank.items())
        )
        report.check(
            "slow rank identified",
            slow == ctx.fault_rank,
            f"injected rank {ctx.fault_rank}, identified {slow}",
        )
        super().judge(report, history, ctx)


class _StoreScenario(Scenario):
    """Scenarios that need a second store to fall back on."""

    def prepare(self, spec: dict[str, Any], ctx: DrillContext) -> dict[str, Any]:
        stores = spec["spec"]["checkpoint"]["stores"]
        if len(stores) < 2:
            stores.append({"uri": f"file://./{DRILL_STORE}", "name": DRILL_STORE})
        return spec


class CorruptCheckpoint(_StoreScenario):
    name = "corrupt-checkpoint"
    summary = "Damage the newest checkpoint in one store (flip bytes / truncate / delete), then kill a worker."
    proves = "restore verifies hashes and falls back to another store or an older step; corrupt data is never loaded."

    def during(self, run: LaunchedRun, ctx: DrillContext, spec: dict[str, Any]) -> None:
        name, uri, options = _store_uris(spec, run.run_dir)[0]
        target = max(ctx.checkpoint_every, (ctx.fault_step // ctx.checkpoint_every) * ctx.checkpoint_every)
        history_ok = wait_for(
            lambda: any(s >= target for s in committed_steps(uri, options)), ctx.options.get("timeout_s", 300), run
        )
        if not history_ok:
            ctx.event("damage_skipped", reason=f"no checkpoint >= step {target} was committed in {name}")
            return
        kind = CorruptionKind(ctx.options.get("corruption", ctx.rng.choice([k.value for k in CorruptionKind])))
        damage = corrupt_newest(uri, kind, options)
        ctx.damage = {**damage.to_dict(), "store_name": name}
        ctx.event("checkpoint_damaged", **damage.to_dict())
        pids = _worker_pids(run.run_dir, ctx.fault_rank)
        if pids:
            ctx.fault_step = _latest_step(run.run_dir)  # the step actually reached, not the planned one
            ctx.event("fault_injected", kind="kill", rank=ctx.fault_rank, step=ctx.fault_step)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> None:
        super().judge(report, history, ctx)
        if ctx.damage is None:
            report.check("checkpoint damaged", False, "the drill found no committed checkpoint to damage")
            return
        first = report.restored_from[0] if report.restored_from else {}
        bad_store, bad_step = ctx.damage["store_name"], ctx.damage["step"]
        avoided = not (first.get("store") == bad_store and first.get("step") == bad_step)
        report.check(
            "damaged copy not restored",
            avoided,
            f"damaged {bad_store}@{bad_step} ({ctx.damage['kind']}); restored {first.get('store')}@{first.get('step')}",
        )


class LoseStore(_StoreScenario):
    name = "lose-store"
    summary = "Make one checkpoint store unreachable mid-run; training continues on the others."
    proves = "losing a store is visible in metrics and the report, and never stops training."
    needs_restore = False

    def during(self, run: LaunchedRun, ctx: DrillContext, spec: dict[str, Any]) -> None:
        stores = _store_uris(spec, run.run_dir)
        # Lose the last store: the drill's own second store unless the job has several.
        name, uri, _ = stores[-1]
        if not uri.startswith("file://"):
            lost = ctx.options.get("lose_store_hook")
            if lost is None:
                raise UnsupportedFeature(f"lose-store: store {name!r} is not a local path; pass a hook to stop it")
            lost(name)
        else:
            target = max(ctx.checkpoint_every, (ctx.fault_step // ctx.checkpoint_every) * ctx.checkpoint_every)
            wait_for(lambda: any(s >= target for s in committed_steps(uri)), ctx.options.get("timeout_s", 300), run)
            aside = make_store_unreachable(uri[len("file://") :])
            ctx.damage = {"store_name": name, "uri": uri, "moved_aside_to": aside}
        ctx.fault_step = _latest_step(run.run_dir)
        ctx.event("fault_injected", kind="lose-store", store=name, step=ctx.fault_step)

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> None:
        super().judge(report, history, ctx)
        lost = (ctx.damage or {}).get("store_name")
        failures = [e for e in history.of("store_failure") if e.get("store") == lost]
        report.check("store failure visible", bool(failures), f"{len(failures)} store_failure events for {lost}")
        t = _fault_time(report) or 0.0
        later = [e for e in history.of("checkpoint_committed") if float(e["time"]) > t]
        report.check(
            "checkpoints continued on the other stores",
            bool(later),
            f"{len(later)} checkpoints committed after the store was lost",
        )


def _pace(ctx: DrillContext) -> list[dict[str, Any]]:
    """Every rank sleeps `pace_s` per step, so a small job lasts long enough to lose and regain a node."""
    pace = float(ctx.options.get("pace_s", 0.05))
    return [{"kind": "slow", "rank": -1, "step": 1, "generation": -1, "seconds": pace}] if pace > 0 else []


class KillNode(Scenario):
    name = "kill-node"
    summary = "Kill a whole node (agent and its ranks); survivors continue smaller, then a new node rejoins."
    proves = "elastic jobs shrink and grow back without losing more than the steps since the last checkpoint."
    needs_nodes = 2
    compares_params = False  # the world size changes on purpose

    def faults(self, ctx: DrillContext) -> list[dict[str, Any]]:
        return _pace(ctx)

    def during(self, run: LaunchedRun, ctx: DrillContext, spec: dict[str, Any]) -> None:
        target = ctx.fault_step
        wait_for(lambda: _latest_step(run.run_dir) >= target, ctx.options.get("timeout_s", 300), run)
        victim = ctx.rng.randrange(1, ctx.nodes) if ctx.nodes > 1 else 0
        ctx.fault_step = _latest_step(run.run_dir)
        ctx.event("fault_injected", kind="kill-node", node=victim, step=ctx.fault_step)
        run.kill_node(victim)
        ctx.fault_rank = victim
        shrunk = wait_for(
            lambda: _world_sizes(run.run_dir)[-1:] == [ctx.world_size - ctx.world_size // ctx.nodes],
            ctx.options.get("timeout_s", 300),
            run,
        )
        ctx.event("shrunk" if shrunk else "did_not_shrink")
        rejoin_after = _latest_step(run.run_dir) + max(2, ctx.checkpoint_every // 2)
        wait_for(lambda: _latest_step(run.run_dir) >= rejoin_after, ctx.options.get("timeout_s", 300), run)
        ctx.event("node_added")
        run.add_node()

    def judge(self, report: DrillReport, history: RunHistory, ctx: DrillContext) -> None:
        super().judge(report, history, ctx)
        sizes = report.world_sizes
        full, small = ctx.world_size, ctx.world_size - ctx.world_size // ctx.nodes
        shrank = small in sizes
        grew_back = shrank and sizes.index(small) < len(sizes) - 1 and full in sizes[sizes.index(small) + 1 :]
        report.check("continued at the smaller world size", shrank, f"world sizes {sizes}")
        report.check("world grew back after the node rejoined", grew_back, f"world sizes {sizes}")


class Partition(KillNode):
    name = "partition"
    summary = "Cut the network link of one of two emulated nodes (network namespaces joined by a veth pair)."
    proves = (
        "a partitioned node is detected (step watchdog, rendezvous keep-alive); the rest restarts from the last "
        "checkpoint at the world size that remains, and grows back when a node rejoins."
    )

    def prepare(self, spec: dict[str, Any], ctx: DrillContext) -> dict[str, Any]:
        # Survivors block inside a collective when packets stop (no reset arrives): the watchdog ends it.
        timeout = float(ctx.options.get("hang_timeout_s", 10.0))
        restarts = spec["spec"].setdefault("restarts", {})
        restarts["stepTimeoutSeconds"] = min(float(restarts.get("stepTimeoutSeconds", timeout)), timeout)
        return spec

    def launch_extra(self, ctx: DrillContext) -> dict[str, Any]:
        from orchestrator.drills.netns import NetnsPair, netns_supported

        reason = netns_supported()
        if reason:
            raise UnsupportedFeature(f"partition: {reason}")
        pair = NetnsPair().create()
        ctx.options["_netns"] = pair
        ctx.event("netns_created", namespaces=list(pair.names), addrs=list(pair.addrs))
        return {
            "placements": [
                {"prefix": pair.exec_prefix(i), "addr": pair.addrs[i], "ifname": pair.links[i]} for i in (0, 1)
            ]
        }

    def cleanup(self, ctx: DrillContext) -> None:
        pair = ctx.options.pop("_netns", None)
        if pair is not None:
            pair.destroy()

    def during(self, run: LaunchedRun, ctx: DrillContext, spec: dict[str, Any]) -> None:
        pair = ctx.options["_netns"]
        timeout = ctx.options.get("timeout_s", 300)
        wait_for(lambda: _latest_step(run.run_dir) >= ctx.fault_step, timeout, run)
        ctx.fault_step = _latest_step(run.run_dir)
        ctx.event("fault_injected", kind="partition", node=1, step=ctx.fault_step)
        ctx.fault_rank = 1
        pair.cut(1)
        per_node = ctx.world_size // ctx.nodes
        shrunk = wait_for(lambda: _world_sizes(run.run_dir)[-1:] == [ctx.world_size - per_node], timeout, run)
        ctx.event("shrunk" if shrunk else "did_not_shrink")
        # The cut-off node is declared lost (a cluster would replace it); after the link is healed a new
        # node joins from the same namespace and the world grows back.
        run.kill_node(1)
        pair.heal(1)
        rejoin_after = _latest_step(run.run_dir) + max(2, ctx.checkpoint_every // 2)
        wait_for(lambda: _latest_step(run.run_dir) >= rejoin_after, timeout, run)
        ctx.event("node_added")
        run.add_node()


def _latest_step(run_dir: Path) -> int:
    history = RunHistory.load(run_dir)
    steps = [int(r["step"]) for r in history.metrics + history.events if isinstance(r.get("step"), int)]
    return max(steps, default=0)


def _world_sizes(run_dir: Path) -> list[int]:
    return RunHistory.load(run_dir).world_sizes()


def _worker_pids(run_dir: Path, rank: int) -> list[int]:
    """PIDs of the live worker(s) holding `rank` (from the newest `start` events)."""
    starts = [e for e in RunHistory.load(run_dir).of("start") if e.get("rank") == rank and "pid" in e]
    if not starts:
        return []
    newest = max(starts, key=lambda e: float(e["time"]))
    return [int(newest["pid"])]


SCENARIOS: dict[str, type[Scenario]] = {
    cls.name: cls
    for cls in (KillWorker, KillNode, CrashDuringCheckpoint, CorruptCheckpoint, LoseStore, Hang, Straggler, Partition)
}


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise SpecError(f"SCENARIO: unknown drill {name!r}; valid drills: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]()
