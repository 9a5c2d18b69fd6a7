"""The operators' contracts, from their source: rendered objects in, the pods they would run out.

Each function takes the objects `orchestrator.compile.compile(spec, target)` renders (plain dicts,
never the JobSpec) and returns the pods the operator would create, each with its name, hostname, DNS
names, the container's command/args and env exactly as the operator leaves them (the kubelet's
`$(VAR)` expansion and downward API come later, in kubelet.py), its volumes and restart policy.

Sources (read with `git show <commit>:<path>`; every rule below names its file and function):

- TO  = kubeflow/trainer branch release-1.9 (Training Operator v1, identical to tag v1.9.4 =
        4445c12aa62e4345b0c2c6ac9b215a70eca46ed7 except CHANGELOG.md; head 3a3a1da8d5287f9f96e1b2d3be6a4b6ad756566d).
- TV2 = kubeflow/trainer master 8c0f5059bd51ec3ba6d6a6a7b2e1471de7bc13b3 (2026-08-21; the CRDs in
        tests/schemas/crds come from this commit).
- JS  = kubernetes-sigs/jobset tag v0.12.0 = f22e565ac3cc3265c7c45ef67ecffdc689af5d77.
- K8S = kubernetes/kubernetes pkg/controller/job (read at 037091284e21741bb0427c489694e84774fff8cc).
- KR  = ray-project/kuberay tag v1.7.0 = 59d663aeec13760646da3db9c1cf8cfe883e30b7 (master
        feeaf72facab4881ba2b179248bb67315634e229 differs in neither common/ nor utils/ that matter here).
"""

from __future__ import annotations

import base64
import copy
import json
import re
from dataclasses import dataclass, field
from secrets import token_bytes
from typing import Any

from tests.pods.kubelet import CLUSTER_DOMAIN, Pod, service_names, strategic_merge, upsert_env

__all__ = [
    "KR_AUTH_HEADER",
    "RayJobPods",
    "go_quote",
    "operator_action",
    "pt_init_containers",
    "pytorchjob_pods",
    "rayjob_pods",
    "trainjob_pods",
]

# Stand-ins for the 5 random characters operators append (k8s rand.String alphabet, fixed here so
# names are reproducible).
RANDOM_SUFFIX = "x7b4q"


def _one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o.get("kind") == kind]
    if len(found) != 1:
        raise ValueError(f"expected one {kind} among the rendered objects, found {len(found)}")
    return found[0]


def _env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _container(template: dict[str, Any], name: str) -> dict[str, Any]:
    for c in template["spec"]["containers"]:
        if c["name"] == name:
            return copy.deepcopy(c)
    raise ValueError(f"no container named {name!r} in the pod template")


# ---------------------------------------------------------------------------------------------
# Training Operator v1: PyTorchJob
# ---------------------------------------------------------------------------------------------
PT_CONTAINER = "pytorch"  # TO pkg/apis/kubeflow.org/v1/pytorch_types.go PyTorchJobDefaultContainerName
PT_PORT_NAME = "pytorchjob-port"  # ibid. PyTorchJobDefaultPortName
PT_DEFAULT_PORT = 23456  # ibid. PyTorchJobDefaultPort (pytorch_defaults.go setPyTorchDefaultPort)


def _pt_port(replica: dict[str, Any]) -> int:
    """TO pytorch/envvar.go getPortFromPyTorchJob: the `pytorchjob-port` of container `pytorch`."""
    for port in _container(replica["template"], PT_CONTAINER).get("ports", []):
        if port.get("name") == PT_PORT_NAME:
            return int(port["containerPort"])
    return PT_DEFAULT_PORT  # defaulted by setPyTorchDefaultPort when missing


def _pt_operator_env(job: dict[str, Any], rtype: str, index: int) -> list[dict[str, Any]]:
    """TO pytorch/envvar.go setPodEnv (+ master.go, elastic.go): what the operator appends, in order."""
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    name = job["metadata"]["name"]
    total = sum(int(r.get("replicas", 1)) for r in replicas.values())  # getTotalReplicas (default 1)
    # pytorch_defaults.go setDefaultNprocPerNode: "auto" when neither field is set.
    elastic = spec.get("elasticPolicy")
    nproc = spec.get("nprocPerNode")
    if nproc is None and (elastic is None or elastic.get("nProcPerNode") is None):
        nproc = "auto"
    nproc_int = int(nproc) if nproc is not None and str(nproc).isdigit() else 1  # getNprocPerNodeInt
    env = [_env("PYTHONUNBUFFERED", "1")]
    if "Master" in replicas:
        # master.go MasterEnvVarGenerator: address = replicaName(job, Master, 0) = <job>-master-0.
        port = str(_pt_port(replicas["Master"]))
        addr = f"{name}-master-0"
        env += [_env("MASTER_PORT", port), _env("PET_MASTER_PORT", port)]
        env += [_env("MASTER_ADDR", addr), _env("PET_MASTER_ADDR", addr)]
        rank = index + 1 if rtype == "worker" else index  # workers come after the master
        env += [_env("WORLD_SIZE", str(total * nproc_int)), _env("RANK", str(rank))]
        env.append(_env("PET_NODE_RANK", str(rank)))
    if nproc is not None:
        env.append(_env("PET_NPROC_PER_NODE", str(nproc)))
    if elastic is not None:
        # elastic.go ElasticEnvVarGenerator.Generate, in its order.
        host = elastic.get("rdzvHost") or f"{name}-worker-0"
        port = elastic.get("rdzvPort") or _pt_port(replicas["Worker"])
        env.append(_env("PET_RDZV_ENDPOINT", f"{host}:{port}"))
        env.append(_env("PET_RDZV_BACKEND", elastic.get("rdzvBackend") or "c10d"))
        lo, hi = elastic.get("minReplicas"), elastic.get("maxReplicas")
        workers = int(replicas["Worker"].get("replicas", 1))
        # pytorch_defaults.go setElasticPolicy fills a missing bound from the other (or the replicas).
        lo = lo if lo is not None else (hi if hi is not None else workers)
        hi = hi if hi is not None else lo
        env.append(_env("PET_NNODES", f"{lo}:{hi}"))
        if elastic.get("maxRestarts") is not None:
            env.append(_env("PET_MAX_RESTARTS", str(elastic["maxRestarts"])))
        if elastic.get("nProcPerNode") is not None:
            env.append(_env("PET_NPROC_PER_NODE", str(elastic["nProcPerNode"])))
        if elastic.get("rdzvId") is not None:
            env.append(_env("PET_RDZV_ID", str(elastic["rdzvId"])))
        if elastic.get("rdzvConf"):
            env.append(_env("PET_RDZV_CONF", ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])))
        if elastic.get("standalone"):
            env.append(_env("PET_STANDALONE", ""))
    else:
        env.append(_env("PET_NNODES", str(total)))
    return env


def pytorchjob_pods(objects: list[dict[str, Any]], init_template: str | None = None) -> list[Pod]:
    """The pods of a rendered PyTorchJob, master first.

    - names: `<job>-<replica type lowercase>-<index>` (TO common/pod.go createNewPod ->
      common/util.go GenGeneralName); hostname = pod name (the operator sets no spec.hostname);
    - a headless Service of the same name per pod (common/service.go CreateNewService), so
      `<job>-master-0` / `<job>-worker-<i>` resolve to the pod;
    - env: the template's, then the operator's (envvar.go setPodEnv) appended to every container;
    - restart: the replica's restartPolicy is copied to the pod, except `ExitCode` -> pod `Never`
      (TO pkg/core/pod.go SetRestartPolicy); the operator then reacts to a Failed pod
      (common/pod.go ReconcilePods, see `operator_action`);
    - the Services are headless without `publishNotReadyAddresses` (common/service.go CreateNewService:
      ClusterIP None, nothing else set), so a pod's names resolve only while it is Ready;
    - Workers of a job with a Master get the init container `init-pytorch` (pytorch/initcontainer.go
      setInitContainer, called from pytorchjob_controller.go SetClusterSpec for every pod): `nslookup
      <job>-master-0` every 2 s, up to `--pytorch-init-container-max-tries` (100) times, image
      `--pytorch-init-container-image` (alpine:3.10), no securityContext; the operator's
      `--pytorch-init-container-template-file` (/etc/config/initContainer.yaml) replaces the template
      when it exists. No init container without a Master (elastic jobs), and none on the Master.
    """
    job = _one(objects, "PyTorchJob")
    name, ns = job["metadata"]["name"], job["metadata"].get("namespace", "default")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    pods: list[Pod] = []
    init = pt_init_containers(name, init_template) if "Master" in replicas else []
    for rtype in ("Master", "Worker"):  # pytorch_defaults.go setPyTorchTypeNamesToCamelCase
        if rtype not in replicas:
            continue
        replica = replicas[rtype]
        policy = replica.get("restartPolicy") or "OnFailure"  # PyTorchJobDefaultRestartPolicy
        template = replica["template"]
        for index in range(int(replica.get("replicas", 1))):
            pod_name = f"{name}-{rtype.lower()}-{index}"
            container = _container(template, PT_CONTAINER)
            container["env"] = [*container.get("env", []), *_pt_operator_env(job, rtype.lower(), index)]
            labels = dict(template.get("metadata", {}).get("labels", {}))
            # common/pod.go createNewPod: GenLabels + replica type/index (+ job-role=master).
            labels.update(
                {
                    "training.kubeflow.org/job-name": name,
                    "training.kubeflow.org/operator-name": "pytorchjob-controller",
                    "training.kubeflow.org/replica-type": rtype.lower(),
                    "training.kubeflow.org/replica-index": str(index),
                }
            )
            pods.append(
                Pod(
                    name=pod_name,
                    namespace=ns,
                    hostname=pod_name,
                    container=container,
                    volumes=copy.deepcopy(template["spec"].get("volumes", [])),
                    labels=labels,
                    annotations=dict(template.get("metadata", {}).get("annotations", {})),
                    restart_policy="Never" if policy == "ExitCode" else policy,
                    replica_policy=policy,
                    dns_names=service_names(pod_name, ns),
                    role=f"{rtype.lower()}-{index}",
                    init_containers=[
                        *copy.deepcopy(template["spec"].get("initContainers", [])),
                        *(copy.deepcopy(init) if rtype == "Worker" else []),
                    ],
                    publish_not_ready=False,
                )
            )
    return pods


PT_INIT_IMAGE = "alpine:3.10"  # TO pkg/config/config.go PyTorchInitContainerImageDefault
PT_INIT_MAX_TRIES = 100  # ibid. PyTorchInitContainerMaxTriesDefault


def pt_init_containers(job_name: str, template: str | None = None) -> list[dict[str, Any]]:
    """TO pytorch/initcontainer.go GetInitContainer for `replicaName(job, Master, 0)`: the built-in
    initContainerTemplate, or `template` (the text of the operator's --pytorch-init-container-template-file)
    with its `{{.MasterAddr}}`, `{{.InitContainerImage}}` and `{{.MaxTries}}` filled in."""
    master = f"{job_name}-master-0"
    if template is not None:
        import yaml

        values = {".MasterAddr": master, ".InitContainerImage": PT_INIT_IMAGE, ".MaxTries": str(PT_INIT_MAX_TRIES)}
        text = template
        for key, value in values.items():
            text = text.replace("{{" + key + "}}", value)
        found: list[dict[str, Any]] = yaml.safe_load(text)
        return found
    script = (
        f"err=1;for i in $(seq {PT_INIT_MAX_TRIES}); do if nslookup {master}; then err=0 && break; fi;"
        "echo waiting for master; sleep 2; done; exit $err"
    )
    return [
        {
            "name": "init-pytorch",
            "image": PT_INIT_IMAGE,
            "imagePullPolicy": "IfNotPresent",
            "resources": {"limits": {"cpu": "100m", "memory": "20Mi"}, "requests": {"cpu": "50m", "memory": "10Mi"}},
            "command": ["sh", "-c", script],
        }
    ]


def operator_action(pod: Pod, exit_code: int) -> str:
    """What the PyTorchJob operator and the kubelet do when the pod's container exits.

    Returns `done` (exit 0), `kubelet-restart` (pod restartPolicy OnFailure/Always: the kubelet
    restarts the container in place, same pod), `recreate` (pod Failed, operator deletes it and
    creates a new pod of the same name) or `fail-job` (the job is marked Failed, nothing restarts).
    TO common/pod.go ReconcilePods: a Failed pod is recreated under ExitCode with a retryable code
    (pkg/util/train/train_util.go IsRetryableExitCode: code >= 128), OnFailure or Always; ExitCode
    with a code < 128 fails the job; `Never` leaves it Failed (UpdateJobStatus: the job fails).
    """
    if exit_code == 0:
        return "done"
    if pod.restart_policy in ("OnFailure", "Always"):
        return "kubelet-restart"
    if pod.replica_policy == "JobSet":
        return _jobset_action(pod, exit_code)
    if pod.replica_policy == "ExitCode":
        return "recreate" if exit_code >= 128 else "fail-job"
    if pod.replica_policy in ("OnFailure", "Always"):
        return "recreate"
    return "fail-job"


def _jobset_action(pod: Pod, exit_code: int) -> str:
    """A failed pod (restartPolicy Never) of a JobSet's Job.

    K8S pkg/controller/job/pod_failure_policy.go matchPodFailurePolicy: the first rule whose
    `onExitCodes` (containerName, operator In/NotIn, values) matches decides: FailJob fails the Job
    with reason PodFailurePolicy, Ignore does not count the failure, Count counts it against
    `backoffLimit` (default 6); past the limit the Job fails (reason BackoffLimitExceeded).
    JS pkg/controllers/failure_policy.go applyFailurePolicy: a failed Job fails the JobSet when a
    rule with action FailJobSet lists the Job's failure reason in `onJobFailureReasons`; otherwise
    the JobSet is restarted (every Job recreated) while `restarts < failurePolicy.maxRestarts`.
    Returns `fail-job`, `recreate` (the Job replaces the pod) or `restart-all` (the JobSet restarts).
    """
    ctl = pod.controller
    reason = None
    for rule in (ctl.get("podFailurePolicy") or {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if not codes or codes.get("containerName", pod.container["name"]) != pod.container["name"]:
            continue
        hit = exit_code in codes["values"]
        if hit == (codes.get("operator", "In") == "In"):
            if rule["action"] == "FailJob":
                reason = "PodFailurePolicy"
            elif rule["action"] == "Ignore":
                return "recreate"
            break
    if reason is None:
        if ctl["failures"] < int(ctl.get("backoffLimit", 6)):
            ctl["failures"] += 1
            return "recreate"
        reason = "BackoffLimitExceeded"
    policy = ctl.get("failurePolicy") or {}
    for rule in policy.get("rules", []):
        if reason in rule.get("onJobFailureReasons", [reason]) and rule.get("action") == "FailJobSet":
            return "fail-job"
    if ctl["restarts"] < int(policy.get("maxRestarts", 0)):
        ctl["restarts"] += 1
        return "restart-all"
    return "fail-job"


# ---------------------------------------------------------------------------------------------
# Kubeflow Trainer v2: TrainJob -> JobSet -> Jobs -> pods
# ---------------------------------------------------------------------------------------------
TV2_NODE = "node"  # TV2 pkg/constants/constants.go Node (replicated job and container name)
TV2_ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"  # constants.LabelTrainJobAncestor
TV2_TRAINER_PORT = 29500  # constants.ContainerTrainerPort
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # K8S batch.JobCompletionIndexAnnotation


def _trainjob_spec(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """TrainJob, its runtime, and the JobSet spec after the TrainJob's runtimePatches."""
    tj = _one(objects, "TrainJob")
    ref = tj["spec"]["runtimeRef"]
    runtimes = [o for o in objects if o.get("kind") == ref.get("kind") and o["metadata"]["name"] == ref["name"]]
    if len(runtimes) != 1:
        raise NotImplementedError(f"runtime {ref['name']!r} is not among the rendered objects")
    runtime = runtimes[0]
    jobset = copy.deepcopy(runtime["spec"]["template"]["spec"])
    # TV2 pkg/runtime/core/trainingruntime.go mergeRuntimePatches: a strategic merge patch of the
    # JobSet spec per runtime patch, in order (replicatedJobs merge by name).
    for patch in tj["spec"].get("runtimePatches", []):
        rt_patch = (patch.get("trainingRuntimeSpec") or {}).get("template", {}).get("spec")
        if rt_patch:
            jobset = strategic_merge(jobset, rt_patch)
    return tj, runtime, jobset


def trainjob_pods(objects: list[dict[str, Any]]) -> list[Pod]:
    """The pods of a rendered TrainJob (torch runtime), by completion index.

    - JobSet named after the TrainJob (TV2 plugins/jobset/jobset.go Build); node count = TrainJob
      `trainer.numNodes`, else the runtime's `mlPolicy.numNodes` (plugins/torch/torch.go
      EnforceMLPolicy; jobset.go SyncParallelCount sets parallelism = completions = count);
    - container `node` of the ancestor-`trainer` replicated job: image/command/args from
      `spec.trainer` (plugins/jobset/builder.go Trainer), `trainer.env` upserted, then the torch
      plugin upserts PET_NNODES, PET_NPROC_PER_NODE (`numProcPerNode`, else "auto" -> CPUs),
      PET_NODE_RANK (fieldRef of the completion-index annotation), PET_MASTER_ADDR
      `<trainjob>-node-0-0.<trainjob>` and PET_MASTER_PORT 29500, and container port 29500;
    - JobSet defaults (JS pkg/webhooks/jobset_webhook.go Default): completionMode Indexed, pod
      restartPolicy OnFailure when unset, enableDNSHostnames true; subdomain = JobSet name
      (pkg/controllers/jobset_controller.go constructJob/GetSubdomain); Job name
      `<jobset>-<rjob>-<jobIdx>` (pkg/util/placement/placement.go GenJobName); JobSet labels and
      annotations on pods (labelAndAnnotateObject);
    - the Job controller (K8S pkg/controller/job/job_controller.go manageJob,
      indexed_job_utils.go): hostname `<job>-<index>`, pod name `<job>-<index>-<5 random>`,
      annotation/label `batch.kubernetes.io/job-completion-index`, env JOB_COMPLETION_INDEX from it
      (addCompletionIndexEnvVariable, appended when absent).
    """
    tj, runtime, jobset = _trainjob_spec(objects)
    name, ns = tj["metadata"]["name"], tj["metadata"].get("namespace", "default")
    trainer = tj["spec"].get("trainer") or {}
    ml = runtime["spec"].get("mlPolicy") or {}
    count = int(trainer.get("numNodes") or ml.get("numNodes") or 1)
    nproc = trainer.get("numProcPerNode")
    if nproc is None:
        nproc = "auto"  # the harness ignores resources, so "auto" stays as torchrun's own default
    subdomain = (jobset.get("network") or {}).get("subdomain") or name
    pods: list[Pod] = []
    for rjob in jobset["replicatedJobs"]:
        if (rjob["template"].get("metadata", {}).get("labels") or {}).get(TV2_ANCESTOR_LABEL) != "trainer":
            raise NotImplementedError(f"replicated job {rjob['name']!r}: only the trainer step is emulated")
        template = copy.deepcopy(rjob["template"]["spec"]["template"])
        container = _container(template, TV2_NODE)
        if trainer.get("image"):
            container["image"] = trainer["image"]
        if trainer.get("command") is not None:
            container["command"] = list(trainer["command"])
        if trainer.get("args") is not None:
            container["args"] = list(trainer["args"])
        env = upsert_env(container.get("env", []), *trainer.get("env", []))
        env = upsert_env(
            env,
            _env("PET_NNODES", str(count)),
            _env("PET_NPROC_PER_NODE", str(nproc)),
            _field_env("PET_NODE_RANK", f"metadata.annotations['{COMPLETION_INDEX}']"),
            _env("PET_MASTER_ADDR", f"{name}-{TV2_NODE}-0-0.{name}"),
            _env("PET_MASTER_PORT", str(TV2_TRAINER_PORT)),
        )
        container["ports"] = [*container.get("ports", []), {"containerPort": TV2_TRAINER_PORT}]
        if not any(e["name"] == "JOB_COMPLETION_INDEX" for e in env):
            env.append(_field_env("JOB_COMPLETION_INDEX", f"metadata.annotations['{COMPLETION_INDEX}']"))
        container["env"] = env
        restart = template["spec"].get("restartPolicy") or "OnFailure"
        # Shared by the pods of the JobSet: the Job's failure rules, the JobSet's restart budget.
        controller = {
            "podFailurePolicy": rjob["template"]["spec"].get("podFailurePolicy"),
            "backoffLimit": rjob["template"]["spec"].get("backoffLimit", 6),
            "failurePolicy": jobset.get("failurePolicy"),
            "failures": 0,
            "restarts": 0,
        }
        for job_idx in range(int(rjob.get("replicas", 1))):
            job_name = f"{name}-{rjob['name']}-{job_idx}"
            for index in range(count):
                hostname = f"{job_name}-{index}"
                labels = dict(template.get("metadata", {}).get("labels", {}))
                labels.update(
                    {
                        "jobset.sigs.k8s.io/jobset-name": name,
                        "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                        "jobset.sigs.k8s.io/job-index": str(job_idx),
                        "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob.get("replicas", 1)),
                        COMPLETION_INDEX: str(index),
                    }
                )
                annotations = dict(template.get("metadata", {}).get("annotations", {}))
                annotations.update({"jobset.sigs.k8s.io/jobset-name": name, COMPLETION_INDEX: str(index)})
                fqdn = f"{hostname}.{subdomain}"
                pods.append(
                    Pod(
                        name=f"{job_name}-{index}-{RANDOM_SUFFIX}",
                        namespace=ns,
                        hostname=hostname,
                        subdomain=subdomain,
                        container=copy.deepcopy(container),
                        volumes=copy.deepcopy(template["spec"].get("volumes", [])),
                        labels=labels,
                        annotations=annotations,
                        restart_policy=restart,
                        replica_policy="JobSet",
                        controller=controller,
                        dns_names=[fqdn, f"{fqdn}.{ns}", f"{fqdn}.{ns}.svc", f"{fqdn}.{ns}.svc.{CLUSTER_DOMAIN}"],
                        role=f"{rjob['name']}-{index}",
                        init_containers=copy.deepcopy(template["spec"].get("initContainers", [])),
                        # JS jobset_controller.go constructService: PublishNotReadyAddresses defaults to true.
                        publish_not_ready=bool((jobset.get("network") or {}).get("publishNotReadyAddresses", True)),
                    )
                )
    return pods


# ---------------------------------------------------------------------------------------------
# KubeRay: RayJob -> RayCluster (head + worker groups) + submitter Job
# ---------------------------------------------------------------------------------------------
KR_GCS_PORT = 6379  # KR utils/constant.go DefaultGcsServerPort
KR_DASHBOARD_PORT = 8265  # DefaultDashboardPort
KR_METRICS_PORT = 8080  # DefaultMetricsPort
KR_AGENT_PORT = 52365  # DefaultDashboardAgentListenPort
KR_SUBMITTER = "ray-job-submitter"  # SubmitterContainerName
KR_HEALTH_PATH = "api/gcs_healthz"  # RayDashboardGCSHealthPath
KR_HEALTH_TIMEOUT_S = 10  # RayDashboardGCSHealthCheckTimeoutSeconds
KR_AUTH_MODE_ENV = "RAY_AUTH_MODE"  # utils/constant.go RAY_AUTH_MODE_ENV_VAR
KR_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"  # RAY_AUTH_TOKEN_ENV_VAR
KR_AUTH_TOKEN_KEY = "auth_token"  # RAY_AUTH_TOKEN_SECRET_KEY
KR_AUTH_HEADER = "x-ray-authorization"  # utils/dashboardclient/dashboard_httpclient.go: "Bearer <token>"
_BASE_PYTHON_HEALTH = (
    "python -c \"import urllib.request; r=urllib.request.urlopen('%s', timeout=%d); "
    "exit(0 if b'success' in r.read() else 1)\""
)  # KR utils/constant.go BasePythonHealthCommand


@dataclass
class RayJobPods:
    """The pods KubeRay runs for a RayJob, and the names it derives."""

    cluster: str
    head: Pod
    workers: list[Pod]
    submitter: Pod
    dashboard_url: str  # Status.DashboardURL: `<cluster>-head-svc.<ns>.svc.cluster.local:8265`
    submission_id: str  # Status.JobId
    secrets: list[dict[str, Any]] = field(default_factory=list)  # what KubeRay creates (the auth token)
    auth_token: str | None = None  # the token the head wants (authOptions mode token), else None


def go_quote(text: str) -> str:
    """Go's `strconv.Quote` for the characters a runtime env holds (KR common/job.go quotes with it)."""
    out = ['"']
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _quantity_bytes(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if str(q).endswith(suffix):
            return int(float(str(q)[: -len(suffix)]) * factor)
    return int(float(q))


def _ray_start(node_type: str, params: dict[str, str], container: dict[str, Any], address: str | None) -> str:
    """KR common/pod.go setMissingRayStartParams + generateRayStartCommand + convertParamMap."""
    params = dict(params)
    if node_type == "worker" and "address" not in params:
        params["address"] = address or ""
    if node_type == "head":
        params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", str(KR_METRICS_PORT))
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", str(KR_AGENT_PORT))
    limits = (container.get("resources") or {}).get("limits") or {}
    requests = (container.get("resources") or {}).get("requests") or {}
    if "num-cpus" not in params:
        cpu = limits.get("cpu") or requests.get("cpu")
        if cpu is not None:
            params["num-cpus"] = str(int(float(str(cpu).rstrip("m")) / (1000 if str(cpu).endswith("m") else 1)))
    if "memory" not in params and limits.get("memory") is not None:
        params["memory"] = str(_quantity_bytes(limits["memory"]))
    if "num-gpus" not in params:
        gpus = [v for k, v in limits.items() if k.endswith("/gpu") and int(v) > 0]
        if gpus:
            params["num-gpus"] = str(gpus[0])
    flags = []
    for key in sorted(params):  # convertParamMap: sorted keys; "true" -> bare flag, "false" dropped
        value = params[key]
        if value.lower() in ("true", "false") and key not in ("log-color", "include-dashboard", "include-log-monitor"):
            if value.lower() == "true":
                flags.append(f" --{key} ")
        else:
            flags.append(f" --{key}={value} ")
    return ("ray start --head " if node_type == "head" else "ray start ") + "".join(flags)


def _check_name(name: str) -> str:
    """KR utils/util.go CheckName: the last 50 characters; a leading digit or punctuation becomes `r`."""
    name = name[-50:] if len(name) > 50 else name
    return "r" + name[1:] if name[0].isdigit() or not name[0].isalnum() else name


def _auth_secret_name(cluster: str, cspec: dict[str, Any]) -> str | None:
    """The Secret holding the token when `authOptions.mode` is `token` (KR utils.IsAuthEnabled), else None.

    `authOptions.secretName` (the user's), else `CheckName(<cluster>)` (common/pod.go
    SetContainerTokenAuthEnvVars). Kubernetes-delegated token auth (`enableK8sTokenAuth`) is not emulated.
    """
    auth = cspec.get("authOptions") or {}
    if auth.get("mode") != "token":
        return None
    if auth.get("enableK8sTokenAuth"):
        raise NotImplementedError("authOptions.enableK8sTokenAuth is not emulated")
    return str(auth.get("secretName") or _check_name(cluster))


def _auth_secret(cluster: str, ns: str, name: str) -> dict[str, Any]:
    """KR raycluster_controller.go reconcileAuthSecret -> createAuthSecret: a Secret of the cluster's
    name with `stringData.auth_token` = generateRandomToken(32) (32 random bytes, base64 StdEncoding)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": ns, "labels": {"ray.io/cluster": cluster}},
        "stringData": {KR_AUTH_TOKEN_KEY: base64.b64encode(token_bytes(32)).decode()},
    }


def _set_token_auth_env(env: list[dict[str, Any]], secret: str) -> None:
    """KR common/pod.go SetContainerTokenAuthEnvVars: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from the
    Secret's `auth_token` key, each appended unless the container sets it already (utils.EnvVarExists)."""
    names = {e["name"] for e in env}
    if KR_AUTH_MODE_ENV not in names:
        env.append(_env(KR_AUTH_MODE_ENV, "token"))
    if KR_AUTH_TOKEN_ENV not in names:
        ref = {"secretKeyRef": {"name": secret, "key": KR_AUTH_TOKEN_KEY}}
        env.append({"name": KR_AUTH_TOKEN_ENV, "valueFrom": ref})


def _ray_pod(
    rj: dict[str, Any],
    cluster: str,
    group: dict[str, Any],
    node_type: str,
    index: int,
    fqdn_head: str,
    auth_secret: str | None = None,
) -> Pod:
    """KR common/pod.go DefaultHeadPodTemplate / DefaultWorkerPodTemplate + BuildPod.

    With token auth (`auth_secret`), DefaultHeadPodTemplate / DefaultWorkerPodTemplate call
    configureTokenAuth before BuildPod: the auth env goes to the Ray container (after the template's
    env, before BuildPod's) and to the worker's `wait-gcs-ready` init container (after its copy of the
    template's env), whose `ray health-check` needs the token too.
    """
    ns = rj["metadata"].get("namespace", "default")
    template = copy.deepcopy(group["template"])
    container = template["spec"]["containers"][0]  # utils.RayContainerIndex
    group_name = "headgroup" if node_type == "head" else group["groupName"]  # RayNodeHeadGroupLabelValue
    head_port = str(group.get("rayStartParams", {}).get("port", KR_GCS_PORT))  # GetHeadPort
    start = _ray_start(node_type, group.get("rayStartParams", {}), container, f"{fqdn_head}:{KR_GCS_PORT}")
    cmd = " ".join([*container.get("command", []), *container.get("args", [])])
    if "ray start" not in cmd:  # BuildPod: the generated command replaces (or follows) the user's
        generated = "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; " + start
        container["command"] = ["/bin/bash", "-c", "--"]  # utils.GetContainerCommand([])
        container["args"] = [f"{cmd} && {generated}" if cmd else generated]
    # BuildPod -> addEmptyDir: /dev/shm as a Memory emptyDir unless one is mounted there already.
    mounts = container.setdefault("volumeMounts", [])
    volumes = template["spec"].setdefault("volumes", [])
    if not any(m["mountPath"] == "/dev/shm" for m in mounts):
        volumes.append({"name": "shared-mem", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "shared-mem", "mountPath": "/dev/shm"})
    env = container.setdefault("env", [])
    if auth_secret is not None:
        _set_token_auth_env(env, auth_secret)  # configureTokenAuth
    # setContainerEnvVars, in order.
    short_head = fqdn_head.split(".", maxsplit=1)[0]  # utils.ExtractRayIPFromFQDN (RAY_IP, deprecated)
    if node_type == "worker":
        env += [_env("FQ_RAY_IP", fqdn_head), _env("RAY_IP", short_head)]
    env += [
        _field_env("RAY_CLUSTER_NAME", "metadata.labels['ray.io/cluster']"),
        _field_env("RAY_CLUSTER_NAMESPACE", "metadata.namespace"),
        _field_env("RAY_CLOUD_INSTANCE_ID", "metadata.name"),
        _field_env("RAY_NODE_TYPE_NAME", "metadata.labels['ray.io/group']"),
        _env("KUBERAY_GEN_RAY_START_CMD", start),
    ]
    names = {e["name"] for e in env}
    if "RAY_PORT" not in names:
        env.append(_env("RAY_PORT", head_port))
    if "RAY_ADDRESS" not in names:
        ip = "127.0.0.1" if node_type == "head" else fqdn_head  # utils.LOCAL_HOST for the head
        env.append(_env("RAY_ADDRESS", f"{ip}:{head_port}"))
    if "RAY_USAGE_STATS_KUBERAY_IN_USE" not in names:
        env.append(_env("RAY_USAGE_STATS_KUBERAY_IN_USE", "1"))
    if node_type == "head":
        env.append(_env("RAY_USAGE_STATS_EXTRA_TAGS", "kuberay_version=v1.7.0;kuberay_crd=RayJob"))
    if "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE" not in names:
        env.append(_env("RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE", "1"))
    _inject_readiness_probe(container, node_type, group.get("rayStartParams", {}), rj["spec"]["rayClusterSpec"])
    labels = dict(template.get("metadata", {}).get("labels", {}))
    # labelPod: ray.io/{cluster,group,node-type} are not overridable.
    labels.update({"ray.io/is-ray-node": "yes", "ray.io/cluster": cluster, "ray.io/node-type": node_type})
    labels["ray.io/group"] = group_name
    # utils.PodName(prefix, type, generateName): `<cluster>-head-xxxxx`, `<cluster>-<group>-worker-xxxxx`.
    prefix = cluster if node_type == "head" else f"{cluster}-{group_name}"
    pod_name = f"{prefix[:50]}-{node_type}-{RANDOM_SUFFIX[:4]}{index}"
    init: list[dict[str, Any]] = []
    if node_type == "worker":
        # DefaultWorkerPodTemplate: init container `wait-gcs-ready` (ENABLE_INIT_CONTAINER_INJECTION
        # defaults to true) loops on `ray health-check` until the head's GCS answers.
        script = (
            "\n\t\t\t\t\tSECONDS=0\n\t\t\t\t\twhile true; do\n\t\t\t\t\t\tif (( SECONDS <= 120 )); then\n"
            f"\t\t\t\t\t\t\tif ray health-check --address {fqdn_head}:{head_port} > /dev/null 2>&1; then\n"
            '\t\t\t\t\t\t\t\techo "GCS is ready."\n\t\t\t\t\t\t\t\tbreak\n\t\t\t\t\t\t\tfi\n'
            '\t\t\t\t\t\t\techo "$SECONDS seconds elapsed: Waiting for GCS to be ready."\n'
            "\t\t\t\t\t\telse\n"
            f"\t\t\t\t\t\t\tif ray health-check --address {fqdn_head}:{head_port}; then\n"
            '\t\t\t\t\t\t\t\techo "GCS is ready. Any error messages above can be safely ignored."\n'
            "\t\t\t\t\t\t\t\tbreak\n\t\t\t\t\t\t\tfi\n"
            '\t\t\t\t\t\t\techo "$SECONDS seconds elapsed: Still waiting for GCS to be ready."\n'
            "\t\t\t\t\t\tfi\n\t\t\t\t\t\tsleep 5\n\t\t\t\t\tdone\n\t\t\t\t"
        )
        init_env = copy.deepcopy(group["template"]["spec"]["containers"][0].get("env", []))
        if auth_secret is not None:
            _set_token_auth_env(init_env, auth_secret)  # configureTokenAuth: the wait-gcs-ready init container
        init.append(
            {
                "name": "wait-gcs-ready",
                "command": ["/bin/bash", "-c", "--"],
                "args": [script],
                # setInitContainerEnvVars (BuildPod) appends FQ_RAY_IP and RAY_IP.
                "env": [*init_env, _env("FQ_RAY_IP", fqdn_head), _env("RAY_IP", short_head)],
            }
        )
    pod = Pod(
        name=pod_name,
        namespace=ns,
        hostname=pod_name,
        container=container,
        volumes=volumes,
        labels=labels,
        annotations=dict(template.get("metadata", {}).get("annotations", {})),
        restart_policy=template["spec"].get("restartPolicy") or "Always",
        role="head" if node_type == "head" else f"worker-{index}",
        init_containers=init,
    )
    return pod


def _inject_readiness_probe(
    container: dict[str, Any], node_type: str, params: dict[str, str], cspec: dict[str, Any]
) -> None:
    """KR common/pod.go BuildPod -> initLivenessAndReadinessProbe (ENABLE_PROBES_INJECTION defaults to true):
    a Ray container without a readinessProbe gets one. From Ray 2.53 (supportsUnifiedHealthCheck) an
    httpGet of the dashboard agent's `/api/healthz` (utils.RayNodeHealthPath) on `dashboard-agent-listen-port`
    (52365), initialDelaySeconds 10, periodSeconds 5, timeoutSeconds 5 on the head and 2 on workers,
    failureThreshold 10 (utils/constant.go DefaultReadinessProbe*). Older Rays get a `wget ... | grep success`
    exec probe instead: not emulated (torchrig's images have no wget; the RayJob needs Ray >= 2.52).

    The liveness probe KubeRay injects beside it is left out on purpose: it kills a container only after
    120 failures 5 s apart (DefaultLivenessProbeFailureThreshold), longer than any scenario here, and each
    probe is a process (a `podman exec` in the containers)."""
    if container.get("readinessProbe"):
        return
    version = tuple(int(x) for x in re.findall(r"\d+", str(cspec.get("rayVersion", "0")))[:3])
    if version < (2, 53):
        raise NotImplementedError(f"rayVersion {cspec.get('rayVersion')}: KubeRay's wget probes are not emulated")
    container["readinessProbe"] = {
        "initialDelaySeconds": 10,
        "timeoutSeconds": 5 if node_type == "head" else 2,
        "periodSeconds": 5,
        "successThreshold": 1,
        "failureThreshold": 10,
        "httpGet": {"path": "/api/healthz", "port": int(params.get("dashboard-agent-listen-port", KR_AGENT_PORT))},
    }


def _submitter_args(rj: dict[str, Any], address: str, job_id: str) -> str:
    """KR common/job.go BuildJobSubmitCommand (K8sJobMode), joined with spaces (configureSubmitterContainer)."""
    spec = rj["spec"]
    health = _BASE_PYTHON_HEALTH % (f"{address}/{KR_HEALTH_PATH}", KR_HEALTH_TIMEOUT_S)
    waiting = go_quote(f"Waiting for Ray Dashboard GCS to become healthy at {address} ...")
    cmd = ["until", health, ">/dev/null", "2>&1", ";", "do", "echo", waiting, ";", "sleep", "2", ";", "done", ";"]
    cmd += ["if", "!", "ray", "job", "status", "--address", address, job_id, ">/dev/null", "2>&1", ";", "then"]
    cmd += ["ray", "job", "submit", "--address", address, "--no-wait"]
    if spec.get("runtimeEnvYAML"):
        import yaml

        # getRuntimeEnvJson: sigs.k8s.io/yaml YAMLToJSON (keys sorted, compact), then strconv.Quote.
        as_json = json.dumps(yaml.safe_load(spec["runtimeEnvYAML"]), sort_keys=True, separators=(",", ":"))
        cmd += ["--runtime-env-json", go_quote(as_json)]
    if spec.get("metadata"):
        cmd += ["--metadata-json", go_quote(json.dumps(spec["metadata"], sort_keys=True, separators=(",", ":")))]
    cmd += ["--submission-id", job_id]
    if spec.get("entrypointNumCpus"):
        cmd += ["--entrypoint-num-cpus", f"{float(spec['entrypointNumCpus']):f}"]
    if spec.get("entrypointNumGpus"):
        cmd += ["--entrypoint-num-gpus", f"{float(spec['entrypointNumGpus']):f}"]
    if spec.get("entrypointResources"):
        cmd += ["--entrypoint-resources", go_quote(spec["entrypointResources"])]
    cmd += ["--", spec["entrypoint"].strip(), ";", "fi", ";"]
    cmd += ["ray", "job", "logs", "--address", address, "--follow", job_id]
    return " ".join(cmd)


def rayjob_pods(objects: list[dict[str, Any]]) -> RayJobPods:
    """The pods KubeRay would run for a rendered RayJob (K8sJobMode, the default submissionMode).

    - cluster `<rayjob>-<5 random>` (KR utils/util.go GenerateRayClusterName), head Service
      `<cluster>-head-svc` (GenerateHeadServiceName) and the RayJob's own `<rayjob>-head-svc`
      (common/job.go BuildHeadServiceForRayJob), both to the head pod;
    - head/worker containers: `/bin/bash -c -- "ulimit -n ...; ray start [--head] <rayStartParams>"`
      with KubeRay's defaults (common/pod.go BuildPod, setMissingRayStartParams: dashboard-host
      0.0.0.0 on the head, metrics-export-port 8080, --block, dashboard-agent-listen-port 52365;
      generateRayStartCommand: num-cpus/memory/num-gpus from the container limits) and env
      (setContainerEnvVars); workers get `address=<head FQDN>:6379` and the `wait-gcs-ready` init
      container; only `replicas` workers per group are started (the autoscaler is not emulated);
    - submitter: a Job named after the RayJob, backoffLimit 2 (rayjob_controller.go createNewK8sJob),
      its pod the RayJob's `submitterPodTemplate` as it is (its container's securityContext and
      resources, its labels, restartPolicy, volumes), else one container `ray-job-submitter` with the
      head's image, 1 CPU / 1Gi limits and restartPolicy Never (common/job.go GetSubmitterTemplate,
      GetDefaultSubmitterContainer); a container without a command gets `/bin/bash -ce --` and the
      joined BuildJobSubmitCommand; env PYTHONUNBUFFERED, RAY_DASHBOARD_ADDRESS, RAY_JOB_SUBMISSION_ID
      appended (configureSubmitterContainer); labels `ray.io/originated-from-cr-name`,
      `ray.io/originated-from-crd: RayJob` and `app.kubernetes.io/created-by: kuberay-operator`
      added to the template's (getSubmitterTemplate); job id `<rayjob>-<5 random>` (GenerateRayJobId); address
      `http://` + Status.DashboardURL = `<cluster>-head-svc.<ns>.svc.cluster.local:8265`
      (utils.FetchHeadServiceURL);
    - `rayClusterSpec.authOptions.mode: token` (KubeRay >= 1.5.1): a Secret `CheckName(<cluster>)`
      with a random `auth_token` (raycluster_controller.go reconcileAuthSecret; none when
      `authOptions.secretName` names the user's own), and RAY_AUTH_MODE=token + RAY_AUTH_TOKEN from
      that Secret in the head, the workers, their `wait-gcs-ready` init containers and the submitter
      (common/pod.go configureTokenAuth / SetContainerTokenAuthEnvVars, rayjob_controller.go
      configureSubmitterContainer). The operator's own dashboard client then sends the token as
      `x-ray-authorization: Bearer <token>` (utils.GetRayDashboardClientFunc, dashboard_httpclient.go).
    """
    rj = _one(objects, "RayJob")
    name, ns = rj["metadata"]["name"], rj["metadata"].get("namespace", "default")
    spec = rj["spec"]
    if spec.get("submissionMode", "K8sJobMode") != "K8sJobMode":
        raise NotImplementedError("only submissionMode K8sJobMode is emulated")
    cluster = f"{name}-{RANDOM_SUFFIX}"
    cspec = spec["rayClusterSpec"]
    head_svc = f"{cluster}-head-svc"
    fqdn_head = f"{head_svc}.{ns}.svc.{CLUSTER_DOMAIN}"
    auth_secret = _auth_secret_name(cluster, cspec)
    own_secret = auth_secret is not None and not cspec["authOptions"].get("secretName")
    made = [_auth_secret(cluster, ns, auth_secret)] if own_secret and auth_secret else []
    head = _ray_pod(rj, cluster, cspec["headGroupSpec"], "head", 0, fqdn_head, auth_secret)
    # Both head Services are headless with publishNotReadyAddresses (KR common/service.go
    # BuildServiceForHeadPod, which BuildHeadServiceForRayJob calls too): the Pod default holds.
    head.dns_names = [*service_names(head_svc, ns), *service_names(f"{name}-head-svc", ns)]
    workers = []
    for group in cspec.get("workerGroupSpecs", []):
        replicas = int(group.get("replicas", group.get("minReplicas", 0)))
        for i in range(replicas * int(group.get("numOfHosts", 1))):
            workers.append(_ray_pod(rj, cluster, group, "worker", i, fqdn_head, auth_secret))
    dashboard_url = f"{fqdn_head}:{KR_DASHBOARD_PORT}"
    job_id = f"{name}-{RANDOM_SUFFIX}"
    head_image = cspec["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    # GetSubmitterTemplate: the RayJob's submitterPodTemplate as it is, else one default container.
    template = copy.deepcopy(spec.get("submitterPodTemplate") or {})
    template_spec = template.get("spec") or {}
    submitter_container: dict[str, Any] = (template_spec.get("containers") or [None])[0] or {
        "name": KR_SUBMITTER,
        "image": head_image,
        "resources": {"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "500m", "memory": "200Mi"}},
    }  # GetDefaultSubmitterContainer
    if not submitter_container.get("command"):  # configureSubmitterContainer (K8sJobMode): only without one
        submitter_container["command"] = ["/bin/bash", "-ce", "--"]
        submitter_container["args"] = [_submitter_args(rj, "http://" + dashboard_url, job_id)]
    submitter_container["env"] = [
        *submitter_container.get("env", []),
        _env("PYTHONUNBUFFERED", "1"),
        _env("RAY_DASHBOARD_ADDRESS", dashboard_url),
        _env("RAY_JOB_SUBMISSION_ID", job_id),
    ]
    if auth_secret is not None:
        _set_token_auth_env(submitter_container["env"], auth_secret)  # configureSubmitterContainer
    # getSubmitterTemplate: the template's labels plus KubeRay's three.
    labels = {
        **((template.get("metadata") or {}).get("labels") or {}),
        "ray.io/originated-from-cr-name": name,
        "ray.io/originated-from-crd": "RayJob",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    submitter = Pod(
        name=f"{name}-{RANDOM_SUFFIX}",
        namespace=ns,
        hostname=f"{name}-{RANDOM_SUFFIX}",
        container=submitter_container,
        volumes=template_spec.get("volumes") or [],
        labels=labels,
        annotations=dict((template.get("metadata") or {}).get("annotations") or {}),
        restart_policy=template_spec.get("restartPolicy") or "Never",
        role="submitter",
    )
    token = made[0]["stringData"][KR_AUTH_TOKEN_KEY] if made else None
    return RayJobPods(cluster, head, workers, submitter, dashboard_url, job_id, made, token)
