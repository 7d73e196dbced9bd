#!/usr/bin/env bash
# One device call on a 4-GPU host (nvidia-h200-x4) for the nvlink kernels and the low-latency pair:
# build (DeepEP V1 beside it in the background), the nvlink GPU tests, per-kernel phases and the
# kernel-choice benchmark (bench_kernels.py, DeepEP in the same run) at EP4 and EP2, and the decode-pair
# yardstick (each library in its own process). Every step has its own time limit; logs go to $OUT.
#   bash benchmarks/device_session.sh [steps...]     steps: test phases kernels pair extra (default: all)
# Carry .deepep (../shared/gpu/deepep_reference.sh prepare) and .yard (copies of ../shared/gpu/yardstick_*.py).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." && export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Everything is written under a staging folder and packed into $OUT/session.tgz at the end (the device
# tool brings back at most 8 files); session.log is also copied beside it.
FINAL=${OUT:-/tmp/ep_out}
export OUT=/tmp/ep_session
rm -rf "$OUT" && mkdir -p "$OUT" "$FINAL"
pack() { tar czf "$FINAL/session.tgz" -C "$OUT" . ; cp "$OUT/session.log" "$FINAL/" 2>/dev/null; }
trap pack EXIT
STEPS=${*:-test phases kernels pair extra}
T0=$(date +%s)
L=$OUT/session.log
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L"; }
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
# run NAME LIMIT CMD...: the command's output into $OUT/NAME.log, its tail into the session log
run() {
  local n=$1 lim=$2 t0=$(date +%s)
  shift 2
  timeout "$lim" "$@" >> "$OUT/$n.log" 2>&1
  local rc=$?
  say "== $n: rc=$rc in $(( $(date +%s) - t0 )) s: $*"
  grep -E "^(EP[0-9]|ceiling|deepep|ep_plugin|deep_ep_shim|wrote|FAILED|ERROR)|passed|failed|Error|rank 0:" "$OUT/$n.log" | tail -40 | tee -a "$L"
}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | head -1 | tee -a "$L"
[ -d .deepep ] && setsid bash .deepep/deepep_reference.sh build > "$OUT/deepep_build.log" 2>&1 < /dev/null &
bash benchmarks/device_build.sh > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
say "build: $(tail -1 "$OUT/build.log")"
PY=python3
if has test; then
  run tests "${TEST_LIMIT:-150}" $PY -m pytest -q -x -m gpu -p no:cacheprovider tests/test_nvlink_one_gpu.py tests/test_nvlink.py \
    ${TEST_EXTRA:-}
fi
if has phases; then
  for w in ${PHASES_WORLDS:-4 2}; do  # PHASES_ARGS: e.g. --only pull
    run phases "${PHASES_LIMIT:-60}" $PY benchmarks/nvlink_phases.py --world $w --iters 20 ${PHASES_ARGS:-}
  done
fi
waitdeepep() {  # DeepEP importable, or a line saying why not
  for _ in $(seq 1 60); do [ -f /tmp/deepep/.built ] && break; pgrep -f "deepep_reference.sh build" > /dev/null || break; sleep 3; done
  if [ -f /tmp/deepep/.built ]; then export PYTHONPATH=/tmp/deepep:${PYTHONPATH:-}; else say "DeepEP not built: $(tail -3 "$OUT/deepep_build.log")"; fi
}
if has kernels; then
  waitdeepep
  # PAIRS4 / PAIRS2: dispatch/combine kernel pairs (bench_kernels.py's default set when empty)
  run kernels "${KERNELS_LIMIT:-150}" $PY benchmarks/bench_kernels.py --world 4 --sms ${SMS4:-16 24 48} --out "$OUT" --iters 20 \
    ${PAIRS4:+--pairs $PAIRS4}
  CUDA_VISIBLE_DEVICES=0,1 run kernels "${KERNELS_LIMIT:-150}" $PY benchmarks/bench_kernels.py --world 2 --sms ${SMS2:-8 24 48} \
    --out "$OUT" --iters 20 ${PAIRS2:+--pairs $PAIRS2}
fi
if has pair; then
  waitdeepep
  for w in 2 4; do
    dev=0,1; [ $w = 4 ] && dev=0,1,2,3
    for lib in "deepep" "ep_plugin --ob 0" "ep_plugin --ob 2" "deep_ep_shim"; do
      CUDA_VISIBLE_DEVICES=$dev run pair 60 $PY .yard/yardstick_decode_pair.py $lib --ranks $w --iters 30
    done
  done
fi
if has extra && [ -n "${EXTRA:-}" ]; then  # other scripts with their arguments, ';'-separated
  IFS=';' read -ra scripts <<< "$EXTRA"
  for script in "${scripts[@]}"; do waitdeepep; run extra "${EXTRA_LIMIT:-170}" bash $script; done
fi
say "done"
