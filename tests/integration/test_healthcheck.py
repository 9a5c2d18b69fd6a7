"""The worker's health check as the kubelet's liveness probe runs it (issue 40 points 3 and 6).

Without a startup probe (which held a pod not Ready, hence unresolvable, until after the rendezvous) the
check itself grants the start, from the container's age; a standby node, which runs no exporter until it
takes a lost node's ranks, is healthy while it stands by (it was killed every ~40 minutes).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from training import healthcheck
from training.healthcheck import check, container_age_s, container_start

# No exporter listens on port 1 (connection refused at once).
NOBODY = "http://127.0.0.1:1/metrics"


def test_no_exporter_is_healthy_only_within_the_start_budget() -> None:
    healthy, reason = check(NOBODY, 60, start_budget_s=1500, age_s=30)
    assert healthy and "starting (30s of 1500s)" in reason
    healthy, reason = check(NOBODY, 60, start_budget_s=1500, age_s=1600)
    assert not healthy and "not answering" in reason
    assert not check(NOBODY, 60, start_budget_s=1500, age_s=None)[0], "an unknown age grants nothing"
    assert not check(NOBODY, 60)[0], "no budget (Docker's HEALTHCHECK): as before"


def test_a_standby_without_exporter_is_healthy_past_the_start_budget() -> None:
    healthy, reason = check(NOBODY, 60, start_budget_s=1500, age_s=10_000, standby=True)
    assert healthy and "standing by" in reason


def _fake_proc(root: Path, comm: str, starttime: int, uptime: float) -> str:
    (root / "1").mkdir(parents=True)
    # /proc/1/stat: pid (comm) state, then fields 4.. ; starttime is field 22.
    fields = ["S", *["0"] * 18, str(starttime), "0", "0"]
    (root / "1" / "stat").write_text(f"1 ({comm}) " + " ".join(fields) + "\n")
    (root / "uptime").write_text(f"{uptime} 0.0\n")
    return str(root)


def test_container_age_comes_from_pid_1_even_with_an_odd_command_name(tmp_path: Path) -> None:
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    proc = _fake_proc(tmp_path / "proc", "py thon) (x", 100 * ticks, 250.0)
    assert container_start(proc) == str(100 * ticks)
    assert container_age_s(proc) == pytest.approx(150.0)
    assert container_start(str(tmp_path / "none")) is None and container_age_s(str(tmp_path / "none")) is None


def test_the_standby_marker_belongs_to_this_container_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(healthcheck, "container_start", lambda proc="/proc": "4242")
    run_dir = str(tmp_path)
    assert not healthcheck.standing_by(run_dir)
    healthcheck.mark_standby(run_dir)
    assert healthcheck.standing_by(run_dir)
    # The run directory (an emptyDir) outlives the container: a restarted container is not standing by.
    monkeypatch.setattr(healthcheck, "container_start", lambda proc="/proc": "9999")
    assert not healthcheck.standing_by(run_dir)
    healthcheck.clear_standby(run_dir)
    assert not (tmp_path / healthcheck.STANDBY_MARKER).exists()
    healthcheck.clear_standby(run_dir)  # twice: nothing to do


def test_main_passes_the_budget_and_reports(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCHRIG_METRICS_PORT", "1")
    monkeypatch.delenv("TORCHRIG_SPEC", raising=False)
    monkeypatch.delenv("TORCHRIG_RUN_DIR", raising=False)
    monkeypatch.setattr(healthcheck, "container_age_s", lambda proc="/proc": 5.0)
    assert healthcheck.main(["--start-budget-s", "100"]) == 0
    assert "healthy: starting" in capsys.readouterr().out
    assert healthcheck.main([]) == 1
