"""The bound on a PyTorchJob's pod recreations that its operator never enforces.

Why it is needed (kubeflow/training-operator v1.9.4, tag 4445c12aa62e4345b0c2c6ac9b215a70eca46ed7):

- `restartPolicy: ExitCode` runs every pod with `restartPolicy: Never` (`pkg/core/pod.go`
  `SetRestartPolicy`), and a pod whose `pytorch` container ends with a code >= 128
  (`pkg/util/train/train_util.go` `IsRetryableExitCode`) is deleted and created again under the same
  name (`pkg/controller.v1/common/pod.go` `ReconcilePods`).
- `runPolicy.backoffLimit` does not bound those recreations. `ReconcileJobs`
  (`pkg/controller.v1/common/job.go`, lines 175-207) fails a job past it in two ways only:
  `PastBackoffLimit` (`pkg/core/job.go`, lines 93-131) sums the container `restartCount` of the pods
  in phase Running, and a container under `Never` is never restarted in place while a recreated pod
  starts again at 0, so the sum stays 0; and `exceedsBackoffLimit` needs
  `WorkQueue.NumRequeues(job) + 1 > backoffLimit`, but the PyTorchJob controller's queue is
  `util.FakeWorkQueue` (`pkg/controller.v1/pytorch/pytorchjob_controller.go`, line 82), whose
  `NumRequeues` is always 0 (`pkg/common/util/fake_workqueue.go`, line 56). Only `backoffLimit: 0`
  ever fails a job, on its first failed pod.
- So a pod OOM-killed at every start (137), or a Master whose loss makes every Worker exit 204
  (`ExitCode.STORE_LOST`), is recreated for as long as the job exists. torchrun's `--max-restarts`
  does not help: each recreated pod runs a new torchrun whose count starts at 0.

What this module does: `python -m training.launch`, the first program of every PyTorchJob container,
records each start of its pod in the job's first shared checkpoint store, as one object created only if
absent (`CheckpointStorage.create_exclusive`): `pod-recreations/<job>/<scope>/<pod>/<n>.json` for the
pod's n-th start. A start past `restarts.max + 1` (the pod was recreated more than `restarts.max`
times) exits `ExitCode.RESTARTS_SPENT` (4), which the operator takes as permanent: the job fails with
one line saying so.

Choices, and why:

- Counted per pod, not summed over the job: losing the rendezvous host (a Master, or the store-only
  Master of the standby shape, which runs no launcher) recreates every Worker at once, one restart of
  the job that a sum would charge once per pod; per pod it costs each pod one, as a group restart costs
  each torchrun agent one. A pod that fails alone (a bad node, an OOM) spends only its own budget.
  And each object has one writer (the operator creates a pod of a name only once the last one is
  gone), so no store needs a compare-and-swap beyond "create if absent".
- Kept in the checkpoint store (the first one that outlives the pod: an object store, or a `file://`
  store on a `pvc`), because that is the one place every recreated pod of the job reaches again: the
  c10d rendezvous store lives in a pod (it is lost with the Master) and the run directory is an emptyDir.
  A job with only pod-local stores is not counted; the launcher says so.
- Scoped by the job's name and a digest of its job file (`scope`), and the whole record is removed when
  the launcher ends the job with a permanent code (this bound, a preflight error, a command that cannot
  run), and when the job succeeds (`forget_after_success`, called by torchrig's torchrun agent once
  torchrun returned 0: every agent of the round passed its exit barrier). Nothing inside a pod names the
  PyTorchJob *instance*: the operator labels pods with the job's name only, its uid is only in
  `ownerReferences`, which the downward API does not expose, and a pod's own `metadata.uid` changes with
  every recreation. So a job resubmitted under its name starts from 0 after a job that succeeded or that
  this launcher ended, and after any change to its spec. The job's Secret (`<job>-job-secret`, mounted
  at `Env.JOB_SECRET_FILE`) is made anew by each `torchrig submit` or `helm install` and deleted by
  `torchrig cancel` and `helm uninstall`, so it names the instance well enough: its HMAC is part of the
  scope, and a job deleted that way and submitted again identical starts from 0 too. Only one re-applied
  with kubectl while its old Secret still exists continues the count (delete `pod-recreations/<job>/` in
  the store to start from 0).
- Only where the PyTorchJob operator started the pod: the hostname is the operator's pod name
  (`<job>-master-<i>` / `<job>-worker-<i>`, `common/util.go` `GenGeneralName`; the operator sets no
  `spec.hostname`) and the operator's rendezvous variable names the job's own host (`MASTER_ADDR` =
  `<job>-master-0`, `master.go`; elastic: `PET_RDZV_ENDPOINT` = `<job>-worker-0:<port>`, `elastic.go`).
  A TrainJob's restarts are counted by its JobSet (`failurePolicy.maxRestarts`) and a RayJob's by Ray
  Train (`FailureConfig.max_failures`); local runs restart nothing.
- A store that cannot be read or written in `STORE_TIMEOUT_S` does not stop the pod (a warning): the
  bound is lost for that start rather than a job failed by a storage blip.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from training.contract import Env

if TYPE_CHECKING:
    from training.checkpoint_config import StoreConfig
    from training.config import WorkerSpec

__all__ = [
    "RECREATIONS_DIR",
    "STORE_TIMEOUT_S",
    "PodRecreations",
    "RecreationDecision",
    "forget_after_success",
    "open_for_pod",
    "pytorchjob_pod",
    "shared_store",
    "spec_scope",
]

RECREATIONS_DIR = "pod-recreations"
# How long one start waits for the store (a list and a small create; a delete when the job ends).
STORE_TIMEOUT_S = 60.0
# The operator's elastic rendezvous variable (pkg/controller.v1/pytorch/elastic.go EnvRDZVEndpoint).
PET_RDZV_ENDPOINT = "PET_RDZV_ENDPOINT"
_START_NAME = re.compile(r"^(\d{8})\.json$")
_MAX_START = 10**8 - 1  # 8 digits: a hostile name cannot make the next number unbounded
_CREATE_ATTEMPTS = 16

T = TypeVar("T")


class _Store(Protocol):
    """What the count needs of a `training.checkpoint.storage.CheckpointStorage` (tests pass a fake)."""

    def list_dir(self, rel: str) -> list[str]: ...

    def create_exclusive(self, rel: str, data: bytes) -> None: ...

    def delete_dir(self, rel: str) -> None: ...


def pytorchjob_pod(job: str, env: Mapping[str, str], hostname: str) -> str | None:
    """The name of the PyTorchJob pod of `job` this process runs in, or None anywhere else.

    Args:
        job: the job's name (`metadata.name`, the PyTorchJob's).
        env: the process environment (the operator's variables).
        hostname: the host name (in a pod: the pod's name).
    """
    if re.fullmatch(rf"{re.escape(job)}-(?:master|worker)-(?:0|[1-9][0-9]{{0,5}})", hostname) is None:
        return None
    fixed = env.get(Env.MASTER_ADDR) == f"{job}-master-0"
    elastic = env.get(PET_RDZV_ENDPOINT, "").startswith(f"{job}-worker-0:")
    return hostname if fixed or elastic else None


def _maybe_pytorchjob_pod(env: Mapping[str, str], hostname: str) -> bool:
    """Whether this process may run in a PyTorchJob pod of some job (`pytorchjob_pod` without the job's name:
    False rules it out for every job)."""
    if re.search(r"-(?:master|worker)-(?:0|[1-9][0-9]{0,5})$", hostname) is None:
        return False
    return env.get(Env.MASTER_ADDR, "").endswith("-master-0") or "-worker-0:" in env.get(PET_RDZV_ENDPOINT, "")


def spec_scope(spec_bytes: bytes, secret: bytes | None = None) -> str:
    """The count's scope within a job name: a digest of the job file every pod of the job mounts and, where
    the job has one, of its secret (`Env.JOB_SECRET_FILE`: a new one for each submission, so a job deleted
    and submitted again identical starts from 0). The secret enters through an HMAC: the digest, written in
    the store's key names, tells nothing of it."""
    digest = hashlib.sha256(spec_bytes)
    if secret:
        digest.update(hmac.new(secret, b"torchrig pod-recreations scope", hashlib.sha256).digest())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class RecreationDecision:
    """One start of a pod, counted.

    Attributes:
        job: the job's name.
        pod: the pod's name.
        start: this start's number (1: the pod's first start, no recreation yet).
        allowed: `restarts.max`, the recreations a pod may have.
    """

    job: str
    pod: str
    start: int
    allowed: int

    @property
    def recreations(self) -> int:
        return self.start - 1

    @property
    def spent(self) -> bool:
        """Whether this start is one recreation too many: the pod must not run."""
        return self.recreations > self.allowed

    def message(self) -> str:
        """One line for the pod's log and the job's failure: what happened and what to do."""
        return (
            f"spec.restarts.max: pod {self.pod} has been recreated {self.recreations} times and restarts.max "
            f"allows {self.allowed} (the PyTorchJob operator recreates a pod after every exit code >= 128 and "
            f"counts none of them, runPolicy.backoffLimit included), so job {self.job!r} fails here: find the "
            f"cause in the earlier exits (kubectl describe pytorchjob {self.job}), then resubmit it (its count "
            "starts again from 0) or raise spec.restarts.max"
        )


def _bounded(fn: Callable[[], T], timeout_s: float) -> T:
    """`fn()` in a daemon thread, given up after `timeout_s` (an object store call has no deadline of its
    own; the thread dies with the process when the launcher execs)."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(fn())
        except BaseException as exc:  # carried to the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="torchrig-pod-recreations", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer in {timeout_s:g} s")
    if errors:
        raise errors[0]
    return results[0]


class PodRecreations:
    """The starts of the pods of one job, in one store.

    Args:
        store: the job's first shared checkpoint store.
        job: the job's name.
        scope: `spec_scope` of the job file.
        timeout_s: the most one store operation may take.
    """

    def __init__(self, store: _Store, job: str, scope: str, *, timeout_s: float = STORE_TIMEOUT_S) -> None:
        self.store = store
        self.job = job
        self.scope = scope
        self.timeout_s = timeout_s

    def _dir(self, pod: str) -> str:
        return f"{RECREATIONS_DIR}/{self.job}/{self.scope}/{pod}"

    def starts(self, pod: str) -> int:
        """How many starts of `pod` are recorded (the highest number; names not ours are ignored)."""
        numbers = [int(m.group(1)) for name in self.store.list_dir(self._dir(pod)) if (m := _START_NAME.match(name))]
        return max(numbers, default=0)

    def _record(self, pod: str) -> int:
        number = self.starts(pod) + 1
        for _ in range(_CREATE_ATTEMPTS):
            if number > _MAX_START:
                raise ValueError(f"{self._dir(pod)}: start numbers exhausted")
            record = {"job": self.job, "pod": pod, "start": number, "time": round(time.time(), 3)}
            try:
                self.store.create_exclusive(f"{self._dir(pod)}/{number:08d}.json", json.dumps(record).encode())
            except FileExistsError:
                number += 1  # another start of this name got there first (a straggler of a deleted pod)
                continue
            return number
        raise FileExistsError(f"{self._dir(pod)}: {_CREATE_ATTEMPTS} start numbers taken in a row")

    def record_start(self, pod: str, allowed: int) -> RecreationDecision:
        """Record one start of `pod` and say whether it may run.

        Raises:
            OSError, ValueError, TimeoutError: the store could not be read or written in time.
        """
        start = _bounded(lambda: self._record(pod), self.timeout_s)
        return RecreationDecision(job=self.job, pod=pod, start=start, allowed=allowed)

    def reset(self) -> None:
        """Forget every start of the job (all scopes): it ended, and a resubmitted job starts from 0."""
        _bounded(lambda: self.store.delete_dir(f"{RECREATIONS_DIR}/{self.job}"), self.timeout_s)


def shared_store(spec: WorkerSpec) -> tuple[int, StoreConfig] | None:
    """The job's first checkpoint store that outlives a pod (index, store): an object store, or a `file://`
    store on a `pvc`. A `file://` store without one is an emptyDir of the pod (`orchestrator.compile._pod`)
    and `memory://` lives in one process."""
    for i, store in enumerate(spec.spec.checkpoint.stores):
        if store.shared:
            return i, store
    return None


def forget_after_success(env: Mapping[str, str], hostname: str, warn: Callable[[str], None]) -> None:
    """The job succeeded (torchrun returned 0 in this pod): forget its pod starts, so the same job
    resubmitted under its name starts from 0. Best effort and bounded: the job's success stands whatever
    the store says; a count left behind is the case the module docstring names."""
    spec_path = env.get(Env.SPEC, "")
    if not spec_path or not os.path.isfile(spec_path) or not _maybe_pytorchjob_pod(env, hostname):
        return  # (before loading the spec: the spec model's import costs every local agent ~0.1 s at its end)
    try:
        from training.config import load_worker_spec

        spec = load_worker_spec(spec_path)  # bounded and validated: the bytes below are what it read
        with open(spec_path, "rb") as f:
            spec_bytes = f.read()
        opened = open_for_pod(spec, spec_bytes, run_dir=env.get(Env.RUN_DIR), env=env, hostname=hostname, warn=warn)
        if opened is not None:
            opened[0].reset()
    except Exception as exc:  # the job succeeded: a store that fails now only leaves the count behind
        warn(f"could not forget the job's pod starts after its success ({type(exc).__name__}: {exc})")


def open_for_pod(
    spec: WorkerSpec,
    spec_bytes: bytes,
    *,
    run_dir: str | None,
    env: Mapping[str, str],
    hostname: str,
    warn: Callable[[str], None],
    timeout_s: float = STORE_TIMEOUT_S,
) -> tuple[PodRecreations, str] | None:
    """The count of this PyTorchJob pod's starts and the pod's name; None where nothing is counted (not a
    PyTorchJob pod; no store outlives the pod, which `warn` is told)."""
    pod = pytorchjob_pod(spec.name, env, hostname)
    if pod is None:
        return None
    found = shared_store(spec)
    if found is None:
        warn(
            "pod recreations are not counted (spec.restarts.max does not bound them): no checkpoint store "
            "outlives the pod; give a file:// store a pvc, or add an object store"
        )
        return None
    from training.checkpoint.storage import open_storage
    from training.contract.orders import SecretError, load_job_secret

    try:
        secret = load_job_secret(env)
    except SecretError:  # the launcher refuses an unusable secret itself; the count goes on without it
        secret = None
    i, store = found
    opened = open_storage(store.resolved_uri(run_dir), store.options, name=f"spec.checkpoint.stores[{i}]")
    return PodRecreations(opened, spec.name, spec_scope(spec_bytes, secret), timeout_s=timeout_s), pod
