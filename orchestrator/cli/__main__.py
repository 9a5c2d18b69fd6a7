"""`python -m orchestrator.cli`: the same as the `torchrig` console script."""

from orchestrator.cli import main

main()
