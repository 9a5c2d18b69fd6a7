"""The Prometheus exporter of one worker: a `MetricsSink` over its own `CollectorRegistry`.

Every rank serves `/metrics` on `metrics.port + local_rank`. A busy port never stops training: the
exporter logs once and tries further ports (stepping by the local world size, so it does not take a
neighbour rank's port), then an ephemeral one; the port it got is in `torchrig_exporter_info` and in
`self.port`.

`on_step` runs on the training thread every step, so it only accumulates into plain Python numbers
(totals, the newest record, the EMAs, the step-time histogram's bucket counts): no lock, no label
lookup, no prometheus-client call. The per-step families are registered through `_Scraped`, which
brings their prometheus-client objects (pre-bound label children) up to date when they are collected,
i.e. at scrape time: the exported values are those of the newest step, and the exposition is what
updating the objects every step gave. Cost per step: `training.metrics.bench`, docs/performance.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, start_http_server
from prometheus_client.registry import Collector

from training import __version__
from training.contract import Env, EventKind, RunFiles, WorkerIdentity
from training.contract.events import read_events
from training.metrics import names
from training.metrics.base import CheckpointRecord, MetricsSink, RestoreRecord, SlowdownRecord, StepRecord
from training.metrics.gpu import GpuCollector, GpuReader

__all__ = ["PORT_ATTEMPTS", "PrometheusSink", "default_bind_address", "prior_sdc_events"]

log = logging.getLogger(__name__)

PORT_ATTEMPTS = 16  # busy ports tried (port + local_rank + k * local_world_size) before an ephemeral one
EMA_ALPHA = 0.1  # smoothing of the throughput and communication-share gauges (~10-step memory)


def _ema(previous: float | None, value: float) -> float:
    return value if previous is None else EMA_ALPHA * value + (1.0 - EMA_ALPHA) * previous


class _Scraped(Collector):
    """A prometheus-client metric (registered through this, not itself) brought up to date by `sync`
    each time it is collected: what the training thread accumulated reaches it at scrape time."""

    def __init__(self, metric: Gauge | Counter, sync: Callable[[], None]) -> None:
        self._metric = metric
        self._sync = sync

    def describe(self) -> Iterable[Metric]:
        return self._metric.describe()

    def collect(self) -> Iterable[Metric]:
        self._sync()
        return self._metric.collect()


class _StepHistogram(Collector):
    """The step-duration histogram as plain counts (`observe` is two additions, no lock).

    Exported through the prometheus-client `Histogram` it was made from (its one pre-bound child never
    observes anything): its samples, `_created` included, with the bucket counts, count and sum
    replaced by these, so the exposition is the one the client object itself would give.
    """

    def __init__(self, histogram: Histogram, label_values: Sequence[str], buckets: Sequence[float]) -> None:
        self._histogram = histogram
        histogram.labels(*label_values)  # the series exists, at 0, from the start
        self.bounds = tuple(float(b) for b in buckets)  # without +Inf: index len(bounds) is +Inf
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value: `le` semantics
        self.sum += value

    def describe(self) -> Iterable[Metric]:
        return self._histogram.describe()

    def collect(self) -> Iterable[Metric]:
        cumulative = list(accumulate(list(self.counts)))
        total = self.sum
        metrics = self._histogram.collect()
        for metric in metrics:
            buckets = iter(cumulative)
            for i, sample in enumerate(metric.samples):
                if sample.name.endswith("_bucket"):
                    metric.samples[i] = sample._replace(value=float(next(buckets)))
                elif sample.name.endswith("_count"):
                    metric.samples[i] = sample._replace(value=float(cumulative[-1]))
                elif sample.name.endswith("_sum"):
                    metric.samples[i] = sample._replace(value=total)
        return metrics


def prior_sdc_events(path: str | os.PathLike[str], evidence: str = "replica") -> int:
    """How many `sdc` events of `evidence` an events.jsonl holds (0 when there is none yet; an event
    without the field, from before it existed, is a replica one)."""
    return sum(1 for e in read_events(path) if e.kind == EventKind.SDC and _evidence(e.get("evidence")) == evidence)


def _evidence(value: object) -> str:
    """An `sdc` event's evidence as a label value: one of a fixed set (untrusted input)."""
    return value if isinstance(value, str) and value in names.SDC_EVIDENCE else names.SDC_EVIDENCE[0]


def default_bind_address(configured: str | None) -> str:
    """`metrics.bindAddress`, else `TORCHRIG_METRICS_BIND` (local runs: 127.0.0.1), else all interfaces."""
    if configured:
        return configured
    return os.environ.get(Env.METRICS_BIND, "").strip() or "0.0.0.0"


class PrometheusSink(MetricsSink):
    """Exports a worker's progress, throughput, checkpoints and GPUs to Prometheus.

    Args:
        identity: who the worker is (labels: training job, rank, node).
        port: base port (`metrics.port`); the exporter tries `port + local_rank` first. None: no HTTP
            server (the registry can still be read, e.g. by tests or a push gateway).
        bind_address: address to listen on (see `default_bind_address`).
        peak_flops: peak FLOP/s of the device, for MFU (None: MFU not exported).
        gpu_reader: NVML reader (None: `torchrig_gpu_available 0`).
        gpu_devices: NVML indices this worker exports (default: all the reader sees).
        stores: checkpoint store names, so their failure counters exist (at 0) before the first failure.
        checkpoint_every_steps / checkpoint_every_seconds: the spec's save interval, for the overdue alert.
        restarts_max: the spec's restart budget.
    """

    def __init__(
        self,
        identity: WorkerIdentity,
        port: int | None = None,
        bind_address: str = "127.0.0.1",
        *,
        peak_flops: float | None = None,
        gpu_reader: GpuReader | None = None,
        gpu_devices: Sequence[int] | None = None,
        stores: Iterable[str] = (),
        checkpoint_every_steps: int | None = None,
        checkpoint_every_seconds: float | None = None,
        restarts_max: int | None = None,
    ) -> None:
        self.identity = identity
        self.registry = CollectorRegistry(auto_describe=True)
        self.peak_flops = peak_flops if peak_flops and peak_flops > 0 else None
        self.port: int | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        # Written by on_step (the training thread) only; read by _sync (scrapes, under _sync_lock).
        self._last: StepRecord | None = None
        self._samples_total = 0
        self._tokens_total = 0
        self._data_wait_total = 0.0
        self._comm_total = 0.0
        self._grad_norm_value: float | None = None  # the newest step's that had one
        self._ema_samples_s: float | None = None
        self._ema_tokens_s: float | None = None
        self._ema_comm: float | None = None
        self._ema_mfu: float | None = None
        # What _sync has applied to the prometheus-client objects.
        self._synced_last: StepRecord | None = None
        self._synced_totals = [0, 0, 0.0, 0.0]  # samples, tokens, data wait, comm
        self._sync_lock = threading.Lock()  # scrapes (and the rare on_start/on_restore), never on_step
        self._lock = threading.Lock()  # guards only close()
        self._closed = False
        self._grad_norm_child: Any = None
        self._mfu_child: Any = None
        self._slowdown_child: Any = None

        base = list(names.BASE_LABELS)
        self._base_values = [identity.job, str(identity.rank), identity.node]
        r = self.registry

        def gauge(name: str, doc: str, extra: Sequence[str] = (), *, per_step: bool = False) -> Gauge:
            # per_step: updated by _sync when scraped (registered at this point of the exposition)
            g = Gauge(name, doc, [*base, *extra], registry=None if per_step else r)
            if per_step:
                r.register(_Scraped(g, self._sync))
            return g

        def counter(name: str, doc: str, extra: Sequence[str] = (), *, per_step: bool = False) -> Counter:
            # prometheus-client appends `_total` itself; pass the family name.
            c = Counter(name.removesuffix("_total"), doc, [*base, *extra], registry=None if per_step else r)
            if per_step:
                r.register(_Scraped(c, self._sync))
            return c

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, base, buckets=buckets, registry=r)

        v = self._base_values
        self._info_gauge = gauge(
            names.EXPORTER_INFO,
            "1 per worker exporter: its port, restart generation, local rank and torchrig version.",
            [names.LABEL_PORT, names.LABEL_GENERATION, names.LABEL_LOCAL_RANK, names.LABEL_VERSION],
        )
        self._start_time = gauge(names.START_TIME, "Unix time this worker process started.").labels(*v)
        self._step = gauge(names.STEP, "Last completed optimizer step.", per_step=True).labels(*v)
        self._last_step_ts = gauge(
            names.LAST_STEP_TIMESTAMP,
            "Unix time of the last completed step (the worker's start before its first).",
            per_step=True,
        ).labels(*v)
        self._samples = counter(names.SAMPLES, "Samples processed by this rank.", per_step=True).labels(*v)
        self._tokens = counter(names.TOKENS, "Tokens processed by this rank.", per_step=True).labels(*v)
        self._samples_s = gauge(
            names.SAMPLES_PER_SECOND, "Smoothed (EMA) samples per second of this rank.", per_step=True
        ).labels(*v)
        self._tokens_s = gauge(
            names.TOKENS_PER_SECOND, "Smoothed (EMA) tokens per second of this rank.", per_step=True
        ).labels(*v)
        step_hist = Histogram(
            names.STEP_DURATION,
            "Wall time of an optimizer step on this rank.",
            base,
            buckets=names.STEP_BUCKETS,
            registry=None,  # exported through _StepHistogram
        )
        self._step_hist = _StepHistogram(step_hist, v, names.STEP_BUCKETS)
        r.register(self._step_hist)
        self._data_wait = counter(names.DATA_WAIT, "Time spent waiting for input batches.", per_step=True).labels(*v)
        self._data_wait_last = gauge(names.DATA_WAIT_LAST, "Input wait of the last step.", per_step=True).labels(*v)
        self._comm = counter(names.COMM, "Time spent in gradient collectives.", per_step=True).labels(*v)
        self._comm_ratio = gauge(
            names.COMM_RATIO, "Smoothed share of step time spent in gradient collectives (0..1).", per_step=True
        ).labels(*v)
        self._mfu = gauge(
            names.MFU, "Smoothed model FLOPs utilisation (0..1), when FLOPs and peak are known.", per_step=True
        )
        self._peak = gauge(names.PEAK_FLOPS, "Peak FLOP/s of the device used for MFU.")
        if self.peak_flops is not None:
            self._peak.labels(*v).set(self.peak_flops)
        self._loss = gauge(names.LOSS, "Training loss of the last step.", per_step=True).labels(*v)
        self._lr = gauge(names.LEARNING_RATE, "Learning rate of the last step.", per_step=True).labels(*v)
        self._grad_norm = gauge(
            names.GRAD_NORM, "Global gradient norm of the last step (before clipping).", per_step=True
        )
        self._world_size = gauge(names.WORLD_SIZE, "Number of ranks in the worker group.", per_step=True).labels(*v)
        self._generation = gauge(names.RESTART_GENERATION, "Elastic restart count of the worker group.").labels(*v)
        restarts_gauge = gauge(names.RESTARTS_MAX, "Restart budget of the job.")
        if restarts_max is not None:
            restarts_gauge.labels(*v).set(restarts_max)

        self._ckpt_step = gauge(
            names.CHECKPOINT_LAST_STEP, "Step of the newest committed (or restored) checkpoint."
        ).labels(*v)
        self._ckpt_ts = gauge(
            names.CHECKPOINT_LAST_TIMESTAMP,
            "Unix time the newest checkpoint committed (the worker's start until one commits); age = time() - this.",
        ).labels(*v)
        every_steps = gauge(names.CHECKPOINT_INTERVAL_STEPS, "Configured checkpoint interval in steps.")
        if checkpoint_every_steps is not None:
            every_steps.labels(*v).set(checkpoint_every_steps)
        every_seconds = gauge(names.CHECKPOINT_INTERVAL_SECONDS, "Configured checkpoint interval in seconds.")
        if checkpoint_every_seconds is not None:
            every_seconds.labels(*v).set(checkpoint_every_seconds)
        self._ckpt_committed = counter(names.CHECKPOINTS_COMMITTED, "Checkpoints committed.").labels(*v)
        self._ckpt_save = hist(
            names.CHECKPOINT_SAVE_DURATION, "Time from staging a checkpoint to its commit.", names.CHECKPOINT_BUCKETS
        ).labels(*v)
        self._ckpt_blocked = hist(
            names.CHECKPOINT_BLOCKED, "Time training was blocked by a checkpoint save.", names.CHECKPOINT_BUCKETS
        ).labels(*v)
        self._ckpt_bytes = gauge(names.CHECKPOINT_BYTES, "Bytes this rank wrote for its last checkpoint.").labels(*v)
        self._store_failures = counter(
            names.STORE_FAILURES, "Failed writes to (or reads from) a checkpoint store.", [names.LABEL_STORE]
        )
        for store in stores:
            self._store_failures.labels(*v, store)
        self._restores = counter(names.RESTORES, "Restores from a checkpoint.", [names.LABEL_SOURCE])
        self._restore_s = gauge(names.RESTORE_DURATION, "Duration of the last restore.").labels(*v)
        self._eval = gauge(names.EVAL_METRIC, "Held-out evaluation results.", [names.LABEL_METRIC])
        self._events = counter(names.EVENTS, "Worker events (watchdog, fault, finished, ...).", [names.LABEL_EVENT])
        self._slowdown = gauge(
            names.RANK_SLOWDOWN, "This rank's compute time over the median rank's, last logEvery window (1 = median)."
        )
        self._straggler = gauge(
            names.STRAGGLER_RANK, "The slowest rank when its slowdown exceeds metrics.stragglerThreshold, else -1."
        ).labels(*v)
        self._straggler.set(-1)
        self._deadline = gauge(
            names.STEP_DEADLINE,
            "The step watchdog's limit by phase: step and first_step (derived from the step times with "
            "restarts.hangDetection auto), collective (in place), checkpoint_io, recovery, startup, evaluation.",
            [names.LABEL_PHASE],
        )
        sdc = counter(
            names.SDC_DETECTED,
            "Silent data corruption found, by evidence: replica (sdc.every: parameters and optimizer state "
            "disagreed) or recompute (sdc.recomputeEvery: a pre-reduce gradient disagreed with its "
            "recomputation); rank 0 counts them.",
            [names.LABEL_EVIDENCE],
        )
        # Both series from the start, at 0: increase() sees the first detection of either kind.
        self._sdc = {evidence: sdc.labels(*v, evidence) for evidence in names.SDC_EVIDENCE}
        if identity.is_leader and identity.run_dir is not None:
            # The rank that finds a disagreement exits at once (exit 206), before a scrape sees its count: its
            # successor in the run directory starts from the `sdc` events there, so the counter still rises.
            for evidence, child in self._sdc.items():
                child.inc(prior_sdc_events(RunFiles(identity.run_dir).events, evidence))

        now = time.time()
        self._start_time.set(now)
        self._last_step_ts.set(now)
        self._ckpt_ts.set(now)
        self._world_size.set(identity.world_size)
        self._generation.set(identity.generation)

        # Always registered: without a reader it exports `torchrig_gpu_available 0`, which dashboards and
        # alerts can tell apart from an exporter that is down.
        self.registry.register(GpuCollector(gpu_reader, self._base_values, gpu_devices))

        if port is not None:
            self._serve(port, bind_address)
        self._set_info()

    # -- server -----------------------------------------------------------------------------------
    def _candidate_ports(self, base_port: int) -> list[int]:
        if base_port == 0:  # an ephemeral port was asked for (tests, several jobs on one host)
            return [0]
        first = base_port + self.identity.local_rank
        stride = max(1, self.identity.local_world_size)
        ports = [first + k * stride for k in range(PORT_ATTEMPTS)]
        return [p for p in ports if p <= 65535] + [0]

    def _serve(self, base_port: int, bind_address: str) -> None:
        first = base_port + self.identity.local_rank
        for candidate in self._candidate_ports(base_port):
            try:
                self._server, self._thread = start_http_server(candidate, addr=bind_address, registry=self.registry)
            except OSError as exc:
                if candidate == first:
                    log.warning(
                        "metrics port %d on %s is unavailable (%s); trying further ports", first, bind_address, exc
                    )
                continue
            self.port = int(self._server.server_port)
            if base_port and self.port != first:
                log.warning(
                    "metrics exporter of rank %d serves on port %d, not %d", self.identity.rank, self.port, first
                )
            return
        log.error("no port available for the metrics exporter on %s; metrics are not served", bind_address)

    def _set_info(self) -> None:
        self._info_gauge.clear()
        self._info_gauge.labels(
            *self._base_values,
            str(self.port if self.port is not None else ""),
            str(self.identity.generation),
            str(self.identity.local_rank),
            __version__,
        ).set(1)

    @property
    def url(self) -> str | None:
        """`http://host:port/metrics` of this exporter (host as bound), or None when not serving."""
        if self._server is None:
            return None
        host = self._server.server_address[0]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    # -- MetricsSink ------------------------------------------------------------------------------
    def on_start(self, identity: WorkerIdentity) -> None:
        # Series labels stay those of construction (rank and node identify a worker process); the
        # values that change across restarts are gauges.
        self.identity = identity
        self._sync()  # the steps before this one must not overwrite it at the next scrape
        self._world_size.set(identity.world_size)
        self._generation.set(identity.generation)
        self._set_info()

    def on_step(self, record: StepRecord) -> None:
        # The training thread, every step: plain arithmetic only (see the module docstring).
        self._last = record
        self._samples_total += record.samples
        self._tokens_total += record.tokens
        self._data_wait_total += record.data_wait_s
        self._comm_total += record.comm_s
        if record.grad_norm is not None:
            self._grad_norm_value = record.grad_norm
        step_s = record.step_s
        hist = self._step_hist  # _StepHistogram.observe, inlined
        hist.counts[bisect_left(hist.bounds, step_s)] += 1
        hist.sum += step_s
        if step_s > 0:
            self._ema_samples_s = _ema(self._ema_samples_s, record.samples / step_s)
            comm = record.comm_s / step_s
            self._ema_comm = _ema(self._ema_comm, min(comm, 1.0))
            if record.tokens:
                self._ema_tokens_s = _ema(self._ema_tokens_s, record.tokens / step_s)
            if self.peak_flops is not None and record.flops > 0:
                self._ema_mfu = _ema(self._ema_mfu, record.flops / step_s / self.peak_flops)

    def _sync(self) -> None:
        """Bring the per-step families up to date with what `on_step` accumulated (at scrape time)."""
        with self._sync_lock:
            last = self._last
            if last is not None and last is not self._synced_last:
                self._synced_last = last
                self._step.set(last.step)
                self._last_step_ts.set(last.time)
                self._data_wait_last.set(last.data_wait_s)
                self._loss.set(last.loss)
                self._lr.set(last.lr)
                self._world_size.set(last.world_size)
            if self._grad_norm_value is not None:
                if self._grad_norm_child is None:  # created on first use: no series until there is a value
                    self._grad_norm_child = self._grad_norm.labels(*self._base_values)
                self._grad_norm_child.set(self._grad_norm_value)
            totals = [self._samples_total, self._tokens_total, self._data_wait_total, self._comm_total]
            for counter, total, synced in zip(
                (self._samples, self._tokens, self._data_wait, self._comm), totals, self._synced_totals, strict=True
            ):
                if total != synced:
                    counter.inc(total - synced)
            self._synced_totals = totals
            if self._ema_samples_s is not None:
                self._samples_s.set(self._ema_samples_s)
            if self._ema_comm is not None:
                self._comm_ratio.set(self._ema_comm)
            if self._ema_tokens_s is not None:
                self._tokens_s.set(self._ema_tokens_s)
            if self._ema_mfu is not None:
                if self._mfu_child is None:
                    self._mfu_child = self._mfu.labels(*self._base_values)
                self._mfu_child.set(self._ema_mfu)

    def on_checkpoint(self, record: CheckpointRecord) -> None:
        if not record.committed:
            self._ckpt_blocked.observe(record.blocked_s)
            if record.bytes:
                self._ckpt_bytes.set(record.bytes)
            return
        self._ckpt_committed.inc()
        self._ckpt_step.set(record.step)
        self._ckpt_ts.set(record.time or time.time())
        if record.save_s is not None:
            self._ckpt_save.observe(record.save_s)
        if record.bytes:
            self._ckpt_bytes.set(record.bytes)

    def on_store_failure(self, store: str, error: str) -> None:
        self._store_failures.labels(*self._base_values, store).inc()

    def on_restore(self, record: RestoreRecord) -> None:
        self._restores.labels(*self._base_values, record.source).inc()
        self._restore_s.set(record.seconds)
        self._ckpt_step.set(record.step)
        self._sync()  # the steps before the restore must not overwrite its step at the next scrape
        self._step.set(record.step)

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._eval.labels(*self._base_values, key).set(float(value))

    def on_slowdown(self, record: SlowdownRecord) -> None:
        if 0 <= self.identity.rank < len(record.ratios):
            if self._slowdown_child is None:  # no series before the first window
                self._slowdown_child = self._slowdown.labels(*self._base_values)
            self._slowdown_child.set(record.ratios[self.identity.rank])
        self._straggler.set(record.straggler)

    def on_deadlines(self, deadlines: dict[str, float]) -> None:
        for phase, seconds in deadlines.items():  # a fixed set of phases (`training.watchdog`)
            self._deadline.labels(*self._base_values, phase).set(seconds)

    def on_event(self, event: EventKind | str, **fields: Any) -> None:
        label = str(event) if str(event) in names.EVENT_NAMES else names.OTHER_EVENT
        self._events.labels(*self._base_values, label).inc()
        if str(event) == str(EventKind.SDC):
            self._sdc[_evidence(fields.get("evidence"))].inc()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            server, self._server = self._server, None
        if server is not None:
            # `serve_forever` looks at its stop flag between polls, 0.5 s apart in prometheus_client: a listening
            # socket shut down is readable at once (its accept fails, which the loop ignores), so the loop comes
            # round to the flag within a millisecond instead of 0.25 s on average (measured: 0.20 s -> 0.001 s),
            # at the end of every trainer, before its host, agent and CLI can exit.
            with contextlib.suppress(OSError):
                server.socket.shutdown(socket.SHUT_RDWR)
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __repr__(self) -> str:
        return f"PrometheusSink(rank={self.identity.rank}, port={self.port})"
