"""backend.stage_beside_notify (on by default; False is the A/B knob): a split rank-major dispatch's copy-engine stage on a
side stream beside notify (Runtime.stage_begin before notify, stage_end after it) gives the torch reference's rows,
fresh and cached, with a rank that sends nothing, beside ranks that do not use it, and in a CUDA graph. Its own
processes, so that a hang here stops no other test."""
import pytest
import torch

from tests._dist import spawn
from tests.test_nvlink import _buf, _inputs, _need, _same_worst_case

pytestmark = pytest.mark.gpu
E, K, HIDDEN = 32, 4, 1024


def beside_body(rank, world):
    nv, ref = _buf("nvlink", E, K, HIDDEN, host_sync=False, dispatch_kernel="split"), _buf("torch", E, K, HIDDEN)
    be = nv._backend
    assert be.dispatch_mode == "split" and be._rt.stage_copy_engine
    seed = 700
    for beside in ((True,) * world, tuple(r % 2 == 0 for r in range(world))):  # everywhere; every other rank
        be.stage_beside_notify = beside[rank]
        for tokens, mode in ((300, "random"), ([0] + [40] * (world - 1), "starve_last"), (512, "skew")):
            seed += 1
            ctx = f"rank {rank} beside {beside} tokens {tokens} mode {mode}"
            _, _, _, x, idx, w = _inputs(world, rank, tokens, HIDDEN, E, K, seed, mode)
            a, b = nv.dispatch(x, idx, w), ref.dispatch(x, idx, w)
            R = _same_worst_case(a, b, ctx)
            c, d = nv.dispatch(x * 2, None, w, handle=a.handle), ref.dispatch(x * 2, None, w, handle=b.handle)
            assert torch.equal(c.x[:R], d.x), ctx + " cached"
            y, y_ref = nv.combine(a.x, a.handle), ref.combine(b.x, b.handle)
            torch.testing.assert_close(y.float(), y_ref.float(), atol=2e-2, rtol=1e-2, msg=ctx + " combine")
    # captured: the side stream forks off the capturing stream and joins it (one graph), replayed twice
    be.stage_beside_notify = True
    _, _, _, x, idx, w = _inputs(world, rank, 256, HIDDEN, E, K, seed + 1)
    b = ref.dispatch(x, idx, w)
    R = b.x.shape[0]
    nv.dispatch(x, idx, w)  # warm: the side stream and its events exist before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nv.dispatch(x, idx, w)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.x[:R], b.x), f"rank {rank} graph replay"
    nv.close()


@pytest.mark.parametrize("world", [2, 4])
def test_stage_beside_notify_matches_torch(world):
    _need(world)
    spawn(beside_body, world, backend="nccl", timeout=240)
