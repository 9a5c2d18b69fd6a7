"""Drill fault injection: the worker breaks itself on purpose, exactly when a drill asks.

`TORCHRIG_FAULTS` holds a JSON list of `{"kind", "rank", "step", "generation" (default 0),
"seconds"}` (docs/architecture.md). A fault fires when global rank `rank` in restart generation
`generation` has completed optimizer step `step` (a warm spare that takes the rank's place in memory
leaves out the faults of the steps its predecessor had passed):

- `kill`: SIGKILL of this process (a hard crash: no cleanup, no exception handler runs);
- `exit`: `os._exit(1)` (a crash with a non-zero exit code);
- `hang`: the main thread sleeps forever (the watchdog must catch it);
- `slow`: every step from `step` on takes `seconds` longer (a straggler that sleeps between steps); with
  `"until_gate": true` only until the run directory's fault gate exists (a drill paces a job until the
  fault it waits to release, `gated` below, and not after);
- `slow_backward`: from `step` on, the backward pass of every step takes `seconds` longer: the delay
  is a hook on the loss inside autograd, so it comes before any of this rank's gradients (and DDP's
  first bucket) is ready; the other ranks wait for it inside the gradient all-reduce;
- `kill_during_checkpoint`: SIGKILL right after the first save at or after `step` is staged, while its
  upload is still in flight;
- `bitflip`: silent data corruption: one bit (`bit`, default 20: a float32 mantissa bit, so the value
  stays finite and the loss keeps falling) of element `element` of parameter number `tensor` (in
  `model.parameters()` order) is flipped on this rank, in `target`: `param` (the parameter, after step
  `step`), `moment` (its optimizer state `exp_avg`, after step `step`), `grad` (its gradient in step
  `step`, after the gradient all-reduce and before the optimizer step) or `local_grad` (this rank's own
  gradient in step `step`, BEFORE the all-reduce: the average carries it into every replica alike, so
  only the recompute spot checks, `sdc.recomputeEvery`, can see it). `training.sdc` must find it.
  With `"gated": true` it waits, from step `step` on, for the run directory's fault gate
  (`RunFiles.fault_gate`, which a drill creates from outside: once a standby node is ready, say) and
  flips at the first step that begins after the gate was seen (the job goes on training meanwhile).

Every fault writes a `fault` event before it fires.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from training.contract import Env, RunFiles
from training.contract.events import Fault as FaultEvent
from training.metrics.base import MetricsSink

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "BITFLIP_LOCAL_GRAD",
    "BITFLIP_TARGETS",
    "FAULT_EXIT_CODE",
    "Fault",
    "FaultInjector",
    "flip_bit",
    "parse_faults",
]

FaultKind = Literal["kill", "hang", "slow", "slow_backward", "exit", "kill_during_checkpoint", "bitflip"]
_KINDS = ("kill", "hang", "slow", "slow_backward", "exit", "kill_during_checkpoint", "bitflip")
_TIMED = ("slow", "slow_backward")  # kinds that need seconds > 0
BitflipTarget = Literal["param", "moment", "grad", "local_grad"]
# What the replica check (`sdc.every`) finds; `local_grad` is averaged into every replica alike before it
# could, and needs the recompute spot checks (`sdc.recomputeEvery`).
BITFLIP_TARGETS: tuple[BitflipTarget, ...] = ("param", "moment", "grad")
BITFLIP_LOCAL_GRAD: BitflipTarget = "local_grad"
_ALL_TARGETS = (*BITFLIP_TARGETS, BITFLIP_LOCAL_GRAD)
BITFLIP_MOMENT = "exp_avg"  # the optimizer state a `moment` flip hits (Adam/AdamW's first moment)
_BITFLIP_KEYS = {"target", "tensor", "element", "bit", "gated"}
FAULT_EXIT_CODE = 1


@dataclass(frozen=True)
class Fault:
    """One fault of a drill."""

    kind: FaultKind
    rank: int
    step: int
    generation: int = 0
    seconds: float = 0.0
    target: BitflipTarget = "param"  # bitflip: where
    tensor: int = 0  # bitflip: the parameter's index in `model.parameters()`
    element: int = 0  # bitflip: the element of that tensor (flattened)
    bit: int = 20  # bitflip: the bit of that element (0: least significant)
    gated: bool = False  # bitflip: from `step` on, wait for the run directory's fault gate (`RunFiles.fault_gate`)
    until_gate: bool = False  # slow: only until the run directory's fault gate exists


def parse_faults(text: str | None) -> list[Fault]:
    """Parse `TORCHRIG_FAULTS` (empty or unset: no faults).

    Raises:
        ValueError: one line naming TORCHRIG_FAULTS and the bad entry.
    """
    if not text or not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{Env.FAULTS}: not JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"{Env.FAULTS}: must be a JSON list of faults")
    faults = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"{Env.FAULTS}[{i}]: must be an object")
        kind = item.get("kind")
        if kind not in _KINDS:
            raise ValueError(f"{Env.FAULTS}[{i}].kind: {kind!r} is not one of {', '.join(_KINDS)}")
        unknown = (
            set(item)
            - {"kind", "rank", "step", "generation", "seconds"}
            - (_BITFLIP_KEYS if kind == "bitflip" else set())
            - ({"until_gate"} if kind == "slow" else set())
        )
        if unknown:
            raise ValueError(f"{Env.FAULTS}[{i}]: unknown keys {sorted(unknown)}")
        target = item.get("target", "param")
        if target not in _ALL_TARGETS:
            raise ValueError(f"{Env.FAULTS}[{i}].target: {target!r} is not one of {', '.join(_ALL_TARGETS)}")
        try:
            fault = Fault(
                kind=cast(FaultKind, kind),
                rank=int(item.get("rank", 0)),
                step=int(item["step"]),
                generation=int(item.get("generation", 0)),
                seconds=float(item.get("seconds", 0.0)),
                target=cast(BitflipTarget, target),
                tensor=int(item.get("tensor", 0)),
                element=int(item.get("element", 0)),
                bit=int(item.get("bit", 20)),
                gated=_flag(item.get("gated", False), f"{Env.FAULTS}[{i}].gated"),
                until_gate=_flag(item.get("until_gate", False), f"{Env.FAULTS}[{i}].until_gate"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{Env.FAULTS}[{i}]: bad or missing field: {exc}") from None
        if fault.kind in _TIMED and fault.seconds <= 0:
            raise ValueError(f"{Env.FAULTS}[{i}].seconds: a {fault.kind} fault needs seconds > 0")
        for name in ("tensor", "element", "bit"):
            if getattr(fault, name) < 0:
                raise ValueError(f"{Env.FAULTS}[{i}].{name}: must be >= 0")
        faults.append(fault)
    return faults


def _flag(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{field}: must be true or false, got {value!r}")
    return value


def gated_step(fault: Fault, completed: int, gate_open: bool) -> int | None:
    """The step a gated fault strikes in, decided once step `completed` is done and the gate was seen open
    (`gate_open`) or not; None while it waits. A fault that is not gated keeps its own step."""
    if not fault.gated:
        return fault.step
    if not gate_open or completed + 1 < fault.step:
        return None
    return completed + 1


class FaultInjector:
    """Fires this rank's faults of this generation at the right moments of the loop."""

    def __init__(
        self,
        faults: list[Fault],
        *,
        rank: int,
        generation: int,
        events: MetricsSink,
        replacement: bool = False,
        gate: Path | None = None,
    ) -> None:
        # rank -1 / generation -1 match every rank / generation (drills pace a whole job this way).
        self.faults = [f for f in faults if f.rank in (rank, -1) and f.generation in (generation, -1)]
        # A warm spare that took this rank's place in memory (`training.inplace`) is the same rank in the
        # same generation, resuming where its predecessor stopped: the faults of steps before that were
        # its predecessor's (`after_step` drops them at the spare's first step). Without this a
        # kill_during_checkpoint, which fires at the first save at or after its step, struck every
        # later save again, one spare after the other.
        self.replacement = replacement
        # The furthest step the group had reached before the failure, where it is ahead of the step the
        # spare resumes after (FSDP in place returns to an in-memory snapshot: `training.inplace.replica`).
        self.predecessor_reached: int | None = None
        self._first_step: int | None = None
        self.events = events
        self._fired: set[Fault] = set()
        self._backward_step = 0  # the last step whose backward was slowed (once per step)
        # In-place recovery: a kill waits (at most `ready_wait_s`) until this returns True, i.e. a warm
        # spare is ready, so the drill measures recovery with a warm spare rather than its start-up.
        self.ready: Callable[[], bool] | None = None
        self.ready_wait_s = 60.0
        # The phase that wait runs in (the step watchdog's fixed limit: a wait of the drill's, not a step, so
        # no deadline derived from the steps before ends it; a spare that is a fresh interpreter, as under
        # Ray, takes seconds to get ready).
        self.ready_phase: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
        self._model: nn.Module | None = None  # `arm`: what a bitflip strikes
        self._optimizer: torch.optim.Optimizer | None = None
        self._step = 0  # the step in progress (`before_backward`), for a gradient flip
        # Gated faults (`Fault.gated`): the file whose existence releases them, and the step each released
        # one strikes in (`gated_step`); one stat a step while one waits.
        self.gate = gate
        self._due: dict[Fault, int] = {}
        self._gate_seen = False  # `until_gate` slow faults end for good once it was

    @classmethod
    def from_env(
        cls,
        *,
        rank: int,
        generation: int,
        events: MetricsSink,
        env: Mapping[str, str] | None = None,
        replacement: bool = False,
    ) -> FaultInjector:
        env = os.environ if env is None else env
        faults = parse_faults(env.get(Env.FAULTS))
        run_dir = env.get(Env.RUN_DIR)
        gate = RunFiles(run_dir).fault_gate if run_dir else None
        return cls(faults, rank=rank, generation=generation, events=events, replacement=replacement, gate=gate)

    def _step_of(self, fault: Fault) -> int | None:
        """The step `fault` strikes in: its own, or for a gated one the step it was released for (None: not yet)."""
        return self._due.get(fault) if fault.gated else fault.step

    def _gate_open(self) -> bool:
        """Whether the fault gate exists (once seen, it stays open: the drill never removes it)."""
        if not self._gate_seen and self.gate is not None:
            self._gate_seen = self.gate.exists()
        return self._gate_seen

    def _release(self, completed: int) -> None:
        """Release the gated faults that wait, once step `completed` is done, if the gate is open."""
        waiting = [f for f in self.faults if f.gated and f not in self._due]
        if not waiting:
            return
        gate_open = self._gate_open()
        for fault in waiting:
            if (due := gated_step(fault, completed, gate_open)) is not None:
                self._due[fault] = due

    def arm(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Give `bitflip` faults their model and optimizer (a gradient flip hooks the optimizer's step)."""
        self._model, self._optimizer = model, optimizer
        if any(f.kind == "bitflip" and f.target == "grad" for f in self.faults):
            optimizer.register_step_pre_hook(lambda *_: self._flip_grads())
        params = list(model.parameters())
        for fault in self.faults:
            if fault.kind == "bitflip" and fault.target == BITFLIP_LOCAL_GRAD:
                # A hook on the leaf runs before its gradient is accumulated, so before DDP's reducer copies
                # it into a bucket for the all-reduce (and in the first backward of the step only).
                params[min(fault.tensor, len(params) - 1)].register_hook(  # type: ignore[no-untyped-call]
                    lambda grad, fault=fault: self._flip_local_grad(fault, grad)
                )

    def _flip_local_grad(self, fault: Fault, grad: torch.Tensor) -> torch.Tensor | None:
        if self._step_of(fault) != self._step or fault in self._fired:
            return None
        flipped = grad.detach().clone()
        self._bitflip(fault, self._step, flipped)
        return flipped

    def _flip_grads(self) -> None:
        for fault in self.faults:
            if fault.kind == "bitflip" and fault.target == "grad" and self._step_of(fault) == self._step:
                self._bitflip(fault, self._step)

    def _bitflip(self, fault: Fault, step: int, local_grad: torch.Tensor | None = None) -> None:
        if fault in self._fired or self._model is None or self._optimizer is None:
            return
        self._fired.add(fault)
        params = list(self._model.parameters())
        param = params[min(fault.tensor, len(params) - 1)]
        moment = self._optimizer.state.get(param, {}).get(BITFLIP_MOMENT)
        tensor = {"param": param, "grad": param.grad, "moment": moment, BITFLIP_LOCAL_GRAD: local_grad}[fault.target]
        if tensor is None:
            raise RuntimeError(f"{Env.FAULTS}: bitflip: parameter {fault.tensor} has no {fault.target} at step {step}")
        flip_bit(tensor, fault.element, fault.bit)
        self.events.emit(FaultEvent(fault="bitflip", step=step, pid=os.getpid()))
        print(
            f"torchrig: drill fault bitflip at step {step} (rank {fault.rank}: bit {fault.bit} of element "
            f"{fault.element} of parameter {fault.tensor}'s {fault.target})",
            file=sys.stderr,
            flush=True,
        )

    def step_delay(self, step: int) -> float:
        """Extra seconds a `slow` fault adds to `step` (events are written once, when it starts)."""
        delay = 0.0
        for fault in self.faults:
            if fault.kind == "slow" and fault.until_gate and self._gate_open():
                continue
            if fault.kind == "slow" and step >= fault.step:
                if fault not in self._fired:
                    self._fired.add(fault)
                    self.events.emit(FaultEvent(fault="slow", step=step, seconds=fault.seconds))
                delay += fault.seconds
        return delay

    def before_backward(self, loss: torch.Tensor, step: int) -> None:
        """Slow the backward pass about to run from `loss` (`slow_backward` faults, once per step).

        A hook on `loss` runs first thing in autograd's backward, before any parameter gradient, so the
        delay is inside this rank's backward pass and ahead of its gradient collectives.
        """
        self._step = step
        if self._backward_step == step or not loss.requires_grad:
            return
        delay = 0.0
        for fault in self.faults:
            if fault.kind == "slow_backward" and step >= fault.step:
                if fault not in self._fired:
                    self._fired.add(fault)
                    self.events.emit(FaultEvent(fault="slow_backward", step=step, seconds=fault.seconds))
                delay += fault.seconds
        if delay:
            self._backward_step = step

            def sleep(grad: torch.Tensor) -> None:
                time.sleep(delay)

            loss.register_hook(sleep)  # type: ignore[no-untyped-call]

    def after_step(self, step: int) -> None:
        """Called once step `step` has completed (before any checkpoint of it)."""
        if self._first_step is None:
            self._first_step = step
            if self.replacement:
                first = max(step, (self.predecessor_reached or 0) + 1)
                self.faults = [f for f in self.faults if f.kind in _TIMED or f.step >= first]
        for fault in self.faults:
            if fault.step == step and fault.kind in ("kill", "exit", "hang"):
                self._fire(fault, step)
            elif self._step_of(fault) == step and fault.kind == "bitflip" and fault.target in ("param", "moment"):
                self._bitflip(fault, step)
        self._release(step)

    def after_save_staged(self, step: int) -> None:
        """Called right after the save of `step` returned (staged; the upload may still run)."""
        for fault in self.faults:
            if fault.kind == "kill_during_checkpoint" and step >= fault.step and fault not in self._fired:
                self._fire(fault, step)

    def _fire(self, fault: Fault, step: int) -> None:
        self._fired.add(fault)
        if fault.kind == "kill" and self.ready is not None:
            with self.ready_phase():
                deadline = time.monotonic() + self.ready_wait_s
                while not self.ready() and time.monotonic() < deadline:
                    time.sleep(0.05)
        self.events.emit(FaultEvent(fault=fault.kind, step=step, pid=os.getpid()))
        print(f"torchrig: drill fault {fault.kind} at step {step} (rank {fault.rank})", file=sys.stderr, flush=True)
        if fault.kind in ("kill", "kill_during_checkpoint"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "exit":
            os._exit(FAULT_EXIT_CODE)
        elif fault.kind == "hang":
            while True:  # the watchdog (or the drill's timeout) ends this
                time.sleep(3600)


def flip_bit(tensor: torch.Tensor, element: int, bit: int) -> None:
    """Flip bit `bit` of element `element` of `tensor` (of this rank's shard, for a DTensor) in place (in
    memory: autograd never sees it).

    The bit is counted in the element's value (little-endian byte order, as on every supported device).

    Raises:
        ValueError: the element or the bit is out of range.
    """
    import torch

    to_local = getattr(tensor, "to_local", None)  # FSDP/HSDP: this rank's shard of a DTensor
    if callable(to_local):
        tensor = to_local()
    flat = tensor.detach().view(-1)
    size = flat.element_size()
    if not 0 <= element < flat.numel() or not 0 <= bit < 8 * size:
        raise ValueError(f"bitflip: element {element} bit {bit} outside a tensor of {flat.numel()} x {size} bytes")
    raw = flat.view(torch.uint8)
    index = element * size + bit // 8
    raw[index] = raw[index] ^ (1 << (bit % 8))
