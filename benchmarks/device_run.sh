#!/usr/bin/env bash
# One device call for the nvlink backend: build, GPU tests on 2 and 4 GPUs, benchmark.
# Logs and JSON go to $OUT. Usage: benchmarks/device_run.sh [all|test|bench]
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ep_out}
mkdir -p "$OUT"
STAGE=${1:-all}
{ nvidia-smi topo -m; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv; } > "$OUT/build.log" 2>&1
t0=$(date +%s)
benchmarks/device_build.sh >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s; $(tail -1 "$OUT/build.log")"
if [ "$STAGE" = all ] || [ "$STAGE" = test ]; then
  t0=$(date +%s)
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rA -p no:cacheprovider tests/test_nvlink.py ${PYTEST_ARGS:-} \
    > "$OUT/test.log" 2>&1
  echo "tests rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" "$OUT/test.log" | head -40
fi
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  t0=$(date +%s)
  timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/bench_dispatch.py --out "$OUT" --breakdown ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1
  echo "bench rc=$? in $(( $(date +%s) - t0 )) s"
  tail -45 "$OUT/bench.log"
fi
