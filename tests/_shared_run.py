"""One launch of an example for several tests, whichever xdist worker they run in.

A torchrun launch of an example costs two framework start-ups (~20 CPU s on the 2-core CI box). Where
two tests check different things of the same run (the DeepSpeed example's training in
test_deepspeed_example.py, its per-interval stats lines in test_telemetry.py), the first test to ask
launches it and the other reads the same result: the run's directory, under the session's temporary
root that the xdist workers share, holds its exit status and output, behind a lock while it runs.
A launch that raised (a timeout) leaves nothing behind, so the next test launches again.
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from types import SimpleNamespace

from tests._dist import run_launch, torchrun_cmd

ROOT = Path(__file__).resolve().parents[1]

def session_dir(tmp_path_factory, name: str) -> Path:
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # popen-gwN/.. is the session's
    d = root / f"shared_{name}"
    d.mkdir(exist_ok=True)
    return d

def torchrun_once(tmp_path_factory, name: str, script: str, args, env: dict, timeout: float):
    """``torchrun --nproc-per-node 2 script *args`` (args may name {dir}, the run's directory), run once
    per session under name; returns (SimpleNamespace(returncode, stdout, stderr), directory)."""
    d = session_dir(tmp_path_factory, name)
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = d / "result.json"
        if not done.exists():
            cmd = torchrun_cmd(2, ROOT / script, *(str(a).format(dir=d) for a in args))
            proc = run_launch(cmd, cwd=ROOT, env=env, timeout=timeout)
            done.write_text(json.dumps(dict(returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)))
        res = SimpleNamespace(**json.loads(done.read_text()))
    # the "terminate called" guard (conftest.py) sees only the test that launched it: the others check too
    assert "terminate called" not in res.stdout + res.stderr, res.stderr[-3000:]
    return res, d

# 2 gloo ranks, 30 steps, a stats line every 2 steps, no bar (test_telemetry.py reads the interval from here)
DEEPSPEED_EXAMPLE_ARGS = ["--steps", "30", "--log-every", "2", "--no-progress"]

def deepspeed_example_run(tmp_path_factory):
    """examples/deepspeed/train_moe_ds.py, 2 gloo ranks, 30 steps, a stats line every 2 steps, no bar,
    JSON of the run in {dir}/run.json: test_deepspeed_example.py and test_telemetry.py read it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return torchrun_once(tmp_path_factory, "deepspeed_example", "examples/deepspeed/train_moe_ds.py",
                         [*DEEPSPEED_EXAMPLE_ARGS, "--json", "{dir}/run.json"],
                         env, timeout=240)
