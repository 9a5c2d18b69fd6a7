"""Process bookkeeping for local runs, from /proc (Linux), without psutil.

Elastic starts every worker in its own session, so a killed agent leaves its workers alive and
`killpg(agent)` does not reach them. Every process of a local run therefore carries two marker
variables in its environment (`Env.RUN_TOKEN`, `Env.LOCAL_NODE`; inherited by workers and their
children); finding "all processes of node i" is a scan of `/proc/*/environ` for those markers, which
also works after the agent is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from training.contract import Env

__all__ = [
    "alive",
    "find_marked",
    "kill_pids",
    "process_start_ticks",
    "spawn",
    "terminate_then_kill",
]


def spawn(
    cmd: Sequence[str], *, log: Path, env: Mapping[str, str], cwd: str | os.PathLike[str] | None = None
) -> subprocess.Popen[bytes]:
    """Start `cmd` in a session of its own (a Ctrl-C at the terminal reaches only the supervisor),
    stdin closed, stdout and stderr appended to `log`, with `env` over this process's environment."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env},
            cwd=cwd,
        )


def process_start_ticks(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (field 22 of /proc/PID/stat), None if gone.

    A pid plus its start time names a process uniquely: pids are reused, start times are not.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :].startswith("Z")


def alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether `pid` is a running (non-zombie) process, and the same one when `start_ticks` is given."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if _is_zombie(pid):
        return False
    return start_ticks is None or process_start_ticks(pid) == start_ticks


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out: dict[bytes, bytes] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key] = value
    return out


def find_marked(token: str, node: int | None = None, exclude: Iterable[int] = ()) -> list[int]:
    """Pids of live processes whose environment holds this run's token (and node index, if given)."""
    skip = {os.getpid(), *exclude}
    found: list[int] = []
    want_token = token.encode()
    want_node = None if node is None else str(node).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid in skip:
            continue
        env = _environ(pid)
        if env.get(Env.RUN_TOKEN.encode()) != want_token:
            continue
        if want_node is not None and env.get(Env.LOCAL_NODE.encode()) != want_node:
            continue
        if not _is_zombie(pid):
            found.append(pid)
    return found


def kill_pids(pids: Iterable[int], sig: signal.Signals = signal.SIGKILL) -> None:
    """Signal each pid and its process group (workers lead their own session; children share it)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def terminate_then_kill(pids: Iterable[int], grace_s: float, token: str | None = None) -> None:
    """SIGTERM `pids`, wait up to `grace_s` for them to exit, then SIGKILL what is left.

    With `token`, whatever still carries the run's marker at the end is killed too, so no worker of
    the run outlives this call.
    """
    pids = list(pids)
    kill_pids(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    kill_pids([p for p in pids if alive(p)], signal.SIGKILL)
    if token is not None:
        # A process caught mid-exec shows an empty environ for an instant: stop only after two clean scans.
        clean = 0
        for _ in range(40):
            left = find_marked(token)
            clean = 0 if left else clean + 1
            if clean >= 2:
                break
            kill_pids(left, signal.SIGKILL)
            time.sleep(0.05)
