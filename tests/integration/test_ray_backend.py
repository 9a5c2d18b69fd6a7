"""The Ray backend end to end on a real local Ray (Ray Train v2 TorchTrainer, 2 workers, CPU/gloo)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from orchestrator.backends import get_backend
from orchestrator.backends.base import RunState, SubmitOptions, SupervisedRun
from orchestrator.cli import cli
from orchestrator.errors import RestartsExhausted
from orchestrator.loader import dump_spec, load_spec
from orchestrator.spec import JobSpec
from tests.fixtures.common import REPO
from tests.fixtures.jobs import events
from training.contract import Env, read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 30


def tiny_digits(**extra: Any) -> JobSpec:
    """The digits example cut down: 2 ranks on one node, 30 steps, a checkpoint every 5 steps."""
    overrides = [
        f"spec.training.steps={STEPS}",
        "spec.nodes.min=1",
        "spec.nodes.max=1",
        "spec.procsPerNode=2",
        "spec.resources.cpu=2",
        "spec.checkpoint.every.steps=5",
        "spec.checkpoint.keep=10",
        "spec.metrics.enabled=false",
        "spec.metrics.logEvery=5",
        # Ray Train's own recovery (its FailureConfig group restart); in place on Ray: test_ray_inplace.py.
        "spec.restarts.mode=restart",
        *[f"{k}={v}" for k, v in extra.items()],
    ]
    return load_spec(REPO / "examples" / "digits-ddp.yaml", overrides)


def test_ray_run_writes_the_run_dir_contract(ray_local_2cpu: object, tmp_path: Path) -> None:
    import ray

    run_dir = tmp_path / "run"
    backend = get_backend("ray")
    run = backend.launch(tiny_digits(), SubmitOptions(run_dir=str(run_dir)))
    assert isinstance(run, SupervisedRun) and run.run_dir == run_dir.resolve()
    returned = run.wait()

    summary = json.loads((run_dir / "summary.json").read_text())
    assert returned.to_dict().items() <= summary.items() and summary["backend"] == "ray"
    assert run.poll() is RunState.SUCCEEDED
    assert summary["status"] == "succeeded"
    assert summary["steps"] == STEPS and summary["world_sizes"] == [2]
    assert summary["restarts"] == 0 and summary["restored_from"] == []
    assert summary["checkpoints"][0]["last_committed_step"] == STEPS
    assert len(summary["params_sha256"]) == 64
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == STEPS and result["world_size"] == 2
    assert (run_dir / "job.yaml").read_text().startswith("apiVersion: torchrig/v1")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics and metrics[-1]["step"] == STEPS
    starts = [e for e in events(run_dir) if e["event"] == "start"]
    assert sorted(e["rank"] for e in starts) == [0, 1] and {e["generation"] for e in starts} == {0}
    # Ray Train kept its own files under the run dir and no checkpoint copy of ours.
    assert (run_dir / "ray").is_dir()
    assert not list((run_dir / "ray").rglob("*.distcp"))
    status = backend.status(str(run.run_dir))
    assert status.state is RunState.SUCCEEDED
    # We ask for 127.0.0.1 (`_node_ip_address`); Ray 2.60 still advertises the machine's own interface
    # address (ENVIRONMENT.md). What must hold: every advertised address is one of this machine's.
    assert backend.dry_run(tiny_digits()).request["local"]["node_ip_address"] == "127.0.0.1"
    for address in {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}:
        assert _is_local_address(address), address


def test_embedded_ray_refuses_a_client_without_its_token(ray_local_2cpu: object) -> None:
    """Token authentication is on (issue 13.11): Ray 2.60 listens on every interface, so the token is
    what keeps others out. The node's HTTP agent refuses a request without it and serves one with it;
    the token lives in the environment of the Ray processes only (no ~/.ray/auth_token)."""
    import os
    import urllib.error
    import urllib.request

    import ray

    assert os.environ.get("RAY_AUTH_MODE") == "token"
    token = os.environ.get("RAY_AUTH_TOKEN", "")
    assert len(token) == 64 and not os.environ.get("RAY_AUTH_TOKEN_PATH")
    port = ray._private.worker.global_worker.node.dashboard_agent_listen_port
    url = f"http://127.0.0.1:{port}/api/job_agent/jobs/"

    def code(headers: dict[str, str]) -> int:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    assert code({}) == 401
    assert code({"Authorization": "Bearer " + "0" * 64}) == 403
    assert code({"Authorization": f"Bearer {token}"}) not in (401, 403)


def _is_local_address(address: str) -> bool:
    """True when a socket can bind to `address`, i.e. it belongs to this machine."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def test_killed_worker_resumes_from_the_latest_committed_checkpoint(ray_local_2cpu: object, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fault = [{"kind": "kill", "rank": 1, "step": 17}]
    options = SubmitOptions(run_dir=str(run_dir), env={Env.FAULTS: json.dumps(fault)})
    get_backend("ray").launch(tiny_digits(), options).wait()

    history = events(run_dir)
    assert [e for e in history if e["event"] == "fault"], "the drill fault never fired"
    restore = next(e for e in history if e["event"] == "restore" and e["rank"] == 0)
    committed_before = [e["step"] for e in history[: history.index(restore)] if e["event"] == "checkpoint_committed"]
    # The ENVIRONMENT.md bug: with Ray's defaults a run resumed from an older checkpoint than the last one.
    assert restore["step"] == max(committed_before)
    assert restore["step"] >= 10 and restore["generation"] == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS
    assert summary["restarts"] == 1
    assert summary["restored_from"] == [{"store": restore["store"], "step": restore["step"]}]


def test_exhausted_restarts_fail_with_recovery_failed(ray_local_2cpu: object, tmp_path: Path) -> None:
    """`torchrig run --backend ray` (launch, then wait): a failed run is RestartsExhausted, exit code 4."""
    run_dir = tmp_path / "run"
    job = tmp_path / "job.yaml"
    job.write_text(dump_spec(tiny_digits(**{"spec.restarts.max": 0, "spec.training.steps": 10})))
    # A kill in every generation with no restarts allowed.
    fault = [{"kind": "kill", "rank": 0, "step": 3}]
    result = CliRunner().invoke(
        cli,
        ["run", str(job), "--backend", "ray", "--run-dir", str(run_dir), "-q"],
        env={Env.FAULTS: json.dumps(fault)},
        catch_exceptions=False,
    )
    assert result.exit_code == RestartsExhausted.exit_code, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: ray: the run failed"), result.stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"


def _committed(run_dir: Path) -> bool:
    return any(e.get("event") == "checkpoint_committed" for e in read_jsonl(run_dir / "events.jsonl"))


def test_submit_returns_at_once_and_cancel_stops_the_detached_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`torchrig submit --backend ray` without an address: a supervisor process of its own (with its
    own embedded Ray, token authentication on even when the environment says `disabled`) runs the
    job; submit does not wait for it, and `cancel` stops it."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    run_dir = tmp_path / "run"
    backend = get_backend("ray")
    handle = backend.submit(tiny_digits(**{"spec.training.steps": 100000}), SubmitOptions(run_dir=str(run_dir)))
    assert str(handle) == f"ray://{run_dir.resolve()}"
    assert not (run_dir / "summary.json").exists(), "submit waited for the job"
    pid = json.loads((run_dir / "supervisor.json").read_text())["pid"]
    assert "orchestrator.backends.supervise" in Path(f"/proc/{pid}/cmdline").read_text()
    log = run_dir / "supervisor.log"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not _committed(run_dir):
        assert backend.status(handle.run_id).state is RunState.RUNNING, log.read_text()[-3000:]
        time.sleep(1)
    t0 = time.monotonic()
    status = backend.cancel(handle.run_id)
    summary = json.loads((run_dir / "summary.json").read_text())
    why = f"cancel took {time.monotonic() - t0:.1f} s; summary {summary}; log: {log.read_text()[-2500:]}"
    assert status.state is RunState.CANCELLED, why
    assert summary["reason"] == "cancelled by the user", why
    assert summary["checkpoints"][0]["last_committed_step"] >= 5, why
    assert summary["ray_auth"] == "token" and not (home / ".ray" / "auth_token").exists()
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_sigterm_to_a_ray_train_worker_takes_an_emergency_checkpoint_and_loses_no_step(
    ray_local_2cpu: object, tmp_path: Path
) -> None:
    """Issue 20 on Ray: a SIGTERM to one Ray Train worker process mid-run (the training function runs in
    a non-main thread; the handler is installed on the actor's main thread). Both ranks stop at one
    agreed step, commit an emergency checkpoint of it, Ray Train restarts the group and the restarted
    group restores exactly that step: no step is lost and the run still ends at `training.steps`."""
    import os
    import signal

    run_dir = tmp_path / "run"
    # Generation 0 is slowed from step 2 on (0.3 s a step), so the signal lands mid-run; the restart runs at speed.
    fault = [{"kind": "slow", "rank": 0, "step": 2, "seconds": 0.3}]
    options = SubmitOptions(run_dir=str(run_dir), env={Env.FAULTS: json.dumps(fault)})
    run = get_backend("ray").launch(tiny_digits(), options)
    deadline = time.monotonic() + 180
    pid = None
    while time.monotonic() < deadline and pid is None:
        live = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
        started = [e for e in live if e.get("event") == "start" and e.get("rank") == 1]
        if started and any(e.get("event") == "checkpoint_committed" and e.get("step") == 5 for e in live):
            pid = int(started[0]["pid"])
        time.sleep(0.2)
    assert pid is not None, "the run never reached its first checkpoint"
    assert pid != os.getpid()
    os.kill(pid, signal.SIGTERM)
    summary = run.wait().to_dict()
    assert_preempted_and_resumed_losing_no_step(run_dir, summary)


def assert_preempted_and_resumed_losing_no_step(run_dir: Path, summary: dict[str, Any]) -> None:
    """Rank 1 got the SIGTERM; both ranks stopped at one agreed step after committing its emergency
    checkpoint, and the restarted group (generation 1) restored exactly that step."""
    history = events(run_dir)
    preempted = [e for e in history if e["event"] == "preempted"]
    assert sorted(e["rank"] for e in preempted) == [0, 1], preempted
    stop = preempted[0]["step"]
    assert {e["step"] for e in preempted} == {stop} and all(e["committed"] for e in preempted)
    assert {e["reason"] for e in preempted} == {"saved"} and 5 < stop < STEPS
    assert {e["signal"] for e in preempted if e["rank"] == 1} == {"SIGTERM"}
    committed = [e for e in history if e["event"] == "checkpoint_committed" and e["step"] == stop]
    assert committed, f"no emergency checkpoint of step {stop} was committed"
    restore = next(e for e in history if e["event"] == "restore" and e["rank"] == 0)
    assert restore["generation"] == 1 and restore["step"] == stop  # 0 steps lost
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS and summary["restarts"] == 1
