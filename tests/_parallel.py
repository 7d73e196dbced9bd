"""The CPU suite in two pytest-xdist workers, without anything on the command line.

The CI box has 2 cores, and one pytest process leaves one of them idle for much of the suite: while a
test runs one process (the example launches, the set-up checks, the tests in pytest's own process),
or waits (the timeout tests sleep through comm.timeout_s). Two workers, each running whole test files
(--dist loadfile: a file's module fixtures, which run its multi-process bodies in one spawn, stay in
one worker), keep both cores busy: on the 2-core box the suite went from 391 s to 312 s.

Only where it helps and nothing else asked otherwise: not on a machine with CUDA (the GPU tests take
every GPU, one test at a time), not with fewer than 2 cores, not inside a worker, and not when the
command line chose (-n, --dist, --tx, -p no:xdist), asked for --pdb or only collects. `-n 0` runs the
suite in one process.
"""
import os

import pytest

WORKERS = 2


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    opt = config.option
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return None
    if opt.numprocesses is not None or opt.dist != "no" or getattr(opt, "tx", None):
        return None
    if config.getoption("usepdb", False) or config.getoption("collectonly", False):
        return None
    import torch

    if torch.cuda.is_available() or len(os.sched_getaffinity(0)) < 2:
        return None
    opt.numprocesses, opt.dist = WORKERS, "loadfile"
    return None
