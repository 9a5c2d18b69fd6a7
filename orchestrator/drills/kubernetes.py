"""`torchrig drill kill-worker JOB --backend kubernetes`: delete a worker pod of a submitted job through
the API and watch the job recover.

On a cluster the drill sees what the API shows: the job's conditions, the pods (the operator recreates
the deleted one; torchrun in the other pods restarts its workers), and the workers' logs, where the
checkpoint manager writes `restored step N from STORE`. There is no in-process fault and no reference
run here: run the local drill with the same spec for the bit-for-bit comparison.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

from orchestrator.backends.base import RunState, SubmitOptions
from orchestrator.drills.plan import DrillEvent
from orchestrator.drills.report import DrillReport
from orchestrator.errors import UnsupportedFeature
from orchestrator.spec import JobSpec
from training.contract import DrillEventKind

__all__ = ["run_kubernetes_kill_worker"]

_RESTORED_RE = re.compile(r"restored step (\d+) from (\S+)")


def _pod_running(pod: Any) -> bool:
    status = getattr(pod, "status", None)
    return bool(status is not None and getattr(status, "phase", None) == "Running")


def run_kubernetes_kill_worker(
    spec: JobSpec,
    *,
    seed: int = 0,
    node_index: int | None = None,
    timeout_s: float = 1800.0,
    poll_s: float = 2.0,
    wait_for_completion: bool = True,
    backend: Any = None,
    options: SubmitOptions | None = None,
) -> DrillReport:
    """Submit `spec`, delete one node's pod once the job runs, and judge the recovery from the API."""
    from orchestrator.backends import get_backend

    if spec.spec.kubernetes.target != "pytorchjob":
        raise UnsupportedFeature("spec.kubernetes.target: the kubernetes kill-worker drill supports pytorchjob")
    backend = backend or get_backend("kubernetes")
    rng = random.Random(seed)
    report = DrillReport(scenario="kill-worker", backend="kubernetes", seed=seed)
    report.notes.append("no reference run on a cluster: run the local drill of the same spec for the params check")

    def event(event_kind: DrillEventKind, /, **fields: Any) -> None:
        report.events.append(DrillEvent(time.time(), event_kind, fields).to_dict())

    handle = backend.submit(spec, options or SubmitOptions())
    run_id = handle.run_id
    report.run_dir = f"kubernetes://{run_id}"
    event(DrillEventKind.SUBMITTED, run_id=run_id)
    deadline = time.monotonic() + timeout_s

    state = RunState.PENDING
    while time.monotonic() < deadline:
        state = backend.status(run_id).state
        if state is RunState.RUNNING or state.terminal:
            break
        time.sleep(poll_s)
    if state is not RunState.RUNNING:
        report.status = state.value
        report.check("job running before the fault", False, f"state {state.value} (timeout {timeout_s:.0f}s)")
        return report
    event(DrillEventKind.RUNNING)

    indices = sorted({i for p in backend.pods(run_id) if (i := backend.pod_index(p)) is not None})
    if not indices:
        report.status = state.value
        report.check("job has pods", False, "the job runs but lists no pods with a node index")
        return report
    index = node_index if node_index is not None else rng.choice(indices)
    report.fault_rank, report.fault_node = None, index
    # The operator recreates the pod under the same name: only a new uid marks the replacement.
    old_uids = {p.metadata.uid for p in backend.pods(run_id) if backend.pod_index(p) == index}
    pod_name = backend.delete_pod(run_id, index)
    t_fault = time.time()
    event(DrillEventKind.FAULT_INJECTED, kind="delete-pod", pod=pod_name, node_index=index)
    report.check("worker pod deleted", True, f"deleted {pod_name} (node index {index})")

    replaced_at: float | None = None
    restored: tuple[int, str] | None = None
    while time.monotonic() < deadline:
        status = backend.status(run_id)
        state = status.state
        if replaced_at is None:
            pods = [p for p in backend.pods(run_id) if backend.pod_index(p) == index]
            if any(_pod_running(p) and p.metadata.uid not in old_uids for p in pods):
                replaced_at = time.time()
                event(DrillEventKind.RECOVERED, detail="replacement pod running")
        if restored is None:
            for line in backend.logs(run_id, rank=None, follow=False):
                match = _RESTORED_RE.search(line)
                if match:
                    restored = (int(match.group(1)), match.group(2))
        if state.terminal or (not wait_for_completion and replaced_at is not None and restored is not None):
            break
        time.sleep(poll_s)

    report.status = state.value
    if replaced_at is not None:
        report.mttr_seconds = round(replaced_at - t_fault, 3)
    if restored is not None:
        report.resumed_from_step = restored[0]
        report.restored_from = [{"store": restored[1], "step": restored[0], "source": "store"}]
    report.recovered = replaced_at is not None and state is not RunState.FAILED
    report.check(
        "replacement pod running",
        replaced_at is not None,
        f"after {report.mttr_seconds} s" if replaced_at is not None else "no replacement pod came up",
    )
    report.check(
        "workers restored from a checkpoint",
        restored is not None,
        f"restored step {restored[0]} from {restored[1]}" if restored else "no `restored step` line in the logs",
    )
    if wait_for_completion:
        report.check("job succeeded", state is RunState.SUCCEEDED, f"final state {state.value}")
    else:
        report.check("job not failed", state is not RunState.FAILED, f"state {state.value}")
    return report
