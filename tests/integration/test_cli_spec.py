"""`torchrig validate | render | schema` through click (and once as a real process): exit codes,
one line per problem, never a traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.cli import cli

REPO = Path(__file__).resolve().parents[2]
DIGITS = str(REPO / "examples" / "digits-ddp.yaml")
TINYGPT = str(REPO / "examples" / "tinygpt-fsdp.yaml")


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def test_validate_ok() -> None:
    assert run("validate", DIGITS) == (0, "ok\n", "")


def test_validate_prints_warnings_on_stderr() -> None:
    code, out, err = run(
        "validate",
        DIGITS,
        "--set",
        "spec.training.lrSchedule.minLrRatio=0.1",
        "--set",
        "spec.training.lrSchedule.decay=constant",
    )
    assert (code, out) == (0, "ok\n")
    assert err == "warning: spec.training.lrSchedule.minLrRatio: has no effect with decay constant\n"


def test_validate_one_line_per_problem() -> None:
    code, out, err = run("validate", DIGITS, "--set", "metadata.name=Bad", "--set", "spec.nodes.min=3")
    assert code == 2 and out == ""
    assert err.splitlines() == [
        f"error: {DIGITS}: metadata.name: must be a DNS-1035 label: lowercase letters, digits and '-', "
        "starting with a letter and ending with a letter or digit",
        f"error: {DIGITS}: spec.nodes.max: must be >= spec.nodes.min (3)",
    ]


def test_validate_json() -> None:
    code, out, _ = run("validate", DIGITS, "-o", "json")
    assert code == 0 and json.loads(out) == {"ok": True, "file": DIGITS, "name": "digits-ddp", "warnings": []}
    code, out, _ = run("validate", DIGITS, "-o", "json", "--set", "spec.bogus=1")
    assert code == 2
    problems = json.loads(out)["problems"]
    assert len(problems) == 1 and problems[0].startswith("spec.bogus: unknown field; valid keys here: checkpoint, ")


def test_validate_missing_file() -> None:
    code, _, err = run("validate", "/nonexistent/job.yaml")
    assert code == 2 and err == "error: /nonexistent/job.yaml: no such file\n"


def _run_stdin(args: list[str], data: bytes) -> subprocess.CompletedProcess[bytes]:
    cmd = [sys.executable, "-c", "from orchestrator.cli import main; main()", *args]
    return subprocess.run(cmd, input=data, capture_output=True, timeout=60, check=False)


def test_stdin_is_read_to_the_end_not_cut_at_64_kib() -> None:
    doc = yaml.safe_load(Path(DIGITS).read_text())
    doc["spec"]["task"]["args"]["note"] = "x" * 100_000  # a spec past one pipe buffer
    proc = _run_stdin(["render", "-", "--target", "pytorchjob"], yaml.safe_dump(doc).encode())
    assert proc.returncode == 0, proc.stderr
    config = next(o for o in yaml.safe_load_all(proc.stdout) if o["kind"] == "ConfigMap")
    assert "x" * 100_000 in next(iter(config["data"].values()))


def test_stdin_over_the_size_limit_is_one_error_line() -> None:
    from orchestrator.loader import MAX_SPEC_BYTES

    proc = _run_stdin(["validate", "-"], Path(DIGITS).read_bytes() + b"#" * MAX_SPEC_BYTES)
    assert proc.returncode == 2
    assert proc.stderr.decode().splitlines() == ["error: <stdin>: larger than 1024 KiB; a job file is a few KiB"]


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (BOMB, "YAML rejected: more than 100000 values once its aliases are expanded (an alias bomb?)"),
        ("a: " + "[" * 3000 + "]" * 3000 + "\n", "YAML rejected: line 1: nesting deeper than 64 levels"),
        ("a: &a [*a]\n", "YAML rejected: more than 100000 values once its aliases are expanded (an alias bomb?)"),
    ],
    ids=["alias-bomb", "deep-nesting", "recursive-alias"],
)
@pytest.mark.parametrize("command", ["validate", "render"])
def test_hostile_yaml_is_one_error_line(tmp_path: Path, text: str, message: str, command: str) -> None:
    # Bounded work: the alias bomb expands to ~387 million values if anything walks it unbounded, so a
    # regression shows as a hang (the per-test timeout), not as a slow pass.
    path = tmp_path / "job.yaml"
    path.write_text(text)
    code, out, err = run(command, str(path))
    assert code == 2 and out == ""
    assert err == f"error: {path}: {message}\n"


def test_render_pytorchjob_is_applyable_yaml() -> None:
    code, out, _ = run("render", DIGITS, "--target", "pytorchjob", "--monitoring")
    assert code == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(out)]
    assert kinds == ["ConfigMap", "NetworkPolicy", "PyTorchJob", "PodMonitor", "PrometheusRule"]


@pytest.mark.parametrize(
    "args",
    [
        ["--target", "pytorchjob"],
        ["--target", "pytorchjob", "--fixed-size"],  # Master and Worker from one template
        ["--target", "pytorchjob", "--set", "spec.nodes={min: 2, max: 2}", "--set", "spec.restarts.spareNodes=1"],
        ["--target", "trainjob", "--fixed-size"],
        ["--target", "rayjob"],
    ],
    ids=["elastic", "fixed", "standby", "trainjob", "rayjob"],
)
def test_render_prints_no_yaml_anchors(args: list[str]) -> None:
    """One object under two keys printed as `&id001` / `*id001`: valid YAML that kubectl expands, but a
    manifest people read, diff and feed to other tools must spell each replica's template out."""
    code, out, err = run("render", DIGITS, *args, "--allow-pod-local-stores")
    assert code == 0, err
    assert not re.search(r"[&*]id\d{3}", out)


def test_render_set_overrides_reach_the_manifest() -> None:
    code, out, _ = run("render", DIGITS, "--target", "pytorchjob", "--set", "spec.nodes.max=5")
    job = next(d for d in yaml.safe_load_all(out) if d["kind"] == "PyTorchJob")
    assert code == 0 and job["spec"]["elasticPolicy"]["maxReplicas"] == 5


def test_render_unsupported_feature_exit_2() -> None:
    code, out, err = run("render", TINYGPT, "--target", "trainjob")
    assert code == 2 and out == ""
    assert err.startswith("error: spec.nodes: TrainJob (Trainer >= v2.2) has no elastic training")
    assert len(err.splitlines()) == 1


def test_render_trainjob_fixed_size() -> None:
    code, out, _ = run("render", TINYGPT, "--target", "trainjob", "--fixed-size")
    assert code == 0 and [d["kind"] for d in yaml.safe_load_all(out)][-1] == "TrainJob"


def test_render_torchrun_and_raytrain() -> None:
    code, out, _ = run("render", TINYGPT, "--target", "torchrun")
    assert code == 0 and out.splitlines()[-1].startswith(
        "python -m training.launch --spec job.yaml -- torchrun --nnodes 2:4 "
    )
    code, out, _ = run("render", TINYGPT, "--target", "raytrain")
    assert code == 0 and yaml.safe_load(out)["scaling"]["num_workers"] == [16, 32]


def test_render_bad_target_lists_choices() -> None:
    code, _, err = run("render", DIGITS, "--target", "mpijob")
    assert code == 2 and "pytorchjob" in err and "Traceback" not in err


def test_schema_validates_the_examples() -> None:
    code, out, _ = run("schema")
    schema = json.loads(out)
    assert code == 0 and schema["properties"]["spec"]
    for example in (DIGITS, TINYGPT):
        jsonschema.validate(yaml.safe_load(Path(example).read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"apiVersion": "torchrig/v1", "kind": "TrainingJob", "metadata": {}, "spec": {}}, schema)
    # What editors check agrees with the model where a user types most: the job's name, booleans for numbers.
    for name, steps in (("Bad_Name", 300), ("digits-ddp", True)):
        doc = yaml.safe_load(Path(DIGITS).read_text())
        doc["metadata"]["name"], doc["spec"]["training"]["steps"] = name, steps
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema)


@pytest.mark.parametrize("command", ["validate", "render", "schema"])
def test_help_has_examples(command: str) -> None:
    code, out, _ = run(command, "--help")
    assert code == 0 and "Examples:" in out


# -- fuzzing ---------------------------------------------------------------------------------------------

_EXAMPLE_TEXT = Path(DIGITS).read_text()
_yaml_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
_yaml_values = st.recursive(
    _yaml_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)


@st.composite
def mutated_examples(draw: st.DrawFn) -> str:
    """The example with one key's value replaced, a line deleted, or random bytes spliced in."""
    lines = _EXAMPLE_TEXT.splitlines()
    kind = draw(st.sampled_from(["replace", "delete", "splice"]))
    i = draw(st.integers(0, len(lines) - 1))
    if kind == "delete":
        del lines[i]
    elif kind == "splice":
        lines.insert(i, draw(st.text(max_size=30)))
    else:
        doc = yaml.safe_load(_EXAMPLE_TEXT)
        node = doc
        path = draw(
            st.lists(
                st.sampled_from(
                    [
                        "spec",
                        "metadata",
                        "training",
                        "nodes",
                        "resources",
                        "checkpoint",
                        "kubernetes",
                        "name",
                        "min",
                        "gpus",
                        "stores",
                        "every",
                    ]
                ),
                max_size=3,
            )
        )
        for key in path:
            if isinstance(node, dict) and isinstance(node.get(key), dict):
                node = node[key]
        if isinstance(node, dict) and node:
            node[draw(st.sampled_from(sorted(node)))] = draw(_yaml_values)
        return yaml.safe_dump(doc)
    return "\n".join(lines)


def assert_clean(code: int, out: str, err: str) -> None:
    assert code in (0, 2), (code, out, err)
    assert "Traceback" not in out + err
    if code == 0:
        assert out == "ok\n"
    else:
        assert err and all(line.startswith("error: ") for line in err.splitlines()), err


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(max_size=200), _yaml_values.map(yaml.safe_dump), mutated_examples()))
def test_validate_fuzz_never_tracebacks(tmp_path: Path, text: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    assert_clean(*run("validate", str(path)))


@settings(max_examples=40, deadline=None)
@given(expr=st.text(max_size=40))
def test_validate_fuzz_set_never_tracebacks(expr: str) -> None:
    assert_clean(*run("validate", DIGITS, "--set", expr))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", ["spec: [1, 2", "apiVersion: torchrig/v1\nkind: TrainingJob\nmetadata: {name: X}\n"])
def test_validate_real_process(tmp_path: Path, text: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-c", "from orchestrator.cli import main; main()", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: {path}: ")
