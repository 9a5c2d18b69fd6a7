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
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from orchestrator.errors import UnsupportedFeature
from orchestrator.spec import JobSpec
from training.contract import Summary

__all__ = [
    "Backend",
    "Capabilities",
    "DryRun",
    "KubernetesOptions",
    "LocalOptions",
    "NodePlacement",
    "RayOptions",
    "RunHandle",
    "RunState",
    "RunStatus",
    "SubmitOptions",
    "SupervisedRun",
]


class RunState(str, enum.Enum):
    """Lifecycle of a run on any backend. Terminal states never change again."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"  # stopped on SIGTERM / Ctrl-C after an emergency checkpoint: run it again to resume
    UNKNOWN = "unknown"

    @property
    def terminal(self) -> bool:
        return self in (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED, RunState.PREEMPTED)

    @property
    def exit_code(self) -> int:
        """`torchrig status` exit code: 0 succeeded, 1 failed, 10 running/pending, 11 cancelled, 12 unknown,
        13 preempted."""
        return {
            RunState.PREEMPTED: 13,
            RunState.SUCCEEDED: 0,
            RunState.FAILED: 1,
            RunState.PENDING: 10,
            RunState.RUNNING: 10,
            RunState.CANCELLED: 11,
            RunState.UNKNOWN: 12,
        }[self]


@runtime_checkable
class SupervisedRun(Protocol):
    """A run this process supervises (`Backend.launch`): the drills, the benchmarks and `torchrig run`
    drive every backend's runs through this surface alone.

    `poll` never blocks; `wait` blocks until the run ends (cancelling it when `timeout_s` passes) and
    returns its summary (also written to `run_dir/summary.json`).
    """

    @property
    def run_dir(self) -> Path:
        """The run directory (`training.contract.RunFiles` layout)."""
        ...

    def poll(self) -> RunState:
        """RUNNING (or PENDING) while the run goes on; a terminal state once it has ended."""
        ...

    def wait(self, timeout_s: float | None = None) -> Summary:
        """Supervise until the run ends; returns (and writes) its summary."""
        ...

    def kill_node(self, node: int) -> list[int]:
        """Kill emulated node `node` like a machine dying (its agent and workers); returns the pids.

        Raises:
            UnsupportedFeature: the backend cannot kill a node of a supervised run.
        """
        ...

    def add_node(self) -> int:
        """Start a replacement node that joins the running job; returns its index.

        Raises:
            UnsupportedFeature: the backend cannot add a node to a supervised run.
        """
        ...

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the run: SIGTERM, then SIGKILL what is left after `grace_s`."""
        ...

    def request_cancel(self, reason: str = "cancelled by the user") -> None:
        """Ask a running `wait` to cancel the run (signal-safe: returns at once; a second call skips
        the grace period). What a Ctrl-C or SIGTERM handler calls; `reason` goes into the summary."""
        ...


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; specs asking for more fail before anything is submitted."""

    elastic: bool = True
    multi_node: bool = True
    gpus: bool = True
    max_nodes: int | None = None
    supervised: bool = False  # `launch` returns a SupervisedRun (drills, benchmarks, `torchrig run`)


@dataclass(frozen=True)
class NodePlacement:
    """Where one emulated node of a local run runs (the partition drill puts each in its own network
    namespace)."""

    prefix: tuple[str, ...] = ()  # command prefix, e.g. ("ip", "netns", "exec", "ns0")
    addr: str = "127.0.0.1"  # the address other nodes reach this node's agent at
    ifname: str | None = None  # the interface gloo binds to (GLOO_SOCKET_IFNAME)


@dataclass
class LocalOptions:
    """Options only the local backend reads."""

    nodes: int | None = None  # number of emulated nodes (agents); default spec.nodes.min
    worker: str | None = None  # module (`-m`) or `.py` file each agent runs; default `training`
    placements: list[NodePlacement] = field(default_factory=list)  # per node; a replacement takes the last


@dataclass
class RayOptions:
    """Options only the Ray backend reads."""

    address: str | None = None  # Jobs API address (http://HEAD:8265); None runs an embedded local Ray
    allow_node_local_stores: bool = False  # a remote cluster: only node-local stores is a warning, not an error
    probe: bool = True  # a remote cluster: check first that it can run the job (ray_jobs.probe_cluster)


@dataclass
class KubernetesOptions:
    """Options only the Kubernetes backend reads."""

    context: str | None = None  # kubeconfig context
    namespace: str | None = None  # default: spec.kubernetes.namespace


@dataclass
class SubmitOptions:
    """Per-invocation options (CLI flags), separate from the spec: common ones, then one typed section
    per backend (a backend reads only its own)."""

    run_dir: str | None = None
    dry_run: bool = False
    fixed_size: bool = False
    monitoring: bool = False
    quiet: bool = False
    env: dict[str, str] = field(default_factory=dict)  # extra worker env (drills inject faults here)
    local: LocalOptions = field(default_factory=LocalOptions)
    ray: RayOptions = field(default_factory=RayOptions)
    kubernetes: KubernetesOptions = field(default_factory=KubernetesOptions)


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

    def launch(self, spec: JobSpec, options: SubmitOptions | None = None) -> SupervisedRun:
        """Check, plan and start a run that this process supervises (`launch_dry_run(dry_run(...))`).

        Raises:
            UnsupportedFeature: the backend cannot supervise runs from here (see `capabilities.supervised`).
        """
        return self.launch_dry_run(self.dry_run(spec, options))

    def launch_dry_run(self, dryrun: DryRun) -> SupervisedRun:
        """Start exactly what `dryrun` describes, supervised from this process."""
        if not self.capabilities.supervised:
            raise UnsupportedFeature(f"backend {self.name!r} cannot supervise a run from this process")
        return self._launch(dryrun)

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

    def _launch(self, dryrun: DryRun) -> SupervisedRun:
        """Start a supervised run (backends with `capabilities.supervised`)."""
        raise UnsupportedFeature(f"backend {self.name!r} cannot supervise a run from this process")

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
