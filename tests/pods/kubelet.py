"""What Kubernetes itself does to a pod before its container runs: the pieces every operator shares.

The operators (operators.py) decide which pods exist, their names and their env; this module holds
what the API server, the Job controller and the kubelet then add, each rule with its source:

- `$(VAR)` expansion in `command`, `args` and `env[].value`: kubernetes/kubernetes
  `third_party/forked/golang/expansion/expand.go` `Expand` (read at commit
  fde22c3f9aacfd260225a9741de123a41157b7c0): `$(NAME)` becomes the value of a variable defined
  earlier in the container's env (for env values) or anywhere in it (for command/args,
  `pkg/kubelet/container/helpers.go` `ExpandContainerCommandAndArgs`); an undefined reference stays
  as written; `$$` is an escaped `$`; any other `$x` stays.
- `env[].valueFrom.fieldRef` (downward API): `metadata.name`, `metadata.namespace`,
  `metadata.labels['k']`, `metadata.annotations['k']`, `spec.hostname`, `status.podIP`, `spec.nodeName`
  (`node-<pod name>`: each pod is a machine of its own here)
  (`pkg/kubelet/kubelet_pods.go` `makeEnvironmentVariables` -> `podFieldSelectorRuntimeValue`);
  `env[].valueFrom.secretKeyRef`: the key's value in the Secret (same function: a missing Secret or
  key fails the container's start unless `optional`, then the variable is left out). A Secret's
  `stringData` is merged into its `data` by the API server on write (`k8s.io/api` core/v1 `Secret`).
- the pod's own `/etc/hosts` line: `<podIP> <hostname>.<subdomain>.<ns>.svc.<domain> <hostname>` when
  `subdomain` is set, else `<podIP> <hostname>` (`pkg/kubelet/kubelet_pods.go` `managedHostsFileContent`);
  the hostname is `spec.hostname`, else the pod name (`GeneratePodHostNameAndDomain`, same file).
- init containers run one after the other to completion before the main container starts; one that
  fails is restarted (with the back-off below) under `restartPolicy: OnFailure|Always`, and fails the pod
  under `Never` (`pkg/kubelet/kuberuntime/kuberuntime_manager.go` `computePodActions`).
- cluster DNS: a pod's Service names resolve only while the pod is Ready, unless the Service sets
  `publishNotReadyAddresses` (`pkg/controller/endpointslice` puts not-ready pods in the slice with
  `ready: false`; CoreDNS `plugin/kubernetes` answers headless names only from ready endpoints unless the
  Service publishes not-ready addresses). The harness models it in each pod's /etc/hosts (runtime.py).
- probes (`pkg/kubelet/prober/worker.go` `doProbe`, `prober_manager.go` `UpdatePodStatus`): while a
  startupProbe has not succeeded, neither readiness nor liveness runs and the container is neither
  Started nor Ready; a probe runs every `periodSeconds` (default 10) after `initialDelaySeconds`, fails
  after `timeoutSeconds` (default 1); `failureThreshold` (default 3) consecutive failures of the startup
  or liveness probe kill the container (then `restartPolicy` applies); a container without a
  readinessProbe is Ready once Started. `probe_spec` gives a probe's fields with those defaults.
- container restarts under `restartPolicy: OnFailure|Always`: in place (same pod, IP, emptyDirs),
  the first at once, then after 10 s doubling to 300 s (`pkg/kubelet/kubelet.go` `backOffPeriod = 10s`,
  `MaxContainerBackOff = 300s`); `Never`: the pod ends Failed and only its controller can replace it.
- a strategic merge patch of a pod spec merges lists of containers, env, volumes by `name` and
  volumeMounts by `mountPath` (the `patchMergeKey` tags of `k8s.io/api/core/v1/types.go`), and
  JobSet's `replicatedJobs` by `name` (kubernetes-sigs/jobset `api/jobset/v1alpha2/jobset_types.go`).

`resources` are ignored on purpose (this harness runs on one small machine); the image is replaced by
this repository's virtualenv (docs/operations.md, "What the pods harness proves").
"""

from __future__ import annotations

import base64
import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CLUSTER_DOMAIN",
    "HTTP_GET_PROBE",
    "Pod",
    "container_argv",
    "expand",
    "http_probe_url",
    "probe_spec",
    "resolve_env",
    "secret_data",
    "service_names",
    "strategic_merge",
]

CLUSTER_DOMAIN = "cluster.local"
# kubelet.go: the first restart of a crashed container is immediate, the next ones back off.
BACKOFF_BASE_S = 10.0
BACKOFF_MAX_S = 300.0

# patchMergeKey of the lists a runtime patch touches (k8s.io/api core/v1 types.go, JobSet types).
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "replicatedJobs": "name",
    "imagePullSecrets": "name",
}


@dataclass
class Pod:
    """One pod as the operator would create it: everything the harness needs to run it.

    Attributes:
        name: `metadata.name` (the operator's naming rule).
        namespace: `metadata.namespace`.
        hostname: the container's hostname (`spec.hostname` or the pod name).
        subdomain: `spec.subdomain` (JobSet), or None.
        labels / annotations: pod metadata after the operator and the Job controller added theirs.
        container: the container that runs (the operator's default container), already with the
            operator's env injected (unresolved `valueFrom` kept as in the API object).
        volumes: `spec.volumes`.
        restart_policy: the pod's `spec.restartPolicy` (what the kubelet does).
        replica_policy: the operator-level policy (PyTorchJob `ExitCode` lives here; "JobSet" for a
            JobSet pod, whose Job `podFailurePolicy`/`backoffLimit` and JobSet `failurePolicy` are in
            `controller`), or None.
        dns_names: names that resolve to this pod's IP in the cluster (its Services, its FQDN).
        role: short label for logs and tests ("master-0", "worker-1", "node-0", "head", "submitter").
        init_containers: `spec.initContainers`, operator-added ones included.
        controller: the owning controller's failure rules (JobSet pods).
        publish_not_ready: whether `dns_names` resolve while the pod is not Ready
            (the Service's `publishNotReadyAddresses`).
    """

    name: str
    namespace: str
    hostname: str
    container: dict[str, Any]
    volumes: list[dict[str, Any]] = field(default_factory=list)
    subdomain: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    restart_policy: str = "Always"
    replica_policy: str | None = None
    dns_names: list[str] = field(default_factory=list)
    role: str = ""
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    controller: dict[str, Any] = field(default_factory=dict)  # the owning controller's failure rules
    # Whether the Services behind `dns_names` publish not-ready addresses (else they resolve only while
    # the pod is Ready).
    publish_not_ready: bool = True

    def own_hosts_names(self) -> list[str]:
        """The names the kubelet writes for the pod itself in its /etc/hosts."""
        if self.subdomain:
            return [f"{self.hostname}.{self.subdomain}.{self.namespace}.svc.{CLUSTER_DOMAIN}", self.hostname]
        return [self.hostname]


def expand(text: str, mapping: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion (expand.go `Expand`), byte for byte."""
    out: list[str] = []
    i, checkpoint, n = 0, 0, len(text)
    while i < n:
        if text[i] == "$" and i + 1 < n:
            out.append(text[checkpoint:i])
            nxt = text[i + 1]
            if nxt == "$":
                read, is_var, advance = "$", False, 1
            elif nxt == "(":
                close = text.find(")", i + 2)
                if close == -1:
                    read, is_var, advance = "$(", False, 1
                else:
                    read, is_var, advance = text[i + 2 : close], True, close - i
            else:
                read, is_var, advance = "$" + nxt, False, 1
            out.append((mapping.get(read, f"$({read})")) if is_var else read)
            i += advance
            checkpoint = i + 1
        i += 1
    return "".join(out) + text[checkpoint:]


_FIELD_KEY = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def _field_ref(pod: Pod, path: str, pod_ip: str) -> str:
    simple = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "spec.hostname": pod.hostname,
        # One pod per emulated machine (its own network namespace): the node is named after the pod.
        "spec.nodeName": f"node-{pod.name}",
        "status.podIP": pod_ip,
    }
    if path in simple:
        return simple[path]
    match = _FIELD_KEY.match(path)
    if not match:
        raise NotImplementedError(f"fieldRef {path!r} is not emulated")
    source = pod.labels if match.group(1) == "labels" else pod.annotations
    # The kubelet resolves a missing label/annotation to "" (fieldpath.ExtractFieldPathAsString).
    return source.get(match.group(2), "")


def secret_data(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Secret name -> its data as the kubelet reads it (`data` base64-decoded, `stringData` merged over it)."""
    out: dict[str, dict[str, str]] = {}
    for obj in objects:
        if obj.get("kind") == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
            out[obj["metadata"]["name"]] = {**data, **(obj.get("stringData") or {})}
    return out


def resolve_env(
    pod: Pod,
    pod_ip: str,
    container: dict[str, Any] | None = None,
    secrets: Mapping[str, Mapping[str, str]] | None = None,
) -> list[tuple[str, str]]:
    """The container's environment as the kubelet builds it: in order, later entries win, `$(VAR)` of
    earlier ones expanded, downward-API `fieldRef`s and `secretKeyRef`s (from `secrets`, see
    `secret_data`) resolved. Returns (name, value) in order."""
    values: dict[str, str] = {}
    for entry in (container or pod.container).get("env", []):
        name = entry["name"]
        if "valueFrom" in entry:
            source = entry["valueFrom"]
            if "fieldRef" in source:
                value = _field_ref(pod, source["fieldRef"]["fieldPath"], pod_ip)
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                found = (secrets or {}).get(ref["name"], {})
                if ref["key"] not in found:
                    if ref.get("optional"):
                        continue
                    raise ValueError(
                        f"pod {pod.name}: env {name}: couldn't find key {ref['key']} in Secret {ref['name']}"
                    )
                value = found[ref["key"]]
            else:
                raise NotImplementedError(f"env {name}: only fieldRef and secretKeyRef valueFrom are emulated")
        else:
            value = expand(str(entry.get("value", "")), values)
        values.pop(name, None)
        values[name] = value
    return list(values.items())


def container_argv(pod: Pod, env: list[tuple[str, str]], container: dict[str, Any] | None = None) -> list[str]:
    """`command` + `args`, each `$(VAR)`-expanded against the container env (helpers.go)."""
    c = container or pod.container
    mapping = dict(env)
    command = list(c.get("command") or [])
    if not command:
        raise NotImplementedError(f"pod {pod.name}: no command; the image's ENTRYPOINT is not emulated")
    return [expand(a, mapping) for a in [*command, *(c.get("args") or [])]]


def service_names(name: str, namespace: str) -> list[str]:
    """What a Service `name` in `namespace` is reachable as from a pod (cluster DNS + search path)."""
    return [name, f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}"]


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """Strategic merge patch of plain dicts: maps merge, keyed lists merge by their patchMergeKey,
    other lists and scalars are replaced; `None` in the patch deletes the key."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    merge_key = _MERGE_KEYS.get(key or "")
    if isinstance(base, list) and isinstance(patch, list) and merge_key:
        out_list = copy.deepcopy(base)
        for item in patch:
            idx = next((i for i, b in enumerate(out_list) if b.get(merge_key) == item.get(merge_key)), None)
            if idx is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[idx] = strategic_merge(out_list[idx], item)
        return out_list
    return copy.deepcopy(patch)


def upsert_env(env: list[dict[str, Any]], *entries: dict[str, Any]) -> list[dict[str, Any]]:
    """Trainer's `apply.UpsertEnvVars`: replace an entry of the same name in place, else append."""
    out = list(env)
    for entry in entries:
        idx = next((i for i, e in enumerate(out) if e["name"] == entry["name"]), None)
        if idx is None:
            out.append(entry)
        else:
            out[idx] = entry
    return out


def restart_delay(restarts_so_far: int) -> float:
    """Seconds the kubelet waits before restarting a container that has already restarted N times."""
    if restarts_so_far <= 0:
        return 0.0
    return min(BACKOFF_BASE_S * 2 ** (restarts_so_far - 1), BACKOFF_MAX_S)


# pkg/apis/core/v1/defaults.go SetDefaults_Probe.
PROBE_DEFAULTS = {"initialDelaySeconds": 0, "periodSeconds": 10, "timeoutSeconds": 1, "failureThreshold": 3}


def probe_spec(container: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The container's `<kind>Probe` (kind: startup, readiness, liveness) with the API defaults, or None.

    `exec` and `httpGet` probes are emulated (the ones torchrig and the operators render: KubeRay injects
    an httpGet readiness probe for Ray >= 2.53); `tcpSocket` and `grpc` are not."""
    probe = container.get(f"{kind}Probe")
    if not probe:
        return None
    if "exec" not in probe and "httpGet" not in probe:
        raise NotImplementedError(f"{kind}Probe: only exec and httpGet probes are emulated")
    return {**PROBE_DEFAULTS, **probe}


# pkg/probe/http/http.go DoHTTPProbe: a GET from the node to the pod; success when 200 <= status < 400
# (redirects followed), anything else (a refused connection, a timeout, another status) a failure.
HTTP_GET_PROBE = """
import sys, urllib.error, urllib.request
try:
    code = urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])).status
except urllib.error.HTTPError as exc:
    code = exc.code
sys.exit(0 if 200 <= code < 400 else 1)
"""


def http_probe_url(spec: dict[str, Any], container: dict[str, Any], pod_ip: str) -> str:
    """The URL an httpGet probe GETs (pkg/kubelet/prober/prober.go runProbe: `host` else the pod IP, a named
    `port` from the container's ports, `scheme` HTTP, `path` as written)."""
    get = spec["httpGet"]
    port = get["port"]
    if isinstance(port, str) and not port.isdigit():
        named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
        if not named:
            raise ValueError(f"httpGet probe: the container has no port named {port!r}")
        port = named[0]
    path = str(get.get("path", ""))
    return f"{str(get.get('scheme', 'HTTP')).lower()}://{get.get('host') or pod_ip}:{int(port)}/{path.lstrip('/')}"
