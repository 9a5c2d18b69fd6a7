"""The bench's sections, by name, in the order `python -m bench` runs them.

Each module measures one thing against its peer in the same run and returns a JSON-able dict; its
`Section` says where that dict goes in bench/results/latest.json, and bench/report.py turns the
results into latest.md and the plots. The section modules import torch, Ray and the orchestrator
inside their functions only, so listing them here costs nothing.
"""

from __future__ import annotations

from bench.sections import (
    checkpoint_io,
    checkpoint_stall,
    exporter,
    gpu,
    inplace_scale,
    mttr,
    overhead,
    preempt,
    scaling,
    sdc,
    startup,
)
from bench.sections.base import Results, Section

__all__ = ["SECTIONS", "Results", "Section"]

SECTIONS: dict[str, Section] = {
    s.name: s
    for s in (
        overhead.SECTION,
        checkpoint_stall.SECTION,
        *checkpoint_io.SECTIONS,
        mttr.SECTION,
        inplace_scale.SECTION,
        exporter.SECTION,
        scaling.SECTION,
        gpu.SECTION,
        preempt.SECTION,
        startup.SECTION,
        sdc.SECTION,
    )
}
