"""The compile-target registry (`orchestrator.targets`): one home for each fact about a target.

What each `Target` declares is checked against what its compiler does (kind, apiVersion, elastic
support, standby nodes), unknown names fail listing the valid ones wherever a name enters, and the
source of `orchestrator/` is searched for target names spelled outside the registry, so a second copy
of a fact cannot creep back.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest
from click.testing import CliRunner

from orchestrator.cli import cli
from orchestrator.compile import check_target, compile, compile_plan, render
from orchestrator.errors import SpecError, UnsupportedFeature
from orchestrator.loader import load_spec
from orchestrator.spec import KubernetesConfig
from orchestrator.targets import (
    DEFAULT_TARGET,
    MANIFEST_TARGETS,
    PLAN_TARGETS,
    SUBMIT_TARGETS,
    TARGET_KINDS,
    TARGETS,
    SubmitTarget,
    get_target,
    target_name_rule,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

# A name that means only the target wherever it is spelled. `torchrun` is also the launcher program
# the compilers run, so its spelling tells nothing.
TARGET_ONLY_NAMES = frozenset(TARGETS) - {"torchrun"}
# (file, name) -> (how many times, why it stays there). Docstrings, comments and messages that only
# mention a name are not string constants of their own and are not counted.
ALLOWED_SPELLINGS: dict[tuple[str, str], tuple[int, str]] = {
    ("orchestrator/compile/__init__.py", "raytrain"): (1, "compile_plan's typed overload (mypy needs a literal)"),
    ("orchestrator/compile/networkpolicy.py", "rayjob"): (1, "the RayJob's dashboard ingress, its own compile step"),
    ("orchestrator/drills/kubernetes.py", "pytorchjob"): (1, "the kill-worker drill reads PyTorchJob pods only"),
    ("orchestrator/chart.py", "trainjob"): (1, "the chart's test values: a TrainJob variant of an example"),
    ("orchestrator/spec.py", "trainjob"): (1, "a warning about what TrainJob does with kubernetes.queue"),
}


def _spellings(root: Path) -> dict[tuple[str, str], list[int]]:
    """(file, target name) -> lines where a string constant (not a docstring) is exactly that name."""
    found: dict[tuple[str, str], list[int]] = {}
    for file in sorted((root / "orchestrator").rglob("*.py")):
        rel = str(file.relative_to(root))
        if rel == "orchestrator/targets.py":
            continue
        tree = ast.parse(file.read_text(), filename=rel)
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value in TARGET_ONLY_NAMES
                and id(node) not in docstrings
            ):
                found.setdefault((rel, node.value), []).append(node.lineno)
    return found


def test_no_target_name_is_spelled_outside_the_registry() -> None:
    found = _spellings(REPO)
    extra = [
        f"{file}:{lines} spells {name!r}: ask its Target (orchestrator.targets) instead"
        for (file, name), lines in sorted(found.items())
        if len(lines) > ALLOWED_SPELLINGS.get((file, name), (0, ""))[0]
    ]
    assert not extra, "\n".join(extra)
    # An allowance nothing needs any more goes too, so the list only shrinks.
    stale = [key for key, (count, _) in ALLOWED_SPELLINGS.items() if len(found.get(key, [])) < count]
    assert not stale, stale


def test_the_spelling_search_finds_a_copy(tmp_path: Path) -> None:
    (tmp_path / "orchestrator").mkdir()
    (tmp_path / "orchestrator" / "x.py").write_text(
        '"""A docstring naming pytorchjob is fine."""\n'
        'def f(t: str) -> bool:\n    """rayjob"""\n    return t == "trainjob"\n'
    )
    assert _spellings(tmp_path) == {("orchestrator/x.py", "trainjob"): [4]}


# -- the registry -----------------------------------------------------------------------------------


def test_unknown_target_lists_the_valid_ones() -> None:
    with pytest.raises(SpecError) as e:
        get_target("slurm")
    assert str(e.value) == (
        "--target: unknown target 'slurm'; valid targets: pytorchjob, trainjob, rayjob, torchrun, raytrain, raycluster"
    )
    spec = load_spec(EXAMPLES[0])
    with pytest.raises(SpecError, match=r"unknown target 'slurm'; valid targets: pytorchjob, trainjob, rayjob$"):
        compile(spec, "slurm")
    with pytest.raises(SpecError, match=r"unknown target 'slurm'; valid targets: torchrun, raytrain, raycluster$"):
        compile_plan(spec, "slurm")
    every = "pytorchjob, trainjob, rayjob, torchrun, raytrain, raycluster"
    with pytest.raises(SpecError, match=rf"valid targets: {every}$"):
        render(spec, "slurm")
    with pytest.raises(SpecError, match=r"'torchrun' is a launch plan, not manifests"):
        compile(spec, "torchrun")


def test_the_registry_partitions_the_targets() -> None:
    assert set(MANIFEST_TARGETS) | set(PLAN_TARGETS) == set(TARGETS)
    assert not set(MANIFEST_TARGETS) & set(PLAN_TARGETS)
    assert set(get_args(SubmitTarget)) == set(SUBMIT_TARGETS) == set(TARGET_KINDS)
    assert DEFAULT_TARGET in SUBMIT_TARGETS
    assert KubernetesConfig().target == DEFAULT_TARGET
    for name, kind in TARGET_KINDS.items():
        assert TARGETS[name].kind == kind and TARGETS[name].submit
    for t in TARGETS.values():
        assert t.manifests == (t.api_version is not None)
        assert t.name_rule is None or t.manifests  # launch plans take any job-model name
        assert not (t.standby_nodes and not t.submit)  # standby pods are a submitted job's


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("name", list(TARGETS))
def test_every_target_compiles_the_examples_as_declared(example: Path, name: str) -> None:
    t = TARGETS[name]
    spec = load_spec(example)
    if not t.manifests:
        assert compile_plan(spec, name).render()
        return
    if spec.spec.nodes.elastic and not t.elastic:
        with pytest.raises(UnsupportedFeature, match=r"^spec\.nodes: "):
            compile(spec, name, allow_pod_local_stores=True)
    fixed = spec.spec.nodes.elastic and not t.elastic
    objects = compile(spec, name, fixed_size=fixed, allow_pod_local_stores=True)
    jobs = [o for o in objects if o["kind"] == t.kind]
    assert len(jobs) == 1
    assert jobs[0]["apiVersion"] == t.api_version
    assert jobs[0]["metadata"]["name"] == spec.name


def test_standby_nodes_count_in_the_name_rule_only_where_the_target_runs_them() -> None:
    for name in MANIFEST_TARGETS:
        t = TARGETS[name]
        base = target_name_rule(name, 2)
        with_spares = target_name_rule(name, 2, spare_nodes=9)
        assert base is not None and with_spares is not None
        # A name exactly at the limit without spares: refused with them only where they are pods.
        overrides = ["spec.nodes.min=2", "spec.nodes.max=2", "spec.restarts.spareNodes=9"]
        spec = load_spec(EXAMPLES[0], [*overrides, f"metadata.name={'a' * base.limit}"])
        assert spec.spec.restarts.standby_nodes == 9
        if t.standby_nodes and with_spares.limit < base.limit:
            with pytest.raises(UnsupportedFeature, match=r"spec\.restarts\.spareNodes=9"):
                check_target(spec, name, allow_pod_local_stores=True)
        else:
            check_target(spec, name, allow_pod_local_stores=True)
    assert any(TARGETS[n].standby_nodes for n in MANIFEST_TARGETS)


def test_the_cli_lists_and_accepts_the_registered_targets() -> None:
    out = CliRunner().invoke(cli, ["render", "--help"], terminal_width=200).output
    for t in TARGETS.values():
        assert f"{t.name:<10}  {t.summary}" in out
    bad = CliRunner().invoke(cli, ["render", str(EXAMPLES[0]), "--target", "slurm"])
    assert bad.exit_code == 2
    assert "'slurm' is not one of 'pytorchjob', 'trainjob', 'rayjob', 'torchrun', 'raytrain'" in bad.output
    plan = CliRunner().invoke(cli, ["render", str(EXAMPLES[0]), "--target", "torchrun", "--monitoring"])
    assert plan.exit_code != 0
    assert "--monitoring: applies to Kubernetes targets only, not 'torchrun'" in plan.output
