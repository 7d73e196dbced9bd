"""csrc/layout/contract_order.cu (the internode backend's contract order in one launch) against the torch
version it replaces and a brute-force count: valid inner orders, garbage rows past the valid ones, a
recv_src full of garbage (what an inner timeout leaves), zero rows, and W up to 64."""
import pytest
import torch

from ep_plugin.backends.hierarchical import backend as hb

pytestmark = pytest.mark.gpu


def _kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import ep_plugin._ext as ext
    assert ext.has_c(), f"ep_plugin._C is not built on a CUDA machine: {ext._IMPORT_ERROR}"
    assert ext.c_op("contract_order") is not None, "ep_plugin._C has no contract_order: rebuild it"


def _inner_order(N, P, M, g, density):
    srcs, off = [], [0]
    for _l in range(P):
        keep = torch.rand(N * M, generator=g) < density
        srcs.append(keep.nonzero().flatten())
        off.append(off[-1] + srcs[-1].numel())
    return srcs, off


@pytest.mark.parametrize("N,P,M", [(2, 2, 7), (3, 2, 5), (2, 4, 3), (4, 1, 6), (2, 2, 4096), (8, 8, 64), (5, 3, 1)])
def test_kernel_matches_torch_and_brute_force(N, P, M):
    _kernel()
    g = torch.Generator().manual_seed(N * 1000 + P * 10 + M)
    for trial in range(12):
        srcs, off = _inner_order(N, P, M, g, (0.0, 0.4, 1.0)[trial % 3])
        garbage = torch.randint(-5 * M, 10 * N * M, (trial,), generator=g)  # rows past the valid ones
        recv_src = torch.cat(srcs + [garbage]).to(torch.int32)
        rows = recv_src.numel()
        want = torch.zeros(N * P, dtype=torch.int64)
        for l, s in enumerate(srcs):
            for slot in s.tolist():
                want[(slot // M) * P + l] += 1
        off_d, src_d = torch.tensor(off, dtype=torch.int32, device="cuda"), recv_src.cuda()
        got, pos = hb.contract_order(off_d, src_d, N, P, M, rows)
        ref_c, ref_pos = hb.contract_order_torch(off_d, src_d, N, P, M, rows)
        assert got.tolist() == want.tolist() == ref_c.tolist()
        assert torch.equal(pos, ref_pos)
        assert sorted(pos.tolist()) == list(range(rows))


def test_garbage_sources_stay_in_range():
    """After an inner timeout recv_off and recv_src hold anything: positions stay in [0, rows), as the
    torch version's, so the reorder cannot index out of its rows."""
    _kernel()
    g = torch.Generator().manual_seed(7)
    N, P, M, rows = 2, 2, 16, 50
    for off in ([0, 30, 50], [0, 40, 90], [5, 3, 80]):
        src = torch.randint(-2**31, 2**31 - 1, (rows,), generator=g, dtype=torch.int64).to(torch.int32).cuda()
        off_d = torch.tensor(off, dtype=torch.int32, device="cuda")
        got, pos = hb.contract_order(off_d, src, N, P, M, rows)
        ref_c, ref_pos = hb.contract_order_torch(off_d, src, N, P, M, rows)
        assert torch.equal(got, ref_c) and torch.equal(pos, ref_pos)
        assert int(pos.min()) >= 0 and int(pos.max()) < rows
    got, pos = hb.contract_order(torch.zeros(3, dtype=torch.int32, device="cuda"),
                                 torch.zeros(0, dtype=torch.int32, device="cuda"), N, P, M, 0)
    assert got.tolist() == [0] * (N * P) and pos.numel() == 0
