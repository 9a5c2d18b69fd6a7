"""What a job file and `--set` may not slip past the model: booleans for numbers, infinite or absurd
timeouts, duplicate keys, YAML bombs in `--set`, store URIs that mean something else than they say,
two stores in one place, and a run directory whose job.yaml is not a job file. Each is one line naming
the field, exit 2, no traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.cli import cli
from orchestrator.errors import SpecError
from orchestrator.loader import load_spec, read_yaml
from tests.fixtures.common import REPO

EXAMPLE = REPO / "examples" / "digits-ddp.yaml"
NO_PVC = "spec.checkpoint.stores[0].pvc=null"


def _problems(*sets: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(EXAMPLE, list(sets))
    return info.value.problems


@pytest.mark.parametrize(
    ("expr", "field", "word"),
    [
        ("spec.training.steps=true", "spec.training.steps", "true"),
        ("spec.training.steps=yes", "spec.training.steps", "true"),  # YAML 1.1's boolean, in a file too
        ("spec.resources.gpus=no", "spec.resources.gpus", "false"),
        ("spec.training.optimizer.lr=true", "spec.training.optimizer.lr", "true"),
        ("spec.checkpoint.every.seconds=on", "spec.checkpoint.every.seconds", "true"),
    ],
)
def test_a_boolean_is_no_number(expr: str, field: str, word: str) -> None:
    """pydantic's lax mode took `steps: yes` as 1 step; `torchrig schema` (what editors check) refused it."""
    assert _problems(expr) == [f"{field}: expected a number, got the boolean {word}"]


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("spec.restarts.stepTimeoutSeconds", ".inf", "finite"),
        ("spec.restarts.preemptGraceSeconds", ".inf", "finite"),
        ("spec.checkpoint.ioTimeoutSeconds", "-.inf", "finite"),
        ("spec.training.optimizer.lr", ".nan", "finite"),
        ("spec.restarts.stepTimeoutSeconds", "1e300", "less than or equal to 604800"),
        ("spec.restarts.inPlaceTimeoutSeconds", "604801", "less than or equal to 604800"),
        ("spec.restarts.preemptGraceSeconds", "1e9", "less than or equal to 86400"),
        ("spec.checkpoint.every.seconds", "1e12", "less than or equal to 604800"),
    ],
)
def test_timeouts_are_finite_and_bounded(field: str, value: str, says: str) -> None:
    """An infinite step timeout validated, then crashed `render` with a traceback (probes are integer
    seconds); 1e300 rendered a terminationGracePeriodSeconds no API server takes."""
    (problem,) = _problems(f"{field}={value}")
    assert problem.startswith(f"{field}: ") and says in problem


def test_the_longest_timeouts_still_render() -> None:
    from orchestrator.compile import compile as compile_manifests

    spec = load_spec(
        EXAMPLE,
        [
            "spec.restarts.stepTimeoutSeconds=604800",
            "spec.checkpoint.ioTimeoutSeconds=604800",
            "spec.restarts.preemptGraceSeconds=86400",
        ],
    )
    assert compile_manifests(spec, "pytorchjob")


def test_a_duplicate_key_is_an_error_not_the_last_one_wins(tmp_path: Path) -> None:
    text = EXAMPLE.read_text().replace("  training:\n    steps: 300\n", "  training:\n    steps: 300\n    steps: 5\n")
    assert "steps: 5" in text
    job = tmp_path / "job.yaml"
    job.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(job)
    (problem,) = info.value.problems
    assert "duplicate key 'steps'" in problem and "line" in problem
    with pytest.raises(SpecError, match="duplicate key 'max'"):
        read_yaml("nodes: {min: 1, max: 2, max: 1}")
    assert _problems("spec.task.args.x={a: 1, a: 2}") == [
        "--set spec.task.args.x: YAML rejected: line 1: duplicate key 'a' (first on line 1)"
    ]


def test_merge_keys_still_override() -> None:
    """`<<: *base` then a key of the same name is YAML's override, not a duplicate."""
    assert read_yaml("base: &b {a: 1, b: 2}\nx:\n  <<: *b\n  a: 3\n")["x"] == {"a": 3, "b": 2}


def test_set_values_have_the_files_bounds() -> None:
    levels = "".join(
        f"&{c} [" + ",".join([f"*{prev}"] * 10) + "], " for prev, c in zip("abcdef", "bcdefg", strict=True)
    )
    bomb = "[&a [1,1,1,1,1,1,1,1,1,1], " + levels + "]"
    (problem,) = _problems(f"spec.task.args.x={bomb}")
    assert problem.startswith("--set spec.task.args.x: YAML rejected: more than")
    (problem,) = _problems("spec.task.args.x=" + "[" * 5000 + "]" * 5000)
    assert problem.startswith("--set spec.task.args.x: YAML rejected:") and "nesting deeper" in problem
    spec = load_spec(EXAMPLE, ["spec.task.args.x=[[1, 2], {a: b}]"])
    assert spec.spec.task.args["x"] == [[1, 2], {"a": "b"}]


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("''", "must not be empty"),
        ("s3://", "s3:// URI needs a bucket"),
        ("gs:///prefix", "gs:// URI needs a bucket"),
        ("file:/abs/ckpt", "write file:///absolute/path"),
        ("file://~/ckpt", "`~` is not expanded"),
        ("~/ckpt", "`~` is not expanded"),
    ],
)
def test_store_uris_that_mean_something_else_are_refused(uri: str, says: str) -> None:
    (problem,) = _problems(f"spec.checkpoint.stores[0].uri={uri}", NO_PVC)
    assert problem.startswith("spec.checkpoint.stores[0].uri: ") and says in problem


def _two_stores(first: str, second: str) -> list[str]:
    return [
        f"spec.checkpoint.stores[0].uri={first}",
        NO_PVC,
        f"spec.checkpoint.stores[1].uri={second}",
        "spec.checkpoint.stores[1].name=second",
    ]


@settings(max_examples=40, deadline=None)
@given(
    parts=st.lists(st.sampled_from(["ckpt", "a", "b-1", "x.y"]), min_size=1, max_size=3),
    absolute=st.booleans(),
    spelling=st.sampled_from(["{p}", "file://{p}", "{p}/", "file://{p}/./", "{p}/../{last}"]),
)
def test_two_spellings_of_one_store_location_are_refused(parts: list[str], absolute: bool, spelling: str) -> None:
    """Two stores in one folder raced each other's writes and every save to the second failed, while the
    user counted two copies. Any spelling of the same place is caught."""
    path = ("/tmp/" if absolute else "./") + "/".join(parts)
    other = spelling.format(p=path, last=parts[-1])
    first = "file://" + path
    (problem,) = _problems(*_two_stores(first, other))
    assert problem.startswith("spec.checkpoint.stores[1].uri: ") and "same location as stores[0]" in problem


@pytest.mark.parametrize(
    ("first", "second"),
    [("s3://bucket/ckpt", "s3://bucket/ckpt/"), ("gs://b/p", "gcs://b/p"), ("az://c/p", "abfs://c/p")],
)
def test_one_bucket_prefix_under_two_names_is_one_store(first: str, second: str) -> None:
    (problem,) = _problems(*_two_stores(first, second))
    assert "same location as stores[0]" in problem


def test_stores_in_different_places_are_fine() -> None:
    spec = load_spec(EXAMPLE, _two_stores("file://./ckpt", "file://./ckpt2"))
    assert len(spec.spec.checkpoint.stores) == 2
    spec = load_spec(EXAMPLE, _two_stores("s3://bucket/a", "s3://bucket/b"))
    assert len(spec.spec.checkpoint.stores) == 2


@pytest.mark.parametrize("bad", ["binary", "directory"])
def test_a_run_dir_whose_job_yaml_is_no_job_file_is_one_line(tmp_path: Path, bad: str) -> None:
    """`--run-dir` onto a folder with a binary or directory job.yaml: a traceback before."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if bad == "binary":
        (run_dir / "job.yaml").write_bytes(bytes(range(256)))
    else:
        (run_dir / "job.yaml").mkdir()
    before = sorted(os.listdir(run_dir))
    done = CliRunner().invoke(cli, ["run", str(EXAMPLE), "--dry-run", "--run-dir", str(run_dir)])
    assert done.exit_code == 2, done.output
    assert f"--run-dir: {run_dir / 'job.yaml'} is not a readable job file" in done.output
    assert "Traceback" not in done.output and sorted(os.listdir(run_dir)) == before


def test_preflight_refuses_an_object_store_whose_package_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gs://` without gcsfs: each worker failed at its first save, and every restart the same way."""
    import fsspec

    from orchestrator.loader import dump_spec
    from training.config import load_worker_spec
    from training.contract import ExitCode
    from training.preflight import PreflightError, check_stores

    def missing(protocol: str) -> object:
        raise ImportError("Please install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    spec = load_worker_spec(dump_spec(load_spec(EXAMPLE, ["spec.checkpoint.stores[0].uri=gs://bucket/x", NO_PVC])))
    with pytest.raises(PreflightError) as info:
        check_stores(spec, None)
    assert info.value.exit_code == ExitCode.ENVIRONMENT
    assert str(info.value) == (
        "spec.checkpoint.stores[0].uri (gs://bucket/x): no gs:// support on this machine: "
        "Please install gcsfs to access Google Storage"
    )


def test_a_memory_store_is_warned_about() -> None:
    """A local run "committed" its final checkpoint to memory:// and exited 0; nothing of it was left."""
    spec = load_spec(EXAMPLE, ["spec.checkpoint.stores[0].uri=memory://x", NO_PVC])
    assert any(w.startswith("spec.checkpoint.stores[0].uri: memory:// lives in each worker") for w in spec.warnings())
    assert not any("memory://" in w for w in load_spec(EXAMPLE).warnings())


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("spec.training.steps[0]=1", "--set 'spec.training.steps[0]=1': [0] needs a list there, found int"),
        (
            "spec.checkpoint.stores[5].uri=x",
            "--set 'spec.checkpoint.stores[5].uri=x': index 5 out of range (the list has 1)",
        ),
        ("metadata=5", "metadata: expected a mapping, got int"),
        ("spec.kubernetes=[1]", "spec.kubernetes: expected a mapping, got list"),
        (
            "spec.task.entrypoint=training..x:task",
            "spec.task.entrypoint: must be an import path of the form `package.module:callable`",
        ),
        (
            "spec.task.entrypoint=mod.:task",
            "spec.task.entrypoint: must be an import path of the form `package.module:callable`",
        ),
    ],
)
def test_messages_say_what_is_wrong_in_the_users_terms(expr: str, problem: str) -> None:
    """Not "index 0 out of range" for a number, not pydantic's class names, no empty module names."""
    assert _problems(expr) == [problem]
