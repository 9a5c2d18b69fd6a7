#!/usr/bin/env bash
# The whole suite as CI runs it. pytest's exit 5 (no tests collected) fails like any other error.
set -euo pipefail
venv=${1:-.venv}; shift || true
export RAY_USAGE_STATS_ENABLED=0 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export PATH="$PWD/$venv/bin:$PATH"
echo "== lint"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy"
echo "== tests"
rc=0
"$venv/bin/pytest" -q --durations=25 -m "not soak" "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing (a suite that runs nothing proves nothing)" >&2
  exit 1
fi
exit "$rc"
