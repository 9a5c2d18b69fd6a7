"""The suite's test time by folder, from pytest's JUnit XML files (scripts/run-tests.sh).

`python3 scripts/suite_times.py A.xml B.xml ...` prints one line per folder (tests/containers,
tests/pods, tests/integration, tests/unit): how many tests and their seconds (setup, call and teardown
together, as pytest's JUnit writer sums them); then each test that failed or errored, from every file (CI
shows the end of the log). A missing or unreadable file is skipped: the summary must never fail the suite.
Standard library only (it runs with the machine's python3).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def folder_of(classname: str) -> str:
    """`tests.containers.test_image.TestX` -> `tests/containers`."""
    parts = classname.split(".")
    return "/".join(parts[:2]) if len(parts) >= 2 else classname or "?"


def main(paths: list[str]) -> int:
    seconds: dict[str, float] = {}
    tests: Counter[str] = Counter()
    failed: list[str] = []
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue
        for case in root.iter("testcase"):
            folder = folder_of(case.get("classname", ""))
            seconds[folder] = seconds.get(folder, 0.0) + float(case.get("time") or 0.0)
            tests[folder] += 1
            bad = case.find("failure")
            bad = case.find("error") if bad is None else bad
            if bad is not None:
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                failed.append(f"   {'FAILED' if bad.tag == 'failure' else 'ERROR'} {name}")
    for folder, total in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"   {folder}: {tests[folder]} tests, {total:.0f} s")
    if failed:
        print(f"== {len(failed)} tests failed or errored")
        print("\n".join(failed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
