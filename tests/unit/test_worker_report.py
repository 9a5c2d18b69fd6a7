"""`WorkerReport`: rank 0's result and summary events, carried to a driver whose run directory is not
rank 0's (a RayJob's head), give the same summary.json as rank 0's own run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator.rundir import build_summary
from training.contract import Result, RunFiles, WorkerReport, read_jsonl

STORES = [{"name": "local", "uri": "file:///pvc/checkpoints"}, {"name": "s3", "uri": "s3://b/p"}]
# Rank 0 and rank 1 of a worker pod, three generations, 60 checkpoint commits (s3 failing from step 400).
EVENTS: list[dict[str, Any]] = [
    {"time": 1.0, "rank": 0, "generation": 0, "event": "start", "world_size": 2, "node": "w0"},
    {"time": 1.0, "rank": 1, "generation": 0, "event": "start", "world_size": 2, "node": "w0"},
    *(
        {
            "time": 2.0 + i / 100,
            "rank": 0,
            "generation": 0,
            "event": "checkpoint_committed",
            "step": 10 * (i + 1),
            "stores_ok": ["local", "s3"] if 10 * (i + 1) < 400 else ["local"],
        }
        for i in range(60)
    ),
    {"time": 3.0, "rank": 0, "generation": 1, "event": "start", "world_size": 1, "node": "w0"},
    {"time": 3.5, "rank": 0, "generation": 1, "event": "restore", "step": 600, "store": "local", "seconds": 0.1},
    {"time": 3.5, "rank": 1, "generation": 1, "event": "restore", "step": 600, "store": "local", "seconds": 0.1},
    {"time": 3.6, "rank": 0, "generation": 1, "event": "step_times", "step": 610, "step_s": 0.1},
    {"time": 4.0, "rank": 0, "generation": 2, "event": "start", "world_size": 2, "node": "w0"},
]
RESULT = Result(
    steps=640, final_loss=0.25, eval={"accuracy": 0.97}, params_sha256="ab", world_size=2, samples_per_s=9.5
)


def _worker_run_dir(root: Path) -> Path:
    root.mkdir()
    (root / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    (root / "metrics.jsonl").write_text(json.dumps({"step": 630, "loss": 0.3}) + "\n")
    RESULT.write(RunFiles(root).result)
    return root


def _summary(run_dir: Path) -> dict[str, Any]:
    summary = build_summary(run_dir, status="succeeded", wall_s=1.0, stores=STORES, total_steps=640).to_dict()
    summary.pop("run_dir")
    return summary


def test_the_driver_gets_the_summary_of_rank_zeros_run_directory(tmp_path: Path) -> None:
    worker = _worker_run_dir(tmp_path / "worker")
    report = WorkerReport.collect(worker, result=Result.read(RunFiles(worker).result))
    # Through Ray as plain data: JSON-able, and back.
    carried = WorkerReport.from_dict(json.loads(json.dumps(report.to_dict())))
    head = tmp_path / "head"
    head.mkdir()
    assert carried.write_into(head) is True
    assert _summary(head) == _summary(worker)
    assert _summary(head)["checkpoints"] == [
        {**STORES[0], "last_committed_step": 600},
        {**STORES[1], "last_committed_step": 390},
    ]
    assert Result.read(RunFiles(head).result) == RESULT
    # Only rank 0's summary events travel, and of the commits only each store's newest.
    assert len(carried.events) == 3 + 1 + 2
    assert read_jsonl(RunFiles(head).metrics) == [{"step": 630, "loss": 0.3}]


def test_rank_zeros_own_run_directory_is_left_alone(tmp_path: Path) -> None:
    worker = _worker_run_dir(tmp_path / "worker")
    before = {p.name: p.read_text() for p in worker.iterdir()}
    report = WorkerReport.collect(worker, result=RESULT)
    assert report.write_into(worker) is False
    assert {p.name: p.read_text() for p in worker.iterdir()} == before


def test_a_failed_run_in_a_shared_directory_gets_no_duplicate_lines(tmp_path: Path) -> None:
    worker = _worker_run_dir(tmp_path / "worker")
    RunFiles(worker).result.unlink()  # rank 0 raised: no result.json
    events_before = RunFiles(worker).events.read_text()
    report = WorkerReport.collect(worker, result=None)
    assert report.result is None and report.last_metrics == {"step": 630, "loss": 0.3}
    assert report.write_into(worker) is True
    assert RunFiles(worker).events.read_text() == events_before
    assert not RunFiles(worker).result.exists()


def test_a_report_from_an_older_or_foreign_writer_is_read_leniently() -> None:
    report = WorkerReport.from_dict({"result": {"final_loss": 1.0}, "events": ["x", {"event": "start"}], "extra": 1})
    assert report.result is None and report.events == [{"event": "start"}] and report.last_metrics is None
