"""`make bench`: torchrig against its peers, side by side in one run (see docs/performance.md)."""
