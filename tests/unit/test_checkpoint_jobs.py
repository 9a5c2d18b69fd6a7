"""Whose checkpoint it is (issue 13, point 2): restore takes only the job's own checkpoints and names the
foreign ones it skipped in one line; retention counts and deletes only the job's own; job-less manifests
are taken as the job's only in a store holding no other job's; `initFrom` warm-starts explicitly."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from tests.fixtures.checkpoint import assert_same, ckpt_identity, config, make_state, save_steps
from training.checkpoint import CheckpointError, CheckpointManager, list_checkpoints, open_storage, read_manifest
from training.checkpoint.manifest import MANIFEST_NAME, step_dir
from training.config import CheckpointConfig
from training.contract import WorkerIdentity

pytestmark = pytest.mark.timeout(120)


def job(tmp_path: Path, name: str, generation: int = 0) -> WorkerIdentity:
    return ckpt_identity(tmp_path / f"run-{name}", generation=generation, run_id=name, job=name)


def steps_of(uri: str, name: str | None = None) -> list[int]:
    listing = list_checkpoints(open_storage(uri))
    return [c.step for c in listing if c.manifest is not None and (name is None or c.manifest.job == name)]


def whose_lines(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


def test_resume_skips_another_jobs_checkpoints_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = str(tmp_path / "shared")
    a = CheckpointManager(config(shared), job(tmp_path, "a"))
    a_states = save_steps(a, [1, 2])
    a.close()
    with pytest.raises(CheckpointError, match="of this job"):
        CheckpointManager(config(shared, resume="required"), job(tmp_path, "b")).restore(make_state(0))
    caplog.set_level(logging.INFO, logger="training.checkpoint")
    caplog.clear()
    b = CheckpointManager(config(shared), job(tmp_path, "b"))
    target = make_state(7)
    assert b.restore(target) is None  # job a's weights are not job b's
    assert target["progress"].step == 7
    assert whose_lines(caplog, "other jobs' checkpoints") == [
        "restore skipped other jobs' checkpoints (not job b): s0: job a steps 1-2 (2)"
    ]
    save_steps(b, [3])
    save_steps(b, [2])  # job a's step 2 is not overwritten
    b.close()
    assert b.history[-2].committed and not b.history[-1].committed
    assert "committed by job a" in b.history[-1].stores_failed["s0"]
    assert read_manifest(open_storage(shared), 2).job == "a"
    target = make_state(0)
    result = CheckpointManager(config(shared), job(tmp_path, "a", 1)).restore(target)
    assert result is not None and result.step == 2  # job b's newer step 3 is not job a's either
    assert_same(target, a_states[2])


def test_retention_counts_and_deletes_only_this_jobs_checkpoints(tmp_path: Path) -> None:
    shared = str(tmp_path / "shared")
    earlier = CheckpointManager(config(shared, keep=3), job(tmp_path, "earlier"))
    save_steps(earlier, [4800, 4900, 5000])
    earlier.close()
    new = CheckpointManager(config(shared, keep=3), job(tmp_path, "new"))
    assert new.restore(make_state(0)) is None
    for step in (100, 200, 300, 400):
        save_steps(new, [step])
        assert new.history[-1].committed
        assert step in steps_of(shared, "new")  # the step just committed is never deleted
    new.close()
    assert steps_of(shared, "new") == [400, 300, 200]
    assert steps_of(shared, "earlier") == [5000, 4900, 4800]


def test_debris_of_another_job_is_left_alone(tmp_path: Path) -> None:
    shared = str(tmp_path / "shared")
    other = CheckpointManager(config(shared, keep=1), job(tmp_path, "other"))
    save_steps(other, [5])
    other_gen = read_manifest(open_storage(shared), 5).generation
    mine = CheckpointManager(config(shared, keep=1), job(tmp_path, "mine"))
    save_steps(mine, [10])
    my_gen = read_manifest(open_storage(shared), 10).generation
    # an uncommitted save of each job, older than anything kept: only this job's is debris
    (tmp_path / "shared" / step_dir(1) / f"gen-{other_gen:04d}").mkdir(parents=True)
    (tmp_path / "shared" / step_dir(2) / f"gen-{my_gen:04d}").mkdir(parents=True)
    save_steps(mine, [20])
    mine.close()
    other.close()
    remaining = sorted(p.name for p in (tmp_path / "shared").iterdir() if p.name.startswith("step-"))
    assert remaining == [step_dir(1), step_dir(5), step_dir(20)]


def _strip_job(uri: str, step: int) -> None:
    """Rewrite a manifest as a version without a job field would have written it."""
    path = Path(uri) / step_dir(step) / MANIFEST_NAME
    manifest = read_manifest(open_storage(uri), step)
    raw = dataclasses.asdict(manifest)
    del raw["job"]
    import json

    path.write_text(json.dumps(raw))


def test_job_less_manifests_are_this_jobs_only_in_a_store_of_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = str(tmp_path / "s")
    old = CheckpointManager(config(store), job(tmp_path, "j"))
    states = save_steps(old, [1])
    old.close()
    _strip_job(store, 1)
    caplog.set_level(logging.INFO, logger="training.checkpoint")
    target = make_state(0)
    result = CheckpointManager(config(store), job(tmp_path, "j", 1)).restore(target)
    assert result is not None and result.step == 1
    assert_same(target, states[1])
    assert len(whose_lines(caplog, "without a job name")) == 1
    # once another job's checkpoint is in the store, nobody can tell whose it was: it is skipped
    other = CheckpointManager(config(store), job(tmp_path, "x"))
    save_steps(other, [9])
    other.close()
    caplog.clear()
    assert CheckpointManager(config(store), job(tmp_path, "j", 2)).restore(make_state(0)) is None
    assert whose_lines(caplog, "other jobs' checkpoints") == [
        "restore skipped other jobs' checkpoints (not job j): s0: job ? step 1; s0: job x step 9"
    ]


def _model_only(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state["model"].items()}


@pytest.mark.parametrize("mode", ["weights", "full"])
def test_init_from_another_job_only_while_the_job_has_none_of_its_own(tmp_path: Path, mode: str) -> None:
    source = str(tmp_path / "pretrain")
    a = CheckpointManager(config(source), job(tmp_path, "pretrain"))
    a_states = save_steps(a, [3, 5])
    a.close()
    mine = str(tmp_path / "mine")
    cfg = config(mine, initFrom={"uri": source, "mode": mode})
    b = CheckpointManager(cfg, job(tmp_path, "finetune"))
    target = make_state(42)
    result = b.restore(target)
    assert result is not None and (result.step, result.source, result.store) == (5, "init", "init")
    assert all(torch.equal(target["model"][k], v) for k, v in _model_only(a_states[5]).items())
    assert target["progress"].step == (5 if mode == "full" else 42)  # weights: progress stays fresh
    assert b.last_committed_step is None
    save_steps(b, [6])
    b.close()
    assert steps_of(mine) == [6] and steps_of(source) == [5, 3]
    # restarted: its own checkpoint wins over initFrom
    again = CheckpointManager(cfg, job(tmp_path, "finetune", 1))
    target = make_state(0)
    result = again.restore(target)
    assert result is not None and (result.step, result.source) == (6, "store")


def test_init_from_a_fixed_step_and_a_missing_one(tmp_path: Path) -> None:
    source = str(tmp_path / "pretrain")
    a = CheckpointManager(config(source, keep=5), job(tmp_path, "pretrain"))
    a_states = save_steps(a, [3, 5])
    a.close()
    cfg = config(str(tmp_path / "mine"), initFrom={"uri": source, "step": 3, "mode": "full"})
    target = make_state(0)
    result = CheckpointManager(cfg, job(tmp_path, "ft")).restore(target)
    assert result is not None and result.step == 3
    assert_same(target, a_states[3])
    cfg = config(str(tmp_path / "mine2"), initFrom={"uri": source, "step": 4})
    with pytest.raises(CheckpointError, match=r"initFrom: no valid checkpoint step 4 in"):
        CheckpointManager(cfg, job(tmp_path, "ft2")).restore(make_state(0))


def test_init_from_is_validated() -> None:
    with pytest.raises(ValidationError, match="resume: auto"):
        CheckpointConfig.model_validate({"initFrom": {"uri": "s3://b/p"}, "resume": "required"})
    with pytest.raises(ValidationError, match="unsupported scheme"):
        CheckpointConfig.model_validate({"initFrom": {"uri": "ftp://host/x"}})
    with pytest.raises(ValidationError, match="mode"):
        CheckpointConfig.model_validate({"initFrom": {"uri": "s3://b/p", "mode": "optimizer"}})
    with pytest.raises(ValidationError):
        CheckpointConfig.model_validate({"initFrom": {"uri": "s3://b/p", "step": -1}})
    cfg = CheckpointConfig.model_validate({"initFrom": {"uri": "s3://b/p", "step": 7}, "resume": "never"})
    assert cfg.init_from is not None and cfg.init_from.mode.value == "weights" and cfg.init_from.step == 7
