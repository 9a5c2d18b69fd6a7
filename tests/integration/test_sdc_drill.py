"""The `sdc` drill end to end on the local backend: a real bit flipped in one rank's memory, real DDP
replicas compared (`training.sdc`), and the end bit-identical to an uninterrupted reference. Where the
suspect is decided (a majority at 4 ranks; at 2 the replay) it leaves, a warm spare takes its rank and the
survivors reload the newest certified checkpoint in place (`inplace-rollback`); undecided, and under HSDP,
the group restarts from that checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    # A majority decides at 4; at 2 the replay (`training.sdc`, the gradient trail where states cannot tell).
    suspects, decided = sdc[0].get("suspects") or [], sdc[0].get("decided") is True
    assert suspects == [rank] and decided, sdc[0].data
    # Nothing after the flip was restored, and what was restored says it is certified.
    assert report.resumed_from_step == 10 and report.final_params_match_reference is True
    rolled_back = decided and len(suspects) < world  # someone is left to roll back
    assert report.recovery_path == ("inplace-rollback" if rolled_back else "restart")
    assert report.mttr_seconds is not None


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
    assert sdc and sdc[0].step == 15 and 3 in (sdc[0].get("suspects") or []) and 0 not in sdc[0].get("suspects")
    # HSDP recovers in place from in-memory snapshots, which may postdate the flip: it restarts from disk.
    assert report.final_params_match_reference is True and report.recovery_path == "restart"


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


# Two replicas: a tinygpt flip at step 8 reaches the other rank through the gradient all-reduces of steps 9
# and 10, so neither original state is what a clean replay reproduces (`training.sdc.decide_replay`); the
# gradient trail (`training.sdc_replay.GradientTrail`) names the rank whose own gradient departed from the
# replay first: the flipped one, a step before its peer.
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
    suspects, decided = sdc[0].get("suspects") or [], sdc[0].get("decided") is True
    assert suspects == [rank] and decided, sdc[0].data
    assert report.resumed_from_step == 5 and report.final_params_match_reference is True
    rolled_back = decided and len(suspects) < world
    assert report.recovery_path == ("inplace-rollback" if rolled_back else "restart")


def _digits_run(
    tmp_path: Path, name: str, faults: list[dict[str, object]], recompute_every: int, every: int = 1
) -> Path:
    """The digits job at 2 ranks under torchrun (one restart allowed), the replica check every `every` steps;
    its run directory."""
    import os
    import subprocess
    import sys

    import yaml

    from orchestrator.loader import apply_overrides, read_yaml

    digits = REPO / "examples" / "digits-ddp.yaml"
    overrides = [
        "spec.training.steps=16",
        "spec.checkpoint.every.steps=4",
        "spec.training.evalAtEnd=false",
        "spec.metrics.enabled=false",
        f"spec.sdc.every={every}",
        f"spec.sdc.recomputeEvery={recompute_every}",
    ]
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(apply_overrides(read_yaml(digits.read_text(), str(digits)), overrides)))
    run_dir = tmp_path / name
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
        "--log-dir", str(tmp_path / f"{name}-logs"), "-m", "training", "--spec", str(spec), "--run-dir", str(run_dir),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHRIG_FAULTS": json.dumps(faults)}
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_local_gradient_flipped_before_the_all_reduce_is_seen_by_recompute_only(tmp_path: Path) -> None:
    """A bit of rank 1's own gradient flipped before DDP's all-reduce at step 7 (`local_grad`): the average
    carries it into both replicas alike, so the replica check, run at every step, sees nothing and the job
    ends with different parameters than a clean run; with `sdc.recomputeEvery` 1, rank 0's recomputation of
    rank 1's gradient disagrees at step 7 itself, rank 1 is named (rank 1's recomputation of rank 0 vouches
    for rank 0), nothing of the flip is applied, and the restarted job ends bit-identical to the clean run."""
    # the output layer's bias (parameter 5): its gradient is never 0 (the default, the first weight of the first
    # layer, meets a pixel that is 0 in every image: its gradient is 0, and a flipped 0 is too small to matter)
    flip = [{"kind": "bitflip", "rank": 1, "step": 7, "target": "local_grad", "tensor": 5, "element": 3}]
    clean = _digits_run(tmp_path, "clean", [], recompute_every=1)
    unseen = _digits_run(tmp_path, "unseen", flip, recompute_every=0)
    seen = _digits_run(tmp_path, "seen", flip, recompute_every=1)

    def sha(run_dir: Path) -> str:
        return str(json.loads(RunFiles(str(run_dir)).result.read_text())["params_sha256"])

    unseen_events = read_events(RunFiles(str(unseen)).events)
    assert [e.step for e in unseen_events if e.kind == EventKind.FAULT and e.get("kind") == "bitflip"] == [7]
    assert not [e for e in unseen_events if e.kind == EventKind.SDC]  # the replicas agreed at every step
    assert sha(unseen) != sha(clean)  # ... on a corrupted model

    events = read_events(RunFiles(str(seen)).events)
    (sdc,) = [e for e in events if e.kind == EventKind.SDC]
    assert sdc.step == 7 and sdc.get("evidence") == "recompute"
    assert sdc.get("suspects") == [1] and sdc.get("decided") is True
    own, recomputed = sdc.get("fingerprints"), sdc.get("recomputed")
    assert recomputed[1] == own[0] and recomputed[0] != own[1]  # the evidence: which fingerprints differed
    restores = [e for e in events if e.kind == EventKind.RESTORE]
    assert restores and restores[-1].step == 4 and restores[-1].get("certified") is True
    assert sha(seen) == sha(clean)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_replicas_the_replay_decides_a_flip_found_before_it_spread(tmp_path: Path) -> None:
    """Two replicas, a parameter flipped on rank 1 after step 7 (the output bias: it reaches the next
    gradient). With a recompute check every step it is found at step 8, before that step's optimizer applies
    the all-reduced spread: the two ranks' recomputations both disagree (undecided), the replica check of
    step 7 runs, and its replay from the state agreed at step 5 reproduces rank 0 and not rank 1: rank 1,
    decided. Without it the check before the save of step 8 comes after the flip was averaged into rank 0
    too: no rank's state is reproduced, and the gradient trail decides: rank 1's own gradient of step 8
    departed from the replay, rank 0's did not. Both end bit-identical to a clean run."""
    flip = [{"kind": "bitflip", "rank": 1, "step": 7, "target": "param", "tensor": 5, "element": 3}]
    clean = _digits_run(tmp_path, "clean", [], recompute_every=1, every=5)
    early = _digits_run(tmp_path, "early", flip, recompute_every=1, every=5)
    late = _digits_run(tmp_path, "late", flip, recompute_every=0, every=5)

    def sdc_events(run_dir: Path) -> list[Any]:
        return [e for e in read_events(RunFiles(str(run_dir)).events) if e.kind == EventKind.SDC]

    (found,) = sdc_events(early)
    assert (found.step, found.get("evidence"), found.get("suspects"), found.get("decided")) == (7, "replica", [1], True)
    assert found.get("detail") == "replay: rank(s) 1 disagree"
    (spread,) = sdc_events(late)
    assert (spread.step, spread.get("suspects"), spread.get("decided")) == (8, [1], True)  # the save's check
    assert spread.get("detail") == "replay: rank(s) 1 disagree"
    for run_dir in (early, late):
        result = json.loads(RunFiles(str(run_dir)).result.read_text())
        assert result["params_sha256"] == json.loads(RunFiles(str(clean)).result.read_text())["params_sha256"]
