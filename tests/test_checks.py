"""The holes of issue 31, one test each: every call form refuses bad input before anything moves,
with a ValueError/TypeError naming the argument, and the group stays usable (torch backend, gloo)."""
import pytest
import torch
import torch.distributed as dist

import ep_plugin
import ep_plugin.deep_ep as deep_ep
from tests._dist import spawn

H, E, K, T = 64, 4, 2, 5


def _buffer(hidden=H, experts=E):
    return ep_plugin.EPBuffer(None, {"moe": {"num_experts": experts, "topk": K},
                                     "comm": {"backend": "torch", "max_tokens_per_rank": 16}}, hidden=hidden)


def _inputs(rank, hidden=H):
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(T, hidden, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, idx, torch.rand(T, K, generator=g)


def _raises(call, exc, *words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value), str(info.value)


def _still_usable(buf, rank):
    x, idx, w = _inputs(rank)
    res = buf.dispatch(x, idx, w)
    y = buf.combine(res.x, res.handle)
    reached = torch.stack([((idx >= 0) & (idx // (E // buf.world) == r)).any(1) for r in range(buf.world)], 1)
    torch.testing.assert_close(y, x * reached.sum(1, keepdim=True))



def cached_body(rank, world):
    buf = _buffer()
    x, idx, w = _inputs(rank)
    res = buf.dispatch(x, idx, w)
    h = res.handle
    _raises(lambda: buf.dispatch(x, handle=h, topk_weights=w[:, :1].contiguous()), ValueError, "topk_weights")
    _raises(lambda: buf.dispatch(x, handle=h, topk_weights=w.double()), TypeError, "topk_weights")
    _raises(lambda: buf.dispatch(x, handle=h, topk_weights=w[:-1]), ValueError, "topk_weights")
    _raises(lambda: buf.dispatch(x, handle=h, topk_weights=w.t().contiguous().t()), ValueError, "topk_weights")
    _raises(lambda: buf.dispatch(x, idx.clone(), handle=h), ValueError, "topk_idx")
    _raises(lambda: buf.dispatch(x, idx.int(), handle=h), ValueError, "topk_idx")
    again = buf.dispatch(x, idx, handle=h, topk_weights=w)  # the dispatch's own ids: accepted
    torch.testing.assert_close(again.x, res.x)
    torch.testing.assert_close(again.topk_weights, res.topk_weights)
    _still_usable(buf, rank)


def test_cached_dispatch_checks_its_routing():
    spawn(cached_body, 2)


def device_body(rank, world):
    buf = _buffer()
    x, idx, w = (t.to("meta") for t in _inputs(rank))
    _raises(lambda: buf.dispatch(x, idx, w), ValueError, "x is on meta", "gloo")
    _still_usable(buf, rank)


def test_dispatch_refuses_a_device_the_buffer_does_not_move():
    spawn(device_body, 2)


def topk_zero_body(rank, world):
    buf = _buffer()
    x, _, _ = _inputs(rank)
    _raises(lambda: buf.dispatch(x, torch.empty(T, 0, dtype=torch.int64)), ValueError, "topk_idx", "K >= 1")
    _raises(lambda: buf.dispatch(x, torch.empty(T, 0, dtype=torch.int64), torch.empty(T, 0)), ValueError, "topk_idx")
    _still_usable(buf, rank)


def test_topk_of_zero_columns_is_refused():
    spawn(topk_zero_body, 2)


def other_buffer_body(rank, world):
    a, b = _buffer(), _buffer(hidden=2 * H)
    x, idx, w = _inputs(rank)
    res = a.dispatch(x, idx, w)
    rows = torch.randn(res.x.shape[0], 2 * H)
    _raises(lambda: b.combine(rows, res.handle), ValueError, "handle", "another EPBuffer")
    _raises(lambda: b.dispatch(torch.randn(T, 2 * H), handle=res.handle), ValueError, "handle", "another EPBuffer")
    _still_usable(a, rank)
    xb, _, _ = _inputs(rank, 2 * H)
    rb = b.dispatch(xb, idx)
    assert b.combine(rb.x, rb.handle).shape == (T, 2 * H)


def test_handles_name_their_buffer():
    spawn(other_buffer_body, 2)
