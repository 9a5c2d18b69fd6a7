"""Shared test setup. Fixtures live in tests/fixtures/, one module per thing they start."""

from __future__ import annotations

import os

# Ray: no usage stats, and no ~/.ray/auth_token from a stray `ray.init()` (torchrig's embedded Ray turns
# token authentication on with a token of its own whatever this says); torchrun: no shared rendezvous
# store (hangs on restart).
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")

pytest_plugins = [
    "tests.fixtures.common",
    "tests.fixtures.s3",
    "tests.fixtures.prometheus",
    "tests.fixtures.ray",
    "tests.fixtures.k8s_fake",
]
