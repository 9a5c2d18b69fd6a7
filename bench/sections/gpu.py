"""GPU: a placeholder here; the GPU figures come from the device machine (docs/performance.md)."""

from __future__ import annotations

from typing import Any

from bench.sections.base import Section


def bench_gpu() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine; see docs/performance.md for the device-tool procedure"}
    return {"skipped": "run bench/gpu.py on the GPU machine"}


SECTION = Section("gpu", lambda quick: bench_gpu())
