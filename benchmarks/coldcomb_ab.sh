#!/usr/bin/env bash
# Session 5, one device call (4 GPUs, <= 150 s): is the EP4 pull combine's cold penalty the ranks' start skew,
# the host, or cold memory (L2 / translations), and do the spans (+8) or evict_first x (+16) variants of
# Runtime.pull_variant take it away? Run from the repo root after `bash benchmarks/device_build.sh` and with
# DeepEP V1 importable (the lead's script puts /tmp/deepep on PYTHONPATH). Writes $OUT/coldcomb.log (the
# summary) and $OUT/coldcomb.tgz (every log and the JSON).
#   1. GPU tests of the pull combine at 2 and 4 GPUs: tests/test_nvlink_pull_variants.py (every variant bit
#      for bit against variant 0, within BF16 rounding of the torch backend) and tests/test_nvlink.py (every
#      combine kernel after every dispatch, graphs, timeouts).
#   2. bench_kernels at EP4, 24 and 48 SMs, combine alone: variants 0, 8, 16, 24, 12 and 0 again (drift), 4
#      stager slots, the fused (push) combine once, and DeepEP V1, under cold / queued / hidden / aligned; each
#      row ends with the ranks' host-clock spread after the barrier / at the call's return / the slowest host
#      time in the call.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/coldcomb_out}
mkdir -p "$OUT"
W=$(mktemp -d /tmp/coldcomb.XXXX)
L=$OUT/coldcomb.log
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L"; }
say "start $(git rev-parse --short HEAD 2>/dev/null) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
nvidia-smi --query-gpu=index,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader \
  | tee -a "$L"  # a GPU at another clock sleeps another time in the hidden protocol

# the two files side by side (two processes, as xdist's loadfile would; the worlds share the GPUs)
timeout -k 5 95 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:xdist -rfE tests/test_nvlink_pull_variants.py \
  > "$W/tests_variants.log" 2>&1 &
TV=$!
timeout -k 5 95 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:xdist -rfE tests/test_nvlink.py > "$W/tests_nvlink.log" 2>&1
say "test_nvlink.py (2 and 4 GPUs) rc=$?: $(tail -1 "$W/tests_nvlink.log")"
wait $TV
say "test_nvlink_pull_variants.py (2 and 4 GPUs) rc=$?: $(tail -1 "$W/tests_variants.log")"
grep -hE "^(FAILED|ERROR)" "$W"/tests*.log | head -10 | tee -a "$L"

left=$(( ${CC_BUDGET_S:-145} - ($(date +%s) - T0) ))
[ $left -gt ${CC_AB_MAX_S:-60} ] && left=${CC_AB_MAX_S:-60}
if [ $left -gt 20 ]; then
  timeout -k 5 $left python3 benchmarks/bench_kernels.py --world 4 --sms 24 48 --pairs auto/pull auto/fused --combine-only \
    --combine-variant 0/4 8/4 16/4 24/4 12/4 0/4 --protocols cold queued hidden aligned --out "$W" > "$W/ab.log" 2>&1
  say "bench_kernels A/B rc=$?"
  grep -E "^EP4|FAILED|Error|error" "$W/ab.log" | head -30 | tee -a "$L"
else
  say "no time left for the A/B ($left s)"
fi
(cd "$W" && tar czf "$OUT/coldcomb.tgz" ./*.log ./*.json 2>/dev/null)
say "done"
