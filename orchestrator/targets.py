"""The compile targets, each declared once: what it is, what it can express, its name rule and its compiler.

Everything that asks "what does target X do" reads its `Target` here instead of comparing the name:
the job model's `spec.kubernetes.target` (`SubmitTarget`), the compiler registry
(`orchestrator.compile`), the rules a Kubernetes target refuses (`orchestrator.compile.checks`), the
name rules (`target_name_rule`), the kubernetes backend's kinds (`TARGET_KINDS`) and the CLI's list.
A target's compiler and checks are `"module:function"` references imported when used, so one
target's dependencies never burden another and this module imports no compiler (the job model
imports it). Anchor: torchx `torchx/schedulers/__init__.py`, one name -> factory registry.

Adding a target: one `Target` below (and, if `torchrig submit` can create it, its name in
`SubmitTarget`); `tests/unit/test_targets.py` fails where a target name is spelled elsewhere.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from orchestrator.errors import SpecError
from orchestrator.naming import (
    MAX_NAME_LEN,
    NameRule,
    pytorchjob_name_rule,
    rayjob_name_rule,
    trainjob_name_rule,
)

__all__ = [
    "DEFAULT_TARGET",
    "KUBERNETES_TARGETS",
    "MANIFEST_TARGETS",
    "PLAN_TARGETS",
    "SUBMIT_TARGETS",
    "TARGETS",
    "TARGET_KINDS",
    "SubmitTarget",
    "Target",
    "get_target",
    "target_name_limit",
    "target_name_rule",
]

# What `spec.kubernetes.target` may name: a Literal so the JSON Schema, the docs and mypy see the
# choices. It must list exactly the targets with `submit=True` below (checked at import).
SubmitTarget = Literal["pytorchjob", "trainjob"]
DEFAULT_TARGET: SubmitTarget = "pytorchjob"  # of `spec.kubernetes.target` and `torchrig render --target`

# (target name, max_nodes, elastic, spare_nodes) -> the operator's rule on `metadata.name`
NameRuleFn = Callable[[str, int, bool, int], NameRule]


@dataclass(frozen=True)
class Target:
    """One compile target.

    Attributes:
        name: what `--target` and `spec.kubernetes.target` call it.
        summary: one line for the CLI's list of targets.
        compiler: `"module:function"`, called as `function(spec, *, fixed_size)`: a list of Kubernetes
            objects for a manifest target (`kind` set), else a launch plan.
        kind: the Kubernetes kind of the job object; None for a launch plan.
        api_version: the job object's `apiVersion`; None for a launch plan.
        submit: `torchrig submit` creates it on Kubernetes (`spec.kubernetes.target` may name it).
        elastic: renders `nodes.min < nodes.max` as an elastic job; otherwise it needs `--fixed-size`.
        standby_nodes: runs `restarts.spareNodes` as standby pods (fixed size only).
        name_rule: its operator's limit on `metadata.name`; None: the job model's rule is all.
        unsupported: `"module:function"` raising UnsupportedFeature for what the target cannot express,
            called as `function(spec, *, fixed_size)` right after the name rule.
        check: `"module:function"` returning warnings and raising UnsupportedFeature for what the target
            would run unsafely, called as `function(spec, *, fixed_size)` after the rules every
            Kubernetes target shares.
        ray_cluster: it describes a remote Ray cluster (Ray's cluster launcher, `ray up`): `--cloud` picks
            the cloud (`spec.ray.cluster.cloud`) and the remote-Ray store rules apply
            (`checks.remote_ray_stores_problem`), as for a job submitted to one.
    """

    name: str
    summary: str
    compiler: str
    kind: str | None = None
    api_version: str | None = None
    submit: bool = False
    elastic: bool = True
    standby_nodes: bool = False
    name_rule: NameRuleFn | None = None
    unsupported: str | None = None
    check: str | None = None
    ray_cluster: bool = False

    @property
    def manifests(self) -> bool:
        """It compiles to Kubernetes objects (else to a launch plan)."""
        return self.kind is not None

    def load(self, ref: str | None = None) -> Any:
        """The function `ref` names (default: the compiler), imported now."""
        module, _, attr = (ref or self.compiler).partition(":")
        return getattr(importlib.import_module(module), attr)


_REGISTRY: tuple[Target, ...] = (
    Target(
        "pytorchjob",
        "Kubeflow Training Operator v1 PyTorchJob (elastic when nodes.min < nodes.max)",
        "orchestrator.compile.pytorchjob:compile_pytorchjob",
        kind="PyTorchJob",
        api_version="kubeflow.org/v1",
        submit=True,
        standby_nodes=True,
        name_rule=pytorchjob_name_rule,
        check="orchestrator.compile.pytorchjob:check_pytorchjob",
    ),
    Target(
        "trainjob",
        "Kubeflow Trainer v2 TrainJob + its TrainingRuntime (fixed size; Trainer >= 2.2)",
        "orchestrator.compile.trainjob:compile_trainjob",
        kind="TrainJob",
        api_version="trainer.kubeflow.org/v1alpha1",
        submit=True,
        elastic=False,
        name_rule=trainjob_name_rule,
        unsupported="orchestrator.compile.trainjob:check_trainjob",
    ),
    Target(
        "rayjob",
        "KubeRay RayJob running the job with Ray Train",
        "orchestrator.compile.rayjob:compile_rayjob",
        kind="RayJob",
        api_version="ray.io/v1",
        name_rule=rayjob_name_rule,
        check="orchestrator.compile.checks:check_rayjob",
    ),
    Target(
        "torchrun",
        "the torchrun command line for bare metal or Slurm (one per node)",
        "orchestrator.compile.torchrun:compile_torchrun",
    ),
    Target(
        "raytrain",
        "the Ray Train plan (ScalingConfig, RunConfig, FailureConfig, CheckpointConfig)",
        "orchestrator.compile.raytrain:compile_raytrain",
    ),
    Target(
        "raycluster",
        "a Ray cluster-launcher file (`ray up`) for aws or gcp (--cloud), sized from the job",
        "orchestrator.compile.raycluster:compile_raycluster",
        ray_cluster=True,
    ),
)

TARGETS: dict[str, Target] = {t.name: t for t in _REGISTRY}
MANIFEST_TARGETS: tuple[str, ...] = tuple(t.name for t in _REGISTRY if t.manifests)
PLAN_TARGETS: tuple[str, ...] = tuple(t.name for t in _REGISTRY if not t.manifests)
KUBERNETES_TARGETS = MANIFEST_TARGETS  # the targets the Kubernetes-only rules (compile.checks) apply to
SUBMIT_TARGETS: tuple[str, ...] = tuple(t.name for t in _REGISTRY if t.submit)
# target -> kind of the job object, for the targets the kubernetes backend submits and watches
TARGET_KINDS: dict[str, str] = {t.name: t.kind for t in _REGISTRY if t.submit and t.kind}

if set(get_args(SubmitTarget)) != set(SUBMIT_TARGETS):  # pragma: no cover - a registry edit, caught at import
    raise RuntimeError(f"SubmitTarget {get_args(SubmitTarget)} must name the submit targets {SUBMIT_TARGETS}")


def get_target(name: str, *, among: tuple[str, ...] | None = None, field: str = "--target") -> Target:
    """The target called `name`.

    Args:
        name: a target name.
        among: the names acceptable here (default: every target), listed when `name` is not one of them.
        field: what the message names as the bad input.

    Raises:
        SpecError: `name` is unknown (or not among `among`); the message lists the valid ones.
    """
    valid = among if among is not None else tuple(TARGETS)
    if name not in valid:
        raise SpecError(f"{field}: unknown target {name!r}; valid targets: {', '.join(valid)}")
    return TARGETS[name]


def target_name_rule(target: str, max_nodes: int, *, elastic: bool = False, spare_nodes: int = 0) -> NameRule | None:
    """The name rule of a target's operator, or None for a target without one (or an unknown name).

    Args:
        target: a target name (launch plans have none: the job model's rule is all).
        max_nodes: `spec.nodes.max`.
        elastic: the job is rendered elastic (`nodes.min < nodes.max` and not `--fixed-size`).
        spare_nodes: standby Worker replicas past the members (`RestartsConfig.standby_nodes`, on a
            target with `standby_nodes`).
    """
    t = TARGETS.get(target)
    if t is None or t.name_rule is None:
        return None
    return t.name_rule(t.name, max_nodes, elastic, spare_nodes)


def target_name_limit(target: str, max_nodes: int, *, elastic: bool = False) -> int:
    """The longest `metadata.name` the target's operator accepts (63 for targets without a rule)."""
    rule = target_name_rule(target, max_nodes, elastic=elastic)
    return MAX_NAME_LEN if rule is None else rule.limit
