#!/usr/bin/env bash
# The whole test suite, RUNS times in a row (default 3), under a CPU hog on every core
# (`stress-ng --cpu 0`, from Debian's stress-ng): tests that wait on conditions pass on a
# saturated box too, tests that wait on fixed sleeps or assert speed do not.
# Each run's status and wall time go to stdout, its output to DIR/run-N.log; the last line is
#   RESULT runs=N failed_runs=K run_s=a,b,c hog=stress-ng-cpu-<cores>
# Usage: bash scripts/stress-suite.sh [RUNS] [DIR] [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
dir=${2:-.stress}
shift $(( $# > 2 ? 2 : $# ))
mkdir -p "$dir"
if ! command -v stress-ng > /dev/null; then
  echo "stress-suite: installing stress-ng (Debian)"
  if [ "$(id -u)" = 0 ]; then apt-get install -y -q stress-ng > "$dir/apt.log" 2>&1
  else sudo apt-get install -y -q stress-ng > "$dir/apt.log" 2>&1; fi || {
    echo "stress-suite: cannot install stress-ng (see $dir/apt.log)"; exit 2; }
fi
cores=$(nproc)
stress-ng --cpu 0 --cpu-method matrixprod --quiet &
hog=$!
trap 'kill "$hog" 2> /dev/null; wait "$hog" 2> /dev/null' EXIT
failed=0
times=()
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  bash scripts/test.sh "$@" > "$dir/run-$i.log" 2>&1
  status=$?
  took=$(( $(date +%s) - start ))
  times+=("$took")
  [ "$status" = 0 ] || failed=$(( failed + 1 ))
  echo "run $i: status $status in ${took}s: $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$dir/run-$i.log" | tail -1)"
done
echo "RESULT runs=$runs failed_runs=$failed run_s=$(IFS=,; echo "${times[*]}") hog=stress-ng-cpu-$cores"
[ "$failed" = 0 ]
