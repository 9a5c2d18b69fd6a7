"""A checkpoint's non-tensor values are read as plain data only: a hostile store cannot run code on a
restoring rank through DCP's byte items (DCP's own planner unpickles them with weights_only=False)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from training.checkpoint.restore import SafeLoadPlanner

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _touch(path: str) -> int:
    Path(path).write_text("code ran")
    return 0


class Payload:
    """Unpickling this object calls `_touch` (what a hostile store would put in a byte item)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (_touch, (self.path,))


def _save(tmp_path: Path, value: Any) -> Path:
    ckpt = tmp_path / "ckpt"
    state = {"w": torch.arange(4.0), "progress": {"step": 7, "loss": 0.5, "extra": value}}
    dcp.save(state, checkpoint_id=ckpt, no_dist=True)
    return ckpt


def test_plain_values_load_as_before(tmp_path: Path) -> None:
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "amsgrad": False, "foreach": None, "params": [0, 1]}]
    ckpt = _save(tmp_path, groups)
    template = [{**groups[0], "lr": 0.0, "betas": (0.0, 0.0), "amsgrad": True}]
    state: dict[str, Any] = {"w": torch.zeros(4), "progress": {"step": 0, "loss": 0.0, "extra": template}}
    dcp.load(state, checkpoint_id=ckpt, planner=SafeLoadPlanner(), no_dist=True)
    assert torch.equal(state["w"], torch.arange(4.0))
    assert state["progress"] == {"step": 7, "loss": 0.5, "extra": groups}


def test_an_object_in_a_byte_item_fails_the_load_without_running_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = _save(tmp_path, Payload(str(marker)))
    assert not marker.exists(), "saving runs nothing"
    state: dict[str, Any] = {"w": torch.zeros(4), "progress": {"step": 0, "loss": 0.0, "extra": None}}
    with pytest.raises(CheckpointException) as failed:
        dcp.load(state, checkpoint_id=ckpt, planner=SafeLoadPlanner(), no_dist=True)
    assert "Weights only load failed" in repr(failed.value.failures), failed.value.failures
    assert not marker.exists(), "the hostile payload never ran"
    # The planner is what protects: DCP's default one runs it.
    dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    assert marker.exists() and os.path.getsize(marker) > 0
