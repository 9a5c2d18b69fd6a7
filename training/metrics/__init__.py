"""Metrics of a worker: the sink seam, the Prometheus exporter, JSON lines and NVML GPU metrics.

The worker calls `create_sinks(spec, info)` once and reports everything into the returned sink; the
checkpoint manager reports into the same one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from training.config import WorkerSpec
from training.metrics.base import CheckpointRecord, FanOut, MetricsSink, RestoreRecord, RunInfo, StepRecord
from training.metrics.flops import resolve_peak_flops

if TYPE_CHECKING:
    from training.metrics.prometheus import PrometheusSink

__all__ = [
    "CheckpointRecord",
    "FanOut",
    "MetricsSink",
    "RestoreRecord",
    "RunInfo",
    "StepRecord",
    "create_sinks",
]

log = logging.getLogger(__name__)


def create_sinks(spec: WorkerSpec, info: RunInfo) -> FanOut:
    """The sinks of one worker, as the spec's `metrics` section asks.

    - Prometheus (every rank) when `metrics.enabled`: serves on `metrics.port + local_rank` (next free
      port when busy), bound to `metrics.bindAddress` / `TORCHRIG_METRICS_BIND` / all interfaces.
    - `events.jsonl` (every rank) and `metrics.jsonl` (rank 0) when `info.run_dir` is set.

    A sink that cannot be created is logged and left out: metrics never stop training.

    Args:
        spec: the resolved job file.
        info: identity of this worker.

    Returns:
        A `FanOut` of the sinks (possibly empty).
    """
    from training.metrics.gpu import create_gpu_reader, visible_device_indices

    cfg = spec.spec.metrics
    sinks: list[MetricsSink] = []
    exporter: PrometheusSink | None = None
    reader = create_gpu_reader() if cfg.gpu else None
    devices: list[int] | None = None
    device_name: str | None = None
    if reader is not None:
        devices = visible_device_indices(info.local_rank, reader.device_count())
        if devices:
            device_name = reader.device_name(devices[0])
    peak = resolve_peak_flops(device_name)

    if cfg.enabled:
        try:
            from training.metrics.prometheus import PrometheusSink, default_bind_address

            ckpt = spec.spec.checkpoint
            exporter = PrometheusSink(
                info,
                port=cfg.port,
                bind_address=default_bind_address(cfg.bind_address),
                peak_flops=peak,
                gpu_reader=reader,
                gpu_devices=devices,
                stores=[s.display_name for s in ckpt.stores],
                checkpoint_every_steps=ckpt.every.steps,
                checkpoint_every_seconds=ckpt.every.seconds,
                restarts_max=spec.spec.restarts.max,
            )
            sinks.append(exporter)
        except Exception:
            log.exception("the Prometheus exporter could not start; training goes on without it")

    if info.run_dir:
        from training.metrics.jsonl import EventsJsonlSink, MetricsJsonlSink

        try:
            events = EventsJsonlSink(info.run_dir, info, cfg.log_every)
            sinks.append(events)
            if exporter is not None:
                # Where this rank's metrics really are (the configured port may have been busy).
                events.write("metrics_exporter", port=exporter.port, url=exporter.url, local_rank=info.local_rank)
            if info.rank == 0:
                sinks.append(MetricsJsonlSink(info.run_dir, info, cfg.log_every, peak_flops=peak))
        except OSError:
            log.exception("cannot write JSON lines to %s; training goes on without them", info.run_dir)
    return FanOut(*sinks)
