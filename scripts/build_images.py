"""Build the torchrig images with podman, from any base, cached by what goes into them (`make images`).

    python scripts/build_images.py                 # images/cpu on a Debian base made here; images/worker if it can
    python scripts/build_images.py --base python:3.11-slim-bookworm cpu   # a base from a registry instead

Without `--base` the CPU image's base is made on this machine, no registry needed: `mmdebstrap` installs
Debian bookworm with python3 (3.11), python3-venv, ca-certificates and python-is-python3 (the Dockerfile
and the pods call `python`), and `podman import` turns it into `localhost/torchrig-base:bookworm-<hash>`,
the hash of that recipe. torch comes from a local directory of wheels when one holds the CPU wheel for
that Python (`--torch-wheels`, else `$TORCHRIG_TORCH_WHEELS`, else pip's configured `find-links`): it is
mounted into the build read-only (`--volume DIR:/mnt:ro`, `--build-arg TORCH_FIND_LINKS=/mnt`);
without one the Dockerfile's public default, the PyTorch CPU index, is used. The other packages come from
PyPI. The host's CA bundle is mounted over the build's during the build only (`--ca-bundle`), so a build
behind a TLS-intercepting proxy verifies PyPI the way the host does; nothing of it lands in the image.

An image is tagged `localhost/torchrig-worker-cpu:<hash>`, the hash of its Dockerfile, the build context
the Dockerfile copies (pyproject.toml, README.md, constraints.txt, orchestrator/ and training/ without
bytecode, as .dockerignore lets through), the base image's id and the torch wheels used. A tag that
exists is not built again: a second `make images` with nothing changed takes seconds. Within a build,
podman's layer cache keeps the torch layer while only the sources changed.

images/worker's base is `nvidia/cuda:...` (`CUDA_IMAGE`) and its torch comes from the PyTorch CUDA
index: where neither the base is present nor a registry reachable, it is not built, and the one line
that says why is printed (exit 0 unless `worker` was asked for by name).

podman runs with the project's images/containers.conf (`CONTAINERS_CONF`), never the machine's own.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

REPO = Path(__file__).resolve().parent.parent
CONTAINERS_CONF = REPO / "images" / "containers.conf"
# The build context a Dockerfile may COPY (.dockerignore lets exactly these through).
CONTEXT = ("pyproject.toml", "README.md", "constraints.txt", "orchestrator", "training")
BASE_REPO = "localhost/torchrig-base"
BASE_SUITE = "bookworm"
BASE_PYTHON = "cp311"  # bookworm's python3
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "python-is-python3")
# Documentation, man pages and translations are no use in a container: ~30 MB less.
BASE_DPKG_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*")
# What python:*-slim images set and a bare rootfs lacks: a Dockerfile's `ENV PATH=...:$PATH` needs PATH.
BASE_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")
# An empty directory every Debian base has: buildah leaves no mount point of its own in the image.
WHEELS_MOUNT = "/mnt"
SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
TIMEOUT_S = 3600


@dataclass(frozen=True)
class Image:
    """One Dockerfile under images/ and what the build calls its base."""

    name: str
    repo: str
    base_arg: str

    @property
    def dockerfile(self) -> Path:
        return REPO / "images" / self.name / "Dockerfile"

    def default_base(self) -> str:
        """The base the Dockerfile names for users (its `ARG <base_arg>=...`)."""
        match = re.search(rf"^ARG {self.base_arg}=(\S+)", self.dockerfile.read_text(), re.MULTILINE)
        if match is None:
            raise BuildError(f"{self.dockerfile}: no `ARG {self.base_arg}=...`")
        return match.group(1)


IMAGES = {
    "cpu": Image("cpu", "localhost/torchrig-worker-cpu", "PYTHON_IMAGE"),
    "worker": Image("worker", "localhost/torchrig-worker", "CUDA_IMAGE"),
}


class BuildError(Exception):
    """A build that cannot go on; its message is one line."""


def podman_env() -> dict[str, str]:
    """The environment every podman call gets: the project's containers.conf."""
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`podman ARGS` with the project's containers.conf; output captured."""
    proc = subprocess.run(
        ["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BuildError(f"podman {args[0]}: {last}")
    return proc


def image_exists(ref: str) -> bool:
    return podman("image", "exists", ref, check=False).returncode == 0


def image_id(ref: str) -> str:
    return podman("image", "inspect", "--format", "{{.Id}}", ref).stdout.strip()


def context_files(repo: Path = REPO) -> list[Path]:
    """The files of the build context, sorted: CONTEXT, directories walked, bytecode left out."""
    files: list[Path] = []
    for name in CONTEXT:
        path = repo / name
        if path.is_dir():
            files += [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
        elif path.is_file():
            files.append(path)
    return sorted(files)


def digest(parts: Iterable[tuple[str, bytes]]) -> str:
    """A short hex digest of named byte strings (names and lengths framed: no two inputs collide)."""
    h = hashlib.sha256()
    for name, data in parts:
        for chunk in (name.encode(), data):
            h.update(len(chunk).to_bytes(8, "big"))
            h.update(chunk)
    return h.hexdigest()[:16]


def base_recipe() -> list[tuple[str, bytes]]:
    return [
        ("suite", BASE_SUITE.encode()),
        ("packages", ",".join(BASE_PACKAGES).encode()),
        ("excludes", ",".join(BASE_DPKG_EXCLUDES).encode()),
        ("env", ",".join(BASE_ENV).encode()),
    ]


def base_tag() -> str:
    return f"{BASE_REPO}:{BASE_SUITE}-{digest(base_recipe())}"


def ensure_base(log: list[str]) -> str:
    """The mmdebstrap base, made and imported unless its tag exists already."""
    tag = base_tag()
    if image_exists(tag):
        return tag
    if shutil.which("mmdebstrap") is None:
        raise BuildError("mmdebstrap not found: install it (scripts/install-tools.sh) or pass --base IMAGE")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torchrig-base-") as tmp:
        rootfs = Path(tmp, "rootfs.tar")
        cmd = [
            "mmdebstrap",
            "--quiet",
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            *(f"--dpkgopt=path-exclude={glob}" for glob in BASE_DPKG_EXCLUDES),
            BASE_SUITE,
            str(rootfs),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise BuildError(f"mmdebstrap {BASE_SUITE}: {last}")
        podman("import", *(a for env in BASE_ENV for a in ("--change", f"ENV={env}")), str(rootfs), tag)
    log.append(f"base {tag}: made with mmdebstrap in {time.monotonic() - t0:.0f} s")
    return tag


def _pip_find_links() -> list[str]:
    """The `find-links` directories pip is configured with (`pip config list`), if any."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    dirs: list[str] = []
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            dirs += value.strip().strip("'\"").split()
    return dirs


def torch_wheels(torch_version: str, python_tag: str, explicit: str | None) -> tuple[Path, Path] | None:
    """(directory, wheel) of a local CPU torch wheel for this Python, or None (the index then)."""
    candidates = [explicit] if explicit else [os.environ.get("TORCHRIG_TORCH_WHEELS", ""), *_pip_find_links()]
    pattern = f"torch-{torch_version}+cpu-{python_tag}-{python_tag}-*linux*_x86_64.whl"
    for raw in candidates:
        if not raw or "://" in raw:
            continue
        found = sorted(Path(raw).glob(pattern))
        if found:
            return Path(raw).resolve(), found[-1]
        if explicit:
            raise BuildError(f"--torch-wheels {raw}: no {pattern} there")
    return None


def torch_version(dockerfile: Path) -> str:
    match = re.search(r"^ARG TORCH_VERSION=(\S+)", dockerfile.read_text(), re.MULTILINE)
    if match is None:
        raise BuildError(f"{dockerfile}: no `ARG TORCH_VERSION=...`")
    return match.group(1)


def image_hash(image: Image, base_id: str, wheel: Path | None, repo: Path = REPO) -> str:
    """The hash an image is tagged with: its Dockerfile, the context it copies, its base, the torch wheel."""
    parts = [("Dockerfile", image.dockerfile.read_bytes()), ("base", base_id.encode())]
    parts += [(str(p.relative_to(repo)), p.read_bytes()) for p in context_files(repo)]
    if wheel is not None:
        parts.append(("wheel", f"{wheel.name}:{wheel.stat().st_size}".encode()))
    return digest(parts)


@dataclass
class Built:
    """What one image's build did."""

    tag: str
    seconds: float
    cached: bool


def build(
    image: Image,
    base: str,
    *,
    wheels_dir: str | None = None,
    ca_bundle: str | None = SYSTEM_CA_BUNDLE,
    progress: TextIO | None = None,
) -> Built:
    """Build IMAGE on BASE unless its tag exists; BASE must be present (or pullable). podman's output goes
    to `progress` (`make images`: stderr) or is kept for the error message."""
    t0 = time.monotonic()
    if not image_exists(base):
        podman("pull", "--quiet", base, timeout=TIMEOUT_S)
    base_id = image_id(base)
    python_tag = BASE_PYTHON if base.startswith(BASE_REPO + ":") else _python_tag(base)
    local = torch_wheels(torch_version(image.dockerfile), python_tag, wheels_dir) if python_tag else None
    tag = f"{image.repo}:{image_hash(image, base_id, local[1] if local else None)}"
    if image_exists(tag):
        return Built(tag, time.monotonic() - t0, cached=True)
    args = ["build", "--file", str(image.dockerfile), "--tag", tag, "--build-arg", f"{image.base_arg}={base}"]
    args += ["--pull=never", "--layers", "--label", f"io.torchrig.inputs={tag.rpartition(':')[2]}"]
    # The RUN steps reach PyPI through the host's network: a bridge's NAT to the outside (netavark's, the
    # backend images/containers.conf names for its DNS) is not there on every host, and a build needs none.
    args += ["--network", "host"]
    if local is not None:
        args += ["--volume", f"{local[0]}:{WHEELS_MOUNT}:ro", "--build-arg", f"TORCH_FIND_LINKS={WHEELS_MOUNT}"]
    if ca_bundle and Path(ca_bundle).is_file():
        args += ["--volume", f"{Path(ca_bundle).resolve()}:{SYSTEM_CA_BUNDLE}:ro"]
    if progress is None:
        podman(*args, str(REPO), timeout=TIMEOUT_S)
    else:
        print(f"images/{image.name}: building {tag} (from scratch: minutes)", file=progress, flush=True)
        cmd = ["podman", *args, str(REPO)]
        proc = subprocess.run(cmd, env=podman_env(), stdout=progress, stderr=progress, timeout=TIMEOUT_S, check=False)
        if proc.returncode != 0:
            raise BuildError(f"podman build exited {proc.returncode} (its output is above)")
    prune(image, tag)
    return Built(tag, time.monotonic() - t0, cached=False)


def prune(image: Image, keep: str) -> None:
    """Remove this image's earlier builds (2 GB each): its other tags and their build stages (untagged,
    labelled with their inputs' hash). The layers the new build shares with them, torch's among them,
    stay: they are the new build's too."""
    current = keep.rpartition(":")[2]
    for ref in podman("images", "--format", "{{.Repository}}:{{.Tag}}", image.repo).stdout.split():
        if ref != keep and ref.startswith(image.repo + ":"):
            podman("rmi", ref, check=False)
    fmt = '{{.ID}} {{index .Labels "io.torchrig.inputs"}}'
    stale = podman("images", "--filter", "dangling=true", "--filter", "label=io.torchrig.inputs", "--format", fmt)
    for line in stale.stdout.splitlines():
        image_id, _, inputs = line.partition(" ")
        if inputs.strip() != current:
            podman("rmi", image_id, check=False)


def _python_tag(base: str) -> str | None:
    """cpXY of a base's `python` (a base of the user's: its wheel tag is asked, not guessed)."""
    code = "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"
    proc = podman("run", "--rm", "--network", "none", base, "python", "-c", code, check=False, timeout=120)
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def image_size(tag: str) -> int:
    return int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="build_images.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="*", help="cpu and/or worker (default: both)")
    parser.add_argument("--base", help="the CPU image's PYTHON_IMAGE (default: a Debian base made here)")
    parser.add_argument("--torch-wheels", help="a directory holding the CPU torch wheel (default: see above)")
    parser.add_argument("--ca-bundle", default=SYSTEM_CA_BUNDLE, help="mounted over the build's CA bundle")
    args = parser.parse_args(argv)
    names: list[str] = args.images or list(IMAGES)
    unknown = [n for n in names if n not in IMAGES]
    if unknown:
        parser.error(f"unknown image {unknown[0]!r}: choose from {', '.join(IMAGES)}")
    if shutil.which("podman") is None:
        print(
            "podman not found: run scripts/install-tools.sh (Debian: podman buildah runc mmdebstrap)", file=sys.stderr
        )
        return 1
    log: list[str] = []
    try:
        for name in names:
            image = IMAGES[name]
            if name == "worker":
                base = image.default_base()
                if not image_exists(base) and podman("pull", "--quiet", base, check=False).returncode != 0:
                    line = f"images/worker: not built: its base {base} is not here and cannot be pulled"
                    if name in args.images:
                        raise BuildError(line)
                    print(f"{line} (no registry reachable; build it where one is)")
                    continue
            else:
                base = args.base or ensure_base(log)
            built = build(image, base, wheels_dir=args.torch_wheels, ca_bundle=args.ca_bundle, progress=sys.stderr)
            what = "up to date" if built.cached else "built"
            size = image_size(built.tag) / 1e9
            print(f"images/{name}: {built.tag} {what} in {built.seconds:.0f} s, {size:.2f} GB")
    except BuildError as exc:
        for line in log:
            print(line, file=sys.stderr)
        print(f"build_images: {exc}", file=sys.stderr)
        return 1
    for line in log:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
