"""manifests/ and docs/spec.md are generated (`make manifests`); fail when they are stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.gen import REPO, generate, stale

GENERATED = generate()


@pytest.mark.parametrize("rel", sorted(GENERATED))
def test_generated_file_is_current(rel: str) -> None:
    path = REPO / rel
    assert path.exists(), f"{rel} is missing: run `make manifests`"
    assert path.read_text() == GENERATED[rel], f"{rel} is stale: run `make manifests`"


def test_no_leftover_manifests() -> None:
    assert stale() == [], f"stale or leftover generated files {stale()}: run `make manifests`"


def test_every_example_has_manifests() -> None:
    for example in (REPO / "examples").glob("*.yaml"):
        assert (Path("manifests") / example.stem / "pytorchjob.yaml").as_posix() in GENERATED


def test_spec_reference_covers_every_field() -> None:
    from orchestrator.spec import JobSpec

    text = GENERATED["docs/spec.md"]
    for path in (
        "`metadata.name`",
        "`spec.checkpoint.stores[].uri`",
        "`spec.kubernetes.runtimeRef`",
        "`spec.checkpoint.async`",
    ):
        assert path in text
    assert JobSpec.model_fields["spec"].description in text


def test_elastic_trainjob_header_says_fixed_size() -> None:
    text = GENERATED["manifests/tinygpt-fsdp/trainjob.yaml"]
    assert "--fixed-size" in text.splitlines()[1] and "elastic" in text
