"""Preemption without loss: SIGTERM (or `restarts.preemptSignal`) becomes an emergency checkpoint.

Kubernetes evicts a pod with SIGTERM and a grace period (node drains, spot nodes, Kueue preemption); a
spot VM under Ray gets 30 s to 2 min of notice; a Ctrl-C of `torchrig run` reaches the workers as a
SIGTERM from their torchrun agent. Without a handler the workers die like a SIGKILL and the job loses
every step since its last periodic checkpoint. With one (`PreemptionHandler`, installed by the worker):

1. the signal only sets a flag (a Python handler on the main thread) and starts the deadline clock,
   `restarts.preemptGraceSeconds`;
2. at every step boundary the ranks exchange their flags (`Agreement`: one 4-byte all-reduce on a gloo
   group of its own, started at one boundary and read at the next, so it overlaps a whole step and
   training never waits for it); the first boundary where the exchanged value says "stop" is the stop
   step, the same on every rank, so no rank is ever left alone in a collective;
3. every rank takes a synchronous checkpoint of that step (`CheckpointManager.save(synchronous=True)`:
   the same commit protocol as every save, so it is verified like any other on restore), writes a
   `preempted` event (`training.contract.events.Preempted`) and the worker exits with
   `ExitCode.PREEMPTED` (202, retryable): the next start restores that step and loses none;
4. the deadline, or a second signal, ends the process at once (`os._exit(202)`) wherever it is. A save
   cut short never commits: the manifest is written last and atomically (`training.checkpoint.save`),
   so the restore falls back to the previous checkpoint. A repeat of the signal within
   `DUPLICATE_WINDOW_S` is the same notice (an outside SIGTERM to every process of a node reaches a
   worker twice: directly, and forwarded by its torchrun agent), not a second one.

Launchers must wait longer than the grace period before they kill a worker: what they are given for it
(torchrun's shutdown timeout, the signals it forwards, a pod's grace period) is
`training.preemption_timing`'s, re-exported here.

Only the main thread can install signal handlers. Where the worker runs in another thread (Ray Train's
training function) the launcher hands `install` a way to run it on the main thread
(`training.ray_train`: the worker actor's main thread, through Ray's `__ray_call__`); without one
`install` does nothing and says so in the log.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from training.contract.events import Preempted
from training.contract.exit_codes import ExitCode

if TYPE_CHECKING:
    from training.config import RestartsConfig
    from training.metrics.base import MetricsSink
    from training.watchdog import StepWatchdog

__all__ = [
    "DUPLICATE_WINDOW_S",
    "PREEMPTED_EXIT_CODE",
    "Agreement",
    "PreemptedExit",
    "PreemptionHandler",
]

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = int(ExitCode.PREEMPTED)
DUPLICATE_WINDOW_S = 1.0  # a repeat of the signal this soon is the same notice, not "stop now"
NOTICE_NAME = "DRAIN"  # the `signal` of a `preempted` event caused by a scheduler's notice (a node drain)


class PreemptedExit(Exception):
    """Raised at the stop step once the emergency checkpoint is done: the worker exits 202."""

    def __init__(self, step: int, committed: bool) -> None:
        super().__init__(f"preempted at step {step} (emergency checkpoint {'committed' if committed else 'lost'})")
        self.step = step
        self.committed = committed


class _Saver(Protocol):
    """What the emergency save needs of `training.checkpoint.CheckpointManager`."""

    @property
    def last_committed_step(self) -> int | None: ...

    history: list[Any]

    def save(self, step: int, state: dict[str, Any], *, final: bool = False, synchronous: bool = False) -> Any: ...

    def wait(self) -> None: ...


class Agreement:
    """The ranks' agreement on the stop step: a MAX all-reduce of the local flags, started at one step
    boundary and read at the next (collective: every rank calls `poll` at every boundary). With one
    process there is nothing to agree: the local flag answers at once.

    It rides on `group` when given: the checkpoint manager's control group (`CheckpointManager.
    control_group`), whose other collectives are issued from the same thread at step boundaries, in the
    same order on every rank, so the two interleave identically everywhere. Otherwise (no checkpoint
    stores) it builds a gloo group of its own. One group fewer per process-group generation: an in-place
    recovery builds every group anew, and at 8 ranks on 2 cores each gloo group costs about 25 ms of the
    recovery (docs/performance.md)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._group: Any = group
        if self.distributed and group is None:
            from training.inplace import sockets

            with sockets.recording():  # in-place recovery cuts these connections when the group breaks
                self._group = dist.new_group(backend="gloo")
        self._work: Any = None
        self._flag: Any = None

    def poll(self, local: bool) -> bool:
        """Whether the group stops at this boundary (the same answer on every rank)."""
        if not self.distributed:
            return local
        import torch
        import torch.distributed as dist

        if self._work is not None:
            self._work.wait()
            self._work = None
            if int(self._flag.item()):
                return True
        self._flag = torch.tensor([1 if local else 0], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return False

    def close(self) -> None:
        """Wait for the exchange in flight (every rank started it, so it completes)."""
        work, self._work = self._work, None
        if work is not None:
            try:
                work.wait()
            except Exception:  # a peer already gone: nothing to agree on any more
                log.debug("preemption: the last flag exchange failed", exc_info=True)


class PreemptionHandler:
    """Turns a preemption signal into an agreed stop step, an emergency checkpoint and exit 202.

    Args:
        grace_s: `restarts.preemptGraceSeconds` (0: off; `install` leaves the signals alone).
        sink: Where the `preempted` event goes.
        rank: This process's global rank (rank 0 prints the summary line).
        extra_signal: `restarts.preemptSignal` (a signal name), besides SIGTERM.
        watchdog: The step watchdog (the save runs under its checkpoint-I/O limit).
        io_timeout_s: That limit (`checkpoint.ioTimeoutSeconds`).
        exit: How the deadline and a second signal end the process (tests replace `os._exit`).
    """

    def __init__(
        self,
        grace_s: float,
        sink: MetricsSink,
        *,
        rank: int = 0,
        extra_signal: str | None = None,
        watchdog: StepWatchdog | None = None,
        io_timeout_s: float = 600.0,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.grace_s = grace_s
        self.sink = sink
        self.rank = rank
        self.signals = [signal.SIGTERM] + ([signal.Signals[extra_signal]] if extra_signal else [])
        self.watchdog = watchdog
        self.io_timeout_s = io_timeout_s
        self._exit = exit
        self.requested_at: float | None = None  # time.monotonic() of the first signal
        self.signal_name = ""
        self._step = 0  # the last step boundary seen (for the deadline's event)
        self._done = threading.Event()  # the preempted event is written: nothing left to record
        self._lock = threading.RLock()  # one ending only (the deadline, a second signal, the save)
        self._timer: threading.Timer | None = None
        self._previous: dict[int, Any] = {}
        self._agreement: Agreement | None = None
        self._installed = False
        self._on_main_thread: Callable[[Callable[[], None]], None] | None = None
        self._notice: Callable[[], float | None] | None = None
        self._notice_every = 1
        self.stop_step: int | None = None
        # Called with the stop step before the emergency save, on every rank at the same boundary (the
        # trainer's `sdc` check, so the emergency checkpoint is certified like the others: restore prefers
        # certified ones, and an uncertified emergency save would be passed over for an older one).
        self.before_save: Callable[[int], None] | None = None

    @classmethod
    def from_spec(
        cls, restarts: RestartsConfig, sink: MetricsSink, *, rank: int, watchdog: StepWatchdog, io_timeout_s: float
    ) -> PreemptionHandler:
        return cls(
            restarts.preempt_grace_seconds,
            sink,
            rank=rank,
            extra_signal=restarts.preempt_signal,
            watchdog=watchdog,
            io_timeout_s=io_timeout_s,
        )

    @property
    def enabled(self) -> bool:
        return self.grace_s > 0

    @property
    def requested(self) -> bool:
        """A preemption signal reached this process."""
        return self.requested_at is not None

    # -- signals ----------------------------------------------------------------------------------
    def install(self, on_main_thread: Callable[[Callable[[], None]], None] | None = None) -> PreemptionHandler:
        """Answer the preemption signals (a no-op when off).

        Only the main thread can install a signal handler. In another thread, `on_main_thread` (a way
        to run a function on the process's main thread and wait for it: Ray Train's, see
        `training.ray_train`) installs it there; without one, SIGTERM keeps its action (logged).
        """
        if not self.enabled:
            return self
        if threading.current_thread() is threading.main_thread():
            self._set_handlers()
        elif on_main_thread is not None:
            on_main_thread(self._set_handlers)
            self._on_main_thread = on_main_thread
        else:
            log.info("preemption: not on the main thread; SIGTERM keeps its default action here")
            return self
        self._installed = True
        return self

    def _set_handlers(self) -> None:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def uninstall(self) -> None:
        """Restore the previous handlers and stop the deadline clock (the process lives on)."""
        if self._previous:
            if self._on_main_thread is not None and threading.current_thread() is not threading.main_thread():
                self._on_main_thread(self._restore_handlers)
            else:
                self._restore_handlers()
        if self._timer is not None:
            self._timer.cancel()

    def watch_notice(self, poll: Callable[[], float | None], every_steps: int) -> PreemptionHandler:
        """Also stop for a scheduler's advance notice, not only a signal (Ray Train's node drain:
        `training.ray_train.ray_drain_notice`).

        Args:
            poll: Returns the seconds left before this group's node is reclaimed, or None while no
                reclaim is announced. Called at every `every_steps`-th step boundary on every rank
                (it may be a collective: Ray's is a barrier). An exception turns the watch off (logged).
            every_steps: Steps between polls (`metrics.logEvery`).
        """
        if self.enabled:
            self._notice, self._notice_every = poll, max(1, every_steps)
        return self

    def _poll_notice(self, step: int) -> None:
        if self._notice is None or self.requested or step % self._notice_every:
            return
        try:
            left = self._notice()
        except Exception as exc:  # a scheduler API failing must never end the training
            log.warning("preemption: the scheduler's notice cannot be read (%s); not watched any more", exc)
            self._notice = None
            return
        if left is not None:
            self.request(NOTICE_NAME, grace_s=min(self.grace_s, max(0.0, left)))

    def request(self, signal_name: str = "SIGTERM", *, grace_s: float | None = None) -> None:
        """A preemption notice (what the signal handler calls): first one starts the deadline (`grace_s`,
        default `restarts.preemptGraceSeconds`); a second one, later than `DUPLICATE_WINDOW_S`, ends the
        process now."""
        now = time.monotonic()
        if self.requested_at is None:
            self.requested_at, self.signal_name = now, signal_name
            grace = self.grace_s if grace_s is None else grace_s
            self._timer = threading.Timer(grace, self._end, args=("deadline",))
            self._timer.daemon = True
            self._timer.start()
            print(
                f"torchrig: {signal_name}: stopping at the next step boundary with an emergency checkpoint "
                f"(grace {grace:g} s; signal again to stop now)",
                file=sys.stderr,
                flush=True,
            )
            return
        if now - self.requested_at >= DUPLICATE_WINDOW_S:
            self._end("second_signal")

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.request(signal.Signals(signum).name)

    def _since_signal(self) -> float:
        return round(time.monotonic() - (self.requested_at or time.monotonic()), 3)

    def _end(self, reason: str) -> None:
        """The deadline or a second signal: record it (unless the outcome is recorded) and exit now."""
        with self._lock:
            if not self._done.is_set():
                self._done.set()
                self.sink.emit(
                    Preempted(
                        step=self.stop_step if self.stop_step is not None else self._step,
                        committed=False,
                        reason=reason,
                        signal=self.signal_name,
                        grace_s=self.grace_s,
                        since_signal_s=self._since_signal(),
                    )
                )
                what = "the grace period ran out" if reason == "deadline" else "asked again to stop"
                print(
                    f"torchrig: preempted: {what} before the emergency checkpoint committed; the previous "
                    "checkpoint stands (a partial save is never committed)",
                    file=sys.stderr,
                    flush=True,
                )
            logging.shutdown()
            self._exit(PREEMPTED_EXIT_CODE)

    # -- the step boundary --------------------------------------------------------------------------
    def connect(self, group: Any = None) -> PreemptionHandler:
        """Start the agreement, on `group` (the checkpoint manager's control group) or a gloo group of its
        own (collective: every rank, once the process group exists; nothing where no handler is
        installed: no rank of the job can then be signalled)."""
        if self._installed and self._agreement is None:
            self._agreement = Agreement(group)
        return self

    def disconnect(self) -> None:
        """Forget the agreement's group (in-place recovery, `training.inplace`, before the broken
        groups are destroyed: nothing may keep them alive)."""
        self._agreement = None

    def reconnect(self, group: Any = None) -> PreemptionHandler:
        """A new process group replaced the old one (in-place recovery): create the agreement anew
        (collective, like `connect`)."""
        self._agreement = None
        return self.connect(group)

    def should_stop(self, step: int) -> bool:
        """At the boundary after `step` (collective): whether the group stops here."""
        self._step = step
        self._poll_notice(step)  # every rank at the same boundaries: the same answer everywhere
        if not self._installed and self._notice is None:
            return False
        if self._agreement is None:
            return self.requested
        return self._agreement.poll(self.requested)

    def at_step_boundary(self, step: int, checkpoints: _Saver | None, state: dict[str, Any]) -> None:
        """Called after every completed step: at the agreed stop step, save and raise `PreemptedExit`."""
        if self.should_stop(step):
            self.stop(step, checkpoints, state)

    def stop(self, step: int, checkpoints: _Saver | None, state: dict[str, Any]) -> None:
        """Take the emergency checkpoint of `step` (collective), record it and raise `PreemptedExit`."""
        self.stop_step = step
        if self.requested_at is None:  # another rank's notice: the clock starts at the agreement here
            self.requested_at, self.signal_name = time.monotonic(), "peer"
        start = time.perf_counter()
        committed, stores_ok = False, []
        if checkpoints is not None:
            if self.before_save is not None:
                self.before_save(step)  # collective; a disagreement raises (the group restarts, certified)
            if self.watchdog is not None:
                with self.watchdog.io(self.io_timeout_s):
                    outcome = self._save(step, checkpoints, state)
            else:
                outcome = self._save(step, checkpoints, state)
            committed = checkpoints.last_committed_step == step
            stores_ok = list(getattr(outcome, "stores_ok", []) or [])
        save_s = round(time.perf_counter() - start, 3)
        with self._lock:
            if self._done.is_set():  # the deadline struck meanwhile and is ending the process
                raise PreemptedExit(step, False)
            self._done.set()
            self.sink.emit(
                Preempted(
                    step=step,
                    committed=committed,
                    reason="saved" if committed else "save_failed",
                    signal=self.signal_name,
                    grace_s=self.grace_s,
                    since_signal_s=self._since_signal(),
                    save_s=save_s,
                    stores_ok=stores_ok,
                )
            )
        if self.rank == 0:
            what = f"emergency checkpoint committed to {', '.join(stores_ok) or 'the stores'}"
            if checkpoints is None:
                what = "no checkpoint stores configured"
            elif not committed:
                what = "the emergency checkpoint failed; the previous checkpoint stands"
            print(
                f"torchrig: preempted at step {step}: {what} in {save_s:.2f} s ({self._since_signal():.2f} s after "
                f"the signal, grace {self.grace_s:g} s); exiting {PREEMPTED_EXIT_CODE} to be resumed",
                file=sys.stderr,
                flush=True,
            )
        raise PreemptedExit(step, committed)

    @staticmethod
    def _save(step: int, checkpoints: _Saver, state: dict[str, Any]) -> Any:
        outcome = checkpoints.save(step, state, synchronous=True)
        if outcome is None:  # this step was saved already (a periodic save at this boundary): wait for it
            checkpoints.wait()
            outcome = next((o for o in reversed(checkpoints.history) if getattr(o, "step", None) == step), None)
        return outcome

    def close(self) -> None:
        """End of the worker: drain the agreement and stop the deadline clock unless it is counting."""
        if self._agreement is not None:
            self._agreement.close()
        if not self.requested:
            self.uninstall()
