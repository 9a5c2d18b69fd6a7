"""The Kubernetes backend: creates the compiled objects with the official `kubernetes` client.

`torchrig submit JOB.yaml --backend kubernetes` compiles the spec (`orchestrator.compile.compile`) into
a ConfigMap, a PyTorchJob or TrainJob (per `spec.kubernetes.target`), and with `--monitoring` a
PodMonitor. Every object is first sent as a server-side dry run (`dryRun=All`), so admission,
schema and RBAC problems surface before anything exists; only then are they created for real
(`--dry-run` stops after the server-side pass). Core kinds go through `CoreV1Api`, custom resources
through `CustomObjectsApi` (`utils.create_from_yaml` cannot create custom resources).

Run ids are `kubernetes://<namespace>/<target>/<name>` (`<namespace>/<name>` is accepted too).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from orchestrator.backends.base import Backend, Capabilities, DryRun, RunHandle, RunState, RunStatus, SubmitOptions
from orchestrator.errors import BackendError, SpecError
from orchestrator.spec import JobSpec

# The kubernetes client is imported lazily (inside methods) so `torchrig validate` never loads it;
# its API client is typed `ApiClient = Any` here because the client ships no type information.
ApiClient = Any

__all__ = ["JOB_LABEL", "MANAGED_BY_LABEL", "KubernetesBackend", "ResourceType", "resource_type"]

JOB_LABEL = "torchrig.io/job"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
FIELD_MANAGER = "torchrig"


@dataclass(frozen=True)
class ResourceType:
    """Where a kind lives in the API and what to install when it is missing."""

    kind: str
    group: str  # "" for the core group
    version: str
    plural: str
    namespaced: bool = True
    install_hint: str = ""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def missing_crd_message(self) -> str:
        return (
            f"{self.kind} CRD ({self.api_version}) is not installed in the cluster: "
            f"{self.install_hint}, see docs/operations.md"
        )


_TRAINER = "install Kubeflow Trainer (v2.2 or newer)"
_TYPES: dict[str, ResourceType] = {
    t.kind: t
    for t in (
        ResourceType("ConfigMap", "", "v1", "configmaps"),
        ResourceType("PyTorchJob", "kubeflow.org", "v1", "pytorchjobs", install_hint="install the training operator"),
        ResourceType(
            "TrainJob", "trainer.kubeflow.org", "v1alpha1", "trainjobs", install_hint="install Kubeflow Trainer"
        ),
        ResourceType(
            "ClusterTrainingRuntime",
            "trainer.kubeflow.org",
            "v1alpha1",
            "clustertrainingruntimes",
            namespaced=False,
            install_hint=_TRAINER,
        ),
        ResourceType(
            "TrainingRuntime",
            "trainer.kubeflow.org",
            "v1alpha1",
            "trainingruntimes",
            install_hint=_TRAINER,
        ),
        ResourceType(
            "PodMonitor", "monitoring.coreos.com", "v1", "podmonitors", install_hint="install the prometheus-operator"
        ),
        ResourceType(
            "PrometheusRule",
            "monitoring.coreos.com",
            "v1",
            "prometheusrules",
            install_hint="install the prometheus-operator",
        ),
        ResourceType(
            "PodGroup", "scheduling.volcano.sh", "v1beta1", "podgroups", install_hint="install the Volcano scheduler"
        ),
        ResourceType("RayJob", "ray.io", "v1", "rayjobs", install_hint="install the KubeRay operator"),
    )
}
_TARGET_KINDS = {"pytorchjob": "PyTorchJob", "trainjob": "TrainJob"}


def resource_type(obj: dict[str, Any]) -> ResourceType:
    """The API location of a manifest, checked against its `apiVersion`.

    Raises:
        BackendError: a kind this backend does not know how to create.
    """
    kind = str(obj.get("kind", ""))
    rtype = _TYPES.get(kind)
    if rtype is None or obj.get("apiVersion") != rtype.api_version:
        raise BackendError(f"cannot create {obj.get('apiVersion')}/{kind}: unknown to the kubernetes backend")
    return rtype


def _describe(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata", {})
    ns = meta.get("namespace")
    return f"{obj.get('kind')} {ns + '/' if ns else ''}{meta.get('name')}"


def _status_message(exc: Any) -> str:
    """The `message` of a Kubernetes Status body, or the raw body (a missing route answers plain text)."""
    body = getattr(exc, "body", None) or ""
    try:
        data = json.loads(body)
    except (TypeError, ValueError):
        return str(body).strip() or str(getattr(exc, "reason", "") or "")
    if isinstance(data, dict):
        return str(data.get("message") or data.get("reason") or body)
    return str(body)


def _status_details_kind(exc: Any) -> str | None:
    try:
        data = json.loads(getattr(exc, "body", None) or "")
    except (TypeError, ValueError):
        return None
    if isinstance(data, dict) and isinstance(data.get("details"), dict):
        kind = data["details"].get("kind")
        return str(kind) if kind else None
    return None


def _state_from_conditions(obj: dict[str, Any]) -> tuple[RunState, str]:
    """PyTorchJob (Created/Running/Restarting/Succeeded/Failed/Suspended) and TrainJob
    (Complete/Failed/Suspended/...) conditions -> RunState: terminal conditions win, else the newest true one."""
    conditions = [c for c in (obj.get("status") or {}).get("conditions") or [] if str(c.get("status")) == "True"]
    types = {str(c.get("type")): str(c.get("message") or c.get("reason") or "") for c in conditions}
    for kind, state in (
        ("Failed", RunState.FAILED),
        ("Succeeded", RunState.SUCCEEDED),
        ("Complete", RunState.SUCCEEDED),
    ):
        if kind in types:
            return state, types[kind]
    if "Suspended" in types:
        return RunState.PENDING, types["Suspended"]
    if "Running" in types or "Restarting" in types:
        key = "Restarting" if "Restarting" in types else "Running"
        return RunState.RUNNING, types[key]
    if (obj.get("status") or {}).get("jobsStatus"):  # TrainJob: JobSet child jobs exist
        return RunState.RUNNING, ""
    return RunState.PENDING, types.get("Created", "")


def _pod_index(pod: Any) -> int | None:
    """Node index of a worker pod: PyTorchJob master-0 is node 0 and worker-i node i+1; TrainJob (JobSet)
    pods carry their completion index."""
    labels = pod.metadata.labels or {}
    rtype = labels.get("training.kubeflow.org/replica-type")
    index = labels.get("training.kubeflow.org/replica-index")
    if rtype is not None and index is not None:
        return int(index) if rtype.lower() == "master" else int(index) + 1
    for key in ("batch.kubernetes.io/job-completion-index", "jobset.sigs.k8s.io/job-index"):
        if key in labels:
            return int(labels[key])
    annotations = pod.metadata.annotations or {}
    if "batch.kubernetes.io/job-completion-index" in annotations:
        return int(annotations["batch.kubernetes.io/job-completion-index"])
    return None


class KubernetesBackend(Backend):
    """Submits compiled manifests to a cluster and manages their lifecycle.

    Args:
        context: kubeconfig context (default: the current one); `SubmitOptions.context` overrides it.
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
        import kubernetes.config

        config: Any = kubernetes.config  # the client ships no type information
        try:
            return config.new_client_from_config(config_file=self.kubeconfig, context=context or self.context)
        except config.ConfigException as exc:
            import os

            if self.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
                from kubernetes import client

                config.load_incluster_config()
                return client.ApiClient()
            first_line = (str(exc).splitlines() or ["ConfigException"])[0]
            raise BackendError(f"no usable kubeconfig: {first_line} (set KUBECONFIG or --context)") from None

    def _call(self, what: str, fn: Any, *args: Any, rtype: ResourceType | None = None, **kwargs: Any) -> Any:
        """Run one API call, turning every client failure into a one-line BackendError."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            raise _translate(what, exc, rtype) from None
        except HTTPError as exc:
            reason = getattr(exc, "reason", None) or exc
            raise BackendError(f"{what}: cannot reach the Kubernetes API server: {reason}") from None

    # -- submit ----------------------------------------------------------------------------------
    def _check(self, spec: JobSpec, options: SubmitOptions) -> None:
        if spec.spec.kubernetes.target not in _TARGET_KINDS:  # pragma: no cover - the model restricts it
            raise SpecError(f"spec.kubernetes.target: unsupported target {spec.spec.kubernetes.target!r}")

    def _dry_run(self, spec: JobSpec, options: SubmitOptions) -> list[dict[str, Any]]:
        from orchestrator.compile import compile as compile_target

        manifests = compile_target(
            spec, spec.spec.kubernetes.target, monitoring=options.monitoring, fixed_size=options.fixed_size
        )
        namespace = options.namespace
        out: list[dict[str, Any]] = []
        for compiled in manifests:
            obj: dict[str, Any] = json.loads(json.dumps(compiled))  # a private copy: never mutate the compiler's
            rtype = resource_type(obj)
            if rtype.namespaced and namespace:
                obj.setdefault("metadata", {})["namespace"] = namespace
            out.append(obj)
        return out

    def _create(self, api: ApiClient, obj: dict[str, Any], *, dry_run: bool) -> dict[str, Any]:
        from kubernetes import client

        rtype = resource_type(obj)
        meta = obj.get("metadata", {})
        namespace = meta.get("namespace") or self.namespace or "default"
        what = ("dry run of " if dry_run else "creating ") + _describe(obj)
        extra: dict[str, Any] = {"field_manager": FIELD_MANAGER, "field_validation": "Strict"}
        if dry_run:
            extra["dry_run"] = "All"
        if rtype.kind == "ConfigMap":
            core = client.CoreV1Api(api)
            result = self._call(
                what, core.create_namespaced_config_map, namespace, client.V1ConfigMap.from_dict(obj), **extra
            )
            return dict(api.sanitize_for_serialization(result))
        custom = client.CustomObjectsApi(api)
        if rtype.namespaced:
            result = self._call(
                what,
                custom.create_namespaced_custom_object,
                rtype.group,
                rtype.version,
                namespace,
                rtype.plural,
                obj,
                rtype=rtype,
                **extra,
            )
        else:
            result = self._call(
                what,
                custom.create_cluster_custom_object,
                rtype.group,
                rtype.version,
                rtype.plural,
                obj,
                rtype=rtype,
                **extra,
            )
        return dict(result)

    def _schedule(self, dryrun: DryRun) -> RunHandle:
        manifests: list[dict[str, Any]] = dryrun.request
        api = self._client(dryrun.options.context)
        try:
            job = next(o for o in manifests if o["kind"] in _TARGET_KINDS.values())
            namespace = job["metadata"].get("namespace") or self.namespace or "default"
            target = next(t for t, k in _TARGET_KINDS.items() if k == job["kind"])
            # Server-side dry run of everything first: nothing is created unless every object would be.
            stale: list[dict[str, Any]] = []
            for obj in manifests:
                try:
                    self._create(api, obj, dry_run=True)
                except BackendError as exc:
                    if "already exists" not in str(exc) or obj is job:
                        raise
                    # The job is absent, so this is a leftover of a finished (TTL-deleted) run of the same job.
                    stale.append(obj)
            handle = RunHandle(
                backend=self.name,
                run_id=f"{namespace}/{target}/{job['metadata']['name']}",
                info={"objects": [_describe(o) for o in manifests], "dry_run": dryrun.options.dry_run},
            )
            if dryrun.options.dry_run:
                handle.info["manifests"] = manifests
                handle.info["replaced"] = [_describe(o) for o in stale]
                return handle
            created: list[str] = []
            for obj in manifests:
                if any(obj is s for s in stale):
                    self._delete(api, obj)
                self._create(api, obj, dry_run=False)
                created.append(_describe(obj))
            handle.info["created"] = created
            return handle
        finally:
            api.close()

    def _delete(self, api: ApiClient, obj: dict[str, Any], *, missing_ok: bool = True) -> None:
        """Delete one object (Foreground); a missing object or CRD is fine when `missing_ok`."""
        from kubernetes import client

        rtype = resource_type(obj)
        meta = obj.get("metadata", {})
        namespace = meta.get("namespace") or self.namespace or "default"
        what = f"deleting {_describe(obj)}"
        try:
            if rtype.kind == "ConfigMap":
                self._call(what, client.CoreV1Api(api).delete_namespaced_config_map, meta["name"], namespace)
            elif rtype.namespaced:
                self._call(
                    what,
                    client.CustomObjectsApi(api).delete_namespaced_custom_object,
                    rtype.group,
                    rtype.version,
                    namespace,
                    rtype.plural,
                    meta["name"],
                    propagation_policy="Foreground",
                    rtype=rtype,
                )
            else:
                self._call(
                    what,
                    client.CustomObjectsApi(api).delete_cluster_custom_object,
                    rtype.group,
                    rtype.version,
                    rtype.plural,
                    meta["name"],
                    rtype=rtype,
                )
        except BackendError as exc:
            if not (missing_ok and ("not found" in str(exc) or "is not installed" in str(exc))):
                raise

    # -- lifecycle -------------------------------------------------------------------------------
    def _parse_run_id(self, run_id: str) -> tuple[str, list[str], str]:
        text = run_id.removeprefix("kubernetes://")
        parts = [p for p in text.split("/") if p]
        if len(parts) == 3 and parts[1] in _TARGET_KINDS:
            return parts[0], [parts[1]], parts[2]
        if len(parts) == 2:
            return parts[0], list(_TARGET_KINDS), parts[1]
        if len(parts) == 1:
            return self.namespace or "default", list(_TARGET_KINDS), parts[0]
        raise SpecError(f"run id {run_id!r}: expected kubernetes://<namespace>/<pytorchjob|trainjob>/<name>")

    def _get_job(self, api: ApiClient, run_id: str) -> tuple[str, str, str, dict[str, Any]]:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        namespace, targets, name = self._parse_run_id(run_id)
        custom: Any = client.CustomObjectsApi(api)
        for target in targets:
            rtype = _TYPES[_TARGET_KINDS[target]]
            what = f"reading {rtype.kind} {namespace}/{name}"
            try:
                obj: dict[str, Any] = custom.get_namespaced_custom_object(
                    rtype.group, rtype.version, namespace, rtype.plural, name
                )
            except ApiException as exc:
                if exc.status == 404 and len(targets) > 1:
                    continue  # not this kind (or its CRD is not installed): try the next target
                raise _translate(what, exc, rtype) from None
            except HTTPError as exc:
                raise BackendError(f"{what}: cannot reach the Kubernetes API server: {exc}") from None
            return namespace, target, name, dict(obj)
        raise BackendError(f"no PyTorchJob or TrainJob named {name!r} in namespace {namespace!r}")

    def _status(self, run_id: str) -> RunStatus:
        api = self._client()
        try:
            namespace, target, name, obj = self._get_job(api, run_id)
        finally:
            api.close()
        state, message = _state_from_conditions(obj)
        handle = RunHandle(self.name, f"{namespace}/{target}/{name}")
        return RunStatus(handle, state, message, details={"status": obj.get("status") or {}})

    def _pods(self, api: ApiClient, namespace: str, name: str) -> list[Any]:
        from kubernetes import client

        core = client.CoreV1Api(api)
        pods = self._call(
            f"listing pods of {namespace}/{name}",
            core.list_namespaced_pod,
            namespace,
            label_selector=f"{JOB_LABEL}={name}",
        )
        return sorted(pods.items, key=lambda p: (_pod_index(p) is None, _pod_index(p) or 0, p.metadata.name))

    def _pod_for_index(self, api: ApiClient, namespace: str, name: str, index: int) -> Any:
        pods = [p for p in self._pods(api, namespace, name) if _pod_index(p) == index]
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
                    resp = self._call(
                        what,
                        core.read_namespaced_pod_log,
                        pod.metadata.name,
                        namespace,
                        follow=True,
                        _preload_content=False,
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
                    text = self._call(what, core.read_namespaced_pod_log, pod.metadata.name, namespace)
                    for line in str(text).splitlines():
                        yield prefix + line
        finally:
            api.close()

    def _cancel(self, run_id: str) -> RunStatus:
        from kubernetes import client

        api = self._client()
        try:
            namespace, target, name, _ = self._get_job(api, run_id)
            kind = _TARGET_KINDS[target]
            rtype = _TYPES[kind]
            # Foreground: the job object goes only after its pods, so `status` never shows a job
            # that is gone while its workers still write checkpoints. Checkpoint stores are untouched.
            job = {"apiVersion": rtype.api_version, "kind": kind, "metadata": {"name": name, "namespace": namespace}}
            self._delete(api, job, missing_ok=False)
            # The job's companions (spec ConfigMap, PodMonitor, PrometheusRule), so a re-submit starts clean.
            core = client.CoreV1Api(api)
            maps = self._call(
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
            for target, kind in _TARGET_KINDS.items():
                rtype = _TYPES[kind]
                try:
                    if self.namespace:
                        listed = self._call(
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
                        listed = self._call(
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
                    state, message = _state_from_conditions(obj)
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
        return _pod_index(pod)

    def delete_pod(self, run_id: str, index: int, *, grace_period_s: int = 0) -> str:
        """Delete the pod of node `index` (the `kill-worker` drill); returns the pod's name.

        PyTorchJob: index 0 is the master, index i the worker i-1; TrainJob: the JobSet completion index.
        """
        from kubernetes import client

        api = self._client()
        try:
            namespace, _, name = self._parse_run_id(run_id)
            pod = self._pod_for_index(api, namespace, name, index)
            self._call(
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


def _translate(what: str, exc: Any, rtype: ResourceType | None) -> BackendError:
    """One line for an ApiException: missing CRD, missing namespace, conflict, forbidden, invalid."""
    status = int(exc.status or 0)
    msg = _status_message(exc)
    details_kind = _status_details_kind(exc)
    if status == 404 and details_kind == "namespaces":
        return BackendError(f"{what}: namespace does not exist ({msg})")
    if status == 404 and rtype is not None and rtype.group and details_kind is None:
        # An unknown group/version/resource route answers a plain-text 404 page, not a Status.
        return BackendError(rtype.missing_crd_message())
    if status == 404:
        return BackendError(f"{what}: not found ({msg})")
    if status == 409:
        return BackendError(
            f"{what}: already exists; cancel the old run first (torchrig cancel ...) or change metadata.name"
        )
    if status in (401, 403):
        return BackendError(f"{what}: not allowed by the cluster ({status}: {msg})")
    if status in (400, 422):
        return BackendError(f"{what}: rejected by the API server: {msg}")
    return BackendError(f"{what}: API server answered {status}: {msg}")
