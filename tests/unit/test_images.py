"""The Dockerfiles: copy only what exists, run the real entry point as a non-root user (hadolint runs them in
tests/integration/test_hadolint.py)."""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

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
