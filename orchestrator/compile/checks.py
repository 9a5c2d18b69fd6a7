"""What a Kubernetes target refuses before anything is rendered or submitted, with the field and the fix.

- the operator's limit on `metadata.name` (`orchestrator.naming`);
- what the target cannot express (`trainjob.check_trainjob`: elastic specs, gang with a user runtime);
- checkpoint stores that all live inside one pod while the job can span several: the default
  `file://./checkpoints` is the pod's emptyDir run directory, so rank 0 would commit manifests over
  shards other pods hold and lose with them. Downgraded to a warning by `allow_pod_local_stores`
  (`--allow-pod-local-stores`; the chart's `allowPodLocalStores`);
- credentials written into `stores[].options` or `initFrom.options`: they would be stored in the spec
  ConfigMap and the job object, readable by anyone who can read those; `stores[].secretRef` names a
  Secret instead (the chart checks these with the same message); and any other credential
  `orchestrator.credentials` finds in the job (env, Ray's runtime env, a URI's userinfo), which the loader
  refuses already, for a `JobSpec` built in Python;
- a RayJob whose `spec.ray.rayVersion` is older than Ray's token authentication (2.52): the RayJob
  turns it on (`authOptions`), and KubeRay refuses token mode on an older Ray. Refused rather than
  rendered without `authOptions`: the Jobs API of such a cluster would run anyone's code.

A remote Ray cluster (`torchrig submit --backend ray --address`, and the cluster file of a target with
`Target.ray_cluster`) gets the same store rule for its nodes (`remote_ray_stores_problem`, same override):
a `file://` store is shared there only under `spec.ray.sharedDir`, a directory every node mounts; and a
relative `file://` store is refused unless the run directory lives under that directory, because the
entrypoint's working directory is Ray's working-dir cache, deleted with the session.

The other launch-plan targets (`torchrun`, `raytrain`) run where a path may well be shared (NFS on bare
metal), so only the Kubernetes targets apply the Kubernetes rules. The Helm chart applies the same ones with the
same messages (helm/torchrig/templates/_checks.tpl).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from orchestrator.credentials import inline_secrets, secret_option_paths
from orchestrator.errors import UnsupportedFeature
from orchestrator.spec import JobSpec
from orchestrator.targets import KUBERNETES_TARGETS, TARGETS, target_name_rule
from training.config import StoreConfig

__all__ = [
    "KUBERNETES_TARGETS",
    "check_name",
    "check_rayjob",
    "check_target",
    "inline_credentials_problem",
    "pod_local_stores_problem",
    "ray_version_problem",
    "remote_ray_stores_problem",
    "remote_ray_stores_warnings",
]

# The first Ray with token authentication (KubeRay ray-operator/controllers/ray/utils/validation.go,
# ValidateRayClusterSpec: "minimum Ray version is 2.52.0" for authOptions.mode token).
MIN_RAY_VERSION_WITH_AUTH = (2, 52)
# KubeRay's probes of a Ray container: an httpGet of the agent's `/api/healthz` from Ray 2.53
# (common/pod.go supportsUnifiedHealthCheck), before that `wget ... | grep success` exec probes.
MIN_RAY_VERSION_HTTP_PROBES = (2, 53)
_RAY_VERSION_RE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:[-+.].*)?$")


def check_name(spec: JobSpec, target: str, *, fixed_size: bool = False) -> None:
    """Raise UnsupportedFeature when the target's operator would reject `metadata.name` (orchestrator.naming).

    The job model takes any DNS-1035 name up to 63 characters; each Kubernetes target's operator derives
    longer names from it (Services, pods, the RayCluster), so its limit applies only to that target.
    """
    t = TARGETS.get(target)
    if t is None:
        return
    elastic = spec.spec.nodes.elastic and not fixed_size
    spare = spec.spec.restarts.standby_nodes if t.standby_nodes and not elastic else 0
    rule = target_name_rule(target, spec.spec.nodes.max, elastic=elastic, spare_nodes=spare)
    problem = rule.problem(spec.name) if rule else None
    if problem:
        raise UnsupportedFeature(problem)


def pod_local_stores_problem(spec: JobSpec) -> str | None:
    """The problem when the job can span several pods and no store is shared between them, else None.

    Shared: an object store, or a `file://` store on a PersistentVolumeClaim (`pvc:`). A `file://`
    store without one is the pod's own filesystem; `memory://` is the process's memory.
    """
    s = spec.spec
    if s.nodes.max <= 1:
        return None
    if any(st.shared for st in s.checkpoint.stores):
        return None
    return (
        "spec.checkpoint.stores: every store is pod-local (a file:// store without pvc is the pod's own "
        f"filesystem) and spec.nodes.max is {s.nodes.max}, so rank 0 would commit checkpoints whose shards "
        "other pods hold and lose; add a shared store: pvc: on a ReadWriteMany PersistentVolumeClaim, or an "
        "s3:// store (to accept it anyway: --allow-pod-local-stores, or the chart value allowPodLocalStores)"
    )


def _shared_on_ray(store: StoreConfig, shared_dir: str | None) -> bool:
    """Every node of a remote Ray cluster reaches this store: an object store, or a `file://` store under
    `spec.ray.sharedDir` (a relative one is under the run directory, which then lives there)."""
    if store.kind.shared:
        return True
    if not store.kind.filesystem or shared_dir is None:
        return False
    path = store.path
    return not path.startswith("/") or PurePosixPath(path).is_relative_to(shared_dir)


def remote_ray_stores_problem(spec: JobSpec, *, relative_only: bool = False) -> str | None:
    """The problem with the job's stores on a remote Ray cluster, else None.

    Args:
        spec: the validated job.
        relative_only: only the rule no override lifts: a relative `file://` store without
            `spec.ray.sharedDir` (it would resolve into the head node's Ray working-dir cache).
    """
    s = spec.spec
    shared_dir = s.ray.shared_dir
    if shared_dir is None:
        for i, store in enumerate(s.checkpoint.stores):
            if store.kind.filesystem and not store.path.startswith("/"):
                return (
                    f"spec.checkpoint.stores[{i}].uri: {store.uri} is relative to the run directory, which on a "
                    "remote Ray cluster is a directory of the head node, and the entrypoint's working directory is "
                    "Ray's working-dir cache (deleted with the session); set spec.ray.sharedDir to a directory "
                    "every node mounts (the run directory then lives there), or use an absolute file:// store on "
                    "such a mount or an s3:// store"
                )
    if relative_only or any(_shared_on_ray(st, shared_dir) for st in s.checkpoint.stores):
        return None
    where = f"outside spec.ray.sharedDir ({shared_dir})" if shared_dir else "without spec.ray.sharedDir"
    return (
        f"spec.checkpoint.stores: every store is node-local (a file:// store {where} is each Ray node's own disk) "
        "on a remote Ray cluster, so rank 0 would commit checkpoints whose shards other nodes hold and lose, and "
        "a worker restarted on another node finds none; add a shared store: a file:// store under "
        "spec.ray.sharedDir, a directory every node mounts (NFS), or an s3:// store (to accept it anyway: "
        "--allow-pod-local-stores)"
    )


def remote_ray_stores_warnings(spec: JobSpec, *, allow_node_local_stores: bool = False) -> list[str]:
    """`remote_ray_stores_problem` as a refusal, or a warning where the override allows it.

    Raises:
        UnsupportedFeature: naming the store and the fix.
    """
    relative = remote_ray_stores_problem(spec, relative_only=True)
    if relative:
        raise UnsupportedFeature(relative)
    problem = remote_ray_stores_problem(spec)
    if problem and not allow_node_local_stores:
        raise UnsupportedFeature(problem)
    return [problem] if problem else []


def inline_credentials_problem(spec: JobSpec) -> str | None:
    """The first credential written inline in a store's options (or initFrom's), else None."""
    ckpt = spec.spec.checkpoint
    sources = [(f"spec.checkpoint.stores[{i}]", st.options) for i, st in enumerate(ckpt.stores)]
    if ckpt.init_from is not None:
        sources.append(("spec.checkpoint.initFrom", ckpt.init_from.options))
    for where, options in sources:
        for path in secret_option_paths(options, f"{where}.options"):
            store = where if where.startswith("spec.checkpoint.stores[") else "spec.checkpoint.stores[]"
            return (
                f"{path}: credentials must not be inline for Kubernetes targets (they would be stored in the "
                f"spec ConfigMap); put them in a Secret and name it in {store}.secretRef: its keys (e.g. "
                "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) become the pods' environment, which fsspec reads"
            )
    return None


def ray_version_problem(spec: JobSpec) -> str | None:
    """The problem when `spec.ray.rayVersion` cannot run the RayJob's token authentication, else None."""
    version = spec.spec.ray.ray_version
    match = _RAY_VERSION_RE.match(version.strip())
    minimum = ".".join(map(str, MIN_RAY_VERSION_WITH_AUTH))
    if match and (int(match.group(1)), int(match.group(2))) >= MIN_RAY_VERSION_WITH_AUTH:
        return None
    why = f"{version!r} is older than {minimum}" if match else f"{version!r} is not a Ray version (like 2.60.0)"
    return (
        f"spec.ray.rayVersion: {why}; the RayJob turns on Ray's token authentication (authOptions mode token), "
        f"which needs Ray >= {minimum} (and KubeRay >= 1.5.1): use an image with Ray >= {minimum} "
        "(spec.ray.image) and set spec.ray.rayVersion to its version"
    )


def check_rayjob(spec: JobSpec, *, fixed_size: bool = False) -> list[str]:
    """The RayJob's own refusal (`Target.check`): a Ray too old for the token authentication it turns on.
    Warns when the spec sets the other targets' TTL to something else than their default: a RayJob's cluster
    goes after `spec.ray.clusterTtlSeconds` (a spec written for a PyTorchJob and rendered as a RayJob)."""
    old_ray = ray_version_problem(spec)
    if old_ray:
        raise UnsupportedFeature(old_ray)
    warnings = []
    version = _RAY_VERSION_RE.match(spec.spec.ray.ray_version.strip())
    if version and (int(version.group(1)), int(version.group(2))) < MIN_RAY_VERSION_HTTP_PROBES:
        warnings.append(
            f"spec.ray.rayVersion: {spec.spec.ray.ray_version}: KubeRay probes a Ray older than 2.53 with `wget`, "
            "which torchrig's images do not have: the head would never be Ready and the job never submitted; "
            "use Ray >= 2.53 (spec.ray.image and spec.ray.rayVersion) or an image with wget"
        )
    k = spec.spec.kubernetes
    default = type(k).model_fields["ttl_seconds_after_finished"].default
    if k.ttl_seconds_after_finished != default:
        ray_ttl = spec.spec.ray.cluster_ttl_seconds
        after = "kept" if ray_ttl is None else f"deleted {ray_ttl} s after the job"
        warnings.append(
            f"spec.kubernetes.ttlSecondsAfterFinished: a RayJob does not use it; its Ray cluster is {after} "
            "(spec.ray.clusterTtlSeconds)"
        )
    return warnings


def check_target(
    spec: JobSpec, target: str, *, fixed_size: bool = False, allow_pod_local_stores: bool = False
) -> list[str]:
    """Everything `target` refuses in `spec`, in the order the chart checks it; returns warnings.

    Args:
        spec: the validated job.
        target: any target; only the Kubernetes ones have rules here.
        fixed_size: run an elastic spec at `nodes.max` nodes.
        allow_pod_local_stores: warn about pod-local stores on a multi-node job instead of refusing it.

    Returns:
        `path: message` lines to print as warnings.

    Raises:
        UnsupportedFeature: naming the field to change and how.
    """
    t = TARGETS.get(target)
    if t is not None and t.ray_cluster:
        return remote_ray_stores_warnings(spec, allow_node_local_stores=allow_pod_local_stores)
    if t is None or target not in KUBERNETES_TARGETS:
        return []
    check_name(spec, target, fixed_size=fixed_size)
    if t.unsupported:
        t.load(t.unsupported)(spec, fixed_size=fixed_size)
    warnings: list[str] = []
    pod_local = pod_local_stores_problem(spec)
    if pod_local and not allow_pod_local_stores:
        raise UnsupportedFeature(pod_local)
    if pod_local:
        warnings.append(pod_local)
    credentials = inline_credentials_problem(spec)
    if credentials:
        raise UnsupportedFeature(credentials)
    # Everywhere else in the job (env, Ray's runtime env, URIs, task args): what the loader refuses, for a
    # JobSpec built through the Python API too (`orchestrator.credentials`).
    for finding in inline_secrets(spec):
        raise UnsupportedFeature(finding.error())
    if t.check:
        warnings += t.load(t.check)(spec, fixed_size=fixed_size)
    return warnings
