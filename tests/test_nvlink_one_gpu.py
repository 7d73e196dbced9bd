"""The nvlink backend with two ranks on ONE GPU: two processes share cuda:0 (a gloo group; the IPC
handles' all-gather goes through the CPU), so the cross-rank protocol of the kernels (notify's counts,
the stage flags, the pulls from the peer's staging, the combine's slots and flags) runs on a machine
with a single GPU. The processes' kernels take turns on the GPU (its time slices), so a wait on the
peer is slow but ends; this says nothing of speed. Checked against tests/reference.py bit for bit:
both dispatch kernels (comm.dispatch_kernel split and fused) and ranks mixing them, cached
dispatches, FP8, the combine, a CUDA-graph replay of a fused dispatch, and an odd SM count; and the
expert-major dispatch of tokens naming an expert twice (merged by notify and stage: one row, weights
summed), fresh, cached and combined, against the reference of the merged picks.
"""
import pytest
import torch
import torch.distributed as dist

from tests._dist import spawn
from tests._graph import capture, static_inputs
from ep_plugin.expert_major import merge_repeats_torch
from tests.reference import make_inputs, reference_combine, reference_dispatch, reference_expert_dispatch

pytestmark = pytest.mark.gpu

WORLD = 2


def _need_one_gpu_and_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import ep_plugin._ext as ext
    if not ext.has_c():
        pytest.skip("ep_plugin._C is not built")


def _share_one_gpu():
    """This process's GPU is cuda:0; the nvlink backend's collectives over gloo: CUDA all-gathers go
    through the CPU, and the registry is told the group is NCCL (it wants NCCL for kernel backends)."""
    torch.cuda.set_device(0)
    gather = dist.all_gather_into_tensor

    def all_gather_via_cpu(out, inp, group=None, async_op=False):
        host = out.cpu()
        gather(host, inp.cpu(), group=group)
        out.copy_(host)

    dist.all_gather_into_tensor = all_gather_via_cpu
    dist.get_backend = lambda group=None: "nccl"


def _buffer(E, K, H, M, **comm):
    import ep_plugin
    cfg = {"moe": {"num_experts": E, "topk": K},
           "comm": {"backend": "nvlink", "max_tokens_per_rank": M, "timeout_s": 120.0, "host_sync": False,
                    "num_sms": 24, **comm}}
    return ep_plugin.EPBuffer(None, cfg, hidden=H)


def _fp8(x):
    T, H = x.shape
    scales = x.float().abs().view(T, H // 128, 128).amax(-1).clamp(min=1e-4) / 448.0
    data = (x.float().view(T, -1, 128) / scales.unsqueeze(-1)).view(T, H).to(torch.float8_e4m3fn)
    return data, scales


def check(nv, rank, world, E, K, H, tokens, seed, mode, fp8=False):
    """Dispatch with the split kernel, the fused one, and (ranks mixing them) rank 0 fused only; a cached
    dispatch through each handle; a combine (BF16) of rows scaled per rank."""
    xs, idxs, ws = make_inputs(world, tokens, H, E, K, seed, torch.bfloat16, mode)
    x, idx, w = xs[rank].cuda(), idxs[rank].cuda(), ws[rank].cuda()
    ctx = f"rank {rank} H {H} tokens {tokens} mode {mode} seed {seed} fp8 {fp8}"
    rx, ridx, rw, tpe = reference_dispatch(xs, idxs, ws, rank, E)
    R = rx.shape[0]
    inp = x
    if fp8:
        inp = _fp8(x)
        every = [None] * world
        dist.all_gather_object(every, (inp[0].view(torch.uint8).cpu(), inp[1].cpu()))
        rdata = reference_dispatch([e[0] for e in every], idxs, ws, rank, E)[0]
        rscales = reference_dispatch([e[1] for e in every], idxs, ws, rank, E)[0]
    for fused in (True, False, rank == 0):  # the last: the ranks run different kernels
        nv._backend.dispatch_mode = "fused" if fused else "split"
        out = nv.dispatch(inp, idx, w)
        torch.cuda.synchronize()
        assert int(out.handle.num_recv_device) == R, (ctx, int(out.handle.num_recv_device), R)
        if fp8:
            assert torch.equal(out.x[0][:R].view(torch.uint8).cpu(), rdata), ctx
            assert torch.equal(out.x[1][:R].cpu(), rscales), ctx
        else:
            assert torch.equal(out.x[:R].cpu(), rx), (ctx, fused)
        assert torch.equal(out.topk_idx[:R].cpu(), ridx), (ctx, fused)
        assert torch.equal(out.topk_weights[:R].cpu(), rw), (ctx, fused)
        assert bool((out.topk_idx[R:] == -1).all()) and bool((out.topk_weights[R:] == 0).all()), (ctx, fused)
        assert list(out.tokens_per_expert) == tpe, ctx
        # cached: new rows and weights through the same handle
        w2 = torch.rand_like(w)
        again = nv.dispatch(inp if fp8 else x * 2, None, w2, handle=out.handle)
        torch.cuda.synchronize()
        every_w2 = [None] * world
        dist.all_gather_object(every_w2, w2.cpu())
        assert torch.equal(again.topk_weights[:R].cpu(), reference_dispatch(xs, idxs, every_w2, rank, E)[2]), ctx
        if fp8:
            assert torch.equal(again.x[0][:R].view(torch.uint8).cpu(), rdata), ctx
        else:
            assert torch.equal(again.x[:R].cpu(), (rx.cuda() * 2).cpu()), (ctx, "cached")
    nv._backend.dispatch_mode = "fused"
    if not fp8:
        rows = (out.x[:R].float() * (rank + 1) + 0.25).to(torch.bfloat16)
        full = torch.zeros_like(out.x)
        full[:R] = rows
        every_rows = [None] * world
        dist.all_gather_object(every_rows, rows.cpu())
        want = reference_combine(every_rows, idxs, rank, E)
        mode0 = nv._backend.combine_mode
        for cmode in (mode0, "pull"):  # the configured combine, and the pull kernel (remote reads)
            nv._backend.combine_mode = cmode
            y = nv.combine(full, out.handle)
            torch.testing.assert_close(y.float().cpu(), want, atol=2e-2, rtol=1e-2, msg=f"{ctx} combine {cmode}")
        nv._backend.combine_mode = mode0


def check_expert_repeats(nv, rank, world, E, K, H, tokens, seed, mode, alignment):
    """Expert-major dispatch (nvlink merges repeated experts in notify and stage) against the reference of
    the merged picks (merge_repeats' definition), bit for bit; a cached one with new weights; the combine
    (each token times its distinct experts). Gradients: test_nvlink.py (an NCCL group; the weights' backward
    is a torch.distributed all-to-all of CUDA tensors, which this gloo group does not move)."""
    xs, idxs, ws = make_inputs(world, tokens, H, E, K, seed, torch.bfloat16, mode)
    x, idx, w = xs[rank].cuda(), idxs[rank].cuda(), ws[rank].cuda()
    ctx = f"expert-major rank {rank} H {H} tokens {tokens} mode {mode} seed {seed} align {alignment}"

    def reference(weights):
        merged = [merge_repeats_torch(i, wt) for i, wt in zip(idxs, weights)]
        return reference_expert_dispatch(xs, [m[0] for m in merged], [m[1] for m in merged], rank, E, alignment)

    rx, rw, offsets, tpe = reference(ws)
    n = offsets[-1]
    out = nv.dispatch(x, idx, w, layout="expert", expert_alignment=alignment)
    torch.cuda.synchronize()
    assert out.expert_offsets.tolist() == offsets, (ctx, out.expert_offsets.tolist(), offsets)
    assert list(out.tokens_per_expert) == tpe and out.num_tokens_per_expert.tolist() == tpe, ctx
    assert torch.equal(out.x[:n].cpu(), rx), ctx
    assert torch.equal(out.topk_weights[:n].cpu(), rw), ctx
    w2 = torch.rand_like(w)
    again = nv.dispatch(x * 2, None, w2, handle=out.handle)
    torch.cuda.synchronize()
    every_w2 = [None] * world
    dist.all_gather_object(every_w2, w2.cpu())
    assert torch.equal(again.topk_weights[:n].cpu(), reference(every_w2)[1]), (ctx, "cached")
    assert torch.equal(again.x[:n].cpu(), (rx.cuda() * 2).cpu()), (ctx, "cached")
    y = nv.combine(out.x, out.handle)
    copies = (merge_repeats_torch(idxs[rank], None)[0] >= 0).sum(1, keepdim=True).cuda()
    torch.testing.assert_close(y.float(), (x.float() * copies).to(torch.bfloat16).float(), atol=2e-2, rtol=1e-2,
                               msg=f"{ctx} combine")


def check_graph(rank, world, E, K, H, T):
    """A fused dispatch captured in a CUDA graph, replayed on new routings."""
    nv = _buffer(E, K, H, T, dispatch_kernel="fused")
    sx, sidx, sw = static_inputs(T, H, K)

    def warmup():
        warm = nv.dispatch(sx, sidx, sw)
        nv.combine(warm.x, warm.handle)

    graph, res = capture(lambda: nv.dispatch(sx, sidx, sw), warmup)
    for s in range(3):
        xs, idxs, ws = make_inputs(world, T, H, E, K, 500 + s, torch.bfloat16, "random" if s < 2 else "skew")
        sx.copy_(xs[rank].cuda())
        sidx.copy_(idxs[rank].cuda())
        sw.copy_(ws[rank].cuda())
        graph.replay()
        torch.cuda.synchronize()
        rx, ridx, rw, _ = reference_dispatch(xs, idxs, ws, rank, E)
        R = rx.shape[0]
        assert int(res.handle.num_recv_device) == R and torch.equal(res.x[:R].cpu(), rx), f"graph replay {s}"
        assert torch.equal(res.topk_idx[:R].cpu(), ridx) and torch.equal(res.topk_weights[:R].cpu(), rw), s
    del graph
    nv.close()


def body(rank, world):
    _share_one_gpu()
    E, K, seed = 8 * world, 4, 0
    for H in (2048, 7168):
        nv = _buffer(E, K, H, 512)
        for mode in (("random", "skew", "nowhere", "starve_last") if H == 2048 else ("random",)):
            for tokens in (17, [0] + [9] * (world - 1), 300, 1):
                seed += 1
                check(nv, rank, world, E, K, H, tokens, seed, mode)
        check(nv, rank, world, E, K, H, 300, 99, "random", fp8=True)
        nv.close()
    check_graph(rank, world, E, K, 2048, 256)
    for host_sync in (False, True):  # expert-major with repeated experts, both sizing modes
        nv = _buffer(E, K, 2048, 512, host_sync=host_sync)
        for mode in ("repeats", "random"):
            for tokens, alignment in ((17, 1), ([0] + [9] * (world - 1), 4), (300, 16)):
                seed += 1
                check_expert_repeats(nv, rank, world, E, K, 2048, tokens, seed, mode, alignment)
        check(nv, rank, world, E, K, 2048, 300, seed + 1, "repeats")  # rank-major: repeats stay (one row per rank)
        nv.close()
    nv = _buffer(E, K, 2048, 512, num_sms=7)  # an odd SM count
    check(nv, rank, world, E, K, 2048, 300, 123, "random")
    nv.close()


def test_two_ranks_on_one_gpu_match_the_reference():
    _need_one_gpu_and_kernels()
    spawn(body, WORLD, backend="gloo", timeout=400)
