"""A framework that speaks DeepEP, unchanged, on ep_plugin: megatron-core's flex dispatcher with
moe_flex_dispatcher_backend="deepep" (its fused_a2a.py imports `deep_ep`) resolved to ep_plugin.deep_ep,
against megatron's own alltoall dispatcher on the same MoE layer: on CPU (gloo, torch backend), and
on 2 GPUs (NCCL, the nvlink backend under ep_plugin.deep_ep)."""
import importlib
import sys

import pytest
import torch

from tests._dist import spawn
from tests._need import need_installed
from tests.megatron_cases import make_config, make_moe_layer

need_installed("megatron.core")  # as the other megatron modules: a machine without it skips, not fails in its ranks


def _megatron_on_our_deep_ep():
    """install() before megatron looks for `deep_ep`. megatron is imported already in this process
    (the test helpers import it), so its fused_a2a is re-imported and the three names the token
    dispatcher took from it are re-bound: what a fresh process gets by calling install() first."""
    import ep_plugin.deep_ep as ours

    ours.install()
    import megatron.core.transformer.moe.token_dispatcher as td
    from megatron.core.transformer.moe import fused_a2a

    if not fused_a2a.HAVE_DEEP_EP:
        importlib.reload(fused_a2a)
        for name in ("fused_dispatch", "fused_combine", "set_deepep_num_sms"):
            setattr(td, name, getattr(fused_a2a, name))

    assert fused_a2a.HAVE_DEEP_EP and fused_a2a.Buffer is ours.Buffer
    return fused_a2a


def body(rank, world, device="cpu"):
    if device == "cpu":
        from ep_plugin.testing import cpu_stand_ins

        cpu_stand_ins()
        torch.set_num_threads(1)
    fused_a2a = _megatron_on_our_deep_ep()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    ref = make_moe_layer(make_config(world, moe_token_dispatcher_type="alltoall"))
    ours = make_moe_layer(make_config(world, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
                                      moe_router_dtype="fp32"))
    assert type(ours.token_dispatcher).__name__ == "MoEFlexTokenDispatcher", type(ours.token_dispatcher)
    # on GPUs the layer runs in BF16, as DeepEP (and the nvlink backend under it) moves BF16 rows
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    ref, ours = ref.to(device, dtype), ours.to(device, dtype)
    with torch.no_grad():
        g = torch.Generator().manual_seed(100 + rank)
        for n, p in ref.named_parameters():
            if ".experts." in n:
                p.add_((torch.randn(p.shape, generator=g) * 0.1).to(device, dtype))
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and all("_extra_state" in m for m in missing), (missing, unexpected)
    S = 5 + 3 * rank
    g = torch.Generator().manual_seed(1000 + rank)
    x0 = torch.randn(S, 2, ref.config.hidden_size, generator=g).to(device, dtype)
    w = torch.randn(S, 2, ref.config.hidden_size, generator=g).to(device, dtype)
    got = {}
    for tag, layer in (("ref", ref), ("ours", ours)):
        x = x0.clone().requires_grad_()
        y, _ = layer(x)
        (y * w).sum().backward()
        got[tag] = (y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
    (y0, gx0, gp0), (y1, gx1, gp1) = got["ref"], got["ours"]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)  # BF16 sums
    torch.testing.assert_close(y1, y0, **tol)
    torch.testing.assert_close(gx1, gx0, **tol)
    assert set(gp0) == set(gp1)
    for n in gp0:
        torch.testing.assert_close(gp1[n], gp0[n], msg=n, **tol)
    assert isinstance(fused_a2a._buffer, sys.modules["ep_plugin.deep_ep"].Buffer)
    fused_a2a._buffer.destroy()
    ps.destroy_model_parallel()


def test_megatron_flex_deepep_backend_runs_on_ep_plugin():
    spawn(body, 2, timeout=240)


@pytest.mark.gpu
def test_megatron_flex_deepep_backend_runs_on_ep_plugin_gpu():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    spawn(body, 2, "cuda", backend="nccl", timeout=240)
