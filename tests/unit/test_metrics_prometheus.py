"""PrometheusSink on its own registry (no HTTP server): what each record does to the exported values."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.prometheus import populated_sink
from training.contract import EventKind, WorkerIdentity
from training.contract.events import Fault
from training.metrics import names
from training.metrics.base import CheckpointRecord, RestoreRecord, StepRecord
from training.metrics.prometheus import PrometheusSink, default_bind_address

INFO = WorkerIdentity(
    job="j", rank=3, local_rank=1, node_rank=1, world_size=4, local_world_size=2, generation=2, node="h1"
)
LABELS = {"training_job": "j", "rank": "3", "node": "h1"}


def step(i: int, *, step_s: float = 0.1, samples: int = 32, tokens: int = 0, comm_s: float = 0.02, flops: float = 0.0):
    return StepRecord(
        step=i,
        loss=1.0 / i,
        samples=samples,
        tokens=tokens,
        step_s=step_s,
        data_wait_s=0.005,
        comm_s=comm_s,
        world_size=4,
        lr=0.01,
        time=1000.0 + i,
        flops=flops,
    )


def value(sink: PrometheusSink, name: str, **extra: str) -> float | None:
    return sink.registry.get_sample_value(name, {**LABELS, **extra})


def test_steps_update_counters_gauges_and_histogram() -> None:
    sink = PrometheusSink(INFO)
    for i in range(1, 11):
        sink.on_step(step(i, tokens=640))
    assert value(sink, names.SAMPLES) == 320
    assert value(sink, names.TOKENS) == 6400
    assert value(sink, names.STEP) == 10
    assert value(sink, names.LAST_STEP_TIMESTAMP) == 1010.0
    assert value(sink, names.LOSS) == pytest.approx(0.1)
    assert value(sink, names.LEARNING_RATE) == 0.01
    assert value(sink, names.WORLD_SIZE) == 4
    assert value(sink, names.RESTART_GENERATION) == 2
    assert value(sink, names.DATA_WAIT) == pytest.approx(0.05)
    assert value(sink, names.DATA_WAIT_LAST) == pytest.approx(0.005)
    assert value(sink, names.COMM) == pytest.approx(0.2)
    # constant 0.1 s steps of 32 samples: the EMA is exactly the rate
    assert value(sink, names.SAMPLES_PER_SECOND) == pytest.approx(320.0)
    assert value(sink, names.TOKENS_PER_SECOND) == pytest.approx(6400.0)
    assert value(sink, names.COMM_RATIO) == pytest.approx(0.2)
    assert value(sink, names.STEP_DURATION + "_count") == 10
    assert value(sink, names.STEP_DURATION + "_sum") == pytest.approx(1.0)
    assert value(sink, names.STEP_DURATION + "_bucket", le="0.1") == 10
    assert value(sink, names.STEP_DURATION + "_bucket", le="0.05") == 0


def test_throughput_ema_follows_a_slowdown() -> None:
    sink = PrometheusSink(INFO)
    for i in range(1, 21):
        sink.on_step(step(i, step_s=0.1))
    for i in range(21, 80):
        sink.on_step(step(i, step_s=0.2))
    assert value(sink, names.SAMPLES_PER_SECOND) == pytest.approx(160.0, rel=0.01)


def test_mfu_only_with_flops_and_peak() -> None:
    no_peak = PrometheusSink(INFO)
    no_peak.on_step(step(1, flops=1e12))
    assert value(no_peak, names.MFU) is None
    assert value(no_peak, names.PEAK_FLOPS) is None

    with_peak = PrometheusSink(INFO, peak_flops=100e12)
    with_peak.on_step(step(1, step_s=0.1))  # no FLOPs reported: no MFU
    assert value(with_peak, names.MFU) is None
    with_peak.on_step(step(2, step_s=0.1, flops=4e12))  # 40 TFLOP/s of 100
    assert value(with_peak, names.MFU) == pytest.approx(0.4)
    assert value(with_peak, names.PEAK_FLOPS) == 100e12


def test_last_step_and_checkpoint_time_start_at_process_start() -> None:
    before = time.time()
    sink = PrometheusSink(INFO)
    assert before <= value(sink, names.LAST_STEP_TIMESTAMP) <= time.time()
    assert before <= value(sink, names.CHECKPOINT_LAST_TIMESTAMP) <= time.time()
    assert value(sink, names.START_TIME) == value(sink, names.LAST_STEP_TIMESTAMP)


def test_checkpoint_staged_then_committed() -> None:
    sink = PrometheusSink(INFO)
    sink.on_checkpoint(CheckpointRecord(step=50, blocked_s=0.2, bytes=4096, time=2000.0))
    assert value(sink, names.CHECKPOINT_BLOCKED + "_count") == 1
    assert value(sink, names.CHECKPOINT_BLOCKED + "_sum") == pytest.approx(0.2)
    assert value(sink, names.CHECKPOINT_BYTES) == 4096
    assert value(sink, names.CHECKPOINTS_COMMITTED) == 0
    assert value(sink, names.CHECKPOINT_LAST_STEP) == 0

    sink.on_checkpoint(CheckpointRecord(step=50, blocked_s=0.2, save_s=3.0, committed=True, time=2003.0))
    assert value(sink, names.CHECKPOINTS_COMMITTED) == 1
    assert value(sink, names.CHECKPOINT_LAST_STEP) == 50
    assert value(sink, names.CHECKPOINT_LAST_TIMESTAMP) == 2003.0
    assert value(sink, names.CHECKPOINT_SAVE_DURATION + "_sum") == pytest.approx(3.0)
    # staging is counted once, not again at commit
    assert value(sink, names.CHECKPOINT_BLOCKED + "_count") == 1


def test_store_failure_counters_exist_at_zero_for_configured_stores() -> None:
    sink = PrometheusSink(INFO, stores=["local", "s3"])
    assert value(sink, names.STORE_FAILURES, store="local") == 0
    assert value(sink, names.STORE_FAILURES, store="s3") == 0
    sink.on_store_failure("s3", "boom")
    sink.on_store_failure("s3", "boom")
    sink.on_store_failure("other", "boom")
    assert value(sink, names.STORE_FAILURES, store="s3") == 2
    assert value(sink, names.STORE_FAILURES, store="other") == 1
    assert value(sink, names.STORE_FAILURES, store="local") == 0


def test_restore_eval_and_events() -> None:
    sink = PrometheusSink(INFO)
    sink.on_restore(RestoreRecord(step=120, store="local", seconds=1.25, source="node-local"))
    assert value(sink, names.RESTORES, source="node-local") == 1
    assert value(sink, names.RESTORE_DURATION) == 1.25
    assert value(sink, names.CHECKPOINT_LAST_STEP) == 120
    assert value(sink, names.STEP) == 120
    sink.on_eval(200, {"accuracy": 0.93, "loss": 0.2})
    assert value(sink, names.EVAL_METRIC, metric="accuracy") == pytest.approx(0.93)
    sink.on_event("watchdog")
    sink.on_event("some_new_event_name", x=1)  # unknown events share one bounded label value
    assert value(sink, names.EVENTS, event="watchdog") == 1
    assert value(sink, names.EVENTS, event="other") == 1
    assert value(sink, names.EVENTS, event="some_new_event_name") is None
    sink.emit(Fault(fault="kill", step=3, pid=1))  # a typed payload counts under its kind's name
    sink.on_event(EventKind.FINISHED, step=4)
    assert value(sink, names.EVENTS, event="fault") == 1
    assert value(sink, names.EVENTS, event="finished") == 1


def test_on_start_updates_generation_and_world_size() -> None:
    sink = PrometheusSink(INFO, restarts_max=5)
    new = WorkerIdentity(
        job="j", rank=3, local_rank=1, node_rank=1, world_size=6, local_world_size=2, generation=3, node="h1"
    )
    sink.on_start(new)
    assert value(sink, names.RESTART_GENERATION) == 3
    assert value(sink, names.WORLD_SIZE) == 6
    assert value(sink, names.RESTARTS_MAX) == 5
    info = sink.registry.get_sample_value(
        names.EXPORTER_INFO, {**LABELS, "port": "", "generation": "3", "local_rank": "1", "version": "0.1.0"}
    )
    assert info == 1


def test_registry_is_private_and_names_match_names_module() -> None:
    from prometheus_client import REGISTRY

    sink = populated_sink()
    exposed = {
        s.name for fam in text_string_to_metric_families(generate_latest(sink.registry).decode()) for s in fam.samples
    }
    # nothing leaked into the global registry
    assert not any(n.startswith(names.PREFIX) for n in (m.name for m in REGISTRY.collect()))
    allowed = names.series_names()
    created = {n for n in exposed if n.endswith("_created")}
    assert exposed - created <= allowed, exposed - created - allowed
    # every name the module defines is really exported by a populated sink
    families = {fam.name for fam in text_string_to_metric_families(generate_latest(sink.registry).decode())}
    expected = {n.removesuffix("_total") for n in names.all_metric_names()}
    assert expected <= families, expected - families
    for sample in (
        s for fam in text_string_to_metric_families(generate_latest(sink.registry).decode()) for s in fam.samples
    ):
        assert {"training_job", "rank", "node"} <= set(sample.labels), sample


def test_bind_address_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHRIG_METRICS_BIND", raising=False)
    assert default_bind_address(None) == "0.0.0.0"
    monkeypatch.setenv("TORCHRIG_METRICS_BIND", "127.0.0.1")
    assert default_bind_address(None) == "127.0.0.1"
    assert default_bind_address("10.1.2.3") == "10.1.2.3"


def test_no_server_without_port() -> None:
    sink = PrometheusSink(INFO)
    assert sink.port is None and sink.url is None
    sink.close()
    sink.close()


def test_scrapes_between_steps_see_the_newest_step_and_count_each_step_once() -> None:
    sink = PrometheusSink(INFO)
    for i in range(1, 6):  # a scrape after every step
        sink.on_step(step(i, step_s=0.02 * i))
        assert value(sink, names.STEP) == i
        assert value(sink, names.SAMPLES) == 32 * i
        assert value(sink, names.STEP_DURATION + "_count") == i
    for i in range(6, 11):  # steps nobody scraped
        sink.on_step(step(i, step_s=0.02 * i))
    assert value(sink, names.STEP) == 10
    assert value(sink, names.LAST_STEP_TIMESTAMP) == 1010.0
    assert value(sink, names.SAMPLES) == 320
    assert value(sink, names.DATA_WAIT) == pytest.approx(0.05)
    assert value(sink, names.STEP_DURATION + "_count") == 10
    assert value(sink, names.STEP_DURATION + "_sum") == pytest.approx(0.02 * 55)
    assert value(sink, names.STEP_DURATION + "_bucket", le="0.1") == 5  # 0.02 .. 0.1: `le` includes the bound
    assert value(sink, names.STEP_DURATION + "_bucket", le="+Inf") == 10


def test_step_histogram_exposition_is_the_client_histograms() -> None:
    from prometheus_client import CollectorRegistry, Histogram

    observed = [0.0, 0.005, 0.0051, 0.3, 599.0, 600.0, 601.0, 3.2e-4, 0.1]
    reference = CollectorRegistry()
    client = Histogram(
        names.STEP_DURATION, "Wall time of an optimizer step on this rank.", list(names.BASE_LABELS),
        buckets=names.STEP_BUCKETS, registry=reference,
    )  # fmt: skip
    sink = PrometheusSink(INFO)
    for i, seconds in enumerate(observed, start=1):
        client.labels(*LABELS.values()).observe(seconds)
        sink.on_step(step(i, step_s=seconds))

    def histogram_lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return [ln for ln in text.splitlines() if names.STEP_DURATION in ln and "_created" not in ln]

    labels_in_order = ",".join(f'{k}="{v}"' for k, v in sorted(LABELS.items()))
    assert labels_in_order in "\n".join(histogram_lines(sink.registry))
    assert histogram_lines(sink.registry) == histogram_lines(reference)


def test_restore_and_restart_are_not_overwritten_by_the_steps_before_them() -> None:
    sink = PrometheusSink(INFO)
    for i in range(1, 31):  # never scraped before the restore
        sink.on_step(step(i))
    sink.on_restore(RestoreRecord(step=20, store="local", seconds=0.5))
    restarted = WorkerIdentity(job="j", rank=3, local_rank=1, node_rank=1, world_size=6, local_world_size=2, node="h1")
    sink.on_start(restarted)
    assert value(sink, names.STEP) == 20
    assert value(sink, names.WORLD_SIZE) == 6
    assert value(sink, names.SAMPLES) == 30 * 32  # the steps before still count
    sink.on_step(step(21))
    assert value(sink, names.STEP) == 21 and value(sink, names.WORLD_SIZE) == 4


def test_on_step_takes_no_lock_a_scrape_holds() -> None:
    import threading

    sink = PrometheusSink(INFO)
    done = threading.Event()

    def steps() -> None:
        for i in range(1, 101):
            sink.on_step(step(i))
        done.set()

    with sink._sync_lock:  # a scrape in progress
        threading.Thread(target=steps, daemon=True).start()
        assert done.wait(10), "on_step waited for the scrape's lock"
    assert value(sink, names.STEP) == 100


def test_concurrent_scrapes_lose_and_double_count_nothing() -> None:
    import threading

    sink = PrometheusSink(INFO)
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            generate_latest(sink.registry)

    scrapers = [threading.Thread(target=scrape, daemon=True) for _ in range(2)]
    for t in scrapers:
        t.start()
    n = 20_000
    try:
        for i in range(1, n + 1):
            sink.on_step(step(i, tokens=3))
    finally:
        stop.set()
        for t in scrapers:
            t.join(10)
    assert value(sink, names.SAMPLES) == 32 * n
    assert value(sink, names.TOKENS) == 3 * n
    assert value(sink, names.STEP_DURATION + "_count") == n
    assert value(sink, names.STEP) == n
