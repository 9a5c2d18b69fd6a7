"""What a torchrig process's exit code means to whoever restarts it: one convention for every backend.

Kubeflow's (training-operator v1 `restartPolicy: ExitCode`, `IsRetryableExitCode`): a code from 1 to 127
is a permanent error, never retried; 128 and above is retryable (a signal death is `128 + signal`: 137
for SIGKILL, an OOM kill or a lost node; 143 for SIGTERM, a preemption). torchrig's own codes:

- `TASK_INVALID` (2): the job cannot run as written: the spec, `task.entrypoint` (import error) or
  `task.args` (the factory rejects them). Retrying changes nothing.
- `ENVIRONMENT` (3): this machine cannot run the job: a GPU job where CUDA is not available, a file
  checkpoint store that cannot be created or written, a command that cannot be executed. Deterministic
  for this pod or host, so not retried either; fix the image, the node pool or the volume.
- `RESTARTS_SPENT` (4): a PyTorchJob pod was recreated more than `restarts.max` times (its operator
  recreates a pod after every code >= 128 and bounds none of it: `training.pod_recreations`), so the
  launcher ends the job instead of starting the pod again.
- `TRAINING_FAILED` (200): an exception during training. Retryable: a survivor of a lost peer raises a
  gloo/NCCL error it cannot tell from a bug of its own (torchelastic restarts the group on any worker
  failure for the same reason), and the deterministic causes are found before training starts (by
  `training.preflight` in every compiled command), so what is left is bounded by `restarts.max`.
- `HUNG` (201): the step watchdog ended a rank that completed no step for `restarts.stepTimeoutSeconds`.
- `RECOVERY_FAILED` (203): in-place recovery (`training.inplace`) could not re-form the group within
  `restarts.inPlaceTimeoutSeconds` (no spare, a second death, a survivor stuck): the per-rank host exits
  with it so torchrun restarts the whole group from the durable checkpoint.
- `STORE_LOST` (204): torchrun's agent lost its c10d rendezvous store (the pod that hosts it died: a
  PyTorchJob's Master, or its store-only Master with standby nodes). torchrun itself raises
  `RendezvousConnectionError` and exits 1, which a PyTorchJob takes as permanent: the job failed where it
  should restart from its checkpoint. `training.torchrun` exits 204 instead, and every pod is recreated.
- `PREEMPTED` (202): the rank was asked to stop (SIGTERM, `restarts.preemptSignal`: an eviction, a spot
  notice, Ctrl-C) and stopped at a step every rank agreed on, after an emergency checkpoint of that step
  (`training.preemption`; the `preempted` event says whether it committed). Retryable: the next start
  resumes from it, losing no step.

- `STORE_UNAVAILABLE` (205): at restore, no checkpoint store that answered holds a checkpoint of this
  job and one did not answer (its listing failed: an object store's timeout, a volume not mounted back)
  for the retries of `checkpoint.ioTimeoutSeconds`. That store may hold the job's checkpoints, so the
  rank stops rather than start over from step 0 (`checkpoint.resume: never` starts over on purpose);
  a later start may find it back.

- `SDC_DETECTED` (206): the data-parallel replicas' fingerprints disagreed (`training.sdc`: silent data
  corruption, an `sdc` event names the suspects). Retryable: the group restarts from the newest
  certified checkpoint (one whose replicas agreed); an in-place host passes it through, since every
  rank's state may carry the corruption and no survivor's can be trusted (two replicas: no majority names
  the culprit; or no in-place recovery).
- `SDC_SUSPECT` (207): a majority of the replicas named this rank the suspect of a disagreement, and the job
  recovers in place (`training.inplace.protocol.decide_sdc`): this rank leaves, its in-place host gives
  its rank to a warm spare, and the survivors reload the newest certified checkpoint in place. Outside an
  in-place host (never the case: the decision needs one) it is retryable like 206.

200 to 207 lie above 128 + 64 (the highest signal), so they are never mistaken for a signal death.
`torchrun` itself exits 1 when its worker group failed and it has no restart left: under a PyTorchJob
(where torchrun owns the restart budget) that is permanent, as it should be; the TrainJob, whose restarts
belong to its JobSet, fails its Job only on `PERMANENT` codes and restarts on the rest.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["PERMANENT", "ExitCode", "is_retryable"]


class ExitCode(IntEnum):
    """Exit codes of the worker (`python -m training`) and the launcher (`python -m training.launch`)."""

    OK = 0
    # Permanent (1-127): never retried.
    FAILED = 1  # generic failure (torchrun: the worker group failed with no restart left)
    TASK_INVALID = 2  # spec, task.entrypoint or task.args cannot give a job
    ENVIRONMENT = 3  # this machine cannot run the job (CUDA, a store, the command)
    RESTARTS_SPENT = 4  # a PyTorchJob pod was recreated more than restarts.max times (training.pod_recreations)
    # Retryable (>= 128, above every signal death).
    TRAINING_FAILED = 200  # an exception during training (a lost peer, transient I/O, a device error)
    HUNG = 201  # the step watchdog ended a silent rank
    RECOVERY_FAILED = 203  # in-place recovery could not finish: the whole group restarts (the fallback)
    PREEMPTED = 202  # stopped on SIGTERM after an emergency checkpoint (training.preemption)
    STORE_LOST = 204  # torchrun's agent lost its rendezvous store (its host pod died): restart the job
    STORE_UNAVAILABLE = 205  # restore: a checkpoint store could not be read, none that could holds one
    SDC_DETECTED = 206  # the replicas disagreed (training.sdc): restart from the newest certified checkpoint
    SDC_SUSPECT = 207  # the majority named this rank (training.sdc): it leaves, a spare takes its rank in place

    @property
    def retryable(self) -> bool:
        return is_retryable(int(self))


# The codes torchrig's commands exit with on a deterministic startup error, plus the shell's "cannot
# execute" (126) and "not found" (127): what a Kubernetes pod failure policy fails the job on at once.
PERMANENT: tuple[int, ...] = (int(ExitCode.TASK_INVALID), int(ExitCode.ENVIRONMENT), 126, 127)


def is_retryable(returncode: int) -> bool:
    """Whether a process that ended with `returncode` may be retried (Kubeflow's rule).

    A negative code is how `subprocess` reports a death by signal (-9: SIGKILL): retryable, like 128 + 9.
    0 is success, not a failure to retry.
    """
    return returncode < 0 or returncode >= 128
