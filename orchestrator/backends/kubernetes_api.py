"""The Kubernetes API side of the Kubernetes backend: where each kind lives, the client, one-line errors.

Everything here is a plain function over the official `kubernetes` client (imported lazily, so
`torchrig validate` never loads it): which API group/version/plural a manifest's kind has
(`resource_type`), creating and deleting one object (`create_object`, `delete_object`), turning every
client failure into a one-line `BackendError` (`call`, `translate`), and reading a job's state from
its conditions and a pod's node index from its labels.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from orchestrator.backends.api_timeout import api_timeout
from orchestrator.backends.base import RunState
from orchestrator.compile.pytorchjob import STORE_POD_LABEL
from orchestrator.errors import BackendError
from orchestrator.targets import TARGET_KINDS

# The client ships no type information: its API client is typed `ApiClient = Any` here.
ApiClient = Any

__all__ = [
    "FIELD_MANAGER",
    "JOB_LABEL",
    "MANAGED_BY_LABEL",
    "TARGET_KINDS",
    "TYPES",
    "ApiClient",
    "ResourceType",
    "call",
    "create_object",
    "delete_object",
    "describe",
    "new_client",
    "pod_index",
    "read_object",
    "resource_type",
    "state_from_conditions",
    "translate",
    "unreachable",
]

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
TYPES: dict[str, ResourceType] = {
    t.kind: t
    for t in (
        ResourceType("ConfigMap", "", "v1", "configmaps"),
        ResourceType("Secret", "", "v1", "secrets"),
        ResourceType("NetworkPolicy", "networking.k8s.io", "v1", "networkpolicies"),
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


def resource_type(obj: dict[str, Any]) -> ResourceType:
    """The API location of a manifest, checked against its `apiVersion`.

    Raises:
        BackendError: a kind this backend does not know how to create.
    """
    kind = str(obj.get("kind", ""))
    rtype = TYPES.get(kind)
    if rtype is None or obj.get("apiVersion") != rtype.api_version:
        raise BackendError(f"cannot create {obj.get('apiVersion')}/{kind}: unknown to the kubernetes backend")
    return rtype


def describe(obj: dict[str, Any]) -> str:
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


def state_from_conditions(obj: dict[str, Any]) -> tuple[RunState, str]:
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


def pod_index(pod: Any) -> int | None:
    """Node index of a worker pod: PyTorchJob master-0 is node 0 and worker-i node i+1, or, beside a
    store-only Master (standby nodes, `STORE_POD_LABEL`), worker-i is node i and the Master none; TrainJob
    (JobSet) pods carry their completion index."""
    labels = pod.metadata.labels or {}
    rtype = labels.get("training.kubeflow.org/replica-type")
    index = labels.get("training.kubeflow.org/replica-index")
    if rtype is not None and index is not None:
        if labels.get(STORE_POD_LABEL[0]) == STORE_POD_LABEL[1]:
            return None if rtype.lower() == "master" else int(index)
        return int(index) if rtype.lower() == "master" else int(index) + 1
    for key in ("batch.kubernetes.io/job-completion-index", "jobset.sigs.k8s.io/job-index"):
        if key in labels:
            return int(labels[key])
    annotations = pod.metadata.annotations or {}
    if "batch.kubernetes.io/job-completion-index" in annotations:
        return int(annotations["batch.kubernetes.io/job-completion-index"])
    return None


def new_client(kubeconfig: str | None, context: str | None) -> ApiClient:
    """An API client from `kubeconfig` (default: `$KUBECONFIG` or `~/.kube/config`) and `context`, or the
    in-cluster configuration inside a pod.

    The client never retries a call by itself: with `call`'s timeout that bounds every call (and a
    dead API server gives its one-line error within `api_timeout()`, not after three more tries).

    Raises:
        BackendError: no usable configuration.
    """
    import kubernetes.config
    from kubernetes import client
    from urllib3.util.retry import Retry

    config: Any = kubernetes.config  # the client ships no type information
    configuration: Any = client.Configuration()
    try:
        # $KUBECONFIG read now: the client reads it once, when it is imported.
        config_file = kubeconfig or os.environ.get("KUBECONFIG") or None
        config.load_kube_config(config_file=config_file, context=context, client_configuration=configuration)
    except config.ConfigException as exc:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            first_line = (str(exc).splitlines() or ["ConfigException"])[0]
            raise BackendError(f"no usable kubeconfig: {first_line} (set KUBECONFIG or --context)") from None
    configuration.retries = Retry(total=0)
    return client.ApiClient(configuration=configuration)


def call(what: str, fn: Any, *args: Any, rtype: ResourceType | None = None, **kwargs: Any) -> Any:
    """Run one API call within `api_timeout()`, turning every client failure into a one-line BackendError.

    A caller may pass its own `_request_timeout` (a log stream that may stay silent bounds the connect only).
    """
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    kwargs.setdefault("_request_timeout", api_timeout().pair())
    try:
        return fn(*args, **kwargs)
    except ApiException as exc:
        raise translate(what, exc, rtype) from None
    except HTTPError as exc:
        raise unreachable(what, exc) from None


def unreachable(what: str, exc: Exception) -> BackendError:
    """One line for a call that got no answer: refused, timed out, TLS, DNS."""
    reason = getattr(exc, "reason", None) or exc
    return BackendError(f"{what}: cannot reach the Kubernetes API server: {reason}")


def create_object(api: ApiClient, obj: dict[str, Any], *, dry_run: bool, namespace: str) -> dict[str, Any]:
    """Create one object (server-side dry run with `dry_run`) in `namespace` unless it names its own."""
    from kubernetes import client

    rtype = resource_type(obj)
    meta = obj.get("metadata", {})
    namespace = meta.get("namespace") or namespace
    what = ("dry run of " if dry_run else "creating ") + describe(obj)
    extra: dict[str, Any] = {"field_manager": FIELD_MANAGER, "field_validation": "Strict"}
    if dry_run:
        extra["dry_run"] = "All"
    if rtype.kind == "ConfigMap":
        core = client.CoreV1Api(api)
        result = call(what, core.create_namespaced_config_map, namespace, client.V1ConfigMap.from_dict(obj), **extra)
        return dict(api.sanitize_for_serialization(result))
    if rtype.kind == "Secret":
        core = client.CoreV1Api(api)
        result = call(what, core.create_namespaced_secret, namespace, client.V1Secret.from_dict(obj), **extra)
        # What comes back is never kept: the caller learns that it was created, not the value.
        return {"kind": "Secret", "metadata": dict(api.sanitize_for_serialization(result.metadata))}
    custom = client.CustomObjectsApi(api)
    if rtype.namespaced:
        result = call(
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
        result = call(
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


def read_object(api: ApiClient, obj: dict[str, Any], *, namespace: str) -> bool:
    """Whether `obj` (its kind, namespace and name) exists; a Secret's data is not kept.

    Raises:
        BackendError: any answer but the object or a 404 of the object.
    """
    from kubernetes import client

    rtype = resource_type(obj)
    meta = obj.get("metadata", {})
    namespace = meta.get("namespace") or namespace
    what = f"reading {describe(obj)}"
    try:
        if rtype.kind == "Secret":
            call(what, client.CoreV1Api(api).read_namespaced_secret, meta["name"], namespace)
        elif rtype.kind == "ConfigMap":
            call(what, client.CoreV1Api(api).read_namespaced_config_map, meta["name"], namespace)
        elif rtype.namespaced:
            custom = client.CustomObjectsApi(api)
            call(
                what,
                custom.get_namespaced_custom_object,
                rtype.group,
                rtype.version,
                namespace,
                rtype.plural,
                meta["name"],
                rtype=rtype,
            )
        else:
            custom = client.CustomObjectsApi(api)
            call(what, custom.get_cluster_custom_object, rtype.group, rtype.version, rtype.plural, meta["name"])
    except BackendError as exc:
        if ": not found (" in str(exc):
            return False
        raise
    return True


def delete_object(api: ApiClient, obj: dict[str, Any], *, namespace: str, missing_ok: bool = True) -> None:
    """Delete one object (Foreground); a missing object or CRD is fine when `missing_ok`."""
    from kubernetes import client

    rtype = resource_type(obj)
    meta = obj.get("metadata", {})
    namespace = meta.get("namespace") or namespace
    what = f"deleting {describe(obj)}"
    custom = client.CustomObjectsApi(api)
    try:
        if rtype.kind == "ConfigMap":
            call(what, client.CoreV1Api(api).delete_namespaced_config_map, meta["name"], namespace)
        elif rtype.kind == "Secret":
            call(what, client.CoreV1Api(api).delete_namespaced_secret, meta["name"], namespace)
        elif rtype.namespaced:
            call(
                what,
                custom.delete_namespaced_custom_object,
                rtype.group,
                rtype.version,
                namespace,
                rtype.plural,
                meta["name"],
                propagation_policy="Foreground",
                rtype=rtype,
            )
        else:
            call(
                what,
                custom.delete_cluster_custom_object,
                rtype.group,
                rtype.version,
                rtype.plural,
                meta["name"],
                rtype=rtype,
            )
    except BackendError as exc:
        if not (missing_ok and ("not found" in str(exc) or "is not installed" in str(exc))):
            raise


def translate(what: str, exc: Any, rtype: ResourceType | None) -> BackendError:
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
