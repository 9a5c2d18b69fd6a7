"""torchrig's control plane: the job model, compilers, backends, drills and the CLI."""

__version__ = "0.1.0"
