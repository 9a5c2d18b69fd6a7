"""The `torchrun` command line for bare metal or Slurm: run it once per node.

Rendezvous is c10d on `$HOST:29400` (the first node, say `$(scontrol show hostnames | head -1)` under
Slurm), so any node can restart and the group re-forms between `nodes.min` and `nodes.max` nodes. The
line starts with the preflight (`python -m training.launch ... --`, `training.preflight`): on a node
where the task does not import, a store cannot be written or CUDA is missing it exits 2 or 3 at once
(permanent: a Slurm `--requeue` or a retry loop should stop there) instead of spending torchrun's restarts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.compile import _common as c
from orchestrator.compile import _pod as p
from orchestrator.spec import JobSpec
from training.contract import Env
from training.preemption_timing import launcher_env

__all__ = ["RDZV_PORT", "TorchrunCommand", "compile_torchrun"]

RDZV_PORT = 29400


@dataclass(frozen=True)
class TorchrunCommand:
    """A launch plan: torchrun's argv (`args`) behind the preflight (`launcher`), the environment to
    export, and the same as shell text."""

    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    launcher: tuple[str, ...] = ()

    @property
    def argv(self) -> tuple[str, ...]:
        """What runs on each node: the preflight, which execs torchrun."""
        return (*self.launcher, *self.args)

    @property
    def command(self) -> str:
        """The command as one shell line; `$HOST` stays expandable."""
        return c.shell_join(list(self.argv))

    @property
    def script(self) -> str:
        """`export` lines followed by the command."""
        exports = [f"export {k}={c.shell_join([v])}" for k, v in self.env.items()]
        return "\n".join([*exports, self.command]) + "\n"

    def render(self) -> str:
        """What `torchrig render --target torchrun` prints: the script."""
        return self.script

    def to_dict(self) -> dict[str, Any]:
        return {
            "args": list(self.args),
            "launcher": list(self.launcher),
            "env": dict(self.env),
            "command": self.command,
        }


def compile_torchrun(
    spec: JobSpec,
    *,
    fixed_size: bool = False,
    spec_path: str = "job.yaml",
    rdzv_host: str = "$HOST",
    rdzv_port: int = RDZV_PORT,
) -> TorchrunCommand:
    """The torchrun invocation of this job.

    Args:
        spec: the job.
        fixed_size: `--nnodes max` instead of the elastic range.
        spec_path: path of the resolved job file on every node.
        rdzv_host: host of the c10d rendezvous store (default: the shell variable `$HOST`).
        rdzv_port: its port.
    """
    s = spec.spec
    nnodes = str(s.nodes.max) if (fixed_size or not s.nodes.elastic) else f"{s.nodes.min}:{s.nodes.max}"
    args = [
        "torchrun",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(s.procs_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{rdzv_host}:{rdzv_port}",
        "--rdzv-id",
        spec.name,
        "--max-restarts",
        str(s.restarts.max),
        *c.worker_program(spec_path),
    ]
    # torchrun's shutdown timeout above restarts.preemptGraceSeconds (training.preemption_timing).
    env = {
        Env.DISABLE_SHARED_RDZV_STORE: "1",
        Env.SPEC: spec_path,
        **launcher_env(spec.spec.restarts),
        **c.inplace_store_env(spec),
    }
    return TorchrunCommand(args=tuple(args), env=env, launcher=tuple(p.launcher(spec_path)))
