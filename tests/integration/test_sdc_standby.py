"""An SDC suspect's node swapped for a standby node (`restarts.spareNodes`), end to end on the local backend:
the digits example on 2 emulated nodes x 2 ranks and 1 standby node, a real bit flipped in rank 2's memory,
the majority names rank 2, the group hands node 1 to the standby (`protocol.decide_handover`: one signed
compare-and-set every rank reads alike, then the `sdc/handover` record the standby takes at once), both of
node 1's ranks leave and their hosts exit 0 (`HandOver`: no spare of the suspect node), the standby's spares
take ranks 2 and 3, every member reloads the newest certified checkpoint in place, and the end is bit-identical
to an uninterrupted run with no group restart. The same job without a standby node rolls back with a spare of
the suspect's own node (its event says so); both recoveries' MTTR (the flip to the first step after) are
measured in the same test. A store-level test checks the record itself (signed, taken once)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends import get_backend
from orchestrator.backends.base import LocalOptions, SubmitOptions
from orchestrator.drills.history import RunHistory
from orchestrator.loader import load_spec
from orchestrator.spec import JobSpec
from tests.fixtures.common import REPO, free_port
from training.contract import Env, EventKind, RunFiles, read_events
from training.inplace.protocol import ROLLBACK_PATH

STEPS = 400
# Late enough for the standby's spares to be warm: 35 s of paced steps (20 s was not, at a load of 11 on 2 cores).
FLIP_STEP = 353
PACE_S = 0.1  # seconds every rank sleeps per step (a `slow` fault on every rank): the flip comes after warm-up
RUN_TIMEOUT_S = 300.0
FLIP = {"kind": "bitflip", "rank": 2, "step": FLIP_STEP, "target": "param", "tensor": 5, "element": 3}
PACE = {"kind": "slow", "rank": -1, "generation": -1, "step": 1, "seconds": PACE_S}


def sdc_standby_spec(spare_nodes: int, port: int, steps: int = STEPS) -> JobSpec:
    """Digits on 2 nodes x 2 ranks, a replica check every 5 steps, `spare_nodes` standby nodes."""
    return load_spec(
        REPO / "examples" / "digits-ddp.yaml",
        [
            f"spec.training.steps={steps}",
            "spec.checkpoint.every.steps=10",
            "spec.training.evalAtEnd=false",
            "spec.training.lrSchedule.warmupSteps=2",
            "spec.metrics.logEvery=10",
            "spec.nodes.min=2",
            "spec.nodes.max=2",
            "spec.procsPerNode=2",
            "spec.sdc.every=5",
            f"spec.restarts.spareNodes={spare_nodes}",
            f"spec.metrics.port={port}",
        ],
    )


def _run(spec: JobSpec, run_dir: Path, faults: list[dict[str, Any]]) -> Any:
    """The job on 2 emulated nodes (its standby nodes beside them); its summary."""
    env = {Env.FAULTS: json.dumps(faults)} if faults else {}
    options = SubmitOptions(run_dir=str(run_dir), quiet=True, env=env, local=LocalOptions(nodes=2))
    run = get_backend("local").launch(spec, options)
    return run.wait(timeout_s=RUN_TIMEOUT_S)


def _mttr(run_dir: Path) -> float:
    """Seconds from the bit flip (the worker's `fault` event) to the first step completed after every member
    rolled back in place (the drill's own measure, `orchestrator.drills.runner`)."""
    history = RunHistory.load(run_dir)
    (flip,) = [e for e in history.of(EventKind.FAULT) if e.get("kind") == "bitflip"]
    rolled = [e for e in history.of(EventKind.RECOVERY) if e.time >= flip.time and e.get("path") == ROLLBACK_PATH]
    assert rolled, "no member rolled back in place"
    first = history.first_step_after(max(e.time for e in rolled))
    assert first is not None
    return round(first.time - flip.time, 3)


def test_a_standby_takes_a_signed_handover_once_and_ignores_a_forged_one() -> None:
    """Against a real c10d store: a hand-over record without the job's MAC is no order; the signed one names
    node 1, which the first standby takes (every rank of it assigned to its spares, the next generation),
    the second never (the same compare-and-set, keyed by the generation), and the node's own spares, alive,
    are left unclaimed (they end with its hosts); a later hand-over of the same node index is another key."""
    import torch.distributed as dist

    from training.inplace import InPlace
    from training.inplace.standby import Launch, Round, Standby

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    secret = b"k" * 32
    found = Round(token="tok", round=0, nodes=2)
    launch = Launch(f"127.0.0.1:{store.port}", "job", 2, 0, ["python", "-m", "training"], secret=secret)
    first, second = (Standby(launch, store, found, slot, {}) for slot in (0, 1))
    node1 = InPlace("", "job", 0, node_rank=1, spares=1, timeout_s=5, round_token="tok", secret=secret)
    space = first.store
    space.add(node1.spawned_key, 1)  # node 1's own warm spare, alive
    for rank in (2, 3):
        node1.write(space, node1.rank_gen_key(rank), "3")
    for local in range(2):
        first.inplace.write(space, first.inplace.spare_key(local, "ready"), str(501 + local))
    space.set(InPlace.handover_key(), json.dumps({"node": 1, "generation": 3}))  # forged: no MAC
    assert first.handover() is None and second.handover() is None
    node1.write(space, InPlace.handover_key(), json.dumps({"node": 1, "generation": 3}))
    handed = first.handover()
    assert handed == (1, b"sdc3") and second.handover() == handed
    assert first.take(*handed, handover=True)
    assert first.handed_over, "its own agent passes the exit barrier: the standby does not stand in for it"
    assert not second.take(*handed, handover=True) and second.handover() is None, "taken once"
    assert not space.check([node1.spare_key(0, "claim")]), "the node's spare is alive: not marked lost"
    for local, rank in ((0, 2), (1, 3)):
        assignment = json.loads(first.inplace.read(space, first.inplace.spare_key(local, "assign")) or "")
        assert assignment["generation"] == 4 and assignment["env"][Env.RANK] == str(rank)
        assert node1.read(space, node1.owner_key(rank)) == str(501 + local)
    node1.write(space, InPlace.handover_key(), json.dumps({"node": 7, "generation": 5}))
    assert second.handover() is None, "no node of the round"


# In `make soak`, not `make test`: three paced 400-step jobs (3-4 minutes on 2 cores) for what the sdc drill
# with a standby node already proves in `make test` (tests/integration/test_sdc_drill_standby.py: the swap,
# the standby's spares in the suspect node's ranks, certified rollback, 0 restarts, bit-identical); this one
# adds the same-node spare beside it and both MTTRs, for docs/drills.md's comparison.
@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(int(3 * RUN_TIMEOUT_S + 120))
def test_a_suspect_node_is_swapped_for_a_standby_and_the_job_ends_bit_identical(tmp_path: Path) -> None:
    port = free_port()
    reference = _run(sdc_standby_spec(0, port), tmp_path / "reference", [])
    assert reference.status == "succeeded", reference.reason

    swapped = _run(sdc_standby_spec(1, port), tmp_path / "swapped", [PACE, FLIP])
    assert swapped.status == "succeeded", swapped.reason
    assert swapped.params_sha256 == reference.params_sha256, "the end is bit-identical to the uninterrupted run"
    assert swapped.restarts == 0, "no group restart: the swap and the rollback ran in place"
    events = read_events(RunFiles(str(tmp_path / "swapped")).events)
    (sdc,) = [e for e in events if e.kind == EventKind.SDC]
    assert sdc.get("suspects") == [2] and sdc.get("decided") is True and sdc.step == FLIP_STEP + 2
    # The standby took node 1: the event names it excluded, and no rank of it runs on the suspect node.
    assert sdc.get("replaced_by") == "standby", f"no standby was ready at the flip: {sdc.data}"
    assert sdc.get("excluded_node") == 1 and sdc.get("excluded_hosts") == sdc.get("suspect_hosts")
    assert swapped.sdc and swapped.sdc[0]["excluded_node"] == 1 and swapped.sdc[0]["replaced_by"] == "standby"
    rolled = [e for e in events if e.kind == EventKind.RECOVERY and e.get("path") == ROLLBACK_PATH]
    spares = sorted(e.rank for e in rolled if e.get("role") == "spare")
    assert spares == [2, 3], f"both of node 1's ranks went to the standby's spares: {[e.data for e in rolled]}"
    restores = [e for e in events if e.kind == EventKind.RESTORE and e.time >= sdc.time]
    assert restores and all(e.step is not None and e.step <= FLIP_STEP for e in restores)
    assert all(e.get("certified") is True for e in restores)
    logs = tmp_path / "swapped" / "logs"
    standby_log = (logs / "node2.log").read_text(errors="replace")
    assert "torchrig: standby: node 1 is an SDC suspect's, handed over by the replicas; this standby takes its" in (
        standby_log
    )
    node1_log = (logs / "node1.log").read_text(errors="replace")
    assert "a standby node takes this node's ranks (an SDC suspect's node); this host leaves" in node1_log
    assert "takes its place" not in node1_log, "no spare of the suspect node took a rank"

    same_node = _run(sdc_standby_spec(0, port), tmp_path / "same-node", [PACE, FLIP])
    assert same_node.status == "succeeded", same_node.reason
    assert same_node.params_sha256 == reference.params_sha256 and same_node.restarts == 0
    (alone,) = [e for e in read_events(RunFiles(str(tmp_path / "same-node")).events) if e.kind == EventKind.SDC]
    assert alone.get("replaced_by") == "spare" and alone.get("excluded_hosts") == []
    mttr = {"standby": _mttr(tmp_path / "swapped"), "same_node_spare": _mttr(tmp_path / "same-node")}
    print(f"sdc mttr (flip -> first step after the rollback): {json.dumps(mttr)}")
