"""What a Ray Jobs API submission uploads (issue 33 point 5): never secret-like files, nothing git-ignored.

The submission is packed here by Ray's own packaging (`ray._private.runtime_env.packaging.create_package`,
what `JobSubmissionClient` does with a local `working_dir`), offline: a fake client stands in for the
Jobs API and records the archive's names.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import pytest

packaging = pytest.importorskip("ray._private.runtime_env.packaging")

from ray._private import ray_constants  # noqa: E402

from orchestrator.backends import ray_jobs  # noqa: E402
from orchestrator.backends.base import SubmitOptions  # noqa: E402
from orchestrator.loader import load_spec  # noqa: E402

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits-ddp.yaml"

SECRET_LIKE = [
    ".env",
    "deploy/.env.production",
    "certs/server.pem",
    "tls.key",
    "id_rsa",
    "home/.ssh/id_ed25519",
    ".netrc",
    ".git-credentials",
    ".kube/config",
    "kubeconfig-prod.yaml",
    ".aws/credentials",
]
GIT_IGNORED = ["data/shard-0.bin", "debug.log", "sub/tmp/scratch.txt"]
BUILD = [".git/config", ".venv/bin/python", "runs/digits/20260101-000000/job.yaml", "pkg/__pycache__/m.cpython-311.pyc"]
KEPT = [
    "train.py",
    "pkg/__init__.py",
    "pkg/id_utils.py",
    "sub/keep.txt",
    "important.log",
    ".gitignore",
    "sub/.gitignore",
]


class _RecordingClient:
    """The Jobs API client's `submit_job`, packing `working_dir` as Ray would and keeping the names."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.names: list[str] = []

    def submit_job(self, *, runtime_env: dict[str, Any], **_: Any) -> str:
        archive = self.scratch / "package.zip"
        excludes = ray_constants.get_runtime_env_default_excludes() + list(runtime_env.get("excludes", []))
        # As `JobSubmissionClient._upload_working_dir_if_needed` decides it (ray/dashboard/modules/dashboard_sdk.py).
        include_gitignore = os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"
        packaging.create_package(
            runtime_env["working_dir"], archive, include_gitignore=include_gitignore, excludes=excludes
        )
        with zipfile.ZipFile(archive) as zf:
            self.names = sorted(n for n in zf.namelist() if not n.endswith("/"))
        return "submitted"


@pytest.fixture
def work_tree(tmp_path: Path) -> Path:
    """A working directory holding secrets, git-ignored data, build output and the code to ship."""
    root = tmp_path / "work"
    for rel in SECRET_LIKE + GIT_IGNORED + BUILD + KEPT:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"contents of {rel}\n")
    (root / ".gitignore").write_text("data/\n*.log\n!important.log\n")
    (root / "sub" / ".gitignore").write_text("tmp/\n")
    outside = tmp_path / "outside-secret.txt"
    outside.write_text("not in the working directory\n")
    (root / "notes.txt").symlink_to(outside)  # Ray's zip would pack the target
    (root / "creds").symlink_to(root / ".aws")  # a way into a secret directory
    return root


def _submit(root: Path, monkeypatch: pytest.MonkeyPatch, scratch: Path) -> _RecordingClient:
    client = _RecordingClient(scratch)
    monkeypatch.chdir(root)
    monkeypatch.setattr(ray_jobs, "jobs_client", lambda address: client)
    ray_jobs.submit_job(load_spec(DIGITS), SubmitOptions(), "http://127.0.0.1:8265", probe=False)
    return client


def test_the_upload_holds_no_secret_and_nothing_git_ignored(
    work_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", raising=False)
    client = _submit(work_tree, monkeypatch, tmp_path)
    assert client.names == sorted([*KEPT, "job.yaml"])
    line, run_dir = capsys.readouterr().err.strip().split("\n")
    assert run_dir.startswith('run dir (on the cluster): "$HOME"/torchrig/runs/digits-ddp/torchrig-digits-ddp-')
    assert line.startswith("not uploaded to the Ray cluster: 12 secret-like (")
    assert "3 git-ignored" in line and "1 links out of the directory" in line and "\n" not in line
    for rel in (".env", ".kube/", "id_rsa", "creds"):
        assert rel in line


def test_secrets_stay_out_when_ray_is_told_to_ignore_gitignore(
    work_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1` (Ray's switch) uploads git-ignored files, never secret-like ones."""
    monkeypatch.setenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "1")
    names = _submit(work_tree, monkeypatch, tmp_path).names
    assert set(GIT_IGNORED) <= set(names)
    assert not set(names) & set(SECRET_LIKE + BUILD)


def test_staging_keeps_modes_and_relative_links(tmp_path: Path) -> None:
    source, target = tmp_path / "src", tmp_path / "dst"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(source / "pkg" / "run.sh", 0o755)
    (source / "latest").symlink_to("pkg/run.sh")
    left_out = ray_jobs.stage_working_dir(source, target)
    assert left_out == ray_jobs.StagedUpload()
    assert os.stat(target / "pkg" / "run.sh").st_mode & 0o777 == 0o755
    assert os.readlink(target / "latest") == "pkg/run.sh"
