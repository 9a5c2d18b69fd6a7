"""Drill campaigns for real: one cheap scenario x 2 seeds on a tiny job (real drills, one shared
reference, a re-run that skips them), and the report card in a real browser (headless Chromium,
installed by scripts/install-tools.sh): it loads with no console message (the page's CSP turns any
network fetch into one), the verdict matrix is in the DOM and drawn in its colours. The screenshot
stays in the test's tmp directory."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.drills.campaign import CampaignOptions, CaseState, parse_scenarios, run_campaign
from orchestrator.drills.plan import DrillOptions
from orchestrator.errors import BackendError
from orchestrator.loader import load_spec
from tests.fixtures.campaign import FakeDrill
from tests.fixtures.common import free_port
from training.contract import DrillEventKind

CHROMIUM = next(
    (path for name in ("chromium-headless-shell", "chromium", "chromium-browser") if (path := shutil.which(name))),
    None,
)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is absent (scripts/install-tools.sh installs chromium-headless-shell)"
)


def _chromium(page: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={page.parent / '.chromium'}",
            *args,
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _console(stderr: str) -> list[str]:
    """What the page wrote to the console (errors, uncaught exceptions, CSP violations)."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def _pixels_near(png: Path, rgb: tuple[int, int, int], tolerance: int = 12) -> int:
    import numpy as np
    from PIL import Image

    with Image.open(png) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    return int((np.abs(pixels - np.array(rgb, dtype=np.int16)) <= tolerance).all(axis=-1).sum())


@needs_chromium
def test_report_card_renders_in_headless_chromium(tmp_path: Path, examples_dir: Path) -> None:
    spec = load_spec(examples_dir / "digits-ddp.yaml", ["spec.nodes.max=1"])
    fake = FakeDrill(
        failing={("hang", 1)},
        raising={("straggler", 2): BackendError("launcher refused")},
        recovery_path={"kill-worker": "restart"},
    )
    options = CampaignOptions(
        scenarios=parse_scenarios("kill-worker,hang,straggler,kill-node"),
        seeds=(0, 1, 2),
        out_dir=str(tmp_path / "campaign"),
        job_file="examples/digits-ddp.yaml",
    )
    run_campaign(spec, options, drill=fake)
    page = tmp_path / "campaign" / "report.html"
    screenshot = tmp_path / "report.png"

    shot = _chromium(page, f"--screenshot={screenshot}", "--window-size=1280,1600", "--hide-scrollbars")
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert screenshot.is_file(), shot.stderr[-2000:]
    assert _console(shot.stderr) == []

    dom = _chromium(page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    matrix = re.search(r'<table class="matrix" id="matrix">(.*?)</table>', dom.stdout, re.S)
    assert matrix is not None
    rows = re.findall(r'<tr><th scope="row">([a-z-]+)</th>(.*?)</tr>', matrix.group(1), re.S)
    assert [name for name, _ in rows] == ["kill-worker", "hang", "straggler", "kill-node"]
    cells = {name: re.findall(r'<td class="cell ([a-z-]+)"', body) for name, body in rows}
    assert cells == {
        "kill-worker": ["passed"] * 3,
        "hang": ["passed", "failed", "passed"],
        "straggler": ["passed", "passed", "error"],
        "kill-node": ["skipped"] * 3,
    }
    assert dom.stdout.count("<polyline") >= 2 * 8  # throughput and world size of every case that ran

    # Drawn, not just present: the pass green and fail red of the matrix cells are on the screenshot.
    assert _pixels_near(screenshot, (0x1A, 0x7F, 0x37)) > 5_000
    assert _pixels_near(screenshot, (0xCF, 0x22, 0x2E)) > 1_000


@needs_chromium
def test_console_check_catches_a_network_fetch(tmp_path: Path) -> None:
    """The check above can fail: a page of the same policy that tries to fetch logs a console line."""
    from orchestrator.drills.campaign_html import _CSP

    page = tmp_path / "fetching.html"
    page.write_text(
        f'<!doctype html><html><head><meta http-equiv="Content-Security-Policy" content="{_CSP}"></head>'
        '<body><img src="http://127.0.0.1:9/logo.png"></body></html>'
    )
    shot = _chromium(page, f"--screenshot={tmp_path / 'fetching.png'}", "--window-size=400,300")
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert any("Content Security Policy" in line for line in _console(shot.stderr)), shot.stderr[-2000:]


# 30 steps, a checkpoint every 5, one node of 2 ranks. lose-store is the cheapest scenario (no restart)
# and one whose patch adds a store: its bit-for-bit check against the shared, unpatched reference is the
# claim that scenario patches never change the numerics.
TINY = [
    "spec.training.steps=30",
    "spec.checkpoint.every.steps=5",
    "spec.training.evalAtEnd=false",
    "spec.training.lrSchedule.warmupSteps=2",
    "spec.metrics.logEvery=5",
    "spec.nodes.min=1",
    "spec.nodes.max=1",
]


# Two drills and a reference, ~1 min idle, 3 on a loaded 2-core machine: the test's timeout comes after the
# three runs' own (each cancelled by its drill after RUN_TIMEOUT_S, which then gives its verdict) and a margin.
RUN_TIMEOUT_S = 300


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 60)
def test_campaign_of_real_drills_shares_one_reference_and_resumes(tmp_path: Path, examples_dir: Path) -> None:
    spec = load_spec(examples_dir / "digits-ddp.yaml", [*TINY, f"spec.metrics.port={free_port()}"])
    options = CampaignOptions(
        scenarios=("lose-store", "kill-node"),
        seeds=(0, 1),
        out_dir=str(tmp_path / "campaign"),
        drill=DrillOptions(timeout_s=RUN_TIMEOUT_S),
    )
    result = run_campaign(spec, options)
    ran = [r for r in result.cases if r.state is not CaseState.SKIPPED]
    assert [r.state for r in ran] == [CaseState.PASSED] * 2, [r.failed_checks or r.reason for r in ran]
    assert {r.scenario for r in result.cases if r.state is CaseState.SKIPPED} == {"kill-node"}
    reports = [r.report or {} for r in ran]
    # Each seed aims its own fault; both cases compare with the one reference of world size 2.
    planned = [
        next(e["fault_step"] for e in x["events"] if e["event"] == DrillEventKind.DRILL_STARTED) for x in reports
    ]
    assert planned == [19, 11]  # random.Random(seed).randint(7, 28) for seeds 0 and 1
    assert all(x["final_params_match_reference"] is True for x in reports)
    assert reports[0]["reference_run_dir"] == reports[1]["reference_run_dir"]
    assert result.references == {"2": reports[0]["reference_run_dir"]}
    assert all(r.timeline and r.timeline["samples_per_s"] for r in ran)
    assert result.exit_code == 0

    again = run_campaign(spec, options)
    assert [r.resumed for r in again.cases if r.state is CaseState.PASSED] == [True, True]
