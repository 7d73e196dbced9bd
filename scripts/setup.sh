#!/usr/bin/env bash
# Set up a CPU machine for ep_plugin's examples and tests: CPU torch, the real frameworks
# (megatron-core 0.19.2, deepspeed 0.19.8), the NVSHMEM wheel matching the CUDA major, and
# ep_plugin itself, with ep_plugin._C compiled when nvcc is found. Safe to run again: pip skips what
# is already installed, and _C is rebuilt only when csrc/, setup.py or the NVSHMEM wheel changed
# (their hash is kept in build/ep_plugin_C.sha256). One line per step, with its time;
# `ep_plugin doctor` ends it: what this machine can run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore  # pip's warning about root, once per call, in containers
STARTED=$(date +%s.%N) STEP="" STEP_AT="" PINNED=""
pip_install() {
  for arg in "$@"; do case $arg in *==*) PINNED="$PINNED ${arg}" ;; esac; done
  "$PY" -m pip install -q --disable-pip-version-check "$@"
}
seconds_since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%6.1f s", b - a }'; }
# step NAME: print the step that ends (name, the pinned packages it installed, its time), start NAME.
step() {
  [ -n "$STEP" ] && printf 'setup: %-76s %s\n' "$STEP${PINNED:+ (${PINNED# })}" "$(seconds_since "$STEP_AT")"
  STEP=$1 STEP_AT=$(date +%s.%N) PINNED=""
}

step "torch (CPU) and build tools"
# torch first and pinned: an unpinned torch would pull the CUDA build and GBs of CUDA packages.
pip_install "torch==2.13.0" "numpy" "packaging>=24.2" "setuptools>=64" wheel "pybind11>=2.12" \
            "PyYAML>=6" tqdm pytest einops triton
step "frameworks"
# megatron-core 0.19.2 declares Python >= 3.12 but runs on 3.11; its needs are installed above.
pip_install --no-deps --ignore-requires-python "megatron-core==0.19.2"
# DeepSpeed without its compiled ops (the MoE layer needs none); it builds against the torch above.
DS_BUILD_OPS=0 pip_install --no-build-isolation "deepspeed==0.19.8"
# Hugging Face models for DeepSpeed AutoEP (no torch dependency); 5.23 breaks AutoEP's output recorders.
pip_install "transformers==5.17.0"
step "NVSHMEM wheel"
# The nvidia-nvshmem-cu<major> wheel that _C's NVSHMEM part compiles against (so CI compiles it on
# every run): major is torch's CUDA major, nvcc's for a CPU torch. Never when torch itself depends on
# an NVSHMEM wheel (re-pinning it would fight torch's), nor next to the other major's wheel (both
# write nvidia/nvshmem/: installing cu12 beside a cu13 torch would overwrite torch's files).
NVSHMEM_WANT=$("$PY" - <<'PYEOF'
import importlib.metadata as md, re, shutil, subprocess
import torch
deps = [r for r in (md.requires("torch") or []) if r.lower().startswith("nvidia-nvshmem") and "extra ==" not in r]
installed = []
for n in ("nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13"):
    try:
        md.version(n); installed.append(n)
    except md.PackageNotFoundError:
        pass
major = torch.version.cuda and torch.version.cuda.split(".")[0]
nvcc = shutil.which("nvcc")
if not major and nvcc:
    m = re.search(r"release (\d+)\.", subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout)
    major = m and m.group(1)
want = f"nvidia-nvshmem-cu{major}"
if deps:
    print(f"skip: torch depends on {deps[0].split(';')[0]}")
elif not major:
    print("skip: CPU torch and no nvcc")
elif [n for n in installed if n != want]:
    print(f"skip: {', '.join(n for n in installed if n != want)} is installed; {want} would overwrite its files")
else:
    print(want)
PYEOF
)
case $NVSHMEM_WANT in
  skip:*) STEP="NVSHMEM wheel (not installed: ${NVSHMEM_WANT#skip: })" ;;
  *) pip_install "$NVSHMEM_WANT"; STEP="NVSHMEM wheel ($NVSHMEM_WANT)" ;;
esac
step "ep_plugin"
# What _C is built from; the same hash as at its last build means the .so beside the sources is current.
# The NVSHMEM wheel's version counts too: installing or changing it changes what setup.py builds.
c_sources_hash() {
  { find csrc -type f | LC_ALL=C sort | xargs sha256sum; sha256sum setup.py
    echo "arch=${EP_PLUGIN_CUDA_ARCH:-90}"
    "$PY" -m pip list --disable-pip-version-check 2>/dev/null | grep -i '^nvidia-nvshmem' || true; } | sha256sum | cut -d' ' -f1
}
C_HASH_FILE=build/ep_plugin_C.sha256
C_HASH=$(c_sources_hash)
if [ -z "${EP_PLUGIN_BUILD_C:-}" ] && ls ep_plugin/_C*.so >/dev/null 2>&1 \
   && [ "$(cat "$C_HASH_FILE" 2>/dev/null)" = "$C_HASH" ]; then
  EP_PLUGIN_BUILD_C=0 pip_install --no-build-isolation -e .
  STEP="ep_plugin (_C unchanged since its build: not rebuilt)"
else
  mkdir -p build && touch build/.ep_plugin_install_started
  pip_install --no-build-isolation -e .
  if [ -n "$(find ep_plugin -maxdepth 1 -name '_C*.so' -newer build/.ep_plugin_install_started)" ]; then
    echo "$C_HASH" > "$C_HASH_FILE"
    STEP="ep_plugin (_C compiled)"
  else
    STEP="ep_plugin (_C not compiled: no nvcc, or EP_PLUGIN_BUILD_C=0)"
  fi
fi
step "ep_plugin doctor"
"$PY" -m ep_plugin doctor --no-ipc || true  # it explains errors; the set-up itself is done
step ""
printf 'setup: %-76s %s\n' "done" "$(seconds_since "$STARTED")"
