"""Pods as process trees: one network namespace per pod on a private bridge, the kubelet's files.

`PodCluster(root, objects, pods)` gives every pod a network namespace with one veth to a bridge that
lives in a namespace of its own (nothing is added to the host's network namespace); the addresses
come from a /24 in 10.214.0.0/16 that only these namespaces hold. `start(pod)` runs the pod's init
containers, then its container through podinit.py (new mount/UTS/IPC/PID namespaces) with:

- /etc/hosts: the kubelet's line for the pod itself plus the cluster DNS names of the pods of
  the job (the harness's stand-in for cluster DNS): a pod's names appear there only while it is
  Ready, or always when its Services publish not-ready addresses (`Pod.publish_not_ready`; kubelet.py).
  Each name's line sits at a fixed offset and is switched on and off by rewriting its first byte (`#`),
  so a resolver never reads a half-written file. /etc/resolv.conf points at 127.0.0.1 (nothing
  answers, so no lookup ever leaves the namespace);
- the init containers' `nslookup` is tests/pods/bin/nslookup, which resolves through that file (the
  operators' init containers run busybox's, against cluster DNS);
- each volumeMount bound at its mountPath: a ConfigMap volume is a read-only directory with its
  items (from the rendered ConfigMap), an emptyDir a directory of the pod (kept across container
  restarts, new when the pod is recreated; a Secret volume a read-only directory of the Secret's keys
  (from a Secret among `objects`); `medium: Memory` a tmpfs of its sizeLimit, fresh at
  each start), a PVC a directory shared by every pod that claims it;
- /dev/shm a 64 MiB tmpfs unless a volume is mounted there; /tmp a new directory per start (the
  container's writable layer) unless `readOnlyRootFilesystem`, which makes the root read-only;
- the image replaced by this repository's virtualenv: PATH starts with its bin/, the rest of the
  image's ENV, HOME and WORKDIR as images/cpu/Dockerfile sets them (IMAGE_ENV);
- processes run as root: `runAsUser`/`fsGroup` are not applied (the interpreter lives under /root).

With `start(name, wait=False)` and `tick()` (what jobs.py `run_job` does) a pod's init containers run
one after the other while the other pods run, and the kubelet's probes (kubelet.py `probe_spec`) run
as exec probes inside the container's namespaces (mount, PID, network, UTS, IPC, with the container's
env): the startup probe first, then readiness and liveness; Ready switches the pod's DNS names on; a
startup or liveness probe past its failureThreshold SIGKILLs the container (its exit, 137, is left to
`poll`, and the restart policy decides). `time_scale` multiplies every probe's `periodSeconds` and
`initialDelaySeconds` (default 1, or TORCHRIG_PODS_TIME_SCALE): at 0.2 a 10 s period is probed every
2 s. `timeoutSeconds` and whatever a probe command measures itself are not scaled (real seconds).

Env from `secretKeyRef` is read from the Secrets among `objects` (the rendered ones plus those an
operator makes, such as KubeRay's auth token Secret; kubelet.py `secret_data`).

Mount points missing on the host (e.g. /etc/torchrig) are created as empty directories and
removed at teardown when no other harness is running. Everything is torn down by `close()`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.pods.kubelet import (
    HTTP_GET_PROBE,
    Pod,
    container_argv,
    http_probe_url,
    probe_spec,
    resolve_env,
    restart_delay,
    secret_data,
)

__all__ = ["IMAGE_ENV", "INIT_FAILED", "NS_PREFIX", "PodCluster", "PodState", "netns_reason"]

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
NS_PREFIX = "trpod"
PODINIT = Path(__file__).with_name("podinit.py")
START_FAILED = 197  # podinit.START_FAILED
# What the image (images/cpu/Dockerfile, final stage) provides, its /opt/torchrig virtualenv replaced
# by this repository's: its ENV, HOME of its user (1000, `useradd --create-home torchrig`) and WORKDIR.
# The two RAY_ settings are this machine's rules (no usage stats, no auth token file), not the image's.
IMAGE_WORKDIR = "/home/torchrig"
IMAGE_ENV = {
    "PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONUNBUFFERED": "1",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    "TORCHRIG_RUN_DIR": "/var/run/torchrig",
    "HOME": IMAGE_WORKDIR,
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
}
DEFAULT_SHM = "64m"  # the container runtime's default /dev/shm
SHIMS = Path(__file__).with_name("bin")  # the harness's stand-ins for the init images' tools (nslookup)
# A pod that failed before its main container ran has no exit code for it: the Training Operator reads
# its magic default (TO pkg/controller.v1/common/pod.go ReconcilePods `exitCode = 0xbeef`), >= 128.
INIT_FAILED = 0xBEEF
PROBE_KINDS = ("startup", "readiness", "liveness")


@dataclass
class ProbeState:
    """One probe of the running container (kubelet prober worker): when it runs next, its run in flight."""

    spec: dict[str, Any]
    due: float
    failures: int = 0
    succeeded: bool = False
    proc: subprocess.Popen[bytes] | None = None
    deadline: float = 0.0


def netns_reason() -> str | None:
    """None when this machine can run the harness, else why not (for a skip)."""
    if not sys.platform.startswith("linux"):
        return "pods harness: needs Linux network namespaces"
    if os.geteuid() != 0:
        return "pods harness: needs root (network, mount and PID namespaces)"
    for tool in ("ip", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"pods harness: `{tool}` is not installed"
    probe = f"{NS_PREFIX}probe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    if made.returncode != 0:
        return f"pods harness: `ip netns add` fails here: {made.stderr.strip()}"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@dataclass
class PodState:
    """A pod of the cluster and what happened to it."""

    pod: Pod
    netns: str
    ip: str
    dir: Path
    incarnation: int = 0
    starts: int = 0
    restarts: int = 0  # container restarts in this pod incarnation (kubelet restartCount)
    exit_codes: list[int] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    killed: bool = False
    init_index: int = 0  # the init container running (with `init_proc`), or about to
    init_proc: subprocess.Popen[bytes] | None = None
    init_restarts: int = 0
    init_due: float | None = None  # when a crashed init container restarts (its back-off)
    init_failed: bool = False  # an init container failed under restartPolicy Never (reported by `poll` once)
    inits_done: int = -1  # the incarnation whose init containers all succeeded
    env: dict[str, str] = field(default_factory=dict)  # the main container's env (what exec probes get)
    probes: dict[str, ProbeState] = field(default_factory=dict)
    ready: bool = False
    published: bool = False
    events: list[str] = field(default_factory=list)  # probe results and kills, for the test's report

    @property
    def log(self) -> Path:
        return self.dir / "logs" / f"{self.pod.container['name']}-{self.starts}.log"

    def logs(self) -> str:
        out = []
        for path in sorted((self.dir / "logs").glob("*.log"), key=lambda p: p.stat().st_mtime):
            out.append(f"== {path.name}\n{path.read_text(errors='replace')}")
        return "\n".join(out)


class PodCluster:
    """The pods of one rendered job, as processes. Use as a context manager (always cleans up)."""

    def __init__(
        self, root: Path, objects: list[dict[str, Any]], pods: list[Pod], time_scale: float | None = None
    ) -> None:
        self.root = root
        self.objects = objects
        scale = os.environ.get("TORCHRIG_PODS_TIME_SCALE", "1")
        self.time_scale = time_scale if time_scale is not None else float(scale)
        self._hosts_offsets: dict[str, list[tuple[Path, int, str]]] = {}
        self.prefix = f"{NS_PREFIX}{uuid.uuid4().hex[:5]}"
        self.octet = uuid.uuid4().int % 250 + 1
        self.hub = f"{self.prefix}-hub"
        self.pods: dict[str, PodState] = {}
        self._made_dirs: list[Path] = []
        for i, pod in enumerate(pods):
            self.pods[pod.name] = PodState(pod, f"{self.prefix}-{i}", f"10.214.{self.octet}.{i + 2}", root / pod.name)

    # -- setup / teardown -------------------------------------------------------------------------
    def __enter__(self) -> PodCluster:
        try:
            self._network()
            for state in self.pods.values():
                self._pod_dirs(state)
            self._hosts()
            for state in self.pods.values():
                self._publish(state, state.pod.publish_not_ready)
            self._mount_points()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _network(self) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"10.214.{self.octet}.1/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, state in enumerate(self.pods.values()):
            _ip("netns", "add", state.netns)
            _ip("-n", self.hub, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", state.netns)
            _ip("-n", self.hub, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", state.netns, "addr", "add", f"{state.ip}/24", "dev", "eth0")
            _ip("-n", state.netns, "link", "set", "eth0", "up")
            _ip("-n", state.netns, "link", "set", "lo", "up")
            # A default route, as a pod has (Ray finds its own address by routing towards 8.8.8.8);
            # it ends in the hub namespace, which has no route anywhere: nothing leaves the machine.
            _ip("-n", state.netns, "route", "add", "default", "via", f"10.214.{self.octet}.1")

    def _pod_dirs(self, state: PodState) -> None:
        base = state.dir / f"pod-{state.incarnation}"
        (state.dir / "logs").mkdir(parents=True, exist_ok=True)
        for vol in state.pod.volumes:
            path = base / "volumes" / vol["name"]
            if "configMap" in vol:
                cm = self._configmap(vol["configMap"]["name"])
                path.mkdir(parents=True, exist_ok=True)
                items = vol["configMap"].get("items") or [{"key": k, "path": k} for k in cm.get("data", {})]
                for item in items:
                    (path / item["path"]).write_text(cm["data"][item["key"]])
            elif "emptyDir" in vol:
                path.mkdir(parents=True, exist_ok=True)
            elif "persistentVolumeClaim" in vol:
                (self.root / "pvc" / vol["persistentVolumeClaim"]["claimName"]).mkdir(parents=True, exist_ok=True)
            elif "secret" in vol:
                # The kubelet does not start a pod whose non-optional Secret volume is missing.
                ref = vol["secret"]
                data = secret_data(self.objects).get(ref["secretName"])
                if data is None and not ref.get("optional"):
                    raise ValueError(f"{state.pod.name}: volume {vol['name']}: Secret {ref['secretName']} not found")
                path.mkdir(parents=True, exist_ok=True)
                items = ref.get("items") or [{"key": k, "path": k} for k in (data or {})]
                for item in items:
                    if item["key"] in (data or {}):
                        (path / item["path"]).write_text((data or {})[item["key"]])
                        os.chmod(path / item["path"], int(item.get("mode", ref.get("defaultMode", 0o644))))
            else:
                raise NotImplementedError(f"volume {vol['name']!r}: only configMap, secret, emptyDir, PVC are emulated")

    def _configmap(self, name: str) -> dict[str, Any]:
        for obj in self.objects:
            if obj.get("kind") == "ConfigMap" and obj["metadata"]["name"] == name:
                return obj
        raise ValueError(f"ConfigMap {name!r} is not among the rendered objects")

    def _hosts(self) -> None:
        for state in self.pods.values():
            head = ["# Kubernetes-managed hosts file (pods harness).", "127.0.0.1\tlocalhost"]
            head.append("\t".join([state.ip, *state.pod.own_hosts_names()]))
            text = "\n".join(head) + "\n"
            # Every pod's Service names, the pod's own included: from inside the pod they resolve through
            # cluster DNS too (the kubelet's line above holds only its hostname and FQDN).
            for other in self.pods.values():
                if other.pod.dns_names:
                    line = "\t".join([other.ip, *other.pod.dns_names])
                    self._hosts_offsets.setdefault(other.pod.name, []).append((state.dir / "hosts", len(text), line[0]))
                    text += "#" + line[1:] + "\n"  # off until the pod is published (`_publish`)
            (state.dir / "hosts").write_text(text)
            (state.dir / "resolv.conf").write_text(
                f"nameserver 127.0.0.1\nsearch {state.pod.namespace}.svc.cluster.local svc.cluster.local\n"
            )

    def _publish(self, state: PodState, on: bool) -> None:
        """Switch the pod's cluster-DNS names on or off in every other pod's /etc/hosts (one byte each)."""
        if state.published == on:
            return
        for path, offset, first in self._hosts_offsets.get(state.pod.name, []):
            fd = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(fd, (first if on else "#").encode(), offset)
            finally:
                os.close(fd)
        state.published = on

    def resolvable(self, name: str) -> bool:
        """Whether the pod's Service names resolve in the other pods now."""
        return self.pods[name].published

    def _mount_points(self) -> None:
        """Create on the host the mount points that neither exist nor lie inside an earlier mount
        (podinit creates those inside their volume), and the image's WORKDIR."""
        targets: list[Path] = [Path(IMAGE_WORKDIR)]
        for state in self.pods.values():
            for c in [state.pod.container, *state.pod.init_containers]:
                earlier: list[Path] = [Path("/tmp"), Path("/dev/shm")]
                for m in c.get("volumeMounts", []):
                    target = Path(m["mountPath"])
                    if not any(target.is_relative_to(e) for e in earlier):
                        targets.append(target)
                    earlier.append(target)
        for target in targets:
            if target.exists():
                continue
            top = target
            while not top.parent.exists():
                top = top.parent
            target.mkdir(parents=True)
            self._made_dirs.append(top)

    def close(self) -> None:
        for state in self.pods.values():
            self._kill(state)
        for state in self.pods.values():
            subprocess.run(["ip", "netns", "del", state.netns], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.hub], capture_output=True, check=False)
        others = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        if not any(line.startswith(NS_PREFIX) for line in others.splitlines()):
            for top in reversed(self._made_dirs):
                _remove_empty_dirs(top)
        self._made_dirs.clear()

    # -- containers -------------------------------------------------------------------------------
    def _mounts(self, state: PodState, container: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
        base = state.dir / f"pod-{state.incarnation}" / "volumes"
        vols = {v["name"]: v for v in state.pod.volumes}
        mounts: list[dict[str, Any]] = []
        if not _readonly_root(container):  # the container's writable layer: a fresh /tmp per start
            mounts.append({"type": "bind", "src": str(tmp), "dst": "/tmp"})
        mounts.append({"type": "tmpfs", "size": DEFAULT_SHM, "dst": "/dev/shm"})  # the runtime's default
        mounts.append({"type": "bind", "src": str(state.dir / "hosts"), "dst": "/etc/hosts"})
        mounts.append({"type": "bind", "src": str(state.dir / "resolv.conf"), "dst": "/etc/resolv.conf"})
        for m in container.get("volumeMounts", []):
            vol = vols[m["name"]]
            if "emptyDir" in vol and vol["emptyDir"].get("medium") == "Memory":
                size = vol["emptyDir"].get("sizeLimit", "50%")
                mounts.append({"type": "tmpfs", "size": _tmpfs_size(size), "dst": m["mountPath"]})
            elif "persistentVolumeClaim" in vol:
                src = self.root / "pvc" / vol["persistentVolumeClaim"]["claimName"]
                mounts.append({"type": "bind", "src": str(src), "dst": m["mountPath"], "ro": m.get("readOnly")})
            else:
                ro = m.get("readOnly") or "configMap" in vol or "secret" in vol
                mounts.append({"type": "bind", "src": str(base / m["name"]), "dst": m["mountPath"], "ro": ro})
        # The "image" is this checkout and its venv: mounted last, read-only, at its own path, so that a
        # volume over one of its parents (the /tmp emptyDir of a read-only root, with the clone under
        # /tmp) cannot hide it from the container.
        mounts.append({"type": "bind", "src": str(REPO), "dst": str(REPO), "ro": True})
        return mounts

    def _launch(self, state: PodState, container: dict[str, Any], tag: str) -> subprocess.Popen[bytes]:
        tmp = state.dir / f"pod-{state.incarnation}" / f"tmp-{tag}"
        tmp.mkdir(parents=True, exist_ok=True)
        env = resolve_env(state.pod, state.ip, container, secret_data(self.objects))
        argv = container_argv(state.pod, env, container)
        image_env = dict(IMAGE_ENV)
        if container is not state.pod.container:  # an init container: its image's tools are the shims
            image_env["PATH"] = f"{SHIMS}:{image_env['PATH']}"
        full_env = {**image_env, "HOSTNAME": state.pod.hostname, **dict(env)}
        if container is state.pod.container:
            state.env = full_env
        cfg = {
            "mounts": self._mounts(state, container, tmp),
            "readonly_root": _readonly_root(container),
            "hostname": state.pod.hostname,
            "cwd": container.get("workingDir") or IMAGE_WORKDIR,
            "argv": argv,
            "env": full_env,
        }
        cfg_path = state.dir / f"podinit-{tag}.json"
        cfg_path.write_text(json.dumps(cfg, indent=1))
        log = (state.dir / "logs" / f"{tag}.log").open("wb")
        cmd = ["nsenter", f"--net=/run/netns/{state.netns}", "--", sys.executable, "-I", str(PODINIT), str(cfg_path)]
        try:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()

    def argv_env(self, name: str) -> tuple[list[str], dict[str, str]]:
        """The main container's argv and env (kubelet-resolved), as `start` would run them."""
        state = self.pods[name]
        env = resolve_env(state.pod, state.ip, secrets=secret_data(self.objects))
        return container_argv(state.pod, env), dict(env)

    def start(self, name: str, init_timeout_s: float = 120, *, wait: bool = True) -> None:
        """Run the pod's init containers to completion, then start its container.

        With `wait=False` the first init container (or the container) is started and `tick` runs the
        rest while the caller goes on, as the kubelet does."""
        state = self.pods[name]
        if not wait:
            # A container restarted in place does not rerun the init containers; a new pod does.
            done = state.inits_done == state.incarnation
            state.init_index = len(state.pod.init_containers) if done else 0
            state.init_restarts, state.init_due = 0, None
            self._next_init(state)
            return
        for i, init in enumerate(state.pod.init_containers):
            proc = self._launch(state, init, f"init{i}-{init['name']}-{state.incarnation}-{state.starts}")
            try:
                code = proc.wait(timeout=init_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise TimeoutError(f"{name}: init container {init['name']} did not finish") from None
            if code != 0:
                raise RuntimeError(f"{name}: init container {init['name']} exited {code}\n{state.logs()}")
        self._start_main(state)

    def _start_main(self, state: PodState) -> None:
        state.starts += 1
        state.killed = False
        self._set_ready(state, False)
        state.proc = self._launch(state, state.pod.container, f"{state.pod.container['name']}-{state.starts}")
        now = time.monotonic()
        state.probes = {}
        for kind in PROBE_KINDS:
            spec = probe_spec(state.pod.container, kind)
            if spec is not None:
                state.probes[kind] = ProbeState(spec, now + spec["initialDelaySeconds"] * self.time_scale)
        if not {"startup", "readiness"} & set(state.probes):
            self._set_ready(state, True)  # Started at once, and Ready with it (liveness plays no part)

    def _next_init(self, state: PodState) -> None:
        """Start init container `init_index`, or the main container once every init container succeeded."""
        if state.init_index >= len(state.pod.init_containers):
            state.inits_done = state.incarnation
            self._start_main(state)
            return
        init = state.pod.init_containers[state.init_index]
        tag = f"init{state.init_index}-{init['name']}-{state.incarnation}-{state.starts}-{state.init_restarts}"
        state.init_proc = self._launch(state, init, tag)

    def _set_ready(self, state: PodState, ready: bool) -> None:
        state.ready = ready
        self._publish(state, ready or state.pod.publish_not_ready)

    def tick(self) -> None:
        """One pass of the kubelet over every pod: advance init containers, run the probes that are due."""
        now = time.monotonic()
        for state in self.pods.values():
            if state.init_due is not None and now >= state.init_due:
                state.init_due = None
                self._next_init(state)
            if state.init_proc is not None:
                code = state.init_proc.poll()
                if code is not None:
                    self._init_exited(state, code)
            if state.proc is not None and state.proc.poll() is None:
                self._probe(state, now)

    def _init_exited(self, state: PodState, code: int) -> None:
        init = state.pod.init_containers[state.init_index]
        state.init_proc = None
        state.events.append(f"{state.pod.name}: init container {init['name']} exited {code}")
        if code == 0:
            state.init_index += 1
            self._next_init(state)
        elif state.pod.restart_policy == "Never":
            state.exit_codes.append(INIT_FAILED)  # the pod is Failed; its container never ran
            state.init_failed = True
        else:
            state.init_due = time.monotonic() + restart_delay(state.init_restarts + 1)
            state.init_restarts += 1

    def _container_pid(self, state: PodState) -> int | None:
        """The host PID of the container's PID 1 (podinit's only child)."""
        assert state.proc is not None
        try:
            children = Path(f"/proc/{state.proc.pid}/task/{state.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def _probe(self, state: PodState, now: float) -> None:
        """kubelet prober: startup until it succeeds, then readiness and liveness, each on its period."""
        started = "startup" not in state.probes or state.probes["startup"].succeeded
        for kind, probe in state.probes.items():
            if kind != "startup" and not started:
                continue
            if kind == "startup" and probe.succeeded:
                continue
            if probe.proc is not None:
                code = probe.proc.poll()
                if code is None and now < probe.deadline:
                    continue
                if code is None:  # timeoutSeconds: a failure
                    probe.proc.kill()
                    probe.proc.wait()
                probe.proc = None
                self._probe_result(state, kind, probe, code == 0)
                if state.killed:
                    return
                started = "startup" not in state.probes or state.probes["startup"].succeeded
                continue
            if now < probe.due:
                continue
            probe.due = now + probe.spec["periodSeconds"] * self.time_scale
            cmd = self._probe_argv(state, probe.spec)
            if cmd is None:
                continue
            log = (state.dir / "logs" / f"probe-{kind}.log").open("ab")
            try:
                probe.proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=state.env
                )
            finally:
                log.close()
            probe.deadline = now + probe.spec["timeoutSeconds"]

    def _probe_argv(self, state: PodState, spec: dict[str, Any]) -> list[str] | None:
        """An exec probe's command, entering the container's namespaces; an httpGet probe's GET from the
        pod's network namespace (None: no container process)."""
        pid = self._container_pid(state)
        if pid is None:
            return None
        if "httpGet" in spec:
            url = http_probe_url(spec, state.pod.container, state.ip)
            get = [sys.executable, "-c", HTTP_GET_PROBE, url, str(spec["timeoutSeconds"])]
            return ["nsenter", f"--net=/run/netns/{state.netns}", "--", *get]
        return ["nsenter", "-t", str(pid), "-m", "-p", "-n", "-u", "-i", "--", *spec["exec"]["command"]]

    def run_probe(self, name: str, kind: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """Run the container's `<kind>Probe` once now, as the kubelet would (for a test to read its verdict)."""
        state = self.pods[name]
        spec = probe_spec(state.pod.container, kind)
        cmd = self._probe_argv(state, spec) if spec is not None and state.proc is not None else None
        if cmd is None:
            raise ValueError(f"{name}: no running container with a {kind} probe")
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=state.env, check=False)

    def _probe_result(self, state: PodState, kind: str, probe: ProbeState, ok: bool) -> None:
        if ok:
            probe.failures = 0
            if not probe.succeeded:
                state.events.append(f"{state.pod.name}: {kind} probe succeeded")
            probe.succeeded = True
        else:
            probe.failures += 1
            if kind == "readiness":
                probe.succeeded = False
        if kind in ("startup", "liveness") and probe.failures >= probe.spec["failureThreshold"]:
            state.events.append(f"{state.pod.name}: {kind} probe failed {probe.failures} times: container killed")
            self._kill(state)
            self._set_ready(state, False)
            return
        started = "startup" not in state.probes or state.probes["startup"].succeeded
        readiness = state.probes.get("readiness")
        self._set_ready(state, started and (readiness is None or readiness.succeeded))

    def poll(self, name: str) -> int | None:
        """The container's exit code once it has exited (recorded once), else None; `INIT_FAILED` once
        for a pod whose init container failed under `restartPolicy: Never`."""
        state = self.pods[name]
        if state.init_failed:
            state.init_failed = False
            return INIT_FAILED
        if state.proc is None:
            return None
        code = state.proc.poll()
        if code is None:
            return None
        if code == START_FAILED:
            state.proc = None
            raise RuntimeError(f"pods harness: could not start {name}'s container:\n{state.logs()[-2000:]}")
        code = 137 if state.killed else (128 - code if code < 0 else code)
        state.exit_codes.append(code)
        state.proc = None
        self._stop_probes(state)
        self._set_ready(state, False)
        return code

    def _stop_probes(self, state: PodState) -> None:
        for probe in state.probes.values():
            if probe.proc is not None and probe.proc.poll() is None:
                probe.proc.kill()
                probe.proc.wait()
        state.probes = {}

    def _kill(self, state: PodState) -> None:
        if state.init_proc is not None and state.init_proc.poll() is None:
            state.init_proc.kill()
            state.init_proc.wait()
        state.init_proc, state.init_due = None, None
        if state.proc is not None and state.proc.poll() is None:
            state.killed = True
            state.proc.send_signal(signal.SIGKILL)  # podinit's PID 1 dies with it (PDEATHSIG)
            with contextlib.suppress(subprocess.TimeoutExpired):
                state.proc.wait(timeout=20)

    def kill(self, name: str) -> None:
        """SIGKILL the pod's whole process tree (its PID namespace), like a lost node. The exit (137)
        is left for `poll`, so whoever supervises the pod sees it and reacts."""
        self._kill(self.pods[name])

    def recreate(self, name: str) -> None:
        """The controller deletes the pod and creates one of the same name: new emptyDirs, restart count 0."""
        state = self.pods[name]
        self._kill(state)
        self.poll(name)
        state.init_failed = False
        self._set_ready(state, False)
        state.incarnation += 1
        state.restarts = 0
        self._pod_dirs(state)

    def exec(self, name: str, argv: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a command in the pod's network namespace only (like a probe from the node)."""
        state = self.pods[name]
        cmd = ["nsenter", f"--net=/run/netns/{state.netns}", "--", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)

    def volume(self, name: str, volume: str) -> Path:
        """The host directory of a pod's emptyDir or ConfigMap volume (current incarnation)."""
        state = self.pods[name]
        return state.dir / f"pod-{state.incarnation}" / "volumes" / volume

    def pvc(self, claim: str) -> Path:
        return self.root / "pvc" / claim


def _readonly_root(container: dict[str, Any]) -> bool:
    return bool((container.get("securityContext") or {}).get("readOnlyRootFilesystem"))


def _remove_empty_dirs(top: Path) -> None:
    """rmdir `top` and the directories below it, bottom-up, if none holds a file (mount points only)."""
    for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: -len(w[0])):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)


def _tmpfs_size(quantity: str) -> str:
    units = {"Ki": "k", "Mi": "m", "Gi": "g", "Ti": "t"}
    for k, v in units.items():
        if str(quantity).endswith(k):
            return str(quantity)[: -len(k)] + v
    return str(quantity)


def wait_until(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
