"""In-place recovery's policies as tables (`training.inplace.protocol`), and the host's claim loop carrying
them out against an in-memory store (no process, no socket)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.unit.test_inplace import IDENTITY
from training.contract import Env, ExitCode
from training.inplace import InPlace
from training.inplace.group import RecoveryFailed
from training.inplace.host import _claim
from training.inplace.protocol import (
    HOST_TRANSITIONS,
    SPARE_TRANSITIONS,
    STANDBY_TRANSITIONS,
    SURVIVOR_TRANSITIONS,
    ClaimSpare,
    Decision,
    FallBack,
    Formed,
    FormObservation,
    HandOver,
    HandoverObservation,
    HostObservation,
    HostState,
    Join,
    PassThrough,
    Promote,
    Ready,
    Recovered,
    RollBack,
    RoundOver,
    SdcObservation,
    SpareObservation,
    SpareState,
    StandBy,
    StandbyObservation,
    StandbyState,
    StandDown,
    Stop,
    SurvivorState,
    Take,
    Wait,
    decide_form,
    decide_handover,
    decide_host,
    decide_sdc,
    decide_spare,
    decide_standby,
    mermaid,
    next_state,
)
from training.inplace.survivor import Phases, recover

FAILED = int(ExitCode.RECOVERY_FAILED)
T, C, W, S, D = (
    HostState.TRAINING,
    HostState.CLAIMING,
    HostState.WATCHING_SPARE,
    HostState.STANDING_BY,
    HostState.STOPPING,
)


def _fallback(decision: Decision, reason: str) -> bool:
    return isinstance(decision, FallBack) and reason in decision.reason and decision.exit_code == FAILED


@pytest.mark.parametrize(
    ("state", "seen", "expected"),
    [
        (T, HostObservation(), Wait()),
        (T, HostObservation(stopping=True), Stop()),
        (T, HostObservation(exit_code=0, stepped=True), PassThrough(0)),
        (T, HostObservation(exit_code=2), PassThrough(2)),  # permanent: passed on, never replaced
        (T, HostObservation(exit_code=202, stepped=True), PassThrough(202)),
        (T, HostObservation(exit_code=205), PassThrough(205)),
        (T, HostObservation(exit_code=203, stepped=True), PassThrough(203)),
        (T, HostObservation(exit_code=137, stepped=True), ClaimSpare()),
        (T, HostObservation(exit_code=200, stepped=True), ClaimSpare()),
        (T, HostObservation(exit_code=206, stepped=True), PassThrough(206)),  # SDC undecided: group restart
        (T, HostObservation(exit_code=207, stepped=True), ClaimSpare()),  # the SDC suspect: replace its rank
        # Its node handed to a standby node (`decide_handover`): no spare of the suspect node, the host leaves.
        (T, HostObservation(exit_code=207, stepped=True, handed_over=True), HandOver()),
        (W, HostObservation(exit_code=207, stepped=True, handed_over=True), HandOver()),
        (T, HostObservation(exit_code=207, stepped=True, handed_over=True, stopping=True), PassThrough(207)),
        (T, HostObservation(exit_code=137, stepped=True, handed_over=True), ClaimSpare()),  # only an SDC leave
        (T, HostObservation(exit_code=137, stepped=True, stopping=True), PassThrough(137)),
        (W, HostObservation(stepped=True), Recovered()),
        (W, HostObservation(), Wait()),
        (W, HostObservation(exit_code=137, stepped=True), ClaimSpare()),  # stepped, then died: lost again
        # Killed in teardown after its run was complete (a promoted spare whose starting host exited
        # first): nothing to replace; a replacement formed a generation no finished rank would join.
        (T, HostObservation(exit_code=137, stepped=True, finished=True), PassThrough(0)),
        (W, HostObservation(exit_code=137, stepped=True, finished=True), PassThrough(0)),
        (D, HostObservation(stopping=True), Wait()),
        (D, HostObservation(exit_code=202, stopping=True), PassThrough(202)),
        (C, HostObservation(exit_code=137, elapsed_s=1.0, timeout_s=60.0), Wait()),
        (C, HostObservation(exit_code=137, claimed_pid=42), Promote(42)),
        (C, HostObservation(exit_code=137, claimed_pid=42, every_rank_lost=True), Promote(42)),
        (C, HostObservation(exit_code=137, stopping=True), PassThrough(137)),
        (S, HostObservation(), Wait()),
        (S, HostObservation(promoted=True), Promote(0)),
        (S, HostObservation(stopping=True, promoted=True), StandDown(0)),
        (S, HostObservation(exit_code=137), StandDown(137)),
        (S, HostObservation(exit_code=0), StandDown(FAILED)),  # a spare has no business ending well
    ],
)
def test_the_host_policy(state: HostState, seen: HostObservation, expected: Decision) -> None:
    assert decide_host(state, seen) == expected
    next_state(HOST_TRANSITIONS, state, expected)  # every decision is a transition of the table


@pytest.mark.parametrize(
    ("seen", "reason"),
    [
        (HostObservation(exit_code=137), "before completing a step"),
        (HostObservation(exit_code=137, elapsed_s=61.0, timeout_s=60.0), "no spare ready within 60 s"),
        (HostObservation(exit_code=137, every_rank_lost=True), "every rank lost its trainer"),
        (HostObservation(exit_code=137, store_failed="refused"), "the store failed while claiming a spare"),
    ],
)
def test_the_host_falls_back_to_a_group_restart(seen: HostObservation, reason: str) -> None:
    state = C if "before" not in reason else T
    assert _fallback(decide_host(state, seen), reason)


def test_a_host_that_is_done_decides_nothing() -> None:
    with pytest.raises(ValueError, match="done"):
        decide_host(HostState.DONE, HostObservation())
    with pytest.raises(ValueError, match="no transition from DONE on Wait"):
        next_state(HOST_TRANSITIONS, HostState.DONE, Wait())


@pytest.mark.parametrize(
    ("seen", "expected"),
    [
        (FormObservation(1, 4, joined=2), Wait()),
        (FormObservation(1, 4, joined=4), Formed(announce=True)),
        (FormObservation(1, 4, joined=2, formed=True), Formed()),
        (FormObservation(1, 4, joined=2, owner="7", pid=7), Wait()),
        (FormObservation(1, 4, owner="7", seat="7", pid=7), Wait()),  # its own seat: it joins
        (FormObservation(1, 4, joined=2, elapsed_s=119.0, limit_s=60.0), Wait()),
    ],
)
def test_the_forming_policy(seen: FormObservation, expected: Decision) -> None:
    assert decide_form(seen) == expected


@pytest.mark.parametrize(
    ("seen", "reason"),
    [
        (FormObservation(2, 4, 3, owner="8", pid=7), "generation 2: rank 3 is held by pid 8 now; this process stands"),
        # Its owner's look said yes, but another process of the rank took the seat between the two requests.
        (FormObservation(2, 4, 3, owner="7", seat="pid 8", pid=7), "rank 3 was joined by pid 8 first; this process"),
        (FormObservation(1, 4, joined=4, cancelled=True), "a shutdown signal arrived while forming"),
        (FormObservation(1, 4, nodes_lost="node(s) [1] stopped"), "node(s) [1] stopped; nobody can bring"),
        (FormObservation(1, 4, joined=3, elapsed_s=121.0, limit_s=60.0), "3 of 4 ranks joined within 120 s"),
    ],
)
def test_a_member_gives_a_generation_up(seen: FormObservation, reason: str) -> None:
    assert _fallback(decide_form(seen), reason)


# -- the standby node and the spare ------------------------------------------------------------------------
SW, SU, SR, SH = StandbyState.WAITING, StandbyState.WARMING, StandbyState.READY, StandbyState.HOLDING
SIGTERM = 15


@pytest.mark.parametrize(
    ("state", "seen", "expected"),
    [
        # Waiting for a round: connect, read the recorded round, look again a second later.
        (SW, StandbyObservation(), Wait()),
        (SW, StandbyObservation(round_running=True), StandBy()),
        (SW, StandbyObservation(round_running=True, stopping=SIGTERM), StandDown(128 + SIGTERM)),
        (SW, StandbyObservation(job_over=True, member=True), StandDown(0)),  # never joins a closed rendezvous
        (SW, StandbyObservation(member=True, unreached_s=0.0), Join()),  # no round runs: one of the next round's
        (SW, StandbyObservation(unreached_s=10.5, gone_after_s=10.0), StandDown(0)),  # reached before, gone
        (SW, StandbyObservation(unreached_s=9.0, gone_after_s=10.0, elapsed_s=900.0), Wait()),
        (SW, StandbyObservation(elapsed_s=601.0, join_timeout_s=600.0), StandDown(1)),  # as torchrun's agent
        (SW, StandbyObservation(elapsed_s=599.0, join_timeout_s=600.0), Wait()),
        # Warming and ready: watching the round's nodes.
        (SU, StandbyObservation(nodes=2, host_codes=(None, None)), Wait()),
        (SU, StandbyObservation(nodes=2, host_codes=(None, None), spares_ready=True), Ready()),
        (SU, StandbyObservation(nodes=2, host_codes=(None, None), lost=(1,)), Wait()),  # not ready: takes nothing
        (SR, StandbyObservation(nodes=2, host_codes=(None, None), lost=(1,)), Take((1,))),
        (SR, StandbyObservation(nodes=2, lost=(0, 1)), RoundOver()),  # every node stopped at once
        # An SDC suspect's node handed over by the replicas: taken at once, before any beat stops; only when
        # ready, and before the checks on ended nodes (the handed-over node's hosts leave on their own).
        (SR, StandbyObservation(nodes=2, host_codes=(None, None), handed_over=1), Take((1,), handover=True)),
        (SR, StandbyObservation(nodes=2, handed_over=1, ended=(0, 1)), Take((1,), handover=True)),
        (SU, StandbyObservation(nodes=2, host_codes=(None, None), handed_over=1), Wait()),
        (SR, StandbyObservation(nodes=2, handed_over=1, job_over=True), StandDown(0)),
        (SR, StandbyObservation(nodes=2, handed_over=1, stopping=SIGTERM), StandDown(128 + SIGTERM)),
        (SR, StandbyObservation(nodes=2, lost=(0, 1), member=True), Join()),
        (SR, StandbyObservation(nodes=2, lost=(1,), ended=(0,)), RoundOver()),  # every node gone, some ended
        (SR, StandbyObservation(nodes=2, ended=(0, 1)), RoundOver()),
        (SR, StandbyObservation(nodes=2, job_over=True, lost=(1,)), StandDown(0)),
        (SR, StandbyObservation(nodes=2, store_failed="refused", unreached_s=3.0), Wait()),
        (SR, StandbyObservation(nodes=2, store_failed="refused", unreached_s=11.0), StandDown(0)),
        (SR, StandbyObservation(nodes=2, lost=(1,), stopping=SIGTERM), StandDown(128 + SIGTERM)),
        # A host ended before the standby was needed: the job's end (or the store's), else start over.
        (SU, StandbyObservation(nodes=2, host_codes=(200, None), job_over=True), StandDown(0)),
        (SU, StandbyObservation(nodes=2, host_codes=(200, None), store_failed="refused"), StandDown(0)),
        (SR, StandbyObservation(nodes=2, host_codes=(200, None)), RoundOver()),
        (SR, StandbyObservation(nodes=2, host_codes=(200, None), member=True), Join()),
        # Holding a lost node: it ends as that node's agent would.
        (SH, StandbyObservation(host_codes=(0, None)), Wait()),
        (SH, StandbyObservation(host_codes=(0, 0)), PassThrough(0)),
        (SH, StandbyObservation(host_codes=(203, 203)), RoundOver()),  # the group restarts: stand by again
        (SH, StandbyObservation(host_codes=(203, 0), member=True), Join()),
        (SH, StandbyObservation(host_codes=(203, 2)), PassThrough(2)),  # a permanent failure wins over 203
        (SH, StandbyObservation(host_codes=(137, 202)), PassThrough(137)),
        (SH, StandbyObservation(host_codes=(None, None), stopping=2), StandDown(130)),
        # A new round began (the group restarted without its node): its ranks end, however complete.
        (SH, StandbyObservation(host_codes=(None, None), new_round=True), RoundOver()),
        (SH, StandbyObservation(host_codes=(None, 0), new_round=True, member=True), Join()),
        (SH, StandbyObservation(host_codes=(None, None), new_round=True, stopping=SIGTERM), StandDown(128 + SIGTERM)),
    ],
)
def test_the_standby_policy(state: StandbyState, seen: StandbyObservation, expected: Decision) -> None:
    decision = decide_standby(state, seen)
    assert decision == expected
    next_state(STANDBY_TRANSITIONS, state, decision)  # the table has the transition the policy decides


def test_a_standby_that_is_done_decides_nothing() -> None:
    with pytest.raises(ValueError, match="decides nothing"):
        decide_standby(StandbyState.DONE, StandbyObservation())


@pytest.mark.parametrize(
    ("state", "seen", "expected"),
    [
        (SpareState.WARMING, SpareObservation(), Wait()),  # its pid published: on to READY
        (SpareState.WARMING, SpareObservation(store_failed="timed out"), StandDown(int(ExitCode.TRAINING_FAILED))),
        (SpareState.READY, SpareObservation(), Wait()),  # nothing assigned, or a forged assignment
        (SpareState.READY, SpareObservation(assigned=True), Promote(0)),
        (SpareState.READY, SpareObservation(store_failed="closed"), StandDown(int(ExitCode.TRAINING_FAILED))),
    ],
)
def test_the_spare_policy(state: SpareState, seen: SpareObservation, expected: Decision) -> None:
    decision = decide_spare(state, seen)
    assert decision == expected
    next_state(SPARE_TRANSITIONS, state, decision)
    with pytest.raises(ValueError, match="decides nothing"):
        decide_spare(SpareState.ASSIGNED, seen)


def test_every_transition_leads_from_a_state_its_role_can_leave() -> None:
    for table in (HOST_TRANSITIONS, SURVIVOR_TRANSITIONS, SPARE_TRANSITIONS, STANDBY_TRANSITIONS):
        for (source, _), target in table.items():
            assert not source.terminal, source
            assert type(source) is type(target)
    assert SurvivorState.FAILED.exit_code == FAILED and SurvivorState.RESUMED.exit_code is None
    assert SpareState.ASSIGNED.terminal and not SpareState.READY.terminal


def test_the_architecture_doc_holds_the_diagram_the_tables_draw() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    block = re.search(r"```mermaid\nstateDiagram-v2\n.*?```", doc, re.S)
    assert block is not None, "docs/architecture.md has no state diagram"
    assert block.group(0) == mermaid(), (
        "regenerate it: python -c 'from training.inplace import protocol; print(protocol.mermaid())'"
    )


# -- the host's claim loop against an in-memory store -----------------------------------------------------
class MemoryStore:
    """What `_claim` asks of a c10d store, in memory; `refuse` makes every request fail."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.refuse = False

    def _op(self) -> None:
        if self.refuse:
            raise RuntimeError("connection refused")

    def add(self, key: str, n: int) -> int:
        self._op()
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        self._op()
        return all(key in self.data for key in keys)

    def get(self, key: str) -> bytes:
        self._op()
        return self.data[key]

    def set(self, key: str, value: str) -> None:
        self._op()
        self.data[key] = value.encode()

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._op()
        if self.data.get(key, b"").decode() == expected:
            self.data[key] = desired.encode()
        return self.data[key]


class StepClock:
    """A clock that moves only when slept on."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def inplace() -> InPlace:
    return InPlace(
        store_addr="memory", run_id="r", restart_count=0, node_rank=0, spares=1, timeout_s=1.0, secret=b"s" * 32
    )


def test_a_claim_gives_up_at_its_timeout_on_the_injected_clock(inplace: InPlace) -> None:
    clock = StepClock()
    decision = _claim(inplace, MemoryStore(), 1, None, code=137, clock=clock)
    assert _fallback(decision, "no spare ready within 1 s")
    assert 1.0 < clock.now < 1.1


def test_a_claim_promotes_a_ready_spare_and_assigns_it(inplace: InPlace, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    store.add(inplace.spawned_key, 1)
    inplace.write(store, inplace.spare_key(0, "ready"), "4242")
    identity = {**IDENTITY, Env.RANK: "1", Env.LOCAL_RANK: "1"}  # rank 1's launcher variables
    for name, value in identity.items():
        monkeypatch.setenv(name, value)
    assert _claim(inplace, store, 1, None, code=137, clock=StepClock()) == Promote(4242)
    assert inplace.read(store, inplace.owner_key(1)) == "4242"
    assignment = json.loads(inplace.read(store, inplace.spare_key(0, "assign")) or "")
    assert assignment["generation"] == 1 and assignment["env"][Env.RANK] == "1"


def test_a_shutdown_while_claiming_passes_the_dead_trainers_code_on_and_claims_nothing(inplace: InPlace) -> None:
    """Found by the simulator: the claim loop did not look at the shutdown, so a host waited out its timeout
    or assigned a spare into a group torchrun was stopping (that spare never got the SIGTERM)."""
    store = MemoryStore()
    store.add(inplace.spawned_key, 1)
    inplace.write(store, inplace.spare_key(0, "ready"), "4242")
    assert _claim(inplace, store, 1, None, code=137, stopping=lambda: True, clock=StepClock()) == PassThrough(137)
    assert not store.check([inplace.spare_key(0, "claim")]), "the spare stays the pool's"


def test_a_store_that_refuses_while_claiming_is_a_group_restart(inplace: InPlace) -> None:
    """Found by the simulator: the store's exception escaped `run_host` (a traceback, exit 1: permanent
    under Kubeflow's convention) where an infrastructure failure must be retryable."""
    store = MemoryStore()
    clock = StepClock()
    store.add(inplace.waiting_key, 0)

    def refuse_later() -> bool:
        store.refuse = clock.now > 0.1
        return False

    decision = _claim(inplace, store, 1, None, code=137, stopping=refuse_later, clock=clock)
    assert _fallback(decision, "the store failed while claiming a spare (RuntimeError: connection refused)")


# -- the survivor's phases ---------------------------------------------------------------------------------
def _phases(done: list[str], failing: str = "", error: Exception | None = None) -> Phases:
    def phase(name: str) -> Callable[[], None]:
        def run() -> None:
            if name == failing:
                raise error or RuntimeError("gloo: connection closed by peer")
            done.append(name)

        return run

    return Phases(leave=phase("leave"), form=phase("form"), sync=phase("sync"), rewire=phase("rewire"))


def test_a_survivor_runs_its_phases_in_the_order_of_the_table() -> None:
    done: list[str] = []
    recover(_phases(done), 3)
    assert done == ["leave", "form", "sync", "rewire"]


def test_a_rollback_reloads_the_certified_checkpoint_after_rewiring_and_its_failure_is_a_fall_back() -> None:
    done: list[str] = []
    recover(dataclasses.replace(_phases(done), rollback=lambda: done.append("rollback")), 3)
    assert done == ["leave", "form", "sync", "rewire", "rollback"]

    def nothing_certified() -> None:
        raise RecoveryFailed("no certified checkpoint before step 15 to roll back to")

    with pytest.raises(RecoveryFailed, match="no certified checkpoint"):
        recover(dataclasses.replace(_phases([]), rollback=nothing_certified), 3)


# -- a replica disagreement (`training.sdc`) -------------------------------------------------------------
@pytest.mark.parametrize(
    ("seen", "expected"),
    [
        # The majority named rank 2: it leaves for a spare, the others roll back in place.
        (SdcObservation(2, 4, (2,), decided=True, in_place=True), StandDown(int(ExitCode.SDC_SUSPECT))),
        (SdcObservation(0, 4, (2,), decided=True, in_place=True), RollBack()),
        # No majority (two replicas the replay could not tell apart): nobody is known good.
        (SdcObservation(0, 2, (0, 1), decided=False, in_place=True), PassThrough(int(ExitCode.SDC_DETECTED))),
        (SdcObservation(1, 2, (0, 1), decided=False, in_place=True), PassThrough(int(ExitCode.SDC_DETECTED))),
        # No in-place host to give the rank to a spare: the group restarts.
        (SdcObservation(2, 4, (2,), decided=True, in_place=False), PassThrough(int(ExitCode.SDC_DETECTED))),
        (SdcObservation(0, 4, (2,), decided=True, in_place=False), PassThrough(int(ExitCode.SDC_DETECTED))),
        # HSDP: its in-place state is in-memory snapshots, which may postdate the flip.
        (SdcObservation(0, 4, (3,), decided=True, in_place=True, sharded=True), PassThrough(206)),
        (SdcObservation(3, 4, (3,), decided=True, in_place=True, sharded=True), PassThrough(206)),
        # Every rank a suspect (a replay none of them reproduced): no survivor to roll back.
        (SdcObservation(0, 2, (0, 1), decided=True, in_place=True), PassThrough(206)),
        # Node 1 (ranks 2, 3) handed to a standby node: both its ranks leave, node 0's roll back.
        (SdcObservation(2, 4, (2,), True, True, node=1, handed_over=1), StandDown(int(ExitCode.SDC_SUSPECT))),
        (SdcObservation(3, 4, (2,), True, True, node=1, handed_over=1), StandDown(int(ExitCode.SDC_SUSPECT))),
        (SdcObservation(0, 4, (2,), True, True, node=0, handed_over=1), RollBack()),
        # Undecided, or no in-place host: a hand-over changes nothing, the group restarts.
        (SdcObservation(3, 4, (2,), False, True, node=1, handed_over=1), PassThrough(206)),
        (SdcObservation(3, 4, (2,), True, False, node=1, handed_over=1), PassThrough(206)),
    ],
)
def test_the_sdc_policy(seen: SdcObservation, expected: Decision) -> None:
    assert decide_sdc(seen) == expected
    assert decide_sdc(seen).exit_code in (None, 206, 207)


@pytest.mark.parametrize(
    ("seen", "expected"),
    [
        # 2 nodes x 2 ranks, rank 2 (node 1) decided, a standby ready: node 1 is handed over.
        (HandoverObservation((2,), True, world=4, nproc=2, standbys_ready=1), 1),
        (HandoverObservation((0, 1), True, world=4, nproc=2, standbys_ready=2), 0),  # both suspects on node 0
        # No standby ready, undecided, FSDP/HSDP: the suspects' own nodes' spares (or a group restart).
        (HandoverObservation((2,), True, world=4, nproc=2, standbys_ready=0), None),
        (HandoverObservation((2,), False, world=4, nproc=2, standbys_ready=1), None),
        (HandoverObservation((2,), True, world=4, nproc=2, standbys_ready=1, sharded=True), None),
        (HandoverObservation((), True, world=4, nproc=2, standbys_ready=1), None),
        # Suspects on two nodes: one standby takes one node, so neither is handed over.
        (HandoverObservation((1, 2), True, world=4, nproc=2, standbys_ready=1), None),
        # One node: no other node holds a survivor; every rank a suspect: nothing to roll back beside it.
        (HandoverObservation((1,), True, world=4, nproc=4, standbys_ready=1), None),
        (HandoverObservation((0, 1, 2, 3), True, world=4, nproc=2, standbys_ready=1), None),
    ],
)
def test_the_handover_policy(seen: HandoverObservation, expected: int | None) -> None:
    assert decide_handover(seen) == expected


def test_every_rank_of_a_handed_over_node_leaves_and_every_other_rolls_back() -> None:
    """Whatever the world, the suspect and the node: the ranks that leave are exactly the handed-over node's,
    and what they leave with is the code their hosts hand over on (`decide_host`: `HandOver`)."""
    for nodes, nproc in ((2, 1), (2, 2), (3, 4)):
        world = nodes * nproc
        for suspect in range(world):
            node = decide_handover(HandoverObservation((suspect,), True, world, nproc, standbys_ready=1))
            assert node == suspect // nproc
            leaving = set()
            for rank in range(world):
                seen = SdcObservation(rank, world, (suspect,), True, True, node=rank // nproc, handed_over=node)
                decision = decide_sdc(seen)
                if isinstance(decision, StandDown):
                    leaving.add(rank)
                    host = decide_host(T, HostObservation(exit_code=decision.exit_code, stepped=True, handed_over=True))
                    assert host == HandOver() and host.exit_code == 0
                else:
                    assert decision == RollBack()
            assert leaving == set(range(node * nproc, (node + 1) * nproc))


def test_a_failure_after_leaving_is_a_fall_back_naming_the_generation() -> None:
    """A second death while syncing: `RecoveryFailed` for the generation being formed (the trainer's own
    message once named generation g+2 when the failure came after the group had formed)."""
    done: list[str] = []
    with pytest.raises(RecoveryFailed, match=r"^generation 3: RuntimeError: gloo: connection closed by peer$"):
        recover(_phases(done, "sync"), 3)
    assert done == ["leave", "form"], "nothing runs after the failed phase"
    forming = RecoveryFailed("generation 3: a shutdown signal arrived while forming")
    with pytest.raises(RecoveryFailed) as raised:
        recover(_phases([], "form", forming), 3)
    assert raised.value is forming, "a member's own fall-back is raised as it is"


def test_a_failure_while_leaving_is_the_trainers_own() -> None:
    with pytest.raises(RuntimeError, match="gloo"):
        recover(_phases([], "leave"), 3)


class _Spare:
    """A spare process of the pool, as far as `SparePool.tick` looks at it (no process is started)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        return None


def test_a_spare_whose_claim_is_forged_is_no_spare_of_the_pool(
    inplace: InPlace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found while modelling the pool for the simulator: a claim written without the job's secret made the
    node's only spare unusable, yet the pool still counted it and started no other one."""
    from training.inplace import forked
    from training.inplace.host import SparePool

    started: list[dict[str, str]] = []

    def start(command: list[str], argv: list[str], env: dict[str, str]) -> _Spare:
        started.append(env)
        return _Spare(200 + len(started))

    monkeypatch.setattr(forked, "start", start)
    store = MemoryStore()
    pool = SparePool(inplace, store, [], [], first_trainer=1)
    pool.procs[100], pool.spawned = (0, _Spare(100)), 1  # type: ignore[assignment]
    store.add(inplace.spawned_key, 1)
    inplace.write(store, inplace.spare_key(0, "ready"), "100")
    pool.tick()
    assert started == [], "one warm spare: nothing to start"
    store.set(inplace.spare_key(0, "claim"), "1")  # forged: no MAC
    pool.tick()
    assert [env[Env.INPLACE_SPARE] for env in started] == ["1"], "a usable spare starts beside it"


def test_a_promoted_spares_exit_code_unreadable_from_a_failed_store_counts_as_a_crash(
    inplace: InPlace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's exception escaped `run_host` here too (exit 1, permanent); now the code is unknown, and
    after `EXIT_CODE_WAIT_S` a crash, which the host's policy turns into a claim or a fall-back."""
    from training.inplace import host

    monkeypatch.setattr(host, "EXIT_CODE_WAIT_S", 0.0)
    store = MemoryStore()
    store.refuse = True
    gone = host._Promoted(2**22 + 1, store, inplace)  # above Linux's largest pid: no such process
    assert gone.poll() == 128 + 9


class _CountingStore:
    """`add` as c10d's store has it (a missing key counts from 0)."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]


def test_every_rank_lost_stays_seen_after_the_host_that_saw_it_gives_its_count_back() -> None:
    """All 4 trainers died at once and rank 1's host had claimed the node's one spare: rank 0's host saw
    the count at 4, fell back and, ending, gave its count back (3). Ranks 2 and 3, looking after that, must
    still fall back at once instead of waiting `inPlaceTimeoutSeconds` for a spare (a CI run hung there)."""
    from training.inplace.host import every_rank_lost_in

    store = _CountingStore()
    store.add("lost", 3)
    assert not every_rank_lost_in(store, "lost", "all-lost", 4)  # rank 3 still trains
    store.add("lost", 1)
    assert every_rank_lost_in(store, "lost", "all-lost", 4)
    store.add("lost", -1)  # the host that saw it ends and gives its rank back
    assert every_rank_lost_in(store, "lost", "all-lost", 4)
