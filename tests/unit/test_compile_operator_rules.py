"""Rules of the operators' own source that the rendered manifests must follow (issue 40 items 1, 7-10) and
the job's secret and NetworkPolicy on every target (issue 33.1).

Sources (read with `git show <commit>:<path>`):
- TV2 = kubeflow/trainer tag v2.3.0 = 658725bdae5c7e3a0854d93ac6ff492e109a22ab;
- KR  = ray-project/kuberay tag v1.7.0 = 59d663aeec13760646da3db9c1cf8cfe883e30b7.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from orchestrator.compile import MANIFEST_TARGETS, compile, render
from orchestrator.compile._common import JOB_SECRET_FILE, job_secret_name, selector_labels
from orchestrator.compile.networkpolicy import compile_network_policy
from orchestrator.errors import UnsupportedFeature
from orchestrator.loader import load_spec, validate_document
from orchestrator.spec import JobSpec
from tests import crds
from tests.fixtures.common import REPO
from tests.unit.test_compile_hypothesis import job_documents
from tests.unit.test_pod_security import pss_restricted_problems
from training.contract import Env

# TV2 pkg/constants/constants.go TorchRunReservedEnvNames: what the torch plugin refuses in trainer.env.
TORCHRUN_RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
# TV2 plugins/jobset/jobset.go Validate: no env on these containers in a runtime patch.
NO_PATCH_ENV = {"node", "dataset-initializer", "model-initializer"}


def spec(name: str = "digits-ddp", *overrides: str) -> JobSpec:
    return load_spec(REPO / "examples" / f"{name}.yaml", list(overrides))


def by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind]
    return found


def _patch_containers(job: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for patch in job["spec"].get("runtimePatches", []):
        for rjob in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            out += rjob["template"]["spec"]["template"]["spec"].get("containers", [])
    return out


def _all(s: JobSpec) -> list[tuple[str, list[dict[str, Any]]]]:
    out = []
    for target in MANIFEST_TARGETS:
        try:
            out.append((target, compile(s, target, monitoring=True, fixed_size=True)))
        except UnsupportedFeature:
            continue
    return out


# -- issue 40.1: the TrainJob's env ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides", [(), ("spec.kubernetes.runtimeRef=torch-distributed", "spec.kubernetes.gang=none")]
)
def test_trainjob_env_is_the_trainers_and_no_runtime_patch_sets_env_on_node(overrides: tuple[str, ...]) -> None:
    """TV2 plugins/jobset/jobset.go Validate refuses `env` on the node container of a runtimePatch;
    plugins/torch/torch.go Validate refuses the reserved PET_* in `spec.trainer.env` and EnforceMLPolicy
    merges `spec.trainer.env` into the `node` container of any runtime, a user's included."""
    job = by_kind(compile(spec("tinygpt-fsdp", *overrides), "trainjob", fixed_size=True), "TrainJob")
    assert not [c for c in _patch_containers(job) if c.get("env") and c["name"] in NO_PATCH_ENV]
    names = {e["name"] for e in job["spec"]["trainer"]["env"]}
    assert names >= {Env.SPEC, Env.RUN_DIR, Env.JOB_SECRET_FILE} and not names & TORCHRUN_RESERVED


def test_runtime_patches_have_no_envfrom_and_a_user_runtime_with_a_store_secret_is_refused() -> None:
    """TV2 pkg/apis/trainer/v1alpha1/trainjob_types.go ContainerPatch: name, env, volumeMounts,
    securityContext; no envFrom (the vendored CRD agrees), so a store's secretRef needs torchrig's runtime."""
    schema = crds.crd_schema("trainer.kubeflow.org/v1alpha1", "TrainJob")
    patch = schema["properties"]["spec"]["properties"]["runtimePatches"]["items"]["properties"]
    pod = patch["trainingRuntimeSpec"]["properties"]["template"]["properties"]["spec"]["properties"]
    pod = pod["replicatedJobs"]["items"]["properties"]["template"]["properties"]["spec"]["properties"]
    pod = pod["template"]["properties"]["spec"]["properties"]
    assert set(pod["containers"]["items"]["properties"]) == {"name", "env", "volumeMounts", "securityContext"}
    s = spec("digits-ddp", "spec.kubernetes.runtimeRef=rt", "spec.kubernetes.gang=none")
    s.spec.checkpoint.stores[0].secret_ref = "s3-credentials"
    with pytest.raises(UnsupportedFeature, match=r"^spec.checkpoint.stores\[\]\.secretRef: "):
        compile(s, "trainjob", fixed_size=True)


# -- issue 40.9: Volcano on TrainJob --------------------------------------------------------------------


def test_trainjob_volcano_queue_is_the_annotation_trainer_reads_and_pods_name_the_scheduler() -> None:
    """TV2 plugins/volcano/volcano.go Build: the PodGroup's queue comes from the JobSet template's
    annotation `scheduling.volcano.sh/queue-name` only; Trainer sets no schedulerName on the pods."""
    objs = compile(spec("tinygpt-fsdp"), "trainjob", fixed_size=True)
    runtime = by_kind(objs, "TrainingRuntime")
    assert runtime["spec"]["podGroupPolicy"] == {"volcano": {}}
    assert runtime["spec"]["template"]["metadata"]["annotations"] == {
        "scheduling.volcano.sh/queue-name": "team-language"
    }
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["schedulerName"] == "volcano"
    crds.assert_valid(objs)
    kueue = by_kind(
        compile(spec("digits-ddp", "spec.kubernetes.gang=kueue"), "trainjob", fixed_size=True), "TrainingRuntime"
    )
    assert "metadata" not in kueue["spec"]["template"] and "schedulerName" not in str(kueue)


# -- issue 40.7 and 40.8: the RayJob's TTL and submitter ---------------------------------------------------


def test_rayjob_deletes_its_cluster_minutes_after_the_job_unless_the_spec_says() -> None:
    """KR rayjob_controller.go handleShutdownAfterJobFinishes: the RayCluster goes `ttlSecondsAfterFinished`
    after the job's end (with shutdownAfterJobFinishes); until then its pods hold their GPUs. The RayJob's
    own field (`spec.ray.clusterTtlSeconds`), not the other targets' day-long one."""
    job = by_kind(compile(spec(), "rayjob"), "RayJob")["spec"]
    assert job["shutdownAfterJobFinishes"] is True and job["ttlSecondsAfterFinished"] == 600
    kept = by_kind(compile(spec("digits-ddp", "spec.ray.clusterTtlSeconds=86400"), "rayjob"), "RayJob")
    assert kept["spec"]["ttlSecondsAfterFinished"] == 86400
    never = by_kind(compile(spec("digits-ddp", "spec.ray.clusterTtlSeconds=null"), "rayjob"), "RayJob")
    assert never["spec"]["shutdownAfterJobFinishes"] is False and "ttlSecondsAfterFinished" not in never["spec"]
    other = by_kind(compile(spec("digits-ddp", "spec.kubernetes.ttlSecondsAfterFinished=null"), "rayjob"), "RayJob")
    assert other["spec"]["ttlSecondsAfterFinished"] == 600
    # ... and says so: a spec written for a PyTorchJob that keeps its jobs, rendered as a RayJob.
    from orchestrator.compile import check_target

    assert check_target(spec("digits-ddp", "spec.kubernetes.ttlSecondsAfterFinished=null"), "rayjob") == [
        "spec.kubernetes.ttlSecondsAfterFinished: a RayJob does not use it; its Ray cluster is deleted 600 s after "
        "the job (spec.ray.clusterTtlSeconds)"
    ]
    assert check_target(spec(), "rayjob") == []
    # The other targets keep the model's default: a finished PyTorchJob holds no running pod.
    assert by_kind(compile(spec(), "pytorchjob"), "PyTorchJob")["spec"]["runPolicy"]["ttlSecondsAfterFinished"] == 86400


def test_rayjob_submitter_template_pulls_private_images_and_passes_restricted() -> None:
    """KR common/job.go GetSubmitterTemplate uses a given submitterPodTemplate as it is;
    rayjob_controller.go configureSubmitterContainer fills in the command only when the container has
    none, and appends the env. So the template must carry what the default lacks, and no command."""
    s = spec("tinygpt-fsdp")
    job = by_kind(compile(s, "rayjob"), "RayJob")
    template = job["spec"]["submitterPodTemplate"]
    pod = template["spec"]
    (ctr,) = pod["containers"]
    assert ctr["name"] == "ray-job-submitter" and "command" not in ctr and "args" not in ctr
    assert ctr["image"] == job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    assert pod["imagePullSecrets"] == [{"name": "ghcr-pull"}]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert ctr["resources"]["requests"] == ctr["resources"]["limits"]
    # What the Job controller would create from it, with KubeRay's env added: PSS restricted.
    final = {**pod, "containers": [{**ctr, "command": ["/bin/bash", "-ce", "--"], "env": []}]}
    assert pss_restricted_problems(final) == []
    # No member of the job (the NetworkPolicy admits it to the dashboard only).
    assert not set(selector_labels(s)) & set(template["metadata"]["labels"])
    crds.assert_valid([job])


# -- issue 40.10: the PodMonitor ---------------------------------------------------------------------------


def test_pod_monitor_selects_the_workers_not_the_ray_head() -> None:
    """KR common/pod.go BuildPod adds a container port named `metrics` (8080, Ray's own) to a Ray
    container that has none: the head. The PodMonitor scrapes port `metrics` of the pods it selects."""
    for target in MANIFEST_TARGETS:
        objs = compile(spec(), target, monitoring=True, fixed_size=True)
        selector = by_kind(objs, "PodMonitor")["spec"]["selector"]["matchLabels"]
        for path, template, _ in rendered_templates(objs):
            labels = template["metadata"]["labels"]
            selected = all(labels.get(k) == v for k, v in selector.items())
            ports = {p.get("name"): p["containerPort"] for p in template["spec"]["containers"][0].get("ports", [])}
            ports.setdefault("metrics", 8080) if target == "rayjob" else None  # what KubeRay adds
            assert selected == (ports.get("metrics") == 9400), (target, path)


# -- issue 33.1: the job's secret and NetworkPolicy ---------------------------------------------------------


def rendered_templates(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(path, pod template as it runs, env of its main container) of every pod template in `objs`: a
    TrainJob's node is its runtime's template (torchrig's, else an empty one) with the runtime patch merged
    by container name (TV2 core/trainingruntime.go mergeRuntimePatches) and `spec.trainer.env` added."""
    out = []
    runtime = next((o for o in objs if o["kind"] == "TrainingRuntime"), None)
    for o in objs:
        spec_ = o.get("spec", {})
        if o["kind"] == "PyTorchJob":
            out += [(f"PyTorchJob {k}", r["template"]) for k, r in spec_["pytorchReplicaSpecs"].items()]
        elif o["kind"] == "RayJob":
            cluster = spec_["rayClusterSpec"]
            out.append(("RayJob head", cluster["headGroupSpec"]["template"]))
            out += [(f"RayJob {g['groupName']}", g["template"]) for g in cluster["workerGroupSpecs"]]
            out.append(("RayJob submitterPodTemplate", spec_["submitterPodTemplate"]))
        elif o["kind"] == "TrainJob":
            rjob = spec_["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
            patch = rjob["template"]["spec"]["template"]
            base: dict[str, Any] = {"containers": [{"name": "node"}]}
            if runtime is not None:
                base = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
            pod = copy.deepcopy(base)
            for key, value in patch["spec"].items():
                if key == "containers":
                    pod["containers"][0].update(copy.deepcopy(value[0]))
                else:
                    pod[key] = copy.deepcopy(value)
            pod["containers"][0]["env"] = [*pod["containers"][0].get("env", []), *spec_["trainer"]["env"]]
            out.append(("TrainJob node", {"metadata": patch["metadata"], "spec": pod}))
    return [
        (path, t, {e["name"]: e.get("value") for e in t["spec"]["containers"][0].get("env", [])}) for path, t in out
    ]


@pytest.mark.parametrize("example", ["digits-ddp", "tinygpt-fsdp"])
@pytest.mark.parametrize(
    "overrides",
    [(), ("spec.restarts.spareNodes=1", "spec.restarts.spares=1", "spec.restarts.mode=auto")],
    ids=["plain", "standby"],
)
def test_every_pod_mounts_the_job_secret_read_only_and_is_told_where(example: str, overrides: tuple[str, ...]) -> None:
    s = spec(example, *overrides)
    for target, objs in _all(s):
        found = rendered_templates(objs)
        assert found, target
        for path, template, env in found:
            if "submitterPodTemplate" in path:
                continue
            pod = template["spec"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "torchrig-job-secret"]
            assert volumes["torchrig-job-secret"]["secret"]["secretName"] == job_secret_name(s.name), path
            assert volumes["torchrig-job-secret"]["secret"]["optional"] is False
            assert mounts == [{"name": "torchrig-job-secret", "mountPath": "/etc/torchrig-secret", "readOnly": True}]
            assert env[Env.JOB_SECRET_FILE] == JOB_SECRET_FILE == "/etc/torchrig-secret/job-secret", (target, path)


def test_no_rendered_output_holds_a_secret_value() -> None:
    """`render` names the Secret; it never makes one (`torchrig submit` and the chart do)."""
    s = spec("tinygpt-fsdp")
    for target in MANIFEST_TARGETS:
        text = render(s, target, monitoring=True, fixed_size=True)
        docs = list(yaml.safe_load_all(text))
        assert not [d for d in docs if d["kind"] == "Secret"]
        assert "job-secret" in text and not re.search(r"\b[0-9a-f]{64}\b", text)


@pytest.mark.parametrize("target", list(MANIFEST_TARGETS))
def test_network_policy_is_valid_strict_and_selects_the_jobs_pods(target: str) -> None:
    s = spec("tinygpt-fsdp")
    objs = compile(s, target, monitoring=True, fixed_size=True)
    policy = by_kind(objs, "NetworkPolicy")
    kubernetes_validate.validate(policy, crds.K8S_VERSION, strict=True)
    assert objs.index(policy) == 1  # applied before any pod can start
    assert policy["spec"]["podSelector"] == {"matchLabels": selector_labels(s)}
    found = rendered_templates(objs)
    assert found
    for path, template, _ in found:
        labels = template["metadata"]["labels"]
        member = all(labels.get(k) == v for k, v in selector_labels(s).items())
        assert member != ("submitter" in path), path


def test_pod_labels_cannot_take_the_pods_out_of_the_policy() -> None:
    """torchrig's labels win over `kubernetes.podLabels`: a pod relabelled out of the job would escape the
    NetworkPolicy (and the PodMonitor)."""
    s = spec("digits-ddp")
    s.spec.kubernetes.pod_labels = {"torchrig.io/job": "other", "app.kubernetes.io/instance": "other"}
    for _target, objs in _all(s):
        for path, template, _ in rendered_templates(objs):
            if "submitter" not in path:
                assert template["metadata"]["labels"]["torchrig.io/job"] == "digits-ddp"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=job_documents())
def test_random_specs_give_a_valid_policy_that_admits_exactly_their_exporters(doc: dict[str, Any]) -> None:
    s = validate_document(doc)
    for target in MANIFEST_TARGETS:
        (policy,) = compile_network_policy(s, target) or [None]
        if not s.spec.kubernetes.network_policy:
            assert policy is None
            continue
        assert policy is not None
        kubernetes_validate.validate(policy, crds.K8S_VERSION, strict=True)
        own, *rest = policy["spec"]["ingress"]
        assert own == {"from": [{"podSelector": {"matchLabels": selector_labels(s)}}], "ports": [{"protocol": "TCP"}]}
        metrics = [
            r
            for r in rest
            if r["from"][0].get("namespaceSelector") == {}
            and "podSelector" in r["from"][0]
            and r["from"][0]["podSelector"]["matchLabels"].get("app.kubernetes.io/name") == "prometheus"
        ]
        want = [s.spec.metrics.port + r for r in range(s.spec.procs_per_node)] if s.spec.metrics.enabled else []
        assert [p["port"] for r in metrics for p in r["ports"]] == want
        assert len(rest) == len(metrics) + (target == "rayjob")


def test_a_rayjob_on_ray_2_52_warns_that_kuberays_probes_need_wget() -> None:
    """KR common/pod.go initLivenessAndReadinessProbe: Ray < 2.53 gets `wget ... | grep success` exec probes,
    and torchrig's images carry no wget: the head would never be Ready, the submitter never created."""
    from orchestrator.compile import check_target

    (warning,) = check_target(spec("digits-ddp", "spec.ray.rayVersion='2.52.1'"), "rayjob")
    assert warning.startswith("spec.ray.rayVersion: 2.52.1: KubeRay probes a Ray older than 2.53 with `wget`")
    assert "\n" not in warning
    for version in ("2.53.0", "2.60.0", "3.0.0"):
        assert check_target(spec("digits-ddp", f"spec.ray.rayVersion='{version}'"), "rayjob") == []
