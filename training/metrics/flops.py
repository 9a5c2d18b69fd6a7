"""Peak FLOP/s of known accelerators, for model FLOPs utilisation (MFU).

MFU = model FLOPs of a step / step time / peak FLOP/s of the device. The peak is the dense (no
sparsity) bf16/fp16 tensor-core rate from the vendor's data sheet, matched by the NVML device name.
Unknown devices (and CPUs) have no peak, hence no MFU, unless `TORCHRIG_PEAK_FLOPS` sets one.
"""

from __future__ import annotations

import logging
import os

from training.contract import Env

__all__ = ["PEAK_FLOPS_TABLE", "peak_flops_for", "resolve_peak_flops"]

log = logging.getLogger(__name__)


# (substring of the NVML name, dense bf16 FLOP/s). Order matters: the first match wins, so the more
# specific names come first ("H100 PCIe" before "H100").
PEAK_FLOPS_TABLE: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIE", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM5 (NVML: "NVIDIA H100 80GB HBM3")
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("V100", 125e12),
)


def peak_flops_for(device_name: str) -> float | None:
    """The table's peak for an NVML device name (case-insensitive substring match), or None."""
    upper = device_name.upper()
    for key, flops in PEAK_FLOPS_TABLE:
        if key in upper:
            return flops
    return None


def resolve_peak_flops(device_name: str | None) -> float | None:
    """`TORCHRIG_PEAK_FLOPS` if set (a positive float), else the table's entry for `device_name`."""
    raw = os.environ.get(Env.PEAK_FLOPS, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = 0.0
        if value > 0:
            return value
        log.warning("%s=%r is not a positive number; ignored", Env.PEAK_FLOPS, raw)
    if device_name is None:
        return None
    return peak_flops_for(device_name)
