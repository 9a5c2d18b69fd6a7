"""The Dockerfiles: copy only what exists, run the real entry point as a non-root user (hadolint runs them in
tests/integration/test_hadolint.py)."""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.common import REPO

DOCKERFILES = sorted((REPO / "images").glob("*/Dockerfile"))


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _final_stage(path: Path) -> list[tuple[str, str]]:
    ins = _instructions(path)
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[last_from:]


def test_there_are_gpu_and_cpu_images() -> None:
    assert {p.parent.name for p in DOCKERFILES} == {"worker", "cpu"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_every_copy_source_exists_and_passes_dockerignore(dockerfile: Path) -> None:
    patterns = [p for p in (REPO / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]

    def included(rel: str) -> bool:
        keep = True
        for pat in patterns:
            negate = pat.startswith("!")
            pat = pat[1:] if negate else pat
            if fnmatch.fnmatch(rel, pat.rstrip("/")) or fnmatch.fnmatch(rel + "/", pat):
                keep = negate
        return keep

    copies = [args for word, args in _instructions(dockerfile) if word == "COPY" and "--from=" not in args]
    assert copies
    for args in copies:
        sources = args.split()[:-1]
        for src in sources:
            assert (REPO / src).exists(), f"{dockerfile}: COPY {src} does not exist"
            assert included(src.rstrip("/")), f"{dockerfile}: COPY {src} is excluded by .dockerignore"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_final_stage_is_non_root_without_sources_or_build_tools(dockerfile: Path) -> None:
    final = _final_stage(dockerfile)
    users = [args for word, args in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "final stage must run as a non-root user"
    # The compilers' pod security context runs as uid 1000; the image's user must be that uid.
    assert users[-1].split(":")[0] == "1000"
    runs = " ".join(args for word, args in final if word == "RUN")
    for tool in ("build-essential", "gcc", "g++", "python3-dev", "git"):
        assert tool not in runs, f"final stage installs build tool {tool}"
    plain_copies = [args for word, args in final if word == "COPY" and "--from=" not in args]
    assert not plain_copies, "final stage copies only the built venv from the build stage"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_images_run_every_target_rayjob_included(dockerfile: Path) -> None:
    """A RayJob without `spec.ray.image` runs `spec.image`, these images by default: they install the
    `ray` extra, at the Ray version the RayJob declares by default (`spec.ray.rayVersion`)."""
    from orchestrator.spec import RayConfig

    (extras,) = [
        args.partition("=")[2]
        for word, args in _instructions(dockerfile)
        if word == "ARG" and args.startswith("EXTRAS=")
    ]
    assert "ray" in extras.split(","), f"{dockerfile}: EXTRAS={extras} has no ray: a default RayJob could not start"
    pins = dict(line.split("==", 1) for line in (REPO / "constraints.txt").read_text().split() if "==" in line)
    assert pins["ray"] == RayConfig().ray_version


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_entrypoint_and_healthcheck_run_real_modules(dockerfile: Path) -> None:
    final = dict(_final_stage(dockerfile))
    entry = final["ENTRYPOINT"]
    assert re.search(r'"-m",\s*"training"\]', entry), entry
    assert importlib.util.find_spec("training.__main__") is not None, "the image's entry point module must exist"
    health = final["HEALTHCHECK"]
    assert '"training.healthcheck"' in health
    assert importlib.util.find_spec("training.healthcheck") is not None


class _Exporter(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def test_healthcheck_judges_step_age() -> None:
    from training.healthcheck import check, parse_last_step

    exposition = (
        "# HELP torchrig_last_step_timestamp_seconds x\n"
        'torchrig_last_step_timestamp_seconds{rank="0"} 1000.0\n'
        'torchrig_last_step_timestamp_seconds{rank="1"} 1010.0\n'
    )
    assert parse_last_step(exposition) == 1010.0
    assert parse_last_step("torchrig_step 3\n") is None

    server = HTTPServer(("127.0.0.1", 0), _Exporter)
    _Exporter.body = exposition.encode()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        assert check(url, max_age_s=60, now=1020.0)[0] is True
        healthy, reason = check(url, max_age_s=60, now=2000.0)
        assert not healthy and "no step completed" in reason
    finally:
        server.shutdown()
    healthy, reason = check(url, max_age_s=60)
    assert not healthy and "not answering" in reason


# ---------------------------------------------------------------------------------------------
# scripts/build_images.py (`make images`): what an image is tagged with, where torch comes from
# ---------------------------------------------------------------------------------------------


def _build_images() -> Any:
    from tests.containers.images import build_images

    return build_images


def _context(root: Path) -> None:
    for name in ("pyproject.toml", "README.md", "constraints.txt"):
        (root / name).write_text(name)
    for pkg in ("orchestrator", "training"):
        (root / pkg / "__pycache__").mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
        (root / pkg / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")


def test_the_image_hash_follows_the_sources_and_ignores_bytecode(tmp_path: Path) -> None:
    bi = _build_images()
    _context(tmp_path)
    image = bi.IMAGES["cpu"]
    first = bi.image_hash(image, "sha256:base", None, tmp_path)
    assert [p.name for p in bi.context_files(tmp_path)] == [
        "README.md",
        "constraints.txt",
        "__init__.py",
        "pyproject.toml",
        "__init__.py",
    ]
    (tmp_path / "training" / "__pycache__" / "y.pyc").write_bytes(b"1")
    assert bi.image_hash(image, "sha256:base", None, tmp_path) == first
    (tmp_path / "training" / "__init__.py").write_text("x = 1\n")
    changed = bi.image_hash(image, "sha256:base", None, tmp_path)
    assert changed != first
    assert bi.image_hash(image, "sha256:other-base", None, tmp_path) != changed
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"w")
    assert bi.image_hash(image, "sha256:base", wheel, tmp_path) != changed
    # Framed: moving bytes from one name to the next is a different input.
    assert bi.digest([("a", b"bc")]) != bi.digest([("ab", b"c")])


def test_the_base_tag_names_its_recipe() -> None:
    bi = _build_images()
    tag = bi.base_tag()
    assert tag.startswith("localhost/torchrig-base:bookworm-")
    assert {"python3", "python3-venv", "ca-certificates", "python-is-python3"} <= set(bi.BASE_PACKAGES)
    assert any(env.startswith("PATH=/usr/local/sbin:") for env in bi.BASE_ENV)


def test_torch_comes_from_a_wheel_directory_only_when_it_holds_the_right_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bi = _build_images()
    monkeypatch.setattr(bi, "_pip_find_links", lambda: [])
    monkeypatch.delenv("TORCHRIG_TORCH_WHEELS", raising=False)
    assert bi.torch_wheels("2.13.0", "cp311", None) is None
    (tmp_path / "torch-2.13.0+cpu-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    with pytest.raises(bi.BuildError, match=re.escape("no torch-2.13.0+cpu-cp311")):
        bi.torch_wheels("2.13.0", "cp311", str(tmp_path))
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    assert bi.torch_wheels("2.13.0", "cp311", str(tmp_path)) == (tmp_path.resolve(), wheel)
    monkeypatch.setenv("TORCHRIG_TORCH_WHEELS", str(tmp_path))
    assert bi.torch_wheels("2.13.0", "cp311", None) == (tmp_path.resolve(), wheel)
    assert bi.torch_version(REPO / "images" / "cpu" / "Dockerfile") == "2.13.0"


def test_the_project_containers_conf_sets_runc_and_the_ulimits() -> None:
    import tomllib

    conf = tomllib.loads((REPO / "images" / "containers.conf").read_text())
    assert conf["engine"]["runtime"] == "runc"
    assert set(conf["containers"]["default_ulimits"]) == {"nofile=1024:1024", "nproc=4096:4096"}
    assert _build_images().podman_env()["CONTAINERS_CONF"] == str(REPO / "images" / "containers.conf")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_the_dependency_layer_lists_what_pyproject_asks_for(dockerfile: Path, tmp_path: Path) -> None:
    """The build stage installs the dependencies before copying the sources, from a list its inline
    Python reads off pyproject.toml: run that very code here."""
    runs = [args for word, args in _instructions(dockerfile) if word == "RUN" and "tomllib" in args]
    assert len(runs) == 1, "one RUN lists the dependencies"
    code = re.search(r"python -c '(.+?)'", runs[0])
    assert code is not None
    extras = dict(args.split("=", 1) for word, args in _instructions(dockerfile) if word == "ARG" and "=" in args)
    proc = subprocess.run(
        [sys.executable, "-c", code.group(1), extras["EXTRAS"]],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    listed = proc.stdout.splitlines()
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    expected = list(project["dependencies"])
    for extra in extras["EXTRAS"].split(","):
        expected += project["optional-dependencies"][extra]
    assert listed == expected
    assert any(r.startswith("ray[") for r in listed) and any(r.startswith("torch") for r in listed)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_caches_that_default_under_home_are_sent_to_the_cache_volume(dockerfile: Path) -> None:
    """Under the pods' read-only root only ~/.cache (an emptyDir) is writable in HOME: every cache
    directory the image sets lies there, and the GPU image sets Triton's and the CUDA JIT's, which
    default to ~/.triton and ~/.nv."""
    from orchestrator.compile._pod import CACHE_DIR

    envs = " ".join(args for word, args in _final_stage(dockerfile) if word == "ENV")
    settings = dict(re.findall(r"(\w+)=(\S+)", envs))
    for name in ("TRITON_HOME", "CUDA_CACHE_PATH", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "MPLCONFIGDIR"):
        if name in settings:
            assert settings[name].startswith(CACHE_DIR + "/"), f"{dockerfile}: {name}={settings[name]}"
    if dockerfile.parent.name == "worker":
        assert {"TRITON_HOME", "CUDA_CACHE_PATH"} <= set(settings)
