"""A tiny stand-in for `python -m training`: a real torch.distributed (gloo) program that follows the
backend -> worker contract of docs/architecture.md, so the local backend is tested on its own.

Each step all-reduces a tensor (so a dead peer is noticed like in real training), rank 0 writes
metrics.jsonl, every rank writes events.jsonl, rank 0 saves its step to `checkpoints/standin.pt`
every `checkpoint.every.steps` and resumes from it after a restart, and writes result.json at the end.
TORCHRIG_FAULTS kills are honoured. STANDIN_STEP_S sets the time per step (default 0.05 s).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from training.config import load_worker_spec


def _event(run_dir: Path, **fields: object) -> None:
    line = json.dumps({"time": time.time(), **fields}) + "\n"
    fd = os.open(run_dir / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default=os.environ.get("TORCHRIG_SPEC"))
    args = parser.parse_args()
    spec = load_worker_spec(args.spec)
    run_dir = Path(os.environ["TORCHRIG_RUN_DIR"])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    faults = json.loads(os.environ.get("TORCHRIG_FAULTS", "[]"))
    step_s = float(os.environ.get("STANDIN_STEP_S", "0.05"))
    steps = spec.spec.training.steps
    every = spec.spec.checkpoint.every.steps or 10
    ckpt = run_dir / "checkpoints" / "standin.pt"

    # Contract checks: a missing variable fails the worker loudly (the backend test then fails).
    assert os.environ["TORCHRIG_METRICS_BIND"] == "127.0.0.1"
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    if spec.spec.metrics.enabled:
        # Hold the metrics port like the exporter would, so colliding ports would fail the run.
        sock = socket.socket()
        sock.bind(("127.0.0.1", spec.spec.metrics.port + int(os.environ["LOCAL_RANK"])))
        sock.listen()

    dist.init_process_group("gloo")
    _event(
        run_dir,
        rank=rank,
        generation=gen,
        event="start",
        pid=os.getpid(),
        world_size=world,
        node_rank=int(os.environ["GROUP_RANK"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
    )
    start_step = 0
    if ckpt.exists():
        start_step = int(torch.load(ckpt)["step"])
        _event(
            run_dir,
            rank=rank,
            generation=gen,
            event="restore",
            step=start_step,
            store="local",
            uri=str(ckpt),
            seconds=0.0,
            source="store",
        )
    weight = torch.full((4,), float(start_step))
    t0 = time.time()
    loss = 0.0
    for step in range(start_step + 1, steps + 1):
        for f in faults:
            if f.get("rank") == rank and f.get("step") == step and f.get("generation", 0) == gen:
                _event(run_dir, rank=rank, generation=gen, event="fault", kind=f["kind"], step=step)
                if f["kind"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif f["kind"] == "exit":
                    os._exit(3)
        time.sleep(step_s)
        grad = torch.ones(4)
        dist.all_reduce(grad)
        weight += grad / world
        loss = 1.0 / step
        if step % spec.spec.metrics.log_every == 0:
            print(f"step {step} loss {loss:.4f} world {world}", flush=True)
        if rank == 0 and step % spec.spec.metrics.log_every == 0:
            with (run_dir / "metrics.jsonl").open("a") as fh:
                fh.write(
                    json.dumps(
                        {
                            "time": time.time(),
                            "step": step,
                            "loss": loss,
                            "samples_per_s": 100.0 * world,
                            "world_size": world,
                            "generation": gen,
                        }
                    )
                    + "\n"
                )
        if step % every == 0 or step == steps:
            dist.barrier()
            if rank == 0:
                ckpt.parent.mkdir(exist_ok=True)
                torch.save({"step": step}, str(ckpt) + ".tmp")
                os.replace(str(ckpt) + ".tmp", ckpt)
                _event(
                    run_dir,
                    rank=rank,
                    generation=gen,
                    event="checkpoint_committed",
                    step=step,
                    blocked_s=0.0,
                    save_s=0.0,
                    stores_ok=["local"],
                    stores_failed=[],
                )
    if rank == 0:
        digest = hashlib.sha256(weight.numpy().tobytes()).hexdigest()
        (run_dir / "result.json").write_text(
            json.dumps(
                {
                    "steps": steps,
                    "final_loss": loss,
                    "eval": {"accuracy": 1.0},
                    "params_sha256": digest,
                    "world_size": world,
                    "samples_per_s": 100.0 * world,
                    "wall_s": time.time() - t0,
                }
            )
        )
    _event(run_dir, rank=rank, generation=gen, event="finished")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
