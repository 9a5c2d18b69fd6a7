"""torchrig's in-container runtime: the DDP/FSDP worker, resumable data, checkpoints and metrics.

Importable without the orchestrator, kubernetes or ray. Heavy modules (torch) load lazily.
"""

__version__ = "0.1.0"
