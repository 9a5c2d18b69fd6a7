"""The Dockerfiles through the real hadolint (`make tools` installs it next to the venv's python). The
pure checks of the same files are in tests/integration/test_images.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.common import REPO

DOCKERFILES = sorted((REPO / "images").glob("*/Dockerfile"))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_clean(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ignore" not in dockerfile.read_text().lower(), "no hadolint ignores"
