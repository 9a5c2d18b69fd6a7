"""A tiny stand-in for `python -m training`: a real torch.distributed (gloo) program that follows the
backend -> worker contract of docs/architecture.md, so the local backend is tested on its own.

Each step all-reduces a tensor (so a dead peer is noticed like in real training), rank 0 writes
metrics.jsonl, every rank writes events.jsonl, rank 0 saves its step to `checkpoints/standin.pt`
every `checkpoint.every.steps` and resumes from it after a restart, and writes result.json at the end.
TORCHRIG_FAULTS kills are honoured. STANDIN_STEP_S sets the time per step (default 0.05 s), until the
file STANDIN_UNPACE_FILE names exists (a test done with the paced part: the rest runs unpaced).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from training.config import load_worker_spec
from training.contract import Env, Result, RunFiles, WorkerIdentity, append_jsonl, open_append
from training.contract.events import CheckpointCommitted, Fault, Finished, Payload, Restore, Start, payload_fields


def _event(path: os.PathLike[str], who: WorkerIdentity, payload: Payload, **extra: Any) -> None:
    fd = open_append(path)
    try:
        line = {"time": time.time(), "rank": who.rank, "generation": who.generation, "event": payload.kind}
        append_jsonl(fd, {**line, **payload_fields(payload), **extra})
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default=os.environ.get(Env.SPEC))
    args = parser.parse_args()
    spec = load_worker_spec(args.spec)
    files = RunFiles(os.environ[Env.RUN_DIR])
    who = WorkerIdentity.from_env()
    rank, world, gen = who.rank, who.world_size, who.generation
    faults = json.loads(os.environ.get(Env.FAULTS, "[]"))
    step_s = float(os.environ.get("STANDIN_STEP_S", "0.05"))
    unpace = os.environ.get("STANDIN_UNPACE_FILE")
    steps = spec.spec.training.steps
    every = spec.spec.checkpoint.every.steps or 10
    ckpt = files.checkpoints / "standin.pt"

    # Contract checks: a missing variable fails the worker loudly (the backend test then fails).
    for name in (Env.RANK, Env.WORLD_SIZE, Env.LOCAL_RANK, Env.GROUP_RANK):
        assert name in os.environ, name
    assert os.environ[Env.METRICS_BIND] == "127.0.0.1"
    assert os.environ[Env.DISABLE_SHARED_RDZV_STORE] == "1"
    if spec.spec.metrics.enabled:
        # Hold the metrics port like the exporter would, so colliding ports would fail the run.
        sock = socket.socket()
        sock.bind(("127.0.0.1", spec.spec.metrics.port + who.local_rank))
        sock.listen()

    dist.init_process_group("gloo")
    _event(
        files.events,
        who,
        Start(pid=os.getpid(), world_size=world, node_rank=who.node_rank, local_rank=who.local_rank, node=""),
    )
    start_step = 0
    if ckpt.exists():
        start_step = int(torch.load(ckpt)["step"])
        _event(files.events, who, Restore(step=start_step, store="local", seconds=0.0), uri=str(ckpt))
    weight = torch.full((4,), float(start_step))
    t0 = time.time()
    loss = 0.0
    for step in range(start_step + 1, steps + 1):
        for f in faults:
            if f.get("rank") == rank and f.get("step") == step and f.get("generation", 0) == gen:
                _event(files.events, who, Fault(fault=f["kind"], step=step))
                if f["kind"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif f["kind"] == "exit":
                    os._exit(1)  # a crash (training.faults.FAULT_EXIT_CODE): 2 and 3 are permanent, never retried
        if step_s and unpace and os.path.exists(unpace):
            step_s = 0.0
        time.sleep(step_s)
        grad = torch.ones(4)
        dist.all_reduce(grad)
        weight += grad / world
        loss = 1.0 / step
        if step % spec.spec.metrics.log_every == 0:
            print(f"step {step} loss {loss:.4f} world {world}", flush=True)
        if rank == 0 and step % spec.spec.metrics.log_every == 0:
            fd = open_append(files.metrics)
            try:
                append_jsonl(
                    fd,
                    {
                        "time": time.time(),
                        "step": step,
                        "loss": loss,
                        "samples_per_s": 100.0 * world,
                        "world_size": world,
                        "generation": gen,
                    },
                )
            finally:
                os.close(fd)
        if step % every == 0 or step == steps:
            dist.barrier()
            if rank == 0:
                ckpt.parent.mkdir(exist_ok=True)
                torch.save({"step": step}, str(ckpt) + ".tmp")
                os.replace(str(ckpt) + ".tmp", ckpt)
                _event(
                    files.events, who, CheckpointCommitted(step=step, blocked_s=0.0, save_s=0.0, stores_ok=["local"])
                )
    wall_s = time.time() - t0
    if rank == 0:
        Result(
            steps=steps,
            final_loss=loss,
            eval={"accuracy": 1.0},
            params_sha256=hashlib.sha256(weight.numpy().tobytes()).hexdigest(),
            world_size=world,
            samples_per_s=100.0 * world,
            wall_s=wall_s,
        ).write(files.result)
    _event(files.events, who, Finished(step=steps, final_loss=loss, wall_s=wall_s))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
