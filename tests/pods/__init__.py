"""The pods harness: rendered Kubernetes manifests' pods run as processes in namespaces (see
docs/operations.md, "What the pods harness proves"). operators.py holds the operators' contracts,
kubelet.py what Kubernetes adds, runtime.py/podinit.py the pods as processes, jobs.py the supervision."""
