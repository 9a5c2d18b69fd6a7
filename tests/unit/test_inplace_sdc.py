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
