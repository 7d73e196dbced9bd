"""NVSHMEM on 2 GPUs: the bootstrap over torch.distributed, and the low-latency engine's kernels
(NvshmemLowLatency, driven directly) against a brute-force expectation built from every rank's
inputs. tests/test_low_latency_gpu.py checks the same engine through EPBuffer against the torch
reference engine."""

import pytest
import torch
import torch.distributed as dist

from ep_plugin.backends.torch_ref.low_latency import cast_fp8  # the contract's cast (tested in test_low_latency)
from tests._dist import spawn_parts
from tests._need import need_nvshmem
from tests.reference import ll_combine_reference

pytestmark = pytest.mark.gpu


def _need_nvshmem(world=2):
    need_nvshmem(world)


def _cfg(M, K, timeout_s=20.0, output_buffers=0):
    """The validated config (a stand-in namespace would miss keys the engine reads, e.g. heap_outputs)."""
    from ep_plugin.config import load_config
    return load_config(None, overrides={"moe": {"topk": K}, "comm": {"timeout_s": timeout_s, "low_latency": {
        "max_tokens_per_rank": M, "output_buffers": output_buffers}}})


def _gather(t, world):
    """Every rank's tensor (sizes may differ), on this GPU."""
    out = [None] * world
    dist.all_gather_object(out, t.cpu())
    return [o.cuda() for o in out]


def _check_case(eng, rank, world, E, H, T, K, seed, use_fp8, round_scale, hook, skew=False, none_rows=0):
    g = torch.Generator(device="cpu").manual_seed(seed * 100 + rank)
    x = (torch.randn(T, H, generator=g) * 2).to(torch.bfloat16).cuda()
    scores = torch.rand(T, E, generator=g)
    if skew:
        scores[:, 0] += 10.0
    idx = scores.topk(K, dim=1).indices
    if none_rows and T:
        idx[: min(none_rows, T)] = -1
        idx[T // 2:, K - 1] = -1
    idx = idx.cuda()
    w = torch.rand(T, K, generator=g).cuda()
    EL = E // world
    xs, idxs = _gather(x, world), _gather(idx, world)
    recv_x, count, handle, recv = eng.dispatch(x, idx, use_fp8=use_fp8, round_scale=round_scale, recv_stats=None,
                                               hook=hook)
    if hook:
        torch.randn(2048, 2048, device="cuda") @ torch.randn(2048, 2048, device="cuda")  # compute in between
        recv()
    torch.cuda.synchronize()
    eng.check()
    ctx = f"rank {rank} E {E} H {H} T {T} K {K} fp8 {use_fp8} round {round_scale} hook {hook} seed {seed}"
    # The expectation from host copies of the routing (one read of each GPU tensor, not one per element:
    # per-element reads of the 288-expert case made this test ~70 s), in the contract's order: source
    # rank, then token, then k.
    rows_of = [[] for _ in range(EL)]
    for s in range(world):
        for t, picks in enumerate(idxs[s].tolist()):
            for e in picks:
                if rank * EL <= e < (rank + 1) * EL:
                    rows_of[e - rank * EL].append((s, t))
    first_row = [sum(int(x.shape[0]) for x in xs[:s]) for s in range(world)]
    all_x = torch.cat(xs)
    got_count, got_layout, got_src = count.cpu().tolist(), handle.layout_range.cpu().tolist(), handle.src_info.cpu()
    for el in range(EL):
        rows = rows_of[el]
        n = len(rows)
        assert int(got_count[el]) == n, ctx
        per_src = [sum(1 for s, _ in rows if s == r) for r in range(world)]
        begins = [sum(per_src[:r]) for r in range(world)]
        lr = got_layout[el]
        assert [(int(v) >> 32, int(v) & 0xFFFFFFFF) for v in lr] == list(zip(begins, per_src)), ctx
        if n == 0:
            continue
        assert got_src[el, :n].tolist() == [t for _, t in rows], ctx
        want = all_x[torch.tensor([first_row[s] + t for s, t in rows], device=all_x.device)]
        if use_fp8:
            q, sc = cast_fp8(want, round_scale)
            got_q, got_s = recv_x[0][el, :n], recv_x[1][el, :n]
            if not torch.equal(got_s, sc):
                bad = (got_s != sc).nonzero()[:4].tolist()
                raise AssertionError(f"{ctx}: scales differ at {bad}: got {[float(got_s[i][j]) for i, j in bad]} "
                                     f"want {[float(sc[i][j]) for i, j in bad]}; data equal: "
                                     f"{torch.equal(got_q.view(torch.uint8), q.view(torch.uint8))}; "
                                     f"rows {rows[:4]}")
            assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)), ctx
        else:
            assert torch.equal(recv_x[el, :n], want), ctx
    # combine: send each received row back as the expert output (dequantised for FP8)
    if use_fp8:
        data, sc = recv_x
        out = (data.float().view(EL, -1, H // 128, 128) * sc.unsqueeze(-1)).view(EL, -1, H).to(torch.bfloat16)
    else:
        out = recv_x
    out = out.contiguous()
    y, recv = eng.combine(out, idx, w, handle, out=None, hook=hook)
    if hook:
        recv()
    torch.cuda.synchronize()
    eng.check()
    xe = x if not use_fp8 else None
    if use_fp8:
        q, sc = cast_fp8(x, round_scale) if T else (x, None)
        xe = (q.float().view(T, H // 128, 128) * sc.unsqueeze(-1)).view(T, H).to(torch.bfloat16) if T else x
    # every pick returns the token's own row; summed as the engine's combine_reduce says
    want = ll_combine_reference([xe.float()] * K, idx, w, E // world, owner=eng.sum_bits != 0)
    assert torch.equal(y, want), ctx + f" max diff {(y.float() - want.float()).abs().max()}"


def _bootstrap_and_ll(rank, world):
    from ep_plugin._ext import get_c
    from ep_plugin.backends.nvshmem import runtime
    from ep_plugin.backends.nvshmem.low_latency import NvshmemLowLatency
    C = get_c()
    runtime.join(dist.group.WORLD, 64 << 20)
    assert C.nvshmem_initialized() and C.nvshmem_my_pe() == rank and C.nvshmem_n_pes() == world
    # a put from each rank into the next one's symmetric buffer
    buf = C.nvshmem_malloc(64)
    src = torch.arange(4, dtype=torch.int32, device="cuda") + 10 * rank
    stream = torch.cuda.current_stream().cuda_stream
    C.nvshmem_put_ints(buf, src.data_ptr(), 4, (rank + 1) % world, stream)
    C.nvshmem_barrier_all_on_stream(stream)
    torch.cuda.synchronize()
    C.nvshmem_free(buf)

    for E, H, M, K in ((8, 256, 16, 4), (288, 7168, 128, 8), (4, 1032, 32, 2)):
        eng = NvshmemLowLatency(dist.group.WORLD, _cfg(M, K), H, E)
        seed = 0
        for fp8 in ((False, True) if H % 128 == 0 else (False,)):
            for rs in ((False, True) if fp8 else (False,)):
                for hook in (False, True):
                    for T in (M, 1, 0 if rank == 1 else M // 2):
                        seed += 1
                        _check_case(eng, rank, world, E, H, T, K, seed, fp8, rs, hook, skew=seed % 3 == 0,
                                    none_rows=seed % 2 * 3)
        eng.close()


def _output_ring(rank, world):
    """comm.low_latency.output_buffers = 2: the same results, and a call's outputs survive the next call."""
    from ep_plugin.backends.nvshmem.low_latency import NvshmemLowLatency
    eng = NvshmemLowLatency(dist.group.WORLD, _cfg(32, 4, output_buffers=2), 1024, 16)
    for seed, (fp8, hook) in enumerate(((False, False), (True, False), (False, True), (True, True), (False, False))):
        _check_case(eng, rank, world, 16, 1024, 32 - rank, 4, 100 + seed, fp8, False, hook, skew=seed == 2)
    x = torch.randn(8, 1024, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, 16, (8, 4), device="cuda")
    w = torch.rand(8, 4, device="cuda")
    first, count, h1, _ = eng.dispatch(x, idx, use_fp8=False, round_scale=False, recv_stats=None, hook=False)
    y1, _ = eng.combine(first, idx, w, h1, out=None, hook=False)
    kept, kept_count, kept_y = first.clone(), count.clone(), y1.clone()
    second, _, h2, _ = eng.dispatch(x * 2, idx, use_fp8=False, round_scale=False, recv_stats=None, hook=False)
    y2, _ = eng.combine(second, idx, w, h2, out=None, hook=False)
    torch.cuda.synchronize()
    # the next call of a kind takes the other set
    assert second.data_ptr() != first.data_ptr() and y2.data_ptr() != y1.data_ptr()
    assert torch.equal(first, kept) and torch.equal(count, kept_count) and torch.equal(y1, kept_y)
    first_ptr = first.data_ptr()
    del first, count, h1  # the one after wraps around to the first: held, it would raise OutputsStillHeldError
    third, _, h3, _ = eng.dispatch(x, idx, use_fp8=False, round_scale=False, recv_stats=None, hook=False)
    eng.combine(third, idx, w, h3, out=None, hook=False)  # calls alternate (docs/LOW_LATENCY.md)
    torch.cuda.synchronize()
    assert third.data_ptr() == first_ptr
    eng.close()


@pytest.fixture(scope="module")
def nvshmem_parts(tmp_path_factory):
    """Both bodies in one spawn (one process start, NCCL init and NVSHMEM bootstrap): the bootstrap one
    first, as it joins NVSHMEM itself; the ring's engine is smaller than the ones it closed."""
    _need_nvshmem()
    parts = [("bootstrap_ll", _bootstrap_and_ll, ()), ("output_ring", _output_ring, ())]
    return spawn_parts(parts, 2, str(tmp_path_factory.mktemp("nvshmem")), backend="nccl", timeout=600)


def test_nvshmem_bootstrap_and_low_latency_kernels(nvshmem_parts):
    nvshmem_parts["bootstrap_ll"].check()


def test_low_latency_output_ring(nvshmem_parts):
    nvshmem_parts["output_ring"].check()
