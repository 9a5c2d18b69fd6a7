"""Data parallelism changes nothing but speed: DDP, FSDP2 and HSDP on 2 ranks end with the same full
parameters (float32 tolerance) as one process with the same global batch (gradient clipping active)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_worker import DIGITS, TINYGPT, _ok, final_checkpoint, run_single, run_torchrun, write_spec


def _params(run_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    model: dict[str, torch.Tensor] = final_checkpoint(run_dir, tmp)["app"]["model"]
    return model


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("strategy", "task", "extra"),
    [
        ("ddp", DIGITS, {}),
        ("fsdp", TINYGPT, {"activation_checkpointing": True}),
        ("hsdp", TINYGPT, {}),
    ],
)
def test_two_ranks_match_one_process(
    tmp_path: Path, strategy: str, task: tuple[str, dict[str, Any]], extra: dict[str, Any]
) -> None:
    common = {"task": task, "steps": 8, "grad_accumulation": 2, "grad_clip": 0.05, "eval_at_end": False, **extra}
    single_spec = write_spec(tmp_path / "single.yaml", batch_size=8, **common)
    multi_spec = write_spec(tmp_path / "multi.yaml", batch_size=4, strategy=strategy, **common)
    _ok(run_single(single_spec, tmp_path / "single"))
    _ok(run_torchrun(multi_spec, tmp_path / "multi"))
    ref, got = _params(tmp_path / "single", tmp_path), _params(tmp_path / "multi", tmp_path)
    assert sorted(ref) == sorted(got)
    moved = 0
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
        moved += int(not torch.equal(ref[key], _params_at_init(task)[key]))
    assert moved == len(ref)  # every tensor trained (a frozen model would match trivially)


_INIT: dict[str, dict[str, torch.Tensor]] = {}


def _params_at_init(task: tuple[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    from training.task import load_task

    if task[0] not in _INIT:
        torch.manual_seed(0)  # the worker seeds with training.seed before build_model
        _INIT[task[0]] = load_task(task[0], task[1]).build_model().state_dict()
    return _INIT[task[0]]
