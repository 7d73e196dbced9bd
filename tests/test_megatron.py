"""megatron-core integration (ep_plugin/megatron.py) on CPU: gloo, world 2, torch backend.

For the same weights and inputs, a MoELayer whose dispatcher is ep_plugin gives the same output,
input gradient and parameter gradients as one with megatron's `alltoall` dispatcher. All
multi-process work runs in one spawn (megatron-core takes ~10 s to import per process); the
parametrized tests then check its per-case results.
"""
from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch

from tests._dist import read_rank_results, spawn, write_rank_result
from tests._need import need_installed
from tests.megatron_cases import (
    CASES, H, SCHEDULE_CASES, compare_case, compare_schedule, make_config, make_moe_layer,
)

need_installed("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "megatron", "pretrain_gpt_moe.py")


def _buffer_reuse(rank, world):
    """Forwards with different token counts (per step and per rank) share one EPBuffer per
    (group, config); a batch over comm.max_tokens_per_rank raises before any communication."""
    import ep_plugin
    import ep_plugin.buffer
    import ep_plugin.megatron as epm

    epm.clear_buffers()
    made = []
    orig_init = ep_plugin.buffer.EPBuffer.__init__

    def counting_init(self, *args, **kwargs):
        made.append(kwargs.get("hidden"))
        orig_init(self, *args, **kwargs)

    ep_plugin.buffer.EPBuffer.__init__ = counting_init
    try:
        # no YAML: the capacity is the config default, not the first batch's token count
        layers = [make_moe_layer(make_config(world, moe_token_dispatcher_type="ep_plugin")) for _ in range(2)]
        for S in (3, 7, 5, 11):
            x = torch.randn(S + 2 * rank, 2, H, requires_grad=True)
            for layer in layers:
                y, _ = layer(x)
                y.sum().backward()
        bufs = [layer.token_dispatcher.buffer for layer in layers]
        out = {"made": len(made), "shared": bufs[0] is bufs[1],
               "capacity": bufs[0].cfg.comm.max_tokens_per_rank,
               "default_capacity": ep_plugin.load_config(None).comm.max_tokens_per_rank}
        cfg = make_config(world, moe_token_dispatcher_type="ep_plugin")
        epm.attach_config(cfg, {"comm": {"max_tokens_per_rank": 16}})
        small = make_moe_layer(cfg)
        small(torch.randn(8, 2, H))  # 16 tokens: exactly the capacity
        try:
            small(torch.randn(9, 2, H))  # 18 tokens
            out["too_large"] = None
        except ValueError as exc:
            out["too_large"] = str(exc)
        small(torch.randn(4 + rank, 2, H))  # the ranks are still in step: nobody entered a collective
        out["made_total"] = len(made)
        return out
    finally:
        ep_plugin.buffer.EPBuffer.__init__ = orig_init
        epm.clear_buffers()


def _dist_body(rank, world, out_dir):
    import ep_plugin.megatron as epm
    from ep_plugin.testing import cpu_stand_ins

    cpu_stand_ins()
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    results = {}
    for name in CASES:
        try:
            results[name] = compare_case(rank, world, name)
        except Exception:  # reported per case by the parametrized test
            results[name] = {"error": traceback.format_exc()}
    for name in SCHEDULE_CASES:
        try:
            results[name] = compare_schedule(rank, world, name)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    try:
        results["buffer_reuse"] = _buffer_reuse(rank, world)
    except Exception:
        results["buffer_reuse"] = {"error": traceback.format_exc()}
    ps.destroy_model_parallel()
    epm.clear_buffers()

    # the example: a few steps of GPT-MoE pretraining, loss must fall
    try:
        sys.path.insert(0, os.path.dirname(EXAMPLE))
        import pretrain_gpt_moe

        r = pretrain_gpt_moe.main(["--steps", "12", "--no-progress", "--log-every", "100",
                                   "--micro-batch-size", "4"])
        results["example"] = {"losses": r["losses"], "backend": r["backend"], "dispatcher": r["dispatcher"]}
    except Exception:
        results["example"] = {"error": traceback.format_exc()}
    write_rank_result(out_dir, rank, results)


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("megatron")
    spawn(_dist_body, 2, str(d), timeout=240)
    return read_rank_results(d, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_alltoall(dist_results, case):
    for rank, results in enumerate(dist_results):
        r = results[case]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        if r["dtype"] == "bfloat16":  # BF16 rows and weights: summed in another order -> a few ulps
            assert max(r["rel_out"], r["rel_grad_x"], r["rel_grad_params"]) <= 2e-2, (rank, r)
            assert max(r["elem_out"], r["elem_grad_x"], r["elem_grad_params"]) <= 1.0, (rank, r)  # per element
        else:
            tol = 1e-5 * max(1.0, r["scale"])
            assert r["out"] <= tol, (rank, r)
            assert r["grad_x"] <= tol, (rank, r)
            assert r["grad_params"] <= tol, (rank, r)
        assert r["num_param_grads"] > 0
    if case.endswith("skew_rank1_receives_nothing"):
        assert dist_results[1][case]["recv_rows"] == 0
        assert dist_results[0][case]["recv_rows"] > 0
    if case.startswith("ep_experts"):  # EPGroupedMLP: the attached (default) comm.host_sync, false
        assert all(results[case]["host_sync"] is False for results in dist_results), case


@pytest.mark.parametrize("case", list(SCHEDULE_CASES))
def test_ep_overlap_schedule_matches_plain_backward(dist_results, case):
    for rank, results in enumerate(dist_results):
        r = results[case]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        assert r["num_param_grads"] > 10
        assert r["grad_params"] <= 1e-6 * max(1.0, r["scale"]), (rank, r)


def test_one_buffer_per_config_across_token_counts(dist_results):
    for rank, results in enumerate(dist_results):
        r = results["buffer_reuse"]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        assert r["made"] == 1 and r["shared"], (rank, r)
        assert r["capacity"] == r["default_capacity"], (rank, r)


def test_batch_over_capacity_raises_before_communication(dist_results):
    for rank, results in enumerate(dist_results):
        r = results["buffer_reuse"]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        assert r["too_large"] is not None, f"rank {rank}: 18 tokens over a capacity of 16 did not raise"
        assert "comm.max_tokens_per_rank=16" in r["too_large"] and "18" in r["too_large"], r["too_large"]
        assert r["made_total"] == 2, (rank, r)  # + the capacity-16 buffer, and none after the error


def test_example_pretraining_loss_falls(dist_results):
    r = dist_results[0]["example"]
    assert "error" not in r, r.get("error")
    losses = r["losses"]
    assert len(losses) == 12 and all(map(lambda v: v == v, losses))
    assert r["dispatcher"] == "ep_plugin" and r["backend"] == "torch"
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


# ------------------------------------------------------------------- single process: hooks, YAML

def test_install_uninstall_restores_megatron():
    import ep_plugin.megatron as epm
    from megatron.core.transformer.moe import moe_layer
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert epm.is_installed()
    hooked_init = moe_layer.MoELayer.__init__
    epm.uninstall()
    try:
        assert not epm.is_installed()
        assert moe_layer.MoELayer.__init__ is not hooked_init
        assert moe_layer.MoEFlexTokenDispatcher.__name__ == "MoEFlexTokenDispatcher"
        # megatron's own validation is back: it refuses the name with shared-expert overlap
        with pytest.raises(ValueError, match="moe_shared_expert_overlap"):
            TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                              moe_token_dispatcher_type="ep_plugin", moe_shared_expert_intermediate_size=8,
                              moe_shared_expert_overlap=True)
    finally:
        epm.install()
    assert epm.is_installed() and moe_layer.MoELayer.__init__ is hooked_init
    epm.install()  # idempotent
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                            moe_token_dispatcher_type="ep_plugin", moe_shared_expert_intermediate_size=8,
                            moe_shared_expert_overlap=True)
    assert cfg.moe_token_dispatcher_type == "ep_plugin"


def test_flex_backend_config_accepts_both_overlaps():
    import ep_plugin.megatron  # noqa: F401
    from megatron.core.transformer.transformer_config import TransformerConfig

    common = dict(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                  expert_model_parallel_size=2, moe_token_dispatcher_type="flex",
                  moe_flex_dispatcher_backend="ep_plugin")
    c1 = TransformerConfig(**common, moe_shared_expert_intermediate_size=8, moe_shared_expert_overlap=True)
    c2 = TransformerConfig(**common, overlap_moe_expert_parallel_comm=True, bf16=True)
    assert c1.moe_flex_dispatcher_backend == c2.moe_flex_dispatcher_backend == "ep_plugin"
    c3 = TransformerConfig(**dict(common, moe_token_dispatcher_type="ep_plugin"),
                           overlap_moe_expert_parallel_comm=True, bf16=True)
    assert c3.moe_token_dispatcher_type == "ep_plugin"


def test_config_from_yaml_deepseek():
    import ep_plugin.megatron as epm
    from megatron.core.transformer.transformer_config import TransformerConfig

    f = epm.config_from_yaml(os.path.join(ROOT, "configs", "deepseek_v3.yaml"),
                             **{"comm.backend": "torch", "overlap.shared_expert_overlap": True},
                             moe_aux_loss_coeff=0.0)
    assert f["num_moe_experts"] == 256 and f["moe_router_topk"] == 8
    assert f["moe_router_num_groups"] == 8 and f["moe_router_group_topk"] == 4
    assert f["moe_router_score_function"] == "sigmoid"
    assert f["moe_router_topk_scaling_factor"] == 2.5
    assert f["moe_router_enable_expert_bias"] is True and f["moe_router_dtype"] == "fp32"
    assert f["moe_shared_expert_overlap"] is True and f["moe_token_dispatcher_type"] == "ep_plugin"
    assert f["moe_aux_loss_coeff"] == 0.0
    assert not hasattr(epm, "get_default_config")  # config enters through attach_config only
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                            moe_shared_expert_intermediate_size=64, expert_model_parallel_size=8,
                            **f)
    assert cfg.num_moe_experts == 256
    # flex form
    f2 = epm.config_from_yaml("tiny", moe_token_dispatcher_type="flex")
    assert f2["moe_flex_dispatcher_backend"] == "ep_plugin"
    from ep_plugin.errors import ConfigError

    with pytest.raises(ConfigError):
        epm.config_from_yaml("tiny", **{"comm.backend": "pigeon"})
