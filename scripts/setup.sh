#!/usr/bin/env bash
# Set up a CPU machine for ep_plugin's examples and tests: CPU torch, the real frameworks
# (megatron-core 0.19.2, deepspeed 0.19.8) and ep_plugin itself, with ep_plugin._C compiled when
# nvcc is found. Safe to run again: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

# torch first and pinned: an unpinned torch would pull the CUDA build and GBs of CUDA packages.
pip_install "torch==2.13.0" "numpy" "packaging>=24.2" "setuptools>=64" wheel "pybind11>=2.12" \
            "PyYAML>=6" tqdm pytest einops triton
# megatron-core 0.19.2 declares Python >= 3.12 but runs on 3.11; its needs are installed above.
pip_install --no-deps --ignore-requires-python "megatron-core==0.19.2"
# DeepSpeed without its compiled ops (the MoE layer needs none); it builds against the torch above.
DS_BUILD_OPS=0 pip_install --no-build-isolation "deepspeed==0.19.8"
pip_install --no-build-isolation -e .
"$PY" - <<'PY'
import ep_plugin, ep_plugin._ext as ext
print("ep_plugin", "with _C (CUDA runtime %d)" % ext.get_c().cuda_runtime_version() if ext.has_c() else "pure Python (no nvcc: torch backend only)")
PY
