"""Job-name rules: the job model's, and each Kubernetes target's as its operator enforces it.

The job model (`metadata.name`) asks only for a DNS-1035 label of at most 63 characters: the local and
Ray-on-VM backends and the launch plans (`torchrun`, `raytrain`) take any such name. Each Kubernetes
target's operator derives further names from the job name and rejects (or fails to create) objects
whose derived names do not fit; the `*_name_rule` functions give that limit (each `Target` in
`orchestrator.targets` names its own, `targets.target_name_rule`) and `compile()` enforces it when
rendering or submitting to that target, nowhere else. Each rule below cites the operator source it
follows (read at the versions torchrig targets, see docs/operations.md and tests/schemas/crds/SOURCES.md).

KubeRay (ray-project/kuberay, tag v1.7.0 = 59d663aeec13760646da3db9c1cf8cfe883e30b7; same on master
feeaf72facab4881ba2b179248bb67315634e229; the constants exist since v1.4.0):
- `ray-operator/controllers/ray/utils/constant.go`: `MaxRayClusterNameLength = 53` (63 - len("-serve-svc"))
  and `MaxRayJobNameLength = MaxRayClusterNameLength - 6`, i.e. 47, "since we append 6 characters to the
  RayJob name to create the cluster": `GenerateRayClusterName` (`utils/util.go`) is `<rayjob>-<rand 5>`.
- `utils/validation.go` `ValidateRayJobMetadata`: a RayJob name longer than `MaxRayJobNameLength` or not a
  DNS-1035 label is rejected ("RayJob name should be no more than 47 characters"), by the RayJob webhook
  (`pkg/webhooks/v1/rayjob_webhook.go`) and by the controller (`rayjob_controller.go`, InvalidRayJobMetadata).
- Pod names never overflow: `utils.PodName` cuts the prefix (`<cluster>` for the head,
  `<cluster>-<group>` for workers) to 50 characters before appending `-head-`/`-worker-` and the
  5 random characters of `generateName` (and `CheckName` likewise cuts other derived names to 50).
  So the only KubeRay rule is the RayJob name limit, whatever the worker group name or node count.

Training Operator v1 (kubeflow/trainer, formerly kubeflow/training-operator, tag v1.9.4 =
4445c12aa62e4345b0c2c6ac9b215a70eca46ed7, branch release-1.9):
- `pkg/controller.v1/common/util.go` `GenGeneralName(job, rtype, index)` = `<job>-<rtype lowercase>-<index>`
  names every replica's pod (`common/pod.go`) and its headless Service (`common/service.go`
  `CreateNewService`). Service names must be DNS-1035 labels of at most 63 characters (Kubernetes
  `ValidateServiceName`), so the longest Service name, `<job>-master-0` or `<job>-worker-<last index>`,
  must fit in 63: the Worker indices run to `nodes.max - 1` when elastic (Worker replicas only), to
  `nodes.max - 2` with a Master (fixed size), and to `nodes.max - 1 + spareNodes` with standby nodes (the
  Master is then a store-only pod and every node a Worker). "master" and "worker" have the same length.
- `pkg/webhooks/pytorch/pytorchjob_webhook.go` `validatePyTorchJob`: `NameIsDNS1035Label(metadata.name)`
  (which includes the 63-character limit); no other name-length rule.

Kubeflow Trainer v2 -> JobSet (kubeflow/trainer tag v2.3.0 = 658725bdae5c7e3a0854d93ac6ff492e109a22ab;
kubernetes-sigs/jobset tag v0.12.0 = f22e565ac3cc3265c7c45ef67ecffdc689af5d77):
- Trainer `pkg/apis/trainer/v1alpha1/trainjob_types.go`: CEL rules on TrainJob, `metadata.name` matches
  the DNS-1035 regex and `size(self.metadata.name) <= 63`; its webhook (`pkg/webhooks/trainjob_webhook.go`)
  adds no length rule. `pkg/runtime/framework/plugins/jobset/jobset.go` names the JobSet after the
  TrainJob and `SyncParallelCount` sets the replicated job's completions to `numNodes`.
- JobSet `pkg/webhooks/jobset_webhook.go` `ValidateCreate` (completion mode defaults to Indexed in
  `Default`): rejects a JobSet whose longest pod name
  `placement.GenPodName(js, rjob, maxJobIndex, maxPodIndex) + "-abcde"`, i.e.
  `<jobset>-<replicatedJob>-<replicas-1>-<completions-1>-xxxxx` (`pkg/util/placement/placement.go`),
  is not a DNS-1035 label of at most 63 ("JobSet name is too long, pod names generated for this JobSet
  will exceed 63 characters"), and likewise the child Job name `<jobset>-<replicatedJob>-<replicas-1>`.
  torchrig's runtime (and Trainer's own torch runtimes) has one replicated job `node`, replicas 1, so the
  longest pod name is `<name>-node-0-<nodes.max - 1>-xxxxx`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "DNS1035_RE",
    "DNS1123_LABEL_RE",
    "KUBERAY_MAX_RAYCLUSTER_NAME_LEN",
    "KUBERAY_MAX_RAYJOB_NAME_LEN",
    "MAX_NAME_LEN",
    "RAY_WORKER_GROUP",
    "TRAINJOB_REPLICATED_JOB",
    "NameRule",
    "pytorchjob_name_rule",
    "rayjob_name_rule",
    "trainjob_name_rule",
]

DNS1035_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME_LEN = 63  # a DNS-1035 label: the job model's only length rule
RANDOM_SUFFIX = "x" * 5  # operators append 5 random characters where they need unique names

RAY_WORKER_GROUP = "worker"
TRAINJOB_REPLICATED_JOB = "node"

# KubeRay utils/constant.go: MaxRayClusterNameLength and MaxRayJobNameLength (= 53 - 6).
KUBERAY_MAX_RAYCLUSTER_NAME_LEN = 53
KUBERAY_MAX_RAYJOB_NAME_LEN = KUBERAY_MAX_RAYCLUSTER_NAME_LEN - len("-" + RANDOM_SUFFIX)


@dataclass(frozen=True)
class NameRule:
    """One target's limit on `metadata.name` and the operator rule behind it."""

    target: str
    limit: int
    kind: str  # what the operator calls the job, e.g. "KubeRay RayJob"
    why: str  # the operator rule, with the job name as <name>
    max_nodes: int | None = None  # set where the limit depends on spec.nodes.max
    spare_nodes: int = 0  # standby Worker replicas counted in the limit (spec.restarts.spareNodes)

    def problem(self, name: str) -> str | None:
        """The one-line `metadata.name: ...` message when `name` is too long for this target, else None."""
        if len(name) <= self.limit:
            return None
        nodes = f" with spec.nodes.max={self.max_nodes}" if self.max_nodes is not None else ""
        if self.spare_nodes:
            nodes += f" and spec.restarts.spareNodes={self.spare_nodes}"
        return (
            f"metadata.name: {name!r} is {len(name)} characters; {self.kind} names (target {self.target}) "
            f"are limited to {self.limit}{nodes} ({self.why})"
        )


def _fit(*suffixes: str) -> int:
    return MAX_NAME_LEN - max(len(s) for s in suffixes)


def rayjob_name_rule(target: str, max_nodes: int, elastic: bool, spare_nodes: int) -> NameRule:
    """KubeRay's limit on a RayJob's name: the same whatever the node count (see the module docstring)."""
    return NameRule(
        target,
        KUBERAY_MAX_RAYJOB_NAME_LEN,
        "KubeRay RayJob",
        f"KubeRay rejects longer RayJob names: it names the RayCluster '<name>-{RANDOM_SUFFIX}' and limits "
        f"RayCluster names to {KUBERAY_MAX_RAYCLUSTER_NAME_LEN}",
    )


def pytorchjob_name_rule(target: str, max_nodes: int, elastic: bool, spare_nodes: int) -> NameRule:
    """The training operator's limit: its longest replica Service name must be a DNS-1035 label."""
    # Worker indices 0..max-1 when elastic (no Master); Master 0 plus Workers 0..max-2 at a fixed size, or
    # plus Workers 0..max-1+spares with standby nodes (the Master is the store-only pod).
    last = max(max_nodes - 2, 0)
    if elastic or spare_nodes:
        last = max_nodes - 1 + spare_nodes
    longest = f"-worker-{last}" if elastic or max_nodes > 1 or spare_nodes else "-master-0"
    return NameRule(
        target,
        _fit(longest, "-master-0"),
        "PyTorchJob",
        f"the training operator names a Service per replica, up to '<name>{longest}', and a Service "
        f"name is a DNS-1035 label of at most {MAX_NAME_LEN} characters",
        max_nodes,
        spare_nodes,
    )


def trainjob_name_rule(target: str, max_nodes: int, elastic: bool, spare_nodes: int) -> NameRule:
    """JobSet's limit on the longest pod name a TrainJob's JobSet generates."""
    pod = f"-{TRAINJOB_REPLICATED_JOB}-0-{max_nodes - 1}-{RANDOM_SUFFIX}"
    return NameRule(
        target,
        _fit(pod),
        "TrainJob",
        f"JobSet rejects pod names over {MAX_NAME_LEN} characters and names the pods up to '<name>{pod}'",
        max_nodes,
    )
