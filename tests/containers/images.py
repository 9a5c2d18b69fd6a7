"""The build script (scripts/build_images.py, not a package) loaded as a module, and podman with the
project's containers.conf."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import ModuleType

from tests.fixtures.common import REPO


def _load_build_images() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_images", REPO / "scripts" / "build_images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_images"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


build_images = _load_build_images()


def podman(*args: str, timeout: float = 300, check: bool = False) -> subprocess.CompletedProcess[str]:
    """`podman ARGS` with the project's containers.conf, output captured."""
    return subprocess.run(
        ["podman", *args],
        env=build_images.podman_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )
