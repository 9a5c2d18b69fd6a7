"""The `raycluster` target (a Ray cluster-launcher file) and the store rules of a remote Ray cluster.

The cluster file is checked by Ray itself: the launcher's own schema (`ray/autoscaler/ray-schema.json`,
shipped in the ray package) and its config preparation (`prepare_config`: the cloud's defaults merged
in, the docker config checked, each node type's worker bounds filled; no cloud call), then
`validate_config` (the schema again, the head type among the node types, the sum of `min_workers`).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.cli import cli
from orchestrator.compile import check_target, render
from orchestrator.compile.checks import remote_ray_stores_problem
from orchestrator.compile.raycluster import INSTANCE_TYPES, compile_raycluster
from orchestrator.errors import SpecError, UnsupportedFeature
from orchestrator.loader import load_spec
from orchestrator.spec import JobSpec, parse_quantity

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "digits-ddp.yaml"
SHARED = ["spec.ray.sharedDir=/mnt/shared"]


def _ray_schema() -> dict[str, Any]:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def _prepared(config: dict[str, Any]) -> dict[str, Any]:
    """What `ray up` makes of the file before it calls the cloud: Ray's own preparation and checks."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    jsonschema.validate(config, _ray_schema())
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _spec(*overrides: str) -> JobSpec:
    return load_spec(EXAMPLE, [*SHARED, "spec.ray.cluster.projectId=my-project", *overrides])


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_the_cluster_file_passes_rays_schema_and_preparation(cloud: str) -> None:
    spec = _spec(f"spec.ray.cluster.cloud={cloud}", "spec.nodes.min=2", "spec.nodes.max=4")
    text = render(spec, "raycluster")
    config = yaml.safe_load(text)
    prepared = _prepared(config)
    types = prepared["available_node_types"]
    assert prepared["head_node_type"] == "head" and types["head"]["resources"] == {"CPU": 0}
    assert (types["worker"]["min_workers"], types["worker"]["max_workers"]) == (2, 4)
    assert (types["worker-on-demand"]["min_workers"], types["worker-on-demand"]["max_workers"]) == (0, 4)
    assert types["worker"]["priority"] > types["worker-on-demand"]["priority"]
    assert prepared["max_workers"] == 4 and prepared["provider"]["type"] == cloud
    assert prepared["docker"]["image"] == spec.spec.image
    assert "-v /mnt/shared:/mnt/shared" in prepared["docker"]["run_options"]
    # Token authentication on every node, with the submitter's token copied there.
    starts = prepared["head_start_ray_commands"] + prepared["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)
    assert prepared["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}
    assert text.startswith("# Ray cluster for torchrig job digits-ddp")


def test_spot_workers_and_their_on_demand_fallback() -> None:
    aws = compile_raycluster(_spec("spec.ray.cluster.fallbackInstanceType=m5.4xlarge")).to_dict()
    spot, fallback = aws["available_node_types"]["worker"], aws["available_node_types"]["worker-on-demand"]
    assert spot["node_config"]["InstanceMarketOptions"] == {"MarketType": "spot"}
    assert "InstanceMarketOptions" not in fallback["node_config"]
    assert fallback["node_config"]["InstanceType"] == "m5.4xlarge"
    one_gpu = ("spec.ray.cluster.cloud=gcp", "spec.resources.gpus=1", "spec.procsPerNode=1")
    gcp = compile_raycluster(_spec(*one_gpu)).to_dict()
    gpu_spot = gcp["available_node_types"]["worker"]["node_config"]
    assert gpu_spot["machineType"] == "a2-highgpu-1g"
    assert gpu_spot["scheduling"] == {"onHostMaintenance": "TERMINATE", "preemptible": True, "automaticRestart": False}
    on_demand = compile_raycluster(_spec("spec.ray.cluster.spot=false")).to_dict()
    assert set(on_demand["available_node_types"]) == {"head", "worker"}


def test_without_docker_setup_commands_pin_torch_ray_and_torchrig() -> None:
    config = compile_raycluster(_spec("spec.ray.cluster.docker=false", "spec.ray.rayVersion=2.55.1")).to_dict()
    assert "docker" not in config
    (command,) = config["setup_commands"]
    assert "torch==2.13.0" in command and "'ray[default,train]==2.55.1'" in command
    assert "'torchrig[ray]==0.1.0'" in command
    _prepared(config)


def test_gcp_needs_a_project_and_big_requests_name_a_type() -> None:
    with pytest.raises(SpecError, match=r"^spec\.ray\.cluster\.projectId: required for gcp"):
        compile_raycluster(load_spec(EXAMPLE, [*SHARED, "spec.ray.cluster.cloud=gcp"]))
    with pytest.raises(UnsupportedFeature, match=r"^spec\.resources: no default aws VM type .*workerInstanceType"):
        compile_raycluster(_spec("spec.resources.cpu=500"))
    named = compile_raycluster(_spec("spec.resources.cpu=500", "spec.ray.cluster.workerInstanceType=x9.huge"))
    assert named.to_dict()["available_node_types"]["worker"]["resources"] == {"CPU": 500}


def test_cli_render_takes_the_cloud() -> None:
    runner = CliRunner()
    args = ["render", str(EXAMPLE), "--target", "raycluster", *[a for s in SHARED for a in ("--set", s)]]
    out = runner.invoke(cli, [*args, "--cloud", "gcp", "--set", "spec.ray.cluster.projectId=p"])
    assert out.exit_code == 0, out.output
    assert yaml.safe_load(out.output)["provider"]["type"] == "gcp"
    other = runner.invoke(cli, ["render", str(EXAMPLE), "--target", "torchrun", "--cloud", "aws"])
    assert other.exit_code == 2 and "--cloud: applies to Ray cluster files only" in other.output


# -- the stores of a remote Ray cluster ----------------------------------------------------------------


def test_a_relative_store_without_a_shared_dir_is_refused_even_with_the_override() -> None:
    spec = load_spec(EXAMPLE)  # file://./checkpoints
    for allow in (False, True):
        with pytest.raises(UnsupportedFeature, match=r"^spec\.checkpoint\.stores\[0\]\.uri: file://\./checkpoints is "):
            check_target(spec, "raycluster", allow_pod_local_stores=allow)
    # Under the shared directory the run directory lives there, and so does the relative store.
    assert check_target(load_spec(EXAMPLE, SHARED), "raycluster") == []


def test_only_node_local_stores_are_refused_unless_allowed() -> None:
    spec = load_spec(EXAMPLE, ["spec.checkpoint.stores[0].uri=file:///data/ckpt"])
    with pytest.raises(UnsupportedFeature) as e:
        check_target(spec, "raycluster")
    assert str(e.value).startswith("spec.checkpoint.stores: every store is node-local")
    assert str(e.value).endswith("(to accept it anyway: --allow-pod-local-stores)")
    assert check_target(spec, "raycluster", allow_pod_local_stores=True) == [str(e.value)]
    # The same store under sharedDir, or an object store beside it, is shared.
    under = load_spec(EXAMPLE, ["spec.checkpoint.stores[0].uri=file:///data/ckpt", "spec.ray.sharedDir=/data"])
    assert remote_ray_stores_problem(under) is None
    s3 = ["spec.checkpoint.stores[0].uri=s3://bucket/x", "spec.checkpoint.stores[0].pvc=null"]
    assert remote_ray_stores_problem(load_spec(EXAMPLE, s3)) is None
    outside = load_spec(EXAMPLE, ["spec.checkpoint.stores[0].uri=file:///data/ckpt", "spec.ray.sharedDir=/dat"])
    assert "outside spec.ray.sharedDir (/dat)" in (remote_ray_stores_problem(outside) or "")


def test_cli_override_is_the_kubernetes_one_under_both_names() -> None:
    runner = CliRunner()
    base = ["render", str(EXAMPLE), "--target", "raycluster", "--set", "spec.checkpoint.stores[0].uri=file:///d/c"]
    refused = runner.invoke(cli, base)
    assert refused.exit_code == 2 and "every store is node-local" in refused.output
    for flag in ("--allow-pod-local-stores", "--allow-node-local-stores"):
        ok = runner.invoke(cli, [*base, flag])
        assert ok.exit_code == 0 and "warning: spec.checkpoint.stores: every store is node-local" in ok.output


def test_shared_dir_is_an_absolute_directory() -> None:
    for bad in ("mnt/x", "/mnt/../etc"):
        with pytest.raises(SpecError, match="sharedDir"):
            load_spec(EXAMPLE, [f"spec.ray.sharedDir={bad}"])


# -- random specs ------------------------------------------------------------------------------------


@st.composite
def cluster_specs(draw: st.DrawFn) -> JobSpec:
    n_min = draw(st.integers(1, 8))
    n_max = draw(st.integers(n_min, 64))
    gpus = draw(st.sampled_from([0, 0, 1, 2, 4, 8]))
    cloud = draw(st.sampled_from(["aws", "gcp"]))
    overrides = [
        *SHARED,
        f"spec.nodes.min={n_min}",
        f"spec.nodes.max={n_max}",
        f"spec.resources.gpus={gpus}",
        f"spec.procsPerNode={gpus or draw(st.integers(1, 4))}",
        f"spec.resources.cpu={draw(st.sampled_from(['500m', '1', '2', '3.5', '8', '16']))}",
        f"spec.resources.memory={draw(st.sampled_from(['512Mi', '4Gi', '16G', '60Gi']))}",
        f"spec.ray.cluster.cloud={cloud}",
        f"spec.ray.cluster.spot={str(draw(st.booleans())).lower()}",
        f"spec.ray.cluster.docker={str(draw(st.booleans())).lower()}",
        f"spec.ray.cluster.idleTimeoutMinutes={draw(st.integers(1, 600))}",
        "spec.ray.cluster.projectId=proj-1",
    ]
    if draw(st.booleans()):
        overrides.append(f"spec.ray.cluster.region={draw(st.sampled_from(['eu-west-1', 'europe-west4']))}")
    return load_spec(EXAMPLE, overrides)


@given(spec=cluster_specs(), fixed_size=st.booleans())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_specs_give_cluster_files_ray_accepts(spec: JobSpec, fixed_size: bool) -> None:
    s = spec.spec
    config = compile_raycluster(spec, fixed_size=fixed_size).to_dict()
    prepared = _prepared(config)
    worker = prepared["available_node_types"]["worker"]
    assert worker["min_workers"] == (s.nodes.max if fixed_size else s.nodes.min)
    assert worker["max_workers"] == prepared["max_workers"] == s.nodes.max
    assert worker["resources"].get("GPU", 0) >= s.resources.gpus
    assert worker["resources"]["CPU"] >= math.ceil(float(parse_quantity(s.resources.cpu)))
    shape = {t.name: t for t in INSTANCE_TYPES[s.ray.cluster.cloud]}
    name = worker["node_config"].get("InstanceType") or worker["node_config"]["machineType"]
    assert shape[name].memory_gib * 2**30 >= float(parse_quantity(s.resources.memory))
    assert ("worker-on-demand" in prepared["available_node_types"]) == s.ray.cluster.spot
    assert prepared["idle_timeout_minutes"] == s.ray.cluster.idle_timeout_minutes
