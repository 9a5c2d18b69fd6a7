"""CheckpointManager across real processes (gloo): resharding 2 -> 1 -> 2 under DDP and FSDP2, a
resubmitted two-process job (restart count 0 again) that keeps committing, two-node emulation with
node-local copies and peer replication, and a worker SIGKILLed in the middle of a save."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.fixtures.checkpoint import ckpt_identity
from tests.fixtures.common import REPO

pytestmark = [pytest.mark.timeout(300)]


class AppState:
    """The worker's way: model + optimizer through get_state_dict/set_state_dict, plus progress."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, step: int = 0) -> None:
        self.model, self.optim, self.step = model, optim, step

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.step = int(sd["step"])


def _build(strategy: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if strategy == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {f"model.{k}": v.clone() for k, v in model_sd.items()}
    for fqn, st in optim_sd.get("state", {}).items():  # full state dicts land on rank 0 only
        for name, value in st.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{fqn}.{name}"] = value.clone()
    return out


PHASE_TIMEOUT_S = 150.0


def _join_group(rank: int, world: int, port: int) -> None:
    """Join the phase's gloo group through the store the test process owns (`_spawn`); a child still
    running shortly before the phase's deadline writes its threads' stacks to stderr (faulthandler)."""
    faulthandler.dump_traceback_later(PHASE_TIMEOUT_S - 15, exit=False)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))


def _end_child() -> NoReturn:
    """End a child whose phase succeeded while its frame still holds the phase's objects.

    Returning would free them (the model, the checkpoint manager's gloo groups, tensors gloo's threads
    may still reference) in the frame's teardown, where torch can deadlock on the GIL (a gloo thread
    releasing a tensor needs it; pytorch/pytorch#179291). Seen once in CI: a child that had finished
    its phase hung in `_wrap` after `fn` returned until the phase's deadline. `exit_now` joins the
    threads, runs the atexit handlers, flushes the streams, then `os._exit`s. A failed phase raises
    before this and reaches `_spawn` as an error, as before.
    """
    from training.fastexit import exit_now

    exit_now(0)


def _spawn(fn: Any, world: int, *args: Any) -> None:
    """Run `fn(rank, world, port, *args)` in `world` processes and wait for all of them.

    The test process owns the rendezvous store, bound to a port the kernel picks (port 0): a port
    picked free and bound later by a child can be taken meanwhile (a client's own outgoing connection
    can even land on it). A phase that does not end within PHASE_TIMEOUT_S fails (its children's stacks
    are in the captured stderr) instead of hanging the suite until pytest's timeout.
    """
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    context = mp.start_processes(fn, args=(world, server.port, *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            alive = [p.pid for p in context.processes if p.is_alive()]
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
            pytest.fail(
                f"a phase of {fn.__name__} did not end within {PHASE_TIMEOUT_S} s (still running: pids {alive}); "
                "their stacks are in the captured stderr"
            )


def _ctx(rank: int, world: int, root: str, generation: int, nodes: int = 1) -> Any:
    return ckpt_identity(root, generation=generation, rank=rank, world_size=world, num_nodes=nodes)


def _reshard_phase(
    rank: int, world: int, port: int, strategy: str, phase: int, root: str, generation: int | None = None
) -> None:
    from training.checkpoint import CheckpointManager
    from training.config import CheckpointConfig

    _join_group(rank, world, port)
    try:
        model, optim = _build(strategy, world)
        app = AppState(model, optim)
        cfg = CheckpointConfig.model_validate(
            {"every": {"steps": 1}, "stores": [{"uri": f"{root}/a", "name": "a"}, {"uri": f"{root}/b", "name": "b"}]}
        )
        restart = phase if generation is None else generation
        mgr = CheckpointManager(cfg, _ctx(rank, world, root, generation=restart), None)
        result = mgr.restore({"app": app})
        out: dict[str, Any] = {"restored": None}
        if result is not None:
            out["restored"] = {"step": result.step, "world_size": result.world_size, "store": result.store}
            got = _full_state(model, optim)  # collective; the full tensors land on rank 0
            if rank == 0:
                expected = torch.load(f"{root}/expected-{result.step}.pt")
                assert set(got) == set(expected), (sorted(got), sorted(expected))
                out["max_diff"] = max(float((got[k] - expected[k]).abs().max()) for k in expected)
            assert app.step == result.step
        _train(model, optim, 2, seed=phase)
        step = app.step + 2
        app.step = step
        full = _full_state(model, optim)
        mgr.save(step, {"app": app})
        # Training goes on (FSDP all-gathers on the default group) while the save runs in the background on
        # its own group: no deadlock, and the checkpoint holds the state at save time, not what came after.
        _train(model, optim, 2, seed=phase + 100)
        mgr.close()
        if rank == 0:
            torch.save(full, f"{root}/expected-{step}.pt")
            out["saved"] = step
            out["committed"] = mgr.history[-1].committed
            out["stores_ok"] = mgr.history[-1].stores_ok
            Path(f"{root}/phase-{phase}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()
    _end_child()


def _run_phase(world: int, strategy: str, phase: int, root: str, generation: int | None = None) -> dict[str, Any]:
    _spawn(_reshard_phase, world, strategy, phase, root, generation)
    result: dict[str, Any] = json.loads(Path(f"{root}/phase-{phase}.json").read_text())
    return result


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_reshard_2_1_2(tmp_path: Path, strategy: str) -> None:
    root = str(tmp_path)
    first = _run_phase(2, strategy, 0, root)
    assert first["restored"] is None and first["committed"] and first["stores_ok"] == ["a", "b"]
    second = _run_phase(1, strategy, 1, root)  # world size 2 -> 1
    assert second["restored"] == {"step": 2, "world_size": 2, "store": "a"}
    assert second["max_diff"] == 0.0
    third = _run_phase(2, strategy, 2, root)  # and back 1 -> 2
    assert third["restored"] == {"step": 4, "world_size": 1, "store": "a"}
    assert third["max_diff"] == 0.0
    from training.checkpoint import list_checkpoints, open_storage

    manifest = list_checkpoints(open_storage(f"{root}/a"))[0].manifest
    assert manifest is not None and manifest.world_size == 2 and manifest.step == 6
    # one shard file per rank plus rank 0's DCP metadata, each recorded with its writer
    ranks = sorted({f.rank for f in manifest.files if f.path.endswith(".distcp")})
    assert set(ranks) <= {0, 1} and (strategy != "fsdp" or ranks == [0, 1])  # FSDP: every rank holds a shard
    assert all(f.path.split("/")[-1].startswith(f"__{f.rank}_") for f in manifest.files if f.path.endswith(".distcp"))


@pytest.mark.slow
def test_resubmitted_two_process_job_keeps_committing(tmp_path: Path) -> None:
    root = str(tmp_path)
    # restarted once, then resubmitted under the same name: the restart count is 0 again
    for phase, restart_count in enumerate((0, 1, 0)):
        out = _run_phase(2, "ddp", phase, root, restart_count)
        assert out["committed"] and out["stores_ok"] == ["a", "b"], out
    assert out["restored"] == {"step": 4, "world_size": 2, "store": "a"} and out["saved"] == 6
    from training.checkpoint import open_storage, read_manifest

    manifest = read_manifest(open_storage(f"{root}/b"), 6)
    assert (manifest.generation, manifest.restart_count) == (2, 0)
    assert {f.path.split("/")[0] for f in manifest.files} == {"gen-0002"}


def _two_node_phase(rank: int, world: int, port: int, phase: int, root: str) -> None:
    from training.checkpoint import CheckpointManager
    from training.config import CheckpointConfig

    _join_group(rank, world, port)
    try:
        model, optim = _build("fsdp", world)
        app = AppState(model, optim)
        cfg = CheckpointConfig.model_validate(
            {
                "every": {"steps": 1},
                "stores": [{"uri": f"{root}/store", "name": "store"}],
                "nodeLocal": {"enabled": True, "path": f"{root}/shm", "replicateToPeer": True},
            }
        )
        mgr = CheckpointManager(cfg, _ctx(rank, world, root, generation=phase, nodes=2), None)
        result = mgr.restore({"app": app})
        out: dict[str, Any] = {"restored": None}
        if result is not None:
            out["restored"] = {"step": result.step, "source": result.source}
            got = _full_state(model, optim)
            if rank == 0:
                expected = torch.load(f"{root}/expected-{result.step}.pt")
                out["max_diff"] = max(float((got[k] - expected[k]).abs().max()) for k in expected)
        _train(model, optim, 1, seed=phase)
        app.step += 1
        mgr.save(app.step, {"app": app})
        mgr.close()
        full = _full_state(model, optim)
        if rank == 0:
            torch.save(full, f"{root}/expected-{app.step}.pt")
        Path(f"{root}/phase-{phase}-rank-{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()
    _end_child()


@pytest.mark.slow
def test_two_nodes_node_local_with_peer_replica(tmp_path: Path) -> None:
    root = str(tmp_path)
    _spawn(_two_node_phase, 2, 0, root)
    # each node holds its own shards and its peer's: a full copy
    node_dirs = [tmp_path / "shm" / "job" / f"node-{n}" / "step-00000001" for n in (0, 1)]
    for d in node_dirs:
        files = sorted(p.name for p in (d / "gen-0000").iterdir())
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], (d, files)
        assert (d / "manifest.json").exists()
    _spawn(_two_node_phase, 2, 1, root)
    for rank in (0, 1):
        out = json.loads((tmp_path / f"phase-1-rank-{rank}.json").read_text())
        assert out["restored"] == {"step": 1, "source": "node-local"}
        assert rank != 0 or out["max_diff"] == 0.0
    # lose node 1's local copy (the node was replaced): restore falls back to the store on every rank
    import shutil

    shutil.rmtree(tmp_path / "shm" / "job" / "node-1")
    _spawn(_two_node_phase, 2, 2, root)
    for rank in (0, 1):
        out = json.loads((tmp_path / f"phase-2-rank-{rank}.json").read_text())
        assert out["restored"] == {"step": 2, "source": "store"}
        assert rank != 0 or out["max_diff"] == 0.0


_KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, torch
    from training.checkpoint import CheckpointManager
    from training.config import CheckpointConfig
    from training.contract import WorkerIdentity
    root = sys.argv[1]
    cfg = CheckpointConfig.model_validate(
        {"every": {"steps": 1}, "stores": [{"uri": root + "/a", "name": "a"}, {"uri": root + "/b", "name": "b"}]}
    )
    ctx = WorkerIdentity(job="job", run_dir=root, generation=0, run_id="run")
    mgr = CheckpointManager(cfg, ctx)
    state = {"model": {f"w{i}": torch.full((1024, 1024), float(i)) for i in range(8)}, "step": 1}
    mgr.save(1, state)
    mgr.wait()
    state = {"model": {f"w{i}": torch.full((1024, 1024), float(i + 100)) for i in range(8)}, "step": 2}
    mgr.save(2, state)  # async: returns once staged; the kill lands while step 2 is being written
    print("staged", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_sigkill_during_save_restores_newest_committed(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_SCRIPT, str(tmp_path)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "staged" in proc.stdout
    from training.checkpoint import CheckpointManager, list_checkpoints, open_storage
    from training.checkpoint.manifest import verify_store
    from training.config import CheckpointConfig

    # whatever the kill interrupted, every committed manifest verifies and step 2 is committed only if complete
    newest_valid = 0
    for store in ("a", "b"):
        storage = open_storage(str(tmp_path / store))
        for c in list_checkpoints(storage):
            if c.manifest is not None:
                assert verify_store(storage, c.manifest).ok
                newest_valid = max(newest_valid, c.step)
    assert newest_valid >= 1
    cfg = CheckpointConfig.model_validate(
        {
            "every": {"steps": 1},
            "stores": [{"uri": str(tmp_path / "a"), "name": "a"}, {"uri": str(tmp_path / "b"), "name": "b"}],
        }
    )
    target: dict[str, Any] = {"model": {f"w{i}": torch.zeros(1024, 1024) for i in range(8)}, "step": 0}
    result = CheckpointManager(cfg, ckpt_identity(tmp_path, generation=1)).restore(target)
    assert result is not None and result.step == newest_valid
    offset = 0.0 if newest_valid == 1 else 100.0
    assert all(torch.equal(target["model"][f"w{i}"], torch.full((1024, 1024), i + offset)) for i in range(8))
