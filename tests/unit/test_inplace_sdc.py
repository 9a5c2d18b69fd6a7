"""What a replica disagreement hands the in-place protocol: the `sdc` event names each suspect host once,
and the exception carries the suspects and whether they are decided (`protocol.decide_sdc` reads both)."""

from __future__ import annotations

from typing import Any

import pytest

from training.contract import EventKind, ExitCode, WorkerIdentity
from training.inplace.protocol import PassThrough, RollBack, SdcObservation, StandDown, decide_sdc
from training.metrics.base import MetricsSink
from training.sdc import SdcMonitor, SilentDataCorruption


class _Recorder(MetricsSink):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def on_event(self, event: Any, **fields: Any) -> None:
        self.events.append((str(event), fields))


def _disagree(fingerprints: list[int], hosts: list[str]) -> tuple[dict[str, Any], SilentDataCorruption]:
    """Rank 0's check of `fingerprints` (index = rank) on `hosts`: its `sdc` event and its exception."""
    sink = _Recorder()
    identity = WorkerIdentity(job="j", rank=0, world_size=len(hosts), node=hosts[0])
    monitor = SdcMonitor(
        identity,
        sink,
        every=5,
        state=lambda: fingerprints[0],
        exchange=lambda _mine: fingerprints,
        hosts=lambda _mine: hosts,
    )
    with pytest.raises(SilentDataCorruption) as raised:
        monitor.check(15)
    ((kind, fields),) = sink.events
    assert kind == str(EventKind.SDC)
    return fields, raised.value


def test_suspects_on_one_host_name_it_once_and_the_exception_carries_them_undecided() -> None:
    fields, exc = _disagree([11, 12, 13], ["vm", "vm", "vm"])  # no majority, no replay: undecided
    assert len(fields["suspects"]) >= 2 and fields["suspect_hosts"] == ["vm"]
    assert exc.suspects == tuple(fields["suspects"]) and exc.decided is False
    seen = SdcObservation(0, 3, exc.suspects, exc.decided, in_place=True)
    assert decide_sdc(seen) == PassThrough(int(ExitCode.SDC_DETECTED))


def test_a_decided_suspect_leaves_and_the_others_roll_back() -> None:
    fields, exc = _disagree([11, 11, 12, 11], ["a", "b", "c", "d"])
    assert fields["suspect_hosts"] == ["c"] and exc.suspects == (2,) and exc.decided is True
    leaves = decide_sdc(SdcObservation(2, 4, exc.suspects, exc.decided, in_place=True))
    assert leaves == StandDown(int(ExitCode.SDC_SUSPECT))
    for rank in (0, 1, 3):
        assert decide_sdc(SdcObservation(rank, 4, exc.suspects, exc.decided, in_place=True)) == RollBack()


def _disagree_in_place(
    fingerprints: list[int], hosts: list[str], nproc: int, handed_over: int | None
) -> tuple[dict[str, Any], SilentDataCorruption, list[tuple[tuple[int, ...], bool]]]:
    """`_disagree` with an in-place trainer's hand-over (`SdcMonitor.handover`) that answers `handed_over`;
    also what the hand-over was asked."""
    sink = _Recorder()
    identity = WorkerIdentity(job="j", rank=0, world_size=len(hosts), local_world_size=nproc, node=hosts[0])
    monitor = SdcMonitor(
        identity, sink, every=5, state=lambda: fingerprints[0], exchange=lambda _: fingerprints, hosts=lambda _: hosts
    )
    asked: list[tuple[tuple[int, ...], bool]] = []

    def handover(suspects: tuple[int, ...], decided: bool) -> int | None:
        asked.append((suspects, decided))
        return handed_over

    monitor.handover = handover
    with pytest.raises(SilentDataCorruption) as raised:
        monitor.check(15)
    ((_, fields),) = sink.events
    return fields, raised.value, asked


def test_a_suspect_node_handed_to_a_standby_is_named_excluded_and_every_rank_of_it_leaves() -> None:
    """2 nodes x 2 ranks, rank 2 flipped: the hand-over is asked with the decided suspects, the event says a
    standby node replaces them and names node 1's host excluded, and the exception carries the node, which
    makes both of node 1's ranks leave (`decide_sdc`)."""
    fields, exc, asked = _disagree_in_place([11, 11, 12, 11], ["n0", "n0", "n1", "n1"], nproc=2, handed_over=1)
    assert asked == [((2,), True)]
    assert fields["replaced_by"] == "standby" and fields["excluded_hosts"] == ["n1"] and fields["excluded_node"] == 1
    assert exc.handed_over == 1 and "a standby node takes node 1's ranks (n1 excluded)" in str(exc)
    for rank in range(4):
        seen = SdcObservation(rank, 4, exc.suspects, exc.decided, True, node=rank // 2, handed_over=exc.handed_over)
        assert decide_sdc(seen) == (StandDown(int(ExitCode.SDC_SUSPECT)) if rank >= 2 else RollBack())


def test_without_a_standby_the_event_says_the_suspect_node_still_runs_the_rank() -> None:
    fields, exc, _ = _disagree_in_place([11, 11, 12, 11], ["n0", "n0", "n1", "n1"], nproc=2, handed_over=None)
    assert fields["replaced_by"] == "spare" and fields["excluded_hosts"] == []
    assert exc.handed_over is None and "the suspect hardware still runs them" in str(exc)
    fields, exc = _disagree([11, 11, 12, 11], ["a", "b", "c", "d"])  # no in-place trainer: nobody in place
    assert fields["replaced_by"] == "" and exc.handed_over is None
