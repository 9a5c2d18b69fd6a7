"""The attacks of issue 33 on the recovery store, reproduced against real processes: a client that reaches
the store but does not hold the job's secret can no longer end the job (the store-only rendezvous pod,
`training.rendezvous_store`) nor steer a live run's warm spare (the local backend). What it can still do
is in docs/operations.md, "Trust boundary"."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from orchestrator.backends import get_backend
from orchestrator.backends.base import RunState, SubmitOptions
from orchestrator.loader import load_spec
from tests.fixtures.common import REPO, free_port
from tests.integration.test_inplace import SMALL
from tests.integration.test_torchrun_exits import _StorePod
from training.contract import Env
from training.contract.orders import IDENTITY_ENV, Signer, create_job_secret, load_job_secret
from training.inplace import InPlace
from training.inplace.standby import LAST_MEMBER, TERMINAL_STATE_SYNC_ID, round_store
from training.rendezvous_store import failed_key, succeeded_key

pytestmark = pytest.mark.timeout(180)

OLD_FAILED_KEY = "torchrig/job/failed"  # where an agent's failure went before the records were signed


class _Pod(_StorePod):
    """The store pod with a client of its own (the attacker's)."""

    def __init__(self, run_id: str, secret_file: str) -> None:
        super().__init__(run_id, secret_file)
        self.client = dist.TCPStore("127.0.0.1", self.port, is_master=False, wait_for_workers=False)  # type: ignore[attr-defined]

    def still_serving_after(self, seconds: float) -> bool:
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return True
        return False


def test_a_foreign_failure_record_no_longer_fails_the_job(tmp_path: Path) -> None:
    """Attack (a): one `set` of the job-failed key made the store pod exit 1 (the PyTorchJob failed)."""
    secret_file = create_job_secret(tmp_path / "secret")
    pod = _Pod("job", secret_file)
    try:
        pod.client.set(OLD_FAILED_KEY, "1")
        pod.client.set(failed_key("job"), "1")  # no MAC
        other = Signer(b"x" * 32)  # another job's secret
        pod.client.set(failed_key("job"), other.sign(failed_key("job"), "2"))
        assert pod.still_serving_after(2.0), "a forged failure record ended the store pod"
        secret = load_job_secret({Env.JOB_SECRET_FILE: secret_file})
        assert secret is not None
        pod.client.set(failed_key("job"), Signer(secret).sign(failed_key("job"), "3"))  # an agent's own
        code, err = pod.finish(30)
        assert code == 3, err
        assert "ignored a store value that is no order of this job" in err, err
    finally:
        pod.finish(1)


def test_a_foreign_round_record_and_exit_barrier_no_longer_make_the_job_succeed(tmp_path: Path) -> None:
    """Attack (b): the round record plus torchelastic's terminal-state key made the store pod exit 0, so
    a half-trained job showed Succeeded."""
    secret_file = create_job_secret(tmp_path / "secret")
    pod = _Pod("job", secret_file)
    try:
        pod.client.set(InPlace.round_record_key("job"), json.dumps({"token": "t", "round": 1, "nodes": 1}))
        round_store(pod.client, "job", 1).set(f"{TERMINAL_STATE_SYNC_ID}{LAST_MEMBER}", "1")
        pod.client.set(succeeded_key("job"), "0")  # no MAC
        assert pod.still_serving_after(2.0), "a forged success ended the store pod"
        secret = load_job_secret({Env.JOB_SECRET_FILE: secret_file})
        assert secret is not None
        pod.client.set(succeeded_key("job"), Signer(secret).sign(succeeded_key("job"), "0"))
        code, err = pod.finish(30)
        assert code == 0 and "passed torchrun's exit barrier" in err, err
    finally:
        pod.finish(1)


def test_the_store_pod_refuses_to_serve_without_the_jobs_secret() -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != Env.JOB_SECRET_FILE}
    proc = subprocess.run(
        [sys.executable, "-m", "training.rendezvous_store", "--port", "0", "--run-id", "job"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.startswith(f"torchrig: error: rendezvous store: {Env.JOB_SECRET_FILE} is not set")
    assert "Traceback" not in proc.stderr


def _forge_assignment_then_kill(address: str, run_id: str, done: threading.Event, wrote: list[float]) -> None:
    """A foreign client of a live run's store: it reads the round record (the token is no secret), waits for
    node 0's spare 0, writes it an assignment (rank 1, generation 5), and only then SIGKILLs a trainer of
    the run (a pid its `stepped/<pid>` key shows), so the forgery is always in the store before the host's
    own assignment: the order a fault at a fixed step could not promise on a loaded machine, where the
    host's real assignment sometimes came first and the forgery overwrote it (a denial of service the
    trust section names, not the attack this test is about)."""
    host, _, port = address.rpartition(":")
    client = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)  # type: ignore[attr-defined]
    record = InPlace.round_record_key(run_id)
    while not done.is_set() and not client.check([record]):
        time.sleep(0.1)
    if done.is_set():
        return
    raw = client.get(record)
    token = json.loads(raw.split(b".", 1)[1] if raw[64:65] == b"." else raw)["token"]
    space = InPlace(address, run_id, 0, 0, 1, 5.0, round_token=token)
    store = space.connect()
    while not done.is_set() and not store.check([space.spare_key(0, "ready")]):
        time.sleep(0.05)
    if done.is_set():
        return
    identity = dict.fromkeys(IDENTITY_ENV, "0")
    identity.update({Env.RANK: "1", Env.WORLD_SIZE: "2", Env.LOCAL_RANK: "1", Env.LOCAL_WORLD_SIZE: "2"})
    identity.update({Env.GROUP_WORLD_SIZE: "1", Env.RUN_ID: run_id})
    store.set(space.spare_key(0, "assign"), json.dumps({"env": identity, "generation": 5}))
    wrote.append(time.monotonic())
    # Under the round's prefix as a PrefixStore writes it (`<prefix>/<key>`).
    stepped = re.compile(re.escape(space.prefix.rstrip("/")) + r"/+stepped/(\d+)$")
    while not done.is_set():
        pids = sorted(int(m.group(1)) for m in map(stepped.match, client.list_keys()) if m)
        if pids:
            os.kill(pids[-1], signal.SIGKILL)
            return
        time.sleep(0.05)


@pytest.mark.slow
def test_a_foreign_assignment_of_a_live_runs_spare_is_ignored(tmp_path: Path) -> None:
    """Attack (c): in a live local run a foreign client wrote `node0/spare0/assign`; the spare took rank 1
    of another generation and sat outside the group. Now it is ignored: a trainer is killed after the
    forgery, its host assigns the spare, and the run recovers in place as it would have without it."""
    spec = load_spec(
        REPO / "examples" / "digits-ddp.yaml",
        [*SMALL, "spec.training.steps=60", "spec.procsPerNode=2", f"spec.metrics.port={free_port()}"],
    )
    # Paced (0.5 s a step, 30 s in all) so that the spare is ready and the attacker strikes mid-run.
    faults = [{"kind": "slow", "rank": -1, "step": 1, "generation": -1, "seconds": 0.5}]
    opts = SubmitOptions(run_dir=str(tmp_path / "run"), quiet=True, env={Env.FAULTS: json.dumps(faults)})
    run: Any = get_backend("local").launch(spec, opts)
    done, wrote = threading.Event(), []
    attacker = threading.Thread(
        target=_forge_assignment_then_kill, args=(run.store_address, run.plan.rdzv_id, done, wrote), daemon=True
    )
    attacker.start()
    try:
        summary = run.wait(150)
    finally:
        done.set()
        attacker.join(10)
    assert wrote, "the forged assignment was never written (the spare never got ready)"
    secret = tmp_path / "run" / "secret"  # the run's own: every process of it signs with it
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_bytes()) == 32
    assert summary.status == RunState.SUCCEEDED, summary.reason
    assert summary.recoveries == {"inplace": 1} and summary.restarts == 0, summary.to_dict()
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "run" / "logs").rglob("*.log"))
    assert "ignored a store value that is no order of this job (no MAC)" in logs
