#!/usr/bin/env bash
# GPU suite in as few device calls as possible: build, GPU tests, Megatron layer, dispatch benchmark,
# low-latency receive-hook overlap.
#
#   bash scripts/gpu_suite.sh test                 # the GPU test suite alone: builds _C if absent (device_build.sh),
#                                                   # runs -m gpu, prints passed/failed/skipped and seconds per file
#   bash scripts/gpu_suite.sh build test layer     # first call
#   bash scripts/gpu_suite.sh build bench          # second call (build is skipped when already done)
#   bash scripts/gpu_suite.sh build ll             # receive hooks vs a GEMM (benchmarks/bench_ll_overlap.py)
#   PYTEST_K=expert: only the GPU tests matching it; TEST_TIMEOUT (570 s): the suite's limit; LAYER_BASELINE=0: the layer on this tree only
#   GPU_TEST_WORKERS (3 where pytest-xdist is installed, else 1): pytest workers (a file each at a time) share
#   the GPUs: most of a test's time is process start-up and host work, which then overlap (4x H100,
#   2026-11-26: 164 tests, 158 passed, 6 skipped (8 GPUs) in 215 s with 3 workers; 2 workers ran 160 in 531 s
#   with a hung fuzz spawn since fixed). GPU_TEST_WORKERS=1 for per-test timings free of the others' load
#   BENCH_ARGS / LL_ARGS: extra arguments of bench_dispatch.py / bench_ll_overlap.py
#
# Expects megatron-core/deepspeed wheels in .whl/ (../shared/gpu/fetch_wheels.sh), optionally DeepEP
# sources in .deepep/ (../shared/gpu/deepep_reference.sh prepare) and an older tree in .baseline/
# (git archive <commit> | tar -x -C .baseline) for before/after rows. Logs and JSON go to $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/ep_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/megatron ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
export EP_COMMIT=${EP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
[ -d .deepep ] && export PYTHONPATH=/tmp/deepep:$PYTHONPATH

stage_build() {
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -2
  if [ -d .deepep ] && [ ! -f /tmp/deepep/.built ]; then
    (bash .deepep/deepep_reference.sh build > "$OUT/deepep_build.log" 2>&1 &)
  fi
  local t0=$(date +%s)
  # The documented offline install (no build isolation: the machine has no package index).
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  python3 -c "import ep_plugin._C as C; print('ep_plugin._C built, CUDA runtime', C.cuda_runtime_version())"
  if [ -d .baseline ]; then
    (cd .baseline && bash benchmarks/device_build.sh > "$OUT/baseline_build.log" 2>&1) || tail -5 "$OUT/baseline_build.log"
  fi
  echo "build: $(( $(date +%s) - t0 )) s"
}

stage_test() {  # the whole GPU suite (-m gpu) in one call: junit + log in $OUT, a one-screen summary
  if ! ls ep_plugin/_C*.so >/dev/null 2>&1 && ! python3 -c "import ep_plugin._C" 2>/dev/null; then
    local tb=$(date +%s)  # the fast in-place build (all files in parallel, ~20 s)
    bash benchmarks/device_build.sh > "$OUT/build.log" 2>&1 || { echo "device_build.sh failed:"; tail -15 "$OUT/build.log"; }
    echo "build: $(( $(date +%s) - tb )) s; $(grep -i nvshmem "$OUT/build.log" | tail -1)"
  fi
  echo "GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs)"
  local t0=$(date +%s)
  # SIGINT first: pytest stops, reports what ran and writes the junit file; KILL 30 s later if it hangs.
  local workers=()
  local nw=${GPU_TEST_WORKERS:-$(python3 -c "import xdist" 2>/dev/null && echo 3 || echo 1)}
  [ "$nw" -gt 1 ] && workers=(-n "$nw" --dist loadfile)
  timeout -s INT -k 30 "${TEST_TIMEOUT:-570}" python3 -m pytest -m gpu tests -p no:cacheprovider -rA --durations=30 \
    "${workers[@]}" --junitxml="$OUT/gpu_junit.xml" -k "${PYTEST_K:-}" > "$OUT/gpu_tests.log" 2>&1
  local rc=$?
  echo "gpu tests rc=$rc in $(( $(date +%s) - t0 )) s  (log $OUT/gpu_tests.log, junit $OUT/gpu_junit.xml)"
  JUNIT="$OUT/gpu_junit.xml" LOG="$OUT/gpu_tests.log" python3 - <<'PYEOF'
import collections, os, re, xml.etree.ElementTree as ET
log = open(os.environ["LOG"], errors="replace").read()
m = re.search(r"collected (\d+) items(?: / (\d+) deselected)?", log)
if m:
    print(f"collected {m.group(1)}, deselected {m.group(2) or 0}")
elif (m := re.search(r"(\d+) workers \[(\d+) items\]", log)):
    print(f"{m.group(1)} workers, {m.group(2)} tests")
if not os.path.exists(os.environ["JUNIT"]):
    print("no junit file (pytest killed?); the log's tail:")
    print("\n".join(log.splitlines()[-25:]))
    raise SystemExit
cases = list(ET.parse(os.environ["JUNIT"]).getroot().iter("testcase"))
per_file, outcome, skipped, failed = collections.Counter(), collections.Counter(), collections.Counter(), []
for c in cases:
    f = c.get("classname", "").replace(".", "/") + ".py"
    per_file[f] += float(c.get("time", 0))
    kids = {k.tag: k for k in c}
    name = f"{f}::{c.get('name')}"
    if "failure" in kids or "error" in kids:
        k = kids.get("failure", kids.get("error"))
        msg = (k.get("message") or k.text or "").strip().splitlines()
        failed.append(f"{name}: {msg[0][:150] if msg else ''}")
        outcome["failed" if "failure" in kids else "error"] += 1
    elif "skipped" in kids:
        outcome["skipped"] += 1
        skipped[(kids["skipped"].get("message") or "").replace("Skipped: ", "")[:110]] += 1
    else:
        outcome["passed"] += 1
print("  ".join(f"{k} {v}" for k, v in sorted(outcome.items())), f"(of {len(cases)} run)")
for line in failed:
    print("  FAILED", line)
for reason, n in skipped.most_common(12):
    print(f"  skipped {n:3d}: {reason}")
print("seconds per file:", ", ".join(f"{f.split('/')[-1][5:-3]} {t:.0f}" for f, t in per_file.most_common()))
print(f"sum {sum(per_file.values()):.0f} s")
PYEOF
}

stage_layer() {  # the Megatron layer at EP2: this tree and the baseline (peak memory before/after)
  for tree in "$ROOT" "$ROOT/.baseline"; do
    [ -d "$tree" ] || continue
    [ "$tree" = "$ROOT" ] || [ "${LAYER_BASELINE:-1}" = 1 ] || continue
    local name=$([ "$tree" = "$ROOT" ] && echo after || echo before)
    local t0=$(date +%s)
    (cd "$tree" && PYTHONPATH=$tree:$PYTHONPATH timeout "${LAYER_TIMEOUT:-150}" torchrun --nproc-per-node 2 \
      benchmarks/megatron_layer.py --skip-equality --out "$OUT/megatron_layer_$name.json" > "$OUT/megatron_$name.log" 2>&1)
    echo "megatron layer EP2 ($name) rc=$? in $(( $(date +%s) - t0 )) s"
    grep -E "^\[ep|peak|GiB|ms" "$OUT/megatron_$name.log" | tail -12
  done
}

stage_bench() {  # the dispatch benchmark, both protocols, DeepEP beside; then the baseline tree
  wait_deepep
  local t0=$(date +%s)
  timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_dispatch.py --out "$OUT" --label after ${BENCH_ARGS:-} \
    > "$OUT/bench_after.log" 2>&1
  echo "bench (after) rc=$? in $(( $(date +%s) - t0 )) s"; tail -30 "$OUT/bench_after.log"
  if [ -d .baseline ]; then
    t0=$(date +%s)
    PYTHONPATH=$ROOT/.baseline:$PYTHONPATH timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_dispatch.py \
      --out "$OUT" --label before ${BENCH_ARGS:-} > "$OUT/bench_before.log" 2>&1
    echo "bench (before) rc=$? in $(( $(date +%s) - t0 )) s"; tail -30 "$OUT/bench_before.log"
  fi
}

stage_ll() {  # low-latency receive hooks: a GEMM between send and hook() vs the calls in sequence (EP2)
  local t0=$(date +%s)
  timeout "${LL_TIMEOUT:-300}" python3 benchmarks/bench_ll_overlap.py --out "$OUT/bench_ll_overlap.json" ${LL_ARGS:-} \
    > "$OUT/bench_ll_overlap.log" 2>&1
  echo "ll overlap rc=$? in $(( $(date +%s) - t0 )) s"; tail -25 "$OUT/bench_ll_overlap.log"
}

wait_deepep() {
  [ -d .deepep ] || return 0
  for _ in $(seq 1 60); do [ -f /tmp/deepep/.built ] && return 0; pgrep -f deepep_reference >/dev/null || break; sleep 3; done
  [ -f /tmp/deepep/.built ] || { echo "deepep not built:"; tail -5 "$OUT/deepep_build.log" 2>/dev/null; }
}

for s in "$@"; do
  case "$s" in
    build) [ -f /tmp/ep_built ] && [ "${REBUILD:-0}" = 0 ] || { stage_build && touch /tmp/ep_built; } ;;
    test) stage_test ;;
    layer) stage_layer ;;
    bench) stage_bench ;;
    ll) stage_ll ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
