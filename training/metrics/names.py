"""Every metric and label the exporter publishes, in one place.

Names follow the Prometheus conventions: a `torchrig_` prefix, base units in the name (`_seconds`,
`_bytes`, `_ratio`, `_watts`, `_celsius`), `_total` only on counters. The alert rules, the Grafana
dashboard and the tests all check their expressions against this module.

Labels are bounded on purpose:

- `training_job` (the job's `metadata.name`), `rank` (global rank), `node` (host name) are on every
  series. The training job is *not* called `job`: Prometheus attaches its own `job` (and `instance`)
  target labels at scrape time and would rename a clashing exported label to `exported_job`.
- The restart generation is a gauge value (`torchrig_restart_generation`) and a label of the
  one-series `torchrig_exporter_info` only, so a restart continues the same series (counters reset and
  `rate()` handles that) instead of creating a new set of series per restart.
- `store` (checkpoint store name, bounded by the spec), `gpu` (device index), `metric` (eval metric
  name, bounded by the task), `source` (restore source), `event` (a fixed set, see `EVENT_NAMES`) and
  `phase` (the step watchdog's phases, a fixed set).
"""

from __future__ import annotations

from typing import Final

from training.contract import EventKind

PREFIX: Final = "torchrig_"

# -- labels -------------------------------------------------------------------------------------------
LABEL_JOB: Final = "training_job"
LABEL_RANK: Final = "rank"
LABEL_NODE: Final = "node"
LABEL_GENERATION: Final = "generation"
LABEL_STORE: Final = "store"
LABEL_GPU: Final = "gpu"
LABEL_GPU_MODEL: Final = "model"
LABEL_METRIC: Final = "metric"
LABEL_SOURCE: Final = "source"
LABEL_EVENT: Final = "event"
LABEL_PORT: Final = "port"
LABEL_LOCAL_RANK: Final = "local_rank"
LABEL_VERSION: Final = "version"
LABEL_PHASE: Final = "phase"

# Labels on every series of a worker.
BASE_LABELS: Final = (LABEL_JOB, LABEL_RANK, LABEL_NODE)

# -- exporter ---------------------------------------------------------------------------------------
EXPORTER_INFO: Final = "torchrig_exporter_info"  # gauge 1: port, generation, local_rank, version
START_TIME: Final = "torchrig_start_time_seconds"  # gauge: unix time this worker process started

# -- progress and throughput ------------------------------------------------------------------------
STEP: Final = "torchrig_step"  # gauge: last completed optimizer step
LAST_STEP_TIMESTAMP: Final = "torchrig_last_step_timestamp_seconds"  # gauge (start time before step 1)
SAMPLES: Final = "torchrig_samples_total"  # counter: samples this rank processed
TOKENS: Final = "torchrig_tokens_total"  # counter: tokens this rank processed
SAMPLES_PER_SECOND: Final = "torchrig_samples_per_second"  # gauge: EMA of this rank's samples/s
TOKENS_PER_SECOND: Final = "torchrig_tokens_per_second"  # gauge: EMA of this rank's tokens/s
STEP_DURATION: Final = "torchrig_step_duration_seconds"  # histogram
DATA_WAIT: Final = "torchrig_data_wait_seconds_total"  # counter
DATA_WAIT_LAST: Final = "torchrig_data_wait_last_seconds"  # gauge: wait of the last step
COMM: Final = "torchrig_comm_seconds_total"  # counter: time in gradient collectives
COMM_RATIO: Final = "torchrig_comm_ratio"  # gauge: EMA of comm_s / step_s
MFU: Final = "torchrig_mfu_ratio"  # gauge: model FLOPs utilisation (only when FLOPs and peak are known)
PEAK_FLOPS: Final = "torchrig_device_peak_flops"  # gauge: peak FLOP/s used for MFU
LOSS: Final = "torchrig_loss"  # gauge
LEARNING_RATE: Final = "torchrig_learning_rate"  # gauge
GRAD_NORM: Final = "torchrig_grad_norm"  # gauge
WORLD_SIZE: Final = "torchrig_world_size"  # gauge
RESTART_GENERATION: Final = "torchrig_restart_generation"  # gauge: elastic restart count
RESTARTS_MAX: Final = "torchrig_restarts_max"  # gauge: restart budget from the spec

# -- checkpoints ------------------------------------------------------------------------------------
CHECKPOINT_LAST_STEP: Final = "torchrig_checkpoint_last_step"  # gauge: newest committed (or restored) step
CHECKPOINT_LAST_TIMESTAMP: Final = "torchrig_checkpoint_last_timestamp_seconds"  # gauge
CHECKPOINT_INTERVAL_STEPS: Final = "torchrig_checkpoint_interval_steps"  # gauge from the spec (if set)
CHECKPOINT_INTERVAL_SECONDS: Final = "torchrig_checkpoint_interval_seconds"  # gauge from the spec (if set)
CHECKPOINTS_COMMITTED: Final = "torchrig_checkpoints_committed_total"  # counter
CHECKPOINT_SAVE_DURATION: Final = "torchrig_checkpoint_save_duration_seconds"  # histogram: staged -> committed
CHECKPOINT_BLOCKED: Final = "torchrig_checkpoint_blocked_seconds"  # histogram: training stalled by a save
CHECKPOINT_BYTES: Final = "torchrig_checkpoint_size_bytes"  # gauge: size of the last save (this rank)
STORE_FAILURES: Final = "torchrig_store_failures_total"  # counter by store
RESTORES: Final = "torchrig_restores_total"  # counter by source
RESTORE_DURATION: Final = "torchrig_restore_duration_seconds"  # gauge: last restore

# -- stragglers (every logEvery steps, training.metrics.straggler) -----------------------------------
RANK_SLOWDOWN = "torchrig_rank_slowdown_ratio"  # gauge: this rank's compute time over the median rank's
STRAGGLER_RANK = "torchrig_straggler_rank"  # gauge: the slowest rank over metrics.stragglerThreshold, else -1

# -- hang detection (the step watchdog, training.watchdog) -------------------------------------------
STEP_DEADLINE: Final = "torchrig_step_deadline_seconds"  # gauge by phase: how long a rank may be silent

# -- silent data corruption (training.sdc) ---------------------------------------------------------
SDC_DETECTED: Final = "torchrig_sdc_detected_total"  # counter (rank 0) by evidence: fingerprints disagreed
LABEL_EVIDENCE: Final = "evidence"  # which fingerprints differed: one of SDC_EVIDENCE
SDC_EVIDENCE: Final = ("replica", "recompute")  # parameters + optimizer state; a recomputed pre-reduce gradient

# -- evaluation and events --------------------------------------------------------------------------
EVAL_METRIC: Final = "torchrig_eval_metric"  # gauge by metric
EVENTS: Final = "torchrig_events_total"  # counter by event (fixed set)

# -- GPUs (NVML, read at scrape time) --------------------------------------------------------------
GPU_AVAILABLE: Final = "torchrig_gpu_available"  # gauge 1/0: NVML answered
GPU_INFO: Final = "torchrig_gpu_info"  # gauge 1 by gpu, model
GPU_UTILIZATION: Final = "torchrig_gpu_utilization_ratio"
GPU_MEMORY_USED: Final = "torchrig_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL: Final = "torchrig_gpu_memory_total_bytes"
GPU_POWER: Final = "torchrig_gpu_power_watts"
GPU_TEMPERATURE: Final = "torchrig_gpu_temperature_celsius"

# Events counted in `torchrig_events_total` under their own name; any other counts as `other`
# (bounded cardinality). Strings, not `EventKind`s: a set lookup of a plain `str` must find them.
OTHER_EVENT: Final = "other"
EVENT_NAMES: Final = frozenset(
    {
        str(EventKind.WATCHDOG),
        str(EventKind.FAULT),
        str(EventKind.FINISHED),
        str(EventKind.STRAGGLER),
        str(EventKind.STACKS),
        str(EventKind.SDC),
        OTHER_EVENT,
    }
)

# Histogram buckets. Steps run from milliseconds (tiny models on CPU) to minutes (huge models).
STEP_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CHECKPOINT_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

HISTOGRAMS: Final = frozenset({STEP_DURATION, CHECKPOINT_SAVE_DURATION, CHECKPOINT_BLOCKED})


def all_metric_names() -> frozenset[str]:
    """Every metric family name defined above (histograms without their `_bucket/_sum/_count` suffixes)."""
    return frozenset(
        value
        for key, value in globals().items()
        if key.isupper() and isinstance(value, str) and value.startswith(PREFIX) and key != "PREFIX"
    )


def series_names() -> frozenset[str]:
    """Every sample name that can appear in the exposition (histograms expanded to their suffixes)."""
    names = set(all_metric_names())
    for hist in HISTOGRAMS:
        names |= {hist + "_bucket", hist + "_sum", hist + "_count"}
    return frozenset(names)
