"""ep_plugin.routing: exact agreement with megatron-core 0.19.2, plus properties that need no
Megatron (group limits, normalisation, expert bias, to_dense, argument checks)."""

import itertools
import zlib

import pytest
import torch

from ep_plugin.config import load_config
from ep_plugin.routing import group_limited_topk, route, to_dense, topk_routing, update_expert_bias


@pytest.fixture(scope="module")
def mcore():
    pytest.importorskip("megatron.core")
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    return moe_utils


# (num_experts, topk, num_groups, group_topk)
SHAPES = [
    (8, 1, None, None),
    (8, 2, None, None),
    (16, 4, None, None),
    (64, 8, None, None),
    (8, 2, 4, 2),
    (16, 4, 4, 2),
    (64, 8, 8, 4),
    (32, 4, 4, 1),
    (256, 8, 8, 4),
]

CASES = [
    # score_function, use_pre_softmax, with_bias, scaling
    ("softmax", False, False, None),
    ("softmax", True, False, None),
    ("softmax", False, False, 2.5),
    ("softmax", True, False, 1.5),
    ("sigmoid", False, False, None),
    ("sigmoid", False, True, None),
    ("sigmoid", False, True, 2.5),
    ("sigmoid", False, False, 2.5),
    ("sqrtsoftplus", False, True, 2.5),
]


def _random_logits(gen, num_tokens, num_experts, dtype, kind):
    if kind == "normal":
        x = torch.randn(num_tokens, num_experts, generator=gen)
    elif kind == "wide":
        x = torch.randn(num_tokens, num_experts, generator=gen) * 8
    else:  # "ties": few distinct values, many exact ties
        x = torch.randint(-3, 4, (num_tokens, num_experts), generator=gen).float() / 2
    return x.to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}k{}g{}gk{}".format(*s))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_megatron(mcore, shape, case):
    num_experts, topk, num_groups, group_topk = shape
    score_function, pre, with_bias, scaling = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, case)).encode()))
    for trial, (dtype, kind, grad) in enumerate(itertools.product(
            (torch.float32, torch.bfloat16), ("normal", "wide", "ties"), (True, False))):
        num_tokens = (0, 1, 7, 64)[trial % 4]
        logits = _random_logits(gen, num_tokens, num_experts, dtype, kind)
        bias = (torch.randn(num_experts, generator=gen) * 0.1) if with_bias else None
        kw = dict(num_groups=num_groups, group_topk=group_topk, scaling_factor=scaling,
                  score_function=score_function, expert_bias=bias, use_pre_softmax=pre)
        with torch.set_grad_enabled(grad):
            w, idx = topk_routing(logits, topk, **kw)
            if num_tokens == 0 and num_groups:
                # Megatron's view(T, G, -1) cannot reshape 0 tokens; we return empty results.
                assert w.shape == idx.shape == (0, topk)
                continue
            ref_w, ref_idx = mcore.topk_routing_with_score_function(
                logits, topk, dense_output=True, **kw)
            ref_probs, ref_map = mcore.topk_routing_with_score_function(logits, topk, **kw)
        assert w.dtype == torch.float32 and idx.dtype == torch.int64
        assert w.shape == idx.shape == (num_tokens, topk)
        assert torch.equal(idx, ref_idx), (dtype, kind, grad)
        assert torch.equal(w.to(dtype), ref_w), (dtype, kind, grad)
        probs, rmap = to_dense(w.to(dtype), idx, num_experts)
        assert torch.equal(rmap, ref_map) and torch.equal(probs, ref_probs)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2]], ids=lambda s: "E{}k{}g{}gk{}".format(*s))
def test_group_limited_topk_matches_megatron(mcore, shape):
    num_experts, topk, num_groups, group_topk = shape
    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16):
        scores = torch.randn(33, num_experts, generator=gen).to(dtype)
        v, i = group_limited_topk(scores, topk, num_groups, group_topk)
        rv, ri = mcore.group_limited_topk(scores, topk, 33, num_experts, num_groups, group_topk)
        assert torch.equal(i, ri) and torch.equal(v, rv)


@pytest.mark.parametrize("case", CASES[:2] + CASES[4:7], ids=lambda c: "-".join(map(str, c)))
def test_gradients_match_megatron(mcore, case):
    score_function, pre, with_bias, scaling = case
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 64, generator=gen)
    bias = torch.randn(64, generator=gen) * 0.1 if with_bias else None
    upstream = torch.randn(40, 8, generator=gen)
    kw = dict(num_groups=8, group_topk=4, scaling_factor=scaling, score_function=score_function,
              expert_bias=bias, use_pre_softmax=pre)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    w, _ = topk_routing(a, 8, **kw)
    rw, _ = mcore.topk_routing_with_score_function(b, 8, dense_output=True, **kw)
    (w * upstream).sum().backward()
    (rw * upstream).sum().backward()
    assert torch.equal(a.grad, b.grad)


def test_route_matches_megatron_deepseek_v3(mcore):
    cfg = load_config("deepseek_v3")
    m = cfg.moe
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(128, m.num_experts, generator=gen).bfloat16()
    bias = torch.randn(m.num_experts, generator=gen) * 0.05
    w, idx = route(logits, cfg, expert_bias=bias)
    rw, ridx = mcore.topk_routing_with_score_function(
        logits, m.topk, num_groups=m.num_groups, group_topk=m.group_topk,
        scaling_factor=m.topk_scaling_factor, score_function=m.score_function,
        expert_bias=bias, dense_output=True)
    assert torch.equal(idx, ridx) and torch.equal(w.bfloat16(), rw)


def test_update_expert_bias_matches_megatron(mcore, monkeypatch):
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
    counts = torch.tensor([5.0, 0.0, 12.0, 3.0, 4.0, 4.0, 1.0, 3.0])
    bias = torch.randn(8)
    ref = mcore.get_updated_expert_bias(counts.clone(), bias, 1e-3, tp_dp_cp_group=object())
    assert torch.equal(update_expert_bias(bias, counts, 1e-3), ref)


# --------------------------------------------------------------------- without Megatron


def _group_reference(scores, topk, num_groups, group_topk):
    """Brute-force group-limited top-k for one row: set of selected experts."""
    e = scores.numel()
    per = e // num_groups
    gscore = []
    for g in range(num_groups):
        vals = sorted(scores[g * per:(g + 1) * per].tolist(), reverse=True)
        gscore.append(sum(vals[:topk // group_topk]))
    groups = sorted(range(num_groups), key=lambda g: -gscore[g])[:group_topk]
    cand = [i for g in groups for i in range(g * per, (g + 1) * per)]
    return set(sorted(cand, key=lambda i: -scores[i].item())[:topk])


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2]], ids=lambda s: "E{}k{}g{}gk{}".format(*s))
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_group_limit_holds(shape, score_function):
    num_experts, topk, num_groups, group_topk = shape
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(50, num_experts, generator=gen, dtype=torch.float64)
    w, idx = topk_routing(logits, topk, num_groups=num_groups, group_topk=group_topk,
                          score_function=score_function)
    per = num_experts // num_groups
    scores = torch.sigmoid(logits) if score_function == "sigmoid" else logits
    for t in range(logits.shape[0]):
        assert len(set(idx[t].tolist())) == topk  # distinct experts
        assert len(set((idx[t] // per).tolist())) <= group_topk
        assert set(idx[t].tolist()) == _group_reference(scores[t], topk, num_groups, group_topk)
    assert torch.all(w[:, :-1] >= w[:, 1:])  # highest first


def test_softmax_after_topk_sums_to_one_and_scaling():
    logits = torch.randn(100, 16)
    w, idx = topk_routing(logits, 4)
    torch.testing.assert_close(w.sum(-1), torch.ones(100))
    assert torch.equal(idx, logits.topk(4, dim=-1).indices)
    w2, idx2 = topk_routing(logits, 4, scaling_factor=2.5)
    assert torch.equal(idx2, idx)
    torch.testing.assert_close(w2, w * 2.5)


def test_pre_softmax_keeps_unnormalised_probs():
    logits = torch.randn(100, 16)
    w, idx = topk_routing(logits, 4, use_pre_softmax=True)
    full = torch.softmax(logits, -1)
    torch.testing.assert_close(w, full.gather(1, idx))
    assert torch.all(w.sum(-1) < 1)


def test_sigmoid_normalisation():
    logits = torch.randn(100, 16)
    w, idx = topk_routing(logits, 4, score_function="sigmoid", scaling_factor=2.5)
    torch.testing.assert_close(w.sum(-1), torch.full((100,), 2.5))
    w1, idx1 = topk_routing(logits, 1, score_function="sigmoid")  # k = 1: raw sigmoid score
    torch.testing.assert_close(w1, torch.sigmoid(logits).gather(1, idx1))


def test_expert_bias_selects_but_does_not_weight():
    logits = torch.randn(64, 8)
    bias = torch.zeros(8)
    bias[3] = 100.0  # every token must pick expert 3
    w, idx = topk_routing(logits, 2, score_function="sigmoid", expert_bias=bias)
    assert torch.all((idx == 3).any(-1))
    s = torch.sigmoid(logits).gather(1, idx)
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True))


def test_bf16_logits_return_float32():
    logits = torch.randn(10, 8).bfloat16()
    for sf in ("softmax", "sigmoid"):
        w, idx = topk_routing(logits, 2, score_function=sf)
        assert w.dtype == torch.float32 and idx.dtype == torch.int64


def test_to_dense_and_minus_one():
    w = torch.tensor([[0.7, 0.3], [0.5, 0.0], [0.2, 0.8]])
    idx = torch.tensor([[2, 0], [1, -1], [-1, -1]])
    probs, rmap = to_dense(w, idx, 4)
    assert torch.equal(probs, torch.tensor([[0.3, 0, 0.7, 0], [0, 0.5, 0, 0], [0, 0, 0, 0]]))
    assert torch.equal(rmap, probs > 0)
    with pytest.raises(ValueError, match="topk_idx"):
        to_dense(w, torch.tensor([[4, 0], [1, 0], [0, 1]]), 4)


def test_route_uses_config():
    cfg = load_config("tiny")
    logits = torch.randn(20, 8)
    w, idx = route(logits, cfg.moe)
    rw, ridx = topk_routing(logits, 2, num_groups=4, group_topk=2)
    assert torch.equal(w, rw) and torch.equal(idx, ridx)
    assert torch.equal(route(logits, cfg)[1], idx)  # EPConfig accepted too
    with pytest.raises(ValueError, match="num_experts"):
        route(torch.randn(3, 16), cfg)
    with pytest.raises(ValueError, match="expert_bias"):
        route(logits, cfg, expert_bias=torch.zeros(8))
    ds = load_config("deepseek_v3")
    w, idx = route(torch.randn(5, 256), ds)  # bias optional (= zero bias)
    torch.testing.assert_close(w.sum(-1), torch.full((5,), 2.5))


def test_update_expert_bias_direction():
    counts = torch.tensor([10, 0, 5, 5])
    new = update_expert_bias(torch.zeros(4), counts, 0.01)
    assert torch.equal(new, torch.tensor([-0.01, 0.01, 0.0, 0.0]))


@pytest.mark.parametrize("kwargs,exc,word", [
    (dict(logits=torch.randn(4), topk=1), ValueError, "logits"),
    (dict(logits=torch.ones(4, 8, dtype=torch.long), topk=1), TypeError, "logits"),
    (dict(logits=[[1.0]], topk=1), TypeError, "logits"),
    (dict(logits=torch.randn(4, 8), topk=9), ValueError, "topk"),
    (dict(logits=torch.randn(4, 8), topk=0), ValueError, "topk"),
    (dict(logits=torch.randn(4, 8), topk=2.0), TypeError, "topk"),
    (dict(logits=torch.randn(4, 8), topk=2, score_function="relu"), ValueError, "score_function"),
    (dict(logits=torch.randn(4, 8), topk=2, num_groups=4), ValueError, "group_topk"),
    (dict(logits=torch.randn(4, 8), topk=2, num_groups=3, group_topk=1), ValueError,
     "num_groups"),
    (dict(logits=torch.randn(4, 8), topk=2, num_groups=4, group_topk=5), ValueError,
     "group_topk"),
    (dict(logits=torch.randn(4, 8), topk=6, num_groups=4, group_topk=2), ValueError, "topk"),
    (dict(logits=torch.randn(4, 8), topk=2, expert_bias=torch.zeros(8)), ValueError,
     "expert_bias"),
    (dict(logits=torch.randn(4, 8), topk=2, score_function="sigmoid",
          expert_bias=torch.zeros(7)), ValueError, "expert_bias"),
    (dict(logits=torch.randn(4, 8), topk=2, scaling_factor="2"), TypeError, "scaling_factor"),
])
def test_bad_arguments(kwargs, exc, word):
    kwargs = dict(kwargs)
    logits, topk = kwargs.pop("logits"), kwargs.pop("topk")
    with pytest.raises(exc, match=word):
        topk_routing(logits, topk, **kwargs)


def test_every_configured_score_function_is_implemented():
    from ep_plugin import config, routing

    assert routing.SCORE_FUNCTIONS is config.SCORE_FUNCTIONS  # one definition, imported
    logits = torch.randn(4, 8)
    for sf in config.SCORE_FUNCTIONS:
        w, idx = topk_routing(logits, 2, score_function=sf)
        assert w.shape == idx.shape == (4, 2) and torch.isfinite(w).all(), sf
        m = load_config({"moe": {"score_function": sf}}).moe
        assert torch.equal(route(logits, m)[1], idx), sf
