"""images/cpu as a real container, run the way the rendered pods ask: uid 1000, every capability dropped,
no privilege escalation, a read-only root filesystem and only the volumes the pod declares
(`orchestrator.compile._pod.volumes_and_mounts`). Its entry points start, and a one-pod PyTorchJob
trains to the end in it, bit-identical to `torchrig run`, writing nowhere but its volumes.

Needs podman (scripts/install-tools.sh); skipped with the reason without it. The image is built once per
session (tests/containers/conftest.py)."""

from __future__ import annotations

import base64
import json
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.compile import compile as compile_manifests
from orchestrator.compile._common import JOB_SECRET_KEY, RUN_DIR, SPEC_FILE, job_secret
from orchestrator.compile._pod import CACHE_DIR, TMP_DIR, volumes_and_mounts
from orchestrator.loader import load_spec
from tests.containers.images import build_images
from tests.containers.podrun import PodRun, container_args
from tests.fixtures.common import REPO, free_port
from tests.pods.operators import pytorchjob_pods

# The first test builds the image (a cold build takes minutes: the session fixture runs in its timeout).
pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(1200)]

EXAMPLE = REPO / "examples" / "digits-ddp.yaml"
# One pod of 2 ranks, 120 steps (a few seconds), a checkpoint every 25 (its store is the job's PVC).
STEPS = 120
SETS = [
    "spec.nodes.min=1",
    "spec.nodes.max=1",
    f"spec.training.steps={STEPS}",
    "spec.checkpoint.every.steps=25",
    "spec.training.evalAtEnd=false",
]


def _render(*extra: str) -> list[dict[str, Any]]:
    """The spec compiled for a PyTorchJob, after its Secret with a value (what `torchrig submit` creates)."""
    spec = load_spec(EXAMPLE, [*SETS, *extra])
    secret = job_secret(spec)
    secret["data"] = {JOB_SECRET_KEY: base64.b64encode(secrets.token_hex(32).encode()).decode()}
    return [secret, *compile_manifests(spec, "pytorchjob")]


def _pod_run(objects: list[dict[str, Any]], workdir: Path, name: str = "", shared: Path | None = None) -> PodRun:
    """The Master pod of a rendered PyTorchJob as `podman run` arguments (tests/containers/podrun.py)."""
    (job,) = [o for o in objects if o["kind"] == "PyTorchJob"]
    pod = next(p for p in pytorchjob_pods(objects) if p.role == "master-0")
    template_spec = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    name = name or f"trg-{workdir.name}"
    return container_args(pod, objects, workdir, pod_spec=template_spec, shared=shared, name=name)


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=build_images.podman_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_the_pod_declares_what_the_image_writes_to() -> None:
    """The writable volumes cover the image's HOME cache and /tmp, and the rendered container runs read-only."""
    spec = load_spec(EXAMPLE, SETS)
    _, mounts = volumes_and_mounts(spec)
    paths = {m["mountPath"] for m in mounts if not m.get("readOnly")}
    assert {RUN_DIR, TMP_DIR, CACHE_DIR, "/dev/shm"} <= paths


def test_the_image_runs_as_uid_1000_read_only_without_capabilities(cpu_image: str, tmp_path: Path) -> None:
    run = _pod_run(_render(), tmp_path)
    assert {"--read-only", "--read-only-tmpfs=false", "--cap-drop", "ALL", "no-new-privileges"} <= set(run.args)
    probe = (
        "import os, pathlib\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "caps = status['CapEff'].strip(), status['NoNewPrivs'].strip()\n"
        "print(os.getuid(), os.getgid(), sorted(os.getgroups()), *caps)\n"
        "for d in ['/', '/opt/torchrig', '/home/torchrig', '/etc', '/var/tmp', '/run']:\n"
        "    try:\n"
        "        pathlib.Path(d, '.w').write_text('x')\n"
        "        print('writable', d)\n"
        "    except OSError as e:\n"
        "        print('refused', d, e.errno)\n"
    )
    proc = _run(run.command(cpu_image, ["python", "-c", probe], detach=False, remove=True), timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "1000 1000 [1000] 0000000000000000 1", lines
    assert all(line.startswith("refused") for line in lines[1:]), lines


@pytest.mark.parametrize(
    "argv",
    [
        [],  # the image's ENTRYPOINT and CMD: python -m training --help
        ["python", "-m", "training.launch", "--help"],
        ["python", "-m", "training.rendezvous_store", "--help"],
        ["python", "-m", "orchestrator.backends.ray_entry", "--help"],
        ["ray", "--version"],
        ["torchrun", "--help"],
    ],
    ids=["entrypoint", "launch", "rendezvous_store", "ray_entry", "ray", "torchrun"],
)
def test_entry_points_start_in_the_hardened_container(cpu_image: str, tmp_path: Path, argv: list[str]) -> None:
    run = _pod_run(_render(), tmp_path)
    proc = _run(run.command(cpu_image, argv, detach=False, remove=True), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage" in proc.stdout.lower() or "version" in proc.stdout.lower(), proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


def test_the_rayjob_entrypoint_is_what_the_image_runs(cpu_image: str) -> None:
    """The RayJob's entrypoint (`orchestrator.compile.rayjob.entrypoint`) names modules the image has."""
    from orchestrator.compile.rayjob import ENTRY_MODULE, entrypoint

    assert ENTRY_MODULE in entrypoint() and "training.launch" in entrypoint()
    proc = _run(
        [
            "podman",
            "run",
            "--rm",
            "--network",
            "none",
            "--entrypoint",
            "python",
            cpu_image,
            "-c",
            f"import importlib.util as u; print(u.find_spec({ENTRY_MODULE!r}) is not None)",
        ]
    )
    assert proc.stdout.strip() == "True", proc.stderr


def test_the_healthcheck_says_unhealthy_without_an_exporter_and_healthy_within_its_start_budget(
    cpu_image: str, tmp_path: Path
) -> None:
    run = _pod_run(_render(), tmp_path)
    health = ["python", "-m", "training.healthcheck"]
    proc = _run(run.command(cpu_image, health, detach=False, remove=True), timeout=120)
    assert proc.returncode == 1 and proc.stdout.startswith("unhealthy:"), proc.stdout + proc.stderr
    # The liveness probe passes a start budget: a young container (its PID 1's age, from /proc) is healthy.
    proc = _run(run.command(cpu_image, [*health, "--start-budget-s", "600"], detach=False, remove=True))
    assert proc.returncode == 0 and proc.stdout.startswith("healthy:"), proc.stdout + proc.stderr


def test_the_rendezvous_store_pod_listens_and_ends_143_on_sigterm(
    cpu_image: str, tmp_path: Path, containers: list[str]
) -> None:
    """With `restarts.spareNodes` the Master pod only hosts the c10d store: it listens in the hardened
    container, reads the job's Secret from its read-only volume, and a `podman stop` (SIGTERM) ends it 143."""
    objects = _render("spec.nodes.min=2", "spec.nodes.max=2", "spec.restarts.spareNodes=1")
    run = _pod_run(objects, tmp_path)
    assert run.argv[:3] == ["python", "-m", "training.rendezvous_store"], run.argv
    port = int(run.argv[run.argv.index("--port") + 1])
    name = f"trg-{tmp_path.name}"
    containers.append(name)
    started = _run(run.command(cpu_image))
    assert started.returncode == 0, started.stderr
    connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2).close(); print('ok')"
    deadline = time.monotonic() + 60
    while True:
        proc = _run(["podman", "exec", name, "python", "-c", connect])
        if proc.stdout.strip() == "ok" or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert proc.stdout.strip() == "ok", _run(["podman", "logs", name]).stderr
    stopped = _run(["podman", "stop", "-t", str(run.grace_s), name], timeout=run.grace_s + 60)
    assert stopped.returncode == 0, stopped.stderr
    code = _run(["podman", "inspect", "--format", "{{.State.ExitCode}}", name]).stdout.strip()
    assert code == "143", (code, _run(["podman", "logs", name]).stderr[-2000:])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """result.json of `torchrig run` of the same spec on this machine: 1 node x 2 ranks."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    sets = [a for s in [*SETS, f"spec.metrics.port={free_port()}"] for a in ("--set", s)]
    cmd = [sys.executable, "-c", "from orchestrator.cli import main; main()", "run", str(EXAMPLE), "--nodes", "1"]
    proc = subprocess.run(
        [*cmd, *sets, "--run-dir", str(run_dir), "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=run_dir.parent,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads((run_dir / "result.json").read_text())
    return result


def test_a_one_pod_pytorchjob_trains_in_the_container_bit_exact_writing_only_to_its_volumes(
    cpu_image: str, tmp_path: Path, containers: list[str], reference: dict[str, Any]
) -> None:
    objects = _render()
    run = _pod_run(objects, tmp_path)
    assert run.argv[:6] == ["python", "-m", "training.launch", "--spec", SPEC_FILE, "--"], run.argv
    name = f"trg-{tmp_path.name}"
    containers.append(name)
    started = _run(run.command(cpu_image))
    assert started.returncode == 0, started.stderr
    waited = _run(["podman", "wait", name], timeout=600)
    logs = _run(["podman", "logs", name])
    assert waited.stdout.strip() == "0", logs.stdout[-3000:] + logs.stderr[-6000:]

    run_dir = run.volumes["torchrig-run"]
    (result_file,) = list(run_dir.rglob("result.json"))
    result = json.loads(result_file.read_text())
    assert (result["steps"], result["world_size"]) == (STEPS, 2), result
    assert result["params_sha256"] == reference["params_sha256"]
    # The checkpoints went to the PVC, mounted inside the run directory.
    assert any(p.name for p in run.volumes["store-0"].rglob("*") if p.is_file())
    # Nothing changed in the container's own filesystem: every write went to a declared volume.
    diff = _run(["podman", "diff", "--format", "json", name]).stdout
    changed = [p for paths in json.loads(diff).values() for p in paths]
    mounts = {m["mountPath"] for m in run_mounts(objects)}
    # podman itself adds the mount points (and their parents show as changed) and the files it manages.
    podman_own = {"/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/run/.containerenv", "/run", "/etc"}
    writes = [p for p in changed if p not in podman_own and not _under(p, mounts) and not _above(p, mounts)]
    assert writes == [], diff
    print(f"\nwhat the run wrote: tmp {_files(run.volumes['torchrig-tmp'])[:20]}")
    print(f"cache {_files(run.volumes['torchrig-cache'])[:20]}; podman diff {diff}")


def run_mounts(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (job,) = [o for o in objects if o["kind"] == "PyTorchJob"]
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    mounts: list[dict[str, Any]] = container["volumeMounts"]
    return mounts


def _above(path: str, mounts: set[str]) -> bool:
    return any(m.startswith(path.rstrip("/") + "/") for m in mounts)


def _under(path: str, roots: set[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def test_ray_starts_a_node_in_the_hardened_container(cpu_image: str, tmp_path: Path) -> None:
    """What a RayJob's head and workers do first (`ray start`, here through `ray.init`), with the pod's
    read-only root and volumes: Ray's session directory goes to /tmp, nothing to the read-only HOME."""
    run = _pod_run(_render(), tmp_path)
    code = (
        "import ray\n"
        "ray.init(num_cpus=1, include_dashboard=False)\n"
        "print('answer', ray.get(ray.remote(lambda: 42).remote()))\n"
        "ray.shutdown()\n"
    )
    # KubeRay gives every Ray container the cluster's token (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN from its
    # Secret: tests/pods/operators.py _set_token_auth_env); without one Ray would write ~/.ray/auth_token.
    env = [
        "--env",
        "RAY_USAGE_STATS_ENABLED=0",
        "--env",
        "RAY_AUTH_MODE=token",
        "--env",
        f"RAY_AUTH_TOKEN={secrets.token_hex(16)}",
    ]
    cmd = run.command(cpu_image, ["python", "-c", code], detach=False, remove=True)
    proc = _run([*cmd[:3], *env, *cmd[3:]], timeout=300)
    assert proc.returncode == 0 and "answer 42" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    tmp, cache = _files(run.volumes["torchrig-tmp"]), _files(run.volumes["torchrig-cache"])
    print(f"\nwhat Ray wrote: tmp {tmp[:10]}; cache {cache}")


def _events(run_dir: Path) -> list[dict[str, Any]]:
    lines = [line for p in run_dir.rglob("events.jsonl") for line in p.read_text().splitlines() if line.strip()]
    return [json.loads(line) for line in lines]


def test_a_drained_pod_checkpoints_within_its_grace_and_its_successor_resumes_losing_no_step(
    cpu_image: str, tmp_path: Path, containers: list[str], reference: dict[str, Any]
) -> None:
    """A node drain as the kubelet does it: `podman stop -t terminationGracePeriodSeconds` (SIGTERM,
    SIGKILL at the deadline). Every rank stops at one step after an emergency checkpoint on the PVC; the
    pod the operator recreates (fresh emptyDirs, the same claim) resumes from that step and ends
    bit-identical to an uninterrupted `torchrig run`."""
    objects = _render()
    shared = tmp_path / "pvc"
    first = _pod_run(objects, tmp_path / "first", f"trg-{tmp_path.name}-1", shared)
    pace = json.dumps([{"kind": "slow", "rank": -1, "step": 1, "generation": -1, "seconds": 0.05}])
    cmd = first.command(cpu_image)
    containers.append(f"trg-{tmp_path.name}-1")
    started = _run([*cmd[:3], "--env", f"TORCHRIG_FAULTS={pace}", *cmd[3:]])
    assert started.returncode == 0, started.stderr
    deadline = time.monotonic() + 300
    while not any(e.get("event") == "checkpoint_committed" for e in _events(first.volumes["torchrig-run"])):
        assert time.monotonic() < deadline, _run(["podman", "logs", f"trg-{tmp_path.name}-1"]).stderr[-4000:]
        time.sleep(0.5)
    t0 = time.monotonic()
    _run(["podman", "stop", "-t", str(first.grace_s), f"trg-{tmp_path.name}-1"], timeout=first.grace_s + 60)
    stopped_s = time.monotonic() - t0
    code = _run(["podman", "inspect", "--format", "{{.State.ExitCode}}", f"trg-{tmp_path.name}-1"]).stdout.strip()
    preempted = [e for e in _events(first.volumes["torchrig-run"]) if e.get("event") == "preempted"]
    logs = _run(["podman", "logs", f"trg-{tmp_path.name}-1"]).stderr[-4000:]
    assert preempted and all(e["committed"] for e in preempted), (code, logs)
    assert stopped_s < first.grace_s, f"the pod needed {stopped_s:.0f} s of its {first.grace_s} s grace"
    stop = {e["step"] for e in preempted}
    assert len(stop) == 1 and 25 <= min(stop) < STEPS, stop

    second = _pod_run(objects, tmp_path / "second", f"trg-{tmp_path.name}-2", shared)
    containers.append(f"trg-{tmp_path.name}-2")
    assert _run(second.command(cpu_image)).returncode == 0
    waited = _run(["podman", "wait", f"trg-{tmp_path.name}-2"], timeout=600)
    logs = _run(["podman", "logs", f"trg-{tmp_path.name}-2"]).stderr[-4000:]
    assert waited.stdout.strip() == "0", logs
    restores = [e for e in _events(second.volumes["torchrig-run"]) if e.get("event") == "restore"]
    assert restores and {e["step"] for e in restores} == stop, restores  # 0 lost steps
    (result_file,) = list(second.volumes["torchrig-run"].rglob("result.json"))
    result = json.loads(result_file.read_text())
    assert result["steps"] == STEPS
    assert result["params_sha256"] == reference["params_sha256"]
