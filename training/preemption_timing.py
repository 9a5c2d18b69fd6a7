"""How long a launcher waits for a preempted worker: the launcher's side of `training.preemption`.

A preempted worker stops at an agreed step after an emergency checkpoint, within
`restarts.preemptGraceSeconds`. Whatever starts it must wait longer than that before it kills it.
torchrun forwards SIGTERM to its workers and SIGKILLs them after its shutdown timeout
(`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, default 30 s): `launcher_env` sets it above the grace period, and
adds `restarts.preemptSignal` to the signals it forwards. A torchrun agent that got the signal shuts its
workers down and exits (it never restarts them in place), so the job stops and the scheduler (or
`torchrig run` again) resubmits it. Pods get `terminationGracePeriodSeconds` from
`pod_grace_period_seconds`. The compilers, the local backend and the chart (`_helpers.tpl`, `_pod.tpl`)
apply these numbers; nothing here imports torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from training.contract import Env

if TYPE_CHECKING:
    from training.config import RestartsConfig

__all__ = ["AGENT_MARGIN_S", "POD_MARGIN_S", "launcher_env", "pod_grace_period_seconds", "torchrun_shutdown_timeout"]

AGENT_MARGIN_S = 5  # torchrun waits this much longer than the workers' grace before it SIGKILLs them
POD_MARGIN_S = 10  # the pod's grace period: the workers' plus the agent's exit and the container's


def torchrun_shutdown_timeout(restarts: RestartsConfig) -> int:
    """Seconds torchrun waits for its workers after forwarding SIGTERM (above the workers' grace)."""
    return math.ceil(restarts.preempt_grace_seconds) + AGENT_MARGIN_S


def pod_grace_period_seconds(restarts: RestartsConfig) -> int:
    """A pod's `terminationGracePeriodSeconds`: the workers' grace, torchrun's margin and the exit."""
    return math.ceil(restarts.preempt_grace_seconds) + POD_MARGIN_S


def launcher_env(restarts: RestartsConfig) -> dict[str, str]:
    """What a torchrun agent's environment needs so that preemption works: its shutdown timeout above
    the grace period, and the extra preemption signal among the signals it forwards."""
    if restarts.preempt_grace_seconds <= 0:
        return {}
    env = {Env.ELASTIC_SHUTDOWN_TIMEOUT: str(torchrun_shutdown_timeout(restarts))}
    if restarts.preempt_signal is not None:
        env[Env.PET_SIGNALS_TO_HANDLE] = f"SIGTERM,SIGINT,SIGHUP,SIGQUIT,{restarts.preempt_signal}"
    return env
