"""ep_plugin.deep_ep's low-latency calls (DeepEP V1.2.1's low_latency_dispatch / low_latency_combine)
on CPU gloo groups with the torch reference engine: the checks of DeepEP's tests/test_low_latency.py
(received rows per expert, recv_count, handle[0] / handle[1], cumulative stats, FP8 with and without
round_scale and UE8M0, hook and async modes, combine = x * the sum of the valid weights, zero copy),
re-stated against a brute-force reference, with the errors of the unsupported arguments. On GPUs,
DeepEP's own test file is the acceptance (.deepep_tests/tests/test_low_latency_ep_plugin.py)."""
import pytest
import torch
import torch.distributed as dist

import ep_plugin.deep_ep as deep_ep
from ep_plugin.deep_ep.low_latency import _pack_ue8m0, _ue8m0_target, low_latency_size_hint
from tests._dist import spawn
from tests.reference import ll_combine_reference, reference_cast_fp8

RANK_OFFSET = 128


def calc_diff(x, y):
    """1 - cosine-like similarity of x + 1 and y + 1 (DeepEP's calc_diff)."""
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def cast_back(data, scales):
    """FP8 rows [N, H] and their scales [N, H/128] float32 or [N, H/512] int32 (UE8M0, four exponent
    bytes each) back to BF16 (DeepEP's per_token_cast_back)."""
    N, H = data.shape
    if scales.dtype == torch.int32:
        exps = scales.contiguous().view(torch.uint8).to(torch.int32).view(N, H // 128)
        scales = (exps << 23).view(torch.float32)
    v = data.float().view(N, H // 128, 128) * scales.reshape(N, H // 128, 1)
    return v.view(N, H).to(torch.bfloat16)


def gather_padded(t, M, fill):
    """Every rank's t [T_r, ...] (T_r <= M) padded to M rows: [W, M, ...]."""
    pad = t.new_full((M,) + tuple(t.shape[1:]), fill)
    pad[:t.shape[0]] = t
    out = [torch.empty_like(pad) for _ in range(dist.get_world_size())]
    dist.all_gather(out, pad)
    return torch.stack(out)


def body(rank, world):
    torch.set_num_threads(1)
    group = dist.group.WORLD
    M, H, K, E = 16, 1024, 3, 4 * world
    E_l, N = E // world, world * M
    T = M - 3 * rank  # ranks dispatch different numbers of tokens, up to M
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, world, E)
    assert hint == low_latency_size_hint(M, H, world, E) and hint > 2 * E * M * H * 2 and hint % 16 == 0
    # the documented layout, computed here: two halves of signal words, counts, dispatch slots, combine rows
    a16 = lambda n: (n + 15) // 16 * 16  # noqa: E731
    assert hint == 2 * (3 * a16(8 * world) + a16(4 * E) + a16(E * M * a16(16 + 2 * H)) + a16(2 * H * M * 16)), hint
    buf = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=E_l,
                         allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True,
                         ep_config={"comm": {"backend": "torch"}})
    g = torch.Generator().manual_seed(7 + rank)
    x_pattern = torch.ones((T, H), dtype=torch.bfloat16) * (rank - RANK_OFFSET)
    x_pattern[:, -128:] = torch.arange(T).to(torch.bfloat16).view(-1, 1)
    x_rand = (torch.randn((T, H), generator=g) * 0.5).to(torch.bfloat16)
    scores = torch.rand((T, E), generator=g) + 1
    topk_idx = torch.topk(scores, K, dim=-1)[1]
    topk_idx[torch.randint(0, T, (5,), generator=g), torch.randint(0, K, (5,), generator=g)] = -1
    topk_idx[0] = -1  # a token routed nowhere
    topk_weights = torch.rand((T, K), generator=g) + 0.1
    all_idx = gather_padded(topk_idx, M, -1)  # [W, M, K]
    valid_w = topk_weights.masked_fill(topk_idx == -1, 0).sum(1, keepdim=True)

    # brute force: per local expert, the (source, token) of each row in the contract's order
    expect = []
    for e in range(E_l):
        gid = rank * E_l + e
        expect.append([(s, t) for s in range(world) for t in range(M) if bool((all_idx[s, t] == gid).any())])

    for x in (x_pattern, x_rand):
        all_x = gather_padded(x, M, 0)  # [W, M, H]
        for hook_mode in (False, True):
            for use_fp8, round_scale, ue8m0 in ((False, False, False), (True, False, False), (True, True, False),
                                                (True, True, True)):
                ctx = f"rank {rank} hook {hook_mode} fp8 {use_fp8} round {round_scale} ue8m0 {ue8m0}"
                stats = torch.zeros(E_l, dtype=torch.int32)
                for _ in range(2):  # the stats accumulate over calls
                    recv_x, count, handle, event, hook = buf.low_latency_dispatch(
                        x, topk_idx, M, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                        round_scale=round_scale, use_ue8m0=ue8m0, async_finish=not hook_mode,
                        return_recv_hook=hook_mode)
                    assert isinstance(event, deep_ep.EventOverlap), ctx
                    if hook_mode:
                        assert callable(hook), ctx
                        hook()
                    else:
                        assert hook is None, ctx
                        event.current_stream_wait()
                # shapes and dtypes
                if use_fp8:
                    data, scales = recv_x
                    assert data.shape == (E_l, N, H) and data.dtype == torch.float8_e4m3fn, ctx
                    G = H // 512 if ue8m0 else H // 128
                    assert scales.shape == (E_l, N, G), ctx
                    assert scales.dtype == (torch.int32 if ue8m0 else torch.float32), ctx
                    assert scales.transpose(1, 2).is_contiguous(), ctx  # column-major, as DeepEP's
                    rows = cast_back(data.view(-1, H), scales.contiguous().view(-1, G)).view(E_l, N, H)
                else:
                    assert isinstance(recv_x, torch.Tensor) and recv_x.shape == (E_l, N, H), ctx
                    assert recv_x.dtype == torch.bfloat16, ctx
                    rows = recv_x.clone()
                assert count.shape == (E_l,) and count.dtype == torch.int32, ctx
                assert isinstance(handle, tuple) and len(handle) == 5 and tuple(handle[2:]) == (M, H, E), ctx
                src_info, layout_range = handle[0], handle[1]
                assert src_info.shape == (E_l, N) and src_info.dtype == torch.int32, ctx
                assert layout_range.shape == (E_l, world) and layout_range.dtype == torch.int64, ctx
                assert torch.equal(stats, 2 * count), ctx
                for e in range(E_l):
                    n = int(count[e])
                    assert n == len(expect[e]) == int((all_idx == rank * E_l + e).sum()), ctx
                    assert src_info[e, :n].tolist() == [t for _, t in expect[e]], ctx
                    begin = 0
                    for s in range(world):
                        c = sum(1 for src, _ in expect[e] if src == s)
                        assert int(layout_range[e, s]) == (begin << 32) | c, ctx
                        begin += c
                    assert int((layout_range[e] & (2 ** 32 - 1)).sum()) == n, ctx
                    if n == 0:
                        continue
                    sent = torch.stack([all_x[s, t] for s, t in expect[e]])
                    if not use_fp8:
                        assert torch.equal(recv_x[e, :n], sent), ctx
                    else:
                        ref_data, ref_scales = reference_cast_fp8(sent, round_scale)
                        assert torch.equal(data[e, :n].view(torch.uint8), ref_data.view(torch.uint8)), ctx
                        if ue8m0:
                            exps = (ref_scales.view(torch.int32) >> 23) & 0xFF
                            got = scales[e, :n].contiguous().view(torch.uint8).view(n, H // 128).to(torch.int32)
                            assert torch.equal(got, exps), ctx
                        else:
                            assert torch.equal(scales[e, :n], ref_scales), ctx
                    if x is x_pattern:  # DeepEP's checks: each source's rows carry its rank, then the token index
                        got = rows[e, :n]
                        assert torch.equal(got[:, -128:].float(), src_info[e, :n].float().view(-1, 1).expand(n, 128)), ctx
                        for s in range(world):
                            b, c = int(layout_range[e, s]) >> 32, int(layout_range[e, s]) & (2 ** 32 - 1)
                            blk = got[b:b + c, :-128].float()
                            assert bool(((blk - (s - RANK_OFFSET)).abs() <= (1.0 if round_scale else 0)).all()), ctx

                # combine: y = x * sum of the valid weights, as DeepEP's test checks it
                ref = x if not use_fp8 else cast_back(*reference_cast_fp8(x, round_scale))
                for zero_copy in (False, True):
                    for with_out in (False, True):
                        if zero_copy:
                            buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = rows
                        out = torch.empty((T, H), dtype=torch.bfloat16) if with_out else None
                        y, event, chook = buf.low_latency_combine(rows, topk_idx, topk_weights, handle,
                                                                  zero_copy=zero_copy, async_finish=not hook_mode,
                                                                  return_recv_hook=hook_mode, out=out)
                        chook() if hook_mode else event.current_stream_wait()
                        assert (chook is None) != hook_mode, ctx
                        assert y.shape == (T, H) and y.dtype == torch.bfloat16, ctx
                        if with_out:
                            assert y.data_ptr() == out.data_ptr(), ctx
                        assert not bool(torch.isnan(y).any()), ctx
                        diff = calc_diff(ref.float() * valid_w, y)
                        assert diff < (9e-4 if use_fp8 else 1e-5), f"{ctx} zero_copy {zero_copy}: {diff=}"
                        assert bool((y[0] == 0).all()), ctx  # routed nowhere: zeros
                        if not use_fp8:  # the contract's exact order (the default combine_reduce, owner)
                            want = ll_combine_reference([x.float()] * K, topk_idx, topk_weights, E_l)
                            assert torch.equal(y, want), ctx

    # expert outputs that differ per expert: each row times (its local expert + 1)
    recv_x, count, handle, event, hook = buf.low_latency_dispatch(x_rand, topk_idx, M, E, use_fp8=False)
    scaled = recv_x * torch.arange(1, E_l + 1, dtype=torch.bfloat16).view(E_l, 1, 1)
    y, event, hook = buf.low_latency_combine(scaled, topk_idx, topk_weights, handle)
    assert event.event is None and hook is None
    factor = (topk_idx % E_l + 1).float().masked_fill(topk_idx == -1, 0)
    want = x_rand.float() * (topk_weights * factor).sum(1, keepdim=True)
    assert calc_diff(want, y) < 1e-5

    # the mask calls map onto EPBuffer.set_low_latency_mask
    (inner,) = {id(b): b for b in buf._ll_buffers.values()}.values()
    seen = []
    orig = inner.set_low_latency_mask
    inner.set_low_latency_mask = lambda ranks: (seen.append(list(ranks)), orig(ranks))[1]
    status = torch.full((world,), 7, dtype=torch.int32)
    buf.low_latency_update_mask_buffer(world - 1, True)
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * (world - 1) + [1]
    buf.low_latency_update_mask_buffer(world - 1, False)
    buf.low_latency_update_mask_buffer(0, True)
    buf.low_latency_clean_mask_buffer()
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * world and seen == [[world - 1], [], [0], []]
    inner.set_low_latency_mask = orig
    with pytest.raises(ValueError, match="rank_to_mask"):
        buf.low_latency_update_mask_buffer(world, True)

    # clean_low_latency_buffer: nothing to clean, arguments checked
    buf.clean_low_latency_buffer(M, H, E)
    with pytest.raises(ValueError, match="divisible"):
        buf.clean_low_latency_buffer(M, H, E + 1)

    # a round after the mask calls still runs (mask cleared)
    recv_x, count, handle, event, hook = buf.low_latency_dispatch(x_pattern, topk_idx, M, E, use_fp8=False,
                                                                  return_recv_hook=True)
    hook()
    assert count.tolist() == [len(v) for v in expect]

    # unsupported arguments and wrong calls: errors naming them (raised before any communication)
    with pytest.raises(NotImplementedError, match="dispatch_wait_recv_cost_stats"):
        buf.low_latency_dispatch(x_pattern, topk_idx, M, E, dispatch_wait_recv_cost_stats=torch.zeros(world, dtype=torch.int64))
    with pytest.raises(NotImplementedError, match="use_logfmt"):
        buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle, use_logfmt=True)
    with pytest.raises(NotImplementedError, match="combine_wait_recv_cost_stats"):
        buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle,
                                combine_wait_recv_cost_stats=torch.zeros(world, dtype=torch.int64))
    with pytest.raises(ValueError, match="async_finish and return_recv_hook"):
        buf.low_latency_dispatch(x_pattern, topk_idx, M, E, async_finish=True, return_recv_hook=True)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        buf.low_latency_dispatch(x_pattern, topk_idx, T - 1, E)
    with pytest.raises(ValueError, match="round_scale"):
        buf.low_latency_dispatch(x_pattern, topk_idx, M, E, use_fp8=True, use_ue8m0=True)
    with pytest.raises(ValueError, match="divisible"):
        buf.low_latency_dispatch(x_pattern, topk_idx, M, E + 1)
    with pytest.raises(TypeError, match="bfloat16"):
        buf.low_latency_dispatch(x_pattern.float(), topk_idx, M, E)
    with pytest.raises(TypeError, match="torch.int"):
        buf.low_latency_dispatch(x_pattern, topk_idx, M, E, cumulative_local_expert_recv_stats=torch.zeros(E_l))
    with pytest.raises(ValueError, match="shape"):
        buf.low_latency_combine(recv_x[:, :M], topk_idx, topk_weights, handle)
    with pytest.raises(TypeError, match="low_latency_dispatch"):
        buf.low_latency_combine(recv_x, topk_idx, topk_weights, tuple(handle))
    with pytest.raises(ValueError, match="out"):
        buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle, out=torch.empty((T, H)))
    y, _, _ = buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle)  # the round's combine
    assert calc_diff(x_pattern.float() * valid_w, y) < 1e-5

    # which EPBuffer serves: low-latency only (num_nvl_bytes=0): its own, normal path sized to M tokens
    (only,) = {id(b): b for b in buf._ll_buffers.values()}.values()
    assert only.cfg.comm.low_latency.max_tokens_per_rank == M and only.cfg.comm.max_tokens_per_rank == M
    assert not buf._buffers
    # with num_nvl_bytes: one EPBuffer for both kinds of call, whichever comes first
    for ll_first in (True, False):
        cfg = {"comm": {"backend": "torch"}} if ll_first else \
            {"comm": {"backend": "torch", "low_latency": {"max_tokens_per_rank": M}}}
        both = deep_ep.Buffer(group, int(1e8), 0, low_latency_mode=True, ep_config=cfg)
        for step in ((0, 1) if ll_first else (1, 0)):
            if step == 0:
                rx, cnt, h, _, _ = both.low_latency_dispatch(x_pattern, topk_idx, M, E, use_fp8=False)
                y, _, _ = both.low_latency_combine(rx, topk_idx, topk_weights, h)
                assert calc_diff(x_pattern.float() * valid_w, y) < 1e-5
            else:
                per_rank, _, per_expert, in_rank, _ = both.get_dispatch_layout(topk_idx, E)
                _, _, _, counts, _, _ = both.dispatch(x_pattern, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                      topk_weights=topk_weights)
                assert counts == [len(v) for v in expect]
        assert h.buffer is both._buffers[(H, E)] and list(both._ll_buffers.values()) == [h.buffer]
        assert cnt.tolist() == counts
        both.destroy()

    # low-latency calls need low_latency_mode=True, as in DeepEP
    normal = deep_ep.Buffer(group, int(1e8), 0, ep_config={"comm": {"backend": "torch"}})
    with pytest.raises(NotImplementedError, match="low_latency_mode=True"):
        normal.low_latency_dispatch(x_pattern, topk_idx, M, E)
    normal.destroy()
    buf.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.low_latency_dispatch(x_pattern, topk_idx, M, E)


def test_deep_ep_low_latency_like_test_low_latency():
    spawn(body, 2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ue8m0_packing(device):
    """Four exponent bytes per int32, little-endian along the scale dim, in a column-major tensor. On CUDA
    too: a shift written straight into the uint8 view gave zeros there (the kernel casts first), not here."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    E_l, N, G = 2, 8, 8
    exps = torch.randint(-20, 5, (E_l, N, G), device=device)
    scales = torch.pow(2.0, exps.float()).transpose(1, 2).contiguous().transpose(1, 2)  # the engine's layout
    packed = _ue8m0_target(scales)
    _pack_ue8m0(scales, packed)
    assert packed.shape == (E_l, N, G // 4) and packed.dtype == torch.int32 and packed.transpose(1, 2).is_contiguous()
    b = (exps + 127).to(torch.int64)
    want = b[..., 0::4] | (b[..., 1::4] << 8) | (b[..., 2::4] << 16) | (b[..., 3::4] << 24)
    assert torch.equal(packed.to(torch.int64) & 0xFFFFFFFF, want)
    back = (packed.contiguous().view(torch.uint8).to(torch.int32).view(E_l, N, G) << 23).view(torch.float32)
    assert torch.equal(back, scales)


def test_size_hint_formula():
    M, H, W, E = 128, 7168, 8, 288
    slot = 16 + 2 * H  # a multiple of 16 here, as every term
    half = 3 * 8 * W + 4 * E + E * M * slot + 2 * H * M * 16  # the NVSHMEM engine's layout (ll_runtime.cu)
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, W, E) == 2 * half
    import ep_plugin._ext as ext
    if ext.has_c() and ext.get_c().HAS_NVSHMEM:  # what the engine allocates (16 top-k slots, as the hint assumes)
        for M, H, W, E in ((128, 7168, 8, 288), (32, 1032, 3, 12), (1, 256, 2, 4)):
            assert deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, W, E) == \
                ext.get_c().LowLatencyRuntime.heap_bytes(W, E, M, 16, H), (M, H, W, E)
    with pytest.raises(ValueError, match="divisible"):
        deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, W, E + 1)
