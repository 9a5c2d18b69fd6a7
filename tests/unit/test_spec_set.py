"""`--set` > file > defaults, in `load_spec` (the one place precedence is decided)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.errors import SpecError
from orchestrator.loader import apply_overrides, load_spec, parse_set

JOB = """\
apiVersion: torchrig/v1
kind: TrainingJob
metadata: {name: prec}
spec:
  task: {entrypoint: "training.examples.digits:task"}
  training: {steps: 100, batchSize: 8}
  checkpoint:
    stores: [{uri: "file://./a", name: a}]
"""


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    return path


def test_file_beats_default(job_file: Path) -> None:
    assert load_spec(job_file).spec.training.batch_size == 8


def test_default_when_file_is_silent(job_file: Path) -> None:
    assert load_spec(job_file).spec.training.grad_accumulation == 1


def test_set_beats_file(job_file: Path) -> None:
    spec = load_spec(job_file, ["spec.training.batchSize=16"])
    assert spec.spec.training.batch_size == 16
    assert spec.spec.training.steps == 100  # untouched fields keep the file's value


def test_set_beats_default(job_file: Path) -> None:
    assert load_spec(job_file, ["spec.training.gradAccumulation=4"]).spec.training.grad_accumulation == 4


def test_later_set_wins(job_file: Path) -> None:
    assert load_spec(job_file, ["spec.training.steps=5", "spec.training.steps=7"]).spec.training.steps == 7


def test_set_indexes_lists(job_file: Path) -> None:
    spec = load_spec(job_file, ["spec.checkpoint.stores[0].name=b", "spec.checkpoint.stores[1].uri=s3://bkt/x"])
    assert [s.display_name for s in spec.spec.checkpoint.stores] == ["b", "bkt_x"]


def test_set_values_are_yaml_scalars(job_file: Path) -> None:
    spec = load_spec(job_file, ["spec.resources.cpu=500m", "spec.metrics.enabled=false", "spec.nodes={min: 1, max: 3}"])
    assert (spec.spec.resources.cpu, spec.spec.metrics.enabled, spec.spec.nodes.max) == ("500m", False, 3)


def test_set_result_validated(job_file: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(job_file, ["spec.training.steps=0"])
    assert info.value.lines() == [f"{job_file}: spec.training.steps: Input should be greater than 0"]


@pytest.mark.parametrize("expr", ["nokey", "=3", "a..b=1"])
def test_bad_set_expression(expr: str) -> None:
    with pytest.raises(SpecError, match="--set"):
        parse_set(expr)


@pytest.mark.parametrize(
    "expr",
    [
        "spec.checkpoint.stores[0].options.secret=abc",
        "spec.checkpoint.stores[0].options.key=abc",
        "spec.checkpoint.initFrom.options.client_kwargs.aws_secret_access_key=abc",
    ],
)
def test_credentials_are_never_taken_from_set(expr: str) -> None:
    with pytest.raises(SpecError, match="credentials are not taken from the command line"):
        apply_overrides({"spec": {}}, [expr])
    assert apply_overrides({"spec": {}}, ["spec.checkpoint.stores[0].options.endpoint_url=http://127.0.0.1:9000"])
