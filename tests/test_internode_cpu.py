"""CPU checks of the internode pieces that the GPU runs lean on: the receive counts read off the inner
exchange (no count all-to-all), the stage timeline's marks, and the device script's Python parts
(argument parsing, imports) so that a device call cannot fail on a typo."""
import os
import subprocess
import sys

import pytest
import torch

from ep_plugin.backends.hierarchical.backend import contract_order, contract_positions
from ep_plugin.backends.hierarchical.timeline import NO_TIMELINE, StageTimeline
from tests._dist import spawn_parts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("N,P,M", [(2, 2, 7), (3, 2, 5), (2, 4, 3), (4, 1, 6)])
def test_contract_order_matches_brute_force(N, P, M):
    g = torch.Generator().manual_seed(N * 100 + P * 10 + M)
    for _ in range(20):
        # per forwarder l, a sorted subset of its N*M slots (the inner exchange's order: forwarder, slot)
        srcs, off = [], [0]
        for _l in range(P):
            keep = torch.rand(N * M, generator=g) < 0.4
            srcs.append(keep.nonzero().flatten())
            off.append(off[-1] + srcs[-1].numel())
        garbage = torch.randint(-5, 10 * N * M, (3,), generator=g)  # worst-case rows past the valid ones
        recv_src = torch.cat(srcs + [garbage]).to(torch.int32)
        want = torch.zeros(N * P, dtype=torch.int64)
        for l, s in enumerate(srcs):
            for slot in s.tolist():
                want[(slot // M) * P + l] += 1
        got, pos = contract_order(torch.tensor(off, dtype=torch.int32), recv_src, N, P, M, recv_src.numel())
        assert got.tolist() == want.tolist()
        # the positions are those contract_positions derives from the counts: a permutation of the rows
        assert torch.equal(pos, contract_positions(got, N, P, recv_src.numel()))
        assert sorted(pos.tolist()) == list(range(recv_src.numel()))


def body_timeline(rank, world, P):
    from tests.reference import make_inputs
    from tests.test_hierarchical import E, K, hierarchical_buffer

    buf = hierarchical_buffer(64, P, max_tokens=16)
    tl = StageTimeline()
    buf._backend.timeline = tl
    xs, idxs, ws = make_inputs(world, 9, 64, E, K, 5, torch.bfloat16)
    for _ in range(2):
        a = buf.dispatch(xs[rank], idxs[rank], ws[rank])
        buf.dispatch(xs[rank], handle=a.handle)
        buf.combine(a.x, a.handle)
    s = tl.summary()
    assert set(s) == {"dispatch", "dispatch_cached", "combine"}, s
    many = P > 1
    want = {"dispatch": ["rail_recv", "layout", "forward"] + (["reorder"] if many else []) + ["counts"],
            "dispatch_cached": ["rail_recv", "forward"] + (["reorder"] if many else []),
            "combine": (["reorder"] if many else []) + ["reduce_in_node", "rail_recv_sum"]}
    for kind, stages in want.items():
        assert list(s[kind]) == stages + ["total"], (kind, list(s[kind]))
        assert all(v["host_us"] >= 0 for v in s[kind].values())
    assert len(tl.per_call()) == 6
    buf.close()


# world -> the bodies run in its one spawn: (name, body, ranks per node); the tests below name theirs
RUNS = {4: (("timeline", "body_timeline", 2), ("sources", "body_sources_path", 2), ("phased", "body_phased_rail", 2),
            ("routed", "body_routed_combine", 2), ("direct", "body_direct_cached", 2),
            ("fresh", "body_direct_fresh", 2), ("pulled", "body_pull_combine", 2)),
        2: (("timeline", "body_timeline", 1), ("phased", "body_phased_rail", 1), ("routed", "body_routed_combine", 1),
            ("pulled", "body_pull_combine", 1)),
        6: (("sources", "body_sources_path", 3),)}


@pytest.fixture(scope="module")
def internode_runs(tmp_path_factory):
    """One spawn per world size for every body of that size (process start-ups of 4 and 6 ranks on the
    CI machine's 2 cores cost more than the bodies); each body leaves the group usable."""
    runs = {}

    def run(world, name, P):
        if world not in runs:
            parts = [(f"{n}_P{p}", globals()[body], (p,)) for n, body, p in RUNS[world]]
            runs[world] = spawn_parts(parts, world, str(tmp_path_factory.mktemp(f"internode{world}")), timeout=600)
        return runs[world][f"{name}_P{P}"]
    return run


@pytest.mark.parametrize("world,P", [(4, 2), (2, 1)])
def test_timeline_marks_each_stage(internode_runs, world, P):
    internode_runs(world, "timeline", P).check()


def test_bench_internode_arguments():
    bench = os.path.join(ROOT, "benchmarks", "bench_internode.py")
    ok = subprocess.run([sys.executable, bench, "--dry-run", "--world", "4", "--ranks-per-node", "2", "--cases",
                         "uniform", "--timeline", "10", "--profile", "--iters", "30", "--timeout", "60", "--out",
                         "/tmp", "--label", "2x2"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "world 4, ranks_per_node 2" in ok.stdout
    bad = subprocess.run([sys.executable, bench, "--dry-run", "--cases", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "nope" in bad.stderr


def test_timeline_table_formats_rows():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_internode
    finally:
        sys.path.pop(0)
    stage = {"gpu_us": 10.0, "host_us": 3.0}
    rows = [{"case": "uniform", "timeline": [{"dispatch": {"rail_recv": stage, "total": stage}}] * 2}]
    text = bench_internode.timeline_table(rows)
    assert "rail_recv 10 (3)" in text and "uniform" in text


def test_device_script_parses():
    script = os.path.join(ROOT, "benchmarks", "internode_device.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0


class _InnerWithSources:
    """The torch backend inside a node, with what the nvlink backend's handle keeps added to its state:
    recv_off [P + 1] (rows per forwarder) and recv_src (each row's slot on its forwarder), so that the
    hierarchical backend takes its contract_order path on CPU."""

    def __init__(self, inner, P):
        self.inner, self.P = inner, P

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def dispatch(self, xf, sf, topk_f, wf, handle=None, async_op=False):
        import torch.distributed as dist

        res = self.inner.dispatch(xf, sf, topk_f, wf, handle=handle, async_op=async_op)
        if handle is None:
            group = self.inner.group
            every = [None] * self.P
            dist.all_gather_object(every, topk_f, group=group)
            j = dist.get_rank(group)
            per = self.inner.experts_per_rank
            srcs = [((t >= 0) & (t // per == j)).any(1).nonzero().flatten() for t in every]
            off = torch.tensor([0] + [int(s.numel()) for s in srcs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            src = torch.cat(srcs).to(torch.int32)
            pad = torch.full((res.handle.num_recv - src.numel(),), 12345, dtype=torch.int32)  # undefined rows
            res.handle.state.recv_off, res.handle.state.recv_src = off, torch.cat([src, pad])
        return res


def body_sources_path(rank, world, P):
    from ep_plugin.backends.hierarchical import backend as hb
    from tests.test_hierarchical import check_against_reference, check_node_limited, hierarchical_buffer

    used = []
    orig = hb.contract_order
    hb.contract_order = lambda *a: used.append(1) or orig(*a)
    try:  # put back: the process runs other bodies after this one
        for host_sync in (False, True):
            buf = hierarchical_buffer(128, P, max_tokens=24, host_sync=host_sync)
            buf._backend.inner = _InnerWithSources(buf._backend.inner, P)
            for seed, (mode, tokens) in enumerate((("random", 24), ("skew", [0] + [7] * (world - 1)),
                                                  ("starve_last", 13), ("nowhere", 20))):
                check_against_reference(buf, rank, world, 128, tokens, 40 + seed, mode, "cpu")
            check_node_limited(buf, rank, world, P, "cpu")
            buf.close()
    finally:
        hb.contract_order = orig
    assert used, "the contract_order path was not taken"


@pytest.mark.parametrize("world,P", [(4, 2), (6, 3)])
def test_hierarchical_orders_rows_from_inner_sources(internode_runs, world, P):
    internode_runs(world, "sources", P).check()


class _InnerGathering(_InnerWithSources):
    """_InnerWithSources declaring `combine_gathers` (as the nvlink backend does): the hierarchical combine then
    hands it x and the reorder's index (Backend.combine_gathered, the torch backend's default: a gather) instead
    of gathering first. Counts its calls."""

    def __init__(self, inner, P):
        super().__init__(inner, P)
        import dataclasses

        self.capabilities = dataclasses.replace(inner.capabilities, combine_gathers=True)
        self.gathered = 0

    def combine_gathered(self, x, x_rows, handle, async_op=False):
        self.gathered += 1
        return self.inner.combine_gathered(x, x_rows, handle, async_op)


def body_routed_combine(rank, world, P):
    """The combine path of session 8 (HierarchicalBackend.fused_combine) on CPU: at P > 1 the inner combine
    takes x and the reorder's index (cut to x's rows when x is), at P = 1 the rail reads x's rows through the
    slots' index; against the reference, and bit for bit against the path before (fused_combine False)."""
    import torch.distributed as dist

    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend
    from tests.reference import make_inputs
    from tests.test_hierarchical import E, K, check_against_reference, check_node_limited, hierarchical_buffer

    buf = hierarchical_buffer(128, P, max_tokens=24)
    be = buf._backend
    if P > 1:
        be.inner = _InnerGathering(be.inner, P)
    for seed, (mode, tokens) in enumerate((("random", 24), ("skew", [0] + [7] * (world - 1)), ("nowhere", 20))):
        check_against_reference(buf, rank, world, 128, tokens, 70 + seed, mode, "cpu")
    check_node_limited(buf, rank, world, P, "cpu")
    xs, idxs, ws = make_inputs(world, 17, 128, E, K, 3, torch.bfloat16)
    a = buf.dispatch(xs[rank], idxs[rank], ws[rank])
    rows = (a.x.float() * (rank + 1) - 0.5).to(torch.bfloat16)
    n = int(a.handle.num_recv_device)
    tl = StageTimeline()
    be.timeline = tl
    got = [buf.combine(rows, a.handle), buf.combine(rows[:n].contiguous(), a.handle)]  # full and cut rows
    be.timeline = NO_TIMELINE
    HierarchicalBackend.fused_combine = False
    try:
        want = [buf.combine(rows, a.handle), buf.combine(rows[:n].contiguous(), a.handle)]
    finally:
        HierarchicalBackend.fused_combine = True
    for g, w in zip(got, want):
        assert torch.equal(g, w), (rank, (g.float() - w.float()).abs().max())
    assert list(tl.summary()["combine"]) == ["reduce_in_node", "rail_recv_sum", "total"], tl.summary()["combine"]
    if P > 1:
        assert be.inner.gathered >= 6, be.inner.gathered  # every combine above took the routed path
    dist.barrier()
    buf.close()


def body_pull_combine(rank, world, P):
    """HierarchicalBackend.pull_combine (session 11) on CPU, where the torch rail takes pull=True with the same exchange:
    every combine branch of the backend hands the rail pull=True (P > 1: the routed combine through an inner backend
    that gathers, and the gather path of fused_combine False; P = 1: x read in place, and to_slots), the sums match
    the reference, and the pushed path (pull_combine False) bit for bit. The kernels' side is tests/test_internode_gpu.py
    (test_pull_combine)."""
    import torch.distributed as dist

    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend
    from tests.reference import make_inputs
    from tests.test_hierarchical import E, K, check_against_reference, check_node_limited, hierarchical_buffer

    assert HierarchicalBackend.pull_combine is True  # the default (the torch rail can pull: the same exchange)
    buf = hierarchical_buffer(128, P, max_tokens=24)
    be = buf._backend
    if P > 1:
        be.inner = _InnerGathering(be.inner, P)
    rail = be._rails[be.fp8]
    seen = []
    orig = rail.combine
    rail.combine = lambda *a, **kw: seen.append(kw.get("pull", False)) or orig(*a, **kw)
    check_against_reference(buf, rank, world, 128, 24, 89, "random", "cpu")
    assert seen and all(seen), (P, seen)  # the default pulls at every P
    del seen[:]
    HierarchicalBackend.pull_combine = True
    try:
        for seed, (mode, tokens) in enumerate((("random", 24), ("skew", [0] + [7] * (world - 1)), ("nowhere", 20),
                                               ("starve_last", 24))):
            check_against_reference(buf, rank, world, 128, tokens, 90 + seed, mode, "cpu")
        check_node_limited(buf, rank, world, P, "cpu")
        assert seen and all(seen), seen
        xs, idxs, ws = make_inputs(world, 17, 128, E, K, 5, torch.bfloat16)
        a = buf.dispatch(xs[rank], idxs[rank], ws[rank])
        rows = (a.x.float() * (rank + 1) - 0.5).to(torch.bfloat16)
        n = int(a.handle.num_recv_device)
        got, want = [], []
        for fused in (True, False):  # the routed / in-place branches, then the gather branches
            HierarchicalBackend.fused_combine = fused
            try:
                del seen[:]
                got += [buf.combine(rows, a.handle), buf.combine(rows[:n].contiguous(), a.handle)]
                assert seen == [True, True], (fused, seen)
                HierarchicalBackend.pull_combine = False
                want += [buf.combine(rows, a.handle), buf.combine(rows[:n].contiguous(), a.handle)]
                assert seen == [True, True, False, False], (fused, seen)
            finally:
                HierarchicalBackend.fused_combine = True
                HierarchicalBackend.pull_combine = True
        for g, w in zip(got, want):
            assert torch.equal(g, w), (rank, (g.float() - w.float()).abs().max())
    finally:
        HierarchicalBackend.pull_combine = True
    dist.barrier()
    buf.close()


@pytest.mark.parametrize("world,P", [(4, 2), (2, 1)])
def test_pull_combine_hands_the_rail_pull(internode_runs, world, P):
    internode_runs(world, "pulled", P).check()


class _InnerScattering(_InnerWithSources):
    """_InnerWithSources declaring `dispatch_scatters` (as the nvlink backend does): the hierarchical cached dispatch
    then hands it the contract positions (Backend.dispatch_scattered) instead of reordering the rows after it. Its
    dispatch_scattered does on CPU what the nvlink pull kernels do through DispatchRoute: every output row i of the
    cached dispatch, padding included, written at out_rows[i]. Counts its calls."""

    def __init__(self, inner, P):
        super().__init__(inner, P)
        import dataclasses

        self.capabilities = dataclasses.replace(inner.capabilities, dispatch_scatters=True)
        self.scattered = 0

    def dispatch_scattered(self, x, scales, topk_weights, handle, out_rows, async_op=False):
        from ep_plugin.types import DispatchOutput

        assert out_rows.dtype == torch.int64 and out_rows.numel() == handle.num_recv
        self.scattered += 1
        res = self.inner.dispatch(x, scales, handle.topk_idx, topk_weights, handle=handle)

        def placed(t):  # FP8 rows as bytes (index_copy_ has no FP8 kernel)
            if t is None:
                return None
            b = t.view(torch.uint8) if t.element_size() == 1 else t
            return torch.empty_like(b).index_copy_(0, out_rows, b).view(t.dtype)
        return DispatchOutput(x=placed(res.x), scales=placed(res.scales), topk_idx=None,
                              topk_weights=placed(res.topk_weights), handle=handle)


def body_direct_cached(rank, world, P):
    """The cached dispatch of session 10 (HierarchicalBackend.direct_cached_dispatch) on CPU: the inner dispatch
    writes into the contract's order through to_contract, with no reorder stage; against the reference (worst-case
    and host-synced sizing), and bit for bit against the path before (the reorder after the inner dispatch), BF16
    and FP8, with the combine after it."""
    import torch.distributed as dist

    from ep_plugin.backends.hierarchical.backend import HierarchicalBackend
    from tests.reference import make_inputs
    from tests.test_hierarchical import E, K, check_against_reference, hierarchical_buffer

    for host_sync in (False, True):
        buf = hierarchical_buffer(128, P, max_tokens=24, host_sync=host_sync)
        be = buf._backend
        be.inner = _InnerScattering(be.inner, P)
        for seed, (mode, tokens) in enumerate((("random", 24), ("skew", [0] + [7] * (world - 1)), ("nowhere", 20))):
            check_against_reference(buf, rank, world, 128, tokens, 80 + seed, mode, "cpu")  # its cached dispatch too
        assert be.inner.scattered == 3, be.inner.scattered
        xs, idxs, ws = make_inputs(world, 17, 128, E, K, 9, torch.bfloat16)
        x, idx, w = xs[rank], idxs[rank], ws[rank]
        scales = torch.rand(x.shape[0], 1, generator=torch.Generator().manual_seed(rank)) + 0.5
        for fp8 in (False, True):
            xin = (x.to(torch.float8_e4m3fn), scales) if fp8 else x
            a = buf.dispatch(xin, idx, w)
            n = int(a.handle.num_recv_device)
            x2 = (x.float() * 0.5 - 1).to(torch.bfloat16)
            x2in = (x2.to(torch.float8_e4m3fn), scales * 2) if fp8 else x2
            tl = StageTimeline()
            be.timeline = tl
            now = buf.dispatch(x2in, None, w * 2, handle=a.handle)
            be.timeline = NO_TIMELINE
            HierarchicalBackend.direct_cached_dispatch = False
            try:
                was = buf.dispatch(x2in, None, w * 2, handle=a.handle)
            finally:
                HierarchicalBackend.direct_cached_dispatch = True
            assert list(tl.summary()["dispatch_cached"]) == ["rail_recv", "forward", "total"], tl.summary()
            got, want = (now.x, was.x) if fp8 else ((now.x, None), (was.x, None))
            assert torch.equal(got[0][:n].view(torch.uint8), want[0][:n].view(torch.uint8)), (rank, fp8)
            if fp8:
                assert torch.equal(got[1][:n], want[1][:n]), rank
            assert torch.equal(now.topk_weights, was.topk_weights) and torch.equal(now.topk_idx, was.topk_idx), rank
            if not fp8:
                rows = (now.x.float() * (rank + 1)).to(torch.bfloat16)
                assert torch.equal(buf.combine(rows, a.handle), buf.combine(was.x.float().mul(rank + 1).to(
                    torch.bfloat16), a.handle)), rank
        assert be.inner.scattered == 5, be.inner.scattered
        dist.barrier()
        buf.close()


class _InnerContracting(_InnerScattering):
    """_InnerScattering declaring `dispatch_contracts` (as the nvlink backend does): the hierarchical fresh dispatch
    then asks it for the rows in the contract's order (Backend.dispatch_contract) instead of running contract_order
    and the reorder after it. Its dispatch_contract does on CPU what stage_pull_tma's contract mode does: from each
    forwarder l's send list to this rank (ascending slots: recv_src's block of l) the lower bounds below[l][s] of
    s*M, the counts and starts per source rank g = s*P + l, row i placed at start[g] + i - off[l] - below[l][s]
    (padding rows in place), the index and the counts returned. It fits worst-case calls only, as the kernel.
    Counts its calls."""

    def __init__(self, inner, P, worst_case):
        super().__init__(inner, P)
        import dataclasses

        self.capabilities = dataclasses.replace(self.capabilities, dispatch_contracts=True)
        self.worst_case, self.contracted = worst_case, 0

    def dispatch_contract_fits(self, x, scales, nodes):
        return self.worst_case

    def dispatch_contract(self, xf, sf, topk_f, wf, nodes, async_op=False):
        from ep_plugin.types import ContractDispatch, DispatchOutput

        assert self.worst_case
        self.contracted += 1
        res = self.dispatch(xf, sf, topk_f, wf)
        st, P, N = res.handle.state, self.P, nodes
        M = xf.shape[0] // N
        R = res.handle.num_recv
        off, src = st.recv_off.long(), st.recv_src.long()
        below = torch.stack([torch.searchsorted(src[off[l]:off[l + 1]], torch.arange(N + 1) * M) for l in range(P)])
        counts = (below[:, 1:] - below[:, :-1]).t().reshape(-1)  # [N*P] in g = s*P + l order
        start = counts.cumsum(0) - counts
        pos = torch.arange(R)
        for i in range(int(off[P])):
            l = int(torch.searchsorted(off[1:], torch.tensor(i), right=True))
            s_ = int(src[i]) // M
            pos[i] = start[s_ * P + l] + i - off[l] - below[l, s_]
        pos = pos.clamp(0, R - 1)

        def placed(t):  # FP8 rows as bytes (index_copy_ has no FP8 kernel)
            if t is None:
                return None
            b = t.view(torch.uint8) if t.element_size() == 1 else t
            return torch.empty_like(b).index_copy_(0, pos, b).view(t.dtype)
        idx = placed(res.topk_idx)
        res.handle.recv_topk_idx = idx  # as the nvlink backend's: its handle's ids are the output's
        out = DispatchOutput(x=placed(res.x), scales=placed(res.scales), topk_idx=idx,
                             topk_weights=placed(res.topk_weights), handle=res.handle)
        return ContractDispatch(out=out, to_contract=pos, recv_counts=counts)


def body_direct_fresh(rank, world, P):
    """The fresh dispatch in contract order (HierarchicalBackend.direct_fresh_dispatch) on CPU: the inner dispatch
    computes each row's contract position (as stage_pull_tma's contract mode) and returns the index and counts,
    with no contract_order and no reorder stage; against the reference (fresh, cached and combine: worst-case,
    where it runs, and host-synced, where it falls back), and bit for bit against the path before, BF16 and FP8:
    rows, scales, ids, weights, the handle's to_contract, counts and num_recv_device, and the combine and the
    cached dispatch of each handle."""
    import torch.distributed as dist

    from ep_plugin.backends.hierarchical import backend as hb
    from tests.reference import make_inputs
    from tests.test_hierarchical import E, K, check_against_reference, hierarchical_buffer

    HB = hb.HierarchicalBackend
    assert HB.direct_fresh_dispatch is True  # the default since session 10's device run
    used = []
    orig = hb.contract_order
    hb.contract_order = lambda *a: used.append(1) or orig(*a)
    HB.direct_fresh_dispatch = True
    try:
        for host_sync in (False, True):
            buf = hierarchical_buffer(128, P, max_tokens=24, host_sync=host_sync)
            be = buf._backend
            be.inner = _InnerContracting(be.inner, P, worst_case=not host_sync)
            used.clear()
            for seed, (mode, tokens) in enumerate((("random", 24), ("skew", [0] + [7] * (world - 1)),
                                                  ("nowhere", 20))):
                check_against_reference(buf, rank, world, 128, tokens, 90 + seed, mode, "cpu")
            assert be.inner.contracted == (0 if host_sync else 3), be.inner.contracted
            assert bool(used) == host_sync, used  # the fallback is the path before, contract_order included
            if host_sync:
                dist.barrier()
                buf.close()
                continue
            xs, idxs, ws = make_inputs(world, 17, 128, E, K, 11, torch.bfloat16)
            x, idx, w = xs[rank], idxs[rank], ws[rank]
            scales = torch.rand(x.shape[0], 1, generator=torch.Generator().manual_seed(rank)) + 0.5
            for fp8 in (False, True):
                xin = (x.to(torch.float8_e4m3fn), scales) if fp8 else x
                tl = StageTimeline()
                be.timeline = tl
                now = buf.dispatch(xin, idx, w)
                be.timeline = NO_TIMELINE
                HB.direct_fresh_dispatch = False
                try:
                    was = buf.dispatch(xin, idx, w)
                finally:
                    HB.direct_fresh_dispatch = True
                assert list(tl.summary()["dispatch"]) == ["rail_recv", "layout", "forward", "counts", "total"], \
                    tl.summary()
                hn, hw = now.handle, was.handle
                n = int(hn.num_recv_device)
                assert n == int(hw.num_recv_device) and hn.num_recv == hw.num_recv, rank
                got, want = (now.x, was.x) if fp8 else ((now.x, None), (was.x, None))
                assert torch.equal(got[0][:n].view(torch.uint8), want[0][:n].view(torch.uint8)), (rank, fp8)
                if fp8:
                    assert torch.equal(got[1][:n], want[1][:n]), rank
                assert torch.equal(now.topk_idx, was.topk_idx) and torch.equal(now.topk_weights, was.topk_weights)
                assert torch.equal(hn.state.to_contract, hw.state.to_contract), rank
                assert hn.recv_counts == hw.recv_counts and hn.send_counts == hw.send_counts, rank
                assert torch.equal(hn.recv_topk_idx, hw.recv_topk_idx), rank
                x2 = (x.float() * 0.5 - 1).to(torch.bfloat16)
                x2in = (x2.to(torch.float8_e4m3fn), scales * 2) if fp8 else x2
                c_now, c_was = buf.dispatch(x2in, None, w * 2, handle=hn), buf.dispatch(x2in, None, w * 2, handle=hw)
                got, want = (c_now.x, c_was.x) if fp8 else ((c_now.x, None), (c_was.x, None))
                assert torch.equal(got[0][:n].view(torch.uint8), want[0][:n].view(torch.uint8)), (rank, fp8)
                assert torch.equal(c_now.topk_weights, c_was.topk_weights), rank
                if not fp8:
                    rows = (now.x.float() * (rank + 1)).to(torch.bfloat16)
                    assert torch.equal(buf.combine(rows, hn), buf.combine(rows, hw)), rank
            assert be.inner.contracted == 5, be.inner.contracted
            dist.barrier()
            buf.close()
    finally:
        HB.direct_fresh_dispatch = True
        hb.contract_order = orig


class _PhasedRail:
    """TorchRail with the NVSHMEM rail's on_phase hook (called between its send and receive halves):
    the hierarchical backend then launches the routing mask inside that hook."""

    def __init__(self, rail):
        self.rail, self.on_phase, self.phases = rail, None, 0

    def __getattr__(self, name):
        return getattr(self.rail, name)

    def _phase(self):
        if self.on_phase is not None:
            self.phases += 1
            self.on_phase("rail_send")

    def dispatch(self, *args):
        self._phase()
        return self.rail.dispatch(*args)

    def combine(self, *args, **kw):
        self._phase()
        return self.rail.combine(*args, **kw)


def body_phased_rail(rank, world, P):
    from tests.test_hierarchical import check_against_reference, check_node_limited, hierarchical_buffer

    buf = hierarchical_buffer(128, P, max_tokens=24)
    be = buf._backend
    rail = be._rails[be.fp8] = _PhasedRail(be._rails[be.fp8])
    for seed, (mode, tokens) in enumerate((("random", 24), ("skew", [0] + [7] * (world - 1)), ("nowhere", 20))):
        check_against_reference(buf, rank, world, 128, tokens, 60 + seed, mode, "cpu")
    check_node_limited(buf, rank, world, P, "cpu")
    assert rail.phases > 0 and rail.on_phase is None  # the hook ran and was put back
    tl = StageTimeline()
    be.timeline = tl
    from tests.reference import make_inputs
    from tests.test_hierarchical import E, K
    xs, idxs, ws = make_inputs(world, 9, 128, E, K, 5, torch.bfloat16)
    a = buf.dispatch(xs[rank], idxs[rank], ws[rank])
    buf.combine(a.x, a.handle)
    s = tl.summary()
    assert list(s["dispatch"])[:3] == ["rail_send", "rail_recv", "layout"], list(s["dispatch"])
    buf.close()


@pytest.mark.parametrize("world,P", [(4, 2), (2, 1)])
def test_routing_mask_launched_under_the_rail_send(internode_runs, world, P):
    internode_runs(world, "phased", P).check()


@pytest.mark.parametrize("world,P", [(4, 2), (2, 1)])
def test_combine_reads_rows_in_place(internode_runs, world, P):
    internode_runs(world, "routed", P).check()


def test_cached_dispatch_writes_contract_order(internode_runs):
    internode_runs(4, "direct", 2).check()


def test_fresh_dispatch_writes_contract_order(internode_runs):
    internode_runs(4, "fresh", 2).check()


def _slot_ids(S, K, El, p_valid, g, device="cpu"):
    """[S, K] node-local ids as the rail leaves them: -1 in slots without a token, else some ids of [0, El)."""
    tf = torch.randint(0, El, (S, K), generator=g)
    tf[torch.rand(S, K, generator=g) > 0.4] = -1
    tf[torch.rand(S, generator=g) > p_valid] = -1
    return tf.to(device)


@pytest.mark.parametrize("E,W", [(256, 2), (256, 4), (16, 8), (12, 6), (8, 8)])
def test_in_rank_matches_the_torch_form(E, W):
    from ep_plugin.backends.hierarchical.backend import _in_rank, _in_rank_torch

    g = torch.Generator().manual_seed(E + W)
    for T in (0, 1, 50):
        idx = torch.randint(-3, E + 4, (T, 8), generator=g)  # ids out of [0, E) too: routed nowhere
        assert torch.equal(_in_rank(idx, E, W), _in_rank_torch(idx, E, W)), (E, W, T)


def _pack_reference(local, topk_f, N, M):
    valid = (topk_f >= 0).any(1)
    return (valid, valid.view(N, M).sum(1)) + tuple(local.order_torch(topk_f, valid))


def _check_pack(device):
    from ep_plugin.backends.hierarchical.local import LocalNode

    g = torch.Generator().manual_seed(5)
    for El, N, M, K in [(1, 2, 3, 1), (4, 2, 7, 8), (128, 2, 4096, 8), (32, 8, 64, 8), (7, 3, 1, 2)]:
        local = LocalNode(El)
        for p in (0.0, 0.3, 1.0):
            tf = _slot_ids(N * M, K, El, p, g, device)
            got, want = local.pack(tf, N, M), _pack_reference(local, tf, N, M)
            for name, a, b in zip(("valid", "node_counts", "order", "place", "num", "tpe"), got, want):
                assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), (El, N, M, K, p, name)


def test_local_pack_matches_the_torch_form():
    """LocalNode.pack (the one-rank node's packing; order() in fewer launches) against the form before."""
    _check_pack("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the local_pack kernel needs a GPU")
def test_local_pack_kernel_matches_the_torch_form(monkeypatch):
    from ep_plugin._ext import c_op
    from ep_plugin.backends.hierarchical import local

    # on a CUDA machine a _C without the kernel is a broken or stale build, not a reason to skip
    assert c_op("local_pack") is not None, "ep_plugin._C lacks local_pack: rebuild it (bash benchmarks/device_build.sh)"
    monkeypatch.setattr(local, "USE_LOCAL_PACK_KERNEL", True)  # the kernel path even if the default is switched off
    _check_pack("cuda")
