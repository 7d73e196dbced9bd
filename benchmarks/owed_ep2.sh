#!/usr/bin/env bash
# The runs owed on two GPUs (nvidia-h200-x2), as one device call: what sessions 6-7 of 2026-11-23 built
# on one H200 (no two-GPU machine was lent) and could not measure there. Results land in $OUT.
#   GPU tests: nvlink (stage_pull, both dispatch kernels, faults), low-latency (output sets, own-row
#   combine, repeated picks), DeepSpeed equality (padded expert segments);
#   nvlink_phases at 4096 and 128 tokens (split vs fused dispatch kernel: decides comm.dispatch_kernel);
#   deepspeed_layer at EP2 per drop_tokens setting; bench_dispatch (throughput + latency, DeepEP beside)
#   with each dispatch kernel.
# Prepare here first (README "Running on GPUs"): .deepep (../shared/gpu/deepep_reference.sh prepare) and .whl
# (../shared/gpu/fetch_wheels.sh); the call carries both: carry [".whl", ".deepep"].
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ep_out}
mkdir -p "$OUT"
L=$OUT/owed.log
T0=$(date +%s)
(bash .deepep/deepep_reference.sh build > /tmp/deepep_build.log 2>&1 &)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 &
python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
wait
t() {  # name, time limit, pytest arguments
  local n=$1 lim=$2 t0
  shift 2
  t0=$(date +%s)
  EP_TEST_STACK_DUMP_S=$((lim - 10)) timeout "$lim" python3 -m pytest -q -s -m gpu "$@" -rA -p no:cacheprovider > "/tmp/$n.log" 2>&1
  echo "== $n rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$L"
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed|^E  " "/tmp/$n.log" | head -14 | tee -a "$L"
  cat "/tmp/$n.log" >> "$OUT/tests.log"
}
t nvlink 150 tests/test_nvlink.py tests/test_nvlink_faults.py tests/test_nvlink_one_gpu.py
t ll 200 tests/test_low_latency_gpu.py tests/test_low_latency_one_gpu.py
PYTHONPATH=/tmp/site t deepspeed 90 tests/test_deepspeed.py
for tok in 4096 128; do
  timeout 70 python3 benchmarks/nvlink_phases.py --tokens $tok > "$OUT/phases_$tok.log" 2>&1
  grep -E "^(dispatch|combine|notify)" "$OUT/phases_$tok.log" | tee -a "$L"
done
for d in false true; do
  PYTHONPATH=/tmp/site timeout 90 torchrun --nproc-per-node 2 benchmarks/deepspeed_layer.py --backends nvlink \
    --drop-tokens $d --iters 30 --out "$OUT/ds_$d.json" > "$OUT/ds_$d.log" 2>&1
  grep "layer fwd" "$OUT/ds_$d.log" | tee -a "$L"
done
left=$(( 540 - ($(date +%s) - T0) ))
echo "left $left s" | tee -a "$L"
for k in split fused; do
  [ $left -gt 80 ] || break
  EP_PLUGIN_NVLINK_DISPATCH=$k PYTHONPATH=/tmp/deepep timeout $((left / 2)) python3 benchmarks/bench_dispatch.py \
    --cases throughput latency --iters 30 --out "$OUT" --label "owed_$k" --timeout $((left / 2 - 5)) > "$OUT/bench_$k.log" 2>&1
  grep -E "^\s+(ep_plugin|DeepEP|NCCL)" "$OUT/bench_$k.log" | head -30 | tee -a "$L"
  left=$(( 540 - ($(date +%s) - T0) ))
done
