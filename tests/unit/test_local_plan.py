"""The local plan (what a local launch runs) and the launch request a detached run stores: plain data
that survives JSON, so the supervisor process starts exactly what the dry run showed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from orchestrator.backends.base import (
    KubernetesOptions,
    LocalOptions,
    NodePlacement,
    RayOptions,
    SubmitOptions,
)
from orchestrator.backends.local import LocalBackend
from orchestrator.backends.local_plan import LocalPlan, create_local_plan
from orchestrator.backends.ray import RayBackend
from orchestrator.backends.supervise import options_from_json
from orchestrator.loader import load_spec
from tests.fixtures.common import REPO
from training.contract import Env

EXAMPLE = REPO / "examples" / "digits-ddp.yaml"
PLACEMENTS = [
    NodePlacement(prefix=("ip", "netns", "exec", "ns0"), addr="10.0.0.1", ifname="veth0"),
    NodePlacement(prefix=("ip", "netns", "exec", "ns1"), addr="10.0.0.2", ifname="veth1"),
]


def _json_roundtrip(data: object) -> Any:
    return json.loads(json.dumps(data))


def test_plan_reads_the_typed_local_options(tmp_path: Path) -> None:
    spec = load_spec(EXAMPLE)
    options = SubmitOptions(
        env={"X": "1"}, local=LocalOptions(nodes=2, worker="tests/w.py", placements=list(PLACEMENTS))
    )
    plan = create_local_plan(spec, options, tmp_path / "r", resume=False)
    assert plan.nodes == 2 and plan.worker == ["tests/w.py"]
    assert plan.env[Env.RUN_DIR] == str((tmp_path / "r").resolve()) and plan.env["X"] == "1"
    assert plan.placement(0) == PLACEMENTS[0] and plan.store_host == "10.0.0.1"
    assert plan.placement(5) == PLACEMENTS[1], "a replacement node takes the last placement"
    cmd = plan.agent_command(1, 29500, "job.yaml")
    assert cmd[:4] == ["ip", "netns", "exec", "ns1"]
    assert "--local-addr=10.0.0.2" in cmd and "--rdzv-endpoint=10.0.0.1:29500" in cmd
    default = create_local_plan(spec, SubmitOptions(), tmp_path / "d", resume=False)
    assert default.nodes == spec.spec.nodes.min and default.worker == ["-m", "training"]
    assert default.placement(3) == NodePlacement()


def test_plan_survives_json(tmp_path: Path) -> None:
    spec = load_spec(EXAMPLE)
    options = SubmitOptions(local=LocalOptions(nodes=2, placements=list(PLACEMENTS)))
    plan = create_local_plan(spec, options, tmp_path / "r", resume=True)
    again = LocalBackend().request_from_json(_json_roundtrip(plan.to_json()))
    assert isinstance(again, LocalPlan) and again == plan
    assert again.to_dict() == plan.to_dict()


def test_submit_options_survive_json() -> None:
    options = SubmitOptions(
        run_dir="r",
        fixed_size=True,
        quiet=True,
        env={"A": "b"},
        local=LocalOptions(nodes=3, worker="w", placements=list(PLACEMENTS)),
        ray=RayOptions(address="http://h:8265"),
        kubernetes=KubernetesOptions(context="c", namespace="n"),
    )
    assert options_from_json(_json_roundtrip(dataclasses.asdict(options))) == options
    assert options_from_json(_json_roundtrip(dataclasses.asdict(SubmitOptions()))) == SubmitOptions()


def test_embedded_ray_dry_run_names_its_run_dir(tmp_path: Path) -> None:
    spec = load_spec(EXAMPLE)
    request = RayBackend().dry_run(spec, SubmitOptions(run_dir=str(tmp_path / "r"))).request
    local = request["local"]
    assert local["run_dir"] == str((tmp_path / "r").resolve())
    assert local["env"][Env.RUN_DIR] == local["run_dir"] and local["node_ip_address"] == "127.0.0.1"
    assert "jobs_api" not in request and not (tmp_path / "r").exists()
    # A cluster's entrypoint runs in Ray's working-dir cache: a relative store needs a directory every node
    # mounts (`spec.ray.sharedDir`), even for a cluster on this machine.
    shared = load_spec(EXAMPLE, [f"spec.ray.sharedDir={tmp_path / 'shared'}"])
    remote = RayBackend().dry_run(shared, SubmitOptions(ray=RayOptions(address="http://127.0.0.1:8265"))).request
    assert remote["jobs_api"]["address"] == "http://127.0.0.1:8265" and "local" not in remote
