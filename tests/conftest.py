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
# scripts/run-tests.sh runs them on 2 workers, first. Every other test outside tests/unit is marked
# `serial`: it trains with several processes or kills them; those run after, on 2 workers, a module to
# each, except the `alone` ones below (timing), one at a time. A module not listed is serial (the safe
# side); a test of a listed module that trains says `@pytest.mark.serial` itself.
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


# Tests of `serial` modules that run one at a time after the rest (`alone`): what they assert is a deadline
# or a race against the clock (a hang found within seconds, a straggler named, a standby taking a node's
# ranks before its replacement comes back, a checkpoint within a preemption grace), which a neighbour
# training on the second core of a 2-core machine turns into a flake. The rest of the `serial` tests run
# on 2 workers, a module to each. A node id prefix: a whole module, or one test (all its parameters).
ALONE = (
    "tests/containers/test_image.py::test_a_drained_pod_checkpoints_within_its_grace",
    "tests/containers/test_pods_in_containers.py::test_a_standby_pod_takes_the_ranks_of_a_killed_pod_in_place",
    "tests/containers/test_pods_in_containers.py::test_drained_pytorchjob_checkpoints_within_its_grace",
    "tests/integration/test_drills.py::test_hang_is_detected_by_the_watchdog",
    "tests/integration/test_drills.py::test_kill_node_with_a_standby_node_keeps_the_world_size",
    "tests/integration/test_drills.py::test_preempt_",
    "tests/integration/test_drills.py::test_straggler_is_named",
    "tests/integration/test_hang_deadline.py",
    "tests/integration/test_inplace.py",
    "tests/integration/test_local_backend.py::test_first_ctrl_c_saves_and_stops_preempted",
    "tests/integration/test_ray_drills.py::test_hang_on_ray_is_taken_back_in_place",
    "tests/integration/test_ray_drills.py::test_preempt_on_ray_checkpoints_at_once",
    "tests/integration/test_ray_multinode.py::test_a_drained_worker_host_checkpoints_at_once",
    "tests/integration/test_sdc_drill_standby.py",
    "tests/integration/test_straggler_hang.py",
    "tests/pods/test_pods.py::test_a_standby_pod_takes_a_lost_nodes_ranks_in_place",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if not module.startswith("tests/unit/") and module not in PARALLEL_MODULES:
            item.add_marker(pytest.mark.serial)
            if item.nodeid.startswith(ALONE):
                item.add_marker(pytest.mark.alone)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name the threads still running as the session ends: a daemon thread left inside a torch or Ray call
    (a store's `wait`, a Ray listener) can abort the interpreter as it exits (SIGABRT, exit 134, after every
    test passed); its name says which fixture or backend left it."""
    import threading

    left = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if left:
        names = ", ".join(sorted(f"{t.name}{' (daemon)' if t.daemon else ''}" for t in left))
        terminalreporter.write_line(f"threads still running at the end of the session: {names}")
