"""scripts/run-tests.sh, the suite as CI runs it: a group of the suite (unit; integration that waits, on 2
workers; integration `serial`, on 2 workers; integration `alone`, one at a time) that collects no test
(pytest's exit 5: a bad `-k`, a broken conftest, a moved folder, a lost marker) fails the run even when the
others passed, and any other failure keeps its exit code. Run against stand-ins for ruff, mypy and pytest,
so that the script's own decisions are what is tested."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.common import REPO

# Which group an invocation is: the unit folder, or the integration groups' `-m`.
PYTEST = """#!/usr/bin/env bash
group=light
for a in "$@"; do
  [ "$a" = tests/unit ] && group=unit
  [ "$a" = "not soak and serial and not alone" ] && group=paired
  [ "$a" = "not soak and alone" ] && group=alone
done
seconds=(unit:1.01 light:1.02 alone:1.03 paired:1.04)
for pair in "${seconds[@]}"; do
  [ "${pair%:*}" = "$group" ] && echo "${pair#*:}s call     tests/fake.py::test_$group"
done
case $group in
  unit) exit "$UNIT_RC";; paired) exit "$PAIRED_RC";; alone) exit "$ALONE_RC";; *) exit "$LIGHT_RC";;
esac
"""


def _run(tmp_path: Path, unit: int, light: int, paired: int, alone: int = 0) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, body in (("ruff", "#!/bin/sh\nexit 0\n"), ("mypy", "#!/bin/sh\nexit 0\n"), ("pytest", PYTEST)):
        tool = bin_dir / name
        tool.write_text(body)
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "run-tests.sh"), str(tmp_path / "venv")],
        check=False,
        cwd=REPO,
        env={
            **os.environ,
            "UNIT_RC": str(unit),
            "LIGHT_RC": str(light),
            "PAIRED_RC": str(paired),
            "ALONE_RC": str(alone),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("unit", "light", "paired", "alone", "code", "says"),
    [
        (0, 0, 0, 0, 0, ""),
        (5, 0, 0, 0, 1, "collected no unit tests"),
        (0, 5, 5, 0, 1, "collected no integration tests"),
        (0, 5, 0, 0, 1, "collected no integration tests on 2 workers"),
        (0, 0, 5, 0, 1, "collected no integration tests that train"),
        (0, 0, 0, 5, 1, "collected no integration tests one at a time"),
        (5, 5, 5, 5, 1, "collected no unit tests"),
        (1, 0, 0, 0, 1, ""),
        (0, 2, 0, 0, 2, ""),
        (0, 0, 3, 0, 3, ""),
        (0, 0, 0, 134, 134, ""),
        (0, 1, 0, 134, 1, ""),
    ],
)
def test_a_group_that_collects_nothing_fails_the_run(
    tmp_path: Path, unit: int, light: int, paired: int, alone: int, code: int, says: str
) -> None:
    done = _run(tmp_path, unit, light, paired, alone)
    assert done.returncode == code, done.stderr
    assert says in done.stderr
    assert "== durations: unit " in done.stdout


def test_the_end_says_what_each_groups_exit_code_means(tmp_path: Path) -> None:
    """CI shows the end of the log: a group that crashed is named there, with its signal."""
    out = _run(tmp_path, 0, 1, 0, 134).stdout
    groups = out[out.index("== groups") :].splitlines()[1:]
    assert groups == [
        "   unit tests: passed",
        "   integration tests on 2 workers: tests failed (FAILED lines above)",
        "   integration tests that train: passed",
        "   integration tests one at a time: the pytest process was killed by SIGABRT"
        " (exit 134; its threads' stacks are above: PYTHONFAULTHANDLER)",
    ]


def test_the_end_lists_the_slowest_tests_of_every_group_slowest_first(tmp_path: Path) -> None:
    out = _run(tmp_path, 0, 0, 0).stdout
    tail = out[out.index("== the 25 slowest tests of the suite") :].splitlines()[1:5]
    names = [line.rsplit("::", 1)[1] for line in tail]
    assert names == ["test_paired", "test_alone", "test_light", "test_unit"], out  # 1.04 s, 1.03 s, ...


def test_every_module_listed_for_two_workers_exists() -> None:
    # A renamed module would silently fall back to `serial` (safe, but slower): keep the list true.
    from tests.conftest import PARALLEL_MODULES

    assert sorted(m for m in PARALLEL_MODULES if not (REPO / m).is_file()) == []


def test_suite_times_sums_each_folders_tests_and_skips_unreadable_files(tmp_path: Path) -> None:
    xml = tmp_path / "serial.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.containers.test_image" name="a" time="100.5"/>'
        '<testcase classname="tests.containers.test_pods_in_containers" name="b" time="20"/>'
        '<testcase classname="tests.integration.test_drills" name="c" time="7"/>'
        "</testsuite></testsuites>"
    )
    (tmp_path / "broken.xml").write_text("<testsuites>")
    out = subprocess.run(
        ["python3", str(REPO / "scripts" / "suite_times.py"), str(xml), str(tmp_path / "broken.xml"), "/nonexistent"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert out.splitlines() == ["   tests/containers: 2 tests, 120 s", "   tests/integration: 1 tests, 7 s"]


def test_suite_times_lists_the_tests_that_failed_or_errored(tmp_path: Path) -> None:
    xml = tmp_path / "paired.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.integration.test_drills" name="ok" time="1"/>'
        '<testcase classname="tests.integration.test_drills" name="bad" time="2"><failure message="x"/></testcase>'
        '<testcase classname="tests.pods.test_pods" name="broken[a]" time="3"><error message="y"/></testcase>'
        "</testsuite></testsuites>"
    )
    out = subprocess.run(
        ["python3", str(REPO / "scripts" / "suite_times.py"), str(xml)],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert out.splitlines()[2:] == [
        "== 2 tests failed or errored",
        "   FAILED tests.integration.test_drills::bad",
        "   ERROR tests.pods.test_pods::broken[a]",
    ]


def test_every_test_run_alone_exists() -> None:
    # A renamed test would silently join the 2-worker group (and flake there): keep the list true.
    from tests.conftest import ALONE

    missing = []
    for prefix in ALONE:
        module, _, test = prefix.partition("::")
        source = (REPO / module).read_text() if (REPO / module).is_file() else ""
        if not source or (test and f"def {test}" not in source):
            missing.append(prefix)
    assert missing == []
