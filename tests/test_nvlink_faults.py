"""A peer that dies: the survivor's nvlink kernels time out, and the survivor gets EPTimeoutError naming
it within comm.timeout_s — never a result computed without the peer's rows.

The dying rank ends its process (os._exit) after a dispatch and before the combine, so this is a
real death, not a skipped call. The survivor's combine does not wait on the host; the timeout is
raised by EPBuffer.check() (the synchronising call), by EPEvent.synchronize() for an async combine,
or by the next call on the buffer.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.errors import EPTimeoutError
from tests._dist import spawn

pytestmark = pytest.mark.gpu
TIMEOUT_S = 2.0  # the survivor waits this long in each case: short, the deadline is what is checked


def survivor_body(rank, world, how):
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # NCCL's watchdog must not end the survivor first
    cfg = {"moe": {"num_experts": 8 * world, "topk": 4},
           "comm": {"backend": "nvlink", "max_tokens_per_rank": 256, "timeout_s": TIMEOUT_S}}
    buf = ep_plugin.EPBuffer(None, cfg, hidden=2048)
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(128, 2048, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 8 * world, (128, 4), device="cuda", generator=g)
    res = buf.dispatch(x, idx)
    torch.cuda.synchronize()
    dist.barrier()
    dead = world - 1
    if rank == dead:
        os._exit(0)  # dies between dispatch and combine
    time.sleep(0.5)  # let it die first
    t0 = time.monotonic()
    with pytest.raises(EPTimeoutError) as info:
        if how == "sync":
            buf.combine(res.x, res.handle)
            buf.check()
        elif how == "async":
            _, ev = buf.combine(res.x, res.handle, async_op=True)
            ev.synchronize()
        else:  # the next call on the buffer
            buf.combine(res.x, res.handle)
            torch.cuda.synchronize()
            buf.dispatch(x, idx)
    elapsed = time.monotonic() - t0
    assert info.value.missing_ranks == (dead,), str(info.value)
    assert elapsed < TIMEOUT_S + 5, f"raised after {elapsed:.1f}s with comm.timeout_s={TIMEOUT_S}"


HOWS = ["sync", "async", "next_call"]


@pytest.fixture(scope="module")
def outcomes():
    """The three cases at the same time, each in its own pair of processes on the two GPUs (a death
    ends a group, so they cannot share one): their start-ups and timeouts overlap. Each case's
    exception (None: it passed), for its own test."""
    from concurrent.futures import ThreadPoolExecutor

    world = 2
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    import ep_plugin._ext as ext
    if not ext.has_c():
        pytest.skip("ep_plugin._C is not built")

    def run(how):
        try:
            spawn(survivor_body, world, how, backend="nccl", timeout=120, abandon=True)
        except AssertionError as exc:
            return exc
        return None

    with ThreadPoolExecutor(len(HOWS)) as pool:
        return dict(zip(HOWS, pool.map(run, HOWS)))


@pytest.mark.parametrize("how", HOWS)
def test_peer_dies_before_combine(outcomes, how):
    if outcomes[how] is not None:
        raise outcomes[how]
