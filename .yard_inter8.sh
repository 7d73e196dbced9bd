#!/usr/bin/env bash
# inter8 (issue 30, the 2x2 combine's extra passes), one device call on 4 GPUs (4x H200 or H100), from the root of
# a copy of branch inter8 with $OUT set; <= ~200 s. What it runs:
#  1. build _C (the nvlink combine kernels take a row index and write to other buffers; the rail combine reads
#     through a row index or only signals);
#  2. the internode GPU tests against the reference at 2x2 (4 GPUs: the new combine path, placed rows);
#  3. 2x2 bench, nvshmem beside flat nvlink, this tree's combine path then --combine-path before (same machine);
#  4. 2x1 bench (GPUs 0,1) now / before  ||  the internode GPU tests at 2x1 (GPUs 2,3).
# Every step has its own timeout; a step that would run past ~195 s is skipped and says so.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export NVSHMEM_SYMMETRIC_SIZE=4294967296
export EP_TEST_STACK_DUMP_S=${EP_TEST_STACK_DUMP_S:-60}
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
OUT=${OUT:-/tmp/inter8_out}; mkdir -p $OUT
L=$OUT/inter8.log; say() { echo "[$(el)s] $*" | tee -a $L; }
W=$OUT/work; mkdir -p $W/bench
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | tee -a $L
git rev-parse --short HEAD 2>/dev/null | tee -a $L
bash benchmarks/device_build.sh > $W/build.log 2>&1 || tail -20 $W/build.log | tee -a $L
say "built: $(python3 -c 'import ep_plugin._C as C; print("nvshmem", C.HAS_NVSHMEM)' 2>&1 | tail -1)"
export PYTHONPATH=$PWD
left() { echo $(( 195 - $(el) )); }  # seconds left of the budget
tests() { # label gpus limit -k
  local lim=$3; [ $(left) -lt $lim ] && lim=$(left); [ $lim -lt 20 ] && { say "tests $1 skipped (time)"; return; }
  CUDA_VISIBLE_DEVICES=$2 timeout -k 5 $lim python3 -m pytest -q -rA -p no:cacheprovider -m gpu \
    tests/test_internode_gpu.py -k "$4" > $W/tests_$1.log 2>&1
  say "tests $1 rc=$?: $(grep -E 'passed|failed' $W/tests_$1.log | tail -1)"
  grep -E "^(PASSED|FAILED|ERROR)" $W/tests_$1.log | cut -c1-160 >> $L
  grep -qE "^(FAILED|ERROR)" $W/tests_$1.log && tail -60 $W/tests_$1.log >> $L
}
bench() { # label world rpn gpus backends combine_path limit
  local lim=$7; [ $(left) -lt $lim ] && lim=$(left); [ $lim -lt 15 ] && { say "bench $1 skipped (time)"; return; }
  CUDA_VISIBLE_DEVICES=$4 timeout -k 3 $lim python3 benchmarks/bench_internode.py --world $2 --ranks-per-node $3 \
    --backends $5 --cases uniform --iters 30 --timeline 5 --timeout $(( lim - 5 )) --combine-path $6 \
    --out $W/bench --label $1 > $W/bench_$1.log 2>&1
  say "bench $1 rc=$?"; grep -vE "^\s*$|Warning|warn|json:" $W/bench_$1.log | tail -12 >> $L
}
tests 2x2 0,1,2,3 60 2x2
bench 2x2_now 4 2 0,1,2,3 nvshmem,nvlink now 35
bench 2x2_before 4 2 0,1,2,3 nvshmem,nvlink before 35
( bench 2x1_now 2 1 0,1 nvshmem,nvlink now 25; bench 2x1_before 2 1 0,1 nvshmem before 22 ) &
bp=$!
tests 2x1 2,3 50 2x1
wait $bp
cp $W/bench/*.json $OUT/ 2>/dev/null
cd $W && tar czf $OUT/inter8.tgz *.log bench 2>/dev/null; say done
