#!/usr/bin/env bash
# Issue 30 in one device call on a 4-GPU host (nvidia-h200-x4), after `bash benchmarks/device_build.sh`:
#   1. 2x2 virtual nodes (4 GPUs, ranks_per_node 2): nvshmem (internode) and flat nvlink in the same run,
#      checked against the torch backend; cold/queued times of fresh, FP8 and cached dispatch and combine;
#      the nvshmem backend's per-stage timeline (fresh, cached, combine) and its per-kernel GPU times.
#   2. 2x1 (GPUs 0,1, ranks_per_node 1): the same bench  ||  the internode GPU tests at 2x1 on GPUs 2,3.
#   3. the internode GPU tests at 2x2 (4 GPUs): contract vs reference, FP8, cached, node-limited, graph,
#      a peer dying mid-dispatch.
#   4. if time is left (started before DEEPEP_AFTER_S=120 s) and $DEEPEP_TESTS (default .deepep/DeepEP/tests,
#      carried; ../shared/gpu/deepep_reference.sh prepare) exists: DeepEP v1.2.1's tests/test_internode.py on
#      ep_plugin.deep_ep as 2 virtual nodes of 2 GPUs (benchmarks/deepep_internode_test.py says what it patches).
# Writes to $OUT: internode.json (bench rows of both shapes, test summaries) and internode.log (all output).
# Budget: ~150 s; each stage has its own timeout. Usage: bash benchmarks/internode_device.sh [STAGES]
# STAGES: comma-separated of bench22,bench21,tests21,tests22,deepep (default: these five) and rail22 (not in the
# default: the rail kernels against TorchRail at 2x2, tests/test_rail_gpu.py -k 2x2, up to ~5 min).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export EP_TEST_STACK_DUMP_S=${EP_TEST_STACK_DUMP_S:-100}
# room for both rail forms (BF16 and FP8, the second made at its first call) at 4096 tokens x 7168
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4294967296}
DEEPEP_TESTS=${DEEPEP_TESTS:-.deepep/DeepEP/tests}
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ep_out}
mkdir -p "$OUT"
STAGES=${1:-bench22,bench21,tests21,tests22,deepep}
LOG="$OUT/internode.log"
W=$(mktemp -d /tmp/internode.XXXX)
T0=$(date +%s)
has() { [[ ",$STAGES," == *",$1,"* ]]; }
el() { echo $(( $(date +%s) - T0 )); }
say() { echo "[$(el) s] $*" | tee -a "$LOG"; }
: > "$LOG"
nvidia-smi --query-gpu=index,name,clocks.sm,memory.used --format=csv,noheader >> "$LOG" 2>&1
python3 -c "import ep_plugin._C as C; assert C.HAS_NVSHMEM, 'ep_plugin._C without NVSHMEM'" >> "$LOG" 2>&1 \
  || { say "ep_plugin._C is not built with NVSHMEM: run benchmarks/device_build.sh first"; exit 1; }
git rev-parse --short HEAD >> "$LOG" 2>/dev/null

pytest_run() {  # name, timeout, pytest args...: summary line to the log, the tail of failures too
  local name=$1 limit=$2; shift 2
  timeout -k 5 "$limit" python3 -m pytest -q -rA -p no:cacheprovider -m gpu "$@" > "$W/$name.log" 2>&1
  local rc=$?
  echo "rc=$rc $(grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed' "$W/$name.log" | tr '\n' ';' | cut -c1-900)" \
    > "$W/$name.sum"
  { echo "=== $name rc=$rc"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error|assert" "$W/$name.log" | head -60
    [ $rc -ne 0 ] && tail -80 "$W/$name.log"; } >> "$LOG"
  return $rc
}

if has bench22; then
  say "bench 2x2: nvshmem (ranks_per_node 2) beside flat nvlink and torch, timeline + kernels"
  timeout -k 5 70 python3 benchmarks/bench_internode.py --world 4 --ranks-per-node 2 --cases uniform \
    --timeline 10 --profile --iters 30 --timeout 60 --out "$W" --label 2x2 >> "$LOG" 2>&1
  say "bench 2x2 rc=$?"
fi

if has bench21 || has tests21; then
  if has bench21; then
    say "bench 2x1 on GPUs 0,1 (ranks_per_node 1) || tests 2x1 on GPUs 2,3"
    ( CUDA_VISIBLE_DEVICES=0,1 timeout -k 5 60 python3 benchmarks/bench_internode.py --world 2 --ranks-per-node 1 \
        --cases uniform --timeline 10 --iters 30 --timeout 50 --out "$W" --label 2x1 > "$W/bench21.log" 2>&1
      echo "bench 2x1 rc=$?" >> "$W/bench21.log" ) &
    bpid=$!
  fi
  if has tests21; then
    CUDA_VISIBLE_DEVICES=2,3 pytest_run tests21 90 tests/test_internode_gpu.py -k 2x1
    say "tests 2x1: $(cut -c1-300 "$W/tests21.sum")"
  fi
  if has bench21; then wait $bpid; cat "$W/bench21.log" >> "$LOG"; say "$(tail -1 "$W/bench21.log")"; fi
fi

if has tests22; then
  pytest_run tests22 100 tests/test_internode_gpu.py -k 2x2
  say "tests 2x2: $(cut -c1-300 "$W/tests22.sum")"
fi

if has rail22; then
  pytest_run rail22 ${RAIL_TIMEOUT_S:-300} tests/test_rail_gpu.py -k 2x2
  say "rail 2x2: $(cut -c1-300 "$W/rail22.sum")"
fi

if has deepep; then
  if [ ! -f "$DEEPEP_TESTS/test_internode.py" ]; then
    say "deepep: skipped ($DEEPEP_TESTS not there: carry .deepep (../shared/gpu/deepep_reference.sh prepare) or set DEEPEP_TESTS)"
  elif [ "$(el)" -gt "${DEEPEP_AFTER_S:-120}" ]; then
    say "deepep: skipped (past ${DEEPEP_AFTER_S:-120} s; run it alone: bash benchmarks/internode_device.sh deepep)"
  else
    say "deepep: DeepEP v1.2.1 tests/test_internode.py as 2 virtual nodes x 2 GPUs on ep_plugin.deep_ep"
    timeout -k 5 "${DEEPEP_TIMEOUT_S:-120}" python3 benchmarks/deepep_internode_test.py \
      --tests "$DEEPEP_TESTS" --nodes 2 --gpus-per-node 2 ${DEEPEP_ARGS:-} > "$W/deepep.log" 2>&1
    rc=$?
    echo "rc=$rc $(grep -c ' passed' "$W/deepep.log") cases passed; $(grep 'deepep_internode_test: ' "$W/deepep.log" | tail -1)" \
      > "$W/deepep.sum"
    { echo "=== deepep rc=$rc"; tail -60 "$W/deepep.log"; } >> "$LOG"
    say "deepep rc=$rc"
  fi
fi

# one JSON: both shapes' bench rows, the test summaries
python3 - "$W" "$OUT/internode.json" <<'PYEOF' >> "$LOG" 2>&1
import glob, json, os, sys
w, out = sys.argv[1], sys.argv[2]
doc = {"bench": {}, "tests": {}}
for p in sorted(glob.glob(os.path.join(w, "bench_internode_*.json"))):
    doc["bench"][os.path.basename(p)[len("bench_internode_"):-5]] = json.load(open(p))
for p in sorted(glob.glob(os.path.join(w, "*.sum"))):
    doc["tests"][os.path.basename(p)[:-4]] = open(p).read().strip()
json.dump(doc, open(out, "w"), indent=1)
print(f"wrote {out}: bench {sorted(doc['bench'])}, tests {sorted(doc['tests'])}")
PYEOF
say "done"
grep -E "^\[|^  |=== |rc=|FAILED|json:" "$LOG" | tail -70
