"""Standby nodes (`restarts.spareNodes`) against a real c10d store and real processes: who stands by, how a
standby takes a lost node's ranks, how it ends with its job. Moved from tests/unit/test_standby.py (the
unit suite starts no process and opens no socket). The whole path runs in tests/pods/test_pods.py."""

from __future__ import annotations

import json
import signal
import socket
import time
from typing import Any

import pytest

from orchestrator.loader import load_spec
from tests.unit.test_standby import EXAMPLE, _job
from training.contract import Env
from training.contract.orders import Signer, create_job_secret, load_job_secret
from training.inplace import InPlace
from training.inplace.protocol import StandDown
from training.inplace.standby import Launch, Round, Standby, standby_wanted


@pytest.fixture
def secret_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """The job's secret (`Env.JOB_SECRET_FILE`), set in this process's environment too."""
    path = create_job_secret(tmp_path / "secret")
    monkeypatch.setenv(Env.JOB_SECRET_FILE, path)
    return path


def _secret(path: str) -> bytes:
    secret = load_job_secret({Env.JOB_SECRET_FILE: path})
    assert secret is not None
    return secret


def _record_round(store: Any, path: str, found: Round, run_id: str = "job") -> None:
    """What every agent records after a rendezvous (`training.torchrun._publish_round`), signed."""
    key = InPlace.round_record_key(run_id)
    store.set(key, Signer(_secret(path)).sign(key, found.to_json()))


@pytest.fixture
def store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]


def test_who_stands_by_and_what_it_reads_from_torchruns_arguments(secret_file: str) -> None:
    job = _job("spec.nodes.min=2", "spec.restarts.spareNodes=1")
    command = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    argv = command[command.index("torchrun") + 1 :]
    argv = [a.replace("$(MASTER_ADDR)", "digits-ddp-master-0").replace("$(MASTER_PORT)", "23456") for a in argv]
    assert standby_wanted(argv, {}) is None, "no spare nodes: torchrun as before"
    spare = {Env.STANDBY_FROM: "2", Env.REPLICA_INDEX: "2"}
    assert standby_wanted(argv, spare) is None, "no job secret: no standby (it could not check its orders)"
    launch = standby_wanted(argv, {**spare, Env.JOB_SECRET_FILE: secret_file})
    assert launch is not None and launch.secret == _secret(secret_file)
    assert (launch.endpoint, launch.run_id, launch.nproc) == ("digits-ddp-master-0:23456", "digits-ddp", 2)
    assert launch.program[1:] == ["-u", "-m", "training", "--spec", "/etc/torchrig/job.yaml"]
    assert launch.join_timeout_s == 600, "torchrun's default join timeout: how long a standby waits for a store"
    # A member's pod stands by only while its job's round runs; with no store reachable it joins.
    assert (
        standby_wanted(
            [*argv[:-5], "--rdzv-endpoint", "127.0.0.1:9", *argv[-5:]],
            {
                Env.STANDBY_FROM: "2",
                Env.REPLICA_INDEX: "0",
                Env.JOB_SECRET_FILE: secret_file,
            },
        )
        is None
    )
    assert Round.parse(b'{"token": "t"}') is None and Round.parse(b"\xff") is None


def test_a_standby_takes_a_lost_node_once_and_hands_each_spare_its_rank(store: Any) -> None:
    found = Round(token="tok", round=3, nodes=2)
    launch = Launch(f"127.0.0.1:{store.port}", "job", 2, 0, ["python", "-m", "training"], secret=b"k" * 32)
    first, second = (Standby(launch, store, found, slot, {}) for slot in (0, 1))
    lost = InPlace(
        store_addr="",
        run_id="job",
        restart_count=0,
        node_rank=1,
        spares=1,
        timeout_s=5,
        round_token="tok",
        secret=b"k" * 32,
    )
    space = first.store
    space.add(lost.spawned_key, 2)  # node 1 had started two spares; both died with it
    lost.write(space, lost.spare_key(1, "ready"), "999")
    lost.write(space, lost.restart_count_key(1), "2")
    lost.write(space, lost.rank_gen_key(2), "4")  # rank 2 had joined generation 4 when its node was lost
    space.set(lost.rank_gen_key(3), "9")  # forged: ignored (rank 3 never joined a generation of its own)
    for local, pid in ((0, "501"), (1, "502")):  # each standby's own warm spares
        first.inplace.write(space, first.inplace.spare_key(local, "ready"), pid)
        second.inplace.write(space, second.inplace.spare_key(local, "ready"), f"6{pid}")
    assert first.take(1, b"17")
    assert not second.take(1, b"17"), "two standbys that saw one loss never both take it"
    for index in range(2):
        assert lost.read(space, lost.spare_key(index, "claim")), "the lost node's dead spares are never claimed"
    for local, rank, generation in ((0, 2, 5), (1, 3, 1)):
        assignment = json.loads(first.inplace.read(space, first.inplace.spare_key(local, "assign")) or "")
        assert assignment["generation"] == generation
        env = assignment["env"]
        assert (env[Env.RANK], env[Env.LOCAL_RANK], env[Env.GROUP_RANK], env[Env.WORLD_SIZE]) == (
            str(rank),
            str(local),
            "1",
            "4",
        )
        assert env[Env.RESTART_COUNT] == "2"
        orders = json.loads(first.inplace.read(space, first.inplace.promote_key(local)) or "")
        assert orders["node"] == 1 and orders["next_spare"] == 2 and orders["env"] == env
        assert lost.read(space, lost.owner_key(rank)) == str(501 + local), "the node's old processes stand down"
    assert first.inplace.node_rank == 2, "a standby's own spares live past the members' node indices"
    assert int(space.add(lost.beat_key(1), 0)) == 1, "the taken node's beat moves again"
    assert second.take(1, b"40"), "lost again later (its beat stopped elsewhere): another standby takes it"


class _Refusing:
    """A store that refuses its next `refusals` writes (`set`), then answers as `inner`."""

    def __init__(self, inner: Any, refusals: int) -> None:
        self.inner, self.refusals = inner, refusals

    def set(self, key: str, value: Any) -> None:
        if self.refusals > 0:
            self.refusals -= 1
            raise RuntimeError("refused")
        self.inner.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_take_the_store_fails_midway_is_a_wait_and_the_next_look_completes_it(store: Any) -> None:
    """The store failed after this standby won the node's compare-and-set: once an exception out of
    `_stand_by` (the pod exited 1, permanent under Kubeflow's convention); now a failed look, and the next take
    wins the same compare-and-set again and finishes, while another standby still cannot take the node."""
    found = Round(token="tok", round=3, nodes=2)
    launch = Launch(f"127.0.0.1:{store.port}", "job", 1, 0, ["python", "-m", "training"], secret=b"k" * 32)
    first, second = (Standby(launch, store, found, slot, {}) for slot in (0, 1))
    first.inplace.write(first.store, first.inplace.spare_key(0, "ready"), "501")
    first.store = _Refusing(first.store, refusals=1)
    assert not first.take_quietly(1, b"17"), "a take the store failed is no take"
    assert first.taken is None
    assert not second.take_quietly(1, b"17"), "the node is still this standby's to take"
    assert first.take_quietly(1, b"17"), "the next look takes it"
    assert first.taken == 1
    assert first.inplace.read(first.store, first.inplace.owner_key(1)) == "501"


def test_a_standby_holding_a_node_sees_a_new_round(store: Any) -> None:
    found = Round(token="tok", round=3, nodes=2)
    launch = Launch(f"127.0.0.1:{store.port}", "job", 1, 0, ["python", "-m", "training"], secret=b"k" * 32)
    standby = Standby(launch, store, found, 0, {})
    key = InPlace.round_record_key("job")
    assert not standby.new_round(), "no record: nothing seen"
    store.set(key, Signer(b"k" * 32).sign(key, found.to_json()))
    assert not standby.new_round(), "its own round"
    store.set(key, Round(token="tok2", round=4, nodes=2).to_json())
    assert not standby.new_round(), "a record this job did not sign is none"
    store.set(key, Signer(b"k" * 32).sign(key, Round(token="tok2", round=4, nodes=2).to_json()))
    assert standby.new_round(), "the group restarted: a new round"


def test_a_local_run_ends_when_only_standbys_that_took_no_node_are_left(tmp_path: Any) -> None:
    """A standby that took no node keeps nothing running: a run whose members all ended is over (its
    standby is stopped with it); one that took a node runs that node's ranks and keeps the run going."""
    import subprocess
    import sys

    from orchestrator.backends.base import RunState, SubmitOptions
    from orchestrator.backends.local_plan import create_local_plan
    from orchestrator.backends.local_run import LocalRun, _Agent

    spec = load_spec(EXAMPLE, ["spec.nodes.min=2", "spec.restarts.spareNodes=1"])
    run = LocalRun(spec, create_local_plan(spec, SubmitOptions(run_dir=str(tmp_path)), tmp_path, resume=False))
    member = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    member.wait()
    standby = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run._agents = [_Agent(node=0, proc=member), _Agent(node=2, proc=standby, standby=True)]
        assert run.poll() is RunState.FAILED
        log = run.files.node_log(2)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("torchrig: standby: node 1 stopped beating; this standby takes its ranks 2-3 in place\n")
        assert run.poll() is RunState.RUNNING
    finally:
        standby.kill()
        standby.wait()


def test_a_standby_whose_store_vanished_or_never_answered_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A standby that reached its job's store before any round ran (the launcher died early: a local
    `torchrig run` killed at start) ends 0 once the store has been gone `STORE_GONE_S`, instead of
    retrying forever; one whose store never answers fails after the rendezvous' join timeout, as a
    torchrun agent would."""
    import torch.distributed as dist

    from training.inplace import standby

    monkeypatch.setattr(standby, "STORE_GONE_S", 0.5)
    monkeypatch.setattr(standby, "STORE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(standby, "RECONNECT_TIMEOUT_S", 0.5)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    launch = Launch(f"127.0.0.1:{server.port}", "job", 1, 0, ["python", "-m", "training"], join_timeout_s=60)
    calls: list[float] = []

    def stop() -> None:  # the store goes away after the standby's first look (no round ran)
        calls.append(time.monotonic())
        if len(calls) == 2:
            nonlocal server
            server = None

    assert standby._wait_for_round(launch, "spare", stop, seen=False) == StandDown(0)
    assert calls[-1] - calls[1] < 10, "ended within a few seconds of the store's loss"

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    never = Launch(f"127.0.0.1:{port}", "job", 1, 0, ["python", "-m", "training"], join_timeout_s=1.0)
    assert standby._wait_for_round(never, "spare", lambda: None, seen=False) == StandDown(1)


def test_a_members_pod_recreated_as_the_job_ends_exits_0_instead_of_joining_a_closed_rendezvous(
    store: Any, secret_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost node's recreated pod that comes up when the job's agents have passed torchrun's exit barrier
    must not run torchrun: the rendezvous is closed, torchrun would exit 1 and the operator would fail a
    job that succeeded. `standby_wanted` keeps it (no round runs, but the job is over) and `run_standby`
    ends it with 0; the store-only Master ends with the job once an agent recorded its end (signed)."""
    from torch.distributed.elastic.utils.store import barrier

    from training.inplace.standby import TERMINAL_STATE_SYNC_ID, job_finished, round_store, run_standby
    from training.rendezvous_store import failed_key, job_outcome
    from training.torchrun import record_job_end

    argv = [
        *("--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "job", "x.py"),
    ]
    secret = _secret(secret_file)
    member = {Env.STANDBY_FROM: "1", Env.REPLICA_INDEX: "0", Env.JOB_SECRET_FILE: secret_file}
    assert standby_wanted(argv, member) is None, "no round recorded: the job is starting, join it"
    assert job_outcome(store, "job", secret) is None
    _record_round(store, secret_file, Round(token="t", round=2, nodes=1))
    assert not job_finished(store, "job", secret) and job_outcome(store, "job", secret) is None
    monkeypatch.setenv(Env.STORE_POD, "1")
    assert not record_job_end(argv, 0), "torchrun's exit barrier did not pass: no end is recorded"
    barrier(round_store(store, "job", 2), 1, TERMINAL_STATE_SYNC_ID, barrier_timeout=10)
    assert job_finished(store, "job", secret)
    assert job_outcome(store, "job", secret) is None, "torch's barrier keys carry no MAC: they end no store pod"
    assert record_job_end(argv, 0)  # what the agent does once torchrun returned 0
    assert job_outcome(store, "job", secret) == 0
    launch = standby_wanted(argv, member)
    assert launch is not None
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert run_standby(launch, dict(member)) == 0
    finally:  # run_standby installs its own
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    signer = Signer(secret)
    store.set(failed_key("job"), signer.sign(failed_key("job"), "1"))
    assert job_outcome(store, "job", secret) == 1, "an agent's permanent exit ends the store pod with that code"
    store.set(failed_key("job"), signer.sign(failed_key("job"), "143"))
    assert job_outcome(store, "job", secret) == 0, "only a permanent code is an agent's verdict on the job"


@pytest.mark.parametrize("code", [0, 3, 143])
def test_a_standby_that_ends_the_job_with_a_permanent_code_tells_the_store_pod(
    store: Any, monkeypatch: pytest.MonkeyPatch, code: int, secret_file: str
) -> None:
    """A standby that took a lost node and whose ranks then fail permanently (exit 3: no checkpoint it may
    load) ends its pod with that code; the store-only Master must end with it, as it does when a member's
    agent ends the job, instead of serving a failed job's kept pods. A success or a signal is no verdict."""
    import training.inplace.standby as standby_mod
    from training.rendezvous_store import failed_key, job_outcome
    from training.torchrun import stand_by_first

    argv = [
        *("--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "job", "x.py"),
    ]
    monkeypatch.setenv(Env.STANDBY_FROM, "1")
    monkeypatch.setenv(Env.REPLICA_INDEX, "1")
    monkeypatch.setenv(Env.STORE_POD, "1")
    _record_round(store, secret_file, Round(token="t", round=1, nodes=1))
    monkeypatch.setattr(standby_mod, "run_standby", lambda launch: code)
    assert stand_by_first(argv) == code
    assert store.check([failed_key("job")]) == (code == 3)
    assert job_outcome(store, "job", _secret(secret_file)) == (3 if code == 3 else None)
