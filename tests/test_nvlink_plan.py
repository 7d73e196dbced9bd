"""The nvlink planners (backends/nvlink/plan.py): SM counts and kernels for `auto`, and Megatron's
moe_flex_dispatcher_num_sms reaching comm.num_sms. CPU only: the rules, not the kernels."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from ep_plugin.backends.nvlink.plan import (AUTO_COMBINE_MIN_TOKENS, AUTO_SMS, COMBINE_MODES, plan_combine_kernel,
                                            plan_dispatch_kernel, plan_kernel_sms, plan_num_sms,
                                            plan_pull_stage_slots)
from ep_plugin.config import load_config
from ep_plugin.integrations.megatron.config import resolve_config


def test_num_sms_auto_by_world_and_batch():
    assert plan_num_sms("auto", 132, world=2, tokens=4096) == 48
    assert plan_num_sms("auto", 132, world=4, tokens=4096) == 32
    assert plan_num_sms("auto", 132, world=8, tokens=4096) == AUTO_SMS  # unmeasured at EP8
    assert plan_num_sms("auto", 132, world=2, tokens=128) == AUTO_SMS  # small batches: latency-bound
    assert plan_num_sms("auto", 60, world=2, tokens=4096) == 30  # at most half of a small GPU
    assert plan_num_sms(17, 132) == 17 and plan_num_sms(500, 132) == 132  # an int: as given, clamped


def test_combine_auto_pull_needs_sms():
    assert plan_combine_kernel("auto", 4096, 2, 48) == "pull" and plan_combine_kernel("auto", 4096, 2, 24) == "pull"
    assert plan_combine_kernel("auto", 4096, 2, 16) == "pipelined"
    assert plan_combine_kernel("auto", 4096, 4, 24) == "pull" and plan_combine_kernel("auto", 4096, 4, 32) == "pull"
    # EP4: the push kernel below 24 SMs; the pull kernel from 24 on, 48 included (its ranks start together since
    # session 16, so a late rank no longer costs it more than its delay)
    assert plan_combine_kernel("auto", 4096, 4, 16) == "pipelined" and plan_combine_kernel("auto", 4096, 4, 48) == "pull"
    assert plan_combine_kernel("auto", 4096, 8, 48) == "fused"  # unmeasured at EP8


def test_kernel_sms_caps_at_ep4_only():
    # EP4: the stage_pull dispatch on at most 24 SMs, the pull combine on at most 32; fewer SMs are kept as given
    assert plan_kernel_sms("stage_pull", 4, 48) == 24 and plan_kernel_sms("pull", 4, 48) == 32
    assert plan_kernel_sms("stage_pull", 4, 16) == 16 and plan_kernel_sms("pull", 4, 24) == 24
    for kernel in ("split", "fused", "pipelined"):  # the push combines: unmeasured past 24, as given
        assert plan_kernel_sms(kernel, 4, 48) == 48
    for world in (2, 8):
        assert plan_kernel_sms("stage_pull", world, 48) == 48 and plan_kernel_sms("pull", world, 48) == 48


def test_pull_stage_slots_by_world():
    assert plan_pull_stage_slots(2) == 5 and plan_pull_stage_slots(4) == 4 and plan_pull_stage_slots(8) == 5


@pytest.mark.parametrize("world,tokens,want", [(2, 4096, "pull"), (4, 4096, "pull"), (8, 4096, "fused"),
                                               (2, AUTO_COMBINE_MIN_TOKENS - 1, "split"), (4, 128, "split")])
def test_combine_kernel_auto(world, tokens, want):
    assert plan_combine_kernel("auto", tokens, world) == want
    assert want in COMBINE_MODES


def test_kernels_as_given_win():
    for k in ("split", "fused", "pipelined", "pull"):
        assert plan_combine_kernel(k, 128, 4) == k
    assert plan_dispatch_kernel("split", 2, 24) == "split" and plan_dispatch_kernel("fused", 4, 48) == "fused"


@pytest.mark.parametrize("world,sms,want", [(2, 8, "split"), (2, 16, "split"), (2, 24, "fused"), (2, 48, "fused"),
                                            (4, 8, "fused"), (4, 16, "fused"), (4, 24, "fused"),
                                            (4, 32, "fused"), (4, 48, "fused"), (8, 48, "fused")])
def test_dispatch_kernel_auto(world, sms, want):
    assert plan_dispatch_kernel("auto", world, sms) == want


def test_defaults_are_auto():
    comm = load_config({}).comm
    assert comm.combine_kernel == "auto" and comm.dispatch_kernel == "auto"


def test_megatron_flex_num_sms_reaches_comm():
    tc = SimpleNamespace(ep_plugin_config=None, moe_flex_dispatcher_num_sms=20)
    assert resolve_config(tc, 8, 2).comm.num_sms == 20
    tc.moe_flex_dispatcher_num_sms = None  # unset: the attached config (or the default) stands
    assert resolve_config(tc, 8, 2).comm.num_sms == load_config({}).comm.num_sms
