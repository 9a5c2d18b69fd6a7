"""Silent data corruption (training.sdc): the fingerprint, the majority, the monitor, the `bitflip` fault,
the manifest's `certified` and the restore order. No process group, no sockets: the exchanges are fakes.
The same on real DDP groups: tests/integration/test_sdc_drill.py."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from training.checkpoint.manifest import FileEntry, Manifest, ManifestLayoutError, parse_manifest
from training.checkpoint.restore import Candidate, order_candidates
from training.checkpoint.signing import SignatureError
from training.config import DEFAULT_SDC_EVERY, SdcConfig
from training.contract import EventKind, WorkerIdentity
from training.faults import FaultInjector, flip_bit, parse_faults
from training.metrics.base import MetricsSink
from training.sdc import (
    MASK64,
    SdcMonitor,
    SilentDataCorruption,
    decide,
    decide_groups,
    fingerprint,
    fingerprint_tensors,
    position_constant,
    replica_groups,
    replica_shards,
    tensor_constant,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8, torch.bool]


def reference_fingerprint(tensors: list[torch.Tensor]) -> int:
    """The documented hash in plain Python integers (exact modulo 2**64), to check torch's wrapping."""
    total = 0
    for t, tensor in enumerate(tensors):
        raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8).tolist()
        if len(raw) % 4 == 0:
            words = [int.from_bytes(bytes(raw[i : i + 4]), "little", signed=True) for i in range(0, len(raw), 4)]
        else:
            words = raw
        h = sum(w * position_constant(i) for i, w in enumerate(words)) & MASK64
        total = (total + h * tensor_constant(t)) & MASK64
    return total


@st.composite
def tensors_and_flip(draw: st.DrawFn) -> tuple[list[torch.Tensor], int, int, int]:
    count = draw(st.integers(1, 3))
    tensors = []
    for _ in range(count):
        dtype = draw(st.sampled_from(DTYPES))
        n = draw(st.integers(1, 40))
        data = draw(st.binary(min_size=n * torch.empty((), dtype=dtype).element_size(), max_size=None))
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.tensor(list(data[: n * size]), dtype=torch.uint8)
        if dtype is torch.bool:
            raw = raw & 1  # a bool byte other than 0/1 is no bool
        tensors.append(raw.view(dtype).clone())
    which = draw(st.integers(0, count - 1))
    victim = tensors[which]
    element = draw(st.integers(0, victim.numel() - 1))
    bit = draw(st.integers(0, 8 * victim.element_size() - 1))
    if victim.dtype is torch.bool:
        bit = 0
    return tensors, which, element, bit


@settings(max_examples=300, deadline=None)
@given(tensors_and_flip())
def test_every_single_bit_flip_changes_the_fingerprint(case: tuple[list[torch.Tensor], int, int, int]) -> None:
    tensors, which, element, bit = case
    before = fingerprint_tensors(tensors)
    assert before == reference_fingerprint(tensors)  # torch's int64 arithmetic wraps exactly like the spec
    flip_bit(tensors[which], element, bit)
    after = fingerprint_tensors(tensors)
    assert after != before
    assert after == reference_fingerprint(tensors)


def test_the_fingerprint_depends_on_position_and_order_not_only_on_values() -> None:
    t = torch.tensor([1.0, 2.0, 3.0])
    assert fingerprint_tensors([t]) != fingerprint_tensors([t.flip(0)])  # a float sum would not tell these apart
    a, b = torch.ones(4), torch.zeros(4)
    assert fingerprint_tensors([a, b]) != fingerprint_tensors([b, a])
    assert fingerprint_tensors([torch.tensor([0.0])]) != fingerprint_tensors([torch.tensor([-0.0])])  # equal floats


def test_a_chunked_tensor_hashes_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import training.sdc as sdc

    t = torch.randn(1000)
    whole = fingerprint_tensors([t])
    monkeypatch.setattr(sdc, "CHUNK_WORDS", 64)  # 1000 words in 16 chunks through one table of 64
    monkeypatch.setattr(sdc, "_POSITIONS", sdc._Positions())
    assert fingerprint_tensors([t]) == whole == reference_fingerprint([t])


def test_a_replica_fingerprint_covers_parameters_and_optimizer_state() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    base = fingerprint(model, optimizer, torch.device("cpu"))
    flip_bit(optimizer.state[model.weight]["exp_avg"], 3, 0)  # the least significant mantissa bit
    moment = fingerprint(model, optimizer, torch.device("cpu"))
    assert moment != base
    flip_bit(optimizer.state[model.weight]["exp_avg"], 3, 0)
    assert fingerprint(model, optimizer, torch.device("cpu")) == base
    flip_bit(model.bias, 1, 31)  # the sign bit
    assert fingerprint(model, optimizer, torch.device("cpu")) != base


# -- the decision ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fingerprints", "suspects", "decided"),
    [
        ([7, 7], (), True),
        ([7, 7, 7, 7], (), True),
        ([7, 7, 9, 7], (2,), True),
        ([9, 7, 7], (0,), True),
        ([7, 7, 7, 9, 9], (3, 4), True),
        ([7, 9], (0, 1), False),  # two replicas: no majority
        ([7, 7, 9, 9], (0, 1, 2, 3), False),  # a tie
        ([7, 7, 9, 5], (2, 3), False),  # a plurality, not a majority
        ([1, 2, 3], (0, 1, 2), False),
    ],
)
def test_a_strict_majority_names_the_suspects(
    fingerprints: list[int], suspects: tuple[int, ...], decided: bool
) -> None:
    decision = decide(fingerprints)
    assert decision.agreed == (not suspects)
    assert decision.suspects == suspects
    assert decision.decided == decided
    if not decided:
        assert "undecided between ranks" in decision.describe()


@given(st.lists(st.integers(0, 3), min_size=2, max_size=9))
def test_the_majority_is_never_a_suspect(fingerprints: list[int]) -> None:
    decision = decide(fingerprints)
    if decision.decided and not decision.agreed:
        assert 2 * (len(fingerprints) - len(decision.suspects)) > len(fingerprints)
        assert len({fingerprints[r] for r in range(len(fingerprints)) if r not in decision.suspects}) == 1


def test_hsdp_replicas_are_the_ranks_that_hold_the_same_shard_and_each_group_decides_alone() -> None:
    assert replica_groups(4, 1) == [[0, 1, 2, 3]]  # DDP: one group
    assert replica_groups(6, 2) == [[0, 2, 4], [1, 3, 5]]  # HSDP, 3 nodes x 2 shards
    # shard 0's replicas agree; shard 1's rank 5 disagrees with ranks 1 and 3 (its majority)
    fingerprints = [7, 100, 7, 100, 7, 9]
    decision = decide_groups(fingerprints, replica_groups(6, 2))
    assert decision.suspects == (5,) and decision.decided
    # the two shards' fingerprints differ by nature: that is no disagreement
    assert decide_groups([7, 100, 7, 100], replica_groups(4, 2)).agreed
    # 2 nodes: each shard has two replicas, so a disagreement is undecided between them
    undecided = decide_groups([7, 100, 8, 100], replica_groups(4, 2))
    assert undecided.suspects == (0, 2) and not undecided.decided


def test_what_is_compared_follows_the_strategy() -> None:
    class Mesh:  # DeviceMesh's surface used: mesh_dim_names, mesh[name].size()
        def __init__(self, names: tuple[str, ...], shard: int) -> None:
            self.mesh_dim_names, self._shard = names, shard

        def __getitem__(self, name: str) -> Any:
            return self

        def size(self) -> int:
            return self._shard

    assert replica_shards(nn.Linear(1, 1), None) is None  # one process or FSDP without a mesh
    assert replica_shards(nn.Linear(1, 1), Mesh(("shard",), 4)) is None  # FSDP: shards only
    assert replica_shards(nn.Linear(1, 1), Mesh(("replicate", "shard"), 4)) == 4  # HSDP


# -- the monitor (fake exchanges) -----------------------------------------------------------------------
class Recorder(MetricsSink):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def on_event(self, event: Any, **fields: Any) -> None:
        self.events.append((str(event), fields))


class FakeManager:
    def __init__(self) -> None:
        self.certified: dict[int, bool] = {}
        self.prefer_certified = False

    def certify(self, step: int, agreed: bool) -> None:
        self.certified[step] = agreed


def monitor(others: list[int], mine: list[int], sink: MetricsSink, every: int = 5) -> SdcMonitor:
    """Rank 0 of len(others) + 1 ranks; `mine` holds this rank's next fingerprint (mutable)."""
    identity = WorkerIdentity(job="j", rank=0, world_size=len(others) + 1, node="host-0")
    return SdcMonitor(
        identity,
        sink,
        every=every,
        state=lambda: mine[0],
        exchange=lambda f: [f, *others],
        hosts=lambda h: [h, *(f"host-{r}" for r in range(1, len(others) + 1))],
    )


def test_the_monitor_checks_every_n_steps_and_before_a_save() -> None:
    sink, calls = Recorder(), []
    mine = [11]
    mon = monitor([11, 11], mine, sink)
    mon.state = lambda: calls.append(1) or mine[0]  # type: ignore[func-returns-value]
    for step in range(1, 11):
        mon.after_step(step)
    assert len(calls) == 2 and mon.last_agreed == 10
    manager = FakeManager()
    mon.certify(10, manager)  # already checked at 10: no second exchange
    mon.certify(12, manager)
    assert len(calls) == 3 and manager.certified == {10: True, 12: True}
    mon.prefer_certified(manager)
    assert manager.prefer_certified
    assert sink.events == []


def test_a_disagreement_is_an_event_and_an_exception_and_nothing_is_certified() -> None:
    sink = Recorder()
    mine, others = [11], [11, 11, 11]
    mon = monitor(others, mine, sink)
    mon.after_step(5)
    others[1] = 12  # rank 2 goes wrong after step 5
    manager = FakeManager()
    with pytest.raises(SilentDataCorruption, match="step 7: majority: rank"):
        mon.certify(7, manager)
    assert manager.certified == {}
    (kind, fields), *_ = sink.events
    assert kind == str(EventKind.SDC)
    assert fields["suspects"] == [2] and fields["suspect_hosts"] == ["host-2"] and fields["decided"]
    assert fields["last_agreed_step"] == 5 and fields["step"] == 7
    assert fields["fingerprints"] == [f"{v:016x}" for v in (11, 11, 12, 11)]


def test_two_replicas_that_differ_are_undecided_not_guessed() -> None:
    sink = Recorder()
    with pytest.raises(SilentDataCorruption, match="undecided between ranks 0,1"):
        monitor([12], [11], sink).after_step(5)
    assert sink.events[0][1]["suspects"] == [0, 1] and not sink.events[0][1]["decided"]


def test_sdc_every_defaults_and_bounds() -> None:
    assert SdcConfig().every == DEFAULT_SDC_EVERY
    assert SdcConfig.model_validate({"every": 0}).every == 0  # off
    with pytest.raises(ValueError, match="every"):
        SdcConfig.model_validate({"every": None})  # a null would not survive the resolved job file
    with pytest.raises(ValueError, match="every"):
        SdcConfig.model_validate({"every": -1})


# -- the bitflip fault -----------------------------------------------------------------------------------
def test_bitflip_faults_parse_and_bad_ones_name_the_field() -> None:
    (fault,) = parse_faults('[{"kind": "bitflip", "rank": 1, "step": 7, "target": "moment", "bit": 3}]')
    assert (fault.kind, fault.rank, fault.step, fault.target, fault.tensor, fault.element, fault.bit) == (
        "bitflip",
        1,
        7,
        "moment",
        0,
        0,
        3,
    )
    with pytest.raises(ValueError, match=r"\[0\]\.target: 'weights'"):
        parse_faults('[{"kind": "bitflip", "step": 7, "target": "weights"}]')
    with pytest.raises(ValueError, match=r"\[0\]\.bit: must be >= 0"):
        parse_faults('[{"kind": "bitflip", "step": 7, "bit": -1}]')
    with pytest.raises(ValueError, match="unknown keys"):
        parse_faults('[{"kind": "kill", "step": 7, "target": "param"}]')  # where applies to bitflips only


def test_flip_bit_flips_exactly_one_bit() -> None:
    t = torch.tensor([1.0, 2.0])
    flip_bit(t, 1, 31)
    assert t.tolist() == [1.0, -2.0]
    with pytest.raises(ValueError, match="outside"):
        flip_bit(t, 2, 0)
    with pytest.raises(ValueError, match="outside"):
        flip_bit(t, 0, 32)


@pytest.mark.parametrize("target", ["param", "moment", "grad", "local_grad"])
def test_the_injector_flips_its_target_at_its_step_on_its_rank_only(target: str) -> None:
    def run(rank: int) -> tuple[int, list[Any]]:
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        sink = Recorder()
        faults = parse_faults(json.dumps([{"kind": "bitflip", "rank": 1, "step": 2, "target": target}]))
        injector = FaultInjector(faults, rank=rank, generation=0, events=sink)
        injector.arm(model, optimizer)
        for step in (1, 2, 3):
            loss = model(torch.ones(1, 3)).sum()
            injector.before_backward(loss, step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            injector.after_step(step)
        return fingerprint(model, optimizer, torch.device("cpu")), [f.get("kind") for _, f in sink.events]

    healthy, healthy_events = run(0)
    struck, struck_events = run(1)
    assert healthy_events == [] and struck_events == ["bitflip"]
    assert struck != healthy


# -- certification in the manifest and the restore order ------------------------------------------------
def manifest(step: int, certified: bool | None) -> Manifest:
    meta = FileEntry(path="gen-0000/.metadata", size=1, digest="0" * 64, rank=0, node_rank=0)
    return Manifest(
        step=step,
        world_size=2,
        generation=0,
        job="j",
        time=float(step),
        torch_version="x",
        files=[meta],
        certified=certified,
    )


@pytest.mark.parametrize("certified", [True, False, None])
def test_certified_round_trips_signed(certified: bool | None) -> None:
    key = b"k" * 32
    data = manifest(4, certified).to_json(key)
    assert parse_manifest(data, step=4, key=key).certified is certified
    raw = json.loads(data)
    raw["certified"] = not certified  # an uncertified checkpoint passed off as certified
    with pytest.raises(SignatureError):
        parse_manifest(json.dumps(raw), step=4, key=key)


def test_a_manifest_without_certified_reads_as_unknown_and_a_bad_value_is_refused() -> None:
    raw = json.loads(manifest(4, None).to_json())
    del raw["certified"]  # written before `sdc`
    assert parse_manifest(json.dumps(raw), step=4).certified is None
    raw["certified"] = "yes"
    with pytest.raises(ManifestLayoutError, match="certified"):
        parse_manifest(json.dumps(raw), step=4)


def test_restore_passes_over_an_uncertified_checkpoint_but_not_an_unchecked_one() -> None:
    """`certified: false` goes last; absent (no replica check where it was saved: one rank, FSDP, sdc off)
    is no evidence of a corruption and keeps its place, newest first."""
    candidates = [Candidate(s, manifest(s, c), [0]) for s, c in ((10, True), (20, True), (30, None), (40, False))]
    assert [c.step for c in order_candidates(candidates)] == [40, 30, 20, 10]
    assert [c.step for c in order_candidates(candidates, prefer_certified=True)] == [30, 20, 10, 40]


# -- the metric -----------------------------------------------------------------------------------------
def test_the_sdc_counter_counts_and_carries_over_a_restart_in_the_run_directory(tmp_path: Any) -> None:
    from training.contract import RunFiles
    from training.contract.events import Sdc
    from training.metrics import names
    from training.metrics.jsonl import EventsJsonlSink
    from training.metrics.prometheus import PrometheusSink

    identity = WorkerIdentity(job="j", rank=0, world_size=2, node="n", run_dir=str(tmp_path))
    labels = {"training_job": "j", "rank": "0", "node": "n", "evidence": "replica"}
    recompute = {**labels, "evidence": "recompute"}
    first = PrometheusSink(identity)
    events = EventsJsonlSink(str(tmp_path), identity, log_every=10)
    try:
        assert first.registry.get_sample_value(names.SDC_DETECTED, labels) == 0  # exported from the start
        assert first.registry.get_sample_value(names.SDC_DETECTED, recompute) == 0  # both kinds of evidence
        event = Sdc(
            step=7, suspects=[1], suspect_hosts=["h"], decided=True, fingerprints=[], last_agreed_step=5, detail=""
        )
        by_recompute = dataclasses.replace(event, evidence="recompute", recomputed=["0" * 16, "1" * 16])
        for each in (event, by_recompute, by_recompute):
            first.emit(each)
            events.emit(each)
        assert first.registry.get_sample_value(names.SDC_DETECTED, labels) == 1
        assert first.registry.get_sample_value(names.SDC_DETECTED, recompute) == 2
    finally:
        first.close()
        events.close()
    assert RunFiles(str(tmp_path)).events.exists()
    successor = PrometheusSink(identity)  # the restarted rank 0, in the same run directory
    try:
        assert successor.registry.get_sample_value(names.SDC_DETECTED, labels) == 1
        assert successor.registry.get_sample_value(names.SDC_DETECTED, recompute) == 2
    finally:
        successor.close()


# -- quarantine: a host suspected twice --------------------------------------------------------------------
def test_a_host_suspected_in_two_detections_is_quarantined_in_the_event_and_the_summary(tmp_path: Any) -> None:
    from orchestrator.rundir import build_summary
    from training.contract import RunFiles, read_events
    from training.contract.events import sdc_quarantine
    from training.metrics.jsonl import EventsJsonlSink

    identity = WorkerIdentity(job="j", rank=0, world_size=4, node="host-0", run_dir=str(tmp_path))
    events = EventsJsonlSink(str(tmp_path), identity, log_every=10)
    mine, others = [11], [11, 11, 11]
    try:
        for step in (5, 10):  # the same rank goes wrong again after the restart
            mon = monitor(others, mine, events)
            mon.identity = WorkerIdentity(job="j", rank=0, world_size=4, node="host-0", run_dir=str(tmp_path))
            others[1] = 12
            with pytest.raises(SilentDataCorruption):
                mon.after_step(step)
            others[1] = 11
    finally:
        events.close()
    first, second = [e for e in read_events(RunFiles(str(tmp_path)).events) if e.kind == EventKind.SDC]
    assert first.get("quarantined_hosts") == [] and second.get("quarantined_hosts") == ["host-2"]
    assert sdc_quarantine([first]) == [] and sdc_quarantine([first, second]) == ["host-2"]
    summary = build_summary(tmp_path, status="succeeded", wall_s=1.0, stores=[])
    assert summary.quarantined_hosts == ["host-2"]
    assert summary.sdc == [
        {"step": 5, "suspects": [2], "suspect_hosts": ["host-2"], "decided": True},
        {"step": 10, "suspects": [2], "suspect_hosts": ["host-2"], "decided": True},
    ]
    assert (
        "quarantined_hosts" not in build_summary(tmp_path / "none", status="succeeded", wall_s=1.0, stores=[]).to_dict()
    )
