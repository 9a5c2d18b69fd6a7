"""Pod recreations of a PyTorchJob are bounded by `restarts.max` (issue 40 point 5).

The operator's rule, read in kubeflow/training-operator v1.9.4 (4445c12aa62e4345b0c2c6ac9b215a70eca46ed7):
`pkg/controller.v1/common/pod.go` `ReconcilePods` deletes and recreates a Failed pod whose `pytorch`
container exited >= 128 under `restartPolicy: ExitCode` (`pkg/util/train/train_util.go`
`IsRetryableExitCode`), and fails the job on 1-127; the pods run with `restartPolicy: Never`
(`pkg/core/pod.go` `SetRestartPolicy`). `runPolicy.backoffLimit` never stops the recreations:
`pkg/controller.v1/common/job.go` `ReconcileJobs` (lines 175-207) fails the job past it only when
`pkg/core/job.go` `PastBackoffLimit` (lines 93-131: the container `restartCount`s of Running pods, always
0 under `Never`) reaches it, or when `NumRequeues + 1 > backoffLimit`, where `NumRequeues` comes from
`util.FakeWorkQueue` (`pkg/controller.v1/pytorch/pytorchjob_controller.go` line 82,
`pkg/common/util/fake_workqueue.go` line 56: always 0). `training.pod_recreations` keeps the count the
operator does not; these tests check that count, who it applies to, and the job it ends.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from orchestrator.compile import compile as compile_manifests
from orchestrator.loader import load_spec
from tests.fixtures.common import REPO
from tests.pods.kubelet import Pod
from tests.pods.operators import operator_action, pytorchjob_pods, trainjob_pods
from training.config import load_worker_spec
from training.contract import Env, ExitCode
from training.pod_recreations import (
    RECREATIONS_DIR,
    PodRecreations,
    RecreationDecision,
    _maybe_pytorchjob_pod,
    open_for_pod,
    pytorchjob_pod,
    shared_store,
    spec_scope,
)

EXAMPLE = REPO / "examples" / "digits-ddp.yaml"


class FakeStore:
    """The three store calls the count makes, on a dict; `create_exclusive` refuses an existing name."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.calls = 0

    def list_dir(self, rel: str) -> list[str]:
        self.calls += 1
        prefix = rel.rstrip("/") + "/"
        return sorted({k[len(prefix) :].split("/")[0] for k in self.objects if k.startswith(prefix)})

    def create_exclusive(self, rel: str, data: bytes) -> None:
        self.calls += 1
        if rel in self.objects:
            raise FileExistsError(rel)
        self.objects[rel] = data

    def delete_dir(self, rel: str) -> None:
        self.calls += 1
        for key in [k for k in self.objects if k.startswith(rel.rstrip("/") + "/")]:
            del self.objects[key]


def _ledger(store: FakeStore, scope: bytes = b"spec") -> PodRecreations:
    return PodRecreations(store, "job", spec_scope(scope), timeout_s=5.0)


# -- the count ---------------------------------------------------------------------------------------


def test_each_start_of_a_pod_is_numbered_and_the_one_past_restarts_max_recreations_is_spent() -> None:
    count = _ledger(FakeStore())
    decisions = [count.record_start("job-worker-0", allowed=2) for _ in range(4)]
    assert [d.start for d in decisions] == [1, 2, 3, 4]
    assert [d.recreations for d in decisions] == [0, 1, 2, 3]
    assert [d.spent for d in decisions] == [False, False, False, True]


def test_restarts_max_zero_allows_the_first_start_only() -> None:
    count = _ledger(FakeStore())
    assert not count.record_start("job-master-0", allowed=0).spent
    assert count.record_start("job-master-0", allowed=0).spent


def test_pods_are_counted_apart_so_a_lost_store_host_costs_each_pod_one_restart() -> None:
    count = _ledger(FakeStore())
    pods = ["job-master-0", "job-worker-0", "job-worker-1"]
    for _ in range(3):  # three losses of the rendezvous host: every pod recreated each time
        last = {pod: count.record_start(pod, allowed=3) for pod in pods}
    assert {d.recreations for d in last.values()} == {2}
    assert not any(d.spent for d in last.values())
    # One pod failing alone spends only its own budget.
    for _ in range(2):
        alone = count.record_start("job-worker-1", allowed=3)
    assert alone.spent and not count.record_start("job-worker-0", allowed=3).spent


def test_a_changed_job_file_starts_a_new_count_and_reset_clears_every_count_of_the_job() -> None:
    store = FakeStore()
    old, new = _ledger(store, b"image: a"), _ledger(store, b"image: b")
    for _ in range(3):
        old.record_start("job-worker-0", allowed=1)
    assert new.record_start("job-worker-0", allowed=1).start == 1
    other = PodRecreations(store, "other", spec_scope(b"image: a"))
    other.record_start("other-worker-0", allowed=1)
    old.reset()
    assert old.record_start("job-worker-0", allowed=1).start == 1
    assert new.record_start("job-worker-0", allowed=1).start == 1  # its scope went with the job's reset
    assert other.record_start("other-worker-0", allowed=1).start == 2  # another job's count is untouched
    assert all(k.startswith(f"{RECREATIONS_DIR}/") for k in store.objects)


def test_a_job_submitted_again_identical_with_a_new_secret_starts_from_zero(tmp_path: Any) -> None:
    """Each `torchrig submit` / `helm install` makes the job's Secret anew: the same job file deleted and
    submitted again is a new count; its pods recreated under the same Secret share one."""
    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: torchrig/v1\nkind: TrainingJob\nmetadata: {name: job}\nspec:\n"
        "  task: {entrypoint: training.examples.digits:task}\n  training: {steps: 1}\n"
        "  checkpoint:\n    stores:\n      - {uri: 'file://./shared', pvc: claim}\n"
    )
    spec = load_worker_spec(path)

    def start(secret: bytes) -> int:
        (tmp_path / "secret").write_bytes(secret)
        env = {Env.MASTER_ADDR: "job-master-0", Env.JOB_SECRET_FILE: str(tmp_path / "secret")}
        opened = open_for_pod(
            spec, path.read_bytes(), run_dir=str(tmp_path), env=env, hostname="job-worker-0", warn=print
        )
        assert opened is not None
        return opened[0].record_start("job-worker-0", allowed=3).start

    first, second = b"a" * 64, b"b" * 64
    assert [start(first), start(first)] == [1, 2]  # one submission: its pod recreated once
    assert start(second) == 1  # deleted, submitted again: a new Secret, a new count
    assert spec_scope(b"spec", first) != spec_scope(b"spec", second) != spec_scope(b"spec")
    assert first.hex() not in spec_scope(b"spec", first)


def test_a_start_number_taken_meanwhile_moves_to_the_next() -> None:
    store = FakeStore()
    count = _ledger(store)
    count.record_start("job-worker-0", allowed=5)
    real_create = store.create_exclusive

    def racing(rel: str, data: bytes) -> None:
        if rel.endswith("00000002.json") and rel not in store.objects:
            real_create(rel, b"{}")  # a straggler of the deleted pod took number 2 between list and create
        real_create(rel, data)

    store.create_exclusive = racing  # type: ignore[method-assign]
    assert count.record_start("job-worker-0", allowed=5).start == 3


def test_names_in_the_store_that_are_not_start_records_are_ignored_and_a_hostile_number_is_refused() -> None:
    store = FakeStore()
    count = _ledger(store)
    where = f"{RECREATIONS_DIR}/job/{spec_scope(b'spec')}/job-worker-0"
    for junk in ("notes.txt", "7.json", "000000007.json", "0000000x.json", "../00000009.json"):
        store.objects[f"{where}/{junk}"] = b""
    assert count.record_start("job-worker-0", allowed=1).start == 1
    store.objects[f"{where}/99999999.json"] = b""
    with pytest.raises(ValueError, match="exhausted"):
        count.record_start("job-worker-0", allowed=1)


class LedgerMachine(RuleBasedStateMachine):
    """Random schedules of pod starts, stragglers, junk written into the store and job ends, against a
    model: each pod's count is its starts since the job's count was last cleared, whatever else the store
    holds, and a start is refused exactly when it is one recreation past `allowed`."""

    pods = ("job-master-0", "job-worker-0", "job-worker-1")

    def __init__(self) -> None:
        super().__init__()
        self.store = FakeStore()
        self.count = _ledger(self.store)
        self.model = dict.fromkeys(self.pods, 0)

    @rule(pod=st.sampled_from(pods), allowed=st.integers(0, 4))
    def start(self, pod: str, allowed: int) -> None:
        decision = self.count.record_start(pod, allowed)
        self.model[pod] += 1
        assert decision.start == self.model[pod]
        assert decision.spent == (self.model[pod] - 1 > allowed)

    @rule(pod=st.sampled_from(pods))
    def straggler(self, pod: str) -> None:
        # A start of the same name from a pod the operator already replaced: it takes the next number.
        PodRecreations(self.store, "job", self.count.scope).record_start(pod, 0)
        self.model[pod] += 1

    @rule(pod=st.sampled_from(pods), name=st.text(min_size=1, max_size=12).filter(lambda n: "/" not in n))
    def junk(self, pod: str, name: str) -> None:
        if re.fullmatch(r"\d{8}\.json", name) is None:
            self.store.objects[f"{RECREATIONS_DIR}/job/{self.count.scope}/{pod}/{name}"] = b"junk"

    @rule()
    def job_ends(self) -> None:
        self.count.reset()
        self.model = dict.fromkeys(self.pods, 0)

    @invariant()
    def counts_match(self) -> None:
        for pod in self.pods:
            assert self.count.starts(pod) == self.model[pod]


TestLedgerMachine = LedgerMachine.TestCase


def test_a_store_that_hangs_is_given_up_after_the_timeout() -> None:
    release = threading.Event()

    class Hanging(FakeStore):
        def list_dir(self, rel: str) -> list[str]:
            release.wait(30)
            return []

    count = PodRecreations(Hanging(), "job", "scope", timeout_s=0.2)
    try:
        with pytest.raises(TimeoutError):
            count.record_start("job-worker-0", allowed=1)
    finally:
        release.set()


def test_the_message_is_one_line_naming_the_field_the_pod_and_how_to_resubmit() -> None:
    text = RecreationDecision(job="job", pod="job-worker-1", start=5, allowed=3).message()
    assert "\n" not in text
    assert text.startswith("spec.restarts.max: pod job-worker-1 has been recreated 4 times and restarts.max allows 3")
    assert "resubmit" in text and "kubectl describe pytorchjob job" in text


# -- who is counted ----------------------------------------------------------------------------------


def _pods(*sets: str, fixed_size: bool = False) -> list[Pod]:
    spec = load_spec(EXAMPLE, list(sets))
    return pytorchjob_pods(compile_manifests(spec, "pytorchjob", fixed_size=fixed_size))


def _plain_env(pod: Pod) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod.container.get("env", []) if "value" in e}


@pytest.mark.parametrize(
    ("sets", "fixed_size"),
    [
        ((), False),  # elastic: Workers only, PET_RDZV_ENDPOINT=<job>-worker-0:<port>
        ((), True),  # fixed size: Master + Workers, MASTER_ADDR=<job>-master-0
        (("spec.nodes.min=3", "spec.nodes.max=3", "spec.restarts.spareNodes=2"), False),  # standby Workers
    ],
    ids=["elastic", "fixed-size", "standby"],
)
def test_every_pod_the_pytorchjob_operator_creates_is_counted_under_its_own_name(
    sets: tuple[str, ...], fixed_size: bool
) -> None:
    pods = [p for p in _pods(*sets, fixed_size=fixed_size) if "training.launch" in " ".join(p.container["command"])]
    assert len(pods) >= 2
    for pod in pods:
        assert pytorchjob_pod("digits-ddp", _plain_env(pod), pod.hostname) == pod.name


def test_a_trainjob_pod_is_not_counted_its_jobset_counts_restarts() -> None:
    spec = load_spec(EXAMPLE, ["spec.nodes.min=2"])
    for pod in trainjob_pods(compile_manifests(spec, "trainjob")):
        assert pytorchjob_pod("digits-ddp", _plain_env(pod), pod.hostname) is None


_JOB = st.from_regex(r"[a-z]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)


@given(job=_JOB, host=st.text(max_size=40), addr=st.text(max_size=40))
def test_a_host_that_is_not_the_operators_pod_name_is_never_counted(job: str, host: str, addr: str) -> None:
    env = {Env.MASTER_ADDR: addr, "PET_RDZV_ENDPOINT": addr}
    pod = pytorchjob_pod(job, env, host)
    if pod is not None:
        assert _maybe_pytorchjob_pod(env, host), "the quick check (without the job's name) never rules out a pod"
        assert pod == host
        kind, index = host[len(job) + 1 :].rsplit("-", 1)
        assert host.startswith(f"{job}-") and kind in ("master", "worker") and index.isdigit()
        assert addr == f"{job}-master-0" or addr.startswith(f"{job}-worker-0:")


@given(job=_JOB, kind=st.sampled_from(["master", "worker"]), index=st.integers(0, 9999), other=_JOB)
def test_the_operators_pod_name_is_counted_only_with_the_operators_rendezvous_host(
    job: str, kind: str, index: int, other: str
) -> None:
    host = f"{job}-{kind}-{index}"
    for env in ({Env.MASTER_ADDR: f"{job}-master-0"}, {"PET_RDZV_ENDPOINT": f"{job}-worker-0:23456"}):
        assert pytorchjob_pod(job, env, host) == host and _maybe_pytorchjob_pod(env, host)
    assert pytorchjob_pod(job, {}, host) is None  # a local run on a machine of that name
    assert not _maybe_pytorchjob_pod({}, host)  # (a local agent's end loads no spec to find that out)
    if other != job:
        assert pytorchjob_pod(job, {Env.MASTER_ADDR: f"{other}-master-0"}, host) is None
        assert pytorchjob_pod(other, {Env.MASTER_ADDR: f"{job}-master-0"}, host) is None


def test_the_count_lives_in_the_first_store_that_outlives_a_pod(tmp_path: Any) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: torchrig/v1\nkind: TrainingJob\nmetadata: {name: job}\nspec:\n"
        "  task: {entrypoint: training.examples.digits:task}\n  training: {steps: 1}\n"
        "  checkpoint:\n    stores:\n      - {uri: 'file://./local'}\n      - {uri: 'file://./shared', pvc: claim}\n"
    )
    spec = load_worker_spec(path)
    found = shared_store(spec)
    assert found is not None and found[0] == 1
    env = {Env.MASTER_ADDR: "job-master-0"}
    warned: list[str] = []
    opened = open_for_pod(
        spec, path.read_bytes(), run_dir=str(tmp_path), env=env, hostname="job-worker-0", warn=warned.append
    )
    assert opened is not None and opened[1] == "job-worker-0" and not warned
    opened[0].record_start("job-worker-0", allowed=1)
    assert list((tmp_path / "shared" / RECREATIONS_DIR / "job").rglob("00000001.json"))
    # Only pod-local stores: nothing outlives the pod, which the launcher says in a warning.
    path.write_text(path.read_text().replace(", pvc: claim", ""))
    spec = load_worker_spec(path)
    assert shared_store(spec) is None
    got = open_for_pod(spec, b"", run_dir=str(tmp_path), env=env, hostname="job-worker-0", warn=warned.append)
    assert got is None and len(warned) == 1 and "not counted" in warned[0]


# -- the operator's rule, and the job it now ends ----------------------------------------------------


def past_backoff_limit(backoff_limit: int, running_restart_counts: list[int]) -> bool:
    """TO pkg/core/job.go PastBackoffLimit: the restartCounts of Running pods against the limit."""
    total = sum(running_restart_counts)
    return total > 0 if backoff_limit == 0 else total >= backoff_limit


def exceeds_backoff_limit(backoff_limit: int, num_requeues: int, new_failure: bool, active: int, total: int) -> bool:
    """TO pkg/controller.v1/common/job.go ReconcileJobs (lines 192-198)."""
    return new_failure and active != total and num_requeues + 1 > backoff_limit


def _run_until_the_operator_stops(
    pods: list[Pod], store: FakeStore, restarts_max: int, cap: int
) -> Iterator[tuple[int, str]]:
    """Start the first pod, let its container exit 137 (an OOM kill) whenever the launcher lets it run, and
    do what the operator does after each exit: `ReconcilePods` (`operator_action`), then `ReconcileJobs`'
    backoff checks with what it can see. Yields (exit code, action)."""
    pod, others = pods[0], len(pods) - 1
    env = _plain_env(pod)
    for _ in range(cap):
        assert pytorchjob_pod("digits-ddp", env, pod.hostname) == pod.name
        decision = PodRecreations(store, "digits-ddp", spec_scope(b"digits")).record_start(pod.name, restarts_max)
        code = int(ExitCode.RESTARTS_SPENT) if decision.spent else 137
        action = operator_action(pod, code)
        # Pods under restartPolicy Never never restart a container in place: every Running pod shows
        # restartCount 0; NumRequeues is FakeWorkQueue's 0; the failed pod is not active.
        backoff = past_backoff_limit(restarts_max, [0] * others) or exceeds_backoff_limit(
            restarts_max, 0, new_failure=True, active=others, total=len(pods)
        )
        if backoff:
            action = "fail-job"
        yield code, action
        if action != "recreate":
            return


def test_the_operators_backoff_limit_counts_only_in_place_container_restarts() -> None:
    # The rule the recreations slip through: an OnFailure pod's restarts count, a recreated pod's do not.
    assert past_backoff_limit(3, [2, 1]) and not past_backoff_limit(3, [0, 0, 0])
    assert exceeds_backoff_limit(0, 0, new_failure=True, active=1, total=2)
    assert not any(exceeds_backoff_limit(limit, 0, True, 1, 2) for limit in range(1, 10))


@pytest.mark.parametrize("restarts_max", [0, 1, 3])
def test_a_pod_killed_at_every_start_ends_the_job_after_restarts_max_recreations(restarts_max: int) -> None:
    objects = compile_manifests(load_spec(EXAMPLE, [f"spec.restarts.max={restarts_max}"]), "pytorchjob")
    job = next(o for o in objects if o["kind"] == "PyTorchJob")
    assert job["spec"]["runPolicy"]["backoffLimit"] == restarts_max  # rendered, yet it bounds nothing
    pods = pytorchjob_pods(objects)
    assert all(p.replica_policy == "ExitCode" and p.restart_policy == "Never" for p in pods)
    history = list(_run_until_the_operator_stops(pods, FakeStore(), restarts_max, cap=50))
    if restarts_max == 0:  # the one case the operator's own check catches (NumRequeues + 1 > 0)
        assert history == [(137, "fail-job")]
    else:
        assert history == [(137, "recreate")] * (restarts_max + 1) + [(int(ExitCode.RESTARTS_SPENT), "fail-job")]


def test_restarts_spent_is_permanent_for_the_operator() -> None:
    assert not ExitCode.RESTARTS_SPENT.retryable and 1 <= ExitCode.RESTARTS_SPENT <= 127


# -- the launcher ------------------------------------------------------------------------------------


@pytest.fixture
def in_worker_pod(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A job file (restarts.max 1, a store on a `pvc`) and this process dressed as pod `job-worker-0`."""
    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: torchrig/v1\nkind: TrainingJob\nmetadata: {name: job}\nspec:\n"
        "  task: {entrypoint: training.examples.digits:task, args: {hidden: 8}}\n  training: {steps: 1}\n"
        "  restarts: {max: 1}\n  checkpoint:\n    stores:\n      - {uri: 'file://./ckpt', pvc: claim}\n"
    )
    monkeypatch.setattr("socket.gethostname", lambda: "job-worker-0")
    monkeypatch.setenv(Env.MASTER_ADDR, "job-master-0")
    return path


def _launch(path: Any, *command: str) -> int:
    from training.launch import main

    return main(["--spec", str(path), "--run-dir", str(path.parent / "run"), *(["--", *command] if command else [])])


def _starts(path: Any) -> int:
    ledger = path.parent / "run" / "ckpt" / RECREATIONS_DIR / "job"
    return len(list(ledger.rglob("*.json"))) if ledger.exists() else 0


def _spend(path: Any, starts: int) -> None:
    store = open_for_pod(
        load_worker_spec(path),
        path.read_bytes(),
        run_dir=str(path.parent / "run"),
        env={Env.MASTER_ADDR: "job-master-0"},
        hostname="job-worker-0",
        warn=print,
    )
    assert store is not None
    for _ in range(starts):
        store[0].record_start("job-worker-0", allowed=1)


def test_the_launcher_refuses_the_start_past_restarts_max_and_clears_the_count(
    in_worker_pod: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _spend(in_worker_pod, 2)  # the first start and one recreation: restarts.max (1) spent
    assert _launch(in_worker_pod, "sh", "-c", "exit 137") == ExitCode.RESTARTS_SPENT
    err = capsys.readouterr().err.splitlines()
    assert err == [f"torchrig: error: {RecreationDecision('job', 'job-worker-0', 3, 1).message()}"]
    assert _starts(in_worker_pod) == 0  # the job ends here: a resubmitted one starts from 0


def test_any_permanent_exit_of_the_launcher_clears_the_count(in_worker_pod: Any) -> None:
    _spend(in_worker_pod, 1)
    assert _launch(in_worker_pod, "no-such-torchrun") == ExitCode.ENVIRONMENT  # counted, then the job ends
    assert _starts(in_worker_pod) == 0


def test_checking_without_a_command_is_no_pod_start(in_worker_pod: Any) -> None:
    for _ in range(3):  # `kubectl exec POD -- python -m training.launch`: only checks
        assert _launch(in_worker_pod) == ExitCode.OK
    assert _starts(in_worker_pod) == 0


def test_a_job_that_succeeded_forgets_its_pod_starts(in_worker_pod: Any) -> None:
    """torchrig's torchrun agent returns 0 only once every agent passed the exit barrier: the job
    succeeded, and the same job resubmitted under its name (its checkpoint store kept) must start its
    count from 0, not inherit the recreations of the run that succeeded."""
    from training.torchrun import run_agent

    _spend(in_worker_pod, 2)  # restarts.max (1) spent by the run that goes on to succeed
    env = {
        Env.SPEC: str(in_worker_pod),
        Env.RUN_DIR: str(in_worker_pod.parent / "run"),
        Env.MASTER_ADDR: "job-master-0",
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        assert run_agent(lambda args: None, ["--nproc-per-node", "1", "-m", "training"]) == 0
    assert _starts(in_worker_pod) == 0
    assert _launch(in_worker_pod) == ExitCode.OK
