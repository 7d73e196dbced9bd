"""The CPU suite in two pytest-xdist workers, without anything on the command line.

The CI box has 2 cores, and one pytest process leaves one of them idle for much of the suite: while a
test runs one process (the example launches, the set-up checks, the tests in pytest's own process),
or waits (the timeout tests sleep through comm.timeout_s). Two workers, each running whole test files
(--dist loadfile: a file's module fixtures, which run its multi-process bodies in one spawn, stay in
one worker), keep both cores busy: on the 2-core box the suite went from 391 s to 312 s.

The files are handed to the workers longest first (the costs below, measured; a file not listed counts
as short), so that no long file starts last and the two workers finish together; a few long files are
split into units that share nothing costly (tests that each launch their own processes, or the world
sizes of a module fixture that spawns each world on first use), so that their halves run side by side.
xdist's own order (the files with most tests first) had the longest files start late.

Only where it helps and nothing else asked otherwise: not on a machine with CUDA (the GPU tests take
every GPU, one test at a time), not with fewer than 2 cores, not inside a worker, and not when the
command line chose (-n, --dist, --tx, -p no:xdist), asked for --pdb or only collects. `-n 0` runs the
suite in one process.
"""
import os
import re

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
    config._ep_cost_units = True
    return None


# ---------------------------------------------------------------------------- units, longest first
def _world_unit(pattern):
    """A unit per world size of a module fixture that spawns each world on first use (parts_per_world,
    or the like): the test ids carry the world first ([4-2] or [4])."""
    def unit(name):
        m = re.match(pattern, name)
        return f"world{m.group(1)}" if m else None
    return unit


# file -> name of the test (after ::) -> unit within the file, or None for the file's own unit
SPLIT = {
    "test_hierarchical.py": lambda n: ("world8" if n.startswith("test_torch_parts_at_eight_ranks")
                                       else _world_unit(r"test_torch_parts_match_reference\[(\d+)-")(n)),
    "test_buffer.py": lambda n: ("world2" if n.startswith("test_async_cached_fp8")
                                 else _world_unit(r"test_(?:contract_random_routings|gradients_match_single_process"
                                                  r"_reference)\[(\d+)")(n)),
    "test_internode_cpu.py": _world_unit(r"test_(?:timeline_marks_each_stage|hierarchical_orders_rows_from_inner"
                                         r"_sources|routing_mask_launched_under_the_rail_send)\[(\d+)-"),
    # every test launches processes of its own
    "test_example_launch.py": lambda n: n,
    "test_telemetry.py": lambda n: n if n.startswith("test_examples_print_one_stats_line_per_interval") else None,
    "test_autoep.py": lambda n: ("example" if n in ("test_example_pretrains_on_cpu", "test_example_stats_lines_cpu")
                                 else n if n == "test_bench_autoep_smoke_cpu" else None),
}


# tests that read one launch (tests/_shared_run.py) go in one unit, so that one worker runs them in turn
# (in two workers, the second would wait for the first one's launch)
JOIN = {"test_telemetry.py::test_examples_print_one_stats_line_per_interval[examples/deepspeed/train_moe_ds.py-args1]":
        "test_deepspeed_example.py"}


def unit_of(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    folder, _, file = path.rpartition("/")
    joined = JOIN.get(f"{file}::{name}")
    if joined:
        return f"{folder}/{joined}" if folder else joined
    split = SPLIT.get(file)
    part = split(name) if split else None
    return f"{path}::{part}" if part else path


# Seconds of each unit (the larger of its CPU seconds and half its wall seconds, from a run of the
# suite on the 2-core box; only their order matters). Units not listed: DEFAULT_COST.
DEFAULT_COST = 2.0
COSTS = {
    "test_compile.py": 57,
    "test_hierarchical.py::world6": 42,
    "test_fuzz_checks.py": 39,
    "test_autoep.py::test_bench_autoep_smoke_cpu": 33,
    "test_autoep.py::example": 32,
    "test_expert_major.py": 32,
    "test_telemetry.py": 29,
    "test_hierarchical.py::world8": 29,
    "test_telemetry.py::test_examples_print_one_stats_line_per_interval[examples/megatron/pretrain_gpt_moe.py-args0]": 28,
    "test_doctor.py": 26,
    "test_internode_deep_ep.py": 25,
    "test_hierarchical.py::world4": 25,
    "test_megatron_training.py": 23,
    "test_deepspeed_example.py": 23,
    "test_megatron.py": 23,
    "test_deep_ep_compat.py": 22,
    "test_buffer_errors.py": 21,
    "test_example_train_moe.py": 21,
    "test_buffer.py::world5": 21,
    "test_internode_cpu.py::world6": 21,
    "test_autoep.py": 20,
    "test_megatron_nosync.py": 19,
    "test_deepspeed.py": 16,
    "test_checks.py": 16,
    "test_buffer.py::world4": 15,
    "test_example_launch.py::test_every_problem_of_the_example_yaml_at_once": 15,
    "test_internode_cpu.py::world4": 13,
    "test_buffer.py::world3": 13,
    "test_setup_light.py": 13,
    "test_cost_model.py": 11,
    "test_torch_timeout.py": 11,
    "test_config.py": 10,
    "test_hierarchical.py::world2": 10,
    "test_buffer.py::world2": 9,
    "test_low_latency.py": 9,
    "test_spawn_rendezvous.py": 12,  # 2026-11-26, loaded box: 7.5 + 4.8 + ~3 s of mostly waiting, + the failed-rank case
    "test_example_launch.py::test_plain_python_is_told_to_use_torchrun[pretrain_gpt_moe.py]": 9,
    "test_example_launch.py::test_plain_python_is_told_to_use_torchrun[autoep_hf_moe.py]": 9,
    "test_deep_ep_low_latency.py": 9,
    "test_deep_ep_megatron.py": 8,
    "test_internode_cpu.py::world2": 7,
    "test_internode_cpu.py": 6,
    "test_example_launch.py::test_the_other_ranks_stay_quiet": 5,
    "test_example_launch.py::test_megatron_example_names_the_world_sizes_that_work": 5,
    "test_example_launch.py::test_train_moe_names_the_world_sizes_that_work": 5,
    "test_example_launch.py::test_relative_config_from_another_directory": 5,
    "test_example_launch.py::test_plain_python_is_told_to_use_torchrun[train_moe_ds.py]": 5,
    "test_example_launch.py::test_plain_python_is_told_to_use_torchrun[train_moe.py]": 4,
    "test_example_launch.py::test_missing_config_with_no_guess_names_the_presets": 4,
    "test_routing.py": 4,
    "test_gate_scan.py": 3,
}


def unit_cost(unit: str) -> float:
    return COSTS.get(unit.replace("\\", "/").split("tests/", 1)[-1], DEFAULT_COST)


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: where xdist is absent (or -p no:xdist) nothing to register
def pytest_xdist_make_scheduler(config, log):
    if not getattr(config, "_ep_cost_units", False):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class CostScheduling(LoadScopeScheduling):
        """--dist loadfile with the units above, handed out longest first."""

        _sorted = False

        def _split_scope(self, nodeid):
            return unit_of(nodeid)

        def _assign_work_unit(self, node):
            if not self._sorted:  # the queue is complete at the first assignment: order it once
                units = sorted(self.workqueue.items(), key=lambda kv: -unit_cost(kv[0]))
                self.workqueue.clear()
                self.workqueue.update(units)
                self._sorted = True
            super()._assign_work_unit(node)

    return CostScheduling(config, log)
