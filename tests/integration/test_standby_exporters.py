"""A local run's standby exporters (`restarts.spareNodes`): listed apart from the members'. Here, not
among the unit tests, because laying out the exporters probes each port with a bind
(`local_plan.pick_port_block`)."""

from __future__ import annotations

from typing import Any

from orchestrator.loader import load_spec
from tests.fixtures.common import REPO

EXAMPLE = REPO / "examples" / "digits-ddp.yaml"


def test_a_local_runs_standby_exporters_are_listed_apart(tmp_path: Any) -> None:
    """A standby node's exporters serve only once it has taken a node: `torchrig run` lists them apart
    from the members' (a scrape of them before then finds nothing listening)."""
    from orchestrator.backends.base import SubmitOptions
    from orchestrator.backends.local_plan import create_local_plan
    from orchestrator.backends.local_run import LocalRun

    spec = load_spec(EXAMPLE, ["spec.nodes.min=2", "spec.restarts.spareNodes=1", "spec.metrics.port=19400"])
    run = LocalRun(spec, create_local_plan(spec, SubmitOptions(run_dir=str(tmp_path)), tmp_path, resume=False))
    run.files.logs.mkdir(parents=True, exist_ok=True)
    run.files.job.write_text("")
    for node in range(3):
        run._node_spec_file(node)
    run._node_spec_file(3)  # a replacement node added later is a member again
    procs = run.plan.procs_per_node
    members = [*range(2 * procs), *range(3 * procs, 4 * procs)]
    assert run.endpoints == [f"http://127.0.0.1:{19400 + i}/metrics" for i in members]
    assert run.standby_endpoints == [f"http://127.0.0.1:{19400 + i}/metrics" for i in range(2 * procs, 3 * procs)]
