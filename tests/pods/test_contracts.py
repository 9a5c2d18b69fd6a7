"""The operators' contracts (operators.py, kubelet.py) applied to the rendered manifests, no processes.

Fast checks of what each operator would run: names and DNS, the injected env, the kubelet-expanded
command (no `$(VAR)` left unresolved), the spec ConfigMap at the path the command reads, and the
restart decisions. The end-to-end runs are in test_pods.py (`-m pods`).
"""

from __future__ import annotations

import base64
from types import SimpleNamespace
from typing import Any, cast

import pytest

from tests.pods.kubelet import (
    Pod,
    container_argv,
    expand,
    http_probe_url,
    probe_spec,
    resolve_env,
    secret_data,
    strategic_merge,
)
from tests.pods.operators import go_quote, operator_action, pytorchjob_pods, rayjob_pods, trainjob_pods
from tests.pods.scenario import one, render

Secrets = dict[str, dict[str, str]]


def _env(pod: Pod, secrets: Secrets | None = None, container: dict[str, Any] | None = None) -> dict[str, str]:
    return dict(resolve_env(pod, "10.214.0.2", container, secrets))


def _argv(pod: Pod, secrets: Secrets | None = None) -> list[str]:
    return container_argv(pod, resolve_env(pod, "10.214.0.2", secrets=secrets))


def _names(pods: list[Pod]) -> dict[str, str]:
    """DNS name -> pod name, over every pod (what the cluster DNS would answer)."""
    return {n: p.name for p in pods for n in [*p.dns_names, *p.own_hosts_names()]}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("--node-rank=$(RANK)", "--node-rank=1"),
        ("$(UNDEFINED)", "$(UNDEFINED)"),
        ("$$(RANK)", "$(RANK)"),
        ("$$", "$"),
        ("a$b", "a$b"),
        ("$(RANK", "$(RANK"),
        ("$", "$"),
        ("$(RANK)$(RANK)", "11"),
    ],
)
def test_kubelet_expansion_follows_expand_go(text: str, expected: str) -> None:
    assert expand(text, {"RANK": "1"}) == expected


def test_strategic_merge_merges_keyed_lists_and_replaces_others() -> None:
    base = {"containers": [{"name": "node", "env": [{"name": "A", "value": "1"}]}], "tolerations": [{"k": 1}]}
    patch = {"containers": [{"name": "node", "env": [{"name": "B", "value": "2"}]}], "tolerations": [{"k": 2}]}
    merged = strategic_merge(base, patch)
    assert merged["containers"] == [{"name": "node", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}]
    assert merged["tolerations"] == [{"k": 2}]


def _assert_runnable(objects: list[dict[str, Any]], pods: list[Pod]) -> None:
    """Every `$(VAR)` resolves, every mount names a volume, the spec file the command reads is in
    the ConfigMap mounted at its directory, and every host the env names resolves to a pod."""
    names = _names(pods)
    secrets = secret_data(objects)
    for pod in pods:
        env, argv = _env(pod, secrets), _argv(pod, secrets)
        assert not [a for a in argv if "$(" in a], f"{pod.name}: unresolved $(VAR) in {argv}"
        volumes = {v["name"]: v for v in pod.volumes}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in pod.container.get("volumeMounts", [])}
        spec_path = env.get("TORCHRIG_SPEC")
        if spec_path:
            directory, _, key = spec_path.rpartition("/")
            cm_volume = mounts[directory]["configMap"]
            cm = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == cm_volume["name"])
            item = next(i for i in cm_volume["items"] if i["path"] == key)
            assert "kind: TrainingJob" in cm["data"][item["key"]]
        for var in ("MASTER_ADDR", "PET_MASTER_ADDR", "PET_RDZV_ENDPOINT", "FQ_RAY_IP"):
            if var in env:
                host = env[var].rsplit(":", 1)[0] if var == "PET_RDZV_ENDPOINT" else env[var]
                assert host in names, f"{pod.name}: {var}={env[var]} names no pod"


def test_pytorchjob_fixed_master_and_worker_get_the_operator_env() -> None:
    objects = render("pytorchjob", fixed_size=True)
    master, worker = pytorchjob_pods(objects)
    assert (master.name, worker.name) == ("digits-ddp-master-0", "digits-ddp-worker-0")
    for pod, rank in ((master, "0"), (worker, "1")):
        env = _env(pod)
        assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "digits-ddp-master-0"
        assert env["MASTER_PORT"] == "23456" and env["WORLD_SIZE"] == "4"
        assert env["RANK"] == env["PET_NODE_RANK"] == rank and env["PET_NNODES"] == "2"
        assert env["PET_NPROC_PER_NODE"] == "2"
        argv = _argv(pod)
        # torchrun rendezvous over c10d at the Master, the kubelet having expanded $(MASTER_ADDR):$(MASTER_PORT)
        assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
        assert argv[argv.index("--rdzv-endpoint") + 1] == "digits-ddp-master-0:23456"
    _assert_runnable(objects, [master, worker])


def test_pytorchjob_elastic_workers_rendezvous_at_worker_0() -> None:
    objects = render("pytorchjob")
    pods = pytorchjob_pods(objects)
    assert [p.name for p in pods] == ["digits-ddp-worker-0", "digits-ddp-worker-1"]
    for pod in pods:
        env = _env(pod)
        assert env["PET_RDZV_ENDPOINT"] == "digits-ddp-worker-0:23456"
        assert (env["PET_RDZV_BACKEND"], env["PET_NNODES"], env["PET_RDZV_ID"]) == ("c10d", "1:2", "digits-ddp")
        assert env["PET_MAX_RESTARTS"] == "3" and "MASTER_ADDR" not in env and "RANK" not in env
    _assert_runnable(objects, pods)


@pytest.mark.parametrize(
    ("replica_policy", "code", "action"),
    [
        ("ExitCode", 0, "done"),
        ("ExitCode", 2, "fail-job"),
        ("ExitCode", 127, "fail-job"),
        ("ExitCode", 137, "recreate"),
        ("OnFailure", 1, "kubelet-restart"),
        ("Always", 1, "kubelet-restart"),
        ("Never", 137, "fail-job"),
    ],
)
def test_operator_restart_decisions(replica_policy: str, code: int, action: str) -> None:
    pod = Pod(name="p", namespace="d", hostname="p", container={}, replica_policy=replica_policy)
    pod.restart_policy = "Never" if replica_policy == "ExitCode" else replica_policy
    assert operator_action(pod, code) == action


def test_trainjob_pods_are_indexed_jobset_pods_with_the_torch_plugin_env() -> None:
    objects = render("trainjob", "spec.nodes.min=2")
    pods = trainjob_pods(objects)
    assert [(p.hostname, p.subdomain) for p in pods] == [
        ("digits-ddp-node-0-0", "digits-ddp"),
        ("digits-ddp-node-0-1", "digits-ddp"),
    ]
    trainer = one(objects, "TrainJob")["spec"]["trainer"]
    # In-place recovery over several nodes: torchrun's c10d endpoint is node 0's name, from the plugin's env.
    endpoint = "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"
    assert endpoint in trainer["command"]
    command = [a.replace(endpoint, "digits-ddp-node-0-0.digits-ddp:29500") for a in trainer["command"]]
    for index, pod in enumerate(pods):
        env = _env(pod)
        assert env["PET_NODE_RANK"] == env["JOB_COMPLETION_INDEX"] == str(index)
        assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("2", "2")
        assert (env["PET_MASTER_ADDR"], env["PET_MASTER_PORT"]) == ("digits-ddp-node-0-0.digits-ddp", "29500")
        assert _argv(pod) == command
    _assert_runnable(objects, pods)


def test_rayjob_head_worker_and_submitter_commands() -> None:
    objects = render("rayjob", "spec.nodes.max=1", "spec.ray.runtimeEnv={env_vars: {A: 'x \"y\"'}}")
    ray = rayjob_pods(objects)
    head_args = ray.head.container["args"][0]
    assert head_args.startswith("ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start --head ")
    assert " --num-cpus=0 " in head_args and " --dashboard-host=0.0.0.0 " in head_args and " --block " in head_args
    (worker,) = ray.workers
    fqdn = "digits-ddp-x7b4q-head-svc.default.svc.cluster.local"
    assert f" --address={fqdn}:6379 " in worker.container["args"][0] and fqdn in ray.head.dns_names
    script = ray.submitter.container["args"][0]
    entrypoint = one(objects, "RayJob")["spec"]["entrypoint"]
    assert f"ray job submit --address http://{fqdn}:8265 --no-wait" in script
    assert f"--submission-id {ray.submission_id} -- {entrypoint} ; fi ;" in script
    assert "--runtime-env-json " + go_quote('{"env_vars":{"A":"x \\"y\\""}}') in script
    secrets = secret_data(ray.secrets)
    assert _env(ray.head, secrets)["RAY_ADDRESS"] == "127.0.0.1:6379"
    assert _env(worker, secrets)["RAY_ADDRESS"] == f"{fqdn}:6379"
    _assert_runnable([*objects, *ray.secrets], [ray.head, worker, ray.submitter])


def test_rayjob_pods_get_kuberays_readiness_probe_which_gates_the_submitter() -> None:
    """KubeRay injects a readiness probe into every Ray container without one (Ray >= 2.53: an httpGet of the
    dashboard agent's /api/healthz, 10 s initial delay, 5 s period); its RayCluster is Ready, and the submitter
    Job created, only once every pod passes it. A user's own probe is kept; the URL is the pod's address."""
    objects = render("rayjob", "spec.nodes.max=1")
    ray = rayjob_pods(objects)
    for pod in [ray.head, *ray.workers]:
        probe = pod.container["readinessProbe"]
        assert probe["httpGet"] == {"path": "/api/healthz", "port": 52365}, pod.name
        assert (probe["initialDelaySeconds"], probe["periodSeconds"], probe["failureThreshold"]) == (10, 5, 10)
        assert probe["timeoutSeconds"] == (5 if pod.role == "head" else 2)
        spec = probe_spec(pod.container, "readiness")
        assert (
            spec is not None and http_probe_url(spec, pod.container, "10.1.2.3") == "http://10.1.2.3:52365/api/healthz"
        )
    assert "readinessProbe" not in ray.submitter.container
    rj = one(objects, "RayJob")
    own = {"exec": {"command": ["true"]}}
    rj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["readinessProbe"] = own
    assert rayjob_pods(objects).head.container["readinessProbe"] == own
    named = {"httpGet": {"port": "dash", "path": "x", "scheme": "HTTPS"}}
    assert http_probe_url(named, {"ports": [{"name": "dash", "containerPort": 8265}]}, "p") == "https://p:8265/x"
    with pytest.raises(ValueError, match="no port named 'dash'"):
        http_probe_url(named, {}, "p")
    rj["spec"]["rayClusterSpec"]["rayVersion"] = "2.52.1"
    del rj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    with pytest.raises(NotImplementedError, match="wget"):
        rayjob_pods(objects)


def test_rayjob_token_auth_reaches_every_ray_process_and_the_submitter() -> None:
    """authOptions mode token: KubeRay's Secret (named after the cluster) feeds RAY_AUTH_TOKEN to the head,
    the workers, their wait-gcs-ready init container and the submitter; without the Secret no pod starts."""
    ray = rayjob_pods(render("rayjob", "spec.nodes.max=1"))
    ((secret_name, data),) = secret_data(ray.secrets).items()
    assert secret_name == ray.cluster == "digits-ddp-x7b4q" and data == {"auth_token": ray.auth_token}
    assert ray.auth_token and len(base64.b64decode(ray.auth_token)) == 32
    (worker,) = ray.workers
    containers = [(ray.head, None), (worker, None), (worker, worker.init_containers[0]), (ray.submitter, None)]
    for pod, container in containers:
        env = _env(pod, secret_data(ray.secrets), container)
        assert (env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN"]) == ("token", ray.auth_token), pod.name
        with pytest.raises(ValueError, match="couldn't find key auth_token in Secret digits-ddp-x7b4q"):
            _env(pod, {}, container)
    # A RayJob rendered without authOptions gets none of it (what the harness ran before).
    objects = render("rayjob", "spec.nodes.max=1")
    del one(objects, "RayJob")["spec"]["rayClusterSpec"]["authOptions"]
    bare = rayjob_pods(objects)
    assert bare.secrets == [] and bare.auth_token is None and "RAY_AUTH_MODE" not in _env(bare.head)


def test_image_env_mirrors_the_cpu_image() -> None:
    """The harness stands in for images/cpu/Dockerfile: same ENV (PATH aside), HOME and WORKDIR."""
    import re

    from tests.fixtures.common import REPO
    from tests.pods.runtime import IMAGE_ENV, IMAGE_WORKDIR

    final = (REPO / "images" / "cpu" / "Dockerfile").read_text().rsplit("\nFROM ", 1)[1]
    env_block = re.search(r"^ENV (.*?)(?<!\\)$", final, re.S | re.M)
    assert env_block is not None
    pairs = dict(re.findall(r"(\w+)=(\S+)", env_block.group(1).replace("\\\n", " ")))
    assert {k: v for k, v in pairs.items() if k != "PATH"} == {
        k: v for k, v in IMAGE_ENV.items() if k not in ("PATH", "HOME") and not k.startswith("RAY_")
    }
    assert f"WORKDIR {IMAGE_WORKDIR}\n" in final and "useradd --uid 1000 --create-home" in final


def test_trainjob_failures_follow_pod_failure_policy_then_jobset_restarts() -> None:
    """A permanent code fails the JobSet at once; another failure (backoffLimit 0) restarts the whole
    JobSet until failurePolicy.maxRestarts is spent."""
    objects = render("trainjob", "spec.nodes.min=2")
    pod = trainjob_pods(objects)[0]
    jobset = one(objects, one(objects, "TrainJob")["spec"]["runtimeRef"]["kind"])["spec"]["template"]["spec"]
    permanent = jobset["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"]
    max_restarts = jobset["failurePolicy"]["maxRestarts"]
    assert all(operator_action(pod, code) == "fail-job" for code in permanent)
    assert [operator_action(pod, 137) for _ in range(max_restarts + 1)] == ["restart-all"] * max_restarts + ["fail-job"]


def test_webhooks_admit_the_rendered_jobs_and_refuse_what_their_source_refuses() -> None:
    """admission.py, each rule from the webhook's source (see its docstring for the files)."""
    import copy

    from tests.pods.admission import admit

    pj = render("pytorchjob", fixed_size=True)
    ray = render("rayjob", "spec.nodes.max=1")
    assert admit(pj) == [] and admit(render("pytorchjob")) == [] and admit(ray) == []

    bad = copy.deepcopy(pj)
    replicas = one(bad, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]
    replicas["Master"]["replicas"] = 2
    replicas["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    found = "\n".join(admit(bad))
    assert "pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1" in found
    assert "must have at least one container with name pytorch" in found

    tj = render("trainjob", "spec.nodes.min=2")
    runtime_first = [o for o in tj if o["kind"] != "TrainJob"] + [one(tj, "TrainJob")]
    patched = copy.deepcopy(runtime_first)
    patch = one(patched, "TrainJob")["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    node = patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    node.setdefault("containers", [{"name": "node"}])[0]["env"] = [{"name": "A", "value": "1"}]
    assert "must not have envs for the dataset-initializer, model-initializer, node containers" in "\n".join(
        admit(patched)
    )
    without_runtime = [o for o in tj if not o["kind"].endswith("TrainingRuntime")]
    assert "must be created before the TrainJob is created" in "\n".join(admit(without_runtime))
    reserved = copy.deepcopy(runtime_first)
    one(reserved, "TrainJob")["spec"].setdefault("trainer", {}).setdefault("env", []).append(
        {"name": "PET_NNODES", "value": "3"}
    )
    assert "must not have reserved envs" in "\n".join(admit(reserved))

    long_ray = copy.deepcopy(ray)
    one(long_ray, "RayJob")["metadata"]["name"] = "r" * 48
    group = one(long_ray, "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["minReplicas"], group["maxReplicas"] = 3, 2
    found = "\n".join(admit(long_ray))
    assert "no more than 47 chars" in found and "minReplicas 3 > maxReplicas 2" in found


def test_workers_of_a_job_with_a_master_wait_for_its_name_in_the_operators_init_container() -> None:
    """TO pytorch/initcontainer.go: `init-pytorch` on every Worker when a Master exists, none otherwise; and
    the operator's Services publish no not-ready addresses (common/service.go)."""
    fixed = pytorchjob_pods(render("pytorchjob", fixed_size=True))
    master, worker = fixed
    assert master.init_containers == [] and not master.publish_not_ready
    (init,) = worker.init_containers
    assert init["name"] == "init-pytorch" and init["image"] == "alpine:3.10" and "securityContext" not in init
    assert "nslookup digits-ddp-master-0;" in init["command"][2] and "seq 100" in init["command"][2]
    assert all(not p.init_containers for p in pytorchjob_pods(render("pytorchjob")))
    assert all(p.publish_not_ready for p in trainjob_pods(render("trainjob", "spec.nodes.min=2")))


class _FakeRayCluster:
    """What `run_rayjob` reads of a PodCluster, scripted: pods turn Ready at a given tick, and the submitter's
    pods exit with the given codes, one per pod the Job creates."""

    def __init__(self, objects: list[dict[str, Any]], ray: Any, ready_at: int, submitter_codes: list[int]) -> None:
        self.objects, self.time_scale, self.ticks = objects, 0.0001, 0
        self.ready_at, self.codes = ready_at, list(submitter_codes)
        self.submitter = ray.submitter.name
        names = [ray.head.name, *(w.name for w in ray.workers), self.submitter]
        self.pods = {n: SimpleNamespace(ready=False, events=[]) for n in names}
        self.log: list[str] = []
        self.running = False

    def tick(self) -> None:
        self.ticks += 1
        for name, state in self.pods.items():
            state.ready = name != self.submitter and self.ticks >= self.ready_at

    def start(self, name: str, wait: bool = True) -> None:
        self.log.append(f"start {name} at tick {self.ticks}")
        self.running = self.running or name == self.submitter

    def poll(self, name: str) -> int | None:
        if name != self.submitter or not self.running:
            return None
        self.running = False
        return self.codes.pop(0)

    def recreate(self, name: str) -> None:
        self.log.append(f"recreate {name}")


@pytest.mark.parametrize(
    ("codes", "status", "pods"),
    [([0], "Succeeded", 1), ([1, 0], "Succeeded", 2), ([1, 1, 1], "Failed", 3)],
)
def test_kuberay_creates_the_submitter_once_the_cluster_is_ready_and_replaces_a_failed_one(
    monkeypatch: pytest.MonkeyPatch, codes: list[int], status: str, pods: int
) -> None:
    """run_rayjob (the harness's KubeRay): no submitter pod before every head and worker pod is Ready; a failed
    submitter pod is replaced by a new one until backoffLimit 2 (3 pods) is spent, then the Job fails."""
    from tests.pods import jobs

    monkeypatch.setattr(jobs.time, "sleep", lambda _s: None)
    objects = render("rayjob", "spec.nodes.max=1")
    ray = rayjob_pods(objects)
    cluster = _FakeRayCluster(objects, ray, ready_at=5, submitter_codes=codes)
    outcome = jobs.run_rayjob(cast(Any, cluster), ray, timeout_s=60)
    assert outcome.status == status, outcome
    starts = [line for line in cluster.log if line.rsplit(" at tick", 1)[0] == f"start {ray.submitter.name}"]
    assert len(starts) == pods and all(int(line.rsplit(" ", 1)[1]) >= 5 for line in starts), cluster.log
    assert cluster.log.count(f"recreate {ray.submitter.name}") == pods - 1
    if status == "Failed":
        assert "backoffLimit 2 reached (3 failed submitter pods)" in outcome.reason
