#!/usr/bin/env bash
# GPU extras on one host with 2 GPUs, in one call of about 4 minutes: AutoEP on GPUs (tests,
# benchmark, example), what comm.stats costs, and the examples' stats lines. Logs and JSON in $OUT.
#
#   OUT=/tmp/ep_out PYTHONPATH=/tmp/site bash scripts/gpu_extras.sh        # every step, in order
#   bash scripts/gpu_extras.sh 2 3                                        # only steps 2 and 3
#   EXTRAS_CPU=1 bash scripts/gpu_extras.sh     # dry run of the same steps on CPU (gloo, tiny sizes)
#
#   1  AutoEP GPU tests        pytest -m gpu tests/test_autoep.py (torch over NCCL and nvlink vs "comm";
#                              the example in BF16 vs "comm")                    -> autoep_gpu_tests.log
#   2  AutoEP benchmark        benchmarks/bench_autoep.py, shape "small" (hidden 2048, 64 experts,
#                              top-8, 4096 tokens/rank, BF16): comm vs ep_plugin  -> bench_autoep.json/.log
#   3  telemetry cost          python -m ep_plugin.telemetry.bench, 4096 x 7168, top-8, stats off/on
#                                                                                -> telemetry_bench.json/.log
#   4  examples' stats lines   Megatron (gpt_moe_gpu.yaml) and DeepSpeed examples, comm.stats on, a line
#                              every 5 steps                -> megatron_example.log/.json, ds_example.log/.json
#   5  AutoEP example          examples/deepspeed/autoep_hf_moe.py, DeepSeek-V3-like, ep_plugin, --stats
#                                                                                -> autoep_example.log/.json
#   6  AutoEP benchmark, v3    shape "v3" (hidden 7168, 256 experts), only when the budget has room
#                                                                                -> bench_autoep.json (merged)
#
# Every step runs under `timeout` (its own limit, cut to what is left of BUDGET seconds, default 235)
# and prints one line "[n] name: rc=.. in .. s" and then a short grep of its log. Needs ep_plugin
# installed (-e, _C built), megatron-core and deepspeed importable (PYTHONPATH=/tmp/site after
# scripts/gpu_suite.sh), and transformers for steps 1, 2, 5 and 6 (skipped without it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/ep_out}
mkdir -p "$OUT"
export OUT
export EP_COMMIT=${EP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
BUDGET=${BUDGET:-235}
START=$(date +%s)
SUMMARY=()

# what each step runs: the GPU sizes, or (EXTRAS_CPU=1) tiny ones on CPU that check the plumbing
if [ "${EXTRAS_CPU:-0}" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
  BENCH_SMALL=(--cpu --tiny)
  BENCH_V3=${BENCH_V3:-0}
  TELEMETRY=(--tokens 256 --hidden 512 --topk 8 --iters 10 --rounds 2 --calls 2000)
  MEGATRON=(--steps 10 --log-every 5)
  DS=(--steps 10 --log-every 5)
  AUTOEP=(--preset deepseek_v3 --steps 10 --log-every 5)
else
  BENCH_SMALL=(--shape small)
  TELEMETRY=(--tokens 4096 --hidden 7168 --topk 8 --iters 50 --rounds 3)
  MEGATRON=(--config examples/megatron/gpt_moe_gpu.yaml --steps 15 --log-every 5)
  DS=(--steps 15 --log-every 5 --hidden 512 --seq-len 256)
  AUTOEP=(--preset deepseek_v3 --hidden 1024 --layers 4 --experts 16 --seq-len 1024 --micro-batch 4 --steps 10
          --log-every 5)
fi

elapsed() { echo $(( $(date +%s) - START )); }

# run_step N NAME LIMIT LOG CMD...: the command under timeout (limit cut to the budget left), one result line
run_step() {
  local n=$1 name=$2 limit=$3 log=$4
  shift 4
  rm -f "$log"  # no stale lines from an earlier run under the grep
  local left=$(( BUDGET - $(elapsed) - 3 ))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    echo "[$n] $name: SKIPPED (budget: $(elapsed) of $BUDGET s used)"
    SUMMARY+=("[$n] $name: skipped (budget)")
    return 99
  fi
  local t0=$(date +%s)
  # torchrun's workers run in sessions of their own: on SIGTERM torchrun stops them itself (SIGTERM,
  # then SIGKILL), so -k leaves it 20 s for that before timeout kills torchrun too
  timeout -k 20 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local what="rc=$rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && what="rc=$rc TIMEOUT after ${limit} s"
  echo "[$n] $name: $what in $dt s (log $log)"
  SUMMARY+=("[$n] $name: $what in $dt s")
  if [ $rc -ne 0 ]; then  # the error itself, whatever the step's grep shows
    grep -aE "Error|error:|Traceback|FAILED|Timeout|timed out|Killed|CUDA|NCCL WARN" "$log" | grep -v "^\s*$" | tail -6 | cut -c1-300
  fi
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then  # what is still on the GPUs after a timeout (nothing is killed here)
    sleep 2
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null | sed 's/^/  still on a GPU: /' | head -4
  fi
  return $rc
}

show() {  # show LOG PATTERN [N]: the last N matching lines, shortened
  grep -aE "$2" "$1" 2>/dev/null | tail -n "${3:-12}" | cut -c1-420
}

have() { python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

# ------------------------------------------------------------------------------------------- steps
step_1() {
  have transformers || { echo "[1] AutoEP GPU tests: SKIPPED (transformers not importable)"; SUMMARY+=("[1] skipped: no transformers"); return; }
  run_step 1 "AutoEP GPU tests" 120 "$OUT/autoep_gpu_tests.log" \
    python3 -m pytest -v -rA -p no:cacheprovider -m gpu tests/test_autoep.py
  show "$OUT/autoep_gpu_tests.log" "^tests/.*(PASSED|FAILED|ERROR|SKIPPED)|^(PASSED|FAILED|ERROR|SKIPPED) |[0-9]+ (passed|failed)" 10
  show "$OUT/autoep_gpu_tests.log" "^E +(AssertionError|[A-Za-z]+Error)|assert .*(loss|grad|diff)" 6
}

step_2() {
  have transformers || { echo "[2] AutoEP benchmark: SKIPPED (transformers not importable)"; SUMMARY+=("[2] skipped: no transformers"); return; }
  run_step 2 "AutoEP benchmark (small)" 75 "$OUT/bench_autoep.log" \
    torchrun --nproc-per-node 2 benchmarks/bench_autoep.py "${BENCH_SMALL[@]}" --out "$OUT/bench_autoep.json"
  show "$OUT/bench_autoep.log" "^bench_autoep:|^AutoEP MoE layer|^variant|^(comm |ep_plugin:[a-z])|^wrote" 8
}

step_3() {
  run_step 3 "telemetry cost" 60 "$OUT/telemetry_bench.log" \
    torchrun --nproc-per-node 2 -m ep_plugin.telemetry.bench "${TELEMETRY[@]}" --out "$OUT/telemetry_bench.json"
  show "$OUT/telemetry_bench.log" "^recorder|^dispatch \+ combine|^device time|^wrote|backend" 6
}

step_4() {
  if have megatron.core; then
    run_step 4a "Megatron example stats" 60 "$OUT/megatron_example.log" \
      torchrun --nproc-per-node 2 examples/megatron/pretrain_gpt_moe.py "${MEGATRON[@]}" --no-progress \
        --json "$OUT/megatron_example.json"
    show "$OUT/megatron_example.log" "^GPT-MoE|^ep_plugin:|^step |^done" 8
  else
    echo "[4a] Megatron example: SKIPPED (megatron.core not importable)"; SUMMARY+=("[4a] skipped: no megatron.core")
  fi
  if have deepspeed; then
    run_step 4b "DeepSpeed example stats" 50 "$OUT/ds_example.log" \
      torchrun --nproc-per-node 2 examples/deepspeed/train_moe_ds.py "${DS[@]}" --no-progress \
        --json "$OUT/ds_example.json"
    show "$OUT/ds_example.log" "^world|^ep_plugin:|does not move|^step |^loss " 8
  else
    echo "[4b] DeepSpeed example: SKIPPED (deepspeed not importable)"; SUMMARY+=("[4b] skipped: no deepspeed")
  fi
}

step_5() {
  have transformers || { echo "[5] AutoEP example: SKIPPED (transformers not importable)"; SUMMARY+=("[5] skipped: no transformers"); return; }
  run_step 5 "AutoEP example" 60 "$OUT/autoep_example.log" \
    torchrun --nproc-per-node 2 examples/deepspeed/autoep_hf_moe.py "${AUTOEP[@]}" --stats --no-progress \
      --json "$OUT/autoep_example.json"
  show "$OUT/autoep_example.log" "parameters on rank 0|^ep_plugin: (using|[0-9])|AutoEP ep_plugin exchange|^step |^ep_plugin stats|^loss " 8
}

step_6() {
  have transformers || return
  local left=$(( BUDGET - $(elapsed) ))
  if [ "${BENCH_V3:-auto}" = 0 ] || { [ "${BENCH_V3:-auto}" = auto ] && [ "$left" -lt 70 ]; }; then
    echo "[6] AutoEP benchmark (v3): SKIPPED (BENCH_V3=${BENCH_V3:-auto}, ${left} s of the budget left; BENCH_V3=1 forces it)"
    SUMMARY+=("[6] AutoEP benchmark (v3): skipped")
    return
  fi
  run_step 6 "AutoEP benchmark (v3)" 90 "$OUT/bench_autoep_v3.log" \
    torchrun --nproc-per-node 2 benchmarks/bench_autoep.py --shape v3 --iters 10 --warmup 3 --out "$OUT/bench_autoep.json"
  show "$OUT/bench_autoep_v3.log" "^AutoEP MoE layer|^variant|^(comm |ep_plugin:[a-z])|^wrote" 6
}

# --------------------------------------------------------------------------------------- preflight
echo "gpu_extras: commit $EP_COMMIT, OUT=$OUT, budget $BUDGET s"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null | head -4
python3 - <<'EOF' 2>&1 | tail -3
import importlib.metadata as md, importlib.util as iu
import torch
def v(name, mod):
    if iu.find_spec(mod) is None:
        return f"{name} absent"
    try:
        return f"{name} {md.version(name)}"
    except md.PackageNotFoundError:
        return f"{name} (no metadata)"
try:
    import ep_plugin._ext as ext
    c = f"_C built (CUDA runtime {ext.get_c().cuda_runtime_version()})" if ext.has_c() else "_C NOT built"
except Exception as exc:  # noqa: BLE001
    c = f"ep_plugin import failed: {exc}"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.device_count()} GPUs; ep_plugin {c}; "
      + ", ".join(v(n, m) for n, m in (("deepspeed", "deepspeed"), ("megatron-core", "megatron.core"),
                                       ("transformers", "transformers"))))
EOF

STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(1 2 3 4 5 6)
for s in "${STEPS[@]}"; do
  case "$s" in
    1|2|3|4|5|6) echo; "step_$s" ;;
    *) echo "unknown step $s (1-6)" >&2; exit 2 ;;
  esac
done

echo
echo "== gpu_extras summary ($(elapsed) s of $BUDGET s, logs and JSON in $OUT)"
for line in "${SUMMARY[@]}"; do echo "$line"; done
ls "$OUT"/*.json 2>/dev/null | sed 's/^/  /'
