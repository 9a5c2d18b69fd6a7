"""Job-name rules (issue 15 point 2): the job model takes any DNS-1035 name up to 63 characters; each
Kubernetes target applies its operator's own limit only when rendering or submitting to it.

The operator rules are re-derived here from the compiled objects, independently of orchestrator/naming.py
(which cites the operator source of each), so the limits there are checked to be exact: a name at a
target's limit gives manifests its operator accepts, one character more gives names it rejects.
"""

from __future__ import annotations

import copy
import re
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.backends import get_backend
from orchestrator.backends.base import SubmitOptions
from orchestrator.cli import cli
from orchestrator.compile import MANIFEST_TARGETS, compile, compile_plan
from orchestrator.compile.pytorchjob import compile_pytorchjob
from orchestrator.compile.rayjob import compile_rayjob
from orchestrator.compile.trainjob import compile_trainjob
from orchestrator.errors import UnsupportedFeature
from orchestrator.loader import apply_overrides, dump_spec, validate_document
from orchestrator.spec import JobSpec
from orchestrator.targets import target_name_limit, target_name_rule
from tests import crds

BASE: dict[str, Any] = {
    "apiVersion": "torchrig/v1",
    "kind": "TrainingJob",
    "metadata": {"name": "t"},
    "spec": {
        "task": {"entrypoint": "training.examples.digits:task"},
        "training": {"steps": 10},
        # A store every pod shares: Kubernetes targets refuse multi-node jobs without one (test_compile_policies).
        "checkpoint": {"stores": [{"uri": "s3://bucket/ckpt"}]},
    },
}
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
UNCHECKED: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "pytorchjob": compile_pytorchjob,
    "trainjob": compile_trainjob,
    "rayjob": compile_rayjob,
}


def job(name: str, max_nodes: int = 1, min_nodes: int = 1, *overrides: str) -> JobSpec:
    doc = apply_overrides(
        copy.deepcopy(BASE),
        [f"metadata.name={name}", f"spec.nodes.min={min_nodes}", f"spec.nodes.max={max_nodes}", *overrides],
    )
    return validate_document(doc)


def _label(name: str, limit: int = 63) -> bool:
    return len(name) <= limit and DNS1035.match(name) is not None


def operator_rejections(objs: list[dict[str, Any]]) -> list[str]:
    """What the operators would reject or fail to create for these objects, by their own naming."""
    out: list[str] = []
    runtime_jobs = [
        (rj["name"], rj.get("replicas", 1))
        for o in objs
        if o["kind"] in ("TrainingRuntime", "ClusterTrainingRuntime")
        for rj in o["spec"]["template"]["spec"]["replicatedJobs"]
    ] or [("node", 1)]  # a user runtime (runtimeRef): Trainer's torch runtimes have one `node` job
    for o in objs:
        name = o["metadata"]["name"]
        if o["kind"] == "PyTorchJob":
            # training-operator v1 GenGeneralName: a headless Service (and pod) <job>-<rtype>-<index>.
            for rtype, r in o["spec"]["pytorchReplicaSpecs"].items():
                out += [
                    f"Service {svc}"
                    for svc in (f"{name}-{rtype.lower()}-{i}" for i in range(r["replicas"]))
                    if not _label(svc)
                ]
        elif o["kind"] == "TrainJob":
            # The JobSet is named after the TrainJob; completions = numNodes; pods get 5 random characters.
            nodes = o["spec"]["trainer"]["numNodes"]
            for rjob, replicas in runtime_jobs:
                child = f"{name}-{rjob}-{replicas - 1}"
                pod = f"{child}-{nodes - 1}-abcde"
                out += [f"JobSet child {n}" for n in (child, pod) if not _label(n)]
        elif o["kind"] == "RayJob":
            # KubeRay: RayJob <= 47 (ValidateRayJobMetadata), its RayCluster <rayjob>-<5 random> <= 53.
            cluster = f"{name}-abcde"
            if not _label(name, 47):
                out.append(f"RayJob {name}")
            if not _label(cluster, 53) or not _label(f"{cluster}-head-svc"):
                out.append(f"RayCluster {cluster}")
            groups = [g["groupName"] for g in o["spec"]["rayClusterSpec"]["workerGroupSpecs"]]
            # utils.PodName cuts the prefix to 50 before "-head-"/"-worker-" + 5 random characters.
            pods = [f"{cluster[:50]}-head-abcde"] + [f"{(cluster + '-' + g)[:50]}-worker-abcde" for g in groups]
            out += [f"Pod {p}" for p in pods if len(p) > 63]
    return out


CASES = [
    (target, max_nodes, fixed)
    for target in MANIFEST_TARGETS
    for max_nodes in (1, 2, 3, 10, 11, 12, 101)
    for fixed in (False, True)
    if not (target == "trainjob" and not fixed and max_nodes > 1)  # TrainJob has no elastic training
]


@pytest.mark.parametrize(("target", "max_nodes", "fixed_size"), CASES)
def test_a_name_at_the_target_limit_renders_and_one_more_fails(target: str, max_nodes: int, fixed_size: bool) -> None:
    elastic = max_nodes > 1 and not fixed_size
    limit = target_name_limit(target, max_nodes, elastic=elastic)
    at = job("a" * limit, max_nodes)
    objs = compile(at, target, monitoring=True, fixed_size=fixed_size)
    crds.assert_valid(objs)
    assert operator_rejections(objs) == []

    over = job("a" * (limit + 1), max_nodes)
    # The limit is tight: the operator would reject what the compiler refuses to render.
    assert operator_rejections(UNCHECKED[target](over, fixed_size=fixed_size))
    with pytest.raises(UnsupportedFeature) as info:
        compile(over, target, fixed_size=fixed_size)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"metadata.name: '{'a' * (limit + 1)}' is {limit + 1} characters; ")
    assert f"(target {target}) are limited to {limit}" in message


def test_messages_name_the_field_the_target_the_limit_and_why() -> None:
    def refusal(target: str, name: str, max_nodes: int = 3, fixed_size: bool = False) -> str:
        with pytest.raises(UnsupportedFeature) as info:
            compile(job(name, max_nodes), target, fixed_size=fixed_size)
        return str(info.value)

    assert refusal("rayjob", "r" * 48) == (
        f"metadata.name: '{'r' * 48}' is 48 characters; KubeRay RayJob names (target rayjob) are limited to 47 "
        "(KubeRay rejects longer RayJob names: it names the RayCluster '<name>-xxxxx' and limits RayCluster "
        "names to 53)"
    )
    assert refusal("pytorchjob", "p" * 55) == (
        f"metadata.name: '{'p' * 55}' is 55 characters; PyTorchJob names (target pytorchjob) are limited to 54 "
        "with spec.nodes.max=3 (the training operator names a Service per replica, up to '<name>-worker-2', and "
        "a Service name is a DNS-1035 label of at most 63 characters)"
    )
    assert refusal("trainjob", "t" * 49, fixed_size=True) == (
        f"metadata.name: '{'t' * 49}' is 49 characters; TrainJob names (target trainjob) are limited to 48 "
        "with spec.nodes.max=3 (JobSet rejects pod names over 63 characters and names the pods up to "
        "'<name>-node-0-2-xxxxx')"
    )
    # Standby Worker replicas lengthen the longest Service name; the message names the field that did it.
    with pytest.raises(UnsupportedFeature) as info:
        compile(job("s" * 54, 3, 3, "spec.restarts.spareNodes=9", "spec.restarts.spares=1"), "pytorchjob")
    assert str(info.value) == (
        f"metadata.name: '{'s' * 54}' is 54 characters; PyTorchJob names (target pytorchjob) are limited to 53 "
        "with spec.nodes.max=3 and spec.restarts.spareNodes=9 (the training operator names a Service per "
        "replica, up to '<name>-worker-11', and a Service name is a DNS-1035 label of at most 63 characters)"
    )


def test_limits() -> None:
    assert [target_name_limit("rayjob", n) for n in (1, 3, 1000)] == [47, 47, 47]
    # Fixed size: Master + Workers 0..max-2; elastic: Workers 0..max-1.
    assert [target_name_limit("pytorchjob", n) for n in (1, 2, 11, 12, 101, 102)] == [54, 54, 54, 53, 53, 52]
    assert [target_name_limit("pytorchjob", n, elastic=True) for n in (2, 10, 11, 100, 101)] == [54, 54, 53, 53, 52]
    assert [target_name_limit("trainjob", n) for n in (1, 10, 11, 100, 101)] == [48, 48, 47, 47, 46]
    assert target_name_limit("torchrun", 1000) == target_name_limit("raytrain", 1000) == 63
    # Standby nodes: the Master is the store-only pod, the nodes Workers 0..max-1, the standbys after them.
    rules = [target_name_rule("pytorchjob", n, spare_nodes=s) for n, s in ((9, 1), (10, 1), (1, 9), (1, 10))]
    assert [r.limit for r in rules if r is not None] == [54, 53, 54, 53]


def test_a_63_character_name_with_three_nodes_validates_and_dry_runs_locally(tmp_path: Path) -> None:
    spec = job("a" * 63, 3)
    assert spec.name == "a" * 63
    dry = get_backend("local").dry_run(spec, SubmitOptions(run_dir=str(tmp_path / "run")))
    assert dry.backend == "local" and dry.spec.name == "a" * 63
    # Ray on VMs and torchrun take it as well.
    assert compile_plan(spec, "raytrain").scaling.max_workers == 3
    assert compile_plan(spec, "torchrun").args[0] == "torchrun"


def test_submitting_to_kubernetes_applies_the_targets_rule() -> None:
    backend = get_backend("kubernetes")
    for target, limit in (("pytorchjob", 54), ("trainjob", 48)):
        backend.dry_run(job("k" * limit, 3, 3, f"spec.kubernetes.target={target}"))
        with pytest.raises(UnsupportedFeature, match=rf"^metadata\.name: 'k{{{limit + 1}}}' is {limit + 1} characters"):
            backend.dry_run(job("k" * (limit + 1), 3, 3, f"spec.kubernetes.target={target}"))


def test_cli_validate_takes_the_name_render_applies_the_targets_rule(tmp_path: Path) -> None:
    def run(*args: str) -> tuple[int, str, str]:
        result = CliRunner().invoke(cli, list(args))
        return result.exit_code, result.stdout, result.stderr

    path = tmp_path / "job.yaml"
    for length in (50, 47):
        path.write_text(dump_spec(job("n" * length, 3)))
        assert run("validate", str(path)) == (0, "ok\n", "")
        assert run("render", str(path), "--target", "pytorchjob")[0] == 0
    path.write_text(dump_spec(job("n" * 48, 3)))
    code, out, err = run("render", str(path), "--target", "rayjob")
    assert (code, out) == (2, "")
    assert err.startswith(f"error: metadata.name: '{'n' * 48}' is 48 characters; KubeRay RayJob names ")
    assert len(err.splitlines()) == 1


@st.composite
def dns1035_names(draw: st.DrawFn, max_len: int = 63) -> str:
    """Every length 1..max_len equally likely (from_regex favours short strings)."""
    length = draw(st.integers(1, max_len))
    first = draw(st.sampled_from(string.ascii_lowercase))
    if length == 1:
        return first
    middle = draw(st.text(string.ascii_lowercase + string.digits + "-", min_size=length - 2, max_size=length - 2))
    return first + middle + draw(st.sampled_from(string.ascii_lowercase + string.digits))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=dns1035_names(), max_nodes=st.integers(1, 1200), fixed_size=st.booleans(), min_nodes=st.integers(1, 4))
def test_any_dns1035_name_validates_and_each_target_compiles_iff_it_fits(
    name: str, max_nodes: int, fixed_size: bool, min_nodes: int
) -> None:
    spec = job(name, max_nodes, min(min_nodes, max_nodes))
    assert spec.name == name
    elastic = spec.spec.nodes.elastic and not fixed_size
    for target in MANIFEST_TARGETS:
        if target == "trainjob" and elastic:
            continue  # refused for being elastic, whatever the name
        fits = len(name) <= target_name_limit(target, max_nodes, elastic=elastic)
        assert (operator_rejections(UNCHECKED[target](spec, fixed_size=fixed_size)) == []) == fits, target
        if fits:
            compile(spec, target, fixed_size=fixed_size)
        else:
            with pytest.raises(UnsupportedFeature, match=r"^metadata\.name: "):
                compile(spec, target, fixed_size=fixed_size)
