"""Drive a PodCluster as the kubelet and the job's operator would until the job ends.

`run_job` starts every pod, then watches them: an exited container is restarted in place, its pod
recreated, or the job failed, as `operator.operator_action` says for the pod's restart policies;
`backoffLimit` counts container restarts (Training Operator pkg/core/job.go PastBackoffLimit:
failed when the restarts reach the limit). The job succeeds when `succeeded(states)` says so.
`on_tick` runs every poll, for scenario actions (killing a pod at the right moment).

Before any pod starts, the rendered objects go through the operators' admission webhooks
(admission.py): a refused object ends the job `Refused` with the webhook's message, as `kubectl apply`
would. Pods start the way the kubelet starts them (init containers first, probes, readiness-gated
DNS: runtime.py `start(wait=False)` and `tick`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.pods.admission import admit
from tests.pods.kubelet import restart_delay
from tests.pods.operators import operator_action
from tests.pods.runtime import PodCluster, PodState

__all__ = ["JobOutcome", "pytorchjob_succeeded", "run_job", "trainjob_succeeded"]


@dataclass
class JobOutcome:
    status: str  # Succeeded | Failed | Timeout | Refused (by an admission webhook) | Stopped (`stop_when`)
    reason: str
    wall_s: float
    events: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.status} after {self.wall_s:.1f} s: {self.reason}\n" + "\n".join(self.events)


def pytorchjob_succeeded(job: dict[str, Any]) -> Callable[[dict[str, PodState]], bool]:
    """TO pytorchjob_controller.go UpdateJobStatus: the Master succeeded; without a Master, every
    Worker succeeded, or (elasticPolicy set) any Worker did."""
    elastic = job["spec"].get("elasticPolicy") is not None
    has_master = "Master" in job["spec"]["pytorchReplicaSpecs"]

    def done(states: dict[str, PodState]) -> bool:
        ok = [s for s in states.values() if s.exit_codes and s.exit_codes[-1] == 0 and s.proc is None]
        if has_master:
            return any(s.pod.role.startswith("master") for s in ok)
        workers = [s for s in states.values() if s.pod.role.startswith("worker")]
        return bool(ok) and (elastic or len(ok) == len(workers))

    return done


def trainjob_succeeded(states: dict[str, PodState]) -> bool:
    """An Indexed Job succeeds when every index succeeded; JobSet's default success policy needs all Jobs."""
    return all(s.exit_codes and s.exit_codes[-1] == 0 and s.proc is None for s in states.values())


def run_job(
    cluster: PodCluster,
    succeeded: Callable[[dict[str, PodState]], bool],
    *,
    timeout_s: float,
    backoff_limit: int | None = None,
    on_tick: Callable[[PodCluster, list[str]], None] | None = None,
    drain_s: float = 30.0,
    stop_when: Callable[[PodCluster], str | None] | None = None,
) -> JobOutcome:
    """Start every pod and supervise until the job succeeds, fails or times out (pods are left to `close`).

    `stop_when(cluster)`, checked every poll, ends the job `Stopped` with the reason it returns (a
    scenario that proves a deadlock stops once the wait cycle is observed, not at a fixed timeout)."""
    start = time.monotonic()
    events: list[str] = []

    def note(msg: str) -> None:
        events.append(f"{time.monotonic() - start:7.1f}s {msg}")

    refused = admit(cluster.objects)
    if refused:
        return JobOutcome("Refused", "\n".join(refused), 0.0, [])
    pending: dict[str, float] = {}  # pod -> when to (re)start it
    recreated = 0
    for name in cluster.pods:
        cluster.start(name, wait=False)
        note(f"start {name}")
    outcome: tuple[str, str] | None = None
    while outcome is None:
        cluster.tick()
        for state in cluster.pods.values():
            while state.events:
                note(state.events.pop(0))
        if time.monotonic() - start > timeout_s:
            outcome = ("Timeout", f"no end within {timeout_s:.0f} s")
            break
        for name, state in cluster.pods.items():
            code = cluster.poll(name)
            if code is None:
                continue
            action = operator_action(state.pod, code)
            note(f"{name} exited {code} -> {action}")
            if action == "kubelet-restart":
                delay = restart_delay(state.restarts)
                state.restarts += 1
                total = sum(s.restarts for s in cluster.pods.values())
                if backoff_limit is not None and total >= max(backoff_limit, 1):
                    outcome = ("Failed", f"backoffLimit {backoff_limit} reached ({total} container restarts)")
                    break
                pending[name] = time.monotonic() + delay
            elif action == "recreate":
                recreated += 1
                # TO v1.9.4 common/job.go ReconcileJobs: `exceedsBackoffLimit` needs NumRequeues(job) + 1 >
                # backoffLimit, and the PyTorchJob controller's FakeWorkQueue (pytorchjob_controller.go:82,
                # fake_workqueue.go:56) always answers 0; `PastBackoffLimit` (core/job.go) sums restartCount of
                # Running pods, 0 under Never. So only backoffLimit 0 fails the job, at its first failed pod:
                # every other bound is the launcher's own (`training.pod_recreations`).
                if backoff_limit == 0:
                    outcome = ("Failed", f"backoffLimit 0 reached ({recreated} pod failure)")
                    break
                cluster.recreate(name)
                pending[name] = time.monotonic()
            elif action == "restart-all":
                note(f"JobSet restart #{state.pod.controller.get('restarts')}: every pod is recreated")
                for other in cluster.pods:
                    cluster.recreate(other)
                    pending[other] = time.monotonic()
            elif action == "fail-job":
                policy = state.pod.replica_policy or state.pod.restart_policy
                outcome = ("Failed", f"{name} exited {code} under {policy}")
                break
        if outcome is None and succeeded(cluster.pods):
            outcome = ("Succeeded", "success condition met")
            break
        for name, when in list(pending.items()):
            if time.monotonic() >= when:
                del pending[name]
                cluster.start(name, wait=False)
                note(f"restart {name} (start #{cluster.pods[name].starts + 1})")
        if on_tick is not None and outcome is None:
            on_tick(cluster, events)
        if stop_when is not None and outcome is None and (why := stop_when(cluster)) is not None:
            outcome = ("Stopped", why)
            break
        time.sleep(0.2)
    # Let the other pods end on their own (they finish the same collective), then stop them.
    deadline = time.monotonic() + drain_s
    while any(s.proc is not None for s in cluster.pods.values()) and time.monotonic() < deadline:
        for name in cluster.pods:
            code = cluster.poll(name)
            if code is not None:
                note(f"{name} exited {code}")
        time.sleep(0.2)
    for name, state in cluster.pods.items():
        if state.proc is not None:
            note(f"{name} still running at the end: killed")
            cluster.kill(name)
            cluster.poll(name)
    return JobOutcome(outcome[0], outcome[1], time.monotonic() - start, events)
