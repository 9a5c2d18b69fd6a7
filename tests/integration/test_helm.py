"""The Helm chart helm/torchrig/ against the compilers, with the real helm binary.

The compilers are the source of truth: for the same job file, `helm template` must render the objects
`torchrig render` prints, object for object (matched by kind and name, compared as parsed dicts; the spec
ConfigMap's `job.yaml` compared parsed, because Helm's toYaml sorts keys). The chart-only objects (Grafana
dashboard ConfigMap, checkpoint PVCs) have no compiler counterpart and are checked on their own.
"""

from __future__ import annotations

import base64
import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from orchestrator.chart import values_document
from orchestrator.compile import compile as compile_objects
from orchestrator.compile.monitoring import load_rule_groups
from orchestrator.errors import CompileError, UnsupportedFeature
from orchestrator.loader import dump_spec, load_spec
from tests import crds
from tests.fixtures import spec_variants
from tests.fixtures.jobs import write_job

pytestmark = [pytest.mark.helm, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "torchrig"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
HELM = shutil.which("helm", path=str(REPO / ".venv" / "bin")) or shutil.which("helm")
if HELM is None:  # pragma: no cover - `make tools` installs it
    pytest.skip("helm not installed (make tools)", allow_module_level=True)

MONITORING = ["--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.prometheusRule.enabled=true"]


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=60, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def helm_template(*args: str) -> list[dict[str, Any]]:
    out = run_helm("template", "t", str(CHART), *args).stdout
    return [d for d in yaml.safe_load_all(out) if d is not None]


def compiled(
    job_file: Path, target: str, *, monitoring: bool = False, fixed_size: bool = False
) -> list[dict[str, Any]]:
    spec = load_spec(job_file)
    objs = compile_objects(spec, target, monitoring=monitoring, fixed_size=fixed_size)
    # Through YAML, as `torchrig render` prints them (tuples become lists).
    return [yaml.safe_load(yaml.safe_dump(o)) for o in objs]


def by_key(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for obj in objs:
        key = (obj["kind"], obj["metadata"]["name"])
        assert key not in out, f"{key} rendered twice"
        out[key] = obj
    return out


def comparable(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with a ConfigMap's `job.yaml` parsed (Helm's toYaml orders keys alphabetically)."""
    obj = copy.deepcopy(obj)
    if obj["kind"] == "ConfigMap" and "job.yaml" in obj.get("data", {}):
        obj["data"]["job.yaml"] = yaml.safe_load(obj["data"]["job.yaml"])
    return obj


# The job's Secret: the chart generates it (`lookup` keeps it across upgrades); `torchrig render` only names it.
CHART_ONLY_KINDS = {"PersistentVolumeClaim", "Secret"}


def assert_same_objects(helm_objs: list[dict[str, Any]], compiler_objs: list[dict[str, Any]]) -> None:
    rendered, expected = by_key(helm_objs), by_key(compiler_objs)
    extra = {k for k in rendered if k not in expected and k[0] not in CHART_ONLY_KINDS}
    extra = {k for k in extra if not (k[0] == "ConfigMap" and k[1].endswith("-dashboard"))}
    assert set(expected) <= set(rendered), f"helm lacks {sorted(set(expected) - set(rendered))}"
    assert not extra, f"helm renders objects the compiler does not: {sorted(extra)}"
    for key, want in expected.items():
        assert comparable(rendered[key]) == comparable(want), f"{key} differs from `torchrig render`"


DIGITS = REPO / "examples" / "digits-ddp.yaml"
TINYGPT = REPO / "examples" / "tinygpt-fsdp.yaml"


# -- equality with the compilers ----------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_renders_what_torchrig_renders(example: Path) -> None:
    assert_same_objects(helm_template("-f", str(example)), compiled(example, "pytorchjob"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_with_monitoring_renders_what_torchrig_renders(example: Path) -> None:
    objs = helm_template("-f", str(example), *MONITORING)
    assert_same_objects(objs, compiled(example, "pytorchjob", monitoring=True))
    rule = next(o for o in objs if o["kind"] == "PrometheusRule")
    # The chart's copy of the rules is the shared rules file (files/rules.yaml is generated from it).
    assert rule["spec"]["groups"] == load_rule_groups() != []


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_trainjob_target_renders_what_torchrig_renders(example: Path, tmp_path: Path) -> None:
    job = write_job(tmp_path, example, {"spec": {"kubernetes": {"target": "trainjob"}}})
    elastic = load_spec(job).spec.nodes.elastic
    args = ["-f", str(job), *MONITORING] + (["--set", "fixedSize=true"] if elastic else [])
    objs = helm_template(*args)
    assert {o["kind"] for o in objs} >= {"ConfigMap", "TrainingRuntime", "TrainJob"}
    assert_same_objects(objs, compiled(job, "trainjob", monitoring=True, fixed_size=elastic))


def test_elastic_trainjob_without_fixed_size_fails_like_the_compiler(tmp_path: Path) -> None:
    job = write_job(tmp_path, TINYGPT, {"spec": {"kubernetes": {"target": "trainjob"}}})
    proc = run_helm("template", "t", str(CHART), "-f", str(job), check=False)
    assert proc.returncode != 0
    assert "spec.nodes: TrainJob (Trainer >= v2.2) has no elastic training (min 2 < max 4)" in proc.stderr
    assert "fixedSize" in proc.stderr


@pytest.mark.parametrize(
    "value",
    ["spec.kubernetes.serviceAccount=Bad_SA", "spec.kubernetes.priorityClass=high prio", "metadata.name=Bad_Name"],
)
def test_names_kubernetes_would_refuse_fail_in_the_charts_schema_as_in_torchrig(value: str) -> None:
    """The chart's values.schema.json carries the model's name patterns: `helm template` refuses what
    `torchrig validate` refuses, instead of rendering a manifest the API server rejects."""
    path, _, _ = value.partition("=")
    proc = run_helm("template", "t", str(CHART), "--set", value, check=False)
    assert proc.returncode != 0 and "does not match pattern" in proc.stderr, proc.stderr
    assert path.split(".")[-1] in proc.stderr


@pytest.mark.parametrize(
    ("target", "limit", "spare_nodes"), [("pytorchjob", 54, 0), ("pytorchjob", 53, 9), ("trainjob", 48, 0)]
)
def test_names_too_long_for_the_target_fail_like_the_compiler(
    target: str, limit: int, spare_nodes: int, tmp_path: Path
) -> None:
    spec = {
        "nodes": {"min": 3, "max": 3},
        "kubernetes": {"target": target},
        "restarts": {"spares": 1, "spareNodes": spare_nodes},
    }
    at = write_job(tmp_path, DIGITS, {"metadata": {"name": "a" * limit}, "spec": spec})
    assert_same_objects(helm_template("-f", str(at)), compiled(at, target))
    over = write_job(tmp_path, at, {"metadata": {"name": "a" * (limit + 1)}}, name="over.yaml")
    with pytest.raises(UnsupportedFeature) as info:
        compiled(over, target)
    proc = run_helm("template", "t", str(CHART), "-f", str(over), check=False)
    assert proc.returncode != 0
    assert str(info.value) in proc.stderr
    assert ("spec.restarts.spareNodes=9" in proc.stderr) == bool(spare_nodes)


def test_fixed_size_pytorchjob_has_master_and_workers() -> None:
    objs = helm_template("-f", str(TINYGPT), "--set", "fixedSize=true")
    assert_same_objects(objs, compiled(TINYGPT, "pytorchjob", fixed_size=True))
    job = by_key(objs)[("PyTorchJob", "tinygpt-fsdp")]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)
    assert "elasticPolicy" not in job["spec"]
    command = replicas["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command[:6] == ["python", "-m", "training.launch", "--spec", "/etc/torchrig/job.yaml", "--"]  # preflight
    assert command[6:16] == [
        "torchrun",
        "--nproc-per-node",
        "8",
        "--nnodes",
        "4",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "$(MASTER_ADDR):$(MASTER_PORT)",
        "--rdzv-id",
    ]


# Every branch of the compilers that the examples leave out, in two jobs.
KITCHEN_SINK: dict[str, Any] = {
    "metadata": {"annotations": {"owner": "ml-platform"}, "labels": {"app.kubernetes.io/name": "overridden"}},
    "spec": {
        "procsPerNode": 3,
        "nodes": {"min": 3, "max": 3},
        # Numbers where the model takes quantities; nulls that Helm turns into missing keys.
        "resources": {"cpu": 3, "memory": "6Gi", "sharedMemory": None},
        "training": {"gradClip": None, "steps": 7},
        "metrics": {"port": 9500},
        "checkpoint": {
            "every": {"seconds": 600, "steps": None},
            "stores": [
                {"uri": "file:///ckpt/a", "pvc": "claim-a", "options": {"auto_mkdir": True}},
                {"uri": "s3://bucket/run", "name": "s3"},
                {"uri": "/ckpt/b", "name": "b", "pvc": "claim-a"},
            ],
            "nodeLocal": {"enabled": True, "path": "/dev/shm/torchrig"},
        },
        "kubernetes": {
            "gang": "kueue",
            "queue": "team-q",
            "serviceAccount": None,
            "priorityClass": None,
            # Keys in sorted order: Helm's maps are sorted, the compiler keeps the file's order.
            "env": {"AAA_FIRST": "1", "NCCL_DEBUG": "INFO", "PYTHONUNBUFFERED": "0"},
            "podLabels": {"torchrig.io/job": "pod-override", "sidecar": "off"},
            "podAnnotations": {"prometheus.io/path": "/custom"},
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "train", "effect": "NoSchedule"}],
            "imagePullSecrets": ["a", "b"],
            "imagePullPolicy": "Always",
            "ttlSecondsAfterFinished": None,
            "activeDeadlineSeconds": 3600,
            "cleanPodPolicy": "All",
        },
    },
}


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
def test_kitchen_sink_renders_what_torchrig_renders(target: str, tmp_path: Path) -> None:
    changes = copy.deepcopy(KITCHEN_SINK)
    changes["spec"]["kubernetes"]["target"] = target
    job = write_job(tmp_path, DIGITS, changes)
    objs = helm_template("-f", str(job), *MONITORING)
    assert_same_objects(objs, compiled(job, target, monitoring=True))
    configmap = by_key(objs)[("ConfigMap", "digits-ddp-spec")]
    resolved = yaml.safe_load(configmap["data"]["job.yaml"])
    assert resolved == yaml.safe_load(dump_spec(load_spec(job)))
    # A null that is not the default is kept (Helm deleted the key; the chart's shape names it a null).
    assert resolved["spec"]["resources"]["sharedMemory"] is None and resolved["spec"]["resources"]["cpu"] == "3"
    assert resolved["spec"]["training"]["gradClip"] is None
    assert resolved["spec"]["checkpoint"]["every"] == {"seconds": 600}  # no inherited `steps: 100`


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize("mode", ["auto", "restart"])
def test_one_node_job_has_its_agent_host_the_in_place_store_like_the_compiler(
    target: str, mode: str, tmp_path: Path
) -> None:
    changes = {"spec": {"nodes": {"min": 1, "max": 1}, "restarts": {"mode": mode}, "kubernetes": {"target": target}}}
    job = write_job(tmp_path, DIGITS, changes)
    objs = helm_template("-f", str(job))
    assert_same_objects(objs, compiled(job, target))
    # A TrainJob's worker env is its trainer's (Trainer refuses env on the node container of a runtime patch).
    trainers = [o["spec"]["trainer"] for o in objs if o["kind"] == "TrainJob"]
    env = {e["name"]: e.get("value") for c in _containers_of(objs) + trainers for e in c.get("env", [])}
    assert env.get("TORCHRIG_INPLACE_STORE") == ("agent" if mode == "auto" else None)


@pytest.mark.parametrize(("nodes", "fixed"), [(1, False), (3, False), (2, True)])
def test_standby_nodes_render_what_torchrig_renders(nodes: int, fixed: bool, tmp_path: Path) -> None:
    """`restarts.spareNodes`: a store-only Master, the nodes and the extra standby Worker replicas with the
    standby env, on one node or several, and through `fixedSize` of an elastic job; the longer Worker
    names count against the name limit."""
    lo = 1 if fixed else nodes
    changes = {"spec": {"nodes": {"min": lo, "max": nodes}, "restarts": {"spareNodes": 2}}}
    job = write_job(tmp_path, DIGITS, changes)
    objs = helm_template("-f", str(job), *(["--set", "fixedSize=true"] if fixed else []))
    assert_same_objects(objs, compiled(job, "pytorchjob", fixed_size=fixed))
    replicas = by_key(objs)[("PyTorchJob", "digits-ddp")]["spec"]["pytorchReplicaSpecs"]
    workers = replicas["Worker"]
    assert workers["replicas"] == nodes + 2, "every node is a Worker beside the store-only Master"
    env = {e["name"]: e.get("value") for c in _containers_of(workers) for e in c.get("env", [])}
    assert env["TORCHRIG_STANDBY_FROM"] == str(nodes) and env["TORCHRIG_INPLACE_STORE"] == "rdzv"
    (master,) = _containers_of(replicas["Master"])
    assert master["command"][:3] == ["python", "-m", "training.rendezvous_store"]


def _containers_of(obj: Any) -> list[dict[str, Any]]:
    if isinstance(obj, dict):
        found = [c for c in obj.get("containers", []) if isinstance(c, dict)]
        return found + [c for k, v in obj.items() if k != "containers" for c in _containers_of(v)]
    if isinstance(obj, list):
        return [c for v in obj for c in _containers_of(v)]
    return []


def test_volcano_fixed_size_and_disabled_node_local(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        TINYGPT,
        {"spec": {"checkpoint": {"nodeLocal": {"enabled": True, "path": "/local/ckpt"}}, "resources": {"gpus": 8}}},
    )
    objs = helm_template("-f", str(job), "--set", "fixedSize=true")
    assert_same_objects(objs, compiled(job, "pytorchjob", fixed_size=True))
    policy = by_key(objs)[("PyTorchJob", "tinygpt-fsdp")]["spec"]["runPolicy"]["schedulingPolicy"]
    assert policy == {"minAvailable": 4, "queue": "team-language", "priorityClass": "high"}


def test_runtime_ref_trainjob_uses_the_users_runtime(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        DIGITS,
        {
            "spec": {
                "nodes": {"min": 2, "max": 2},
                "kubernetes": {"target": "trainjob", "gang": "none", "runtimeRef": "torch-distributed"},
            }
        },
    )
    objs = helm_template("-f", str(job))
    assert_same_objects(objs, compiled(job, "trainjob"))
    assert not {"TrainingRuntime", "ClusterTrainingRuntime"} & {o["kind"] for o in objs}


def test_disabled_metrics_render_no_monitoring(tmp_path: Path) -> None:
    job = write_job(tmp_path, DIGITS, {"spec": {"metrics": {"enabled": False}}})
    objs = helm_template("-f", str(job), *MONITORING, "--set", "monitoring.dashboard.enabled=true")
    assert_same_objects(objs, compiled(job, "pytorchjob", monitoring=True))
    assert {o["kind"] for o in objs} == {"ConfigMap", "PyTorchJob", "NetworkPolicy", "Secret"}


def test_chart_defaults_render_the_default_job(tmp_path: Path) -> None:
    from orchestrator.chart import values_document

    job = tmp_path / "default.yaml"
    job.write_text(yaml.safe_dump(values_document()))
    assert_same_objects(helm_template(), compiled(job, "pytorchjob"))


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_ci_values_render_what_torchrig_renders(values: Path, tmp_path: Path) -> None:
    doc = yaml.safe_load(values.read_text())
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({k: doc[k] for k in ("apiVersion", "kind", "metadata", "spec")}))
    target = doc["spec"]["kubernetes"]["target"]
    objs = helm_template("-f", str(values))
    assert_same_objects(objs, compiled(job, target, monitoring=True, fixed_size=doc["fixedSize"]))
    assert ("ConfigMap", f"{doc['metadata']['name']}-dashboard") in by_key(objs)


# -- every field of the model, generated --------------------------------------------------------------

# The chart's default job with one leaf of the model changed, for every leaf (tests/fixtures/spec_variants.py
# walks the model's schema; tests/unit/test_chart.py checks it leaves no field out).
DEFAULT_JOB = values_document()
VARIANTS = spec_variants.variants(DEFAULT_JOB)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_every_field_of_the_model_renders_what_torchrig_renders(variant: spec_variants.Variant, tmp_path: Path) -> None:
    for target in ("pytorchjob", "trainjob"):
        doc = variant.apply(DEFAULT_JOB)
        doc["spec"]["kubernetes"]["target"] = target
        job = write_job(tmp_path, doc, name=f"{target}.yaml")
        fixed = target == "trainjob" and load_spec(job).spec.nodes.elastic
        args = ["-f", str(job), *MONITORING, *(["--set", "fixedSize=true"] if fixed else [])]
        try:
            want = compiled(job, target, monitoring=True, fixed_size=fixed)
        except CompileError as exc:  # the chart must refuse what the compiler refuses, with its message
            proc = run_helm("template", "t", str(CHART), *args, check=False)
            assert proc.returncode != 0 and str(exc).split(": ", 1)[-1] in proc.stderr, (target, proc.stderr)
            continue
        assert_same_objects(helm_template(*args), want)


# -- chart-only objects -------------------------------------------------------------------------------


def test_dashboard_configmap_carries_the_dashboard() -> None:
    objs = helm_template(
        "-f", str(DIGITS), "--set", "monitoring.dashboard.enabled=true,monitoring.dashboard.labels.team=ml"
    )
    cm = by_key(objs)[("ConfigMap", "digits-ddp-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["labels"]["team"] == "ml"
    assert cm["metadata"]["namespace"] == "default"
    (text,) = cm["data"].values()
    assert json.loads(text) == json.loads((REPO / "orchestrator" / "monitoring" / "dashboard.json").read_text())


def test_checkpoint_pvcs_are_created_once_per_claim(tmp_path: Path) -> None:
    changes = copy.deepcopy(KITCHEN_SINK)
    job = write_job(tmp_path, DIGITS, changes)
    objs = helm_template(
        "-f", str(job), "--set", "checkpointPvc.create=true,checkpointPvc.size=5Gi,checkpointPvc.storageClassName=nfs"
    )
    pvcs = [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    assert [p["metadata"]["name"] for p in pvcs] == ["claim-a"]
    (pvc,) = pvcs
    assert pvc["metadata"]["namespace"] == "default"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "5Gi"}},
        "storageClassName": "nfs",
    }
    assert not [o for o in helm_template("-f", str(job)) if o["kind"] == "PersistentVolumeClaim"]


# -- validity -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
def test_every_rendered_object_is_valid(target: str, tmp_path: Path) -> None:
    objs: list[dict[str, Any]] = []
    everything = [*MONITORING, "--set", "monitoring.dashboard.enabled=true,checkpointPvc.create=true,fixedSize=true"]
    for example in EXAMPLES:
        job = write_job(tmp_path, example, {"spec": {"kubernetes": {"target": target}}}, name=example.name)
        objs += helm_template("-f", str(job), *everything)
    assert {o["kind"] for o in objs} >= {"ConfigMap", "PodMonitor", "PrometheusRule", "PersistentVolumeClaim"}
    core = [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    for obj in core:
        kubernetes_validate.validate(obj, crds.K8S_VERSION, strict=True)
    crds.assert_valid([o for o in objs if o not in core])


@pytest.mark.parametrize("values", [None, *EXAMPLES, *CI_VALUES], ids=lambda p: p.name if p else "defaults")
def test_helm_lint_strict(values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
    proc = run_helm(*args, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


# -- the schema rejects bad values before anything reaches a cluster ---------------------------------


@pytest.mark.parametrize(
    ("set_args", "where", "what"),
    [
        (["--set", "spec.training.stepz=10"], "/spec/training", "additional properties 'stepz' not allowed"),
        (["--set", "replicas=2"], "at ''", "additional properties 'replicas' not allowed"),
        (["--set", "spec.training.steps=-5"], "/spec/training/steps", "exclusiveMinimum"),
        (["--set-string", "spec.nodes.max=four"], "/spec/nodes/max", "want integer"),
        (["--set", "spec.training.precision=fp8"], "/spec/training/precision", "must be one of 'fp32', 'bf16', 'fp16'"),
        (["--set", "spec.resources.memory=4Gb"], "/spec/resources/memory", "does not match pattern"),
        (["--set", "metadata.name=Not_A_Name"], "/metadata/name", "does not match pattern"),
        (["--set", "monitoring.podMonitor.enable=true"], "/monitoring/podMonitor", "'enable' not allowed"),
        (["--set", "fixedSize=maybe"], "/fixedSize", "want boolean"),
    ],
)
def test_schema_rejects_bad_values_naming_the_field(set_args: list[str], where: str, what: str) -> None:
    proc = run_helm("template", "t", str(CHART), "-f", str(DIGITS), *set_args, check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert where in proc.stderr and what in proc.stderr, proc.stderr


def test_notes_tell_the_user_how_to_watch_the_job() -> None:
    proc = run_helm(
        "install",
        "t",
        str(CHART),
        "--dry-run=client",
        "-f",
        str(TINYGPT),
        "--set",
        "monitoring.podMonitor.enabled=true",
    )
    notes = proc.stdout.split("NOTES:", 1)[1]
    for line in (
        "kubectl -n ml-training get pytorchjob tinygpt-fsdp -w",
        "kubectl -n ml-training get pods -l torchrig.io/job=tinygpt-fsdp",
        "kubectl -n ml-training logs -f -l torchrig.io/job=tinygpt-fsdp",
        "port-forward",
        "9400:9400",
        "torchrig status kubernetes://ml-training/pytorchjob/tinygpt-fsdp",
        "file:///mnt/checkpoints (PVC tinygpt-checkpoints: must exist)",
        "torchrig validate",
    ):
        assert line in notes, f"NOTES lack {line!r}:\n{notes}"
    assert "elastic on 2..4 nodes x 8 process(es)" in notes


# -- the job's Secret and NetworkPolicy (issue 33.1) ---------------------------------------------------


def test_chart_generates_the_job_secret_and_keeps_it_with_lookup() -> None:
    """The pods mount `<job>-job-secret`; the chart makes it (64 random characters) and, on an upgrade, reuses
    the value of the Secret it made before (`lookup`: no cluster answers `helm template`, so each render
    here makes a new one)."""
    first, second = (by_key(helm_template("-f", str(DIGITS))) for _ in range(2))
    secret = first[("Secret", "digits-ddp-job-secret")]
    value = base64.b64decode(secret["data"]["job-secret"]).decode()
    assert len(value) == 64 and value.isalnum()
    assert second[("Secret", "digits-ddp-job-secret")]["data"] != secret["data"]
    assert secret["metadata"]["labels"]["torchrig.io/job"] == "digits-ddp"
    kubernetes_validate.validate(secret, crds.K8S_VERSION, strict=True)
    template = (CHART / "templates" / "secret.yaml").read_text()
    assert 'lookup "v1" "Secret" $job.metadata.namespace $name' in template
    assert 'index $existing.data "job-secret"' in template


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
def test_chart_network_policy_is_on_by_default_and_can_be_turned_off(target: str, tmp_path: Path) -> None:
    job = write_job(tmp_path, DIGITS, {"spec": {"kubernetes": {"target": target}}})
    objs = by_key(helm_template("-f", str(job), "--set", "fixedSize=true"))
    policy = objs[("NetworkPolicy", "digits-ddp")]
    assert policy == compiled(job, target, fixed_size=True)[1]
    kubernetes_validate.validate(policy, crds.K8S_VERSION, strict=True)
    off = write_job(tmp_path, DIGITS, {"spec": {"kubernetes": {"target": target, "networkPolicy": False}}})
    assert not [k for k in by_key(helm_template("-f", str(off), "--set", "fixedSize=true")) if k[0] == "NetworkPolicy"]
