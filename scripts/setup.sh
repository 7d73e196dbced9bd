#!/usr/bin/env bash
# Set up a CPU machine for ep_plugin, into the python3 that comes first on PATH (a venv, preferably:
# `python3 -m venv .venv && . .venv/bin/activate` first). Two modes:
#
#   bash scripts/setup.sh --light   what the examples run with on a CPU box: CPU torch, megatron-core
#                                   0.19.2, deepspeed 0.19.8, transformers, ep_plugin (pure Python, torch
#                                   backend). No NVSHMEM wheel, no _C compile, no triton, no pytest:
#                                   nothing that a machine without a GPU could use.
#   bash scripts/setup.sh           all of that, plus what the tests (and CI) check: pytest, pytest-xdist, the
#                                   nvidia-nvshmem-cu<major> wheel and ep_plugin._C compiled with nvcc,
#                                   NVSHMEM part included, when nvcc is found (without a GPU, a check
#                                   build: every file compiled, less optimised; setup.py says how).
#
# triton: megatron-core imports it on its way to GPTModel for one GPU-only feature (the paged
# activation stash). Where triton is not installed, a stand-in for that one module is put into
# site-packages (ep_plugin/testing/megatron_without_triton.py): triton itself is ~1 GB and runs on no CPU.
#
# Safe to run again: pip skips what is installed, and _C is rebuilt only when csrc/, setup.py or the
# NVSHMEM wheel changed (their hash is kept in build/ep_plugin_C.sha256). A line before each step says
# what it does and about how long it takes (measured on a 2-core box with a fresh venv), a line every
# 10 s while it runs, and the compile prints each file it finishes. Without --light the compile runs in the
# background while the frameworks install (it needs only nvcc, pybind11 and the NVSHMEM wheel), and the
# set-up waits for it, failing with the end of its log if it failed. `ep_plugin doctor` ends it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIGHT=0
for arg in "$@"; do
  case $arg in
    --light) LIGHT=1 ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup: unknown argument '$arg'; usage: bash scripts/setup.sh [--light]" >&2; exit 2 ;;
  esac
done
export PIP_ROOT_USER_ACTION=ignore  # pip's warning about root, once per call, in containers
STARTED=$(date +%s.%N)
NSTEPS=$([ $LIGHT = 1 ] && echo 4 || echo 5) N=0 STEP_AT=""

seconds_since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f s", b - a }'; }
# step WHAT ABOUT: the line before a step (what it does, about how long).
step() { N=$((N + 1)); STEP_AT=$(date +%s.%N); echo "setup: [$N/$NSTEPS] $1 (about $2)"; }
# step_done [NOTE]: the line after it, with its time.
step_done() { echo "setup: [$N/$NSTEPS] done in $(seconds_since "$STEP_AT")${1:+: $1}"; }
# with_heartbeat CMD...: run CMD, printing a line every 10 s while it runs (pip -q is silent meanwhile).
with_heartbeat() {
  local t0 hb rc=0
  t0=$(date +%s)
  # on stderr: a caller may capture stdout (VAR=$(with_heartbeat ...))
  ( while sleep 10; do echo "setup:       ... still at it ($(( $(date +%s) - t0 )) s)" >&2; done ) &
  hb=$!
  "$@" || rc=$?
  kill "$hb" 2>/dev/null || true
  wait "$hb" 2>/dev/null || true
  return "$rc"
}
pip_install() { with_heartbeat "$PY" -m pip install -q --disable-pip-version-check "$@"; }

"$PY" - "$LIGHT" <<'PYEOF'
import sys
light = sys.argv[1] == "1"
venv = sys.prefix != sys.base_prefix
print(f"setup: {'--light: the examples on a CPU box' if light else 'the examples, the tests and the compiled kernels'}, "
      f"into {sys.prefix} (Python {sys.version.split()[0]}{', a venv' if venv else ''})")
if not venv:
    print("setup: (not a venv: to keep it apart, `python3 -m venv .venv && . .venv/bin/activate` and run this again)")
PYEOF

# ------------------------------------------------------------------------------ 1: torch, tools, the NVSHMEM wheel
if [ $LIGHT = 1 ]; then
  step "torch 2.13.0 (CPU), numpy, PyYAML, tqdm, einops, setuptools" "35 s"
  EXTRA=()
else
  step "torch 2.13.0 (CPU), numpy, PyYAML, tqdm, einops, setuptools, pybind11, pytest, pytest-xdist, hypothesis; the NVSHMEM wheel that _C's NVSHMEM part compiles against" "40 s"
  # pytest-xdist: on a machine without CUDA the suite runs in two workers (tests/_parallel.py says why)
  # hypothesis: the call-form fuzzer (tests/test_fuzz_checks.py), which fails without it rather than skip
  EXTRA=("pybind11>=2.12" pytest pytest-xdist hypothesis)
fi
# nvidia-nvshmem-cu<major>, major = torch's CUDA major (from torch/version.py, as setup.py reads it: torch
# cannot be imported before its requirements are in), nvcc's for a CPU torch. Never when torch itself
# depends on an NVSHMEM wheel (re-pinning it would fight torch's), nor next to the other major's wheel
# (both write nvidia/nvshmem/: installing cu12 beside a cu13 torch would overwrite torch's files).
# Prints the wheel's name, or "skip: why".
nvshmem_wanted() {
  "$PY" - <<'PYEOF'
import importlib.metadata as md, importlib.util, re, shutil, subprocess
from pathlib import Path
deps = [r for r in (md.requires("torch") or []) if r.lower().startswith("nvidia-nvshmem") and "extra ==" not in r]
installed = []
for n in ("nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13"):
    try:
        md.version(n); installed.append(n)
    except md.PackageNotFoundError:
        pass
version_py = Path(list(importlib.util.find_spec("torch").submodule_search_locations)[0]) / "version.py"
m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"](\d+)\.", version_py.read_text(), re.M)
major = m and m.group(1)
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
}
# torch first and pinned: an unpinned torch would pull the CUDA build and GBs of CUDA packages.
# Two pips side by side on packages apart (one pip uses one core): torch's own files (--no-deps: ~25 CPU-s
# with their bytecode), then the NVSHMEM wheel (without --light), and the rest of the list with torch's
# requirements (sympy & co., ~30 CPU-s). Then one more pip checks the whole list (~3 s), installing whatever
# torch needs and the second pip missed (setuptools >= 77, say: before the _C compile, which runs on it).
TORCH_NEEDS=(filelock fsspec jinja2 networkx sympy typing-extensions)
NVSHMEM_NOTE=$(mktemp)
torch_then_nvshmem() {
  "$PY" -m pip install -q --disable-pip-version-check --no-deps "torch==2.13.0" || return
  [ $LIGHT = 0 ] || return 0
  local want
  want=$(nvshmem_wanted) || return
  case $want in
    skip:*) echo "no NVSHMEM wheel: ${want#skip: }" > "$NVSHMEM_NOTE" ;;
    *) "$PY" -m pip install -q --disable-pip-version-check "$want" || return; echo "$want" > "$NVSHMEM_NOTE" ;;
  esac
}
torch_then_nvshmem &
TORCH_PID=$!
pip_install numpy "packaging>=24.2" "setuptools>=64" wheel "PyYAML>=6" tqdm einops "${TORCH_NEEDS[@]}" "${EXTRA[@]}"
with_heartbeat wait "$TORCH_PID"
pip_install "torch==2.13.0" numpy "packaging>=24.2" "setuptools>=64" wheel "PyYAML>=6" tqdm einops "${EXTRA[@]}"
step_done "$(cat "$NVSHMEM_NOTE")"
rm -f "$NVSHMEM_NOTE"

# ------------------------------------------------------------------------------ the frameworks
frameworks() {
  step "deepspeed 0.19.8 (built without its ops), megatron-core 0.19.2, transformers 5.17.0" \
       "$([ $LIGHT = 1 ] && echo 45 s || echo "50 s, beside the _C compile")"
  # DeepSpeed without its compiled ops (the MoE layer needs none); it builds against the torch above.
  # Without CUDA, DeepSpeed would compile its CPU shared-memory all-reduce op when its comm starts: the
  # examples and tests turn it off (ep_plugin/testing/deepspeed_cpu.py says why), nothing builds it here.
  DS_BUILD_OPS=0 pip_install --no-build-isolation "deepspeed==0.19.8"
  # megatron-core 0.19.2 declares Python >= 3.12 but runs on 3.11; its needs are installed above.
  pip_install --no-deps --ignore-requires-python "megatron-core==0.19.2"
  # Hugging Face models for DeepSpeed AutoEP (no torch dependency); 5.23 breaks AutoEP's output recorders.
  pip_install "transformers==5.17.0"
  # megatron-core without triton: the stand-in for its one module that imports triton (see the top).
  TRITON_NOTE=$("$PY" - <<'PYEOF'
import importlib.util, shutil, sysconfig
from pathlib import Path
site = Path(sysconfig.get_paths()["purelib"])
if importlib.util.find_spec("triton") is not None:
    print("triton is installed: megatron-core uses it")
else:
    shutil.copyfile("ep_plugin/testing/megatron_without_triton.py", site / "_ep_plugin_megatron_without_triton.py")
    (site / "ep_plugin_megatron_without_triton.pth").write_text("import _ep_plugin_megatron_without_triton\n")
    print("no triton: megatron-core's paged-stash kernels stand in (GPU only)")
PYEOF
  )
  step_done "$TRITON_NOTE"
}

# ------------------------------------------------------------------------------ 2-3: _C, the frameworks
c_sources_hash() {  # what _C is built from, the NVSHMEM wheel's version included
  { find csrc -type f | LC_ALL=C sort | xargs sha256sum; sha256sum setup.py
    echo "arch=${EP_PLUGIN_CUDA_ARCH:-90} check_build=${EP_PLUGIN_CHECK_BUILD:-0}"
    "$PY" -m pip list --disable-pip-version-check 2>/dev/null | grep -i '^nvidia-nvshmem' || true; } | sha256sum | cut -d' ' -f1
}
if [ $LIGHT = 0 ]; then
  # No GPU here: nothing can run the kernels, and _C is compiled to check that every file builds (the
  # NVSHMEM part included), with less optimisation (setup.py's EP_PLUGIN_CHECK_BUILD: ~1/3 less CPU time).
  # A GPU machine gets the optimised build. An EP_PLUGIN_CHECK_BUILD of the caller's own wins.
  if [ -z "${EP_PLUGIN_CHECK_BUILD:-}" ]; then
    if ls /dev/nvidia[0-9]* >/dev/null 2>&1 || nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
      export EP_PLUGIN_CHECK_BUILD=0
    else
      export EP_PLUGIN_CHECK_BUILD=1
    fi
  fi
  C_HASH_FILE=build/ep_plugin_C.sha256
  C_HASH=$(c_sources_hash)
  if [ "${EP_PLUGIN_BUILD_C:-}" = 0 ]; then
    step "ep_plugin._C: not compiled (EP_PLUGIN_BUILD_C=0)" "0 s"; step_done
  elif [ -z "${EP_PLUGIN_BUILD_C:-}" ] && ls ep_plugin/_C*.so >/dev/null 2>&1 \
       && [ "$(cat "$C_HASH_FILE" 2>/dev/null)" = "$C_HASH" ]; then
    step "ep_plugin._C: unchanged since its last build, not recompiled" "0 s"; step_done
  elif ! command -v nvcc >/dev/null 2>&1 && [ -z "${CUDA_HOME:-}" ] && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    step "ep_plugin._C: not compiled (no nvcc: the torch backend only)" "0 s"; step_done
  else
    # The compile needs only nvcc, pybind11 and the NVSHMEM wheel, all in place now: it runs in the
    # background while the frameworks install (step 3), and the set-up waits for it before step 4.
    # Its lines start with "setup:   _C"; it fails the set-up, with the end of its log, if it fails.
    if [ "$EP_PLUGIN_CHECK_BUILD" = 1 ]; then C_KIND="a check build (no GPU here), "; else C_KIND=""; fi
    step "compiling ep_plugin._C with nvcc in the background, ${C_KIND}a line per file (full log: build/ep_plugin_C.log)" \
         "80 s on 2 cores, beside step 3"
    mkdir -p build
    rm -f "$C_HASH_FILE"
    C_STEP=$N C_AT=$STEP_AT
    # its own process group (setsid), so that a set-up that stops early stops the compilers too
    # setup.py's own lines (ep_plugin: ...) are shown; the compilers' output goes to the log.
    setsid bash -c 'set -o pipefail; "$1" setup.py build_ext --inplace 2>&1 | tee build/ep_plugin_C.log \
      | { grep --line-buffered "^ep_plugin:" || true; } | sed -u "s/^ep_plugin: /setup:   _C  /"' _ "$PY" &
    C_PID=$!
    trap 'kill -- -"$C_PID" 2>/dev/null || true' EXIT
  fi
  frameworks
  if [ -n "${C_PID:-}" ]; then
    echo "setup: [$C_STEP/$NSTEPS] waiting for the _C compile to finish (its lines go on)"
    C_RC=0
    wait "$C_PID" || C_RC=$?
    trap - EXIT
    if [ "$C_RC" = 0 ]; then
      echo "$C_HASH" > "$C_HASH_FILE"
      echo "setup: [$C_STEP/$NSTEPS] done in $(seconds_since "$C_AT"): $(ls ep_plugin/_C*.so)"
    else
      echo "setup: compiling _C failed (exit status $C_RC); the end of build/ep_plugin_C.log:" >&2
      tail -n 30 build/ep_plugin_C.log >&2
      exit 1
    fi
  fi
else
  frameworks
fi

# ------------------------------------------------------------------------------ ep_plugin itself
step "ep_plugin itself (pip install -e ., pure Python; an existing _C stays in place)" "5 s"
# _C, when wanted, was compiled above: the editable install itself compiles nothing.
EP_PLUGIN_BUILD_C=0 pip_install --no-build-isolation -e .
step_done

step "ep_plugin doctor: what this machine can run" "5 s"
with_heartbeat "$PY" -m ep_plugin doctor --no-ipc || true  # it explains errors; the set-up itself is done
step_done

SIZE=$("$PY" -c "import sys; print(sys.prefix)" | xargs du -sh 2>/dev/null | cut -f1 || echo "?")
echo "setup: done in $(seconds_since "$STARTED"); $("$PY" -c "import sys; print(sys.prefix)") holds $SIZE"
if [ $LIGHT = 1 ]; then
  echo "setup: next: torchrun --nproc-per-node 2 examples/megatron/pretrain_gpt_moe.py   (the tests and the"
  echo "setup:       compiled kernels: bash scripts/setup.sh, without --light)"
fi
