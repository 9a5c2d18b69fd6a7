"""scripts/run-tests.sh, the suite as CI runs it: a half of the suite that collects no test (pytest's exit
5: a bad `-k`, a broken conftest, a moved folder) fails the run even when the other half passed, and any
other failure keeps its exit code. Run against stand-ins for ruff, mypy and pytest, so that the script's
own decisions are what is tested."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.common import REPO

PYTEST = """#!/usr/bin/env bash
for a in "$@"; do [ "$a" = tests/unit ] && exit "$UNIT_RC"; done
exit "$REST_RC"
"""


@pytest.mark.parametrize(
    ("unit", "rest", "code", "says"),
    [
        (0, 0, 0, ""),
        (5, 0, 1, "collected no unit tests"),
        (0, 5, 1, "collected no integration tests"),
        (5, 5, 1, "collected no unit tests"),
        (1, 0, 1, ""),
        (0, 2, 2, ""),
    ],
)
def test_a_half_that_collects_nothing_fails_the_run(tmp_path: Path, unit: int, rest: int, code: int, says: str) -> None:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, body in (("ruff", "#!/bin/sh\nexit 0\n"), ("mypy", "#!/bin/sh\nexit 0\n"), ("pytest", PYTEST)):
        tool = bin_dir / name
        tool.write_text(body)
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "run-tests.sh"), str(tmp_path / "venv")],
        check=False,
        cwd=REPO,
        env={**os.environ, "UNIT_RC": str(unit), "REST_RC": str(rest)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == code, done.stderr
    assert says in done.stderr
    assert "== durations: unit " in done.stdout
