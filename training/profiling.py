"""`metrics.profile`: a `torch.profiler` capture of a few training steps, written where a person looks.

Where does a step's time go? On a GPU the answer decides what to fix: a device busy most of the step
is bound by its kernels (precision, fusion, larger batches), a device idle most of it by the host (op
dispatch, launches, syncs, the optimizer's per-parameter loop). The capture covers steps
`startStep`..`startStep + steps - 1` on the ranks named, and writes per rank:

- `profile/gen-<G>/rank-<R>.trace.json.gz`: the Chrome trace (open it in https://ui.perfetto.dev);
- `profile/gen-<G>/rank-<R>.txt`: the costliest ops, by device time on a GPU, by host time on a CPU;
- a `profile` event with the wall time of the captured steps and the ops' total host and device time.

The step loop pays one integer comparison per step when no capture is due (`StepProfiler.before_step`).
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from training.config import ProfileConfig
from training.contract import RunFiles, WorkerIdentity
from training.contract.events import Profile
from training.metrics.base import MetricsSink

__all__ = ["StepProfiler", "create_step_profiler"]

log = logging.getLogger(__name__)
TABLE_ROWS = 30


class StepProfiler:
    """Starts torch.profiler before step `first` and stops it after step `last` (once per process).

    Args:
        cfg: `metrics.profile`.
        identity: This worker (its rank and restart generation name the files).
        run_dir: Where `profile/` goes.
        sink: Receives the `profile` event.
        cuda: Also record CUDA activity (a GPU job).
    """

    def __init__(
        self, cfg: ProfileConfig, identity: WorkerIdentity, run_dir: str, sink: MetricsSink, *, cuda: bool
    ) -> None:
        self.first = cfg.start_step
        self.last = cfg.start_step + cfg.steps - 1
        self._files = RunFiles(run_dir)
        self._identity = identity
        self._sink = sink
        self._cuda = cuda
        self._prof: Any = None
        self._started_at = 0.0
        self.done = False

    def before_step(self, step: int) -> None:
        """Called before optimizer step `step`: starts the capture at the first step of the window."""
        if step != self.first or self._prof is not None or self.done:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        self._prof = profile(activities=activities, record_shapes=False, with_stack=False)
        self._prof.__enter__()
        self._started_at = time.perf_counter()

    def after_step(self, step: int) -> None:
        """Called after optimizer step `step`: stops and writes the capture after the window's last step."""
        if self._prof is None or step < self.last:
            return
        if self._cuda:
            torch.cuda.synchronize()  # the window's kernels belong to it
        wall_s = time.perf_counter() - self._started_at
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.done = True
        try:
            self._write(prof, self.first, step, wall_s)
        except Exception:  # a profile that cannot be written must not end the training
            log.exception("rank %d: could not write the profile of steps %d-%d", self._identity.rank, self.first, step)

    def close(self) -> None:
        """Training ended inside the window: stop without writing (the window was never complete)."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)

    def _write(self, prof: Any, first: int, last: int, wall_s: float) -> None:
        rank, generation = self._identity.rank, self._identity.generation
        trace = self._files.profile_trace(generation, rank)
        table = self._files.profile_table(generation, rank)
        trace.parent.mkdir(parents=True, exist_ok=True)
        # export_chrome_trace writes a path: a plain file next to the target, gzipped into place.
        fd, raw = tempfile.mkstemp(dir=trace.parent, suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as src, gzip.open(trace, "wb", compresslevel=3) as dst:
                shutil.copyfileobj(src, dst)
        finally:
            Path(raw).unlink(missing_ok=True)
        averages = prof.key_averages()
        host_us = sum(float(e.self_cpu_time_total) for e in averages)
        device_us = sum(float(getattr(e, "self_device_time_total", 0.0) or 0.0) for e in averages)
        sort_by = "self_device_time_total" if self._cuda else "self_cpu_time_total"
        header = (
            f"torchrig profile: rank {rank}, generation {generation}, steps {first}-{last} "
            f"({last - first + 1} steps, {wall_s:.3f} s wall; ops' self time: host {host_us / 1e6:.3f} s, "
            f"device {device_us / 1e6:.3f} s)\n"
        )
        table.write_text(header + averages.table(sort_by=sort_by, row_limit=TABLE_ROWS) + "\n")
        root = self._files.root
        self._sink.emit(
            Profile(
                first_step=first,
                last_step=last,
                trace=str(trace.relative_to(root)),
                table=str(table.relative_to(root)),
                wall_s=round(wall_s, 4),
                host_time_s=round(host_us / 1e6, 4),
                device_time_s=round(device_us / 1e6, 4),
            )
        )
        log.info("rank %d: profile of steps %d-%d in %s", rank, first, last, table)


def create_step_profiler(
    cfg: ProfileConfig | None, identity: WorkerIdentity, sink: MetricsSink, *, cuda: bool
) -> StepProfiler | None:
    """The profiler `metrics.profile` asks of this rank; None when off, for another rank, or no run dir."""
    if cfg is None or identity.rank not in cfg.ranks or identity.run_dir is None:
        return None
    return StepProfiler(cfg, identity, str(identity.run_dir), sink, cuda=cuda)
