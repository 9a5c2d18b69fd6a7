"""The backend interface: every place a job can run implements these `_`-prefixed hooks.

Public methods are guarded (feature checks, spec validation happen once, here); a backend only
implements the hooks. Submitting is `schedule(dry_run(spec))`: the dry run returns exactly what would
be submitted, so `--dry-run` and the real thing cannot diverge.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from orchestrator.errors import UnsupportedFeature
from orchestrator.spec import JobSpec

__all__ = ["Backend", "Capabilities", "DryRun", "RunHandle", "RunState", "RunStatus", "SubmitOptions"]


class RunState(str, enum.Enum):
    """Lifecycle of a run on any backend. Terminal states never change again."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"

    @property
    def terminal(self) -> bool:
        return self in (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)

    @property
    def exit_code(self) -> int:
        """`torchrig status` exit code: 0 succeeded, 1 failed, 10 running/pending, 11 cancelled, 12 unknown."""
        return {
            RunState.SUCCEEDED: 0,
            RunState.FAILED: 1,
            RunState.PENDING: 10,
            RunState.RUNNING: 10,
            RunState.CANCELLED: 11,
            RunState.UNKNOWN: 12,
        }[self]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; specs asking for more fail before anything is submitted."""

    elastic: bool = True
    multi_node: bool = True
    gpus: bool = True
    max_nodes: int | None = None


@dataclass
class SubmitOptions:
    """Per-invocation options (CLI flags), separate from the spec."""

    run_dir: str | None = None
    nodes: int | None = None  # local: number of emulated nodes (agents)
    address: str | None = None  # ray: Jobs API address
    context: str | None = None  # kubernetes: kubeconfig context
    namespace: str | None = None
    dry_run: bool = False
    fixed_size: bool = False
    monitoring: bool = False
    quiet: bool = False
    env: dict[str, str] = field(default_factory=dict)  # extra worker env (drills inject faults here)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class DryRun:
    """Exactly what `schedule` will submit: objects, commands, environment."""

    backend: str
    spec: JobSpec
    options: SubmitOptions
    request: Any  # backend-specific, plain data (list of manifests, launch config, Ray plan)

    def __str__(self) -> str:
        import yaml

        if isinstance(self.request, list):
            return yaml.safe_dump_all(self.request, sort_keys=False)
        return yaml.safe_dump(self.request, sort_keys=False) if isinstance(self.request, dict) else str(self.request)


@dataclass
class RunHandle:
    """A submitted run: `backend://id`, e.g. `local://runs/digits-ddp/20261122-230000`."""

    backend: str
    run_id: str
    info: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.backend}://{self.run_id}"


@dataclass
class RunStatus:
    handle: RunHandle
    state: RunState
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)


class Backend(ABC):
    """Base of every backend. Subclasses set `name` and `capabilities` and implement the hooks."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities] = Capabilities()

    # -- public, guarded -------------------------------------------------------------------------
    def check(self, spec: JobSpec, options: SubmitOptions | None = None) -> None:
        """Fail early with UnsupportedFeature when the spec asks for what this backend cannot do."""
        caps = self.capabilities
        if spec.spec.nodes.elastic and not caps.elastic and not (options and options.fixed_size):
            raise UnsupportedFeature(
                f"spec.nodes: backend {self.name!r} cannot run elastic jobs (min {spec.spec.nodes.min} < "
                f"max {spec.spec.nodes.max}); set min = max or pass --fixed-size"
            )
        if spec.spec.nodes.max > 1 and not caps.multi_node:
            raise UnsupportedFeature(f"spec.nodes.max: backend {self.name!r} runs one node only")
        if caps.max_nodes is not None and spec.spec.nodes.max > caps.max_nodes:
            raise UnsupportedFeature(f"spec.nodes.max: backend {self.name!r} supports at most {caps.max_nodes} nodes")
        if spec.spec.resources.gpus > 0 and not caps.gpus:
            raise UnsupportedFeature(f"spec.resources.gpus: backend {self.name!r} has no GPU support")
        self._check(spec, options or SubmitOptions())

    def dry_run(self, spec: JobSpec, options: SubmitOptions | None = None) -> DryRun:
        options = options or SubmitOptions()
        self.check(spec, options)
        return DryRun(backend=self.name, spec=spec, options=options, request=self._dry_run(spec, options))

    def schedule(self, dryrun: DryRun) -> RunHandle:
        return self._schedule(dryrun)

    def submit(self, spec: JobSpec, options: SubmitOptions | None = None) -> RunHandle:
        return self.schedule(self.dry_run(spec, options))

    def status(self, run_id: str) -> RunStatus:
        return self._status(run_id)

    def logs(self, run_id: str, rank: int | None = None, follow: bool = False) -> Iterator[str]:
        return self._logs(run_id, rank, follow)

    def cancel(self, run_id: str) -> RunStatus:
        return self._cancel(run_id)

    def list_runs(self) -> list[RunStatus]:
        return self._list()

    # -- hooks ------------------------------------------------------------------------------------
    def _check(self, spec: JobSpec, options: SubmitOptions) -> None:  # noqa: B027 - optional hook
        """Backend-specific feature checks (default: none)."""

    @abstractmethod
    def _dry_run(self, spec: JobSpec, options: SubmitOptions) -> Any: ...

    @abstractmethod
    def _schedule(self, dryrun: DryRun) -> RunHandle: ...

    @abstractmethod
    def _status(self, run_id: str) -> RunStatus: ...

    @abstractmethod
    def _logs(self, run_id: str, rank: int | None, follow: bool) -> Iterator[str]: ...

    @abstractmethod
    def _cancel(self, run_id: str) -> RunStatus: ...

    @abstractmethod
    def _list(self) -> list[RunStatus]: ...
