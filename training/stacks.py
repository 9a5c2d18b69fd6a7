"""Hang forensics of one worker: its Python stacks (every thread) in the run directory, on demand.

`StackDumper.install()` opens `stacks/gen-G/rank-R.txt` (`RunFiles.stack_file`) and registers
`faulthandler` for `SIGUSR1` on it, so `torchrig status --stacks` can make a live rank write its stacks
even while its main thread is blocked inside a collective (faulthandler's handler is C code: it needs
no Python thread to be free). The step watchdog calls `dump()` before it exits, which also runs
`py-spy dump` when py-spy is on PATH and writes torch.distributed's flight recorder when it records.
The file format and the analysis of dumps (which rank is not at the collective) are
`training.contract.stacks`.

On CUDA builds `enable_flight_recorder` (called before the process group exists) turns on the
flight recorder with its dump on a collective timeout, into the same directory.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import IO

from training.contract import Env, RunFiles, WorkerIdentity
from training.contract.events import Stacks
from training.contract.files import PRIVATE_FILE_MODE, make_private_dirs, open_private_append
from training.contract.stacks import DUMP_SIGNAL, header
from training.metrics.base import MetricsSink

__all__ = [
    "DUMP_SIGNAL",
    "FLIGHT_RECORDER_ENTRIES",
    "StackDumper",
    "enable_flight_recorder",
    "flight_recorder_env",
]

log = logging.getLogger(__name__)

FLIGHT_RECORDER_ENTRIES = 2000  # collectives kept per process group (a few hundred KB)
PY_SPY_TIMEOUT_S = 20.0


def flight_recorder_env(prefix: str, *, new_names: bool) -> dict[str, str]:
    """The flight recorder's variables: `prefix` + rank is where a dump goes.

    Args:
        prefix: `RunFiles.flight_recorder_prefix(generation)`.
        new_names: The torch reads the `TORCH_FR_*` names (2.7 and later; the NCCL ones are deprecated).
    """
    return {
        Env.FR_BUFFER_SIZE if new_names else Env.NCCL_TRACE_BUFFER_SIZE: str(FLIGHT_RECORDER_ENTRIES),
        Env.FR_DUMP_TEMP_FILE if new_names else Env.NCCL_DEBUG_INFO_TEMP_FILE: prefix,
        Env.NCCL_DUMP_ON_TIMEOUT: "1",
    }


def _fr_dump_function() -> object | None:
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)


def enable_flight_recorder(identity: WorkerIdentity, environ: MutableMapping[str, str] | None = None) -> bool:
    """On a CUDA build with a run directory, turn the flight recorder on (before the process group is
    created); variables the user set already win. Returns whether it set anything."""
    import torch

    environ = os.environ if environ is None else environ
    if identity.run_dir is None or torch.version.cuda is None:
        return False
    dump = _fr_dump_function()
    new_names = getattr(dump, "__name__", "") == "_dump_fr_trace"
    if any(name in environ for name in (Env.FR_BUFFER_SIZE, Env.NCCL_TRACE_BUFFER_SIZE)):
        return False
    files = RunFiles(identity.run_dir)
    make_private_dirs(files.stacks_dir(identity.generation), levels=2)
    prefix = str(files.flight_recorder_prefix(identity.generation))
    for name, value in flight_recorder_env(prefix, new_names=new_names).items():
        environ.setdefault(name, value)
    return True


class StackDumper:
    """Writes this rank's stacks into `RunFiles.stack_file(generation, rank)`.

    Without a run directory dumps go to stderr (the rank's log) and no signal is registered.

    Args:
        identity: This rank (its run directory, generation and rank name the file).
        events: Where the `stacks` event of a `dump()` goes.
    """

    def __init__(self, identity: WorkerIdentity, events: MetricsSink) -> None:
        self.identity = identity
        self.events = events
        files = RunFiles(identity.run_dir) if identity.run_dir is not None else None
        self.path: Path | None = files.stack_file(identity.generation, identity.rank) if files else None
        self.py_spy_path: Path | None = files.py_spy_file(identity.generation, identity.rank) if files else None
        self.flight_recorder_path: Path | None = (
            Path(f"{files.flight_recorder_prefix(identity.generation)}{identity.rank}") if files else None
        )
        self._file: IO[str] | None = None
        self._registered = False

    def install(self) -> StackDumper:
        """Open the stack file and answer `DUMP_SIGNAL` with a dump into it (no-op without a run dir)."""
        if self.path is None or self._file is not None:
            return self
        try:
            # Stacks show the code and where every thread is: private to the user (0700 / 0600) on any backend.
            make_private_dirs(self.path.parent, levels=2)
            self._file = open_private_append(self.path)
        except OSError:
            log.exception("cannot open %s; stack dumps go to stderr", self.path)
            return self
        with contextlib.suppress(AttributeError, RuntimeError, ValueError):  # no SIGUSR1 (not POSIX)
            faulthandler.register(DUMP_SIGNAL, file=self._file, all_threads=True, chain=False)
            self._registered = True
        return self

    def dump(self, reason: str, step: int) -> Path | None:
        """Write every thread's stack now (plus py-spy and the flight recorder where available) and
        record a `stacks` event. Returns the stack file (None: went to stderr)."""
        out: IO[str] = self._file if self._file is not None else sys.stderr
        try:
            out.write(header(rank=self.identity.rank, generation=self.identity.generation, reason=reason, step=step))
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.flush()
        except (OSError, ValueError):
            log.exception("writing the stack dump failed")
        if self._file is None:
            return None
        py_spy = self._py_spy()
        flight = self._flight_recorder()
        self.events.emit(
            Stacks(
                step=step,
                reason=reason,
                path=str(self.path),
                py_spy=str(py_spy) if py_spy else None,
                flight_recorder=str(flight) if flight else None,
            )
        )
        return self.path

    def _py_spy(self) -> Path | None:
        exe = shutil.which("py-spy")
        if exe is None or self.py_spy_path is None:
            return None
        try:
            # --nonblocking: never pause the process it reads (here: itself).
            proc = subprocess.run(
                [exe, "dump", "--nonblocking", "--pid", str(os.getpid())],
                capture_output=True,
                text=True,
                timeout=PY_SPY_TIMEOUT_S,
                check=False,
            )
            text = proc.stdout + (f"\n[py-spy exit {proc.returncode}]\n{proc.stderr}" if proc.returncode else "")
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"[py-spy failed: {exc}]\n"
        try:
            with open_private_append(self.py_spy_path) as fh:
                fh.write(header(rank=self.identity.rank, generation=self.identity.generation, reason="py-spy") + text)
        except OSError:
            return None
        return self.py_spy_path

    def _flight_recorder(self) -> Path | None:
        """The flight recorder's entries (a pickle), when it records (its buffer size is set)."""
        if self.flight_recorder_path is None:
            return None
        size = os.environ.get(Env.FR_BUFFER_SIZE) or os.environ.get(Env.NCCL_TRACE_BUFFER_SIZE) or "0"
        dump = _fr_dump_function()
        if not size.isdigit() or int(size) <= 0 or not callable(dump):
            return None
        try:
            data = dump()
            fd = os.open(self.flight_recorder_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data if isinstance(data, bytes) else bytes(data))
        except Exception:  # a private torch API: never let it stop the watchdog's exit
            log.exception("dumping the flight recorder failed")
            return None
        return self.flight_recorder_path

    def close(self) -> None:
        """Stop answering the signal; an unused (empty) stack file and directory are removed."""
        if self._registered:
            with contextlib.suppress(AttributeError, RuntimeError, ValueError):
                faulthandler.unregister(DUMP_SIGNAL)
            self._registered = False
        file, self._file = self._file, None
        if file is None or self.path is None:
            return
        file.close()
        with contextlib.suppress(OSError):
            if self.path.stat().st_size == 0:
                self.path.unlink()
                self.path.parent.rmdir()  # only when no other rank's file is left
                self.path.parent.parent.rmdir()
