"""Every pod torchrig generates passes the Pod Security Standard "restricted" and is hardened beyond it
(issue 13 point 14): a read-only root filesystem with a writable volume wherever the worker writes, no
ServiceAccount token, a liveness probe from the worker's health check (no startup probe: readiness must not
wait for the rendezvous), ephemeral-storage requests. The PyTorchJob pods are also checked as the Training
Operator makes them, its `init-pytorch` init container included (issue 40 point 4).

The PSS checks are written from the standard itself (kubernetes.io/docs/concepts/security/pod-security-
standards, the "Baseline" and "Restricted" tables, Kubernetes v1.33), not from what the compiler emits:
every control of both profiles that a pod spec can violate, over every container, init container and
ephemeral container. GPUs need none of the forbidden settings (the device plugin injects the devices).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from orchestrator.compile import MANIFEST_TARGETS, compile
from orchestrator.compile._pod import CACHE_DIR, HEALTHCHECK, TMP_DIR, store_mount_path
from orchestrator.errors import UnsupportedFeature
from orchestrator.loader import load_spec, validate_document
from orchestrator.spec import JobSpec
from tests.unit.test_compile_hypothesis import job_documents

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
RUN_DIR = "/var/run/torchrig"

# -- the Pod Security Standards, as written -------------------------------------------------------------

RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for key in ("containers", "initContainers", "ephemeralContainers") for c in pod.get(key) or []]


def pss_restricted_problems(pod: dict[str, Any], annotations: dict[str, str] | None = None) -> list[str]:
    """Every control of the "restricted" profile (which includes "baseline") that the pod spec violates."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    containers = _containers(pod)
    scs = [(c.get("name", "?"), c.get("securityContext") or {}) for c in containers]
    # Baseline.
    if (psc.get("windowsOptions") or {}).get("hostProcess") or any(
        (sc.get("windowsOptions") or {}).get("hostProcess") for _, sc in scs
    ):
        out.append("HostProcess")
    out += [f"host namespaces: {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    out += [f"privileged: {n}" for n, sc in scs if sc.get("privileged")]
    for name, sc in scs:
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f"capabilities (baseline): {name} adds {sorted(added - BASELINE_CAPABILITIES)}")
    out += [f"hostPath volume: {v['name']}" for v in pod.get("volumes") or [] if "hostPath" in v]
    out += [f"host port: {c.get('name')}" for c in containers for p in c.get("ports") or [] if p.get("hostPort")]
    for who, sc in [("pod", psc), *scs]:
        apparmor = (sc.get("appArmorProfile") or {}).get("type")
        if apparmor not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"AppArmor: {who} {apparmor}")
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            out.append(f"SELinux: {who}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"seccomp (baseline): {who} Unconfined")
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            out.append(f"AppArmor annotation: {key}")
    out += [f"/proc mount: {n}" for n, sc in scs if sc.get("procMount", "Default") != "Default"]
    out += [f"sysctl: {s['name']}" for s in psc.get("sysctls") or [] if s["name"] not in SAFE_SYSCTLS]
    # Restricted.
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            out.append(f"volume type: {v['name']} {sorted(kinds)}")
    out += [f"privilege escalation: {n}" for n, sc in scs if sc.get("allowPrivilegeEscalation") is not False]
    pod_non_root = psc.get("runAsNonRoot") is True
    for name, sc in scs:
        if sc.get("runAsNonRoot") is False or not (pod_non_root or sc.get("runAsNonRoot") is True):
            out.append(f"non-root: {name}")
    out += [f"runAsUser 0: {who}" for who, sc in [("pod", psc), *scs] if sc.get("runAsUser") == 0]
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    for name, sc in scs:
        own = (sc.get("seccompProfile") or {}).get("type")
        if own not in ("RuntimeDefault", "Localhost") and (
            own is not None or pod_seccomp not in ("RuntimeDefault", "Localhost")
        ):
            out.append(f"seccomp: {name}")
    for name, sc in scs:
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"capabilities: {name} does not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"capabilities: {name} adds more than NET_BIND_SERVICE")
    return out


# -- the pods of the compiled objects --------------------------------------------------------------------


def _merge_patch(pod: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Trainer's runtimePatches over a runtime's pod spec: fields replace, containers merge by name."""
    out = copy.deepcopy(pod)
    for key, value in patch.items():
        if key == "containers":
            by_name = {c["name"]: c for c in out.get("containers", [])}
            for ctr in value:
                by_name.setdefault(ctr["name"], {"name": ctr["name"]}).update(copy.deepcopy(ctr))
            out["containers"] = list(by_name.values())
        else:
            out[key] = copy.deepcopy(value)
    return out


def pods(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """(where, pod spec as it runs, pod annotations) of every pod the objects create."""
    out: list[tuple[str, dict[str, Any], dict[str, str]]] = []
    runtime = next((o for o in objs if o["kind"].endswith("TrainingRuntime")), None)
    for o in objs:
        spec = o.get("spec", {})
        if o["kind"] == "PyTorchJob":
            for rtype, r in spec["pytorchReplicaSpecs"].items():
                tmpl = r["template"]
                out.append((f"PyTorchJob {rtype}", tmpl["spec"], tmpl["metadata"].get("annotations", {})))
        elif o["kind"] == "RayJob":
            cluster = spec["rayClusterSpec"]
            groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
            for name, group in groups:
                tmpl = group["template"]
                pod = tmpl["spec"]
                if name == "head" and cluster["enableInTreeAutoscaling"]:
                    # KubeRay's autoscaler sidecar (BuildAutoscalerContainer) takes autoscalerOptions.securityContext.
                    sidecar = {"name": "autoscaler", "securityContext": cluster["autoscalerOptions"]["securityContext"]}
                    pod = {**pod, "containers": [*pod["containers"], sidecar]}
                out.append((f"RayJob {name}", pod, tmpl["metadata"].get("annotations", {})))
        elif o["kind"] == "TrainJob":
            patch = spec["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
            patch_tmpl = patch["template"]["spec"]["template"]
            base: dict[str, Any] = {}
            if runtime is not None:
                base = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
            out.append(("TrainJob node", _merge_patch(base, patch_tmpl["spec"]), patch_tmpl["metadata"]["annotations"]))
    return out


def compiled_everywhere(spec: JobSpec) -> list[tuple[str, list[dict[str, Any]]]]:
    out = []
    for target in MANIFEST_TARGETS:
        try:
            objs = compile(spec, target, monitoring=True, fixed_size=True, allow_pod_local_stores=True)
        except UnsupportedFeature:
            continue
        out.append((target, objs))
    return out


def example_objects() -> list[tuple[str, list[dict[str, Any]]]]:
    out = []
    for example in EXAMPLES:
        spec = load_spec(example)
        for target in MANIFEST_TARGETS:
            for fixed in (False, True):
                if target == "trainjob" and spec.spec.nodes.elastic and not fixed:
                    continue
                out.append((f"{example.stem}-{target}-{fixed}", compile(spec, target, fixed_size=fixed)))
    return out


EXAMPLE_OBJECTS = example_objects()


# -- tests ------------------------------------------------------------------------------------------------


def test_the_checker_catches_each_kind_of_violation() -> None:
    bad = {
        "hostNetwork": True,
        "securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]},
        "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
        "containers": [
            {
                "name": "c",
                "ports": [{"containerPort": 80, "hostPort": 80}],
                "securityContext": {"privileged": True, "runAsUser": 0, "capabilities": {"add": ["SYS_ADMIN"]}},
            }
        ],
    }
    found = " | ".join(pss_restricted_problems(bad))
    for control in (
        "host namespaces: hostNetwork",
        "privileged: c",
        "capabilities (baseline)",
        "hostPath volume: h",
        "host port: c",
        "sysctl: kernel.msgmax",
        "volume type: h",
        "privilege escalation: c",
        "non-root: c",
        "runAsUser 0: c",
        "seccomp: c",
        "capabilities: c does not drop ALL",
    ):
        assert control in found


@pytest.mark.parametrize(("name", "objs"), EXAMPLE_OBJECTS, ids=[n for n, _ in EXAMPLE_OBJECTS])
def test_example_pods_pass_the_restricted_standard(name: str, objs: list[dict[str, Any]]) -> None:
    found = pods(objs)
    assert found
    for where, pod, pod_annotations in found:
        assert pss_restricted_problems(pod, pod_annotations) == [], where


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=job_documents())
def test_random_specs_give_restricted_pods(doc: dict[str, Any]) -> None:
    for target, objs in compiled_everywhere(validate_document(doc)):
        for where, pod, pod_annotations in pods(objs):
            assert pss_restricted_problems(pod, pod_annotations) == [], (target, where)


@pytest.mark.parametrize(("name", "objs"), EXAMPLE_OBJECTS, ids=[n for n, _ in EXAMPLE_OBJECTS])
def test_root_filesystem_is_read_only_and_every_written_path_is_a_volume(name: str, objs: list[dict[str, Any]]) -> None:
    spec = load_spec(REPO / "examples" / f"{name.split('-', 2)[0]}-{name.split('-', 2)[1]}.yaml")
    ckpt = spec.spec.checkpoint
    written = [RUN_DIR, TMP_DIR, CACHE_DIR] + [store_mount_path(s.path) for s in ckpt.stores if s.scheme == "file"]
    written += [ckpt.node_local.path] if ckpt.node_local.enabled else []
    for where, pod, _ in pods(objs):
        for ctr in pod["containers"]:
            if ctr["name"] == "autoscaler":  # KubeRay's sidecar, not a torchrig container
                continue
            assert ctr["securityContext"]["readOnlyRootFilesystem"] is True, where
            mounts = [m["mountPath"] for m in ctr["volumeMounts"] if not m.get("readOnly")]
            for path in written:
                assert any(path == m or path.startswith(m + "/") for m in mounts), (where, path, mounts)


def test_an_absolute_store_without_a_claim_gets_an_emptydir() -> None:
    spec = load_spec(
        REPO / "examples" / "digits-ddp.yaml", ["spec.nodes.max=1", "spec.checkpoint.stores=[{uri: file:///ckpt/a}]"]
    )
    (_, pod, _) = pods(compile(spec, "pytorchjob"))[0]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/ckpt/a"]
    assert {"name": mount["name"], "emptyDir": {}} in pod["volumes"]


def test_no_service_account_token_unless_asked() -> None:
    for name, objs in EXAMPLE_OBJECTS:
        for where, pod, _ in pods(objs):
            if where == "RayJob head" and name.endswith("-rayjob-False"):  # both examples are elastic
                # KubeRay's autoscaler (an elastic worker group) runs beside the head and needs the API.
                assert pod["automountServiceAccountToken"] is True
            else:
                assert pod["automountServiceAccountToken"] is False, (name, where)
    asked = load_spec(REPO / "examples" / "digits-ddp.yaml", ["spec.kubernetes.automountServiceAccountToken=true"])
    for _, objs in compiled_everywhere(asked):
        assert all(pod["automountServiceAccountToken"] is True for _, pod, _ in pods(objs))


def test_torchrun_containers_probe_the_workers_health_check() -> None:
    spec = load_spec(REPO / "examples" / "tinygpt-fsdp.yaml")  # stepTimeoutSeconds 900
    for target in ("pytorchjob", "trainjob"):
        for where, pod, _ in pods(compile(spec, target, fixed_size=True)):
            ctr = pod["containers"][0]
            # The start (rendezvous 600 s plus a step timeout) is granted by the check itself; no startup or
            # readiness probe holds the pod's readiness (and with it its DNS name) until after the rendezvous.
            command = ctr["livenessProbe"]["exec"]["command"]
            assert command[:-2] == HEALTHCHECK and command[-2] == "--start-budget-s", where
            assert int(command[-1]) >= 600 + 900, where
            assert not {"startupProbe", "readinessProbe"} & set(ctr), where
            # Liveness: about another step timeout once started.
            assert ctr["livenessProbe"]["periodSeconds"] * ctr["livenessProbe"]["failureThreshold"] >= 900
    quiet = load_spec(REPO / "examples" / "tinygpt-fsdp.yaml", ["spec.metrics.enabled=false"])
    for target in ("pytorchjob", "trainjob", "rayjob"):
        for where, pod, _ in pods(compile(quiet, target, fixed_size=True)):
            assert not {"startupProbe", "livenessProbe"} & set(pod["containers"][0]), where


def test_pods_request_ephemeral_storage() -> None:
    for _, objs in EXAMPLE_OBJECTS:
        for where, pod, _ in pods(objs):
            requests = pod["containers"][0].get("resources", {}).get("requests")
            if where == "TrainJob node":  # the trainer's resourcesPerNode stand in for the container's
                requests = next(o for o in objs if o["kind"] == "TrainJob")["spec"]["trainer"]["resourcesPerNode"][
                    "requests"
                ]
            assert requests["ephemeral-storage"] == "10Gi", where
            limits = pod["containers"][0].get("resources", {}).get("limits", {})
            assert "ephemeral-storage" not in limits  # a limit evicts the pod when pod-local checkpoints grow


# -- the final pods: what the operator adds, as Pod Security admission evaluates them (issue 40 point 4) --

INIT_TEMPLATE = REPO / "docs" / "operators" / "pytorch-init-container.yaml"


def _final_pytorchjob_pods(objs: list[dict[str, Any]], init_template: str | None = None) -> list[tuple[str, Any]]:
    """(pod name, pod spec) of every pod the Training Operator creates (tests/pods/operators.py), its
    init containers included: what the PodSecurity admission plugin sees, not the replica template."""
    from tests.pods.operators import pytorchjob_pods

    replicas = next(o for o in objs if o["kind"] == "PyTorchJob")["spec"]["pytorchReplicaSpecs"]
    out = []
    for pod in pytorchjob_pods(objs, init_template):
        spec = copy.deepcopy(replicas[pod.role.split("-")[0].capitalize()]["template"]["spec"])
        spec["containers"] = [pod.container]
        spec["initContainers"] = pod.init_containers
        out.append((pod.name, spec))
    return out


@pytest.mark.parametrize("shape", ["fixed size", "spare nodes", "elastic"])
def test_final_pytorchjob_pods_under_restricted_and_the_render_warning(shape: str) -> None:
    """The operator adds `init-pytorch` (no securityContext) to the Workers of a job with a Master
    (TO v1.9.4 pkg/controller.v1/pytorch/initcontainer.go setInitContainer): with its built-in template those
    Workers are refused under "restricted", and the render warns, naming the fixes. With the operator
    given docs/operators/pytorch-init-container.yaml (--pytorch-init-container-template-file), every final
    pod passes; the elastic shape has no Master, hence no init container and no warning."""
    from orchestrator.compile.checks import check_target

    sets = {"fixed size": [], "spare nodes": ["spec.nodes.min=2", "spec.restarts.spareNodes=1"], "elastic": []}[shape]
    spec = load_spec(REPO / "examples" / "digits-ddp.yaml", sets)
    fixed = shape == "fixed size"
    objs = compile(spec, "pytorchjob", fixed_size=fixed)
    warnings = check_target(spec, "pytorchjob", fixed_size=fixed)
    default = {name: pss_restricted_problems(pod) for name, pod in _final_pytorchjob_pods(objs)}
    if shape == "elastic":
        assert all(not problems for problems in default.values()), default
        assert not [w for w in warnings if "init-pytorch" in w]
    else:
        refused = {name: problems for name, problems in default.items() if problems}
        assert refused and all("worker" in name for name in refused), default
        assert all(p.endswith("init-pytorch") or "init-pytorch " in p for ps in refused.values() for p in ps), refused
        (warning,) = [w for w in warnings if "init-pytorch" in w]
        assert "docs/operators/pytorch-init-container.yaml" in warning and "elastic" in warning
    template = INIT_TEMPLATE.read_text()
    for name, pod in _final_pytorchjob_pods(objs, template):
        assert not pss_restricted_problems(pod), (name, pss_restricted_problems(pod))
    if shape != "elastic":
        init = _final_pytorchjob_pods(objs, template)[-1][1]["initContainers"][0]
        assert init["name"] == "init-pytorch" and "nslookup digits-ddp-master-0" in init["command"][2]
