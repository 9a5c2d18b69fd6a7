"""The peer of the overhead benchmark: a minimal hand-written DDP loop, launched by plain torchrun.

Same model and data as torchrig's digits task (built through the same Task object), same batch, same
optimizer; none of torchrig's runtime (no sampler state, no checkpoints, no metrics, no watchdog).
Writes one `{"time", "step"}` JSON line per step to --out (rank 0), like torchrig's metrics history.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from training.task import load_task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    task = load_task("training.examples.digits:task", {"hidden": args.hidden})
    model = DistributedDataParallel(task.build_model())
    data = task.train_dataset()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n = len(data)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(n, generator=gen).tolist()
    cursor = 0
    records = []
    for step in range(1, args.steps + 1):
        idx = [order[(cursor + rank * args.batch_size + i) % n] for i in range(args.batch_size)]
        cursor += world * args.batch_size
        batch = task.collate([data[i] for i in idx])
        loss = task.loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        records.append({"time": time.time(), "step": step})
    if rank == 0:
        with open(args.out, "w") as fh:
            for r in records:
                fh.write(json.dumps(r) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
