"""backend.combine_stage_copy_engine (an A/B knob, off by default): the pull combine with its stage by the copy
engines (csrc/nvlink/combine_stage_copies.cu: a snap kernel, the pull kernel without its stager, the copies and
their releases on a side stream) sums bit for bit as the kernel's stager does and as the torch reference within
BF16 rounding -- worst-case and host-synced handles, a rank that receives nothing, skewed routing, one to seven
rounds of pieces, every rank or every other rank using it (the flags are the stager's), calls back to back. Its own
processes, so that a hang here stops no other test."""
import pytest
import torch

from tests._dist import spawn
from tests.test_nvlink import _buf, _inputs, _need

pytestmark = pytest.mark.gpu
E, K, HIDDEN = 32, 4, 1024


def copies_body(rank, world):
    ref = _buf("torch", E, K, HIDDEN)
    for host_sync in (False, True):
        nv = _buf("nvlink", E, K, HIDDEN, host_sync=host_sync, combine_kernel="pull")
        rt = nv._backend._rt
        assert rt.combine_copy_engine_fits and not nv._backend.combine_stage_copy_engine
        seed = 900 + 10 * host_sync
        for who in ((True,) * world, tuple(r % 2 == 0 for r in range(world))):  # everywhere; every other rank
            for rounds, (tokens, mode) in zip((4, 1, 7), ((300, "random"), ([0] + [40] * (world - 1), "starve_last"),
                                                          (512, "skew"))):
                seed += 1
                ctx = f"rank {rank} host_sync {host_sync} ranks {who} rounds {rounds} tokens {tokens} mode {mode}"
                _, _, _, x, idx, w = _inputs(world, rank, tokens, HIDDEN, E, K, seed, mode)
                a, b = nv.dispatch(x, idx, w), ref.dispatch(x, idx, w)
                torch.cuda.synchronize()  # notify done: the receive offsets are on the host
                rows = (a.x.float() * (rank + 1)).to(torch.bfloat16)
                nv._backend.combine_stage_copy_engine = False
                y_kernel = nv.combine(rows, a.handle)
                nv._backend.combine_stage_copy_engine, rt.combine_copy_rounds = who[rank], rounds
                before = rt.combine_copy_calls
                y_copies = nv.combine(rows, a.handle)
                y_again = nv.combine(rows, a.handle)  # back to back: the next snap waits for this one's readers
                assert rt.combine_copy_calls - before == (2 if who[rank] else 0), ctx + " (the path that ran)"
                y_ref = ref.combine((b.x.float() * (rank + 1)).to(torch.bfloat16), b.handle)
                assert torch.equal(y_copies, y_kernel) and torch.equal(y_again, y_kernel), ctx
                torch.testing.assert_close(y_copies.float(), y_ref.float(), atol=3e-2, rtol=2e-2, msg=ctx)
        nv.close()
    ref.close()


@pytest.mark.parametrize("world", [2, 4])
def test_combine_stage_by_copy_engines_matches(world):
    _need(world)
    spawn(copies_body, world, backend="nccl", timeout=240)
