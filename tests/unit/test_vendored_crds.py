"""The CRD schemas the manifest tests validate against live in the repository, unmodified."""

from __future__ import annotations

import hashlib
import re

import yaml

from tests import crds

SOURCES = crds.crd_dir() / "SOURCES.md"
ROW_RE = re.compile(r"^\| `(?P<file>[^`]+)` \| (?P<bytes>[\d,]+) \| .*? \| `(?P<blob>[0-9a-f]{40})` \|", re.M)


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_every_crd_the_tests_use_is_vendored_with_its_source() -> None:
    rows = {m["file"]: m for m in ROW_RE.finditer(SOURCES.read_text())}
    for name in crds.CRD_FILES.values():
        assert name in rows, f"{name}: no row in {SOURCES}"
        assert (crds.crd_dir() / name).is_file(), f"{name}: not vendored in {crds.crd_dir()}"


def test_vendored_crds_are_byte_for_byte_the_cited_blobs() -> None:
    for match in ROW_RE.finditer(SOURCES.read_text()):
        data = (crds.crd_dir() / match["file"]).read_bytes()
        assert len(data) == int(match["bytes"].replace(",", "")), match["file"]
        assert _git_blob_id(data) == match["blob"], f"{match['file']} differs from its source blob"


def test_each_vendored_file_is_the_crd_its_name_says() -> None:
    for (api_version, kind), name in crds.CRD_FILES.items():
        doc = yaml.safe_load((crds.crd_dir() / name).read_text())
        group, version = api_version.split("/")
        assert doc["kind"] == "CustomResourceDefinition"
        assert doc["spec"]["group"] == group and doc["spec"]["names"]["kind"] == kind
        assert version in [v["name"] for v in doc["spec"]["versions"]]
