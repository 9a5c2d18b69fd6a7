"""`metrics.profile`: who captures, what the spec accepts, and a window cut short by the end of training.
The capture itself (trace, table, event, unchanged weights) runs in tests/integration/test_worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from training.config import MetricsConfig, ProfileConfig
from training.contract import RunFiles, WorkerIdentity
from training.metrics.base import MetricsSink
from training.profiling import create_step_profiler


class _Events(MetricsSink):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []

    def on_event(self, kind: object, **fields: object) -> None:
        self.events.append((str(kind), fields))


def test_only_the_named_ranks_with_a_run_directory_profile(tmp_path: Path) -> None:
    cfg = ProfileConfig(start_step=10, steps=3, ranks=[0, 2])
    sink = MetricsSink()
    for rank, expected in ((0, True), (1, False), (2, True)):
        identity = WorkerIdentity(rank=rank, world_size=4, run_dir=str(tmp_path))
        assert (create_step_profiler(cfg, identity, sink, cuda=False) is not None) is expected
    assert create_step_profiler(cfg, WorkerIdentity(rank=0, run_dir=None), sink, cuda=False) is None
    assert create_step_profiler(None, WorkerIdentity(rank=0, run_dir=str(tmp_path)), sink, cuda=False) is None


def test_the_spec_names_the_field_of_a_bad_window() -> None:
    assert MetricsConfig().profile is None  # off unless asked for
    parsed = MetricsConfig.model_validate({"profile": {"startStep": 5}})
    assert parsed.profile == ProfileConfig(start_step=5, steps=5, ranks=[0])
    for bad, field in (({"startStep": 0}, "startStep"), ({"startStep": 3, "steps": 0}, "steps"), ({}, "startStep")):
        with pytest.raises(ValidationError, match=field):
            MetricsConfig.model_validate({"profile": bad})


def test_the_window_opens_and_closes_on_its_steps_only_once(tmp_path: Path) -> None:
    sink = _Events()
    profiler = create_step_profiler(
        ProfileConfig(start_step=2, steps=2), WorkerIdentity(rank=0, run_dir=str(tmp_path)), sink, cuda=False
    )
    assert profiler is not None
    for step in range(1, 6):
        profiler.before_step(step)
        torch.ones(8) @ torch.ones(8)
        profiler.after_step(step)
    assert [(kind, f["first_step"], f["last_step"]) for kind, f in sink.events] == [("profile", 2, 3)]
    assert RunFiles(tmp_path).profile_table(0, 0).read_text().startswith("torchrig profile: rank 0, generation 0")
    # A run that ends inside its window writes nothing and leaves no profiler running.
    sink2 = _Events()
    cut = create_step_profiler(
        ProfileConfig(start_step=2, steps=10), WorkerIdentity(rank=0, run_dir=str(tmp_path / "cut")), sink2, cuda=False
    )
    assert cut is not None
    cut.before_step(2)
    cut.after_step(2)
    cut.close()
    assert sink2.events == [] and not (tmp_path / "cut" / "profile").exists()
    assert torch.autograd.profiler._is_profiler_enabled is False  # type: ignore[attr-defined]
