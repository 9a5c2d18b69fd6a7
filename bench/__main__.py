"""`python -m bench` (`make bench`): every figure is a ratio of two things measured in the same run.

Sections: overhead, checkpoint_stall, mttr, exporter, scaling, gpu (bench/sections/). `--quick` uses
fewer repeats and smaller states (for a smoke run); `--only a,b` runs some sections and keeps the
others' last figures. Results go to bench/results/latest.json, latest.md and PNG plots
(bench/report.py); docs/performance.md embeds the table.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import time
import traceback

from bench.common import now_iso
from bench.report import read_previous, write_report
from bench.sections import SECTIONS, Results


def run_sections(names: list[str], quick: bool, results: Results) -> Results:
    """Run the named sections in order into `results`; a failing section is recorded under `errors`.

    `runs` says when each section last ran and whether with `--quick` (a run of some sections keeps the
    others' figures, so one flag for the whole file would mislabel them); `quick` is this run's flag.
    """
    results.update(
        {
            "timestamp": now_iso(),
            "machine": {"cpus": os.cpu_count(), "gpu": None, "python": platform.python_version()},
            "quick": quick,
        }
    )
    results.setdefault("errors", {})
    runs = results.setdefault("runs", {})
    for name in names:
        runs[name] = {"timestamp": now_iso(), "quick": quick}
        section = SECTIONS[name]
        print(f"== {name}", flush=True)
        t = time.time()
        try:
            section.store(results, section.run(quick))
            results["errors"].pop(name, None)
        except Exception:
            results["errors"][name] = traceback.format_exc()[-2000:]
            print(results["errors"][name], flush=True)
        print(f"   {time.time() - t:.1f}s", flush=True)
    return results


def merge_changes(latest: Results, before: Results, after: Results) -> Results:
    """`latest` with every top-level key that went from `before` to `after` (this run's changes) applied;
    `errors` and `runs` are merged per section."""
    merged = copy.deepcopy(latest)
    for key, value in after.items():
        if key in ("errors", "runs"):
            table = dict(merged.get(key) or {})
            old = before.get(key) or {}
            for name in set(old) | set(value):
                if name not in value:
                    table.pop(name, None)
                elif old.get(name) != value[name]:
                    table[name] = value[name]
            merged[key] = table
        elif before.get(key) != value:
            merged[key] = value
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, small states (smoke run)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {tuple(SECTIONS)}")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown sections {sorted(unknown)}; valid: {', '.join(SECTIONS)}")
    before = read_previous()
    results = run_sections(only, args.quick, copy.deepcopy(before))
    # A bench run takes minutes to hours: another run may have written its sections meanwhile. Only what
    # this run changed replaces the file's figures (a stale copy of the others would undo that run).
    print(write_report(merge_changes(read_previous(), before, results)).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
