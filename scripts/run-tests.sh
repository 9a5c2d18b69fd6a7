#!/usr/bin/env bash
# The whole suite as CI runs it. pytest's exit 5 (no tests collected) fails like any other error.
# The unit tests run on two workers (pytest-xdist); the integration, pod and chart tests run one at a
# time (each starts real multi-process jobs and servers that need the machine's cores to themselves).
set -euo pipefail
venv=${1:-.venv}; shift || true
export RAY_USAGE_STATS_ENABLED=0 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export PATH="$PWD/$venv/bin:$PATH"
echo "== lint"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy"
echo "== unit tests (2 workers)"
unit=0
t0=$SECONDS
"$venv/bin/pytest" -q -n 2 --durations=25 -m "not soak" tests/unit "$@" || unit=$?
t1=$SECONDS
echo "== integration tests"
rest=0
"$venv/bin/pytest" -q --durations=25 -m "not soak" --ignore=tests/unit "$@" || rest=$?
t2=$SECONDS
# Each half's wall time, for the suite's 25-minute budget (README, "Development").
echo "== durations: unit $((t1 - t0)) s, integration $((t2 - t1)) s, total $((t2 - t0)) s"
# Either half collecting nothing (a bad -k, a broken conftest, a moved folder) fails the run: a half
# that runs nothing proves nothing, even when the other half passed.
for part in "unit:$unit" "integration:$rest"; do
  if [ "${part#*:}" -eq 5 ]; then
    echo "pytest collected no ${part%%:*} tests: failing (a suite that runs nothing proves nothing)" >&2
    exit 1
  fi
done
for rc in "$unit" "$rest"; do
  if [ "$rc" -ne 0 ]; then exit "$rc"; fi
done
