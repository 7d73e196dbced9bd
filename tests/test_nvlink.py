"""The nvlink backend against the torch reference backend, on real NCCL groups of 2 and 4 GPUs.

One spawn per world size runs every test's body, one after the other, in the same processes and
NCCL group (process and NCCL start-up are the expensive part on the device machine). Every check compares the nvlink backend with the torch
backend on the same inputs and group: dispatch outputs bit-exact, combine within BF16 rounding.
"""
import pytest
import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.errors import EPTimeoutError
from tests._dist import spawn_parts
from ep_plugin.expert_major import merge_repeats_torch
from tests.reference import make_inputs, reference_dispatch, reference_expert_dispatch

pytestmark = pytest.mark.gpu
WORLDS = (2, 4, 8)  # each where that many GPUs exist


def _need(world):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    import ep_plugin._ext as ext
    if not ext.has_c():
        pytest.skip("ep_plugin._C is not built")


def _buf(backend, E, K, hidden, max_tokens=512, timeout_s=10.0, **comm):
    comm.setdefault("host_sync", True)  # exact output sizes, compared row for row; the default mode has its own checks
    cfg = {"moe": {"num_experts": E, "topk": K},
           "comm": {"backend": backend, "max_tokens_per_rank": max_tokens, "timeout_s": timeout_s, **comm}}
    return ep_plugin.EPBuffer(None, cfg, hidden=hidden)


def _inputs(world, rank, tokens, hidden, E, K, seed, mode="random"):
    xs, idxs, ws = make_inputs(world, tokens, hidden, E, K, seed, torch.bfloat16, mode)
    return xs, idxs, ws, xs[rank].cuda(), idxs[rank].cuda(), ws[rank].cuda()


def _same_dispatch(a, b, ctx):
    assert a.x.dtype == b.x.dtype, ctx
    assert torch.equal(a.x, b.x), ctx
    assert torch.equal(a.topk_idx, b.topk_idx), ctx
    if b.topk_weights is None:
        assert a.topk_weights is None, ctx
    else:
        assert torch.equal(a.topk_weights, b.topk_weights), ctx
    assert list(a.tokens_per_expert) == list(b.tokens_per_expert), ctx
    assert a.handle.send_counts == b.handle.send_counts, ctx
    assert a.handle.recv_counts == b.handle.recv_counts, ctx
    assert torch.equal(a.handle.is_token_in_rank, b.handle.is_token_in_rank), ctx


def _same_worst_case(a, b, ctx) -> int:
    """A worst-case-sized dispatch `a` against the reference's exact `b`: its valid rows (the device count) equal
    b's, the padding routes nowhere. Returns the valid row count."""
    R = b.x.shape[0]
    assert int(a.handle.num_recv_device) == R, ctx
    assert torch.equal(a.x[:R], b.x) and torch.equal(a.topk_idx[:R], b.topk_idx), ctx
    assert torch.equal(a.topk_weights[:R], b.topk_weights), ctx
    assert (a.topk_idx[R:] == -1).all() and (a.topk_weights[R:] == 0).all(), ctx
    return R


def _register_pull(nv, call):
    """call() with the pulls moving rows by registers instead of bulk copies (TMA, the default)."""
    rt = nv._backend._rt
    assert rt.tma and rt.tma_supported == (torch.cuda.get_device_capability()[0] >= 9)  # sm_90 builds
    rt.tma = False
    try:
        return call()
    finally:
        rt.tma = True


def check_vs_torch(nv, ref, rank, world, E, K, hidden, tokens, seed, mode):
    xs, idxs, ws, x, idx, w = _inputs(world, rank, tokens, hidden, E, K, seed, mode)
    ctx = f"rank {rank} world {world} hidden {hidden} tokens {tokens} mode {mode} seed {seed}"
    a = nv.dispatch(x, idx, w)
    b = ref.dispatch(x, idx, w)
    _same_dispatch(a, b, ctx)
    _same_dispatch(_register_pull(nv, lambda: nv.dispatch(x, idx, w)), b, f"{ctx} register pull")
    rx, ridx, rw, tpe = reference_dispatch(xs, idxs, ws, rank, E)      # and the CPU reference
    assert torch.equal(a.x.cpu(), rx) and torch.equal(a.topk_idx.cpu(), ridx), ctx
    assert torch.equal(a.topk_weights.cpu(), rw) and list(a.tokens_per_expert) == tpe, ctx
    rows = (a.x.float() * (rank + 1) + 0.25).to(torch.bfloat16)
    yb = ref.combine(rows, b.handle)
    be = nv._backend
    mode0 = be.combine_mode
    for mode in ("split", "fused", "pipelined", "pull"):  # every combine kernel
        be.combine_mode = mode
        ya = nv.combine(rows, a.handle)
        assert ya.dtype == torch.bfloat16 and ya.shape == (x.shape[0], hidden), ctx
        torch.testing.assert_close(ya.float(), yb.float(), atol=2e-2, rtol=1e-2, msg=f"{ctx} combine {mode}")
    be.combine_mode = mode0
    return a


def body_contract(rank, world):
    torch.cuda.set_device(rank)
    E, K = 8 * world, 4
    seed = 100
    for hidden in (2048, 5120, 7168):  # 5120: not a power of two; 7168: the model's (4096 added nothing)
        nv, ref = _buf("nvlink", E, K, hidden), _buf("torch", E, K, hidden)
        assert nv.backend_name == "nvlink"
        modes = ("random", "skew", "nowhere", "starve_last") if hidden == 2048 else ("random",)
        for mode in modes:
            for tokens in (17, [0] + [9] * (world - 1), 300, 512):
                seed += 1
                check_vs_torch(nv, ref, rank, world, E, K, hidden, tokens, seed, mode)
        if hidden == 2048:
            check_modes(nv, ref, rank, world, E, K, hidden)
        nv.close()
        ref.close()
        if hidden in (2048, 7168):
            check_stage_pull(rank, world, E, K, hidden)
    # the benchmark's shape: 4096 tokens, hidden 7168, 256 experts, top-8
    nv, ref = _buf("nvlink", 256, 8, 7168, max_tokens=4096), _buf("torch", 256, 8, 7168, max_tokens=4096)
    check_vs_torch(nv, ref, rank, world, 256, 8, 7168, 4096, 7, "random")  # one seed: a second added no shape
    check_fp8(nv, ref, rank, world, 256, 8, 7168, 4096)
    nv.close()
    ref.close()
    check_uneven_auto(rank, world, E, K)


def check_uneven_auto(rank, world, E, K):
    """Token counts on either side of the auto combine's 512 (backends/nvlink/plan.py), auto kernels: every rank must
    run the same combine kernel (planned from max_tokens_per_rank), else split meets pull and both wait to the
    timeout."""
    hidden = 2048
    nv, ref = _buf("nvlink", E, K, hidden, max_tokens=1024), _buf("torch", E, K, hidden, max_tokens=1024)
    assert nv._backend.combine_mode == "auto"
    tokens = [700 if r % 2 == 0 else 300 for r in range(world)]
    ctx = f"rank {rank} world {world} tokens {tokens} auto kernels"
    _, _, _, x, idx, w = _inputs(world, rank, tokens, hidden, E, K, 999)
    a, b = nv.dispatch(x, idx, w), ref.dispatch(x, idx, w)
    _same_dispatch(a, b, ctx)
    rows = (a.x.float() * (rank + 1) + 0.25).to(torch.bfloat16)
    ya, yb = nv.combine(rows, a.handle), ref.combine(rows, b.handle)
    torch.testing.assert_close(ya.float(), yb.float(), atol=2e-2, rtol=1e-2, msg=ctx)
    nv.close()
    ref.close()


def check_modes(nv, ref, rank, world, E, K, hidden):
    """Async, cached, out-of-order handles, FP8."""
    _, _, _, x, idx, w = _inputs(world, rank, 200, hidden, E, K, seed=5)
    base = nv.dispatch(x, idx, w)
    # async
    res = nv.dispatch(x, idx, w, async_op=True)
    assert res.event is not None
    res.event.current_stream_wait()
    _same_dispatch(res, base, "async dispatch")
    y_async, ev = nv.combine(res.x, res.handle, async_op=True)
    ev.current_stream_wait()
    torch.testing.assert_close(y_async, nv.combine(base.x, base.handle), atol=0, rtol=0)
    # cached: same layout, new rows (and weights)
    x2 = torch.randn_like(x)
    w2 = torch.rand_like(w)
    cached = nv.dispatch(x2, None, w2, handle=base.handle)
    fresh = ref.dispatch(x2, idx, w2)
    assert torch.equal(cached.x, fresh.x) and torch.equal(cached.topk_idx, fresh.topk_idx)
    assert torch.equal(cached.topk_weights, fresh.topk_weights)
    assert list(cached.tokens_per_expert) == list(fresh.tokens_per_expert)
    cached2 = nv.dispatch(x2, handle=base.handle)
    assert torch.equal(cached2.x, fresh.x) and cached2.topk_weights is None
    # two dispatches in flight, combined in reverse order
    _, _, _, x3, idx3, w3 = _inputs(world, rank, 150, hidden, E, K, seed=6)
    d1 = nv.dispatch(x, idx, w)
    d2 = nv.dispatch(x3, idx3, w3)
    y2 = nv.combine(d2.x, d2.handle)
    y1 = nv.combine(d1.x, d1.handle)
    torch.testing.assert_close(y1, ref.combine(d1.x, ref.dispatch(x, idx, w).handle), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(y2, ref.combine(d2.x, ref.dispatch(x3, idx3, w3).handle), atol=2e-2, rtol=1e-2)
    # what the kernels do not take is refused with the fix named, never handed to another backend
    with pytest.raises(TypeError, match="comm.backend: torch"):
        nv.dispatch(x.float(), idx, w)
    with pytest.raises(TypeError, match="comm.backend: torch"):
        nv.combine(base.x.float(), base.handle)
    with pytest.raises(TypeError, match="torch backend"):
        nv.combine(base.x, ref.dispatch(x, idx, w).handle)
    check_fp8(nv, ref, rank, world, E, K, hidden, 200)


def check_fp8(nv, ref, rank, world, E, K, hidden, T):
    _, _, _, x, idx, w = _inputs(world, rank, T, hidden, E, K, seed=11)
    scales = x.float().abs().view(T, hidden // 128, 128).amax(-1).clamp(min=1e-4) / 448.0
    data = (x.float().view(T, -1, 128) / scales.unsqueeze(-1)).view(T, hidden).to(torch.float8_e4m3fn)
    a = nv.dispatch((data, scales), idx, w)
    b = ref.dispatch((data, scales), idx, w)
    (ad, asc), (bd, bsc) = a.x, b.x
    assert ad.dtype == torch.float8_e4m3fn and asc.dtype == torch.float32
    assert torch.equal(ad.view(torch.uint8), bd.view(torch.uint8)) and torch.equal(asc, bsc)
    rd, rsc = _register_pull(nv, lambda: nv.dispatch((data, scales), idx, w)).x
    assert torch.equal(rd.view(torch.uint8), ad.view(torch.uint8)) and torch.equal(rsc, asc)
    assert torch.equal(a.topk_idx, b.topk_idx) and torch.equal(a.topk_weights, b.topk_weights)
    # round trip: dequantise, send back, compare with the BF16 path
    deq = (ad.float().view(-1, hidden // 128, 128) * asc.unsqueeze(-1)).view(-1, hidden).to(torch.bfloat16)
    y = nv.combine(deq, a.handle)
    reached = a.handle.is_token_in_rank.sum(1, keepdim=True).float()
    torch.testing.assert_close(y.float(), x.float() * reached, atol=0.1, rtol=0.1)
    # cached FP8
    c = nv.dispatch((data, scales), handle=a.handle)
    assert torch.equal(c.x[0].view(torch.uint8), ad.view(torch.uint8)) and torch.equal(c.x[1], asc)


def check_stage_pull(rank, world, E, K, hidden):
    """comm.dispatch_kernel fused: a rank-major dispatch without host sync (and a cached one) runs stage
    and pull as one kernel (stage_pull): the same rows as stage, then pull, also when only some ranks
    use it (each protocol releases the other's flags), fresh and cached, BF16 and FP8. Every call's outputs are
    held to the end and checked again there: the outputs later calls got made ahead (comm.spare_outputs, the
    default) are never an earlier call's."""
    nv, ref = _buf("nvlink", E, K, hidden, host_sync=False, dispatch_kernel="fused"), _buf("torch", E, K, hidden)
    be = nv._backend
    seed = 300
    held = []
    # the fused kernel everywhere, split everywhere (its stage by the copy engine), mixed, and split with the stage
    # kernel (Runtime.stage_copy_engine off) mixed with the fused kernel
    evens, odds = tuple(r % 2 == 0 for r in range(world)), tuple(r % 2 == 1 for r in range(world))
    for fused, copies in (((True,) * world, True), ((False,) * world, True), (evens, True), (odds, False)):
        be.dispatch_mode = "fused" if fused[rank] else "split"
        be._rt.stage_copy_engine = copies
        for tokens, mode in ((300, "random"), (512, "skew"), ([0] + [33] * (world - 1), "starve_last"), (1, "random")):
            seed += 1
            ctx = f"rank {rank} fused {fused} copy-engine stage {copies} tokens {tokens} mode {mode}"
            _, _, _, x, idx, w = _inputs(world, rank, tokens, hidden, E, K, seed, mode)
            a, b = nv.dispatch(x, idx, w), ref.dispatch(x, idx, w)
            R = _same_worst_case(a, b, ctx)
            w2 = torch.rand_like(w)
            c = nv.dispatch(x * 2, None, w2, handle=a.handle)
            d = ref.dispatch(x * 2, None, w2, handle=b.handle)
            assert torch.equal(c.x[:R], d.x) and torch.equal(c.topk_weights[:R], d.topk_weights), ctx + " cached"
            y = nv.combine(a.x, a.handle)
            y_ref = ref.combine(b.x, b.handle)
            torch.testing.assert_close(y.float(), y_ref.float(), atol=2e-2, rtol=1e-2, msg=ctx + " combine")
            held.append((ctx, a, b, c, d, y, y.clone()))
    be._rt.stage_copy_engine = True
    for ctx, a, b, c, d, y, y_then in held:
        R = b.x.shape[0]
        assert torch.equal(a.x[:R], b.x) and torch.equal(a.topk_idx[:R], b.topk_idx), ctx + " held"
        assert torch.equal(c.x[:R], d.x) and torch.equal(y, y_then), ctx + " held cached / combine"
    # one form again and again: from the third call on, each call's outputs were made ahead by the one before
    # (comm.spare_outputs); every one of them is held and checked again at the end
    _, _, _, x, idx, w = _inputs(world, rank, 300, hidden, E, K, seed=299)
    b = ref.dispatch(x, idx, w)
    R = b.x.shape[0]
    outs = [nv.dispatch(x * (k + 1), idx, w) for k in range(4)]
    assert "rows" in be._spares._sets and "notify" in be._spares._sets
    sums = [nv.combine(o.x, o.handle) for o in outs]
    assert "sums" in be._spares._sets
    assert len({o.x.data_ptr() for o in outs}) == 4 and len({y.data_ptr() for y in sums}) == 4
    for k, (o, y) in enumerate(zip(outs, sums)):
        assert torch.equal(o.x[:R], b.x * (k + 1)), f"rank {rank} held dispatch {k}"
        torch.testing.assert_close(y.float(), ref.combine(b.x * (k + 1), b.handle).float(), atol=4e-2, rtol=1e-2,
                                   msg=f"rank {rank} held combine {k}")
    be.dispatch_mode = "fused"
    T = 200
    _, _, _, x, idx, w = _inputs(world, rank, T, hidden, E, K, seed=301)
    scales = x.float().abs().view(T, hidden // 128, 128).amax(-1).clamp(min=1e-4) / 448.0
    data = (x.float().view(T, -1, 128) / scales.unsqueeze(-1)).view(T, hidden).to(torch.float8_e4m3fn)
    a, b = nv.dispatch((data, scales), idx, w), ref.dispatch((data, scales), idx, w)
    R = b.x[0].shape[0]
    assert torch.equal(a.x[0][:R].view(torch.uint8), b.x[0].view(torch.uint8)) and torch.equal(a.x[1][:R], b.x[1])
    c = nv.dispatch((data, scales), handle=a.handle)
    assert torch.equal(c.x[0][:R].view(torch.uint8), b.x[0].view(torch.uint8)) and torch.equal(c.x[1][:R], b.x[1])
    nv.close()
    ref.close()


def test_nvlink_matches_torch(nvlink_parts):
    nvlink_parts["contract"].check()


def _captured(nv, T, H, K, **layout):
    """dispatch + combine (rows doubled) of static inputs captured in one CUDA graph after a warm-up
    outside capture: (graph, (sx, sidx, sw) to fill before a replay, dispatch result, combined y)."""
    sx = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
    sidx = torch.full((T, K), -1, dtype=torch.int64, device="cuda")
    sw = torch.zeros(T, K, dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture
        r0 = nv.dispatch(sx, sidx, sw, **layout)
        nv.combine(r0.x, r0.handle)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = nv.dispatch(sx, sidx, sw, **layout)
        y = nv.combine((res.x.float() * 2).to(torch.bfloat16), res.handle)
    return g, (sx, sidx, sw), res, y


def body_graph_autograd_errors(rank, world):
    torch.cuda.set_device(rank)
    E, K, H = 8 * world, 4, 2048
    ref = _buf("torch", E, K, H)
    # ---- CUDA graph: capture dispatch + combine once (worst-case mode), replay on new routings;
    # dispatch / combine kernel pairs: every kernel in a graph at least once
    for kernel, combine_kernel in (("split", "split"), ("fused", "pipelined"), ("split", "pull")):
        nv = _buf("nvlink", E, K, H, max_tokens=256, dispatch_kernel=kernel, combine_kernel=combine_kernel)
        T = 256
        g, (sx, sidx, sw), res, y = _captured(nv, T, H, K)
        Rmax = world * 256
        assert res.x.shape == (Rmax, H) and res.handle.num_recv == Rmax
        for seed in range(3):
            _, _, _, x, idx, w = _inputs(world, rank, T, H, E, K, seed=40 + seed, mode="random" if seed < 2 else "skew")
            sx.copy_(x), sidx.copy_(idx), sw.copy_(w)
            g.replay()
            torch.cuda.synchronize()
            b = ref.dispatch(x, idx, w)
            R = int(res.num_recv.item())
            assert R == b.x.shape[0], (R, b.x.shape)
            assert torch.equal(res.x[:R], b.x) and torch.equal(res.topk_idx[:R], b.topk_idx)
            assert torch.equal(res.topk_weights[:R], b.topk_weights)
            assert bool((res.topk_idx[R:] == -1).all()) and bool((res.topk_weights[R:] == 0).all())
            assert res.num_tokens_per_expert.tolist() == list(b.tokens_per_expert)
            yb = ref.combine((b.x.float() * 2).to(torch.bfloat16), b.handle)
            torch.testing.assert_close(y.float(), yb.float(), atol=2e-2, rtol=1e-2, msg=f"{kernel}/{combine_kernel}")
        del g
        nv.close()

    # ---- comm.host_sync: false outside a graph: same types as the synced mode, counts read lazily
    nv = _buf("nvlink", E, K, H, max_tokens=256, host_sync=False)
    _, _, _, x, idx, w = _inputs(world, rank, 200, H, E, K, seed=44, mode="skew")
    a, b = nv.dispatch(x, idx, w), ref.dispatch(x, idx, w)
    R = int(a.num_recv.item())
    assert a.x.shape[0] == world * 256 and R == b.x.shape[0]
    assert torch.equal(a.x[:R], b.x) and torch.equal(a.topk_idx[:R], b.topk_idx)
    assert isinstance(a.tokens_per_expert, list) and a.tokens_per_expert == list(b.tokens_per_expert)
    assert a.handle.recv_counts == b.handle.recv_counts and a.handle.send_counts == b.handle.send_counts
    ya, wa = nv.combine(a.x, a.handle, a.topk_weights)
    yb, wb = ref.combine(b.x, b.handle, b.topk_weights)
    torch.testing.assert_close(ya.float(), yb.float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(wa, wb)
    # an expert id out of range: found on the device, raised by check(), nothing written out of bounds
    nv.dispatch(x, idx.clone().fill_(E + 3))
    with pytest.raises(ValueError, match="topk_idx"):
        nv.check()
    nv.check()  # reported once; the buffer keeps working
    nv.close()

    # ---- autograd through EPBuffer: grads of x and topk_weights equal the torch backend's
    nv = _buf("nvlink", E, K, H)
    _, _, _, x0, idx, w0 = _inputs(world, rank, 97, H, E, K, seed=77)
    gen = torch.Generator(device="cuda").manual_seed(5 + rank)
    gx = torch.randn(4096, H, device="cuda", generator=gen)
    gw = torch.randn(4096, K, device="cuda", generator=gen)
    gy = torch.randn(97, H, device="cuda", generator=gen)
    grads = []
    for buf in (nv, ref):
        x = x0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        res = buf.dispatch(x, idx, w)
        R = res.x.shape[0]
        y = buf.combine(res.x * (rank + 2), res.handle)
        loss = (y.float() * gy).sum() + (res.x.float() * gx[:R]).sum() + (res.topk_weights * gw[:R]).sum()
        loss.backward()
        grads.append((x.grad.float(), w.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-3, rtol=1e-3)

    # ---- bad input is refused before any kernel runs, and the buffer keeps working
    _, _, _, x, idx, w = _inputs(world, rank, 64, H, E, K, seed=3)
    bad = [
        (lambda: nv.dispatch(torch.randn(600, H, device="cuda", dtype=torch.bfloat16),
                             torch.zeros(600, K, dtype=torch.int64, device="cuda")), ValueError),  # > max tokens
        (lambda: nv.dispatch(x, idx.clone().fill_(E)), ValueError),                        # expert out of range
        (lambda: nv.dispatch(x, idx.int()), TypeError),                                     # wrong index dtype
        (lambda: nv.dispatch(x[:, :1024], idx), ValueError),                                # wrong hidden
        (lambda: nv.dispatch(x.t(), idx), ValueError),                                      # not contiguous
        (lambda: nv.combine(x[:3], nv.dispatch(x, idx).handle), ValueError),                # wrong row count
        (lambda: nv._backend.dispatch(x, None, torch.zeros(64, 40, dtype=torch.int64, device="cuda"),
                                      None), ValueError),                                   # topk > 32
    ]
    for fn, exc in bad:
        with pytest.raises(exc):
            fn()
    check_vs_torch(nv, ref, rank, world, E, K, H, 64, 9, "random")
    for hidden in (1000, 64, 100000):
        with pytest.raises(ValueError, match="hidden"):
            _buf("nvlink", E, K, hidden)
    nv.close()

    # ---- timeout on purpose: the last rank skips a dispatch; the others must name it
    nv = _buf("nvlink", E, K, H, timeout_s=2.0)
    check_vs_torch(nv, ref, rank, world, E, K, H, 64, 10, "random")
    missing = world - 1
    if rank != missing:
        with pytest.raises(EPTimeoutError) as ei:
            nv.dispatch(x, idx, w)
        assert ei.value.missing_ranks == (missing,), ei.value.missing_ranks
        assert f"[{missing}]" in str(ei.value)
        with pytest.raises(EPTimeoutError):  # the buffer stays failed
            nv.dispatch(x, idx, w)
    # the CUDA context is not poisoned
    z = torch.ones(1024, device="cuda") * 3
    torch.cuda.synchronize()
    assert float(z.sum()) == 3072.0
    nv.close()
    ref.close()
    dist.barrier()


def test_nvlink_graph_autograd_errors_timeout(nvlink_parts):
    nvlink_parts["graph_autograd_errors"].check()


def _same_expert(a, b, ctx):
    """nvlink's expert-major result against the torch backend's (the reference layout)."""
    assert a.expert_offsets.tolist() == b.expert_offsets.tolist(), ctx
    n = int(b.expert_offsets[-1])
    assert (a.x[0] if isinstance(a.x, tuple) else a.x).shape[0] >= n, ctx
    if isinstance(a.x, tuple):
        assert torch.equal(a.x[0][:n].view(torch.uint8), b.x[0][:n].view(torch.uint8)), ctx
        assert torch.equal(a.x[1][:n], b.x[1][:n]), ctx
    else:
        assert torch.equal(a.x[:n], b.x[:n]), ctx
    if b.topk_weights is not None:
        assert torch.equal(a.topk_weights[:n], b.topk_weights[:n]), ctx
    assert a.num_tokens_per_expert.tolist() == b.num_tokens_per_expert.tolist(), ctx
    assert list(a.tokens_per_expert) == list(b.tokens_per_expert), ctx
    return n


def check_expert(nv, ref, rank, world, E, K, hidden, tokens, seed, mode, alignment):
    xs, idxs, ws, x, idx, w = _inputs(world, rank, tokens, hidden, E, K, seed, mode)
    ctx = f"expert-major rank {rank} world {world} hidden {hidden} tokens {tokens} mode {mode} align {alignment}"
    a = nv.dispatch(x, idx, w, layout="expert", expert_alignment=alignment)
    b = ref.dispatch(x, idx, w, layout="expert", expert_alignment=alignment)
    n = _same_expert(a, b, ctx)
    if mode == "repeats":  # nvlink merges in its kernels (notify, stage), the torch backend before them:
        # both against the CPU reference of the merged picks (merge_repeats' definition)
        merged = [merge_repeats_torch(i, wt) for i, wt in zip(idxs, ws)]
        rx, rw, offsets, tpe = reference_expert_dispatch(xs, [m[0] for m in merged], [m[1] for m in merged], rank,
                                                         E, alignment)
        assert a.expert_offsets.tolist() == offsets and list(a.tokens_per_expert) == tpe, ctx
        assert torch.equal(a.x[:n].cpu(), rx) and torch.equal(a.topk_weights[:n].cpu(), rw), ctx
        assert a.handle.topk_idx is idx, ctx  # the caller's ids, not a merged copy
    _same_expert(_register_pull(nv, lambda: nv.dispatch(x, idx, w, layout="expert", expert_alignment=alignment)),
                 b, f"{ctx} register pull")
    # rows scaled per local expert: combine sums each token's experts (and ranks)
    epr = E // world
    seg = torch.zeros(a.x.shape[0], device="cuda")
    off = a.expert_offsets.tolist()
    for e in range(epr):
        seg[off[e]:off[e + 1]] = 1.0 + (rank * epr + e) / E
    yb = ref.combine((b.x.float() * seg[:b.x.shape[0]].unsqueeze(1)).to(torch.bfloat16), b.handle)
    be = nv._backend
    mode0 = be.combine_mode
    # every combine kernel: split sums on the way out; pull takes the sum as its stage, beside it (expert_sum_beside),
    # or the rows summed first (expert_sum), as the push kernels do; with expert_sum_first off, the split kernels' way
    # whatever the plan
    for mode, sum_first, beside in (("split", True, True), ("fused", True, True), ("pipelined", True, True),
                                    ("pull", True, True), ("pull", True, False), ("pull", False, True)):
        be.combine_mode, be.expert_sum_first, be.expert_sum_beside = mode, sum_first, beside
        staged0 = be._rt.combine_expert_staged_calls
        ya = nv.combine((a.x.float() * seg.unsqueeze(1)).to(torch.bfloat16), a.handle)
        ran = be._rt.combine_expert_staged_calls - staged0
        assert ran == (mode == "pull" and sum_first and beside and be._combine_sms < be._gpu_sms), f"{ctx} {mode}"
        torch.testing.assert_close(ya.float(), yb.float(), atol=3e-2, rtol=2e-2,
                                   msg=f"{ctx} combine {mode} sum first {sum_first} beside {beside}")
    be.combine_mode, be.expert_sum_first, be.expert_sum_beside = mode0, True, True
    # cached: same layout, new rows
    x2 = (x.float() * 0.5 - 1).to(torch.bfloat16)
    ca = nv.dispatch(x2, handle=a.handle)
    cb = ref.dispatch(x2, handle=b.handle)
    assert torch.equal(ca.x[:n], cb.x[:n]) and ca.topk_weights is None, ctx
    # cached with new weights: merged over the handle's picks (nvlink's stage; the torch backend in Python)
    w2 = (w * 0.5 + 0.125).contiguous()
    ca = nv.dispatch(x2, None, w2, handle=a.handle)
    cb = ref.dispatch(x2, None, w2, handle=b.handle)
    assert torch.equal(ca.x[:n], cb.x[:n]) and torch.equal(ca.topk_weights[:n], cb.topk_weights[:n]), ctx
    return a


def body_expert(rank, world):
    torch.cuda.set_device(rank)
    E, K = 8 * world, 4
    seed = 500
    for host_sync in (False, True):
        for hidden in (2048, 7168):
            nv = _buf("nvlink", E, K, hidden, host_sync=host_sync)
            ref = _buf("torch", E, K, hidden)
            for alignment in (1, 16):
                modes = ("random", "skew", "nowhere", "starve_last", "repeats") if hidden == 2048 else \
                    ("random",)
                for mode in modes:
                    for tokens in (17, [0] + [9] * (world - 1), 512):
                        seed += 1
                        check_expert(nv, ref, rank, world, E, K, hidden, tokens, seed, mode, alignment)
            nv.close()
            ref.close()
    # the benchmark's shape, BF16 and FP8, default (no host sync) mode
    nv, ref = _buf("nvlink", 256, 8, 7168, max_tokens=4096, host_sync=False), _buf("torch", 256, 8, 7168, max_tokens=4096)
    check_expert(nv, ref, rank, world, 256, 8, 7168, 4096, 9, "random", 1)
    _, _, _, x, idx, w = _inputs(world, rank, 4096, 7168, 256, 8, seed=12)
    scales = x.float().abs().view(4096, 56, 128).amax(-1).clamp(min=1e-4) / 448.0
    data = (x.float().view(4096, -1, 128) / scales.unsqueeze(-1)).view(4096, 7168).to(torch.float8_e4m3fn)
    a = nv.dispatch((data, scales), idx, w, layout="expert", expert_alignment=128)
    b = ref.dispatch((data, scales), idx, w, layout="expert", expert_alignment=128)
    _same_expert(a, b, "fp8 expert-major")
    nv.close()
    ref.close()

    # CUDA graph: expert-major dispatch + combine captured once, replayed on new routings
    H = 2048
    nv, ref = _buf("nvlink", E, K, H, max_tokens=256, host_sync=False), _buf("torch", E, K, H)
    T = 256
    g, (sx, sidx, sw), res, y = _captured(nv, T, H, K, layout="expert", expert_alignment=8)
    for s, mode in enumerate(("random", "random", "skew", "repeats")):
        _, _, _, x, idx, w = _inputs(world, rank, T, H, E, K, seed=70 + s, mode=mode)
        sx.copy_(x), sidx.copy_(idx), sw.copy_(w)
        g.replay()
        torch.cuda.synchronize()
        b = ref.dispatch(x, idx, w, layout="expert", expert_alignment=8)
        n = int(b.expert_offsets[-1])
        assert res.expert_offsets.tolist() == b.expert_offsets.tolist()
        assert torch.equal(res.x[:n], b.x[:n]) and torch.equal(res.topk_weights[:n], b.topk_weights[:n])
        yb = ref.combine((b.x.float() * 2).to(torch.bfloat16), b.handle)
        torch.testing.assert_close(y.float(), yb.float(), atol=2e-2, rtol=1e-2)
    del g

    # autograd: grads of x and topk_weights through the expert-major path equal the torch backend's (with
    # repeated experts too: nvlink merges them in its kernels, each slot's gradient its expert row's), for a
    # fresh dispatch and for a cached one with new weights on the layout of a dispatch that recorded nothing
    for mode in ("random", "repeats"):
        _, _, _, x0, idx, w0 = _inputs(world, rank, 97, H, E, K, seed=78, mode=mode)
        for cached in (False, True):
            grads = []
            for buf in (nv, ref):
                x = x0.clone().requires_grad_(True)
                w = w0.clone().requires_grad_(True)
                if cached:
                    with torch.no_grad():
                        h = buf.dispatch(x0, idx, w0, layout="expert", expert_alignment=4).handle
                    res = buf.dispatch(x, None, w, handle=h)
                else:
                    res = buf.dispatch(x, idx, w, layout="expert", expert_alignment=4)
                rows = res.x * res.topk_weights.unsqueeze(1).to(torch.bfloat16)
                y = buf.combine(rows, res.handle)
                gen = torch.Generator(device="cuda").manual_seed(5 + rank)
                loss = (y.float() * torch.randn(y.shape, device="cuda", generator=gen)).sum()
                loss.backward()
                grads.append((x.grad.float(), w.grad))
            msg = f"autograd {mode} cached {cached}"
            torch.testing.assert_close(grads[0][0], grads[1][0], atol=5e-2, rtol=2e-2, msg=msg)
            torch.testing.assert_close(grads[0][1], grads[1][1], atol=5e-2, rtol=2e-2, msg=msg)
            if mode == "repeats":  # a repeated slot's gradient is its first slot's, and not zero
                rep = torch.arange(0, idx.shape[0], 2, device="cuda")
                rep = rep[idx[rep, 1] >= 0]
                assert rep.numel() and torch.equal(grads[0][1][rep, 1], grads[0][1][rep, 0]), msg
                assert bool((grads[0][1][rep, 1] != 0).any()), msg
    nv.close()
    ref.close()
    dist.barrier()


def test_nvlink_expert_major_matches_torch(nvlink_parts):
    nvlink_parts["expert"].check()


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def nvlink_parts(request, tmp_path_factory):
    """All three bodies in one spawn per world size (one process start and NCCL init instead of three);
    the one with a timeout on purpose runs last (its buffer fails, the group stays usable)."""
    world = request.param
    _need(world)
    parts = [("contract", body_contract, ()), ("expert", body_expert, ()),
             ("graph_autograd_errors", body_graph_autograd_errors, ())]
    return spawn_parts(parts, world, str(tmp_path_factory.mktemp(f"nvlink{world}")), backend="nccl", timeout=600)
