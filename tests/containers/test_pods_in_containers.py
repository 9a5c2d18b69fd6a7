"""The rendered pods of multi-pod jobs as real containers (tests/pods/podman_runtime.py), trained to the end.

The pods harness's scenarios run here with its second runtime: each pod of the rendered PyTorchJob,
TrainJob or RayJob (operators.py derives them) is a container of images/cpu with the template's
securityContext, volumes, limits and grace period, on one podman network whose aardvark-dns answers the
operators' Service and hostname names. jobs.py `run_job` plays the kubelet and the operator, as for the
process runtime (the RayJob's head, workers and submitter are started as KubeRay would, and the kubelet
ticks until the submitter exits). Every scenario ends bit-identical (`params_sha256`) to `torchrig run
--nodes 2`.

Needs podman with netavark/aardvark-dns (scripts/install-tools.sh); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.pods.admission import check_admitted
from tests.pods.conftest import TIME_SCALE
from tests.pods.conftest import reference_result as reference_result  # noqa: PLC0414 (a fixture, re-exported)
from tests.pods.jobs import JobOutcome, pytorchjob_succeeded, run_job, run_rayjob, trainjob_succeeded
from tests.pods.kubelet import Pod
from tests.pods.operators import pytorchjob_pods, rayjob_pods, trainjob_pods
from tests.pods.podman_runtime import PodmanCluster
from tests.pods.runtime import PodCluster
from tests.pods.scenario import one, render
from tests.pods.test_pods import _events, _ray_job_status, _result, _run_dirs_of, _why
from training.contract import EventKind

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(900)]

JOB_TIMEOUT_S = 300
MakeCluster = Callable[[list[dict[str, Any]], list[Pod]], PodmanCluster]

# Run inside a container (`podman exec`, as its user): SIGKILL the trainer of RANK argv[1]; exit 3 when this
# container has none. torchrun's worker is the rank's in-place host (training.inplace.host), the trainer
# its child (TORCHRIG_INPLACE_ROLE=trainer when exec'd, the host's own environment when forked); warm
# spares carry TORCHRIG_INPLACE_ROLE=spare. Killing the host would be torchrun's worker dying: a group restart.
KILL_RANK = """
import os, signal, sys
ranked = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        env = dict(e.split(b"=", 1) for e in open(f"/proc/{pid}/environ", "rb").read().split(b"\\0") if b"=" in e)
        parent = int(open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[1])
    except OSError:
        continue
    if env.get(b"RANK") == sys.argv[1].encode() and env.get(b"TORCHRIG_INPLACE_ROLE") != b"spare":
        ranked[int(pid)] = (parent, env.get(b"TORCHRIG_INPLACE_ROLE"))
trainers = [p for p, (parent, role) in ranked.items() if role == b"trainer" or parent in ranked]
if len(trainers) != 1:
    print("candidates", ranked)
    sys.exit(3)
os.kill(trainers[0], signal.SIGKILL)
print("killed", trainers[0], "of", sorted(ranked))
"""


@pytest.fixture
def podman_cluster(cpu_image: str, tmp_path: Path) -> Iterator[MakeCluster]:
    """`make(objects, pods)` -> an entered PodmanCluster of the CPU image; every cluster made is closed."""
    made: list[PodmanCluster] = []

    def make(objects: list[dict[str, Any]], pods: list[Pod]) -> PodmanCluster:
        cluster = PodmanCluster(tmp_path / f"cluster{len(made)}", objects, pods, image=cpu_image, time_scale=TIME_SCALE)
        made.append(cluster)
        return cluster.__enter__()

    yield make
    for cluster in made:
        cluster.close()


def _committed(cluster: PodCluster, step: int) -> bool:
    return any(e.kind is EventKind.CHECKPOINT_COMMITTED and (e.step or 0) >= step for e in _events(cluster))


def _pytorchjob(make: MakeCluster, objects: list[dict[str, Any]], **kw: Any) -> tuple[PodmanCluster, JobOutcome]:
    job = one(objects, "PyTorchJob")
    cluster = make(objects, pytorchjob_pods(objects))
    backoff = job["spec"].get("runPolicy", {}).get("backoffLimit")
    outcome = run_job(cluster, pytorchjob_succeeded(job), timeout_s=JOB_TIMEOUT_S, backoff_limit=backoff, **kw)
    return cluster, outcome


def _slow(rank: int, step: int, seconds: float) -> str:
    fault = [{"kind": "slow", "rank": rank, "step": step, "generation": -1, "seconds": seconds}]
    return f"spec.kubernetes.env.TORCHRIG_FAULTS='{json.dumps(fault)}'"


def _kill_rank_after_step_10(rank: int) -> tuple[list[str], Callable[[PodCluster, list[str]], None]]:
    """A harness tick that SIGKILLs rank `rank`'s trainer inside its container (`podman exec`) once the
    step-10 checkpoint is committed; the list gets the pod it ran in."""
    killed: list[str] = []

    def kill(cluster: PodCluster, events: list[str]) -> None:
        if killed or not _committed(cluster, 10):
            return
        for name in cluster.pods:
            proc = cluster.exec(name, ["python", "-c", KILL_RANK, str(rank)])
            if proc.returncode == 0:
                killed.append(name)
                events.append(f"harness: podman exec {name}: {proc.stdout.strip()} (rank {rank})")
                return
        raise AssertionError(f"no container runs rank {rank}'s trainer: {proc.stdout} {proc.stderr}")

    return killed, kill


def _assert_replaced_in_place(cluster: PodCluster, outcome: JobOutcome, reference: dict[str, Any]) -> None:
    """The job succeeded, no container restarted, every member recovered in place at one step, bit-exact."""
    assert outcome.status == "Succeeded", _why(outcome, cluster)
    assert {n: (s.exit_codes, s.starts) for n, s in cluster.pods.items()} == {n: ([0], 1) for n in cluster.pods}
    recoveries = [e for e in _events(cluster) if e.kind is EventKind.RECOVERY]
    assert {e.get("path") for e in recoveries} == {"inplace"}, _why(outcome, cluster)
    assert sorted(e.get("role") for e in recoveries) == ["spare", "survivor", "survivor", "survivor"]
    assert len({e.step for e in recoveries}) == 1, "every rank resumed from the same step: none lost"
    result = _result(cluster)
    assert (result["steps"], result["world_size"]) == (40, 4)
    assert result["params_sha256"] == reference["params_sha256"]


def test_pytorchjob_of_two_pods_replaces_a_rank_killed_in_its_container_in_place(
    podman_cluster: MakeCluster, reference_result: dict[str, Any]
) -> None:
    """A fixed-size PyTorchJob (Master + Worker, 2 ranks each) in hardened containers: the Worker's
    init container waits for the Master's name (aardvark-dns), both agents rendezvous at
    `$(MASTER_ADDR):$(MASTER_PORT)`, and after the step-10 checkpoint rank 3's trainer is SIGKILLed
    from outside (`podman exec ... kill`): a warm spare in its container takes its place, no container
    restarts, no step is lost, and the run ends bit-identical to `torchrig run --nodes 2`."""
    objects = render("pytorchjob", _slow(0, 5, 0.3), fixed_size=True)
    killed, kill = _kill_rank_after_step_10(3)
    cluster, outcome = _pytorchjob(podman_cluster, objects, on_tick=kill)
    assert killed, "the job ended before the step-10 checkpoint\n" + _why(outcome, cluster)
    _assert_replaced_in_place(cluster, outcome, reference_result)


def test_drained_pytorchjob_checkpoints_within_its_grace_and_resumes_losing_no_step(
    podman_cluster: MakeCluster, reference_result: dict[str, Any]
) -> None:
    """A node drain of both pods after the step-10 checkpoint: `podman stop -t
    terminationGracePeriodSeconds` of every container (SIGTERM, SIGKILL at the deadline). Every rank
    stops at one agreed step after an emergency checkpoint on the PVC, well within the grace, and exits
    PREEMPTED (their torchrun 143, retryable); the operator recreates both pods (new emptyDirs, the same claim), which
    resume from that step: 0 steps lost, bit-identical to `torchrig run --nodes 2`."""
    # Every rank paced from step 8: the drain, sent once step 10 is committed, lands well before step 40.
    objects = render("pytorchjob", _slow(-1, 8, 0.2), fixed_size=True)
    drained: list[float] = []

    def drain(cluster: PodCluster, events: list[str]) -> None:
        if drained or not _committed(cluster, 10):
            return
        assert isinstance(cluster, PodmanCluster)
        drained.append(time.time())
        for name in cluster.pods:
            cluster.stop(name)
        events.append("harness: node drain, every pod deleted")

    cluster, outcome = _pytorchjob(podman_cluster, objects, on_tick=drain)
    assert drained, "the job ended before the step-10 checkpoint\n" + _why(outcome, cluster)
    assert outcome.status == "Succeeded", _why(outcome, cluster)
    for state in cluster.pods.values():
        # The ranks exit PREEMPTED; the container's torchrun (training.torchrun) ends 128 + SIGTERM.
        assert state.exit_codes == [128 + signal.SIGTERM, 0] and state.incarnation == 1, _why(outcome, cluster)
    events = _events(cluster)
    preempted = [e for e in events if e.kind is EventKind.PREEMPTED]
    assert len(preempted) == 4 and all(e.get("committed") for e in preempted), _why(outcome, cluster)
    stop = {e.step for e in preempted}
    assert len(stop) == 1 and 10 <= min(stop) < 40, stop
    stopped_s = max(e.time for e in preempted) - drained[0]
    assert stopped_s < cluster.grace_s(next(iter(cluster.pods))), f"{stopped_s:.0f} s of the grace period"
    restores = [e for e in events if e.kind is EventKind.RESTORE]
    assert restores and {e.step for e in restores} == stop, "0 lost steps: resumed from the stop step"
    result = _result(cluster)
    assert (result["steps"], result["world_size"]) == (40, 4)
    assert result["params_sha256"] == reference_result["params_sha256"]


def test_trainjob_of_two_pods_trains_in_containers_and_replaces_a_killed_rank_in_place(
    podman_cluster: MakeCluster, reference_result: dict[str, Any]
) -> None:
    """A TrainJob of 2 nodes: the JobSet's pods reach node 0 by `PET_MASTER_ADDR`
    (`<trainjob>-node-0-0.<trainjob>`, the headless Service's name, answered by aardvark-dns) and share
    its rendezvous store for in-place recovery; rank 1's trainer, SIGKILLed in its container after the
    step-10 checkpoint, is replaced by a warm spare: no pod fails (a failed pod would fail its Job and
    restart the whole JobSet), no step is lost, bit-identical to `torchrig run --nodes 2`."""
    objects = render("trainjob", "spec.nodes.min=2", _slow(0, 5, 0.3))
    cluster = podman_cluster(objects, trainjob_pods(objects))
    killed, kill = _kill_rank_after_step_10(1)
    outcome = run_job(cluster, trainjob_succeeded, timeout_s=JOB_TIMEOUT_S, on_tick=kill)
    assert killed, "the job ended before the step-10 checkpoint\n" + _why(outcome, cluster)
    _assert_replaced_in_place(cluster, outcome, reference_result)


def test_a_standby_pod_takes_the_ranks_of_a_killed_pod_in_place(
    podman_cluster: MakeCluster, reference_result: dict[str, Any]
) -> None:
    """`restarts.spareNodes: 1` on a 2-node PyTorchJob: a store-only Master, Workers 0 and 1 training,
    Worker 2 standing by. Once the standby's spares are warm, the container of the node that is not
    rank 0's is SIGKILLed whole (`podman kill`: a lost node). The standby takes both of its ranks in
    place, the other node's ranks never restart, no step is lost, bit-identical to `torchrig run
    --nodes 2`; the lost node's recreated pod stands by (or finds the job over)."""
    objects = render("pytorchjob", "spec.nodes.min=2", "spec.restarts.spareNodes=1", _slow(0, 5, 0.3))
    standby, nodes, store = "digits-ddp-worker-2", ["digits-ddp-worker-0", "digits-ddp-worker-1"], "digits-ddp-master-0"
    killed: list[tuple[float, str]] = []

    def kill(cluster: PodCluster, events: list[str]) -> None:
        if killed or "torchrig: standby: ready" not in cluster.pods[standby].logs():
            return
        rank0 = [n for n in nodes if "torchrig: step " in cluster.pods[n].logs()]
        if len(rank0) != 1:
            return
        victim = next(n for n in nodes if n != rank0[0])
        killed.append((time.time(), victim))
        cluster.kill(victim)
        events.append(f"harness: podman kill -s KILL {victim} (a lost node)")

    cluster, outcome = _pytorchjob(podman_cluster, objects, on_tick=kill)
    assert killed, "the job ended before the standby was ready\n" + _why(outcome, cluster)
    killed_at, victim = killed[0]
    assert outcome.status == "Succeeded", _why(outcome, cluster)
    survivor = next(n for n in nodes if n != victim)
    codes = {n: s.exit_codes for n, s in cluster.pods.items()}
    assert codes[store] == codes[survivor] == codes[standby] == [0], _why(outcome, cluster)
    assert codes[victim][0] == 137 and codes[victim][-1] == 0, _why(outcome, cluster)
    taken = [line for line in cluster.pods[standby].logs().splitlines() if "standby: node" in line]
    assert len(taken) == 1 and "takes its ranks" in taken[0], _why(outcome, cluster)
    recoveries = [e for e in _events(cluster) if e.kind is EventKind.RECOVERY and e.time >= killed_at]
    assert {e.get("path") for e in recoveries} == {"inplace"}, _why(outcome, cluster)
    assert sorted(e.get("role") for e in recoveries) == ["spare", "spare", "survivor", "survivor"]
    assert len({e.step for e in recoveries}) == 1, "every rank resumed from the same step: none lost"
    result = _result(cluster)
    assert (result["steps"], result["world_size"]) == (40, 4)
    assert result["params_sha256"] == reference_result["params_sha256"]
    logs = cluster.pods[victim].logs()
    assert "this node stands by" in logs or "the job is over" in logs, _why(outcome, cluster)


@pytest.mark.timeout(600)  # JOB_TIMEOUT_S, the reference run when it comes first, the teardown
def test_rayjob_head_and_two_workers_train_in_containers_to_the_end(
    podman_cluster: MakeCluster, reference_result: dict[str, Any]
) -> None:
    """A RayJob of 2 worker pods (`nodes.min=2`: 2 Ray worker nodes x 2 ranks) as KubeRay runs it: the
    head's `ulimit -n ...; ray start --head ...` (KubeRay's command, token auth from its Secret), each
    worker's `wait-gcs-ready` init container looping on `ray health-check` until the head's GCS answers
    at the head Service's name (aardvark-dns), then `ray start --address=<head FQDN>:6379`, and the
    submitter Job's pod once the RayCluster is Ready (KubeRay's injected readiness probe on every pod; the
    pod is the `submitterPodTemplate`: restricted securityContext, no command, so KubeRay's `ray job
    submit ... ; ray job logs --follow`; a failed one replaced, backoffLimit 2: jobs.py `run_rayjob`). Ray
    finds each node's address on its own (KubeRay passes no `--node-ip-address`): with no default route on
    the internal network, by its fallback to the hostname, which the container's /etc/hosts maps to the pod
    address. The driver on the head runs Ray Train over the two worker containers (gloo across them); the
    submitter exits 0, the Ray job is SUCCEEDED, the head's summary says so, and rank 0's parameters are
    bit-identical to `torchrig run --nodes 2`."""
    t0 = time.monotonic()
    objects = render("rayjob", "spec.nodes.min=2")
    check_admitted(objects)  # KubeRay's webhook and validation (admission.py)
    ray = rayjob_pods(objects)
    assert len(ray.workers) == 2 and ray.auth_token, "2 worker pods, token auth"
    assert ray.submitter.container["securityContext"]["capabilities"]["drop"] == ["ALL"], "its template's"
    cluster = podman_cluster([*objects, *ray.secrets], [ray.head, *ray.workers, ray.submitter])
    # The head and workers start; the submitter once the RayCluster is Ready (KubeRay's readiness probe), and
    # again as the Job's next pod if it fails (backoffLimit 2).
    outcome = run_rayjob(cluster, ray, timeout_s=JOB_TIMEOUT_S)
    wall_s = time.monotonic() - t0
    head_ip = cluster.pods[ray.head.name].ip
    status = _ray_job_status(cluster, ray.head.name, head_ip, ray.submission_id, ray.auth_token)
    assert outcome.status == "Succeeded" and status == "SUCCEEDED", f"{status}\n{outcome}\n{_logs(cluster)}"
    assert any("the RayCluster is Ready" in e for e in outcome.events), outcome
    workers = [w.name for w in ray.workers]
    result = _result(cluster, workers)  # rank 0's, in its worker pod's run directory
    assert (result["steps"], result["world_size"]) == (40, 4)
    assert result["params_sha256"] == reference_result["params_sha256"]
    summary = json.loads((_run_dirs_of(cluster, ray.head.name)[0] / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["ray_auth"] == "token"
    assert summary["world_sizes"] == [4] and summary["params_sha256"] == result["params_sha256"]
    # Each Ray node advertised its own pod address (its hostname's, in /etc/hosts), not loopback.
    nodes = cluster.exec(ray.head.name, ["ray", "list", "nodes", "--format", "json"], timeout_s=120)
    ips = sorted(n["node_ip"] for n in json.loads(nodes.stdout)) if nodes.returncode == 0 else nodes.stderr
    assert ips == sorted(s.ip for n, s in cluster.pods.items() if n != ray.submitter.name), ips
    print(f"rayjob in containers: submitter exited after {wall_s:.1f} s; Ray nodes at {ips}")


def _logs(cluster: PodCluster) -> str:
    """Every pod's log tail, the submitter's first (what CI keeps of a failure is its beginning)."""
    order = sorted(cluster.pods.items(), key=lambda item: item[1].pod.role != "submitter")
    return "\n".join(f"--- {n}\n{s.logs()[-4000:]}" for n, s in order)
