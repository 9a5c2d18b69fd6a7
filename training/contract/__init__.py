"""The typed contract between the control plane and the workers: everything that crosses a process
boundary is named here once.

- `env`: the environment variables a backend sets for its workers (`Env`), and `WorkerIdentity`,
  the one record of who a worker process is;
- `files`: the run-directory layout (`RunFiles`) and the one JSON / JSON-lines reader and writer;
- `events`: the kinds of `events.jsonl` lines (`EventKind`) with their typed payloads;
- `records`: `result.json` (`Result`), `summary.json` (`Summary`) and what rank 0 hands a driver
  that does not share its run directory (`WorkerReport`);
- `exit_codes`: what a worker's or launcher's exit code means to whoever restarts it (`ExitCode`).

Imports nothing but the standard library, so the orchestrator, the bench and the worker all use it.
"""

from training.contract.env import Env, WorkerIdentity
from training.contract.events import DrillEventKind, Event, EventKind, read_events
from training.contract.exit_codes import PERMANENT, ExitCode, is_retryable
from training.contract.files import JsonlTail, RunFiles, append_jsonl, open_append, read_json, read_jsonl, write_json
from training.contract.records import CheckpointSummary, FinalCheckpoint, Result, Summary, WorkerReport

__all__ = [
    "PERMANENT",
    "CheckpointSummary",
    "DrillEventKind",
    "Env",
    "Event",
    "EventKind",
    "ExitCode",
    "FinalCheckpoint",
    "JsonlTail",
    "Result",
    "RunFiles",
    "Summary",
    "WorkerIdentity",
    "WorkerReport",
    "append_jsonl",
    "is_retryable",
    "open_append",
    "read_events",
    "read_json",
    "read_jsonl",
    "write_json",
]
