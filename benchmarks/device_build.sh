#!/usr/bin/env bash
# Build ep_plugin._C in place with the same flags as setup.py, all files in parallel (the device
# machine bills by the second; `pip install -e .` compiles one file after another). Needs nvcc, g++,
# pybind11 and the Python headers. Sources: every .cu/.cpp under csrc/ (includes are relative to
# csrc/, e.g. "common/ptx.cuh"). Falls back to pip when this fails. With the nvidia-nvshmem wheel
# matching torch's CUDA major installed, csrc/nvshmem/ is compiled with -rdc and device-linked with
# libnvshmem_device into one object, as setup.py does; otherwise one line says why it is skipped.
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
# The wheel's lib dir when it matches torch's CUDA major (nvcc's for a CPU torch), as in setup.py's
# find_nvshmem; else "skip: <reason>". EP_PLUGIN_WITH_NVSHMEM=0 skips it.
SHMEM=$(EP_NVCC="$NVCC" $PY - <<'PYEOF'
import importlib.metadata as md, importlib.util as iu, os, re, subprocess
from pathlib import Path
def main():
    if os.environ.get("EP_PLUGIN_WITH_NVSHMEM", "").lower() in ("0", "false", "no", "off"):
        return "skip: EP_PLUGIN_WITH_NVSHMEM=0"
    try:
        import torch
        cuda = torch.version.cuda
    except ImportError:
        cuda = None
    if not cuda:
        m = re.search(r"release (\d+)\.", subprocess.run([os.environ["EP_NVCC"], "--version"], capture_output=True, text=True).stdout)
        cuda = m and m.group(1)
    major = int(str(cuda).split(".")[0]) if cuda else None
    wheels = [m for m in (12, 13) if iu.find_spec("nvidia") and _has(f"nvidia-nvshmem-cu{m}")]
    spec = iu.find_spec("nvidia.nvshmem") if iu.find_spec("nvidia") else None
    if spec is None or wheels == []:
        return f"skip: no nvidia-nvshmem wheel is installed (pip install nvidia-nvshmem-cu{major})"
    if wheels != [major]:
        return f"skip: nvidia-nvshmem wheel(s) cu{wheels} do not match CUDA {major}"
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
    return str(lib) if (lib / "libnvshmem_host.so.3").exists() else f"skip: {lib}/libnvshmem_host.so.3 is missing"
def _has(name):
    try:
        return bool(md.version(name))
    except md.PackageNotFoundError:
        return False
print(main())
PYEOF
)
if [ "${SHMEM#skip: }" != "$SHMEM" ]; then
  echo "ep_plugin: building _C without NVSHMEM: ${SHMEM#skip: }"; SHMEM=""
fi
B=build/devbuild
rm -rf $B  # objects of renamed or deleted sources would be linked too
mkdir -p $B
obj() { local r=${1#csrc/}; echo "$B/${r//\//_}"; }  # csrc/nvlink/notify.cu -> $B/nvlink_notify.cu
GENCODE=-gencode=arch=compute_90,code=sm_90
pids=() rdc=() defs=()
for f in $(find csrc -name '*.cu' ! -path 'csrc/nvshmem/*' | sort); do
  "$NVCC" -c "$f" -o "$(obj "$f").o" -O3 -std=c++17 $GENCODE \
    -Xcompiler -fPIC --expt-relaxed-constexpr -lineinfo -Icsrc & pids+=($!)
done
if [ -n "$SHMEM" ]; then  # relocatable device code: NVSHMEM's device API is a static library
  for f in $(find csrc/nvshmem -name '*.cu' | sort); do
    "$NVCC" -c "$f" -o "$(obj "$f").o" -O3 -std=c++17 $GENCODE -rdc=true -I"$SHMEM/../include" \
      -Xcompiler -fPIC --expt-relaxed-constexpr -lineinfo -Icsrc & pids+=($!); rdc+=("$(obj "$f").o")
  done
  defs=(-DEP_WITH_NVSHMEM=1)
fi
for f in $(find csrc -name '*.cpp' | sort); do
  [ -z "$SHMEM" ] && [ "$f" = csrc/python/nvshmem.cpp ] && continue  # its bindings need the NVSHMEM part
  g++ -c "$f" -o "$(obj "${f%.cpp}").o" -O2 -std=c++17 -fPIC -fvisibility=hidden "${defs[@]}" \
    -I"$PYINC" -I"$PBINC" -I"$CUDA/include" -Icsrc & pids+=($!)
done
ok=1
for p in "${pids[@]}"; do wait "$p" || ok=0; done
extra=()
if [ $ok = 1 ] && [ -n "$SHMEM" ]; then
  # one device-link unit for all -rdc objects + libnvshmem_device: NVSHMEM's device state exists once
  "$NVCC" -dlink "${rdc[@]}" -o $B/nvshmem_dlink.o $GENCODE -Xcompiler -fPIC -L"$SHMEM" -lnvshmem_device || ok=0
  # the wheel has libnvshmem_host.so.3 only (no .so for -l); rpaths as in setup.py
  extra=("$SHMEM/libnvshmem_device.a" "$SHMEM/libnvshmem_host.so.3"
         '-Wl,-rpath,$ORIGIN/../nvidia/nvshmem/lib' "-Wl,-rpath,$SHMEM")
fi
if [ $ok = 1 ] && g++ -shared $B/*.o "${extra[@]}" -o "ep_plugin/_C$SUF" -L"$CUDA/lib64" -lcudart_static -ldl -lrt -lpthread; then
  $PY -c "import ep_plugin._C as C; print('built ep_plugin._C, CUDA runtime', C.cuda_runtime_version(), 'NVSHMEM', C.HAS_NVSHMEM)" && exit 0
fi
echo "parallel build failed; falling back to pip" >&2
$PY -m pip install --no-build-isolation -e . 2>&1 | tail -5
