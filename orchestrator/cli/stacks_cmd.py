"""`torchrig status --stacks RUN`: every live rank of a local run dumps its Python stacks, now.

The workers answer `DUMP_SIGNAL` (SIGUSR1) with faulthandler's C handler, which writes every thread's
stack into `stacks/gen-G/rank-R.txt` even while the rank's main thread is blocked inside a
collective. This module finds the live ranks of the newest generation (their `start` events, checked
against /proc so a reused pid is never signalled), opens a section in each file (a header line),
signals them, runs `py-spy dump` too when py-spy is on PATH, waits for the dumps and says which
ranks were not where the others were (`training.contract.stacks.ranks_apart`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from orchestrator.errors import SpecError
from training.contract import Env, EventKind, RunFiles, read_events, read_json
from training.contract.files import make_private_dirs, open_private_append
from training.contract.stacks import (
    DUMP_SIGNAL,
    Frame,
    header,
    innermost_frames,
    ranks_apart,
    read_stack_dumps,
    read_stack_file,
)

__all__ = ["LiveRank", "StacksReport", "live_ranks", "report_stacks", "request_stacks", "stacks_hint"]

WAIT_S = 10.0  # how long to wait for every rank's dump
_SETTLE_S = 0.2  # a dump is complete once its file stopped growing for this long


@dataclass(frozen=True)
class LiveRank:
    rank: int
    pid: int
    generation: int


@dataclass
class StacksReport:
    """What one `--stacks` request produced."""

    generation: int
    files: dict[int, Path] = field(default_factory=dict)  # rank -> its stack file (dumped this time)
    missing: list[int] = field(default_factory=list)  # signalled ranks whose dump did not arrive in time
    frames: dict[int, Frame] = field(default_factory=dict)  # rank -> innermost torchrig/torch.distributed frame
    apart: list[int] = field(default_factory=list)  # ranks not at the same place as the others
    py_spy: dict[int, Path] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "files": {str(r): str(p) for r, p in sorted(self.files.items())},
            "missing": self.missing,
            "frames": {str(r): str(f) for r, f in sorted(self.frames.items())},
            "apart": self.apart,
            "py_spy": {str(r): str(p) for r, p in sorted(self.py_spy.items())},
        }


def _proc_environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0"))
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, sep, v in pairs if sep}


def _started_at(pid: int) -> float | None:
    """Unix time a process started (from /proc), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
    except (OSError, StopIteration, ValueError):
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _is_worker(pid: int, rank: int, started: float, token: str | None) -> bool:
    """Whether `pid` is still the worker that wrote a `start` event at `started` as rank `rank`."""
    began = _started_at(pid)
    if began is None or began > started + 1.0:  # gone, or a newer process with a reused pid
        return False
    env = _proc_environ(pid)
    if env.get(Env.RANK, "0") != str(rank):  # no launcher: a single rank 0
        return False
    return token is None or env.get(Env.RUN_TOKEN) == token


def live_ranks(run_dir: str | os.PathLike[str]) -> list[LiveRank]:
    """The ranks of the run's newest generation whose worker process is alive."""
    files = RunFiles(run_dir)
    starts = [e for e in read_events(files.events) if e.kind == EventKind.START and isinstance(e.get("pid"), int)]
    if not starts:
        return []
    generation = max(e.generation for e in starts)
    token = (read_json(files.supervisor) or {}).get("run_token")
    latest = {e.rank: e for e in starts if e.generation == generation}  # events are in time order
    return [
        LiveRank(rank, int(e.get("pid")), generation)
        for rank, e in sorted(latest.items())
        if _is_worker(int(e.get("pid")), rank, e.time, token if isinstance(token, str) else None)
    ]


def _py_spy(exe: str, pid: int, path: Path, rank: int, generation: int) -> None:
    try:
        proc = subprocess.run(
            [exe, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True, timeout=20, check=False
        )
        text = proc.stdout + (f"\n[py-spy exit {proc.returncode}]\n{proc.stderr}" if proc.returncode else "")
    except (OSError, subprocess.TimeoutExpired) as exc:
        text = f"[py-spy failed: {exc}]\n"
    with open_private_append(path) as fh:
        fh.write(header(rank=rank, generation=generation, reason="py-spy") + text)


def request_stacks(run_dir: str | os.PathLike[str], *, wait_s: float = WAIT_S) -> StacksReport:
    """Make every live rank of `run_dir` dump its stacks and wait for the dumps.

    Raises:
        SpecError: no live worker of the run was found.
    """
    files = RunFiles(run_dir)
    ranks = live_ranks(run_dir)
    if not ranks:
        raise SpecError(f"RUN: no live worker of {run_dir} (from the start events in {files.events.name})")
    generation = ranks[0].generation
    report = StacksReport(generation)
    opened: dict[int, int] = {}
    for live in ranks:
        path = files.stack_file(generation, live.rank)
        make_private_dirs(path.parent, levels=2)  # stack dumps are private, like the worker's own (0700 / 0600)
        with open_private_append(path) as fh:  # the worker appends after this line (its file is O_APPEND too)
            fh.write(header(rank=live.rank, generation=generation, reason="request"))
        opened[live.rank] = path.stat().st_size
        try:
            os.kill(live.pid, DUMP_SIGNAL)
        except ProcessLookupError:
            opened.pop(live.rank)
    exe = shutil.which("py-spy")
    if exe is not None:
        for live in ranks:
            out = files.py_spy_file(generation, live.rank)
            _py_spy(exe, live.pid, out, live.rank, generation)
            report.py_spy[live.rank] = out
    deadline = time.monotonic() + wait_s
    last, settled = dict(opened), set[int]()
    while len(settled) < len(opened) and time.monotonic() < deadline:
        time.sleep(_SETTLE_S)
        for rank in opened.keys() - settled:
            size = files.stack_file(generation, rank).stat().st_size
            if opened[rank] < size == last[rank]:
                settled.add(rank)  # grew, then held still for a settle period
            last[rank] = size
    for rank, start in sorted(opened.items()):
        if last[rank] > start:
            report.files[rank] = files.stack_file(generation, rank)
        else:
            report.missing.append(rank)
    dumps = {rank: read_stack_file(path) for rank, path in report.files.items()}  # bounded: the newest dumps
    report.frames = innermost_frames(dumps)
    report.apart = ranks_apart(dumps)
    return report


def _short(frame: Frame) -> str:
    for root in ("/training/", "/torch/"):
        if root in frame.path:
            return f"{root[1:]}{frame.path.rsplit(root, 1)[1]}:{frame.line} in {frame.function}"
    return str(frame)


def report_stacks(backend_name: str, run_id: str, *, echo: bool) -> dict[str, Any]:
    """`status --stacks`: request the dumps of a local run; print where each rank is when `echo`.

    Returns:
        The report as a dict (`status -o json` puts it under `details.stacks`).
    """
    if backend_name != "local":
        raise SpecError(f"--stacks: only local runs can be signalled from here, not {backend_name!r} runs")
    report = request_stacks(Path(run_id.removeprefix("local://")))
    if echo:
        click.echo(f"stacks of generation {report.generation}:")
        for rank, path in sorted(report.files.items()):
            where = _short(report.frames[rank]) if rank in report.frames else "no Python frame"
            click.echo(f"  rank {rank}: {path}  ({where})")
        for rank in report.missing:
            click.echo(f"  rank {rank}: no dump within {WAIT_S:.0f}s")
        if report.apart:
            click.echo(f"  not where the others are: rank {', '.join(str(r) for r in report.apart)}")
    return report.to_dict()


def stacks_hint(run_dir: str | os.PathLike[str]) -> str | None:
    """One line pointing at the newest generation's stack dumps (a hang the watchdog ended), naming the
    ranks that were not where the others were; None when the run has no dump. For a run's final line."""
    stacks = RunFiles(run_dir).stacks
    generations = sorted(
        (int(d.name.removeprefix("gen-")) for d in stacks.glob("gen-*") if d.name.removeprefix("gen-").isdigit()),
        reverse=True,
    )
    for generation in generations:
        dumps = read_stack_dumps(run_dir, generation)
        if dumps:
            apart = ranks_apart(dumps)
            where = f"; not where the others were: rank {', '.join(map(str, apart))}" if apart else ""
            return f"stacks: {RunFiles(run_dir).stacks_dir(generation)} ({len(dumps)} ranks{where})"
    return None
