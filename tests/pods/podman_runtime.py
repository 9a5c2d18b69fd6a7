"""Pods as podman containers: the second runtime of the pods harness (runtime.py is the first).

`PodmanCluster(root, objects, pods, image=...)` runs the same pods (operators.py stays the single source
of what Kubeflow, Trainer/JobSet and KubeRay inject; kubelet.py of what Kubernetes adds) with the same
interface jobs.py and the tests drive: `start(name, wait=False)` / `tick()` / `poll` / `kill` /
`recreate` / `exec` / `volume` / `pvc` / `close`, plus `stop(name)`, the kubelet's deletion. What differs
is how a container runs: `podman run` of the built image (tests/containers/podrun.py turns the pod and
its template's `spec` into arguments), attached, so the `podman run` process ends with the container's
exit code:

- one podman network per cluster (netavark, `--internal`: no route off the bridge, not even the default
  route a pod has; Ray, which finds its node address by routing towards 8.8.8.8, falls back to resolving
  the hostname, which the container's /etc/hosts maps to the pod address; `dns_enabled`), each
  pod at a fixed address of its /24 (`--ip`, what `status.podIP` resolves to), its Services' names and
  its own FQDN as `--network-alias`es that the network's aardvark-dns answers (the stand-in for cluster
  DNS, instead of runtime.py's /etc/hosts). A name resolves while its pod's container runs: the
  readiness gate of runtime.py (`publish_not_ready`) is not modelled here;
- the image's user, PATH, HOME, WORKDIR and entrypoint, the template's `securityContext` (`--user`,
  `--read-only`, `--cap-drop ALL`, `no-new-privileges`), its volumes (ConfigMap and Secret read-only
  files, emptyDirs as directories kept across container restarts and new when the pod is recreated,
  `medium: Memory` as tmpfs and `/dev/shm` of its sizeLimit, a PVC as a directory every pod of the job
  shares), `resources.limits` as `--cpus`/`--memory`;
- init containers run in the same image (the operators' alpine/busybox images cannot be pulled here),
  with tests/pods/bin/nslookup over `nslookup`: it asks the container's resolver, i.e. aardvark-dns;
- exec probes through `podman exec` (the kubelet's own exec path: CRI ExecSync);
- `kill(name)`: `podman kill -s KILL` (a lost node); `stop(name)`: `podman stop -t
  terminationGracePeriodSeconds` (SIGTERM, then SIGKILL), in the background like the kubelet's deletion.

Needs podman with netavark and aardvark-dns (scripts/install-tools.sh) and the project's
images/containers.conf (`CONTAINERS_CONF`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import uuid
from pathlib import Path
from typing import Any

from tests.containers.images import build_images, podman
from tests.containers.podrun import container_args
from tests.pods.kubelet import HTTP_GET_PROBE, Pod, http_probe_url
from tests.pods.operators import _trainjob_spec
from tests.pods.runtime import PodCluster, PodState

__all__ = ["PodmanCluster", "template_spec"]

SUBNET_PREFIX = "10.215"  # runtime.py's namespaces use 10.214: the two runtimes may run side by side
NSLOOKUP = Path(__file__).with_name("bin") / "nslookup"
# This machine's rule, not the image's or an operator's (runtime.py's IMAGE_ENV sets it too): Ray reports
# no usage stats. A pod's own env, later on the command line, would override it.
MACHINE_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}
START_FAILED = 125  # `podman run`'s own error (no image, a bad argument, an address in use)
PT_REPLICA_LABEL = "training.kubeflow.org/replica-type"
JS_RJOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
RAY_GROUP_LABEL = "ray.io/group"  # head ("headgroup") and worker pods
RAY_CRD_LABEL = "ray.io/originated-from-crd"  # the submitter's


def template_spec(objects: list[dict[str, Any]], pod: Pod) -> dict[str, Any]:
    """The `spec` of the pod template POD was made from (its `securityContext`, grace period), which the
    Pod record does not carry: a PyTorchJob replica's, a TrainJob's replicated Job's after its
    runtime patches, or a RayJob's head or worker group's or its `submitterPodTemplate`'s."""
    kinds = {o.get("kind") for o in objects}
    if "PyTorchJob" in kinds and PT_REPLICA_LABEL in pod.labels:
        job = next(o for o in objects if o.get("kind") == "PyTorchJob")
        for rtype, replica in job["spec"]["pytorchReplicaSpecs"].items():
            if rtype.lower() == pod.labels[PT_REPLICA_LABEL]:
                spec: dict[str, Any] = replica["template"]["spec"]
                return spec
    if "TrainJob" in kinds and JS_RJOB_LABEL in pod.labels:
        _, _, jobset = _trainjob_spec(objects)
        for rjob in jobset["replicatedJobs"]:
            if rjob["name"] == pod.labels[JS_RJOB_LABEL]:
                spec = rjob["template"]["spec"]["template"]["spec"]
                return spec
    if "RayJob" in kinds and (RAY_GROUP_LABEL in pod.labels or pod.labels.get(RAY_CRD_LABEL) == "RayJob"):
        rayjob = next(o for o in objects if o.get("kind") == "RayJob")["spec"]
        if RAY_GROUP_LABEL not in pod.labels:  # the submitter: its submitterPodTemplate, else KubeRay's default
            spec = (rayjob.get("submitterPodTemplate") or {}).get("spec") or {}
            return spec
        cluster = rayjob["rayClusterSpec"]
        groups = [("headgroup", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
        for group_name, group in groups:
            if group_name == pod.labels[RAY_GROUP_LABEL]:
                spec = group["template"]["spec"]
                return spec
    raise NotImplementedError(f"pod {pod.name}: no PyTorchJob, TrainJob or RayJob pod template found for it")


class PodmanCluster(PodCluster):
    """The pods of one rendered job, as podman containers. Use as a context manager (always cleans up)."""

    def __init__(
        self,
        root: Path,
        objects: list[dict[str, Any]],
        pods: list[Pod],
        *,
        image: str,
        time_scale: float | None = None,
    ) -> None:
        super().__init__(root, objects, pods, time_scale)
        self.image = image
        self.network = f"{self.prefix}-net"
        self._names: dict[str, str] = {}  # pod -> its running (or last) container
        self._stops: list[subprocess.Popen[str]] = []
        self._specs = {p.name: template_spec(objects, p) for p in pods}
        self._renumber()

    def _renumber(self) -> None:
        for i, state in enumerate(self.pods.values()):
            state.ip = f"{SUBNET_PREFIX}.{self.octet}.{i + 2}"
            state.netns = ""

    # -- setup / teardown -------------------------------------------------------------------------
    def __enter__(self) -> PodmanCluster:
        try:
            self._network()
            for state in self.pods.values():
                (state.dir / "logs").mkdir(parents=True, exist_ok=True)
        except BaseException:
            self.close()
            raise
        return self

    def _network(self) -> None:
        # Another cluster (or helper) may hold the /24 drawn: draw again.
        for _ in range(8):
            made = podman(
                "network", "create", "--internal", "--subnet", f"{SUBNET_PREFIX}.{self.octet}.0/24", self.network
            )
            if made.returncode == 0:
                return
            self.octet = uuid.uuid4().int % 250 + 1
            self._renumber()
        raise RuntimeError(f"podman network create {self.network}: {made.stderr.strip()}")

    def close(self) -> None:
        # The network goes whatever happens before (pytest-timeout's exception landing in a wait below left
        # `trpod*-net` networks behind, each holding a /24 of the subnet the next clusters draw from).
        try:
            names = list(self._names.values())
            if names:
                # --ignore: podman 4.3 removes none of the names, silently and with exit 0, when one of them is
                # gone already (a container that ended and was removed by `--rm`, as the RayJob's submitter's).
                podman("rm", "--force", "--ignore", "--time", "0", *names, timeout=180)
            for state in self.pods.values():
                for proc in (state.proc, state.init_proc):
                    if proc is not None:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            proc.wait(timeout=60)
                self._stop_probes(state)
            for stop in self._stops:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    stop.wait(timeout=60)
        finally:
            podman("network", "rm", "--force", self.network, timeout=120)

    def _pod_dirs(self, state: PodState) -> None:
        """Nothing ahead of a start: `container_args` writes a pod incarnation's volumes when it launches."""

    # -- containers -------------------------------------------------------------------------------
    def _launch(self, state: PodState, container: dict[str, Any], tag: str) -> subprocess.Popen[bytes]:
        main = container is state.pod.container
        pod = state.pod if main else dataclasses.replace(state.pod, container=container)
        name = f"{self.prefix}-{state.pod.name}" + ("" if main else f"-{container['name']}")
        podman("rm", "--force", "--time", "0", name, timeout=120)  # a previous start's, if any is left
        self._names[state.pod.name] = name
        # Published names only on the main container: the init containers run before the pod is Ready.
        aliases = [*state.pod.own_hosts_names(), *state.pod.dns_names] if main else []
        run = container_args(
            pod,
            self.objects,
            state.dir / f"pod-{state.incarnation}",
            pod_spec=self._specs[state.pod.name],
            pod_ip=state.ip,
            shared=self.root / "pvc",
            name=name,
            network=self.network,
            ip=state.ip,
            aliases=aliases,
        )
        cmd = run.command(self.image, detach=False, remove=True)
        if not main:
            # The init images' nslookup (busybox) is the harness's shim, which asks aardvark-dns.
            cmd[2:2] = ["--volume", f"{NSLOOKUP}:/usr/local/bin/nslookup:ro"]
        cmd[2:2] = [a for k, v in MACHINE_ENV.items() for a in ("--env", f"{k}={v}")]  # the pod's own come later
        if main:
            state.env = build_images.podman_env()  # what the exec probes' `podman exec` runs with
        log = (state.dir / "logs" / f"{tag}.log").open("wb")
        try:
            return subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=build_images.podman_env()
            )
        finally:
            log.close()

    def _probe_argv(self, state: PodState, spec: dict[str, Any]) -> list[str] | None:
        if state.proc is None or state.proc.poll() is not None:
            return None
        if "httpGet" in spec:  # the kubelet's GET to the pod's address, from inside the pod here
            url = http_probe_url(spec, state.pod.container, state.ip)
            get = ["python3", "-c", HTTP_GET_PROBE, url, str(spec["timeoutSeconds"])]
            return ["podman", "exec", self._names[state.pod.name], *get]
        return ["podman", "exec", self._names[state.pod.name], *spec["exec"]["command"]]

    def poll(self, name: str) -> int | None:
        state = self.pods[name]
        if state.proc is not None and state.proc.poll() == START_FAILED and not state.killed:
            state.proc = None
            raise RuntimeError(f"podman could not start {name}'s container:\n{state.logs()[-2000:]}")
        return super().poll(name)

    def _kill(self, state: PodState) -> None:
        for proc in (state.init_proc, state.proc):
            if proc is not None and proc.poll() is None:
                if proc is state.proc:
                    state.killed = True
                podman("kill", "--signal", "KILL", self._names[state.pod.name], timeout=60)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=60)
        state.init_proc, state.init_due = None, None

    def stop(self, name: str) -> None:
        """Delete the pod as the kubelet does: SIGTERM, SIGKILL after the template's
        `terminationGracePeriodSeconds` (`podman stop -t`), in the background; its exit is left to `poll`."""
        state = self.pods[name]
        grace = int(self._specs[name].get("terminationGracePeriodSeconds", 30))
        state.events.append(f"{name}: deleted (podman stop -t {grace})")
        self._stops.append(
            subprocess.Popen(
                ["podman", "stop", "--time", str(grace), self._names[name]],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=build_images.podman_env(),
                text=True,
            )
        )

    def grace_s(self, name: str) -> int:
        return int(self._specs[name].get("terminationGracePeriodSeconds", 30))

    def exec(self, name: str, argv: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a command in the pod's running container (`podman exec`, as its user)."""
        return podman("exec", self._names[name], *argv, timeout=timeout_s)
