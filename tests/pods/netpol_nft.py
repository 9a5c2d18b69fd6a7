"""The job's NetworkPolicy enforced by the kernel in the pods harness: nftables in each pod's namespace.

A CNI that enforces NetworkPolicies (Calico, Cilium, ...) turns each policy's peers into the addresses of
the pods they select and filters a selected pod's incoming connections; `enforce` does the same for a
`PodCluster` (runtime.py): for every pod that some policy with `Ingress` selects (netpol.py decides which
and what), an `inet` table in the pod's network namespace drops new connections that no rule admits,
with the rule's sources resolved to the cluster's pod addresses. Loopback and replies to the pod's own
connections pass, as they do under any CNI. Needs `nft` (Debian package nftables) and root.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from tests.pods.netpol import Endpoint, peer_matches, policy_types, selects
from tests.pods.runtime import PodCluster, PodState

__all__ = ["endpoint", "enforce", "nft_reason", "ruleset"]

TABLE = "torchrig_netpol"


def nft_reason() -> str | None:
    """None when nftables can be used here, else why not (for a skip)."""
    return None if shutil.which("nft") else "nftables: `nft` is not installed (apt-get install nftables)"


def endpoint(state: PodState, namespace_labels: dict[str, dict[str, str]]) -> Endpoint:
    pod = state.pod
    ports = {p["name"]: int(p["containerPort"]) for p in pod.container.get("ports", []) if "name" in p}
    return Endpoint(dict(pod.labels), pod.namespace, namespace_labels.get(pod.namespace, {}), ports)


def _port_match(rule_port: dict[str, Any], dst: Endpoint) -> str | None:
    """The nft match of one NetworkPolicyPort, or None when it names a port the pod does not have."""
    proto = str(rule_port.get("protocol", "TCP")).lower()
    want = rule_port.get("port")
    if want is None:
        return f"meta l4proto {proto}"
    if isinstance(want, str):
        number = dst.named_ports.get(want)
        return None if number is None else f"{proto} dport {number}"
    end = rule_port.get("endPort")
    return f"{proto} dport {int(want)}" + (f"-{int(end)}" if end is not None else "")


def ruleset(policies: list[dict[str, Any]], dst: Endpoint, peers: list[tuple[Endpoint, str]]) -> str | None:
    """The nft ruleset for `dst` (None: no policy selects it, everything is admitted); `peers` are the
    (endpoint, address) pairs a rule's selectors resolve to."""
    applying = [
        p
        for p in policies
        if p["metadata"].get("namespace", "default") == dst.namespace
        and "Ingress" in policy_types(p["spec"])
        and selects(p["spec"].get("podSelector"), dst.labels)
    ]
    if not applying:
        return None
    lines = ['iif "lo" accept', "ct state established,related accept"]
    for policy in applying:
        ns = policy["metadata"].get("namespace", "default")
        for rule in policy["spec"].get("ingress") or []:
            source = ""
            if rule.get("from"):
                addrs = sorted({ip for ep, ip in peers if any(peer_matches(peer, ns, ep) for peer in rule["from"])})
                if not addrs:
                    continue
                source = f"ip saddr {{ {', '.join(addrs)} }} "
            matches = [_port_match(p, dst) for p in rule.get("ports") or []] or [""]
            lines += [f"{source}{m} accept".strip() for m in matches if m is not None]
    head = ["type filter hook input priority 0; policy drop;", *lines]
    body = "\n".join(f"    {line}" for line in head)
    return f"table inet {TABLE} {{\n  chain input {{\n{body}\n  }}\n}}\n"


def enforce(
    cluster: PodCluster, policies: list[dict[str, Any]], namespace_labels: dict[str, dict[str, str]] | None = None
) -> dict[str, str | None]:
    """Load each pod's ruleset into its network namespace; returns pod name -> ruleset (None: none)."""
    labels = namespace_labels or {}
    peers = [(endpoint(s, labels), s.ip) for s in cluster.pods.values()]
    out: dict[str, str | None] = {}
    for name, state in cluster.pods.items():
        rules = ruleset(policies, endpoint(state, labels), peers)
        out[name] = rules
        if rules is not None:
            subprocess.run(
                ["ip", "netns", "exec", state.netns, "nft", "-f", "-"],
                input=rules,
                text=True,
                check=True,
                capture_output=True,
                timeout=20,
            )
    return out
