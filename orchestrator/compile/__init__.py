"""Compilers: pure functions from a `JobSpec` to what a target gets.

Manifest targets (`pytorchjob`, `trainjob`, `rayjob`) compile to a list of Kubernetes objects (plain
dicts, in apply order); launch-plan targets compile to typed plans (`torchrun` -> `TorchrunCommand`,
`raytrain` -> `RayTrainPlan`). A target that cannot express part of a spec, or would run it unsafely
(`orchestrator.compile.checks`), raises `UnsupportedFeature` naming the field and the alternative, before
anything is rendered.

    >>> from orchestrator.compile import compile
    >>> objs = compile(spec, "pytorchjob", monitoring=True)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Literal, overload

import yaml

from orchestrator.compile.checks import check_name, check_target
from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec

if TYPE_CHECKING:
    from orchestrator.compile.raytrain import RayTrainPlan
    from orchestrator.compile.torchrun import TorchrunCommand

__all__ = [
    "MANIFEST_TARGETS",
    "PLAN_TARGETS",
    "TARGETS",
    "check_name",
    "check_target",
    "compile",
    "compile_plan",
    "render",
]

# name -> "module:function"; imported lazily so one target's dependencies never burden another.
MANIFEST_TARGETS: dict[str, str] = {
    "pytorchjob": "orchestrator.compile.pytorchjob:compile_pytorchjob",
    "trainjob": "orchestrator.compile.trainjob:compile_trainjob",
    "rayjob": "orchestrator.compile.rayjob:compile_rayjob",
}
PLAN_TARGETS: dict[str, str] = {
    "torchrun": "orchestrator.compile.torchrun:compile_torchrun",
    "raytrain": "orchestrator.compile.raytrain:compile_raytrain",
}
TARGETS: tuple[str, ...] = (*MANIFEST_TARGETS, *PLAN_TARGETS)


def _load(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _unknown(target: str, valid: list[str]) -> SpecError:
    return SpecError(f"--target: unknown target {target!r}; valid targets: {', '.join(valid)}")


def compile(
    spec: JobSpec,
    target: str,
    *,
    monitoring: bool = False,
    fixed_size: bool = False,
    allow_pod_local_stores: bool = False,
) -> list[dict[str, Any]]:
    """Compile a spec to the Kubernetes objects of a manifest target.

    Args:
        spec: the validated job.
        target: `pytorchjob`, `trainjob` or `rayjob`.
        monitoring: also emit a PodMonitor and a PrometheusRule (prometheus-operator). The job's
            NetworkPolicy (`orchestrator.compile.networkpolicy`) comes unless `kubernetes.networkPolicy`
            is false.
        fixed_size: run an elastic spec at `nodes.max` nodes on a fixed-size shape.
        allow_pod_local_stores: compile a multi-node job whose checkpoint stores are all pod-local
            (`check_target` returns the warning to print).

    Returns:
        Plain dicts, in the order `kubectl apply` should create them.

    Raises:
        SpecError: unknown target (the message lists the valid ones).
        UnsupportedFeature: the target cannot express part of the spec, its operator would reject
            `metadata.name`, or `check_target` refuses it (pod-local stores, inline credentials,
            a RayJob `rayVersion` older than Ray's token authentication).
    """
    if target not in MANIFEST_TARGETS:
        if target in PLAN_TARGETS:
            raise SpecError(f"--target: {target!r} is a launch plan, not manifests; use compile_plan()")
        raise _unknown(target, list(MANIFEST_TARGETS))
    check_target(spec, target, fixed_size=fixed_size, allow_pod_local_stores=allow_pod_local_stores)
    objects: list[dict[str, Any]] = _load(MANIFEST_TARGETS[target])(spec, fixed_size=fixed_size)
    from orchestrator.compile.networkpolicy import compile_network_policy

    # Right after the spec ConfigMap: the policy is in force before the first pod starts.
    objects[1:1] = compile_network_policy(spec, target)
    if monitoring:
        from orchestrator.compile.monitoring import compile_monitoring

        objects.extend(compile_monitoring(spec))
    return objects


@overload
def compile_plan(spec: JobSpec, target: Literal["torchrun"], *, fixed_size: bool = ...) -> TorchrunCommand: ...
@overload
def compile_plan(spec: JobSpec, target: Literal["raytrain"], *, fixed_size: bool = ...) -> RayTrainPlan: ...
@overload
def compile_plan(spec: JobSpec, target: str, *, fixed_size: bool = ...) -> TorchrunCommand | RayTrainPlan: ...
def compile_plan(spec: JobSpec, target: str, *, fixed_size: bool = False) -> TorchrunCommand | RayTrainPlan:
    """Compile a spec to a launch plan: `torchrun` -> `TorchrunCommand`, `raytrain` -> `RayTrainPlan`.

    Raises:
        SpecError: unknown target.
    """
    if target not in PLAN_TARGETS:
        raise _unknown(target, list(PLAN_TARGETS))
    plan: TorchrunCommand | RayTrainPlan = _load(PLAN_TARGETS[target])(spec, fixed_size=fixed_size)
    return plan


def render(
    spec: JobSpec,
    target: str,
    *,
    monitoring: bool = False,
    fixed_size: bool = False,
    allow_pod_local_stores: bool = False,
) -> str:
    """What `torchrig render` prints: multi-document YAML, or the torchrun script, or the Ray plan."""
    if target in MANIFEST_TARGETS:
        objs = compile(
            spec, target, monitoring=monitoring, fixed_size=fixed_size, allow_pod_local_stores=allow_pod_local_stores
        )
        return yaml.safe_dump_all(objs, sort_keys=False, width=120)
    if target == "torchrun":
        return compile_plan(spec, "torchrun", fixed_size=fixed_size).script
    if target == "raytrain":
        plan = compile_plan(spec, "raytrain", fixed_size=fixed_size)
        return yaml.safe_dump(plan.to_dict(), sort_keys=False, width=120)
    raise _unknown(target, list(TARGETS))
