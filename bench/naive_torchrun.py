"""The MTTR peer: what people write with plain torchrun — save every N steps with torch.save, resume
from the newest file on restart. Kills itself (SIGKILL, like torchrig's drill) at --kill-step in the
first attempt; torchrun restarts the group. Appends `fault` / `first_step` events to --events.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from training.contract import Env, EventKind
from training.task import load_task


def _event(path: str, kind: EventKind, **fields: object) -> None:
    # The events.jsonl line format (training.contract.events), so the bench reads it with read_events.
    with open(path, "a") as fh:
        fh.write(json.dumps({"time": time.time(), "event": kind.value, **fields}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--kill-step", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--events", required=True)
    args = parser.parse_args()

    attempt = int(os.environ.get(Env.RESTART_COUNT, "0"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    task = load_task("training.examples.digits:task", {"hidden": 256})
    model = DistributedDataParallel(task.build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    files = sorted(glob.glob(os.path.join(args.ckpt_dir, "step-*.pt")))
    if files:
        state = torch.load(files[-1], weights_only=False)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])
        if rank == 0:
            _event(args.events, EventKind.RESTORE, step=start, attempt=attempt)
    data = task.train_dataset()
    n = len(data)  # type: ignore[arg-type]
    for step in range(start + 1, args.steps + 1):
        if attempt == 0 and step == args.kill_step and rank == world - 1:
            _event(args.events, EventKind.FAULT, step=step, rank=rank)
            os.kill(os.getpid(), signal.SIGKILL)
        base = (step - 1) * world * args.batch_size + rank * args.batch_size
        batch = task.collate([data[(base + i) % n] for i in range(args.batch_size)])
        loss = task.loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        # Restarts give mttr its first step after a kill; without a kill (startup) the run's first.
        if rank == 0 and step == start + 1 and (attempt > 0 or args.kill_step == 0):
            _event(args.events, EventKind.FIRST_STEP, step=step, attempt=attempt)
        if rank == 0 and step % args.every == 0:
            path = os.path.join(args.ckpt_dir, f"step-{step:08d}.pt")
            torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step}, path + ".tmp")
            os.replace(path + ".tmp", path)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
