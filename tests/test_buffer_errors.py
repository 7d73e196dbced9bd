"""Bad input is refused before any communication, with an error naming the argument."""
import pytest
import torch

import ep_plugin
from ep_plugin.errors import BackendUnavailableError
from tests._dist import spawn

H, E, K, T = 256, 8, 2, 6


def bad_inputs_body(rank, world):
    buf = ep_plugin.EPBuffer(None, {"moe": {"num_experts": E, "topk": K},
                                    "comm": {"backend": "torch", "max_tokens_per_rank": 16}}, hidden=H)
    x = torch.randn(T, H)
    idx = torch.randint(0, E, (T, K))
    w = torch.rand(T, K)
    fp8 = x.to(torch.float8_e4m3fn)
    sc = torch.ones(T, H // 128)
    res = buf.dispatch(x, idx, w)

    cases = [  # (call, exception type, words the message must contain)
        (lambda: buf.dispatch(x.numpy(), idx), TypeError, "x"),
        (lambda: buf.dispatch(x.to(torch.int32), idx), TypeError, "x must be float32"),
        (lambda: buf.dispatch(x[:, :128], idx), ValueError, "x must have shape"),
        (lambda: buf.dispatch(x.t().contiguous().t(), idx), ValueError, "x must be contiguous"),
        (lambda: buf.dispatch(torch.randn(17, H), torch.zeros(17, K, dtype=torch.long)), ValueError,
         "max_tokens_per_rank"),
        (lambda: buf.dispatch(x, idx.int()), TypeError, "topk_idx must be int64"),
        (lambda: buf.dispatch(x, idx[:-1]), ValueError, "topk_idx must have shape"),
        (lambda: buf.dispatch(x, idx.t().contiguous().t()), ValueError, "topk_idx must be contiguous"),
        (lambda: buf.dispatch(x, torch.full((T, K), E)), ValueError, "topk_idx values must lie in [-1, 8)"),
        (lambda: buf.dispatch(x, torch.full((T, K), -2)), ValueError, "topk_idx values"),
        (lambda: buf.dispatch(x), ValueError, "topk_idx is required"),
        (lambda: buf.dispatch(x, idx, w.double()), TypeError, "topk_weights must be float32"),
        (lambda: buf.dispatch(x, idx, w[:, :1].contiguous()), ValueError, "topk_weights must have"),
        (lambda: buf.dispatch((fp8, sc.double()), idx), TypeError, "x[1] (FP8 scales)"),
        (lambda: buf.dispatch((x, sc), idx), TypeError, "x[0] (FP8 data)"),
        (lambda: buf.dispatch((fp8, sc[:, :1].contiguous()), idx), ValueError, "x[1] (FP8 scales) must have shape"),
        (lambda: buf.dispatch((fp8, sc, sc), idx), TypeError, "(x_fp8, scales) pair"),
        (lambda: buf.dispatch(x[:3], handle=res.handle), ValueError, "handle was made for"),
        (lambda: buf.dispatch(x, handle="h"), TypeError, "handle must be a Handle"),
        (lambda: buf.combine(res.x[:-1] if res.x.shape[0] else torch.randn(1, H), res.handle), ValueError,
         "rows that dispatch delivered"),
        (lambda: buf.combine(res.x.long(), res.handle), TypeError, "combine's x must be"),
        (lambda: buf.combine(res.x[:, :64].contiguous(), res.handle), ValueError, "x must have shape"),
        (lambda: buf.combine(res.x, None), TypeError, "handle must be a Handle"),
    ]
    for i, (call, exc, words) in enumerate(cases):
        with pytest.raises(exc) as info:
            call()
        assert words in str(info.value), (i, str(info.value))
    with pytest.raises(ValueError, match="hidden"):
        ep_plugin.EPBuffer(None, {"moe": {"num_experts": E, "topk": K}}, hidden=0)
    with pytest.raises(ValueError, match="FP8 dispatch needs hidden divisible by 128"):
        ep_plugin.EPBuffer(None, {"moe": {"num_experts": E, "topk": K}, "comm": {"backend": "torch"}},
                           hidden=96).dispatch((torch.zeros(2, 96, dtype=torch.float8_e4m3fn), torch.ones(2, 0)),
                                               torch.zeros(2, K, dtype=torch.long))
    # GPU backends on a gloo group: a clear error saying what is needed
    for name in ("nvlink", "nvshmem"):
        with pytest.raises(BackendUnavailableError, match="NCCL"):
            ep_plugin.EPBuffer(None, {"moe": {"num_experts": E, "topk": K}, "comm": {"backend": name}}, hidden=H)
    auto = ep_plugin.EPBuffer(None, {"moe": {"num_experts": E, "topk": K}, "comm": {"backend": "auto"}}, hidden=H)
    assert auto.backend_name == "torch"


def test_bad_inputs_are_refused_with_named_arguments():
    spawn(bad_inputs_body, 1)


def experts_vs_world_body(rank, world):
    with pytest.raises(ep_plugin.ConfigError, match="num_experts"):
        ep_plugin.EPBuffer(None, {"moe": {"num_experts": 6, "topk": 2}, "comm": {"backend": "torch"}}, hidden=8)


def test_experts_not_divisible_by_ep_size():
    spawn(experts_vs_world_body, 4)
