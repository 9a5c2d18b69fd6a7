"""NetworkPolicy evaluation as the Kubernetes API defines it, for ingress: may a source pod reach a port?

A model, not a CNI: it follows the field semantics documented on the API types (k8s.io/api
`networking/v1/types.go`: NetworkPolicySpec, NetworkPolicyIngressRule, NetworkPolicyPeer,
NetworkPolicyPort; `meta/v1/types.go` LabelSelector), which every enforcing CNI implements:

- a policy applies to the pods of its own namespace that its `podSelector` selects (an empty selector
  selects them all); `policyTypes` defaults to `[Ingress]` (plus `Egress` when egress rules exist);
- a pod that no policy with `Ingress` selects admits everything; a pod that one selects admits a
  connection only when some ingress rule of some policy selecting it allows it (policies add up);
- a rule allows a connection when its `from` is empty or one peer matches the source, and its `ports`
  is empty or one port matches: same protocol (default TCP) and `port` absent (every port), equal, a
  named port of the destination's container, or within `port`..`endPort`;
- a peer with only `podSelector` matches pods of the policy's namespace; with only `namespaceSelector`
  every pod of the matching namespaces; with both, the matching pods of the matching namespaces;
  `ipBlock` peers are not modelled (torchrig renders none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Endpoint", "admits", "peer_matches", "policy_types", "selects"]


@dataclass(frozen=True)
class Endpoint:
    """A pod as a NetworkPolicy sees it: labels, namespace, its namespace's labels, its named ports."""

    labels: dict[str, str]
    namespace: str = "default"
    namespace_labels: dict[str, str] = field(default_factory=dict)
    named_ports: dict[str, int] = field(default_factory=dict)


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (`matchLabels` and `matchExpressions`, ANDed); empty selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown selector operator {op!r}")
    return True


def policy_types(spec: dict[str, Any]) -> list[str]:
    if spec.get("policyTypes"):
        return list(spec["policyTypes"])
    return ["Ingress", *(["Egress"] if spec.get("egress") else [])]


def peer_matches(peer: dict[str, Any], policy_ns: str, src: Endpoint) -> bool:
    if "ipBlock" in peer:
        raise NotImplementedError("ipBlock peers are not modelled")
    pods, namespaces = peer.get("podSelector"), peer.get("namespaceSelector")
    in_namespace = src.namespace == policy_ns if namespaces is None else selects(namespaces, src.namespace_labels)
    return in_namespace and (pods is None or selects(pods, src.labels))


def _port_matches(rule_port: dict[str, Any], dst: Endpoint, port: int, protocol: str) -> bool:
    if rule_port.get("protocol", "TCP") != protocol:
        return False
    want = rule_port.get("port")
    if want is None:
        return True
    if isinstance(want, str):
        return dst.named_ports.get(want) == port
    end = rule_port.get("endPort")
    return int(want) == port if end is None else int(want) <= port <= int(end)


def admits(policies: list[dict[str, Any]], dst: Endpoint, src: Endpoint, port: int, protocol: str = "TCP") -> bool:
    """Whether `dst` admits a connection from `src` to `port` under `policies` (NetworkPolicy objects)."""
    applying = [
        p
        for p in policies
        if p["metadata"].get("namespace", "default") == dst.namespace
        and "Ingress" in policy_types(p["spec"])
        and selects(p["spec"].get("podSelector"), dst.labels)
    ]
    if not applying:
        return True
    for policy in applying:
        ns = policy["metadata"].get("namespace", "default")
        for rule in policy["spec"].get("ingress") or []:
            peers, ports = rule.get("from") or [], rule.get("ports") or []
            if peers and not any(peer_matches(peer, ns, src) for peer in peers):
                continue
            if ports and not any(_port_matches(p, dst, port, protocol) for p in ports):
                continue
            return True
    return False
