"""The low-latency calls (docs/LOW_LATENCY.md) on the torch engine, through EPBuffer.

The contract tests run in real gloo groups of 2 and 3 ranks and compare every output with a
brute-force computation of the contract over all ranks' inputs (gathered): rows packed per expert by
source rank then token, src_info, layout_range, counts, the FP8 cast, the weighted combine. The
argument checks run in a one-rank group inside this process (no collective is reached), one test per
family of errors.
"""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.backends import registry
from ep_plugin.errors import BackendUnavailableError, ConfigError, EPTimeoutError
from ep_plugin.types import LowLatencyHandle
from tests._dist import parts_per_world

M = 16     # comm.low_latency.max_tokens_per_rank
K = 3
GARBAGE = 1.0e4  # fills the combine input past each expert's rows: a read of it shows in y


def make_buffer(world, E_l, hidden, **comm):
    cfg = {"moe": {"num_experts": E_l * world, "topk": K},
           "comm": {"backend": "torch", "low_latency": {"max_tokens_per_rank": M}, **comm}}
    return ep_plugin.EPBuffer(None, cfg, hidden=hidden)


# --------------------------------------------------------------------------- brute force of the contract

def routing(T, E, seed, mode):
    """(x [T, H] BF16 later, topk_idx [T, K]): random distinct experts with some -1; skew: every token
    to expert 0 only; nowhere: all -1."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.empty(0, K, dtype=torch.int64)
    if mode == "random" and T:
        idx[torch.rand(T, K, generator=g) < 0.2] = -1
    elif mode == "skew":
        idx[:] = -1
        idx[:, 1] = 0
    elif mode == "nowhere":
        idx[:] = -1
    return idx


def gather(t):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t)
    return out


def expected_dispatch(xs, idxs, rank, E_l, mask):
    """What `rank` receives: (rows BF16 [E_l, W*M, H], counts [E_l], src_info (valid entries, -1
    elsewhere), layout_range [E_l, W]). A row travels unless its source or destination is masked."""
    W, H = len(xs), xs[0].shape[1]
    rows = torch.zeros(E_l, W * M, H, dtype=torch.bfloat16)
    src_info = torch.full((E_l, W * M), -1, dtype=torch.int32)
    layout = torch.zeros(E_l, W, dtype=torch.int64)
    counts = torch.zeros(E_l, dtype=torch.int32)
    for e in range(E_l):
        expert = rank * E_l + e
        n = 0
        for s in range(W):
            begin = n
            if s not in mask and rank not in mask:
                for t, experts in enumerate(idxs[s].tolist()):
                    if expert in experts:
                        rows[e, n] = xs[s][t]
                        src_info[e, n] = t
                        n += 1
            layout[e, s] = (begin << 32) | (n - begin)
        counts[e] = n
    return rows, counts, src_info, layout


def expected_fp8(rows, round_scale):
    """The contract's cast, per 128 channels in float32: (data as uint8 bits, scales)."""
    lead, H = rows.shape[:-1], rows.shape[-1]
    f = rows.float().reshape(-1, H // 128, 128)
    amax = f.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    r = float(torch.tensor(1 / 448, dtype=torch.float32))  # float32(1/448): the contract's constant
    if round_scale:
        scale = torch.pow(2.0, torch.ceil(torch.log2(amax * r)))
        data = f * torch.reciprocal(scale)
    else:
        scale = amax * r
        data = f * (torch.reciprocal(amax) * 448)
    return (data.to(torch.float8_e4m3fn).view(torch.uint8).reshape(*lead, H),
            scale.reshape(*lead, H // 128))


def dequantized(data, scales):
    return (data.float() * scales.repeat_interleave(128, dim=-1)).to(torch.bfloat16)


def expert_output(rows, rank, E_l):
    """What the test's experts make of their rows: a different affine map per global expert."""
    scale = 1 + 0.125 * (rank * E_l + torch.arange(E_l, dtype=torch.float32))
    return (rows.float() * scale.view(-1, 1, 1) - 0.5).to(torch.bfloat16)


def expected_combine(idxs, ws, outputs, infos, rank, E_l, mask, owner=False):
    """y on `rank`: acc = acc + w * row over k ascending in float32, BF16 at the end. outputs[d] and
    infos[d] = (src_info, layout_range) are rank d's expert outputs and its dispatch layout. owner
    (combine_reduce owner): each rank's picks summed that way into BF16 first, those sums added in
    float32 in the order of each rank's first pick."""
    idx, w = idxs[rank], ws[rank]
    T, H = idx.shape[0], outputs[0].shape[-1]
    y = torch.zeros(T, H, dtype=torch.float32)
    for t in range(T):
        acc = torch.zeros(H, dtype=torch.float32)
        sums = {}  # owner: rank -> its float32 sum, in the order of first picks
        for k in range(K):
            g = int(idx[t, k])
            d, e = divmod(g, E_l)
            if g < 0 or d in mask or rank in mask:
                continue
            src_info, layout = infos[d]
            begin, count = int(layout[e, rank]) >> 32, int(layout[e, rank]) & 0xFFFFFFFF
            slot = begin + src_info[e, begin:begin + count].tolist().index(t)
            if owner:
                sums[d] = sums.get(d, torch.zeros(H, dtype=torch.float32)) + w[t, k] * outputs[d][e, slot].float()
            else:
                acc = acc + w[t, k] * outputs[d][e, slot].float()
        for part in sums.values():
            acc = acc + part.to(torch.bfloat16).float()
        y[t] = acc
    return y.to(torch.bfloat16)


def check_case(buf, rank, world, E_l, hidden, tokens, mode, seed, *, use_fp8, round_scale=False,
               hook=False, async_op=False, mask=(), recv_stats=None, device="cpu"):
    """One dispatch + combine through `buf`, every output against the brute force (on the CPU);
    returns the counts."""
    ctx = f"rank {rank}/{world} E_l {E_l} H {hidden} tokens {tokens} {mode} fp8 {use_fp8} round {round_scale} " \
          f"hook {hook} mask {mask}"
    E = E_l * world
    T = tokens[rank]
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = (torch.randn(T, hidden, generator=g) * (1 + rank)).to(torch.bfloat16)
    idx = routing(T, E, 1000 * seed + rank, mode)
    w = torch.rand(T, K, generator=g)
    xs, idxs, ws = gather(x), gather(idx), gather(w)

    recv_x, count, handle, event, recv_hook = buf.low_latency_dispatch(
        x.to(device), idx.to(device), use_fp8=use_fp8, round_scale=round_scale, async_op=async_op, return_recv_hook=hook,
        recv_stats=recv_stats)
    assert (recv_hook is not None) == hook and (event is not None) == async_op, ctx
    if hook:
        recv_hook()
    if event is not None:
        event.current_stream_wait()
    assert isinstance(handle, LowLatencyHandle) and handle.backend == "torch", ctx
    assert handle.src_info.device == count.device == x.to(device).device, ctx
    if use_fp8:
        assert recv_x[1].transpose(1, 2).is_contiguous(), ctx  # scales: [E_l, H/128, W*M] in memory
    recv_x = tuple(t.cpu() for t in recv_x) if use_fp8 else recv_x.cpu()
    count, src_info_got, layout_got = count.cpu(), handle.src_info.cpu(), handle.layout_range.cpu()
    assert (handle.num_tokens, handle.max_tokens, handle.hidden, handle.topk, handle.use_fp8) == \
        (T, M, hidden, K, use_fp8), ctx

    rows, counts, src_info, layout = expected_dispatch(xs, idxs, rank, E_l, mask)
    assert count.dtype == torch.int32 and torch.equal(count, counts), (ctx, count, counts)
    assert layout_got.dtype == torch.int64 and torch.equal(layout_got, layout), ctx
    assert src_info_got.shape == (E_l, world * M) and src_info_got.dtype == torch.int32, ctx
    if use_fp8:
        data, scales = recv_x
        assert data.dtype == torch.float8_e4m3fn and data.shape == (E_l, world * M, hidden), ctx
        assert scales.dtype == torch.float32 and scales.shape == (E_l, world * M, hidden // 128), ctx
        want_data, want_scales = expected_fp8(rows, round_scale)
    else:
        assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (E_l, world * M, hidden), ctx
    for e in range(E_l):
        n = int(counts[e])
        assert torch.equal(src_info_got[e, :n], src_info[e, :n]), (ctx, e)
        if use_fp8:
            assert torch.equal(data[e, :n].view(torch.uint8), want_data[e, :n]), (ctx, e)
            assert torch.equal(scales[e, :n], want_scales[e, :n]), (ctx, e)
        else:
            assert torch.equal(recv_x[e, :n], rows[e, :n]), (ctx, e)

    # combine: the experts' outputs in the dispatch's layout, garbage past each expert's rows
    got_rows = dequantized(*recv_x) if use_fp8 else recv_x
    out = expert_output(got_rows, rank, E_l)
    for e in range(E_l):
        out[e, int(counts[e]):] = GARBAGE
    y, event, recv_hook = buf.low_latency_combine(out.to(device), idx.to(device), w.to(device), handle,
                                                  async_op=async_op, return_recv_hook=hook)
    assert (recv_hook is not None) == hook and (event is not None) == async_op, ctx
    if hook:
        recv_hook()
    if event is not None:
        event.synchronize()
    y = y.cpu()
    outputs = gather(out)
    infos = gather((src_info_got, layout_got))
    owner = buf.cfg.comm.low_latency.combine_reduce == "owner"
    want = expected_combine(idxs, ws, outputs, infos, rank, E_l, mask, owner)
    assert y.dtype == torch.bfloat16 and y.shape == (T, hidden), ctx
    assert torch.equal(y, want), (ctx, (y.float() - want.float()).abs().max())
    return counts


def contract_body(rank, world, device="cpu"):
    E_l = 2 if world == 2 else 3
    full, zero_first = [M] * world, [0] + [M] * (world - 1)
    odd = ([1, M, 7] + [3] * world)[:world]  # T = 1 on rank 0; every rank listed at any world size
    seed = 0
    for hidden, fp8 in ((256, True), (136, False)):  # 136: BF16 rows of 272 bytes, no FP8 (not % 128)
        buf = make_buffer(world, E_l, hidden)
        stats = torch.zeros(E_l, dtype=torch.int32, device=device)
        total = torch.zeros(E_l, dtype=torch.int32)
        cases = [  # (tokens, mode, FP8, round_scale, hook, async_op)
            ([11] * world, "random", fp8, False, False, False),
            (zero_first, "random", fp8, fp8, True, False),    # a rank with no tokens, T = M elsewhere
            (full, "skew", fp8, False, False, True),          # expert 0 gets W*M rows: full
            ([5] * world, "nowhere", fp8, False, True, False),
            (odd, "random", False, False, False, False),      # T = 1 on rank 0
            (full, "random", fp8, fp8, False, True),
        ]
        for tokens, mode, use_fp8, round_scale, hook, async_op in cases:
            seed += 1
            total += check_case(buf, rank, world, E_l, hidden, tokens, mode, seed, use_fp8=use_fp8,
                                round_scale=round_scale, hook=hook, async_op=async_op, recv_stats=stats,
                                device=device)
        assert torch.equal(stats.cpu(), total), (stats, total)  # recv_stats accumulates every dispatch
        # a mask left out on every rank: its rows count as routed nowhere, both ways; then cleared
        buf.set_low_latency_mask([world - 1])
        for use_fp8, hook in ((fp8, False), (False, True)):
            seed += 1
            check_case(buf, rank, world, E_l, hidden, [9] * world, "random", seed, use_fp8=use_fp8, hook=hook,
                       mask=(world - 1,), device=device)
        buf.set_low_latency_mask([])
        check_case(buf, rank, world, E_l, hidden, [9] * world, "random", seed + 1, use_fp8=False, device=device)
        assert buf.low_latency_backend_name == "torch"
        buf.close()
    # combine_reduce source (the default is owner): every pick summed at the token's rank, k ascending, DeepEP's
    # numbers (a hook, a mask, skew)
    buf = make_buffer(world, E_l, 256, low_latency={"max_tokens_per_rank": M, "combine_reduce": "source"})
    for tokens, mode, hook, mask in (([11] * world, "random", False, ()), (full, "skew", True, ()),
                                     (odd, "random", False, (world - 1,))):
        seed += 1
        buf.set_low_latency_mask(list(mask))
        check_case(buf, rank, world, E_l, 256, tokens, mode, seed, use_fp8=False, hook=hook, mask=mask,
                   device=device)
    buf.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One spawn per world size; at world 2 the timeout runs after the contract, in abandon mode (it
    leaves rank 1 waiting outside the engine)."""
    table = {2: [("contract", contract_body, ()), ("timeout", timeout_body, ())], 3: [("contract", contract_body, ())],
             4: [("contract", contract_body, ())]}
    return parts_per_world(tmp_path_factory, "low_latency", table, abandon=True, timeout=300)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_torch_engine_matches_brute_force(runs, world):
    runs(world, "contract").check()


TIMEOUT_S = 1.5


def timeout_body(rank, world):
    buf = make_buffer(world, 2, 128, timeout_s=TIMEOUT_S)
    x = torch.randn(4, 128).to(torch.bfloat16)
    idx = torch.arange(4 * K).view(4, K) % (2 * world)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx)  # a healthy round: builds the engine
    buf.low_latency_combine(dequantized(*recv_x), idx, torch.ones(4, K), handle)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # stalls, alive, until rank 0 has given up: never arrives at the next dispatch
        store.wait(["rank 0 timed out"], timedelta(seconds=30))
        return
    start = time.monotonic()
    with pytest.raises(EPTimeoutError) as info:
        buf.low_latency_dispatch(x, idx)  # this engine waits on the host: the call itself raises
    elapsed = time.monotonic() - start
    assert info.value.missing_ranks == (1,), str(info.value)
    assert TIMEOUT_S - 0.5 < elapsed < TIMEOUT_S + 2.5, elapsed  # the deadline fired, not another error
    with pytest.raises(EPTimeoutError):  # and so does every later call
        buf.check()
    store.set("rank 0 timed out", "1")
    buf.close()


def test_timeout_names_the_missing_rank(runs):
    runs(2, "timeout").check()


# --------------------------------------------------------------------------- argument checks, one rank

H = 256
E = 4


@pytest.fixture
def buf(solo):
    b = make_buffer(1, E, H)
    yield b
    b.close()


def inputs(T=6):
    x = torch.randn(T, H).to(torch.bfloat16)
    idx = torch.tensor([[0, 1, -1], [2, 3, 1], [-1, -1, -1], [3, 0, 2], [1, -1, 0], [2, 1, 3]])[:T]
    return x, idx, torch.rand(T, K)


def raises(exc, words, call):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value), str(info.value)


def test_dispatch_refuses_bad_x(buf):
    x, idx, _ = inputs()
    raises(TypeError, "x must be a torch.Tensor", lambda: buf.low_latency_dispatch(x.tolist(), idx))
    raises(TypeError, "BF16", lambda: buf.low_latency_dispatch(x.float(), idx))
    raises(ValueError, f"x must have shape [num_tokens, {H}]", lambda: buf.low_latency_dispatch(x[:, :128], idx))
    raises(ValueError, "x must have shape", lambda: buf.low_latency_dispatch(x[0], idx))
    raises(ValueError, "x must be contiguous", lambda: buf.low_latency_dispatch(torch.cat([x, x], 1)[:, ::2], idx))
    big = torch.zeros(M + 1, H, dtype=torch.bfloat16)
    raises(ValueError, f"comm.low_latency.max_tokens_per_rank={M}",
           lambda: buf.low_latency_dispatch(big, torch.zeros(M + 1, K, dtype=torch.int64)))
    raises(ValueError, "x is on meta", lambda: buf.low_latency_dispatch(x.to("meta"), idx.to("meta")))


def test_dispatch_refuses_bad_topk_idx(buf):
    x, idx, _ = inputs()
    raises(TypeError, "topk_idx must be a torch.Tensor", lambda: buf.low_latency_dispatch(x, idx.tolist()))
    raises(TypeError, "topk_idx must be int64", lambda: buf.low_latency_dispatch(x, idx.int()))
    raises(ValueError, "topk_idx must have shape [6, K]", lambda: buf.low_latency_dispatch(x, idx[:-1]))
    raises(ValueError, "1 <= topk <= 32", lambda: buf.low_latency_dispatch(x, idx[:, :0]))
    raises(ValueError, "1 <= topk <= 32", lambda: buf.low_latency_dispatch(x, torch.zeros(6, 33, dtype=torch.int64)))
    raises(ValueError, "topk_idx must be contiguous", lambda: buf.low_latency_dispatch(x, idx.t().contiguous().t()))
    raises(ValueError, "topk_idx is on meta", lambda: buf.low_latency_dispatch(x, idx.to("meta")))
    raises(ValueError, f"topk_idx values must lie in [-1, {E})", lambda: buf.low_latency_dispatch(x, idx + E))
    raises(ValueError, "topk_idx values", lambda: buf.low_latency_dispatch(x, idx.clamp(max=0) - 2))
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx)  # the buffer still works
    raises(ValueError, "topk_idx values", lambda: buf.low_latency_combine(dequantized(*recv_x), idx + E, torch.ones(6, K), handle))


def test_dispatch_refuses_bad_flags_and_widths(solo):
    x, idx, _ = inputs()
    b = make_buffer(1, E, 136)  # 272-byte rows: BF16 only
    raises(ValueError, "use_fp8 needs hidden divisible by 128", lambda: b.low_latency_dispatch(x[:, :136].contiguous(), idx))
    raises(ValueError, "round_scale applies to the FP8 cast",
           lambda: b.low_latency_dispatch(x[:, :136].contiguous(), idx, use_fp8=False, round_scale=True))
    b.low_latency_dispatch(x[:, :136].contiguous(), idx, use_fp8=False)
    b.close()
    b = make_buffer(1, E, 36)  # 72-byte rows
    raises(ValueError, "multiple of 16 bytes", lambda: b.low_latency_dispatch(x[:, :36].contiguous(), idx, use_fp8=False))
    b.close()
    b = make_buffer(1, E, H)
    raises(TypeError, "use_fp8 must be a bool", lambda: b.low_latency_dispatch(x, idx, use_fp8=1))
    raises(TypeError, "return_recv_hook must be a bool", lambda: b.low_latency_dispatch(x, idx, return_recv_hook="yes"))
    raises(TypeError, "async_op must be a bool", lambda: b.low_latency_dispatch(x, idx, async_op=None))
    b.close()


def test_dispatch_refuses_bad_recv_stats(buf):
    x, idx, _ = inputs()
    raises(TypeError, "recv_stats must be int32",
           lambda: buf.low_latency_dispatch(x, idx, recv_stats=torch.zeros(E, dtype=torch.int64)))
    raises(ValueError, f"recv_stats must have shape [{E}]",
           lambda: buf.low_latency_dispatch(x, idx, recv_stats=torch.zeros(E + 1, dtype=torch.int32)))
    raises(ValueError, "recv_stats is on meta",
           lambda: buf.low_latency_dispatch(x, idx, recv_stats=torch.zeros(E, dtype=torch.int32, device="meta")))
    # the kernels add to recv_stats through its pointer: a strided view would get the wrong elements
    raises(ValueError, "recv_stats must be contiguous",
           lambda: buf.low_latency_dispatch(x, idx, recv_stats=torch.zeros(2 * E, dtype=torch.int32)[::2]))


def test_combine_refuses_bad_handles(buf, solo):
    x, idx, w = inputs()
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, use_fp8=False)
    raises(TypeError, "LowLatencyHandle", lambda: buf.low_latency_combine(recv_x, idx, w, "handle"))
    buf.low_latency_combine(recv_x, idx, w, handle)  # a good call: its form is cached, the handles below still fail
    _, _, short, _, _ = buf.low_latency_dispatch(x[:4].contiguous(), idx[:4].contiguous(), use_fp8=False)
    raises(ValueError, "topk_idx must have shape [4, 3]", lambda: buf.low_latency_combine(recv_x, idx, w, short))
    other = make_buffer(1, E, H)
    _, _, foreign, _, _ = other.low_latency_dispatch(x, idx, use_fp8=False)
    raises(ValueError, "another EPBuffer", lambda: buf.low_latency_combine(recv_x, idx, w, foreign))
    other.close()
    raises(ValueError, "topk_idx must have shape [6, 3]", lambda: buf.low_latency_combine(recv_x, idx[:4], w[:4], handle))
    # a hooked dispatch whose hook has not run yet has no layout to combine with
    _, _, pending, _, hook = buf.low_latency_dispatch(x, idx, use_fp8=False, return_recv_hook=True)
    raises(RuntimeError, "receive hook has not run", lambda: buf.low_latency_combine(recv_x, idx, w, pending))
    hook()
    buf.low_latency_combine(recv_x, idx, w, pending)


def test_combine_refuses_bad_rows_weights_and_out(buf):
    x, idx, w = inputs()
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, use_fp8=False)
    raises(TypeError, "low_latency_combine takes BF16 x", lambda: buf.low_latency_combine(recv_x.float(), idx, w, handle))
    raises(ValueError, f"[{E}, {M}, {H}]", lambda: buf.low_latency_combine(recv_x[:, :-1].contiguous(), idx, w, handle))
    raises(ValueError, "x must be contiguous",
           lambda: buf.low_latency_combine(recv_x.transpose(0, 1).contiguous().transpose(0, 1), idx, w, handle))
    raises(TypeError, "topk_weights must be float32", lambda: buf.low_latency_combine(recv_x, idx, w.double(), handle))
    raises(ValueError, "topk_weights must have shape [6, 3]",
           lambda: buf.low_latency_combine(recv_x, idx, w[:, :2].contiguous(), handle))
    raises(TypeError, "out must be BF16", lambda: buf.low_latency_combine(recv_x, idx, w, handle, out=torch.empty(6, H)))
    raises(ValueError, f"out must have shape [6, {H}]",
           lambda: buf.low_latency_combine(recv_x, idx, w, handle, out=torch.empty(5, H, dtype=torch.bfloat16)))
    out = torch.empty(6, H, dtype=torch.bfloat16)
    y, _, _ = buf.low_latency_combine(recv_x, idx, w, handle, out=out)
    assert y is out


def test_cached_forms_follow_in_place_changes(buf):
    """A form's checks run once; the same tensor objects changed in place (shape, strides) make a new form,
    checked again before anything runs."""
    x, idx, w = inputs()
    stats = torch.zeros(E, dtype=torch.int32)
    for _ in range(2):  # the second call of each finds its form
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, use_fp8=False, recv_stats=stats)
        buf.low_latency_combine(recv_x, idx, w, handle)
    stats.resize_(E + 1)
    for _ in range(2):  # a form that failed is not the last call's form
        raises(ValueError, f"recv_stats must have shape [{E}]",
               lambda: buf.low_latency_dispatch(x, idx, use_fp8=False, recv_stats=stats))
    stats.resize_(E)
    w.as_strided_((6, K), (1, 6))
    for _ in range(2):
        raises(ValueError, "topk_weights must be contiguous", lambda: buf.low_latency_combine(recv_x, idx, w, handle))
    w.as_strided_((6, K), (K, 1))
    buf.low_latency_combine(recv_x, idx, w, handle)
    idx.resize_(5, K)
    raises(ValueError, "topk_idx must have shape [6, K]",
           lambda: buf.low_latency_dispatch(x, idx, use_fp8=False, recv_stats=stats))
    raises(ValueError, "topk_idx must have shape [6, 3]", lambda: buf.low_latency_combine(recv_x, idx, w, handle))


def test_mask_refuses_ranks_outside_the_group(buf):
    for bad, exc in (([1], ValueError), ([-1], ValueError), ([True], TypeError), ("0", TypeError),
                     ([0.0], TypeError), (3, TypeError)):
        with pytest.raises(exc, match="ranks"):
            buf.set_low_latency_mask(bad)
    buf.set_low_latency_mask([0])
    buf.set_low_latency_mask([])


def test_hook_runs_once_and_a_closed_buffer_refuses(buf):
    x, idx, w = inputs()
    _, _, handle, _, hook = buf.low_latency_dispatch(x, idx, return_recv_hook=True)
    hook()
    raises(RuntimeError, "has run already", hook)
    recv_x = torch.zeros(E, M, H, dtype=torch.bfloat16)
    _, _, hook = buf.low_latency_combine(recv_x, idx, w, handle, return_recv_hook=True)
    hook()
    raises(RuntimeError, "has run already", hook)
    buf.close()
    raises(RuntimeError, "closed", lambda: buf.low_latency_dispatch(x, idx))


def test_registry_picks_the_torch_engine_on_gloo(solo):
    name, why = registry.low_latency_choice(dist.group.WORLD, "auto", H)
    assert name == "torch" and "gloo" in why
    assert registry.low_latency_choice(dist.group.WORLD, "torch", H)[0] == "torch"
    with pytest.raises(BackendUnavailableError, match="comm.backend: nvshmem"):
        registry.low_latency_choice(dist.group.WORLD, "nvshmem", H)
    b = make_buffer(1, E, H)
    assert b.low_latency_backend_name is None  # built at the first low-latency call
    x, idx, _ = inputs()
    b.low_latency_dispatch(x, idx)
    assert b.low_latency_backend_name == "torch"
    b.close()


# --------------------------------------------------------------------------- config

def test_low_latency_config_section():
    from ep_plugin.config import load_config

    assert load_config(None).comm.low_latency.max_tokens_per_rank == 128
    c = load_config({"comm": {"low_latency": {"max_tokens_per_rank": 64}}})
    assert c.comm.low_latency.max_tokens_per_rank == 64 and load_config(c.to_dict()) == c
    assert load_config({"comm": {"low_latency": None}}).comm.low_latency.max_tokens_per_rank == 128
    assert load_config("tiny", {"comm.low_latency": {"max_tokens_per_rank": 8}}).comm.low_latency.max_tokens_per_rank == 8
    for bad, words in (
        ({"comm": {"low_latency": {"max_tokens": 8}}},
         ["comm.low_latency.max_tokens: unknown key", "did you mean 'max_tokens_per_rank'"]),
        ({"comm": {"low_latency": {"max_tokens_per_rank": 0}}}, ["comm.low_latency.max_tokens_per_rank", ">= 1"]),
        ({"comm": {"low_latency": {"max_tokens_per_rank": 8.0}}}, ["comm.low_latency.max_tokens_per_rank", "wrong type"]),
        ({"comm": {"low_latency": 128}}, ["comm.low_latency: must be a mapping", "max_tokens_per_rank"]),
    ):
        with pytest.raises(ConfigError) as info:
            load_config(bad)
        for w in words:
            assert w in str(info.value), str(info.value)
    with pytest.raises(ConfigError, match=r"tiny.yaml \(overrides\): comm.low_latency.max_tokens_per_rank"):
        load_config("tiny", {"comm.low_latency": {"max_tokens_per_rank": -1}})


@pytest.mark.parametrize("round_scale", [False, True])
def test_cast_fp8_is_the_documented_cast(round_scale):
    """The torch engine's cast, bit for bit, against tests/reference.reference_cast_fp8 (DESIGN.md's
    formula written independently): zero rows (amax floor), tiny, unit and large magnitudes."""
    from ep_plugin.backends.torch_ref.low_latency import cast_fp8
    from tests.reference import reference_cast_fp8

    g = torch.Generator().manual_seed(3)
    for magnitude in (1e-7, 1e-3, 1.0, 250.0, 3e4):
        x = (torch.randn(19, 512, generator=g) * magnitude).to(torch.bfloat16)
        x[2] = 0
        x[5, :128] = magnitude  # a block of equal values: amax exactly representable
        a, sa = cast_fp8(x, round_scale)
        b, sb = reference_cast_fp8(x, round_scale)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb), magnitude
