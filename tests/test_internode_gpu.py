"""comm.backend: nvshmem on GPUs as 2 virtual nodes: 2x1 (2 GPUs, one rank per node: no NVLink
forwarding) and 2x2 (4 GPUs, two ranks per node: the rail, then the nvlink backend inside each node).

Each world checks the whole backend against the single-process reference (tests/reference.py):
random, skewed, partly unrouted and starved routings, zero-token ranks, FP8 rows, cached dispatch,
worst-case (default) and host-synced sizing, node-limited routing with num_groups = nodes, a CUDA
graph; and a peer that dies in the middle of a dispatch (after its rail send, before its NVLink
forwarding and its combine): every survivor gets EPTimeoutError within comm.timeout_s of each wait,
and the survivors that wait on the dead rank directly (its node peers, its rail peers) name it.

    python3 -m pytest -q -m gpu tests/test_internode_gpu.py            # both worlds (needs 4 GPUs for 2x2)
    python3 -m pytest -q -m gpu tests/test_internode_gpu.py -k 2x2
    python3 -m pytest -q -m gpu tests/test_internode_gpu.py -k contract_order   # session 10's contract order alone

The last one (2x2 only, two own spawns, a few seconds of GPU time each) runs the cached dispatch that writes the
contract's order through the inner pull (HierarchicalBackend.direct_cached_dispatch) on each inner pull
kernel, against the path before it (the reorder pass), bit for bit; and the fresh dispatch that does
(direct_fresh_dispatch: stage_pull_tma computes the positions), against contract_order + the reorder pass
(`-k fresh_dispatch` for that one alone).

    python3 -m pytest -q -m gpu tests/test_internode_gpu.py -k pull_combine     # session 11's pulled combine

runs HierarchicalBackend.pull_combine at 2x1 and 2x2 (one spawn each) against the reference and, bit for bit,
against the pushed combine (today's) on the same handles.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.backends.hierarchical.timeline import StageTimeline
from ep_plugin.errors import EPTimeoutError
from tests._dist import spawn, spawn_parts
from tests.reference import make_inputs
from tests.test_hierarchical import E, K, _cfg, check_against_reference, check_graph, check_node_limited

pytestmark = pytest.mark.gpu

WORLDS = {"2x1": (2, 1), "2x2": (4, 2)}  # id -> (GPUs, ranks per node): always 2 virtual nodes
DEATH_TIMEOUT_S = 3.0


def _need(world):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    import ep_plugin._ext as ext
    if not ext.has_c() or not getattr(ext.get_c(), "HAS_NVSHMEM", False):
        pytest.skip("ep_plugin._C is built without NVSHMEM")


# (mode, tokens per rank) per sizing: a full batch, zero-token and starved ranks, unrouted tokens, skew
CASES = {False: (("random", 512), ("skew", "zero_first"), ("nowhere", 17), ("starve_last", 512), ("random", 300)),
         True: (("random", 512), ("skew", "zero_first"))}


def check_cut_combine(buf, res):
    """combine takes x cut to the valid rows of a worst-case-sized dispatch (EPBuffer.combine allows
    it; DeepEP's combine passes the exact rows back): the same sums as the full x. DeepEP's
    test_internode.py hit an index past the cut rows here on 2026-11-26 (a device-side assert)."""
    n = int(res.handle.num_recv_device)
    rows = (res.x.float() * 0.5 + 1).to(torch.bfloat16)
    full = buf.combine(rows, res.handle)
    cut = buf.combine(rows[:n].contiguous(), res.handle)
    torch.cuda.synchronize()
    buf.check()
    torch.testing.assert_close(cut.float(), full.float(), atol=1e-2, rtol=1e-2,
                               msg=f"rank {dist.get_rank()}: combine of the {n} valid rows differs from the full x")
    # the combine path of session 8 (x read in place; at 2x2 the inner reduce stores into the rail peers' rows)
    # against the passes it replaced (HierarchicalBackend.fused_combine False): the same sums, bit for bit
    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend

    HierarchicalBackend.fused_combine = False
    try:
        before = [buf.combine(rows, res.handle), buf.combine(rows[:n].contiguous(), res.handle)]
        torch.cuda.synchronize()
        buf.check()
    finally:
        HierarchicalBackend.fused_combine = True
    for now, was in zip((full, cut), before):
        assert torch.equal(now, was), (f"rank {dist.get_rank()}: combine differs from the path before session 8 by "
                                       f"{(now.float() - was.float()).abs().max().item()}")


def body_contract(rank, world, P):
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(2 << 30))
    seed = 300
    for host_sync in (False, True):
        buf = ep_plugin.EPBuffer(None, _cfg("nvshmem", 512, host_sync, ranks_per_node=P), hidden=7168)
        assert buf.backend_name == "nvshmem"
        for mode, tokens in CASES[host_sync]:
            seed += 1
            tokens = [0] + [9] * (world - 1) if tokens == "zero_first" else tokens
            res = check_against_reference(buf, rank, world, 7168, tokens, seed, mode, "cuda")  # + combine, cached
            if not host_sync:
                check_cut_combine(buf, res)
        check_against_reference(buf, rank, world, 7168, [0] + [200] * (world - 1), 6, "random", "cuda", fp8=True)
        check_node_limited(buf, rank, world, P, "cuda")  # num_groups = nodes, group_topk 1
        if not host_sync:
            check_graph(buf, rank, world)
        buf.check()
        buf.close()


@pytest.fixture(scope="module", params=list(WORLDS))
def internode_parts(request, tmp_path_factory):
    """Both bodies of a world in one spawn (one process start, NCCL init and NVSHMEM bootstrap), in
    abandon mode: the peer's death ends the group, so it runs last."""
    world, P = WORLDS[request.param]
    _need(world)
    parts = [("contract", body_contract, (P,)), ("peer_dies", body_peer_dies, (P,))]
    return spawn_parts(parts, world, str(tmp_path_factory.mktemp(f"internode{request.param}")), backend="nccl",
                       abandon=True, timeout=500)


def test_contract_against_reference(internode_parts):
    internode_parts["contract"].check()


class _DieAfterRailSend(StageTimeline):
    """The dying rank's timeline: at the mark between its rail send and receive half it waits for the
    send to land, then ends its process -- in the middle of the dispatch call."""

    def mark(self, stage):
        if stage == "rail_send" and self._open is not None and self._open.kind == "dispatch":
            torch.cuda.synchronize()
            os._exit(0)
        super().mark(stage)


def body_peer_dies(rank, world, P):
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # NCCL's watchdog must not end a survivor first
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(1 << 30))
    buf = ep_plugin.EPBuffer(None, _cfg("nvshmem", 64, False, ranks_per_node=P, timeout_s=DEATH_TIMEOUT_S),
                             hidden=1024)
    xs, idxs, ws = make_inputs(world, 48, 1024, E, K, 21, torch.bfloat16)
    x, idx, w = xs[rank].cuda(), idxs[rank].cuda(), ws[rank].cuda()
    res = buf.dispatch(x, idx, w)  # a healthy round first
    buf.combine(res.x, res.handle)
    torch.cuda.synchronize()
    buf.check()
    dist.barrier()
    dead = world - 1
    backend = getattr(buf._backend, "wrapped", buf._backend)
    if rank == dead:
        backend.timeline = _DieAfterRailSend()
    t0 = time.monotonic()
    caught, where = None, "dispatch"
    try:
        res = buf.dispatch(x, idx, w)
        torch.cuda.synchronize()
        buf.check()
        where = "combine"
        buf.combine(res.x, res.handle)
        torch.cuda.synchronize()
        buf.check()
    except EPTimeoutError as e:
        caught = e
    elapsed = time.monotonic() - t0
    assert rank != dead, "the dying rank came back from its dispatch"
    assert caught is not None, f"rank {rank}: no EPTimeoutError although rank {dead} died in its dispatch"
    assert elapsed < 2 * DEATH_TIMEOUT_S + 10, f"rank {rank}: raised after {elapsed:.1f}s"
    missing = tuple(caught.missing_ranks)
    assert missing and rank not in missing and all(0 <= r < world for r in missing), (rank, where, str(caught))
    node_peer = rank // P == dead // P
    rail_peer = rank % P == dead % P
    if node_peer or rail_peer:  # they wait on the dead rank itself
        assert missing == (dead,), (rank, where, str(caught))
    if node_peer and P > 1:  # its NVLink forwarding never came: the dispatch times out
        assert where == "dispatch", (rank, where, str(caught))


def test_peer_dies_mid_dispatch(internode_parts):
    part = internode_parts["peer_dies"]
    part.check(exited=(part.world - 1,))  # body_peer_dies's dead rank


# the inner nvlink pull kernels a cached rank-major dispatch can run: (comm.dispatch_kernel, Runtime.tma)
INNER_PULLS = {"stage_pull_tma": ("fused", True), "pull_tma": ("split", True), "register_pull": ("split", False)}


def _contract_inputs(rank, world, seed):
    """(H, x, topk_idx, weights, FP8 scales, second rows) of this rank for the contract-order tests, on its GPU:
    rows of 14 KB (BF16) / 7 KB (FP8), the bulk-copy kernels' ring, as in the benchmarks."""
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(1 << 30))
    H = 7168
    xs, idxs, ws = make_inputs(world, 160, H, E, K, seed, torch.bfloat16)
    x, idx, w = xs[rank].cuda(), idxs[rank].cuda(), ws[rank].cuda()
    scales = torch.rand(x.shape[0], H // 128, generator=torch.Generator().manual_seed(rank)).cuda() + 0.5
    return H, x, idx, w, scales, (x.float() * 0.5 - 1).to(torch.bfloat16)


def _counting_buffer(P, host_sync, H, method):
    """(buffer, hierarchical backend, inner nvlink backend, calls): a 2x2 nvshmem buffer whose inner backend's
    `method` appends to `calls` at each call (which path ran), and the inner pull's settings to put back."""
    buf = ep_plugin.EPBuffer(None, _cfg("nvshmem", 192, host_sync, ranks_per_node=P), hidden=H)
    backend = getattr(buf._backend, "wrapped", buf._backend)
    inner = backend.inner
    calls = []
    orig = getattr(inner, method)
    setattr(inner, method, lambda *a, **k: calls.append(1) or orig(*a, **k))
    return buf, backend, inner, calls


def body_cached_contract_order(rank, world, P):
    """The cached dispatch of session 10 against the path before it, on one 2x2 world: worst-case and host-synced
    sizing, BF16 and FP8 rows, each inner pull kernel (stage_pull_tma, stage + pull_tma, stage + the register pull).
    The rows, scales and weights written straight into the contract's order equal the ones the reorder pass gave,
    bit for bit (the valid rows; the weights of every row, padding included), the direct path was taken (one
    dispatch_scattered per call), and the combine of the rows after it sums the same."""
    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend

    H, x, idx, w, scales, x2 = _contract_inputs(rank, world, 41)
    for host_sync in (False, True):
        buf, _, inner, calls = _counting_buffer(P, host_sync, H, "dispatch_scattered")
        mode, tma = inner.dispatch_mode, inner._rt.tma
        for fp8 in (False, True):
            xin = (x.to(torch.float8_e4m3fn), scales) if fp8 else x
            a = buf.dispatch(xin, idx, w)
            n = int(a.handle.num_recv_device)
            again = (x2.to(torch.float8_e4m3fn), scales * 2) if fp8 else x2
            for kernel, (dispatch_mode, use_tma) in INNER_PULLS.items():
                inner.dispatch_mode, inner._rt.tma = dispatch_mode, use_tma  # read by every cached call
                ctx = f"rank {rank} host_sync {host_sync} fp8 {fp8} {kernel}"
                before = len(calls)
                now = buf.dispatch(again, None, w * 2, handle=a.handle)
                HierarchicalBackend.direct_cached_dispatch = False
                try:
                    was = buf.dispatch(again, None, w * 2, handle=a.handle)
                finally:
                    HierarchicalBackend.direct_cached_dispatch = True
                torch.cuda.synchronize()
                buf.check()
                assert len(calls) == before + 1, ctx  # the direct path ran once, the path before did not call it
                (got, got_s), (want, want_s) = (now.x, was.x) if fp8 else ((now.x, None), (was.x, None))
                assert got.shape == want.shape, ctx
                assert torch.equal(got[:n].view(torch.uint8), want[:n].view(torch.uint8)), ctx
                if fp8:
                    assert torch.equal(got_s[:n], want_s[:n]), ctx
                assert torch.equal(now.topk_weights, was.topk_weights), ctx  # padding rows included (0)
                assert torch.equal(now.topk_idx, was.topk_idx), ctx  # the fresh dispatch's, in the contract's order
                if not fp8:
                    rows = [(t.float() * (rank + 1)).to(torch.bfloat16) for t in (got, want)]
                    ys = [buf.combine(r, a.handle) for r in rows]
                    torch.cuda.synchronize()
                    assert torch.equal(ys[0], ys[1]), ctx
        inner.dispatch_mode, inner._rt.tma = mode, tma
        buf.check()
        buf.close()


def test_cached_dispatch_writes_contract_order():
    """2x2 only: with one rank per node there is no inner exchange and so nothing to reorder."""
    world, P = WORLDS["2x2"]
    _need(world)
    spawn(body_cached_contract_order, world, P, backend="nccl", timeout=300)


def body_fresh_contract_order(rank, world, P):
    """The fresh dispatch in contract order (HierarchicalBackend.direct_fresh_dispatch: stage_pull_tma computes each
    row's contract position from the forwarders' send lists) against the path before (contract_order + the reorder
    pass), on one 2x2 world, BF16 and FP8 rows, worst-case and host-synced sizing, each inner pull kernel. Where it
    runs (worst-case, stage_pull_tma: one dispatch_contract call) the valid rows and scales, every row's ids and
    weights (padding included), the handle's to_contract, counts and num_recv_device equal the path before's bit
    for bit, and so do the combine and a cached dispatch of each handle; everywhere else it falls back (no
    dispatch_contract call) with the same results. The stage_pull_tma case runs twice: notify launched first and
    notify inside the contract-order stage_pull (notify_inside_contract, the default since session 18)."""
    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend

    H, x, idx, w, scales, x2 = _contract_inputs(rank, world, 43)
    assert HierarchicalBackend.direct_fresh_dispatch is True  # the default since this test passed (session 10)
    try:
        for host_sync in (False, True):
            buf, backend, inner, calls = _counting_buffer(P, host_sync, H, "dispatch_contract")
            mode, tma = inner.dispatch_mode, inner._rt.tma
            for fp8 in (False, True):
                xin = (x.to(torch.float8_e4m3fn), scales) if fp8 else x
                again = (x2.to(torch.float8_e4m3fn), scales * 2) if fp8 else x2
                # stage_pull_tma once more with notify inside it (NvlinkBackend.notify_inside_contract, on since session 18)
                for kernel, (dispatch_mode, use_tma), inside in [(k, v, False) for k, v in INNER_PULLS.items()] + [
                        ("stage_pull_tma", INNER_PULLS["stage_pull_tma"], True)]:
                    inner.dispatch_mode, inner._rt.tma = dispatch_mode, use_tma  # read by every fresh call
                    inner.notify_inside_contract = inside  # (the path before, below, runs no contract launch)
                    ctx = f"rank {rank} host_sync {host_sync} fp8 {fp8} {kernel} notify inside {inside}"
                    before = len(calls)
                    now = buf.dispatch(xin, idx, w)
                    HierarchicalBackend.direct_fresh_dispatch = False
                    try:
                        was = buf.dispatch(xin, idx, w)
                    finally:
                        HierarchicalBackend.direct_fresh_dispatch = True
                    torch.cuda.synchronize()
                    buf.check()
                    direct = not host_sync and kernel == "stage_pull_tma"
                    assert len(calls) == before + int(direct), ctx  # where it runs, once; elsewhere the path before
                    hn, hw = now.handle, was.handle
                    n = int(hn.num_recv_device)
                    assert n == int(hw.num_recv_device) and hn.num_recv == hw.num_recv, ctx
                    (got, got_s), (want, want_s) = (now.x, was.x) if fp8 else ((now.x, None), (was.x, None))
                    assert got.shape == want.shape, ctx
                    assert torch.equal(got[:n].view(torch.uint8), want[:n].view(torch.uint8)), ctx
                    if fp8:
                        assert torch.equal(got_s[:n], want_s[:n]), ctx
                    assert torch.equal(now.topk_idx, was.topk_idx), ctx  # padding rows included (-1)
                    assert torch.equal(now.topk_weights, was.topk_weights), ctx  # padding rows included (0)
                    assert torch.equal(backend._state(hn).to_contract, backend._state(hw).to_contract), ctx
                    assert hn.recv_counts == hw.recv_counts and hn.send_counts == hw.send_counts, ctx
                    c_now = buf.dispatch(again, None, w * 2, handle=hn)
                    c_was = buf.dispatch(again, None, w * 2, handle=hw)
                    torch.cuda.synchronize()
                    (got, got_s), (want, want_s) = (c_now.x, c_was.x) if fp8 else ((c_now.x, None), (c_was.x, None))
                    assert torch.equal(got[:n].view(torch.uint8), want[:n].view(torch.uint8)), ctx
                    if fp8:
                        assert torch.equal(got_s[:n], want_s[:n]), ctx
                    assert torch.equal(c_now.topk_weights, c_was.topk_weights), ctx
                    if not fp8:
                        ys = [buf.combine((t.float() * (rank + 1)).to(torch.bfloat16), h)
                              for t, h in ((now.x, hn), (was.x, hw))]
                        torch.cuda.synchronize()
                        assert torch.equal(ys[0], ys[1]), ctx
                    buf.check()
            inner.dispatch_mode, inner._rt.tma = mode, tma
            inner.notify_inside_contract = type(inner).notify_inside_contract
            buf.check()
            buf.close()
    finally:
        HierarchicalBackend.direct_fresh_dispatch = True


def test_fresh_dispatch_writes_contract_order():
    """2x2 only: with one rank per node there is no inner exchange and so nothing to reorder."""
    world, P = WORLDS["2x2"]
    _need(world)
    spawn(body_fresh_contract_order, world, P, backend="nccl", timeout=300)


def _pulled_and_pushed(buf, rows, handle):
    """(pulled, pushed): combine of rows through handle with HierarchicalBackend.pull_combine on, then off (full x and,
    where the dispatch was sized for the worst case, x cut to its valid rows)."""
    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend

    n = int(handle.num_recv_device)
    xs = [rows] + ([rows[:n].contiguous()] if n < rows.shape[0] else [])
    out = []
    for pull in (True, False):
        HierarchicalBackend.pull_combine = pull
        try:
            out.append([buf.combine(x, handle) for x in xs])
        finally:
            HierarchicalBackend.pull_combine = True  # the body's setting
    torch.cuda.synchronize()
    buf.check()
    return out


def body_pull_combine(rank, world, P):
    """The pulled combine (session 11, HierarchicalBackend.pull_combine) on one world: with it on, the contract against
    the reference (random, skewed -- every rank but 0 receives nothing --, unrouted, starved, zero-token ranks;
    worst-case and host-synced sizing; an FP8 dispatch before it, a cached dispatch after it; node-limited routing;
    a CUDA graph), and each combine bit for bit against the pushed path (pull_combine off: today's) on the same
    handle, after a fresh BF16 dispatch, an FP8 one and a cached one. Every combine above took the pulled rail
    path (the rail saw pull=True), where the rail can (every rail peer over P2P: always on one host)."""
    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend
    from ep_plugin.backends.nvshmem.rail import NvshmemRail

    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(2 << 30))
    pulled = []
    orig = {name: getattr(NvshmemRail, name) for name in ("combine", "combine_placed")}

    def counting(name):
        def call(self, *a, **kw):
            pulled.append(bool(kw.get("pull", False)))
            return orig[name](self, *a, **kw)
        return call

    for name in orig:
        setattr(NvshmemRail, name, counting(name))
    HierarchicalBackend.pull_combine = True
    try:
        seed = 500
        for host_sync in (False, True):
            buf = ep_plugin.EPBuffer(None, _cfg("nvshmem", 512, host_sync, ranks_per_node=P), hidden=7168)
            assert buf.backend_name == "nvshmem"
            rail = next(iter(getattr(buf._backend, "wrapped", buf._backend)._rails.values()))
            assert rail.can_pull, f"rank {rank}: a rail peer on this host is not P2P-mapped"
            cases = (("random", 512), ("skew", "zero_first"), ("nowhere", 17), ("starve_last", 300)) if not host_sync \
                else (("random", 512), ("skew", "zero_first"))
            for mode, tokens in cases:
                seed += 1
                tokens = [0] + [9] * (world - 1) if tokens == "zero_first" else tokens
                ctx = f"rank {rank} {world // P}x{P} host_sync {host_sync} mode {mode} tokens {tokens}"
                res = check_against_reference(buf, rank, world, 7168, tokens, seed, mode, "cuda")  # + combine, cached
                rows = (res.x.float() * 0.5 + 1).to(torch.bfloat16)
                now, was = _pulled_and_pushed(buf, rows, res.handle)
                for a, b in zip(now, was):
                    assert torch.equal(a, b), f"{ctx}: pulled combine off by {(a.float() - b.float()).abs().max()}"
                # a cached dispatch after the pulled combines, then its rows' combine both ways
                xs, _, _ = make_inputs(world, tokens, 7168, E, K, seed, torch.bfloat16, mode)
                again = buf.dispatch((xs[rank].float() * 0.25).to(torch.bfloat16).cuda(), handle=res.handle)
                rows = (again.x.float() * (rank + 1) - 0.5).to(torch.bfloat16)
                now, was = _pulled_and_pushed(buf, rows, again.handle)
                for a, b in zip(now, was):
                    assert torch.equal(a, b), f"{ctx}: pulled combine after a cached dispatch differs"
            # an FP8 dispatch before it (the other rail: made at its first call), against the reference and bit for bit
            res = check_against_reference(buf, rank, world, 7168, [0] + [200] * (world - 1), 7, "random", "cuda",
                                          fp8=True)
            data, got_scales = res.x
            rows = (data.float() * got_scales.float().repeat_interleave(128, dim=1) * (rank + 1)).to(torch.bfloat16)
            now, was = _pulled_and_pushed(buf, rows, res.handle)
            for a, b in zip(now, was):
                assert torch.equal(a, b), f"rank {rank} host_sync {host_sync}: pulled combine after FP8 differs"
            check_node_limited(buf, rank, world, P, "cuda")  # num_groups = nodes, group_topk 1
            if not host_sync:
                check_graph(buf, rank, world)  # dispatch + pulled combine captured, replayed twice
            buf.check()
            buf.close()
    finally:
        HierarchicalBackend.pull_combine = True  # the default
        for name, fn in orig.items():
            setattr(NvshmemRail, name, fn)
    # the pushed halves of _pulled_and_pushed are the only calls without pull
    assert pulled.count(True) > pulled.count(False) > 0, (pulled.count(True), pulled.count(False))


@pytest.mark.parametrize("shape", list(WORLDS))
def test_pull_combine(shape):
    """`-k pull_combine`: both worlds, one spawn each (~20-30 s each on 4x H100)."""
    world, P = WORLDS[shape]
    _need(world)
    spawn(body_pull_combine, world, P, backend="nccl", timeout=240)
