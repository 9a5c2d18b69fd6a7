"""The compilers on the examples: shapes the operators expect, the env/command contracts, CRD validity."""

from __future__ import annotations

import re
import shlex
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.compile import MANIFEST_TARGETS, TARGETS, compile, compile_plan, render
from orchestrator.compile.monitoring import RULES_FILE, load_rule_groups
from orchestrator.errors import SpecError, UnsupportedFeature
from orchestrator.loader import load_spec
from orchestrator.spec import JobSpec
from orchestrator.targets import target_name_limit
from tests import crds
from training.contract import Env, WorkerIdentity

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# Every compiled command starts with the preflight, which then execs the rest (training.launch).
LAUNCH = ["python", "-m", "training.launch", "--spec", "/etc/torchrig/job.yaml", "--"]


def spec(name: str = "digits-ddp", *overrides: str) -> JobSpec:
    return load_spec(REPO / "examples" / f"{name}.yaml", list(overrides))


def by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind]
    return found


def container(template: dict[str, Any]) -> dict[str, Any]:
    return template["spec"]["containers"][0]  # type: ignore[no-any-return]


def env_of(ctr: dict[str, Any]) -> dict[str, str]:
    """name -> value; a downward-API entry reads `fieldRef:<path>`."""
    return {
        e["name"]: e.get("value", f"fieldRef:{e.get('valueFrom', {}).get('fieldRef', {}).get('fieldPath')}")
        for e in ctr["env"]
    }


# -- validity ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("target", list(MANIFEST_TARGETS))
@pytest.mark.parametrize("fixed_size", [False, True])
def test_examples_validate_against_crds(example: Path, target: str, fixed_size: bool) -> None:
    s = load_spec(example)
    if target == "trainjob" and s.spec.nodes.elastic and not fixed_size:
        with pytest.raises(UnsupportedFeature):
            compile(s, target)
        return
    crds.assert_valid(compile(s, target, monitoring=True, fixed_size=fixed_size))


# -- PyTorchJob ----------------------------------------------------------------------------------------


def test_pytorchjob_elastic_shape() -> None:
    job = by_kind(compile(spec("tinygpt-fsdp"), "pytorchjob"), "PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4
    assert job["spec"]["elasticPolicy"] == {
        "minReplicas": 2,
        "maxReplicas": 4,
        "rdzvBackend": "c10d",
        "rdzvId": "tinygpt-fsdp",
        "maxRestarts": 10,
    }
    assert job["spec"]["nprocPerNode"] == "8"
    ctr = container(job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])
    # Elastic: nnodes, rendezvous and restarts come from the PET_* variables the operator injects.
    assert ctr["command"] == [
        *LAUNCH,
        *["torchrun", "--nproc-per-node", "8", "-m", "training", "--spec", "/etc/torchrig/job.yaml"],
    ]
    # The operator derives PET_RDZV_ENDPOINT from this port.
    assert {"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"} in ctr["ports"]


def test_pytorchjob_fixed_size_has_master_and_passes_master_env() -> None:
    job = by_kind(compile(spec("tinygpt-fsdp"), "pytorchjob", fixed_size=True), "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)
    assert "elasticPolicy" not in job["spec"]
    cmd = container(replicas["Master"]["template"])["command"]
    assert cmd[: len(LAUNCH) + 3] == [*LAUNCH, "torchrun", "--nproc-per-node", "8"]
    joined = " ".join(cmd)
    # A c10d rendezvous hosted by the master pod's agent: a recreated pod rejoins, and in-place recovery
    # shares the store across the nodes.
    assert (
        "--nnodes 4 --rdzv-backend c10d --rdzv-endpoint $(MASTER_ADDR):$(MASTER_PORT) --rdzv-id tinygpt-fsdp" in joined
    )
    assert cmd[-4:] == ["-m", "training", "--spec", "/etc/torchrig/job.yaml"]
    env = env_of(container(replicas["Master"]["template"]))
    assert env[Env.INPLACE_STORE] == Env.INPLACE_STORE_RDZV


def test_pytorchjob_single_node_omits_worker() -> None:
    job = by_kind(compile(spec("digits-ddp", "spec.nodes.max=1"), "pytorchjob"), "PyTorchJob")
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"}


def test_pytorchjob_pod_contract() -> None:
    s = spec("tinygpt-fsdp")
    objs = compile(s, "pytorchjob")
    cm, _policy, job = objs
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "tinygpt-fsdp-spec"
    # The ConfigMap holds the resolved spec; reading it back gives the same job.
    assert JobSpec.model_validate(yaml.safe_load(cm["data"]["job.yaml"])) == s
    tmpl = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    ctr = container(tmpl)
    env = env_of(ctr)
    assert env["TORCHRIG_SPEC"] == "/etc/torchrig/job.yaml"
    assert env["TORCHRIG_RUN_DIR"] == "/var/run/torchrig"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCHRIG_METRICS_BIND" not in env  # pods bind all interfaces
    mounts = {m["mountPath"]: m["name"] for m in ctr["volumeMounts"]}
    volumes = {v["name"]: v for v in tmpl["spec"]["volumes"]}
    assert volumes[mounts["/etc/torchrig"]]["configMap"]["name"] == "tinygpt-fsdp-spec"
    assert "emptyDir" in volumes[mounts["/var/run/torchrig"]]
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes[mounts["/mnt/checkpoints"]]["persistentVolumeClaim"] == {"claimName": "tinygpt-checkpoints"}
    assert ctr["resources"]["limits"] == {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": 8}
    assert ctr["securityContext"]["allowPrivilegeEscalation"] is False
    assert ctr["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert tmpl["spec"]["securityContext"]["runAsNonRoot"] is True
    assert tmpl["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert ports["metrics"] == 9400 and ports["metrics-r7"] == 9407
    assert tmpl["metadata"]["annotations"]["prometheus.io/port"] == "9400"
    assert tmpl["metadata"]["labels"]["torchrig.io/job"] == "tinygpt-fsdp"
    assert tmpl["metadata"]["labels"]["team"] == "language"
    assert tmpl["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert tmpl["spec"]["imagePullSecrets"] == [{"name": "ghcr-pull"}]
    assert tmpl["spec"]["serviceAccountName"] == "trainer"
    assert tmpl["spec"]["priorityClassName"] == "high"


def test_pytorchjob_volcano_gang() -> None:
    job = by_kind(compile(spec("tinygpt-fsdp"), "pytorchjob"), "PyTorchJob")
    rp = job["spec"]["runPolicy"]
    assert rp["schedulingPolicy"] == {"minAvailable": 2, "queue": "team-language", "priorityClass": "high"}
    assert rp["backoffLimit"] == 10
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["schedulerName"] == "volcano"


def test_pytorchjob_kueue_label() -> None:
    job = by_kind(compile(spec("digits-ddp", "spec.kubernetes.gang=kueue"), "pytorchjob"), "PyTorchJob")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert "schedulingPolicy" not in job["spec"]["runPolicy"]


# -- TrainJob ------------------------------------------------------------------------------------------


def test_trainjob_refuses_elastic_with_alternatives() -> None:
    with pytest.raises(UnsupportedFeature) as info:
        compile(spec("digits-ddp"), "trainjob")
    msg = str(info.value)
    assert msg.startswith("spec.nodes: ")
    assert "pytorchjob" in msg and "rayjob" in msg and "--fixed-size" in msg


def test_trainjob_shape() -> None:
    objs = compile(spec("digits-ddp"), "trainjob", fixed_size=True)
    # A namespaced runtime of the job's own (issue 13 point 12), beside the TrainJob that alone uses it.
    assert [o["kind"] for o in objs] == ["ConfigMap", "NetworkPolicy", "TrainingRuntime", "TrainJob"]
    runtime, job = objs[2], objs[3]
    assert runtime["metadata"]["name"] == "torchrig-digits-ddp"
    assert runtime["metadata"]["namespace"] == job["metadata"]["namespace"] == "default"
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == "node"
    assert rjob["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    assert container(rjob["template"]["spec"]["template"])["name"] == "node"
    assert job["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": "torchrig-digits-ddp",
    }
    assert job["spec"]["trainer"]["numNodes"] == 2
    assert job["spec"]["trainer"]["numProcPerNode"] == 2
    assert job["spec"]["trainer"]["command"][: len(LAUNCH) + 3] == [*LAUNCH, "torchrun", "--nproc-per-node", "2"]
    (patch,) = job["spec"]["runtimePatches"]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    # Trainer's webhook refuses env on the `node` container of a runtime patch (kubeflow/trainer v2.3.0
    # pkg/runtime/framework/plugins/jobset/jobset.go Validate): the worker's environment is the trainer's.
    assert "env" not in container(pod)
    assert env_of(job["spec"]["trainer"])["TORCHRIG_SPEC"] == "/etc/torchrig/job.yaml"
    assert "podSpecOverrides" not in job["spec"] and "podTemplateOverrides" not in job["spec"]


def test_trainjob_runtime_ref_uses_existing_runtime() -> None:
    objs = compile(
        spec("digits-ddp", "spec.kubernetes.runtimeRef=torch-distributed", "spec.kubernetes.gang=none"),
        "trainjob",
        fixed_size=True,
    )
    assert [o["kind"] for o in objs] == ["ConfigMap", "NetworkPolicy", "TrainJob"]
    assert objs[2]["spec"]["runtimeRef"]["name"] == "torch-distributed"
    # Trainer's own runtimes are cluster-wide: a bare runtimeRef still names a ClusterTrainingRuntime.
    assert objs[2]["spec"]["runtimeRef"]["kind"] == "ClusterTrainingRuntime"
    # A user runtime still gets the worker's environment (spec.trainer.env, merged into its `node`
    # container by the torch plugin, plugins/torch/torch.go EnforceMLPolicy) and the job's secret.
    assert env_of(objs[2]["spec"]["trainer"])["TORCHRIG_JOB_SECRET_FILE"] == "/etc/torchrig-secret/job-secret"


def test_trainjob_volcano_with_runtime_ref_unsupported() -> None:
    with pytest.raises(UnsupportedFeature, match=r"^spec.kubernetes.gang: "):
        compile(spec("digits-ddp", "spec.kubernetes.runtimeRef=rt"), "trainjob", fixed_size=True)


# -- RayJob --------------------------------------------------------------------------------------------


def test_rayjob_shape() -> None:
    job = by_kind(compile(spec("tinygpt-fsdp"), "rayjob"), "RayJob")
    cluster = job["spec"]["rayClusterSpec"]
    (group,) = cluster["workerGroupSpecs"]
    assert (group["groupName"], group["replicas"], group["minReplicas"], group["maxReplicas"]) == ("worker", 4, 2, 4)
    assert cluster["enableInTreeAutoscaling"] is True
    assert job["spec"]["entrypoint"] == (
        "python -m training.launch --spec /etc/torchrig/job.yaml --no-gpu-check -- "
        "python -m orchestrator.backends.ray_entry --spec /etc/torchrig/job.yaml"
    )
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    assert container(group["template"])["resources"]["limits"]["nvidia.com/gpu"] == 8
    for tmpl in (cluster["headGroupSpec"]["template"], group["template"]):
        mounts = {m["mountPath"] for m in container(tmpl)["volumeMounts"]}
        assert "/etc/torchrig" in mounts


def test_rayjob_head_starts_ray_with_usage_stats_off() -> None:
    """As `--target raycluster` does: the head decides for the cluster, and KubeRay turns a "true" into the
    bare flag (common/pod.go convertParamMap), which tests/pods' KubeRay model renders the same way."""
    from tests.pods.operators import _ray_start

    job = by_kind(compile(spec("digits-ddp"), "rayjob"), "RayJob")
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["disable-usage-stats"] == "true"
    assert " --disable-usage-stats " in _ray_start("head", head["rayStartParams"], container(head["template"]), None)


def test_rayjob_turns_on_ray_token_authentication() -> None:
    """Issue 13 point 11: the Jobs API and Ray Client of the RayJob's head need KubeRay's token."""
    for fixed_size in (False, True):
        job = by_kind(compile(spec("digits-ddp"), "rayjob", fixed_size=fixed_size), "RayJob")
        cluster = job["spec"]["rayClusterSpec"]
        assert cluster["authOptions"] == {"mode": "token"} and cluster["rayVersion"] == "2.60.0"
        # Nothing in the pods switches it back off (KubeRay keeps a RAY_AUTH_MODE the template sets).
        templates = [cluster["headGroupSpec"]["template"], cluster["workerGroupSpecs"][0]["template"]]
        assert all("RAY_AUTH_MODE" not in {e["name"] for e in container(t)["env"]} for t in templates)


@pytest.mark.parametrize("version", ["2.52", "2.52.0", "v2.60.1", "3.0.0rc1"])
def test_rayjob_takes_ray_versions_with_token_authentication(version: str) -> None:
    job = by_kind(compile(spec("digits-ddp", f"spec.ray.rayVersion='{version}'"), "rayjob"), "RayJob")
    assert job["spec"]["rayClusterSpec"]["rayVersion"] == version


@pytest.mark.parametrize(
    ("version", "why"), [("2.51.1", "older than 2.52"), ("2.9.3", "older"), ("latest", "not a Ray")]
)
def test_rayjob_refuses_a_ray_version_without_token_authentication(version: str, why: str) -> None:
    old = spec("digits-ddp", f"spec.ray.rayVersion='{version}'")
    with pytest.raises(UnsupportedFeature, match=rf"^spec\.ray\.rayVersion: '{re.escape(version)}' is {why}") as err:
        compile(old, "rayjob")
    assert "\n" not in str(err.value) and "spec.ray.image" in str(err.value)
    compile(old, "pytorchjob")  # only the RayJob runs Ray


# -- names ---------------------------------------------------------------------------------------------


def kuberay_pod_prefix(prefix: str) -> str:
    """KubeRay utils.PodName: the prefix is cut to 50 characters before `-head-`/`-worker-` + 5 random."""
    return prefix[:50]


def derived_pod_names(objs: list[dict[str, Any]]) -> list[str]:
    """Pod (and PyTorchJob Service) names as the operators derive them from the compiled objects (random
    parts as x's); orchestrator/naming.py cites the operator source of each."""
    out: list[str] = []
    for o in objs:
        name = o["metadata"]["name"]
        if o["kind"] == "PyTorchJob":
            for rtype, r in o["spec"]["pytorchReplicaSpecs"].items():
                out.append(f"{name}-{rtype.lower()}-{r['replicas'] - 1}")
        elif o["kind"] == "TrainJob":
            rjob = "node"
            out.append(f"{name}-{rjob}-0-{o['spec']['trainer']['numNodes'] - 1}-xxxxx")
        elif o["kind"] == "RayJob":
            cluster = f"{name}-xxxxx"
            out.append(f"{kuberay_pod_prefix(cluster)}-head-xxxxx")
            groups = [g["groupName"] for g in o["spec"]["rayClusterSpec"]["workerGroupSpecs"]]
            out += [f"{kuberay_pod_prefix(cluster + '-' + group)}-worker-xxxxx" for group in groups]
    return out


@pytest.mark.parametrize("max_nodes", [1, 2, 9, 10, 11, 100, 1000])
@pytest.mark.parametrize("target", list(MANIFEST_TARGETS))
def test_longest_names_fit(max_nodes: int, target: str) -> None:
    # Elastic where the target supports it: the widest shape (PyTorchJob workers 0..max-1).
    limit = target_name_limit(target, max_nodes, elastic=target != "trainjob" and max_nodes > 1)
    name = "a" * limit
    s = spec("digits-ddp", f"metadata.name={name}", "spec.nodes.min=1", f"spec.nodes.max={max_nodes}")
    objs = compile(s, target, monitoring=True, fixed_size=target == "trainjob")
    names = derived_pod_names(objs)
    assert names and max(len(n) for n in names) <= 63
    if target == "rayjob":
        assert len(f"{name}-xxxxx") <= 53  # KubeRay MaxRayClusterNameLength
    for o in objs:
        assert len(o["metadata"]["name"]) <= 63
        assert all(len(v) <= 63 for v in o["metadata"]["labels"].values())
    longer = spec("digits-ddp", f"metadata.name={name}b", "spec.nodes.min=1", f"spec.nodes.max={max_nodes}")
    with pytest.raises(UnsupportedFeature, match=r"^metadata\.name: "):
        compile(longer, target, monitoring=True, fixed_size=target == "trainjob")


# -- launch plans ---------------------------------------------------------------------------------------


def test_torchrun_command_parses_with_torchs_own_parser() -> None:
    from torch.distributed.run import get_args_parser

    plan = compile_plan(spec("tinygpt-fsdp"), "torchrun")
    args = get_args_parser().parse_args(list(plan.args[1:]))
    assert args.nnodes == "2:4"
    assert args.nproc_per_node == "8"
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "$HOST:29400", "tinygpt-fsdp")
    assert args.max_restarts == 10
    assert args.module is True and args.training_script == "training"
    assert args.training_script_args == ["--spec", "job.yaml"]
    assert plan.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    # The shell line splits back to the same argv, preflight first, with $HOST left for the shell to expand.
    assert plan.launcher == ("python", "-m", "training.launch", "--spec", "job.yaml", "--")
    assert shlex.split(plan.command) == [*plan.launcher, *plan.args]
    assert '"$HOST:29400"' in plan.command


def test_pytorchjob_commands_parse_with_torchs_own_parser_as_a_c10d_rendezvous() -> None:
    """Both shapes run torchrun over the c10d rendezvous: the fixed one at the Master's address (the
    operator's `MASTER_ADDR`/`MASTER_PORT`, expanded by the kubelet), the elastic one from the operator's
    `PET_RDZV_*` (torchrun's defaults, so nothing on the command line)."""
    from torch.distributed.run import get_args_parser

    for fixed in (True, False):
        job = by_kind(compile(spec("tinygpt-fsdp"), "pytorchjob", fixed_size=fixed), "PyTorchJob")
        replica = job["spec"]["pytorchReplicaSpecs"]["Master" if fixed else "Worker"]
        cmd = container(replica["template"])["command"]
        torchrun = cmd[cmd.index("torchrun") + 1 :]
        expanded = [a.replace("$(MASTER_ADDR)", "job-master-0").replace("$(MASTER_PORT)", "23456") for a in torchrun]
        args = get_args_parser().parse_args(expanded)
        if fixed:
            assert (args.rdzv_backend, args.rdzv_endpoint, args.nnodes) == ("c10d", "job-master-0:23456", "4")
        assert args.module is True and args.training_script == "training"


def test_torchrun_fixed_size() -> None:
    from torch.distributed.run import get_args_parser

    plan = compile_plan(spec("tinygpt-fsdp"), "torchrun", fixed_size=True)
    assert get_args_parser().parse_args(list(plan.args[1:])).nnodes == "4"


def test_raytrain_plan() -> None:
    plan = compile_plan(spec("tinygpt-fsdp"), "raytrain")
    assert plan.scaling.kwargs() == {
        "num_workers": (16, 32),
        "use_gpu": True,
        "resources_per_worker": {"CPU": 8.0, "GPU": 1.0},
    }
    assert plan.failure.max_failures == 10
    assert plan.checkpoint.num_to_keep == 5
    assert plan.run.name == "tinygpt-fsdp" and plan.run.storage_path == "s3://acme-checkpoints/tinygpt"
    small = compile_plan(spec("digits-ddp"), "raytrain", fixed_size=True)
    assert small.scaling.kwargs()["num_workers"] == 4 and small.scaling.use_gpu is False


def test_raytrain_plan_matches_ray_configs() -> None:
    """The plan's kwargs are accepted by the real Ray Train config classes."""
    pytest.importorskip("ray.train")
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    plan = compile_plan(spec("tinygpt-fsdp"), "raytrain")
    ScalingConfig(**plan.scaling.kwargs())
    RunConfig(
        name=plan.run.name,
        storage_path=plan.run.storage_path,
        failure_config=FailureConfig(max_failures=plan.failure.max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=plan.checkpoint.num_to_keep),
    )


# -- monitoring and registry ----------------------------------------------------------------------------


def test_monitoring_objects() -> None:
    objs = compile(spec("tinygpt-fsdp"), "pytorchjob", monitoring=True)
    pm = by_kind(objs, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"]["torchrig.io/job"] == "tinygpt-fsdp"
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]][:2] == ["metrics", "metrics-r1"]
    pod_labels = by_kind(objs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert by_kind(objs, "PrometheusRule")["spec"]["groups"] == load_rule_groups()


@pytest.mark.skipif(
    not RULES_FILE.exists(), reason="orchestrator/monitoring/rules.yaml not written yet (monitoring piece)"
)
def test_prometheus_rule_carries_shared_rules() -> None:
    rule = by_kind(compile(spec("digits-ddp"), "pytorchjob", monitoring=True), "PrometheusRule")
    assert rule["spec"]["groups"] and all(g.get("rules") for g in rule["spec"]["groups"])


def test_metrics_disabled_means_no_monitoring_objects() -> None:
    objs = compile(spec("digits-ddp", "spec.metrics.enabled=false"), "pytorchjob", monitoring=True)
    assert [o["kind"] for o in objs] == ["ConfigMap", "NetworkPolicy", "PyTorchJob"]


def test_unknown_target_lists_valid_ones() -> None:
    with pytest.raises(SpecError, match="valid targets: pytorchjob, trainjob, rayjob"):
        compile(spec(), "mpijob")


@pytest.mark.parametrize("target", TARGETS)
def test_render_is_yaml_or_shell(target: str) -> None:
    text = render(spec("tinygpt-fsdp"), target, fixed_size=True)
    if target == "torchrun":
        assert text.splitlines()[-1].startswith("python -m training.launch --spec job.yaml -- torchrun ")
    else:
        assert all(isinstance(d, dict) for d in yaml.safe_load_all(text))


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob", "rayjob"])
def test_every_compiled_worker_names_its_kubernetes_node(target: str) -> None:
    """Every pod's workers learn the node they run on (downward API `spec.nodeName`): an `sdc` suspect and
    the metrics' `node` label name the machine an operator cordons or taints, not the pod's host name."""
    docs = compile(spec("tinygpt-fsdp"), target, fixed_size=True)
    envs = [
        c.get("env", [])
        for doc in docs
        for c in _containers(doc)
        if any(e["name"] == Env.SPEC for e in c.get("env", []))
    ]
    if target == "trainjob":
        envs = [by_kind(docs, "TrainJob")["spec"]["trainer"]["env"]]
    assert envs, "no worker container found"
    for env in envs:
        entry = next(e for e in env if e["name"] == Env.NODE_NAME)
        assert entry == {"name": Env.NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}


def _containers(doc: Any) -> list[dict[str, Any]]:
    """Every container dict anywhere in a manifest (templates nest at different depths per kind)."""
    found: list[dict[str, Any]] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "containers" and isinstance(value, list):
                found.extend(c for c in value if isinstance(c, dict))
            else:
                found.extend(_containers(value))
    elif isinstance(doc, list):
        for item in doc:
            found.extend(_containers(item))
    return found


def test_a_worker_names_the_kubernetes_node_else_its_host() -> None:
    base = {Env.RANK: "0", Env.WORLD_SIZE: "1"}
    assert WorkerIdentity.from_env({**base, Env.NODE_NAME: "gpu-node-17"}).node == "gpu-node-17"
    assert WorkerIdentity.from_env(base).node == socket.gethostname()
    assert WorkerIdentity.from_env({**base, Env.NODE_NAME: ""}).node == socket.gethostname()
