"""Per-device GPU metrics through NVML, read when Prometheus scrapes (never on the training hot path).

The reader is an injectable interface (`GpuReader`) so tests use a fake one; `NvmlReader` is the real
one (`nvidia-ml-py`, imported lazily). Without NVML (a CPU machine: `nvmlInit()` raises
`NVMLError_LibraryNotFound`) `create_gpu_reader` logs once and returns None, and the collector exports
`torchrig_gpu_available 0` and nothing else about GPUs; training is unaffected.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from training.metrics import names

__all__ = ["GpuCollector", "GpuReader", "GpuSample", "NvmlReader", "create_gpu_reader", "visible_device_indices"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuSample:
    """One reading of one device. A field is None when the device does not report it."""

    index: int
    name: str
    utilization_ratio: float | None = None  # 0..1, share of time a kernel ran in the last sample period
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None


class GpuReader(Protocol):
    """What the collector needs from NVML (or from a fake in tests)."""

    def device_count(self) -> int:
        """Number of devices the reader can see."""

    def device_name(self, index: int) -> str:
        """Marketing name of a device, e.g. `NVIDIA H100 80GB HBM3`."""

    def read(self, index: int) -> GpuSample:
        """Read the current values of one device."""


class NvmlReader:
    """`GpuReader` over NVML. Construct through `create_gpu_reader`, which handles a missing NVML."""

    def __init__(self) -> None:
        import pynvml  # optional dependency (extra `gpu`)

        self._nvml: Any = pynvml
        pynvml.nvmlInit()

    def device_count(self) -> int:
        return int(self._nvml.nvmlDeviceGetCount())

    def device_name(self, index: int) -> str:
        name = self._nvml.nvmlDeviceGetName(self._nvml.nvmlDeviceGetHandleByIndex(index))
        return name.decode() if isinstance(name, bytes) else str(name)

    def read(self, index: int) -> GpuSample:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)

        # Each query can be unsupported on a given board (power on some consumer cards, say): a missing
        # field is left out instead of losing the whole device.
        def query(fn: Any, *args: Any) -> Any:
            try:
                return fn(handle, *args)
            except nvml.NVMLError:
                return None

        util = query(nvml.nvmlDeviceGetUtilizationRates)
        mem = query(nvml.nvmlDeviceGetMemoryInfo)
        power_mw = query(nvml.nvmlDeviceGetPowerUsage)
        temp = query(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
        return GpuSample(
            index=index,
            name=self.device_name(index),
            utilization_ratio=None if util is None else float(util.gpu) / 100.0,
            memory_used_bytes=None if mem is None else int(mem.used),
            memory_total_bytes=None if mem is None else int(mem.total),
            power_watts=None if power_mw is None else float(power_mw) / 1000.0,
            temperature_celsius=None if temp is None else float(temp),
        )

    def close(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


def create_gpu_reader() -> NvmlReader | None:
    """The NVML reader, or None (logged once) when nvidia-ml-py or the NVML library is missing."""
    try:
        import pynvml
    except ImportError:
        log.info("nvidia-ml-py is not installed: no GPU metrics (install torchrig[gpu])")
        return None
    try:
        reader = NvmlReader()
        if reader.device_count() == 0:
            log.info("NVML sees no GPU: no GPU metrics")
            return None
        return reader
    except pynvml.NVMLError as exc:
        log.info("NVML unavailable (%s): no GPU metrics", exc)
        return None


def visible_device_indices(local_rank: int, device_count: int, env: dict[str, str] | None = None) -> list[int]:
    """The NVML index of the device this local rank trains on.

    NVML numbers every device of the machine and ignores `CUDA_VISIBLE_DEVICES`, while torch numbers the
    visible ones; a rank uses visible device `local_rank`, so map it through the variable when it lists
    indices (UUIDs are left to the default: index `local_rank`).
    """
    env = dict(os.environ) if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        parts = [p.strip() for p in visible.split(",") if p.strip()]
        if parts and all(p.isdigit() for p in parts):
            index = int(parts[local_rank % len(parts)])
            return [index] if index < device_count else []
    if device_count == 0:
        return []
    return [local_rank % device_count]


class GpuCollector(Collector):
    """A custom collector: reads the devices when Prometheus scrapes this worker.

    Args:
        reader: NVML (or a fake); None means no GPU, exported as `torchrig_gpu_available 0`.
        base_labels: values of `names.BASE_LABELS` (training job, rank, node).
        devices: NVML indices to export (default: every device the reader sees).
    """

    def __init__(self, reader: GpuReader | None, base_labels: Sequence[str], devices: Sequence[int] | None = None):
        self.reader = reader
        self.base_labels = list(base_labels)
        self.devices = None if devices is None else list(devices)
        self._warned = False

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Describing without reading keeps registration free of NVML calls.
        yield from self._families()

    def _families(self) -> list[GaugeMetricFamily]:
        base = list(names.BASE_LABELS)
        dev = [*base, names.LABEL_GPU]
        return [
            GaugeMetricFamily(names.GPU_AVAILABLE, "1 when NVML answered on the last scrape, else 0.", labels=base),
            GaugeMetricFamily(
                names.GPU_INFO, "1 per exported device, labelled with its model.", labels=[*dev, names.LABEL_GPU_MODEL]
            ),
            GaugeMetricFamily(names.GPU_UTILIZATION, "Share of time a kernel ran on the device (0..1).", labels=dev),
            GaugeMetricFamily(names.GPU_MEMORY_USED, "Device memory in use, bytes.", labels=dev),
            GaugeMetricFamily(names.GPU_MEMORY_TOTAL, "Device memory in total, bytes.", labels=dev),
            GaugeMetricFamily(names.GPU_POWER, "Power draw of the device, watts.", labels=dev),
            GaugeMetricFamily(names.GPU_TEMPERATURE, "Temperature of the device, degrees Celsius.", labels=dev),
        ]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        available, info, util, used, total, power, temp = families = self._families()
        samples: list[GpuSample] = []
        if self.reader is not None:
            try:
                indices = self.devices if self.devices is not None else list(range(self.reader.device_count()))
                samples = [self.reader.read(i) for i in indices]
            except Exception as exc:  # a scrape must never fail because a device went away
                if not self._warned:
                    self._warned = True
                    log.warning("reading GPU metrics failed (%s); exporting torchrig_gpu_available 0", exc)
                samples = []
                available.add_metric(self.base_labels, 0.0)
                yield available
                return
        available.add_metric(self.base_labels, 1.0 if self.reader is not None else 0.0)
        for s in samples:
            labels = [*self.base_labels, str(s.index)]
            info.add_metric([*labels, s.name], 1.0)
            if s.utilization_ratio is not None:
                util.add_metric(labels, s.utilization_ratio)
            if s.memory_used_bytes is not None:
                used.add_metric(labels, float(s.memory_used_bytes))
            if s.memory_total_bytes is not None:
                total.add_metric(labels, float(s.memory_total_bytes))
            if s.power_watts is not None:
                power.add_metric(labels, s.power_watts)
            if s.temperature_celsius is not None:
                temp.add_metric(labels, s.temperature_celsius)
        yield from families
