"""The holes of issue 31, one test each: every call form refuses bad input before anything moves,
with a ValueError/TypeError naming the argument, and the group stays usable (torch backend, gloo)."""
import pytest
import torch
import torch.distributed as dist

import ep_plugin
import ep_plugin.deep_ep as deep_ep
from tests._dist import spawn_parts

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


def test_cached_dispatch_checks_its_routing(check_parts):
    check_parts["cached_body"].check()


def device_body(rank, world):
    buf = _buffer()
    x, idx, w = (t.to("meta") for t in _inputs(rank))
    _raises(lambda: buf.dispatch(x, idx, w), ValueError, "x is on meta", "gloo")
    _still_usable(buf, rank)


def test_dispatch_refuses_a_device_the_buffer_does_not_move(check_parts):
    check_parts["device_body"].check()


def topk_zero_body(rank, world):
    buf = _buffer()
    x, _, _ = _inputs(rank)
    _raises(lambda: buf.dispatch(x, torch.empty(T, 0, dtype=torch.int64)), ValueError, "topk_idx", "K >= 1")
    _raises(lambda: buf.dispatch(x, torch.empty(T, 0, dtype=torch.int64), torch.empty(T, 0)), ValueError, "topk_idx")
    _still_usable(buf, rank)


def test_topk_of_zero_columns_is_refused(check_parts):
    check_parts["topk_zero_body"].check()


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


def test_handles_name_their_buffer(check_parts):
    check_parts["other_buffer_body"].check()


def repeats_body(rank, world):
    buf = _buffer()
    x = torch.randn(3, H)
    # token 0 names expert 1 twice, token 1 one expert on rank 1, token 2 one expert on each rank
    idx = torch.tensor([[1, 1], [2, -1], [0, 3]])
    w = torch.tensor([[0.25, 0.5], [1.0, 0.0], [0.125, 2.0]], requires_grad=True)
    res = buf.dispatch(x, idx, w, layout="expert")
    if rank == 0:  # local experts 0, 1: token 2 to expert 0 and token 0 to expert 1, from both ranks
        assert res.tokens_per_expert == [2, 2], res.tokens_per_expert
        assert res.x.shape[0] == 4
        got = sorted(res.topk_weights.tolist())
        assert got == pytest.approx(sorted([0.125, 0.125, 0.75, 0.75])), got
    y = buf.combine(res.x, res.handle)
    once = torch.tensor([[1.0], [1.0], [2.0]])  # one row per (token, expert): as the low-latency calls
    torch.testing.assert_close(y, x * once)
    res.topk_weights.sum().backward()  # both picks of the repeated expert get the row's gradient
    assert w.grad.tolist() == [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]], w.grad.tolist()
    _still_usable(buf, rank)


def test_a_repeated_expert_gets_one_expert_major_row(check_parts):
    check_parts["repeats_body"].check()


def deep_ep_body(rank, world):
    group = dist.group.WORLD
    buf = deep_ep.Buffer(group, int(1e8), 0, ep_config={"comm": {"backend": "torch", "max_tokens_per_rank": 16}})
    x, idx, w = _inputs(rank)
    x = x.to(torch.bfloat16)
    _raises(lambda: buf.get_dispatch_layout(idx, 3), ValueError, "num_experts", "3")
    _raises(lambda: buf.get_dispatch_layout(torch.full((T, K), E), E), ValueError, "topk_idx", f"[-1, {E})")
    _raises(lambda: buf.get_dispatch_layout(torch.full((T, K), -2), E), ValueError, "topk_idx")
    _raises(lambda: buf.get_dispatch_layout(idx.int(), E), TypeError, "topk_idx")
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    ok = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
              topk_idx=idx, topk_weights=w)
    wrong = {
        "num_tokens_per_expert": [torch.cat([per_expert, per_expert]), per_expert[:-1], per_expert + 1,
                                  per_expert.float()],
        "num_tokens_per_rank": [per_rank + 1, per_rank[:1]],
        "is_token_in_rank": [~in_rank, in_rank[:-1]],
        "topk_idx": [idx.int(), idx[:-1]],
    }
    for name, values in wrong.items():
        for v in values:
            _raises(lambda: buf.dispatch(x, **dict(ok, **{name: v})), (ValueError, TypeError), name)
    recv_x, _, _, counts, handle, _ = buf.dispatch(x, **ok)
    y, _, _ = buf.combine(recv_x, handle)
    reached = in_rank.sum(1, keepdim=True).to(torch.float32)
    torch.testing.assert_close(y.float(), x.float() * reached, rtol=2e-2, atol=2e-2)
    assert len(buf._buffers) == 1  # no second EPBuffer with another expert count
    buf.destroy()


def test_deep_ep_checks_its_layout_tensors(check_parts):
    check_parts["deep_ep_body"].check()


BODIES = ("cached_body", "device_body", "topk_zero_body", "other_buffer_body", "repeats_body", "deep_ep_body")


@pytest.fixture(scope="module")
def check_parts(tmp_path_factory):
    """Every body in one spawn (each leaves the group usable: that is what they check)."""
    parts = [(name, globals()[name], ()) for name in BODIES]
    return spawn_parts(parts, 2, str(tmp_path_factory.mktemp("checks")), timeout=300)
