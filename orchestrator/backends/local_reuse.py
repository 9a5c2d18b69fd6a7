"""May a run go into an existing directory? (`--run-dir` of a local run.)

An empty or new directory is fine; a directory holding an earlier attempt of the same job is a resume
(its checkpoints are picked up, its summary kept under another name); anything else is refused
before a process starts, so one run never overwrites another's files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from orchestrator.backends.base import RunState
from orchestrator.errors import BackendError, SpecError
from orchestrator.loader import read_spec_text
from orchestrator.rundir import run_state
from orchestrator.spec import JobSpec
from training.contract import RunFiles

__all__ = ["check_reuse", "job_differences", "same_job"]


def job_differences(old: dict[str, Any], new: JobSpec) -> list[str]:
    """The fields that make `new` another job than the run in a directory (`old`, its job.yaml): its
    name, task and training loop. `training.steps` may differ (training a job longer, or stopping it
    sooner, resumes it: the checkpoints in its stores are picked up the same way); ports, node counts,
    stores and restarts may differ too. `["job.yaml"]` when the old document is no valid job."""
    from orchestrator.loader import validate_document

    try:
        before = validate_document(old).to_yaml_dict()
    except SpecError:
        return ["job.yaml"]
    now = new.to_yaml_dict()
    out = ["metadata.name"] if before["metadata"]["name"] != now["metadata"]["name"] else []
    out += ["spec.task"] if before["spec"]["task"] != now["spec"]["task"] else []
    was, is_ = before["spec"]["training"], now["spec"]["training"]
    out += [f"spec.training.{k}" for k in sorted(set(was) | set(is_)) if k != "steps" and was.get(k) != is_.get(k)]
    return out


def same_job(old: dict[str, Any], new: JobSpec) -> bool:
    """A resume: same name, task and training loop but for its length (`job_differences`)."""
    return not job_differences(old, new)


def check_reuse(run_dir: Path, spec: JobSpec) -> bool:
    """May `run_dir` take this run? True when it is a resume of the same job there.

    Raises:
        BackendError: a live run owns the directory.
        SpecError: the directory holds another job's run, or a summary without its job.yaml.
    """
    files = RunFiles(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise SpecError(f"--run-dir: {run_dir} is not a directory")
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return False
    state, _, _ = run_state(run_dir)
    if state is RunState.RUNNING:
        raise BackendError(f"--run-dir: {run_dir} belongs to a run that is still going")
    if not files.job.exists():
        if files.summary.exists():
            raise SpecError(f"--run-dir: {run_dir} holds a summary but no job.yaml; use another directory")
        return False
    try:
        old = yaml.safe_load(read_spec_text(str(files.job))) or {}  # bounded in size, like any job file
    except yaml.YAMLError:
        old = {}
    except SpecError as exc:  # a directory, binary, unreadable or oversized job.yaml
        raise SpecError(
            f"--run-dir: {files.job} is not a readable job file ({exc.problems[0]}); use another directory"
        ) from None
    differ = job_differences(old if isinstance(old, dict) else {}, spec)
    if differ:
        raise SpecError(
            f"--run-dir: {run_dir} holds a run of a different job ({', '.join(differ)} differ); use another directory"
        )
    return True
