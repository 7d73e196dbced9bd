"""The nvlink backend's host path on CPU, through EPBuffer, over a fake _C.NvlinkRuntime that records its
launches (benchmarks/bench_nvlink_host.py): the launch order of each call, that every pointer passed is
the one of the tensor returned (or kept in the handle), the documented shapes and dtypes in each mode
(worst-case and host-synced, rank- and expert-major, FP8, async, CUDA-graph capture), the host counts
read from the pinned copies, the stream a call runs on (and the wait on a previous async call), and the
errors the runtime reports. No GPU, no kernel: the contract itself is tested on GPUs (test_nvlink.py).
"""
import ctypes
from collections import Counter

import pytest
import torch

import ep_plugin
from benchmarks import bench_nvlink_host as bench
from ep_plugin import expert_major
from ep_plugin.backends.nvlink import backend as nvl
from ep_plugin.backends.nvlink import plan as nvl_plan
from ep_plugin.errors import EPTimeoutError

W, E, K, H, M, T = bench.W, 8, 3, 256, 16, 6
E_L, R = E // W, W * M
SMS = bench.SMS
TPE = [3, 1, 4, 1]          # what the fake notify writes: rows per local expert
RECV_OFF = [0, 5, 9]        # receive offsets per source rank
IS_IN = [[1, 0], [1, 1], [0, 0], [0, 1], [1, 1], [1, 0]]  # [T, W] token -> rank


class FillingRuntime(bench.FakeRuntime):
    """FakeRuntime whose notify writes known counts through the pointers it gets (CPU memory), as the
    kernel would before the copies queued behind it; counts expert_scratch_ints calls."""

    scratch_calls = 0

    def notify(self, topk_idx, T_, K_, send_pos, is_in, recv_off, tpe, stream, host_tpe=0, host_recv_off=0,
               merge_repeats=0):
        super().notify(topk_idx, T_, K_, send_pos, is_in, recv_off, tpe, stream, host_tpe, host_recv_off,
                       merge_repeats)
        for at in (tpe, host_tpe):  # the kernel writes the pinned copies too, when given
            if at:
                (ctypes.c_int64 * E_L).from_address(at)[:] = TPE
        for at in (recv_off, host_recv_off):
            if at:
                (ctypes.c_int32 * (W + 1)).from_address(at)[:] = RECV_OFF
        (ctypes.c_bool * (T_ * W)).from_address(is_in)[:] = [bool(v) for row in IS_IN[:T_] for v in row]

    def expert_scratch_ints(self, num_sms):
        FillingRuntime.scratch_calls += 1
        return super().expert_scratch_ints(num_sms)


@pytest.fixture
def gpu(solo):
    """(launch log, current FakeStream, Counter of torch.cuda stand-in calls) inside the fakes."""
    log, stream = [], bench.FakeStream(device=0)
    FillingRuntime.scratch_calls = 0
    with bench.fake_gpu(calls=log, runtime=FillingRuntime, stream=stream, count=Counter()) as tally:
        yield log, stream, tally


def make_buf(default_stage=False, **comm):
    # the split kernels unless a test names another (auto picks stage_pull at this world size of 2), and their stage
    # launched after notify on the call's stream, so that its launch shows the stage's own arguments; default_stage:
    # the backend's own choice (the copy-engine stage beside notify, test_stage_beside_notify)
    comm.setdefault("dispatch_kernel", "split")
    buf = ep_plugin.EPBuffer(None, bench.config(max_tokens=M, num_experts=E, topk=K, **comm), hidden=H)
    if not default_stage:
        buf._backend.stage_beside_notify = False
    return buf


def inputs(fp8=False):
    idx = torch.tensor([[0, 5, -1], [1, 2, 7], [-1, -1, -1], [6, 4, 3], [0, 7, 1], [2, 3, 0]])
    x = torch.randn(T, H).to(torch.bfloat16)
    if fp8:
        x = (x.to(torch.float8_e4m3fn), torch.rand(T, H // 128))
    return x, idx, torch.rand(T, K)


def names(log):
    return [c[0] for c in log]


def launches(log):
    """name -> args of each launch in `log`; a stage_pull (stage and rank-major pull in one kernel) is
    given as the stage and the pull it stands for, with their own argument orders."""
    out = {}
    for name, a in log:
        if name == "stage_pull":
            (x, T_, row_bytes, scales, nscales, idx, w, K_, out_x, out_s, out_idx, out_w, recv_off, recv_src, cached,
             R_alloc, sms, stream) = a
            out["stage"] = (x, T_, row_bytes, scales, nscales, idx, w, K_, sms, 0, stream)
            out["pull"] = (out_x, row_bytes, out_s, nscales, out_idx, out_w, K_, recv_off, recv_src, cached, R_alloc,
                           sms, stream)
        else:
            out[name] = a
    return out


def ptr(t):
    return 0 if t is None else t.data_ptr()


def check_fresh_tensors(res, stream_ptr, log, rows, x, w, merge=0):
    """notify/stage pointers and the handle's tensors of a fresh dispatch of (x, idx, w) (launches in `log`);
    merge: 1 where notify and stage merge repeated experts (an expert-major dispatch)."""
    h, st = res.handle, res.handle.state
    notify = dict(log)["notify"]
    pinned = h.counts._pinned if not h.exact else {}  # no host sync: notify writes the pinned ring slot
    assert notify == (h.topk_idx.data_ptr(), T, K, st.send_pos.data_ptr(), h.is_token_in_rank.data_ptr(),
                      st.recv_off.data_ptr(), h.num_tokens_per_expert.data_ptr(),
                      ptr(pinned.get("tokens_per_expert")), ptr(pinned.get("recv_off")), merge, stream_ptr)
    for t, shape, dtype in ((st.send_pos, (T, W), torch.int32), (h.is_token_in_rank, (T, W), torch.bool),
                            (st.recv_off, (W + 1,), torch.int32), (h.num_tokens_per_expert, (E_L,), torch.int64),
                            (st.recv_src, (rows,), torch.int32), (h.recv_topk_idx, (rows, K), torch.int64)):
        assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous(), (shape, dtype)
    # the valid row count is recv_off[W], a device scalar viewing it
    assert h.num_recv_device.shape == () and h.num_recv_device.data_ptr() == st.recv_off.data_ptr() + 4 * W
    data, scales = x if isinstance(x, tuple) else (x, None)
    assert launches(log)["stage"] == (data.data_ptr(), T, H * data.element_size(), ptr(scales),
                                      0 if scales is None else H // 128, h.topk_idx.data_ptr(), ptr(w), K, SMS, merge,
                                      stream_ptr)


def test_worst_case_rank_major(gpu):
    log, stream, _ = gpu
    buf = make_buf()
    x, idx, w = inputs()
    res = buf.dispatch(x, idx, w)
    assert names(log) == ["notify", "stage", "pull"]
    check_fresh_tensors(res, stream.cuda_stream, log, R, x, w)
    h, st = res.handle, res.handle.state
    assert launches(log)["pull"] == (res.x.data_ptr(), H * 2, 0, 0, res.topk_idx.data_ptr(), res.topk_weights.data_ptr(),
                                 K, st.recv_off.data_ptr(), st.recv_src.data_ptr(), 0, R, SMS, stream.cuda_stream)
    assert res.x.shape == (R, H) and res.x.dtype == torch.bfloat16 and res.x.is_contiguous()
    assert res.topk_idx is h.recv_topk_idx
    assert res.topk_weights.shape == (R, K) and res.topk_weights.dtype == torch.float32
    assert h.num_recv == R and not h.exact and st.worst_case and h.expert is None and res.event is None
    # the host counts: the pinned copies of what notify wrote, and what derives from them
    assert res.tokens_per_expert == TPE and isinstance(res.tokens_per_expert, list)
    assert h.recv_counts == [5, 4]
    assert h.send_counts == [sum(r[0] for r in IS_IN), sum(r[1] for r in IS_IN)]
    assert isinstance(h.counts, ep_plugin.types.HostCounts)
    # without weights: none staged, none pulled
    log.clear()
    res2 = buf.dispatch(x, idx)
    assert res2.topk_weights is None and launches(log)["stage"][6] == 0 and launches(log)["pull"][5] == 0
    buf.close()


def test_counts_survive_the_ring_and_combine(gpu):
    log, stream, _ = gpu
    buf = make_buf()
    x, idx, w = inputs()
    first = buf.dispatch(x, idx, w)
    ring = buf._backend._ring
    for _ in range(len(ring._slots) + 3):  # the first handle's slot is reused: its counts became lists
        buf.dispatch(x, idx, w)
    assert first.tokens_per_expert == TPE and first.handle.recv_counts == [5, 4]
    rows = torch.zeros(R, H, dtype=torch.bfloat16)
    log.clear()
    y = buf.combine(rows, first.handle)
    st = first.handle.state
    assert names(log) == ["combine"] and y.shape == (T, H) and y.dtype == torch.bfloat16
    assert dict(log)["combine"] == (rows.data_ptr(), st.send_pos.data_ptr(), st.recv_off.data_ptr(),
                                    st.recv_src.data_ptr(), y.data_ptr(), T, SMS, 0, stream.cuda_stream)
    buf._backend.combine_mode = "fused"  # read per call (the GPU tests switch it on a live buffer)
    log.clear()
    buf.combine(rows, first.handle)
    assert dict(log)["combine"][7] == 1
    buf.close()


def test_auto_combine_kernel_is_the_buffers_not_the_calls(gpu):
    """comm.combine_kernel auto is planned from comm.max_tokens_per_rank, which every rank shares, not from the call's
    token count: ranks with counts on either side of AUTO_COMBINE_MIN_TOKENS would otherwise run split and pull in
    one exchange, each waiting for flags the other never sets."""
    from ep_plugin.backends.nvlink.plan import AUTO_COMBINE_MIN_TOKENS, COMBINE_MODES, plan_combine_kernel
    log, _, _ = gpu
    big = 2 * AUTO_COMBINE_MIN_TOKENS
    buf = ep_plugin.EPBuffer(None, bench.config(max_tokens=big, num_experts=E, topk=K, dispatch_kernel="split"),
                             hidden=H)
    buf._backend.stage_beside_notify = False
    x, idx, w = inputs()  # T tokens, far below AUTO_COMBINE_MIN_TOKENS
    res = buf.dispatch(x, idx, w)
    rows = torch.zeros(res.x.shape[0], H, dtype=torch.bfloat16)
    want = COMBINE_MODES[plan_combine_kernel("auto", big, W, SMS)]
    assert want != COMBINE_MODES["split"]
    log.clear()
    buf.combine(rows, res.handle)
    assert dict(log)["combine"][7] == want
    buf.close()


@pytest.mark.parametrize("host_sync", [False, True])
def test_combine_stage_by_copy_engines(gpu, host_sync):
    """backend.combine_stage_copy_engine (an A/B knob, off by default): a pull combine whose dispatch's receive
    offsets are on the host (the pinned slot notify wrote, once its event is done; a host-synced dispatch's lists)
    goes to combine_copy_engine with the W + 1 offsets; off, with another combine kernel, or while notify may still
    run, the plain combine."""
    log, stream, _ = gpu
    buf = make_buf(host_sync=host_sync, combine_kernel="pull")
    x, idx, w = inputs()
    res = buf.dispatch(x, idx, w)
    rows = torch.zeros(res.x.shape[0], H, dtype=torch.bfloat16)
    log.clear()
    buf.combine(rows, res.handle)
    assert names(log) == ["combine"] and dict(log)["combine"][7] == 3  # off by default: the pull kernel's stager
    buf._backend.combine_stage_copy_engine = True
    log.clear()
    y = buf.combine(rows, res.handle)
    st = res.handle.state
    offs = [0] + [sum(res.handle.recv_counts[:i + 1]) for i in range(W)]
    assert names(log) == ["combine_copy_engine"]
    assert dict(log)["combine_copy_engine"] == (rows.data_ptr(), st.send_pos.data_ptr(), st.recv_off.data_ptr(),
                                                y.data_ptr(), T, SMS, stream.cuda_stream, offs)
    if not host_sync:
        assert offs == RECV_OFF
    buf._backend.combine_mode = "fused"  # another kernel: its own stage
    log.clear()
    buf.combine(rows, res.handle)
    assert names(log) == ["combine"]
    buf._backend.combine_mode = "pull"
    if not host_sync:  # notify not known to be done: no host read, the kernel stages
        res2 = buf.dispatch(x, idx, w)
        res2.handle.counts._event.query = lambda: False
        log.clear()
        buf.combine(rows, res2.handle)
        assert names(log) == ["combine"]
    buf.close()


def test_cached_dispatch(gpu):
    log, stream, _ = gpu
    buf = make_buf()
    x, idx, w = inputs()
    h = buf.dispatch(x, idx, w).handle
    log.clear()
    c = buf.dispatch(x, None, w, handle=h)
    assert names(log) == ["stage", "pull"]
    st = h.state
    assert launches(log)["stage"] == (x.data_ptr(), T, H * 2, 0, 0, h.topk_idx.data_ptr(), w.data_ptr(), K, SMS, 0,
                                      stream.cuda_stream)
    assert launches(log)["pull"] == (c.x.data_ptr(), H * 2, 0, 0, 0, c.topk_weights.data_ptr(), K, st.recv_off.data_ptr(),
                                 st.recv_src.data_ptr(), 1, R, SMS, stream.cuda_stream)
    assert c.x.shape == (R, H) and c.topk_weights.shape == (R, K) and c.topk_idx is h.recv_topk_idx
    log.clear()
    c2 = buf.dispatch(x, handle=h)
    assert c2.topk_weights is None and launches(log)["stage"][5:7] == (0, 0) and launches(log)["pull"][5] == 0
    buf.close()


@pytest.mark.parametrize("kernel", ["split", "fused"])
def test_dispatch_scattered_passes_its_index(gpu, kernel):
    """dispatch_scattered (the hierarchical backend's cached dispatch in contract order) is a cached rank-major
    dispatch whose pull gets the index (out_rows, last); the plain cached dispatch passes none. Wrong indexes and
    expert-major handles are refused before any launch."""
    log, stream, _ = gpu
    buf = make_buf(dispatch_kernel=kernel)
    be = buf._backend
    x, idx, w = inputs()
    h = buf.dispatch(x, idx, w).handle
    st = h.state
    rows = torch.randperm(R)
    log.clear()
    c = be.dispatch_scattered(x, None, w, h, rows)
    assert names(log) == (["stage_pull"] if kernel == "fused" else ["stage", "pull"])
    assert be._rt.out_rows == rows.data_ptr()
    assert launches(log)["pull"] == (c.x.data_ptr(), H * 2, 0, 0, 0, c.topk_weights.data_ptr(), K,
                                     st.recv_off.data_ptr(), st.recv_src.data_ptr(), 1, R, SMS, stream.cuda_stream)
    assert c.x.shape == (R, H) and c.topk_weights.shape == (R, K) and c.topk_idx is None  # ids: the caller's order
    buf.dispatch(x, None, w, handle=h)
    assert be._rt.out_rows == 0
    log.clear()
    with pytest.raises(TypeError, match="out_rows must be a contiguous 1-D int64"):
        be.dispatch_scattered(x, None, w, h, rows.int())
    with pytest.raises(ValueError, match=f"out_rows has {R - 1} entries"):
        be.dispatch_scattered(x, None, w, h, rows[:-1])
    eh = buf.dispatch(x, idx, w, layout="expert").handle
    log.clear()
    with pytest.raises(ValueError, match="expert-major"):
        be.dispatch_scattered(x, None, w, eh, rows)
    assert log == []
    buf.close()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("inside", [True, False])
def test_dispatch_contract_passes_its_outputs(gpu, fp8, inside):
    """dispatch_contract (the hierarchical backend's fresh dispatch in contract order) is one stage_pull_contract
    with the plain fused dispatch's pointers plus the node count, the index and the counts it returns, notify inside
    it with notify_inside_contract (the default since session 18; given notify's pointers and the counts' pinned slot
    as the separate notify would be; off: notify first); every call that would not run the fused bulk-copy pull is refused before any launch
    (dispatch_contract_fits says False there)."""
    log, stream, _ = gpu
    buf = make_buf(dispatch_kernel="fused")
    be = buf._backend
    assert be.notify_inside_contract  # on by default (session 18's GPU run)
    be.notify_inside_contract = inside
    rt = be._rt
    x, idx, w = inputs(fp8)
    xr, sc = x if fp8 else (x, None)
    assert be.dispatch_contract_fits(xr, sc, 2)
    got = be.dispatch_contract(xr, sc, idx, w, 2)
    res, st = got.out, got.out.handle.state
    assert names(log) == ["notify", "stage_pull_contract"]  # the fake logs notify inside as the notify it stands for
    assert rt.inside_launches == (1 if inside else 0)
    assert launches(log)["stage_pull_contract"] == (
        xr.data_ptr(), T, H * xr.element_size(), ptr(sc), H // 128 if fp8 else 0, idx.data_ptr(), w.data_ptr(), K,
        res.x.data_ptr(), ptr(res.scales), res.topk_idx.data_ptr(), res.topk_weights.data_ptr(),
        st.recv_off.data_ptr(), st.recv_src.data_ptr(), R, 2, got.to_contract.data_ptr(), got.recv_counts.data_ptr(),
        SMS, stream.cuda_stream)
    notified = launches(log)["notify"]  # the same pointers either way: send_pos, is_in, recv_off, tpe, pinned slot
    assert notified[:3] == (idx.data_ptr(), T, K)
    assert notified[3:7] == (st.send_pos.data_ptr(), res.handle.is_token_in_rank.data_ptr(), st.recv_off.data_ptr(),
                             res.handle.num_tokens_per_expert.data_ptr())
    assert res.handle.counts is not None
    assert got.to_contract.shape == (R,) and got.to_contract.dtype == torch.int64
    assert got.recv_counts.shape == (2 * W,) and got.recv_counts.dtype == torch.int64
    assert res.handle.num_recv == R and res.x.shape[0] == R
    assert not be.dispatch_contract_fits(xr, sc, 3)  # 3 nodes do not split max_tokens (16) into slot blocks
    be._rt.tma = False  # the register pull: the path before
    assert not be.dispatch_contract_fits(xr, sc, 2)
    be._rt.tma = True
    for comm in ({"dispatch_kernel": "split"}, {"dispatch_kernel": "fused", "host_sync": True}):
        other = make_buf(**comm)
        log.clear()
        assert not other._backend.dispatch_contract_fits(xr, sc, 2)
        with pytest.raises(ValueError, match="dispatch_contract runs the fused bulk-copy pull only"):
            other._backend.dispatch_contract(xr, sc, idx, w, 2)
        assert log == []
        other.close()
    buf.close()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("inside", [True, False])
def test_fused_dispatch_kernel(gpu, fp8, inside):
    """comm.dispatch_kernel fused: a rank-major dispatch without host sync, and a cached one, launch
    stage and pull as one stage_pull with the same pointers, the fresh one with notify inside it (one
    notify_stage_pull launch, given notify's pointers as the separate notify would be; notify_inside False:
    notify first); host-synced and expert-major ones do not."""
    log, stream, _ = gpu
    buf = make_buf(dispatch_kernel="fused")
    buf._backend.notify_inside = inside
    rt = buf._backend._rt
    x, idx, w = inputs(fp8)
    res = buf.dispatch(x, idx, w)
    assert names(log) == ["notify", "stage_pull"]  # the fake logs notify_stage_pull as the two it stands for
    assert rt.inside_launches == (1 if inside else 0)
    check_fresh_tensors(res, stream.cuda_stream, log, R, x, w)
    st = res.handle.state
    out, out_s = res.x if fp8 else (res.x, None)
    assert launches(log)["pull"] == (out.data_ptr(), H * out.element_size(), ptr(out_s), H // 128 if fp8 else 0,
                                     res.topk_idx.data_ptr(), res.topk_weights.data_ptr(), K,
                                     st.recv_off.data_ptr(), st.recv_src.data_ptr(), 0, R, SMS, stream.cuda_stream)
    log.clear()
    c = buf.dispatch(x, None, w, handle=res.handle)
    assert names(log) == ["stage_pull"]
    out, out_s = c.x if fp8 else (c.x, None)
    assert launches(log)["pull"] == (out.data_ptr(), H * out.element_size(), ptr(out_s), H // 128 if fp8 else 0, 0,
                                     c.topk_weights.data_ptr(), K, st.recv_off.data_ptr(), st.recv_src.data_ptr(), 1,
                                     R, SMS, stream.cuda_stream)
    log.clear()
    buf.dispatch(x, idx, w, layout="expert")
    assert names(log) == ["notify", "stage", "expert_pull"]
    assert rt.inside_launches == (1 if inside else 0)  # cached and expert-major: never inside
    buf.close()
    buf = make_buf(dispatch_kernel="fused", host_sync=True)
    log.clear()
    buf.dispatch(x, idx, w)
    assert names(log) == ["notify", "stage", "pull"]
    buf.close()


def test_fp8_rows(gpu):
    log, stream, _ = gpu
    buf = make_buf()
    (data, scales), idx, w = inputs(fp8=True)
    res = buf.dispatch((data, scales), idx, w)
    out, out_s = res.x
    assert out.dtype == torch.float8_e4m3fn and out.shape == (R, H)
    assert out_s.dtype == torch.float32 and out_s.shape == (R, H // 128) and out_s.is_contiguous()
    check_fresh_tensors(res, stream.cuda_stream, log, R, (data, scales), w)
    pull = launches(log)["pull"]
    assert pull[:4] == (out.data_ptr(), H, out_s.data_ptr(), H // 128)
    log.clear()
    c = buf.dispatch((data, scales), handle=res.handle)
    assert c.x[1].shape == (R, H // 128) and launches(log)["pull"][2:4] == (c.x[1].data_ptr(), H // 128)
    buf.close()


@pytest.mark.parametrize("host_sync", [False, True])
def test_expert_major(gpu, host_sync):
    log, stream, _ = gpu
    buf = make_buf(host_sync=host_sync)
    x, idx, w = inputs()
    a = 4
    res = buf.dispatch(x, idx, w, layout="expert", expert_alignment=a)
    h = res.handle
    rows = h.num_recv
    n = expert_major.capacity(rows, K, E_L, a, None if not host_sync else h.tokens_per_expert)
    # nothing before notify: the kernels merge repeated experts (notify counts, stage stages them merged),
    # so the ids and weights go as given and the handle keeps the caller's ids
    assert names(log) == ["notify", "stage", "expert_pull"]
    assert h.topk_idx is idx and h.given_topk_idx is None
    check_fresh_tensors(res, stream.cuda_stream, log, rows, x, w, merge=1)
    lay, st = h.expert, h.state
    assert res.x.shape == (n, H) and res.topk_weights.shape == (n,) and lay.num_rows == n and lay.alignment == a
    assert lay.positions.shape == (rows, K) and lay.positions.dtype == torch.int32
    assert lay.offsets.shape == (E_L + 1,) and lay.offsets.dtype == torch.int64
    args = dict(log)["expert_pull"]
    assert args[:13] == (res.x.data_ptr(), H * 2, 0, 0, h.recv_topk_idx.data_ptr(), res.topk_weights.data_ptr(), K,
                         st.recv_off.data_ptr(), st.recv_src.data_ptr(), lay.positions.data_ptr(), 0, rows, a)
    assert args[14:] == (lay.offsets.data_ptr(), h.num_tokens_per_expert.data_ptr(), SMS, stream.cuda_stream)
    assert args[13] != 0
    for _ in range(3):
        buf.dispatch(x, idx, w, layout="expert", expert_alignment=a)
    assert FillingRuntime.scratch_calls == 1  # the scratch size is asked once per SM count
    buf._backend.num_sms = 8
    buf.dispatch(x, idx, w, layout="expert", expert_alignment=a)
    assert FillingRuntime.scratch_calls == 2
    buf._backend.num_sms = SMS
    log.clear()
    c = buf.dispatch(x, idx, w, handle=h)  # cached with weights: staged merged over the handle's ids
    assert names(log) == ["stage", "expert_pull"]
    assert launches(log)["stage"] == (x.data_ptr(), T, H * 2, 0, 0, idx.data_ptr(), w.data_ptr(), K, SMS, 1,
                                      stream.cuda_stream)
    assert dict(log)["expert_pull"][5] == c.topk_weights.data_ptr() and c.topk_weights.shape == (n,)
    log.clear()
    c = buf.dispatch(x, handle=h)  # cached: straight to the handle's positions
    assert names(log) == ["stage", "expert_pull"] and c.x.shape == (n, H)
    args = dict(log)["expert_pull"]
    assert args == (c.x.data_ptr(), H * 2, 0, 0, 0, 0, K, st.recv_off.data_ptr(), st.recv_src.data_ptr(),
                    lay.positions.data_ptr(), 1, rows, a, 0, lay.offsets.data_ptr(),
                    h.num_tokens_per_expert.data_ptr(), SMS, stream.cuda_stream)
    log.clear()
    y = buf.combine(torch.zeros(n, H, dtype=torch.bfloat16), h)
    assert names(log) == ["combine_expert"] and y.shape == (T, H)
    assert dict(log)["combine_expert"][1:] == (lay.positions.data_ptr(), K, st.send_pos.data_ptr(),
                                               st.recv_off.data_ptr(), y.data_ptr(), T, SMS, stream.cuda_stream)
    buf.close()


def _expert_rows(buf):
    """An expert-major dispatch's handle, its nvlink state and layout, and zero rows of its layout to combine."""
    x, idx, w = inputs()
    h = buf.dispatch(x, idx, w, layout="expert").handle
    return h, h.state, h.expert, torch.zeros(h.expert.num_rows, H, dtype=torch.bfloat16)


def test_expert_combine_stages_by_the_sum_under_the_pull_kernel(gpu):
    """combine of expert-major rows under the pull kernel: one combine_expert_staged launch (the expert sum as the
    pull kernel's stage, beside it), on num_sms SMs, y from the spares; async on the side stream."""
    log, stream, _ = gpu
    buf = make_buf(combine_kernel="pull")
    h, st, lay, ex = _expert_rows(buf)
    log.clear()
    y = buf.combine(ex, h)
    assert names(log) == ["combine_expert_staged"] and y.shape == (T, H)
    assert dict(log)["combine_expert_staged"] == (ex.data_ptr(), lay.positions.data_ptr(), K, st.send_pos.data_ptr(),
                                                  st.recv_off.data_ptr(), y.data_ptr(), T, SMS, stream.cuda_stream)
    log.clear()
    y, ev = buf.combine(ex, h, async_op=True)
    assert names(log) == ["combine_expert_staged"] and ev is not None
    assert dict(log)["combine_expert_staged"][-1] != stream.cuda_stream
    ev.current_stream_wait()
    buf._backend._combine_sms = buf._backend._gpu_sms  # no SM left for the sum beside the pull kernel: sum first
    log.clear()
    buf.combine(ex, h)
    assert names(log) == ["expert_sum", "combine"]
    buf.close()


def test_expert_combine_sums_first_under_the_pull_kernel(gpu):
    """combine of expert-major rows under a combine kernel other than split, expert_sum_beside off: each row's local
    experts summed into rank-major rows on the whole GPU (expert_sum), then the planned kernel on num_sms SMs;
    expert_sum_first False (or the split kernels) keeps the send-side sum (combine_expert)."""
    log, stream, _ = gpu
    buf = make_buf(combine_kernel="pull")
    be = buf._backend
    be.expert_sum_beside = False
    h, st, lay, ex = _expert_rows(buf)
    log.clear()
    y = buf.combine(ex, h)
    assert names(log) == ["expert_sum", "combine"] and y.shape == (T, H)
    xs, pos, k, off, rows, blocks, sp = dict(log)["expert_sum"]
    assert (xs, pos, k, off, blocks, sp) == (ex.data_ptr(), lay.positions.data_ptr(), K, st.recv_off.data_ptr(),
                                             be._gpu_sms, stream.cuda_stream)
    comb = dict(log)["combine"]
    assert comb[0] == rows and comb[4] == y.data_ptr() and comb[6:8] == (SMS, 3)  # the rows summed, pull, num_sms
    log.clear()
    y, ev = buf.combine(ex, h, async_op=True)  # async: both launches on the side stream, the event after them
    assert names(log) == ["expert_sum", "combine"] and ev is not None
    assert dict(log)["expert_sum"][-1] == dict(log)["combine"][8] != stream.cuda_stream
    ev.current_stream_wait()
    for sum_first, mode in ((False, "pull"), (True, "split")):
        be.expert_sum_first, be.combine_mode = sum_first, mode
        log.clear()
        buf.combine(ex, h)
        assert names(log) == ["combine_expert"], (sum_first, mode)
    buf.close()


def test_expert_major_weights_with_grad(gpu):
    """Weights whose gradient is recorded go through expert_major.repeats_share_grad before notify: a view
    (no op, the kernels merge the values), whose backward gives each slot its expert's gradient; a cached
    dispatch's the same, over the handle's ids; rank-major ones are never merged."""
    log, stream, _ = gpu
    buf = make_buf()
    x, idx, w = inputs()
    idx[1, 2] = idx[1, 0]  # a repeated expert
    w.requires_grad_(True)
    res = buf.dispatch(x, idx, w, layout="expert")
    assert names(log) == ["notify", "stage", "expert_pull"]
    st = launches(log)["stage"]
    assert st[6] == w.data_ptr() and st[9] == 1 and dict(log)["notify"][9] == 1
    assert res.handle.topk_idx is idx and res.topk_weights.requires_grad  # the gradients: test_layout, test_nvlink
    log.clear()
    c = buf.dispatch(x, idx, w, handle=res.handle)
    st = launches(log)["stage"]
    assert st[6] == w.data_ptr() and st[9] == 1 and c.topk_weights.requires_grad
    log.clear()
    with torch.no_grad():  # nothing recorded: the weights as given
        buf.dispatch(x, idx, w, layout="expert")
    assert launches(log)["stage"][6] == w.data_ptr() and launches(log)["stage"][9] == 1
    log.clear()
    r = buf.dispatch(x, idx, w)  # rank-major: repeats stay, as the contract says
    assert launches(log)["stage"][6] == w.data_ptr() and launches(log)["stage"][9] == 0
    assert dict(log)["notify"][9] == 0
    log.clear()
    buf.dispatch(x, idx, w, handle=r.handle)
    assert launches(log)["stage"][6] == w.data_ptr() and launches(log)["stage"][9] == 0
    buf.close()


@pytest.mark.parametrize("host_sync", [False, True])
def test_stage_beside_notify(gpu, host_sync):
    """backend.stage_beside_notify (on by default): a fresh split rank-major dispatch forks the copy-engine stage's
    side stream before notify (stage_fork), launches notify, then queues the stage's wait and copies from that fork
    (stage_begin, the stage's own arguments) and its release behind notify (stage_end), then the pull; expert-major
    dispatches (merged ids: the stage kernel) and cached ones do not."""
    log, stream, _ = gpu
    buf = make_buf(default_stage=True, host_sync=host_sync)
    assert buf._backend.stage_beside_notify
    x, idx, w = inputs()
    res = buf.dispatch(x, idx, w)
    assert names(log) == ["stage_fork", "notify", "stage_begin", "stage_end", "pull"]
    sp = stream.cuda_stream
    assert dict(log)["stage_begin"] == (x.data_ptr(), T, H * 2, 0, 0, idx.data_ptr(), w.data_ptr(), K, sp)
    assert dict(log)["stage_end"] == (sp,)
    log.clear()
    buf.dispatch(x, None, w, handle=res.handle)
    assert names(log) == ["stage", "pull"]
    log.clear()
    buf.dispatch(x, idx, w, layout="expert")
    assert names(log) == ["notify", "stage", "expert_pull"]
    log.clear()
    buf._backend._rt.stage_copy_engine = False  # the stage kernel: after notify, as ever
    buf.dispatch(x, idx, w)
    assert names(log) == ["notify", "stage", "pull"]
    buf.close()


def test_host_sync_sizes_exactly(gpu):
    log, stream, _ = gpu
    buf = make_buf(host_sync=True)
    x, idx, w = inputs()
    res = buf.dispatch(x, idx, w)
    rows, send, recv, tpe, _ = buf._backend._rt.results()
    assert names(log) == ["notify", "stage", "pull"]
    check_fresh_tensors(res, stream.cuda_stream, log, rows, x, w)
    h = res.handle
    assert h.exact and h.num_recv == rows and res.x.shape == (rows, H) and dict(log)["pull"][10] == rows
    assert h.send_counts == send and h.recv_counts == recv and res.tokens_per_expert == tpe
    buf.close()


def test_capture_sizes_for_the_worst_case_and_copies_nothing(gpu, monkeypatch):
    log, stream, _ = gpu
    buf = make_buf(host_sync=True)  # capture overrides host_sync
    x, idx, w = inputs()
    ring = buf._backend._ring
    before = ring._next
    monkeypatch.setattr(nvl, "_is_capturing", lambda: True)
    res = buf.dispatch(x, idx, w)
    assert res.x.shape == (R, H) and not res.handle.exact and res.handle.num_recv == R
    assert ring._next == before  # no pinned slot taken, no copy
    with pytest.raises(RuntimeError, match="CUDA graph"):
        res.tokens_per_expert
    monkeypatch.undo()
    buf.close()


def test_streams_and_async(gpu):
    log, stream, tally = gpu
    buf = make_buf()
    be = buf._backend
    x, idx, w = inputs()
    res = buf.dispatch(x, idx, w)
    first = be._current()[0]
    buf.dispatch(x, idx, w)
    assert be._current()[0] is first and first == stream  # one Stream object while the stream is current
    made = tally["current_stream"]
    stream.cuda_stream = 0x7000  # another stream becomes current: launches go there
    log.clear()
    buf.dispatch(x, idx, w)
    assert all(c[1][-1] == 0x7000 for c in log) and tally["current_stream"] == made + 1
    # async: the communication stream (notify writes the pinned counts: no copy, no stream switched to),
    # an event; then a synchronous call on the current stream waits for it
    bench.FakeStreamContext.entered = []
    try:
        log.clear()
        a = buf.dispatch(x, idx, w, async_op=True)
        comm = be._comm_stream
        assert comm.cuda_stream != stream.cuda_stream and all(c[1][-1] == comm.cuda_stream for c in log)
        assert bench.FakeStreamContext.entered == []
        assert a.event is not None and a.handle.counts._event.recorded is comm
        assert tally["record_stream"] == 11  # every input and output, the handle's tensors too
        a.event.current_stream_wait()
        assert a.tokens_per_expert == TPE
        ev = be._tail[1]
        cur = be._current()[0]
        n = len(cur.waited_events)
        log.clear()
        y = buf.combine(torch.zeros(R, H, dtype=torch.bfloat16), a.handle)
        assert cur.waited_events[n:] == [ev] and be._tail is None and dict(log)["combine"][-1] == 0x7000
        log.clear()
        y, ev2 = buf.combine(torch.zeros(R, H, dtype=torch.bfloat16), a.handle, async_op=True)
        assert ev2 is not None and dict(log)["combine"][-1] == comm.cuda_stream and be._tail[0] is comm
    finally:
        bench.FakeStreamContext.entered = None
    del res, y
    buf.close()


def test_call_tensors_made_ahead_serve_the_same_form_and_stream_only(gpu, monkeypatch):
    """What a call's kernels write -- notify's tensors, a dispatch's outputs, a combine's sums -- is made at the
    end of the previous call of the same form (spares.py), once that form came twice in a row: the cold call's
    launches wait on no allocation. Used only for that form, on the same current stream, outside a capture;
    every call still returns tensors of its own (and each handle keeps its own)."""
    log, stream, _ = gpu
    buf = make_buf()
    be = buf._backend
    x, idx, w = inputs()

    def launched():  # (notify's four pointers, the pull's rows pointer) of the last dispatch
        d = dict(log)
        return d["notify"][3:7], d["pull"][0]

    def made():
        sets = be._spares._sets
        n = sets["notify"][2][1] if "notify" in sets else None
        r = sets["rows"][2][1][0] if "rows" in sets else None
        return n, r

    a = buf.dispatch(x, idx, w)
    assert len(be._spares) == 0  # a form seen once leaves nothing behind
    b = buf.dispatch(x, idx, w)
    ahead = made()
    assert None not in ahead
    log.clear()
    c = buf.dispatch(x, idx, w)
    assert launched() == ahead and c.x.data_ptr() == ahead[1]  # both served
    assert len({r.handle.state.send_pos.data_ptr() for r in (a, b, c)}) == 3
    assert len({r.x.data_ptr() for r in (a, b, c)}) == 3 and a.tokens_per_expert == c.tokens_per_expert
    # another token count: notify's tensors fresh (then made for it); the worst-case rows do not depend on T
    ahead = made()
    small = (x[:4].contiguous(), idx[:4].contiguous(), w[:4].contiguous())
    log.clear()
    buf.dispatch(*small)
    got = launched()
    assert got[0] != ahead[0] and got[1] == ahead[1] and "notify" not in be._spares._sets
    buf.dispatch(*small)
    assert be._spares._sets["notify"][0][0] == 4
    # another current stream: fresh tensors
    buf.dispatch(x, idx, w)
    buf.dispatch(x, idx, w)
    ahead, keep = made(), dict(be._spares._sets)  # kept: their memory cannot come back as the fresh tensors
    stream.cuda_stream = 0x9000
    log.clear()
    buf.dispatch(x, idx, w)
    got = launched()
    assert got[0] != ahead[0] and got[1] != ahead[1] and dict(log)["notify"][-1] == 0x9000
    buf.dispatch(x, idx, w)
    del keep
    # a capture neither takes nor makes one (nor frees one) ...
    ahead, sets = made(), dict(be._spares._sets)
    monkeypatch.setattr(nvl, "_is_capturing", lambda: True)
    log.clear()
    buf.dispatch(x, idx, w)
    got = launched()
    assert got[0] != ahead[0] and got[1] != ahead[1] and be._spares._sets == sets
    monkeypatch.undo()
    # ... and the next dispatch outside it takes them
    log.clear()
    buf.dispatch(x, idx, w)
    assert launched() == ahead and be._spares._sets["rows"] is not sets["rows"]
    # a cached dispatch is another form: the fresh rows go, its own come once it repeats
    res = buf.dispatch(x, idx, w)
    log.clear()
    one = buf.dispatch(x, handle=res.handle)
    assert dict(log)["pull"][0] == one.x.data_ptr() and "rows" not in be._spares._sets
    buf.dispatch(x, handle=res.handle)
    ahead = be._spares._sets["rows"][2][1][0]
    log.clear()
    three = buf.dispatch(x, handle=res.handle)
    assert dict(log)["pull"][0] == three.x.data_ptr() == ahead
    # a combine's sums, likewise
    rows = torch.zeros(R, H, dtype=torch.bfloat16)
    buf.combine(rows, res.handle)
    y2 = buf.combine(rows, res.handle)
    ahead = be._spares._sets["sums"][2].data_ptr()
    log.clear()
    y3 = buf.combine(rows, res.handle)
    assert y3.data_ptr() == ahead == dict(log)["combine"][4] and y2.data_ptr() != ahead
    buf.close()
    assert len(be._spares) == 0
    # host-synced outputs have their exact size: no rows made ahead, fresh or cached (the sums still are)
    buf = make_buf(host_sync=True)
    for _ in range(3):
        res = buf.dispatch(x, idx, w)
        buf.dispatch(x, handle=res.handle)
        buf.combine(rows[:res.x.shape[0]].contiguous(), res.handle)
        buf.combine(rows[:res.x.shape[0]].contiguous(), res.handle)
    assert "rows" not in buf._backend._spares._sets and "sums" in buf._backend._spares._sets
    buf.close()
    # comm.spare_outputs: false makes none
    buf = make_buf(spare_outputs=False)
    for _ in range(3):
        res = buf.dispatch(x, idx, w)
        buf.combine(rows, res.handle)
    assert len(buf._backend._spares) == 0
    buf.close()


def test_runtime_errors_are_raised(gpu):
    log, stream, _ = gpu
    buf = make_buf()
    x, idx, w = inputs()
    res = buf.dispatch(x, idx, w)
    rt = buf._backend._rt
    rt.bad_ids = 1
    with pytest.raises(ValueError, match="topk_idx values must lie"):
        buf.dispatch(x, idx, w)
    buf.dispatch(x, idx, w)  # reported once
    rt.err = 1
    log.clear()
    for _ in range(2):  # the buffer stays failed
        with pytest.raises(EPTimeoutError) as info:
            buf.combine(torch.zeros(R, H, dtype=torch.bfloat16), res.handle)
        assert info.value.missing_ranks == (1,)
    with pytest.raises(EPTimeoutError):
        buf._backend.dispatch(x, None, idx, w)  # the backend alone (autograd's path) checks too
    assert log == []
    rt.err = 0
    buf.close()


def test_backend_refuses_before_any_launch(gpu):
    log, _, _ = gpu
    buf = make_buf()
    x, idx, w = inputs()
    with pytest.raises(ValueError, match="topk <= 32"):
        buf._backend.dispatch(x, None, torch.zeros(T, 40, dtype=torch.int64), None)
    with pytest.raises(TypeError, match="FP8 dispatch needs"):
        buf._backend.dispatch(x.to(torch.float8_e4m3fn), None, idx, None)
    assert log == []
    buf.close()


def test_a_passed_form_lets_no_other_form_through(gpu):
    """The checks of a repeated call form are one lookup (checks.calls.fresh); each argument that differs
    from a form that passed is still refused, before any launch, with the full check's error."""
    log, _, _ = gpu
    buf = make_buf()
    x, idx, w = inputs()
    xf8 = (x.to(torch.float8_e4m3fn), torch.rand(T, H // 128))
    buf.dispatch(x, idx, w)
    buf.dispatch(xf8, idx, w)
    buf.dispatch(x, idx)
    log.clear()
    bad = [((x.double(), idx, w), {}, TypeError, "float32, bfloat16 or float16"),
           ((x.t().contiguous().t(), idx, w), {}, ValueError, "x must be contiguous"),
           ((x[:, :H // 2], idx, w), {}, ValueError, "shape"),
           ((x, idx.int(), w), {}, TypeError, "int64"),
           ((x, idx, w.double()), {}, TypeError, "float32"),
           ((x, idx, w[:, :2]), {}, ValueError, "topk_weights must have topk_idx's shape"),
           ((x, idx[:4], w[:4]), {}, ValueError, "topk_idx must have shape"),
           ((x, idx.t().contiguous().t(), w), {}, ValueError, "contiguous"),
           (((xf8[0], xf8[1][:, :1]), idx, w), {}, ValueError, "FP8 scales"),
           (((xf8[0], xf8[1].double()), idx, w), {}, TypeError, "FP8 scales"),
           ((x, idx, w), {"layout": "experts"}, ValueError, "layout must be one of"),
           ((x, idx, w), {"layout": "expert", "expert_alignment": 0}, ValueError, "expert_alignment"),
           ((x, idx, w), {"expert_alignment": 1.0}, ValueError, "expert_alignment"),
           ((x, None, w), {}, ValueError, "topk_idx is required")]
    for args, kw, exc, match in bad:
        with pytest.raises(exc, match=match):
            buf.dispatch(*args, **kw)
    assert log == []
    for _ in range(2):  # and the forms that passed still pass
        buf.dispatch(x, idx, w)
        buf.dispatch(xf8, idx, w)
    assert names(log).count("notify") == 4
    buf.close()


def test_bench_runs(solo, capsys):
    bench.main(["-n", "3", "--repeats", "1", "--tokens", "128", "--modes", "bf16", "bf16 async", "-v"])
    out = capsys.readouterr().out
    assert "HOST OVERHEAD ONLY" in out and out.count("current ") == 2 and "stand-in calls" in out
    assert "cProfile" in out and "function calls" in out


def test_num_sms_replans_the_dispatch_kernel(gpu):
    """Setting the backend's num_sms (the benches' SM sweeps, the deep_ep shim's Config.num_sms) plans
    comm.dispatch_kernel auto for the new count, as a buffer built for it would (split at EP2 up to 16 SMs); a
    kernel the config names stays."""
    for requested, want in (("auto", {8: "split", 16: "split", 24: "fused", 48: "fused"}),
                            ("fused", {8: "fused", 48: "fused"})):
        be = make_buf(dispatch_kernel=requested)._backend
        for sms, kernel in want.items():
            be.num_sms = sms
            assert (be.num_sms, be.dispatch_mode) == (sms, kernel), (requested, sms)
        be.close()


def test_kernel_sms_caps_reach_the_launches(gpu, monkeypatch):
    """plan.KERNEL_SMS_CAP's counts reach the stage_pull and pull-combine launches (the fakes' world stands in for
    EP4, whose caps they are); every other launch keeps num_sms, and a new num_sms replans both."""
    log = gpu[0]
    monkeypatch.setitem(nvl_plan.KERNEL_SMS_CAP, W, {"stage_pull": 6, "pull": 10})
    buf = make_buf(dispatch_kernel="fused", combine_kernel="pull")
    be = buf._backend
    x, idx, w = inputs()
    for sms, stage_pull_sms, pull_sms in ((SMS, 6, 10), (8, 6, 8), (4, 4, 4)):
        be.num_sms = sms
        log.clear()
        res = buf.dispatch(x, idx, w)
        assert launches(log)["stage"][8] == stage_pull_sms
        log.clear()
        buf.combine(torch.randn(res.x.shape[0], H).to(torch.bfloat16), res.handle)
        assert dict(log)["combine"][6] == pull_sms, sms
    be.combine_mode = "pipelined"  # a push combine: not capped
    log.clear()
    buf.combine(torch.randn(res.x.shape[0], H).to(torch.bfloat16), res.handle)
    assert dict(log)["combine"][6] == 4
    buf.close()
