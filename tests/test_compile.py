"""torch.compile through ep_plugin's dispatch/combine (ep_plugin/ops.py) on CPU: gloo, world 2, torch
backend.

(a) the custom ops against torch.library.opcheck where it applies, and fake (meta) shapes against real
    ones; (b) a compiled function dispatch -> per-row linear -> combine (fullgraph=True, aot_eager,
    both layouts, dynamic token counts) equal to eager EPBuffer calls, forward and backward; (c) a
    megatron-core MoELayer with the ep_plugin dispatcher compiled with fullgraph=True (no graph
    break at all), equal to the eager layer; where megatron's own code breaks the graph, the breaks
    are counted and none is in ep_plugin's calls. All multi-process work runs in one spawn; the tests
    then check its per-rank results.
"""
from __future__ import annotations

import gc
import os
import time
import traceback

import pytest
import torch

from tests._dist import read_rank_results, spawn, write_rank_result

E, K, H = 8, 2, 16
# (c)'s megatron layers: 4 experts, 2 per rank. What is checked (fullgraph, where the graph breaks, equal to
# eager) is the same with 2 local experts as with make_config's 8 (4 per rank), which cost each rank ~4 s
# more of dynamo's tracing on the CI box.
MEGATRON_EXPERTS = 4
PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + "ep_plugin" + os.sep


def _inputs(rank, T, seed, hidden=H, experts=E, topk=K):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(T, hidden, generator=g)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(T)]) if T else \
        torch.empty(0, topk, dtype=torch.int64)
    if T:
        idx[torch.rand(T, topk, generator=g) < 0.15] = -1  # some slots routed nowhere
    return x, idx.to(torch.int64), torch.rand(T, topk, generator=g)


def _diff(a, b) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item() if a.numel() else 0.0


# ----------------------------------------------------------------------------------- (a) the ops
def _opcheck(rank, world, buf, bid):
    from ep_plugin import ops

    out = {}
    T = 5 + 3 * rank
    x, idx, w = _inputs(rank, T, 1)
    x.requires_grad_(), w.requires_grad_()
    # Every run of these ops is a collective: opcheck runs each op several times, the same number of
    # times on every rank. test_aot_dispatch_dynamic compares the outputs of separate runs, and a
    # dispatch returns a new handle token each time: it applies to the ops that take a handle only
    # (the dispatch ops' compiled outputs are compared with eager in _fake_vs_real and in (b)).
    base = ("test_schema", "test_autograd_registration", "test_faketensor")
    d = ops.dispatch(bid, x.detach(), idx, w.detach(), layout="expert")
    rows = torch.randn(d.x.shape, generator=torch.Generator().manual_seed(rank))
    cases = {
        "dispatch": (torch.ops.ep_plugin.dispatch.default, (x, idx, w, bid), base),
        "dispatch_expert": (torch.ops.ep_plugin.dispatch_expert.default, (x, idx, w, bid, 4), base),
        "combine": (torch.ops.ep_plugin.combine.default, (rows.requires_grad_(), d.handle.token, T),
                    base + ("test_aot_dispatch_dynamic",)),
        "dispatch_cached": (torch.ops.ep_plugin.dispatch_cached.default,
                            (torch.randn(T, H), d.handle.token, d.x.shape[0]), base + ("test_aot_dispatch_dynamic",)),
        "combine_with_weights": (torch.ops.ep_plugin.combine_with_weights.default,
                                 (rows.detach(), d.topk_weights, d.handle.token, T, K),
                                 base + ("test_aot_dispatch_dynamic",)),
    }
    for name, (op, args, utils) in cases.items():
        try:
            torch.library.opcheck(op, args, test_utils=utils)
            out[name] = "ok"
        except Exception:
            out[name] = traceback.format_exc()
    return out


def _fake_vs_real(rank, world, bid):
    """Each op's fake outputs (what a compiled graph is built with) against its real outputs; and the
    dispatch ops compiled with dynamic shapes (aot_eager) against eager, every output but the token."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ep_plugin import ops

    res = {}
    T = 6 + rank
    x, idx, w = _inputs(rank, T, 2)
    for layout, kw in (("rank", {}), ("expert", {"expert_alignment": 4})):
        real = ops.dispatch(bid, x, idx, w, layout=layout, **kw)
        with FakeTensorMode() as mode:
            fake = ops.dispatch(bid, mode.from_tensor(x), mode.from_tensor(idx), mode.from_tensor(w), layout=layout,
                                **kw)
        meta = lambda t: (tuple(t.shape), str(t.dtype), str(t.device), tuple(t.stride()))  # noqa: E731
        pairs = list(zip(real[:-1], fake[:-1])) + [(real.handle.token, fake.handle.token)]
        res[f"{layout}_meta_equal"] = all(meta(a) == meta(b) for a, b in pairs)
        res[f"{layout}_rows"] = real.x.shape[0]
        res[f"{layout}_expected_rows"] = ops.output_rows(bid, K, layout, kw.get("expert_alignment", 1))
        y = ops.combine(real.x, real.handle)
        with FakeTensorMode() as mode:
            fy = torch.ops.ep_plugin.combine(mode.from_tensor(real.x), mode.from_tensor(real.handle.token), T)
        res[f"{layout}_combine_meta_equal"] = meta(y) == meta(fy)

        def f(x, idx, w, layout=layout, kw=kw):
            return tuple(ops.dispatch(bid, x, idx, w, layout=layout, **kw)[:-1])

        comp = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
        res[f"{layout}_dynamic_max_diff"] = max(_diff(a, b) if a.dtype.is_floating_point else float((a != b).sum())
                                                for a, b in zip(comp(x, idx, w), f(x, idx, w)))
    return res


# ----------------------------------------------------------------------------------- (b) compiled
def _compiled_function(rank, world, buf, bid):
    """dispatch -> per-row linear -> combine, fullgraph compiled, against the eager EPBuffer calls."""
    from ep_plugin import ops

    res = {}
    W = torch.randn(E // world, H, H, generator=torch.Generator().manual_seed(50 + rank)) * 0.3

    def expert_rows(rows, offsets):  # expert of each expert-major row, from the device offsets
        seg = torch.searchsorted(offsets[1:], torch.arange(rows.shape[0]), right=True)
        return torch.bmm(rows.unsqueeze(1), W[seg.clamp(max=W.shape[0] - 1)]).squeeze(1)

    def ops_expert(x, idx, w):
        d = ops.dispatch(bid, x, idx, w, layout="expert")
        return ops.combine(expert_rows(d.x, d.offsets) * d.topk_weights.unsqueeze(1), d.handle)

    def eager_expert(x, idx, w):
        d = buf.dispatch(x, idx, w, layout="expert")
        return buf.combine(expert_rows(d.x, d.expert_offsets) * d.topk_weights.unsqueeze(1), d.handle)

    def ops_rank(x, idx, w):
        d = ops.dispatch(bid, x, idx, w)
        return ops.combine((d.x @ W[0]) * d.topk_weights.sum(1, keepdim=True), d.handle)

    def eager_rank(x, idx, w):
        d = buf.dispatch(x, idx, w)
        return buf.combine((d.x @ W[0]) * d.topk_weights.sum(1, keepdim=True), d.handle)

    from torch._dynamo.utils import counters

    for layout, fn, ref in (("expert", ops_expert, eager_expert), ("rank", ops_rank, eager_rank)):
        counters.clear()
        comp = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
        t0 = time.time()
        diffs = []
        for step, T in enumerate((5 + 3 * rank, 9 - 2 * rank, 0 if rank == 1 else 4)):  # rank 1 sends nothing last
            x, idx, w = _inputs(rank, T, 10 + step)
            got = {}
            for tag, f in (("eager", ref), ("compiled", comp)):
                xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
                y = f(xx, idx, ww)
                gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(step))
                (y * gy).sum().backward()
                got[tag] = (y, xx.grad, ww.grad)
            diffs.append(max(_diff(a, b) for a, b in zip(got["eager"], got["compiled"])))
        res[f"{layout}_max_diff"] = max(diffs)
        res[f"{layout}_graphs"] = counters["stats"]["unique_graphs"]
        res[f"{layout}_graph_breaks"] = sum(counters["graph_break"].values())
        res[f"{layout}_seconds"] = time.time() - t0
    return res


def _refusals(rank, world):
    import ep_plugin
    from ep_plugin import ops

    out = {}
    synced = ep_plugin.EPBuffer(None, {"moe": {"num_experts": E, "topk": K},
                                       "comm": {"backend": "torch", "max_tokens_per_rank": 16, "host_sync": True}},
                                hidden=H)
    bid = ops.register(synced)
    x, idx, w = _inputs(rank, 4, 3)
    for tag, fn in (("host_sync_eager", lambda: ops.dispatch(bid, x, idx, w)),
                    ("host_sync_compiled", lambda: torch.compile(
                        lambda a, b, c: ops.dispatch(bid, a, b, c).x, fullgraph=True, backend="eager")(x, idx, w)),
                    ("unknown_id", lambda: ops.dispatch(10 ** 6, x, idx, w))):
        try:
            fn()
            out[tag] = None
        except Exception as exc:  # the message is checked by the test
            out[tag] = f"{type(exc).__name__}: {exc}"
    synced.close()
    return out


# ----------------------------------------------------------------------------------- (c) megatron
def _breaks(explained):
    """[(innermost user frame file, function, first reason line)] of each graph break that
    torch._dynamo.explain reports."""
    out = []
    for b in explained.break_reasons:
        fr = b.user_stack[-1] if b.user_stack else None
        out.append((fr.filename if fr else "?", fr.name if fr else "?", str(b.reason).splitlines()[0][:200]))
    return out


def _megatron(rank, world):
    import torch._dynamo as dynamo
    from megatron.core import parallel_state as ps

    import ep_plugin.megatron as epm
    from ep_plugin import ops
    from ep_plugin.integrations.megatron.dispatcher import EPPluginTokenDispatcher
    from ep_plugin.testing import cpu_stand_ins
    from tests.megatron_cases import make_config, make_moe_layer

    cpu_stand_ins(eager=False)  # dynamo on; the eager runs below use the force_eager stance
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    res = {}
    try:
        # 1. megatron's TEGroupedMLP (its non-TE path) with ep_plugin's GroupedMMLinear: fullgraph
        cfg = make_config(world, moe_token_dispatcher_type="ep_plugin", moe_router_topk=3,
                          num_moe_experts=MEGATRON_EXPERTS)
        epm.attach_config(cfg, {"comm": {"backend": "torch", "max_tokens_per_rank": 32}})
        layer = make_moe_layer(cfg, grouped=True)
        assert isinstance(layer.token_dispatcher, EPPluginTokenDispatcher)
        with torch.no_grad():
            for n, p in layer.named_parameters():
                if "experts" in n:  # experts differ per rank
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + rank)) * 0.1)
        t0 = time.time()
        with dynamo.config.patch(capture_scalar_outputs=True):
            comp = torch.compile(layer, fullgraph=True, backend="aot_eager")
            diffs = {"out": 0.0, "grad_x": 0.0, "grad_params": 0.0}
            for step, S in enumerate((5 + 3 * rank, 5 + 3 * rank, 3 + rank)):
                g = torch.Generator().manual_seed(1000 * step + rank)
                x0, gout = torch.randn(S, 2, H, generator=g), torch.randn(S, 2, H, generator=g)
                got = {}
                for tag in ("eager", "compiled"):
                    layer.zero_grad(set_to_none=True)
                    x = x0.clone().requires_grad_()
                    if tag == "eager":
                        with torch.compiler.set_stance("force_eager"):
                            y, _ = layer(x)
                            (y * gout).sum().backward()
                    else:
                        y, _ = comp(x)
                        (y * gout).sum().backward()
                    got[tag] = (y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()
                                                     if p.grad is not None})
                (y0, gx0, gp0), (y1, gx1, gp1) = got["eager"], got["compiled"]
                assert set(gp0) == set(gp1) and gp0, (sorted(gp0), sorted(gp1))
                diffs["out"] = max(diffs["out"], _diff(y0, y1))
                diffs["grad_x"] = max(diffs["grad_x"], _diff(gx0, gx1))
                diffs["grad_params"] = max(diffs["grad_params"], max(_diff(gp0[n], gp1[n]) for n in gp0))
        res["grouped"] = dict(diffs, seconds=time.time() - t0, num_param_grads=len(gp0),
                              buffers=[(b.backend_name, b.cfg.comm.host_sync) for b in epm.cached_buffers()])
        # the handle table empties once the tokens are gone
        del comp, y, x, got
        gc.collect()
        res["grouped"]["live_handles"] = ops.live_handles()

        # 2. graph breaks, counted: megatron's default experts (SequentialMLP of ColumnParallelLinear MLPs)
        #    with capture_scalar_outputs, and the grouped layer without it
        dynamo.reset()
        t0 = time.time()
        seq_cfg = make_config(world, moe_token_dispatcher_type="ep_plugin", num_moe_experts=MEGATRON_EXPERTS)
        epm.attach_config(seq_cfg, {"comm": {"backend": "torch", "max_tokens_per_rank": 32}})
        seq = make_moe_layer(seq_cfg)
        x = torch.randn(4 + rank, 2, H)
        with dynamo.config.patch(capture_scalar_outputs=True):
            ex = dynamo.explain(seq)(x)
        res["sequential_capture"] = {"graph_breaks": ex.graph_break_count, "breaks": _breaks(ex)}
        dynamo.reset()
        with dynamo.config.patch(capture_scalar_outputs=False):
            ex = dynamo.explain(layer)(x)
        res["grouped_default"] = {"graph_breaks": ex.graph_break_count, "breaks": _breaks(ex),
                                  "seconds": time.time() - t0}

        # 3. comm.host_sync: true under compile: eager calls behind three graph breaks, same results
        dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
        t0 = time.time()
        sync_cfg = make_config(world, moe_token_dispatcher_type="ep_plugin", moe_router_topk=3,
                               num_moe_experts=MEGATRON_EXPERTS)
        epm.attach_config(sync_cfg, {"comm": {"backend": "torch", "max_tokens_per_rank": 32, "host_sync": True}})
        synced = make_moe_layer(sync_cfg, grouped=True)
        with dynamo.config.patch(capture_scalar_outputs=True):
            comp = torch.compile(synced, backend="eager")
            x0 = torch.randn(5 + rank, 2, H, generator=torch.Generator().manual_seed(7 + rank))
            got = []
            for run in ("eager", "compiled"):
                synced.zero_grad(set_to_none=True)
                x = x0.clone().requires_grad_()
                if run == "eager":
                    with torch.compiler.set_stance("force_eager"):
                        y, _ = synced(x)
                else:
                    y, _ = comp(x)
                y.square().sum().backward()
                got.append((y.detach(), x.grad))
        res["host_sync_fallback"] = {
            "max_diff": max(_diff(a, b) for a, b in zip(*got)),
            "breaks": sorted({k.splitlines()[1].strip()[:160] if len(k.splitlines()) > 1 else k[:160]
                              for k in counters["graph_break"]}),
            "seconds": time.time() - t0}
    finally:
        ps.destroy_model_parallel()
        epm.clear_buffers()
    return res


def _dist_body(rank, world, out_dir):
    import ep_plugin
    from ep_plugin import ops

    torch.set_num_threads(1)
    results = {}
    t0 = time.time()
    buf = ep_plugin.EPBuffer(None, {"moe": {"num_experts": E, "topk": K},
                                    "comm": {"backend": "torch", "max_tokens_per_rank": 16}}, hidden=H)
    bid = ops.register(buf)
    base_handles = ops.live_handles()
    for name, fn in (("opcheck", lambda: _opcheck(rank, world, buf, bid)),
                     ("fake_vs_real", lambda: _fake_vs_real(rank, world, bid)),
                     ("compiled_function", lambda: _compiled_function(rank, world, buf, bid)),
                     ("refusals", lambda: _refusals(rank, world))):
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    torch._dynamo.reset()
    gc.collect()
    results["ops_live_handles"] = ops.live_handles() - base_handles
    results["ops_seconds"] = time.time() - t0
    buf.close()
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        results["megatron"] = {"skipped": "megatron-core is not importable"}
    else:
        try:
            results["megatron"] = _megatron(rank, world)
        except Exception:
            results["megatron"] = {"error": traceback.format_exc()}
    write_rank_result(out_dir, rank, results)


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("compile")
    spawn(_dist_body, 2, str(d), timeout=240)
    return read_rank_results(d, 2)


def _get(results, rank, key):
    r = results[key]
    assert not (isinstance(r, dict) and "error" in r), f"rank {rank}:\n{r['error']}"
    return r


# ----------------------------------------------------------------------------------- (a)
@pytest.mark.parametrize("op", ["dispatch", "dispatch_expert", "combine", "dispatch_cached", "combine_with_weights"])
def test_opcheck(dist_results, op):
    for rank, results in enumerate(dist_results):
        assert _get(results, rank, "opcheck")[op] == "ok", f"rank {rank}:\n{results['opcheck'][op]}"


def test_fake_shapes_match_real_and_worst_case(dist_results):
    for rank, results in enumerate(dist_results):
        r = _get(results, rank, "fake_vs_real")
        for layout in ("rank", "expert"):
            assert r[f"{layout}_meta_equal"] and r[f"{layout}_combine_meta_equal"], (rank, r)
            assert r[f"{layout}_rows"] == r[f"{layout}_expected_rows"], (rank, r)
            assert r[f"{layout}_dynamic_max_diff"] == 0.0, (rank, r)
        # world 2 * max_tokens_per_rank 16; expert-major: * min(K, E_l) + E_l * (alignment - 1)
        assert r["rank_rows"] == 32 and r["expert_rows"] == 32 * K + 4 * 3, r


# ----------------------------------------------------------------------------------- (b)
@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_compiled_dispatch_linear_combine_matches_eager(dist_results, layout):
    for rank, results in enumerate(dist_results):
        r = _get(results, rank, "compiled_function")
        assert r[f"{layout}_max_diff"] <= 1e-5, (rank, r)
        assert r[f"{layout}_graph_breaks"] == 0, (rank, r)
        # dynamic token counts: one graph for all of them, and one more where a rank sends 0 tokens
        # (dynamo specializes sizes 0 and 1)
        assert r[f"{layout}_graphs"] == (1 if rank == 0 else 2), (rank, r)


def test_handles_freed_with_their_tokens(dist_results):
    for rank, results in enumerate(dist_results):
        assert results["ops_live_handles"] == 0, (rank, results["ops_live_handles"])


def test_host_sync_buffer_and_unknown_id_refused(dist_results):
    for rank, results in enumerate(dist_results):
        r = _get(results, rank, "refusals")
        for tag in ("host_sync_eager", "host_sync_compiled"):
            assert r[tag] is not None and "comm.host_sync: false" in r[tag], (rank, tag, r[tag])
        assert r["unknown_id"] is not None and r["unknown_id"].startswith("ValueError"), r["unknown_id"]


# ----------------------------------------------------------------------------------- (c)
def _megatron_results(dist_results, rank):
    r = dist_results[rank]["megatron"]
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return r


def test_megatron_layer_compiles_fullgraph_and_matches_eager(dist_results):
    for rank in range(2):
        r = _megatron_results(dist_results, rank)["grouped"]
        assert r["out"] <= 1e-5 and r["grad_x"] <= 1e-5 and r["grad_params"] <= 1e-5, (rank, r)
        assert r["num_param_grads"] >= 3, r
        # the eager path's exact-size buffer and the compiled path's worst-case one (host_sync false)
        assert sorted(map(tuple, r["buffers"])) == [("torch", False), ("torch", True)], r
        assert r["live_handles"] == 0, r


def test_megatron_graph_breaks_are_megatrons(dist_results):
    """SequentialMLP's ColumnParallelLinears warn (warnings.warn, which dynamo does not trace) on rank
    0 when tp_group is None: megatron's breaks, none in ep_plugin. Without capture_scalar_outputs the
    host counts megatron's experts need break the graph: in its experts (TEGroupedMLP.forward's
    tokens_per_expert.tolist(), experts.py:769 in 0.19.2) and where the dispatcher cuts the rows to
    them (the only ep_plugin frame that breaks); never in the dispatch/combine calls."""
    for rank in range(2):
        r = _megatron_results(dist_results, rank)
        seq = r["sequential_capture"]["breaks"]
        assert all(PKG not in f for f, _, _ in seq), (rank, seq)
        if rank == 1:
            assert r["sequential_capture"]["graph_breaks"] == 0, (rank, r["sequential_capture"])
        for f, fn, why in r["grouped_default"]["breaks"]:
            if PKG in f:
                assert (os.path.basename(f), fn) == ("dispatcher.py", "_dispatch_postprocess_op"), (rank, f, fn, why)
                assert "item()" in why, why
        assert r["grouped_default"]["graph_breaks"] >= 1


def test_megatron_host_sync_true_falls_back_eagerly(dist_results):
    for rank in range(2):
        r = _megatron_results(dist_results, rank)["host_sync_fallback"]
        assert r["max_diff"] <= 1e-5, (rank, r)
        names = " ".join(r["breaks"])
        for fn in ("_eager_token_dispatch", "_eager_dispatch_postprocess", "_eager_token_combine"):
            assert fn in names, (rank, r["breaks"])
        assert len(r["breaks"]) == 3, (rank, r["breaks"])
