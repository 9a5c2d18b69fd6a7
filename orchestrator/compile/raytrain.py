"""The plan the Ray backend hands to Ray Train: plain data mirroring Ray's config objects.

Deliberately free of `ray` imports, so compiling (and `torchrig render --target raytrain`) works
where Ray is not installed. The backend builds `ray.train.ScalingConfig(**plan.scaling.kwargs())`
and so on. Each Ray Train worker is one rank, so `num_workers` is nodes x procsPerNode; an elastic
spec gives `num_workers=(min, max)`, which Ray Train v2 (>= 2.50) resizes between.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import yaml

from orchestrator.spec import JobSpec, parse_quantity

__all__ = ["CheckpointPlan", "FailurePlan", "RayTrainPlan", "RunPlan", "ScalingPlan", "compile_raytrain"]


@dataclass(frozen=True)
class ScalingPlan:
    """`ray.train.ScalingConfig`."""

    num_workers: int
    min_workers: int
    max_workers: int
    use_gpu: bool
    resources_per_worker: dict[str, float]

    @property
    def elastic(self) -> bool:
        return self.min_workers < self.max_workers

    def kwargs(self) -> dict[str, Any]:
        workers: int | tuple[int, int] = (self.min_workers, self.max_workers) if self.elastic else self.num_workers
        return {
            "num_workers": workers,
            "use_gpu": self.use_gpu,
            "resources_per_worker": dict(self.resources_per_worker),
        }


@dataclass(frozen=True)
class FailurePlan:
    """`ray.train.FailureConfig`."""

    max_failures: int


@dataclass(frozen=True)
class CheckpointPlan:
    """`ray.train.CheckpointConfig`."""

    num_to_keep: int


@dataclass(frozen=True)
class RunPlan:
    """`ray.train.RunConfig` (its failure and checkpoint configs are siblings in `RayTrainPlan`)."""

    name: str
    storage_path: str | None


@dataclass(frozen=True)
class RayTrainPlan:
    """Everything the Ray backend passes to `TorchTrainer`, besides the spec itself."""

    scaling: ScalingPlan
    run: RunPlan
    failure: FailurePlan
    checkpoint: CheckpointPlan

    def render(self) -> str:
        """What `torchrig render --target raytrain` prints: the plan as YAML."""
        return str(yaml.safe_dump(self.to_dict(), sort_keys=False, width=120))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["scaling"]["num_workers"] = self.scaling.kwargs()["num_workers"]
        if isinstance(out["scaling"]["num_workers"], tuple):
            out["scaling"]["num_workers"] = list(out["scaling"]["num_workers"])
        return out


def _storage_path(spec: JobSpec) -> str | None:
    """Ray Train's storage must be reachable from every node: the first remote or absolute store."""
    for store in spec.spec.checkpoint.stores:
        if not store.kind.filesystem:
            return store.uri
        if store.path.startswith("/"):
            return store.path
    return None  # Ray's default (~/ray_results); torchrig's own stores still hold the checkpoints


def compile_raytrain(spec: JobSpec, *, fixed_size: bool = False) -> RayTrainPlan:
    """The Ray Train plan of this job."""
    s = spec.spec
    procs = s.procs_per_node
    max_workers = s.max_world_size
    min_workers = max_workers if fixed_size else s.min_world_size
    # A node's CPUs are shared by its ranks; keep at least one CPU per rank so placement succeeds.
    cpus = float(parse_quantity(s.resources.cpu)) / procs
    resources: dict[str, float] = {"CPU": max(1.0, float(int(cpus)))}
    if s.resources.gpus > 0:
        resources["GPU"] = 1.0
    return RayTrainPlan(
        scaling=ScalingPlan(
            num_workers=max_workers,
            min_workers=min_workers,
            max_workers=max_workers,
            use_gpu=s.resources.gpus > 0,
            resources_per_worker=resources,
        ),
        run=RunPlan(name=spec.name, storage_path=_storage_path(spec)),
        failure=FailurePlan(max_failures=s.restarts.max),
        checkpoint=CheckpointPlan(num_to_keep=s.checkpoint.keep),
    )
