"""Metrics of a worker: the sink seam, the Prometheus exporter, JSON lines and NVML GPU metrics.

The worker calls `create_sinks(spec, identity)` once and reports everything into the returned sink; the
checkpoint manager reports into the same one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from training.config import WorkerSpec
from training.contract import WorkerIdentity
from training.contract.events import MetricsExporter
from training.metrics.base import CheckpointRecord, FanOut, MetricsSink, RestoreRecord, SlowdownRecord, StepRecord
from training.metrics.flops import resolve_peak_flops

if TYPE_CHECKING:
    from training.metrics.prometheus import PrometheusSink

__all__ = [
    "CheckpointRecord",
    "FanOut",
    "MetricsSink",
    "RestoreRecord",
    "SlowdownRecord",
    "StepRecord",
    "create_sinks",
]

log = logging.getLogger(__name__)


def create_sinks(spec: WorkerSpec, identity: WorkerIdentity, env: Mapping[str, str] | None = None) -> FanOut:
    """The sinks of one worker, as the spec's `metrics` section asks.

    - Prometheus (every rank) when `metrics.enabled`: serves on `metrics.port + local_rank` (next free
      port when busy), bound to `metrics.bindAddress` / `TORCHRIG_METRICS_BIND` / all interfaces.
    - `events.jsonl` (every rank) and `metrics.jsonl` (rank 0) when `identity.run_dir` is set.
    - The TrainJob's `status.trainerStatus` (rank 0) when Kubeflow Trainer injected its status server's
      address (`KUBEFLOW_TRAINER_SERVER_URL`, the alpha `TrainJobStatus` gate): `trainer_status`.

    A sink that cannot be created is logged and left out: metrics never stop training.

    Args:
        spec: the resolved job file.
        identity: who this worker is.
        env: the environment to read the Trainer's variables from (default: `os.environ`).

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
        devices = visible_device_indices(identity.local_rank, reader.device_count())
        if devices:
            device_name = reader.device_name(devices[0])
    peak = resolve_peak_flops(device_name)

    if cfg.enabled:
        try:
            from training.metrics.prometheus import PrometheusSink, default_bind_address

            ckpt = spec.spec.checkpoint
            exporter = PrometheusSink(
                identity,
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

    if identity.run_dir:
        from training.metrics.jsonl import EventsJsonlSink, MetricsJsonlSink

        try:
            events = EventsJsonlSink(identity.run_dir, identity, cfg.log_every)
            sinks.append(events)
            if exporter is not None and exporter.port is not None and exporter.url is not None:
                # Where this rank's metrics really are (the configured port may have been busy).
                events.emit(MetricsExporter(port=exporter.port, url=exporter.url, local_rank=identity.local_rank))
            if identity.is_leader:
                sinks.append(MetricsJsonlSink(identity.run_dir, identity, cfg.log_every, peak_flops=peak))
        except OSError:
            log.exception("cannot write JSON lines to %s; training goes on without them", identity.run_dir)

    if identity.is_leader:
        from training.metrics.trainer_status import TrainerStatusEndpoint, TrainerStatusSink

        endpoint = TrainerStatusEndpoint.from_env(env)
        if endpoint is not None:
            try:
                sinks.append(TrainerStatusSink(endpoint, total_steps=spec.spec.training.steps, log_every=cfg.log_every))
            except Exception:
                log.exception("cannot report progress to the TrainJob status; training goes on without it")
    return FanOut(*sinks)
