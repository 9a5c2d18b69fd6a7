"""The `sdc` drill end to end on the local backend: a real bit flipped in one rank's memory, real DDP
replicas compared (`training.sdc`), a real group restart from the newest certified checkpoint, and the
end bit-identical to an uninterrupted reference. At 2 ranks (no majority: the event says undecided) and
at 4 (the majority names the flipped rank)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.drills import DrillOptions, run_drill
from orchestrator.loader import load_spec
from orchestrator.spec import JobSpec
from tests.fixtures.common import REPO, free_port
from training.contract import EventKind, RunFiles, read_events


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "seed", "rank"),
    [(2, 0, 1), (4, 1, 2)],  # the seed picks where the bit flips: 0 a parameter, 1 an AdamW moment, 2 a gradient
)
def test_a_flipped_bit_is_found_its_rank_named_and_the_job_ends_bit_identical(
    tmp_path: Path, world: int, seed: int, rank: int
) -> None:
    spec = load_spec(
        REPO / "examples" / "digits-ddp.yaml",
        [
            "spec.training.steps=30",
            "spec.checkpoint.every.steps=5",
            "spec.training.evalAtEnd=false",
            "spec.training.lrSchedule.warmupSteps=2",
            "spec.metrics.logEvery=5",
            "spec.nodes.min=1",
            "spec.nodes.max=1",
            f"spec.procsPerNode={world}",
            "spec.sdc.every=5",
            f"spec.metrics.port={free_port()}",
        ],
    )
    options = DrillOptions(seed=seed, at_step=13, rank=rank, drill_dir=str(tmp_path / "sdc"), timeout_s=300)
    report = run_drill("sdc", spec, options)
    failed = [(c.name, c.detail) for c in report.checks if not c.passed]
    assert report.passed, f"failed checks: {failed}\n" + json.dumps(report.to_dict(), default=str)[-3000:]
    events = read_events(RunFiles(report.run_dir or "").events)
    (flip,) = [e for e in events if e.kind == EventKind.FAULT and e.get("kind") == "bitflip"]
    assert flip.rank == rank and flip.step == 13
    sdc = [e for e in events if e.kind == EventKind.SDC]
    assert sdc and sdc[0].step == 15 and sdc[0].get("last_agreed_step") == 10
    assert sdc[0].get("decided") is (world > 2)
    assert sdc[0].get("suspects") == ([0, 1] if world == 2 else [rank])
    # Nothing after the flip was restored, and what was restored says it is certified.
    assert report.resumed_from_step == 10 and report.final_params_match_reference is True


@pytest.mark.slow
def test_hsdp_compares_each_shards_replicas_across_nodes(tmp_path: Path) -> None:
    """HSDP on 2 emulated nodes x 2 ranks (mesh 2 x 2): ranks 1 and 3 hold the same shard; an AdamW moment
    of rank 3's shard flips (a DTensor's local shard), the two replicas of that shard disagree (no majority
    between two: undecided), the others agree, and the restart from the certified checkpoint ends
    bit-identical."""
    spec = load_spec(
        REPO / "examples" / "digits-ddp.yaml",
        [
            "spec.training.steps=30",
            "spec.checkpoint.every.steps=5",
            "spec.training.evalAtEnd=false",
            "spec.training.strategy=hsdp",
            "spec.nodes.min=2",
            "spec.nodes.max=2",
            "spec.procsPerNode=2",
            "spec.sdc.every=5",
            f"spec.metrics.port={free_port()}",
        ],
    )
    options = DrillOptions(seed=1, at_step=13, rank=3, nodes=2, drill_dir=str(tmp_path / "sdc"), timeout_s=300)
    report = run_drill("sdc", spec, options)
    failed = [(c.name, c.detail) for c in report.checks if not c.passed]
    assert report.passed, f"failed checks: {failed}\n" + json.dumps(report.to_dict(), default=str)[-3000:]
    sdc = [e for e in read_events(RunFiles(report.run_dir or "").events) if e.kind == EventKind.SDC]
    assert sdc and sdc[0].step == 15 and sdc[0].get("suspects") == [1, 3] and not sdc[0].get("decided")
    assert report.final_params_match_reference is True


# tinygpt small enough for a CPU test (the example's own size is a GPU cluster's), DDP in fp32 so the
# replicas' bits can agree; one metrics port per world size so that the drills of one world share one
# uninterrupted reference (orchestrator.drills.runner keys its cache by the job).
_TINYGPT_PORTS: dict[int, int] = {}


def _tinygpt_spec(world: int) -> JobSpec:
    port = _TINYGPT_PORTS.setdefault(world, free_port())
    return load_spec(
        REPO / "examples" / "digits-ddp.yaml",
        [
            "spec.task.entrypoint=training.examples.tinygpt:task",
            "spec.task.args={dim: 32, layers: 2, heads: 2, seq_len: 16, max_bytes: 40000}",
            "spec.training.steps=20",
            "spec.training.batchSize=8",
            "spec.checkpoint.every.steps=5",
            "spec.training.evalAtEnd=false",
            "spec.training.lrSchedule.warmupSteps=2",
            "spec.metrics.logEvery=5",
            "spec.nodes.min=1",
            "spec.nodes.max=1",
            f"spec.procsPerNode={world}",
            "spec.sdc.every=5",
            f"spec.metrics.port={port}",
        ],
    )


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2], ids=["param", "moment", "grad"])
def test_tinygpt_a_flipped_bit_in_each_place_is_found_and_the_job_ends_bit_identical(
    tmp_path: Path, world: int, seed: int
) -> None:
    """The sdc drill on the tinygpt example (a transformer: embeddings, attention, LayerNorm, a tied output
    layer) for a parameter, an AdamW moment and a gradient flipped on the last rank at step 8."""
    rank = world - 1
    options = DrillOptions(seed=seed, at_step=8, rank=rank, drill_dir=str(tmp_path / "sdc"), timeout_s=300)
    report = run_drill("sdc", _tinygpt_spec(world), options)
    failed = [(c.name, c.detail) for c in report.checks if not c.passed]
    assert report.passed, f"failed checks: {failed}\n" + json.dumps(report.to_dict(), default=str)[-3000:]
    events = read_events(RunFiles(report.run_dir or "").events)
    (flip,) = [e for e in events if e.kind == EventKind.FAULT and e.get("kind") == "bitflip"]
    assert flip.rank == rank and flip.step == 8
    sdc = [e for e in events if e.kind == EventKind.SDC]
    assert sdc and sdc[0].step == 10 and sdc[0].get("last_agreed_step") == 5
    assert sdc[0].get("suspects") == (list(range(world)) if world == 2 else [rank])
    assert report.resumed_from_step == 5 and report.final_params_match_reference is True
