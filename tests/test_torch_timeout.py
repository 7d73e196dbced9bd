"""The torch backend honours comm.timeout_s: when a peer stalls or dies, the others raise EPTimeoutError
naming it, within the timeout plus a small slack, and the buffer stays failed afterwards."""
import os
import time

import pytest
import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.errors import EPTimeoutError
from tests._dist import spawn
from tests.reference import make_inputs

TIMEOUT_S = 3.0
SLACK_S = 2.5  # start-up of the wait and a loaded 2-core CI machine
H, K = 16, 2


def _buffer(world, group=None):
    cfg = {"moe": {"num_experts": 2 * world, "topk": K}, "comm": {"backend": "torch", "timeout_s": TIMEOUT_S}}
    return ep_plugin.EPBuffer(group, cfg, hidden=H)


def _inputs(rank, world, device):
    xs, idxs, ws = make_inputs(world, 8, H, 2 * world, K, seed=5)
    return xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device)


def _expect_timeout(call, missing, fails_fast=False):
    start = time.monotonic()
    with pytest.raises(EPTimeoutError) as info:
        call()
    elapsed = time.monotonic() - start
    err = info.value
    assert err.missing_ranks == tuple(missing), str(err)
    named = f"rank(s) {list(missing)}" if missing else "every rank of the EP group reached"
    assert named in str(err), str(err)
    assert elapsed < TIMEOUT_S + SLACK_S, f"raised after {elapsed:.1f}s: {err}"
    if not fails_fast:  # the deadline fired, not some earlier error
        assert elapsed > TIMEOUT_S - 0.5, f"raised after {elapsed:.1f}s: {err}"
    return err


def stall_body(rank, world, stalled, device="cpu"):
    buf = _buffer(world)
    x, idx, w = _inputs(rank, world, device)
    res = buf.dispatch(x, idx, w)  # a healthy round first
    buf.combine(res.x, res.handle)
    if rank == stalled:
        time.sleep(TIMEOUT_S + SLACK_S)
        with pytest.raises(EPTimeoutError):  # late: the others have given up
            buf.dispatch(x, idx, w)  # on CPU it raises here; on CUDA the rows' exchange may be in flight:
            buf.check()              # check() (or the next call) raises then
        return
    err = _expect_timeout(lambda: buf.dispatch(x, idx, w), [stalled])
    start = time.monotonic()
    with pytest.raises(EPTimeoutError) as again:  # unusable from now on: the same error, at once
        buf.combine(res.x, res.handle)
    assert again.value is err and time.monotonic() - start < 0.5


def death_body(rank, world, dead):
    buf = _buffer(world)
    x, idx, w = _inputs(rank, world, "cpu")
    res = buf.dispatch(x, idx, w, async_op=True)
    res.event.current_stream_wait()
    dist.barrier()  # every rank has its rows: the death cannot cut the dispatch short
    if rank == dead:
        time.sleep(0.2)
        os._exit(0)
    _, event = buf.combine(res.x, res.handle, async_op=True)
    _expect_timeout(event.current_stream_wait, [dead], fails_fast=True)  # gloo may see the socket close


def subgroup_body(rank, world, stalled):
    """EP groups {0, 1} and {2, 3} of a world of 4; `stalled` (a global rank) is late to build its
    buffer. Its partner names it by group rank and global rank; the other group is unaffected."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    ep_rank = rank % 2
    x, idx, w = _inputs(ep_rank, 2, "cpu")
    if rank == stalled:
        time.sleep(TIMEOUT_S + SLACK_S)
        _expect_timeout(lambda: _buffer(2, group), [])  # late: its partner has given up
        return
    if rank // 2 == stalled // 2:
        err = _expect_timeout(lambda: _buffer(2, group), [stalled % 2])
        assert f"global ranks [{stalled}]" in str(err), str(err)
        return
    buf = _buffer(2, group)
    for _ in range(2):
        res = buf.dispatch(x, idx, w)
        buf.combine(res.x, res.handle)


def test_stalled_peer_is_named_within_the_timeout():
    spawn(stall_body, 3, 1, timeout=60, abandon=True)


def test_dead_peer_is_named():
    spawn(death_body, 3, 0, timeout=60, abandon=True)


def test_subgroup_peer_late_to_build_the_buffer_is_named():
    spawn(subgroup_body, 4, 3, timeout=60, abandon=True)


@pytest.fixture(scope="module")
def nccl_outcomes():
    """The three NCCL cases at the same time, each in its own pair of processes on the two GPUs (a stall
    or a death ends a group): their start-ups and waits overlap. Each case's exception (None: passed).
    TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (torch's default, set here so the CI environment cannot change
    it) lets the watchdog kill the process once the group's own timeout (comm.timeout_s + GRACE_S)
    passes; our error must come first, and the workers exit right after checking it."""
    from concurrent.futures import ThreadPoolExecutor

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    cases = {"stalled_lazy": (stall_body, (2, 1, "cuda"), {"bind_device": False}),
             "stalled_bound": (stall_body, (2, 1, "cuda"), {"bind_device": True}),
             "dead": (nccl_death_body, (2, 1), {})}

    def run(name):
        body, args, kw = cases[name]
        try:
            spawn(body, *args, backend="nccl", timeout=120, abandon=True, **kw)
        except AssertionError as exc:
            return exc
        return None

    before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"  # the spawned ranks inherit it
    try:
        with ThreadPoolExecutor(len(cases)) as pool:
            return dict(zip(cases, pool.map(run, cases)))
    finally:
        if before is None:
            del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
        else:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = before


@pytest.mark.gpu
@pytest.mark.parametrize("bind_device", [False, True], ids=["lazy", "bound"])
def test_stalled_peer_is_named_on_nccl(nccl_outcomes, bind_device):
    """NCCL's kernel cannot be cancelled: the host's wait gives up, and the backend aborts its own group."""
    outcome = nccl_outcomes["stalled_bound" if bind_device else "stalled_lazy"]
    if outcome is not None:
        raise outcome


def nccl_death_body(rank, world, dead):
    """A synchronous combine on CUDA does not wait on the host: the deadline is checked by check()
    (or the next call), which names the dead rank instead of hanging in a device synchronise."""
    buf = _buffer(world)
    x, idx, w = _inputs(rank, world, "cuda")
    res = buf.dispatch(x, idx, w)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == dead:
        os._exit(0)
    time.sleep(0.2)
    start = time.monotonic()
    buf.combine(res.x, res.handle)
    with pytest.raises(EPTimeoutError) as info:
        buf.check()
    assert info.value.missing_ranks == (dead,), str(info.value)
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S


@pytest.mark.gpu
def test_dead_peer_before_combine_is_named_on_nccl(nccl_outcomes):
    if nccl_outcomes["dead"] is not None:
        raise nccl_outcomes["dead"]
