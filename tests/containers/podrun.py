"""A rendered pod as a podman container, the way the kubelet would run it (test code, not product).

`container_args` turns one pod, as `tests/pods/operators.py` returns it (the operator's env injected), and
the pod template's own `securityContext` and grace period into `podman run` arguments:

- the image's entrypoint replaced by the container's `command` + `args`, `$(VAR)`-expanded, and its env
  with downward-API `fieldRef`s and `secretKeyRef`s resolved, `envFrom` Secrets included (the harness's
  kubelet.py does both, read-only here);
- `securityContext`: `runAsUser`/`runAsGroup` -> `--user` (else the image's USER), `fsGroup` -> `--group-add`,
  `readOnlyRootFilesystem` -> `--read-only` (and `--read-only-tmpfs=false`: podman would otherwise mount
  writable tmpfs on /tmp, /var/tmp and /run, which a Kubernetes pod does not get), `capabilities.drop:
  [ALL]` -> `--cap-drop ALL`, `allowPrivilegeEscalation: false` -> `--security-opt no-new-privileges`;
  `seccompProfile: RuntimeDefault` is podman's default profile;
- volumes: a ConfigMap or Secret as a read-only directory of its items (a Secret's files 0440 by
  `defaultMode`, group fsGroup, as the kubelet writes them), an emptyDir as a host directory (mode 0777
  and fsGroup's setgid, like the kubelet's) kept after the run so a test can read what was written, an
  emptyDir `medium: Memory` on /dev/shm as `--shm-size` (elsewhere a tmpfs of its `sizeLimit`), a PVC as
  a directory shared by every pod of the job;
- `resources.limits` -> `--cpus` / `--memory`; `terminationGracePeriodSeconds` -> `--stop-timeout`
  (`podman stop` sends SIGTERM, then SIGKILL after it), Kubernetes' default 30 s without one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.pods.kubelet import Pod, container_argv, resolve_env, secret_data

DEFAULT_GRACE_S = 30  # the Pod API's default terminationGracePeriodSeconds

_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(q: str) -> int:
    """A Kubernetes memory quantity (`4Gi`, `512M`, `1000`) in bytes."""
    match = _QUANTITY.match(q)
    if not match or match.group(2) not in {**_BINARY, **_DECIMAL}:
        raise ValueError(f"unsupported quantity {q!r}")
    number, unit = float(match.group(1)), match.group(2)
    return int(number * (_BINARY.get(unit) or _DECIMAL[unit]))


def cpu_cores(q: str) -> float:
    """A Kubernetes CPU quantity (`2`, `500m`) in cores."""
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _configmap_data(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: dict(o.get("data") or {}) for o in objects if o.get("kind") == "ConfigMap"}


@dataclass
class PodRun:
    """`podman run` arguments for one pod, and the host directories behind its writable volumes.

    Attributes:
        args: everything after `podman run` up to the image (name, security, mounts, env, limits).
        argv: the container's command line (entrypoint first), after the image.
        volumes: volume name -> host directory (emptyDirs, PVCs, ConfigMaps and Secrets).
        grace_s: the pod's termination grace period (`podman stop -t`).
    """

    args: list[str]
    argv: list[str]
    volumes: dict[str, Path] = field(default_factory=dict)
    grace_s: int = DEFAULT_GRACE_S

    def command(
        self, image: str, argv: list[str] | None = None, *, detach: bool = True, remove: bool = False
    ) -> list[str]:
        """The whole `podman run` command line: detached (`-d`) or not, removed at its end (`--rm`) or not,
        running `argv` instead of the pod's command if given (`[]`: the image's ENTRYPOINT and CMD)."""
        argv = self.argv if argv is None else argv
        head = ["podman", "run", *(["-d"] if detach else []), *(["--rm"] if remove else []), *self.args]
        return [*head, image] if not argv else [*head, "--entrypoint", argv[0], image, *argv[1:]]


def _write_items(root: Path, data: Mapping[str, str], items: list[dict[str, Any]] | None, mode: int, gid: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for item in items or [{"key": k, "path": k} for k in data]:
        if item["key"] not in data:
            raise ValueError(f"volume item {item['key']!r} missing from its source")
        path = root / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data[item["key"]])
        os.chown(path, 0, gid)
        path.chmod(item.get("mode", mode))
    os.chown(root, 0, gid)
    root.chmod(0o755)


def _writable_dir(path: Path, gid: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, 0, gid)
    path.chmod(0o2777)  # the kubelet's emptyDir: 0777, fsGroup-owned with setgid
    return path


def container_args(
    pod: Pod,
    objects: list[dict[str, Any]],
    workdir: Path,
    *,
    pod_spec: Mapping[str, Any],
    pod_ip: str = "127.0.0.1",
    shared: Path | None = None,
    name: str | None = None,
    network: str = "none",
    ip: str | None = None,
    aliases: Sequence[str] = (),
) -> PodRun:
    """`podman run` arguments for POD (see the module docstring).

    Args:
        pod: the pod as operators.py returns it.
        objects: the rendered objects (the ConfigMap and Secrets its volumes and env name).
        workdir: where this pod's volume directories go.
        pod_spec: the pod template's `spec` (its `securityContext` and `terminationGracePeriodSeconds`,
            which the Pod record does not carry).
        pod_ip: what `status.podIP` resolves to.
        shared: where the job's PVC directories go (default: under `workdir`).
        name: the container's name (default: the pod's).
        network: `podman run --network` (default none: loopback only, enough for a one-pod job).
        ip: the container's address on `network` (`--ip`; `pod_ip` should say the same).
        aliases: names that resolve to the container on `network` (`--network-alias`: its Services'
            and hostname's cluster DNS names, answered by the network's aardvark-dns).
    """
    c = pod.container
    pod_sc = pod_spec.get("securityContext") or {}
    sc = {**pod_sc, **(c.get("securityContext") or {})}
    uid = int(sc.get("runAsUser", 0))
    gid = int(sc.get("runAsGroup", uid))
    fs_group = int(pod_sc.get("fsGroup", gid))
    args = [
        "--name",
        name or pod.name,
        "--hostname",
        pod.hostname,
        "--network",
        network,
        *(["--ip", ip] if ip else []),
        *[a for alias in aliases for a in ("--network-alias", alias)],
    ]
    # Without runAsUser the image's USER runs (a container's securityContext may leave it out: KubeRay's submitter).
    if "runAsUser" in sc:
        args += ["--user", f"{uid}:{gid}"]
    if "fsGroup" in pod_sc:
        args += ["--group-add", str(fs_group)]
    if sc.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]
    if "ALL" in (sc.get("capabilities") or {}).get("drop", []):
        args += ["--cap-drop", "ALL"]
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    if c.get("workingDir"):
        args += ["--workdir", c["workingDir"]]

    secrets = secret_data(objects)
    configmaps = _configmap_data(objects)
    host: dict[str, Path] = {}
    shm_size: int | None = None
    tmpfs: dict[str, dict[str, Any]] = {}
    for vol in pod.volumes:
        name = vol["name"]
        if "configMap" in vol:
            src = vol["configMap"]
            _write_items(workdir / "volumes" / name, configmaps[src["name"]], src.get("items"), 0o644, fs_group)
        elif "secret" in vol:
            src = vol["secret"]
            mode = src.get("defaultMode", 0o644)
            _write_items(workdir / "volumes" / name, secrets[src["secretName"]], src.get("items"), mode, fs_group)
        elif "emptyDir" in vol and (vol["emptyDir"] or {}).get("medium") == "Memory":
            tmpfs[name] = vol["emptyDir"]
            continue
        elif "emptyDir" in vol:
            _writable_dir(workdir / "volumes" / name, fs_group)
        elif "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            host[name] = _writable_dir((shared or workdir / "pvc") / claim, fs_group)
            continue
        else:
            raise NotImplementedError(f"pod {pod.name}: volume {name}: only configMap, secret, emptyDir, PVC")
        host[name] = workdir / "volumes" / name
    for mount in c.get("volumeMounts", []):
        if "subPath" in mount:
            raise NotImplementedError(f"pod {pod.name}: volumeMount {mount['name']}: subPath")
        path = mount["mountPath"]
        if mount["name"] in tmpfs:
            size = tmpfs[mount["name"]].get("sizeLimit")
            if path == "/dev/shm":
                shm_size = quantity_bytes(size) if size else 64 << 20
            else:
                opts = f",tmpfs-size={quantity_bytes(size)}" if size else ""
                args += ["--mount", f"type=tmpfs,destination={path},tmpfs-mode=1777{opts}"]
            continue
        args += ["--volume", f"{host[mount['name']]}:{path}" + (":ro" if mount.get("readOnly") else "")]
    if shm_size is not None:
        args += ["--shm-size", str(shm_size)]

    env = resolve_env(pod, pod_ip, secrets=secrets)
    for ref in c.get("envFrom", []):
        if "secretRef" in ref:
            known = {k for k, _ in env}
            env += [(k, v) for k, v in secrets.get(ref["secretRef"]["name"], {}).items() if k not in known]
    for key, value in env:
        args += ["--env", f"{key}={value}"]

    limits = (c.get("resources") or {}).get("limits") or {}
    if "cpu" in limits:
        args += ["--cpus", f"{cpu_cores(str(limits['cpu'])):g}"]
    if "memory" in limits:
        args += ["--memory", str(quantity_bytes(str(limits["memory"])))]
    grace = int(pod_spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))
    args += ["--stop-timeout", str(grace), "--stop-signal", "SIGTERM"]
    return PodRun(args=args, argv=container_argv(pod, env), volumes=host, grace_s=grace)
