"""No host sync inside a Megatron MoE layer: ep_plugin's dispatcher + EPGroupedMLP (CPU, gloo, world 2).

With EPGroupedMLP as the experts, the dispatcher hands them the expert-major rows and
tokens_per_expert on the device (comm.host_sync false, the default), and neither reads a count on
the host. CPU tensors cannot show a CUDA sync, so the check patches every Python-level host read
(Tensor.tolist/item/cpu/..., torch.cuda.synchronize) to raise inside the dispatcher's hooks and the
experts' forward (tests/megatron_cases.forbid_host_sync); the torch backend's own exchange, which
reads counts on the host by design, is exempt (test_megatron_gpu.py runs the same check with CUDA's
sync debug mode on the kernel backend, where nothing is exempt). Equality with alltoall + megatron's
experts is in tests/megatron_cases.py (the ep_experts* cases, run by test_megatron.py).
"""
from __future__ import annotations

import traceback

import pytest
import torch

from tests._dist import read_rank_results, spawn, write_rank_result
from tests._need import need_installed
from tests.megatron_cases import (
    H, HostSyncError, cpu_recompute_stand_ins, forbid_host_sync, grouped_layout, make_config, make_moe_layer,
)

need_installed("megatron.core")

CAP = 32  # comm.max_tokens_per_rank


def _layer(world, experts, **kw):
    import ep_plugin.megatron as epm

    kw.setdefault("moe_token_dispatcher_type", "ep_plugin")
    cfg = make_config(world, **kw)
    epm.attach_config(cfg, {"comm": {"backend": "torch", "max_tokens_per_rank": CAP}})
    layer = make_moe_layer(cfg, experts=experts)
    with torch.no_grad():
        g = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
        for n, p in layer.named_parameters():
            if "experts" in n and "shared" not in n:  # experts differ per rank
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return layer


def _guarded_forward(layer, S, rank):
    """A warm-up forward (it builds the EPBuffer: collectives, once), then forwards under
    forbid_host_sync with other token counts; backward outside it. -> what was caught, the outputs."""
    x = torch.randn(S + rank, 2, H, requires_grad=True)  # a reentrant checkpoint needs an input grad
    layer(x)[0].sum().backward()
    caught, outs = [], []
    for s in (S + 2 * rank, S + 3 - rank):
        x = torch.randn(s, 2, H, requires_grad=True)
        try:
            with forbid_host_sync(layer, exempt_buffer=True) as c:
                y, _ = layer(x)
        except HostSyncError:
            y = None
        caught += c
        if y is not None:
            with torch.no_grad():
                y_free, _ = layer(x)  # the same forward, unguarded
            y.sum().backward()
            outs.append(((y - y_free).abs().max().item(), bool(torch.isfinite(x.grad).all())))
    return caught, outs


def _guard(rank, world):
    out = {}
    for form, kw in (("by_name", {}),
                     ("flex", dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ep_plugin")),
                     ("probs_on_input", dict(moe_router_topk=1, moe_apply_probs_on_input=True,
                                             moe_router_pre_softmax=True)),
                     ("recompute_act", dict(recompute_granularity="selective", recompute_modules=["moe_act"],
                                            moe_grouped_gemm=True)),
                     ("recompute_layer", dict(recompute_granularity="selective", recompute_modules=["moe"])),
                     ("shared_overlap", dict(moe_shared_expert_intermediate_size=12, moe_shared_expert_overlap=True))):
        try:
            layer = _layer(world, "ep", **kw)
            caught, outs = _guarded_forward(layer, 5, rank)
            d = layer.token_dispatcher
            out[form] = {"caught": caught, "outs": outs, "device_counts": d.device_counts,
                         "fed": layer.experts.fed_device_counts, "host_sync": d.buffer.cfg.comm.host_sync,
                         "counts_type": type(d.tokens_per_expert).__name__}
        except Exception:
            out[form] = {"error": traceback.format_exc()}
    # the control: megatron's experts need host counts, and the guard sees them read
    for experts in ("grouped", None):
        layer = _layer(world, experts, moe_router_topk=3)
        caught, outs = _guarded_forward(layer, 5, rank)
        out[f"control_{experts or 'sequential'}"] = {
            "caught": caught, "outs": outs, "device_counts": layer.token_dispatcher.device_counts,
            "host_sync": layer.token_dispatcher.buffer.cfg.comm.host_sync}
    return out


def _tail(rank, world):
    """EPGroupedMLP on worst-case rows: the rows past the counts are NaN (a kernel backend leaves them
    unwritten); the output there is zero, the valid rows and all gradients are those of the exact rows."""
    from ep_plugin.megatron import GroupedMMLinear

    out = {}
    for name, kw in (("swiglu", dict(moe_router_topk=3)),
                     ("probs_on_input", dict(moe_router_topk=1, moe_apply_probs_on_input=True,
                                             moe_router_pre_softmax=True)),
                     ("gelu", dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu))):
        experts = _layer(world, "ep", **kw).experts
        G = experts.num_local_experts
        g = torch.Generator().manual_seed(5)
        counts = torch.tensor([3, 0, 5, 2][:G], dtype=torch.int64)
        n, pad = int(counts.sum()), 7
        x = torch.randn(n, H, generator=g)
        probs = torch.rand(n, generator=g)
        gy = torch.randn(n, H, generator=g)
        nan = float("nan")
        res = {}
        for tag, rows, p, grad in (
                ("exact", x, probs, gy),
                ("worst", torch.cat([x, torch.full((pad, H), nan)]), torch.cat([probs, torch.full((pad,), nan)]),
                 torch.cat([gy, torch.randn(pad, H, generator=g)]))):
            experts.zero_grad(set_to_none=True)
            rows = rows.clone().requires_grad_()
            p = p.clone().requires_grad_()
            with forbid_host_sync(experts, exempt_buffer=False) as caught:
                y, bias = experts(rows, counts, p)
            assert not caught and bias is None
            (y * grad).sum().backward()
            res[tag] = (y.detach(), rows.grad[:n], p.grad[:n],
                        {k: v.grad.clone() for k, v in experts.named_parameters()})
        (y0, gx0, gp0, gw0), (y1, gx1, gp1, gw1) = res["exact"], res["worst"]
        out[name] = {
            "valid": (y0 - y1[:n]).abs().max().item(),
            "tail_zero": bool((y1[n:] == 0).all()),
            "grad_x": (gx0 - gx1).abs().max().item(),
            "grad_probs": (gp0 - gp1).abs().max().item(),
            "grad_w": max((gw0[k] - gw1[k]).abs().max().item() for k in gw0),
            "grads_finite": all(bool(torch.isfinite(v).all()) for v in gw1.values()),
            "impl": GroupedMMLinear.impl,
        }
    return out


def _pairing(rank, world):
    """EPGroupedMLP under megatron's alltoall dispatcher: no ep_plugin dispatcher to take its counts
    from, it takes alltoall's exact rows and counts, and equals alltoall + SequentialMLP."""
    ref = make_moe_layer(make_config(world, moe_token_dispatcher_type="alltoall", moe_router_topk=3))
    ours = make_moe_layer(make_config(world, moe_token_dispatcher_type="alltoall", moe_router_topk=3), experts="ep")
    with torch.no_grad():
        g = torch.Generator().manual_seed(100 + rank)
        for n, p in ref.named_parameters():
            if "experts" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    G = ours.experts.num_local_experts
    ours.load_state_dict(grouped_layout(ref.state_dict(), G), strict=False)
    x0 = torch.randn(6 + rank, 2, H, generator=torch.Generator().manual_seed(rank))
    got = []
    for layer in (ref, ours):
        x = x0.clone().requires_grad_()
        y, _ = layer(x)
        y.square().sum().backward()
        got.append((y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}))
    (y0, gx0, gp0), (y1, gx1, gp1) = got
    gp0 = grouped_layout(gp0, G)
    return {"fed": ours.experts.fed_device_counts, "out": (y0 - y1).abs().max().item(),
            "grad_x": (gx0 - gx1).abs().max().item(),
            "grad_params": max((gp0[n] - gp1[n]).abs().max().item() for n in gp1),
            "same_params": sorted(gp0) == sorted(gp1)}


def _compiled(rank, world):
    """torch.compile(fullgraph=True) without capture_scalar_outputs: a host read anywhere in the
    dispatcher's or the experts' compiled code would be a graph break, which fullgraph refuses."""
    import torch._dynamo as dynamo

    import ep_plugin.megatron as epm

    layer = _layer(world, "ep", moe_router_topk=3)
    dynamo.config.disable = False  # cpu_stand_ins() turned dynamo off for the rest of this process
    try:
        with dynamo.config.patch(capture_scalar_outputs=False):
            comp = torch.compile(layer, fullgraph=True, backend="aot_eager")
            diffs = {"out": 0.0, "grad_x": 0.0, "grad_params": 0.0}
            for step, S in enumerate((5 + 3 * rank, 3 + rank)):
                g = torch.Generator().manual_seed(1000 * step + rank)
                x0, gout = torch.randn(S, 2, H, generator=g), torch.randn(S, 2, H, generator=g)
                got = []
                for run in ("eager", "compiled"):
                    layer.zero_grad(set_to_none=True)
                    x = x0.clone().requires_grad_()
                    if run == "eager":
                        with torch.compiler.set_stance("force_eager"):
                            y, _ = layer(x)
                    else:
                        y, _ = comp(x)
                    (y * gout).sum().backward()
                    got.append((y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()
                                                     if p.grad is not None}))
                (y0, gx0, gp0), (y1, gx1, gp1) = got
                diffs["out"] = max(diffs["out"], (y0 - y1).abs().max().item())
                diffs["grad_x"] = max(diffs["grad_x"], (gx0 - gx1).abs().max().item())
                diffs["grad_params"] = max(diffs["grad_params"],
                                           max((gp0[n] - gp1[n]).abs().max().item() for n in gp0))
        diffs["buffers"] = sorted((b.backend_name, b.cfg.comm.host_sync) for b in epm.cached_buffers())
        return diffs
    finally:
        dynamo.config.disable = True
        dynamo.reset()


def _dist_body(rank, world, out_dir):
    import torch._dynamo.trace_rules as trace_rules

    import ep_plugin.megatron as epm
    from ep_plugin.testing import cpu_stand_ins

    # dynamo maps torch functions to rules by the objects it finds at their names when it first builds
    # the map: build it before cpu_stand_ins() puts a lambda at torch.cuda.current_device, or dynamo
    # takes that lambda for the torch function and breaks the graph at megatron's router
    trace_rules.get_torch_obj_rule_map()
    cpu_stand_ins()
    cpu_recompute_stand_ins()
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    results = {}
    for name, fn in (("guard", _guard), ("tail", _tail), ("pairing", _pairing), ("compiled", _compiled)):
        try:
            results[name] = fn(rank, world)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        epm.clear_buffers()
    ps.destroy_model_parallel()
    write_rank_result(out_dir, rank, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("megatron_nosync")
    spawn(_dist_body, 2, str(d), timeout=300)
    return read_rank_results(d, 2)


def _get(results, rank, name):
    r = results[rank][name]
    assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return r


@pytest.mark.parametrize("form", ["by_name", "flex", "probs_on_input", "recompute_act", "recompute_layer",
                                  "shared_overlap"])
def test_layer_forward_reads_nothing_on_the_host(results, form):
    for rank in range(2):
        r = _get(results, rank, "guard")[form]
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["caught"] == [], (rank, "".join(r["caught"]))
        assert r["device_counts"] and r["fed"], (rank, r)
        assert r["host_sync"] is False and r["counts_type"] == "Tensor", (rank, r)
        assert len(r["outs"]) == 2, (rank, r)
        for diff, finite in r["outs"]:
            assert diff <= 1e-6 and finite, (rank, r)


@pytest.mark.parametrize("experts", ["grouped", "sequential"])
def test_guard_catches_megatrons_host_counts(results, experts):
    """The check is live: megatron's experts (and the host-synced dispatch they need) are caught."""
    for rank in range(2):
        r = _get(results, rank, "guard")[f"control_{experts}"]
        assert not r["device_counts"] and r["host_sync"] is True, (rank, r)
        assert r["caught"] and any(c.startswith("Tensor.tolist") for c in r["caught"]), (rank, r["caught"])


@pytest.mark.parametrize("case", ["swiglu", "probs_on_input", "gelu"])
def test_worst_case_tail_gives_zeros_never_nan(results, case):
    for rank in range(2):
        r = _get(results, rank, "tail")[case]
        assert r["tail_zero"] and r["grads_finite"], (rank, r)
        assert max(r["valid"], r["grad_x"], r["grad_probs"], r["grad_w"]) <= 1e-5, (rank, r)


def test_ep_experts_under_alltoall_take_exact_rows(results):
    for rank in range(2):
        r = _get(results, rank, "pairing")
        assert r["fed"] is False and r["same_params"], (rank, r)
        assert max(r["out"], r["grad_x"], r["grad_params"]) <= 1e-5, (rank, r)


def test_compiled_fullgraph_without_scalar_capture(results):
    for rank in range(2):
        r = _get(results, rank, "compiled")
        assert max(r["out"], r["grad_x"], r["grad_params"]) <= 1e-5, (rank, r)
        # eager and compiled share one buffer: the attached comm.host_sync false, for both
        assert r["buffers"] == [["torch", False]] or r["buffers"] == [("torch", False)], (rank, r)
