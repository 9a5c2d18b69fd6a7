"""Hang forensics: the stack-file format and which ranks were elsewhere (training.contract.stacks), the
worker's dumper (training.stacks: faulthandler on SIGUSR1, the watchdog's dump, py-spy, the flight
recorder) and `torchrig status --stacks` finding live ranks. On a real hung gloo job:
tests/integration/test_straggler_hang.py."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli.stacks_cmd import live_ranks, stacks_hint
from training.contract import Env, EventKind, RunFiles, WorkerIdentity
from training.contract.stacks import (
    DUMP_SIGNAL,
    Frame,
    header,
    innermost_frames,
    last_dump,
    parse_threads,
    ranks_apart,
    read_stack_dumps,
)
from training.metrics.base import MetricsSink
from training.stacks import StackDumper, enable_flight_recorder, flight_recorder_env
from training.watchdog import DUMP_AT, StepWatchdog

SITE = "/venv/lib/python3.11/site-packages"
WATCHDOG_THREAD = """Current thread 0x00007f0000000001 (most recent call first):
  File "/app/training/watchdog.py", line 90 in _run
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap
"""


def dump(*frames: str, rank: int = 0) -> str:
    """A stack file: a header and faulthandler's text (the watchdog thread, then the main thread)."""
    main = "".join(f"  {f}\n" for f in frames)
    return (
        header(rank=rank, generation=0, reason="watchdog", step=3)
        + WATCHDOG_THREAD
        + "\nThread 0x00007f0000000002 (most recent call first):\n"
        + main
    )


HUNG = dump(
    'File "/app/training/faults.py", line 170 in _fire',
    'File "/app/training/faults.py", line 158 in after_step',
    'File "/app/training/trainer.py", line 280 in after_step',
    'File "/app/training/trainer.py", line 170 in train',
    'File "/usr/lib/python3.11/runpy.py", line 88 in _run_code',
    'File "/app/training/__main__.py", line 80 in <module>',
)
IN_ALLREDUCE = dump(
    f'File "{SITE}/torch/autograd/graph.py", line 829 in _engine_run_backward',
    f'File "{SITE}/torch/autograd/__init__.py", line 347 in backward',
    f'File "{SITE}/torch/_tensor.py", line 581 in backward',
    'File "/app/training/trainer.py", line 228 in step',
    'File "/app/training/trainer.py", line 168 in train',
    'File "/app/training/__main__.py", line 80 in <module>',
)
IN_ALL_GATHER = dump(
    f'File "{SITE}/torch/distributed/distributed_c10d.py", line 3800 in all_gather',
    'File "/app/training/metrics/straggler.py", line 150 in exchange',
    'File "/app/training/trainer.py", line 275 in after_step',
    'File "/app/training/__main__.py", line 80 in <module>',
)


# -- the format and the analysis (pure) -----------------------------------------------------------------


def test_parse_threads_and_the_innermost_torchrig_frame_of_the_training_thread() -> None:
    threads = parse_threads(last_dump(HUNG))
    assert [t.current for t in threads] == [True, False]
    assert threads[1].frames[0] == Frame("/app/training/faults.py", 170, "_fire")
    frames = innermost_frames({0: IN_ALLREDUCE, 1: HUNG, 2: IN_ALL_GATHER})
    assert frames[0] == Frame("/app/training/trainer.py", 228, "step")  # torch internals are skipped
    assert frames[1].function == "_fire"
    assert frames[2] == Frame(f"{SITE}/torch/distributed/distributed_c10d.py", 3800, "all_gather")


def test_last_dump_is_the_newest_section() -> None:
    text = HUNG + header(rank=1, generation=0, reason="request") + IN_ALLREDUCE.split("\n", 1)[1]
    assert innermost_frames({1: text})[1].function == "step"
    assert last_dump("no header\n") == "no header"


def test_ranks_apart_majority_tie_and_agreement() -> None:
    assert ranks_apart({0: IN_ALLREDUCE, 1: HUNG, 2: IN_ALLREDUCE}) == [1]
    assert ranks_apart({0: IN_ALLREDUCE, 1: IN_ALLREDUCE, 2: IN_ALLREDUCE}) == []
    # two ranks, two places: the one waiting in a collective is where the group is
    assert ranks_apart({0: IN_ALLREDUCE, 1: HUNG}) == [1]
    assert ranks_apart({0: HUNG, 1: IN_ALL_GATHER}) == [0]
    # both waiting, at different collectives: cannot tell, both named
    assert ranks_apart({0: IN_ALLREDUCE, 1: IN_ALL_GATHER}) == [0, 1]
    assert ranks_apart({0: IN_ALLREDUCE, 1: "garbage\n"}) == []  # a rank without frames is left out


def test_faulthandler_without_all_threads_and_real_dumps_parse() -> None:
    import faulthandler
    import tempfile

    with tempfile.TemporaryFile("w+") as fh:
        faulthandler.dump_traceback(file=fh, all_threads=False)
        fh.seek(0)
        (thread,) = parse_threads(fh.read())
    assert thread.frames[0].function == "test_faulthandler_without_all_threads_and_real_dumps_parse"


def test_read_stack_dumps_and_run_files(tmp_path: Path) -> None:
    files = RunFiles(tmp_path)
    assert files.stack_file(2, 1) == tmp_path / "stacks" / "gen-2" / "rank-1.txt"
    assert files.py_spy_file(2, 1) == tmp_path / "stacks" / "gen-2" / "rank-1.py-spy.txt"
    assert str(files.flight_recorder_prefix(2)).endswith("stacks/gen-2/flight-recorder-rank-")
    files.stacks_dir(2).mkdir(parents=True)
    files.stack_file(2, 0).write_text(IN_ALLREDUCE)
    files.stack_file(2, 1).write_text("")  # opened, never dumped
    files.py_spy_file(2, 0).write_text("py-spy")
    assert read_stack_dumps(tmp_path, 2) == {0: IN_ALLREDUCE}
    assert read_stack_dumps(tmp_path, 5) == {}


# -- the worker's dumper ----------------------------------------------------------------------------------


class Recorder(MetricsSink):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def on_event(self, event: Any, **fields: Any) -> None:
        self.events.append((str(event), fields))


def identity(run_dir: Path | None, rank: int = 1) -> WorkerIdentity:
    return WorkerIdentity(rank=rank, world_size=2, generation=0, run_dir=str(run_dir) if run_dir else None)


def _parked_in_a_known_frame(stop: threading.Event) -> None:
    stop.wait(10)


def test_dump_writes_every_thread_and_a_stacks_event(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no py-spy
    sink = Recorder()
    dumper = StackDumper(identity(tmp_path), sink).install()
    stop = threading.Event()
    parked = threading.Thread(target=_parked_in_a_known_frame, args=(stop,))
    parked.start()
    try:
        path = dumper.dump("watchdog", 7)
    finally:
        stop.set()
        parked.join()
        dumper.close()
    assert path == RunFiles(tmp_path).stack_file(0, 1)
    text = path.read_text()
    assert text.startswith("# torchrig stacks: rank=1 generation=0 step=7 reason=watchdog")
    assert "in _parked_in_a_known_frame" in text and "in test_dump_writes_every_thread" in text
    fields = {"step": 7, "reason": "watchdog", "path": str(path), "py_spy": None, "flight_recorder": None}
    assert sink.events == [(EventKind.STACKS.value, fields)]
    assert path.exists()  # a file with a dump is kept


def test_signal_dumps_into_the_file_and_unused_files_are_removed(tmp_path: Path) -> None:
    dumper = StackDumper(identity(tmp_path), Recorder()).install()
    path = RunFiles(tmp_path).stack_file(0, 1)
    try:
        os.kill(os.getpid(), DUMP_SIGNAL)
        deadline = time.monotonic() + 5
        while not path.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        dumper.close()
    assert "in test_signal_dumps_into_the_file" in path.read_text()
    assert signal.getsignal(DUMP_SIGNAL) == signal.SIG_DFL  # unregistered

    unused = StackDumper(identity(tmp_path, rank=0), Recorder()).install()
    assert RunFiles(tmp_path).stack_file(0, 0).exists()
    unused.close()
    assert not RunFiles(tmp_path).stack_file(0, 0).exists()  # nothing dumped: nothing left behind


def test_without_a_run_dir_the_dump_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    sink = Recorder()
    dumper = StackDumper(identity(None), sink).install()
    assert dumper.dump("watchdog", 1) is None
    dumper.close()
    assert not sink.events


def test_py_spy_output_when_it_is_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "py-spy"
    fake.write_text('#!/bin/sh\necho "Thread 1 (idle): MainThread  args: $*"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    sink = Recorder()
    dumper = StackDumper(identity(tmp_path / "run"), sink).install()
    dumper.dump("watchdog", 2)
    dumper.close()
    out = RunFiles(tmp_path / "run").py_spy_file(0, 1)
    assert f"args: dump --nonblocking --pid {os.getpid()}" in out.read_text()
    assert sink.events[0][1]["py_spy"] == str(out)


def test_flight_recorder_env_and_only_on_cuda_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert flight_recorder_env("/r/stacks/gen-0/flight-recorder-rank-", new_names=False) == {
        Env.NCCL_TRACE_BUFFER_SIZE: "2000",
        Env.NCCL_DEBUG_INFO_TEMP_FILE: "/r/stacks/gen-0/flight-recorder-rank-",
        Env.NCCL_DUMP_ON_TIMEOUT: "1",
    }
    assert Env.FR_BUFFER_SIZE in flight_recorder_env("p", new_names=True)
    import torch

    environ: dict[str, str] = {}
    monkeypatch.setattr(torch.version, "cuda", None)
    assert not enable_flight_recorder(identity(tmp_path), environ) and environ == {}
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert enable_flight_recorder(identity(tmp_path), environ)
    prefix = str(RunFiles(tmp_path).flight_recorder_prefix(0))
    assert prefix in environ.values() and environ[Env.NCCL_DUMP_ON_TIMEOUT] == "1"
    mine = {Env.FR_BUFFER_SIZE: "10"}
    assert not enable_flight_recorder(identity(tmp_path), mine) and mine == {Env.FR_BUFFER_SIZE: "10"}


def test_dump_includes_the_flight_recorder_when_it_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch >= 2.7 records gloo's collectives too, so the dump path runs here without a GPU."""
    import torch
    import torch.distributed as dist

    monkeypatch.setenv(Env.FR_BUFFER_SIZE, "100")
    monkeypatch.setenv("PATH", "/nonexistent")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        dist.all_reduce(torch.ones(2))
        sink = Recorder()
        dumper = StackDumper(identity(tmp_path), sink).install()
        dumper.dump("watchdog", 1)
        dumper.close()
    finally:
        dist.destroy_process_group()
    recorded = sink.events[0][1].get("flight_recorder")
    if recorded is None:
        pytest.skip("this torch's flight recorder does not record gloo")
    trace = pickle.loads(Path(recorded).read_bytes())
    assert any(e["profiling_name"].endswith("all_reduce") for e in trace["entries"])


# -- the watchdog dumps before it would exit ---------------------------------------------------------------


class FakeDumper:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float]] = []

    def dump(self, reason: str, step: int) -> None:
        self.calls.append((reason, step, time.monotonic()))


def test_watchdog_dumps_once_per_silence_at_dump_at_of_the_timeout() -> None:
    fake = FakeDumper()
    timeout = 1.6
    dog = StepWatchdog(timeout, Recorder(), poll_s=0.02, stacks=fake)  # type: ignore[arg-type]
    dog.start()
    try:
        dog.beat(4)
        start = time.monotonic()
        time.sleep(timeout * DUMP_AT + 0.3)  # past the dump point, well before the exit
        assert [(r, s) for r, s, _ in fake.calls] == [("watchdog", 4)]
        assert fake.calls[0][2] - start >= timeout * DUMP_AT
        dog.beat(5)  # progress again: the next silence gets its own dump
        time.sleep(timeout * DUMP_AT + 0.3)
        assert [s for _, s, _ in fake.calls] == [4, 5]
    finally:
        dog.stop()


# -- `torchrig status --stacks`: which processes it would signal ---------------------------------------------


def _start_line(rank: int, generation: int, pid: int, at: float) -> str:
    return json.dumps({"time": at, "rank": rank, "generation": generation, "event": "start", "pid": pid}) + "\n"


def test_live_ranks_are_the_newest_generation_still_running_as_that_rank(tmp_path: Path) -> None:
    env = {**os.environ, Env.RANK: "1"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        # /proc shows the child's own environment once it runs Python (a CI run under load once read an
        # environment without RANK right after the spawn): wait for it, the way a live worker has it.
        deadline = time.monotonic() + 10
        while f"{Env.RANK}=1".encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0"):
            assert time.monotonic() < deadline, "the child never showed its environment in /proc"
            time.sleep(0.05)
        now = time.time() + 1
        events = RunFiles(tmp_path).events
        events.write_text(
            _start_line(0, 0, proc.pid, now - 1)  # an older generation
            + _start_line(1, 1, proc.pid, now)
        )
        assert [(r.rank, r.pid, r.generation) for r in live_ranks(tmp_path)] == [(1, proc.pid, 1)]
        events.write_text(_start_line(0, 1, proc.pid, now))  # not the rank it runs as: never signalled
        assert live_ranks(tmp_path) == []
        events.write_text(_start_line(1, 1, proc.pid, now))
        (tmp_path / "supervisor.json").write_text('{"run_token": "other-run"}')
        assert live_ranks(tmp_path) == []  # another run's token
    finally:
        proc.kill()
        proc.wait()
    (tmp_path / "supervisor.json").unlink()
    assert live_ranks(tmp_path) == []  # gone


def test_a_pid_reused_after_the_start_event_is_not_this_worker(tmp_path: Path) -> None:
    RunFiles(tmp_path).events.write_text(_start_line(0, 0, os.getpid(), time.time() - 3600))
    assert live_ranks(tmp_path) == []  # this process started after that hour-old event


def test_stacks_hint_points_at_the_newest_generation_with_dumps(tmp_path: Path) -> None:
    files = RunFiles(tmp_path)
    assert stacks_hint(tmp_path) is None
    for generation, texts in ((0, {0: IN_ALLREDUCE, 1: HUNG, 2: IN_ALLREDUCE}), (1, {0: ""})):
        files.stacks_dir(generation).mkdir(parents=True)
        for rank, text in texts.items():
            files.stack_file(generation, rank).write_text(text)
    # generation 1 has only an empty file (nothing dumped): the hint names generation 0
    assert stacks_hint(tmp_path) == f"stacks: {files.stacks_dir(0)} (3 ranks; not where the others were: rank 1)"
