"""The kubernetes backend against a fake API server on 127.0.0.1 (no real cluster can run here).

What users rely on: every object is dry-run server-side before anything is created, what is sent
is valid against the real CRD schemas, a missing CRD / kubeconfig / server or a duplicate gives one
clear line, and status/logs/cancel/list/delete_pod talk to the right endpoints.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from orchestrator.backends import get_backend
from orchestrator.backends.base import KubernetesOptions, RunState, SubmitOptions
from orchestrator.backends.kubernetes import JOB_LABEL, KubernetesBackend
from orchestrator.errors import BackendError
from orchestrator.loader import load_spec
from orchestrator.spec import JobSpec
from tests import crds
from tests.fixtures.common import REPO, free_port
from tests.fixtures.k8s_fake import FakeKubeAPI, write_kubeconfig

pytestmark = pytest.mark.timeout(60)

PYTORCHJOB = "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs"
CONFIGMAPS = "/api/v1/namespaces/default/configmaps"


@pytest.fixture
def spec() -> JobSpec:
    return load_spec(REPO / "examples" / "digits-ddp.yaml")


@pytest.fixture
def backend(k8s_kubeconfig: Path) -> KubernetesBackend:
    return KubernetesBackend(kubeconfig=str(k8s_kubeconfig))


def test_registry_finds_the_kubernetes_backend() -> None:
    assert isinstance(get_backend("kubernetes"), KubernetesBackend)


def test_submit_dry_runs_every_object_server_side_before_creating_any(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    handle = backend.submit(spec, SubmitOptions(monitoring=True))

    posts = k8s_fake_server.sent("POST")
    kinds = [r.body["kind"] for r in posts]
    # The job last: its companions exist before its pods start.
    assert kinds == ["Secret", "ConfigMap", "NetworkPolicy", "PodMonitor", "PrometheusRule", "PyTorchJob"] * 2
    assert [r.dry_run for r in posts] == [True] * 6 + [False] * 6
    # Strict field validation and a field manager on every write.
    assert all(r.query.get("fieldValidation") == "Strict" and r.query.get("fieldManager") == "torchrig" for r in posts)
    assert posts[5].path == PYTORCHJOB and posts[1].path == CONFIGMAPS
    assert str(handle) == "kubernetes://default/pytorchjob/digits-ddp"
    assert k8s_fake_server.stored("pytorchjobs")[0]["metadata"]["labels"][JOB_LABEL] == "digits-ddp"


def test_every_object_sent_validates_against_the_real_crd_schemas(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    backend.submit(spec, SubmitOptions(monitoring=True))
    fixed = spec.model_copy(deep=True)
    fixed.spec.kubernetes.target = "trainjob"
    fixed.metadata.name = "digits-tj"
    backend.submit(fixed, SubmitOptions(fixed_size=True))
    bodies = [r.body for r in k8s_fake_server.sent("POST")]
    assert {b["kind"] for b in bodies} >= {
        "ConfigMap",
        "PyTorchJob",
        "TrainJob",
        "TrainingRuntime",  # namespaced, the job's own (issue 13 point 12)
        "PodMonitor",
    }
    for body in bodies:
        assert crds.problems(body) == [], body["kind"]


def test_dry_run_flag_stops_after_the_server_side_dry_run(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    handle = backend.submit(spec, SubmitOptions(dry_run=True))
    assert k8s_fake_server.sent("POST", dry_run=False) == []
    assert len(k8s_fake_server.sent("POST", dry_run=True)) == 4
    assert k8s_fake_server.objects == {}
    assert [m["kind"] for m in handle.info["manifests"]] == ["Secret", "ConfigMap", "NetworkPolicy", "PyTorchJob"]
    assert handle.info["objects"] == [
        "Secret default/digits-ddp-job-secret",
        "ConfigMap default/digits-ddp-spec",
        "NetworkPolicy default/digits-ddp",
        "PyTorchJob default/digits-ddp",
    ]
    # What a dry run hands back names the Secret but holds no value.
    assert "data" not in handle.info["manifests"][0]


def test_missing_crd_is_one_clear_line_and_nothing_is_created(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    k8s_fake_server.mark_not_installed("kubeflow.org", "v1")
    with pytest.raises(BackendError) as err:
        backend.submit(spec)
    assert str(err.value) == (
        "PyTorchJob CRD (kubeflow.org/v1) is not installed in the cluster: install the training operator, "
        "see docs/operations.md"
    )
    assert k8s_fake_server.sent("POST", dry_run=False) == []
    assert k8s_fake_server.objects == {}


def test_missing_trainjob_crd_names_kubeflow_trainer(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    k8s_fake_server.mark_not_installed("trainer.kubeflow.org", "v1alpha1")
    spec.spec.kubernetes.target = "trainjob"
    with pytest.raises(BackendError, match=r"^TrainingRuntime CRD \(trainer.kubeflow.org/v1alpha1\) is not"):
        backend.submit(spec, SubmitOptions(fixed_size=True))
    assert k8s_fake_server.objects == {}


def test_duplicate_job_is_a_clear_conflict(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    backend.submit(spec)
    created = len(k8s_fake_server.sent("POST", dry_run=False))
    with pytest.raises(BackendError, match=r"PyTorchJob default/digits-ddp: already exists; cancel the old run first"):
        backend.submit(spec)
    assert len(k8s_fake_server.sent("POST", dry_run=False)) == created


def test_leftover_spec_configmap_of_a_finished_job_is_replaced(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    # A TTL-deleted PyTorchJob leaves its ConfigMap behind; re-submitting the same job must work.
    k8s_fake_server.add("", "v1", "configmaps", {"metadata": {"name": "digits-ddp-spec", "namespace": "default"}})
    backend.submit(spec)
    deletes = k8s_fake_server.sent("DELETE")
    assert [r.path for r in deletes] == [f"{CONFIGMAPS}/digits-ddp-spec"]
    assert "job.yaml" in str(k8s_fake_server.stored("configmaps")[0].get("data"))


def test_namespace_option_and_missing_namespace(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    with pytest.raises(BackendError, match=r"namespace does not exist"):
        backend.submit(spec, SubmitOptions(kubernetes=KubernetesOptions(namespace="ml")))
    k8s_fake_server.namespaces.add("ml")
    handle = backend.submit(spec, SubmitOptions(kubernetes=KubernetesOptions(namespace="ml")))
    assert handle.run_id == "ml/pytorchjob/digits-ddp"
    assert all("/namespaces/ml/" in r.path for r in k8s_fake_server.sent("POST", dry_run=False))


def test_missing_kubeconfig(tmp_path: Path, spec: JobSpec) -> None:
    backend = KubernetesBackend(kubeconfig=str(tmp_path / "nope"))
    with pytest.raises(BackendError, match=r"^no usable kubeconfig: .*\(set KUBECONFIG or --context\)$"):
        backend.submit(spec)


def test_unknown_context(k8s_kubeconfig: Path, spec: JobSpec) -> None:
    backend = KubernetesBackend(kubeconfig=str(k8s_kubeconfig))
    with pytest.raises(BackendError, match=r"^no usable kubeconfig"):
        backend.submit(spec, SubmitOptions(kubernetes=KubernetesOptions(context="prod")))


def test_nothing_listening(tmp_path: Path, spec: JobSpec) -> None:
    config = write_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(BackendError, match=r"digits-ddp-job-secret: cannot reach the Kubernetes API server"):
        KubernetesBackend(kubeconfig=str(config)).submit(spec)


def _job(name: str, conditions: list[dict[str, str]], target: str = "pytorchjobs") -> dict[str, object]:
    return {
        "apiVersion": "kubeflow.org/v1" if target == "pytorchjobs" else "trainer.kubeflow.org/v1alpha1",
        "kind": "PyTorchJob" if target == "pytorchjobs" else "TrainJob",
        "metadata": {"name": name, "namespace": "default", "labels": {"app.kubernetes.io/managed-by": "torchrig"}},
        "status": {"conditions": conditions},
    }


@pytest.mark.parametrize(
    ("conditions", "state"),
    [
        ([], RunState.PENDING),
        ([{"type": "Created", "status": "True"}], RunState.PENDING),
        ([{"type": "Created", "status": "True"}, {"type": "Running", "status": "True"}], RunState.RUNNING),
        ([{"type": "Running", "status": "False"}, {"type": "Restarting", "status": "True"}], RunState.RUNNING),
        ([{"type": "Running", "status": "False"}, {"type": "Succeeded", "status": "True"}], RunState.SUCCEEDED),
        ([{"type": "Failed", "status": "True", "message": "restarts exhausted"}], RunState.FAILED),
    ],
)
def test_status_maps_pytorchjob_conditions(
    backend: KubernetesBackend, k8s_fake_server: FakeKubeAPI, conditions: list[dict[str, str]], state: RunState
) -> None:
    k8s_fake_server.add("kubeflow.org", "v1", "pytorchjobs", _job("digits-ddp", conditions))
    status = backend.status("kubernetes://default/pytorchjob/digits-ddp")
    assert status.state is state
    # The short form finds the job whatever its kind.
    assert backend.status("default/digits-ddp").state is state


def test_status_of_a_trainjob_and_of_a_missing_job(backend: KubernetesBackend, k8s_fake_server: FakeKubeAPI) -> None:
    job = _job("tj", [{"type": "Complete", "status": "True"}], target="trainjobs")
    k8s_fake_server.add("trainer.kubeflow.org", "v1alpha1", "trainjobs", job)
    assert backend.status("default/tj").state is RunState.SUCCEEDED
    with pytest.raises(BackendError, match=r"no PyTorchJob or TrainJob named 'gone' in namespace 'default'"):
        backend.status("default/gone")
    with pytest.raises(BackendError, match=r"not found"):
        backend.status("default/pytorchjob/gone")


def _seed_pods(fake: FakeKubeAPI) -> None:
    base = {JOB_LABEL: "digits-ddp"}
    fake.add_pod(
        "default",
        "digits-ddp-master-0",
        {**base, "training.kubeflow.org/replica-type": "master", "training.kubeflow.org/replica-index": "0"},
        "master line 1\nmaster line 2\n",
    )
    fake.add_pod(
        "default",
        "digits-ddp-worker-0",
        {**base, "training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": "0"},
        "worker line\n",
    )
    fake.add_pod("default", "other-master-0", {JOB_LABEL: "other"}, "not ours\n")


def test_logs_by_node_index_and_all(backend: KubernetesBackend, k8s_fake_server: FakeKubeAPI) -> None:
    _seed_pods(k8s_fake_server)
    assert list(backend.logs("default/pytorchjob/digits-ddp", rank=1)) == ["worker line"]
    assert list(backend.logs("default/pytorchjob/digits-ddp", rank=0, follow=True)) == [
        "master line 1",
        "master line 2",
    ]
    assert list(backend.logs("default/pytorchjob/digits-ddp")) == [
        "[digits-ddp-master-0] master line 1",
        "[digits-ddp-master-0] master line 2",
        "[digits-ddp-worker-0] worker line",
    ]
    follow = [r for r in k8s_fake_server.sent("GET") if r.path.endswith("/log") and r.query.get("follow") == "true"]
    assert len(follow) == 1
    assert any(r.query.get("labelSelector") == f"{JOB_LABEL}=digits-ddp" for r in k8s_fake_server.sent("GET"))
    with pytest.raises(BackendError, match=r"no pod for node index 5"):
        list(backend.logs("default/pytorchjob/digits-ddp", rank=5))


def test_cancel_deletes_job_foreground_and_its_companions(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    backend.submit(spec, SubmitOptions(monitoring=True))
    status = backend.cancel("kubernetes://default/pytorchjob/digits-ddp")
    assert status.state is RunState.CANCELLED
    deletes = k8s_fake_server.sent("DELETE")
    assert deletes[0].path == f"{PYTORCHJOB}/digits-ddp"
    policy = deletes[0].query.get("propagationPolicy") or (deletes[0].body or {}).get("propagationPolicy")
    assert policy == "Foreground"
    assert k8s_fake_server.objects == {}
    # And the same job can be submitted again right away.
    backend.submit(spec, SubmitOptions(monitoring=True))


def test_list_selects_torchrig_jobs(backend: KubernetesBackend, k8s_fake_server: FakeKubeAPI) -> None:
    k8s_fake_server.add("kubeflow.org", "v1", "pytorchjobs", _job("a", [{"type": "Running", "status": "True"}]))
    other = _job("b", [])
    other["metadata"] = {"name": "b", "namespace": "default", "labels": {}}
    k8s_fake_server.add("kubeflow.org", "v1", "pytorchjobs", other)
    k8s_fake_server.mark_not_installed("trainer.kubeflow.org", "v1alpha1")  # one operator only: still lists
    runs = backend.list_runs()
    assert [(str(r.handle), r.state) for r in runs] == [("kubernetes://default/pytorchjob/a", RunState.RUNNING)]
    lists = [r for r in k8s_fake_server.sent("GET") if r.path == "/apis/kubeflow.org/v1/pytorchjobs"]
    assert lists[0].query["labelSelector"] == "app.kubernetes.io/managed-by=torchrig"


def test_delete_pod_kills_the_pod_of_a_node(backend: KubernetesBackend, k8s_fake_server: FakeKubeAPI) -> None:
    _seed_pods(k8s_fake_server)
    assert backend.delete_pod("default/pytorchjob/digits-ddp", 1) == "digits-ddp-worker-0"
    delete = k8s_fake_server.sent("DELETE")[0]
    assert delete.path == "/api/v1/namespaces/default/pods/digits-ddp-worker-0"
    assert [p["metadata"]["name"] for p in k8s_fake_server.stored("pods")] == ["digits-ddp-master-0", "other-master-0"]


RUNTIMES = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainingruntimes"


def _trainjob_spec(spec: JobSpec) -> JobSpec:
    tj = spec.model_copy(deep=True)
    tj.spec.kubernetes.target = "trainjob"
    tj.metadata.name = "digits-tj"
    return tj


def test_a_leftover_runtime_is_replaced_only_when_no_trainjob_uses_it(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    """Issue 13.12: a runtime another TrainJob references is never deleted; an unused leftover is replaced."""
    runtime = {"metadata": {"name": "torchrig-digits-tj", "namespace": "default"}, "spec": {}}
    k8s_fake_server.add("trainer.kubeflow.org", "v1alpha1", "trainingruntimes", runtime)
    user = {
        "metadata": {"name": "someone-else", "namespace": "default"},
        "spec": {"runtimeRef": {"kind": "TrainingRuntime", "name": "torchrig-digits-tj"}},
    }
    k8s_fake_server.add("trainer.kubeflow.org", "v1alpha1", "trainjobs", user)
    with pytest.raises(BackendError, match=r"TrainJob default/someone-else still uses it; it is not replaced"):
        backend.submit(_trainjob_spec(spec), SubmitOptions(fixed_size=True))
    assert k8s_fake_server.sent("DELETE") == [] and k8s_fake_server.sent("POST", dry_run=False) == []

    k8s_fake_server.objects.clear()
    k8s_fake_server.add("trainer.kubeflow.org", "v1alpha1", "trainingruntimes", runtime)
    backend.submit(_trainjob_spec(spec), SubmitOptions(fixed_size=True))
    assert [r.path for r in k8s_fake_server.sent("DELETE")] == [f"{RUNTIMES}/torchrig-digits-tj"]


def test_beside_a_store_only_master_worker_i_is_node_i(
    backend: KubernetesBackend, k8s_fake_server: FakeKubeAPI
) -> None:
    """Standby nodes: the Master only hosts the rendezvous store, so `--rank 0` / the drills' node 0 is
    worker-0, and the store pod is no node (its log comes last in the whole job's)."""
    from orchestrator.compile.pytorchjob import STORE_POD_LABEL

    base = {JOB_LABEL: "digits-ddp", STORE_POD_LABEL[0]: STORE_POD_LABEL[1]}
    for rtype, index, line in [("master", 0, "store line"), ("worker", 0, "node 0 line"), ("worker", 1, "node 1 line")]:
        labels = {"training.kubeflow.org/replica-type": rtype, "training.kubeflow.org/replica-index": str(index)}
        k8s_fake_server.add_pod("default", f"digits-ddp-{rtype}-{index}", {**base, **labels}, line + "\n")
    assert list(backend.logs("default/pytorchjob/digits-ddp", rank=0)) == ["node 0 line"]
    assert list(backend.logs("default/pytorchjob/digits-ddp"))[-1] == "[digits-ddp-master-0] store line"
    assert backend.delete_pod("default/pytorchjob/digits-ddp", 1) == "digits-ddp-worker-1"
    with pytest.raises(BackendError, match=r"no pod for node index 2"):
        backend.delete_pod("default/pytorchjob/digits-ddp", 2)


SECRETS = "/api/v1/namespaces/default/secrets"
TRAINJOBS = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainjobs"


def test_a_trainjob_is_dry_run_and_created_after_its_runtime(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    """Issue 40.2. Trainer's webhook (kubeflow/trainer v2.3.0 pkg/webhooks/trainjob_webhook.go ->
    pkg/runtime/core/trainingruntime.go ValidateObjects) refuses a TrainJob, dry run included, whose
    runtime does not exist yet; the fake answers so (tests/fixtures/k8s_fake.py). So the runtime is
    created before the TrainJob's dry run, and the webhook's lagging cache is waited out."""
    k8s_fake_server.runtime_lag = 2
    backend.submit(_trainjob_spec(spec), SubmitOptions(fixed_size=True))
    posts = [(r.body["kind"], r.dry_run) for r in k8s_fake_server.sent("POST")]
    companions = ["Secret", "ConfigMap", "NetworkPolicy", "TrainingRuntime"]
    assert posts == [
        *[(k, True) for k in companions],
        *[(k, False) for k in companions],
        *[("TrainJob", True)] * 3,  # twice refused while the webhook's cache lags
        ("TrainJob", False),
    ]
    assert [o["metadata"]["name"] for o in k8s_fake_server.stored("trainjobs")] == ["digits-tj"]


def test_a_trainjob_the_webhook_refuses_leaves_nothing_behind(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    """A user runtime (runtimeRef) that does not exist: the webhook's one line, and what the submit created
    before the TrainJob's turn (its Secret, ConfigMap, NetworkPolicy) is removed again."""
    tj = _trainjob_spec(spec)
    tj.spec.kubernetes.runtime_ref = "torch-distributed"
    tj.spec.kubernetes.gang = "none"  # a user runtime's podGroupPolicy decides
    with pytest.raises(BackendError) as err:
        backend.submit(tj, SubmitOptions(fixed_size=True))
    assert "specified clusterTrainingRuntime must be created before the TrainJob is created" in str(err.value)
    assert str(err.value).startswith("dry run of TrainJob default/digits-tj: rejected by the API server")
    assert k8s_fake_server.objects == {}
    assert k8s_fake_server.sent("POST", dry_run=False) == []  # a runtimeRef job is dry-run with the rest
    cluster_runtime = {"metadata": {"name": "torch-distributed"}, "spec": {}}
    k8s_fake_server.add("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", cluster_runtime)
    backend.submit(tj, SubmitOptions(fixed_size=True))
    assert [o["metadata"]["name"] for o in k8s_fake_server.stored("trainjobs")] == ["digits-tj"]


def test_a_refused_trainjob_rolls_back_the_runtime_it_created(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    k8s_fake_server.runtime_lag = 1000  # a webhook that never sees the runtime
    with pytest.raises(BackendError, match=r"must be created before the TrainJob is created"):
        backend.submit(_trainjob_spec(spec), SubmitOptions(fixed_size=True))
    deleted = [r.path.rsplit("/", 2)[-2] for r in k8s_fake_server.sent("DELETE")]
    assert deleted == ["trainingruntimes", "networkpolicies", "configmaps", "secrets"]
    assert k8s_fake_server.objects == {}


def test_dry_run_of_a_trainjob_says_which_object_it_could_not_dry_run(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    handle = backend.submit(_trainjob_spec(spec), SubmitOptions(fixed_size=True, dry_run=True))
    assert handle.info["not_dry_run"] == ["TrainJob default/digits-tj: its runtime must exist first"]
    assert [r.body["kind"] for r in k8s_fake_server.sent("POST")] == [
        "Secret",
        "ConfigMap",
        "NetworkPolicy",
        "TrainingRuntime",
    ]
    assert k8s_fake_server.objects == {}


def test_the_fake_refuses_env_on_the_node_container_of_a_runtime_patch(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    """Issue 40.1, the fake's webhook rule (kubeflow/trainer v2.3.0 plugins/jobset/jobset.go Validate): what
    torchrig rendered before (the worker env in the runtime patch) is refused; `spec.trainer.env` is not."""
    from orchestrator.backends.kubernetes_api import create_object, new_client
    from orchestrator.compile import compile as compile_target

    tj = _trainjob_spec(spec)
    objs = compile_target(tj, "trainjob", fixed_size=True)
    api = new_client(str(backend.kubeconfig), None)
    try:
        for obj in objs[:-1]:
            create_object(api, obj, dry_run=False, namespace="default")
        job = objs[-1]
        assert job["spec"]["trainer"]["env"]
        create_object(api, job, dry_run=True, namespace="default")
        patched = json.loads(json.dumps(job))
        container = patched["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        container = container["template"]["spec"]["template"]["spec"]["containers"][0]
        container["env"] = job["spec"]["trainer"]["env"]
        with pytest.raises(BackendError, match=r"must not have envs for the dataset-initializer, model-initializer"):
            create_object(api, patched, dry_run=True, namespace="default")
    finally:
        api.close()


def test_submit_creates_the_job_secret_once_and_a_resubmit_keeps_it(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    """Issue 33.1: 32 random bytes (hex) in a Secret of the job, created by submit only where none exists."""
    backend.submit(spec)
    (secret,) = k8s_fake_server.stored("secrets")
    assert secret["metadata"]["name"] == "digits-ddp-job-secret"
    assert secret["metadata"]["labels"][JOB_LABEL] == "digits-ddp"
    value = base64.b64decode(secret["data"]["job-secret"]).decode()
    assert len(value) == 64 and int(value, 16) >= 0
    # A resubmit of a finished job (the PyTorchJob is gone, the Secret is not): the old secret stays.
    k8s_fake_server.objects.pop(("kubeflow.org", "v1", "pytorchjobs", "default", "digits-ddp"))
    backend.submit(spec)
    assert [r.path for r in k8s_fake_server.sent("POST") if r.path == SECRETS] == [SECRETS, SECRETS]  # 1st submit
    assert k8s_fake_server.stored("secrets") == [secret]
    # Another job gets its own.
    other = spec.model_copy(deep=True)
    other.metadata.name = "other"
    backend.submit(other)
    values = {base64.b64decode(s["data"]["job-secret"]) for s in k8s_fake_server.stored("secrets")}
    assert len(values) == 2


def test_cancel_removes_the_network_policy_and_the_job_secret(
    backend: KubernetesBackend, spec: JobSpec, k8s_fake_server: FakeKubeAPI
) -> None:
    backend.submit(spec)
    assert {o["kind"] for o in k8s_fake_server.objects.values()} == {
        "Secret",
        "ConfigMap",
        "NetworkPolicy",
        "PyTorchJob",
    }
    backend.cancel("default/pytorchjob/digits-ddp")
    assert k8s_fake_server.objects == {}
