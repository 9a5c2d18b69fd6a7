"""Stack dumps of the workers (`RunFiles.stack_file`): their format, and which ranks were elsewhere.

A rank's file holds one section per dump. Each section opens with a header line, written by the worker
(its watchdog) or by `torchrig status --stacks` before it signals the worker:

    # torchrig stacks: rank=1 generation=0 step=3 reason=watchdog time=1795443940.512

(`torchrig status --stacks` sends `DUMP_SIGNAL`, which every worker answers with a dump), followed
by `faulthandler`'s text for every thread, most recent call first:

    Thread 0x00007f3a... (most recent call first):
      File "/app/training/faults.py", line 139 in _fire
      ...

`ranks_apart(dumps)` names the ranks whose training thread is not where the others are: in a hang the
healthy ranks wait at the same collective (the same innermost frame of torchrig or torch.distributed
code) and the culprit is somewhere else. Pure functions over text, so the CLI, the drills and tests
read dumps of any run the same way.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from training.contract.files import RunFiles

__all__ = [
    "DUMP_SIGNAL",
    "HEADER_PREFIX",
    "Frame",
    "ThreadStack",
    "header",
    "innermost_frames",
    "last_dump",
    "parse_threads",
    "ranks_apart",
    "read_stack_dumps",
    "read_stack_file",
    "training_thread",
]

HEADER_PREFIX = "# torchrig stacks:"
DUMP_SIGNAL = signal.SIGUSR1  # a worker answers it with a dump of every thread into its stack file

# Code that counts as "where a rank is": torchrig's worker and torch.distributed. The task's own code
# and torch's internals below them are not (every rank runs the same model code).
FRAME_MARKERS = ("/training/", "/torch/distributed/")
# A thread with one of these in its stack is inside a collective or waiting for one: DDP's all-reduce
# is awaited at the end of backward (torch/autograd), FSDP's and explicit collectives in torch.distributed.
_WAITING_MARKERS = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/")
# The training loop's modules: the thread running them is the one that matters.
_LOOP_FILES = ("/training/trainer.py", "/training/worker.py")

_THREAD_RE = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)\b.*\(most recent call first\):\s*$")
_STACK_RE = re.compile(r"^Stack \(most recent call first\):\s*$")  # faulthandler without all_threads
_FRAME_RE = re.compile(r'^\s+File "(?P<path>.*)", line (?P<line>\d+) in (?P<function>.+?)\s*$')


def header(*, rank: int, generation: int, reason: str, step: int | None = None, at: float | None = None) -> str:
    """The line that opens one dump section (newline included)."""
    parts = [f"rank={rank}", f"generation={generation}"]
    if step is not None:
        parts.append(f"step={step}")
    parts += [f"reason={reason}", f"time={at if at is not None else time.time():.3f}"]
    return f"{HEADER_PREFIX} {' '.join(parts)}\n"


@dataclass(frozen=True)
class Frame:
    """One Python frame of a dump."""

    path: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in {self.function}"


@dataclass(frozen=True)
class ThreadStack:
    """One thread of a dump; `frames` innermost first (as faulthandler prints them)."""

    thread_id: str
    current: bool  # the thread that wrote the dump (the watchdog's, or the one the signal interrupted)
    frames: tuple[Frame, ...]


def last_dump(text: str) -> str:
    """The newest section of a stack file (the whole text when it has no header)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(HEADER_PREFIX)]
    return "\n".join(lines[starts[-1] + 1 :] if starts else lines)


def parse_threads(text: str) -> list[ThreadStack]:
    """The threads of one dump section (`last_dump`), in the order faulthandler wrote them."""
    threads: list[ThreadStack] = []
    thread_id: str | None = None
    current = False
    frames: list[Frame] = []

    def flush() -> None:
        if thread_id is not None:
            threads.append(ThreadStack(thread_id, current, tuple(frames)))

    for line in text.splitlines():
        if m := _THREAD_RE.match(line):
            flush()
            thread_id, current, frames = m.group(2), m.group(1) == "Current thread", []
        elif _STACK_RE.match(line):
            flush()
            thread_id, current, frames = "", True, []
        elif (m := _FRAME_RE.match(line)) and thread_id is not None:
            frames.append(Frame(m["path"], int(m["line"]), m["function"]))
    flush()
    return threads


def _has(stack: ThreadStack, markers: Iterable[str]) -> bool:
    return any(marker in frame.path for frame in stack.frames for marker in markers)


def training_thread(threads: list[ThreadStack]) -> ThreadStack | None:
    """The thread that runs the training loop: the one in `training/trainer.py` or `worker.py`, else the
    main thread (its outermost frame is a module's), else the first thread that did not write the dump."""
    for stack in threads:
        if _has(stack, _LOOP_FILES):
            return stack
    for stack in threads:
        if stack.frames and stack.frames[-1].function == "<module>":
            return stack
    others = [s for s in threads if not s.current] or threads
    return others[0] if others else None


def _innermost(stack: ThreadStack) -> Frame | None:
    for frame in stack.frames:
        if any(marker in frame.path for marker in FRAME_MARKERS):
            return frame
    return stack.frames[0] if stack.frames else None


def innermost_frames(dumps: Mapping[int, str]) -> dict[int, Frame]:
    """Per rank, the innermost torchrig / torch.distributed frame of the training thread of its newest
    dump (its innermost frame at all when none is). Ranks whose dump has no frame are left out."""
    out: dict[int, Frame] = {}
    for rank, text in dumps.items():
        stack = training_thread(parse_threads(last_dump(text)))
        frame = _innermost(stack) if stack is not None else None
        if frame is not None:
            out[rank] = frame
    return out


def ranks_apart(dumps: Mapping[int, str]) -> list[int]:
    """The ranks that were not where the others were (not at the same collective), from their dumps.

    The ranks sharing the most common innermost frame (`innermost_frames`) are together; every other
    rank is apart. On a tie (two ranks, two places) the group waiting inside a collective (a
    torch.distributed / autograd / DDP frame in its stack) is together; when that does not decide
    either, every rank is returned.

    Args:
        dumps: Rank -> the text of its stack file (`read_stack_dumps`).

    Returns:
        Sorted ranks; empty when every rank with a dump was at the same place.
    """
    frames = innermost_frames(dumps)
    groups: dict[Frame, list[int]] = {}
    for rank, frame in frames.items():
        groups.setdefault(frame, []).append(rank)
    if len(groups) <= 1:
        return []
    largest = max(len(ranks) for ranks in groups.values())
    top = [frame for frame, ranks in groups.items() if len(ranks) == largest]
    if len(top) > 1:
        waiting = []
        for frame in top:
            stack = training_thread(parse_threads(last_dump(dumps[groups[frame][0]])))
            if stack is not None and _has(stack, _WAITING_MARKERS):
                waiting.append(frame)
        if len(waiting) != 1:
            return sorted(frames)
        top = waiting
    together = set(groups[top[0]])
    return sorted(rank for rank in frames if rank not in together)


_RANK_FILE_RE = re.compile(r"^rank-(\d+)\.txt$")


MAX_STACK_READ_BYTES = 4 << 20  # a stack file's newest bytes read: its newest dumps (a dump is ~10-100 KiB)


def read_stack_file(path: str | os.PathLike[str]) -> str:
    """The last `MAX_STACK_READ_BYTES` of a regular file as text ("" for anything else): a stack file
    gains a section per dump and is written by the workers, so it is read bounded and never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ""
        start = max(0, st.st_size - MAX_STACK_READ_BYTES)
        data = os.pread(fd, MAX_STACK_READ_BYTES, start)
    except OSError:
        return ""
    finally:
        os.close(fd)
    text = data.decode("utf-8", "replace")
    if start:  # cut mid-file: begin at the first whole section
        cut = text.find(HEADER_PREFIX)
        text = text[cut:] if cut >= 0 else ""
    return text


def read_stack_dumps(run_dir: str | os.PathLike[str], generation: int) -> dict[int, str]:
    """Rank -> the text of its stack file in restart generation `generation` (empty files left out; a
    file over `MAX_STACK_READ_BYTES` from its first section within its last `MAX_STACK_READ_BYTES`)."""
    directory = RunFiles(run_dir).stacks_dir(generation)
    out: dict[int, str] = {}
    try:
        entries = sorted(Path(directory).iterdir())
    except OSError:
        return out
    for path in entries:
        m = _RANK_FILE_RE.match(path.name)
        if not m:
            continue
        text = read_stack_file(path)
        if text.strip():
            out[int(m.group(1))] = text
    return out
