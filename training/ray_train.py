"""The function Ray Train's `TorchTrainer` runs on every worker: the torchrig worker, under Ray.

Ray Train has already created the default process group when `train_loop_per_worker` starts; this
module only translates `ray.train.get_context()` into a `training.env.DistEnv` and calls
`training.worker.run_worker`, which reuses that group. The torchrig checkpoint manager stays the
source of truth: every restarted worker group restores the newest committed torchrig checkpoint
itself, and the `ray.train.report` at the end carries the last committed step and store URIs as
metrics only. No Ray Checkpoint is reported, so Ray never holds a second copy of the state.

`ray` is imported inside functions only: `training` must stay importable without Ray.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["create_generation_counter", "last_committed_checkpoint", "train_loop_per_worker"]


def create_generation_counter() -> Any:
    """A Ray actor counting worker-group starts: Ray Train has no public restart count.

    Created by the driver (so it lives as long as the run, on any node), passed to the workers in
    `train_loop_config["generation_counter"]`; rank 0 of each new group takes the next number and
    broadcasts it, so drill faults aimed at generation 0 fire once and a restarted group is generation 1.
    """
    import ray

    class GenerationCounter:
        def __init__(self) -> None:
            self.value = -1

        def next(self) -> int:
            self.value += 1
            return self.value

    actor: Any = ray.remote(num_cpus=0)(GenerationCounter)
    return actor.remote()


def _agree_generation(counter: Any, rank: int) -> int:
    """Rank 0 draws the generation; every rank receives it over the group Ray Train created."""
    import torch
    import torch.distributed as dist

    value = 0
    if rank == 0 and counter is not None:
        import ray

        value = int(ray.get(counter.next.remote()))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        import ray.train.torch

        device = ray.train.torch.get_device()
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def last_committed_checkpoint(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """`{checkpoint_step, checkpoint_stores}` of the newest `checkpoint_committed` event (empty if none)."""
    path = Path(run_dir) / "events.jsonl"
    best: dict[str, Any] = {}
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return best
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a torn last line from a killed writer
        if not isinstance(event, dict) or event.get("event") != "checkpoint_committed":
            continue
        step = event.get("step")
        if isinstance(step, int) and step >= int(best.get("checkpoint_step", -1)):
            best = {"checkpoint_step": step, "checkpoint_stores": list(event.get("stores_ok") or [])}
    return best


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry of one rank.

    Args:
        config: `spec_yaml` (the resolved job file's text), `run_dir` (absolute; shared by the ranks of
            one node), `generation_counter` (optional actor from `create_generation_counter`), and
            `store_uris` (`{name: resolved uri}` of the checkpoint stores, reported as metrics).
    """
    import ray.train

    from training.config import load_worker_spec
    from training.env import DistEnv
    from training.worker import run_worker

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    world_size = ctx.get_world_size()
    local_world_size = ctx.get_local_world_size()
    generation = _agree_generation(config.get("generation_counter"), rank)
    run_dir = str(config["run_dir"])
    os.environ["TORCHRIG_RUN_DIR"] = run_dir
    dist_env = DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=ctx.get_local_rank(),
        local_world_size=local_world_size,
        node_rank=ctx.get_node_rank(),
        num_nodes=max(1, -(-world_size // max(local_world_size, 1))),
        generation=generation,
    )
    spec = load_worker_spec(str(config["spec_yaml"]))
    result = run_worker(spec, run_dir=run_dir, dist=dist_env)
    metrics: dict[str, Any] = {
        key: value for key, value in result.items() if isinstance(value, (int, float, str)) and key != "eval"
    }
    metrics.update({f"eval_{k}": v for k, v in (result.get("eval") or {}).items()})
    metrics["generation"] = generation
    checkpoint = last_committed_checkpoint(run_dir)
    stores: dict[str, str] = dict(config.get("store_uris") or {})
    if checkpoint:
        metrics["checkpoint_step"] = checkpoint["checkpoint_step"]
        names = checkpoint["checkpoint_stores"] or list(stores)
        metrics["checkpoint_uris"] = ",".join(stores.get(name, name) for name in names)
    # Every rank reports once (the call is a barrier); metrics only, no Ray Checkpoint.
    ray.train.report(metrics)
