"""The main job runs: two gloo processes train the example MoE model and the loss falls."""
import os
import re
import subprocess
import sys
from pathlib import Path

from tests._dist import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_train_moe_example_loss_falls():
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), str(ROOT / "examples" / "train_moe.py"), "--steps", "60"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    m = re.search(r"loss ([\d.]+) -> ([\d.]+)", out.stdout)
    assert m, out.stdout[-2000:]
    first, last = map(float, m.groups())
    print(out.stdout.strip().splitlines()[-1])
    assert last < first - 1.0, (first, last)
