#!/usr/bin/env bash
# Build ep_plugin._C in place with the same flags as setup.py, all files in parallel (the device
# machine bills by the second; `pip install -e .` compiles one file after another). Needs nvcc, g++,
# pybind11 and the Python headers. Sources: every .cu/.cpp under csrc/ (includes are relative to
# csrc/, e.g. "common/ptx.cuh"). Falls back to pip when this fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CUDA=${CUDA_HOME:-}
[ -z "$CUDA" ] && [ -x /usr/local/cuda/bin/nvcc ] && CUDA=/usr/local/cuda
[ -z "$CUDA" ] && CUDA=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
NVCC=$CUDA/bin/nvcc
SUF=$($PY -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")
PYINC=$($PY -c "import sysconfig;print(sysconfig.get_paths()['include'])")
PBINC=$($PY -c "import pybind11;print(pybind11.get_include())")
B=build/devbuild
rm -rf $B  # objects of renamed or deleted sources would be linked too
mkdir -p $B
obj() { local r=${1#csrc/}; echo "$B/${r//\//_}"; }  # csrc/nvlink/notify.cu -> $B/nvlink_notify.cu
pids=()
for f in $(find csrc -name '*.cu' | sort); do
  "$NVCC" -c "$f" -o "$(obj "$f").o" -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 \
    -Xcompiler -fPIC --expt-relaxed-constexpr -lineinfo -Icsrc & pids+=($!)
done
for f in $(find csrc -name '*.cpp' | sort); do
  g++ -c "$f" -o "$(obj "${f%.cpp}").o" -O2 -std=c++17 -fPIC -fvisibility=hidden \
    -I"$PYINC" -I"$PBINC" -I"$CUDA/include" -Icsrc & pids+=($!)
done
ok=1
for p in "${pids[@]}"; do wait "$p" || ok=0; done
if [ $ok = 1 ] && g++ -shared $B/*.o -o "ep_plugin/_C$SUF" -L"$CUDA/lib64" -lcudart_static -ldl -lrt -lpthread; then
  $PY -c "import ep_plugin._C as C; print('built ep_plugin._C, CUDA runtime', C.cuda_runtime_version())" && exit 0
fi
echo "parallel build failed; falling back to pip" >&2
$PY -m pip install --no-build-isolation -e . 2>&1 | tail -5
