"""A real two-host Ray cluster: `ray start --head` in one network namespace, `ray start --address` in
another (addresses of a private /30 only these namespaces hold, `orchestrator.drills.netns`), Ray's token
authentication on, and torchrig submitting with `--address` from the head's host, as from a machine on
the cluster's network. The two "VMs" share this machine's file system, so a directory of it is the
shared store both mount (`spec.ray.sharedDir`), and the run directory lives there (`torchrig report`
reads it from here).

Scenarios: a 2-node job trains to the end bit-identical to `torchrig run`; the worker host's raylet is
SIGKILLed mid-run (the host is lost with its workers), a new one joins, and Ray Train's group restart
ends bit-identical; the worker host is drained (`ray drain-node`, preemption with a deadline: a spot
reclaim), the job stops at an emergency checkpoint without losing a step, and submitted again it
resumes there and ends bit-identical. A cluster whose `ray start` ran without the venv on PATH (the
system `python`, no ray) is refused at submit in one line.

Every process is started here in its own session and ended by its group (and whatever is left in the
namespaces by pid), in the fixture's finalizer, also when a test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from orchestrator.drills.netns import NetnsPair, netns_supported
from tests.fixtures.common import REPO, free_port
from training.contract import Env, read_jsonl

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(netns_supported() is not None, reason=str(netns_supported())),
]

VENV_BIN = str(Path(sys.executable).parent)
STEPS = 30
JOB_OVERRIDES = [
    f"spec.training.steps={STEPS}",
    "spec.checkpoint.every.steps=5",
    "spec.checkpoint.keep=10",
    "spec.training.evalAtEnd=false",
    "spec.training.lrSchedule.warmupSteps=2",
    "spec.metrics.enabled=false",
    "spec.metrics.logEvery=1",
    "spec.nodes.min=2",
    "spec.nodes.max=2",
    "spec.procsPerNode=1",
    "spec.resources.cpu=1",
]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)
            return


@dataclass
class TwoHosts:
    """The cluster: namespace 0 holds the head (and the submitter), namespace 1 a worker node."""

    pair: NetnsPair
    root: Path  # logs and Ray temp dirs
    shared: Path  # the directory both hosts mount
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    temp_dirs: list[str] = field(default_factory=list)
    path: str = f"{VENV_BIN}:{os.environ.get('PATH', '')}"

    @property
    def head_ip(self) -> str:
        return self.pair.addrs[0]

    @property
    def address(self) -> str:
        return f"http://{self.head_ip}:{self.dashboard_port}"

    def env(self, index: int, **extra: str) -> dict[str, str]:
        return {
            "PATH": self.path,
            "HOME": os.environ.get("HOME", "/root"),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
            # A lost host's replacement joins within this (Ray Train's default, 60 s, is tight on a loaded CI).
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "180",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            # gloo picks its interface from the host name, which resolves to an address the namespace lacks.
            "GLOO_SOCKET_IFNAME": self.pair.links[index],
            **extra,
        }

    def _start(self, index: int, args: list[str], name: str) -> None:
        temp_dir = tempfile.mkdtemp(prefix=f"rmn{index}", dir="/tmp")  # Ray's sockets need a short path
        self.temp_dirs.append(temp_dir)
        log = (self.root / f"{name}.log").open("ab")
        cmd = [*self.pair.exec_prefix(index), f"{VENV_BIN}/ray", "start", "--block", *args, f"--temp-dir={temp_dir}"]
        cmd += [f"--node-ip-address={self.pair.addrs[index]}", "--num-cpus=1", "--disable-usage-stats"]
        self.procs.append(
            subprocess.Popen(cmd, env=self.env(index), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )

    def start_head(self) -> None:
        args = [f"--port={self.gcs_port}", f"--dashboard-host={self.head_ip}"]
        self._start(0, ["--head", *args, f"--dashboard-port={self.dashboard_port}"], "head")
        self.wait_nodes(1)

    def start_worker(self) -> None:
        self._start(1, [f"--address={self.head_ip}:{self.gcs_port}"], "worker")
        self.wait_nodes(2)

    def in_head(self, args: list[str], timeout_s: float = 300, **extra: str) -> subprocess.CompletedProcess[str]:
        """A command on the head's host (namespace 0), from the repository (the job's working directory)."""
        return subprocess.run(
            [*self.pair.exec_prefix(0), *args],
            env=self.env(0, **extra),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def torchrig(self, *args: str, timeout_s: float = 300, **extra: str) -> subprocess.CompletedProcess[str]:
        return self.in_head([sys.executable, "-m", "orchestrator.cli", *args], timeout_s, **extra)

    def nodes(self) -> list[dict[str, Any]]:
        code = (
            f"import json, ray; ray.init(address='{self.head_ip}:{self.gcs_port}', logging_level='ERROR');"
            "print(json.dumps([{'id': n['NodeID'], 'ip': n['NodeManagerAddress']} for n in ray.nodes() if n['Alive']]))"
        )
        out = self.in_head([sys.executable, "-c", code], timeout_s=120)
        return list(json.loads(out.stdout.strip().splitlines()[-1])) if out.returncode == 0 else []

    def wait_nodes(self, count: int, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.nodes()) == count:
                return
            time.sleep(1)
        logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(self.root.glob("*.log")))
        raise AssertionError(f"the cluster never had {count} live nodes\n{logs}")

    def worker_raylets(self) -> list[int]:
        """Pids of the raylet(s) of the worker host (its node address in their command line)."""
        found = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with contextlib.suppress(OSError):
                    argv = (proc / "cmdline").read_bytes().split(b"\0")
                    if argv and argv[0].endswith(b"raylet") and f"={self.pair.addrs[1]}".encode() in b" ".join(argv):
                        found.append(int(proc.name))
        return found

    def stop_worker(self) -> None:
        """The worker host goes (its `ray start` group: the raylet and the workers it started)."""
        for proc in [p for p in self.procs if "worker" in str(p.args)]:
            _kill_group(proc)
            self.procs.remove(proc)
        for pid in self.worker_raylets():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        for proc in reversed(self.procs):
            _kill_group(proc)
        # Anything still in the namespaces was started here (through `ip netns exec`): end it by pid.
        for ns in self.pair.names:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
            for pid in pids.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        self.pair.destroy()
        for temp_dir in self.temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHosts]:
    root = tmp_path_factory.mktemp("ray-two-hosts")
    shared = root / "shared"
    shared.mkdir()
    hosts = TwoHosts(NetnsPair(), root, shared)
    try:
        hosts.pair.create()
        hosts.start_head()
        hosts.start_worker()
        yield hosts
    finally:
        hosts.close()


def _job(tmp_path: Path, shared: Path, *extra: str) -> Path:
    from orchestrator.loader import dump_spec, load_spec

    spec = load_spec(REPO / "examples" / "digits-ddp.yaml", [*JOB_OVERRIDES, f"spec.ray.sharedDir={shared}", *extra])
    path = tmp_path / "job.yaml"
    path.write_text(dump_spec(spec))
    return path


@pytest.fixture(scope="module")
def reference(two_hosts: TwoHosts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`torchrig run` of the same job on this machine (local backend, two emulated nodes)."""
    tmp = tmp_path_factory.mktemp("reference")
    run_dir = tmp / "run"
    job = _job(tmp, two_hosts.shared)
    # One intra-op thread per rank, as Ray Train gives a worker of 1 CPU (OMP_NUM_THREADS = its CPUs):
    # torchrun sets none with one process per node, and more threads sum matmuls in another order
    # (measured: parameters 1e-8 apart after 30 steps, the losses equal).
    env = {
        **os.environ,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "run", str(job), "--nodes", "2", "--run-dir", str(run_dir), "-q"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return dict(json.loads((run_dir / "summary.json").read_text()))


def _submit(hosts: TwoHosts, job: Path, *args: str, **env: str) -> tuple[str, Path]:
    out = hosts.torchrig("submit", str(job), "--backend", "ray", "--address", hosts.address, *args, **env)
    assert out.returncode == 0, out.stderr[-3000:]
    run = out.stdout.strip().splitlines()[-1]
    assert run.startswith(f"ray://{hosts.head_ip}:{hosts.dashboard_port}/torchrig-digits-ddp-")
    assert "Uploading package" not in out.stderr and "INFO" not in out.stderr  # Ray's own lines stay out
    run_dir = hosts.shared / "runs" / "digits-ddp" / run.rsplit("/", 1)[1]
    return run, run_dir


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return read_jsonl(path) if path.exists() else []


def _wait_for(run_dir: Path, what: str, predicate: Any, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate(_events(run_dir)):
            return
        time.sleep(0.3)
    raise AssertionError(f"{what} never happened in {run_dir}: {_events(run_dir)[-5:]}")


def _summary(hosts: TwoHosts, run: str, run_dir: Path, timeout_s: float = 420) -> dict[str, Any]:
    """The run's summary once the Jobs API says it ended (the CLI's `status`, in the head's namespace)."""
    deadline = time.monotonic() + timeout_s
    status = hosts.torchrig("status", run, "-o", "json")
    while json.loads(status.stdout or "{}").get("state") in (None, "pending", "running"):
        assert time.monotonic() < deadline, status.stdout + status.stderr
        time.sleep(3)
        status = hosts.torchrig("status", run, "-o", "json")
    path = run_dir / "summary.json"
    assert path.exists(), f"{status.stdout}\n{hosts.torchrig('logs', run).stdout[-4000:]}"
    return dict(json.loads(path.read_text()))


def _slow(seconds: float = 0.4) -> dict[str, str]:
    """The first worker group is slowed from step 2 on, so a fault from outside lands mid-run."""
    return {Env.FAULTS: json.dumps([{"kind": "slow", "rank": 0, "step": 2, "seconds": seconds}])}


def test_a_two_node_job_on_the_shared_store_matches_torchrig_run(
    two_hosts: TwoHosts, reference: dict[str, Any], tmp_path: Path
) -> None:
    run, run_dir = _submit(two_hosts, _job(tmp_path, two_hosts.shared))
    summary = _summary(two_hosts, run, run_dir)
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS
    assert summary["params_sha256"] == reference["params_sha256"], "bit-identical to torchrig run"
    starts = [e for e in _events(run_dir) if e.get("event") == "start"]
    assert sorted(e["node_rank"] for e in starts) == [0, 1]  # one rank on each host
    # The checkpoints are on the shared store, under the run directory that lives there.
    assert any((run_dir / "checkpoints").iterdir())
    report = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "report", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert report.returncode == 0, report.stderr
    listed = two_hosts.torchrig("list", "--backend", "ray", "-o", "json", RAY_ADDRESS=two_hosts.address)
    assert run in [r["run"] for r in json.loads(listed.stdout)]


def test_a_lost_worker_host_is_a_group_restart_that_ends_bit_identical(
    two_hosts: TwoHosts, reference: dict[str, Any], tmp_path: Path
) -> None:
    run, run_dir = _submit(two_hosts, _job(tmp_path, two_hosts.shared), **_slow())
    _wait_for(
        run_dir,
        "a checkpoint past step 5",
        lambda ev: any(e.get("event") == "checkpoint_committed" and e["step"] >= 5 for e in ev),
    )
    raylets = two_hosts.worker_raylets()
    assert raylets, "no raylet of the worker host"
    for pid in raylets:
        os.kill(pid, signal.SIGKILL)
    two_hosts.stop_worker()
    two_hosts.start_worker()  # the replacement VM joins
    summary = _summary(two_hosts, run, run_dir)
    logs = two_hosts.torchrig("logs", run).stdout if summary["status"] != "succeeded" else ""
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS, f"{summary}\n{logs[-6000:]}"
    assert summary["restarts"] >= 1
    assert summary["params_sha256"] == reference["params_sha256"], "bit-identical after the group restart"


def test_a_drained_worker_host_checkpoints_at_once_and_loses_no_step(
    two_hosts: TwoHosts, reference: dict[str, Any], tmp_path: Path
) -> None:
    """A spot reclaim: the worker host is drained with a deadline (what Ray's autoscaler does on the
    cloud's notice). Every rank stops at one agreed step with an emergency checkpoint; the host is then
    terminated and a replacement joins; Ray Train's group restart resumes from that checkpoint.

    With `sdc` on (the default) the emergency checkpoint must be certified like any other save: when it
    was not, the restore preferred the older certified one (seen here: stopped at 16, restored 15)."""
    job = _job(tmp_path, two_hosts.shared)
    run, run_dir = _submit(two_hosts, job, **_slow(0.6))
    _wait_for(run_dir, "a checkpoint", lambda ev: any(e.get("event") == "checkpoint_committed" for e in ev))
    (worker,) = [n for n in two_hosts.nodes() if n["ip"] == two_hosts.pair.addrs[1]]
    gcs = f"{two_hosts.head_ip}:{two_hosts.gcs_port}"
    reason = ["--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=spot reclaim"]
    target = [f"--address={gcs}", f"--node-id={worker['id']}", "--deadline-remaining-seconds=60"]
    drain = two_hosts.in_head([f"{VENV_BIN}/ray", "drain-node", *target, *reason])
    assert drain.returncode == 0, drain.stderr
    _wait_for(
        run_dir, "the emergency checkpoint", lambda ev: len([e for e in ev if e.get("event") == "preempted"]) == 2
    )
    stops = [e for e in _events(run_dir) if e.get("event") == "preempted"]
    assert all(e["committed"] for e in stops) and len({e["step"] for e in stops}) == 1, stops
    stop_step = stops[0]["step"]  # the last step trained, agreed by every rank
    two_hosts.stop_worker()  # the deadline: the cloud takes the VM
    two_hosts.start_worker()  # the autoscaler's replacement
    summary = _summary(two_hosts, run, run_dir)
    logs = two_hosts.torchrig("logs", run).stdout if summary["status"] != "succeeded" else ""
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS, f"{summary}\n{logs[-6000:]}"
    assert summary["params_sha256"] == reference["params_sha256"], "bit-identical after the drain"
    restored = {e["step"] for e in _events(run_dir) if e.get("event") == "restore"}
    assert restored == {stop_step}, f"stopped at step {stop_step}, restored {sorted(restored)}: lost steps"


def test_a_cluster_started_without_the_venv_is_refused_at_submit(tmp_path: Path) -> None:
    """`ray start` run by path from a venv that was not activated: the entrypoint's `python` is the
    system one. The submit says so in one line, and nothing is queued."""
    pair = NetnsPair()
    hosts = TwoHosts(pair, tmp_path, tmp_path)
    system = tmp_path / "system-bin"  # `python` is the system's Python, which has no ray and no torch
    system.mkdir()
    (system / "python").symlink_to("/usr/bin/python3")
    hosts.path = f"{system}:/usr/bin:/bin"  # ray started by its full path, from a venv not activated
    try:
        pair.create()
        hosts.start_head()
        job = _job(tmp_path, tmp_path)
        out = hosts.torchrig("submit", str(job), "--backend", "ray", "--address", hosts.address, timeout_s=400)
        assert out.returncode == 3, out.stdout + out.stderr
        errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
        assert errors[0].startswith(f"error: the Ray cluster at {hosts.address} cannot run the job: ")
        assert f"its entrypoint python ({system}/python, Python " in errors[0] and "cannot import torch (" in errors[0]
        assert "ray (ModuleNotFoundError" in errors[0], errors[0]
        assert not out.stdout.strip()  # no run reference: nothing was queued
        listed = hosts.torchrig("list", "--backend", "ray", "--address", hosts.address, "-o", "json")
        assert json.loads(listed.stdout) == []
    finally:
        hosts.close()
