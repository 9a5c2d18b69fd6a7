"""The Kubernetes backend: creates the compiled objects with the official `kubernetes` client.

`torchrig submit JOB.yaml --backend kubernetes` compiles the spec (`orchestrator.compile.compile`) into
a ConfigMap, a NetworkPolicy, a PyTorchJob or TrainJob (per `spec.kubernetes.target`, a TrainJob with its
TrainingRuntime), and with `--monitoring` a PodMonitor. It also creates the job's Secret `<name>-job-secret`
(`orchestrator.compile._common.job_secret`: 32 random bytes, hex, that the job's processes share to sign
their orders) unless it exists: a resubmit keeps it, as the pods of a running job must keep agreeing.
Every object is first sent as a server-side dry run (`dryRun=All`), so admission, schema and RBAC problems
surface before anything exists; only then are they created for real (`--dry-run` stops after the
server-side pass). A TrainJob whose runtime this submit creates is dry-run once that runtime exists
(`_schedule`). Core kinds go through `CoreV1Api`, custom resources
through `CustomObjectsApi` (`utils.create_from_yaml` cannot create custom resources).

Run ids are `kubernetes://<namespace>/<target>/<name>` (`<namespace>/<name>` is accepted too).
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any, ClassVar

from orchestrator.backends.api_timeout import api_timeout
from orchestrator.backends.base import Backend, Capabilities, DryRun, RunHandle, RunState, RunStatus, SubmitOptions
from orchestrator.backends.kubernetes_api import (
    JOB_LABEL,
    MANAGED_BY_LABEL,
    TARGET_KINDS,
    TYPES,
    ApiClient,
    ResourceType,
    call,
    create_object,
    delete_object,
    describe,
    new_client,
    pod_index,
    read_object,
    resource_type,
    state_from_conditions,
    translate,
    unreachable,
)
from orchestrator.compile._common import JOB_SECRET_KEY, job_secret_name
from orchestrator.errors import BackendError, SpecError
from orchestrator.spec import JobSpec

_RUNTIME_KINDS = ("TrainingRuntime", "ClusterTrainingRuntime")
# What Trainer's webhook says of a TrainJob whose runtime it cannot read (pkg/runtime/core/trainingruntime.go).
RUNTIME_MISSING = "must be created before the TrainJob is created"
RUNTIME_SEEN_FIRST_DELAY_S = 0.25
RUNTIME_SEEN_TIMEOUT_S = 8.0


def _with_value(obj: dict[str, Any]) -> dict[str, Any]:
    """A Secret of the job (`_common.job_secret`, no value) with 32 fresh random bytes, hex; else `obj`."""
    if obj.get("kind") != "Secret" or "data" in obj:
        return obj
    value = secrets.token_hex(32).encode()
    return {**obj, "data": {JOB_SECRET_KEY: base64.b64encode(value).decode()}}


__all__ = ["JOB_LABEL", "MANAGED_BY_LABEL", "KubernetesBackend", "ResourceType", "resource_type"]


class KubernetesBackend(Backend):
    """Submits compiled manifests to a cluster and manages their lifecycle.

    Args:
        context: kubeconfig context (default: the current one); `SubmitOptions.kubernetes.context`
            overrides it.
        namespace: namespace for lifecycle commands (default: all namespaces for `list`).
        kubeconfig: kubeconfig file (default: `$KUBECONFIG` or `~/.kube/config`, else in-cluster).
    """

    name: ClassVar[str] = "kubernetes"
    capabilities: ClassVar[Capabilities] = Capabilities(elastic=True, multi_node=True, gpus=True)

    def __init__(self, context: str | None = None, namespace: str | None = None, kubeconfig: str | None = None) -> None:
        self.context = context
        self.namespace = namespace
        self.kubeconfig = kubeconfig

    # -- client ----------------------------------------------------------------------------------
    def _client(self, context: str | None = None) -> ApiClient:
        return new_client(self.kubeconfig, context or self.context)

    def _create(self, api: ApiClient, obj: dict[str, Any], *, dry_run: bool) -> dict[str, Any]:
        return create_object(api, obj, dry_run=dry_run, namespace=self.namespace or "default")

    def _delete(self, api: ApiClient, obj: dict[str, Any], *, missing_ok: bool = True) -> None:
        delete_object(api, obj, namespace=self.namespace or "default", missing_ok=missing_ok)

    # -- submit ----------------------------------------------------------------------------------
    def _check(self, spec: JobSpec, options: SubmitOptions) -> None:
        if spec.spec.kubernetes.target not in TARGET_KINDS:  # pragma: no cover - the model restricts it
            raise SpecError(f"spec.kubernetes.target: unsupported target {spec.spec.kubernetes.target!r}")

    def _dry_run(self, spec: JobSpec, options: SubmitOptions) -> list[dict[str, Any]]:
        from orchestrator.compile import _common
        from orchestrator.compile import compile as compile_target

        manifests = compile_target(
            spec, spec.spec.kubernetes.target, monitoring=options.monitoring, fixed_size=options.fixed_size
        )
        namespace = options.kubernetes.namespace
        out: list[dict[str, Any]] = []
        # The job's Secret first, without its value: `_schedule` makes one only where none exists yet.
        for compiled in [_common.job_secret(spec), *manifests]:
            obj: dict[str, Any] = json.loads(json.dumps(compiled))  # a private copy: never mutate the compiler's
            rtype = resource_type(obj)
            if rtype.namespaced and namespace:
                obj.setdefault("metadata", {})["namespace"] = namespace
            out.append(obj)
        return out

    def _schedule(self, dryrun: DryRun) -> RunHandle:
        """Server-side dry run, then create: the job's Secret (kept when it exists), then the companions
        (spec ConfigMap, NetworkPolicy, TrainingRuntime, monitoring), then the job.

        A PyTorchJob is dry-run with the rest, so nothing is created unless every object would be. A
        TrainJob whose runtime this submit creates can only be dry-run once that runtime exists: Trainer's
        webhook reads it (kubeflow/trainer v2.3.0 `pkg/runtime/core/trainingruntime.go` ValidateObjects,
        from `pkg/webhooks/trainjob_webhook.go`). So its dry run follows the runtime's creation, and a
        refusal then removes what this submit created.
        """
        manifests: list[dict[str, Any]] = dryrun.request
        api = self._client(dryrun.options.kubernetes.context)
        try:
            job = next(o for o in manifests if o["kind"] in TARGET_KINDS.values())
            namespace = job["metadata"].get("namespace") or self.namespace or "default"
            target = next(t for t, k in TARGET_KINDS.items() if k == job["kind"])
            secrets = [o for o in manifests if o["kind"] == "Secret"]
            companions = [o for o in manifests if o is not job and o["kind"] != "Secret"]
            # Its runtime emitted here: the TrainJob's dry run must wait for the runtime's creation.
            job_after = job["kind"] == "TrainJob" and any(o["kind"] in _RUNTIME_KINDS for o in companions)
            new_secrets = [o for o in secrets if not read_object(api, o, namespace=namespace)]
            stale: list[dict[str, Any]] = []
            for obj in [*new_secrets, *companions, *([] if job_after else [job])]:
                try:
                    self._create(api, _with_value(obj), dry_run=True)
                except BackendError as exc:
                    if "already exists" not in str(exc) or obj is job:
                        raise
                    # The job is absent, so this is a leftover of a finished (TTL-deleted) run of the same job;
                    # a training runtime is replaced only while no other TrainJob still runs on it.
                    self._refuse_if_runtime_in_use(api, obj, namespace)
                    stale.append(obj)
            handle = RunHandle(
                backend=self.name,
                run_id=f"{namespace}/{target}/{job['metadata']['name']}",
                info={"objects": [describe(o) for o in manifests], "dry_run": dryrun.options.dry_run},
            )
            if dryrun.options.dry_run:
                handle.info["manifests"] = manifests
                handle.info["replaced"] = [describe(o) for o in stale]
                handle.info["kept"] = [describe(o) for o in secrets if not any(o is n for n in new_secrets)]
                if job_after:
                    handle.info["not_dry_run"] = [f"{describe(job)}: its runtime must exist first"]
                return handle
            created: list[dict[str, Any]] = []
            try:
                for obj in [*new_secrets, *companions]:
                    if any(obj is s for s in stale):
                        self._delete(api, obj)
                    self._create(api, _with_value(obj), dry_run=False)
                    created.append(obj)
                if job_after:
                    self._dry_run_when_runtime_seen(api, job)
                self._create(api, job, dry_run=False)
            except BackendError:
                for obj in reversed(created):
                    self._delete(api, obj)
                raise
            handle.info["created"] = [describe(o) for o in [*created, job]]
            return handle
        finally:
            api.close()

    def _dry_run_when_runtime_seen(self, api: ApiClient, job: dict[str, Any]) -> None:
        """Dry-run the TrainJob until Trainer's webhook sees its new runtime: the webhook reads runtimes
        from its informer's cache, which may lag the creation by a moment."""
        delay_s = RUNTIME_SEEN_FIRST_DELAY_S
        deadline = time.monotonic() + RUNTIME_SEEN_TIMEOUT_S
        while True:
            try:
                self._create(api, job, dry_run=True)
                return
            except BackendError as exc:
                if RUNTIME_MISSING not in str(exc) or time.monotonic() + delay_s > deadline:
                    raise
            time.sleep(delay_s)
            delay_s *= 2

    @staticmethod
    def _refuse_if_runtime_in_use(api: ApiClient, obj: dict[str, Any], namespace: str) -> None:
        """Raise when `obj` is a (Cluster)TrainingRuntime that a TrainJob other than this one references."""
        from kubernetes import client

        kind = obj.get("kind")
        if kind not in ("TrainingRuntime", "ClusterTrainingRuntime"):
            return
        name = obj["metadata"]["name"]
        custom = client.CustomObjectsApi(api)
        what = f"listing the TrainJobs that use {kind} {name}"
        if kind == "TrainingRuntime":
            found = call(
                what, custom.list_namespaced_custom_object, "trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs"
            )
        else:
            found = call(what, custom.list_cluster_custom_object, "trainer.kubeflow.org", "v1alpha1", "trainjobs")
        users = [
            f"{j['metadata'].get('namespace', namespace)}/{j['metadata']['name']}"
            for j in found.get("items", [])
            if (j.get("spec") or {}).get("runtimeRef", {}).get("name") == name
            and (j.get("spec") or {}).get("runtimeRef", {}).get("kind", "ClusterTrainingRuntime") == kind
        ]
        if users:
            raise BackendError(
                f"{kind} {name}: already exists and TrainJob {', '.join(sorted(users))} still uses it; "
                "it is not replaced: wait for that job, or name another runtime (spec.kubernetes.runtimeRef)"
            )

    # -- lifecycle -------------------------------------------------------------------------------
    def _parse_run_id(self, run_id: str) -> tuple[str, list[str], str]:
        text = run_id.removeprefix("kubernetes://")
        parts = [p for p in text.split("/") if p]
        if len(parts) == 3 and parts[1] in TARGET_KINDS:
            return parts[0], [parts[1]], parts[2]
        if len(parts) == 2:
            return parts[0], list(TARGET_KINDS), parts[1]
        if len(parts) == 1:
            return self.namespace or "default", list(TARGET_KINDS), parts[0]
        raise SpecError(f"run id {run_id!r}: expected kubernetes://<namespace>/<{'|'.join(TARGET_KINDS)}>/<name>")

    def _get_job(self, api: ApiClient, run_id: str) -> tuple[str, str, str, dict[str, Any]]:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        namespace, targets, name = self._parse_run_id(run_id)
        custom: Any = client.CustomObjectsApi(api)
        for target in targets:
            rtype = TYPES[TARGET_KINDS[target]]
            what = f"reading {rtype.kind} {namespace}/{name}"
            try:
                obj: dict[str, Any] = custom.get_namespaced_custom_object(
                    rtype.group, rtype.version, namespace, rtype.plural, name, _request_timeout=api_timeout().pair()
                )
            except ApiException as exc:
                if exc.status == 404 and len(targets) > 1:
                    continue  # not this kind (or its CRD is not installed): try the next target
                raise translate(what, exc, rtype) from None
            except HTTPError as exc:
                raise unreachable(what, exc) from None
            return namespace, target, name, dict(obj)
        raise BackendError(f"no PyTorchJob or TrainJob named {name!r} in namespace {namespace!r}")

    def _status(self, run_id: str) -> RunStatus:
        api = self._client()
        try:
            namespace, target, name, obj = self._get_job(api, run_id)
        finally:
            api.close()
        state, message = state_from_conditions(obj)
        handle = RunHandle(self.name, f"{namespace}/{target}/{name}")
        return RunStatus(handle, state, message, details={"status": obj.get("status") or {}})

    def _pods(self, api: ApiClient, namespace: str, name: str) -> list[Any]:
        from kubernetes import client

        core = client.CoreV1Api(api)
        pods = call(
            f"listing pods of {namespace}/{name}",
            core.list_namespaced_pod,
            namespace,
            label_selector=f"{JOB_LABEL}={name}",
        )
        return sorted(pods.items, key=lambda p: (pod_index(p) is None, pod_index(p) or 0, p.metadata.name))

    def _pod_for_index(self, api: ApiClient, namespace: str, name: str, index: int) -> Any:
        pods = [p for p in self._pods(api, namespace, name) if pod_index(p) == index]
        if not pods:
            raise BackendError(f"job {namespace}/{name} has no pod for node index {index}")
        # The newest pod of that index (a restarted replica leaves its predecessor terminating).
        return max(pods, key=lambda p: str(p.metadata.creation_timestamp or ""))

    def _logs(self, run_id: str, rank: int | None, follow: bool) -> Iterator[str]:
        from kubernetes import client

        api = self._client()
        try:
            namespace, _, name = self._parse_run_id(run_id)
            core = client.CoreV1Api(api)
            if rank is not None:
                pods = [self._pod_for_index(api, namespace, name, rank)]
            else:
                pods = self._pods(api, namespace, name)
                if not pods:
                    raise BackendError(f"job {namespace}/{name} has no pods (yet)")
            for pod in pods:
                prefix = "" if len(pods) == 1 else f"[{pod.metadata.name}] "
                what = f"logs of pod {namespace}/{pod.metadata.name}"
                if follow:
                    resp = call(
                        what,
                        core.read_namespaced_pod_log,
                        pod.metadata.name,
                        namespace,
                        follow=True,
                        _preload_content=False,
                        _request_timeout=api_timeout().stream(),  # a quiet pod is not a dead server
                    )
                    try:
                        pending = b""
                        for chunk in resp.stream(1024):
                            pending += chunk
                            *lines, pending = pending.split(b"\n")
                            for line in lines:
                                yield prefix + line.decode(errors="replace")
                        if pending:
                            yield prefix + pending.decode(errors="replace")
                    finally:
                        resp.release_conn()
                else:
                    text = call(what, core.read_namespaced_pod_log, pod.metadata.name, namespace)
                    for line in str(text).splitlines():
                        yield prefix + line
        finally:
            api.close()

    def _cancel(self, run_id: str) -> RunStatus:
        from kubernetes import client

        api = self._client()
        try:
            namespace, target, name, _ = self._get_job(api, run_id)
            kind = TARGET_KINDS[target]
            rtype = TYPES[kind]
            # Foreground: the job object goes only after its pods, so `status` never shows a job
            # that is gone while its workers still write checkpoints. Checkpoint stores are untouched.
            job = {"apiVersion": rtype.api_version, "kind": kind, "metadata": {"name": name, "namespace": namespace}}
            self._delete(api, job, missing_ok=False)
            # The job's companions (spec ConfigMap, PodMonitor, PrometheusRule, NetworkPolicy, its Secret), so a
            # re-submit starts clean.
            core = client.CoreV1Api(api)
            maps = call(
                f"listing ConfigMaps of {namespace}/{name}",
                core.list_namespaced_config_map,
                namespace,
                label_selector=f"{JOB_LABEL}={name}",
            )
            companions: list[dict[str, Any]] = [
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": m.metadata.name, "namespace": namespace}}
                for m in maps.items
            ]
            companions += [
                {
                    "apiVersion": "monitoring.coreos.com/v1",
                    "kind": k,
                    "metadata": {"name": name, "namespace": namespace},
                }
                for k in ("PodMonitor", "PrometheusRule")
            ]
            # No pod of the job is left (Foreground), so none still needs the job's secret.
            companions += [
                {
                    "apiVersion": "networking.k8s.io/v1",
                    "kind": "NetworkPolicy",
                    "metadata": {"name": name, "namespace": namespace},
                },
                {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": {"name": job_secret_name(name), "namespace": namespace},
                },
            ]
            for obj in companions:
                self._delete(api, obj)
        finally:
            api.close()
        return RunStatus(RunHandle(self.name, f"{namespace}/{target}/{name}"), RunState.CANCELLED, "deleted")

    def _list(self) -> list[RunStatus]:
        from kubernetes import client

        api = self._client()
        out: list[RunStatus] = []
        try:
            custom = client.CustomObjectsApi(api)
            selector = f"{MANAGED_BY_LABEL}=torchrig"
            for target, kind in TARGET_KINDS.items():
                rtype = TYPES[kind]
                try:
                    if self.namespace:
                        listed = call(
                            f"listing {kind}s",
                            custom.list_namespaced_custom_object,
                            rtype.group,
                            rtype.version,
                            self.namespace,
                            rtype.plural,
                            label_selector=selector,
                            rtype=rtype,
                        )
                    else:
                        listed = call(
                            f"listing {kind}s",
                            custom.list_cluster_custom_object,
                            rtype.group,
                            rtype.version,
                            rtype.plural,
                            label_selector=selector,
                            rtype=rtype,
                        )
                except BackendError as exc:
                    if "is not installed" in str(exc):
                        continue  # a cluster with only one of the operators
                    raise
                for obj in listed.get("items", []):
                    meta = obj.get("metadata", {})
                    state, message = state_from_conditions(obj)
                    handle = RunHandle(self.name, f"{meta.get('namespace')}/{target}/{meta.get('name')}")
                    out.append(RunStatus(handle, state, message, details={"created": meta.get("creationTimestamp")}))
        finally:
            api.close()
        return out

    def pods(self, run_id: str) -> list[Any]:
        """The job's pods (V1Pod objects), ordered by node index (drills watch these)."""
        api = self._client()
        try:
            namespace, _, name = self._parse_run_id(run_id)
            return self._pods(api, namespace, name)
        finally:
            api.close()

    @staticmethod
    def pod_index(pod: Any) -> int | None:
        """Node index of a pod (see `delete_pod`)."""
        return pod_index(pod)

    def delete_pod(self, run_id: str, index: int, *, grace_period_s: int = 0) -> str:
        """Delete the pod of node `index` (the `kill-worker` drill); returns the pod's name.

        PyTorchJob: index 0 is the master, index i the worker i-1 (beside a store-only Master, the worker i);
        TrainJob: the JobSet completion index.
        """
        from kubernetes import client

        api = self._client()
        try:
            namespace, _, name = self._parse_run_id(run_id)
            pod = self._pod_for_index(api, namespace, name, index)
            call(
                f"deleting pod {namespace}/{pod.metadata.name}",
                client.CoreV1Api(api).delete_namespaced_pod,
                pod.metadata.name,
                namespace,
                grace_period_seconds=grace_period_s,
            )
            return str(pod.metadata.name)
        finally:
            api.close()

    def wait(self, run_id: str, *, timeout_s: float = 3600.0, poll_s: float = 5.0) -> RunStatus:
        """Poll `status` until the run is terminal or `timeout_s` passes (then the last status)."""
        deadline = time.monotonic() + timeout_s
        status = self.status(run_id)
        while not status.state.terminal and time.monotonic() < deadline:
            time.sleep(poll_s)
            status = self.status(run_id)
        return status
