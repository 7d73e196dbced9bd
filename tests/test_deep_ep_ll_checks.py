"""ep_plugin.deep_ep's low-latency calls through ep_plugin.checks (deep_ep_ll.py): each form is checked once,
a repeated form costs no check and formats no message, and a bad input is refused -- before any launch --
however many good calls of a nearby form came before it (the cache must never let one through). On CPU,
over the NVSHMEM engine's Python and a fake runtime that records its launches (benchmarks/bench_ll_host.py)."""
import pytest
import torch
import torch.distributed as dist

import ep_plugin
import ep_plugin.buffer_ll as buffer_ll
import ep_plugin.checks.deep_ep_ll as dl_checks
import ep_plugin.checks.low_latency as ll_checks
from benchmarks import bench_ll_host as bench
from ep_plugin.deep_ep import Buffer

E, M, H, K = 4, 8, 512, 3  # one rank: E_l = E; H % 512 == 0 for UE8M0


def cfg():
    return {"moe": {"num_experts": E, "topk": K},
            "comm": {"backend": "torch", "low_latency": {"max_tokens_per_rank": M, "output_buffers": 2}}}


@pytest.fixture
def calls(solo):
    log = []
    with bench.fake_gpu("cpu", log):
        yield log


@pytest.fixture(params=["ep_config", "no_ep_config"])
def dbuf(calls, request):
    b = Buffer(dist.group.WORLD, low_latency_mode=True, ep_config=cfg() if request.param == "ep_config" else None)
    yield b
    b.destroy()


def inputs(T=6):
    x = torch.randn(T, H).to(torch.bfloat16)
    idx = torch.tensor([[0, 1, -1], [2, 3, 1], [-1, -1, -1], [3, 0, 2], [1, -1, 0], [2, 1, 3]])[:T].contiguous()
    return x, idx, torch.rand(T, K), torch.zeros(E, dtype=torch.int32)


def good_dispatch(b, x, idx, stats, **kw):
    args = dict(cumulative_local_expert_recv_stats=stats, use_fp8=True)
    args.update(kw)
    return b.low_latency_dispatch(x, idx, M, E, **args)


# each: (what changes from the good call, exception, message); the good call's form is cached first
BAD_DISPATCH = [
    ("x float32", lambda a: a.update(x=a["x"].float()), TypeError, "bfloat16"),
    ("x not contiguous", lambda a: a.update(x=torch.randn(H, 6).to(torch.bfloat16).t()), ValueError, "contiguous"),
    ("x more tokens than M", lambda a: a.update(x=torch.zeros(M + 1, H, dtype=torch.bfloat16),
                                                idx=torch.zeros(M + 1, K, dtype=torch.int64)), ValueError,
     "num_max_dispatch_tokens_per_rank"),
    ("x 1-d", lambda a: a.update(x=a["x"].view(-1)), ValueError, "num_tokens, hidden"),
    ("topk_idx int32", lambda a: a.update(idx=a["idx"].int()), TypeError, "int64"),
    ("topk_idx rows", lambda a: a.update(idx=a["idx"][:5].contiguous()), ValueError, "topk_idx must have shape"),
    ("topk_idx too wide", lambda a: a.update(idx=torch.zeros(6, 40, dtype=torch.int64)), ValueError, "topk"),
    ("stats float", lambda a: a.update(cumulative_local_expert_recv_stats=torch.zeros(E)), TypeError, "torch.int"),
    ("stats shape", lambda a: a.update(cumulative_local_expert_recv_stats=torch.zeros(E + 1, dtype=torch.int32)),
     ValueError, "cumulative_local_expert_recv_stats"),
    ("stats not a tensor", lambda a: a.update(cumulative_local_expert_recv_stats=[0] * E), TypeError, "torch.int"),
    ("M float", lambda a: a.update(M=float(M)), TypeError, "num_max_dispatch_tokens_per_rank must be an int"),
    ("M zero", lambda a: a.update(M=0), ValueError, "must be positive"),
    ("E a str", lambda a: a.update(E=str(E)), TypeError, "num_experts must be an int"),
    ("ue8m0 without round_scale", lambda a: a.update(use_ue8m0=True), ValueError, "round_scale"),
    ("async and hook", lambda a: a.update(async_finish=True, return_recv_hook=True), ValueError,
     "async_finish and return_recv_hook"),
    ("round_scale without fp8", lambda a: a.update(use_fp8=False, round_scale=True), ValueError, "round_scale"),
    ("wait stats", lambda a: a.update(dispatch_wait_recv_cost_stats=torch.zeros(1, dtype=torch.int64)),
     NotImplementedError, "dispatch_wait_recv_cost_stats"),
]


def _dispatch(b, a):
    a = dict(a)
    x, idx, M_, E_ = a.pop("x"), a.pop("idx"), a.pop("M"), a.pop("E")
    return b.low_latency_dispatch(x, idx, M_, E_, **a)


@pytest.mark.parametrize("name,change,exc,match", BAD_DISPATCH, ids=[c[0] for c in BAD_DISPATCH])
def test_bad_dispatch_refused_after_good_forms(dbuf, calls, name, change, exc, match):
    x, idx, w, stats = inputs()
    good = dict(x=x, idx=idx, M=M, E=E, cumulative_local_expert_recv_stats=stats, use_fp8=True)
    for hook in (False, True, False):  # both forms cached
        out = _dispatch(dbuf, dict(good, return_recv_hook=hook))
        if hook:
            out[4]()
    bad = dict(good)
    change(bad)
    n = len(calls)
    with pytest.raises(exc, match=match):
        _dispatch(dbuf, bad)
    assert len(calls) == n, "a refused call launched"
    _dispatch(dbuf, good)  # still served
    assert len(calls) == n + 1


def _combine_cases():
    def other_handle(b, a):  # a handle of another Buffer, same shapes
        other = Buffer(dist.group.WORLD, low_latency_mode=True, ep_config=cfg())
        x, idx, _, stats = inputs()
        a["handle"] = good_dispatch(other, x, idx, stats)[2]
        a["_keep"] = other

    return [
        ("x shape", lambda b, a: a.update(x=a["x"][:, :M - 1]), ValueError, "shape"),
        ("x float32", lambda b, a: a.update(x=a["x"].float()), TypeError, "bfloat16"),
        ("x not contiguous", lambda b, a: a.update(x=a["x"].transpose(0, 1).contiguous().transpose(0, 1)),
         ValueError, "contiguous"),
        ("weights float64", lambda b, a: a.update(w=a["w"].double()), TypeError, "float32"),
        ("weights shape", lambda b, a: a.update(w=a["w"][:, :2].contiguous()), ValueError, "topk_weights"),
        ("weights not contiguous", lambda b, a: a.update(w=a["w"].t().contiguous().t()), ValueError, "contiguous"),
        ("topk_idx int32", lambda b, a: a.update(idx=a["idx"].int()), TypeError, "int64"),
        ("out float", lambda b, a: a.update(out=torch.empty(6, H)), ValueError, "out"),
        ("handle a plain tuple", lambda b, a: a.update(handle=tuple(a["handle"])), TypeError, "low_latency_dispatch"),
        ("handle of another Buffer", other_handle, ValueError, "another Buffer"),
        ("handle of fewer tokens", lambda b, a: a.update(handle=good_dispatch(b, *[t[:4].contiguous() for t in
                                                                                    inputs()[:2]], inputs()[3])[2]),
         ValueError, r"topk_idx must have shape \[4, 3\]"),
        ("logfmt", lambda b, a: a.update(use_logfmt=True), NotImplementedError, "use_logfmt"),
        ("wait stats", lambda b, a: a.update(combine_wait_recv_cost_stats=torch.zeros(1, dtype=torch.int64)),
         NotImplementedError, "combine_wait_recv_cost_stats"),
        ("async and hook", lambda b, a: a.update(async_finish=True, return_recv_hook=True), ValueError,
         "async_finish and return_recv_hook"),
        ("zero_copy with no staging buffer", lambda b, a: a.update(zero_copy=True), ValueError,
         "get_next_low_latency_combine_buffer"),
    ]


COMBINE = _combine_cases()


@pytest.mark.parametrize("name,change,exc,match", COMBINE, ids=[c[0] for c in COMBINE])
def test_bad_combine_refused_after_good_forms(dbuf, calls, name, change, exc, match):
    x, idx, w, stats = inputs()
    rows = torch.zeros(E, M, H, dtype=torch.bfloat16)
    handle = good_dispatch(dbuf, x, idx, stats)[2]
    for hook in (False, True, False):
        hk = dbuf.low_latency_combine(rows, idx, w, handle, return_recv_hook=hook)[2]
        if hook:
            hk()
    a = dict(x=rows, idx=idx, w=w, handle=handle)
    change(dbuf, a)
    other = a.pop("_keep", None)
    n = len(calls)
    with pytest.raises(exc, match=match):
        dbuf.low_latency_combine(a.pop("x"), a.pop("idx"), a.pop("w"), a.pop("handle"), **a)
    if other is not None:
        other.destroy()
    assert len(calls) == n, "a refused call launched"
    dbuf.low_latency_combine(rows, idx, w, handle)
    assert len(calls) == n + 1


def test_each_form_checked_once_and_no_message_on_the_hot_path(dbuf, calls, monkeypatch):
    """Forms are a set, not the last call's: alternating forms (hook / no hook, BF16 / FP8, as DeepEP's test
    does) are each checked once; past that no check function runs and `need` (whose message is an
    f-string built before the call) is never called."""
    counted = {"dispatch_args": 0, "combine_args": 0, "need": 0}

    def count(name, fn):
        def wrapped(*a, **k):
            counted[name] += 1
            return fn(*a, **k)
        return wrapped

    for mod, name in ((dl_checks, "dispatch_args"), (dl_checks, "combine_args")):
        monkeypatch.setattr(mod, name, count(name, getattr(mod, name)))
    x, idx, w, stats = inputs()
    rows = torch.zeros(E, M, H, dtype=torch.bfloat16)

    def rounds(n):
        for _ in range(n):
            for fp8 in (False, True):
                for hook in (False, True):
                    recv_x, count_, handle, event, hk = good_dispatch(dbuf, x, idx, stats, use_fp8=fp8,
                                                                      return_recv_hook=hook)
                    if hook:
                        hk()
                    y, event, hk = dbuf.low_latency_combine(rows, idx, w, handle, return_recv_hook=hook)
                    if hook:
                        hk()
                    assert event.event is None and tuple(y.shape) == (6, H)

    rounds(1)
    assert counted == {"dispatch_args": 4, "combine_args": 2, "need": 0}
    for mod in (dl_checks, ll_checks, buffer_ll, ep_plugin.checks.core):
        monkeypatch.setattr(mod, "need", count("need", mod.need))
    n = len(calls)
    rounds(3)
    assert counted == {"dispatch_args": 4, "combine_args": 2, "need": 0}
    assert len(calls) == n + 3 * 4 * 3  # per round: 2 fused pairs (2 launches), 2 hooked (4)


def test_unhashable_flag_is_checked_not_cached(dbuf, calls):
    x, idx, w, stats = inputs()
    for _ in range(2):
        recv_x = good_dispatch(dbuf, x, idx, stats, use_fp8=[1])[0]  # truthy: FP8, as DeepEP would take it
        assert isinstance(recv_x, tuple)
    assert not any(isinstance(k, tuple) and [1] in k for k in dbuf._ll_dispatch_forms)


def test_shared_done_event_is_read_only(dbuf, calls):
    x, idx, w, stats = inputs()
    _, _, handle, event, _ = good_dispatch(dbuf, x, idx, stats)
    event.current_stream_wait()
    with event:
        pass
    with pytest.raises(AttributeError, match="shared"):
        event.event = object()
