"""In-place recovery's settings, failure classification and recovery counts, without a process or a store
(those pieces run against a real c10d store and real processes in tests/integration/test_inplace_pieces.py;
the policies are tables in test_inplace_protocol.py, the whole path in tests/integration/test_inplace.py)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import pytest
import torch.distributed as dist
import yaml

from tests.unit.test_spec_rules import BASE, problems
from training.config import WorkerSpec, load_worker_spec
from training.contract import Env, Event, EventKind
from training.contract.orders import create_job_secret
from training.inplace import InPlace
from training.inplace.group import RecoveryFailed, is_peer_failure


def _worker_spec(**restarts: Any) -> WorkerSpec:
    doc = json.loads(json.dumps(BASE))
    doc["spec"]["restarts"] = restarts
    return load_worker_spec(yaml.safe_dump(doc))


def _secret_file() -> str:
    """A job secret for the module's launches (`Env.JOB_SECRET_FILE`: in-place recovery signs its orders)."""
    folder = tempfile.mkdtemp(prefix="torchrig-test-")
    return create_job_secret(os.path.join(folder, "secret"))


SECRET_FILE = _secret_file()


IDENTITY = {
    Env.RANK: "0",
    Env.WORLD_SIZE: "2",
    Env.LOCAL_RANK: "0",
    Env.LOCAL_WORLD_SIZE: "2",
    Env.GROUP_RANK: "0",
    Env.GROUP_WORLD_SIZE: "1",
    Env.RESTART_COUNT: "0",
    Env.RUN_ID: "r",
}


LAUNCHED = {
    Env.INPLACE_STORE: "127.0.0.1:1234",
    Env.RUN_ID: "job-1",
    Env.WORLD_SIZE: "2",
    Env.GROUP_RANK: "1",
    Env.JOB_SECRET_FILE: SECRET_FILE,
}


def test_restarts_fields_are_validated_with_one_line_per_field() -> None:
    assert problems("spec.restarts.spares=-1") == ["spec.restarts.spares: Input should be greater than or equal to 0"]
    assert problems("spec.restarts.inPlaceTimeoutSeconds=0") == [
        "spec.restarts.inPlaceTimeoutSeconds: Input should be greater than 0"
    ]
    assert len(problems("spec.restarts.mode=sometimes")) == 1
    assert problems("spec.restarts.mode=sometimes")[0].startswith("spec.restarts.mode: ")


def test_in_place_applies_only_to_ddp_with_spares_under_the_local_launch() -> None:
    settings = InPlace.from_spec(_worker_spec(), LAUNCHED)
    assert settings is not None
    assert (settings.spares, settings.timeout_s, settings.node_rank) == (1, 60.0, 1)
    assert settings.prefix == "torchrig/inplace/job-1/0/"
    assert InPlace.from_spec(_worker_spec(mode="restart"), LAUNCHED) is None
    assert InPlace.from_spec(_worker_spec(spares=0), LAUNCHED) is None
    assert InPlace.from_spec(_worker_spec(), {**LAUNCHED, Env.WORLD_SIZE: "1"}) is None
    assert InPlace.from_spec(_worker_spec(), {k: v for k, v in LAUNCHED.items() if k != Env.INPLACE_STORE}) is None
    # Any world size on one node (`auto`, the default, as `inplace`).
    assert InPlace.from_spec(_worker_spec(), {**LAUNCHED, Env.WORLD_SIZE: "8"}) is not None
    # Several nodes: only with the c10d round token torchrig's agent exports (each agent counts its own
    # restarts, so the restart count cannot name a key space every node shares).
    assert InPlace.from_spec(_worker_spec(), {**LAUNCHED, Env.GROUP_WORLD_SIZE: "2"}) is None
    several = InPlace.from_spec(_worker_spec(), {**LAUNCHED, Env.GROUP_WORLD_SIZE: "2", Env.INPLACE_ROUND: "ab12"})
    assert several is not None and several.node_rank == 1
    assert several.prefix == "torchrig/inplace/job-1/round-ab12/"
    # A placeholder no agent of ours replaced means no store.
    for placeholder in (Env.INPLACE_STORE_AGENT, Env.INPLACE_STORE_RDZV):
        assert InPlace.from_spec(_worker_spec(), {**LAUNCHED, Env.INPLACE_STORE: placeholder}) is None
    # FSDP/HSDP: in place only with in-memory replicas of the shards (`checkpoint.inMemory.every`).
    fsdp = _worker_spec()
    fsdp.spec.training.strategy = type(fsdp.spec.training.strategy)("fsdp")
    assert InPlace.from_spec(fsdp, LAUNCHED) is None
    fsdp.spec.checkpoint.in_memory.every = 5
    assert InPlace.from_spec(fsdp, LAUNCHED) is not None
    fsdp.spec.restarts.mode = "restart"
    assert InPlace.from_spec(fsdp, LAUNCHED) is None


def test_mode_inplace_says_why_a_launch_restarts_instead(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="training.inplace"):
        assert InPlace.from_spec(_worker_spec(), {**LAUNCHED, Env.GROUP_WORLD_SIZE: "2"}) is None
    assert not caplog.records, "auto chooses quietly"
    with caplog.at_level("WARNING", logger="training.inplace"):
        assert InPlace.from_spec(_worker_spec(mode="inplace"), {**LAUNCHED, Env.GROUP_WORLD_SIZE: "2"}) is None
    assert [r.getMessage() for r in caplog.records] == [
        "restarts.mode is inplace, but this launch recovers by a group restart: several nodes without a c10d "
        "rendezvous round to share"
    ]


def test_a_lost_peer_is_told_from_a_bug() -> None:
    assert is_peer_failure(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:42388"))
    assert is_peer_failure(dist.DistBackendError("anything"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))
    assert not is_peer_failure(ValueError("connection"))
    assert not is_peer_failure(RecoveryFailed("generation 2: 1 of 2 ranks joined"))


def test_summary_counts_recoveries_by_path() -> None:
    from orchestrator.rundir import recoveries_from_events

    def recovery(rank: int, generation: int, path: str, inplace_generation: int = 0) -> Event:
        data = {"path": path, "step": 5, "inplace_generation": inplace_generation}
        return Event(time=0.0, rank=rank, generation=generation, kind=EventKind.RECOVERY, data=data)

    events = [
        recovery(0, 0, "inplace", 1),
        recovery(1, 0, "inplace", 1),  # the spare of the same recovery
        recovery(0, 0, "inplace", 2),
        recovery(0, 1, "restart"),
    ]
    assert recoveries_from_events(events) == {"inplace": 2, "restart": 1}


def test_one_node_torchrun_targets_have_their_agent_host_the_in_place_store() -> None:
    from orchestrator.compile import compile as compile_manifests
    from orchestrator.compile.torchrun import compile_torchrun
    from tests.unit.test_spec_rules import spec_of

    def pod_env(spec: Any, target: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for obj in compile_manifests(spec, target):
            # A TrainJob's variables are `spec.trainer.env` (its runtime's node container may have none).
            for holder in [*_containers(obj), obj.get("spec", {}).get("trainer") or {}]:
                out.update({e["name"]: e.get("value") for e in holder.get("env", [])})
        return out

    one_node = spec_of("spec.nodes.max=1", "spec.procsPerNode=2")
    for target in ("pytorchjob", "trainjob"):
        assert pod_env(one_node, target)[Env.INPLACE_STORE] == Env.INPLACE_STORE_AGENT, target
    assert compile_torchrun(one_node).env[Env.INPLACE_STORE] == Env.INPLACE_STORE_AGENT
    # Several nodes over the c10d rendezvous (both PyTorchJob shapes, the torchrun target, and a TrainJob
    # that recovers in place, which leaves the torch plugin's static rendezvous for c10d at node 0) share
    # the rendezvous store; without in-place recovery the TrainJob keeps the static rendezvous.
    nodes = ("spec.nodes.min=1", "spec.nodes.max=2", "spec.checkpoint.stores=[{uri: 's3://bucket/x'}]")
    several, fixed = spec_of(*nodes), spec_of(*nodes, "spec.nodes.min=2")
    assert pod_env(several, "pytorchjob")[Env.INPLACE_STORE] == Env.INPLACE_STORE_RDZV
    assert pod_env(fixed, "pytorchjob")[Env.INPLACE_STORE] == Env.INPLACE_STORE_RDZV
    assert compile_torchrun(several).env[Env.INPLACE_STORE] == Env.INPLACE_STORE_RDZV
    assert pod_env(fixed, "trainjob")[Env.INPLACE_STORE] == Env.INPLACE_STORE_RDZV
    from orchestrator.compile.trainjob import worker_command

    assert worker_command(fixed)[-9:-4] == [
        "c10d",
        "--rdzv-endpoint",
        "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
        "--rdzv-id",
        "t",
    ]
    assert "--rdzv-backend" not in worker_command(spec_of(*nodes, "spec.nodes.min=2", "spec.restarts.mode=restart"))
    # Ray runs no torchrun; restart mode, no spares or one process on one node recover by a restart.
    assert Env.INPLACE_STORE not in pod_env(one_node, "rayjob")
    for sets in (
        (*nodes, "spec.restarts.spares=0"),
        ("spec.nodes.max=1", "spec.restarts.mode=restart"),
        ("spec.nodes.max=1", "spec.restarts.spares=0"),
        ("spec.nodes.max=1", "spec.procsPerNode=1"),
    ):
        assert Env.INPLACE_STORE not in pod_env(spec_of(*sets), "pytorchjob"), sets


def _containers(obj: Any) -> list[dict[str, Any]]:
    """Every container spec inside a rendered object (any depth)."""
    found: list[dict[str, Any]] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "containers" and isinstance(value, list):
                found += [c for c in value if isinstance(c, dict)]
            else:
                found += _containers(value)
    elif isinstance(obj, list):
        for value in obj:
            found += _containers(value)
    return found


@pytest.mark.parametrize(
    ("argv", "pet", "expected"),
    [
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "master-0:23456", "-m", "training"], {}, "master-0:23456"),
        (["--rdzv_backend=c10d", "--rdzv_endpoint=node-a", "x.py"], {}, "node-a:29400"),  # c10d's default port
        # The elastic PyTorchJob: the operator's PET_* variables are torchrun's defaults.
        (["x.py"], {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "job-worker-0:23456"}, "job-worker-0:23456"),
        # The static rendezvous (a TrainJob's MASTER_ADDR launch): no shared round, no in-place store.
        (["--nnodes", "2", "--master-addr", "m", "--master-port", "1", "x.py"], {}, None),
    ],
)
def test_several_nodes_share_the_c10d_rendezvous_store(
    argv: list[str], pet: dict[str, str], expected: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.torchrun import host_inplace_store

    for name, value in pet.items():
        monkeypatch.setenv(name, value)
    env = {Env.INPLACE_STORE: Env.INPLACE_STORE_RDZV, Env.JOB_SECRET_FILE: SECRET_FILE}
    assert host_inplace_store(env, argv) is None, "nothing hosted here: the rendezvous host's agent serves it"
    assert env.get(Env.INPLACE_STORE) == expected
    # Without the job's secret, several nodes recover by group restarts: the store is reachable from
    # every node, and orders nobody can check could come from anyone.
    unsigned = {Env.INPLACE_STORE: Env.INPLACE_STORE_RDZV}
    assert host_inplace_store(unsigned, argv) is None and Env.INPLACE_STORE not in unsigned


def test_a_finished_run_does_not_wait_forever_for_its_last_replica_exchange(caplog: pytest.LogCaptureFixture) -> None:
    import threading

    from training.inplace.replica import ReplicaSet

    replicas = ReplicaSet(rank=0, world_size=2, every=5)
    stuck = threading.Event()
    replicas._thread = threading.Thread(target=stuck.wait, daemon=True)  # an exchange whose peer never came
    replicas._thread.start()
    begun = time.monotonic()
    replicas.close(timeout_s=0.3)
    assert time.monotonic() - begun < 5
    assert "did not end within 0.3 s" in caplog.text
    stuck.set()
