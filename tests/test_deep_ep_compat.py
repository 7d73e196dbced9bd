"""ep_plugin.deep_ep (DeepEP V1's API over EPBuffer) on CPU gloo groups with the torch backend: the
checks of DeepEP v1.2.1's tests/test_intranode.py (layout, dispatch with and without top-k, FP8,
num_worst_tokens, cached dispatch, combine of rows and weights), re-stated here for worlds of 2 and 3.
On GPUs, DeepEP's own test file is the acceptance (see the nvshmem/DeepEP issues)."""
import sys

import pytest
import torch
import torch.distributed as dist

import ep_plugin.deep_ep as deep_ep
from tests._dist import spawn
from tests.reference import reference_dispatch


def _fp8(x):
    """Per-token, per-128-channel FP8 cast (DeepEP's per_token_cast_to_fp8)."""
    T, H = x.shape
    v = x.float().view(T, H // 128, 128)
    amax = v.abs().amax(-1).clamp(min=1e-4)
    return (v * (448.0 / amax.unsqueeze(-1))).view(T, H).to(torch.float8_e4m3fn), amax / 448.0


def _fp8_back(data, scales):
    T, H = data.shape
    return (data.float().view(T, H // 128, 128) * scales.unsqueeze(-1)).view(T, H)


def body(rank, world):
    group = dist.group.WORLD
    T, H, K, E = 64, 256, 4, 4 * world
    buf = deep_ep.Buffer(group, int(1e8), 0, ep_config={"comm": {"backend": "torch", "max_tokens_per_rank": 128}})
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.ones((T, H), dtype=torch.bfloat16) * rank
    x_rand = torch.randn((T, H), generator=g).to(torch.bfloat16)
    x_e4m3 = _fp8(x)
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T)  # column-major scales, as DeepEP's test passes them
    scores = torch.rand((T, E), generator=g) + 1
    topk_idx = torch.topk(scores, K, dim=-1, sorted=False)[1]
    topk_idx[::7, -1] = -1  # some tokens use fewer experts
    topk_weights = torch.ones((T, K), dtype=torch.float32) * rank
    topk_weights_rand = torch.randn((T, K), generator=g)
    epr = E // world
    rank_idx = torch.where(topk_idx >= 0, topk_idx // epr, -1)
    num_tokens_per_expert = torch.stack([(topk_idx == e).sum() for e in range(E)]).int()
    gbl_per_expert = num_tokens_per_expert.clone()
    dist.all_reduce(gbl_per_expert)
    is_token_in_rank = torch.stack([(rank_idx == r).any(1) for r in range(world)], 1)
    num_tokens_per_rank = is_token_in_rank.sum(0).int()
    gbl_per_rank = num_tokens_per_rank.clone()
    dist.all_reduce(gbl_per_rank)

    ref_rank, rdma, ref_expert, ref_in, _ = buf.get_dispatch_layout(topk_idx, E)
    assert rdma is None
    assert torch.equal(ref_rank, num_tokens_per_rank) and torch.equal(ref_expert, num_tokens_per_expert)
    assert torch.equal(ref_in, is_token_in_rank)

    # every rank's inputs, for the reference: where each received row came from AND what it holds
    def gather(t):
        out = [None] * world
        dist.all_gather_object(out, t)
        return out

    idx_all, wr_all, w_all, xr_all = gather(topk_idx), gather(topk_weights_rand), gather(topk_weights), gather(x_rand)
    x_all = [torch.ones((T, H), dtype=torch.bfloat16) * r for r in range(world)]

    def check_reference(current, with_topk, recv_x, recv_idx, recv_w, ctx):
        """The received rows, local expert indices and weights equal reference_dispatch's, row for row."""
        rows = xr_all if current is x_rand else x_all
        if isinstance(current, tuple):
            rows = [_fp8_back(*_fp8(t)).to(torch.bfloat16) for t in rows]
        rx, ridx, rw, _ = reference_dispatch(rows, idx_all, wr_all if current is x_rand else w_all, rank, E)
        assert torch.equal(recv_x, rx), ctx
        if with_topk:
            assert torch.equal(recv_idx, ridx) and torch.equal(recv_w, rw), ctx

    def check_data(check_x, prefix):
        assert torch.equal(check_x.amin(1), check_x.amax(1))
        start = 0
        for i in range(world):
            end = int(prefix[i][rank])
            assert int((check_x[start:end].int() - i).abs().sum()) == 0
            start = end

    for previous in (False, True):
        for current in (x_rand, x, x_e4m3):
            for with_topk in (False, True):
                ctx = f"rank {rank} previous {previous} fp8 {isinstance(current, tuple)} topk {with_topk}"
                args = dict(x=current, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                            num_tokens_per_expert=num_tokens_per_expert, config=deep_ep.Config(20, 8, 256))
                if with_topk:
                    args.update(topk_idx=topk_idx, topk_weights=topk_weights_rand if current is x_rand else topk_weights)
                if previous:
                    args.update(previous_event=buf.capture())
                recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(**args)
                recv_x = _fp8_back(*recv_x).to(torch.bfloat16) if isinstance(recv_x, tuple) else recv_x
                prefix = handle[0]
                assert int(gbl_per_rank[rank]) == recv_x.shape[0], ctx
                assert gbl_per_expert.view(world, -1)[rank].tolist() == counts, ctx
                check_reference(current, with_topk, recv_x, recv_idx, recv_w, ctx)
                if current is not x_rand:
                    check_data(recv_x, prefix)
                w_clone = None
                if with_topk:
                    assert bool(((recv_idx == -1) | ((recv_idx >= 0) & (recv_idx < epr))).all()), ctx
                    for i, c in enumerate(counts):
                        assert int(recv_idx.eq(i).sum()) == c, ctx
                    w_clone = recv_w.clone()
                    if current is not x_rand:
                        recv_w[recv_idx.eq(-1)] = recv_w.amax(1, keepdim=True).expand_as(recv_w)[recv_idx.eq(-1)]
                        check_data(recv_w, prefix)
                    worst = T * world
                    wx, widx, ww, empty, _, _ = buf.dispatch(**dict(args, num_worst_tokens=worst))
                    wx = _fp8_back(*wx).to(torch.bfloat16) if isinstance(wx, tuple) else wx
                    assert empty == [] and wx.shape[0] == worst and widx.shape[0] == worst and ww.shape[0] == worst
                    n = recv_x.shape[0]
                    assert torch.equal(recv_x, wx[:n]) and torch.equal(recv_idx, widx[:n]), ctx
                    assert torch.equal(w_clone, ww[:n]) and bool((widx[n:] == -1).all()), ctx
                else:  # cached dispatch
                    cx, *_ = buf.dispatch(x=current, handle=handle, config=deep_ep.Config(20, 8, 256))
                    cx = _fp8_back(*cx).to(torch.bfloat16) if isinstance(cx, tuple) else cx
                    check_reference(current, False, cx, None, None, ctx + " cached")
                    if current is not x_rand:
                        check_data(cx, prefix)
                cargs = dict(x=recv_x, handle=handle)
                if with_topk:
                    cargs.update(topk_weights=recv_w)
                combined, combined_w, _ = buf.combine(**cargs)
                reached = is_token_in_rank.sum(1, keepdim=True)
                ref = x_rand if current is x_rand else x
                if isinstance(current, tuple):
                    ref = _fp8_back(*_fp8(ref)).to(torch.bfloat16)  # what the FP8 rows carried
                check = combined.float() / reached.clamp(min=1)
                got = torch.where(reached > 0, check, ref.float())
                torch.testing.assert_close(got, ref.float(), atol=2e-2, rtol=2e-2, msg=ctx)
                if with_topk:
                    cw = combined_w if current is x_rand else combined_w / reached.clamp(min=1)
                    ref_w = topk_weights_rand if current is x_rand else topk_weights
                    live = (reached > 0).expand_as(ref_w)
                    if current is x_rand:  # an unused slot (-1) carries its weight nowhere
                        live = live & (topk_idx >= 0)
                    torch.testing.assert_close(cw[live], ref_w[live], msg=ctx)
    with pytest.raises(NotImplementedError, match="low_latency_dispatch"):
        buf.low_latency_dispatch(x, topk_idx, 128, E)
    with pytest.raises(NotImplementedError, match="num_tokens_per_rdma_rank"):
        buf.dispatch(x, num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rank,
                     is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert)
    with pytest.raises(ValueError, match="num_tokens_per_expert"):
        buf.dispatch(x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank)
    buf.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_deep_ep_api_like_test_intranode(world):
    spawn(body, world)


def test_install_makes_import_deep_ep_resolve_here():
    prev = sys.modules.get("deep_ep")
    deep_ep.install()
    try:
        import deep_ep as d
        assert d is deep_ep and d.Buffer is deep_ep.Buffer and d.Config(24).num_sms == 24
    finally:
        deep_ep.uninstall()
    assert sys.modules.get("deep_ep") is prev
    with pytest.raises(ValueError, match="even"):
        deep_ep.Buffer.set_num_sms(7)
