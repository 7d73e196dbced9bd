#!/usr/bin/env bash
# One device call for everything GPU outside the nvlink benchmark: build _C, the GPU tests of the
# core (layout kernel, torch backend on NCCL), Megatron and DeepSpeed, and the Megatron layer timing.
# Expects megatron-core/deepspeed wheels in .whl/ (../shared/gpu/fetch_wheels.sh). Logs go to $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ep_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
t0=$(date +%s)
# The documented offline install (no build isolation: the machine has no package index).
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
python3 -c "import ep_plugin._C as C; print('pip -e build: ep_plugin._C, CUDA runtime', C.cuda_runtime_version())"
echo "build: $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -v -rA -p no:cacheprovider -m gpu \
  tests/test_layout.py tests/test_buffer_gpu.py tests/test_megatron_gpu.py tests/test_deepspeed.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s"
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|layout kernel" "$OUT/gpu_tests.log" | head -60
if [ "${MEGATRON_BENCH:-1}" = 1 ]; then
  for n in ${MEGATRON_EP:-4 2}; do
    t0=$(date +%s)
    timeout "${BENCH_TIMEOUT:-150}" torchrun --nproc-per-node "$n" benchmarks/megatron_layer.py --skip-equality \
      --out "$OUT/megatron_layer.json" > "$OUT/megatron_ep$n.log" 2>&1
    echo "megatron layer EP$n rc=$? in $(( $(date +%s) - t0 )) s"
    grep -E "^\[ep|wrote|ms" "$OUT/megatron_ep$n.log" | tail -12
  done
fi
