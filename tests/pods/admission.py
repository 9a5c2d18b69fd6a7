"""The operators' validating webhooks, as a step before a rendered job starts in the harness.

`admit(objects)` returns the messages the webhooks would refuse the rendered objects with (empty: admitted),
in the order `kubectl apply` sends them: a TrainJob is checked against the runtimes already applied
before it (`objects` earlier in the list), as the Trainer's webhook reads its runtime from the API server.
Only the rules a rendered torchrig object can break are encoded; each names its source (see operators.py
for the commits):

- TO  pkg/webhooks/pytorch/pytorchjob_webhook.go `validatePyTorchJob`: metadata.name a DNS-1035 label;
  `validateSpec`: elasticPolicy needs a Worker replica spec, `elasticPolicy.nProcPerNode` not together
  with `nprocPerNode`; `validatePyTorchReplicaSpecs`: replica types Master/Worker only, containers with an
  image, a container named `pytorch`, Master replicas exactly 1, Worker replicas at least 1 when set.
- TV2 (tag v2.3.0) pkg/webhooks/trainjob_webhook.go `ValidateCreate` -> pkg/runtime/core/trainingruntime.go
  (clustertrainingruntime.go) `ValidateObjects`: the runtime must exist ("specified trainingRuntime must
  be created before the TrainJob is created"); then the plugins' `Validate`:
  plugins/jobset/jobset.go: a runtimePatch's `manager` is a domain-prefixed path, patches name only
  replicated jobs and containers of the runtime, and set no `env` on the `dataset-initializer`,
  `model-initializer` or `node` containers ("must not have envs for the ..."); plugins/torch/torch.go:
  `trainer.env` holds none of TorchRunReservedEnvNames (pkg/constants/constants.go: PET_NNODES,
  PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT).
- JS  pkg/webhooks/jobset_webhook.go `ValidateCreate`, applied to the JobSet the Trainer builds from the
  runtime (the JobSet named after the TrainJob): replicated-job names, the longest generated Job name
  (`<jobset>-<rjob>-<index>`) and Indexed pod name (`<job>-<pod index>-abcde`) DNS-1035 labels;
  `validateFailurePolicy`: onJobFailureReasons among the Job controller's reasons.
- KR  ray-operator/controllers/ray/utils/validation.go `ValidateRayJobMetadata` (name at most
  MaxRayJobNameLength = 47 characters, a DNS-1035 label), `ValidateRayJobSpec` (rayClusterSpec set;
  backoffLimit, activeDeadlineSeconds non-negative / positive, ttlSecondsAfterFinished non-negative),
  `ValidateRayClusterSpec` (a container in every group; minReplicas and maxReplicas both set without the
  autoscaler, neither negative, min <= max).
"""

from __future__ import annotations

import re
from typing import Any

from tests.pods.kubelet import strategic_merge

__all__ = ["AdmissionError", "admit", "check_admitted"]

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DOMAIN_PREFIXED = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+/.+$")
TORCHRUN_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
TV2_NO_ENV_CONTAINERS = ("dataset-initializer", "model-initializer", "node")  # jobset.go Validate
KR_MAX_RAYJOB_NAME = 47  # utils/constant.go MaxRayJobNameLength = MaxRayClusterNameLength (53) - 6
JOB_FAILURE_REASONS = (  # JS jobset_webhook.go validOnJobFailureReasons (batchv1 JobReason*)
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
)


class AdmissionError(Exception):
    """A webhook refused an object (the message is the webhook's)."""


def _dns1035(value: str, limit: int = 63) -> bool:
    """apimachinery validation.IsDNS1035Label."""
    return len(value) <= limit and bool(_DNS1035.match(value))


def _pytorchjob(job: dict[str, Any]) -> list[str]:
    errs: list[str] = []
    name = job["metadata"]["name"]
    if not _dns1035(name):
        errs.append(f"metadata.name: Invalid value: {name!r}: should match: a DNS-1035 label")
    spec = job.get("spec", {})
    replicas = spec.get("pytorchReplicaSpecs") or {}
    path = "spec.pytorchReplicaSpecs"
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in replicas:
            errs.append(f"{path}[Worker]: Required value: must be configured if elastic policy is used")
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            errs.append("spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode")
    if not replicas:
        errs.append(f"{path}: Required value: must be required")
    for rtype, rspec in replicas.items():
        rpath = f"{path}[{rtype}]"
        if rtype not in ("Master", "Worker"):
            errs.append(f'{rpath}: Unsupported value: "{rtype}": supported values: "Master", "Worker"')
        containers = ((rspec or {}).get("template", {}).get("spec", {}) or {}).get("containers") or []
        cpath = f"{rpath}.template.spec.containers"
        if not containers:
            errs.append(f"{cpath}: Required value: must be specified")
        for i, container in enumerate(containers):
            if not container.get("image"):
                errs.append(f"{cpath}[{i}].image: Required value: must be required")
        if not any(c.get("name") == "pytorch" for c in containers):
            errs.append(f"{cpath}: Required value: must have at least one container with name pytorch")
        count = (rspec or {}).get("replicas")
        if rtype == "Master" and count != 1:
            errs.append(f"{rpath}.replicas: Forbidden: must be 1")
        elif rtype != "Master" and count is not None and int(count) < 1:
            errs.append(f"{rpath}.replicas: Forbidden: must be at least 1")
    return errs


def _trainjob(tj: dict[str, Any], earlier: list[dict[str, Any]]) -> list[str]:
    ref = tj["spec"]["runtimeRef"]
    kind = ref.get("kind", "ClusterTrainingRuntime")
    ns = tj["metadata"].get("namespace", "default")
    runtimes = [
        o
        for o in earlier
        if o.get("kind") == kind
        and o["metadata"]["name"] == ref["name"]
        and (kind == "ClusterTrainingRuntime" or o["metadata"].get("namespace", "default") == ns)
    ]
    if not runtimes:
        return [
            f'spec.runtimeRef: Invalid value: {ref}: {kind.lower()}s.trainer.kubeflow.org "{ref["name"]}" not found: '
            f"specified {kind[0].lower() + kind[1:]} must be created before the TrainJob is created"
        ]
    runtime = runtimes[-1]
    errs: list[str] = []
    jobset = runtime["spec"]["template"]["spec"]
    containers = {
        rjob["name"]: {
            c["name"]
            for c in [
                *rjob["template"]["spec"]["template"]["spec"].get("initContainers", []),
                *rjob["template"]["spec"]["template"]["spec"].get("containers", []),
            ]
        }
        for rjob in jobset.get("replicatedJobs", [])
    }
    path = "spec.runtimePatches"
    for patch in tj["spec"].get("runtimePatches", []):
        if not _DOMAIN_PREFIXED.match(str(patch.get("manager", ""))):
            errs.append(f"{path}.manager: Invalid value: {patch.get('manager')!r}: must be a domain-prefixed path")
        spec = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec")
        for rjob in (spec or {}).get("replicatedJobs", []):
            if rjob["name"] not in containers:
                errs.append(f"{path}: must not have replicated job that doesn't exist in the runtime job template")
                continue
            pod = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
            for c in pod.get("initContainers", []):
                if c["name"] not in containers[rjob["name"]]:
                    errs.append(
                        f"{path}: must not have initContainer that doesn't exist in the runtime job {rjob['name']}"
                    )
            for c in pod.get("containers", []):
                if c["name"] not in containers[rjob["name"]]:
                    errs.append(f"{path}: must not have container that doesn't exist in the runtime job {rjob['name']}")
                elif c.get("env") and c["name"] in TV2_NO_ENV_CONTAINERS:
                    errs.append(f"{path}: must not have envs for the {', '.join(TV2_NO_ENV_CONTAINERS)} containers")
    if (runtime["spec"].get("mlPolicy") or {}).get("torch") is not None:
        env = {e["name"] for e in (tj["spec"].get("trainer") or {}).get("env", [])}
        reserved = sorted(env & set(TORCHRUN_RESERVED_ENV))
        if reserved:
            errs.append(f"spec.trainer.env: must not have reserved envs, invalid envs configured: {reserved}")
    errs += _jobset(tj["metadata"]["name"], _patched_jobset(jobset, tj))
    return errs


def _patched_jobset(jobset: dict[str, Any], tj: dict[str, Any]) -> dict[str, Any]:
    """The JobSet spec the Trainer builds: the runtime's, strategic-merge patched (trainingruntime.go)."""
    out = jobset
    for patch in tj["spec"].get("runtimePatches", []):
        spec = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec")
        if spec:
            out = strategic_merge(out, spec)
    return out


def _jobset(name: str, spec: dict[str, Any]) -> list[str]:
    errs: list[str] = []
    for rjob in spec.get("replicatedJobs", []):
        job_name = f"{name}-{rjob['name']}-{int(rjob.get('replicas', 1)) - 1}"  # placement.GenJobName
        if not _dns1035(rjob["name"]) or not _dns1035(job_name):
            errs.append(f"spec.replicatedJobs.name: Invalid value: {job_name!r}: not a DNS-1035 label (too long?)")
        job = rjob["template"]["spec"]
        if job.get("completionMode") == "Indexed" and job.get("completions") is not None:
            pod_name = f"{job_name}-{int(job['completions']) - 1}-abcde"  # placement.GenPodName + 5 chars
            if not _dns1035(pod_name):
                errs.append(f"spec.replicatedJobs.name: Invalid value: {job_name!r}: pod name {pod_name} too long")
    for rule in (spec.get("failurePolicy") or {}).get("rules", []):
        for reason in rule.get("onJobFailureReasons", []):
            if reason not in JOB_FAILURE_REASONS:
                errs.append(f"invalid job failure reason '{reason}' in failure policy is not a recognized one")
    return errs


def _rayjob(rj: dict[str, Any]) -> list[str]:
    errs: list[str] = []
    name = rj["metadata"]["name"]
    if len(name) > KR_MAX_RAYJOB_NAME:
        errs.append(f"The RayJob metadata is invalid: RayJob name should be no more than {KR_MAX_RAYJOB_NAME} chars")
    elif not _dns1035(name):
        errs.append("The RayJob metadata is invalid: RayJob name should be a valid DNS1035 label")
    spec = rj["spec"]
    if spec.get("ttlSecondsAfterFinished") is not None and int(spec["ttlSecondsAfterFinished"]) < 0:
        errs.append("The RayJob spec is invalid: TTLSecondsAfterFinished must be a non-negative integer")
    cluster = spec.get("rayClusterSpec")
    if cluster is None and not spec.get("clusterSelector"):
        errs.append("The RayJob spec is invalid: one of RayClusterSpec or ClusterSelector must be set")
    if spec.get("activeDeadlineSeconds") is not None and int(spec["activeDeadlineSeconds"]) <= 0:
        errs.append("The RayJob spec is invalid: activeDeadlineSeconds must be a positive integer")
    if spec.get("backoffLimit") is not None and int(spec["backoffLimit"]) < 0:
        errs.append("The RayJob spec is invalid: backoffLimit must be a positive integer")
    if cluster is None:
        return errs
    if not cluster["headGroupSpec"]["template"]["spec"].get("containers"):
        errs.append("The RayJob spec is invalid: headGroupSpec should have at least one container")
    autoscaling = bool(cluster.get("enableInTreeAutoscaling"))
    for group in cluster.get("workerGroupSpecs", []):
        g, lo, hi = group.get("groupName"), group.get("minReplicas"), group.get("maxReplicas")
        if not group["template"]["spec"].get("containers"):
            errs.append("The RayJob spec is invalid: workerGroupSpec should have at least one container")
        if not autoscaling and (lo is None or hi is None):
            errs.append(
                f"The RayJob spec is invalid: worker group {g} must set both minReplicas and maxReplicas "
                "when autoscaling is disabled"
            )
        for bound, value in (("minReplicas", lo), ("maxReplicas", hi)):
            if value is not None and int(value) < 0:
                errs.append(f"The RayJob spec is invalid: worker group {g} has negative {bound} {value}")
        if lo is not None and hi is not None and int(lo) > int(hi):
            errs.append(f"The RayJob spec is invalid: worker group {g} has minReplicas {lo} > maxReplicas {hi}")
    return errs


def admit(objects: list[dict[str, Any]]) -> list[str]:
    """What the webhooks refuse, `<kind>/<name>: <message>` each, applying `objects` in order."""
    out: list[str] = []
    for i, obj in enumerate(objects):
        kind = obj.get("kind")
        if kind == "PyTorchJob":
            errs = _pytorchjob(obj)
        elif kind == "TrainJob":
            errs = _trainjob(obj, objects[:i])
        elif kind == "RayJob":
            errs = _rayjob(obj)
        else:
            continue
        out += [f"{kind}/{obj['metadata']['name']}: admission webhook denied the request: {e}" for e in errs]
    return out


def check_admitted(objects: list[dict[str, Any]]) -> None:
    """Raise AdmissionError with every webhook's message when any object would be refused."""
    refused = admit(objects)
    if refused:
        raise AdmissionError("\n".join(refused))
