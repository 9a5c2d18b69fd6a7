#!/usr/bin/env bash
# The whole suite as CI runs it. pytest's exit 5 (no tests collected) fails like any other error.
# The unit tests run on two workers (pytest-xdist). The integration, pod and chart tests run in three
# groups: those that mostly wait (HTTP fakes, helm/promtool subprocesses, CLI errors) on two workers;
# those marked `serial` (tests/conftest.py: multi-process training, drills) on two workers too, a test
# module to a worker (`--dist loadscope`: a module's fixtures and cached reference runs stay in one
# process); then those marked `alone` (deadlines, standby races, preemption graces: a busy neighbour on a
# 2-core machine would turn them into flakes) one at a time.
set -euo pipefail
venv=${1:-.venv}; shift || true
export RAY_USAGE_STATS_ENABLED=0 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# A pytest process that crashes (a C++ abort as the interpreter exits, a segfault) prints every Python
# thread's stack: the thread still inside torch or Ray says which test left it running.
export PYTHONFAULTHANDLER=1
export PATH="$PWD/$venv/bin:$PATH"
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# The machine's busy CPU time (user, nice, system, irq, softirq, steal), in clock ticks: how much of the
# cores a group kept busy says whether running it on more workers could be faster (the 25-minute budget).
busy() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
hz=$(getconf CLK_TCK); cores=$(nproc)
usage() {  # usage NAME START_TICKS END_TICKS WALL_S
  echo "   $1: $(( ($3 - $2) / hz )) s of CPU in $4 s on $cores cores ($(( ($3 - $2) * 100 / hz / (cores * ($4 > 0 ? $4 : 1)) ))% busy)"
}
# What a group's exit code means, at the end of the log (CI shows its tail).
meaning() {
  case $1 in
    0) echo "passed" ;;
    1) echo "tests failed (FAILED lines above)" ;;
    5) echo "no tests collected" ;;
    2|3|4) echo "pytest stopped: interrupted, internal error or usage (exit $1)" ;;
    *)
      if [ "$1" -gt 128 ]; then
        echo "the pytest process was killed by SIG$(kill -l $(( $1 - 128 )) 2>/dev/null || echo $(( $1 - 128 )))" \
          "(exit $1; its threads' stacks are above: PYTHONFAULTHANDLER)"
      else
        echo "exit $1"
      fi ;;
  esac
}
echo "== lint"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy"
# Each group's output also goes to a log, for the suite's 25 slowest tests at the end.
echo "== unit tests (2 workers)"
unit=0
t0=$SECONDS; b0=$(busy)
"$venv/bin/pytest" -q -n 2 --durations=25 -m "not soak" --junitxml="$logs/unit.xml" tests/unit "$@" \
  | tee "$logs/unit" || unit=$?
t1=$SECONDS; b1=$(busy)
echo "== integration tests that mostly wait (2 workers)"
light=0
"$venv/bin/pytest" -q -n 2 --durations=25 -m "not soak and not serial" --junitxml="$logs/light.xml" \
  --ignore=tests/unit "$@" \
  | tee "$logs/light" || light=$?
t2=$SECONDS; b2=$(busy)
echo "== integration tests that train (2 workers, a module to a worker)"
paired=0
"$venv/bin/pytest" -q -n 2 --dist loadscope --durations=25 -m "not soak and serial and not alone" \
  --junitxml="$logs/paired.xml" --ignore=tests/unit "$@" \
  | tee "$logs/paired" || paired=$?
t3=$SECONDS; b3=$(busy)
echo "== integration tests that need the cores to themselves (one at a time)"
alone=0
"$venv/bin/pytest" -q --durations=25 -m "not soak and alone" --junitxml="$logs/alone.xml" --ignore=tests/unit "$@" \
  | tee "$logs/alone" || alone=$?
t4=$SECONDS; b4=$(busy)
echo "== the 25 slowest tests of the suite"
cat "$logs"/* | grep -E '^[0-9]+\.[0-9]+s (setup|call|teardown) ' | sort -rn | head -25 || true
# The tests' own time by folder (what the containers, the pods harness, ... add to the suite), and the
# tests that failed, from every group (the end of the log is what CI shows).
echo "== test time by folder (setup, call and teardown; the 2-worker groups' tests overlap)"
python3 scripts/suite_times.py "$logs"/*.xml || true
# Each group's wall time, for the suite's 25-minute budget (README, "Development").
echo "== durations: unit $((t1 - t0)) s, integration $((t4 - t1)) s" \
  "($((t2 - t1)) s waiting on 2 workers, $((t3 - t2)) s training on 2 workers, $((t4 - t3)) s one at a time)," \
  "total $((t4 - t0)) s"
usage "unit" "$b0" "$b1" $((t1 - t0))
usage "integration that waits, 2 workers" "$b1" "$b2" $((t2 - t1))
usage "integration that trains, 2 workers" "$b2" "$b3" $((t3 - t2))
usage "integration one at a time" "$b3" "$b4" $((t4 - t3))
groups=("unit tests:$unit" "integration tests on 2 workers:$light" "integration tests that train:$paired"
  "integration tests one at a time:$alone")
echo "== groups"
for part in "${groups[@]}"; do echo "   ${part%:*}: $(meaning "${part##*:}")"; done
# Any group collecting nothing (a bad -k, a broken conftest, a moved folder, a lost marker) fails the run:
# a group that runs nothing proves nothing, even when the others passed.
for part in "${groups[@]}"; do
  if [ "${part##*:}" -eq 5 ]; then
    echo "pytest collected no ${part%:*}: failing (a suite that runs nothing proves nothing)" >&2
    exit 1
  fi
done
for part in "${groups[@]}"; do
  if [ "${part##*:}" -ne 0 ]; then exit "${part##*:}"; fi
done
