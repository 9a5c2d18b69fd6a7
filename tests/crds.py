"""Offline validation of generated manifests: real CRD schemas, core schemas and operator webhooks.

No API server can run here, so manifests are checked the way the API server and the operators would:

- custom resources against their CRD's `openAPIV3Schema` (vendored in `tests/schemas/crds/`, with their
  sources in SOURCES.md there), made strict like the API server's strict field validation (unknown fields fail:
  `additionalProperties: false` on objects with `properties` and no `x-kubernetes-preserve-unknown-fields`),
  after applying the schema's defaults (some fields are required-with-default, e.g. RayJob
  `workerGroupSpecs[].minReplicas`);
- core kinds (ConfigMap, and the pod templates embedded in custom resources, as Pods) with
  `kubernetes_validate` in strict mode;
- the rules only the operators' webhooks enforce (SOURCES.md): PyTorchJob replica keys Master/Worker,
  a container named `pytorch`, Master replicas 1, elastic needs Worker; DNS-1035 names.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S_VERSION = "1.33"

# (apiVersion, kind) -> CRD file
CRD_FILES: dict[tuple[str, str], str] = {
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.yaml",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainer.kubeflow.org_trainjobs.yaml",
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): "trainer.kubeflow.org_clustertrainingruntimes.yaml",
    ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"): "trainer.kubeflow.org_trainingruntimes.yaml",
    ("ray.io/v1", "RayJob"): "ray.io_rayjobs.yaml",
    ("ray.io/v1", "RayCluster"): "ray.io_rayclusters.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
}
CORE_KINDS = {
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("v1", "Pod"),
    ("v1", "Secret"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
}

_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def crd_dir() -> Path:
    """The vendored CRDs; a missing file is a test failure, never a skip (a clone elsewhere must test too)."""
    return REPO / "tests" / "schemas" / "crds"


def _strict(schema: Any) -> Any:
    """Make a structural schema strict and plain-JSON-Schema friendly (in place)."""
    if isinstance(schema, list):
        for item in schema:
            _strict(item)
        return schema
    if not isinstance(schema, dict):
        return schema
    if schema.get("x-kubernetes-int-or-string"):
        schema.pop("type", None)
        if "anyOf" not in schema:
            schema["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        "properties" in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in schema
    ):
        schema["additionalProperties"] = False
    for key in ("properties", "patternProperties", "definitions"):
        for sub in schema.get(key, {}).values():
            _strict(sub)
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), (dict, list)):
            _strict(schema[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            _strict(schema[key])
    return schema


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    """The strict openAPIV3Schema of the served version of a CRD (cached: compile once per process)."""
    group_version = api_version.split("/")
    version = group_version[-1]
    doc = yaml.safe_load((crd_dir() / CRD_FILES[(api_version, kind)]).read_text())
    for v in doc["spec"]["versions"]:
        if v["name"] == version:
            return _strict(copy.deepcopy(v["schema"]["openAPIV3Schema"]))  # type: ignore[no-any-return]
    raise KeyError(f"{kind}: no version {version} in the CRD")


@functools.cache
def _validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    schema = crd_schema(api_version, kind)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)  # type: ignore[no-any-return]


def apply_defaults(instance: Any, schema: dict[str, Any]) -> Any:
    """Fill in the schema's `default`s the way the API server does before validating."""
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        for name, sub in props.items():
            if name not in instance and "default" in sub:
                instance[name] = copy.deepcopy(sub["default"])
            if name in instance:
                apply_defaults(instance[name], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, value in instance.items():
                if name not in props:
                    apply_defaults(value, extra)
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for item in instance:
            apply_defaults(item, schema["items"])
    return instance


def _meta_problems(obj: dict[str, Any]) -> list[str]:
    meta = obj.get("metadata") or {}
    out: list[str] = []
    name = meta.get("name", "")
    if not name or len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name):
        out.append(f"metadata.name: {name!r} is not a DNS-1123 subdomain")
    for key, value in (meta.get("labels") or {}).items():
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            out.append(f"metadata.labels.{key}: {value!r} is not a valid label value")
    return out


def _pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The complete pod templates embedded in a custom resource (path, template)."""
    kind, spec = obj["kind"], obj.get("spec", {})
    if kind == "PyTorchJob":
        return [
            (f"spec.pytorchReplicaSpecs.{k}.template", v["template"]) for k, v in spec["pytorchReplicaSpecs"].items()
        ]
    if kind in ("ClusterTrainingRuntime", "TrainingRuntime"):
        return [
            (f"spec.template.spec.replicatedJobs[{i}].template.spec.template", rj["template"]["spec"]["template"])
            for i, rj in enumerate(spec["template"]["spec"]["replicatedJobs"])
        ]
    if kind == "RayJob":
        cluster = spec.get("rayClusterSpec", {})
        out = [("spec.rayClusterSpec.headGroupSpec.template", cluster["headGroupSpec"]["template"])]
        out += [
            (f"spec.rayClusterSpec.workerGroupSpecs[{i}].template", g["template"])
            for i, g in enumerate(cluster.get("workerGroupSpecs", []))
        ]
        return out
    return []


def webhook_problems(obj: dict[str, Any]) -> list[str]:
    """The rules the operators' admission webhooks enforce beyond the CRD schema."""
    out: list[str] = []
    if obj["kind"] == "PyTorchJob":
        name = obj["metadata"]["name"]
        if not _DNS1035.match(name) or len(name) > 63:
            out.append(f"metadata.name: {name!r} is not a DNS-1035 label")
        spec = obj["spec"]
        replicas = spec["pytorchReplicaSpecs"]
        for rtype, rspec in replicas.items():
            path = f"spec.pytorchReplicaSpecs[{rtype}]"
            if rtype not in ("Master", "Worker"):
                out.append(f"{path}: replica type must be Master or Worker")
            containers = rspec["template"]["spec"]["containers"]
            if not any(ct.get("name") == "pytorch" for ct in containers):
                out.append(f"{path}: must have a container named pytorch")
            if not all(ct.get("image") for ct in containers):
                out.append(f"{path}: every container needs an image")
            if rtype == "Master" and rspec.get("replicas") != 1:
                out.append(f"{path}.replicas: must be 1")
            elif rspec.get("replicas", 1) < 1:
                out.append(f"{path}.replicas: must be at least 1")
        if "elasticPolicy" in spec:
            if "Worker" not in replicas:
                out.append("spec.pytorchReplicaSpecs[Worker]: must be configured if elastic policy is used")
            if "nProcPerNode" in spec["elasticPolicy"] and "nprocPerNode" in spec:
                out.append("spec.elasticPolicy.nProcPerNode: must not be used with spec.nprocPerNode")
    if obj["kind"] == "RayJob":
        mode = obj["spec"].get("submissionMode", "K8sJobMode")
        if mode not in ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"):
            out.append(f"spec.submissionMode: {mode!r} is not a submission mode")
    return out


def problems(obj: dict[str, Any]) -> list[str]:
    """Everything the API server and the operator would reject in `obj`, as `path: message` lines."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    out = _meta_problems(obj)
    if key in CORE_KINDS:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            out.append(f"{'.'.join(str(p) for p in exc.path)}: {exc.message}")
        return out
    if key not in CRD_FILES:
        return [*out, f"{key}: no CRD known for this kind"]
    instance = apply_defaults(copy.deepcopy(obj), crd_schema(*key))
    for err in sorted(_validator(*key).iter_errors(instance), key=lambda e: list(e.absolute_path)):
        out.append(f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message[:300]}")
    for path, template in _pod_templates(obj):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "pod", **(template.get("metadata") or {})},
            "spec": template["spec"],
        }
        try:
            kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            out.append(f"{path}.{'.'.join(str(p) for p in exc.path)}: {exc.message}")
    out.extend(webhook_problems(obj))
    return out


def assert_valid(objs: list[dict[str, Any]]) -> None:
    """Fail with every problem of every object."""
    found = [f"{o.get('kind')}/{(o.get('metadata') or {}).get('name')}: {p}" for o in objs for p in problems(o)]
    assert not found, "\n".join(found)
