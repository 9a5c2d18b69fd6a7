"""The local backend end to end: real torch.distributed.elastic agents, a real c10d rendezvous in its
own store process, real gloo workers (the stand-in worker of this directory), real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.backends._local_procs import find_marked
from orchestrator.backends.base import LocalOptions, RunState, SubmitOptions, SupervisedRun
from orchestrator.backends.local import LocalBackend, LocalRun
from orchestrator.loader import validate_document
from tests.fixtures.common import REPO, free_port
from tests.fixtures.jobs import write_job
from training.contract import Env, Result, RunFiles, read_jsonl

STANDIN = str(Path(__file__).with_name("standin_worker.py"))


def standin_job(
    tmp_path: Path,
    *,
    steps: int = 30,
    procs: int = 2,
    nodes: tuple[int, int] = (1, 1),
    restarts: int = 3,
    every: int = 10,
    log_every: int = 5,
) -> Path:
    doc: dict[str, Any] = {
        "apiVersion": "torchrig/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "standin"},
        "spec": {
            "task": {"entrypoint": "training.examples.digits:task"},
            "training": {"steps": steps},
            "nodes": {"min": nodes[0], "max": nodes[1]},
            "procsPerNode": procs,
            "restarts": {"max": restarts},
            "checkpoint": {"every": {"steps": every}, "stores": [{"uri": "file://./checkpoints", "name": "local"}]},
            "metrics": {"port": free_port(), "logEvery": log_every},
        },
    }
    return write_job(tmp_path, doc)


def torchrig(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from orchestrator.cli import main; main()", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def run_token(run_dir: Path) -> str:
    return str(json.loads((run_dir / "supervisor.json").read_text())["run_token"])


def assert_no_processes_left(run_dir: Path) -> None:
    token = run_token(run_dir)
    deadline = time.monotonic() + 10
    while find_marked(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert find_marked(token) == [], "processes of the run outlived it"


@pytest.mark.timeout(180)
def test_two_ranks_end_to_end_writes_summary(tmp_path: Path) -> None:
    job = standin_job(tmp_path, steps=20)
    run_dir = tmp_path / "run"
    proc = torchrig("run", str(job), "--run-dir", str(run_dir), "--worker", STANDIN, "-o", "json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded"
    assert summary["steps"] == 20 and summary["restarts"] == 0 and summary["world_sizes"] == [2]
    assert summary["restored_from"] == []
    assert summary["params_sha256"] == json.loads((run_dir / "result.json").read_text())["params_sha256"]
    assert summary["checkpoints"] == [
        {"name": "local", "uri": f"file://{run_dir.resolve()}/checkpoints", "last_committed_step": 20}
    ]
    for key in ("final_loss", "eval", "samples_per_s", "wall_s", "run_dir"):
        assert key in summary
    # The workers saw the resolved spec the backend wrote, and the env contract (the stand-in asserts it).
    assert validate_document(yaml.safe_load((run_dir / "job.yaml").read_text())).name == "standin"
    starts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "start"]
    assert sorted(e["rank"] for e in starts) == [0, 1]
    # Elastic logged into the run directory (never /tmp/torchelastic_*), per attempt and local rank.
    assert list((run_dir / "logs" / "node0").glob("*/attempt_0/1/stderr.log"))
    rank1 = torchrig("logs", str(run_dir), "--rank", "1")
    assert rank1.returncode == 0 and "[rank1]:step 5 " in rank1.stdout and "[rank0]" not in rank1.stdout
    st = torchrig("status", f"local://{run_dir}")
    assert st.returncode == 0 and "succeeded" in st.stdout
    assert_no_processes_left(run_dir)


@pytest.mark.timeout(180)
def test_worker_sigkill_restarts_and_resumes(tmp_path: Path) -> None:
    job = standin_job(tmp_path, steps=30)
    faults = json.dumps([{"kind": "kill", "rank": 1, "step": 15, "generation": 0}])
    run_dir = tmp_path / "run"
    proc = torchrig(
        "run", str(job), "--run-dir", str(run_dir), "--worker", STANDIN, "-o", "json", env={Env.FAULTS: faults}
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["status"] == "succeeded"
    assert summary["restarts"] == 1
    assert summary["restored_from"] == [{"store": "local", "step": 10}]
    assert summary["steps"] == 30


@pytest.mark.timeout(180)
def test_restarts_exhausted_fails_with_exit_4_and_log_path(tmp_path: Path) -> None:
    job = standin_job(tmp_path, steps=30, restarts=1)
    faults = json.dumps([{"kind": "exit", "rank": 0, "step": 3, "generation": g} for g in (0, 1)])
    run_dir = tmp_path / "run"
    proc = torchrig("run", str(job), "--run-dir", str(run_dir), "--worker", STANDIN, "-q", env={Env.FAULTS: faults})
    assert proc.returncode == 4, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "restarts exhausted" in errors[0] and "Traceback" not in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["restarts"] == 1
    assert Path(summary["failure_log"]).is_file() and str(run_dir) in summary["failure_log"]
    assert summary["failure_log"] in errors[0]
    st = torchrig("status", str(run_dir))
    assert st.returncode == 1
    assert_no_processes_left(run_dir)


@pytest.mark.timeout(120)
def test_sigint_cancels_cleanly(tmp_path: Path) -> None:
    job = standin_job(tmp_path, steps=2000, every=10)
    run_dir = tmp_path / "run"
    proc = _cli(["run", str(job), "--run-dir", str(run_dir), "--worker", STANDIN], {"STANDIN_STEP_S": "0.05"})
    try:
        _wait_for_commit(run_dir)
        token = run_token(run_dir)
        assert find_marked(token), "agents and workers should be running"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "cancelled"
    assert summary["checkpoints"][0]["last_committed_step"] >= 10
    assert "last committed checkpoint: file://" in err
    assert find_marked(token) == []
    assert torchrig("status", str(run_dir)).returncode == 11


def test_a_closed_stdout_stops_the_run_like_ctrl_c(tmp_path: Path) -> None:
    """`torchrig run JOB | head -3`: when the reader of stdout exits, the run stops as on Ctrl-C (workers
    ended, checkpoints kept, a summary saying why) and exits 141 like any writer in a broken pipeline,
    instead of dying at its next line with the workers left unwatched."""
    job = standin_job(tmp_path, steps=2000, every=10)
    run_dir = tmp_path / "run"
    proc = _cli(["run", str(job), "--run-dir", str(run_dir), "--worker", STANDIN], {"STANDIN_STEP_S": "0.05"})
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("run dir:")
        _wait_for_commit(run_dir)
        token = run_token(run_dir)
        assert find_marked(token), "agents and workers should be running"
        proc.stdout.close()  # the reader goes; the run's next line of progress meets a closed pipe
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 141, err
    assert "stdout's reader exited; stopping the run" in err and "Traceback" not in err, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "cancelled" and "stdout exited" in summary["reason"]
    assert summary["checkpoints"][0]["last_committed_step"] >= 10
    assert find_marked(token) == []


def _cli(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """`torchrig ARGS` in the background, stdout and stderr piped, `env` on top of this one's."""
    return subprocess.Popen(
        [sys.executable, "-c", "from orchestrator.cli import main; main()", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **env},
    )


def _wait_for_commit(run_dir: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e.get("event") == "checkpoint_committed" for e in read_jsonl(run_dir / "events.jsonl")):
            return
        time.sleep(0.2)
    pytest.fail(f"no checkpoint within {timeout_s} s")


@pytest.mark.timeout(180)
def test_submit_returns_at_once_and_a_detached_supervisor_runs_the_job(tmp_path: Path) -> None:
    """`torchrig submit --backend local` starts no CLI: a supervisor process runs the stored plan."""
    job = standin_job(tmp_path, steps=60)
    run_dir = tmp_path / "run"
    env = {"STANDIN_STEP_S": "0.1"}
    proc = torchrig(
        "submit", str(job), "--backend", "local", "--run-dir", str(run_dir), "--worker", STANDIN, "-o", "json", env=env
    )
    assert proc.returncode == 0, proc.stderr
    ref = json.loads(proc.stdout)["run"]
    assert ref == f"local://{run_dir}"
    assert not (run_dir / "summary.json").exists(), "submit waited for the job"
    launch = json.loads((run_dir / "launch.json").read_text())
    assert launch["backend"] == "local" and launch["options"]["local"]["worker"] == STANDIN
    supervisor = json.loads((run_dir / "supervisor.json").read_text())
    assert "orchestrator.backends.supervise" in Path(f"/proc/{supervisor['pid']}/cmdline").read_text()
    assert torchrig("status", ref).returncode == 10
    deadline = time.monotonic() + 120
    while (code := torchrig("status", ref).returncode) == 10 and time.monotonic() < deadline:
        time.sleep(1)
    assert code == 0, (run_dir / "supervisor.log").read_text()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 60 and summary["world_sizes"] == [2]
    assert "succeeded: 60/60 steps" in (run_dir / "supervisor.log").read_text()
    assert_no_processes_left(run_dir)


@pytest.mark.timeout(180)
def test_cancel_stops_a_submitted_run(tmp_path: Path) -> None:
    job = standin_job(tmp_path, steps=2000, every=10)
    run_dir = tmp_path / "run"
    proc = torchrig(
        "submit",
        str(job),
        "--backend",
        "local",
        "--run-dir",
        str(run_dir),
        "--worker",
        STANDIN,
        env={"STANDIN_STEP_S": "0.05"},
    )
    assert proc.returncode == 0, proc.stderr
    _wait_for_commit(run_dir)
    token = run_token(run_dir)
    assert find_marked(token), "agents and workers should be running"
    cancel = torchrig("cancel", str(run_dir))
    assert cancel.returncode == 0 and "cancelled" in cancel.stdout, cancel.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "cancelled" and summary["reason"] == "cancelled by the user"
    assert summary["checkpoints"][0]["last_committed_step"] >= 10
    assert_no_processes_left(run_dir)
    assert torchrig("status", str(run_dir)).returncode == 11


def test_checkpoints_corrupt_everywhere_fail_the_resubmit_at_once_without_burning_restarts(tmp_path: Path) -> None:
    """A resubmit whose every checkpoint copy fails its integrity check: the workers exit 3 (permanent),
    the agents stop without a restart, `torchrig run` exits 1 with the worker's own line, and nothing in
    the store is touched."""
    run_dir = tmp_path / "run"
    args = ["run", str(REPO / "examples" / "digits-ddp.yaml"), "--run-dir", str(run_dir), "-o", "json"]
    args += ["--set", "spec.training.steps=40", "--set", "spec.checkpoint.every.steps=20"]
    args += ["--set", f"spec.metrics.port={free_port()}"]
    first = torchrig(*args, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    shards = sorted((run_dir / "checkpoints").glob("step-*/gen-*/*.distcp"))
    assert len(shards) >= 2
    for shard in shards:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    damaged = {p: p.read_bytes() for p in shards}
    again = torchrig(*args, timeout=240)
    assert again.returncode == 1, again.stderr[-3000:]
    summary = json.loads(again.stdout)
    assert summary["status"] == "failed" and summary["worker_exit"] == 3 and summary["restarts"] == 0
    assert "steps [40, 20] but every copy is corrupt or incomplete" in summary["reason"]
    assert "permanent, not restarted" in summary["reason"]
    assert again.stderr.count("error: ") == 1 and "Traceback" not in again.stderr
    assert {p: p.read_bytes() for p in shards} == damaged  # the evidence is left as it was
    assert_no_processes_left(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_five_consecutive_worker_kills_never_hang(tmp_path: Path) -> None:
    job = standin_job(tmp_path, steps=20, restarts=5, every=5)
    faults = json.dumps([{"kind": "kill", "rank": g % 2, "step": 8, "generation": g} for g in range(5)])
    run_dir = tmp_path / "run"
    start = time.monotonic()
    proc = torchrig(
        "run",
        str(job),
        "--run-dir",
        str(run_dir),
        "--worker",
        STANDIN,
        "-o",
        "json",
        env={Env.FAULTS: faults},
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["status"] == "succeeded" and summary["restarts"] == 5
    assert [r["step"] for r in summary["restored_from"]] == [5] * 5
    print(f"5 kill/restart cycles: {time.monotonic() - start:.1f} s")


def _wait_world(run_dir: Path, world: int, after: float, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in read_jsonl(run_dir / "metrics.jsonl"):
            if m.get("world_size") == world and m["time"] > after:
                return float(m["time"])
        time.sleep(0.2)
    raise AssertionError(f"world size {world} not reached after {after} within {timeout} s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_kill_store_candidate_node_then_rejoin(tmp_path: Path) -> None:
    """Node 0 is the agent that would host the c10d store with torchrun's defaults; killing it (agent
    and workers) leaves the survivor at world size 1, and a replacement node grows the world back."""
    job = standin_job(tmp_path, steps=1000, procs=1, nodes=(1, 2), every=10)
    spec = validate_document(yaml.safe_load(job.read_text()))
    backend = LocalBackend()
    # Paced (0.05 s a step) so the kill and the rejoin land mid-run, unpaced once the world grew back.
    unpace = tmp_path / "unpace"
    env = {"STANDIN_STEP_S": "0.05", "STANDIN_UNPACE_FILE": str(unpace)}
    options = SubmitOptions(run_dir=str(tmp_path / "run"), env=env, local=LocalOptions(nodes=2, worker=STANDIN))
    run = backend.launch(spec, options)
    assert isinstance(run, LocalRun) and isinstance(run, SupervisedRun)
    try:
        t2 = _wait_world(run.run_dir, 2, 0.0, 90)
        node0 = run.node_pids(0)
        assert len(node0) >= 2, "agent and its worker"
        killed_at = time.time()
        run.kill_node(0)
        assert all(
            not Path(f"/proc/{p}").exists() or "Z" in Path(f"/proc/{p}/stat").read_text().split()[2] for p in node0
        )
        t1 = _wait_world(run.run_dir, 1, killed_at, 90)
        print(f"kill node 0 -> first step at world size 1: {t1 - killed_at:.1f} s")
        assert run.add_node() == 2
        added_at = time.time()
        _wait_world(run.run_dir, 2, max(t1, added_at), 90)
        unpace.touch()
        summary = run.wait(timeout_s=200)
    finally:
        if run.summary is None:
            run.finish("cancelled")
    assert t2 < killed_at
    assert summary.status == "succeeded", summary
    assert run.poll() is RunState.SUCCEEDED
    sizes = summary.world_sizes
    assert sizes[-3:] == [2, 1, 2], sizes
    assert find_marked(run.token) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_digits_demo_with_the_real_worker(tmp_path: Path) -> None:
    """`make demo`'s job through the real `python -m training` worker, shortened, with a worker kill."""
    run_dir = tmp_path / "run"
    faults = json.dumps([{"kind": "kill", "rank": 1, "step": 70, "generation": 0}])
    proc = torchrig(
        "run",
        str(REPO / "examples" / "digits-ddp.yaml"),
        "--run-dir",
        str(run_dir),
        "-o",
        "json",
        "--set",
        "spec.training.steps=120",
        "--set",
        f"spec.metrics.port={free_port()}",
        env={Env.FAULTS: faults},
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["status"] == "succeeded" and summary["steps"] == 120
    # In place (`restarts.mode: auto`, the default, at 2 ranks): a warm spare took rank 1's place, nothing restored.
    assert summary["restarts"] == 0 and summary["restored_from"] == []
    assert summary["recoveries"] == {"inplace": 1}
    assert summary["params_sha256"] and summary["eval"]
    assert summary["checkpoints"][0]["last_committed_step"] == 120
    assert summary["world_sizes"] == [2]
    assert_no_processes_left(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_first_ctrl_c_saves_and_stops_preempted_and_a_new_run_resumes_from_that_step(tmp_path: Path) -> None:
    """The real worker: a first Ctrl-C of `torchrig run` is a preemption (every rank stops at one step
    after an emergency checkpoint of it, exit 202); `torchrig run` again in that directory resumes there.
    A launch without `--run-dir` takes a new directory and says where the stopped run's checkpoints are."""
    runs = tmp_path / "runs"
    run_dir = runs / "digits-ddp" / "20261127-000000"
    pace = json.dumps([{"kind": "slow", "rank": -1, "step": 1, "generation": -1, "seconds": 0.05}])
    args = [
        "run",
        str(REPO / "examples" / "digits-ddp.yaml"),
        "--run-dir",
        str(run_dir),
        "-o",
        "json",
        "--set",
        "spec.training.steps=120",
        "--set",
        "spec.checkpoint.every.steps=25",
        "--set",
        "spec.training.evalAtEnd=false",
        "--set",
        "spec.nodes.min=1",
        "--set",
        "spec.nodes.max=1",
        "--set",
        f"spec.metrics.port={free_port()}",
    ]
    proc = _cli(args, {Env.FAULTS: pace})
    try:
        _wait_for_commit(run_dir, timeout_s=200)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 202, err[-3000:]
    summary = json.loads(out)
    preempted = summary["preempted"]
    assert summary["status"] == "preempted" and preempted["committed"] and preempted["reason"] == "saved"
    stop = preempted["step"]
    assert 25 <= stop < 120 and summary["checkpoints"][0]["last_committed_step"] == stop
    assert "resumes it" in err
    assert torchrig("status", str(run_dir)).returncode == 13
    assert_no_processes_left(run_dir)

    elsewhere = [a for a in args if a not in ("--run-dir", str(run_dir))]
    fresh = torchrig(*elsewhere, "--set", "spec.training.steps=1", env={Env.RUNS_DIR: str(runs)}, timeout=180)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert (
        f"{run_dir} (preempted) holds this job's checkpoints up to step {stop}: "
        f"`torchrig run JOB --run-dir {run_dir}` resumes from them"
    ) in fresh.stderr
    assert_no_processes_left(Path(json.loads(fresh.stdout)["run_dir"]))

    again = torchrig(*args, timeout=280)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads(again.stdout)
    assert resumed["status"] == "succeeded" and resumed["steps"] == 120
    assert resumed["restored_from"][0]["step"] == stop  # 0 lost steps


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sigterm_after_the_workers_finished_is_still_a_success(tmp_path: Path) -> None:
    """The real worker finishes every step and writes result.json; a SIGTERM then reaches the torchrun
    agent before its monitor loop noticed the workers' success, and the agent exits 143. The run succeeded."""
    job = write_job(
        tmp_path,
        REPO / "examples" / "digits-ddp.yaml",
        overrides=[
            "spec.training.steps=20",
            "spec.checkpoint.every.steps=10",
            "spec.training.evalAtEnd=false",
            "spec.nodes.min=1",
            "spec.nodes.max=1",
            f"spec.metrics.port={free_port()}",
        ],
    )
    spec = validate_document(yaml.safe_load(job.read_text()))
    # torchrun's `--monitor-interval` (default 0.1 s; the local plan does not set it) read from its
    # PET_ variable: the agent looks at its workers every 3 s, so the signal surely lands in that sleep.
    env = {"PET_MONITOR_INTERVAL": "3"}
    options = SubmitOptions(run_dir=str(tmp_path / "run"), env=env, local=LocalOptions(nodes=1))
    run = LocalBackend().launch(spec, options)
    assert isinstance(run, LocalRun)
    try:
        deadline = time.monotonic() + 200
        while Result.read(RunFiles(run.run_dir).result) is None:
            assert time.monotonic() < deadline, "no result.json in 200 s"
            assert not run.poll().terminal, (run.run_dir / "logs" / "node0.log").read_text()[-3000:]
            time.sleep(0.02)
        agents = run.agent_pids()
        assert agents, "the agent noticed its workers' success before the signal: no window was hit"
        for pid in agents.values():
            os.kill(pid, signal.SIGTERM)
        # What the drills' `wait_for` sees, before `finish` writes any summary.
        while not (state := run.poll()).terminal:
            assert time.monotonic() < deadline, "the agent outlived the signal"
            time.sleep(0.05)
        summary = run.wait(timeout_s=60)
    finally:
        if run.summary is None:
            run.finish("cancelled")
    # The window was real: torchrun raised SignalException out of its monitor loop's sleep (exit 128 + 15).
    assert [a.proc.returncode for a in run._agents] == [128 + signal.SIGTERM]
    assert state is RunState.SUCCEEDED
    assert summary.status == "succeeded", summary
    assert summary.steps == 20 and summary.reason is None and summary.restarts == 0
    assert summary.final_checkpoint is not None and summary.final_checkpoint.committed
    assert_no_processes_left(run.run_dir)
