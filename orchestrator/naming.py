"""Names the operators derive from a job name, so the spec can reject names that would overflow.

Kubernetes object names used as pod hostnames and label values must stay within 63 characters
(DNS-1123/1035 labels). Each target's operator builds pod names from the job name; the worst case
of every target is listed here and checked by the job model, and tests check the compilers against it.
"""

from __future__ import annotations

import re

DNS1035_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME_LEN = 63
RANDOM_SUFFIX = "x" * 5  # operators append 5 random characters where they need unique names

RAY_WORKER_GROUP = "worker"
TRAINJOB_REPLICATED_JOB = "node"


def pod_names(name: str, max_nodes: int) -> dict[str, list[str]]:
    """The longest pod names each target's operator derives from `name` (random parts as x's)."""
    last = max(max_nodes - 1, 0)
    return {
        # training-operator v1: <job>-master-0 and <job>-worker-<i>
        "pytorchjob": [f"{name}-master-0", f"{name}-worker-{last}"],
        # Trainer v2 -> JobSet: <jobset>-<replicatedJob>-<jobIndex>-<podIndex>-<random>
        "trainjob": [f"{name}-{TRAINJOB_REPLICATED_JOB}-0-{last}-{RANDOM_SUFFIX}"],
        # KubeRay: cluster <rayjob>-<random>; pods <cluster>-head-<random>, <cluster>-<group>-worker-<random>
        "rayjob": [
            f"{name}-{RANDOM_SUFFIX}-head-{RANDOM_SUFFIX}",
            f"{name}-{RANDOM_SUFFIX}-{RAY_WORKER_GROUP}-worker-{RANDOM_SUFFIX}",
        ],
    }


def max_name_length(max_nodes: int) -> int:
    """The longest job name for which every derived pod name fits in 63 characters."""
    overhead = max(len(p) for names in pod_names("", max_nodes).values() for p in names)
    return MAX_NAME_LEN - overhead
