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
from tests.pods.operators import RayJobPods, operator_action
from tests.pods.runtime import PodCluster, PodState

__all__ = [
    "KR_SUBMITTER_BACKOFF_LIMIT",
    "JobOutcome",
    "pytorchjob_succeeded",
    "run_job",
    "run_rayjob",
    "trainjob_succeeded",
]


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


def _stamped(events: list[str], start: float) -> Callable[[str], None]:
    """`note(msg)`: appends `msg` to `events`, stamped with the seconds since `start`."""

    def note(msg: str) -> None:
        events.append(f"{time.monotonic() - start:7.1f}s {msg}")

    return note


def _take_pod_events(cluster: PodCluster, note: Callable[[str], None]) -> None:
    """Move what the kubelet recorded for each pod (probes, init containers) into the job's events."""
    for state in cluster.pods.values():
        while state.events:
            note(state.events.pop(0))


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
    note = _stamped(events, start)
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
        _take_pod_events(cluster, note)
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


# KubeRay rayjob_controller.go createNewK8sJob: the submitter Job's `backoffLimit` unless
# `submitterConfig.backoffLimit` says otherwise.
KR_SUBMITTER_BACKOFF_LIMIT = 2


def run_rayjob(cluster: PodCluster, ray: RayJobPods, *, timeout_s: float) -> JobOutcome:
    """Play KubeRay's RayJob controller in K8sJobMode and the Job controller of its submitter.

    - The RayCluster's head and worker pods start at once (their init containers and probes run on `tick`).
    - The submitter Job is created only once the RayCluster is Ready (rayjob_controller.go: "Wait for the
      RayCluster.Status.State to be ready before submitting the job"; raycluster_controller.go
      calculateStatus: every pod there, Running and Ready, utils.CheckAllPodsRunning): with the readiness
      probe KubeRay injects (operators.py `_inject_readiness_probe`) that is about 10 s after the start.
    - Its pod (restartPolicy Never) that fails is replaced by a new one, after the Job controller's back-off
      (10 s, doubling), until `backoffLimit` failures (KR_SUBMITTER_BACKOFF_LIMIT); the Job then fails.
      The submitter's `ray job status` guard keeps a retried pod from submitting twice (common/job.go).
    - A head or worker container that exits fails the run at once (restartPolicy Always would restart it;
      no scenario here expects one to exit), with its code.

    Returns `Succeeded` when a submitter pod exits 0, else `Failed` or `Timeout`; `events` holds when the
    cluster was Ready and every submitter exit. Pods are left running for the caller to inspect.
    """
    start = time.monotonic()
    events: list[str] = []
    note = _stamped(events, start)
    refused = admit(cluster.objects)
    if refused:
        return JobOutcome("Refused", "\n".join(refused), 0.0, [])
    nodes = [ray.head.name, *(w.name for w in ray.workers)]
    for name in nodes:
        cluster.start(name, wait=False)  # the workers' wait-gcs-ready init containers wait for the head's GCS
        note(f"start {name}")
    submitter = ray.submitter.name
    created_at: float | None = None  # when the submitter's current pod is due to start
    running = False  # the submitter's current pod has started
    failures = 0
    while True:
        cluster.tick()
        _take_pod_events(cluster, note)
        now = time.monotonic()
        if now - start > timeout_s:
            return JobOutcome("Timeout", f"no end within {timeout_s:.0f} s", now - start, events)
        for name in nodes:
            code = cluster.poll(name)
            if code is not None:
                return JobOutcome("Failed", f"{name} exited {code}", now - start, events)
        if created_at is None and failures == 0 and all(cluster.pods[n].ready for n in nodes):
            note("the RayCluster is Ready: the submitter Job is created")
            created_at = now
        if created_at is not None and now >= created_at and not running:
            cluster.start(submitter, wait=False)
            running = True
            note(f"start {submitter} (pod {failures + 1} of the Job)")
        if running:
            code = cluster.poll(submitter)
            if code == 0:
                note(f"{submitter} exited 0")
                return JobOutcome("Succeeded", "the submitter pod succeeded", now - start, events)
            if code is not None:
                failures += 1
                note(f"{submitter} exited {code} (failure {failures} of the Job)")
                if failures > KR_SUBMITTER_BACKOFF_LIMIT:
                    why = f"backoffLimit {KR_SUBMITTER_BACKOFF_LIMIT} reached ({failures} failed submitter pods)"
                    return JobOutcome("Failed", why, now - start, events)
                cluster.recreate(submitter)  # the Job's next pod: a fresh one
                running = False
                created_at = now + restart_delay(failures) * cluster.time_scale
        time.sleep(0.2)
