"""Silent data corruption (SDC): data-parallel replicas must hold bit-identical state; find the one that does not.

Under DDP every rank applies the same all-reduced gradient to the same parameters with the same
optimizer, so after each step every replica holds the same bits. A device that computes a wrong number
or flips a bit in memory breaks that silently: the loss still falls, and every checkpoint after it
carries the damage. Every `sdc.every` steps (and before every checkpoint save) each rank hashes its
parameters and optimizer state on the device into a 64-bit `fingerprint`, the group all-gathers the
fingerprints (8 bytes per rank, one collective on the default group) and `decide` names the suspects:

- all equal: the replicas agree, and a checkpoint of this step is `certified` (its manifest says so);
- a strict majority agrees: the ranks outside it are the suspects;
- no strict majority (two ranks that differ, or a tie): the suspects are every rank outside the
  largest group and the event says `undecided`. Deterministic replay of the step, which would decide
  between two ranks, is not built: the event says so rather than guess.

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
all-reduce (it is averaged into every replica alike) and inside a collective.

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
from dataclasses import dataclass
from typing import Any

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
    "create_sdc_monitor",
    "decide",
    "decide_groups",
    "fingerprint",
    "fingerprint_tensors",
    "replica_groups",
    "replica_shards",
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
    acc: torch.Tensor | None = None
    for t, tensor in enumerate(tensors):
        h = _tensor_hash(tensor)
        if device is None:
            device = h.device
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
        decided: A strict majority agreed, so the suspects are known; False: no majority (two ranks, a
            tie), and `suspects` are every rank outside the largest group of equal fingerprints.
    """

    agreed: bool
    suspects: tuple[int, ...]
    decided: bool

    def describe(self) -> str:
        """One line for the log and the event."""
        if self.agreed:
            return "replicas agree"
        ranks = ",".join(str(r) for r in self.suspects)
        if self.decided:
            return f"majority: rank(s) {ranks} disagree"
        return f"undecided between ranks {ranks}: no majority (replay not built)"


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


def replica_groups(world_size: int, shards: int) -> list[list[int]]:
    """The replica groups of a job whose state is split into `shards` parts, shard index = rank % shards
    (HSDP's mesh is nodes x local ranks: rank = node * shards + local rank); DDP is `shards` 1."""
    return [list(range(s, world_size, shards)) for s in range(shards)]


class SilentDataCorruption(RuntimeError):
    """The replicas disagreed: the group restarts from the newest certified checkpoint."""


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
    ) -> None:
        self.identity = identity
        self.groups = [list(g) for g in groups] if groups is not None else [list(range(identity.world_size))]
        self.sink = sink
        self.every = max(1, every)
        self.state = state
        self.exchange = exchange
        self.hosts = hosts
        self.last_checked: int | None = None
        self.last_agreed: int | None = None  # the newest step whose replicas agreed (certified)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def check(self, step: int) -> Decision:
        """Fingerprint, exchange, decide (collective); raises SilentDataCorruption on a disagreement."""
        fingerprints = self.exchange(self.state())
        self.last_checked = step
        decision = decide_groups(fingerprints, self.groups)
        if decision.agreed:
            self.last_agreed = step
            return decision
        hosts = self.hosts(self.identity.node)  # collective too: every rank saw the same fingerprints
        message = f"silent data corruption at step {step}: {decision.describe()}"
        if self.identity.is_leader:
            suspect_hosts = [hosts[r] for r in decision.suspects]
            quarantined = self.quarantined(suspect_hosts)
            if quarantined:
                message += f"; quarantine (suspected before): {', '.join(quarantined)}"
            self.sink.emit(
                Sdc(
                    step=step,
                    suspects=list(decision.suspects),
                    suspect_hosts=suspect_hosts,
                    decided=decision.decided,
                    fingerprints=[f"{f:016x}" for f in fingerprints],
                    last_agreed_step=self.last_agreed,
                    detail=decision.describe(),
                    quarantined_hosts=quarantined,
                )
            )
        print(f"torchrig: rank {self.identity.rank}: {message}", file=sys.stderr, flush=True)
        raise SilentDataCorruption(message)

    def quarantined(self, suspect_hosts: list[str]) -> list[str]:
        """The hosts to keep out after this detection: `sdc_quarantine` over the run directory's earlier
        `sdc` events (the restarts before this one) and this one's suspects."""
        earlier = read_events(RunFiles(self.identity.run_dir).events) if self.identity.run_dir is not None else []
        now = Event(time=0.0, rank=0, generation=0, kind=EventKind.SDC, data={"suspect_hosts": suspect_hosts})
        return sdc_quarantine([*earlier, now])

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
) -> SdcMonitor | None:
    """The monitor of a data-parallel job (None: `sdc.every` 0, one rank, no group, or no replicas).

    Args:
        state: This rank's fingerprint now (`fingerprint` of the current model and optimizer).
        device: Where the fingerprints are exchanged (the default group's device).
        shards: Parts the state is split into (`replica_shards`): 1 for DDP, the shard dimension for HSDP
            (its replicas are compared), None for FSDP (no two ranks hold the same bits: off, with a log line).
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
