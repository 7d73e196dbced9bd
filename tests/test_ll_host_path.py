"""The NVSHMEM low-latency engine's host path on CPU, over a fake _C.LowLatencyRuntime that records its
launches (benchmarks/bench_ll_host.py): which phases each call launches (one SEND|RECV launch with
fused_launch, the default with comm.low_latency.output_buffers > 0; SEND then RECV otherwise and with
a hook), that every pointer passed is the one of the tensor returned, the FP8 scales' layout, the
output ring, and that the shortcuts of EPBuffer and ep_plugin.deep_ep for a call of a form already
checked still raise what a changed handle or a pending engine error should. No GPU, no kernel: the
contract itself is tested on the torch engine (test_low_latency.py) and on GPUs (test_nvshmem_gpu.py).
"""
import pytest
import torch
import torch.distributed as dist

import ep_plugin
from benchmarks import bench_ll_host as bench
from ep_plugin.backends.nvshmem.heap_views import heap_tensor
from ep_plugin.backends.nvshmem.low_latency import (KERNEL_FLAGS_DEFAULT, OWNER_REDUCE, PER_PICK_SEND, RECV, SEND,
                                                    SEND_RECV, OutputsStillHeldError)

E_L, M, H, K = 4, 8, 256, 3


@pytest.fixture
def calls(solo):
    """The fake runtime's launches: ("dispatch" | "combine", phases, pointer and size arguments), the
    phases without the engine's variant bits (kernel_flags: test_default_variant_bits_reach_the_dispatch)."""
    log = _PhaseLog()
    with bench.fake_gpu("cpu", log):
        yield log


class _PhaseLog(list):
    """A launch log keeping each launch's phase bits (SEND, RECV) apart from its variant bits, which are in
    `.variant_bits` in launch order."""

    def __init__(self):
        super().__init__()
        self.variant_bits = []

    def append(self, call):
        kind, phases, args = call
        self.variant_bits.append(phases & ~SEND_RECV)
        super().append((kind, phases & SEND_RECV, args))


def test_default_variant_bits_reach_the_dispatch(calls):
    """The engine's default kernel_flags (row-major FP8 scales, count words, lean stores and routing, light
    tickets) go to every dispatch launch of the direct (heap-set) path; the combine kernels ignore the
    dispatch's bits."""
    buf = ep_plugin.EPBuffer(None, cfg(2), hidden=H)
    x, idx, w = inputs()
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx)
    assert engine_of(buf).kernel_flags == KERNEL_FLAGS_DEFAULT == 8 | 64 | 256 | 8192 | 16384
    # + kOwnerReduce (combine_reduce owner, the default): the dispatch writes the owners' records
    assert [c[0] for c in calls] == ["dispatch"] and calls.variant_bits == [KERNEL_FLAGS_DEFAULT | OWNER_REDUCE]


def cfg(output_buffers=0):
    return {"moe": {"num_experts": E_L, "topk": K},
            "comm": {"backend": "torch",
                     "low_latency": {"max_tokens_per_rank": M, "output_buffers": output_buffers}}}


def inputs(T=6):
    x = torch.randn(T, H).to(torch.bfloat16)
    idx = torch.tensor([[0, 1, -1], [2, 3, 1], [-1, -1, -1], [3, 0, 2], [1, -1, 0], [2, 1, 3], [0, 2, 1],
                        [3, 1, 0]])[:T].contiguous()
    return x, idx, torch.rand(T, K)


def engine_of(buf):
    eng = buf._low_latency
    assert type(eng).__name__ == "NvshmemLowLatency"
    return eng


def dispatch_ptrs(recv_x, recv_count, handle, stats):
    data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    return (data.data_ptr(), 0 if scales is None else scales.data_ptr(), recv_count.data_ptr(),
            handle.src_info.data_ptr(), handle.layout_range.data_ptr(), handle.state["row_slot"].data_ptr(),
            0 if stats is None else stats.data_ptr())


@pytest.mark.parametrize("output_buffers", [0, 2])
@pytest.mark.parametrize("use_fp8", [False, True])
def test_phases_and_pointers_without_hook(calls, output_buffers, use_fp8):
    buf = ep_plugin.EPBuffer(None, cfg(output_buffers), hidden=H)
    x, idx, w = inputs()
    stats = torch.zeros(E_L, dtype=torch.int32)
    recv_x, count, handle, event, hook = buf.low_latency_dispatch(x, idx, use_fp8=use_fp8, recv_stats=stats)
    eng = engine_of(buf)
    assert eng.fused_launch is (output_buffers > 0) and event is None and hook is None
    # the engine builds the handle positionally (in the dataclass's field order)
    assert (handle.num_tokens, handle.max_tokens, handle.hidden, handle.num_experts, handle.topk, handle.use_fp8,
            handle.backend, handle.buffer_id) == (6, M, H, E_L, K, use_fp8, "nvshmem", buf._id)
    assert handle.src_info.shape == (E_L, M) and handle.layout_range.shape == (E_L, 1) and "ptrs" in handle.state
    want = dispatch_ptrs(recv_x, count, handle, stats)
    if output_buffers:  # one launch: both halves
        (kind, phases, args), = calls
        assert (kind, phases) == ("dispatch", SEND_RECV)
        assert args[:6] == (x.data_ptr(), idx.data_ptr(), 6, K, int(use_fp8), 0) and args[6:] == want
    else:  # the send half with inputs only, then the receive half with outputs only
        (k1, p1, a1), (k2, p2, a2) = calls
        assert (k1, p1, k2, p2) == ("dispatch", SEND, "dispatch", RECV)
        assert a1 == (x.data_ptr(), idx.data_ptr(), 6, K, int(use_fp8), 0) + (0,) * 7
        assert a2[:2] == (0, 0) and a2[6:] == want
    calls.clear()
    rows = torch.zeros(E_L, M, H, dtype=torch.bfloat16)
    y, event, hook = buf.low_latency_combine(rows, idx, w, handle)
    assert tuple(y.shape) == (6, H) and y.dtype == torch.bfloat16 and event is None and hook is None
    state = handle.state
    send = (rows.data_ptr(), state["row_slot"].data_ptr(), state["recv_count"].data_ptr())
    recv = (idx.data_ptr(), w.data_ptr(), 6, K, y.data_ptr())
    if output_buffers:
        (kind, phases, args), = calls
        assert (kind, phases) == ("combine", SEND_RECV) and args == send + recv[:2] + (6, K, y.data_ptr())
    else:
        (k1, p1, a1), (k2, p2, a2) = calls
        assert (k1, p1, k2, p2) == ("combine", SEND, "combine", RECV)
        # the receive half reads this rank's own rows from the input (no hook: nothing runs in between);
        # the send half gets the routing and weights too (combine_reduce owner sends the weights first)
        assert a1 == send + recv[:4] + (0,) and a2 == (rows.data_ptr(), 0, 0) + recv
    buf.close()


@pytest.mark.parametrize("output_buffers", [0, 2])
def test_a_hook_always_splits_the_halves(calls, output_buffers):
    buf = ep_plugin.EPBuffer(None, cfg(output_buffers), hidden=H)
    x, idx, w = inputs()
    recv_x, count, handle, _, hook = buf.low_latency_dispatch(x, idx, use_fp8=False, return_recv_hook=True)
    assert [(c[0], c[1]) for c in calls] == [("dispatch", SEND)]
    hook()
    assert [(c[0], c[1]) for c in calls] == [("dispatch", SEND), ("dispatch", RECV)]
    assert calls[1][2][6:] == dispatch_ptrs(recv_x, count, handle, None)
    calls.clear()
    y, _, hook = buf.low_latency_combine(torch.zeros(E_L, M, H, dtype=torch.bfloat16), idx, w, handle,
                                         return_recv_hook=True)
    assert [(c[0], c[1]) for c in calls] == [("combine", SEND)]
    hook()
    assert [(c[0], c[1]) for c in calls] == [("combine", SEND), ("combine", RECV)]
    assert calls[1][2][-1] == y.data_ptr()
    buf.close()


def test_a_combine_hook_keeps_its_inputs_alive(calls):
    """The combine's receive half reads topk_idx and topk_weights when the hook runs: the hook holds them, so a
    caller that drops its names meanwhile does not free what the launch will read."""
    import gc
    import weakref
    buf = ep_plugin.EPBuffer(None, cfg(2), hidden=H)
    x, idx, w = inputs()
    handle = buf.low_latency_dispatch(x, idx)[2]
    idx_c, w_c = idx.clone(), w.clone()
    refs, ptrs = (weakref.ref(idx_c), weakref.ref(w_c)), (idx_c.data_ptr(), w_c.data_ptr())
    _, _, hook = buf.low_latency_combine(torch.zeros(E_L, M, H, dtype=torch.bfloat16), idx_c, w_c, handle,
                                         return_recv_hook=True)
    del idx_c, w_c
    gc.collect()
    assert all(r() is not None for r in refs)
    hook()  # reads them (the receive launch's routing and weights); then the hook lets them go
    assert calls[-1][2][3:5] == ptrs
    del hook
    gc.collect()
    assert all(r() is None for r in refs)
    buf.close()


def test_fused_launch_is_a_switch(calls):
    """Off with output_buffers: two launches; on with fresh outputs: one (outputs allocated first)."""
    x, idx, w = inputs()
    for output_buffers, fused in ((2, False), (0, True)):
        buf = ep_plugin.EPBuffer(None, cfg(output_buffers), hidden=H)
        buf.low_latency_dispatch(x, idx, use_fp8=False)  # builds the engine
        engine_of(buf).fused_launch = fused
        calls.clear()
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, use_fp8=False)
        y, _, _ = buf.low_latency_combine(torch.zeros(E_L, M, H, dtype=torch.bfloat16), idx, w, handle)
        phases = [(c[0], c[1]) for c in calls]
        if fused:
            assert phases == [("dispatch", SEND_RECV), ("combine", SEND_RECV)]
            assert calls[0][2][6:] == dispatch_ptrs(recv_x, count, handle, None) and calls[1][2][-1] == y.data_ptr()
        else:
            assert phases == [("dispatch", SEND), ("dispatch", RECV), ("combine", SEND), ("combine", RECV)]
        buf.close()


def test_output_layouts_and_ring(calls):
    buf = ep_plugin.EPBuffer(None, cfg(2), hidden=H)
    x, idx, w = inputs()
    (data, scales), count, handle, _, _ = buf.low_latency_dispatch(x, idx)
    S = H // 128
    assert data.dtype == torch.float8_e4m3fn and tuple(data.shape) == (E_L, M, H) and data.is_contiguous()
    # the transpose of a contiguous [E_l, H/128, W*M], as DeepEP returns it
    assert scales.dtype == torch.float32 and tuple(scales.shape) == (E_L, M, S) and scales.stride() == (S * M, 1, M)
    assert scales.transpose(1, 2).is_contiguous() and scales.storage_offset() == 0
    assert count.dtype == torch.int32 and tuple(count.shape) == (E_L,)
    assert handle.src_info.dtype == torch.int32 and tuple(handle.src_info.shape) == (E_L, M)
    assert handle.layout_range.dtype == torch.int64 and tuple(handle.layout_range.shape) == (E_L, 1)
    rows = torch.zeros(E_L, M, H, dtype=torch.bfloat16)
    ys = []
    for T in (6, 6, 6, 4):
        xt, it, wt = x[:T].contiguous(), idx[:T].contiguous(), w[:T].contiguous()
        _, _, h, _, _ = buf.low_latency_dispatch(xt, it, use_fp8=False)
        y, _, _ = buf.low_latency_combine(rows, it, wt, h)
        assert tuple(y.shape) == (T, H) and y.is_contiguous()
        ys.append(y.data_ptr())
    # combine outputs: two [M, H] sets used in turn, whatever T
    assert ys[0] != ys[1] and ys[2] == ys[0] and ys[3] == ys[1]
    out = torch.empty(6, H, dtype=torch.bfloat16)
    _, _, h, _, _ = buf.low_latency_dispatch(x, idx, use_fp8=False)
    calls.clear()
    y, _, _ = buf.low_latency_combine(rows, idx, w, h, out=out)
    assert y is out and calls[0][2][-1] == out.data_ptr()
    buf.close()


@pytest.fixture
def heap_calls(solo):
    """As `calls`, with output sets in the fake runtime: (launches, each dispatch launch's set)."""
    log, sets = _PhaseLog(), []
    with bench.fake_gpu("cpu", log, sets):
        yield log, sets


def test_output_sets_in_the_heap(heap_calls):
    """output_buffers 2 with sets in the heap: the outputs are views of the sets (the senders write there),
    BF16 and FP8 dispatches take the sets in one turn, and every launch names its set."""
    calls, sets = heap_calls
    buf = ep_plugin.EPBuffer(None, cfg(2), hidden=H)
    x, idx, w = inputs()
    outs = [buf.low_latency_dispatch(x, idx, use_fp8=use_fp8) for use_fp8 in (False, True)]
    eng = engine_of(buf)
    assert eng.output_sets == 2 and sets == [0, 1]
    assert [(c[0], c[1]) for c in calls] == [("dispatch", SEND_RECV)] * 2
    S = H // 128
    for (recv_x, count, handle, _, _), i in zip(outs, (0, 1)):
        data_ptr, scales_ptr, src_ptr, slot_ptr, _rec_ptr = eng._rt.set_pointers(i)
        data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        assert data.data_ptr() == data_ptr and tuple(data.shape) == (E_L, M, H) and data.is_contiguous()
        assert handle.src_info.data_ptr() == src_ptr and handle.state["row_slot"].data_ptr() == slot_ptr
        if scales is not None:
            assert data.dtype == torch.float8_e4m3fn and scales.data_ptr() == scales_ptr
            assert tuple(scales.shape) == (E_L, M, S) and scales.stride() == (S * M, 1, M)
        else:
            assert data.dtype == torch.bfloat16
    del recv_x, count, handle, data, scales  # the loop's names hold set 1 too
    # the views alias the set's bytes: what a sender writes there is what the caller reads
    outs[0][0][1, 2].fill_(3.5)
    again = heap_tensor(eng._rt.set_pointers(0)[0], (E_L, M, H), torch.bfloat16, torch.device("cpu"))
    assert bool((again[1, 2] == 3.5).all())
    del again
    # set 0 comes round while outs[0] is still held: launched on every rank alike, then raised
    with pytest.raises(OutputsStillHeldError, match="output_buffers: 0 for fresh tensors"):
        buf.low_latency_dispatch(x, idx, use_fp8=False)
    assert sets == [0, 1, 0]
    outs.clear()
    kept = buf.low_latency_dispatch(x, idx, use_fp8=True)  # set 1, no longer held
    # with a hook: the send half already names the set, and the receive half too
    calls.clear()
    sets.clear()
    _, _, handle, _, hook = buf.low_latency_dispatch(x, idx, use_fp8=False, return_recv_hook=True)
    hook()
    assert [(c[0], c[1]) for c in calls] == [("dispatch", SEND), ("dispatch", RECV)] and sets == [0, 0]
    assert handle.src_info.data_ptr() == eng._rt.set_pointers(0)[2]
    y, _, _ = buf.low_latency_combine(torch.zeros(E_L, M, H, dtype=torch.bfloat16), idx, w, handle)
    assert tuple(y.shape) == (6, H)
    del kept
    buf.close()


@pytest.mark.parametrize("view", [False, True])
def test_held_outputs_are_never_overwritten_silently(heap_calls, view):
    """What DeepEP V1's fresh tensors allow a caller -- keeping outputs as long as it likes -- stays safe
    with output sets: a dispatch whose set a caller still holds (the tensor, or only a view of it)
    raises once launched; a held combine output is replaced by a fresh tensor, nothing raised; a loop
    that drops each step's outputs raises nothing."""
    calls, sets = heap_calls
    buf = ep_plugin.EPBuffer(None, cfg(2), hidden=H)
    x, idx, w = inputs()
    rows = torch.zeros(E_L, M, H, dtype=torch.bfloat16)
    for _ in range(5):  # a decode loop: nothing held across steps
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, use_fp8=False)
        y, _, _ = buf.low_latency_combine(rows, idx, w, handle)
    keep = recv_x[0] if view else recv_x  # the last step's (set 0 after 5 calls: 0 1 0 1 0)
    kept_y = y[:2] if view else y
    del recv_x, count, handle, y
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, use_fp8=True)  # set 1: free
    ys = [buf.low_latency_combine(rows, idx, w, handle)[0] for _ in range(2)]  # y sets 1, then 0 (held)
    assert ys[1].data_ptr() != kept_y.data_ptr()  # the held combine output was not reused
    del recv_x, count, handle
    with pytest.raises(OutputsStillHeldError):
        buf.low_latency_dispatch(x, idx, use_fp8=False)  # set 0, held through `keep`
    del keep
    buf.low_latency_dispatch(x, idx, use_fp8=False)
    buf.close()


@pytest.mark.parametrize("output_buffers", [0, 2])
def test_own_rows_skip_the_send_unless_hooked(solo, output_buffers):
    """Every dispatch launch records where this rank's own (token, k) rows land (the handle's self_pos);
    a combine without a hook passes it to both halves (its own rows are read from the input, not sent),
    a hooked one passes none (the input may change before the hook runs)."""
    log = []
    with bench.fake_gpu("cpu", None, None, log):
        buf = ep_plugin.EPBuffer(None, cfg(output_buffers), hidden=H)
        x, idx, w = inputs()
        rows = torch.zeros(E_L, M, H, dtype=torch.bfloat16)
        for hook in (False, True):
            log.clear()
            _, _, handle, _, dhook = buf.low_latency_dispatch(x, idx, use_fp8=False, return_recv_hook=hook)
            if hook:
                dhook()
            own = handle.state["self_pos"]
            assert own.dtype == torch.int32 and own.numel() == M * engine_of(buf).max_topk
            assert [p for k, _, p in log if k == "dispatch"][-1] == own.data_ptr()
            _, _, chook = buf.low_latency_combine(rows, idx, w, handle, return_recv_hook=hook)
            if hook:
                chook()
            assert {p for k, _, p in log if k == "combine"} == ({0} if hook else {own.data_ptr()})
        buf.close()


def test_cached_forms_still_refuse_a_changed_handle_and_raise_pending_errors(calls):
    """The deep_ep layer goes past EPBuffer's checks for a form it checked: the per-call handle checks and
    the engine's pending errors must still apply."""
    from ep_plugin.deep_ep import Buffer
    dbuf = Buffer(dist.group.WORLD, low_latency_mode=True, ep_config=cfg(2))
    x, idx, w = inputs()
    rows = torch.zeros(E_L, M, H, dtype=torch.bfloat16)
    stats = torch.zeros(E_L, dtype=torch.int32)

    def dispatch(T=6):
        return dbuf.low_latency_dispatch(x[:T].contiguous(), idx[:T].contiguous(), M, E_L,
                                         cumulative_local_expert_recv_stats=stats, use_fp8=False)

    for _ in range(2):  # the second call of each takes the shortcut
        _, _, handle, _, _ = dispatch()
        dbuf.low_latency_combine(rows, idx, w, handle)
    _, _, short, _, _ = dispatch(4)
    for _ in range(2):  # a call that failed leaves the last good form as it was
        with pytest.raises(ValueError, match=r"topk_idx must have shape \[4, 3\]"):
            dbuf.low_latency_combine(rows, idx, w, short)  # same form as the last good combine, other handle
    eng = engine_of(next(iter(dbuf._ll_buffers.values())))
    eng._rt.take_bad_expert_ids = lambda: 1  # a send half saw an id outside [-1, E)
    with pytest.raises(ValueError, match="topk_idx values must lie"):
        dispatch(4)  # the form of the last good dispatch
    del eng._rt.take_bad_expert_ids
    _, _, handle, _, _ = dispatch(4)
    dbuf.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        dbuf.low_latency_combine(rows, idx[:4].contiguous(), w[:4].contiguous(), handle)


def test_deep_ep_checks_each_form_once(calls, monkeypatch):
    """A repeated call of the deep_ep layer goes past EPBuffer's public methods (whose checks its form
    covers) to the engine, and launches the same as through EPBuffer."""
    from ep_plugin.deep_ep import Buffer
    checked = []
    for name in ("_check_low_latency_dispatch", "_check_low_latency_combine"):
        orig = getattr(ep_plugin.EPBuffer, name)
        monkeypatch.setattr(ep_plugin.EPBuffer, name,
                            lambda self, *a, _o=orig, _n=name, **k: (checked.append(_n), _o(self, *a, **k))[1])
    dbuf = Buffer(dist.group.WORLD, low_latency_mode=True, ep_config=cfg(2))
    x, idx, w = inputs()
    rows = torch.zeros(E_L, M, H, dtype=torch.bfloat16)
    for _ in range(3):
        (data, scales), count, handle, event, hook = dbuf.low_latency_dispatch(x, idx, M, E_L)
        y, event2, hook2 = dbuf.low_latency_combine(rows, idx, w, handle)
        assert hook is None and hook2 is None and event.event is None and event2.event is None
        assert handle[2:] == (M, H, E_L) and handle.inner.buffer_id is not None and tuple(y.shape) == (6, H)
    assert checked == ["_check_low_latency_dispatch", "_check_low_latency_combine"]
    assert [(c[0], c[1]) for c in calls] == [("dispatch", SEND_RECV), ("combine", SEND_RECV)] * 3
    dbuf.destroy()


def test_deep_ep_known_forms_skip_torch_function_modes(calls):
    """DeepEP's tests run under torch.set_default_device('cuda'), a torch function mode that every tensor
    attribute and method passes through: a call of a form already checked makes none of those passes (its
    first call, with the checks, still does: a new buffer allocates on the caller's default device)."""
    from torch.overrides import TorchFunctionMode

    from ep_plugin.deep_ep import Buffer

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    dbuf = Buffer(dist.group.WORLD, low_latency_mode=True, ep_config=cfg(2))
    x, idx, w = inputs()
    rows = torch.zeros(E_L, M, H, dtype=torch.bfloat16)
    stats = torch.zeros(E_L, dtype=torch.int32)
    with Count():
        for step in range(3):
            before = Count.n
            _, _, handle, _, _ = dbuf.low_latency_dispatch(x, idx, M, E_L, cumulative_local_expert_recv_stats=stats)
            y, _, _ = dbuf.low_latency_combine(rows, idx, w, handle)
            assert (Count.n > before) == (step == 0), (step, Count.n - before)
            del handle, y
    assert [(c[0], c[1]) for c in calls] == [("dispatch", SEND_RECV), ("combine", SEND_RECV)] * 3
    dbuf.destroy()


def test_bench_runs(solo, capsys):
    bench.main(["-n", "20", "--repeats", "1", "--output-buffers", "2"])
    out = capsys.readouterr().out
    assert "HOST OVERHEAD ONLY" in out and out.count(" fp8 ") == 3 and out.count(" bf16 ") == 3


def test_decode_pair_bench_variants_timelines_and_merge():
    """benchmarks/bench_decode_pair.py's CPU-side logic (the device run has no second chance): variant
    specs, the per-kernel timeline of traced pairs aligned across ranks, the merged table and A/B lines."""
    from benchmarks import bench_decode_pair as dp
    assert dp.parse_variant("ob2")["ob"] == 2 and dp.parse_variant("shim")["shim"]
    v = dp.parse_variant("x:ob=0,eng.fused_launch=1,cfg.comm.backend=nvshmem")
    assert v == {"name": "x", "ob": 0, "shim": False, "eng": {"fused_launch": 1}, "cfg": {"comm.backend": "nvshmem"},
                 "ht": None}
    assert dp.parse_variant("noht:ht=torch")["ht"] == "torch"
    for bad in ("nope", "x:ob=-1", "x:what=1", "x:ob"):
        with pytest.raises(ValueError):
            dp.parse_variant(bad)

    def pair(t0, ks):
        return {"t0": t0, "kernels": [{"name": n, "ts": t, "dur": d} for n, t, d in ks]}

    r0 = [pair(100, [("dispatch", 105, 10), ("combine", 120, 12)]), pair(200, [("dispatch", 204, 11), ("combine", 221, 12)])]
    r1 = [pair(101, [("dispatch", 108, 10), ("combine", 125, 9)]), pair(199, [("dispatch", 206, 10), ("combine", 222, 12)])]
    tl = dp.timeline([r0, r1])
    a, b = tl["ranks"]
    assert [k["name"] for k in a["kernels"]] == ["dispatch", "combine"] and a["launch_gap"] == 4.5
    assert b["kernels"][0]["start"] == 7.5 and b["end"] == 34.5 and a["gaps"] == [5.5]
    rec = {"variant": "default", "spec": {}, "engine": {}, "wall_s": 1.0,
           "dtypes": {"bf16": {"us": {"graph_cold": [80.0, 90.0, 85.0]}, "errors": {}, "checksum": 3.0}}}
    merged = dp.merge_ranks([rec, rec])
    assert merged["dtypes"]["bf16"]["slowest_median_us"]["graph_cold"] == 85.0
    # host stamps (after the barrier, after the launch) per pair: rank 1 leaves the barrier 30 then 10 us late
    h0 = dict(rec, dtypes={"bf16": dict(rec["dtypes"]["bf16"], host_ns={"graph_cold": [(0, 5_000), (100_000, 104_000)]})})
    h1 = dict(rec, dtypes={"bf16": dict(rec["dtypes"]["bf16"], host_ns={"graph_cold": [(30_000, 36_000), (110_000, 116_000)]})})
    host = dp.merge_ranks([h0, h1])["dtypes"]["bf16"]["host"]
    assert host["graph_cold_skew_us"] == 20.0 and host["graph_cold_late_rank"] == 1 and host["graph_cold_host_us"] == 6.0
    assert "graph_cold spread 20.0 (late r1)" in dp.variant_lines("ep_plugin", 2, dp.merge_ranks([h0, h1]))
    docs = [{"world": 2, "lib": "ep_plugin", "results": [merged, dict(merged, variant="ob0")]},
            {"world": 2, "lib": "deepep", "results": [dict(merged, variant="deepep")]}]
    rows = dp.rows_of(docs)
    assert "85.0" in dp.table(rows)
    ab = dp.ab_lines(rows)
    assert "vs deepep: graph cold 1.00" in ab and "outputs of the ep_plugin variants: equal" in ab


def _deepep_test_main_calls(buffer, H_, num_experts, use_async=True, on_bench=lambda: None):
    """The low-latency calls of DeepEP v1.2.1's tests/test_low_latency.py test_main, in its order and with
    its names bound as it binds them (values unchecked: no kernel runs here). What matters is what the
    test keeps: its check loop's names (recv_x, recv_count, recv_src_info, recv_layout_range: views of
    the last checked dispatch) stay bound through the next dispatches and the whole bench, and every
    other iteration dispatches twice in a row."""
    num_tokens, num_topk = 6, K
    x = torch.ones(num_tokens, H_, dtype=torch.bfloat16)
    x_list = [x, torch.randn(num_tokens, H_).to(torch.bfloat16)]
    topk_idx = torch.stack([torch.randperm(num_experts)[:num_topk] for _ in range(num_tokens)])
    topk_idx[1, 2] = -1
    topk_weights = torch.rand(num_tokens, num_topk)
    num_local_experts = num_experts  # one rank
    num_times = 0
    for current_x in x_list:
        for return_recv_hook in (False, True):
            for dispatch_use_fp8 in (False, True):
                for round_scale in (False, True) if dispatch_use_fp8 else (False, ):
                    for use_ue8m0 in (False, True) if round_scale else (False, ):
                        num_times += 1
                        for i in range((num_times % 2) + 1):
                            cumulative_local_expert_recv_stats = torch.zeros(num_local_experts, dtype=torch.int)
                            packed_recv_x, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
                                current_x, topk_idx, M, num_experts, use_fp8=dispatch_use_fp8,
                                round_scale=round_scale, use_ue8m0=use_ue8m0,
                                cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                                async_finish=use_async and not return_recv_hook, return_recv_hook=return_recv_hook)
                            hook() if return_recv_hook else None
                        packed_recv_x = (packed_recv_x[0], packed_recv_x[1].contiguous()) if dispatch_use_fp8 \
                            else packed_recv_x
                        simulated_gemm_x = torch.zeros(num_local_experts, M, H_, dtype=torch.bfloat16)  # fresh
                        for i in range(num_local_experts):
                            recv_x = packed_recv_x[0][i].float() if dispatch_use_fp8 else packed_recv_x[i]
                            recv_count, recv_src_info, recv_layout_range = packed_recv_count[i], handle[0][i], handle[1][i]
                            recv_x, recv_src_info = recv_x[:1], recv_src_info[:1]
                        for zero_copy in (False, True):
                            if zero_copy:
                                buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = simulated_gemm_x
                            out = torch.empty((num_tokens, H_), dtype=torch.bfloat16)
                            combined_x, event, hook = buffer.low_latency_combine(
                                simulated_gemm_x, topk_idx, topk_weights, handle, async_finish=False,
                                zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out)
                            hook() if return_recv_hook else None

    def test_func(return_recv_hook):  # the bench's pair, 20 times per form
        recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
            current_x, topk_idx, M, num_experts, cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            use_fp8=True, async_finish=False, return_recv_hook=return_recv_hook)
        hook() if return_recv_hook else None
        combined_x, event, hook = buffer.low_latency_combine(simulated_gemm_x, topk_idx, topk_weights, handle,
                                                             return_recv_hook=return_recv_hook)
        hook() if return_recv_hook else None

    on_bench()
    for return_recv_hook in (False, False, True):
        for _ in range(20):
            test_func(return_recv_hook)
    return packed_recv_x  # still bound, as in the test


@pytest.mark.parametrize("ep_config", [None, "heap"])
def test_deepep_test_low_latency_pattern_never_raises_without_ep_config(heap_calls, ep_config, move_by):
    """DeepEP's own test_low_latency (device run 2026-11-26: OutputsStillHeldError at EP2 through
    ep_plugin.deep_ep with two heap sets) keeps a dispatch's views through its bench. With no ep_config the
    deep_ep layer takes three heap sets with held_outputs copy: a held set is moved out one dispatch before
    its turn, nothing raised, a held view never named by a later launch, and the bench (nothing held but
    the check loop's one set, moved once) copies nothing. With an ep_config (two heap sets) the same
    calls raise."""
    from ep_plugin.deep_ep import Buffer
    calls, sets = heap_calls
    H_ = 512  # use_ue8m0 needs H % 512 == 0
    dbuf = Buffer(dist.group.WORLD, low_latency_mode=True,
                  ep_config=None if ep_config is None else cfg(2))
    if ep_config is not None:
        with pytest.raises(OutputsStillHeldError):
            _deepep_test_main_calls(dbuf, H_, E_L, use_async=False)
        dbuf.destroy()
        return
    at_bench = []
    kept = _deepep_test_main_calls(dbuf, H_, E_L, use_async=False,
                                   on_bench=lambda: at_bench.append(engine_of(next(iter(dbuf._ll_buffers.values())))
                                                                    .moved_sets))
    buf = next(iter(dbuf._ll_buffers.values()))
    eng = engine_of(buf)
    assert eng.output_buffers == 3 and eng.output_sets == 3 and eng.move_held and eng.fused_launch
    assert sorted(set(sets)) == [0, 1, 2]  # every launch names a heap set
    # the check loop's names held sets: moved (one copy each time), never raised; the bench moves the one the
    # names still hold (once) and nothing after it
    assert at_bench[0] > 0 and eng.moved_sets <= at_bench[0] + 1
    # the views the test still holds are memory of their own now, never the target of a later launch's rows
    held = kept[0].data_ptr()
    heap = {eng._rt.set_pointers(i)[0] for i in range(3)}
    assert held not in heap
    assert held not in [c[2][6] for c in calls if c[0] == "dispatch"]
    dbuf.destroy()


def _heap_cfg(n, held):
    c = cfg(n)
    c["comm"]["low_latency"]["held_outputs"] = held
    return c


@pytest.fixture(params=["swap", "scan"])
def move_by(request, monkeypatch):
    """_move_out both ways: torch's storage swap (where torch has it) and the scan for the tensors (torch 2.11)."""
    from ep_plugin.backends.nvshmem import held
    if request.param == "swap" and not held._CAN_SWAP:
        pytest.skip("this torch has no UntypedStorage._swap_data_ptr_")
    monkeypatch.setattr(held, "_CAN_SWAP", request.param == "swap")
    return request.param


@pytest.mark.parametrize("view", [False, True])
def test_held_heap_set_is_moved_with_its_values(heap_calls, view, move_by):
    """held_outputs copy: a heap set a caller holds (a tensor, or only a view, and the handle) is moved to
    memory of its own one dispatch before its turn: the caller's tensors keep the values the senders had
    written, later writes into the heap set do not reach them, the held handle's row_slot pointer follows,
    and a loop that drops its outputs moves nothing."""
    calls, sets = heap_calls
    buf = ep_plugin.EPBuffer(None, _heap_cfg(3, "copy"), hidden=H)
    x, idx, w = inputs()
    rows = torch.zeros(E_L, M, H, dtype=torch.bfloat16)
    for step in range(4):  # a decode loop: nothing held across steps (sets 0 1 2 0; FP8 views made at step 0)
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, use_fp8=step == 0)
        buf.low_latency_combine(rows, idx, w, handle)
    eng = engine_of(buf)
    assert eng.moved_sets == 0 and sets == [0, 1, 2, 0]
    recv_x.fill_(1.5)  # what the senders wrote into set 0
    handle.src_info.fill_(7)
    keep = recv_x[1] if view else recv_x
    kept_handle = handle
    del recv_x, count, handle
    heap0 = eng._rt.set_pointers(0)
    buf.low_latency_dispatch(x, idx, use_fp8=False)  # set 1; set 2 looked at: free
    assert eng.moved_sets == 0
    buf.low_latency_dispatch(x, idx, use_fp8=True)  # set 2; set 0 looked at: held -> moved
    assert eng.moved_sets == 1
    assert keep.data_ptr() not in heap0 and kept_handle.src_info.data_ptr() != heap0[2]
    assert kept_handle.state["ptrs"][0] == kept_handle.state["row_slot"].data_ptr() != heap0[3]
    # set 0 again, in the other precision (whose views of the same bytes a scan also finds): new views of
    # the heap, and the launch names them
    _, _, h0, _, _ = buf.low_latency_dispatch(x, idx, use_fp8=True)
    assert h0.src_info.data_ptr() == heap0[2] and h0.state["row_slot"].data_ptr() == heap0[3] and sets[-1] == 0
    assert calls[-1][2][9] == heap0[2] and calls[-1][2][11] == heap0[3]
    heap_tensor(heap0[0], (E_L, M, H), torch.bfloat16, torch.device("cpu")).fill_(-3.0)  # the senders' new rows
    heap_tensor(heap0[2], (E_L, M), torch.int32, torch.device("cpu")).fill_(-1)
    assert bool((keep == 1.5).all()) and bool((kept_handle.src_info == 7).all())
    buf.low_latency_combine(rows, idx, w, kept_handle)  # an old handle still combines (its own row_slot)
    assert calls[-1][2][1] == kept_handle.state["row_slot"].data_ptr()
    buf.close()


def test_held_outputs_copy_needs_three_sets():
    from ep_plugin.config import load_config
    from ep_plugin.errors import ConfigError
    with pytest.raises(ConfigError, match="copy needs output_buffers >= 3"):
        load_config(_heap_cfg(2, "copy"))
    assert load_config(_heap_cfg(3, "copy")).comm.low_latency.held_outputs == "copy"
    assert load_config(_heap_cfg(0, "copy")).comm.low_latency.output_buffers == 0


def test_torch_sets_skip_a_held_set(calls):
    """Output sets of torch tensors (no heap sets): a held set gives way to the next one nobody holds, the
    turn going on from there; fresh tensors only when every set is held. Never raised, never overwritten."""
    buf = ep_plugin.EPBuffer(None, cfg(2), hidden=H)
    x, idx, _ = inputs()
    eng = None

    def dispatch():
        nonlocal eng
        recv_x = buf.low_latency_dispatch(x, idx, use_fp8=False)[0]
        eng = engine_of(buf)
        return recv_x

    kept = dispatch()  # set 0, held from here on
    assert eng.output_sets == 0
    ptr = [dispatch().data_ptr() for _ in range(3)]  # set 1 each time: set 0 is held, set 1 is dropped
    assert len(set(ptr)) == 1 and kept.data_ptr() not in ptr
    also = dispatch()  # set 1 again, now held too
    fresh = dispatch()  # both held: fresh tensors
    assert fresh.data_ptr() not in (kept.data_ptr(), also.data_ptr())
    del kept
    assert dispatch().data_ptr() != also.data_ptr()  # set 0 is free again
    buf.close()


def test_source_order_arrival_sets_its_kernel_bit(calls):
    """comm.low_latency.source_order arrival: the engine adds kArrivalOrder (32768) to the default bits, and
    the launches carry it; rank (the default) does not; a misspelt value is a ConfigError naming both."""
    from ep_plugin.backends.nvshmem.low_latency import ARRIVAL_ORDER
    from ep_plugin.config import load_config
    from ep_plugin.errors import ConfigError
    c = cfg(2)
    c["comm"]["low_latency"]["source_order"] = "arrival"
    buf = ep_plugin.EPBuffer(None, c, hidden=H)
    x, idx, _ = inputs()
    buf.low_latency_dispatch(x, idx)
    assert engine_of(buf).kernel_flags == KERNEL_FLAGS_DEFAULT | ARRIVAL_ORDER == KERNEL_FLAGS_DEFAULT + 32768
    assert calls.variant_bits == [KERNEL_FLAGS_DEFAULT | ARRIVAL_ORDER | OWNER_REDUCE]
    buf.close()
    assert load_config(cfg(2)).comm.low_latency.source_order == "rank"
    c["comm"]["low_latency"]["source_order"] = "arival"
    with pytest.raises(ConfigError, match="arrival") as exc:
        load_config(c)
    assert "rank" in str(exc.value)


def test_combine_reduce_sets_its_kernel_bit(calls):
    """comm.low_latency.combine_reduce: owner (the default) adds kOwnerReduce (65536) to every launch, dispatch
    and combine, apart from kernel_flags (the A/B bits a benchmark may replace); source does not."""
    x, idx, w = inputs()
    for reduce, bits in (("owner", OWNER_REDUCE), ("source", 0)):
        c = cfg(2)
        c["comm"]["low_latency"]["combine_reduce"] = reduce
        buf = ep_plugin.EPBuffer(None, c, hidden=H)
        calls.clear()
        calls.variant_bits.clear()
        handle = buf.low_latency_dispatch(x, idx)[2]
        buf.low_latency_combine(torch.zeros(E_L, M, H, dtype=torch.bfloat16), idx, w, handle)
        eng = engine_of(buf)
        assert eng.kernel_flags == KERNEL_FLAGS_DEFAULT and eng.sum_bits == bits == 65536 * (reduce == "owner")
        assert calls.variant_bits == [KERNEL_FLAGS_DEFAULT | bits] * 2
        eng.kernel_flags = 0  # an A/B run replacing the variant bits keeps the sums' bit
        buf.low_latency_combine(torch.zeros(E_L, M, H, dtype=torch.bfloat16), idx, w, handle)
        assert calls.variant_bits[-1] == bits
        # under a hook both halves send / read every pick's row (kPerPickSend): a send half that waited for
        # the peers' weights would hold its SMs through the caller's compute
        _, _, hook = buf.low_latency_combine(torch.zeros(E_L, M, H, dtype=torch.bfloat16), idx, w, handle,
                                             return_recv_hook=True)
        hook()
        assert calls.variant_bits[-2:] == [bits | (PER_PICK_SEND if bits else 0)] * 2
        buf.close()
