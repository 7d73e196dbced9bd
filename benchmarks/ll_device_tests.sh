#!/usr/bin/env bash
# Issue 29's "done when", as one device call on a 4-GPU host after the builds (carry [".deepep"]):
#   bash benchmarks/device_build.sh && bash .deepep/deepep_reference.sh build && bash benchmarks/ll_device_tests.sh
# Budget LL_TESTS_BUDGET_S (default 300 s); each step runs only if the time left allows it, in order:
#   1. DeepEP v1.2.1's own tests/test_low_latency.py through ep_plugin.deep_ep (no ep_config) at 4, then 2 ranks;
#   2. tests/test_low_latency_gpu.py at EP4, then EP2 (EP_TEST_WORLD): hooks, graphs, masks, FP8, repeated
#      picks, zero-token ranks, output sets, timeouts;
#   3. benchmarks/bench_ll_overlap.py at EP2 and EP4 (a GEMM between send and hook runs at full speed).
# Writes $OUT/ll_tests.log (the summary and every step's tail) and $OUT/ll_overlap.json.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ep_out}
mkdir -p "$OUT"
LOG=$OUT/ll_tests.log
W=/tmp/ll_tests
rm -rf "$W" && mkdir -p "$W"
T0=$(date +%s)
B=${LL_TESTS_BUDGET_S:-300}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d /tmp/deepep ] && export PYTHONPATH=$PYTHONPATH:/tmp/deepep
left() { echo $(( B - ($(date +%s) - T0) )); }
say() { echo "$*" | tee -a "$LOG"; }
step() {  # name, need_s, limit_s, command...
  local n=$1 need=$2 lim=$3 l t0 rc
  shift 3
  l=$(left)
  [ "$l" -lt "$need" ] && { say "-- $n skipped: ${l}s left"; return; }
  [ "$lim" -gt "$l" ] && lim=$l
  t0=$(date +%s)
  timeout -k 5 "$lim" "$@" > "$W/$n.log" 2>&1
  rc=$?
  say "-- $n rc=$rc $(( $(date +%s) - t0 ))s"
  grep -E "passed|failed|PASSED|FAILED|^E  |Error|Dispatch \+ combine|send/recv|deepep_ll_test|overlap|GEMM|total" \
    "$W/$n.log" | head -20 | tee -a "$LOG"
}
say "== ll_device_tests.sh $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ); budget ${B}s"
TESTS=/tmp/deepep/tests
[ -d "$TESTS" ] || TESTS=.deepep/DeepEP/tests
step deepep_test_ep4 60 120 env CUDA_VISIBLE_DEVICES=0,1,2,3 python3 benchmarks/deepep_ll_test.py --tests "$TESTS" --shim --ranks 4
step deepep_test_ep2 50 100 env CUDA_VISIBLE_DEVICES=0,1 python3 benchmarks/deepep_ll_test.py --tests "$TESTS" --shim --ranks 2
for w in 4 2; do
  devs=0,1; [ $w = 4 ] && devs=0,1,2,3
  step "ll_gpu_ep$w" 90 200 env CUDA_VISIBLE_DEVICES=$devs EP_TEST_WORLD=$w EP_TEST_STACK_DUMP_S=190 \
    python3 -m pytest -q -s -m gpu tests/test_low_latency_gpu.py -rA -p no:cacheprovider
done
for w in 2 4; do
  devs=0,1; [ $w = 4 ] && devs=0,1,2,3
  step "overlap_ep$w" 30 60 env CUDA_VISIBLE_DEVICES=$devs python3 benchmarks/bench_ll_overlap.py --ranks $w \
    --iters 30 --timeout 55 --out "$W/overlap_ep$w.json"
done
python3 - "$W" "$OUT/ll_overlap.json" <<'PYEOF'
import glob, json, sys
docs = {}
for p in sorted(glob.glob(sys.argv[1] + "/overlap_ep*.json")):
    try:
        docs[p.rsplit("/", 1)[1]] = json.load(open(p))
    except Exception as exc:  # noqa: BLE001
        docs[p] = {"error": str(exc)}
json.dump(docs, open(sys.argv[2], "w"), indent=1)
PYEOF
for n in "$W"/*.log; do echo "=== $(basename "$n")"; tail -40 "$n"; done >> "$LOG"
say "== done in $(( $(date +%s) - T0 ))s"
