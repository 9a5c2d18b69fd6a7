"""Shared test setup. Fixtures live in tests/fixtures/, one module per thing they start."""

from __future__ import annotations

import os

import pytest

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

# Modules outside tests/unit whose tests mostly wait (in-process HTTP fakes, helm/promtool/hadolint
# subprocesses, CLI errors that come before any process starts, API timeouts with seconds of slack):
# scripts/run-tests.sh runs them on 2 workers. Every other test outside tests/unit is marked `serial`
# and runs one at a time: it trains with several processes, kills them, or asserts on timing that a busy
# neighbour on a 2-core machine would turn into a flake. A module not listed is serial (the safe side);
# a test of a listed module that needs the cores to itself says `@pytest.mark.serial` itself.
PARALLEL_MODULES = frozenset(
    {
        "tests/integration/test_api_timeouts.py",
        "tests/integration/test_checkpoint_collectives.py",
        "tests/integration/test_checkpoint_unknown_store.py",
        "tests/integration/test_cli_spec.py",
        "tests/integration/test_digits_data.py",
        "tests/integration/test_drill_kubernetes.py",
        "tests/integration/test_hadolint.py",
        "tests/integration/test_healthcheck.py",
        "tests/integration/test_helm.py",
        "tests/integration/test_helm_credentials.py",
        "tests/integration/test_helm_policies.py",
        "tests/integration/test_images.py",
        "tests/integration/test_inplace_replica.py",
        "tests/integration/test_kubernetes_backend.py",
        "tests/integration/test_local_rundir.py",
        "tests/integration/test_orders.py",
        "tests/integration/test_prometheus_exporter.py",
        "tests/integration/test_promtool.py",
        "tests/integration/test_run_tests_script.py",
        "tests/integration/test_standby_exporters.py",
        "tests/integration/test_trainer_status.py",
        "tests/pods/test_contracts.py",
        "tests/pods/test_netpol.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if not module.startswith("tests/unit/") and module not in PARALLEL_MODULES:
            item.add_marker(pytest.mark.serial)
