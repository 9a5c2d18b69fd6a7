"""Typed errors. The CLI maps each to an exit code and a one-line message; nothing parses stdout.

Exit codes of the `torchrig` CLI (docs/operations.md has the same table):

| code | meaning |
|---|---|
| 0 | ok: the job succeeded (a drill: passed) |
| 1 | the job failed (a drill: its verdict failed; `checkpoints verify`: a checkpoint is invalid) |
| 2 | bad input: the spec, a flag, an unknown name, a malformed `TORCHRIG_*` variable |
| 3 | the backend failed: the cluster or launcher refused, or did not answer within `TORCHRIG_API_TIMEOUT` |
| 4 | the job could not recover within its restart budget (or found no checkpoint it required) |
| 5 | the job trained to the end but no store committed its final checkpoint: its last steps are lost |
| 6 | a drill was inconclusive: its fault struck after the job had finished, so it proved nothing |
| 130 | cancelled (Ctrl-C, `torchrig cancel`) |
| 141 | `torchrig run`: the reader of its stdout exited (`| head`); the run was stopped as on Ctrl-C |
| 202 | preempted (a first Ctrl-C, SIGTERM): stopped after an emergency checkpoint; run it again to resume |

`torchrig status` reports the run's state instead: 0 succeeded, 1 failed, 10 pending or running,
11 cancelled, 12 unknown, 13 preempted (`RunState.exit_code`).
"""

from __future__ import annotations

__all__ = [
    "EXIT_BACKEND",
    "EXIT_CHECKPOINT_LOST",
    "EXIT_FAILED",
    "EXIT_INCONCLUSIVE",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_RECOVERY",
    "EXIT_USAGE",
    "BackendError",
    "CompileError",
    "FinalCheckpointLost",
    "JobFailed",
    "RestartsExhausted",
    "SpecError",
    "TorchrigError",
    "UnsupportedFeature",
]

EXIT_OK = 0
EXIT_FAILED = 1  # the job (or the drill's verdict) failed
EXIT_USAGE = 2  # bad input: spec, flags, unknown names
EXIT_BACKEND = 3  # the cluster or launcher could not do what was asked
EXIT_RECOVERY = 4  # a job could not recover within its restart budget
EXIT_CHECKPOINT_LOST = 5  # trained to the end, but no store committed the final checkpoint
EXIT_INCONCLUSIVE = 6  # a drill proved nothing: its fault struck a job that had already finished
EXIT_PREEMPTED = 202  # stopped after an emergency checkpoint (training.contract.ExitCode.PREEMPTED): retryable


class TorchrigError(Exception):
    """Base of every error the CLI reports as a message instead of a traceback."""

    exit_code = EXIT_FAILED

    def lines(self) -> list[str]:
        return [str(self)]


class SpecError(TorchrigError):
    """The job file is not valid. `problems` holds one `path: message` entry per problem."""

    exit_code = EXIT_USAGE

    def __init__(self, problems: list[str] | str, source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        super().__init__("; ".join(self.problems))

    def lines(self) -> list[str]:
        prefix = f"{self.source}: " if self.source else ""
        return [prefix + p for p in self.problems]


class CompileError(TorchrigError):
    """A valid spec cannot be compiled to the requested target."""

    exit_code = EXIT_USAGE


class UnsupportedFeature(CompileError):
    """A target or backend cannot do what the spec asks (checked before anything is submitted)."""


class BackendError(TorchrigError):
    """The backend (launcher, Ray, Kubernetes API) failed."""

    exit_code = EXIT_BACKEND


class JobFailed(TorchrigError):
    """A worker failed on an error no restart cures (a permanent exit: a setting or the spec to fix, or
    checkpoints corrupt in every store): the run ended without spending its restarts."""

    exit_code = EXIT_FAILED


class RestartsExhausted(TorchrigError):
    """The job exhausted its restarts or could not find a checkpoint it was required to resume from.

    The run's verdict, as the CLI reports it (exit 4). Not `training.inplace.group.RecoveryFailed`, which
    is one in-place recovery giving up inside a worker (exit 203: torchrun restarts the group, a restart
    this budget counts).
    """

    exit_code = EXIT_RECOVERY


class FinalCheckpointLost(TorchrigError):
    """Every step ran, but the final checkpoint (`checkpoint.saveFinal`) reached no store.

    Not a clean success: the trained weights existed only in the workers' memory. A distinct code
    (not `RestartsExhausted`'s) because nothing needs restarting: fix the store, then run the job again
    (it resumes from the newest checkpoint that was committed).
    """

    exit_code = EXIT_CHECKPOINT_LOST
