"""Checkpoint stall: the time training is blocked per checkpoint, against torch.save, DCP and a memory copy;
and the committed write throughput against the disk's own `dd`."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import run, stats
from bench.sections.base import Section

MEASURES = ("torch_save", "dcp_save", "dcp_async", "memcpy", "torchrig", "torchrig_write_MBps", "dd_MBps")


def _state_of(megabytes: int) -> tuple[Any, Any]:
    """A model + AdamW state of about `megabytes` (params + 2 moments, float32)."""
    import torch

    numel = megabytes * 2**20 // 4 // 3
    width = 1024
    rows = max(1, numel // width)
    model = torch.nn.Linear(width, rows, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def _dd_write_mbps(directory: Path, megabytes: int) -> float:
    """The disk's own write bandwidth: dd of the same size, flushed to the device (conv=fdatasync)."""
    target = directory / "dd.bin"
    t = time.perf_counter()
    run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={megabytes}", "conv=fdatasync", "status=none"])
    seconds = time.perf_counter() - t
    target.unlink()
    return megabytes / seconds


def _peers(flat: dict[str, Any], model: Any, opt: Any, tmp: Path, i: int, res: dict[str, list[float]]) -> None:
    """One repeat of the peers: torch.save, dcp.save, dcp.async_save (blocked part) and a memory copy."""
    import torch
    import torch.distributed.checkpoint as dcp

    t = time.perf_counter()
    torch.save(flat, tmp / f"ts{i}.pt")
    res["torch_save"].append(time.perf_counter() - t)
    t = time.perf_counter()
    dcp.save(flat, checkpoint_id=str(tmp / f"dcp{i}"))
    res["dcp_save"].append(time.perf_counter() - t)
    t = time.perf_counter()
    fut = dcp.async_save(flat, checkpoint_id=str(tmp / f"adcp{i}"))
    res["dcp_async"].append(time.perf_counter() - t)
    fut.result()
    t = time.perf_counter()
    _copy = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _copy_o = [s["exp_avg"].clone() for s in opt.state.values()] + [s["exp_avg_sq"].clone() for s in opt.state.values()]
    res["memcpy"].append(time.perf_counter() - t)
    del _copy, _copy_o


def _manager(stores: Path) -> Any:
    """One job's checkpoint manager (async, two file stores), kept across the repeats as a job keeps it."""
    from training.checkpoint import CheckpointManager
    from training.config import CheckpointConfig
    from training.contract import WorkerIdentity

    config = CheckpointConfig.model_validate(
        {
            "every": {"steps": 1},
            "keep": 1,
            "async": True,
            "stores": [{"uri": f"file://{stores}/a", "name": "a"}, {"uri": f"file://{stores}/b", "name": "b"}],
        }
    )
    return CheckpointManager(config, WorkerIdentity(job="bench", run_dir=str(stores)))


def _torchrig(flat: dict[str, Any], mgr: Any, stores: Path, step: int, res: dict[str, list[float]]) -> None:
    """One repeat of torchrig: an async save of `step` to two file stores, blocked time and committed MB/s."""
    from training.checkpoint.manifest import step_dir

    t = time.perf_counter()
    mgr.save(step, flat)
    res["torchrig"].append(time.perf_counter() - t)
    mgr.wait()
    commit_s = time.perf_counter() - t
    written = sum(
        f.stat().st_size for st in ("a", "b") for f in (stores / st / step_dir(step)).rglob("*") if f.is_file()
    )
    res["torchrig_write_MBps"].append(written / 2**20 / commit_s)


def bench_checkpoint_stall(sizes_mb: list[int], repeats: int) -> dict[str, Any]:
    """Time training is blocked per checkpoint: torchrig async (2 stores) vs torch.save, dcp.save, dcp.async_save,
    and a plain in-memory copy (the floor)."""
    out: dict[str, Any] = {}
    for mb in sizes_mb:
        model, opt = _state_of(mb)
        flat = {"model": model.state_dict(), "optim": opt.state_dict()}
        res: dict[str, list[float]] = {k: [] for k in MEASURES}
        with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as s:
            tmp, stores = Path(d), Path(s)
            # One manager for every repeat, saving steps 1, 2, ... as a job's does: the blocked time is a
            # running job's, not a new manager's first save (its thread pool, its first allocations).
            mgr = _manager(stores)
            try:
                for i in range(repeats):
                    _peers(flat, model, opt, tmp, i, res)
                    _torchrig(flat, mgr, stores, i + 1, res)
                    res["dd_MBps"].append(_dd_write_mbps(tmp, mb))
                    for p in tmp.iterdir():
                        shutil.rmtree(p) if p.is_dir() else p.unlink()
            finally:
                mgr.close()
        med = {k: stats(v)["median"] for k, v in res.items()}
        out[f"{mb}MB"] = {
            "torchrig_blocked_s": med["torchrig"],
            "torch_save_s": med["torch_save"],
            "dcp_save_s": med["dcp_save"],
            "dcp_async_blocked_s": med["dcp_async"],
            "memcpy_s": med["memcpy"],
            "ratio_vs_torch_save": med["torchrig"] / med["torch_save"],
            "ratio_vs_memcpy": med["torchrig"] / med["memcpy"],
            "torchrig_write_MBps": med["torchrig_write_MBps"],
            "dd_write_MBps": med["dd_MBps"],
            "write_ratio_vs_dd": med["torchrig_write_MBps"] / med["dd_MBps"],
            "spread_pct": {k: round(stats(v)["spread_pct"], 1) for k, v in res.items()},
            "targets": {"ratio_vs_torch_save": "<= 0.10", "ratio_vs_memcpy": "<= 1.5"},
        }
    return out


SECTION = Section(
    "checkpoint_stall", lambda quick: bench_checkpoint_stall([50] if quick else [50, 500], 2 if quick else 5)
)
