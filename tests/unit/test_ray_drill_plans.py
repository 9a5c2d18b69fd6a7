"""The Ray side of the node drills without a Ray: `kill-node` on `--backend ray` plans a kill and a look at the
progress (no shrink, no rejoin: one machine's CPUs come back at once) and compares with the reference
(`tests/integration/test_ray_drills.py` finds the workers of real processes)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.backends.ray_run import ray_hosts
from orchestrator.drills.plan import AwaitProgress, AwaitStep, DrillOptions, NodeKill
from orchestrator.drills.scenarios import get_scenario
from tests.unit.test_drill_plans import _ctx, _spec


def test_kill_node_on_ray_kills_and_waits_for_progress_and_compares_with_the_reference() -> None:
    scenario = get_scenario("kill-node")
    fixed = _spec("spec.nodes.min=1", "spec.nodes.max=1")
    plan = scenario.plan(fixed, _ctx(nodes=1, world_size=2, options=DrillOptions(backend="ray")))
    assert plan.actions == (AwaitStep(23), NodeKill(0), AwaitProgress(2))
    # One node, fixed size: the local backend needs an elastic job that can lose a node; Ray does not.
    assert scenario.nodes_unmet(fixed, 1, "ray") is None
    assert scenario.nodes_unmet(fixed, 1) is not None
    assert scenario.nodes_unmet(fixed, 2, "ray") is not None  # more nodes than spec.nodes allows
    assert scenario.compares(fixed, "ray") and not scenario.compares(fixed)
    # The partition drill's nodes are network namespaces of the local backend: no Ray variant.
    assert get_scenario("partition").nodes_unmet(fixed, 1, "ray") is not None


def test_ray_hosts_of_a_run_without_events_is_empty(tmp_path: Path) -> None:
    assert ray_hosts(tmp_path, 2) == []
