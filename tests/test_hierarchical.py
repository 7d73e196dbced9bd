"""The hierarchical (internode) backend against the single-process reference and the torch backend.

On CPU (gloo) the composition runs with torch parts -- TorchRail across nodes, the torch backend
inside them, LocalNode for one-rank nodes -- on 2, 4 and 6 ranks split into nodes of 1, 2 and 3:
the routing, slot, order and count logic that the NVSHMEM backend shares. The same checks run on
2 GPUs with comm.backend: nvshmem as 2 virtual nodes (tests/test_rail_gpu.py has the kernels'
own comparison with TorchRail).
"""
import contextlib
import gc
import os
import traceback

import pytest
import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.backends.hierarchical import HierarchicalBackend
from ep_plugin.backends.hierarchical.backend import contract_positions
from ep_plugin.backends.hierarchical.nodes import ranks_per_node_of
from tests._dist import spawn_parts
from tests._need import need_nvshmem
from tests.reference import make_inputs, reference_combine, reference_dispatch, reference_expert_dispatch

E, K = 24, 4


def _cfg(backend, max_tokens, host_sync, **comm):
    return {"moe": {"num_experts": E, "topk": K},
            "comm": {"backend": backend, "max_tokens_per_rank": max_tokens, "timeout_s": 30.0,
                     "host_sync": host_sync, **comm}}


def hierarchical_buffer(hidden, P, max_tokens, host_sync=False):
    """An EPBuffer whose backend is the torch-parts composition with P ranks per node."""
    import ep_plugin.buffer as B

    orig = B.make_backend
    B.make_backend = lambda g, c, h, e: HierarchicalBackend(g, c, h, e, ranks_per_node=P)
    try:
        return ep_plugin.EPBuffer(None, _cfg("torch", max_tokens, host_sync), hidden=hidden)
    finally:
        B.make_backend = orig


def assert_sum_close(got, want, magnitude, ctx=""):
    """got == want, element by element, within 2^-6 of the sum of the magnitudes of want's terms (BF16
    rounding of the output and of a node's partial sum; cancellation cannot hide a wrong row, which is
    off by about one term)."""
    err = (got.float().cpu() - want).abs()
    bound = 2 ** -6 * magnitude + 1e-6
    bad = err > bound
    assert not bool(bad.any()), (f"{ctx}: {int(bad.sum())} of {bad.numel()} elements off, worst "
                                 f"{float((err - bound).max()):.4g} past the bound")


@contextlib.contextmanager
def agreed(what: str):
    """Runs a block of local checks (and the call they check), then agrees on the outcome across the ranks before
    whatever collective comes next: every rank's error text (or None) goes round by dist.all_gather_object, and a
    failure on any rank raises an AssertionError on every rank with the failing ranks' messages. Without it a rank
    whose assert failed left its peers waiting in the next collective (a combine, an all_gather_object) until the
    test timed out, its own message never shown (the 4-GPU overlapped FP8 case, docs/INTERNODE.md "Branch dovl13").
    Every rank must enter the same blocks in the same order; keep collectives of the host (all_gather_object) out of
    the block (a rank failing before one would meet its peers' gather with this one)."""
    error = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001  (recorded, agreed, raised on every rank below)
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        error = (exc, f"{type(exc).__name__} at {os.path.basename(frame.filename)}:{frame.lineno}: {exc}")
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else error[1])
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        raise AssertionError(f"{what}: failed on rank(s) {[r for r, _ in failed]}\n"
                             + "\n".join(f"  rank {r}: {m}" for r, m in failed)) from (error[0] if error else None)


def check_against_reference(buf, rank, world, hidden, tokens, seed, mode, device, fp8=False):
    """The dispatch (fresh), its combine and (BF16) a cached dispatch against the single-process reference. The
    checks of each call are agreed across the ranks (agreed) before the next collective: a failure on one rank
    raises on all of them, with its message."""
    xs, idxs, ws = make_inputs(world, tokens, hidden, E, K, seed, torch.bfloat16, mode)
    x, idx, w = xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device)
    ctx = f"rank {rank}/{world} hidden {hidden} tokens {tokens} mode {mode} seed {seed} fp8 {fp8}"
    rx, ridx, rw, tpe = reference_dispatch(xs, idxs, ws, rank, E)
    n = rx.shape[0]
    if fp8:
        # every rank's scales, known everywhere (seeded per source rank): the received ones are compared
        scales_all = [torch.rand(t.shape[0], hidden // 128, generator=torch.Generator().manual_seed(seed * 31 + src))
                      + 0.5 for src, t in enumerate(xs)]
        with agreed(f"FP8 dispatch, {ctx}"):
            res = buf.dispatch((x.to(torch.float8_e4m3fn), scales_all[rank].to(device)), idx, w)
            data, got_scales = res.x
            rscales = reference_dispatch(scales_all, idxs, ws, rank, E)[0]
            assert torch.equal(data[:n].float().cpu(), rx.to(torch.float8_e4m3fn).float()), f"rows, {ctx}"
            assert got_scales.shape[0] == data.shape[0] and torch.equal(got_scales[:n].cpu(), rscales), \
                f"scales, {ctx}"
        # the combine after an FP8 dispatch (BF16): the dequantised rows, scaled per rank, summed per token
        with agreed(f"combine after the FP8 dispatch, {ctx}"):
            deq = data.float() * got_scales.float().repeat_interleave(128, dim=1)
            rows = (deq * (rank + 1)).to(torch.bfloat16)
            y = buf.combine(rows, res.handle)
        everyone = [None] * world
        dist.all_gather_object(everyone, rows[:n].cpu())
        with agreed(f"combine after the FP8 dispatch (values), {ctx}"):
            want = reference_combine(everyone, idxs, rank, E)
            assert_sum_close(y, want, reference_combine([r.abs() for r in everyone], idxs, rank, E), ctx)
        return res
    with agreed(f"dispatch, {ctx}"):
        res = buf.dispatch(x, idx, w)
        assert res.x.shape[0] >= n and res.topk_idx.shape[0] == res.x.shape[0], ctx
        assert torch.equal(res.x[:n].cpu(), rx), f"rows, {ctx}"
        assert torch.equal(res.topk_idx[:n].cpu(), ridx), f"topk_idx, {ctx}"
        assert bool((res.topk_idx[n:] == -1).all()), f"padding topk_idx, {ctx}"
        assert torch.equal(res.topk_weights[:n].cpu(), rw), f"topk_weights, {ctx}"
        assert list(res.tokens_per_expert) == tpe, f"tokens_per_expert, {ctx}"
        assert int(res.handle.num_recv_device) == n, f"num_recv_device, {ctx}"
        assert sum(res.handle.recv_counts) == n and sum(res.handle.send_counts) == int(
            res.handle.is_token_in_rank.sum()), f"counts, {ctx}"
    # combine: each rank sends back its rows scaled by (rank + 1); the reference sums them per token
    with agreed(f"combine, {ctx}"):
        rows = (res.x.float() * (rank + 1) + 0.25).to(torch.bfloat16)
        y = buf.combine(rows, res.handle)
    everyone = [None] * world
    dist.all_gather_object(everyone, rows[:n].cpu())
    with agreed(f"combine (values), {ctx}"):
        want = reference_combine(everyone, idxs, rank, E)
        torch.testing.assert_close(y.float().cpu(), want, atol=3e-2, rtol=1e-2, msg=lambda m: f"{ctx}: {m}")
    # cached dispatch: new rows through the handle's layout
    with agreed(f"cached dispatch, {ctx}"):
        x2 = (x.float() * 0.5 - 1).to(torch.bfloat16)
        again = buf.dispatch(x2, handle=res.handle)
        rx2, _, _, _ = reference_dispatch([(t.float() * 0.5 - 1).to(torch.bfloat16) for t in xs], idxs, ws, rank, E)
        assert torch.equal(again.x[:n].cpu(), rx2), f"cached rows, {ctx}"
    return res


def node_limited_inputs(world, P, tokens, hidden, seed):
    """Every rank's inputs with DeepSeek-V3 node-limited gating: num_groups = nodes, group_topk 1 (each
    token's experts on one node), as make_inputs returns them."""
    from ep_plugin.routing import group_limited_topk

    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for _ in range(world):
        xs.append(torch.randn(tokens, hidden, generator=g).to(torch.bfloat16))
        idxs.append(group_limited_topk(torch.rand(tokens, E, generator=g), K, world // P, 1)[1].long().contiguous())
        ws.append(torch.rand(tokens, K, generator=g))
    return xs, idxs, ws


def check_node_limited(buf, rank, world, P, device):
    xs, idxs, ws = node_limited_inputs(world, P, 20, buf.hidden, 99)
    rx, ridx, rw, tpe = reference_dispatch(xs, idxs, ws, rank, E)
    n = rx.shape[0]
    ctx = f"rank {rank}/{world} node-limited"
    with agreed(f"dispatch, {ctx}"):  # every rank's checks before the combine (agreed)
        res = buf.dispatch(xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device))
        assert torch.equal(res.x[:n].cpu(), rx) and torch.equal(res.topk_idx[:n].cpu(), ridx), ctx
        assert list(res.tokens_per_expert) == tpe, ctx
    with agreed(f"combine, {ctx}"):
        rows = (res.x.float() * (rank + 1)).to(torch.bfloat16)
        y = buf.combine(rows, res.handle)
    everyone = [None] * world
    dist.all_gather_object(everyone, rows[:n].cpu())
    with agreed(f"combine (values), {ctx}"):
        torch.testing.assert_close(y.float().cpu(), reference_combine(everyone, idxs, rank, E), atol=3e-2, rtol=1e-2,
                                   msg=lambda m: f"{ctx}: {m}")


def check_no_cycle(P):
    """A closed buffer's backend goes when its last reference does (no reference cycle): a cycle kept its
    process groups, and gloo's threads, alive until the cyclic GC ran during interpreter exit, where
    they aborted the process now and then ("terminate called without an active exception")."""
    import weakref

    buf = hierarchical_buffer(256, P, max_tokens=8)
    backend = weakref.ref(buf._backend)
    buf.close()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        del buf
        assert backend() is None, "the hierarchical backend is held by a reference cycle"
    finally:
        if gc_was:
            gc.enable()


def body_torch_parts(rank, world, P):
    check_no_cycle(P)
    torch.manual_seed(0)
    seed = 10
    for host_sync in (False, True):
        for hidden in (256, 136):  # 136: not a multiple of 128
            buf = hierarchical_buffer(hidden, P, max_tokens=40, host_sync=host_sync)
            assert buf.backend_name == "hierarchical"
            for mode in ("random", "skew", "nowhere", "starve_last"):
                for tokens in (13, [0] + [7] * (world - 1), 40):
                    seed += 1
                    check_against_reference(buf, rank, world, hidden, tokens, seed, mode, "cpu")
            buf.close()
    buf = hierarchical_buffer(256, P, max_tokens=40)
    check_node_limited(buf, rank, world, P, "cpu")
    check_against_reference(buf, rank, world, 256, 29, 3, "random", "cpu", fp8=True)
    # async calls return events; outputs equal the synchronous ones
    xs, idxs, ws = make_inputs(world, 21, 256, E, K, 4, torch.bfloat16)
    res = buf.dispatch(xs[rank], idxs[rank], ws[rank], async_op=True)
    res.event.current_stream_wait()
    base = buf.dispatch(xs[rank], idxs[rank], ws[rank])
    assert torch.equal(res.x, base.x) and torch.equal(res.topk_idx, base.topk_idx)
    check_expert_major(buf, rank, world, xs, idxs, ws)
    check_backward(buf, rank, world, xs, idxs, ws)
    buf.close()


def check_expert_major(buf, rank, world, xs, idxs, ws):
    """Expert-major (built from the rank-major rows by the base class) against the reference layout; its
    combine with expert e's rows scaled by (1 + e's global id): token t gets the sum, over its experts,
    of its own row so scaled (each term rounded to BF16 as the rows are)."""
    ex = buf.dispatch(xs[rank], idxs[rank], ws[rank], layout="expert")
    rx, rw, offsets, tpe = reference_expert_dispatch(xs, idxs, ws, rank, E)
    n = offsets[-1]
    assert ex.expert_offsets.tolist() == offsets and ex.tokens_per_expert == tpe
    assert torch.equal(ex.x[:n], rx) and torch.equal(ex.topk_weights[:n], rw)
    epr = E // world
    seg = torch.repeat_interleave(torch.arange(epr), torch.tensor([b - a for a, b in zip(offsets, offsets[1:])]))
    scale = torch.zeros(ex.x.shape[0])
    scale[:n] = 1.0 + (rank * epr + seg).float()
    y = buf.combine((ex.x.float() * scale.unsqueeze(1)).to(torch.bfloat16), ex.handle)
    idx, x = idxs[rank], xs[rank].float()
    want, magnitude = torch.zeros_like(x), torch.zeros_like(x)
    for k in range(idx.shape[1]):
        term = (x * (1.0 + idx[:, k].clamp(min=0).float()).unsqueeze(1)).to(torch.bfloat16).float()
        term = torch.where((idx[:, k] >= 0).unsqueeze(1), term, 0.0)
        want, magnitude = want + term, magnitude + term.abs()
    assert_sum_close(y, want, magnitude, f"rank {rank}/{world} expert-major combine")


def check_backward(buf, rank, world, xs, idxs, ws):
    """Dispatch's backward with random upstream gradients (padding rows' included, which must not count):
    x's gradient is the reference combine of everyone's row gradients, and each (token, k) weight gets
    the gradient of the slot it landed in on the expert's rank."""
    xg = xs[rank].clone().requires_grad_(True)
    wg = ws[rank].clone().requires_grad_(True)
    out = buf.dispatch(xg, idxs[rank], wg)
    g = torch.Generator().manual_seed(77 + rank)
    gx = torch.randn(out.x.shape, generator=g)
    gw = torch.randn(out.topk_weights.shape, generator=g)
    ((out.x.float() * gx).sum() + (out.topk_weights * gw).sum()).backward()
    n = int(out.handle.num_recv_device)
    rows_g, w_g = [None] * world, [None] * world
    dist.all_gather_object(rows_g, gx[:n].to(torch.bfloat16))
    dist.all_gather_object(w_g, gw[:n])
    want_x = reference_combine(rows_g, idxs, rank, E)
    assert_sum_close(xg.grad, want_x, reference_combine([r.abs() for r in rows_g], idxs, rank, E),
                     f"rank {rank}/{world} x grad")
    epr, idx = E // world, idxs[rank]
    want_w = torch.zeros_like(ws[rank])
    for r in range(world):
        before = sum(int(((i >= 0) & (i // epr == r)).any(1).sum()) for i in idxs[:rank])
        on_r = (idx >= 0) & (idx // epr == r)
        sel = on_r.any(1).nonzero()[:, 0]
        want_w[sel] += torch.where(on_r[sel], w_g[r][before:before + len(sel)], 0.0)
    torch.testing.assert_close(wg.grad, want_w)


TORCH_PARTS = {2: (1,), 4: (2, 1), 6: (3, 2), 8: (4, 2)}  # world -> ranks per node of the cases


@pytest.fixture(scope="module")
def torch_parts_runs(tmp_path_factory):
    """One spawn per world size, running the cases of every P of that world in it (the process start-ups
    of 6 and 8 ranks on the CI machine's 2 cores cost more than a case)."""
    runs = {}

    def run(world, body):
        if world not in runs:
            parts = [(f"P{P}", body, (P,)) for P in TORCH_PARTS[world]]
            runs[world] = spawn_parts(parts, world, str(tmp_path_factory.mktemp(f"hier_torch{world}")), timeout=900)
        return runs[world]
    return run


@pytest.mark.parametrize("world,P", [(2, 1), (4, 2), (4, 1), (6, 3), (6, 2)])
def test_torch_parts_match_reference(torch_parts_runs, world, P):
    torch_parts_runs(world, body_torch_parts)[f"P{P}"].check()


def body_world8(rank, world, P):
    """The forwarding schedule at 8 ranks (fewer cases: 8 processes share the CI machine's 2 cores)."""
    buf = hierarchical_buffer(256, P, max_tokens=24)
    for seed, (mode, tokens) in enumerate((("random", 24), ("skew", [0] + [5] * 7), ("starve_last", 11))):
        check_against_reference(buf, rank, world, 256, tokens, 200 + seed, mode, "cpu")
    check_node_limited(buf, rank, world, P, "cpu")
    buf.close()


@pytest.mark.parametrize("P", [4, 2])
def test_torch_parts_at_eight_ranks(torch_parts_runs, P):
    torch_parts_runs(8, body_world8)[f"P{P}"].check()


def test_contract_positions_reorders_forwarder_blocks():
    # 2 nodes x 2 ranks; counts received from global ranks 0..3: 2, 1, 0, 3 (inner order: l=0: s=0 (2),
    # s=1 (0); l=1: s=0 (1), s=1 (3)); contract order: g0 (2), g1 (1), g2 (0), g3 (3)
    c = torch.tensor([2, 1, 0, 3])
    pos = contract_positions(c, nodes=2, per_node=2, rows=8)
    # inner rows: [g0 a, g0 b, g1 a, g3 a, g3 b, g3 c] -> contract positions 0, 1, 2, 3, 4, 5; row 6, 7 stay
    assert pos.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    c = torch.tensor([1, 2, 3, 0])  # inner: l0: s0 (1), s1 (3); l1: s0 (2), s1 (0)
    pos = contract_positions(c, nodes=2, per_node=2, rows=7)
    # contract: g0 at 0, g1 at 1..2, g2 at 3..5; inner rows: g0, g2, g2, g2, g1, g1, (tail)
    assert pos.tolist() == [0, 3, 4, 5, 1, 2, 6]


def test_ranks_per_node_from_hosts():
    assert ranks_per_node_of(["a", "a", "b", "b"]) == 2
    assert ranks_per_node_of(["a", "b", "c"]) == 1
    with pytest.raises(ValueError, match="contiguous"):
        ranks_per_node_of(["a", "b", "a", "b"])
    with pytest.raises(ValueError, match="contiguous"):
        ranks_per_node_of(["a", "a", "a", "b"])


def test_auto_counts_virtual_nodes():
    from ep_plugin.backends.registry import auto_choice

    def unavailable(name):
        return None

    name, why = auto_choice("nccl", True, True, 2, lambda: 2, lambda: True, unavailable)
    assert name == "nvshmem" and "2 nodes" in why
    name, _ = auto_choice("nccl", True, True, 2, lambda: 1, lambda: True, unavailable)
    assert name == "nvlink"


def test_ranks_per_node_is_validated():
    cfg = ep_plugin.load_config({"comm": {"ranks_per_node": 2}})
    assert cfg.comm.ranks_per_node == 2
    with pytest.raises(ep_plugin.ConfigError, match="ranks_per_node"):
        ep_plugin.load_config({"comm": {"ranks_per_node": 0}})


# ---------------------------------------------------------------------------- GPUs
def body_nvshmem(rank, world):
    torch.cuda.set_device(rank)
    seed = 50
    for host_sync in (False, True):
        cfg = _cfg("nvshmem", 512, host_sync, ranks_per_node=1)
        buf = ep_plugin.EPBuffer(None, cfg, hidden=7168)
        assert buf.backend_name == "nvshmem"
        for mode in ("random", "skew", "nowhere", "starve_last"):
            for tokens in (17, [0] + [9] * (world - 1), 300, 512):
                seed += 1
                check_against_reference(buf, rank, world, 7168, tokens, seed, mode, "cuda")
        check_against_reference(buf, rank, world, 7168, 200, 5, "random", "cuda", fp8=True)
        check_against_reference(buf, rank, world, 7168, [0] + [200] * (world - 1), 6, "random", "cuda", fp8=True)
        check_node_limited(buf, rank, world, 1, "cuda")
        if not host_sync:
            check_graph(buf, rank, world)
        buf.close()


def check_graph(buf, rank, world):
    """A dispatch + combine captured in a CUDA graph replays to the eager results (no host sync inside)."""
    xs, idxs, ws = make_inputs(world, 64, 7168, E, K, 77, torch.bfloat16)
    x, idx, w = xs[rank].cuda(), idxs[rank].cuda(), ws[rank].cuda()
    eager = buf.dispatch(x, idx, w)
    y_eager = buf.combine(eager.x, eager.handle)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            res = buf.dispatch(x, idx, w)
            y = buf.combine(res.x, res.handle)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    n = int(eager.handle.num_recv_device)
    assert torch.equal(res.x[:n], eager.x[:n]) and torch.equal(y, y_eager)


@pytest.fixture(scope="module")
def nvshmem_parts(tmp_path_factory):
    """Both GPU bodies in one spawn (one process start, NCCL init and NVSHMEM bootstrap), in abandon
    mode: the timeout leaves rank 0's buffer broken, so it runs last."""
    need_nvshmem(2)
    parts = [("two_virtual_nodes", body_nvshmem, ()), ("timeout", body_nvshmem_timeout, ())]
    return spawn_parts(parts, 2, str(tmp_path_factory.mktemp("hier_nvshmem")), backend="nccl", abandon=True,
                       timeout=500)


@pytest.mark.gpu
def test_nvshmem_two_virtual_nodes(nvshmem_parts):
    nvshmem_parts["two_virtual_nodes"].check()


def test_traffic_per_domain():
    from ep_plugin.plan.traffic import hierarchical_rows

    # 2 nodes x 2 ranks, 8 experts (2 per rank, 4 per node). Rank 0's token: experts 1 (rank 0), 3
    # (rank 1), 5 (rank 2) -> RDMA once to rank 2 (its rail peer), which keeps it (expert 5 is its
    # own); NVLink: rank 0 -> rank 1. Flat: one RDMA row to rank 2. Rank 3's token: experts 0, 2 (ranks
    # 0 and 1 on node 0) -> one RDMA row to rank 1, which forwards one NVLink row to rank 0.
    idx = [torch.tensor([[1, 3, 5]]), torch.empty(0, 3, dtype=torch.long), torch.empty(0, 3, dtype=torch.long),
           torch.tensor([[0, 2, -1]])]
    t = hierarchical_rows(idx, 8, 2)
    assert t["rdma_sent"] == [1, 0, 0, 1] and t["rdma_recv"] == [0, 1, 1, 0]
    assert t["nvlink_sent"] == [1, 1, 0, 0] and t["local"] == [1, 1, 1, 0]
    assert t["flat_rdma_sent"] == [1, 0, 0, 2]


def test_node_limited_gating_cuts_rdma_rows():
    from ep_plugin.plan.traffic import hierarchical_rows
    from ep_plugin.routing import group_limited_topk

    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(512, 64, generator=g) for _ in range(4)]
    uniform = [s.topk(8, dim=1).indices for s in scores]
    limited = [group_limited_topk(s, 8, num_groups=2, group_topk=1)[1] for s in scores]  # 2 groups = 2 nodes
    u, lim = hierarchical_rows(uniform, 64, 2), hierarchical_rows(limited, 64, 2)
    assert sum(lim["rdma_sent"]) < 0.6 * sum(u["rdma_sent"])
    assert sum(u["rdma_sent"]) < sum(u["flat_rdma_sent"])  # a row crosses once per node, not per rank


def body_nvshmem_timeout(rank, world):
    torch.cuda.set_device(rank)
    buf = ep_plugin.EPBuffer(None, _cfg("nvshmem", 64, False, ranks_per_node=1, timeout_s=2.0), hidden=1024)
    xs, idxs, ws = make_inputs(world, 32, 1024, E, K, 9, torch.bfloat16)
    dist.barrier()
    if rank == 1:
        return  # never dispatches: rank 0's rail waits for it until comm.timeout_s
    buf.dispatch(xs[0].cuda(), idxs[0].cuda(), ws[0].cuda())
    torch.cuda.synchronize()
    from ep_plugin.errors import EPTimeoutError
    with pytest.raises(EPTimeoutError) as info:
        buf.check()
    assert tuple(info.value.missing_ranks) == (1,)


@pytest.mark.gpu
def test_nvshmem_timeout_names_the_missing_rank(nvshmem_parts):
    nvshmem_parts["timeout"].check()
