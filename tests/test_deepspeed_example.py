"""The DeepSpeed example trains on CPU: torchrun, 2 gloo processes, ep_plugin flag on."""
from __future__ import annotations

import json

from tests._need import need_installed
from tests._shared_run import deepspeed_example_run

need_installed("deepspeed")


def test_example_trains_on_cpu(tmp_path_factory):
    # this tree first: the example imports the ep_plugin under test, installed or not (one run with
    # test_telemetry.py's stats-line test: tests/_shared_run.py)
    proc, d = deepspeed_example_run(tmp_path_factory)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((d / "run.json").read_text())
    assert res["ep_plugin"] is True and res["world"] == 2
    losses = res["losses"]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    assert res["tokens_per_s"] > 0
