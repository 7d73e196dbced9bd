#!/usr/bin/env bash
# Megatron-LM's launch path on one host with 2 GPUs, in one call: examples/megatron/pretrain_megatron_lm.py
# (megatron.training's pretrain(), NCCL, BF16, mock data) with `--moe-token-dispatcher-type ep_plugin
# --ep-plugin-config examples/megatron/gpt_moe_gpu.yaml`, 20 iterations under `timeout 150`.
# The log goes to $OUT/megatron_lm.log; prints megatron's loss lines and one summary line.
#
#   OUT=/tmp/ep_out PYTHONPATH=/tmp/site bash scripts/gpu_megatron_lm.sh
#   bash scripts/gpu_megatron_lm.sh --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend ep_plugin
#   bash scripts/gpu_megatron_lm.sh --moe-token-dispatcher-type alltoall      # megatron's own dispatcher
#
# Extra arguments go to the example (any Megatron-LM argument). ITERS (20), LIMIT (150 s), NPROC (2).
# Needs ep_plugin installed (-e, _C built) and megatron-core (with megatron/training) importable:
# /tmp/site is put on PYTHONPATH when it exists. No network.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/ep_out}
mkdir -p "$OUT"
case ":${PYTHONPATH:-}:" in
  *:/tmp/site:*) ;;
  *) [ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;;
esac
ITERS=${ITERS:-20}
LIMIT=${LIMIT:-150}
NPROC=${NPROC:-2}
LOG=$OUT/megatron_lm.log
rm -f "$LOG"

python3 - "$NPROC" <<'EOF' 2>&1 | tail -2
import importlib.metadata as md, importlib.util as iu, sys
import torch
def v(dist, mod):
    if iu.find_spec(mod) is None:
        return f"{dist} absent"
    try:
        return f"{dist} {md.version(dist)}"
    except md.PackageNotFoundError:
        return f"{dist} (no metadata)"
n = torch.cuda.device_count()
print(f"gpu_megatron_lm: python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"{n} GPUs ({torch.cuda.get_device_name(0) if n else '-'}), {v('megatron-core', 'megatron.core')}, "
      f"megatron.training {'found' if iu.find_spec('megatron.training') else 'ABSENT'}")
if n < int(sys.argv[1]):
    print(f"gpu_megatron_lm: WARNING: {n} GPUs for --nproc-per-node {sys.argv[1]}")
EOF

t0=$(date +%s)
# torchrun's workers run in sessions of their own: on SIGTERM torchrun stops them itself, so -k leaves
# it 20 s for that before timeout kills torchrun too
timeout -k 20 "$LIMIT" torchrun --nproc-per-node "$NPROC" examples/megatron/pretrain_megatron_lm.py \
  --train-iters "$ITERS" "$@" > "$LOG" 2>&1
rc=$?
dt=$(( $(date +%s) - t0 ))

# what the example says about itself (the TransformerConfig, the dispatcher, a missing package), then the losses
grep -aE "^pretrain_megatron_lm\.py:|^dispatcher:" "$LOG" | cut -c1-400
grep -aE "iteration +[0-9]+/ *[0-9]+ \|.*lm loss" "$LOG" \
  | sed -E 's/^ *\[[^]]*\] *//; s/ number of (skipped|nan) iterations: +[0-9]+ \|//g' | cut -c1-300
if [ $rc -ne 0 ]; then  # the error itself
  echo "--- rc=$rc; last error lines of $LOG:"
  grep -aE "Error|error:|Traceback|Timeout|timed out|Killed|NCCL WARN|AssertionError" "$LOG" | grep -v "^\s*$" \
    | tail -8 | cut -c1-300
  tail -5 "$LOG" | cut -c1-300
fi

python3 - "$LOG" "$rc" "$dt" "$LIMIT" "$ITERS" <<'EOF'
import re, sys
log, rc, dt, limit, iters = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
text = open(log, errors="replace").read()
rows = []
for line in text.splitlines():
    m = re.search(r"iteration +(\d+)/ *\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                  r".*?global batch size: +(\d+) \|.*?lm loss: ([\d.Ee+-]+) \|", line)
    if m:
        rows.append((int(m[1]), float(m[2]), int(m[3]), float(m[4])))
seq = re.search(r"^ +seq_length \.+ (\d+)$", text, re.M)
disp = re.search(r"^dispatcher: (.*)$", text, re.M)
what = "TIMEOUT" if rc in (124, 137) else ("OK" if rc == 0 and len(rows) >= iters else "FAILED")
parts = [f"megatron_lm: {what} rc={rc} in {dt} s (limit {limit} s)", f"{len(rows)}/{iters} iterations"]
if rows:
    parts.append(f"lm loss {rows[0][3]:.3f} -> {rows[-1][3]:.3f}")
    steady = rows[3:] if len(rows) > 4 else rows
    ms = sum(r[1] for r in steady) / len(steady)
    rate = f", {steady[0][2] * int(seq[1]) / (ms / 1e3):,.0f} tokens/s" if seq else ""
    parts.append(f"{ms:.1f} ms/iteration (iterations {steady[0][0]}-{steady[-1][0]}){rate}")
parts.append(disp[1] if disp else "dispatcher: not reported")
print(", ".join(parts))
EOF
exit $rc
