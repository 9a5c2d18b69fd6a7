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

from typing import TYPE_CHECKING, Any, Literal, overload

import yaml

from orchestrator.compile.checks import check_name, check_target
from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec
from orchestrator.targets import MANIFEST_TARGETS, PLAN_TARGETS, TARGETS, get_target

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
    if target in PLAN_TARGETS:
        raise SpecError(f"--target: {target!r} is a launch plan, not manifests; use compile_plan()")
    t = get_target(target, among=MANIFEST_TARGETS)
    check_target(spec, target, fixed_size=fixed_size, allow_pod_local_stores=allow_pod_local_stores)
    objects: list[dict[str, Any]] = t.load()(spec, fixed_size=fixed_size)
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
    plan: TorchrunCommand | RayTrainPlan = get_target(target, among=PLAN_TARGETS).load()(spec, fixed_size=fixed_size)
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
    get_target(target)  # an unknown name fails listing every target, not only the plans
    return compile_plan(spec, target, fixed_size=fixed_size).render()
