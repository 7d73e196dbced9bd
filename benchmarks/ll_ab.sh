#!/usr/bin/env bash
# The FP8 direct dispatch's lean-store bits, the combine receive's loads ahead and the 8-deep row copies
# (engine.kernel_flags 256, 512, 1024, 2048; docs/LOW_LATENCY.md, "The FP8 dispatch against DeepEP's:
# bytes, floor, lean stores") against the default (64), on a 4-GPU host after
# the builds (benchmarks/device_build.sh; DeepEP v1.2.1 at /tmp/deepep). Budget LL_AB_BUDGET_S (145 s);
# every step under `timeout`, and a step that no longer fits is skipped:
#   1. bench_decode_pair.py at EP2 (GPUs 0,1), then EP4 (0-3): DeepEP V1 in a process of its own, then ours
#      in one process -- default (64), lean (64|256), early (64|128|256|512), ahead (64|1024), copy8
#      (64|2048), all_new (64|128|256|512|1024|2048), and default again last (the drift of the machine
#      between the first and the last variant) -- graph cold and graph queued, BF16 and FP8; EP2 also traces
#      the kernels of default, all_new and DeepEP (--profile 3);
#   2. the merge: the table, and each variant's ratios to DeepEP and to default (< 1: faster);
#   3. tests/test_low_latency_gpu.py at EP2 with the time left (each new bit against the torch reference:
#      FP8 with and without round_scale, BF16, hooks, CUDA graphs, a masked rank; bit-exact outputs).
# Writes $OUT/ll_ab.log (everything printed), ll_ab.json, ll_ab.png, gpu_tests_ep2.log, ll_ab_steps.tgz.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
B=${LL_AB_BUDGET_S:-145}
OUT=${OUT:-/tmp/ep_out}
mkdir -p "$OUT"
LOG=$OUT/ll_ab.log
W=/tmp/ll_ab
rm -rf "$W" && mkdir -p "$W"
T0=$(date +%s)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this tree's ep_plugin (built in place by device_build.sh)
[ -d /tmp/deepep ] && export PYTHONPATH=$PYTHONPATH:/tmp/deepep
VARIANTS="default lean:eng.kernel_flags=320 early:eng.kernel_flags=960 ahead:eng.kernel_flags=1088"
VARIANTS="$VARIANTS copy8:eng.kernel_flags=2112 all_new:eng.kernel_flags=4032 default_again:eng.kernel_flags=64"
PROTOCOLS="graph_cold graph_queued"
left() { echo $(( B - ($(date +%s) - T0) )); }
say() { echo "$*" | tee -a "$LOG"; }
say "== ll_ab.sh $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ); budget ${B}s"
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tee -a "$LOG"
timeout 30 python3 -c "import ep_plugin, ep_plugin._C as C; print(ep_plugin.__file__, '_C NVSHMEM', C.HAS_NVSHMEM)" 2>&1 \
  | tail -1 | tee -a "$LOG"

pair() {  # ranks lib limit_s extra args...
  local r=$1 lib=$2 lim=$3 devs=0,1 l t0 rc
  shift 3
  [ "$r" = 4 ] && devs=0,1,2,3
  l=$(left)
  [ "$l" -lt 20 ] && { say "-- EP$r $lib skipped: ${l}s left"; return; }
  [ "$lim" -gt "$l" ] && lim=$l
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=$devs timeout -k 5 "$lim" python3 benchmarks/bench_decode_pair.py --lib "$lib" --ranks "$r" \
    --protocols $PROTOCOLS --iters 40 --timeout $((lim - 3)) --out "$W/pair_ep${r}_$lib.json" "$@" > "$W/ep${r}_$lib.log" 2>&1
  rc=$?
  say "-- EP$r $lib rc=$rc $(( $(date +%s) - t0 ))s"
  grep -vE "^\s*$|[Ww]arning|warn\(" "$W/ep${r}_$lib.log" | tail -60 >> "$LOG"
}
# shellcheck disable=SC2086
{
  pair 2 deepep 25 --profile 3
  pair 2 ep_plugin 40 --variants $VARIANTS --profile 3 --profile-variants default all_new
  if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 4 ]; then
    pair 4 deepep 25
    pair 4 ep_plugin 35 --variants $VARIANTS
  else
    say "-- EP4 skipped: fewer than 4 GPUs"
  fi
}
say "== merged (slowest rank's median, us)"
timeout 30 python3 benchmarks/bench_decode_pair.py --merge "$W"/pair_ep*.json --out "$OUT/ll_ab.json" --plot "$OUT/ll_ab.png" \
  2>&1 | tee -a "$LOG"

l=$(left)
if [ "$l" -ge 30 ]; then
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=0,1 EP_TEST_WORLD=2 EP_TEST_STACK_DUMP_S=$((l - 10)) timeout -k 5 $((l - 3)) \
    python3 -m pytest -q -s -m gpu tests/test_low_latency_gpu.py -rA -p no:cacheprovider > "$OUT/gpu_tests_ep2.log" 2>&1
  say "-- gpu tests EP2 rc=$? $(( $(date +%s) - t0 ))s"
  grep -E "passed|failed|PASSED|FAILED|^E  |Error" "$OUT/gpu_tests_ep2.log" | tail -25 | tee -a "$LOG"
else
  say "-- gpu tests EP2 skipped: ${l}s left"
fi
tar -czf "$OUT/ll_ab_steps.tgz" -C "$W" . 2>/dev/null
say "== done in $(( $(date +%s) - T0 ))s"
