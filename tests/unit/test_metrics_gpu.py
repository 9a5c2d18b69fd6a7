"""GPU metrics through the injectable reader; without NVML: `torchrig_gpu_available 0` and no crash."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from tests.fixtures.prometheus import FakeGpuReader
from training.contract import WorkerIdentity
from training.metrics import names
from training.metrics.base import StepRecord
from training.metrics.gpu import GpuCollector, GpuSample, create_gpu_reader, visible_device_indices
from training.metrics.prometheus import PrometheusSink

BASE = ["j", "0", "h"]
LABELS = {"training_job": "j", "rank": "0", "node": "h"}


def registry_with(collector: GpuCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def test_values_and_labels_from_reader() -> None:
    reader = FakeGpuReader(count=2)
    registry = registry_with(GpuCollector(reader, BASE, devices=[1]))
    dev = {**LABELS, "gpu": "1"}
    assert registry.get_sample_value(names.GPU_AVAILABLE, LABELS) == 1
    assert registry.get_sample_value(names.GPU_UTILIZATION, dev) == 0.6
    assert registry.get_sample_value(names.GPU_MEMORY_USED, dev) == 11 * 2**30
    assert registry.get_sample_value(names.GPU_MEMORY_TOTAL, dev) == 80 * 2**30
    assert registry.get_sample_value(names.GPU_POWER, dev) == 301.0
    assert registry.get_sample_value(names.GPU_TEMPERATURE, dev) == 61.0
    assert registry.get_sample_value(names.GPU_INFO, {**dev, "model": "NVIDIA H100 80GB HBM3"}) == 1
    # only the devices asked for
    assert registry.get_sample_value(names.GPU_UTILIZATION, {**LABELS, "gpu": "0"}) is None


def test_all_devices_by_default_and_read_at_scrape_time() -> None:
    reader = FakeGpuReader(count=3)
    collector = GpuCollector(reader, BASE)
    registry = registry_with(collector)
    reads_after_register = reader.reads
    assert reads_after_register == 0  # registering (describe) does not touch NVML
    text = generate_latest(registry).decode()
    assert reader.reads == 3
    for i in range(3):
        assert f'gpu="{i}"' in text


def test_missing_fields_are_left_out() -> None:
    class PartialReader(FakeGpuReader):
        def read(self, index: int) -> GpuSample:
            return GpuSample(index=index, name="Some GPU", utilization_ratio=0.25)

    registry = registry_with(GpuCollector(PartialReader(count=1), BASE))
    dev = {**LABELS, "gpu": "0"}
    assert registry.get_sample_value(names.GPU_UTILIZATION, dev) == 0.25
    assert registry.get_sample_value(names.GPU_POWER, dev) is None


def test_no_reader_exports_unavailable() -> None:
    registry = registry_with(GpuCollector(None, BASE))
    assert registry.get_sample_value(names.GPU_AVAILABLE, LABELS) == 0
    text = generate_latest(registry).decode()
    assert names.GPU_UTILIZATION + "{" not in text


def test_failing_reader_never_breaks_a_scrape() -> None:
    class Broken(FakeGpuReader):
        def read(self, index: int) -> GpuSample:
            raise RuntimeError("GPU fell off the bus")

    registry = registry_with(GpuCollector(Broken(), BASE))
    for _ in range(2):
        assert registry.get_sample_value(names.GPU_AVAILABLE, LABELS) == 0


def test_create_gpu_reader_on_this_machine() -> None:
    # Without NVML (CPU machines) this is None, with it a working reader; it never raises.
    reader = create_gpu_reader()
    if reader is None:
        sink = PrometheusSink(WorkerIdentity(job="j", node="h"), gpu_reader=None)
        sink.on_step(StepRecord(1, 1.0, 1, 0, 0.1, 0.0, 0.0, 1, 0.1, 1.0))
        assert sink.registry.get_sample_value(names.GPU_AVAILABLE, LABELS) == 0
    else:
        assert reader.device_count() > 0
        sample = reader.read(0)
        assert sample.memory_total_bytes and sample.memory_total_bytes > 0
        reader.close()


def test_visible_device_indices() -> None:
    assert visible_device_indices(1, 8, env={}) == [1]
    assert visible_device_indices(1, 8, env={"CUDA_VISIBLE_DEVICES": "4,5"}) == [5]
    assert visible_device_indices(0, 8, env={"CUDA_VISIBLE_DEVICES": "GPU-abc"}) == [0]
    assert visible_device_indices(0, 2, env={"CUDA_VISIBLE_DEVICES": "7"}) == []
    assert visible_device_indices(0, 0, env={}) == []
