#!/usr/bin/env bash
# Runs each given pytest node N times (REPEATS, default 50), each run in a fresh interpreter, and counts
# failures and runs whose output holds "terminate called" (a rank aborting at exit): the evidence that an
# exit-time crash is gone.   bash scripts/repeat_tests.sh NODE [NODE...]   (log per node: $OUT/repeat_*.log)
set -uo pipefail
cd "$(dirname "$0")/.."
N=${REPEATS:-50}
OUT=${OUT:-/tmp/repeat_tests}
mkdir -p "$OUT"
for node in "$@"; do
  log="$OUT/repeat_$(echo "$node" | tr -c 'A-Za-z0-9_' '_').log"
  : > "$log"
  fails=0 aborts=0 t0=$(date +%s)
  for i in $(seq 1 "$N"); do
    out=$(python3 -m pytest -q -p no:cacheprovider "$node" 2>&1)
    rc=$?
    [ $rc -ne 0 ] && fails=$((fails + 1))
    grep -q "terminate called" <<< "$out" && aborts=$((aborts + 1))
    echo "run $i rc=$rc $(tail -1 <<< "$out")" >> "$log"
  done
  echo "$node: $N runs, $fails failed, $aborts with 'terminate called', $(( $(date +%s) - t0 )) s" | tee -a "$log"
done
