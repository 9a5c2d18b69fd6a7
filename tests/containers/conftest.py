"""Fixtures of the container tests: podman with the project's containers.conf, the CPU image built once
per session (scripts/build_images.py: the mmdebstrap base and podman's layer cache are reused within a
run, and across runs while nothing that goes into the image changed), and what they cost."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator

import pytest

from tests.containers.images import build_images, podman

_COST: dict[str, float] = {"tests": 0.0}
_BUILT: list[str] = []


def _why_no_podman() -> str | None:
    if shutil.which("podman") is None:
        return "podman is not installed (scripts/install-tools.sh installs podman, buildah, runc, mmdebstrap)"
    proc = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", timeout=60)
    if proc.returncode != 0:
        return f"podman cannot run here: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


@pytest.fixture(scope="session")
def cpu_image() -> str:
    """The tag of images/cpu built on the mmdebstrap base with the local torch wheel (built once a session)."""
    why = _why_no_podman()
    if why:
        pytest.skip(why)
    # An image already built (a tag) to run instead: while the sources change under a test being written,
    # every session would rebuild. `make test` never sets it.
    given = os.environ.get("TORCHRIG_TEST_CPU_IMAGE")
    if given:
        _BUILT.append(f"{given} given by TORCHRIG_TEST_CPU_IMAGE")
        return given
    t0 = time.monotonic()
    log: list[str] = []
    try:
        base = build_images.ensure_base(log)
        built = build_images.build(build_images.IMAGES["cpu"], base)
    except build_images.BuildError as exc:
        pytest.fail(f"images/cpu did not build: {exc}", pytrace=False)
    _COST["build"] = time.monotonic() - t0
    _BUILT.extend([*log, f"{built.tag} {'cached' if built.cached else 'built'} in {built.seconds:.0f} s"])
    return str(built.tag)


@pytest.fixture
def containers() -> Iterator[list[str]]:
    """Names of containers a test starts; each is removed (killed if still running) at teardown."""
    names: list[str] = []
    yield names
    for name in names:
        podman("rm", "--force", "--time", "0", name, timeout=120)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.nodeid.startswith("tests/containers/"):
        _COST["tests"] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _COST["tests"] <= 0:
        return
    build = _COST.get("build", 0.0)
    terminalreporter.write_line(
        f"tests/containers: {_COST['tests']:.0f} s in all, the image build's {build:.0f} s included "
        f"({'; '.join(_BUILT) or 'no build'})"
    )
