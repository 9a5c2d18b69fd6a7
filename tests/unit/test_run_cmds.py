"""The run lifecycle CLI without launching anything: dry runs, bad input, status/list/logs/report over
run directories written by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from orchestrator.backends._local_procs import process_start_ticks
from orchestrator.backends._local_view import LiveProgress
from orchestrator.cli import cli
from orchestrator.summary_text import final_line, format_value
from training.contract import Env, Summary, write_json

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits-ddp.yaml"


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def make_run(root: Path, name: str, stamp: str, status: str | None, job: Path = EXAMPLE) -> Path:
    run_dir = root / name / stamp
    run_dir.mkdir(parents=True)
    (run_dir / "job.yaml").write_text(job.read_text())
    if status:
        write_json(run_dir / "summary.json", {"status": status, "steps": 7, "run_dir": str(run_dir)})
    return run_dir


def test_dry_run_shows_the_elastic_launch(tmp_path: Path) -> None:
    code, out, _ = invoke(
        "run", str(EXAMPLE), "--dry-run", "--nodes", "2", "--run-dir", str(tmp_path / "r"), "-o", "json"
    )
    assert code == 0
    plan = json.loads(out)
    assert plan["rendezvous"]["conf"]["is_host"] == "false"
    assert len(plan["agents"]) == 2
    cmd = plan["agents"][1]["command"]
    for part in (
        # torchrun through the agent module that exports the rendezvous round (every node's must).
        "-m orchestrator.backends._local_agent",
        "--nnodes=1:2",
        "--nproc-per-node=2",
        "--max-restarts=3",
        "--rdzv-backend=c10d",
        "--local-addr=127.0.0.1",
        f"--log-dir={tmp_path / 'r'}/logs/node1",
        "-m training --spec",
    ):
        assert part in cmd
    assert plan["env"]["TORCHRIG_METRICS_BIND"] == "127.0.0.1"
    assert plan["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert not (tmp_path / "r").exists(), "a dry run creates nothing"


def test_dry_run_text_is_yaml_and_applies_set(tmp_path: Path) -> None:
    code, out, _ = invoke(
        "run", str(EXAMPLE), "--dry-run", "--set", "spec.restarts.max=7", "--run-dir", str(tmp_path / "r")
    )
    assert code == 0
    assert "--max-restarts=7" in yaml.safe_load(out)["agents"][0]["command"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nodes", "3"], "--nodes: 3 exceeds spec.nodes.max (2)"),
        (["--nodes", "0"], "--nodes: must be at least 1"),
        (
            ["--nodes", "1", "--set", "spec.nodes.min=2"],
            "--nodes: 1 is below spec.nodes.min (2): the rendezvous would wait for nodes that never start",
        ),
        (["--backend", "nope"], "unknown backend 'nope'; valid backends:"),
        (["--set", "spec.training.steps=-1"], "spec.training.steps"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    code, _, err = invoke("run", str(EXAMPLE), "--dry-run", "--run-dir", str(tmp_path / "r"), *args)
    assert code == 2
    assert needle in err and "Traceback" not in err


def test_run_dir_of_another_job_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.yaml"
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["training"]["batchSize"] = 8
    doc["spec"]["training"]["seed"] = 3
    other.write_text(yaml.safe_dump(doc))
    run_dir = make_run(tmp_path, "x", "1", "succeeded", job=other)
    code, _, err = invoke("run", str(EXAMPLE), "--dry-run", "--run-dir", str(run_dir))
    assert code == 2 and "holds a run of a different job (spec.training.batchSize, spec.training.seed differ)" in err
    # Training it longer (or shorter) is the same job: a resume.
    code, out, _ = invoke("run", str(other), "--dry-run", "--run-dir", str(run_dir), "--set", "spec.training.steps=900")
    assert code == 0, out
    # The same job again is a resume: allowed, and nothing already written is touched.
    code, out, _ = invoke("run", str(other), "--dry-run", "--run-dir", str(run_dir), "-o", "json")
    assert code == 0 and json.loads(out)["resume"] is True
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "succeeded"


def test_run_dir_of_a_live_run_is_refused(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "x", "1", None)
    write_json(run_dir / "supervisor.json", {"pid": os.getpid(), "start_ticks": process_start_ticks(os.getpid())})
    code, _, err = invoke("run", str(EXAMPLE), "--dry-run", "--run-dir", str(run_dir))
    assert code == 3 and "still going" in err


def test_status_exit_codes_and_list(tmp_path: Path) -> None:
    ok = make_run(tmp_path, "digits-ddp", "20261122-000001", "succeeded")
    bad = make_run(tmp_path, "digits-ddp", "20261122-000002", "failed")
    gone = make_run(tmp_path, "digits-ddp", "20261122-000003", "cancelled")
    live = make_run(tmp_path, "digits-ddp", "20261122-000004", None)
    write_json(live / "supervisor.json", {"pid": os.getpid(), "start_ticks": process_start_ticks(os.getpid())})
    (live / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 1.0}) + "\n")
    assert invoke("status", str(ok))[0] == 0
    assert invoke("status", f"local://{bad}")[0] == 1
    assert invoke("status", str(gone))[0] == 11
    code, out, _ = invoke("status", str(live), "-o", "json")
    assert code == 10 and json.loads(out)["details"]["step"] == 3
    code, _, err = invoke("status", str(tmp_path / "nope"))
    assert code == 2 and "no such run directory" in err
    code, out, _ = invoke("list", "-o", "json", env={Env.RUNS_DIR: str(tmp_path)})
    assert code == 0
    states = {Path(r["run"].removeprefix("local://")).name: r["state"] for r in json.loads(out)}
    assert states == {
        "20261122-000001": "succeeded",
        "20261122-000002": "failed",
        "20261122-000003": "cancelled",
        "20261122-000004": "running",
    }


def test_cancel_of_a_finished_run_changes_nothing(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "x", "1", "succeeded")
    code, out, _ = invoke("cancel", str(run_dir))
    assert code == 0 and "succeeded" in out


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_cancel_of_what_is_no_run_says_so_and_writes_nothing(tmp_path: Path, backend: str) -> None:
    """A typo or a wrong directory: one line naming RUN, exit 2, and no summary.json left in a directory
    that is not a run's (a cancel there used to write one, or fail with a traceback)."""
    code, _, err = invoke("cancel", str(tmp_path / "nosuch"), "--backend", backend)
    assert code == 2 and err.startswith("error: RUN: no such run directory") and "Traceback" not in err
    code, _, err = invoke("cancel", str(tmp_path), "--backend", backend)
    assert code == 2 and "is not a run directory (no job.yaml)" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_ref_backend_mismatch_is_usage_error(tmp_path: Path) -> None:
    code, _, err = invoke("status", "ray://raysubmit_1", "--backend", "local")
    assert code == 2 and "belongs to backend 'ray'" in err


def test_logs_by_rank(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "x", "1", "succeeded")
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "node0.log").write_text("[rank0]:zero\n[rank1]:one\n")
    code, out, _ = invoke("logs", str(run_dir), "--rank", "1")
    assert code == 0 and out == "[rank1]:one\n"
    code, out, _ = invoke("logs", str(run_dir), "--follow")  # a finished run: prints all and returns
    assert code == 0 and out == "[rank0]:zero\n[rank1]:one\n"


def test_report_json_and_plot(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "x", "1", "succeeded")
    (run_dir / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"time": 100.0 + i, "step": 10 * i, "loss": 2.0 / i, "samples_per_s": 50.0 + i, "world_size": 2})
            + "\n"
            for i in range(1, 6)
        )
    )
    (run_dir / "events.jsonl").write_text(
        "".join(
            json.dumps(e) + "\n"
            for e in [
                {"time": 99.0, "rank": 0, "generation": 0, "event": "start", "world_size": 2},
                {
                    "time": 102.0,
                    "rank": 0,
                    "generation": 0,
                    "event": "checkpoint_committed",
                    "step": 20,
                    "blocked_s": 0.03,
                },
                {"time": 103.0, "rank": 0, "generation": 1, "event": "start", "world_size": 1},
                {
                    "time": 104.0,
                    "rank": 0,
                    "generation": 1,
                    "event": "profile",
                    "first_step": 30,
                    "last_step": 34,
                    "trace": "profile/gen-1/rank-0.trace.json.gz",
                    "table": "profile/gen-1/rank-0.txt",
                    "wall_s": 2.0,
                    "host_time_s": 1.5,
                    "device_time_s": 0.5,
                },
            ]
        )
    )
    png = tmp_path / "r.png"
    code, out, _ = invoke("report", str(run_dir), "-o", "json", "--plot", str(png))
    assert code == 0
    data = json.loads(out)
    assert data["summary"]["status"] == "succeeded"
    assert data["derived"]["world_sizes"] == [2, 1]
    assert data["derived"]["checkpoints_committed"] == 1 and data["derived"]["min_loss"] == 0.4
    assert data["derived"]["samples_per_s_median"] == 53.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["derived"]["profiles"] == [
        {
            "rank": 0,
            "generation": 1,
            "steps": [30, 34],
            "table": str(run_dir / "profile/gen-1/rank-0.txt"),
            "trace": str(run_dir / "profile/gen-1/rank-0.trace.json.gz"),
            "wall_s": 2.0,
            "host_time_s": 1.5,
            "device_time_s": 0.5,
        }
    ]
    code, out, _ = invoke("report", str(run_dir))
    assert code == 0 and "succeeded" in out
    assert "steps 30-34, device busy 25%" in out  # where the profile is, and what it says at a glance
    code, _, err = invoke("report", str(tmp_path))
    assert code == 2 and "holds no summary.json" in err


def test_final_line_labels_every_number_and_prints_counts_as_integers() -> None:
    summary = Summary(
        status="succeeded",
        steps=300,
        total_steps=300,
        final_loss=0.0161,
        eval={"loss": 0.1107, "accuracy": 0.9694, "count": 360.0},
        samples_per_s=2345.6,
        wall_s=41.25,
        world_sizes=[4, 2],
        run_dir="/r",
    )
    line, where = final_line(summary).splitlines()
    assert line.startswith("succeeded: 300/300 steps, ")
    assert "train loss 0.0161, eval loss 0.1107, eval accuracy 0.9694, eval count 360, " in line
    assert "360.0" not in line and " loss 0.1107" not in line.replace("eval loss 0.1107", "")
    assert line.endswith("2346 samples/s, 41.2 s, restarts 0, world sizes 4 -> 2")
    assert where == "summary: /r/summary.json"


@pytest.mark.parametrize("steps", [None, 0])
def test_final_line_of_a_run_that_never_stepped_says_so(steps: int | None) -> None:
    summary = Summary(status="failed", steps=steps, total_steps=10, reason="cannot import 'x'", wall_s=3.0, restarts=0)
    line = final_line(summary).splitlines()[0]
    assert line == "failed before the first step: cannot import 'x'; 3.0 s, restarts 0"
    assert "None" not in final_line(Summary(status="cancelled", total_steps=10))


def test_format_value_counts_and_floats() -> None:
    assert format_value(360.0, "count") == "360"
    assert format_value(12.0, "num_tokens") == "12"
    assert format_value(1.0, "accuracy") == "1.0000"
    assert format_value(0.96944, "accuracy") == "0.9694"
    assert format_value(3e-6, "loss") == "3e-06"
    assert format_value(None) == "-" and format_value(7) == "7"


def test_report_text_labels_losses_and_min_loss_includes_the_final(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "x", "1", None)
    write_json(
        run_dir / "summary.json",
        {
            "status": "succeeded",
            "steps": 20,
            "total_steps": 20,
            "final_loss": 0.05,  # the mean over ranks of the last step: below every logged window
            "eval": {"loss": 0.1107, "accuracy": 0.9694, "count": 360.0},
        },
    )
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"time": 100.0 + i, "step": 10 * i, "loss": 1.0 / i}) + "\n" for i in (1, 2))
    )
    code, out, _ = invoke("report", str(run_dir), "-o", "json")
    data = json.loads(out)
    assert code == 0 and data["derived"]["first_loss"] == 1.0 and data["derived"]["min_loss"] == 0.05
    assert set(data["derived"]) == {
        "records",
        "first_loss",
        "min_loss",
        "samples_per_s_median",
        "checkpoints_committed",
        "checkpoint_blocked_s_max",
        "store_failures",
        "faults",
        "watchdog",
        "world_sizes",
        "profiles",
    }
    assert data["summary"]["eval"]["count"] == 360.0, "-o json keeps the values as written"
    code, out, _ = invoke("report", str(run_dir))
    assert code == 0
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines() if line.count("│") == 3}
    assert rows["train loss (final)"] == "0.05" and rows["train loss (first / min)"] == "1 / 0.05"
    assert rows["eval loss"] == "0.1107" and rows["eval accuracy"] == "0.9694" and rows["eval count"] == "360"


def test_report_of_a_run_that_never_stepped(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "x", "1", None)
    write_json(run_dir / "summary.json", {"status": "failed", "total_steps": 10, "reason": "boom"})
    code, out, _ = invoke("report", str(run_dir))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines() if line.count("│") == 3}
    assert code == 0 and "None" not in out
    assert rows["status"] == "failed before the first step" and rows["steps"] == "0 / 10"


def test_live_progress_labels_train_and_eval(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 0.5, "world_size": 2}) + "\n")
    eval_line = {"time": 1.0, "rank": 0, "generation": 0, "event": "eval", "step": 5, "metrics": {"count": 360.0}}
    (tmp_path / "events.jsonl").write_text(json.dumps(eval_line) + "\n")
    progress = LiveProgress(tmp_path, 10)
    progress.poll()
    # The live loss is rank 0's (the metrics lines are); the summary's is the mean over the ranks.
    assert progress.line().startswith("step 5/10  train loss (rank 0) 0.5000  eval count 360  world 2")


def test_live_progress_of_a_resubmit_skips_the_earlier_attempts_lines(tmp_path: Path) -> None:
    old = {"time": 100.0, "step": 100, "loss": 0.2, "world_size": 2}
    new = {"time": 200.0, "step": 3, "loss": 2.0, "world_size": 2}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(old) + "\n")
    committed = {"time": 100.0, "rank": 0, "generation": 0, "event": "checkpoint_committed", "step": 100}
    (tmp_path / "events.jsonl").write_text(json.dumps(committed) + "\n")
    progress = LiveProgress(tmp_path, 100, since=150.0)
    assert not progress.poll()
    assert progress.line() == "step 0/100  restarts 0  checkpoint none yet"
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps(new) + "\n")
    assert progress.poll() and progress.line().startswith("step 3/100  train loss (rank 0) 2.0000")


def test_report_plot_into_a_missing_folder_or_an_unknown_format_is_one_line(tmp_path: Path) -> None:
    """Both were matplotlib tracebacks (FileNotFoundError, "Format 'xyz' is not supported"), exit 1."""
    run_dir = make_run(tmp_path, "x", "1", "succeeded")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"time": 1.0, "step": 1, "loss": 1.0}) + "\n")
    for plot, says in (
        (tmp_path / "no" / "p.png", "no such directory"),
        (tmp_path / "p.xyz", "give a .png, .svg or .pdf"),
    ):
        code, _, err = invoke("report", str(run_dir), "--plot", str(plot))
        assert code == 2 and err.startswith(f"error: --plot: {plot}") and says in err, err
    code, _, _ = invoke("report", str(run_dir), "--plot", str(tmp_path / "p.svg"))
    assert code == 0 and (tmp_path / "p.svg").stat().st_size > 0


def test_logs_of_a_rank_the_run_cannot_have_is_bad_input(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "x", "1", "succeeded")  # digits-ddp: up to 2 nodes of 2 ranks
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "node0.log").write_text("[rank0]:zero\n")
    code, _, err = invoke("logs", str(run_dir), "--rank", "5")
    assert code == 2 and "--rank: no rank 5 in this run (ranks 0-3)" in err
    assert invoke("logs", str(run_dir), "--rank", "3")[0] == 0
