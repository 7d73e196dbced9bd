"""The DeepSpeed example trains on CPU: torchrun, 2 gloo processes, ep_plugin flag on."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests._dist import free_port

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_example_trains_on_cpu(tmp_path):
    out = tmp_path / "run.json"
    # this tree first: the example imports the ep_plugin under test, installed or not
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           os.path.join(ROOT, "examples", "deepspeed", "train_moe_ds.py"), "--steps", "30", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ep_plugin"] is True and res["world"] == 2
    losses = res["losses"]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    assert res["tokens_per_s"] > 0
