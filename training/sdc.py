"""Silent data corruption (SDC): data-parallel replicas must hold bit-identical state; find the one that does not.

Under DDP every rank applies the same all-reduced gradient to the same parameters with the same
optimizer, so after each step every replica holds the same bits. A device that computes a wrong number
or flips a bit in memory breaks that silently: the loss still falls, and every checkpoint after it
carries the damage. Every `sdc.every` steps (and before every checkpoint save) each rank hashes its
parameters and optimizer state on the device into a 64-bit `fingerprint`, the group all-gathers the
fingerprints (8 bytes per rank, one collective on the default group) and `decide` names the suspects:

- all equal: the replicas agree, and a checkpoint of this step is `certified` (its manifest says so);
- a strict majority agrees: the ranks outside it are the suspects;
- no strict majority (two ranks that differ, or a tie): deterministic replay decides (`decide_replay`).
  Where some replica group has two members, every agreed check keeps a copy of the state it agreed on
  (`training.sdc_replay.ReplayPoint`: parameters, optimizer state, the loop's position; one more copy of
  the state in memory). On a disagreement without a majority the group checks that those copies still
  agree, loads them and re-runs the steps since (the same batches, seeds and collectives: the run is
  bit-exact), and fingerprints again. A replica whose replay does not reproduce its own fingerprint
  computed (or held) something it cannot compute again: it is the suspect, `decided`. Where the replays
  themselves differ (a device that computes the same wrong number every time cannot be told from its one
  peer), or no copy was kept yet (the first `sdc.every` steps), the suspects are every rank outside the
  largest group and the event says `undecided` rather than guess. Where the corruption was already
  averaged into the peer (a flip on rank 1 after step k enters rank 1's local gradient of step k + 1, whose
  all-reduce carries it to rank 0, so after step k + 1 neither state is what a clean replay reproduces),
  DDP's gradient trail decides (`training.sdc_replay.GradientTrail`): each rank kept a hash of a sample of
  its own pre-reduce gradient at every step since the kept state, the replay records the same, and the rank
  whose gradient departed from its replay strictly first is the suspect (its peer departs a step later,
  once the average reached it). A departure at the same step on both, or none seen, stays undecided.

On a disagreement rank 0 writes an `sdc` event (step, suspects, their hosts, every fingerprint, and the
hosts to quarantine: suspects already named by an earlier `sdc` event of the run, `sdc_quarantine`) and
every rank raises `SilentDataCorruption`: the worker exits retryably (`TRAINING_FAILED`), the group
restarts, and the restore takes the newest checkpoint, a certified one: no checkpoint of a step whose
replicas disagreed is ever committed, because every save is preceded by a check
(`CheckpointManager.prefer_certified` passes over a manifest that says `certified: false`; one saved where
no check runs says nothing and keeps its place). The result is then bit-identical to an uninterrupted
run (the resume is deterministic).

HSDP compares along its replica dimension: the ranks that hold the same shard (`replica_groups`) must
agree, each group decided on its own. Not covered: FSDP shards (no two ranks hold the same bits, so
there is nothing to compare: detection is off with a log line); corruption before the gradient
all-reduce (it is averaged into every replica alike: `training.sdc_recompute`'s spot checks,
`sdc.recomputeEvery`, find that under DDP) and inside a collective (every replica receives the same
wrong sum: neither check sees it).

The fingerprint is a position-dependent integer hash over the raw bits, not a float sum: each tensor's
bytes are read as int32 words (bytes when the size is not a multiple of 4), word i is multiplied by the
odd constant `c_i = 2 * (i * K + K0) + 1` and the products summed modulo 2**64; the tensors' hashes are
combined the same way with odd per-tensor constants. A single flipped bit changes its word by +-2**b
(b < 32), so the sum changes by 2**b times an odd number, which is never 0 modulo 2**64: every single-bit
flip changes the fingerprint (`tests/unit/test_sdc.py` checks it with hypothesis).
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn, Protocol

import torch
from torch import nn

from training.contract import EventKind, RunFiles, WorkerIdentity
from training.contract.events import Event, Sdc, read_events, sdc_quarantine
from training.metrics.base import MetricsSink

__all__ = [
    "HOST_BYTES",
    "Decision",
    "SdcMonitor",
    "SilentDataCorruption",
    "combine_hashes",
    "create_sdc_monitor",
    "decide",
    "decide_departures",
    "decide_groups",
    "decide_replay",
    "fingerprint",
    "fingerprint_tensors",
    "replacement",
    "replica_groups",
    "replica_shards",
    "report_disagreement",
    "state_tensors",
]

log = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1
_K = 0x9E3779B97F4A7C15  # golden-ratio constant (odd): spreads positions over all 64 bits
_K0 = 0xD6E8FEB86659FD93
_TENSOR_K = 0xC2B2AE3D27D4EB4F
CHUNK_WORDS = 1 << 22  # words hashed per kernel: bounds the int64 temporaries to 32 MiB per chunk
HOST_BYTES = 64  # a host name in the one-off exchange of names (longer ones are cut)

# this rank's fingerprint -> every rank's, by rank (an all-gather); injected in tests
Exchange = Callable[[int], list[int]]
HostExchange = Callable[[str], list[str]]
# In place with standby nodes: the node a ready standby node takes after a decided disagreement, the same on
# every rank (`training.inplace.group.InPlaceGroup.sdc_handover`); None: spares of the suspects' own nodes.
Handover = Callable[[tuple[int, ...], bool], int | None]


def _signed(value: int) -> int:
    """`value` mod 2**64 as the int64 torch stores."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def position_constant(i: int) -> int:
    """The odd multiplier of word `i` (mod 2**64): `2 * (i * K + K0) + 1`."""
    return (2 * (i * _K + _K0) + 1) & MASK64


def tensor_constant(t: int) -> int:
    """The odd multiplier of the `t`-th tensor's hash."""
    return (2 * (t * _TENSOR_K + _K) + 1) & MASK64


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as int64 words: its bytes read as int32 (or uint8), widened."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8)
    if raw.numel() % 4 == 0:
        return raw.view(torch.int32).to(torch.int64)
    return raw.to(torch.int64)


class _Positions:
    """The position constants of one chunk, per device, built once: `c_j` for j < CHUNK_WORDS.

    Chunk o starts at word `o * CHUNK_WORDS`; since `c_{s+j} = c_j + 2 * s * K`, a chunk's sum is
    `sum(w_j * c_j) + 2 * s * K * sum(w_j)`, so one table serves every chunk.
    """

    def __init__(self) -> None:
        self._tables: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        table = self._tables.get(device)
        if table is None or table.numel() < n:
            size = min(CHUNK_WORDS, max(n, 1 << 16))
            j = torch.arange(size, dtype=torch.int64, device=device)
            table = (j * _signed(_K) + _signed(_K0)) * 2 + 1  # int64 arithmetic wraps modulo 2**64
            self._tables[device] = table
        return table[:n]


_POSITIONS = _Positions()


def _tensor_hash(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 tensor on the tensor's device: `sum_i w_i * c_i` modulo 2**64."""
    words = _words(tensor)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[start : start + CHUNK_WORDS]
        part = (chunk * _POSITIONS.get(words.device, chunk.numel())).sum()
        if start:
            part = part + chunk.sum() * _signed(2 * start * _K)
        total = total + part
    return total


def fingerprint_tensors(tensors: Iterable[torch.Tensor], device: torch.device | None = None) -> int:
    """The 64-bit fingerprint of `tensors`, in order (unsigned), computed on their devices.

    Args:
        tensors: The tensors, in an order every replica shares.
        device: Where the per-tensor hashes are combined (default: the first tensor's device).
    """
    hashes = [_tensor_hash(tensor) for tensor in tensors]
    return combine_hashes(hashes, device if device is not None or not hashes else hashes[0].device)


def combine_hashes(hashes: Sequence[torch.Tensor | None], device: torch.device | None) -> int:
    """The fingerprint of tensors whose `_tensor_hash`es are `hashes`, in order (None: a tensor of zeros,
    whose hash is 0); one transfer to the host at the end."""
    acc: torch.Tensor | None = None
    for t, h in enumerate(hashes):
        if h is None:
            continue
        term = h.to(device) * _signed(tensor_constant(t))
        acc = term if acc is None else acc + term
    if acc is None:
        return 0
    return int(acc.item()) & MASK64


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What the replicas must agree on, in a fixed order: the parameters, then each parameter's optimizer
    state (its tensors by key). Buffers are left out: DDP overwrites them from rank 0 at every forward,
    and BatchNorm's running statistics differ between ranks in between."""
    tensors: list[torch.Tensor] = [_local(p) for p in model.parameters()]
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key in sorted(state, key=str):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    tensors.append(_local(value))
    return tensors


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2/HSDP), the tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """The fingerprint of a replica: `fingerprint_tensors(state_tensors(...))`, combined on `device`."""
    return fingerprint_tensors(state_tensors(model, optimizer), device)


@dataclass(frozen=True)
class Decision:
    """What the all-gathered fingerprints say.

    Attributes:
        agreed: Every rank holds the same fingerprint.
        suspects: The ranks that disagree (empty when `agreed`).
        decided: The suspects are known (a strict majority, a replay, or the recompute's witnesses); False:
            no majority (two ranks, a tie) and nothing else told them apart, and `suspects` are every rank
            outside the largest group of equal fingerprints.
        how: What named them: "majority", "replay" (`decide_replay`) or "recompute"
            (`training.sdc_recompute.decide_recompute`).
        note: Why an undecided verdict stayed undecided (for the event's detail).
    """

    agreed: bool
    suspects: tuple[int, ...]
    decided: bool
    how: str = "majority"
    note: str = ""

    def describe(self) -> str:
        """One line for the log and the event."""
        if self.agreed:
            return "replicas agree"
        ranks = ",".join(str(r) for r in self.suspects)
        if self.decided:
            return f"{self.how}: rank(s) {ranks} disagree"
        return f"undecided between ranks {ranks}: {self.note or 'no majority'}"


def decide(fingerprints: Sequence[int]) -> Decision:
    """Name the suspects among the ranks' fingerprints (index = rank).

    A strict majority (more than half) of equal fingerprints decides: the other ranks are the suspects.
    Without one every rank outside the largest group is a suspect, and with two or more largest groups
    (two ranks that differ) every rank is.
    """
    counts = Counter(fingerprints)
    if len(counts) <= 1:
        return Decision(agreed=True, suspects=(), decided=True)
    (top, top_count), *rest = counts.most_common()
    if top_count * 2 > len(fingerprints):
        return Decision(False, tuple(r for r, f in enumerate(fingerprints) if f != top), decided=True)
    if rest and rest[0][1] == top_count:  # a tie: no group stands out
        return Decision(False, tuple(range(len(fingerprints))), decided=False)
    return Decision(False, tuple(r for r, f in enumerate(fingerprints) if f != top), decided=False)


def decide_groups(fingerprints: Sequence[int], groups: Sequence[Sequence[int]]) -> Decision:
    """`decide` within each replica group (global ranks that must hold the same bits), merged: the union of
    the suspects, decided only when every disagreeing group had a majority."""
    suspects: list[int] = []
    decided = True
    for group in groups:
        within = decide([fingerprints[r] for r in group])
        suspects += [group[i] for i in within.suspects]
        decided = decided and within.decided
    if not suspects:
        return Decision(agreed=True, suspects=(), decided=True)
    return Decision(agreed=False, suspects=tuple(sorted(suspects)), decided=decided)


def decide_replay(
    original: Sequence[int], replayed: Sequence[int], groups: Sequence[Sequence[int]] | None = None
) -> Decision:
    """Name the suspects from a deterministic replay (index = rank; `groups` as in `decide_groups`).

    Every rank re-ran the same steps from the same agreed state, so a healthy rank reproduces its own
    fingerprint bit for bit. Within a group whose replays agree, the ranks whose original fingerprint
    differs from that replay are the suspects (decided). Within a group whose replays differ, the replay
    proves nothing on its own: the majority of the replays decides if there is one; without one (two ranks
    that computed two different results twice) the group stays undecided, and the suspects are the ranks
    outside its largest group of replays together with any rank that did not reproduce itself. A group in
    which no rank reproduced itself proves nothing either (the kept state was not what these ranks trained
    from, e.g. from before a rollback at another world size): undecided, the whole group suspect.
    """
    groups = groups if groups is not None else [list(range(len(original)))]
    suspects: set[int] = set()
    decided = True
    for group in groups:
        inconsistent = {r for r in group if replayed[r] != original[r]}
        again = [replayed[r] for r in group]
        if len(set(again)) == 1:
            suspects |= inconsistent
            if len(inconsistent) == len(group) > 1:
                decided = False
            continue
        within = decide(again)
        named = {group[i] for i in within.suspects}
        suspects |= named if within.decided else named | inconsistent
        decided = decided and within.decided
    if not suspects:
        return Decision(agreed=True, suspects=(), decided=True)
    note = "" if decided else "the replay reproduced no rank, or the replays differ too (deterministic wrong numbers)"
    return Decision(False, tuple(sorted(suspects)), decided, how="replay", note=note)


NO_DEPARTURE = 0  # `training.sdc_replay.GradientTrail.departure`: every replayed step matched its record
UNKNOWN = -1  # a replayed step had no record (HSDP: no DDP bucket; a trail begun after the kept step)


def decide_departures(departures: list[int], groups: list[list[int]], undecided: Decision) -> Decision:
    """Name the suspects from each rank's first departing step (`GradientTrail.departure`, index = rank).

    Within a replica group the ranks whose gradients departed strictly first are the suspects (decided): a
    healthy replica's gradient departs only once a corrupted average reached it, a step later. A group
    whose earliest departure is shared by all its ranks, where a rank could not tell (UNKNOWN), or where no
    rank departed, proves nothing: the verdict stays `undecided` (with the reason).
    """
    suspects: set[int] = set()
    for group in groups:
        seen = {r: departures[r] for r in group}
        if any(d == UNKNOWN for d in seen.values()):
            return replace(undecided, note=undecided.note + "; a replayed step had no gradient record")
        departed = {r: d for r, d in seen.items() if d != NO_DEPARTURE}
        if not departed:
            if any(r in undecided.suspects for r in group):
                return replace(undecided, note=undecided.note + "; no rank's gradients departed from the replay")
            continue
        first = min(departed.values())
        earliest = {r for r, d in departed.items() if d == first}
        if len(earliest) == len(group):
            return replace(undecided, note=undecided.note + f"; every rank's gradients departed at step {first}")
        suspects |= earliest
    if not suspects:
        return undecided
    return Decision(False, tuple(sorted(suspects)), True, how="replay")


def replica_groups(world_size: int, shards: int) -> list[list[int]]:
    """The replica groups of a job whose state is split into `shards` parts, shard index = rank % shards
    (HSDP's mesh is nodes x local ranks: rank = node * shards + local rank); DDP is `shards` 1."""
    return [list(range(s, world_size, shards)) for s in range(shards)]


class SilentDataCorruption(RuntimeError):
    """The replicas disagreed: the group restarts from the newest certified checkpoint, or, in place, the
    suspects leave and the others roll back (`training.inplace.protocol.decide_sdc`).

    Attributes:
        suspects: The ranks the fingerprints suspect.
        decided: A majority named them (False: no majority, every disagreeing replica is a suspect).
    """

    def __init__(
        self, message: str, *, suspects: Sequence[int] = (), decided: bool = False, handed_over: int | None = None
    ) -> None:
        super().__init__(message)
        self.suspects = tuple(suspects)
        self.decided = decided
        self.handed_over = handed_over  # the node a standby node takes (`Handover`), None: spares of the node


def report_disagreement(
    identity: WorkerIdentity,
    sink: MetricsSink,
    hosts: HostExchange,
    *,
    step: int,
    decision: Decision,
    fingerprints: Sequence[int],
    last_agreed: int | None,
    evidence: str,
    recomputed: Sequence[int] = (),
    handover: Handover | None = None,
) -> NoReturn:
    """The `sdc` event (rank 0), a line on stderr and `SilentDataCorruption` (every rank; collective: the
    host names are all-gathered).

    Args:
        evidence: Which fingerprints differed: "replica" (parameters and optimizer state, `SdcMonitor`) or
            "recompute" (pre-reduce gradients against a neighbour's recomputation, `training.sdc_recompute`).
        recomputed: "recompute": rank r's fingerprint of rank (r + 1)'s gradient, by rank.
        handover: In place (DDP): the node a standby node takes (every rank asks: one answer for all). The
            event says who replaces the suspects (`replaced_by`) and names the node handed over (`excluded_hosts`).
    """
    names = hosts(identity.node)  # collective too: every rank saw the same fingerprints
    handed_over = handover(decision.suspects, decision.decided) if handover is not None else None
    replaced_by = replacement(decision, identity.world_size, in_place=handover is not None, handed_over=handed_over)
    nproc = max(1, identity.local_world_size)
    node_ranks = range(handed_over * nproc, (handed_over + 1) * nproc) if handed_over is not None else range(0)
    excluded = list(dict.fromkeys(names[r] for r in node_ranks if r < len(names)))
    message = f"silent data corruption at step {step}: {decision.describe()} (evidence: {evidence})"
    if replaced_by == "standby":
        message += f"; a standby node takes node {handed_over}'s ranks ({', '.join(excluded)} excluded)"
    elif replaced_by == "spare":
        message += "; spares of the suspects' own nodes take their ranks (the suspect hardware still runs them)"
    if identity.is_leader:
        suspect_hosts = list(dict.fromkeys(names[r] for r in decision.suspects))  # each host once
        quarantined = quarantined_hosts(identity, suspect_hosts)
        if quarantined:
            message += f"; quarantine (suspected before): {', '.join(quarantined)}"
        sink.emit(
            Sdc(
                step=step,
                suspects=list(decision.suspects),
                suspect_hosts=suspect_hosts,
                decided=decision.decided,
                fingerprints=[f"{f:016x}" for f in fingerprints],
                last_agreed_step=last_agreed,
                detail=decision.describe(),
                quarantined_hosts=quarantined,
                evidence=evidence,
                recomputed=[f"{f:016x}" for f in recomputed],
                replaced_by=replaced_by,
                excluded_hosts=excluded,
                excluded_node=handed_over,
            )
        )
    print(f"torchrig: rank {identity.rank}: {message}", file=sys.stderr, flush=True)
    raise SilentDataCorruption(message, suspects=decision.suspects, decided=decision.decided, handed_over=handed_over)


def replacement(decision: Decision, world: int, *, in_place: bool, handed_over: int | None) -> str:
    """Who takes the suspects' ranks (the `sdc` event's `replaced_by`): "standby" (a standby node takes the
    suspects' node: it holds no rank of the job any more), "spare" (warm spares of the suspects' own nodes:
    the suspect hardware still runs their ranks) or "" (nobody in place: the group restarts from the newest
    certified checkpoint, `training.inplace.protocol.decide_sdc`)."""
    if handed_over is not None:
        return "standby"
    every_rank = set(range(world)) <= set(decision.suspects)
    return "spare" if in_place and decision.decided and decision.suspects and not every_rank else ""


def quarantined_hosts(identity: WorkerIdentity, suspect_hosts: list[str]) -> list[str]:
    """The hosts to keep out after this detection: `sdc_quarantine` over the run directory's earlier `sdc`
    events (the restarts before this one) and this one's suspects."""
    earlier = read_events(RunFiles(identity.run_dir).events) if identity.run_dir is not None else []
    now = Event(time=0.0, rank=0, generation=0, kind=EventKind.SDC, data={"suspect_hosts": suspect_hosts})
    return sdc_quarantine([*earlier, now])


class ReplayLike(Protocol):
    """`training.sdc_replay.ReplayPoint` as the monitor uses it."""

    kept_step: int | None

    def keep(self, step: int) -> None: ...

    def kept_fingerprint(self) -> int: ...

    def run(self, step: int) -> int | None: ...


class SdcMonitor:
    """Checks replica agreement every `every` steps and before every save (every rank must call it).

    Args:
        identity: This rank.
        sink: Gets the `sdc` event (rank 0).
        every: Steps between checks (`sdc.every`).
        state: Returns this rank's fingerprint (`fingerprint` over the model and optimizer).
        exchange: All-gathers the fingerprints.
        hosts: All-gathers the host names (only on a disagreement).
        groups: The replica groups, global ranks that must agree (default: every rank, DDP). HSDP's are
            the ranks that hold the same shard (`replica_groups`).
        replay: Keeps the state of each agreed check and re-runs the steps since (`decide_replay`); None:
            no replay (a disagreement without a majority stays undecided).
    """

    def __init__(
        self,
        identity: WorkerIdentity,
        sink: MetricsSink,
        *,
        every: int,
        state: Callable[[], int],
        exchange: Exchange,
        hosts: HostExchange,
        groups: Sequence[Sequence[int]] | None = None,
        replay: ReplayLike | None = None,
    ) -> None:
        self.identity = identity
        self.replay = replay
        self.groups = [list(g) for g in groups] if groups is not None else [list(range(identity.world_size))]
        self.sink = sink
        self.every = max(1, every)
        self.state = state
        self.exchange = exchange
        self.hosts = hosts
        self.last_checked: int | None = None
        self.last_agreed: int | None = None  # the newest step whose replicas agreed (certified)
        self.handover: Handover | None = None  # set by an in-place DDP trainer (`report_disagreement`)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def check(self, step: int) -> Decision:
        """Fingerprint, exchange, decide (collective); raises SilentDataCorruption on a disagreement."""
        fingerprints = self.exchange(self.state())
        self.last_checked = step
        decision = decide_groups(fingerprints, self.groups)
        if decision.agreed:
            self.last_agreed = step
            if self.replay is not None:
                self.replay.keep(step)
            return decision
        if not decision.decided and self.replay is not None:
            decision = self.replayed(step, fingerprints, decision)
        report_disagreement(
            self.identity,
            self.sink,
            self.hosts,
            step=step,
            decision=decision,
            fingerprints=fingerprints,
            last_agreed=self.last_agreed,
            evidence="replica",
            handover=self.handover,
        )

    def replayed(self, step: int, fingerprints: list[int], undecided: Decision) -> Decision:
        """Re-run the steps since the kept state on every rank and let `decide_replay` name the suspects
        (collective; `undecided`, with a note, where no replay is possible)."""
        assert self.replay is not None
        kept = self.replay.kept_step
        if kept is None or kept > step:  # (kept after `step`: from before an in-place rollback)
            return replace(undecided, note="no majority, and no agreed state kept to replay from yet")
        if not decide_groups(self.exchange(self.replay.kept_fingerprint()), self.groups).agreed:
            return replace(undecided, note=f"no majority, and the state kept at step {kept} no longer agrees")
        log.warning("sdc: no majority at step %d: replaying steps %d..%d to decide", step, kept + 1, step)
        again = self.replay.run(step)
        replayed = self.exchange(-1 if again is None else again)  # collective even where it could not run
        if again is None or any(f == MASK64 for f in replayed):
            return replace(undecided, note="no majority, and the replay could not run on every rank")
        decision = decide_replay(fingerprints, replayed, self.groups)
        departed = getattr(self.replay, "departed", None)  # the gradient trail's verdict (DDP)
        if decision.decided or departed is None:
            return decision
        # No state was reproduced (the corruption reached the peer through an all-reduce): whose own
        # gradient departed from the replay first (`training.sdc_replay.GradientTrail`). Sent as step + 1
        # (the exchange carries unsigned words; UNKNOWN is -1).
        departures = [d - 1 for d in self.exchange(departed + 1)]
        return decide_departures(departures, self.groups, decision)

    def quarantined(self, suspect_hosts: list[str]) -> list[str]:
        """`quarantined_hosts` of this rank's run directory."""
        return quarantined_hosts(self.identity, suspect_hosts)

    def after_step(self, step: int) -> None:
        """Check when `step` is due (every `every` steps)."""
        if self.due(step):
            self.check(step)

    def certify(self, step: int, checkpoints: object) -> None:
        """Before a save of `step`: check unless already checked at it (raises on a disagreement), then
        tell the checkpoint manager its manifest is `certified`."""
        if self.last_checked != step:
            self.check(step)
        certify = getattr(checkpoints, "certify", None)  # a stand-in manager may have no manifests
        if certify is not None:
            certify(step, True)

    def prefer_certified(self, checkpoints: object) -> None:
        """Make `checkpoints` restore the newest certified checkpoint first (where it has manifests)."""
        if hasattr(checkpoints, "prefer_certified"):
            checkpoints.prefer_certified = True


def all_gather_fingerprints(device: torch.device) -> Exchange:
    """Every rank's fingerprint through one all-gather of 8 bytes per rank on the default group."""
    import torch.distributed as tdist

    def exchange(mine: int) -> list[int]:
        local = torch.tensor([_signed(mine)], dtype=torch.int64, device=device)
        out = [torch.empty_like(local) for _ in range(tdist.get_world_size())]
        tdist.all_gather(out, local)
        return [int(t.item()) & MASK64 for t in out]

    return exchange


def all_gather_hosts(device: torch.device) -> HostExchange:
    """Every rank's host name (UTF-8, cut to HOST_BYTES) through one all-gather of fixed-size bytes."""
    import torch.distributed as tdist

    def exchange(mine: str) -> list[str]:
        raw = mine.encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
        local = torch.tensor(list(raw), dtype=torch.uint8, device=device)
        out = [torch.empty_like(local) for _ in range(tdist.get_world_size())]
        tdist.all_gather(out, local)
        return [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in out]

    return exchange


def create_sdc_monitor(
    identity: WorkerIdentity,
    sink: MetricsSink,
    *,
    every: int,
    state: Callable[[], int],
    device: torch.device,
    shards: int | None,
    replay: ReplayLike | None = None,
) -> SdcMonitor | None:
    """The monitor of a data-parallel job (None: `sdc.every` 0, one rank, no group, or no replicas).

    Args:
        state: This rank's fingerprint now (`fingerprint` of the current model and optimizer).
        device: Where the fingerprints are exchanged (the default group's device).
        shards: Parts the state is split into (`replica_shards`): 1 for DDP, the shard dimension for HSDP
            (its replicas are compared), None for FSDP (no two ranks hold the same bits: off, with a log line).
        replay: How to keep the agreed state and re-run the steps since (`training.sdc_replay`); used only
            where a replica group has two members (with three or more a majority decides, and keeping a
            copy of the state would cost memory for nothing).
    """
    import torch.distributed as tdist

    if every <= 0 or identity.world_size <= 1 or not tdist.is_initialized():
        return None
    groups = replica_groups(identity.world_size, shards) if shards else []
    if not any(len(g) > 1 for g in groups):
        if identity.is_leader:
            log.info("sdc: replica agreement is off: no two ranks hold the same state (FSDP shards, or one replica)")
        return None
    return SdcMonitor(
        identity,
        sink,
        every=every,
        state=state,
        exchange=all_gather_fingerprints(device),
        hosts=all_gather_hosts(device),
        groups=groups,
        replay=replay if any(len(g) == 2 for g in groups) else None,
    )


def replica_shards(model: nn.Module, mesh: Any) -> int | None:
    """What `create_sdc_monitor` compares: 1 for a DDP model (full replicas), the size of HSDP's `shard`
    dimension (ranks r and r + shards hold the same shard), None for FSDP (a 1-D mesh: shards only)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return 1
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "replicate" in names and "shard" in names:
        return int(mesh["shard"].size())
    return None
