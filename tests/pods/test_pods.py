"""The rendered manifests' own pods, run as processes (tests/pods/runtime.py), train digits.

Each scenario renders examples/digits-ddp.yaml (40 steps, a checkpoint every 10 on its PVC store)
for one target, asks the operator's contract (operators.py) which pods it would run, and runs their
exact commands in per-pod network/mount/PID namespaces. `pytest -m pods` runs exactly these; they
need root and `ip netns` (skipped otherwise, with the reason).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.pods.admission import check_admitted
from tests.pods.jobs import JobOutcome, pytorchjob_succeeded, run_job, run_rayjob, trainjob_succeeded
from tests.pods.kubelet import Pod
from tests.pods.operators import KR_AUTH_HEADER, pytorchjob_pods, rayjob_pods, trainjob_pods
from tests.pods.runtime import IMAGE_ENV, PodCluster, netns_reason
from tests.pods.scenario import one, render
from training.contract import EventKind, ExitCode, read_events

pytestmark = [pytest.mark.pods, pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(420)]

# A client of the store pod without the job's secret: the job-end records a forger would write (argv: the
# store pod's address and the run id). Unsigned, the store pod must ignore them (`training.contract.orders`).
FORGE_JOB_END = """
import sys
from datetime import timedelta
from torch._C._distributed_c10d import TCPStore
from training.rendezvous_store import failed_key, succeeded_key
store = TCPStore(sys.argv[1], 23456, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=20))
store.set(failed_key(sys.argv[2]), "1")
store.set(succeeded_key(sys.argv[2]), "1")
"""
MakeCluster = Callable[[list[dict[str, Any]], list[Pod]], PodCluster]
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module", autouse=True)
def _netns_available() -> Iterator[None]:
    reason = netns_reason()
    if reason:
        pytest.skip(reason)
    yield


def _run_dirs_of(cluster: PodCluster, pod: str) -> list[Path]:
    """The pod's run directories (the volume mounted at TORCHRIG_RUN_DIR), one per incarnation."""
    state = cluster.pods[pod]
    env = {e["name"]: e.get("value") for e in state.pod.container.get("env", [])}
    run_dir = env.get("TORCHRIG_RUN_DIR", IMAGE_ENV["TORCHRIG_RUN_DIR"])
    mounts = [m for m in state.pod.container.get("volumeMounts", []) if m["mountPath"] == run_dir]
    return sorted(state.dir.glob(f"pod-*/volumes/{mounts[0]['name']}")) if mounts else []


def _run_dirs(cluster: PodCluster) -> list[Path]:
    """Every run directory of every pod incarnation."""
    return [d for name in cluster.pods for d in _run_dirs_of(cluster, name)]


def _result(cluster: PodCluster, pods: list[str] | None = None) -> dict[str, Any]:
    """Rank 0's result.json: the one among the run directories of `pods` (default: every pod)."""
    dirs = _run_dirs(cluster) if pods is None else [d for name in pods for d in _run_dirs_of(cluster, name)]
    found = [json.loads(p.read_text()) for d in dirs if (p := d / "result.json").exists()]
    assert len(found) == 1, f"expected one result.json (rank 0's), found {len(found)}"
    return found[0]


def _events(cluster: PodCluster) -> list[Any]:
    return [e for d in _run_dirs(cluster) for e in read_events(d / "events.jsonl")]


def _why(outcome: JobOutcome, cluster: PodCluster) -> str:
    return f"{outcome}\n" + "\n".join(f"--- {n}\n{s.logs()[-4000:]}" for n, s in cluster.pods.items())


def _run_pytorchjob(
    make: MakeCluster, objects: list[dict[str, Any]], timeout_s: float = JOB_TIMEOUT_S, **kw: Any
) -> tuple[PodCluster, JobOutcome]:
    job = one(objects, "PyTorchJob")
    cluster = make(objects, pytorchjob_pods(objects))
    backoff = job["spec"].get("runPolicy", {}).get("backoffLimit")
    outcome = run_job(cluster, pytorchjob_succeeded(job), timeout_s=timeout_s, backoff_limit=backoff, **kw)
    return cluster, outcome


def _kill_once(
    victim: str, when: Callable[[PodCluster], bool]
) -> tuple[list[float], Callable[[PodCluster, list[str]], None]]:
    """A harness tick that SIGKILLs `victim`'s PID namespace the first time `when(cluster)` holds; the
    list gets the kill's time."""
    killed_at: list[float] = []

    def tick(cluster: PodCluster, events: list[str]) -> None:
        if not killed_at and when(cluster):
            killed_at.append(time.time())
            cluster.kill(victim)
            events.append(f"harness: SIGKILL of {victim}'s PID namespace")

    return killed_at, tick


def _step_20_committed(cluster: PodCluster) -> bool:
    committed = [e for e in _events(cluster) if e.kind is EventKind.CHECKPOINT_COMMITTED]
    return any((e.step or 0) >= 20 for e in committed)


def test_pytorchjob_fixed_master_and_worker_train_like_torchrig_run(
    pod_cluster: MakeCluster, reference_result: dict[str, Any]
) -> None:
    objects = render("pytorchjob", fixed_size=True)
    assert [p.role for p in pytorchjob_pods(objects)] == ["master-0", "worker-0"]
    cluster, outcome = _run_pytorchjob(pod_cluster, objects)
    assert outcome.status == "Succeeded", _why(outcome, cluster)
    result = _result(cluster)
    assert (result["steps"], result["world_size"]) == (40, 4)
    assert result["params_sha256"] == reference_result["params_sha256"]
    assert {n: s.exit_codes for n, s in cluster.pods.items()} == {n: [0] for n in cluster.pods}


ELASTIC_MIN_2 = ("spec.nodes.min=2", "spec.nodes.max=3")


def test_pytorchjob_elastic_job_of_at_least_two_nodes_trains(pod_cluster: MakeCluster) -> None:
    """`nodes.min: 2` (of 3): every Worker's torchrun must reach `<job>-worker-0` (PET_RDZV_ENDPOINT) before
    the rendezvous can complete, so worker-0's name must resolve before worker-0 trains (issue 40 point 3)."""
    objects = render("pytorchjob", *ELASTIC_MIN_2)
    assert one(objects, "PyTorchJob")["spec"]["elasticPolicy"]["minReplicas"] == 2
    cluster, outcome = _run_pytorchjob(pod_cluster, objects)
    assert outcome.status == "Succeeded", _why(outcome, cluster)
    result = _result(cluster)
    assert result["steps"] == 40 and result["world_size"] in (4, 6), result


def _gate_readiness_on_the_rendezvous(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The probes torchrig rendered before issue 40: a startup probe that passes only once rank 0's
    exporter answers (after torchrun's rendezvous), 240 x 10 s, then liveness."""
    job = one(objects, "PyTorchJob")
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        container = replica["template"]["spec"]["containers"][0]
        exec_ = {"command": ["python", "-m", "training.healthcheck"]}
        container["startupProbe"] = {"exec": exec_, "timeoutSeconds": 10, "periodSeconds": 10, "failureThreshold": 240}
        container["livenessProbe"] = {"exec": exec_, "timeoutSeconds": 10, "periodSeconds": 30, "failureThreshold": 3}
    return objects


# Failed startup probes of the rendezvous host that prove the deadlock: at the scenarios' probe pace
# (`TIME_SCALE`) 5 probes take 25 s, the host's imports and its side of the rendezvous long done by then.
CYCLE_PROBES = 5


def _wait_cycle(host: str, waiter: str, marker: str) -> Callable[[PodCluster], str | None]:
    """`stop_when` of the deadlock scenarios: the reason once every edge of the wait cycle is seen at once.

    The host's container runs, its name does not resolve (its Services do not publish not-ready
    addresses), its startup probe failed `CYCLE_PROBES` times in a row (not Ready, and it cannot be
    before the rendezvous it hosts completes), and the waiter, still running, logged `marker` (it could
    not resolve the host's name: `init-pytorch` loops on it, torchrun's c10d client retries it until its
    join timeout). The rendezvous needs the waiter, the waiter needs the host's name, the name needs the
    host Ready: nothing outside the cycle can break it, so waiting longer would prove no more."""

    def seen(cluster: PodCluster) -> str | None:
        state, other = cluster.pods[host], cluster.pods[waiter]
        startup = state.probes.get("startup")
        if state.proc is None or state.pod.publish_not_ready or cluster.resolvable(host) or startup is None:
            return None
        waiting = other.init_proc is not None or other.proc is not None
        if startup.failures < CYCLE_PROBES or not waiting or marker not in other.logs():
            return None
        return f"deadlocked: {host} not Ready after {startup.failures} startup probes; {waiter} waits for its name"

    return seen


@pytest.mark.parametrize("shape", ["fixed size", "elastic, min 2"])
def test_readiness_gated_on_the_rendezvous_deadlocks_a_multi_node_pytorchjob(
    pod_cluster: MakeCluster, shape: str
) -> None:
    """Issue 40 point 3, the defect the harness once hid: the operator's Services do not publish not-ready
    addresses, so the rendezvous host's name resolves only once its pod is Ready, and a startup probe that
    waits for the exporter keeps it not Ready until after the rendezvous it hosts. Fixed size: the
    Worker's `init-pytorch` waits on `<job>-master-0` and its trainer never starts; elastic with
    `min >= 2`: worker-1's torchrun cannot resolve `<job>-worker-0`. No step is ever taken."""
    if shape == "fixed size":
        objects = _gate_readiness_on_the_rendezvous(render("pytorchjob", fixed_size=True))
        host, waiter = "digits-ddp-master-0", "digits-ddp-worker-0"
    else:
        objects = _gate_readiness_on_the_rendezvous(render("pytorchjob", *ELASTIC_MIN_2))
        host, waiter = "digits-ddp-worker-0", "digits-ddp-worker-1"
    marker = "waiting for master" if shape == "fixed size" else host
    # Stopped once the wait cycle is seen, not after a fixed 90 s: nothing in the cycle can change by itself.
    stop = _wait_cycle(host, waiter, marker)
    cluster, outcome = _run_pytorchjob(pod_cluster, objects, timeout_s=90, drain_s=0, stop_when=stop)
    assert outcome.status == "Stopped", _why(outcome, cluster)
    assert not [e for e in _events(cluster) if e.kind is EventKind.CHECKPOINT_COMMITTED], _why(outcome, cluster)
    assert not [e for e in outcome.events if f"{host}: startup probe succeeded" in e], _why(outcome, cluster)
    logs = cluster.pods[waiter].logs()
    if shape == "fixed size":
        assert cluster.pods[waiter].starts == 0 and "waiting for master" in logs, _why(outcome, cluster)
    else:
        assert host in logs, _why(outcome, cluster)


def test_pytorchjob_elastic_workers_train_like_torchrig_run(
    pod_cluster: MakeCluster, reference_result: dict[str, Any]
) -> None:
    objects = render("pytorchjob")
    assert one(objects, "PyTorchJob")["spec"]["elasticPolicy"]["minReplicas"] == 1
    assert [p.role for p in pytorchjob_pods(objects)] == ["worker-0", "worker-1"]
    cluster, outcome = _run_pytorchjob(pod_cluster, objects)
    assert outcome.status == "Succeeded", _why(outcome, cluster)
    result = _result(cluster)
    assert (result["steps"], result["world_size"]) == (40, 4)
    assert result["params_sha256"] == reference_result["params_sha256"]


def test_killed_elastic_worker_pod_is_restarted_and_resumes_from_the_pvc(
    pod_cluster: MakeCluster, reference_result: dict[str, Any]
) -> None:
    # Rank 0 slows down from step 20 (generation 0 only), so the kill lands between checkpoints; the
    # fault travels in the manifest's own env (spec.kubernetes.env), like any pod env.
    slow = '\'[{"kind": "slow", "rank": 0, "step": 20, "seconds": 0.4}]\''
    objects = render("pytorchjob", f"spec.kubernetes.env.TORCHRIG_FAULTS={slow}")
    victim = "digits-ddp-worker-1"  # not the c10d store host (PET_RDZV_ENDPOINT = worker-0)

    killed_at, kill = _kill_once(victim, _step_20_committed)
    cluster, outcome = _run_pytorchjob(pod_cluster, objects, on_tick=kill)
    assert killed_at, "the job ended before the step-20 checkpoint was committed"
    assert outcome.status == "Succeeded", _why(outcome, cluster)
    state = cluster.pods[victim]
    assert state.exit_codes[0] == 137 and state.starts >= 2, _why(outcome, cluster)
    restores = [e for e in _events(cluster) if e.kind is EventKind.RESTORE and e.time >= killed_at[0]]
    assert restores, _why(outcome, cluster)
    assert {e.get("store") for e in restores} == {"local"} and min(e.step for e in restores) >= 20
    result = _result(cluster)
    assert (result["steps"], result["world_size"]) == (40, 4)
    # The resumed run equals `torchrig run --nodes 2` with the same kill (restore at step 20) bit for
    # bit (checked by hand, both e4c78052...), but a resume at world size 4 is not bit-exact with the
    # uninterrupted run (it is at 1 node x 2 ranks, tests/integration/test_worker.py): compare the losses.
    assert result["final_loss"] == pytest.approx(reference_result["final_loss"], rel=1e-5)
    assert result["eval"]["loss"] == pytest.approx(reference_result["eval"]["loss"], rel=1e-5)


def test_lost_master_pod_restarts_the_job_from_the_pvc(
    pod_cluster: MakeCluster, reference_result: dict[str, Any]
) -> None:
    """A fixed-size PyTorchJob whose Master pod (its agent hosts the c10d rendezvous store) is lost after
    the step-20 checkpoint: the Worker's agent loses the store and exits 204 (retryable, not torchrun's
    permanent 1), the operator recreates both pods and the job resumes from the checkpoint."""
    slow = '\'[{"kind": "slow", "rank": 0, "step": 20, "seconds": 0.4}]\''
    objects = render("pytorchjob", f"spec.kubernetes.env.TORCHRIG_FAULTS={slow}", fixed_size=True)
    victim, worker = "digits-ddp-master-0", "digits-ddp-worker-0"

    killed_at, kill = _kill_once(victim, _step_20_committed)
    cluster, outcome = _run_pytorchjob(pod_cluster, objects, on_tick=kill)
    assert killed_at, "the job ended before the step-20 checkpoint was committed"
    assert outcome.status == "Succeeded", _why(outcome, cluster)
    assert cluster.pods[victim].exit_codes[0] == 137, _why(outcome, cluster)
    assert cluster.pods[worker].exit_codes[0] == int(ExitCode.STORE_LOST), _why(outcome, cluster)
    assert "lost the rendezvous store" in cluster.pods[worker].logs(), _why(outcome, cluster)
    restores = [e for e in _events(cluster) if e.kind is EventKind.RESTORE and e.time >= killed_at[0]]
    assert restores and min(e.step for e in restores) >= 20, _why(outcome, cluster)
    result = _result(cluster, [victim])
    assert (result["steps"], result["world_size"]) == (40, 4)
    assert result["final_loss"] == pytest.approx(reference_result["final_loss"], rel=1e-5)


def _replace_a_rank_in_place(
    make: MakeCluster, rank: int, replica: str, store: str, *sets: str, fixed_size: bool = False
) -> dict[str, Any]:
    """Run the PyTorchJob with rank `rank` SIGKILLed at step 15; assert the manifest's in-place store
    (`store` in `replica`'s env), that no pod restarted and that every member recovered in place losing
    no step. Returns rank 0's result."""
    kill = f'\'[{{"kind": "kill", "rank": {rank}, "step": 15}}]\''
    objects = render("pytorchjob", *sets, f"spec.kubernetes.env.TORCHRIG_FAULTS={kill}", fixed_size=fixed_size)
    container = one(objects, "PyTorchJob")["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in container["containers"][0]["env"]}
    assert env["TORCHRIG_INPLACE_STORE"] == store
    cluster, outcome = _run_pytorchjob(make, objects)
    assert outcome.status == "Succeeded", _why(outcome, cluster)
    assert {n: s.exit_codes for n, s in cluster.pods.items()} == {n: [0] for n in cluster.pods}, "no pod restart"
    recoveries = [e for e in _events(cluster) if e.kind is EventKind.RECOVERY]
    assert {e.get("path") for e in recoveries} == {"inplace"}, _why(outcome, cluster)
    world = len(cluster.pods) * 2
    assert sorted(e.get("role") for e in recoveries) == ["spare", *["survivor"] * (world - 1)]
    assert {e.step for e in recoveries} == {15}, "no step lost"
    result = _result(cluster)
    assert (result["steps"], result["world_size"]) == (40, world)
    return result


def test_one_pod_job_replaces_a_killed_rank_in_place_without_restarting_the_pod(
    pod_cluster: MakeCluster, tmp_path: Path
) -> None:
    """A one-node PyTorchJob's container runs the same in-place recovery as `torchrig run`: its torchrun
    agent hosts the store (`TORCHRIG_INPLACE_STORE=agent` in the manifest), a warm spare in the pod takes
    the killed rank's place, the pod never restarts and the run ends bit-identical to an uninterrupted
    local run of the same spec."""
    result = _replace_a_rank_in_place(pod_cluster, 1, "Master", "agent", "spec.nodes.max=1")
    from orchestrator.backends import get_backend
    from orchestrator.backends.base import SubmitOptions
    from orchestrator.loader import load_spec
    from tests.fixtures.common import free_port
    from tests.pods.scenario import EXAMPLE, SCENARIO_SETS

    spec = load_spec(EXAMPLE, [*SCENARIO_SETS, "spec.nodes.max=1", f"spec.metrics.port={free_port()}"])
    reference = get_backend("local").launch(spec, SubmitOptions(run_dir=str(tmp_path / "ref"), quiet=True)).wait(240)
    assert result["params_sha256"] == reference.params_sha256


def test_two_pod_job_replaces_a_killed_rank_in_place_across_pods_without_restarting_a_pod(
    pod_cluster: MakeCluster, reference_result: dict[str, Any]
) -> None:
    """A fixed-size PyTorchJob (Master + Worker pod, 2 ranks each): both agents rendezvous over c10d at
    the Master (`--rdzv-endpoint $(MASTER_ADDR):$(MASTER_PORT)`), in-place recovery shares that store
    (`TORCHRIG_INPLACE_STORE=rdzv`) and the round's token. Rank 3 (the Worker pod) is killed: the
    Worker pod's warm spare takes its place, the ranks in both pods keep their state, no pod restarts,
    and the run ends bit-identical to the uninterrupted `torchrig run --nodes 2` reference."""
    result = _replace_a_rank_in_place(pod_cluster, 3, "Worker", "rdzv", fixed_size=True)
    assert result["params_sha256"] == reference_result["params_sha256"]


@pytest.mark.parametrize("lost", ["rank 0's node", "the other node"])
def test_a_standby_pod_takes_a_lost_nodes_ranks_in_place_and_its_recreated_pod_stands_by(
    pod_cluster: MakeCluster, reference_result: dict[str, Any], lost: str
) -> None:
    """`restarts.spareNodes: 1` on a fixed-size 2-node PyTorchJob: a store-only Master (the c10d store, no
    trainer), the nodes Worker 0 and 1, and a standby Worker 2. Once the standby's spares are warm, a
    node's whole PID namespace is SIGKILLed (a lost node: its ranks and its spare die together). The
    standby takes both of its ranks in place: the other node's ranks keep their state and never restart,
    no step is lost, and the run ends bit-identical to the uninterrupted `torchrig run --nodes 2`. The
    lost node's recreated pod finds the round running and stands by instead of joining the rendezvous
    (which would restart every healthy agent). Either node may be the one lost, the one whose agent
    registered first (rank 0) included: no training node hosts the store any more."""
    slow = '\'[{"kind": "slow", "rank": 0, "step": 5, "seconds": 0.4}]\''
    objects = render(
        "pytorchjob", "spec.nodes.min=2", "spec.restarts.spareNodes=1", f"spec.kubernetes.env.TORCHRIG_FAULTS={slow}"
    )
    job = one(objects, "PyTorchJob")
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    standby, nodes = "digits-ddp-worker-2", ["digits-ddp-worker-0", "digits-ddp-worker-1"]
    store = "digits-ddp-master-0"
    killed: list[tuple[float, str]] = []
    standing_by: list[subprocess.CompletedProcess[str]] = []
    forged: list[subprocess.CompletedProcess[str]] = []

    def kill(cluster: PodCluster, events: list[str]) -> None:
        if killed or "torchrig: standby: ready" not in cluster.pods[standby].logs():
            return
        # Rank 0 prints the progress lines; which node it runs on is the rendezvous' choice.
        rank0 = [n for n in nodes if "torchrig: step " in cluster.pods[n].logs()]
        if len(rank0) != 1:
            return
        victim = rank0[0] if lost == "rank 0's node" else next(n for n in nodes if n != rank0[0])
        standing_by.append(cluster.run_probe(standby, "liveness"))
        # Issue 33: what reaches the store but holds no secret (here a process in the standby's network
        # namespace, which the job's NetworkPolicy admits) writes the records that once ended the job:
        # failed with 1, and succeeded. The store pod ignores both, the job goes on to succeed below.
        forged.append(
            cluster.exec(standby, [sys.executable, "-c", FORGE_JOB_END, cluster.pods[store].ip, "digits-ddp"])
        )
        killed.append((time.time(), victim))
        cluster.kill(victim)
        events.append(f"harness: SIGKILL of {victim}'s PID namespace ({lost})")

    cluster, outcome = _run_pytorchjob(pod_cluster, objects, on_tick=kill)
    assert killed, "the job ended before the standby was ready\n" + _why(outcome, cluster)
    killed_at, victim = [killed[0][0]], killed[0][1]
    assert outcome.status == "Succeeded", _why(outcome, cluster)
    assert cluster.pods[store].exit_codes == [0], "the store pod never restarts"
    assert "passed torchrun's exit barrier" in cluster.pods[store].logs()
    assert forged[0].returncode == 0, forged[0].stderr
    assert "ignored a store value that is no order of this job" in cluster.pods[store].logs()
    survivor = next(n for n in nodes if n != victim)
    assert cluster.pods[survivor].exit_codes == [0], "the surviving node's pod never restarts"
    assert cluster.pods[standby].exit_codes == [0], _why(outcome, cluster)
    assert cluster.pods[victim].exit_codes[0] == 137, _why(outcome, cluster)
    # Issue 40 point 6: the standby runs no exporter until it takes a node, and its liveness probe knows it
    # (it inherited a startup probe that waited for an exporter: killed every ~40 minutes).
    assert standing_by[0].returncode == 0 and "healthy: standing by" in standing_by[0].stdout, standing_by[0]
    probed = (cluster.pods[standby].dir / "logs" / "probe-liveness.log").read_text()
    assert "unhealthy" not in probed, probed
    assert not [e for e in outcome.events if "container killed" in e], _why(outcome, cluster)
    taken = [line for line in cluster.pods[standby].logs().splitlines() if "standby: node" in line]
    assert len(taken) == 1 and "takes its ranks" in taken[0], _why(outcome, cluster)
    recoveries = [e for e in _events(cluster) if e.kind is EventKind.RECOVERY and e.time >= killed_at[0]]
    assert {e.get("path") for e in recoveries} == {"inplace"}, _why(outcome, cluster)
    assert sorted(e.get("role") for e in recoveries) == ["spare", "spare", "survivor", "survivor"]
    # For the record (`pytest -s`; figures belong in docs/performance.md, not in assertions).
    print("recovery seconds by role:", sorted((e.get("role"), e.get("seconds")) for e in recoveries))
    assert len({e.step for e in recoveries}) == 1, "every rank resumed from the same step: none lost"
    assert not [e for e in _events(cluster) if e.kind is EventKind.RESTORE and e.time >= killed_at[0]]
    result = _result(cluster)
    assert (result["steps"], result["world_size"]) == (40, 4)
    # Bit-identical: the standby's ranks compute with torchrun's thread count (OMP_NUM_THREADS=1); with
    # the interpreter's default they differed in the 8th digit.
    assert result["params_sha256"] == reference_result["params_sha256"]
    # The recreated victim stood by: had it joined the rendezvous, every healthy agent would have restarted.
    # Recreated as the job ended, it finds the job over and exits 0 (joining would exit 1: a closed round).
    assert cluster.pods[victim].starts >= 2, _why(outcome, cluster)
    logs = cluster.pods[victim].logs()
    assert "this node stands by" in logs or "the job is over" in logs, _why(outcome, cluster)
    assert cluster.pods[victim].exit_codes[-1] == 0, _why(outcome, cluster)


def test_trainjob_with_two_nodes_trains_like_torchrig_run(
    pod_cluster: MakeCluster, reference_result: dict[str, Any]
) -> None:
    objects = render("trainjob", "spec.nodes.min=2")
    pods = trainjob_pods(objects)
    assert [p.hostname for p in pods] == ["digits-ddp-node-0-0", "digits-ddp-node-0-1"]
    cluster = pod_cluster(objects, pods)
    outcome = run_job(cluster, trainjob_succeeded, timeout_s=JOB_TIMEOUT_S)
    assert outcome.status == "Succeeded", _why(outcome, cluster)
    result = _result(cluster)
    assert (result["steps"], result["world_size"]) == (40, 4)
    assert result["params_sha256"] == reference_result["params_sha256"]


def test_two_node_trainjob_replaces_a_killed_rank_in_place_across_pods_without_failing_a_pod(
    pod_cluster: MakeCluster, reference_result: dict[str, Any]
) -> None:
    """A TrainJob of two nodes that recovers in place rendezvous over c10d at node 0 (the torch plugin's
    `PET_MASTER_ADDR:PET_MASTER_PORT`, whose static rendezvous has no round to share) and shares its store
    (`TORCHRIG_INPLACE_STORE=rdzv`). Rank 3 is killed: node 1's warm spare takes its place, no pod fails
    (a failed pod would fail its Job and restart the whole JobSet), no step is lost, bit-identical."""
    kill = '\'[{"kind": "kill", "rank": 3, "step": 15}]\''
    objects = render("trainjob", "spec.nodes.min=2", f"spec.kubernetes.env.TORCHRIG_FAULTS={kill}")
    pods = trainjob_pods(objects)
    command = pods[0].container["command"]
    assert command[command.index("--rdzv-endpoint") + 1] == "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"
    env = {e["name"]: e.get("value") for e in pods[0].container["env"]}
    assert env["TORCHRIG_INPLACE_STORE"] == "rdzv"
    cluster = pod_cluster(objects, pods)
    outcome = run_job(cluster, trainjob_succeeded, timeout_s=JOB_TIMEOUT_S)
    assert outcome.status == "Succeeded", _why(outcome, cluster)
    assert {n: s.exit_codes for n, s in cluster.pods.items()} == {n: [0] for n in cluster.pods}, "no pod failed"
    recoveries = [e for e in _events(cluster) if e.kind is EventKind.RECOVERY]
    assert {e.get("path") for e in recoveries} == {"inplace"}, _why(outcome, cluster)
    assert sorted(e.get("role") for e in recoveries) == ["spare", "survivor", "survivor", "survivor"]
    assert {e.step for e in recoveries} == {15}, "no step lost"
    result = _result(cluster)
    assert (result["steps"], result["world_size"]) == (40, 4)
    assert result["params_sha256"] == reference_result["params_sha256"]


@dataclass
class RayJobRun:
    cluster: PodCluster
    head: str
    workers: list[str]
    submitter: str
    outcome: JobOutcome  # the submitter Job's (jobs.py run_rayjob)
    status: str  # the Ray job's status on the dashboard after the submitter exited
    logs: str
    status_without_token: str  # the same request without KubeRay's token


@pytest.fixture(scope="module")
def rayjob_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayJobRun]:
    """The RayJob's head, worker group and submitter, run once for the module's tests (1 worker pod)."""
    objects = render("rayjob", "spec.nodes.max=1")
    check_admitted(objects)  # KubeRay's webhook and validation (admission.py), as run_job does for the others
    ray = rayjob_pods(objects)
    assert "ray start --head" in ray.head.container["args"][0] and len(ray.workers) == 1
    assert ray.auth_token, "the RayJob renders no authOptions token mode"
    pods = [ray.head, *ray.workers, ray.submitter]
    cluster = PodCluster(tmp_path_factory.mktemp("rayjob"), [*objects, *ray.secrets], pods)
    with cluster:
        # The submitter once the RayCluster is Ready (KubeRay's readiness probes), replaced if it fails.
        outcome = run_rayjob(cluster, ray, timeout_s=JOB_TIMEOUT_S)
        head_ip = cluster.pods[ray.head.name].ip
        status = _ray_job_status(cluster, ray.submitter.name, head_ip, ray.submission_id, ray.auth_token)
        anonymous = _ray_job_status(cluster, ray.submitter.name, head_ip, ray.submission_id, None)
        logs = "\n".join(f"--- {n}\n{s.logs()[-3000:]}" for n, s in cluster.pods.items())
        workers = [w.name for w in ray.workers]
        yield RayJobRun(cluster, ray.head.name, workers, ray.submitter.name, outcome, status, logs, anonymous)


def test_rayjob_entrypoint_runs_against_a_head_started_from_its_ray_start_params(rayjob_run: RayJobRun) -> None:
    run = rayjob_run
    assert run.outcome.status == "Succeeded" and run.status == "SUCCEEDED", f"{run.status}\n{run.outcome}\n{run.logs}"
    assert any("the RayCluster is Ready" in e for e in run.outcome.events), run.outcome
    for name in [run.head, *run.workers]:
        assert run.cluster.pods[name].proc is not None, f"{name} died:\n{run.logs}"
    result = _result(run.cluster, run.workers)  # rank 0's, in the worker pod's run directory
    assert result["steps"] == 40 and result["world_size"] == 2


def test_rayjob_jobs_api_answers_only_with_kuberays_token(rayjob_run: RayJobRun) -> None:
    """Issue 13 point 11: the rendered RayJob turns on Ray's token authentication (authOptions), so the
    head's dashboard refuses a client without the token KubeRay put in its Secret."""
    assert rayjob_run.status == "SUCCEEDED", rayjob_run.logs
    assert "HTTP Error 401" in rayjob_run.status_without_token, rayjob_run.status_without_token


def test_rayjob_summary_on_the_head_reports_the_run(rayjob_run: RayJobRun) -> None:
    """The driver on the head writes rank 0's result and summary events (carried through Ray from the
    worker pod, whose emptyDir run directory the head does not see) before building summary.json."""
    head_run_dir = _run_dirs_of(rayjob_run.cluster, rayjob_run.head)[0]
    summary = json.loads((head_run_dir / "summary.json").read_text())
    result = _result(rayjob_run.cluster, rayjob_run.workers)
    assert summary["status"] == "succeeded" and summary["ray_auth"] == "token"
    assert summary["steps"] == 40 and summary["params_sha256"] == result["params_sha256"]
    assert summary["final_loss"] == result["final_loss"] and summary["eval"] == result["eval"]
    assert summary["world_sizes"] == [2] and summary["restarts"] == 0 and summary["restored_from"] == []
    assert summary["checkpoints"][0]["last_committed_step"] == 40
    assert json.loads((head_run_dir / "result.json").read_text()) == result


def _ray_job_status(cluster: PodCluster, pod: str, head_ip: str, job_id: str, token: str | None) -> str:
    """The job's status from the dashboard, as the RayJob controller reads it (GetJobInfo), with the
    token in the header KubeRay's dashboard client sends (operators.KR_AUTH_HEADER) when given."""
    url = f"http://{head_ip}:8265/api/jobs/{job_id}"
    headers = {KR_AUTH_HEADER: f"Bearer {token}"} if token else {}
    code = (
        "import json, urllib.request; "
        f"r = urllib.request.Request({url!r}, headers={headers!r}); "
        "print(json.load(urllib.request.urlopen(r, timeout=10))['status'])"
    )
    proc = cluster.exec(pod, ["python3", "-c", code])
    return proc.stdout.strip() or proc.stderr.strip()[-500:]


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
def test_permanent_error_is_not_retried(pod_cluster: MakeCluster, target: str) -> None:
    """A bad task entrypoint fails at once: the pods exit with a code < 128 and are never restarted
    (PyTorchJob `restartPolicy: ExitCode`; TrainJob: the Job's podFailurePolicy FailJob + JobSet FailJobSet)."""
    bad = "spec.task.entrypoint=training.examples.digitz:task"
    if target == "pytorchjob":
        objects = render("pytorchjob", bad)
        replicas = one(objects, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]
        policies = {r: spec.get("restartPolicy") for r, spec in replicas.items()}
        assert set(policies.values()) == {"ExitCode"}, f"replica restartPolicy is {policies}, not ExitCode"
        cluster, outcome = _run_pytorchjob(pod_cluster, objects)
    else:
        objects = render("trainjob", "spec.nodes.min=2", bad)
        cluster = pod_cluster(objects, trainjob_pods(objects))
        outcome = run_job(cluster, trainjob_succeeded, timeout_s=JOB_TIMEOUT_S)
    assert outcome.status == "Failed", _why(outcome, cluster)
    for name, state in cluster.pods.items():
        assert state.starts == 1 and state.incarnation == 0, f"{name} was retried\n{_why(outcome, cluster)}"
        if state.exit_codes:  # a pod may be stopped by the job's failure before it fails itself
            assert 0 < state.exit_codes[0] < 128, _why(outcome, cluster)
        # Not retried inside the pod either: the error is reported once, before torchrun starts.
        assert state.logs().count("torchrig: error:") <= 1, _why(outcome, cluster)
        assert "torch/distributed/run.py" not in state.logs(), _why(outcome, cluster)
